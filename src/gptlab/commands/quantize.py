"""gptlab quantize: write an int8 or int4 copy of a model (every linear layer, the head included)."""

import os
from pathlib import Path

from gptlab.commands._model_args import (
    add_model_arguments,
    check_out_is_not_read,
    check_out_layout,
    check_out_path,
    model_from_args,
)


def add_arguments(parser):
    add_model_arguments(parser, prompt=False, dtype_default=None)  # a float model; --dtype: of the unquantized rest
    parser.add_argument("--mode", required=True, choices=["int8", "int4"], help="int8 per-channel or int4 group-wise")
    parser.add_argument(
        "--group-size", type=int, default=None, help="int4 only: inputs per scale/zero, 32, 64 (default), 128 or 256"
    )
    parser.add_argument(
        "--activations",
        default=None,
        choices=["float", "int8"],
        help="int8 only: multiply by bf16 activations (weight-only) or dynamically quantized int8 ones",
    )
    parser.add_argument(
        "--out",
        required=True,
        type=os.path.expanduser,  # --out=~/x: no shell expands that ~
        help="directory to write (model.safetensors + gptlab.json)",
    )


def run(args):
    from gptlab.loading import tokenizer_name
    from gptlab.lora import lora_layers, merge
    from gptlab.quantize import DEFAULT_ACTIVATIONS, DEFAULT_GROUP_SIZE, quantize_model, save_quantized, weight_bytes

    if args.activations is not None and args.mode != "int8":
        raise ValueError("--activations applies to --mode int8 only")
    if args.group_size is not None and args.mode != "int4":  # int8 has one scale per output row, no groups
        raise ValueError("--group-size applies to --mode int4 only")
    check_out_is_not_read(args)
    check_out_path(args.out, directory=True)
    check_out_layout(args.out, "gptlab")
    model = model_from_args(args)
    if lora_layers(model):  # a quantized file holds plain weights: --adapter's (or a LoRA run's) is folded in
        merge(model)
    if model.config.num_labels:
        raise ValueError(f"{args.model} is a classifier: quantize holds language models")
    if getattr(model, "quantization", None):
        raise ValueError(f"{args.model} is already quantized ({model.quantization['mode']}); quantize a float model")
    float_bytes = weight_bytes(model)
    float_dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")  # --dtype's (bfloat16: half fp32's bytes)
    group_size = DEFAULT_GROUP_SIZE if args.group_size is None else args.group_size
    quantize_model(model, args.mode, group_size, activations=args.activations or DEFAULT_ACTIVATIONS)
    save_quantized(model, args.out, tokenizer=tokenizer_name(args.model))
    size = (Path(args.out) / "model.safetensors").stat().st_size
    print(
        f"{args.mode}: wrote {args.out} ({size / 2**20:.1f} MiB, {size / float_bytes:.1%} of the {float_dtype} weights)"
    )
