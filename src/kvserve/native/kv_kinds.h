/* What the KV kernels (paged_attention.c, kv_write.c) share: the KV types' numbers (as
 * attention/native_paged.py's KV_KIND_CODES), the q8_0/q4_0 group size, and f16 -> f32 (half.h). */
#ifndef KVSERVE_KV_KINDS_H
#define KVSERVE_KV_KINDS_H
#include <stdint.h>
#include <string.h>

#include "half.h"

enum { KV_F32, KV_F16, KV_BF16, KV_Q8_0, KV_Q4_0, KV_FP8, KV_TQ2, KV_TQ3, KV_TQ4 };

#define GROUP 32

#endif
