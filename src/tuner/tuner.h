/*
 * tuner.h - the one place that decides a layer's protocol (comet.h's
 * comet_protocol_t): the combine at create, and for each forward call the
 * mode, the number of communication workers (CPU) or blocks (GPU) and the
 * layer-1 column-chunk width, where the call leaves them at 0.
 *
 * A measured table comes first: `comet tune` times a configuration over a
 * grid of knobs and appends the best to a table file. Configurations the table
 * does not hold get the analytical rule. The file is tab-separated text, one
 * header line, then one line per measured configuration:
 *   backend hidden ffn experts topk tp ep tokens n_comm chunk_cols ms
 * (backend "cpu" or "cuda"; tokens per rank; a CUDA n_comm of 0 records that
 * the sequential chain was fastest). Malformed lines are skipped. Each world
 * reads its table once, when it is created (comet_world_options_t.tune_file).
 */
#ifndef COMET_TUNER_H
#define COMET_TUNER_H

#include <stdio.h>

#include "comet.h"
#include "../plan/plan.h"

/* Most ranks GEMM1's epilogue pushes to (src/cuda/gemm.h COMET_GEMM_MAX_PUSH). */
#define COMET_TUNER_MAX_PUSH 8

typedef struct {
    int n_comm;     /* communication workers (CPU) or blocks (GPU) */
    int chunk_cols; /* layer-1 column-chunk width (CPU engine); must be equal on every rank */
    int push;       /* [in] CUDA: the layer's combine is push, the layer the rule's overlapped choice
                     * was measured with; without it the rule keeps the sequential chain */
} comet_tuning_t;

/* A table read from a file (one per world: comet_world_options_t.tune_file). */
typedef struct comet_tune_table comet_tune_table_t;

/* Read a table file into *out (NULL or "" path: an empty table). Returns the
 * number of entries read, or -1 if the file cannot be opened, is not a
 * regular file or is larger than 1 MiB (*out is then an empty table too, or
 * NULL when out of memory). Lines longer than 510 characters and lines with a
 * value out of range (for a valid config; n_comm at most 64 for the CPU
 * engine, 1024 for CUDA; chunk_cols at most hidden) are skipped. */
int comet_tune_table_load(const char *path, comet_tune_table_t **out);
void comet_tune_table_free(comet_tune_table_t *table);

/* The combine a layer runs, chosen at create (it sizes the symmetric
 * buffer): the CPU engine's fp32 partials; on CUDA push where GEMM1's
 * epilogue can push (the Hopper GEMM, 2..8 ranks) unless force_pull, else
 * pull. */
comet_combine_t comet_tuner_combine(const comet_dims_t *d, comet_backend_t backend, comet_gemm_kind_t gemm,
                                    int force_pull);

/* The protocol of one forward: p->gemm and p->combine are [in] (the layer's,
 * from create); mode, n_comm, chunk_cols and chosen_by are [out]. n_comm and
 * chunk_cols are the call's arguments (0: the tuner's choice; n_comm
 * COMET_SEQUENTIAL: the sequential chain on CUDA). The table comes first
 * (the entry whose token count is nearest), then the rule. chunk_cols never
 * depends on this rank's token count (the nearest entry is taken for
 * max_tokens), so every rank of a world picks the same value; on the CUDA
 * backend the mode is taken for max_tokens too, and only the Hopper GEMM
 * runs the overlapped mode. */
void comet_tuner_choose(const comet_tune_table_t *table, const comet_dims_t *d, comet_backend_t backend,
                        int64_t num_tokens, int n_comm, int chunk_cols, comet_protocol_t *p);

/* The analytical rule alone (what the table falls back to), for the fields of
 * *t that are 0: chunk_cols about hidden/8; n_comm on the CPU engine 1 or 2 workers; on the CUDA backend 16
 * (the overlapped mode) for 2+ ranks with push, max_tokens >= 4096, topk
 * x hidden <= 16384 and an expert's W1 slice at most 2^26 elements (128
 * MiB: w1_rows x hidden; gated, F_local x hidden <= 2^25), else 0 (the
 * sequential chain): the 24 cells measured on 2x H200 and 4 rows on 4x H200
 * (docs/decisions.md). A table entry decides for every token count of its
 * configuration (the nearest entry, however far), so tune a configuration
 * at the token counts it runs. */
void comet_tuner_rule(const comet_dims_t *d, comet_backend_t backend, int64_t num_tokens, comet_tuning_t *t);

/* Append one measured entry to a table file (header written if new). */
int comet_tuner_append(const char *path, const comet_dims_t *d, comet_backend_t backend, int64_t tokens,
                       const comet_tuning_t *t, double ms);

#endif /* COMET_TUNER_H */
