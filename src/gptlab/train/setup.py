"""Set-up of a run: processes (DDP/FSDP), device, model, optimizer, and checks on the token files."""

from __future__ import annotations

import ctypes
import logging
import math
import os
import pickle
import platform
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from gptlab import compile_cache, run_files
from gptlab.config import GPTConfig
from gptlab.data import TokenLoader, open_tokens
from gptlab.loading import load_model
from gptlab.model import GPT
from gptlab.tokenizer import get_tokenizer
from gptlab.train.muon import Muon
from gptlab.train_config import TrainConfig

log = logging.getLogger(__name__)


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


def decided_on_rank0(dist: Dist, device: torch.device, decide):
    """decide() run on rank 0 alone, its value (or its exception) taken by every rank: one
    decision where ranks would each decide their own (precision=auto's timings differ per rank),
    or what rank 0 alone did (the checkpoint it wrote; the others wait for it).

    Any exception of rank 0's is raised on every rank: one it kept to itself left the others
    waiting for its broadcast until the gloo pair closed ("Connection closed by peer", not why)
    or, on NCCL, the watchdog's timeout."""
    if not dist.enabled:
        return decide()
    import torch.distributed as torch_dist

    box, failure = [None], None
    if dist.is_main:
        try:
            box[0] = (decide(), None)
        except Exception as e:
            failure, box[0] = e, (None, _sendable(e))
    torch_dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    value, error = box[0]
    if failure is not None:
        raise failure  # rank 0's own, with its traceback
    if error is not None:
        raise error
    return value


def _sendable(error: Exception) -> Exception:
    """error as another rank can raise it: itself where it pickles (a ValueError the CLI prints as
    one line), else a RuntimeError with its message (an exception holding a lock or a file)."""
    try:
        pickle.loads(pickle.dumps(error))  # our own bytes, as broadcast_object_list sends them
        return error
    except Exception:
        return RuntimeError(f"rank 0: {type(error).__name__}: {error}")


def resolve_device(cfg: TrainConfig, dist: Dist) -> torch.device:
    if cfg.device != "auto":
        from gptlab.loading import check_device

        check_device(cfg.device, "device")  # "gpu", or cuda without one: a ValueError, not torch's
        return torch.device(cfg.device)
    if torch.cuda.is_available():
        return torch.device("cuda", dist.local_rank)
    return torch.device("cpu")


# glibc's malloc gives blocks past its mmap threshold back to the kernel when they are freed, and
# trims freed memory past its trim threshold off the top of its heap; the next allocation then
# page-faults that memory in again. A CPU training step frees and reallocates tens of MB every step
# (the tied head's 26 MB gradient and the embedding's, activations): the demo's ~9.5M minor page
# faults in 750 steps. With these, measured on the AMD EPYC Zen 5 held to AVX2 (a demo step,
# medians of 40, alternating runs): 236-249 ms a step against 226-240.
MALLOC_SETTINGS = {-3: 32 << 20, -1: 1 << 30}  # M_MMAP_THRESHOLD (glibc's largest), M_TRIM_THRESHOLD
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Have glibc's malloc serve blocks of up to 32 MB from its heap and keep up to 1 GB of freed
    memory for reuse instead of returning it to the kernel (mallopt M_MMAP_THRESHOLD and
    M_TRIM_THRESHOLD): a process-wide setting, made by CPU training only. Not where the C library
    is not glibc, nor where the environment sets either (glibc's MALLOC_*_ variables: the user's
    choice stands). Returns whether it was set."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or any(v in os.environ for v in MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in MALLOC_SETTINGS.items())


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device, labels: list[str] | None = None,
                pad_token_id: int = 50256) -> GPT:  # fmt: skip
    """A fresh model from the preset and overrides, or the weights named by init_from; with
    `labels` (classification data), a classifier over them on that body, padded with pad_token_id
    (the data's tokenizer's <|endoftext|>). Then freezes what cfg.trainable or LoRA (cfg.lora_rank)
    leaves out of training."""
    model = _base_model(cfg, vocab_size, device)
    if labels is not None:
        from gptlab.classifier import from_language_model

        if not model.config.num_labels:
            model = from_language_model(model, labels, pad_token_id)
        elif model.config.labels != list(labels):
            raise ValueError(f"{cfg.init_from} classifies {model.config.labels}; the data's labels are {labels}")
    if cfg.lora_rank:
        from gptlab.lora import apply_lora

        apply_lora(model, cfg.lora_settings())  # freezes the base: the optimizer sees the adapters only
        if model.config.num_labels:
            model.score.weight.requires_grad_(True)  # a new head trains with the adapters
    elif cfg.trainable != "all":
        from gptlab.classifier import set_trainable

        set_trainable(model, cfg.trainable)
    return model


def _base_model(cfg: TrainConfig, vocab_size: int, device: torch.device) -> GPT:
    if cfg.init_from == "scratch":
        shape = {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd", "bias") if getattr(cfg, k) is not None}
        padded = -(-vocab_size // cfg.vocab_multiple) * cfg.vocab_multiple
        config = GPTConfig.from_name(
            cfg.model, **shape, block_size=cfg.block_size, vocab_size=padded, dropout=cfg.dropout
        )
        with torch.device(device):
            return GPT(config)
    from gptlab.lora import lora_layers, merge

    spec = cfg.init_from
    model = load_model(spec, device=device).train()  # a run directory loads its latest checkpoint
    if lora_layers(model):  # a LoRA run's adapters are folded in: this run trains (or adapts) plain weights
        merge(model)
        model.requires_grad_(True)  # loading the adapter froze the base
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
    """AdamW, weight decay on matrices only, fused where the device supports it, else foreach; with
    optimizer="muon", Muon (gptlab.train.muon) for the blocks' weight matrices and AdamW for the rest.

    A group's "lr_scale" is its peak learning rate over cfg.lr: the trainer sets each group's lr to
    the scheduled lr times it (muon_lr / lr for Muon's group).
    """
    hidden = muon_matrices(model) if cfg.optimizer == "muon" else []
    if cfg.muon_lr is not None and cfg.optimizer != "muon":
        log.warning("muon_lr=%g is unused: optimizer is %r", cfg.muon_lr, cfg.optimizer)
    muon_ids = {id(p) for p in hidden}
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in muon_ids]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    adamw = None
    if fused_ok:
        try:
            adamw = torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, ValueError):
            log.debug("fused AdamW unavailable on %s; using foreach", device)
    adamw = adamw or torch.optim.AdamW(groups, foreach=True, **kwargs)
    if not hidden:
        return adamw
    muon_lr = cfg.muon_lr or cfg.lr
    muon = Muon(hidden, lr=muon_lr, weight_decay=cfg.weight_decay)
    muon.param_groups[0]["lr_scale"] = muon_lr / cfg.lr
    return Optimizers(adamw, muon)


def muon_matrices(model: GPT) -> list[torch.nn.Parameter]:
    """The trainable weight matrices of the transformer blocks (attention and MLP): what Muon steps.
    The embeddings (also the tied head), biases and gains stay with AdamW, as Muon's authors advise."""
    return [p for p in model.transformer.h.parameters() if p.requires_grad and p.dim() == 2]


class Optimizers:
    """Several torch optimizers stepped as one (AdamW and Muon): what the trainer, GradScaler
    (param_groups, step) and checkpoints (state_dict) use of an optimizer."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        states = state.get("optimizers", [])
        if len(states) != len(self.optimizers):
            raise ValueError(f"optimizer state holds {len(states)} optimizers; this run has {len(self.optimizers)}")
        for opt, opt_state in zip(self.optimizers, states, strict=True):
            opt.load_state_dict(opt_state)


def build_loaders(cfg: TrainConfig, manifest: dict, dist: Dist):
    """Random training batches and the fixed sequential validation batches, this rank's rows:
    windows of a token stream, or whole examples of an SFT directory (gptlab.sft)."""
    common = dict(dtype=manifest["dtype"], rank=dist.rank, world_size=dist.world_size, seed=cfg.seed)
    kind = manifest.get("kind")
    if kind in ("classify", "sft"):  # whole examples: gptlab.classify_data, gptlab.sft
        # padded with the data's own <|endoftext|>: GPT-2's 50256 is past a byte model's vocabulary
        common["pad_id"] = get_tokenizer(manifest["tokenizer"]).eot_token
        if kind == "classify":
            from gptlab.classify_data import ClassifyLoader as Loader
        else:
            from gptlab.sft import ExampleLoader as Loader

            common["layout"] = cfg.sft_layout
        return tuple(Loader(cfg.data_dir, split, cfg.batch_size, cfg.block_size, mode=mode, **common)
                     for split, mode in (("train", "random"), ("val", "sequential")))  # fmt: skip
    train = TokenLoader(Path(cfg.data_dir) / "train.bin", cfg.batch_size, cfg.block_size, mode="random", **common)
    try:
        val = TokenLoader(Path(cfg.data_dir) / "val.bin", cfg.batch_size, cfg.block_size, mode="sequential", **common)
    except ValueError as e:  # too short for one window: the split was made too small for this block_size
        raise ValueError(f"{e}: prepare with a larger --val-fraction (now {manifest.get('val_fraction', '?')}), "
                         "or train with a smaller block_size") from None  # fmt: skip
    return train, val


def grad_accum_steps(cfg: TrainConfig, world_size: int) -> int:
    """Micro-steps per update: cfg.grad_accum, or enough to reach cfg.batch_tokens."""
    if cfg.batch_tokens is None:
        return cfg.grad_accum
    per_micro = cfg.batch_size * cfg.block_size * world_size
    return max(1, math.ceil(cfg.batch_tokens / per_micro))


def wrap_model(model: GPT, cfg: TrainConfig, dist: Dist, device: torch.device) -> nn.Module:
    """The module the loop calls: FSDP-sharded, or DDP, then compiled, as configured."""
    if cfg.fsdp:
        if not dist.enabled:
            log.warning("fsdp=True in a single process: nothing to shard, training unsharded")
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.transformer.h:
                fully_shard(block)
            fully_shard(model)
    elif dist.enabled:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=ids)
    if cfg.compile:
        compile_cache.use()  # this CPU's own builds (see there)
        model = torch.compile(model)
    return model


def check_out_dir(out_dir: Path, resume: bool) -> None:
    """A new run needs an out_dir without a run's files (it would prune their checkpoints and
    truncate their metrics); --resume needs one whose `latest` link names a checkpoint."""
    latest = out_dir / run_files.LATEST
    has_run = latest.is_symlink()
    if has_run and not resume:
        raise ValueError(f"{out_dir} already holds a run; pass --resume to continue it or pick another out_dir")
    # checkpoints without their link (a run stopped before its first one leaves metrics.jsonl alone: it starts over)
    found = sorted(p.name for p in [latest, *out_dir.glob("ckpt-*")] if p.exists())
    if found and not has_run:
        raise ValueError(f"{out_dir} holds part of a run ({', '.join(found[:3])}) but no `latest` link to a "
                         "checkpoint: pick another out_dir, or restore the link to resume it")  # fmt: skip
    if resume and not has_run:
        raise ValueError(f"--resume: {out_dir} holds no checkpoint to resume from")


def check_tokenizer(cfg: TrainConfig, manifest: dict) -> None:
    """Data tokenized otherwise than init_from's model reads was trained on as if it were its
    tokens (the byte tokenizer's ids fit GPT-2's vocabulary), failing only at the final sample."""
    if cfg.init_from == "scratch":
        return
    from gptlab.loading import tokenizer_name

    model_tokenizer = tokenizer_name(cfg.init_from)
    if model_tokenizer != manifest["tokenizer"]:
        raise ValueError(f"{cfg.data_dir} holds {manifest['tokenizer']} tokens; {cfg.init_from} reads "
                         f"{model_tokenizer} tokens: prepare the data with --tokenizer {model_tokenizer}")  # fmt: skip


def check_tokens(data_dir, manifest: dict, model_vocab: int) -> None:
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
        tokens = open_tokens(path, dtype)  # an empty one: the loader names the tokens its block_size needs
        top = max((int(tokens[s : s + (1 << 24)].max()) for s in range(0, len(tokens), 1 << 24)), default=-1)
        if top >= model_vocab:
            raise ValueError(
                f"{path} holds token id {top}, outside the model's {model_vocab}-token vocabulary (tokenizer {manifest['tokenizer']!r})"
            )
    if manifest["vocab_size"] > model_vocab:
        raise ValueError(f"the data's tokenizer has {manifest['vocab_size']} tokens; the model only {model_vocab}")
