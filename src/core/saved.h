/*
 * saved.h - the layout of the state a training forward saves for its
 * backward (comet.h, comet_save_t), the same on every backend: a header,
 * then gu and h of every row of the rank's plan (the padded, expert-grouped
 * row order of src/plan/plan.h), bf16, rows the plan leaves empty
 * unwritten. The backward rebuilds the same plan from the same routing, so
 * row r of the saved arrays is row r of its plan. Not part of the public API.
 */
#ifndef COMET_SAVED_H
#define COMET_SAVED_H

#include <stddef.h>
#include <stdint.h>

#include "comet.h"
#include "../plan/hd.h"
#include "../plan/plan.h"

#define COMET_SAVED_MAGIC 0x31766173746d6f63ull /* "cometsav1" */
#define COMET_SAVED_HEADER_BYTES 256

/* The header, written by the forward last (after gu and h). */
typedef struct {
    uint64_t magic;     /* COMET_SAVED_MAGIC */
    uint64_t layer_id;  /* the layer that wrote it (comet_layer_t's id, unique in the process) */
    int64_t tokens;     /* T of the forward on this rank */
    int64_t rows;       /* valid rows of the forward's plan (a check, not a size) */
} comet_saved_header_t;

/* Bytes for mode save (comet_save_t) and dims d. */
COMET_HD static inline size_t comet_saved_bytes(const comet_dims_t *d, int save) {
    if (save != COMET_SAVE_ACTIVATIONS) return 0;
    return COMET_SAVED_HEADER_BYTES + (size_t)d->max_rows_padded * (size_t)(d->w1_rows + d->ffn_local) * 2u;
}
/* Offsets of gu (max_rows_padded, w1_rows) and h (max_rows_padded, F_local). */
COMET_HD static inline size_t comet_saved_gu_offset(const comet_dims_t *d) {
    (void)d;
    return COMET_SAVED_HEADER_BYTES;
}
COMET_HD static inline size_t comet_saved_h_offset(const comet_dims_t *d) {
    return COMET_SAVED_HEADER_BYTES + (size_t)d->max_rows_padded * (size_t)d->w1_rows * 2u;
}

#endif /* COMET_SAVED_H */
