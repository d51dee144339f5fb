"""The learning-rate schedule, and the time budget (`max_time`) that can drive it instead of steps."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from gptlab.train_config import TrainConfig, parse_duration  # noqa: F401 (parse_duration: re-exported)


def step_fraction(step: int, cfg: TrainConfig) -> float:
    """How far through the decay a step-counted run is: after warmup for cosine, of all steps for wsd."""
    if cfg.schedule == "wsd":
        return step / cfg.max_steps
    return (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)


def lr_at(step: int, cfg: TrainConfig, fraction: float | None = None) -> float:
    """Learning rate for update `step` (0-based): linear warmup to cfg.lr over warmup_steps, then
    cosine to min_lr, or constant, or constant then linear decay over the last decay_fraction (wsd).

    `fraction` (0..1) is how much of the run is done; by default it comes from the step count
    (step_fraction), and a `max_time` run passes the elapsed fraction of its time budget.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, max(0.0, step_fraction(step, cfg) if fraction is None else fraction))
    if cfg.schedule == "wsd":
        decay = (progress - (1 - cfg.decay_fraction)) / cfg.decay_fraction
        return cfg.lr if decay <= 0 else cfg.lr - min(1.0, decay) * (cfg.lr - cfg.final_lr)
    return cfg.final_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.final_lr)


class TimeBudget:
    """Wall time spent by a run, carried across resumes, against an optional limit in seconds.

    `clock` is injectable (tests pass a fake one). Each method reads it once, so a run's sequence
    of readings, and with it a time-driven schedule, is the same for a fake clock every time.
    """

    def __init__(self, seconds: float | None, clock: Callable[[], float] = time.perf_counter, spent: float = 0.0):
        self.seconds, self.clock = seconds, clock
        self.spent_before = spent  # seconds spent by earlier processes of the same run
        self.start = clock()

    def elapsed(self) -> float:
        return self.spent_before + (self.clock() - self.start)

    def fraction(self, elapsed: float | None = None) -> float | None:
        """The elapsed fraction of the budget (capped at 1), or None without a budget. `elapsed`:
        a reading taken already (the one all ranks agreed on), else the clock's now."""
        if self.seconds is None:
            return None
        return min(1.0, (self.elapsed() if elapsed is None else elapsed) / self.seconds)

    def exhausted(self, elapsed: float | None = None) -> bool:
        """Whether the budget is spent (`elapsed` as in `fraction`)."""
        if self.seconds is None:
            return False
        return (self.elapsed() if elapsed is None else elapsed) >= self.seconds
