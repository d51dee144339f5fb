"""gptlab bench formats: the format readers and writers against the peers' own code and tools.

- nanoGPT (`--nanogpt DIR`, a checkout holding nanoGPT's model.py): models built by nanoGPT's
  own GPT class (bias=True/False), one AdamW step from its configure_optimizers, saved as train.py
  saves `ckpt.pt` (through torch.compile's wrapper for the compiled variant, so the `_orig_mod.`
  prefixes are real); gptlab's logits against nanoGPT's forward, at nanoGPT's initialisation and
  at trained-model scale (weights x8, where the exact GELU matters); and what the tanh GELU would
  have given.
- llama.cpp (the cached build of `gptlab bench generate --peer llama.cpp`; `--build` builds it):
  1. the same random GPT-2 saved as HF and converted by convert_hf_to_gguf.py (F32, F16, BF16,
     Q8_0; Q4_0 with `llama-quantize --pure`) against `gptlab export --format gguf`: every
     metadata field but general.name, every tensor's name, type, shape and bytes;
  2. the tokenizer fields against llama.cpp's own `models/ggml-vocab-gpt-2.gguf` (written by its
     converter from openai-community/gpt2); a model with an untied head, no biases, another MLP
     width and a padded vocabulary run by llama-perplexity against gptlab on the same tokens;
  3. `llama-perplexity` on the F32 export of `--ppl-model` against `gptlab eval --task perplexity`
     on the same text with the same context and stride (see perplexity_row), and gptlab on exactly
     the predictions llama-perplexity scores.
Results go to bench/results/formats-*.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import re
import sys
import tempfile
from pathlib import Path

import torch

from gptlab.bench.common import CORPUS, add_out_argument, positive, write_results

log = logging.getLogger(__name__)

NANOGPT_SHAPE = dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=512, dropout=0.0)
CONVERTER_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
VOCAB_FILE = "models/ggml-vocab-gpt-2.gguf"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gptlab bench formats", description=__doc__.splitlines()[0])
    p.add_argument("--nanogpt", default=None, help="a nanoGPT checkout (the directory holding its model.py)")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp comparisons")
    p.add_argument("--build", action="store_true", help="build llama.cpp when no build is cached (~8 min)")
    p.add_argument("--ppl-model", default=None, help="a trained model (any --model spec) for the perplexity row")
    p.add_argument("--data", default=CORPUS, help="text for the perplexity row")
    p.add_argument("--val-fraction", type=float, default=0.1, help="the last part of --data is scored")
    p.add_argument("--threads", type=positive, default=2)
    add_out_argument(p)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------- nanoGPT


def import_nanogpt(directory: str):
    path = Path(directory) / "model.py"
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    if spec is None or not path.is_file():
        raise ValueError(f"{directory}: no nanoGPT model.py there")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nanogpt_rows(directory: str) -> list[dict]:
    """gptlab's logits against nanoGPT's own model, per variant."""
    from gptlab.loading import load_model
    from gptlab.model import MLP

    nanogpt = import_nanogpt(directory)
    rows = []
    for bias in (True, False):
        for compiled in (False, True):
            for scale in (1.0, 8.0):
                torch.manual_seed(0)
                args = dict(NANOGPT_SHAPE, bias=bias)
                model = nanogpt.GPT(nanogpt.GPTConfig(**args))
                with torch.no_grad():
                    for p in model.parameters():
                        if p.dim() == 2:
                            p.mul_(scale)
                idx = torch.randint(0, args["vocab_size"], (4, args["block_size"]))
                with tempfile.TemporaryDirectory() as tmp:
                    save_like_train_py(model, args, Path(tmp), compiled=compiled, batch=idx)
                    ours = load_model(tmp)
                model.eval()
                with torch.no_grad():
                    theirs, _ = model(idx, targets=idx)  # with targets nanoGPT returns every position's logits
                    diff = (ours(idx)[0] - theirs).abs().max().item()
                    for block in ours.transformer.h:
                        block.mlp.__class__ = MLP  # GPT-2's tanh GELU, for comparison
                    tanh_diff = (ours(idx)[0] - theirs).abs().max().item()
                rows.append(dict(bias=bias, compiled=compiled, weight_scale=scale, max_abs_logits_diff=diff,
                                 tanh_gelu_max_abs_logits_diff=tanh_diff, logits_max_abs=theirs.abs().max().item()))  # fmt: skip
                print(f"nanoGPT bias={bias!s:<5} compiled={compiled!s:<5} weights x{scale:<3g} max |logits diff| {diff:.2e}"
                      f" (tanh GELU: {tanh_diff:.2e})")  # fmt: skip
    return rows


def save_like_train_py(model, model_args: dict, out_dir: Path, *, compiled: bool, batch) -> None:
    """ckpt.pt as nanoGPT's train.py writes it: raw_model.state_dict() (of torch.compile's wrapper
    when compiling), its AdamW after a step, model_args, iter_num, best_val_loss, config."""
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cpu")
    model.train()
    _, loss = model(batch, targets=batch)
    loss.backward()
    optimizer.step()
    raw_model = torch.compile(model) if compiled else model  # compiling happens at the first call: none here
    checkpoint = {
        "model": raw_model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "model_args": model_args,
        "iter_num": 1,
        "best_val_loss": loss.detach(),
        "config": dict(model_args, out_dir=str(out_dir), compile=compiled, dataset="shakespeare"),
    }
    torch.save(checkpoint, out_dir / "ckpt.pt")


# ------------------------------------------------------------------------------------ llama.cpp


def gguf_fields(path) -> dict:
    import gguf

    reader = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return {"kv": kv, "tensors": {t.name: t for t in reader.tensors}}


def compare_gguf(ours: Path, theirs: Path) -> dict:
    """Every metadata field but general.name, and every tensor's type, shape and bytes."""
    a, b = gguf_fields(ours), gguf_fields(theirs)
    keys = (set(a["kv"]) | set(b["kv"])) - {"general.name"}
    kv_diff = sorted(k for k in keys if a["kv"].get(k) != b["kv"].get(k))
    identical = 0
    for name in set(a["tensors"]) & set(b["tensors"]):
        x, y = a["tensors"][name], b["tensors"][name]
        same = x.tensor_type == y.tensor_type and list(x.shape) == list(y.shape)
        identical += same and x.data.tobytes() == y.data.tobytes()
    return {
        "metadata_fields": len(keys),
        "metadata_differences": kv_diff,
        "tensor_names_equal": set(a["tensors"]) == set(b["tensors"]),
        "tensors": len(b["tensors"]),
        "tensors_byte_identical": identical,
    }


def converter_rows(llama, tmp: Path) -> dict:
    from gptlab.bench.llamacpp import convert
    from gptlab.config import GPTConfig
    from gptlab.formats.gguf import export_gguf
    from gptlab.hf import save_pretrained
    from gptlab.model import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("gpt2-tiny")).eval()
    save_pretrained(model, tmp / "hf")
    converted = convert(llama, tmp / "hf", tmp / "converter", CONVERTER_TYPES)
    rows = {}
    for gguf_type, path in converted.items():
        ours = tmp / f"gptlab-{gguf_type}.gguf"
        export_gguf(model, ours, outtype=gguf_type.lower())
        rows[gguf_type] = compare_gguf(ours, path)
        r = rows[gguf_type]
        peer = "llama-quantize --pure" if gguf_type == "Q4_0" else "convert_hf_to_gguf.py"
        print(f"GGUF {gguf_type:<5} vs {peer}: metadata differences {r['metadata_differences'] or 'none'}"
              f" ({r['metadata_fields']} fields), tensors byte-identical {r['tensors_byte_identical']}/{r['tensors']}")  # fmt: skip
    return rows


def vocab_row(llama, ours: Path) -> dict:
    theirs = gguf_fields(llama.root / VOCAB_FILE)["kv"]
    kv = gguf_fields(ours)["kv"]
    keys = sorted(k for k in set(theirs) | set(kv) if k.startswith("tokenizer."))
    row = {
        "fields_equal": [k for k in keys if kv.get(k) == theirs.get(k)],
        "fields_different": [k for k in keys if k in kv and k in theirs and kv[k] != theirs[k]],
        "only_in_gptlab": [k for k in keys if k not in theirs],
        "only_in_llamacpp": [k for k in keys if k not in kv],
    }
    print(f"tokenizer vs llama.cpp's {VOCAB_FILE}: equal {row['fields_equal']}, different {row['fields_different']},"
          f" only gptlab {row['only_in_gptlab']} (llama.cpp's default for pre 'gpt-2' is the same: false)")  # fmt: skip
    return row


def perplexity_row(llama, spec: str, text: Path, tmp: Path, threads: int) -> dict:
    """llama-perplexity against gptlab eval (stride block_size/2) on the same text and context.

    For a block_size that is a multiple of 256, llama-perplexity runs strided (`--ppl-stride`), which
    scores the same windows as gptlab eval: windows of block_size tokens advancing by the stride,
    the last stride predictions of each scored. (It widens the context by stride/2 and pads it to a
    multiple of 256, hence `-c block_size - stride/2` and `-b` the same, so that one sequence of
    exactly block_size positions runs.) Other block sizes get its default method: chunks of
    block_size tokens, the second half of each scored, i.e. half the tokens with the same range of
    context lengths as gptlab eval's.
    """
    from gptlab.bench.llamacpp import run_step
    from gptlab.cli import main as gptlab_main
    from gptlab.formats.gguf import export_gguf
    from gptlab.loading import load_model
    from gptlab.tokenizer import get_tokenizer

    model = load_model(spec)
    n_ctx = model.config.block_size
    stride = n_ctx // 2
    gguf_path = tmp / "ppl-f32.gguf"
    export_gguf(model, gguf_path, outtype="f32")
    strided = n_ctx % 256 == 0
    c = n_ctx - stride // 2 if strided else n_ctx
    cmd = [llama.tool("llama-perplexity"), "-m", gguf_path, "-f", text, "-c", c, "-t", threads]
    cmd += ["-b", c, "--ppl-stride", stride] if strided else []
    output = run_step("llama-perplexity", cmd)
    log_text = output.stdout + output.stderr
    if strided:
        theirs = float(re.findall(r"\[\d+\]([0-9.]+),", log_text)[-1])
        chunks = int(re.search(r"perplexity_v2: computing over (\d+) chunks", log_text).group(1))
    else:
        theirs = float(re.search(r"Final estimate: PPL = ([0-9.]+)", log_text).group(1))
        chunks = int(re.search(r"calculating perplexity over (\d+) chunks", log_text).group(1))
    out_json = tmp / "eval.json"
    eval_cmd = ["eval", "--model", spec, "--task", "perplexity", "--data", str(text), "--stride", str(stride)]
    gptlab_main([*eval_cmd, "--json", str(out_json), "--no-progress"])
    ours = json.loads(out_json.read_text())
    tokens = get_tokenizer("gpt2").encode(text.read_text())
    same_set = llama_scored_perplexity(model, tokens, n_ctx, stride if strided else None)
    row = {
        "model": spec,
        "text": str(text),
        "tokens": len(tokens),
        "context": n_ctx,
        "llama_method": "strided (--ppl-stride)" if strided else "chunks, second half scored",
        "llama_perplexity": theirs,
        "llama_chunks": chunks,
        "gptlab_eval_perplexity": ours["perplexity"],
        "gptlab_eval_stride": ours["stride"],
        "relative_difference": ours["perplexity"] / theirs - 1,
        "gptlab_on_llamas_scored_tokens": same_set,
        "same_tokens_relative_difference": same_set / theirs - 1,
        "command_llama": " ".join(str(x) for x in cmd),
        "command_gptlab": "gptlab " + " ".join(eval_cmd),
    }
    print(f"perplexity, context {n_ctx}, {row['llama_method']}: llama-perplexity {theirs:.4f}, gptlab eval "
          f"{ours['perplexity']:.4f} ({100 * row['relative_difference']:+.3f}%); gptlab on llama-perplexity's "
          f"scored tokens {same_set:.4f} ({100 * row['same_tokens_relative_difference']:+.4f}%)")  # fmt: skip
    return row


@torch.no_grad()
def llama_scored_perplexity(model, tokens: list[int], n_ctx: int, stride: int | None) -> float:
    """gptlab's perplexity on exactly the predictions llama-perplexity scores (no BOS: the file
    says add_bos false). stride None: non-overlapping chunks, positions n_ctx/2 .. n_ctx-2 scored;
    else windows every `stride` tokens, positions n_ctx-stride-1 .. n_ctx-2 scored."""
    import torch.nn.functional as F

    if stride is None:
        starts, first = range(0, len(tokens) // n_ctx * n_ctx, n_ctx), n_ctx // 2
    else:
        starts, first = range(0, (len(tokens) - n_ctx + stride - 1) // stride * stride, stride), n_ctx - stride - 1
    windows = torch.stack([torch.tensor(tokens[s : s + n_ctx]) for s in starts])  # (N, n_ctx)
    nll, count = 0.0, 0
    for batch in windows.split(16):
        logits, _ = model(batch)  # (B, T, V)
        logp = F.log_softmax(logits[:, first : n_ctx - 1].float(), dim=-1)
        targets = batch[:, first + 1 :]
        nll -= logp.gather(-1, targets.unsqueeze(-1)).sum().item()
        count += targets.numel()
    return math.exp(nll / count)


def variant_row(llama, text: Path, tmp: Path, threads: int) -> dict:
    """A model more general than OpenAI's gpt2 (untied head, no biases, a 96-wide MLP, a 50,304-token
    vocabulary), random with weights x6 so that every tensor moves the logits: llama-perplexity on
    its F32 export against gptlab on the same predictions."""
    from gptlab.bench.llamacpp import run_step
    from gptlab.config import GPTConfig
    from gptlab.formats.gguf import export_gguf
    from gptlab.model import GPT
    from gptlab.tokenizer import get_tokenizer

    torch.manual_seed(0)
    shape = dict(vocab_size=50304, block_size=128, n_layer=2, n_head=4, n_embd=64)
    model = GPT(GPTConfig(**shape, tie_weights=False, bias=False, n_inner=96)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(6.0 if p.dim() == 2 else 1.0)
    export_gguf(model, tmp / "variant.gguf")
    cmd = [llama.tool("llama-perplexity"), "-m", tmp / "variant.gguf", "-f", text, "-c", 128, "-t", threads]
    output = run_step("llama-perplexity on the variant", cmd)
    theirs = float(re.search(r"Final estimate: PPL = ([0-9.]+)", output.stdout + output.stderr).group(1))
    ours = llama_scored_perplexity(model, get_tokenizer("gpt2").encode(text.read_text()), 128, None)
    print(f"untied head, no biases, n_inner 96, vocab 50304: llama-perplexity {theirs:.4f}, gptlab on the same "
          f"tokens {ours:.4f} ({100 * (ours / theirs - 1):+.4f}%)")  # fmt: skip
    return {"config": model.config.to_dict(), "llama_perplexity": theirs, "gptlab_same_tokens": ours,
            "relative_difference": ours / theirs - 1}  # fmt: skip


def llama_rows(args, tmp: Path) -> dict:
    from gptlab.bench.llamacpp import build_root, ensure_built, load_build

    llama = ensure_built() if args.build else load_build(build_root())
    if llama is None:
        print(f"no llama.cpp build cached at {build_root()}; --build builds it (~8 min)")
        return {"skipped": "no llama.cpp build"}
    out = {"llama_cpp": llama.info}
    out["converter"] = converter_rows(llama, tmp)
    out["tokenizer_vs_llamacpp_vocab"] = vocab_row(llama, tmp / "gptlab-F32.gguf")
    text = tmp / "val.txt"
    source = Path(args.data).read_text()
    text.write_text(source[int(len(source) * (1 - args.val_fraction)) :])
    out["variant"] = variant_row(llama, text, tmp, args.threads)
    if args.ppl_model:
        out["perplexity"] = perplexity_row(llama, args.ppl_model, text, tmp, args.threads)
    return out


def main(argv=None) -> int:
    args = parse_args(argv if argv is not None else sys.argv[1:])
    results = {}
    if args.nanogpt:
        results["nanogpt"] = nanogpt_rows(args.nanogpt)
    if not args.no_llama_cpp:
        with tempfile.TemporaryDirectory() as tmp:
            results.update(llama_rows(args, Path(tmp)))
    write_results("formats", results, args.out)
    return 0
