"""The `gptlab` command: a table of subcommands, each in gptlab/commands/<name>.py.

A subcommand's module (and so torch) is imported only when that subcommand runs, which keeps
`gptlab --help` fast. Each module defines `add_arguments(parser)` and `run(args) -> int | None`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import import_module

COMMANDS = {
    "info": "parameters per component, FLOPs per token, KV-cache and weight memory of a model",
    "eval": "perplexity / bits per byte, HellaSwag or LAMBADA; a table and a JSON file",
    "trace": "one forward pass step by step: tokens, shapes, residual stream, next tokens",
    "attention": "heatmap (PNG) of a layer's attention probabilities, one head or all",
    "lens": "logit lens: the top token read from each layer's residual stream",
    "next": "the most likely next tokens after a prompt, with probabilities",
    "prepare": "tokenize text files into train.bin / val.bin token files and a manifest",
    "train": "train or fine-tune (TOML config + --key=value; resumes exactly; DDP/FSDP under torchrun)",
    "generate": "continue a prompt with sampling controls, streaming; -i for an interactive session",
    "demo": "the main job: train a small model on tiny-shakespeare, then generate",
    "bench": "benchmarks against the peers (generate, train); results go to bench/results/",
    "export": "write a model as Hugging Face GPT2LMHeadModel, GGUF (llama.cpp) or an llm.c checkpoint",
    "quantize": "write an int8 or int4 copy of a model (every linear layer incl. the head)",
    "serve": "OpenAI-compatible completions API with dynamic batching, and a web explorer",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gptlab", description="GPT-2-style language models in PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, rest = build_parser().parse_known_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    module = import_module(f"gptlab.commands.{args.command.replace('-', '_')}")
    parser = argparse.ArgumentParser(prog=f"gptlab {args.command}", description=COMMANDS[args.command])
    module.add_arguments(parser)
    command_args = parser.parse_args(rest)
    try:
        return module.run(command_args) or 0
    except ValueError as e:  # user errors: one clear line, no traceback
        print(f"gptlab {args.command}: error: {e}", file=sys.stderr)
        return 2
