/* One decoding step of a whole model: gl_decode_step runs a few new tokens (one per row when
 * decoding) through every block, the final norm and the head in one call, instead of ~400 PyTorch
 * operations and Python module calls per token (1.7 ms of an int4 GPT-2's 4.3 ms step before). It
 * computes what the model's modules compute, op by op, with the linear and attention kernels of
 * linear.c, quantized.c and attention.c; for a bf16 model each intermediate result is rounded to
 * bf16 where PyTorch's bf16 ops round it. The model's description (gl_model_t) is in common.h. */
#include "common.h"

/* Round each value of x to the nearest bf16 (ties to even), kept as fp32. */
static void round_bf16(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

/* tanh(u) as (1 - e) / (1 + e), e = exp(-2 |u|), with u's sign: no overflow for any u. */
static inline vf tanh_of(vf u) {
    const vf one = vf_set1(1.0f), e = vf_exp(vf_mul(vf_set1(-2.0f), vf_abs(u)));
    return vf_copysign(vf_div(vf_sub(one, e), vf_add(one, e)), u);
}

/* y = GPT-2's GELU of x, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), n values (y may be x). */
static void gelu_tanh(const float *x, float *y, int n) {
    const vf c = vf_set1(0.7978845608028654f), a = vf_set1(0.044715f), one = vf_set1(1.0f), half = vf_set1(0.5f);
    for (int i = 0; i < n; i += VW) {
        vf v = vf_load_n(x + i, n - i);
        vf t = tanh_of(vf_mul(c, vf_fma(vf_mul(a, v), vf_mul(v, v), v)));
        vf_store_n(y + i, vf_mul(vf_mul(half, v), vf_add(one, t)), n - i);
    }
}

/* dx = dy gelu_tanh'(x), as PyTorch's gelu_backward: with u = c (x + a x^3) and t = tanh(u),
 * 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2). */
static void gelu_tanh_backward(const float *x, const float *dy, float *dx, int n) {
    const vf c = vf_set1(0.7978845608028654f), a = vf_set1(0.044715f), one = vf_set1(1.0f), half = vf_set1(0.5f);
    const vf a3 = vf_set1(3.0f * 0.044715f);
    for (int i = 0; i < n; i += VW) {
        vf v = vf_load_n(x + i, n - i), v2 = vf_mul(v, v);
        vf t = tanh_of(vf_mul(c, vf_fma(vf_mul(a, v), v2, v)));
        vf left = vf_mul(half, vf_add(one, t));
        vf right = vf_mul(vf_mul(vf_mul(half, v), vf_fnma(t, t, one)), vf_mul(c, vf_fma(a3, v2, one)));
        vf_store_n(dx + i, vf_mul(vf_load_n(dy + i, n - i), vf_add(left, right)), n - i);
    }
}

#define GELU_CHUNK 4096 /* values per thread's turn: 16 KB, a multiple of every variant's vector */

/* y = gelu_tanh(x) over n values, fp32, or bf16 (computed in fp32, rounded once, as PyTorch's
 * bf16 GELU) when bf16; split over nthreads. A prompt's MLP activations in the PyTorch forward
 * (gptlab.ops.gelu): 3.5x faster than PyTorch's tanh GELU at AVX2. */
int gl_gelu_tanh(const void *x, void *y, long n, int bf16, int nthreads) {
    const long chunks = (n + GELU_CHUNK - 1) / GELU_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (chunks > 1)
    for (long c = 0; c < chunks; c++) {
        const long i = c * GELU_CHUNK;
        const int len = (int)(n - i < GELU_CHUNK ? n - i : GELU_CHUNK);
        if (!bf16) {
            gelu_tanh((const float *)x + i, (float *)y + i, len);
            continue;
        }
        float t[GELU_CHUNK];
        const uint16_t *xi = (const uint16_t *)x + i;
        uint16_t *yi = (uint16_t *)y + i;
        for (int j = 0; j < len; j++) t[j] = bf16_to_f32(xi[j]);
        gelu_tanh(t, t, len);
        for (int j = 0; j < len; j++) yi[j] = f32_to_bf16(t[j]);
    }
    return 0;
}

/* dx = dy gelu_tanh'(x) over n fp32 values, split over nthreads: the backward of the training
 * MLP's GELU (gptlab.ops.gelu under autograd; PyTorch's takes ~0.6 ms of a ~250 ms demo step
 * per layer at AVX2). */
int gl_gelu_tanh_backward(const float *x, const float *dy, float *dx, long n, int nthreads) {
    const long chunks = (n + GELU_CHUNK - 1) / GELU_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (chunks > 1)
    for (long c = 0; c < chunks; c++) {
        const long i = c * GELU_CHUNK;
        gelu_tanh_backward(x + i, dy + i, dx + i, (int)(n - i < GELU_CHUNK ? n - i : GELU_CHUNK));
    }
    return 0;
}

/* out[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + e^-x); silu rounded to bf16 first when bf16. */
static void swiglu(const float *gate, const float *up, float *out, int n, int bf16) {
    const vf one = vf_set1(1.0f);
    for (int i = 0; i < n; i += VW) {
        vf g = vf_load_n(gate + i, n - i);
        vf_store_n(out + i, vf_div(g, vf_add(one, vf_exp(vf_sub(vf_zero(), g)))), n - i);
    }
    if (bf16) round_bf16(out, (size_t)n);
    for (int i = 0; i < n; i++) out[i] *= up[i];
}

/* Rows at which a step's norms and GELU split over the threads: an int4 model's batches of many
 * rows (gptlab.fused_step.INT_STEP_ROWS). In one thread they kept the other waiting: GPT-2 int4,
 * the C step against the modules (AMD EPYC Zen 4, avx2, 2 threads) at 16 / 32 rows 0.99 / 0.97x,
 * split 1.13 / 1.02x. Each row or value is computed alike wherever it runs. */
#define PARALLEL_ROWS 9

/* LayerNorm or RMSNorm of each of M rows of x (M, C) into y, in fp32 (as PyTorch's CPU norms
 * compute also for bf16 inputs). */
static void norm_rows(const gl_model_t *m, const float *x, const void *w, const void *b, float *y, int M,
                      int nthreads) {
    const int C = m->n_embd;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= PARALLEL_ROWS)
    for (int r = 0; r < M; r++) {
        const float *xr = x + (size_t)r * C;
        float *yr = y + (size_t)r * C;
        float mean = 0.0f, var = 0.0f;
        if (m->norm == GL_LAYERNORM) {
            for (int i = 0; i < C; i++) mean += xr[i];
            mean /= (float)C;
        }
        for (int i = 0; i < C; i++) var += (xr[i] - mean) * (xr[i] - mean);
        const float inv = 1.0f / sqrtf(var / (float)C + m->eps);
        for (int i = 0; i < C; i++)
            yr[i] = (xr[i] - mean) * inv * param(w, i, m->bf16) + (b ? param(b, i, m->bf16) : 0.0f);
    }
    if (m->bf16) round_bf16(y, (size_t)M * C);
}

/* y (M, N) = x (M, K) L^T + bias for any kind of layer; x fp32; y rounded to bf16 values when
 * round. Returns 0, -1 out of memory, -2 a kind it does not know. */
static int run_linear(const gl_linear_t *L, const float *x, float *y, int M, int round, int nthreads) {
    const int N = L->N, K = L->K;
    int s = 0;
    switch (L->kind) {
    case GL_F32: gl_linear_rows(L->w, 0, x, L->bias, 0, y, round ? 2 : 0, M, N, K, nthreads); return 0;
    case GL_BF16: {
        float *xf = gl_scratch((size_t)M * K * sizeof(float));
        if (!xf) return -1;
        gl_order_pairs(x, xf, M, K);
        gl_linear_rows(L->w, 1, xf, L->bias, L->bias_bf16, y, round ? 2 : 0, M, N, K, nthreads);
        return 0;
    }
    case GL_I8: s = gl_linear_i8(x, L->w, L->a, L->b, L->bias, y, M, N, K, nthreads); break;
    case GL_I4: s = gl_linear_i4(x, L->w, L->a, L->b, L->bias, y, M, N, K, L->g, nthreads); break;
    default: return -2;
    }
    if (!s && round) round_bf16(y, (size_t)M * N);
    return s;
}

/* x (M, n) += y (M, n), rounded to bf16 values when bf16. */
static void add_residual(float *x, const float *y, size_t n, int bf16) {
    for (size_t i = 0; i < n; i++) x[i] += y[i];
    if (bf16) round_bf16(x, n);
}

static void to_bf16(const float *x, uint16_t *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = f32_to_bf16(x[i]);
}

static void from_bf16(const uint16_t *x, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = bf16_to_f32(x[i]);
}

/* Rotary positions: rotate the query and key of each of M rows of qkv (M, 3C) in place, per head
 * the pairs (i, i + hs/2) by the row's angles, cs (M, hs): cos (hs/2) then sin (hs/2) (the GPT-NeoX
 * layout of gptlab.model.apply_rope); each product and sum rounded to bf16, as bf16 ops round,
 * when bf16. */
static void rope_rows(float *qkv, const float *cs, int M, int C, int nh, int bf16) {
    const int hs = C / nh, half = hs / 2;
#define RB(v) (bf16 ? bf16_to_f32(f32_to_bf16(v)) : (v))
    for (int r = 0; r < M; r++) {
        const float *cosv = cs + (size_t)r * hs, *sinv = cosv + half;
        for (int part = 0; part < 2; part++) /* the query, then the key */
            for (int h = 0; h < nh; h++) {
                float *x = qkv + (size_t)r * 3 * C + (size_t)part * C + (size_t)h * hs;
                for (int i = 0; i < half; i++) {
                    const float x1 = x[i], x2 = x[i + half];
                    const float a = RB(x1 * cosv[i]), b = RB(x2 * sinv[i]), c = RB(x1 * sinv[i]), d = RB(x2 * cosv[i]);
                    x[i] = RB(a - b);
                    x[i + half] = RB(c + d);
                }
            }
    }
#undef RB
}

/* Row t of an embedding table described as a layer, (V, C), in fp32 as gptlab's modules compute
 * it: fp32 and bf16 rows as stored; int8 q * scale; int4 (q - 8) * scale + zero in two roundings
 * (gptlab.quantize.dequantize_int4's order: no fused multiply-add, hence the attribute). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static void embedding_row(const gl_linear_t *e, int64_t t, float *out) {
    const int K = e->K;
    const size_t row = (size_t)t * K;
    switch (e->kind) {
    case GL_F32: memcpy(out, (const float *)e->w + row, sizeof(float) * K); break;
    case GL_BF16: from_bf16((const uint16_t *)e->w + row, out, (size_t)K); break;
    case GL_I8: {
        const int8_t *q = (const int8_t *)e->w + row;
        const float s = bf16_to_f32(((const uint16_t *)e->a)[t]);
        for (int k = 0; k < K; k++) out[k] = (float)q[k] * s;
        break;
    }
    case GL_I4: {
        const uint8_t *q = (const uint8_t *)e->w + row / 2;
        const int G = K / e->g;
        for (int k = 0; k < K; k++) {
            const size_t j = (size_t)t * G + (size_t)(k / e->g);
            const int v = k & 1 ? q[k / 2] >> 4 : q[k / 2] & 15;
            const float scaled = (float)(v - 8) * bf16_to_f32(((const uint16_t *)e->a)[j]);
            out[k] = scaled + bf16_to_f32(((const uint16_t *)e->b)[j]);
        }
        break;
    }
    }
}

/* Row r's position id of M = B*T new tokens written from slot pos: positions[r], or pos + r % T
 * without them (no row padded). */
static int64_t position_of(const int64_t *positions, int r, int T, int pos) {
    return positions ? positions[r] : pos + r % T;
}

/* Whether every token id is in the vocabulary and, with learned positions, every position id in
 * the table: the decoding steps gptlab.fused_step.decode hands over without the model's checks
 * rely on it. */
static int in_range(const gl_model_t *m, const int64_t *tokens, const int64_t *positions, int M, int T, int pos) {
    for (int r = 0; r < M; r++) {
        if (tokens[r] < 0 || tokens[r] >= m->wte.N) return 0;
        const int64_t p = position_of(positions, r, T, pos);
        if (m->wpe && (p < 0 || p >= m->n_pos)) return 0;
    }
    return 1;
}

/* x (M, C) = the embeddings of tokens (M), plus their rows of the learned position table when the
 * model has one; each sum rounded to bf16, as PyTorch's bf16 add, for a bf16 model. */
static void embed(const gl_model_t *m, const int64_t *tokens, const int64_t *positions, float *x, int M, int T,
                  int pos) {
    const int C = m->n_embd;
    for (int r = 0; r < M; r++) {
        float *xr = x + (size_t)r * C;
        embedding_row(&m->wte, tokens[r], xr);
        if (m->bf16) round_bf16(xr, (size_t)C); /* a quantized table's rows, cast to the activations' dtype */
        if (!m->wpe) continue;
        const size_t at = (size_t)position_of(positions, r, T, pos) * C;
        for (int i = 0; i < C; i++) xr[i] += param(m->wpe, at + i, m->bf16);
        if (m->bf16) round_bf16(xr, (size_t)C);
    }
}

/* Self-attention of T new tokens per row, qkv (B*T, 3C) -> att (B*T, C): token t of each row
 * writes its key and value to slot pos + t and sees the slots up to its own (causal), where mask
 * (B, pos + T) allows. A bf16 model's qkv and att go through bf16 buffers, its caches bf16; an fp32
 * model's caches are fp32, or bf16 when kv_bf16 (gl_attend_rows rounds the new keys into them). */
static int attention(const gl_model_t *m, void *k_cache, void *v_cache, int kv_bf16, const float *qkv, float *att,
                     uint16_t *spare, int B, int T, int pos, int max_len, const uint8_t *mask, int nthreads) {
    const int C = m->n_embd, nh = m->n_head, hs = C / nh, R = m->bf16;
    const size_t n_qkv = (size_t)B * T * 3 * C;
    uint16_t *q16 = spare, *a16 = spare + n_qkv;
    if (R) to_bf16(qkv, q16, n_qkv);
    for (int t = 0; t < T; t++) { /* in order: token t sees the keys tokens 0..t just wrote */
        const void *q = R ? (const void *)(q16 + (size_t)t * 3 * C) : (const void *)(qkv + (size_t)t * 3 * C);
        void *o = R ? (void *)(a16 + (size_t)t * C) : (void *)(att + (size_t)t * C);
        int s = gl_attend_rows(q, T * 3 * C, k_cache, v_cache, pos + t, mask, pos + T, o, T * C, B, nh, hs,
                               max_len, R, kv_bf16, nthreads);
        if (s) return s;
    }
    if (R) from_bf16(a16, att, (size_t)B * T * C);
    return 0;
}

/* One block on x (M = B*T rows, C), the residual stream, in place. */
static int block_step(const gl_model_t *m, const gl_block_t *blk, void *const kv[2], int kv_bf16, float *x, float *work,
                      int B, int T, int pos, int max_len, const uint8_t *mask, const float *rope, int nthreads) {
    const int C = m->n_embd, H = m->hidden, R = m->bf16, M = B * T;
    const int Hfc = m->mlp == GL_SWIGLU ? 2 * H : H;
    float *h = work, *qkv = h + (size_t)M * C, *att = qkv + (size_t)M * 3 * C, *fc = att + (size_t)M * C;
    float *act = fc + (size_t)M * Hfc, *spare = act + (size_t)M * H; /* spare: 2C per row */
    int s;
    norm_rows(m, x, blk->ln1_w, blk->ln1_b, h, M, nthreads);
    if ((s = run_linear(&blk->attn, h, qkv, M, R, nthreads))) return s;
    if (rope) rope_rows(qkv, rope, M, C, m->n_head, R);
    if ((s = attention(m, kv[0], kv[1], kv_bf16, qkv, att, (uint16_t *)spare, B, T, pos, max_len, mask, nthreads)))
        return s;
    if ((s = run_linear(&blk->attn_proj, att, h, M, R, nthreads))) return s;
    add_residual(x, h, (size_t)M * C, R);
    norm_rows(m, x, blk->ln2_w, blk->ln2_b, h, M, nthreads);
    if ((s = run_linear(&blk->fc, h, fc, M, R, nthreads))) return s;
    float *mlp_in = fc;
    if (m->mlp == GL_SWIGLU) {
        for (int r = 0; r < M; r++) swiglu(fc + (size_t)r * 2 * H, fc + (size_t)r * 2 * H + H, act + (size_t)r * H, H, R);
        mlp_in = act;
    } else if (m->mlp == GL_GELU_ERF) {
        for (size_t i = 0; i < (size_t)M * H; i++) fc[i] = 0.5f * fc[i] * (1.0f + erff(fc[i] * 0.70710678118654752f));
    } else if (M >= PARALLEL_ROWS) {
        gl_gelu_tanh(fc, fc, (long)M * H, 0, nthreads);
    } else {
        gelu_tanh(fc, fc, M * H);
    }
    if (R) round_bf16(mlp_in, (size_t)M * H);
    if ((s = run_linear(&blk->mlp_proj, mlp_in, h, M, R, nthreads))) return s;
    add_residual(x, h, (size_t)M * C, R);
    return 0;
}

/* A forward of T new tokens per row over the KV cache: the tokens (B*T ids, and their positions
 * for learned position embeddings, or NULL for pos + t), embedded as the model's embedding modules
 * do, run through every block (token t's keys and values written to slot pos + t of each layer's
 * cache: kv holds layer l's key and value caches (B, nh, max_len, hs) at 2l and 2l + 1, in the
 * activations' dtype, or bf16 for an fp32 model when kv_bf16), the final norm and the head into
 * logits: (B*T, V) when all_logits, else (B, V) for each row's last token; fp32 (bf16 values for a
 * bf16 model). mask (B, pos + T) bytes, False at slots a row may not see, or NULL. rope (B*T, hs):
 * each new token's rotary cos then sin (see rope_rows), or NULL for a model without rotary
 * positions. Returns 0, -1 out of memory, -2 a layer kind it does not know, -3 a token id outside
 * the vocabulary or a position outside the table (nothing written). */
int gl_decode_step(const gl_model_t *m, void *const *kv, int kv_bf16, const int64_t *tokens, const int64_t *positions,
                   int B, int T, int pos, int max_len, const uint8_t *mask, const float *rope, float *logits,
                   int all_logits, int nthreads) {
    const int C = m->n_embd, Hfc = (m->mlp == GL_SWIGLU ? 2 : 1) * m->hidden, M = B * T;
    if (!in_range(m, tokens, positions, M, T, pos)) return -3;
    float *x = malloc(sizeof(float) * (size_t)M * (8 * C + Hfc + m->hidden) + 64); /* x (M, C), then the work */
    if (!x) return -1;
    float *work = x + (size_t)M * C;
    embed(m, tokens, positions, x, M, T, pos);
    int s = 0;
    for (int l = 0; l < m->n_layer && !s; l++)
        s = block_step(m, &m->blocks[l], kv + 2 * l, kv_bf16, x, work, B, T, pos, max_len, mask, rope, nthreads);
    if (!s) {
        if (!all_logits) /* the head only for each row's last token */
            for (int b = 0; b < B; b++) memmove(x + (size_t)b * C, x + ((size_t)b * T + T - 1) * C, sizeof(float) * C);
        const int rows = all_logits ? M : B;
        norm_rows(m, x, m->lnf_w, m->lnf_b, work, rows, nthreads);
        s = run_linear(&m->head, work, logits, rows, m->bf16, nthreads);
    }
    free(x);
    return s;
}

