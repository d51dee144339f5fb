/* gemm.c's fp32 kinds of product: the MR x NR micro-kernels (A packed, or read in place for
 * gl_sgemm_nt's weights), the packing of A's and B's panels, fp32 or bf16 widened exactly as it is
 * packed, and the fp32 entry points. Included by kernels.c after gemm.c. */

#include "common.h"

/* c's m x n corner (+)= tile (rows `width` apart): a tile's part inside C's edges. */
static inline void tile_store_part(float *c, long ldc, const float *tile, int width, int m, int n, int first) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) c[i * ldc + j] = first ? tile[i * width + j] : c[i * ldc + j] + tile[i * width + j];
}

/* tile_f32 for a panel of at most VW columns (n <= VW): its first vector only, each sum the same. */
static inline __attribute__((always_inline)) void tile_f32_half(int kc, const float *a, long si, long sk,
                                                                const float *b, float *c, long ldc, int first,
                                                                const float *bias, int m, int n) {
    vf acc[GEMM_MR];
#pragma GCC unroll 6
    for (int i = 0; i < GEMM_MR; i++) acc[i] = vf_zero();
    for (int k = 0; k < kc; k++, b += GEMM_NR) {
        const vf b0 = vf_load(b);
#pragma GCC unroll 6
        for (int i = 0; i < GEMM_MR; i++) acc[i] = vf_fma(vf_set1(a[i * si + k * sk]), b0, acc[i]);
    }
    if (bias) {
        const vf bias0 = vf_load_n(bias, n);
        for (int i = 0; i < GEMM_MR; i++) acc[i] = vf_add(acc[i], bias0);
    }
    float tile[GEMM_MR][VW];
    for (int i = 0; i < GEMM_MR; i++) vf_store(tile[i], acc[i]);
    tile_store_part(c, ldc, tile[0], VW, m, n, first);
}

/* A last panel of gl_sgemm_nt's x^T (B) more than one vector wide but at most SPLIT_REST columns
 * past it: 9-12 rows of x on AVX2's 16 columns a panel, 17-24 on AVX-512's 32. A whole tile
 * spends two FMAs on each weight value for them, where one vector of x's rows (8 rows) takes one:
 * GPT-2 decoded 9 sequences at 257-265 tok/s against 8 sequences' 337-342 (AMD EPYC Zen 4,
 * avx512-256). Such a panel is packed as its first VW columns [kc][VW] (a half tile reads them)
 * and then the other columns, each its kc values in a row (packed_split), which the tile
 * multiplies as dot products along k with A's rows while they are in L1 (tile_f32_split). */
#define SPLIT_REST (VW / 2)
static inline int split_panel(int nr) { return nr > VW && nr <= VW + SPLIT_REST; }

/* acc[i][j] += A's row i . row j of rest over k..k+n (n <= VW lanes), for w (1 or 2) rows of rest. */
AI void rest_step(int kc, const float *a, long si, const float *rest, const int w, int k, const int n,
                  vf acc[GEMM_MR][2]) {
    const vf b0 = vf_load_n(rest + k, n), b1 = w == 2 ? vf_load_n(rest + kc + k, n) : b0;
#pragma GCC unroll 6
    for (int i = 0; i < GEMM_MR; i++) {
        const vf ai = vf_load_n(a + i * si + k, n);
        acc[i][0] = vf_fma(ai, b0, acc[i][0]);
        if (w == 2) acc[i][1] = vf_fma(ai, b1, acc[i][1]);
    }
}

/* tile[i][col + j] = A's row i (k values adjacent, rows si apart) . row j of rest (kc values,
 * rows kc apart), for the MR rows of A and w (1 or 2) rows of rest: lanes along k, summed at the end. */
AI void rest_dots(int kc, const float *a, long si, const float *rest, const int w, float tile[GEMM_MR][GEMM_NR],
                  int col) {
    vf acc[GEMM_MR][2];
    for (int i = 0; i < GEMM_MR; i++) acc[i][0] = acc[i][1] = vf_zero();
    int k = 0;
    for (; k + VW <= kc; k += VW) rest_step(kc, a, si, rest, w, k, VW, acc);
    if (k < kc) rest_step(kc, a, si, rest, w, k, kc - k, acc); /* the last lanes: none read past kc */
    for (int i = 0; i < GEMM_MR; i++) {
        tile[i][col] = vf_sum(acc[i][0]);
        if (w == 2) tile[i][col + 1] = vf_sum(acc[i][1]);
    }
}

/* tile_f32 for a split panel (split_panel(n); b packed as packed_split says), A's k values
 * adjacent (sk 1): half a tile for the first VW columns, dot products for the n - VW others.
 * (gl_sgemm_nt, its one caller, passes no bias: it adds it as it transposes y^T.) */
static inline __attribute__((always_inline)) void tile_f32_split(int kc, const float *a, long si, const float *b,
                                                                 float *c, long ldc, int first, const float *bias,
                                                                 int m, int n) {
    float tile[GEMM_MR][GEMM_NR];
    vf acc[GEMM_MR];
#pragma GCC unroll 6
    for (int i = 0; i < GEMM_MR; i++) acc[i] = vf_zero();
    for (int k = 0; k < kc; k++) {
        const vf b0 = vf_load(b + k * VW);
#pragma GCC unroll 6
        for (int i = 0; i < GEMM_MR; i++) acc[i] = vf_fma(vf_set1(a[i * si + k]), b0, acc[i]);
    }
    for (int i = 0; i < GEMM_MR; i++) vf_store(tile[i], acc[i]);
    const float *rest = b + (size_t)kc * VW;
    int j = VW;
    for (; j + 2 <= n; j += 2) rest_dots(kc, a, si, rest + (size_t)(j - VW) * kc, 2, tile, j);
    if (j < n) rest_dots(kc, a, si, rest + (size_t)(j - VW) * kc, 1, tile, j);
    for (int i = 0; bias && i < GEMM_MR; i++)
        for (j = 0; j < n; j++) tile[i][j] += bias[j];
    tile_store_part(c, ldc, tile[0], GEMM_NR, m, n, first);
}

/* The MR x NR tile c (row stride ldc) = (first ? 0 : c) + a b (+ bias, NR values, unless NULL) over
 * kc: A's value (i, k) at a[i si + k sk], b packed [kc][NR].
 * Only the first m rows and n columns are written (the packed padding is zeros). A last panel of
 * at most VW columns computes only those (tile_f32_half): a prompt of 17 rows, whose x^T is B in
 * gl_sgemm_nt, took as long as one of 32 (AVX2's 16 columns a panel). With split (gl_sgemm_nt's
 * kinds, whose B is packed by packed_split), a split panel goes to tile_f32_split. */
static inline __attribute__((always_inline)) void tile_f32(int kc, const float *a, long si, long sk,
                                                           const float *b, float *c, long ldc, int first,
                                                           const float *bias, int m, int n, const int split) {
    if (split && split_panel(n)) {
        tile_f32_split(kc, a, si, b, c, ldc, first, bias, m, n);
        return;
    }
    if (n <= VW) {
        tile_f32_half(kc, a, si, sk, b, c, ldc, first, bias, m, n);
        return;
    }
    vf acc[GEMM_MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < GEMM_MR; i++) acc[i][0] = acc[i][1] = vf_zero();
    for (int k = 0; k < kc; k++, b += GEMM_NR) {
        const vf b0 = vf_load(b), b1 = vf_load(b + VW);
#pragma GCC unroll 6
        for (int i = 0; i < GEMM_MR; i++) {
            const vf ai = vf_set1(a[i * si + k * sk]);
            acc[i][0] = vf_fma(ai, b0, acc[i][0]);
            acc[i][1] = vf_fma(ai, b1, acc[i][1]);
        }
    }
    if (bias) {
        const vf bias0 = vf_load_n(bias, n), bias1 = vf_load_n(bias + VW, n - VW);
        for (int i = 0; i < GEMM_MR; i++) acc[i][0] = vf_add(acc[i][0], bias0), acc[i][1] = vf_add(acc[i][1], bias1);
    }
    if (m == GEMM_MR && n == GEMM_NR) {
#pragma GCC unroll 6
        for (int i = 0; i < GEMM_MR; i++) {
            float *ci = c + i * ldc;
            vf_store(ci, first ? acc[i][0] : vf_add(acc[i][0], vf_load(ci)));
            vf_store(ci + VW, first ? acc[i][1] : vf_add(acc[i][1], vf_load(ci + VW)));
        }
        return;
    }
    float tile[GEMM_MR][GEMM_NR];
    for (int i = 0; i < GEMM_MR; i++) {
        vf_store(tile[i], acc[i][0]);
        vf_store(tile[i] + VW, acc[i][1]);
    }
    tile_store_part(c, ldc, tile[0], GEMM_NR, m, n, first);
}

/* The tile with A packed, [kc][MR] (lda unused). */
static void gemm_tile(int kc, const void *ap, long lda, const void *bp, float *c, long ldc, int first,
                      const float *bias, int m, int n) {
    (void)lda;
    tile_f32(kc, ap, 1, GEMM_MR, bp, c, ldc, first, bias, m, n, 0);
}

/* The tile with A read in place, rows lda apart (fp32), B packed by packed_split: for m < MR rows,
 * A's rows copied into a panel first (kc apart, zeros past m), so that no row past A's end is read. */
static void gemm_tile_in_place(int kc, const void *a, long lda, const void *bp, float *c, long ldc, int first,
                               const float *bias, int m, int n) {
    if (m == GEMM_MR) {
        tile_f32(kc, a, lda, 1, bp, c, ldc, first, bias, m, n, 1);
        return;
    }
    float panel[GEMM_MR * GEMM_KC];
    for (int i = 0; i < GEMM_MR; i++)
        for (int k = 0; k < kc; k++) panel[i * kc + k] = i < m ? ((const float *)a)[i * lda + k] : 0.0f;
    tile_f32(kc, panel, kc, 1, bp, c, ldc, first, bias, m, n, 1);
}

/* bf16 A whose rows' k values are adjacent (gl_sgemm_nt's weights; rsa apart, csa 1): rows [0, m)
 * widened exactly into panels of MR rows, each row's kc values together, GEMM_KC apart ([MR][GEMM_KC]
 * fp32, a_rows), the rows past m zero. No transpose: the tile reads them as it reads fp32 weights in
 * place. Widening each value as the tile broadcast it cost a load, a shift and a broadcast where an
 * fp32 value takes one broadcast from memory: against gl_sgemm_bf16_ab (the weights widened as they
 * are packed) that lost from ~96 rows, 0.89x at 256 (GPT-2's block layers, AMD EPYC Zen 4, avx2);
 * widened a block at a time it wins up to 512 rows (1.05x at 256), as fp32 weights read in place. */
static void gemm_widen_a_rows(const void *a, long rsa, long csa, int m, int kc, void *panels) {
    (void)csa;
    float *ap = panels;
    for (int i0 = 0; i0 < m; i0 += GEMM_MR, ap += (size_t)GEMM_MR * GEMM_KC)
        for (int i = 0; i < GEMM_MR; i++) {
            const uint16_t *row = (const uint16_t *)a + (size_t)(i0 + i) * rsa;
            float *out = ap + (size_t)i * GEMM_KC;
            int k = 0;
            if (i0 + i < m)
                for (; k + VW <= kc; k += VW) vf_store(out + k, vf_load_bf16(row + k));
            for (; k < kc; k++) out[k] = i0 + i < m ? bf16_to_f32(row[k]) : 0.0f;
        }
}

/* The tile with A widened into rows (gemm_widen_a_rows; lda unused): every row of the panel is
 * there, zeros past m. */
static void gemm_tile_rows(int kc, const void *ap, long lda, const void *bp, float *c, long ldc, int first,
                           const float *bias, int m, int n) {
    (void)lda;
    tile_f32(kc, ap, GEMM_KC, 1, bp, c, ldc, first, bias, m, n, 1);
}

#if defined(__AVX2__)
/* 8 values of element size 4 (fp32) or 2 (bf16, widened exactly) at p. */
static inline __m256 load8(const void *p, int bf16) {
    if (!bf16) return _mm256_loadu_ps(p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* r[i] (8 k values of row i) -> r[k] (the 8 rows' values at k), in registers: pairs of rows
 * interleaved, then fours, then the 128-bit halves swapped. */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20), r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
}
#endif

/* A panel of `width` values per k from `width` rows whose k values are adjacent (a transpose):
 * out[k width + i] = row i's k-th value, row i from element at + i stride of src (fp32, or bf16
 * widened exactly), for k < kc. Long prompts' x (A) and the weights they multiply (B, stored (N, K)) and
 * the head's logits in e x (A) are packed this way. On x86 with AVX2 (every SIMD variant there),
 * 8 k values of 8 rows at a time by a transpose in registers: for a width of 8 or more (B's NR) in
 * whole groups of 8 rows; for a narrower one (A's MR = 6) the missing rows are zeros and each k's
 * 8 floats spill into the next k's, overwritten by its store, so that loop stops one k short of
 * the panel's end. The rest is scalar, as every element was before (the same bits). Measured on
 * the AMD EPYC Zen 5, 2 threads, against that: held to AVX2, the head's e x 59.6 -> 55.1 ms
 * (medians of 7), a 512-token GPT-2 prefill 466 -> 450 ms in fp32 and 477 -> 458 in bf16 (medians
 * of 9 alternating rounds); natively (avx512, 32 columns a panel) that fp32 prefill 335 -> 285 ms. */
static void pack_rows(const void *src, size_t at, long stride, int width, int kc, float *out, int bf16) {
    const int size = bf16 ? 2 : 4;
    const char *base = (const char *)src + at * size;
    int k = 0;
#if defined(__AVX2__)
    if (width % 8 == 0) {
        for (; k + 8 <= kc; k += 8)
            for (int g = 0; g < width; g += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = load8(base + ((g + i) * stride + k) * size, bf16);
                transpose8(r);
                for (int kk = 0; kk < 8; kk++) _mm256_storeu_ps(out + (k + kk) * width + g, r[kk]);
            }
    } else if (width < 8) {
        for (; k + 8 < kc; k += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = i < width ? load8(base + (i * stride + k) * size, bf16) : _mm256_setzero_ps();
            transpose8(r);
            for (int kk = 0; kk < 8; kk++) _mm256_storeu_ps(out + (k + kk) * width, r[kk]); /* in order of k */
        }
    }
#endif
    for (; k < kc; k++)
        for (int i = 0; i < width; i++) out[k * width + i] = param(base, (size_t)(i * stride + k), bf16);
}

/* A's rows [0, m) and columns [0, kc) (element (i, k) at a[i rsa + k csa], fp32, or bf16 widened
 * exactly when bf16) into panels of MR rows, each [kc][MR], the rows past m zero. */
static void pack_a_f32(const void *a, long rsa, long csa, int m, int kc, void *panels, int bf16) {
    float *ap = panels;
    for (int i0 = 0; i0 < m; i0 += GEMM_MR, ap += (size_t)kc * GEMM_MR) {
        const int mr = m - i0 < GEMM_MR ? m - i0 : GEMM_MR;
        const size_t a0 = (size_t)i0 * rsa;
        if (!bf16 && rsa == 1 && mr == GEMM_MR) { /* each k's MR values are adjacent */
            const float *ai = (const float *)a + a0;
            for (int k = 0; k < kc; k++) memcpy(ap + k * GEMM_MR, ai + k * csa, sizeof(float) * GEMM_MR);
            continue;
        }
        if (csa == 1 && mr == GEMM_MR) { /* each row's k values are adjacent */
            pack_rows(a, a0, rsa, GEMM_MR, kc, ap, bf16);
            continue;
        }
        for (int k = 0; k < kc; k++)
            for (int i = 0; i < GEMM_MR; i++)
                ap[k * GEMM_MR + i] = i < mr ? param(a, a0 + (size_t)(i * rsa + k * csa), bf16) : 0.0f;
    }
}

static void gemm_pack_a(const void *a, long rsa, long csa, int m, int kc, void *panels) {
    pack_a_f32(a, rsa, csa, m, kc, panels, 0);
}

/* A bf16 model's activations as A: widened as they are packed, so they need no fp32 copy. */
static void gemm_pack_a_from_bf16(const void *a, long rsa, long csa, int m, int kc, void *panels) {
    pack_a_f32(a, rsa, csa, m, kc, panels, 1);
}

/* B's rows [0, kc) and the columns of panels [p0, p1) (element (k, j) at b[k rsb + j csb], fp32,
 * or bf16 widened exactly when bf16) into panels of NR columns, each [kc][NR], the columns past n
 * zero; panel p at bp + p kc NR. */
static void pack_b_f32(const void *b, long rsb, long csb, int n, int kc, int p0, int p1, void *panels, int bf16) {
    float *bp = panels;
    for (int p = p0; p < p1; p++) {
        const int j0 = p * GEMM_NR, nr = n - j0 < GEMM_NR ? n - j0 : GEMM_NR;
        float *out = bp + (size_t)p * kc * GEMM_NR;
        if (!bf16 && csb == 1 && nr == GEMM_NR) {
            const float *bj = (const float *)b + j0;
            for (int k = 0; k < kc; k++) memcpy(out + k * GEMM_NR, bj + k * rsb, sizeof(float) * GEMM_NR);
            continue;
        }
        if (csb == 1 && nr == GEMM_NR) { /* bf16, each k's columns adjacent: widened a vector at a time */
            const uint16_t *bj = (const uint16_t *)b + j0;
            for (int k = 0; k < kc; k++)
                for (int j = 0; j < GEMM_NR; j += VW) vf_store(out + k * GEMM_NR + j, vf_load_bf16(bj + k * rsb + j));
            continue;
        }
        if (rsb == 1 && nr == GEMM_NR) { /* each column's k values are adjacent: a weight stored (N, K) */
            pack_rows(b, (size_t)j0 * csb, csb, GEMM_NR, kc, out, bf16);
            continue;
        }
        for (int k = 0; k < kc; k++)
            for (int j = 0; j < GEMM_NR; j++)
                out[k * GEMM_NR + j] = j < nr ? param(b, (size_t)(k * rsb + (j0 + j) * csb), bf16) : 0.0f;
    }
}

static void gemm_pack_b(const void *b, long rsb, long csb, int n, int kc, int p0, int p1, void *panels) {
    pack_b_f32(b, rsb, csb, n, kc, p0, p1, panels, 0);
}

/* A bf16 layer's weight as B: widened as it is packed, so it needs no fp32 copy. */
static void gemm_pack_b_from_bf16(const void *b, long rsb, long csb, int n, int kc, int p0, int p1, void *panels) {
    pack_b_f32(b, rsb, csb, n, kc, p0, p1, panels, 1);
}

/* pack_b_f32 for gl_sgemm_nt's x^T, except a last panel that split_panel takes: its first VW
 * columns [kc][VW], then each other column's kc values in a row (from B's columns, x's rows). */
static void packed_split(const void *b, long rsb, long csb, int n, int kc, int p0, int p1, void *panels, int bf16) {
    const int last = (n - 1) / GEMM_NR, j0 = last * GEMM_NR;
    const int split = last >= p0 && last < p1 && split_panel(n - j0);
    pack_b_f32(b, rsb, csb, n, kc, p0, split ? last : p1, panels, bf16);
    if (!split) return;
    float *out = (float *)panels + (size_t)last * kc * GEMM_NR;
    for (int k = 0; k < kc; k++)
        for (int j = 0; j < VW; j++) out[k * VW + j] = param(b, (size_t)(k * rsb + (j0 + j) * csb), bf16);
    for (int j = VW; j < n - j0; j++)
        for (int k = 0; k < kc; k++)
            out[(size_t)kc * j + k] = param(b, (size_t)(k * rsb + (j0 + j) * csb), bf16); /* kc VW + (j - VW) kc */
}

static void gemm_pack_b_split(const void *b, long rsb, long csb, int n, int kc, int p0, int p1, void *panels) {
    packed_split(b, rsb, csb, n, kc, p0, p1, panels, 0);
}

static void gemm_pack_b_split_from_bf16(const void *b, long rsb, long csb, int n, int kc, int p0, int p1,
                                        void *panels) {
    packed_split(b, rsb, csb, n, kc, p0, p1, panels, 1);
}

static const gemm_kind_t GEMM_F32 = {GEMM_MR, GEMM_NR, 1, 4, 4, 0, gemm_pack_a, gemm_pack_b, gemm_tile};
static const gemm_kind_t GEMM_F32_BF16_B = {GEMM_MR, GEMM_NR, 1, 2, 4, 0, gemm_pack_a, gemm_pack_b_from_bf16, gemm_tile};
static const gemm_kind_t GEMM_F32_BF16_AB = {GEMM_MR, GEMM_NR, 1, 2, 2, 0, gemm_pack_a_from_bf16, gemm_pack_b_from_bf16,
                                             gemm_tile};
/* gl_sgemm_nt's weights as A: fp32 read in place (pack_a NULL), or bf16 widened into rows, with B
 * (x^T) fp32 or bf16 */
static const gemm_kind_t GEMM_F32_A_IN_PLACE = {GEMM_MR, GEMM_NR, 1, 4, 4, 0, NULL, gemm_pack_b_split,
                                                gemm_tile_in_place};
static const gemm_kind_t GEMM_BF16_A_ROWS = {GEMM_MR, GEMM_NR, 1, 4, 2, 1, gemm_widen_a_rows, gemm_pack_b_split,
                                             gemm_tile_rows};
static const gemm_kind_t GEMM_BF16_AB_ROWS = {GEMM_MR, GEMM_NR, 1, 2, 2, 1, gemm_widen_a_rows,
                                              gemm_pack_b_split_from_bf16, gemm_tile_rows};

/* A bf16 A against a prepacked fp32 B (gemm_prepacked's; the kind's pack_b is never called). */
static const gemm_kind_t GEMM_F32_BF16_A = {GEMM_MR, GEMM_NR, 1, 4, 2, 0, gemm_pack_a_from_bf16, gemm_pack_b, gemm_tile};

/* One operand B (K, N), K <= GEMM_KC, fp32 or bf16 (widened exactly), packed once for many
 * products (gemm_prepacked): its elements, and the packing (panels of NR columns, [K][NR] each). */
static size_t gemm_packed_elems(int N, int K) { return (size_t)(N + GEMM_NR - 1) / GEMM_NR * K * GEMM_NR; }
static void gemm_pack_whole(const void *b, long rsb, long csb, int N, int K, float *bp, int bf16) {
    pack_b_f32(b, rsb, csb, N, K, 0, (N + GEMM_NR - 1) / GEMM_NR, bp, bf16);
}

/* On this thread: C (M, N) = A (M, K) B, A fp32 or (a_bf16) bf16, B packed by gemm_pack_whole for
 * N or more columns (its first panels serve a narrower product). Returns 0, or -1 out of memory. */
static inline __attribute__((always_inline)) int prepacked(const gemm_kind_t *kind, int M, int N, int K,
                                                           const void *a, long rsa, long csa, const float *bp,
                                                           float *c, long ldc) {
    uint32_t *ap = alloc_elems((GEMM_MC / GEMM_MR + 1) * a_panel_elems(kind, K));
    if (!ap) return -1;
    const gemm_t g = {kind, M, N, K, 0, M, 0, a, NULL, rsa, csa, ldc, c, NULL};
    gemm_rows_whole(&g, (const uint32_t *)bp, 0, ap);
    free(ap);
    return 0;
}
static int gemm_prepacked(int M, int N, int K, const void *a, long rsa, long csa, int a_bf16, const float *bp,
                          float *c, long ldc) { /* each kind a constant, so that its loops are specialized */
    return a_bf16 ? prepacked(&GEMM_F32_BF16_A, M, N, K, a, rsa, csa, bp, c, ldc)
                  : prepacked(&GEMM_F32, M, N, K, a, rsa, csa, bp, c, ldc);
}

/* fp32: C (M, N) = A (M, K) B (K, N) + bias, or C += A B + bias when accumulate (see gemm). */
int gl_sgemm(int M, int N, int K, const float *a, long rsa, long csa, const float *b, long rsb, long csb, float *c,
             long ldc, const float *bias, int accumulate, int nthreads) {
    return gemm(&GEMM_F32, M, N, K, a, rsa, csa, b, rsb, csb, c, ldc, bias, accumulate, NULL, nthreads);
}

/* Columns of the fp32 tile (linear.float_kernel_rows). */
int gl_gemm_columns(void) { return GEMM_NR; }

/* As gl_sgemm with B stored as bf16 (its strides in bf16 elements), widened exactly: the same
 * fp32 product as of B converted to fp32 first (a bf16 model's long prompts, gemm.mm). */
int gl_sgemm_bf16_b(int M, int N, int K, const float *a, long rsa, long csa, const uint16_t *b, long rsb, long csb,
                    float *c, long ldc, const float *bias, int accumulate, int nthreads) {
    return gemm(&GEMM_F32_BF16_B, M, N, K, a, rsa, csa, b, rsb, csb, c, ldc, bias, accumulate, NULL, nthreads);
}

/* As gl_sgemm_bf16_b with A stored as bf16 too, widened as it is packed: a bf16 model's long
 * prompts multiply their activations with no fp32 copy of them. */
int gl_sgemm_bf16_ab(int M, int N, int K, const uint16_t *a, long rsa, long csa, const uint16_t *b, long rsb, long csb,
                     float *c, long ldc, const float *bias, int accumulate, int nthreads) {
    return gemm(&GEMM_F32_BF16_AB, M, N, K, a, rsa, csa, b, rsb, csb, c, ldc, bias, accumulate, NULL, nthreads);
}
