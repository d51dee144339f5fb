"""nanoGPT checkpoints (gptlab.formats.nanogpt) against nanoGPT's own forward pass.

The fixture writes `ckpt.pt` as nanoGPT's train.py does: `{'model': raw_model.state_dict(),
'optimizer': optimizer.state_dict(), 'model_args', 'iter_num', 'best_val_loss', 'config'}`, with
nanoGPT's parameter names (nn.Linear (out, in) layout, `lm_head.weight` the same tensor as
`transformer.wte.weight`, biases only when bias=True, `_orig_mod.` prefixes after torch.compile).
The reference logits come from `nanogpt_logits`, a re-statement of nanoGPT's model.py forward
(its non-flash attention path, `nn.GELU()`'s exact GELU) over the checkpoint's own tensors.
`gptlab bench formats --nanogpt DIR` compares against nanoGPT's model.py itself.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from gptlab import load_model
from gptlab.cli import main

TOL = 1e-5


def model_args(**overrides):
    return dict(n_layer=2, n_head=4, n_embd=32, block_size=32, bias=True, vocab_size=97, dropout=0.0) | overrides


def nanogpt_state(args: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under nanoGPT's names, at the scale of a trained model (pre-activations of
    order 1, where the exact and the tanh GELU differ by up to 5e-4)."""
    g = torch.Generator().manual_seed(seed)
    C, V, T, bias = args["n_embd"], args["vocab_size"], args["block_size"], args["bias"]

    def matrix(out_features, in_features):
        return torch.randn(out_features, in_features, generator=g) / math.sqrt(in_features)

    def vector(n, mean=0.0):
        return mean + 0.1 * torch.randn(n, generator=g)

    state = {"transformer.wte.weight": 0.5 * torch.randn(V, C, generator=g), "transformer.wpe.weight": 0.5 * torch.randn(T, C, generator=g)}  # fmt: skip
    for i in range(args["n_layer"]):
        h = f"transformer.h.{i}."
        linears = {"attn.c_attn": (3 * C, C), "attn.c_proj": (C, C), "mlp.c_fc": (4 * C, C), "mlp.c_proj": (C, 4 * C)}
        state[h + "ln_1.weight"] = vector(C, 1.0)
        if bias:
            state[h + "ln_1.bias"] = vector(C)
        for name, (n_out, n_in) in linears.items():
            state[h + name + ".weight"] = matrix(n_out, n_in)
            if bias:
                state[h + name + ".bias"] = vector(n_out)
        state[h + "ln_2.weight"] = vector(C, 1.0)
        if bias:
            state[h + "ln_2.bias"] = vector(C)
    state["transformer.ln_f.weight"] = vector(C, 1.0)
    if bias:
        state["transformer.ln_f.bias"] = vector(C)
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied: one tensor, two names
    return state


def nanogpt_logits(state: dict, args: dict, idx: torch.Tensor, gelu=F.gelu) -> torch.Tensor:
    """nanoGPT's GPT.forward (model.py, manual-attention path) over a state dict: (B, T, V) logits."""
    C, nh = args["n_embd"], args["n_head"]
    B, T = idx.shape

    def layer_norm(x, p):
        return F.layer_norm(x, (C,), state[p + ".weight"], state.get(p + ".bias"), 1e-5)

    def linear(x, p):
        return F.linear(x, state[p + ".weight"], state.get(p + ".bias"))

    x = state["transformer.wte.weight"][idx] + state["transformer.wpe.weight"][:T]  # (B, T, C)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(args["n_layer"]):
        h = f"transformer.h.{i}."
        q, k, v = linear(layer_norm(x, h + "ln_1"), h + "attn.c_attn").split(C, dim=2)
        q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // nh))  # (B, nh, T, T)
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + linear(y, h + "attn.c_proj")
        x = x + linear(gelu(linear(layer_norm(x, h + "ln_2"), h + "mlp.c_fc")), h + "mlp.c_proj")
    return F.linear(layer_norm(x, "transformer.ln_f"), state["lm_head.weight"])  # (B, T, V)


def adamw_state(state: dict) -> dict:
    """optimizer.state_dict() of nanoGPT's configure_optimizers (decay / no-decay groups) after one step."""
    params = {id(t): torch.nn.Parameter(t.clone()) for t in state.values()}.values()  # the tied tensor once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), fused=False)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    return optimizer.state_dict()


def write_checkpoint(out_dir, state: dict, args: dict, *, compiled: bool = False) -> None:
    """ckpt.pt as nanoGPT's train.py saves it (torch.compile'd models carry `_orig_mod.` prefixes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = {("_orig_mod." if compiled else "") + k: v for k, v in state.items()}
    config = dict(out_dir=str(out_dir), eval_interval=250, init_from="scratch", dataset="shakespeare",
                  batch_size=12, learning_rate=6e-4, compile=compiled, dtype="float32", **args)  # fmt: skip
    checkpoint = {
        "model": model,
        "optimizer": adamw_state(state),
        "model_args": args,
        "iter_num": 250,
        "best_val_loss": torch.tensor(1.4697),  # estimate_loss() returns tensors
        "config": config,
    }
    torch.save(checkpoint, out_dir / "ckpt.pt")


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
def test_logits_equal_nanogpts(tmp_path, bias, compiled):
    args = model_args(bias=bias)
    state = nanogpt_state(args)
    write_checkpoint(tmp_path / "out", state, args, compiled=compiled)
    idx = torch.randint(0, args["vocab_size"], (2, args["block_size"]), generator=torch.Generator().manual_seed(1))
    expected = nanogpt_logits(state, args, idx)
    for spec in (tmp_path / "out", tmp_path / "out" / "ckpt.pt"):  # the out_dir or the file
        model = load_model(str(spec))
        with torch.no_grad():
            logits, _ = model(idx)
        assert (logits - expected).abs().max().item() <= TOL
    assert model.config.bias is bias and model.config.mlp == "gelu_erf" and model.config.tie_weights
    assert model.lm_head.weight is model.transformer.wte.weight


def test_the_exact_gelu_matters_at_this_scale():
    """The fixture's weights are large enough that GPT-2's tanh GELU would miss nanoGPT's logits."""
    args = model_args()
    state = nanogpt_state(args)
    idx = torch.randint(0, args["vocab_size"], (2, args["block_size"]), generator=torch.Generator().manual_seed(1))
    tanh = nanogpt_logits(state, args, idx, gelu=lambda h: F.gelu(h, approximate="tanh"))
    assert (tanh - nanogpt_logits(state, args, idx)).abs().max().item() > 100 * TOL


def test_checkpoint_loads_with_weights_only(tmp_path):
    """Everything train.py saves (optimizer state, config, tensor best_val_loss) passes the restricted unpickler."""
    args = model_args()
    write_checkpoint(tmp_path, nanogpt_state(args), args)
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert checkpoint["optimizer"]["state"] and checkpoint["config"]["dataset"] == "shakespeare"


def test_a_checkpoint_that_needs_unpickling_code_is_refused(tmp_path):
    args = model_args()
    torch.save({"model": nanogpt_state(args), "model_args": args, "config": {"when": __import__("datetime").date(2024, 1, 1)}}, tmp_path / "ckpt.pt")  # fmt: skip
    with pytest.raises(ValueError, match="weights_only=True"):
        load_model(str(tmp_path / "ckpt.pt"))


def test_old_torch_mask_buffers_are_ignored(tmp_path):
    """nanoGPT on torch < 2.0 registers a causal-mask buffer `attn.bias` (1, 1, T, T), saved with the weights."""
    args = model_args(bias=False)
    state = nanogpt_state(args)
    T = args["block_size"]
    masked = {**state, **{f"transformer.h.{i}.attn.bias": torch.tril(torch.ones(T, T)).view(1, 1, T, T) for i in range(2)}}  # fmt: skip
    write_checkpoint(tmp_path, masked, args)
    idx = torch.arange(T).view(1, T) % args["vocab_size"]
    with torch.no_grad():
        assert (load_model(str(tmp_path))(idx)[0] - nanogpt_logits(state, args, idx)).abs().max() <= TOL


def test_mismatches_name_the_tensor(tmp_path):
    args = model_args()
    state = nanogpt_state(args)
    state["transformer.h.1.mlp.c_fc.weight"] = state["transformer.h.1.mlp.c_fc.weight"].t()  # (in, out): Conv1D layout
    write_checkpoint(tmp_path / "shape", state, args)
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.mlp\.c_fc\.weight has shape \(32, 128\)"):
        load_model(str(tmp_path / "shape"))
    state = nanogpt_state(args)
    del state["transformer.ln_f.bias"]
    write_checkpoint(tmp_path / "missing", state, args)
    with pytest.raises(ValueError, match=r"missing tensors \['transformer\.ln_f\.bias'\]"):
        load_model(str(tmp_path / "missing"))
    torch.save({"weights": state}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a nanoGPT checkpoint"):
        load_model(str(tmp_path / "other.pt"))


def test_damaged_checkpoints_are_value_errors(tmp_path):
    """An empty file, model_args that are not a dict, a state without the embedding or with a
    non-string key: each a ValueError naming it (IndexError, TypeError, KeyError, AttributeError)."""
    args, state = model_args(), nanogpt_state(model_args())
    (tmp_path / "empty.pt").write_bytes(b"")
    cases = [
        ("empty.pt", None, "cannot read it as a nanoGPT checkpoint"),
        ("args.pt", {"model": state, "model_args": 3}, "model_args is a int"),
        (
            "no-wte.pt",
            {"model": {k: v for k, v in state.items() if "wte" not in k}, "model_args": args},
            "no transformer.wte",
        ),  # fmt: skip
        (
            "int-key.pt",
            {"model": {**state, 0: state["transformer.wte.weight"]}, "model_args": args},
            "not a state dict",
        ),  # fmt: skip
    ]
    for name, content, message in cases:
        if content is not None:
            torch.save(content, tmp_path / name)
        with pytest.raises(ValueError, match=message):
            load_model(str(tmp_path / name))


def test_cli_reads_the_out_dir(tmp_path, capsys):
    """Any --model takes nanoGPT's out_dir: here a 50304-token model (nanoGPT's padded GPT-2 vocabulary)."""
    args = model_args(vocab_size=50304, n_embd=32, bias=False)
    write_checkpoint(tmp_path / "out", nanogpt_state(args), args, compiled=True)
    assert main(["next", "--model", str(tmp_path / "out"), "--prompt", "Hello", "--top", "3"]) == 0
    assert "Hello" in capsys.readouterr().out


def test_export_to_hugging_face_keeps_the_exact_gelu(tmp_path):
    """nanoGPT -> gptlab -> HF: GPT2LMHeadModel(activation_function="gelu") gives nanoGPT's logits."""
    from transformers import GPT2LMHeadModel

    args = model_args()
    state = nanogpt_state(args)
    write_checkpoint(tmp_path / "out", state, args)
    assert main(["export", "--model", str(tmp_path / "out"), "--out", str(tmp_path / "hf")]) == 0
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert theirs.config.activation_function == "gelu"
    idx = torch.randint(0, args["vocab_size"], (2, args["block_size"]), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (theirs(idx).logits - nanogpt_logits(state, args, idx)).abs().max().item() <= TOL
