/* y[m, n] = sum_k x[m, k] * w[n, k] for 4-bit weights w = lo + scale * q (q in 0..15, groups of
 * 32 along k, a scale and an offset per group: GGUF Q4_1's grid), f32 activations.
 *
 * Each activation row is split into two int8 digits (as models/linear.py's int8 format does):
 *     u = x * 127 / max|x|,   d1 = round(u),   d2 = round((u - d1) * 254),   u ~ d1 + d2 / 254
 * so a group's dot product is two exact integer sums of u8 x s8 products (AVX-512 VNNI: 64 a
 * instruction), and per group, per output:
 *     acc = fma(scale, S1 + S2 / 254, acc);   acc = fma(lo, sum of d1 + d2 / 254 over the group, acc)
 * then y = acc * max|x| / 127 (+ bias). Every float operation of a row is the same sequence whatever
 * the batch, the tile it lands in, or the thread count: a row's output is the same bits alone,
 * batched, in a decode step or in a prefill chunk (the engine's exactness rule).
 *
 * digits = 1 (``--weights q4-fast``) is llama.cpp's arithmetic instead: one int8 code per activation,
 * q = round(x / a) with a = max|x| / 127 over each group of 32, so half the integer products:
 *     acc = fma(scale, a * S, acc);   acc = fma(lo, a * sum of q over the group, acc);   y = acc (+ bias)
 * ~1.7x faster where the products bound the time (batches, prefill); output error ~5e-3 instead of
 * ~3e-5.
 *
 * Packed weights, for each panel of 16 outputs and each group (320 bytes, the panel's groups
 * contiguous, so a decode step streams the weights once in order):
 *     256 bytes: 4 chunks of 64; chunk c holds k-quads 2c (low nibbles) and 2c+1 (high nibbles),
 *                byte 4 * lane + i = code of output lane, k = 4 * quad + i (the VNNI operand layout)
 *      32 bytes: 16 scales (f16)      32 bytes: 16 offsets (f16)
 * models/linear.py's pack_int4 writes this layout.
 *
 * Threads split the panels; rows are taken in blocks (digits stay in L2) and tiles of up to 6 rows
 * that share each unpacked weight vector. The digits (and per-group sums and scales) are stored tile by
 * tile, group by group: a tile's rows of a group sit next to each other, so the inner loop addresses
 * them all from one pointer (with a pointer per row GCC ran out of registers and kept the
 * accumulators in memory).
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

#define GROUP 32
#define PANEL 16
#define BLOCK_BYTES 320
#define ROW_TILE 6
#define TILE_GROUP (ROW_TILE * GROUP) /* bytes of one group of a tile's digits */
#define PREFETCH 4096 /* bytes ahead, into L2: one row streams ~10% faster on 2 threads (measured) */
#define ROW_BLOCK 96 /* a multiple of ROW_TILE */

/* One digit (digits = 1): per group of 32, q = round(x / a) with a = max|x| / 127 into d1, a into
 * gscale, a * (sum of q) into usum; row_scale 1. The offsets' term takes the sum of the rounded
 * activations, not of x: the rounding errors then meet the weights themselves (lo + scale * code,
 * centred), not their all-positive codes alone. With the exact sum SmolLM2's KLD was 0.0141, with
 * this one 0.0036 (both beside a head that re-rounded the Q8_0 weights; with it held exactly: 0.0019,
 * llama.cpp's own on the same file and text: 0.0029). */
static void split_row_groups(const float *x, int K, int8_t *d1, float *usum, float *gscale, float *row_scale) {
    /* d1: the row's first group, the next ROW_TILE * GROUP bytes on; usum, gscale: every ROW_TILE floats */
    for (int g = 0; g < K / GROUP; g++) {
        const float *xg = x + g * GROUP;
#if defined(VNNI)
        const __m512 v0 = _mm512_loadu_ps(xg), v1 = _mm512_loadu_ps(xg + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m512 codes = _mm512_setzero_ps();
        for (int h = 0; h < 2; h++) {
            const __m512 code = _mm512_roundscale_ps(_mm512_mul_ps(h ? v1 : v0, inv), nearest);
            _mm_storeu_si128((__m128i *)(d1 + g * TILE_GROUP + 16 * h), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(code)));
            codes = _mm512_add_ps(codes, code);
        }
        const float code_sum = _mm512_reduce_add_ps(codes); /* an exact integer */
#else
        float amax = 0.0f, code_sum = 0.0f;
        for (int i = 0; i < GROUP; i++) amax = fmaxf(amax, fabsf(xg[i]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < GROUP; i++) {
            d1[g * TILE_GROUP + i] = (int8_t)nearbyintf(xg[i] * inv);
            code_sum += d1[g * TILE_GROUP + i];
        }
#endif
        gscale[g * ROW_TILE] = amax / 127.0f;
        usum[g * ROW_TILE] = gscale[g * ROW_TILE] * code_sum;
    }
    *row_scale = 1.0f;
}

/* Digits of one row, the sum of the digits' value d1 + d2 / 254 over each group (see split_row_groups:
 * the rounded activations' sum, not u's), and max|x| / 127. Strides as split_row_groups'. */
static void split_row(const float *x, int K, int8_t *d1, int8_t *d2, float *usum, float *row_scale) {
#if defined(VNNI) /* the same steps, 16 lanes at a time (the scalar loop cost ~500 us at 512 x 576) */
    __m512 vmax = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    const float amax = fmaxf(_mm512_reduce_max_ps(vmax), 1e-30f);
    const __m512 inv = _mm512_set1_ps(127.0f / amax), radix = _mm512_set1_ps(254.0f);
    const int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int g = 0; g < K / GROUP; g++) {
        __m512 sum1 = _mm512_setzero_ps(), sum2 = sum1;
        for (int h = 0; h < GROUP; h += 16) {
            const int k = g * GROUP + h, at = g * TILE_GROUP + h;
            const __m512 u = _mm512_mul_ps(_mm512_loadu_ps(x + k), inv), r1 = _mm512_roundscale_ps(u, nearest);
            const __m512 r2 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(u, r1), radix), nearest);
            _mm_storeu_si128((__m128i *)(d1 + at), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r1)));
            _mm_storeu_si128((__m128i *)(d2 + at), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r2)));
            sum1 = _mm512_add_ps(sum1, r1);
            sum2 = _mm512_add_ps(sum2, r2);
        }
        usum[g * ROW_TILE] = fmaf(_mm512_reduce_add_ps(sum2), 1.0f / 254.0f, _mm512_reduce_add_ps(sum1)); /* exact sums */
    }
    *row_scale = amax / 127.0f;
#else
    float amax = 0.0f;
    for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
    amax = fmaxf(amax, 1e-30f);
    const float inv = 127.0f / amax;
    for (int g = 0; g < K / GROUP; g++) {
        float sum1 = 0.0f, sum2 = 0.0f;
        for (int i = 0; i < GROUP; i++) {
            int k = g * GROUP + i, at = g * TILE_GROUP + i;
            float u = x[k] * inv, r1 = nearbyintf(u);
            d1[at] = (int8_t)r1;
            d2[at] = (int8_t)nearbyintf((u - r1) * 254.0f);
            sum1 += d1[at];
            sum2 += d2[at];
        }
        usum[g * ROW_TILE] = fmaf(sum2, 1.0f / 254.0f, sum1);
    }
    *row_scale = amax / 127.0f;
#endif
}

#if defined(VNNI)
/* acc + the u8 x s8 products of w with the 4 bytes at p in every lane, broadcast by the load itself
 * ({1to16}): compilers emit a separate vpbroadcastd, ~5% of the kernel's time (measured). */
static inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

/* Rows [0, nr) of a tile against one panel: out[r][0..16) (before the row scale and bias). d1, d2,
 * usum, gscale: the tile's, in the tile layout. */
static inline __attribute__((always_inline)) void panel_tile(const uint8_t *panel, int G, const int8_t *d1,
                                                             const int8_t *d2, const float *usum,
                                                             const float *gscale, float *out, const int nr,
                                                             const int digits) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512 inv254 = _mm512_set1_ps(1.0f / 254.0f);
    __m512 acc[ROW_TILE]; /* locals, stored once at the end (through a pointer GCC stored them every group) */
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = panel + (int64_t)g * BLOCK_BYTES;
        for (int i = 0; i < BLOCK_BYTES; i += 64) _mm_prefetch((const char *)(blk + PREFETCH + i), _MM_HINT_T1);
        __m512i c[8];
        for (int i = 0; i < 4; i++) {
            __m512i v = _mm512_loadu_si512((const void *)(blk + 64 * i));
            c[2 * i] = _mm512_and_si512(v, low);
            c[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 256)));
        __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 288)));
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) {
            const int8_t *a1 = d1 + (int64_t)g * TILE_GROUP + r * GROUP, *a2 = d2 + (int64_t)g * TILE_GROUP + r * GROUP;
            __m512i s1a = _mm512_setzero_si512(), s1b = s1a, s2a = s1a, s2b = s1a;
            for (int j = 0; j < 8; j += 2) {  /* integer sums: the split into two chains is exact */
                s1a = dpbusd_broadcast(s1a, c[j], a1 + 4 * j);
                s1b = dpbusd_broadcast(s1b, c[j + 1], a1 + 4 * j + 4);
                if (digits == 2) {
                    s2a = dpbusd_broadcast(s2a, c[j], a2 + 4 * j);
                    s2b = dpbusd_broadcast(s2b, c[j + 1], a2 + 4 * j + 4);
                }
            }
            const __m512 s1 = _mm512_cvtepi32_ps(_mm512_add_epi32(s1a, s1b));
            const __m512 t = digits == 2 ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s2a, s2b)), inv254, s1)
                                         : _mm512_mul_ps(s1, _mm512_set1_ps(gscale[g * ROW_TILE + r]));
            acc[r] = _mm512_fmadd_ps(scale, t, acc[r]);
            acc[r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(usum[g * ROW_TILE + r]), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(out + r * PANEL, acc[r]);
}

#else
/* The same arithmetic one output at a time (machines without AVX-512 VNNI); d1, d2, usum, gscale: the
 * row's, in the tile layout. */
static void panel_row_scalar(const uint8_t *panel, int G, const int8_t *d1, const int8_t *d2, const float *usum,
                             const float *gscale, int digits, float *out) {
    for (int lane = 0; lane < PANEL; lane++) {
        float acc = 0.0f;
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = panel + (int64_t)g * BLOCK_BYTES;
            int32_t s1 = 0, s2 = 0;
            for (int k = 0; k < GROUP; k++) {
                int quad = k / 4, chunk = quad / 2;
                uint8_t byte = blk[64 * chunk + 4 * lane + k % 4];
                int q = quad % 2 ? byte >> 4 : byte & 0x0F;
                s1 += q * d1[g * TILE_GROUP + k];
                if (digits == 2) s2 += q * d2[g * TILE_GROUP + k];
            }
            uint16_t hs, hl;
            memcpy(&hs, blk + 256 + 2 * lane, 2);
            memcpy(&hl, blk + 288 + 2 * lane, 2);
            float t = digits == 2 ? fmaf((float)s2, 1.0f / 254.0f, (float)s1) : (float)s1 * gscale[g * ROW_TILE];
            acc = fmaf(half_to_float(hs), t, acc);
            acc = fmaf(half_to_float(hl), usum[g * ROW_TILE], acc);
        }
        out[lane] = acc;
    }
}
#endif

/* Rows [0, nr) against one panel, written to y (row stride ldy) with the row scale and bias. */
static void panel_rows(const uint8_t *panel, int G, const int8_t *d1, const int8_t *d2, const float *usum,
                       const float *gscale, int digits, int K, int nr, const float *row_scale, const float *bias,
                       int width, float *y, int ldy) {
    float out[ROW_TILE][PANEL];
#if defined(VNNI)
#define TILE(n, digits) panel_tile(panel, G, d1, d2, usum, gscale, out[0], n, digits)
#define TILES(digits)                                                                                    \
    switch (nr) {                                                                                        \
    case 6: TILE(6, digits); break;                                                                      \
    case 5: TILE(5, digits); break;                                                                      \
    case 4: TILE(4, digits); break;                                                                      \
    case 3: TILE(3, digits); break;                                                                      \
    case 2: TILE(2, digits); break;                                                                      \
    default: TILE(1, digits); break;                                                                     \
    }
    if (digits == 2) {
        TILES(2)
    } else {
        TILES(1)
    }
#undef TILES
#undef TILE
#else
    for (int r = 0; r < nr; r++)
        panel_row_scalar(panel, G, d1 + r * GROUP, d2 + r * GROUP, usum + r, gscale + r, digits, out[r]);
#endif
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < width; i++) y[(int64_t)r * ldy + i] = out[r][i] * row_scale[r] + (bias ? bias[i] : 0.0f);
}

/* x [M, K] f32, w packed [ceil(N / 16), K / 32, 320 bytes], bias [N] or NULL, y [M, N] f32; digits
 * 2 (exact group sums) or 1 (llama.cpp's int8 activations). Returns 0, or -1 when the digits could
 * not be allocated. */
int int4_matmul(const float *x, const uint8_t *w, const float *bias, int M, int N, int K, float *y,
                 int num_threads, int digits) {
    const int G = K / GROUP, panels = (N + PANEL - 1) / PANEL;
    const size_t rows = (size_t)(M + ROW_TILE - 1) / ROW_TILE * ROW_TILE; /* whole tiles */
    int8_t *d1 = malloc(rows * K), *d2 = digits == 2 ? malloc(rows * K) : d1;
    float *usum = malloc(sizeof(float) * rows * G), *row_scale = malloc(sizeof(float) * (size_t)M);
    float *gscale = digits == 2 ? usum : malloc(sizeof(float) * rows * G);
    if (!d1 || !d2 || !usum || !row_scale || !gscale) {
        free(d1);
        if (d2 != d1) free(d2);
        free(usum);
        free(row_scale);
        if (gscale != usum) free(gscale);
        return -1;
    }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            const int64_t tile = m / ROW_TILE, r = m % ROW_TILE; /* the tile layout (see the top) */
            const int64_t digits_at = tile * ROW_TILE * K + r * GROUP, sums_at = tile * ROW_TILE * G + r;
            if (digits == 2)
                split_row(x + (int64_t)m * K, K, d1 + digits_at, d2 + digits_at, usum + sums_at, row_scale + m);
            else
                split_row_groups(x + (int64_t)m * K, K, d1 + digits_at, usum + sums_at, gscale + sums_at,
                                 row_scale + m);
        }
        /* each thread its own panels; rows in blocks whose digits stay in L2 while the panels pass */
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p_begin = (int)((int64_t)panels * t / nt), p_end = (int)((int64_t)panels * (t + 1) / nt);
        for (int mb = 0; mb < M; mb += ROW_BLOCK) {
            const int m_end = M - mb < ROW_BLOCK ? M : mb + ROW_BLOCK;
            for (int p = p_begin; p < p_end; p++) {
                const uint8_t *panel = w + (int64_t)p * G * BLOCK_BYTES;
                const int n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
                for (int m0 = mb; m0 < m_end; m0 += ROW_TILE) {
                    const int nr = m_end - m0 < ROW_TILE ? m_end - m0 : ROW_TILE;
                    panel_rows(panel, G, d1 + (int64_t)m0 * K, d2 + (int64_t)m0 * K, usum + (int64_t)m0 * G,
                               gscale + (int64_t)m0 * G, digits, K, nr, row_scale + m0, bias ? bias + n0 : NULL,
                               width, y + (int64_t)m0 * N + n0, N);
                }
            }
        }
    }
    free(d1);
    if (d2 != d1) free(d2);
    free(usum);
    free(row_scale);
    if (gscale != usum) free(gscale);
    return 0;
}
