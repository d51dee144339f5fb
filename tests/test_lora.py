"""gptlab.lora: adapters on gptlab's GPT against PEFT's on transformers' GPT2LMHeadModel, both
ways, on the same random weights; merging; a quantized base."""

import json

import pytest
import torch

from gptlab.config import GPTConfig
from gptlab.lora import (
    ALL_TARGETS,
    LoRALinear,
    LoRASettings,
    apply_lora,
    load_adapter,
    lora_layers,
    merge,
    save_adapter,
)
from gptlab.model import GPT
from gptlab.quantize import quantize_model

pytestmark = pytest.mark.usefixtures("one_thread")
TARGETS = tuple(t for t in ALL_TARGETS if t != "lm_head")  # GPT-2's head is tied to the embedding


def base_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=50257, block_size=32, n_layer=2, n_head=2, n_embd=32)).eval()


def randomize(model) -> None:
    """B starts at zero (a fresh adapter changes nothing): give every adapter weight a value."""
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for b in layer.lora_B.values():
                b.normal_(0, 0.2)


@pytest.fixture
def idx():
    return torch.randint(0, 50257, (2, 7), generator=torch.Generator().manual_seed(1))


def test_a_fresh_adapter_changes_nothing_and_only_adapters_train(idx):
    model = base_model()
    with torch.no_grad():
        before = model(idx)[0]
    apply_lora(model, LoRASettings(rank=4, alpha=8, targets=TARGETS))
    with torch.no_grad():
        assert torch.equal(model(idx)[0], before)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    model(idx, idx)[1].backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == trainable  # adapters only
    c_attn = model.transformer.h[0].attn.c_attn
    assert isinstance(c_attn, LoRALinear) and set(c_attn.slices) == {"q", "k", "v"}  # q, k, v each their own


def test_peft_loads_gptlabs_adapter_with_gptlabs_logits(tmp_path, idx):
    """Separate q/k/v adapters of rank 4 are written as one exact c_attn adapter of rank 12."""
    from peft import PeftModel
    from transformers import GPT2LMHeadModel

    model = base_model()
    model.save_pretrained(tmp_path / "base")
    apply_lora(model, LoRASettings(rank=4, alpha=8, targets=TARGETS))
    randomize(model)
    save_adapter(model, tmp_path / "adapter")
    peft = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(tmp_path / "base"), tmp_path / "adapter").eval()
    with torch.no_grad():
        ours, theirs = model(idx)[0], peft(idx).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)  # measured: 2.0e-7
    assert (theirs - GPT2LMHeadModel.from_pretrained(tmp_path / "base")(idx).logits).abs().max() > 1e-2


@pytest.mark.parametrize(
    "alpha_pattern", [{}, {"^transformer.h.1": 9.0}, {"c_attn|fc": 9.0}], ids=["none", "caret", "or"]
)
def test_gptlab_loads_a_peft_adapter_with_pefts_logits(tmp_path, idx, alpha_pattern):
    """alpha_pattern's keys match as PEFT matches them, at the module name's end: `^transformer.h.1`
    matches no module there (gptlab took it as a prefix: layer 1's adapters scaled 9/4, not 16/4),
    and `c_attn|fc` matches c_attn, not c_fc (gptlab read it as `(^|.)c_attn` or `fc$`)."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    base = base_model()
    base.save_pretrained(tmp_path / "base")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
                        alpha_pattern=alpha_pattern)  # fmt: skip
    peft = get_peft_model(hf, config)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    peft.save_pretrained(tmp_path / "adapter")
    load_adapter(base, tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(base(idx)[0], peft.eval()(idx).logits, rtol=0, atol=1e-5)


def test_an_adapter_on_a_model_in_eval_mode_runs_without_dropout(tmp_path, idx):
    """load_model(spec, adapter=DIR) and load_model(a LoRA run's checkpoint) say "in eval mode",
    but each adapter layer came in training mode: its lora_dropout stayed on, and two forwards
    of the same tokens gave logits 0.19 apart (a run with lora_dropout=0.1)."""
    from gptlab.loading import load_model

    model = base_model()
    model.save_pretrained(tmp_path / "base")
    apply_lora(model, LoRASettings(rank=4, alpha=8, dropout=0.5, targets=TARGETS))
    randomize(model)
    save_adapter(model, tmp_path / "adapter")
    for loaded in (load_model(str(tmp_path / "base"), adapter=tmp_path / "adapter"), model):
        assert not any(m.training for m in loaded.modules())
        with torch.no_grad():
            torch.testing.assert_close(loaded(idx)[0], loaded(idx)[0], rtol=0, atol=0)
    assert all(m.training for m in apply_lora(base_model().train(), LoRASettings()).modules())


def test_merging_is_the_same_function(idx):
    model = apply_lora(base_model(), LoRASettings(rank=4, alpha=8, targets=TARGETS))
    randomize(model)
    with torch.no_grad():
        unmerged = model(idx)[0]
        merge(model)
        merged = model(idx)[0]
    assert not lora_layers(model)
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=1e-6)  # measured: 2.5e-7


def test_adapters_on_a_quantized_base(idx):
    """The int8 base's own kernels run under the adapter; merging folds into its dequantized weight."""
    model = quantize_model(base_model(), "int8")
    apply_lora(model, LoRASettings(rank=4, alpha=8, targets=("c_attn.q", "mlp.c_fc")))
    randomize(model)
    with torch.no_grad():
        unmerged = model(idx)[0]
        merged = merge(model)(idx)[0]
    assert (merged - unmerged).abs().max() < 5e-2  # int8 activations in the unmerged base; measured 9.9e-3


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown LoRA target"):
        LoRASettings(targets=("c_attn.x",))
    with pytest.raises(ValueError, match="overlap"):
        apply_lora(base_model(), LoRASettings(targets=("c_attn", "c_attn.q")))
    with pytest.raises(ValueError, match="tied token embedding"):
        apply_lora(base_model(), LoRASettings(targets=("lm_head",)))
    with pytest.raises(ValueError, match="not a PEFT adapter"):
        load_adapter(base_model(), tmp_path)
    adapted = apply_lora(base_model(), LoRASettings(targets=("c_attn.q",)))
    with pytest.raises(ValueError, match="LoRA adapters: fold them in first"):  # it said "a quantized model"
        adapted.save_pretrained(tmp_path / "hf")


def test_an_adapter_for_another_model_is_refused_before_the_model_changes(tmp_path, idx):
    """Another width, a module the model lacks, a missing B, a damaged file, a config that is not an
    object, an adapter over a LoRA layer: each a ValueError naming it (they were RuntimeError,
    AttributeError, KeyError, SafetensorError tracebacks), and the model is left as it was."""
    import json

    from safetensors.torch import load_file, save_file

    wide = GPT(GPTConfig(vocab_size=50257, block_size=32, n_layer=2, n_head=2, n_embd=64))
    apply_lora(wide, LoRASettings(rank=4, alpha=8, targets=TARGETS))
    save_adapter(wide, tmp_path / "wide")
    good = tmp_path / "good"
    model = base_model()
    apply_lora(model, LoRASettings(rank=4, alpha=8, targets=TARGETS))
    save_adapter(model, good)
    tensors = load_file(good / "adapter_model.safetensors")

    def variant(name, config=None, drop=None, rename=None, raw=None):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps(config) if config is not None else (good / "adapter_config.json").read_text())  # fmt: skip
        if raw is not None:
            (d / "adapter_model.safetensors").write_bytes(raw)
            return d
        t = {(k.replace(*rename) if rename else k): v for k, v in tensors.items() if not (drop and drop in k)}
        save_file(t, d / "adapter_model.safetensors")
        return d

    config = json.loads((good / "adapter_config.json").read_text())
    cases = {
        tmp_path / "wide": "maps 32 to 96: an adapter for another model",
        variant("layer5", rename=("h.1.", "h.5.")): "h.5.*this model does not have",
        variant("no-b", drop="h.0.mlp.c_fc.lora_B"): "needs both lora_A and lora_B",
        variant("cut", raw=(good / "adapter_model.safetensors").read_bytes()[:100]): "cannot read",
        variant("list", config=[config]): "not a JSON object",
        variant("no-alpha", config={k: v for k, v in config.items() if k != "lora_alpha"}): "lora_alpha",
    }
    for directory, message in cases.items():
        target = base_model()
        before = {k: v.clone() for k, v in target.state_dict().items()}
        with pytest.raises(ValueError, match=message):
            load_adapter(target, directory)
        assert not lora_layers(target) and all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    with pytest.raises(ValueError, match="already carries an adapter"):
        load_adapter(load_adapter(base_model(), good), good)


def test_a_lora_base_is_recorded_as_the_checkpoint_it_resolves_to(tmp_path, monkeypatch):
    """A run directory given relatively is recorded as its latest checkpoint's absolute path (the
    relative path failed from another directory, and the link moves on as the base run goes on)."""
    from gptlab.checkpoint import save_model
    from gptlab.train.checkpointing import lora_base

    save_model(base_model(), tmp_path / "run" / "ckpt-000002")
    (tmp_path / "run" / "ckpt-000002" / "train_state.json").write_text("{}")
    (tmp_path / "run" / "latest").symlink_to("ckpt-000002")
    monkeypatch.chdir(tmp_path)
    assert lora_base("run") == str((tmp_path / "run" / "ckpt-000002").resolve())
    assert lora_base("openai-community/gpt2") == "openai-community/gpt2"  # a Hub id as it is


def test_an_adapter_on_a_tied_head_loads_but_is_not_merged(tmp_path, idx):
    """PEFT's adapter on lm_head runs on a tied model, but merging it would change the token
    embedding too (export --merge wrote logits 22.5 away from the adapted model's): refused."""
    untied = GPT(GPTConfig(vocab_size=50257, block_size=32, n_layer=2, n_head=2, n_embd=32, tie_weights=False))
    apply_lora(untied, LoRASettings(rank=4, alpha=8, targets=("lm_head",)))
    randomize(untied)
    save_adapter(untied, tmp_path / "head")
    model = load_adapter(base_model(), tmp_path / "head")
    with pytest.raises(ValueError, match="tied to the token embedding"):
        merge(model)


def test_every_command_takes_adapter_and_export_merges_it(tmp_path, idx):
    """`--adapter DIR` on the commands that load a model (load_model(spec, adapter=DIR)), and
    `gptlab export --adapter A --merge` writes the merged model: transformers reads it and gives
    the adapted model's logits."""
    from transformers import GPT2LMHeadModel

    from gptlab.cli import main
    from gptlab.loading import load_model

    model = base_model()
    model.save_pretrained(tmp_path / "base")
    apply_lora(model, LoRASettings(rank=4, alpha=8, targets=TARGETS))
    randomize(model)
    save_adapter(model, tmp_path / "adapter")
    loaded = load_model(str(tmp_path / "base"), adapter=str(tmp_path / "adapter"))
    with torch.no_grad():
        adapted = model(idx)[0]
        torch.testing.assert_close(loaded(idx)[0], adapted, rtol=0, atol=1e-5)
    base, adapter = str(tmp_path / "base"), str(tmp_path / "adapter")
    assert main(["export", "--model", base, "--adapter", adapter, "--merge", "--out", str(tmp_path / "merged")]) in (
        0,
        None,
    )
    with torch.no_grad():
        merged = GPT2LMHeadModel.from_pretrained(tmp_path / "merged")(idx).logits
    torch.testing.assert_close(merged, adapted, rtol=0, atol=1e-5)
    assert main(["export", "--model", base, "--adapter", adapter, "--out", str(tmp_path / "x")]) == 2
    assert main(["next", "--model", base, "--adapter", adapter, "--prompt", "Hello"]) in (0, None)


@pytest.mark.parametrize("out", ["hf", "m.gguf", "m.bin"])
def test_exporting_a_lora_runs_checkpoint_without_merge_asks_for_merge(tmp_path, capsys, out):
    """A LoRA run's checkpoint carries its adapters: every format asks for --merge (gguf and llmc
    named "tensors GPT-2 does not" and asked for "a float model", which it is)."""
    import json

    from gptlab.checkpoint import save_model
    from gptlab.cli import main

    save_model(base_model(), tmp_path / "base")
    model = apply_lora(base_model(), LoRASettings(rank=4, alpha=8, targets=TARGETS))
    save_adapter(model, tmp_path / "run", base_model=str(tmp_path / "base"))
    meta = {"format": "gptlab", "lora_base": str(tmp_path / "base"), "config": model.config.to_dict()}
    (tmp_path / "run" / "gptlab.json").write_text(json.dumps(meta))  # as train/checkpointing.py writes it
    assert main(["export", "--model", str(tmp_path / "run"), "--out", str(tmp_path / out)]) == 2
    assert "LoRA run's checkpoint: pass --merge" in capsys.readouterr().err
    assert not (tmp_path / out).exists()
    assert main(["export", "--model", str(tmp_path / "run"), "--merge", "--out", str(tmp_path / out)]) == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int4"])
def test_lora_training_trains_adapters_only_and_resumes_exactly(tmp_path, precision, monkeypatch):
    """TrainConfig's lora_* settings, on an fp32, bf16, int8 or int4 base (QLoRA: its kernels run forward,
    gradients pass through its dequantized weight): the base stays as it was, checkpoints hold the
    adapters (not the base), load_model(checkpoint) is the trained model, and a run cut at step 6
    and resumed equals the same run straight, bit for bit."""
    from gptlab.checkpoint import save_model
    from gptlab.data import prepare
    from gptlab.loading import load_model
    from gptlab.run_files import latest_checkpoint
    from gptlab.train import TrainConfig, Trainer
    from test_data import corpus
    from test_train import TINY, losses

    (tmp_path / "corpus.txt").write_text(corpus(1500, 7))
    prepare(tmp_path / "corpus.txt", tmp_path / "tokens", tokenizer="byte", progress=False)
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=257, block_size=32, n_layer=2, n_head=2, n_embd=32))
    if precision in ("int8", "int4"):
        from gptlab.quantize import save_quantized

        base = quantize_model(base, precision, **({"group_size": 32} if precision == "int4" else {}))
        save_quantized(base, tmp_path / "base", tokenizer="byte")
    elif precision == "bf16":
        save_model(base.to(torch.bfloat16), tmp_path / "base", tokenizer="byte")
    else:
        save_model(base, tmp_path / "base", tokenizer="byte")
    lora = dict(
        lora_rank=4, lora_alpha=8.0, lora_targets="c_attn.q,c_attn.v,mlp.c_fc", init_from=str(tmp_path / "base")
    )

    def run_cfg(out, max_steps, resume=False):
        shape = {k: v for k, v in TINY.items() if k not in ("n_layer", "n_head", "n_embd")}
        return dict(data_dir=str(tmp_path / "tokens"), out_dir=str(out), **shape, **lora, max_steps=max_steps,
                    eval_interval=3, schedule="constant", resume=resume)  # fmt: skip

    def run(out, max_steps, resume=False):
        trainer = Trainer(TrainConfig(**run_cfg(out, max_steps, resume)))
        trainer.run()
        return trainer

    straight = run(tmp_path / "straight", 12)
    run(tmp_path / "cut", 6)
    resumed = run(tmp_path / "cut", 12, resume=True)
    assert losses(tmp_path / "straight") == losses(tmp_path / "cut")  # exact float equality
    steps = losses(tmp_path / "straight")
    assert steps[12] < steps[1] - 0.05  # it learns
    ckpt = latest_checkpoint(tmp_path / "cut")
    assert not (ckpt / "model.safetensors").exists() and (ckpt / "adapter_model.safetensors").exists()
    mode = lambda name: (ckpt / name).stat().st_mode & 0o777  # noqa: E731
    assert mode("lora.safetensors") == mode("adapter_model.safetensors")  # was 0600: safetensors' own temp file
    trained = {k: v for k, v in resumed.raw_model.state_dict().items() if ".lora_" in k}
    assert all(torch.equal(v, straight.raw_model.state_dict()[k]) for k, v in trained.items())
    frozen = {k.replace(".base.", "."): v for k, v in resumed.raw_model.state_dict().items() if ".lora_" not in k}
    assert all(torch.equal(frozen[k], v) for k, v in base.state_dict().items())  # the base did not move
    idx = torch.randint(0, 257, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(load_model(str(ckpt))(idx)[0], resumed.raw_model.eval()(idx)[0], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="set init_from"):
        TrainConfig(lora_rank=4)
    if precision == "fp32":  # gptlab quantize folds a LoRA run's adapters in (it wrote a directory that did not load)
        from gptlab.cli import main

        assert main(["quantize", "--model", str(tmp_path / "cut"), "--mode", "int8", "--out", str(tmp_path / "q")]) == 0
        expected = quantize_model(merge(load_model(str(ckpt))), "int8")
        with torch.no_grad():
            torch.testing.assert_close(load_model(str(tmp_path / "q"))(idx)[0], expected(idx)[0], rtol=0, atol=0)
        # the adapters name their base as the absolute checkpoint path (a relative one failed from
        # another directory), and resuming on another base is refused
        from gptlab.checkpoint import read_meta

        assert read_meta(ckpt)["lora_base"] == str((tmp_path / "base").resolve())
        meta = json.loads((ckpt / "gptlab.json").read_text())
        (ckpt / "gptlab.json").write_text(json.dumps({**meta, "lora_base": "base"}))  # as written before: relative
        monkeypatch.chdir(tmp_path)
        Trainer(TrainConfig(**run_cfg(tmp_path / "cut", 14, resume=True)))  # resumes (it was refused)
        save_model(base, tmp_path / "other", tokenizer="byte")
        with pytest.raises(ValueError, match="resume on the same base"):
            Trainer(TrainConfig(**{**run_cfg(tmp_path / "cut", 14, resume=True), "init_from": str(tmp_path / "other")}))
        # a full fine-tune from the LoRA run trains its merged weights (it wrote a checkpoint that did not load)
        shape = {k: v for k, v in TINY.items() if k not in ("n_layer", "n_head", "n_embd")}
        cfg = TrainConfig(data_dir=str(tmp_path / "tokens"), out_dir=str(tmp_path / "full"), **shape, max_steps=2,
                          eval_interval=2, schedule="constant", init_from=str(tmp_path / "cut"))  # fmt: skip
        full = Trainer(cfg)
        assert all(p.requires_grad for p in full.raw_model.parameters()) and not lora_layers(full.raw_model)
        full.run()
        load_model(str(tmp_path / "full"))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_layer_passes_its_input_the_dequantized_gradient(mode):
    layer = torch.nn.Linear(64, 48)
    q = quantize_model_layer(layer, mode)
    x = torch.randn(5, 64, requires_grad=True)
    q(x).pow(2).sum().backward()
    with torch.no_grad():
        y = q(x)
    torch.testing.assert_close(x.grad, (2 * y) @ q.dequantize(), rtol=1e-5, atol=1e-5)
    assert all(p.grad is None for p in q.parameters())


def quantize_model_layer(layer, mode):
    from gptlab.quantize import Int4Linear, Int8Linear

    q = Int8Linear.from_linear(layer) if mode == "int8" else Int4Linear.from_linear(layer, group_size=32)
    q.prepare()
    return q


@pytest.mark.parametrize("tied", [True, False])
def test_an_adapter_on_a_classifiers_lm_head_is_refused_by_name(tied):
    """A classifier has a score head, no lm_head: lora_targets=lm_head failed with an AttributeError
    traceback (untied body) or blamed the tied embedding (tied)."""
    from gptlab.classifier import from_language_model

    torch.manual_seed(0)
    lm = GPT(GPTConfig(vocab_size=300, block_size=16, n_layer=1, n_head=2, n_embd=16, tie_weights=tied))
    with pytest.raises(ValueError, match="a classifier has no lm_head"):
        apply_lora(from_language_model(lm, ["a", "b"]), LoRASettings(targets=("lm_head", "c_attn")))


def test_a_peft_adapter_with_a_bias_on_b_is_refused_not_loaded_without_it(tmp_path, idx):
    """PEFT's lora_bias=True adds lora_B.bias tensors: they were left out, and the model gave
    other logits than PEFT's (0.76 apart), saying nothing."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    base_model().save_pretrained(tmp_path / "base")
    config = LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_bias=True)
    get_peft_model(GPT2LMHeadModel.from_pretrained(tmp_path / "base"), config).save_pretrained(tmp_path / "a")
    model = base_model()
    with pytest.raises(ValueError, match="lora_bias"):
        load_adapter(model, tmp_path / "a")
    settings = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**settings, "lora_bias": False}))
    with pytest.raises(ValueError, match=r"lora_B.bias; gptlab reads lora_A and lora_B weights"):
        load_adapter(model, tmp_path / "a")  # the tensors are there whatever the config says
    assert not lora_layers(model)


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_a_peft_adapter_that_trained_the_biases_is_refused_by_its_setting(tmp_path, bias):
    """PEFT's bias="all"/"lora_only" saves the layers' trained biases: refused as holding
    "...c_attn.base_layer.bias, which this model does not have", which named no setting."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    base_model().save_pretrained(tmp_path / "base")
    config = LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, bias=bias)
    get_peft_model(GPT2LMHeadModel.from_pretrained(tmp_path / "base"), config).save_pretrained(tmp_path / "a")
    model = base_model()
    with pytest.raises(ValueError, match=f"adapters trained with bias='{bias}'"):
        load_adapter(model, tmp_path / "a")
    assert not lora_layers(model)


@pytest.mark.parametrize(
    ("key", "setting"),
    [
        ("use_dora", dict(use_dora=True)),
        ("use_rslora", dict(use_rslora=True)),
        (
            "target_parameters",
            dict(target_modules=[], target_parameters=["transformer.h.0.attn.c_proj.weight"], fan_in_fan_out=False),
        ),
        ("alora_invocation_tokens", dict(alora_invocation_tokens=[262], task_type="CAUSAL_LM")),
        ("use_bdlora", dict(use_bdlora={"target_modules_bd_a": ["c_attn"], "nblocks": 2})),
    ],
)
def test_a_peft_adapter_computing_other_than_plain_lora_is_refused_by_its_setting(tmp_path, key, setting):
    """PEFT variants gptlab does not run were loaded as plain LoRA: a target_parameters adapter
    on a square weight (attn.c_proj) and an aLoRA one (applied only from its invocation tokens on)
    gave other logits than PEFT's, 2.7 and 2.3 apart, saying nothing; BD-LoRA's was refused as
    "an adapter for another model". Each is refused naming its setting, the model unchanged."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    base_model().save_pretrained(tmp_path / "base")
    config = LoraConfig(**{"r": 2, "target_modules": ["c_attn"], "fan_in_fan_out": True, **setting})
    get_peft_model(GPT2LMHeadModel.from_pretrained(tmp_path / "base"), config).save_pretrained(tmp_path / "a")
    model = base_model()
    with pytest.raises(ValueError, match=rf"\({key}\) are not supported"):
        load_adapter(model, tmp_path / "a")
    assert not lora_layers(model)


@pytest.mark.parametrize("module", ["wte", "lm_head"])
def test_a_peft_adapter_replacing_one_of_a_tied_pair_is_refused(tmp_path, module):
    """PEFT's modules_to_save=["wte"] (or ["lm_head"]) on GPT-2 replaces that module alone and
    leaves the other with the base matrix; gptlab copied the saved matrix into the one tensor both
    share, changing the head (or the embedding) too: logits 3.0 (1.8) from PEFT's, with no word."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    base_model().save_pretrained(tmp_path / "base")
    config = LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, modules_to_save=[module])
    get_peft_model(GPT2LMHeadModel.from_pretrained(tmp_path / "base"), config).save_pretrained(tmp_path / "a")
    model = base_model()
    before = model.transformer.wte.weight.clone()
    with pytest.raises(ValueError, match="tied"):
        load_adapter(model, tmp_path / "a")
    assert not lora_layers(model) and torch.equal(model.transformer.wte.weight, before)


def test_a_peft_adapter_saving_whole_conv1d_layers_loads_them_transposed(tmp_path, idx):
    """PEFT's modules_to_save=["attn.c_proj", "c_fc"] saves those layers as transformers holds
    them, Conv1D (in, out): copied as they were into gptlab's (out, in) weights, the square
    c_proj ran transposed (logits 4.1 from PEFT's, silently) and c_fc was refused as "shape
    (32, 128), this model's (128, 32)"."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    base = base_model()
    base.save_pretrained(tmp_path / "base")
    config = LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, modules_to_save=["attn.c_proj", "c_fc"])
    peft = get_peft_model(GPT2LMHeadModel.from_pretrained(tmp_path / "base"), config)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.2)
    peft.save_pretrained(tmp_path / "a")
    load_adapter(base, tmp_path / "a")
    with torch.no_grad():
        torch.testing.assert_close(base(idx)[0], peft.eval()(idx).logits, rtol=0, atol=1e-5)


def test_lora_targets_naming_no_layer_are_refused(tmp_path):
    """lora_targets="" (or ",") made no adapter: the run failed at its first backward with a
    RuntimeError traceback ("element 0 of tensors does not require grad")."""
    from gptlab.train import TrainConfig

    for targets in ("", " , "):
        with pytest.raises(ValueError, match="lora_targets names no layer"):
            TrainConfig(lora_rank=4, lora_targets=targets, init_from=str(tmp_path))
