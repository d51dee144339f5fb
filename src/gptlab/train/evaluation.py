"""Evaluation during training: validation loss over fixed batches of val.bin, and a text sample
(a classifier: its validation accuracy instead of a sample)."""

from __future__ import annotations

import logging
import math

import torch

from gptlab.data import IGNORE
from gptlab.sampling import NonFiniteProbabilities
from gptlab.train.precision import autocast

log = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(trainer) -> dict:
    """Validation loss and perplexity over the first eval_steps batches of val.bin (at most one
    pass over it: rows that wrap around are left out), as a mean over every target scored, and
    a sample."""
    cfg = trainer.cfg
    trainer.model.eval()
    zero = torch.zeros((), device=trainer.device)
    total, scored, correct = zero.clone(), zero.clone(), zero.clone()
    classifier = bool(trainer.raw_model.config.num_labels)
    steps = min(cfg.eval_steps, trainer.val_loader.distinct_batches())  # past that: the same rows again
    for k in range(steps):
        batch = trainer.val_loader.batch(k)
        with autocast(trainer.device, trainer.precision):
            logits, loss = forward_loss(trainer.model, batch, trainer.device)
        targets = batch[1]  # (B, T) next tokens, or (B,) labels, on the CPU; IGNORE where left out
        counted = int((targets != IGNORE).sum())  # what the batch's loss is a mean over
        if counted:  # a mean over every target of the pass, not over batches: each is scored once
            total += loss.float() * counted
            scored += counted
        if classifier:  # logits (B, num_labels)
            correct += (logits.argmax(-1) == targets.to(logits.device)).sum()
    scored = trainer.mean_over_ranks(scored)
    val_loss = trainer.mean_over_ranks(total) / scored
    extra = {"val_accuracy": trainer.mean_over_ranks(correct) / scored} if classifier else {}
    text = sample(trainer) if (trainer.dist.is_main or trainer.sharded) and not classifier else ""
    trainer.model.train()
    return dict(step=trainer.step_num, tokens=trainer.tokens_seen, val_loss=val_loss,
                val_ppl=math.exp(min(val_loss, 50.0)), sample=text, **extra)  # fmt: skip


def forward_loss(model, batch, device):
    """(logits or None, mean loss) of one batch: (x, y) from a TokenLoader, or (x, y, extra) whose
    extra holds more forward arguments (packed examples' segments, a classifier's padding mask)."""
    x, y, *extra = batch
    more = {k: v.to(device, non_blocking=True) for k, v in (extra[0] if extra else {}).items()}
    return model(x.to(device, non_blocking=True), y.to(device, non_blocking=True), return_logits=False, **more)


def sample(trainer) -> str:
    """A short continuation of cfg.sample_prompt (fixed seed, so samples compare across evals);
    none, with a warning, where the model's outputs are not finite: a diverged model is the
    divergence guard's to stop (the error stopped the run here, with no checkpoint)."""
    from gptlab.generation import generate_text
    from gptlab.tokenizer import get_tokenizer

    cfg = trainer.cfg
    if cfg.sample_tokens <= 0:
        return ""
    tok = get_tokenizer(trainer.tokenizer_name)
    try:
        with autocast(trainer.device, trainer.precision):
            text = generate_text(trainer.raw_model, tok, cfg.sample_prompt, cfg.sample_tokens,
                                 temperature=0.8, top_k=200, generator=cfg.seed)  # fmt: skip
    except NonFiniteProbabilities:
        log.warning("step %d: no sample: the model's next-token probabilities are not finite (inf or NaN logits)",
                    trainer.step_num)  # fmt: skip
        return ""
    return cfg.sample_prompt + text
