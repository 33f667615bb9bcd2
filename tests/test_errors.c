/*
 * test_errors.c - bad input gets the documented status, a message naming what
 * is wrong, and writes nothing:
 *   configs:  every field out of range, E not divisible by EP, ffn not
 *             divisible by TP, topk > E or < 1, world size mismatch, sizes
 *             whose byte counts overflow or pass 2^48 (at check and create)
 *   forward:  expert id out of range or negative or repeated, null data,
 *             wrong or too-small shapes and dtypes, T above the maximum,
 *             struct sizes, chunk widths that differ across ranks; the rank
 *             with the bad input gets the specific status, its peers
 *             COMET_ERR_PEER_FAILED, every output keeps its poison, and the
 *             next valid call on the same layers is correct
 *   ranks:    a config invalid on one rank only (its peers PEER_FAILED at
 *             once, the world still usable), n_comm above the CPU engine's 64
 *             on every rank, a world destroyed while a layer lives
 *   waits:    a rank that never arrives makes the others time out with a
 *             message naming rank and role
 *   misc:     status strings, NULL handles, the reference's own checks
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../harness/workload.h"
#include "check.h"

static int has(const char *haystack, const char *needle) { return strstr(haystack, needle) != NULL; }

static comet_layer_config_t base_config(void) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 16, cfg.ffn = 8, cfg.num_experts = 4, cfg.topk = 2, cfg.tp = 1, cfg.ep = 2;
    cfg.max_tokens_per_rank = 6, cfg.tile_m = 4;
    return cfg;
}

static void test_config(void) {
    comet_layer_config_t c;
#define EXPECT(stmt, status, text)                                                                     \
    do {                                                                                               \
        c = base_config();                                                                             \
        stmt;                                                                                          \
        comet_status_t st = comet_layer_config_check(&c, 2);                                           \
        CHECK(st == (status) && has(comet_last_error(), text), "%s: got %s \"%s\"", #stmt,            \
              comet_status_string(st), comet_last_error());                                            \
    } while (0)
    EXPECT((void)0, COMET_SUCCESS, "");
    EXPECT(c.hidden = 0, COMET_ERR_INVALID_ARGUMENT, "hidden");
    EXPECT(c.ffn = -3, COMET_ERR_INVALID_ARGUMENT, "ffn");
    EXPECT(c.num_experts = 0, COMET_ERR_INVALID_ARGUMENT, "num_experts");
    EXPECT(c.topk = 0, COMET_ERR_INVALID_ARGUMENT, "topk");
    EXPECT(c.topk = 5, COMET_ERR_INVALID_ARGUMENT, "topk");
    EXPECT(c.num_experts = 5, COMET_ERR_INVALID_ARGUMENT, "not divisible by config.ep");
    EXPECT((c.tp = 2, c.ep = 1, c.ffn = 7), COMET_ERR_INVALID_ARGUMENT, "not divisible by config.tp");
    EXPECT(c.tp = 2, COMET_ERR_INVALID_ARGUMENT, "world has 2 ranks");
    EXPECT(c.ep = 0, COMET_ERR_INVALID_ARGUMENT, "config.ep");
    EXPECT(c.max_tokens_per_rank = 0, COMET_ERR_INVALID_ARGUMENT, "max_tokens_per_rank");
    EXPECT(c.tile_m = -1, COMET_ERR_INVALID_ARGUMENT, "tile_m");
    EXPECT(c.activation = (comet_activation_t)7, COMET_ERR_INVALID_ARGUMENT, "activation");
    EXPECT(c.dtype = COMET_DTYPE_FP16, COMET_ERR_UNSUPPORTED, "only bf16");
    EXPECT(c.struct_size = 8, COMET_ERR_INVALID_ARGUMENT, "COMET_LAYER_CONFIG_INIT");
    /* sizes whose byte counts overflow, or pass 2^48 bytes: refused, naming the field */
    const int64_t huge = (int64_t)1 << 62;
    EXPECT(c.max_tokens_per_rank = huge, COMET_ERR_INVALID_ARGUMENT, "max_tokens_per_rank");
    EXPECT(c.hidden = huge, COMET_ERR_INVALID_ARGUMENT, "hidden");
    EXPECT(c.ffn = huge, COMET_ERR_INVALID_ARGUMENT, "ffn");
    EXPECT((c.num_experts = huge, c.topk = 1), COMET_ERR_INVALID_ARGUMENT, "num_experts");
    EXPECT(c.tile_m = 0x7fffffff, COMET_ERR_INVALID_ARGUMENT, "tile_m");
    EXPECT((c.max_tokens_per_rank = 1 << 20, c.hidden = 0x7fffffff), COMET_ERR_INVALID_ARGUMENT, "hidden");
    EXPECT((c.hidden = 1 << 30, c.ffn = 1 << 30), COMET_ERR_INVALID_ARGUMENT, "ffn");
    EXPECT((c.max_tokens_per_rank = 1 << 28, c.hidden = 1 << 18), COMET_ERR_INVALID_ARGUMENT, "max_tokens_per_rank");
    EXPECT((c.max_tokens_per_rank = 1 << 20, c.hidden = 1 << 12, c.ffn = 1 << 12), COMET_SUCCESS, "");
#undef EXPECT
    CHECK(comet_layer_config_check(NULL, 2) == COMET_ERR_INVALID_ARGUMENT, "NULL config");
}

/* The same configs at create, on one rank: refused before anything is sized
 * (they used to get tiny buffers and corrupt memory). */
static void test_huge_create(void) {
    comet_world_t *w = NULL;
    comet_world_create_local(&w, 1, COMET_BACKEND_CPU);
    const int64_t huge = (int64_t)1 << 62;
    for (int i = 0; i < 4; i++) {
        comet_layer_config_t c = base_config();
        c.ep = 1;
        if (i == 0) c.max_tokens_per_rank = huge;
        if (i == 1) c.hidden = huge;
        if (i == 2) c.ffn = huge;
        if (i == 3) c.max_tokens_per_rank = huge / 2, c.hidden = 4;
        comet_layer_t *l = NULL;
        comet_status_t st = comet_layer_create(&l, w, 0, &c);
        CHECK((st == COMET_ERR_INVALID_ARGUMENT || st == COMET_ERR_OUT_OF_MEMORY) && !l, "huge config %d: %s \"%s\"", i,
              comet_status_string(st), comet_last_error());
        comet_layer_destroy(l);
    }
    CHECK(comet_world_destroy(w) == COMET_SUCCESS, "destroy");
}

/* ---- forward with one bad rank -------------------------------------------- */
typedef struct {
    comet_problem_t *p;
    comet_world_t *world;
    comet_forward_args_t bad[2];
    comet_status_t first[2], second[2];
    char msg[2][512];
} bad_job_t;

typedef struct {
    bad_job_t *job;
    int rank;
} bad_rank_t;

static void *bad_rank_main(void *arg) {
    bad_rank_t *br = arg;
    bad_job_t *j = br->job;
    int r = br->rank;
    comet_layer_t *layer = NULL;
    comet_status_t st = comet_layer_create(&layer, j->world, r, &j->p->cfg);
    if (st) {
        j->first[r] = j->second[r] = st;
        return NULL;
    }
    j->first[r] = comet_layer_forward(layer, &j->bad[r]);
    snprintf(j->msg[r], sizeof j->msg[r], "%s", comet_last_error());
    j->second[r] = comet_layer_forward(layer, &j->p->args[r]);
    comet_layer_destroy(layer);
    return NULL;
}

typedef void (*edit_fn)(comet_forward_args_t *, comet_problem_t *);

/* Rank 1's args with its routing redirected to a private copy (so edits of the
 * data cannot leak into later good calls), then edited. */
static comet_forward_args_t bad_args(comet_problem_t *p, edit_fn edit, int32_t *idx_copy) {
    comet_forward_args_t a = p->args[1];
    memcpy(idx_copy, p->topk_idx[1], sizeof(int32_t) * (size_t)(p->tokens[1] * p->cfg.topk));
    a.topk_idx.data = idx_copy;
    edit(&a, p);
    return a;
}

/* Run a forward where rank 1 passes edited args; expect status want on rank 1
 * with text in its message, PEER_FAILED on rank 0 (or want_peer), nothing
 * written; then a good call on the same layers must match the reference. */
static void expect_bad_forward(comet_problem_t *p, const char *what, edit_fn edit, comet_status_t want,
                               comet_status_t want_peer, const char *text) {
    bad_job_t j;
    int32_t idx_copy[64];
    memset(&j, 0, sizeof j);
    j.p = p;
    j.bad[0] = p->args[0];
    j.bad[1] = bad_args(p, edit, idx_copy);
    comet_world_create_local(&j.world, 2, COMET_BACKEND_CPU);
    bad_rank_t br[2] = {{&j, 0}, {&j, 1}};
    pthread_t th[2];
    for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, bad_rank_main, &br[r]);
    for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
    CHECK(j.first[1] == want && has(j.msg[1], text), "%s: rank 1 got %s \"%s\"", what,
          comet_status_string(j.first[1]), j.msg[1]);
    CHECK(j.first[0] == want_peer, "%s: rank 0 got %s \"%s\"", what, comet_status_string(j.first[0]), j.msg[0]);
    CHECK(want_peer != COMET_ERR_PEER_FAILED || has(j.msg[0], "rank 1"), "%s: peer message names rank 1: %s", what, j.msg[0]);
    CHECK(j.second[0] == COMET_SUCCESS && j.second[1] == COMET_SUCCESS, "%s: the next good call failed: %s / %s", what,
          comet_status_string(j.second[0]), comet_status_string(j.second[1]));
    comet_reference_forward(&p->cfg, 2, p->ref_args);
    CHECK(comet_problem_count_mismatch(p) == 0, "%s: next good call differs from the reference", what);
    comet_world_destroy(j.world);
}

/* The bad call alone: every output must keep its poison. */
static void expect_nothing_written(comet_problem_t *p, const char *what, edit_fn edit) {
    comet_world_t *world;
    int32_t idx_copy[64];
    comet_world_create_local(&world, 2, COMET_BACKEND_CPU);
    comet_problem_poison(p);
    comet_forward_args_t saved = p->args[1];
    p->args[1] = bad_args(p, edit, idx_copy);
    comet_run_t run;
    memset(&run, 0, sizeof run);
    comet_status_t st = comet_problem_run(p, world, &run, 0);
    p->args[1] = saved;
    CHECK(st != COMET_SUCCESS, "%s: bad call succeeded", what);
    int64_t total = p->tokens[0] * p->cfg.hidden + p->tokens[1] * p->cfg.hidden;
    CHECK(comet_problem_count_poison(p) == total, "%s: %lld of %lld outputs were written", what, (long long)(total - comet_problem_count_poison(p)),
          (long long)total);
    comet_world_destroy(world);
}

static void e_range(comet_forward_args_t *a, comet_problem_t *p) { ((int32_t *)a->topk_idx.data)[3] = 4; (void)p; }
static void e_negative(comet_forward_args_t *a, comet_problem_t *p) { ((int32_t *)a->topk_idx.data)[0] = -1; (void)p; }
static void e_repeat(comet_forward_args_t *a, comet_problem_t *p) {
    int32_t *idx = a->topk_idx.data;
    idx[5] = idx[4];
    (void)p;
}
static void e_null_x(comet_forward_args_t *a, comet_problem_t *p) { a->x.data = NULL; (void)p; }
static void e_small_y(comet_forward_args_t *a, comet_problem_t *p) { a->y.shape[0] -= 1; (void)p; }
static void e_w1_shape(comet_forward_args_t *a, comet_problem_t *p) { a->w1.shape[1] = 3; (void)p; }
static void e_w_dtype(comet_forward_args_t *a, comet_problem_t *p) { a->topk_w.dtype = COMET_DTYPE_BF16; (void)p; }
static void e_too_many(comet_forward_args_t *a, comet_problem_t *p) {
    a->x.shape[0] = a->y.shape[0] = a->topk_idx.shape[0] = a->topk_w.shape[0] = p->cfg.max_tokens_per_rank + 1;
}
static void e_size(comet_forward_args_t *a, comet_problem_t *p) { a->struct_size = 4; (void)p; }
static void e_chunk(comet_forward_args_t *a, comet_problem_t *p) { a->chunk_cols = (int)p->cfg.hidden + 1; }
static void e_ncomm(comet_forward_args_t *a, comet_problem_t *p) { a->n_comm = -2; (void)p; }
static void e_ncomm_big(comet_forward_args_t *a, comet_problem_t *p) { a->n_comm = 65; (void)p; }
static void e_ncomm_max(comet_forward_args_t *a, comet_problem_t *p) { a->n_comm = 0x7fffffff; (void)p; }
static void e_chunk_negative(comet_forward_args_t *a, comet_problem_t *p) { a->chunk_cols = -8; (void)p; }
static void e_chunk_differs(comet_forward_args_t *a, comet_problem_t *p) { a->chunk_cols = 5; (void)p; }
static void e_disable(comet_forward_args_t *a, comet_problem_t *p) { a->disable = 4; (void)p; }

static void test_forward(void) {
    comet_layer_config_t cfg = base_config();
    int64_t tokens[2] = {6, 5};
    comet_routing_opts_t ro = {0, 0, 3};
    comet_problem_t *p;
    if (comet_problem_create(&p, &cfg, 2, tokens, &ro)) {
        CHECK(0, "problem: %s", comet_last_error());
        return;
    }
    struct {
        const char *what;
        edit_fn edit;
        comet_status_t want, peer;
        const char *text;
    } cases[] = {
        {"expert id out of range", e_range, COMET_ERR_INVALID_ROUTING, COMET_ERR_PEER_FAILED, "topk_idx[1, 1] = 4"},
        {"negative expert id", e_negative, COMET_ERR_INVALID_ROUTING, COMET_ERR_PEER_FAILED, "= -1"},
        {"repeated expert", e_repeat, COMET_ERR_INVALID_ROUTING, COMET_ERR_PEER_FAILED, "repeats expert"},
        {"null x", e_null_x, COMET_ERR_INVALID_ARGUMENT, COMET_ERR_PEER_FAILED, "x.data is NULL"},
        {"y too small", e_small_y, COMET_ERR_INVALID_SHAPE, COMET_ERR_PEER_FAILED, "y: expected bf16 (5, 16), got bf16 (4, 16)"},
        {"w1 wrong shape", e_w1_shape, COMET_ERR_INVALID_SHAPE, COMET_ERR_PEER_FAILED, "w1: expected"},
        {"topk_w wrong dtype", e_w_dtype, COMET_ERR_INVALID_SHAPE, COMET_ERR_PEER_FAILED, "topk_w"},
        {"tokens above max", e_too_many, COMET_ERR_INVALID_SHAPE, COMET_ERR_PEER_FAILED, "max_tokens_per_rank=6"},
        {"struct size", e_size, COMET_ERR_INVALID_ARGUMENT, COMET_ERR_PEER_FAILED, "COMET_FORWARD_ARGS_INIT"},
        {"chunk too wide", e_chunk, COMET_ERR_INVALID_ARGUMENT, COMET_ERR_PEER_FAILED, "chunk_cols"},
        {"negative n_comm", e_ncomm, COMET_ERR_INVALID_ARGUMENT, COMET_ERR_PEER_FAILED, "n_comm"},
        {"n_comm above 64", e_ncomm_big, COMET_ERR_INVALID_ARGUMENT, COMET_ERR_PEER_FAILED, "args.n_comm 65"},
        {"n_comm INT_MAX", e_ncomm_max, COMET_ERR_INVALID_ARGUMENT, COMET_ERR_PEER_FAILED, "args.n_comm"},
        {"negative chunk", e_chunk_negative, COMET_ERR_INVALID_ARGUMENT, COMET_ERR_PEER_FAILED, "chunk_cols"},
        {"unknown disable bits", e_disable, COMET_ERR_INVALID_ARGUMENT, COMET_ERR_PEER_FAILED, "args.disable"},
        {"chunk differs across ranks", e_chunk_differs, COMET_ERR_INVALID_ARGUMENT, COMET_ERR_INVALID_ARGUMENT,
         "chunk_cols differ across ranks"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        expect_nothing_written(p, cases[i].what, cases[i].edit);
        expect_bad_forward(p, cases[i].what, cases[i].edit, cases[i].want, cases[i].peer, cases[i].text);
    }
    /* the reference checks the same things and writes nothing */
    comet_problem_poison(p);
    ((int32_t *)p->ref_args[1].topk_idx.data)[2] = 9;
    comet_status_t st = comet_reference_forward(&p->cfg, 2, p->ref_args);
    CHECK(st == COMET_ERR_INVALID_ROUTING && has(comet_last_error(), "rank 1"), "reference bad routing: %s %s",
          comet_status_string(st), comet_last_error());
    int64_t poisoned = 0;
    for (int s = 0; s < 2; s++)
        for (int64_t i = 0; i < p->tokens[s] * cfg.hidden; i++) poisoned += p->y_ref[s][i] == 0xffff;
    CHECK(poisoned == (6 + 5) * cfg.hidden, "reference wrote %lld outputs on bad input", (long long)((6 + 5) * cfg.hidden - poisoned));
    CHECK(comet_reference_forward(&p->cfg, 2, NULL) == COMET_ERR_INVALID_ARGUMENT, "reference NULL inputs");
    comet_problem_destroy(p);
}

/* ---- handles, worlds, collective mismatch ------------------------------------ */
typedef struct {
    comet_world_t *world;
    comet_layer_config_t cfg;
    int rank;
    comet_status_t st;
    char msg[512];
    comet_memory_t mem;
} create_job_t;

static void *create_rank(void *arg) {
    create_job_t *j = arg;
    comet_layer_t *l = NULL;
    j->st = comet_layer_create(&l, j->world, j->rank, &j->cfg);
    snprintf(j->msg, sizeof j->msg, "%s", comet_last_error());
    if (l) comet_layer_memory(l, &j->mem);
    comet_layer_destroy(l);
    return NULL;
}

static void *forward_alone(void *arg) {
    create_job_t *j = arg;
    comet_layer_t *l = NULL;
    j->st = comet_layer_create(&l, j->world, j->rank, &j->cfg);
    if (j->st == COMET_SUCCESS && j->rank == 0) {
        uint16_t x[16], y[16], w1[2 * 8 * 16 * 2], w2[2 * 16 * 8];
        int32_t idx[2] = {0, 1};
        float w[2] = {0.5f, 0.5f};
        memset(x, 0x3f, sizeof x), memset(w1, 0x3c, sizeof w1), memset(w2, 0x3c, sizeof w2);
        comet_forward_args_t a = COMET_FORWARD_ARGS_INIT;
        a.x = comet_tensor_2d(x, COMET_DTYPE_BF16, 1, 16);
        a.topk_idx = comet_tensor_2d(idx, COMET_DTYPE_INT32, 1, 2);
        a.topk_w = comet_tensor_2d(w, COMET_DTYPE_FP32, 1, 2);
        a.w1 = comet_tensor_3d(w1, COMET_DTYPE_BF16, 2, 16, 16);
        a.w2 = comet_tensor_3d(w2, COMET_DTYPE_BF16, 2, 16, 8);
        a.y = comet_tensor_2d(y, COMET_DTYPE_BF16, 1, 16);
        j->st = comet_layer_forward(l, &a);
        snprintf(j->msg, sizeof j->msg, "%s", comet_last_error());
    }
    /* rank 1 never calls forward; once rank 0 has returned no worker runs,
     * so both layers can be destroyed */
    comet_layer_destroy(l);
    return NULL;
}

static void test_handles(void) {
    comet_world_t *w = NULL;
    CHECK(comet_world_create_local(&w, 0, COMET_BACKEND_CPU) == COMET_ERR_INVALID_ARGUMENT && w == NULL, "0 ranks");
    if (comet_device_count() == 0)
        CHECK(comet_world_create_local(&w, 2, COMET_BACKEND_CUDA) == COMET_ERR_UNSUPPORTED && w == NULL,
              "CUDA backend without a GPU: %s", comet_last_error());
    CHECK(comet_world_create_local(NULL, 2, COMET_BACKEND_CPU) == COMET_ERR_INVALID_ARGUMENT, "NULL out");
    CHECK(comet_world_destroy(NULL) == COMET_SUCCESS && comet_layer_destroy(NULL) == COMET_SUCCESS, "destroy(NULL)");
    CHECK(comet_layer_forward(NULL, NULL) == COMET_ERR_INVALID_ARGUMENT, "forward on NULL layer");
    comet_world_create_local(&w, 2, COMET_BACKEND_CPU);
    comet_layer_t *l = NULL;
    comet_layer_config_t cfg = base_config();
    CHECK(comet_layer_create(&l, w, 2, &cfg) == COMET_ERR_INVALID_ARGUMENT && l == NULL, "rank out of range");
    CHECK(comet_layer_create(&l, NULL, 0, &cfg) == COMET_ERR_INVALID_ARGUMENT, "NULL world");
    CHECK(comet_world_size(w) == 2, "world size");
    CHECK(comet_world_local_rank(w) == -1 && comet_world_device(w, 0) == -1, "a CPU world: all ranks here, no devices");
    comet_unique_id_t id;
    memset(&id, 0, sizeof id);
    comet_world_t *ext = NULL;
    CHECK(comet_world_create_nccl(&ext, 0, 2, NULL, 0) == COMET_ERR_INVALID_ARGUMENT && !ext, "NULL id");
    CHECK(comet_world_create_nccl(&ext, 2, 2, &id, 0) == COMET_ERR_INVALID_ARGUMENT && !ext, "rank >= world size");
    CHECK(comet_world_create_nccl(&ext, 0, 2, &id, -1) == COMET_ERR_INVALID_ARGUMENT && !ext, "negative device");
    if (comet_device_count() == 0)
        CHECK(comet_world_create_nccl(&ext, 0, 2, &id, 0) == COMET_ERR_UNSUPPORTED && !ext,
              "a spread world without a GPU: %s", comet_last_error());

    /* ranks that disagree on the config all fail */
    create_job_t jobs[2] = {{w, cfg, 0, 0, "", {0, 0}}, {w, cfg, 1, 0, "", {0, 0}}};
    jobs[1].cfg.ffn = 16;
    pthread_t th[2];
    for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, create_rank, &jobs[r]);
    for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
    CHECK(jobs[0].st == COMET_ERR_INVALID_ARGUMENT && jobs[1].st == COMET_ERR_INVALID_ARGUMENT &&
              has(jobs[0].msg, "different arguments"), "config mismatch: %s / %s (%s)", comet_status_string(jobs[0].st),
          comet_status_string(jobs[1].st), jobs[0].msg);
    /* and the world still works afterwards */
    jobs[1].cfg = cfg;
    for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, create_rank, &jobs[r]);
    for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
    CHECK(jobs[0].st == COMET_SUCCESS && jobs[1].st == COMET_SUCCESS, "create after a mismatch: %s", jobs[0].msg);
    /* memory report: at least the partials (W, max_T, H) fp32 are symmetric, and
     * the gathered rows (W * max_T * min(topk, E_local), H) bf16 are private */
    CHECK(jobs[0].mem.symmetric_bytes >= (size_t)(2 * 6 * 16 * 4) && jobs[0].mem.symmetric_bytes < (1u << 20),
          "symmetric bytes %zu", jobs[0].mem.symmetric_bytes);
    CHECK(jobs[0].mem.private_bytes >= (size_t)(2 * 6 * 2 * 16 * 2), "private bytes %zu", jobs[0].mem.private_bytes);
    CHECK(comet_layer_memory(NULL, &jobs[0].mem) == COMET_ERR_INVALID_ARGUMENT, "memory of a NULL layer");
    CHECK(comet_world_destroy(w) == COMET_SUCCESS, "destroy world");

    /* status strings: one per code, distinct */
    int distinct = 1;
    for (int a = 0; a < COMET_NUM_STATUS; a++)
        for (int b = 0; b < a; b++) distinct &= strcmp(comet_status_string(a), comet_status_string(b)) != 0;
    CHECK(distinct, "status strings distinct");
    CHECK(strcmp(comet_status_string((comet_status_t)99), "COMET_ERR_UNKNOWN") == 0, "unknown status");
    CHECK(comet_version() == COMET_VERSION_CODE, "version");
}

/* ---- a world destroyed before its layers ---------------------------------------- */
static void test_destroy_live_world(void) {
    comet_world_t *w = NULL;
    comet_world_create_local(&w, 1, COMET_BACKEND_CPU);
    comet_layer_config_t cfg = base_config();
    cfg.ep = 1;
    comet_layer_t *l = NULL;
    CHECK(comet_layer_create(&l, w, 0, &cfg) == COMET_SUCCESS, "create: %s", comet_last_error());
    comet_status_t st = comet_world_destroy(w);
    CHECK(st == COMET_ERR_INVALID_ARGUMENT && has(comet_last_error(), "1 layer"), "destroy with a live layer: %s \"%s\"",
          comet_status_string(st), comet_last_error());
    if (st == COMET_SUCCESS) return; /* the world is gone: the layer cannot be destroyed any more */
    CHECK(comet_layer_destroy(l) == COMET_SUCCESS, "layer destroy after the refused world destroy");
    CHECK(comet_world_destroy(w) == COMET_SUCCESS, "world destroy once its layers are gone: %s", comet_last_error());
}

/* ---- n_comm out of range on every rank ------------------------------------------ */
/* Every rank fails with INVALID_ARGUMENT (no worker started) and the next
 * valid call on the same world succeeds. */
static void test_n_comm_all_ranks(void) {
    setenv("COMET_TIMEOUT_MS", "3000", 1);
    comet_world_t *w;
    comet_world_create_local(&w, 2, COMET_BACKEND_CPU);
    unsetenv("COMET_TIMEOUT_MS");
    comet_layer_config_t cfg = base_config();
    int64_t tokens[2] = {6, 4};
    comet_routing_opts_t ro = {0, 0, 11};
    comet_problem_t *p;
    if (comet_problem_create(&p, &cfg, 2, tokens, &ro) != COMET_SUCCESS) {
        CHECK(0, "problem: %s", comet_last_error());
        comet_world_destroy(w);
        return;
    }
    const int bad[] = {65, 200000, 0x7fffffff};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        comet_run_t run;
        memset(&run, 0, sizeof run);
        run.n_comm = bad[i];
        comet_status_t st = comet_problem_run(p, w, &run, 0);
        CHECK(st == COMET_ERR_INVALID_ARGUMENT && has(comet_last_error(), "n_comm"), "n_comm %d on every rank: %s %s",
              bad[i], comet_status_string(st), comet_last_error());
        comet_problem_poison(p);
        memset(&run, 0, sizeof run);
        st = comet_problem_run(p, w, &run, 0);
        comet_reference_forward(&p->cfg, 2, p->ref_args);
        CHECK(st == COMET_SUCCESS && comet_problem_count_mismatch(p) == 0, "valid call after n_comm %d: %s %s", bad[i],
              comet_status_string(st), comet_last_error());
    }
    comet_problem_destroy(p);
    CHECK(comet_world_destroy(w) == COMET_SUCCESS, "destroy: %s", comet_last_error());
}

/* ---- a config invalid on one rank only ---------------------------------------- */
static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

typedef struct {
    create_job_t job;
    int delay_ms; /* before create: which rank arrives first */
    double ms;    /* create's own time */
} timed_create_t;

static void *timed_create(void *arg) {
    timed_create_t *t = arg;
    if (t->delay_ms) nanosleep(&(struct timespec){0, t->delay_ms * 1000000L}, NULL);
    comet_layer_t *l = NULL;
    double t0 = now_ms();
    t->job.st = comet_layer_create(&l, t->job.world, t->job.rank, &t->job.cfg);
    t->ms = now_ms() - t0;
    snprintf(t->job.msg, sizeof t->job.msg, "%s", comet_last_error());
    comet_layer_destroy(l);
    return NULL;
}

/* Rank `bad` brings hidden = 0: it gets INVALID_ARGUMENT, its peer
 * PEER_FAILED at once (not after the 4 s timeout), and the world still runs
 * a valid layer and can be destroyed. */
static void one_rank_bad_config(int bad, int bad_delay_ms, int good_delay_ms) {
    setenv("COMET_TIMEOUT_MS", "4000", 1);
    comet_world_t *w;
    comet_world_create_local(&w, 2, COMET_BACKEND_CPU);
    unsetenv("COMET_TIMEOUT_MS");
    timed_create_t t[2];
    memset(t, 0, sizeof t);
    pthread_t th[2];
    for (int r = 0; r < 2; r++) {
        t[r].job.world = w, t[r].job.cfg = base_config(), t[r].job.rank = r;
        t[r].delay_ms = r == bad ? bad_delay_ms : good_delay_ms;
    }
    t[bad].job.cfg.hidden = 0;
    for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, timed_create, &t[r]);
    for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
    const int good = 1 - bad;
    CHECK(t[bad].job.st == COMET_ERR_INVALID_ARGUMENT && has(t[bad].job.msg, "hidden"), "bad rank %d: %s \"%s\"", bad,
          comet_status_string(t[bad].job.st), t[bad].job.msg);
    CHECK(t[good].job.st == COMET_ERR_PEER_FAILED && t[good].ms < 2000 && has(t[good].job.msg, bad ? "rank 1" : "rank 0"),
          "its peer: %s after %.0f ms \"%s\"",
          comet_status_string(t[good].job.st), t[good].ms, t[good].job.msg);
    /* the ranks' collective calls are still in step: a valid layer runs */
    comet_layer_config_t cfg = base_config();
    int64_t tokens[2] = {6, 3};
    comet_routing_opts_t ro = {0, 0, 7};
    comet_problem_t *p;
    if (comet_problem_create(&p, &cfg, 2, tokens, &ro) == COMET_SUCCESS) {
        comet_problem_poison(p);
        comet_run_t run;
        memset(&run, 0, sizeof run);
        comet_status_t st = comet_problem_run(p, w, &run, 0);
        CHECK(st == COMET_SUCCESS, "valid layer after one rank's bad config: %s %s", comet_status_string(st),
              comet_last_error());
        comet_reference_forward(&p->cfg, 2, p->ref_args);
        CHECK(st != COMET_SUCCESS || comet_problem_count_mismatch(p) == 0, "valid layer differs from the reference");
        comet_problem_destroy(p);
    }
    CHECK(comet_world_destroy(w) == COMET_SUCCESS, "destroy the world after one rank's bad config: %s",
          comet_last_error());
}

static void test_one_rank_bad_config(void) {
    one_rank_bad_config(1, 0, 0);
    one_rank_bad_config(1, 0, 50); /* the bad rank arrives first */
    one_rank_bad_config(0, 50, 0); /* last */
}

static void test_timeout(void) {
    setenv("COMET_TIMEOUT_MS", "300", 1);
    comet_world_t *w;
    comet_world_create_local(&w, 2, COMET_BACKEND_CPU);
    unsetenv("COMET_TIMEOUT_MS");
    create_job_t jobs[2] = {{w, base_config(), 0, 0, "", {0, 0}}, {w, base_config(), 1, 0, "", {0, 0}}};
    pthread_t th[2];
    for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, forward_alone, &jobs[r]);
    for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
    CHECK(jobs[0].st == COMET_ERR_TIMEOUT && has(jobs[0].msg, "rank 0 host") && has(jobs[0].msg, "rank 1 to enter"),
          "missing rank: %s \"%s\"", comet_status_string(jobs[0].st), jobs[0].msg);
    CHECK(comet_world_destroy(w) == COMET_SUCCESS, "destroy an aborted world");
}

/* A rank that creates a layer alone times out; a rank that comes after that
 * is refused at once (the world ran a timeout), makes nothing, and the world
 * can still be destroyed. */
static void *create_alone(void *arg) {
    create_job_t *j = arg;
    comet_layer_t *l = NULL;
    j->st = comet_layer_create(&l, j->world, j->rank, &j->cfg);
    snprintf(j->msg, sizeof j->msg, "%s", comet_last_error());
    comet_layer_destroy(l);
    return NULL;
}

static void test_late_rank(void) {
    setenv("COMET_TIMEOUT_MS", "200", 1);
    comet_world_t *w;
    comet_world_create_local(&w, 2, COMET_BACKEND_CPU);
    unsetenv("COMET_TIMEOUT_MS");
    create_job_t jobs[2] = {{w, base_config(), 0, 0, "", {0, 0}}, {w, base_config(), 1, 0, "", {0, 0}}};
    pthread_t th;
    pthread_create(&th, NULL, create_alone, &jobs[0]);
    pthread_join(th, NULL);
    CHECK(jobs[0].st == COMET_ERR_TIMEOUT, "alone: %s \"%s\"", comet_status_string(jobs[0].st), jobs[0].msg);
    const double t0 = now_ms();
    pthread_create(&th, NULL, create_alone, &jobs[1]);
    pthread_join(th, NULL);
    CHECK(jobs[1].st == COMET_ERR_TIMEOUT && now_ms() - t0 < 150 && has(jobs[1].msg, "timed out before"),
          "late: %s \"%s\" after %.0f ms", comet_status_string(jobs[1].st), jobs[1].msg, now_ms() - t0);
    CHECK(comet_world_destroy(w) == COMET_SUCCESS, "destroy a world with a call some rank never joined: %s",
          comet_last_error());
}

int main(void) {
    test_config();
    test_huge_create();
    test_forward();
    test_handles();
    test_one_rank_bad_config();
    test_destroy_live_world();
    test_n_comm_all_ranks();
    test_timeout();
    test_late_rank();
    return check_summary("test_errors");
}
