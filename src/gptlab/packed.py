"""Faster CPU inference: each nn.Linear's weight reordered once into oneDNN's blocked layout.

Batch-1 decoding is a chain of matrix-vector products, so its speed is how fast the weights
stream from memory. On CPU, nn.Linear's fp32 matrix-vector product reads an (out, in) weight at
~17 GB/s on our 2-core machine, single-threaded; oneDNN's inner product on a prepacked weight
reads at 40-60 GB/s on both cores (bf16 too), and is faster for prompts and batches as well.
The arithmetic is the same up to summation order (fp32 results agree to ~1e-6 relative).

`pack_linears(model)` swaps every nn.Linear, the head included, for a PackedLinear in place;
`unpack_linears(model)` restores plain nn.Linear modules with bit-identical weights. A tied head
gets its own packed copy (the token table stays dense for the embedding lookup), which costs
vocab_size x n_embd more memory: 31% of GPT-2 small. Packed models are for inference: the
kernel has no backward, so a forward that autograd would differentiate is refused.
`state_dict()` still holds the dense weights, so saving a packed model loses nothing.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from gptlab.kernels import Linear

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(model: nn.Module) -> tuple[bool, str]:
    """Whether pack_linears applies to this model, and why not if not."""
    p = next(model.parameters())
    if p.device.type != "cpu":
        return False, f"weights on {p.device.type}; packing is a CPU (oneDNN) layout"
    if not torch.backends.mkldnn.is_available():
        return False, "this PyTorch build has no oneDNN (mkldnn)"
    if p.dtype not in PACKABLE_DTYPES:
        return False, f"dtype {p.dtype}; packing handles float32 and bfloat16"
    if p.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False, "this CPU has no bf16 support in oneDNN"
    return True, ""


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's prepacked layout; inference only."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())  # opaque layout
        self.bias = linear.bias  # shared Parameter or None

    @property
    def weight(self) -> torch.Tensor:
        """The dense (out, in) weight, unpacked on demand (a copy: for inspection and saving)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad)):
            raise RuntimeError(
                "packed weights are for inference: run under torch.no_grad(), or unpack_linears() to train"
            )
        if x.dtype != self.packed.dtype or x.device.type != "cpu":
            raise ValueError(
                f"weights packed as {self.packed.dtype} on cpu, input is {x.dtype} on {x.device}: "
                "unpack_linears(model) before .to(...), then pack_linears again"
            )
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")  # (..., out)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        """load_state_dict() takes dense weights, as state_dict() gives them, and packs them."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
        key, shape = prefix + "weight", (self.out_features, self.in_features)
        if key in unexpected:
            unexpected.remove(key)
        if key not in state_dict:
            missing.append(key)
        elif tuple(state_dict[key].shape) != shape:
            errors.append(f"size mismatch for {key}: {tuple(state_dict[key].shape)} given, {shape} here")
        else:
            weight = state_dict[key].detach().to(device="cpu", dtype=self.packed.dtype)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)

    def __deepcopy__(self, memo):
        return PackedLinear(copy.deepcopy(self.unpack(), memo))

    def unpack(self) -> nn.Linear:
        """A plain nn.Linear with the same (bit-identical) weight and bias."""
        weight = self.weight
        linear = Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, dtype={self.packed.dtype}"


def pack_linears(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear in `model` for a PackedLinear, in place; returns the model in eval mode
    with gradients off. Raises ValueError when the model cannot be packed (see can_pack)."""
    ok, why = can_pack(model)
    if not ok:
        raise ValueError(f"cannot pack this model's weights: {why}")
    model.eval().requires_grad_(False)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            model.set_submodule(name, PackedLinear(module))
    return model


def unpack_linears(model: nn.Module) -> nn.Module:
    """Undo pack_linears, in place: plain nn.Linear modules again, the head re-tied when the
    config ties it. Gradients stay off; call requires_grad_() to train."""
    for name, module in list(model.named_modules()):
        if isinstance(module, PackedLinear):
            model.set_submodule(name, module.unpack())
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def is_packed(model: nn.Module) -> bool:
    """Whether any of the model's linear layers are packed."""
    return any(isinstance(m, PackedLinear) for m in model.modules())


def maybe_pack(model: nn.Module) -> nn.Module:
    """pack_linears where it applies (CPU, fp32/bf16, oneDNN), the model unchanged elsewhere."""
    return pack_linears(model) if can_pack(model)[0] else model
