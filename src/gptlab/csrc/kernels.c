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
 *
 * Called from Python through ctypes (gptlab/kernels.py), which builds this file with
 * -O3 -march=native -fopenmp once per CPU model. Shapes are checked on the Python side.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_ROWS 8 /* rows of x per call; the Python side splits larger batches */

int gl_abi(void) { return 3; }

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

/* ---------------------------------------------------------------- float weights */

/* R weight rows at a time (R memory streams in flight) times M rows of x, R and M compile-time
 * constants after inlining so the R x M accumulators live in registers: out[r][m] = dot(w_r, x_m).
 * w holds fp32 or (bf16 != 0) bf16 rows of K values; bf16 converts to fp32 exactly (a shift). */
#define ROWS 4
static inline __attribute__((always_inline)) __m512 load_w(const void *w, int bf16, size_t i, __mmask16 mk) {
    if (bf16) return load_bf16x16_masked((const uint16_t *)w + i, mk);
    return _mm512_maskz_loadu_ps(mk, (const float *)w + i);
}

static inline __attribute__((always_inline)) void dot_rm(const void *w, int bf16, const float *x, const int R,
                                                         const int M, int K, float out[ROWS][ROWS]) {
    __m512 acc[ROWS][ROWS];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        __mmask16 mk = (K - k >= 16) ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
        __m512 xv[ROWS];
        for (int m = 0; m < M; m++) xv[m] = _mm512_maskz_loadu_ps(mk, x + (size_t)m * K + k);
        for (int r = 0; r < R; r++) {
            __m512 wv = load_w(w, bf16, (size_t)r * K + k, mk);
            for (int m = 0; m < M; m++) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
        }
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

/* y (M, N) = x (M, K) W^T + bias, W fp32 or bf16 (N, K), x and bias fp32 (bias may be NULL);
 * y fp32, or bf16 (rounded to nearest even) when y_bf16. */
static void linear_rows(const void *w, int bf16, const float *x, const float *bias, void *y, int y_bf16, int M, int N,
                        int K, int nthreads) {
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
                        float v = out[r][m] + (bias ? bias[n + r] : 0.0f);
                        size_t i = (size_t)(m0 + m) * N + n + r;
                        if (y_bf16) ((uint16_t *)y)[i] = f32_to_bf16(v);
                        else ((float *)y)[i] = v;
                    }
            }
        }
    }
}

void gl_linear_f32(const float *x, const float *w, const float *b, float *y, int M, int N, int K, int nthreads) {
    linear_rows(w, 0, x, b, y, 0, M, N, K, nthreads);
}

/* bf16 x (M, K) and W (N, K), fp32 b (N) or NULL -> bf16 y (M, N); xf: fp32 scratch (M, K). */
void gl_linear_bf16(const uint16_t *x, const uint16_t *w, const float *b, uint16_t *y, float *xf, int M, int N, int K,
                    int nthreads) {
    for (size_t i = 0; i < (size_t)M * K; i++) xf[i] = bf16_to_f32(x[i]);
    linear_rows(w, 1, xf, b, y, 1, M, N, K, nthreads);
}

#endif /* __AVX512F__ */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

/* ---------------------------------------------------------------- int8 weights, one scale per row */

/* Quantize x (M, K) fp32 per row: xq = round(x / s) + 128 as uint8 (vpdpbusd wants one unsigned
 * operand), s = max|x| / 127; writes xq (M, K) and s (M). */
void gl_quantize_rows_u8(const float *x, uint8_t *xq, float *s, int M, int K) {
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
static inline __attribute__((always_inline)) void i8_rm(const int8_t *w, const uint8_t *xq, const int R, const int M,
                                                        int K, int32_t out[ROWS][ROWS]) {
    __m512i acc[ROWS][ROWS];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_si512();
    for (int k = 0; k < K; k += 64) {
        __mmask64 mk = (K - k >= 64) ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
        __m512i xv[ROWS];
        for (int m = 0; m < M; m++) xv[m] = _mm512_maskz_loadu_epi8(mk, xq + (size_t)m * K + k);
        for (int r = 0; r < R; r++) {
            __m512i wv = _mm512_maskz_loadu_epi8(mk, w + (size_t)r * K + k);
            for (int m = 0; m < M; m++) acc[r][m] = _mm512_dpbusd_epi32(acc[r][m], xv[m], wv);
        }
    }
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

/* y[m, n] = xs[m] * ws[n] * (sum_k xq[m, k] w[n, k] - 128 * wsum[n]) + b[n]. ws are bf16. */
void gl_linear_i8(const uint8_t *xq, const float *xs, const int8_t *w, const uint16_t *ws, const int32_t *wsum,
                  const float *b, float *y, int M, int N, int K, int nthreads) {
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
}

/* ---------------------------------------------------------------- int4 weights, groups of g inputs */

/* Quantize x (M, K) fp32 in blocks of 32: q = round(x / d), d = max|x| / 127 per block, written
 * in the order the int4 kernel reads: in each chunk of 128 inputs, the 64 even ones, then the 64
 * odd ones (the packed weights hold columns 2i and 2i+1 in one byte). Writes xq (M, K) int8,
 * d (M, K/32) and gsum (M, K/g): the sum of the dequantized x over each group of g inputs. */
void gl_quantize_blocks_i8(const float *x, int8_t *xq, float *d, float *gsum, int M, int K, int g) {
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
static inline __attribute__((always_inline)) void i4_row(const int8_t *xq, const float *xd, const float *xgsum,
                                                         const uint8_t *wr, const uint16_t *sr, const uint16_t *zr,
                                                         const int M, int K, int gshift, float *out) {
    const int G = (K / 32) >> gshift, B = K / 32;
    const __m512i lanes_to_block = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 acc[ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int c = 0; c < K / 128; c++) {
        __m512i packed = _mm512_loadu_si512((const void *)(wr + 64 * c));
        __m512i lo = _mm512_and_si512(packed, low4);                        /* columns 128c + 2i */
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4); /* columns 128c + 2i + 1 */
        __m128i s16;                                                        /* the bf16 scales of blocks 4c..4c+3 */
        if (gshift == 0) {
            s16 = _mm_loadl_epi64((const __m128i *)(sr + 4 * c));
        } else {
            uint16_t s4[4];
            for (int t = 0; t < 4; t++) s4[t] = sr[(4 * c + t) >> gshift];
            s16 = _mm_loadl_epi64((const __m128i *)s4);
        }
        __m128 wscale = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(s16), 16));
        for (int m = 0; m < M; m++) {
            const int8_t *xr = xq + (size_t)m * K + 128 * c;
            __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)xr));
            dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512((const void *)(xr + 64)));
            /* lane l sums inputs 128c + 8l .. 8l + 7: block 4c + l / 4 */
            __m128 s4 = _mm_mul_ps(wscale, _mm_loadu_ps(xd + (size_t)m * B + 4 * c));
            __m512 s = _mm512_permutexvar_ps(lanes_to_block, _mm512_castps128_ps512(s4));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[m]);
        }
    }
    for (int j = 0; j < G; j += 16) { /* the (zero - 8 * scale) * sum(x) term, per group */
        __mmask16 mk = (G - j >= 16) ? 0xffff : (__mmask16)((1u << (G - j)) - 1);
        __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), load_bf16x16_masked(sr + j, mk),
                                         load_bf16x16_masked(zr + j, mk));
        for (int m = 0; m < M; m++)
            acc[m] = _mm512_fmadd_ps(offset, _mm512_maskz_loadu_ps(mk, xgsum + (size_t)m * G + j), acc[m]);
    }
    for (int m = 0; m < M; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
}

void gl_linear_i4(const int8_t *xq, const float *xd, const float *xgsum, const uint8_t *w, const uint16_t *scales,
                  const uint16_t *zeros, const float *b, float *y, int M, int N, int K, int g, int nthreads) {
    int gshift = 0;
    while ((32 << gshift) < g) gshift++;
    const int G = K / g;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *wr = w + (size_t)n * (K / 2);
        const uint16_t *sr = scales + (size_t)n * G, *zr = zeros + (size_t)n * G;
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            const int mm = M - m0 < ROWS ? M - m0 : ROWS;
            const int8_t *x = xq + (size_t)m0 * K;
            const float *d = xd + (size_t)m0 * (K / 32), *gs = xgsum + (size_t)m0 * G;
            float out[ROWS];
            switch (mm) {
            case 1: i4_row(x, d, gs, wr, sr, zr, 1, K, gshift, out); break;
            case 2: i4_row(x, d, gs, wr, sr, zr, 2, K, gshift, out); break;
            case 3: i4_row(x, d, gs, wr, sr, zr, 3, K, gshift, out); break;
            default: i4_row(x, d, gs, wr, sr, zr, 4, K, gshift, out); break;
            }
            for (int m = 0; m < mm; m++) y[(size_t)(m0 + m) * N + n] = out[m] + (b ? b[n] : 0.0f);
        }
    }
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
