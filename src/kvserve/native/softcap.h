/* Soft-capped attention scores (Gemma 2): s -> cap * tanh(s / cap), a vector (simd.h's vf) at a time.
 * One elementwise function on every path (explicit FMAs, no lane depends on another), so a score's
 * capped bits do not depend on where it sits in a vector; the ISA paths differ only in the scores they
 * are handed. native/__init__.py hashes this header into every kernel's cache key. */
#ifndef KVSERVE_SOFTCAP_H
#define KVSERVE_SOFTCAP_H
#include "exp_nonpositive.h" /* and simd.h */

/* tanh(x), relative error ~2e-7: below |x| = 0.625 Cephes tanhf's odd polynomial (1 - e^(-2|x|) would
 * cancel there), above it (1 - e) / (1 + e) with e = e^(-2|x|) <= 0.29; the sign put back last. */
static inline vf vf_tanh(vf x) {
    const vf a = vf_abs(x), z = vf_mul(a, a);
    vf p = vf_set1(-5.70498872745e-3f);
    p = vf_fma(p, z, vf_set1(2.06390887954e-2f));
    p = vf_fma(p, z, vf_set1(-5.37397155531e-2f));
    p = vf_fma(p, z, vf_set1(1.33314422036e-1f));
    p = vf_fma(p, z, vf_set1(-3.33332819422e-1f));
    const vf near_zero = vf_fma(vf_mul(p, z), a, a);
    const vf e = vf_exp_nonpositive(vf_mul(a, vf_set1(-2.0f)));
    const vf far = vf_div(vf_sub(vf_set1(1.0f), e), vf_add(vf_set1(1.0f), e));
    const vf t = vf_select_sign(vf_sub(a, vf_set1(0.625f)), near_zero, far);
    return vf_select_sign(x, vf_sub(vf_zero(), t), t);
}

static inline vf vf_softcap(vf s, vf cap, vf inv_cap) { return vf_mul(vf_tanh(vf_mul(s, inv_cap)), cap); }

/* s[0 .. n) -> cap * tanh(s / cap) in place (cap > 0): whole vectors, then the tail through a
 * zero-padded vector. */
static void softcap_scores(float *s, int n, float cap) {
    const vf c = vf_set1(cap), inv = vf_set1(1.0f / cap);
    int i = 0;
    for (; i + VL <= n; i += VL) vf_store(s + i, vf_softcap(vf_load(s + i), c, inv));
    if (i < n) {
        float tail[VL] = {0};
        memcpy(tail, s + i, sizeof(float) * (size_t)(n - i));
        vf_store(tail, vf_softcap(vf_load(tail), c, inv));
        memcpy(s + i, tail, sizeof(float) * (size_t)(n - i));
    }
}

#endif
