/* SwiGLU's gating: out[r, i] = silu(gate[r, i]) * up[r, i] with gate and up the two halves of a row of
 * the fused gate_up projection's output ([n, 2 * inter], f32), in one pass.
 *
 * Through torch it is a chunk, a silu and a multiply: three dispatches a layer and a temporary the size
 * of the output. silu(x) = x * sigmoid(x), sigmoid from e = exp(-|x|) (never overflows):
 * 1 / (1 + e) for x >= 0, e / (1 + e) below. Elementwise, so a row's result never depends on the batch.
 */
#include <stdint.h>

#include "exp_nonpositive.h"

static inline float silu_times(float g, float u) {
    float e = exp_nonpositive(g < 0.0f ? g : -g);
    return g * (g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e)) * u;
}

static void row(const float *gate, const float *up, int inter, float *out) {
    int i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= inter; i += 16) {
        __m512 g = _mm512_loadu_ps(gate + i);
        __m512 e = exp_nonpositive_v(_mm512_min_ps(g, _mm512_sub_ps(_mm512_setzero_ps(), g))); /* e^-|g| */
        __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
        __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        __m512 sigmoid = _mm512_mask_mul_ps(inv, negative, e, inv);
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), _mm512_loadu_ps(up + i)));
    }
#endif
    for (; i < inter; i++) out[i] = silu_times(gate[i], up[i]);
}

/* gate_up [n, 2 * inter] -> out [n, inter]. */
void silu_mul(const float *gate_up, int n, int inter, float *out) {
#pragma omp parallel for if ((int64_t)n * inter >= 65536)
    for (int r = 0; r < n; r++)
        row(gate_up + (int64_t)r * 2 * inter, gate_up + (int64_t)r * 2 * inter + inter, inter, out + (int64_t)r * inter);
}
