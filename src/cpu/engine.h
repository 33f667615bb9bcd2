/*
 * engine.h - the multi-rank CPU engine's private state, shared by its two
 * halves: engine.c (layers, the protocol every collective call runs, the
 * forward) and engine_backward.c (the backward on the same protocol). Not
 * part of the public API; engine.c's header comment documents the protocol.
 */
#ifndef COMET_CPU_ENGINE_H
#define COMET_CPU_ENGINE_H

#include <pthread.h>
#include <stdatomic.h>

#include "../core/runtime.h"
#include "../core/numerics.h"

typedef _Atomic uint64_t flag_t;

/* One rank's symmetric memory: every rank loads and stores it. */
typedef struct {
    comet_bf16_t *x;     /* (max_T, H): staged tokens */
    comet_bf16_t *dy;    /* (max_T, H): staged gradient of y (backward) */
    int32_t *topk_idx;   /* (max_T, topk) */
    float *topk_w;       /* (max_T, topk) */
    float *partials;     /* (W, max_T, H): [q][t] written by rank q */
    float *dtw_parts;    /* (TP, max_T, topk): [tp][t][j] <G, a> of slot j's expert slice tp (backward) */
    flag_t *partial_flag; /* (W, H): [q][c] = epoch once rank q wrote chunk c */
    int64_t token_count;
    int status;
    int chunk_cols;
    char message[256];
    flag_t entry;
    flag_t done;
} cpu_sym_t;

typedef struct {
    atomic_int refs;
    int world_size;
    cpu_sym_t *rank; /* [W] */
    void *block;     /* one allocation for all rank buffers */
} cpu_shared_t;

typedef struct cpu_layer cpu_layer_t;

/* What a call's compute workers do with the rows of one block: layer 0's
 * columns [c0, c1) of the ffn dimension (tiles of l0_tile columns), layer
 * 1's columns [c0, c1) of H (one chunk). */
typedef void (*cpu_rows_fn)(comet_layer_t *l, int worker, const comet_plan_block_t *blk, int64_t c0, int64_t c1);

#define WG_KB 4 /* output rows of a weight-gradient task (engine_backward.c) */

/* The backward's buffers, taken at its first call (engine_backward.c), and
 * its call in flight. */
typedef struct {
    comet_bf16_t *dh;        /* (max_rows_padded, w1_rows): each row's dH */
    comet_bf16_t *dxr;       /* (max_rows_padded, H): each row's dX */
    float *dtw;              /* (max_rows_padded): each row's <G, a> */
    comet_bf16_t *w1t, *w2t; /* the weights' transposes (comet_cpu_transpose_weights) */
    comet_bf16_t *gu_tmp;    /* (workers, 2, w1_rows): two recomputed rows' gu */
    float *sum_tmp;          /* (workers, WG_KB, max(H, F_local)): a task's weight-gradient sums; also
                                layer 0's dots (4 F_local) and layer 1's (2 H): WG_KB >= 4 */
    float *scale_tmp;        /* (workers, max_rows_padded, WG_KB, 4): a task's row scales, broadcast; 64-aligned */
    /* the call */
    const comet_bf16_t *gu, *act; /* saved state: gu (rows, w1_rows) and a (rows, F_local); NULL: computed again */
    const comet_backward_args_t *args;
} cpu_backward_t;

struct cpu_layer {
    cpu_shared_t *sh;
    void *plan_ws;
    comet_plan_t plan;
    comet_bf16_t *a, *h, *o; /* gathered x rows, activations, expert outputs (backward: dy rows) */
    flag_t *block_ready;     /* [max_blocks] */
    flag_t l0_done;
    uint64_t l0_base;
    flag_t *l1_done;         /* [H] */
    uint64_t *l1_base;       /* [H] */
    uint64_t epoch;
    size_t private_bytes;    /* what cpu_take() allocated */
    comet_trace_t *trace;    /* recorder attached by comet_layer_set_trace, or NULL */
    cpu_backward_t bw;
    /* the call in flight */
    comet_trace_t *rec;      /* its recorder: trace, or NULL */
    int backward;            /* a backward: its steps are traced as the backward's kinds */
    const comet_bf16_t *w1, *w2;
    comet_bf16_t *out;       /* (T, H): y, or dx */
    int64_t num_tokens;
    int n_comm, n_compute, chunk_cols, n_chunks;
    int disable;             /* COMET_DISABLE_* of this call (measurement only) */
    int64_t l0_tile;         /* layer-0 tile width (ffn columns) */
    int64_t l0_tiles;        /* layer-0 tiles of the call, for l0_base */
    void (*head)(comet_layer_t *l, int worker); /* a compute worker's work before layer 0, or NULL: then
                                                    every worker waits for every worker's (head_done) */
    flag_t head_done;
    uint64_t head_base;
    cpu_rows_fn layer0, layer1;
    void (*tail)(comet_layer_t *l, int worker); /* a compute worker's work after layer 1, or NULL */
    comet_bf16_t *fwd_h;     /* forward: where layer 0 stores h: h, or the saved state's */
    comet_bf16_t *fwd_gu;    /* forward: the saved state's gu, or NULL */
    comet_bf16_t *pull_dy;   /* rows (max_rows_padded, H) layer 0 fills with dy beside x, or NULL */
    const comet_bf16_t *combined; /* rows the combine reduces: o, or dX */
    int unit_weights;        /* the combine's top-k reduce with weights 1 (backward) */
    const float *row_dtw;    /* backward: each row's <G, a>, sent home with chunk 0 */
    float *d_topk_w;         /* backward: (T, topk), summed over TP ranks with chunk 0 */
    /* first failure of a worker */
    pthread_mutex_t err_mu;
    comet_status_t err;
    char err_msg[512];
};

/* Private memory of the layer, counted for comet_layer_memory; aligned (64
 * bytes) when asked. NULL when out of memory. */
void *cpu_take(cpu_layer_t *L, size_t bytes, int aligned);

/* The common part of a collective call, after this rank's own checks (own:
 * their status, the calling thread's last error its message), on the
 * protocol proto: wait for the previous call everywhere, stage x, routing
 * and (not NULL) dy for the peers, meet them, and, if every rank's input is
 * valid and the ranks agree on proto, build this rank's plan and set
 * layer->protocol. On failure every rank returns an error having written
 * nothing. */
comet_status_t cpu_enter(comet_layer_t *l, comet_status_t own, int64_t t, const comet_protocol_t *proto,
                         const void *x, const void *topk_idx, const void *topk_w, const void *dy);
/* A call's own checks beside src/core/validate.h's, made before entry so
 * that the peers learn of a failure: n_comm at most the engine's most
 * workers (COMET_CPU_MAX_N_COMM). */
comet_status_t cpu_check_n_comm(int n_comm);
/* A saved state's bf16 arrays need saved.data 2-byte aligned. */
comet_status_t cpu_check_saved_alignment(const comet_tensor_t *saved);
/* Run the call the fields "in flight" describe on n_comm communication and
 * n_compute compute workers, then close it (done = epoch). */
comet_status_t cpu_run(comet_layer_t *l);

/* Record one step of (role, worker) from t0 to now into the call's
 * recorder (L->rec set), in the backward's kinds during a backward. */
void cpu_trace_step(comet_layer_t *l, int role, int worker, int kind, int64_t index, int64_t aux, uint64_t t0);

/* The backward (engine_backward.c). */
comet_status_t cpu_layer_backward(comet_layer_t *l, const comet_backward_args_t *args);

#endif /* COMET_CPU_ENGINE_H */
