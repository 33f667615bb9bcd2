/*
 * plan.h - routing -> the data every backend schedules from, for one rank.
 *
 * A plan says, for rank r = (ep, tp), which token rows of the whole world its
 * local experts receive, where each row lands in the expert-grouped buffers,
 * how those buffers split into row blocks (tiles of height tile_m), in which
 * order layer 0 visits the blocks (local-first), and which tokens rank r sends
 * partial outputs back to. It is plain data built by plain C that compiles for
 * the host (plan.c) and inside CUDA kernels (src/cuda/plan_kernel.cu): no
 * allocation, no host calls. Buffers are sized for the worst case from the
 * config (comet_plan_workspace_bytes), so building needs no host sync.
 *
 * Row order inside one expert: by source rank in rotation order starting with
 * the local rank (r, r+1, ..., W-1, 0, ..., r-1), then by token, then by slot.
 * The rotation index of a row's source rank is its "stage": stage 0 rows are
 * local and ready at once; a block is ready once its latest stage has arrived.
 *
 * Not part of the public API.
 */
#ifndef COMET_PLAN_H
#define COMET_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "hd.h"

/* Sizes of one rank's view of a layer, derived once from the config. */
typedef struct {
    int world_size, rank, tp, ep, tp_rank, ep_rank;
    int64_t hidden;        /* H */
    int64_t ffn_local;     /* F / TP */
    int64_t num_experts;   /* E */
    int64_t experts_local; /* E / EP */
    int64_t topk;
    int64_t w1_rows;       /* 2*ffn_local (gated) or ffn_local */
    int64_t max_tokens;    /* per rank */
    int64_t tile_m;        /* row-block height */
    int64_t max_rows;      /* rows this rank can receive: W * max_tokens * min(topk, E_local) */
    int64_t max_rows_padded; /* max_rows + E_local * (tile_m - 1) */
    int64_t max_blocks;    /* max_rows / tile_m + E_local */
    int activation;        /* comet_activation_t */
} comet_dims_t;

/* One received token row. Padding rows have src_rank = -1. */
typedef struct {
    int32_t src_rank;  /* home rank of the token */
    int32_t src_token; /* index in the home rank's x */
    int32_t slot;      /* j in topk */
    float weight;      /* topk_w[src_token, slot] */
} comet_plan_row_t;

/* One row block: tile_m padded rows of one local expert. */
typedef struct {
    int32_t expert;    /* local expert index */
    int32_t row_start; /* first row in the padded expert-grouped layout */
    int32_t num_rows;  /* valid rows, 1..tile_m */
    int32_t stage;     /* latest source stage among its rows (0 = local only) */
} comet_plan_block_t;

/* Scalars of a built plan. */
typedef struct {
    int32_t num_rows;        /* valid rows received (sum of expert_count) */
    int32_t num_rows_padded; /* expert_start[E_local] */
    int32_t num_blocks;
} comet_plan_totals_t;

/* Views into one workspace (comet_plan_carve). Shapes in brackets. */
typedef struct {
    comet_plan_totals_t *totals;
    int32_t *expert_count;       /* [E_local] rows per local expert */
    int32_t *expert_start;       /* [E_local + 1] padded row offsets, multiples of tile_m */
    int32_t *cursor;             /* [E_local] scratch for the fill */
    comet_plan_row_t *rows;      /* [max_rows_padded] */
    comet_plan_block_t *blocks;  /* [max_blocks] in expert order; block b holds padded rows [b, b + 1) * tile_m */
    int32_t *l0_order;           /* [max_blocks] block ids, ascending stage (local first) */
    int32_t *stage_end;          /* [W] l0_order entries with stage <= q */
    int32_t *row_of_slot;        /* [W, max_tokens * topk] row of (src s, token t, slot j) or -1 */
    int32_t *send_count;         /* [W] tokens of home rank s with >= 1 row here */
    int32_t *send_tokens;        /* [W, max_tokens] those tokens, ascending */
    int32_t *home_group_count;   /* [max_tokens] EP groups used by each local token */
    int32_t *home_groups;        /* [max_tokens, topk] those groups, ascending */
} comet_plan_t;

/* Routing of every rank, as the plan builder reads it (peer pointers on GPU). */
typedef struct {
    const int64_t *token_count;     /* [W] T of each rank */
    const int32_t *const *topk_idx; /* [W] -> (T_s, topk) */
    const float *const *topk_w;     /* [W] -> (T_s, topk) */
} comet_plan_input_t;

/* The functions live in plan_impl.h, compiled for the host by plan.c and for
 * the device by src/cuda/plan_kernel.cu (which defines COMET_PLAN_DEVICE_ONLY
 * and gets file-local device copies). */
#ifndef COMET_PLAN_DEVICE_ONLY
#ifdef __cplusplus
extern "C" {
#endif
size_t comet_plan_workspace_bytes(const comet_dims_t *d);
/* Point every array of plan into workspace (comet_plan_workspace_bytes long,
 * 16-byte aligned). */
void comet_plan_carve(const comet_dims_t *d, void *workspace, comet_plan_t *plan);
/* Build the plan of rank d->rank from every rank's routing. Inputs must have
 * passed validation; ids out of range are skipped, never written through. */
void comet_plan_build(const comet_dims_t *d, const comet_plan_input_t *in, comet_plan_t *plan);
#ifdef __cplusplus
}
#endif
#endif

/* Rotation stage of source rank s as seen from rank r, and back. */
COMET_HD static inline int comet_stage_of(int r, int s, int w) { return (s - r + w) % w; }
COMET_HD static inline int comet_rank_of_stage(int r, int q, int w) { return (r + q) % w; }

#endif /* COMET_PLAN_H */
