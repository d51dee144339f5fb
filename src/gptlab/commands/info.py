"""gptlab info: what a model is made of."""

from pathlib import Path


def add_arguments(parser):
    parser.add_argument("model", nargs="?", default=None, help="preset name, gptlab/HF directory or Hub id")
    parser.add_argument("--model", dest="model_opt", default=None, help="same as the positional MODEL")


def run(args):
    import torch

    from gptlab.checkpoint import load_model
    from gptlab.config import PRESETS, GPTConfig
    from gptlab.model import GPT

    spec = args.model_opt or args.model or "gpt2"
    if spec in PRESETS and not Path(spec).exists():
        with torch.device("meta"):  # shapes are all a preset's breakdown needs
            model = GPT(GPTConfig.from_name(spec))
    else:
        model = load_model(spec)
    rows = model.param_breakdown()
    width = max(len(r["component"]) for r in rows)
    print(f"model: {spec}")
    for r in rows:
        print(f"  {r['component']:<{width}}  {r['params']:>14,}  {r['note']}")
    print(f"  {'total':<{width}}  {model.num_params():>14,}")
