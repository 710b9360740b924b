/* simd.h's AVX2 (and AVX-VNNI) path: included by simd.h alone, which documents the primitives and picks the path. */
#ifndef KVSERVE_SIMD_AVX2_H
#define KVSERVE_SIMD_AVX2_H
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
/* The Walsh-Hadamard butterflies of distance 1, 2, .. VL/2 inside one vector, in that order: at each, lane
 * j of a pair (j, j + h) becomes x_j + x_{j+h} and lane j + h x_j - x_{j+h} (hadamard.h). */
static inline vf vf_hadamard_lanes(vf x) {
    vf b = _mm256_permute_ps(x, 0xB1); /* pairs swapped */
    x = _mm256_blend_ps(_mm256_add_ps(x, b), _mm256_sub_ps(b, x), 0xAA);
    b = _mm256_permute_ps(x, 0x4E);
    x = _mm256_blend_ps(_mm256_add_ps(x, b), _mm256_sub_ps(b, x), 0xCC);
    b = _mm256_permute2f128_ps(x, x, 1);
    return _mm256_blend_ps(_mm256_add_ps(x, b), _mm256_sub_ps(b, x), 0xF0);
}
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

#endif
