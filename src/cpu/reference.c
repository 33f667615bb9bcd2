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
#include <stdlib.h>
#include <string.h>

#include "../core/status.h"
#include "../core/validate.h"
#include "cpu_math.h"

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
        if (st == COMET_SUCCESS) st = comet_check_forward_args(&ds, &inputs[s], &tokens[s]);
        if (st != COMET_SUCCESS) {
            char msg[1024];
            snprintf(msg, sizeof msg, "rank %d: %s", s, comet_last_error());
            free(tokens);
            return comet_fail_copy(st, msg);
        }
    }

    const int64_t hd = d0.hidden, topk = d0.topk, el = d0.experts_local;
    float *acc_y = malloc(sizeof(float) * (size_t)hd);
    float *partial = malloc(sizeof(float) * (size_t)hd);
    comet_bf16_t *h = malloc(sizeof(comet_bf16_t) * (size_t)d0.ffn_local);
    comet_bf16_t *o = malloc(sizeof(comet_bf16_t) * (size_t)hd);
    if (!acc_y || !partial || !h || !o) {
        free(acc_y), free(partial), free(h), free(o), free(tokens);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "reference: no memory");
    }

    for (int s = 0; s < world_size; s++) {
        const comet_forward_args_t *in = &inputs[s];
        const comet_bf16_t *x = in->x.data;
        const int32_t *idx = in->topk_idx.data;
        const float *wt = in->topk_w.data;
        comet_bf16_t *y = in->y.data;
        for (int64_t t = 0; t < tokens[s]; t++) {
            for (int64_t c = 0; c < hd; c++) acc_y[c] = 0.0f;
            for (int q = 0; q < world_size; q++) {
                comet_dims_t dq;
                comet_dims_from_config(cfg, world_size, q, &dq); /* validated above */
                int contributes = 0;
                for (int64_t c = 0; c < hd; c++) partial[c] = 0.0f;
                for (int64_t j = 0; j < topk; j++) {
                    int64_t e = idx[t * topk + j];
                    if (e / el != dq.ep_rank) continue;
                    contributes = 1;
                    const comet_bf16_t *w1_e = (const comet_bf16_t *)inputs[q].w1.data + (e % el) * dq.w1_rows * hd;
                    const comet_bf16_t *w2_e = (const comet_bf16_t *)inputs[q].w2.data + (e % el) * hd * dq.ffn_local;
                    comet_cpu_gemm0_row(&dq, x + t * hd, w1_e, 0, dq.ffn_local, h);
                    comet_cpu_gemm1_row(&dq, h, w2_e, 0, hd, o);
                    comet_cpu_topk_accumulate(partial, wt[t * topk + j], o, 0, hd);
                }
                if (contributes)
                    for (int64_t c = 0; c < hd; c++) acc_y[c] += partial[c];
            }
            for (int64_t c = 0; c < hd; c++) y[t * hd + c] = comet_f32_to_bf16(acc_y[c]);
        }
    }
    free(acc_y), free(partial), free(h), free(o), free(tokens);
    return COMET_SUCCESS;
}
