"""gptlab generate: continue a prompt, streaming to the terminal; -i for an interactive session.

The prompt comes from --prompt, --prompt-file, or standard input (when it is not a terminal);
with none, generation starts from <|endoftext|>. The sampling flags are the fields of
`gptlab.sampling.SamplingParams` with its defaults: temperature 1, every filter off
(--top-k 0, --top-p 1.0, --min-p 0.0, --repetition-penalty 1.0).
"""

import argparse
import sys

from gptlab.commands._model_args import add_model_arguments, load, model_from_args


def add_arguments(parser):
    add_model_arguments(parser, prompt=False)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", default=None, help="the text to continue")
    source.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    parser.add_argument(
        "-i", "--interactive", action="store_true", help="a session that keeps the conversation as context"
    )
    add_sampling_arguments(parser)
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step (slow start)")
    spec = parser.add_argument_group("speculative decoding (same tokens when greedy, same distribution when sampling)")
    spec.add_argument("--draft-model", default=None, help="a smaller model with the same tokenizer proposes tokens")
    spec.add_argument("--prompt-lookup", type=int, default=0, help="propose what followed the last n-gram, n <= N")
    spec.add_argument("--num-draft-tokens", type=int, default=None, help="most tokens proposed per step (default 4)")


def add_sampling_arguments(parser) -> None:
    """One flag per SamplingParams field (dashes for underscores), with its default."""
    from gptlab.sampling import SamplingParams as P

    parser.add_argument("--max-new-tokens", type=int, default=P.max_new_tokens, help=f"tokens to generate (default {P.max_new_tokens})")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=P.temperature, help=f"0 means greedy (default {P.temperature})")  # fmt: skip
    parser.add_argument("--top-k", type=int, default=P.top_k, help=f"keep the k most likely tokens (default {P.top_k}: off)")  # fmt: skip
    parser.add_argument("--top-p", type=float, default=P.top_p, help=f"nucleus sampling, e.g. 0.9 (default {P.top_p}: off)")  # fmt: skip
    parser.add_argument("--min-p", type=float, default=P.min_p, help=f"drop tokens below min_p x the top probability (default {P.min_p}: off)")  # fmt: skip
    parser.add_argument("--repetition-penalty", type=float, default=P.repetition_penalty, help=f"CTRL's penalty, e.g. 1.2 (default {P.repetition_penalty}: off)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=P.seed, help="make sampling reproducible")
    parser.add_argument("--num-samples", type=int, default=P.num_samples, help=f"continuations of the prompt (default {P.num_samples})")  # fmt: skip
    parser.add_argument("--stop", action="append", type=unescape, default=list(P.stop),
                        help=r'stop at this string (repeatable); \n, \t, \r and \\ are escapes: --stop "\n\n"')  # fmt: skip


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    r"""A flag's text with the escapes a shell leaves alone turned into their characters (as
    llama.cpp's flags do): --stop "\n\n" is two newlines."""
    import re

    return re.sub(r"\\([ntr\\])", lambda m: ESCAPES[m.group(1)], text)


def sampling_from_args(args):
    """The SamplingParams the sampling flags describe (ValueError naming a bad one)."""
    import dataclasses

    from gptlab.sampling import SamplingParams

    return SamplingParams(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingParams)})


def run(args):
    import dataclasses

    from gptlab.generation import compile_decode, model_device_dtype, stream_text
    from gptlab.speculative import check_speculation

    params = sampling_from_args(args)
    check_flags(args, params)
    one = dataclasses.replace(params, num_samples=1)  # each stream_text call makes one sample
    model, tokenizer = load(args)
    device, _ = model_device_dtype(model)
    # One generator for the whole session, so the samples (and interactive turns) differ.
    generator = params.generator(device, fresh=True)
    compiled_step = compile_decode(model) if args.compile else None
    draft_tokens = 4 if args.num_draft_tokens is None else args.num_draft_tokens  # 0 stays 0: refused below
    speculation = dict(prompt_lookup=args.prompt_lookup, num_draft_tokens=draft_tokens)
    if args.draft_model:
        speculation["draft_model"] = model_from_args(
            argparse.Namespace(**{**vars(args), "model": args.draft_model, "adapter": None})
        )
    check_speculation(model, speculation.get("draft_model"), args.prompt_lookup, speculation["num_draft_tokens"])

    def continue_text(prompt: str) -> str:
        pieces = []
        ids = tokenizer.encode(prompt, allowed_special="all")  # <|endoftext|> is the token, as in completions
        for piece in stream_text(model, tokenizer, ids, sampling=one, generator=generator,
                                 compiled_step=compiled_step, **speculation):  # fmt: skip
            print(piece, end="", flush=True)
            pieces.append(piece)
        print(flush=True)
        return "".join(pieces)

    if args.interactive:
        return interactive(continue_text)
    prompt = read_prompt(args)
    for i in range(params.num_samples):
        if params.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        print(prompt, end="", flush=True)
        continue_text(prompt)


def check_flags(args, params) -> None:
    """Refuse flags the run would ignore."""
    if args.interactive and (args.prompt is not None or args.prompt_file is not None):
        raise ValueError("-i reads the conversation from the keyboard, a line per turn: drop --prompt/--prompt-file")
    if args.interactive and params.num_samples > 1:
        raise ValueError("-i continues the conversation once per turn: drop --num-samples")
    if args.num_draft_tokens is not None and not (args.draft_model or args.prompt_lookup):
        raise ValueError("--num-draft-tokens sizes speculative decoding: add --draft-model or --prompt-lookup")
    if args.compile and (args.draft_model or args.prompt_lookup):  # before the prompt is printed, not after
        raise ValueError("--compile compiles plain decoding: it does not apply with --draft-model or --prompt-lookup")


def read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror or e}") from e
    if not sys.stdin.isatty():
        return sys.stdin.read()
    return ""


def interactive(continue_text) -> None:
    """Read a line, continue the whole conversation so far, repeat; /reset forgets, /quit or EOF ends."""
    print("interactive: each line you type is added to the conversation; /reset to forget it, /quit to end")
    history = ""
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return
        if line.strip() == "/quit":
            return
        if line.strip() == "/reset":
            history = ""
            continue
        history += line + "\n"
        history += continue_text(history) + "\n"
