/* fp32 matrix products for the training head (gptlab.chunked_loss): C = A B, or C += A B.
 *
 * A small head's three products, W x^T, e^T W and e x (GPT-2's 50,257-row vocabulary by 128-1024
 * rows of x and a 128-wide model), are most of a training step, and MKL runs them at 75-110
 * GFLOP/s on an AMD EPYC (Zen 3) where its square products reach 140. This is the textbook
 * blocked GEMM (Goto's, as BLIS and OpenBLAS): B is packed kc x nc into panels NR wide that stay
 * in L3 and are read by every thread, each thread packs mc x kc of A into panels MR tall that
 * stay in L2, and a micro-kernel keeps an MR x NR tile of C in registers while it walks kc
 * products, one broadcast of A against NR values of B each. Packing takes any strides, so one
 * routine serves the three products whatever their operands' layouts.
 */
#include <omp.h>

#include "common.h"

#define GEMM_MR 6        /* rows of the tile: 6 x 2 accumulators + 2 of B + 1 of A fit AVX2's 16 */
#define GEMM_NR (2 * VW) /* columns of the tile */
#define GEMM_KC 256      /* depth of a packed block: an A panel (6 KB) and a B panel (16 KB AVX2) in L1 */
#define GEMM_MC 144      /* rows of A packed at a time: 144 KB in L2 */
#define GEMM_NC 4096     /* columns of B packed at a time: kc x nc is 4 MB, in L3 */
#define GEMM_B_WHOLE (2 << 20) /* B packed whole, once, when it fits this many bytes */

/* The MR x NR tile c (row stride ldc) = (first ? 0 : c) + a b over kc: a packed [kc][MR], b packed
 * [kc][NR]. Only the first m rows and n columns are written (the packed padding is zeros). */
static void gemm_tile(int kc, const float *a, const float *b, float *c, long ldc, int first, int m, int n) {
    vf acc[GEMM_MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < GEMM_MR; i++) acc[i][0] = acc[i][1] = vf_zero();
    for (int k = 0; k < kc; k++, a += GEMM_MR, b += GEMM_NR) {
        const vf b0 = vf_load(b), b1 = vf_load(b + VW);
#pragma GCC unroll 6
        for (int i = 0; i < GEMM_MR; i++) {
            const vf ai = vf_set1(a[i]);
            acc[i][0] = vf_fma(ai, b0, acc[i][0]);
            acc[i][1] = vf_fma(ai, b1, acc[i][1]);
        }
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
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) c[i * ldc + j] = first ? tile[i][j] : c[i * ldc + j] + tile[i][j];
}

/* A's rows [0, m) and columns [0, kc) (element (i, k) at a[i rsa + k csa]) into panels of MR rows,
 * each [kc][MR], the rows past m zero. */
static void gemm_pack_a(const float *a, long rsa, long csa, int m, int kc, float *ap) {
    for (int i0 = 0; i0 < m; i0 += GEMM_MR, ap += (size_t)kc * GEMM_MR) {
        const int mr = m - i0 < GEMM_MR ? m - i0 : GEMM_MR;
        const float *ai = a + i0 * rsa;
        if (rsa == 1 && mr == GEMM_MR) { /* each k's MR values are adjacent */
            for (int k = 0; k < kc; k++) memcpy(ap + k * GEMM_MR, ai + k * csa, sizeof(float) * GEMM_MR);
            continue;
        }
        for (int k = 0; k < kc; k++)
            for (int i = 0; i < GEMM_MR; i++) ap[k * GEMM_MR + i] = i < mr ? ai[i * rsa + k * csa] : 0.0f;
    }
}

/* B's rows [0, kc) and the columns of panels [p0, p1) (element (k, j) at b[k rsb + j csb]) into
 * panels of NR columns, each [kc][NR], the columns past n zero; panel p at bp + p kc NR. */
static void gemm_pack_b(const float *b, long rsb, long csb, int n, int kc, int p0, int p1, float *bp) {
    for (int p = p0; p < p1; p++) {
        const int j0 = p * GEMM_NR, nr = n - j0 < GEMM_NR ? n - j0 : GEMM_NR;
        const float *bj = b + j0 * csb;
        float *out = bp + (size_t)p * kc * GEMM_NR;
        if (csb == 1 && nr == GEMM_NR) {
            for (int k = 0; k < kc; k++) memcpy(out + k * GEMM_NR, bj + k * rsb, sizeof(float) * GEMM_NR);
            continue;
        }
        for (int k = 0; k < kc; k++)
            for (int j = 0; j < GEMM_NR; j++) out[k * GEMM_NR + j] = j < nr ? bj[k * rsb + j * csb] : 0.0f;
    }
}

/* The operands, and one thread's rows of C [r0, r1). */
typedef struct {
    int M, N, K, r0, r1, accumulate;
    const float *a, *b;
    long rsa, csa, rsb, csb, ldc;
    float *c;
} gemm_t;

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
    const float *start = g->a + ic * g->rsa + pc * g->csa;
    if (ic >= g->r1 || pc >= g->K) return (gemm_ahead_t){0}; /* no next block */
    if (g->csa == 1) return (gemm_ahead_t){(const char *)start, g->rsa * 4, mc, kc / 16 + 2, 0, 0};
    if (g->rsa == 1) return (gemm_ahead_t){(const char *)start, g->csa * 4, kc, mc / 16 + 2, 0, 0};
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
static void gemm_block(const gemm_t *g, int ic, int mc, int jc, int nc, int pc, int kc, const float *bp, float *ap,
                       gemm_ahead_t next) {
    gemm_pack_a(g->a + ic * g->rsa + pc * g->csa, g->rsa, g->csa, mc, kc, ap);
    const int first = pc == 0 && !g->accumulate, panels = (nc + GEMM_NR - 1) / GEMM_NR;
    const int tiles = panels * ((mc + GEMM_MR - 1) / GEMM_MR), per_tile = next.runs * next.lines / tiles + 1;
    for (int p = 0; p < panels; p++) {
        const int nr = nc - p * GEMM_NR < GEMM_NR ? nc - p * GEMM_NR : GEMM_NR;
        for (int ir = 0; ir < mc; ir += GEMM_MR) {
            gemm_fetch(&next, per_tile);
            gemm_tile(kc, ap + (size_t)ir * kc, bp + (size_t)p * kc * GEMM_NR, g->c + (ic + ir) * g->ldc + jc + p * GEMM_NR,
                      g->ldc, first, mc - ir < GEMM_MR ? mc - ir : GEMM_MR, nr);
        }
    }
}

static int mc_at(const gemm_t *g, int ic) { return g->r1 - ic < GEMM_MC ? g->r1 - ic : GEMM_MC; }
static int kc_at(const gemm_t *g, int pc) { return g->K - pc < GEMM_KC ? g->K - pc : GEMM_KC; }

/* B packed whole (bp: its kc blocks one after another, `block` floats apart): each block of this
 * thread's rows walks all of K while its part of C stays in L2 (the head's e x, whose B is x). */
static void gemm_rows_whole(const gemm_t *g, const float *bp, size_t block, float *ap) {
    for (int ic = g->r0; ic < g->r1; ic += GEMM_MC)
        for (int pc = 0; pc < g->K; pc += GEMM_KC) {
            const int last = pc + GEMM_KC >= g->K, ni = last ? ic + GEMM_MC : ic, np = last ? 0 : pc + GEMM_KC;
            gemm_block(g, ic, mc_at(g, ic), 0, g->N, pc, kc_at(g, pc), bp + block * (pc / GEMM_KC), ap,
                       gemm_ahead(g, ni, ni < g->r1 ? mc_at(g, ni) : 0, np, kc_at(g, np)));
        }
}

/* This thread's rows against one packed block of B (kc x nc at (pc, jc)), shared by the threads. */
static void gemm_rows_blocked(const gemm_t *g, int jc, int nc, int pc, const float *bp, float *ap) {
    for (int ic = g->r0; ic < g->r1; ic += GEMM_MC) {
        const int more = ic + GEMM_MC < g->r1, ni = more ? ic + GEMM_MC : g->r0, np = more ? pc : pc + GEMM_KC;
        gemm_block(g, ic, mc_at(g, ic), jc, nc, pc, kc_at(g, pc), bp, ap,
                   gemm_ahead(g, ni, mc_at(g, ni), np < g->K ? np : g->K, np < g->K ? kc_at(g, np) : 0));
    }
}

static size_t round64(size_t nbytes) { return (nbytes + 63) / 64 * 64; }

/* C (M, N) = A (M, K) B (K, N), or C += A B when accumulate: element (i, k) of A at a[i rsa + k csa],
 * (k, j) of B at b[k rsb + j csb], (i, j) of C at c[i ldc + j]. Each thread takes a contiguous range
 * of C's rows, so the summation order of every element is that of one thread's loop: results do
 * not depend on nthreads. B is packed whole once where it fits GEMM_B_WHOLE, else a kc x nc block
 * at a time. Returns 0, or -1 out of memory. */
int gl_sgemm(int M, int N, int K, const float *a, long rsa, long csa, const float *b, long rsb, long csb, float *c,
             long ldc, int accumulate, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0) {
        if (!accumulate)
            for (int i = 0; i < M; i++) memset(c + i * ldc, 0, sizeof(float) * N);
        return 0;
    }
    const int kc_max = K < GEMM_KC ? K : GEMM_KC, kblocks = (K + GEMM_KC - 1) / GEMM_KC;
    const int nc_max = N < GEMM_NC ? N : GEMM_NC, panels_max = (nc_max + GEMM_NR - 1) / GEMM_NR;
    const size_t block = (size_t)panels_max * GEMM_NR * kc_max; /* floats of one packed kc x nc block */
    const int whole = N <= GEMM_NC && block * kblocks * sizeof(float) <= GEMM_B_WHOLE;
    float *bp = whole ? aligned_alloc(64, round64(sizeof(float) * block * kblocks)) : NULL;
    if (whole && !bp) return -1;
    int failed = 0;
    const int tiles = (M + GEMM_MR - 1) / GEMM_MR; /* whole MR tiles per thread: none straddles two */
#pragma omp parallel num_threads(nthreads)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int r0 = (int)((long)tiles * id / nt) * GEMM_MR, r1 = (int)((long)tiles * (id + 1) / nt) * GEMM_MR;
        const gemm_t g = {M, N, K, r0, r1 < M ? r1 : M, accumulate, a, b, rsa, csa, rsb, csb, ldc, c};
        float *ap = aligned_alloc(64, round64(sizeof(float) * GEMM_MC * kc_max));
        if (!ap) {
#pragma omp atomic write
            failed = 1;
        }
        if (whole) {
            const int panels = (N + GEMM_NR - 1) / GEMM_NR;
            for (int pc = 0; pc < K; pc += GEMM_KC) /* the threads pack B's panels together */
                gemm_pack_b(b + pc * rsb, rsb, csb, N, kc_at(&g, pc), panels * id / nt, panels * (id + 1) / nt,
                            bp + block * (pc / GEMM_KC));
#pragma omp barrier
            if (ap) gemm_rows_whole(&g, bp, block, ap);
        } else { /* each thread packs its own copy of each block of B: no barriers between blocks */
            float *own = aligned_alloc(64, round64(sizeof(float) * block));
            for (int jc = 0; own && ap && jc < N; jc += GEMM_NC) {
                const int nc = N - jc < GEMM_NC ? N - jc : GEMM_NC;
                for (int pc = 0; pc < K; pc += GEMM_KC) {
                    gemm_pack_b(b + pc * rsb + jc * csb, rsb, csb, nc, kc_at(&g, pc), 0, (nc + GEMM_NR - 1) / GEMM_NR, own);
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
    }
    free(bp);
    return failed ? -1 : 0;
}
