/* The int4 linear layer, gl_linear_i4 (see quantized.c, whose activation quantizing and tiles of x
 * it shares): decoding's kernel (i4_rows: a lane sums 8 inputs of one row of x), a prompt's (the
 * rows of x in the lanes: i4_lanes), and gl_dequantize_i4 for products in PyTorch.
 */
#include "common.h"

/* ---------------------------------------------------------------- int4 weights, groups of g inputs */

/* The int4 kernel reads the packed weights a vector (VB bytes, 2 VB inputs: a "chunk") at a time;
 * int32 lane l of a dot product sums inputs 8l..8l+7 of the chunk, i.e. block (of 32) l / 4. */
#define CHUNK (2 * VB)

/* Quantize x (M, K) fp32 per row, as gl_linear_i8 (xq = round(x / s), s = max|x| / 127), written
 * in the order the int4 kernel reads: in each chunk, its VB even inputs, then its VB odd ones (the
 * packed weights hold columns 2i and 2i+1 in one byte). Writes xq (M, K) int8, s (M) and gsum
 * (M, K/g): the sum of the dequantized x over each group of g inputs. */
static void quantize_rows_i4(const float *x, int8_t *xq, float *s, float *gsum, int M, int K, int g, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= QUANTIZE_PARALLEL_ROWS)
    for (int m = 0; m < M; m++) {
        const float *r = x + (size_t)m * K;
        int8_t *q = xq + (size_t)m * K;
        float *gs = gsum + (size_t)m * (K / g);
        const float amax = absmax(r, K), scale = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
        for (int j = 0; j < K / g; j++) gs[j] = 0.0f;
        for (int c = 0; c < K / CHUNK; c++) {
            int8_t t[CHUNK]; /* the chunk's values in input order */
            quantize_bytes(r + CHUNK * c, t, CHUNK, inv, 0.0f);
            for (int b = 0; b < CHUNK / 32; b++) { /* groups are whole blocks of 32 */
                int bsum = 0;
                for (int i = 0; i < 32; i++) bsum += t[32 * b + i];
                gs[(CHUNK * c + 32 * b) / g] += (float)bsum; /* exact: |sum| < 2^24 */
            }
            vi_deinterleave_bytes(t, q + CHUNK * c); /* even inputs, then odd */
        }
        for (int j = 0; j < K / g; j++) gs[j] *= scale;
        s[m] = scale;
    }
}

/* An int4 product's operands from row 0 of its block: x quantized (xq (M, K), row scales xs (M),
 * group sums xgsum (M, G)) and W (w (N, K/2), bf16 scales and zeros (N, G)); g = 32 << gshift. */
typedef struct {
    const int8_t *xq;
    const float *xs, *xgsum;
    const uint8_t *w;
    const uint16_t *scales, *zeros;
    int K, G, gshift;
} i4_args;

/* R rows of an int4 W times M rows of x (R, M compile-time constants, as gshift and nta: prefetch
 * W non-temporally, common.h's prefetch_stream_i4); out[r][m]. The
 * weight w = q * scale + (zero - 8 scale), so y = xs * (sum over blocks of scale * (sum q xq)) +
 * sum over groups of (zero - 8 scale) * gsum. */
AI void i4_rows(const i4_args a, const int R, const int M, const int gshift, const int nta,
                float out[2][I4_MROWS]) {
    const int K = a.K, G = a.G, C = K / CHUNK;
    vf acc[2][I4_MROWS];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = vf_zero();
    for (int c = 0; c < C; c++) {
        vi lo[2], hi[2];
        vf scale[2];
        for (int r = 0; r < R; r++) {
            const uint8_t *p = a.w + (size_t)r * (K / 2) + VB * c;
            prefetch_stream_i4((const char *)p + PF_I4, nta);
            vi packed = vi_load(p);
            lo[r] = vi_low_nibbles(packed);  /* columns CHUNK c + 2i */
            hi[r] = vi_high_nibbles(packed); /* columns CHUNK c + 2i + 1 */
            scale[r] = vf_block_scales(a.scales + (size_t)r * G, c * (VW / 4), gshift);
        }
        for (int m = 0; m < M; m++) {
            const int8_t *xr = a.xq + (size_t)m * K + CHUNK * c;
            vi x0 = vi_load(xr), x1 = vi_load(xr + VB);
            for (int r = 0; r < R; r++)
                acc[r][m] = vf_fma(vf_from_vi(vi_dot_u4(lo[r], x0, hi[r], x1)), scale[r], acc[r][m]);
        }
    }
    for (int r = 0; r < R; r++) {
        for (int m = 0; m < M; m++) acc[r][m] = vf_mul(acc[r][m], vf_set1(a.xs[m]));
        for (int j = 0; j < G; j += VW) { /* the (zero - 8 * scale) * sum(x) term, per group */
            const int n = G - j;
            const vf offset = vf_fnma(vf_set1(8.0f), vf_load_bf16_n(a.scales + (size_t)r * G + j, n),
                                      vf_load_bf16_n(a.zeros + (size_t)r * G + j, n));
            for (int m = 0; m < M; m++) acc[r][m] = vf_fma(offset, vf_load_n(a.xgsum + (size_t)m * G + j, n), acc[r][m]);
        }
        for (int m = 0; m < M; m++) out[r][m] = vf_sum(acc[r][m]);
    }
}

/* R (1 or 2, a constant once inlined) rows of W times M <= I4_MROWS rows of x, specialized per M. */
AI void i4_block_r(const i4_args a, const int R, int M, float out[2][I4_MROWS]) {
#define I4(MM) (a.gshift ? i4_rows(a, R, MM, a.gshift, 0, out) : i4_rows(a, R, MM, 0, 0, out))
    switch (M) {
    case 1: I4(1); break;
#if I4_MROWS >= 2
    case 2: I4(2); break;
#endif
#if I4_MROWS >= 4
    case 3: I4(3); break;
    case 4: I4(4); break;
#endif
#if I4_MROWS >= 8
    case 5: I4(5); break;
    case 6: I4(6); break;
    case 7: I4(7); break;
    case 8: I4(8); break;
#endif
    }
#undef I4
}

/* Rows [n0, n1) of W times M rows of x, two at a time ((n1 - n0) even), into y (M, N) + b:
 * decoding's product, one call per thread (thread_rows in common.h). */
AI void i4_span(i4_args a, const int M, const int gshift, const int nta, int n0, int n1, const float *b, float *y,
                int N) {
    const size_t row = (size_t)a.K / 2, G = (size_t)a.G;
    for (int n = n0; n < n1; n += 2) {
        i4_args r = a;
        r.w += n * row, r.scales += n * G, r.zeros += n * G;
        float out[2][I4_MROWS];
        i4_rows(r, 2, M, gshift, nta, out);
        for (int i = 0; i < 2; i++)
            for (int m = 0; m < M; m++) y[(size_t)m * N + n + i] = out[i][m] + (b ? b[n + i] : 0.0f);
    }
}

/* i4_span specialized per M <= 2 (batch-1 and batch-2 decoding; more rows of x take i4_block:
 * each instantiation of i4_rows costs compile time) and per group size 32, 64 and larger
 * (gshift 0, 1, 2+: the block scales' load and shuffle are then fixed; AMD EPYC Zen 5, avx512,
 * GPT-2's int4 layers decoding at g64: 2.46 ms with gshift known only at run time, 1.5-1.9 ms),
 * and per prefetch hint (prefetch_nta in common.h). */
static void i4_span_m(const i4_args a, int M, int n0, int n1, const float *b, float *y, int N) {
#define SPAN(MM, GS, NTA) i4_span(a, MM, GS, NTA, n0, n1, b, y, N)
#define SPAN_G(MM, NTA) (a.gshift == 0 ? SPAN(MM, 0, NTA) : a.gshift == 1 ? SPAN(MM, 1, NTA) : SPAN(MM, a.gshift, NTA))
    const int nta = prefetch_nta();
    if (M == 1) nta ? SPAN_G(1, 1) : SPAN_G(1, 0);
    else nta ? SPAN_G(2, 1) : SPAN_G(2, 0);
#undef SPAN_G
#undef SPAN
}

static void i4_block(const i4_args a, int R, int M, float out[2][I4_MROWS]) {
    if (R == 2) i4_block_r(a, 2, M, out);
    else i4_block_r(a, 1, M, out);
}

/* ---------------------------------------------------------------- int4 prompts: rows of x in the lanes */

/* A prompt (at least I4_LANES_ROWS rows of x) puts VW rows of x side by side, one per lane, so that
 * a lane sums a whole group's integer products before its one conversion and scaling. In i4_rows a
 * lane holds 8 inputs of one row, so every vector of products is converted and scaled: int4
 * prompts ran at about half int8's speed. Unit u of a row is its inputs 8u..8u+7: 4 packed weight
 * bytes, the low nibbles its even inputs, the high ones its odd inputs. */
#define I4_LANES_ROWS 16
#define I4_LANES_R 4 /* rows of W per block */
#if GL_VARIANT == GL_AVX512 || defined(__AVX512VL__)
#define I4_LANES_V 2 /* vectors of VW rows of x per block: 32 registers hold 2 x 4 x 3 sums */
#else
#define I4_LANES_V 1
#endif

/* xq (M, K), as quantize_rows_i4 writes it (per chunk its even inputs, then its odd ones), and
 * xgsum (M, G) into xt and gt, VW rows at a time for nv VW rows (rows past M zero): for each VW
 * rows, unit u's two vectors at xt + 2 u VB (lane m of the first: the 4 even inputs of row m's unit
 * u; of the second: its 4 odd ones), and group j's sums at gt + j VW (lane m: row m's). */
static void transpose_x_i4(const int8_t *xq, const float *xgsum, int8_t *xt, float *gt, int M, int nv, int K, int G,
                           int nthreads) {
    const int units = K / 8, per_chunk = VB / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nv > 1)
    for (int v = 0; v < nv; v++)
        for (int l = 0; l < VW; l++) {
            const int m = v * VW + l;
            int8_t *t = xt + (size_t)v * VW * K + 4 * l;
            for (int u = 0; u < units; u++) {
                const int8_t *even = xq + (size_t)m * K + (size_t)(u / per_chunk) * CHUNK + 4 * (u % per_chunk);
                if (m < M) memcpy(t + (size_t)u * 2 * VB, even, 4), memcpy(t + (size_t)u * 2 * VB + VB, even + VB, 4);
                else memset(t + (size_t)u * 2 * VB, 0, 4), memset(t + (size_t)u * 2 * VB + VB, 0, 4);
            }
            for (int j = 0; j < G; j++) gt[((size_t)v * G + j) * VW + l] = m < M ? xgsum[(size_t)m * G + j] : 0.0f;
        }
}

/* W's bf16 scales (N, G) as fp32 ws, and the offsets zero - 8 scale as wo; rows N..N+I4_LANES_R
 * zero (a last partial block reads them). */
static void weight_scales_i4(const uint16_t *scales, const uint16_t *zeros, float *ws, float *wo, int N, int G,
                             int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n = 0; n < N + I4_LANES_R; n++)
        for (int j = 0; j < G; j++) {
            const size_t i = (size_t)n * G + j;
            ws[i] = n < N ? bf16_to_f32(scales[i]) : 0.0f;
            wo[i] = n < N ? bf16_to_f32(zeros[i]) - 8.0f * ws[i] : 0.0f;
        }
}

/* Rows [0, R) of W's packed nibbles (N, K/2) into bytes wu (R, K): per row its K/2 low nibbles
 * (unit u's even inputs at 4u), then its K/2 high ones. */
static void unpack_rows_i4(const uint8_t *w, int R, int K, uint8_t *wu) {
    for (int r = 0; r < R; r++)
        for (int k = 0; k < K / 2; k += VB) {
            const vi p = vi_load(w + (size_t)r * (K / 2) + k);
            vi_store(wu + (size_t)r * K + k, vi_low_nibbles(p));
            vi_store(wu + (size_t)r * K + K / 2 + k, vi_high_nibbles(p));
        }
}

/* out[v][r] (lane m) = y[m, n + r] - bias for I4_LANES_R unpacked rows of W (wu; ws, wo their
 * scales and offsets, (R, G)) and I4_LANES_V vectors of VW rows of x (xt, gt, xs as
 * transpose_x_i4 lays them out), a group of gunits (a constant once inlined) units at a time: its
 * integer sums exact, then converted and scaled once; y = xs (sum over groups of scale (sum q xq))
 * + sum over groups of offset gsum. */
AI void i4_lanes(const uint8_t *wu, const float *ws, const float *wo, const int8_t *xt, const float *gt, const vf *xs,
                 int K, int G, const int gunits, vf out[I4_LANES_V][I4_LANES_R]) {
    enum { R = I4_LANES_R, V = I4_LANES_V, SPLIT = V == 1 }; /* SPLIT: two sums per row where registers allow */
    const size_t xstep = (size_t)VW * K, gstep = (size_t)G * VW; /* from one vector of rows of x to the next */
    vf acc[V][R];
    for (int v = 0; v < V; v++)
        for (int r = 0; r < R; r++) acc[v][r] = vf_zero();
    for (int j = 0; j < G; j++) {
        vi a[V][R], b[V][R]; /* b: the second sum when SPLIT (each a chain of products of its own) */
        for (int v = 0; v < V; v++)
            for (int r = 0; r < R; r++) a[v][r] = b[v][r] = vi_zero();
#pragma GCC unroll 32
        for (int u = j * gunits; u < (j + 1) * gunits; u++) {
            vi x0[V], x1[V];
            for (int v = 0; v < V; v++) {
                x0[v] = vi_load(xt + v * xstep + (size_t)u * 2 * VB);
                x1[v] = vi_load(xt + v * xstep + (size_t)u * 2 * VB + VB);
            }
            for (int r = 0; r < R; r++) {
                const vi lo = vi_bcast4(wu + (size_t)r * K + 4 * u), hi = vi_bcast4(wu + (size_t)r * K + K / 2 + 4 * u);
                for (int v = 0; v < V; v++) vi_dot_u4_acc(&a[v][r], SPLIT ? &b[v][r] : &a[v][r], lo, x0[v], hi, x1[v]);
            }
        }
        for (int r = 0; r < R; r++) {
            const vf scale = vf_set1(ws[(size_t)r * G + j]);
            for (int v = 0; v < V; v++)
                acc[v][r] = vf_fma(vf_from_vi(SPLIT ? vi_add(a[v][r], b[v][r]) : a[v][r]), scale, acc[v][r]);
        }
    }
    vf offset[V][R]; /* the sums side by side: one chain of multiply-adds each would wait on its latency */
    for (int v = 0; v < V; v++)
        for (int r = 0; r < R; r++) offset[v][r] = vf_zero();
    for (int j = 0; j < G; j++)
        for (int v = 0; v < V; v++) {
            const vf gsum = vf_load(gt + v * gstep + (size_t)j * VW);
            for (int r = 0; r < R; r++) offset[v][r] = vf_fma(vf_set1(wo[(size_t)r * G + j]), gsum, offset[v][r]);
        }
    for (int v = 0; v < V; v++)
        for (int r = 0; r < R; r++) out[v][r] = vf_fma(acc[v][r], xs[v], offset[v][r]);
}

/* i4_lanes specialized per group size (units of 8 inputs: 4 << gshift). */
static void i4_lanes_g(const uint8_t *wu, const float *ws, const float *wo, const int8_t *xt, const float *gt,
                       const vf *xs, int K, int G, int gshift, vf out[I4_LANES_V][I4_LANES_R]) {
    switch (gshift) {
    case 0: i4_lanes(wu, ws, wo, xt, gt, xs, K, G, 4, out); break;
    case 1: i4_lanes(wu, ws, wo, xt, gt, xs, K, G, 8, out); break;
    case 2: i4_lanes(wu, ws, wo, xt, gt, xs, K, G, 16, out); break;
    default: i4_lanes(wu, ws, wo, xt, gt, xs, K, G, 4 << gshift, out); break;
    }
}

/* Vectors of VW rows of x a prompt of M rows takes: whole blocks of I4_LANES_V. */
static int lanes_vectors(int M) { return (M + VW * I4_LANES_V - 1) / (VW * I4_LANES_V) * I4_LANES_V; }

/* Bytes of work memory linear_i4_lanes takes. */
static size_t lanes_bytes(int M, int N, int K, int G, int nthreads) {
    const size_t rows = (size_t)lanes_vectors(M) * VW;
    return rows * K + (rows * G + 2 * (size_t)(N + I4_LANES_R) * G + rows) * sizeof(float) +
           (size_t)nthreads * I4_LANES_R * K;
}

/* A prompt's y (M, N) = x W^T + b from x quantized (xq, xs, xgsum): W's rows a block of I4_LANES_R
 * at a time over the threads, against a tile of x that stays in L2 (as gl_linear_i8's tiles), each
 * block's nibbles unpacked once per tile; work: lanes_bytes of memory (64-byte aligned). */
static void linear_i4_lanes(const int8_t *xq, const float *xs, const float *xgsum, const uint8_t *w,
                            const uint16_t *scales, const uint16_t *zeros, const float *b, float *y, int M, int N, int K,
                            int G, int gshift, int nthreads, int8_t *work) {
    enum { R = I4_LANES_R, V = I4_LANES_V };
    const int nv = lanes_vectors(M), nblocks = (N + R - 1) / R;
    const size_t nt = (size_t)nv * VW * K, ng = (size_t)nv * VW * G, nw = (size_t)(N + R) * G;
    int8_t *xt = work;
    float *gt = (float *)(xt + nt), *ws = gt + ng, *wo = ws + nw, *xsv = wo + nw;
    uint8_t *wus = (uint8_t *)(xsv + (size_t)nv * VW);
    transpose_x_i4(xq, xgsum, xt, gt, M, nv, K, G, nthreads);
    weight_scales_i4(scales, zeros, ws, wo, N, G, nthreads);
    for (int m = 0; m < nv * VW; m++) xsv[m] = m < M ? xs[m] : 0.0f;
    const int fit = X_TILE_BYTES / (VW * K) / V * V, tile = fit > V ? fit : V; /* vectors of rows of x */
#pragma omp parallel num_threads(nthreads)
    {
        uint8_t *wu = wus + (size_t)omp_get_thread_num() * R * K;
        for (int v0 = 0; v0 < nv; v0 += tile) {
            const int v1 = nv - v0 < tile ? nv : v0 + tile;
#pragma omp for schedule(static)
            for (int blk = 0; blk < nblocks; blk++) {
                const int n = blk * R, rows = N - n < R ? N - n : R;
                unpack_rows_i4(w + (size_t)n * (K / 2), rows, K, wu);
                /* The next block's nibbles, while this one computes (perf: the first touch of a
                 * block's weights stalled; that and y's stores below took 40% of a prompt's int4 time,
                 * the products 60%; GPT-2 int4 prefill of 512 tokens on an AMD EPYC Zen 5, avx512,
                 * three interleaved pairs: 224 -> 200, 196 -> 165, 201 -> 195 ms). */
                if (rows == R && n + 2 * R <= N)
                    for (size_t off = 0; off < (size_t)R * (K / 2); off += 64)
                        prefetch((const char *)(w + (size_t)(n + R) * (K / 2) + off));
                float bias[R];
                for (int r = 0; r < R; r++) bias[r] = b && r < rows ? b[n + r] : 0.0f;
                for (int v = v0; v < v1; v += V) {
                    vf out[V][R], xsv_v[V];
                    for (int i = 0; i < V; i++) xsv_v[i] = vf_load(xsv + (size_t)(v + i) * VW);
                    i4_lanes_g(wu, ws + (size_t)n * G, wo + (size_t)n * G, xt + (size_t)v * VW * K,
                               gt + (size_t)v * G * VW, xsv_v, K, G, gshift, out);
                    for (int i = 0; i < V; i++) {
                        float lanes[R][VW]; /* lanes[r][l] = y[row l of this vector, n + r] - bias */
                        for (int r = 0; r < R; r++) vf_store(lanes[r], out[i][r]);
                        const int m0 = (v + i) * VW, nl = M - m0 < VW ? M - m0 : VW;
                        for (int l = 0; l < nl; l++) {
                            float *yl = y + (size_t)(m0 + l) * N + n;
                            if (rows == R)
                                for (int r = 0; r < R; r++) yl[r] = lanes[r][l] + bias[r];
                            else
                                for (int r = 0; r < rows; r++) yl[r] = lanes[r][l] + bias[r];
                        }
                    }
                }
            }
        }
    }
}

/* y (M, N) = x (M, K) W^T + b for an int4 W (see i4_rows); x is quantized per row first. K must
 * be a multiple of 128 (every variant's CHUNK divides it), g a multiple of 32. Returns -1 when
 * out of memory. */
int gl_linear_i4(const float *x, const uint8_t *w, const uint16_t *scales, const uint16_t *zeros, const float *b,
                 float *y, int M, int N, int K, int g, int nthreads) {
    const int G = K / g, lanes = M >= I4_LANES_ROWS;
    const size_t nq = ((size_t)M * K + 63) & ~(size_t)63, nx = nq + (((size_t)M + (size_t)M * G) * 4 + 63) / 64 * 64;
    int8_t *xq = gl_scratch(nx + (lanes ? lanes_bytes(M, N, K, G, nthreads) : 0));
    if (!xq) return -1;
    float *xs = (float *)(xq + nq), *xgsum = xs + M;
    quantize_rows_i4(x, xq, xs, xgsum, M, K, g, nthreads);
    int gshift = 0;
    while ((32 << gshift) < g) gshift++;
    if (lanes) {
        linear_i4_lanes(xq, xs, xgsum, w, scales, zeros, b, y, M, N, K, G, gshift, nthreads, xq + nx);
        return 0;
    }
    const int nblocks = (N + 1) / 2, tile = x_tile_rows(K, I4_MROWS);
    const i4_args a = {xq, xs, xgsum, w, scales, zeros, K, G, gshift};
    if (M <= 2) { /* decoding: a span of W's rows per thread */
#pragma omp parallel num_threads(nthreads)
        {
            int n0, n1;
            thread_rows(N, 2, &n0, &n1);
            const int whole = n1 - (n1 - n0) % 2;
            i4_span_m(a, M, n0, whole, b, y, N);
            if (whole < n1) { /* N's odd last row */
                i4_args r = a;
                r.w += (size_t)whole * (K / 2), r.scales += (size_t)whole * G, r.zeros += (size_t)whole * G;
                float out[2][I4_MROWS];
                i4_block(r, 1, M, out);
                for (int m = 0; m < M; m++) y[(size_t)m * N + whole] = out[0][m] + (b ? b[whole] : 0.0f);
            }
        }
        return 0;
    }
#pragma omp parallel num_threads(nthreads)
    for (int t0 = 0; t0 < M; t0 += tile) { /* as gl_linear_i8's tiles */
        const int t1 = tile_end(t0, tile, M);
#pragma omp for schedule(static)
        for (int blk = 0; blk < nblocks; blk++) {
            const int n = 2 * blk, R = n + 2 <= N ? 2 : 1;
            for (int m0 = t0; m0 < t1; m0 += I4_MROWS) {
                const int mm = t1 - m0 < I4_MROWS ? t1 - m0 : I4_MROWS;
                const i4_args r = {xq + (size_t)m0 * K, xs + m0, xgsum + (size_t)m0 * G, w + (size_t)n * (K / 2),
                                   scales + (size_t)n * G, zeros + (size_t)n * G, K, G, gshift};
                float out[2][I4_MROWS];
                i4_block(r, R, mm, out);
                for (int rr = 0; rr < R; rr++)
                    for (int m = 0; m < mm; m++) y[(size_t)(m0 + m) * N + n + rr] = out[rr][m] + (b ? b[n + rr] : 0.0f);
            }
        }
    }
    return 0;
}

/* The weight (N, K) an int4 layer stands for, w = (q - 8) * scale + zero, into out: fp32 for
 * prefill's GEMM, or rounded to bf16 (to nearest even, as torch rounds) when bf16, for a bf16 GEMM
 * (linear.int4_bf16_linear; no fp32 copy to round afterwards). */
void gl_dequantize_i4(const uint8_t *w, const uint16_t *scales, const uint16_t *zeros, void *out, int N, int K, int g,
                      int bf16, int nthreads) {
    const int G = K / g;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *wr = w + (size_t)n * (K / 2);
        float *o = (float *)out + (size_t)n * K;
        uint16_t *o16 = (uint16_t *)out + (size_t)n * K;
        for (int j = 0; j < G; j++) {
            const float s = bf16_to_f32(scales[(size_t)n * G + j]), z = bf16_to_f32(zeros[(size_t)n * G + j]) - 8.0f * s;
            for (int k0 = j * g; k0 < (j + 1) * g; k0 += 256) { /* at most 256 columns at a time */
                const int len = (j + 1) * g - k0 < 256 ? (j + 1) * g - k0 : 256;
                uint8_t q[256]; /* the nibbles in column order, then a loop the compiler vectorizes */
                for (int i = 0; i < len / 2; i++) {
                    q[2 * i] = wr[k0 / 2 + i] & 15;
                    q[2 * i + 1] = wr[k0 / 2 + i] >> 4;
                }
                if (bf16)
                    for (int k = 0; k < len; k++) o16[k0 + k] = f32_to_bf16((float)q[k] * s + z);
                else
                    for (int k = 0; k < len; k++) o[k0 + k] = (float)q[k] * s + z;
            }
        }
    }
}
