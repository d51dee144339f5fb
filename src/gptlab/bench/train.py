"""gptlab bench train: training tokens/s of gptlab's GPT against transformers' GPT2LMHeadModel.

Both train the same config (4 layers, 128 wide, 4 heads, GPT-2's 50,257-token vocabulary, no
dropout) on the same random batches (B16 x T128 by default) with the same optimizer (AdamW,
fused where available, gradient clipping at 1.0) under the same dtype (fp32, or bf16 autocast).
Rounds alternate between the two so that a machine whose load changes treats both alike; the
median round counts. On CUDA it also prints MFU: model FLOPs per token as in the PaLM paper's
appendix B (6N + 12 L T C) against the device's peak.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

from gptlab.bench.common import add_out_argument, positive, write_results

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "A10": 125.0, "4090": 165.0}  # bf16 dense


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gptlab bench train", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch-size", type=positive, default=16)
    p.add_argument("--block-size", type=positive, default=128)
    p.add_argument("--n-layer", type=positive, default=4)
    p.add_argument("--n-embd", type=positive, default=128)
    p.add_argument("--n-head", type=positive, default=4)
    p.add_argument(
        "--vocab-multiple", type=positive, default=1, help="pad gptlab's vocabulary (a lever; 1 = same as HF)"
    )
    p.add_argument("--rounds", type=positive, default=5, help="timed rounds per model and dtype")
    p.add_argument("--steps", type=positive, default=3, help="optimizer steps per round")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    add_out_argument(p)
    p.add_argument("--profile", action="store_true",
                   help="also profile two gptlab steps per dtype (torch.profiler) and print the top ops")  # fmt: skip
    return p.parse_args(argv)


def build_pair(args, device):
    """(gptlab GPT, transformers GPT2LMHeadModel) with the same shapes, fp32 weights."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from gptlab.config import GPTConfig
    from gptlab.model import GPT

    vocab = 50257
    padded = -(-vocab // args.vocab_multiple) * args.vocab_multiple
    shape = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    torch.manual_seed(0)
    ours = GPT(GPTConfig(vocab_size=padded, block_size=args.block_size, **shape)).to(device)
    hf_config = GPT2Config(
        vocab_size=vocab, n_positions=args.block_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **shape
    )
    hf = GPT2LMHeadModel(hf_config).to(device)
    return ours, hf


def make_step(model, kind: str, dtype, device):
    """A closure doing one training step on a batch (x, y); returns the loss."""
    import torch

    try:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    except (RuntimeError, ValueError):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()

    def step(x, y):
        with autocast:
            if kind == "gptlab":
                _, loss = model(x, y, return_logits=False)
            else:  # transformers shifts labels itself: labels = the input ids
                loss = model(input_ids=x, labels=x).loss
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def profile_steps(step, batches, dtype_name: str, rows: int = 12) -> str:
    """torch.profiler's table of the ops that took the most self CPU time over the batches' steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x, y in batches:
            step(x, y)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=36)
    return f"--- gptlab, {dtype_name}: ops by self CPU time over {len(batches)} steps\n{table}"


def model_flops_per_token(model, n_layer, block_size, n_embd) -> float:
    """6N + 12 L T C (PaLM, appendix B), N without the position table."""
    return 6 * model.num_params(non_embedding=True) + 12 * n_layer * block_size * n_embd


def run_dtype(args, dtype_name: str, device) -> dict:
    import torch

    dtype = getattr(torch, dtype_name)
    ours, hf = build_pair(args, device)
    steps = {
        "gptlab": make_step(ours, "gptlab", dtype, device),
        "transformers": make_step(hf, "transformers", dtype, device),
    }
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 50257, (args.batch_size, args.block_size + 1), generator=g) for _ in range(args.steps)]
    batches = [(b[:, :-1].to(device), b[:, 1:].to(device)) for b in batches]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in steps.values():  # warm-up: allocator, kernels, optimizer state
        step(*batches[0])
    times: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}  # process CPU seconds: steadier on a busy machine
    for _ in range(args.rounds):
        for name, step in steps.items():
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            for x, y in batches:
                step(x, y)
            sync()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    if args.profile:
        print(profile_steps(steps["gptlab"], batches, dtype_name))
    tokens = args.steps * args.batch_size * args.block_size
    tok_s = {name: tokens / statistics.median(t) for name, t in times.items()}
    tok_per_cpu_s = {name: tokens / statistics.median(t) for name, t in cpu.items()}
    result = {"dtype": dtype_name, "tok_per_s": tok_s, "ratio": tok_s["gptlab"] / tok_s["transformers"],
              "tok_per_cpu_s": tok_per_cpu_s, "cpu_ratio": tok_per_cpu_s["gptlab"] / tok_per_cpu_s["transformers"],
              "round_seconds": times, "round_cpu_seconds": cpu}  # fmt: skip
    if device.type == "cuda":
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in torch.cuda.get_device_name()), None)
        flops = model_flops_per_token(ours, args.n_layer, args.block_size, args.n_embd)
        if peak:
            result["mfu"] = {name: tok_s[name] * flops / (peak * 1e12) for name in tok_s}
    return result


def main(argv=None) -> int:
    import torch

    from gptlab.loading import check_device

    args = parse_args(argv or [])
    if args.device:  # a name torch does not know (tpu), or cuda on a CPU-only build, said as such
        check_device(args.device, "--device")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from gptlab import gemm, kernels

    print(f"training B{args.batch_size}xT{args.block_size}, {args.n_layer} layers x {args.n_embd} wide, on {device}"
          f" (gptlab kernels: {kernels.describe()}; head GEMM: {gemm.head_gemm()})")  # fmt: skip
    results = []
    for dtype_name in args.dtypes:
        if dtype_name == "bfloat16" and device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            print("bfloat16: skipped (this CPU has no native bf16)")
            continue
        if dtype_name == "float16" and device.type != "cuda":
            print("float16: skipped (CUDA only)")
            continue
        r = run_dtype(args, dtype_name, device)
        results.append(r)
        line = (
            f"{dtype_name:>9}: gptlab {r['tok_per_s']['gptlab']:>9,.0f} tok/s   transformers {r['tok_per_s']['transformers']:>9,.0f} tok/s"
            f"   ratio {r['ratio']:.2f}x   (per CPU-second: {r['cpu_ratio']:.2f}x)"
        )
        if "mfu" in r:
            line += f"   MFU {r['mfu']['gptlab']:.1%} vs {r['mfu']['transformers']:.1%}"
        print(line)
    write_results("train", {"config": vars(args), "device": str(device), "results": results}, args.out)
    return 0
