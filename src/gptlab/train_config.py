"""`TrainConfig`: every training setting in one dataclass, read from TOML and key=value overrides.

The training loop that uses it is gptlab.train (a package).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

SCHEDULES = ("cosine", "constant", "wsd")
PRECISIONS = ("auto", "float32", "bfloat16", "float16")
OPTIMIZERS = ("adamw", "muon")
SEED_LIMIT = 2**40  # the loaders seed batch k with seed * 1_000_003 + k: a 64-bit integer
# Old key -> new key. `dtype` meant the autocast precision here but the weight dtype in
# `--dtype`/`load_model` (issue 15); old configs keep working with a warning.
RENAMED = {"dtype": "precision"}

log = logging.getLogger(__name__)
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass
class TrainConfig:
    """Every training setting. Load from TOML with `from_toml`, override with `with_overrides`."""

    data_dir: str = "data/tinyshakespeare"  # holds train.bin, val.bin, manifest.json (gptlab prepare)
    out_dir: str = "runs/default"
    # Model: a preset, optionally reshaped; or init_from a checkpoint / HF directory / Hub id.
    model: str = "gpt2-mini"
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    dropout: float = 0.0
    bias: bool | None = None
    vocab_multiple: int = 1  # pad the vocabulary of a scratch model to a multiple of this (64 for GPUs)
    init_from: str = "scratch"  # "scratch", a gptlab checkpoint/run directory, an HF directory or Hub id
    # LoRA (gptlab.lora): lora_rank > 0 trains adapters on the init_from model, its weights frozen;
    # checkpoints then hold the adapters and their optimizer state, not the base.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = (
        "c_attn.q,c_attn.v"  # comma-separated: c_attn.q/k/v, c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj, lm_head
    )
    # Which parameters train: all, head (the head and the final norm) or last:N (those and the
    # last N blocks); with lora_rank, the adapters (and a classifier's head).
    trainable: str = "all"
    # Instruction tuning data (gptlab prepare on Alpaca/chat records): "pad" each example to its
    # own row (batch_size counts examples), or "pack" several per row with attention kept inside
    # each. Measured on the CPU (README, Recipes): the same seconds per epoch within 6%, and pad's
    # extra updates per epoch gave the lower loss.
    sft_layout: str = "pad"
    # Batch: batch_size x block_size tokens per micro-step and rank; grad_accum micro-steps per update.
    batch_size: int = 16
    block_size: int = 128
    grad_accum: int = 1
    batch_tokens: int | None = None  # if set, grad_accum is derived to reach this many tokens per update
    max_steps: int = 1000
    # A wall-time budget ("4m", "90s", "1h", or seconds): training stops when it is spent, and the
    # learning-rate schedule follows the elapsed fraction of it instead of steps/max_steps.
    max_time: str | None = None
    # Optimizer and schedule. muon: Muon (gptlab.train.muon) for the blocks' weight matrices (their updates
    # orthogonalized, scaled to AdamW's RMS), AdamW for the embeddings, the head, biases and gains.
    optimizer: str = "adamw"  # adamw | muon
    muon_lr: float | None = None  # muon: the blocks' matrices' peak lr (default: lr), same schedule; adamw: unused
    lr: float = 6e-4
    min_lr: float | None = None  # None: lr / 10 (nanoGPT's 6e-4 -> 6e-5), so a fine-tune's small lr needs only --set lr
    warmup_steps: int = 100
    schedule: str = "cosine"  # cosine | constant | wsd (warmup-stable-decay)
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly to min_lr
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still measured and logged)
    # Evaluation, logging, checkpoints.
    eval_interval: int = 250
    eval_steps: int = 20
    log_interval: int = 10
    checkpoint_interval: int | None = None  # default: eval_interval
    keep_checkpoints: int = 2
    sample_prompt: str = "\n"
    sample_tokens: int = 48
    progress: bool = True
    # Precision, device, distribution.
    precision: str = "auto"  # autocast precision: auto (measured per machine) | float32 | bfloat16 | float16
    device: str = "auto"
    compile: bool = False
    fsdp: bool = False
    seed: int = 1337
    resume: bool = False
    # Divergence guards.
    spike_zscore: float = 6.0  # skip an update whose grad norm is this many std above the window mean
    spike_window: int = 50
    max_bad_steps: int = 5  # this many skipped updates in a row stop the run

    def __post_init__(self) -> None:
        positive = ["batch_size", "block_size", "grad_accum", "max_steps", "eval_interval", "eval_steps"]
        positive += ["keep_checkpoints", "spike_window", "vocab_multiple", "max_bad_steps"]
        positive += ["checkpoint_interval"] if self.checkpoint_interval is not None else []
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {value!r}")
        for name in ("warmup_steps", "log_interval", "sample_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be a non-negative integer, got {getattr(self, name)!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not abs(self.seed) < SEED_LIMIT:
            raise ValueError(f"TrainConfig.seed must be an integer of magnitude below 2**40, got {self.seed!r} (the "
                             "loaders seed each batch with seed * 1,000,003 + k, which must fit 64 bits)")  # fmt: skip
        self._check_numbers()
        if not (self.lr > 0 and 0 <= self.final_lr <= self.lr):
            raise ValueError(f"TrainConfig needs lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"TrainConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        self._check_optimizer()
        self._check_ignored()
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        parse_duration(self.max_time)
        if not (self.trainable in ("all", "head") or re.fullmatch(r"last:\d+", self.trainable)):
            raise ValueError(f"TrainConfig.trainable must be all, head or last:N, got {self.trainable!r}")
        if self.lora_rank and self.trainable != "all":
            raise ValueError("trainable and lora_rank exclude each other: LoRA trains the adapters")
        if self.sft_layout not in ("pack", "pad"):
            raise ValueError(f"TrainConfig.sft_layout must be 'pack' or 'pad', got {self.sft_layout!r}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"TrainConfig.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"TrainConfig.lora_rank must be a non-negative integer, got {self.lora_rank!r}")
        if self.lora_rank:
            if self.init_from == "scratch":
                raise ValueError("lora_rank: LoRA adapts a trained model; set init_from to it")
            if self.fsdp:  # writing the PEFT adapter gathered the sharded adapters on rank 0 alone: a hang
                raise ValueError(
                    "lora_rank and fsdp exclude each other: train LoRA adapters under DDP (without --fsdp)"
                )
            self.lora_settings()  # validates alpha, dropout and the targets

    def _check_numbers(self) -> None:
        """Every real-valued setting finite (lr=inf passed, then trained on NaN) and in its range:
        spike_zscore <= 0 skipped healthy updates until the run stopped as diverged."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if "float" in str(f.type) and isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"TrainConfig.{f.name} must be a finite number, got {value}")
        if not self.spike_zscore > 0:
            raise ValueError(f"TrainConfig.spike_zscore must be > 0 (standard deviations above the recent mean that "
                             f"make a gradient norm a spike), got {self.spike_zscore}")  # fmt: skip
        for name in ("beta1", "beta2", "dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be in [0, 1), got {getattr(self, name)}")

    def _check_ignored(self) -> None:
        """Refuse settings the run would ignore, or read as off, without a word."""
        if not self.out_dir:
            raise ValueError("TrainConfig.out_dir is empty: name the run's directory")
        for name in ("weight_decay", "grad_clip"):  # grad_clip 0 is off; a negative one was off too
            if not getattr(self, name) >= 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        shape = [k for k in ("n_layer", "n_head", "n_embd", "bias") if getattr(self, k) is not None]
        shape += ["vocab_multiple"] if self.vocab_multiple != 1 else []
        if shape and self.init_from != "scratch":
            raise ValueError(f"{', '.join(shape)} shape a model made from scratch; init_from's model has its own")
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name.startswith("lora_")}
        lora = [k for k, v in defaults.items() if k != "lora_rank" and getattr(self, k) != v]
        if lora and not self.lora_rank:
            raise ValueError(f"{', '.join(lora)} set without lora_rank: set lora_rank > 0 to train adapters")
        if self.batch_tokens is not None and self.grad_accum != 1:
            raise ValueError("batch_tokens derives grad_accum: set one of them, not both")

    def _check_optimizer(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"TrainConfig.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.muon_lr is not None and not self.muon_lr > 0:
            raise ValueError(f"TrainConfig.muon_lr must be positive, got {self.muon_lr}")
        if self.optimizer == "muon" and self.fsdp:
            raise ValueError("optimizer='muon' needs whole matrices; FSDP shards them (use DDP, or adamw)")
        if self.optimizer == "muon" and self.lora_rank:
            raise ValueError("optimizer='muon' trains the blocks' full matrices; train LoRA adapters with adamw")

    def lora_settings(self):
        """The LoRASettings these fields describe (gptlab.lora)."""
        from gptlab.lora import LoRASettings

        targets = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())
        if not targets:  # no adapter: the run failed at its first backward, with a traceback
            raise ValueError(f"TrainConfig.lora_targets names no layer, got {self.lora_targets!r}")
        return LoRASettings(rank=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout, targets=targets)

    @property
    def final_lr(self) -> float:
        """min_lr, or lr / 10 when it is not set (kept None, so --set lr alone moves it too)."""
        return final_lr(self.lr, self.min_lr)

    @property
    def save_every(self) -> int:
        return self.checkpoint_interval or self.eval_interval

    @classmethod
    def from_toml(cls, path: str | os.PathLike, overrides: list[str] | dict | None = None) -> TrainConfig:
        """Settings from a TOML file (flat keys, or under a [train] table), then `overrides`."""
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"config {path}: {e}") from e
        tables = sorted(k for k, v in data.items() if isinstance(v, dict) and k != "train")
        if tables:  # their keys would be ignored, or read as one setting's value
            raise ValueError(f"config {path}: unknown table(s) [{'], ['.join(tables)}]; "
                             "settings go at the top level or under [train]")  # fmt: skip
        top, train = {k: v for k, v in data.items() if k != "train"}, data.get("train", {})
        if both := sorted(set(top) & set(train)):  # [train]'s value silently won
            raise ValueError(f"config {path}: {', '.join(both)} given both at the top level and under [train]; "
                             "give each setting once")  # fmt: skip
        data = {**top, **train}
        return cls().with_overrides(data).with_overrides(overrides or [])

    def with_overrides(self, overrides: list[str] | dict) -> TrainConfig:
        """A copy with fields replaced; `overrides` is a dict or ["key=value", ...] (strings parsed by field type)."""
        if not isinstance(overrides, dict):
            overrides = dict(split_override(o) for o in overrides)
        overrides = _renamed(overrides)
        fields = {f.name: f for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise ValueError(f"unknown TrainConfig key(s): {', '.join(unknown)}; known keys: {', '.join(fields)}")
        values = {k: _parse_value(k, v, fields[k].type) if isinstance(v, str) else _check_type(k, v, fields[k].type)
                  for k, v in overrides.items()}  # fmt: skip
        return dataclasses.replace(self, **values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def final_lr(lr: float, min_lr: float | None) -> float:
    """The schedule's last learning rate: min_lr, or lr / 10 (nanoGPT's ratio) when unset."""
    return lr / 10 if min_lr is None else min_lr


def parse_duration(value: str | float | int | None) -> float | None:
    """Seconds from 90, 90.0, "90", "90s", "4m", "1.5h" (None stays None)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*", str(value))
        if not match:
            raise ValueError(f"max_time {value!r}: expected seconds or a number with s, m or h (e.g. 90s, 4m, 1h)")
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if seconds <= 0:
        raise ValueError(f"max_time must be positive, got {value!r}")
    return seconds


def _renamed(overrides: dict) -> dict:
    """Map deprecated keys to their new names, with a warning; both at once is an error."""
    out = dict(overrides)
    for old, new in RENAMED.items():
        if old in out:
            if new in out:
                raise ValueError(f"TrainConfig: {old!r} is the old name of {new!r}; give only {new!r}")
            log.warning("TrainConfig: %r is deprecated, use %r (same values)", old, new)
            out[new] = out.pop(old)
    return out


def split_override(text: str) -> tuple[str, str]:
    """Split key=value (a leading -- and dashes in the key are accepted: --max-steps=5 is max_steps=5)."""
    key, sep, value = text.lstrip("-").partition("=")
    if not sep:
        raise ValueError(f"setting {text!r} must look like key=value")
    return key.strip().replace("-", "_"), value


TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "None": (type(None),)}


def _check_type(key: str, value, type_name: str):
    """A value given as its own type (TOML, a dict) must be of the field's annotation: true is no
    lr, 3 no device (they failed late, or silently read as 1.0)."""
    if key == "max_time":  # a duration string or seconds: parse_duration checks it
        return value
    kinds = [t.strip() for t in str(type_name).split("|")]
    allowed = tuple(t for kind in kinds for t in TYPES.get(kind, (object,)))
    if (isinstance(value, bool) and "bool" not in kinds) or not isinstance(value, allowed):
        raise ValueError(f"TrainConfig.{key} must be {type_name}, got {value!r}")
    return value


def _parse_value(key: str, value: str, type_name: str):
    """Parse a command-line string by the field's annotation ("int | None", "bool", "float", "str")."""
    kinds = [t.strip() for t in str(type_name).split("|")]
    if "None" in kinds and value.lower() in ("none", "null", ""):
        return None
    try:
        if "bool" in kinds:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if "int" in kinds:
            return int(value)
        if "float" in kinds:
            return float(value)
    except ValueError:
        raise ValueError(f"TrainConfig.{key}: cannot parse {value!r} as {type_name}") from None
    return value
