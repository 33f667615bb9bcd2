/*
 * engine_backward.c - the CPU engine's backward (include/comet.h,
 * "Backward") on the forward's protocol (engine.c, steps 1-7): dy staged
 * beside x, the plan built again from the routing (the forward's plan), x
 * and dy rows pulled block by block as the forward's layer 0 pulls x. Per
 * block, whole rows (layer 0): gu and a (the saved state, or GEMM0 again on
 * the gathered row), G = dy W2_e, the activation's backward dH and <G, a>.
 * Layer 1, chunk by chunk: dX = dH W1_e, combined home as the forward's
 * partials with weights 1 (points 5, 6); with chunk 0 each row's <G, a>
 * goes home, which sums the TP ranks' parts in ascending tp (point 3). Then
 * each compute worker's weight-gradient tiles, beside the combine: WG_KB
 * output rows of dW1 or dW2 each, the expert's rows summed in the plan's row
 * order (point 7), rounded once or added. Before layer 0 the compute workers
 * transpose the weights (a head: every worker's tiles done first). Every
 * step is cpu_math.h's, as in reference_backward.c, or its register tile in
 * cpu_tiles.h (the same operations per element, in the same order), so the
 * outputs are bitwise the reference's whatever the save mode, n_comm or
 * chunk width.
 */
#include <stdio.h>
#include <string.h>

#include "../core/saved.h"
#include "../core/status.h"
#include "../core/validate.h"
#include "../trace/trace.h"
#include "../tuner/tuner.h"
#include "cpu_math.h"
#include "cpu_tiles.h"
#include "engine.h"

/* The backward's buffers, taken at its first call and kept for later ones
 * (one that could not be taken is tried again at the next call). */
static comet_status_t take_buffers(comet_layer_t *l) {
    cpu_layer_t *L = l->backend_state;
    cpu_backward_t *B = &L->bw;
    const comet_dims_t *d = &l->dims;
    const size_t rows = (size_t)d->max_rows_padded, hd = (size_t)d->hidden, fl = (size_t)d->ffn_local;
    const size_t r1 = (size_t)d->w1_rows, el = (size_t)d->experts_local, bf = sizeof(comet_bf16_t);
    const size_t workers = (size_t)l->world->settings.cpu_workers;
    if (!B->dh) B->dh = cpu_take(L, rows * r1 * bf + 1, 0);
    if (!B->dxr) B->dxr = cpu_take(L, rows * hd * bf + 1, 0);
    if (!B->dtw) B->dtw = cpu_take(L, rows * sizeof(float) + 1, 0);
    if (!B->w1t) B->w1t = cpu_take(L, el * hd * r1 * bf, 0);
    if (!B->w2t) B->w2t = cpu_take(L, el * fl * hd * bf, 0);
    if (!B->gu_tmp) B->gu_tmp = cpu_take(L, workers * 2 * r1 * bf, 0);
    if (!B->sum_tmp) B->sum_tmp = cpu_take(L, workers * WG_KB * (hd > fl ? hd : fl) * sizeof(float), 0);
    if (!B->scale_tmp) B->scale_tmp = cpu_take(L, workers * rows * WG_KB * 4 * sizeof(float) + 64, 1);
    if (B->dh && B->dxr && B->dtw && B->w1t && B->w2t && B->gu_tmp && B->sum_tmp && B->scale_tmp)
        return COMET_SUCCESS;
    return comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: no memory for the backward's buffers", l->rank);
}

/* The saved state's header: written by a training forward of this layer
 * with T tokens on this rank. */
static comet_status_t check_saved_header(const comet_layer_t *l, const comet_tensor_t *saved, int64_t t) {
    COMET_TRY(cpu_check_saved_alignment(saved));
    comet_saved_header_t hdr;
    memcpy(&hdr, saved->data, sizeof hdr);
    if (hdr.magic != COMET_SAVED_MAGIC)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT,
                          "saved: no training forward's state (magic %#llx): run the forward with args.save = "
                          "COMET_SAVE_ACTIVATIONS into it, or pass args.save = COMET_SAVE_RECOMPUTE",
                          (unsigned long long)hdr.magic);
    if (hdr.layer_id != l->id)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "saved: written by another layer (id %llu; this one is %llu)",
                          (unsigned long long)hdr.layer_id, (unsigned long long)l->id);
    if (hdr.tokens != t)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT,
                          "saved: its forward had %lld tokens on rank %d, this backward has %lld",
                          (long long)hdr.tokens, l->rank, (long long)t);
    return COMET_SUCCESS;
}

/* The weights' transposes (comet_cpu_transpose_weights' w1t and w2t), the
 * head of every compute worker: comet_cpu_transpose_tile's tiles, task i of the local experts'
 * w1 tiles then w2 tiles on worker i mod n_compute. */
static void backward_transpose(comet_layer_t *l, int worker) {
    cpu_layer_t *L = l->backend_state;
    const cpu_backward_t *B = &L->bw;
    const comet_dims_t *d = &l->dims;
    const int64_t hd = d->hidden, fl = d->ffn_local, r1 = d->w1_rows, el = d->experts_local;
    const int64_t T = COMET_CPU_TRANSPOSE_TILE, t = (hd + T - 1) / T, t1 = (r1 + T - 1) / T, t2 = (fl + T - 1) / T;
    const int64_t n1 = el * t1 * t, n = n1 + el * t * t2;
    for (int64_t i = worker; i < n; i += L->n_compute) {
        if (i < n1) { /* w1_e (w1_rows, H) -> w1t_e (H, w1_rows) */
            const int64_t e = i / (t1 * t), rt = i / t % t1, ct = i % t;
            comet_cpu_transpose_tile(L->w1 + e * r1 * hd, B->w1t + e * hd * r1, r1, hd, rt * T, ct * T);
        } else { /* w2_e (H, F_local) -> w2t_e (F_local, H) */
            const int64_t j = i - n1, e = j / (t * t2), rt = j / t2 % t, ct = j % t2;
            comet_cpu_transpose_tile(L->w2 + e * hd * fl, B->w2t + e * fl * hd, hd, fl, rt * T, ct * T);
        }
    }
}

/* GEMM0 again (step 1) for columns [0, F_local) of one row x0 or two (x1
 * not NULL), as comet_cpu_gemm0_gu_row: gu and h. tmp: 4 F_local floats. */
static void recompute_rows(const comet_dims_t *d, const comet_bf16_t *x0, const comet_bf16_t *x1,
                           const comet_bf16_t *w1_e, comet_bf16_t *h0, comet_bf16_t *h1, comet_bf16_t *gu0,
                           comet_bf16_t *gu1, float *tmp) {
    const int64_t hd = d->hidden, fl = d->ffn_local;
    float *g0 = tmp, *g1 = tmp + fl, *u0 = tmp + 2 * fl, *u1 = tmp + 3 * fl;
    cpu_dots(x0, x1, w1_e, hd, 0, fl, hd, g0, g1);
    if (d->activation == 0 /* COMET_ACT_SILU_GATED */) cpu_dots(x0, x1, w1_e + fl * hd, hd, 0, fl, hd, u0, u1);
    for (int64_t n = 0; n < fl; n++) {
        comet_cpu_gemm0_col(d, g0[n], d->activation == 0 ? u0[n] : 0.0f, n, h0, gu0);
        if (x1) comet_cpu_gemm0_col(d, g1[n], d->activation == 0 ? u1[n] : 0.0f, n, h1, gu1);
    }
}

/* Layer 0, whole rows (the tile is [0, F_local)), two rows at a time: steps
 * 1, 2 and 4 and the row's <G, a>. */
static void backward_layer0(comet_layer_t *l, int worker, const comet_plan_block_t *blk, int64_t n0, int64_t n1) {
    cpu_layer_t *L = l->backend_state;
    const cpu_backward_t *B = &L->bw;
    const comet_dims_t *d = &l->dims;
    const int64_t hd = d->hidden, fl = d->ffn_local, r1 = d->w1_rows;
    const comet_bf16_t *w1_e = L->w1 + (int64_t)blk->expert * r1 * hd;
    const comet_bf16_t *w2t_e = B->w2t + (int64_t)blk->expert * fl * hd;
    float *tmp = B->sum_tmp + (int64_t)worker * WG_KB * (hd > fl ? hd : fl); /* 4 F_local floats */
    comet_bf16_t *gu_tmp = B->gu_tmp + (int64_t)worker * 2 * r1;
    const int64_t end = blk->row_start + blk->num_rows;
    (void)n0, (void)n1;
    for (int64_t row = blk->row_start; row < end; row += 2) {
        const int two = row + 1 < end;
        const comet_bf16_t *gu = B->gu ? B->gu + row * r1 : gu_tmp;
        if (!B->gu) /* a into h, where B->act points */
            recompute_rows(d, L->a + row * hd, two ? L->a + (row + 1) * hd : NULL, w1_e, L->h + row * fl,
                           L->h + (row + 1) * fl, gu_tmp, gu_tmp + r1, tmp);
        cpu_dots(L->o + row * hd, two ? L->o + (row + 1) * hd : NULL, w2t_e, hd, 0, fl, hd, tmp, tmp + fl);
        for (int i = 0; i <= two; i++)
            B->dtw[row + i] = comet_cpu_backward_row_g(d, gu + i * r1, B->act + (row + i) * fl, tmp + i * fl,
                                                       L->plan.rows[row + i].weight, B->dh + (row + i) * r1);
    }
}

/* Layer 1: dX's columns [c0, c1) (step 5), two rows at a time. */
static void backward_layer1(comet_layer_t *l, int worker, const comet_plan_block_t *blk, int64_t c0, int64_t c1) {
    cpu_layer_t *L = l->backend_state;
    const cpu_backward_t *B = &L->bw;
    const comet_dims_t *d = &l->dims;
    const int64_t hd = d->hidden, fl = d->ffn_local, r1 = d->w1_rows;
    const comet_bf16_t *w1t_e = B->w1t + (int64_t)blk->expert * hd * r1;
    float *tmp = B->sum_tmp + (int64_t)worker * WG_KB * (hd > fl ? hd : fl); /* 2 (c1 - c0) floats */
    const int64_t end = blk->row_start + blk->num_rows, m = c1 - c0;
    for (int64_t row = blk->row_start; row < end; row += 2) {
        const int two = row + 1 < end;
        cpu_dots(B->dh + row * r1, two ? B->dh + (row + 1) * r1 : NULL, w1t_e, r1, c0, c1, r1, tmp, tmp + m);
        for (int i = 0; i <= two; i++)
            for (int64_t c = c0; c < c1; c++) B->dxr[(row + i) * hd + c] = comet_f32_to_bf16(tmp[i * m + c - c0]);
    }
}

/* The weight gradients (step 7), after layer 1's tiles, in tasks of WG_KB
 * output rows: task i of a local expert's ceil(w1_rows / WG_KB) + ceil(H /
 * WG_KB) is rows [WG_KB i, WG_KB (i + 1)) of its dW1, then those of its dW2
 * (the rest of the task index), each element summed over the expert's rows
 * in plan order from 0 (comet_cpu_wgrad_add's arithmetic, one element at a
 * time: s * v rounded, then added), then stored. The tile below keeps WG_KB x
 * 8 sums in registers while it streams the expert's rows once per 8 columns
 * (the row-by-row form read every row once per output row and kept its sums
 * in memory). */
typedef cpu_v4f v4f;

/* sums[j * n + i] = sum over r in [0, rows) of s[r][j] * v[r * stride + i],
 * for j < WG_KB, i < n; s[r][j] the row's scale for output row j broadcast
 * (rows x WG_KB vectors). */
static void wgrad_tile(float *sums, const v4f *s, const comet_bf16_t *v, int64_t stride, int64_t rows, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v4f a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
        const comet_bf16_t *vr = v + i;
        const v4f *sr = s;
        for (int64_t r = 0; r < rows; r++, vr += stride, sr += WG_KB) {
            v4f x0, x1;
            cpu_bf16x8(vr, &x0, &x1);
            a00 += sr[0] * x0, a01 += sr[0] * x1;
            a10 += sr[1] * x0, a11 += sr[1] * x1;
            a20 += sr[2] * x0, a21 += sr[2] * x1;
            a30 += sr[3] * x0, a31 += sr[3] * x1;
        }
        memcpy(sums + 0 * n + i, &a00, 16), memcpy(sums + 0 * n + i + 4, &a01, 16);
        memcpy(sums + 1 * n + i, &a10, 16), memcpy(sums + 1 * n + i + 4, &a11, 16);
        memcpy(sums + 2 * n + i, &a20, 16), memcpy(sums + 2 * n + i + 4, &a21, 16);
        memcpy(sums + 3 * n + i, &a30, 16), memcpy(sums + 3 * n + i + 4, &a31, 16);
    }
    for (; i < n; i++)
        for (int j = 0; j < WG_KB; j++) {
            float acc = 0.0f;
            for (int64_t r = 0; r < rows; r++) acc += s[r * WG_KB + j][0] * comet_bf16_to_f32(v[r * stride + i]);
            sums[j * n + i] = acc;
        }
}

static void backward_wgrad(comet_layer_t *l, int worker) {
    cpu_layer_t *L = l->backend_state;
    const cpu_backward_t *B = &L->bw;
    const comet_backward_args_t *a = B->args;
    const comet_dims_t *d = &l->dims;
    const comet_plan_t *p = &L->plan;
    const int64_t hd = d->hidden, fl = d->ffn_local, r1 = d->w1_rows;
    const int64_t t1 = (r1 + WG_KB - 1) / WG_KB, per = t1 + (hd + WG_KB - 1) / WG_KB;
    float *sums = B->sum_tmp + (int64_t)worker * WG_KB * (hd > fl ? hd : fl);
    v4f *s = (v4f *)B->scale_tmp + (int64_t)worker * d->max_rows_padded * WG_KB;
    for (int64_t i = worker; i < d->experts_local * per; i += L->n_compute) {
        const int64_t e = i / per, k = i % per;
        const int64_t r0 = p->expert_start[e], rows = p->expert_count[e];
        const uint64_t t0 = L->rec ? comet_trace_now_ns() : 0;
        if (k < t1) { /* dW1_e[k0 + j, :] = sum dH_r[k0 + j] x_r */
            const int64_t k0 = k * WG_KB, kn = r1 - k0 < WG_KB ? r1 - k0 : WG_KB;
            for (int64_t r = 0; r < rows; r++)
                for (int j = 0; j < WG_KB; j++) {
                    const float v = j < kn ? comet_bf16_to_f32(B->dh[(r0 + r) * r1 + k0 + j]) : 0.0f;
                    s[r * WG_KB + j] = (v4f){v, v, v, v};
                }
            wgrad_tile(sums, s, L->a + r0 * hd, hd, rows, hd);
            for (int64_t j = 0; j < kn; j++)
                comet_cpu_store_grad(&a->dw1, (e * r1 + k0 + j) * hd, sums + j * hd, hd, a->accumulate);
        } else { /* dW2_e[c0 + j, :] = sum bf16(w_r dy_r[c0 + j]) a_r */
            const int64_t c0 = (k - t1) * WG_KB, cn = hd - c0 < WG_KB ? hd - c0 : WG_KB;
            for (int64_t r = 0; r < rows; r++)
                for (int j = 0; j < WG_KB; j++) {
                    const float v = j < cn ? comet_cpu_wgrad_scale(p->rows[r0 + r].weight, L->o[(r0 + r) * hd + c0 + j])
                                           : 0.0f;
                    s[r * WG_KB + j] = (v4f){v, v, v, v};
                }
            wgrad_tile(sums, s, B->act + r0 * fl, fl, rows, fl);
            for (int64_t j = 0; j < cn; j++)
                comet_cpu_store_grad(&a->dw2, (e * hd + c0 + j) * fl, sums + j * fl, fl, a->accumulate);
        }
        if (t0) cpu_trace_step(l, COMET_TRACE_GEMM, worker, COMET_TRACE_WGRAD, k, e, t0);
    }
}

comet_status_t cpu_layer_backward(comet_layer_t *l, const comet_backward_args_t *args) {
    cpu_layer_t *L = l->backend_state;
    cpu_backward_t *B = &L->bw;
    const comet_dims_t *d = &l->dims;
    int64_t t = 0;
    comet_status_t own = comet_check_backward_args(d, args, 1, &t);
    if (own == COMET_SUCCESS) own = cpu_check_n_comm(args->n_comm);
    const int save = own == COMET_SUCCESS && args->save == COMET_SAVE_ACTIVATIONS;
    if (save) own = check_saved_header(l, &args->saved, t);
    if (own == COMET_SUCCESS) own = take_buffers(l);
    comet_protocol_t proto = COMET_PROTOCOL_INIT;
    if (own == COMET_SUCCESS) /* COMET_SEQUENTIAL: this engine always overlaps; the chunk width the tuner's */
        comet_tuner_choose(l->world->tune, d, COMET_BACKEND_CPU, t, args->n_comm > 0 ? args->n_comm : 0, 0, &proto);
    L->rec = L->trace, L->backward = 1;
    COMET_TRY(cpu_enter(l, own, t, &proto, args->x.data, args->topk_idx.data, args->topk_w.data, args->dy.data));

    const char *saved = args->saved.data;
    B->args = args;
    B->gu = save ? (const comet_bf16_t *)(saved + comet_saved_gu_offset(d)) : NULL;
    B->act = save ? (const comet_bf16_t *)(saved + comet_saved_h_offset(d)) : L->h;
    L->w1 = args->w1.data;
    L->w2 = args->w2.data;
    L->out = args->dx.data;
    L->disable = args->disable;
    L->l0_tile = d->ffn_local;
    L->head = backward_transpose, L->layer0 = backward_layer0, L->layer1 = backward_layer1;
    L->tail = backward_wgrad;
    L->fwd_h = L->fwd_gu = NULL;
    L->pull_dy = L->o;
    L->combined = B->dxr, L->unit_weights = 1;
    L->row_dtw = B->dtw, L->d_topk_w = args->d_topk_w.data;
    return cpu_run(l);
}
