/* GGUF block-quantized rows rearranged into int4_matmul.c's layouts (kernels.h's QL_*), straight from the
 * file's bytes: the codes and scales as the file states them, moved, never dequantized. The loader's
 * share of a model's start-up; models/block_layouts.py's pack_blocks_reference is the same in numpy, and
 * the tests hold the two to the same bytes.
 *
 * For each panel of 16 rows and group of 32 weights, each row (lane) is decoded into its 32 codes (0..63)
 * and its scale fields, then written to the group's block: the nibble chunks (chunk c, byte 4 * lane + i:
 * the codes of k-quads 2c and 2c + 1), the fifth (sixth) bits' planes, then each scale field for the 16
 * lanes side by side; the K-quants' d (and dmin) for 16 lanes open each run of 8 groups. Codes of 2 or 3
 * bits (Q2_K, Q3_K) have no nibble chunks: their bits 0-1 go to the planes of crumbs, bit 2 to a plane
 * of bits. Rows past the
 * tensor's end are zeros. Panels are independent: the threads split them.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "ql_layout.h"

#define PANEL 16
#define GROUP 32

/* One row's group g: its 32 codes and its scale fields (up to 2, of `width` bytes each). */
typedef struct {
    uint8_t codes[GROUP];
    uint8_t field[2][2];
} RowGroup;

/* The file's bytes per block and weights per block. */
static inline int file_block_bytes(int layout) {
    static const int bytes[] = {[QL_F16] = 20,   [QL_Q4_0] = 18,  [QL_Q5_0] = 22,  [QL_Q5_1] = 24, [QL_Q4_K] = 144,
                                [QL_Q5_K] = 176, [QL_Q6_K] = 210, [QL_Q2_K] = 84, [QL_Q3_K] = 110};
    return bytes[layout];
}
static inline int file_block_weights(int layout) { return layout >= QL_Q4_K ? 256 : 32; }
/* Bytes of each scale field. */
static inline int field_width(int layout) { return layout >= QL_Q4_K ? 1 : 2; }
static inline int field_count(int layout) { return layout == QL_Q4_0 || layout == QL_Q5_0 ? 1 : 2; }
/* Where a K-quant block keeps d (then dmin, where it has one). */
static inline int d_offset(int layout) { return layout == QL_Q6_K ? 208 : layout == QL_Q3_K ? 108 : layout == QL_Q2_K ? 80 : 0; }

/* 6-bit scale and minimum j of a Q4_K / Q5_K block's 12 scale bytes. */
static inline void k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* Inlined into each layout's own copy of the packer (PACKERS below): with the layout a constant, the
 * branches on it vanish and the index arithmetic folds to shifts (4-7x the speed of one generic copy). */
#define INLINE static inline __attribute__((always_inline))

INLINE void decode_group(const uint8_t *row, int layout, int g, RowGroup *out) {
    if (layout < QL_Q4_K) { /* 32-weight blocks: d (m) (qh) qs */
        const uint8_t *b = row + (int64_t)g * file_block_bytes(layout);
        const int affine = layout == QL_F16 || layout == QL_Q5_1, five = layout == QL_Q5_0 || layout == QL_Q5_1;
        const uint8_t *qs = b + file_block_bytes(layout) - 16;
        uint32_t qh = 0;
        if (five) memcpy(&qh, b + (affine ? 4 : 2), 4);
        for (int j = 0; j < 16; j++) {
            out->codes[j] = (uint8_t)((qs[j] & 0x0F) | (five ? ((qh >> j) & 1) << 4 : 0));
            out->codes[j + 16] = (uint8_t)((qs[j] >> 4) | (five ? ((qh >> (j + 16)) & 1) << 4 : 0));
        }
        memcpy(out->field[0], b, 2);
        if (affine) memcpy(out->field[1], b + 2, 2);
        return;
    }
    const uint8_t *b = row + (int64_t)(g / 8) * file_block_bytes(layout);
    const int sub = g % 8;
    if (layout == QL_Q6_K) {
        /* weight e = 32 sub + i, in half h = sub / 4: its low nibble in ql[64 h + 32 (sub % 2) + i] at bit
         * 4 (sub % 4 / 2), its high 2 bits in qh[32 h + i] at bit 2 (sub % 4) */
        const uint8_t *ql = b + 64 * (sub / 4) + 32 * (sub % 2), *qh = b + 128 + 32 * (sub / 4);
        const int low_shift = 4 * (sub % 4 / 2), high_shift = 2 * (sub % 4);
        for (int i = 0; i < GROUP; i++)
            out->codes[i] = (uint8_t)(((ql[i] >> low_shift) & 0x0F) | ((qh[i] >> high_shift) & 3) << 4);
        out->field[0][0] = b[192 + 2 * sub];
        out->field[1][0] = b[192 + 2 * sub + 1];
        return;
    }
    if (layout == QL_Q2_K || layout == QL_Q3_K) { /* weight e: bits 2 (e % 128 / 32) of byte e / 128 * 32 + e % 32 */
        const uint8_t *qs = layout == QL_Q2_K ? b + 16 : b + 32;
        for (int i = 0; i < GROUP; i++) {
            const int e = sub * GROUP + i;
            int code = (qs[e / 128 * 32 + e % 32] >> (2 * (e % 128 / 32))) & 3;
            if (layout == QL_Q3_K) code |= ((b[e % 32] >> (e / 32)) & 1) << 2; /* hmask: bit e / 32 of byte e % 32 */
            out->codes[i] = (uint8_t)code;
        }
        for (int half = 0; half < 2; half++) {
            const int j = 2 * sub + half; /* the block's 16-weight scale j */
            if (layout == QL_Q2_K) {
                out->field[half][0] = b[j];
            } else { /* 6 bits: the low 4 from bytes 0-7, the high 2 from bytes 8-11 */
                const uint8_t *s = b + 96;
                const int low = j < 8 ? s[j] & 0x0F : s[j - 8] >> 4, high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
                out->field[half][0] = (uint8_t)(int8_t)((low | high << 4) - 32);
            }
        }
        return;
    }
    const uint8_t *qs = b + file_block_bytes(layout) - 128 + 32 * (sub / 2);
    for (int i = 0; i < GROUP; i++) {
        int code = sub % 2 ? qs[i] >> 4 : qs[i] & 0x0F;
        if (layout == QL_Q5_K) code |= ((b[16 + i] >> sub) & 1) << 4;
        out->codes[i] = (uint8_t)code;
    }
    k_scale_min(b + 4, sub, &out->field[0][0], &out->field[1][0]);
}

/* Panel p's bytes (rows [16 p, 16 p + 16) of the tensor, those past `rows` zeros). */
INLINE void pack_panel(const uint8_t *raw, int layout, int64_t row_bytes, int64_t rows, int cols, int64_t p,
                       uint8_t *panel) {
    const int G = cols / GROUP, block = group_bytes(layout), super = super_bytes(layout), bits = code_bits(layout);
    const int width = field_width(layout), fields = field_count(layout);
    const int scales_at = code_bytes(layout);
    for (int g = 0; g < G; g++) {
        uint8_t *head = panel + (int64_t)(g / 8) * (super + 8 * block) * (super > 0);
        uint8_t *blk = super ? head + super + (g % 8) * block : panel + (int64_t)g * block;
        memset(blk, 0, (size_t)block);
        if (super && g % 8 == 0) memset(head, 0, (size_t)super);
        for (int lane = 0; lane < PANEL; lane++) {
            const int64_t r = p * PANEL + lane;
            if (r >= rows) break;
            const uint8_t *row = raw + r * row_bytes;
            RowGroup rg;
            decode_group(row, layout, g, &rg);
            if (bits >= 4) { /* each of the lane's bytes written whole: no read-modify-write, no branch */
                uint8_t *own = blk + 4 * lane;
                const uint8_t *c = rg.codes;
                for (int chunk = 0; chunk < 4; chunk++)
                    for (int i = 0; i < 4; i++)
                        own[64 * chunk + i] = (uint8_t)((c[8 * chunk + i] & 0x0F) | (c[8 * chunk + 4 + i] & 0x0F) << 4);
                for (int i = 0; bits == 5 && i < 4; i++) {
                    unsigned plane = 0;
                    for (int quad = 0; quad < 8; quad++) plane |= ((c[4 * quad + i] >> 4) & 1u) << quad;
                    own[256 + i] = (uint8_t)plane;
                }
                for (int half = 0; bits == 6 && half < 2; half++)
                    for (int i = 0; i < 4; i++) {
                        unsigned plane = 0;
                        for (int q = 0; q < 4; q++) plane |= ((c[4 * (4 * half + q) + i] >> 4) & 3u) << (2 * q);
                        own[256 + 64 * half + i] = (uint8_t)plane;
                    }
            }
            for (int k = 0; k < GROUP && bits < 4; k++) {
                const int quad = k / 4, i = k % 4, c = rg.codes[k];
                blk[64 * (quad / 4) + 4 * lane + i] |= (uint8_t)((c & 3) << (2 * (quad % 4)));
                if (bits == 3) blk[128 + 4 * lane + i] |= (uint8_t)(((c >> 2) & 1) << quad);
            }
            for (int f = 0; f < fields; f++) memcpy(blk + scales_at + f * PANEL * width + lane * width, rg.field[f], (size_t)width);
            if (super && g % 8 == 0) { /* d (f16), then dmin */
                const uint8_t *b = row + (int64_t)(g / 8) * file_block_bytes(layout) + d_offset(layout);
                memcpy(head + 2 * lane, b, 2);
                if (super == 64) memcpy(head + 32 + 2 * lane, b + 2, 2);
            }
        }
    }
}

typedef void (*PanelPacker)(const uint8_t *raw, int64_t row_bytes, int64_t rows, int cols, int64_t p, uint8_t *panel);
#define PACKER(L)                                                                                           \
    static void pack_panel_##L(const uint8_t *raw, int64_t row_bytes, int64_t rows, int cols, int64_t p,   \
                               uint8_t *panel) {                                                           \
        pack_panel(raw, L, row_bytes, rows, cols, p, panel);                                                \
    }
PACKER(QL_F16)
PACKER(QL_Q4_0)
PACKER(QL_Q5_0)
PACKER(QL_Q5_1)
PACKER(QL_Q4_K)
PACKER(QL_Q5_K)
PACKER(QL_Q6_K)
PACKER(QL_Q2_K)
PACKER(QL_Q3_K)
static const PanelPacker PACKERS[] = {[QL_F16] = pack_panel_QL_F16,   [QL_Q4_0] = pack_panel_QL_Q4_0,
                                      [QL_Q5_0] = pack_panel_QL_Q5_0, [QL_Q5_1] = pack_panel_QL_Q5_1,
                                      [QL_Q4_K] = pack_panel_QL_Q4_K, [QL_Q5_K] = pack_panel_QL_Q5_K,
                                      [QL_Q6_K] = pack_panel_QL_Q6_K, [QL_Q2_K] = pack_panel_QL_Q2_K,
                                      [QL_Q3_K] = pack_panel_QL_Q3_K};

int pack_gguf_blocks(const uint8_t *raw, int layout, int64_t rows, int cols, uint8_t *out, int num_threads) {
    if (layout < QL_F16 || layout > QL_Q3_K || layout == QL_F32 || cols % file_block_weights(layout)) return -1;
    const int64_t row_bytes = (int64_t)cols / file_block_weights(layout) * file_block_bytes(layout);
    const int G = cols / GROUP;
    const int64_t panel_bytes = panel_bytes_of(layout, G);
    const int64_t panels = (rows + PANEL - 1) / PANEL;
    const PanelPacker pack = PACKERS[layout];
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) pack(raw, row_bytes, rows, cols, p, out + p * panel_bytes);
    return 0;
}

/* Q8_0, Q5_0 or Q4_0 rows (`type`: kernels.h's INT8_FROM_*) as int8_matmul.c's groups: per panel of 16
 * rows and group of 32, the 16 rows' f16 d, then byte 32 * (k / 2) + 2 * lane + k % 2 = the code of
 * weight k of row lane (q - 16 for Q5_0, q - 8 for Q4_0: w = d * code as the file states it). */
INLINE void pack_int8_panel(const uint8_t *raw, int type, int64_t row_bytes, int64_t rows, int cols, int64_t p,
                            uint8_t *panel) {
    const int G = cols / GROUP, block_bytes = type == INT8_FROM_Q8_0 ? 34 : type == INT8_FROM_Q5_0 ? 22 : 18;
    for (int g = 0; g < G; g++) {
        uint8_t *blk = panel + (int64_t)g * 544;
        memset(blk, 0, 544);
        for (int lane = 0; lane < PANEL && p * PANEL + lane < rows; lane++) {
            const uint8_t *b = raw + (p * PANEL + lane) * row_bytes + (int64_t)g * block_bytes;
            memcpy(blk + 2 * lane, b, 2);
            int8_t codes[GROUP];
            if (type == INT8_FROM_Q8_0) {
                memcpy(codes, b + 2, GROUP);
            } else {
                const uint8_t *qs = b + block_bytes - 16;
                uint32_t qh = 0;
                if (type == INT8_FROM_Q5_0) memcpy(&qh, b + 2, 4);
                const int five = type == INT8_FROM_Q5_0, offset = five ? 16 : 8;
                for (int j = 0; j < 16; j++) {
                    codes[j] = (int8_t)(((qs[j] & 0x0F) | (five ? ((qh >> j) & 1) << 4 : 0)) - offset);
                    codes[j + 16] = (int8_t)(((qs[j] >> 4) | (five ? ((qh >> (j + 16)) & 1) << 4 : 0)) - offset);
                }
            }
            for (int k = 0; k < GROUP; k++) blk[32 + 32 * (k / 2) + 2 * lane + k % 2] = (uint8_t)codes[k];
        }
    }
}

#define INT8_PACKER(T)                                                                                      \
    static void pack_int8_##T(const uint8_t *raw, int64_t row_bytes, int64_t rows, int cols, int64_t p,    \
                              uint8_t *panel) {                                                            \
        pack_int8_panel(raw, T, row_bytes, rows, cols, p, panel);                                           \
    }
INT8_PACKER(INT8_FROM_Q8_0)
INT8_PACKER(INT8_FROM_Q5_0)
INT8_PACKER(INT8_FROM_Q4_0)
static const PanelPacker INT8_PACKERS[] = {[INT8_FROM_Q8_0] = pack_int8_INT8_FROM_Q8_0,
                                           [INT8_FROM_Q5_0] = pack_int8_INT8_FROM_Q5_0,
                                           [INT8_FROM_Q4_0] = pack_int8_INT8_FROM_Q4_0};

int pack_gguf_int8(const uint8_t *raw, int type, int64_t rows, int cols, uint8_t *out, int num_threads) {
    if (type < INT8_FROM_Q8_0 || type > INT8_FROM_Q4_0 || cols % GROUP) return -1;
    const int64_t row_bytes = (int64_t)cols / GROUP * (type == INT8_FROM_Q8_0 ? 34 : type == INT8_FROM_Q5_0 ? 22 : 18);
    const int64_t panels = (rows + PANEL - 1) / PANEL, panel_bytes = (int64_t)(cols / GROUP) * 544;
    const PanelPacker pack = INT8_PACKERS[type];
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) pack(raw, row_bytes, rows, cols, p, out + p * panel_bytes);
    return 0;
}

/* Vocabularies and merges: 300k length-prefixed strings in Qwen2.5's header, ~0.8 s stepped over in
 * Python, a millisecond here. */
int64_t gguf_string_spans(const uint8_t *buf, int64_t size, int64_t count, int swap, int64_t *starts,
                          int64_t *lengths) {
    int64_t pos = 0;
    for (int64_t i = 0; i < count; i++) {
        if (size - pos < 8)
            return i;
        uint64_t n;
        memcpy(&n, buf + pos, 8);
        if (swap)
            n = __builtin_bswap64(n);
        if (n > (uint64_t)(size - pos - 8))
            return i;
        starts[i] = pos + 8;
        lengths[i] = (int64_t)n;
        pos += 8 + (int64_t)n;
    }
    return count;
}
