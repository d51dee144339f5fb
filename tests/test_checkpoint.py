import os
import stat

import pytest
import torch

from conftest import VARIANTS, tiny_model
from gptlab.checkpoint import atomic_write, atomic_write_text, load_model, load_native, save_model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_native_round_trip(tmp_path, variant):
    model = tiny_model(**VARIANTS[variant])
    save_model(model, tmp_path / "m", tokenizer="byte")
    loaded = load_model(str(tmp_path / "m"))
    idx = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx)[0], model(idx)[0], rtol=0, atol=0)
    assert (loaded.lm_head.weight is loaded.transformer.wte.weight) == model.config.tie_weights


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "out.txt"
    atomic_write_text(path, "old")

    def crash(tmp):
        open(tmp, "w").write("half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(path, crash)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]  # no temporary left behind


def test_written_files_get_a_normal_mode(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "x.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.json").stat().st_mode) == 0o644


def test_damaged_weights_are_a_clear_error(tmp_path):
    save_model(tiny_model(), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="cannot read weights"):
        load_native(tmp_path)


def test_shape_mismatch_names_the_tensor(tmp_path):
    save_model(tiny_model(n_embd=48), tmp_path / "a")
    save_model(tiny_model(), tmp_path / "b")
    (tmp_path / "a" / "gptlab.json").write_text((tmp_path / "b" / "gptlab.json").read_text())
    with pytest.raises(ValueError, match=r"tensor transformer\.\S+ has shape .* the model expects"):
        load_native(tmp_path / "a")


def test_directory_without_model_files(tmp_path):
    with pytest.raises(ValueError, match="neither gptlab.json"):
        load_model(str(tmp_path))


def test_openai_names_are_hub_ids_and_presets_need_the_prefix(monkeypatch):
    from gptlab.model import GPT

    asked = []
    monkeypatch.setattr(GPT, "from_pretrained", classmethod(lambda cls, spec, **kw: asked.append(spec)))
    load_model("gpt2-medium")
    assert asked == ["gpt2-medium"]  # the released weights, not a random model
    model = load_model("preset:gpt2-tiny")
    assert model.config.n_layer == 2 and asked == ["gpt2-medium"]
    assert load_model("llama-tiny").config.pos_embedding == "rope"
