"""llm.c checkpoints (gptlab.formats.llmc): round trips, and the bytes against llm.c's documented layout.

`read_llmc` below walks a file the way llm.c's train_gpt2.c does (gpt2_build_from_checkpoint,
fill_in_parameter_sizes), independently of gptlab's reader: the header's ints, then 16 tensors
back to back, each stacked over the layers.
"""

import numpy as np
import pytest
import torch

from conftest import VARIANTS, tiny_model
from gptlab import GPT, GPTConfig, load_model
from gptlab.checkpoint import save_model
from gptlab.cli import main
from gptlab.formats import llmc
from gptlab.loading import load_config

# llm.c's ParameterTensors in order, with their shapes as functions of (Vp, maxT, L, C)
LLMC_TENSORS = [
    ("wte", lambda Vp, T, L, C: (Vp, C)),
    ("wpe", lambda Vp, T, L, C: (T, C)),
    ("ln1w", lambda Vp, T, L, C: (L, C)),
    ("ln1b", lambda Vp, T, L, C: (L, C)),
    ("qkvw", lambda Vp, T, L, C: (L, 3 * C, C)),
    ("qkvb", lambda Vp, T, L, C: (L, 3 * C)),
    ("attprojw", lambda Vp, T, L, C: (L, C, C)),
    ("attprojb", lambda Vp, T, L, C: (L, C)),
    ("ln2w", lambda Vp, T, L, C: (L, C)),
    ("ln2b", lambda Vp, T, L, C: (L, C)),
    ("fcw", lambda Vp, T, L, C: (L, 4 * C, C)),
    ("fcb", lambda Vp, T, L, C: (L, 4 * C)),
    ("fcprojw", lambda Vp, T, L, C: (L, C, 4 * C)),
    ("fcprojb", lambda Vp, T, L, C: (L, C)),
    ("lnfw", lambda Vp, T, L, C: (C,)),
    ("lnfb", lambda Vp, T, L, C: (C,)),
]
# what each llm.c tensor is in a gptlab model ({i}: stacked over layers)
GPTLAB_NAMES = {
    "wte": "transformer.wte.weight", "wpe": "transformer.wpe.weight",
    "ln1w": "transformer.h.{i}.ln_1.weight", "ln1b": "transformer.h.{i}.ln_1.bias",
    "qkvw": "transformer.h.{i}.attn.c_attn.weight", "qkvb": "transformer.h.{i}.attn.c_attn.bias",
    "attprojw": "transformer.h.{i}.attn.c_proj.weight", "attprojb": "transformer.h.{i}.attn.c_proj.bias",
    "ln2w": "transformer.h.{i}.ln_2.weight", "ln2b": "transformer.h.{i}.ln_2.bias",
    "fcw": "transformer.h.{i}.mlp.c_fc.weight", "fcb": "transformer.h.{i}.mlp.c_fc.bias",
    "fcprojw": "transformer.h.{i}.mlp.c_proj.weight", "fcprojb": "transformer.h.{i}.mlp.c_proj.bias",
    "lnfw": "transformer.ln_f.weight", "lnfb": "transformer.ln_f.bias",
}  # fmt: skip


def read_llmc(path):
    """(header ints, {llm.c tensor name: float32 array}) read as llm.c reads the file."""
    raw = np.fromfile(path, dtype="<i4", count=256)
    version, maxT, V, L, NH, C, Vp = (int(x) for x in raw[1:8])
    dtype = {3: np.dtype("<f4"), 5: np.dtype("<u2")}[version]
    data = np.fromfile(path, dtype=dtype, offset=1024)
    if version == 5:  # bf16: the high half of a float32
        data = (data.astype(np.uint32) << 16).view(np.float32)
    tensors, offset = {}, 0
    for name, shape in LLMC_TENSORS:
        shape = shape(Vp, maxT, L, C)
        n = int(np.prod(shape))
        tensors[name] = data[offset : offset + n].reshape(shape)
        offset += n
    assert offset == data.size, "the file holds exactly the parameters, nothing after them"
    return raw, tensors


def logits(model, idx):
    with torch.no_grad():
        return model(idx)[0]


def ids(config, seed=0):
    return torch.randint(0, config.vocab_size, (2, config.block_size), generator=torch.Generator().manual_seed(seed))


def test_layout_matches_llmc(tmp_path):
    model = tiny_model(vocab_size=200)  # padded to 256
    llmc.save(model, tmp_path / "m.bin")
    header, tensors = read_llmc(tmp_path / "m.bin")
    c = model.config
    assert header[:8].tolist() == [20240326, 3, c.block_size, 200, c.n_layer, c.n_head, c.n_embd, 256]
    assert not header[8:].any()
    state = model.state_dict()
    for name, gptlab_name in GPTLAB_NAMES.items():
        if "{i}" in gptlab_name:
            expected = torch.stack([state[gptlab_name.format(i=i)] for i in range(c.n_layer)])
        else:
            expected = state[gptlab_name]
        got = torch.from_numpy(tensors[name].copy())
        if name == "wte":
            assert not got[200:].any(), "padded vocabulary rows are zero"
            got = got[:200]
        assert torch.equal(got, expected), name


def test_bf16_file_is_version_5(tmp_path):
    model = tiny_model()
    llmc.save(model, tmp_path / "m.bin", dtype=torch.bfloat16)
    header, tensors = read_llmc(tmp_path / "m.bin")
    assert header[1] == 5
    expected = model.transformer.h[1].mlp.c_fc.weight.detach().to(torch.bfloat16).float()
    assert torch.equal(torch.from_numpy(tensors["fcw"][1].copy()), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_round_trip_gives_the_same_logits(tmp_path, dtype):
    model = tiny_model(vocab_size=50257, n_embd=32)
    model = model.to(dtype)
    llmc.save(model, tmp_path / "gpt2_124M.bin", dtype=dtype)
    again = load_model(str(tmp_path / "gpt2_124M.bin"))  # dispatched on the magic number
    assert again.config.vocab_size == 50257 and again.transformer.wte.weight.shape == (50257, 32)
    assert next(again.parameters()).dtype == dtype
    assert again.lm_head.weight is again.transformer.wte.weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    idx = ids(model.config)
    assert torch.equal(logits(again, idx), logits(model, idx))


def test_model_without_biases_is_written_with_zero_biases(tmp_path):
    model = tiny_model(bias=False)
    llmc.save(model, tmp_path / "m.bin")
    _, tensors = read_llmc(tmp_path / "m.bin")
    assert not tensors["qkvb"].any() and not tensors["lnfb"].any()
    again = load_model(str(tmp_path / "m.bin"))
    idx = ids(model.config)
    assert (logits(again, idx) - logits(model, idx)).abs().max() <= 1e-6


@pytest.mark.parametrize("variant", ["rope", "rmsnorm", "swiglu", "nobias-untied"])
def test_variants_llmc_cannot_run_are_refused(tmp_path, variant):
    with pytest.raises(ValueError, match="llm.c cannot represent"):
        llmc.save(tiny_model(**VARIANTS[variant]), tmp_path / "m.bin")
    assert not (tmp_path / "m.bin").exists()


def test_shapes_llmc_fixes_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"MLP 96 wide \(llm.c's is 4\*n_embd = 128\)"):
        llmc.save(tiny_model(n_inner=96), tmp_path / "m.bin")
    with pytest.raises(ValueError, match="layer_norm_eps 1e-06"):
        llmc.save(tiny_model(layer_norm_eps=1e-6), tmp_path / "m.bin")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        llmc.save(tiny_model(), tmp_path / "m.bin", dtype=torch.float16)


def test_damaged_files_are_refused(tmp_path):
    llmc.save(tiny_model(), tmp_path / "m.bin")
    data = (tmp_path / "m.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(data[:-4])
    with pytest.raises(ValueError, match="bytes; an llm.c 2-layer model"):
        load_model(str(tmp_path / "short.bin"))
    header = np.frombuffer(data[:1024], dtype="<i4").copy()
    header[1] = 4
    (tmp_path / "v4.bin").write_bytes(header.tobytes() + data[1024:])
    with pytest.raises(ValueError, match="version 4"):
        llmc.load(tmp_path / "v4.bin")
    header[:2] = [20240326, 3]
    header[7] = 64  # Vp below V
    (tmp_path / "vp.bin").write_bytes(header.tobytes() + data[1024:])
    with pytest.raises(ValueError, match="inconsistent"):
        llmc.load(tmp_path / "vp.bin")


def test_a_bin_file_without_llmcs_magic_is_named_as_not_an_llmc_checkpoint(tmp_path):
    """llm.c's other .bin files (its tokenizer, magic 20240328; its debug state, 20240327), an empty
    or a damaged one were refused as "not a directory in the Hugging Face layout, and not a Hub id":
    the llm.c reader, whose header check names the magic, was only asked when the magic was right."""
    header = np.zeros(256, dtype="<i4")
    header[:2] = [20240328, 2]
    (tmp_path / "gpt2_tokenizer.bin").write_bytes(header.tobytes() + bytes(100))
    with pytest.raises(ValueError, match=r"not an llm.c checkpoint \(magic 20240328, expected 20240326\)"):
        load_model(str(tmp_path / "gpt2_tokenizer.bin"))
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="0 bytes, shorter than llm.c's 1024-byte header"):
        load_config(str(tmp_path / "empty.bin"))  # gptlab info's path


def test_a_header_asking_for_a_million_layers_is_refused_by_the_size_before_building(tmp_path, monkeypatch):
    header = np.zeros(256, dtype="<i4")
    header[:8] = [20240326, 3, 1024, 50257, 1_000_000, 12, 768, 50304]
    (tmp_path / "damaged.bin").write_bytes(header.tobytes() + bytes(1000))

    def build(config):  # building a million meta layers first took minutes: a hang on a 2 KB file
        raise AssertionError(f"a {config.n_layer}-layer model was built before the file's size was checked")

    monkeypatch.setattr(llmc, "GPT", build)
    with pytest.raises(ValueError, match="2,024 bytes; an llm.c 1000000-layer model"):
        llmc.load(tmp_path / "damaged.bin")


def test_padded_vocabulary_is_a_multiple_of_128():
    assert [llmc.padded_vocab(v) for v in (50257, 50304, 65, 128)] == [50304, 50304, 128, 128]


def test_export_command(tmp_path, capsys):
    model = GPT(GPTConfig(vocab_size=50257, block_size=16, n_layer=1, n_head=2, n_embd=32)).eval()
    save_model(model, tmp_path / "native")
    assert main(["export", "--model", str(tmp_path / "native"), "--out", str(tmp_path / "m.bin"), "--dtype", "bfloat16"]) == 0  # fmt: skip
    assert "version 5" in capsys.readouterr().out
    assert llmc.read_header(tmp_path / "m.bin")["Vp"] == 50304
    idx = ids(model.config)
    assert torch.equal(logits(load_model(str(tmp_path / "m.bin")), idx), logits(model.to(torch.bfloat16), idx))
    # without --dtype, as stored (the CLI conventions): that bf16 .bin gives a bf16 .bin (it gave fp32)
    assert main(["export", "--model", str(tmp_path / "m.bin"), "--out", str(tmp_path / "again.bin")]) == 0
    assert "version 5" in capsys.readouterr().out
    assert (tmp_path / "again.bin").read_bytes() == (tmp_path / "m.bin").read_bytes()
    assert main(["export", "--model", str(tmp_path / "native"), "--out", ""]) == 2  # wrote HF into the cwd
    assert "--out is empty" in capsys.readouterr().err


def test_export_needs_no_tokenizer_gptlab_reads(tmp_path, capsys):
    """llm.c's file holds no tokenizer: a Hugging Face model whose tokenizer gptlab cannot read (a
    WordPiece tokenizer.json) exports, where generate refuses it by name."""
    from tokenizers import Tokenizer, models

    from conftest import own_bpe_model_dir

    own_bpe_model_dir(tmp_path / "m")
    Tokenizer(models.WordPiece({"[UNK]": 0}, unk_token="[UNK]")).save(str(tmp_path / "m" / "tokenizer.json"))
    assert main(["export", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "m.bin")]) == 0
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "a", "--max-new-tokens", "1"]) == 2
    assert "a WordPiece model" in capsys.readouterr().err
