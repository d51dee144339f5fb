"""Building modules on the meta device: shapes without memory, for weights loaded afterwards."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

# torch.nn.init's random initializers: on meta tensors they run torch._refs, whose first call
# imports torch._dynamo (~0.8 s of a command's start, for weights that are about to be loaded).
_RANDOM_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_normal_", "kaiming_uniform_",
                 "xavier_normal_", "xavier_uniform_", "orthogonal_", "sparse_")  # fmt: skip


def _skip_on_meta(init):
    def skipped(tensor, *args, **kwargs):
        return tensor if tensor.is_meta else init(tensor, *args, **kwargs)

    skipped.original = init
    return skipped


@contextmanager
def meta_device():
    """Build modules on the meta device (shapes, no memory), for weights loaded afterwards, without
    running random initializers on meta tensors (building GPT-2 so took ~1 s, now ~0.01). A real
    tensor initialized meanwhile, in this thread or another, is initialized as usual."""
    saved = {name: getattr(nn.init, name) for name in _RANDOM_INITS}
    for name, init in saved.items():
        setattr(nn.init, name, _skip_on_meta(getattr(init, "original", init)))
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, init in saved.items():
            setattr(nn.init, name, init)
