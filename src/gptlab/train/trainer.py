"""The Trainer: a run's state, one optimizer update (`step`), and the loop (`run`)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from gptlab import run_files
from gptlab.data import read_manifest
from gptlab.tokenizer import get_tokenizer
from gptlab.train import checkpointing, evaluation, setup
from gptlab.train.evaluation import forward_loss
from gptlab.train.guards import SpikeGuard
from gptlab.train.precision import autocast, resolve_precision
from gptlab.train.schedule import TimeBudget, lr_at, parse_duration
from gptlab.train_config import TrainConfig

log = logging.getLogger(__name__)


class Trainer:
    """Holds the state of one run; `step()` does one optimizer update, `run()` the whole loop.

    `clock` (seconds, monotonic) measures the `max_time` budget; tests pass a fake one.
    """

    def __init__(self, cfg: TrainConfig, clock: Callable[[], float] = time.perf_counter):
        self.cfg, self.out_dir = cfg, Path(cfg.out_dir)
        max_time = parse_duration(cfg.max_time)
        manifest = read_manifest(cfg.data_dir)  # a missing data directory fails before anything is written
        self.tokenizer_name = manifest["tokenizer"]
        on_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
        self.dist = setup.init_distributed("cuda" if on_cuda else "cpu")
        self.device = setup.resolve_device(cfg, self.dist)
        if self.device.type == "cpu" and setup.keep_freed_memory():
            log.debug("malloc: freed memory kept for reuse (%s)", setup.MALLOC_SETTINGS)
        setup.check_out_dir(self.out_dir, cfg.resume)
        setup.check_tokenizer(cfg, manifest)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        # a LoRA run's base, resolved once: the checkpoint init_from names as the base is loaded
        self.lora_base = checkpointing.lora_base(cfg.init_from) if cfg.lora_rank else None
        labels = manifest["labels"] if manifest.get("kind") == "classify" else None
        pad = get_tokenizer(self.tokenizer_name).eot_token  # a new classifier's pad_token_id
        self.raw_model = setup.build_model(cfg, manifest["vocab_size"], self.device, labels, pad).train()
        setup.check_tokens(cfg.data_dir, manifest, self.raw_model.config.vocab_size)
        # rank 0 measures precision=auto, and caches its timings; the others take its choice
        self.precision, why = setup.decided_on_rank0(self.dist, self.device, lambda: resolve_precision(
            cfg.precision, self.device, self.raw_model, (cfg.batch_size, cfg.block_size)))  # fmt: skip
        log.info("precision: %s (%s)", str(self.precision).removeprefix("torch."), why)
        self.grad_accum = setup.grad_accum_steps(cfg, self.dist.world_size)
        self.train_loader, self.val_loader = setup.build_loaders(cfg, manifest, self.dist)
        self.model = setup.wrap_model(self.raw_model, cfg, self.dist, self.device)
        self.optimizer = setup.build_optimizer(self.raw_model, cfg, self.device, fused_ok=not cfg.fsdp)
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == torch.float16 else None
        self.guard = SpikeGuard(cfg.spike_zscore, cfg.spike_window, cfg.max_bad_steps)
        torch.manual_seed(cfg.seed + self.dist.rank)  # dropout streams differ per rank
        self.step_num, self.tokens_seen = 0, 0
        self.best_val: float | None = None
        self.last_checkpoint: Path | None = None
        spent = checkpointing.resume(self) if cfg.resume else 0.0
        self.budget = TimeBudget(max_time, clock, spent)

    @property
    def sharded(self) -> bool:
        return self.cfg.fsdp and self.dist.enabled

    # -- one update

    def step(self) -> dict:
        """One optimizer update over grad_accum micro-batches; returns its log record."""
        cfg, t0 = self.cfg, time.perf_counter()
        lr = lr_at(self.step_num, cfg, self.budget.fraction(self.agreed_elapsed()))
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        loss_sum, fed = torch.zeros((), device=self.device), 0
        for micro in range(self.grad_accum):
            batch = self.train_loader.next_batch()
            fed += batch[0].numel()  # (B, T): padded examples run to their batch's longest, not block_size
            sync = self._no_sync() if micro < self.grad_accum - 1 else nullcontext()
            with sync:
                with autocast(self.device, self.precision):
                    _, loss = forward_loss(self.model, batch, self.device)
                loss = loss / self.grad_accum
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += loss.detach().float()
        loss_value = self.mean_over_ranks(loss_sum)
        grad_norm = self._clip_gradients()
        skipped = self.guard.check(loss_value, grad_norm, self.step_num + 1, fp16_scaler=self.scaler is not None,
                                   last_checkpoint=self.last_checkpoint)  # fmt: skip
        if not skipped and self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_num += 1
        tokens = fed * self.dist.world_size  # every rank's batch as this one's (exact for token windows)
        self.tokens_seen += tokens
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return dict(step=self.step_num, tokens=self.tokens_seen, loss=loss_value, lr=lr, grad_norm=grad_norm,
                    skipped=skipped, tok_per_s=tokens / dt, step_s=dt)  # fmt: skip

    def _no_sync(self):
        return self.model.no_sync() if hasattr(self.model, "no_sync") else nullcontext()

    def agreed_elapsed(self) -> float:
        """Seconds the run has spent, the same on every rank (every rank calls it, in step): each
        rank's clock starts on its own, so under DDP with max_time the ranks take the largest
        reading, of the rank that started first. On their own clocks they took different learning
        rates and stopped at different steps, their collectives mismatched (a crash, nothing saved)."""
        seconds = self.budget.elapsed()
        if not (self.dist.enabled and self.budget.seconds is not None):
            return seconds
        import torch.distributed as dist

        value = torch.tensor(seconds, dtype=torch.float64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)

    def mean_over_ranks(self, value: torch.Tensor) -> float:
        if self.dist.enabled:
            import torch.distributed as dist

            value = value.clone()
            dist.all_reduce(value)
            value /= self.dist.world_size
        return float(value)

    def _clip_gradients(self) -> float:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
            norm = norm.full_tensor()
        return float(norm)

    # -- evaluation and checkpoints (gptlab.train.evaluation, .checkpointing)

    def evaluate(self) -> dict:
        return evaluation.evaluate(self)

    def sample(self) -> str:
        return evaluation.sample(self)

    def save_checkpoint(self) -> None:
        checkpointing.save_checkpoint(self)

    # -- the loop

    def finished(self) -> bool:
        """max_steps done, or the max_time budget spent (by the ranks' agreed clock)."""
        return self.step_num >= self.cfg.max_steps or self.budget.exhausted(self.agreed_elapsed())

    def run(self) -> dict:
        """Train to max_steps or max_time; evaluate, checkpoint and log on the way. Returns a summary."""
        cfg, main = self.cfg, self.dist.is_main
        from tqdm import tqdm

        metrics = (
            run_files.MetricsLog(self.out_dir, resume_step=self.step_num if cfg.resume else None) if main else None
        )
        total = None if self.budget.seconds else cfg.max_steps  # a time budget: the step count is not known
        bar = tqdm(total=total, initial=self.step_num, disable=not (main and cfg.progress), desc="train", unit="step")
        start_step, t0, record, last_eval = self.step_num, time.perf_counter(), {}, None
        # The loop ends on the decision taken after the step: the clock read again after a
        # periodic eval or checkpoint that spent the budget left without the final ones.
        at_end = self.finished()
        try:
            while not at_end:
                record = self.step()
                if main and (self.step_num % max(cfg.log_interval, 1) == 0 or record["skipped"]):
                    metrics.write(record)
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}",
                                tok_s=f"{record['tok_per_s']:,.0f}")  # fmt: skip
                at_end = self.finished()
                if main and at_end and self.step_num % max(cfg.log_interval, 1) and not record["skipped"]:
                    metrics.write(record)  # the last step is always logged
                evaluated = None  # this step's evaluation, of the weights a checkpoint now would hold
                if self.step_num % cfg.eval_interval == 0 or at_end:
                    last_eval = evaluated = self._eval_and_log(metrics, bar)
                if self.step_num % cfg.save_every == 0 or at_end:
                    self._save_if_sound(record["loss"], evaluated and evaluated["val_loss"])
        finally:
            bar.close()
            if metrics:
                metrics.close()
        plot = run_files.plot_losses(self.out_dir) if main else None
        last_eval = last_eval or {}
        return dict(step=self.step_num, tokens=self.tokens_seen, train_loss=record.get("loss"),
                    val_loss=last_eval.get("val_loss"), sample=last_eval.get("sample"),
                    val_accuracy=last_eval.get("val_accuracy"),
                    precision=str(self.precision).removeprefix("torch."),
                    checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
                    metrics=str(self.out_dir / run_files.METRICS), plot=str(plot) if plot else None,
                    seconds=time.perf_counter() - t0, steps_run=self.step_num - start_step)  # fmt: skip

    def _save_if_sound(self, loss: float, val_loss: float | None = None) -> None:
        """A checkpoint, unless the last step's loss or this step's validation loss (agreed by the
        ranks) was not finite: an update before the step, or the step's own, broke the weights
        (skipped updates leave them as they are), and their checkpoint was named "the last good
        checkpoint" by the guard and pushed good ones out. The step's loss is of the weights before
        its update: a checkpoint whose evaluation had just given NaN was written."""
        bad = next((x for x in (loss, val_loss) if x is not None and not math.isfinite(x)), None)
        if bad is None:
            self.save_checkpoint()
        elif self.dist.is_main:
            log.warning("step %d: no checkpoint: these weights give a loss of %s (the last good checkpoint is %s)",
                        self.step_num, bad, self.last_checkpoint or "none")  # fmt: skip

    def _eval_and_log(self, metrics, bar) -> dict:
        result = self.evaluate()
        if self.dist.is_main:
            self.best_val = result["val_loss"] if self.best_val is None else min(self.best_val, result["val_loss"])
            metrics.write({**result, "elapsed_s": self.budget.elapsed()})
            message = f"step {result['step']}: val loss {result['val_loss']:.4f} (ppl {result['val_ppl']:.1f})"
            if "val_accuracy" in result:
                message = (
                    f"step {result['step']}: val loss {result['val_loss']:.4f}, accuracy {result['val_accuracy']:.1%}"
                )
            if self.cfg.progress:
                bar.write(message)  # tqdm.write keeps the bar intact
            else:
                log.info(message)
            log.debug("sample: %r", result["sample"])
            run_files.plot_losses(self.out_dir)
        return result


def train(cfg: TrainConfig, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Run training as `cfg` says (one process, or one rank under torchrun); returns a summary."""
    trainer = Trainer(cfg, clock)
    try:
        return trainer.run()
    finally:
        if trainer.dist.enabled:
            import torch.distributed as dist

            dist.destroy_process_group()
