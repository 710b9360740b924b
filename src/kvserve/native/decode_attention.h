/* Paged decode attention on the CPU, reading (possibly quantized) KV blocks in place: the steps of
 * paged_attention.c's paged_decode_attention.
 *
 * One query token per sequence. Work is split into tasks of (sequence, kv head, partition), a
 * partition being a fixed range of PARTITION positions (a grid over absolute positions, so a
 * sequence's result never depends on the batch it is in or on the thread count):
 *
 *     positions  0 ........ 255 | 256 ....... 511 | 512 .. ctx-1
 *     task       (seq, kvh, 0)    (seq, kvh, 1)     (seq, kvh, 2)     -> (max, sum, acc) each
 *     combine    out = sum_p acc_p e^(m_p - M) / sum_p l_p e^(m_p - M)
 *
 * Neighbouring sequences that read the same blocks (a request's speculative rows, each a decode row
 * one token longer than the one before) share their tasks: a task attends a partition for all of
 * them, each block read once, their query heads scored side by side as if of one group (attend_rows).
 *
 * Inside a task each block is read where it is stored and decoded in registers as it is loaded (f32,
 * f16, bf16, q8_0, q4_0), or decoded into a small f32 buffer first (one block, in L1: the other types,
 * and keys of partial blocks), and consumed at once by every query head of the kv head's group (GQA):
 * the cache is read once, never expanded into a full-precision temporary. Storage is head-major [kv_heads, num_blocks, block_size, width]
 * per part (codes, scales), as in kv/storage.py. For rotated codecs (tq*) the caller passes the
 * rotation: q is rotated once per call and each output row un-rotated after the combine.
 */
#ifndef KVSERVE_DECODE_ATTENTION_H
#define KVSERVE_DECODE_ATTENTION_H
#include "kv_rows.h"
#include "softcap.h"

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

/* sums[h * 4 + r] = q_h . row_(r0 + r) for 4 rows and H (at most 3) query heads: 4 x H accumulators
 * (12 of AVX2's 16 registers), each key vector loaded once for the H heads. A score is an FMA chain
 * over the row in element order from zero, then vf_sum4's lane sum: the same whatever H, the rows
 * beside it, or whether the row was read in place. */
static inline __attribute__((always_inline)) void score_rows_4(const float *q, const rows_view *R, int r0, int D,
                                                               float *sums, const int H, const int kind) {
    vf a[3][4];
    for (int h = 0; h < H; h++)
        for (int r = 0; r < 4; r++) a[h][r] = vf_zero();
    for (int d = 0; d < D; d += VL)
        for (int r = 0; r < 4; r++) {
            const vf k = row_vector(R, r0 + r, d, D, kind);
            for (int h = 0; h < H; h++) a[h][r] = vf_fma(vf_load(q + h * D + d), k, a[h][r]);
        }
    for (int h = 0; h < H; h++) vf_sum4(a[h][0], a[h][1], a[h][2], a[h][3], sums + 4 * h);
}

/* block_scores without AVX-512, 4 rows a pass (rows past nr, up to the next multiple of 4, are read,
 * from the buffer or from the block that holds them, and not stored); query heads 3 at a time (4 as
 * 2 + 2). */
static inline __attribute__((always_inline)) void block_scores_4(const float *q, const rows_view *R, int nr, int D,
                                                                 float scale, float *scores, int G, const int kind) {
    float sums[3 * 4];
    for (int r0 = 0; r0 < nr; r0 += 4) {
        const int keep = nr - r0 < 4 ? nr - r0 : 4;
        for (int g0 = 0; g0 < G;) {
            const int H = G - g0 == 4 ? 2 : G - g0 < 3 ? G - g0 : 3;
            const float *qg = q + g0 * D;
            switch (H) {
            case 3: score_rows_4(qg, R, r0, D, sums, 3, kind); break;
            case 2: score_rows_4(qg, R, r0, D, sums, 2, kind); break;
            default: score_rows_4(qg, R, r0, D, sums, 1, kind); break;
            }
            for (int h = 0; h < H; h++)
                for (int r = 0; r < keep; r++) scores[(g0 + h) * PARTITION + r0 + r] = sums[4 * h + r] * scale;
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

/* acc_g += sum_r w[g * PARTITION + r] * row_r for H (at most 4) query heads; acc_g at out + g * (D + 2).
 * H is a constant in each specialization, so with D a multiple of 64 the H x 4 accumulators of a
 * 64-wide slice stay in registers across the rows, each row's vectors loaded (and decoded) once. */
static inline __attribute__((always_inline)) void accumulate_heads(const float *w, const rows_view *R, int nr,
                                                                   int D, float *out, const int H, const int kind) {
#if defined(__AVX512F__)
    if (D % 64 == 0) {
        for (int d = 0; d < D; d += 64) {
            __m512 a[4][4];
            for (int g = 0; g < H; g++)
                for (int s = 0; s < 4; s++) a[g][s] = _mm512_loadu_ps(out + g * (D + 2) + d + 16 * s);
            for (int r = 0; r < nr; r++) {
                __m512 v[4];
                for (int s = 0; s < 4; s++) v[s] = row_elems(R, r, d + 16 * s, D, kind);
                for (int g = 0; g < H; g++) {
                    __m512 wv = _mm512_set1_ps(w[g * PARTITION + r]);
                    for (int s = 0; s < 4; s++) a[g][s] = _mm512_fmadd_ps(wv, v[s], a[g][s]);
                }
            }
            for (int g = 0; g < H; g++)
                for (int s = 0; s < 4; s++) _mm512_storeu_ps(out + g * (D + 2) + d + 16 * s, a[g][s]);
        }
        return;
    }
#endif
    if (D % (2 * VL) == 0) { /* H x 2 accumulators in registers across the rows, each row vector loaded once */
        for (int d = 0; d < D; d += 2 * VL) {
            vf a[4][2];
            for (int g = 0; g < H; g++)
                for (int s = 0; s < 2; s++) a[g][s] = vf_load(out + g * (D + 2) + d + VL * s);
            for (int r = 0; r < nr; r++) {
                const vf v0 = row_vector(R, r, d, D, kind), v1 = row_vector(R, r, d + VL, D, kind);
                for (int g = 0; g < H; g++) {
                    const vf wv = vf_set1(w[g * PARTITION + r]);
                    a[g][0] = vf_fma(wv, v0, a[g][0]);
                    a[g][1] = vf_fma(wv, v1, a[g][1]);
                }
            }
            for (int g = 0; g < H; g++)
                for (int s = 0; s < 2; s++) vf_store(out + g * (D + 2) + d + VL * s, a[g][s]);
        }
        return;
    }
    const float *rows = (const float *)R->codes; /* f32 here (see in_place) */
    for (int g = 0; g < H; g++)
        for (int r = 0; r < nr; r++)
            for (int d = 0; d < D; d++) out[g * (D + 2) + d] += w[g * PARTITION + r] * rows[r * D + d];
}

#define ACCUMULATE_KIND(kind)                                                                                  \
    switch (H) {                                                                                               \
    case 1: accumulate_heads(wg, R, nr, D, og, 1, kind); break;                                                \
    case 2: accumulate_heads(wg, R, nr, D, og, 2, kind); break;                                                \
    case 3: accumulate_heads(wg, R, nr, D, og, 3, kind); break;                                                \
    default: accumulate_heads(wg, R, nr, D, og, 4, kind); break;                                               \
    }

/* Every query head of the group, four at a time. */
static void block_accumulate(const float *w, const rows_view *R, int nr, int D, float *out, int G) {
    for (int g0 = 0; g0 < G; g0 += 4) {
        const float *wg = w + g0 * PARTITION;
        float *og = out + g0 * (D + 2);
        int H = G - g0 < 4 ? G - g0 : 4;
        FOR_KIND(R->kind, ACCUMULATE_KIND)
    }
}

/* Whether a block's stored rows can be read where they are (decoded in registers: row_elems,
 * row_vector) rather than decoded into the task's buffer first: f32 always; f16, bf16, q8_0 and q4_0
 * with D a multiple of 64 on the AVX-512 paths, of 2 VL on the others. tq4 measured faster through the
 * buffer (a byte's two codes decoded together). Keys only in whole passes of rows (block_scores reads
 * 16, or 4, at a time and must not read past the block). Same bits either way. */
static int in_place(int kind, int nr, int D, int keys) {
#if defined(__AVX512F__)
    if (keys && nr % 16 != 0) return 0;
    if (kind == KV_F32) return 1;
    if (D % 64 == 0)
        return kind == KV_F16 || kind == KV_BF16 || kind == KV_Q8_0 || kind == KV_Q4_0;
    return 0;
#else
    if (keys && nr % 4 != 0) return 0;
    if (kind == KV_F32) return 1;
    return D % (2 * VL) == 0 && (kind == KV_F16 || kind == KV_BF16 || kind == KV_Q8_0 || kind == KV_Q4_0);
#endif
}

/* The largest of s[0 .. n-1] (exact in any order). */
static float max_of(const float *s, int n) {
    float m = -FLT_MAX;
    int i = 0;
    if (n >= VL) {
        vf mv = vf_load(s);
        for (i = VL; i + VL <= n; i += VL) mv = vf_max(mv, vf_load(s + i));
        m = vf_reduce_max(mv);
    }
    for (; i < n; i++) m = s[i] > m ? s[i] : m;
    return m;
}

/* The positions [*begin, *end) of partition `part` that sequence seq attends (its window's and its
 * context's part of the partition; empty when *end <= *begin). */
static void partition_range(const problem *P, int seq, int part, int64_t *begin, int64_t *end) {
    int64_t ctx = P->context_lens[seq];
    int64_t lo = P->window > 0 && ctx > P->window ? ctx - P->window : 0;
    *begin = (int64_t)part * PARTITION > lo ? (int64_t)part * PARTITION : lo;
    *end = (int64_t)part * PARTITION + PARTITION < ctx ? (int64_t)part * PARTITION + PARTITION : ctx;
}

/* Positions [begin, end) of one kv head for `rows` sequences seq .. seq + rows - 1 that read the same
 * blocks there (a request's speculative rows: see paged_decode_attention) -> out[rows * G][D + 2]:
 * acc..., max, sum. Each block is read once for all of them, as if their rows x G query heads were
 * the heads of one group; a head's arithmetic does not depend on the heads beside it, so each row's
 * result is the same bits as attending alone. softcap > 0: the scores are capped (softcap.h) before
 * the softmax. q: rows * G * D floats of workspace; scores: rows * G * PARTITION. */
static void attend_rows(const problem *P, float softcap, int seq, int rows, int kvh, int64_t begin, int64_t end,
                        float *out, float *q, float *scores, float *block) {
    const int D = P->head_dim, G = P->num_heads / P->num_kv_heads, bs = P->block_size, heads = rows * G;
    const int len = (int)(end - begin);
    for (int g = 0; g < heads; g++) {
        float *o = out + g * (D + 2);
        memset(o, 0, sizeof(float) * D);
        o[D] = -FLT_MAX;
        o[D + 1] = 0.0f;
    }
    if (len <= 0) return;
    int order[D];
    lane_order(P->k.kind, D, order);
    for (int r = 0; r < rows; r++) {
        const float *q_elems = P->q + ((int64_t)(seq + r) * P->num_heads + (int64_t)kvh * G) * D;
        for (int g = 0; g < G; g++)
            for (int i = 0; i < D; i++) q[(r * G + g) * D + i] = q_elems[g * D + order[i]];
    }
    const int64_t *table = P->block_tables + seq * P->table_stride;
    float scales[bs * D / GROUP + 1]; /* a block's q8_0/q4_0 group scales */
    for (int pass = 0; pass < 2; pass++) {
        const kv_part *kv = pass == 0 ? &P->k : &P->v;
        for (int64_t t = begin; t < end;) {
            int64_t b = t / bs, off = t % bs;
            int nr = (int)(bs - off < end - t ? bs - off : end - t);
            int64_t row = ((int64_t)kvh * P->num_blocks + table[b]) * bs + off;
            rows_view R = {KV_F32, (const uint8_t *)block, NULL};
            if (in_place(kv->kind, nr, D, pass == 0)) {
                R.kind = kv->kind;
                R.codes = kv->codes + row * kv->code_stride;
                if (kv->kind == KV_Q8_0 || kv->kind == KV_Q4_0) {
                    R.d = scales;
                    halves_to_floats((const uint16_t *)(kv->scales + row * kv->scale_stride), scales, nr * D / GROUP);
                }
            } else {
                decode_rows(kv, row, nr, D, block);
            }
            int i0 = (int)(t - begin);
            if (pass == 0)
                block_scores(q, &R, nr, D, P->scale, scores + i0, heads);
            else
                block_accumulate(scores + i0, &R, nr, D, out, heads);
            t += nr;
        }
        if (pass == 1) { /* the value sums back from the values' lane order */
            lane_order(P->v.kind, D, order);
            float lanes[D];
            for (int g = 0; g < heads; g++) {
                float *acc = out + g * (D + 2);
                memcpy(lanes, acc, sizeof(float) * D);
                for (int i = 0; i < D; i++) acc[order[i]] = lanes[i];
            }
        }
        if (pass == 0) {
            for (int g = 0; g < heads; g++) {
                float *s = scores + g * PARTITION;
                if (softcap > 0.0f) softcap_scores(s, len, softcap);
                const float m = max_of(s, len);
                vf sum = vf_zero();
                int i = 0;
                for (; i + VL <= len; i += VL) {
                    const vf e = vf_exp_nonpositive(vf_sub(vf_load(s + i), vf_set1(m)));
                    vf_store(s + i, e);
                    sum = vf_add(sum, e);
                }
                float l = vf_reduce_add(sum);
                for (; i < len; i++) {
                    s[i] = exp_nonpositive(s[i] - m);
                    l += s[i];
                }
                out[g * (D + 2) + D] = m;
                out[g * (D + 2) + D + 1] = l;
            }
        }
    }
}

/* y = x R for one row of D (y may not alias x): a rotated codec's query rotation or value un-rotation. */
static void rotate_row(const float *x, const float *R, int D, float *restrict y) {
    memset(y, 0, sizeof(float) * D);
    for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++) y[j] += x[i] * R[(int64_t)i * D + j];
}

static int num_partitions(int64_t ctx) { return (int)((ctx + PARTITION - 1) / PARTITION); }

#endif
