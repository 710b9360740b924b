/* GeGLU's gating (Gemma): out[r, i] = gelu_tanh(gate[r, i]) * up[r, i], gate and up the two halves of a
 * row of the fused gate_up projection's output ([n, 2 * inter], f32), in one pass.
 *
 * gelu_tanh(x) = x / 2 * (1 + tanh(c (x + 0.044715 x^3))), c = sqrt(2 / pi), written as
 * x * sigmoid(2 c (x + 0.044715 x^3)) (1 + tanh(a) = 2 sigmoid(2 a)), with silu_mul.c's sigmoid from
 * e = exp(-|z|): never overflows, and no 1 - tanh cancellation near zero. Both the engine's forward
 * and the one-call decode step gate through this, so a row's result is the same bits on either path
 * and never depends on the batch.
 */
#include <stdint.h>

#include "exp_nonpositive.h" /* and simd.h */
#include "kernels.h"

SIMD_EXPORT_ISA

#define GELU_C2 1.5957691216057308f /* 2 sqrt(2 / pi) */
#define GELU_CUBIC 0.044715f

static inline float gelu_times(float g, float u) {
    const float z = GELU_C2 * (g + GELU_CUBIC * g * g * g);
    const float e = exp_nonpositive(z < 0.0f ? z : -z);
    return g * (z >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e)) * u;
}

static void row(const float *gate, const float *up, int inter, float *out) {
    int i = 0;
    const vf one = vf_set1(1.0f), c2 = vf_set1(GELU_C2), cubic = vf_set1(GELU_CUBIC);
    for (; i + VL <= inter; i += VL) {
        const vf g = vf_load(gate + i);
        const vf z = vf_mul(c2, vf_add(g, vf_mul(vf_mul(vf_mul(cubic, g), g), g)));
        const vf e = vf_exp_nonpositive(vf_sub(vf_zero(), vf_abs(z))); /* e^-|z| */
        const vf inv = vf_div(one, vf_add(one, e));
        const vf sigmoid = vf_select_sign(z, vf_mul(e, inv), inv);
        vf_store(out + i, vf_mul(vf_mul(g, sigmoid), vf_load(up + i)));
    }
    for (; i < inter; i++) out[i] = gelu_times(gate[i], up[i]);
}

/* gate_up [n, 2 * inter] -> out [n, inter]. */
void gelu_tanh_mul(const float *gate_up, int n, int inter, float *out) {
#pragma omp parallel for if ((int64_t)n * inter >= 65536)
    for (int r = 0; r < n; r++)
        row(gate_up + (int64_t)r * 2 * inter, gate_up + (int64_t)r * 2 * inter + inter, inter, out + (int64_t)r * inter);
}
