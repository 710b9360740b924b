/* simd.h's NEON path: included by simd.h alone, which documents the primitives and picks the path. */
#ifndef KVSERVE_SIMD_NEON_H
#define KVSERVE_SIMD_NEON_H
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
/* The Walsh-Hadamard butterflies of distance 1, 2, .. VL/2 inside one vector, in that order: at each, lane
 * j of a pair (j, j + h) becomes x_j + x_{j+h} and lane j + h x_j - x_{j+h} (hadamard.h). */
static inline vf vf_hadamard_lanes(vf x) {
    static const uint32_t odd[4] = {0, ~0u, 0, ~0u}, high[4] = {0, 0, ~0u, ~0u};
    vf b = vrev64q_f32(x); /* pairs swapped */
    x = vbslq_f32(vld1q_u32(odd), vsubq_f32(b, x), vaddq_f32(x, b));
    b = vextq_f32(x, x, 2);
    return vbslq_f32(vld1q_u32(high), vsubq_f32(b, x), vaddq_f32(x, b));
}
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

#endif
