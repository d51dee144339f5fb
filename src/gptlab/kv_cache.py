"""The KV cache decoding attends over: preallocated keys and values per layer, on the device of the
model's activations (`model_device_dtype`), in the dtype its caches take (`cache_dtype`), and the
write each attention layer makes into it (`write_kv`).
"""

from __future__ import annotations

import torch

from gptlab.config import GPTConfig


def model_device_dtype(model) -> tuple[torch.device, torch.dtype]:
    """Where activations live and their dtype: those of the token embedding (float32 if it is not float)."""
    weight = model.transformer.wte.weight
    dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
    return weight.device, dtype


def cache_dtype(model) -> torch.dtype:
    """The dtype of the model's KV caches: `model.kv_cache_dtype` when set; else bf16 for a
    quantized model with fp32 activations (its keys and values rounded to bf16, an error far below
    its weights': half the bytes decoding reads from the cache at every token, as llama.cpp's F16
    cache); else the activations' dtype."""
    dtype = getattr(model, "kv_cache_dtype", None)
    if dtype is not None:
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"kv_cache_dtype must be a floating-point torch.dtype, got {dtype!r}")
        return dtype
    _, dtype = model_device_dtype(model)
    quantized = getattr(model, "quantization", None) is not None
    return torch.bfloat16 if quantized and dtype is torch.float32 else dtype


def window_keep(block_size: int, keep: int | None) -> int:
    """The tokens a full cache keeps when decoding slides its window (gptlab.generation): `keep`,
    or 3/4 of block_size when None (at least 1: a block_size of 1 keeps its token); ValueError
    outside [1, block_size]."""
    keep = max(1, block_size * 3 // 4) if keep is None else keep
    if not 1 <= keep <= block_size:
        raise ValueError(f"window_keep must be in [1, block_size], got {keep}")
    return keep


class KVCache:
    """Preallocated keys and values, one (k, v) pair of tensors per layer, (B, nh, max_len, hs).

    The model writes the keys of new tokens at slots pos..pos+T; the caller advances `pos`.
    `pos` is a Python int, or a 0-dim LongTensor for compiled decoding: then writes use
    index_copy_ and attention spans all max_len slots with the unwritten ones masked, so one
    compiled graph serves every position (a Python int would be specialised on).
    Separate tensors per layer, not views of one big tensor: a compiled step would copy it whole.
    """

    def __init__(self, config: GPTConfig, batch_size: int, max_len: int, *, device=None, dtype=None):
        shape = (batch_size, config.n_head, max_len, config.head_size)
        self.layers = [
            (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            for _ in range(config.n_layer)
        ]
        self.pos = 0
        self.max_len = max_len
        self.checked_plan = None  # the model's gptlab.fused_step plan, as checked at this cache's last prompt

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int) -> KVCache:
        """A cache for `model`'s activations: on its device, in cache_dtype(model)."""
        device, _ = model_device_dtype(model)
        return cls(model.config, batch_size, max_len, device=device, dtype=cache_dtype(model))

    @property
    def batch_size(self) -> int:
        """Rows the cache holds (a view's own rows)."""
        return self.layers[0][0].size(0)

    def check_room(self, rows: int, n: int) -> None:
        """ValueError unless `rows` rows of n new slots fit: another row count, or slots past
        max_len, were written out of bounds by the C step (a heap corruption), or silently
        into row 0 alone."""
        if rows != self.batch_size:
            raise ValueError(f"{rows} rows for a KV cache of {self.batch_size}")
        if int(self.pos) + n > self.max_len:
            raise ValueError(f"KV cache overflow: {int(self.pos)} + {n} > {self.max_len}")

    def advance(self, n: int) -> None:
        """Move the write position past n newly written slots."""
        if int(self.pos) + n > self.max_len:
            raise ValueError(f"KV cache overflow: {int(self.pos)} + {n} > {self.max_len}")
        self.pos = self.pos + n

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


def write_kv(kv, start, k, v):
    """Write k, v (B, nh, T, hs) into one layer's cache at slots start..start+T (rounded to the
    cache's dtype); return the keys and values to attend over, in k's dtype: slots 0..start+T, or
    all max_len slots when start is a tensor."""
    k_cache, v_cache = kv
    T = k.size(2)
    if isinstance(start, torch.Tensor):
        slots = start + torch.arange(T, device=k.device)  # (T,)
        k_cache.index_copy_(2, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(2, slots, v.to(v_cache.dtype))
        return k_cache.to(k.dtype), v_cache.to(v.dtype)
    k_cache[:, :, start : start + T] = k
    v_cache[:, :, start : start + T] = v
    return k_cache[:, :, : start + T].to(k.dtype), v_cache[:, :, : start + T].to(v.dtype)
