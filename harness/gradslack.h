/*
 * gradslack.h - how far a correct backend's dW1 may lie from the reference's
 * on a given problem: the part of the gradient checks' tolerance that an
 * error model gives, element by element (harness/gradslack.c).
 *
 * The contract (include/comet.h) fixes the rounding points, not the order of
 * an fp32 sum. Where a sum cancels, another order moves it by far more than
 * its own ulps: g, u (GEMM0, H terms) and G = dy W2^T (H terms) are such sums,
 * and a dW1 row is a dH column times x rows, so with a few rows an expert one
 * cancelling g, u or G moves a whole dW1 row by a large fraction of itself
 * (a u of -1.8e-6 from terms of ~1e-2 is ~3 fp32 ulps of their sum). The
 * slack bounds that: per row and dH column the change of dH that any two
 * fp32 orders of those sums, a flipped bf16 rounding of g, u and dH, and the
 * activation's Lipschitz constants allow, then per dW1 element its sum over
 * the expert's rows times |x|, plus the row sum's own order.
 */
#ifndef COMET_GRADSLACK_H
#define COMET_GRADSLACK_H

#include <math.h>
#include <stdint.h>

#include "comet.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int64_t hidden, w1_rows, experts_local;
    int64_t *first;              /* [E_local + 1]: the expert's rows are first[e] .. first[e + 1] - 1 */
    const uint16_t **x;          /* [rows]: the row's token (bf16, H) */
    float *ddh;                  /* (rows, w1_rows): bound on |dH_a - dH_b| */
    float *adh;                  /* (rows, w1_rows): |dH| (float64 evaluation) */
} comet_dw1_slack_t;

/* The slack of rank q's dW1 on the problem args (world_size ranks' backward
 * arguments as comet_reference_backward takes them: x, topk_idx, topk_w, dy
 * of every rank, w1 and w2 of q). */
comet_status_t comet_dw1_slack_init(comet_dw1_slack_t *s, const comet_layer_config_t *cfg, int world_size,
                                    const comet_backward_args_t *args, int q);

/* The slack of dW1 element (local expert e, row j, column c). */
double comet_dw1_slack(const comet_dw1_slack_t *s, int64_t e, int64_t j, int64_t c);

/* The gradient checks' rule, without the slack: how far a gradient element
 * may lie from the reference's value ref in a row of rms `rms` (8 bf16 ulps
 * of |ref| + 2% of the rms: what another fp32 order moves through dH's bf16
 * rounding); the dW1 checks add comet_dw1_slack. */
static inline double comet_grad_rule(double ref, double rms) {
    return 8.0 * fabs(ref) / 128.0 + 0.02 * rms;
}

void comet_dw1_slack_free(comet_dw1_slack_t *s);

#ifdef __cplusplus
}
#endif

#endif /* COMET_GRADSLACK_H */
