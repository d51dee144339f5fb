"""gptlab next: the most likely next tokens after a prompt, with their probabilities."""

from gptlab.commands._model_args import add_json_argument, add_model_arguments, load, prompt_ids, quoted, write_json


def add_arguments(parser):
    add_model_arguments(parser)
    parser.add_argument("--top", type=int, default=10, help="how many tokens to show (default 10)")
    add_json_argument(parser, help="also write the tokens as JSON")


def run(args):
    from gptlab.inspect import next_tokens

    model, tokenizer = load(args)
    idx = prompt_ids(args, model, tokenizer)
    tokens = next_tokens(model, tokenizer, idx, top=args.top)
    print(f"next token after {args.prompt!r} ({idx.size(1)} tokens):")
    for rank, t in enumerate(tokens, start=1):
        bar = "#" * round(40 * t["prob"])
        print(f"{rank:>3}. {quoted(t['token']):<20} id {t['id']:>6}  {100 * t['prob']:7.3f}%  {bar}".rstrip())
    if args.json is not None:
        write_json(args.json, {"prompt": args.prompt, "next": tokens})
