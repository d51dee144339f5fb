/* Float linear layers for decoding: y (M, N) = x (M, K) W^T + b for a few rows M, W fp32 or bf16.
 *
 * Decoding one token reads every weight once, so its speed is how fast the weights stream from
 * memory. These kernels read each weight row once for all M rows of x, in the layout the model
 * stores (no second, repacked copy), on all OpenMP threads (split over the output rows N), ROWS
 * weight rows at a time (ROWS streams in flight) against MROWS rows of x held in registers.
 * bf16 weights become fp32 by a shift (no native bf16 instructions needed) and are summed in fp32,
 * as torch's bf16 linear does.
 */
#include "common.h"

/* acc[r][m] += w_r[k..k+VW) * x_m[k..k+VW), fp32 w (the first n lanes when tail), prefetching
 * PF_FLOAT bytes ahead of each weight stream (measured +3-8% over the hardware prefetcher alone),
 * non-temporally when nta (common.h's prefetch_stream). */
AI void dot_step_f32(const float *w, const float *x, const int R, const int M, int K, int k, int n, int tail,
                     const int nta, vf acc[ROWS][MROWS]) {
    vf xv[MROWS];
    for (int m = 0; m < M; m++) xv[m] = tail ? vf_load_n(x + (size_t)m * K + k, n) : vf_load(x + (size_t)m * K + k);
    for (int r = 0; r < R; r++) {
        const float *p = w + (size_t)r * K + k;
        prefetch_stream((const char *)p + PF_FLOAT, nta);
        vf wv = tail ? vf_load_n(p, n) : vf_load(p);
        for (int m = 0; m < M; m++) acc[r][m] = vf_fma(wv, xv[m], acc[r][m]);
    }
}

/* The same for 2 VW bf16 weights w_r[k..k+2VW): one load gives the even-indexed weights as fp32
 * by a shift and the odd-indexed ones by a mask (no shuffles), against x stored with each block of
 * 2 VW as its VW even then its VW odd values (gl_order_pairs). */
AI void dot_step_bf16_pairs(const uint16_t *w, const float *x, const int R, const int M, int K, int k,
                            const int nta, vf acc[ROWS][MROWS]) {
    vf xe[MROWS], xo[MROWS];
    for (int m = 0; m < M; m++) {
        xe[m] = vf_load(x + (size_t)m * K + k);
        xo[m] = vf_load(x + (size_t)m * K + k + VW);
    }
    for (int r = 0; r < R; r++) {
        const uint16_t *p = w + (size_t)r * K + k;
        prefetch_stream((const char *)p + PF_FLOAT, nta);
        vf even, odd;
        vf_bf16_pairs(p, &even, &odd);
        for (int m = 0; m < M; m++) {
            acc[r][m] = vf_fma(even, xe[m], acc[r][m]);
            acc[r][m] = vf_fma(odd, xo[m], acc[r][m]);
        }
    }
}

/* A tail of fewer than 2 VW bf16 weights (x in natural order there), VW at a time, n lanes of it. */
AI void dot_step_bf16(const uint16_t *w, const float *x, const int R, const int M, int K, int k, int n,
                      vf acc[ROWS][MROWS]) {
    vf xv[MROWS];
    for (int m = 0; m < M; m++) xv[m] = vf_load_n(x + (size_t)m * K + k, n);
    for (int r = 0; r < R; r++) {
        vf wv = vf_load_bf16_n(w + (size_t)r * K + k, n);
        for (int m = 0; m < M; m++) acc[r][m] = vf_fma(wv, xv[m], acc[r][m]);
    }
}

/* out[r][m] = dot(w_r, x_m) for R rows of w and M rows of x (compile-time constants after
 * inlining, so the R x M accumulators live in registers). */
AI void dot_rm(const void *w, int bf16, const float *x, const int R, const int M, int K, const int nta,
               float out[ROWS][MROWS]) {
    vf acc[ROWS][MROWS];
    for (int r = 0; r < ROWS; r++)
        for (int m = 0; m < M; m++) acc[r][m] = vf_zero();
    int k = 0;
    if (bf16) {
        if (R == 1) /* one weight stream: ROWS sums along it in turn (SPLIT_SUMS in common.h) */
            for (; k + ROWS * 2 * VW <= K; k += ROWS * 2 * VW)
                for (int j = 0; j < ROWS; j++)
                    dot_step_bf16_pairs((const uint16_t *)w, x, 1, M, K, k + j * 2 * VW, nta, acc + j);
        for (; k + 2 * VW <= K; k += 2 * VW) dot_step_bf16_pairs((const uint16_t *)w, x, R, M, K, k, nta, acc);
        for (; k < K; k += VW) dot_step_bf16((const uint16_t *)w, x, R, M, K, k, K - k, acc);
    } else {
        if (R == 1)
            for (; k + ROWS * VW <= K; k += ROWS * VW)
                for (int j = 0; j < ROWS; j++) dot_step_f32((const float *)w, x, 1, M, K, k + j * VW, VW, 0, nta, acc + j);
        for (; k + VW <= K; k += VW) dot_step_f32((const float *)w, x, R, M, K, k, VW, 0, nta, acc);
        if (k < K) dot_step_f32((const float *)w, x, R, M, K, k, K - k, 1, nta, acc);
    }
    if (R == 4 || R == 1) {
        for (int m = 0; m < M; m++) {
            float s4[4];
            vf_sum4(acc[0][m], acc[1][m], acc[2][m], acc[3][m], s4);
            if (R == 1) out[0][m] = (s4[0] + s4[1]) + (s4[2] + s4[3]);
            else
                for (int r = 0; r < 4; r++) out[r][m] = s4[r];
        }
    } else {
        for (int r = 0; r < R; r++)
            for (int m = 0; m < M; m++) out[r][m] = vf_sum(acc[r][m]);
    }
}

static void dot_block(const void *w, int bf16, const float *x, int R, int M, int K, float out[ROWS][MROWS]) {
#define DOT(RR, MM) dot_rm(w, bf16, x, RR, MM, K, 0, out)
    SWITCH_RM(R, M, DOT)
#undef DOT
}

/* Row n of W (N, K), fp32 or (bf16) bf16. */
AI const void *w_row(const void *w, int bf16, int n, int K) {
    return bf16 ? (const void *)((const uint16_t *)w + (size_t)n * K) : (const void *)((const float *)w + (size_t)n * K);
}

/* y[m][n + r] = out[r][m] + bias[n + r] for R rows of W and M rows of x, y fp32 or bf16 (see common.h). */
AI void store_rows(float out[ROWS][MROWS], const void *bias, const int bias_bf16, void *y, int y_bf16, int R, int M,
                   int n, int N) {
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) {
            float v = out[r][m] + (bias ? param(bias, n + r, bias_bf16) : 0.0f);
            size_t i = (size_t)m * N + n + r;
            if (y_bf16 == 1) ((uint16_t *)y)[i] = f32_to_bf16(v);
            else ((float *)y)[i] = y_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
        }
}

/* Rows [n0, n1) of W, R at a time ((n1 - n0) a multiple of R), times M <= MROWS rows of x into y:
 * decoding's product, one call per thread (thread_rows in common.h). */
AI void dot_span(const void *w, int bf16, const float *x, const void *bias, const int bias_bf16, void *y, int y_bf16,
                 const int R, const int M, const int nta, int n0, int n1, int N, int K) {
    for (int n = n0; n < n1; n += R) {
        float out[ROWS][MROWS];
        dot_rm(w_row(w, bf16, n, K), bf16, x, R, M, K, nta, out);
        store_rows(out, bias, bias_bf16, y, y_bf16, R, M, n, N);
    }
}

/* dot_span specialized per R (1 or ROWS), M <= MROWS and prefetch hint (prefetch_nta in common.h). */
static void dot_span_rm(const void *w, int bf16, const float *x, const void *bias, const int bias_bf16, void *y,
                        int y_bf16, int R, int M, int n0, int n1, int N, int K) {
#define SPAN(RR, MM)                                                                                                   \
    (prefetch_nta() ? dot_span(w, bf16, x, bias, bias_bf16, y, y_bf16, RR, MM, 1, n0, n1, N, K)                          \
                    : dot_span(w, bf16, x, bias, bias_bf16, y, y_bf16, RR, MM, 0, n0, n1, N, K))
    SWITCH_RM(R, M, SPAN)
#undef SPAN
}

/* From how many rows of x fp32 weights run gptlab's GEMM instead (gl_sgemm_nt, the weights read in
 * place), on the AVX2 code's variants: past DECODE_MAX_M their 16 registers hold 2 rows of x per
 * block (MROWS_R) against 4 weight rows, so the float kernel's blocks read each weight row M / 2
 * times. GPT-2's whole fused decoding step (the head included), batches of 4-8 sequences, AMD EPYC
 * Zen 4, 2 threads, 2026-12-05, gl_sgemm_nt against the float kernel, medians of 5-7 alternating
 * rounds, avx2 / avx512-256: 4 rows 0.88 / 0.96x (against 2 rows of x per block then), 5 1.15 /
 * 1.09-1.12x, 6 1.11 / 1.13-1.16x, 7 1.25 / 1.25x, 8 1.28-1.36 / 1.33x. Not on avx512 (4 rows of x
 * per block: 0.76-0.85x at 4-8 rows) nor for bf16 weights (half the bytes: 0.65-0.95x on avx2).
 * On avx512 from 17 rows, where the modules switch to gl_sgemm_nt too: the fused step's fp32
 * batches of 17-64 rows (gptlab.fused_step.FLOAT_STEP_ROWS) then run what the modules run. */
#if GL_VARIANT == GL_AVX2
#define F32_GEMM_ROWS (DECODE_MAX_M + 1)
#elif GL_VARIANT == GL_AVX512
#define F32_GEMM_ROWS (VW + 1) /* past half gl_sgemm_nt's tile (2 VW columns), as linear.float_kernel_rows */
#else
#define F32_GEMM_ROWS INT_MAX
#endif

/* See common.h. Inlined per bias type: the bf16 head's bias read cost ~4% as a run-time choice. */
AI void linear_rows(const void *w, int bf16, const float *x, const void *bias, const int bias_bf16, void *y,
                    int y_bf16, int M, int N, int K, int nthreads) {
    if (M >= F32_GEMM_ROWS && !bf16 && !bias_bf16 && !y_bf16 &&
        !gl_sgemm_nt(M, N, K, x, K, 0, w, 0, y, N, 0, (const float *)bias, nthreads))
        return; /* else out of memory for its x^T panel: the float kernel's blocks need none */
    if (M <= MROWS) { /* decoding: a span of W's rows per thread */
#pragma omp parallel num_threads(nthreads)
        {
            int n0, n1;
            thread_rows(N, ROWS, &n0, &n1);
            const int R = BLOCK_ROWS(M), whole = n1 - (n1 - n0) % R;
            dot_span_rm(w, bf16, x, bias, bias_bf16, y, y_bf16, R, M, n0, whole, N, K);
            dot_span_rm(w, bf16, x, bias, bias_bf16, y, y_bf16, 1, M, whole, n1, N, K); /* N's last rows */
        }
        return;
    }
    const int nblocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int blk = 0; blk < nblocks; blk++) {
        const int n0 = blk * ROWS, R = N - n0 < ROWS ? 1 : BLOCK_ROWS(M); /* the last partial block: row by row */
        for (int n = n0; n < n0 + ROWS && n < N; n += R) {
            const void *wr = w_row(w, bf16, n, K);
            const int mstep = R == ROWS ? MROWS_R : MROWS;
            for (int m0 = 0; m0 < M; m0 += mstep) {
                const int mm = M - m0 < mstep ? M - m0 : mstep;
                float out[ROWS][MROWS];
                dot_block(wr, bf16, x + (size_t)m0 * K, R, mm, K, out);
                store_rows(out, bias, bias_bf16, (char *)y + (size_t)m0 * N * (y_bf16 == 1 ? 2 : 4), y_bf16, R, mm, n,
                           N);
            }
        }
    }
}

void gl_linear_rows(const void *w, int w_bf16, const float *x, const void *bias, int bias_bf16, void *y, int y_bf16,
                    int M, int N, int K, int nthreads) {
    if (bias_bf16) linear_rows(w, w_bf16, x, bias, 1, y, y_bf16, M, N, K, nthreads);
    else linear_rows(w, w_bf16, x, bias, 0, y, y_bf16, M, N, K, nthreads);
}

/* fp32 W (N, K), fp32 x (M, K), b (N) or NULL -> fp32 y (M, N). */
int gl_linear_f32(const float *x, const float *w, const float *b, float *y, int M, int N, int K, int nthreads) {
    linear_rows(w, 0, x, b, 0, y, 0, M, N, K, nthreads);
    return 0;
}

/* x (M, K), fp32 or (bf16) bf16, into fp32 xo, each whole block of 2 VW as its VW even then its
 * VW odd values (the order dot_step_bf16_pairs reads); a tail of fewer than 2 VW stays in order. */
static void order_pairs(const void *x, int bf16, float *xo, int M, int K) {
    for (int m = 0; m < M; m++) {
        const size_t row = (size_t)m * K;
        float *o = xo + row;
        int k = 0;
        for (; k + 2 * VW <= K; k += 2 * VW)
            for (int i = 0; i < VW; i++) {
                o[k + i] = param(x, row + k + 2 * i, bf16);
                o[k + VW + i] = param(x, row + k + 2 * i + 1, bf16);
            }
        for (; k < K; k++) o[k] = param(x, row + k, bf16);
    }
}

void gl_order_pairs(const float *x, float *xo, int M, int K) { order_pairs(x, 0, xo, M, K); }

/* bf16 x (M, K) and W (N, K), fp32 b (N) or NULL -> bf16 y (M, N). Returns -1 when out of memory. */
int gl_linear_bf16(const uint16_t *x, const uint16_t *w, const float *b, uint16_t *y, int M, int N, int K,
                   int nthreads) {
    float *xf = gl_scratch((size_t)M * K * sizeof(float));
    if (!xf) return -1;
    order_pairs(x, 1, xf, M, K);
    linear_rows(w, 1, xf, b, 0, y, 1, M, N, K, nthreads);
    return 0;
}
