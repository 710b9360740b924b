/* y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]): f32 activations against int8 weight rows.
 *
 * For the output head (the largest single tensor of a small model), applied to the rows that need
 * logits. Each activation row is split into two int8 digits as in int4_matmul.c,
 *     u = x * 127 / max|x|,   d1 = round(u),   d2 = round((u - d1) * 254),
 * and each digit row against the weights is one exact integer sum (AVX-512 VNNI: 64 products an
 * instruction). VNNI multiplies unsigned by signed bytes, so the weights are stored offset by 128 (u8)
 * and 128 * (the row's sum of the digit) comes off again:
 *     S = sum_k (w + 128) d - 128 * sum_k d,   y = scale[n] * max|x| / 127 * (S1 + S2 / 254)
 * Every float operation of a row is the same whatever the batch or the thread count: a row's logits
 * are the same bits alone or batched.
 *
 * digits = 1 (the head of ``--weights q4-fast``) is llama.cpp's arithmetic instead: per group of 32
 * inputs one int8 code per activation, q = round(x / a) with a = max|x| / 127 over the group:
 *     y = scale[n] * sum_g a_g * (sum_k (w + 128) q - 128 * sum_k q)     (K a multiple of 32)
 * Half the products of the two digits, plus one float step a group (~1.4x faster at 16 rows); codes
 * per row (one a for the row) were measured too coarse for the head (SmolLM2's KLD 0.0036 -> 0.0123).
 *
 * Packed weights: panels of 16 output rows, each panel K4 / 4 vectors of 64 bytes, byte 4 * lane + i
 * = w[16 * panel + lane, 4 * quad + i] + 128 (K4 = K rounded up to 4, zero weights in the padding).
 * models/linear.py's pack_int8_panels writes it. The activations' digits are stored tile by tile
 * (ROW_TILE rows of a quad, or of a group of 32, side by side), so that the inner loops address a
 * tile's rows from one pointer and keep their accumulators in registers.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define VNNI 1
#endif

#define PANEL 16
#define ROW_TILE 8
#define GROUP 32

/* Two digits of one row (zero in the padding), quad j at d + j * ROW_TILE * 4; offset[0], offset[1] =
 * 128 * the sums of d1 and d2. Returns max|x| / 127. */
static float split_row(const float *x, int K, int K4, int8_t *d1, int8_t *d2, int32_t *offset) {
    float amax = 0.0f;
    for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
    amax = fmaxf(amax, 1e-30f);
    const float inv = 127.0f / amax;
    int32_t sum1 = 0, sum2 = 0;
    for (int k = 0; k < K4; k++) {
        int a = 0, b = 0;
        if (k < K) {
            float u = x[k] * inv, r1 = nearbyintf(u);
            a = (int)r1;
            b = (int)nearbyintf((u - r1) * 254.0f);
        }
        d1[k / 4 * ROW_TILE * 4 + k % 4] = (int8_t)a;
        d2[k / 4 * ROW_TILE * 4 + k % 4] = (int8_t)b;
        sum1 += a;
        sum2 += b;
    }
    offset[0] = 128 * sum1;
    offset[1] = 128 * sum2;
    return amax / 127.0f;
}

/* One digit: codes per group of 32 (q, signed), a per group, 128 * (sum of q) per group; stored tile by
 * tile, group by group (a tile's rows of a group side by side, so one pointer addresses them all): the
 * row's group g at q + g * ROW_TILE * GROUP, gscale[g * ROW_TILE], offset[g * ROW_TILE]. */
static void split_row_groups(const float *x, int K, int8_t *q, float *gscale, int32_t *offset) {
    for (int g = 0; g < K / GROUP; g++) {
        const float *xg = x + g * GROUP;
        float amax = 0.0f;
        for (int i = 0; i < GROUP; i++) amax = fmaxf(amax, fabsf(xg[i]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < GROUP; i++) {
            q[g * ROW_TILE * GROUP + i] = (int8_t)nearbyintf(xg[i] * inv);
            sum += q[g * ROW_TILE * GROUP + i];
        }
        gscale[g * ROW_TILE] = amax / 127.0f;
        offset[g * ROW_TILE] = 128 * sum;
    }
}

#if defined(VNNI)
/* acc + the u8 x s8 products of w with the 4 signed bytes at p in every lane, broadcast by the load
 * itself ({1to16}) rather than by a separate instruction. */
static inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

/* One digit: rows [0, nr) of a tile (its codes, scales and offsets in the tile layout) against one
 * panel of u8 weights, sum_g a_g * (group's integer sum - offset), to out[r][0..16). The row loops are
 * unrolled early so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void panel_group_sums(const uint8_t *panel, int G, const int8_t *q,
                                                                   const float *gscale, const int32_t *offset,
                                                                   float *out, const int nr) {
    __m512 acc[ROW_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512i s[ROW_TILE];
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) s[r] = _mm512_setzero_si512();
        for (int j = 0; j < GROUP / 4; j++) {
            __m512i wj = _mm512_loadu_si512((const void *)(panel + 64 * (g * GROUP / 4 + j)));
#pragma GCC unroll 8
            for (int r = 0; r < nr; r++) s[r] = dpbusd_broadcast(s[r], wj, q + g * ROW_TILE * GROUP + r * GROUP + 4 * j);
        }
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) {
            __m512 t = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[r], _mm512_set1_epi32(offset[g * ROW_TILE + r])));
            acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(gscale[g * ROW_TILE + r]), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(out + r * PANEL, acc[r]);
}

/* Two digits: integer sums (offset included) of rows [0, nr) of a tile against one panel, to S1, S2
 * [ROW_TILE][PANEL]: one chain per row and digit. */
static inline __attribute__((always_inline)) void panel_sums(const uint8_t *panel, int quads, const int8_t *d1,
                                                             const int8_t *d2, int32_t *S1, int32_t *S2,
                                                             const int nr) {
    __m512i s1[ROW_TILE], s2[ROW_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) s1[r] = s2[r] = _mm512_setzero_si512();
    for (int j = 0; j < quads; j++) {
        __m512i wj = _mm512_loadu_si512((const void *)(panel + 64 * j));
        const int8_t *a1 = d1 + j * ROW_TILE * 4, *a2 = d2 + j * ROW_TILE * 4;
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) {
            s1[r] = dpbusd_broadcast(s1[r], wj, a1 + 4 * r);
            s2[r] = dpbusd_broadcast(s2[r], wj, a2 + 4 * r);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) {
        _mm512_storeu_si512((void *)(S1 + r * PANEL), s1[r]);
        _mm512_storeu_si512((void *)(S2 + r * PANEL), s2[r]);
    }
}
#endif

/* One digit (see the top): w holds the weights offset by 128 (u8), K a multiple of 32. */
static int int8_matmul_groups(const float *x, const uint8_t *w, const float *scale, const float *bias, int M, int N,
                              int K, float *y, int num_threads) {
    const int G = K / GROUP, quads = K / 4, panels = (N + PANEL - 1) / PANEL;
    const size_t rows = (size_t)(M + ROW_TILE - 1) / ROW_TILE * ROW_TILE; /* whole tiles */
    /* one allocation: codes, then group scales and offsets (4-byte aligned: K is a multiple of 32) */
    int8_t *q = malloc(rows * K + (sizeof(float) + sizeof(int32_t)) * rows * G);
    if (!q) return -1;
    float *gscale = (float *)(q + rows * K);
    int32_t *offset = (int32_t *)(gscale + rows * G);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            const int64_t tile = m / ROW_TILE, r = m % ROW_TILE;
            split_row_groups(x + (int64_t)m * K, K, q + tile * ROW_TILE * K + r * GROUP,
                             gscale + tile * ROW_TILE * G + r, offset + tile * ROW_TILE * G + r);
        }
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            const uint8_t *panel = w + (int64_t)p * quads * 64;
            const int n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
            for (int m0 = 0; m0 < M; m0 += ROW_TILE) {
                const int nr = M - m0 < ROW_TILE ? M - m0 : ROW_TILE;
                const int8_t *qt = q + (int64_t)m0 * K;
                const float *gt = gscale + (int64_t)m0 * G;
                const int32_t *ot = offset + (int64_t)m0 * G;
                float out[ROW_TILE][PANEL];
#if defined(VNNI)
#define SUMS(n)                                                                                          \
    case n: panel_group_sums(panel, G, qt, gt, ot, out[0], n); break;
                switch (nr) {
                    SUMS(8) SUMS(7) SUMS(6) SUMS(5) SUMS(4) SUMS(3) SUMS(2)
                default: panel_group_sums(panel, G, qt, gt, ot, out[0], 1); break;
                }
#undef SUMS
#else
                for (int r = 0; r < nr; r++)
                    for (int lane = 0; lane < PANEL; lane++) {
                        float a = 0.0f;
                        for (int g = 0; g < G; g++) {
                            int32_t sum = 0;
                            for (int k = g * GROUP; k < (g + 1) * GROUP; k++)
                                sum += panel[64 * (k / 4) + 4 * lane + k % 4] * qt[g * ROW_TILE * GROUP + r * GROUP + k % GROUP];
                            a = fmaf((float)(sum - ot[g * ROW_TILE + r]), gt[g * ROW_TILE + r], a);
                        }
                        out[r][lane] = a;
                    }
#endif
                for (int r = 0; r < nr; r++)
                    for (int i = 0; i < width; i++)
                        y[(int64_t)(m0 + r) * N + n0 + i] = out[r][i] * scale[n0 + i] + (bias ? bias[n0 + i] : 0.0f);
            }
        }
    }
    free(q);
    return 0;
}

/* x [M, K] f32; w packed [ceil(N / 16), K4 / 4, 64] u8 (the weights offset by 128); scale [N]; bias
 * [N] or NULL; y [M, N]; digits 2 or 1. Returns 0, or -1 when the digits could not be allocated. */
int int8_matmul(const float *x, const uint8_t *w, const float *scale, const float *bias, int M, int N, int K,
                float *y, int num_threads, int digits) {
    if (digits == 1) return int8_matmul_groups(x, w, scale, bias, M, N, K, y, num_threads);
    const int K4 = (K + 3) / 4 * 4, quads = K4 / 4, panels = (N + PANEL - 1) / PANEL;
    const size_t rows = (size_t)(M + ROW_TILE - 1) / ROW_TILE * ROW_TILE; /* whole tiles */
    /* one allocation: both digits, then row scales and digit-sum offsets (K4 keeps them 4-byte aligned) */
    int8_t *d1 = malloc(2 * rows * K4 + (sizeof(float) + 2 * sizeof(int32_t)) * (size_t)M);
    if (!d1) return -1;
    int8_t *d2 = d1 + rows * K4;
    float *row_scale = (float *)(d2 + rows * K4);
    int32_t *offset = (int32_t *)(row_scale + M);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            const int64_t at = (int64_t)(m / ROW_TILE) * ROW_TILE * K4 + m % ROW_TILE * 4;
            row_scale[m] = split_row(x + (int64_t)m * K, K, K4, d1 + at, d2 + at, offset + 2 * m);
        }
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            const uint8_t *panel = w + (int64_t)p * quads * 64;
            const int n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
            for (int m0 = 0; m0 < M; m0 += ROW_TILE) {
                const int nr = M - m0 < ROW_TILE ? M - m0 : ROW_TILE;
                const int8_t *x1 = d1 + (int64_t)m0 * K4, *x2 = d2 + (int64_t)m0 * K4;
                int32_t S1[ROW_TILE][PANEL], S2[ROW_TILE][PANEL];
#if defined(VNNI)
#define SUMS(n)                                                                                          \
    case n: panel_sums(panel, quads, x1, x2, S1[0], S2[0], n); break;
                switch (nr) {
                    SUMS(8) SUMS(7) SUMS(6) SUMS(5) SUMS(4) SUMS(3) SUMS(2)
                default: panel_sums(panel, quads, x1, x2, S1[0], S2[0], 1); break;
                }
#undef SUMS
#else
                for (int r = 0; r < nr; r++)
                    for (int lane = 0; lane < PANEL; lane++) {
                        int32_t a = 0, b = 0;
                        for (int k = 0; k < K4; k++) {
                            int wk = panel[64 * (k / 4) + 4 * lane + k % 4], at = k / 4 * ROW_TILE * 4 + 4 * r + k % 4;
                            a += wk * x1[at];
                            b += wk * x2[at];
                        }
                        S1[r][lane] = a;
                        S2[r][lane] = b;
                    }
#endif
                for (int r = 0; r < nr; r++) {
                    float *yr = y + (int64_t)(m0 + r) * N + n0;
                    const int32_t off1 = offset[2 * (m0 + r)], off2 = offset[2 * (m0 + r) + 1];
                    for (int i = 0; i < width; i++) {
                        float t = fmaf((float)(S2[r][i] - off2), 1.0f / 254.0f, (float)(S1[r][i] - off1));
                        yr[i] = t * (row_scale[m0 + r] * scale[n0 + i]) + (bias ? bias[n0 + i] : 0.0f);
                    }
                }
            }
        }
    }
    free(d1);
    return 0;
}
