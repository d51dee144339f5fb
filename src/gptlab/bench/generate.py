"""gptlab bench generate: decode and prefill speed of gptlab vs transformers' GPT2LMHeadModel.generate.

One process, one run: both engines get the same `gpt2`-shaped model with the same random weights,
a batch of 64-token prompts and 256 new tokens, greedy. Each row is an (engine, mode, compiled,
batch) combination. A mode is a name that `build_mode` turns into a model: fp32 and bf16 cast
the weights, int8 and int4 go through gptlab.quantize.quantize_model (when that module exists).

Timing: each configuration runs `--repeats` times and the best run counts (the machine may be
shared). Prefill is timed as generate(max_new_tokens=1); decode tok/s is the 255 remaining tokens
per row divided by (time for 256 tokens - time for 1, both from the same repeat), the same
formula for both engines.
The memory-bandwidth limit of batch-1 decoding is (bandwidth measured here) / (bytes of weights
read per token): every weight is read once per token and batch-1 decoding cannot go faster.
Bandwidth is probed before each timed repeat and after the last (see BandwidthProbe).

`--peer llama.cpp` compares with llama.cpp instead (gptlab.bench.llamacpp builds it, cached per
CPU): the model is exported with save_pretrained and converted to GGUF F32/BF16/Q8_0/Q4_0, and
each precision runs through gptlab's public path (from_pretrained, quantize_model, generate) and
llama-bench: decode tok/s (batch 1, 128 new tokens from one token) and 512-token prefill tok/s.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

import torch

from gptlab import cpu, kernels
from gptlab.bench.common import add_out_argument, at_least, machine, positive, repeat_seconds, write_results
from gptlab.bench.isa import AVX2_ENV, ISA_ENV
from gptlab.config import GPTConfig
from gptlab.kv_cache import cache_dtype
from gptlab.meta import meta_device
from gptlab.model import GPT

log = logging.getLogger(__name__)

# Quantized modes -> quantize_model keyword arguments: "int8" is the default int8 kernel, "int8-wo"
# (weight-only, bf16 activations) and "int8-dyn" (dynamic int8 activations) name each one explicitly.
QUANTIZED = {"int8": {}, "int8-wo": {"activations": "float"}, "int8-dyn": {"activations": "int8"}, "int4": {}}
MODES = ("fp32", "bf16", *QUANTIZED)


# ---------------------------------------------------------------------------------------------
# What is measured against what


class BandwidthProbe:
    """Memory bandwidth in GB/s, streaming a buffer much larger than the caches two ways: a full
    read (sum) and a matrix-vector product over it as an fp32 matrix, through oneDNN's prepacked
    kernel where available (every byte read once, all cores streaming). A measurement is the
    best of both: the fastest rate this machine streamed the buffer, the strictest limit we know.

    This machine is a VM whose bandwidth switches for tens of seconds at a time (~45 GB/s, at
    times ~70 GB/s), so the bench probes right before each timed repeat and after the last one,
    and divides each row by the best its own probes saw, not by a figure from another moment.
    """

    def __init__(self, nbytes: int = 512 * 2**20):
        self.nbytes = nbytes
        self.flat = torch.ones(nbytes // 4, dtype=torch.float32)
        self.vec = torch.ones(1, 1024)
        self.packed = None
        if torch.backends.mkldnn.is_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.flat.view(-1, 1024))  # (nbytes/4096, 1024)

    def _gemv(self):
        if self.packed is None:
            return torch.nn.functional.linear(self.vec, self.flat.view(-1, 1024))
        return torch.ops.mkldnn._linear_pointwise(self.vec, self.packed, None, "none", [], "")

    def measure(self, repeats: int = 5) -> dict:
        """{"read_gbs", "gemv_gbs", "bandwidth_gbs"}, each the best of `repeats` passes."""

        def best(fn) -> float:
            return round(self.nbytes / min(repeat_seconds(fn, repeats)) / 1e9, 2)

        out = {"read_gbs": best(self.flat.sum), "gemv_gbs": best(self._gemv)}
        out["bandwidth_gbs"] = max(out.values())
        return out


def weight_bytes_per_token(model: torch.nn.Module, buffers: bool = True) -> int:
    """Bytes of weights one decode step reads: every parameter (and buffer: quantized weights)
    once, a tied head once, except the position table, which only serves lookups (one row)."""
    lookup_only = ("wpe.weight",)
    seen, total = set(), 0
    for name, t in [*model.named_parameters(), *(model.named_buffers() if buffers else [])]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.element_size() * (t.size(-1) if name.endswith(lookup_only) else t.numel())
    return total


def cpu_has_native_bf16() -> tuple[bool, str]:
    """Whether bf16 matmuls may have hardware support here (cpu.may_have_native_bf16: one of
    cpu.BF16_FLAGS, or a CPU whose flags cannot be read), and why not if not."""
    capability = torch.backends.cpu.get_cpu_capability()
    if cpu.may_have_native_bf16():
        named = [f for f in cpu.BF16_FLAGS if f in cpu.cpuinfo("flags").split()]
        return True, f"{capability}, {' + '.join(named) or 'no x86 flags to read'}"
    return False, f"no native bf16 on this CPU (capability {capability}, no {'/'.join(cpu.BF16_FLAGS)} flag)"


# ---------------------------------------------------------------------------------------------
# Models: a mode name -> a model; the quantization work plugs in here


def build_mode(mode: str, state: dict, config: GPTConfig) -> GPT:
    """A gptlab model in `mode` with the given fp32 weights."""
    with meta_device():
        model = GPT(config)
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    model.eval()
    if mode in ("fp32", "bf16"):
        model = model.to(torch.bfloat16 if mode == "bf16" else torch.float32)
        return model
    if mode in QUANTIZED:
        try:
            from gptlab.quantize import quantize_model
        except ImportError as e:
            raise ValueError(f"mode {mode} needs gptlab.quantize ({e})") from e
        return quantize_model(model, mode[:4], **QUANTIZED[mode])
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")


def build_hf(state: dict, config: GPTConfig, mode: str):
    """transformers' GPT2LMHeadModel with the same weights (through gptlab's HF export), fp32 or bf16."""
    from transformers import GPT2LMHeadModel

    with tempfile.TemporaryDirectory() as tmp:
        build_mode("fp32", state, config).save_pretrained(tmp)
        hf = GPT2LMHeadModel.from_pretrained(tmp, dtype=torch.float32)
    hf.generation_config.pad_token_id = hf.config.eos_token_id
    return hf.to(torch.bfloat16 if mode == "bf16" else torch.float32).eval()


# ---------------------------------------------------------------------------------------------
# Engines: run(idx, n) -> token ids (B, T + n), greedy


def gptlab_engine(model, compiled_step=None):
    from gptlab.generation import generate

    return lambda idx, n: generate(model, idx, n, temperature=0, compiled_step=compiled_step)


def hf_engine(hf):
    def run(idx, n):
        mask = torch.ones_like(idx)
        return hf.generate(idx, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    return run


def time_engine(run, idx, new_tokens: int, repeats: int, probe: BandwidthProbe | None = None) -> dict:
    """Best-of-`repeats` times for prefill (1 new token), decoding (best_decode) and the full
    generation; with a probe, the memory bandwidth measured before each repeat and after the last
    (`bandwidth_gbs`, best). A repeat whose full run took no longer than its own prefill (noise on a
    tiny model) is run again, up to `repeats` more times."""
    first_t0 = time.perf_counter()
    out = run(idx, new_tokens)  # warm-up; with a compiled step, this call compiles
    first = time.perf_counter() - first_t0
    t1, tn, bandwidths = [], [], []
    with torch.no_grad():
        while sum(n > one for one, n in zip(t1, tn, strict=True)) < repeats and len(tn) < 2 * repeats:
            if probe is not None:
                bandwidths.append(probe.measure()["bandwidth_gbs"])
            t0 = time.perf_counter()
            run(idx, 1)
            t1.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = run(idx, new_tokens)
            tn.append(time.perf_counter() - t0)
    if probe is not None:
        bandwidths.append(probe.measure()["bandwidth_gbs"])
    B, T = idx.shape
    prefill, total = min(t1), min(tn)
    decode = best_decode(t1, tn, new_tokens)
    result = {
        "prefill_tok_s": round(B * T / prefill, 1),
        "decode_tok_s": round(B * (new_tokens - 1) / decode, 2),
        "e2e_tok_s": round(B * new_tokens / total, 2),
        "decode_ms_per_step": round(1e3 * decode / (new_tokens - 1), 2),
        "median_e2e_tok_s": round(B * new_tokens / sorted(tn)[len(tn) // 2], 2),
        "first_call_s": round(first, 2),
        "tokens": out,
    }
    if bandwidths:
        result.update(bandwidth_gbs=max(bandwidths), bandwidth_probes_gbs=bandwidths)
    return result


def best_decode(prefills: list[float], totals: list[float], new_tokens: int) -> float:
    """Seconds for the new_tokens - 1 decode steps: each repeat's full run less its own prefill,
    the best of them. Not the best full run less the best prefill, which come from different
    repeats: on a noisy machine that difference was negative, and decode_tok_s a fake 3e9."""
    decodes = [total - prefill for prefill, total in zip(prefills, totals, strict=True) if total > prefill]
    if not decodes:
        raise ValueError(f"every repeat's {new_tokens}-token run took no longer than its 1-token prefill (a noisy "
                         "machine): nothing to time decoding by; raise --new-tokens or --repeats")  # fmt: skip
    return min(decodes)


def time_linears(model, probe: BandwidthProbe | None = None, passes: int = 10, repeats: int = 3) -> dict:
    """The model's linear layers alone, back to back on one token, best of `repeats` runs of
    `passes` passes: what a decode step would cost with nothing else to do (no attention, norms,
    sampling or Python between them), the ceiling for these kernels. Returns ms per pass and the
    bandwidth measured next to it."""
    from gptlab.generation import model_device_dtype

    device, dtype = model_device_dtype(model)
    layers = [m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]
    inputs = {m.in_features: torch.randn(1, 1, m.in_features, device=device, dtype=dtype) for m in layers}

    def one_run() -> float:
        t0 = time.perf_counter()
        for _ in range(passes):
            for m in layers:
                m(inputs[m.in_features])
        return (time.perf_counter() - t0) / passes

    with torch.no_grad():
        one_run()
        bandwidth = probe.measure()["bandwidth_gbs"] if probe is not None else None
        best = min(one_run() for _ in range(repeats))
    return {"linears_only_ms": round(1e3 * best, 3), "linears_only_bandwidth_gbs": bandwidth}


# ---------------------------------------------------------------------------------------------
# The run


def isa_env_missing(isa: str) -> dict:
    """The ISA_ENV[isa] settings this process was not started with: {name: value}."""
    return {k: v for k, v in ISA_ENV[isa].items() if os.environ.get(k) != v}  # PyTorch's check is case-sensitive


# Flags that one peer reads and the other does not (given with the other, they were silently
# ignored): {peer: {flag's dest: its default}}. Their parser default is None, to tell them given.
PEER_ONLY = {
    "transformers": {"prompt_len": 64, "new_tokens": 256, "batch": (1, 8), "compile": False, "no_eager": False,
                     "no_hf": False, "probe_mib": 512},
    "llama.cpp": {"depth": 0, "kv_cache": "auto", "peer_isa": "native"},
}  # fmt: skip


def batch_sizes(text: str) -> tuple[int, ...]:
    """argparse's type for --batch: comma-separated batch sizes, each at least 1."""
    try:
        return tuple(positive(size) for size in text.split(","))
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated batch sizes such as 1,8 ({e})") from None


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gptlab bench generate", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2", help="model shape (random weights, seeded)")
    p.add_argument("--prompt-len", type=positive, help="prompt tokens (default 64)")
    p.add_argument(
        "--new-tokens",
        type=at_least(2, " (decoding is timed over the tokens after the first, which the prompt's pass gives)"),
        help="new tokens (default 256)",
    )
    p.add_argument("--batch", type=batch_sizes, help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--peer", choices=("transformers", "llama.cpp"), default="transformers", help="what to compare with")
    p.add_argument(
        "--peer-isa",
        choices=tuple(ISA_ENV),
        help="llama.cpp's build: for this CPU (native, the default), or for a lower level, to stand in for a CPU of "
        "that level: avx2 (AVX2-only CPUs such as AMD Zen 1-3), avx512-vnni (AVX-512 with VNNI, no BF16 or AMX: "
        "Intel's Ice Lake servers); pair each with its settings for gptlab: "
        + "; ".join(f"{isa}: {' '.join(f'{k}={v}' for k, v in env.items())}" for isa, env in ISA_ENV.items() if env),
    )
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated, from {', '.join(MODES)} (default fp32,bf16; with --peer llama.cpp fp32,bf16,int8,int4)",
    )
    p.add_argument(
        "--depth",
        type=int,
        help="with --peer llama.cpp: decode after this many tokens of context (llama-bench -d), prefill not timed",
    )
    p.add_argument(
        "--kv-cache",
        choices=("auto", "float32", "bfloat16"),
        help="with --peer llama.cpp: gptlab's KV cache dtype (auto, the default: bf16 for int8/int4, the "
        "activations' otherwise)",
    )
    p.add_argument(
        "--compile", action="store_true", default=None, help="also run gptlab with a torch.compile'd decode step"
    )
    p.add_argument("--no-eager", action="store_true", default=None, help="with --compile, skip the eager gptlab rows")
    p.add_argument("--no-hf", action="store_true", default=None, help="skip transformers")
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument(
        "--threads",
        type=positive,
        default=None,
        help="torch threads (default: torch's choice; with --peer llama.cpp os.cpu_count(), for both engines)",
    )
    p.add_argument("--probe-mib", type=positive, help="bandwidth probe buffer (default 512 MiB, >> caches)")
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p)
    return with_peer_defaults(p, p.parse_args(argv))


def with_peer_defaults(parser: argparse.ArgumentParser, args):
    """args with the PEER_ONLY flags not given at their defaults; the parser's error for one given
    that --peer does not read, and for --no-eager without --compile (nothing to skip beside)."""
    for peer, flags in PEER_ONLY.items():
        given = [f"--{name.replace('_', '-')}" for name in flags if getattr(args, name) is not None]
        if given and peer != args.peer:
            parser.error(f"{', '.join(given)}: not read with --peer {args.peer}, only with --peer {peer}")
        for name, default in flags.items():
            setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    if args.no_eager and not args.compile:
        parser.error("--no-eager skips the eager rows beside --compile's: give --compile too")
    return args


def plan_rows(args) -> list[dict]:
    """The (engine, mode, compiled, batch) rows to run, in order: every mode at the first batch
    size (batch 1, the goal figures) before the next batch size."""
    rows = []
    for batch in args.batch:
        for mode in args.modes.split(","):
            if not args.no_eager or not args.compile:
                rows.append(dict(engine="gptlab", mode=mode, compiled=False, batch=batch))
            if args.compile:
                rows.append(dict(engine="gptlab", mode=mode, compiled=True, batch=batch))
            if not args.no_hf and mode in ("fp32", "bf16"):
                rows.append(dict(engine="transformers", mode=mode, compiled=False, batch=batch))
    return rows


def run_row(row, models, hf_models, idx_by_batch, args, probe) -> dict:
    from gptlab.generation import compile_decode, new_cache

    mode, batch = row["mode"], row["batch"]
    idx = idx_by_batch[batch]
    if row["engine"] == "gptlab":
        model = models[mode]
        step = None
        if row["compiled"]:
            torch._dynamo.reset()  # each compiled row pays (and reports) its own compile
            step = compile_decode(model)
        result = time_engine(gptlab_engine(model, step), idx, args.new_tokens, args.repeats, probe)
        cache_len = min(model.config.block_size, args.prompt_len + args.new_tokens)
        row["kv_cache_bytes"] = new_cache(model, batch, cache_len).nbytes
        if row["compiled"]:
            row["compile_s"] = round(result["first_call_s"] - (batch * args.new_tokens / result["e2e_tok_s"]), 1)
        row["weight_bytes_per_token"] = weight_bytes_per_token(model)
        row["gptlab_kernels"] = kernels.available()[0]  # gptlab's C kernels built and used here
        if batch == 1 and not row["compiled"]:
            row.update(time_linears(model, probe))
    else:
        hf = hf_models[mode]
        result = time_engine(hf_engine(hf), idx, args.new_tokens, args.repeats, probe)
        row["weight_bytes_per_token"] = weight_bytes_per_token(hf, buffers=False)  # its buffers are masks
    row["tokens"] = result.pop("tokens")
    row.update(result)
    limit = row["bandwidth_gbs"] * 1e9 / row["weight_bytes_per_token"]
    row["bandwidth_limit_tok_s"] = round(limit, 2)
    if batch == 1:
        row["bandwidth_share"] = round(row["decode_tok_s"] / limit, 3)
    if row.get("linears_only_bandwidth_gbs"):
        streamed = row["weight_bytes_per_token"] / (row["linears_only_ms"] / 1e3) / 1e9  # GB/s
        row["linears_only_share"] = round(streamed / row["linears_only_bandwidth_gbs"], 3)
    return row


def check_run(args, config: GPTConfig) -> None:
    """Refuse, before any work, a mode not in MODES (build_mode's error came after minutes of
    probing) and a run the preset cannot take: transformers' GPT2LMHeadModel (unless --no-hf)
    stops at the model's block_size positions, where gptlab slides its window, and runs only
    GPT-2's own architecture."""
    if unknown := [mode for mode in args.modes.split(",") if mode not in MODES]:
        raise ValueError(f"--modes {args.modes}: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if args.no_hf:
        return
    if args.prompt_len + args.new_tokens > config.block_size:
        raise ValueError(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} is past {args.preset}'s "
                         f"{config.block_size} positions, where transformers stops: shorten them, or add --no-hf")  # fmt: skip
    if used := config.not_gpt2:
        raise ValueError(
            f"{args.preset} uses {', '.join(used)}, which transformers' GPT2LMHeadModel cannot run: add --no-hf"
        )


def main(argv=None) -> int:
    args = parse_args(argv or [])
    if args.peer == "llama.cpp":
        return run_llamacpp(args)
    args.modes = args.modes or "fp32,bf16"
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = GPTConfig.from_name(args.preset)
    check_run(args, config)
    fp32 = GPT(config).eval()
    state = fp32.state_dict()
    modes, skipped = [], {}
    for mode in args.modes.split(","):
        native, why = cpu_has_native_bf16()
        if mode == "bf16" and not native:
            skipped[mode] = why
        else:
            modes.append(mode)
    args.modes = ",".join(modes)
    for mode, why in skipped.items():
        print(f"skipping {mode}: {why}")
    gen = torch.Generator().manual_seed(args.seed)
    idx_by_batch = {b: torch.randint(0, config.vocab_size, (b, args.prompt_len), generator=gen) for b in args.batch}
    print(f"machine: {machine()}")
    probe = BandwidthProbe(args.probe_mib * 2**20)
    bandwidth = probe.measure()
    print(f"memory bandwidth: {bandwidth} (probed again around every repeat; each row uses its own)")
    models = {mode: build_mode(mode, state, config) for mode in modes}
    hf_models = {} if args.no_hf else {m: build_hf(state, config, m) for m in modes if m in ("fp32", "bf16")}
    rows, planned = [], plan_rows(args)
    try:
        for row in planned:
            label = f"{row['engine']:<12} {row['mode']:<5} {'compiled' if row['compiled'] else 'eager':<8} batch {row['batch']}"
            print(f"running {label} ...", flush=True)
            rows.append(run_row(row, models, hf_models, idx_by_batch, args, probe))
            print(format_row(rows[-1]), flush=True)
    except KeyboardInterrupt:  # Ctrl-C (or timeout -s INT): keep and write the rows done so far
        print(f"interrupted: {len(rows)} of {len(planned)} rows done")
    bandwidth["per_row_best_gbs"] = [r["bandwidth_gbs"] for r in rows]
    summary = summarize(rows)
    print_summary(rows, summary)
    for row in rows:
        row["same_tokens_as_transformers"] = _same_tokens(row, rows)
    for row in rows:
        row.pop("tokens")
    results = {
        "settings": dict(
            preset=args.preset, prompt_len=args.prompt_len, new_tokens=args.new_tokens, greedy=True,
            repeats=args.repeats, threads=torch.get_num_threads(), load_average=os.getloadavg(),
            rows_done=f"{len(rows)} of {len(planned)}",
        ),
        "bandwidth": bandwidth, "skipped": skipped, "rows": rows, "summary": summary,
    }  # fmt: skip
    write_results("generate", results, args.out)
    return 0


def run_llamacpp(args) -> int:
    """--peer llama.cpp: one row per precision, gptlab and llama-bench timed back to back."""
    from gptlab.bench import llamacpp

    modes = (args.modes or ",".join(llamacpp.GGUF_TYPES)).split(",")
    for mode in modes:
        if mode not in llamacpp.GGUF_TYPES:
            raise ValueError(f"--peer llama.cpp runs modes {', '.join(llamacpp.GGUF_TYPES)}; got {mode!r}")
    config = GPTConfig.from_name(args.preset)
    if config.block_size < llamacpp.PREFILL_TOKENS:  # llama.cpp would die on an assertion at position block_size
        raise ValueError(f"--peer llama.cpp times a {llamacpp.PREFILL_TOKENS}-token prompt, longer than {args.preset}'s "
                         f"{config.block_size} positions (block_size): choose a preset of GPT-2's shapes")  # fmt: skip
    if not 0 <= args.depth <= config.block_size - llamacpp.DECODE_TOKENS - 1:
        raise ValueError(f"--depth must be in [0, {config.block_size - llamacpp.DECODE_TOKENS - 1}] for {args.preset}")
    threads = args.threads or os.cpu_count()
    torch.set_num_threads(threads)
    print(f"machine: {machine()}")
    root = llamacpp.build_root(isa=args.peer_isa)
    if llamacpp.load_build(root) is None:
        print(f"building llama.cpp {llamacpp.LLAMA_CPP_PYTHON} into {root} (~8 minutes on 2 cores) ...")
    llama = llamacpp.ensure_built(isa=args.peer_isa)
    info = llama.info
    print(f"llama.cpp {info['llama_cpp_commit'][:12]} (llama-cpp-python {info['llama_cpp_python']}, {args.peer_isa}): {llama.root}")  # fmt: skip
    unpaired = isa_env_missing(args.peer_isa)
    if unpaired:
        print(f"note: llama.cpp runs at the {args.peer_isa} level but gptlab does not; set {' '.join(f'{k}={v}' for k, v in unpaired.items())}")  # fmt: skip
    native, why = cpu_has_native_bf16()
    if "bf16" in modes and not native:
        print(f"note: bf16 rows run without hardware bf16 for both engines ({why})")
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, config.vocab_size, (1, llamacpp.PREFILL_TOKENS), generator=gen)
    context = torch.randint(0, config.vocab_size, (1, args.depth), generator=gen) if args.depth else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(args.seed)
        GPT(config).save_pretrained(f"{tmp}/hf")
        print("converting to GGUF ...", flush=True)
        files = llamacpp.convert(llama, f"{tmp}/hf", tmp, [llamacpp.GGUF_TYPES[m] for m in modes])
        models = {mode: llamacpp.load_gptlab(f"{tmp}/hf", mode, args.kv_cache) for mode in modes}
        ggufs = {mode: files[llamacpp.GGUF_TYPES[mode]] for mode in modes}
        gguf_bytes = {mode: gguf.stat().st_size for mode, gguf in ggufs.items()}
        print(f"{args.repeats} rounds, each timing {', '.join(modes)} in turn ...", flush=True)
        try:
            best = llamacpp.time_interleaved(models, ggufs, prompt, llama, threads, args.repeats, context)
        except KeyboardInterrupt:
            print("interrupted: no rows (each row needs every round)")
            best = {}
        print(llamacpp.row_header(args.depth), flush=True)
        for mode, (ours, theirs) in best.items():
            kv = str(cache_dtype(models[mode])).removeprefix("torch.")
            rows.append({**llamacpp.peer_row(mode, ours, theirs), "kv_cache": kv, "llamacpp_bench": theirs})
            print(llamacpp.format_peer_row(rows[-1]), flush=True)
    results = {
        "settings": dict(
            peer="llama.cpp", preset=args.preset, seed=args.seed, decode_tokens=llamacpp.DECODE_TOKENS,
            decode_from=f"{args.depth} random tokens" if args.depth else [[llamacpp.EOT]], depth=args.depth,
            kv_cache=args.kv_cache, prefill_tokens=llamacpp.PREFILL_TOKENS, greedy=True,
            repeats=args.repeats, best_of_repeats=True, modes_interleaved=True, threads=threads, native_bf16=native,
            native_bf16_why=why, load_average=os.getloadavg(), rows_done=f"{len(rows)} of {len(modes)}",
            peer_isa=args.peer_isa, isa_env={k: os.environ[k] for k in AVX2_ENV if k in os.environ},  # every level's names
        ),
        "llama_cpp": {**llama.info, "q4_0": "llama-quantize --pure from the F32 file", "gguf_bytes": gguf_bytes},
        "rows": rows,
    }  # fmt: skip
    write_results("generate-llamacpp", results, args.out)
    return 0


def _find(rows, **keys):
    return next((r for r in rows if all(r.get(k) == v for k, v in keys.items())), None)


def _same_tokens(row, rows):
    ref = _find(rows, engine="transformers", mode=row["mode"], batch=row["batch"])
    if ref is None or row["engine"] == "transformers":
        return None
    return bool(torch.equal(row["tokens"], ref["tokens"]))


def _ratio(row, base, key: str = "decode_tok_s") -> float:
    return round(row[key] / base[key], 2)


def summarize(rows) -> dict:
    """The goal figures: ratios to transformers and to gptlab fp32, bandwidth shares (batch 1)."""
    out = {}
    for compiled in (False, True):
        tag = "compiled" if compiled else "eager"
        ours32 = _find(rows, engine="gptlab", mode="fp32", compiled=compiled, batch=1)
        hf32 = _find(rows, engine="transformers", mode="fp32", batch=1)
        ours16 = _find(rows, engine="gptlab", mode="bf16", compiled=compiled, batch=1)
        if ours32:
            out[f"fp32_{tag}_bandwidth_share"] = ours32["bandwidth_share"]
            if "linears_only_share" in ours32:
                out["fp32_linears_only_share"] = ours32["linears_only_share"]
        if ours32 and hf32:
            out[f"fp32_{tag}_decode_vs_transformers"] = _ratio(ours32, hf32)
            out[f"fp32_{tag}_prefill_vs_transformers"] = _ratio(ours32, hf32, "prefill_tok_s")
        if ours16 and ours32:
            out[f"bf16_{tag}_decode_vs_gptlab_fp32_{tag}"] = _ratio(ours16, ours32)
        for q in QUANTIZED:
            ours_q = _find(rows, engine="gptlab", mode=q, compiled=compiled, batch=1)
            if ours_q and ours32:
                out[f"{q}_{tag}_decode_vs_gptlab_fp32_{tag}"] = _ratio(ours_q, ours32)
            if ours_q and hf32:
                out[f"{q}_{tag}_decode_vs_transformers_fp32"] = _ratio(ours_q, hf32)
    best32 = [r for r in rows if r["engine"] == "gptlab" and r["mode"] == "fp32" and r["batch"] == 1]
    best16 = [r for r in rows if r["engine"] == "gptlab" and r["mode"] == "bf16" and r["batch"] == 1]
    if best32 and best16:
        fastest32 = max(best32, key=lambda r: r["decode_tok_s"])
        out["bf16_best_vs_fp32_best"] = round(max(r["decode_tok_s"] for r in best16) / fastest32["decode_tok_s"], 2)
    return out


def format_row(r) -> str:
    share = (
        f"{100 * r['bandwidth_share']:5.1f}% of limit ({r['bandwidth_gbs']:.0f} GB/s)" if "bandwidth_share" in r else ""
    )
    kv = f"kv {r['kv_cache_bytes'] / 2**20:6.1f} MiB" if "kv_cache_bytes" in r else ""
    comp = f"compile {r['compile_s']:.0f}s" if "compile_s" in r else ""
    if "linears_only_share" in r:
        share += f", linears alone {100 * r['linears_only_share']:.0f}%"
    return (
        f"  {r['engine']:<12} {r['mode']:<5} {'compiled' if r['compiled'] else 'eager':<8} B={r['batch']:<2} "
        f"decode {r['decode_tok_s']:8.2f} tok/s  prefill {r['prefill_tok_s']:8.1f} tok/s  "
        f"e2e {r['e2e_tok_s']:8.2f} tok/s  {share}  {kv}  {comp}"
    )


def print_summary(rows, summary) -> None:
    print("\nresults (best of repeats):")
    for r in rows:
        print(format_row(r))
    for key, value in summary.items():
        print(f"  {key}: {value}")
