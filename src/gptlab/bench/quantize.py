"""gptlab bench quantize: what int8 and int4 cost in quality, and what they save in bytes.

- Logits: a random `gpt2`-shaped model written by transformers (GPT2LMHeadModel's own init),
  loaded through gptlab, quantized per scheme; cosine similarity of each position's logits to
  fp32 over a tiny-shakespeare excerpt, and how often the top token agrees.
- Size: model.safetensors of each scheme as a share of the fp32 file.
- Perplexity (with --model): the validation split (the last --val-fraction of --data) under each
  scheme, and its rise over fp32: whole windows at once (the prompt path), and the first
  --decode-tokens scored one token at a time through the KV cache (the decoding path, which runs
  gptlab's int8-activation kernels), through the quantized model's default bf16 cache and through
  an fp32 one.
Decode speed is `gptlab bench generate --modes fp32,int8,int8-wo,int4`.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from gptlab.bench.common import CORPUS, add_out_argument, positive, write_results

log = logging.getLogger(__name__)

SCHEMES = {
    "int8": dict(mode="int8", activations="int8"),
    "int8-wo": dict(mode="int8", activations="float"),
    "int4-g32": dict(mode="int4", group_size=32),
    "int4-g64": dict(mode="int4", group_size=64),
    "int4-g128": dict(mode="int4", group_size=128),
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gptlab bench quantize", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a trained model for the perplexity rows (any --model spec)")
    p.add_argument("--data", default=CORPUS, help="text file")
    p.add_argument("--val-fraction", type=float, default=0.1, help="the last part of --data scored")
    p.add_argument("--tokens", type=positive, default=256, help="excerpt length for the logits comparison")
    p.add_argument(
        "--decode-tokens", type=positive, default=2048, help="validation tokens scored one at a time (decoding)"
    )
    p.add_argument("--no-random", action="store_true", help="skip the random gpt2 logits/size rows")
    p.add_argument("--threads", type=positive, default=None)
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p)
    return p.parse_args(argv)


def file_size(model, directory: Path, quantized: bool) -> int:
    from gptlab.checkpoint import save_model
    from gptlab.quantize import save_quantized

    (save_quantized if quantized else save_model)(model, directory)
    return (directory / "model.safetensors").stat().st_size


def random_gpt2_rows(args, text: str) -> dict:
    """Cosine similarity of logits and file sizes on a transformers-initialised gpt2-shaped model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from gptlab.model import GPT
    from gptlab.quantize import quantize_model
    from gptlab.tokenizer import get_tokenizer

    torch.manual_seed(args.seed)
    idx = torch.tensor([get_tokenizer("gpt2").encode(text)[: args.tokens]])  # (1, T)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        GPT2LMHeadModel(GPT2Config()).save_pretrained(tmp)
        model = GPT.from_pretrained(tmp).eval()
        fp32_bytes = file_size(model, Path(tmp) / "fp32", quantized=False)
        rows["fp32"] = {"bytes": fp32_bytes}
        with torch.no_grad():
            ref = model(idx)[0][0]  # (T, V)
        for name, scheme in SCHEMES.items():
            qmodel = quantize_model(copy.deepcopy(model), **scheme)
            with torch.no_grad():
                logits = qmodel(idx)[0][0]  # (T, V)
            cos = F.cosine_similarity(logits, ref, dim=-1)  # (T,)
            size = file_size(qmodel, Path(tmp) / name, quantized=True)
            rows[name] = {
                "cosine_mean": round(cos.mean().item(), 5),
                "cosine_min": round(cos.min().item(), 5),
                "top1_agreement": round((logits.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4),
                "bytes": size,
                "size_vs_fp32": round(size / fp32_bytes, 4),
            }
            print(f"  random gpt2 {name:<9} {rows[name]}", flush=True)
    return rows


def decode_perplexity(model, ids: list[int], window: int) -> float:
    """Perplexity of ids scored one token at a time through the KV cache, in windows of `window`
    tokens each started afresh: the decoding path (a few rows per call, gptlab's kernels), which
    `perplexity` (whole windows at once) does not run."""
    from gptlab.generation import decode_step, new_cache, prefill

    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[start : start + window + 1])  # (W + 1,)
        cache = new_cache(model, 1, len(chunk) - 1)
        logits = prefill(model, chunk[None, :1], cache)  # (1, V)
        for t in range(1, len(chunk)):
            nll -= F.log_softmax(logits.float(), dim=-1)[0, chunk[t]].item()
            count += 1
            if t < len(chunk) - 1:
                logits = decode_step(model, chunk[t : t + 1], cache)
    return math.exp(nll / count)


def group_misfit(model, group_size: int) -> str:
    """Why int4 groups of `group_size` do not fit the model (the first linear layer whose input
    width they do not divide: n_embd, or the MLP's hidden width for mlp.c_proj), else ""."""
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and m.in_features % group_size:
            return f"group size {group_size} does not divide {name}'s {m.in_features} inputs"
    return ""


def perplexity_rows(args, text: str) -> dict:
    """Validation perplexity of --model under each scheme that fits its widths."""
    from gptlab.evaluate import perplexity
    from gptlab.kv_cache import cache_dtype
    from gptlab.loading import load_model, tokenizer_name
    from gptlab.quantize import quantize_model
    from gptlab.tokenizer import get_tokenizer

    model = load_model(args.model, dtype=torch.float32)  # the fp32 row, whatever the file holds (bf16)
    tok = get_tokenizer(tokenizer_name(args.model))
    ids = tok.encode(text)
    val = ids[int((1 - args.val_fraction) * len(ids)) :]
    stride = model.config.block_size
    base = perplexity(model, val, tok, stride=stride, batch_size=8)["perplexity"]
    decoded = val[: args.decode_tokens]
    base_decode = decode_perplexity(model, decoded, stride)
    rows = {"fp32": {"perplexity": round(base, 4), "decode_perplexity": round(base_decode, 4)},
            "val_tokens": len(val), "stride": stride, "decode_tokens": len(decoded)}  # fmt: skip
    print(f"  {args.model} fp32 perplexity {base:.4f} ({len(val)} tokens), "
          f"decoding {base_decode:.4f} ({len(decoded)} tokens)", flush=True)  # fmt: skip
    for name, scheme in SCHEMES.items():
        misfit = group_misfit(model, scheme.get("group_size", 1))
        if misfit:
            print(f"  {args.model} {name} skipped: {misfit}", flush=True)
            continue
        qmodel = quantize_model(copy.deepcopy(model), **scheme)
        ppl = perplexity(qmodel, val, tok, stride=stride, batch_size=8)["perplexity"]
        ppl_decode, kv_default = decode_perplexity(qmodel, decoded, stride), cache_dtype(qmodel)
        qmodel.kv_cache_dtype = torch.float32  # what the default cache's rounding costs, beside it
        ppl_decode_fp32 = decode_perplexity(qmodel, decoded, stride)
        rows[name] = {
            "perplexity": round(ppl, 4),
            "rise_pct": round(100 * (ppl / base - 1), 3),
            "decode_perplexity": round(ppl_decode, 4),
            "decode_rise_pct": round(100 * (ppl_decode / base_decode - 1), 3),
            "kv_cache": str(kv_default).removeprefix("torch."),
            "decode_perplexity_fp32_cache": round(ppl_decode_fp32, 4),
        }
        print(f"  {args.model} {name:<9} {rows[name]}", flush=True)
    return rows


def check_not_quantized(spec: str) -> None:
    """ValueError if the --model spec names a gptlab-quantized directory: the bench quantizes a float model."""
    from gptlab.checkpoint import META_FILE, read_meta
    from gptlab.loading import checkpoint_path

    path = checkpoint_path(spec)
    scheme = read_meta(path).get("quantization") if (path / META_FILE).is_file() else None
    if scheme:
        raise ValueError(f"--model {spec} is quantized ({scheme['mode']}): give the float model it was quantized from")


def main(argv=None) -> int:
    from gptlab.loading import load_config

    args = parse_args(argv or [])
    if args.model:  # before minutes of the random model's rows
        try:
            load_config(args.model)
        except ValueError as e:
            raise ValueError(f"--model {e}") from e
        check_not_quantized(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    text = Path(args.data).read_text()
    results = {"settings": vars(args)}
    if not args.no_random:
        results["random_gpt2"] = random_gpt2_rows(args, text)
    if args.model:
        results["perplexity"] = perplexity_rows(args, text)
    write_results("quantize", results, args.out)
    return 0
