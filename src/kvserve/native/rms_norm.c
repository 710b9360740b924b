/* RMSNorm over the rows of a [n, hidden] f32 tensor, and the residual add fused in front of it.
 *
 *   rms_norm:      out = x / sqrt(mean(x^2) + eps) * w
 *   add_rms_norm:  x += h (h f32 or bf16), then out = rms_norm(x)       (one pass over x instead of three)
 *   rms_norm_heads: in place on the first `heads` head vectors of each token's row (q/k norms: Qwen3,
 *                   Gemma 3), the same arithmetic per head vector as rms_norm's per row
 *
 * At one token per step torch's CPU rms_norm costs ~40 us per call in dispatch and temporaries
 * (61 calls a decode step for SmolLM2); these take ~1 us of arithmetic. Rows are independent and
 * summed in a fixed order, so a row's result never depends on the batch.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

/* Not inlined: every caller (whole rows, heads in place) runs these same instructions, so a vector of
 * values is normalized to the same bits whichever entry point it came through. */
static __attribute__((noinline)) void norm_row(const float *restrict x, const float *restrict w, float eps,
                                               int hidden, float *restrict out) {
    float sum = 0.0f;
    for (int i = 0; i < hidden; i++) sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
    for (int i = 0; i < hidden; i++) out[i] = x[i] * inv * w[i];
}

void rms_norm(const float *x, const float *w, float eps, int n, int hidden, float *out) {
#pragma omp parallel for if (n >= 64)
    for (int r = 0; r < n; r++) norm_row(x + (int64_t)r * hidden, w, eps, hidden, out + (int64_t)r * hidden);
}

/* h_is_bf16: h holds bf16 bit patterns (a 4-bit projection's output) instead of f32. */
void add_rms_norm(float *x, const void *h, int h_is_bf16, const float *w, float eps, int n, int hidden, float *out) {
#pragma omp parallel for if (n >= 64)
    for (int r = 0; r < n; r++) {
        float *xr = x + (int64_t)r * hidden;
        if (h_is_bf16) {
            const uint16_t *hr = (const uint16_t *)h + (int64_t)r * hidden;
            for (int i = 0; i < hidden; i++) {
                union { uint32_t u; float f; } v = {(uint32_t)hr[i] << 16};
                xr[i] += v.f;
            }
        } else {
            const float *hr = (const float *)h + (int64_t)r * hidden;
            for (int i = 0; i < hidden; i++) xr[i] += hr[i];
        }
        norm_row(xr, w, eps, hidden, out + (int64_t)r * hidden);
    }
}

/* x: [tokens][token_stride floats], head h of token t at x + t * token_stride + h * D (rope.c's layout). */
void rms_norm_heads(float *x, int tokens, int heads, int64_t token_stride, int D, const float *w, float eps) {
#pragma omp parallel for if (tokens >= 64)
    for (int t = 0; t < tokens; t++) {
        float row[D]; /* norm_row reads its input twice: normalized from a copy, written in place */
        for (int h = 0; h < heads; h++) {
            float *v = x + (int64_t)t * token_stride + (int64_t)h * D;
            for (int i = 0; i < D; i++) row[i] = v[i];
            norm_row(row, w, eps, D, v);
        }
    }
}
