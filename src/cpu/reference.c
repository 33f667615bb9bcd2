/*
 * reference.c - the specification of one MoE layer forward as plain loops,
 * for all ranks of a world at once (include/comet.h, "Semantics"). Readable
 * first: every other backend is tested against it. Not fast.
 *
 * For each home rank s and token t: for each contributing rank q in ascending
 * order (every TP rank of every EP group that holds one of t's experts), the
 * partial p_q = sum over t's slots j on q, ascending, of w_j * o_j, where o_j
 * is the bf16 output of q's ffn slice of expert topk_idx[t, j]; then
 * y[t] = bf16(sum_q p_q).
 */
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/status.h"
#include "../core/validate.h"
#include "cpu_math.h"
#include "reference.h"

comet_status_t comet_reference_scratch_init(const comet_dims_t *d, comet_reference_scratch_t *s) {
    s->acc_y = malloc(sizeof(float) * (size_t)d->hidden);
    s->partial = malloc(sizeof(float) * (size_t)d->hidden);
    s->h = malloc(sizeof(comet_bf16_t) * (size_t)d->ffn_local);
    s->o = malloc(sizeof(comet_bf16_t) * (size_t)d->hidden);
    s->o_ulps = malloc(sizeof(float) * (size_t)d->hidden);
    if (s->acc_y && s->partial && s->h && s->o && s->o_ulps) return COMET_SUCCESS;
    comet_reference_scratch_free(s);
    return comet_fail(COMET_ERR_OUT_OF_MEMORY, "reference: no memory");
}

void comet_reference_scratch_free(comet_reference_scratch_t *s) {
    free(s->acc_y), free(s->partial), free(s->h), free(s->o), free(s->o_ulps);
    s->acc_y = s->partial = s->o_ulps = NULL;
    s->h = s->o = NULL;
}

void comet_reference_token(const comet_layer_config_t *cfg, int world_size, const comet_forward_args_t *inputs,
                           int s, int64_t t, comet_reference_scratch_t *sc, comet_bf16_t *y) {
    comet_dims_t d0;
    comet_dims_from_config(cfg, world_size, 0, &d0);
    const int64_t hd = d0.hidden, topk = d0.topk, el = d0.experts_local;
    const comet_bf16_t *x = (const comet_bf16_t *)inputs[s].x.data + t * hd;
    const int32_t *idx = (const int32_t *)inputs[s].topk_idx.data + t * topk;
    const float *wt = (const float *)inputs[s].topk_w.data + t * topk;
    for (int64_t c = 0; c < hd; c++) sc->acc_y[c] = 0.0f, sc->o_ulps[c] = 0.0f;
    for (int q = 0; q < world_size; q++) {
        comet_dims_t dq;
        comet_dims_from_config(cfg, world_size, q, &dq);
        int contributes = 0;
        for (int64_t c = 0; c < hd; c++) sc->partial[c] = 0.0f;
        for (int64_t j = 0; j < topk; j++) {
            int64_t e = idx[j];
            if (e / el != dq.ep_rank) continue;
            contributes = 1;
            const comet_bf16_t *w1_e = (const comet_bf16_t *)inputs[q].w1.data + (e % el) * dq.w1_rows * hd;
            const comet_bf16_t *w2_e = (const comet_bf16_t *)inputs[q].w2.data + (e % el) * hd * dq.ffn_local;
            comet_cpu_gemm0_row(&dq, x, w1_e, 0, dq.ffn_local, sc->h);
            comet_cpu_gemm1_row(&dq, sc->h, w2_e, 0, hd, sc->o);
            comet_cpu_topk_accumulate(sc->partial, wt[j], sc->o, 0, hd);
            for (int64_t c = 0; c < hd; c++) {
                const float v = comet_bf16_to_f32(sc->o[c]);
                /* NaN: no ulp (ilogbf gives INT_MIN), y is NaN anyway */
                sc->o_ulps[c] += v != 0.0f && !isnan(v) ? fabsf(wt[j]) * ldexpf(1.0f, ilogbf(v) - 7) : 0.0f;
            }
        }
        if (contributes)
            for (int64_t c = 0; c < hd; c++) sc->acc_y[c] += sc->partial[c];
    }
    for (int64_t c = 0; c < hd; c++) y[c] = comet_f32_to_bf16(sc->acc_y[c]);
}

comet_status_t comet_reference_forward(const comet_layer_config_t *cfg, int world_size,
                                       const comet_forward_args_t *inputs) {
    comet_clear_error();
    if (!inputs) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "inputs is NULL");
    if (world_size < 1) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "world_size %d < 1", world_size);
    comet_dims_t d0;
    COMET_TRY(comet_dims_from_config(cfg, world_size, 0, &d0));

    /* Validate every rank before writing anything. */
    int64_t *tokens = malloc(sizeof(int64_t) * (size_t)world_size);
    if (!tokens) return comet_fail(COMET_ERR_OUT_OF_MEMORY, "reference: no memory");
    for (int s = 0; s < world_size; s++) {
        comet_dims_t ds;
        comet_status_t st = comet_dims_from_config(cfg, world_size, s, &ds);
        if (st == COMET_SUCCESS) st = comet_check_forward_args(&ds, &inputs[s], 1, &tokens[s]);
        if (st != COMET_SUCCESS) {
            char msg[1024];
            snprintf(msg, sizeof msg, "rank %d: %s", s, comet_last_error());
            free(tokens);
            return comet_fail_copy(st, msg);
        }
    }

    comet_reference_scratch_t scratch;
    comet_status_t st = comet_reference_scratch_init(&d0, &scratch);
    if (st != COMET_SUCCESS) {
        free(tokens);
        return st;
    }
    for (int s = 0; s < world_size; s++)
        for (int64_t t = 0; t < tokens[s]; t++)
            comet_reference_token(cfg, world_size, inputs, s, t, &scratch, (comet_bf16_t *)inputs[s].y.data + t * d0.hidden);
    comet_reference_scratch_free(&scratch);
    free(tokens);
    return COMET_SUCCESS;
}
