/* The core's ceiling for bf16 and fp32 multiply-adds, measured: 12 independent chains (set
 * with -DCHAINS=N; 6 to 16 unroll fully; each starts from its own value, so that the compiler
 * cannot merge them) of `vdpbf16ps zmm` (AVX512_BF16: 32 bf16 products summed into 16 fp32
 * lanes, 64 flops an instruction) and of `vfmadd231ps zmm` (32 flops), registers only, no
 * memory traffic. No GEMM can run faster than this on one core; the bench's `gemm_classes`
 * GFLOP/s divided by it is the share of the ceiling a GEMM library reaches. Best of 7 runs of
 * 16 M x CHAINS instructions each, the two kinds alternated. Needs AVX512_BF16 (`avx512_bf16`
 * in /proc/cpuinfo; elsewhere it stops on an illegal instruction). AMX's tile unit is not
 * measured here.
 * A measuring tool, not part of Keel.
 *
 *   gcc -O2 -mavx512f -mavx512bf16 scripts/bench/bf16_peak.c -o /tmp/bf16_peak
 *   taskset -c 0 /tmp/bf16_peak
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#ifndef CHAINS
#define CHAINS 12
#endif
#define ITERS 16000000L

/* ITERS x CHAINS dot-product instructions; returns the seconds taken. */
static double run_bf16(float *sink) {
    __m512 acc[CHAINS];
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_ps((float)i); /* distinct: no chain merged */
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80); /* bf16 1.0 */
    __m512bh b = (__m512bh)_mm512_set1_epi16(0x2000); /* ~1.1e-19: normal, and small enough
                                                           that the sums never overflow */
    double t0 = now();
    for (long it = 0; it < ITERS; it++) {
#pragma GCC unroll 16
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    }
    double t = now() - t0;
    __m512 s = acc[0];
    for (int i = 1; i < CHAINS; i++) s = _mm512_add_ps(s, acc[i]);
    *sink += _mm512_reduce_add_ps(s);
    return t;
}

static double run_fp32(float *sink) {
    __m512 acc[CHAINS];
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_ps((float)i); /* distinct: no chain merged */
    __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-30f);
    double t0 = now();
    for (long it = 0; it < ITERS; it++) {
#pragma GCC unroll 16
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
    }
    double t = now() - t0;
    __m512 s = acc[0];
    for (int i = 1; i < CHAINS; i++) s = _mm512_add_ps(s, acc[i]);
    *sink += _mm512_reduce_add_ps(s);
    return t;
}

int main(void) {
    float sink = 0.0f;
    double best_bf16 = 1e30, best_fp32 = 1e30;
    for (int r = 0; r < 7; r++) { /* alternated, so that drift hits both alike */
        double t = run_bf16(&sink);
        if (t < best_bf16) best_bf16 = t;
        t = run_fp32(&sink);
        if (t < best_fp32) best_fp32 = t;
    }
    double n = (double)ITERS * CHAINS;
    printf("{\"bf16_dp_gflops\": %.1f, \"fp32_fma_gflops\": %.1f, \"bf16_instr_per_ns\": %.3f, "
           "\"fp32_instr_per_ns\": %.3f, \"sink\": %g}\n",
           n * 64 / best_bf16 * 1e-9, n * 32 / best_fp32 * 1e-9, n / best_bf16 * 1e-9,
           n / best_fp32 * 1e-9, sink);
    return 0;
}
