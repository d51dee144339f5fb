/* simd.h's primitives for GL_NEON: aarch64 Advanced SIMD (and the neon-dotprod variant).
 * Included by simd.h only, when GL_VARIANT names this set. */
#ifndef GL_SIMD_NEON_H
#define GL_SIMD_NEON_H

#if !defined(__aarch64__)
#error "the NEON variant is for aarch64"
#endif
#include <arm_neon.h>
#define VW 4
#define GL_I8_OFFSET 0 /* signed activations: sdot (or smull) multiplies int8 by int8 */
typedef float32x4_t vf;
typedef int32x4_t vi;

AI vf vf_zero(void) { return vdupq_n_f32(0.0f); }
AI vf vf_set1(float a) { return vdupq_n_f32(a); }
AI vf vf_load(const float *p) { return vld1q_f32(p); }
AI void vf_store(float *p, vf v) { vst1q_f32(p, v); }
AI vf vf_add(vf a, vf b) { return vaddq_f32(a, b); }
AI vf vf_sub(vf a, vf b) { return vsubq_f32(a, b); }
AI vf vf_mul(vf a, vf b) { return vmulq_f32(a, b); }
AI vf vf_div(vf a, vf b) { return vdivq_f32(a, b); }
AI vf vf_max(vf a, vf b) { return vbslq_f32(vcgtq_f32(a, b), a, b); } /* b where unordered, as maxps */
AI vf vf_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
AI vf vf_fnma(vf a, vf b, vf c) { return vfmsq_f32(c, a, b); }
AI float vf_sum(vf v) { /* (v0 + v2) + (v1 + v3), the portable tree's order */
    const float32x2_t s = vadd_f32(vget_low_f32(v), vget_high_f32(v));
    return vget_lane_f32(s, 0) + vget_lane_f32(s, 1);
}
AI float vf_hmax(vf v) { return vmaxvq_f32(v); }
AI vf vf_abs(vf v) { return vabsq_f32(v); }
AI vf vf_round(vf v) { return vrndnq_f32(v); } /* to nearest, ties to even */
AI vf vf_pow2i(vf n) { /* 2^n for integral n in [-126, 127] */
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23));
}
AI vf vf_copysign(vf t, vf s) { return vbslq_f32(vdupq_n_u32(0x80000000u), s, t); }
AI vf vf_load_bf16(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
AI void vf_bf16_pairs(const uint16_t *p, vf *even, vf *odd) {
    const uint32x4_t v = vreinterpretq_u32_u16(vld1q_u16(p));
    *even = vreinterpretq_f32_u32(vshlq_n_u32(v, 16));
    *odd = vreinterpretq_f32_u32(vandq_u32(v, vdupq_n_u32(0xffff0000u)));
}
AI void vf_store_bytes(void *p, vf v) { /* the low byte of each (integral) lane */
    const int16x4_t h = vmovn_s32(vcvtq_s32_f32(v));
    const uint32_t four = vget_lane_u32(vreinterpret_u32_s8(vmovn_s16(vcombine_s16(h, h))), 0);
    memcpy(p, &four, 4);
}

AI vi vi_zero(void) { return vdupq_n_s32(0); }
AI vi vi_load(const void *p) { return vreinterpretq_s32_u8(vld1q_u8((const uint8_t *)p)); }
AI void vi_deinterleave_bytes(const void *t, void *q) { /* 2 VB bytes: evens, then odds */
    const uint8x16x2_t eo = vld2q_u8((const uint8_t *)t);
    vst1q_u8((uint8_t *)q, eo.val[0]);
    vst1q_u8((uint8_t *)q + 16, eo.val[1]);
}
AI int32_t vi_sum(vi v) { return vaddvq_s32(v); }
AI vf vf_from_vi(vi v) { return vcvtq_f32_s32(v); }
/* acc lane l += sum of the 4 byte products x . w over lane l's bytes, both int8 (exact either way:
 * each product fits 16 bits, |x| <= 127). */
AI vi vi_dot_i8(vi acc, vi x, vi w) {
    const int8x16_t a = vreinterpretq_s8_s32(x), b = vreinterpretq_s8_s32(w);
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    const int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b)), hi = vmull_high_s8(a, b);
    return vaddq_s32(acc, vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
#endif
}
/* Nibbles (<= 15, so also valid int8) times int8. */
AI vi vi_dot_u4(vi lo, vi x0, vi hi, vi x1) { return vi_dot_i8(vi_dot_i8(vi_zero(), lo, x0), hi, x1); }
AI void vi_store(void *p, vi v) { vst1q_u8((uint8_t *)p, vreinterpretq_u8_s32(v)); }
AI vi vi_add(vi a, vi b) { return vaddq_s32(a, b); }
AI vi vi_bcast4(const void *p) {
    int32_t w;
    memcpy(&w, p, 4);
    return vdupq_n_s32(w);
}
AI void vi_dot_u4_acc(vi *a, vi *b, vi lo, vi x0, vi hi, vi x1) {
    *a = vi_dot_i8(*a, lo, x0);
    *b = vi_dot_i8(*b, hi, x1);
}
AI vi vi_low_nibbles(vi v) { return vreinterpretq_s32_u8(vandq_u8(vreinterpretq_u8_s32(v), vdupq_n_u8(0x0f))); }
AI vi vi_high_nibbles(vi v) { return vreinterpretq_s32_u8(vshrq_n_u8(vreinterpretq_u8_s32(v), 4)); }
AI vf vf_block_scales(const uint16_t *s, int b, int gshift) { /* one block of 32 per vector of 4 lanes */
    const uint32_t u = (uint32_t)s[b >> gshift] << 16;
    float f;
    memcpy(&f, &u, 4);
    return vdupq_n_f32(f);
}

#endif /* GL_SIMD_NEON_H */
