"""gptlab train: train or fine-tune a model; settings from --config FILE.toml and --key=value overrides.

Run it under `torchrun --nproc_per_node=K -m gptlab train ...` for data-parallel training.
"""

import sys


def add_arguments(parser):
    parser.add_argument("--config", help="TOML file of TrainConfig settings (flat, or under [train])")
    parser.add_argument("--resume", action="store_true", help="continue the run in out_dir from its latest checkpoint")
    parser.add_argument("--fsdp", action="store_true", help="shard the model with FSDP (under torchrun)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.epilog = (
        "Any TrainConfig field can be set as --key=value, e.g. --max_steps=200 --lr=1e-3 (see README, Training)."
    )
    parse_known = parser.parse_known_args

    def parse_args(args=None, namespace=None):
        # TrainConfig fields are open-ended options: collect every --key=value argparse does not know.
        ns, extra = parse_known(args, namespace)
        bad = [a for a in extra if not (a.startswith("--") and "=" in a)]
        if bad:
            parser.error(f"unrecognized arguments: {' '.join(bad)} (settings are --key=value)")
        ns.overrides = extra
        return ns

    parser.parse_args = parse_args


def run(args):
    from gptlab.train import TrainConfig, TrainingDiverged, train

    flags = {name: True for name in ("resume", "fsdp", "compile") if getattr(args, name)}
    overrides = list(args.overrides)
    cfg = TrainConfig.from_toml(args.config, overrides) if args.config else TrainConfig().with_overrides(overrides)
    cfg = cfg.with_overrides(flags)
    try:
        summary = train(cfg)
    except TrainingDiverged as e:
        print(f"gptlab train: {e}", file=sys.stderr)
        return 1
    if summary.get("checkpoint"):
        print(f"checkpoint: {summary['checkpoint']}")
        print(f"metrics:    {summary['metrics']}")
        print(f"plot:       {summary['plot']}")
        if summary.get("val_loss") is not None:
            print(f"val loss:   {summary['val_loss']:.4f} after {summary['step']} steps ({summary['tokens']:,} tokens)")
