"""GGUF export (gptlab.formats.gguf), read back with the gguf package's own GGUFReader.

The tokenizer is checked against tiktoken (every token's bytes) and GPT-2's merges file; the
comparison with llama.cpp's convert_hf_to_gguf.py output, byte for byte, and llama-perplexity on
the exported file are in `gptlab bench formats` (they need the llama.cpp build).
"""

import logging

import gguf
import numpy as np
import pytest
import torch

from conftest import VARIANTS
from gptlab import GPT, GPTConfig, get_tokenizer
from gptlab.checkpoint import save_model
from gptlab.cli import main
from gptlab.formats.gguf import OUTTYPES, _gguf_tensors, export_gguf

T = gguf.GGMLQuantizationType


def gpt2_model(seed=0, **overrides) -> GPT:
    """A 2-layer, 32-wide GPT-2 over GPT-2's vocabulary (GGUF export writes GPT-2's tokenizer)."""
    torch.manual_seed(seed)
    config = dict(vocab_size=50257, block_size=64, n_layer=2, n_head=4, n_embd=32) | overrides
    return GPT(GPTConfig(**config)).eval()


@pytest.fixture(scope="module")
def model():
    return gpt2_model()


@pytest.fixture(scope="module")
def f32_file(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    export_gguf(model, path)
    return path


@pytest.fixture(scope="module")
def f32_reader(f32_file):
    return gguf.GGUFReader(f32_file)  # parsing the 50,257 tokens and 50,000 merges takes seconds: once


@pytest.fixture(scope="module")
def f32_kv(f32_reader):
    return fields(f32_reader)


def fields(reader: gguf.GGUFReader) -> dict:
    return {key: field.contents() for key, field in reader.fields.items()}


def gguf_tensor(reader, name) -> tuple[np.ndarray, T]:
    """A tensor as a float32 array in gptlab's (out, in) layout, and its GGUF type."""
    (t,) = [t for t in reader.tensors if t.name == name]
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions fastest first
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape), t.tensor_type


def test_metadata_is_llamacpps_gpt2(f32_kv, model):
    kv = f32_kv
    c = model.config
    assert kv["general.architecture"] == "gpt2" and kv["general.type"] == "model"
    assert kv["general.name"] == "tiny" and kv["general.size_label"] == "1.6M"
    assert (kv["gpt2.block_count"], kv["gpt2.context_length"], kv["gpt2.embedding_length"]) == (2, 64, 32)
    assert (kv["gpt2.feed_forward_length"], kv["gpt2.attention.head_count"]) == (128, 4)
    assert kv["gpt2.attention.layer_norm_epsilon"] == pytest.approx(c.layer_norm_eps)
    assert kv["general.file_type"] == gguf.LlamaFileType.ALL_F32 and kv["general.quantization_version"] == 2


def test_tokenizer_is_gpt2s(f32_kv):
    kv = f32_kv
    assert (kv["tokenizer.ggml.model"], kv["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"]) == (50256, 50256)
    assert kv["tokenizer.ggml.add_bos_token"] is False
    tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 50257
    assert types[50256] == gguf.TokenType.CONTROL and set(types[:50256]) == {gguf.TokenType.NORMAL}
    byte_of = {ch: b for b, ch in gpt2_bytes_to_unicode().items()}
    tokenizer = get_tokenizer("gpt2")
    for i in range(50256):  # each token is its bytes in GPT-2's byte-to-unicode alphabet
        assert bytes(byte_of[ch] for ch in tokens[i]) == tokenizer.decode_bytes([i])
    assert tokens[50256] == "<|endoftext|>"
    merges = kv["tokenizer.ggml.merges"]
    assert len(merges) == 50000 and merges[:3] == ["Ġ t", "Ġ a", "h e"] and merges[-1] == "Ġg azed"


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's encoder.py: bytes -> printable characters (the alphabet of vocab.json)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))  # fmt: skip
    out, n = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def test_f32_tensors_are_the_model(f32_reader, model):
    reader = f32_reader
    names = {t.name for t in reader.tensors}
    expected = {"token_embd.weight", "position_embd.weight", "output_norm.weight", "output_norm.bias"}
    for i in range(2):
        for part in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"):
            expected |= {f"blk.{i}.{part}.weight", f"blk.{i}.{part}.bias"}
    assert names == expected  # tied head: no output.weight, as the converter writes OpenAI's gpt2
    state = model.state_dict()
    pairs = {
        "token_embd.weight": "transformer.wte.weight",
        "position_embd.weight": "transformer.wpe.weight",
        "blk.1.attn_qkv.weight": "transformer.h.1.attn.c_attn.weight",
        "blk.1.attn_qkv.bias": "transformer.h.1.attn.c_attn.bias",
        "blk.0.attn_output.weight": "transformer.h.0.attn.c_proj.weight",
        "blk.0.ffn_up.weight": "transformer.h.0.mlp.c_fc.weight",
        "blk.1.ffn_down.weight": "transformer.h.1.mlp.c_proj.weight",
        "blk.1.ffn_norm.weight": "transformer.h.1.ln_2.weight",
        "blk.0.attn_norm.bias": "transformer.h.0.ln_1.bias",
        "output_norm.weight": "transformer.ln_f.weight",
    }
    for gguf_name, name in pairs.items():
        array, ttype = gguf_tensor(reader, gguf_name)
        assert ttype == T.F32
        assert np.array_equal(array, state[name].numpy()), gguf_name
    (qkv,) = [t for t in reader.tensors if t.name == "blk.0.attn_qkv.weight"]
    assert qkv.shape.tolist() == [32, 96]  # {n_embd, 3*n_embd}, as llama.cpp's gpt2 loader expects


def test_tensor_types_follow_the_converter():
    """1-D tensors and the position table stay F32; every other matrix takes the output type; rows
    that the type's blocks of 32 do not divide fall back to F16 (convert_hf_to_gguf.py's rules)."""
    for outtype, qtype in [("f32", T.F32), ("f16", T.F16), ("bf16", T.BF16), ("q8_0", T.Q8_0), ("q4_0", T.Q4_0)]:
        _, file_qtype = OUTTYPES[outtype]
        types = {name: ttype for name, (_, ttype) in _gguf_tensors(gpt2_model(n_embd=48, n_head=4), file_qtype).items()}
        assert types["position_embd.weight"] == types["blk.0.attn_qkv.bias"] == types["output_norm.weight"] == T.F32
        assert types["blk.0.ffn_down.weight"] == qtype  # rows of 192
        assert types["token_embd.weight"] == types["blk.0.attn_qkv.weight"] == (T.F16 if outtype.startswith("q") else qtype)  # rows of 48  # fmt: skip


def test_general_gpt2_shapes_are_described_exactly_in_q4_0(tmp_path):
    """Untied head -> output.weight; no biases -> zero biases; n_inner -> feed_forward_length; a
    nanoGPT-style 50304-token vocabulary -> [PAD] tokens of type UNUSED; Q4_0 as llama-quantize --pure."""
    model = gpt2_model(tie_weights=False, bias=False, n_inner=96, vocab_size=50304)
    export_gguf(model, tmp_path / "m.gguf", outtype="q4_0")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    kv = fields(reader)
    assert kv["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_0 and kv["gpt2.feed_forward_length"] == 96
    assert len(kv["tokenizer.ggml.tokens"]) == 50304 and kv["tokenizer.ggml.tokens"][50257] == "[PAD50257]"
    assert kv["tokenizer.ggml.token_type"][50300] == gguf.TokenType.UNUSED
    for gguf_name, weight in [("output.weight", model.lm_head.weight), ("token_embd.weight", model.transformer.wte.weight),
                              ("blk.0.ffn_down.weight", model.transformer.h[0].mlp.c_proj.weight)]:  # fmt: skip
        array, ttype = gguf_tensor(reader, gguf_name)
        blocks = weight.detach().view(-1, 32)
        step = blocks.abs().amax(dim=1, keepdim=True) / 8  # Q4_0: scale = the largest magnitude / -8
        assert ttype == T.Q4_0 and ((torch.from_numpy(array).view(-1, 32) - blocks).abs() <= 1.01 * step).all()
    up_bias, ttype = gguf_tensor(reader, "blk.0.ffn_up.bias")
    assert ttype == T.F32 and up_bias.shape == (96,) and not up_bias.any()
    assert not gguf_tensor(reader, "output_norm.bias")[0].any()
    assert gguf_tensor(reader, "position_embd.weight")[1] == T.F32


@pytest.mark.parametrize("variant", ["rope", "rmsnorm", "swiglu"])
def test_variants_llamacpp_gpt2_cannot_run_are_refused(tmp_path, variant):
    with pytest.raises(ValueError, match="gpt2 architecture cannot represent"):
        export_gguf(gpt2_model(**VARIANTS[variant]), tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())


def test_models_without_gpt2s_tokenizer_are_refused(tmp_path):
    with pytest.raises(ValueError, match="GPT-2's tokenizer"):
        export_gguf(gpt2_model(vocab_size=257), tmp_path / "m.gguf", tokenizer="byte")


def test_a_hugging_face_models_own_bpe_is_written(tmp_path):
    """A GPT-2 with its own tokenizer was refused for GPT-2's (or, with 50,257 tokens, written with
    GPT-2's): the file holds the model's tokens, merges and end-of-text id, as gguf's own vocabulary
    readers (those of llama.cpp's converters) read that directory."""
    from conftest import own_bpe_model_dir

    directory = tmp_path / "m"
    own_bpe_model_dir(directory)
    assert main(["export", "--model", str(directory), "--out", str(tmp_path / "m.gguf")]) == 0
    kv = fields(gguf.GGUFReader(tmp_path / "m.gguf"))
    special = gguf.SpecialVocab(directory, load_merges=True)
    expected = [t if isinstance(t, str) else t.decode() for t, _, _ in gguf.vocab.BpeVocab(directory).all_tokens()]
    assert kv["tokenizer.ggml.tokens"] == expected
    assert kv["tokenizer.ggml.merges"] == special.merges
    eos = special.special_token_ids["eos"]
    assert kv["tokenizer.ggml.eos_token_id"] == kv["tokenizer.ggml.bos_token_id"] == eos == 0
    assert kv["tokenizer.ggml.token_type"][0] == gguf.TokenType.CONTROL


def test_export_logs_no_temporary_file_name(tmp_path, model, caplog):
    """gguf's writer logged "Writing the following files: .../.m.gguf.XXXX.tmp" (and the file's
    endianness) at INFO, which the command line showed: the temporary file, not the output."""
    with caplog.at_level(logging.INFO):
        export_gguf(model, tmp_path / "m.gguf")
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("gguf")]
    assert logging.getLogger("gguf.gguf_writer").level == logging.NOTSET  # the writer's level is given back


def test_export_command_picks_gguf_from_the_suffix(tmp_path, model, f32_file, capsys):
    save_model(model, tmp_path / "native")
    out = tmp_path / "cli" / f32_file.name  # the same name: general.name is the file's stem
    assert main(["export", "--model", str(tmp_path / "native"), "--out", str(out)]) == 0
    assert "GGUF F32" in capsys.readouterr().out
    assert out.read_bytes() == f32_file.read_bytes()  # the command writes what export_gguf writes
    assert main(["export", "--model", str(out), "--out", str(tmp_path / "hf")]) == 2
    assert "does not read it" in capsys.readouterr().err
    upper = tmp_path / "cli" / "M.GGUF"  # the suffix in capitals: was an HF directory named M.GGUF
    assert main(["export", "--model", str(tmp_path / "native"), "--out", str(upper)]) == 0
    assert upper.is_file() and upper.read_bytes()[:4] == b"GGUF"
    assert main(["export", "--model", str(tmp_path / "native"), "--out", str(out), "--dtype", "float16"]) == 2
    assert "--outtype" in capsys.readouterr().err


def test_an_own_bpes_bos_is_written_as_gguf_reads_it(tmp_path):
    """A model whose own BPE names <s> (0) as bos and </s> (2) as eos was written with bos 2, where
    gguf's SpecialVocab (llama.cpp's converters) reads 0 from that directory."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from conftest import s_bpe_dir

    directory = s_bpe_dir(tmp_path / "m", layout="pair")
    config = GPT2Config(vocab_size=347, n_positions=64, n_embd=32, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=2)
    GPT2LMHeadModel(config).save_pretrained(directory)
    assert main(["export", "--model", str(directory), "--out", str(tmp_path / "m.gguf")]) == 0
    kv = fields(gguf.GGUFReader(tmp_path / "m.gguf"))
    special = gguf.SpecialVocab(directory, load_merges=False).special_token_ids
    ids = (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"])
    assert ids == (special["bos"], special["eos"]) == (0, 2)
