/* A test driver's input (arm_driver.c, arm_attention_driver.c): `driver IN OUT`, and IN read exactly
 * (a short file exits 2). */
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

/* IN opened for reading, after checking the command line; exits 2 when it is wrong or IN cannot be opened. */
static FILE *open_input(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
        exit(2);
    }
    FILE *in = fopen(argv[1], "rb");
    if (!in) exit(2);
    return in;
}
