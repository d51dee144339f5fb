"""gptlab attention: a heatmap of one layer's attention probabilities, token strings on both axes."""

from gptlab.commands._model_args import add_model_arguments, load, prompt_ids, quoted


def add_arguments(parser):
    add_model_arguments(parser)
    parser.add_argument("--layer", type=int, required=True, help="layer index, 0-based (negative counts from the end)")
    parser.add_argument("--head", type=int, default=None, help="one head (default: a grid of all heads)")
    parser.add_argument("--out", default="attention.png", help="PNG file to write (default attention.png)")


def run(args):
    from gptlab.inspect import plot_attention, token_label

    model, tokenizer = load(args)
    idx = prompt_ids(args, model, tokenizer)
    probs = model.attention(idx, layer=args.layer, head=args.head)[0]  # (nh, T, T) or (T, T)
    labels = [token_label(tokenizer, int(i)) for i in idx[0]]
    layer = args.layer % model.config.n_layer
    if args.head is None:
        title, heads = f"{args.model}: layer {layer}, all {model.config.n_head} heads", None
    else:
        head = args.head % model.config.n_head
        title, heads = f"{args.model}: layer {layer}, head {head}", [head]
    plot_attention(probs, labels, args.out, title=title, heads=heads)
    print(f"wrote {args.out}: {title}, {len(labels)} tokens")
    last = probs if probs.dim() == 3 else probs[None]  # (n, T, T)
    print(f"the last token {quoted(labels[-1])} attends most to:")
    for k, row in enumerate(last[:, -1]):
        j = int(row.argmax())
        name = f"head {heads[0] if heads else k}"
        print(f"  {name:>8}: {quoted(labels[j])} (position {j}, p = {float(row[j]):.3f})")
