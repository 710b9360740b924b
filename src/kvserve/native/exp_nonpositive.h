/* e^x for x <= 0, scalar and a vector (simd.h's vf) at a time (Cephes expf: range reduction by ln 2, degree-6
 * polynomial), branch-free so that loops over it vectorize. Shared by the kernels that need it:
 * native/__init__.py hashes this header into every kernel's cache key. */
#ifndef KVSERVE_EXP_NONPOSITIVE_H
#define KVSERVE_EXP_NONPOSITIVE_H
#include <stdint.h>
#include <string.h>

#include "simd.h"

static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float k = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, 4);
    return p * two_k;
}

/* The same steps on a vector (simd.h). */
static inline vf vf_exp_nonpositive(vf x) {
    x = vf_max(x, vf_set1(-87.0f));
    const vf k = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnma(k, vf_set1(0.693359375f), x);
    r = vf_fnma(k, vf_set1(-2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fma(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fma(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fma(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fma(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fma(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fma(vf_mul(p, r), r, vf_add(r, vf_set1(1.0f)));
    return vf_mul(p, vf_pow2i(k));
}

#endif
