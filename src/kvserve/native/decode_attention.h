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
#include "decode_scores.h"
#include "hadamard.h"
#include "kv_rows.h"
#include "softcap.h"

/* acc_g += sum_r w[g * PARTITION + r] * row_r for H query heads (at most 4 with AVX-512, else 8); acc_g at
 * out + g * (D + 2). H is a constant in each specialization, so with D a multiple of 64 the H x 4
 * accumulators of a 64-wide slice stay in registers across the rows, each row's vectors loaded (and
 * decoded) once. Each lane is an FMA chain over the rows in order: the same bits however heads group. */
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
    if (H > 4 && D % VL == 0) { /* H x 1 accumulators across the rows: each row vector decoded once for H heads */
        for (int d = 0; d < D; d += VL) {
            vf a[8];
            for (int g = 0; g < H; g++) a[g] = vf_load(out + g * (D + 2) + d);
            for (int r = 0; r < nr; r++) {
                const vf v = row_vector(R, r, d, D, kind);
                for (int g = 0; g < H; g++) a[g] = vf_fma(vf_set1(w[g * PARTITION + r]), v, a[g]);
            }
            for (int g = 0; g < H; g++) vf_store(out + g * (D + 2) + d, a[g]);
        }
        return;
    }
    if (H <= 4 && D % (2 * VL) == 0) { /* H x 2 accumulators in registers across the rows, each row vector loaded once */
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

#if defined(__AVX512F__)
#define ACCUMULATE_HEADS 4
#define ACCUMULATE_MORE(kind)
#else /* up to 8 heads a sweep, one vector each: a group of 7 (Qwen2.5) decodes each value vector once */
#define ACCUMULATE_HEADS 8
#define ACCUMULATE_MORE(kind)                                                                                  \
    case 8: accumulate_heads(wg, R, nr, D, og, 8, kind); break;                                                \
    case 7: accumulate_heads(wg, R, nr, D, og, 7, kind); break;                                                \
    case 6: accumulate_heads(wg, R, nr, D, og, 6, kind); break;                                                \
    case 5: accumulate_heads(wg, R, nr, D, og, 5, kind); break;
#endif

#define ACCUMULATE_KIND(kind)                                                                                  \
    switch (H) {                                                                                               \
    ACCUMULATE_MORE(kind)                                                                                      \
    case 1: accumulate_heads(wg, R, nr, D, og, 1, kind); break;                                                \
    case 2: accumulate_heads(wg, R, nr, D, og, 2, kind); break;                                                \
    case 3: accumulate_heads(wg, R, nr, D, og, 3, kind); break;                                                \
    default: accumulate_heads(wg, R, nr, D, og, 4, kind); break;                                               \
    }

/* Every query head of the group, ACCUMULATE_HEADS at a time. */
static void block_accumulate(const float *w, const rows_view *R, int nr, int D, float *out, int G) {
    for (int g0 = 0; g0 < G; g0 += ACCUMULATE_HEADS) {
        const float *wg = w + g0 * PARTITION;
        float *og = out + g0 * (D + 2);
        int H = G - g0 < ACCUMULATE_HEADS ? G - g0 : ACCUMULATE_HEADS;
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

static int num_partitions(int64_t ctx) { return (int)((ctx + PARTITION - 1) / PARTITION); }

#endif
