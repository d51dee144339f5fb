"""llm.c checkpoints (`gpt2_124M.bin`, `gpt2_124M_bf16.bin`, and what llm.c's trainers write).

The layout, from llm.c's train_gpt2.py (`write_model`, `write_tensors`) and train_gpt2.c
(`gpt2_build_from_checkpoint`, `fill_in_parameter_sizes`):
- a header of 256 little-endian int32: magic 20240326, version (3: fp32, 5: bf16), maxT (context),
  V (vocabulary), L (layers), NH (heads), C (channels), Vp (V padded to a multiple of 128); the
  rest zeros;
- then every parameter, in the header's dtype, in this order: wte (Vp, C) with the padded rows
  zero, wpe (maxT, C), and per kind, stacked over the L layers: ln1w, ln1b (L, C), qkvw (L, 3C, C),
  qkvb (L, 3C), attprojw (L, C, C), attprojb (L, C), ln2w, ln2b (L, C), fcw (L, 4C, C),
  fcb (L, 4C), fcprojw (L, C, 4C), fcprojb (L, C); then lnfw, lnfb (C).
Matrices are nn.Linear's (out, in), as gptlab keeps them. The head is tied to wte; the MLP is 4C
wide with GPT-2's tanh GELU and LayerNorm's epsilon is 1e-5, all fixed by llm.c's code.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from gptlab.atomic import atomic_write
from gptlab.checkpoint import load_state_strict
from gptlab.config import GPTConfig
from gptlab.meta import meta_device
from gptlab.model import GPT

log = logging.getLogger(__name__)

MAGIC = 20240326
HEADER_INTS = 256
VERSIONS = {3: torch.float32, 5: torch.bfloat16}  # checkpoint version -> parameter dtype
VOCAB_MULTIPLE = 128  # llm.c pads the vocabulary to a multiple of 128 at export
LAYER_NORM_EPS = 1e-5

# llm.c's parameter tensors in file order: (gptlab name with {i} for the layer, stacked over layers?)
PARAMETERS = [
    ("transformer.wte.weight", False),
    ("transformer.wpe.weight", False),
    ("transformer.h.{i}.ln_1.weight", True),
    ("transformer.h.{i}.ln_1.bias", True),
    ("transformer.h.{i}.attn.c_attn.weight", True),
    ("transformer.h.{i}.attn.c_attn.bias", True),
    ("transformer.h.{i}.attn.c_proj.weight", True),
    ("transformer.h.{i}.attn.c_proj.bias", True),
    ("transformer.h.{i}.ln_2.weight", True),
    ("transformer.h.{i}.ln_2.bias", True),
    ("transformer.h.{i}.mlp.c_fc.weight", True),
    ("transformer.h.{i}.mlp.c_fc.bias", True),
    ("transformer.h.{i}.mlp.c_proj.weight", True),
    ("transformer.h.{i}.mlp.c_proj.bias", True),
    ("transformer.ln_f.weight", False),
    ("transformer.ln_f.bias", False),
]
WTE = "transformer.wte.weight"


def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def tensor_order(n_layer: int) -> list[str]:
    """Every parameter's gptlab name in the file's order."""
    names = []
    for name, stacked in PARAMETERS:
        names += [name.format(i=i) for i in range(n_layer)] if stacked else [name]
    return names


# ------------------------------------------------------------------------------------- reading


def read_header(path: str | os.PathLike) -> dict:
    """The header's fields, checked: magic, version, maxT, V, L, NH, C, Vp, dtype."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(HEADER_INTS * 4)
    if len(raw) != HEADER_INTS * 4:
        raise ValueError(f"{path}: {len(raw)} bytes, shorter than llm.c's 1024-byte header")
    header = np.frombuffer(raw, dtype="<i4")
    if header[0] != MAGIC:
        raise ValueError(f"{path}: not an llm.c checkpoint (magic {header[0]}, expected {MAGIC})")
    version = int(header[1])
    if version not in VERSIONS:
        raise ValueError(f"{path}: llm.c checkpoint version {version}; gptlab reads versions 3 (fp32) and 5 (bf16)")
    fields = dict(zip(("maxT", "V", "L", "NH", "C", "Vp"), (int(x) for x in header[2:8]), strict=True))
    if min(fields.values()) <= 0 or fields["Vp"] < fields["V"] or fields["C"] % fields["NH"]:
        raise ValueError(f"{path}: inconsistent llm.c header {fields}")
    return {"version": version, "dtype": VERSIONS[version], **fields}


def file_size(header: dict) -> int:
    """The bytes of a file with this header, as llm.c's fill_in_parameter_sizes counts them: the
    header, wte (Vp, C), wpe (maxT, C), L layers of 12*C*C + 13*C values, and lnfw, lnfb (C)."""
    C, L = header["C"], header["L"]
    n_values = (header["Vp"] + header["maxT"]) * C + L * (12 * C * C + 13 * C) + 2 * C
    return HEADER_INTS * 4 + n_values * header["dtype"].itemsize


def config_from_header(header: dict) -> GPTConfig:
    return GPTConfig(
        vocab_size=header["V"],
        block_size=header["maxT"],
        n_layer=header["L"],
        n_head=header["NH"],
        n_embd=header["C"],
        layer_norm_eps=LAYER_NORM_EPS,
    )


def load(path: str | os.PathLike, *, device=None, dtype=None) -> GPT:
    """A gptlab GPT from an llm.c checkpoint, without wte's padded vocabulary rows.

    dtype None keeps the file's dtype (float32 for version 3, bfloat16 for version 5).
    """
    path = Path(path)
    header = read_header(path)
    config = config_from_header(header)
    file_dtype = header["dtype"]
    size = path.stat().st_size
    if size != file_size(header):  # before building: a damaged header can ask for a million layers
        raise ValueError(
            f"{path}: {size:,} bytes; an llm.c {config.n_layer}-layer model with header {header} takes "
            f"{file_size(header):,}"
        )
    with meta_device():
        model = GPT(config)
    expected = model.state_dict()
    names = tensor_order(config.n_layer)
    state = {}
    with open(path, "rb") as f:
        f.seek(HEADER_INTS * 4)
        for name in names:
            tensor = torch.empty(expected[name].shape, dtype=file_dtype)
            _read_into(f, tensor)
            if name == WTE:  # skip the padded rows (Vp - V, C)
                f.seek((header["Vp"] - header["V"]) * header["C"] * file_dtype.itemsize, os.SEEK_CUR)
            state[name] = tensor.to(device=device or "cpu", dtype=dtype or file_dtype)
    state["lm_head.weight"] = state[WTE]
    load_state_strict(model, state, str(path))
    model.tie_weights()
    log.info(
        "loaded llm.c checkpoint %s (version %d): %s parameters", path, header["version"], f"{model.num_params():,}"
    )
    return model.eval()


def _read_into(f, tensor: torch.Tensor) -> None:
    buffer = tensor.view(-1).view(torch.uint8).numpy()  # the tensor's own bytes (little-endian)
    if f.readinto(buffer) != tensor.nbytes:
        raise ValueError(f"{f.name}: truncated")


# ------------------------------------------------------------------------------------- writing


def check_exportable(config: GPTConfig) -> None:
    """ValueError unless llm.c's fixed GPT-2 computes the same function as this config."""
    problems = {
        "RoPE positions (llm.c learns a position table)": config.pos_embedding != "learned",
        "RMSNorm (llm.c uses LayerNorm)": config.norm != "layernorm",
        "a SwiGLU MLP (llm.c's MLP is GELU)": config.mlp == "swiglu",
        f"an MLP {config.mlp_hidden} wide (llm.c's is 4*n_embd = {4 * config.n_embd})": config.mlp_hidden
        != 4 * config.n_embd,
        "an untied head (llm.c ties it to wte)": not config.tie_weights,
        f"layer_norm_eps {config.layer_norm_eps} (llm.c's is {LAYER_NORM_EPS})": config.layer_norm_eps
        != LAYER_NORM_EPS,
    }
    used = [what for what, bad in problems.items() if bad]
    if used:
        raise ValueError(f"llm.c cannot represent this model: it has {'; '.join(used)}")


def save(model: GPT, path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> None:
    """Write `model` as an llm.c checkpoint: version 3 (float32) or 5 (bfloat16).

    A model without biases is written with zero biases (the same function). nanoGPT's exact GELU
    becomes llm.c's tanh GELU, with a warning.
    """
    config = model.config
    check_exportable(config)
    version = {v: k for k, v in VERSIONS.items()}.get(dtype)
    if version is None:
        raise ValueError(f"llm.c checkpoints hold float32 or bfloat16 weights, not {dtype}")
    if config.mlp == "gelu_erf":
        log.warning("llm.c computes GPT-2's tanh GELU; this model's exact (erf) GELU is not kept")
    own = {k: v.detach() for k, v in model.state_dict().items()}
    unexpected = sorted(set(own) - set(tensor_order(config.n_layer)) - {"lm_head.weight"})
    if unexpected:
        raise ValueError(f"the model has tensors llm.c does not ({', '.join(unexpected[:3])}); export a float model")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    vp = padded_vocab(config.vocab_size)
    header[:8] = [
        MAGIC,
        version,
        config.block_size,
        config.vocab_size,
        config.n_layer,
        config.n_head,
        config.n_embd,
        vp,
    ]
    shapes = _shapes_with_biases(config)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            for name in tensor_order(config.n_layer):
                tensor = own[name] if name in own else torch.zeros(shapes[name])  # bias=False: zero biases
                if name == WTE:
                    tensor = torch.cat([tensor, tensor.new_zeros(vp - config.vocab_size, config.n_embd)])  # (Vp, C)
                _write(f, tensor, dtype)

    atomic_write(path, write)
    log.debug(
        "wrote llm.c checkpoint %s (version %d, vocabulary padded %d -> %d)", path, version, config.vocab_size, vp
    )


def _shapes_with_biases(config: GPTConfig) -> dict[str, torch.Size]:
    """The shape of every parameter of this model with biases (llm.c always has them)."""
    with meta_device():
        model = GPT(GPTConfig(**{**config.to_dict(), "bias": True}))
    return {name: tensor.shape for name, tensor in model.state_dict().items()}


def _write(f, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    tensor = tensor.to(device="cpu", dtype=dtype).contiguous()
    f.write(tensor.view(-1).view(torch.uint8).numpy())  # little-endian, row-major
