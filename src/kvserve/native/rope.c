/* Rotary position embedding, in place on the first `heads` head-vectors of each token's row:
 *
 *   out[j] = x[j] * cos[j] + x[j + D/2] * sin[j]      j <  D/2      (sin's first half holds -sin:
 *   out[j] = x[j] * cos[j] + x[j - D/2] * sin[j]      j >= D/2       models/rope.py folds the sign in)
 *
 * with cos/sin one row of D per token. Each product and the sum are rounded as torch rounds
 * apply_rotary's x * cos + rotated * sin (no fused multiply-add: built with -ffp-contract=off, see
 * native/__init__.py), so both paths give the same bits.
 * At one token torch's version is ~12 us a call in dispatch (plus a split); this is the arithmetic.
 *
 *   x: [tokens][token_stride floats], head h of token t at x + t * token_stride + h * D
 */
#include <stdint.h>

#include "kernels.h"

static void rotate(float *restrict v, const float *restrict c, const float *restrict s, int D) {
    const int half = D / 2;
    float out[D];
    for (int j = 0; j < half; j++) out[j] = v[j] * c[j] + v[j + half] * s[j];
    for (int j = half; j < D; j++) out[j] = v[j] * c[j] + v[j - half] * s[j];
    for (int j = 0; j < D; j++) v[j] = out[j];
}

void rope_in_place(float *x, int tokens, int heads, int64_t token_stride, int D, const float *cos,
                   const float *sin) {
#pragma omp parallel for if (tokens >= 64)
    for (int t = 0; t < tokens; t++)
        for (int h = 0; h < heads; h++)
            rotate(x + (int64_t)t * token_stride + (int64_t)h * D, cos + (int64_t)t * D, sin + (int64_t)t * D, D);
}
