"""LoRA adapters on gptlab's GPT (Hu et al. 2021), in PEFT's file format both ways.

A LoRALinear wraps one linear layer (fp32, bf16, or a quantized int8/int4 layer: its own kernels
run the frozen base) and adds scale * B A x on slices of its outputs: the whole output for most
layers, and q, k and v each with their own A and B inside GPT-2's fused `c_attn` (targets
`c_attn.q`, `c_attn.k`, `c_attn.v`; `c_attn` alone is one adapter over all three, as PEFT has it).
The adapters train in fp32; B starts at zero, so a fresh adapter changes nothing.

PEFT's format (adapter_config.json + adapter_model.safetensors, keys
`base_model.model.<module>.lora_A.weight` (r, in) and `lora_B.weight` (out, r)) is written so
that `PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(<the base exported>), dir)`
gives the same logits. Separate q, k, v adapters have no PEFT equivalent of rank r; they are
written exactly as one c_attn adapter of rank 3r, A the three A's stacked and B block-diagonal
(rank_pattern and alpha_pattern keep each scale).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

QKV = ("q", "k", "v")
ALL_TARGETS = ("c_attn.q", "c_attn.k", "c_attn.v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "lm_head")
PREFIX = "base_model.model."
# PEFT settings under which an adapter computes something other than plain LoRA, which gptlab runs:
# loaded as plain LoRA, a target_parameters adapter on a square weight and an aLoRA one (applied
# only from its invocation tokens on) gave other logits than PEFT's, saying nothing.
OTHER_THAN_LORA = {
    "use_dora": "DoRA",
    "use_rslora": "rsLoRA",
    "target_parameters": "parameter-targeting LoRA",
    "alora_invocation_tokens": "Activated LoRA (aLoRA)",
    "use_bdlora": "block-diagonal (BD-LoRA)",
    "arrow_config": "Arrow-routed",
}


@dataclass
class LoRASettings:
    """Which layers get adapters and how large: targets are names from ALL_TARGETS or `c_attn`."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("c_attn.q", "c_attn.v")
    ranks: dict[str, int] = field(default_factory=dict)  # per-module overrides (full module names)
    alphas: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        unknown = [t for t in self.targets if t not in (*ALL_TARGETS, "c_attn")]
        if unknown:
            raise ValueError(
                f"unknown LoRA target(s) {', '.join(unknown)}; choose from {', '.join(ALL_TARGETS)}, c_attn"
            )
        if self.rank < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ValueError(
                f"LoRA needs rank >= 1, alpha > 0, dropout in [0, 1); got {self.rank}, {self.alpha}, {self.dropout}"
            )


class LoRALinear(nn.Module):
    """base(x) + sum over slices s of scale_s * B_s A_s dropout(x), written to outputs s."""

    def __init__(self, base: nn.Module, slices: dict[str, tuple[int, int]], rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.slices = dict(slices)  # name -> (first output, end)
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout)
        device = base.weight.device  # a Linear's parameter or a quantized layer's buffer
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for name, (start, end) in self.slices.items():
            a = torch.empty(rank, base.in_features, device=device)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # PEFT's init for A; B starts at zero
            self.lora_A[name] = nn.Parameter(a)
            self.lora_B[name] = nn.Parameter(torch.zeros(end - start, rank, device=device))
        self.in_features, self.out_features = base.in_features, base.out_features
        self.train(base.training)  # a new module trains: in an eval model, its dropout stayed on

    def delta_weight(self) -> torch.Tensor:
        """The fp32 (out, in) matrix the adapters add to the base weight."""
        delta = torch.zeros(self.out_features, self.in_features, device=self.lora_A[next(iter(self.slices))].device)
        for name, (start, end) in self.slices.items():
            delta[start:end] += self.scale * (self.lora_B[name] @ self.lora_A[name])
        return delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (..., out)
        h = self.dropout(x).float()
        parts = []
        for name, (start, end) in self.slices.items():
            parts.append((start, end, (h @ self.lora_A[name].t()) @ self.lora_B[name].t() * self.scale))
        if len(parts) == 1 and parts[0][:2] == (0, self.out_features):
            return y + parts[0][2].to(y.dtype)
        delta = torch.zeros(*y.shape[:-1], self.out_features, device=y.device)
        for start, end, d in parts:
            delta[..., start:end] += d
        return y + delta.to(y.dtype)


def _module_slices(model, target: str) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """(module name, {slice name: output range}) for each module a target names."""
    C = model.config.n_embd
    if target == "lm_head":
        return [("lm_head", {"all": (0, model.config.vocab_size)})]
    out = []
    for i in range(model.config.n_layer):
        if target.startswith("c_attn."):
            q = QKV.index(target.split(".")[1])
            out.append((f"transformer.h.{i}.attn.c_attn", {target.split(".")[1]: (q * C, (q + 1) * C)}))
        elif target == "c_attn":
            out.append((f"transformer.h.{i}.attn.c_attn", {"all": (0, 3 * C)}))
        else:
            out.append((f"transformer.h.{i}.{target}", {"all": (0, model.get_submodule(f"transformer.h.{i}.{target}").out_features)}))  # fmt: skip
    return out


def apply_lora(model: nn.Module, settings: LoRASettings) -> nn.Module:
    """Freeze the model and wrap each targeted layer in a LoRALinear (in place; returns model)."""
    if model.config.num_labels and "lm_head" in settings.targets:  # it failed as an AttributeError, or as "tied"
        raise ValueError("a classifier has no lm_head (its score head trains whole beside the adapters): drop lm_head")
    if model.config.tie_weights and "lm_head" in settings.targets:
        raise ValueError("an adapter on lm_head would also change the tied token embedding: untie it or drop lm_head")
    for p in model.parameters():
        p.requires_grad_(False)
    for m in model.modules():  # quantized layers pass gradients back to the adapters before them (QLoRA)
        if hasattr(m, "passes_gradients"):
            m.passes_gradients = True
    wanted: dict[str, dict[str, tuple[int, int]]] = {}
    for target in settings.targets:
        for name, slices in _module_slices(model, target):
            existing = wanted.setdefault(name, {})
            if existing and ("all" in slices or "all" in existing):
                raise ValueError(f"{name}: c_attn and c_attn.q/k/v overlap; choose one")
            existing.update(slices)
    for name, slices in wanted.items():
        parent, _, child = name.rpartition(".")
        base = model.get_submodule(name)
        rank = settings.ranks.get(name, settings.rank)
        alpha = settings.alphas.get(name, settings.alpha)
        setattr(
            model.get_submodule(parent) if parent else model,
            child,
            LoRALinear(base, slices, rank, alpha, settings.dropout),
        )
    model.lora_settings = settings
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and unwrap it (in place; returns model). A quantized
    base is replaced by its dequantized float layer first, so the merge is exact."""
    from gptlab.linear import Linear

    layers = lora_layers(model)
    if "lm_head" in layers and model.config.ties_head:
        raise ValueError("cannot merge an adapter on lm_head into a head tied to the token embedding: the merged "
                         "weight would change the embedding too (load the model with its adapter instead)")  # fmt: skip
    for name, layer in layers.items():
        base = layer.base
        if not isinstance(base, nn.Linear):  # a quantized layer: its float equivalent
            weight = base.dequantize()
            merged = Linear(base.in_features, base.out_features, bias=base.bias is not None, device=weight.device)
            merged.weight.copy_(weight)
            if base.bias is not None:
                merged.bias.copy_(base.bias)
            base = merged
        base.weight.add_(layer.delta_weight().to(base.weight.dtype))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, base)
    if hasattr(model, "lora_settings"):  # no adapter is left to describe
        del model.lora_settings
    return model


# ----------------------------------------------------------------------------- PEFT's format


def save_adapter(model: nn.Module, directory: str | os.PathLike, *, base_model: str = "") -> None:
    """Write the model's adapters as a PEFT LoRA directory (adapter_config.json and
    adapter_model.safetensors) for GPT2LMHeadModel, or for GPT2ForSequenceClassification with the
    score head as PEFT's modules_to_save; q/k/v adapters as one exact c_attn adapter."""
    from gptlab.atomic import atomic_write, atomic_write_text

    tensors, ranks, alphas, modules = {}, {}, {}, set()
    settings = model.lora_settings
    for name, layer in lora_layers(model).items():
        rank = layer.lora_A[next(iter(layer.slices))].size(0)
        A = torch.cat([layer.lora_A[s] for s in layer.slices])  # (k r, in)
        B = torch.zeros(layer.out_features, A.size(0))  # (out, k r): block-diagonal over the slices
        for j, (s, (start, end)) in enumerate(layer.slices.items()):
            B[start:end, j * rank : (j + 1) * rank] = layer.lora_B[s]
        tensors[f"{PREFIX}{name}.lora_A.weight"] = A.detach().float().contiguous()
        tensors[f"{PREFIX}{name}.lora_B.weight"] = B.detach().float().contiguous()
        ranks[name] = A.size(0)
        alphas[name] = layer.scale * A.size(0)  # PEFT's scale is alpha / r
        modules.add(name.rpartition(".")[2])
    extra = {}
    if model.config.num_labels:  # a classifier: its new head goes along, as PEFT's modules_to_save
        tensors[f"{PREFIX}score.weight"] = model.score.weight.detach().float().contiguous()
        extra = {"modules_to_save": ["score"]}
    config = {
        **extra, "task_type": "SEQ_CLS" if model.config.num_labels else "CAUSAL_LM",
        "peft_type": "LORA", "base_model_name_or_path": base_model,
        "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
        "target_modules": sorted(modules), "fan_in_fan_out": True, "bias": "none", "inference_mode": True,
        "rank_pattern": {f"^{n}$": r for n, r in ranks.items()},
        "alpha_pattern": {f"^{n}$": a for n, a in alphas.items()},
    }  # fmt: skip
    directory = Path(directory)
    atomic_write(directory / "adapter_model.safetensors", lambda tmp: save_file(tensors, tmp))
    atomic_write_text(directory / "adapter_config.json", json.dumps(config, indent=2))


def load_adapter(model: nn.Module, directory: str | os.PathLike) -> nn.Module:
    """Apply a PEFT LoRA directory (trained on GPT2LMHeadModel, or written by save_adapter) to the
    model, in place; returns the model. An adapter made for another model is a ValueError, raised
    before the model is changed."""
    directory = Path(directory)
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{directory}: not a PEFT adapter directory (adapter_config.json: {getattr(e, 'strerror', None) or e})"
        ) from e
    if not isinstance(config, dict):
        raise ValueError(f"{directory}: adapter_config.json is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{directory}: a {config.get('peft_type')} adapter; gptlab reads LORA")
    for key, variant in OTHER_THAN_LORA.items():
        if config.get(key):
            raise ValueError(f"{directory}: {variant} adapters ({key}) are not supported; gptlab runs plain LoRA")
    if config.get("lora_bias"):  # its lora_B.bias tensors were left out: other logits, silently
        raise ValueError(f"{directory}: adapters with lora_bias (a bias on lora_B) are not supported")
    if config.get("bias", "none") != "none":  # was "holds ...base_layer.bias, which this model does not have"
        raise ValueError(f"{directory}: adapters trained with bias={config['bias']!r} (the layers' biases trained "
                         "too) are not supported; gptlab reads bias='none' adapters")  # fmt: skip
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), int | float):
            raise ValueError(f"{directory}: adapter_config.json has no number {key!r}")
    try:
        tensors = load_file(str(directory / "adapter_model.safetensors"))
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise ValueError(f"{directory}: cannot read adapter_model.safetensors ({e})") from e
    own = model.state_dict()
    layers, saved = _adapter_tensors(directory, config, tensors, model, own)
    for p in model.parameters():
        p.requires_grad_(False)
    for name, (A, B, alpha) in layers.items():
        base = model.get_submodule(name)
        layer = LoRALinear(base, {"all": (0, base.out_features)}, A.size(0), alpha, config.get("lora_dropout", 0.0))
        layer.lora_A["all"].data.copy_(A)
        layer.lora_B["all"].data.copy_(B)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    with torch.no_grad():
        for name, tensor in saved.items():
            own[name].copy_(tensor)
    model.lora_settings = LoRASettings(rank=config["r"], alpha=config["lora_alpha"], dropout=config.get("lora_dropout", 0.0), targets=())  # fmt: skip
    return model


def _adapter_tensors(directory: Path, config: dict, tensors: dict, model: nn.Module, own: dict) -> tuple[dict, dict]:
    """The adapter's layers, {module name: (A, B, alpha)}, and its modules_to_save tensors, each
    checked against the model (`own`: its state dict): a module it lacks, or a shape of another
    width, is a ValueError."""
    other = sorted(k for k in tensors if ".lora_" in k and not k.endswith((".lora_A.weight", ".lora_B.weight")))
    if other:  # a bias on B, an embedding's adapter: tensors gptlab would leave out
        raise ValueError(f"{directory}: the adapter holds {', '.join(other)}; gptlab reads lora_A and lora_B weights")
    names = sorted({k[len(PREFIX) :].rsplit(".lora_", 1)[0] for k in tensors if ".lora_" in k})
    saved = _gptlab_layout(model, {k[len(PREFIX) :]: v for k, v in tensors.items() if ".lora_" not in k})
    unknown = sorted(set(saved) - set(own))
    if unknown:
        raise ValueError(f"{directory}: the adapter holds {', '.join(unknown)}, which this model does not have")
    for name, tensor in saved.items():
        if tensor.shape != own[name].shape:
            raise ValueError(f"{directory}: {name} has shape {tuple(tensor.shape)}, this model's {tuple(own[name].shape)}")  # fmt: skip
    tied = _tied_pair(model) & set(saved)
    if tied:  # PEFT's modules_to_save replaces that module alone; copied here, it changed both
        raise ValueError(f"{directory}: the adapter replaces {', '.join(sorted(tied))} (modules_to_save), which this "
                         "model ties to the other of the token embedding and lm_head; PEFT replaces one alone, "
                         "a tied model cannot: not supported")  # fmt: skip
    layers = {}
    for name in names:
        A, B = (tensors.get(f"{PREFIX}{name}.lora_{x}.weight") for x in "AB")
        if A is None or B is None:
            raise ValueError(f"{directory}: {name} needs both lora_A and lora_B weights")
        try:
            base = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"{directory}: the adapter is for {name}, which this model does not have") from None
        if isinstance(base, LoRALinear):
            raise ValueError(f"{directory}: {name} already carries an adapter (a LoRA run's): merge it first")
        if not hasattr(base, "out_features"):
            raise ValueError(f"{directory}: the adapter is for {name}, which is not a linear layer")
        if A.dim() != 2 or B.dim() != 2 or A.shape[1] != base.in_features or B.shape != (base.out_features, A.shape[0]):
            raise ValueError(f"{directory}: {name}'s adapter is (A {tuple(A.shape)}, B {tuple(B.shape)}), but the layer "
                             f"maps {base.in_features} to {base.out_features}: an adapter for another model")  # fmt: skip
        layers[name] = A, B, _pattern(config.get("alpha_pattern", {}), name, config["lora_alpha"])
    return layers, saved


def _gptlab_layout(model: nn.Module, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's modules_to_save tensors as gptlab holds them: they are transformers' tensors, and
    GPT-2's Conv1D weights are (in, out) there, (out, in) in gptlab's Linear (gptlab.hf's table)."""
    from gptlab.hf import name_table

    table = name_table(model.config)  # HF name -> (gptlab name, transposed?)
    out = {}
    for name, tensor in saved.items():
        ours, transpose = table.get(name, (name, False))
        out[ours] = tensor.t().contiguous() if transpose else tensor
    return out


def _tied_pair(model: nn.Module) -> set[str]:
    """The state-dict names of the token embedding and the head when they share one tensor."""
    head = getattr(model, "lm_head", None)
    if head is None or head.weight is not model.transformer.wte.weight:
        return set()
    return {"transformer.wte.weight", "lm_head.weight"}


def _pattern(patterns: dict, name: str, default):
    """PEFT's rank/alpha pattern lookup (peft.utils.other.get_pattern_key): the first key that,
    as a whole regular expression, matches the module name's end after a dot, or all of it. A
    `^`-key is anchored at the end too, and `a|b` is one group: searched unanchored, they matched
    modules PEFT's keys do not (a prefix `^transformer.h.1`, `fc` inside `c_attn|fc`)."""
    import re

    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default
