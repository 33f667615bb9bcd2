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
 *
 * Every token of pass 1 and every expert of pass 2 writes outputs no other
 * one writes, with scratch of its own, so the passes' items may run in any
 * order or at once, once every expert's weights are transposed (items too;
 * reference.h: harnesses run them on many threads); the function below runs
 * them in order, in the calling thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/status.h"
#include "../core/validate.h"
#include "cpu_math.h"
#include "reference.h"

/* The transposes of one rank's weights, which the row helpers read by row:
 * w1t (E_local, H, w1_rows) and w2t (E_local, F_local, H). */
typedef struct {
    comet_bf16_t *w1t, *w2t;
} transposed_t;

static comet_status_t alloc_transposes(const comet_dims_t *d, transposed_t *t) {
    const int64_t el = d->experts_local, hd = d->hidden, fl = d->ffn_local, r1 = d->w1_rows;
    t->w1t = malloc(sizeof(comet_bf16_t) * (size_t)(el * r1 * hd) + 1);
    t->w2t = malloc(sizeof(comet_bf16_t) * (size_t)(el * hd * fl) + 1);
    if (!t->w1t || !t->w2t) {
        free(t->w1t), free(t->w2t);
        t->w1t = t->w2t = NULL;
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "reference backward: no memory for the weights' transposes");
    }
    return COMET_SUCCESS;
}

/* What every item shares: validated once, read only. */
struct comet_reference_backward {
    int world_size;
    const comet_backward_args_t *args;
    comet_dims_t *dims;   /* [W] */
    int64_t *tokens;      /* [W] */
    transposed_t *wt;     /* [W] */
};

/* One item's scratch. */
struct comet_reference_backward_scratch {
    comet_bf16_t *gu, *dh; /* (w1_rows): one row's */
    comet_bf16_t *a;       /* (F_local): one row's */
    comet_bf16_t *dxr;    /* (H): one row's dX */
    float *acc, *partial; /* (H) */
    float *dtw;           /* (topk) */
    float *dw1, *dw2;     /* one expert's fp32 sums */
};

void comet_reference_backward_scratch_free(comet_reference_backward_scratch_t *s) {
    if (!s) return;
    free(s->gu), free(s->a), free(s->dh), free(s->dxr), free(s->acc), free(s->partial), free(s->dtw), free(s->dw1);
    free(s->dw2), free(s);
}

comet_status_t comet_reference_backward_scratch_create(const comet_reference_backward_t *rb,
                                                       comet_reference_backward_scratch_t **out) {
    const comet_dims_t *d0 = &rb->dims[0];
    const int64_t hd = d0->hidden, fl = d0->ffn_local, r1 = d0->w1_rows;
    comet_reference_backward_scratch_t *s = calloc(1, sizeof *s);
    if (s) {
        s->gu = malloc(sizeof(comet_bf16_t) * (size_t)r1);
        s->a = malloc(sizeof(comet_bf16_t) * (size_t)fl);
        s->dh = malloc(sizeof(comet_bf16_t) * (size_t)r1);
        s->dxr = malloc(sizeof(comet_bf16_t) * (size_t)hd);
        s->acc = malloc(sizeof(float) * (size_t)hd);
        s->partial = malloc(sizeof(float) * (size_t)hd);
        s->dtw = malloc(sizeof(float) * (size_t)d0->topk);
        s->dw1 = malloc(sizeof(float) * (size_t)(r1 * hd));
        s->dw2 = malloc(sizeof(float) * (size_t)(hd * fl));
    }
    if (!s || !s->gu || !s->a || !s->dh || !s->dxr || !s->acc || !s->partial || !s->dtw || !s->dw1 || !s->dw2) {
        comet_reference_backward_scratch_free(s);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "reference backward: no memory");
    }
    *out = s;
    return COMET_SUCCESS;
}

/* Steps 1, 2 and 4 of one row: gu, a and dH into the state; returns the
 * slice's <G, a>. */
static float row_backward(const comet_dims_t *dq, comet_reference_backward_scratch_t *st, const comet_bf16_t *x,
                          const comet_bf16_t *dy, float w, const comet_bf16_t *w1_e, const comet_bf16_t *w2t_e) {
    comet_cpu_gemm0_gu_row(dq, x, w1_e, 0, dq->ffn_local, st->a, st->gu);
    return comet_cpu_backward_row(dq, st->gu, st->a, dy, w, w2t_e, st->dh);
}

/* Pass 1: dx and d_topk_w of token t of home rank s. */
void comet_reference_backward_token(const comet_reference_backward_t *sh, comet_reference_backward_scratch_t *st, int s,
                                    int64_t t) {
    const comet_backward_args_t *args = sh->args;
    const int w = sh->world_size;
    const comet_dims_t *d0 = &sh->dims[0];
    const int64_t hd = d0->hidden, topk = d0->topk, el = d0->experts_local;
    const comet_bf16_t *x = (const comet_bf16_t *)args[s].x.data + t * hd;
    const comet_bf16_t *dy = (const comet_bf16_t *)args[s].dy.data + t * hd;
    const int32_t *idx = (const int32_t *)args[s].topk_idx.data + t * topk;
    const float *wt = (const float *)args[s].topk_w.data + t * topk;
    for (int64_t c = 0; c < hd; c++) st->acc[c] = 0.0f;
    for (int64_t j = 0; j < topk; j++) st->dtw[j] = 0.0f;
    for (int q = 0; q < w; q++) {
        const comet_dims_t *dq = &sh->dims[q];
        int contributes = 0;
        for (int64_t c = 0; c < hd; c++) st->partial[c] = 0.0f;
        for (int64_t j = 0; j < topk; j++) {
            const int64_t e = idx[j];
            if (e / el != dq->ep_rank) continue;
            contributes = 1;
            const comet_bf16_t *w1_e = (const comet_bf16_t *)args[q].w1.data + (e % el) * dq->w1_rows * hd;
            const comet_bf16_t *w2t_e = sh->wt[q].w2t + (e % el) * dq->ffn_local * hd;
            const comet_bf16_t *w1t_e = sh->wt[q].w1t + (e % el) * hd * dq->w1_rows;
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
void comet_reference_backward_expert(const comet_reference_backward_t *sh, comet_reference_backward_scratch_t *st, int q,
                                     int64_t el_e) {
    const comet_backward_args_t *args = sh->args;
    const int w = sh->world_size;
    const comet_dims_t *dq = &sh->dims[q];
    const int64_t hd = dq->hidden, fl = dq->ffn_local, r1 = dq->w1_rows, topk = dq->topk;
    const int64_t e = dq->ep_rank * dq->experts_local + el_e;
    memset(st->dw1, 0, sizeof(float) * (size_t)(r1 * hd));
    memset(st->dw2, 0, sizeof(float) * (size_t)(hd * fl));
    const comet_bf16_t *w1_e = (const comet_bf16_t *)args[q].w1.data + el_e * r1 * hd;
    const comet_bf16_t *w2t_e = sh->wt[q].w2t + el_e * fl * hd;
    for (int stage = 0; stage < w; stage++) { /* the plan's row order: stage, then token */
        const int s = comet_rank_of_stage(q, stage, w);
        const int32_t *idx = args[s].topk_idx.data;
        const float *wt = args[s].topk_w.data;
        for (int64_t t = 0; t < sh->tokens[s]; t++)
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

void comet_reference_backward_end(comet_reference_backward_t *rb) {
    if (!rb) return;
    for (int q = 0; rb->wt && q < rb->world_size; q++) free(rb->wt[q].w1t), free(rb->wt[q].w2t);
    free(rb->dims), free(rb->tokens), free(rb->wt), free(rb);
}

comet_status_t comet_reference_backward_begin(comet_reference_backward_t **out, const comet_layer_config_t *cfg,
                                              int world_size, const comet_backward_args_t *args) {
    comet_clear_error();
    if (!args) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "args is NULL");
    if (world_size < 1 || world_size > COMET_MAX_RANKS)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "world_size %d is outside [1, %d]", world_size, COMET_MAX_RANKS);
    comet_reference_backward_t *rb = calloc(1, sizeof *rb);
    if (rb) {
        rb->world_size = world_size, rb->args = args;
        rb->dims = calloc((size_t)world_size, sizeof *rb->dims);
        rb->tokens = calloc((size_t)world_size, sizeof *rb->tokens);
        rb->wt = calloc((size_t)world_size, sizeof *rb->wt);
    }
    if (!rb || !rb->dims || !rb->tokens || !rb->wt) {
        comet_reference_backward_end(rb);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "reference backward: no memory");
    }
    /* every rank validated before anything is written */
    for (int s = 0; s < world_size; s++) {
        comet_status_t e = comet_dims_from_config(cfg, world_size, s, &rb->dims[s]);
        if (e == COMET_SUCCESS) e = comet_check_backward_args(&rb->dims[s], &args[s], 1, &rb->tokens[s]);
        if (e != COMET_SUCCESS) {
            char msg[1024];
            snprintf(msg, sizeof msg, "rank %d: %s", s, comet_last_error());
            comet_reference_backward_end(rb);
            return comet_fail_copy(e, msg);
        }
    }
    comet_status_t e = COMET_SUCCESS;
    for (int q = 0; e == COMET_SUCCESS && q < world_size; q++) e = alloc_transposes(&rb->dims[q], &rb->wt[q]);
    if (e != COMET_SUCCESS) {
        comet_reference_backward_end(rb);
        return e;
    }
    *out = rb;
    return COMET_SUCCESS;
}

void comet_reference_backward_transpose(comet_reference_backward_t *rb, int q, int64_t e) {
    comet_dims_t one = rb->dims[q]; /* expert e alone */
    const int64_t hd = one.hidden, fl = one.ffn_local, r1 = one.w1_rows;
    one.experts_local = 1;
    comet_cpu_transpose_weights(&one, (const comet_bf16_t *)rb->args[q].w1.data + e * r1 * hd,
                                (const comet_bf16_t *)rb->args[q].w2.data + e * hd * fl, rb->wt[q].w1t + e * hd * r1,
                                rb->wt[q].w2t + e * fl * hd);
}

int64_t comet_reference_backward_tokens(const comet_reference_backward_t *rb, int s) {
    return rb->tokens[s];
}

int64_t comet_reference_backward_experts_local(const comet_reference_backward_t *rb) {
    return rb->dims[0].experts_local;
}

comet_status_t comet_reference_backward(const comet_layer_config_t *cfg, int world_size,
                                        const comet_backward_args_t *args) {
    comet_reference_backward_t *rb;
    comet_reference_backward_scratch_t *sc;
    COMET_TRY(comet_reference_backward_begin(&rb, cfg, world_size, args));
    comet_status_t e = comet_reference_backward_scratch_create(rb, &sc);
    if (e != COMET_SUCCESS) {
        comet_reference_backward_end(rb);
        return e;
    }
    for (int q = 0; q < world_size; q++)
        for (int64_t el_e = 0; el_e < rb->dims[0].experts_local; el_e++) comet_reference_backward_transpose(rb, q, el_e);
    for (int s = 0; s < world_size; s++)
        for (int64_t t = 0; t < rb->tokens[s]; t++) comet_reference_backward_token(rb, sc, s, t);
    for (int q = 0; q < world_size; q++)
        for (int64_t el_e = 0; el_e < rb->dims[0].experts_local; el_e++) comet_reference_backward_expert(rb, sc, q, el_e);
    comet_reference_backward_scratch_free(sc);
    comet_reference_backward_end(rb);
    return COMET_SUCCESS;
}
