/*
 * test_reference.c - the reference against an independent computation: the
 * unsliced model (full W1, W2 of every expert) evaluated in double with the
 * contract's bf16 rounding of h and o, written as directly as the formula
 * reads. Over several (TP, EP) layouts and both activations the reference
 * must agree within a few bf16 ulps, so a reference that is wrong, partial or
 * a no-op cannot pass (and the engine tests, which compare with it bitwise,
 * inherit that). Also: the reference is deterministic run to run, and NaN
 * weights give NaN outputs without undefined behaviour (UBSan).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../src/core/numerics.h"
#include "../harness/workload.h"
#include "check.h"

static double act(int activation, double g, double u) {
    return activation == COMET_ACT_SILU_GATED ? g / (1.0 + exp(-g)) * u : 0.5 * g * (1.0 + erf(g / sqrt(2.0)));
}


static void check_layout(int tp, int ep, comet_activation_t activation, double skew) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 48, cfg.ffn = 32, cfg.num_experts = 8, cfg.topk = 3, cfg.tp = tp, cfg.ep = ep;
    cfg.activation = activation, cfg.max_tokens_per_rank = 9, cfg.tile_m = 4;
    const int w = tp * ep;
    int64_t tokens[4] = {9, 4, 1, 7};
    comet_routing_opts_t ro = {skew, 1, (uint64_t)(tp * 10 + ep)};
    comet_problem_t *p;
    if (comet_problem_create(&p, &cfg, w, tokens, &ro) != COMET_SUCCESS) {
        CHECK(0, "problem: %s", comet_last_error());
        return;
    }
    comet_problem_poison(p);
    comet_status_t st = comet_reference_forward(&p->cfg, w, p->ref_args);
    CHECK(st == COMET_SUCCESS, "reference: %s", comet_last_error());

    const int64_t hd = cfg.hidden, f = cfg.ffn, rows = activation == COMET_ACT_SILU_GATED ? 2 * f : f;
    double *h = malloc(sizeof(double) * (size_t)f);
    double err2 = 0, ref2 = 0, max_ulps = 0;
    for (int s = 0; s < w; s++)
        for (int64_t t = 0; t < p->tokens[s]; t++) {
            const uint16_t *x = p->x[s] + t * hd;
            for (int64_t c = 0; c < hd; c++) {
                double y = 0;
                for (int64_t j = 0; j < cfg.topk; j++) {
                    int64_t e = p->topk_idx[s][t * cfg.topk + j];
                    const uint16_t *w1 = p->w1_full + e * rows * hd, *w2 = p->w2_full + e * hd * f;
                    /* with TP the ffn slices are rounded separately; summed they are the full dot */
                    double o = 0;
                    for (int part = 0; part < tp; part++) {
                        double o_part = 0;
                        for (int64_t n = part * f / tp; n < (part + 1) * f / tp; n++) {
                            double g = 0, u = 0;
                            for (int64_t k = 0; k < hd; k++) {
                                g += (double)comet_bf16_to_f32(x[k]) * comet_bf16_to_f32(w1[n * hd + k]);
                                if (rows == 2 * f) u += (double)comet_bf16_to_f32(x[k]) * comet_bf16_to_f32(w1[(f + n) * hd + k]);
                            }
                            h[n] = comet_bf16_round((float)act(activation, g, u));
                            o_part += h[n] * comet_bf16_to_f32(w2[c * f + n]);
                        }
                        o += comet_bf16_round((float)o_part);
                    }
                    y += p->topk_w[s][t * cfg.topk + j] * o;
                }
                double got = comet_bf16_to_f32(p->y_ref[s][t * hd + c]);
                double ulp = fabs(y) > 1e-30 ? ldexp(1.0, ilogb(y) - 7) : 1e-30;
                double ulps = fabs(got - y) / ulp;
                if (!(ulps <= max_ulps)) max_ulps = isnan(ulps) ? INFINITY : ulps;
                err2 += (got - y) * (got - y);
                ref2 += y * y;
            }
        }
    double rel = sqrt(err2 / ref2);
    printf("test_reference: TP=%d EP=%d %s: relative error %.2e, worst %.2f bf16 ulps\n", tp, ep,
           activation == COMET_ACT_GELU ? "gelu" : "silu-gated", rel, max_ulps);
    CHECK(rel < 3e-3, "TP=%d EP=%d act=%d: relative error %.2e vs the independent model", tp, ep, (int)activation, rel);
    CHECK(max_ulps <= 2, "TP=%d EP=%d act=%d: worst element off by %.1f bf16 ulps", tp, ep, (int)activation, max_ulps);

    /* deterministic: a second run is bitwise equal */
    uint16_t *first = malloc((size_t)(p->tokens[0] * hd) * 2);
    memcpy(first, p->y_ref[0], (size_t)(p->tokens[0] * hd) * 2);
    comet_reference_forward(&p->cfg, w, p->ref_args);
    CHECK(memcmp(first, p->y_ref[0], (size_t)(p->tokens[0] * hd) * 2) == 0, "reference is deterministic");
    free(first), free(h);
    comet_problem_destroy(p);
}

/* A weight that makes expert outputs NaN: the reference (whole and token by
 * token, as the GPU check runs it) propagates it without undefined behaviour
 * (the UBSan build checks), and the engine agrees bit for bit. */
static void check_nan(void) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 16, cfg.ffn = 8, cfg.num_experts = 4, cfg.topk = 2, cfg.tp = 1, cfg.ep = 2;
    cfg.max_tokens_per_rank = 6, cfg.tile_m = 4;
    int64_t tokens[2] = {6, 5};
    comet_routing_opts_t ro = {0, 0, 4};
    comet_problem_t *p;
    if (comet_problem_create(&p, &cfg, 2, tokens, &ro) != COMET_SUCCESS) {
        CHECK(0, "problem: %s", comet_last_error());
        return;
    }
    for (int64_t i = 0; i < cfg.num_experts * cfg.hidden * cfg.ffn; i += 5) p->w2_full[i] = 0x7fc0; /* NaN */
    comet_problem_slice_weights(p);
    comet_problem_poison(p);
    comet_status_t st = comet_reference_forward(&p->cfg, 2, p->ref_args);
    int64_t nans = 0;
    for (int s = 0; s < 2; s++)
        for (int64_t i = 0; i < tokens[s] * cfg.hidden; i++) nans += isnan(comet_bf16_to_f32(p->y_ref[s][i]));
    CHECK(st == COMET_SUCCESS && nans > 0, "NaN weights: %s, %lld NaN outputs", comet_status_string(st), (long long)nans);
    comet_world_t *w;
    comet_world_create_local(&w, 2, COMET_BACKEND_CPU);
    comet_run_t run;
    memset(&run, 0, sizeof run);
    st = comet_problem_run(p, w, &run, 0);
    comet_world_destroy(w);
    CHECK(st == COMET_SUCCESS && comet_problem_count_mismatch(p) == 0, "NaN weights: the engine %s, %lld differ",
          comet_status_string(st), (long long)comet_problem_count_mismatch(p));
    comet_check_t chk;
    st = comet_problem_check(p, 0, -1, &chk);
    CHECK(st == COMET_SUCCESS && chk.wrong > 0, "NaN outputs fail the tolerance check: %s, %lld wrong", comet_status_string(st),
          (long long)chk.wrong);
    comet_problem_destroy(p);
}

int main(void) {
    check_nan();
    const int layouts[][2] = {{1, 1}, {1, 2}, {2, 1}, {2, 2}, {4, 1}, {1, 4}};
    for (int i = 0; i < 6; i++) {
        check_layout(layouts[i][0], layouts[i][1], COMET_ACT_SILU_GATED, i % 2 ? 0.2 : 0.0);
        check_layout(layouts[i][0], layouts[i][1], COMET_ACT_GELU, 0.05);
    }
    return check_summary("test_reference");
}
