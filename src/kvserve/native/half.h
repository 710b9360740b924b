/* f16 -> f32 (exact), shared by the kernels that read f16 scales or values. */
#ifndef KVSERVE_HALF_H
#define KVSERVE_HALF_H
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do { mant <<= 1; e++; } while (!(mant & 0x400));
            bits = sign | (uint32_t)(127 - 15 - e) << 23 | (mant & 0x3FF) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | mant << 13;
    } else {
        bits = sign | (exp + 127 - 15) << 23 | mant << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

#endif
