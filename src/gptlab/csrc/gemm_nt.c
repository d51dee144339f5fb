/* A prompt's linear layer in gemm.c's product (gl_sgemm_nt, gemm.sgemm_linear). Prompts of up
 * to a few hundred tokens multiply their layers as y^T = W x^T, the weights read in place as A
 * (gemm_f32.c's in-place and row-widening kinds): packing them, a transpose of every weight on
 * every call, took a fifth of a 64-token GPT-2 forward. Included by kernels.c after gemm_f32.c. */

#include "common.h"

#if defined(__AVX2__)
/* 8 fp32 values rounded to bf16 as f32_to_bf16 rounds them (to nearest even, NaN kept). */
static inline __m128i bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v), one = _mm256_set1_epi32(1);
    const __m256i even = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                              _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i r = _mm256_srli_epi32(_mm256_blendv_epi8(even, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan), 16);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8)); /* 8 x 16 bits */
}
#endif

/* y (M, N) = t (N, M) transposed, + bias (N values, or NULL), y's rows ldy apart: fp32, or rounded
 * to bf16 as it is written when y_bf16 (a bf16 model's prompts: no fp32 y to round afterwards). */
static void transpose_bias(const float *t, int N, int M, const float *bias, void *y, long ldy, int y_bf16,
                           int nthreads) {
    float *yf = y;
    uint16_t *yh = y;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n0 = 0; n0 < N; n0 += 8) {
        int m0 = 0;
#if defined(__AVX2__)
        if (n0 + 8 <= N) {
            __m256 b = bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
            for (; m0 + 8 <= M; m0 += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(t + (size_t)(n0 + i) * M + m0);
                transpose8(r);
                for (int j = 0; j < 8; j++) {
                    const __m256 v = _mm256_add_ps(r[j], b);
                    if (y_bf16)
                        _mm_storeu_si128((__m128i *)(yh + (m0 + j) * ldy + n0), bf16x8(v));
                    else
                        _mm256_storeu_ps(yf + (m0 + j) * ldy + n0, v);
                }
            }
        }
#endif
        const int n1 = n0 + 8 < N ? n0 + 8 : N;
        for (int m = m0; m < M; m++)
            for (int n = n0; n < n1; n++) {
                const float v = t[(size_t)n * M + m] + (bias ? bias[n] : 0.0f);
                if (y_bf16)
                    yh[m * ldy + n] = f32_to_bf16(v);
                else
                    yf[m * ldy + n] = v;
            }
    }
}

#define NT_SLAB_BYTES (8 << 20) /* y^T computed this many bytes at a time, then transposed */

/* A prompt's linear layer, y (M, N) = x (M, K) W^T + bias: x's rows ldx apart, W (N, K) contiguous,
 * each fp32 or bf16 (x bf16 only with W bf16), y's rows ldy apart, bias N values or NULL. Computed
 * as y^T = W x^T, W as A read in place (bf16 W widened a block of rows at a time, no transpose), so
 * that the weights, the larger operand, are never packed; x^T is (x is small). y^T is found a slab
 * of W's rows at a time (at most NT_SLAB_BYTES: GPT-2's head against 512 rows of x would take
 * 103 MB more) and transposed into y, fp32 or (y_bf16) rounded to bf16 as it is written. Returns 0,
 * -1 out of memory, or -2 for bf16 x against fp32 W. */
int gl_sgemm_nt(int M, int N, int K, const void *x, long ldx, int x_bf16, const void *w, int w_bf16, void *y, long ldy,
                int y_bf16, const float *bias, int nthreads) {
    if (x_bf16 && !w_bf16) return -2;
    if (M <= 0 || N <= 0) return 0;
    const gemm_kind_t *kind = !w_bf16 ? &GEMM_F32_A_IN_PLACE : x_bf16 ? &GEMM_BF16_AB_ROWS : &GEMM_BF16_A_ROWS;
    int slab = NT_SLAB_BYTES / 4 / M / 24 * 24; /* whole tiles (MR) and transposed blocks (8) */
    slab = slab < 24 ? 24 : slab > N ? N : slab;
    float *t = alloc_elems((size_t)slab * M);
    if (!t) return -1;
    int status = 0;
    for (int n0 = 0; n0 < N && !status; n0 += slab) {
        const int n = N - n0 < slab ? N - n0 : slab;
        const char *w0 = (const char *)w + (size_t)n0 * K * kind->a_size;
        status = gemm(kind, n, M, K, w0, K, 1, x, 1, ldx, t, M, NULL, 0, NULL, nthreads);
        if (!status)
            transpose_bias(t, n, M, bias ? bias + n0 : NULL, (char *)y + (size_t)n0 * (y_bf16 ? 2 : 4), ldy, y_bf16,
                           nthreads);
    }
    free(t);
    return status;
}
