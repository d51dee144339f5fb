/* What the kernel files share: scalar bf16 conversions, scratch memory, the model description
 * gl_decode_step reads, and the functions one file calls in another. */
#ifndef GL_COMMON_H
#define GL_COMMON_H

#include <limits.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define GL_ABI 23 /* gptlab/kernels.py refuses a library of another ABI */

/* Rows of W at a time (ROWS memory streams in flight) and rows of x at a time (MROWS, their
 * products kept in registers: 4 x 4 vectors fit AVX-512's 32 registers, 4 x 2 AVX2's 16). The
 * float and int8 kernels' blocks of ROWS weight rows take MROWS_R rows of x; decoding's blocks of
 * one weight row (BLOCK_ROWS below) take up to MROWS. On the AVX2 code, 4 rows of x against one
 * weight row read it once where 2 at a time read it twice (the second pass from L1, with no
 * memory traffic in flight): GPT-2's whole decoding step, AMD EPYC Zen 4 held to AVX2, 2 threads,
 * 2026-12-05, medians of 9 alternating rounds against MROWS 2 (in alternating runs of an
 * identical library the harness read 0.94-1.14x): 4 sequences fp32 1.16-1.19x, bf16 1.17x, int8
 * 1.20-1.25x; 3 sequences 1.06-1.16x; 2 and 8 level. Blocks of ROWS weight rows against 4 rows
 * of x spill AVX2's registers (bf16 prompts of 12-16 tokens 0.94-0.96x), so MROWS_R stays 2. */
#ifndef ROWS
#define ROWS 4
#endif
#if GL_VARIANT == GL_AVX512 || GL_VARIANT == GL_AVX2
#define MROWS 4
#else
#define MROWS 2
#endif
#if GL_VARIANT == GL_AVX512
#define MROWS_R 4
#else
#define MROWS_R 2
#endif

/* CALL(R, M) with R rows of W (1 or ROWS) and M (1..MROWS) rows of x as compile-time constants,
 * from their run-time values: the float and int8 kernels' one dispatch into specialized code. */
#if MROWS == 4
#define SWITCH_RM(R, M, CALL)                                                                                          \
    switch (((R) == ROWS ? 4 : 0) + (M)) {                                                                             \
    case 1: CALL(1, 1); break;                                                                                         \
    case 2: CALL(1, 2); break;                                                                                         \
    case 3: CALL(1, 3); break;                                                                                         \
    case 4: CALL(1, 4); break;                                                                                         \
    case 5: CALL(ROWS, 1); break;                                                                                      \
    case 6: CALL(ROWS, 2); break;                                                                                      \
    case 7: CALL(ROWS, 3); break;                                                                                      \
    default: CALL(ROWS, 4); break;                                                                                     \
    }
#else
#define SWITCH_RM(R, M, CALL)                                                                                          \
    switch (((R) == ROWS ? 2 : 0) + (M)) {                                                                             \
    case 1: CALL(1, 1); break;                                                                                         \
    case 2: CALL(1, 2); break;                                                                                         \
    case 3: CALL(ROWS, 1); break;                                                                                      \
    default: CALL(ROWS, 2); break;                                                                                     \
    }
#endif

/* Rows of x at a time in the int4 kernel for 3 to 15 rows (batched decoding; prompts of 16 and more
 * put rows of x in the lanes instead, quantized.c). On AVX2, 8 (against 2 weight rows, so 16
 * accumulators: some spill, and it is still faster): AMD EPYC, 2026-12-02, when it also ran
 * prompts, 512 rows, g32, 2 threads: 3072x768 25-29 -> 19.1-19.5 ms, 768x3072 19.6-20.3 ->
 * 14.3-14.8 (4 rows: 19.7-20.5 and 16.5-21.9). AVX-512 keeps MROWS, tuned on an Intel Xeon. */
#if GL_VARIANT == GL_AVX2
#define I4_MROWS 8
#else
#define I4_MROWS MROWS
#endif
_Static_assert(I4_MROWS == 2 || I4_MROWS == 4 || I4_MROWS == 8, "i4_block_r specializes 1, 2, 4 or 8 rows of x");

/* Weight rows per block when decoding (at most DECODE_MAX_M rows of x): 1 or ROWS (the blocks'
 * dispatch knows no other), chosen at load from the CPU's vendor (cpu.c, gl_decode_rows). On AMD
 * CPUs one weight stream per thread beats four: Zen 3 (AVX2, 2 threads), 2026-12-01, each layer's
 * weights streaming from memory, 1 row of x: int8 1.2-1.5x (1.1-1.3x at 4 rows, 0.83-1.1x at 8-32,
 * hence DECODE_MAX_M), bf16 1.0-1.27x, fp32 0.95-1.06x; whole-model int8 decode ~8%; Zen 4
 * (AVX-512), 2026-12-03, whole-model decode: fp32 42 -> 55 tok/s, int8 117 -> 165. The Intel Xeon's
 * AVX-512 kept four, its tuning; other CPUs take one. int4's two rows stay (one: 0.81-1.17x). */
extern int gl_decode_rows_;
/* SPLIT_SUMS: a block of one weight row keeps ROWS partial sums along it, vector k + j VW (or VB)
 * into sum j, so that the multiply-add's latency (4-5 cycles, one sum a vector) does not pace the
 * stream: ROWS rows at a time had that from their ROWS streams. */
#define DECODE_MAX_M 4
#define BLOCK_ROWS(M) ((M) <= DECODE_MAX_M ? gl_decode_rows_ : ROWS) /* rows of W per block for M rows of x */
int gl_default_decode_rows(void);

/* Software prefetch distances, bytes ahead of each weight stream; 2 threads, whole-model decode
 * steps. Float weights 8 KiB ahead and int8 4 KiB on every variant: Intel Xeon (avx512),
 * 2026-12-01, fp32 16.2-16.6 vs 16.8-17.3 ms at 512, bf16 9.4-9.8 vs 11.3; AMD Zen 4
 * (avx512-256), 2026-12-03, interleaved runs, float 8 KiB against 16: bf16 median 108 vs 98 tok/s,
 * fp32 58 vs 56 (8 runs each); AMD EPYC Zen 3 (avx2), 2026-12-01, prefetching into every cache
 * level: bf16 decode 50-51 -> 56-59 tok/s at 16 KiB against 8, the int distances within this VM's
 * noise. Non-temporal prefetches (below) land in L1 only, where 16 KiB ahead plus a 3072-float x
 * fill 7 of the Zen 3's 8 ways a set, and a line evicted before its use is read from memory again:
 * 8 KiB. AMD EPYC Zen 5 held to AVX2, 2026-12-04, non-temporal, medians of 9 alternating rounds:
 * fp32 decoding 8 KiB 1.05-1.22x 16 KiB, bf16 1.02-1.05x (4 KiB: fp32 1.03x). */
#define PF_DEFAULT_FLOAT 8192
#define PF_DEFAULT_I8 4096
/* int4: 16 KiB ahead into L2 (PF_I4_LOCALITY, below) on avx512-256 and the AVX2 variants; 8 KiB
 * elsewhere (avx512 tuned on the Intel Xeon, not measured on the others). avx512-256, AMD Zen 4,
 * 2026-12-03: 4 KiB against 8 into L1 (median 182 vs 170 tok/s, 10 runs each), then 16 KiB into L2
 * since 2026-12-05 (below). AMD EPYC Zen 5 held to AVX2, 2026-12-04: 8 KiB (two streams) 1.08x 4
 * KiB into L1. AMD EPYC Zen 4 held to AVX2 (GPTLAB_KERNELS=avx2), 2026-12-05, GPT-2 int4 decoding,
 * two builds alternating in one process, medians of the per-round ratios: prefetcht1 16 KiB
 * against prefetchnta 8 KiB 1.09x, 1.08x and 1.09x (12-16 rounds each); prefetcht1 at 8 KiB and at
 * 32 KiB level with 16. Not measured on a Zen 3. */
#if GL_VARIANT != GL_AVX512 && defined(__AVX2__)
#define PF_DEFAULT_I4 16384
#define PF_DEFAULT_I4_LOCALITY 2
#else
#define PF_DEFAULT_I4 8192
#endif
#ifndef PF_FLOAT
#define PF_FLOAT PF_DEFAULT_FLOAT
#endif
#ifndef PF_I8
#define PF_I8 PF_DEFAULT_I8
#endif
#ifndef PF_I4
#define PF_I4 PF_DEFAULT_I4
#endif
/* Where int4's spans prefetch their weights when non-temporal (prefetch_nta below): the locality
 * of __builtin_prefetch, 0 (prefetchnta: L1 only) unless a variant sets it (avx512-256 and the
 * AVX2 ones: 2, prefetcht1). On the AMD EPYC Zen 4 (avx512-256) an int4 row of 768 inputs is 384
 * bytes and its loop does little per byte, so the stream waited on L1's few outstanding misses
 * (perf: 14% of int4 decoding's samples on the prefetchnta itself); prefetcht1 lands in L2, which
 * holds more in flight. GPT-2 int4 decoding, whole model, two builds alternating in one process
 * (2026-12-05, medians of the per-round ratios, 10-12 rounds): against prefetchnta at 4 KiB,
 * prefetcht1 at 4 KiB 1.00x, at 8 KiB 1.10x, at 16 KiB 1.10x and 1.12x (every round 1.04-1.29x),
 * prefetcht2 at 8 KiB 1.11x; prefetcht1 at 16 KiB against 8 KiB 1.00x. Float decoding measured
 * slower with it (fp32 0.93x, bf16 0.91-0.97x), int8 level within the VM's noise, so they keep
 * theirs. */
#ifndef PF_DEFAULT_I4_LOCALITY
#define PF_DEFAULT_I4_LOCALITY 0
#endif
#ifndef PF_I4_LOCALITY
#define PF_I4_LOCALITY PF_DEFAULT_I4_LOCALITY
#endif

/* Prefetch a weight stream's next bytes; nta (a compile-time constant once inlined): without
 * temporal locality. Decoding reads each weight once: a non-temporal prefetch brings it into L1
 * only, so it neither fills L2 nor, through L2's evictions, L3, where the activations, the KV cache
 * and the Python objects of the next step stay. Only a window that fits L1 may go there. AMD EPYC
 * Zen 5, 2026-12-04, 2 threads, GPT-2 decoding at batch 1, medians of 9 rounds alternating builds
 * with and without it in one process: at AVX2 fp32 +6%, bf16 +14%, int8 +2%, int4 0% (+2-10% in
 * earlier rounds); at AVX-512 fp32 +6%, bf16 +6%, int4 +3%, int8 level; prompts level. */
AI void prefetch_stream(const void *p, const int nta) {
    if (nta) __builtin_prefetch(p, 0, 0);
    else __builtin_prefetch(p, 0, 3);
}
/* prefetch_stream for int4's weights: non-temporal at PF_I4_LOCALITY. */
AI void prefetch_stream_i4(const void *p, const int nta) {
    if (nta) __builtin_prefetch(p, 0, PF_I4_LOCALITY);
    else __builtin_prefetch(p, 0, 3);
}

/* Whether decoding's spans prefetch non-temporally (the kernels specialize their spans on it):
 * on AMD CPUs by default, or as set (cpu.c: gl_default_prefetch_nta, gl_set_prefetch_nta). */
extern int gl_prefetch_nta_;
static inline int prefetch_nta(void) { return gl_prefetch_nta_; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Rounded to nearest even, as torch does; NaN stays NaN (quiet). A select, not a branch, so that
 * loops of it vectorize. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u & 0x7fffffffu) > 0x7f800000u ? u | 0x400000u : u + 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Element i of a parameter vector stored as fp32, or as bf16 when bf16. */
static inline float param(const void *p, size_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Per-thread scratch for converted or quantized activations, grown on demand and kept (cpu.c). */
void *gl_scratch(size_t nbytes);

/* The calling OpenMP thread's share [*n0, *n1) of n rows, in whole units of `unit` rows (the last
 * unit may be short): decoding's kernels give each thread one span of W's rows in one call, so a
 * kernel's set-up (its specialization's call, constants, stack frame) is paid once per thread, not
 * once per block of rows (AMD EPYC Zen 4, 2026-12-03: int4 GPT-2 layers 1.3-1.4x). */
static inline void thread_rows(int n, int unit, int *n0, int *n1) {
    const long units = (n + unit - 1) / unit;
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int a = (int)(units * t / nt) * unit, b = (int)(units * (t + 1) / nt) * unit;
    *n0 = a < n ? a : n, *n1 = b < n ? b : n;
}

/* ---------------------------------------------------------------- linear layers (linear.c, quantized.c) */

/* y (M, N) = x (M, K) W^T + bias, W fp32 or (w_bf16) bf16 (N, K), x fp32 (for bf16 W: in
 * order_pairs' order), bias fp32 or (bias_bf16) bf16 or NULL; y_bf16: 0 y fp32, 1 y bf16 (rounded
 * to nearest even), 2 y fp32 holding those bf16 values. */
void gl_linear_rows(const void *w, int w_bf16, const float *x, const void *bias, int bias_bf16, void *y, int y_bf16,
                    int M, int N, int K, int nthreads);
/* y (M, N) = x (M, K) W^T + bias in gptlab's GEMM, W (N, K) read where it is (gemm.c; x, W and y
 * fp32 or bf16 as flagged, rows ldx and ldy apart, bias fp32 or NULL). Returns 0, -1 out of
 * memory, -2 bf16 x with fp32 W. */
int gl_sgemm_nt(int M, int N, int K, const void *x, long ldx, int x_bf16, const void *w, int w_bf16, void *y, long ldy,
                int y_bf16, const float *bias, int nthreads);
/* x (M, K) fp32 into xo in the order the bf16 kernel reads (see linear.c). */
void gl_order_pairs(const float *x, float *xo, int M, int K);
int gl_linear_i8(const float *x, const int8_t *w, const uint16_t *ws, const int32_t *wsum, const float *b, float *y,
                 int M, int N, int K, int nthreads);
int gl_linear_i4(const float *x, const uint8_t *w, const uint16_t *scales, const uint16_t *zeros, const float *b,
                 float *y, int M, int N, int K, int g, int nthreads);

/* ---------------------------------------------------------------- attention (attention.c) */

int gl_attend_rows(const void *qkv, int qkv_stride, void *k_cache, void *v_cache, int pos, const uint8_t *mask,
                   int mask_stride, void *out, int out_stride, int B, int nh, int hs, int max_len, int bf16,
                   int kv_bf16, int nthreads);

/* ---------------------------------------------------------------- the model gl_decode_step runs */

enum { GL_F32 = 0, GL_BF16 = 1, GL_I8 = 2, GL_I4 = 3 };
enum { GL_LAYERNORM = 0, GL_RMSNORM = 1 };
enum { GL_GELU_TANH = 0, GL_GELU_ERF = 1, GL_SWIGLU = 2 };

/* The model, described once by gptlab.fused_step: pointers to its own tensors, no copies. */
typedef struct {      /* one linear layer, y = x W^T + bias */
    int kind;         /* GL_F32 or GL_BF16 weights (N, K); GL_I8 (N, K) int8; GL_I4 (N, K/2) nibbles */
    int N, K, g;      /* g: int4 group size */
    int bias_bf16;    /* the bias is bf16 (a bf16 model's), else fp32 */
    const void *w;    /* the weights */
    const void *a;    /* GL_I8: bf16 row scales (N); GL_I4: bf16 scales (N, K/g) */
    const void *b;    /* GL_I8: int32 row sums (N); GL_I4: bf16 zeros (N, K/g) */
    const void *bias; /* (N) or NULL */
} gl_linear_t;

typedef struct {
    const void *ln1_w, *ln1_b, *ln2_w, *ln2_b; /* norm gains and biases (may be NULL), the activations' dtype */
    gl_linear_t attn, attn_proj, fc, mlp_proj;
} gl_block_t;

typedef struct {
    int n_layer, n_embd, n_head, hidden; /* hidden: the MLP's width (SwiGLU: c_fc gives 2 * hidden) */
    int norm, mlp, bf16;                 /* bf16: activations, norms (and caches) are bf16 */
    float eps;
    const gl_block_t *blocks;
    const void *lnf_w, *lnf_b;
    gl_linear_t head;
    gl_linear_t wte;  /* the token embedding (V, C), described as a layer: its table, or a tied head's */
    const void *wpe;  /* learned positions (block_size, C), the activations' dtype; NULL for rotary */
    int n_pos;        /* wpe's rows (block_size) */
} gl_model_t;

#endif /* GL_COMMON_H */
