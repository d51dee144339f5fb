/* simd.h's primitives for GL_AVX512: AVX-512 F/BW/VL/DQ + VNNI.
 * Included by simd.h only, when GL_VARIANT names this set. */
#ifndef GL_SIMD_AVX512_H
#define GL_SIMD_AVX512_H

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512VNNI__)
#error "the AVX-512 variant needs -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni"
#endif
#include <immintrin.h>
#define VW 16
#define GL_I8_OFFSET 128 /* vpdpbusd multiplies unsigned by signed bytes: activations are stored + 128 */
typedef __m512 vf;
typedef __m512i vi;

AI vf vf_zero(void) { return _mm512_setzero_ps(); }
AI vf vf_set1(float a) { return _mm512_set1_ps(a); }
AI vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
AI void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
AI vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
AI vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
AI vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
AI vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
AI vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
AI vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  /* a b + c */
AI vf vf_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a b */
AI float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }
AI float vf_hmax(vf v) { return _mm512_reduce_max_ps(v); }
AI vf vf_abs(vf v) { return _mm512_abs_ps(v); }
AI vf vf_round(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
AI vf vf_ldexp(vf p, vf n) { return _mm512_scalef_ps(p, n); } /* p 2^n, n integral */
AI vf vf_copysign(vf t, vf s) { /* |t| with the sign of s */
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(sign, _mm512_castps_si512(t)),
                                               _mm512_and_si512(sign, _mm512_castps_si512(s))));
}
AI vf vf_load_bf16(const uint16_t *p) { /* VW bf16 values, as fp32 (exact: a shift) */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* 2 VW bf16 values in one load: the even-indexed ones by a shift, the odd-indexed ones by a mask. */
AI void vf_bf16_pairs(const uint16_t *p, vf *even, vf *odd) {
    __m512i v = _mm512_loadu_si512((const void *)p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

/* The VW integral values of v (each in [-128, 255]) as bytes: their low 8 bits, to p. */
AI void vf_store_bytes(void *p, vf v) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v))); }

AI vi vi_zero(void) { return _mm512_setzero_si512(); }
AI vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
/* The even bytes of t[0, 128) to q[0, 64), the odd ones to q[64, 128) (per 16 bytes, then per 8). */
AI void vi_deinterleave_bytes(const void *t, void *q) {
    const __m512i split = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    const __m512i a = _mm512_shuffle_epi8(vi_load(t), split), b = _mm512_shuffle_epi8(vi_load((const char *)t + 64), split);
    _mm512_storeu_si512(q, _mm512_permutex2var_epi64(a, _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), b));
    _mm512_storeu_si512((char *)q + 64, _mm512_permutex2var_epi64(a, _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15), b));
}
AI int32_t vi_sum(vi v) { return _mm512_reduce_add_epi32(v); }
AI vf vf_from_vi(vi v) { return _mm512_cvtepi32_ps(v); }
/* acc lane l += sum of the 4 byte products of lanes l of x (activations, stored + GL_I8_OFFSET) and w (int8). */
AI vi vi_dot_i8(vi acc, vi x, vi w) { return _mm512_dpbusd_epi32(acc, x, w); }
/* Lane l: sum of the byte products lo . x0 + hi . x1 over lane l's 4 bytes (lo, hi unsigned nibbles). */
AI vi vi_dot_u4(vi lo, vi x0, vi hi, vi x1) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x0), hi, x1);
}
AI void vi_store(void *p, vi v) { _mm512_storeu_si512(p, v); }
AI vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
AI vi vi_bcast4(const void *p) { /* the 4 bytes at p in every lane */
    int32_t w;
    memcpy(&w, p, 4);
    return _mm512_set1_epi32(w);
}
/* The products of vi_dot_u4, added to two sums: lo . x0 to *a and hi . x1 to *b (each a chain of
 * its own) or both to *a (then b is not read). */
AI void vi_dot_u4_acc(vi *a, vi *b, vi lo, vi x0, vi hi, vi x1) {
    *a = _mm512_dpbusd_epi32(*a, lo, x0);
    *b = _mm512_dpbusd_epi32(*b, hi, x1);
}
AI vi vi_low_nibbles(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
AI vi vi_high_nibbles(vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f)); }
/* Lane l: the bf16 scale of block b + l / 4 of 32 int4 inputs (s[(b + l / 4) >> gshift]) as
 * fp32: the scale of the block lane l's inputs belong to (see quantized.c). b is a multiple of 4,
 * so the 4 blocks take groups (b >> gshift) + (t >> gshift), t < 4: one broadcast of those
 * scales, one in-lane shuffle (128-bit lane t takes block t's scale into each float's high half),
 * where groups larger than 32 took four scalar loads through the stack (GPT-2's int4 layers
 * decoding at g64 on an AMD EPYC Zen 5: 2.98 -> 2.71 ms; level at g32). */
#define BF16_AT(j) ((int)(0x8080u | (2u * (j)) << 16 | (2u * (j) + 1) << 24)) /* bytes -1, -1, 2j, 2j+1 */
AI vf vf_block_scales(const uint16_t *s, int b, int gshift) {
    uint64_t four = 0;
    memcpy(&four, s + (b >> gshift), gshift == 0 ? 8 : gshift == 1 ? 4 : 2); /* only what exists */
    const int g = gshift < 2 ? gshift : 2; /* lane t takes group t >> g of the four loaded */
#define Q(t) BF16_AT((t) >> g), BF16_AT((t) >> g), BF16_AT((t) >> g), BF16_AT((t) >> g)
    const __m512i put = _mm512_set_epi32(Q(3), Q(2), Q(1), Q(0));
#undef Q
    return _mm512_castsi512_ps(_mm512_shuffle_epi8(_mm512_set1_epi64((long long)four), put));
}
#undef BF16_AT

/* simd.h's fallbacks this set replaces */
#define GL_HAVE_LDEXP 1
#define GL_HAVE_TAIL_LOADS 1
#define GL_HAVE_TAIL_STORE 1

/* Tails by masked loads and stores, which never touch memory past p + n. (A copy through the
 * stack, as the other variants do, stalls on store forwarding: with int4's 24 groups per
 * 768-input row, 16 + a tail of 8, that made AVX-512's int4 decoding of GPT-2's 768-input rows
 * 2x slower than AVX2's, whose 8 + 8 + 8 have no tail; AMD EPYC Zen 5.) */
AI __mmask16 tail_mask(int n) { return (__mmask16)((1u << n) - 1u); }
static inline vf vf_load_part(const float *p, int n, float fill) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), tail_mask(n), p);
}
static inline vf vf_load_n(const float *p, int n) { return n >= VW ? vf_load(p) : _mm512_maskz_loadu_ps(tail_mask(n), p); }
static inline void vf_store_n(float *p, vf v, int n) {
    if (n >= VW) vf_store(p, v);
    else _mm512_mask_storeu_ps(p, tail_mask(n), v);
}
static inline vf vf_load_bf16_n(const uint16_t *p, int n) {
    if (n >= VW) return vf_load_bf16(p);
    const __m256i h = _mm256_maskz_loadu_epi16(tail_mask(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#endif /* GL_SIMD_AVX512_H */
