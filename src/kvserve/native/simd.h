/* Vector primitives, one implementation per instruction set; the kernels are written once against them
 * (ggml-cpu's model), so adding an instruction set means filling in this file.
 *
 *   path         chosen when the build targets           VL   integer group dot
 *   avx512vnni   AVX-512 F/BW/VL + VNNI                  16   vpdpbusd / vpdpwssd
 *   avxvnni      AVX2 + AVX-VNNI (x86-64-v3 + avxvnni)    8   vpdpbusd / vpdpwssd (256-bit, VEX)
 *   avx2         AVX2 + FMA + F16C (x86-64-v3)            8   vpmaddubsw + vpmaddwd
 *   neon         aarch64 (sdot with +dotprod)             4   sdot, else smull + pairwise adds
 *   portable     anything else, or -DKVSERVE_PORTABLE     8   C loops
 *
 * Each path's definitions live in simd_<path>.h (avx512, avx2, neon, portable), included below and nowhere
 * else. native/__init__.py compiles for the CPU (-march=native), or for one path's baseline when
 * KVSERVE_ISA names it. Every path computes the same integer sums, and the kernels order their float
 * steps the same way in every lane (explicit fused multiply-adds, no reductions of inexact values),
 * so an integer kernel gives the same bits on every path (tests compare them).
 *
 * Types: vf = VL floats, vi = VL int32, vb = VL lanes of 4 bytes, vw = VL lanes of 2 int16.
 * vf_fnma(a, b, c) = c - a b (fused); vf_pow2i(k) = 2^k for integral k in [-126, 127];
 * vf_select_sign(s, x, y) = x where s's sign bit is set, else y; vf_sum4(a, b, c, d, out): out[0..3] = the
 * lane sums of a, b, c, d (each in a fixed order of its own); vf_from_half / vf_from_bf16 / vf_from_i8: VL
 * stored f16, bf16 or int8 values as f32; vf_from_nibbles(p, high): the low (high = 0) or high nibbles of VL
 * bytes, less 8.
 */
#ifndef KVSERVE_SIMD_H
#define KVSERVE_SIMD_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

#if defined(KVSERVE_PORTABLE)
#define SIMD_PORTABLE 1
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define SIMD_AVX512VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SIMD_AVX2 1
#if defined(__AVXVNNI__)
#define SIMD_AVXVNNI 1 /* AVX2's path with the 256-bit VEX vpdpbusd / vpdpwssd (Alder Lake, Zen 4 and later) */
#endif
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define SIMD_NEON 1
#else
#define SIMD_PORTABLE 1
#endif

/* ------------------------------------------------------------------------------------------------ */
#if defined(SIMD_AVX512VNNI)
#include "simd_avx512.h"
#elif defined(SIMD_AVX2)
#include "simd_avx2.h"
#elif defined(SIMD_NEON)
#include "simd_neon.h"
#else
#include "simd_portable.h"
#endif

#if !defined(SIMD_OWN_GROUP_DOTS)
/* Where vi_dot_u8s8 accumulates in int32 (VNNI, sdot, smull + pairwise adds): per lane the sum of 32 (16)
 * products of its codes c[j] (4 a lane each) with the int8 a[4 j .. 4 j + 3], in two dependency chains
 * (the split of an integer sum is exact). */
static inline vi vi_group_dot_u4s8(const vb c[8], const int8_t *a) {
    vi s0 = vi_zero(), s1 = vi_zero();
    for (int j = 0; j < 8; j += 2) {
        s0 = vi_dot_u8s8(s0, c[j], a + 4 * j);
        s1 = vi_dot_u8s8(s1, c[j + 1], a + 4 * j + 4);
    }
    return vi_add(s0, s1);
}
static inline vi vi_dot4_u6s8(const vb c[4], const int8_t *a) {
    return vi_add(vi_dot_u8s8(vi_dot_u8s8(vi_zero(), c[0], a), c[2], a + 8),
                  vi_dot_u8s8(vi_dot_u8s8(vi_zero(), c[1], a + 4), c[3], a + 12));
}
#endif

static inline vi vi_group_dot_u6s8(const vb c[8], const int8_t *a) {
    return vi_add(vi_dot4_u6s8(c, a), vi_dot4_u6s8(c + 4, a + 16));
}

/* Which path this file was built for (tests check it against the path they asked for). Weak: the
 * kernels linked into one program (tests/native/arm_driver.c) share it. */
#define SIMD_EXPORT_ISA __attribute__((weak)) const char *simd_isa(void) { return SIMD_ISA; }

#endif