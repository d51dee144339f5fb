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
 *
 * Each set is a header of its own (simd_avx512.h, simd_avx2.h, simd_neon.h, simd_portable.h),
 * included below; what follows them is written once in their primitives, with fallbacks a set
 * may replace by a faster one of its own (GL_HAVE_LDEXP, GL_HAVE_SUM4, GL_HAVE_TAIL_LOADS,
 * GL_HAVE_TAIL_STORE).
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
#include "simd_avx512.h"
#elif GL_VARIANT == GL_AVX2
#include "simd_avx2.h"
#elif GL_VARIANT == GL_NEON
#include "simd_neon.h"
#elif GL_VARIANT == GL_PORTABLE
#include "simd_portable.h"
#else
#error "unknown GL_VARIANT"
#endif

#ifndef GL_HAVE_LDEXP
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

#ifndef GL_HAVE_TAIL_LOADS
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
#ifndef GL_HAVE_TAIL_STORE
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
