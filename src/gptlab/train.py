"""Training: `train(config)` for a `TrainConfig` (gptlab.train_config: every setting, one dataclass).

One process or many under torchrun (DDP, or FSDP with `fsdp=True`), with AdamW, warmup + cosine
(or constant, or warmup-stable-decay) learning rate, gradient accumulation and clipping, bf16/fp16
mixed precision, guards against divergence, periodic evaluation with a text sample, checkpoints
that resume bit-exactly, metrics as JSON lines and a loss plot. Files: see gptlab.run_files.

Weight decay applies to every matrix (2-D parameter: linear weights, the token embedding that is
also the head, and the position table, as nanoGPT and GPT-2 do) and never to biases and norm
gains.
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from gptlab import run_files
from gptlab.checkpoint import load_state_strict, save_model
from gptlab.config import GPTConfig
from gptlab.data import TokenLoader, read_manifest
from gptlab.loading import load_model
from gptlab.model import GPT
from gptlab.train_config import TrainConfig

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Too many bad steps (NaN/inf loss or gradient-norm spikes) in a row."""


# ---------------------------------------------------------------------------------------------
# Schedule


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for update `step` (0-based): linear warmup to cfg.lr over warmup_steps, then
    cosine to min_lr at max_steps, or constant, or constant then linear decay (wsd)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        decay_start = cfg.max_steps * (1 - cfg.decay_fraction)
        if step < decay_start:
            return cfg.lr
        progress = min(1.0, (step - decay_start) / max(1.0, cfg.max_steps - decay_start))
        return cfg.lr - progress * (cfg.lr - cfg.min_lr)
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


# ---------------------------------------------------------------------------------------------
# Set-up: distribution, device, precision, model, optimizer


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> Dist:
    """Join the process group torchrun describes in the environment (RANK, WORLD_SIZE, ...)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return Dist(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=int(os.environ.get("LOCAL_RANK", "0"))
    )


def resolve_device(cfg: TrainConfig, dist: Dist) -> torch.device:
    if cfg.device != "auto":
        return torch.device(cfg.device)
    if torch.cuda.is_available():
        return torch.device("cuda", dist.local_rank)
    return torch.device("cpu")


def resolve_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """The autocast dtype (float32 = no autocast). bf16 needs native support, fp16 needs CUDA."""
    native_bf16 = (
        torch.cuda.is_bf16_supported() if device.type == "cuda" else torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    if cfg.precision == "auto":
        return torch.bfloat16 if native_bf16 else torch.float32
    if cfg.precision == "float16" and device.type != "cuda":
        raise ValueError("precision float16 needs CUDA (a GradScaler on CPU buys nothing); use bfloat16 or float32")
    if cfg.precision == "bfloat16" and not native_bf16:
        log.warning("this %s has no native bf16; training in float32", device.type)
        return torch.float32
    return getattr(torch, cfg.precision)


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device) -> GPT:
    """A fresh model from the preset and overrides, or the weights named by init_from."""
    if cfg.init_from == "scratch":
        shape = {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd", "bias") if getattr(cfg, k) is not None}
        padded = -(-vocab_size // cfg.vocab_multiple) * cfg.vocab_multiple
        config = GPTConfig.from_name(
            cfg.model, **shape, block_size=cfg.block_size, vocab_size=padded, dropout=cfg.dropout
        )
        with torch.device(device):
            return GPT(config)
    spec = cfg.init_from
    latest = run_files.latest_checkpoint(spec) if Path(spec).is_dir() else None
    model = load_model(str(latest or spec), device=device).train()
    _set_dropout(model, cfg.dropout)
    if model.config.block_size < cfg.block_size:
        raise ValueError(f"block_size {cfg.block_size} exceeds the model's context length {model.config.block_size}")
    if model.config.vocab_size < vocab_size:
        raise ValueError(f"{spec} has a {model.config.vocab_size}-token vocabulary; the data uses {vocab_size} tokens")
    return model


def _set_dropout(model: GPT, p: float) -> None:
    model.config.dropout = p
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = p
        elif hasattr(m, "dropout") and isinstance(m.dropout, float):
            m.dropout = p


def build_optimizer(model: GPT, cfg: TrainConfig, device: torch.device, fused_ok: bool = True):
    """AdamW; weight decay on matrices only. fused where the device supports it, else foreach."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    if fused_ok:
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, ValueError):
            log.debug("fused AdamW unavailable on %s; using foreach", device)
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


# ---------------------------------------------------------------------------------------------
# The trainer


class Trainer:
    """Holds the state of one run; `step()` does one optimizer update, `run()` the whole loop."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.out_dir = Path(cfg.out_dir)
        manifest = read_manifest(cfg.data_dir)  # a missing data directory fails before anything is written
        self.tokenizer_name = manifest["tokenizer"]
        device_type = (
            "cuda" if cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
        )
        self.dist = init_distributed(device_type)
        self.device = resolve_device(cfg, self.dist)
        self.autocast_dtype = resolve_dtype(cfg, self.device)
        self._check_out_dir()
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.raw_model = build_model(cfg, manifest["vocab_size"], self.device).train()
        _check_tokens(cfg.data_dir, manifest, self.raw_model.config.vocab_size)
        self.grad_accum = self._grad_accum()
        self.train_loader, self.val_loader = self._loaders(manifest)
        self.model = self._wrap(self.raw_model)
        self.optimizer = build_optimizer(self.raw_model, cfg, self.device, fused_ok=not cfg.fsdp)
        self.scaler = torch.amp.GradScaler("cuda") if self.autocast_dtype == torch.float16 else None
        torch.manual_seed(cfg.seed + self.dist.rank)  # dropout streams differ per rank
        self.step_num, self.tokens_seen = 0, 0
        self.grad_history: list[float] = []
        self.bad_in_a_row = 0
        self.best_val: float | None = None
        self.last_checkpoint: Path | None = None
        if cfg.resume:
            self._resume()

    # -- set-up helpers

    def _check_out_dir(self) -> None:
        has_run = (self.out_dir / run_files.LATEST).is_symlink()
        if has_run and not self.cfg.resume:
            raise ValueError(
                f"{self.out_dir} already holds a run; pass --resume to continue it or pick another out_dir"
            )
        if self.cfg.resume and not has_run:
            raise ValueError(f"--resume: {self.out_dir} holds no checkpoint to resume from")

    def _grad_accum(self) -> int:
        cfg = self.cfg
        if cfg.batch_tokens is None:
            return cfg.grad_accum
        per_micro = cfg.batch_size * cfg.block_size * self.dist.world_size
        return max(1, math.ceil(cfg.batch_tokens / per_micro))

    def _loaders(self, manifest: dict) -> tuple[TokenLoader, TokenLoader]:
        cfg, d = self.cfg, self.dist
        common = dict(dtype=manifest["dtype"], rank=d.rank, world_size=d.world_size, seed=cfg.seed)
        train = TokenLoader(Path(cfg.data_dir) / "train.bin", cfg.batch_size, cfg.block_size, mode="random", **common)
        val = TokenLoader(Path(cfg.data_dir) / "val.bin", cfg.batch_size, cfg.block_size, mode="sequential", **common)
        return train, val

    def _wrap(self, model: GPT) -> nn.Module:
        if self.cfg.fsdp:
            if not self.dist.enabled:
                log.warning("fsdp=True in a single process: nothing to shard, training unsharded")
            else:
                from torch.distributed.fsdp import fully_shard

                for block in model.transformer.h:
                    fully_shard(block)
                fully_shard(model)
        elif self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=ids)
        if self.cfg.compile:
            model = torch.compile(model)
        return model

    @property
    def sharded(self) -> bool:
        return self.cfg.fsdp and self.dist.enabled

    def autocast(self):
        if self.autocast_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # -- one update

    def step(self) -> dict:
        """One optimizer update over grad_accum micro-batches; returns its log record."""
        cfg, t0 = self.cfg, time.perf_counter()
        lr = lr_at(self.step_num, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.grad_accum):
            x, y = (t.to(self.device, non_blocking=True) for t in self.train_loader.next_batch())
            sync = self._no_sync() if micro < self.grad_accum - 1 else nullcontext()
            with sync:
                with self.autocast():
                    _, loss = self.model(x, y, return_logits=False)
                loss = loss / self.grad_accum
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += loss.detach().float()
        loss_value = self._mean_over_ranks(loss_sum)
        grad_norm = self._clip_gradients()
        skipped = self._guard(loss_value, grad_norm)
        if not skipped:
            if self.scaler:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_num += 1
        tokens = cfg.batch_size * cfg.block_size * self.grad_accum * self.dist.world_size
        self.tokens_seen += tokens
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return dict(step=self.step_num, tokens=self.tokens_seen, loss=loss_value, lr=lr, grad_norm=grad_norm,
                    skipped=skipped, tok_per_s=tokens / dt, step_s=dt)  # fmt: skip

    def _no_sync(self):
        return self.model.no_sync() if hasattr(self.model, "no_sync") else nullcontext()

    def _mean_over_ranks(self, value: torch.Tensor) -> float:
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

    def _guard(self, loss: float, grad_norm: float) -> bool:
        """True to skip this update: a NaN/inf loss or gradient, or a gradient-norm spike."""
        cfg = self.cfg
        reason = None
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            if self.scaler and math.isfinite(loss):
                return False  # fp16 overflow: the GradScaler skips the step and lowers its scale
            reason = f"non-finite loss {loss} / grad norm {grad_norm}"
        elif len(self.grad_history) >= cfg.spike_window:  # a full window: early training is jumpy
            mean = sum(self.grad_history) / len(self.grad_history)
            std = math.sqrt(sum((g - mean) ** 2 for g in self.grad_history) / len(self.grad_history))
            if std > 0 and (grad_norm - mean) / std > cfg.spike_zscore:
                reason = (
                    f"grad norm {grad_norm:.3g} is {(grad_norm - mean) / std:.1f} std above the recent mean {mean:.3g}"
                )
        if reason is None:
            self.grad_history = (self.grad_history + [grad_norm])[-cfg.spike_window :]
            self.bad_in_a_row = 0
            return False
        self.bad_in_a_row += 1
        log.warning("step %d: skipped the update: %s", self.step_num + 1, reason)
        if self.bad_in_a_row > cfg.max_bad_steps:
            raise TrainingDiverged(
                f"training diverged: {self.bad_in_a_row} bad steps in a row up to step {self.step_num + 1} ({reason}); "
                f"the last good checkpoint is {self.last_checkpoint or 'none (no checkpoint written yet)'}"
            )
        return True

    # -- evaluation

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation loss and perplexity over the first eval_steps batches of val.bin, and a sample."""
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for k in range(self.cfg.eval_steps):
            x, y = (t.to(self.device) for t in self.val_loader.batch(k))
            with self.autocast():
                _, loss = self.model(x, y, return_logits=False)
            total += loss.float()
        val_loss = self._mean_over_ranks(total / self.cfg.eval_steps)
        sample = self.sample() if (self.dist.is_main or self.sharded) else ""
        self.model.train()
        return dict(step=self.step_num, tokens=self.tokens_seen, val_loss=val_loss,
                    val_ppl=math.exp(min(val_loss, 50.0)), sample=sample)  # fmt: skip

    def sample(self) -> str:
        """A short continuation of cfg.sample_prompt (fixed seed, so samples compare across evals)."""
        from gptlab.generation import generate_text
        from gptlab.tokenizer import get_tokenizer

        if self.cfg.sample_tokens <= 0:
            return ""
        tok = get_tokenizer(self.tokenizer_name)
        with self.autocast():
            text = generate_text(self.raw_model, tok, self.cfg.sample_prompt, self.cfg.sample_tokens,
                                 temperature=0.8, top_k=200, generator=self.cfg.seed)  # fmt: skip
        return self.cfg.sample_prompt + text

    # -- checkpoints

    def state_dicts(self) -> tuple[dict, dict]:
        """Full (unsharded) model and optimizer state dicts; every rank must call this under FSDP."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            return get_state_dict(
                self.raw_model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        return self.raw_model.state_dict(), self.optimizer.state_dict()

    def save_checkpoint(self) -> None:
        """Write a checkpoint of the current step (rank 0 writes; every rank takes part)."""
        model_state, optim_state = self.state_dicts()
        rng = self._gather_rng()
        if self.dist.is_main:
            self.last_checkpoint = run_files.write_checkpoint(
                self.out_dir, self.step_num, lambda d: self._write_checkpoint(d, model_state, optim_state, rng),
                keep=self.cfg.keep_checkpoints,
            )  # fmt: skip
            log.info("step %d: checkpoint %s", self.step_num, self.last_checkpoint)
        self._barrier()

    def _write_checkpoint(self, directory: Path, model_state: dict, optim_state: dict, rng: dict) -> None:
        model = self.raw_model
        if self.sharded:  # a plain module around the gathered tensors, for save_model
            with torch.device("meta"):
                model = GPT(self.raw_model.config)
            load_state_strict(model, model_state, "gathered state")
            model.tie_weights()
        save_model(model, directory, tokenizer=self.tokenizer_name, extra={"train_step": self.step_num})
        run_files.save_torch(directory / run_files.OPTIMIZER_FILE,
                             {"optimizer": optim_state, "scaler": self.scaler.state_dict() if self.scaler else None})  # fmt: skip
        run_files.save_torch(directory / run_files.RNG_FILE, rng)
        state = dict(step=self.step_num, tokens_seen=self.tokens_seen, loader=self.train_loader.state_dict(),
                     grad_history=self.grad_history, bad_in_a_row=self.bad_in_a_row, best_val=self.best_val,
                     world_size=self.dist.world_size, grad_accum=self.grad_accum,
                     model_config=self.raw_model.config.to_dict(), config=self.cfg.to_dict())  # fmt: skip
        run_files.save_json(directory / run_files.STATE_FILE, state)

    def _gather_rng(self) -> dict:
        mine = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            mine["cuda"] = torch.cuda.get_rng_state_all()
        if not self.dist.enabled:
            return {"ranks": [mine]}
        import torch.distributed as dist

        everyone: list = [None] * self.dist.world_size
        dist.all_gather_object(everyone, mine)
        return {"ranks": everyone}

    def _barrier(self) -> None:
        if self.dist.enabled:
            import torch.distributed as dist

            dist.barrier()

    def _resume(self) -> None:
        ckpt = run_files.latest_checkpoint(self.out_dir)
        state = run_files.load_json(ckpt / run_files.STATE_FILE)
        if state["model_config"] != self.raw_model.config.to_dict():
            diff = {k: (v, self.raw_model.config.to_dict().get(k)) for k, v in state["model_config"].items()
                    if self.raw_model.config.to_dict().get(k) != v}  # fmt: skip
            raise ValueError(f"{ckpt} holds a model of another shape (checkpoint vs now: {diff})")
        if state["world_size"] * state["grad_accum"] != self.dist.world_size * self.grad_accum:
            log.warning("resuming with a different global batch (world_size x grad_accum changed)")
        self._load_weights(ckpt)
        optim = run_files.load_torch(ckpt / run_files.OPTIMIZER_FILE)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.raw_model, self.optimizer, optim["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))  # fmt: skip
        else:
            self.optimizer.load_state_dict(optim["optimizer"])
        if self.scaler and optim.get("scaler"):
            self.scaler.load_state_dict(optim["scaler"])
        rng = run_files.load_torch(ckpt / run_files.RNG_FILE)["ranks"]
        mine = rng[self.dist.rank] if self.dist.rank < len(rng) else rng[0]
        torch.set_rng_state(mine["cpu"])
        if "cuda" in mine and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(mine["cuda"])
        self.train_loader.load_state_dict(state["loader"])
        self.step_num, self.tokens_seen = state["step"], state["tokens_seen"]
        self.grad_history, self.bad_in_a_row = state["grad_history"], state["bad_in_a_row"]
        self.best_val, self.last_checkpoint = state.get("best_val"), ckpt
        log.info("resumed from %s at step %d", ckpt, self.step_num)

    def _load_weights(self, ckpt: Path) -> None:
        from safetensors.torch import load_file

        weights = load_file(ckpt / "model.safetensors", device=str(self.device))
        if self.raw_model.config.tie_weights:
            weights["lm_head.weight"] = weights["transformer.wte.weight"]
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.raw_model, weights, options=StateDictOptions(full_state_dict=True))
            return
        with torch.no_grad():
            own = self.raw_model.state_dict()
            for name, tensor in weights.items():
                if own[name].shape != tensor.shape:
                    raise ValueError(
                        f"{ckpt}: tensor {name} has shape {tuple(tensor.shape)}, the model expects {tuple(own[name].shape)}"
                    )
                own[name].copy_(tensor)

    # -- the loop

    def run(self) -> dict:
        """Train to max_steps; evaluate, checkpoint and log on the way. Returns a summary."""
        cfg, main = self.cfg, self.dist.is_main
        from tqdm import tqdm

        metrics = (
            run_files.MetricsLog(self.out_dir, resume_step=self.step_num if cfg.resume else None) if main else None
        )
        bar = tqdm(
            total=cfg.max_steps, initial=self.step_num, disable=not (main and cfg.progress), desc="train", unit="step"
        )
        start_step, t0, record, last_eval = self.step_num, time.perf_counter(), {}, None
        try:
            while self.step_num < cfg.max_steps:
                record = self.step()
                if main and (
                    self.step_num % max(cfg.log_interval, 1) == 0 or record["skipped"] or self.step_num == cfg.max_steps
                ):
                    metrics.write(record)
                bar.update(1)
                bar.set_postfix(
                    loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tok_per_s']:,.0f}"
                )
                at_end = self.step_num == cfg.max_steps
                if self.step_num % cfg.eval_interval == 0 or at_end:
                    last_eval = self._eval_and_log(metrics, bar)
                if self.step_num % cfg.save_every == 0 or at_end:
                    self.save_checkpoint()
        finally:
            bar.close()
            if metrics:
                metrics.close()
        plot = run_files.plot_losses(self.out_dir) if main else None
        return dict(step=self.step_num, tokens=self.tokens_seen, train_loss=record.get("loss"),
                    val_loss=(last_eval or {}).get("val_loss"), sample=(last_eval or {}).get("sample"),
                    checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
                    metrics=str(self.out_dir / run_files.METRICS), plot=str(plot) if plot else None,
                    seconds=time.perf_counter() - t0, steps_run=self.step_num - start_step)  # fmt: skip

    def _eval_and_log(self, metrics, bar) -> dict:
        result = self.evaluate()
        if self.dist.is_main:
            self.best_val = result["val_loss"] if self.best_val is None else min(self.best_val, result["val_loss"])
            metrics.write(result)
            message = f"step {result['step']}: val loss {result['val_loss']:.4f} (ppl {result['val_ppl']:.1f})"
            if self.cfg.progress:
                bar.write(message)  # tqdm.write keeps the bar intact
            else:
                log.info(message)
            log.debug("sample: %r", result["sample"])
            run_files.plot_losses(self.out_dir)
        return result


def _check_tokens(data_dir, manifest: dict, model_vocab: int) -> None:
    """The token files must have the manifest's size and only ids the model can embed."""
    import numpy as np

    dtype = np.dtype(manifest["dtype"])
    for split in ("train", "val"):
        path = Path(data_dir) / f"{split}.bin"
        if not path.is_file():
            raise ValueError(f"{path} is missing (run `gptlab prepare`)")
        expected = manifest["tokens"][split] * dtype.itemsize
        if path.stat().st_size != expected:
            raise ValueError(
                f"{path} has {path.stat().st_size} bytes; the manifest says {expected} ({manifest['tokens'][split]} {dtype.name} tokens)"
            )
        tokens = np.memmap(path, dtype=dtype, mode="r")
        top = max(int(tokens[s : s + (1 << 24)].max()) for s in range(0, len(tokens), 1 << 24))
        if top >= model_vocab:
            raise ValueError(
                f"{path} holds token id {top}, outside the model's {model_vocab}-token vocabulary (tokenizer {manifest['tokenizer']!r})"
            )
    if manifest["vocab_size"] > model_vocab:
        raise ValueError(f"the data's tokenizer has {manifest['vocab_size']} tokens; the model only {model_vocab}")


def train(cfg: TrainConfig) -> dict:
    """Run training as `cfg` says (one process, or one rank under torchrun); returns a summary."""
    trainer = Trainer(cfg)
    try:
        return trainer.run()
    finally:
        if trainer.dist.enabled:
            import torch.distributed as dist

            dist.destroy_process_group()
