import os
import stat

import pytest
import torch

from conftest import VARIANTS, tiny_model
from gptlab.atomic import atomic_write, atomic_write_text
from gptlab.checkpoint import load_native, read_meta, save_model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_native_round_trip(tmp_path, variant):
    model = tiny_model(**VARIANTS[variant])
    save_model(model, tmp_path / "m", tokenizer="byte")
    loaded = load_native(tmp_path / "m")
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


def test_an_unwritable_path_is_named_not_the_temporary_file(tmp_path):
    """A directory, a parent that is a file: OSErrors naming the path asked for (they named
    ".x.json.g32w51i2.tmp", or said only "File exists")."""
    (tmp_path / "file").write_text("")
    for path, message in [(tmp_path, "Is a directory"), (tmp_path / "file" / "x.json", "file is a file, not a directory")]:  # fmt: skip
        with pytest.raises(OSError, match=f"cannot write {path}: .*{message}"):
            atomic_write_text(path, "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_written_files_get_a_normal_mode(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "x.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.json").stat().st_mode) == 0o644


def test_a_write_through_a_symlink_or_to_a_pipe_reaches_what_it_names(tmp_path):
    """--json results.json, a link into a shared folder, replaced the link with a file and left its
    target as it was; --json /dev/stdout (a link to a pipe) replaced /dev/stdout itself where the
    user may write in /dev (root, in a container): no JSON came out, and the container's
    /dev/stdout was a plain file from then on."""
    import threading

    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "results.json").write_text("old")
    (tmp_path / "results.json").symlink_to(tmp_path / "shared" / "results.json")
    atomic_write_text(tmp_path / "results.json", "new")
    assert (tmp_path / "results.json").is_symlink() and (tmp_path / "shared" / "results.json").read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["results.json"]  # no temporary left
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "stdout").symlink_to(tmp_path / "pipe")
    received = []
    reader = threading.Thread(target=lambda: received.append((tmp_path / "pipe").read_text()), daemon=True)
    reader.start()
    atomic_write_text(tmp_path / "stdout", "{}")
    reader.join(timeout=10)
    assert received == ["{}"] and (tmp_path / "stdout").is_symlink()
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode)


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


def test_metadata_names_the_tokenizer_and_extras(tmp_path):
    save_model(tiny_model(), tmp_path, tokenizer="byte", extra={"train_step": 7})
    meta = read_meta(tmp_path)
    assert (meta["format"], meta["tokenizer"], meta["train_step"]) == ("gptlab", "byte", 7)
    assert meta["config"]["n_embd"] == 32


def test_a_quantized_directory_is_not_read_as_float(tmp_path):
    save_model(tiny_model(), tmp_path, extra={"quantization": {"mode": "int8"}})
    with pytest.raises(ValueError, match="int8 quantized model"):
        load_native(tmp_path)


def test_a_foreign_directory_is_a_clear_error(tmp_path):
    (tmp_path / "gptlab.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a gptlab model file"):
        load_native(tmp_path)


def test_damaged_metadata_and_a_missing_embedding_are_clear_errors(tmp_path):
    """gptlab.json that is a list, without its config, or with a quantization that is not an object,
    and tied weights without the embedding: ValueErrors naming them (were AttributeError/KeyError)."""
    import json

    from safetensors.torch import load_file, save_file

    save_model(tiny_model(), tmp_path)
    meta = json.loads((tmp_path / "gptlab.json").read_text())
    for bad, message in [([meta], "not a gptlab model file"), ({**meta, "config": None}, "no model config"),
                         ({**meta, "quantization": "int8"}, "quantization.*object")]:  # fmt: skip
        (tmp_path / "gptlab.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            load_native(tmp_path)
    (tmp_path / "gptlab.json").write_text(json.dumps(meta))
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "wte" not in k}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['lm_head.weight', 'transformer.wte.weight'\]"):
        load_native(tmp_path)
