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

/* f32 -> f16, rounded to nearest even (as torch): the compiler's _Float16 where it has one, F16C's
 * instruction, or (portable builds) the same rounding on the bits. */
static inline uint16_t float_to_half(float f) {
#if defined(__FLT16_MANT_DIG__) && !defined(KVSERVE_PORTABLE)
    _Float16 h = (_Float16)f;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return bits;
#elif defined(__F16C__) && !defined(KVSERVE_PORTABLE)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, mant = x & 0x7FFFFF;
    const int exp = (int)((x >> 23) & 0xFF), e = exp - 127 + 15;
    if (exp == 0xFF) return (uint16_t)(sign | 0x7C00 | (mant ? 0x200 | mant >> 13 : 0)); /* inf, nan (its payload kept) */
    if (e >= 31) return (uint16_t)(sign | 0x7C00);                          /* overflow */
    if (e <= 0) {                                                            /* a subnormal half, or zero */
        if (e < -10) return (uint16_t)sign;
        const int shift = 14 - e;
        const uint32_t m = mant | 0x800000, half = 1u << (shift - 1), rest = m & ((1u << shift) - 1);
        uint32_t h = m >> shift;
        h += rest > half || (rest == half && (h & 1));
        return (uint16_t)(sign | h);
    }
    uint32_t h = (uint32_t)e << 10 | mant >> 13;
    const uint32_t rest = mant & 0x1FFF;
    h += rest > 0x1000 || (rest == 0x1000 && (h & 1)); /* a carry into the exponent rounds up to inf */
    return (uint16_t)(sign | h);
#endif
}

#endif
