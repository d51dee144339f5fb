"""gptlab trace: one forward pass step by step, as GPT-2 is taught: tokens, shapes, residual stream, next tokens."""

from gptlab.commands._model_args import add_json_argument, add_model_arguments, load, prompt_ids, quoted, write_json


def add_arguments(parser):
    add_model_arguments(parser)
    parser.add_argument("--top", type=int, default=5, help="how many next tokens to show (default 5)")
    add_json_argument(parser, help="also write the trace as JSON")


def run(args):
    from gptlab.inspect import trace

    model, tokenizer = load(args)
    idx = prompt_ids(args, model, tokenizer)
    result = trace(model, tokenizer, idx, top=args.top)
    print_trace(result)
    if args.json is not None:
        write_json(args.json, result)


def print_trace(result: dict) -> None:
    tokens = result["tokens"]
    print(f"1. tokenize: {len(tokens)} tokens")
    for i, t in enumerate(tokens):
        print(f"   {i:>4}  {t['id']:>6}  {quoted(t['text'])}")
    print("2. forward pass, stage by stage (B = batch, T = tokens)")
    width = max(len(s["stage"]) for s in result["stages"])
    for s in result["stages"]:
        shape = "(" + ", ".join(str(d) for d in s["shape"]) + ")"
        print(f"   {s['stage']:<{width}}  {shape:<20} {s['detail']}")
    print("3. residual stream per block (L2 norms averaged over positions)")
    print(
        f"   {'block':>5}  {'|x| in':>9}  {'|attn|':>9}  {'|mlp|':>9}  {'|change|':>9}  {'|x| out':>9}  change/|x in|"
    )
    for b in result["blocks"]:
        rel = b["change"] / b["resid_in"] if b["resid_in"] else float("inf")
        print(
            f"   {b['layer']:>5}  {b['resid_in']:9.3f}  {b['attn']:9.3f}  {b['mlp']:9.3f}  "
            f"{b['change']:9.3f}  {b['resid_out']:9.3f}  {rel:8.2%}"
        )
    print(f"4. logits: shape {tuple(result['logits_shape'])}; the last position predicts the next token:")
    for rank, t in enumerate(result["next"], start=1):
        print(f"   {rank:>2}. {quoted(t['token']):<20} id {t['id']:>6}  p = {t['prob']:.4f}")
