"""nanoGPT checkpoints: the `ckpt.pt` that nanoGPT's train.py writes, as a gptlab GPT.

train.py saves `{'model': state_dict, 'optimizer': ..., 'model_args': {n_layer, n_head, n_embd,
block_size, bias, vocab_size, dropout}, 'iter_num', 'best_val_loss', 'config'}` with torch.save.
gptlab's parameter names are nanoGPT's (`transformer.h.0.attn.c_attn.weight`, nn.Linear (out, in)
layout), so reading is a matter of:
- `_orig_mod.` prefixes, present when the model was wrapped by torch.compile, are removed;
- biases (Linear and LayerNorm) exist only when `bias=True`;
- `lm_head.weight` is the token embedding (tied), stored under both names;
- torch < 2.0 runs of nanoGPT also saved the causal mask buffer `attn.bias` (1, 1, T, T), dropped.

The file is read with `torch.load(weights_only=True)`: everything train.py saves is plain data
(dicts, lists, numbers, strings, tensors; the AdamW state's `step` and `best_val_loss` are tensors),
which the restricted unpickler accepts, so no code from the file runs.

nanoGPT's MLP uses `nn.GELU()`, the exact (erf) GELU, not GPT-2's tanh approximation: the loaded
model's config says `mlp="gelu_erf"`: its MLPs compute the exact erf GELU, as nanoGPT's nn.GELU().
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from gptlab.checkpoint import load_state_strict
from gptlab.config import GPTConfig
from gptlab.meta import meta_device
from gptlab.model import GPT

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "ckpt.pt"
COMPILED_PREFIX = "_orig_mod."
MODEL_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")
MASK_BUFFER = re.compile(r"^transformer\.h\.\d+\.attn\.bias$")  # 4-D causal mask; c_attn.bias is another name
HEAD = "lm_head.weight"
WTE = "transformer.wte.weight"


def checkpoint_path(path: str | Path) -> Path:
    """The checkpoint file: `path` itself, or `path/ckpt.pt` for nanoGPT's out_dir."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no nanoGPT checkpoint there")
    return path


def read_checkpoint(path: Path) -> dict:
    """The dict train.py saved, loaded on the CPU without running any code from the file."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # refused globals, damaged zip archives, truncated files
        refused = re.search(r"WeightsUnpickler error: ([^\n]*?)(\. Please|$)", str(e), re.MULTILINE)
        detail = refused.group(1) if refused else (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"{path}: cannot read it as a nanoGPT checkpoint with torch.load(weights_only=True): {detail}"
        ) from e
    if not isinstance(checkpoint, dict) or "model" not in checkpoint or "model_args" not in checkpoint:
        keys = sorted(map(str, checkpoint))[:5] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ValueError(f"{path}: not a nanoGPT checkpoint (expected 'model' and 'model_args', found {keys})")
    return checkpoint


def config_from_model_args(model_args: dict, tied: bool, source: str) -> GPTConfig:
    """GPTConfig of nanoGPT's GPTConfig fields; dropout is a training setting and is not kept."""
    if not isinstance(model_args, dict):
        raise ValueError(f"{source}: model_args is a {type(model_args).__name__}, not a dict")
    missing = [k for k in MODEL_ARGS if k not in model_args]
    if missing:
        raise ValueError(f"{source}: model_args lacks {', '.join(missing)}")
    try:
        return GPTConfig(
            **{k: model_args[k] for k in MODEL_ARGS},
            dropout=0.0,
            layer_norm_eps=1e-5,  # nanoGPT's LayerNorm hard-codes it
            mlp="gelu_erf",
            tie_weights=tied,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: model_args {model_args}: {e}") from e


def model_state(state: dict, source: str) -> tuple[dict[str, torch.Tensor], bool]:
    """(gptlab state dict, tied?) from nanoGPT's state dict: prefixes and mask buffers removed."""
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):  # fmt: skip
        raise ValueError(f"{source}: checkpoint['model'] is not a state dict of tensors")
    out = {}
    for name, tensor in state.items():
        name = name.removeprefix(COMPILED_PREFIX)
        if MASK_BUFFER.match(name) and tensor.dim() == 4:
            continue
        out[name] = tensor
    head, wte = out.get(HEAD), out.get(WTE)
    tied = head is None or (wte is not None and head.shape == wte.shape and torch.equal(head, wte))
    if wte is None:
        raise ValueError(f"{source}: checkpoint['model'] has no {WTE}, the token embedding")
    if tied:
        out.pop(HEAD, None)
    return out, tied


def load(path: str | Path, *, device=None, dtype=None) -> GPT:
    """A gptlab GPT with the weights of nanoGPT's `ckpt.pt` (or of the out_dir holding it).

    dtype None keeps the checkpoint's dtype. Missing, unexpected or wrongly shaped tensors raise
    ValueError naming them.
    """
    path = checkpoint_path(path)
    checkpoint = read_checkpoint(path)
    state, tied = model_state(checkpoint["model"], str(path))
    config = config_from_model_args(checkpoint["model_args"], tied, str(path))
    with meta_device():
        model = GPT(config)
    dtype = dtype or (state[WTE].dtype if WTE in state else torch.float32)
    state = {k: v.to(device=device or "cpu", dtype=dtype) for k, v in state.items()}
    if tied:
        state[HEAD] = state[WTE]
    load_state_strict(model, state, str(path))
    model.tie_weights()
    log.info(
        "loaded nanoGPT checkpoint %s (iter %s, best val loss %s): %s parameters",
        path,
        checkpoint.get("iter_num"),
        _number(checkpoint.get("best_val_loss")),
        f"{model.num_params():,}",
    )
    return model.eval()


def _number(value):
    return round(float(value), 4) if isinstance(value, (int, float, torch.Tensor)) else value
