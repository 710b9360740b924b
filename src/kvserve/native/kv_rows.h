/* Reading a layer's stored K or V rows of any KV type as f32, for both attention kernels
 * (decode_attention.h, prefill_attention.h), and the attention problem they are handed.
 * Storage is head-major [kv_heads, num_blocks, block_size, width] per part (codes, scales), as in
 * kv/storage.py. */
#ifndef KVSERVE_KV_ROWS_H
#define KVSERVE_KV_ROWS_H
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
    for (; i + VL <= n; i += VL) vf_store(dst + i, vf_from_half(h + i));
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
 * (at most 16) sit in one register (two on AVX2) and are picked with a permute instead of a memory
 * gather; the product with the vector's norm is the scalar loop's, so the same bits. */
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
#elif defined(__AVX2__) /* 8 levels a register: tq4's 16 in two, picked by the code's bit 3 */
        const __m256 lv0 = _mm256_loadu_ps(levels), lv1 = _mm256_loadu_ps(levels + 8), dv = _mm256_set1_ps(d);
        const __m256i m = _mm256_set1_epi32(mask), seven = _mm256_set1_epi32(7);
        for (; j + 8 <= bytes; j += 8) {
            const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + j)));
            for (int k = 0; k < per_byte; k++) {
                const __m256i code = _mm256_and_si256(_mm256_srli_epi32(x, bits * k), m);
                __m256 v = _mm256_permutevar8x32_ps(lv0, code);
                if (bits == 4)
                    v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(lv1, code),
                                         _mm256_castsi256_ps(_mm256_cmpgt_epi32(code, seven)));
                _mm256_storeu_ps(o + k * bytes + j, _mm256_mul_ps(v, dv));
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
            int w0 = 0;
#if defined(__AVX2__) /* the 8 levels in one register, 8 words at a time (as decode_small_codes) */
            const __m256 lv = _mm256_loadu_ps(cb), dv = _mm256_set1_ps(d);
            for (; w0 + 8 <= D / 8; w0 += 8) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(words + w0));
                for (int k = 0; k < 8; k++) {
                    const __m256i code = _mm256_and_si256(_mm256_srli_epi32(x, 3 * k), _mm256_set1_epi32(7));
                    _mm256_storeu_ps(o + k * (D / 8) + w0, _mm256_mul_ps(_mm256_permutevar8x32_ps(lv, code), dv));
                }
            }
#endif
            for (int k = 0; k < 8; k++)
                for (int w = w0; w < D / 8; w++) o[k * (D / 8) + w] = cb[(words[w] >> (3 * k)) & 7] * d;
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

#endif
