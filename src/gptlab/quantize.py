"""Quantized inference: int8 and int4 weights for every linear layer, the output head included.

Decoding one sequence reads every weight once per token, so on a CPU the speed is set by the
bytes of weights. This module stores them in fewer bytes:

- int8: symmetric, one scale per output channel; w ~= q * scale with q in [-127, 127].
- int4: asymmetric, one (scale, zero) pair per group of `group_size` inputs of a row;
  w ~= (q - 8) * scale + zero with q in [0, 15] (PyTorch's tinygemm convention), stored as
  nibbles, two per byte (even column in the low nibble): `pack_int4`/`unpack_int4`.

"Pack" means only that nibble packing here. The layouts PyTorch's own kernels want (fbgemm's
weight object for int8, tinygemm's for int4) are each named after their library.

Scales and zeros are bfloat16 numbers, the precision PyTorch's CPU kernels read, so the stored
checkpoint, `dequantize()` and the kernels all describe one and the same matrix.

On the CPU, decoding (a few rows) runs gptlab's own kernels (gptlab.kernels, every x86-64 level)
on the stored buffers as they are: the activations quantized to int8 (one scale per row, for int8
and int4 weights alike), integer dot products, one scale per row or group of the weight.
Prompts and batches (many rows) of int8 layers take, on CPUs with AVX-512 VNNI, PyTorch's oneDNN
int8 x int8 product (`onednn::qlinear_pointwise`, AMX where the CPU has it) on x quantized per row
by gptlab's kernel, or fbgemm's dynamic `quantized::linear_dynamic` (x quantized with one scale for
all rows), whichever was measured faster on the machine (gptlab.int8_prompts); gptlab's int8
kernel elsewhere (without VNNI fbgemm's 16-bit intermediate sums saturate: a 1.08% perplexity rise
measured on an AMD EPYC). int4 prompts dequantize, then multiply in a GEMM. Without gptlab's kernels (no C compiler,
`GPTLAB_KERNELS=0` or `kernels.use_kernels(False)`), PyTorch's int kernels stand in: fbgemm's for
int8 where it is exact (VNNI), else `_weight_int8pack_mm` with bf16 activations, and
`_weight_int4pack_mm_for_cpu`; `activations="float"` (int8) always takes `_weight_int8pack_mm`.
Off the CPU, layers dequantize the weight and call `F.linear`.

The head is tied to the token embedding in GPT-2; after quantization the embedding lookup reads
its rows from the quantized head table (`QuantizedEmbedding`), so the checkpoint stores the matrix
once, quantized. An untied model keeps its float embedding.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from gptlab import int8_prompts, kernels, ops
from gptlab import linear as linear_layer
from gptlab.atomic import atomic_write, atomic_write_text
from gptlab.checkpoint import META_FILE, WEIGHTS_FILE, load_state_strict, read_meta
from gptlab.config import GPTConfig
from gptlab.lora import lora_layers
from gptlab.meta import meta_device
from gptlab.model import GPT

log = logging.getLogger(__name__)

MODES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
DEFAULT_GROUP_SIZE = 64
ACTIVATIONS = ("float", "int8")  # int8 weights times float (bf16) or dynamically quantized int8 activations
# int8 x int8 (VNNI) measured 1.4x faster than weight-only here (README "Quantization"); "float" is more accurate.
DEFAULT_ACTIVATIONS = "int8"
_EPS = 1e-8  # smallest scale, so all-zero rows and groups stay finite


# ---------------------------------------------------------------- primitives


def bf16_round_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 value >= x for positive finite fp32 x (so x / result never exceeds 1)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w (N, K) -> q int8 (N, K), scales bf16 (N,) with w ~= q * scales[:, None]."""
    w = w.detach().float()
    scales = bf16_round_up((w.abs().amax(dim=1) / 127).clamp(min=_EPS))  # (N,)
    q = (w / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)  # (N, K)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q int8 (N, K), scales (N,) -> fp32 (N, K)."""
    return q.float() * scales.float()[:, None]


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4: w (N, K) -> q uint8 (N, K) in [0, 15], scales and zeros bf16 (N, K/g).

    Each group of `group_size` consecutive inputs of a row maps its [min, max] onto 16 levels;
    w ~= (q - 8) * scale + zero.
    """
    N, K = w.shape
    check_group_size(K, group_size)
    wg = w.detach().float().reshape(N, K // group_size, group_size)  # (N, G, g)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # (N, G)
    scales = bf16_round_up(((hi - lo) / 15).clamp(min=_EPS))  # (N, G)
    zeros = (lo + 8 * scales.float()).to(torch.bfloat16)  # (N, G): the value of level 8
    q = (wg - zeros.float()[..., None]) / scales.float()[..., None] + 8  # (N, G, g)
    return q.round().clamp(0, 15).to(torch.uint8).reshape(N, K), scales, zeros


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """q uint8 (..., K) in [0, 15], scales and zeros (..., K/g) -> fp32 (..., K)."""
    G = scales.size(-1)
    qg = q.float().unflatten(-1, (G, q.size(-1) // G))  # (..., G, g)
    return ((qg - 8) * scales.float()[..., None] + zeros.float()[..., None]).flatten(-2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit values (nibbles) per byte: q uint8 (N, K) in [0, 15] -> (N, K/2), even column in the low nibble."""
    if q.size(-1) % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {q.size(-1)}")
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"int4 values must lie in [0, 15], got {int(q.max())}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)  # (N, K/2)


def unpack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: (N, K/2) uint8 -> (N, K) uint8 in [0, 15]."""
    low, high = nibbles & 0x0F, nibbles >> 4  # (N, K/2) each
    return torch.stack([low, high], dim=-1).flatten(-2)  # (N, K)


def is_group_size(group_size) -> bool:
    """Whether group_size is one of GROUP_SIZES as an int (64.0 == 64, but shapes need ints; True == 1)."""
    return isinstance(group_size, int) and not isinstance(group_size, bool) and group_size in GROUP_SIZES


def check_group_size(in_features: int, group_size: int) -> None:
    if not is_group_size(group_size):
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size!r}")
    if in_features % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide the input dimension {in_features}")


# ---------------------------------------------------------------- modules


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is stored quantized; subclasses define the scheme.

    `prepare()` builds the CPU kernel's own weight layout from the stored buffers (it is not part
    of the state dict) and must run after the buffers change, as quantize_model and
    load_quantized do. Without it, or off the CPU, forward dequantizes the weight and calls F.linear.
    """

    mode = ""
    passes_gradients = False  # set by gptlab.lora.apply_lora: a frozen base under trained adapters

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self._kernel_weights: tuple | None = None  # PyTorch's kernel layouts (prompts, batches)
        self._decode = None  # gptlab's decoding kernel with this layer's buffers bound (gptlab.kernels)
        self._decode_rows = kernels.MAX_ROWS  # up to this many rows take it
        self._kernels_off_cpu = False  # bound before a move off the CPU (see _apply)
        self.use_kernel = True
        self.training = False  # for inference; model.train() still reaches it (and forward then refuses)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled() and not self.passes_gradients:
            raise RuntimeError(
                "quantized layers are for inference (their weights are not parameters): train the float "
                "model, or dequantize_model(model) and train that, or train LoRA adapters on it"
            )
        if torch.is_grad_enabled() and x.requires_grad:
            return _InputGradient.apply(x, self)
        return self._infer(x)

    def _apply(self, fn, recurse=True):
        """model.to(device), share_memory(), ...: the kernels hold the buffers' data pointers, so
        they are bound again to the moved buffers (they read freed memory). A dtype conversion
        (model.to(torch.bfloat16)) leaves this layer's stored scheme as it is: its activations
        follow the input's dtype."""
        probes = {d: fn(torch.zeros(1, dtype=d)) for d in (torch.float32, torch.bfloat16)}
        if any(p.dtype is not d for d, p in probes.items()):  # a dtype conversion: move, keep the stored dtypes
            fn = functools.partial(torch.Tensor.to, device=probes[torch.float32].device)
        bound = self._decode is not None or self._kernel_weights is not None or self._kernels_off_cpu
        super()._apply(fn, recurse)
        if bound:  # bound to the buffers before they moved
            self.prepare()
            # off the CPU prepare binds nothing: back on it, bind again (.cuda().cpu() ran unbound for good)
            self._kernels_off_cpu = self._decode is None and self._kernel_weights is None
        return self

    def __getstate__(self):
        # The kernels are bound to the buffers by their data pointers (closures, packed weights):
        # a copy (copy.deepcopy) or a pickled layer (torch.save(model)) would run the original's,
        # and neither pickles. It keeps whether they were bound and binds its own (__setstate__),
        # for the machine it is loaded on.
        state = dict(self.__dict__)
        state["_kernels_bound"] = self._decode is not None or self._kernel_weights is not None
        state["_decode"] = state["_kernel_weights"] = None
        return state

    def __setstate__(self, state):
        bound = state.pop("_kernels_bound", False)
        super().__setstate__(state)
        if bound:
            self.prepare()

    def _infer(self, x: torch.Tensor) -> torch.Tensor:
        if self._decode is not None and self.use_kernel and ops.int_kernels_apply(x, self._decode_rows):
            y = self._decode(x)  # decoding: gptlab's kernel, fp32 (..., N), bias included
            return y if x.dtype is torch.float32 else y.to(x.dtype)
        if self.use_kernel and self._kernel_weights is not None and x.device.type == "cpu" and x.numel():
            y = self._kernel(x.reshape(-1, self.in_features))  # (B*T, N), bias included
            return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantize().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        """The full fp32 weight (out_features, in_features) this layer stands for."""
        return self.dequantize_rows(slice(None))

    def dequantize_rows(self, rows) -> torch.Tensor:
        """fp32 rows of the weight: `rows` is an index tensor (any shape) or a slice."""
        raise NotImplementedError

    def prepare(self) -> None:
        raise NotImplementedError

    def _kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        """x2d (M, K) -> (M, N) in the kernel's dtype, bias added."""
        raise NotImplementedError

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        # one op: the add promotes a bf16 y to the fp32 bias, exactly
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class _InputGradient(torch.autograd.Function):
    """y = layer(x) by the quantized layer's own kernels; the gradient flows to x only, through
    the dequantized weight (dx = dy W): what a frozen base passes back to the layers before it."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        with torch.no_grad():
            return layer._infer(x)

    @staticmethod
    def backward(ctx, grad_y):
        weight = ctx.layer.dequantize().to(grad_y.dtype)  # (N, K)
        return grad_y @ weight, None  # (..., K)


class Int8Linear(QuantizedLinear):
    """int8 weights (N, K), one bf16 scale per output row."""

    mode = "int8"

    def __init__(self, in_features, out_features, bias=True, activations=DEFAULT_ACTIVATIONS, device=None):
        super().__init__(in_features, out_features, bias, device)
        if activations not in ACTIVATIONS:
            raise ValueError(f"int8 activations must be one of {ACTIVATIONS}, got {activations!r}")
        self.activations = activations
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.bfloat16, device=device))

    @classmethod
    def from_linear(cls, linear: nn.Linear, activations=DEFAULT_ACTIVATIONS) -> Int8Linear:
        module = cls(
            linear.in_features, linear.out_features, linear.bias is not None, activations, linear.weight.device
        )
        module.weight, module.scales = quantize_int8(linear.weight)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach().float())
        return module

    def dequantize_rows(self, rows) -> torch.Tensor:
        return self.weight[rows].float() * self.scales[rows].float()[..., None]

    def prepare(self, prompts_gemm: str | None = None) -> None:
        """Bind the CPU kernels to the stored buffers. prompts_gemm: whose int8 product takes prompts
        where fbgemm would keep full precision, "fbgemm" or "onednn" (None: int8_prompts.gemm_choice)."""
        self._kernel_weights = self._decode = None
        self._prompts_in_kernel, self._decode_rows = False, kernels.MAX_ROWS  # prompts: fbgemm unless set below
        if self.weight.device.type != "cpu":
            return
        self.weight, self.scales = _aligned(self.weight), _aligned(self.scales)
        prompt_weight, self._prompts_gemm = None, "fbgemm"
        if self.activations == "int8":
            _, kernel, no_kernel = kernels.available()
            exact = ops.fbgemm_int8_is_exact()
            int8_prompts.warn_if_forced_in_vain(kernel, exact, no_kernel)
            if kernel:  # decoding (a few rows): gptlab's kernel, the same int8 x int8 product as fbgemm's
                row_sums = self.weight.sum(dim=1, dtype=torch.int32)  # (N,) for gptlab's kernel (kernels.c)
                self._decode = ops.int8_decoder(self.weight, self.scales, row_sums, self.bias)
            if kernel and not exact:  # fbgemm would saturate its 16-bit sums: gptlab's kernel takes prompts too
                self._prompts_in_kernel, self._decode_rows = True, sys.maxsize
            elif exact:  # else no kernel and no exact int8 product: weight-only int8 below
                self._prompts_gemm = (prompts_gemm or int8_prompts.gemm_choice(Int8Linear)) if kernel else "fbgemm"
                prompt_weight = self._prompt_weight()
        self._kernel_weights = (self.weight, self.scales, prompt_weight)

    def _prompt_weight(self):
        """The weight in the layout of the int8 x int8 product that takes prompts (_prompts_gemm)."""
        if self._prompts_gemm == "onednn":
            return int8_prompts.OnednnInt8Weight(self.weight, self.scales)
        with warnings.catch_warnings():  # torch.ao's deprecation notice; the kernel itself stays
            warnings.simplefilter("ignore")
            qweight = torch._make_per_channel_quantized_tensor(
                self.weight, self.scales.double(), torch.zeros(self.out_features, dtype=torch.long), 0
            )
        return torch.ops.quantized.linear_prepack(qweight, None)  # fbgemm's own layout: x quantized on the fly

    def _kernel(self, x2d):
        weight, scales, prompt_weight = self._kernel_weights
        # torch.compile cannot trace fbgemm's weight object (or ctypes): compiled graphs run weight-only.
        if self._prompts_in_kernel and not torch.compiler.is_compiling():
            return self._decode(x2d)  # gptlab's exact int8 kernel where fbgemm's would saturate (see prepare)
        if prompt_weight is not None and not torch.compiler.is_compiling():
            if self._prompts_gemm == "onednn":
                return self._onednn_product(x2d, prompt_weight)
            return self._add_bias(torch.ops.quantized.linear_dynamic(x2d.float().contiguous(), prompt_weight, False))
        # fp32 activations take a slow reference path in this kernel; bf16 ones hit the fast one.
        y = torch.ops.aten._weight_int8pack_mm(x2d.to(torch.bfloat16).contiguous(), weight, scales)  # (M, N)
        return self._add_bias(y)

    def _onednn_product(self, x2d: torch.Tensor, onednn_weight: int8_prompts.OnednnInt8Weight) -> torch.Tensor:
        """x2d (M, K) -> (M, N) fp32 through oneDNN's int8 x int8 product (AMX where the CPU has it),
        x quantized per row as gptlab's kernel quantizes it: oneDNN takes one scale for all of x, so
        it multiplies the quantized rows, and each output row is then scaled by its own s."""
        xq, s = ops.quantize_rows_u8(x2d)  # (M, K) uint8 = round(x / s) + 128, (M,)
        y = onednn_weight.scaled_sums(xq)  # (M, N)
        s = s[:, None]  # (M, 1)
        return y.mul_(s) if self.bias is None else torch.addcmul(self.bias, y, s)


class Int4Linear(QuantizedLinear):
    """int4 weights as nibbles, two per byte (N, K/2), a bf16 scale and zero per group of inputs."""

    mode = "int4"

    def __init__(self, in_features, out_features, bias=True, group_size=64, device=None):
        super().__init__(in_features, out_features, bias, device)
        check_group_size(in_features, group_size)
        self.group_size = group_size
        groups = (out_features, in_features // group_size)
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(groups, dtype=torch.bfloat16, device=device))
        self.register_buffer("zeros", torch.zeros(groups, dtype=torch.bfloat16, device=device))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 64) -> Int4Linear:
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size, linear.weight.device)
        q, module.scales, module.zeros = quantize_int4(linear.weight, group_size)
        module.weight = pack_int4(q)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach().float())
        return module

    def dequantize_rows(self, rows) -> torch.Tensor:
        return dequantize_int4(unpack_int4(self.weight[rows]), self.scales[rows], self.zeros[rows])  # (..., K)

    def prepare(self) -> None:
        self._kernel_weights = self._decode = None
        self._prompts_in_bf16 = False  # long prompts dequantized to bf16 for AMX (set below)
        if self.weight.device.type != "cpu":
            return
        if kernels.available()[1] and ops.int4_fits(self.in_features, self.group_size):
            # gptlab's kernels read the stored buffers as they are: no second copy of the weights.
            self.weight, self.scales, self.zeros = _aligned(self.weight), _aligned(self.scales), _aligned(self.zeros)
            self._kernel_weights = ("gptlab",)
            self._decode = ops.int4_decoder(self.weight, self.scales, self.zeros, self.group_size, self.bias)
            self._decode_rows = ops.int4_kernel_rows()
            self._prompts_in_bf16 = linear_layer.int4_prompts_in_bf16(
                linear_layer.INT4_BF16_ROWS, self.weight.numel() * 2
            )
            if self._prompts_in_bf16:  # long prompts: bf16 on AMX (_kernel)
                self._decode_rows = min(self._decode_rows, linear_layer.INT4_BF16_ROWS - 1)
            return
        # PyTorch's kernel wants a multiple of 16 output rows: pad (GPT-2's head has 50257) and slice after.
        pad = -self.out_features % 16
        q = F.pad(unpack_int4(self.weight).to(torch.int32), (0, 0, 0, pad), value=8)  # (N_pad, K)
        tinygemm_weight = _aligned(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))  # tinygemm's layout
        scales = F.pad(self.scales, (0, 0, 0, pad))  # (N_pad, G)
        zeros = F.pad(self.zeros, (0, 0, 0, pad))  # (N_pad, G)
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # (G, N_pad, 2)
        self._kernel_weights = ("torch", tinygemm_weight, scales_and_zeros)

    def _kernel(self, x2d):
        if self._kernel_weights[0] == "gptlab":
            if torch.compiler.is_compiling():  # torch.compile cannot trace ctypes: dequantize in torch
                return F.linear(x2d.float(), self.dequantize(), self.bias)  # (M, N)
            if self._prompts_in_bf16 and x2d.size(0) >= linear_layer.INT4_BF16_ROWS:  # a long prompt on AMX
                return linear_layer.int4_bf16_linear(
                    x2d, self.weight, self.scales, self.zeros, self.group_size, self.bias
                )
            # A prompt or a batch: dequantize this layer and run the GEMM (compute-bound, so the
            # matrix's bytes matter less than the GEMM's speed).
            weight = ops.dequantize_int4(self.weight, self.scales, self.zeros, self.group_size)  # (N, K)
            return linear_layer.linear(x2d.float(), weight, self.bias)
        _, tinygemm_weight, scales_and_zeros = self._kernel_weights
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2d.to(torch.bfloat16).contiguous(), tinygemm_weight, self.group_size, scales_and_zeros
        )  # (M, N_pad)
        return self._add_bias(y[:, : self.out_features])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


class QuantizedEmbedding(nn.Module):
    """Token embedding that reads its rows from a tied, quantized head (which owns the storage)."""

    def __init__(self, head: QuantizedLinear, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.__dict__["head"] = head  # not a submodule: the table is saved once, under lm_head
        self.dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        """The quantized table itself (int8, or int4 nibbles as uint8): its device is the model's,
        and its non-float dtype tells callers such as gptlab.kv_cache.model_device_dtype to use float32."""
        return self.head.weight

    @property
    def num_embeddings(self) -> int:
        return self.head.out_features

    @property
    def embedding_dim(self) -> int:
        return self.head.in_features

    def _apply(self, fn, recurse=True):
        """model.to(torch.bfloat16) makes the rows it gives bf16, as the rest of the model."""
        self.dtype = fn(torch.zeros(1, dtype=self.dtype)).dtype  # a move keeps it
        return super()._apply(fn, recurse)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head.dequantize_rows(idx).to(self.dtype)  # (B, T, C)


# ---------------------------------------------------------------- model-level


def quantize_model(
    model: GPT, mode: str, group_size: int = DEFAULT_GROUP_SIZE, *, activations: str = DEFAULT_ACTIVATIONS
) -> GPT:
    """Swap every nn.Linear of `model` (the head included) for a quantized one, in place; returns it.

    mode: "int8" (per-channel; `activations` "float" or "int8" picks the CPU kernel) or "int4"
    (group-wise, `group_size` in 32/64/128/256 dividing every layer's input width).
    """
    _check_scheme(mode, group_size, activations)
    if model.config.num_labels:  # load_quantized builds a GPT: a quantized score head would not come back
        raise ValueError(
            f"model is a classifier ({model.config.num_labels} labels); quantize_model holds language models"
        )
    if getattr(model, "quantization", None):
        raise ValueError(f"model is already quantized ({model.quantization['mode']})")
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if mode == "int4":
        for name, m in linears:  # validate everything before changing anything
            try:
                check_group_size(m.in_features, group_size)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
    tied = model.config.tie_weights and model.lm_head.weight is model.transformer.wte.weight
    for name, linear in linears:
        if mode == "int8":
            quantized = Int8Linear.from_linear(linear, activations)
        else:
            quantized = Int4Linear.from_linear(linear, group_size)
        quantized.prepare()
        quantized.train(linear.training)  # the layer it replaces was in train or eval mode: keep that
        _set_submodule(model, name, quantized)
    if tied:
        model.transformer.wte = QuantizedEmbedding(model.lm_head, model.transformer.ln_f.weight.dtype)
    model.quantization = scheme_dict(mode, group_size, activations)
    log.info("quantized %d linear layers to %s", len(linears), mode)
    return model


def scheme_dict(mode: str, group_size: int | None, activations: str) -> dict:
    """The quantization record stored in gptlab.json."""
    if mode == "int8":
        return {"mode": "int8", "group_size": None, "activations": activations}
    return {"mode": "int4", "group_size": group_size}


def dequantize_model(model: GPT) -> GPT:
    """A float GPT holding exactly the matrices a quantized model stands for (its reference: the
    difference between the two is the kernels' rounding, not the quantization error)."""
    state = {}
    for name, tensor in model.state_dict().items():
        state[name] = tensor.float() if tensor.is_floating_point() else tensor
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            for buffer in ("weight", "scales", "zeros"):
                state.pop(f"{name}.{buffer}", None)
            state[f"{name}.weight"] = m.dequantize()
    if model.config.tie_weights:
        state["transformer.wte.weight"] = state["lm_head.weight"]
    with meta_device():
        reference = GPT(model.config)
    load_state_strict(reference, state, "dequantize_model")
    reference.tie_weights()
    return reference.eval()


def set_kernels(model: nn.Module, enabled: bool) -> None:
    """Use the CPU kernels (gptlab's, else PyTorch's; True) or the plain dequantize-then-F.linear path (False)."""
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.use_kernel = enabled


def save_quantized(model: GPT, directory: str | os.PathLike, *, tokenizer: str = "gpt2") -> None:
    """Write a quantized model as a native gptlab directory: safetensors plus gptlab.json with the scheme."""
    scheme = getattr(model, "quantization", None)
    if not scheme:
        raise ValueError("model is not quantized; save it with gptlab.checkpoint.save_model")
    _check_layers_saveable(model)
    directory = Path(directory)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    atomic_write(directory / WEIGHTS_FILE, lambda tmp: save_file(state, tmp))
    meta = {"format": "gptlab", "config": model.config.to_dict(), "tokenizer": tokenizer, "quantization": scheme}
    atomic_write_text(directory / META_FILE, json.dumps(meta, indent=2))


def _check_layers_saveable(model: GPT) -> None:
    """Refuse what load_quantized could not read back: LoRA adapters (their tensors sit under the
    layers' names) and float linear layers (gptlab.lora.merge leaves its merged layers float)."""
    adapters = list(lora_layers(model))
    if adapters:
        raise ValueError(f"model carries LoRA adapters ({', '.join(adapters[:3])}): save them with "
                         "gptlab.lora.save_adapter, or merge them into the float model and quantize that")  # fmt: skip
    floats = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if floats:
        raise ValueError(f"{', '.join(floats[:3])} are float layers in a quantized model (a LoRA merge makes "
                         "them float): merge into the float model and quantize that")  # fmt: skip


def load_quantized(directory: str | os.PathLike, *, device=None) -> GPT:
    """Load a directory written by save_quantized without ever building the float model's weights."""
    directory = Path(directory)
    meta = read_meta(directory)
    scheme = meta.get("quantization")
    if not scheme:
        raise ValueError(f"{directory} holds a float model, not a quantized one; load it with gptlab.load_model")
    mode, group_size = scheme.get("mode"), scheme.get("group_size")
    activations = scheme.get("activations", DEFAULT_ACTIVATIONS)
    _check_scheme(mode, group_size, activations)
    _check_record_keys(scheme, directory)
    config = GPTConfig.from_dict(meta["config"])
    with meta_device():
        model = GPT(config)
        _swap_empty(model, mode, group_size, activations)
    try:
        state = load_file(directory / WEIGHTS_FILE, device=str(device or "cpu"))
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise ValueError(f"{directory / WEIGHTS_FILE}: cannot read weights ({e})") from e
    _check_quantized_dtypes(model, state, str(directory))
    load_state_strict(model, state, str(directory))
    if isinstance(model.transformer.wte, QuantizedEmbedding):  # its rows in the stored model's dtype
        model.transformer.wte.dtype = model.transformer.ln_f.weight.dtype
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.prepare()
    model.quantization = scheme_dict(mode, group_size, activations)
    return model.eval()


def _check_record_keys(scheme: dict, directory: Path) -> None:
    """Refuse keys scheme_dict does not write for the mode: a misspelt one ("activation") or one of
    a newer version's scheme loaded silently as another scheme."""
    known = scheme_dict(scheme["mode"], None, DEFAULT_ACTIVATIONS)
    unknown = sorted(set(scheme) - set(known))
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise ValueError(f"{directory}: unknown key(s) {names} in its {scheme['mode']} quantization record "
                         f"(known: {', '.join(known)}); was it written by a newer gptlab?")  # fmt: skip


def _check_quantized_dtypes(model: GPT, state: dict[str, torch.Tensor], source: str) -> None:
    """The quantized layers' buffers must be stored in the exact dtypes the kernels read (the
    codes, and bf16 scales and zeros): fp16 scales were read as bf16 bits (logits near 0)."""
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            for buffer_name, buffer in m.named_buffers(recurse=False):
                stored = state.get(f"{name}.{buffer_name}")
                if stored is not None and stored.dtype != buffer.dtype:
                    raise ValueError(
                        f"{source}: tensor {name}.{buffer_name} is {stored.dtype}, the model expects {buffer.dtype}"
                    )


def _swap_empty(model: GPT, mode: str, group_size: int | None, activations: str) -> None:
    """Replace the (meta) linear layers by quantized ones of the same shapes, ready for assign-loading."""
    tied = model.config.tie_weights
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        args = (linear.in_features, linear.out_features, linear.bias is not None)
        if mode == "int8":
            _set_submodule(model, name, Int8Linear(*args, activations=activations))
        else:
            _set_submodule(model, name, Int4Linear(*args, group_size=group_size))
    if tied:
        model.transformer.wte = QuantizedEmbedding(model.lm_head)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied if needed so it starts on a 64-byte boundary: the CPU kernels use aligned
    AVX-512 loads, and safetensors hands out tensors at arbitrary offsets (a segfault otherwise)."""
    t = t.contiguous()
    return t if t.data_ptr() % 64 == 0 else t.clone()


def _check_scheme(mode, group_size, activations) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; choose one of {MODES}")
    if mode == "int4" and not is_group_size(group_size):
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size!r}")
    if mode == "int8" and activations not in ACTIVATIONS:
        raise ValueError(f"int8 activations must be one of {ACTIVATIONS}, got {activations!r}")


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's state (what a checkpoint holds), tied tensors counted once."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
