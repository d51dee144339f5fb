"""gptlab patch: activation patching of a clean prompt into a corrupted one, with attribution
patching's estimate of the same grid (gptlab.patching); a table, a PNG and a JSON file."""

from gptlab.commands._model_args import add_json_argument, add_model_arguments, load, quoted, write_json


def add_arguments(parser):
    add_model_arguments(parser, prompt=False)
    parser.add_argument("--clean", required=True, help="the clean prompt")
    parser.add_argument("--corrupt", required=True, help="the corrupted prompt (the same number of tokens)")
    parser.add_argument("--answers", nargs=2, required=True, metavar=("RIGHT", "WRONG"),
                        help='the clean and the corrupted answer, one token each (e.g. " Mary" " John")')  # fmt: skip
    parser.add_argument("--metric", default="logit-diff", choices=["logit-diff"],
                        help="logit(RIGHT) - logit(WRONG) at the last position")  # fmt: skip
    parser.add_argument("--over", default="layer-pos", choices=["layer-pos", "layer-head"])
    parser.add_argument("--out", default=None, help="draw the patching and attribution grids as a PNG")
    add_json_argument(parser, help="also write the grids as JSON")


def single_token(tokenizer, text: str) -> int:
    """The answer's one token; `<|endoftext|>` is that token, as in the prompts."""
    ids = tokenizer.encode(text, allowed_special="all")
    if len(ids) != 1:
        raise ValueError(f"--answers {text!r} is {len(ids)} tokens; each answer must be one token")
    return ids[0]


def run(args):
    import torch

    from gptlab.inspect import encode_prompt, plot_patching, token_label
    from gptlab.patching import activation_patching, attribution_patching, logit_diff

    model, tokenizer = load(args)
    device, block = next(model.parameters()).device, model.config.block_size
    clean, corrupt = (torch.tensor([encode_prompt(tokenizer, text, block, flag)], device=device)
                      for text, flag in ((args.clean, "--clean"), (args.corrupt, "--corrupt")))  # fmt: skip
    if clean.shape != corrupt.shape:
        raise ValueError(f"--clean is {clean.size(1)} tokens, --corrupt {corrupt.size(1)}: they must be as long")
    right, wrong = (single_token(tokenizer, a) for a in args.answers)
    if right == wrong:
        raise ValueError("--answers are the same token: their logit difference is always 0")
    metric = logit_diff(right, wrong)
    result = activation_patching(model, clean, corrupt, metric, over=args.over)
    normalized, span = result["normalized"], result["clean"] - result["corrupt"]
    if abs(span) <= 1e-9:  # the grid has no scale (activation_patching's zeros)
        raise ValueError(f"--clean and --corrupt give the same logit difference ({result['clean']:.4f}): "
                         "there is nothing to patch; choose prompts whose answers differ")  # fmt: skip
    attribution = attribution_patching(model, clean, corrupt, metric, over=args.over)
    columns = ([token_label(tokenizer, int(t)) for t in clean[0]] if args.over == "layer-pos"
               else [f"head {h}" for h in range(model.config.n_head)])  # fmt: skip
    print(f"logit difference: clean {result['clean']:.4f}, corrupted {result['corrupt']:.4f}")
    print(f"patched ({args.over}), as a share of the way from corrupted (0) to clean (1):")
    print(f"{'layer':<7}" + "".join(f"{quoted(c[:9]):>12}" for c in columns))  # labels: escaped, not repr'd
    for layer, row in enumerate(normalized.tolist()):
        print(f"{layer:<7}" + "".join(f"{v:>12.3f}" for v in row))
    data = {"over": args.over, "columns": columns, "clean": result["clean"], "corrupt": result["corrupt"],
            "grid": result["grid"].tolist(), "normalized": normalized.tolist(),
            "attribution": attribution.tolist()}  # fmt: skip
    if args.out is not None:
        plot_patching(normalized, attribution / span, columns, args.out,
                      title=f"{args.model}: {args.clean!r} -> {args.corrupt!r}")  # fmt: skip
        print(f"wrote {args.out}")
    if args.json is not None:
        write_json(args.json, data)
