"""gptlab train: train or fine-tune a model; settings from --config FILE.toml and --set key=value overrides.

Run it under `torchrun --nproc_per_node=K -m gptlab train ...` for data-parallel training.
"""

import logging
import os
import sys


def add_set_argument(parser) -> None:
    """--set KEY=VALUE, repeatable: one TrainConfig setting (train and demo share it)."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a TrainConfig setting, e.g. --set max_steps=200 --set lr=1e-3 (repeatable)")  # fmt: skip


def add_arguments(parser):
    parser.add_argument("--config", help="TOML file of TrainConfig settings (flat, or under [train])")
    add_set_argument(parser)
    parser.add_argument("--resume", action="store_true", help="continue the run in out_dir from its latest checkpoint")
    parser.add_argument("--fsdp", action="store_true", help="shard the model with FSDP (under torchrun)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.epilog = "Every TrainConfig field can be set with --set key=value (see README, Training)."


def run(args):
    from gptlab.train import TrainConfig, TrainingDiverged, train

    main = os.environ.get("RANK", "0") == "0"  # under torchrun rank 0 alone reports; the others say only errors
    if not main:  # before the config is read: its warnings (a renamed key) came from every rank
        logging.getLogger().setLevel(logging.ERROR)
    flags = {name: True for name in ("resume", "fsdp", "compile") if getattr(args, name)}
    overrides = list(args.overrides)
    cfg = TrainConfig.from_toml(args.config, overrides) if args.config else TrainConfig().with_overrides(overrides)
    cfg = cfg.with_overrides(flags)
    try:
        summary = train(cfg)
    except TrainingDiverged as e:
        if main:
            print(f"gptlab train: {e}", file=sys.stderr)
        return 1
    if main and summary.get("checkpoint"):
        print(f"checkpoint: {summary['checkpoint']}")
        print(f"metrics:    {summary['metrics']}")
        print(f"plot:       {summary['plot']}")
        print(f"precision:  {summary['precision']}")
        if summary.get("val_loss") is not None:
            print(f"val loss:   {summary['val_loss']:.4f} after {summary['step']} steps ({summary['tokens']:,} tokens)")
