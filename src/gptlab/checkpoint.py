"""Native model files: the lowest layer of model I/O.

A native model directory holds `model.safetensors` (weights; a tied head stored once) and
`gptlab.json` (format, config, tokenizer name, and any extra metadata such as a quantization
scheme). Files are written through gptlab.atomic (a temporary name in the same directory, renamed
into place), so a crash never leaves a half-written file under the real name.

Turning a --model spec into a model (native, quantized, Hugging Face, other formats, presets) is
`gptlab.loading`'s job, one layer up; this module imports none of the readers above it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gptlab.atomic import atomic_write, atomic_write_text
from gptlab.classifier import model_for
from gptlab.config import GPTConfig
from gptlab.lora import lora_layers
from gptlab.meta import meta_device
from gptlab.model import GPT

log = logging.getLogger(__name__)
META_FILE = "gptlab.json"
WEIGHTS_FILE = "model.safetensors"


def save_model(model: GPT, directory: str | os.PathLike, *, tokenizer: str = "gpt2", extra: dict | None = None) -> None:
    """Write `model` as a native gptlab directory (weights first, then the metadata)."""
    _check_plain_weights(model)
    directory = Path(directory)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.ties_head:
        state.pop("lm_head.weight", None)  # the same tensor as wte; stored once
    atomic_write(directory / WEIGHTS_FILE, lambda tmp: save_file(state, tmp))
    meta = {"format": "gptlab", "config": model.config.to_dict(), "tokenizer": tokenizer, **(extra or {})}
    atomic_write_text(directory / META_FILE, json.dumps(meta, indent=2))


def _check_plain_weights(model: GPT) -> None:
    """Refuse what load_native could not read back: a quantized model's codes and scales, or LoRA
    adapters' tensors under the layers' names."""
    if scheme := getattr(model, "quantization", None):
        raise ValueError(f"model is quantized ({scheme['mode']}); save it with gptlab.quantize.save_quantized")
    if lora_layers(model):
        raise ValueError("model carries LoRA adapters: save them with gptlab.lora.save_adapter, "
                         "or fold them in first (gptlab.lora.merge)")  # fmt: skip


def read_meta(directory: str | os.PathLike) -> dict:
    path = Path(directory) / META_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable gptlab model file ({getattr(e, 'strerror', None) or e})") from e
    if not isinstance(meta, dict) or meta.get("format") != "gptlab":
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path}: not a gptlab model file (format={found!r})")
    if not isinstance(meta.get("config"), dict):
        raise ValueError(f"{path}: no model config (a 'config' object) in it")
    if not isinstance(meta.get("quantization") or {}, dict):
        raise ValueError(f"{path}: 'quantization' must be an object, got {meta['quantization']!r}")
    return meta


def load_native(directory: str | os.PathLike, *, device=None, dtype=None) -> GPT:
    """Load a directory written by save_model, building on the meta device and assigning tensors."""
    directory = Path(directory)
    meta = read_meta(directory)
    if meta.get("quantization"):
        raise ValueError(
            f"{directory} holds a {meta['quantization']['mode']} quantized model; load it with gptlab.load_model (or gptlab.quantize.load_quantized)"
        )
    config = GPTConfig.from_dict(meta["config"])
    with meta_device():
        model = model_for(config)
    try:
        state = load_file(directory / WEIGHTS_FILE, device=str(device or "cpu"))
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise ValueError(f"{directory / WEIGHTS_FILE}: cannot read weights ({e})") from e
    if config.ties_head and "transformer.wte.weight" in state:  # else load_state_strict names it missing
        state["lm_head.weight"] = state["transformer.wte.weight"]
    load_state_strict(model, state, str(directory))
    model.tie_weights()
    if dtype is not None:
        model.to(dtype=dtype)
    return model.eval()


def load_state_strict(model: GPT, state: dict[str, torch.Tensor], source: str) -> None:
    """Assign `state` into `model` (which may live on the meta device); any mismatch names the tensor."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, the model expects {tuple(expected[name].shape)}"
            )
        want = expected[name].dtype  # any float dtype is a float model's; integer (quantized) ones are exact
        if tensor.dtype != want and not (tensor.dtype.is_floating_point and want.is_floating_point):
            raise ValueError(f"{source}: tensor {name} is {tensor.dtype}, the model expects {want}")
    model.load_state_dict(state, strict=True, assign=True)
