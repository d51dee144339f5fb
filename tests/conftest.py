"""Shared fixtures: tiny configs and seeded models, so every test runs in seconds on a CPU."""

import hashlib
import json
from collections import Counter

import pytest
import tiktoken
import torch

from gptlab import kernels
from gptlab import tokenizer as tokmod
from gptlab.config import GPTConfig
from gptlab.model import GPT

VARIANTS = {
    "gpt2": {},
    "rope": dict(pos_embedding="rope"),
    "rmsnorm": dict(norm="rmsnorm"),
    "swiglu": dict(mlp="swiglu"),
    "nobias-untied": dict(bias=False, tie_weights=False),
    "llama": dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_weights=False),
}


def tiny_config(**overrides) -> GPTConfig:
    """A 2-layer, 32-wide model over a 97-token vocabulary."""
    base = dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=32)
    return GPTConfig(**{**base, **overrides})


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    a tiny model gains nothing from intra-op threads, and they thrash on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def model():
    return tiny_model()


@pytest.fixture(params=list(VARIANTS), ids=list(VARIANTS))
def variant_model(request):
    return tiny_model(**VARIANTS[request.param])


@pytest.fixture(params=kernels.runnable_variants())
def kernel_variant(request):
    """Each kernel variant this CPU can run (AVX-512, AVX2, portable C, ...), active for the test:
    `pytestmark = pytest.mark.usefixtures("kernel_variant")` runs a module's tests once per variant."""
    with kernels.use_variant(request.param):
        yield request.param


class CountingLibrary:
    """Stands in for the ctypes library and counts the calls of each kernel."""

    def __init__(self, lib):
        self.lib, self.calls = lib, Counter()

    def __getattr__(self, name):
        fn = getattr(self.lib, name)

        def call(*args):
            self.calls[name] += 1
            return fn(*args)

        return call


@pytest.fixture
def calls(monkeypatch):
    """A Counter of the calls of each kernel in the active variant's library (skips where none is built)."""
    ok, _, why = kernels.available()
    if not ok:
        pytest.skip(f"gptlab's kernels are not built here: {why}")
    counting = CountingLibrary(kernels._library().lib)
    monkeypatch.setattr(kernels._library(), "lib", counting)
    return counting.calls


@pytest.fixture(scope="session")
def tiktoken_gpt2(tmp_path_factory):
    """tiktoken's own gpt2 constructor, fed the same files through its download cache."""
    cache = tmp_path_factory.mktemp("tiktoken-cache")
    files = tokmod.gpt2_files()
    base = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
    for name, path in files.items():
        key = hashlib.sha1((base + name).encode()).hexdigest()
        (cache / key).write_bytes(open(path, "rb").read())
    mp = pytest.MonkeyPatch()
    mp.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    try:
        yield tiktoken.get_encoding("gpt2")
    finally:
        mp.undo()


@pytest.fixture
def lmeval_workdir(tmp_path, monkeypatch):
    """lm-eval (and the datasets library under it) offline, caching in tmp_path, in a working
    directory holding the data of tests/lmeval_tasks."""
    import lmeval_data

    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    lmeval_data.write_data(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


OWN_BPE_TEXT = [
    "Über die Brücke gehen wir heute.   Ça va? naïve café — 東京 🙂 tab\there\n\nnew  lines",
    "der die das " * 50,
    "hello world, it's 42 o'clock\r\n" * 20,
]


def own_bpe_dir(directory, *, layout: str = "pair", vocab_size: int = 400, special_tokens=("<|endoftext|>",)):
    """A Hugging Face directory holding a tiny byte-level BPE trained by `tokenizers` (not GPT-2's):
    vocab.json + merges.txt (layout "pair") or tokenizer.json alone ("json"); the special tokens
    take the first ids (<|endoftext|> is id 0)."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        OWN_BPE_TEXT * 5, vocab_size=vocab_size, min_frequency=2, special_tokens=list(special_tokens)
    )
    directory.mkdir(parents=True, exist_ok=True)
    if layout == "pair":
        bpe.save_model(str(directory))
    else:
        bpe.save(str(directory / "tokenizer.json"))
    return directory


def s_bpe_dir(directory, layout: str = "json"):
    """own_bpe_dir with RoBERTa-style <s> (bos, id 0), <pad>, </s> (eos, id 2), <unk> and no
    <|endoftext|>, named in tokenizer_config.json."""
    own_bpe_dir(directory, layout=layout, special_tokens=("<s>", "<pad>", "</s>", "<unk>"))
    tokens = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokens))
    return directory


def own_bpe_model_dir(directory):
    """A tiny transformers GPT2LMHeadModel with its own BPE (own_bpe_dir) in `directory`: (the
    model, transformers' GPT2TokenizerFast for it)."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    ref_tok = GPT2TokenizerFast.from_pretrained(own_bpe_dir(directory))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(ref_tok), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=ref_tok.eos_token_id, eos_token_id=ref_tok.eos_token_id)  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(directory)
    return model, ref_tok
