"""gptlab serve: an OpenAI-compatible completions and chat API and the web explorer for one model."""

import argparse
import socket
from pathlib import Path

from gptlab.commands._model_args import add_model_arguments, load, model_from_args


def add_arguments(parser):
    add_model_arguments(parser, prompt=False)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--name", default=None, help="model id clients ask for (default: the --model's last path part)")
    parser.add_argument("--max-batch", type=int, default=16, help="rows decoded together (default 16)")
    parser.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 429 (default 64)")
    parser.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes (default 1 MiB)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: OMP_NUM_THREADS, else every core)")  # fmt: skip
    parser.add_argument("--template", default=None, help="chat template for /v1/chat/completions: the JSON file given to `gptlab prepare --template` (default: the built-in one)")  # fmt: skip
    parser.add_argument("--draft-model", default=None, help="speculative decoding: a smaller model with the same tokenizer proposes tokens")  # fmt: skip
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def check_listen(host: str, port: int) -> None:
    """ValueError naming host:port when it cannot be bound (in use, or not this machine's address),
    before the model loads; uvicorn would find out after, with a log line and exit code 3."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except (OSError, OverflowError) as e:  # OverflowError: a port past 65535
            raise ValueError(
                f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e} (--host, --port)"
            ) from None


def run(args):
    import torch
    import uvicorn

    from gptlab.serve.app import create_app
    from gptlab.sft import Template

    for flag in ("max_batch", "max_queue", "max_body"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    check_listen(args.host, args.port)
    template = Template.load(args.template)  # a bad file fails before the model loads
    if args.threads is not None and args.threads < 1:
        raise ValueError("--threads must be at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(args)
    name = args.name or Path(args.model.rstrip("/")).name
    draft = (
        model_from_args(argparse.Namespace(**{**vars(args), "model": args.draft_model, "adapter": None}))
        if args.draft_model
        else None
    )
    app = create_app(
        model, tokenizer, name=name, max_batch=args.max_batch, max_queue=args.max_queue, max_body_bytes=args.max_body,
        draft_model=draft, template=template,
    )  # fmt: skip
    threads = torch.get_num_threads()
    print(f"gptlab serve: {name} on http://{args.host}:{args.port}/ (OpenAI API under /v1), {threads} decoding thread{'s' * (threads > 1)}", flush=True)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
