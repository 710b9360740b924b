/* A whole decode step of a Llama-family decoder in one call from Python: a list of operations, each
 * a call into another kernel of this directory (rms_norm.c, int4_matmul.c, rope.c, kv_write.c,
 * paged_attention.c, silu_mul.c) or a row copy. models/native_decode.py writes the list once per
 * model and KV cache; a step passes only what changes between steps: the number of sequences, their
 * block tables, context lengths, KV slot rows and RoPE tables.
 *
 * The operations are the same calls, with the same arguments, that models/decoder.py makes one by
 * one through ctypes, so a step's outputs are the same bits either way (tested). What goes is the
 * Python between them: ~300 calls, tensor allocations and argument conversions a step, ~3 ms of an
 * ~8 ms step at one sequence and short context.
 *
 * An operation is OP_FIELDS int64 words: [kind, function address, arguments...]. Pointers are
 * addresses, floats are the bits of a double (see arg_float).
 */
#include <stdint.h>
#include <string.h>

#define OP_FIELDS 32

enum {
    OP_RMS_NORM = 1,         /* x, w, eps, hidden, out */
    OP_ADD_RMS_NORM = 2,     /* x, h, w, eps, hidden, out */
    OP_INT4_MATMUL = 3,      /* x, w, bias, N, K, y, threads, digits */
    OP_ROPE = 4,             /* x, heads, token stride, D (the step's cos and sin) */
    OP_COPY_ROWS = 5,        /* (no function) src, src stride, dst, dst stride, floats a row */
    OP_KV_WRITE = 6,         /* kind, x, kv heads, D, codes, code stride, scales, scale stride, rotation, levels */
    OP_DECODE_ATTENTION = 7, /* heads, kv heads, D, q, out, num blocks, block size, window, scale, K part (6),
                                V part (6), q rotation, out rotation, threads */
    OP_SILU_MUL = 8,         /* gate_up, inter, out */
};

typedef void (*rms_norm_fn)(const float *, const float *, float, int, int, float *);
typedef void (*add_rms_norm_fn)(float *, const void *, int, const float *, float, int, int, float *);
typedef int (*int4_matmul_fn)(const float *, const uint8_t *, const float *, int, int, int, float *, int, int);
typedef void (*rope_fn)(float *, int, int, int64_t, int, const float *, const float *);
typedef void (*kv_write_fn)(int, const float *, int, int, int, const int64_t *, uint8_t *, int64_t, uint8_t *,
                            int64_t, const float *, const float *);
typedef int (*decode_attention_fn)(int, int, int, int, const float *, float *, const int64_t *, int64_t,
                                   const int64_t *, int, int, int, float, int, const void *, const void *, int64_t,
                                   int64_t, const float *, int, const void *, const void *, int64_t, int64_t,
                                   const float *, const float *, const float *, int);
typedef void (*silu_mul_fn)(const float *, int, int, float *);

#define P(i) ((void *)(intptr_t)a[i])
#define I(i) ((int)a[i])

static float arg_float(int64_t word) {
    double d;
    memcpy(&d, &word, sizeof d);
    return (float)d; /* what ctypes' c_float does with the Python float */
}

/* n sequences, one token each. block_tables [n, table_stride] int64, context_lens [n] int64,
 * slot_rows [kv heads * n] (kv_write.c's layout), cos and sin [n, D]. Returns 0, or the (1-based)
 * index of the operation that failed: a kernel that could not allocate its workspace, or an unknown
 * kind. */
int decode_step(const int64_t *ops, int num_ops, int n, const int64_t *block_tables, int64_t table_stride,
                const int64_t *context_lens, const int64_t *slot_rows, const float *cos, const float *sin) {
    for (int op = 0; op < num_ops; op++) {
        const int64_t *a = ops + (int64_t)op * OP_FIELDS;
        const void *fn = P(1);
        int rc = 0;
        switch (a[0]) {
        case OP_RMS_NORM:
            ((rms_norm_fn)fn)(P(2), P(3), arg_float(a[4]), n, I(5), P(6));
            break;
        case OP_ADD_RMS_NORM:
            ((add_rms_norm_fn)fn)(P(2), P(3), 0, P(4), arg_float(a[5]), n, I(6), P(7));
            break;
        case OP_INT4_MATMUL:
            rc = ((int4_matmul_fn)fn)(P(2), P(3), P(4), n, I(5), I(6), P(7), I(8), I(9));
            break;
        case OP_ROPE:
            ((rope_fn)fn)(P(2), n, I(3), a[4], I(5), cos, sin);
            break;
        case OP_COPY_ROWS: {
            const float *src = P(2);
            float *dst = P(4);
            for (int r = 0; r < n; r++)
                memcpy(dst + (int64_t)r * a[5], src + (int64_t)r * a[3], sizeof(float) * (size_t)a[6]);
            break;
        }
        case OP_KV_WRITE:
            ((kv_write_fn)fn)(I(2), P(3), n, I(4), I(5), slot_rows, P(6), a[7], P(8), a[9], P(10), P(11));
            break;
        case OP_DECODE_ATTENTION:
            rc = ((decode_attention_fn)fn)(n, I(2), I(3), I(4), P(5), P(6), block_tables, table_stride, context_lens,
                                           I(7), I(8), I(9), arg_float(a[10]), I(11), P(12), P(13), a[14], a[15],
                                           P(16), I(17), P(18), P(19), a[20], a[21], P(22), P(23), P(24), I(25));
            break;
        case OP_SILU_MUL:
            ((silu_mul_fn)fn)(P(2), n, I(3), P(4));
            break;
        default:
            return op + 1;
        }
        if (rc != 0) return op + 1;
    }
    return 0;
}
