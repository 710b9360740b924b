/* y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]): f32 activations against int8 weight rows.
 *
 * For the output head (the largest single tensor of a small model), applied to the rows that need
 * logits. Each activation row is split into two int8 digits as in int4_matmul.c,
 *     u = x * 127 / max|x|,   d1 = round(u),   d2 = round((u - d1) * 254),
 * and each digit row against the weights is one exact integer sum (AVX-512 VNNI: 64 products an
 * instruction). VNNI multiplies unsigned by signed bytes, so the digits go in offset by 128 and
 * 128 * sum_k w[n, k] (precomputed) comes off again:
 *     y = scale[n] * max|x| / 127 * (S1 + S2 / 254)
 * Every float operation of a row is the same whatever the batch or the thread count: a row's logits
 * are the same bits alone or batched.
 *
 * Packed weights: panels of 16 output rows, each panel K4 / 4 vectors of 64 bytes, byte 4 * lane + i
 * = w[16 * panel + lane, 4 * quad + i] (K4 = K rounded up to 4, zero-padded). models/linear.py's
 * pack_int8_panels writes it.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define VNNI 1
#endif

#define PANEL 16
#define ROW_TILE 8

/* Digits of one row, offset by 128 (u8), zero digits in the padding; returns max|x| / 127. */
static float split_row(const float *x, int K, int K4, uint8_t *d1, uint8_t *d2) {
    float amax = 0.0f;
    for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
    amax = fmaxf(amax, 1e-30f);
    const float inv = 127.0f / amax;
    for (int k = 0; k < K; k++) {
        float u = x[k] * inv, r1 = nearbyintf(u);
        d1[k] = (uint8_t)((int)r1 + 128);
        d2[k] = (uint8_t)((int)nearbyintf((u - r1) * 254.0f) + 128);
    }
    for (int k = K; k < K4; k++) d1[k] = d2[k] = 128;
    return amax / 127.0f;
}

#if defined(VNNI)
static inline __m512i broadcast4(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* Integer sums (offset included) of rows [0, nr) against one panel: one chain per row and digit. */
static inline __attribute__((always_inline)) void panel_sums(const int8_t *panel, int quads, const uint8_t *d1,
                                                             const uint8_t *d2, int K4, __m512i *s1, __m512i *s2,
                                                             const int nr) {
    for (int r = 0; r < nr; r++) s1[r] = s2[r] = _mm512_setzero_si512();
    for (int j = 0; j < quads; j++) {
        __m512i wj = _mm512_loadu_si512((const void *)(panel + 64 * j));
        for (int r = 0; r < nr; r++) {
            s1[r] = _mm512_dpbusd_epi32(s1[r], broadcast4(d1 + (int64_t)r * K4 + 4 * j), wj);
            s2[r] = _mm512_dpbusd_epi32(s2[r], broadcast4(d2 + (int64_t)r * K4 + 4 * j), wj);
        }
    }
}
#endif

/* x [M, K] f32; w packed [ceil(N / 16), K4 / 4, 64] int8; scale, rowsum [N] (rowsum padded to a
 * multiple of 16); bias [N] or NULL; y [M, N]. Returns 0, or -1 when the digits could not be allocated. */
int int8_matmul(const float *x, const int8_t *w, const float *scale, const int32_t *rowsum, const float *bias,
                int M, int N, int K, float *y, int num_threads) {
    const int K4 = (K + 3) / 4 * 4, quads = K4 / 4, panels = (N + PANEL - 1) / PANEL;
    uint8_t *d1 = malloc((size_t)M * K4), *d2 = malloc((size_t)M * K4);
    float *row_scale = malloc(sizeof(float) * (size_t)M);
    if (!d1 || !d2 || !row_scale) {
        free(d1);
        free(d2);
        free(row_scale);
        return -1;
    }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++)
            row_scale[m] = split_row(x + (int64_t)m * K, K, K4, d1 + (int64_t)m * K4, d2 + (int64_t)m * K4);
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            const int8_t *panel = w + (int64_t)p * quads * 64;
            const int n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
            for (int m0 = 0; m0 < M; m0 += ROW_TILE) {
                const int nr = M - m0 < ROW_TILE ? M - m0 : ROW_TILE;
                const uint8_t *x1 = d1 + (int64_t)m0 * K4, *x2 = d2 + (int64_t)m0 * K4;
                int32_t S1[ROW_TILE][PANEL], S2[ROW_TILE][PANEL];
#if defined(VNNI)
                __m512i s1[ROW_TILE], s2[ROW_TILE];
                switch (nr) {
                case 8: panel_sums(panel, quads, x1, x2, K4, s1, s2, 8); break;
                case 7: panel_sums(panel, quads, x1, x2, K4, s1, s2, 7); break;
                case 6: panel_sums(panel, quads, x1, x2, K4, s1, s2, 6); break;
                case 5: panel_sums(panel, quads, x1, x2, K4, s1, s2, 5); break;
                case 4: panel_sums(panel, quads, x1, x2, K4, s1, s2, 4); break;
                case 3: panel_sums(panel, quads, x1, x2, K4, s1, s2, 3); break;
                case 2: panel_sums(panel, quads, x1, x2, K4, s1, s2, 2); break;
                default: panel_sums(panel, quads, x1, x2, K4, s1, s2, 1); break;
                }
                for (int r = 0; r < nr; r++) {
                    _mm512_storeu_si512((void *)S1[r], s1[r]);
                    _mm512_storeu_si512((void *)S2[r], s2[r]);
                }
#else
                for (int r = 0; r < nr; r++)
                    for (int lane = 0; lane < PANEL; lane++) {
                        int32_t a = 0, b = 0;
                        for (int k = 0; k < K4; k++) {
                            int wk = panel[64 * (k / 4) + 4 * lane + k % 4];
                            a += wk * x1[(int64_t)r * K4 + k];
                            b += wk * x2[(int64_t)r * K4 + k];
                        }
                        S1[r][lane] = a;
                        S2[r][lane] = b;
                    }
#endif
                for (int r = 0; r < nr; r++) {
                    float *yr = y + (int64_t)(m0 + r) * N + n0;
                    for (int i = 0; i < width; i++) {
                        int32_t offset = 128 * rowsum[n0 + i];
                        float t = fmaf((float)(S2[r][i] - offset), 1.0f / 254.0f, (float)(S1[r][i] - offset));
                        yr[i] = t * (row_scale[m0 + r] * scale[n0 + i]) + (bias ? bias[n0 + i] : 0.0f);
                    }
                }
            }
        }
    }
    free(d1);
    free(d2);
    free(row_scale);
    return 0;
}
