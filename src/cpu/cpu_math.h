/*
 * cpu_math.h - the expert arithmetic of the CPU backend: one dot-product
 * order, one GEMM0+activation row, one GEMM1 row, one top-k accumulation.
 * The reference (reference.c) and the multi-rank engine (engine.c) both use
 * exactly these, which is why the engine's output is bitwise identical to the
 * reference. Accumulation order of a dot: eight lanes by k mod 8, then a
 * fixed pairwise sum; every backend's GEMMs must only match it within fp32
 * accumulation tolerance (the contract fixes fp32, not the order).
 */
#ifndef COMET_CPU_MATH_H
#define COMET_CPU_MATH_H

#include <math.h>
#include <stdint.h>

#include "../core/numerics.h"
#include "../plan/plan.h"

static inline float comet_cpu_dot(const comet_bf16_t *a, const comet_bf16_t *b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
        for (int l = 0; l < 8; l++) acc[l] += comet_bf16_to_f32(a[k + l]) * comet_bf16_to_f32(b[k + l]);
    for (; k < n; k++) acc[k & 7] += comet_bf16_to_f32(a[k]) * comet_bf16_to_f32(b[k]);
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* h[n0:n1) of one row: GEMM0 against one expert's w1 (w1_rows, H), the
 * activation in fp32, stored bf16 (rounding point 1). */
static inline void comet_cpu_gemm0_row(const comet_dims_t *d, const comet_bf16_t *x_row,
                                       const comet_bf16_t *w1_e, int64_t n0, int64_t n1,
                                       comet_bf16_t *h_row) {
    const int64_t hd = d->hidden;
    for (int64_t n = n0; n < n1; n++) {
        float g = comet_cpu_dot(x_row, w1_e + n * hd, hd);
        float h;
        if (d->activation == 0 /* COMET_ACT_SILU_GATED */) {
            float u = comet_cpu_dot(x_row, w1_e + (d->ffn_local + n) * hd, hd);
            h = comet_silu(g) * u;
        } else {
            h = comet_gelu(g);
        }
        h_row[n] = comet_f32_to_bf16(h);
    }
}

/* o[c0:c1) of one row: GEMM1 against one expert's w2 (H, F_local), stored
 * bf16 (rounding point 2). */
static inline void comet_cpu_gemm1_row(const comet_dims_t *d, const comet_bf16_t *h_row,
                                       const comet_bf16_t *w2_e, int64_t c0, int64_t c1,
                                       comet_bf16_t *o_row) {
    for (int64_t c = c0; c < c1; c++)
        o_row[c] = comet_f32_to_bf16(comet_cpu_dot(h_row, w2_e + c * d->ffn_local, d->ffn_local));
}

/* acc[c0:c1) += w * o[c0:c1), one slot of the top-k reduce (rounding point 3). */
static inline void comet_cpu_topk_accumulate(float *acc, float w, const comet_bf16_t *o, int64_t c0,
                                             int64_t c1) {
    for (int64_t c = c0; c < c1; c++) acc[c] = fmaf(w, comet_bf16_to_f32(o[c]), acc[c]);
}

#endif /* COMET_CPU_MATH_H */
