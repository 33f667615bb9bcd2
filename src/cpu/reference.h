/*
 * reference.h - the reference in pieces, for harnesses: the forward one
 * token at a time (to check a sample of tokens of a problem too large to
 * evaluate whole on the CPU; comet_reference_forward in comet.h evaluates
 * every token with these; inputs must have passed validation), and the
 * backward token by token and expert by expert (to run its items on many
 * threads; comet_reference_backward runs them all in order).
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

/* The backward's specification (src/cpu/reference_backward.c) in items:
 * begin validates every rank's args (as comet_reference_backward does,
 * nothing written on failure) and makes what the items share; first every
 * transpose item (expert e of rank q's weights, e <
 * comet_reference_backward_experts_local), in any order or at once; then
 * the others: each writes outputs no other item writes, so they may run in
 * any order or at once, each thread with its own scratch; the outputs are complete once
 * every token item (dx, d_topk_w: token t of rank s, t <
 * comet_reference_backward_tokens) and every expert item (dW1, dW2: local
 * expert e of rank q, e < comet_reference_backward_experts_local) has run.
 * end frees the shared part (after every item). */
typedef struct comet_reference_backward comet_reference_backward_t;
typedef struct comet_reference_backward_scratch comet_reference_backward_scratch_t;

comet_status_t comet_reference_backward_begin(comet_reference_backward_t **rb, const comet_layer_config_t *cfg,
                                              int world_size, const comet_backward_args_t *args);
void comet_reference_backward_transpose(comet_reference_backward_t *rb, int q, int64_t e);
int64_t comet_reference_backward_tokens(const comet_reference_backward_t *rb, int s);
int64_t comet_reference_backward_experts_local(const comet_reference_backward_t *rb);
comet_status_t comet_reference_backward_scratch_create(const comet_reference_backward_t *rb,
                                                       comet_reference_backward_scratch_t **scratch);
void comet_reference_backward_token(const comet_reference_backward_t *rb, comet_reference_backward_scratch_t *scratch,
                                    int s, int64_t t);
void comet_reference_backward_expert(const comet_reference_backward_t *rb, comet_reference_backward_scratch_t *scratch,
                                     int q, int64_t e);
void comet_reference_backward_scratch_free(comet_reference_backward_scratch_t *scratch);
void comet_reference_backward_end(comet_reference_backward_t *rb);

#ifdef __cplusplus
}
#endif

#endif /* COMET_REFERENCE_H */
