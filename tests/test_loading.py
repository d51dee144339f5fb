"""gptlab.loading: every kind of --model spec reaches the right reader and comes back ready."""

import json
import os

import pytest
import torch

from conftest import VARIANTS, tiny_model
from gptlab import loading, run_files
from gptlab.checkpoint import save_model
from gptlab.hf import save_pretrained
from gptlab.loading import is_preset, load_model, tokenizer_name
from gptlab.quantize import quantize_model, save_quantized


def logits(model, idx):
    with torch.no_grad():
        return model(idx)[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_native_directory(tmp_path, variant):
    model = tiny_model(**VARIANTS[variant])
    save_model(model, tmp_path / "m", tokenizer="byte")
    loaded = load_model(str(tmp_path / "m"))
    idx = torch.randint(0, 97, (2, 8))
    torch.testing.assert_close(logits(loaded, idx), logits(model, idx), rtol=0, atol=0)
    assert (loaded.lm_head.weight is loaded.transformer.wte.weight) == model.config.tie_weights
    assert not loaded.training


def test_a_home_relative_path_is_read_in_every_format(tmp_path, monkeypatch):
    """A path under ~ loaded only Hugging Face directories (a native one was "not in the Hugging Face cache")."""
    monkeypatch.setenv("HOME", str(tmp_path))
    model = tiny_model()
    save_model(model, tmp_path / "m", tokenizer="byte")
    idx = torch.randint(0, 97, (1, 5))
    torch.testing.assert_close(logits(load_model("~/m"), idx), logits(model, idx), rtol=0, atol=0)


@pytest.mark.parametrize("device, match", [("cuda:99", "device cuda:99: (no CUDA device|this machine has)"),
                                           ("warp9", "device warp9: not a device name")])  # fmt: skip
def test_a_device_this_machine_lacks_is_named_before_loading(tmp_path, device, match):
    """load_model's device is checked as --device is (a CPU-only torch asked for cuda raised from
    inside safetensors: "pin_memory=True requires a CUDA or other accelerator backend")."""
    save_model(tiny_model(), tmp_path / "m", tokenizer="byte")
    with pytest.raises(ValueError, match=match):
        load_model(str(tmp_path / "m"), device=device)


def test_native_directory_in_another_dtype(tmp_path):
    save_model(tiny_model(), tmp_path)
    loaded = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


def test_quantized_directory_keeps_its_scheme(tmp_path):
    model = quantize_model(tiny_model(), "int4", group_size=32)
    save_quantized(model, tmp_path, tokenizer="byte")
    loaded = load_model(str(tmp_path))
    assert loaded.quantization == model.quantization
    idx = torch.randint(0, 97, (1, 8))
    torch.testing.assert_close(logits(loaded, idx), logits(model, idx), rtol=0, atol=0)


def test_hugging_face_directory(tmp_path):
    model = tiny_model()
    save_pretrained(model, tmp_path, tokenizer="byte")
    idx = torch.randint(0, 97, (2, 8))
    torch.testing.assert_close(logits(load_model(str(tmp_path)), idx), logits(model, idx), rtol=0, atol=0)


def test_a_training_runs_directory_loads_the_checkpoint_latest_points_to(tmp_path):
    """`--model runs/x` means runs/x/latest, as `init_from` does: not the first checkpoint found."""
    old, new = tiny_model(seed=1), tiny_model(seed=2)
    for step, model in ((1, new), (2, old), (3, new)):  # `latest` ends on step 3

        def write(tmp, model=model, step=step):
            save_model(model, tmp, tokenizer="byte")
            (tmp / run_files.STATE_FILE).write_text(json.dumps({"step": step}))

        run_files.write_checkpoint(tmp_path / "run", step, write)
    idx = torch.randint(0, 97, (2, 8))
    torch.testing.assert_close(logits(load_model(str(tmp_path / "run")), idx), logits(new, idx), rtol=0, atol=0)
    assert tokenizer_name(str(tmp_path / "run")) == "byte"
    (tmp_path / "run" / "latest").unlink()
    os.symlink("ckpt-000002", tmp_path / "run" / "latest")  # the runs' own layout, pointed back
    torch.testing.assert_close(logits(load_model(str(tmp_path / "run")), idx), logits(old, idx), rtol=0, atol=0)


def test_directory_without_model_files(tmp_path):
    with pytest.raises(ValueError, match="neither gptlab.json"):
        load_model(str(tmp_path))


def test_openai_names_are_hub_ids_and_presets_need_the_prefix(monkeypatch):
    asked = []
    monkeypatch.setattr(loading, "load_pretrained", lambda spec, **kw: asked.append(spec))
    load_model("gpt2-medium")
    assert asked == ["gpt2-medium"]  # the released weights, not a random model
    model = load_model("preset:gpt2-tiny")
    assert model.config.n_layer == 2 and asked == ["gpt2-medium"]
    assert load_model("llama-tiny").config.pos_embedding == "rope"
    load_model("org/some-gpt2")
    assert asked == ["gpt2-medium", "org/some-gpt2"]


def test_a_preset_on_a_device_and_dtype():
    model = load_model("preset:gpt2-tiny", device="meta", dtype=torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}
    assert not model.training


def test_an_existing_path_wins_over_a_preset_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_preset("gpt2-tiny")
    save_model(tiny_model(), tmp_path / "gpt2-tiny")
    assert not is_preset("gpt2-tiny")
    assert load_model("gpt2-tiny").config.vocab_size == 97  # the directory, not the preset


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="no-such-model"):
        load_model("preset:no-such-model")


def test_tokenizer_name(tmp_path):
    save_model(tiny_model(), tmp_path / "byte", tokenizer="byte")
    save_model(tiny_model(), tmp_path / "bpe")
    assert tokenizer_name(str(tmp_path / "byte")) == "byte"
    assert tokenizer_name(str(tmp_path / "bpe")) == "gpt2"
    assert tokenizer_name("gpt2") == "gpt2"


def test_tokenizer_name_of_a_hugging_face_model_with_its_own_bpe(tmp_path, monkeypatch):
    """Every model not gptlab's was taken to read GPT-2's tokens, one that ships its own too:
    its directory (or Hub id) names it; GPT-2's files, or none, keep gpt2."""
    from conftest import own_bpe_model_dir

    own_bpe_model_dir(tmp_path / "own")
    save_pretrained(tiny_model(vocab_size=50257), tmp_path / "gpt2s")  # with GPT-2's files
    save_pretrained(tiny_model(), tmp_path / "none", tokenizer="byte")  # no tokenizer files
    assert tokenizer_name(str(tmp_path / "own")) == str((tmp_path / "own").resolve())
    assert tokenizer_name(str(tmp_path / "gpt2s")) == tokenizer_name(str(tmp_path / "none")) == "gpt2"
    monkeypatch.setattr("gptlab.hf.download", lambda repo_id, config_only=False: tmp_path / "own")
    assert tokenizer_name("someone/gpt2-german") == str((tmp_path / "own").resolve())


def test_a_hub_download_fetches_every_file_a_models_own_bpe_reads(tmp_path):
    """Each file the tokenizer reads from a directory (its eos in special_tokens_map.json, its added
    tokens) is one the Hub download asks for: a Hub model's own eos was otherwise never fetched."""
    import fnmatch

    from conftest import own_bpe_model_dir
    from gptlab import hf

    own_bpe_model_dir(tmp_path)
    names = {"tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"}  # fmt: skip
    names |= {p.name for p in tmp_path.iterdir() if "token" in p.name or p.suffix in (".txt",)}
    assert [n for n in sorted(names) if not any(fnmatch.fnmatch(n, p) for p in hf.HUB_PATTERNS)] == []


def test_the_public_name_is_this_function():
    import gptlab

    assert gptlab.load_model is load_model


def test_load_config_reads_no_weights(tmp_path, monkeypatch):
    """load_config (`gptlab info`) gives load_model's config from a gptlab, quantized, training-run
    or Hugging Face directory without touching a weight: every weight reader fails here."""
    from gptlab import hf

    small, other = tiny_model(), tiny_model(n_layer=3, n_embd=48)
    save_model(small, tmp_path / "native", tokenizer="byte")
    save_quantized(quantize_model(tiny_model(), "int8"), tmp_path / "int8", tokenizer="byte")
    save_pretrained(other, tmp_path / "hf", tokenizer="byte")

    def write(tmp):
        save_model(other, tmp, tokenizer="byte")
        (tmp / run_files.STATE_FILE).write_text(json.dumps({"step": 1}))

    run_files.write_checkpoint(tmp_path / "run", 1, write)
    specs = {"native": small, "int8": small, "hf": other, "run": other}
    want = {name: load_model(str(tmp_path / name)).config for name in specs}

    def no_weights(*args, **kwargs):
        raise AssertionError("a weight was read")

    for reader in ("load_native", "load_quantized", "load_pretrained"):
        monkeypatch.setattr(loading, reader, no_weights)
    monkeypatch.setattr(hf, "weight_files", no_weights)
    for name, model in specs.items():
        assert loading.load_config(str(tmp_path / name)) == want[name] == model.config, name
    assert loading.load_config("preset:gpt2-tiny") == loading.GPTConfig.from_name("gpt2-tiny")
    with pytest.raises(ValueError, match="neither gptlab.json"):
        loading.load_config(str(tmp_path))


def test_load_config_of_a_hub_id_fetches_config_json_alone(tmp_path, monkeypatch):
    import huggingface_hub

    save_pretrained(tiny_model(n_layer=3), tmp_path, tokenizer="byte")
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, allow_patterns: asked.append((repo, allow_patterns)) or str(tmp_path))  # fmt: skip
    assert loading.load_config("org/some-gpt2").n_layer == 3
    assert asked == [("org/some-gpt2", ["config.json"])]
