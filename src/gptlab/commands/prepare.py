"""gptlab prepare: text files -> train.bin / val.bin token files plus manifest.json."""


def add_arguments(parser):
    parser.add_argument(
        "--input", required=True, nargs="+", help="text FILE, DIR or GLOB (several allowed), or a `datasets` name"
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--tokenizer", default="gpt2", help="gpt2 (default) or byte")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="the last fraction of tokens for validation")
    parser.add_argument("--workers", type=int, default=None, help="encoding processes (default: by input size)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args):
    from gptlab.data import prepare

    inputs = args.input[0] if len(args.input) == 1 else args.input
    manifest = prepare(inputs, args.out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                       workers=args.workers, progress=not args.no_progress)  # fmt: skip
    t = manifest["tokens"]
    print(
        f"{args.out}: {t['train']:,} train + {t['val']:,} val tokens ({manifest['dtype']}, tokenizer {manifest['tokenizer']})"
    )
