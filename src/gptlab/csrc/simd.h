/* The vector primitives the kernels are written in, one set per variant (x86-64 level).
 *
 * GL_VARIANT picks the set; each variant's library is this source compiled with its own target
 * flags (gptlab/kernel_build.py), so one build serves every CPU and gptlab/kernels.py loads the
 * best one the CPU reports:
 *
 *   GL_AVX512   AVX-512 F/BW/VL/DQ + VNNI: 16 floats a vector, vpdpbusd for int8.
 *   GL_AVX2     AVX2 + FMA + F16C (Haswell, AMD Zen 1-3): 8 floats a vector; int8 products by
 *               vpmaddubsw + vpmaddwd (full 8-bit precision, see vi_dot_i8), or AVX-VNNI's
 *               vpdpbusd on ymm when compiled with -mavxvnni (Alder Lake, Zen 5), or AVX-512
 *               VNNI's on ymm when compiled with AVX-512 VL (the avx512-256 variant, for CPUs
 *               whose AVX-512 is half width: AMD Zen 4).
 *   GL_NEON     aarch64 Advanced SIMD: 4 floats a vector; int8 products by sdot when compiled
 *               with +dotprod (Armv8.2+), else by widening multiplies and pairwise adds.
 *   GL_PORTABLE plain C over arrays of 8 (no intrinsics): compiles for any CPU, and is the
 *               reference the tests compare the others against.
 *
 * Types: vf holds VW floats; vi holds VW int32 lanes, or the 4 * VW bytes they are made of.
 */
#ifndef GL_SIMD_H
#define GL_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define GL_PORTABLE 0
#define GL_NEON 1
#define GL_AVX2 2
#define GL_AVX512 3

#ifndef GL_VARIANT
#error "compile with -DGL_VARIANT=GL_PORTABLE, GL_NEON, GL_AVX2 or GL_AVX512 (see gptlab/kernel_build.py)"
#endif

#define AI static inline __attribute__((always_inline))

#if GL_VARIANT == GL_AVX512
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

#elif GL_VARIANT == GL_AVX2
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

#elif GL_VARIANT == GL_NEON
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

#elif GL_VARIANT == GL_PORTABLE
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

#else
#error "unknown GL_VARIANT"
#endif

#if GL_VARIANT != GL_AVX512
AI vf vf_ldexp(vf p, vf n) { /* p 2^n for integral n in [-252, 254], in two steps so neither leaves fp32's range */
    vf half = vf_round(vf_mul(n, vf_set1(0.5f)));
    return vf_mul(vf_mul(p, vf_pow2i(half)), vf_pow2i(vf_sub(n, half)));
}
#endif

/* ---------------------------------------------------------------- every variant */

#ifndef GL_HAVE_SUM4 /* one reduction at a time where no variant-specific tree is written */
AI void vf_sum4(vf a, vf b, vf c, vf d, float out[4]) {
    out[0] = vf_sum(a), out[1] = vf_sum(b), out[2] = vf_sum(c), out[3] = vf_sum(d);
}
AI void vi_sum4(vi a, vi b, vi c, vi d, int32_t out[4]) {
    out[0] = vi_sum(a), out[1] = vi_sum(b), out[2] = vi_sum(c), out[3] = vi_sum(d);
}
#endif

#define VB (4 * VW) /* bytes in a vi */

#if GL_VARIANT == GL_AVX512
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
#elif GL_VARIANT == GL_AVX2
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
#else
/* The first n (< VW) values of p, the rest `fill` (tails: a copy through the stack, never past p + n). */
static inline vf vf_load_part(const float *p, int n, float fill) {
    float t[VW];
    for (int l = 0; l < VW; l++) t[l] = l < n ? p[l] : fill;
    return vf_load(t);
}
static inline vf vf_load_n(const float *p, int n) { return n >= VW ? vf_load(p) : vf_load_part(p, n, 0.0f); }
static inline vf vf_load_bf16_n(const uint16_t *p, int n) {
    if (n >= VW) return vf_load_bf16(p);
    uint16_t t[VW] = {0};
    memcpy(t, p, sizeof(uint16_t) * (size_t)n);
    return vf_load_bf16(t);
}
#endif
#if GL_VARIANT != GL_AVX512
/* The first n values of v to p (a tail through the stack: never written past p + n). */
static inline void vf_store_n(float *p, vf v, int n) {
    if (n >= VW) {
        vf_store(p, v);
        return;
    }
    float t[VW];
    vf_store(t, v);
    memcpy(p, t, sizeof(float) * (size_t)n);
}
#endif
/* n values of an fp32 or (bf16 != 0) bf16 vector. */
static inline vf vf_load_any_n(const void *p, int bf16, int n) {
    return bf16 ? vf_load_bf16_n((const uint16_t *)p, n) : vf_load_n((const float *)p, n);
}

/* e^x: x = n ln2 + r, |r| <= ln2/2, e^r by its Taylor polynomial to r^7 (relative error < 2e-8
 * there), times 2^n. Inputs below -104 give 0, above 88.7 infinity. */
static inline vf vf_exp(vf x) {
    x = vf_max(x, vf_set1(-104.0f));
    vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnma(n, vf_set1(0.693145751953125f), x);
    r = vf_fnma(n, vf_set1(1.428606765330187e-06f), r);
    vf p = vf_set1(1.0f / 5040);
    p = vf_fma(p, r, vf_set1(1.0f / 720));
    p = vf_fma(p, r, vf_set1(1.0f / 120));
    p = vf_fma(p, r, vf_set1(1.0f / 24));
    p = vf_fma(p, r, vf_set1(1.0f / 6));
    p = vf_fma(p, r, vf_set1(0.5f));
    p = vf_fma(p, r, vf_set1(1.0f));
    p = vf_fma(p, r, vf_set1(1.0f));
    return vf_ldexp(p, n);
}

static inline void prefetch(const void *p) { __builtin_prefetch(p, 0, 3); }
/* Into L2 only (locality 1): for data needed later, without evicting what the loop is using from L1. */
static inline void prefetch_l2(const void *p) { __builtin_prefetch(p, 0, 1); }

#endif /* GL_SIMD_H */
