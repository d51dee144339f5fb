"""GGUF export: a gptlab GPT-2 as llama.cpp's `gpt2` architecture, with its byte-level BPE tokenizer.

Written with the `gguf` package (llama.cpp's own Python writer, from PyPI) and its quantizers, and
laid out as llama.cpp's convert_hf_to_gguf.py lays out OpenAI's gpt2 (its GPT2Model class, and
TextModel._set_vocab_gpt2 for the tokenizer):
- metadata: general.architecture "gpt2", general.type "model", general.name, general.size_label;
  gpt2.block_count, context_length, embedding_length, feed_forward_length, attention.head_count,
  attention.layer_norm_epsilon; general.file_type, general.quantization_version;
- tokenizer: tokenizer.ggml.model "gpt2", pre "gpt-2", tokens (GPT-2's byte-level strings by id;
  ids past 50,257 are "[PAD<id>]", type UNUSED), token_type (NORMAL; <|endoftext|> CONTROL),
  merges, bos/eos ids 50256, add_bos_token false. A Hugging Face model's own byte-level BPE (a
  tokenizer named by its directory) is written the same way: its tokens, merges and end-of-text id;
- tensors under llama.cpp's names (token_embd, position_embd, blk.N.attn_qkv, ...), matrices in
  nn.Linear's (out, in) layout, which GGUF lists as {in, out}. 1-D tensors and position_embd stay
  F32; every other matrix, token_embd included, gets the output type. A row length that the type's
  blocks do not divide falls back to F16, as the converter does. Q4_0 (which the converter leaves
  to llama-quantize) follows `llama-quantize --pure`: every matrix but position_embd in Q4_0.

Where gptlab's model is more general than OpenAI's gpt2, the file still describes it exactly:
feed_forward_length is the MLP's real width (the converter writes 4*n_embd whatever n_inner is),
an untied head is written as output.weight (llama.cpp's gpt2 reads it when present), and a model
without biases gets zero biases (llama.cpp's gpt2 requires them). RoPE, RMSNorm and SwiGLU have
no place in llama.cpp's gpt2 and raise ValueError.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import gguf
import numpy as np
import torch

from gptlab.atomic import atomic_write
from gptlab.config import GPTConfig
from gptlab.model import GPT
from gptlab.tokenizer import BPEFiles, bpe_files, get_tokenizer

log = logging.getLogger(__name__)

ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT2]  # "gpt2"
QTYPE = gguf.GGMLQuantizationType
OUTTYPES = {  # --outtype -> (general.file_type, the type of the matrices)
    "f32": (gguf.LlamaFileType.ALL_F32, QTYPE.F32),
    "f16": (gguf.LlamaFileType.MOSTLY_F16, QTYPE.F16),
    "bf16": (gguf.LlamaFileType.MOSTLY_BF16, QTYPE.BF16),
    "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, QTYPE.Q8_0),
    "q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, QTYPE.Q4_0),
}
GPT2_VOCAB = 50257
PRE_TOKENIZER = "gpt-2"  # what convert_hf_to_gguf.py's get_vocab_base_pre finds for openai-community/gpt2

_T = gguf.MODEL_TENSOR
GLOBAL_TENSORS = {  # gptlab name -> GGUF name
    "transformer.wte.weight": gguf.TENSOR_NAMES[_T.TOKEN_EMBD] + ".weight",
    "transformer.wpe.weight": gguf.TENSOR_NAMES[_T.POS_EMBD] + ".weight",
    "transformer.ln_f.weight": gguf.TENSOR_NAMES[_T.OUTPUT_NORM] + ".weight",
    "transformer.ln_f.bias": gguf.TENSOR_NAMES[_T.OUTPUT_NORM] + ".bias",
}
BLOCK_TENSORS = {  # gptlab module in block N -> GGUF name pattern (weight and bias)
    "ln_1": gguf.TENSOR_NAMES[_T.ATTN_NORM],
    "attn.c_attn": gguf.TENSOR_NAMES[_T.ATTN_QKV],
    "attn.c_proj": gguf.TENSOR_NAMES[_T.ATTN_OUT],
    "ln_2": gguf.TENSOR_NAMES[_T.FFN_NORM],
    "mlp.c_fc": gguf.TENSOR_NAMES[_T.FFN_UP],
    "mlp.c_proj": gguf.TENSOR_NAMES[_T.FFN_DOWN],
}
HEAD = ("lm_head.weight", gguf.TENSOR_NAMES[_T.OUTPUT] + ".weight")
POSITIONS = GLOBAL_TENSORS["transformer.wpe.weight"]


def name_table(config: GPTConfig) -> dict[str, str]:
    """gptlab tensor name -> GGUF tensor name, in the order they are written."""
    table = dict(GLOBAL_TENSORS)
    for i in range(config.n_layer):
        for module, pattern in BLOCK_TENSORS.items():
            for kind in ("weight", "bias"):
                table[f"transformer.h.{i}.{module}.{kind}"] = f"{pattern.format(bid=i)}.{kind}"
    if not config.tie_weights:
        table[HEAD[0]] = HEAD[1]
    return table


def check_exportable(config: GPTConfig, tokenizer: str) -> None:
    """ValueError unless llama.cpp's gpt2 architecture and a byte-level BPE (GPT-2's or the model's
    own) can hold this model."""
    problems = {
        "RoPE positions (llama.cpp's gpt2 learns a position table)": config.pos_embedding != "learned",
        "RMSNorm (llama.cpp's gpt2 uses LayerNorm)": config.norm != "layernorm",
        "a SwiGLU MLP (llama.cpp's gpt2 MLP is GELU)": config.mlp == "swiglu",
    }
    used = [what for what, bad in problems.items() if bad]
    if used:
        raise ValueError(f"llama.cpp's gpt2 architecture cannot represent this model: it has {'; '.join(used)}")
    n_tokens = GPT2_VOCAB if tokenizer == "gpt2" else None if tokenizer == "byte" else get_tokenizer(tokenizer).n_vocab
    if n_tokens is None or config.vocab_size < n_tokens:
        raise ValueError(f"GGUF export writes GPT-2's tokenizer or a model's own byte-level BPE; this model uses the "
                         f"{tokenizer!r} tokenizer with a {config.vocab_size}-token vocabulary")  # fmt: skip


def tensor_type(gguf_name: str, shape: tuple[int, ...], qtype: QTYPE) -> QTYPE:
    """The GGUF type of one tensor for an output type, by convert_hf_to_gguf.py's rules."""
    if len(shape) <= 1 or gguf_name == POSITIONS:
        return QTYPE.F32
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_size:
        log.warning("%s: rows of %d do not split into %s blocks of %d; writing F16", gguf_name, shape[-1], qtype.name, block_size)  # fmt: skip
        return QTYPE.F16
    return qtype


def export_gguf(model: GPT, path: str | os.PathLike, *, outtype: str = "f32", tokenizer: str = "gpt2", name: str | None = None) -> None:  # fmt: skip
    """Write `model` as a GGUF file llama.cpp runs (see the module docstring for the layout)."""
    config = model.config
    check_exportable(config, tokenizer)
    if outtype not in OUTTYPES:
        raise ValueError(f"unknown GGUF output type {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    if config.mlp == "gelu_erf":
        log.warning("llama.cpp's gpt2 computes the tanh GELU; this model's exact (erf) GELU is not kept")
    file_type, qtype = OUTTYPES[outtype]
    tensors = _gguf_tensors(model, qtype)  # GGUF name -> (tensor, GGUF type)
    path = Path(path)

    def write(tmp: str) -> None:
        with _quiet(logging.getLogger("gguf.gguf_writer")):  # its INFO lines named the temporary file
            writer = gguf.GGUFWriter(tmp, ARCH)
            for gguf_name, (tensor, ttype) in tensors.items():
                writer.add_tensor_info(gguf_name, tuple(tensor.shape), np.dtype(np.float32), _nbytes(tensor.shape, ttype), raw_dtype=ttype)  # fmt: skip
            _add_metadata(writer, config, file_type, name or path.stem)
            _add_tokenizer(writer, bpe_files(tokenizer), config.vocab_size)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for tensor, ttype in tensors.values():  # converted one at a time: at most one extra tensor in memory
                array = tensor.to("cpu", torch.float32).numpy()  # no copy for a float32 CPU model
                writer.write_tensor_data(gguf.quants.quantize(array, ttype))
            writer.close()

    atomic_write(path, write)
    log.debug("wrote %s: GGUF %s, %d tensors", path, outtype.upper(), len(tensors))


@contextlib.contextmanager
def _quiet(logger: logging.Logger):
    """`logger` at WARNING and above only, for the duration."""
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _gguf_tensors(model: GPT, qtype: QTYPE) -> dict[str, tuple[torch.Tensor, QTYPE]]:
    """GGUF name -> (the model's tensor, its GGUF type); absent biases are zeros."""
    config = model.config
    own = model.state_dict()
    table = name_table(config)
    unexpected = sorted(set(own) - set(table) - {HEAD[0]})
    if unexpected:
        raise ValueError(f"the model has tensors GPT-2 does not ({', '.join(unexpected[:3])}); export a float model")
    out = {}
    for name, gguf_name in table.items():
        if name in own:
            tensor = own[name].detach()
        else:  # a bias of a model without biases: zeros, the weight's output size
            tensor = torch.zeros(own[name.removesuffix(".bias") + ".weight"].shape[0])
        out[gguf_name] = (tensor, tensor_type(gguf_name, tuple(tensor.shape), qtype))
    return out


def _nbytes(shape, ttype: QTYPE) -> int:
    block_size, type_size = gguf.GGML_QUANT_SIZES[ttype]
    return int(np.prod(tuple(shape))) // block_size * type_size


def _add_metadata(writer: gguf.GGUFWriter, config: GPTConfig, file_type, name: str) -> None:
    total_params, shared, expert, experts = writer.get_total_parameter_count()
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_size_label(gguf.size_label(total_params, shared, expert, experts))
    writer.add_block_count(config.n_layer)
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.mlp_hidden)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.layer_norm_eps)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def bpe_vocabulary(bpe: BPEFiles, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) as convert_hf_to_gguf.py writes them for a byte-level BPE
    (GPT-2's: its special tokens CONTROL), padded to `vocab_size` with "[PAD<id>]" tokens of type UNUSED."""
    by_id = {i: token for token, i in {**bpe.vocab, **bpe.special}.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if by_id[i] in bpe.special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    return tokens, [int(t) for t in types], [" ".join(pair) for pair in bpe.merges]


def _add_tokenizer(writer: gguf.GGUFWriter, bpe: BPEFiles, vocab_size: int) -> None:
    tokens, types, merges = bpe_vocabulary(bpe, vocab_size)
    eot = bpe.special[bpe.eot]  # GPT-2's <|endoftext|> is its bos and eos
    bos = bpe.special[bpe.bos] if bpe.bos else eot  # another a directory names (<s>), as SpecialVocab reads it
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)  # the split pattern: tokenizer.py accepts only GPT-2's
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eot)
    writer.add_add_bos_token(False)
