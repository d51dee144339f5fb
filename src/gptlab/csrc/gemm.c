/* The blocked matrix product that gptlab's own products share: the training head's
 * (gptlab.chunked_loss), long prompts' layers (gemm.sgemm_linear) and a prompt's attention
 * (attention.c). C = A B (+ bias), or C += A B (+ bias).
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
 * The kinds of product share that loop nest and differ in their packing and micro-kernel
 * (gemm_kind_t). kernels.c includes their files after this one:
 *   gemm_f32.c   fp32 (gl_sgemm), operands stored as bf16 widened exactly as they are packed
 *                (gl_sgemm_bf16_b, gl_sgemm_bf16_ab), and one operand packed once for many
 *                products (attention's K^T)
 *   gemm_bf16.c  pairs of bf16 multiplied with vdpbf16ps (gl_gemm_bf16, on CPUs with AVX512-BF16),
 *                and gl_sgemm_colmax, either kind with the maxima of C's columns
 *   gemm_nt.c    a prompt's linear layer as y^T = W x^T, the weights read in place (gl_sgemm_nt)
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
 * it packs A's and B's panels and multiplies one tile (gemm_f32.c's functions for the fp32 kinds
 * state their contracts). */
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
