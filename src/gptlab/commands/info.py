"""gptlab info: what a model is made of: parameters per component, FLOPs per token, KV-cache
size and weight memory."""

from pathlib import Path

from gptlab.commands._model_args import add_json_argument, write_json


def add_arguments(parser):
    parser.add_argument("model", nargs="?", default=None, help="preset name, gptlab/HF directory or Hub id")
    parser.add_argument("--model", dest="model_opt", default=None, help="same as the positional MODEL")
    parser.add_argument(
        "--context", type=int, default=None, help="context length for FLOPs and KV cache (default block_size)"
    )
    add_json_argument(parser, help="also write the figures as JSON")


def run(args):
    from gptlab.classifier import model_for
    from gptlab.config import PRESETS, GPTConfig
    from gptlab.inspect import model_info
    from gptlab.loading import load_config
    from gptlab.meta import meta_device

    if args.model and args.model_opt and args.model != args.model_opt:
        raise ValueError(f"two models: {args.model} and --model {args.model_opt}; give one")
    spec = args.model_opt or args.model or "gpt2"
    config = GPTConfig.from_name(spec) if spec in PRESETS and not Path(spec).exists() else load_config(spec)
    with meta_device():  # shapes are all the breakdown needs; a quantized model counts its logical weights
        model = model_for(config)  # a classifier has a score head where a language model's head is
    quantization = stored_quantization(spec)
    info = model_info(model, args.context, **{k: v for k, v in quantization.items() if k == "group_size"})
    if quantization:
        info["quantization"] = quantization
    print_info(spec, info)
    if args.json is not None:
        write_json(args.json, {"model": spec, **info})


def stored_quantization(spec: str) -> dict:
    """The quantization record of a quantized gptlab directory (mode, group_size, ...), else {}."""
    from gptlab.checkpoint import META_FILE, read_meta
    from gptlab.loading import checkpoint_path

    path = checkpoint_path(spec)
    record = (read_meta(path).get("quantization") or {}) if (path / META_FILE).is_file() else {}
    return {k: v for k, v in record.items() if v is not None}  # int8's group_size is null


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def _variant(c: dict) -> str:
    """The config's departures from GPT-2's architecture, comma-separated ("" for a GPT-2)."""
    switches = {
        f"RoPE positions (theta {c['rope_theta']:g})": c["pos_embedding"] == "rope",
        "RMSNorm": c["norm"] == "rmsnorm",
        "SwiGLU MLP": c["mlp"] == "swiglu",
        "exact (erf) GELU": c["mlp"] == "gelu_erf",
        "no biases": not c["bias"],
        "untied head": not c["tie_weights"] and not c.get("num_labels"),
    }
    return ", ".join(name for name, on in switches.items() if on)


def print_info(spec: str, info: dict) -> None:
    c = info["config"]
    print(
        f"model: {spec}  ({c['n_layer']} layers, {c['n_head']} heads, n_embd {c['n_embd']}, "
        f"context {c['block_size']}, vocab {c['vocab_size']})"
    )
    if variant := _variant(c):
        print(f"variant: {variant}")
    if q := info.get("quantization"):
        options = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in q.items() if k != "mode")
        print(
            f"quantized: {q['mode']}{f' ({options})' if options else ''}, its weights the {q['mode']} row of weight memory"
        )
    width = max(len(r["component"]) for r in info["components"]) + 2
    print("parameters")
    for r in info["components"]:
        print(f"  {r['component']:<{width}}{r['params']:>14,}  {100 * r['share']:5.1f}%  {r['note']}".rstrip())
    print(f"  {'total':<{width}}{info['total']:>14,}")
    print(f"  {'without wpe (nanoGPT count)':<{width}}{info['non_embedding']:>14,}")
    f = info["flops"]
    print(
        f"FLOPs per token at context {f['context']} (PaLM appendix B: 2N + 4*L*T*n_embd forward, "
        f"N = {f['matmul_params']:,} matmul weights incl. the head)"
    )
    print(f"  forward   {f['forward']:>16,}  ({f['forward'] / 1e9:.3f} GFLOP)")
    print(f"  training  {f['train']:>16,}  ({f['train'] / 1e9:.3f} GFLOP, 3x forward = 6N + 12*L*T*n_embd)")
    print("KV cache (keys + values, all layers)")
    for name, kv in info["kv_cache"].items():
        print(
            f"  {name:<5} {_bytes(kv['per_token']):>12} per token   {_bytes(kv['full_context']):>12} at {kv['context']} tokens"
        )
    print(
        "weight memory (int8/int4: every matrix incl. the head quantized, bf16 scales; the rest fp32, as quantize keeps it)"
    )
    for name, n in info["weights"].items():
        print(f"  {name:<5} {_bytes(n):>12}  ({n:,} bytes)")
