"""gptlab export: a model -> the Hugging Face GPT2LMHeadModel layout, a GGUF file for llama.cpp, or
an llm.c checkpoint."""

from pathlib import Path

FORMATS = ("hf", "gguf", "llmc")
DTYPES = ("float32", "float16", "bfloat16")
GGUF_OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")  # gptlab.formats.gguf.OUTTYPES, without importing gguf
SUFFIX_FORMATS = {".gguf": "gguf", ".bin": "llmc"}


def add_arguments(parser):
    parser.add_argument(
        "--model", required=True, help="gptlab/HF directory, nanoGPT ckpt.pt or out_dir, llm.c .bin, Hub id or preset"
    )
    parser.add_argument("--out", required=True, help="HF: a directory; gguf: a .gguf file; llmc: a .bin file")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="hf (default), gguf (llama.cpp) or llmc (llm.c); by default .gguf and .bin outputs pick gguf and llmc",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="hf: weights dtype (default: the model's); llmc: float32 or bfloat16",
    )
    parser.add_argument("--outtype", choices=GGUF_OUTTYPES, default="f32", help="gguf: tensor type (default f32)")


def run(args):
    import torch

    from gptlab.loading import load_model, tokenizer_name

    fmt = args.format or SUFFIX_FORMATS.get(Path(args.out).suffix, "hf")
    if fmt != "gguf" and args.outtype != "f32":
        raise ValueError("--outtype is for --format gguf; use --dtype for hf and llmc")
    if fmt == "gguf" and args.dtype:
        raise ValueError("--dtype is for --format hf and llmc; use --outtype for gguf")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    tokenizer = tokenizer_name(args.model)
    if fmt == "hf":
        from gptlab.hf import save_pretrained

        model = load_model(args.model, dtype=dtype)
        save_pretrained(model, args.out, tokenizer=tokenizer)
        print(f"wrote {args.out}: {model.num_params():,} parameters, {next(model.parameters()).dtype}")
        print(f"load it with transformers.GPT2LMHeadModel.from_pretrained({args.out!r})")
    elif fmt == "gguf":
        from gptlab.formats.gguf import export_gguf

        model = load_model(args.model)
        export_gguf(model, args.out, outtype=args.outtype, tokenizer=tokenizer)
        print(f"wrote {args.out}: {model.num_params():,} parameters, GGUF {args.outtype.upper()}")
        print(f"run it with llama.cpp, e.g. llama-cli -m {args.out}")
    else:
        from gptlab.formats.llmc import save

        model = load_model(args.model)
        save(model, args.out, dtype=dtype or torch.float32)
        bf16 = dtype == torch.bfloat16
        print(
            f"wrote {args.out}: {model.num_params():,} parameters, llm.c version {5 if bf16 else 3} ({'bf16' if bf16 else 'fp32'})"
        )
        build = "train_gpt2cu" if bf16 else "train_gpt2cu built with PRECISION=FP32 (or train_gpt2.c)"
        print(f"continue training it in llm.c: {build} -e {args.out}")
