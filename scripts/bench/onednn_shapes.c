/* GFLOP/s of the bf16 matmuls Keel's worker runs, called exactly as the worker calls them
 * (through model/csrc/dnnl_matmul.c: bf16 inputs, f32 output, user scratchpad, 1 OpenMP
 * thread), at BERT-mini and BERT-base shapes, in the three layouts the model uses:
 *   AB   y = x W       (A [m, k], B [k, n], row-major)
 *   AB^T y = x W^T     (B stored [n, k]: a Linear's forward and the MLM decoder)
 *   A^TB dW = dy^T x   (A stored [k, m]: a weight gradient)
 * Each shape: 3 warm-up calls, then the best of 5 rounds of 0.15 s. One line per shape, with
 * the implementation oneDNN chose. A measuring tool, not part of Keel.
 *
 *   gcc -O2 -fopenmp scripts/bench/onednn_shapes.c -o /tmp/onednn_shapes -ldnnl -lgomp
 *   OMP_NUM_THREADS=1 /tmp/onednn_shapes
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../../model/csrc/dnnl_matmul.c"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static const char *LAYOUT[3] = {"AB", "AB^T", "A^TB"};

static void run(int m, int k, int n, int layout) {
    int64_t ad[2] = {m, k}, bd[2] = {k, n}, cd[2] = {m, n}, as[2], bs[2], cs[2] = {n, 1};
    if (layout == 2) { as[0] = 1; as[1] = m; } else { as[0] = k; as[1] = 1; }
    if (layout == 1) { bs[0] = 1; bs[1] = k; } else { bs[0] = n; bs[1] = 1; }
    struct keel_matmul *mm = NULL;
    char impl[128];
    int st = keel_dnnl_matmul_create(1, 2, ad, as, bd, bs, cd, cs, 1.0f, 0.0f, 0, &mm, impl, sizeof impl);
    if (st) {
        printf("[%d, %d] x [%d, %d] %s: oneDNN could not create it (status %d)\n", m, k, k, n,
               LAYOUT[layout], st);
        return;
    }
    uint16_t *a = malloc((size_t)m * k * 2), *b = malloc((size_t)k * n * 2);
    float *c = calloc((size_t)m * n, 4);
    if (!a || !b || !c) { puts("out of memory"); exit(1); }
    for (size_t i = 0; i < (size_t)m * k; i++) a[i] = 0x3f80 + (i % 7); /* ~1.0 in bf16 */
    for (size_t i = 0; i < (size_t)k * n; i++) b[i] = 0x3c00 + (i % 5); /* ~0.008 */
    for (int w = 0; w < 3; w++) keel_dnnl_matmul_run(mm, a, b, NULL, c);
    double best = 1e9;
    for (int r = 0; r < 5; r++) {
        double t = now();
        int it = 0;
        while (now() - t < 0.15) { keel_dnnl_matmul_run(mm, a, b, NULL, c); it++; }
        double dt = (now() - t) / it;
        if (dt < best) best = dt;
    }
    printf("[%d, %d] x [%d, %d] %-4s %6.0f GFLOP/s  %s\n", m, k, k, n, LAYOUT[layout],
           2.0 * m * k * n / best / 1e9, impl);
    keel_dnnl_matmul_destroy(mm);
    free(a); free(b); free(c);
}

int main(void) {
    /* mini: 32 x 128 tokens, hidden 256, intermediate 1024, ~600 masked positions x vocab
     * 30,522; base: hidden 768, intermediate 3072. */
    int shapes[][3] = {{4096, 256, 256},  {4096, 256, 1024}, {4096, 1024, 256},
                       {608, 256, 30522}, {4096, 768, 768},  {4096, 768, 3072}};
    for (int s = 0; s < 6; s++)
        for (int layout = 0; layout < 3; layout++) run(shapes[s][0], shapes[s][1], shapes[s][2], layout);
    return 0;
}
