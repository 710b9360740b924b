/* The byte arithmetic of int4_matmul.c's packed layouts (kernels.h's QL_*), shared by the kernel that reads
 * them and block_repack.c, which writes them: a panel of 16 rows is, per group of 32 inputs, the codes'
 * nibble chunks (CODE_BYTES) and bit planes, then the group's scale fields; a K-quant's super-block scales
 * (d, dmin for 16 rows) open each run of 8 groups. */
#ifndef KVSERVE_QL_LAYOUT_H
#define KVSERVE_QL_LAYOUT_H

#include <stdint.h>

#include "kernels.h"

#define CODE_BYTES 256 /* a group's 4-bit codes for 16 rows */

static inline int code_bits(int layout) {
    static const int bits[] = {[QL_F16] = 4,  [QL_F32] = 4,  [QL_Q4_0] = 4, [QL_Q5_0] = 5, [QL_Q5_1] = 5,
                               [QL_Q4_K] = 4, [QL_Q5_K] = 5, [QL_Q6_K] = 6, [QL_Q2_K] = 2, [QL_Q3_K] = 3};
    return bits[layout];
}
/* Bytes of a group's codes (where its scales start), of the whole group, and of the super-block scales
 * before each run of 8 groups. */
static inline int code_bytes(int layout) {
    const int bits = code_bits(layout);
    return bits >= 4 ? CODE_BYTES + 64 * (bits - 4) : 64 * bits;
}
static inline int group_bytes(int layout) {
    static const int bytes[] = {[QL_F16] = 320,  [QL_F32] = 384,  [QL_Q4_0] = 288, [QL_Q5_0] = 352,
                                [QL_Q5_1] = 384, [QL_Q4_K] = 288, [QL_Q5_K] = 352, [QL_Q6_K] = 416,
                                [QL_Q2_K] = 160, [QL_Q3_K] = 224};
    return bytes[layout];
}
static inline int super_bytes(int layout) {
    return layout == QL_Q4_K || layout == QL_Q5_K || layout == QL_Q2_K ? 64 : layout == QL_Q6_K || layout == QL_Q3_K ? 32 : 0;
}
/* Bytes of one panel of G groups. */
static inline int64_t panel_bytes_of(int layout, int G) {
    return (int64_t)G * group_bytes(layout) + (int64_t)(G / 8) * super_bytes(layout);
}

#endif
