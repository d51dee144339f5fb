"""gptlab: GPT-2-style language models from scratch in PyTorch.

The public API is imported lazily, so `import gptlab` (and `gptlab --help`) does not load torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "GPTConfig": "gptlab.config",
    "GPT": "gptlab.model",
    "KVCache": "gptlab.kv_cache",
    "get_tokenizer": "gptlab.tokenizer",
    "generate": "gptlab.generation",
    "SamplingParams": "gptlab.sampling",
    "load_model": "gptlab.loading",
    "quantize_model": "gptlab.quantize",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gptlab' has no attribute {name!r}")
