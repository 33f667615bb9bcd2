/*
 * gradslack.c - the error model of dW1's tolerance (harness/gradslack.h).
 *
 * For each row r of rank q (a token of some rank routed to one of q's
 * experts) and each column f of its ffn slice, in float64 from the bf16
 * inputs: g, u = x . W1 (H terms), G = dy . W2^T (H terms) and the 2-norm
 * S of each sum's terms. Another fp32 order of an H-term sum moves it by
 * the sum of H roundings of its partial sums: for terms of random sign
 * (the cancelling sums that matter; where terms share a sign the sum is
 * large and the bf16 ulps of the rule cover it) a random walk whose
 * partial sums are ~sqrt(k / H) S, so a standard deviation of about 2^-24
 * S sqrt(H / 6) an order, sqrt(H / 3) for two; the slack takes 4 2^-24
 * sqrt(H) S (about 7 standard deviations; the worst-case bound, 2 H 2^-24
 * times the sum of |terms|, is ~1000x larger on real data and would leave
 * every such row unchecked). Measured
 * on Qwen2-MoE's shape (H 2048): u = -1.800e-6 from terms of 2-norm 0.325,
 * summed in fp32 in sequence -1.848e-6, by the GPU's GEMM ~-1.6e-6; the
 * slack allows 3.5e-6. The bf16 roundings of g and u add one bf16 ulp.
 * Through dA = w G and
 * the activation's backward (gated SiLU: dg = dA u silu'(g), du = dA silu(g),
 * |silu''| <= 0.5, |silu'| <= 1.1; GELU: dg = dA gelu'(g), |gelu''| <= 0.8)
 * that bounds how far dH may move: the product of the perturbed magnitudes
 * less the product of the magnitudes, plus two bf16 ulps of dH (its rounding
 * flipped, the fp32 evaluation of exp). dW1[e, j, c] then sums over e's rows
 * |x_rc| times that bound, plus the wgrad's own sum in another order (2 n_e
 * 2^-24 sum |dH x|).
 */
#include "gradslack.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../src/core/numerics.h"
#include "../src/core/status.h"
#include "../src/core/validate.h"
#include "workload.h"

/* One bf16 ulp at magnitude m (0 at 0). */
static double ulp16(double m) {
    return m > 0 ? ldexp(1.0, ilogb(m) - 7) : 0;
}

static double bf(uint16_t v) {
    return comet_bf16_to_f32(v);
}

/* The bounds of one row's dH (w1_rows) into ddh, its magnitudes into adh. */
static void row_slack(const comet_dims_t *d, const uint16_t *x, const uint16_t *dy, double w, const uint16_t *w1_e,
                      const uint16_t *w2_e, float *ddh, float *adh) {
    const int64_t hd = d->hidden, fl = d->ffn_local;
    const double order = 4.0 * sqrt((double)hd) * ldexp(1.0, -24); /* times sqrt(sum of squared terms) */
    const int gated = d->activation == COMET_ACT_SILU_GATED;
    for (int64_t f = 0; f < fl; f++) {
        double g = 0, sg = 0, u = 0, su = 0, G = 0, sG = 0;
        const uint16_t *wg = w1_e + f * hd, *wu = w1_e + (fl + f) * hd;
        for (int64_t h = 0; h < hd; h++) {
            const double xv = bf(x[h]), dv = bf(dy[h]), w2v = bf(w2_e[h * fl + f]);
            const double tg = xv * bf(wg[h]);
            g += tg, sg += tg * tg;
            if (gated) {
                const double tu = xv * bf(wu[h]);
                u += tu, su += tu * tu;
            }
            G += dv * w2v, sG += dv * w2v * dv * w2v;
        }
        sg = sqrt(sg), su = sqrt(su), sG = sqrt(sG); /* the terms' 2-norms */
        const double dg_in = order * sg + ulp16(fabs(g) + order * sg), dG = order * sG;
        g = comet_bf16_round((float)g);
        const double aG = fabs(w) * fabs(G), aGp = fabs(w) * (fabs(G) + dG); /* |dA| and its bound */
        if (gated) {
            const double du_in = order * su + ulp16(fabs(u) + order * su);
            u = comet_bf16_round((float)u);
            const double s = 1.0 / (1.0 + exp(-g)), d1 = fabs(s * (1.0 + g * (1.0 - s))), sil = fabs(g * s);
            const double adg = aG * fabs(u) * d1, adu = aG * sil;
            const double ddg = aGp * (fabs(u) + du_in) * (d1 + 0.5 * dg_in) - adg;
            const double ddu = aGp * (sil + 1.1 * dg_in) - adu;
            ddh[f] = (float)(ddg + 2.0 * ulp16(adg + ddg)), adh[f] = (float)adg;
            ddh[fl + f] = (float)(ddu + 2.0 * ulp16(adu + ddu)), adh[fl + f] = (float)adu;
        } else {
            const double gp = fabs(0.5 * (1.0 + erf(g * M_SQRT1_2)) + g * exp(-0.5 * g * g) / sqrt(2.0 * M_PI));
            const double a = aG * gp, dd = aGp * (gp + 0.8 * dg_in) - a;
            ddh[f] = (float)(dd + 2.0 * ulp16(a + dd)), adh[f] = (float)a;
        }
    }
}

/* The rows' bounds, rows split over the parts. */
typedef struct {
    const comet_dims_t *d;
    const comet_backward_args_t *args;
    int q;
    int64_t rows;
    int64_t *src; /* (rows, 3): rank, flat (token, slot) index, local expert */
    comet_dw1_slack_t *s;
} slack_rows_t;

static void slack_part(void *v, int part, int parts) {
    const slack_rows_t *j = v;
    const comet_dims_t *d = j->d;
    const int64_t hd = d->hidden, r1 = d->w1_rows, k = d->topk;
    for (int64_t row = j->rows * part / parts; row < j->rows * (part + 1) / parts; row++) {
        const int r = (int)j->src[row * 3];
        const int64_t i = j->src[row * 3 + 1], e = j->src[row * 3 + 2];
        const float *tw = j->args[r].topk_w.data;
        row_slack(d, j->s->x[row], (const uint16_t *)j->args[r].dy.data + i / k * hd, tw[i],
                  (const uint16_t *)j->args[j->q].w1.data + e * r1 * hd,
                  (const uint16_t *)j->args[j->q].w2.data + e * hd * d->ffn_local, j->s->ddh + row * r1,
                  j->s->adh + row * r1);
    }
}

void comet_dw1_slack_free(comet_dw1_slack_t *s) {
    if (!s) return;
    free(s->first), free(s->x), free(s->ddh), free(s->adh);
    memset(s, 0, sizeof *s);
}

comet_status_t comet_dw1_slack_init(comet_dw1_slack_t *s, const comet_layer_config_t *cfg, int world_size,
                                    const comet_backward_args_t *args, int q) {
    memset(s, 0, sizeof *s);
    comet_dims_t d;
    comet_status_t st = comet_dims_from_config(cfg, world_size, q, &d);
    if (st != COMET_SUCCESS) return st;
    const int64_t el = d.experts_local, k = d.topk, hd = d.hidden, r1 = d.w1_rows;
    s->hidden = hd, s->w1_rows = r1, s->experts_local = el;
    s->first = calloc((size_t)el + 1, sizeof *s->first);
    if (!s->first) return comet_fail(COMET_ERR_OUT_OF_MEMORY, "dW1 slack: no memory");
    /* count the rows of each local expert, then place them */
    for (int r = 0; r < world_size; r++) {
        const int32_t *idx = args[r].topk_idx.data;
        for (int64_t i = 0; i < args[r].topk_idx.shape[0] * k; i++)
            if (idx[i] / el == d.ep_rank) s->first[idx[i] % el + 1]++;
    }
    for (int64_t e = 0; e < el; e++) s->first[e + 1] += s->first[e];
    const int64_t rows = s->first[el];
    s->x = malloc(sizeof *s->x * (size_t)rows + 1);
    s->ddh = malloc(sizeof(float) * (size_t)(rows * r1) + 1);
    s->adh = malloc(sizeof(float) * (size_t)(rows * r1) + 1);
    int64_t *at = calloc((size_t)el + 1, sizeof *at);
    if (!s->x || !s->ddh || !s->adh || !at) {
        free(at);
        comet_dw1_slack_free(s);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "dW1 slack: no memory for %lld rows", (long long)rows);
    }
    memcpy(at, s->first, sizeof *at * (size_t)el);
    slack_rows_t job = {&d, args, q, rows, malloc(sizeof(int64_t) * (size_t)rows * 3 + 1), s};
    if (!job.src) {
        free(at);
        comet_dw1_slack_free(s);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "dW1 slack: no memory for %lld rows", (long long)rows);
    }
    for (int r = 0; r < world_size; r++) { /* each row's (rank, flat slot), placed by expert */
        const int32_t *idx = args[r].topk_idx.data;
        for (int64_t i = 0; i < args[r].topk_idx.shape[0] * k; i++) {
            if (idx[i] / el != d.ep_rank) continue;
            const int64_t row = at[idx[i] % el]++;
            job.src[row * 3] = r, job.src[row * 3 + 1] = i, job.src[row * 3 + 2] = idx[i] % el;
            s->x[row] = (const uint16_t *)args[r].x.data + i / k * hd;
        }
    }
    free(at);
    comet_parts_run(slack_part, &job, rows * r1 * hd);
    free(job.src);
    return COMET_SUCCESS;
}

double comet_dw1_slack(const comet_dw1_slack_t *s, int64_t e, int64_t j, int64_t c) {
    double sum = 0, mag = 0;
    const int64_t n = s->first[e + 1] - s->first[e];
    for (int64_t r = s->first[e]; r < s->first[e + 1]; r++) {
        const double xv = fabs(bf(s->x[r][c]));
        sum += xv * s->ddh[r * s->w1_rows + j], mag += xv * s->adh[r * s->w1_rows + j];
    }
    return sum + 2.0 * (double)n * ldexp(1.0, -24) * mag;
}
