/* gemm.c's bf16 kind of product, on CPUs with AVX512-BF16: it packs pairs of adjacent k values,
 * rounded to bf16, into 32 bits, and its micro-kernel multiplies them with vdpbf16ps, two products
 * per lane per instruction. On an AMD EPYC Zen 4 one core runs 228 GFLOP/s of vdpbf16ps (zmm)
 * against 112 of fp32 FMAs. Included by kernels.c after gemm_f32.c. */

#include "common.h"

#if defined(__AVX512F__)
#define BF_MR 12 /* 12 x 2 accumulators + 2 of B + 1 of A of AVX-512's 32 registers */
#define BF_NR 32 /* two vectors of 16 fp32 sums */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* bf16(lo) | bf16(hi) << 16, each rounded to nearest even (NaN kept), from their fp32 bits:
 * vertical integer operations only, so the packing loops vectorize. */
static inline uint32_t bf16_pair(uint32_t lo, uint32_t hi) {
    lo = (lo & 0x7fffffffu) > 0x7f800000u ? lo | 0x400000u : lo + 0x7fffu + ((lo >> 16) & 1u);
    hi = (hi & 0x7fffffffu) > 0x7f800000u ? hi | 0x400000u : hi + 0x7fffu + ((hi >> 16) & 1u);
    return lo >> 16 | (hi & 0xffff0000u);
}

/* The pair of k values (k, k + 1) of a vector whose element k is at v[k step] (k + 1 past kc: 0). */
static inline uint32_t pair_at(const float *v, long step, int k, int kc) {
    return bf16_pair(f32_bits(v[k * step]), k + 1 < kc ? f32_bits(v[(k + 1) * step]) : 0);
}

/* A's rows [0, m) and columns [0, kc), its rows adjacent (rsa 1), into panels of BF_MR rows, each
 * [kc / 2][BF_MR] pairs: the pair (k, k + 1) of row i at panel[k / 2 BF_MR + i]; rows past m and k
 * past kc are zeros. Each pair joins two runs of BF_MR values. */
static void gemm_pack_a_bf16(const void *av, long rsa, long csa, int m, int kc, void *panels) {
    const float *a = av;
    uint32_t *ap = panels;
    const int kp = (kc + 1) / 2;
    for (int i0 = 0; i0 < m; i0 += BF_MR, ap += (size_t)kp * BF_MR) {
        const int mr = m - i0 < BF_MR ? m - i0 : BF_MR;
        const float *ai = a + i0 * rsa;
        if (rsa == 1 && mr == BF_MR) {
            for (int k = 0; k < kc; k += 2) {
                const float *lo = ai + k * csa, *hi = ai + (k + 1) * csa;
                uint32_t *out = ap + k / 2 * BF_MR;
                if (k + 1 < kc)
                    for (int i = 0; i < BF_MR; i++) out[i] = bf16_pair(f32_bits(lo[i]), f32_bits(hi[i]));
                else
                    for (int i = 0; i < BF_MR; i++) out[i] = bf16_pair(f32_bits(lo[i]), 0);
            }
            continue;
        }
        for (int i = 0; i < BF_MR; i++)
            for (int k = 0; k < kc; k += 2) ap[k / 2 * BF_MR + i] = i < mr ? pair_at(ai + i * rsa, csa, k, kc) : 0;
    }
}

/* A's rows [0, m) and columns [0, kc) into panels of BF_MR rows, each [BF_MR][GEMM_KC / 2] pairs:
 * the pair (k, k + 1) of row i at panel[i GEMM_KC / 2 + k / 2], so that a row whose columns are
 * adjacent (csa 1) packs as one run; rows past m are zeros (k past kc is never read, but the pair
 * that straddles kc has a zero). */
static void gemm_pack_a_bf16_rows(const void *av, long rsa, long csa, int m, int kc, void *panels) {
    const float *a = av;
    uint32_t *ap = panels;
    for (int i0 = 0; i0 < m; i0 += BF_MR, ap += (size_t)BF_MR * GEMM_KC / 2)
        for (int i = 0; i < BF_MR; i++) {
            const float *ai = a + (i0 + i) * rsa;
            uint32_t *out = ap + i * GEMM_KC / 2;
            if (i0 + i >= m) {
                memset(out, 0, sizeof(uint32_t) * ((kc + 1) / 2));
            } else if (csa == 1) {
                for (int k = 0; k + 1 < kc; k += 2) out[k / 2] = bf16_pair(f32_bits(ai[k]), f32_bits(ai[k + 1]));
                if (kc & 1) out[kc / 2] = bf16_pair(f32_bits(ai[kc - 1]), 0);
            } else {
                for (int k = 0; k < kc; k += 2) out[k / 2] = pair_at(ai, csa, k, kc);
            }
        }
}

/* B's rows [0, kc) and the columns of panels [p0, p1) into panels of BF_NR columns, each
 * [kc / 2][BF_NR] pairs; panel p at bp + p (kc / 2) BF_NR. */
static void gemm_pack_b_bf16(const void *bv, long rsb, long csb, int n, int kc, int p0, int p1, void *panels) {
    const float *b = bv;
    const int kp = (kc + 1) / 2;
    for (int p = p0; p < p1; p++) {
        const int j0 = p * BF_NR, nr = n - j0 < BF_NR ? n - j0 : BF_NR;
        const float *bj = b + j0 * csb;
        uint32_t *out = (uint32_t *)panels + (size_t)p * kp * BF_NR;
        if (csb == 1 && nr == BF_NR) { /* each k's columns are adjacent: pair two runs of BF_NR */
            for (int k = 0; k + 1 < kc; k += 2) {
                const float *lo = bj + k * rsb, *hi = bj + (k + 1) * rsb;
                for (int j = 0; j < BF_NR; j++) out[k / 2 * BF_NR + j] = bf16_pair(f32_bits(lo[j]), f32_bits(hi[j]));
            }
            if (kc & 1)
                for (int j = 0; j < BF_NR; j++) out[kc / 2 * BF_NR + j] = bf16_pair(f32_bits(bj[(kc - 1) * rsb + j]), 0);
            continue;
        }
        for (int j = 0; j < BF_NR; j++)
            for (int k = 0; k < kc; k += 2) out[k / 2 * BF_NR + j] = j < nr ? pair_at(bj + j * csb, rsb, k, kc) : 0;
    }
}

/* The BF_MR x BF_NR tile c (+)= a b over kc, A's pair (k, k + 1) of row i at a[i si + k / 2 sk]:
 * vdpbf16ps adds both products of a pair to each lane. */
__attribute__((target("avx512f,avx512bf16"))) static inline void tile_bf16(int kc, const uint32_t *a, const int si,
                                                                            const int sk, const uint32_t *b, float *c,
                                                                            long ldc, int first, const float *bias,
                                                                            int m, int n) {
    __m512 acc[BF_MR][2];
#pragma GCC unroll 12
    for (int i = 0; i < BF_MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int k = 0; k < (kc + 1) / 2; k++, a += sk, b += BF_NR) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 16);
#pragma GCC unroll 12
        for (int i = 0; i < BF_MR; i++) {
            const __m512bh ai = (__m512bh)_mm512_set1_epi32((int)a[i * si]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
        }
    }
    const __mmask16 m0 = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
    const __mmask16 m1 = n >= 32 ? 0xffff : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1);
    const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int i = 0; i < BF_MR; i++) {
        if (i >= m) break;
        float *ci = c + i * ldc;
        acc[i][0] = _mm512_add_ps(acc[i][0], bias0);
        acc[i][1] = _mm512_add_ps(acc[i][1], bias1);
        if (!first) {
            acc[i][0] = _mm512_add_ps(acc[i][0], _mm512_maskz_loadu_ps(m0, ci));
            acc[i][1] = _mm512_add_ps(acc[i][1], _mm512_maskz_loadu_ps(m1, ci + 16));
        }
        _mm512_mask_storeu_ps(ci, m0, acc[i][0]);
        _mm512_mask_storeu_ps(ci + 16, m1, acc[i][1]);
    }
}

__attribute__((target("avx512f,avx512bf16"))) static void gemm_tile_bf16(int kc, const void *ap, long lda,
                                                                          const void *bp, float *c, long ldc,
                                                                          int first, const float *bias, int m, int n) {
    (void)lda;
    tile_bf16(kc, ap, 1, BF_MR, bp, c, ldc, first, bias, m, n);
}

__attribute__((target("avx512f,avx512bf16"))) static void gemm_tile_bf16_rows(int kc, const void *ap, long lda,
                                                                               const void *bp, float *c, long ldc,
                                                                               int first, const float *bias, int m,
                                                                               int n) {
    (void)lda;
    tile_bf16(kc, ap, GEMM_KC / 2, 1, bp, c, ldc, first, bias, m, n);
}

/* A packed to suit its layout: by k when its rows are adjacent, else by rows. */
static const gemm_kind_t GEMM_BF16 = {BF_MR, BF_NR, 2, 4, 4, 0, gemm_pack_a_bf16, gemm_pack_b_bf16, gemm_tile_bf16};
static const gemm_kind_t GEMM_BF16_ROWS = {BF_MR, BF_NR, 2, 4, 4, 1, gemm_pack_a_bf16_rows, gemm_pack_b_bf16,
                                           gemm_tile_bf16_rows};
#endif

/* Whether gl_gemm_bf16 runs here: this variant has AVX-512 and the CPU AVX512-BF16. */
int gl_has_gemm_bf16(void) {
#if defined(__AVX512F__)
    static int has = -1; /* cpuid once (a hypervisor may trap it) */
    if (has < 0) has = gl_cpu_features() >> 11 & 1;
    return has;
#else
    return 0;
#endif
}

/* As gl_sgemm with A and B rounded to bf16 (nearest even) as they are packed; the products of
 * each pair and the sums in fp32 (vdpbf16ps). Returns -2 where it does not run (gl_has_gemm_bf16). */
int gl_gemm_bf16(int M, int N, int K, const float *a, long rsa, long csa, const float *b, long rsb, long csb,
                 float *c, long ldc, const float *bias, int accumulate, int nthreads) {
#if defined(__AVX512F__)
    if (gl_has_gemm_bf16())
        return gemm(rsa == 1 ? &GEMM_BF16 : &GEMM_BF16_ROWS, M, N, K, a, rsa, csa, b, rsb, csb, c, ldc, bias,
                    accumulate, NULL, nthreads);
#endif
    (void)M, (void)N, (void)K, (void)a, (void)rsa, (void)csa, (void)b, (void)rsb, (void)csb, (void)c, (void)ldc;
    (void)bias, (void)accumulate, (void)nthreads;
    return -2;
}

/* C (M, N) = A B, as gl_sgemm, or as gl_gemm_bf16 when bf16 (-2 where that does not run), and
 * colmax (N) the largest value of each column of C, found as C's tiles are written (the training
 * head's W x^T: gptlab.chunked_loss hands them to gl_softmax_xent, sparing it a pass). */
int gl_sgemm_colmax(int M, int N, int K, const float *a, long rsa, long csa, const float *b, long rsb, long csb,
                    float *c, long ldc, float *colmax, int bf16, int nthreads) {
    const gemm_kind_t *kind = &GEMM_F32;
#if defined(__AVX512F__)
    if (bf16 && gl_has_gemm_bf16()) kind = rsa == 1 ? &GEMM_BF16 : &GEMM_BF16_ROWS, bf16 = 0;
#endif
    if (bf16) return -2;
    return gemm(kind, M, N, K, a, rsa, csa, b, rsb, csb, c, ldc, NULL, 0, colmax, nthreads);
}
