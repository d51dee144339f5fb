/* simd.h's primitives for GL_PORTABLE: plain C, no intrinsics.
 * Included by simd.h only, when GL_VARIANT names this set. */
#ifndef GL_SIMD_PORTABLE_H
#define GL_SIMD_PORTABLE_H

#define VW 8
#define GL_I8_OFFSET 0
typedef struct { float v[VW]; } vf;
typedef union { int32_t i[VW]; int8_t s[4 * VW]; uint8_t u[4 * VW]; } vi;
#define EACH(expr)                                                                                                     \
    vf r;                                                                                                              \
    for (int l = 0; l < VW; l++) r.v[l] = (expr);                                                                      \
    return r

static inline vf vf_zero(void) { EACH(0.0f); }
static inline vf vf_set1(float a) { EACH(a); }
static inline vf vf_load(const float *p) { EACH(p[l]); }
static inline void vf_store(float *p, vf v) { memcpy(p, v.v, sizeof v.v); }
static inline vf vf_add(vf a, vf b) { EACH(a.v[l] + b.v[l]); }
static inline vf vf_sub(vf a, vf b) { EACH(a.v[l] - b.v[l]); }
static inline vf vf_mul(vf a, vf b) { EACH(a.v[l] * b.v[l]); }
static inline vf vf_div(vf a, vf b) { EACH(a.v[l] / b.v[l]); }
static inline vf vf_max(vf a, vf b) { EACH(a.v[l] > b.v[l] ? a.v[l] : b.v[l]); } /* b where unordered, as maxps */
static inline vf vf_fma(vf a, vf b, vf c) { EACH(a.v[l] * b.v[l] + c.v[l]); }
static inline vf vf_fnma(vf a, vf b, vf c) { EACH(c.v[l] - a.v[l] * b.v[l]); }
static inline vf vf_abs(vf v) { EACH(fabsf(v.v[l])); }
static inline vf vf_round(vf v) { EACH(nearbyintf(v.v[l])); }
static inline vf vf_pow2i(vf n) { EACH(ldexpf(1.0f, (int)n.v[l])); }
static inline vf vf_copysign(vf t, vf s) { EACH(copysignf(t.v[l], s.v[l])); }
static inline vf vf_load_bf16(const uint16_t *p) {
    vf r;
    for (int l = 0; l < VW; l++) {
        uint32_t u = (uint32_t)p[l] << 16;
        memcpy(&r.v[l], &u, 4);
    }
    return r;
}
static inline void vf_bf16_pairs(const uint16_t *p, vf *even, vf *odd) {
    for (int l = 0; l < VW; l++) {
        uint32_t e = (uint32_t)p[2 * l] << 16, o = (uint32_t)p[2 * l + 1] << 16;
        memcpy(&even->v[l], &e, 4);
        memcpy(&odd->v[l], &o, 4);
    }
}
static inline float vf_sum(vf v) { /* pairwise, as the SIMD reductions add */
    float s[VW];
    memcpy(s, v.v, sizeof s);
    for (int w = VW / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) s[l] += s[l + w];
    return s[0];
}
static inline float vf_hmax(vf v) {
    float m = v.v[0];
    for (int l = 1; l < VW; l++) m = v.v[l] > m ? v.v[l] : m;
    return m;
}

static inline void vf_store_bytes(void *p, vf v) {
    for (int l = 0; l < VW; l++) ((uint8_t *)p)[l] = (uint8_t)(int)v.v[l];
}

static inline vi vi_zero(void) {
    vi r;
    memset(&r, 0, sizeof r);
    return r;
}
static inline vi vi_load(const void *p) {
    vi r;
    memcpy(&r, p, sizeof r);
    return r;
}
static inline void vi_deinterleave_bytes(const void *t, void *q) { /* 2 VB bytes: evens, then odds */
    for (int i = 0; i < 4 * VW; i++) {
        ((uint8_t *)q)[i] = ((const uint8_t *)t)[2 * i];
        ((uint8_t *)q)[4 * VW + i] = ((const uint8_t *)t)[2 * i + 1];
    }
}
static inline int32_t vi_sum(vi v) {
    int32_t s = 0;
    for (int l = 0; l < VW; l++) s += v.i[l];
    return s;
}
static inline vf vf_from_vi(vi v) { EACH((float)v.i[l]); }
static inline vi vi_dot_i8(vi acc, vi x, vi w) {
    for (int l = 0; l < VW; l++)
        for (int t = 0; t < 4; t++) acc.i[l] += (int32_t)x.s[4 * l + t] * w.s[4 * l + t];
    return acc;
}
static inline vi vi_dot_u4(vi lo, vi x0, vi hi, vi x1) {
    vi r;
    for (int l = 0; l < VW; l++) {
        r.i[l] = 0;
        for (int t = 0; t < 4; t++) r.i[l] += lo.u[4 * l + t] * x0.s[4 * l + t] + hi.u[4 * l + t] * x1.s[4 * l + t];
    }
    return r;
}
static inline void vi_store(void *p, vi v) { memcpy(p, &v, sizeof v); }
static inline vi vi_add(vi a, vi b) {
    for (int l = 0; l < VW; l++) a.i[l] += b.i[l];
    return a;
}
static inline vi vi_bcast4(const void *p) {
    vi r;
    for (int l = 0; l < VW; l++) memcpy(&r.i[l], p, 4);
    return r;
}
static inline void vi_dot_u4_acc(vi *a, vi *b, vi lo, vi x0, vi hi, vi x1) {
    (void)b;
    *a = vi_add(*a, vi_dot_u4(lo, x0, hi, x1));
}
static inline vi vi_low_nibbles(vi v) {
    for (int b = 0; b < 4 * VW; b++) v.u[b] &= 15;
    return v;
}
static inline vi vi_high_nibbles(vi v) {
    for (int b = 0; b < 4 * VW; b++) v.u[b] >>= 4;
    return v;
}
static inline vf vf_block_scales(const uint16_t *s, int b, int gshift) {
    uint16_t t[VW];
    for (int l = 0; l < VW; l++) t[l] = s[(b + l / 4) >> gshift];
    return vf_load_bf16(t);
}
#undef EACH

#endif /* GL_SIMD_PORTABLE_H */
