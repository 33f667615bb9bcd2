/*
 * harness/workload.c - test and benchmark harness, not part of the library
 * (libcomet_harness.a): model presets, routing generators, random inputs,
 * the multi-rank problem runner and the tune table's writer (see
 * workload.h). It uses the library's private headers under src/
 * (validation, numerics, the reference, the tuner), so it links against the
 * static libcomet.a.
 */
#include "workload.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../src/core/numerics.h"
#include "../src/core/runtime.h"
#include "../src/core/status.h"
#include "../src/core/validate.h"
#include "../src/cpu/reference.h"
#include "../src/tuner/tuner.h"
#include "gradslack.h"

#ifdef COMET_WITH_CUDA
#include <cuda_runtime.h>
#endif

const comet_model_t comet_models[] = {
    {"mixtral-8x7b", 4096, 14336, 8, 2},
    {"qwen2-moe", 2048, 1408, 64, 4},
    {"phi-3.5-moe", 4096, 6400, 16, 2},
    {"deepseek-v3", 7168, 2048, 256, 8},
};
const int comet_num_models = (int)(sizeof comet_models / sizeof comet_models[0]);

const comet_model_t *comet_model_find(const char *name) {
    for (int i = 0; i < comet_num_models; i++)
        if (strcmp(comet_models[i].name, name) == 0) return &comet_models[i];
    return NULL;
}

/* ---- random numbers ------------------------------------------------------- */

uint64_t comet_rng_next(comet_rng_t *r) {
    uint64_t z = (r->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double comet_rng_uniform(comet_rng_t *r) { return (double)(comet_rng_next(r) >> 11) * 0x1.0p-53; }

double comet_rng_normal(comet_rng_t *r) {
    double u = comet_rng_uniform(r), v = comet_rng_uniform(r);
    return sqrt(-2.0 * log(1.0 - u)) * cos(6.283185307179586 * v);
}

/* ---- host work in parallel ------------------------------------------------
 * fn(arg, part, parts) on `parts` threads (the online cores, at most 64; one
 * when n is small or a thread cannot start: then the caller runs the rest).
 * Each part's result must not depend on the part count. */
typedef void (*part_fn)(void *arg, int part, int parts);
typedef struct {
    part_fn fn;
    void *arg;
    int part, parts;
} part_job_t;

static void *part_main(void *v) {
    part_job_t *j = v;
    j->fn(j->arg, j->part, j->parts);
    return NULL;
}

/* fn on exactly `parts` parts (1..64). */
static void run_parts_on(part_fn fn, void *arg, int parts) {
    pthread_t th[64];
    part_job_t jobs[64];
    int started = 0;
    for (int i = 1; i < parts; i++) {
        jobs[i] = (part_job_t){fn, arg, i, parts};
        if (pthread_create(&th[i], NULL, part_main, &jobs[i])) break;
        started = i;
    }
    for (int i = started + 1; i < parts; i++) fn(arg, i, parts); /* parts whose thread did not start */
    fn(arg, 0, parts);
    for (int i = 1; i <= started; i++) pthread_join(th[i], NULL);
}

static int online_parts(int64_t n) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    return n < (1 << 16) || cores < 2 ? 1 : cores > 64 ? 64 : (int)cores;
}

void comet_parts_run(part_fn fn, void *arg, int64_t work) {
    run_parts_on(fn, arg, online_parts(work));
}

/* Uniform bf16 in [-scale, scale): the values of drawing them one by one from
 * r (splitmix64's state advances by a constant per draw, so a part starts at
 * its own offset), drawn in parallel. */
typedef struct {
    uint16_t *a;
    int64_t n;
    double scale;
    uint64_t state;
} fill_t;

static void fill_part(void *v, int part, int parts) {
    const fill_t *f = v;
    const int64_t i0 = f->n * part / parts, i1 = f->n * (part + 1) / parts;
    comet_rng_t r = {f->state + (uint64_t)i0 * 0x9e3779b97f4a7c15ull};
    for (int64_t i = i0; i < i1; i++) f->a[i] = comet_f32_to_bf16((float)((2.0 * comet_rng_uniform(&r) - 1.0) * f->scale));
}

static void fill_bf16(uint16_t *a, int64_t n, double scale, comet_rng_t *r) {
    fill_t f = {a, n, scale, r->state};
    comet_parts_run(fill_part, &f, n);
    r->state += (uint64_t)n * 0x9e3779b97f4a7c15ull;
}

/* ---- routing ---------------------------------------------------------------
 * Expert popularity: 1 + skew * N(0,1), floored at 0.01, and 0 for the
 * zero_experts chosen at random. Each token draws topk distinct experts in
 * proportion to popularity; its weights are a softmax of random logits. */
comet_status_t comet_routing_draw(int64_t e_num, int64_t topk, int world_size, const int64_t *tokens,
                                  int32_t *const *topk_idx, float *const *topk_w, const comet_routing_opts_t *ro,
                                  comet_rng_t *rng) {
    if (ro->skew < 0) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "routing skew %g < 0", ro->skew);
    if (ro->zero_experts < 0 || e_num - ro->zero_experts < topk)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT,
                          "routing: %lld empty experts leave fewer than topk=%lld of %lld experts",
                          (long long)ro->zero_experts, (long long)topk, (long long)e_num);
    double *pop = malloc(sizeof(double) * (size_t)e_num);
    double *mass = malloc(sizeof(double) * (size_t)e_num);
    double *logit = malloc(sizeof(double) * (size_t)topk);
    if (!pop || !mass || !logit) {
        free(pop), free(mass), free(logit);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "routing: no memory");
    }
    for (int64_t e = 0; e < e_num; e++) {
        double v = 1.0 + ro->skew * comet_rng_normal(rng);
        pop[e] = v < 0.01 ? 0.01 : v;
    }
    for (int64_t z = 0; z < ro->zero_experts;) { /* distinct random experts */
        int64_t e = (int64_t)(comet_rng_next(rng) % (uint64_t)e_num);
        if (pop[e] > 0) pop[e] = 0, z++;
    }
    for (int s = 0; s < world_size; s++) {
        for (int64_t t = 0; t < tokens[s]; t++) {
            int32_t *idx = topk_idx[s] + t * topk;
            float *w = topk_w[s] + t * topk;
            double left = 0, norm = 0;
            for (int64_t e = 0; e < e_num; e++) left += (mass[e] = pop[e]);
            for (int64_t j = 0; j < topk; j++) {
                double u = comet_rng_uniform(rng) * left, acc = 0;
                int64_t pick = -1;
                for (int64_t e = 0; e < e_num; e++) {
                    if (mass[e] <= 0) continue;
                    pick = e;
                    if ((acc += mass[e]) > u) break;
                }
                left -= mass[pick];
                mass[pick] = 0;
                idx[j] = (int32_t)pick;
                logit[j] = exp(comet_rng_normal(rng));
                norm += logit[j];
            }
            for (int64_t j = 0; j < topk; j++) w[j] = (float)(logit[j] / norm);
        }
    }
    free(pop), free(mass), free(logit);
    return COMET_SUCCESS;
}

static comet_status_t draw_routing(comet_problem_t *p, const comet_routing_opts_t *ro, comet_rng_t *rng) {
    return comet_routing_draw(p->cfg.num_experts, p->cfg.topk, p->world_size, p->tokens, p->topk_idx, p->topk_w, ro,
                              rng);
}

/* ---- problems --------------------------------------------------------------- */

void comet_problem_slice_weights(comet_problem_t *p) {
    const comet_layer_config_t *cfg = &p->cfg;
    const int64_t hd = cfg->hidden, f = cfg->ffn, el = cfg->num_experts / cfg->ep, fl = f / cfg->tp;
    const int64_t rows_full = cfg->activation == COMET_ACT_SILU_GATED ? 2 * f : f;
    const int64_t w1_rows = cfg->activation == COMET_ACT_SILU_GATED ? 2 * fl : fl;
    for (int s = 0; s < p->world_size; s++) { /* rank s = (ep, tp) */
        int ep = s / cfg->tp, tp = s % cfg->tp;
        for (int64_t le = 0; le < el; le++) {
            int64_t e = ep * el + le;
            for (int64_t n = 0; n < w1_rows; n++) {
                /* gate rows then up rows, each the tp-th slice of F */
                int64_t src = n < fl ? tp * fl + n : f + tp * fl + (n - fl);
                memcpy(p->w1[s] + (le * w1_rows + n) * hd, p->w1_full + (e * rows_full + src) * hd, (size_t)hd * 2);
            }
            for (int64_t c = 0; c < hd; c++)
                memcpy(p->w2[s] + (le * hd + c) * fl, p->w2_full + (e * hd + c) * f + tp * fl, (size_t)fl * 2);
        }
    }
}

void comet_problem_destroy(comet_problem_t *p) {
    if (!p) return;
    for (int s = 0; p->x && s < p->world_size; s++) {
        free(p->x[s]), free(p->w1[s]), free(p->w2[s]), free(p->topk_idx[s]), free(p->topk_w[s]);
        free(p->y[s]), free(p->y_ref[s]);
    }
    free(p->x), free(p->w1), free(p->w2), free(p->topk_idx), free(p->topk_w), free(p->y), free(p->y_ref);
    free(p->w1_full), free(p->w2_full), free(p->tokens), free(p->args), free(p->ref_args);
    free(p);
}

static void *alloc_n(int64_t n, size_t size) { return malloc((size_t)(n > 0 ? n : 1) * size); }

comet_status_t comet_problem_create(comet_problem_t **out, const comet_layer_config_t *cfg, int world_size,
                                    const int64_t *tokens, const comet_routing_opts_t *ro) {
    *out = NULL;
    comet_dims_t d;
    COMET_TRY(comet_dims_from_config(cfg, world_size, 0, &d));
    comet_problem_t *p = calloc(1, sizeof *p);
    if (!p) return comet_fail(COMET_ERR_OUT_OF_MEMORY, "problem: no memory");
    p->cfg = *cfg;
    p->world_size = world_size;
    const int w = world_size;
    const int64_t hd = d.hidden, f = cfg->ffn, e_num = d.num_experts, el = d.experts_local, fl = d.ffn_local;
    const int64_t rows_full = cfg->activation == COMET_ACT_SILU_GATED ? 2 * f : f;
    p->tokens = calloc((size_t)w, sizeof(int64_t));
    p->x = calloc((size_t)w, sizeof(void *)), p->w1 = calloc((size_t)w, sizeof(void *));
    p->w2 = calloc((size_t)w, sizeof(void *)), p->topk_idx = calloc((size_t)w, sizeof(void *));
    p->topk_w = calloc((size_t)w, sizeof(void *)), p->y = calloc((size_t)w, sizeof(void *));
    p->y_ref = calloc((size_t)w, sizeof(void *));
    p->args = calloc((size_t)w, sizeof(comet_forward_args_t));
    p->ref_args = calloc((size_t)w, sizeof(comet_forward_args_t));
    p->w1_full = alloc_n(e_num * rows_full * hd, 2);
    p->w2_full = alloc_n(e_num * hd * f, 2);
    int ok = p->tokens && p->x && p->w1 && p->w2 && p->topk_idx && p->topk_w && p->y && p->y_ref && p->args &&
             p->ref_args && p->w1_full && p->w2_full;
    for (int s = 0; ok && s < w; s++) {
        int64_t t = tokens[s];
        if (t < 0 || t > cfg->max_tokens_per_rank) {
            comet_problem_destroy(p);
            return comet_fail(COMET_ERR_INVALID_ARGUMENT, "problem: rank %d has %lld tokens, max %lld", s,
                              (long long)t, (long long)cfg->max_tokens_per_rank);
        }
        p->tokens[s] = t;
        p->x[s] = alloc_n(t * hd, 2), p->y[s] = alloc_n(t * hd, 2), p->y_ref[s] = alloc_n(t * hd, 2);
        p->topk_idx[s] = alloc_n(t * d.topk, 4), p->topk_w[s] = alloc_n(t * d.topk, 4);
        p->w1[s] = alloc_n(el * d.w1_rows * hd, 2), p->w2[s] = alloc_n(el * hd * fl, 2);
        ok = p->x[s] && p->y[s] && p->y_ref[s] && p->topk_idx[s] && p->topk_w[s] && p->w1[s] && p->w2[s];
    }
    if (!ok) {
        comet_problem_destroy(p);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "problem: no memory");
    }

    comet_rng_t rng = {ro->seed * 0x2545f4914f6cdd1dull + 1};
    fill_bf16(p->w1_full, e_num * rows_full * hd, 1.0 / sqrt((double)hd), &rng);
    fill_bf16(p->w2_full, e_num * hd * f, 1.0 / sqrt((double)f), &rng);
    comet_problem_slice_weights(p);
    for (int s = 0; s < w; s++) {
        comet_forward_args_t a = COMET_FORWARD_ARGS_INIT;
        int64_t t = p->tokens[s];
        a.x = comet_tensor_2d(p->x[s], COMET_DTYPE_BF16, t, hd);
        a.topk_idx = comet_tensor_2d(p->topk_idx[s], COMET_DTYPE_INT32, t, d.topk);
        a.topk_w = comet_tensor_2d(p->topk_w[s], COMET_DTYPE_FP32, t, d.topk);
        a.w1 = comet_tensor_3d(p->w1[s], COMET_DTYPE_BF16, el, d.w1_rows, hd);
        a.w2 = comet_tensor_3d(p->w2[s], COMET_DTYPE_BF16, el, hd, fl);
        a.y = comet_tensor_2d(p->y[s], COMET_DTYPE_BF16, t, hd);
        p->args[s] = a;
        a.y.data = p->y_ref[s];
        p->ref_args[s] = a;
    }
    comet_status_t st = comet_problem_redraw(p, ro);
    if (st != COMET_SUCCESS) {
        comet_problem_destroy(p);
        return st;
    }
    *out = p;
    return COMET_SUCCESS;
}

comet_status_t comet_problem_redraw(comet_problem_t *p, const comet_routing_opts_t *ro) {
    comet_rng_t rng = {ro->seed * 0x9e3779b97f4a7c15ull + 7};
    for (int s = 0; s < p->world_size; s++) fill_bf16(p->x[s], p->tokens[s] * p->cfg.hidden, 1.0, &rng);
    return draw_routing(p, ro, &rng);
}

void comet_problem_poison(comet_problem_t *p) {
    for (int s = 0; s < p->world_size; s++) {
        memset(p->y[s], 0xff, (size_t)(p->tokens[s] * p->cfg.hidden) * 2);
        memset(p->y_ref[s], 0xff, (size_t)(p->tokens[s] * p->cfg.hidden) * 2);
    }
}

int64_t comet_problem_count_poison(const comet_problem_t *p) {
    int64_t n = 0;
    for (int s = 0; s < p->world_size; s++)
        for (int64_t i = 0; i < p->tokens[s] * p->cfg.hidden; i++) n += p->y[s][i] == 0xffff;
    return n;
}

int64_t comet_problem_count_mismatch(const comet_problem_t *p) {
    int64_t bad = 0;
    for (int s = 0; s < p->world_size; s++)
        for (int64_t i = 0; i < p->tokens[s] * p->cfg.hidden; i++) bad += p->y[s][i] != p->y_ref[s][i];
    return bad;
}

/* The check's work: sampled (rank, token) pairs; each part its own result. */
typedef struct {
    const comet_problem_t *p;
    comet_dims_t d;
    int64_t n_pairs, *pairs; /* rank * 2^40 + token */
    comet_check_t part_out[64];
    int part_failed[64];
} check_t;

static void check_part(void *v, int part, int parts) {
    check_t *k = v;
    const comet_problem_t *p = k->p;
    const int64_t hd = k->d.hidden;
    comet_check_t *out = &k->part_out[part];
    comet_reference_scratch_t sc;
    uint16_t *want = malloc(sizeof(uint16_t) * (size_t)hd);
    if (!want || comet_reference_scratch_init(&k->d, &sc) != COMET_SUCCESS) {
        free(want);
        k->part_failed[part] = 1;
        return;
    }
    for (int64_t i = part; i < k->n_pairs; i += parts) {
        const int s = (int)(k->pairs[i] >> 40);
        const int64_t t = k->pairs[i] & (((int64_t)1 << 40) - 1);
        comet_reference_token(&p->cfg, p->world_size, p->args, s, t, &sc, want);
        double ss = 0;
        for (int64_t c = 0; c < hd; c++) ss += (double)comet_bf16_to_f32(want[c]) * comet_bf16_to_f32(want[c]);
        double rms = sqrt(ss / (double)hd) + 1e-30;
        for (int64_t c = 0; c < hd; c++) {
            double g = comet_bf16_to_f32(p->y[s][t * hd + c]), r = comet_bf16_to_f32(want[c]);
            double ulp = r != 0 && !isnan(r) ? ldexp(1.0, ilogb(r) - 7) : 0; /* ilogb(NaN) is INT_MIN */
            double err = fabs(g - r);
            out->differ += p->y[s][t * hd + c] != want[c];
            /* 4 ulps of y, 1% of the row's rms, and two flipped roundings of every o
             * row it sums (near cancellation those dominate: they scale with o, not y) */
            out->wrong += !(err <= 4 * ulp + 0.01 * rms + 2.0 * sc.o_ulps[c]); /* NaN is wrong */
            if (!(err / rms <= out->worst)) out->worst = isnan(err) ? INFINITY : err / rms;
            out->elements++;
        }
    }
    free(want);
    comet_reference_scratch_free(&sc);
}

comet_status_t comet_problem_check(const comet_problem_t *p, int64_t sample, int only_rank, comet_check_t *out) {
    memset(out, 0, sizeof *out);
    check_t *k = calloc(1, sizeof *k);
    if (!k) return comet_fail(COMET_ERR_OUT_OF_MEMORY, "check: no memory");
    k->p = p;
    comet_status_t st = comet_dims_from_config(&p->cfg, p->world_size, 0, &k->d);
    int64_t total = 0;
    for (int s = 0; s < p->world_size; s++) total += p->tokens[s];
    k->pairs = malloc(sizeof(int64_t) * (size_t)(total + 1));
    if (st == COMET_SUCCESS && !k->pairs) st = comet_fail(COMET_ERR_OUT_OF_MEMORY, "check: no memory");
    for (int s = 0; st == COMET_SUCCESS && s < p->world_size; s++) {
        if (only_rank >= 0 && s != only_rank) continue;
        const int64_t t_num = p->tokens[s], n = sample <= 0 || sample >= t_num ? t_num : sample;
        for (int64_t i = 0; i < n; i++)
            k->pairs[k->n_pairs++] = ((int64_t)s << 40) | (n == t_num ? i : (n == 1 ? 0 : i * (t_num - 1) / (n - 1)));
    }
    if (st == COMET_SUCCESS) comet_parts_run(check_part, k, k->n_pairs * k->d.hidden * k->d.topk * k->d.ffn_local / 256);
    for (int i = 0; st == COMET_SUCCESS && i < 64; i++) {
        if (k->part_failed[i]) st = comet_fail(COMET_ERR_OUT_OF_MEMORY, "check: no memory");
        out->elements += k->part_out[i].elements, out->differ += k->part_out[i].differ;
        out->wrong += k->part_out[i].wrong;
        if (!(k->part_out[i].worst <= out->worst)) out->worst = k->part_out[i].worst; /* NaN-safe max */
    }
    free(k->pairs);
    free(k);
    return st;
}

int64_t comet_problem_link_bytes(const comet_problem_t *p, comet_backend_t backend) {
    const int64_t hd = p->cfg.hidden, k = p->cfg.topk, el = p->cfg.num_experts / p->cfg.ep;
    const int tp = p->cfg.tp, ep = p->cfg.ep, cuda = backend == COMET_BACKEND_CUDA;
    int64_t bytes = 0;
    char *used = calloc((size_t)ep, 1);
    if (!used) return -1;
    for (int s = 0; s < p->world_size; s++)
        for (int64_t t = 0; t < p->tokens[s]; t++) {
            memset(used, 0, (size_t)ep);
            for (int64_t j = 0; j < k; j++) {
                int g = (int)(p->topk_idx[s][t * k + j] / el);
                used[g] = 1;
                /* every TP rank of group g needs this slot: the CPU engine pulls the row per
                 * slot; on CUDA the slot's output row crosses back to s from each of them */
                for (int q = g * tp; q < (g + 1) * tp; q++) bytes += q != s ? hd * 2 : 0;
            }
            for (int g = 0; g < ep; g++) /* per used group and rank of it: CPU the partial back to s (fp32),
                                          * CUDA the token's row, pulled once for all its slots there */
                for (int q = g * tp; used[g] && q < (g + 1) * tp; q++) bytes += q != s ? hd * (cuda ? 2 : 4) : 0;
        }
    free(used);
    return bytes;
}

/* ---- running every rank ------------------------------------------------------ */

/* One agreement among the rank threads of a run (the graph capture): each
 * arrives with ok or not; all learn whether every one was ok. The runner
 * lowers `expected` for threads that never started. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int expected, arrived, failed;
} agree_t;

#ifdef COMET_WITH_CUDA /* only the GPU runner captures graphs */
static int agree(agree_t *a, int ok) {
    pthread_mutex_lock(&a->mu);
    a->failed |= !ok;
    a->arrived++;
    pthread_cond_broadcast(&a->cv);
    while (a->arrived < a->expected) pthread_cond_wait(&a->cv, &a->mu);
    const int all = !a->failed;
    pthread_mutex_unlock(&a->mu);
    return all;
}
#endif

typedef struct {
    comet_problem_t *p;
    comet_world_t *world;
    comet_run_t *run;
    int rank;
    double *ms;     /* [repeats] this rank's time per call */
    agree_t *agree; /* shared by the run's rank threads */
    int agreed;     /* this rank has arrived at agree (graph runs: exactly once, on every path) */
    int warmup;     /* the untimed calls before the timed ones */
    int marks;      /* this rank calls run->timed (the first this process runs) */
    int timing;     /* run->timed(ctx, 0) was called, (ctx, 1) not yet */
    double *ms_f, *ms_b;      /* train: [repeats] this rank's forward and backward per step */
    struct train_ctx *train;  /* train: the dy, the gradient check's sample and reference */
    double host_ms;           /* train, pipeline: this rank's host time to enqueue a timed step (mean) */
} rank_job_t;

/* run->timed around the timed calls (rank_job_t.marks): before call i when it is the first timed one, and
 * at the end (i < 0) if it began. */
static void mark_timed(rank_job_t *job, int i) {
    comet_run_t *run = job->run;
    if (!run->timed || !job->marks) return;
    if (i == job->warmup && !job->timing) run->timed(run->timed_ctx, 0), job->timing = 1;
    if (i < 0 && job->timing) run->timed(run->timed_ctx, 1), job->timing = 0;
}

/* run->progress before call i (the rank that calls run->timed) and, with i == repeats, after the last. */
static void note_progress(rank_job_t *job, int i) {
    comet_run_t *run = job->run;
    if (run->progress && job->marks) run->progress(run->progress_ctx, i, run->repeats);
}

/* A tensor's elements. */
static size_t tensor_elems(const comet_tensor_t *ts) {
    size_t n = 1;
    for (int dim = 0; dim < ts->ndim; dim++) n *= (size_t)ts->shape[dim];
    return n;
}

static double wall_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* compare_repeats: keep call 0's y of this rank (host copy), count later
 * calls that differ. */
static void compare_call(rank_job_t *job, int call, const uint16_t *y, uint16_t **first) {
    const size_t bytes = (size_t)(job->p->tokens[job->rank] * job->p->cfg.hidden) * 2;
    if (call == 0) {
        *first = malloc(bytes ? bytes : 1);
        if (*first) memcpy(*first, y, bytes);
    }
    if (job->rank < 64 && (!*first || memcmp(*first, y, bytes) != 0)) job->run->repeats_differ[job->rank]++;
}

/* With run->interleave, the disable bits of call i (comet_run_t), and the
 * ms_side slot of those bits. */
#define SIDES 4
static int interleave_side(int i) {
    static const int side[SIDES] = {COMET_DISABLE_COMM, COMET_DISABLE_GEMM, COMET_DISABLE_COMM | COMET_DISABLE_GEMM, 0};
    return side[i % SIDES];
}
static int side_slot(int i) {
    static const int slot[SIDES] = {0, 1, 3, 2};
    return slot[i % SIDES];
}

/* Before calls that leave one side out (run->disable): one whole forward,
 * so that those calls work on real gathered rows and activations instead of
 * fresh buffers (zeros: on a GPU the tensor cores then draw less power and
 * run faster: "GEMM only" read 828 TFLOP/s for Mixtral). Every rank takes
 * part; the caller poisons y again. */
static comet_status_t full_forward_first(comet_layer_t *layer, comet_forward_args_t *a) {
    const int keep = a->disable;
    a->disable = 0;
    comet_status_t st = comet_layer_forward(layer, a);
    if (st == COMET_SUCCESS) st = comet_layer_sync(layer);
    a->disable = keep;
    return st;
}


/* ---- the backward's reference on many threads ------------------------------
 * comet_reference_backward's items (src/cpu/reference.h) spread over
 * threads, round robin; each has its own scratch (one expert's fp32 dW1 and
 * dW2 sums: the automatic count is held to 8 GiB of them). */
typedef struct {
    comet_reference_backward_t *rb;
    int world_size;
    int failed[64];
} ref_bwd_t;

static void ref_transpose_part(void *v, int part, int parts) {
    ref_bwd_t *k = v;
    const int64_t el = comet_reference_backward_experts_local(k->rb);
    for (int64_t i = part; i < k->world_size * el; i += parts)
        comet_reference_backward_transpose(k->rb, (int)(i / el), i % el);
}

static void ref_bwd_part(void *v, int part, int parts) {
    ref_bwd_t *k = v;
    const int w = k->world_size;
    const int64_t el = comet_reference_backward_experts_local(k->rb), stride = parts;
    comet_reference_backward_scratch_t *sc;
    if (comet_reference_backward_scratch_create(k->rb, &sc) != COMET_SUCCESS) {
        k->failed[part] = 1;
        return;
    }
    int64_t i = 0;
    for (int s = 0; s < w; s++)
        for (int64_t t = 0; t < comet_reference_backward_tokens(k->rb, s); t++, i++)
            if (i % stride == part) comet_reference_backward_token(k->rb, sc, s, t);
    for (int q = 0; q < w; q++)
        for (int64_t e = 0; e < el; e++, i++)
            if (i % stride == part) comet_reference_backward_expert(k->rb, sc, q, e);
    comet_reference_backward_scratch_free(sc);
}

comet_status_t comet_reference_backward_parallel(const comet_layer_config_t *cfg, int world_size,
                                                 const comet_backward_args_t *args, int threads) {
    comet_reference_backward_t *rb;
    COMET_TRY(comet_reference_backward_begin(&rb, cfg, world_size, args));
    ref_bwd_t k;
    memset(&k, 0, sizeof k);
    k.rb = rb, k.world_size = world_size;
    if (threads <= 0) {
        const int64_t hd = cfg->hidden, fl = cfg->ffn / cfg->tp;
        const int64_t scratch = (int64_t)sizeof(float) * hd * fl * (cfg->activation == COMET_ACT_SILU_GATED ? 3 : 2);
        int64_t items = world_size * comet_reference_backward_experts_local(rb), most = ((int64_t)8 << 30) / scratch;
        for (int s = 0; s < world_size; s++) items += comet_reference_backward_tokens(rb, s);
        threads = online_parts(items * hd * fl); /* ~the work: threads only where it is worth them */
        if (threads > most) threads = most > 1 ? (int)most : 1;
    }
    run_parts_on(ref_transpose_part, &k, threads > 64 ? 64 : threads);
    run_parts_on(ref_bwd_part, &k, threads > 64 ? 64 : threads);
    comet_reference_backward_end(rb);
    for (int i = 0; i < 64; i++)
        if (k.failed[i]) return comet_fail(COMET_ERR_OUT_OF_MEMORY, "reference backward: no memory for a thread's scratch");
    return COMET_SUCCESS;
}

/* ---- training steps (comet_run_t.train) ------------------------------------ */

/* What the steps of a run share: every rank's dy, and the gradient check's
 * sample (its tokens' inputs, dy rows and the reference's gradients), made
 * by the runner's thread before the rank threads start; each rank thread
 * compares its own gradients into out[rank]. */
typedef struct train_ctx {
    uint16_t *dy[64];                 /* (T, H) each rank's dy of the timed steps */
    int64_t n[64];                    /* sampled tokens of each rank */
    uint16_t *sx[64], *sdy[64];       /* (n, H) */
    int32_t *sidx[64];                /* (n, topk) */
    float *sw[64];
    uint16_t *rdx[64], *rdw1[64], *rdw2[64]; /* the reference's gradients of the sample */
    float *rdtw[64];
    comet_dw1_slack_t slack[64];      /* dW1's tolerance from the error model, each rank's */
    struct comet_train_check out[64];
} train_ctx_t;

static void train_ctx_free(train_ctx_t *c, int w) {
    if (!c) return;
    for (int s = 0; s < w; s++) {
        free(c->dy[s]), free(c->sx[s]), free(c->sdy[s]), free(c->sidx[s]), free(c->sw[s]);
        free(c->rdx[s]), free(c->rdw1[s]), free(c->rdw2[s]), free(c->rdtw[s]);
        comet_dw1_slack_free(&c->slack[s]);
    }
    free(c);
}

static float grad_val(const void *a, int64_t i, int fp32) {
    return fp32 ? ((const float *)a)[i] : comet_bf16_to_f32(((const uint16_t *)a)[i]);
}

/* Gradient k of the check (train_check's index): rows of n elements of got
 * against ref (bf16, or fp32), counted into *c; base: the flat index of
 * got[0] in the rank's tensor. An element is wrong when NaN or |got - ref|
 * > 8 bf16 ulps of |ref| + 2% of the rms of ref's row + for dW1 the error
 * model's slack (harness/gradslack.h: cancelling sums of g, u and G). */
static void grad_compare(struct comet_train_check *c, int k, const void *got, const void *ref, int64_t rows, int64_t n,
                         int fp32, int64_t base, const comet_dw1_slack_t *slack) {
    for (int64_t r = 0; r < rows; r++) {
        double ss = 0;
        for (int64_t i = 0; i < n; i++) {
            const double e = grad_val(ref, r * n + i, fp32);
            ss += e * e;
        }
        const double rms = sqrt(ss / (double)(n > 0 ? n : 1));
        const int64_t row = base / (n > 0 ? n : 1) + r; /* dW1: local expert row / w1_rows, row % w1_rows */
        for (int64_t i = 0; i < n; i++) {
            const float g = grad_val(got, r * n + i, fp32), e = grad_val(ref, r * n + i, fp32);
            const double err = fabs((double)g - (double)e);
            const double tol = comet_grad_rule(e, rms) +
                               (slack ? comet_dw1_slack(slack, row / slack->w1_rows, row % slack->w1_rows, i) : 0);
            c->elements[k]++;
            c->differ[k] += fp32 ? memcmp(&g, &e, 4) != 0
                                 : ((const uint16_t *)got)[r * n + i] != ((const uint16_t *)ref)[r * n + i];
            c->wrong[k] += !(err <= tol); /* NaN is wrong */
            if (rms > 0 && !(err / rms <= c->worst[k])) c->worst[k] = isnan(err) ? INFINITY : err / rms;
            if (!(err <= c->over[k] * tol))
                c->over[k] = isnan(err) ? INFINITY : err / tol, c->worst_at[k] = base + r * n + i, c->worst_tol[k] = tol;
        }
    }
}

/* The runner's part before the rank threads: every rank's dy, and with
 * run->train_sample the sampled tokens and comet_reference_backward over
 * them (every rank's: the reference needs them all, also where this
 * process runs one). */
static comet_status_t train_prepare(const comet_problem_t *p, const comet_run_t *run, train_ctx_t **out) {
    const int w = p->world_size;
    const int64_t hd = p->cfg.hidden, k = p->cfg.topk;
    train_ctx_t *c = calloc(1, sizeof *c);
    comet_backward_args_t *ref = calloc((size_t)w, sizeof *ref);
    comet_status_t st = c && ref ? COMET_SUCCESS : comet_fail(COMET_ERR_OUT_OF_MEMORY, "runner: no memory");
    for (int s = 0; st == COMET_SUCCESS && s < w; s++) {
        const int64_t t = p->tokens[s];
        comet_rng_t rng = {0x6772616473ull + 7919ull * (uint64_t)s}; /* "grads": dy, the same every run */
        c->dy[s] = alloc_n(t * hd, 2);
        if (!c->dy[s]) {
            st = comet_fail(COMET_ERR_OUT_OF_MEMORY, "runner: no memory for dy");
            break;
        }
        fill_bf16(c->dy[s], t * hd, 1.0, &rng);
        if (!run->train_sample) continue;
        const int64_t n = c->n[s] = run->train_sample < 0 || run->train_sample >= t ? t : run->train_sample;
        const comet_forward_args_t *fa = &p->args[s];
        const size_t n1 = tensor_elems(&fa->w1), n2 = tensor_elems(&fa->w2);
        c->sx[s] = alloc_n(n * hd, 2), c->sdy[s] = alloc_n(n * hd, 2), c->rdx[s] = alloc_n(n * hd, 2);
        c->sidx[s] = alloc_n(n * k, 4), c->sw[s] = alloc_n(n * k, 4), c->rdtw[s] = alloc_n(n * k, 4);
        c->rdw1[s] = alloc_n((int64_t)n1, 2), c->rdw2[s] = alloc_n((int64_t)n2, 2);
        if (!c->sx[s] || !c->sdy[s] || !c->rdx[s] || !c->sidx[s] || !c->sw[s] || !c->rdtw[s] || !c->rdw1[s] ||
            !c->rdw2[s]) {
            st = comet_fail(COMET_ERR_OUT_OF_MEMORY, "runner: no memory for the gradient check");
            break;
        }
        for (int64_t i = 0; i < n; i++) { /* evenly spaced, first and last included (comet_problem_check's) */
            const int64_t tok = n == t ? i : n == 1 ? 0 : i * (t - 1) / (n - 1);
            memcpy(c->sx[s] + i * hd, p->x[s] + tok * hd, (size_t)hd * 2);
            memcpy(c->sdy[s] + i * hd, c->dy[s] + tok * hd, (size_t)hd * 2);
            memcpy(c->sidx[s] + i * k, p->topk_idx[s] + tok * k, (size_t)k * 4);
            memcpy(c->sw[s] + i * k, p->topk_w[s] + tok * k, (size_t)k * 4);
        }
        comet_backward_args_t a = COMET_BACKWARD_ARGS_INIT;
        a.x = comet_tensor_2d(c->sx[s], COMET_DTYPE_BF16, n, hd);
        a.topk_idx = comet_tensor_2d(c->sidx[s], COMET_DTYPE_INT32, n, k);
        a.topk_w = comet_tensor_2d(c->sw[s], COMET_DTYPE_FP32, n, k);
        a.w1 = fa->w1, a.w2 = fa->w2;
        a.dy = comet_tensor_2d(c->sdy[s], COMET_DTYPE_BF16, n, hd);
        a.dx = comet_tensor_2d(c->rdx[s], COMET_DTYPE_BF16, n, hd);
        a.d_topk_w = comet_tensor_2d(c->rdtw[s], COMET_DTYPE_FP32, n, k);
        a.dw1 = fa->w1, a.dw1.data = c->rdw1[s];
        a.dw2 = fa->w2, a.dw2.data = c->rdw2[s];
        ref[s] = a;
    }
    if (st == COMET_SUCCESS && run->train_sample) st = comet_reference_backward_parallel(&p->cfg, w, ref, 0);
    for (int q = 0; st == COMET_SUCCESS && run->train_sample && q < w; q++)
        st = comet_dw1_slack_init(&c->slack[q], &p->cfg, w, ref, q);
    free(ref);
    if (st != COMET_SUCCESS) {
        train_ctx_free(c, w);
        c = NULL;
    }
    *out = c;
    return st;
}

/* A wrong weight gradient explained: the element of rank r's dw1 (g = 2)
 * or dw2 (g = 3) furthest past its tolerance (flat index `at` in the rank's
 * (E_local, rows, cols) tensor), printed with its value from the GPU (got), from the
 * reference, and from the contract's formula evaluated in float64 on the
 * sampled rows (the contract's bf16 roundings of gu, h, dH and w dy kept,
 * every sum in float64), with the rows that reach it. The float64 value
 * sides with whichever of the two is right. Gated activation only. */
static void grad_explain(const comet_problem_t *p, const train_ctx_t *c, int r, const comet_forward_args_t *a0, int g,
                         float got) {
    const int64_t at = c->out[r].worst_at[g];
    const comet_layer_config_t *cfg = &p->cfg;
    if (cfg->activation != COMET_ACT_SILU_GATED) return;
    const int64_t hd = cfg->hidden, k = cfg->topk, fl = cfg->ffn / cfg->tp, el = cfg->num_experts / cfg->ep;
    const int64_t rows = g == 2 ? 2 * fl : hd, cols = g == 2 ? hd : fl;
    const int64_t x = at / (rows * cols), row = at % (rows * cols) / cols, col = at % cols;
    const int64_t e = (int64_t)(r / cfg->tp) * el + x;      /* rank = ep * TP + tp */
    const int64_t jf = g == 2 ? row % fl : col;              /* the ffn column of the local slice */
    const int gate = g == 2 && row < fl;
    const uint16_t *w1 = (const uint16_t *)a0->w1.data + x * 2 * fl * hd, *w2 = (const uint16_t *)a0->w2.data + x * hd * fl;
    const uint16_t *ref = (g == 2 ? c->rdw1[r] : c->rdw2[r]);
    double sum = 0;
    int n_rows = 0;
    char list[512] = "";
    for (int s = 0; s < p->world_size; s++)
        for (int64_t t = 0; t < c->n[s]; t++)
            for (int64_t q = 0; q < k; q++) {
                if (c->sidx[s][t * k + q] != e) continue;
                const uint16_t *xt = c->sx[s] + t * hd, *dyt = c->sdy[s] + t * hd;
                const double w = c->sw[s][t * k + q];
                double gg = 0, uu = 0, G = 0;
                for (int64_t h = 0; h < hd; h++) {
                    const double xv = comet_bf16_to_f32(xt[h]);
                    gg += xv * comet_bf16_to_f32(w1[jf * hd + h]), uu += xv * comet_bf16_to_f32(w1[(fl + jf) * hd + h]);
                    G += (double)comet_bf16_to_f32(dyt[h]) * comet_bf16_to_f32(w2[h * fl + jf]);
                }
                double term;
                if (g == 2) { /* the activation's backward from gu's bf16 values */
                    gg = comet_bf16_round((float)gg), uu = comet_bf16_round((float)uu);
                    const double sg = 1.0 / (1.0 + exp(-gg)), dA = w * G;
                    const double dh = gate ? dA * uu * sg * (1 + gg * (1 - sg)) : dA * gg * sg;
                    term = comet_bf16_round((float)dh) * (double)comet_bf16_to_f32(xt[col]);
                } else { /* a: the forward's h, from the unrounded accumulators */
                    const double a = comet_bf16_round((float)(gg / (1.0 + exp(-gg)) * uu));
                    term = comet_bf16_round((float)(w * comet_bf16_to_f32(dyt[row]))) * a;
                }
                sum += term;
                const size_t used = strlen(list);
                if (used < sizeof list - 96)
                    snprintf(list + used, sizeof list - used, "%s(rank %d token %lld slot %lld w %.3f g %.5g u %.4g term %.3g)",
                             n_rows ? " " : "", s, (long long)t, (long long)q, w, gg, uu, term);
                n_rows++;
            }
    printf("rank %d %s worst (%.3g times its tolerance %.3g): expert %lld (local %lld) row %lld col %lld: got %.6g, "
           "reference %.6g, float64 %.6g; %d sampled rows: %s\n",
           r, g == 2 ? "dw1" : "dw2", c->out[r].over[g], c->out[r].worst_tol[g], (long long)e, (long long)x, (long long)row, (long long)col, got,
           comet_bf16_to_f32(ref[at]), sum, n_rows, list);
    fflush(stdout);
}

/* The forward and backward arguments of a step of rank r on n tokens. */
static void train_args(const comet_forward_args_t *fa, int save, int64_t n, comet_forward_args_t *f,
                       comet_backward_args_t *b) {
    const int64_t hd = fa->x.shape[1], k = fa->topk_idx.shape[1];
    *f = *fa;
    f->x.shape[0] = f->y.shape[0] = f->topk_idx.shape[0] = f->topk_w.shape[0] = n;
    f->save = save;
    *b = (comet_backward_args_t)COMET_BACKWARD_ARGS_INIT;
    b->x = f->x, b->topk_idx = f->topk_idx, b->topk_w = f->topk_w, b->w1 = f->w1, b->w2 = f->w2;
    b->dy = comet_tensor_2d(NULL, COMET_DTYPE_BF16, n, hd);
    b->dx = comet_tensor_2d(NULL, COMET_DTYPE_BF16, n, hd);
    b->d_topk_w = comet_tensor_2d(NULL, COMET_DTYPE_FP32, n, k);
    b->dw1 = f->w1, b->dw2 = f->w2; /* bf16, the weights' shapes */
    b->save = save;
    b->stream = f->stream, b->n_comm = f->n_comm;
}

/* The slowest rank gets its medians in comet_problem_run; this is one step.
 * CPU engine: host buffers, wall clock. */
static comet_status_t rank_train_cpu(rank_job_t *job, comet_layer_t *layer, const comet_forward_args_t *a) {
    comet_problem_t *p = job->p;
    comet_run_t *run = job->run;
    train_ctx_t *c = job->train;
    const int r = job->rank, save = run->train;
    const int64_t t = p->tokens[r], hd = p->cfg.hidden, k = p->cfg.topk;
    const size_t n1 = tensor_elems(&a->w1), n2 = tensor_elems(&a->w2);
    size_t sb = 0;
    comet_status_t st = comet_layer_saved_bytes(layer, save, &sb);
    const size_t sb16 = (sb + 15) / 16 * 16;
    void *saved = sb16 ? aligned_alloc(16, sb16) : NULL;
    uint16_t *dx = alloc_n(t * hd, 2), *dw1 = alloc_n((int64_t)n1 + 8, 2), *dw2 = alloc_n((int64_t)n2 + 8, 2);
    float *dtw = alloc_n(t * k, 4);
    if (st == COMET_SUCCESS && (!dx || !dw1 || !dw2 || !dtw || (sb16 && !saved)))
        st = comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: runner: no memory for the training step", r);
    comet_forward_args_t f;
    comet_backward_args_t b;
    if (st == COMET_SUCCESS && c->n[r] >= 0 && run->train_sample) { /* the gradient check, once */
        const int64_t n = c->n[r];
        uint16_t *y = alloc_n(n * hd, 2);
        train_args(a, save, n, &f, &b);
        f.x.data = b.x.data = c->sx[r], f.topk_idx.data = b.topk_idx.data = c->sidx[r];
        f.topk_w.data = b.topk_w.data = c->sw[r], f.y.data = y;
        f.saved = b.saved = (comet_tensor_t){saved, COMET_DTYPE_UINT8, 1, {(int64_t)sb16}};
        b.dy.data = c->sdy[r], b.dx.data = dx, b.d_topk_w.data = dtw, b.dw1.data = dw1, b.dw2.data = dw2;
        st = y ? comet_layer_forward(layer, &f) : comet_fail(COMET_ERR_OUT_OF_MEMORY, "runner: no memory");
        if (st == COMET_SUCCESS) st = comet_layer_backward(layer, &b);
        free(y);
        if (st == COMET_SUCCESS) {
            struct comet_train_check *o = &c->out[r];
            o->tokens = n;
            grad_compare(o, 0, dx, c->rdx[r], n, hd, 0, 0, NULL);
            grad_compare(o, 1, dtw, c->rdtw[r], 1, n * k, 1, 0, NULL);
            grad_compare(o, 2, dw1, c->rdw1[r], (int64_t)n1 / hd, hd, 0, 0, &c->slack[r]);
            grad_compare(o, 3, dw2, c->rdw2[r], (int64_t)(n2 / (size_t)a->w2.shape[2]), a->w2.shape[2], 0, 0, NULL);
            if (o->wrong[2]) grad_explain(p, c, r, a, 2, comet_bf16_to_f32(dw1[o->worst_at[2]]));
            if (o->wrong[3]) grad_explain(p, c, r, a, 3, comet_bf16_to_f32(dw2[o->worst_at[3]]));
        }
    }
    train_args(a, save, t, &f, &b);
    f.saved = b.saved = (comet_tensor_t){saved, COMET_DTYPE_UINT8, 1, {(int64_t)sb16}};
    b.dy.data = c->dy[r], b.dx.data = dx, b.d_topk_w.data = dtw, b.dw1.data = dw1, b.dw2.data = dw2;
    for (int i = 0; st == COMET_SUCCESS && i < run->repeats; i++) {
        if (run->trace && i == run->repeats - 1) st = comet_layer_set_trace(layer, run->trace); /* the last step */
        if (st != COMET_SUCCESS) break;
        note_progress(job, i);
        mark_timed(job, i);
        b.disable = run->interleave ? interleave_side(i) : 0; /* the backward's sides; the forward runs whole */
        const double t0 = wall_ms();
        st = comet_layer_forward(layer, &f);
        const double t1 = wall_ms();
        if (st == COMET_SUCCESS && r == 0 && i == run->repeats - 1) st = comet_layer_last_protocol(layer, &run->fwd_protocol);
        if (st == COMET_SUCCESS) st = comet_layer_backward(layer, &b);
        const double t2 = wall_ms();
        job->ms[i] = t2 - t0, job->ms_f[i] = t1 - t0, job->ms_b[i] = t2 - t1;
    }
    if (st == COMET_SUCCESS) note_progress(job, run->repeats);
    mark_timed(job, -1);
    free(saved), free(dx), free(dw1), free(dw2), free(dtw);
    return st;
}

#ifdef COMET_WITH_CUDA
/* dst rows [0, n) <- src rows k, k+1, ..., n-1, 0, ..., k-1 (rows of rb
 * bytes, 0 <= k < n; cudaMemcpy of kind). */
static cudaError_t copy_rotated(void *dst, const void *src, int64_t n, int64_t k, size_t rb, enum cudaMemcpyKind kind) {
    const size_t head = (size_t)(n - k) * rb, tail = (size_t)k * rb;
    cudaError_t e = head ? cudaMemcpy(dst, (const char *)src + tail, head, kind) : cudaSuccess;
    if (e == cudaSuccess && tail) e = cudaMemcpy((char *)dst + head, src, tail, kind);
    return e;
}

/* A tensor's bytes (elem bytes an element). */
static size_t tensor_bytes(const comet_tensor_t *ts, size_t elem) {
    size_t n = elem;
    for (int dim = 0; dim < ts->ndim; dim++) n *= (size_t)ts->shape[dim];
    return n;
}

/* Rows [0, rows) of a host tensor into dst rotated by shift (row t <- row
 * (t + shift) % rows), as whole rows of its bytes / rows. */
static cudaError_t upload_rotated(void *dst, const comet_tensor_t *ts, size_t elem, int64_t shift) {
    const int64_t rows = ts->ndim > 0 ? ts->shape[0] : 1;
    const size_t n = tensor_bytes(ts, elem);
    if (rows <= 0) return cudaMemcpy(dst, ts->data, n, cudaMemcpyHostToDevice);
    return copy_rotated(dst, ts->data, rows, shift % rows, n / (size_t)rows, cudaMemcpyHostToDevice);
}

/* One of a rank's input sets on the device (comet_run_t.input_sets): x,
 * topk_idx, topk_w and y, the tokens rotated by `shift` (row t holds token
 * (t + shift) % T; the set's index), so each set's output holds the same
 * rows in another order. */
typedef struct {
    void *x, *idx, *w, *y;
    int64_t shift;
} input_set_t;

/* This rank's y of set `in`, its rows put back in token order, into p->y[r]. */
static cudaError_t y_back(comet_problem_t *p, int r, const input_set_t *in) {
    const int64_t t = p->tokens[r];
    return copy_rotated(p->y[r], in->y, t, t ? (t - in->shift % t) % t : 0, (size_t)p->cfg.hidden * 2,
                        cudaMemcpyDeviceToHost);
}

/* The same on a GPU: inputs copied to the rank's device (input_sets of
 * them, rotated; one with graph; with pipeline one a call), y poisoned
 * there, each call timed with events on the next set, the status of each
 * call taken from comet_layer_sync (with pipeline: the calls enqueued back
 * to back, one sync after the last), y copied back into p->y in token
 * order. */
static comet_status_t rank_cuda(rank_job_t *job, comet_layer_t *layer, comet_forward_args_t *a) {
    comet_problem_t *p = job->p;
    const int r = job->rank;
    const int64_t t = p->tokens[r], hd = p->cfg.hidden;
    /* pipeline: a set a call (comet_problem_run checked repeats <= COMET_MAX_INPUT_SETS) */
    const int want_sets = job->run->pipeline && !job->run->graph ? job->run->repeats : job->run->input_sets;
    const int nsets = job->run->graph || want_sets < 1           ? 1
                      : want_sets > COMET_MAX_INPUT_SETS ? COMET_MAX_INPUT_SETS
                                                         : want_sets;
    input_set_t sets[COMET_MAX_INPUT_SETS];
    memset(sets, 0, sizeof sets);
    void *w1 = NULL, *w2 = NULL;
    cudaStream_t stream = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    comet_status_t st = COMET_SUCCESS;
    cudaError_t e = cudaSetDevice(comet_world_device(job->world, r));
    if (e == cudaSuccess) e = cudaStreamCreate(&stream);
    if (e == cudaSuccess) e = cudaEventCreate(&e0);
    if (e == cudaSuccess) e = cudaEventCreate(&e1);
    /* buffers sized by the tensors' shapes, as the layer reads them */
    const size_t w1_bytes = tensor_bytes(&a->w1, 2), w2_bytes = tensor_bytes(&a->w2, 2);
    const size_t x_bytes = tensor_bytes(&a->x, 2), y_bytes = tensor_bytes(&a->y, 2);
    const size_t idx_bytes = tensor_bytes(&a->topk_idx, 4), w_bytes = tensor_bytes(&a->topk_w, 4);
    if (e == cudaSuccess) e = cudaMalloc(&w1, w1_bytes ? w1_bytes : 1);
    if (e == cudaSuccess) e = cudaMemcpy(w1, a->w1.data, w1_bytes, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMalloc(&w2, w2_bytes ? w2_bytes : 1);
    if (e == cudaSuccess) e = cudaMemcpy(w2, a->w2.data, w2_bytes, cudaMemcpyHostToDevice);
    for (int s = 0; s < nsets && e == cudaSuccess; s++) {
        input_set_t *in = &sets[s];
        in->shift = s;
        if (e == cudaSuccess) e = cudaMalloc(&in->x, x_bytes ? x_bytes : 1);
        if (e == cudaSuccess) e = cudaMalloc(&in->idx, idx_bytes ? idx_bytes : 1);
        if (e == cudaSuccess) e = cudaMalloc(&in->w, w_bytes ? w_bytes : 1);
        if (e == cudaSuccess) e = cudaMalloc(&in->y, y_bytes ? y_bytes : 1);
        if (e == cudaSuccess) e = upload_rotated(in->x, &a->x, 2, in->shift);
        if (e == cudaSuccess) e = upload_rotated(in->idx, &a->topk_idx, 4, in->shift);
        if (e == cudaSuccess) e = upload_rotated(in->w, &a->topk_w, 4, in->shift);
        if (e == cudaSuccess) e = cudaMemset(in->y, 0xff, y_bytes);
    }
    a->w1.data = w1, a->w2.data = w2;
    a->x.data = sets[0].x, a->topk_idx.data = sets[0].idx, a->topk_w.data = sets[0].w, a->y.data = sets[0].y;
    a->stream = stream;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    if (job->run->graph) { /* the forward enqueues only device work: capture it once */
        if (e == cudaSuccess) e = cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed);
        if (e == cudaSuccess) {
            st = comet_layer_forward(layer, a);
            e = cudaStreamEndCapture(stream, &graph);
        }
        if (e == cudaSuccess && st == COMET_SUCCESS) e = cudaGraphInstantiate(&exec, graph, 0);
        /* a rank that could not capture never launches: the others must not replay either */
        const int ok = e == cudaSuccess && st == COMET_SUCCESS;
        job->agreed = 1;
        if (!agree(job->agree, ok) && ok)
            st = comet_fail(COMET_ERR_PEER_FAILED, "rank %d: another rank could not capture its forward in a graph", r);
    }
    /* after the graph's agreement, so that every rank is known to take part: one whole forward
     * before calls that leave a side out, then y poisoned again (those calls leave it) */
    if (e == cudaSuccess && st == COMET_SUCCESS && (job->run->disable || job->run->interleave)) {
        st = full_forward_first(layer, a);
        for (int s = 0; s < nsets && st == COMET_SUCCESS && e == cudaSuccess; s++)
            e = cudaMemset(sets[s].y, 0xff, (size_t)(t * hd) * 2);
    }
    uint16_t *first = NULL;
    const input_set_t *last = &sets[0];
    const int pipe = job->run->pipeline && !exec; /* every call enqueued before one sync at the end */
    for (int i = 0; e == cudaSuccess && st == COMET_SUCCESS && i < job->run->repeats; i++) {
        const input_set_t *in = last = &sets[i % nsets];
        a->x.data = in->x, a->topk_idx.data = in->idx, a->topk_w.data = in->w, a->y.data = in->y;
        if (job->run->compare_repeats && i > 0) e = cudaMemsetAsync(in->y, 0xff, (size_t)(t * hd) * 2, stream);
        if (e != cudaSuccess) break;
        if (job->run->interleave) a->disable = interleave_side(i);
        note_progress(job, i);
        mark_timed(job, i);
        if (!pipe || i == 0) cudaEventRecord(e0, stream);
        if (exec)
            e = cudaGraphLaunch(exec, stream);
        else
            st = comet_layer_forward(layer, a);
        if (pipe) continue;
        cudaEventRecord(e1, stream);
        if (st == COMET_SUCCESS) st = comet_layer_sync(layer);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        job->ms[i] = ms;
        if (job->run->compare_repeats && st == COMET_SUCCESS && e == cudaSuccess) {
            e = y_back(p, r, in);
            compare_call(job, i, p->y[r], &first);
        }
    }
    if (pipe && e == cudaSuccess && st == COMET_SUCCESS) { /* one sync (the last call's status), then each set's y */
        cudaEventRecord(e1, stream);
        st = comet_layer_sync(layer);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        for (int i = 0; i < job->run->repeats; i++) job->ms[i] = ms / (float)job->run->repeats;
        for (int i = 0; job->run->compare_repeats && st == COMET_SUCCESS && e == cudaSuccess && i < job->run->repeats; i++) {
            e = y_back(p, r, &sets[i]);
            compare_call(job, i, p->y[r], &first);
        }
    }
    if (e == cudaSuccess && st == COMET_SUCCESS) note_progress(job, job->run->repeats);
    mark_timed(job, -1);
    free(first);
    if (e == cudaSuccess) e = y_back(p, r, last);
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    for (int s = 0; s < nsets; s++) cudaFree(sets[s].x), cudaFree(sets[s].idx), cudaFree(sets[s].w), cudaFree(sets[s].y);
    cudaFree(w1), cudaFree(w2);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (stream) cudaStreamDestroy(stream);
    if (e != cudaSuccess && st == COMET_SUCCESS)
        st = comet_fail(COMET_ERR_CUDA, "rank %d: runner: %s", r, cudaGetErrorString(e));
    return st;
}

/* Step `at`'s forward and backward times from its start, forward-backward boundary and end events (e[0..2]). */
static void step_times(rank_job_t *job, int at, const cudaEvent_t *e) {
    float fwd = 0, bwd = 0;
    cudaEventElapsedTime(&fwd, e[0], e[1]);
    cudaEventElapsedTime(&bwd, e[1], e[2]);
    job->ms_f[at] = fwd, job->ms_b[at] = bwd, job->ms[at] = (double)fwd + (double)bwd;
}

/* Training steps on a GPU (comet_run_t.train): as rank_cuda's timed calls,
 * each call the training forward then the backward, events before, between
 * and after; before them, the gradient check on the sample (set 0's buffers,
 * its real rows uploaded again after). dw1 and dw2 compared expert by
 * expert, so the host holds one expert's copy at a time. */
static comet_status_t rank_train_cuda(rank_job_t *job, comet_layer_t *layer, const comet_forward_args_t *a0) {
    comet_problem_t *p = job->p;
    comet_run_t *run = job->run;
    train_ctx_t *c = job->train;
    const int r = job->rank, save = run->train;
    const int64_t t = p->tokens[r], hd = p->cfg.hidden, k = p->cfg.topk;
    const int nsets = run->input_sets < 1 ? 1 : run->input_sets > COMET_MAX_INPUT_SETS ? COMET_MAX_INPUT_SETS
                                                                                        : run->input_sets;
    typedef struct {
        input_set_t in;
        void *dy, *dx, *dtw;
    } train_set_t;
    train_set_t sets[COMET_MAX_INPUT_SETS];
    memset(sets, 0, sizeof sets);
    void *w1 = NULL, *w2 = NULL, *dw1 = NULL, *dw2 = NULL, *saved = NULL;
    cudaStream_t stream = NULL;
    /* the events of the steps' starts, their forward-backward boundaries and the last step's end: one
     * step's three (reused step by step) or, back to back (pipeline), two a timed step and the end */
    const int b2b = run->pipeline, timed = run->repeats - job->warmup;
    const int nev = b2b ? 2 * timed + 1 : 3;
    cudaEvent_t *ev = calloc((size_t)nev, sizeof *ev);
    comet_status_t st = COMET_SUCCESS;
    size_t sb = 0;
    cudaError_t e = ev ? cudaSetDevice(comet_world_device(job->world, r)) : cudaErrorMemoryAllocation;
    if (e == cudaSuccess) e = cudaStreamCreate(&stream);
    for (int i = 0; i < nev && e == cudaSuccess; i++) e = cudaEventCreate(&ev[i]);
    const size_t w1_bytes = tensor_bytes(&a0->w1, 2), w2_bytes = tensor_bytes(&a0->w2, 2);
    const size_t x_bytes = (size_t)(t * hd) * 2, rk_bytes = (size_t)(t * k) * 4;
    if (e == cudaSuccess) st = comet_layer_saved_bytes(layer, save, &sb);
    if (e == cudaSuccess) e = cudaMalloc(&w1, w1_bytes ? w1_bytes : 1);
    if (e == cudaSuccess) e = cudaMemcpy(w1, a0->w1.data, w1_bytes, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMalloc(&w2, w2_bytes ? w2_bytes : 1);
    if (e == cudaSuccess) e = cudaMemcpy(w2, a0->w2.data, w2_bytes, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMalloc(&dw1, w1_bytes ? w1_bytes : 1);
    if (e == cudaSuccess) e = cudaMalloc(&dw2, w2_bytes ? w2_bytes : 1);
    if (e == cudaSuccess) e = cudaMalloc(&saved, sb ? sb : 1); /* cudaMalloc: 256-byte aligned */
    const comet_tensor_t dy_host = comet_tensor_2d(c->dy[r], COMET_DTYPE_BF16, t, hd);
    for (int s = 0; s < nsets && e == cudaSuccess; s++) {
        train_set_t *ts = &sets[s];
        ts->in.shift = s;
        if (e == cudaSuccess) e = cudaMalloc(&ts->in.x, x_bytes ? x_bytes : 1);
        if (e == cudaSuccess) e = cudaMalloc(&ts->in.idx, rk_bytes ? rk_bytes : 1);
        if (e == cudaSuccess) e = cudaMalloc(&ts->in.w, rk_bytes ? rk_bytes : 1);
        if (e == cudaSuccess) e = cudaMalloc(&ts->in.y, x_bytes ? x_bytes : 1);
        if (e == cudaSuccess) e = cudaMalloc(&ts->dy, x_bytes ? x_bytes : 1);
        if (e == cudaSuccess) e = cudaMalloc(&ts->dx, x_bytes ? x_bytes : 1);
        if (e == cudaSuccess) e = cudaMalloc(&ts->dtw, rk_bytes ? rk_bytes : 1);
        if (e == cudaSuccess) e = upload_rotated(ts->in.x, &a0->x, 2, s);
        if (e == cudaSuccess) e = upload_rotated(ts->in.idx, &a0->topk_idx, 4, s);
        if (e == cudaSuccess) e = upload_rotated(ts->in.w, &a0->topk_w, 4, s);
        if (e == cudaSuccess) e = upload_rotated(ts->dy, &dy_host, 2, s);
        if (e == cudaSuccess) e = cudaMemset(ts->in.y, 0xff, x_bytes);
    }
    comet_forward_args_t f;
    comet_backward_args_t b;
    if (e == cudaSuccess && st == COMET_SUCCESS && run->train_sample) { /* the gradient check, once, on set 0 */
        const int64_t n = c->n[r];
        train_set_t *ts = &sets[0];
        train_args(a0, save, n, &f, &b);
        f.w1.data = b.w1.data = w1, f.w2.data = b.w2.data = w2;
        f.x.data = b.x.data = ts->in.x, f.topk_idx.data = b.topk_idx.data = ts->in.idx;
        f.topk_w.data = b.topk_w.data = ts->in.w, f.y.data = ts->in.y;
        f.stream = b.stream = stream;
        f.saved = b.saved = (comet_tensor_t){saved, COMET_DTYPE_UINT8, 1, {(int64_t)sb}};
        b.dy.data = ts->dy, b.dx.data = ts->dx, b.d_topk_w.data = ts->dtw, b.dw1.data = dw1, b.dw2.data = dw2;
        e = cudaMemcpy(ts->in.x, c->sx[r], (size_t)(n * hd) * 2, cudaMemcpyHostToDevice);
        if (e == cudaSuccess) e = cudaMemcpy(ts->in.idx, c->sidx[r], (size_t)(n * k) * 4, cudaMemcpyHostToDevice);
        if (e == cudaSuccess) e = cudaMemcpy(ts->in.w, c->sw[r], (size_t)(n * k) * 4, cudaMemcpyHostToDevice);
        if (e == cudaSuccess) e = cudaMemcpy(ts->dy, c->sdy[r], (size_t)(n * hd) * 2, cudaMemcpyHostToDevice);
        if (e == cudaSuccess) st = comet_layer_forward(layer, &f);
        if (e == cudaSuccess && st == COMET_SUCCESS) st = comet_layer_backward(layer, &b);
        if (e == cudaSuccess && st == COMET_SUCCESS) st = comet_layer_sync(layer);
        const int64_t el = a0->w1.shape[0], e1n = a0->w1.shape[1] * hd, e2n = hd * a0->w2.shape[2];
        void *host = malloc((size_t)(n * hd > e1n ? (n * hd > e2n ? n * hd : e2n) : (e1n > e2n ? e1n : e2n)) * 2 +
                            (size_t)(n * k) * 4 + 16);
        if (!host && e == cudaSuccess && st == COMET_SUCCESS)
            st = comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: runner: no memory for the gradient check", r);
        struct comet_train_check *o = &c->out[r];
        o->tokens = n;
        if (e == cudaSuccess && st == COMET_SUCCESS) e = cudaMemcpy(host, ts->dx, (size_t)(n * hd) * 2, cudaMemcpyDeviceToHost);
        if (e == cudaSuccess && st == COMET_SUCCESS) grad_compare(o, 0, host, c->rdx[r], n, hd, 0, 0, NULL);
        if (e == cudaSuccess && st == COMET_SUCCESS) e = cudaMemcpy(host, ts->dtw, (size_t)(n * k) * 4, cudaMemcpyDeviceToHost);
        if (e == cudaSuccess && st == COMET_SUCCESS) grad_compare(o, 1, host, c->rdtw[r], 1, n * k, 1, 0, NULL);
        float worst_got[2] = {0, 0}; /* dw1's and dw2's worst element's value */
        for (int64_t x = 0; x < el && e == cudaSuccess && st == COMET_SUCCESS; x++) {
            e = cudaMemcpy(host, (const uint16_t *)dw1 + x * e1n, (size_t)e1n * 2, cudaMemcpyDeviceToHost);
            if (e == cudaSuccess) grad_compare(o, 2, host, c->rdw1[r] + x * e1n, e1n / hd, hd, 0, x * e1n, &c->slack[r]);
            if (e == cudaSuccess && o->worst_at[2] / e1n == x) /* the worst so far is this expert's */
                worst_got[0] = comet_bf16_to_f32(((const uint16_t *)host)[o->worst_at[2] % e1n]);
            if (e == cudaSuccess) e = cudaMemcpy(host, (const uint16_t *)dw2 + x * e2n, (size_t)e2n * 2, cudaMemcpyDeviceToHost);
            if (e == cudaSuccess) grad_compare(o, 3, host, c->rdw2[r] + x * e2n, hd, a0->w2.shape[2], 0, x * e2n, NULL);
            if (e == cudaSuccess && o->worst_at[3] / e2n == x)
                worst_got[1] = comet_bf16_to_f32(((const uint16_t *)host)[o->worst_at[3] % e2n]);
        }
        for (int g = 2; g < 4 && e == cudaSuccess && st == COMET_SUCCESS; g++)
            if (o->wrong[g]) grad_explain(p, c, r, a0, g, worst_got[g - 2]);
        free(host);
        /* set 0's own rows again */
        if (e == cudaSuccess) e = upload_rotated(ts->in.x, &a0->x, 2, 0);
        if (e == cudaSuccess) e = upload_rotated(ts->in.idx, &a0->topk_idx, 4, 0);
        if (e == cudaSuccess) e = upload_rotated(ts->in.w, &a0->topk_w, 4, 0);
        if (e == cudaSuccess) e = upload_rotated(ts->dy, &dy_host, 2, 0);
    }
    train_args(a0, save, t, &f, &b);
    f.w1.data = b.w1.data = w1, f.w2.data = b.w2.data = w2;
    f.stream = b.stream = stream;
    f.saved = b.saved = (comet_tensor_t){saved, COMET_DTYPE_UINT8, 1, {(int64_t)sb}};
    b.dw1.data = dw1, b.dw2.data = dw2;
    const input_set_t *last = &sets[0].in;
    double host_t0 = 0; /* back to back: when the first timed step was enqueued (wall_ms) */
    for (int i = 0; e == cudaSuccess && st == COMET_SUCCESS && i < run->repeats; i++) {
        const train_set_t *ts = &sets[i % nsets];
        last = &ts->in;
        b.disable = run->interleave ? interleave_side(i) : 0; /* the backward's sides; the forward runs whole */
        f.x.data = b.x.data = ts->in.x, f.topk_idx.data = b.topk_idx.data = ts->in.idx;
        f.topk_w.data = b.topk_w.data = ts->in.w, f.y.data = ts->in.y;
        b.dy.data = ts->dy, b.dx.data = ts->dx, b.d_topk_w.data = ts->dtw;
        if (run->trace && i == run->repeats - 1) st = comet_layer_set_trace(layer, run->trace); /* the last step */
        if (st != COMET_SUCCESS) break;
        note_progress(job, i);
        mark_timed(job, i);
        const int j = b2b && i >= job->warmup ? i - job->warmup : -1; /* a timed step enqueued back to back */
        cudaEvent_t *se = j >= 0 ? &ev[2 * j] : ev;                  /* its start, boundary and end events */
        if (j == 0) host_t0 = wall_ms();
        cudaEventRecord(se[0], stream);
        st = comet_layer_forward(layer, &f);
        cudaEventRecord(se[1], stream);
        if (st == COMET_SUCCESS && job->rank == 0 && i == run->repeats - 1)
            st = comet_layer_last_protocol(layer, &run->fwd_protocol);
        if (st == COMET_SUCCESS) st = comet_layer_backward(layer, &b);
        if (j >= 0 && i < run->repeats - 1) continue; /* the next step's start event ends this one */
        if (j >= 0) job->host_ms = (wall_ms() - host_t0) / timed;
        cudaEventRecord(se[2], stream);
        if (st == COMET_SUCCESS) st = comet_layer_sync(layer);
        if (j < 0) step_times(job, i, ev);
        else /* every timed step, after the one sync */
            for (int q = 0; q < timed; q++) step_times(job, job->warmup + q, &ev[2 * q]);
    }
    if (e == cudaSuccess && st == COMET_SUCCESS) note_progress(job, run->repeats);
    mark_timed(job, -1);
    if (e == cudaSuccess && st == COMET_SUCCESS) e = y_back(p, r, last);
    for (int s = 0; s < nsets; s++)
        cudaFree(sets[s].in.x), cudaFree(sets[s].in.idx), cudaFree(sets[s].in.w), cudaFree(sets[s].in.y),
            cudaFree(sets[s].dy), cudaFree(sets[s].dx), cudaFree(sets[s].dtw);
    cudaFree(w1), cudaFree(w2), cudaFree(dw1), cudaFree(dw2), cudaFree(saved);
    for (int i = 0; ev && i < nev; i++)
        if (ev[i]) cudaEventDestroy(ev[i]);
    free(ev);
    if (stream) cudaStreamDestroy(stream);
    if (e != cudaSuccess && st == COMET_SUCCESS)
        st = comet_fail(COMET_ERR_CUDA, "rank %d: runner: %s", r, cudaGetErrorString(e));
    return st;
}
#endif

static void *rank_main(void *arg) {
    rank_job_t *job = arg;
    comet_run_t *run = job->run;
    comet_layer_t *layer = NULL;
    comet_status_t st = comet_layer_create(&layer, job->world, job->rank, &job->p->cfg);
    if (st == COMET_SUCCESS && job->rank == 0) comet_layer_memory(layer, &run->memory);
    if (st == COMET_SUCCESS && job->rank == 0 && run->train) st = comet_layer_saved_bytes(layer, run->train, &run->saved_bytes);
    comet_forward_args_t a = job->p->args[job->rank];
    if (run->n_comm) a.n_comm = run->n_comm;
    if (job->rank < 64 && run->n_comm_of_rank[job->rank]) a.n_comm = run->n_comm_of_rank[job->rank];
    if (run->chunk_cols) a.chunk_cols = run->chunk_cols;
    if (run->disable) a.disable = run->disable;
    if (run->train) {
#ifdef COMET_WITH_CUDA
        if (st == COMET_SUCCESS && comet_world_backend(job->world) == COMET_BACKEND_CUDA)
            st = rank_train_cuda(job, layer, &a);
        else
#endif
            if (st == COMET_SUCCESS)
            st = rank_train_cpu(job, layer, &a);
    } else
#ifdef COMET_WITH_CUDA
    if (st == COMET_SUCCESS && comet_world_backend(job->world) == COMET_BACKEND_CUDA) {
        if (run->trace) st = comet_layer_set_trace(layer, run->trace); /* each sync keeps the latest call */
        if (st == COMET_SUCCESS) st = rank_cuda(job, layer, &a);
    } else
#endif
    {
        uint16_t *first = NULL;
        if (st == COMET_SUCCESS && (run->disable || run->interleave)) { /* as rank_cuda */
            st = full_forward_first(layer, &a);
            memset(job->p->y[job->rank], 0xff, (size_t)(job->p->tokens[job->rank] * job->p->cfg.hidden) * 2);
        }
        for (int i = 0; st == COMET_SUCCESS && i < run->repeats; i++) {
            if (run->trace && i == run->repeats - 1) st = comet_layer_set_trace(layer, run->trace);
            if (st != COMET_SUCCESS) break;
            if (run->compare_repeats && i > 0)
                memset(job->p->y[job->rank], 0xff, (size_t)(job->p->tokens[job->rank] * job->p->cfg.hidden) * 2);
            if (run->interleave) a.disable = interleave_side(i);
            note_progress(job, i);
            mark_timed(job, i);
            double t0 = wall_ms();
            st = comet_layer_forward(layer, &a);
            job->ms[i] = wall_ms() - t0;
            if (run->compare_repeats && st == COMET_SUCCESS) compare_call(job, i, job->p->y[job->rank], &first);
        }
        if (st == COMET_SUCCESS) note_progress(job, run->repeats);
        mark_timed(job, -1);
        free(first);
    }
    if (job->rank < 64) {
        run->status[job->rank] = st;
        snprintf(run->message[job->rank], sizeof run->message[0], "%s", st ? comet_last_error() : "");
    }
#ifdef COMET_WITH_CUDA /* a rank that failed before its capture still arrives, or its peers wait forever */
    if (run->graph && !job->agreed && comet_world_backend(job->world) == COMET_BACKEND_CUDA) agree(job->agree, 0);
#endif
    if (layer && run->trace) comet_layer_set_trace(layer, NULL);
    if (layer && job->rank == 0) {
        comet_protocol_t proto = COMET_PROTOCOL_INIT;
        if (comet_layer_last_protocol(layer, &proto) == COMET_SUCCESS) run->protocol = proto;
        run->replays = layer->replays, run->captures = layer->captures;
    }
    comet_layer_destroy(layer);
    return NULL;
}


static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Call `call`'s time on the slowest of ranks first..last: src holds each rank's `repeats` times in a row. */
static double slowest_rank(const double *src, int repeats, int first, int last, int call) {
    double m = 0;
    for (int s = first; s <= last; s++)
        if (src[s * repeats + call] > m) m = src[s * repeats + call];
    return m;
}

comet_status_t comet_problem_run(comet_problem_t *p, comet_world_t *world, comet_run_t *run, int warmup) {
    const int w = p->world_size;
    if (w > 64) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "problem runner keeps at most 64 ranks");
    if (run->repeats < 1) run->repeats = 1;
    if (warmup < 0 || warmup >= run->repeats) warmup = 0;
    memset(run->ms_side, 0, sizeof run->ms_side);
    if (run->interleave && (run->disable || run->graph || run->repeats - warmup < SIDES))
        return comet_fail(COMET_ERR_INVALID_ARGUMENT,
                          "runner: interleaved sides need disable 0, no graph and %d timed calls or more (%d)", SIDES,
                          run->repeats - warmup);
    if (run->pipeline && (run->graph || run->interleave || (!run->train && run->repeats > COMET_MAX_INPUT_SETS)))
        return comet_fail(COMET_ERR_INVALID_ARGUMENT,
                          "runner: pipelined calls need no graph, no interleave and (forwards) at most %d calls (%d)",
                          COMET_MAX_INPUT_SETS, run->repeats);
    if (run->train && (run->train != COMET_SAVE_ACTIVATIONS && run->train != COMET_SAVE_RECOMPUTE))
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "runner: train is COMET_SAVE_ACTIVATIONS or COMET_SAVE_RECOMPUTE (%d)",
                          run->train);
    if (run->train && (run->disable || run->graph || run->compare_repeats))
        return comet_fail(COMET_ERR_INVALID_ARGUMENT,
                          "runner: training steps take no disable, graph or compare_repeats");
    run->ms_fwd = run->ms_bwd = 0;
    memset(&run->train_check, 0, sizeof run->train_check);
    const comet_protocol_t init = COMET_PROTOCOL_INIT;
    run->fwd_protocol = init;
    train_ctx_t *tc = NULL;
    if (run->train) {
        const comet_status_t ts = train_prepare(p, run, &tc);
        if (ts != COMET_SUCCESS) return ts;
    }
    memset(run->repeats_differ, 0, sizeof run->repeats_differ);
    pthread_t th[64];
    rank_job_t jobs[64];
    double *ms = calloc((size_t)(3 * w * run->repeats), sizeof(double)); /* step; train: forward, backward */
    double *slowest = calloc((size_t)run->repeats, sizeof(double));
    double *side_ms = calloc((size_t)run->repeats, sizeof(double)); /* one side's calls (interleave) */
    if (!ms || !slowest || !side_ms) {
        free(ms), free(slowest), free(side_ms);
        train_ctx_free(tc, w);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "runner: no memory");
    }
    double *ms_f = ms + w * run->repeats, *ms_b = ms + 2 * w * run->repeats;
    /* a world spread over processes runs only the rank it holds here */
    const int local = comet_world_local_rank(world), first = local >= 0 ? local : 0, last = local >= 0 ? local : w - 1;
    if (run->graph && local >= 0 && w > 1) {
        free(ms), free(slowest), free(side_ms);
        train_ctx_free(tc, w);
        return comet_fail(COMET_ERR_UNSUPPORTED, "runner: graph replay needs every rank in this process");
    }
    agree_t ag = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, last - first + 1, 0, 0};
    int started = first;
    for (; started <= last; started++) {
        jobs[started] = (rank_job_t){p, world, run, started, ms + started * run->repeats, &ag, 0, warmup, started == first, 0,
                                     ms_f + started * run->repeats, ms_b + started * run->repeats, tc, 0};
        if (pthread_create(&th[started], NULL, rank_main, &jobs[started])) break;
    }
    if (started <= last) { /* the threads that did not start will never arrive */
        pthread_mutex_lock(&ag.mu);
        ag.expected -= last - started + 1, ag.failed = 1;
        pthread_cond_broadcast(&ag.cv);
        pthread_mutex_unlock(&ag.mu);
    }
    for (int s = first; s < started; s++) pthread_join(th[s], NULL);
    if (started <= last) {
        free(ms), free(slowest), free(side_ms);
        train_ctx_free(tc, w);
        return comet_fail(COMET_ERR_SYSTEM, "runner: could not start rank thread %d", started);
    }
    const int timed = run->repeats - warmup;
    run->ms_host = 0; /* the jobs' host_ms: 0 unless measured (train, pipeline, GPUs) */
    for (int s = first; s < started; s++)
        if (jobs[s].host_ms > run->ms_host) run->ms_host = jobs[s].host_ms;
    if (tc) { /* each part's median of the slowest rank's, the check summed over the ranks run here */
        for (int part = 0; part < 2; part++) {
            const double *src = part ? ms_b : ms_f;
            for (int i = 0; i < timed; i++) slowest[i] = slowest_rank(src, run->repeats, first, last, warmup + i);
            qsort(slowest, (size_t)timed, sizeof(double), cmp_double);
            *(part ? &run->ms_bwd : &run->ms_fwd) = slowest[timed / 2];
        }
        struct comet_train_check *o = &run->train_check;
        for (int s = first; s <= last; s++) {
            const struct comet_train_check *q = &tc->out[s];
            o->tokens += q->tokens;
            for (int g = 0; g < 4; g++) {
                o->elements[g] += q->elements[g], o->differ[g] += q->differ[g], o->wrong[g] += q->wrong[g];
                if (!(q->worst[g] <= o->worst[g])) o->worst[g] = q->worst[g];
                if (!(q->over[g] <= o->over[g])) o->over[g] = q->over[g], o->worst_tol[g] = q->worst_tol[g];
            }
        }
        train_ctx_free(tc, w);
    }
    for (int i = 0; i < timed; i++) slowest[i] = slowest_rank(ms, run->repeats, first, last, warmup + i);
    for (int side = 0; run->interleave && side < SIDES; side++) { /* call warmup + i: side (warmup + i) % SIDES */
        const double *src = run->train ? ms_b : ms; /* a training step's sides are its backward's */
        int n = 0;
        for (int i = 0; i < timed; i++)
            if ((warmup + i) % SIDES == side) side_ms[n++] = slowest_rank(src, run->repeats, first, last, warmup + i);
        qsort(side_ms, (size_t)n, sizeof(double), cmp_double);
        run->ms_side[side_slot(side)] = side_ms[n / 2]; /* n >= 1: SIDES timed calls or more */
    }
    qsort(slowest, (size_t)timed, sizeof(double), cmp_double);
    run->ms_median = slowest[timed / 2];
    free(ms), free(slowest), free(side_ms);
    /* a rank's own failure before the PEER_FAILED of the others, which only echo it */
    for (int pass = 0; pass < 2; pass++)
        for (int s = first; s <= last; s++)
            if (run->status[s] != COMET_SUCCESS && (pass || run->status[s] != COMET_ERR_PEER_FAILED))
                return comet_fail_copy(run->status[s], run->message[s]);
    return COMET_SUCCESS;
}

/* ---- the tuner's table ------------------------------------------------------- */

int comet_tune_append(const char *path, const comet_layer_config_t *cfg, int world_size, comet_backend_t backend,
                      int n_comm, int chunk_cols, double ms) {
    comet_dims_t d;
    if (comet_dims_from_config(cfg, world_size, 0, &d) != COMET_SUCCESS) return -1;
    const comet_tuning_t best = {n_comm, chunk_cols, 0};
    return comet_tuner_append(path, &d, backend, cfg->max_tokens_per_rank, &best, ms);
}
