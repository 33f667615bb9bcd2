/*
 * test_backward.c - comet_reference_backward (include/comet.h, "Backward
 * (training)") against an independent float64 model of the layer.
 *
 * The model. The unsliced layer (every expert's full W1, W2, the problem's
 * w1_full/w2_full) in double, from the same bf16/fp32 inputs:
 *   y_t = sum_j w_j act(x_t W1_e^T) W2_e^T, no intermediate rounding,
 * with its analytic gradients for dy: G = dy W2_e, d_topk_w = <G, h>,
 * dA = w G, dH = [dA u silu'(g) | dA silu(g)] (gated) or dA gelu'(g),
 * dX = dH W1_e, dx = sum_j dX, dW1_e = sum dH^T x, dW2_e = sum (w dy)^T h.
 * dW1/dW2 of rank (ep, tp) are its experts' slices of the full ones: w1 rows
 * [tp F_l, (tp+1) F_l) of the gate then the same rows of up (gated), w2
 * columns [tp F_l, (tp+1) F_l) (harness/workload.c slices the forward's
 * weights the same way).
 *
 * 1. Finite differences. The analytic gradients are checked against
 *    central differences of the float64 loss L = sum dy . y (Richardson-
 *    extrapolated from steps 1e-3 and 5e-4, relative to max(1, |coordinate|))
 *    at 6 random coordinates each of x, topk_w, w1 (gate and up rows) and w2,
 *    on 4 small layouts (both activations, W1 scaled x3 so g reaches the
 *    activations' curved parts): |fd - analytic| <= 1e-9 (|analytic| + the
 *    tensor's largest |gradient|) (seen: <= 2e-12). The activations' first
 *    and second partials, which the bounds use, likewise at g in [-4, 3]
 *    (around silu's minimum too): <= 1e-9 relative (seen: 6e-11).
 *
 * 2. Bound A: the reference against the exact gradients. With u = 2^-8 (bf16
 *    unit roundoff), g_n = (n + 2) 2^-24 1.01 (any fp32 sum of n terms),
 *    e_act = 32 2^-24 (an fp32 activation or its derivative evaluated in
 *    float), every quantity's worst-case error against the exact value is
 *    propagated to first order through the contract's rounding points:
 *      a   (the forward's h, bf16):  e_a = u|h| + g_H (|h_g| S_g + |h_u| S_u) + e_act (|h| + |g| gelu)
 *      G   (fp32):                   e_G = g_H S_G          (S_. = sum of |terms| of that dot)
 *      gu  (bf16):                   d_g = u|g| + g_H S_g,  d_u likewise
 *      dA  = w G (fp32):             e_dA = |w| e_G + 2^-24 |dA|
 *      dH  (bf16), dg = dA h_g(g,u), du = dA h_u(g):
 *          e_dg = u|dg| + |h_g| e_dA + |dA| (|h_gg| d_g + |h_gu| d_u) + e_act |dA| |u| s (1 + |g| (1-s))
 *          e_du = u|du| + |h_u| e_dA + |dA| |h_gu| d_g + e_act |dA| |g| s
 *          (GELU: e_dg = u|dg| + |h_g| e_dA + |dA| |h_gg| d_g + e_act |dA| (Phi + |g| phi + 1))
 *      dX_r per TP slice (bf16): e_X = u|dX| + sum_n e_dH_n |W1_nk| + g_{w1_rows} sum_n |dH_n W1_nk|
 *    and for the outputs (B = bound, checked as |ref - exact| <= 1.05 B, the
 *    5% covering the second-order terms, ~u^2):
 *      dx[t,k] (bf16):      B = B0 + u (|dx| + B0), B0 = sum_{slots, slices} e_X + g_{topk TP} sum |dX|
 *      d_topk_w (fp32):     B = sum_n (|G_n| e_a + |h_n| e_G) + g_{F+TP} sum_n |G_n h_n|
 *      dW1[e,n,k]:          B0 = sum_rows e_dH_n |x_k| + g_R sum_rows |dH_n x_k|   (R rows of e)
 *      dW2[e,c,n]:          B0 = sum_rows (|w dy_c| e_a + (u + 2^-24) |w dy_c h_n|) + g_R sum |w dy_c h_n|
 *      written bf16: B = B0 + u (|v| + B0); fp32: 2^-24 instead of u;
 *      accumulated: |ref - (old + v)| <= 1.05 (B0 + 2^-24 (|old + v| + B0)).
 *    An expert no row chose has B = 0: its dW must be exactly 0 (or exactly
 *    the old value when accumulating).
 *
 * 3. Bound B (tighter, the rounding points themselves): the same model run
 *    in interval arithmetic. Each fp32 sum is the exact double sum +- g_n
 *    (sum of |terms|), each bf16 store maps [lo, hi] to [bf16(lo), bf16(hi)]
 *    (rounding is monotone), the sums in a fixed order (dx over slots then
 *    ranks, d_topk_w over TP ranks) are replayed in that order with every
 *    endpoint rounded to fp32, an activation (derivative) is its value at the
 *    box's centre +- 1.5 x (its largest partial at the box's corners) x
 *    radius + e_act (as above). Most intervals collapse to a single bf16
 *    value, so this is close to bitwise: it catches a missing or extra
 *    rounding (dH or dX_r kept in fp32, a bf16 accumulator, w dy not rounded
 *    before dW2) that bound A, a worst case, lets through. The reference's
 *    value must lie in the interval.
 *
 * That the check can fail. (a) Every element is perturbed in simulation by
 * 1, 4, 16 and 64 bf16 ulps of its scale (dx: the rms of the token's row;
 * dW1: of [e, n, :]; dW2: of [e, c, :] of the unsliced expert; d_topk_w: of
 * the whole d_topk_w, its few slots being dot products that may cancel), and
 * the fraction each bound surely catches (perturbation > |err| + bound, or
 * > the interval's width) is printed; required: bound A catches 16 ulps for
 * >= 95% of the elements, bound B 1 ulp for >= 90% (rows that must be exactly
 * zero, where anything is caught, left out). Seen over the 41 cases: bound A
 * 4 ulps for 10% (dx) 94% (d_topk_w) 89% (dw1) 88% (dw2), 16 ulps for >=
 * 98.5%; bound B 1 ulp for >= 96%. Worst |err| / bound A seen: dx 0.43,
 * d_topk_w 0.55, dw1 0.84, dw2 0.89. (b) In three cases (TP=2 EP=2, dw
 * bf16, fp32, accumulated) one element of each output is perturbed for real,
 * by 2 bf16 ulps of itself (bound B must report it) and by 32 ulps of its
 * scale (bound A must). (c) By hand, while writing this test, the reference
 * was mutated (not committed) and the test failed for each of: du/dg from
 * the fp32 u or g instead of gu's bf16 values, the tanh GELU derivative, dg
 * off by 1/128, w dy not rounded to bf16 before dW2, d_topk_w from the fp32
 * h instead of a, d_topk_w stored bf16, dx truncated instead of rounded,
 * only one TP slice in d_topk_w, gate and up rows swapped in dW1, dW2
 * without w, dW not written for experts no token chose, accumulate ignoring
 * or doubling, fp32 dW rounded to bf16 (most caught by bound B only). Not
 * observable at these sizes: the order of dx's sum over ranks (reversed, no
 * bf16 rounding of dx flipped) and of d_topk_w's over TP ranks (inside the
 * fp32 slack).
 *
 * Cases: W = 1, 2, 4 with every TP x EP split, both activations, dw1/dw2
 * bf16 written, fp32 written and fp32 accumulated (old values random),
 * topk 1..4 and topk = E, E up to 16, T different per rank with 0 and 1
 * (and a world with no tokens at all), skewed routing with experts no token
 * chose (41 cases). The reference is deterministic (a second call, outputs
 * poisoned again, bitwise equal). dw1 and dw2 of different dtypes in one
 * call; bf16 dw = bf16(fp32 dw) bitwise and accumulating into zeros = fp32
 * dw (the reference's sum order does not depend on the dtype). Invalid
 * input (struct_size, dtype and shape of every tensor, NULL data,
 * accumulate with a bf16 dw, accumulate not 0/1, routing, world size,
 * config, NULL args): the documented status with a message, and no output
 * of any rank written (poisoned before, still poisoned after); the invalid
 * tensor sits on the last rank (so a reference that wrote the first ranks
 * before checking the last is caught) or on the first. About 0.2 s of CPU
 * (1.2 s under ThreadSanitizer, 0.5 s under ASan + UBSan).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../src/core/numerics.h"
#include "../harness/workload.h"
#include "check.h"

/* Soak runs: cc -DTEST_SEED=n draws other inputs. */
#ifndef TEST_SEED
#define TEST_SEED 0
#endif

static const double U_BF = 1.0 / 256.0;     /* bf16 unit roundoff */
static const double U32 = 1.0 / 16777216.0; /* fp32 unit roundoff */
#define E_ACT (32.0 * U32)

static double gam(int64_t n) { return (double)(n + 2) * U32 * 1.01; }

/* Round to the nearest bf16 (ties to even), in double: monotone, and on an
 * fp32 value the same as comet_f32_to_bf16. */
static double rb(double v) {
    if (v == 0 || !isfinite(v)) return v;
    const double q = ldexp(1.0, ilogb(v) - 7);
    return nearbyint(v / q) * q;
}
static double rf(double v) { return (double)(float)v; }
static double bf(uint16_t h) { return comet_bf16_to_f32(h); }
static double ulp_bf(double v) { return v != 0 && isfinite(v) ? ldexp(1.0, ilogb(v) - 7) : 0; }

/* ---- intervals ------------------------------------------------------------ */
typedef struct {
    double lo, hi;
} iv_t;

/* c +- r, widened by the double rounding of c (far below any fp32 ulp) */
static iv_t iv(double c, double r) {
    r += 1e-13 * fabs(c);
    return (iv_t){c - r, c + r};
}
static iv_t iv_rb(iv_t a) { return (iv_t){rb(a.lo), rb(a.hi)}; }
static iv_t iv_add_f32(iv_t a, iv_t b) { return (iv_t){rf(a.lo + b.lo), rf(a.hi + b.hi)}; }
static double iv_mag(iv_t a) { return fmax(fabs(a.lo), fabs(a.hi)); }
static iv_t iv_mul(iv_t a, iv_t b) {
    const double p[4] = {a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi};
    iv_t r = {p[0], p[0]};
    for (int i = 1; i < 4; i++)
        r.lo = fmin(r.lo, p[i]), r.hi = fmax(r.hi, p[i]);
    return r;
}
static iv_t iv_scale(iv_t a, double k) { return k >= 0 ? (iv_t){a.lo * k, a.hi * k} : (iv_t){a.hi * k, a.lo * k}; }

/* ---- the activation and its derivatives ------------------------------------ */
typedef struct {
    double h, hg, hu, hgg, hgu; /* h(g, u) and its partials (GELU: no u) */
    double s, Phi, phi;         /* sigmoid(g); GELU: Phi(g), phi(g) */
} act_t;

static act_t act_eval(int gated, double g, double u) {
    act_t a;
    memset(&a, 0, sizeof a);
    if (gated) {
        const double s = 1.0 / (1.0 + exp(-g));
        const double d1 = s * (1.0 + g * (1.0 - s));                   /* silu' */
        const double d2 = s * (1.0 - s) * (2.0 + g * (1.0 - 2.0 * s)); /* silu'' */
        a.s = s, a.h = g * s * u, a.hg = u * d1, a.hu = g * s, a.hgg = u * d2, a.hgu = d1;
    } else {
        const double Phi = 0.5 * (1.0 + erf(g / sqrt(2.0))), phi = exp(-0.5 * g * g) / sqrt(2.0 * M_PI);
        a.Phi = Phi, a.phi = phi, a.h = g * Phi, a.hg = Phi + g * phi, a.hgg = phi * (2.0 - g * g);
    }
    return a;
}

/* which 0: h(g, u); 1: dg = dA h_g(g, u); 2: du = dA h_u(g). Value and partials in (dA, g, u). */
static double fn_eval(int gated, int which, double dA, double g, double u, double df[3]) {
    const act_t a = act_eval(gated, g, u);
    if (which == 0) {
        df[0] = 0, df[1] = a.hg, df[2] = a.hu;
        return a.h;
    }
    if (which == 1) {
        df[0] = a.hg, df[1] = dA * a.hgg, df[2] = dA * a.hgu;
        return dA * a.hg;
    }
    df[0] = a.hu, df[1] = dA * a.hgu, df[2] = 0;
    return dA * a.hu;
}

/* An enclosure of fn over the box v[0..2] (dA, g, u): the centre's value +-
 * 1.5 x (the largest |partial| over the corners and the centre) x radius. */
static iv_t fn_range(int gated, int which, const iv_t v[3]) {
    double c[3], r[3], df[3], m[3];
    int wide = 0;
    for (int i = 0; i < 3; i++)
        c[i] = 0.5 * (v[i].lo + v[i].hi), r[i] = 0.5 * (v[i].hi - v[i].lo), wide |= r[i] > 0;
    const double f = fn_eval(gated, which, c[0], c[1], c[2], df);
    if (!wide) return (iv_t){f, f};
    for (int i = 0; i < 3; i++)
        m[i] = fabs(df[i]);
    for (int k = 0; k < 8; k++) {
        fn_eval(gated, which, k & 1 ? v[0].hi : v[0].lo, k & 2 ? v[1].hi : v[1].lo, k & 4 ? v[2].hi : v[2].lo, df);
        for (int i = 0; i < 3; i++)
            m[i] = fmax(m[i], fabs(df[i]));
    }
    return iv(f, 1.5 * (m[0] * r[0] + m[1] * r[1] + m[2] * r[2]));
}

/* ---- the model --------------------------------------------------------------- */
typedef struct {
    int W, tp, ep, gated;
    int64_t H, F, FL, E, EL, K, RF; /* RF: rows of the full W1 (2F gated, F GELU) */
    const int64_t *T;
    double **x, **dy, **tw; /* [W] (T, H), (T, H), (T, K) */
    const int32_t *const *idx;
    double *W1, *W2; /* (E, RF, H), (E, H, F) */
} model_t;

typedef struct {
    /* exact gradients */
    double **dx, **dtw, *dW1, *dW2;
    /* bound A: dx, dtw complete; dW1, dW2 before the g_R and output terms */
    double **bx, **btw, *bW1, *bW2;
    /* bound B: dx (bf16 values) and dtw (fp32) complete; dW sums of products before g_R */
    double **lx, **hx, **ltw, **htw, *lW1, *hW1, *lW2, *hW2;
    double *aW1, *aW2; /* sum of |products| of each dW element */
    int64_t *rows;     /* rows per expert */
} grads_t;

static double *zalloc(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(double)); }

static void grads_init(grads_t *g, const model_t *m) {
    double ***per_rank[] = {&g->dx, &g->dtw, &g->bx, &g->btw, &g->lx, &g->ltw, &g->hx, &g->htw};
    for (int i = 0; i < 8; i++) {
        *per_rank[i] = calloc((size_t)m->W, sizeof(double *));
        for (int s = 0; s < m->W; s++)
            *(*per_rank[i] + s) = zalloc(m->T[s] * (i % 2 ? m->K : m->H));
    }
    const int64_t n1 = m->E * m->RF * m->H, n2 = m->E * m->H * m->F;
    g->dW1 = zalloc(n1), g->bW1 = zalloc(n1), g->lW1 = zalloc(n1), g->hW1 = zalloc(n1), g->aW1 = zalloc(n1);
    g->dW2 = zalloc(n2), g->bW2 = zalloc(n2), g->lW2 = zalloc(n2), g->hW2 = zalloc(n2), g->aW2 = zalloc(n2);
    g->rows = calloc((size_t)m->E, sizeof(int64_t));
}

static void grads_free(grads_t *g, const model_t *m) {
    double **per_rank[] = {g->dx, g->dtw, g->bx, g->btw, g->lx, g->ltw, g->hx, g->htw};
    for (int i = 0; i < 8; i++) {
        for (int s = 0; s < m->W; s++)
            free(per_rank[i][s]);
        free(per_rank[i]);
    }
    free(g->dW1), free(g->bW1), free(g->lW1), free(g->hW1), free(g->aW1);
    free(g->dW2), free(g->bW2), free(g->lW2), free(g->hW2), free(g->aW2), free(g->rows);
}

/* Per-row scratch. */
typedef struct {
    double *h, *ea, *G, *eG, *dH, *edH; /* (F) (F) (F) (F) (RF) (RF) */
    iv_t *a, *Gi, *dHi;                 /* (F) (F) (RF) */
    double *dX, *eX, *aX;               /* (K, TP, H): exact, bound A, sum |dX| */
    iv_t *dXi;                          /* (K, TP, H): bf16 enclosure */
} scratch_t;

/* W1 row (full) of ffn index n, part 0 gate, 1 up. */
static int64_t full_row(const model_t *m, int64_t n, int part) { return part ? m->F + n : n; }

/* Slot j of token t of rank s: one row of the model. */
static void model_row(const model_t *m, grads_t *gr, scratch_t *w, int s, int64_t t, int64_t j) {
    const int64_t H = m->H, F = m->F, FL = m->FL, RF = m->RF, TP = m->tp;
    const int64_t e = m->idx[s][t * m->K + j];
    const double wt = m->tw[s][t * m->K + j];
    const double *x = m->x[s] + t * H, *dy = m->dy[s] + t * H;
    const double *W1e = m->W1 + e * RF * H, *W2e = m->W2 + e * H * F;
    const int gated = m->gated;
    gr->rows[e]++;
    double dtw = 0, btw = 0, stw = 0;
    for (int64_t n = 0; n < F; n++) {
        double g = 0, gs = 0, u = 1, us = 0, G = 0, Gs = 0;
        for (int64_t k = 0; k < H; k++)
            g += x[k] * W1e[n * H + k], gs += fabs(x[k] * W1e[n * H + k]);
        if (gated) {
            u = 0;
            for (int64_t k = 0; k < H; k++)
                u += x[k] * W1e[(F + n) * H + k], us += fabs(x[k] * W1e[(F + n) * H + k]);
        }
        for (int64_t c = 0; c < H; c++)
            G += dy[c] * W2e[c * F + n], Gs += fabs(dy[c] * W2e[c * F + n]);
        const act_t a = act_eval(gated, g, u);
        const double dA = wt * G;
        /* bound A */
        const double ea = U_BF * fabs(a.h) + gam(H) * (fabs(a.hg) * gs + fabs(a.hu) * us) +
                          E_ACT * (fabs(a.h) + (gated ? 0 : fabs(g)));
        const double eG = gam(H) * Gs, edA = fabs(wt) * eG + U32 * fabs(dA);
        const double dg_ = U_BF * fabs(g) + gam(H) * gs, du_ = U_BF * fabs(u) + gam(H) * us;
        const double phi_abs_g = gated ? fabs(dA) * fabs(u) * a.s * (1.0 + fabs(g) * (1.0 - a.s))
                                       : fabs(dA) * (a.Phi + fabs(g) * a.phi + 1.0);
        w->h[n] = a.h, w->ea[n] = ea, w->G[n] = G, w->eG[n] = eG;
        w->dH[n] = dA * a.hg;
        w->edH[n] = U_BF * fabs(dA * a.hg) + fabs(a.hg) * edA + fabs(dA) * (fabs(a.hgg) * dg_ + fabs(a.hgu) * du_) +
                    E_ACT * phi_abs_g;
        if (gated) {
            w->dH[F + n] = dA * a.hu;
            w->edH[F + n] = U_BF * fabs(dA * a.hu) + fabs(a.hu) * edA + fabs(dA) * fabs(a.hgu) * dg_ +
                            E_ACT * fabs(dA) * fabs(g) * a.s;
        }
        dtw += G * a.h, btw += fabs(G) * ea + fabs(a.h) * eG, stw += fabs(G * a.h);
        /* bound B: the fp32 accumulators, then their bf16 stores */
        const iv_t g_acc = iv(g, gam(H) * gs), u_acc = gated ? iv(u, gam(H) * us) : (iv_t){1, 1};
        iv_t box[3] = {{0, 0}, g_acc, u_acc};
        iv_t ai = fn_range(gated, 0, box);
        const double ae = E_ACT * (fabs(a.h) + (gated ? 0 : fabs(g)));
        w->a[n] = iv_rb((iv_t){ai.lo - ae, ai.hi + ae});
        w->Gi[n] = iv(G, gam(H) * Gs);
        const iv_t gq = iv_rb(g_acc), uq = gated ? iv_rb(u_acc) : (iv_t){1, 1};
        iv_t dAi = iv_scale(w->Gi[n], wt);
        dAi = iv(0.5 * (dAi.lo + dAi.hi), 0.5 * (dAi.hi - dAi.lo) + U32 * iv_mag(dAi));
        box[0] = dAi, box[1] = gq, box[2] = uq;
        iv_t dgi = fn_range(gated, 1, box);
        const double pg = E_ACT * phi_abs_g * 1.01 + E_ACT * 1e-3 * iv_mag(dAi); /* dA's own width is in the box */
        w->dHi[n] = iv_rb((iv_t){dgi.lo - pg, dgi.hi + pg});
        if (gated) {
            iv_t dui = fn_range(gated, 2, box);
            const double pu = E_ACT * iv_mag(dAi) * (fabs(g) * a.s * 1.01 + 1e-3);
            w->dHi[F + n] = iv_rb((iv_t){dui.lo - pu, dui.hi + pu});
        }
    }
    /* d_topk_w: bound A, then B (each TP rank's slice in fp32, the ranks in ascending tp) */
    gr->dtw[s][t * m->K + j] = dtw;
    gr->btw[s][t * m->K + j] = btw + gam(F + TP) * stw;
    iv_t acc = {0, 0};
    for (int64_t q = 0; q < TP; q++) {
        iv_t part = {0, 0};
        double mag = 0;
        for (int64_t n = q * FL; n < (q + 1) * FL; n++) {
            const iv_t p = iv_mul(w->Gi[n], w->a[n]);
            part.lo += p.lo, part.hi += p.hi, mag += iv_mag(p);
        }
        part.lo -= gam(FL + 1) * mag, part.hi += gam(FL + 1) * mag;
        acc = iv_add_f32(acc, part);
    }
    gr->ltw[s][t * m->K + j] = acc.lo, gr->htw[s][t * m->K + j] = acc.hi;

    /* dX_r, per TP slice */
    const int64_t w1_rows = gated ? 2 * FL : FL;
    for (int64_t q = 0; q < TP; q++) {
        double *dX = w->dX + (j * TP + q) * H, *eX = w->eX + (j * TP + q) * H, *aX = w->aX + (j * TP + q) * H;
        iv_t *dXi = w->dXi + (j * TP + q) * H;
        for (int64_t k = 0; k < H; k++) {
            double v = 0, e_ = 0, sa = 0, lo = 0, hi = 0, mag = 0;
            for (int part = 0; part < 1 + gated; part++)
                for (int64_t n = q * FL; n < (q + 1) * FL; n++) {
                    const int64_t rr = full_row(m, n, part);
                    const double wk = W1e[rr * H + k];
                    v += w->dH[rr] * wk, e_ += w->edH[rr] * fabs(wk), sa += fabs(w->dH[rr] * wk);
                    const iv_t p = iv_scale(w->dHi[rr], wk);
                    lo += p.lo, hi += p.hi, mag += iv_mag(p);
                }
            dX[k] = v, aX[k] = fabs(v);
            eX[k] = U_BF * fabs(v) + e_ + gam(w1_rows) * sa;
            dXi[k] = iv_rb((iv_t){lo - gam(w1_rows) * mag, hi + gam(w1_rows) * mag});
        }
    }

    /* dW1 += dH^T x, dW2 += bf16(w dy)^T a */
    for (int64_t rr = 0; rr < RF; rr++) {
        const int64_t o = (e * RF + rr) * H;
        for (int64_t k = 0; k < H; k++) {
            gr->dW1[o + k] += w->dH[rr] * x[k];
            gr->bW1[o + k] += w->edH[rr] * fabs(x[k]);
            const iv_t p = iv_scale(w->dHi[rr], x[k]);
            gr->lW1[o + k] += p.lo, gr->hW1[o + k] += p.hi, gr->aW1[o + k] += iv_mag(p);
        }
    }
    for (int64_t c = 0; c < H; c++) {
        const double wd = wt * dy[c];
        const iv_t bw = iv_rb(iv(wd, U32 * fabs(wd)));
        const int64_t o = (e * H + c) * F;
        for (int64_t n = 0; n < F; n++) {
            gr->dW2[o + n] += wd * w->h[n];
            gr->bW2[o + n] += fabs(wd) * w->ea[n] + (U_BF + U32) * fabs(wd * w->h[n]);
            const iv_t p = iv_mul(bw, w->a[n]);
            gr->lW2[o + n] += p.lo, gr->hW2[o + n] += p.hi, gr->aW2[o + n] += iv_mag(p);
        }
    }
}

/* Every token of every rank: the exact gradients and both bounds. */
static void model_backward(const model_t *m, grads_t *gr) {
    scratch_t w;
    const int64_t nx = m->K * m->tp * m->H;
    w.h = zalloc(m->F), w.ea = zalloc(m->F), w.G = zalloc(m->F), w.eG = zalloc(m->F);
    w.dH = zalloc(m->RF), w.edH = zalloc(m->RF);
    w.a = calloc((size_t)m->F, sizeof(iv_t)), w.Gi = calloc((size_t)m->F, sizeof(iv_t));
    w.dHi = calloc((size_t)m->RF, sizeof(iv_t));
    w.dX = zalloc(nx), w.eX = zalloc(nx), w.aX = zalloc(nx), w.dXi = calloc((size_t)nx, sizeof(iv_t));
    const int64_t H = m->H, K = m->K, TP = m->tp;
    for (int s = 0; s < m->W; s++)
        for (int64_t t = 0; t < m->T[s]; t++) {
            for (int64_t j = 0; j < K; j++)
                model_row(m, gr, &w, s, t, j);
            for (int64_t k = 0; k < H; k++) {
                /* exact and bound A */
                double v = 0, b = 0, sa = 0;
                for (int64_t i = 0; i < K * TP; i++)
                    v += w.dX[i * H + k], b += w.eX[i * H + k], sa += w.aX[i * H + k];
                b += gam(K * TP) * sa;
                gr->dx[s][t * H + k] = v, gr->bx[s][t * H + k] = b + U_BF * (fabs(v) + b);
                /* bound B: ranks q ascending, on each t's slots there ascending, in fp32 from 0 */
                iv_t acc = {0, 0};
                for (int q = 0; q < m->W; q++) {
                    const int grp = q / m->tp, tq = q % m->tp;
                    iv_t part = {0, 0};
                    int any = 0;
                    for (int64_t j = 0; j < K; j++) {
                        if (m->idx[s][t * K + j] / m->EL != grp) continue;
                        any = 1;
                        part = iv_add_f32(part, w.dXi[(j * TP + tq) * H + k]);
                    }
                    if (any) acc = iv_add_f32(acc, part);
                }
                gr->lx[s][t * H + k] = rb(acc.lo), gr->hx[s][t * H + k] = rb(acc.hi);
            }
        }
    free(w.h), free(w.ea), free(w.G), free(w.eG), free(w.dH), free(w.edH), free(w.a), free(w.Gi), free(w.dHi);
    free(w.dX), free(w.eX), free(w.aX), free(w.dXi);
}

/* The float64 loss sum dy . y, written apart from the model above (for the
 * finite differences). */
static double model_loss(const model_t *m) {
    double L = 0;
    double *h = zalloc(m->F);
    for (int s = 0; s < m->W; s++)
        for (int64_t t = 0; t < m->T[s]; t++)
            for (int64_t j = 0; j < m->K; j++) {
                const int64_t e = m->idx[s][t * m->K + j];
                const double *x = m->x[s] + t * m->H, *W1e = m->W1 + e * m->RF * m->H, *W2e = m->W2 + e * m->H * m->F;
                for (int64_t n = 0; n < m->F; n++) {
                    double g = 0, u = 0;
                    for (int64_t k = 0; k < m->H; k++) {
                        g += x[k] * W1e[n * m->H + k];
                        if (m->gated) u += x[k] * W1e[(m->F + n) * m->H + k];
                    }
                    h[n] = m->gated ? g / (1.0 + exp(-g)) * u : 0.5 * g * (1.0 + erf(g / sqrt(2.0)));
                }
                for (int64_t c = 0; c < m->H; c++) {
                    double o = 0;
                    for (int64_t n = 0; n < m->F; n++)
                        o += h[n] * W2e[c * m->F + n];
                    L += m->dy[s][t * m->H + c] * m->tw[s][t * m->K + j] * o;
                }
            }
    free(h);
    return L;
}

/* ---- a problem: inputs, the reference's outputs ---------------------------- */
enum { DW_BF16 = 0, DW_FP32 = 1, DW_ACC = 2 };

typedef struct {
    comet_problem_t *p;
    model_t m;
    int W, mode;
    int64_t w1_rows;
    uint16_t **dy, **dx;
    float **dtw;
    void **dw1, **dw2;
    float **old1, **old2; /* accumulate: the values before the call */
    comet_backward_args_t *args;
} bwd_t;

static void bwd_free(bwd_t *b) {
    for (int s = 0; s < b->W; s++) {
        free(b->dy[s]), free(b->dx[s]), free(b->dtw[s]), free(b->dw1[s]), free(b->dw2[s]);
        free(b->old1[s]), free(b->old2[s]), free(b->m.x[s]), free(b->m.dy[s]), free(b->m.tw[s]);
    }
    free(b->dy), free(b->dx), free(b->dtw), free(b->dw1), free(b->dw2), free(b->old1), free(b->old2);
    free(b->m.x), free(b->m.dy), free(b->m.tw), free(b->m.W1), free(b->m.W2), free(b->args);
    comet_problem_destroy(b->p);
}

static size_t dw_elem(int mode) { return mode == DW_BF16 ? 2 : 4; }
static int64_t n_dw1(const bwd_t *b) { return b->m.EL * b->w1_rows * b->m.H; }
static int64_t n_dw2(const bwd_t *b) { return b->m.EL * b->m.H * b->m.FL; }

/* Poison every output of every rank (accumulating: the old values again). */
static void bwd_poison(bwd_t *b) {
    for (int s = 0; s < b->W; s++) {
        memset(b->dx[s], 0xff, (size_t)(b->m.T[s] * b->m.H) * 2);
        memset(b->dtw[s], 0xff, (size_t)(b->m.T[s] * b->m.K) * 4);
        if (b->mode == DW_ACC) {
            memcpy(b->dw1[s], b->old1[s], (size_t)n_dw1(b) * 4);
            memcpy(b->dw2[s], b->old2[s], (size_t)n_dw2(b) * 4);
        } else {
            memset(b->dw1[s], 0xff, (size_t)n_dw1(b) * dw_elem(b->mode));
            memset(b->dw2[s], 0xff, (size_t)n_dw2(b) * dw_elem(b->mode));
        }
    }
}

/* Every output of every rank still as bwd_poison left it. */
static int bwd_untouched(const bwd_t *b) {
    int ok = 1;
    for (int s = 0; s < b->W; s++) {
        for (int64_t i = 0; i < b->m.T[s] * b->m.H; i++)
            ok &= b->dx[s][i] == 0xffff;
        const uint32_t *t = (const uint32_t *)b->dtw[s];
        for (int64_t i = 0; i < b->m.T[s] * b->m.K; i++)
            ok &= t[i] == 0xffffffffu;
        if (b->mode == DW_ACC) {
            ok &= memcmp(b->dw1[s], b->old1[s], (size_t)n_dw1(b) * 4) == 0;
            ok &= memcmp(b->dw2[s], b->old2[s], (size_t)n_dw2(b) * 4) == 0;
        } else {
            const unsigned char *p1 = b->dw1[s], *p2 = b->dw2[s];
            for (size_t i = 0; i < (size_t)n_dw1(b) * dw_elem(b->mode); i++)
                ok &= p1[i] == 0xff;
            for (size_t i = 0; i < (size_t)n_dw2(b) * dw_elem(b->mode); i++)
                ok &= p2[i] == 0xff;
        }
    }
    return ok;
}

static int bwd_create(bwd_t *b, const comet_layer_config_t *cfg, int W, const int64_t *tokens,
                      const comet_routing_opts_t *ro, int mode, uint64_t seed) {
    memset(b, 0, sizeof *b);
    if (comet_problem_create(&b->p, cfg, W, tokens, ro) != COMET_SUCCESS) {
        CHECK(0, "problem: %s", comet_last_error());
        return 0;
    }
    const comet_problem_t *p = b->p;
    model_t *m = &b->m;
    b->W = W, b->mode = mode;
    m->W = W, m->tp = cfg->tp, m->ep = cfg->ep, m->gated = cfg->activation == COMET_ACT_SILU_GATED;
    m->H = cfg->hidden, m->F = cfg->ffn, m->FL = cfg->ffn / cfg->tp, m->E = cfg->num_experts;
    m->EL = cfg->num_experts / cfg->ep, m->K = cfg->topk, m->RF = m->gated ? 2 * m->F : m->F;
    m->T = p->tokens, m->idx = (const int32_t *const *)p->topk_idx;
    b->w1_rows = m->gated ? 2 * m->FL : m->FL;
    m->W1 = zalloc(m->E * m->RF * m->H), m->W2 = zalloc(m->E * m->H * m->F);
    for (int64_t i = 0; i < m->E * m->RF * m->H; i++)
        m->W1[i] = bf(p->w1_full[i]);
    for (int64_t i = 0; i < m->E * m->H * m->F; i++)
        m->W2[i] = bf(p->w2_full[i]);
    m->x = calloc((size_t)W, sizeof(double *)), m->dy = calloc((size_t)W, sizeof(double *));
    m->tw = calloc((size_t)W, sizeof(double *));
    b->dy = calloc((size_t)W, sizeof(void *)), b->dx = calloc((size_t)W, sizeof(void *));
    b->dtw = calloc((size_t)W, sizeof(void *)), b->dw1 = calloc((size_t)W, sizeof(void *));
    b->dw2 = calloc((size_t)W, sizeof(void *)), b->old1 = calloc((size_t)W, sizeof(void *));
    b->old2 = calloc((size_t)W, sizeof(void *));
    b->args = calloc((size_t)W, sizeof(comet_backward_args_t));
    comet_rng_t rng = {seed * 0x2545f4914f6cdd1dull + 3};
    const comet_dtype_t dt = mode == DW_BF16 ? COMET_DTYPE_BF16 : COMET_DTYPE_FP32;
    for (int s = 0; s < W; s++) {
        const int64_t T = p->tokens[s], H = m->H, K = m->K;
        b->dy[s] = malloc((size_t)(T * H + 1) * 2), b->dx[s] = malloc((size_t)(T * H + 1) * 2);
        b->dtw[s] = malloc((size_t)(T * K + 1) * 4);
        b->dw1[s] = malloc((size_t)n_dw1(b) * dw_elem(mode)), b->dw2[s] = malloc((size_t)n_dw2(b) * dw_elem(mode));
        b->old1[s] = malloc((size_t)n_dw1(b) * 4), b->old2[s] = malloc((size_t)n_dw2(b) * 4);
        m->x[s] = zalloc(T * H), m->dy[s] = zalloc(T * H), m->tw[s] = zalloc(T * K);
        for (int64_t i = 0; i < T * H; i++) {
            b->dy[s][i] = comet_f32_to_bf16((float)(2.0 * comet_rng_uniform(&rng) - 1.0));
            m->dy[s][i] = bf(b->dy[s][i]);
            m->x[s][i] = bf(p->x[s][i]);
        }
        for (int64_t i = 0; i < T * K; i++)
            m->tw[s][i] = p->topk_w[s][i];
        for (int64_t i = 0; i < n_dw1(b); i++)
            b->old1[s][i] = (float)(0.02 * (2.0 * comet_rng_uniform(&rng) - 1.0));
        for (int64_t i = 0; i < n_dw2(b); i++)
            b->old2[s][i] = (float)(0.02 * (2.0 * comet_rng_uniform(&rng) - 1.0));
        comet_backward_args_t a = COMET_BACKWARD_ARGS_INIT;
        a.x = p->ref_args[s].x, a.topk_idx = p->ref_args[s].topk_idx, a.topk_w = p->ref_args[s].topk_w;
        a.w1 = p->ref_args[s].w1, a.w2 = p->ref_args[s].w2;
        a.dy = comet_tensor_2d(b->dy[s], COMET_DTYPE_BF16, T, H);
        a.dx = comet_tensor_2d(b->dx[s], COMET_DTYPE_BF16, T, H);
        a.d_topk_w = comet_tensor_2d(b->dtw[s], COMET_DTYPE_FP32, T, K);
        a.dw1 = comet_tensor_3d(b->dw1[s], dt, m->EL, b->w1_rows, H);
        a.dw2 = comet_tensor_3d(b->dw2[s], dt, m->EL, H, m->FL);
        a.accumulate = mode == DW_ACC;
        b->args[s] = a;
    }
    return 1;
}

/* ---- the comparison ------------------------------------------------------------ */
enum { O_DX, O_DTW, O_DW1, O_DW2, O_N };
static const char *const o_name[O_N] = {"dx", "d_topk_w", "dw1", "dw2"};

typedef struct {
    int64_t elements[O_N], bad_a[O_N], bad_b[O_N], point[O_N];
    int64_t zero_rows[O_N];                     /* elements of an all-zero exact row (must be exact): not in caught_ */
    int64_t caught_a[O_N][4], caught_b[O_N][4]; /* perturbations of 1, 4, 16, 64 bf16 ulps of the row's rms caught */
    double worst_a[O_N];                        /* largest |ref - exact| / B */
} stats_t;

typedef struct {
    const char *name;
    int printed;
} ctx_t;

/* One element: ref against exact (bound A) and against [lo, hi] (bound B);
 * scale is the rms of its row (for the simulated perturbation). */
static void judge(stats_t *st, ctx_t *cx, int o, double ref, double exact, double bound, double lo, double hi,
                  double scale, const char *where) {
    const double err = fabs(ref - exact);
    const int ok_a = err <= 1.05 * bound, ok_b = ref >= lo && ref <= hi;
    st->elements[o]++;
    st->bad_a[o] += !ok_a, st->bad_b[o] += !ok_b, st->point[o] += lo == hi;
    const double r = bound > 0 ? err / bound : err > 0 ? INFINITY : 0;
    if (!(r <= st->worst_a[o])) st->worst_a[o] = isnan(r) ? INFINITY : r;
    /* a perturbation p of this element is surely caught when p > err + 1.05 bound (A), p > hi - lo (B) */
    const double ulp = ulp_bf(scale);
    st->zero_rows[o] += scale == 0;
    for (int i = 0; scale != 0 && i < 4; i++) {
        const double p = ulp * (1 << (2 * i));
        st->caught_a[o][i] += p > err + 1.05 * bound, st->caught_b[o][i] += p > hi - lo;
    }
    if ((!ok_a || !ok_b) && cx->printed++ < 8)
        fprintf(stderr, "  %s: %s %s: ref %.9g exact %.9g (|err| %.3g, bound A %.3g) interval [%.9g, %.9g]\n", cx->name,
                o_name[o], where, ref, exact, err, 1.05 * bound, lo, hi);
}

static double row_rms(const double *v, int64_t n, int64_t stride) {
    double ss = 0;
    for (int64_t i = 0; i < n; i++)
        ss += v[i * stride] * v[i * stride];
    return n ? sqrt(ss / (double)n) : 0;
}

/* d_topk_w's scale: the rms over every rank's d_topk_w (one token's few
 * slots are dot products that may cancel, no scale for each other). */
static double dtw_rms(const bwd_t *b, const grads_t *g) {
    double ss = 0;
    int64_t n = 0;
    for (int s = 0; s < b->W; s++)
        for (int64_t i = 0; i < b->m.T[s] * b->m.K; i++)
            ss += g->dtw[s][i] * g->dtw[s][i], n++;
    return n ? sqrt(ss / (double)n) : 0;
}

static double dw_value(const bwd_t *b, void *const *dw, int s, int64_t i) {
    return b->mode == DW_BF16 ? bf(((const uint16_t *)dw[s])[i]) : ((const float *)dw[s])[i];
}

/* quiet: print no element (the mutation checks' expected failures) */
static void compare(const bwd_t *b, const grads_t *g, stats_t *st, const char *name, int quiet) {
    const model_t *m = &b->m;
    const int64_t H = m->H, K = m->K, F = m->F, FL = m->FL, RF = m->RF;
    ctx_t cx = {name, quiet ? 1 << 30 : 0};
    char where[96];
    const double stw = dtw_rms(b, g);
    for (int s = 0; s < b->W; s++) {
        for (int64_t t = 0; t < m->T[s]; t++) {
            const double sx = row_rms(g->dx[s] + t * H, H, 1);
            for (int64_t k = 0; k < H; k++) {
                const int64_t i = t * H + k;
                snprintf(where, sizeof where, "rank %d token %lld col %lld", s, (long long)t, (long long)k);
                judge(st, &cx, O_DX, bf(b->dx[s][i]), g->dx[s][i], g->bx[s][i], g->lx[s][i], g->hx[s][i], sx, where);
            }
            for (int64_t j = 0; j < K; j++) {
                const int64_t i = t * K + j;
                snprintf(where, sizeof where, "rank %d token %lld slot %lld", s, (long long)t, (long long)j);
                judge(st, &cx, O_DTW, b->dtw[s][i], g->dtw[s][i], g->btw[s][i], g->ltw[s][i], g->htw[s][i], stw, where);
            }
        }
        const int ep = s / m->tp, tp = s % m->tp;
        for (int64_t le = 0; le < m->EL; le++) {
            const int64_t e = ep * m->EL + le, R = g->rows[e];
            for (int64_t n = 0; n < b->w1_rows; n++) {
                const int64_t nf = n < FL ? tp * FL + n : F + tp * FL + (n - FL); /* gate slice, then up slice */
                const int64_t o = (e * RF + nf) * H;
                const double scale = row_rms(g->dW1 + o, H, 1);
                for (int64_t k = 0; k < H; k++) {
                    const int64_t i = (le * b->w1_rows + n) * H + k;
                    const double slack = gam(R) * g->aW1[o + k] * (R > 0);
                    double v = g->dW1[o + k], bd = g->bW1[o + k] + slack;
                    double lo = g->lW1[o + k] - slack, hi = g->hW1[o + k] + slack;
                    if (b->mode == DW_BF16)
                        bd += U_BF * (fabs(v) + bd), lo = rb(lo), hi = rb(hi);
                    else if (b->mode == DW_FP32)
                        bd += U32 * (fabs(v) + bd), lo = rf(lo), hi = rf(hi);
                    else {
                        const double old = b->old1[s][i];
                        bd += U32 * (fabs(old + v) + bd), v += old, lo = rf(old + lo), hi = rf(old + hi);
                    }
                    snprintf(where, sizeof where, "rank %d expert %lld row %lld col %lld", s, (long long)e,
                             (long long)n, (long long)k);
                    judge(st, &cx, O_DW1, dw_value(b, b->dw1, s, i), v, bd, lo, hi, scale, where);
                }
            }
            for (int64_t c = 0; c < H; c++) {
                const int64_t o = (e * H + c) * F;
                const double scale = row_rms(g->dW2 + o, F, 1);
                for (int64_t n = 0; n < FL; n++) {
                    const int64_t i = (le * H + c) * FL + n, of = o + tp * FL + n;
                    const double slack = gam(R) * g->aW2[of] * (R > 0);
                    double v = g->dW2[of], bd = g->bW2[of] + slack, lo = g->lW2[of] - slack, hi = g->hW2[of] + slack;
                    if (b->mode == DW_BF16)
                        bd += U_BF * (fabs(v) + bd), lo = rb(lo), hi = rb(hi);
                    else if (b->mode == DW_FP32)
                        bd += U32 * (fabs(v) + bd), lo = rf(lo), hi = rf(hi);
                    else {
                        const double old = b->old2[s][i];
                        bd += U32 * (fabs(old + v) + bd), v += old, lo = rf(old + lo), hi = rf(old + hi);
                    }
                    snprintf(where, sizeof where, "rank %d expert %lld row %lld col %lld", s, (long long)e,
                             (long long)c, (long long)n);
                    judge(st, &cx, O_DW2, dw_value(b, b->dw2, s, i), v, bd, lo, hi, scale, where);
                }
            }
        }
    }
}

static int64_t stats_bad(const stats_t *st) {
    int64_t n = 0;
    for (int o = 0; o < O_N; o++)
        n += st->bad_a[o] + st->bad_b[o];
    return n;
}

/* ---- the cases ----------------------------------------------------------------- */
typedef struct {
    int tp, ep;
    comet_activation_t act;
    int mode;
    int64_t E, K, H, F, T[4];
    double skew;
    int64_t zero_experts;
} case_t;

static const char *const mode_name[3] = {"bf16", "fp32", "accumulate"};

/* Outputs of every rank as bytes, for the determinism check. */
static size_t snapshot(const bwd_t *b, unsigned char *buf) {
    size_t n = 0;
    for (int s = 0; s < b->W; s++) {
        const size_t sz[4] = {(size_t)(b->m.T[s] * b->m.H) * 2, (size_t)(b->m.T[s] * b->m.K) * 4,
                              (size_t)n_dw1(b) * dw_elem(b->mode), (size_t)n_dw2(b) * dw_elem(b->mode)};
        const void *src[4] = {b->dx[s], b->dtw[s], b->dw1[s], b->dw2[s]};
        for (int i = 0; i < 4; i++) {
            if (buf) memcpy(buf + n, src[i], sz[i]);
            n += sz[i];
        }
    }
    return n;
}

/* Add d to element i of output o of rank s; returns the old bits. */
static uint32_t perturb(bwd_t *b, int o, int s, int64_t i, double d) {
    uint32_t keep = 0;
    if (o == O_DX)
        keep = b->dx[s][i], b->dx[s][i] = comet_f32_to_bf16((float)(bf(b->dx[s][i]) + d));
    else if (o == O_DTW)
        memcpy(&keep, &b->dtw[s][i], 4), b->dtw[s][i] = (float)(b->dtw[s][i] + d);
    else {
        void *p = o == O_DW1 ? b->dw1[s] : b->dw2[s];
        if (b->mode == DW_BF16) {
            uint16_t *q = p;
            keep = q[i], q[i] = comet_f32_to_bf16((float)(bf(q[i]) + d));
        } else {
            float *q = p;
            memcpy(&keep, &q[i], 4), q[i] = (float)(q[i] + d);
        }
    }
    return keep;
}

static void restore(bwd_t *b, int o, int s, int64_t i, uint32_t keep) {
    if (o == O_DX)
        b->dx[s][i] = (uint16_t)keep;
    else if (o == O_DTW)
        memcpy(&b->dtw[s][i], &keep, 4);
    else {
        void *p = o == O_DW1 ? b->dw1[s] : b->dw2[s];
        if (b->mode == DW_BF16)
            ((uint16_t *)p)[i] = (uint16_t)keep;
        else
            memcpy((float *)p + i, &keep, 4);
    }
}

/* Real perturbations of one element of each output (the largest |exact| of
 * the first rank that has one): by 2 bf16 ulps of its own magnitude, which
 * bound B must report, and by 32 bf16 ulps of its row's rms, which bound A
 * must report. */
static void mutation_check(bwd_t *b, const grads_t *g, const char *name) {
    const model_t *m = &b->m;
    for (int o = 0; o < O_N; o++) {
        int s_best = -1;
        int64_t i_best = -1;
        double best = -1, rms = 0;
        for (int s = 0; s < b->W && s_best < 0; s++) {
            if (o == O_DX || o == O_DTW) {
                const int64_t len = o == O_DX ? m->H : m->K;
                const double *v = o == O_DX ? g->dx[s] : g->dtw[s];
                for (int64_t i = 0; i < m->T[s] * len; i++)
                    if (fabs(v[i]) > best)
                        best = fabs(v[i]), s_best = s, i_best = i,
                        rms = o == O_DX ? row_rms(v + i / len * len, len, 1) : dtw_rms(b, g);
            } else { /* rank s's slices: local expert le, local row n */
                const int ep = s / m->tp, tp = s % m->tp;
                const int64_t rows = o == O_DW1 ? b->w1_rows : m->H, cols = o == O_DW1 ? m->H : m->FL;
                for (int64_t le = 0; le < m->EL; le++)
                    for (int64_t n = 0; n < rows; n++) {
                        const int64_t e = ep * m->EL + le;
                        const double *row;
                        int64_t len, off;
                        if (o == O_DW1) {
                            const int64_t nf = n < m->FL ? tp * m->FL + n : m->F + tp * m->FL + (n - m->FL);
                            row = g->dW1 + (e * m->RF + nf) * m->H, len = m->H, off = 0;
                        } else {
                            row = g->dW2 + (e * m->H + n) * m->F, len = m->F, off = tp * m->FL;
                        }
                        for (int64_t k = 0; k < cols; k++)
                            if (fabs(row[off + k]) > best)
                                best = fabs(row[off + k]), s_best = s, i_best = (le * rows + n) * cols + k,
                                rms = row_rms(row, len, 1);
                    }
            }
        }
        if (s_best < 0 || best == 0) continue;
        const double sizes[2] = {2 * ulp_bf(best), 32 * ulp_bf(rms)};
        for (int which = 0; which < 2; which++) {
            const uint32_t keep = perturb(b, o, s_best, i_best, sizes[which]);
            stats_t st;
            memset(&st, 0, sizeof st);
            compare(b, g, &st, name, 1);
            const int64_t seen = which ? st.bad_a[o] : st.bad_b[o];
            CHECK(seen >= 1,
                  "%s: %s perturbed by %.3g (rank %d, element %lld, |exact| %.3g, row rms %.3g): bound %s "
                  "does not report it (bound A %lld, bound B %lld)",
                  name, o_name[o], sizes[which], s_best, (long long)i_best, best, rms, which ? "A" : "B",
                  (long long)st.bad_a[o], (long long)st.bad_b[o]);
            restore(b, o, s_best, i_best, keep);
        }
    }
}

static void run_case(const case_t *c, stats_t *total, int mutate) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = c->H, cfg.ffn = c->F, cfg.num_experts = c->E, cfg.topk = c->K, cfg.tp = c->tp, cfg.ep = c->ep;
    cfg.activation = c->act, cfg.tile_m = 4;
    const int W = c->tp * c->ep;
    int64_t maxT = 1;
    for (int s = 0; s < W; s++)
        maxT = c->T[s] > maxT ? c->T[s] : maxT;
    cfg.max_tokens_per_rank = maxT;
    char name[160];
    snprintf(name, sizeof name, "TP=%d EP=%d %s E=%lld topk=%lld H=%lld F=%lld T={%lld,%lld,%lld,%lld} dw %s", c->tp,
             c->ep, c->act == COMET_ACT_GELU ? "gelu" : "silu-gated", (long long)c->E, (long long)c->K, (long long)c->H,
             (long long)c->F, (long long)c->T[0], (long long)(W > 1 ? c->T[1] : -1), (long long)(W > 2 ? c->T[2] : -1),
             (long long)(W > 3 ? c->T[3] : -1), mode_name[c->mode]);
    comet_routing_opts_t ro = {c->skew, c->zero_experts,
                               (uint64_t)(c->tp * 131 + c->ep * 17 + c->K * 7 + c->mode) + 1000 * TEST_SEED};
    bwd_t b;
    if (!bwd_create(&b, &cfg, W, c->T, &ro, c->mode, ro.seed + 99)) return;
    grads_t g;
    grads_init(&g, &b.m);
    model_backward(&b.m, &g);
    int64_t empty = 0, rows = 0;
    for (int64_t e = 0; e < c->E; e++)
        empty += g.rows[e] == 0, rows += g.rows[e];

    bwd_poison(&b);
    comet_status_t st = comet_reference_backward(&cfg, W, b.args);
    CHECK(st == COMET_SUCCESS, "%s: %s (%s)", name, comet_status_string(st), comet_last_error());
    if (st == COMET_SUCCESS) {
        stats_t cs;
        memset(&cs, 0, sizeof cs);
        compare(&b, &g, &cs, name, 0);
        CHECK(stats_bad(&cs) == 0,
              "%s: outside the bounds: dx %lld/%lld (A) %lld (B), d_topk_w %lld/%lld %lld, dw1 %lld/%lld %lld, "
              "dw2 %lld/%lld %lld",
              name, (long long)cs.bad_a[0], (long long)cs.elements[0], (long long)cs.bad_b[0], (long long)cs.bad_a[1],
              (long long)cs.elements[1], (long long)cs.bad_b[1], (long long)cs.bad_a[2], (long long)cs.elements[2],
              (long long)cs.bad_b[2], (long long)cs.bad_a[3], (long long)cs.elements[3], (long long)cs.bad_b[3]);
        for (int o = 0; o < O_N; o++) {
            total->elements[o] += cs.elements[o], total->bad_a[o] += cs.bad_a[o], total->bad_b[o] += cs.bad_b[o];
            total->point[o] += cs.point[o], total->zero_rows[o] += cs.zero_rows[o];
            for (int i = 0; i < 4; i++)
                total->caught_a[o][i] += cs.caught_a[o][i], total->caught_b[o][i] += cs.caught_b[o][i];
            if (!(cs.worst_a[o] <= total->worst_a[o])) total->worst_a[o] = cs.worst_a[o];
        }
        printf("test_backward: %s: %lld rows, %lld experts without rows, worst |err|/bound A: dx %.2f d_topk_w %.2f "
               "dw1 %.2f dw2 %.2f\n",
               name, (long long)rows, (long long)empty, cs.worst_a[0], cs.worst_a[1], cs.worst_a[2], cs.worst_a[3]);

        /* deterministic: a second call (outputs poisoned again) is bitwise equal */
        const size_t n = snapshot(&b, NULL);
        unsigned char *first = malloc(n + 1);
        snapshot(&b, first);
        if (mutate) mutation_check(&b, &g, name);
        bwd_poison(&b);
        st = comet_reference_backward(&cfg, W, b.args);
        unsigned char *second = malloc(n + 1);
        snapshot(&b, second);
        CHECK(st == COMET_SUCCESS && memcmp(first, second, n) == 0, "%s: a second call differs (%s)", name,
              comet_status_string(st));
        /* the harness's threaded driver (items in another order, at once) gives the same bits */
        for (int threads = 2; threads <= 5; threads += 3) {
            bwd_poison(&b);
            st = comet_reference_backward_parallel(&cfg, W, b.args, threads);
            snapshot(&b, second);
            CHECK(st == COMET_SUCCESS && memcmp(first, second, n) == 0, "%s: on %d threads the result differs (%s)", name,
                  threads, comet_status_string(st));
        }
        free(first), free(second);
    }
    grads_free(&g, &b.m);
    bwd_free(&b);
}

/* ---- finite differences of the float64 model --------------------------------- */
static void check_act_derivatives(void) {
    const double gs[] = {-4.0, -1.2785, -0.5, 0.0, 0.3, 1.7, 3.0}, us[] = {-1.3, 0.4, 2.0};
    double worst = 0;
    for (int gated = 0; gated < 2; gated++)
        for (size_t i = 0; i < sizeof gs / sizeof gs[0]; i++)
            for (size_t k = 0; k < (gated ? 3u : 1u); k++) {
                const double g = gs[i], u = gated ? us[k] : 1;
                const act_t a = act_eval(gated, g, u);
                double fd[4] = {0, 0, 0, 0}; /* Richardson-extrapolated central differences, steps 1e-3 and 5e-4 */
                for (int r = 0; r < 2; r++) {
                    const double d = r ? 5e-4 : 1e-3, wgt = r ? 4.0 / 3.0 : -1.0 / 3.0;
                    const act_t gp = act_eval(gated, g + d, u), gm = act_eval(gated, g - d, u);
                    const act_t up = act_eval(gated, g, u + d), um = act_eval(gated, g, u - d);
                    fd[0] += wgt * (gp.h - gm.h) / (2 * d), fd[1] += wgt * (gp.hg - gm.hg) / (2 * d);
                    fd[2] += wgt * (up.h - um.h) / (2 * d), fd[3] += wgt * (up.hg - um.hg) / (2 * d);
                }
                const double an[4] = {a.hg, a.hgg, a.hu, a.hgu};
                for (int q = 0; q < (gated ? 4 : 2); q++) {
                    const double err = fabs(fd[q] - an[q]) / (fabs(an[q]) + 1e-3);
                    worst = fmax(worst, err);
                    CHECK(err < 1e-9, "act %s derivative %d at g=%g u=%g: fd %.12g analytic %.12g",
                          gated ? "silu-gated" : "gelu", q, g, u, fd[q], an[q]);
                }
            }
    printf("test_backward: activation derivatives against finite differences: worst relative %.2e\n", worst);
}

/* Richardson-extrapolated central difference of the loss in *p. */
static double fd_loss(const model_t *m, double *p) {
    const double keep = *p, h = 1e-3 * fmax(1.0, fabs(keep));
    double d[2];
    for (int i = 0; i < 2; i++) {
        const double hh = i ? h / 2 : h;
        *p = keep + hh;
        const double lp = model_loss(m);
        *p = keep - hh;
        const double lm = model_loss(m);
        d[i] = (lp - lm) / (2 * hh);
    }
    *p = keep;
    return (4 * d[1] - d[0]) / 3;
}

static double max_abs(const double *v, int64_t n) {
    double r = 0;
    for (int64_t i = 0; i < n; i++)
        r = fmax(r, fabs(v[i]));
    return r;
}

static void check_finite_differences(int tp, int ep, comet_activation_t act, int64_t K) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 12, cfg.ffn = 8, cfg.num_experts = 4, cfg.topk = K, cfg.tp = tp, cfg.ep = ep;
    cfg.activation = act, cfg.max_tokens_per_rank = 3, cfg.tile_m = 4;
    const int W = tp * ep;
    const int64_t tokens[4] = {3, 1, 0, 2};
    comet_routing_opts_t ro = {0.3, 0, (uint64_t)(50 + K) + 1000 * TEST_SEED};
    bwd_t b;
    if (!bwd_create(&b, &cfg, W, tokens, &ro, DW_FP32, 5 + (uint64_t)K)) return;
    model_t *m = &b.m;
    /* larger activations, so that g reaches the activations' curved parts */
    for (int64_t i = 0; i < m->E * m->RF * m->H; i++)
        m->W1[i] *= 3;
    grads_t g;
    grads_init(&g, m);
    model_backward(m, &g);
    comet_rng_t rng = {1234 + (uint64_t)K + 1000 * TEST_SEED};
    double worst = 0;
    int checked = 0;
    for (int which = 0; which < 4; which++) {
        double scale = 0;
        if (which == 0)
            for (int s = 0; s < W; s++)
                scale = fmax(scale, max_abs(g.dx[s], m->T[s] * m->H));
        else if (which == 1)
            for (int s = 0; s < W; s++)
                scale = fmax(scale, max_abs(g.dtw[s], m->T[s] * m->K));
        else
            scale = which == 2 ? max_abs(g.dW1, m->E * m->RF * m->H) : max_abs(g.dW2, m->E * m->H * m->F);
        for (int n = 0; n < 6; n++) {
            double *p, an;
            if (which <= 1) {
                int s;
                do
                    s = (int)(comet_rng_next(&rng) % (uint64_t)W);
                while (m->T[s] == 0);
                const int64_t len = m->T[s] * (which ? m->K : m->H),
                              i = (int64_t)(comet_rng_next(&rng) % (uint64_t)len);
                p = which ? &m->tw[s][i] : &m->x[s][i];
                an = which ? g.dtw[s][i] : g.dx[s][i];
            } else {
                int64_t e;
                do
                    e = (int64_t)(comet_rng_next(&rng) % (uint64_t)m->E);
                while (g.rows[e] == 0);
                if (which == 2) { /* gate rows first, then up rows (gated) */
                    const int64_t row =
                        (n % 2 && m->gated ? m->F : 0) + (int64_t)(comet_rng_next(&rng) % (uint64_t)m->F);
                    const int64_t i = (e * m->RF + row) * m->H + (int64_t)(comet_rng_next(&rng) % (uint64_t)m->H);
                    p = &m->W1[i], an = g.dW1[i];
                } else {
                    const int64_t i = e * m->H * m->F + (int64_t)(comet_rng_next(&rng) % (uint64_t)(m->H * m->F));
                    p = &m->W2[i], an = g.dW2[i];
                }
            }
            const double fd = fd_loss(m, p), err = fabs(fd - an) / (fabs(an) + scale);
            worst = fmax(worst, err);
            checked++;
            CHECK(err <= 1e-9, "finite differences, TP=%d EP=%d %s topk=%lld, %s: fd %.12g analytic %.12g", tp, ep,
                  act == COMET_ACT_GELU ? "gelu" : "silu-gated", (long long)K, o_name[which], fd, an);
        }
    }
    printf("test_backward: finite differences (TP=%d EP=%d %s topk=%lld): %d coordinates, worst |fd - analytic| / "
           "(|analytic| + max) %.2e\n",
           tp, ep, act == COMET_ACT_GELU ? "gelu" : "silu-gated", (long long)K, checked, worst);
    grads_free(&g, m);
    bwd_free(&b);
}

/* ---- invalid input --------------------------------------------------------------- */
typedef struct {
    const char *what;
    comet_status_t want;
} bad_t;

static void bad_call(bwd_t *b, comet_layer_config_t *cfg, int W, const comet_backward_args_t *args, bad_t k) {
    bwd_poison(b);
    comet_status_t st = comet_reference_backward(cfg, W, args);
    const char *msg = comet_last_error();
    CHECK(st == k.want, "invalid input (%s): %s, expected %s (%s)", k.what, comet_status_string(st),
          comet_status_string(k.want), msg);
    CHECK(st == COMET_SUCCESS || msg[0] != '\0', "invalid input (%s): no message", k.what);
    CHECK(bwd_untouched(b), "invalid input (%s): an output was written", k.what);
    /* the harness's threaded driver of the same items: the same status, nothing written */
    const comet_status_t st3 = comet_reference_backward_parallel(cfg, W, args, 3);
    CHECK(st3 == k.want, "invalid input (%s), on 3 threads: %s, expected %s", k.what, comet_status_string(st3),
          comet_status_string(k.want));
    CHECK(bwd_untouched(b), "invalid input (%s), on 3 threads: an output was written", k.what);
}

static void check_invalid(int mode) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 16, cfg.ffn = 8, cfg.num_experts = 8, cfg.topk = 2, cfg.tp = 2, cfg.ep = 2;
    cfg.max_tokens_per_rank = 5, cfg.tile_m = 4;
    const int W = 4;
    const int64_t tokens[4] = {3, 0, 2, 4};
    comet_routing_opts_t ro = {0.5, 1, 77};
    bwd_t b;
    if (!bwd_create(&b, &cfg, W, tokens, &ro, mode, 8)) return;
    comet_backward_args_t *a = malloc(sizeof(comet_backward_args_t) * W);
    const comet_status_t ARG = COMET_ERR_INVALID_ARGUMENT, SHAPE = COMET_ERR_INVALID_SHAPE,
                         ROUT = COMET_ERR_INVALID_ROUTING;
    /* the valid call first */
    bwd_poison(&b);
    comet_status_t st = comet_reference_backward(&cfg, W, b.args);
    CHECK(st == COMET_SUCCESS, "valid input (dw %s): %s (%s)", mode_name[mode], comet_status_string(st),
          comet_last_error());
    const int last = W - 1; /* rank 3: a reference that wrote ranks 0..2 before checking 3 is caught */
    const int64_t T = tokens[last], H = cfg.hidden, K = cfg.topk, EL = 4, R1 = 2 * 4, FL = 4;
#define BAD(rank, edit, want_, what_)                                                                                  \
    do {                                                                                                               \
        memcpy(a, b.args, sizeof(comet_backward_args_t) * W);                                                          \
        comet_backward_args_t *r_ = &a[rank];                                                                          \
        edit;                                                                                                          \
        bad_call(&b, &cfg, W, a, (bad_t){what_, want_});                                                               \
        (void)r_;                                                                                                      \
    } while (0)
    BAD(last, r_->struct_size = 0, ARG, "struct_size 0");
    BAD(0, r_->struct_size = sizeof(comet_backward_args_t) - 4, ARG, "struct_size - 4 on rank 0");
    BAD(last, r_->dy.dtype = COMET_DTYPE_FP32, SHAPE, "dy fp32");
    BAD(last, r_->dy.shape[0] = T - 1, SHAPE, "dy (T-1, H)");
    BAD(last, r_->dy.shape[1] = H + 1, SHAPE, "dy (T, H+1)");
    BAD(last, r_->dy.ndim = 3, SHAPE, "dy 3-d");
    BAD(last, r_->dx.dtype = COMET_DTYPE_FP32, SHAPE, "dx fp32");
    BAD(last, r_->dx.shape[0] = T + 1, SHAPE, "dx (T+1, H)");
    BAD(last, r_->dx.shape[1] = H - 1, SHAPE, "dx (T, H-1)");
    BAD(last, r_->dx.data = NULL, ARG, "dx NULL");
    BAD(last, r_->d_topk_w.dtype = COMET_DTYPE_BF16, SHAPE, "d_topk_w bf16");
    BAD(last, r_->d_topk_w.shape[1] = K + 1, SHAPE, "d_topk_w (T, topk+1)");
    BAD(last, r_->d_topk_w.shape[0] = T - 1, SHAPE, "d_topk_w (T-1, topk)");
    BAD(last, r_->dw1.dtype = COMET_DTYPE_INT32, SHAPE, "dw1 int32");
    BAD(last, r_->dw1.shape[1] = R1 / 2, SHAPE, "dw1 (E_local, F_local, H) for gated");
    BAD(last, r_->dw1.shape[0] = EL + 1, SHAPE, "dw1 (E_local+1, ...)");
    BAD(last, r_->dw1.ndim = 2, SHAPE, "dw1 2-d");
    BAD(last, r_->dw2.shape[2] = FL * 2, SHAPE, "dw2 (E_local, H, F) unsliced");
    BAD(last, r_->dw2.dtype = COMET_DTYPE_INT32, SHAPE, "dw2 int32");
    BAD(last, r_->dw2.data = NULL, ARG, "dw2 NULL");
    BAD(last, r_->x.dtype = COMET_DTYPE_FP32, SHAPE, "x fp32");
    BAD(last, r_->x.shape[0] = 6; r_->dy.shape[0] = 6; r_->dx.shape[0] = 6; r_->topk_idx.shape[0] = 6;
        r_->topk_w.shape[0] = 6; r_->d_topk_w.shape[0] = 6, SHAPE, "T > max_tokens_per_rank");
    BAD(last, r_->w1.shape[1] = R1 + 2, SHAPE, "w1 wrong rows");
    BAD(last, r_->topk_idx.dtype = COMET_DTYPE_FP32, SHAPE, "topk_idx fp32");
    BAD(last, r_->topk_w.dtype = COMET_DTYPE_BF16, SHAPE, "topk_w bf16");
    BAD(last, r_->accumulate = 2, ARG, "accumulate 2");
    BAD(last, r_->accumulate = -1, ARG, "accumulate -1");
    BAD(last, r_->disable = 4, ARG, "disable 4 (unknown bits)");
    if (mode == DW_BF16) {
        /* accumulate with bf16 dw: "1: added to (both fp32)", a dtype mismatch */
        BAD(last, r_->accumulate = 1, SHAPE, "accumulate 1 with bf16 dw1 and dw2");
        for (int s = 0; s < W; s++)
            b.args[s].accumulate = 1;
        BAD(0, (void)0, SHAPE, "accumulate 1 on every rank with bf16 dw");
        for (int s = 0; s < W; s++)
            b.args[s].accumulate = 0;
    }
    if (mode == DW_ACC) {
        BAD(last, r_->dw1.dtype = COMET_DTYPE_BF16, SHAPE, "accumulate with bf16 dw1 (fp32 dw2)");
        BAD(last, r_->dw2.dtype = COMET_DTYPE_BF16, SHAPE, "accumulate with bf16 dw2 (fp32 dw1)");
    }
    /* routing (host memory: checked before anything is written) */
    int32_t *idx = b.p->topk_idx[last];
    const int32_t keep0 = idx[0], keep1 = idx[1], keepl = idx[T * K - 1];
    idx[T * K - 1] = (int32_t)cfg.num_experts;
    BAD(last, (void)0, ROUT, "expert id E");
    idx[T * K - 1] = -1;
    BAD(last, (void)0, ROUT, "expert id -1");
    idx[T * K - 1] = keepl;
    idx[1] = idx[0];
    BAD(last, (void)0, ROUT, "an expert repeated in a row");
    idx[0] = keep0, idx[1] = keep1;
    /* the call itself */
    bad_call(&b, &cfg, W, NULL, (bad_t){"args NULL", ARG});
    bad_call(&b, &cfg, 2, b.args, (bad_t){"world_size 2 for TP*EP 4", ARG});
    bad_call(&b, NULL, W, b.args, (bad_t){"config NULL", ARG});
    comet_layer_config_t bad_cfg = cfg;
    bad_cfg.struct_size = 8;
    bad_call(&b, &bad_cfg, W, b.args, (bad_t){"config struct_size 8", ARG});
#undef BAD
    /* still valid afterwards */
    bwd_poison(&b);
    st = comet_reference_backward(&cfg, W, b.args);
    CHECK(st == COMET_SUCCESS, "valid input after the invalid ones: %s", comet_status_string(st));
    free(a);
    bwd_free(&b);
}

/* dw1 and dw2 of different dtypes in one call (the contract lets each be
 * bf16 or fp32), and the dtypes against each other: the reference sums each
 * weight gradient in one fp32 order whatever the output, so the bf16 output
 * is the fp32 one rounded (bitwise), and accumulating into zeros gives the
 * fp32 output (by value). */
static void check_dtypes(void) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 20, cfg.ffn = 12, cfg.num_experts = 4, cfg.topk = 2, cfg.tp = 2, cfg.ep = 2;
    cfg.max_tokens_per_rank = 6, cfg.tile_m = 4;
    const int W = 4;
    const int64_t tokens[4] = {6, 1, 0, 4};
    comet_routing_opts_t ro = {0.4, 1, 31 + 1000 * TEST_SEED};
    bwd_t b;
    if (!bwd_create(&b, &cfg, W, tokens, &ro, DW_FP32, 9)) return;
    const int64_t n1 = n_dw1(&b), n2 = n_dw2(&b);
    uint16_t *h1[4], *h2[4];
    float *f1[4], *f2[4];
    comet_backward_args_t a[4];
    comet_status_t st[3];
    for (int s = 0; s < W; s++) {
        h1[s] = malloc((size_t)n1 * 2), h2[s] = malloc((size_t)n2 * 2);
        f1[s] = malloc((size_t)n1 * 4), f2[s] = malloc((size_t)n2 * 4);
    }
    for (int call = 0; call < 3; call++) {
        memcpy(a, b.args, sizeof a);
        for (int s = 0; s < W; s++) {
            if (call == 0) { /* dw1 fp32, dw2 bf16 */
                a[s].dw2 = comet_tensor_3d(h2[s], COMET_DTYPE_BF16, b.m.EL, b.m.H, b.m.FL);
            } else if (call == 1) { /* dw1 bf16, dw2 fp32 */
                a[s].dw1 = comet_tensor_3d(h1[s], COMET_DTYPE_BF16, b.m.EL, b.w1_rows, b.m.H);
            } else { /* both fp32, accumulated into zeros */
                a[s].accumulate = 1;
                memset(b.dw1[s], 0, (size_t)n1 * 4), memset(b.dw2[s], 0, (size_t)n2 * 4);
            }
        }
        st[call] = comet_reference_backward(&cfg, W, a);
        for (int s = 0; s < W; s++) {
            if (call == 0) memcpy(f1[s], b.dw1[s], (size_t)n1 * 4);
            if (call == 1) memcpy(f2[s], b.dw2[s], (size_t)n2 * 4);
        }
    }
    CHECK(st[0] == COMET_SUCCESS && st[1] == COMET_SUCCESS && st[2] == COMET_SUCCESS,
          "mixed dtypes / accumulate into zeros: %s %s %s (%s)", comet_status_string(st[0]), comet_status_string(st[1]),
          comet_status_string(st[2]), comet_last_error());
    int64_t round_bad = 0, acc_bad = 0;
    for (int s = 0; s < W; s++) {
        for (int64_t i = 0; i < n1; i++)
            round_bad += comet_f32_to_bf16(f1[s][i]) != h1[s][i], acc_bad += ((float *)b.dw1[s])[i] != f1[s][i];
        for (int64_t i = 0; i < n2; i++)
            round_bad += comet_f32_to_bf16(f2[s][i]) != h2[s][i], acc_bad += ((float *)b.dw2[s])[i] != f2[s][i];
    }
    CHECK(round_bad == 0, "bf16 dw is not the fp32 dw rounded: %lld elements", (long long)round_bad);
    CHECK(acc_bad == 0, "dw accumulated into zeros is not the fp32 dw: %lld elements", (long long)acc_bad);
    for (int s = 0; s < W; s++)
        free(h1[s]), free(h2[s]), free(f1[s]), free(f2[s]);
    bwd_free(&b);
}

int main(void) {
    const clock_t t0 = clock();
    check_act_derivatives();
    check_finite_differences(1, 1, COMET_ACT_SILU_GATED, 2);
    check_finite_differences(2, 2, COMET_ACT_SILU_GATED, 3);
    check_finite_differences(2, 1, COMET_ACT_GELU, 1);
    check_finite_differences(1, 2, COMET_ACT_GELU, 4);

    const int layouts[][2] = {{1, 1}, {1, 2}, {2, 1}, {1, 4}, {2, 2}, {4, 1}};
    const int64_t Es[] = {4, 8, 16};
    const int64_t Ts[][4] = {{6, 0, 1, 9}, {1, 7, 4, 0}, {0, 5, 8, 1}, {9, 1, 0, 3}};
    stats_t total;
    memset(&total, 0, sizeof total);
    int n_cases = 0;
    for (int li = 0; li < 6; li++)
        for (int act = 0; act < 2; act++)
            for (int mode = 0; mode < 3; mode++) {
                const int i = li * 6 + act * 3 + mode;
                case_t c;
                memset(&c, 0, sizeof c);
                c.tp = layouts[li][0], c.ep = layouts[li][1], c.act = (comet_activation_t)act, c.mode = mode;
                c.E = Es[i % 3];
                c.K = 1 + (i + li) % 4;
                c.H = 36 + 4 * (i % 2), c.F = 16 + 8 * (i % 3 == 1);
                memcpy(c.T, Ts[i % 4], sizeof c.T);
                if (c.tp * c.ep == 1) c.T[0] = i % 2 ? 7 : 1;
                c.skew = 0.6, c.zero_experts = c.E > c.K ? 1 : 0;
                run_case(&c, &total, n_cases >= 24 && n_cases <= 26);
                n_cases++;
            }
    /* topk = E: every token on every rank */
    const case_t all[] = {
        {2, 2, COMET_ACT_SILU_GATED, DW_FP32, 4, 4, 32, 16, {3, 1, 0, 4}, 0.0, 0},
        {1, 4, COMET_ACT_GELU, DW_ACC, 4, 4, 24, 8, {2, 0, 5, 1}, 0.0, 0},
        {1, 4, COMET_ACT_SILU_GATED, DW_BF16, 16, 4, 32, 16, {8, 2, 1, 0}, 1.5, 3},
        {1, 1, COMET_ACT_GELU, DW_ACC, 8, 2, 24, 16, {0, 0, 0, 0}, 0.3, 1}, /* no tokens at all */
        {1, 1, COMET_ACT_SILU_GATED, DW_BF16, 4, 4, 24, 8, {0, 0, 0, 0}, 0.0, 0},
    };
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++, n_cases++)
        run_case(&all[i], &total, 0);

    for (int o = 0; o < O_N; o++) {
        double ca[4], cb[4];
        const double nz = (double)(total.elements[o] - total.zero_rows[o]);
        for (int i = 0; i < 4; i++) {
            ca[i] = 100.0 * (double)total.caught_a[o][i] / nz;
            cb[i] = 100.0 * (double)total.caught_b[o][i] / nz;
        }
        printf(
            "test_backward: %s over %d cases: %lld elements, worst |err|/bound A %.3f, %.1f%% intervals of bound B a "
            "single value; a perturbation by 1, 4, 16, 64 bf16 ulps of its scale surely caught: bound A "
            "%.1f%% %.1f%% %.1f%% %.1f%%, bound B %.1f%% %.1f%% %.1f%% %.1f%%\n",
            o_name[o], n_cases, (long long)total.elements[o], total.worst_a[o],
            100.0 * (double)total.point[o] / (double)total.elements[o], ca[0], ca[1], ca[2], ca[3], cb[0], cb[1], cb[2],
            cb[3]);
        CHECK(ca[2] >= 95.0 && cb[0] >= 90.0,
              "%s: the bounds lost their edge: a 16-ulp perturbation caught by bound A "
              "for %.1f%%, a 1-ulp one by bound B for %.1f%%",
              o_name[o], ca[2], cb[0]);
    }
    check_dtypes();
    for (int mode = 0; mode < 3; mode++)
        check_invalid(mode);
    printf("test_backward: %.2f s of CPU\n", (double)(clock() - t0) / CLOCKS_PER_SEC);
    return check_summary("test_backward");
}
