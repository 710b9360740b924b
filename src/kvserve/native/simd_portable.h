/* simd.h's portable C path: included by simd.h alone, which documents the primitives and picks the path. */
#ifndef KVSERVE_SIMD_PORTABLE_H
#define KVSERVE_SIMD_PORTABLE_H
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
/* The Walsh-Hadamard butterflies of distance 1, 2, .. VL/2 inside one vector, in that order: at each, lane
 * j of a pair (j, j + h) becomes x_j + x_{j+h} and lane j + h x_j - x_{j+h} (hadamard.h). */
static inline vf vf_hadamard_lanes(vf x) {
    for (int h = 1; h < VL; h *= 2)
        for (int i = 0; i < VL; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x.v[j], b = x.v[j + h];
                x.v[j] = a + b;
                x.v[j + h] = a - b;
            }
    return x;
}
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
