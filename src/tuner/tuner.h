/*
 * tuner.h - choice of the run-time knobs of a forward call when the caller
 * leaves them at 0: the number of communication workers (CPU) or blocks (GPU)
 * and the layer-1 column-chunk width.
 *
 * A measured table comes first: `comet tune` times a configuration over a
 * grid of knobs and appends the best to a table file; the library reads the
 * file named by COMET_TUNE_FILE once per process. Configurations the table
 * does not hold get the analytical rule. The file is tab-separated text, one
 * header line, then one line per measured configuration:
 *   backend hidden ffn experts topk tp ep tokens n_comm chunk_cols ms
 * (backend "cpu" or "cuda"; tokens per rank; a CUDA n_comm of 0 records that
 * the sequential chain was fastest). Malformed lines are skipped.
 */
#ifndef COMET_TUNER_H
#define COMET_TUNER_H

#include <stdio.h>

#include "comet.h"
#include "../plan/plan.h"

typedef struct {
    int n_comm;     /* communication workers (CPU) or blocks (GPU) */
    int chunk_cols; /* layer-1 column-chunk width; must be equal on every rank */
    int push;       /* [in] CUDA: GEMM1 pushes rows home (COMET_PUSH, no partials): the layer
                     * the rule's overlapped choice was measured with; without it the rule
                     * keeps the sequential chain */
} comet_tuning_t;

/* Fill the fields of *t that are 0, from the table when it holds this
 * configuration (the entry whose token count is nearest), else by rule.
 * chunk_cols never depends on this rank's token count (the nearest entry is
 * taken for max_tokens), so every rank of a world picks the same value; on
 * the CUDA backend n_comm chooses the protocol (0: the sequential chain) and
 * is taken for max_tokens too. */
void comet_tuner_pick(const comet_dims_t *d, comet_backend_t backend, int64_t num_tokens, comet_tuning_t *t);

/* The analytical rule alone (what the table falls back to): chunk_cols about
 * hidden/8; n_comm on the CPU engine 1 or 2 workers; on the CUDA backend 16
 * (the overlapped mode) for 2+ ranks with push, max_tokens >= 4096, topk
 * x hidden <= 16384 and an expert's W1 slice at most 2^26 elements (128
 * MiB: w1_rows x hidden; gated, F_local x hidden <= 2^25), else 0 (the
 * sequential chain): the 24 cells measured on
 * 2x H200 (bench/results/2026-11-22-comet-h200x2-5215af5.md) and 4 rows on
 * 4x H200 (-h200x4-a392388.jsonl; tuner.c says which). A table entry
 * decides for every token count of its configuration (the nearest entry,
 * however far), so tune a configuration at the token counts it runs. */
void comet_tuner_rule(const comet_dims_t *d, comet_backend_t backend, int64_t num_tokens, comet_tuning_t *t);

/* Read a table file, replacing the process's table (NULL or "" clears it).
 * Returns the number of entries read, or -1 if the file cannot be opened, is
 * not a regular file or is larger than 1 MiB. Lines longer than 510 characters
 * and lines with a value out of range (for a valid config; n_comm at most 64
 * for the CPU engine, 1024 for CUDA; chunk_cols at most hidden) are skipped.
 * Thread-safe; comet_tuner_pick reads COMET_TUNE_FILE by itself once, unless
 * a table was loaded before. */
int comet_tuner_load(const char *path);

/* Append one measured entry to a table file (header written if new). */
int comet_tuner_append(const char *path, const comet_dims_t *d, comet_backend_t backend, int64_t tokens,
                       const comet_tuning_t *t, double ms);

#endif /* COMET_TUNER_H */
