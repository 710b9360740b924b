/* The one declaration of every function the native libraries export.
 *
 * Every source of this directory includes it, so the compiler checks each definition against its
 * prototype here; decode_step.c calls the kernels through these prototypes' types; and native/abi.py
 * reads this file for the ctypes signatures the Python side calls with (and the decode step's
 * operation layout). A signature is therefore written once: a mismatch is a compile error or a
 * Python exception, never a call that reads its arguments from the wrong registers.
 *
 * Kept in a regular form so that a few lines of Python read it (abi.py says what it refuses):
 *   - a section comment "<source>.c: ..." opening a line names the library that exports what follows;
 *   - one prototype a statement, `<type> <name>(<type> <parameter>, ...);`, every parameter named, a
 *     type being void, int, int64_t or float, or a pointer to one of those, uint8_t, uint16_t or char,
 *     optionally const;
 *   - integer constants as `#define NAME <number>` or an enum of `NAME = <number>` entries.
 */
#ifndef KVSERVE_KERNELS_H
#define KVSERVE_KERNELS_H

#include <stdint.h>

/* Every library written against simd.h (int4_matmul, int8_matmul, paged_attention, silu_mul,
 * gelu_mul) also
 * exports the name of the instruction-set path it was built for (weak: one per process). */
const char *simd_isa(void);

/* rms_norm.c: x [n, hidden] f32; h_is_bf16: h holds bf16 bit patterns instead of f32. */
void rms_norm(const float *x, const float *w, float eps, int n, int hidden, float *out);
void add_rms_norm(float *x, const void *h, int h_is_bf16, const float *w, float eps, int n, int hidden,
                  float *out);
void rms_norm_heads(float *x, int tokens, int heads, int64_t token_stride, int D, const float *w, float eps);

/* rope.c: in place on the first `heads` head-vectors of each of `tokens` rows of x. */
void rope_in_place(float *x, int tokens, int heads, int64_t token_stride, int D, const float *cos,
                   const float *sin);

/* silu_mul.c: gate_up [n, 2 * inter] -> out [n, inter]. */
void silu_mul(const float *gate_up, int n, int inter, float *out);

/* gelu_mul.c: gate_up [n, 2 * inter] -> out [n, inter], GELU's tanh form. */
void gelu_tanh_mul(const float *gate_up, int n, int inter, float *out);

/* int4_matmul.c: y [M, N] = x [M, K] against packed weights of 2 to 6 bits in one of the layouts
 * below (int4_matmul.c's top describes each); 0, or -1 without workspace. */
enum {
    QL_F16 = 0,  /* 4-bit codes, f16 scale and offset per 32 (GGUF Q4_1) */
    QL_F32 = 1,  /* 4-bit codes, f32 scale and offset per 32 */
    QL_Q4_0 = 2, /* 4-bit codes, f16 d per 32, offset -8 d */
    QL_Q5_0 = 3, /* 5-bit codes, f16 d per 32, offset -16 d */
    QL_Q5_1 = 4, /* 5-bit codes, f16 scale and offset per 32 */
    QL_Q4_K = 5, /* 4-bit codes, 6-bit scale and minimum per 32, f16 d and dmin per 256 */
    QL_Q5_K = 6, /* 5-bit codes, as Q4_K */
    QL_Q6_K = 7, /* 6-bit codes, int8 scale per 16, f16 d per 256, offset -32 d sc */
    QL_Q2_K = 8, /* 2-bit codes, 4-bit scale and minimum per 16, f16 d and dmin per 256 */
    QL_Q3_K = 9, /* 3-bit codes, int8 (6-bit signed) scale per 16, f16 d per 256, offset -4 d sc */
};
int int4_matmul(const float *x, const uint8_t *w, const float *bias, int M, int N, int K, float *y,
                int num_threads, int digits, int layout, int ldy);

/* block_repack.c: rows x cols weights of a GGUF block type (its file bytes, rows in order) into the layout
 * `layout` of int4_matmul.c (QL_F16 for Q4_1); 0, or -1 for a layout it does not pack. */
int pack_gguf_blocks(const uint8_t *raw, int layout, int64_t rows, int cols, uint8_t *out, int num_threads);
/* Q8_0, Q5_0 or Q4_0 rows as int8_matmul.c's groups of 32 (f16 scale, int8 codes); 0, or -1 for another type. */
enum { INT8_FROM_Q8_0 = 0, INT8_FROM_Q5_0 = 1, INT8_FROM_Q4_0 = 2 };
int pack_gguf_int8(const uint8_t *raw, int type, int64_t rows, int cols, uint8_t *out, int num_threads);
/* The next `count` strings of a GGUF string array in buf[0, size) (each a u64 length, byte-swapped when
 * `swap`, then its bytes): start and length of each, relative to buf. Returns how many lie whole within
 * size (fewer than count: the caller reads on and calls again). */
int64_t gguf_string_spans(const uint8_t *buf, int64_t size, int64_t count, int swap, int64_t *starts,
                          int64_t *lengths);

/* spm_tokenize.c: a SentencePiece vocabulary (GGUF "llama": pieces, scores, token types) tokenized without
 * a merges list. Piece i is text[starts[i], starts[i] + lengths[i]); scores NULL: rank by id. spm_vocab_new
 * copies what it keeps (NULL when out of memory); spm_encode returns the number of ids written, -1 when
 * capacity < 4 * len + 3 or len >= 512 MiB, -2 out of memory; its flags: SPM_LITERAL reads CONTROL pieces' strings as text,
 * SPM_NO_PREFIX leaves out the space prefix (a fragment from inside a text, as llguidance asks); spm_first_special: the byte offset of the first CONTROL piece
 * in s (its length in *found_len), or -1; spm_piece_id: the id of the piece s, or -1. */
void *spm_vocab_new(const char *text, const int64_t *starts, const int64_t *lengths, const int *types,
                    const float *scores, int n, int space_prefix);
void spm_vocab_free(void *vocab);
enum { SPM_LITERAL = 1, SPM_NO_PREFIX = 2 };
int64_t spm_encode(const void *vocab, const char *s, int64_t len, int flags, int *out, int64_t capacity);
int64_t spm_first_special(const void *vocab, const char *s, int64_t len, int64_t *found_len);
int spm_piece_id(const void *vocab, const char *s, int64_t len);

/* bpe_tokenize.c: a byte-level BPE vocabulary (GGUF "gpt2": tokens, merges "left right", token types) and
 * the splits its pre-tokenizer makes, in turn (pretokenizers.py writes each as a regex). Token i is
 * text[starts[i], starts[i] + lengths[i]), merge r merge_text[merge_starts[r], ...). bpe_vocab_new copies
 * what it keeps (NULL when out of memory or for more than BPE_MAX_SPLITS splits); bpe_encode takes valid
 * UTF-8 (NFC-normalized by the caller where the vocabulary asks) and returns the number of ids written, -1
 * when capacity < len + 1 or len >= 512 MiB, -2 out of memory; BPE_LITERAL reads CONTROL tokens' strings as
 * text. bpe_decode writes the ids' bytes (ids out of range left out, CONTROL ones too when skip_special):
 * their number, or -1 past capacity. bpe_first_special and bpe_token_id as spm_first_special and
 * spm_piece_id. */
enum { BPE_LITERAL = 1, BPE_MAX_SPLITS = 4 };
enum { BPE_SPLIT_GPT2 = 0, BPE_SPLIT_LLAMA3 = 1, BPE_SPLIT_QWEN2 = 2, BPE_SPLIT_DIGIT = 3, BPE_SPLIT_DIGITS = 4,
       BPE_SPLIT_PUNCTUATION = 5, BPE_SPLIT_THREE_DIGITS = 6, BPE_SPLIT_GPT4O = 7, BPE_SPLIT_TEKKEN = 8 };
void *bpe_vocab_new(const char *text, const int64_t *starts, const int64_t *lengths, const int *types, int n,
                    const char *merge_text, const int64_t *merge_starts, const int64_t *merge_lengths,
                    int num_merges, const int *splits, int num_splits, int ignore_merges);
void bpe_vocab_free(void *vocab);
int64_t bpe_encode(const void *vocab, const char *s, int64_t len, int flags, int *out, int64_t capacity);
int64_t bpe_decode(const void *vocab, const int *ids, int64_t n, int skip_special, char *out, int64_t capacity);
int64_t bpe_first_special(const void *vocab, const char *s, int64_t len, int64_t *found_len);
int bpe_token_id(const void *vocab, const char *s, int64_t len);

/* int8_matmul.c: the int8 grids (f16 scale per 32 inputs; _g16: f32 scale and offset per 16).
 * Every matmul writes row m of its output at y + m * ldy (ldy <= 0: N), so the parts of a stacked
 * projection (q and k in one layout, v in another) fill their columns of one output. */
int int8_matmul(const float *x, const uint8_t *w, const float *bias, int M, int N, int K, float *y,
                int num_threads, int ldy);
int int8_matmul_g16(const float *x, const uint8_t *w, const float *bias, int M, int N, int K, float *y,
                    int num_threads, int ldy);
void int8_rows(const uint8_t *w, const int64_t *ids, int n, int K, float *out);
void int8_rows_g16(const uint8_t *w, const int64_t *ids, int n, int K, float *out);

/* kv_write.c: x [tokens, kv_heads, D] into the rows slot_rows [kv_heads * tokens] of a paged cache; centre
 * [kv_heads, D] (or NULL) subtracted first, then times balance [kv_heads, D] (or NULL), then rotated by the
 * D signs of rotation (or NULL: hadamard.h). */
void kv_write(int kind, const float *x, int tokens, int kv_heads, int D, const int64_t *slot_rows, uint8_t *codes,
              int64_t code_stride, uint8_t *scales, int64_t scale_stride, const float *rotation,
              const float *levels, const float *centre, const float *balance);

/* paged_attention.c: 0, or -1 when the workspace could not be allocated. softcap > 0 caps each scaled score
 * s -> softcap * tanh(s / softcap) before the softmax (Gemma 2); 0: no cap. q_balance [num_kv_heads, head_dim]
 * (or NULL): each query of a KV head's group times it, then rotated by q_rotation (D signs, hadamard.h; or
 * NULL), before scoring; out_rotation (D signs or NULL): each output row un-rotated (rotated values). */
int paged_decode_attention(int n, int num_heads, int num_kv_heads, int head_dim, const float *q, float *out,
                           const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                           int num_blocks, int block_size, int window, float scale, float softcap,
                           int k_kind, const void *k_codes, const void *k_scales, int64_t k_code_stride,
                           int64_t k_scale_stride, const float *k_table,
                           int v_kind, const void *v_codes, const void *v_scales, int64_t v_code_stride,
                           int64_t v_scale_stride, const float *v_table, const float *q_balance,
                           const float *q_rotation, const float *out_rotation, int num_threads);
int paged_prefill_attention(int n, int64_t q_start, int num_heads, int num_kv_heads, int head_dim, const float *q,
                            float *out, const int64_t *block_table, int num_blocks, int block_size, int window,
                            float scale, float softcap, int k_kind, const void *k_codes, const void *k_scales,
                            int64_t k_code_stride, int64_t k_scale_stride, const float *k_table, int v_kind,
                            const void *v_codes, const void *v_scales, int64_t v_code_stride,
                            int64_t v_scale_stride, const float *v_table, const float *q_balance,
                            const float *q_rotation, const float *out_rotation, int num_threads);
int paged_prefill_int_keys(void);

/* model_step.c: a model's step (prefill chunks and decodes, in any mix) as a list of operations,
 * OP_FIELDS int64 words each:
 *
 *   [kind, function address, word 0, word 1, ...]   word i: parameter i of the kind's function
 *
 * (a pointer as its address, an integer as itself, a float as the bits of a double). The parameters
 * that change between steps (the number of rows, block tables, ...) the step passes itself; their
 * words are unused (native/step_ops.py names them). OP_<NAME> calls the function <name> above. */
#define OP_FIELDS 32
enum {
    OP_RMS_NORM = 1,
    OP_ADD_RMS_NORM = 2,
    OP_INT4_MATMUL = 3,
    OP_ROPE_IN_PLACE = 4,
    OP_COPY_ROWS = 5,
    OP_KV_WRITE = 6,
    OP_PAGED_DECODE_ATTENTION = 7,
    OP_SILU_MUL = 8,
    OP_INT8_MATMUL = 9,
    OP_INT8_MATMUL_G16 = 10,
    OP_RMS_NORM_HEADS = 11,
    OP_GELU_TANH_MUL = 12,
    OP_PAGED_PREFILL_ATTENTION = 13,
    OP_GATHER_ROWS = 14,
    OP_SCATTER_ROWS = 15,
};
/* Row r of dst (strides in floats) = the first `width` floats of row r of src, for r < n. */
void copy_rows(const float *src, int64_t src_stride, float *dst, int64_t dst_stride, int64_t width, int n);
/* Row r of dst = row rows[r] of src (gather_rows); row rows[r] of dst = row r of src (scatter_rows); r < n. */
void gather_rows(const float *src, int64_t src_stride, float *dst, int64_t dst_stride, int64_t width,
                 const int64_t *rows, int n);
void scatter_rows(const float *src, int64_t src_stride, float *dst, int64_t dst_stride, int64_t width,
                  const int64_t *rows, int n);
/* The step's batch (int64 words): [decodes, sequences, sequence table words, the decodes' rows...,
 * then per sequence (prefill chunk): first row, rows, position of its first row, offset of its block
 * table in sequence_tables]. */
enum { BATCH_DECODES = 0, BATCH_SEQUENCES = 1, BATCH_TABLE_WORDS = 2, BATCH_HEADER = 3, BATCH_SEQUENCE_WORDS = 4 };
/* n rows (tokens). block_tables [groups, decodes, table_stride] int64 and context_lens [decodes] int64:
 * the decodes'; sequence_tables [groups, table words]: the sequences' block tables back to back; slot_rows
 * [groups, kv heads * n] (kv_write.c's layout). Returns 0, or the (1-based) index of the operation that
 * failed: a kernel that could not allocate its workspace, or an unknown kind. */
int model_step(const int64_t *ops, int num_ops, int n, const int64_t *batch, const int64_t *block_tables,
               int64_t table_stride, const int64_t *context_lens, const int64_t *slot_rows,
               const int64_t *sequence_tables);

#endif
