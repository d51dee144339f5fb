"""GPTConfig: the shape of a GPT-2-style model, its variant switches, and named presets.

No torch import here: configs are read by the CLI and the server before any model exists.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

POS_EMBEDDINGS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "gelu_erf", "swiglu")
CLASSIFIER_FIELDS = ("num_labels", "labels", "pad_token_id")


@dataclass
class GPTConfig:
    """Hyper-parameters of a decoder-only Transformer. Defaults are GPT-2 small (124M)."""

    vocab_size: int = 50257
    block_size: int = 1024  # maximum context length (GPT-2's n_positions)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and norms, as GPT-2
    layer_norm_eps: float = 1e-5
    tie_weights: bool = True  # lm_head shares the token embedding matrix
    # Variant switches; the defaults are GPT-2.
    pos_embedding: str = "learned"  # "learned" (GPT-2 wpe) or "rope" (rotary, RoFormer)
    rope_theta: float = 10000.0
    norm: str = "layernorm"  # "layernorm" or "rmsnorm"
    mlp: str = "gelu"  # "gelu" (tanh approximation, 4x), "gelu_erf" (exact GELU, 4x) or "swiglu" (Shazeer 2020)
    n_inner: int | None = None  # MLP hidden width; None: 4*n_embd (gelu) or ~8/3*n_embd (swiglu)
    # Sequence classification (gptlab.classifier): num_labels > 0 puts a `score` head (num_labels
    # x n_embd) where the LM head was, read at each row's last non-padding token.
    num_labels: int = 0
    labels: list[str] | None = None  # label names in id order
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        for name in ("dropout", "layer_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"GPTConfig.{name} must be a number, got {value!r}")
        for name in ("bias", "tie_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not 0 < self.layer_norm_eps < float("inf"):  # inf made every norm's output its bias
            raise ValueError(f"GPTConfig.layer_norm_eps must be a positive finite number, got {self.layer_norm_eps!r}")
        if not 0 < self.rope_theta < float("inf"):  # 0, negative or NaN made NaN rotary angles
            raise ValueError(f"GPTConfig.rope_theta must be a positive finite number, got {self.rope_theta!r}")
        _check_choice("pos_embedding", self.pos_embedding, POS_EMBEDDINGS)
        _check_choice("norm", self.norm, NORMS)
        _check_choice("mlp", self.mlp, MLPS)
        if self.pos_embedding == "rope" and self.head_size % 2 != 0:
            raise ValueError(f"GPTConfig.n_embd/n_head must be even for rope, got {self.head_size}")
        if self.n_inner is not None and (
            isinstance(self.n_inner, bool) or not isinstance(self.n_inner, int) or self.n_inner <= 0
        ):
            raise ValueError(f"GPTConfig.n_inner must be a positive integer or None, got {self.n_inner!r}")
        if isinstance(self.num_labels, bool) or not isinstance(self.num_labels, int) or self.num_labels < 0:
            raise ValueError(f"GPTConfig.num_labels must be a non-negative integer, got {self.num_labels!r}")
        if self.labels is not None:
            if not isinstance(self.labels, list | tuple):
                raise ValueError(f"GPTConfig.labels must be a list of names, got {self.labels!r}")
            self.labels = [str(name) for name in self.labels]
            if len(self.labels) != self.num_labels or len(set(self.labels)) != len(self.labels):
                raise ValueError(
                    f"GPTConfig.labels must name each of the {self.num_labels} labels once, got {self.labels}"
                )

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_hidden(self) -> int:
        """Width of the MLP's hidden layer."""
        if self.n_inner is not None:
            return self.n_inner
        if self.mlp == "swiglu":  # 2/3 of 4x keeps the parameter count of a 4x GELU MLP (Llama)
            return _round_up(8 * self.n_embd // 3, 64)
        return 4 * self.n_embd

    @property
    def ties_head(self) -> bool:
        """True when lm_head is the token embedding's matrix (a classifier has no lm_head)."""
        return self.tie_weights and not self.num_labels

    @property
    def is_gpt2(self) -> bool:
        """True when transformers' GPT2LMHeadModel holds the model exactly (gptlab.hf exports it):
        no variant of `not_gpt2`. An untied head, the exact GELU and no biases (zero biases) are GPT-2 too."""
        return not self.not_gpt2

    @property
    def not_gpt2(self) -> list[str]:
        """The variant switches that GPT2LMHeadModel cannot represent, by name."""
        variants = {  # the exact GELU (nanoGPT's) is GPT2LMHeadModel's activation_function="gelu"
            "RoPE positions": self.pos_embedding != "learned",
            "RMSNorm": self.norm != "layernorm",
            "SwiGLU MLP": self.mlp == "swiglu",
        }  # an untied head is tie_word_embeddings=False with its own lm_head.weight; no biases are zero biases
        return [name for name, on in variants.items() if on]

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPTConfig:
        """Build a preset by name (see PRESETS), optionally overriding fields."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        """Every field; a language model's leaves out the classification fields (their defaults)."""
        d = dataclasses.asdict(self)
        if not self.num_labels:
            for name in CLASSIFIER_FIELDS:
                d.pop(name)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """Build from a dict; unknown keys are an error that names them."""
        if not isinstance(d, dict):
            raise ValueError(f"a GPTConfig is a dict of its fields, got {type(d).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s): {', '.join(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GPTConfig:
        return cls.from_dict(json.loads(text))


def _check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"GPTConfig.{field} must be one of {choices}, got {value!r}")


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


# OpenAI's four GPT-2 shapes, plus small models for tests and CPU demos.
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
    "gpt2-tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=128),
    "gpt2-mini": dict(n_layer=4, n_head=4, n_embd=128, block_size=256),
    "gpt2-small-cpu": dict(n_layer=6, n_head=6, n_embd=192, block_size=256),
    # A small Llama-style model: rotary positions, RMSNorm, SwiGLU, no biases, untied head.
    "llama-tiny": dict(
        n_layer=2,
        n_head=4,
        n_embd=64,
        block_size=128,
        pos_embedding="rope",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        tie_weights=False,
    ),
}
