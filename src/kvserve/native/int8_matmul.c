/* y[m, n] = sum_g d[n, g] * sum_{k in g} x[m, k] * w[n, k] (+ bias[n]): f32 activations against int8
 * weights with an f16 scale per group of 32 inputs (GGUF Q8_0's grid, which SmolLM2's output head
 * is: held exactly).
 *
 * For the output head (the largest single tensor of a small model), applied to the rows that need
 * logits. Each activation is one int16 code, c = round(x * 32258 / max|x|) over its row (32258 =
 * 127 * 254: the two int8 digits d1 + d2 / 254 of int4_matmul.c, joined). A group's dot product is one
 * exact integer sum of s16 x s16 products (simd.h: AVX-512 VNNI's vpdpwssd, 32 products an instruction,
 * AVX2's vpmaddwd, NEON's smull; the int8 weights widened as they load), and per group, per output:
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
 * models/linear.py's pack_int8_groups writes it.
 *
 * int8_matmul_g16 (GROUPS_16) holds the grids whose scales are not f16 or whose groups are 16 inputs
 * (GGUF Q6_K: d * sc * q per 16; Q4_K: d * sc * q - dmin * m per 32): per panel and group of 32, 768
 * bytes: the 16 outputs' f32 scales of inputs 0-15, of inputs 16-31, their f32 offsets likewise, then
 * the codes as above (pack_int8_groups16). An offset meets the sum of the half group's activation codes.
 *
 * The activations' codes are stored tile by tile
 * (ROW_TILE rows' pairs side by side), so that the inner loop addresses a tile's rows from one pointer
 * and keeps their accumulators in registers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "parallel.h"
#include "simd.h"

#define PANEL 16
#if VL == 8 /* 16 vector registers: three per row (two integer chains, the sum) */
#define ROW_TILE 4
#else
#define ROW_TILE 8
#endif
#define GROUP 32
#define BLOCK_BYTES 544    /* GROUPS_32, a panel's group: 32 bytes of scales, 512 of codes (16 outputs x 32 inputs) */
#define BLOCK_BYTES_16 768 /* GROUPS_16: 2 x 64 bytes of f32 scales, 2 x 64 of f32 offsets, 512 of codes */
enum { GROUPS_32, GROUPS_16 };
#define RADIX 32258.0f  /* 127 * 254 */

SIMD_EXPORT_ISA

/* The code of input g * 32 + i of output lane in a panel's group block whose codes start at byte
 * `codes` (see the top). */
static inline int8_t code_at(const uint8_t *blk, int codes, int lane, int i) {
    return (int8_t)blk[codes + 32 * (i / 2) + 2 * lane + i % 2];
}

/* The int16 codes of one row (zero in the padding up to Kp), pair j at c + 2 * j * ROW_TILE; with
 * half_sums, the sum of the codes of each half group (16 inputs) at half_sums[(2 g + half) * ROW_TILE]
 * (exact: at most 16 x 32258). Returns max|x| / 32258. */
static float code_row(const float *x, int K, int Kp, int16_t *c, float *half_sums) {
    /* the largest magnitude in vectors: fmaxf of each element in turn is a library call a step (it
     * keeps NaN's rules), 0.5-1 ms of a 512-row call, more than a 256-output Q8_0 matmul's products */
    const int kv = K / VL * VL;
    vf vmax = vf_zero();
    for (int k = 0; k < kv; k += VL) vmax = vf_max(vmax, vf_abs(vf_load(x + k)));
    float amax = kv ? vf_reduce_max(vmax) : 0.0f;
    for (int k = kv; k < K; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    amax = amax > 1e-30f ? amax : 1e-30f;
    const float inv = RADIX / amax;
    int32_t sum = 0;
    for (int k = 0; k < Kp; k++) {
        const int16_t code = k < K ? (int16_t)nearbyintf(x[k] * inv) : 0;
        c[k / 2 * 2 * ROW_TILE + k % 2] = code;
        sum += code;
        if (half_sums && k % 16 == 15) {
            half_sums[k / 16 * ROW_TILE] = (float)sum;
            sum = 0;
        }
    }
    return amax / RADIX;
}

/* Rows [0, nr) of a tile against one panel to out[r][0..16), VL outputs at a time (lanes [h VL, h VL + VL)
 * of a pair: its bytes [2 VL h, 2 VL (h + 1))). Two integer chains a row, the group's first and second
 * 16 inputs (so that one row is not bound by the instruction's latency; the split of an integer sum is
 * exact). Per group:
 *     GROUPS_32: acc = fma(d, S0 + S1, acc)
 *     GROUPS_16: acc = fma(d0, S0, acc); acc = fma(m0, X0, acc); acc = fma(d1, S1, acc); acc = fma(m1, X1, acc)
 * with X the halves' activation code sums (half_sums). */
static inline __attribute__((always_inline)) void panel_tile(const uint8_t *panel, int G, const int16_t *c,
                                                             const float *half_sums, float *out, const int nr,
                                                             const int layout) {
    const int block = layout == GROUPS_16 ? BLOCK_BYTES_16 : BLOCK_BYTES, codes = block - 512;
    for (int h = 0; h < PANEL / VL; h++) {
        vf acc[ROW_TILE];
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) acc[r] = vf_zero();
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = panel + (int64_t)g * block;
            const int16_t *cg = c + (int64_t)g * GROUP * ROW_TILE;
            vi sa[ROW_TILE], sb[ROW_TILE];
#pragma GCC unroll 8
            for (int r = 0; r < nr; r++) sa[r] = sb[r] = vi_zero();
            for (int j = 0; j < GROUP / 4; j++) {
                const vw wa = vw_widen((const int8_t *)blk + codes + 32 * j + 2 * VL * h);
                const vw wb = vw_widen((const int8_t *)blk + codes + 32 * (j + GROUP / 4) + 2 * VL * h);
#pragma GCC unroll 8
                for (int r = 0; r < nr; r++) {
                    sa[r] = vi_dot_s16(sa[r], wa, cg + 2 * (j * ROW_TILE + r));
                    sb[r] = vi_dot_s16(sb[r], wb, cg + 2 * ((j + GROUP / 4) * ROW_TILE + r));
                }
            }
            if (layout == GROUPS_32) {
                const vf d = vf_from_half(blk + 2 * VL * h);
#pragma GCC unroll 8
                for (int r = 0; r < nr; r++) acc[r] = vf_fma(d, vf_from_vi(vi_add(sa[r], sb[r])), acc[r]);
            } else {
                const vf d0 = vf_load((const float *)blk + VL * h), d1 = vf_load((const float *)blk + 16 + VL * h);
                const vf m0 = vf_load((const float *)blk + 32 + VL * h), m1 = vf_load((const float *)blk + 48 + VL * h);
                const float *xs = half_sums + (int64_t)2 * g * ROW_TILE;
#pragma GCC unroll 8
                for (int r = 0; r < nr; r++) {
                    acc[r] = vf_fma(d0, vf_from_vi(sa[r]), acc[r]);
                    acc[r] = vf_fma(m0, vf_set1(xs[r]), acc[r]);
                    acc[r] = vf_fma(d1, vf_from_vi(sb[r]), acc[r]);
                    acc[r] = vf_fma(m1, vf_set1(xs[ROW_TILE + r]), acc[r]);
                }
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) vf_store(out + r * PANEL + h * VL, acc[r]);
    }
}

static inline __attribute__((always_inline)) int matmul(const float *x, const uint8_t *w, const float *bias, int M,
                                                        int N, int K, float *y, int num_threads, const int layout,
                                                        int ldy) {
    const int64_t ld = ldy > 0 ? ldy : N; /* y's row stride */
    const int Kp = (K + GROUP - 1) / GROUP * GROUP, G = Kp / GROUP, panels = (N + PANEL - 1) / PANEL;
    const int block = layout == GROUPS_16 ? BLOCK_BYTES_16 : BLOCK_BYTES;
    const size_t rows = (size_t)(M + ROW_TILE - 1) / ROW_TILE * ROW_TILE; /* whole tiles */
    /* one allocation: the codes, the row scales, the half groups' code sums (GROUPS_16) */
    const size_t sums = layout == GROUPS_16 ? rows * 2 * G : 0;
    int16_t *c = malloc(sizeof(int16_t) * rows * Kp + sizeof(float) * ((size_t)M + sums));
    if (!c) return -1;
    float *row_scale = (float *)(c + rows * Kp), *half_sums = layout == GROUPS_16 ? row_scale + M : NULL;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            const int64_t tile = m / ROW_TILE, r = m % ROW_TILE;
            row_scale[m] = code_row(x + (int64_t)m * K, K, Kp, c + tile * ROW_TILE * Kp + 2 * r,
                                    half_sums ? half_sums + tile * ROW_TILE * 2 * G + r : NULL);
        }
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            const uint8_t *panel = w + (int64_t)p * G * block;
            const int n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
            for (int m0 = 0; m0 < M; m0 += ROW_TILE) {
                const int nr = M - m0 < ROW_TILE ? M - m0 : ROW_TILE;
                const int16_t *ct = c + (int64_t)m0 * Kp;
                const float *st = half_sums ? half_sums + (int64_t)m0 * 2 * G : NULL;
                float out[ROW_TILE][PANEL];
#define TILE(n) case n: panel_tile(panel, G, ct, st, out[0], n, layout); break;
                switch (nr) {
#if ROW_TILE == 8
                    TILE(8) TILE(7) TILE(6) TILE(5)
#endif
                    TILE(4) TILE(3) TILE(2) TILE(1)
                }
#undef TILE
                for (int r = 0; r < nr; r++)
                    for (int i = 0; i < width; i++)
                        y[(m0 + r) * ld + n0 + i] = fmaf(out[r][i], row_scale[m0 + r], bias ? bias[n0 + i] : 0.0f);
            }
        }
    }
    free(c);
    return 0;
}

/* x [M, K] f32; w packed [ceil(N / 16), ceil(K / 32), 544] (see the top); bias [N] or NULL; y [M, N], rows
 * ldy floats apart (ldy <= 0: N). Returns 0, or -1 when the codes could not be allocated. */
int int8_matmul(const float *x, const uint8_t *w, const float *bias, int M, int N, int K, float *y,
                int num_threads, int ldy) {
    return matmul(x, w, bias, M, N, K, y, num_threads, GROUPS_32, ldy);
}

/* The same with w packed [ceil(N / 16), ceil(K / 32), 768]: an f32 scale and offset per 16 inputs. */
int int8_matmul_g16(const float *x, const uint8_t *w, const float *bias, int M, int N, int K, float *y,
                    int num_threads, int ldy) {
    return matmul(x, w, bias, M, N, K, y, num_threads, GROUPS_16, ldy);
}

/* Rows ids[0..n) of packed weights with K inputs as f32 out [n][K], a tied model's embedding lookup from
 * its head: GROUPS_32 each code times its group's scale (a product exact in f32); GROUPS_16 that product
 * plus the half group's offset, rounded as the gguf library dequantizes (d * q + m, not fused). */
static void rows(const uint8_t *w, const int64_t *ids, int n, int K, float *out, const int layout) {
    const int G = (K + GROUP - 1) / GROUP, block = layout == GROUPS_16 ? BLOCK_BYTES_16 : BLOCK_BYTES;
    for (int r = 0; r < n; r++) {
        const uint8_t *panel = w + ids[r] / PANEL * G * block;
        const int lane = (int)(ids[r] % PANEL);
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = panel + (int64_t)g * block;
            for (int i = 0; i < GROUP && g * GROUP + i < K; i++) {
                float v;
                if (layout == GROUPS_32) {
                    uint16_t h;
                    memcpy(&h, blk + 2 * lane, 2);
                    v = (float)code_at(blk, 32, lane, i) * half_to_float(h);
                } else {
                    float d, m;
                    memcpy(&d, blk + 4 * (16 * (i / 16) + lane), 4);
                    memcpy(&m, blk + 128 + 4 * (16 * (i / 16) + lane), 4);
                    const float product = (float)code_at(blk, 256, lane, i) * d;
                    v = product + m;
                }
                out[(int64_t)r * K + g * GROUP + i] = v;
            }
        }
    }
}

void int8_rows(const uint8_t *w, const int64_t *ids, int n, int K, float *out) { rows(w, ids, n, K, out, GROUPS_32); }

void int8_rows_g16(const uint8_t *w, const int64_t *ids, int n, int K, float *out) {
    rows(w, ids, n, K, out, GROUPS_16);
}
