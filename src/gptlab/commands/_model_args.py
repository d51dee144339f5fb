"""What the model-reading commands (eval, trace, attention, lens, next) share: the --model,
--device, --dtype and --prompt options, and turning them into a model, tokenizer and token ids."""

DTYPES = ("float32", "bfloat16", "float16")


def add_model_arguments(parser, *, prompt: bool = True) -> None:
    parser.add_argument("--model", required=True, help="preset name (random weights), gptlab/HF directory or Hub id")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weights' dtype (default float32)")
    if prompt:
        parser.add_argument("--prompt", required=True, help="the text to run through the model")


def load(args):
    """(model, tokenizer) for args.model on the requested device and dtype, in eval mode."""
    import torch

    from gptlab.loading import load_model, tokenizer_name
    from gptlab.tokenizer import get_tokenizer

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(args.model, device=device, dtype=getattr(torch, args.dtype))
    tokenizer = get_tokenizer(tokenizer_name(args.model))
    if tokenizer.n_vocab > model.config.vocab_size:
        raise ValueError(
            f"{args.model}: the {tokenizer.name} tokenizer has {tokenizer.n_vocab} tokens, the model only {model.config.vocab_size}"
        )
    return model.eval(), tokenizer


def prompt_ids(args, model, tokenizer):
    """The prompt as a (1, T) tensor on the model's device."""
    import torch

    from gptlab.inspect import encode_prompt

    ids = encode_prompt(tokenizer, args.prompt, model.config.block_size)
    return torch.tensor([ids], device=next(model.parameters()).device)


def write_json(path, data) -> None:
    import json

    from gptlab.checkpoint import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def quoted(label: str) -> str:
    """A token label in single quotes, so leading spaces show (labels are already escaped)."""
    return f"'{label}'"
