"""Sequence classification: GPT-2 with a `score` head where the LM head was (transformers'
GPT2ForSequenceClassification), and which parameters train.

The head reads the final norm's output at each row's last non-padding token: with an
`attention_mask` (B, T), its last True; otherwise the last token that is not `pad_token_id`,
as transformers does. Left padding is recognised from the mask (a row whose first token is
padding): positions then count from each row's first real token and padding is masked out of
attention, so a left-padded row gives the logits of the same text unpadded. The data side is
gptlab.classify_data.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlab.config import GPTConfig
from gptlab.linear import Linear
from gptlab.meta import meta_device
from gptlab.model import GPT

log = logging.getLogger(__name__)


class GPTForSequenceClassification(GPT):
    """GPT-2 body + `score` (num_labels, n_embd), no bias, pooled at the last real token."""

    def __init__(self, config: GPTConfig):
        if config.num_labels < 1:
            raise ValueError("a classifier needs config.num_labels >= 1")
        super().__init__(config)
        del self.lm_head
        self.score = Linear(config.n_embd, config.num_labels, bias=False)
        nn.init.normal_(self.score.weight, mean=0.0, std=0.02)  # transformers' initializer_range

    def tie_weights(self) -> None:
        pass  # no LM head to tie

    def forward(self, idx, targets=None, *, attention_mask=None, return_logits=True):
        """Label logits (B, num_labels) and, given targets (B,) label ids, the mean cross-entropy.

        attention_mask (B, T), True/1 at real tokens; without it, padding is pad_token_id."""
        B, T = idx.shape
        mask = self.real_tokens(idx, attention_mask)  # (B, T) bool
        positions = key_mask = None
        if not bool(mask[:, 0].all()):  # left padding: count positions from each row's first token
            positions = (mask.long().cumsum(1) - 1).clamp(min=0)  # (B, T)
            key_mask = mask
        h, _ = super().forward(idx, positions=positions, key_mask=key_mask, head=False)  # (B, T, C)
        last = (torch.arange(T, device=idx.device) * mask).argmax(-1)  # (B,) the last real token
        logits = self.score(h[torch.arange(B, device=idx.device), last])  # (B, num_labels)
        loss = None
        if targets is not None:
            if targets.shape != (B,):
                raise ValueError(
                    f"classification targets must be label ids of shape ({B},), got {tuple(targets.shape)}"
                )
            loss = F.cross_entropy(logits.float(), targets)
        return logits, loss

    def real_tokens(self, idx, attention_mask=None) -> torch.Tensor:
        """(B, T) bool, True at the tokens that are not padding."""
        if attention_mask is not None:
            if attention_mask.shape != idx.shape:
                raise ValueError(
                    f"attention_mask {tuple(attention_mask.shape)} must have idx's shape {tuple(idx.shape)}"
                )
            mask = attention_mask.bool()
        elif self.config.pad_token_id is not None:
            mask = idx != self.config.pad_token_id
        elif idx.size(0) > 1:
            raise ValueError("a batch of several rows needs an attention_mask or config.pad_token_id")
        else:
            mask = torch.ones_like(idx, dtype=torch.bool)
        if not bool(mask.any(1).all()):
            raise ValueError("a row holds only padding")
        return mask

    def _head_row(self) -> dict:
        return dict(component="classification head (score)", params=self.score.weight.numel(), note="")

    @torch.no_grad()
    def classify(self, tok, texts: list[str]) -> torch.Tensor:
        """Label probabilities (len(texts), num_labels) for raw texts, right-padded in one batch."""
        block = self.config.block_size
        encoded = [tok.encode(t) for t in texts]
        for i, ids in enumerate(encoded):
            if len(ids) > block:  # as transformers truncates: the start is classified
                log.warning("text %d is %d tokens: its first %d (block_size) are classified", i, len(ids), block)
        rows = [ids[:block] or [tok.eot_token] for ids in encoded]
        x, mask = pad_rows(rows, self.config.pad_token_id if self.config.pad_token_id is not None else tok.eot_token)
        device = self.transformer.wte.weight.device
        logits, _ = self(x.to(device), attention_mask=mask.to(device))
        return logits.float().softmax(-1).cpu()

    def label_names(self) -> list[str]:
        return list(self.config.labels or [f"LABEL_{i}" for i in range(self.config.num_labels)])


def model_for(config: GPTConfig) -> GPT:
    """The model class a config describes: a classifier when num_labels > 0, else the LM."""
    return GPTForSequenceClassification(config) if config.num_labels else GPT(config)


def from_language_model(lm: GPT, labels: list[str], pad_token_id: int | None = 50256) -> GPTForSequenceClassification:
    """A classifier with lm's body (shared tensors, not copies) and a fresh score head."""
    config = GPTConfig.from_dict({**lm.config.to_dict(), "num_labels": len(labels), "labels": list(labels),
                                  "pad_token_id": pad_token_id})  # fmt: skip
    device = lm.transformer.wte.weight.device
    with meta_device():
        model = GPTForSequenceClassification(config)
    model.transformer = lm.transformer
    model.score = Linear(config.n_embd, config.num_labels, bias=False, device=device)
    nn.init.normal_(model.score.weight, mean=0.0, std=0.02)
    return model.train(lm.training)


def pad_rows(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, T_max) and the matching bool attention mask."""
    T = max(len(r) for r in rows)
    x = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, r in enumerate(rows):
        x[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = True
    return x, mask


def set_trainable(model: GPT, spec: str) -> None:
    """Freeze all but what `spec` names: "all", "head" (the head and the final norm) or
    "last:N" (those and the last N blocks). A classifier's score head always trains."""
    if spec == "all":
        return
    n = 0
    if spec.startswith("last:") and spec[5:].isdigit():
        n = int(spec[5:])
    elif spec != "head":
        raise ValueError(f"trainable must be all, head or last:N, got {spec!r}")
    if n > len(model.transformer.h):  # last:9 of 2 blocks trained them all, saying nothing
        raise ValueError(f"trainable {spec}: the model has {len(model.transformer.h)} blocks")
    keep = [model.transformer.ln_f, model.score if hasattr(model, "score") else model.lm_head]
    keep += list(model.transformer.h)[len(model.transformer.h) - n :] if n else []
    for p in model.parameters():
        p.requires_grad_(False)
    for m in keep:
        for p in m.parameters():
            p.requires_grad_(True)
