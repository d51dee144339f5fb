"""Checkpoint I/O for a Trainer: write one (atomically, rank 0) and resume from the latest, exactly.

A checkpoint directory holds the native model (model.safetensors + gptlab.json), optimizer.pt
(optimizer and GradScaler), rng.pt (every rank's RNG states) and train_state.json (step, data
cursor, guard window, time spent, configs). See gptlab.run_files for the atomic write. A LoRA run
(lora_rank > 0) writes its adapters instead of the model: lora.safetensors (their exact
parameters, for resuming), the same adapters in PEFT's format, and a gptlab.json naming the base,
so `load_model(checkpoint)` gives the adapted model.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from gptlab import run_files
from gptlab.checkpoint import load_state_strict, save_model
from gptlab.classifier import model_for
from gptlab.meta import meta_device
from gptlab.train.setup import decided_on_rank0
from gptlab.train_config import final_lr

log = logging.getLogger(__name__)
LORA_FILE = "lora.safetensors"  # a LoRA run's trained tensors, exactly, for resuming
NOT_SHAPE = ("dropout",)  # model config fields a resumed run may change (TrainConfig.dropout)
LOADER_SETTINGS = ("seed", "layout")  # a loader's state keys that are TrainConfig's seed and sft_layout


def full_state_dicts(trainer) -> tuple[dict, dict]:
    """Full (unsharded) model and optimizer state dicts; every rank must call this under FSDP."""
    if trainer.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(
            trainer.raw_model, trainer.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return trainer.raw_model.state_dict(), trainer.optimizer.state_dict()


def save_checkpoint(trainer) -> None:
    """Write a checkpoint of the trainer's current step (rank 0 writes; every rank takes part, and
    takes its path as last_checkpoint: rank 1 named the one it had resumed from). The time spent
    is the ranks' agreed reading: rank 0's own, where it started last, was short of the budget
    the ranks had stopped on, and a resume trained on in time already spent."""
    model_state, optim_state = full_state_dicts(trainer)
    rng = _gather_rng(trainer.dist)
    elapsed = trainer.agreed_elapsed()

    def publish() -> Path:
        write = lambda d: _write(trainer, d, model_state, optim_state, rng, elapsed)  # noqa: E731
        path = run_files.write_checkpoint(trainer.out_dir, trainer.step_num, write, keep=trainer.cfg.keep_checkpoints)
        log.info("step %d: checkpoint %s", trainer.step_num, path)
        return path

    trainer.last_checkpoint = decided_on_rank0(trainer.dist, trainer.device, publish)  # the others wait for it


def _write(trainer, directory: Path, model_state: dict, optim_state: dict, rng: dict, elapsed: float) -> None:
    model = trainer.raw_model
    if trainer.cfg.lora_rank:
        _write_adapters(trainer, directory, model_state)
    elif trainer.sharded:  # a plain module around the gathered tensors, for save_model
        with meta_device():
            model = model_for(trainer.raw_model.config)
        load_state_strict(model, model_state, "gathered state")
        model.tie_weights()
    if not trainer.cfg.lora_rank:
        save_model(model, directory, tokenizer=trainer.tokenizer_name, extra={"train_step": trainer.step_num})
    scaler = trainer.scaler.state_dict() if trainer.scaler else None
    run_files.save_torch(directory / run_files.OPTIMIZER_FILE, {"optimizer": optim_state, "scaler": scaler})
    run_files.save_torch(directory / run_files.RNG_FILE, rng)
    state = dict(step=trainer.step_num, tokens_seen=trainer.tokens_seen, loader=trainer.train_loader.state_dict(),
                 **trainer.guard.state_dict(), best_val=trainer.best_val, elapsed_s=elapsed,
                 precision=str(trainer.precision).removeprefix("torch."),
                 world_size=trainer.dist.world_size, grad_accum=trainer.grad_accum,
                 model_config=trainer.raw_model.config.to_dict(), config=trainer.cfg.to_dict())  # fmt: skip
    run_files.save_json(directory / run_files.STATE_FILE, state)


def _write_adapters(trainer, directory: Path, model_state: dict) -> None:
    from safetensors.torch import save_file

    from gptlab.atomic import atomic_write
    from gptlab.checkpoint import META_FILE
    from gptlab.lora import save_adapter

    names = trained_names(trainer.raw_model)
    adapters = {k: v.detach().contiguous() for k, v in model_state.items() if k in names}
    atomic_write(directory / LORA_FILE, lambda tmp: save_file(adapters, tmp))  # a normal file's mode, not 0600
    save_adapter(trainer.raw_model, directory, base_model=trainer.cfg.init_from)
    meta = {"format": "gptlab", "lora_base": trainer.lora_base, "config": trainer.raw_model.config.to_dict(),
            "tokenizer": trainer.tokenizer_name, "train_step": trainer.step_num}  # fmt: skip
    run_files.save_json(directory / META_FILE, meta)


def lora_base(init_from: str) -> str:
    """What a LoRA checkpoint records as its base: a local run or checkpoint as the absolute path of
    the checkpoint it resolves to now (a run's `latest` moves on, and a relative path depends on
    the directory one loads from); a Hub id as it is."""
    from gptlab.loading import checkpoint_path

    init_from = os.path.expanduser(init_from)
    return str(checkpoint_path(init_from).resolve()) if Path(init_from).exists() else init_from


def trained_names(model) -> set[str]:
    """Names of the parameters a LoRA run trains: the adapters, and a classifier's new head."""
    return {name for name, p in model.named_parameters() if p.requires_grad}


def _gather_rng(dist_info) -> dict:
    mine = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        mine["cuda"] = torch.cuda.get_rng_state_all()
    if not dist_info.enabled:
        return {"ranks": [mine]}
    import torch.distributed as dist

    everyone: list = [None] * dist_info.world_size
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


def resume(trainer) -> float:
    """Load the latest checkpoint of trainer.out_dir into the trainer; returns the seconds it had spent."""
    ckpt = run_files.latest_checkpoint(trainer.out_dir)
    state = run_files.load_json(ckpt / run_files.STATE_FILE)
    # dropout is in the model's config but is no part of its shape: a changed one is a changed
    # setting (warned about below), as it is to --set dropout= of a fine-tune's init_from
    shape_was = {k: v for k, v in state["model_config"].items() if k not in NOT_SHAPE}
    shape_now = {k: v for k, v in trainer.raw_model.config.to_dict().items() if k not in NOT_SHAPE}
    if shape_was != shape_now:
        diff = {k: (v, shape_now.get(k)) for k, v in shape_was.items() if shape_now.get(k) != v}
        raise ValueError(f"{ckpt} holds a model of another shape (checkpoint vs now: {diff})")
    was = state.get("config", {}).get("optimizer", "adamw")
    if was != trainer.cfg.optimizer:
        raise ValueError(f"{ckpt} was trained with optimizer={was!r}; this run asks for {trainer.cfg.optimizer!r}")
    was_config = state.get("config", {})
    batch_was = (state["world_size"], state["grad_accum"], was_config.get("batch_size", trainer.cfg.batch_size))
    batch_now = (trainer.dist.world_size, trainer.grad_accum, trainer.cfg.batch_size)
    changed = changed_settings(was_config, trainer.cfg.to_dict())
    if math.prod(batch_was) != math.prod(batch_now):
        log.warning("resuming with a different global batch (world_size x grad_accum x batch_size: %s -> %s)",
                    "x".join(map(str, batch_was)), "x".join(map(str, batch_now)))  # fmt: skip
    else:  # 2 ranks of 4 rows continue as 1 process of 8: the ranks' rows of the same global batches
        changed.pop("batch_size", None)
    if changed:
        log.warning("resuming with changed settings, so not exactly the run it continues: %s",
                    ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))  # fmt: skip
    _load_weights(trainer, ckpt)
    _load_optimizer(trainer, run_files.load_torch(ckpt / run_files.OPTIMIZER_FILE))
    rng = run_files.load_torch(ckpt / run_files.RNG_FILE)["ranks"]
    if trainer.dist.rank < len(rng):
        torch.set_rng_state(rng[trainer.dist.rank]["cpu"])
        if "cuda" in rng[trainer.dist.rank] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng[trainer.dist.rank]["cuda"])
    else:  # a rank the checkpoint had not: its own stream (rank 0's, copied, dropped the same units on every rank)
        torch.manual_seed(trainer.cfg.seed + trainer.dist.rank + state["step"])
    # seed and sft_layout are settings a resumed run may change, warned about above (the loader
    # refused them, after the warning, with its own "does not match"): its batches go on from the
    # checkpoint's count (in this run's batches: loader_state), drawn as this run's settings say
    now = trainer.train_loader.state_dict()
    kept = {k: now[k] for k in LOADER_SETTINGS if k in now}
    trainer.train_loader.load_state_dict({**loader_state(state, trainer), **kept})
    trainer.step_num, trainer.tokens_seen = state["step"], state["tokens_seen"]
    trainer.guard.load_state_dict(state)
    trainer.best_val, trainer.last_checkpoint = state.get("best_val"), ckpt
    log.info("resumed from %s at step %d", ckpt, trainer.step_num)
    return state.get("elapsed_s", 0.0)


def loader_state(state: dict, trainer) -> dict:
    """The checkpoint's training-loader state for this run's loader. Its counter counts batches
    of world_size x batch_size rows: where that changed (2 ranks of 4 rows resumed by one process
    of 4 rows with grad_accum 2), it is converted to count the rows read in this run's batches.
    Taken as it was, it went back to rows already read (an SFT epoch trained examples twice).
    Rows that do not fill one of this run's batches are skipped, not read twice."""
    loader = dict(state["loader"])
    rows_was = state["world_size"] * state.get("config", {}).get("batch_size", trainer.cfg.batch_size)
    rows_now = trainer.dist.world_size * trainer.cfg.batch_size
    loader["batch_index"] = -(-loader["batch_index"] * rows_was // rows_now)
    return loader


# Settings a resumed run may change and still be the run it continues (when and how long it runs,
# unless that is the length of its lr schedule, see schedule_length; what it logs and keeps, where it
# runs; init_from's weights are replaced by the checkpoint's, and a LoRA run checks its base itself).
FREE_ON_RESUME = {"resume", "max_steps", "max_time", "progress", "log_interval", "eval_interval", "eval_steps",
                  "checkpoint_interval", "keep_checkpoints", "sample_prompt", "sample_tokens", "device", "out_dir",
                  "init_from"}  # fmt: skip


def changed_settings(was: dict, now: dict) -> dict:
    """{setting: (checkpoint's, now)} for the settings that change what a resumed run computes
    (min_lr as the value it stands for: unset is lr / 10)."""
    free = FREE_ON_RESUME - schedule_length(was) - schedule_length(now)
    was, now = _final_lr(was), _final_lr(now)
    return {k: (v, now[k]) for k, v in was.items() if k in now and now[k] != v and k not in free}


def schedule_length(settings: dict) -> set[str]:
    """The setting a decaying learning rate is spread over: max_time where it is set, else max_steps
    (none for a constant lr). Resuming with another moves every later step's learning rate (a
    finished cosine run's jumps back up), as in nanoGPT and llm.c, where the new value wins silently."""
    if settings.get("schedule", "cosine") == "constant":
        return set()
    return {"max_time"} if settings.get("max_time") else {"max_steps"}


def _final_lr(settings: dict) -> dict:
    if "lr" not in settings:
        return settings
    return {**settings, "min_lr": final_lr(settings["lr"], settings.get("min_lr"))}


def _load_optimizer(trainer, optim: dict) -> None:
    if trainer.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state = keyed_by_name(trainer.raw_model, trainer.optimizer, optim["optimizer"])
        set_optimizer_state_dict(trainer.raw_model, trainer.optimizer, state,
                                 options=StateDictOptions(full_state_dict=True))  # fmt: skip
    else:
        trainer.optimizer.load_state_dict(optim["optimizer"])
    if trainer.scaler and optim.get("scaler"):
        trainer.scaler.load_state_dict(optim["scaler"])


def keyed_by_name(model, optimizer, state: dict) -> dict:
    """An optimizer state dict with its parameters keyed by name, as FSDP's set_optimizer_state_dict
    reads it (and get_state_dict writes it). An unsharded run saves torch's own state_dict, keyed
    by each parameter's index in the optimizer's groups (0, 1, ...): those are renamed, in the
    groups' order, which build_optimizer makes the same in every run of the same model."""
    saved = [key for group in state["param_groups"] for key in group["params"]]
    if not all(isinstance(key, int) for key in saved):
        return state
    names = {id(p): name for name, p in model.named_parameters()}
    now = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(saved) != len(now):
        raise ValueError(f"the checkpoint's optimizer holds {len(saved)} parameters; this run trains {len(now)}")
    name = dict(zip(saved, now, strict=True))
    return {"state": {name[key]: value for key, value in state["state"].items()},
            "param_groups": [{**group, "params": [name[key] for key in group["params"]]}
                             for group in state["param_groups"]]}  # fmt: skip


def _read_safetensors(path: Path, device) -> dict:
    from safetensors.torch import load_file

    try:
        return load_file(path, device=str(device))
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise ValueError(f"{path}: cannot read weights, the checkpoint is damaged ({e})") from e


def _load_weights(trainer, ckpt: Path) -> None:
    if trainer.cfg.lora_rank:  # the base came from init_from again; the adapters come from here
        from gptlab.checkpoint import read_meta

        was, now = read_meta(ckpt).get("lora_base"), trainer.lora_base
        if was and not Path(was).is_absolute():  # written before bases were recorded resolved
            was = lora_base(was)
        if was != now:
            raise ValueError(f"{ckpt} adapts {was}, but init_from now gives {now}: resume on the same base")
        weights = _read_safetensors(ckpt / LORA_FILE, trainer.device)
        names = trained_names(trainer.raw_model)
        own = {k: v for k, v in trainer.raw_model.state_dict().items() if k in names}
        if set(weights) != set(own) or any(weights[k].shape != own[k].shape for k in own):
            raise ValueError(f"{ckpt}: its adapters do not match lora_targets {trainer.cfg.lora_targets!r} "
                             f"and lora_rank {trainer.cfg.lora_rank}")  # fmt: skip
        with torch.no_grad():
            for name, tensor in weights.items():
                own[name].copy_(tensor)
        return
    weights = _read_safetensors(ckpt / "model.safetensors", trainer.device)
    if trainer.raw_model.config.ties_head:
        weights["lm_head.weight"] = weights["transformer.wte.weight"]
    if trainer.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(trainer.raw_model, weights, options=StateDictOptions(full_state_dict=True))
        return
    with torch.no_grad():
        own = trainer.raw_model.state_dict()
        for name, tensor in weights.items():
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"{ckpt}: tensor {name} has shape {tuple(tensor.shape)}, the model expects {tuple(own[name].shape)}"
                )
            own[name].copy_(tensor)
