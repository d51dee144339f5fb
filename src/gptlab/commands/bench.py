"""gptlab bench NAME [options]: run a benchmark module gptlab.bench.NAME (its own --help)."""

import argparse
from importlib import import_module

BENCHMARKS = {
    "generate": "decode/prefill speed vs transformers' generate (fp32, bf16, quantized)",
    "train": "training tokens/s vs transformers' GPT2LMHeadModel",
    "gemm": "the training head's three fp32 products: gptlab's GEMM vs PyTorch's (MKL), GFLOP/s and ratios",
    "variants": "every kernel variant this CPU runs side by side (decode, prefill, head GEMM) and which one auto takes",
    "recipes": "the demo's validation loss against wall time, old recipe vs new (docs/demo-loss.png)",
    "nanogpt": "gptlab's trainer vs nanoGPT's train.py: same data, model, batch and wall time (tokens/s, val loss)",
    "quantize": "int8/int4 quality (logits cosine, perplexity rise) and checkpoint sizes",
    "speculative": "speculative decoding (prompt lookup, a draft model) vs plain decoding: speedup and acceptance",
    "harness": "lm-evaluation-harness: --model gptlab (fp32, int8) vs --model hf, requests/s and agreement",
    "hooks": "hook points vs TransformerLens's TransformerBridge: run_with_cache and the patching grid",
    "finetune": "the fine-tuning recipes: speaker classification 4 ways, masked vs unmasked instruction tuning",
    "formats": "nanoGPT/GGUF readers and writers against nanoGPT's model.py, llama.cpp's converter and llama-perplexity",
    "serve": "the OpenAI-compatible server (one client, streaming, many at once) vs generate() on the same weights",
    "summary": "the README's speed-table figures for this machine (or --all), from the latest results: runs nothing",
}


def add_arguments(parser):
    parser.add_argument(
        "benchmark", choices=list(BENCHMARKS), help="; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items())
    )
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options of that benchmark (see its --help)")


def run(args):
    module = import_module(f"gptlab.bench.{args.benchmark}")
    return module.main(args.options)
