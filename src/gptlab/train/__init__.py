"""Training: `train(config)` for a `TrainConfig` (gptlab.train_config: every setting, one dataclass).

One process or many under torchrun (DDP, or FSDP with `fsdp=True`), with AdamW (and Muon for the
blocks' matrices with `optimizer="muon"`), warmup + cosine
(or constant, or warmup-stable-decay) learning rate driven by steps or by a wall-time budget
(`max_time`), gradient accumulation and clipping, bf16/fp16 mixed precision (`precision=auto`
measures which is faster here), guards against divergence, periodic evaluation with a text
sample, checkpoints that resume bit-exactly, metrics as JSON lines and a loss plot.

The parts, each one job:
  setup.py          processes (DDP/FSDP), device, model, optimizer, token-file checks
  precision.py      the autocast precision, and auto's measured, cached choice
  schedule.py       the learning rate by step or by elapsed time; the time budget
  guards.py         skip non-finite or spiking updates; TrainingDiverged
  trainer.py        Trainer: one update (`step`) and the loop (`run`); `train()`
  muon.py           the Muon optimizer for the blocks' matrices (optimizer="muon")
  evaluation.py     validation loss and a sample
  checkpointing.py  checkpoint writing and exact resume

Weight decay applies to every matrix (2-D parameter: linear weights, the token embedding that is
also the head, and the position table, as nanoGPT and GPT-2 do) and never to biases and norm
gains.
"""

from gptlab.train.guards import SpikeGuard, TrainingDiverged
from gptlab.train.precision import resolve_precision
from gptlab.train.schedule import TimeBudget, lr_at, parse_duration
from gptlab.train.setup import build_model, build_optimizer
from gptlab.train.trainer import Trainer, train
from gptlab.train_config import TrainConfig

__all__ = ["SpikeGuard", "TimeBudget", "TrainConfig", "Trainer", "TrainingDiverged", "build_model",
           "build_optimizer", "lr_at", "parse_duration", "resolve_precision", "train"]  # fmt: skip
