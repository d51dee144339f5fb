"""gptlab export: a model -> the Hugging Face GPT2LMHeadModel layout, a GGUF file for llama.cpp, or
an llm.c checkpoint."""

import os
from pathlib import Path

from gptlab.commands._model_args import (
    add_model_arguments,
    check_out_is_not_read,
    check_out_layout,
    check_out_path,
    model_from_args,
)

FORMATS = ("hf", "gguf", "llmc")
GGUF_OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")  # gptlab.formats.gguf.OUTTYPES, without importing gguf
SUFFIX_FORMATS = {".gguf": "gguf", ".bin": "llmc"}


def add_arguments(parser):
    add_model_arguments(parser, prompt=False, dtype_default=None)  # hf, llmc (float32/bfloat16): the dtype written
    parser.add_argument(
        "--out",
        required=True,
        type=os.path.expanduser,  # --out=~/x: no shell expands that ~
        help="HF: a directory; gguf: a .gguf file; llmc: a .bin file",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="hf (default), gguf (llama.cpp) or llmc (llm.c); by default .gguf and .bin outputs pick gguf and llmc",
    )
    parser.add_argument("--outtype", choices=GGUF_OUTTYPES, default="f32", help="gguf: tensor type (default f32)")
    parser.add_argument(
        "--merge", action="store_true", help="with --adapter: fold the adapter into the weights written"
    )


def run(args):
    import torch

    from gptlab.loading import tokenizer_name

    fmt = args.format or SUFFIX_FORMATS.get(Path(args.out).suffix.lower(), "hf")  # x.GGUF is GGUF too
    if fmt != "gguf" and args.outtype != "f32":
        raise ValueError("--outtype is for --format gguf; use --dtype for hf and llmc")
    if fmt == "gguf" and args.dtype:
        raise ValueError("--dtype is for --format hf and llmc; use --outtype for gguf")
    if args.adapter and not args.merge:
        raise ValueError("--adapter: the formats hold plain weights; pass --merge to fold the adapter into them")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    check_out_is_not_read(args)
    check_out_path(args.out, directory=fmt == "hf")
    if fmt == "hf":
        check_out_layout(args.out, "hf")
    model = model_from_args(args)
    # after loading: a spec that names no model is the loader's error; llm.c's file holds no tokenizer
    tokenizer = tokenizer_name(args.model) if fmt != "llmc" else None
    if model.config.num_labels and fmt != "hf":
        raise ValueError(f"{args.model} is a classifier: --format {fmt} holds language models; use --format hf")
    from gptlab.lora import lora_layers, merge

    if args.merge:  # the adapter of --adapter, or of a LoRA run's checkpoint
        if not lora_layers(model):
            raise ValueError(f"--merge: {args.model} carries no adapter (pass --adapter DIR)")
        merge(model)
    elif lora_layers(model):  # gguf and llmc named only "tensors GPT-2 does not" and asked for a float model
        raise ValueError(f"{args.model} is a LoRA run's checkpoint: pass --merge to fold its adapters into the weights")
    check_not_quantized(model, args.model, fmt)
    if fmt == "hf":
        from gptlab.hf import save_pretrained

        save_pretrained(model, args.out, tokenizer=tokenizer)
        kind = "GPT2ForSequenceClassification" if model.config.num_labels else "GPT2LMHeadModel"
        print(f"wrote {args.out}: {model.num_params():,} parameters, {next(model.parameters()).dtype}")
        print(f"load it with transformers.{kind}.from_pretrained({args.out!r})")
    elif fmt == "gguf":
        from gptlab.formats.gguf import export_gguf

        export_gguf(model, args.out, outtype=args.outtype, tokenizer=tokenizer)
        print(f"wrote {args.out}: {model.num_params():,} parameters, GGUF {args.outtype.upper()}")
        print(f"run it with llama.cpp, e.g. llama-cli -m {args.out}")
    else:
        from gptlab.formats.llmc import padded_vocab, save

        stored = next(model.parameters()).dtype  # as stored by default: llm.c holds fp32 or bf16
        dtype = dtype or (stored if stored in (torch.float32, torch.bfloat16) else torch.float32)
        save(model, args.out, dtype=dtype)
        bf16, vocab = dtype == torch.bfloat16, model.config.vocab_size
        print(f"wrote {args.out}: {model.num_params():,} parameters, llm.c version {5 if bf16 else 3} "
              f"({'bf16' if bf16 else 'fp32'}, vocabulary padded {vocab:,} -> {padded_vocab(vocab):,})")  # fmt: skip
        build = "train_gpt2cu" if bf16 else "train_gpt2cu built with PRECISION=FP32 (or train_gpt2.c)"
        print(f"continue training it in llm.c: {build} -e {args.out}")


def check_not_quantized(model, name: str, fmt: str) -> None:
    """Refuse a gptlab-quantized model by name (the formats named its scales "tensors GPT-2 does
    not have"), pointing gguf at llama.cpp's own 8- and 4-bit types."""
    scheme = getattr(model, "quantization", None)  # quantize.quantize_model's record
    if scheme:
        hint = ", with --outtype q8_0 or q4_0 for llama.cpp's 8- or 4-bit types" if fmt == "gguf" else ""
        raise ValueError(f"{name} is quantized by gptlab ({scheme['mode']}) and --format {fmt} holds float weights: "
                         f"export the float model it was quantized from{hint}")  # fmt: skip
