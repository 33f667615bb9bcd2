/*
 * plan_impl.h - the plan builder (see plan.h), written once for host and
 * device. Included by plan.c (host, external functions) and by
 * src/cuda/plan_kernel.cu (device, COMET_PLAN_API = static __device__).
 *
 * The builder is sequential phases over plain arrays:
 *   1. count rows per local expert          4. row blocks per expert
 *   2. padded prefix sums                    5. local-first block order
 *   3. fill rows in stage order              6. send lists and home groups
 * Every phase is a loop over independent items or a prefix sum, so the GPU
 * version can split it over threads later without changing the result.
 */
#include "plan.h"

#ifndef COMET_PLAN_API
#define COMET_PLAN_API
#endif

#define COMET_PLAN_ALIGN 16

COMET_HD static inline size_t comet_plan_align_up(size_t n) {
    return (n + COMET_PLAN_ALIGN - 1) / COMET_PLAN_ALIGN * COMET_PLAN_ALIGN;
}

/* Walk the workspace layout once: with base == NULL it only measures. */
COMET_HD static size_t comet_plan_layout(const comet_dims_t *d, char *base, comet_plan_t *p) {
    size_t off = 0;
    const int64_t w = d->world_size, el = d->experts_local;
#define COMET_CARVE(field, type, count)                                \
    do {                                                               \
        if (base) p->field = (type *)(base + off);                     \
        off += comet_plan_align_up(sizeof(type) * (size_t)(count));    \
    } while (0)
    COMET_CARVE(totals, comet_plan_totals_t, 1);
    COMET_CARVE(expert_count, int32_t, el);
    COMET_CARVE(expert_start, int32_t, el + 1);
    COMET_CARVE(cursor, int32_t, el);
    COMET_CARVE(rows, comet_plan_row_t, d->max_rows_padded);
    COMET_CARVE(blocks, comet_plan_block_t, d->max_blocks);
    COMET_CARVE(l0_order, int32_t, d->max_blocks);
    COMET_CARVE(stage_end, int32_t, w);
    COMET_CARVE(row_of_slot, int32_t, w * d->max_tokens * d->topk);
    COMET_CARVE(send_count, int32_t, w);
    COMET_CARVE(send_tokens, int32_t, w * d->max_tokens);
    COMET_CARVE(home_group_count, int32_t, d->max_tokens);
    COMET_CARVE(home_groups, int32_t, d->max_tokens * d->topk);
#undef COMET_CARVE
    return off;
}

COMET_PLAN_API size_t comet_plan_workspace_bytes(const comet_dims_t *d) {
    return comet_plan_layout(d, (char *)0, (comet_plan_t *)0);
}

COMET_PLAN_API void comet_plan_carve(const comet_dims_t *d, void *workspace, comet_plan_t *plan) {
    comet_plan_layout(d, (char *)workspace, plan);
}

COMET_PLAN_API void comet_plan_build(const comet_dims_t *d, const comet_plan_input_t *in,
                                     comet_plan_t *p) {
    const int w = d->world_size, r = d->rank;
    const int64_t el = d->experts_local, topk = d->topk, tm = d->tile_m;
    const int64_t e0 = (int64_t)d->ep_rank * el;
    const int64_t slots = d->max_tokens * topk; /* row_of_slot stride per source rank */

    /* 1. rows per local expert */
    for (int64_t e = 0; e < el; e++) p->expert_count[e] = 0;
    for (int s = 0; s < w; s++) {
        const int32_t *idx = in->topk_idx[s];
        for (int64_t i = 0; i < in->token_count[s] * topk; i++) {
            int64_t e = (int64_t)idx[i] - e0;
            if (e >= 0 && e < el) p->expert_count[e]++;
        }
    }

    /* 2. padded prefix sums */
    p->expert_start[0] = 0;
    int32_t num_rows = 0;
    for (int64_t e = 0; e < el; e++) {
        int64_t padded = (p->expert_count[e] + tm - 1) / tm * tm;
        p->expert_start[e + 1] = p->expert_start[e] + (int32_t)padded;
        p->cursor[e] = p->expert_start[e];
        num_rows += p->expert_count[e];
    }

    /* 3. fill rows in stage order: local rank first, then r+1, ... */
    for (int q = 0; q < w; q++) {
        int s = comet_rank_of_stage(r, q, w);
        const int32_t *idx = in->topk_idx[s];
        const float *wt = in->topk_w[s];
        int32_t *ros = p->row_of_slot + (int64_t)s * slots;
        for (int64_t t = 0; t < in->token_count[s]; t++) {
            for (int64_t j = 0; j < topk; j++) {
                int64_t e = (int64_t)idx[t * topk + j] - e0;
                if (e < 0 || e >= el) {
                    ros[t * topk + j] = -1;
                    continue;
                }
                int32_t row = p->cursor[e]++;
                comet_plan_row_t pr;
                pr.src_rank = s;
                pr.src_token = (int32_t)t;
                pr.slot = (int32_t)j;
                pr.weight = wt[t * topk + j];
                p->rows[row] = pr;
                ros[t * topk + j] = row;
            }
        }
    }
    for (int64_t e = 0; e < el; e++) {
        for (int32_t i = p->cursor[e]; i < p->expert_start[e + 1]; i++) {
            comet_plan_row_t pad = {-1, -1, -1, 0.0f};
            p->rows[i] = pad;
        }
    }

    /* 4. row blocks, in expert order */
    int32_t nb = 0;
    for (int64_t e = 0; e < el; e++) {
        for (int32_t start = p->expert_start[e]; start < p->expert_start[e] + p->expert_count[e];
             start += (int32_t)tm) {
            int32_t end = p->expert_start[e] + p->expert_count[e];
            comet_plan_block_t b;
            b.expert = (int32_t)e;
            b.row_start = start;
            b.num_rows = (int32_t)(end - start < tm ? end - start : tm);
            /* rows are in stage order, so the last row has the latest stage */
            b.stage = comet_stage_of(r, p->rows[start + b.num_rows - 1].src_rank, w);
            p->blocks[nb++] = b;
        }
    }

    /* 5. local-first order: stable counting sort of blocks by stage */
    int32_t filled = 0;
    for (int q = 0; q < w; q++) {
        for (int32_t b = 0; b < nb; b++)
            if (p->blocks[b].stage == q) p->l0_order[filled++] = b;
        p->stage_end[q] = filled;
    }

    /* 6a. tokens of each home rank that have at least one row here */
    for (int s = 0; s < w; s++) {
        const int32_t *ros = p->row_of_slot + (int64_t)s * slots;
        int32_t *list = p->send_tokens + (int64_t)s * d->max_tokens;
        int32_t n = 0;
        for (int64_t t = 0; t < in->token_count[s]; t++) {
            int any = 0;
            for (int64_t j = 0; j < topk; j++) any |= ros[t * topk + j] >= 0;
            if (any) list[n++] = (int32_t)t;
        }
        p->send_count[s] = n;
    }

    /* 6b. EP groups that hold each local token's experts, ascending: the ranks
     * whose partials the home rank sums, in the contract's fixed order. */
    const int32_t *own = in->topk_idx[r];
    for (int64_t t = 0; t < in->token_count[r]; t++) {
        int32_t *g = p->home_groups + t * topk;
        int32_t n = 0;
        for (int64_t j = 0; j < topk; j++) {
            int32_t grp = (int32_t)(own[t * topk + j] / el);
            int32_t k = n;
            int dup = 0;
            for (int32_t m = 0; m < n; m++) dup |= g[m] == grp;
            if (dup) continue;
            while (k > 0 && g[k - 1] > grp) { /* insertion sort, topk is small */
                g[k] = g[k - 1];
                k--;
            }
            g[k] = grp;
            n++;
        }
        p->home_group_count[t] = n;
    }

    p->totals->num_rows = num_rows;
    p->totals->num_rows_padded = p->expert_start[el];
    p->totals->num_blocks = nb;
}
