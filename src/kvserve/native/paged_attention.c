/* Paged attention on the CPU, reading (possibly quantized) KV blocks where they are stored: decode (one
 * query per sequence, decode_attention.h) and prefill (a chunk of one sequence's queries,
 * prefill_attention.h), both over the rows kv_rows.h reads. This file holds the entry points
 * attention/native_paged.py and model_step.c call.
 */
#include "decode_attention.h"
#include "kernels.h"
#include "prefill_attention.h"

SIMD_EXPORT_ISA

#define MAX_RUN 16 /* sequences attended together, at most */

/* Whether sequence j reads the blocks sequence i reads, over all of i's context (j's context at least as
 * long): the rows of one request's speculative step (each draft a decode row, its context one longer),
 * or requests that share a cached prefix. Such neighbours are attended together (attend_rows): a
 * block read once for all of them, each row's result the same bits as alone. */
static int reads_blocks_of(const int64_t *tables, int64_t stride, const int64_t *lens, int block_size, int i, int j) {
    if (lens[j] < lens[i]) return 0;
    size_t blocks = (size_t)((lens[i] + block_size - 1) / block_size);
    return memcmp(tables + (int64_t)i * stride, tables + (int64_t)j * stride, sizeof(int64_t) * blocks) == 0;
}

/* A new buffer of rows x D, the queries as the stored keys need them (rows are [n, num_heads] major): each
 * times its KV head's balance (balanced keys), then rotated by the signs R (rotated keys: hadamard.h);
 * NULL when it cannot be allocated. */
static float *query_rows(const float *x, int rows, int num_heads, int G, int D, const float *balance,
                         const float *R, int num_threads) {
    float *y = malloc(sizeof(float) * (size_t)rows * D);
    if (!y) return NULL;
#pragma omp parallel for num_threads(num_threads) if (rows >= 256)
    for (int r = 0; r < rows; r++) {
        const float *q = x + (int64_t)r * D;
        float balanced[D];
        if (balance) {
            const float *b = balance + (int64_t)(r % num_heads / G) * D;
            for (int i = 0; i < D; i++) balanced[i] = q[i] * b[i];
            q = balanced;
        }
        if (R)
            hadamard_rotate(q, R, D, y + (int64_t)r * D);
        else
            memcpy(y + (int64_t)r * D, q, sizeof(float) * D);
    }
    return y;
}

int paged_decode_attention(int n, int num_heads, int num_kv_heads, int head_dim, const float *q, float *out,
                           const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                           int num_blocks, int block_size, int window, float scale, float softcap,
                           int k_kind, const void *k_codes, const void *k_scales, int64_t k_code_stride,
                           int64_t k_scale_stride, const float *k_table,
                           int v_kind, const void *v_codes, const void *v_scales, int64_t v_code_stride,
                           int64_t v_scale_stride, const float *v_table, const float *q_balance,
                           const float *q_rotation, const float *out_rotation, int num_threads) {
    int rows = n * num_heads;
    float *rotated = NULL; /* the query balanced and rotated as the keys are stored; the caller's q as it is */
    if ((q_balance || q_rotation) &&
        !(q = rotated = query_rows(q, rows, num_heads, num_heads / num_kv_heads, head_dim, q_balance, q_rotation,
                                   num_threads)))
        return -1;
    problem P = {num_heads, num_kv_heads, head_dim, num_blocks, block_size, window, scale, q, out,
                 block_tables, table_stride, context_lens,
                 {k_kind, k_codes, k_scales, k_code_stride, k_scale_stride, k_table},
                 {v_kind, v_codes, v_scales, v_code_stride, v_scale_stride, v_table}};
    int G = num_heads / num_kv_heads, D = head_dim;
    int64_t *first = malloc(sizeof(int64_t) * (n + 1)); /* each sequence's first partial */
    int *run_start = malloc(sizeof(int) * (n + 1));     /* the runs of sequences attended together */
    int64_t *run_task = malloc(sizeof(int64_t) * (n + 1));
    if (!first || !run_start || !run_task) {
        free(first);
        free(run_start);
        free(run_task);
        free(rotated);
        return -1;
    }
    first[0] = 0;
    for (int i = 0; i < n; i++) first[i + 1] = first[i] + (int64_t)num_kv_heads * num_partitions(context_lens[i]);
    int runs = 0, longest = 1;
    for (int i = 0; i < n; i++) {
        if (i == 0 || i - run_start[runs - 1] == MAX_RUN ||
            !reads_blocks_of(block_tables, table_stride, context_lens, block_size, i - 1, i))
            run_start[runs++] = i;
        longest = i + 1 - run_start[runs - 1] > longest ? i + 1 - run_start[runs - 1] : longest;
    }
    run_start[runs] = n;
    run_task[0] = 0; /* a run's tasks: kv heads x the partitions of its longest context */
    for (int k = 0; k < runs; k++) {
        int64_t ctx = 0;
        for (int i = run_start[k]; i < run_start[k + 1]; i++) ctx = context_lens[i] > ctx ? context_lens[i] : ctx;
        run_task[k + 1] = run_task[k] + (int64_t)num_kv_heads * num_partitions(ctx);
    }
    int64_t num_tasks = run_task[runs];
    float *partials = malloc(sizeof(float) * (size_t)first[n] * G * (D + 2));
    if (!partials) {
        free(first);
        free(run_start);
        free(run_task);
        free(rotated);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_tasks > 1)
    {
        const size_t heads = (size_t)longest * G;
        float *scores = malloc(sizeof(float) * heads * PARTITION);
        float *work = malloc(sizeof(float) * heads * (2 * D + 2)); /* the rows' queries, then their partials */
        /* whole 16-row groups (see block_scores), zeroed so rows past a block's end are finite */
        float *block = calloc((size_t)(block_size + 15) / 16 * 16 * D, sizeof(float));
        if (!scores || !work || !block) {
#pragma omp atomic write
            failed = 1;
        }
        int k = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; task++) {
            if (failed) continue;
            while (run_task[k + 1] <= task) k++;
            while (run_task[k] > task) k--;
            int64_t local = task - run_task[k];
            int parts = (int)((run_task[k + 1] - run_task[k]) / num_kv_heads);
            int kvh = (int)(local / parts), part = (int)(local % parts);
            /* the run's sequences a partition at a time: those that attend the same positions together */
            for (int i = run_start[k]; i < run_start[k + 1];) {
                int64_t begin, end, b, e;
                partition_range(&P, i, part, &begin, &end);
                int j = i + 1;
                for (; j < run_start[k + 1]; j++) {
                    partition_range(&P, j, part, &b, &e);
                    if (b != begin || e != end) break;
                }
                float *o = work + heads * D;
                attend_rows(&P, softcap, i, j - i, kvh, begin, end, o, work, scores, block);
                for (int r = i; r < j; r++) {
                    int own = num_partitions(context_lens[r]);
                    if (part < own)
                        memcpy(partials + (first[r] + (int64_t)kvh * own + part) * G * (D + 2),
                               o + (size_t)(r - i) * G * (D + 2), sizeof(float) * G * (D + 2));
                }
                i = j;
            }
        }
        free(scores);
        free(work);
        free(block);
    }
    if (!failed) {
        for (int i = 0; i < n; i++) {
            int parts = num_partitions(context_lens[i]);
            for (int h = 0; h < num_heads; h++) {
                int kvh = h / G, g = h % G;
                const float *base = partials + (first[i] + (int64_t)kvh * parts) * G * (D + 2) + g * (D + 2);
                int64_t step = (int64_t)G * (D + 2);
                float M = -FLT_MAX, L = 0.0f;
                for (int p = 0; p < parts; p++) M = base[p * step + D] > M ? base[p * step + D] : M;
                float *o = out + ((int64_t)i * num_heads + h) * D;
                memset(o, 0, sizeof(float) * D);
                for (int p = 0; p < parts; p++) {
                    const float *part = base + p * step;
                    if (part[D + 1] == 0.0f) continue;
                    float w = exp_nonpositive(part[D] - M);
                    L += part[D + 1] * w;
                    for (int d = 0; d < D; d++) o[d] += part[d] * w;
                }
                float inv = L > 0.0f ? 1.0f / L : 0.0f;
                for (int d = 0; d < D; d++) o[d] *= inv;
                if (out_rotation) { /* values were summed in their rotated domain */
                    float summed[D];
                    memcpy(summed, o, sizeof(float) * D);
                    hadamard_unrotate(summed, out_rotation, D, o);
                }
            }
        }
    }
    free(partials);
    free(first);
    free(run_start);
    free(run_task);
    free(rotated);
    return failed ? -1 : 0;
}

/* q, out [n, num_heads, head_dim] for positions q_start .. q_start + n - 1 of one sequence whose
 * blocks are block_table; the cache holds its keys up to q_start + n - 1. Returns 0, or -1 when the
 * workspace could not be allocated. */
int paged_prefill_attention(int n, int64_t q_start, int num_heads, int num_kv_heads, int head_dim, const float *q,
                            float *out, const int64_t *block_table, int num_blocks, int block_size, int window,
                            float scale, float softcap, int k_kind, const void *k_codes, const void *k_scales,
                            int64_t k_code_stride, int64_t k_scale_stride, const float *k_table, int v_kind,
                            const void *v_codes, const void *v_scales, int64_t v_code_stride,
                            int64_t v_scale_stride, const float *v_table, const float *q_balance,
                            const float *q_rotation, const float *out_rotation, int num_threads) {
    float *rotated = NULL; /* the query as the keys are stored (as paged_decode_attention) */
    if ((q_balance || q_rotation) &&
        !(q = rotated = query_rows(q, n * num_heads, num_heads, num_heads / num_kv_heads, head_dim, q_balance,
                                   q_rotation, num_threads)))
        return -1;
    problem P = {num_heads, num_kv_heads, head_dim, num_blocks, block_size, window, scale, q, out,
                 block_table, 0, NULL,
                 {k_kind, k_codes, k_scales, k_code_stride, k_scale_stride, k_table},
                 {v_kind, v_codes, v_scales, v_code_stride, v_scale_stride, v_table}};
    const int G = num_heads / num_kv_heads, D = head_dim, tiles = (n + QUERY_TILE - 1) / QUERY_TILE;
    const int rows = QUERY_TILE * G;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (tiles * num_kv_heads > 1)
    {
        prefill_work w = {0};
        w.softcap = softcap;
        float *mem = malloc(sizeof(float) * ((size_t)rows * (2 * D + 2) + (size_t)KEY_TILE * D * 3));
        if (!mem) {
#pragma omp atomic write
            failed = 1;
        } else {
            w.q = mem;
            w.acc = w.q + (size_t)rows * D;
            w.m = w.acc + (size_t)rows * D;
            w.l = w.m + rows;
            w.keys = w.l + rows;
            w.values = w.keys + (size_t)KEY_TILE * D;
            w.kt = w.values + (size_t)KEY_TILE * D;
        }
        void *int_mem = NULL;
#if defined(INT_KEYS)
        if (mem && (k_kind == KV_Q8_0 || k_kind == KV_Q4_0)) { /* integer scores (int_key_scores) */
            int_mem = malloc(sizeof(int16_t) * ((size_t)rows * D + (size_t)KEY_TILE * D) +
                             sizeof(float) * ((size_t)rows + (size_t)KEY_TILE * (D / GROUP)));
            if (!int_mem) {
#pragma omp atomic write
                failed = 1;
            } else {
                w.q16_scale = int_mem;
                w.ks = w.q16_scale + rows;
                w.q16 = (int16_t *)(w.ks + (size_t)KEY_TILE * (D / GROUP));
                w.kq = w.q16 + (size_t)rows * D;
            }
        }
#endif
        /* the last tiles see the longest history: hand them out first */
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tiles * num_kv_heads; task++) {
            if (failed || !mem) continue;
            int tile = tiles - 1 - task / num_kv_heads, kvh = task % num_kv_heads;
            int t0 = tile * QUERY_TILE, tn = n - t0 < QUERY_TILE ? n - t0 : QUERY_TILE;
            prefill_task(&P, block_table, q_start, kvh, t0, tn, &w);
        }
        free(mem);
        free(int_mem);
    }
    free(rotated);
    if (out_rotation && !failed) { /* values were summed in their rotated domain */
#pragma omp parallel for num_threads(num_threads) if (n * num_heads >= 256)
        for (int r = 0; r < n * num_heads; r++) {
            float summed[head_dim];
            memcpy(summed, out + (int64_t)r * head_dim, sizeof(float) * head_dim);
            hadamard_unrotate(summed, out_rotation, head_dim, out + (int64_t)r * head_dim);
        }
    }
    return failed ? -1 : 0;
}

/* 1 where this build scores q8_0 and q4_0 keys in integers in prefill (AVX-512 VNNI), else 0. */
int paged_prefill_int_keys(void) {
#if defined(INT_KEYS)
    return 1;
#else
    return 0;
#endif
}
