"""`gptlab train` under torchrun with per-rank test knobs; each rank records what it did.

    torchrun --nproc_per_node=2 tests/ddp_ranks.py RECORD_DIR train --config ...

Knobs, from the environment:
  DDP_LATE_RANK_S=S  rank 1 starts its clock S seconds after rank 0 (it sleeps as it builds the
                     optimizer: after Trainer's last collective, before its time budget starts)
  DDP_LATE_RANK=R    rank R is the late one instead (DDP_LATE_RANK_S)
  DDP_FAKE_PROBE=1   precision=auto measures (a CPU with bf16 instructions, the probe faked): the
                     fake probe finds bf16 faster on rank 1 only, and takes a second on rank 0
  DDP_SAVE_FAILS=M   rank 0's checkpoint writes raise RuntimeError(M) (not a ValueError or OSError)

Each rank writes RECORD_DIR/rankN.json: the learning rate of each of its steps (and a digest of
its random state before it), its precision,
how often it probed, and the checkpoint its summary names.
"""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

import gptlab.train
from gptlab import cli, run_files
from gptlab.train import precision, setup
from gptlab.train.trainer import Trainer

RANK = int(os.environ["RANK"])
RECORD = {"lrs": [], "precision": None, "probes": 0, "checkpoint": None, "rng": []}


def late(build):
    def build_late(*args, **kwargs):
        if RANK == int(os.environ.get("DDP_LATE_RANK", "1")):
            time.sleep(float(os.environ["DDP_LATE_RANK_S"]))
        return build(*args, **kwargs)

    return build_late


def fake_probe(model, device, batch, block) -> dict[str, float]:
    RECORD["probes"] += 1
    if RANK == 0:
        time.sleep(1.0)  # measuring a while: rank 1 finds no cached timings
    return {"float32": 0.5, "bfloat16": 0.1} if RANK == 1 else {"float32": 0.1, "bfloat16": 0.5}


def failing_write(*args, **kwargs):
    raise RuntimeError(os.environ["DDP_SAVE_FAILS"])


def recorded(step):
    def recording_step(self) -> dict:
        RECORD["rng"].append(hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16])
        record = step(self)
        RECORD["lrs"].append(record["lr"])
        RECORD["precision"] = str(self.precision).removeprefix("torch.")
        return record

    return recording_step


def recorded_train(train):
    def recording_train(cfg):
        summary = train(cfg)
        RECORD["checkpoint"] = summary["checkpoint"]
        return summary

    return recording_train


def main() -> int:
    record_dir, argv = Path(sys.argv[1]), sys.argv[2:]
    if "DDP_LATE_RANK_S" in os.environ:
        setup.build_optimizer = late(setup.build_optimizer)
    if os.environ.get("DDP_FAKE_PROBE"):
        precision.may_have_native_bf16 = precision.onednn_runs_bf16 = lambda: True
        precision.probe = fake_probe
    if "DDP_SAVE_FAILS" in os.environ and RANK == 0:
        run_files.write_checkpoint = failing_write
    Trainer.step = recorded(Trainer.step)
    gptlab.train.train = recorded_train(gptlab.train.train)  # what `gptlab train` calls
    try:
        return cli.main(argv)
    finally:
        record_dir.mkdir(parents=True, exist_ok=True)
        (record_dir / f"rank{RANK}.json").write_text(json.dumps(RECORD))


if __name__ == "__main__":
    sys.exit(main())
