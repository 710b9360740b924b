/* The rotated codecs' rotation R = diag(s) H / sqrt(D) (kv/codecs.py signed_hadamard: seeded signs s, H
 * the Sylvester-ordered Walsh-Hadamard matrix), applied as the fast transform: log2(D) passes of pairwise
 * sums and differences, D log2(D) additions, instead of the D x D product (D^2 multiply-adds). Every query
 * row of a rotated-key cache goes through it, so the product cost as much as the scores themselves on
 * short contexts: at D = 64 it is 4,096 multiply-adds a row against 128 per key scored, at D = 256
 * (Gemma 3) 65,536. Kernels take the D signs, not the matrix.
 *
 * Each output is the same sequence of additions in the same order on every instruction-set path (the
 * sign flips and the final power-of-two or single scaling are exact or one rounding), so all paths
 * give the same bits. */
#ifndef KVSERVE_HADAMARD_H
#define KVSERVE_HADAMARD_H
#include <string.h>

#include "simd.h"

/* x <- H x in place (unnormalized), D a power of two: the butterflies of distance 1, 2, .., D/2 in that
 * order, those inside a vector by vf_hadamard_lanes, the others a vector at a time. */
static inline void walsh_hadamard(float *x, int D) {
    int h = 1;
    if (D % VL == 0) {
        for (int i = 0; i < D; i += VL) vf_store(x + i, vf_hadamard_lanes(vf_load(x + i)));
        for (h = VL; h < D; h *= 2)
            for (int i = 0; i < D; i += 2 * h)
                for (int j = i; j < i + h; j += VL) {
                    const vf a = vf_load(x + j), b = vf_load(x + j + h);
                    vf_store(x + j, vf_add(a, b));
                    vf_store(x + j + h, vf_sub(a, b));
                }
        return;
    }
    for (; h < D; h *= 2)
        for (int i = 0; i < D; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

/* y = x R = H (s * x) / sqrt(D): a key's rotation before its codes, a query's before its scores. */
static inline void hadamard_rotate(const float *x, const float *signs, int D, float *restrict y) {
    const float scale = 1.0f / __builtin_sqrtf((float)D);
    for (int i = 0; i < D; i++) y[i] = x[i] * signs[i];
    walsh_hadamard(y, D);
    for (int i = 0; i < D; i++) y[i] *= scale;
}

/* y = x R^T = s * (H x) / sqrt(D): the inverse, a sum of rotated values back to the model's basis. */
static inline void hadamard_unrotate(const float *x, const float *signs, int D, float *restrict y) {
    const float scale = 1.0f / __builtin_sqrtf((float)D);
    memcpy(y, x, sizeof(float) * (size_t)D);
    walsh_hadamard(y, D);
    for (int i = 0; i < D; i++) y[i] = y[i] * scale * signs[i];
}

#endif
