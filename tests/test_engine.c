/*
 * test_engine.c - the multi-rank CPU engine against the reference.
 *   exact:   inputs built so that every rounding point is exact; the engine
 *            and the reference must both produce the hand-computed answer
 *   matrix:  random problems over W in {1,2,4,8}, every (TP, EP), topk 1..8,
 *            E 1..512, tokens per rank 0..max (including 1 and T not a
 *            multiple of tile_m), uniform and skewed routing, empty experts,
 *            n_comm 1..16; output bitwise equal to the reference, every
 *            element written (outputs poisoned first)
 *   epochs:  one layer, many forwards with fresh inputs, chunk widths and
 *            n_comm per call: every call equal to the reference
 *   timed:   the runner's comet_run_t.timed marks the timed calls once,
 *            from one thread, after the warm-up
 *   check:   the tolerance check the GPU runs are judged by
 *            (comet_problem_check) passes the engine's output and one-ulp
 *            changes, and fails a changed element and a missing expert row
 *   empty:   T = 0 with NULL data pointers (no NULL reaches memcpy: UBSan)
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "../src/core/numerics.h"
#include "../harness/workload.h"
#include "check.h"

static comet_status_t run_engine(comet_problem_t *p, int n_comm, int chunk_cols, int repeats) {
    comet_world_t *world;
    comet_status_t st = comet_world_create_local(&world, p->world_size, COMET_BACKEND_CPU);
    if (st) return st;
    comet_run_t run;
    memset(&run, 0, sizeof run);
    run.n_comm = n_comm, run.chunk_cols = chunk_cols, run.repeats = repeats;
    st = comet_problem_run(p, world, &run, 0);
    comet_world_destroy(world);
    return st;
}

/* ---- exact ------------------------------------------------------------------
 * x[t] = (1, a_t, 0, ...); gate row n of expert e = (32, 0, ...) so g = 32 and
 * silu(g) = 32 exactly in fp32; up row n = (n, e+1, 0, ...) so u = n+(e+1)a_t;
 * h = 32u (<= 4 significant bits); W2[e][c][n] = 1/32 if n == c mod F, so
 * o[c] = u_{c mod F}; weights 1/2, 1/4, ... make every sum exact. */
static void test_exact(int tp, int ep) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 8, cfg.ffn = 4, cfg.num_experts = 4, cfg.topk = 2, cfg.tp = tp, cfg.ep = ep;
    cfg.max_tokens_per_rank = 5, cfg.tile_m = 2;
    const int w = tp * ep;
    int64_t tokens[4] = {5, 3, 1, 4};
    comet_routing_opts_t ro = {0, 0, 1};
    comet_problem_t *p;
    if (comet_problem_create(&p, &cfg, w, tokens, &ro) != COMET_SUCCESS) {
        CHECK(0, "problem: %s", comet_last_error());
        return;
    }
    const int64_t hd = 8, f = 4;
    memset(p->w1_full, 0, (size_t)(4 * 2 * f * hd) * 2);
    memset(p->w2_full, 0, (size_t)(4 * hd * f) * 2);
    for (int64_t e = 0; e < 4; e++) {
        for (int64_t n = 0; n < f; n++) {
            p->w1_full[(e * 2 * f + n) * hd + 0] = comet_f32_to_bf16(32.0f);
            p->w1_full[(e * 2 * f + f + n) * hd + 0] = comet_f32_to_bf16((float)n);
            p->w1_full[(e * 2 * f + f + n) * hd + 1] = comet_f32_to_bf16((float)(e + 1));
        }
        for (int64_t c = 0; c < hd; c++) p->w2_full[(e * hd + c) * f + c % f] = comet_f32_to_bf16(1.0f / 32);
    }
    comet_problem_slice_weights(p);
    for (int s = 0; s < w; s++)
        for (int64_t t = 0; t < p->tokens[s]; t++) {
            for (int64_t k = 0; k < hd; k++) p->x[s][t * hd + k] = 0;
            p->x[s][t * hd + 0] = comet_f32_to_bf16(1.0f);
            p->x[s][t * hd + 1] = comet_f32_to_bf16((float)((s + t) % 4));
            p->topk_idx[s][t * 2 + 0] = (int32_t)((s + 3 * t) % 4);
            p->topk_idx[s][t * 2 + 1] = (int32_t)((s + 3 * t + 1 + t % 3) % 4);
            p->topk_w[s][t * 2 + 0] = 0.5f, p->topk_w[s][t * 2 + 1] = 0.25f;
        }
    comet_problem_poison(p);
    comet_status_t st = comet_reference_forward(&p->cfg, w, p->ref_args);
    CHECK(st == COMET_SUCCESS, "reference: %s", comet_last_error());
    st = run_engine(p, 2, 3, 1);
    CHECK(st == COMET_SUCCESS, "engine: %s", comet_last_error());
    int64_t bad_ref = 0, bad_eng = 0;
    for (int s = 0; s < w; s++)
        for (int64_t t = 0; t < p->tokens[s]; t++)
            for (int64_t c = 0; c < hd; c++) {
                float a = (float)((s + t) % 4), want = 0;
                for (int j = 0; j < 2; j++) {
                    int e = p->topk_idx[s][t * 2 + j];
                    want += p->topk_w[s][t * 2 + j] * ((float)(c % f) + (float)(e + 1) * a);
                }
                bad_ref += comet_bf16_to_f32(p->y_ref[s][t * hd + c]) != want;
                bad_eng += comet_bf16_to_f32(p->y[s][t * hd + c]) != want;
            }
    CHECK(bad_ref == 0, "TP=%d EP=%d: reference differs from the exact answer in %lld elements", tp, ep, (long long)bad_ref);
    CHECK(bad_eng == 0, "TP=%d EP=%d: engine differs from the exact answer in %lld elements", tp, ep, (long long)bad_eng);
    comet_problem_destroy(p);
}

/* ---- matrix ------------------------------------------------------------------ */
static void test_matrix(void) {
    comet_rng_t rng = {2024};
    const int worlds[] = {1, 2, 4, 8};
    const int64_t experts[] = {1, 2, 4, 8, 16, 64, 512};
    int cases = 0;
    for (int wi = 0; wi < 4; wi++) {
        int w = worlds[wi];
        for (int tp = 1; tp <= w; tp *= 2) {
            int ep = w / tp;
            for (int rep = 0; rep < 14; rep++) {
                comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
                cfg.tp = tp, cfg.ep = ep;
                cfg.hidden = 8 + 8 * (int64_t)(comet_rng_next(&rng) % 6) + (rep == 3 ? 3 : 0);
                cfg.ffn = tp * (4 + (int64_t)(comet_rng_next(&rng) % 24));
                cfg.num_experts = ep * ((experts[rep % 7] + ep - 1) / ep);
                int64_t kmax = cfg.num_experts < 8 ? cfg.num_experts : 8;
                cfg.topk = 1 + (int64_t)(comet_rng_next(&rng) % (uint64_t)kmax);
                cfg.activation = rep == 5 ? COMET_ACT_GELU : COMET_ACT_SILU_GATED;
                cfg.max_tokens_per_rank = 1 + (int64_t)(comet_rng_next(&rng) % (w >= 8 ? 24 : 48));
                cfg.tile_m = 1 + (int)(comet_rng_next(&rng) % 8);
                int64_t tokens[8];
                for (int s = 0; s < w; s++) {
                    tokens[s] = (int64_t)(comet_rng_next(&rng) % (uint64_t)(cfg.max_tokens_per_rank + 1));
                    if (s == 0 && rep == 1) tokens[s] = 1;
                }
                comet_routing_opts_t ro = {rep % 3 == 1 ? 0.2 : (rep % 3 == 2 ? 0.05 : 0.0),
                                           cfg.num_experts >= cfg.topk + 2 && rep % 2 ? cfg.num_experts / 4 + 1 : 0,
                                           (uint64_t)(100 * w + 10 * tp + rep)};
                if (cfg.num_experts - ro.zero_experts < cfg.topk) ro.zero_experts = 0;
                const int n_comms[] = {1, 2, 3, 7, 16};
                int n_comm = n_comms[comet_rng_next(&rng) % 5];
                int chunk = rep % 2 ? 0 : 1 + (int)(comet_rng_next(&rng) % (uint64_t)cfg.hidden);
                comet_problem_t *p;
                if (comet_problem_create(&p, &cfg, w, tokens, &ro) != COMET_SUCCESS) {
                    CHECK(0, "problem: %s", comet_last_error());
                    continue;
                }
                comet_problem_poison(p);
                comet_status_t rs = comet_reference_forward(&p->cfg, w, p->ref_args);
                comet_status_t es = run_engine(p, n_comm, chunk, 1);
                char tag[200];
                snprintf(tag, sizeof tag,
                         "W=%d TP=%d EP=%d H=%lld F=%lld E=%lld topk=%lld tile_m=%d n_comm=%d chunk=%d skew=%g empty=%lld",
                         w, tp, ep, (long long)cfg.hidden, (long long)cfg.ffn, (long long)cfg.num_experts,
                         (long long)cfg.topk, cfg.tile_m, n_comm, chunk, ro.skew, (long long)ro.zero_experts);
                CHECK(rs == COMET_SUCCESS && es == COMET_SUCCESS, "%s: status %s/%s: %s", tag,
                      comet_status_string(rs), comet_status_string(es), comet_last_error());
                int64_t mism = comet_problem_count_mismatch(p), unwritten = comet_problem_count_poison(p);
                CHECK(mism == 0, "%s: %lld elements differ from the reference", tag, (long long)mism);
                CHECK(unwritten == 0, "%s: %lld outputs never written", tag, (long long)unwritten);
                comet_problem_destroy(p);
                cases++;
            }
        }
    }
    printf("test_engine: %d random configurations matched the reference bitwise\n", cases);
}

/* ---- epochs ------------------------------------------------------------------ */
typedef struct {
    comet_problem_t *p;
    comet_world_t *world;
    pthread_barrier_t *bar;
    int rank, calls;
    int64_t mismatches;
    comet_status_t st;
} epoch_job_t;

static void *epoch_rank(void *arg) {
    epoch_job_t *j = arg;
    comet_layer_t *layer = NULL;
    j->st = comet_layer_create(&layer, j->world, j->rank, &j->p->cfg);
    for (int i = 0; i < j->calls && j->st == COMET_SUCCESS; i++) {
        if (j->rank == 0) { /* fresh inputs while nobody is inside a call */
            comet_routing_opts_t ro = {i % 2 ? 0.2 : 0.0, i % 3 == 2 ? 3 : 0, (uint64_t)(77 + i)};
            comet_problem_redraw(j->p, &ro);
            comet_problem_poison(j->p);
            comet_reference_forward(&j->p->cfg, j->p->world_size, j->p->ref_args);
        }
        pthread_barrier_wait(j->bar);
        comet_forward_args_t a = j->p->args[j->rank];
        a.chunk_cols = (int)(1 + (i * 5) % j->p->cfg.hidden); /* same on every rank */
        a.n_comm = 1 + (j->rank + i) % 3;                     /* differs per rank */
        j->st = comet_layer_forward(layer, &a);
        pthread_barrier_wait(j->bar);
        if (j->rank == 0) j->mismatches += comet_problem_count_mismatch(j->p) + comet_problem_count_poison(j->p);
    }
    comet_layer_destroy(layer);
    return NULL;
}

static void test_epochs(int tp, int ep) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 24, cfg.ffn = 12 * tp, cfg.num_experts = 8, cfg.topk = 3, cfg.tp = tp, cfg.ep = ep;
    cfg.max_tokens_per_rank = 20, cfg.tile_m = 4;
    const int w = tp * ep;
    int64_t tokens[4] = {20, 7, 1, 13};
    comet_routing_opts_t ro = {0, 0, 5};
    comet_problem_t *p;
    comet_world_t *world;
    if (comet_problem_create(&p, &cfg, w, tokens, &ro) || comet_world_create_local(&world, w, COMET_BACKEND_CPU)) {
        CHECK(0, "setup: %s", comet_last_error());
        return;
    }
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)w);
    epoch_job_t jobs[4];
    pthread_t th[4];
    for (int r = 0; r < w; r++) {
        jobs[r] = (epoch_job_t){p, world, &bar, r, 12, 0, COMET_SUCCESS};
        pthread_create(&th[r], NULL, epoch_rank, &jobs[r]);
    }
    for (int r = 0; r < w; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < w; r++) CHECK(jobs[r].st == COMET_SUCCESS, "epochs rank %d: %s", r, comet_status_string(jobs[r].st));
    CHECK(jobs[0].mismatches == 0, "epochs TP=%d EP=%d: %lld elements wrong or unwritten over 12 calls", tp, ep,
          (long long)jobs[0].mismatches);
    pthread_barrier_destroy(&bar);
    comet_world_destroy(world);
    comet_problem_destroy(p);
}

/* The small two-rank problem of the --comm-hidden tests (12 and 9 tokens,
 * H 32), routing drawn from seed; NULL if it cannot be made. */
static comet_problem_t *sides_problem(uint64_t seed) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 32, cfg.ffn = 16, cfg.num_experts = 8, cfg.topk = 2, cfg.ep = 2, cfg.max_tokens_per_rank = 12;
    int64_t tokens[2] = {12, 9};
    comet_routing_opts_t ro = {0.2, 0, seed};
    comet_problem_t *p;
    return comet_problem_create(&p, &cfg, 2, tokens, &ro) == COMET_SUCCESS ? p : NULL;
}

/* The measurement modes of --comm-hidden: either side left out, the protocol
 * still completes on every rank (no wait is left hanging); without
 * communication nothing is summed into y, so y keeps its poison. */
static void test_disable(void) {
    comet_problem_t *p = sides_problem(3);
    if (!p) return;
    const int modes[] = {COMET_DISABLE_COMM, COMET_DISABLE_GEMM, COMET_DISABLE_COMM | COMET_DISABLE_GEMM};
    for (int m = 0; m < 3; m++) {
        comet_world_t *world;
        comet_world_create_local(&world, 2, COMET_BACKEND_CPU);
        comet_problem_poison(p);
        comet_run_t run;
        memset(&run, 0, sizeof run);
        run.repeats = 2, run.disable = modes[m], run.n_comm = 2;
        comet_status_t st = comet_problem_run(p, world, &run, 0);
        CHECK(st == COMET_SUCCESS, "disable=%d: %s", modes[m], comet_last_error());
        if (modes[m] & COMET_DISABLE_COMM)
            CHECK(comet_problem_count_poison(p) == (12 + 9) * 32, "disable=%d: y written without communication", modes[m]);
        comet_world_destroy(world);
    }
    comet_problem_destroy(p);
}

/* --comm-hidden's sides interleaved call by call in one layer (the
 * runner's interleave): every side timed, the last call whole and bitwise
 * the reference's; with y poisoned before every call, exactly the calls
 * without communication (0, 2, 4 and 6 of 8: without it, and without
 * both) leave it poisoned, as the first does, so 4 differ from the first
 * (all whole: 0); the runner refuses interleave with disable bits, a
 * graph, or fewer than 4 timed calls (one a side). */
static void test_interleave(void) {
    comet_problem_t *p = sides_problem(4);
    if (!p) return;
    for (int n_comm = 1; n_comm <= 2; n_comm++) {
        comet_world_t *world;
        comet_world_create_local(&world, 2, COMET_BACKEND_CPU);
        comet_problem_poison(p);
        comet_run_t run;
        memset(&run, 0, sizeof run);
        run.repeats = 8, run.interleave = 1, run.n_comm = n_comm;
        comet_status_t st = comet_problem_run(p, world, &run, 4);
        CHECK(st == COMET_SUCCESS, "interleave n_comm %d: %s", n_comm, comet_last_error());
        CHECK(run.ms_side[0] > 0 && run.ms_side[1] > 0 && run.ms_side[2] > 0 && run.ms_side[3] > 0,
              "interleave n_comm %d: side medians %g %g %g %g", n_comm, run.ms_side[0], run.ms_side[1], run.ms_side[2],
              run.ms_side[3]);
        comet_run_t each = run;
        each.compare_repeats = 1;
        st = comet_problem_run(p, world, &each, 0);
        CHECK(st == COMET_SUCCESS && each.repeats_differ[0] == 4 && each.repeats_differ[1] == 4,
              "interleave n_comm %d: %s, %d and %d calls differ from the first (want 4: the sides in order)", n_comm,
              comet_status_string(st), each.repeats_differ[0], each.repeats_differ[1]);
        comet_check_t chk;
        comet_problem_check(p, 0, -1, &chk);
        CHECK(chk.differ == 0 && chk.elements == (12 + 9) * 32,
              "interleave n_comm %d: the last (whole) call: %lld of %lld elements differ from the reference", n_comm,
              (long long)chk.differ, (long long)chk.elements);
        static const struct { int disable, graph, repeats, warmup; } bad[3] = {{COMET_DISABLE_COMM, 0, 8, 0},
                                                                               {0, 1, 8, 0}, {0, 0, 7, 4}};
        for (int b = 0; b < 3; b++) {
            run.disable = bad[b].disable, run.graph = bad[b].graph, run.repeats = bad[b].repeats;
            st = comet_problem_run(p, world, &run, bad[b].warmup);
            CHECK(st == COMET_ERR_INVALID_ARGUMENT, "interleave case %d: %s, want invalid argument", b,
                  comet_status_string(st));
        }
        comet_world_destroy(world);
    }
    comet_problem_destroy(p);
}

static void test_check(void) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 64, cfg.ffn = 32, cfg.num_experts = 4, cfg.topk = 2, cfg.ep = 2, cfg.max_tokens_per_rank = 10;
    int64_t tokens[2] = {10, 7};
    comet_routing_opts_t ro = {0, 0, 5};
    comet_problem_t *p;
    if (comet_problem_create(&p, &cfg, 2, tokens, &ro)) return;
    comet_problem_poison(p);
    CHECK(run_engine(p, 2, 0, 1) == COMET_SUCCESS, "check: engine: %s", comet_last_error());
    comet_check_t chk;
    comet_problem_check(p, 0, -1, &chk);
    CHECK(chk.wrong == 0 && chk.differ == 0 && chk.elements == 17 * 64, "check: exact output: %lld wrong, %lld differ",
          (long long)chk.wrong, (long long)chk.differ);
    uint16_t *y = p->y[1] + 3 * 64;
    for (int c = 0; c < 64; c += 5) y[c] ^= 1; /* one ulp */
    comet_problem_check(p, 0, -1, &chk);
    CHECK(chk.wrong == 0 && chk.differ == 13, "check: one-ulp changes: %lld wrong, %lld differ", (long long)chk.wrong,
          (long long)chk.differ);
    y[7] = comet_f32_to_bf16(comet_bf16_to_f32(y[7]) * 1.5f + 0.25f);
    comet_problem_check(p, 0, -1, &chk);
    CHECK(chk.wrong == 1, "check: one changed element: %lld wrong", (long long)chk.wrong);
    /* token 2 of rank 0 without its second expert's row: the output the
     * reference gives for that token with the weight of slot 1 set to 0 */
    float *w = (float *)p->args[0].topk_w.data;
    const float keep = w[2 * 2 + 1];
    w[2 * 2 + 1] = 0.0f;
    comet_problem_poison(p);
    CHECK(run_engine(p, 2, 0, 1) == COMET_SUCCESS, "check: engine: %s", comet_last_error());
    uint16_t row[64];
    memcpy(row, p->y[0] + 2 * 64, sizeof row);
    w[2 * 2 + 1] = keep;
    comet_problem_poison(p);
    CHECK(run_engine(p, 2, 0, 1) == COMET_SUCCESS, "check: engine: %s", comet_last_error());
    memcpy(p->y[0] + 2 * 64, row, sizeof row);
    comet_problem_check(p, 0, -1, &chk);
    CHECK(chk.wrong > 32, "check: a missing expert row: only %lld of 64 elements wrong", (long long)chk.wrong);
    /* the runner's repeat comparison (what the GPU test's 100 forwards use) */
    comet_world_t *world;
    if (comet_world_create_local(&world, 2, COMET_BACKEND_CPU) == COMET_SUCCESS) {
        comet_run_t run;
        memset(&run, 0, sizeof run);
        run.n_comm = 2, run.repeats = 6, run.compare_repeats = 1;
        run.repeats_differ[0] = 9;
        comet_status_t st = comet_problem_run(p, world, &run, 0);
        CHECK(st == COMET_SUCCESS && run.repeats_differ[0] == 0 && run.repeats_differ[1] == 0,
              "check: 6 forwards compared: %s, %d and %d differ", comet_status_string(st), run.repeats_differ[0],
              run.repeats_differ[1]);
        comet_world_destroy(world);
    }
    comet_problem_destroy(p);
}

/* comet_run_t.timed: one begin and one end a run, from one rank's thread
 * (two ranks here), the begin just before the first timed call (rank 0's y
 * still poisoned with no warm-up, written by a warm-up call with one) and
 * the end after the last (with y poisoned before every call, rank 0's y
 * whole at the end). */
typedef struct {
    const comet_problem_t *p;
    int begins, ends;
    int y_any_at_begin, y_whole_at_end; /* rank 0's y: some element written / every element written */
    pthread_t begun_by;
    int same_thread; /* the end came from the begin's thread */
} timed_probe_t;

static void timed_probe(void *ctx, int end) {
    timed_probe_t *t = ctx;
    const int64_t n = t->p->tokens[0] * t->p->cfg.hidden;
    int64_t written = 0;
    for (int64_t i = 0; i < n; i++) written += t->p->y[0][i] != 0xffff;
    if (end) {
        t->ends++;
        t->same_thread = t->begins == 1 && pthread_equal(t->begun_by, pthread_self());
        t->y_whole_at_end = written == n;
        return;
    }
    t->begins++;
    t->begun_by = pthread_self();
    t->y_any_at_begin = written > 0;
}

static void test_timed(void) {
    comet_problem_t *p = sides_problem(5);
    if (!p) return;
    for (int warmup = 0; warmup <= 2; warmup += 2) {
        for (int poison = 0; poison <= 1; poison++) { /* compare_repeats: y poisoned before every call */
            comet_world_t *world;
            comet_world_create_local(&world, 2, COMET_BACKEND_CPU);
            comet_problem_poison(p);
            timed_probe_t t = {p, 0, 0, 0, 0, pthread_self(), 0};
            comet_run_t run;
            memset(&run, 0, sizeof run);
            run.repeats = 4, run.n_comm = 2, run.compare_repeats = poison, run.timed = timed_probe, run.timed_ctx = &t;
            comet_status_t st = comet_problem_run(p, world, &run, warmup);
            CHECK(st == COMET_SUCCESS && t.begins == 1 && t.ends == 1 && t.same_thread,
                  "timed, warm-up %d: %s, %d begins and %d ends (want 1 and 1, one thread: %d)", warmup,
                  comet_status_string(st), t.begins, t.ends, t.same_thread);
            if (!poison)
                CHECK(t.y_any_at_begin == (warmup > 0), "timed, warm-up %d: rank 0's y %s at the begin", warmup,
                      t.y_any_at_begin ? "written" : "still poisoned");
            else
                CHECK(t.y_whole_at_end, "timed, warm-up %d: rank 0's y not whole at the end (the last call not done)",
                      warmup);
            /* a run refused before any call (interleave needs 4 timed calls) calls neither */
            t.begins = t.ends = 0;
            run.interleave = 1, run.compare_repeats = 0;
            st = comet_problem_run(p, world, &run, 2);
            CHECK(st == COMET_ERR_INVALID_ARGUMENT && t.begins == 0 && t.ends == 0,
                  "timed, refused run: %s, %d begins, %d ends", comet_status_string(st), t.begins, t.ends);
            comet_world_destroy(world);
        }
    }
    comet_problem_destroy(p);
}

/* ---- no tokens, no data -----------------------------------------------------------
 * T = 0 on a rank with NULL x, topk_idx, topk_w and y (valid: nothing to point
 * at) runs, with the other rank's tokens equal to the reference; the UBSan
 * build checks that no NULL reaches memcpy. */
static void test_empty_null(void) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 16, cfg.ffn = 8, cfg.num_experts = 4, cfg.topk = 2, cfg.tp = 1, cfg.ep = 2;
    cfg.max_tokens_per_rank = 5, cfg.tile_m = 2;
    const int64_t cases[2][2] = {{0, 5}, {0, 0}};
    for (int c = 0; c < 2; c++) {
        comet_routing_opts_t ro = {0, 0, 9};
        comet_problem_t *p;
        if (comet_problem_create(&p, &cfg, 2, cases[c], &ro) != COMET_SUCCESS) {
            CHECK(0, "problem: %s", comet_last_error());
            return;
        }
        for (int s = 0; s < 2; s++) {
            if (cases[c][s]) continue;
            comet_forward_args_t *a[2] = {&p->args[s], &p->ref_args[s]};
            for (int k = 0; k < 2; k++) a[k]->x.data = a[k]->topk_idx.data = a[k]->topk_w.data = a[k]->y.data = NULL;
        }
        comet_problem_poison(p);
        comet_status_t st = run_engine(p, 0, 0, 2);
        CHECK(st == COMET_SUCCESS, "T = 0 with NULL data, tokens %lld/%lld: %s %s", (long long)cases[c][0],
              (long long)cases[c][1], comet_status_string(st), comet_last_error());
        st = comet_reference_forward(&p->cfg, 2, p->ref_args);
        CHECK(st == COMET_SUCCESS && comet_problem_count_mismatch(p) == 0, "T = 0 with NULL data: reference %s",
              comet_status_string(st));
        comet_problem_destroy(p);
    }
}

int main(void) {
    test_empty_null();
    test_check();
    test_timed();
    test_disable();
    test_interleave();
    const int layouts[][2] = {{1, 1}, {1, 2}, {2, 1}, {2, 2}, {1, 4}, {4, 1}};
    for (int i = 0; i < 6; i++) test_exact(layouts[i][0], layouts[i][1]);
    test_matrix();
    for (int i = 0; i < 4; i++) test_epochs(layouts[i][0], layouts[i][1]);
    return check_summary("test_engine");
}
