/* A whole step of a decoder in one call from Python: a list of operations, each a call into another
 * kernel of this directory (rms_norm.c, int4_matmul.c, int8_matmul.c, rope.c, kv_write.c,
 * paged_attention.c, silu_mul.c, gelu_mul.c) or a row copy. models/native_step.py writes the list once per
 * model and KV cache; a step passes only what changes between steps: its rows (tokens), the batch
 * (which rows are single-token decodes, which are prefill chunks of which sequence), block tables,
 * context lengths and KV slot rows (the RoPE rows it writes into buffers the operations name, one pair
 * per table: Gemma's sliding layers rotate with another base).
 *
 * Every operation but attention runs over all rows at once. Attention is three: the prefill chunks, each
 * through paged_prefill_attention over its own rows; the decodes' queries gathered into rows of their own,
 * attended together by paged_decode_attention, and their outputs scattered back to their rows.
 *
 * With a window group (kv/groups.py: the sliding layers' blocks in a pool of their own), the
 * step gets both groups' tables and slot rows one after the other, and the word of an operation where
 * the step's block tables or slot rows go holds the group (0 or 1) whose part it takes.
 *
 * The operations are the same calls, with the same arguments, that models/decoder.py makes one by
 * one through ctypes, so a step's outputs are the same bits either way (tested). What goes is the
 * Python between them: ~300 calls, tensor allocations and argument conversions a step, ~3 ms of an
 * ~8 ms decode step at one sequence and short context.
 *
 * kernels.h gives an operation's layout (word i: the function's parameter i) and the type each call
 * goes through, so the argument lists below read word i in position i, and native/step_ops.py writes
 * the words from the same prototypes. tests/native/test_kernel_abi.py runs every kind against
 * recording stand-ins to check the two agree.
 */
#include <string.h>

#include "kernels.h"

/* passing a word where a pointer is expected, or the reverse, must not compile */
#pragma GCC diagnostic error "-Wint-conversion"

/* The operation's function, as the type kernels.h declares for `kernel`. */
#define CALL(kernel) ((__typeof__(kernel) *)(intptr_t)a[1])
/* Word i of the operation, as a pointer, an int, an int64 or a float. */
#define P(i) ((void *)(intptr_t)a[2 + (i)])
#define I(i) ((int)a[2 + (i)])
#define L(i) (a[2 + (i)])
#define F(i) arg_float(a[2 + (i)])

static float arg_float(int64_t word) {
    double d;
    memcpy(&d, &word, sizeof d);
    return (float)d; /* what ctypes' c_float does with the Python float */
}

void copy_rows(const float *src, int64_t src_stride, float *dst, int64_t dst_stride, int64_t width, int n) {
    for (int r = 0; r < n; r++)
        memcpy(dst + (int64_t)r * dst_stride, src + (int64_t)r * src_stride, sizeof(float) * (size_t)width);
}

void gather_rows(const float *src, int64_t src_stride, float *dst, int64_t dst_stride, int64_t width,
                 const int64_t *rows, int n) {
    for (int r = 0; r < n; r++)
        memcpy(dst + (int64_t)r * dst_stride, src + rows[r] * src_stride, sizeof(float) * (size_t)width);
}

void scatter_rows(const float *src, int64_t src_stride, float *dst, int64_t dst_stride, int64_t width,
                  const int64_t *rows, int n) {
    for (int r = 0; r < n; r++)
        memcpy(dst + rows[r] * dst_stride, src + (int64_t)r * src_stride, sizeof(float) * (size_t)width);
}

/* Each prefill chunk of the batch through paged_prefill_attention (operation a): its rows of q and out,
 * its block table in the operation's KV group. */
static int prefill_attention(const int64_t *a, const int64_t *batch, const int64_t *sequence_tables) {
    const int64_t *seq = batch + BATCH_HEADER + batch[BATCH_DECODES];
    const int64_t row_floats = (int64_t)I(2) * I(4); /* num_heads * head_dim */
    const int64_t *tables = sequence_tables + L(7) * batch[BATCH_TABLE_WORDS];
    for (int64_t s = 0; s < batch[BATCH_SEQUENCES]; s++, seq += BATCH_SEQUENCE_WORDS) {
        const float *q = (const float *)P(5) + seq[0] * row_floats;
        float *out = (float *)P(6) + seq[0] * row_floats;
        int rc = CALL(paged_prefill_attention)((int)seq[1], seq[2], I(2), I(3), I(4), q, out, tables + seq[3], I(8),
                                               I(9), I(10), F(11), F(12), I(13), P(14), P(15), L(16), L(17), P(18),
                                               I(19), P(20), P(21), L(22), L(23), P(24), P(25), P(26), P(27),
                                               I(28));
        if (rc != 0) return rc;
    }
    return 0;
}

int model_step(const int64_t *ops, int num_ops, int n, const int64_t *batch, const int64_t *block_tables,
               int64_t table_stride, const int64_t *context_lens, const int64_t *slot_rows,
               const int64_t *sequence_tables) {
    const int decodes = (int)batch[BATCH_DECODES];
    const int64_t *decode_rows = batch + BATCH_HEADER;
    for (int op = 0; op < num_ops; op++) {
        const int64_t *a = ops + (int64_t)op * OP_FIELDS;
        int rc = 0;
        switch (a[0]) {
        case OP_RMS_NORM:
            CALL(rms_norm)(P(0), P(1), F(2), n, I(4), P(5));
            break;
        case OP_ADD_RMS_NORM:
            CALL(add_rms_norm)(P(0), P(1), I(2), P(3), F(4), n, I(6), P(7));
            break;
        case OP_INT4_MATMUL:
            rc = CALL(int4_matmul)(P(0), P(1), P(2), n, I(4), I(5), P(6), I(7), I(8), I(9), I(10));
            break;
        case OP_ROPE_IN_PLACE:
            CALL(rope_in_place)(P(0), n, I(2), L(3), I(4), P(5), P(6));
            break;
        case OP_COPY_ROWS:
            CALL(copy_rows)(P(0), L(1), P(2), L(3), L(4), n);
            break;
        case OP_GATHER_ROWS:
            CALL(gather_rows)(P(0), L(1), P(2), L(3), L(4), decode_rows, decodes);
            break;
        case OP_SCATTER_ROWS:
            CALL(scatter_rows)(P(0), L(1), P(2), L(3), L(4), decode_rows, decodes);
            break;
        case OP_KV_WRITE:
            CALL(kv_write)(I(0), P(1), n, I(3), I(4), slot_rows + L(5) * I(3) * (int64_t)n, P(6), L(7), P(8), L(9),
                           P(10), P(11), P(12), P(13));
            break;
        case OP_PAGED_PREFILL_ATTENTION:
            rc = prefill_attention(a, batch, sequence_tables);
            break;
        case OP_PAGED_DECODE_ATTENTION:
            if (decodes > 0)
                rc = CALL(paged_decode_attention)(decodes, I(1), I(2), I(3), P(4), P(5),
                                                  block_tables + L(6) * decodes * table_stride, table_stride,
                                                  context_lens, I(9), I(10), I(11), F(12), F(13), I(14), P(15),
                                                  P(16), L(17), L(18), P(19), I(20), P(21), P(22), L(23), L(24),
                                                  P(25), P(26), P(27), P(28), I(29));
            break;
        case OP_SILU_MUL:
            CALL(silu_mul)(P(0), n, I(2), P(3));
            break;
        case OP_GELU_TANH_MUL:
            CALL(gelu_tanh_mul)(P(0), n, I(2), P(3));
            break;
        case OP_INT8_MATMUL:
            rc = CALL(int8_matmul)(P(0), P(1), P(2), n, I(4), I(5), P(6), I(7), I(8));
            break;
        case OP_INT8_MATMUL_G16:
            rc = CALL(int8_matmul_g16)(P(0), P(1), P(2), n, I(4), I(5), P(6), I(7), I(8));
            break;
        case OP_RMS_NORM_HEADS:
            CALL(rms_norm_heads)(P(0), n, I(2), L(3), I(4), P(5), F(6));
            break;
        default:
            return op + 1;
        }
        if (rc != 0) return op + 1;
    }
    return 0;
}
