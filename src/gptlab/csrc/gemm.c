/* Matrix products for the training head (gptlab.chunked_loss) and long prompts' layers
 * (kernels.sgemm_linear): C = A B (+ bias), or C += A B (+ bias), in fp32 (gl_sgemm; B stored as
 * bf16 and widened as it is packed: gl_sgemm_bf16_b) or with A and B rounded to bf16 and fp32 sums
 * (gl_gemm_bf16, on CPUs with AVX512-BF16). Attention's products for prompts use it too
 * (attention.c). Prompts of up to a few hundred tokens multiply their layers as y^T = W x^T, the
 * weights read in place as A (gl_sgemm_nt): packing them, a transpose of every weight on every
 * call, took a fifth of a 64-token GPT-2 forward.
 *
 * A small head's three products, W x^T, e^T W and e x (GPT-2's 50,257-row vocabulary by 128-1024
 * rows of x and a 128-wide model), are most of a training step, and MKL runs them at 75-110
 * GFLOP/s on an AMD EPYC (Zen 3) where its square products reach 140. This is the textbook
 * blocked GEMM (Goto's, as BLIS and OpenBLAS): B is packed kc x nc into panels NR wide that stay
 * in L3 and are read by every thread, each thread packs mc x kc of A into panels MR tall that
 * stay in L2, and a micro-kernel keeps an MR x NR tile of C in registers while it walks kc
 * products, one broadcast of A against NR values of B each. Packing takes any strides, so one
 * routine serves the three products whatever their operands' layouts.
 *
 * The two kinds of product share that loop nest and differ in their packing and micro-kernel
 * (gemm_kind_t): bf16 packs pairs of adjacent k values, rounded to bf16, into 32 bits, and its
 * micro-kernel multiplies them with vdpbf16ps, two products per lane per instruction. On an AMD
 * EPYC Zen 4 one core runs 228 GFLOP/s of vdpbf16ps (zmm) against 112 of fp32 FMAs.
 */
#include <omp.h>

#include "common.h"

#define GEMM_MR 6        /* rows of the tile: 6 x 2 accumulators + 2 of B + 1 of A fit AVX2's 16 */
#define GEMM_NR (2 * VW) /* columns of the tile */
#define GEMM_KC 256      /* depth of a packed block: an A panel (6 KB) and a B panel (16 KB AVX2) in L1 */
#define GEMM_MC 144      /* rows of A packed at a time: 144 KB in L2 */
#define GEMM_NC 4096     /* columns of B packed at a time: kc x nc is 4 MB, in L3 */
#define GEMM_B_WHOLE (2 << 20) /* B packed whole, once, when it fits this many bytes */

/* One kind of product: its tile (mr x nr), the k values per packed 32-bit element (1: an fp32;
 * 2: a pair of bf16), the bytes of one element of B and of A as stored (4: fp32; 2: bf16), and how
 * it packs A's and B's panels and multiplies one tile (see the fp32 kind's functions below for
 * their contracts). */
typedef struct {
    int mr, nr, ksub, b_size, a_size;
    int a_rows; /* A's panels hold each row's k values together, GEMM_KC of them, instead of each k's mr rows */
    /* NULL: A is not packed; the tile reads it where it is, its rows lda apart (fp32, k adjacent) */
    void (*pack_a)(const void *a, long rsa, long csa, int m, int kc, void *ap);
    void (*pack_b)(const void *b, long rsb, long csb, int n, int kc, int p0, int p1, void *bp);
    void (*tile)(int kc, const void *a, long lda, const void *b, float *c, long ldc, int first, const float *bias,
                 int m, int n);
} gemm_kind_t;

/* 32-bit elements of a packed panel `width` wide over kc values of k. */
static size_t panel_elems(const gemm_kind_t *kind, int kc, int width) {
    return (size_t)(kc + kind->ksub - 1) / kind->ksub * width;
}

/* 32-bit elements of one packed panel of A over kc values of k. */
static size_t a_panel_elems(const gemm_kind_t *kind, int kc) {
    return panel_elems(kind, kind->a_rows ? GEMM_KC : kc, kind->mr);
}

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

/* The operands, the kind of product, one thread's rows of C [r0, r1), and its maxima of C's
 * columns over those rows (N values, or NULL for none). */
typedef struct {
    const gemm_kind_t *kind;
    int M, N, K, r0, r1, accumulate;
    const void *a; /* elements of the kind's a_size */
    const float *bias;
    long rsa, csa, ldc; /* B is packed before its rows are multiplied: its strides are the packing's */
    float *c, *colmax;
} gemm_t;

/* A's element (i, k). */
static const void *a_at(const gemm_t *g, int i, int k) {
    return (const char *)g->a + (i * g->rsa + k * g->csa) * g->kind->a_size;
}

/* colmax[j] = max(colmax[j], c[i ldc + j]) over the m x n tile at c. */
static void tile_colmax(const float *c, long ldc, int m, int n, int nr, float *colmax) {
    if (n == nr && nr % VW == 0) {
        for (int j = 0; j < nr; j += VW) {
            vf top = vf_load(colmax + j);
            for (int i = 0; i < m; i++) top = vf_max(top, vf_load(c + i * ldc + j));
            vf_store(colmax + j, top);
        }
        return;
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) colmax[j] = fmaxf(colmax[j], c[i * ldc + j]);
}

/* A block of A still in memory, fetched into the caches a few lines at a time while the block
 * before it is multiplied: packing it then finds it there (AMD EPYC, the head's e^T W and e x:
 * packing from memory took 22 and 15 ms of 101 and 90). Runs of contiguous bytes: a row of A's
 * block when its columns are adjacent, else a column when its rows are; other layouts fetch nothing. */
typedef struct {
    const char *base;
    long stride;     /* bytes from one run to the next */
    int runs, lines; /* runs, cache lines per run */
    int run, line;   /* the next line to fetch */
} gemm_ahead_t;

static gemm_ahead_t gemm_ahead(const gemm_t *g, int ic, int mc, int pc, int kc) {
    const char *start = a_at(g, ic, pc);
    const int size = g->kind->a_size, per_line = 64 / size;
    if (ic >= g->r1 || pc >= g->K) return (gemm_ahead_t){0}; /* no next block */
    if (g->csa == 1) return (gemm_ahead_t){start, g->rsa * size, mc, kc / per_line + 2, 0, 0};
    if (g->rsa == 1) return (gemm_ahead_t){start, g->csa * size, kc, mc / per_line + 2, 0, 0};
    return (gemm_ahead_t){0};
}

static void gemm_fetch(gemm_ahead_t *f, int n) {
    for (; n > 0 && f->run < f->runs; n--) {
        prefetch_l2(f->base + f->run * f->stride + f->line * 64);
        if (++f->line == f->lines) f->line = 0, f->run++;
    }
}

/* C's rows [ic, ic + mc) and columns [jc, jc + nc) (+)= A's block at (ic, pc) times the packed
 * block bp of B (kc x nc), A's block packed into ap; `next` is fetched meanwhile. */
static void gemm_block(const gemm_t *g, int ic, int mc, int jc, int nc, int pc, int kc, const uint32_t *bp,
                       uint32_t *ap, gemm_ahead_t next) {
    const gemm_kind_t *kind = g->kind;
    const int MR = kind->mr, NR = kind->nr;
    if (kind->pack_a) kind->pack_a(a_at(g, ic, pc), g->rsa, g->csa, mc, kc, ap);
    const int first = pc == 0 && !g->accumulate, panels = (nc + NR - 1) / NR;
    const int tiles = panels * ((mc + MR - 1) / MR), per_tile = next.runs * next.lines / tiles + 1;
    const size_t a_panel = a_panel_elems(kind, kc), b_panel = panel_elems(kind, kc, NR);
    for (int p = 0; p < panels; p++) {
        const int nr = nc - p * NR < NR ? nc - p * NR : NR;
        for (int ir = 0; ir < mc; ir += MR) {
            gemm_fetch(&next, per_tile);
            const float *bias = g->bias && pc == 0 ? g->bias + jc + p * NR : NULL; /* added once, with the first kc */
            float *c = g->c + (ic + ir) * g->ldc + jc + p * NR;
            const int m = mc - ir < MR ? mc - ir : MR;
            const void *a = kind->pack_a ? (const void *)(ap + ir / MR * a_panel) : a_at(g, ic + ir, pc);
            kind->tile(kc, a, g->rsa, bp + p * b_panel, c, g->ldc, first, bias, m, nr);
            if (g->colmax && pc + kc >= g->K) tile_colmax(c, g->ldc, m, nr, NR, g->colmax + jc + p * NR); /* final */
        }
    }
}

static int mc_at(const gemm_t *g, int ic) { return g->r1 - ic < GEMM_MC ? g->r1 - ic : GEMM_MC; }
static int kc_at(const gemm_t *g, int pc) { return g->K - pc < GEMM_KC ? g->K - pc : GEMM_KC; }

/* B packed whole (bp: its kc blocks one after another, `block` elements apart): each block of this
 * thread's rows walks all of K while its part of C stays in L2 (the head's e x, whose B is x). */
static void gemm_rows_whole(const gemm_t *g, const uint32_t *bp, size_t block, uint32_t *ap) {
    for (int ic = g->r0; ic < g->r1; ic += GEMM_MC)
        for (int pc = 0; pc < g->K; pc += GEMM_KC) {
            const int last = pc + GEMM_KC >= g->K, ni = last ? ic + GEMM_MC : ic, np = last ? 0 : pc + GEMM_KC;
            gemm_block(g, ic, mc_at(g, ic), 0, g->N, pc, kc_at(g, pc), bp + block * (pc / GEMM_KC), ap,
                       gemm_ahead(g, ni, ni < g->r1 ? mc_at(g, ni) : 0, np, kc_at(g, np)));
        }
}

/* This thread's rows against one packed block of B (kc x nc at (pc, jc)), shared by the threads. */
static void gemm_rows_blocked(const gemm_t *g, int jc, int nc, int pc, const uint32_t *bp, uint32_t *ap) {
    for (int ic = g->r0; ic < g->r1; ic += GEMM_MC) {
        const int more = ic + GEMM_MC < g->r1, ni = more ? ic + GEMM_MC : g->r0, np = more ? pc : pc + GEMM_KC;
        gemm_block(g, ic, mc_at(g, ic), jc, nc, pc, kc_at(g, pc), bp, ap,
                   gemm_ahead(g, ni, mc_at(g, ni), np < g->K ? np : g->K, np < g->K ? kc_at(g, np) : 0));
    }
}

/* B's element `offset` (in elements of the kind's stored size). */
static const void *b_at(const gemm_kind_t *kind, const void *b, long offset) {
    return (const char *)b + offset * kind->b_size;
}

static void *alloc_elems(size_t n) { return aligned_alloc(64, (n * 4 + 63) / 64 * 64); }

/* C (M, N) = A (M, K) B (K, N) + bias, or C += A B + bias when accumulate, as `kind` multiplies
 * (bias: N values added to every row, or NULL for none): element (i, k) of A at a[i rsa + k csa],
 * (k, j) of B at b[k rsb + j csb], (i, j) of C at c[i ldc + j]. colmax, unless NULL, gets the
 * largest value of each of C's N columns, taken from each tile as it is finished (the training
 * head's logits: its softmax then skips a pass over them). Each thread takes a contiguous range
 * of C's rows (or of its columns, below), so the summation order of every element is that of one
 * thread's loop: results do not depend on nthreads. B is packed whole once where it fits
 * GEMM_B_WHOLE, else a kc x nc block at a time. Returns 0, or -1 out of memory. */
static int gemm(const gemm_kind_t *kind, int M, int N, int K, const void *a, long rsa, long csa, const void *b,
                long rsb, long csb, float *c, long ldc, const float *bias, int accumulate, float *colmax,
                int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    if (colmax)
        for (int j = 0; j < N; j++) colmax[j] = -INFINITY;
    if (K <= 0) {
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) c[i * ldc + j] = (accumulate ? c[i * ldc + j] : 0.0f) + (bias ? bias[j] : 0.0f);
        if (colmax)
            for (int i = 0; i < M; i++) tile_colmax(c + i * ldc, ldc, 1, N, 0, colmax);
        return 0;
    }
    const int MR = kind->mr, NR = kind->nr;
    const int kc_max = K < GEMM_KC ? K : GEMM_KC, kblocks = (K + GEMM_KC - 1) / GEMM_KC;
    const int nc_max = N < GEMM_NC ? N : GEMM_NC, panels_max = (nc_max + NR - 1) / NR;
    const size_t block = panels_max * panel_elems(kind, kc_max, NR); /* elements of one packed kc x nc block */
    const int whole = N <= GEMM_NC && block * kblocks * 4 <= GEMM_B_WHOLE;
    uint32_t *bp = whole ? alloc_elems(block * kblocks) : NULL;
    if (whole && !bp) return -1;
    int failed = 0;
    const int tiles = (M + MR - 1) / MR, panels_all = (N + NR - 1) / NR; /* whole MR tiles per thread */
    /* Threads split C by rows, each packing its own copy of every block of B, unless B is wider than
     * A is tall (a prompt's layers: B the weights, N >= 768, M the prompt's tokens): then by
     * columns, each packing only its part of B and its own copy of A, the smaller, instead. The
     * AMD EPYC Zen 5, a 512-token GPT-2 prefill in fp32 (medians of 9 alternating rounds, 3 runs):
     * 281-291 -> 266-271 ms natively (avx512), 469-483 -> 457-472 held to AVX2. */
    const int by_columns = !whole && N > M && panels_all >= nthreads;
#pragma omp parallel num_threads(nthreads)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        int r0 = (int)((long)tiles * id / nt) * MR, r1 = (int)((long)tiles * (id + 1) / nt) * MR, c0 = 0, c1 = N;
        if (by_columns) { /* whole panels of NR columns: every tile as the rows' split makes it, the same bits */
            r0 = 0, r1 = M, c0 = panels_all * id / nt * NR, c1 = panels_all * (id + 1) / nt * NR;
            c1 = c1 < N ? c1 : N;
        }
        float *mine = colmax ? alloc_elems((size_t)panels_all * NR) : NULL; /* this thread's column maxima */
        if (mine)
            for (int j = 0; j < panels_all * NR; j++) mine[j] = -INFINITY;
        const gemm_t g = {kind, M, N, K, r0, r1 < M ? r1 : M, accumulate, a, bias, rsa, csa, ldc, c, mine};
        uint32_t *ap = alloc_elems((GEMM_MC / MR + 1) * a_panel_elems(kind, kc_max));
        if (!ap || (colmax && !mine)) {
#pragma omp atomic write
            failed = 1;
        }
        if (whole) {
            const int panels = (N + NR - 1) / NR;
            for (int pc = 0; pc < K; pc += GEMM_KC) /* the threads pack B's panels together */
                kind->pack_b(b_at(kind, b, pc * rsb), rsb, csb, N, kc_at(&g, pc), panels * id / nt,
                             panels * (id + 1) / nt, bp + block * (pc / GEMM_KC));
#pragma omp barrier
            if (ap) gemm_rows_whole(&g, bp, block, ap);
        } else { /* each thread packs its own copy of each block of B (of its columns, when split so): no barriers */
            uint32_t *own = alloc_elems(block);
            for (int jc = c0; own && ap && jc < c1; jc += GEMM_NC) {
                const int nc = c1 - jc < GEMM_NC ? c1 - jc : GEMM_NC;
                for (int pc = 0; pc < K; pc += GEMM_KC) {
                    kind->pack_b(b_at(kind, b, pc * rsb + jc * csb), rsb, csb, nc, kc_at(&g, pc), 0, (nc + NR - 1) / NR,
                                 own);
                    gemm_rows_blocked(&g, jc, nc, pc, own, ap);
                }
            }
            if (!own) {
#pragma omp atomic write
                failed = 1;
            }
            free(own);
        }
        free(ap);
        if (mine) {
#pragma omp critical
            for (int j = 0; j < N; j++) colmax[j] = fmaxf(colmax[j], mine[j]); /* in any order: max is exact */
        }
        free(mine);
    }
    free(bp);
    return failed ? -1 : 0;
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

/* Columns of the fp32 tile (kernels.float_kernel_rows). */
int gl_gemm_columns(void) { return GEMM_NR; }

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

/* As gl_sgemm with B stored as bf16 (its strides in bf16 elements), widened exactly: the same
 * fp32 product as of B converted to fp32 first (a bf16 model's long prompts, kernels.mm). */
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

/* ---------------------------------------------------------------- bf16 products (AVX512-BF16) */

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
