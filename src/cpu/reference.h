/*
 * reference.h - the reference one token at a time, for harnesses that check a
 * sample of tokens of a problem too large to evaluate whole on the CPU
 * (comet_reference_forward in comet.h evaluates every token with these).
 * Inputs must have passed validation.
 */
#ifndef COMET_REFERENCE_H
#define COMET_REFERENCE_H

#include "comet.h"
#include "../core/numerics.h"
#include "../plan/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    float *acc_y, *partial; /* (H) */
    comet_bf16_t *h;        /* (F_local) */
    comet_bf16_t *o;        /* (H) */
    float *o_ulps;          /* (H) sum over the token's rows of |w| * one bf16 ulp of o: how far a
                             * different GEMM1 order can move y by flipping o's roundings */
} comet_reference_scratch_t;

comet_status_t comet_reference_scratch_init(const comet_dims_t *d, comet_reference_scratch_t *s);
void comet_reference_scratch_free(comet_reference_scratch_t *s);

/* y (H) = the layer's output for token t of rank s. */
void comet_reference_token(const comet_layer_config_t *cfg, int world_size, const comet_forward_args_t *inputs,
                           int s, int64_t t, comet_reference_scratch_t *scratch, comet_bf16_t *y);

#ifdef __cplusplus
}
#endif

#endif /* COMET_REFERENCE_H */
