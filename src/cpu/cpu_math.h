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

/* ---- backward (include/comet.h, "Backward") ------------------------------ */

/* One row's backward through its expert slice, steps 1, 2 and 4: from x_row
 * and dy_row (H), the expert's w1_e (w1_rows, H) and w2t_e (W2_e transposed:
 * (F_local, H)), and the row's routing weight w: a_row (F_local), the
 * forward's h, and dh_row (w1_rows), dH in bf16. Returns the slice's
 * <G, a> (step 3's part), in comet_cpu_dot's lane order. */
static inline float comet_cpu_backward_row(const comet_dims_t *d, const comet_bf16_t *x_row,
                                           const comet_bf16_t *dy_row, float w, const comet_bf16_t *w1_e,
                                           const comet_bf16_t *w2t_e, comet_bf16_t *a_row, comet_bf16_t *dh_row) {
    const int64_t hd = d->hidden, fl = d->ffn_local;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t n = 0; n < fl; n++) {
        const float g = comet_cpu_dot(x_row, w1_e + n * hd, hd);
        const float gb = comet_bf16_to_f32(comet_f32_to_bf16(g));                      /* gu in bf16 */
        const float G = comet_cpu_dot(dy_row, w2t_e + n * hd, hd), dA = w * G;
        if (d->activation == 0 /* COMET_ACT_SILU_GATED */) {
            const float u = comet_cpu_dot(x_row, w1_e + (fl + n) * hd, hd);
            float dg, du;
            a_row[n] = comet_f32_to_bf16(comet_silu(g) * u);
            comet_silu_gated_backward(gb, comet_bf16_to_f32(comet_f32_to_bf16(u)), dA, &dg, &du);
            dh_row[n] = comet_f32_to_bf16(dg);
            dh_row[fl + n] = comet_f32_to_bf16(du);
        } else {
            a_row[n] = comet_f32_to_bf16(comet_gelu(g));
            dh_row[n] = comet_f32_to_bf16(dA * comet_gelu_grad(gb));
        }
        acc[n & 7] += G * comet_bf16_to_f32(a_row[n]);
    }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* dX_r (H) of one row, step 5: dh_row (w1_rows) against w1t_e (W1_e
 * transposed: (H, w1_rows)), stored bf16. */
static inline void comet_cpu_dgrad_row(const comet_dims_t *d, const comet_bf16_t *dh_row, const comet_bf16_t *w1t_e,
                                       comet_bf16_t *dx_row) {
    for (int64_t c = 0; c < d->hidden; c++)
        dx_row[c] = comet_f32_to_bf16(comet_cpu_dot(dh_row, w1t_e + c * d->w1_rows, d->w1_rows));
}

/* One row's share of the weight gradients, step 7, into fp32 sums:
 * dw2 (H, F_local) += bf16(w dy_row)^T a_row, dw1 (w1_rows, H) += dh_row^T
 * x_row. */
static inline void comet_cpu_wgrad_row(const comet_dims_t *d, const comet_bf16_t *x_row, const comet_bf16_t *dy_row,
                                       float w, const comet_bf16_t *a_row, const comet_bf16_t *dh_row, float *dw1,
                                       float *dw2) {
    const int64_t hd = d->hidden, fl = d->ffn_local;
    for (int64_t c = 0; c < hd; c++) {
        const float dyw = comet_bf16_to_f32(comet_f32_to_bf16(w * comet_bf16_to_f32(dy_row[c])));
        for (int64_t n = 0; n < fl; n++) dw2[c * fl + n] += dyw * comet_bf16_to_f32(a_row[n]);
    }
    for (int64_t n = 0; n < d->w1_rows; n++) {
        const float dh = comet_bf16_to_f32(dh_row[n]);
        for (int64_t c = 0; c < hd; c++) dw1[n * hd + c] += dh * comet_bf16_to_f32(x_row[c]);
    }
}

#endif /* COMET_CPU_MATH_H */
