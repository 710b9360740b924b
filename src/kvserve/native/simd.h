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
 * native/__init__.py compiles for the CPU (-march=native), or for one path's baseline when
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
#include <immintrin.h>
#define SIMD_ISA "avx512vnni"
#define VL 16
typedef __m512 vf;
typedef __m512i vi;
typedef __m512i vb;
typedef __m512i vw;

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_abs(vf a) { return _mm512_abs_ps(a); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline float vf_reduce_max(vf a) { return _mm512_reduce_max_ps(a); }
static inline float vf_reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
static inline void vf_sum4(vf a, vf b, vf c, vf d, float *out) {
    out[0] = vf_reduce_add(a), out[1] = vf_reduce_add(b), out[2] = vf_reduce_add(c), out[3] = vf_reduce_add(d);
}
static inline vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline void vf_store_i8(int8_t *p, vf v) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v))); }
static inline vf vf_from_half(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vf_from_bf16(const void *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vf_from_i8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline vf vf_from_nibbles(const uint8_t *p, int high) {
    __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    x = high ? _mm512_srli_epi32(x, 4) : _mm512_and_si512(x, _mm512_set1_epi32(15));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(x, _mm512_set1_epi32(8)));
}
static inline vf vf_from_vi(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf vf_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf vf_pow2i(vf k) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23)); }
static inline vf vf_select_sign(vf s, vf if_negative, vf otherwise) {
    return _mm512_mask_blend_ps(_mm512_movepi32_mask(_mm512_castps_si512(s)), otherwise, if_negative);
}
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vb vb_load(const void *p) { return _mm512_loadu_si512(p); }
static inline vb vb_low_nibbles(vb v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
static inline vb vb_high_nibbles(vb v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
static inline vw vw_widen(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }

/* acc + per lane the 4 products of its u8 codes with the 4 int8 at p, broadcast by the load itself
 * ({1to16}): compilers emit a separate vpbroadcastd, ~5% of the int4 kernel's time (measured). */
static inline vi vi_dot_u8s8(vi acc, vb w, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}
/* acc + per lane the 2 products of its int16 pair with the two int16 at p (broadcast as above). */
static inline vi vi_dot_s16(vi acc, vw w, const int16_t *p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}
static inline vb vb_or(vb a, vb b) { return _mm512_or_si512(a, b); }
static inline vb vb_bits(vb v, int mask, int shift) {
    const vb m = _mm512_and_si512(v, _mm512_set1_epi8((char)mask));
    return shift >= 0 ? _mm512_slli_epi16(m, (unsigned)shift) : _mm512_srli_epi16(m, (unsigned)-shift);
}
#define simd_prefetch(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)

/* ------------------------------------------------------------------------------------------------ */
#elif defined(SIMD_AVX2)
#include <immintrin.h>
#if defined(SIMD_AVXVNNI)
#define SIMD_ISA "avxvnni"
#else
#define SIMD_ISA "avx2"
#endif
#define VL 8
typedef __m256 vf;
typedef __m256i vi;
typedef __m256i vb;
typedef __m256i vw;

static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm256_set1_ps(a); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_abs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline __m128 simd_half_sum(vf a) { return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); }
static inline float vf_reduce_max(vf a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline float vf_reduce_add(vf a) {
    __m128 s = simd_half_sum(a);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* Three horizontal adds and one add for four sums, instead of four reductions of three steps each. */
static inline void vf_sum4(vf a, vf b, vf c, vf d, float *out) {
    const vf t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d)); /* [a b c d | a b c d] halves */
    _mm_storeu_ps(out, simd_half_sum(t));
}
static inline vf vf_round(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline void vf_store_i8(int8_t *p, vf v) {
    const __m256i i = _mm256_cvtps_epi32(v);
    const __m128i s16 = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(s16, s16));
}
static inline vf vf_from_half(const void *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vf_from_bf16(const void *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vf_from_i8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline vf vf_from_nibbles(const uint8_t *p, int high) {
    __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    x = high ? _mm256_srli_epi32(x, 4) : _mm256_and_si256(x, _mm256_set1_epi32(15));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(x, _mm256_set1_epi32(8)));
}
static inline vf vf_from_vi(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vf vf_fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf vf_pow2i(vf k) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23)); }
static inline vf vf_select_sign(vf s, vf if_negative, vf otherwise) { return _mm256_blendv_ps(otherwise, if_negative, s); }
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vb vb_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vb vb_low_nibbles(vb v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
static inline vb vb_high_nibbles(vb v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
static inline vw vw_widen(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256i simd_broadcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
#if defined(SIMD_AVXVNNI)
/* One instruction a product quad, accumulated in int32: nothing to saturate, whatever the codes (the group
 * dots are the generic ones at the end). */
static inline vi vi_dot_u8s8(vi acc, vb w, const int8_t *p) { return _mm256_dpbusd_avx_epi32(acc, w, simd_broadcast4(p)); }
static inline vi vi_dot_s16(vi acc, vw w, const int16_t *p) { return _mm256_dpwssd_avx_epi32(acc, w, simd_broadcast4(p)); }
#else
#define SIMD_OWN_GROUP_DOTS 1
/* vpmaddubsw's int16 pair sums saturate: exact while w <= 127 and |p| <= 127 (at most 32258). */
static inline vi vi_dot_u8s8(vi acc, vb w, const int8_t *p) {
    const __m256i pairs = _mm256_maddubs_epi16(w, simd_broadcast4(p));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
static inline vi vi_dot_s16(vi acc, vw w, const int16_t *p) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, simd_broadcast4(p)));
}
/* The 8 vpmaddubsw results summed as int16 before the one widening vpmaddwd: with codes <= 15 and
 * |a| <= 127 a lane's 16 pair sums total at most 30480 < 32767, so nothing saturates or wraps. */
static inline vi vi_group_dot_u4s8(const vb c[8], const int8_t *a) {
    __m256i s0 = _mm256_maddubs_epi16(c[0], simd_broadcast4(a)), s1 = _mm256_maddubs_epi16(c[1], simd_broadcast4(a + 4));
    for (int j = 2; j < 8; j += 2) {
        s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(c[j], simd_broadcast4(a + 4 * j)));
        s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(c[j + 1], simd_broadcast4(a + 4 * j + 4)));
    }
    return _mm256_madd_epi16(_mm256_add_epi16(s0, s1), _mm256_set1_epi16(1));
}
/* Codes up to 63: two vpmaddubsw results summed as int16 (at most 4 x 63 x 127 = 32004) per widening. */
static inline vi vi_dot4_u6s8(const vb c[4], const int8_t *a) {
    const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(c[0], simd_broadcast4(a)),
                                        _mm256_maddubs_epi16(c[1], simd_broadcast4(a + 4)));
    const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(c[2], simd_broadcast4(a + 8)),
                                        _mm256_maddubs_epi16(c[3], simd_broadcast4(a + 12)));
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
}
#endif
static inline vb vb_or(vb a, vb b) { return _mm256_or_si256(a, b); }
static inline vb vb_bits(vb v, int mask, int shift) {
    const vb m = _mm256_and_si256(v, _mm256_set1_epi8((char)mask));
    return shift >= 0 ? _mm256_slli_epi16(m, shift) : _mm256_srli_epi16(m, -shift);
}
#define simd_prefetch(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)

/* ------------------------------------------------------------------------------------------------ */
#elif defined(SIMD_NEON)
#include <arm_neon.h>
#if defined(__ARM_FEATURE_DOTPROD)
#define SIMD_ISA "neon-dotprod"
#else
#define SIMD_ISA "neon"
#endif
#define VL 4
typedef float32x4_t vf;
typedef int32x4_t vi;
typedef uint8x16_t vb;
typedef int16x8_t vw;

static inline vf vf_zero(void) { return vdupq_n_f32(0.0f); }
static inline vf vf_set1(float a) { return vdupq_n_f32(a); }
static inline vf vf_load(const float *p) { return vld1q_f32(p); }
static inline void vf_store(float *p, vf v) { vst1q_f32(p, v); }
static inline vf vf_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
static inline vf vf_mul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vf_add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vf_sub(vf a, vf b) { return vsubq_f32(a, b); }
static inline vf vf_div(vf a, vf b) { return vdivq_f32(a, b); }
static inline vf vf_abs(vf a) { return vabsq_f32(a); }
static inline vf vf_max(vf a, vf b) { return vmaxq_f32(a, b); }
static inline float vf_reduce_max(vf a) { return vmaxvq_f32(a); }
static inline float vf_reduce_add(vf a) { return vaddvq_f32(a); }
static inline void vf_sum4(vf a, vf b, vf c, vf d, float *out) { vst1q_f32(out, vpaddq_f32(vpaddq_f32(a, b), vpaddq_f32(c, d))); }
static inline vf vf_round(vf a) { return vrndnq_f32(a); }
static inline void vf_store_i8(int8_t *p, vf v) {
    const int16x4_t s16 = vmovn_s32(vcvtnq_s32_f32(v));
    const int8x8_t s8 = vmovn_s16(vcombine_s16(s16, s16));
    vst1_lane_s32((int32_t *)(void *)p, vreinterpret_s32_s8(s8), 0);
}
static inline vf vf_from_half(const void *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p))); }
static inline vf vf_from_bf16(const void *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)p), 16)); }
static inline uint8x8_t simd_load4_u8(const void *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return vreinterpret_u8_u32(vdup_n_u32(w));
}
static inline vf vf_from_i8(const int8_t *p) {
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u8(simd_load4_u8(p))))));
}
static inline vf vf_from_nibbles(const uint8_t *p, int high) {
    uint8x8_t b = simd_load4_u8(p);
    b = high ? vshr_n_u8(b, 4) : vand_u8(b, vdup_n_u8(15));
    const int32x4_t x = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(b))));
    return vcvtq_f32_s32(vsubq_s32(x, vdupq_n_s32(8)));
}
static inline vf vf_from_vi(vi a) { return vcvtq_f32_s32(a); }
static inline vf vf_fnma(vf a, vf b, vf c) { return vfmsq_f32(c, a, b); }
static inline vf vf_pow2i(vf k) { return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(k), vdupq_n_s32(127)), 23)); }
static inline vf vf_select_sign(vf s, vf if_negative, vf otherwise) {
    return vbslq_f32(vcltq_s32(vreinterpretq_s32_f32(s), vdupq_n_s32(0)), if_negative, otherwise);
}
static inline vi vi_zero(void) { return vdupq_n_s32(0); }
static inline vi vi_add(vi a, vi b) { return vaddq_s32(a, b); }
static inline vb vb_load(const void *p) { return vld1q_u8((const uint8_t *)p); }
static inline vb vb_low_nibbles(vb v) { return vandq_u8(v, vdupq_n_u8(0x0F)); }
static inline vb vb_high_nibbles(vb v) { return vshrq_n_u8(v, 4); }
static inline vw vw_widen(const int8_t *p) { return vmovl_s8(vld1_s8(p)); }
static inline int8x16_t simd_broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return vreinterpretq_s8_s32(vdupq_n_s32(v));
}
/* Codes <= 127 read as int8 give the same products. */
static inline vi vi_dot_u8s8(vi acc, vb w, const int8_t *p) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, vreinterpretq_s8_u8(w), simd_broadcast4(p));
#else
    const int8x16_t ws = vreinterpretq_s8_u8(w), a = simd_broadcast4(p);
    const int16x8_t lo = vmull_s8(vget_low_s8(ws), vget_low_s8(a)), hi = vmull_high_s8(ws, a);
    return vpadalq_s16(acc, vpaddq_s16(lo, hi)); /* pair sums <= 32258: exact in int16 */
#endif
}
static inline vi vi_dot_s16(vi acc, vw w, const int16_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    const int16x8_t b = vreinterpretq_s16_s32(vdupq_n_s32(v));
    return vaddq_s32(acc, vpaddq_s32(vmull_s16(vget_low_s16(w), vget_low_s16(b)), vmull_high_s16(w, b)));
}
static inline vb vb_or(vb a, vb b) { return vorrq_u8(a, b); }
static inline vb vb_bits(vb v, int mask, int shift) {
    return vshlq_u8(vandq_u8(v, vdupq_n_u8((uint8_t)mask)), vdupq_n_s8((int8_t)shift));
}
#define simd_prefetch(p) __builtin_prefetch((p), 0, 2)

/* ------------------------------------------------------------------------------------------------ */
#else /* portable C: fixed-size arrays the compiler may vectorize for whatever it targets */
#define SIMD_OWN_GROUP_DOTS 1
#define SIMD_ISA "portable"
#define VL 8
typedef struct { float v[VL]; } vf;
typedef struct { int32_t v[VL]; } vi;
typedef struct { uint8_t v[4 * VL]; } vb;
typedef struct { int16_t v[2 * VL]; } vw;
#define SIMD_MAP(T, expr) { T r; for (int l = 0; l < VL; l++) r.v[l] = (expr); return r; }

static inline vf vf_zero(void) SIMD_MAP(vf, 0.0f)
static inline vf vf_set1(float a) SIMD_MAP(vf, a)
static inline vf vf_load(const float *p) SIMD_MAP(vf, p[l])
static inline void vf_store(float *p, vf v) { memcpy(p, v.v, sizeof v.v); }
static inline vf vf_fma(vf a, vf b, vf c) SIMD_MAP(vf, fmaf(a.v[l], b.v[l], c.v[l]))
static inline vf vf_mul(vf a, vf b) SIMD_MAP(vf, a.v[l] * b.v[l])
static inline vf vf_add(vf a, vf b) SIMD_MAP(vf, a.v[l] + b.v[l])
static inline vf vf_sub(vf a, vf b) SIMD_MAP(vf, a.v[l] - b.v[l])
static inline vf vf_div(vf a, vf b) SIMD_MAP(vf, a.v[l] / b.v[l])
static inline vf vf_abs(vf a) SIMD_MAP(vf, fabsf(a.v[l]))
static inline vf vf_max(vf a, vf b) SIMD_MAP(vf, a.v[l] > b.v[l] ? a.v[l] : b.v[l])
static inline vf vf_round(vf a) SIMD_MAP(vf, nearbyintf(a.v[l]))
static inline vf vf_from_half(const void *p) {
    vf r;
    for (int l = 0; l < VL; l++) {
        uint16_t h;
        memcpy(&h, (const uint8_t *)p + 2 * l, 2);
        r.v[l] = half_to_float(h);
    }
    return r;
}
static inline vf vf_from_bf16(const void *p) {
    vf r;
    for (int l = 0; l < VL; l++) {
        uint16_t h;
        memcpy(&h, (const uint8_t *)p + 2 * l, 2);
        const uint32_t bits = (uint32_t)h << 16;
        memcpy(&r.v[l], &bits, 4);
    }
    return r;
}
static inline vf vf_from_i8(const int8_t *p) SIMD_MAP(vf, (float)p[l])
static inline vf vf_from_nibbles(const uint8_t *p, int high) SIMD_MAP(vf, (float)((high ? p[l] >> 4 : p[l] & 15) - 8))
static inline vf vf_from_vi(vi a) SIMD_MAP(vf, (float)a.v[l])
static inline vf vf_fnma(vf a, vf b, vf c) SIMD_MAP(vf, fmaf(-a.v[l], b.v[l], c.v[l]))
static inline vf vf_pow2i(vf k) {
    vf r;
    for (int l = 0; l < VL; l++) {
        const int32_t bits = ((int32_t)k.v[l] + 127) * (1 << 23);
        memcpy(&r.v[l], &bits, 4);
    }
    return r;
}
static inline vf vf_select_sign(vf s, vf if_negative, vf otherwise) SIMD_MAP(vf, signbit(s.v[l]) ? if_negative.v[l] : otherwise.v[l])
static inline vi vi_zero(void) SIMD_MAP(vi, 0)
static inline vi vi_add(vi a, vi b) SIMD_MAP(vi, a.v[l] + b.v[l])
static inline float vf_reduce_max(vf a) {
    float m = a.v[0];
    for (int l = 1; l < VL; l++) m = a.v[l] > m ? a.v[l] : m;
    return m;
}
static inline float vf_reduce_add(vf a) {
    float s = 0.0f;
    for (int l = 0; l < VL; l++) s += a.v[l];
    return s;
}
static inline void vf_sum4(vf a, vf b, vf c, vf d, float *out) {
    out[0] = vf_reduce_add(a), out[1] = vf_reduce_add(b), out[2] = vf_reduce_add(c), out[3] = vf_reduce_add(d);
}
static inline void vf_store_i8(int8_t *p, vf v) {
    for (int l = 0; l < VL; l++) p[l] = (int8_t)v.v[l];
}
static inline vb vb_load(const void *p) {
    vb r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
static inline vb vb_low_nibbles(vb v) {
    for (int i = 0; i < 4 * VL; i++) v.v[i] &= 0x0F;
    return v;
}
static inline vb vb_high_nibbles(vb v) {
    for (int i = 0; i < 4 * VL; i++) v.v[i] >>= 4;
    return v;
}
static inline vw vw_widen(const int8_t *p) {
    vw r;
    for (int i = 0; i < 2 * VL; i++) r.v[i] = p[i];
    return r;
}
static inline vi vi_dot_u8s8(vi acc, vb w, const int8_t *p) {
    for (int l = 0; l < VL; l++)
        for (int i = 0; i < 4; i++) acc.v[l] += w.v[4 * l + i] * p[i];
    return acc;
}
static inline vi vi_dot_s16(vi acc, vw w, const int16_t *p) {
    for (int l = 0; l < VL; l++) acc.v[l] += w.v[2 * l] * p[0] + w.v[2 * l + 1] * p[1];
    return acc;
}
static inline vi vi_group_dot_u4s8(const vb c[8], const int8_t *a) {
    vi s = vi_zero();
    for (int j = 0; j < 8; j++) s = vi_dot_u8s8(s, c[j], a + 4 * j);
    return s;
}
static inline vb vb_or(vb a, vb b) {
    for (int i = 0; i < 4 * VL; i++) a.v[i] |= b.v[i];
    return a;
}
static inline vb vb_bits(vb v, int mask, int shift) {
    for (int i = 0; i < 4 * VL; i++) {
        const unsigned m = v.v[i] & (unsigned)mask;
        v.v[i] = (uint8_t)(shift >= 0 ? m << shift : m >> -shift);
    }
    return v;
}
static inline vi vi_dot4_u6s8(const vb c[4], const int8_t *a) {
    vi s = vi_zero();
    for (int j = 0; j < 4; j++) s = vi_dot_u8s8(s, c[j], a + 4 * j);
    return s;
}
#undef SIMD_MAP
#define simd_prefetch(p) __builtin_prefetch((p), 0, 2)
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
