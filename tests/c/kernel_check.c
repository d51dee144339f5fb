/* The C kernels' own check, for variants Python cannot load (aarch64 under qemu-user: `make
 * neon-check`): every kernel of each library given is run on the same seeded inputs as the first
 * library (the portable reference, itself checked against a double-precision product here) and must
 * agree with it within the tolerances the Python tests use. Natively, `make kernel-check` runs it on
 * this machine's x86 variants.
 *
 *   kernel_check REF.so LIB.so [LIB.so ...]     exit status 0 when every check passes
 */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*linear_f32_t)(const float *, const float *, const float *, float *, int, int, int, int);
typedef int (*linear_bf16_t)(const uint16_t *, const uint16_t *, const float *, uint16_t *, int, int, int, int);
typedef int (*linear_i8_t)(const float *, const int8_t *, const uint16_t *, const int32_t *, const float *, float *,
                           int, int, int, int);
typedef int (*linear_i4_t)(const float *, const uint8_t *, const uint16_t *, const uint16_t *, const float *, float *,
                           int, int, int, int, int);
typedef int (*softmax_xent_t)(float *, long, const int64_t *, float *, float *, float *, int, int, int, const float *,
                               int);
typedef int (*attend_one_t)(const void *, void *, void *, int, const uint8_t *, void *, int, int, int, int, int, int,
                            int);
typedef int (*argmax_t)(const float *, int64_t *, int, int);
typedef int (*sgemm_t)(int, int, int, const float *, long, long, const float *, long, long, float *, long,
                       const float *, int, int);
typedef int (*sgemm_colmax_t)(int, int, int, const float *, long, long, const float *, long, long, float *, long,
                              float *, int, int);
typedef int (*sgemm_bf16_ab_t)(int, int, int, const uint16_t *, long, long, const uint16_t *, long, long, float *,
                               long, const float *, int, int);
typedef int (*sgemm_bf16_b_t)(int, int, int, const float *, long, long, const uint16_t *, long, long, float *, long,
                              const float *, int, int);
typedef int (*sgemm_nt_t)(int, int, int, const void *, long, int, const void *, int, void *, long, int,
                          const float *, int);
typedef int (*attend_prompt_t)(const void *, const long *, const void *, const long *, const void *, const long *,
                               void *, int, int, int, int, int, int, int);
typedef int (*gelu_t)(const void *, void *, long, int, int);
typedef int (*gelu_backward_t)(const float *, const float *, float *, long, int);
typedef void (*dequantize_i4_t)(const uint8_t *, const uint16_t *, const uint16_t *, void *, int, int, int, int, int);
typedef void (*dequantize_i8_t)(const int8_t *, const uint16_t *, float *, int, int, int);

typedef struct {
    const char *path, *variant;
    linear_f32_t linear_f32;
    linear_bf16_t linear_bf16;
    linear_i8_t linear_i8;
    linear_i4_t linear_i4;
    softmax_xent_t softmax_xent;
    attend_one_t attend_one;
    argmax_t argmax;
    sgemm_t sgemm, gemm_bf16;
    int (*has_gemm_bf16)(void);
    sgemm_bf16_b_t sgemm_bf16_b;
    sgemm_colmax_t sgemm_colmax;
    sgemm_bf16_ab_t sgemm_bf16_ab;
    sgemm_nt_t sgemm_nt;
    attend_prompt_t attend_prompt;
    gelu_t gelu_tanh;
    gelu_backward_t gelu_tanh_backward;
    int (*gemm_columns)(void);
    dequantize_i4_t dequantize_i4;
    dequantize_i8_t dequantize_i8;
} lib_t;

static int failures = 0;

static void *need(void *h, const char *name) {
    void *f = dlsym(h, name);
    if (!f) {
        fprintf(stderr, "kernel_check: %s\n", dlerror());
        exit(2);
    }
    return f;
}

static lib_t open_lib(const char *path) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "kernel_check: %s\n", dlerror());
        exit(2);
    }
    lib_t l = {path, ((const char *(*)(void))need(h, "gl_variant"))(), need(h, "gl_linear_f32"),
               need(h, "gl_linear_bf16"), need(h, "gl_linear_i8"), need(h, "gl_linear_i4"),
               need(h, "gl_softmax_xent"), need(h, "gl_attend_one"), need(h, "gl_argmax_f32"), need(h, "gl_sgemm"),
               need(h, "gl_gemm_bf16"), need(h, "gl_has_gemm_bf16"), need(h, "gl_sgemm_bf16_b"),
               need(h, "gl_sgemm_colmax"), need(h, "gl_sgemm_bf16_ab"), need(h, "gl_sgemm_nt"),
               need(h, "gl_attend_prompt"),
               need(h, "gl_gelu_tanh"), need(h, "gl_gelu_tanh_backward"), need(h, "gl_gemm_columns"),
               need(h, "gl_dequantize_i4"), need(h, "gl_dequantize_i8")};
    return l;
}

/* ---------------------------------------------------------------- seeded inputs */

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next_bits(void) { /* xorshift64 */
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return rng;
}
static float uniform(void) { return (float)((next_bits() >> 40) & 0xffffff) / 8388608.0f - 1.0f; } /* [-1, 1) */
static float *floats(size_t n, float scale) {
    float *p = malloc(n * sizeof *p);
    for (size_t i = 0; i < n; i++) p[i] = scale * uniform();
    return p;
}
static uint16_t bf16(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t *bf16s(size_t n, float scale) {
    uint16_t *p = malloc(n * sizeof *p);
    for (size_t i = 0; i < n; i++) p[i] = bf16(scale * uniform());
    return p;
}

/* ---------------------------------------------------------------- comparisons */

/* max |got - want| / (atol + rtol |want|) over n values: <= 1 passes. */
static double worst(const float *got, const float *want, size_t n, double atol, double rtol) {
    double w = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - want[i]) / (atol + rtol * fabs(want[i]));
        if (!(e <= w)) w = e; /* NaN counts as a failure */
    }
    return w;
}
static void report(const char *what, const lib_t *l, const char *shape, double w) {
    const int ok = w <= 1.0;
    failures += !ok;
    printf("%-6s %-14s %-28s %s (worst %.3g of the tolerance)\n", ok ? "ok" : "FAIL", l->variant, what, ok ? "" : shape,
           w);
}

/* ---------------------------------------------------------------- the checks */

static void check_linear_f32(const lib_t *ref, const lib_t *l, int M, int N, int K) {
    float *x = floats((size_t)M * K, 1), *w = floats((size_t)N * K, 0.1f), *b = floats(N, 1);
    float *y0 = malloc(sizeof(float) * M * N), *y = malloc(sizeof(float) * M * N), *yd = malloc(sizeof(float) * M * N);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double s = b[n];
            for (int k = 0; k < K; k++) s += (double)x[m * K + k] * w[n * K + k];
            yd[m * N + n] = (float)s;
        }
    ref->linear_f32(x, w, b, y0, M, N, K, 2);
    l->linear_f32(x, w, b, y, M, N, K, 2);
    char shape[64];
    snprintf(shape, sizeof shape, "M=%d N=%d K=%d", M, N, K);
    if (ref == l) report("linear_f32 vs float64", l, shape, worst(y, yd, (size_t)M * N, 1e-5, 1e-5));
    else report("linear_f32", l, shape, worst(y, y0, (size_t)M * N, 1e-5, 1e-5)); /* measured <= 1.2e-6 */
    free(x), free(w), free(b), free(y0), free(y), free(yd);
}

static void check_linear_bf16(const lib_t *ref, const lib_t *l, int M, int N, int K) {
    uint16_t *x = bf16s((size_t)M * K, 1), *w = bf16s((size_t)N * K, 0.1f), *y0 = malloc(2 * M * N), *y = malloc(2 * M * N);
    float *b = floats(N, 1), *f0 = malloc(sizeof(float) * M * N), *f = malloc(sizeof(float) * M * N);
    ref->linear_bf16(x, w, b, y0, M, N, K, 2);
    l->linear_bf16(x, w, b, y, M, N, K, 2);
    for (int i = 0; i < M * N; i++) f0[i] = from_bf16(y0[i]), f[i] = from_bf16(y[i]);
    char shape[64];
    snprintf(shape, sizeof shape, "M=%d N=%d K=%d", M, N, K);
    report("linear_bf16", l, shape, worst(f, f0, (size_t)M * N, 1e-4, 1.0 / 128)); /* one bf16 rounding apart */
    free(x), free(w), free(y0), free(y), free(b), free(f0), free(f);
}

static void check_linear_i8(const lib_t *ref, const lib_t *l, int M, int N, int K) {
    float *x = floats((size_t)M * K, 1), *b = floats(N, 1);
    int8_t *w = malloc((size_t)N * K);
    uint16_t *ws = malloc(2 * N);
    int32_t *wsum = calloc(N, 4);
    for (int n = 0; n < N; n++) {
        ws[n] = bf16(0.01f * (1.5f + uniform()));
        for (int k = 0; k < K; k++) wsum[n] += w[n * K + k] = (int8_t)lrintf(127 * uniform());
    }
    float *y0 = malloc(sizeof(float) * M * N), *y = malloc(sizeof(float) * M * N);
    ref->linear_i8(x, w, ws, wsum, b, y0, M, N, K, 2);
    l->linear_i8(x, w, ws, wsum, b, y, M, N, K, 2);
    char shape[64];
    snprintf(shape, sizeof shape, "M=%d N=%d K=%d", M, N, K);
    report("linear_i8", l, shape, worst(y, y0, (size_t)M * N, 1e-5, 1e-5)); /* exact integer sums */
    free(x), free(b), free(w), free(ws), free(wsum), free(y0), free(y);
}

static void check_linear_i4(const lib_t *ref, const lib_t *l, int M, int N, int K, int g) {
    float *x = floats((size_t)M * K, 1), *b = floats(N, 1);
    uint8_t *w = malloc((size_t)N * K / 2);
    uint16_t *sc = malloc(2 * (size_t)N * (K / g)), *ze = malloc(2 * (size_t)N * (K / g));
    for (size_t i = 0; i < (size_t)N * K / 2; i++) w[i] = (uint8_t)(next_bits() >> 56); /* two nibbles */
    for (size_t i = 0; i < (size_t)N * (K / g); i++) sc[i] = bf16(0.01f * (1.5f + uniform())), ze[i] = bf16(0.05f * uniform());
    float *y0 = malloc(sizeof(float) * M * N), *y = malloc(sizeof(float) * M * N);
    ref->linear_i4(x, w, sc, ze, b, y0, M, N, K, g, 2);
    l->linear_i4(x, w, sc, ze, b, y, M, N, K, g, 2);
    char shape[64];
    snprintf(shape, sizeof shape, "M=%d N=%d K=%d g=%d", M, N, K, g);
    report("linear_i4", l, shape, worst(y, y0, (size_t)M * N, 1e-5, 1e-5));
    free(x), free(b), free(w), free(sc), free(ze), free(y0), free(y);
}

/* given_peak: the variant is handed the reference's maxima (as gl_sgemm_colmax finds them) and
 * skips its first pass. */
static void check_softmax_xent(const lib_t *ref, const lib_t *l, int n, int V, int given_peak) {
    const int ldz = n + 5; /* the variant's rows padded apart, as gptlab.chunked_loss's workspace */
    float *z0 = floats((size_t)V * n, 4), *z = malloc(sizeof(float) * V * ldz);
    for (int v = 0; v < V; v++) memcpy(z + (size_t)v * ldz, z0 + (size_t)v * n, sizeof(float) * n);
    int64_t *t = malloc(sizeof(int64_t) * n);
    for (int r = 0; r < n; r++) t[r] = r % 5 == 3 ? -100 : (int64_t)((uniform() + 1) / 2 * (V - 1));
    float *out0 = malloc(sizeof(float) * 3 * n), *out = malloc(sizeof(float) * 3 * n);
    ref->softmax_xent(z0, n, t, out0, out0 + n, out0 + 2 * n, n, V, 1, NULL, 2);
    l->softmax_xent(z, ldz, t, out, out + n, out + 2 * n, n, V, 1, given_peak ? out0 + n : NULL, 2);
    for (int v = 0; v < V; v++) memmove(z + (size_t)v * n, z + (size_t)v * ldz, sizeof(float) * n);
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d V=%d%s", n, V, given_peak ? " peak given" : "");
    report("softmax_xent loss, max, inv", l, shape, worst(out, out0, 3 * (size_t)n, 1e-6, 1e-5));
    report("softmax_xent exp(z - max)", l, shape, worst(z, z0, (size_t)V * n, 1e-7, 1e-5)); /* vf_exp: < 2e-8 */
    free(z0), free(z), free(t), free(out0), free(out);
}

/* One decoding step's attention, against the reference library's: fp32 caches, or (kv16) bf16
 * caches of fp32 activations, a quantized model's. */
static void check_attention(const lib_t *ref, const lib_t *l, int B, int nh, int hs, int pos, int kv16) {
    const int C = nh * hs, L = pos + 8;
    const size_t cache = (size_t)B * nh * L * hs, bytes = cache * (kv16 ? 2 : 4);
    float *qkv = floats((size_t)B * 3 * C, 1);
    void *k0 = kv16 ? (void *)bf16s(cache, 1) : (void *)floats(cache, 1);
    void *v0 = kv16 ? (void *)bf16s(cache, 1) : (void *)floats(cache, 1);
    void *k = malloc(bytes), *v = malloc(bytes);
    memcpy(k, k0, bytes), memcpy(v, v0, bytes);
    uint8_t *mask = malloc((size_t)B * (pos + 1));
    for (int i = 0; i < B * (pos + 1); i++) mask[i] = uniform() > -0.5f;
    float *o0 = malloc(sizeof(float) * B * C), *o = malloc(sizeof(float) * B * C);
    ref->attend_one(qkv, k0, v0, pos, mask, o0, B, nh, hs, L, 0, kv16, 2);
    l->attend_one(qkv, k, v, pos, mask, o, B, nh, hs, L, 0, kv16, 2);
    char shape[64];
    snprintf(shape, sizeof shape, "B=%d nh=%d hs=%d pos=%d%s", B, nh, hs, pos, kv16 ? " bf16 cache" : "");
    report("attend_one", l, shape, worst(o, o0, (size_t)B * C, 1e-6, 1e-5));
    const int same = !memcmp(k, k0, bytes) && !memcmp(v, v0, bytes);
    report("attend_one caches", l, shape, same ? 0 : 2); /* the new key and value, copied or rounded */
    free(qkv), free(k0), free(v0), free(k), free(v), free(mask), free(o0), free(o);
}

/* A prompt's causal attention: q a strided view of c_attn's output (B, T, 3C), k and v a cache's
 * first S = T + cached slots, out (B, T, nh, hs); against the reference variant. In bf16 (the same
 * values rounded to bf16): the same bits as this library's fp32 attention of them, rounded. */
static void check_attend_prompt(const lib_t *ref, const lib_t *l, int B, int nh, int hs, int T, int cached) {
    const int C = nh * hs, S = T + cached, L = S + 5;
    const size_t nq = (size_t)B * T * 3 * C, nkv = (size_t)B * nh * L * hs, no = (size_t)B * T * C;
    float *qkv = floats(nq, 1), *k = floats(nkv, 1), *v = floats(nkv, 1);
    const long qs[3] = {(long)T * 3 * C, hs, 3 * C}, cs[3] = {(long)nh * L * hs, (long)L * hs, hs};
    float *o0 = malloc(sizeof(float) * no), *o = malloc(sizeof(float) * no);
    ref->attend_prompt(qkv, qs, k, cs, v, cs, o0, B, nh, T, S, hs, 0, 2);
    l->attend_prompt(qkv, qs, k, cs, v, cs, o, B, nh, T, S, hs, 0, 2);
    char shape[64];
    snprintf(shape, sizeof shape, "B=%d nh=%d hs=%d T=%d S=%d", B, nh, hs, T, S);
    report("attend_prompt", l, shape, worst(o, o0, no, 1e-6, 1e-5));
    uint16_t *qkvh = malloc(2 * nq), *kh = malloc(2 * nkv), *vh = malloc(2 * nkv), *oh = malloc(2 * no);
    for (size_t i = 0; i < nq; i++) qkvh[i] = bf16(qkv[i]), qkv[i] = from_bf16(qkvh[i]);
    for (size_t i = 0; i < nkv; i++) kh[i] = bf16(k[i]), k[i] = from_bf16(kh[i]), vh[i] = bf16(v[i]), v[i] = from_bf16(vh[i]);
    l->attend_prompt(qkv, qs, k, cs, v, cs, o, B, nh, T, S, hs, 0, 2);
    l->attend_prompt(qkvh, qs, kh, cs, vh, cs, oh, B, nh, T, S, hs, 1, 2);
    int same = 1;
    for (size_t i = 0; i < no; i++) same &= oh[i] == bf16(o[i]);
    report("attend_prompt bf16", l, shape, same ? 0 : 2);
    free(qkv), free(k), free(v), free(o0), free(o), free(qkvh), free(kh), free(vh), free(oh);
}

/* GPT-2's tanh GELU over n values, fp32 and bf16 (rounded once), against the reference variant. */
static void check_gelu(const lib_t *ref, const lib_t *l, int n) {
    float *x = floats((size_t)n, 6), *y0 = malloc(sizeof(float) * n), *y = malloc(sizeof(float) * n);
    ref->gelu_tanh(x, y0, n, 0, 2);
    l->gelu_tanh(x, y, n, 0, 2);
    char shape[32];
    snprintf(shape, sizeof shape, "n=%d", n);
    report("gelu_tanh", l, shape, worst(y, y0, (size_t)n, 1e-6, 1e-6)); /* vf_exp and the order of products */
    uint16_t *xh = bf16s((size_t)n, 6), *h0 = malloc(2 * (size_t)n), *h = malloc(2 * (size_t)n);
    ref->gelu_tanh(xh, h0, n, 1, 2);
    l->gelu_tanh(xh, h, n, 1, 2);
    for (int i = 0; i < n; i++) y0[i] = from_bf16(h0[i]), y[i] = from_bf16(h[i]);
    report("gelu_tanh bf16", l, shape, worst(y, y0, (size_t)n, 1e-6, 1.0 / 128)); /* one bf16 rounding apart */
    float *dy = floats((size_t)n, 1);
    ref->gelu_tanh_backward(x, dy, y0, n, 2);
    l->gelu_tanh_backward(x, dy, y, n, 2);
    report("gelu_tanh_backward", l, shape, worst(y, y0, (size_t)n, 1e-6, 1e-6));
    free(x), free(y0), free(y), free(xh), free(h0), free(h), free(dy);
}

/* The weights a quantized layer stands for, for prompts' GEMMs: int4 (N, K) in groups of g,
 * w = (q - 8) s + z, in fp32 against the formula (exact but for a fused multiply-add's rounding)
 * and the reference's, and in bf16 the same bits as the variant's own fp32 rounded to nearest even
 * (as torch rounds); int8, w = q s, one product, the same bits as the formula's. */
static void check_dequantize(const lib_t *ref, const lib_t *l, int N, int K, int g) {
    const int G = K / g;
    uint8_t *w = malloc((size_t)N * K / 2);
    uint16_t *sc = malloc(2 * (size_t)N * G), *ze = malloc(2 * (size_t)N * G);
    for (size_t i = 0; i < (size_t)N * K / 2; i++) w[i] = (uint8_t)(next_bits() >> 56); /* two nibbles */
    for (size_t i = 0; i < (size_t)N * G; i++) sc[i] = bf16(0.01f * (1.5f + uniform())), ze[i] = bf16(0.05f * uniform());
    float *want = malloc(sizeof(float) * N * K), *f0 = malloc(sizeof(float) * N * K), *f = malloc(sizeof(float) * N * K);
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            const int q = k & 1 ? w[((size_t)n * K + k) / 2] >> 4 : w[((size_t)n * K + k) / 2] & 15;
            const size_t j = (size_t)n * G + k / g;
            want[(size_t)n * K + k] = (float)((q - 8) * (double)from_bf16(sc[j]) + from_bf16(ze[j]));
        }
    ref->dequantize_i4(w, sc, ze, f0, N, K, g, 0, 2);
    l->dequantize_i4(w, sc, ze, f, N, K, g, 0, 2);
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d K=%d g=%d", N, K, g);
    report("dequantize_i4 vs formula", l, shape, worst(f, want, (size_t)N * K, 1e-7, 1e-6));
    report("dequantize_i4", l, shape, worst(f, f0, (size_t)N * K, 1e-7, 1e-6));
    uint16_t *h = malloc(2 * (size_t)N * K);
    l->dequantize_i4(w, sc, ze, h, N, K, g, 1, 2);
    size_t differ = 0;
    for (size_t i = 0; i < (size_t)N * K; i++) differ += h[i] != bf16(f[i]);
    report("dequantize_i4 bf16", l, shape, differ ? 2 : 0);
    int8_t *w8 = malloc((size_t)N * K);
    for (size_t i = 0; i < (size_t)N * K; i++) w8[i] = (int8_t)lrintf(127 * uniform());
    for (size_t i = 0; i < (size_t)N * K; i++) want[i] = (float)w8[i] * from_bf16(sc[i / K]); /* the first N scales */
    l->dequantize_i8(w8, sc, f, N, K, 2);
    report("dequantize_i8", l, shape, memcmp(f, want, sizeof(float) * N * K) ? 2 : 0);
    free(w), free(sc), free(ze), free(want), free(f0), free(f), free(h), free(w8);
}

/* A long prompt's bf16 layer, y = x W^T + b with W (N, K) stored as bf16: the same bits as gl_sgemm of
 * W widened to fp32 (each variant against itself, then against the reference). */
static void check_sgemm_bf16_b(const lib_t *ref, const lib_t *l, int M, int N, int K) {
    float *x = floats((size_t)M * K, 1), *b = floats((size_t)N, 1), *wf = malloc(sizeof(float) * N * K);
    uint16_t *w = bf16s((size_t)N * K, 0.1f);
    for (int i = 0; i < N * K; i++) wf[i] = from_bf16(w[i]);
    float *y0 = malloc(sizeof(float) * M * N), *y = malloc(sizeof(float) * M * N), *yw = malloc(sizeof(float) * M * N);
    ref->sgemm_bf16_b(M, N, K, x, K, 1, w, 1, K, y0, N, b, 0, 2);
    l->sgemm_bf16_b(M, N, K, x, K, 1, w, 1, K, y, N, b, 0, 2);
    l->sgemm(M, N, K, x, K, 1, wf, 1, K, yw, N, b, 0, 2);
    char shape[64];
    snprintf(shape, sizeof shape, "M=%d N=%d K=%d", M, N, K);
    report("sgemm_bf16_b = sgemm of W widened", l, shape, memcmp(y, yw, sizeof(float) * M * N) ? 2 : 0);
    report("sgemm_bf16_b", l, shape, worst(y, y0, (size_t)M * N, 1e-5, 1e-5));
    uint16_t *xh = bf16s((size_t)M * K, 1); /* x stored as bf16 too: the same bits as both widened */
    for (int i = 0; i < M * K; i++) x[i] = from_bf16(xh[i]);
    l->sgemm_bf16_ab(M, N, K, xh, K, 1, w, 1, K, y, N, b, 0, 2);
    l->sgemm(M, N, K, x, K, 1, wf, 1, K, yw, N, b, 0, 2);
    report("sgemm_bf16_ab = sgemm widened", l, shape, memcmp(y, yw, sizeof(float) * M * N) ? 2 : 0);
    free(x), free(b), free(wf), free(w), free(y0), free(y), free(yw), free(xh);
}

/* A prompt's layer with the weights read in place, y = x W^T + b (gl_sgemm_nt), x's rows K + 3
 * apart: against the reference; without the bias the same bits as gl_sgemm's x W^T (each sum in
 * the same order), unless x^T's last panel is split (VW < M mod NR <= VW + VW / 2: its last rows
 * are dot products along k, in another order), then within the tolerance; bf16 W, and x, the same
 * bits as the fp32 ones widened. */
static void check_sgemm_nt(const lib_t *ref, const lib_t *l, int M, int N, int K) {
    const long ldx = K + 3;
    float *x = floats((size_t)M * ldx, 1), *w = floats((size_t)N * K, 0.1f), *b = floats((size_t)N, 1);
    float *y0 = malloc(sizeof(float) * M * N), *y = malloc(sizeof(float) * M * N), *yw = malloc(sizeof(float) * M * N);
    char shape[64];
    snprintf(shape, sizeof shape, "M=%d N=%d K=%d", M, N, K);
    ref->sgemm_nt(M, N, K, x, ldx, 0, w, 0, y0, N, 0, b, 2);
    l->sgemm_nt(M, N, K, x, ldx, 0, w, 0, y, N, 0, b, 2);
    report("sgemm_nt", l, shape, worst(y, y0, (size_t)M * N, 1e-5, 1e-5));
    l->sgemm_nt(M, N, K, x, ldx, 0, w, 0, y, N, 0, NULL, 2);
    l->sgemm(M, N, K, x, ldx, 1, w, 1, K, yw, N, NULL, 0, 2);
    const int nr = l->gemm_columns(), vw = nr / 2, rest = (M - 1) % nr + 1;
    if (rest > vw && rest <= vw + vw / 2)
        report("sgemm_nt ~ sgemm (split)", l, shape, worst(y, yw, (size_t)M * N, 1e-5, 1e-5));
    else
        report("sgemm_nt = sgemm", l, shape, memcmp(y, yw, sizeof(float) * M * N) ? 2 : 0);
    uint16_t *xh = bf16s((size_t)M * ldx, 1), *wh = bf16s((size_t)N * K, 0.1f);
    for (long i = 0; i < M * ldx; i++) x[i] = from_bf16(xh[i]);
    for (int i = 0; i < N * K; i++) w[i] = from_bf16(wh[i]);
    l->sgemm_nt(M, N, K, x, ldx, 0, w, 0, yw, N, 0, b, 2);
    l->sgemm_nt(M, N, K, x, ldx, 0, wh, 1, y, N, 0, b, 2);
    report("sgemm_nt bf16 W = widened", l, shape, memcmp(y, yw, sizeof(float) * M * N) ? 2 : 0);
    l->sgemm_nt(M, N, K, xh, ldx, 1, wh, 1, y, N, 0, b, 2);
    report("sgemm_nt bf16 x, W = widened", l, shape, memcmp(y, yw, sizeof(float) * M * N) ? 2 : 0);
    uint16_t *yh = malloc(2 * (size_t)M * N); /* y rounded to bf16 as it is written: y's bits, rounded */
    l->sgemm_nt(M, N, K, xh, ldx, 1, wh, 1, yh, N, 1, b, 2);
    size_t differ = 0;
    for (size_t i = 0; i < (size_t)M * N; i++) differ += yh[i] != bf16(y[i]);
    report("sgemm_nt bf16 y = rounded", l, shape, differ ? 2 : 0);
    free(yh);
    free(x), free(w), free(b), free(y0), free(y), free(yw), free(xh), free(wh);
}

static void check_argmax(const lib_t *ref, const lib_t *l, int M, int N) {
    float *x = floats((size_t)M * N, 1);
    int64_t *a0 = malloc(8 * M), *a = malloc(8 * M);
    ref->argmax(x, a0, M, N);
    l->argmax(x, a, M, N);
    int same = 1;
    for (int m = 0; m < M; m++) same &= a[m] == a0[m];
    char shape[64];
    snprintf(shape, sizeof shape, "M=%d N=%d", M, N);
    report("argmax", l, shape, same ? 0 : 2);
    free(x), free(a0), free(a);
}

/* C (M, N) (+)= A B (+ a bias for odd M) with A stored (M, K) or transposed (K, M), B (K, N) or
 * (N, K), against float64: within 1e-6 of the sum of |a b| over each element's products (fp32
 * sums: measured <= 1.9e-7).
 * bf16: gl_gemm_bf16, against the float64 product of A and B rounded to bf16 (measured <= 1.2e-7). */
static void check_gemm(const lib_t *l, int M, int N, int K, int a_t, int b_t, int accumulate, int bf16_operands) {
    float *a = floats((size_t)M * K, 1), *b = floats((size_t)K * N, 1), *c = floats((size_t)M * N, 1);
    float *bias = M & 1 ? floats((size_t)N, 1) : NULL;
    double *want = malloc(sizeof(double) * M * N), *scale = malloc(sizeof(double) * M * N);
    const long rsa = a_t ? 1 : K, csa = a_t ? M : 1, rsb = b_t ? 1 : N, csb = b_t ? K : 1;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = (accumulate ? c[i * N + j] : 0) + (bias ? bias[j] : 0), m = fabs(s);
            for (int k = 0; k < K; k++) {
                float x = a[i * rsa + k * csa], y = b[k * rsb + j * csb];
                if (bf16_operands) x = from_bf16(bf16(x)), y = from_bf16(bf16(y));
                const double p = (double)x * y;
                s += p, m += fabs(p);
            }
            want[i * N + j] = s, scale[i * N + j] = m;
        }
    (bf16_operands ? l->gemm_bf16 : l->sgemm)(M, N, K, a, rsa, csa, b, rsb, csb, c, N, bias, accumulate, 2);
    double w = 0;
    for (int i = 0; i < M * N; i++) {
        const double e = fabs(c[i] - want[i]) / (1e-6 * scale[i] + 1e-30);
        if (!(e <= w)) w = e;
    }
    char shape[64];
    snprintf(shape, sizeof shape, "M=%d N=%d K=%d%s%s%s%s", M, N, K, a_t ? " a^T" : "", b_t ? " b^T" : "",
             accumulate ? " +=" : "", bias ? " +bias" : "");
    report(bf16_operands ? "gemm_bf16 vs float64" : "sgemm vs float64", l, shape, w);
    if (!accumulate && !bias) { /* the same product with its columns' maxima: the same bits, and their max */
        float *c2 = malloc(sizeof(float) * M * N), *top = malloc(sizeof(float) * N);
        l->sgemm_colmax(M, N, K, a, rsa, csa, b, rsb, csb, c2, N, top, bf16_operands, 2);
        int bad = memcmp(c, c2, sizeof(float) * M * N) != 0;
        for (int j = 0; j < N; j++) {
            float m = -INFINITY;
            for (int i = 0; i < M; i++) m = fmaxf(m, c[i * N + j]);
            bad |= top[j] != m;
        }
        report(bf16_operands ? "gemm_bf16 colmax" : "sgemm colmax", l, shape, bad ? 2 : 0);
        free(c2), free(top);
    }
    free(a), free(b), free(c), free(want), free(scale), free(bias);
}

/* The head's three layouts (W x^T, e^T W, e x), B packed whole and a block at a time (B over 2 MB,
 * columns past GEMM_NC), edge tiles, accumulation; in fp32, and in bf16 where the library and the
 * CPU have it. */
static void check_sgemms(const lib_t *l) {
    static const int mm[][6] = {{1, 1, 1, 0, 0, 0},      {301, 40, 16, 0, 1, 0}, {40, 16, 301, 1, 0, 0},
                                {301, 16, 40, 0, 0, 1},  {13, 70, 600, 0, 0, 1}, {50, 700, 800, 1, 1, 0},
                                {3, 4100, 20, 0, 1, 1},  {302, 40, 16, 0, 1, 0}};
    for (int bf16_operands = 0; bf16_operands <= l->has_gemm_bf16(); bf16_operands++)
        for (size_t i = 0; i < sizeof mm / sizeof *mm; i++)
            check_gemm(l, mm[i][0], mm[i][1], mm[i][2], mm[i][3], mm[i][4], mm[i][5], bf16_operands);
}

static void check_all(const lib_t *ref, const lib_t *l) {
    static const int Ms[] = {1, 2, 5, 17, 100}, NKs[][2] = {{37, 40}, {70, 768}, {30, 3072}};
    for (size_t i = 0; i < sizeof Ms / sizeof *Ms; i++)
        for (size_t j = 0; j < sizeof NKs / sizeof *NKs; j++) {
            const int M = Ms[i], N = NKs[j][0], K = NKs[j][1];
            if (M <= 8) check_linear_f32(ref, l, M, N, K), check_linear_bf16(ref, l, M, N, K);
            check_linear_i8(ref, l, M, N, K);
        }
    static const int i4[][3] = {{1, 33, 256}, {3, 40, 768}, {17, 21, 768}, {41, 9, 1024}};
    static const int groups[] = {32, 64, 128, 256};
    for (size_t i = 0; i < sizeof i4 / sizeof *i4; i++)
        for (size_t j = 0; j < sizeof groups / sizeof *groups; j++)
            check_linear_i4(ref, l, i4[i][0], i4[i][1], i4[i][2], groups[j]);
    for (int given_peak = 0; given_peak <= 1; given_peak++)
        check_softmax_xent(ref, l, 13, 301, given_peak), check_softmax_xent(ref, l, 64, 2000, given_peak);
    for (int kv16 = 0; kv16 < 2; kv16++)
        check_attention(ref, l, 2, 3, 16, 0, kv16), check_attention(ref, l, 3, 2, 64, 37, kv16);
    check_argmax(ref, l, 3, 1000), check_argmax(ref, l, 1, 7);
    check_attend_prompt(ref, l, 2, 3, 40, 101, 0), check_attend_prompt(ref, l, 1, 2, 64, 50, 37);
    check_gelu(ref, l, 4099), check_gelu(ref, l, 7);
    check_dequantize(ref, l, 37, 256, 32), check_dequantize(ref, l, 5, 768, 128), check_dequantize(ref, l, 3, 1024, 1024);
    check_sgemm_bf16_b(ref, l, 37, 70, 300), check_sgemm_bf16_b(ref, l, 5, 4100, 20);
    check_sgemm_nt(ref, l, 37, 70, 300), check_sgemm_nt(ref, l, 5, 41, 20), check_sgemm_nt(ref, l, 512, 4100, 8);
    static const int split_rows[] = {9, 10, 11, 12, 13, 17, 20, 23, 24, 25}; /* split last panels of 16 and 32 */
    for (size_t i = 0; i < sizeof split_rows / sizeof *split_rows; i++) check_sgemm_nt(ref, l, split_rows[i], 43, 300);
    check_sgemms(l);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: kernel_check REF.so LIB.so [LIB.so ...]\n");
        return 2;
    }
    const lib_t ref = open_lib(argv[1]);
    printf("reference: %s (%s)\n", ref.variant, ref.path);
    check_linear_f32(&ref, &ref, 3, 37, 40), check_linear_f32(&ref, &ref, 1, 70, 768);
    check_dequantize(&ref, &ref, 7, 256, 64);
    check_sgemms(&ref);
    for (int i = 2; i < argc; i++) {
        const lib_t l = open_lib(argv[i]);
        printf("checking %s (%s) against %s\n", l.variant, l.path, ref.variant);
        check_all(&ref, &l);
    }
    printf("%s: %d failed\n", failures ? "FAILED" : "passed", failures);
    return failures ? 1 : 0;
}
