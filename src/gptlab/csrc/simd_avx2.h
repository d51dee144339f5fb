/* simd.h's primitives for GL_AVX2: AVX2 + FMA + F16C (and the avx2-vnni and avx512-256 variants).
 * Included by simd.h only, when GL_VARIANT names this set. */
#ifndef GL_SIMD_AVX2_H
#define GL_SIMD_AVX2_H

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the AVX2 variant needs -mavx2 -mfma -mf16c"
#endif
#include <immintrin.h>
#define VW 8
#define GL_I8_OFFSET 0 /* signed activations: the sign trick of vi_dot_i8 */
typedef __m256 vf;
typedef __m256i vi;

AI vf vf_zero(void) { return _mm256_setzero_ps(); }
AI vf vf_set1(float a) { return _mm256_set1_ps(a); }
AI vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
AI void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
AI vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
AI vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
AI vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
AI vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
AI vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
AI vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
AI vf vf_fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
AI float vf_sum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
AI float vf_hmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
/* The four sums of a, b, c, d into out[0..3] at once (hadd trees: ~5 instructions, not 4 x 6). */
#define GL_HAVE_SUM4 1
AI void vf_sum4(vf a, vf b, vf c, vf d, float out[4]) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}
AI vf vf_abs(vf v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
AI vf vf_round(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
AI vf vf_pow2i(vf n) { /* 2^n for integral n in [-126, 127] */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
AI vf vf_copysign(vf t, vf s) {
    const vf sign = _mm256_set1_ps(-0.0f);
    return _mm256_or_ps(_mm256_andnot_ps(sign, t), _mm256_and_ps(sign, s));
}
AI vf vf_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
AI void vf_bf16_pairs(const uint16_t *p, vf *even, vf *odd) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

AI void vf_store_bytes(void *p, vf v) { /* the low byte of each int32 lane, gathered per 128-bit half */
    const __m256i low = _mm256_set1_epi32(0x0c080400), b = _mm256_shuffle_epi8(_mm256_cvtps_epi32(v), low);
    const uint32_t two[2] = {(uint32_t)_mm256_cvtsi256_si32(b), (uint32_t)_mm256_extract_epi32(b, 4)};
    memcpy(p, two, 8);
}

AI vi vi_zero(void) { return _mm256_setzero_si256(); }
AI vi vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
/* The even bytes of t[0, 64) to q[0, 32), the odd ones to q[32, 64) (per 16 bytes, then per 8). */
AI void vi_deinterleave_bytes(const void *t, void *q) {
    const __m256i split = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    const __m256i a = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(vi_load(t), split), 0xd8); /* e0 e1 o0 o1 */
    const __m256i b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(vi_load((const char *)t + 32), split), 0xd8);
    _mm256_storeu_si256((__m256i *)q, _mm256_permute2x128_si256(a, b, 0x20));
    _mm256_storeu_si256((__m256i *)((char *)q + 32), _mm256_permute2x128_si256(a, b, 0x31));
}
AI int32_t vi_sum(vi v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}
AI vf vf_from_vi(vi v) { return _mm256_cvtepi32_ps(v); }
AI void vi_sum4(vi a, vi b, vi c, vi d, int32_t out[4]) {
    const __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    _mm_storeu_si128((__m128i *)out, _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1)));
}
/* acc lane l += sum of the 4 byte products x . w, both int8, at full precision: vpmaddubsw wants
 * one unsigned operand and saturates at 16 bits, so (as llama.cpp) it gets |w| and x with w's sign
 * moved onto it: |w| sign(w) x = w x, and each pair sum is at most 2 * 128 * 127 < 2^15. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GL_DPBUSD _mm256_dpbusd_epi32 /* the avx512-256 variant: AVX-512 VNNI's vpdpbusd on ymm */
#elif defined(__AVXVNNI__)
#define GL_DPBUSD _mm256_dpbusd_avx_epi32
#elif defined(GL_EMULATE_AVXVNNI)
/* For the C check only (tests/c/run_check.py), on CPUs without AVX-VNNI: vpdpbusd's exact meaning
 * in AVX2, so the avx2-vnni code runs everywhere. Lane l += u[4l..4l+3] . s[4l..4l+3], u unsigned
 * and s signed bytes, without saturation: the even and the odd bytes widened to 16 bits apart. */
#define GL_DPBUSD vi_dpbusd_emulated
AI vi vi_dpbusd_emulated(vi acc, vi u, vi s) {
    const vi mask = _mm256_set1_epi16(0x00ff);
    const vi u_even = _mm256_and_si256(u, mask), u_odd = _mm256_srli_epi16(u, 8);
    const vi s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
}
#endif
AI vi vi_dot_i8(vi acc, vi x, vi w) {
    const vi aw = _mm256_sign_epi8(w, w), sx = _mm256_sign_epi8(x, w);
#if defined(GL_DPBUSD)
    return GL_DPBUSD(acc, aw, sx);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)));
#endif
}
/* Nibbles (<= 15) times int8: both byte-pair sums fit 16 bits (2 * 15 * 127 each, 7620 together). */
AI vi vi_dot_u4(vi lo, vi x0, vi hi, vi x1) {
#if defined(GL_DPBUSD)
    return GL_DPBUSD(GL_DPBUSD(_mm256_setzero_si256(), lo, x0), hi, x1);
#else
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}
AI void vi_store(void *p, vi v) { _mm256_storeu_si256((__m256i *)p, v); }
AI vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
AI vi vi_bcast4(const void *p) {
    int32_t w;
    memcpy(&w, p, 4);
    return _mm256_set1_epi32(w);
}
AI void vi_dot_u4_acc(vi *a, vi *b, vi lo, vi x0, vi hi, vi x1) {
#if defined(GL_DPBUSD)
    *a = GL_DPBUSD(*a, lo, x0);
    *b = GL_DPBUSD(*b, hi, x1);
#else
    (void)b;
    *a = _mm256_add_epi32(*a, vi_dot_u4(lo, x0, hi, x1));
#endif
}
AI vi vi_low_nibbles(vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
AI vi vi_high_nibbles(vi v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)); }
AI vf vf_block_scales(const uint16_t *s, int b, int gshift) { /* lanes 0-3: block b's scale; 4-7: b + 1's */
    /* b is even, so at g64 and more both blocks are in one group, whose scale every lane takes: a
     * broadcast and a shift, not two scalar loads merged (GPT-2 int4 decoding at g64 on avx2,
     * AMD EPYC Zen 4, rounds alternating with the old code: 1.05x, twice; avx512-256 1.01x). */
    if (gshift > 0)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi16((short)s[b >> gshift]), 16));
    uint32_t two;
    memcpy(&two, s + b, 4);
    const __m256i put = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 0, 1, -1, -1, 0, 1, -1, -1, 0, 1, /* the low half */
                                         -1, -1, 2, 3, -1, -1, 2, 3, -1, -1, 2, 3, -1, -1, 2, 3);
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(_mm256_set1_epi32((int)two), put));
}

/* simd.h's fallbacks this set replaces (and GL_HAVE_SUM4, above) */
#define GL_HAVE_TAIL_LOADS 1

/* Loads of tails by AVX's masked loads (no store-forwarding stall, nothing read past p + n); stores
 * of tails still through the stack (vmaskmovps stores are slow on AMD). AMD EPYC Zen 5, GPT-2's
 * int4 layers decoding at g64 (12 groups per 768-input row: 8 + a tail of 4) on avx512-256:
 * 2.74 -> 1.75-1.86 ms. */
AI __m256i tail_lanes(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
static inline vf vf_load_part(const float *p, int n, float fill) {
    const __m256i m = tail_lanes(n);
    return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}
static inline vf vf_load_n(const float *p, int n) { return n >= VW ? vf_load(p) : _mm256_maskload_ps(p, tail_lanes(n)); }
static inline vf vf_load_bf16_n(const uint16_t *p, int n) {
    if (n >= VW) return vf_load_bf16(p);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m128i h = _mm_maskz_loadu_epi16((__mmask8)((1u << n) - 1u), p);
#else
    /* n < 8: its n / 2 pairs by a masked load of 32-bit lanes, an odd last value blended in. (Seven
     * conditional scalar loads, as before, made the int4 epilogue's g64 tail, 4 of 12 groups, cost
     * GPT-2's int4 layers of 768 inputs 1.1-1.3x their time; AMD EPYC Zen 4, avx2.) */
    __m128i h = _mm_maskload_epi32((const int *)p, _mm_cmpgt_epi32(_mm_set1_epi32(n / 2), _mm_setr_epi32(0, 1, 2, 3)));
    if (n & 1) {
        const __m128i last = _mm_cmpeq_epi16(_mm_set1_epi16((short)(n - 1)), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
        h = _mm_blendv_epi8(h, _mm_set1_epi16((short)p[n - 1]), last);
    }
#endif
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#endif /* GL_SIMD_AVX2_H */
