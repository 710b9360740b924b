/* paged_attention.c's kernels as a program, for the aarch64 builds this machine cannot load:
 * tests/native/test_arm.py builds it with aarch64-linux-gnu-gcc and runs it under qemu-aarch64.
 * K/V of one kind (paged_attention.c's kinds: f32, f16, bf16, q8_0, q4_0), one sequence whose blocks
 * are the table read from IN.
 *
 *   arm_attention_driver IN OUT
 *   IN:  int32 prefill (0: decode the last position, 1: prefill n queries), n, heads, kv_heads, D,
 *        num_blocks, block_size, window, context length, kind, code bytes and scale bytes per head-vector;
 *        f32 scale, softcap; then q f32 [n][heads][D]; for k, then v: codes [kv_heads][num_blocks][block_size]
 *        [code bytes], scales [...][scale bytes]; table int64 [num_blocks]
 *   OUT: out f32 [n][heads][D], then the path's name (simd_isa)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "driver_io.h"
#include "kernels.h"

int main(int argc, char **argv) {
    FILE *in = open_input(argc, argv);
    int32_t *h = read_exactly(in, 12 * sizeof(int32_t));
    const int prefill = h[0], n = h[1], heads = h[2], kv_heads = h[3], D = h[4], blocks = h[5], bs = h[6];
    const int window = h[7], kind = h[9], code_bytes = h[10], scale_bytes = h[11];
    const int64_t ctx = h[8];
    float *f = read_exactly(in, 2 * sizeof(float));
    const size_t q_n = (size_t)n * heads * D, vectors = (size_t)kv_heads * blocks * bs;
    float *q = read_exactly(in, sizeof(float) * q_n);
    void *k = read_exactly(in, vectors * code_bytes), *k_scales = read_exactly(in, vectors * scale_bytes);
    void *v = read_exactly(in, vectors * code_bytes), *v_scales = read_exactly(in, vectors * scale_bytes);
    int64_t *table = read_exactly(in, sizeof(int64_t) * (size_t)blocks);
    fclose(in);
    if (!scale_bytes) k_scales = v_scales = NULL;
    float *out = calloc(q_n, sizeof(float));
    int rc = prefill ? paged_prefill_attention(n, ctx - n, heads, kv_heads, D, q, out, table, blocks, bs, window, f[0],
                                               f[1], kind, k, k_scales, code_bytes, scale_bytes, NULL, kind, v,
                                               v_scales, code_bytes, scale_bytes, NULL, NULL, NULL, NULL, 2)
                     : paged_decode_attention(n, heads, kv_heads, D, q, out, table, 0, &ctx, blocks, bs, window, f[0],
                                              f[1], kind, k, k_scales, code_bytes, scale_bytes, NULL, kind, v,
                                              v_scales, code_bytes, scale_bytes, NULL, NULL, NULL, NULL, 2);
    if (rc != 0) return 3;
    FILE *o = fopen(argv[2], "wb");
    if (!o) return 2;
    fwrite(out, sizeof(float), q_n, o);
    fputs(simd_isa(), o);
    fclose(o);
    return 0;
}
