/* y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]: f32 activations against int8 weight rows.
 *
 * For the output head, applied to the few rows that need logits: the weights (the largest single
 * tensor of a small model) stream through once for every row of the batch, each int8 vector
 * widened to f32 once and used by up to four rows. Every row accumulates the same way (16 lanes
 * in k order, then one fixed reduction), whatever the batch: a row's logits are the same bits alone
 * or batched. Output rows are split across threads.
 */
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define ROW_TILE 4

/* rows x[0..nr) against weight row w; nr <= ROW_TILE. */
static inline __attribute__((always_inline)) void dot_rows(const float *x, int64_t x_stride, const int8_t *w, int K,
                                                           float *dots, const int nr) {
#if defined(__AVX512F__)
    if (K % 16 == 0) {
        __m512 acc[ROW_TILE];
        for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
        for (int k = 0; k < K; k += 16) {
            __m512 wk = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + k))));
            for (int r = 0; r < nr; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * x_stride + k), wk, acc[r]);
        }
        for (int r = 0; r < nr; r++) dots[r] = _mm512_reduce_add_ps(acc[r]);
        return;
    }
#endif
    for (int r = 0; r < nr; r++) {
        float lanes[16] = {0};
        for (int k = 0; k < K; k++) lanes[k % 16] += x[r * x_stride + k] * (float)w[k];
        float s = 0.0f;
        for (int l = 0; l < 16; l++) s += lanes[l];
        dots[r] = s;
    }
}

void int8_matmul(const float *x, const int8_t *w, const float *scale, const float *bias, int M, int N, int K,
                 float *y, int num_threads) {
#pragma omp parallel for schedule(static, 64) num_threads(num_threads)
    for (int n = 0; n < N; n++) {
        const int8_t *wn = w + (int64_t)n * K;
        float dots[ROW_TILE];
        for (int m = 0; m < M; m += ROW_TILE) {
            int nr = M - m < ROW_TILE ? M - m : ROW_TILE;
            const float *xm = x + (int64_t)m * K;
            switch (nr) {
            case 4: dot_rows(xm, K, wn, K, dots, 4); break;
            case 3: dot_rows(xm, K, wn, K, dots, 3); break;
            case 2: dot_rows(xm, K, wn, K, dots, 2); break;
            default: dot_rows(xm, K, wn, K, dots, 1); break;
            }
            for (int r = 0; r < nr; r++)
                y[(int64_t)(m + r) * N + n] = dots[r] * scale[n] + (bias ? bias[n] : 0.0f);
        }
    }
}
