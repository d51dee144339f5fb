"""gptlab lens: the logit lens, the top token each layer's residual stream would predict."""

from gptlab.commands._model_args import add_json_argument, add_model_arguments, load, prompt_ids, quoted, write_json


def add_arguments(parser):
    add_model_arguments(parser)
    parser.add_argument(
        "--top", type=int, default=5, help="top tokens per layer kept for the last position (default 5)"
    )
    parser.add_argument("--positions", type=int, default=8, help="show the last N positions in the table (default 8)")
    parser.add_argument("--out", default=None, help="also draw the lens as a PNG")
    add_json_argument(parser, help="also write the lens as JSON")


def run(args):
    from gptlab.inspect import logit_lens, plot_logit_lens, token_label

    if args.positions < 1:
        raise ValueError(f"--positions must be at least 1, got {args.positions}")
    model, tokenizer = load(args)
    idx = prompt_ids(args, model, tokenizer)
    lens = logit_lens(model, idx, top=args.top)
    label = lambda i: token_label(tokenizer, i)
    inputs = [label(i) for i in lens["input_ids"]]
    first = max(0, len(inputs) - args.positions)
    cell = 19
    print("top-1 next token (probability) read from each layer's residual stream; columns: input tokens")
    row = lambda name, cells: (f"{name:<9}" + "".join(f"{c:<{cell}}" for c in cells)).rstrip()
    print(row("layer", [quoted(inputs[p][: cell - 4]) for p in range(first, len(inputs))]))
    for name, ids, probs in zip(lens["layers"], lens["top_ids"], lens["top_probs"], strict=True):
        print(row(name, [f"{quoted(label(ids[p][0])[:10])} {probs[p][0]:.2f}" for p in range(first, len(inputs))]))
    print(f"top {args.top} after the last token {quoted(inputs[-1])}:")
    for name, ids, probs in zip(lens["layers"], lens["top_ids"], lens["top_probs"], strict=True):
        print(
            f"  {name:<9}" + "  ".join(f"{quoted(label(i))} {p:.2f}" for i, p in zip(ids[-1], probs[-1], strict=True))
        )
    if args.out is not None:
        plot_logit_lens(lens, tokenizer, args.out, title=f"logit lens: {args.model}")
        print(f"wrote {args.out}")
    if args.json is not None:
        write_json(args.json, lens)
