/* Quantized linear layers for decoding, with 8-bit activations and integer dot products. This
 * file holds the int8 layer and what both layers share (quantizing x per row, tiles of x for a
 * prompt); quantized_i4.c, included after it, the int4 layer:
 *
 *   gl_linear_i8   int8 W (N, K) with one scale per row; x quantized per row to int8 (one scale
 *                  per row of x), as llama.cpp's Q8_0 x Q8_0.
 *   gl_linear_i4   int4 W (N, K/2) (even column in the low nibble), a scale and zero per group of
 *                  g inputs; x quantized per row too (so the integer products need one fp32 scale
 *                  per block of W only: a quarter fewer instructions than Q4_0 x Q8_0's two).
 *
 * The integer sums are exact on every variant (vi_dot_i8 and vi_dot_u4 in simd.h never saturate),
 * so the variants differ only in the order of the fp32 sums after them.
 */
#include "common.h"

/* ---------------------------------------------------------------- x quantized per row, tiles of x: both layers' */

/* Rows of x at which quantizing them is worth the threads (a prompt, not a decoding step). */
#define QUANTIZE_PARALLEL_ROWS 16

/* max |p[0..n)| for n a multiple of VW. */
static inline float absmax(const float *p, int n) {
    vf m = vf_zero();
    for (int k = 0; k < n; k += VW) m = vf_max(m, vf_abs(vf_load(p + k)));
    return vf_hmax(m);
}

/* q[k] = round(p[k] inv) + offset as bytes, k < n, n a multiple of VW (rounding to nearest even,
 * as lrintf: the same bytes on every variant). */
static inline void quantize_bytes(const float *p, void *q, int n, float inv, float offset) {
    const vf vinv = vf_set1(inv), voff = vf_set1(offset);
    for (int k = 0; k < n; k += VW) vf_store_bytes((uint8_t *)q + k, vf_add(vf_round(vf_mul(vf_load(p + k), vinv)), voff));
}

/* Quantize x (M, K) fp32 per row: xq = round(x / s) + offset (GL_I8_OFFSET, see simd.h, for this
 * file's kernels), s = max|x| / 127; writes xq (M, K) and s (M). */
static void quantize_rows_i8(const float *x, uint8_t *xq, float *s, int M, int K, int offset, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= QUANTIZE_PARALLEL_ROWS)
    for (int m = 0; m < M; m++) {
        const float *r = x + (size_t)m * K;
        uint8_t *q = xq + (size_t)m * K;
        const int kv = K - K % VW;
        float amax = absmax(r, kv);
        for (int k = kv; k < K; k++) amax = fmaxf(amax, fabsf(r[k]));
        float scale = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
        quantize_bytes(r, q, kv, inv, (float)offset);
        for (int k = kv; k < K; k++) q[k] = (uint8_t)(lrintf(r[k] * inv) + offset);
        s[m] = scale;
    }
}

/* x (M, K) fp32 quantized per row as unsigned bytes, xq = round(x / s) + 128 with s = max|x| / 127
 * (M scales): a prompt's activations for PyTorch's oneDNN int8 product (quantize.py), whose
 * per-tensor scale this per-row one replaces (applied to its output rows). */
int gl_quantize_rows_u8(const float *x, uint8_t *xq, float *s, int M, int K, int nthreads) {
    quantize_rows_i8(x, xq, s, M, K, 128, nthreads);
    return 0;
}

/* Rows of x per tile: a prompt's quantized x is multiplied a tile at a time, each tile small enough
 * to stay in L2 (X_TILE_BYTES) while all of W streams past it, instead of all of x streaming from
 * L3 once per block of W's rows (x is 1.5 MiB at 512 x 3072). */
#define X_TILE_BYTES (128 * 1024)
static int x_tile_rows(int K, int mrows) { /* a multiple of mrows, the rows of x a block takes */
    const int rows = X_TILE_BYTES / K / mrows * mrows;
    return rows > mrows ? rows : mrows;
}
/* The end of the tile of x starting at row t0. */
static inline int tile_end(int t0, int tile, int M) { return M - t0 < tile ? M : t0 + tile; }

/* ---------------------------------------------------------------- int8 weights, one scale per row */

/* The first n (< VB) bytes of p, the rest 0. */
static inline vi vi_load_part(const void *p, int n) {
    uint8_t t[VB] = {0};
    memcpy(t, p, (size_t)n);
    return vi_load(t);
}

/* acc[r][m] += the products of w_r[k..k+VB) and xq_m[k..k+VB) (the first n bytes when tail). A
 * zero weight byte adds nothing, whatever the activation byte (GL_I8_OFFSET included). */
AI void i8_step(const int8_t *w, const uint8_t *xq, const int R, const int M, int K, int k, int n, int tail,
                const int nta, vi acc[ROWS][MROWS]) {
    vi xv[MROWS];
    for (int m = 0; m < M; m++)
        xv[m] = tail ? vi_load_part(xq + (size_t)m * K + k, n) : vi_load(xq + (size_t)m * K + k);
    for (int r = 0; r < R; r++) {
        const int8_t *p = w + (size_t)r * K + k;
        prefetch_stream((const char *)p + PF_I8, nta);
        vi wv = tail ? vi_load_part(p, n) : vi_load(p);
        for (int m = 0; m < M; m++) acc[r][m] = vi_dot_i8(acc[r][m], xv[m], wv);
    }
}

/* out[r][m] = sum_k xq[m, k] w[r, k] for R rows of w and M rows of xq (compile-time constants). */
AI void i8_rm(const int8_t *w, const uint8_t *xq, const int R, const int M, int K, const int nta,
              int32_t out[ROWS][MROWS]) {
    vi acc[ROWS][MROWS];
    for (int r = 0; r < ROWS; r++)
        for (int m = 0; m < M; m++) acc[r][m] = vi_zero();
    int k = 0;
    if (R == 1) /* one weight stream: ROWS sums along it in turn (SPLIT_SUMS in common.h) */
        for (; k + ROWS * VB <= K; k += ROWS * VB)
            for (int j = 0; j < ROWS; j++) i8_step(w, xq, 1, M, K, k + j * VB, VB, 0, nta, acc + j);
    for (; k + VB <= K; k += VB) i8_step(w, xq, R, M, K, k, VB, 0, nta, acc);
    if (k < K) i8_step(w, xq, R, M, K, k, K - k, 1, nta, acc);
    if (R == 4 || R == 1) {
        for (int m = 0; m < M; m++) {
            int32_t s4[4];
            vi_sum4(acc[0][m], acc[1][m], acc[2][m], acc[3][m], s4);
            if (R == 1) out[0][m] = s4[0] + s4[1] + s4[2] + s4[3];
            else
                for (int r = 0; r < 4; r++) out[r][m] = s4[r];
        }
    } else {
        for (int r = 0; r < R; r++)
            for (int m = 0; m < M; m++) out[r][m] = vi_sum(acc[r][m]);
    }
}

static void i8_block(const int8_t *w, const uint8_t *xq, int R, int M, int K, int32_t out[ROWS][MROWS]) {
#define DOT(RR, MM) i8_rm(w, xq, RR, MM, K, 0, out)
    SWITCH_RM(R, M, DOT)
#undef DOT
}

/* y[m][n + r] = xs[m] ws[n + r] (out[r][m] - offset wsum[n + r]) + b[n + r], R rows of W, M of x. */
AI void i8_store(int32_t out[ROWS][MROWS], const float *xs, const uint16_t *ws, const int32_t *wsum, const float *b,
                 float *y, int R, int M, int n, int N) {
    for (int r = 0; r < R; r++) {
        const float scale = bf16_to_f32(ws[n + r]);
        for (int m = 0; m < M; m++) {
            const int32_t dot = out[r][m] - GL_I8_OFFSET * wsum[n + r];
            y[(size_t)m * N + n + r] = xs[m] * scale * (float)dot + (b ? b[n + r] : 0.0f);
        }
    }
}

/* Rows [n0, n1) of W, R at a time ((n1 - n0) a multiple of R), times M <= MROWS rows of xq into y:
 * decoding's product, one call per thread (thread_rows in common.h). */
AI void i8_span(const int8_t *w, const uint8_t *xq, const float *xs, const uint16_t *ws, const int32_t *wsum,
                const float *b, float *y, const int R, const int M, const int nta, int n0, int n1, int N, int K) {
    for (int n = n0; n < n1; n += R) {
        int32_t out[ROWS][MROWS];
        i8_rm(w + (size_t)n * K, xq, R, M, K, nta, out);
        i8_store(out, xs, ws, wsum, b, y, R, M, n, N);
    }
}

/* i8_span specialized per R (1 or ROWS), M <= MROWS and prefetch hint (prefetch_nta in common.h). */
static void i8_span_rm(const int8_t *w, const uint8_t *xq, const float *xs, const uint16_t *ws, const int32_t *wsum,
                       const float *b, float *y, int R, int M, int n0, int n1, int N, int K) {
#define SPAN(RR, MM)                                                                                                   \
    (prefetch_nta() ? i8_span(w, xq, xs, ws, wsum, b, y, RR, MM, 1, n0, n1, N, K)                                        \
                    : i8_span(w, xq, xs, ws, wsum, b, y, RR, MM, 0, n0, n1, N, K))
    SWITCH_RM(R, M, SPAN)
#undef SPAN
}

/* y (M, N) = x (M, K) W^T + b for int8 W (N, K) with bf16 row scales ws (N) and row sums wsum (N):
 * x is quantized per row (xq, xs), then y[m, n] = xs[m] ws[n] (sum_k xq[m, k] w[n, k] - offset
 * wsum[n]) + b[n]. Returns -1 when out of memory. */
int gl_linear_i8(const float *x, const int8_t *w, const uint16_t *ws, const int32_t *wsum, const float *b, float *y,
                 int M, int N, int K, int nthreads) {
    uint8_t *xq = gl_scratch((size_t)M * K + (size_t)M * sizeof(float) + 64);
    if (!xq) return -1;
    float *xs = (float *)(xq + (((size_t)M * K + 63) & ~(size_t)63));
    quantize_rows_i8(x, xq, xs, M, K, GL_I8_OFFSET, nthreads);
    if (M <= MROWS) { /* decoding: a span of W's rows per thread */
#pragma omp parallel num_threads(nthreads)
        {
            int n0, n1;
            thread_rows(N, ROWS, &n0, &n1);
            const int R = BLOCK_ROWS(M), whole = n1 - (n1 - n0) % R;
            i8_span_rm(w, xq, xs, ws, wsum, b, y, R, M, n0, whole, N, K);
            i8_span_rm(w, xq, xs, ws, wsum, b, y, 1, M, whole, n1, N, K); /* N's last rows */
        }
        return 0;
    }
    const int nblocks = (N + ROWS - 1) / ROWS, tile = x_tile_rows(K, MROWS);
#pragma omp parallel num_threads(nthreads)
    for (int t0 = 0; t0 < M; t0 += tile) { /* a tile of x stays in L2 while W streams past it */
        const int t1 = tile_end(t0, tile, M);
#pragma omp for schedule(static)
        for (int blk = 0; blk < nblocks; blk++) {
            const int n0 = blk * ROWS, R = N - n0 < ROWS ? 1 : BLOCK_ROWS(M); /* the last partial block: row by row */
            for (int n = n0; n < n0 + ROWS && n < N; n += R) {
                const int mstep = R == ROWS ? MROWS_R : MROWS;
                for (int m0 = t0; m0 < t1; m0 += mstep) {
                    const int mm = t1 - m0 < mstep ? t1 - m0 : mstep;
                    int32_t out[ROWS][MROWS];
                    i8_block(w + (size_t)n * K, xq + (size_t)m0 * K, R, mm, K, out);
                    i8_store(out, xs + m0, ws, wsum, b, y + (size_t)m0 * N, R, mm, n, N);
                }
            }
        }
    }
    return 0;
}

/* The fp32 weight (N, K) an int8 layer stands for, w = q * scale, for a prompt's GEMM on CPUs
 * whose PyTorch int8 GEMM loses precision (fbgemm without VNNI quantizes activations to 7 bits). */
void gl_dequantize_i8(const int8_t *w, const uint16_t *scales, float *out, int N, int K, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n = 0; n < N; n++) {
        const float s = bf16_to_f32(scales[n]);
        const int8_t *wr = w + (size_t)n * K;
        float *o = out + (size_t)n * K;
        for (int k = 0; k < K; k++) o[k] = (float)wr[k] * s;
    }
}
