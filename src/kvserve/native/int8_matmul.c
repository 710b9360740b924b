/* y[m, n] = sum_g d[n, g] * sum_{k in g} x[m, k] * w[n, k] (+ bias[n]): f32 activations against int8
 * weights with an f16 scale per group of 32 inputs (GGUF Q8_0's grid, which SmolLM2's output head
 * is: held exactly).
 *
 * For the output head (the largest single tensor of a small model), applied to the rows that need
 * logits. Each activation is one int16 code, c = round(x * 32258 / max|x|) over its row (32258 =
 * 127 * 254: the two int8 digits d1 + d2 / 254 of int4_matmul.c, joined). A group's dot product is one
 * exact integer sum of s16 x s16 products (AVX-512 VNNI vpdpwssd, 32 products an instruction, the int8
 * weights widened as they load), and per group, per output:
 *     acc = fma(d[n, g], S_g, acc),   y = acc * max|x| / 32258 (+ bias)
 * So beyond the activations' codes (~1e-5 of the output) only the float steps round (a group sum's
 * conversion, the f32 accumulation): SmolLM2's KLD against f32 weights is ~1e-6 (with one weight
 * scale per row, which re-rounded the Q8_0 grid: 0.0016).
 * Every float operation of a row is the same whatever the batch or the thread count: a row's logits
 * are the same bits alone or batched.
 *
 * Packed weights: panels of 16 output rows; per panel, its groups in order, 544 bytes each: the 16
 * outputs' f16 scales, then 16 pairs of 32 bytes, byte 2 * lane + i = w[16 * panel + lane,
 * 32 * g + 2 * pair + i] (vpdpwssd's operand once widened). K is rounded up to 32 with zero weights.
 * A panel is read in address order and no 32-byte load crosses a cache line (scales after each
 * group's codes measured 9% slower decode steps, at the panel's end 40-90% slower head calls).
 * models/linear.py's pack_int8_groups writes it. The activations' codes are stored tile by tile
 * (ROW_TILE rows' pairs side by side), so that the inner loop addresses a tile's rows from one pointer
 * and keeps their accumulators in registers.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define VNNI 1
#endif

#define PANEL 16
#define ROW_TILE 8
#define GROUP 32
#define BLOCK_BYTES 544 /* a panel's group: 32 bytes of scales, 512 of codes (16 outputs x 32 inputs) */
#define RADIX 32258.0f  /* 127 * 254 */

/* The code of input g * 32 + i of output lane in a panel's group block (see the top). */
static inline int8_t code_at(const uint8_t *blk, int lane, int i) {
    return (int8_t)blk[32 + 32 * (i / 2) + 2 * lane + i % 2];
}

/* The int16 codes of one row (zero in the padding up to Kp), pair j at c + 2 * j * ROW_TILE. Returns
 * max|x| / 32258. */
static float code_row(const float *x, int K, int Kp, int16_t *c) {
    float amax = 0.0f;
    for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
    amax = fmaxf(amax, 1e-30f);
    const float inv = RADIX / amax;
    for (int k = 0; k < Kp; k++) c[k / 2 * 2 * ROW_TILE + k % 2] = k < K ? (int16_t)nearbyintf(x[k] * inv) : 0;
    return amax / RADIX;
}

#if defined(VNNI)
/* acc + the s16 x s16 products of w with the two int16 at p in every lane, broadcast by the load itself
 * ({1to16}) rather than by a separate instruction. */
static inline __m512i dpwssd_broadcast(__m512i acc, __m512i w, const int16_t *p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

/* Rows [0, nr) of a tile against one panel, sum_g d_g * S_g to out[r][0..16). Two integer chains a row
 * (even and odd pairs: the split of an integer sum is exact) so that one row is not bound by the
 * instruction's latency. */
static inline __attribute__((always_inline)) void panel_tile(const uint8_t *panel, int G, const int16_t *c,
                                                             float *out, const int nr) {
    __m512 acc[ROW_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = panel + (int64_t)g * BLOCK_BYTES;
        const int16_t *cg = c + (int64_t)g * GROUP * ROW_TILE;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        __m512i sa[ROW_TILE], sb[ROW_TILE];
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) sa[r] = sb[r] = _mm512_setzero_si512();
        for (int j = 0; j < GROUP / 2; j += 2) {
            const __m512i wa = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * j)));
            const __m512i wb = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 64 + 32 * j)));
#pragma GCC unroll 8
            for (int r = 0; r < nr; r++) {
                sa[r] = dpwssd_broadcast(sa[r], wa, cg + 2 * (j * ROW_TILE + r));
                sb[r] = dpwssd_broadcast(sb[r], wb, cg + 2 * ((j + 1) * ROW_TILE + r));
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) acc[r] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_add_epi32(sa[r], sb[r])), acc[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(out + r * PANEL, acc[r]);
}

#else
/* The same arithmetic one output at a time (machines without AVX-512 VNNI): row r of a tile. */
static void panel_row_scalar(const uint8_t *panel, int G, const int16_t *c, int r, float *out) {
    for (int lane = 0; lane < PANEL; lane++) {
        float acc = 0.0f;
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = panel + (int64_t)g * BLOCK_BYTES;
            uint16_t h;
            memcpy(&h, blk + 2 * lane, 2);
            int32_t s = 0;
            for (int i = 0; i < GROUP; i++)
                s += code_at(blk, lane, i) * c[((g * GROUP + i) / 2 * ROW_TILE + r) * 2 + i % 2];
            acc = fmaf(half_to_float(h), (float)s, acc);
        }
        out[lane] = acc;
    }
}
#endif

/* x [M, K] f32; w packed [ceil(N / 16), ceil(K / 32), 544] (see the top); bias [N] or NULL; y [M, N].
 * Returns 0, or -1 when the codes could not be allocated. */
int int8_matmul(const float *x, const uint8_t *w, const float *bias, int M, int N, int K, float *y,
                int num_threads) {
    const int Kp = (K + GROUP - 1) / GROUP * GROUP, G = Kp / GROUP, panels = (N + PANEL - 1) / PANEL;
    const size_t rows = (size_t)(M + ROW_TILE - 1) / ROW_TILE * ROW_TILE; /* whole tiles */
    /* one allocation: the codes, then the row scales */
    int16_t *c = malloc(sizeof(int16_t) * rows * Kp + sizeof(float) * (size_t)M);
    if (!c) return -1;
    float *row_scale = (float *)(c + rows * Kp);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++)
            row_scale[m] = code_row(x + (int64_t)m * K, K, Kp, c + (int64_t)(m / ROW_TILE) * ROW_TILE * Kp + 2 * (m % ROW_TILE));
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            const uint8_t *panel = w + (int64_t)p * G * BLOCK_BYTES;
            const int n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
            for (int m0 = 0; m0 < M; m0 += ROW_TILE) {
                const int nr = M - m0 < ROW_TILE ? M - m0 : ROW_TILE;
                const int16_t *ct = c + (int64_t)m0 * Kp;
                float out[ROW_TILE][PANEL];
#if defined(VNNI)
#define TILE(n) case n: panel_tile(panel, G, ct, out[0], n); break;
                switch (nr) {
                    TILE(8) TILE(7) TILE(6) TILE(5) TILE(4) TILE(3) TILE(2) TILE(1)
                }
#undef TILE
#else
                for (int r = 0; r < nr; r++) panel_row_scalar(panel, G, ct, r, out[r]);
#endif
                for (int r = 0; r < nr; r++)
                    for (int i = 0; i < width; i++)
                        y[(int64_t)(m0 + r) * N + n0 + i] = out[r][i] * row_scale[m0 + r] + (bias ? bias[n0 + i] : 0.0f);
            }
        }
    }
    free(c);
    return 0;
}

/* Rows ids[0..n) of packed weights with K inputs as f32 out [n][K]: each code times its group's scale
 * (a product exact in f32), a tied model's embedding lookup from its head. */
void int8_rows(const uint8_t *w, const int64_t *ids, int n, int K, float *out) {
    const int G = (K + GROUP - 1) / GROUP;
    for (int r = 0; r < n; r++) {
        const uint8_t *panel = w + ids[r] / PANEL * G * BLOCK_BYTES;
        const int lane = (int)(ids[r] % PANEL);
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = panel + (int64_t)g * BLOCK_BYTES;
            uint16_t h;
            memcpy(&h, blk + 2 * lane, 2);
            const float d = half_to_float(h);
            for (int i = 0; i < GROUP && g * GROUP + i < K; i++)
                out[(int64_t)r * K + g * GROUP + i] = (float)code_at(blk, lane, i) * d;
        }
    }
}
