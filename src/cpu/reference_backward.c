/*
 * reference_backward.c - the specification of one MoE layer backward as
 * plain loops, for all ranks of a world at once (include/comet.h,
 * "Backward"). Readable first: every other backend's backward is tested
 * against it. Not fast: each row is evaluated twice (once per pass).
 *
 * Pass 1, token by token on its home rank s: for each rank q in ascending
 * order, the rows of the token's slots whose experts live on q (ascending
 * slot): the slice's <G, a> into d_topk_w (so the TP ranks of an EP group
 * add in ascending tp), dX_r summed into q's partial; dx[t] = bf16(sum of
 * the partials of the contributing ranks, ascending q).
 * Pass 2, expert by expert on its rank q: the expert's rows in the order
 * q's plan holds them (stage by stage from q itself, then token), each
 * row's share of dW1 and dW2 added into fp32 sums; then written (rounded
 * once) or added to the caller's fp32 gradients.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/status.h"
#include "../core/validate.h"
#include "cpu_math.h"

/* The transposes of one rank's weights, which the row helpers read by row:
 * w1t (E_local, H, w1_rows) and w2t (E_local, F_local, H). */
typedef struct {
    comet_bf16_t *w1t, *w2t;
} transposed_t;

static comet_status_t transpose_weights(const comet_dims_t *d, const comet_backward_args_t *a, transposed_t *t) {
    const int64_t el = d->experts_local, hd = d->hidden, fl = d->ffn_local, r1 = d->w1_rows;
    t->w1t = malloc(sizeof(comet_bf16_t) * (size_t)(el * r1 * hd) + 1);
    t->w2t = malloc(sizeof(comet_bf16_t) * (size_t)(el * hd * fl) + 1);
    if (!t->w1t || !t->w2t) {
        free(t->w1t), free(t->w2t);
        t->w1t = t->w2t = NULL;
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "reference backward: no memory for the weights' transposes");
    }
    comet_cpu_transpose_weights(d, a->w1.data, a->w2.data, t->w1t, t->w2t);
    return COMET_SUCCESS;
}

typedef struct {
    comet_dims_t *dims;   /* [W] */
    int64_t *tokens;      /* [W] */
    transposed_t *wt;     /* [W] */
    comet_bf16_t *gu, *dh; /* (w1_rows): one row's */
    comet_bf16_t *a;       /* (F_local): one row's */
    comet_bf16_t *dxr;    /* (H): one row's dX */
    float *acc, *partial; /* (H) */
    float *dtw;           /* (topk) */
    float *dw1, *dw2;     /* one expert's fp32 sums */
} state_t;

static void state_free(state_t *s, int w) {
    for (int q = 0; s->wt && q < w; q++) free(s->wt[q].w1t), free(s->wt[q].w2t);
    free(s->dims), free(s->tokens), free(s->wt), free(s->gu), free(s->a), free(s->dh), free(s->dxr);
    free(s->acc), free(s->partial), free(s->dtw), free(s->dw1), free(s->dw2);
}

/* Steps 1, 2 and 4 of one row: gu, a and dH into the state; returns the
 * slice's <G, a>. */
static float row_backward(const comet_dims_t *dq, state_t *st, const comet_bf16_t *x, const comet_bf16_t *dy, float w,
                          const comet_bf16_t *w1_e, const comet_bf16_t *w2t_e) {
    comet_cpu_gemm0_gu_row(dq, x, w1_e, 0, dq->ffn_local, st->a, st->gu);
    return comet_cpu_backward_row(dq, st->gu, st->a, dy, w, w2t_e, st->dh);
}

/* Pass 1: dx and d_topk_w of token t of home rank s. */
static void token_backward(const comet_backward_args_t *args, int w, state_t *st, int s, int64_t t) {
    const comet_dims_t *d0 = &st->dims[0];
    const int64_t hd = d0->hidden, topk = d0->topk, el = d0->experts_local;
    const comet_bf16_t *x = (const comet_bf16_t *)args[s].x.data + t * hd;
    const comet_bf16_t *dy = (const comet_bf16_t *)args[s].dy.data + t * hd;
    const int32_t *idx = (const int32_t *)args[s].topk_idx.data + t * topk;
    const float *wt = (const float *)args[s].topk_w.data + t * topk;
    for (int64_t c = 0; c < hd; c++) st->acc[c] = 0.0f;
    for (int64_t j = 0; j < topk; j++) st->dtw[j] = 0.0f;
    for (int q = 0; q < w; q++) {
        const comet_dims_t *dq = &st->dims[q];
        int contributes = 0;
        for (int64_t c = 0; c < hd; c++) st->partial[c] = 0.0f;
        for (int64_t j = 0; j < topk; j++) {
            const int64_t e = idx[j];
            if (e / el != dq->ep_rank) continue;
            contributes = 1;
            const comet_bf16_t *w1_e = (const comet_bf16_t *)args[q].w1.data + (e % el) * dq->w1_rows * hd;
            const comet_bf16_t *w2t_e = st->wt[q].w2t + (e % el) * dq->ffn_local * hd;
            const comet_bf16_t *w1t_e = st->wt[q].w1t + (e % el) * hd * dq->w1_rows;
            st->dtw[j] += row_backward(dq, st, x, dy, wt[j], w1_e, w2t_e);
            comet_cpu_dgrad_row(dq, st->dh, w1t_e, 0, hd, st->dxr);
            comet_cpu_topk_accumulate(st->partial, 1.0f, st->dxr, 0, hd);
        }
        if (contributes)
            for (int64_t c = 0; c < hd; c++) st->acc[c] += st->partial[c];
    }
    comet_bf16_t *dx = (comet_bf16_t *)args[s].dx.data + t * hd;
    for (int64_t c = 0; c < hd; c++) dx[c] = comet_f32_to_bf16(st->acc[c]);
    float *dtw = (float *)args[s].d_topk_w.data + t * topk;
    for (int64_t j = 0; j < topk; j++) dtw[j] = st->dtw[j];
}

/* Pass 2: dW1 and dW2 of rank q's local expert el_e. */
static void expert_backward(const comet_backward_args_t *args, int w, state_t *st, int q, int64_t el_e) {
    const comet_dims_t *dq = &st->dims[q];
    const int64_t hd = dq->hidden, fl = dq->ffn_local, r1 = dq->w1_rows, topk = dq->topk;
    const int64_t e = dq->ep_rank * dq->experts_local + el_e;
    memset(st->dw1, 0, sizeof(float) * (size_t)(r1 * hd));
    memset(st->dw2, 0, sizeof(float) * (size_t)(hd * fl));
    const comet_bf16_t *w1_e = (const comet_bf16_t *)args[q].w1.data + el_e * r1 * hd;
    const comet_bf16_t *w2t_e = st->wt[q].w2t + el_e * fl * hd;
    for (int stage = 0; stage < w; stage++) { /* the plan's row order: stage, then token */
        const int s = comet_rank_of_stage(q, stage, w);
        const int32_t *idx = args[s].topk_idx.data;
        const float *wt = args[s].topk_w.data;
        for (int64_t t = 0; t < st->tokens[s]; t++)
            for (int64_t j = 0; j < topk; j++) {
                if (idx[t * topk + j] != e) continue;
                const comet_bf16_t *x = (const comet_bf16_t *)args[s].x.data + t * hd;
                const comet_bf16_t *dy = (const comet_bf16_t *)args[s].dy.data + t * hd;
                row_backward(dq, st, x, dy, wt[t * topk + j], w1_e, w2t_e);
                comet_cpu_wgrad_row(dq, x, dy, wt[t * topk + j], st->a, st->dh, st->dw1, st->dw2);
            }
    }
    comet_cpu_store_grad(&args[q].dw1, el_e * r1 * hd, st->dw1, r1 * hd, args[q].accumulate);
    comet_cpu_store_grad(&args[q].dw2, el_e * hd * fl, st->dw2, hd * fl, args[q].accumulate);
}

comet_status_t comet_reference_backward(const comet_layer_config_t *cfg, int world_size,
                                        const comet_backward_args_t *args) {
    comet_clear_error();
    if (!args) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "args is NULL");
    if (world_size < 1 || world_size > COMET_MAX_RANKS)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "world_size %d is outside [1, %d]", world_size, COMET_MAX_RANKS);
    state_t st;
    memset(&st, 0, sizeof st);
    st.dims = calloc((size_t)world_size, sizeof *st.dims);
    st.tokens = calloc((size_t)world_size, sizeof *st.tokens);
    st.wt = calloc((size_t)world_size, sizeof *st.wt);
    if (!st.dims || !st.tokens || !st.wt) {
        state_free(&st, world_size);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "reference backward: no memory");
    }
    /* every rank validated before anything is written */
    for (int s = 0; s < world_size; s++) {
        comet_status_t e = comet_dims_from_config(cfg, world_size, s, &st.dims[s]);
        if (e == COMET_SUCCESS) e = comet_check_backward_args(&st.dims[s], &args[s], 1, &st.tokens[s]);
        if (e != COMET_SUCCESS) {
            char msg[1024];
            snprintf(msg, sizeof msg, "rank %d: %s", s, comet_last_error());
            state_free(&st, world_size);
            return comet_fail_copy(e, msg);
        }
    }
    const comet_dims_t *d0 = &st.dims[0];
    const int64_t hd = d0->hidden, fl = d0->ffn_local, r1 = d0->w1_rows;
    st.gu = malloc(sizeof(comet_bf16_t) * (size_t)r1);
    st.a = malloc(sizeof(comet_bf16_t) * (size_t)fl);
    st.dh = malloc(sizeof(comet_bf16_t) * (size_t)r1);
    st.dxr = malloc(sizeof(comet_bf16_t) * (size_t)hd);
    st.acc = malloc(sizeof(float) * (size_t)hd);
    st.partial = malloc(sizeof(float) * (size_t)hd);
    st.dtw = malloc(sizeof(float) * (size_t)d0->topk);
    st.dw1 = malloc(sizeof(float) * (size_t)(r1 * hd));
    st.dw2 = malloc(sizeof(float) * (size_t)(hd * fl));
    comet_status_t e = st.gu && st.a && st.dh && st.dxr && st.acc && st.partial && st.dtw && st.dw1 && st.dw2
                           ? COMET_SUCCESS
                           : comet_fail(COMET_ERR_OUT_OF_MEMORY, "reference backward: no memory");
    for (int q = 0; e == COMET_SUCCESS && q < world_size; q++) e = transpose_weights(&st.dims[q], &args[q], &st.wt[q]);
    if (e != COMET_SUCCESS) {
        state_free(&st, world_size);
        return e;
    }
    for (int s = 0; s < world_size; s++)
        for (int64_t t = 0; t < st.tokens[s]; t++) token_backward(args, world_size, &st, s, t);
    for (int q = 0; q < world_size; q++)
        for (int64_t el_e = 0; el_e < d0->experts_local; el_e++) expert_backward(args, world_size, &st, q, el_e);
    state_free(&st, world_size);
    return COMET_SUCCESS;
}
