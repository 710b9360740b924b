/* SwiGLU's gating: out[r, i] = silu(gate[r, i]) * up[r, i] with gate and up the two halves of a row of
 * the fused gate_up projection's output ([n, 2 * inter], f32), in one pass.
 *
 * Through torch it is a chunk, a silu and a multiply: three dispatches a layer and a temporary the size
 * of the output. silu(x) = x * sigmoid(x), sigmoid from e = exp(-|x|) (never overflows):
 * 1 / (1 + e) for x >= 0, e / (1 + e) below. Elementwise, so a row's result never depends on the batch.
 */
#include <stdint.h>

#include "exp_nonpositive.h" /* and simd.h */
#include "kernels.h"

SIMD_EXPORT_ISA

static inline float silu_times(float g, float u) {
    float e = exp_nonpositive(g < 0.0f ? g : -g);
    return g * (g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e)) * u;
}

static void row(const float *gate, const float *up, int inter, float *out) {
    int i = 0;
    const vf one = vf_set1(1.0f);
    for (; i + VL <= inter; i += VL) {
        const vf g = vf_load(gate + i);
        const vf e = vf_exp_nonpositive(vf_sub(vf_zero(), vf_abs(g))); /* e^-|g| */
        const vf inv = vf_div(one, vf_add(one, e));
        const vf sigmoid = vf_select_sign(g, vf_mul(e, inv), inv);
        vf_store(out + i, vf_mul(vf_mul(g, sigmoid), vf_load(up + i)));
    }
    for (; i < inter; i++) out[i] = silu_times(gate[i], up[i]);
}

/* gate_up [n, 2 * inter] -> out [n, inter]. */
void silu_mul(const float *gate_up, int n, int inter, float *out) {
#pragma omp parallel for if ((int64_t)n * inter >= 65536)
    for (int r = 0; r < n; r++)
        row(gate_up + (int64_t)r * 2 * inter, gate_up + (int64_t)r * 2 * inter + inter, inter, out + (int64_t)r * inter);
}
