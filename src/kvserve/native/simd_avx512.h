/* simd.h's AVX-512 VNNI path: included by simd.h alone, which documents the primitives and picks the path. */
#ifndef KVSERVE_SIMD_AVX512_H
#define KVSERVE_SIMD_AVX512_H
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
/* The Walsh-Hadamard butterflies of distance 1, 2, .. VL/2 inside one vector, in that order: at each, lane
 * j of a pair (j, j + h) becomes x_j + x_{j+h} and lane j + h x_j - x_{j+h} (hadamard.h). */
static inline vf vf_hadamard_lanes(vf x) {
    vf b = _mm512_permute_ps(x, 0xB1); /* pairs swapped */
    x = _mm512_mask_blend_ps(0xAAAA, _mm512_add_ps(x, b), _mm512_sub_ps(b, x));
    b = _mm512_permute_ps(x, 0x4E);
    x = _mm512_mask_blend_ps(0xCCCC, _mm512_add_ps(x, b), _mm512_sub_ps(b, x));
    b = _mm512_shuffle_f32x4(x, x, 0xB1); /* 128-bit lanes 1 0 3 2 */
    x = _mm512_mask_blend_ps(0xF0F0, _mm512_add_ps(x, b), _mm512_sub_ps(b, x));
    b = _mm512_shuffle_f32x4(x, x, 0x4E); /* 256-bit halves swapped */
    return _mm512_mask_blend_ps(0xFF00, _mm512_add_ps(x, b), _mm512_sub_ps(b, x));
}
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

#endif
