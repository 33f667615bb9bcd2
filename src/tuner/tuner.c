/*
 * tuner.c - analytical fallback for the run-time knobs (see tuner.h).
 *
 * chunk_cols: about 8 chunks over hidden, a multiple of 8 columns, so the
 * reduce-and-send of chunk c overlaps the GEMM of chunk c+1 while each chunk
 * stays wide enough to amortise its flag. n_comm: on the CPU engine, one worker
 * per 4 compute-sized pieces of traffic is plenty; 2 unless the call is tiny.
 */
#include "tuner.h"

void comet_tuner_pick(const comet_dims_t *d, int64_t num_tokens, comet_tuning_t *t) {
    if (t->chunk_cols == 0) {
        int64_t c = (d->hidden + 7) / 8;
        c = (c + 7) / 8 * 8;
        if (c > d->hidden) c = d->hidden;
        t->chunk_cols = (int)c;
    }
    if (t->n_comm == 0) t->n_comm = num_tokens * d->topk >= 64 ? 2 : 1;
}
