"""make mutants: plant realistic bugs one at a time and report which tests catch each.

Each mutant names a file under src/gptlab, an exact snippet and its replacement. The source and
tests are copied to a temporary directory once; each mutant is written into that copy, only the
test files relevant to it run there (PYTHONPATH points at the copy), and the file is restored.
The working tree is never touched, so this runs while others edit it, nor is the user's
gptlab cache (the copy has its own), so it runs beside `make test` too.

A mutant is "caught" when a test fails (the first failing test is named), "MISSED" when every
test passes, and "stale" when its snippet is not found exactly once (the code moved: update the
snippet). The tests are first run once unmutated; a failure there is reported as "baseline
failing" and makes its mutants' results meaningless.

    python bench/mutants.py              # all mutants
    python bench/mutants.py -k sampling  # those whose name contains "sampling"
    python bench/mutants.py --list

Exit status 0 when every mutant is caught, 1 otherwise.
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SAMPLING_TESTS = ("tests/test_sampling_semantics.py", "tests/test_generate.py", "tests/test_sampling*.py")
TRAIN_TESTS = ("tests/test_train*.py",)
KV_TESTS = ("tests/test_model.py", "tests/test_generate.py")
LOSS_TESTS = ("tests/test_model.py", "tests/test_chunked_loss.py", "tests/test_data.py")
HF_TESTS = ("tests/test_hf.py", "-k", "parity or round_trip or layouts or to_gptlab")
QUANTIZE_TESTS = ("tests/test_quantize.py",)
INT8_PROMPT_TESTS = ("tests/test_int8_prompts.py", "tests/test_quantize.py")
FUSED_TESTS = ("tests/test_fused_step.py", "tests/test_kernels.py")
HARNESS_TESTS = ("tests/test_harness.py", "-k", "equals")
HOOKS_TESTS = ("tests/test_hooks.py",)
GEMM_TESTS = ("tests/test_gemm.py",)
PROBE_TESTS = ("tests/test_gemm_probe.py",)
PREFETCH_TESTS = ("tests/test_kernel_variants.py", "-k", "prefetch")
COMPILE_CACHE_TESTS = ("tests/test_compile_cache.py",)
LLAMACPP_BUILD_TESTS = ("tests/test_bench.py", "-k", "llamacpp")
INSTRUCTION_TESTS = ("tests/test_kernel_variants.py", "-k", "instructions")  # objdump of each library
C_CHECK_TESTS = ("tests/test_kernel_variants.py", "-k", "c_check")  # tests/c/kernel_check.c, make neon-check's
SERVE_LMEVAL_TESTS = ("tests/test_serve_tokenize.py", "tests/test_serve.py", "-k", "offset or logprobs or echo")


@dataclass(frozen=True)
class Mutant:
    name: str  # area/what: the bug, as a reviewer would name it
    file: str  # under src/gptlab
    old: str  # an exact snippet, found exactly once
    new: str
    tests: tuple[str, ...]  # test files (globs) and pytest options
    variant: str = ""  # a kernel variant (gptlab.kernel_build) the CPU must run for the tests to reach the bug
    feature: str = ""  # a CPU feature (gptlab.kernels.FEATURES) the tests need to reach the bug


# fmt: off
MUTANTS = [
    Mutant("gemm-probe/auto-keyed-apart-from-unset", "machine_cache.py",
           "and value.strip().lower() not in DEFAULT_VALUES.get(name, ())", "", COMPILE_CACHE_TESTS),
    # the llama.cpp peer's build
    Mutant("bench/llamacpp-amx-fix-never-written", "bench/llamacpp.py",
           "            path.write_text(text.replace(fix.old, fix.new))", "            pass", LLAMACPP_BUILD_TESTS),
    Mutant("bench/llamacpp-build-before-the-fix-reused", "bench/llamacpp.py",
           "    return built if fixed and built.is_complete() else None", "    return built if built.is_complete() else None",
           LLAMACPP_BUILD_TESTS),
    Mutant("bench/llamacpp-avx512-vnni-keeps-amx", "bench/llamacpp.py",
           '"AVX_VNNI AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16 AMX_TILE AMX_INT8 AMX_BF16"',
           '"AVX_VNNI AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16"', LLAMACPP_BUILD_TESTS),
    Mutant("bench/llamacpp-level-needs-unchecked", "bench/llamacpp.py",
           "    missing = ISA_NEEDS[isa] - set(cpu_flags())", "    missing = set()", LLAMACPP_BUILD_TESTS),
    Mutant("bench/summary-ignores-held-libraries", "bench/summary.py",
           '    return " ".join([key, *(f"{name}={held[name]}" for name in HELD_IN_KEY if held.get(name))])',
           "    return key", ("tests/test_bench.py", "-k", "summary")),
    Mutant("bench/summary-ignores-older-isa-env", "bench/summary.py",
           '    held = machine.get("isa_settings", (settings or {}).get("isa_env") or {})',
           '    held = machine.get("isa_settings", {})', ("tests/test_bench.py", "-k", "summary")),
    Mutant("bench/out-empty-written-into-the-working-directory", "bench/common.py",
           "    if not str(out_dir):\n        return None\n", "", ("tests/test_bench.py", "-k", "with_out_empty")),
    # the training head's bf16 products in PyTorch: kept buffers
    Mutant("loss/bf16-product-into-a-fresh-tensor", "chunked_loss.py",
           "logits = out.copy_(torch.mm(w, x_c.t().contiguous(), out=product))", "logits = out.copy_(w @ x_c.t().contiguous())",
           LOSS_TESTS),
    Mutant("loss/bf16-e-left-in-fp32", "chunked_loss.py",
           "                if mm_dtype != torch.float32:  # rounded", "                if False:  # rounded", LOSS_TESTS),
    Mutant("loss/bf16-buffer-never-kept", "chunked_loss.py",
           "buf = _WORKSPACE[device, dtype] = torch.empty", "buf = torch.empty", LOSS_TESTS),
    # sampling
    Mutant("sampling/draw-not-scaled-to-the-rows-mass", "sampling.py",
           "torch.searchsorted(cdf, u * total, right=True)", "torch.searchsorted(cdf, u, right=True)",
           SAMPLING_TESTS),
    Mutant("sampling/top-p-never-sorts-a-wide-nucleus", "sampling.py",
           "    if k < probs.size(-1) and not bool(((mass[..., -1] >= p) & (last > top[..., -1])).all()):",
           "    if False:", SAMPLING_TESTS),
    Mutant("sampling/top-p-ties-left-in-topks-order", "sampling.py",
           "(last > top[..., -1])", "True", SAMPLING_TESTS),
    Mutant("sampling/temperature-multiplies", "sampling.py",
           "logits = logits / max(params.temperature, torch.finfo(torch.float32).tiny)",
           "logits = logits * max(params.temperature, torch.finfo(torch.float32).tiny)",
           SAMPLING_TESTS),
    Mutant("sampling/top-k-keeps-k-1", "sampling.py",
           'logits.masked_fill(logits < kth, float("-inf"))', 'logits.masked_fill(logits <= kth, float("-inf"))',
           SAMPLING_TESTS),
    Mutant("sampling/top-p-drops-the-crossing-token", "sampling.py",
           "keep_top = mass - top < p", "keep_top = mass < p", SAMPLING_TESTS),
    Mutant("sampling/min-p-absolute-threshold", "sampling.py",
           "threshold = min_p * probs.max(dim=-1, keepdim=True).values", "threshold = min_p", SAMPLING_TESTS),
    Mutant("sampling/repetition-penalty-inverted", "sampling.py",
           "torch.where(logits > 0, logits / penalty, logits * penalty)",
           "torch.where(logits > 0, logits * penalty, logits / penalty)", SAMPLING_TESTS),
    Mutant("sampling/repetition-penalty-on-unseen-tokens", "sampling.py",
           "return torch.where(seen, penalised.clamp(-big, big), logits)", "return penalised.clamp(-big, big)",
           SAMPLING_TESTS),
    # the trainer
    Mutant("train/auto-probes-bf16-with-onednn-held-below-it", "train/precision.py",
           "return torch.ops.mkldnn._is_mkldnn_bf16_supported()", "return True",
           ("tests/test_train_semantics.py", "-k", "auto")),
    Mutant("train/auto-probes-cpus-without-bf16", "train/precision.py",
           "    if not may_have_native_bf16():\n", "    if False:\n", ("tests/test_train_semantics.py", "-k", "auto")),
    Mutant("train/weight-decay-off", "train/setup.py",
           '{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay}',
           '{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.0}', TRAIN_TESTS),
    Mutant("train/weight-decay-on-biases-and-gains", "train/setup.py",
           '{"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}',
           '{"params": [p for p in params if p.dim() < 2], "weight_decay": cfg.weight_decay}', TRAIN_TESTS),
    Mutant("train/grad-accum-sums-micro-batches", "train/trainer.py",
           "loss = loss / self.grad_accum", "loss = loss", TRAIN_TESTS),
    Mutant("train/lr-warmup-starts-at-zero", "train/schedule.py",
           "return cfg.lr * (step + 1) / cfg.warmup_steps", "return cfg.lr * step / cfg.warmup_steps", TRAIN_TESTS),
    Mutant("train/lr-cosine-rises", "train/schedule.py",
           "0.5 * (1.0 + math.cos(math.pi * progress))", "0.5 * (1.0 - math.cos(math.pi * progress))", TRAIN_TESTS),
    Mutant("train/muon-without-nesterov", "train/muon.py",
           "nesterov = torch.stack([g.lerp(buf, momentum)", "nesterov = torch.stack([buf + 0 * g", TRAIN_TESTS),
    Mutant("train/muon-scaled-by-the-short-side", "train/muon.py",
           "0.2 * max(shape) ** 0.5", "0.2 * min(shape) ** 0.5", TRAIN_TESTS),
    Mutant("train/muon-lr-ignored", "train/trainer.py",
           'group["lr"] = lr * group.get("lr_scale", 1.0)', 'group["lr"] = lr', TRAIN_TESTS),
    Mutant("train/muon-steps-the-embedding", "train/setup.py",
           "model.transformer.h.parameters() if", "model.parameters() if", TRAIN_TESTS),
    Mutant("train/demo-deadline-without-the-reserve", "commands/demo.py",
           "left = deadline - now - RESERVE_S", "left = deadline - now", TRAIN_TESTS),
    Mutant("train/resume-skips-muons-momentum", "train/setup.py",
           "zip(self.optimizers, states, strict=True)", "zip(self.optimizers[:1], states[:1], strict=True)",
           TRAIN_TESTS),
    Mutant("train/grad-clip-ignored", "train/trainer.py",
           'max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")', 'max_norm = float("inf")',
           TRAIN_TESTS),
    # the KV cache
    Mutant("kv-cache/pos-advances-by-one", "kv_cache.py", "self.pos = self.pos + n", "self.pos = self.pos + 1", KV_TESTS),
    Mutant("kv-cache/writes-at-slot-0", "kv_cache.py",
           "k_cache[:, :, start : start + T] = k\n    v_cache[:, :, start : start + T] = v",
           "k_cache[:, :, 0:T] = k\n    v_cache[:, :, 0:T] = v", KV_TESTS),
    Mutant("kv-cache/c-kernel-writes-one-slot-early", "model.py",
           "ops.decode_attention(qkv, kv, cache_pos, mask, self.n_head)",
           "ops.decode_attention(qkv, kv, max(cache_pos - 1, 0), mask, self.n_head)", KV_TESTS),
    # the whole decoding step in C (fused_step.py, gl_decode_step in csrc/decode_step.c)
    Mutant("fused/bf16-residual-not-rounded", "csrc/decode_step.c",
           "    for (size_t i = 0; i < n; i++) x[i] += y[i];\n    if (bf16) round_bf16(x, n);",
           "    for (size_t i = 0; i < n; i++) x[i] += y[i];", FUSED_TESTS),
    Mutant("fused/padding-mask-ignored", "csrc/decode_step.c",
           "pos + t, mask, pos + T, o, T * C", "pos + t, NULL, pos + T, o, T * C", FUSED_TESTS),
    Mutant("fused/swapped-modules-not-seen", "fused_step.py",
           "return all(map(operator.is_, map(dict.get, wheres, names), values)) and self._key() == self.key",
           "return self._key() == self.key", FUSED_TESTS),
    Mutant("fused/learned-positions-not-added", "csrc/decode_step.c",
           "        if (!m->wpe) continue;", "        continue;", FUSED_TESTS),
    Mutant("fused/int4-embedding-rows-not-centred", "csrc/decode_step.c",
           "(float)(v - 8) * bf16_to_f32", "(float)v * bf16_to_f32", FUSED_TESTS),
    Mutant("fused/values-written-to-the-key-cache", "fused_step.py",
           "tensors = [t for kv in layers for t in kv]",
           "tensors = [t for k, v in layers for t in (k, k)]", FUSED_TESTS),
    # each kernel variant's own primitives (csrc/simd_*.h): each test of the kernels runs on every
    # variant this CPU can execute, so a bug in one variant fails there
    Mutant("kernels/avx512-int8-offset-not-removed", "csrc/simd_avx512.h",
           "#define GL_I8_OFFSET 128 /*", "#define GL_I8_OFFSET 0 /*", FUSED_TESTS, "avx512"),
    Mutant("kernels/avx2-int8-sign-not-moved", "csrc/simd_avx2.h",
           "const vi aw = _mm256_sign_epi8(w, w), sx = _mm256_sign_epi8(x, w);",
           "const vi aw = _mm256_sign_epi8(w, w), sx = x;", FUSED_TESTS),
    Mutant("kernels/avx2-bf16-odd-weights-shifted", "csrc/simd_avx2.h",
           "*odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));",
           "*odd = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(v, 16), 15));", FUSED_TESTS),
    Mutant("kernels/avx2-int4-blocks-scaled-by-the-wrong-lanes", "csrc/simd_avx2.h",
           "-1, -1, 2, 3, -1, -1, 2, 3, -1, -1, 2, 3, -1, -1, 2, 3);",
           "-1, -1, 0, 1, -1, -1, 0, 1, -1, -1, 0, 1, -1, -1, 0, 1);", FUSED_TESTS),
    Mutant("kernels/avx2-int4-g64-scales-read-as-g32", "csrc/simd_avx2.h",
           "    if (gshift > 0)\n        return _mm256_castsi256_ps(", "    if (gshift > 1)\n        return _mm256_castsi256_ps(",
           FUSED_TESTS),
    Mutant("kernels/int4-prompt-offsets-7-scales", "csrc/quantized_i4.c",
           "bf16_to_f32(zeros[i]) - 8.0f * ws[i]", "bf16_to_f32(zeros[i]) - 7.0f * ws[i]", FUSED_TESTS),
    Mutant("kernels/int4-prompt-odd-inputs-misplaced", "csrc/quantized_i4.c",
           "memcpy(t + (size_t)u * 2 * VB + VB, even + VB, 4)", "memcpy(t + (size_t)u * 2 * VB + VB, even + 4, 4)",
           FUSED_TESTS),
    Mutant("kernels/avx2-sum-drops-a-lane", "csrc/simd_avx2.h",
           "return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));", "return _mm_cvtss_f32(s);", FUSED_TESTS),
    Mutant("kernels/portable-high-nibbles-not-shifted", "csrc/simd_portable.h",
           "for (int b = 0; b < 4 * VW; b++) v.u[b] >>= 4;", "for (int b = 0; b < 4 * VW; b++) v.u[b] &= 15;",
           FUSED_TESTS),
    Mutant("kernels/portable-exp-off-by-a-power-of-two", "csrc/simd_portable.h",
           "static inline vf vf_pow2i(vf n) { EACH(ldexpf(1.0f, (int)n.v[l])); }",
           "static inline vf vf_pow2i(vf n) { EACH(ldexpf(1.0f, (int)n.v[l] + 1)); }", FUSED_TESTS),
    Mutant("kernels/avx2-activation-bytes-from-the-wrong-lane-byte", "csrc/simd_avx2.h",
           "_mm256_set1_epi32(0x0c080400)", "_mm256_set1_epi32(0x0d090501)", FUSED_TESTS),
    Mutant("kernels/avx2-int4-activations-not-deinterleaved", "csrc/simd_avx2.h",
           "_mm256_shuffle_epi8(vi_load(t), split), 0xd8)", "_mm256_shuffle_epi8(vi_load(t), split), 0xe4)",
           FUSED_TESTS),
    Mutant("kernels/prompt-tiles-drop-rows", "csrc/quantized.c",
           "return M - t0 < tile ? M : t0 + tile;", "return M - t0 < tile ? M : t0 + tile - MROWS;",
           FUSED_TESTS),
    Mutant("kernels/decode-rows-not-one-or-rows", "csrc/cpu.c",
           "!cpu_is_amd() ? ROWS : 1; }", "!cpu_is_amd() ? ROWS : 2; }", FUSED_TESTS),
    Mutant("kernels/temporal-float-spans-take-one-row-of-x", "csrc/linear.c",
           ": dot_span(w, bf16, x, bias, bias_bf16, y, y_bf16, RR, MM, 0, n0, n1, N, K))",
           ": dot_span(w, bf16, x, bias, bias_bf16, y, y_bf16, RR, 1, 0, n0, n1, N, K))",
           PREFETCH_TESTS),
    Mutant("kernels/non-temporal-int8-spans-drop-the-bias", "csrc/quantized.c",
           "(prefetch_nta() ? i8_span(w, xq, xs, ws, wsum, b, y, RR, MM, 1, n0, n1, N, K)",
           "(prefetch_nta() ? i8_span(w, xq, xs, ws, wsum, NULL, y, RR, MM, 1, n0, n1, N, K)",
           PREFETCH_TESTS),
    Mutant("kernels/prefetch-default-flipped", "csrc/cpu.c",
           "int gl_default_prefetch_nta(void) { return cpu_is_amd(); }",
           "int gl_default_prefetch_nta(void) { return !cpu_is_amd(); }",
           PREFETCH_TESTS),
    Mutant("kernels/prefetch-default-not-restored", "csrc/cpu.c",
           "gl_prefetch_nta_ = nta < 0 ? gl_default_prefetch_nta() : nta;",
           "gl_prefetch_nta_ = nta < 0 ? gl_prefetch_nta_ : nta;",
           PREFETCH_TESTS),
    Mutant("kernels/prefetch-hint-not-set", "csrc/cpu.c",
           "    gl_prefetch_nta_ = nta < 0 ? gl_default_prefetch_nta() : nta;\n    return prefetch_nta();",
           "    return prefetch_nta();",
           PREFETCH_TESTS),
    Mutant("kernels/avx2-f32-gemm-rows-drop-the-bias", "csrc/linear.c",
           "!gl_sgemm_nt(M, N, K, x, K, 0, w, 0, y, N, 0, (const float *)bias, nthreads))",
           "!gl_sgemm_nt(M, N, K, x, K, 0, w, 0, y, N, 0, NULL, nthreads))", FUSED_TESTS, variant="avx2"),
    Mutant("kernels/avx2-float-blocks-step-past-rows-of-x", "csrc/linear.c",
           "for (int m0 = 0; m0 < M; m0 += mstep) {", "for (int m0 = 0; m0 < M; m0 += MROWS) {", FUSED_TESTS,
           variant="avx2"),
    Mutant("kernels/avx2-int8-blocks-step-past-rows-of-x", "csrc/quantized.c",
           "for (int m0 = t0; m0 < t1; m0 += mstep) {", "for (int m0 = t0; m0 < t1; m0 += MROWS) {",
           FUSED_TESTS + QUANTIZE_TESTS, variant="avx2"),
    Mutant("kernels/split-sums-drop-one", "csrc/linear.c",
           "out[0][m] = (s4[0] + s4[1]) + (s4[2] + s4[3]);", "out[0][m] = (s4[0] + s4[1]) + s4[2];", FUSED_TESTS),
    Mutant("kernels/tail-of-inputs-dropped", "csrc/linear.c",
           "        if (k < K) dot_step_f32((const float *)w, x, R, M, K, k, K - k, 1, nta, acc);\n", "", FUSED_TESTS),
    Mutant("kernels/avx512-tail-mask-a-lane-short", "csrc/simd_avx512.h",
           "return (__mmask16)((1u << n) - 1u); }", "return (__mmask16)((1u << n) - 2u); }", FUSED_TESTS, "avx512"),
    Mutant("kernels/avx2-bf16-tail-shifted-wrong", "csrc/simd_avx2.h",
           "return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));",
           "return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 15));", FUSED_TESTS),
    Mutant("kernels/avx2-bf16-tail-odd-value-dropped", "csrc/simd_avx2.h",
           "    if (n & 1) {\n        const __m128i last", "    if (0) {\n        const __m128i last", FUSED_TESTS),
    Mutant("kernels/avx2-bf16-tail-a-pair-short", "csrc/simd_avx2.h",
           "_mm_cmpgt_epi32(_mm_set1_epi32(n / 2),", "_mm_cmpgt_epi32(_mm_set1_epi32((n - 1) / 2),", FUSED_TESTS),
    Mutant("kernels/avx512-int4-g64-scales-of-the-wrong-group", "csrc/simd_avx512.h",
           "const int g = gshift < 2 ? gshift : 2;", "const int g = gshift < 2 ? 0 : 2;",
           FUSED_TESTS, "avx512"),
    Mutant("kernels/int4-prompt-bias-of-the-first-row", "csrc/quantized_i4.c",
           "for (int r = 0; r < R; r++) yl[r] = lanes[r][l] + bias[r];",
           "for (int r = 0; r < R; r++) yl[r] = lanes[r][l] + bias[0];", FUSED_TESTS),
    Mutant("kernels/prompt-gemm-bias-dropped", "gemm.py",
           "b = None if bias is None else bias.detach().float().contiguous()\n    in_place",
           "b = None\n    in_place",
           FUSED_TESTS),
    # the training head's GEMM (csrc/gemm.c)
    Mutant("gemm/accumulate-ignored", "csrc/gemm.c",
           "const int first = pc == 0 && !g->accumulate,", "const int first = pc == 0,", GEMM_TESTS),
    Mutant("gemm/last-block-as-deep-as-the-others", "csrc/gemm.c",
           "return g->K - pc < GEMM_KC ? g->K - pc : GEMM_KC;", "return GEMM_KC;", GEMM_TESTS),
    Mutant("gemm/edge-tile-drops-a-column", "csrc/gemm_f32.c",
           "for (int j = 0; j < n; j++) c[i * ldc + j] = first ? tile[i * width + j]",
           "for (int j = 0; j < n - 1; j++) c[i * ldc + j] = first ? tile[i * width + j]",
           GEMM_TESTS),
    Mutant("gemm/transposed-a-packed-with-the-row-stride", "csrc/gemm_f32.c",
           "memcpy(ap + k * GEMM_MR, ai + k * csa,", "memcpy(ap + k * GEMM_MR, ai + k * rsa,", GEMM_TESTS),
    Mutant("gemm/rows-transposed-with-pairs-of-rows-swapped", "csrc/gemm_f32.c",
           "t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);",
           "t[i] = _mm256_unpacklo_ps(r[i + 1], r[i]), t[i + 1] = _mm256_unpackhi_ps(r[i + 1], r[i]);", GEMM_TESTS,
           feature="avx2"),
    Mutant("gemm/narrow-rows-transposed-stored-out-of-k-order", "csrc/gemm_f32.c",
           "for (int kk = 0; kk < 8; kk++) _mm256_storeu_ps(out + (k + kk) * width, r[kk]);",
           "for (int kk = 7; kk >= 0; kk--) _mm256_storeu_ps(out + (k + kk) * width, r[kk]);", GEMM_TESTS,
           feature="avx2"),
    Mutant("gemm/wide-rows-transposed-every-group-from-the-first-rows", "csrc/gemm_f32.c",
           "load8(base + ((g + i) * stride + k) * size, bf16)", "load8(base + (i * stride + k) * size, bf16)",
           GEMM_TESTS, feature="avx2"),
    Mutant("gemm/rows-transposed-bf16-read-as-fp32", "csrc/gemm_f32.c",
           "const int size = bf16 ? 2 : 4;", "const int size = 4;", GEMM_TESTS, feature="avx2"),
    Mutant("gemm/rows-transposed-tail-dropped", "csrc/gemm_f32.c",
           "    for (; k < kc; k++)\n        for (int i = 0; i < width; i++)",
           "    for (; k < kc - 1; k++)\n        for (int i = 0; i < width; i++)", GEMM_TESTS),
    Mutant("gemm/threads-rows-overlap", "csrc/gemm.c",
           "int r0 = (int)((long)tiles * id / nt) * MR,",
           "int r0 = (int)((long)tiles * id / nt) * MR - (id ? MR : 0),", GEMM_TESTS),
    Mutant("gemm/threads-columns-overlap", "csrc/gemm.c",
           "r0 = 0, r1 = M, c0 = panels_all * id / nt * NR,", "r0 = 0, r1 = M, c0 = (panels_all * id / nt - (id ? 1 : 0)) * NR,",
           GEMM_TESTS),
    Mutant("gemm/last-threads-columns-past-the-end", "csrc/gemm.c",
           "            c1 = c1 < N ? c1 : N;\n", "", GEMM_TESTS),
    Mutant("gemm/bias-added-in-every-block-of-k", "csrc/gemm.c",
           "g->bias && pc == 0 ? g->bias + jc + p * NR : NULL", "g->bias ? g->bias + jc + p * NR : NULL", GEMM_TESTS),
    Mutant("gemm/bf16-b-strided-as-fp32", "csrc/gemm_f32.c",
           "GEMM_F32_BF16_B = {GEMM_MR, GEMM_NR, 1, 2, 4, 0,", "GEMM_F32_BF16_B = {GEMM_MR, GEMM_NR, 1, 4, 4, 0,",
           GEMM_TESTS),
    Mutant("gemm/bf16-a-strided-as-fp32", "csrc/gemm_f32.c",
           "GEMM_F32_BF16_AB = {GEMM_MR, GEMM_NR, 1, 2, 2, 0,", "GEMM_F32_BF16_AB = {GEMM_MR, GEMM_NR, 1, 2, 4, 0,",
           GEMM_TESTS),
    Mutant("gemm/bf16-a-not-widened", "csrc/gemm_f32.c",
           "pack_a_f32(a, rsa, csa, m, kc, panels, 1);", "pack_a_f32(a, rsa, csa, m, kc, panels, 0);", GEMM_TESTS),
    # gl_sgemm_nt's split last panel: half a tile, then dot products along k
    Mutant("gemm/split-panel-second-rest-row-reads-the-first", "csrc/gemm_f32.c",
           "b1 = w == 2 ? vf_load_n(rest + kc + k, n) : b0;", "b1 = b0;", GEMM_TESTS),
    Mutant("gemm/split-panel-depth-tail-dropped", "csrc/gemm_f32.c",
           "    if (k < kc) rest_step(kc, a, si, rest, w, k, kc - k, acc);", "", GEMM_TESTS),
    Mutant("gemm/split-panel-packed-whole", "csrc/gemm_f32.c",
           "const int split = last >= p0 && last < p1 && split_panel(n - j0);", "const int split = 0;", GEMM_TESTS),
    Mutant("decode/cache-pointers-kept-when-a-layer-is-replaced", "fused_step.py",
           "            if all(map(operator.is_, known[1], layers)):", "            if True:", FUSED_TESTS),
    Mutant("decode/int8-steps-of-many-rows-in-c-where-fbgemm-multiplies", "fused_step.py",
           "(mode == \"int8\" and not ops.fbgemm_int8_is_exact())", "(mode == \"int8\")", FUSED_TESTS),
    Mutant("decode/int8-steps-of-many-rows-never-in-c", "fused_step.py",
           "(mode == \"int8\" and not ops.fbgemm_int8_is_exact())", "False", FUSED_TESTS),
    Mutant("decode/float-steps-past-their-rows", "fused_step.py",
           "        and rows <= FLOAT_STEP_ROWS.get(model.transformer.wte.weight.dtype, 0)\n", "", FUSED_TESTS),
    Mutant("decode/float-steps-in-c-where-mkl-won-the-probe", "fused_step.py",
           "        and gemm.prompt_gemm_choice(rows) == \"gptlab\"\n", "", FUSED_TESTS),
    Mutant("decode/float-steps-of-many-rows-normed-from-the-first-row", "csrc/decode_step.c",
           "        const float *xr = x + (size_t)r * C;", "        const float *xr = x + (size_t)(M >= PARALLEL_ROWS ? 0 : r) * C;",
           FUSED_TESTS),
    Mutant("decode/hooks-unchecked-once-none-were-found", "fused_step.py",
           "if registered is not None and registered == self.no_hooks_at:",
           "if registered is not None and self.no_hooks_at is not None:", FUSED_TESTS),
    Mutant("decode/attention-four-keys-all-scored-against-the-first", "csrc/attention.c",
           "a[i] = vf_fma(q[v], ROW(kc, j + i, v), a[i])", "a[i] = vf_fma(q[v], ROW(kc, j, v), a[i])", FUSED_TESTS),
    Mutant("decode/attention-not-normalized", "csrc/attention.c",
           "vf_store(o, vf_mul(acc[v], vf_set1(inv)));", "vf_store(o, acc[v]);", FUSED_TESTS),
    Mutant("decode/argmax-ties-to-the-last-block", "csrc/attention.c",
           "        if (most > top) {", "        if (most >= top) {", ("tests/test_kernels.py",)),
    Mutant("decode/argmax-nan-not-taken", "csrc/attention.c",
           "                if (r[n] != r[n]) return n;", "                if (r[n] != r[n] && n < from) return n;",
           ("tests/test_kernels.py",)),
    Mutant("decode/attention-masked-slots-seen", "csrc/attention.c",
           "        if (HIDDEN(j)) sc[j] = -INFINITY;", "        if (HIDDEN(j)) sc[j] = sc[j];", FUSED_TESTS),
    Mutant("decode/attention-gpt2-heads-unscaled", "csrc/attention.c",
           "softmax_seen(sc, S, S, 1.0f / sqrtf((float)hs))", "softmax_seen(sc, S, S, hs == 64 ? 1.0f : 1.0f / sqrtf((float)hs))",
           FUSED_TESTS),
    Mutant("install/a-library-of-other-sources-counts-as-current", "kernel_build.py",
           "return source_digest().encode() in Path(path).read_bytes()", "return bool(Path(path).read_bytes())",
           ("tests/test_kernel_variants.py", "-k", "build_all or stale")),
    Mutant("install/avx512-without-vnni-taken-as-avx512", "kernel_build.py",
           '"avx512dq", "avx512vnni", "avx2", "fma", "f16c"),', '"avx512dq", "avx2", "fma", "f16c"),',
           ("tests/test_kernel_variants.py", "-k", "auto_picks")),
    Mutant("install/avx2-vnni-built-with-avx512-vnni", "kernel_build.py",
           '"-mf16c", "-mavxvnni")', '"-mf16c", "-mavx512vnni")', INSTRUCTION_TESTS),
    Mutant("install/avx2-vnni-library-names-itself-avx2", "csrc/cpu.c",
           'defined(__AVXVNNI__)\n    return "avx2-vnni";', 'defined(__AVXVNNI__)\n    return "avx2";',
           ("tests/test_kernel_variants.py", "-k", "loaded_as"), variant="avx2-vnni"),
    Mutant("install/loss-compiled-for-avx2-in-every-variant", "csrc/loss.c",
           "\nint gl_softmax_xent(", '\n__attribute__((target("avx2,fma"))) int gl_softmax_xent(', INSTRUCTION_TESTS),
    Mutant("kv-cache/query-read-in-the-caches-dtype", "csrc/attention.c",
           "vf_load_any_n(qp + (size_t)VW * v * (qb ? 2 : 4), qb, hs - VW * v)",
           "vf_load_any_n(qp + (size_t)VW * v * (qb ? 2 : 4), kb, hs - VW * v)", FUSED_TESTS),
    Mutant("kv-cache/new-keys-truncated-to-bf16", "csrc/attention.c",
           "((uint16_t *)slot)[d] = f32_to_bf16(((const float *)src)[d]);",
           "((uint16_t *)slot)[d] = (uint16_t)(*(const uint32_t *)((const float *)src + d) >> 16);", FUSED_TESTS),
    Mutant("kv-cache/bf16-cache-flag-dropped", "fused_step.py",
           "found = pointers, int(kv_dtype is torch.bfloat16)", "found = pointers, int(self.dtype is torch.bfloat16)",
           FUSED_TESTS),
    Mutant("prompt/last-layer-keeps-the-first-position", "model.py",
           "x = self.hook_resid_mid((x[:, -1:] if last_only else x)", "x = self.hook_resid_mid((x[:, :1] if last_only else x)",
           KV_TESTS),
    Mutant("prompt/last-layer-trimmed-under-a-hook", "model.py",
           " and attn_probs is None and not (block.hooked() or every_position)", " and attn_probs is None", KV_TESTS),
    Mutant("prompt/last-layer-query-sees-the-first-row-of-the-mask", "model.py",
           "mask = None if mask is None else mask[:, :, -1:]", "mask = None if mask is None else mask[:, :, :1]", KV_TESTS),
    Mutant("kv-cache/compiled-writes-uncast", "kv_cache.py",
           "k_cache.index_copy_(2, slots, k.to(k_cache.dtype))", "k_cache.index_copy_(2, slots, k)", KV_TESTS),
    Mutant("prompt/attention-sees-one-key-too-few", "csrc/attention.c",
           "softmax_seen(scores + (size_t)i * keys, S - T + t0 + i + 1, keys, scale)",
           "softmax_seen(scores + (size_t)i * keys, S - T + t0 + i, keys, scale)", FUSED_TESTS),
    Mutant("prompt/attention-every-head-against-the-first-heads-keys", "csrc/attention.c",
           "qb, sq.row, 1, bf16, kt + packed * bh, scores, keys)", "qb, sq.row, 1, bf16, kt, scores, keys)", FUSED_TESTS),
    Mutant("prompt/attention-normalized-by-the-first-row", "csrc/attention.c",
           "vf_set1(inv[i])), hs - d)", "vf_set1(inv[0])), hs - d)", FUSED_TESTS),
    Mutant("prompt/attention-bf16-rows-written-at-the-scratch-stride", "csrc/attention.c",
           "uint16_t *oh = (uint16_t *)out + at + i * ldo;", "uint16_t *oh = (uint16_t *)out + at + i * ld;",
           FUSED_TESTS),
    Mutant("prompt/attention-bf16-keys-packed-as-fp32", "csrc/attention.c",
           "kt + packed * bh, bf16);", "kt + packed * bh, 0);", FUSED_TESTS),
    Mutant("prompt/attention-bf16-values-widened-from-each-panels-first-vector", "csrc/gemm_f32.c",
           "vf_store(out + k * GEMM_NR + j, vf_load_bf16(bj + k * rsb + j));",
           "vf_store(out + k * GEMM_NR + j, vf_load_bf16(bj + k * rsb));", FUSED_TESTS),
    Mutant("bf16/rounding-ties-away-from-zero", "csrc/common.h",
           ": u + 0x7fffu + ((u >> 16) & 1u);", ": u + 0x8000u;", FUSED_TESTS),
    Mutant("prompt/attention-values-at-the-keys-strides", "ops.py",
           "for t in (q, k, v)]  # (batch, head, row)", "for t in (q, k, k)]  # (batch, head, row)", FUSED_TESTS),
    Mutant("prompt/gelu-cubic-coefficient", "csrc/decode_step.c",
           "tanh_of(vf_mul(c, vf_fma(vf_mul(a, v), vf_mul(v, v), v)))",
           "tanh_of(vf_mul(c, vf_fma(vf_mul(vf_set1(0.04715f), v), vf_mul(v, v), v)))", FUSED_TESTS),
    Mutant("train/malloc-trim-threshold-not-set", "train/setup.py",
           "MALLOC_SETTINGS = {-3: 32 << 20, -1: 1 << 30}", "MALLOC_SETTINGS = {-3: 32 << 20, -2: 1 << 30}",
           TRAIN_TESTS),
    Mutant("train/malloc-left-alone-by-the-trainer", "train/trainer.py",
           'if self.device.type == "cpu" and setup.keep_freed_memory():', 'if False:', TRAIN_TESTS),
    Mutant("train/gelu-backward-cubic-term-not-differentiated", "csrc/decode_step.c",
           "a3 = vf_set1(3.0f * 0.044715f)", "a3 = vf_set1(0.044715f)", FUSED_TESTS),
    Mutant("train/gelu-backward-drops-the-incoming-gradient", "csrc/decode_step.c",
           "vf_mul(vf_load_n(dy + i, n - i), vf_add(left, right))", "vf_add(left, right)", FUSED_TESTS),
    Mutant("prompt/gelu-in-place-under-a-hook", "model.py",
           "inplace=not self.hook_pre.active)", "inplace=True)", FUSED_TESTS),
    Mutant("gemm/head-products-ignore-the-choice", "gemm.py",
           'return gemm_choice() == "gptlab"', "return True", GEMM_TESTS),
    # whose GEMM an Intel CPU runs, measured (gemm_probe.py)
    Mutant("gemm-probe/slower-side-taken", "gemm_probe.py",
           'return "gptlab" if t["torch"] > t["gptlab"] else "torch"',
           'return "gptlab" if t["torch"] < t["gptlab"] else "torch"', PROBE_TESTS),
    Mutant("gemm-probe/the-head-decides-every-workload", "gemm_probe.py",
           "    t = timings[work]\n", '    t = timings["head"]\n', PROBE_TESTS),
    Mutant("gemm-probe/gptlab-side-times-pytorch", "gemm_probe.py",
           '"gptlab": lambda: [sgemm_linear(x, w, None) for x, w in layers],',
           '"gptlab": lambda: [F.linear(x, w) for x, w in layers],', PROBE_TESTS),
    Mutant("gemm-probe/cache-never-read", "machine_cache.py",
           "    if key in cache:\n", "    if False:\n", PROBE_TESTS),
    Mutant("gemm-probe/key-without-threads", "machine_cache.py",
           'f"{torch.get_num_threads()} threads", ', "", PROBE_TESTS),
    # torch.compile's builds per CPU (inductor's cache keys do not name it)
    Mutant("compile-cache/blind-to-cpu-flags", "compile_cache.py",
           '" ".join(sorted(set(flags.split())))]', '""]', COMPILE_CACHE_TESTS),
    Mutant("compile-cache/inductors-default-kept", "compile_cache.py",
           "if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):", "if chosen:",
           COMPILE_CACHE_TESTS),
    Mutant("compile-cache/training-compiles-anywhere", "train/setup.py",
           "        compile_cache.use()", "        pass", COMPILE_CACHE_TESTS),
    Mutant("gemm-probe/intel-keeps-mkl-unmeasured", "gemm.py",
           "_measured_gemm[at] = {w: gemm_probe.choice(w, timings) for w in gemm_probe.WORK}",
           '_measured_gemm[at] = {w: "torch" for w in gemm_probe.WORK}',
           PROBE_TESTS),
    Mutant("gemm-probe/process-memo-blind-to-threads", "gemm.py",
           "at = (torch.get_num_threads(), kernels.variant())", "at = (0, kernels.variant())", PROBE_TESTS),
    Mutant("gemm-probe/measured-inside-a-compiled-trace", "gemm.py",
           "    if torch.compiler.is_compiling():  # nothing is timed", "    if False:  # nothing is timed", PROBE_TESTS),
    Mutant("gemm-probe/intel-bf16-products-unasked", "gemm.py",
           'if cpu.vendor() == "GenuineIntel" and _gemm_env() != "gptlab":', "if False:", PROBE_TESTS),
    Mutant("gemm-probe/prompts-one-choice-for-every-row-count", "gemm_probe.py",
           "    nearest = min(PROMPT_ROWS, key=lambda n: abs(math.log(max(rows, 1) / n)))",
           "    nearest = PROMPT_ROWS[0]", PROBE_TESTS),
    Mutant("gemm-probe/prompts-nearest-row-count-on-a-linear-scale", "gemm_probe.py",
           "    nearest = min(PROMPT_ROWS, key=lambda n: abs(math.log(max(rows, 1) / n)))",
           "    nearest = min(PROMPT_ROWS, key=lambda n: abs(rows - n))", PROBE_TESTS),
    Mutant("gemm-probe/prompts-follow-the-head", "linear.py",
           '        and gemm.prompt_gemm_choice(x.numel() // x.size(-1)) == "gptlab"\n    )',
           '        and gemm.gemm_choice() == "gptlab"\n    )',
           PROBE_TESTS),
    # its bf16 products (AVX512-BF16)
    Mutant("gemm-bf16/pair-halves-swapped-in-row-panels", "csrc/gemm_bf16.c",
           "out[k / 2] = bf16_pair(f32_bits(ai[k]), f32_bits(ai[k + 1]));",
           "out[k / 2] = bf16_pair(f32_bits(ai[k + 1]), f32_bits(ai[k]));", GEMM_TESTS, feature="avx512bf16"),
    Mutant("gemm-bf16/never-runs", "csrc/gemm_bf16.c",
           "if (has < 0) has = gl_cpu_features() >> 11 & 1;", "if (has < 0) has = 0;", GEMM_TESTS,
           feature="avx512bf16"),
    Mutant("gemm-bf16/truncated-not-rounded", "csrc/gemm_bf16.c",
           "lo | 0x400000u : lo + 0x7fffu + ((lo >> 16) & 1u);", "lo | 0x400000u : lo;", GEMM_TESTS,
           feature="avx512bf16"),
    Mutant("gemm-bf16/odd-depth-last-pair-of-b-dropped", "csrc/gemm_bf16.c",
           "            if (kc & 1)\n                for (int j = 0; j < BF_NR; j++)",
           "            if (0)\n                for (int j = 0; j < BF_NR; j++)", GEMM_TESTS, feature="avx512bf16"),
    Mutant("gemm-bf16/edge-tile-writes-a-column-more", "csrc/gemm_bf16.c",
           "(__mmask16)((1u << (n - 16)) - 1);", "(__mmask16)((1u << (n - 15)) - 1);", GEMM_TESTS,
           feature="avx512bf16"),
    Mutant("gemm-bf16/head-weight-gradient-not-in-bf16", "chunked_loss.py",
           "gemm.mm(e, x_scaled, grad_w, accumulate=not first, bf16=bf16)",
           "gemm.mm(e, x_scaled, grad_w, accumulate=not first)", GEMM_TESTS, feature="avx512bf16"),
    # the loss
    Mutant("eval/perplexity-targets-not-shifted", "evaluate.py",
           "targets = torch.cat([tokens[f + 1 : e + 1] for b, e, f in batch])",
           "targets = torch.cat([tokens[f:e] for b, e, f in batch])", ("tests/test_evaluate.py",)),
    Mutant("eval/json-writes-bare-nan", "commands/_model_args.py",
           "json.dumps(_finite(data), indent=2, allow_nan=False)", "json.dumps(data, indent=2)",
           ("tests/test_evaluate.py", "-k", "bare_nan")),
    Mutant("eval/stride-zero-taken-as-the-default", "evaluate.py",
           "stride = default_stride(model.config.block_size) if stride is None else stride",
           "stride = stride or default_stride(model.config.block_size)", ("tests/test_evaluate.py", "-k", "stride")),
    Mutant("loss/targets-not-shifted", "data.py", "x, y = windows[:, :-1], windows[:, 1:].copy()", "x, y = windows[:, :-1], windows[:, :-1].copy()",
           LOSS_TESTS),
    Mutant("loss/chunked-ignore-index-not-honoured", "chunked_loss.py",
           "valid = t_c != IGNORE_INDEX", "valid = t_c == t_c", LOSS_TESTS),
    Mutant("loss/chunked-head-gradient-not-accumulated", "chunked_loss.py",
           "accumulate=not first, bf16=bf16)  # the first", "accumulate=False, bf16=bf16)  # the first", LOSS_TESTS),
    Mutant("loss/one-hot-added-to-the-input-gradient", "chunked_loss.py",
           "alpha=-scale)  # the one-hot's part", "alpha=scale)  # the one-hot's part", LOSS_TESTS),
    Mutant("loss/one-hot-missing-from-the-head-gradient", "chunked_loss.py",
           "    grad_w.index_add_(0, targets, x_c[rows].to(grad_w.dtype), alpha=-scale)\n", "", LOSS_TESTS),
    Mutant("loss/gradient-not-divided-by-the-rows", "chunked_loss.py",
           "first=s == 0, scale=1.0 / n_valid,", "first=s == 0, scale=1.0,", LOSS_TESTS),
    Mutant("loss/head-gradient-ignores-the-incoming-gradient", "chunked_loss.py",
           "(grad_w if unit else grad_w * grad_loss)", "(grad_w if True else grad_w * grad_loss)", LOSS_TESTS),
    Mutant("gemm/prompts-below-256-rows-left-to-torch", "linear.py",
           "PROMPT_GEMM_ROWS = MAX_ROWS + 1", "PROMPT_GEMM_ROWS = 256", GEMM_TESTS + ("tests/test_kernels.py",)),
    Mutant("gemm/short-prompts-left-to-gptlabs-gemm", "linear.py",
           "and (rows <= MAX_ROWS or rows <= float_kernel_rows(x.dtype))", "and rows <= MAX_ROWS",
           ("tests/test_kernels.py",)),
    Mutant("gemm/prompts-never-read-the-weights-in-place", "gemm.py",
           "if in_place and x2.size(0) <= NT_ROWS and", "if False and", ("tests/test_kernels.py",)),
    Mutant("gemm/nt-x-row-stride-ignored", "gemm.py",
           "x2.size(0), N, K, x2.data_ptr(), x2.stride(0),", "x2.size(0), N, K, x2.data_ptr(), K,", GEMM_TESTS),
    Mutant("gemm/nt-bias-dropped-in-whole-blocks", "csrc/gemm_nt.c",
           "__m256 b = bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();", "__m256 b = _mm256_setzero_ps();",
           GEMM_TESTS, feature="avx2"),
    Mutant("gemm/nt-transposed-tail-biased-by-its-first-row", "csrc/gemm_nt.c",
           "t[(size_t)n * M + m] + (bias ? bias[n] : 0.0f)", "t[(size_t)n * M + m] + (bias ? bias[n0] : 0.0f)",
           GEMM_TESTS),
    Mutant("gemm/nt-transposed-blocks-stored-a-row-short", "csrc/gemm_nt.c",
           "_mm256_storeu_ps(yf + (m0 + j) * ldy + n0,", "_mm256_storeu_ps(yf + (m0 + j) * (ldy - 1) + n0,", GEMM_TESTS,
           feature="avx2"),
    Mutant("gemm/nt-in-place-strides-swapped", "csrc/gemm_f32.c",
           "tile_f32(kc, a, lda, 1, bp,", "tile_f32(kc, a, 1, lda, bp,", GEMM_TESTS),
    Mutant("gemm/nt-every-slab-biased-from-the-first-row", "csrc/gemm_nt.c",
           "transpose_bias(t, n, M, bias ? bias + n0 : NULL,", "transpose_bias(t, n, M, bias,", GEMM_TESTS),
    Mutant("gemm/nt-bf16-y-rounded-half-up", "csrc/gemm_nt.c",
           "_mm256_and_si256(_mm256_srli_epi32(u, 16), one)));", "one));", GEMM_TESTS),
    Mutant("gemm/nt-bf16-y-nan-rounded-as-a-number", "csrc/gemm_nt.c",
           "_mm256_set1_epi32(0x7f800000));", "_mm256_set1_epi32(0x7fffffff));", GEMM_TESTS),
    Mutant("gemm/nt-bf16-y-halves-interleaved", "csrc/gemm_nt.c", "(r, r), 0xd8));", "(r, r), 0x00));", GEMM_TESTS),
    Mutant("gemm/nt-bf16-y-written-as-fp32", "gemm.py",
           "int(weight.dtype is torch.bfloat16), y.data_ptr(), N, int(dtype is torch.bfloat16), ptr(b),",
           "int(weight.dtype is torch.bfloat16), y.data_ptr(), N, 0, ptr(b),", GEMM_TESTS),
    Mutant("gemm/bf16-prompts-follow-the-fp32-probe", "gemm.py",
           'return "gptlab" if kernels.has_simd() and kernel_build.is_x86() and not torch.compiler.is_compiling() else "torch"',
           'return _gemm_choice("prompts 512 rows")', PROBE_TESTS),
    Mutant("gemm/bf16-prompts-ignore-gptlab-gemm", "gemm.py",
           '(1.09x both)."""\n    want = _gemm_env()\n    if want != "auto":\n        return want\n',
           '(1.09x both)."""\n    want = _gemm_env()\n', PROBE_TESTS),
    Mutant("gemm/nt-every-slab-from-ws-first-rows", "csrc/gemm_nt.c",
           "(const char *)w + (size_t)n0 * K * kind->a_size;", "(const char *)w;", GEMM_TESTS),
    Mutant("gemm/nt-bf16-weight-strided-as-fp32", "csrc/gemm_f32.c",
           "GEMM_BF16_A_ROWS = {GEMM_MR, GEMM_NR, 1, 4, 2, 1,", "GEMM_BF16_A_ROWS = {GEMM_MR, GEMM_NR, 1, 4, 4, 1,",
           GEMM_TESTS),
    Mutant("gemm/nt-bf16-x-read-as-fp32", "csrc/gemm_nt.c",
           "x_bf16 ? &GEMM_BF16_AB_ROWS : &GEMM_BF16_A_ROWS", "&GEMM_BF16_A_ROWS", GEMM_TESTS),
    Mutant("gemm/nt-edge-rows-read-at-the-panels-stride", "csrc/gemm_f32.c",
           "i < m ? ((const float *)a)[i * lda + k]", "i < m ? ((const float *)a)[i * kc + k]", GEMM_TESTS),
    Mutant("gemm/nt-bf16-rows-tail-dropped", "csrc/gemm_f32.c",
           "for (; k < kc; k++) out[k] = i0 + i < m ? bf16_to_f32(row[k]) : 0.0f;",
           "for (; k < kc; k++) out[k] = 0.0f;", GEMM_TESTS),
    Mutant("gemm/nt-bf16-rows-widened-at-the-panels-stride", "csrc/gemm_f32.c",
           "tile_f32(kc, ap, GEMM_KC, 1, bp,", "tile_f32(kc, ap, kc, 1, bp,", GEMM_TESTS),
    Mutant("gemm/half-tile-steps-b-by-a-vector", "csrc/gemm_f32.c",
           "for (int k = 0; k < kc; k++, b += GEMM_NR) {\n        const vf b0 = vf_load(b);\n",
           "for (int k = 0; k < kc; k++, b += VW) {\n        const vf b0 = vf_load(b);\n", GEMM_TESTS),
    Mutant("gemm/half-tile-bias-of-the-second-vector", "csrc/gemm_f32.c",
           "const vf bias0 = vf_load_n(bias, n);", "const vf bias0 = vf_load_n(bias + VW, n - VW);",
           GEMM_TESTS),
    Mutant("loss/evaluation-computes-gradients", "chunked_loss.py",
           "need_grad = grad_mode and (", "need_grad = (", LOSS_TESTS),
    Mutant("loss/c-softmax-at-the-rows-width-not-their-stride", "ops.py",
           "logits_t.data_ptr(), logits_t.stride(0), t.data_ptr()", "logits_t.data_ptr(), logits_t.size(1), t.data_ptr()",
           LOSS_TESTS),
    Mutant("loss/c-softmax-given-peaks-unused", "csrc/loss.c",
           "peak[r] = r >= n ? 0.0f : peak_in ? peak_in[r] : m;", "peak[r] = r >= n ? 0.0f : m;", LOSS_TESTS),
    Mutant("gemm/column-maxima-miss-a-tiles-last-row", "csrc/gemm.c",
           "for (int i = 0; i < m; i++) top = vf_max(", "for (int i = 0; i < m - 1; i++) top = vf_max(",
           GEMM_TESTS + LOSS_TESTS),
    Mutant("loss/c-softmax-keeps-ignored-rows", "csrc/loss.c",
           "if (grad) inv[r] = t[r] != -100 ? 1.0f / sum : 0.0f;", "if (grad) inv[r] = 1.0f / sum;", LOSS_TESTS),
    Mutant("loss/c-softmax-sums-of-one-thread", "csrc/loss.c",
           "for (int i = 0; i < nt; i++) sum +=", "for (int i = 0; i < 1; i++) sum +=", LOSS_TESTS),
    Mutant("loss/ignore-index-wrong", "model.py", "ignore_index=-100)", "ignore_index=-1)", LOSS_TESTS),
    # the Hugging Face name table
    Mutant("hf/c-proj-not-transposed", "hf.py", '"attn.c_proj.weight": True,', '"attn.c_proj.weight": False,',
           HF_TESTS),
    Mutant("hf/ln-1-and-ln-2-swapped", "hf.py",
           '{f"{PREFIX}h.{i}.{name}": (f"{PREFIX}h.{i}.{name}", t)',
           '{f"{PREFIX}h.{i}.{name}": (f"{PREFIX}h.{i}.{SWAP.get(name, name)}", t)',
           HF_TESTS),
    # the weight formats
    Mutant("llmc/file-size-unchecked-before-building-the-model", "formats/llmc.py",
           "    if size != file_size(header):  # before building", "    if False:  # before building",
           ("tests/test_formats_llmc.py", "-k", "million")),
    Mutant("hf/untied-head-exported-as-tied", "hf.py",
           '"tie_word_embeddings": config.tie_weights,', '"tie_word_embeddings": True,',
           ("tests/test_hf.py", "-k", "untied")),
    Mutant("hf/embedding-stored-as-lm-head-refused", "hf.py",
           'head_is_wte = tied and not {"wte.weight", PREFIX + "wte.weight"} & set(names)', "head_is_wte = False",
           ("tests/test_hf.py", "-k", "layouts")),
    Mutant("hf/earlier-exports-tokenizer-left-beside-a-byte-model", "hf.py",
           "            (directory / name).unlink(missing_ok=True)", "            pass",
           ("tests/test_hf.py", "-k", "earlier_exports_tokenizer")),
    Mutant("export/lora-run-sent-to-the-format-unmerged", "commands/export.py",
           "    elif lora_layers(model):  # gguf", "    elif False:  # gguf",
           ("tests/test_lora.py", "-k", "without_merge")),
    # quantization
    # int8 prompts through oneDNN (x quantized per row) or fbgemm, whichever the probe timed faster
    Mutant("int8-prompts/onednn-row-scales-dropped", "quantize.py",
           "return y.mul_(s) if self.bias is None else torch.addcmul(self.bias, y, s)",
           "return y if self.bias is None else y + self.bias", INT8_PROMPT_TESTS),
    Mutant("int8-prompts/onednn-zero-point-ignored", "int8_prompts.py",
           "qlinear_pointwise(xq, 1.0, 128, self.packed,", "qlinear_pointwise(xq, 1.0, 0, self.packed,",
           INT8_PROMPT_TESTS),
    Mutant("int8-prompts/onednn-unscaled-weights", "int8_prompts.py",
           "        self.scales_f32 = scales.float()  # (N,)", "        self.scales_f32 = torch.ones(weight.size(0))",
           INT8_PROMPT_TESTS),
    Mutant("int8-prompts/quantized-per-row-offset-wrong", "csrc/quantized.c",
           "quantize_rows_i8(x, xq, s, M, K, 128, nthreads);", "quantize_rows_i8(x, xq, s, M, K, 127, nthreads);",
           INT8_PROMPT_TESTS),
    Mutant("int8-prompts/saturating-onednn-taken-as-exact", "int8_prompts.py",
           "    return bool((y == 127 * 127 * K).all())  # exact in fp32", "    return True  # exact in fp32",
           INT8_PROMPT_TESTS),
    Mutant("int8-prompts/slower-product-taken", "int8_prompts.py",
           '"onednn" if total["onednn"] < total["fbgemm"] else "fbgemm"',
           '"onednn" if total["onednn"] > total["fbgemm"] else "fbgemm"', INT8_PROMPT_TESTS),
    Mutant("int8-prompts/timings-never-cached", "int8_prompts.py",
           "timings, source, fresh = cached(\n            CACHE_FILE, key, lambda: measure(layer_class), lambda entry: are_seconds_per_work(entry, WORK, SIDES)\n        )",
           'timings, source, fresh = measure(layer_class), "measured now", True', INT8_PROMPT_TESTS),
    Mutant("int8-prompts/forced-choice-ignored", "int8_prompts.py",
           "    if want != \"auto\":\n        return want\n    if not (onednn_available()",
           "    if not (onednn_available()", INT8_PROMPT_TESTS),
    Mutant("int8-prompts/layers-ignore-the-choice", "quantize.py",
           "self._prompts_gemm = (prompts_gemm or int8_prompts.gemm_choice(Int8Linear)) if kernel else \"fbgemm\"",
           "self._prompts_gemm = (prompts_gemm or \"fbgemm\") if kernel else \"fbgemm\"", INT8_PROMPT_TESTS),
    Mutant("int8-prompts/no-kernels-without-vnni-take-fbgemms-saturating-sums", "quantize.py",
           "            elif exact:  # else no kernel", "            else:  # else no kernel", INT8_PROMPT_TESTS),
    Mutant("int8-prompts/kernel-prompts-keep-an-unused-fbgemm-copy", "quantize.py",
           "self._prompts_in_kernel, self._decode_rows = True, sys.maxsize\n",
           "self._prompts_in_kernel, self._decode_rows = True, sys.maxsize\n"
           "                prompt_weight = self._prompt_weight()\n", INT8_PROMPT_TESTS),
    Mutant("quantize/copy-keeps-the-originals-kernels", "quantize.py",
           "        if bound:\n            self.prepare()\n", "", QUANTIZE_TESTS),
    Mutant("quantize/copy-takes-the-kernels-along", "quantize.py",
           '        state["_decode"] = state["_kernel_weights"] = None\n', "", QUANTIZE_TESTS),
    Mutant("kernels/amx-bf16-read-from-the-wrong-bit", "csrc/cpu.c",
           "(tile_state ? ((d >> 22) & 1) << 12 : 0)", "(tile_state ? ((d >> 21) & 1) << 12 : 0)",
           ("tests/test_kernel_variants.py", "-k", "cpuid"),
           feature="amxbf16"),  # without AMX bits 21 and 22 are both clear: cpuid reads the same (Zen 4, 2026-12-07)
    Mutant("int4-bf16/from-one-row-more", "linear.py",
           "        rows >= INT4_BF16_ROWS\n", "        rows > INT4_BF16_ROWS\n", QUANTIZE_TESTS),
    Mutant("int4-bf16/without-amx", "linear.py",
           '        and "amxbf16" in kernels.cpu_features()  # cpuid', '        and True  # cpuid', QUANTIZE_TESTS),
    Mutant("int4-bf16/any-size-of-layer", "linear.py",
           "        and weights <= INT4_BF16_MAX_WEIGHTS\n", "", QUANTIZE_TESTS),
    Mutant("int4-bf16/bias-dropped", "linear.py",
           "    return y if bias is None else y.add_(bias)\n", "    return y\n", QUANTIZE_TESTS),
    Mutant("int4-bf16/decoding-kernel-keeps-long-prompts", "quantize.py",
           "                self._decode_rows = min(self._decode_rows, linear_layer.INT4_BF16_ROWS - 1)\n",
           "                pass\n", QUANTIZE_TESTS),
    Mutant("int4-bf16/dequantized-as-fp32", "ops.py",
           "N, K, group_size, int(dtype is torch.bfloat16), torch.get_num_threads())",
           "N, K, group_size, 0, torch.get_num_threads())", ("tests/test_kernels.py", "-k", "dequantize")),
    Mutant("int4-bf16/dequantized-bf16-truncated", "csrc/quantized_i4.c",
           "o16[k0 + k] = f32_to_bf16((float)q[k] * s + z);",
           "{ const float v = (float)q[k] * s + z; uint32_t u; memcpy(&u, &v, 4); o16[k0 + k] = (uint16_t)(u >> 16); }",
           ("tests/test_kernels.py", "-k", "dequantize")),
    Mutant("c-check/int4-dequantized-offset-7-scales", "csrc/quantized_i4.c",
           "z = bf16_to_f32(zeros[(size_t)n * G + j]) - 8.0f * s;",
           "z = bf16_to_f32(zeros[(size_t)n * G + j]) - 7.0f * s;", C_CHECK_TESTS),
    Mutant("c-check/int4-dequantized-bf16-truncated", "csrc/quantized_i4.c",
           "o16[k0 + k] = f32_to_bf16((float)q[k] * s + z);",
           "{ const float v = (float)q[k] * s + z; uint32_t u; memcpy(&u, &v, 4); o16[k0 + k] = (uint16_t)(u >> 16); }",
           C_CHECK_TESTS),
    Mutant("c-check/int8-dequantized-with-the-first-rows-scale", "csrc/quantized.c",
           "const float s = bf16_to_f32(scales[n]);", "const float s = bf16_to_f32(scales[0]);", C_CHECK_TESTS),
    Mutant("int4-bf16/weight-buffer-misread", "linear.py",
           "    w16 = ops.dequantize_int4(weight, scales, zeros, group_size, buffer, torch.bfloat16)",
           "    w16 = buffer.view(N, K)", QUANTIZE_TESTS),
    Mutant("quantize/int8-zeroes-weights", "quantize.py",
           "q = (w / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)",
           "q = torch.zeros_like(w, dtype=torch.int8)", QUANTIZE_TESTS),
    Mutant("quantize/fbgemm-int8-exact-without-vnni", "ops.py",
           '    return "avx512vnni" in kernels.cpu_features()', "    return True", ("tests/test_emulated_cpu.py",)),
    # what the CPU is (cpu.py) and the variant auto takes for it (kernels.py)
    Mutant("cpu/bf16-flags-not-read", "cpu.py", "    return any(f in flags for f in BF16_FLAGS)", "    return True",
           ("tests/test_bench.py", "tests/test_masquerade_cpu.py", "-k", "bf16_is_native or as_the_kind")),
    Mutant("cpu/family-read-from-the-model-field", "cpu.py", 'value = cpuinfo("cpu family")', 'value = cpuinfo("model")',
           ("tests/test_kernel_variants.py", "-k", "cpuinfos")),
    Mutant("kernels/half-width-avx512-kept", "kernels.py",
           'if runnable[0] == "avx512" and (cpu.vendor(), cpu.family()) in HALF_WIDTH_AVX512:', "if False:",
           ("tests/test_kernel_variants.py", "-k", "half_width")),
    # first-use builds in a cache shared by several gptlab versions (kernels.py)
    Mutant("kernels/newest-builds-deleted-oldest-kept", "kernels.py",
           "sorted(others, key=_mtime, reverse=True)", "sorted(others, key=_mtime)",
           ("tests/test_kernel_variants.py", "-k", "keeps_its_variants")),
    Mutant("kernels/a-build-removed-while-opened-fails-the-load", "kernels.py",
           "        return None  # removed since", "        raise  # removed since",
           ("tests/test_kernel_variants.py", "-k", "removed_while")),
    Mutant("kernels/bf16-probe-while-pages-move", "linear.py",
           "    kernels.wait_for_huge_pages()\n    x = torch.randn(128, 768)", "    x = torch.randn(128, 768)",
           ("tests/test_kernels.py", "-k", "huge or bf16_matmul")),
    Mutant("kernels/bf16-probe-counts-the-warm-up", "linear.py",
           "min(times[name][1:])", "min(times[name])", ("tests/test_kernels.py", "-k", "huge or bf16_matmul")),
    # hook points (hooks.py, model.py)
    Mutant("hooks/scores-before-the-mask", "model.py",
           """    att = att.masked_fill(~mask, float("-inf"))
    if hook_scores is not None:
        att = hook_scores(att)""",
           """    if hook_scores is not None:
        att = hook_scores(att)
    att = att.masked_fill(~mask, float("-inf"))""", HOOKS_TESTS),
    Mutant("hooks/z-in-the-head-major-layout", "model.py",
           "y = self.hook_z(y.transpose(1, 2)).contiguous().view(B, T, C)",
           "y = self.hook_z(y).transpose(1, 2).contiguous().view(B, T, C)", HOOKS_TESTS),
    Mutant("hooks/normalized-after-the-gain", "model.py",
           "        x = self.hook_normalized(centred / scale)  # (B, T, C)\n        return x * self.weight + self.bias if",
           "        x = centred / scale * self.weight  # (B, T, C)\n        return self.hook_normalized(x) + self.bias if",
           HOOKS_TESTS),
    Mutant("hooks/fold-ln-drops-the-norms-bias", "hooks.py",
           "        linear.bias.add_(linear.weight @ norm.bias)\n", "", HOOKS_TESTS),
    Mutant("hooks/generation-cache-keeps-padding", "hooks.py",
           "row[name] = full[b, pad[b] : pad[b] + lengths[b]]", "row[name] = full[b, : lengths[b]]", HOOKS_TESTS),
    Mutant("patching/patch-at-the-next-position", "patching.py",
           "x[units, units] = src[units, units]", "x[units, (units + 1) % x.size(1)] = src[units, units]",
           ("tests/test_patching.py",)),
    Mutant("patching/attribution-sign", "patching.py",
           "(clean_cache[n] - acts[n].detach())", "(acts[n].detach() - clean_cache[n])", ("tests/test_patching.py",)),
    Mutant("patching/ablated-head-of-the-pattern-on-its-query-axis", "patching.py",
           "axis = 1 if attention else 2", "axis = 2",
           ("tests/test_patching.py", "-k", "ablation")),
    # LoRA (lora.py)
    Mutant("lora/qkv-blocks-misplaced", "lora.py",
           "B[start:end, j * rank : (j + 1) * rank] = layer.lora_B[s]", "B[start:end, 0:rank] = layer.lora_B[s]",
           ("tests/test_lora.py",)),
    Mutant("lora/scale-ignored", "lora.py",
           "parts.append((start, end, (h @ self.lora_A[name].t()) @ self.lora_B[name].t() * self.scale))",
           "parts.append((start, end, (h @ self.lora_A[name].t()) @ self.lora_B[name].t()))", ("tests/test_lora.py",)),
    Mutant("lora/resume-skips-the-adapters", "train/checkpointing.py",
           "            for name, tensor in weights.items():\n                own[name].copy_(tensor)\n        return",
           "            pass\n        return", ("tests/test_lora.py", "-k", "training")),
    Mutant("lora/quantized-base-stops-gradients", "quantize.py",
           "return grad_y @ weight, None  # (..., K)", "return torch.zeros_like(grad_y @ weight), None",
           ("tests/test_lora.py",)),
    Mutant("lora/merge-scales-by-alpha-twice", "lora.py",
           "delta[start:end] += self.scale * (self.lora_B[name] @ self.lora_A[name])",
           "delta[start:end] += self.scale * self.scale * (self.lora_B[name] @ self.lora_A[name])",
           ("tests/test_lora.py",)),
    Mutant("lora/merge-in-conv1d-layout", "lora.py",  # fan_in_fan_out applied where the weight is (out, in)
           "base.weight.add_(layer.delta_weight().to(base.weight.dtype))",
           "base.weight.add_(layer.delta_weight().t().reshape(base.weight.shape).to(base.weight.dtype))",
           ("tests/test_lora.py",)),
    Mutant("lora/classifier-head-left-out", "lora.py",
           '        tensors[f"{PREFIX}score.weight"] = model.score.weight.detach().float().contiguous()\n', "",
           ("tests/test_classifier.py", "-k", "peft")),
    Mutant("lora/modules-to-save-not-loaded", "lora.py",
           "        for name, tensor in saved.items():\n            own[name].copy_(tensor)",
           "        for name, tensor in saved.items():\n            pass", ("tests/test_classifier.py", "-k", "peft")),
    # Instruction tuning (sft.py, the segments in model.py) and classification (classifier.py)
    Mutant("sft/mask-off-by-one", "sft.py",
           "np.where(mask[1 : n + 1], ids[1 : n + 1], IGNORE)", "np.where(mask[0:n], ids[1 : n + 1], IGNORE)",
           ("tests/test_sft.py",)),
    Mutant("sft/attention-crosses-examples", "model.py",
           "mask = causal_mask(T, T, idx.device) & (segments[:, None, :, None] == segments[:, None, None, :])",
           "mask = causal_mask(T, T, idx.device)[None, None].expand(B, 1, T, T)", ("tests/test_sft.py",)),
    Mutant("sft/positions-run-on", "model.py",
           "            positions = segment_positions(segments)  # (B, T)",
           "            positions = torch.arange(T, device=idx.device).expand(B, T)", ("tests/test_sft.py",)),
    Mutant("sft/head-rows-misaligned", "chunked_loss.py",
           "x.reshape(-1, x.size(-1))[keep.reshape(-1)], targets.reshape(-1)[keep.reshape(-1)]",
           "x.reshape(-1, x.size(-1))[keep.reshape(-1).roll(1)], targets.reshape(-1)[keep.reshape(-1)]",
           ("tests/test_sft.py",)),
    Mutant("classify/pools-the-last-position", "classifier.py",
           "last = (torch.arange(T, device=idx.device) * mask).argmax(-1)",
           "last = torch.full((B,), T - 1, device=idx.device)", ("tests/test_classifier.py",)),
    Mutant("classify/left-padding-positions-not-shifted", "classifier.py",
           "positions = (mask.long().cumsum(1) - 1).clamp(min=0)",
           "positions = torch.arange(T, device=idx.device).expand(B, T)", ("tests/test_classifier.py",)),
    Mutant("classify/labels-shuffled-in-batches", "classify_data.py",
           "labels = self.labels[chosen].copy()", "labels = np.sort(self.labels[chosen])",
           ("tests/test_classifier.py",)),
    Mutant("classify/empty-label-taken-as-a-label", "classify_data.py",
           'if r.get("label") is None or not str(r["label"]).strip():', 'if r.get("label") is None:',
           ("tests/test_classifier.py", "-k", "without_a_label")),
    # lm-eval: the backend (harness.py) and what local-completions reads from the server
    Mutant("harness/continuation-split-one-early", "harness.py",
           "torch.arange(fed - n, fed)", "torch.arange(fed - n - 1, fed - 1)", HARNESS_TESTS),
    Mutant("harness/rolling-windows-overlap", "harness.py",
           "max_seq_len=self.max_length, context_len=1", "max_seq_len=self.max_length, context_len=16",
           HARNESS_TESTS),
    Mutant("harness/no-prefix-token", "harness.py",
           "token_list=self.tok_encode(text), prefix_token=self.prefix_token_id",
           "token_list=self.tok_encode(text)[1:], prefix_token=self.tok_encode(text)[0]", HARNESS_TESTS),
    Mutant("harness/generation-kwargs-not-normalized", "harness.py",
           "kwargs = dict(normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS))",
           'kwargs = {"until": [], "max_gen_toks": DEFAULT_MAX_GEN_TOKS, "do_sample": False, **gen_kwargs}',
           ("tests/test_harness.py", "-k", "generation_kwargs")),
    Mutant("harness/negative-batch-size-accepted", "harness.py",
           "if size < 1 or isinstance(value, bool):", "if size == 0 or isinstance(value, bool):",
           ("tests/test_harness.py", "-k", "batch_size_below")),
    Mutant("serve/openai-four-stop-limit", "serve/completions.py", "MAX_STOPS = 16", "MAX_STOPS = 4",
           ("tests/test_serve_lmeval.py", "-k", "more_than_four")),
    Mutant("serve/text-offset-in-tokens", "serve/completions.py",
           "offset += len(text.decode(self.state.tokenizer.decode_bytes([token])))", "offset += 1",
           SERVE_LMEVAL_TESTS),
    # thread counts other than CI's 2: each thread's share of a kernel's rows
    Mutant("kernels/last-thread-loses-its-last-rows-beyond-two-threads", "csrc/common.h",
           "b = (int)(units * (t + 1) / nt) * unit;", "b = (int)(units * (t + 1) / nt - (nt > 2 && t == nt - 1)) * unit;",
           ("tests/test_kernels.py", "-k", "same_bits_on_any")),
    # the server's threads (a second thread that keeps OpenMP helpers makes every team sleep)
    Mutant("serve/explorer-keeps-its-openmp-helpers", "serve/explorer.py",
           '"/lens", computes(self.lens)', '"/lens", self.lens', ("tests/test_serve.py", "-k", "release")),
    Mutant("serve/release-threads-does-nothing", "csrc/cpu.c",
           "return omp_pause_resource_all(omp_pause_soft);", "return 0;", ("tests/test_serve.py", "-k", "release")),
    Mutant("serve/step-view-keeps-its-first-position", "serve/scheduler.py",
           "        view.pos = self.pos\n", "", ("tests/test_serve.py", "-k", "scheduler or replaced")),
    Mutant("fused/many-rows-last-row-not-normed", "csrc/decode_step.c",
           "    for (int r = 0; r < M; r++) {\n        const float *xr = x + (size_t)r * C;",
           "    for (int r = 0; r < M - (M >= PARALLEL_ROWS); r++) {\n        const float *xr = x + (size_t)r * C;",
           ("tests/test_fused_step.py", "-k", "many_rows")),
    Mutant("fused/int8-steps-of-many-rows-in-c", "fused_step.py",
           'mode == "int4" or (mode == "int8" and not ops.fbgemm_int8_is_exact())', 'mode in ("int4", "int8")',
           ("tests/test_fused_step.py", "-k", "many_rows")),
    Mutant("sampling/temperature-below-one-ignored", "sampling.py",
           "    if params.temperature != 1.0:  # x / 1 is x", "    if params.temperature > 1.0:  # x / 1 is x",
           SAMPLING_TESTS),
    # the top-p nucleus in C (csrc/sampling.c): only the bucket it ends in sorted
    Mutant("sampling/top-p-buckets-below-the-edge-kept", "csrc/sampling.c",
           "keep[i] = b > edge;", "keep[i] = b < edge;", ("tests/test_sampling.py",)),
    Mutant("sampling/top-p-edge-sorted-least-likely-first", "csrc/sampling.c",
           "return x->p > y->p ? -1 : 1;", "return x->p < y->p ? -1 : 1;", ("tests/test_sampling.py",)),
    Mutant("sampling/top-p-equal-probabilities-last-id-first", "csrc/sampling.c",
           "return (x->i > y->i) - (x->i < y->i);", "return (x->i < y->i) - (x->i > y->i);",
           ("tests/test_sampling.py",)),
    Mutant("sampling/top-p-edge-bucket-one-low", "csrc/sampling.c",
           "while (edge >= 0 && above + mass[edge] < p)", "while (edge >= 0 && above + mass[edge] <= p + 0.01)",
           ("tests/test_sampling.py",)),
    Mutant("sampling/top-p-always-sorted", "sampling.py",
           "keep = ops.top_p_keep(probs, p)  # in C", "keep = None  # in C", ("tests/test_sampling.py",)),
    Mutant("sampling/c-draw-at-or-past-u", "csrc/sampling.c", "if (sum > at) {", "if (sum >= at) {",
           ("tests/test_sampling.py",)),
    Mutant("sampling/c-draw-takes-any-row", "csrc/sampling.c",
           "        if (!(total > 0.0) || total > DBL_MAX) return -3;\n", "", ("tests/test_sampling.py",)),
    Mutant("sampling/c-draw-past-the-end-takes-the-first", "csrc/sampling.c", "int id = V - 1;", "int id = 0;",
           ("tests/test_sampling.py",)),
    # decoding steps taken before the model's forward (fused_step.decode), its checks in C
    Mutant("fused/step-ids-unchecked-in-c", "csrc/decode_step.c",
           "    if (!in_range(m, tokens, positions, M, T, pos)) return -3;\n", "", FUSED_TESTS),
    Mutant("fused/slots-positions-one-late", "csrc/decode_step.c",
           "positions ? positions[r] : pos + r % T;", "positions ? positions[r] : pos + r % T + 1;", FUSED_TESTS),
    Mutant("fused/early-step-drops-positions", "fused_step.py",
           "_run(p, cache, tokens, positions, B, 1,", "_run(p, cache, tokens, None, B, 1,", FUSED_TESTS),
    Mutant("fused/early-step-ignores-hooks", "fused_step.py",
           "        and not p.hooked()\n    ):", "    ):", FUSED_TESTS),
    Mutant("fused/early-step-never-taken", "fused_step.py",
           "        return None  # (compiled decoding's position is a 0-dim tensor)",
           "        pass  # (compiled decoding's position is a 0-dim tensor)\n    return None", FUSED_TESTS),
    Mutant("fused/decode-step-records-autograd", "generation.py",
           "        with torch.no_grad():\n            logits = _next_logits(model, tokens, cache, positions, key_mask)",
           "        logits = _next_logits(model, tokens, cache, positions, key_mask)", FUSED_TESTS),
    # inputs refused up front rather than run wrong (speculative decoding, the CLI's --out)
    Mutant("speculative/long-prompt-cropped-to-window-keep", "speculative.py",
           "[list(r[-block:]) for r in rows]", "[list(r) for r in rows]",
           ("tests/test_speculative.py", "-k", "longer_than")),
    Mutant("speculative/window-keep-zero-taken-as-the-default", "kv_cache.py",
           "keep = block_size * 3 // 4 if keep is None else keep", "keep = keep or block_size * 3 // 4",
           ("tests/test_speculative.py", "-k", "bad_settings")),
    Mutant("train/keep-checkpoints-zero-accepted", "train_config.py",
           'positive += ["keep_checkpoints", ', "positive += [", ("tests/test_train.py", "-k", "counts_of_zero")),
    Mutant("cli/out-compared-with-the-run-not-the-checkpoint-it-reads", "commands/_model_args.py",
           'read = checkpoint_path(source).resolve() if flag == "model" else', "read =",
           ("tests/test_cli.py", "-k", "writing_over")),
    Mutant("serve/usage-on-every-stream-chunk", "serve/completions.py",
           'extra = {"usage": None} if include_usage else {}', 'extra = {"usage": self.usage()}',
           ("tests/test_serve.py", "-k", "streaming")),
    Mutant("serve/end-of-text-without-its-logprob", "serve/completions.py",
           "*choice.end_of_text(token, lp, top)", '*choice.finish("stop")',
           ("tests/test_serve.py", "-k", "completion_equals_generate")),
    Mutant("lora/adapter-of-another-width-unchecked", "lora.py",
           "if A.dim() != 2 or B.dim() != 2 or A.shape[1] != base.in_features or B.shape != (base.out_features, A.shape[0]):",
           "if False:", ("tests/test_lora.py", "-k", "another_model")),
    Mutant("sft/examples-cut-before-their-response-trained", "sft.py",
           "if empty == len(examples):", "if False:", ("tests/test_sft.py", "-k", "cuts_off")),
    Mutant("train/data-of-another-tokenizer-accepted", "train/setup.py",
           'if model_tokenizer != manifest["tokenizer"]:', "if False:", ("tests/test_train.py", "-k", "vocabulary")),
    Mutant("train/lora-base-recorded-as-given", "train/checkpointing.py",
           "str(checkpoint_path(init_from).resolve()) if Path(init_from).exists() else init_from", "init_from",
           ("tests/test_lora.py", "-k", "recorded")),
    Mutant("data/out-inside-input-read-again", "data.py",
           "and (skip is None or skip not in p.resolve().parents)", "", ("tests/test_data.py", "-k", "input_directory")),
    Mutant("data/val-split-takes-every-token", "data.py",
           "n_val = min(n_tokens - 1, max(1, round(n_tokens * val_fraction)))",
           "n_val = max(1, round(n_tokens * val_fraction))", ("tests/test_data.py", "-k", "tiny_input")),
    Mutant("data/truncated-token-file-unnamed", "data.py",
           "    if size % dtype.itemsize:\n", "    if False:\n", ("tests/test_data.py", "-k", "loader_errors")),
    Mutant("data/jsonl-text-records-tokenized-as-json", "data.py",
           'if path.suffix == ".jsonl":', "if False:", ("tests/test_data.py", "-k", "json_records")),
    Mutant("data/rerun-keeps-the-old-manifest-while-splits-are-replaced", "data.py",
           "        (out_dir / MANIFEST).unlink(missing_ok=True)\n", "", ("tests/test_data.py", "-k", "stale_manifest")),
    Mutant("data/mistyped-path-reported-as-a-hub-failure", "data.py",
           "    except Exception as e:  # not found, no network", "    except ImportError as e:  # not found, no network",
           ("tests/test_data.py", "-k", "mistyped")),
    Mutant("data/crlf-file-read-as-one-piece", "data.py",
           '_SAFE_CUT = re.compile(r"\\S\\r?\\n(?=\\S)")', '_SAFE_CUT = re.compile(r"\\S\\n(?=\\S)")',
           ("tests/test_data.py", "-k", "windows_file")),
    Mutant("data/empty-input-directory-looked-up-as-a-dataset", "data.py",
           "    if Path(spec).exists():  # an empty directory", "    if False:  # an empty directory",
           ("tests/test_data.py", "-k", "mistyped")),
    Mutant("data/workers-below-one-run-in-process", "data.py",
           "    if workers is not None and workers < 1:", "    if False:", ("tests/test_data.py", "-k", "glob_and_errors")),
    Mutant("generate/stop-escapes-left-literal", "commands/generate.py",
           "type=unescape, ", "", ("tests/test_generate.py", "-k", "sampling_flags")),
    Mutant("inspect/top-zero-accepted", "inspect.py", "or top < 1:", "or top < 0:",
           ("tests/test_inspect.py", "-k", "bad_prompts")),
    Mutant("inspect/token-labels-read-as-mathtext", "inspect.py",
           "labels[::step], **PLAIN, **kwargs)", "labels[::step], **kwargs)", ("tests/test_inspect.py", "-k", "dollar")),
    Mutant("inspect/attention-figure-grows-with-the-prompt", "inspect.py",
           "side = min(max(3.0, 0.25 * T + 1.2), (MAX_SQUARE_INCHES - 1.5) / cols)", "side = max(3.0, 0.25 * T + 1.2)",
           ("tests/test_inspect.py", "-k", "long_prompts")),
    Mutant("inspect/thinned-ticks-labelled-from-the-first-tokens", "inspect.py",
           "labels[::step], **PLAIN", "labels[: len(labels) // step + (len(labels) % step > 0)], **PLAIN",
           ("tests/test_inspect.py", "-k", "long_prompts")),
    Mutant("cli/classifier-loaded-as-a-language-model", "commands/_model_args.py",
           "if model.config.num_labels and not classifier:", "if False:",
           ("tests/test_inspect.py", "-k", "classifier")),
    Mutant("inspect/classifier-counted-with-a-vocabulary-head", "inspect.py",
           'head = ("score", 1, config.num_labels, C) if config.num_labels else', "head =",
           ("tests/test_inspect.py", "-k", "classifier_counts")),
    Mutant("inspect/endoftext-in-a-prompt-read-as-text", "inspect.py",
           'ids = tokenizer.encode(prompt, allowed_special="all")', "ids = tokenizer.encode(prompt)",
           ("tests/test_inspect.py", "-k", "endoftext")),
    Mutant("inspect/nan-logits-read-as-a-distribution", "inspect.py",
           "    if not torch.isfinite(logits).all():", "    if False:", ("tests/test_inspect.py", "-k", "overflow")),
    Mutant("patching/nan-metric-read-as-no-difference", "patching.py",
           "    if not torch.isfinite(value).all():", "    if False:", ("tests/test_inspect.py", "-k", "overflow")),
    Mutant("cli/empty-json-path-writes-nothing", "commands/next.py", "if args.json is not None:", "if args.json:",
           ("tests/test_inspect.py", "-k", "bad_input")),
    Mutant("config/toml-table-beside-train-ignored", "train_config.py", "if tables:  #", "if False:  #",
           ("tests/test_train.py", "-k", "toml")),
    Mutant("quantize/lora-run-written-unmerged", "commands/quantize.py",
           "    if lora_layers(model):", "    if args.adapter:", ("tests/test_lora.py", "-k", "fp32")),
    Mutant("hooks/rotary-points-on-gpt2", "model.py",
           'rotary = ("rot_q", "rot_k") if config.pos_embedding == "rope" else ()', 'rotary = ("rot_q", "rot_k")',
           ("tests/test_hooks.py", "-k", "cached_values")),
    Mutant("generation/decode-rows-unchecked-against-the-cache", "generation.py",
           "    cache.check_room(tokens.size(0), 1)\n", "", ("tests/test_generate.py", "-k", "fit_the_cache")),
    Mutant("quantize/kernels-left-on-moved-buffers", "quantize.py",
           "        super()._apply(fn, recurse)\n        if bound:  # bound to the buffers before they moved\n            self.prepare()\n",
           "        super()._apply(fn, recurse)\n", ("tests/test_quantize.py", "-k", "rebinds")),
    Mutant("hf/exact-gelu-read-as-tanh", "hf.py", '"gelu": "gelu_erf"}', '"gelu": "gelu"}',
           ("tests/test_hf.py", "-k", "parity")),
    Mutant("cli/out-over-another-training-checkpoint-written", "commands/_model_args.py",
           "if (out / STATE_FILE).is_file() or", "if", ("tests/test_cli.py", "-k", "writing_over")),
    Mutant("hooks/last-block-trimmed-under-a-hooked-final-norm", "model.py",
           "not (block.hooked() or every_position)", "not block.hooked()",
           ("tests/test_hooks.py", "-k", "generation_caches")),
    Mutant("hooks/split-views-edited-in-place", "hooks.py",
           "return x.clone() if x.requires_grad and x._is_view() else x", "return x",
           ("tests/test_hooks.py", "-k", "in_place")),
    Mutant("patching/attention-mean-over-heads", "patching.py",
           "mean(dim=0 if attention else (0, 1), keepdim=True)", "mean(dim=(0, 1), keepdim=True)",
           ("tests/test_patching.py", "-k", "ablation")),
    Mutant("patching/scalar-metric-found-after-the-grid", "patching.py",
           "if not isinstance(value, torch.Tensor) or value.shape != logits.shape[:1]:", "if False:",
           ("tests/test_patching.py", "-k", "value_per_row")),
    Mutant("hooks/points-in-registration-order", "hooks.py",
           "return dict(sorted(points.items(), key=lambda item: _forward_position(item[0])))", "return points",
           ("tests/test_hooks.py", "-k", "order")),
    Mutant("hooks/targets-dropped", "hooks.py", 'if forward_kwargs.get("targets") is not None:', "if False:",
           ("tests/test_hooks.py", "-k", "names_filter")),
    Mutant("speculative/draft-window-counted-from-the-row-start", "speculative.py",
           "chunks = [r[d + n :] for r, d, n in", "chunks = [r[n:] for r, d, n in",
           ("tests/test_speculative.py", "-k", "slides")),
    # the explorer page (tests/test_serve_browser.py drives it in Chromium)
    Mutant("explorer/picked-token-sent-as-its-text", "serve/static/app.js",
           '  return state.ids ?? $("prompt").value;', '  return $("prompt").value;',
           ("tests/test_serve_browser.py", "-k", "picked")),
    Mutant("explorer/older-attention-drawn-over-the-layer-picked", "serve/static/app.js",
           "    if (attentionRun === state.attention) renderAttention(attention);", "    renderAttention(attention);",
           ("tests/test_serve_browser.py", "-k", "last_layer")),
    Mutant("explorer/patch-cell-read-with-the-form-of-now", "serve/static/app.js",
           '"/api/patch/cell", { ...request, layer', '"/api/patch/cell", { ...patchRequest(), layer',
           ("tests/test_serve_browser.py", "-k", "patching")),
    Mutant("explorer/predict-again-recorded-twice", "serve/static/app.js",
           "  if (same) return;", "", ("tests/test_serve_browser.py", "-k", "picked")),
    # training (QA of DDP and max_time)
    Mutant("train/ddp-ranks-on-their-own-clocks", "train/trainer.py",
           "        dist.all_reduce(value, op=dist.ReduceOp.MAX)\n", "",
           ("tests/test_train.py", "-k", "share_one_clock")),
    Mutant("train/loop-rereads-the-clock-after-the-last-eval", "train/trainer.py",
           "            while not at_end:", "            while not self.finished():",
           ("tests/test_train.py", "-k", "spent_in_an_evaluation")),
    Mutant("train/auto-precision-measured-on-every-rank", "train/setup.py",
           "    if not dist.enabled:\n        return decide()\n", "    if True:\n        return decide()\n",
           ("tests/test_train.py", "-k", "measured_precision")),
    Mutant("train/diverged-model-fails-the-sample", "train/evaluation.py",
           "    except NonFiniteProbabilities:", "    except ZeroDivisionError:",
           ("tests/test_train.py", "-k", "diverged_model")),
    Mutant("train/guard-calls-a-finite-loss-non-finite", "train/guards.py",
           "for k, v in values.items() if not math.isfinite(v))", "for k, v in values.items())",
           ("tests/test_train.py", "-k", "diverged_model")),
    Mutant("train/every-torchrun-rank-reports", "commands/train.py",
           'main = os.environ.get("RANK", "0") == "0"', "main = True",
           ("tests/test_train.py", "-k", "rank_0_alone")),
    Mutant("train/other-ranks-keep-the-checkpoint-they-resumed-from", "train/checkpointing.py",
           "    trainer.last_checkpoint = decided_on_rank0(trainer.dist, trainer.device, publish)",
           "    path = decided_on_rank0(trainer.dist, trainer.device, publish)\n"
           "    trainer.last_checkpoint = path if trainer.dist.is_main else trainer.last_checkpoint",
           ("tests/test_train.py", "-k", "rank_0_alone")),
    Mutant("train/resume-compares-world-size-x-grad-accum-only", "train/checkpointing.py",
           "    if math.prod(batch_was) != math.prod(batch_now):", "    if batch_was[:2] != batch_now[:2]:",
           ("tests/test_train.py", "-k", "global_batch")),
    Mutant("train/resume-flags-batch-size-of-the-same-global-batch", "train/checkpointing.py",
           '        changed.pop("batch_size", None)', "        pass", ("tests/test_train.py", "-k", "global_batch")),
    Mutant("config/infinite-lr-accepted", "train_config.py",
           "and not math.isfinite(value):", "and math.isnan(value):", ("tests/test_train.py", "-k", "nonsense")),
    Mutant("config/spike-zscore-of-zero-accepted", "train_config.py",
           "        if not self.spike_zscore > 0:", "        if self.spike_zscore < 0:",
           ("tests/test_train.py", "-k", "nonsense")),
    Mutant("kernels/int-kernels-handed-no-rows", "ops.py",
           "return 0 < x.numel() <= max_rows * x.size(-1) and", "return x.numel() <= max_rows * x.size(-1) and",
           ("tests/test_kernels.py", "-k", "no_rows and int4")),
    Mutant("kernels/float-kernel-handed-no-rows", "linear.py",
           "        x.numel() > 0\n        and x.dtype is weight.dtype", "        x.dtype is weight.dtype",
           ("tests/test_kernels.py", "-k", "no_inputs")),
    Mutant("model/empty-batch-reaches-the-vocabulary-check", "model.py",
           "        if idx.size(0) == 0:\n", "        if False:\n", ("tests/test_model.py", "-k", "bad_input")),
    Mutant("kernels/unrunnable-variant-a-traceback-from-the-cli", "kernels.py",
           "    if missing_features(want):\n        raise ValueError(", "    if missing_features(want):\n        raise RuntimeError(",
           ("tests/test_cli.py", "-k", "cannot_run")),
    Mutant("machine-cache/corrupt-entry-read-as-timings", "machine_cache.py",
           "        if valid(cache[key]):\n", "        if True:\n",
           ("tests/test_gemm_probe.py", "tests/test_int8_prompts.py", "tests/test_compile_cache.py", "-k", "corrupt")),
    Mutant("machine-cache/a-string-timing-taken-as-seconds", "machine_cache.py",
           "return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf",
           "return value is not None", ("tests/test_int8_prompts.py", "-k", "corrupt")),
    Mutant("install/cc-with-arguments-run-as-one-program", "kernel_build.py",
           "*shlex.split(cc or compiler()), *COMMON_FLAGS,", "cc or compiler(), *COMMON_FLAGS,",
           ("tests/test_kernel_variants.py", "-k", "cc_may_hold")),
    Mutant("install/no-compiler-leaves-an-empty-temporary-library", "kernel_build.py",
           "    cc = cc or compiler()  # before the temporary file: without a compiler it was left behind, empty\n"
           "    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=\".so.tmp\")\n    os.close(fd)\n"
           "    try:\n        cmd = command(variant, tmp, cc)\n",
           "    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=\".so.tmp\")\n    os.close(fd)\n"
           "    cmd = command(variant, tmp, cc)\n    try:\n",
           ("tests/test_kernel_variants.py", "-k", "no_compiler")),
    Mutant("kernels/unreadable-features-blamed-on-the-cpu", "kernels.py",
           "    if features_unread() and variant in kernel_build.buildable():", "    if False:",
           ("tests/test_kernel_variants.py", "-k", "blamed_on_the_cpu")),
    Mutant("kernels/command-report-outside-its-error-handling", "kernels.py",
           "    try:\n        lines = report()\n    except (ValueError, RuntimeError) as e:",
           "    lines = report()\n    try:\n        pass\n    except (ValueError, RuntimeError) as e:",
           ("tests/test_kernel_variants.py", "-k", "command_names")),
    Mutant("quantize/int8-group-size-silently-ignored", "commands/quantize.py",
           "    if args.group_size is not None and args.mode != \"int4\":", "    if False:",
           ("tests/test_quantize.py", "-k", "cli_quantize")),
    Mutant("quantize/bf16-source-size-given-as-a-share-of-fp32", "commands/quantize.py",
           "of the {float_dtype} weights", "of the fp32 weights",
           ("tests/test_quantize.py", "-k", "share_of_the_weights")),
    Mutant("gemm/gptlab-forced-without-kernels-named-but-not-run", "gemm.py",
           '    if want == "gptlab" and kernels.library() is None:', "    if False:",
           ("tests/test_gemm_probe.py", "-k", "said_once")),
    Mutant("int8-prompts/forced-onednn-without-kernels-ignored-unsaid", "int8_prompts.py",
           '    if want == "auto" or exact and (kernel or want == "fbgemm"):', '    if want == "auto" or exact:',
           ("tests/test_int8_prompts.py", "-k", "warned_of_once")),
    Mutant("bench/summary-counts-a-run-made-otherwise", "bench/summary.py",
           "    for run in filter(made_as_make_bench, runs):", "    for run in runs:",
           ("tests/test_bench.py", "-k", "counts_only_runs_made")),
    Mutant("bench/summary-reads-a-malformed-result", "bench/summary.py",
           "        if problem := malformed(run):\n            log.warning(\"skipped %s: %s\", path, problem)\n            continue\n",
           "", ("tests/test_bench.py", "-k", "malformed")),
    Mutant("bench/summary-orders-results-by-their-time-as-text", "bench/summary.py",
           'key=lambda run: (_when(run["time"]), run["file"])', 'key=lambda run: (run["time"], run["file"])',
           ("tests/test_bench.py", "-k", "whatever_its_zone")),
    Mutant("bench/generate-decode-from-different-repeats", "bench/generate.py",
           "decodes = [total - prefill for prefill, total in zip(prefills, totals, strict=True) if total > prefill]",
           "decodes = [max(min(totals) - min(prefills), 1e-9)]", ("tests/test_bench.py", "-k", "own_prefill")),
    Mutant("bench/generate-one-new-token-accepted", "bench/generate.py", "type=at_least(2, ", "type=at_least(1, ",
           ("tests/test_bench.py", "-k", "two_new_tokens")),
    Mutant("bench/out-checked-only-when-the-results-are-written", "bench/common.py",
           '"--out", type=results_directory, default=', '"--out", default=',
           ("tests/test_bench.py", "-k", "cannot_be_written and nanogpt")),  # the others would run their bench
    Mutant("bench/results-of-the-same-second-overwritten", "bench/common.py",
           "return next(directory / name for name in names if _claim(directory / name))",
           'return directory / f"{stem}.json"', ("tests/test_bench.py", "-k", "same_second")),
    Mutant("bench/nanogpt-wall-time-of-zero-accepted", "bench/nanogpt.py", '"--seconds", type=positive_seconds,',
           '"--seconds", type=float,', ("tests/test_bench.py", "-k", "wall_time")),
    Mutant("bench/child-training-error-dropped", "bench/common.py",
           "    if proc.returncode:\n        raise ValueError(", "    if proc.returncode:\n        raise RuntimeError(",
           ("tests/test_bench.py", "-k", "why_gptlab_train_failed or failed_child")),
    Mutant("bench/recipes-starts-without-prepared-data", "bench/recipes.py", "        check_prepared(args.data)\n", "",
           ("tests/test_bench.py", "-k", "recipes_names")),
    Mutant("demo/set-out-dir-silently-replaced", "commands/demo.py", "    check_overrides(args.overrides)\n", "",
           ("tests/test_cli.py", "-k", "directories_it_sets")),
    Mutant("bench/generate-flag-its-peer-ignores-only-warned", "bench/generate.py",
           "            parser.error(f\"{', '.join(given)}: not read", "            log.warning(f\"{', '.join(given)}: not read",
           ("tests/test_bench.py", "-k", "flags_its_peer")),
    Mutant("bench/generate-batch-read-with-int", "bench/generate.py",
           'return tuple(positive(size) for size in text.split(","))', 'return tuple(int(size) for size in text.split(","))',
           ("tests/test_bench.py", "-k", "flags_its_peer")),
    Mutant("bench/generate-unknown-mode-found-after-probing", "bench/generate.py",
           'if unknown := [mode for mode in args.modes.split(",") if mode not in MODES]:', "if unknown := []:",
           ("tests/test_bench.py", "-k", "transformers_cannot_run")),
    Mutant("bench/generate-noisy-repeat-not-run-again", "bench/generate.py",
           "< repeats and len(tn) < 2 * repeats:", "< repeats and len(tn) < repeats:",
           ("tests/test_bench.py", "-k", "own_prefill")),
    Mutant("bench/train-device-left-to-torch", "bench/train.py", '        check_device(args.device, "--device")\n',
           "        pass\n", ("tests/test_bench.py", "-k", "device_it_cannot")),
    Mutant("bench/quantize-model-checked-after-the-random-rows", "bench/quantize.py",
           "            load_config(args.model)\n", "            pass\n", ("tests/test_bench.py", "-k", "quantize_checks")),
    Mutant("sft/rows-padded-with-gpt2s-end-whatever-the-tokenizer", "train/setup.py",
           'common["pad_id"] = get_tokenizer(manifest["tokenizer"]).eot_token', 'common["pad_id"] = 50256',
           ("tests/test_sft.py", "tests/test_classifier.py", "-k", "byte_tokenize")),
    Mutant("classify/csv-byte-order-mark-kept", "sft.py",
           'text = path.read_text(encoding="utf-8-sig")', 'text = path.read_text(encoding="utf-8")',
           ("tests/test_classifier.py", "-k", "byte_order")),
    Mutant("classify/validation-wraps-around-and-scores-texts-twice", "classify_data.py",
           "labels[self.wrapped(k)] = IGNORE", "pass", ("tests/test_classifier.py", "-k", "scores_each")),
    Mutant("gguf/writer-logs-the-temporary-file", "formats/gguf.py",
           '        with _quiet(logging.getLogger("gguf.gguf_writer")):', "        with contextlib.nullcontext():",
           ("tests/test_formats_gguf.py", "-k", "temporary")),
    Mutant("export/quantized-model-sent-to-the-format", "commands/export.py",
           "    check_not_quantized(model, args.model, fmt)\n", "", ("tests/test_quantize.py", "-k", "float_original")),
    Mutant("data/wrapped-rows-past-the-pass-kept", "data.py",
           "        return self.positions(k) >= self.units()", "        return self.positions(k) < 0",
           ("tests/test_data.py", "tests/test_train.py", "-k", "wrap or each_window_once")),
    Mutant("data/wrapped-windows-keep-their-targets", "data.py",
           "        y[self.wrapped(k)] = IGNORE\n        return", "        return",
           ("tests/test_data.py", "tests/test_train.py", "-k", "wrap or each_window_once")),
    Mutant("sft/wrapped-examples-scored-twice", "sft.py",
           "        y[self.wrapped(k)] = IGNORE", "        pass", ("tests/test_sft.py", "-k", "each_response_token_once")),
    Mutant("eval/val-loss-a-mean-over-batches", "train/evaluation.py",
           "            total += loss.float() * counted\n            scored += counted",
           "            total += loss.float()\n            scored += 1",
           ("tests/test_train.py", "tests/test_sft.py", "tests/test_classifier.py", "-k",
            "each_window_once or each_response_token_once or scores_each")),
    Mutant("sft/bad-record-named-without-its-file", "sft.py",
           'raise ValueError(f"{where}: {e}") from e', 'raise ValueError(f"record: {e}") from e',
           ("tests/test_sft.py", "-k", "file_and_line")),
    Mutant("lora/classifier-lm-head-target-unchecked", "lora.py",
           'if model.config.num_labels and "lm_head" in settings.targets:', "if False:",
           ("tests/test_lora.py", "-k", "classifiers_lm_head")),
    Mutant("lora/peft-bias-on-b-left-out", "lora.py",
           'if config.get("lora_bias"):', "if False:", ("tests/test_lora.py", "-k", "bias_on_b")),
    Mutant("lora/no-targets-accepted", "train_config.py",
           "        if not targets:  # no adapter", "        if False:  # no adapter",
           ("tests/test_lora.py", "-k", "naming_no_layer")),
]
# fmt: on
# The swapped-name mutant needs its table in the module: appended to hf.py with it.
EXTRA = {
    "hf/ln-1-and-ln-2-swapped": '\nSWAP = {"ln_1.weight": "ln_2.weight", "ln_2.weight": "ln_1.weight", "ln_1.bias": "ln_2.bias", "ln_2.bias": "ln_1.bias"}\n'
}  # fmt: skip


def copy_tree(dest: Path) -> Path:
    """src/ and tests/ (and pyproject.toml, for pytest's settings; the Makefile, which tests read)
    into dest/main, without caches, with the kernel libraries built there as `make install` builds
    them (kept when the checkout's were copied current; a git worktree has none, and its tests
    would otherwise build them at first use in every run, a server test's request timing out);
    dest/shared links to the checkout's ../shared (the tests find tiny-shakespeare there). Returns dest/main."""
    root = dest / "main"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for part in ("src", "tests"):
        shutil.copytree(ROOT / part, root / part, ignore=ignore)
    for name in ("pyproject.toml", "Makefile"):
        shutil.copy2(ROOT / name, root / name)
    if (ROOT.parent / "shared").is_dir():
        (dest / "shared").symlink_to(ROOT.parent / "shared")
    subprocess.run([sys.executable, str(root / "src" / "gptlab" / "kernel_build.py")], check=True, capture_output=True)
    return root


def pytest_args(tests: tuple[str, ...], root: Path) -> list[str]:
    """Test globs expanded in the copy (a glob matching nothing is dropped), options kept."""
    args = []
    for item in tests:
        if item.startswith("tests/"):
            args += sorted(os.path.relpath(p, root) for p in glob.glob(str(root / item)))
        else:
            args.append(item)
    return args


def run_pytest(root: Path, args: list[str], timeout: int) -> tuple[int, str]:
    """pytest on the copy at root, with a gptlab cache of its own beside it: a planted bug's
    first-use kernel build removes the cache's builds of other sources (kernels._remove_older_builds),
    which in the user's cache would be those a `make test` running meanwhile is loading."""
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "PYTHONDONTWRITEBYTECODE": "1",
           "GPTLAB_CACHE": str(root.parent / "cache")}  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", *args]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timed out"
    return proc.returncode, proc.stdout + proc.stderr


def first_failure(output: str) -> str:
    match = re.search(r"^(FAILED|ERROR) (\S+)", output, re.M)
    return match.group(2) if match else output.strip().splitlines()[-1] if output.strip() else "?"


@functools.cache
def runnable_variants() -> list[str]:
    """The kernel variants this CPU runs (asked of the checkout's gptlab, in a subprocess)."""
    code = "from gptlab import kernels; print(' '.join(kernels.runnable_variants()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    return out.stdout.split()


@functools.cache
def cpu_features() -> list[str]:
    """The CPU features gptlab reads (kernels.cpu_features, asked in a subprocess)."""
    code = "from gptlab import kernels; print(' '.join(sorted(kernels.cpu_features())))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    return out.stdout.split()


def staleness(m: Mutant, root: Path = ROOT) -> str:
    """Why `m` cannot be planted in the tree at root ("" when it can): its file is gone, its
    snippet is not found exactly once there, or a test file it names matches nothing."""
    path = root / "src" / "gptlab" / m.file
    if not path.is_file():
        return f"src/gptlab/{m.file} does not exist"
    count = path.read_text().count(m.old)
    if count != 1:
        return f"snippet found {count} times in src/gptlab/{m.file}: {m.old!r}"
    missing = [t for t in m.tests if t.startswith("tests/") and not glob.glob(str(root / t))]
    return f"no test file matches {', '.join(missing)}" if missing else ""


def run_mutant(m: Mutant, root: Path, timeout: int) -> tuple[str, str]:
    """(status, detail) for one mutant planted in the copy at root; the file is restored after."""
    path = root / "src" / "gptlab" / m.file
    if m.variant and m.variant not in runnable_variants():
        return "n/a", f"this CPU cannot run the {m.variant} kernels"
    if m.feature and m.feature not in cpu_features():
        return "n/a", f"this CPU has no {m.feature}"
    if stale := staleness(m, root):
        return "stale", stale
    original = path.read_text()
    try:
        path.write_text(original.replace(m.old, m.new) + EXTRA.get(m.name, ""))
        args = pytest_args(m.tests, root)
        rc, output = run_pytest(root, args, timeout)
    finally:
        path.write_text(original)
    if rc == 0:
        return "MISSED", "all of " + " ".join(a for a in args if a.startswith("tests/")) + " passed"
    if rc == -1:
        return "caught", "timed out (a hang counts as caught; check it)"
    if rc == 1:
        return "caught", first_failure(output)
    return "caught", f"pytest exit {rc} (collection or import error): {first_failure(output)}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="run only mutants whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per pytest run (default 600)")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if args.k in m.name]
    if args.list:
        for m in mutants:
            print(f"{m.name:45s} src/gptlab/{m.file}")
        return 0
    with tempfile.TemporaryDirectory(prefix="gptlab-mutants-") as tmp:
        root = copy_tree(Path(tmp))
        baselines: dict[tuple, bool] = {}
        results = []
        for m in mutants:
            key = tuple(pytest_args(m.tests, root))
            if key not in baselines:
                rc, output = run_pytest(root, list(key), args.timeout)
                baselines[key] = rc == 0
                if rc != 0:
                    print(f"baseline failing for {' '.join(key)}: {first_failure(output)}", flush=True)
            t0 = time.monotonic()
            status, detail = run_mutant(m, root, args.timeout)
            if not baselines[key] and status != "stale":
                status, detail = "baseline failing", detail
            results.append((m, status, detail))
            print(f"{status:8s} {m.name:45s} {time.monotonic() - t0:5.0f}s  {detail}", flush=True)
    caught = sum(s == "caught" for _, s, _ in results)
    print(f"\n{caught}/{len(results)} mutants caught", end="")
    others = {s: sum(x == s for _, x, _ in results) for s in ("MISSED", "stale", "baseline failing", "n/a")}
    print("".join(f", {n} {s}" for s, n in others.items() if n))
    return 0 if caught == sum(s != "n/a" for _, s, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
