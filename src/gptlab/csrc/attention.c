/* Decoding attention over a layer's KV cache, a prompt's causal attention, and greedy sampling's
 * argmax. */
#include "common.h"

#define MAX_HS 256 /* kernels.MAX_HEAD_SIZE */

/* A row of scores (`keys` of them) into e^((s - max) scale) over its first `seen`, zeros past them;
 * returns the sum of the exponentials (the caller divides by it). */
static float softmax_seen(float *row, int seen, int keys, float scale) {
    int j = 0;
    vf vmax = vf_set1(-INFINITY);
    for (; j + VW <= seen; j += VW) vmax = vf_max(vmax, vf_load(row + j));
    float top = vf_hmax(vmax);
    for (; j < seen; j++) top = row[j] > top ? row[j] : top;
    const vf shift = vf_set1(-top * scale), sc = vf_set1(scale);
    vf sum = vf_zero();
    for (j = 0; j + VW <= seen; j += VW) {
        const vf e = vf_exp(vf_fma(vf_load(row + j), sc, shift));
        vf_store(row + j, e);
        sum = vf_add(sum, e);
    }
    float total = vf_sum(sum);
    for (; j < seen; j++) total += row[j] = expf((row[j] - top) * scale);
    memset(row + seen, 0, sizeof(float) * (size_t)(keys - seen));
    return total;
}

/* One head of one new token, as gl_attend_rows says: q (hs values) against the keys and values
 * kc, vc of slots 0..pos (mask: the row's bytes, or NULL), sc room for pos + 1 scores; writes the
 * hs outputs to out. q and out are fp32, or bf16 when qb; the caches fp32, or bf16 when kb. Masked
 * slots' probabilities are exactly 0. hs, qb and kb are compile-time constants where
 * gl_attend_rows specializes them, so q and the sums stay in registers (with hs known only at run
 * time, the value sums went through memory: a store-forwarding chain per key). The scores run four
 * keys at a time, their sums side by side and reduced together. */
AI void attend_head(const char *qp, const char *kc, const char *vc, int pos, const uint8_t *mask, float *sc,
                    const int hs, const int qb, const int kb, char *out) {
    const int S = pos + 1, nv = (hs + VW - 1) / VW, ks = kb ? 2 : 4;
#define ROW(base, j, v) vf_load_any_n((base) + ((size_t)(j) * hs + VW * (v)) * ks, kb, hs - VW * (v))
    vf q[MAX_HS / VW];
    for (int v = 0; v < nv; v++) q[v] = vf_load_any_n(qp + (size_t)VW * v * (qb ? 2 : 4), qb, hs - VW * v);
    int j = 0;
    for (; j + 4 <= S; j += 4) {
        vf a[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
        for (int v = 0; v < nv; v++)
            for (int i = 0; i < 4; i++) a[i] = vf_fma(q[v], ROW(kc, j + i, v), a[i]);
        vf_sum4(a[0], a[1], a[2], a[3], sc + j);
    }
    for (; j < S; j++) {
        vf a = vf_zero();
        for (int v = 0; v < nv; v++) a = vf_fma(q[v], ROW(kc, j, v), a);
        sc[j] = vf_sum(a);
    }
#define HIDDEN(j) (mask && !mask[j] && (j) != pos) /* a query always sees its own slot */
    for (j = 0; j < S; j++)
        if (HIDDEN(j)) sc[j] = -INFINITY;
    const float inv = 1.0f / softmax_seen(sc, S, S, 1.0f / sqrtf((float)hs));
    vf acc[MAX_HS / VW];
    for (int v = 0; v < nv; v++) acc[v] = vf_zero();
    for (j = 0; j < S; j++) {
        if (HIDDEN(j)) continue;
        const vf p = vf_set1(sc[j]);
        for (int v = 0; v < nv; v++) acc[v] = vf_fma(p, ROW(vc, j, v), acc[v]);
    }
#undef HIDDEN
#undef ROW
    for (int v = 0; v < nv; v++) {
        const int n = hs - VW * v >= VW ? VW : hs - VW * v;
        float o[VW];
        vf_store(o, vf_mul(acc[v], vf_set1(inv)));
        for (int d = 0; d < n; d++) {
            if (qb) ((uint16_t *)out)[VW * v + d] = f32_to_bf16(o[d]);
            else ((float *)out)[VW * v + d] = o[d];
        }
    }
}

/* The new key or value (hs values of qkv's dtype) into its cache slot: copied, or rounded to bf16
 * (to nearest even, as torch's .to) for a bf16 cache of fp32 activations. */
static void store_slot(char *slot, const char *src, int hs, int bf16, int kv_bf16) {
    if (bf16 == kv_bf16) memcpy(slot, src, (size_t)hs * (bf16 ? 2 : 4));
    else
        for (int d = 0; d < hs; d++) ((uint16_t *)slot)[d] = f32_to_bf16(((const float *)src)[d]);
}

/* One new token per row attends over its cache, for one layer: row b's qkv at qkv + b * qkv_stride
 * elements holds the token's query, key and value (heads side by side, as c_attn gives them); its
 * key and value are written to slot `pos` of the caches k_cache and v_cache (B, nh, max_len, hs), then
 *   out[b, h*hs:(h+1)*hs] = softmax(q . k_j / sqrt(hs), j <= pos, where mask[b, j] or j == pos) . v_j
 * (a query always sees its own slot, as the model's mask) with fp32 scores and sums, row b of out at
 * out + b * out_stride. mask: row b at mask + b * mask_stride bytes, or NULL. qkv and out fp32, or
 * bf16 when bf16 != 0; the caches fp32, or bf16 when kv_bf16 != 0 (a bf16 cache of fp32
 * activations: the new key and value rounded into it, the query and the sums fp32). Returns -1
 * when hs > 256, for bf16 activations over an fp32 cache, or out of memory. */
int gl_attend_rows(const void *qkv, int qkv_stride, void *k_cache, void *v_cache, int pos, const uint8_t *mask,
                   int mask_stride, void *out, int out_stride, int B, int nh, int hs, int max_len, int bf16,
                   int kv_bf16, int nthreads) {
    if (hs > MAX_HS || (bf16 && !kv_bf16)) return -1;
    const int C = nh * hs, S = pos + 1, es = bf16 ? 2 : 4, ks = kv_bf16 ? 2 : 4;
    float *scores_all = gl_scratch((size_t)B * nh * S * sizeof(float));
    if (!scores_all) return -1;
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < nh; h++) {
            const char *row = (const char *)qkv + (size_t)b * qkv_stride * es;
            size_t head = ((size_t)b * nh + h) * max_len; /* first slot of this (b, h) in the caches */
            char *kc = (char *)k_cache + head * hs * ks, *vc = (char *)v_cache + head * hs * ks;
            store_slot(kc + (size_t)pos * hs * ks, row + (size_t)(C + h * hs) * es, hs, bf16, kv_bf16);
            store_slot(vc + (size_t)pos * hs * ks, row + (size_t)(2 * C + h * hs) * es, hs, bf16, kv_bf16);
            const char *q = row + (size_t)h * hs * es;
            const uint8_t *m = mask ? mask + (size_t)b * mask_stride : NULL;
            float *sc = scores_all + ((size_t)b * nh + h) * S;
            char *o = (char *)out + ((size_t)b * out_stride + (size_t)h * hs) * es;
#define AH(HS, QB, KB) attend_head(q, kc, vc, pos, m, sc, HS, QB, KB, o)
#define HEAD(HS) (bf16 ? AH(HS, 1, 1) : kv_bf16 ? AH(HS, 0, 1) : AH(HS, 0, 0))
            if (hs == 64) HEAD(64); /* GPT-2's heads, and most models' */
            else if (hs == 128) HEAD(128);
            else HEAD(hs);
#undef HEAD
#undef AH
        }
    }
    return 0;
}

/* gl_attend_rows for B rows of one token each, stored one after another; mask (B, pos + 1) or NULL. */
int gl_attend_one(const void *qkv, void *k_cache, void *v_cache, int pos, const uint8_t *mask, void *out, int B,
                  int nh, int hs, int max_len, int bf16, int kv_bf16, int nthreads) {
    const int C = nh * hs;
    return gl_attend_rows(qkv, 3 * C, k_cache, v_cache, pos, mask, pos + 1, out, C, B, nh, hs, max_len, bf16,
                          kv_bf16, nthreads);
}

/* ---------------------------------------------------------------- a prompt's causal attention */

/* Queries per task, a multiple of gemm.c's 6-row tiles; their scores stay in L2. A 512-token GPT-2
 * layer on the Zen 5: 2.7 ms at AVX2 and 2.0 at AVX-512, against 2.8-2.9 and 2.4-2.6 with 48
 * (then 1.7 at AVX-512 with each head's K^T packed once, not once per task). */
#define AP_ROWS 96

/* The strides of a (B, nh, rows, hs) operand, in elements, its hs values adjacent. */
typedef struct {
    long b, h, row;
} ap_strides_t;

/* Causal attention of T queries per (batch row, head) over S >= T keys:
 *   out[b, t, h, :] = softmax(q_t . k_j / sqrt(hs), j <= S - T + t) . v_j
 * q (B, nh, T, hs), k and v (B, nh, S, hs) at any strides (e.g. views of c_attn's output, or the
 * KV cache), out (B, T, nh, hs) contiguous: the heads side by side, as c_proj takes them. Each
 * head's K^T is packed once (gemm.c's panels); then each task is AP_ROWS queries of one head:
 * their scores against the keys they can see, then those probabilities times the values, both in
 * gemm.c's blocked product on one thread; the rows of scores a query cannot see are zeroed after
 * its softmax. All fp32, or (bf16) q, k, v and out bf16: q, k and v widened exactly as they are
 * packed, the sums fp32, each output rounded once (to nearest even) as it is written, the same
 * bits as the fp32 product of their fp32 copies rounded by torch. Returns 0, or -1 out of memory. */
int gl_attend_prompt(const void *q, const long *qs, const void *k, const long *ks, const void *v, const long *vs,
                     void *out, int B, int nh, int T, int S, int hs, int bf16, int nthreads) {
    const ap_strides_t sq = {qs[0], qs[1], qs[2]}, sk = {ks[0], ks[1], ks[2]}, sv = {vs[0], vs[1], vs[2]};
    const int blocks = (T + AP_ROWS - 1) / AP_ROWS, heads = B * nh, tasks = heads * blocks, es = bf16 ? 2 : 4;
    const float scale = 1.0f / sqrtf((float)hs);
    const size_t packed = gemm_packed_elems(S, hs); /* each head's K^T, packed once for its blocks */
    float *kt = aligned_alloc(64, (sizeof(float) * packed * heads + 63) / 64 * 64);
    if (!kt) return -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int bh = 0; bh < heads; bh++)
            gemm_pack_whole((const char *)k + (bh / nh * sk.b + bh % nh * sk.h) * es, 1, sk.row, S, hs,
                            kt + packed * bh, bf16);
        float *scores = malloc(sizeof(float) * (size_t)AP_ROWS * S);
        float *sums = bf16 ? malloc(sizeof(float) * (size_t)AP_ROWS * hs) : NULL; /* a task's fp32 output */
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tasks; task++) { /* the last (longest) query blocks first */
            const int blk = blocks - 1 - task / heads, bh = task % heads, b = bh / nh, h = bh % nh;
            const int t0 = blk * AP_ROWS, m = T - t0 < AP_ROWS ? T - t0 : AP_ROWS, keys = S - T + t0 + m;
            const char *qb = (const char *)q + (b * sq.b + h * sq.h + t0 * sq.row) * es;
            const char *vb = (const char *)v + (b * sv.b + h * sv.h) * es;
            const size_t at = (((size_t)b * T + t0) * nh + h) * hs; /* out's element (b, t0, h, 0) */
            const long ldo = (long)nh * hs, ld = bf16 ? hs : ldo;
            float *ob = bf16 ? sums : (float *)out + at;
            if (!scores || (bf16 && !sums) ||
                gemm_prepacked(m, keys, hs, qb, sq.row, 1, bf16, kt + packed * bh, scores, keys)) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            float inv[AP_ROWS]; /* query t0 + i sees keys [0, S - T + t0 + i] */
            for (int i = 0; i < m; i++)
                inv[i] = 1.0f / softmax_seen(scores + (size_t)i * keys, S - T + t0 + i + 1, keys, scale);
            if (bf16 ? gemm(&GEMM_F32_BF16_B, m, hs, keys, scores, keys, 1, vb, sv.row, 1, ob, ld, NULL, 0, NULL, 1)
                     : gemm(&GEMM_F32, m, hs, keys, scores, keys, 1, vb, sv.row, 1, ob, ld, NULL, 0, NULL, 1)) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            for (int i = 0; i < m; i++) { /* the probabilities' normalization, on hs values instead of keys */
                float *o = ob + i * ld;
                for (int d = 0; d < hs; d += VW)
                    vf_store_n(o + d, vf_mul(vf_load_n(o + d, hs - d), vf_set1(inv[i])), hs - d);
                if (bf16) {
                    uint16_t *oh = (uint16_t *)out + at + i * ldo;
                    for (int d = 0; d < hs; d++) oh[d] = f32_to_bf16(o[d]);
                }
            }
        }
        free(scores);
        free(sums);
    }
    free(kt);
    return failed ? -1 : 0;
}

/* The index of the largest of r[0..N): the first one on ties, and the first NaN where there is
 * one, as torch.argmax. Vectors find each block's largest value, and the first block holding the
 * row's largest is then searched; a block whose values' differences with themselves sum to NaN
 * (it holds a NaN, or an infinity) is searched for a NaN value by value. One pass over the logits
 * and a short search, where finding the first largest value by value took ~20 us of GPT-2's 50,257. */
enum { ARGMAX_BLOCK = 1024 };
static int64_t argmax_row(const float *r, int N) {
    float top = -INFINITY;
    int from = 0; /* the block holding the first `top` */
    for (int b = 0; b < N; b += ARGMAX_BLOCK) {
        int end = b + ARGMAX_BLOCK < N ? b + ARGMAX_BLOCK : N, n = b;
        vf best = vf_set1(-INFINITY), odd = vf_zero();
        for (; n + VW <= end; n += VW) {
            vf v = vf_load(r + n);
            best = vf_max(best, v);
            odd = vf_add(odd, vf_sub(v, v)); /* 0, or NaN from a NaN or an infinity */
        }
        float most = vf_hmax(best), flag = vf_sum(odd);
        for (; n < end; n++) {
            most = r[n] > most ? r[n] : most;
            flag += r[n] - r[n];
        }
        if (flag != flag)
            for (n = b; n < end; n++)
                if (r[n] != r[n]) return n;
        if (most > top) {
            top = most;
            from = b;
        }
    }
    for (int n = from; n < N; n++)
        if (r[n] == top) return n;
    return 0; /* every value -inf */
}

/* out[m] = the index of the largest of x[m, 0..N) (argmax_row). */
int gl_argmax_f32(const float *x, int64_t *out, int M, int N) {
    for (int m = 0; m < M; m++) out[m] = argmax_row(x + (size_t)m * N, N);
    return 0;
}
