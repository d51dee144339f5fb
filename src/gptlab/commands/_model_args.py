"""What the subcommands that load a model share (the CLI conventions in the README): the --model,
--device, --dtype (and --prompt) options, turning them into a model and tokenizer, --json, and
the checks of an --out (prepare's too)."""

DTYPES = ("float32", "bfloat16", "float16")


def add_model_arguments(parser, *, prompt: bool = True, dtype_default: str | None = "float32") -> None:
    """--model, --device (default auto), --dtype and, when `prompt`, a required --prompt.

    dtype_default None keeps the dtype the model is stored in (export, quantize).
    """
    parser.add_argument(
        "--model", required=True, help="gptlab/HF directory, nanoGPT ckpt.pt, llm.c .bin, Hub id or preset name"
    )
    parser.add_argument(
        "--device", default="auto", help="auto (default: cuda when available, else cpu), cpu, cuda:1, ..."
    )
    default = f"default {dtype_default}" if dtype_default else "default: as stored"
    parser.add_argument("--dtype", default=dtype_default, choices=DTYPES, help=f"weights' dtype ({default})")
    parser.add_argument(
        "--adapter", default=None, metavar="DIR", help="a LoRA adapter (PEFT's format) applied to the model"
    )
    if prompt:
        parser.add_argument("--prompt", required=True, help="the text to run through the model")


def resolve_device(name: str) -> str:
    """--device as a torch device string; `auto` is cuda when available, else cpu.

    A device this machine does not have is a user error (ValueError), not torch's traceback.
    """
    import torch

    from gptlab.loading import check_device

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    check_device(name, "--device")
    return name


def model_from_args(args):
    """The model args.model names, on args.device in args.dtype (None: as stored), in eval mode."""
    import torch

    from gptlab.loading import load_model

    dtype = getattr(torch, args.dtype) if args.dtype else None
    return load_model(
        args.model, device=resolve_device(args.device), dtype=dtype, adapter=getattr(args, "adapter", None)
    ).eval()


def check_out_is_not_read(args) -> None:
    """Refuse an --out that would replace weights: the --model (or --adapter) it reads however
    spelled (a run directory, a checkpoint's `latest` link, a relative path, ~), a directory around
    the checkpoint read or a file of it, or any training run or checkpoint (its optimizer state
    beside them)."""
    import os
    from pathlib import Path

    from gptlab.loading import checkpoint_path
    from gptlab.run_files import LATEST, STATE_FILE

    if not args.out:
        raise ValueError("--out is empty: name the file or directory to write")  # "" wrote into the current one
    out = Path(args.out).resolve()  # ~ expanded as the flag is read
    for flag in ("model", "adapter"):
        source = getattr(args, flag, None)
        source = source and os.path.expanduser(source)
        if not source or not Path(source).exists():
            continue
        read = checkpoint_path(source).resolve() if flag == "model" else Path(source).resolve()
        if out in (Path(source).resolve(), read) or out in read.parents:
            raise ValueError(f"--out {args.out} is (or holds) the --{flag} it reads: writing there would replace "
                             "those weights; choose another path")  # fmt: skip
        if read in out.parents and out.exists():  # a new file beside the model's (a .gguf in its folder) is fine
            raise ValueError(f"--out {args.out} is a file of the --{flag} it reads: writing there would replace "
                             "it; choose another path")  # fmt: skip
    if (out / STATE_FILE).is_file() or (out / LATEST).is_symlink():
        raise ValueError(f"--out {args.out} is a training checkpoint or run: writing there would replace its "
                         "weights; choose another path")  # fmt: skip
    if out.exists() and (out.parent / STATE_FILE).is_file():  # another run's model.safetensors, optimizer.pt
        raise ValueError(f"--out {args.out} is a file of a training checkpoint: writing there would replace it; "
                         "choose another path")  # fmt: skip


def check_out_path(out: str, *, directory: bool) -> None:
    """Refuse an --out that cannot be written, before the work whose result it holds (found as the
    result was written, `gptlab quantize` had loaded and quantized the model first): a directory's
    --out that is a file, a file's --out that is a directory, or one under a file."""
    from pathlib import Path

    path = Path(out)
    if not directory and path.is_dir():
        raise ValueError(f"--out {out}: {path} is a directory; name the file to write")
    above = (path, *path.parents) if directory else path.parents
    there = next(p for p in above if p.exists())  # the nearest path that is there: it must be a directory
    if not there.is_dir():
        raise ValueError(f"--out {out}: {there} is a file, not a directory")


# layout -> (its marker file: hf.CONFIG_FILE, checkpoint.META_FILE, named here without importing torch; what it holds)
DIRECTORY_LAYOUTS = {"hf": ("config.json", "a Hugging Face model"), "gptlab": ("gptlab.json", "a gptlab model")}


def check_out_layout(out: str, layout: str) -> None:
    """Refuse an --out directory holding a model of the other directory layout than `layout` ("hf"
    or "gptlab"): both keep their weights in model.safetensors, so writing there replaced the other
    model's weights and left its config.json or gptlab.json beside them, describing weights no
    longer there (gptlab reads gptlab.json first and then failed on the Hugging Face weights)."""
    from pathlib import Path

    (other,) = set(DIRECTORY_LAYOUTS) - {layout}
    marker, holds = DIRECTORY_LAYOUTS[other]
    if (Path(out) / marker).is_file():
        raise ValueError(f"--out {out} holds {holds} ({marker}): writing {DIRECTORY_LAYOUTS[layout][1]} there "
                         "would replace its weights (model.safetensors); choose another path")  # fmt: skip


def load(args, *, classifier: bool = False):
    """(model, tokenizer) for args.model on the requested device and dtype, in eval mode.

    A sequence classifier has no next-token head: only the commands that take one (`classifier`)
    load it; the others refuse it in one line rather than fail inside the model."""
    from gptlab.loading import tokenizer_name
    from gptlab.tokenizer import get_tokenizer

    model = model_from_args(args)
    if model.config.num_labels and not classifier:
        raise ValueError(f"{args.model} is a sequence classifier (labels {', '.join(model.label_names())}), not a "
                         "language model: it predicts no next token; use gptlab classify")  # fmt: skip
    tokenizer = get_tokenizer(tokenizer_name(args.model))
    if tokenizer.n_vocab > model.config.vocab_size:
        raise ValueError(
            f"{args.model}: the {tokenizer.name} tokenizer has {tokenizer.n_vocab} tokens, the model only {model.config.vocab_size}"
        )
    return model, tokenizer


def prompt_ids(args, model, tokenizer):
    """The prompt as a (1, T) tensor on the model's device."""
    import torch

    from gptlab.inspect import encode_prompt

    ids = encode_prompt(tokenizer, args.prompt, model.config.block_size)
    return torch.tensor([ids], device=next(model.parameters()).device)


def add_json_argument(parser, help: str = "also write the results as JSON") -> None:
    """--json FILE: the command's results as JSON, for programs (every command spells it so)."""
    parser.add_argument("--json", default=None, metavar="FILE", help=help)


def write_json(path, data) -> None:
    """Write `data` as indented JSON, atomically (an unwritable path raises OSError: exit code 2).

    A NaN or infinite number is written as null (as JavaScript's JSON.stringify writes it): JSON
    has no such numbers, and the bare NaN / Infinity that Python writes are refused by jq, by
    JSON.parse and by every strict reader (bits per byte of text with no bytes is NaN)."""
    import json

    from gptlab.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(_finite(data), indent=2, allow_nan=False) + "\n")


def _finite(value):
    """`value` with every NaN or infinite float inside it (dicts, lists) replaced by None."""
    import math

    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def quoted(label: str) -> str:
    """A token label in single quotes, so leading spaces show (labels are already escaped)."""
    return f"'{label}'"
