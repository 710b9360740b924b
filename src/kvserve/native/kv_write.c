/* Encodes this step's K or V and stores it at its slots of the paged, head-major storage, in one
 * pass: for q8_0 the torch path is ~10 ops per write (group, amax, scale, round, clamp, scatter),
 * 120 a decode step; for tq2-4 ~15 (rotate, norm, bucketize, codebook norm, bit packing).
 * f32/f16/bf16/q8_0/q4_0: bit-for-bit the same codes as kv/codecs.py (round half to even, the f16
 * scale rounded before its inverse is taken). tq2-4: the same steps in the same float precision; the
 * rotation is a fast Walsh-Hadamard transform (hadamard.h) whose sums run in another order than torch's
 * matmul, so a coordinate within rounding of a bucket edge may land in the bucket next to it, and the norm
 * may differ in its last f16 bit.
 *
 *   x [tokens, kv_heads, D] f32  --(slot_rows[h * tokens + t])-->  codes/scales row of (h, t)
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "hadamard.h"
#include "kernels.h"
#include "kv_kinds.h"

static inline uint16_t float_to_bf16(float f) { /* round to nearest even (finite inputs), as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* tqB (kv/codecs.py RotatedCodec): y = x @ rotation, unit = y / |y|, code = number of bucket edges
 * (midpoints of the levels) below unit, packed little-endian B bits a code; scale = |y| / |levels[code]|. */
static void encode_rotated(int bits, const float *x, int D, const float *rotation, const float *levels,
                           uint8_t *code, uint8_t *scale) {
    float y[D], edges[15];
    const int n_edges = (1 << bits) - 1;
    for (int e = 0; e < n_edges; e++) edges[e] = (levels[e] + levels[e + 1]) * 0.5f;
    hadamard_rotate(x, rotation, D, y);
    float squares = 0.0f;
    for (int j = 0; j < D; j++) squares += y[j] * y[j];
    const float norm = __builtin_sqrtf(squares), divisor = norm > 1e-30f ? norm : 1e-30f;
    memset(code, 0, (size_t)D * bits / 8);
    float recon = 0.0f;
    for (int j = 0; j < D; j++) {
        const float unit = y[j] / divisor;
        int idx = 0;
        for (int e = 0; e < n_edges; e++) idx += unit > edges[e];
        recon += levels[idx] * levels[idx];
        const int bit = j * bits, shift = bit & 7;
        code[bit >> 3] |= (uint8_t)(idx << shift);
        if (shift + bits > 8) code[(bit >> 3) + 1] |= (uint8_t)(idx >> (8 - shift));
    }
    recon = __builtin_sqrtf(recon);
    ((uint16_t *)scale)[0] = float_to_half(norm / (recon > 1e-30f ? recon : 1e-30f));
}

static void encode_vector(int kind, const float *x, int D, uint8_t *code, uint8_t *scale, const float *rotation,
                          const float *levels) {
    switch (kind) {
    case KV_F32:
        memcpy(code, x, sizeof(float) * D);
        break;
    case KV_F16:
        for (int i = 0; i < D; i++) ((uint16_t *)code)[i] = float_to_half(x[i]);
        break;
    case KV_BF16:
        for (int i = 0; i < D; i++) ((uint16_t *)code)[i] = float_to_bf16(x[i]);
        break;
    case KV_Q8_0:
        for (int g = 0; g < D / GROUP; g++) {
            const float *xg = x + g * GROUP;
            float amax = 0.0f;
            for (int j = 0; j < GROUP; j++) {
                float a = xg[j] < 0 ? -xg[j] : xg[j];
                amax = a > amax ? a : amax;
            }
            uint16_t d = float_to_half(amax / 127.0f);
            float df = half_to_float(d), inv = df > 0.0f ? 1.0f / df : 0.0f;
            ((uint16_t *)scale)[g] = d;
            int8_t *q = (int8_t *)code + g * GROUP;
            for (int j = 0; j < GROUP; j++) {
                float r = __builtin_rintf(xg[j] * inv);
                q[j] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
            }
        }
        break;
    case KV_Q4_0: /* llama.cpp: d = (the value of largest magnitude) / -8, code = clamp(floor(x / d + 8.5), 0, 15) */
        for (int g = 0; g < D / GROUP; g++) {
            const float *xg = x + g * GROUP;
            float amax = 0.0f, vmax = 0.0f;
            for (int j = 0; j < GROUP; j++) {
                float a = xg[j] < 0 ? -xg[j] : xg[j];
                if (a > amax) { /* the first of equal magnitudes, as torch's argmax */
                    amax = a;
                    vmax = xg[j];
                }
            }
            uint16_t d = float_to_half(vmax / -8.0f);
            float df = half_to_float(d), inv = df != 0.0f ? 1.0f / df : 0.0f;
            ((uint16_t *)scale)[g] = d;
            uint8_t *q = code + g * (GROUP / 2);
            for (int j = 0; j < GROUP / 2; j++) {
                float lo = __builtin_floorf(xg[2 * j] * inv + 8.5f), hi = __builtin_floorf(xg[2 * j + 1] * inv + 8.5f);
                lo = lo < 0.0f ? 0.0f : lo > 15.0f ? 15.0f : lo;
                hi = hi < 0.0f ? 0.0f : hi > 15.0f ? 15.0f : hi;
                q[j] = (uint8_t)lo | (uint8_t)hi << 4;
            }
        }
        break;
    case KV_TQ2:
    case KV_TQ3:
    case KV_TQ4:
        encode_rotated(kind - KV_TQ2 + 2, x, D, rotation, levels, code, scale);
        break;
    }
}

/* rotation [D] f32: the signs of the tq codecs' rotation, or of a rotated q8_0/q4_0 key codec's (applied
 * here before the codes; hadamard.h); levels [2^B]: the tq codebook (NULL for the others). centre
 * [kv_heads][D] f32: subtracted from each head's vector first (keys centred by a fixed vector: see kv/storage.py), or NULL; balance
 * [kv_heads][D] f32: the centred vector times it, coordinate by coordinate (keys balanced against the
 * queries, which the attention kernels divide by it), or NULL. */
void kv_write(int kind, const float *x, int tokens, int kv_heads, int D, const int64_t *slot_rows, uint8_t *codes,
              int64_t code_stride, uint8_t *scales, int64_t scale_stride, const float *rotation,
              const float *levels, const float *centre, const float *balance) {
    const int rotate_here = rotation && kind != KV_TQ2 && kind != KV_TQ3 && kind != KV_TQ4;
#pragma omp parallel for if (tokens >= 64)
    for (int t = 0; t < tokens; t++)
        for (int h = 0; h < kv_heads; h++) {
            int64_t row = slot_rows[(int64_t)h * tokens + t];
            const float *v = x + ((int64_t)t * kv_heads + h) * D;
            float centred[D], rotated[D];
            if (centre || balance) {
                for (int i = 0; i < D; i++) {
                    float c = centre ? v[i] - centre[(int64_t)h * D + i] : v[i];
                    centred[i] = balance ? c * balance[(int64_t)h * D + i] : c;
                }
                v = centred;
            }
            if (rotate_here) {
                hadamard_rotate(v, rotation, D, rotated);
                v = rotated;
            }
            encode_vector(kind, v, D, codes + row * code_stride, scales ? scales + row * scale_stride : NULL,
                          rotation, levels);
        }
}
