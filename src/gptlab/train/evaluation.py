"""Evaluation during training: validation loss over fixed batches of val.bin, and a text sample."""

from __future__ import annotations

import math

import torch

from gptlab.train.precision import autocast


@torch.no_grad()
def evaluate(trainer) -> dict:
    """Validation loss and perplexity over the first eval_steps batches of val.bin, and a sample."""
    cfg = trainer.cfg
    trainer.model.eval()
    total = torch.zeros((), device=trainer.device)
    for k in range(cfg.eval_steps):
        x, y = (t.to(trainer.device) for t in trainer.val_loader.batch(k))
        with autocast(trainer.device, trainer.precision):
            _, loss = trainer.model(x, y, return_logits=False)
        total += loss.float()
    val_loss = trainer.mean_over_ranks(total / cfg.eval_steps)
    text = sample(trainer) if (trainer.dist.is_main or trainer.sharded) else ""
    trainer.model.train()
    return dict(step=trainer.step_num, tokens=trainer.tokens_seen, val_loss=val_loss,
                val_ppl=math.exp(min(val_loss, 50.0)), sample=text)  # fmt: skip


def sample(trainer) -> str:
    """A short continuation of cfg.sample_prompt (fixed seed, so samples compare across evals)."""
    from gptlab.generation import generate_text
    from gptlab.tokenizer import get_tokenizer

    cfg = trainer.cfg
    if cfg.sample_tokens <= 0:
        return ""
    tok = get_tokenizer(trainer.tokenizer_name)
    with autocast(trainer.device, trainer.precision):
        text = generate_text(trainer.raw_model, tok, cfg.sample_prompt, cfg.sample_tokens,
                             temperature=0.8, top_k=200, generator=cfg.seed)  # fmt: skip
    return cfg.sample_prompt + text
