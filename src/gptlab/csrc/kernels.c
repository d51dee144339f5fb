/* gptlab CPU kernels: linear layers for decoding, y (M, N) = x (M, K) W^T + b, for a few rows M.
 *
 * Decoding one token reads every weight once, so its speed is how fast the weights stream from
 * memory. These kernels read each weight row once for all M rows of x, in the layout the model
 * stores (no second, repacked copy), on all OpenMP threads (split over the output rows N):
 *
 *   gl_linear_f32   fp32 W (N, K), fp32 x and y.
 *   gl_linear_bf16  bf16 W (N, K), bf16 x and y; fp32 products and sums (as torch's bf16 linear),
 *                   plain AVX-512F code, so CPUs without native bf16 instructions run it too.
 *   gl_linear_i8    int8 W (N, K) with one scale per row; x quantized per row to int8 (one scale
 *                   per row of x), integer dot products (AVX-512 VNNI vpdpbusd, as llama.cpp's Q8_0).
 *   gl_linear_i4    int4 W (N, K/2) (even column in the low nibble), a scale and zero per group of
 *                   g inputs; x quantized to int8 in blocks of 32 with one scale each (Q8_0), VNNI.
 *   gl_attend_one   one decoding step's attention over a layer's KV cache (fp32 or bf16).
 *   gl_argmax_f32   greedy sampling's argmax.
 *   gl_decode_step  a whole model's forward of a few new tokens over its KV cache (see below).
 *   gl_softmax_xent training's softmax cross-entropy and its gradient over rows of logits.
 *
 * Any M works (rows of x are taken four at a time, each weight row reused from L1); the Python
 * side sends up to 8 rows (128 for int4), where these beat PyTorch's GEMMs.
 *
 * Called from Python through ctypes (gptlab/kernels.py), which builds this file with
 * -O3 -march=native -fopenmp once per CPU model. Shapes are checked on the Python side.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

/* Software prefetch distances, bytes ahead of each weight stream (tuned on an Intel Xeon, 2 threads). */
#ifndef PF_FLOAT
#define PF_FLOAT 8192 /* 2026-12-01, whole-model decode steps: fp32 16.2-16.6 vs 16.8-17.3 ms at 512; bf16 9.4-9.8 vs 11.3 */
#endif
#ifndef PF_I8
#define PF_I8 4096
#endif
#ifndef PF_I4
#define PF_I4 8192
#endif

/* Per-thread scratch for converted or quantized activations, grown on demand and kept. */
static void *scratch(size_t nbytes) {
    static __thread void *buf = NULL;
    static __thread size_t cap = 0;
    if (nbytes > cap) {
        free(buf);
        cap = (nbytes + 4095) & ~(size_t)4095;
        buf = aligned_alloc(64, cap);
        if (!buf) cap = 0;
    }
    return buf;
}

int gl_abi(void) { return 5; }

/* Back [p, p + n) by 2 MiB pages where the kernel allows (Linux 6.1+ MADV_COLLAPSE copies the
 * pages now; older kernels only mark the range). Streaming weights through 4 KiB pages costs a TLB
 * miss per 4 KiB: huge pages measured +6% fp32 decoding bandwidth (30.5 -> 32.4 GB/s, Intel Xeon).
 * Returns 0, or -1 when the range holds no whole huge page or the kernel said no. */
int gl_huge_pages(void *p, size_t n) {
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t start = ((uintptr_t)p + huge - 1) & ~(huge - 1), end = ((uintptr_t)p + n) & ~(huge - 1);
    if (end <= start) return -1;
    if (madvise((void *)start, end - start, MADV_HUGEPAGE) != 0) return -1;
    return madvise((void *)start, end - start, MADV_COLLAPSE) == 0 ? 0 : -1;
}

int gl_has_float_kernels(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

int gl_has_int_kernels(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline __m512 load_bf16x16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 load_bf16x16_masked(const uint16_t *p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Element i of a parameter vector stored as fp32, or as bf16 when bf16. */
static inline float param(const void *p, size_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* ---------------------------------------------------------------- float weights */

/* R weight rows at a time (R memory streams in flight) times M rows of x, R and M compile-time
 * constants after inlining so the R x M accumulators live in registers: out[r][m] = dot(w_r, x_m).
 * w holds fp32 or (bf16 != 0) bf16 rows of K values; bf16 converts to fp32 exactly (a shift). */
#define ROWS 4
/* acc[r][m] += w_r[k..k+16) * x_m[k..k+16) (masked by mk), for fp32 w, prefetching PF_FLOAT bytes
 * ahead of each weight stream: measured +3-8% over the hardware prefetcher alone. */
static inline __attribute__((always_inline)) void dot_step_f32(const float *w, const float *x, const int R,
                                                               const int M, int K, int k, __mmask16 mk, int masked,
                                                               __m512 acc[ROWS][ROWS]) {
    __m512 xv[ROWS];
    for (int m = 0; m < M; m++)
        xv[m] = masked ? _mm512_maskz_loadu_ps(mk, x + (size_t)m * K + k) : _mm512_loadu_ps(x + (size_t)m * K + k);
    for (int r = 0; r < R; r++) {
        const float *p = w + (size_t)r * K + k;
        _mm_prefetch((const char *)p + PF_FLOAT, _MM_HINT_T0);
        __m512 wv = masked ? _mm512_maskz_loadu_ps(mk, p) : _mm512_loadu_ps(p);
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
}

/* The same for 32 bf16 weights w_r[k..k+32): one 64-byte load gives the even-indexed weights as
 * fp32 by a shift and the odd-indexed ones by a mask (no shuffles), against x stored with each
 * block of 32 as its 16 even then its 16 odd values (see gl_linear_bf16). */
static inline __attribute__((always_inline)) void dot_step_bf16x32(const uint16_t *w, const float *x, const int R,
                                                                   const int M, int K, int k, __m512 acc[ROWS][ROWS]) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 xe[ROWS], xo[ROWS];
    for (int m = 0; m < M; m++) {
        xe[m] = _mm512_loadu_ps(x + (size_t)m * K + k);
        xo[m] = _mm512_loadu_ps(x + (size_t)m * K + k + 16);
    }
    for (int r = 0; r < R; r++) {
        const uint16_t *p = w + (size_t)r * K + k;
        _mm_prefetch((const char *)p + PF_FLOAT, _MM_HINT_T0);
        __m512i v = _mm512_loadu_si512((const void *)p);
        __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), odd = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        for (int m = 0; m < M; m++) {
            acc[r][m] = _mm512_fmadd_ps(even, xe[m], acc[r][m]);
            acc[r][m] = _mm512_fmadd_ps(odd, xo[m], acc[r][m]);
        }
    }
}

/* A tail of fewer than 32 bf16 weights (x in natural order there), 16 at a time. */
static inline __attribute__((always_inline)) void dot_step_bf16(const uint16_t *w, const float *x, const int R,
                                                                const int M, int K, int k, __mmask16 mk,
                                                                __m512 acc[ROWS][ROWS]) {
    __m512 xv[ROWS];
    for (int m = 0; m < M; m++) xv[m] = _mm512_maskz_loadu_ps(mk, x + (size_t)m * K + k);
    for (int r = 0; r < R; r++) {
        __m512 wv = load_bf16x16_masked(w + (size_t)r * K + k, mk);
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
}

static inline __attribute__((always_inline)) void dot_rm(const void *w, int bf16, const float *x, const int R,
                                                         const int M, int K, float out[ROWS][ROWS]) {
    __m512 acc[ROWS][ROWS];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    int k = 0;
    if (bf16) {
        for (; k + 32 <= K; k += 32) dot_step_bf16x32((const uint16_t *)w, x, R, M, K, k, acc);
        for (; k < K; k += 16)
            dot_step_bf16((const uint16_t *)w, x, R, M, K, k, K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1), acc);
    } else {
        for (; k + 16 <= K; k += 16) dot_step_f32((const float *)w, x, R, M, K, k, 0xffff, 0, acc);
        if (k < K) dot_step_f32((const float *)w, x, R, M, K, k, (__mmask16)((1u << (K - k)) - 1), 1, acc);
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) out[r][m] = _mm512_reduce_add_ps(acc[r][m]);
}

static void dot_block(const void *w, int bf16, const float *x, int R, int M, int K, float out[ROWS][ROWS]) {
    switch ((R == ROWS ? 4 : 0) + M) {
    case 1: dot_rm(w, bf16, x, 1, 1, K, out); break;
    case 2: dot_rm(w, bf16, x, 1, 2, K, out); break;
    case 3: dot_rm(w, bf16, x, 1, 3, K, out); break;
    case 4: dot_rm(w, bf16, x, 1, 4, K, out); break;
    case 5: dot_rm(w, bf16, x, ROWS, 1, K, out); break;
    case 6: dot_rm(w, bf16, x, ROWS, 2, K, out); break;
    case 7: dot_rm(w, bf16, x, ROWS, 3, K, out); break;
    default: dot_rm(w, bf16, x, ROWS, 4, K, out); break;
    }
}

/* y (M, N) = x (M, K) W^T + bias, W fp32 or bf16 (N, K), x fp32, bias fp32 or (bias_bf16) bf16 or NULL;
 * y_bf16: 0 y fp32, 1 y bf16 (rounded to nearest even), 2 y fp32 holding those bf16 values. */
static inline __attribute__((always_inline)) void linear_rows(const void *w, int bf16, const float *x,
                                                               const void *bias, const int bias_bf16, void *y,
                                                               int y_bf16, int M, int N, int K, int nthreads) {
    const int nblocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int blk = 0; blk < nblocks; blk++) {
        const int n0 = blk * ROWS, R = N - n0 < ROWS ? 1 : ROWS; /* the last partial block: row by row */
        for (int n = n0; n < n0 + ROWS && n < N; n += R) {
            const void *wr = bf16 ? (const void *)((const uint16_t *)w + (size_t)n * K)
                                  : (const void *)((const float *)w + (size_t)n * K);
            for (int m0 = 0; m0 < M; m0 += ROWS) {
                const int mm = M - m0 < ROWS ? M - m0 : ROWS;
                float out[ROWS][ROWS];
                dot_block(wr, bf16, x + (size_t)m0 * K, R, mm, K, out);
                for (int r = 0; r < R; r++)
                    for (int m = 0; m < mm; m++) {
                        float v = out[r][m] + (bias ? param(bias, n + r, bias_bf16) : 0.0f);
                        size_t i = (size_t)(m0 + m) * N + n + r;
                        if (y_bf16 == 1) ((uint16_t *)y)[i] = f32_to_bf16(v);
                        else ((float *)y)[i] = y_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
                    }
            }
        }
    }
}

int gl_linear_f32(const float *x, const float *w, const float *b, float *y, int M, int N, int K, int nthreads) {
    linear_rows(w, 0, x, b, 0, y, 0, M, N, K, nthreads);
    return 0;
}

/* x (M, K) fp32 into xo, each whole block of 32 as its 16 even then its 16 odd values (the
 * order dot_step_bf16x32 reads); a tail of fewer than 32 stays in order. */
static void order_pairs(const float *x, float *xo, int M, int K) {
    for (int m = 0; m < M; m++) {
        const float *xr = x + (size_t)m * K;
        float *o = xo + (size_t)m * K;
        int k = 0;
        for (; k + 32 <= K; k += 32)
            for (int i = 0; i < 16; i++) {
                o[k + i] = xr[k + 2 * i];
                o[k + 16 + i] = xr[k + 2 * i + 1];
            }
        for (; k < K; k++) o[k] = xr[k];
    }
}

/* bf16 x (M, K) and W (N, K), fp32 b (N) or NULL -> bf16 y (M, N). Returns -1 when out of memory. */
int gl_linear_bf16(const uint16_t *x, const uint16_t *w, const float *b, uint16_t *y, int M, int N, int K,
                   int nthreads) {
    float *xf = scratch((size_t)M * K * sizeof(float));
    if (!xf) return -1;
    for (int m = 0; m < M; m++) { /* fp32, each whole block of 32 as its 16 even then 16 odd values */
        const uint16_t *xr = x + (size_t)m * K;
        float *xo = xf + (size_t)m * K;
        int k = 0;
        for (; k + 32 <= K; k += 32)
            for (int i = 0; i < 16; i++) {
                xo[k + i] = bf16_to_f32(xr[k + 2 * i]);
                xo[k + 16 + i] = bf16_to_f32(xr[k + 2 * i + 1]);
            }
        for (; k < K; k++) xo[k] = bf16_to_f32(xr[k]);
    }
    linear_rows(w, 1, xf, b, 0, y, 1, M, N, K, nthreads);
    return 0;
}

/* ---------------------------------------------------------------- decoding attention and argmax */

static inline __attribute__((always_inline)) __m512 load_any(const void *p, int bf16, __mmask16 mk) {
    return bf16 ? load_bf16x16_masked((const uint16_t *)p, mk) : _mm512_maskz_loadu_ps(mk, (const float *)p);
}

/* One new token per row attends over its cache, for one layer: row b's qkv at qkv + b * qkv_stride
 * elements holds the token's query, key and value (heads side by side, as c_attn gives them); its
 * key and value are written to slot `pos` of the caches k_cache and v_cache (B, nh, max_len, hs), then
 *   out[b, h*hs:(h+1)*hs] = softmax(q . k_j / sqrt(hs), j <= pos, where mask[b, j] or j == pos) . v_j
 * (a query always sees its own slot, as the model's mask) with fp32 scores and sums, row b of out at
 * out + b * out_stride. mask: row b at mask + b * mask_stride bytes, or NULL. Tensors fp32, or bf16
 * when bf16 != 0. Returns -1 when hs > 256 or out of memory. */
static int attend_rows(const void *qkv, int qkv_stride, void *k_cache, void *v_cache, int pos, const uint8_t *mask,
                       int mask_stride, void *out, int out_stride, int B, int nh, int hs, int max_len, int bf16,
                       int nthreads) {
    if (hs > 256) return -1;
    const int C = nh * hs, S = pos + 1, es = bf16 ? 2 : 4;
    const float scale = 1.0f / sqrtf((float)hs);
    float *scores_all = scratch((size_t)B * nh * S * sizeof(float));
    if (!scores_all) return -1;
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < nh; h++) {
            const char *row = (const char *)qkv + (size_t)b * qkv_stride * es;
            size_t head = ((size_t)b * nh + h) * max_len; /* first slot of this (b, h) in the caches */
            char *kc = (char *)k_cache + head * hs * es, *vc = (char *)v_cache + head * hs * es;
            memcpy(kc + (size_t)pos * hs * es, row + (size_t)(C + h * hs) * es, (size_t)hs * es);
            memcpy(vc + (size_t)pos * hs * es, row + (size_t)(2 * C + h * hs) * es, (size_t)hs * es);
            __m512 q[16];
            const int nv = (hs + 15) / 16;
            for (int v = 0; v < nv; v++) {
                int rem = hs - 16 * v;
                __mmask16 mk = rem >= 16 ? 0xffff : (__mmask16)((1u << rem) - 1);
                q[v] = _mm512_mul_ps(load_any(row + (size_t)(h * hs + 16 * v) * es, bf16, mk), _mm512_set1_ps(scale));
            }
            float *sc = scores_all + ((size_t)b * nh + h) * S, smax = -INFINITY;
            for (int j = 0; j < S; j++) {
                if (mask && !mask[(size_t)b * mask_stride + j] && j != pos) {
                    sc[j] = -INFINITY;
                    continue;
                }
                __m512 acc = _mm512_setzero_ps();
                for (int v = 0; v < nv; v++) {
                    int rem = hs - 16 * v;
                    __mmask16 mk = rem >= 16 ? 0xffff : (__mmask16)((1u << rem) - 1);
                    acc = _mm512_fmadd_ps(q[v], load_any(kc + ((size_t)j * hs + 16 * v) * es, bf16, mk), acc);
                }
                sc[j] = _mm512_reduce_add_ps(acc);
                smax = sc[j] > smax ? sc[j] : smax;
            }
            float total = 0.0f;
            for (int j = 0; j < S; j++) {
                sc[j] = sc[j] == -INFINITY ? 0.0f : expf(sc[j] - smax);
                total += sc[j];
            }
            __m512 acc[16];
            for (int v = 0; v < nv; v++) acc[v] = _mm512_setzero_ps();
            for (int j = 0; j < S; j++) {
                if (sc[j] == 0.0f) continue;
                __m512 p = _mm512_set1_ps(sc[j] / total);
                for (int v = 0; v < nv; v++) {
                    int rem = hs - 16 * v;
                    __mmask16 mk = rem >= 16 ? 0xffff : (__mmask16)((1u << rem) - 1);
                    acc[v] = _mm512_fmadd_ps(p, load_any(vc + ((size_t)j * hs + 16 * v) * es, bf16, mk), acc[v]);
                }
            }
            for (int v = 0; v < nv; v++) {
                int rem = hs - 16 * v, n = rem >= 16 ? 16 : rem;
                float o[16];
                _mm512_storeu_ps(o, acc[v]);
                size_t at = (size_t)b * out_stride + h * hs + 16 * v;
                for (int d = 0; d < n; d++) {
                    if (bf16) ((uint16_t *)out)[at + d] = f32_to_bf16(o[d]);
                    else ((float *)out)[at + d] = o[d];
                }
            }
        }
    }
    return 0;
}

/* attend_rows for B rows of one token each, stored one after another; mask (B, pos + 1) or NULL. */
int gl_attend_one(const void *qkv, void *k_cache, void *v_cache, int pos, const uint8_t *mask, void *out, int B,
                  int nh, int hs, int max_len, int bf16, int nthreads) {
    const int C = nh * hs;
    return attend_rows(qkv, 3 * C, k_cache, v_cache, pos, mask, pos + 1, out, C, B, nh, hs, max_len, bf16, nthreads);
}

/* out[m] = the index of the largest of x[m, 0..N) (the first one on ties, as torch.argmax; NaN wins). */
int gl_argmax_f32(const float *x, int64_t *out, int M, int N) {
    for (int m = 0; m < M; m++) {
        const float *r = x + (size_t)m * N;
        __m512 best = _mm512_set1_ps(-INFINITY);
        int n = 0;
        for (; n + 16 <= N; n += 16) best = _mm512_max_ps(best, _mm512_loadu_ps(r + n));
        float top = _mm512_reduce_max_ps(best);
        for (; n < N; n++) top = r[n] > top ? r[n] : top;
        int64_t at = -1;
        for (n = 0; n < N; n++)
            if (r[n] == top || r[n] != r[n]) {
                at = n;
                break;
            }
        out[m] = at < 0 ? 0 : at;
    }
    return 0;
}

#endif /* __AVX512F__ */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

/* ---------------------------------------------------------------- int8 weights, one scale per row */

/* Quantize x (M, K) fp32 per row: xq = round(x / s) + 128 as uint8 (vpdpbusd wants one unsigned
 * operand), s = max|x| / 127; writes xq (M, K) and s (M). */
static void quantize_rows_u8(const float *x, uint8_t *xq, float *s, int M, int K) {
    for (int m = 0; m < M; m++) {
        const float *r = x + (size_t)m * K;
        float amax = 0.0f;
        for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(r[k]));
        float scale = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
        for (int k = 0; k < K; k++) xq[(size_t)m * K + k] = (uint8_t)(lrintf(r[k] * inv) + 128);
        s[m] = scale;
    }
}

/* out[r][m] = sum_k xq[m, k] w[r, k] for R rows of w and M rows of xq (compile-time constants). */
static inline __attribute__((always_inline)) void i8_step(const int8_t *w, const uint8_t *xq, const int R,
                                                          const int M, int K, int k, __mmask64 mk, int masked,
                                                          __m512i acc[ROWS][ROWS]) {
    __m512i xv[ROWS];
    for (int m = 0; m < M; m++)
        xv[m] = masked ? _mm512_maskz_loadu_epi8(mk, xq + (size_t)m * K + k)
                       : _mm512_loadu_si512((const void *)(xq + (size_t)m * K + k));
    for (int r = 0; r < R; r++) {
        const int8_t *p = w + (size_t)r * K + k;
        _mm_prefetch((const char *)p + PF_I8, _MM_HINT_T0);
        __m512i wv = masked ? _mm512_maskz_loadu_epi8(mk, p) : _mm512_loadu_si512((const void *)p);
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_dpbusd_epi32(acc[r][m], xv[m], wv);
    }
}

/* out[r][m] = sum_k xq[m, k] w[r, k] for R rows of w and M rows of xq (compile-time constants). */
static inline __attribute__((always_inline)) void i8_rm(const int8_t *w, const uint8_t *xq, const int R, const int M,
                                                        int K, int32_t out[ROWS][ROWS]) {
    __m512i acc[ROWS][ROWS];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_si512();
    int k = 0;
    for (; k + 64 <= K; k += 64) i8_step(w, xq, R, M, K, k, ~(__mmask64)0, 0, acc);
    if (k < K) i8_step(w, xq, R, M, K, k, ((__mmask64)1 << (K - k)) - 1, 1, acc);
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) out[r][m] = _mm512_reduce_add_epi32(acc[r][m]);
}

static void i8_block(const int8_t *w, const uint8_t *xq, int R, int M, int K, int32_t out[ROWS][ROWS]) {
    switch ((R == ROWS ? 4 : 0) + M) {
    case 1: i8_rm(w, xq, 1, 1, K, out); break;
    case 2: i8_rm(w, xq, 1, 2, K, out); break;
    case 3: i8_rm(w, xq, 1, 3, K, out); break;
    case 4: i8_rm(w, xq, 1, 4, K, out); break;
    case 5: i8_rm(w, xq, ROWS, 1, K, out); break;
    case 6: i8_rm(w, xq, ROWS, 2, K, out); break;
    case 7: i8_rm(w, xq, ROWS, 3, K, out); break;
    default: i8_rm(w, xq, ROWS, 4, K, out); break;
    }
}

/* y (M, N) = x (M, K) W^T + b for int8 W (N, K) with bf16 row scales ws (N) and row sums wsum (N):
 * x is quantized per row (xq, xs), then y[m, n] = xs[m] ws[n] (sum_k xq[m, k] w[n, k] - 128 wsum[n]) + b[n]. */
int gl_linear_i8(const float *x, const int8_t *w, const uint16_t *ws, const int32_t *wsum, const float *b, float *y,
                 int M, int N, int K, int nthreads) {
    uint8_t *xq = scratch((size_t)M * K + (size_t)M * sizeof(float) + 64);
    if (!xq) return -1;
    float *xs = (float *)(xq + (((size_t)M * K + 63) & ~(size_t)63));
    quantize_rows_u8(x, xq, xs, M, K);
    const int nblocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int blk = 0; blk < nblocks; blk++) {
        const int n0 = blk * ROWS, R = N - n0 < ROWS ? 1 : ROWS; /* the last partial block: row by row */
        for (int n = n0; n < n0 + ROWS && n < N; n += R) {
            for (int m0 = 0; m0 < M; m0 += ROWS) {
                const int mm = M - m0 < ROWS ? M - m0 : ROWS;
                int32_t out[ROWS][ROWS];
                i8_block(w + (size_t)n * K, xq + (size_t)m0 * K, R, mm, K, out);
                for (int r = 0; r < R; r++) {
                    float scale = bf16_to_f32(ws[n + r]);
                    for (int m = 0; m < mm; m++) {
                        int32_t dot = out[r][m] - 128 * wsum[n + r];
                        y[(size_t)(m0 + m) * N + n + r] = xs[m0 + m] * scale * (float)dot + (b ? b[n + r] : 0.0f);
                    }
                }
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- int4 weights, groups of g inputs */

/* Quantize x (M, K) fp32 in blocks of 32: q = round(x / d), d = max|x| / 127 per block, written
 * in the order the int4 kernel reads: in each chunk of 128 inputs, the 64 even ones, then the 64
 * odd ones (the packed weights hold columns 2i and 2i+1 in one byte). Writes xq (M, K) int8,
 * d (M, K/32) and gsum (M, K/g): the sum of the dequantized x over each group of g inputs. */
static void quantize_blocks_i8(const float *x, int8_t *xq, float *d, float *gsum, int M, int K, int g) {
    for (int m = 0; m < M; m++) {
        const float *r = x + (size_t)m * K;
        int8_t *q = xq + (size_t)m * K;
        float *dm = d + (size_t)m * (K / 32), *gs = gsum + (size_t)m * (K / g);
        for (int j = 0; j < K / g; j++) gs[j] = 0.0f;
        for (int j = 0; j < K / 32; j++) {
            float amax = 0.0f;
            for (int t = 0; t < 32; t++) amax = fmaxf(amax, fabsf(r[32 * j + t]));
            float scale = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
            int bsum = 0;
            for (int t = 0; t < 32; t++) {
                int k = 32 * j + t, v = (int)lrintf(r[k] * inv);
                int c = k / 128, i = k % 128; /* even inputs first, then odd, in each chunk */
                q[128 * c + (i % 2) * 64 + i / 2] = (int8_t)v;
                bsum += v;
            }
            dm[j] = scale;
            gs[(32 * j) / g] += scale * (float)bsum;
        }
    }
}

/* y[m, n] = sum over groups of scale * (sum_k (q[n, k] - 8) x[m, k]) + zero * sum_k x[m, k] + b[n],
 * i.e. w = q * scale + (zero - 8 * scale). K must be a multiple of 128, g = 32 << gshift. */
static inline __attribute__((always_inline)) __m128 i4_scales(const uint16_t *sr, int c, const int gshift) {
    __m128i s16; /* the bf16 scales of blocks 4c..4c+3 */
    if (gshift == 0) {
        s16 = _mm_loadl_epi64((const __m128i *)(sr + 4 * c));
    } else {
        uint16_t s4[4];
        for (int t = 0; t < 4; t++) s4[t] = sr[(4 * c + t) >> gshift];
        s16 = _mm_loadl_epi64((const __m128i *)s4);
    }
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(s16), 16));
}

/* R rows n..n+R of an int4 W times M rows of x (R, M compile-time constants); out[r][m]. Row r's
 * weights wr + r * K/2, scales sr + r * G, zeros zr + r * G. */
static inline __attribute__((always_inline)) void i4_rows(const int8_t *xq, const float *xd, const float *xgsum,
                                                          const uint8_t *wr, const uint16_t *sr, const uint16_t *zr,
                                                          const int R, const int M, int K, const int gshift,
                                                          float out[2][ROWS]) {
    const int G = (K / 32) >> gshift, B = K / 32;
    const __m512i lanes_to_block = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 acc[2][ROWS];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    for (int c = 0; c < K / 128; c++) {
        __m512i lo[2], hi[2];
        __m128 wscale[2];
        for (int r = 0; r < R; r++) {
            const uint8_t *p = wr + (size_t)r * (K / 2) + 64 * c;
            _mm_prefetch((const char *)p + PF_I4, _MM_HINT_T0);
            __m512i packed = _mm512_loadu_si512((const void *)p);
            lo[r] = _mm512_and_si512(packed, low4);                        /* columns 128c + 2i */
            hi[r] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4); /* columns 128c + 2i + 1 */
            wscale[r] = i4_scales(sr + (size_t)r * G, c, gshift);
        }
        for (int m = 0; m < M; m++) {
            const int8_t *xr = xq + (size_t)m * K + 128 * c;
            __m512i x0 = _mm512_loadu_si512((const void *)xr), x1 = _mm512_loadu_si512((const void *)(xr + 64));
            __m128 xs = _mm_loadu_ps(xd + (size_t)m * B + 4 * c);
            for (int r = 0; r < R; r++) {
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], x0);
                dot = _mm512_dpbusd_epi32(dot, hi[r], x1);
                /* lane l sums inputs 128c + 8l .. 8l + 7: block 4c + l / 4 */
                __m512 s = _mm512_permutexvar_ps(lanes_to_block, _mm512_castps128_ps512(_mm_mul_ps(wscale[r], xs)));
                acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        for (int j = 0; j < G; j += 16) { /* the (zero - 8 * scale) * sum(x) term, per group */
            __mmask16 mk = (G - j >= 16) ? 0xffff : (__mmask16)((1u << (G - j)) - 1);
            __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), load_bf16x16_masked(sr + (size_t)r * G + j, mk),
                                             load_bf16x16_masked(zr + (size_t)r * G + j, mk));
            for (int m = 0; m < M; m++)
                acc[r][m] = _mm512_fmadd_ps(offset, _mm512_maskz_loadu_ps(mk, xgsum + (size_t)m * G + j), acc[r][m]);
        }
        for (int m = 0; m < M; m++) out[r][m] = _mm512_reduce_add_ps(acc[r][m]);
    }
}

static void i4_block(const int8_t *x, const float *d, const float *gs, const uint8_t *wr, const uint16_t *sr,
                     const uint16_t *zr, int R, int M, int K, int gshift, float out[2][ROWS]) {
#define I4(RR, MM)                                                                                                     \
    (gshift ? i4_rows(x, d, gs, wr, sr, zr, RR, MM, K, gshift, out) : i4_rows(x, d, gs, wr, sr, zr, RR, MM, K, 0, out))
    if (R == 2) {
        switch (M) {
        case 1: I4(2, 1); break;
        case 2: I4(2, 2); break;
        case 3: I4(2, 3); break;
        default: I4(2, 4); break;
        }
    } else {
        switch (M) {
        case 1: I4(1, 1); break;
        case 2: I4(1, 2); break;
        case 3: I4(1, 3); break;
        default: I4(1, 4); break;
        }
    }
#undef I4
}

/* y (M, N) = x (M, K) W^T + b for an int4 W (see i4_row); x is quantized in blocks of 32 first. */
int gl_linear_i4(const float *x, const uint8_t *w, const uint16_t *scales, const uint16_t *zeros, const float *b,
                 float *y, int M, int N, int K, int g, int nthreads) {
    const size_t nq = ((size_t)M * K + 63) & ~(size_t)63, nd = (size_t)M * (K / 32), ng = (size_t)M * (K / g);
    int8_t *xq = scratch(nq + (nd + ng) * sizeof(float));
    if (!xq) return -1;
    float *xd = (float *)(xq + nq), *xgsum = xd + nd;
    quantize_blocks_i8(x, xq, xd, xgsum, M, K, g);
    int gshift = 0;
    while ((32 << gshift) < g) gshift++;
    const int G = K / g, nblocks = (N + 1) / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int blk = 0; blk < nblocks; blk++) {
        const int n = 2 * blk, R = n + 2 <= N ? 2 : 1;
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            const int mm = M - m0 < ROWS ? M - m0 : ROWS;
            float out[2][ROWS];
            i4_block(xq + (size_t)m0 * K, xd + (size_t)m0 * (K / 32), xgsum + (size_t)m0 * G, w + (size_t)n * (K / 2),
                     scales + (size_t)n * G, zeros + (size_t)n * G, R, mm, K, gshift, out);
            for (int r = 0; r < R; r++)
                for (int m = 0; m < mm; m++) y[(size_t)(m0 + m) * N + n + r] = out[r][m] + (b ? b[n + r] : 0.0f);
        }
    }
    return 0;
}

/* The fp32 weight (N, K) an int4 layer stands for, for prefill's GEMM: w = (q - 8) * scale + zero. */
void gl_dequantize_i4(const uint8_t *w, const uint16_t *scales, const uint16_t *zeros, float *out, int N, int K, int g,
                      int nthreads) {
    const int G = K / g;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *wr = w + (size_t)n * (K / 2);
        float *o = out + (size_t)n * K;
        for (int j = 0; j < G; j++) {
            float s = bf16_to_f32(scales[(size_t)n * G + j]), z = bf16_to_f32(zeros[(size_t)n * G + j]) - 8.0f * s;
            for (int k = j * g; k < (j + 1) * g; k += 2) {
                uint8_t v = wr[k / 2];
                o[k] = (float)(v & 15) * s + z;
                o[k + 1] = (float)(v >> 4) * s + z;
            }
        }
    }
}

#endif /* VNNI */

#if defined(__AVX512F__)

/* ---------------------------------------------------------------- one decoding step of a whole model */

/* gl_decode_step runs a few new tokens (one per row when decoding) through every block, the final
 * norm and the head in one call, instead of ~400 PyTorch operations and Python module calls per
 * token (1.7 ms of an int4 GPT-2's 4.3 ms step before). It computes what the model's modules
 * compute, op by op, with the same linear kernels as above; for a bf16 model each intermediate
 * result is rounded to bf16 where PyTorch's bf16 ops round it. */

enum { GL_F32 = 0, GL_BF16 = 1, GL_I8 = 2, GL_I4 = 3 };
enum { GL_LAYERNORM = 0, GL_RMSNORM = 1 };
enum { GL_GELU_TANH = 0, GL_GELU_ERF = 1, GL_SWIGLU = 2 };

/* The model, described once by gptlab.fused_step: pointers to its own tensors, no copies. */
typedef struct {     /* one linear layer, y = x W^T + bias */
    int kind;        /* GL_F32 or GL_BF16 weights (N, K); GL_I8 (N, K) int8; GL_I4 (N, K/2) nibbles */
    int N, K, g;     /* g: int4 group size */
    int bias_bf16;   /* the bias is bf16 (a bf16 model's), else fp32 */
    const void *w;   /* the weights */
    const void *a;   /* GL_I8: bf16 row scales (N); GL_I4: bf16 scales (N, K/g) */
    const void *b;   /* GL_I8: int32 row sums (N); GL_I4: bf16 zeros (N, K/g) */
    const void *bias; /* (N) or NULL */
} gl_linear_t;

typedef struct {
    const void *ln1_w, *ln1_b, *ln2_w, *ln2_b; /* norm gains and biases (may be NULL), the activations' dtype */
    gl_linear_t attn, attn_proj, fc, mlp_proj;
} gl_block_t;

typedef struct {
    int n_layer, n_embd, n_head, hidden; /* hidden: the MLP's width (SwiGLU: c_fc gives 2 * hidden) */
    int norm, mlp, bf16;                 /* bf16: activations, caches and norms are bf16 */
    float eps;
    const gl_block_t *blocks;
    const void *lnf_w, *lnf_b;
    gl_linear_t head;
} gl_model_t;

/* Round each value of x to the nearest bf16 (ties to even), kept as fp32. */
static void round_bf16(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

/* e^x for 16 lanes: x = n ln2 + r, |r| <= ln2/2, e^r by its Taylor polynomial to r^7 (relative
 * error < 2e-8 there), times 2^n by vscalefps. Inputs below -104 give 0, above 88.7 infinity. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* GPT-2's GELU, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in place; tanh(u) = sign(u)
 * (1 - e) / (1 + e) with e = exp(-2|u|). */
static void gelu_tanh(float *x, int n) {
    const __m512 c = _mm512_set1_ps(0.7978845608028654f), a = _mm512_set1_ps(0.044715f);
    const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
    for (int i = 0; i < n; i += 16) {
        __mmask16 mk = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(mk, x + i);
        __m512 u = _mm512_mul_ps(c, _mm512_fmadd_ps(_mm512_mul_ps(a, v), _mm512_mul_ps(v, v), v));
        __m512 e = exp16(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(u)));
        __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
        t = _mm512_mask_sub_ps(t, _mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_ps(), t);
        _mm512_mask_storeu_ps(x + i, mk, _mm512_mul_ps(_mm512_mul_ps(half, v), _mm512_add_ps(one, t)));
    }
}

/* out[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + e^-x); silu rounded to bf16 first when bf16. */
static void swiglu(const float *gate, const float *up, float *out, int n, int bf16) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int i = 0; i < n; i += 16) {
        __mmask16 mk = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 g = _mm512_maskz_loadu_ps(mk, gate + i);
        _mm512_mask_storeu_ps(out + i, mk, _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    }
    if (bf16) round_bf16(out, (size_t)n);
    for (int i = 0; i < n; i++) out[i] *= up[i];
}

/* LayerNorm or RMSNorm of each of M rows of x (M, C) into y, in fp32 (as PyTorch's CPU norms
 * compute also for bf16 inputs). */
static void norm_rows(const gl_model_t *m, const float *x, const void *w, const void *b, float *y, int M) {
    const int C = m->n_embd;
    for (int r = 0; r < M; r++) {
        const float *xr = x + (size_t)r * C;
        float *yr = y + (size_t)r * C;
        float mean = 0.0f, var = 0.0f;
        if (m->norm == GL_LAYERNORM) {
            for (int i = 0; i < C; i++) mean += xr[i];
            mean /= (float)C;
        }
        for (int i = 0; i < C; i++) var += (xr[i] - mean) * (xr[i] - mean);
        const float inv = 1.0f / sqrtf(var / (float)C + m->eps);
        for (int i = 0; i < C; i++)
            yr[i] = (xr[i] - mean) * inv * param(w, i, m->bf16) + (b ? param(b, i, m->bf16) : 0.0f);
    }
    if (m->bf16) round_bf16(y, (size_t)M * C);
}

/* y (M, N) = x (M, K) L^T + bias for any kind of layer; x fp32; y rounded to bf16 values when
 * round. Returns 0, -1 out of memory, -2 a kind this build has no kernel for. */
static int run_linear(const gl_linear_t *L, const float *x, float *y, int M, int round, int nthreads) {
    const int N = L->N, K = L->K;
    switch (L->kind) {
    case GL_F32: linear_rows(L->w, 0, x, L->bias, 0, y, round ? 2 : 0, M, N, K, nthreads); return 0;
    case GL_BF16: {
        float *xf = scratch((size_t)M * K * sizeof(float));
        if (!xf) return -1;
        order_pairs(x, xf, M, K);
        if (L->bias_bf16) linear_rows(L->w, 1, xf, L->bias, 1, y, round ? 2 : 0, M, N, K, nthreads);
        else linear_rows(L->w, 1, xf, L->bias, 0, y, round ? 2 : 0, M, N, K, nthreads);
        return 0;
    }
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    case GL_I8: {
        int s = gl_linear_i8(x, L->w, L->a, L->b, L->bias, y, M, N, K, nthreads);
        if (!s && round) round_bf16(y, (size_t)M * N);
        return s;
    }
    case GL_I4: {
        int s = gl_linear_i4(x, L->w, L->a, L->b, L->bias, y, M, N, K, L->g, nthreads);
        if (!s && round) round_bf16(y, (size_t)M * N);
        return s;
    }
#endif
    default: return -2;
    }
}

/* x (M, n) += y (M, n), rounded to bf16 values when bf16. */
static void add_residual(float *x, const float *y, size_t n, int bf16) {
    for (size_t i = 0; i < n; i++) x[i] += y[i];
    if (bf16) round_bf16(x, n);
}

static void to_bf16(const float *x, uint16_t *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = f32_to_bf16(x[i]);
}

static void from_bf16(const uint16_t *x, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = bf16_to_f32(x[i]);
}

/* Rotary positions: rotate the query and key of each of M rows of qkv (M, 3C) in place, per head
 * the pairs (i, i + hs/2) by the row's angles, cs (M, hs): cos (hs/2) then sin (hs/2) (the GPT-NeoX
 * layout of gptlab.model.apply_rope); each product and sum rounded to bf16, as bf16 ops round,
 * when bf16. */
static void rope_rows(float *qkv, const float *cs, int M, int C, int nh, int bf16) {
    const int hs = C / nh, half = hs / 2;
#define RB(v) (bf16 ? bf16_to_f32(f32_to_bf16(v)) : (v))
    for (int r = 0; r < M; r++) {
        const float *cosv = cs + (size_t)r * hs, *sinv = cosv + half;
        for (int part = 0; part < 2; part++) /* the query, then the key */
            for (int h = 0; h < nh; h++) {
                float *x = qkv + (size_t)r * 3 * C + (size_t)part * C + (size_t)h * hs;
                for (int i = 0; i < half; i++) {
                    const float x1 = x[i], x2 = x[i + half];
                    const float a = RB(x1 * cosv[i]), b = RB(x2 * sinv[i]), c = RB(x1 * sinv[i]), d = RB(x2 * cosv[i]);
                    x[i] = RB(a - b);
                    x[i + half] = RB(c + d);
                }
            }
    }
#undef RB
}

/* Self-attention of T new tokens per row, qkv (B*T, 3C) -> att (B*T, C): token t of each row
 * writes its key and value to slot pos + t and sees the slots up to its own (causal), where mask
 * (B, pos + T) allows. A bf16 model's caches are bf16: its qkv and att go through bf16 buffers. */
static int attention(const gl_model_t *m, void *k_cache, void *v_cache, const float *qkv, float *att, uint16_t *spare,
                     int B, int T, int pos, int max_len, const uint8_t *mask, int nthreads) {
    const int C = m->n_embd, nh = m->n_head, hs = C / nh, R = m->bf16;
    const size_t n_qkv = (size_t)B * T * 3 * C;
    uint16_t *q16 = spare, *a16 = spare + n_qkv;
    if (R) to_bf16(qkv, q16, n_qkv);
    for (int t = 0; t < T; t++) { /* in order: token t sees the keys tokens 0..t just wrote */
        const void *q = R ? (const void *)(q16 + (size_t)t * 3 * C) : (const void *)(qkv + (size_t)t * 3 * C);
        void *o = R ? (void *)(a16 + (size_t)t * C) : (void *)(att + (size_t)t * C);
        int s = attend_rows(q, T * 3 * C, k_cache, v_cache, pos + t, mask, pos + T, o, T * C, B, nh, hs,
                            max_len, R, nthreads);
        if (s) return s;
    }
    if (R) from_bf16(a16, att, (size_t)B * T * C);
    return 0;
}

/* One block on x (M = B*T rows, C), the residual stream, in place. */
static int block_step(const gl_model_t *m, const gl_block_t *blk, void *const kv[2], float *x, float *work, int B,
                      int T, int pos, int max_len, const uint8_t *mask, const float *rope, int nthreads) {
    const int C = m->n_embd, H = m->hidden, R = m->bf16, M = B * T;
    const int Hfc = m->mlp == GL_SWIGLU ? 2 * H : H;
    float *h = work, *qkv = h + (size_t)M * C, *att = qkv + (size_t)M * 3 * C, *fc = att + (size_t)M * C;
    float *act = fc + (size_t)M * Hfc, *spare = act + (size_t)M * H; /* spare: 2C per row */
    int s;
    norm_rows(m, x, blk->ln1_w, blk->ln1_b, h, M);
    if ((s = run_linear(&blk->attn, h, qkv, M, R, nthreads))) return s;
    if (rope) rope_rows(qkv, rope, M, C, m->n_head, R);
    if ((s = attention(m, kv[0], kv[1], qkv, att, (uint16_t *)spare, B, T, pos, max_len, mask, nthreads))) return s;
    if ((s = run_linear(&blk->attn_proj, att, h, M, R, nthreads))) return s;
    add_residual(x, h, (size_t)M * C, R);
    norm_rows(m, x, blk->ln2_w, blk->ln2_b, h, M);
    if ((s = run_linear(&blk->fc, h, fc, M, R, nthreads))) return s;
    float *mlp_in = fc;
    if (m->mlp == GL_SWIGLU) {
        for (int r = 0; r < M; r++) swiglu(fc + (size_t)r * 2 * H, fc + (size_t)r * 2 * H + H, act + (size_t)r * H, H, R);
        mlp_in = act;
    } else if (m->mlp == GL_GELU_ERF) {
        for (size_t i = 0; i < (size_t)M * H; i++) fc[i] = 0.5f * fc[i] * (1.0f + erff(fc[i] * 0.70710678118654752f));
    } else {
        gelu_tanh(fc, M * H);
    }
    if (R) round_bf16(mlp_in, (size_t)M * H);
    if ((s = run_linear(&blk->mlp_proj, mlp_in, h, M, R, nthreads))) return s;
    add_residual(x, h, (size_t)M * C, R);
    return 0;
}

/* A forward of T new tokens per row over the KV cache: x (B*T, C) fp32, the embedded tokens (bf16
 * values for a bf16 model), runs through every block (token t's keys and values written to slot
 * pos + t of each layer's cache: kv holds layer l's key and value caches (B, nh, max_len, hs) at
 * 2l and 2l + 1, in the activations' dtype), the final norm and the head into logits: (B*T, V) when
 * all_logits, else (B, V) for each row's last token; fp32 (bf16 values for a bf16 model).
 * mask (B, pos + T) bytes, False at slots a row may not see, or NULL. rope (B*T, hs): each new
 * token's rotary cos then sin (see rope_rows), or NULL for a model without rotary positions.
 * x is overwritten. Returns 0, -1 out of memory, -2 a layer kind this build cannot run. */
int gl_decode_step(const gl_model_t *m, void *const *kv, float *x, int B, int T, int pos, int max_len,
                   const uint8_t *mask, const float *rope, float *logits, int all_logits, int nthreads) {
    const int C = m->n_embd, Hfc = (m->mlp == GL_SWIGLU ? 2 : 1) * m->hidden, M = B * T;
    float *work = malloc(sizeof(float) * (size_t)M * (7 * C + Hfc + m->hidden) + 64);
    if (!work) return -1;
    int s = 0;
    for (int l = 0; l < m->n_layer && !s; l++)
        s = block_step(m, &m->blocks[l], kv + 2 * l, x, work, B, T, pos, max_len, mask, rope, nthreads);
    if (!s) {
        if (!all_logits) /* the head only for each row's last token */
            for (int b = 0; b < B; b++) memmove(x + (size_t)b * C, x + ((size_t)b * T + T - 1) * C, sizeof(float) * C);
        const int rows = all_logits ? M : B;
        norm_rows(m, x, m->lnf_w, m->lnf_b, work, rows);
        s = run_linear(&m->head, work, logits, rows, m->bf16, nthreads);
    }
    free(work);
    return s;
}

/* ---------------------------------------------------------------- training: softmax cross-entropy */

/* For each of n rows of logits z (n, V), in place: z = softmax(z) - onehot(t) (the gradient of the
 * row's cross-entropy with respect to its logits) and loss[r] = logsumexp(z) - z[t]; a row whose
 * target is -100 (ignored) gets zeros and loss 0. Three passes over each row (max; exp and sum;
 * scale) where PyTorch's ops take five. Returns 0, or -3 when a target is outside [0, V) and not -100. */
int gl_softmax_xent(float *z, const int64_t *t, float *loss, int n, int V, int nthreads) {
    int bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(| : bad)
    for (int r = 0; r < n; r++) {
        float *row = z + (size_t)r * V;
        if (t[r] < 0 || t[r] >= V) { /* -100: an ignored position (IGNORE_INDEX); else an error */
            bad |= t[r] != -100;
            memset(row, 0, sizeof(float) * V);
            loss[r] = 0.0f;
            continue;
        }
        const float target = row[t[r]];
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int i = 0; i < V; i += 16) {
            __mmask16 mk = V - i >= 16 ? 0xffff : (__mmask16)((1u << (V - i)) - 1);
            vmax = _mm512_mask_max_ps(vmax, mk, vmax, _mm512_maskz_loadu_ps(mk, row + i));
        }
        const float peak = _mm512_reduce_max_ps(vmax);
        __m512 vsum = _mm512_setzero_ps();
        for (int i = 0; i < V; i += 16) {
            __mmask16 mk = V - i >= 16 ? 0xffff : (__mmask16)((1u << (V - i)) - 1);
            __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, row + i), _mm512_set1_ps(peak)));
            _mm512_mask_storeu_ps(row + i, mk, e);
            vsum = _mm512_mask_add_ps(vsum, mk, vsum, e);
        }
        const float total = _mm512_reduce_add_ps(vsum);
        const __m512 inv = _mm512_set1_ps(1.0f / total);
        for (int i = 0; i < V; i += 16) {
            __mmask16 mk = V - i >= 16 ? 0xffff : (__mmask16)((1u << (V - i)) - 1);
            _mm512_mask_storeu_ps(row + i, mk, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, row + i), inv));
        }
        row[t[r]] -= 1.0f;
        loss[r] = logf(total) + peak - target;
    }
    return bad ? -3 : 0;
}

#endif /* __AVX512F__ */
