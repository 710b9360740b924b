/* Reading a test driver's input (arm_driver.c, arm_attention_driver.c): exactly so many bytes, or exit 2. */
#include <stdio.h>
#include <stdlib.h>

static void *read_exactly(FILE *f, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, f) != bytes) {
        fprintf(stderr, "short input\n");
        exit(2);
    }
    return p;
}
