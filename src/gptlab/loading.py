"""Any --model spec -> a ready model: the one place that knows every way gptlab reads a model.

A spec is, in the order tried:

1. `preset:NAME`, or a small preset's bare name (gpt2-tiny, llama-tiny, ...): fresh random weights.
2. A native gptlab directory (`gptlab.json`): float (`gptlab.checkpoint`) or quantized
   (`gptlab.quantize`); or a training run's directory, which means the checkpoint its `latest`
   points to (`gptlab.run_files`).
3. Another program's file: nanoGPT's ckpt.pt (or its out_dir), llm.c's .bin (`gptlab.formats`).
4. A Hugging Face directory (`config.json`) or a Hub id (`gptlab.hf`); OpenAI's names (gpt2,
   gpt2-medium, gpt2-large, gpt2-xl) are Hub ids and load the released weights.

This module sits above the readers and none of them imports it, so a new format is a new
reader plus one line here.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gptlab.checkpoint import META_FILE, load_native, read_meta
from gptlab.config import PRESETS, GPTConfig
from gptlab.formats import reader_for
from gptlab.hf import CONFIG_FILE, load_pretrained, resolve
from gptlab.hf import load_config as hf_config
from gptlab.model import GPT
from gptlab.quantize import load_quantized
from gptlab.run_files import latest_checkpoint
from gptlab.tokenizer import directory_tokenizer

HUB_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # presets that are also OpenAI's Hub ids


def load_model(spec: str, *, device=None, dtype=None, adapter=None) -> GPT:
    """The model a --model spec names, in eval mode on `device` (default cpu).

    `dtype` converts float weights (None keeps the stored dtype; HF and fresh presets: float32);
    a quantized model keeps its stored scheme and converts the rest (norms, biases, activations). `adapter`, a PEFT LoRA directory (gptlab.lora),
    is applied on top. Raises ValueError for a spec that names no model.
    """
    if device is not None:
        check_device(device)
    spec = os.path.expanduser(os.fspath(spec))  # "~/runs/x" as a shell would read it, in every format
    model = _load_base(spec, device=device, dtype=dtype)
    if adapter:
        from gptlab.lora import load_adapter

        load_adapter(model, os.path.expanduser(os.fspath(adapter)))
    return model


def check_device(device, label: str = "device") -> None:
    """ValueError naming `device` (a name or a torch.device) when this machine does not have it, a
    user's error, rather than what torch raises from deep inside loading (a CPU-only build asked
    for cuda: "pin_memory=True requires a CUDA or other accelerator backend")."""
    try:
        d = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{label} {device}: not a device name (cpu, cuda, cuda:1, mps, ...)") from e
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{label} {device}: no CUDA device is available (torch {torch.__version__})")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"{label} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if d.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{label} {device}: MPS is not available on this machine")


def _load_base(spec: str, *, device=None, dtype=None) -> GPT:
    if is_preset(spec):
        return random_model(spec.removeprefix("preset:"), device=device, dtype=dtype)
    path = checkpoint_path(spec)
    if (path / META_FILE).is_file():
        meta = read_meta(path)
        if meta.get("lora_base"):  # a LoRA run's checkpoint: its base, then its adapters
            return _lora_run(path, meta, device=device, dtype=dtype)
        if meta.get("quantization"):  # dtype converts the float rest; the quantized layers keep their scheme
            model = load_quantized(path, device=device)
            return model.to(dtype) if dtype is not None else model
        return load_native(path, device=device, dtype=dtype)
    if (read_foreign := reader_for(path)) is not None:  # nanoGPT's ckpt.pt, llm.c's .bin
        return read_foreign(path, device=device, dtype=dtype)
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(
            f"{spec}: directory holds neither {META_FILE} (gptlab), a `latest` link (a training run), "
            "config.json (Hugging Face) nor ckpt.pt (nanoGPT)"
        )
    return load_pretrained(spec, device=device, dtype=dtype)


def load_config(spec: str) -> GPTConfig:
    """The GPTConfig of the model a --model spec names, without reading its weights where the
    format keeps the config apart: presets, gptlab directories (and training runs), Hugging Face
    directories and Hub ids (config.json alone). nanoGPT's and llm.c's files are read whole."""
    if is_preset(spec):
        return GPTConfig.from_name(spec.removeprefix("preset:"))
    path = checkpoint_path(spec)
    if (path / META_FILE).is_file():
        return GPTConfig.from_dict(read_meta(path)["config"])
    if reader_for(path) is not None or (path.is_dir() and not (path / CONFIG_FILE).is_file()):
        return _load_base(spec).config  # their configs live inside the weights' files; else _load_base's error
    return hf_config(spec)


def _lora_run(path: Path, meta: dict, *, device=None, dtype=None) -> GPT:
    """A LoRA run's checkpoint: the base it named, made a classifier if the run was one, then its
    adapters (PEFT's files, a classifier's head among them as modules_to_save)."""
    from gptlab.classifier import from_language_model
    from gptlab.lora import load_adapter

    model = _load_base(meta["lora_base"], device=device, dtype=dtype)
    config = GPTConfig.from_dict(meta["config"])
    if config.num_labels and not model.config.num_labels:
        model = from_language_model(model, config.labels, config.pad_token_id).eval()
    return load_adapter(model, path)


def is_preset(spec: str) -> bool:
    """Whether `spec` asks for a preset with random weights rather than a file or a Hub id.

    A path that exists wins over a preset's name; OpenAI's names need the `preset:` prefix.
    """
    if Path(spec).exists():
        return False
    return spec.startswith("preset:") or (spec in PRESETS and spec not in HUB_MODELS)


def random_model(name: str, *, device=None, dtype=None) -> GPT:
    """A preset's architecture with GPT-2's random initialization, built directly on `device`."""
    with torch.device(device or "cpu"):
        model = GPT(GPTConfig.from_name(name))
    return model.to(dtype=dtype).eval() if dtype is not None else model.eval()


def checkpoint_path(spec: str) -> Path:
    """The path a spec names: a training run's directory (its `latest` link) gives the checkpoint
    `latest` points to; any other spec, itself."""
    path = Path(spec)
    if path.is_dir() and not (path / META_FILE).is_file():
        return latest_checkpoint(path) or path
    return path


def tokenizer_name(spec: str) -> str:
    """The tokenizer a model spec uses (a get_tokenizer name): the name recorded with a native model;
    a Hugging Face directory's or Hub model's own byte-level BPE where it ships one other than
    GPT-2's (tokenizer.directory_tokenizer); else gpt2 (presets, nanoGPT, llm.c, OpenAI's ids)."""
    spec = os.path.expanduser(os.fspath(spec))
    path = checkpoint_path(spec)
    if (path / META_FILE).is_file():
        return read_meta(path).get("tokenizer", "gpt2")
    if is_preset(spec) or spec in HUB_MODELS or reader_for(path) is not None:
        return "gpt2"
    return directory_tokenizer(resolve(spec))  # resolve: a directory as is, a Hub id from the cache
