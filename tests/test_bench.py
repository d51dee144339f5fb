"""gptlab bench generate on a tiny model: both engines, identical greedy tokens, the bandwidth figures."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from gptlab import cpu, kernels
from gptlab.bench.generate import BandwidthProbe, cpu_has_native_bf16, main, weight_bytes_per_token

# the variants and gemm benches time gptlab's kernels: nothing to time where they are off or not built
needs_kernels = pytest.mark.skipif(
    not kernels.available()[0], reason=f"gptlab's kernels are off or not built here: {kernels.available()[2]}"
)


def test_bench_generate_writes_both_engines_and_the_bandwidth_shares(tmp_path, capsys):
    # 32 new tokens, 2 repeats: with 6 and 1, a loaded CI machine once had both tries' full run
    # no longer than their prefill, leaving no decode time to report
    args = ["--preset", "gpt2-tiny", "--modes", "fp32", "--batch", "1", "--prompt-len", "5", "--new-tokens", "32",
            "--repeats", "2", "--probe-mib", "16", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    (path,) = tmp_path.glob("generate-*.json")
    results = json.loads(path.read_text())
    ours, theirs = results["rows"]
    assert (ours["engine"], theirs["engine"]) == ("gptlab", "transformers")
    assert ours["same_tokens_as_transformers"] is True
    for row in (ours, theirs):
        assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0
        # before each repeat and after the last, and before a repeat run again (noise: a full run beat its prefill)
        assert 3 <= len(row["bandwidth_probes_gbs"]) <= 5 and row["bandwidth_gbs"] == max(row["bandwidth_probes_gbs"])
        limit = row["bandwidth_gbs"] * 1e9 / row["weight_bytes_per_token"]
        assert row["bandwidth_share"] == pytest.approx(row["decode_tok_s"] / limit, abs=1e-3)
    assert 0 < ours["linears_only_share"] and ours["linears_only_ms"] > 0
    # the summary's ratios are the rows' (not asserted > 0: 6 tokens timed once on a loaded machine
    # once gave gptlab 0.004x transformers, which rounds to 0.00)
    summary = results["summary"]
    assert "machine" in results
    assert summary["fp32_eager_decode_vs_transformers"] == round(ours["decode_tok_s"] / theirs["decode_tok_s"], 2)
    assert summary["fp32_eager_prefill_vs_transformers"] == round(ours["prefill_tok_s"] / theirs["prefill_tok_s"], 2)
    assert "of limit" in capsys.readouterr().out


def test_bench_generate_refuses_what_transformers_cannot_run_before_any_work(monkeypatch):
    """transformers stops at the model's positions and runs only GPT-2's architecture: such a run
    is refused up front, saying what to change, not with transformers' IndexError after gptlab's rows."""
    import gptlab.bench.generate as bench

    monkeypatch.setattr(bench, "GPT", None)  # nothing is built before the checks
    with pytest.raises(ValueError, match="--prompt-len 64 \\+ --new-tokens 256 is past gpt2-tiny's 128 positions"):
        main(["--preset", "gpt2-tiny"])
    with pytest.raises(ValueError, match="--prompt-len 100 \\+ --new-tokens 29 is past gpt2-tiny's 128 positions"):
        main(["--preset", "gpt2-tiny", "--prompt-len", "100", "--new-tokens", "29"])
    with pytest.raises(ValueError, match="llama-tiny uses RoPE positions, RMSNorm, SwiGLU MLP, which"):
        main(["--preset", "llama-tiny", "--prompt-len", "8", "--new-tokens", "8"])
    with pytest.raises(ValueError, match="--modes fp32,bogus: unknown bogus; choose from fp32, bf16"):
        main(["--preset", "gpt2-tiny", "--prompt-len", "4", "--new-tokens", "4", "--modes", "fp32,bogus"])
    with pytest.raises(TypeError):  # past the checks: the run starts (with --no-hf, gptlab slides its window)
        main(["--preset", "llama-tiny", "--prompt-len", "200", "--new-tokens", "8", "--no-hf"])
    with pytest.raises(TypeError):  # the longest run transformers takes
        main(["--preset", "gpt2-tiny", "--prompt-len", "100", "--new-tokens", "28"])


@pytest.mark.parametrize(
    "argv, message",
    [(["--batch", "a"], "argument --batch: 'a': expected comma-separated batch sizes such as 1,8 (expected an "
                        "integer, got 'a')"),
     (["--batch", "1,,2"], "argument --batch: '1,,2': expected comma-separated batch sizes such as 1,8"),
     (["--batch", "1,0"], "(must be at least 1, got 0)"),
     (["--peer", "llama.cpp", "--batch", "1", "--compile"], "--batch, --compile: not read with --peer llama.cpp"),
     (["--peer", "llama.cpp", "--prompt-len", "8", "--new-tokens", "8", "--no-hf"],
      "--prompt-len, --new-tokens, --no-hf: not read with --peer llama.cpp, only with --peer transformers"),
     (["--depth", "100"], "--depth: not read with --peer transformers, only with --peer llama.cpp"),
     (["--kv-cache", "float32", "--peer-isa", "avx2"], "--kv-cache, --peer-isa: not read with --peer transformers"),
     (["--no-eager"], "--no-eager skips the eager rows beside --compile's: give --compile too")],
)  # fmt: skip
def test_bench_generate_refuses_a_bad_batch_and_flags_its_peer_does_not_read(argv, message, capsys):
    """--batch a was a bare int() ValueError; --peer llama.cpp silently ignored --batch, --prompt-len,
    --new-tokens, --compile and --no-hf, and without it --depth and --kv-cache were ignored."""
    from gptlab.bench.generate import parse_args

    with pytest.raises(SystemExit) as exit:
        parse_args(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err
    assert parse_args(["--peer", "llama.cpp", "--depth", "895"]).batch == (1, 8)  # the defaults, where not given
    args = parse_args(["--batch", "1,4", "--compile", "--no-eager"])
    assert (args.batch, args.depth, args.kv_cache, args.peer_isa, args.no_hf) == ((1, 4), 0, "auto", "native", False)


@pytest.mark.parametrize(
    "device, message",
    [("tpu", "--device tpu: not a device name"), ("cuda:0", "--device cuda:0: no CUDA device is available")],
)
def test_bench_train_names_a_device_it_cannot_use(device, message, monkeypatch, capsys):
    """--device cuda on a CPU-only build was torch's AssertionError traceback, --device tpu a RuntimeError."""
    from gptlab.bench import train
    from gptlab.cli import main as cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only build, on any machine
    monkeypatch.setattr(train, "run_dtype", None)  # nothing runs before the check
    assert cli(["bench", "train", "--device", device, "--out", ""]) == 2
    assert message in capsys.readouterr().err


def test_bench_quantize_checks_its_model_before_the_random_rows(tmp_path, monkeypatch, capsys):
    """--model /nope was refused after minutes of the random gpt2 model's rows."""
    from gptlab.bench import quantize
    from gptlab.cli import main as cli

    monkeypatch.setattr(quantize, "random_gpt2_rows", None)  # nothing runs before the check
    assert cli(["bench", "quantize", "--model", str(tmp_path / "nope"), "--out", ""]) == 2
    assert f"--model {tmp_path / 'nope'}: not a directory in the Hugging Face layout" in capsys.readouterr().err


def test_results_are_written_and_named_or_with_out_empty_not_written(tmp_path, monkeypatch, capsys):
    """Every bench writes through write_results: a JSON file whose path it prints, or with `--out ''`
    nothing at all (gemm, nanogpt, recipes, serve, speculative and train wrote into the working
    directory then)."""
    from gptlab.bench.common import write_results

    path = write_results("unit", {"rows": [1]}, tmp_path / "out")
    assert json.loads(path.read_text())["rows"] == [1] and f"results: {path}" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)
    assert write_results("unit", {"rows": [1]}, "") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and capsys.readouterr().out == ""


def test_results_of_the_same_second_are_each_kept(tmp_path, monkeypatch):
    """Two runs finishing in the same second got the same name: the second overwrote the first."""
    from datetime import datetime, timezone

    from gptlab.bench import common

    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 12, 8, 12, 0, 0, tzinfo=timezone.utc)

    monkeypatch.setattr(common, "datetime", Frozen)
    monkeypatch.setattr(common, "machine", lambda: {"cpu": "test"})
    paths = [common.write_results("unit", {"rows": [n]}, tmp_path) for n in range(3)]
    assert [p.name for p in paths] == ["unit-20261208-120000.json", "unit-20261208-120000-2.json",
                                       "unit-20261208-120000-3.json"]  # fmt: skip
    assert [json.loads(p.read_text())["rows"] for p in paths] == [[0], [1], [2]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)  # no temporary file left


BENCHES_WITH_OUT = ["generate", "train", "gemm", "variants", "recipes", "nanogpt", "quantize", "speculative", "harness",
                    "hooks", "formats", "serve"]  # fmt: skip


@pytest.mark.parametrize("bench", BENCHES_WITH_OUT)
def test_bench_out_that_cannot_be_written_is_refused_as_the_flag_is_read(bench, tmp_path, capsys, monkeypatch):
    """An --out under a file was found only when the results were written, after the whole run
    (minutes of llama.cpp in make bench): every bench now checks it as the flag is read."""
    from gptlab.bench import common
    from gptlab.cli import main as cli

    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as exit:
        cli(["bench", bench, "--out", str(tmp_path / "afile" / "results")])
    assert exit.value.code == 2
    assert f"argument --out: {tmp_path}/afile/results: {tmp_path}/afile is a file, not a directory" in (
        capsys.readouterr().err
    )
    monkeypatch.setattr(common.os, "access", lambda path, mode: False)  # a directory not ours, or read-only
    with pytest.raises(SystemExit):
        cli(["bench", bench, "--out", str(tmp_path / "new" / "results")])
    assert f"argument --out: {tmp_path}/new/results: {tmp_path} cannot be written to" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "bench, flag",
    [("gemm", "--rounds"), ("variants", "--rounds"), ("train", "--steps"), ("generate", "--repeats"),
     ("speculative", "--prompt-len"), ("serve", "--clients"), ("hooks", "--tokens"), ("quantize", "--threads")],
)  # fmt: skip
def test_bench_counts_below_one_are_refused_as_the_flag_is_read(bench, flag, capsys):
    """`--rounds 0` was "no median for empty data" after the models were built; now argparse's error."""
    from gptlab.cli import main as cli

    for value, message in (("0", "must be at least 1, got 0"), ("two", "expected an integer, got 'two'")):
        with pytest.raises(SystemExit) as exit:
            cli(["bench", bench, flag, value])
        assert exit.value.code == 2 and f"argument {flag}: {message}" in capsys.readouterr().err


def test_decode_is_timed_from_each_repeats_own_prefill(monkeypatch):
    """The best prefill and the best full run came from different repeats: a repeat whose prefill
    ran slow made the other's full run look shorter than prefill, and decode 3,000,000,000 tok/s.
    Now each repeat's full run less its own prefill, the best of those; a repeat without one is run
    again, and where none gives one, an error."""
    from types import SimpleNamespace

    import gptlab.bench.generate as bench

    now = [0.0]
    # warm-up; repeat 1: prefill 1.0, full run 1.5; repeat 2: 1.6, 0.9 (noise), run again: 0.8, 1.4
    durations = iter([0.0, 1.0, 1.5, 1.6, 0.9, 0.8, 1.4])

    def run(idx, n):
        now[0] += next(durations)
        return idx

    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    result = bench.time_engine(run, torch.zeros(2, 4, dtype=torch.long), new_tokens=11, repeats=2)
    assert result["decode_tok_s"] == 2 * 10 / 0.5 and result["decode_ms_per_step"] == 50.0  # repeat 1's 0.5 s
    assert result["prefill_tok_s"] == 2 * 4 / 0.8 and result["e2e_tok_s"] == round(2 * 11 / 0.9, 2)
    durations = iter([0.0, 1.0, 0.9, 1.0, 0.9])  # run again once (repeats=1), to no avail
    with pytest.raises(ValueError, match="took no longer than its 1-token prefill"):
        bench.time_engine(run, torch.zeros(1, 4, dtype=torch.long), new_tokens=11, repeats=1)


def test_bench_generate_refuses_fewer_than_two_new_tokens_as_the_flag_is_read(capsys):
    """--new-tokens 1 left no decode step to time: a ZeroDivisionError after the models were built."""
    from gptlab.cli import main as cli

    with pytest.raises(SystemExit) as exit:
        cli(["bench", "generate", "--new-tokens", "1"])
    assert exit.value.code == 2
    assert "argument --new-tokens: must be at least 2 (decoding is timed over the tokens after the first" in (
        capsys.readouterr().err
    )


def test_probe_reports_its_best_reading():
    out = BandwidthProbe(8 * 2**20).measure(repeats=2)
    assert out["bandwidth_gbs"] == max(out["read_gbs"], out["gemv_gbs"]) > 0


def test_weight_bytes_count_the_tied_head_once_and_skip_the_position_table():
    from conftest import tiny_model

    plain = tiny_model()
    C, P = plain.config.n_embd, plain.config.block_size
    total = 4 * plain.num_params()
    expected = total - 4 * (P - 1) * C  # the position table: one row per token
    assert weight_bytes_per_token(plain) == expected


# --- llama.cpp peer (gptlab.bench.llamacpp): the pure parts; building llama.cpp is not a test


def test_llama_bench_json_gives_the_best_repetition():
    from gptlab.bench.llamacpp import parse_bench_json

    out = parse_bench_json(LLAMA_BENCH_SAMPLE)
    assert out["best_ts"] == max(out["samples_ts"]) > out["avg_ts"]
    assert (out["n_prompt"], out["n_gen"], out["n_threads"]) == (0, 128, 2)
    assert out["build_commit"] == "0c1e570" and out["model_type"].startswith("gpt2")
    with pytest.raises(RuntimeError, match="(?s)no JSON.*main: load the model"):
        parse_bench_json("main: load the model and apply lora adapter, if any\n")
    with pytest.raises(RuntimeError, match="expected one test"):
        parse_bench_json("[]")


def test_peer_rows_print_both_engines_and_the_ratio():
    from gptlab.bench.llamacpp import format_peer_row, peer_row, row_header

    row = peer_row(
        "int4", {"decode_tok_s": 41.234, "prefill_tok_s": 1800.0}, {"decode_tok_s": 60.0, "prefill_tok_s": 900.0}
    )
    assert row["gguf_type"] == "Q4_0" and row["decode_ratio"] == 0.687 and row["prefill_ratio"] == 2.0
    line = format_peer_row(row)
    assert line.split() == ["int4", "Q4_0", "41.23", "60.00", "0.69x", "1800.0", "900.0", "2.00x"]
    for depth in (0, 896):  # the columns line up under the header
        assert len(line) == len(row_header(depth).splitlines()[-1])
    assert "after 896 tokens" in row_header(896) and "after" not in row_header(0)
    failed = peer_row(
        "fp32", {"decode_tok_s": 10.0, "prefill_tok_s": 10.0}, {"decode_tok_s": 0.0, "prefill_tok_s": 5.0}
    )
    assert failed["decode_ratio"] is None and format_peer_row(failed).split()[4] == "-"


def test_llamacpp_cache_path_names_the_cpu(monkeypatch, tmp_path):
    from gptlab.bench import llamacpp

    assert llamacpp.cpu_slug("Intel(R) Xeon(R) Processor") == "intel-r-xeon-r-processor"
    with_flags = llamacpp.cpu_slug("Intel(R) Xeon(R) Processor", ["avx2", "avx512f"])
    assert with_flags.startswith("intel-r-xeon-r-processor-") and len(with_flags.rsplit("-", 1)[1]) == 8
    assert with_flags != llamacpp.cpu_slug("Intel(R) Xeon(R) Processor", ["avx2"])  # same name, other ISA
    assert llamacpp.cpu_slug("AMD EPYC 7B13 64-Core Processor") == "amd-epyc-7b13-64-core-processor"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = llamacpp.build_root("0.3.36")
    assert root.parent == tmp_path / "gptlab" / "llama.cpp"
    assert root.name == "0.3.36-" + llamacpp.cpu_slug(llamacpp.cpu_model_name(), llamacpp.cpu_flags())
    assert llamacpp.load_build(root) is None  # nothing cached: ensure_built would build


def test_llamacpp_avx2_build_is_cached_apart_built_for_avx2_and_refused_where_it_cannot_run(monkeypatch, tmp_path):
    from gptlab.bench import llamacpp

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(llamacpp, "cpu_flags", lambda: ["avx", "avx2", "avx512f", "bmi2", "f16c", "fma"])
    root = llamacpp.build_root("0.3.36", isa="avx2")
    assert root.name == "0.3.36-x86-64-avx2" and root != llamacpp.build_root("0.3.36")
    # the build hands cmake the AVX2 level in place of -DGGML_NATIVE=ON
    commands = []
    monkeypatch.setattr(llamacpp, "run_step", lambda step, cmd, **kw: commands.append([str(c) for c in cmd]))
    for tool in llamacpp.TARGETS:
        (tmp_path / "src" / "build" / "bin").mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / "build" / "bin" / tool).touch()
    info = llamacpp.build(tmp_path / "src", "0.3.36", "0c1e570", 2, isa="avx2")
    configure = commands[0]
    assert "-DGGML_NATIVE=OFF" in configure and "-DGGML_NATIVE=ON" not in configure
    assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF"} <= set(configure)
    assert info["isa"] == "avx2" and info["cmake_flags"] == configure[5:-1]
    assert "-DGGML_NATIVE=ON" in llamacpp.build(tmp_path / "src", "0.3.36", "0c1e570", 2)["cmake_flags"]
    # a CPU below the level is refused before anything is downloaded
    monkeypatch.setattr(llamacpp, "cpu_flags", lambda: ["avx", "sse4_2"])
    with pytest.raises(ValueError, match="cannot run llama.cpp's avx2 build: it lacks avx2, bmi2, f16c, fma"):
        llamacpp.ensure_built("0.3.36", cache=tmp_path / "cache", isa="avx2")
    with pytest.raises(ValueError, match="unknown llama.cpp ISA 'avx9'; choose from native, avx2, avx512-vnni"):
        llamacpp.build_root(isa="avx9")
    assert not (tmp_path / "cache").exists()


def test_llamacpp_avx512_vnni_build_has_no_bf16_or_amx_and_needs_vnni(monkeypatch, tmp_path):
    """The first Xeon's level (Ice Lake): AVX-512 with VBMI and VNNI switched on, its BF16 and AMX
    off, whatever this CPU has; refused on a CPU without VNNI."""
    from gptlab.bench import llamacpp

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    icelake = "avx2 fma f16c bmi2 avx512f avx512bw avx512dq avx512vl avx512vbmi avx512_vnni".split()
    monkeypatch.setattr(llamacpp, "cpu_flags", lambda: [*icelake, "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"])
    assert llamacpp.build_root("0.3.36", isa="avx512-vnni").name == "0.3.36-x86-64-avx512-vnni"
    commands = []
    monkeypatch.setattr(llamacpp, "run_step", lambda step, cmd, **kw: commands.append([str(c) for c in cmd]))
    (tmp_path / "src" / "build" / "bin").mkdir(parents=True)
    for tool in llamacpp.TARGETS:
        (tmp_path / "src" / "build" / "bin" / tool).touch()
    configure = set(llamacpp.build(tmp_path / "src", "0.3.36", "0c1e570", 2, isa="avx512-vnni")["cmake_flags"])
    on = {f"-DGGML_{e}=ON" for e in ("AVX2", "FMA", "AVX512", "AVX512_VBMI", "AVX512_VNNI")}
    off = {f"-DGGML_{e}=OFF" for e in ("AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16", "AVX_VNNI")}
    assert "-DGGML_NATIVE=OFF" in configure and on | off <= configure
    monkeypatch.setattr(llamacpp, "cpu_flags", lambda: icelake[:-1])  # a Skylake server: no VNNI
    with pytest.raises(ValueError, match="cannot run llama.cpp's avx512-vnni build: it lacks avx512_vnni"):
        llamacpp.build_root("0.3.36", isa="avx512-vnni")


def test_llamacpp_builds_with_its_amx_tile_config_fixed_and_rebuilds_a_build_made_before(monkeypatch, tmp_path):
    """SOURCE_FIXES: the vendored AMX code's stack-built tile configuration (which GCC compiles to a
    zeroed one: SIGILL on an Intel Xeon with AMX) is replaced before cmake runs, the build records
    it, and a cached build that does not record it is built again."""
    from gptlab.bench import llamacpp

    fix = llamacpp.SOURCE_FIXES[0]
    mmq = tmp_path / "src" / fix.path
    mmq.parent.mkdir(parents=True)
    mmq.write_text("inline void ggml_tile_config_init(void) {\n" + fix.old + "    _tile_loadconfig(&tc);\n}\n")
    configured = []
    monkeypatch.setattr(llamacpp, "run_step", lambda step, cmd, **kw: configured.append(mmq.read_text()))
    (tmp_path / "src" / "build" / "bin").mkdir(parents=True)
    for tool in llamacpp.TARGETS:
        (tmp_path / "src" / "build" / "bin" / tool).touch()
    (tmp_path / "src" / "convert_hf_to_gguf.py").touch()
    info = llamacpp.build(tmp_path / "src", "0.3.36", "0c1e570", 2)
    assert fix.old not in configured[0] and fix.new in configured[0]  # fixed before cmake ran
    assert "static const tile_config_t tc" in mmq.read_text() and info["source_fixes"] == {fix.name: True}
    (tmp_path / "src" / llamacpp.INFO_FILE).write_text(json.dumps(info))
    assert llamacpp.load_build(tmp_path / "src") is not None
    (tmp_path / "src" / llamacpp.INFO_FILE).write_text(json.dumps({**info, "source_fixes": {}}))
    assert llamacpp.load_build(tmp_path / "src") is None  # built before the fix: ensure_built rebuilds
    # another version's tree without that code: built as it is, the fix recorded as not made
    mmq.write_text("// other code\n")
    assert llamacpp.build(tmp_path / "src", "0.3.37", "abcdef0", 2)["source_fixes"] == {fix.name: False}
    assert mmq.read_text() == "// other code\n"


def test_decoding_at_depth_times_the_steps_after_the_context_as_llama_bench_d(monkeypatch):
    """--depth: gptlab's decoding timed from the prefill's token to the last of DECODE_TOKENS steps
    after it (each clock read here one tick), llama-bench given -d; a depth past the model's, or a model
    shorter than the prefill's prompt, is refused."""
    from gptlab.bench import llamacpp

    with pytest.raises(ValueError, match=r"--depth must be in \[0, 895\] for gpt2"):
        main(["--peer", "llama.cpp", "--depth", "896"])  # before building or converting anything
    with pytest.raises(ValueError, match="a 512-token prompt, longer than gpt2-mini's 256 positions"):
        main(["--peer", "llama.cpp", "--preset", "gpt2-mini"])  # not llama.cpp's assertion, after building it
    monkeypatch.setattr(llamacpp, "DECODE_TOKENS", 5)
    ticks = iter(range(1000))
    monkeypatch.setattr(llamacpp.time, "perf_counter", lambda: float(next(ticks)))
    assert llamacpp.decode_after(tiny_model(), torch.tensor([[1, 2, 3, 4]])) == 5.0
    commands = []

    def fake_run(step, cmd, **kw):
        commands.append([str(c) for c in cmd])
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps([{"avg_ts": 9.0, "samples_ts": [9.0]}]))

    monkeypatch.setattr(llamacpp, "run_step", fake_run)
    fake = llamacpp.LlamaCpp(Path("/llama"), {})
    assert llamacpp.time_llamacpp(fake, Path("m.gguf"), threads=2, repeats=1, depth=300)["decode_tok_s"] == 9.0
    assert commands[0][commands[0].index("-d") + 1] == "300" and commands[1][commands[1].index("-d") + 1] == "0"


def test_each_llamacpp_round_times_every_mode_and_each_row_keeps_its_best(monkeypatch):
    """Rounds run fp32, int4, fp32, int4, ... (each engine after the other), so a slow phase of the
    VM hits every precision alike; each engine's row keeps its fastest round, with llama-bench's facts
    of that round."""
    from gptlab.bench import llamacpp

    calls, speeds = [], iter([10.0, 40.0, 30.0, 20.0, 20.0, 50.0])  # fp32, int4 per round, 3 rounds

    def fake_gptlab(model, prompt, repeats, context):
        calls.append(("gptlab", model))
        speed = next(speeds)
        return {"decode_tok_s": speed, "prefill_tok_s": 100 * speed}

    def fake_llamacpp(llama, gguf, *, threads, repeats, depth):
        calls.append(("llama.cpp", gguf))
        speed = 2.0 * len(calls)
        return {"decode_tok_s": speed, "prefill_tok_s": speed, "decode": {"call": len(calls)}, "prefill": {}}

    monkeypatch.setattr(llamacpp, "time_gptlab", fake_gptlab)
    monkeypatch.setattr(llamacpp, "time_llamacpp", fake_llamacpp)
    models, ggufs = {"fp32": "m32", "int4": "m4"}, {"fp32": "F32.gguf", "int4": "Q4_0.gguf"}
    best = llamacpp.time_interleaved(models, ggufs, None, None, threads=2, repeats=3)
    assert calls == [("gptlab", "m32"), ("llama.cpp", "F32.gguf"), ("gptlab", "m4"), ("llama.cpp", "Q4_0.gguf")] * 3
    assert best["fp32"][0] == {"decode_tok_s": 30.0, "prefill_tok_s": 3000.0}
    assert best["int4"][0] == {"decode_tok_s": 50.0, "prefill_tok_s": 5000.0}
    assert best["int4"][1]["decode_tok_s"] == 24.0 and best["int4"][1]["decode"] == {"call": 12}


def test_the_llamacpp_rows_load_gptlab_with_the_kv_cache_asked(tmp_path):
    """--kv-cache: auto keeps each mode's default (bf16 for int8/int4, the activations' otherwise);
    float32 or bfloat16 sets it."""
    from gptlab.bench.llamacpp import load_gptlab
    from gptlab.generation import new_cache

    tiny_model(n_embd=64).save_pretrained(tmp_path)

    def cache(mode, kv="auto"):
        return new_cache(load_gptlab(tmp_path, mode, kv), 1, 4).layers[0][0].dtype

    assert cache("fp32") == torch.float32 and cache("int4") == cache("int8") == torch.bfloat16
    assert cache("int4", "float32") == torch.float32 and cache("fp32", "bfloat16") == torch.bfloat16


def test_bench_generate_names_the_settings_that_hold_gptlab_to_each_level(monkeypatch):
    from gptlab.bench.generate import AVX2_ENV, ISA_ENV, isa_env_missing, parse_args

    for name in AVX2_ENV:
        monkeypatch.delenv(name, raising=False)
    assert isa_env_missing("avx2") == AVX2_ENV and isa_env_missing("native") == {}
    monkeypatch.setenv("GPTLAB_KERNELS", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "AVX2")  # ignored by PyTorch, which wants "avx2"
    assert isa_env_missing("avx2") == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    # the first Xeon's level: AVX-512 kernels, oneDNN without AMX or bf16, MKL at Ice Lake's level
    assert isa_env_missing("avx512-vnni") == {
        "GPTLAB_KERNELS": "avx512", "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "MKL_ENABLE_INSTRUCTIONS": "AVX512_E2",
    }  # fmt: skip
    assert set(ISA_ENV["avx512-vnni"]) == set(AVX2_ENV)  # the results record every level's settings by AVX2_ENV's names
    assert parse_args(["--peer", "llama.cpp", "--peer-isa", "avx2"]).peer_isa == "avx2"
    assert parse_args(["--peer", "llama.cpp", "--peer-isa", "avx512-vnni"]).peer_isa == "avx512-vnni"
    assert parse_args([]).peer_isa == "native"


def test_building_without_cmake_says_so_before_downloading(monkeypatch, tmp_path):
    from gptlab.bench.llamacpp import ensure_built

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="needs cmake"):
        ensure_built(cache=tmp_path)
    assert not any(tmp_path.iterdir())


def test_failed_llamacpp_step_names_the_step_and_shows_the_output_tail():
    import sys

    from gptlab.bench.llamacpp import run_step

    script = "import sys; print('\\n'.join(f'line {i}' for i in range(100))); sys.exit('boom')"
    with pytest.raises(RuntimeError, match=r"(?s)building llama.cpp failed \(exit 1\).*line 99\nboom") as err:
        run_step("building llama.cpp", [sys.executable, "-c", script])
    assert "line 50" not in str(err.value)  # the tail only
    with pytest.raises(RuntimeError, match="configuring llama.cpp.*cannot run"):
        run_step("configuring llama.cpp (cmake)", ["/nonexistent/cmake"])


def test_peer_llamacpp_refuses_other_modes_before_building():
    with pytest.raises(ValueError, match="int8-dyn"):
        main(["--peer", "llama.cpp", "--modes", "fp32,int8-dyn"])


# llama-bench -m q4.gguf -p 0 -n 128 -t 2 -r 2 -o json, llama.cpp 0c1e570, a 3M-parameter gpt2 on a busy 2-core VM
LLAMA_BENCH_SAMPLE = """[
  {
    "build_commit": "0c1e570",
    "build_number": 0,
    "cpu_info": "Intel(R) Xeon(R) Processor",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "q4.gguf",
    "model_type": "gpt2 ?B Q4_0",
    "model_size": 2133860,
    "model_n_params": 3382080,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 128,
    "n_depth": 0,
    "test_time": "2026-11-30T19:35:42Z",
    "avg_ns": 29588226148,
    "stddev_ns": 2138651789,
    "avg_ts": 4.337375,
    "stddev_ts": 0.313508,
    "samples_ns": [ 31100481322, 28075970975 ],
    "samples_ts": [ 4.11569, 4.55906 ]
  }
]
"""


@needs_kernels
def test_bench_variants_runs_each_variant_and_rates_it_against_autos(tmp_path, capsys, monkeypatch):
    from gptlab.bench import variants

    seen = []  # the variant each timed generate call ran under
    engine = variants.gptlab_engine

    def spying_engine(model):
        run = engine(model)

        def spy(idx, n):
            seen.append(kernels.variant())
            return run(idx, n)

        return spy

    monkeypatch.setattr(variants, "gptlab_engine", spying_engine)
    monkeypatch.delenv("GPTLAB_GEMM", raising=False)
    runnable = kernels.runnable_variants()
    args = ["--preset", "gpt2-tiny", "--modes", "fp32,int8", "--variants", ",".join(runnable), "--new-tokens", "3",
            "--prompt-len", "5", "--rounds", "2", "--gemm-rows", "16", "--out", str(tmp_path)]  # fmt: skip
    assert variants.main(args) == 0
    assert "GPTLAB_GEMM" not in os.environ  # the head GEMM's timings set it, and put it back
    assert sorted(set(seen)) == sorted(runnable)
    (path,) = tmp_path.glob("variants-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["mode"], r["variant"]) for r in rows] == [
        (m, v) for m in ("fp32", "int8", "head GEMM") for v in runnable
    ]
    assert all(r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 for r in rows[: 2 * len(runnable)])
    out = capsys.readouterr().out
    assert f"auto takes {kernels.auto_variant()}" in out
    assert out.count("<- auto") == 3 and out.count("(1.00x)  <- auto") == 3
    monkeypatch.setattr(kernels, "cpu_features", lambda: frozenset())
    with pytest.raises(SystemExit, match="this CPU cannot run 'avx2'"):
        variants.main(["--variants", "avx2"])


@needs_kernels
def test_bench_variants_times_each_prefetch_hint_it_is_given(tmp_path, capsys, monkeypatch):
    """NAME:nta and NAME:t0 run the variant with decoding's prefetch hint set, rated against the
    first when auto's variant is not among them."""
    from gptlab.bench import variants

    seen = []  # (variant, hint) of each timed generate call
    engine = variants.gptlab_engine

    def spying_engine(model):
        run = engine(model)

        def spy(idx, n):
            seen.append((kernels.variant(), kernels.prefetch_nta()))
            if kernels.prefetch_nta():
                time.sleep(0.05)  # :nta clearly slower, so only the base can print 1.00x
            return run(idx, n)

        return spy

    monkeypatch.setattr(variants, "gptlab_engine", spying_engine)
    default = kernels.prefetch_nta()
    name = "portable"  # every CPU runs it
    args = ["--preset", "gpt2-tiny", "--modes", "fp32", "--variants", f"{name}:t0,{name}:nta", "--new-tokens", "3",
            "--prompt-len", "0", "--rounds", "1", "--gemm-rows", "0", "--out", ""]  # fmt: skip
    assert variants.main(args) == 0
    assert set(seen) == {(name, False), (name, True)}
    assert kernels.prefetch_nta() is default  # the default again
    out = capsys.readouterr().out
    base, other = [line for line in out.splitlines() if f" {name}:" in line]
    assert f"{name}:t0 " in base and base.endswith("(1.00x)")  # the first is the base
    assert not other.endswith("(1.00x)")
    with pytest.raises(SystemExit, match=":nta or :t0"):
        variants.main(["--variants", f"{name}:l2"])


@needs_kernels
def test_bench_gemm_times_both_sides_and_the_bf16_products_where_they_run(tmp_path, capsys, monkeypatch):
    from gptlab import gemm
    from gptlab.bench import gemm as bench_gemm

    calls, sgemm_linear = [], gemm.sgemm_linear
    monkeypatch.setattr(gemm, "sgemm_linear", lambda *a: calls.append(1) or sgemm_linear(*a))
    argv = ["--vocab", "300", "--rows", "16", "--width", "8", "--rounds", "1", "--layer-rows", "9",
            "--out", str(tmp_path)]  # fmt: skip
    assert bench_gemm.main(argv) == 0
    assert (
        len(calls) == 2 * (1 + 2048 // 9) * 4
    )  # fp32 and bf16: a warm-up and a round's reps of 4 layers, gptlab's side only
    (path,) = tmp_path.glob("gemm-*.json")
    results = json.loads(path.read_text())
    assert [r["product"] for r in results["products"]] == list(bench_gemm.PRODUCTS)
    layers = results["block_layers"]
    assert [(r["rows"], r["weights"]) for r in layers] == [(9, "float32"), (9, "bfloat16")]
    assert all(r["speedup"] == pytest.approx(r["torch_ms"] / r["gptlab_ms"], rel=0.01) for r in layers)
    assert all(r["gptlab_ms"] > 0 and r["torch_ms"] > 0 for r in results["products"])
    bf16 = gemm.gemm_bf16_runs()
    assert results["bf16_products"] == ("gl_gemm_bf16" if bf16 else "torch")
    assert ("products_bf16" in results) == bf16
    assert ("gl_gemm_bf16 against torch bf16" in capsys.readouterr().out) == bf16


def test_make_bench_runs_benchmarks_whose_options_exist():
    """`make bench` (the README's speed tables for this machine): every `gptlab bench NAME ...` it
    runs parses with that benchmark's own options, so a renamed flag fails here, not in a 40-minute run."""
    import importlib
    import re
    import shlex

    root = Path(__file__).resolve().parents[1]
    text = subprocess.run(["make", "-n", "-W", ".venv/.installed", "bench", "NANOGPT_DIR=/nanogpt"], cwd=root,
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    runs = re.findall(r"-m gptlab bench (\w+) ([^;\n]*)", text)
    assert [name for name, _ in runs] == ["generate", "generate", "generate", "serve", "train", "gemm", "variants", "nanogpt",
                                          "summary"]  # fmt: skip
    for name, options in runs:
        argv = shlex.split(options.replace("$V", "avx2").rstrip("\\ "))
        importlib.import_module(f"gptlab.bench.{name}").parse_args(argv)  # SystemExit on an unknown option


# --- gptlab bench serve: the server against generate()


def test_bench_serve_times_the_server_against_generate_and_checks_its_tokens(tmp_path, capsys):
    """A real `gptlab serve` subprocess on a tiny model: each row's ratio is the server's rate over
    generate()'s, and every completion is generate()'s greedy tokens."""
    from gptlab.bench import serve
    from gptlab.checkpoint import save_model

    save_model(tiny_model(vocab_size=257, block_size=64), tmp_path / "tiny", tokenizer="byte")
    argv = ["--model", str(tmp_path / "tiny"), "--mode", "fp32", "--new-tokens", "12", "--prompt-len", "4",
            "--clients", "3", "--rounds", "1", "--threads", "1", "--out", str(tmp_path)]  # fmt: skip
    assert serve.main(argv) == 0
    (path,) = tmp_path.glob("serve-*.json")
    results = json.loads(path.read_text())
    assert [r["row"] for r in results["rows"]] == [
        "1 client, non-streaming",
        "1 client, streaming",
        "3 clients at once",
    ]
    for row in results["rows"]:
        server, generate = row["server_tok_s"], row["generate_tok_s"]  # rounded to 0.1, the ratio to 0.001
        rounding = 5e-4 + server / generate * (0.05 / server + 0.05 / generate)  # 2,483.0 / 312.0: 1.4e-3
        assert server > 0 and row["ratio"] == pytest.approx(server / generate, abs=rounding)
    assert results["mismatches"] == {} and "1 decoding thread" in results["settings"]["server"]
    assert "token ids: as generate() gives them" in capsys.readouterr().out


def test_bench_serve_says_why_the_server_refused_a_completion():
    """A 4xx from the server is a ValueError with the message of its OpenAI-style body (it was
    urllib's bare "HTTP Error 400: Bad Request" for a prompt past the model's positions)."""
    import http.server
    import threading

    from gptlab.bench import serve

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.dumps({"error": {"message": "maximum context length is 128 tokens", "type": "x"}}).encode()
            self.send_response(400)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}"
        with pytest.raises(ValueError, match=r"refused the completion \(HTTP 400\): maximum context length is 128"):
            serve.complete(url, [1, 2], 200, stream=False)
    finally:
        httpd.shutdown()


def test_bench_serve_tells_a_near_tie_from_a_wrong_token():
    """Where a completion leaves generate()'s greedy tokens, the margin is how much generate()'s
    logits prefer its own token there: ~0 at a tie, large for a token the model ranks low."""
    from gptlab.bench.serve import NEAR_TIE, difference

    model, prompt = tiny_model(), [1, 2, 3]
    want = generate_greedy(model, prompt, 5)
    assert difference(model, prompt, want, want) is None
    with torch.no_grad():
        logits, _ = model(torch.tensor([prompt + want[:2]]))  # (1, T, V)
    worst = int(logits[0, -1].argmin())
    wrong = want[:2] + [worst] + want[3:]
    margin = difference(model, prompt, wrong, want)
    assert margin == pytest.approx(float(logits[0, -1].max() - logits[0, -1, worst]), abs=1e-5)
    assert margin > NEAR_TIE["fp32"] and difference(model, prompt, want[:4], want) == float("inf")


def generate_greedy(model, prompt, n):
    from gptlab.generation import generate

    return generate(model, [prompt], n, temperature=0)[0][len(prompt) :]


# --- gptlab bench summary: the speed tables' figures from the results files


def _result(out, name, stamp, machine, **fields):
    (out / f"{name}-{stamp}.json").write_text(
        json.dumps({"benchmark": name, "time": stamp, "machine": machine, **fields})
    )


def _llamacpp_rows(decode, prefill, tok_s, modes=("fp32", "bf16", "int8", "int4")):
    return [{"mode": m, "decode_ratio": d, "prefill_ratio": p, "gptlab_decode_tok_s": t}
            for m, d, p, t in zip(modes, decode, prefill, tok_s, strict=True)]  # fmt: skip


def test_bench_summary_gives_each_machines_latest_figures(tmp_path, capsys, monkeypatch):
    """Each machine's latest run of each kind, with its file: not an older run, not a run at depth,
    with fewer precisions or on fewer threads than cores, and a run held to AVX2 on the same CPU as
    a machine of its own."""
    from gptlab.bench import common, summary

    zen5 = {"cpu": "AMD EPYC", "cpu_family_model": "26/2", "gptlab_kernels": "avx512", "cpu_capability": "AVX512"}
    held = {**zen5, "gptlab_kernels": "avx2", "cpu_capability": "AVX2"}
    full = _llamacpp_rows((1.1, 1.2, 1.3, 1.4), (1.5, 1.6, 1.7, 1.8), (100.0, 190.0, 400.0, 700.0))
    same = (0.5,) * 4
    peer = "generate-llamacpp"
    _result(tmp_path, peer, "2026-12-01T00:00:00", zen5, rows=_llamacpp_rows(same, same, same))  # older
    _result(tmp_path, peer, "2026-12-02T00:00:00", zen5, settings={"depth": 0}, rows=full)
    _result(tmp_path, peer, "2026-12-03T00:00:00", zen5, settings={"depth": 895}, rows=_llamacpp_rows(same, same, same))
    _result(tmp_path, peer, "2026-12-04T00:00:00", zen5, rows=_llamacpp_rows((8.0,), (8.0,), (8.0,), ("fp32",)))
    one_core = {**zen5, "cores": 2}  # a later full run on 1 of the 2 cores: not the table's setting
    _result(
        tmp_path,
        peer,
        "2026-12-04T06:00:00",
        one_core,
        settings={"threads": 1},
        rows=_llamacpp_rows((9.0,) * 4, (9.0,) * 4, (90.0,) * 4),
    )
    _result(tmp_path, peer, "2026-12-05T00:00:00", held, rows=_llamacpp_rows((2.0,) * 4, (2.1,) * 4, (50.0,) * 4))
    versus = {"fp32_eager_decode_vs_transformers": 2.5, "fp32_eager_prefill_vs_transformers": 1.75}
    _result(tmp_path, "generate", "2026-12-02T00:00:00", zen5, summary=versus)
    _result(tmp_path, "generate", "2026-12-03T00:00:00", zen5, summary={})  # a run without the fp32 rows
    _result(tmp_path, "nanogpt", "2026-12-02T00:00:00", zen5, ratio=4.0)
    _result(tmp_path, "nanogpt", "2026-12-01T00:00:00", zen5, ratio=3.0)
    trained = [{"dtype": "bfloat16", "ratio": 9.0}, {"dtype": "float32", "ratio": 3.25}]
    _result(tmp_path, "train", "2026-12-02T00:00:00", zen5, results=trained)
    (tmp_path / "notes.json").write_text("[1, 2]")  # not a result: skipped

    table = summary.summarize(summary.load_results(tmp_path))
    assert list(table) == [summary.machine_key(zen5), summary.machine_key(held)]
    assert table[summary.machine_key(zen5)] == {
        "decode vs llama.cpp": ("1.10 / 1.20 / 1.30 / 1.40x", "generate-llamacpp-2026-12-02T00:00:00"),
        "prefill 512 vs llama.cpp": ("1.50 / 1.60 / 1.70 / 1.80x", "generate-llamacpp-2026-12-02T00:00:00"),
        "int4 / bf16 decode vs gptlab's fp32": ("7.00 / 1.90x", "generate-llamacpp-2026-12-02T00:00:00"),
        "default path vs transformers": ("2.50 / 1.75x", "generate-2026-12-02T00:00:00"),
        "training vs nanoGPT": ("4.00x", "nanogpt-2026-12-02T00:00:00"),
        "training vs transformers (fp32)": ("3.25x", "train-2026-12-02T00:00:00"),
    }
    assert table[summary.machine_key(held)]["decode vs llama.cpp"][0] == "2.00 / 2.00 / 2.00 / 2.00x"

    monkeypatch.setattr(common, "machine", lambda: held)
    assert summary.main(["--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "kernels avx2, ATen AVX2" in out and "2.10 / 2.10 / 2.10 / 2.10x" in out and "avx512" not in out
    assert summary.main(["--results", str(tmp_path), "--all", "--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].count(" | ") == 2 and lines[2].startswith("| decode vs llama.cpp | 1.10 / 1.20 / 1.30 / 1.40x (`")
    monkeypatch.setattr(common, "machine", lambda: {**zen5, "cpu": "Intel(R) Xeon(R)"})
    assert summary.main(["--results", str(tmp_path)]) == 1
    assert "no results for this machine (Intel(R) Xeon(R) (26/2)" in capsys.readouterr().out


# A later run made otherwise than make bench makes the README's rows: (benchmark, where it records
# its settings, the settings), each of which once replaced the row it does not measure
NOT_AS_MAKE_BENCH = [
    ("generate", "settings", {"preset": "gpt2-tiny", "new_tokens": 4}),
    ("generate", "settings", {"prompt_len": 8}),
    ("generate", "settings", {"repeats": 1}),
    ("train", "config", {"n_layer": 1}),
    ("train", "config", {"batch_size": 2, "block_size": 16}),
    ("train", "config", {"rounds": 1}),
    ("nanogpt", "config", {"seconds": 5.0}),
    ("generate-llamacpp", "settings", {"preset": "gpt2-medium"}),
    ("generate-llamacpp", "settings", {"peer_isa": "avx2", "isa_env": {}}),  # gptlab not held to AVX2
    ("generate-llamacpp", "settings", {"peer_isa": "avx2", "isa_env": {"GPTLAB_KERNELS": "avx2"}}),
    ("generate-llamacpp", "settings", {"kv_cache": "float32"}),
    ("generate-llamacpp", "settings", {"repeats": 1}),
]


@pytest.mark.parametrize("benchmark, section, settings", NOT_AS_MAKE_BENCH)
def test_bench_summary_counts_only_runs_made_as_make_bench(benchmark, section, settings, tmp_path):
    """A tiny `bench generate --preset gpt2-tiny --new-tokens 4` gave the default path's row
    58173356.60 / 0.37x, a `bench train --n-layer 1` the training row: only a run with each
    command's default shapes and at least make bench's repeats counts (a setting an older file
    lacks is its default), and a llama.cpp built for a lower level only against gptlab held to it."""
    from gptlab.bench import summary
    from gptlab.bench.generate import ISA_ENV

    zen5 = {"cpu": "AMD EPYC", "cpu_family_model": "26/2", "gptlab_kernels": "avx512", "cpu_capability": "AVX512",
            "cores": 2, "isa_settings": {}}  # fmt: skip
    figures = {
        "generate-llamacpp": {"rows": _llamacpp_rows((1.1,) * 4, (1.2,) * 4, (100.0,) * 4)},
        "generate": {"summary": {"fp32_eager_decode_vs_transformers": 2.5, "fp32_eager_prefill_vs_transformers": 1.75}},
        "nanogpt": {"ratio": 4.0},
        "train": {"results": [{"dtype": "float32", "ratio": 3.25}]},
    }
    made = {  # as make bench runs them, with what each records (older files: nothing)
        "generate-llamacpp": {"settings": {"preset": "gpt2", "depth": 0, "kv_cache": "auto", "repeats": 3,
                                           "threads": 2, "peer_isa": "native", "isa_env": {}}},
        "generate": {"settings": {"preset": "gpt2", "prompt_len": 64, "new_tokens": 256, "repeats": 3}},
        "nanogpt": {"config": {"seconds": 60.0}},
        "train": {"config": {"batch_size": 16, "block_size": 128, "n_layer": 4, "n_embd": 128, "n_head": 4,
                             "vocab_multiple": 1, "rounds": 3, "steps": 2}},
    }  # fmt: skip
    for name, fields in figures.items():
        _result(tmp_path, name, "2026-12-01T00:00:00", zen5, **fields)  # an older file, recording no settings
        _result(tmp_path, name, "2026-12-02T00:00:00", zen5, **fields, **made[name])
    expected = summary.summarize(summary.load_results(tmp_path))
    assert {file for _, file in expected[summary.machine_key(zen5)].values()} == {
        f"{name}-2026-12-02T00:00:00" for name in figures
    }
    later = {"generate-llamacpp": {"rows": _llamacpp_rows((9.0,) * 4, (9.0,) * 4, (9.0,) * 4)},
             "generate": {"summary": {"fp32_eager_decode_vs_transformers": 9.0, "fp32_eager_prefill_vs_transformers": 9.0}},
             "nanogpt": {"ratio": 9.0}, "train": {"results": [{"dtype": "float32", "ratio": 9.0}]}}  # fmt: skip
    recorded = {**made[benchmark][section], **settings}
    _result(tmp_path, benchmark, "2026-12-03T00:00:00", zen5, **later[benchmark], **{section: recorded})
    assert summary.summarize(summary.load_results(tmp_path)) == expected
    # the same run made as make bench makes it counts; one held to AVX2 counts as that machine's
    _result(tmp_path, benchmark, "2026-12-04T00:00:00", zen5, **later[benchmark], **made[benchmark])
    assert summary.summarize(summary.load_results(tmp_path)) != expected
    if benchmark == "generate-llamacpp":
        held = {**zen5, "gptlab_kernels": "avx2", "isa_settings": ISA_ENV["avx2"]}
        as_held = {**made[benchmark]["settings"], "peer_isa": "avx2", "isa_env": ISA_ENV["avx2"]}
        _result(tmp_path, benchmark, "2026-12-05T00:00:00", held, **later[benchmark], settings=as_held)
        table = summary.summarize(summary.load_results(tmp_path))
        assert table[summary.machine_key(held)]["decode vs llama.cpp"][0] == "9.00 / 9.00 / 9.00 / 9.00x"


MALFORMED = [  # (benchmark, what the file has, what the warning says), each once a traceback
    ("generate-llamacpp", {"machine": "x"}, 'machine is "x", not an object'),
    ("generate-llamacpp", {"machine": None}, "machine is null, not an object"),
    ("generate-llamacpp", {"settings": None}, "settings is null, not an object"),
    ("generate-llamacpp", {"rows": None}, "rows is null, not a list of objects"),
    ("generate-llamacpp", {"rows": {"fp32": {"decode_ratio": 9.9}}}, "not a list of objects"),
    ("generate-llamacpp", {"rows": [{"decode_ratio": 9.9}]}, "an entry of rows has no mode"),
    ("generate-llamacpp", {"rows": [{"mode": "int4", "decode_ratio": 9.9, "prefill_ratio": 9.9}]},
     "an entry of rows has no gptlab_decode_tok_s"),
    ("generate-llamacpp", {"rows": _llamacpp_rows(("1.2",), (9.9,), (9.9,), ("fp32",))}, 'decode_ratio is "1.2", not a number'),
    ("generate", {"summary": None}, "summary is null, not an object"),
    ("generate", {"summary": {"fp32_eager_decode_vs_transformers": "fast"}}, "not a number"),
    ("nanogpt", {"ratio": [4.0]}, "ratio is [4.0], not a number"),
    ("train", {"results": [{"dtype": "float32", "ratio": True}]}, "ratio is true, not a number"),
    ("train", {"config": [], "results": []}, "config is [], not an object"),
    ("train", {"time": 12345}, "time 12345 is not an ISO 8601 date"),
]  # fmt: skip


@pytest.mark.parametrize("benchmark, fields, message", MALFORMED)
def test_bench_summary_skips_a_malformed_result_saying_what_is_wrong(benchmark, fields, message, tmp_path, caplog):
    """A results file with the keys of a result but another shape (a machine that is a string,
    rows that are null or a dict, a row without its mode, a figure in a string, a time that is a
    number among the others' dates) crashed the whole summary: it is skipped with a warning naming
    it, and the table comes from the other files."""
    from gptlab.bench import summary

    zen5 = {"cpu": "AMD EPYC", "cpu_family_model": "26/2", "gptlab_kernels": "avx512", "cpu_capability": "AVX512"}
    _result(tmp_path, "generate-llamacpp", "2026-12-01T00:00:00", zen5,
            rows=_llamacpp_rows((1.1,) * 4, (1.2,) * 4, (100.0,) * 4))  # fmt: skip
    _result(tmp_path, "train", "2026-12-01T00:00:00", zen5, results=[{"dtype": "float32", "ratio": 3.25}])
    expected = summary.summarize(summary.load_results(tmp_path))
    fields = {"machine": zen5, **fields}
    _result(tmp_path, benchmark, "2026-12-02T00:00:00", fields.pop("machine"), **fields)
    with caplog.at_level("WARNING"):
        assert summary.summarize(summary.load_results(tmp_path)) == expected
    assert f"skipped {tmp_path / benchmark}-2026-12-02T00:00:00.json: " in caplog.text and message in caplog.text


def test_bench_summary_orders_results_by_their_time_whatever_its_zone(tmp_path):
    """Times compared as text put 13:00+05:00 (08:00 UTC) after 12:00 UTC."""
    from gptlab.bench import summary

    zen5 = {"cpu": "AMD EPYC", "cpu_family_model": "26/2", "gptlab_kernels": "avx512", "cpu_capability": "AVX512"}
    _result(tmp_path, "nanogpt", "2026-12-01T12:00:00+00:00", zen5, ratio=4.0)
    _result(tmp_path, "nanogpt", "2026-12-01T13:00:00+05:00", zen5, ratio=3.0)
    _result(tmp_path, "nanogpt", "2026-12-01T11:00:00", zen5, ratio=2.0)  # no zone: UTC, as write_results writes
    table = summary.summarize(summary.load_results(tmp_path))
    assert table[summary.machine_key(zen5)]["training vs nanoGPT"][0] == "4.00x"


def test_bench_summary_says_the_results_directory_does_not_exist(tmp_path, capsys):
    from gptlab.cli import main as cli

    assert cli(["bench", "summary", "--results", str(tmp_path / "nope")]) == 2
    assert f"--results {tmp_path / 'nope'}: no such directory" in capsys.readouterr().err


def test_bench_summary_asks_for_each_commands_defaults():
    """The settings the summary counts are each command's defaults (or, for repeats, rounds and
    seconds, at most them): a changed default fails here, not silently in the README's rows."""
    from gptlab.bench import generate, nanogpt, summary, train

    parsed = {"generate": generate.parse_args([]), "generate-llamacpp": generate.parse_args(["--peer", "llama.cpp"]),
              "train": train.parse_args([]), "nanogpt": nanogpt.parse_args(["--nanogpt-dir", "x"])}  # fmt: skip
    for name, (_, wanted) in summary.MADE_AS_MAKE_BENCH.items():
        for key, want in wanted.items():
            default = getattr(parsed[name], key)
            assert default >= want if isinstance(want, summary.AtLeast) else default == want, (name, key)


def test_bench_summary_keeps_a_run_with_its_libraries_held_apart(tmp_path, monkeypatch, capsys):
    """A run with oneDNN and MKL held below the CPU's level (a stand-in for an older CPU: the same
    kernel variant and ATen level) is a machine of its own, recorded by machine() or, in results
    written before it recorded them, by the llama.cpp bench's isa_env; this machine's column is
    the run under the settings this process has."""
    from gptlab import machine_cache
    from gptlab.bench import common, summary

    xeon = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_family_model": "6/207", "gptlab_kernels": "avx512",
            "cpu_capability": "AVX512", "isa_settings": {}}  # fmt: skip
    held = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "MKL_ENABLE_INSTRUCTIONS": "AVX512_E2"}
    peer = "generate-llamacpp"
    _result(tmp_path, peer, "2026-12-06T10:00:00", xeon, rows=_llamacpp_rows((1.3,) * 4, (1.5,) * 4, (80.0,) * 4))
    _result(tmp_path, peer, "2026-12-06T11:00:00", {**xeon, "isa_settings": {**held, "GPTLAB_KERNELS": "avx512"}},
            rows=_llamacpp_rows((1.1,) * 4, (1.2,) * 4, (80.0,) * 4))  # fmt: skip
    old = {k: v for k, v in xeon.items() if k != "isa_settings"}  # written before machine() recorded them
    _result(tmp_path, peer, "2026-12-06T12:00:00", old, settings={"isa_env": {"ONEDNN_MAX_CPU_ISA": "AVX2"}},
            rows=_llamacpp_rows((0.9,) * 4, (0.8,) * 4, (80.0,) * 4))  # fmt: skip
    table = summary.summarize(summary.load_results(tmp_path))
    native, stand_in = summary.machine_key(xeon), summary.machine_key({**xeon, "isa_settings": held})
    assert stand_in == native + " ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI MKL_ENABLE_INSTRUCTIONS=AVX512_E2"
    assert len(table) == 3 and table[native]["decode vs llama.cpp"][0] == "1.30 / 1.30 / 1.30 / 1.30x"
    assert table[stand_in]["decode vs llama.cpp"][0] == "1.10 / 1.10 / 1.10 / 1.10x"
    for name in machine_cache.ISA_SETTINGS:  # whatever this process runs under (make masquerade-check holds ATen)
        monkeypatch.delenv(name, raising=False)
    for name, value in held.items():
        monkeypatch.setenv(name, value)
    assert common.held_settings() == held
    monkeypatch.setattr(common, "machine", lambda: {**xeon, "isa_settings": common.held_settings()})
    assert summary.main(["--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1.10 / 1.10 / 1.10 / 1.10x" in out and "1.30 /" not in out and "0.90 /" not in out


@pytest.mark.parametrize("flags", ["fpu sse2 avx2", "fpu sse2 avx2 avx_ne_convert", "fpu sse2 avx512_bf16 amx_bf16"])
def test_bench_generate_asks_gptlab_cpu_whether_bf16_is_native(flags, monkeypatch):
    """The bench's bf16 rows against transformers run where training's precision choice and the
    prompts' GEMM would see native bf16 (cpu.BF16_FLAGS, AVX-NE-CONVERT included), and the
    skip names the flags it looked for."""
    monkeypatch.setattr(cpu, "cpuinfo", lambda field: flags if field == "flags" else "")
    native, why = cpu_has_native_bf16()
    assert native == cpu.may_have_native_bf16() == (flags != "fpu sse2 avx2")
    if native:
        assert all(f in why for f in flags.split() if f in cpu.BF16_FLAGS)
    else:
        assert "avx512_bf16/amx_bf16/avx_ne_convert" in why


def test_bench_nanogpt_refuses_a_wall_time_of_zero_or_less_as_the_flag_is_read(tmp_path, capsys):
    """--seconds 0 ran nanoGPT for minutes, then died on gptlab train's refusal of max_time=0.0s."""
    from gptlab.cli import main as cli

    for seconds in ("0", "-5", "nan"):
        with pytest.raises(SystemExit) as exit:
            cli(["bench", "nanogpt", "--nanogpt-dir", str(tmp_path), "--seconds", seconds])
        assert exit.value.code == 2
        assert f"argument --seconds: must be more than 0 seconds, got {seconds}" in capsys.readouterr().err


def test_bench_nanogpt_says_why_gptlab_train_failed(tmp_path):
    """`gptlab train` failing was a CalledProcessError traceback, its stderr captured and dropped:
    now an error with the last lines of what it said."""
    from gptlab.bench import nanogpt

    (tmp_path / "data").mkdir()
    with pytest.raises(
        ValueError, match=r"gptlab train failed \(exit 2\): gptlab train: error: .*no readable manifest"
    ):
        nanogpt.run_gptlab(tmp_path / "data", tmp_path / "work", 5.0)


def test_a_failed_child_is_named_with_the_last_lines_it_wrote(capfd):
    import sys

    from gptlab.bench.common import run_child

    script = "import sys; print('out'); [print(f'line {i}', file=sys.stderr) for i in range(20)]; sys.exit('boom')"
    with pytest.raises(ValueError, match=r"^child failed \(exit 1\): line 13 / line 14 .* line 19 / boom$"):
        run_child("child", [sys.executable, "-c", script], quiet=True)
    assert capfd.readouterr().out == ""  # quiet: nothing passed on
    run_child("child", [sys.executable, "-c", "import sys; print('out'); print('note', file=sys.stderr)"])
    assert capfd.readouterr() == ("out\n", "note\n")  # passed on as it runs


def test_bench_recipes_names_a_bad_run_or_points(tmp_path, capsys):
    """--points without its step time was a KeyError, a malformed one an unpacking error,
    --runs naming a directory without evaluations plotted an empty curve and exited 0, and --data
    without prepared data a CalledProcessError traceback after gptlab train started."""
    from gptlab.cli import main as cli

    (tmp_path / "empty").mkdir()
    cases = [(["--points", "x=600:5.0"], "give its step time with --step-seconds x=SECONDS"),
             (["--points", "x=600", "--step-seconds", "x=0.2"], "expected STEP:LOSS pairs"),
             (["--runs", f"a={tmp_path / 'empty'}"], "no evaluations"),
             (["--data", str(tmp_path / "nope")], "no train.bin there")]  # fmt: skip
    for argv, message in cases:
        assert cli(["bench", "recipes", *argv, "--plot", str(tmp_path / "p.png"), "--out", ""]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()
