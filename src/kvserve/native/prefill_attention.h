/* Prefill attention (the steps of paged_attention.c's paged_prefill_attention): a chunk of consecutive queries of one sequence (positions q_start ..) against its
 * history, causal (and windowed), flash-style: per query an online softmax over 64-key tiles.
 *
 * Tasks are (kv head, tile of QUERY_TILE queries); a task decodes each key tile of the history once
 * into L1 (any KV type, as decode does), transposes the keys to [head_dim][64] so sixty-four scores
 * are four FMA chains per query (no horizontal sums), and feeds every query head of the group. Key
 * tiles sit on a fixed grid of absolute positions and masked lanes contribute exact zeros, so a
 * query's arithmetic depends only on its position and the keys: a prompt gives the same bits whole
 * or in chunks, on any number of threads.
 */
#ifndef KVSERVE_PREFILL_ATTENTION_H
#define KVSERVE_PREFILL_ATTENTION_H
#include "kv_rows.h"
#include "softcap.h"

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
    float softcap; /* > 0: scores capped (softcap.h) before the softmax */
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
    if (w->softcap > 0.0f) /* on the scaled scores, every path's (integer keys' too) */
        for (int r = 0; r < nr; r++) softcap_scores(s[r], KEY_TILE, w->softcap);
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

#endif
