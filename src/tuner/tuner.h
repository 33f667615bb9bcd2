/*
 * tuner.h - choice of the run-time knobs of a forward call when the caller
 * leaves them at 0: the number of communication workers (n_comm) and the
 * layer-1 column-chunk width. Today an analytical rule; a measured table from
 * `comet tune` plugs in behind the same call (issue: fused layers).
 */
#ifndef COMET_TUNER_H
#define COMET_TUNER_H

#include "../plan/plan.h"

typedef struct {
    int n_comm;     /* communication workers (CPU) or blocks (GPU) */
    int chunk_cols; /* layer-1 column-chunk width; must be equal on every rank */
} comet_tuning_t;

/* Fill the fields of *t that are 0. chunk_cols depends on the config alone, so
 * every rank of a world picks the same value. */
void comet_tuner_pick(const comet_dims_t *d, int64_t num_tokens, comet_tuning_t *t);

#endif /* COMET_TUNER_H */
