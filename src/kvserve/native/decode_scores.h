/* Decode attention's scores: q . row for every row of a KV block and every query head of a kv head's
 * group, each row read where it is stored and decoded in registers (f32, f16, bf16, q8_0, q4_0) or from
 * the task's f32 buffer (decode_attention.h). Lane partials are summed in a fixed order, so a row's
 * score never depends on its neighbours, the batch, or the thread count.
 */
#ifndef KVSERVE_DECODE_SCORES_H
#define KVSERVE_DECODE_SCORES_H
#include "kv_rows.h"

#define PARTITION 256

/* CALL(k) with k the constant for `kind` among the kinds decoded in registers (f32 for the rest: rows
 * decoded into the task's buffer), so each kind gets its own inlined copy of the loop. */
#define FOR_KIND(kind, CALL)                                                                                   \
    switch (kind) {                                                                                            \
    case KV_F16: CALL(KV_F16); break;                                                                          \
    case KV_BF16: CALL(KV_BF16); break;                                                                        \
    case KV_Q8_0: CALL(KV_Q8_0); break;                                                                        \
    case KV_Q4_0: CALL(KV_Q4_0); break;                                                                        \
    default: CALL(KV_F32); break;                                                                              \
    }

#if defined(__AVX512F__)
/* out lane i = the sum of the 16 lanes of v[i], for 16 vectors: a transposing tree of 45 shuffles and
 * adds instead of 16 horizontal reductions of 8 dependent steps each. Lane sums pair up the same way
 * for every i, so a row's score does not depend on its neighbours. */
static inline __m512 sum_lanes_16(const __m512 v[16]) {
    __m512 t[8], u[4], p[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: [a, b, c, d] partial sums */
        __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* 128-bit lanes: [u0 L0+L1, u0 L2+L3, u1 L0+L1, u1 L2+L3] */
        p[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(p[0], p[1], 0x88), _mm512_shuffle_f32x4(p[0], p[1], 0xDD));
}
#endif

/* A block's rows as the score and value loops read them: f32 rows (stored, or decoded into the task's
 * buffer), or stored rows of another kind decoded in registers as they are loaded (see in_place). */
typedef struct {
    int kind;
    const uint8_t *codes; /* the block's first row */
    const float *d;       /* q8_0/q4_0: the rows' group scales, in order */
} rows_view;

#if defined(__AVX512F__)
/* Elements col .. col+15 (col a multiple of 16) of row r, in lane order, as f32: the same operations,
 * so the same bits, as decode_rows followed by a load. kind is a constant in every caller. */
static inline __attribute__((always_inline)) __m512 row_elems(const rows_view *R, int64_t r, int col, int D,
                                                              const int kind) {
    int64_t i = r * D + col;
    switch (kind) {
    case KV_F16:
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)R->codes + i)));
    case KV_BF16:
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)R->codes + i))), 16));
    case KV_Q8_0: {
        __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(R->codes + i)));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(R->d[i / GROUP]));
    }
    case KV_Q4_0: { /* a group's 16 bytes: low nibbles are its lanes 0-15, high nibbles 16-31 */
        __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(R->codes + i / GROUP * (GROUP / 2))));
        x = i % GROUP ? _mm512_srli_epi32(x, 4) : _mm512_and_si512(x, _mm512_set1_epi32(15));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(x, _mm512_set1_epi32(8))), _mm512_set1_ps(R->d[i / GROUP]));
    }
    default:
        return _mm512_loadu_ps((const float *)R->codes + i);
    }
}

/* lanes[h * 16 + r] = the 16 lane partials of q_h . row_(r0 + r), for H heads and 16 rows, RR rows a
 * sweep: each loaded (and decoded) key vector feeds all H heads while H x RR accumulators stay in
 * registers. A partial is an FMA chain over the row in element order from zero, whatever H and RR. */
static inline __attribute__((always_inline)) void score_lanes(const float *q, const rows_view *R, int r0, int D,
                                                              __m512 *lanes, const int H, const int RR,
                                                              const int kind) {
    for (int r1 = 0; r1 < 16; r1 += RR) {
        __m512 a[4][16];
        for (int h = 0; h < H; h++)
            for (int r = 0; r < RR; r++) a[h][r] = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 16)
            for (int r = 0; r < RR; r++) {
                __m512 k = row_elems(R, r0 + r1 + r, d, D, kind);
                for (int h = 0; h < H; h++) a[h][r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + d), k, a[h][r]);
            }
        for (int h = 0; h < H; h++)
            for (int r = 0; r < RR; r++) lanes[h * 16 + r1 + r] = a[h][r];
    }
}

/* block_scores' vector path, 16 rows a pass (rows past nr are read, from the zeroed or stale buffer or
 * from a block that holds them, and not stored). Rows decoded in registers are shared by up to four
 * query heads a sweep; f32 rows, a plain load, go one head and 16 rows a sweep (measured faster). */
static inline __attribute__((always_inline)) void block_scores_16(const float *q, const rows_view *R, int nr, int D,
                                                                  float scale, float *scores, int G, const int kind) {
    __m512 sv = _mm512_set1_ps(scale), lanes[4 * 16];
    for (int r0 = 0; r0 < nr; r0 += 16) {
        __mmask16 keep = nr - r0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nr - r0)) - 1);
        for (int g0 = 0; g0 < G;) {
            int H = kind == KV_F32 || G - g0 == 1 ? 1 : G - g0 >= 4 ? 4 : G - g0;
            const float *qg = q + g0 * D;
            switch (H) {
            case 4: score_lanes(qg, R, r0, D, lanes, 4, 4, kind); break;
            case 3: score_lanes(qg, R, r0, D, lanes, 3, 8, kind); break;
            case 2: score_lanes(qg, R, r0, D, lanes, 2, 8, kind); break;
            default: score_lanes(qg, R, r0, D, lanes, 1, 16, kind); break;
            }
            for (int h = 0; h < H; h++)
                _mm512_mask_storeu_ps(scores + (g0 + h) * PARTITION + r0, keep,
                                      _mm512_mul_ps(sum_lanes_16(lanes + h * 16), sv));
            g0 += H;
        }
    }
}
#endif

/* Elements d .. d+VL-1 (in lane order) of row r as f32, on the paths without AVX-512: f32 rows (stored,
 * or decoded into the task's buffer), and f16, bf16, q8_0 and q4_0 rows decoded as they are loaded with
 * the operations decode_rows does (the same values). kind is a constant in every caller. */
static inline __attribute__((always_inline)) vf row_vector(const rows_view *R, int64_t r, int d, int D, const int kind) {
    const int64_t i = r * D + d;
    switch (kind) {
    case KV_F16: return vf_from_half((const uint16_t *)R->codes + i);
    case KV_BF16: return vf_from_bf16((const uint16_t *)R->codes + i);
    case KV_Q8_0: return vf_mul(vf_from_i8((const int8_t *)R->codes + i), vf_set1(R->d[i / GROUP]));
    case KV_Q4_0: /* a group's 16 bytes: low nibbles are its lanes 0-15, high nibbles 16-31 */
        return vf_mul(vf_from_nibbles(R->codes + i / GROUP * (GROUP / 2) + i % 16, i % GROUP >= 16),
                      vf_set1(R->d[i / GROUP]));
    default: return vf_load((const float *)R->codes + i);
    }
}

/* lanes[h * 4 + r] = the VL lane partials of q_h . row_(r0 + r) for 4 rows and H query heads, RR rows a
 * sweep: each key vector is loaded (and decoded) once for all H heads while the H x RR accumulators
 * (at most 12: AVX2 has 16 registers) stay in registers. A partial is an FMA chain over the row in
 * element order from zero, whatever H and RR. */
static inline __attribute__((always_inline)) void score_lanes_4(const float *q, const rows_view *R, int r0, int D,
                                                                vf *lanes, const int H, const int RR,
                                                                const int kind) {
    for (int r1 = 0; r1 < 4; r1 += RR) {
        vf a[8][4];
        for (int h = 0; h < H; h++)
            for (int r = 0; r < RR; r++) a[h][r] = vf_zero();
        for (int d = 0; d < D; d += VL)
            for (int r = 0; r < RR; r++) {
                const vf k = row_vector(R, r0 + r1 + r, d, D, kind);
                for (int h = 0; h < H; h++) a[h][r] = vf_fma(vf_load(q + h * D + d), k, a[h][r]);
            }
        for (int h = 0; h < H; h++)
            for (int r = 0; r < RR; r++) lanes[h * 4 + r1 + r] = a[h][r];
    }
}

/* block_scores without AVX-512, 4 rows a pass (rows past nr, up to the next multiple of 4, are read,
 * from the buffer or from the block that holds them, and not stored); up to 8 query heads a sweep, so
 * a group of 7 (Qwen2.5) decodes each key vector once, not three times (measured: q8_0 keys at 4K
 * positions 0.38 -> 0.29 ms a layer on Zen 3). A score is its lanes' partials summed by vf_sum4: the
 * same bits whatever the heads and rows beside it. */
static inline __attribute__((always_inline)) void block_scores_4(const float *q, const rows_view *R, int nr, int D,
                                                                 float scale, float *scores, int G, const int kind) {
    vf lanes[8 * 4];
    float sums[4];
    for (int r0 = 0; r0 < nr; r0 += 4) {
        const int keep = nr - r0 < 4 ? nr - r0 : 4;
        for (int g0 = 0; g0 < G;) {
            const int H = G - g0 < 8 ? G - g0 : 8;
            const float *qg = q + g0 * D;
            switch (H) { /* H x RR <= 12 accumulators */
            case 8: score_lanes_4(qg, R, r0, D, lanes, 8, 1, kind); break;
            case 7: score_lanes_4(qg, R, r0, D, lanes, 7, 1, kind); break;
            case 6: score_lanes_4(qg, R, r0, D, lanes, 6, 2, kind); break;
            case 5: score_lanes_4(qg, R, r0, D, lanes, 5, 2, kind); break;
            case 4: score_lanes_4(qg, R, r0, D, lanes, 4, 2, kind); break;
            case 3: score_lanes_4(qg, R, r0, D, lanes, 3, 4, kind); break;
            case 2: score_lanes_4(qg, R, r0, D, lanes, 2, 4, kind); break;
            default: score_lanes_4(qg, R, r0, D, lanes, 1, 4, kind); break;
            }
            for (int h = 0; h < H; h++) {
                const vf *l = lanes + h * 4;
                vf_sum4(l[0], l[1], l[2], l[3], sums);
                for (int r = 0; r < keep; r++) scores[(g0 + h) * PARTITION + r0 + r] = sums[r] * scale;
            }
            g0 += H;
        }
    }
}

/* scores[g * PARTITION + r] = scale * (q_g . row_r) for the nr rows of a block, every query head g of
 * the group. A row's arithmetic is the same whatever nr is (16 rows a pass with AVX-512, else 4). */
static void block_scores(const float *q, const rows_view *R, int nr, int D, float scale, float *scores, int G) {
#if defined(__AVX512F__)
#define SCORES_16(kind) block_scores_16(q, R, nr, D, scale, scores, G, kind)
    if (D % 16 == 0) {
        FOR_KIND(R->kind, SCORES_16)
        return;
    }
#undef SCORES_16
#endif
#define SCORES_4(kind) block_scores_4(q, R, nr, D, scale, scores, G, kind)
    if (D % VL == 0) {
        FOR_KIND(R->kind, SCORES_4)
        return;
    }
#undef SCORES_4
    const float *rows = (const float *)R->codes; /* f32 here (see in_place) */
    for (int g = 0; g < G; g++)
        for (int r = 0; r < nr; r++) {
            float dot = 0.0f;
            for (int d = 0; d < D; d++) dot += q[g * D + d] * rows[r * D + d];
            scores[g * PARTITION + r] = dot * scale;
        }
}

#endif
