/* Paged decode attention on the CPU, reading (possibly quantized) KV blocks in place.
 *
 * One query token per sequence. Work is split into tasks of (sequence, kv head, partition), a
 * partition being a fixed range of PARTITION positions (a grid over absolute positions, so a
 * sequence's result never depends on the batch it is in or on the thread count):
 *
 *     positions  0 ........ 255 | 256 ....... 511 | 512 .. ctx-1
 *     task       (seq, kvh, 0)    (seq, kvh, 1)     (seq, kvh, 2)     -> (max, sum, acc) each
 *     combine    out = sum_p acc_p e^(m_p - M) / sum_p l_p e^(m_p - M)
 *
 * Inside a task each block is read where it is stored and decoded in registers as it is loaded (f32,
 * f16, bf16, q8_0, q4_0), or decoded into a small f32 buffer first (one block, in L1: the other types,
 * and keys of partial blocks), and consumed at once by every query head of the kv head's group (GQA):
 * the cache is read once, never expanded into a full-precision temporary. Storage is head-major [kv_heads, num_blocks, block_size, width]
 * per part (codes, scales), as in kv/storage.py. For rotated codecs (tq*) the caller passes the
 * rotation: q is rotated once per call and each output row un-rotated after the combine.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_nonpositive.h" /* and simd.h */
#include "kv_kinds.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define PARTITION 256

SIMD_EXPORT_ISA

typedef struct {
    int kind;
    const uint8_t *codes;   /* part 0 of the layer */
    const uint8_t *scales;  /* part 1 (q8_0/q4_0: f16 per group; fp8/tq: f16 per vector) or NULL */
    int64_t code_stride;    /* bytes per head-vector in part 0 */
    int64_t scale_stride;   /* bytes per head-vector in part 1 */
    const float *table;     /* fp8: 256 values; tq2/tq4: 256 x codes-per-byte; tq3: 8 levels */
} kv_part;

static void halves_to_floats(const uint16_t *h, float *restrict dst, int n) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) dst[i] = half_to_float(h[i]);
}

/* Packed codes decode fastest in a "lane order" that is not the element order: all low nibbles of
 * a group, then all high nibbles. Scores do not care about the order of a dot product, so the kernel
 * decodes keys and values in lane order, permutes the query into it once per task and the value sum
 * back out of it at the end. lane_order[i] = element stored in lane i of a decoded head-vector. */
static void lane_order(int kind, int D, int *order) {
    for (int i = 0; i < D; i++) order[i] = i;
    if (kind == KV_Q4_0) /* per group of 32: 16 low nibbles (even elements), then 16 high (odd) */
        for (int i = 0; i < D; i++) order[i] = i / GROUP * GROUP + (i % GROUP < 16 ? 2 * (i % 16) : 2 * (i % 16) + 1);
    if (kind == KV_TQ4) /* D/2 bytes: their low nibbles, then their high nibbles */
        for (int i = 0; i < D; i++) order[i] = i < D / 2 ? 2 * i : 2 * (i - D / 2) + 1;
    if (kind == KV_TQ2) /* D/4 bytes: code k of every byte, k = 0..3 */
        for (int i = 0; i < D; i++) order[i] = 4 * (i % (D / 4)) + i / (D / 4);
    if (kind == KV_TQ3) /* D/8 24-bit words: code k of every word, k = 0..7 */
        for (int i = 0; i < D; i++) order[i] = 8 * (i % (D / 8)) + i / (D / 8);
}

/* tq2/tq4 rows: codes of `bits` bits, code k of each byte into lanes [k * D/per_byte, ...). The levels
 * (at most 16) sit in one register and are picked with a permute instead of a memory gather. */
static void decode_small_codes(int bits, const uint8_t *c, const uint16_t *s, const float *cb, int nrows, int D,
                               float *restrict dst) {
    int per_byte = 8 / bits, bytes = D / per_byte, mask = (1 << bits) - 1;
    float levels[16] = {0};
    for (int i = 0; i <= mask; i++) levels[i] = cb[per_byte * i];
    for (int r = 0; r < nrows; r++) {
        const uint8_t *b = c + (int64_t)r * bytes;
        float d = half_to_float(s[r]), *o = dst + (int64_t)r * D;
        int j = 0;
#if defined(__AVX512F__)
        __m512 lv = _mm512_loadu_ps(levels), dv = _mm512_set1_ps(d);
        __m512i m = _mm512_set1_epi32(mask);
        for (; j + 16 <= bytes; j += 16) {
            __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + j)));
            for (int k = 0; k < per_byte; k++) {
                __m512i code = _mm512_and_si512(_mm512_srli_epi32(x, bits * k), m);
                _mm512_storeu_ps(o + k * bytes + j, _mm512_mul_ps(_mm512_permutexvar_ps(code, lv), dv));
            }
        }
#endif
        for (; j < bytes; j++)
            for (int k = 0; k < per_byte; k++) o[k * bytes + j] = levels[(b[j] >> (bits * k)) & mask] * d;
    }
}

/* nrows head-vectors starting at flat row `row` -> dst [nrows, D] f32, each in lane order. */
static void decode_rows(const kv_part *p, int64_t row, int nrows, int D, float *restrict dst) {
    const uint8_t *c = p->codes + row * p->code_stride;
    const uint16_t *s = p->scales ? (const uint16_t *)(p->scales + row * p->scale_stride) : NULL;
    const float *cb = p->table;
    int n = nrows * D;
    switch (p->kind) {
    case KV_F32:
        memcpy(dst, c, (size_t)n * 4);
        break;
    case KV_F16:
        halves_to_floats((const uint16_t *)c, dst, n);
        break;
    case KV_BF16: {
        const uint16_t *h = (const uint16_t *)c;
        uint32_t *d = (uint32_t *)dst;
        for (int i = 0; i < n; i++) d[i] = (uint32_t)h[i] << 16;
        break;
    }
    case KV_Q8_0: {
        const int8_t *q = (const int8_t *)c;
        float d[n / GROUP];
        halves_to_floats(s, d, n / GROUP);
        for (int g = 0; g < n / GROUP; g++) {
#if defined(__AVX512F__)
            __m512 dv = _mm512_set1_ps(d[g]);
            for (int j = 0; j < GROUP; j += 16) {
                __m512i c32 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + g * GROUP + j)));
                _mm512_storeu_ps(dst + g * GROUP + j, _mm512_mul_ps(_mm512_cvtepi32_ps(c32), dv));
            }
#else
            for (int j = 0; j < GROUP; j++) dst[g * GROUP + j] = (float)q[g * GROUP + j] * d[g];
#endif
        }
        break;
    }
    case KV_Q4_0: {
        float d[n / GROUP];
        halves_to_floats(s, d, n / GROUP);
        for (int g = 0; g < n / GROUP; g++) {
            const uint8_t *b = c + g * (GROUP / 2);
            float *o = dst + g * GROUP;
#if defined(__AVX512F__)
            __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b)), eight = _mm512_set1_epi32(8);
            __m512 dv = _mm512_set1_ps(d[g]);
            __m512i lo = _mm512_sub_epi32(_mm512_and_si512(x, _mm512_set1_epi32(15)), eight);
            __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(x, 4), eight);
            _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), dv));
            _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(hi), dv));
#else
            for (int j = 0; j < GROUP / 2; j++) o[j] = (float)((int)(b[j] & 15) - 8) * d[g];
            for (int j = 0; j < GROUP / 2; j++) o[GROUP / 2 + j] = (float)((int)(b[j] >> 4) - 8) * d[g];
#endif
        }
        break;
    }
    case KV_FP8:
        for (int r = 0; r < nrows; r++) {
            float d = half_to_float(s[r]);
            for (int j = 0; j < D; j++) dst[r * D + j] = cb[c[r * D + j]] * d;
        }
        break;
    case KV_TQ4: /* cb: [256][2], the value of each nibble is cb[2 * nibble] */
    case KV_TQ2: /* cb: [256][4], the value of each 2-bit code is cb[4 * code] */
        decode_small_codes(p->kind == KV_TQ4 ? 4 : 2, c, s, cb, nrows, D, dst);
        break;
    case KV_TQ3: /* cb: the 8 levels */
        for (int r = 0; r < nrows; r++) {
            const uint8_t *b = c + (int64_t)r * (D * 3 / 8);
            float d = half_to_float(s[r]), *o = dst + r * D;
            uint32_t words[D / 8];
            for (int w = 0; w < D / 8; w++)
                words[w] = b[3 * w] | (uint32_t)b[3 * w + 1] << 8 | (uint32_t)b[3 * w + 2] << 16;
            for (int k = 0; k < 8; k++)
                for (int w = 0; w < D / 8; w++) o[k * (D / 8) + w] = cb[(words[w] >> (3 * k)) & 7] * d;
        }
        break;
    }
}

typedef struct {
    int num_heads, num_kv_heads, head_dim, num_blocks, block_size, window;
    float scale;
    const float *q;  /* [n, num_heads, head_dim] */
    float *out;      /* prefill: [n, num_heads, head_dim] */
    const int64_t *block_tables;
    int64_t table_stride;
    const int64_t *context_lens;
    kv_part k, v;
} problem;

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

/* scores[g * PARTITION + r] = scale * (q_g . row_r) for the nr rows of a block, every query head g of
 * the group. With AVX-512 the rows go 16 at a time, so a row's arithmetic is the same whatever nr is. */
static void block_scores(const float *q, const rows_view *R, int nr, int D, float scale, float *scores, int G) {
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        switch (R->kind) {
        case KV_F16: block_scores_16(q, R, nr, D, scale, scores, G, KV_F16); break;
        case KV_BF16: block_scores_16(q, R, nr, D, scale, scores, G, KV_BF16); break;
        case KV_Q8_0: block_scores_16(q, R, nr, D, scale, scores, G, KV_Q8_0); break;
        case KV_Q4_0: block_scores_16(q, R, nr, D, scale, scores, G, KV_Q4_0); break;
        default: block_scores_16(q, R, nr, D, scale, scores, G, KV_F32); break;
        }
        return;
    }
#endif
    const float *rows = (const float *)R->codes; /* f32 here (see in_place) */
    if (D % VL == 0) { /* four rows a pass: four independent FMA chains, then each row's lane sum */
        for (int g = 0; g < G; g++) {
            const float *qg = q + g * D;
            int r = 0;
            for (; r + 4 <= nr; r += 4) {
                vf a0 = vf_zero(), a1 = a0, a2 = a0, a3 = a0;
                for (int d = 0; d < D; d += VL) {
                    const vf qd = vf_load(qg + d);
                    a0 = vf_fma(qd, vf_load(rows + (r + 0) * D + d), a0);
                    a1 = vf_fma(qd, vf_load(rows + (r + 1) * D + d), a1);
                    a2 = vf_fma(qd, vf_load(rows + (r + 2) * D + d), a2);
                    a3 = vf_fma(qd, vf_load(rows + (r + 3) * D + d), a3);
                }
                scores[g * PARTITION + r] = vf_reduce_add(a0) * scale;
                scores[g * PARTITION + r + 1] = vf_reduce_add(a1) * scale;
                scores[g * PARTITION + r + 2] = vf_reduce_add(a2) * scale;
                scores[g * PARTITION + r + 3] = vf_reduce_add(a3) * scale;
            }
            for (; r < nr; r++) { /* the same operations, one row */
                vf a = vf_zero();
                for (int d = 0; d < D; d += VL) a = vf_fma(vf_load(qg + d), vf_load(rows + r * D + d), a);
                scores[g * PARTITION + r] = vf_reduce_add(a) * scale;
            }
        }
        return;
    }
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
    (void)kind;
    const float *rows = (const float *)R->codes; /* f32 here (see in_place) */
    if (D % (2 * VL) == 0) { /* H x 2 accumulators in registers across the rows, each row vector loaded once */
        for (int d = 0; d < D; d += 2 * VL) {
            vf a[4][2];
            for (int g = 0; g < H; g++)
                for (int s = 0; s < 2; s++) a[g][s] = vf_load(out + g * (D + 2) + d + VL * s);
            for (int r = 0; r < nr; r++) {
                const vf v0 = vf_load(rows + r * D + d), v1 = vf_load(rows + r * D + d + VL);
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
        switch (R->kind) {
        case KV_F16: ACCUMULATE_KIND(KV_F16) break;
        case KV_BF16: ACCUMULATE_KIND(KV_BF16) break;
        case KV_Q8_0: ACCUMULATE_KIND(KV_Q8_0) break;
        case KV_Q4_0: ACCUMULATE_KIND(KV_Q4_0) break;
        default: ACCUMULATE_KIND(KV_F32) break;
        }
    }
}

/* Whether a block's stored rows can be read where they are (decoded in registers, row_elems) rather
 * than decoded into the task's buffer first: f32 always; f16, bf16, q8_0 and q4_0 on the AVX-512 paths
 * (D a multiple of 64). tq4 measured faster through the buffer (a byte's two codes decoded together).
 * Keys only in whole groups of 16 rows (block_scores reads 16 at a time and must not read past the
 * block). Same bits either way. */
static int in_place(int kind, int nr, int D, int keys) {
    if (keys && nr % 16 != 0) return 0;
    if (kind == KV_F32) return 1;
#if defined(__AVX512F__)
    if (D % 64 == 0)
        return kind == KV_F16 || kind == KV_BF16 || kind == KV_Q8_0 || kind == KV_Q4_0;
#endif
    (void)D;
    return 0;
}

/* The largest of s[0 .. n-1] (exact in any order). */
static float max_of(const float *s, int n) {
    float m = -FLT_MAX;
    int i = 0;
#if defined(__AVX512F__)
    __m512 mv = _mm512_set1_ps(-FLT_MAX);
    for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + i));
    m = _mm512_reduce_max_ps(mv);
#endif
    for (; i < n; i++) m = s[i] > m ? s[i] : m;
    return m;
}

/* One partition of one kv head of one sequence -> out[G][D + 2]: acc..., max, sum. */
static void attend_partition(const problem *P, int seq, int kvh, int part, float *out, float *scores,
                             float *block) {
    int D = P->head_dim, G = P->num_heads / P->num_kv_heads, bs = P->block_size;
    int64_t ctx = P->context_lens[seq];
    int64_t lo = P->window > 0 && ctx > P->window ? ctx - P->window : 0;
    int64_t begin = (int64_t)part * PARTITION, end = begin + PARTITION;
    if (begin < lo) begin = lo;
    if (end > ctx) end = ctx;
    int len = (int)(end - begin);
    for (int g = 0; g < G; g++) {
        float *o = out + g * (D + 2);
        memset(o, 0, sizeof(float) * D);
        o[D] = -FLT_MAX;
        o[D + 1] = 0.0f;
    }
    if (len <= 0) return;
    const float *q_elems = P->q + ((int64_t)seq * P->num_heads + (int64_t)kvh * G) * D;
    float q[G * D];
    int order[D];
    lane_order(P->k.kind, D, order);
    for (int g = 0; g < G; g++)
        for (int i = 0; i < D; i++) q[g * D + i] = q_elems[g * D + order[i]];
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
                block_scores(q, &R, nr, D, P->scale, scores + i0, G);
            else
                block_accumulate(scores + i0, &R, nr, D, out, G);
            t += nr;
        }
        if (pass == 1) { /* the value sums back from the values' lane order */
            lane_order(P->v.kind, D, order);
            float lanes[D];
            for (int g = 0; g < G; g++) {
                float *acc = out + g * (D + 2);
                memcpy(lanes, acc, sizeof(float) * D);
                for (int i = 0; i < D; i++) acc[order[i]] = lanes[i];
            }
        }
        if (pass == 0) {
            for (int g = 0; g < G; g++) {
                float *s = scores + g * PARTITION, m = max_of(s, len), l = 0.0f;
                for (int i = 0; i < len; i++) {
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

/* Returns 0, or -1 when the workspace could not be allocated. */
int paged_decode_attention(int n, int num_heads, int num_kv_heads, int head_dim, const float *q, float *out,
                           const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                           int num_blocks, int block_size, int window, float scale,
                           int k_kind, const void *k_codes, const void *k_scales, int64_t k_code_stride,
                           int64_t k_scale_stride, const float *k_table,
                           int v_kind, const void *v_codes, const void *v_scales, int64_t v_code_stride,
                           int64_t v_scale_stride, const float *v_table, const float *q_rotation,
                           const float *out_rotation, int num_threads) {
    int rows = n * num_heads;
    float *rotated = NULL; /* q R, when the keys are stored rotated and the caller left q as it is */
    if (q_rotation) {
        rotated = malloc(sizeof(float) * (size_t)rows * head_dim);
        if (!rotated) return -1;
        for (int r = 0; r < rows; r++)
            rotate_row(q + (int64_t)r * head_dim, q_rotation, head_dim, rotated + (int64_t)r * head_dim);
        q = rotated;
    }
    problem P = {num_heads, num_kv_heads, head_dim, num_blocks, block_size, window, scale, q, out,
                 block_tables, table_stride, context_lens,
                 {k_kind, k_codes, k_scales, k_code_stride, k_scale_stride, k_table},
                 {v_kind, v_codes, v_scales, v_code_stride, v_scale_stride, v_table}};
    int G = num_heads / num_kv_heads, D = head_dim;
    int64_t *first = malloc(sizeof(int64_t) * (n + 1)); /* first task of each sequence */
    if (!first) {
        free(rotated);
        return -1;
    }
    first[0] = 0;
    for (int i = 0; i < n; i++) first[i + 1] = first[i] + (int64_t)num_kv_heads * num_partitions(context_lens[i]);
    int64_t num_tasks = first[n];
    float *partials = malloc(sizeof(float) * (size_t)num_tasks * G * (D + 2));
    if (!partials) {
        free(first);
        free(rotated);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_tasks > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)G * PARTITION);
        /* whole 16-row groups (see block_scores), zeroed so rows past a block's end are finite */
        float *block = calloc((size_t)(block_size + 15) / 16 * 16 * D, sizeof(float));
        if (!scores || !block) {
#pragma omp atomic write
            failed = 1;
        }
        int seq = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; task++) {
            if (failed) continue;
            while (first[seq + 1] <= task) seq++;
            while (first[seq] > task) seq--;
            int64_t local = task - first[seq];
            int parts = num_partitions(context_lens[seq]);
            attend_partition(&P, seq, (int)(local / parts), (int)(local % parts),
                             partials + task * G * (D + 2), scores, block);
        }
        free(scores);
        free(block);
    }
    if (!failed) {
        for (int i = 0; i < n; i++) {
            int parts = num_partitions(context_lens[i]);
            for (int h = 0; h < num_heads; h++) {
                int kvh = h / G, g = h % G;
                const float *base = partials + (first[i] + (int64_t)kvh * parts) * G * (D + 2) + g * (D + 2);
                int64_t step = (int64_t)G * (D + 2);
                float M = -FLT_MAX, L = 0.0f;
                for (int p = 0; p < parts; p++) M = base[p * step + D] > M ? base[p * step + D] : M;
                float *o = out + ((int64_t)i * num_heads + h) * D;
                memset(o, 0, sizeof(float) * D);
                for (int p = 0; p < parts; p++) {
                    const float *part = base + p * step;
                    if (part[D + 1] == 0.0f) continue;
                    float w = exp_nonpositive(part[D] - M);
                    L += part[D + 1] * w;
                    for (int d = 0; d < D; d++) o[d] += part[d] * w;
                }
                float inv = L > 0.0f ? 1.0f / L : 0.0f;
                for (int d = 0; d < D; d++) o[d] *= inv;
                if (out_rotation) { /* values were summed in their rotated domain */
                    float summed[D];
                    memcpy(summed, o, sizeof(float) * D);
                    rotate_row(summed, out_rotation, D, o);
                }
            }
        }
    }
    free(partials);
    free(first);
    free(rotated);
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------------------
 * Prefill attention: a chunk of consecutive queries of one sequence (positions q_start ..) against its
 * history, causal (and windowed), flash-style: per query an online softmax over 64-key tiles.
 *
 * Tasks are (kv head, tile of QUERY_TILE queries); a task decodes each key tile of the history once
 * into L1 (any KV type, as decode does), transposes the keys to [head_dim][64] so sixty-four scores
 * are four FMA chains per query (no horizontal sums), and feeds every query head of the group. Key
 * tiles sit on a fixed grid of absolute positions and masked lanes contribute exact zeros, so a
 * query's arithmetic depends only on its position and the keys: a prompt gives the same bits whole
 * or in chunks, on any number of threads.
 */
#define QUERY_TILE 32
#define KEY_TILE 64
#if VL == 8 /* 16 vector registers: measured 5-8% faster than 2 rows (which fit them without spilling) */
#define ROWS 3       /* query rows scored together: 3 x 4 independent FMA chains over 4 VL keys */
#define VALUE_VECS 4 /* vectors of a row's value sum updated together: 3 x 4 chains */
#else
#define ROWS 6 /* 6 x 4 independent FMA chains */
#define VALUE_VECS 1
#endif

#if defined(__AVX512F__)
/* r[i] = row i of a 16 x 16 matrix of 32-bit elements -> r[j] = its column j (64 shuffles). */
static inline void transpose_16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);     /* per 128-bit lane: a0 b0 a1 b1 */
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]); /* a2 b2 a3 b3 */
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);         /* a0 b0 c0 d0 */
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);     /* a1 b1 c1 d1 */
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]); /* a2 b2 c2 d2 */
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]); /* a3 b3 c3 d3 */
    }
    /* r[4g + k], 128-bit lane L: column 4L + k of rows 4g .. 4g + 3 */
    for (int k = 0; k < 4; k++) {
        t[k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88); /* lanes L0, L2 of groups 0 and 1 */
        t[4 + k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xDD); /* lanes L1, L3 */
        t[8 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
        t[12 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xDD);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);           /* lane L0 of every group: column k */
        r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xDD);       /* L2: column 8 + k */
        r[4 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0x88);  /* L1: column 4 + k */
        r[12 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0xDD); /* L3: column 12 + k */
    }
}
#endif

/* keys [KEY_TILE][D] -> kt [D][KEY_TILE] */
static void transpose_keys(const float *keys, int D, float *kt) {
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        for (int j0 = 0; j0 < KEY_TILE; j0 += 16)
            for (int d0 = 0; d0 < D; d0 += 16) {
                __m512i r[16];
                for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void *)(keys + (int64_t)(j0 + i) * D + d0));
                transpose_16x16(r);
                for (int i = 0; i < 16; i++) _mm512_storeu_si512((void *)(kt + (int64_t)(d0 + i) * KEY_TILE + j0), r[i]);
            }
        return;
    }
#endif
    for (int j = 0; j < KEY_TILE; j++)
        for (int d = 0; d < D; d++) kt[(int64_t)d * KEY_TILE + j] = keys[(int64_t)j * D + d];
}

typedef struct {
    float *q;      /* [rows][D], keys' lane order, pre-scaled */
    float *acc;    /* [rows][D], values' lane order */
    float *m, *l;  /* [rows] running max and sum */
    float *keys, *values, *kt; /* one key tile: [KEY_TILE][D] each, keys transposed [D][KEY_TILE] */
    /* q8_0 keys with VNNI (see int_key_scores), else NULL: */
    int16_t *q16;  /* [rows][D] the pre-scaled query rows as int16, q ~ q16 * q16_scale[row] */
    float *q16_scale;
    int16_t *kq;   /* the tile's key codes as int16 pairs: [D / 2][KEY_TILE][2] */
    float *ks;     /* their scales: [D / GROUP][KEY_TILE] */
} prefill_work;

/* Bit j set when key kb + j is visible from position pos (causal, window). */
static inline uint64_t visible_keys(int64_t pos, int64_t kb, int window) {
    int64_t hi = pos - kb, lo = window > 0 ? pos - window + 1 - kb : 0;
    if (lo < 0) lo = 0;
    if (hi > KEY_TILE - 1) hi = KEY_TILE - 1;
    if (hi < lo) return 0;
    uint64_t upto = hi == 63 ? ~0ull : (1ull << (hi + 1)) - 1;
    return upto & ~((1ull << lo) - 1);
}

/* Online-softmax state of one row for its scores s[0..KEY_TILE) over the tile's visible keys: turns
 * s into the weights p (0 for hidden keys), returns alpha, the factor for the row's old sums. */
static inline float softmax_update(prefill_work *w, int row, float *s, uint64_t visible) {
    const int all = visible == ~0ull;
    if (!all)
        for (int j = 0; j < KEY_TILE; j++)
            if (!(visible >> j & 1)) s[j] = -FLT_MAX;
    vf mv = vf_set1(-FLT_MAX);
    for (int j = 0; j < KEY_TILE; j += VL) mv = vf_max(mv, vf_load(s + j));
    const float m_tile = vf_reduce_max(mv);
    float m_old = w->m[row], m_new = m_tile > m_old ? m_tile : m_old, alpha = exp_nonpositive(m_old - m_new);
    const vf mn = vf_set1(m_new);
    for (int j = 0; j < KEY_TILE; j += VL) vf_store(s + j, vf_exp_nonpositive(vf_sub(vf_load(s + j), mn)));
    if (!all) /* hidden keys weigh exactly nothing */
        for (int j = 0; j < KEY_TILE; j++)
            if (!(visible >> j & 1)) s[j] = 0.0f;
    vf parts = vf_zero();
    for (int j = 0; j < KEY_TILE; j += VL) parts = vf_add(parts, vf_load(s + j));
    w->l[row] = w->l[row] * alpha + vf_reduce_add(parts);
    w->m[row] = m_new;
    return alpha;
}

/* acc_r = acc_r * alpha_r + sum_j p_r[j] * values[j] for rows r0 .. r0 + nr (each lane summed in key
 * order); the rows share every value vector loaded. */
static inline __attribute__((always_inline)) void accumulate_values(prefill_work *w, int r0, const int nr, int D,
                                                                    float p[][KEY_TILE], const float *alpha,
                                                                    const float *values) {
    if (D % (VL * VALUE_VECS) == 0) {
        for (int d = 0; d < D; d += VL * VALUE_VECS) {
            vf a[ROWS][VALUE_VECS];
            for (int r = 0; r < nr; r++)
                for (int u = 0; u < VALUE_VECS; u++)
                    a[r][u] = vf_mul(vf_load(w->acc + (int64_t)(r0 + r) * D + d + VL * u), vf_set1(alpha[r]));
            for (int j = 0; j < KEY_TILE; j++) {
                vf v[VALUE_VECS];
                for (int u = 0; u < VALUE_VECS; u++) v[u] = vf_load(values + (int64_t)j * D + d + VL * u);
                for (int r = 0; r < nr; r++) {
                    const vf pj = vf_set1(p[r][j]);
                    for (int u = 0; u < VALUE_VECS; u++) a[r][u] = vf_fma(pj, v[u], a[r][u]);
                }
            }
            for (int r = 0; r < nr; r++)
                for (int u = 0; u < VALUE_VECS; u++) vf_store(w->acc + (int64_t)(r0 + r) * D + d + VL * u, a[r][u]);
        }
        return;
    }
    for (int r = 0; r < nr; r++) {
        float *acc = w->acc + (int64_t)(r0 + r) * D;
        for (int d = 0; d < D; d++) {
            float a = acc[d] * alpha[r];
            for (int j = 0; j < KEY_TILE; j++) a = fmaf(p[r][j], values[(int64_t)j * D + d], a);
            acc[d] = a;
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INT_KEYS 1
/* acc + the int16 pair products of k with the 2 int16 at p in every lane, broadcast by the load
 * itself ({1to16}; compilers emit a separate vpbroadcastd). */
static inline __m512i dpwssd_broadcast(__m512i acc, __m512i k, const int16_t *p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(k), "m"(*(const int32_t *)p));
    return acc;
}

/* Scores of rows [r0, r0 + nr) against a tile of q8_0 or q4_0 keys, in integers: each group of 32 is an
 * exact int32 sum of int16 query codes times the keys' codes (32 products an instruction instead of
 * 16 FMAs), scaled by the key's group scale, then by the row's query scale. The query's int16
 * rounding (relative error under 2e-5 of its largest element) is the only difference from the f32
 * path; the sums are exact, so a row's scores do not depend on its tile or chunk. */
static inline __attribute__((always_inline)) void int_key_scores(const prefill_work *w, int r0, const int nr, int D,
                                                                 float s[][KEY_TILE]) {
    for (int grp = 0; grp < D / GROUP; grp++) {
        __m512i a[ROWS][KEY_TILE / 16];
        for (int r = 0; r < nr; r++)
            for (int v = 0; v < KEY_TILE / 16; v++) a[r][v] = _mm512_setzero_si512();
        for (int p = grp * GROUP / 2; p < (grp + 1) * GROUP / 2; p++) {
            const int16_t *kp = w->kq + (int64_t)p * KEY_TILE * 2;
            __m512i k[KEY_TILE / 16];
            for (int v = 0; v < KEY_TILE / 16; v++) k[v] = _mm512_loadu_si512((const void *)(kp + 32 * v));
            for (int r = 0; r < nr; r++) {
                const int16_t *qp = w->q16 + (int64_t)(r0 + r) * D + 2 * p;
                for (int v = 0; v < KEY_TILE / 16; v++) a[r][v] = dpwssd_broadcast(a[r][v], k[v], qp);
            }
        }
        for (int v = 0; v < KEY_TILE / 16; v++) {
            const __m512 ks = _mm512_loadu_ps(w->ks + grp * KEY_TILE + 16 * v);
            for (int r = 0; r < nr; r++) {
                __m512 part = _mm512_cvtepi32_ps(a[r][v]);
                _mm512_storeu_ps(s[r] + 16 * v, grp == 0 ? _mm512_mul_ps(part, ks)
                                                         : _mm512_fmadd_ps(part, ks, _mm512_loadu_ps(s[r] + 16 * v)));
            }
        }
    }
    for (int r = 0; r < nr; r++) {
        const __m512 qs = _mm512_set1_ps(w->q16_scale[r0 + r]);
        for (int v = 0; v < KEY_TILE / 16; v++) _mm512_storeu_ps(s[r] + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(s[r] + 16 * v), qs));
    }
}

/* The pre-scaled query row q [D] -> q16 with q ~ q16 * scale, |q16| <= 32767. */
static void query_to_int16(const float *q, int D, int16_t *q16, float *scale) {
    float amax = 0.0f;
    for (int i = 0; i < D; i++) amax = fabsf(q[i]) > amax ? fabsf(q[i]) : amax;
    const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    for (int i = 0; i < D; i++) {
        float c = __builtin_rintf(q[i] * inv);
        q16[i] = (int16_t)(c > 32767.0f ? 32767.0f : c < -32767.0f ? -32767.0f : c);
    }
    *scale = amax / 32767.0f;
}

/* A key's 32 codes of group g as int16, in the lane order the query was permuted into: q8_0 as stored,
 * q4_0 its 16 low nibbles then its 16 high nibbles, each minus 8. */
static inline __m512i group_codes(int kind, const uint8_t *codes, int g) {
    if (kind == KV_Q8_0) return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(codes + g * GROUP)));
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + g * GROUP / 2)));
    const __m256i eight = _mm256_set1_epi16(8);
    const __m256i lo = _mm256_sub_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(15)), eight);
    const __m256i hi = _mm256_sub_epi16(_mm256_srli_epi16(bytes, 4), eight);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* Keys [kb, kb + nk) of a q8_0 or q4_0 kv head -> w->kq (int16 pairs) and w->ks (f32 group scales); keys
 * past nk get zero codes and scales (exact zero scores, masked anyway). */
static void load_int_keys(const problem *P, const int64_t *table, int kvh, int64_t kb, int nk, prefill_work *w) {
    const int D = P->head_dim, bs = P->block_size;
    for (int j0 = 0; j0 < KEY_TILE; j0 += 16) {
        const uint8_t *c[16];
        for (int i = 0; i < 16; i++) {
            const int j = j0 + i;
            const uint16_t *sc = NULL;
            c[i] = NULL;
            if (j < nk) {
                const int64_t t = kb + j, row = ((int64_t)kvh * P->num_blocks + table[t / bs]) * bs + t % bs;
                c[i] = P->k.codes + row * P->k.code_stride;
                sc = (const uint16_t *)(P->k.scales + row * P->k.scale_stride);
            }
            for (int g = 0; g < D / GROUP; g++) w->ks[g * KEY_TILE + j] = sc ? half_to_float(sc[g]) : 0.0f;
        }
        for (int g = 0; g < D / GROUP; g++) { /* 32 codes = 16 pairs of each of the 16 keys, transposed */
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = c[i] ? group_codes(P->k.kind, c[i], g) : _mm512_setzero_si512();
            transpose_16x16(r);
            for (int p = 0; p < 16; p++)
                _mm512_storeu_si512((void *)(w->kq + ((int64_t)(g * 16 + p) * KEY_TILE + j0) * 2), r[p]);
        }
    }
}
#endif

/* Rows [r0, r0 + nr) (row = query * G + head in group) against the key tile at kb. nr is a constant in
 * each specialization (prefill_key_tile below): the accumulators then stay in registers (with a
 * run-time nr the compiler kept them on the stack and tested nr inside the FMA loops). */
static inline __attribute__((always_inline)) void key_tile_rows(prefill_work *w, int r0, const int nr, int G, int D,
                                                                int64_t first_pos, int64_t kb, int window) {
    float s[ROWS][KEY_TILE], alpha[ROWS];
#if defined(INT_KEYS)
    if (w->kq) {
        int_key_scores(w, r0, nr, D, s);
    } else {
#endif
    for (int c0 = 0; c0 < KEY_TILE; c0 += 4 * VL) { /* each score an FMA chain over d, on every path */
        vf a[ROWS][4];
        for (int r = 0; r < nr; r++)
            for (int v = 0; v < 4; v++) a[r][v] = vf_zero();
        for (int d = 0; d < D; d++) {
            const float *kd = w->kt + (int64_t)d * KEY_TILE + c0;
            const vf k0 = vf_load(kd), k1 = vf_load(kd + VL), k2 = vf_load(kd + 2 * VL), k3 = vf_load(kd + 3 * VL);
            for (int r = 0; r < nr; r++) {
                const vf qd = vf_set1(w->q[(int64_t)(r0 + r) * D + d]);
                a[r][0] = vf_fma(qd, k0, a[r][0]);
                a[r][1] = vf_fma(qd, k1, a[r][1]);
                a[r][2] = vf_fma(qd, k2, a[r][2]);
                a[r][3] = vf_fma(qd, k3, a[r][3]);
            }
        }
        for (int r = 0; r < nr; r++)
            for (int v = 0; v < 4; v++) vf_store(s[r] + c0 + VL * v, a[r][v]);
    }
#if defined(INT_KEYS)
    }
#endif
    for (int r = 0; r < nr; r++) {
        uint64_t visible = visible_keys(first_pos + (r0 + r) / G, kb, window);
        if (visible) {
            alpha[r] = softmax_update(w, r0 + r, s[r], visible);
        } else { /* nothing visible: the row's sums stay exactly as they are */
            alpha[r] = 1.0f;
            memset(s[r], 0, sizeof(s[r]));
        }
    }
    accumulate_values(w, r0, nr, D, s, alpha, w->values);
}

static void prefill_key_tile(prefill_work *w, int r0, int nr, int G, int D, int64_t first_pos, int64_t kb, int window) {
    switch (nr) {
#if ROWS >= 6
    case 6: key_tile_rows(w, r0, 6, G, D, first_pos, kb, window); break;
    case 5: key_tile_rows(w, r0, 5, G, D, first_pos, kb, window); break;
#endif
#if ROWS >= 4
    case 4: key_tile_rows(w, r0, 4, G, D, first_pos, kb, window); break;
#endif
#if ROWS >= 3
    case 3: key_tile_rows(w, r0, 3, G, D, first_pos, kb, window); break;
#endif
    case 2: key_tile_rows(w, r0, 2, G, D, first_pos, kb, window); break;
    default: key_tile_rows(w, r0, 1, G, D, first_pos, kb, window); break;
    }
}

/* Decoded rows of positions [t, t + n) of one kv head -> dst [n][D] (walking the block table). */
static void decode_positions(const problem *P, const kv_part *part, const int64_t *table, int kvh, int64_t t,
                             int n, float *dst) {
    const int D = P->head_dim, bs = P->block_size;
    for (int64_t end = t + n; t < end;) {
        int64_t b = t / bs, off = t % bs;
        int nr = (int)(bs - off < end - t ? bs - off : end - t);
        decode_rows(part, ((int64_t)kvh * P->num_blocks + table[b]) * bs + off, nr, D, dst);
        dst += (int64_t)nr * D;
        t += nr;
    }
}

static void prefill_task(const problem *P, const int64_t *table, int64_t q_start, int kvh, int t0, int tn,
                         prefill_work *w) {
    const int D = P->head_dim, G = P->num_heads / P->num_kv_heads, rows = tn * G;
    int order[D];
    lane_order(P->k.kind, D, order);
    for (int row = 0; row < rows; row++) {
        const float *qe = P->q + ((int64_t)(t0 + row / G) * P->num_heads + (int64_t)kvh * G + row % G) * D;
        for (int i = 0; i < D; i++) w->q[(int64_t)row * D + i] = qe[order[i]] * P->scale;
#if defined(INT_KEYS)
        if (w->kq) query_to_int16(w->q + (int64_t)row * D, D, w->q16 + (int64_t)row * D, w->q16_scale + row);
#endif
        memset(w->acc + (int64_t)row * D, 0, sizeof(float) * D);
        w->m[row] = -FLT_MAX;
        w->l[row] = 0.0f;
    }
    const int64_t first_pos = q_start + t0, last_pos = first_pos + tn - 1;
    const int64_t lo = P->window > 0 && first_pos - P->window + 1 > 0 ? first_pos - P->window + 1 : 0;
    for (int64_t kb = lo / KEY_TILE * KEY_TILE; kb <= last_pos; kb += KEY_TILE) {
        const int nk = (int)(last_pos + 1 - kb < KEY_TILE ? last_pos + 1 - kb : KEY_TILE);
        decode_positions(P, &P->v, table, kvh, kb, nk, w->values);
        memset(w->values + (int64_t)nk * D, 0, sizeof(float) * (size_t)(KEY_TILE - nk) * D);
#if defined(INT_KEYS)
        if (w->kq) {
            load_int_keys(P, table, kvh, kb, nk, w);
        } else
#endif
        {
            decode_positions(P, &P->k, table, kvh, kb, nk, w->keys);
            memset(w->keys + (int64_t)nk * D, 0, sizeof(float) * (size_t)(KEY_TILE - nk) * D);
            transpose_keys(w->keys, D, w->kt);
        }
        /* rows whose query sees some key of this tile: query position >= kb */
        const int first_row = (int)(kb > first_pos ? (kb - first_pos) * G : 0);
        for (int r0 = first_row; r0 < rows; r0 += ROWS)
            prefill_key_tile(w, r0, rows - r0 < ROWS ? rows - r0 : ROWS, G, D, first_pos, kb, P->window);
    }
    lane_order(P->v.kind, D, order);
    for (int row = 0; row < rows; row++) {
        float *o = P->out + ((int64_t)(t0 + row / G) * P->num_heads + (int64_t)kvh * G + row % G) * D;
        const float *acc = w->acc + (int64_t)row * D;
        float inv = w->l[row] > 0.0f ? 1.0f / w->l[row] : 0.0f;
        for (int i = 0; i < D; i++) o[order[i]] = acc[i] * inv;
    }
}

/* q, out [n, num_heads, head_dim] for positions q_start .. q_start + n - 1 of one sequence whose
 * blocks are block_table; the cache holds its keys up to q_start + n - 1. Returns 0, or -1 when the
 * workspace could not be allocated. */
int paged_prefill_attention(int n, int64_t q_start, int num_heads, int num_kv_heads, int head_dim, const float *q,
                            float *out, const int64_t *block_table, int num_blocks, int block_size, int window,
                            float scale, int k_kind, const void *k_codes, const void *k_scales,
                            int64_t k_code_stride, int64_t k_scale_stride, const float *k_table, int v_kind,
                            const void *v_codes, const void *v_scales, int64_t v_code_stride,
                            int64_t v_scale_stride, const float *v_table, int num_threads) {
    problem P = {num_heads, num_kv_heads, head_dim, num_blocks, block_size, window, scale, q, out,
                 block_table, 0, NULL,
                 {k_kind, k_codes, k_scales, k_code_stride, k_scale_stride, k_table},
                 {v_kind, v_codes, v_scales, v_code_stride, v_scale_stride, v_table}};
    const int G = num_heads / num_kv_heads, D = head_dim, tiles = (n + QUERY_TILE - 1) / QUERY_TILE;
    const int rows = QUERY_TILE * G;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (tiles * num_kv_heads > 1)
    {
        prefill_work w = {0};
        float *mem = malloc(sizeof(float) * ((size_t)rows * (2 * D + 2) + (size_t)KEY_TILE * D * 3));
        if (!mem) {
#pragma omp atomic write
            failed = 1;
        } else {
            w.q = mem;
            w.acc = w.q + (size_t)rows * D;
            w.m = w.acc + (size_t)rows * D;
            w.l = w.m + rows;
            w.keys = w.l + rows;
            w.values = w.keys + (size_t)KEY_TILE * D;
            w.kt = w.values + (size_t)KEY_TILE * D;
        }
        void *int_mem = NULL;
#if defined(INT_KEYS)
        if (mem && (k_kind == KV_Q8_0 || k_kind == KV_Q4_0)) { /* integer scores (int_key_scores) */
            int_mem = malloc(sizeof(int16_t) * ((size_t)rows * D + (size_t)KEY_TILE * D) +
                             sizeof(float) * ((size_t)rows + (size_t)KEY_TILE * (D / GROUP)));
            if (!int_mem) {
#pragma omp atomic write
                failed = 1;
            } else {
                w.q16_scale = int_mem;
                w.ks = w.q16_scale + rows;
                w.q16 = (int16_t *)(w.ks + (size_t)KEY_TILE * (D / GROUP));
                w.kq = w.q16 + (size_t)rows * D;
            }
        }
#endif
        /* the last tiles see the longest history: hand them out first */
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tiles * num_kv_heads; task++) {
            if (failed || !mem) continue;
            int tile = tiles - 1 - task / num_kv_heads, kvh = task % num_kv_heads;
            int t0 = tile * QUERY_TILE, tn = n - t0 < QUERY_TILE ? n - t0 : QUERY_TILE;
            prefill_task(&P, block_table, q_start, kvh, t0, tn, &w);
        }
        free(mem);
        free(int_mem);
    }
    return failed ? -1 : 0;
}

/* 1 where this build scores q8_0 and q4_0 keys in integers in prefill (AVX-512 VNNI), else 0. */
int paged_prefill_int_keys(void) {
#if defined(INT_KEYS)
    return 1;
#else
    return 0;
#endif
}
