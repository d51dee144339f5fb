"""gptlab demo: the main job. For now: build a small model, show its parameters, sample a few tokens."""


def add_arguments(parser):
    parser.add_argument("--preset", default="gpt2-mini", help="model preset (default gpt2-mini)")
    parser.add_argument("--seed", type=int, default=1337)


def run(args):
    import torch

    from gptlab.config import GPTConfig
    from gptlab.model import GPT
    from gptlab.tokenizer import get_tokenizer

    torch.manual_seed(args.seed)
    model = GPT(GPTConfig.from_name(args.preset)).eval()
    print(f"{args.preset}: {model.num_params():,} parameters")
    for r in model.param_breakdown():
        print(f"  {r['component']:<26} {r['params']:>12,}  {r['note']}")
    tok = get_tokenizer("gpt2")
    idx = torch.tensor([tok.encode("To be, or not to be")])
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for _ in range(16):
            logits, _ = model(idx)
            probs = torch.softmax(logits[:, -1], dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=gen)], dim=1)
    print("sample (untrained):", repr(tok.decode(idx[0].tolist())))
