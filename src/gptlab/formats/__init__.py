"""Other programs' checkpoint formats, one module per format.

- `nanogpt`: reads the `ckpt.pt` nanoGPT's train.py writes (the file or the out_dir holding it).
- `llmc`: reads and writes llm.c's `gpt2_124M.bin` layout (fp32 or bf16).
- `gguf`: writes llama.cpp's GGUF (GPT-2 architecture, GPT-2 tokenizer), via the `gguf` package.

`gptlab.loading` tries gptlab's own directories (`gptlab.checkpoint`) before these and Hugging
Face ones (`gptlab.hf`) after them. `reader_for` only looks at a path; the format's module is
imported when it is used.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path

LLMC_MAGIC = (20240326).to_bytes(4, "little")
GGUF_MAGIC = b"GGUF"
NANOGPT_FILE = "ckpt.pt"
TORCH_SUFFIXES = (".pt", ".pth", ".ckpt")
LLMC_SUFFIX = ".bin"  # when not a torch zip (an HF pytorch_model.bin is one)


def reader_for(path: Path) -> Callable | None:
    """The `load(path, device=, dtype=)` of the foreign format at `path`, or None when `path` is
    none of them (then it may still be a Hugging Face directory or a Hub id)."""
    if path.is_dir():  # a directory with a config.json is a Hugging Face one
        return _nanogpt() if (path / NANOGPT_FILE).is_file() and not (path / "config.json").is_file() else None
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == LLMC_MAGIC:
        return _llmc()
    if magic == GGUF_MAGIC:
        raise ValueError(f"{path}: a GGUF file; gptlab writes GGUF (gptlab export --format gguf) but does not read it")
    if path.suffix in TORCH_SUFFIXES or zipfile.is_zipfile(path):
        return _nanogpt()
    if path.suffix == LLMC_SUFFIX:  # another magic (llm.c's tokenizer, a damaged file): its header check names it
        return _llmc()
    return None


def _nanogpt() -> Callable:
    from gptlab.formats.nanogpt import load

    return load


def _llmc() -> Callable:
    from gptlab.formats.llmc import load

    return load
