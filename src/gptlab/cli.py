"""The `gptlab` command: a table of subcommands, each in gptlab/commands/<name>.py.

A subcommand's module (and so torch) is imported only when that subcommand runs, which keeps
`gptlab --help` fast. Each module defines `add_arguments(parser)` and `run(args) -> int | None`.

User errors end as one line on stderr and exit code 2, never a traceback: a bad flag (argparse),
ValueError (the library's user errors), OSError (a missing or unwritable file) and an optional
package that is not installed. Ctrl-C exits with 130. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from importlib import import_module

COMMANDS = {
    "info": "parameters per component, FLOPs per token, KV-cache and weight memory of a model",
    "eval": "perplexity / bits per byte, HellaSwag, LAMBADA or lm-eval tasks (--harness); a table and a JSON file",
    "trace": "one forward pass step by step: tokens, shapes, residual stream, next tokens",
    "attention": "heatmap (PNG) of a layer's attention probabilities, one head or all",
    "lens": "logit lens: the top token read from each layer's residual stream",
    "next": "the most likely next tokens after a prompt, with probabilities",
    "patch": "activation and attribution patching: clean vs corrupted prompt, a layers x positions/heads grid",
    "classify": "label probabilities of a text under a sequence-classification model",
    "prepare": "tokenize text (or instruction / classification records) into token files and a manifest",
    "train": "train or fine-tune (TOML config + --set key=value; resumes exactly; DDP/FSDP under torchrun)",
    "generate": "continue a prompt with sampling controls, streaming; -i for an interactive session",
    "demo": "the main job: train a small model on tiny-shakespeare, then generate",
    "bench": "benchmarks against the peers (generate, train); results go to bench/results/",
    "export": "write a model as Hugging Face GPT2LMHeadModel, GGUF (llama.cpp) or an llm.c checkpoint",
    "quantize": "write an int8 or int4 copy of a model (every linear layer incl. the head)",
    "serve": "OpenAI-compatible completions and chat API with dynamic batching, and a web explorer",
}
INTERRUPTED = 130  # 128 + SIGINT, as shells report it
BROKEN_PIPE = 141  # 128 + SIGPIPE: what shells report for a writer whose reader left


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (exit code 2, as argparse's own)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_global_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags every subcommand accepts, before or after its name."""
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")


def build_parser() -> argparse.ArgumentParser:
    from gptlab import __version__

    parser = ArgumentParser(prog="gptlab", description="GPT-2-style language models in PyTorch.")
    parser.add_argument("--version", action="version", version=f"gptlab {__version__}")
    add_global_arguments(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def command_parser(name: str, module) -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=f"gptlab {name}", description=COMMANDS[name])
    module.add_arguments(parser)
    add_global_arguments(parser.add_argument_group("global options"))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, rest = build_parser().parse_known_args(argv)
    name = args.command
    try:
        module = import_module(f"gptlab.commands.{name.replace('-', '_')}")
        command_args = command_parser(name, module).parse_args(rest)
        verbose = args.verbose or command_args.verbose
        logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s")
        return module.run(command_args) or 0
    except KeyboardInterrupt:
        print(f"gptlab {name}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:  # `gptlab info | head`: the reader has all it wants; no "error: Broken pipe"
        _stdout_to_devnull()
        return BROKEN_PIPE
    except ImportError as e:
        if (message := missing_package(e)) is None:
            raise  # gptlab's own import failed: a bug, keep the traceback
        return fail(name, message)
    except OSError as e:
        return fail(name, os_error_message(e))
    except ValueError as e:
        return fail(name, str(e))


def _stdout_to_devnull() -> None:
    """Point standard output at /dev/null, so that Python's flush at exit does not fail on the
    closed pipe again (Python's documented recipe for BrokenPipeError)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor behind sys.stdout (captured, replaced)
        pass


def os_error_message(e: OSError) -> str:
    """An OSError as its reason, after the file it names if any, without str()'s "[Errno 20]"."""
    if not e.strerror:
        return str(e)
    if e.filename is None:
        return e.strerror
    files = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else str(e.filename)
    return f"{files}: {e.strerror}"


def fail(command: str, message: str) -> int:
    """Print a user error as one line and return the exit code for it."""
    print(f"gptlab {command}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def missing_package(e: ImportError) -> str | None:
    """The message for an optional package that is not installed, naming the pip extra that has
    it; None when the failed import is gptlab's own."""
    package = (e.name or "").split(".")[0]
    if not package or package == "gptlab":
        return None
    extra = optional_extras().get(package.lower().replace("_", "-"))
    fix = f"pip install 'gptlab[{extra}]'" if extra else f"pip install {package}"
    return f"this needs the package {package!r}, which is not installed: {fix}"


def optional_extras() -> dict[str, str]:
    """Package name -> the gptlab extra that installs it, from the installed package's metadata."""
    from importlib import metadata

    try:
        requirements = metadata.requires("gptlab") or []
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return {}
    extras = {}
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement)
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
        if name and extra:
            extras[name.group().lower().replace("_", "-")] = extra.group(1)
    return extras
