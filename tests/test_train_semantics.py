"""gptlab.train semantics that a wrong trainer could break with the loss still falling (issue 16):
the precision a run reports is the one its matmuls run in, gradient accumulation averages,
weight decay reaches matrices only, and compiled training saves a plain checkpoint."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from gptlab import cpu, kernels, machine_cache
from gptlab.checkpoint import load_native
from gptlab.train import TrainConfig, Trainer, precision
from gptlab.train.muon import Muon
from test_train import byte_data, config  # noqa: F401 (byte_data is a fixture)


def linear_output_dtypes(model) -> list[torch.dtype]:
    """Record the output dtype of every linear layer of the transformer blocks on each forward."""
    seen: list[torch.dtype] = []
    for module in model.transformer.h.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    return seen


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_configured_precision_is_what_the_matmuls_run(byte_data, tmp_path, name):  # noqa: F811
    trainer = Trainer(config(byte_data, tmp_path / "run", precision=name))
    seen = linear_output_dtypes(trainer.raw_model)
    trainer.step()
    assert trainer.precision == getattr(torch, name)
    assert seen and set(seen) == {getattr(torch, name)}  # every block matmul, forward
    assert all(p.dtype == torch.float32 for p in trainer.raw_model.parameters())  # master weights stay fp32


@pytest.mark.parametrize("faster", ["float32", "bfloat16"])
def test_auto_runs_what_it_measured_and_reports(byte_data, tmp_path, monkeypatch, caplog, faster):  # noqa: F811
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "cache"))
    for name in machine_cache.ISA_SETTINGS:  # as run plainly, even under settings that stand in for another CPU
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(precision, "may_have_native_bf16", lambda: True)  # a CPU whose flags name bf16: measured
    monkeypatch.setattr(precision, "onednn_runs_bf16", lambda: True)  # and oneDNN not held below them
    calls = []

    def fake_probe(model, device, batch, block):
        calls.append((batch, block))
        return {"float32": 0.2, "bfloat16": 0.5} if faster == "float32" else {"float32": 0.5, "bfloat16": 0.2}

    monkeypatch.setattr(precision, "probe", fake_probe)
    with caplog.at_level("INFO"):
        trainer = Trainer(config(byte_data, tmp_path / "run", precision="auto"))
    seen = linear_output_dtypes(trainer.raw_model)
    trainer.step()
    assert trainer.precision == getattr(torch, faster) and set(seen) == {getattr(torch, faster)}
    assert f"precision: {faster} (auto: one forward + backward of this model took" in caplog.text
    assert "measured now" in caplog.text and calls == [(4, 32)]
    # A second run on this machine reads the cache instead of measuring again.
    again = Trainer(config(byte_data, tmp_path / "run2", precision="auto"))
    assert again.precision == trainer.precision and len(calls) == 1
    cached = json.loads((tmp_path / "cache" / precision.CACHE_FILE).read_text())
    assert len(cached) == 1 and "torch " + torch.__version__ in next(iter(cached))
    # Held to fewer instructions (e.g. oneDNN to AVX2), the same machine measures again.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    Trainer(config(byte_data, tmp_path / "run3", precision="auto"))
    assert len(calls) == 2
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in list(json.loads((tmp_path / "cache" / precision.CACHE_FILE).read_text()))[1]


def test_auto_takes_fp32_unmeasured_where_the_cpu_has_no_bf16(byte_data, tmp_path, monkeypatch, caplog):  # noqa: F811
    monkeypatch.setattr(precision, "may_have_native_bf16", lambda: False)
    monkeypatch.setattr(precision, "probe", lambda *a: pytest.fail("probed a CPU without bf16 instructions"))
    with caplog.at_level("INFO"):
        trainer = Trainer(config(byte_data, tmp_path / "run", precision="auto"))
    assert trainer.precision == torch.float32 and "this CPU has no bf16 instructions" in caplog.text


def test_auto_takes_fp32_unmeasured_where_onednn_is_held_below_bf16(tmp_path):
    """ONEDNN_MAX_CPU_ISA=AVX2 on a CPU whose flags name bf16 (how an Intel Xeon 6/207 or a Zen 5
    stands in for a Zen 3): oneDNN has no bf16 instructions then, and the probe's bf16 step took
    41.6 s against fp32's 0.29. Real oneDNN, in a fresh process: it reads the setting once."""
    code = (
        "import sys, torch\n"
        "from gptlab.config import GPTConfig\n"
        "from gptlab.model import GPT\n"
        "from gptlab.train import precision\n"
        "precision.may_have_native_bf16 = lambda: True\n"
        "precision.probe = lambda *a: sys.exit('probed bf16 with oneDNN held to AVX2')\n"
        "model = GPT(GPTConfig(vocab_size=97, block_size=32, n_layer=1, n_head=2, n_embd=32))\n"
        "print(*precision.resolve_precision('auto', torch.device('cpu'), model, (4, 32)), sep='|')\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "GPTLAB_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (
        out.stdout.strip()
        == "torch.float32|auto: oneDNN runs no bf16 instructions here (the CPU, or ONEDNN_MAX_CPU_ISA): emulated"
    )


def test_native_bf16_is_read_from_the_cpu_flags():
    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    if "sse2" in flags:  # x86 Linux: the flags decide
        assert cpu.may_have_native_bf16() == any(f in flags for f in cpu.BF16_FLAGS)
    else:
        assert cpu.may_have_native_bf16()
    assert precision.may_have_native_bf16 is cpu.may_have_native_bf16  # training asks the same


def test_auto_probe_measures_this_model(byte_data, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(precision, "may_have_native_bf16", lambda: True)
    monkeypatch.setattr(precision, "onednn_runs_bf16", lambda: True)  # measured even where it would be emulated
    trainer = Trainer(config(byte_data, tmp_path / "run", precision="auto"))
    timings = next(iter(json.loads((tmp_path / "cache" / precision.CACHE_FILE).read_text()).values()))
    assert set(timings) == {"float32", "bfloat16"} and all(t > 0 for t in timings.values())
    clearly_faster = timings["bfloat16"] < precision.BF16_MARGIN * timings["float32"]
    assert trainer.precision == (torch.bfloat16 if clearly_faster else torch.float32)
    assert all(p.grad is None for p in trainer.raw_model.parameters())  # the probe leaves no gradients


def test_the_probe_times_after_the_huge_pages_are_moved(byte_data, tmp_path, monkeypatch):  # noqa: F811
    """A timing taken while Linux copies a decoded model's pages runs slow, and the probe is cached."""
    events = []
    monkeypatch.setattr(kernels, "wait_for_huge_pages", lambda timeout=10.0: events.append("wait") or True)
    model = Trainer(config(byte_data, tmp_path / "run", precision="float32")).raw_model
    monkeypatch.setattr(
        model, "forward", lambda *a, **k: events.append("forward") or (None, model.lm_head.weight.sum())
    )
    precision.probe(model, torch.device("cpu"), 1, 8)
    assert events[0] == "wait" and events.count("forward") == 2 * (precision.PROBE_REPEATS + 1)


@pytest.mark.parametrize(("bf16_ms", "expected"), [(85, torch.bfloat16), (95, torch.float32), (120, torch.float32)])
def test_auto_takes_bf16_only_when_clearly_faster(monkeypatch, bf16_ms, expected):
    """BF16_MARGIN: a bf16 step probed at 95% of fp32's (AMD EPYC Zen 4) trained the demo to a
    worse loss than fp32 in the same time; 85% takes bf16."""
    monkeypatch.setattr(precision, "may_have_native_bf16", lambda: True)
    monkeypatch.setattr(precision, "onednn_runs_bf16", lambda: True)
    monkeypatch.setattr(precision, "cached_probe", lambda *a: ({"float32": 0.1, "bfloat16": bf16_ms / 1000}, "test"))
    choice, why = precision.resolve_precision("auto", torch.device("cpu"), model=object())
    assert choice == expected and "100 ms in float32" in why


def one_update(trainer, batches) -> dict:
    """Run one trainer.step() on the given micro-batches instead of the loader's."""
    feed = iter(batches)
    trainer.train_loader.next_batch = lambda: next(feed)
    return trainer.step()


def grads_at_the_update(trainer) -> dict[str, torch.Tensor]:
    """Filled with each parameter's gradient as the optimizer steps (after clipping)."""
    grads, step = {}, trainer.optimizer.step

    def capturing_step(*args, **kwargs):
        grads.update((n, p.grad.clone()) for n, p in trainer.raw_model.named_parameters() if p.grad is not None)
        return step(*args, **kwargs)

    trainer.optimizer.step = capturing_step
    return grads


def test_grad_accum_equals_one_big_batch(byte_data, tmp_path):  # noqa: F811
    torch.manual_seed(0)
    x = torch.randint(0, 257, (8, 32))
    y = torch.randint(0, 257, (8, 32))
    big = Trainer(config(byte_data, tmp_path / "big", batch_size=8, grad_accum=1, warmup_steps=0))
    small = Trainer(config(byte_data, tmp_path / "small", batch_size=4, grad_accum=2, warmup_steps=0))
    big_grads, small_grads = grads_at_the_update(big), grads_at_the_update(small)
    a = one_update(big, [(x, y)])
    b = one_update(small, [(x[:4], y[:4]), (x[4:], y[4:])])
    # Measured: loss 8.6e-8 relative apart, grad norm equal, each gradient 6.3e-7 to 9.3e-7 of its
    # largest element apart over four seeds (fp32 sums in another order). Not averaging (loss /
    # grad_accum dropped) doubles the loss and the gradients; Adam would hide that in the weights.
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
    assert big_grads.keys() == small_grads.keys() and len(big_grads) == len(list(big.raw_model.parameters()))
    for name, g in big_grads.items():
        torch.testing.assert_close(small_grads[name], g, rtol=0, atol=1e-5 * g.abs().max().item(), msg=name)
    # Adam's first step moves a weight by lr * g / (|g| + eps): about lr, one step more or fewer
    # shows, but ill-conditioned where |g| is near eps (Intel Xeon 6/207: a gradient of -4.17e-8
    # against -4.14e-8 put one weight 2.6e-6 apart, the rest <= 9e-7), so the weights at lr / 10.
    for (name, p), q in zip(big.raw_model.named_parameters(), small.raw_model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=3e-4, msg=name)


def test_weight_decay_reaches_matrices_not_biases_or_gains(byte_data, tmp_path):  # noqa: F811
    cfg = config(byte_data, tmp_path / "run", warmup_steps=0, lr=1e-2, weight_decay=0.5)
    trainer = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.raw_model.named_parameters()}
    # Zero every gradient (ln_f's output x 0): Adam's step is then 0 and only the decay moves weights.
    trainer.raw_model.transformer.ln_f.register_forward_hook(lambda m, args, out: out * 0.0)
    record = trainer.step()
    assert record["grad_norm"] == 0.0 and not record["skipped"]
    matrices = 0
    for name, p in trainer.raw_model.named_parameters():
        if p.dim() >= 2:  # AdamW's decoupled decay: p <- p * (1 - lr * wd)
            matrices += 1
            torch.testing.assert_close(p, before[name] * (1 - 1e-2 * 0.5), rtol=1e-6, atol=0, msg=name)
        else:
            assert torch.equal(p, before[name]), name  # biases and norm gains untouched
    assert matrices == 1 + 1 + 2 * 4  # wte (= head), wpe, and 4 linear weights per block


def test_compiled_training_saves_a_plain_checkpoint(byte_data, tmp_path):  # noqa: F811
    trainer = Trainer(config(byte_data, tmp_path / "run", compile=True))
    assert trainer.model is not trainer.raw_model  # the loop calls the compiled module
    first, second = trainer.step(), trainer.step()  # compiles forward + backward once
    assert second["loss"] < first["loss"]
    trainer.save_checkpoint()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "run" / "latest" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and not any("_orig_mod" in k for k in keys)
    assert load_native(tmp_path / "run" / "latest").config.n_layer == 2


# --------------------------------------------------------------------------------------------- Muon


def first_update(trainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each parameter's change in the trainer's first step, with the gradients it stepped on."""
    before = {n: p.detach().clone() for n, p in trainer.raw_model.named_parameters()}
    grads = {}
    for n, p in trainer.raw_model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.detach().clone()))
    trainer.step()
    return {n: p.detach() - before[n] for n, p in trainer.raw_model.named_parameters()}, grads


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's orthogonalization as Keller Jordan published it: a quintic Newton-Schulz iteration on
    g / |g| that pushes its singular values towards 1 (float64 here, as the reference)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double() / (g.double().norm() + 1e-7)
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return (x if wide else x.T).float()


def test_muon_orthogonalizes_the_blocks_matrices_and_adamw_steps_the_rest(byte_data, tmp_path):  # noqa: F811
    lr, muon_lr = 1e-3, 4e-3
    cfg = config(byte_data, tmp_path / "run", optimizer="muon", muon_lr=muon_lr, lr=lr, min_lr=0.0,
                 warmup_steps=0, weight_decay=0.0, grad_clip=0.0)  # fmt: skip
    trainer = Trainer(cfg)
    deltas, grads = first_update(trainer)
    model = trainer.raw_model
    matrices = {n for n, p in model.named_parameters() if n.startswith("transformer.h.") and p.dim() == 2}
    assert len(matrices) == 4 * cfg.n_layer  # attention qkv and out, MLP in and out
    for name, delta in deltas.items():
        if name in matrices:
            # Muon: -muon_lr * 0.2 * sqrt(max(A, B)) * NS(g), Moonshot's AdamW-matched scale.
            expected = -muon_lr * 0.2 * max(delta.shape) ** 0.5 * newton_schulz(grads[name])
            # measured: at most 6.6e-6 of the largest element off the float64 reference
            torch.testing.assert_close(delta, expected, rtol=0, atol=5e-5 * expected.abs().max(), msg=name)
        else:
            # AdamW's first step: lr * g / (|g| + eps), i.e. lr wherever the gradient is well above eps.
            big = grads[name].abs() > 1e-5
            assert big.any(), name
            torch.testing.assert_close(delta[big], -lr * grads[name][big].sign(), rtol=2e-3, atol=0, msg=name)
    scaled = {id(g["params"][0]): g["lr"] for g in trainer.optimizer.param_groups}
    assert scaled[id(model.transformer.h[0].attn.c_attn.weight)] == muon_lr
    assert scaled[id(model.transformer.wte.weight)] == lr


def test_muon_steps_as_torch_muon_does():
    """gptlab's Muon against torch.optim.Muon with Moonshot's scale: momentum, Nesterov, weight decay
    and the per-shape scale over several steps (torch's Newton-Schulz runs in bf16, so not exactly)."""
    torch.manual_seed(0)
    shapes = [(384, 128), (384, 128), (128, 512), (48, 48)]
    ours = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt_ours = Muon(ours, lr=0.01, weight_decay=0.1, momentum=0.9)
    opt_theirs = torch.optim.Muon(theirs, lr=0.01, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    start = [p.detach().clone() for p in ours]
    for _ in range(4):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn_like(a) * torch.rand(a.shape[1])  # columns of unequal scale
            b.grad = a.grad.clone()
        opt_ours.step()
        opt_theirs.step()
    for a, b, p0 in zip(ours, theirs, start, strict=True):
        moved = (b - p0).detach()
        # measured: 1.0-1.3% of the largest move apart, torch's bf16 products
        torch.testing.assert_close(a - p0, moved, rtol=0, atol=0.02 * moved.abs().max())


def test_optimizer_settings_are_checked():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="muon_lr must be positive"):
        TrainConfig(optimizer="muon", muon_lr=-0.01)
    with pytest.raises(ValueError, match="FSDP shards them"):
        TrainConfig(optimizer="muon", fsdp=True)
    with pytest.raises(ValueError, match="train LoRA adapters with adamw"):
        TrainConfig(optimizer="muon", lora_rank=4, init_from="gpt2")


def test_muon_and_adamw_under_a_grad_scaler_step_as_without_it(byte_data, tmp_path):  # noqa: F811
    """fp16 training (CUDA) unscales and steps the pair of optimizers through GradScaler; on the CPU
    GradScaler does the same bookkeeping, so every gradient it hands the optimizers (Muon's too) and
    the step must equal the plain ones. (Both updates barely depend on the gradients' scale, so the
    gradients are compared, not only the weights.)"""
    runs = []
    for scaled in (False, True):
        trainer = Trainer(config(byte_data, tmp_path / f"run{scaled}", optimizer="muon"))
        model, opt = trainer.raw_model, trainer.optimizer
        batch = trainer.train_loader.next_batch()
        _, loss = model(*batch)
        if scaled:
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            grads = [p.grad.clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
        runs.append((grads, [p.detach().clone() for p in model.parameters()]))
    (plain_grads, plain), (scaled_grads, scaled) = runs
    for a, b in zip(plain_grads, scaled_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-9)
    for a, b in zip(plain, scaled, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
