"""gptlab generate: continue a prompt, streaming to the terminal; -i for an interactive session.

The prompt comes from --prompt, --prompt-file, or standard input (when it is not a terminal);
with none, generation starts from <|endoftext|>. Defaults follow GPT-2's own samples: top-k 40
at temperature 1.
"""

import sys

from gptlab.commands._model_args import add_model_arguments, load


def add_arguments(parser):
    add_model_arguments(parser, prompt=False)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", default=None, help="the text to continue")
    source.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    parser.add_argument(
        "-i", "--interactive", action="store_true", help="a session that keeps the conversation as context"
    )
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 means greedy (default 1.0)")
    parser.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens (default 40; 0: off)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling, e.g. 0.9 (default off)")
    parser.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p x the top probability")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL's penalty, e.g. 1.2 (1: off)")
    parser.add_argument("--stop", action="append", default=[], help="stop at this string (repeatable)")
    parser.add_argument("--num-samples", type=int, default=1, help="continuations of the prompt")
    parser.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step (slow start)")


def run(args):
    import torch

    from gptlab.generation import compile_decode, stream_text, validate_sampling

    sampling = dict(
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
    )
    validate_sampling(**sampling, max_new_tokens=args.max_new_tokens, num_samples=args.num_samples)
    model, tokenizer = load(args)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    generator.manual_seed(args.seed) if args.seed is not None else generator.seed()
    sampling.update(generator=generator, stop=args.stop or None)
    if args.compile:
        sampling["compiled_step"] = compile_decode(model)

    def continue_text(prompt: str) -> str:
        pieces = []
        for piece in stream_text(model, tokenizer, prompt, args.max_new_tokens, **sampling):
            print(piece, end="", flush=True)
            pieces.append(piece)
        print(flush=True)
        return "".join(pieces)

    if args.interactive:
        return interactive(continue_text)
    prompt = read_prompt(args)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        print(prompt, end="", flush=True)
        continue_text(prompt)


def read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"cannot read --prompt-file: {e}") from e
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
