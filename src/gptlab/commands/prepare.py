"""gptlab prepare: text files -> train.bin / val.bin token files plus manifest.json; instruction
records (Alpaca or chat JSON/JSONL) -> the same plus a loss mask (gptlab.sft); text/label
records -> a classification set (gptlab.classify_data)."""

import sys

FORMATS = ("auto", "text", "sft", "classify")
# Options for some kinds of data only: given for another kind, they were silently ignored.
FORMAT_OPTIONS = {"labels": ("classify",), "template": ("sft",), "train_on": ("sft",), "seed": ("sft", "classify")}


def add_arguments(parser):
    parser.add_argument(
        "--input",
        nargs="+",
        help='text FILE, DIR or GLOB (several allowed; JSON/JSONL of {"text": ...} records: their texts), or a `datasets` name',
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--tokenizer", default="gpt2", help="gpt2 (default), byte, or a Hugging Face model's directory")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="the last fraction of tokens for validation")
    parser.add_argument("--workers", type=int, default=None, help="encoding processes (default: by input size)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    sft = parser.add_argument_group("instruction data (Alpaca: instruction/input/output; chat: messages)")
    sft.add_argument("--format", choices=FORMATS, default="auto",
                     help="auto (default): sft for Alpaca or chat records, classify for text/label records "
                     "(.json/.jsonl/.csv), else text")  # fmt: skip
    sft.add_argument("--labels", help="classify: label names in id order, comma-separated (default: sorted)")
    sft.add_argument("--template", help="prompt template: alpaca (default) or a JSON file (see gptlab.sft.Template)")
    sft.add_argument("--train-on", choices=("response", "all"),
                     help="tokens the loss covers: the responses / assistant turns (default), or all")  # fmt: skip
    sft.add_argument("--seed", type=int, help="seed of the validation examples' draw (default 0)")
    sft.add_argument("--show", type=int, default=0, metavar="N",
                     help="print the first N prepared examples, trained-on tokens marked [[...]] "
                     "(with --out alone: of an existing directory)")  # fmt: skip


def run(args):
    from gptlab import sft
    from gptlab.commands._model_args import check_out_path
    from gptlab.data import read_manifest

    if not args.input:
        if not args.show:
            raise ValueError("prepare needs --input (or --show N to look at a prepared SFT directory)")
        kind = read_manifest(args.out).get("kind", "text")  # it said "no train.mask.bin" of a text directory
        if kind != "sft":
            raise ValueError(f"--show marks the trained-on tokens of instruction data; {args.out} holds {kind} data")
    else:
        check_out_path(args.out, directory=True)  # before tokenizing: writing found it after
        args.input = _input_files(args)
        fmt = args.format if args.format != "auto" else sft.record_format(args.input) or "text"
        if args.show and fmt != "sft":
            raise ValueError(f"--show marks the trained-on tokens of instruction data; this input is {fmt}")
        _check_options(args, fmt)
        if fmt == "sft":
            _prepare_sft(args)
        elif fmt == "classify":
            _prepare_classify(args)
        else:
            _prepare_text(args)
    for i in range(args.show):
        print(sft.render_example(args.out, i, color=sys.stdout.isatty()), end="\n\n")


def _check_options(args, fmt: str) -> None:
    """ValueError for an option given that this kind of data does not use (FORMAT_OPTIONS)."""
    for name, formats in FORMAT_OPTIONS.items():
        if getattr(args, name) is not None and fmt not in formats:
            raise ValueError(f"--{name.replace('_', '-')} is for {' or '.join(formats)} data; this input is {fmt} "
                             "(--format names it)")  # fmt: skip


def _prepare_text(args):
    from gptlab.data import prepare

    inputs = args.input[0] if len(args.input) == 1 else args.input
    manifest = prepare(inputs, args.out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                       workers=args.workers, progress=not args.no_progress)  # fmt: skip
    t = manifest["tokens"]
    print(
        f"{args.out}: {t['train']:,} train + {t['val']:,} val tokens ({manifest['dtype']}, tokenizer {manifest['tokenizer']})"
    )


def _input_files(args):
    """--input's files, leaving out an --out that lies inside an input directory (a second run read
    its own outputs as input); a name that is no file (a `datasets` name) as it is."""
    from gptlab.data import resolve_inputs

    try:
        return [str(p) for p in resolve_inputs(args.input, exclude=args.out)]
    except ValueError:
        return args.input


def _prepare_sft(args):
    from gptlab.sft import prepare_sft

    m = prepare_sft(args.input, args.out, tokenizer=args.tokenizer, template=args.template,
                    train_on=args.train_on or "response", val_fraction=args.val_fraction, seed=args.seed or 0)  # fmt: skip
    e, t, trained = m["examples"], m["tokens"], m["trained_tokens"]
    print(
        f"{args.out}: {e['train']:,} train + {e['val']:,} val examples, {t['train']:,} + {t['val']:,} tokens, "
        f"{trained['train'] / t['train']:.0%} trained on ({m['train_on']}); longest {m['max_example_tokens']} tokens"
    )


def _prepare_classify(args):
    from gptlab.classify_data import prepare_classify

    labels = [x.strip() for x in args.labels.split(",")] if args.labels else None
    m = prepare_classify(args.input, args.out, tokenizer=args.tokenizer, labels=labels,
                         val_fraction=args.val_fraction, seed=args.seed or 0)  # fmt: skip
    e = m["examples"]
    counts = ", ".join(f"{n} {c}" for n, c in zip(m["labels"], m["per_label"]["train"], strict=True))
    print(f"{args.out}: {e['train']:,} train + {e['val']:,} val texts; labels (train): {counts}")
