/*
 * test_engine_backward.c - the CPU engine's backward (comet_layer_backward)
 * and its training forward (args.save) against comet_reference_backward.
 *   matrix:  random problems over W in {1,2,4,8}, every (TP, EP), topk 1..8,
 *            E 1..512 (small H and F), tokens per rank 0..max (1 and T
 *            different per rank included), uniform and skewed routing, empty
 *            experts, n_comm 0 and COMET_SEQUENTIAL (the tuner's) and 1..16,
 *            chunk widths from a tuner table (or the rule's), 1..3 compute
 *            workers, both activations, dw1/dw2 bf16, fp32 and accumulated.
 *            Per problem: a training forward (y bitwise the reference's, the
 *            saved state's header), then backwards from the saved state, by
 *            recomputing (COMET_SAVE_RECOMPUTE, COMET_SAVE_NONE) and from the
 *            saved state again, each with every output poisoned before and
 *            bitwise equal to the reference's after (so also run to run);
 *            the protocol each reports (n_comm, the table's chunk width)
 *   misuse:  saved state of another layer (on one rank, on every rank), of
 *            a forward with other tokens, too small, NULL, misaligned, never
 *            written; bad routing and n_comm above the engine's most on one
 *            rank: that rank's status, COMET_ERR_PEER_FAILED on the others,
 *            no output written on any rank; afterwards valid backwards of
 *            both layers still bitwise the reference's. A failed training
 *            forward and a measurement forward (disable bits) leave the
 *            saved state untouched
 *   empty:   T = 0 with NULL data pointers on a rank (UBSan: no NULL reaches
 *            memcpy)
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../src/core/numerics.h"
#include "../src/core/saved.h"
#include "../harness/workload.h"
#include "check.h"

enum { DW_BF16 = 0, DW_FP32 = 1, DW_ACC = 2 };
static const char *const dw_name[3] = {"bf16", "fp32", "accumulate"};

/* ---- a problem: inputs, the engine's outputs [0] and the reference's [1] ---- */
typedef struct {
    comet_problem_t *p;
    int W, mode;
    int64_t n1, n2; /* dw1, dw2 elements per rank */
    size_t es;      /* bytes of a dw element */
    uint16_t **dy, **dx[2];
    float **dtw[2], **old1, **old2;
    void **dw1[2], **dw2[2];
    comet_backward_args_t *args[2];
} bprob_t;

static void *alloc_rows(int W) { return calloc((size_t)W, sizeof(void *)); }

static void bprob_free(bprob_t *b) {
    for (int s = 0; s < b->W; s++) {
        free(b->dy[s]), free(b->old1[s]), free(b->old2[s]);
        for (int k = 0; k < 2; k++) free(b->dx[k][s]), free(b->dtw[k][s]), free(b->dw1[k][s]), free(b->dw2[k][s]);
    }
    free(b->dy), free(b->old1), free(b->old2);
    for (int k = 0; k < 2; k++) free(b->dx[k]), free(b->dtw[k]), free(b->dw1[k]), free(b->dw2[k]), free(b->args[k]);
    comet_problem_destroy(b->p);
}

static int bprob_create(bprob_t *b, const comet_layer_config_t *cfg, int W, const int64_t *tokens,
                        const comet_routing_opts_t *ro, int mode) {
    memset(b, 0, sizeof *b);
    if (comet_problem_create(&b->p, cfg, W, tokens, ro) != COMET_SUCCESS) {
        CHECK(0, "problem: %s", comet_last_error());
        return 0;
    }
    const comet_problem_t *p = b->p;
    const int64_t H = cfg->hidden, K = cfg->topk, EL = cfg->num_experts / cfg->ep, FL = cfg->ffn / cfg->tp;
    const int64_t R1 = cfg->activation == COMET_ACT_SILU_GATED ? 2 * FL : FL;
    b->W = W, b->mode = mode, b->n1 = EL * R1 * H, b->n2 = EL * H * FL, b->es = mode == DW_BF16 ? 2 : 4;
    b->dy = alloc_rows(W), b->old1 = alloc_rows(W), b->old2 = alloc_rows(W);
    for (int k = 0; k < 2; k++) {
        b->dx[k] = alloc_rows(W), b->dtw[k] = alloc_rows(W), b->dw1[k] = alloc_rows(W), b->dw2[k] = alloc_rows(W);
        b->args[k] = calloc((size_t)W, sizeof(comet_backward_args_t));
    }
    comet_rng_t rng = {ro->seed * 7919 + 17};
    const comet_dtype_t dt = mode == DW_BF16 ? COMET_DTYPE_BF16 : COMET_DTYPE_FP32;
    for (int s = 0; s < W; s++) {
        const int64_t T = p->tokens[s];
        b->dy[s] = malloc((size_t)(T * H) * 2 + 2);
        for (int64_t i = 0; i < T * H; i++) b->dy[s][i] = comet_f32_to_bf16((float)(2.0 * comet_rng_uniform(&rng) - 1.0));
        b->old1[s] = malloc((size_t)b->n1 * 4), b->old2[s] = malloc((size_t)b->n2 * 4);
        for (int64_t i = 0; i < b->n1; i++) b->old1[s][i] = (float)(0.02 * (2.0 * comet_rng_uniform(&rng) - 1.0));
        for (int64_t i = 0; i < b->n2; i++) b->old2[s][i] = (float)(0.02 * (2.0 * comet_rng_uniform(&rng) - 1.0));
        if (s == 0 && b->n1 > 1) b->old1[s][1] = -0.0f; /* adding a sum of 0 makes it +0 */
        for (int k = 0; k < 2; k++) {
            b->dx[k][s] = malloc((size_t)(T * H) * 2 + 2), b->dtw[k][s] = malloc((size_t)(T * K) * 4 + 4);
            b->dw1[k][s] = malloc((size_t)b->n1 * b->es), b->dw2[k][s] = malloc((size_t)b->n2 * b->es);
            comet_backward_args_t a = COMET_BACKWARD_ARGS_INIT;
            a.x = p->args[s].x, a.topk_idx = p->args[s].topk_idx, a.topk_w = p->args[s].topk_w;
            a.w1 = p->args[s].w1, a.w2 = p->args[s].w2;
            a.dy = comet_tensor_2d(b->dy[s], COMET_DTYPE_BF16, T, H);
            a.dx = comet_tensor_2d(b->dx[k][s], COMET_DTYPE_BF16, T, H);
            a.d_topk_w = comet_tensor_2d(b->dtw[k][s], COMET_DTYPE_FP32, T, K);
            a.dw1 = comet_tensor_3d(b->dw1[k][s], dt, EL, R1, H);
            a.dw2 = comet_tensor_3d(b->dw2[k][s], dt, EL, H, FL);
            a.accumulate = mode == DW_ACC;
            b->args[k][s] = a;
        }
    }
    return 1;
}

/* Rank s's outputs of side k poisoned (NaN bits; accumulating: the old values). */
static void poison(bprob_t *b, int k, int s) {
    const int64_t T = b->p->tokens[s], H = b->p->cfg.hidden, K = b->p->cfg.topk;
    memset(b->dx[k][s], 0xff, (size_t)(T * H) * 2);
    memset(b->dtw[k][s], 0xff, (size_t)(T * K) * 4);
    if (b->mode == DW_ACC) {
        memcpy(b->dw1[k][s], b->old1[s], (size_t)b->n1 * 4);
        memcpy(b->dw2[k][s], b->old2[s], (size_t)b->n2 * 4);
    } else {
        memset(b->dw1[k][s], 0xff, (size_t)b->n1 * b->es);
        memset(b->dw2[k][s], 0xff, (size_t)b->n2 * b->es);
    }
}

static int64_t count_diff(const void *x, const void *y, int64_t n, size_t es) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += memcmp((const char *)x + i * es, (const char *)y + i * es, es) != 0;
    return bad;
}

/* Elements of rank s's outputs that differ between the engine and the reference. */
static int64_t diff_rank(const bprob_t *b, int s) {
    const int64_t T = b->p->tokens[s], H = b->p->cfg.hidden, K = b->p->cfg.topk;
    return count_diff(b->dx[0][s], b->dx[1][s], T * H, 2) + count_diff(b->dtw[0][s], b->dtw[1][s], T * K, 4) +
           count_diff(b->dw1[0][s], b->dw1[1][s], b->n1, b->es) + count_diff(b->dw2[0][s], b->dw2[1][s], b->n2, b->es);
}

/* Rank s's engine outputs still as poison() left them. */
static int untouched_rank(const bprob_t *b, int s) {
    const int64_t T = b->p->tokens[s], H = b->p->cfg.hidden, K = b->p->cfg.topk;
    int ok = 1;
    for (int64_t i = 0; i < T * H; i++) ok &= b->dx[0][s][i] == 0xffff;
    const uint32_t *t = (const uint32_t *)b->dtw[0][s];
    for (int64_t i = 0; i < T * K; i++) ok &= t[i] == 0xffffffffu;
    if (b->mode == DW_ACC)
        return ok && !memcmp(b->dw1[0][s], b->old1[s], (size_t)b->n1 * 4) &&
               !memcmp(b->dw2[0][s], b->old2[s], (size_t)b->n2 * 4);
    const unsigned char *p1 = b->dw1[0][s], *p2 = b->dw2[0][s];
    for (int64_t i = 0; i < b->n1 * (int64_t)b->es; i++) ok &= p1[i] == 0xff;
    for (int64_t i = 0; i < b->n2 * (int64_t)b->es; i++) ok &= p2[i] == 0xff;
    return ok;
}

/* The reference's outputs of every rank (side 1). */
static comet_status_t reference(bprob_t *b) {
    for (int s = 0; s < b->W; s++) poison(b, 1, s);
    return comet_reference_backward(&b->p->cfg, b->W, b->args[1]);
}

static comet_tensor_t bytes_tensor(void *data, int64_t n) {
    comet_tensor_t t;
    memset(&t, 0, sizeof t);
    t.data = data, t.dtype = COMET_DTYPE_UINT8, t.ndim = 1, t.shape[0] = n;
    return t;
}

/* Valid rows of rank q's plan: the slots of every rank whose expert q holds. */
static int64_t plan_rows(const comet_problem_t *p, int q) {
    const int64_t el = p->cfg.num_experts / p->cfg.ep, ep = q / p->cfg.tp;
    int64_t n = 0;
    for (int s = 0; s < p->world_size; s++)
        for (int64_t i = 0; i < p->tokens[s] * p->cfg.topk; i++) n += p->topk_idx[s][i] / el == ep;
    return n;
}

/* A world of W ranks with `workers` compute workers a rank and, when chunk >
 * 0, a tuner table holding chunk (and n_comm table_n_comm) for cfg. */
static comet_world_t *make_world(const comet_layer_config_t *cfg, int W, int workers, int chunk, int table_n_comm) {
    char path[] = "/tmp/comet_test_bwd_XXXXXX";
    int fd = -1;
    if (chunk > 0) {
        fd = mkstemp(path);
        if (fd < 0 || comet_tune_append(path, cfg, W, COMET_BACKEND_CPU, table_n_comm, chunk, 1.0) != 0) {
            CHECK(0, "tuner table %s", path);
            if (fd >= 0) close(fd), unlink(path);
            return NULL;
        }
    }
    comet_world_options_t o = COMET_WORLD_OPTIONS_INIT;
    o.cpu_workers = workers;
    o.tune_file = chunk > 0 ? path : "";
    comet_world_t *world = NULL;
    comet_status_t st = comet_world_create_local_opts(&world, W, COMET_BACKEND_CPU, &o);
    CHECK(st == COMET_SUCCESS, "world: %s", comet_last_error());
    if (fd >= 0) close(fd), unlink(path);
    return world;
}

/* Run fn(job i) on W threads, one a rank. */
static void run_ranks(int W, void *(*fn)(void *), void *jobs, size_t job_size) {
    pthread_t th[8];
    for (int r = 0; r < W; r++) pthread_create(&th[r], NULL, fn, (char *)jobs + (size_t)r * job_size);
    for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
}

/* ---- matrix -------------------------------------------------------------------- */
#define CALLS 3
static const int call_save[CALLS] = {COMET_SAVE_ACTIVATIONS, COMET_SAVE_RECOMPUTE, COMET_SAVE_ACTIVATIONS};

typedef struct {
    bprob_t *b;
    comet_world_t *world;
    int rank, n_comm;
    comet_status_t st; /* first failure, with its message */
    char msg[300];
    comet_saved_header_t hdr;
    int64_t bad[CALLS];      /* elements differing from the reference, per backward */
    comet_protocol_t proto;  /* of the last backward */
} mjob_t;

static void job_fail(mjob_t *j, comet_status_t st, const char *what) {
    if (j->st != COMET_SUCCESS) return;
    j->st = st;
    snprintf(j->msg, sizeof j->msg, "rank %d %s: %s", j->rank, what, comet_last_error());
}

static void *matrix_rank(void *arg) {
    mjob_t *j = arg;
    bprob_t *b = j->b;
    const int r = j->rank;
    comet_layer_t *layer = NULL;
    size_t bytes = 0;
    comet_status_t st = comet_layer_create(&layer, j->world, r, &b->p->cfg);
    if (st) {
        job_fail(j, st, "create");
        return NULL;
    }
    if ((st = comet_layer_saved_bytes(layer, COMET_SAVE_ACTIVATIONS, &bytes))) job_fail(j, st, "saved bytes");
    unsigned char *saved = malloc(bytes);
    if (saved) memset(saved, 0xa5, bytes);
    comet_forward_args_t f = b->p->args[r];
    f.n_comm = j->n_comm, f.save = COMET_SAVE_ACTIVATIONS, f.saved = bytes_tensor(saved, (int64_t)bytes);
    if ((st = comet_layer_forward(layer, &f))) job_fail(j, st, "training forward");
    if (saved) memcpy(&j->hdr, saved, sizeof j->hdr);
    for (int c = 0; c < CALLS; c++) {
        comet_backward_args_t a = b->args[0][r];
        a.n_comm = j->n_comm, a.save = call_save[c] == COMET_SAVE_RECOMPUTE && r % 2 ? COMET_SAVE_NONE : call_save[c];
        a.saved = bytes_tensor(saved, (int64_t)bytes);
        poison(b, 0, r);
        if ((st = comet_layer_backward(layer, &a))) job_fail(j, st, "backward");
        j->bad[c] = diff_rank(b, r);
    }
    comet_protocol_t pr = COMET_PROTOCOL_INIT;
    if ((st = comet_layer_last_protocol(layer, &pr))) job_fail(j, st, "last protocol");
    j->proto = pr;
    free(saved);
    comet_layer_destroy(layer);
    return NULL;
}

typedef struct {
    comet_layer_config_t cfg;
    int W;
    int64_t tokens[8];
    comet_routing_opts_t ro;
    int mode, n_comm, chunk, table_n_comm, workers;
} mcase_t;

/* One problem: reference, then the engine's training forward and backwards. */
static int run_matrix_case(const mcase_t *c) {
    bprob_t b;
    if (!bprob_create(&b, &c->cfg, c->W, c->tokens, &c->ro, c->mode)) return 0;
    char tag[300];
    snprintf(tag, sizeof tag,
             "W=%d TP=%d EP=%d H=%lld F=%lld E=%lld topk=%lld %s tile_m=%d T=%lld.. n_comm=%d chunk=%d workers=%d "
             "skew=%g empty=%lld dw %s",
             c->W, c->cfg.tp, c->cfg.ep, (long long)c->cfg.hidden, (long long)c->cfg.ffn, (long long)c->cfg.num_experts,
             (long long)c->cfg.topk, c->cfg.activation == COMET_ACT_GELU ? "gelu" : "silu", c->cfg.tile_m,
             (long long)c->tokens[0], c->n_comm, c->chunk, c->workers, c->ro.skew, (long long)c->ro.zero_experts,
             dw_name[c->mode]);
    comet_problem_poison(b.p);
    comet_status_t rs = comet_reference_forward(&b.p->cfg, c->W, b.p->ref_args);
    comet_status_t bs = reference(&b);
    CHECK(rs == COMET_SUCCESS && bs == COMET_SUCCESS, "%s: references: %s %s: %s", tag, comet_status_string(rs),
          comet_status_string(bs), comet_last_error());
    comet_world_t *world = make_world(&c->cfg, c->W, c->workers, c->chunk, c->table_n_comm);
    mjob_t jobs[8];
    memset(jobs, 0, sizeof jobs);
    for (int r = 0; r < c->W; r++) jobs[r].b = &b, jobs[r].world = world, jobs[r].rank = r, jobs[r].n_comm = c->n_comm;
    if (world) run_ranks(c->W, matrix_rank, jobs, sizeof jobs[0]);
    comet_world_destroy(world);
    const int64_t ybad = comet_problem_count_mismatch(b.p);
    CHECK(ybad == 0, "%s: the training forward's y: %lld elements differ from the reference", tag, (long long)ybad);
    for (int r = 0; world && r < c->W; r++) {
        const mjob_t *j = &jobs[r];
        CHECK(j->st == COMET_SUCCESS, "%s: %s %s", tag, comet_status_string(j->st), j->msg);
        const int64_t rows = plan_rows(b.p, r);
        CHECK(j->hdr.magic == COMET_SAVED_MAGIC && j->hdr.tokens == b.p->tokens[r] && j->hdr.rows == rows,
              "%s: rank %d's saved header: magic %#llx, %lld tokens, %lld rows (want %lld, %lld)", tag, r,
              (unsigned long long)j->hdr.magic, (long long)j->hdr.tokens, (long long)j->hdr.rows,
              (long long)b.p->tokens[r], (long long)rows);
        for (int k = 0; k < CALLS; k++)
            CHECK(j->bad[k] == 0, "%s: rank %d, backward %d (save %d): %lld elements differ from the reference", tag, r,
                  k, call_save[k], (long long)j->bad[k]);
        const int want_n = c->n_comm > 0 ? c->n_comm : c->chunk ? c->table_n_comm : j->proto.n_comm;
        CHECK(j->proto.n_comm == want_n && j->proto.n_comm >= 1 && (!c->chunk || j->proto.chunk_cols == c->chunk) &&
                  j->proto.mode == COMET_MODE_OVERLAPPED && j->proto.combine == COMET_COMBINE_PARTIALS,
              "%s: rank %d's protocol: n_comm %d chunk %d mode %d combine %d", tag, r, j->proto.n_comm,
              j->proto.chunk_cols, (int)j->proto.mode, (int)j->proto.combine);
    }
    bprob_free(&b);
    return 1;
}

static void test_matrix(void) {
    comet_rng_t rng = {4242};
    const int worlds[] = {1, 2, 4, 8};
    const int64_t experts[] = {1, 2, 4, 8, 16, 64, 512};
    const int n_comms[] = {0, COMET_SEQUENTIAL, 1, 2, 3, 7, 16};
    int cases = 0;
    for (int wi = 0; wi < 4; wi++) {
        const int w = worlds[wi];
        for (int tp = 1; tp <= w; tp *= 2) {
            const int reps = w == 8 ? 5 : 8;
            for (int rep = 0; rep < reps; rep++) {
                mcase_t c;
                memset(&c, 0, sizeof c);
                comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
                cfg.tp = tp, cfg.ep = w / tp;
                const int64_t e = experts[(rep + wi) % 7];
                cfg.num_experts = cfg.ep * ((e + cfg.ep - 1) / cfg.ep);
                const int big = cfg.num_experts >= 64;
                cfg.hidden = (big ? 8 : 8 + 8 * (int64_t)(comet_rng_next(&rng) % 4)) + (rep == 3 ? 3 : 0);
                cfg.ffn = tp * ((big ? 2 : 4) + (int64_t)(comet_rng_next(&rng) % (big ? 4 : 12)));
                const int64_t kmax = cfg.num_experts < 8 ? cfg.num_experts : 8;
                cfg.topk = 1 + (int64_t)(comet_rng_next(&rng) % (uint64_t)kmax);
                cfg.activation = (rep + wi) % 2 ? COMET_ACT_GELU : COMET_ACT_SILU_GATED;
                cfg.max_tokens_per_rank = 1 + (int64_t)(comet_rng_next(&rng) % (w >= 8 ? 10 : 20));
                cfg.tile_m = 1 + (int)(comet_rng_next(&rng) % 8);
                c.cfg = cfg, c.W = w;
                for (int s = 0; s < w; s++) {
                    c.tokens[s] = (int64_t)(comet_rng_next(&rng) % (uint64_t)(cfg.max_tokens_per_rank + 1));
                    if (s == 0 && rep == 1) c.tokens[s] = 1;
                    if (s == w - 1 && rep == 2) c.tokens[s] = 0;
                }
                c.ro.skew = rep % 3 == 1 ? 0.8 : (rep % 3 == 2 ? 0.1 : 0.0);
                c.ro.zero_experts = cfg.num_experts >= cfg.topk + 2 && rep % 2 ? cfg.num_experts / 4 + 1 : 0;
                if (cfg.num_experts - c.ro.zero_experts < cfg.topk) c.ro.zero_experts = 0;
                c.ro.seed = (uint64_t)(1000 * w + 100 * tp + rep);
                c.mode = (rep + tp) % 3;
                c.n_comm = n_comms[comet_rng_next(&rng) % 7];
                c.chunk = rep % 3 ? 1 + (int)(comet_rng_next(&rng) % (uint64_t)cfg.hidden) : 0;
                c.table_n_comm = 1 + (int)(comet_rng_next(&rng) % 4);
                c.workers = 1 + (int)(comet_rng_next(&rng) % 3);
                cases += run_matrix_case(&c);
            }
        }
    }
    /* every token on every rank (topk = E), a world without tokens, E = 512 on one rank */
    mcase_t special[3];
    memset(special, 0, sizeof special);
    for (int i = 0; i < 3; i++) {
        comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
        cfg.hidden = 16, cfg.ffn = 8, cfg.num_experts = 4, cfg.topk = 4, cfg.max_tokens_per_rank = 6, cfg.tile_m = 4;
        special[i].cfg = cfg, special[i].W = 4, special[i].workers = 2, special[i].n_comm = 2;
        special[i].ro.seed = (uint64_t)(77 + i);
    }
    special[0].cfg.tp = 2, special[0].cfg.ep = 2, special[0].cfg.ffn = 16, special[0].mode = DW_FP32;
    special[0].tokens[0] = 6, special[0].tokens[1] = 1, special[0].tokens[2] = 0, special[0].tokens[3] = 5;
    special[1].cfg.ep = 4, special[1].cfg.activation = COMET_ACT_GELU, special[1].mode = DW_ACC, special[1].chunk = 5;
    special[1].table_n_comm = 2;
    special[2].W = 1, special[2].cfg.num_experts = 512, special[2].cfg.topk = 8, special[2].cfg.hidden = 8;
    special[2].cfg.ffn = 4, special[2].tokens[0] = 6, special[2].ro.skew = 2.0, special[2].mode = DW_BF16;
    for (int i = 0; i < 3; i++) cases += run_matrix_case(&special[i]);
    printf("test_engine_backward: %d random problems: training forward, then %d backwards each, bitwise the "
           "reference's\n",
           cases, CALLS);
}

/* ---- misuse -------------------------------------------------------------------- */
typedef struct {
    bprob_t *b;
    comet_world_t *world;
    int rank;
    comet_layer_t *A, *B;
    unsigned char *savedA, *savedB, *zeros, *fresh;
    size_t bytes;
    int32_t *bad_idx;      /* this rank's routing with an expert id out of range */
    comet_status_t st[16]; /* per step */
    int untouched[16];     /* per step: the outputs (and for forwards the saved state) as before */
    int64_t bad_valid[2];  /* the valid backwards afterwards: elements differing from the reference */
} ujob_t;

enum { STEP_OTHER_LAYER_ONE, STEP_OTHER_LAYER_ALL, STEP_SMALL, STEP_NULL, STEP_ZEROS, STEP_MISALIGNED, STEP_TOKENS,
       STEP_ROUTING, STEP_N_COMM, STEP_FWD_ROUTING, STEP_FWD_DISABLE, N_STEPS };

/* Which rank each step makes invalid (-1: every rank). */
static const int step_rank[N_STEPS] = {1, -1, 2, 3, 0, 1, 0, 3, 2, 1, -1};
static const comet_status_t step_want[N_STEPS] = {
    COMET_ERR_INVALID_ARGUMENT, COMET_ERR_INVALID_ARGUMENT, COMET_ERR_INVALID_SHAPE,  COMET_ERR_INVALID_ARGUMENT,
    COMET_ERR_INVALID_ARGUMENT, COMET_ERR_INVALID_ARGUMENT, COMET_ERR_INVALID_ARGUMENT, COMET_ERR_INVALID_ROUTING,
    COMET_ERR_INVALID_ARGUMENT, COMET_ERR_INVALID_ROUTING,  COMET_SUCCESS};
static const char *const step_name[N_STEPS] = {
    "saved state of another layer on one rank", "saved state of another layer on every rank", "saved state too small",
    "saved.data NULL", "saved state never written", "saved.data misaligned", "saved state of a forward with other tokens",
    "bad routing in a backward", "n_comm 65", "bad routing in a training forward", "a measurement forward (disable bits)"};

static void *misuse_rank(void *arg) {
    ujob_t *j = arg;
    bprob_t *b = j->b;
    const int r = j->rank;
    const int64_t T = b->p->tokens[r];
    comet_forward_args_t f = b->p->args[r];
    f.save = COMET_SAVE_ACTIVATIONS, f.n_comm = 2;
    f.saved = bytes_tensor(j->savedA, (int64_t)j->bytes);
    comet_layer_forward(j->A, &f);
    f.saved = bytes_tensor(j->savedB, (int64_t)j->bytes);
    comet_layer_forward(j->B, &f);
    for (int s = 0; s < N_STEPS; s++) {
        const int bad = step_rank[s] < 0 || step_rank[s] == r;
        comet_backward_args_t a = b->args[0][r];
        a.save = COMET_SAVE_ACTIVATIONS, a.n_comm = 1 + r % 2;
        a.saved = bytes_tensor(j->savedA, (int64_t)j->bytes);
        if (s >= STEP_FWD_ROUTING) { /* a training forward into a fresh buffer: none of it written */
            comet_forward_args_t g = f;
            memset(j->fresh, 0x5a, j->bytes);
            g.saved = bytes_tensor(j->fresh, (int64_t)j->bytes);
            if (bad && s == STEP_FWD_ROUTING) g.topk_idx.data = j->bad_idx;
            if (s == STEP_FWD_DISABLE) g.disable = COMET_DISABLE_COMM | COMET_DISABLE_GEMM;
            j->st[s] = comet_layer_forward(j->A, &g);
            int same = 1;
            for (size_t i = 0; i < j->bytes; i++) same &= j->fresh[i] == 0x5a;
            j->untouched[s] = same;
            continue;
        }
        if (bad) {
            switch (s) {
            case STEP_OTHER_LAYER_ONE:
            case STEP_OTHER_LAYER_ALL: a.saved.data = j->savedB; break;
            case STEP_SMALL: a.saved.shape[0] = (int64_t)j->bytes - 1; break;
            case STEP_NULL: a.saved.data = NULL; break;
            case STEP_ZEROS: a.saved.data = j->zeros; break;
            case STEP_MISALIGNED: a.saved.data = j->fresh + 1; break;
            case STEP_TOKENS: /* the first T - 1 tokens */
                a.x.shape[0] = a.dy.shape[0] = a.dx.shape[0] = a.topk_idx.shape[0] = T - 1;
                a.topk_w.shape[0] = a.d_topk_w.shape[0] = T - 1;
                break;
            case STEP_ROUTING: a.topk_idx.data = j->bad_idx, a.save = COMET_SAVE_RECOMPUTE; break;
            case STEP_N_COMM: a.n_comm = 65; break;
            }
        }
        poison(b, 0, r);
        j->st[s] = comet_layer_backward(j->A, &a);
        j->untouched[s] = untouched_rank(b, r);
    }
    /* still usable: valid backwards of both layers from their saved states */
    for (int k = 0; k < 2; k++) {
        comet_backward_args_t a = b->args[0][r];
        a.save = COMET_SAVE_ACTIVATIONS, a.saved = bytes_tensor(k ? j->savedB : j->savedA, (int64_t)j->bytes);
        poison(b, 0, r);
        const comet_status_t st = comet_layer_backward(k ? j->B : j->A, &a);
        j->bad_valid[k] = st == COMET_SUCCESS ? diff_rank(b, r) : -1;
    }
    return NULL;
}

static void *create_rank(void *arg) {
    ujob_t *j = arg;
    comet_layer_create(&j->A, j->world, j->rank, &j->b->p->cfg);
    comet_layer_create(&j->B, j->world, j->rank, &j->b->p->cfg);
    return NULL;
}

static void *destroy_rank(void *arg) {
    ujob_t *j = arg;
    comet_layer_destroy(j->A);
    comet_layer_destroy(j->B);
    return NULL;
}

static void test_misuse(int mode) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 16, cfg.ffn = 16, cfg.num_experts = 8, cfg.topk = 2, cfg.tp = 2, cfg.ep = 2;
    cfg.max_tokens_per_rank = 6, cfg.tile_m = 4;
    const int W = 4;
    const int64_t tokens[4] = {5, 3, 6, 4};
    comet_routing_opts_t ro = {0.5, 1, 91};
    bprob_t b;
    if (!bprob_create(&b, &cfg, W, tokens, &ro, mode)) return;
    CHECK(reference(&b) == COMET_SUCCESS, "misuse: reference: %s", comet_last_error());
    comet_world_t *world = make_world(&cfg, W, 2, 0, 0);
    if (!world) {
        bprob_free(&b);
        return;
    }
    ujob_t jobs[4];
    memset(jobs, 0, sizeof jobs);
    for (int r = 0; r < W; r++) {
        ujob_t *j = &jobs[r];
        j->b = &b, j->world = world, j->rank = r;
    }
    run_ranks(W, create_rank, jobs, sizeof jobs[0]);
    for (int r = 0; r < W; r++) {
        ujob_t *j = &jobs[r];
        CHECK(j->A && j->B, "misuse: layers of rank %d not created", r);
        if (!j->A || !j->B) return;
        comet_layer_saved_bytes(j->A, COMET_SAVE_ACTIVATIONS, &j->bytes);
        j->savedA = malloc(j->bytes), j->savedB = malloc(j->bytes), j->zeros = calloc(1, j->bytes);
        j->fresh = malloc(j->bytes + 1);
        const int64_t n = tokens[r] * cfg.topk;
        j->bad_idx = malloc((size_t)n * sizeof(int32_t));
        memcpy(j->bad_idx, b.p->topk_idx[r], (size_t)n * sizeof(int32_t));
        j->bad_idx[n - 1] = (int32_t)cfg.num_experts;
    }
    run_ranks(W, misuse_rank, jobs, sizeof jobs[0]);
    for (int s = 0; s < N_STEPS; s++)
        for (int r = 0; r < W; r++) {
            const int bad = step_rank[s] < 0 || step_rank[s] == r;
            const comet_status_t want = bad ? step_want[s] : COMET_ERR_PEER_FAILED;
            CHECK(jobs[r].st[s] == (step_want[s] == COMET_SUCCESS ? COMET_SUCCESS : want),
                  "misuse (dw %s), %s: rank %d returned %s, want %s", dw_name[mode], step_name[s], r,
                  comet_status_string(jobs[r].st[s]), comet_status_string(want));
            CHECK(jobs[r].untouched[s], "misuse (dw %s), %s: rank %d's %s written", dw_name[mode], step_name[s], r,
                  s >= STEP_FWD_ROUTING ? "saved state" : "outputs");
        }
    for (int r = 0; r < W; r++)
        CHECK(jobs[r].bad_valid[0] == 0 && jobs[r].bad_valid[1] == 0,
              "misuse (dw %s): rank %d's valid backwards afterwards: %lld and %lld elements differ (-1: failed)",
              dw_name[mode], r, (long long)jobs[r].bad_valid[0], (long long)jobs[r].bad_valid[1]);
    run_ranks(W, destroy_rank, jobs, sizeof jobs[0]);
    for (int r = 0; r < W; r++)
        free(jobs[r].savedA), free(jobs[r].savedB), free(jobs[r].zeros), free(jobs[r].fresh), free(jobs[r].bad_idx);
    comet_world_destroy(world);
    bprob_free(&b);
}

/* ---- no tokens, no data ---------------------------------------------------------
 * T = 0 on rank 0 with every (T, .) tensor's data NULL: the other rank's
 * outputs still the reference's. */
static void test_empty_null(void) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 16, cfg.ffn = 8, cfg.num_experts = 4, cfg.topk = 2, cfg.ep = 2, cfg.max_tokens_per_rank = 5;
    cfg.tile_m = 2;
    bprob_t b;
    const int64_t tokens[2] = {0, 5};
    comet_routing_opts_t ro = {0, 0, 9};
    if (!bprob_create(&b, &cfg, 2, tokens, &ro, DW_FP32)) return;
    for (int k = 0; k < 2; k++) {
        comet_backward_args_t *a = &b.args[k][0];
        a->x.data = a->topk_idx.data = a->topk_w.data = a->dy.data = a->dx.data = a->d_topk_w.data = NULL;
    }
    b.p->args[0].x.data = b.p->args[0].topk_idx.data = b.p->args[0].topk_w.data = b.p->args[0].y.data = NULL;
    CHECK(reference(&b) == COMET_SUCCESS, "T = 0 with NULL data: reference: %s", comet_last_error());
    comet_world_t *world = make_world(&cfg, 2, 2, 0, 0);
    mjob_t jobs[2];
    memset(jobs, 0, sizeof jobs);
    for (int r = 0; r < 2; r++) jobs[r].b = &b, jobs[r].world = world, jobs[r].rank = r, jobs[r].n_comm = 0;
    if (world) run_ranks(2, matrix_rank, jobs, sizeof jobs[0]);
    for (int r = 0; world && r < 2; r++) {
        CHECK(jobs[r].st == COMET_SUCCESS, "T = 0 with NULL data: %s", jobs[r].msg);
        for (int k = 0; k < CALLS; k++)
            CHECK(jobs[r].bad[k] == 0, "T = 0 with NULL data: rank %d, backward %d: %lld elements differ", r, k,
                  (long long)jobs[r].bad[k]);
    }
    comet_world_destroy(world);
    bprob_free(&b);
}

int main(void) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    test_empty_null();
    for (int mode = 0; mode < 3; mode++) test_misuse(mode);
    test_matrix();
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("test_engine_backward: %.2f s\n", (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    return check_summary("test_engine_backward");
}
