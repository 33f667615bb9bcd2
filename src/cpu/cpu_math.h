/*
 * cpu_math.h - the expert arithmetic of the CPU backend: one dot-product
 * order, one GEMM0+activation row, one GEMM1 row, one top-k accumulation,
 * and the backward's steps (the activation's backward row, the dX row, the
 * weight gradients' sums and their store). The references (reference.c,
 * reference_backward.c) and the multi-rank engine (engine.c,
 * engine_backward.c) all use exactly these, which is why the engine's
 * outputs are bitwise identical to the references'. Accumulation order of a
 * dot: eight lanes by k mod 8, then a fixed pairwise sum; every backend's
 * GEMMs must only match it within fp32 accumulation tolerance (the contract
 * fixes fp32, not the order).
 */
#ifndef COMET_CPU_MATH_H
#define COMET_CPU_MATH_H

#include <math.h>
#include <stdint.h>

#include "comet.h"
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

/* Column n of one row's GEMM0 epilogue from its dots g (and u, gated): the
 * activation in fp32, h_row[n] in bf16 (rounding point 1), and with gu_row
 * not NULL gu_row's n (and F_local + n) in bf16. */
static inline void comet_cpu_gemm0_col(const comet_dims_t *d, float g, float u, int64_t n, comet_bf16_t *h_row,
                                       comet_bf16_t *gu_row) {
    float h;
    if (d->activation == 0 /* COMET_ACT_SILU_GATED */) {
        h = comet_silu(g) * u;
        if (gu_row) gu_row[d->ffn_local + n] = comet_f32_to_bf16(u);
    } else {
        h = comet_gelu(g);
    }
    if (gu_row) gu_row[n] = comet_f32_to_bf16(g);
    h_row[n] = comet_f32_to_bf16(h);
}

/* h[n0:n1) of one row: GEMM0 against one expert's w1 (w1_rows, H), the
 * activation in fp32, stored bf16 (rounding point 1); with gu_row (w1_rows)
 * not NULL also the pre-activation's columns n0..n1-1 in bf16, gu = [g|u]
 * (gated) or g (backward step 1: what a training forward saves). */
static inline void comet_cpu_gemm0_gu_row(const comet_dims_t *d, const comet_bf16_t *x_row,
                                          const comet_bf16_t *w1_e, int64_t n0, int64_t n1, comet_bf16_t *h_row,
                                          comet_bf16_t *gu_row) {
    const int64_t hd = d->hidden;
    for (int64_t n = n0; n < n1; n++) {
        const float g = comet_cpu_dot(x_row, w1_e + n * hd, hd);
        const float u = d->activation == 0 ? comet_cpu_dot(x_row, w1_e + (d->ffn_local + n) * hd, hd) : 0.0f;
        comet_cpu_gemm0_col(d, g, u, n, h_row, gu_row);
    }
}

/* The same without gu (inference). */
static inline void comet_cpu_gemm0_row(const comet_dims_t *d, const comet_bf16_t *x_row,
                                       const comet_bf16_t *w1_e, int64_t n0, int64_t n1,
                                       comet_bf16_t *h_row) {
    comet_cpu_gemm0_gu_row(d, x_row, w1_e, n0, n1, h_row, NULL);
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

/* One tile of a transpose, cache-friendly: dst (cols, rows) gets src (rows,
 * cols)'s elements [r0, r0 + TILE) x [c0, c0 + TILE), clipped. */
#define COMET_CPU_TRANSPOSE_TILE 32
static inline void comet_cpu_transpose_tile(const comet_bf16_t *src, comet_bf16_t *dst, int64_t rows, int64_t cols,
                                            int64_t r0, int64_t c0) {
    const int64_t T = COMET_CPU_TRANSPOSE_TILE;
    const int64_t r1 = r0 + T < rows ? r0 + T : rows, c1 = c0 + T < cols ? c0 + T : cols;
    for (int64_t c = c0; c < c1; c++)
        for (int64_t r = r0; r < r1; r++) dst[c * rows + r] = src[r * cols + c];
}

/* W1_e and W2_e of every local expert transposed, as the backward's rows
 * read them: w1t (E_local, H, w1_rows) and w2t (E_local, F_local, H), from
 * w1 (E_local, w1_rows, H) and w2 (E_local, H, F_local), tile by tile. */
static inline void comet_cpu_transpose_weights(const comet_dims_t *d, const comet_bf16_t *w1, const comet_bf16_t *w2,
                                               comet_bf16_t *w1t, comet_bf16_t *w2t) {
    const int64_t hd = d->hidden, fl = d->ffn_local, r1 = d->w1_rows, T = COMET_CPU_TRANSPOSE_TILE;
    for (int64_t e = 0; e < d->experts_local; e++) {
        for (int64_t r0 = 0; r0 < r1; r0 += T)
            for (int64_t c0 = 0; c0 < hd; c0 += T) comet_cpu_transpose_tile(w1 + e * r1 * hd, w1t + e * hd * r1, r1, hd, r0, c0);
        for (int64_t r0 = 0; r0 < hd; r0 += T)
            for (int64_t c0 = 0; c0 < fl; c0 += T) comet_cpu_transpose_tile(w2 + e * hd * fl, w2t + e * fl * hd, hd, fl, r0, c0);
    }
}

/* Column n of one row's step 4 from its G (step 2's dot): dh_row's n (and
 * F_local + n, gated) from gu_row, the row's routing weight w and G. */
static inline void comet_cpu_backward_col(const comet_dims_t *d, const comet_bf16_t *gu_row, float w, float G,
                                          int64_t n, comet_bf16_t *dh_row) {
    const int64_t fl = d->ffn_local;
    const float dA = w * G;
    const float g = comet_bf16_to_f32(gu_row[n]);
    if (d->activation == 0 /* COMET_ACT_SILU_GATED */) {
        float dg, du;
        comet_silu_gated_backward(g, comet_bf16_to_f32(gu_row[fl + n]), dA, &dg, &du);
        dh_row[n] = comet_f32_to_bf16(dg);
        dh_row[fl + n] = comet_f32_to_bf16(du);
    } else {
        dh_row[n] = comet_f32_to_bf16(dA * comet_gelu_grad(g));
    }
}

/* One row's backward through its expert slice, steps 2 and 4, from step 1's
 * gu_row (w1_rows) and a_row (F_local: the forward's h), both as
 * comet_cpu_gemm0_gu_row stores them (computed again, or saved by the
 * forward), dy_row (H), the expert's w2t_e (W2_e transposed: (F_local, H))
 * and the row's routing weight w: dh_row (w1_rows), dH in bf16. Returns the
 * slice's <G, a> (step 3's part), in comet_cpu_dot's lane order. */
static inline float comet_cpu_backward_row(const comet_dims_t *d, const comet_bf16_t *gu_row,
                                           const comet_bf16_t *a_row, const comet_bf16_t *dy_row, float w,
                                           const comet_bf16_t *w2t_e, comet_bf16_t *dh_row) {
    const int64_t hd = d->hidden, fl = d->ffn_local;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t n = 0; n < fl; n++) {
        const float G = comet_cpu_dot(dy_row, w2t_e + n * hd, hd);
        comet_cpu_backward_col(d, gu_row, w, G, n, dh_row);
        acc[n & 7] += G * comet_bf16_to_f32(a_row[n]);
    }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* The same from the row's G (F_local), comet_cpu_dot(dy_row, w2t_e + n H, H)
 * for each n, computed by the caller. */
static inline float comet_cpu_backward_row_g(const comet_dims_t *d, const comet_bf16_t *gu_row,
                                             const comet_bf16_t *a_row, const float *G, float w,
                                             comet_bf16_t *dh_row) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t n = 0; n < d->ffn_local; n++) {
        comet_cpu_backward_col(d, gu_row, w, G[n], n, dh_row);
        acc[n & 7] += G[n] * comet_bf16_to_f32(a_row[n]);
    }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* dX_r[c0:c1) of one row, step 5: dh_row (w1_rows) against w1t_e (W1_e
 * transposed: (H, w1_rows)), stored bf16. */
static inline void comet_cpu_dgrad_row(const comet_dims_t *d, const comet_bf16_t *dh_row, const comet_bf16_t *w1t_e,
                                       int64_t c0, int64_t c1, comet_bf16_t *dx_row) {
    for (int64_t c = c0; c < c1; c++)
        dx_row[c] = comet_f32_to_bf16(comet_cpu_dot(dh_row, w1t_e + c * d->w1_rows, d->w1_rows));
}

/* Step 7's fp32 sums, one row's share of one output row: sum[0:n) += s *
 * v[0:n). dW1_e[k, :] takes s = dH_r[k], v = x_r (n = H); dW2_e[c, :] takes
 * s = comet_cpu_wgrad_scale(w, dy_r[c]), v = a_r (n = F_local). Every
 * element sums its rows in the order the caller visits them. */
static inline void comet_cpu_wgrad_add(float *sum, float s, const comet_bf16_t *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) sum[i] += s * comet_bf16_to_f32(v[i]);
}

/* dW2's row scale: bf16(w dy[c]), in fp32. */
static inline float comet_cpu_wgrad_scale(float w, comet_bf16_t dy) {
    return comet_bf16_round(w * comet_bf16_to_f32(dy));
}

/* One row's share of one expert's weight gradients, step 7, into fp32 sums:
 * dw2 (H, F_local) += bf16(w dy_row)^T a_row, dw1 (w1_rows, H) += dh_row^T
 * x_row. */
static inline void comet_cpu_wgrad_row(const comet_dims_t *d, const comet_bf16_t *x_row, const comet_bf16_t *dy_row,
                                       float w, const comet_bf16_t *a_row, const comet_bf16_t *dh_row, float *dw1,
                                       float *dw2) {
    const int64_t hd = d->hidden, fl = d->ffn_local;
    for (int64_t c = 0; c < hd; c++) comet_cpu_wgrad_add(dw2 + c * fl, comet_cpu_wgrad_scale(w, dy_row[c]), a_row, fl);
    for (int64_t n = 0; n < d->w1_rows; n++) comet_cpu_wgrad_add(dw1 + n * hd, comet_bf16_to_f32(dh_row[n]), x_row, hd);
}

/* out[offset, offset + n) from fp32 sums, step 7: rounded once to its dtype
 * (bf16 or fp32), or added to it (fp32, accumulate). */
static inline void comet_cpu_store_grad(const comet_tensor_t *out, int64_t offset, const float *sum, int64_t n,
                                        int accumulate) {
    if (out->dtype == COMET_DTYPE_BF16) {
        comet_bf16_t *o = (comet_bf16_t *)out->data + offset;
        for (int64_t i = 0; i < n; i++) o[i] = comet_f32_to_bf16(sum[i]);
        return;
    }
    float *o = (float *)out->data + offset;
    for (int64_t i = 0; i < n; i++) o[i] = accumulate ? o[i] + sum[i] : sum[i];
}

#endif /* COMET_CPU_MATH_H */
