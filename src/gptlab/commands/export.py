"""gptlab export: a model (usually a native gptlab checkpoint) -> the Hugging Face GPT2LMHeadModel layout."""

DTYPES = ("float32", "float16", "bfloat16")


def add_arguments(parser):
    parser.add_argument("--model", required=True, help="gptlab checkpoint directory, HF directory, Hub id or preset")
    parser.add_argument(
        "--out", required=True, help="directory to write config.json, model.safetensors, tokenizer files"
    )
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="weights dtype (default: the model's)")


def run(args):
    import torch

    from gptlab.checkpoint import load_model, tokenizer_name
    from gptlab.hf import save_pretrained

    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = load_model(args.model, dtype=dtype)
    save_pretrained(model, args.out, tokenizer=tokenizer_name(args.model))
    print(f"wrote {args.out}: {model.num_params():,} parameters, {next(model.parameters()).dtype}")
    print(f"load it with transformers.GPT2LMHeadModel.from_pretrained({args.out!r})")
