/* The library's identity and the CPU's: ABI, variant, the features cpuid reports, scratch
 * memory, huge pages, the OpenMP threads. */
#include <sys/mman.h>

#include "common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

#ifndef GL_SOURCE_DIGEST
#define GL_SOURCE_DIGEST "unknown"
#endif

int gl_abi(void) { return GL_ABI; }

/* The variant this library was compiled as (gptlab/kernel_build.py names them). */
const char *gl_variant(void) {
#if GL_VARIANT == GL_AVX512
    return "avx512";
#elif GL_VARIANT == GL_AVX2 && defined(__AVX512VNNI__)
    return "avx512-256";
#elif GL_VARIANT == GL_AVX2 && defined(__AVXVNNI__)
    return "avx2-vnni";
#elif GL_VARIANT == GL_AVX2 && defined(GL_EMULATE_AVXVNNI)
    return "avx2-vnni-emulated"; /* the C check's build only */
#elif GL_VARIANT == GL_AVX2
    return "avx2";
#elif GL_VARIANT == GL_NEON && defined(__ARM_FEATURE_DOTPROD)
    return "neon-dotprod";
#elif GL_VARIANT == GL_NEON
    return "neon";
#else
    return "portable";
#endif
}

/* The SHA-256 prefix of the sources it was compiled from: kernels.py rebuilds a stale library. */
const char *gl_source_digest(void) { return GL_SOURCE_DIGEST; }

/* What the CPU and the operating system support, as bits (kernels.py FEATURES names them):
 * 0 AVX2, 1 FMA, 2 F16C, 3 AVX-512 F, 4 BW, 5 VL, 6 DQ, 7 AVX-512 VNNI, 8 AVX-VNNI, 11 AVX512-BF16,
 * 12 AMX-BF16 (with the tile state the OS saves);
 * on aarch64 9 Advanced SIMD (every aarch64 CPU), 10 its dot products (sdot, Armv8.2's DotProd).
 * On x86 from cpuid directly, with XGETBV for the registers' state the OS saves (AVX needs XMM and
 * YMM state, AVX-512 also the opmask and ZMM state), so any compiler and OS read it the same way;
 * on aarch64 Linux from the kernel's hardware capabilities (HWCAP_ASIMDDP is bit 20). */
int gl_cpu_features(void) {
    int bits = 0;
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx) return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    const int ymm_state = (lo & 0x6) == 0x6, zmm_state = (lo & 0xe6) == 0xe6;
    const int tile_state = (lo & 0x60000) == 0x60000; /* XTILECFG and XTILEDATA */
    if (!ymm_state || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    bits |= ((b >> 5) & 1) << 0 | fma << 1 | f16c << 2 | (tile_state ? ((d >> 22) & 1) << 12 : 0);
    if (zmm_state)
        bits |= ((b >> 16) & 1) << 3 | ((b >> 30) & 1) << 4 | ((b >> 31) & 1) << 5 | ((b >> 17) & 1) << 6 |
                ((c >> 11) & 1) << 7;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) bits |= ((a >> 4) & 1) << 8 | (zmm_state ? ((a >> 5) & 1) << 11 : 0);
#elif defined(__aarch64__)
    bits |= 1 << 9;
#if defined(__linux__)
    bits |= (int)((getauxval(AT_HWCAP) >> 20) & 1) << 10;
#endif
#endif
    return bits;
}

/* Whether cpuid's vendor string is AMD's ("AuthenticAMD"). */
static int cpu_is_amd(void) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    return b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163; /* "Auth" "enti" "cAMD" */
#else
    return 0;
#endif
}

/* Weight rows per decoding block (common.h): ROWS for AVX-512 on a CPU that is not AMD's (tuned on
 * an Intel Xeon), else 1. */
int gl_default_decode_rows(void) { return GL_VARIANT == GL_AVX512 && !cpu_is_amd() ? ROWS : 1; }

int gl_decode_rows_ = 1;
__attribute__((constructor)) static void choose_decode_rows(void) { gl_decode_rows_ = gl_default_decode_rows(); }

/* Set the rows per decoding block: 1 or ROWS, or 0 for this CPU's default; returns the rows now
 * in use, or -1 (unchanged) for another value. For tests and benchmarks; not thread-safe against
 * running kernels. */
int gl_set_decode_rows(int rows) {
    if (rows == 0) rows = gl_default_decode_rows();
    if (rows != 1 && rows != ROWS) return -1;
    gl_decode_rows_ = rows;
    return rows;
}

int gl_decode_rows(void) { return gl_decode_rows_; }

/* Whether decoding prefetches its weights non-temporally by default (common.h, prefetch_stream):
 * on AMD CPUs, where it was measured faster (Zen 5, 2026-12-04: +2-14% at AVX2, +3-6% at
 * AVX-512). Not on Intel ones: on the Intel Xeon 6/207, 2026-12-06, `gptlab bench variants
 * --variants avx2:nta,avx2:t0,...`, GPT-2 at batch 1, medians of 3 rounds, prefetching into every
 * cache level decoded fp32 2.2x, bf16 1.9-2.1x, int8 3.0-3.6x and int4 1.0-1.3x faster on every
 * variant (avx2, avx2-vnni, avx512-256, avx512), whatever the rows per block (avx2, rows 1
 * against 4: fp32 58 / 60, int8 469 / 473 tok/s). Elsewhere (ARM) not measured: the ordinary hint. */
int gl_default_prefetch_nta(void) { return cpu_is_amd(); }

int gl_prefetch_nta_ = 0;
__attribute__((constructor)) static void choose_prefetch(void) { gl_prefetch_nta_ = gl_default_prefetch_nta(); }

/* Set decoding's prefetch hint: 1 non-temporal, 0 temporal, -1 this CPU's default
 * (gl_default_prefetch_nta); returns the hint now in use, or -1 (unchanged) for another value.
 * For tests and benchmarks, as gl_set_decode_rows. */
int gl_set_prefetch_nta(int nta) {
    if (nta < -1 || nta > 1) return -1;
    gl_prefetch_nta_ = nta < 0 ? gl_default_prefetch_nta() : nta;
    return prefetch_nta();
}

int gl_prefetch_nta(void) { return prefetch_nta(); }

void *gl_scratch(size_t nbytes) {
    static __thread void *buf = NULL;
    static __thread size_t cap = 0;
    if (nbytes > cap) {
        free(buf);
        cap = (nbytes + 4095) & ~(size_t)4095;
        buf = aligned_alloc(64, cap);
        if (!buf) cap = 0;
    }
    return buf;
}

/* Back [p, p + n) by 2 MiB pages where the kernel allows (Linux 6.1+ MADV_COLLAPSE copies the
 * pages now; older kernels only mark the range). Streaming weights through 4 KiB pages costs a TLB
 * miss per 4 KiB: huge pages measured +6% fp32 decoding bandwidth (30.5 -> 32.4 GB/s, Intel Xeon).
 * Returns 0, or -1 when the range holds no whole huge page or the kernel said no. */
int gl_huge_pages(void *p, size_t n) {
#if defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t start = ((uintptr_t)p + huge - 1) & ~(huge - 1), end = ((uintptr_t)p + n) & ~(huge - 1);
    if (end <= start) return -1;
    if (madvise((void *)start, end - start, MADV_HUGEPAGE) != 0) return -1;
    return madvise((void *)start, end - start, MADV_COLLAPSE) == 0 ? 0 : -1;
#else
    (void)p, (void)n;
    return -1;
#endif
}

/* Let the calling thread's OpenMP helper threads exit (OpenMP 5.0's pause; in libgomp, the pool of
 * the calling thread only). libgomp spins between parallel regions only while it manages no more
 * threads than there are CPUs: once a second thread has computed, every team sleeps and wakes at
 * each region's barrier instead (kernels.release_threads). Returns 0, or nonzero where the runtime
 * did not. */
int gl_release_threads(void) { return omp_pause_resource_all(omp_pause_soft); }
