/* The integer kernels of src/kvserve/native as a program, for the builds this machine cannot load:
 * tests/native/test_arm.py builds it with aarch64-linux-gnu-gcc and runs it under qemu-aarch64.
 *
 *   arm_driver IN OUT
 *   IN:  int32 kernel (4: int4_matmul, 8: int8_matmul, 16: int8_matmul_g16; 32: kv_write's Hadamard
 *        rotation of M tokens of N kv heads of K / N elements into an f32 cache, the weights its K / N
 *        signs),
 *        M, N, K, digits, layout (int4_matmul's QL_*), weight bytes,
 *        has bias;
 *        then x f32 [M][K], the packed weights, bias f32 [N] if any
 *   OUT: y f32 [M][N] (kernel 32: [N * M][K / N]), then the path's name (simd_isa)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver_io.h"
#include "kernels.h"

/* y [n] f32, then the path's name, to path: 0, or 2 when it cannot be written. */
static int write_result(const char *path, const float *y, size_t n) {
    FILE *out = fopen(path, "wb");
    if (!out) return 2;
    fwrite(y, sizeof(float), n, out);
    fputs(simd_isa(), out);
    fclose(out);
    return 0;
}

int main(int argc, char **argv) {
    FILE *in = open_input(argc, argv);
    int32_t *h = read_exactly(in, 8 * sizeof(int32_t));
    const int kind = h[0], M = h[1], N = h[2], K = h[3], digits = h[4], layout = h[5], has_bias = h[7];
    float *x = read_exactly(in, sizeof(float) * (size_t)M * K);
    uint8_t *w = read_exactly(in, (size_t)h[6]);
    float *bias = has_bias ? read_exactly(in, sizeof(float) * (size_t)N) : NULL;
    fclose(in);
    if (kind == 32) {
        float *rows = calloc((size_t)M * K, sizeof(float));
        int64_t *slots = malloc(sizeof(int64_t) * (size_t)M * N);
        for (int i = 0; i < M * N; i++) slots[i] = i;
        kv_write(0, x, M, N, K / N, slots, (uint8_t *)rows, 4 * (int64_t)(K / N), NULL, 0, (const float *)w, NULL,
                 NULL, NULL);
        return write_result(argv[2], rows, (size_t)M * K);
    }
    float *y = calloc((size_t)M * N, sizeof(float));
    int rc = kind == 4 ? int4_matmul(x, w, bias, M, N, K, y, 2, digits, layout, N)
             : kind == 16 ? int8_matmul_g16(x, w, bias, M, N, K, y, 2, N)
                          : int8_matmul(x, w, bias, M, N, K, y, 2, N);
    if (rc != 0) return 3;
    return write_result(argv[2], y, (size_t)M * N);
}
