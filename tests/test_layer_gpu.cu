/*
 * test_layer_gpu.cu - the CUDA backend against the CPU reference, on one GPU
 * and, where there are two or more, on two (both (TP, EP) layouts), and
 * where there are four or more, on four (EP4, TP2 x EP2, TP4): model
 * presets scaled down, random configurations (topk 1..8, E up to 256, tokens
 * per rank including 0 and 1, small and default tile heights, skewed routing,
 * experts with no tokens, GELU; hidden % 8 != 0, topk > 32, tall row
 * blocks), outputs poisoned before each run. Every
 * element must be within the tolerance of a different GEMM accumulation order
 * (comet_problem_check), every output written, a second run bitwise equal
 * to the first (fixed reduction order), and so with the Hopper GEMM on single
 * CTAs (COMET_GEMM_CLUSTER=0; 2-CTA clusters are the default), and the
 * overlapped mode (n_comm > 0)
 * bitwise equal to the sequential chain, and so both with GEMM1 pushing its
 * rows home (the default, COMET_PUSH=1 here; the other cases set
 * COMET_PUSH=0 for the pull combine; receive buffers poisoned at create),
 * and --comm-hidden's interleaved sides leave the next whole call's bits
 * alone, and the protocol the layer reports is the one asked for, all with
 * GEMM1's tail split on
 * pieces of two k-slices and up (COMET_GEMM_SPLIT=2, so that these small
 * shapes split; unless set by the caller); one layer
 * run 100 times in each mode,
 * replayed by the layer as its own graph (src/cuda/replay.c: every call) and
 * inside the caller's captured CUDA graph, gives the same
 * bits every time, and so 30 calls over 3 input sets (the tokens rotated:
 * each call hands the layer new tensors), replayed and launched kernel by
 * kernel (a world with graph_replay -1), and 12 calls in flight at once on 12 sets. Ranks asking for different protocols get an error and
 * write nothing. An invalid expert id on one rank must
 * leave every output untouched and be reported by comet_layer_sync.
 * Without a GPU it prints "skipped (no GPU)". COMET_LAYER_TEST_WORLDS (a
 * list of world sizes, e.g. "4" or "1,2"; default every size the GPUs allow)
 * limits the layouts, the repeat, mismatch and bad-routing cases to those
 * worlds, so that the four-rank layouts fit one device call; a list that
 * leaves no case (a typo, or 4 with two GPUs) fails. COMET_LAYER_TEST_TPS
 * (a list of TP sizes, e.g. "2,4") limits the layouts of those worlds the
 * same way (4 ranks: EP4 took ~120 s of a call on 4x H200, 79d0879).
 */
#include <stdlib.h>
#include <string.h>

#include "../harness/workload.h"
#include "../src/core/validate.h"
#include "../src/cuda/gemm.h"
#include "check.h"

/* The GEMM a layer of cfg must run here, decided apart from the layer: the
 * Hopper GEMM on an sm_90 GPU for the shapes it takes (unless
 * COMET_SIMT_GEMM), else the SIMT tiles; so a silent fallback fails. */
static comet_gemm_kind_t expected_gemm(const comet_layer_config_t *cfg, int w) {
    cudaDeviceProp prop;
    comet_dims_t d;
    const int hopper = cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 && !getenv("COMET_SIMT_GEMM");
    return hopper && comet_dims_from_config(cfg, w, 0, &d) == COMET_SUCCESS && comet_gemm_check(&d) == NULL
               ? COMET_GEMM_HOPPER
               : COMET_GEMM_SIMT;
}

/* comet_problem_run with the environment variables vars (name, value, ...,
 * NULL) set while its layers are created (the caller's values put back after). */
static comet_status_t run_with_env(comet_problem_t *p, comet_world_t *world, comet_run_t *run, const char *const *vars) {
    char *keep[8];
    int n = 0;
    for (; n < 8 && vars[2 * n]; n++) {
        const char *old = getenv(vars[2 * n]);
        keep[n] = old ? strdup(old) : NULL;
        setenv(vars[2 * n], vars[2 * n + 1], 1);
    }
    comet_status_t st = comet_problem_run(p, world, run, 0);
    for (int i = 0; i < n; i++) {
        if (keep[i])
            setenv(vars[2 * i], keep[i], 1);
        else
            unsetenv(vars[2 * i]);
        free(keep[i]);
    }
    return st;
}

static comet_status_t run_with_push(comet_problem_t *p, comet_world_t *world, comet_run_t *run) {
    static const char *const push[] = {"COMET_PUSH", "1", NULL};
    return run_with_env(p, world, run, push);
}

/* A copy of every rank's y into first[rank] (malloc; the caller frees), for same_output. */
static void keep_outputs(const comet_problem_t *p, uint16_t **first, int w, int64_t hidden) {
    for (int s = 0; s < w; s++) {
        first[s] = (uint16_t *)malloc((size_t)(p->tokens[s] * hidden) * 2 + 2);
        memcpy(first[s], p->y[s], (size_t)(p->tokens[s] * hidden) * 2);
    }
}

/* st succeeded and every rank's y equals first[rank] bitwise. */
static int same_output(const comet_problem_t *p, uint16_t *const *first, int w, int64_t hidden, comet_status_t st) {
    int same = st == COMET_SUCCESS;
    for (int s = 0; s < w; s++) same &= memcmp(first[s], p->y[s], (size_t)(p->tokens[s] * hidden) * 2) == 0;
    return same;
}

static void run_case(const comet_layer_config_t *cfg, const int64_t *tokens, const comet_routing_opts_t *ro,
                     const char *tag) {
    const int w = cfg->tp * cfg->ep;
    comet_problem_t *p;
    comet_world_t *world;
    if (comet_problem_create(&p, cfg, w, tokens, ro) != COMET_SUCCESS) {
        CHECK(0, "%s: problem: %s", tag, comet_last_error());
        return;
    }
    if (comet_world_create_local(&world, w, COMET_BACKEND_CUDA) != COMET_SUCCESS) {
        CHECK(0, "%s: world: %s", tag, comet_last_error());
        comet_problem_destroy(p);
        return;
    }
    comet_problem_poison(p);
    comet_run_t run;
    memset(&run, 0, sizeof run);
    run.repeats = 2, run.n_comm = COMET_SEQUENTIAL; /* whatever a tuner table in the environment says */
    comet_status_t st = comet_problem_run(p, world, &run, 0);
    CHECK(st == COMET_SUCCESS, "%s: %s: %s", tag, comet_status_string(st), comet_last_error());
    comet_check_t chk;
    comet_problem_check(p, 0, -1, &chk);
    CHECK(chk.wrong == 0, "%s: %lld of %lld elements off the reference (worst %.3g of the row rms)", tag,
          (long long)chk.wrong, (long long)chk.elements, chk.worst);
    CHECK(comet_problem_count_poison(p) == 0, "%s: %lld outputs never written", tag, (long long)comet_problem_count_poison(p));
    const comet_gemm_kind_t gemm = expected_gemm(cfg, w);
    CHECK(run.protocol.gemm == gemm, "%s: the layer ran GEMM kind %d, expected %d", tag, (int)run.protocol.gemm,
          (int)gemm);
    printf("test_layer_gpu: %-60s %lld elements, %lld not bitwise equal, worst %.2e\n", tag, (long long)chk.elements,
           (long long)chk.differ, chk.worst);

    /* determinism: a fresh run gives the same bits */
    uint16_t *first[8];
    keep_outputs(p, first, w, cfg->hidden);
    comet_problem_poison(p);
    st = comet_problem_run(p, world, &run, 0);
    int same = same_output(p, first, w, cfg->hidden, st);
    CHECK(same, "%s: a second run differs bitwise", tag);

    /* the Hopper GEMM's knobs (read at layer create): single CTAs instead of
     * the default 2-CTA clusters sharing B tiles, and that with GEMM1
     * pushing its rows home (W > 1): the same bits */
    static const char *const gemm_env[2][5] = {{"COMET_GEMM_CLUSTER", "0", NULL},
                                               {"COMET_GEMM_CLUSTER", "0", "COMET_PUSH", "1", NULL}};
    for (int v = 0; v < (w > 1 ? 2 : 1); v++) {
        comet_problem_poison(p);
        st = run_with_env(p, world, &run, gemm_env[v]);
        same = same_output(p, first, w, cfg->hidden, st);
        CHECK(same, "%s: %s=%s%s: %s, output %s", tag, gemm_env[v][0], gemm_env[v][1], v == 1 ? " with push" : "",
              comet_status_string(st), same ? "equal" : "differs from the default GEMM's");
    }

    /* overlapped mode (n_comm communication CTAs beside the GEMM; the
     * sequential chain where the Hopper GEMM does not run): the same bits */
    comet_problem_poison(p);
    run.n_comm = 8;
    st = comet_problem_run(p, world, &run, 0);
    same = same_output(p, first, w, cfg->hidden, st);
    CHECK(same, "%s: overlapped mode (n_comm 8): %s, output %s", tag, comet_status_string(st),
          same ? "equal" : "differs from the sequential one");

    /* --comm-hidden's sides interleaved call by call in one layer (the
     * runner's interleave: 8 calls, without communication, without GEMMs,
     * without both, whole, twice; the last whole), in both modes, with the
     * pull combine and (W > 1) with push: no call fails or hangs, the last
     * gives the same bits, and with y poisoned before every call those
     * without communication (it alone, and both) leave it poisoned (4 calls
     * differ from the first; none where the SIMT
     * GEMM fallback runs, which ignores disable). The calls without
     * GEMMs find the previous call's o, so the bits alone cannot tell a
     * state a left-out side corrupts from a correct one: the hangs and
     * timeouts are what this catches. */
    static const char *const push_on[] = {"COMET_PUSH", "1", NULL};
    static const char *const as_set[] = {NULL};
    for (int v = 0; v < (w > 1 ? 4 : 2); v++) {
        comet_run_t sides = run;
        sides.n_comm = v % 2 ? 8 : COMET_SEQUENTIAL, sides.interleave = 1, sides.repeats = 8;
        comet_problem_poison(p);
        st = run_with_env(p, world, &sides, v >= 2 ? push_on : as_set);
        same = same_output(p, first, w, cfg->hidden, st);
        int differ_ok = 1;
        if (same) {
            sides.compare_repeats = 1;
            st = run_with_env(p, world, &sides, v >= 2 ? push_on : as_set);
            const int want = sides.protocol.gemm == COMET_GEMM_SIMT ? 0 : 4; /* the SIMT fallback ignores disable */
            for (int s = 0; s < w; s++) differ_ok &= sides.repeats_differ[s] == want;
        }
        CHECK(same && st == COMET_SUCCESS && differ_ok && sides.ms_side[0] > 0 && sides.ms_side[1] > 0 &&
                  sides.ms_side[2] > 0 && sides.ms_side[3] > 0,
              "%s: %s%s, sides interleaved: %s, output %s, %s, times %.3f / %.3f / %.3f / %.3f ms", tag,
              v % 2 ? "overlapped" : "sequential", v >= 2 ? " with push" : "", comet_status_string(st),
              same ? "equal" : "differs", differ_ok ? "sides in order" : "calls without communication wrote y",
              sides.ms_side[0], sides.ms_side[1], sides.ms_side[2], sides.ms_side[3]);
    }

    /* push (COMET_PUSH=1 at layer create, W > 1): GEMM1 stores o rows into
     * their home ranks and the combine reads them there: the same bits */
    if (w > 1) {
        const size_t pull_bytes = run.memory.symmetric_bytes;
        comet_problem_poison(p);
        run.n_comm = COMET_SEQUENTIAL;
        st = run_with_push(p, world, &run);
        same = same_output(p, first, w, cfg->hidden, st);
        /* receive buffers where push runs (the Hopper GEMM), none where the SIMT tiles pull */
        const int pushed = run.protocol.combine == COMET_COMBINE_PUSH;
        CHECK(same && (run.memory.symmetric_bytes > pull_bytes) == pushed,
              "%s: push: %s, output %s, receive buffers %s (%s combine)", tag, comet_status_string(st),
              same ? "equal" : "differs from the pull combine's",
              run.memory.symmetric_bytes > pull_bytes ? "allocated" : "none", pushed ? "push" : "pull");
        comet_problem_poison(p); /* and overlapped: comm CTAs beside GEMM0 only */
        run.n_comm = 8;
        st = run_with_push(p, world, &run);
        same = same_output(p, first, w, cfg->hidden, st);
        CHECK(same, "%s: overlapped with push: %s, output %s", tag, comet_status_string(st),
              same ? "equal" : "differs from the sequential one");
        /* the protocol the layer reports: overlapped, push, Hopper (or the SIMT fallback) */
        const comet_protocol_t *pr = &run.protocol;
        CHECK(pr->struct_size == sizeof(comet_protocol_t) && pr->chosen_by == COMET_CHOSEN_BY_ARGS &&
                  (pr->gemm == COMET_GEMM_SIMT ? pr->mode == COMET_MODE_SEQUENTIAL && pr->combine == COMET_COMBINE_PULL
                                               : pr->mode == COMET_MODE_OVERLAPPED && pr->n_comm == 8 &&
                                                     pr->combine == (w <= 8 ? COMET_COMBINE_PUSH : COMET_COMBINE_PULL)),
              "%s: the protocol reported: mode %d, n_comm %d, combine %d, gemm %d, chosen by %d", tag, (int)pr->mode,
              pr->n_comm, (int)pr->combine, (int)pr->gemm, (int)pr->chosen_by);
    }
    for (int s = 0; s < w; s++) free(first[s]);
    comet_world_destroy(world);
    comet_problem_destroy(p);
}

/* One run of repeat_case: it succeeded, every call's y (repeats_differ) and
 * the last one equal ref[rank], and the layer replayed every call from one
 * capture where replay says it may (not inside a caller's capture, not with
 * graph replay off), and never with the SIMT GEMM (COMET_SIMT_GEMM, or not
 * Hopper). */
static void check_repeat_run(const comet_problem_t *p, int w, int64_t hidden, uint16_t *const *ref,
                             const comet_run_t *run, comet_status_t st, int replay, const char *what) {
    int differ = 0;
    for (int s = 0; s < w; s++)
        differ += run->repeats_differ[s] + (memcmp(ref[s], p->y[s], (size_t)(p->tokens[s] * hidden) * 2) != 0);
    replay = replay && run->protocol.gemm != COMET_GEMM_SIMT;
    const int64_t want_replays = replay ? run->repeats : 0, want_captures = replay ? 1 : 0;
    CHECK(st == COMET_SUCCESS && differ == 0 && run->replays == want_replays && run->captures == want_captures,
          "W=%d %s, %d forwards: %s: %s, %d outputs differ, %lld replayed by the layer from %lld captures (want %lld "
          "from %lld)", w, what, run->repeats, comet_status_string(st), run->message[0], differ,
          (long long)run->replays, (long long)run->captures, (long long)want_replays, (long long)want_captures);
}

/* For each of sequential, overlapped and (W > 1) both with push, replayed
 * by the layer from its own graph
 * (one capture, then every call) and replayed from the caller's CUDA graph
 * (captured on a fresh layer's first forward; the layer then launches its
 * kernels into it): a layer created for the run, 100 forwards (output
 * poisoned before each), every output bitwise equal to the first one. Then
 * 30 calls over 3 rotated input sets, replayed and launched kernel by kernel. */
static void repeat_case(int w) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    const comet_model_t *mod = comet_model_find("mixtral-8x7b");
    cfg.hidden = mod->hidden / 8, cfg.ffn = mod->ffn / 8, cfg.num_experts = mod->num_experts, cfg.topk = mod->topk;
    cfg.ep = w, cfg.max_tokens_per_rank = 512;
    int64_t tokens[2] = {512, 509};
    comet_routing_opts_t ro = {0.3, 0, 77};
    comet_problem_t *p;
    comet_world_t *world;
    if (comet_problem_create(&p, &cfg, w, tokens, &ro) || comet_world_create_local(&world, w, COMET_BACKEND_CUDA)) {
        CHECK(0, "repeat setup: %s", comet_last_error());
        return;
    }
    uint16_t *ref[2] = {NULL, NULL};
    static const char *const names[4] = {"sequential", "overlapped", "sequential with push", "overlapped with push"};
    for (int mode = 0; mode < (w > 1 ? 8 : 4); mode++) {
        const int kind = mode / 2, graph = mode % 2;
        comet_run_t run;
        memset(&run, 0, sizeof run);
        run.n_comm = kind % 2 ? 8 : COMET_SEQUENTIAL, run.graph = graph, run.repeats = 100;
        run.compare_repeats = 1;
        comet_problem_poison(p);
        comet_status_t st = kind >= 2 ? run_with_push(p, world, &run) : comet_problem_run(p, world, &run, 0);
        if (mode == 0) { /* the reference output of the others: written, and right */
            comet_check_t chk;
            comet_problem_check(p, 0, -1, &chk);
            CHECK(comet_problem_count_poison(p) == 0 && chk.wrong == 0, "W=%d repeat: %lld outputs unwritten, %lld wrong",
                  w, (long long)comet_problem_count_poison(p), (long long)chk.wrong);
        }
        for (int s = 0; s < w && !ref[s]; s++) {
            const size_t bytes = (size_t)(p->tokens[s] * cfg.hidden) * 2;
            ref[s] = (uint16_t *)malloc(bytes);
            memcpy(ref[s], p->y[s], bytes);
        }
        /* launched by the layer as its own replayed graph (replay.c) every call, unless inside the
         * caller's capture, where the caller's graph takes the launches */
        char what[160];
        snprintf(what, sizeof what, "%s%s", names[kind], graph ? " from a CUDA graph" : "");
        check_repeat_run(p, w, cfg.hidden, ref, &run, st, !graph, what);
    }
    /* the layer's replay handed each call's tensors: 3 input sets, each the tokens rotated by
     * its index (the runner puts y back in token order), called in turn, in both modes with
     * push; the same launched kernel by kernel (a world with graph_replay -1); and (W > 1)
     * overlapped with the pull combine: all the same bits as the first run */
    static const char *const rot_env[3][3] = {{"COMET_PUSH", "1", NULL}, {"COMET_PUSH", "1", NULL}, {"COMET_PUSH", "0", NULL}};
    static const char *const rot_name[3] = {"with push", "with push, launched kernel by kernel", "with the pull combine"};
    comet_world_options_t no_replay = COMET_WORLD_OPTIONS_INIT;
    no_replay.graph_replay = -1;
    comet_world_t *direct = NULL;
    CHECK(comet_world_create_local_opts(&direct, w, COMET_BACKEND_CUDA, &no_replay) == COMET_SUCCESS,
          "a world without graph replay: %s", comet_last_error());
    for (int v = 0; direct && v < (w > 1 ? 5 : 4); v++) {
        const int env = v < 4 ? v / 2 : 2; /* v 4: pull, overlapped */
        comet_run_t run;
        memset(&run, 0, sizeof run);
        run.n_comm = (v < 4 ? v % 2 : 1) ? 8 : COMET_SEQUENTIAL, run.repeats = 30, run.compare_repeats = 1;
        run.input_sets = 3;
        comet_problem_poison(p);
        comet_status_t st = run_with_env(p, env == 1 ? direct : world, &run, rot_env[env]);
        char what[160];
        snprintf(what, sizeof what, "%s %s, 3 rotated input sets", run.n_comm > 0 ? "overlapped" : "sequential",
                 rot_name[env]);
        check_repeat_run(p, w, cfg.hidden, ref, &run, st, env != 1, what);
    }
    comet_world_destroy(direct);
    /* and 12 calls enqueued back to back before one sync (the runner's pipeline), each on its
     * own rotated input set, so replays with different tensors are in flight together: with
     * push, sequential and overlapped */
    for (int v = 0; v < 2; v++) {
        comet_run_t run;
        memset(&run, 0, sizeof run);
        run.n_comm = v ? 8 : COMET_SEQUENTIAL, run.repeats = 12, run.compare_repeats = 1, run.pipeline = 1;
        comet_problem_poison(p);
        comet_status_t st = run_with_env(p, world, &run, rot_env[0]);
        char what[160];
        snprintf(what, sizeof what, "%s %s, in flight together on as many rotated input sets",
                 v ? "overlapped" : "sequential", rot_name[0]);
        check_repeat_run(p, w, cfg.hidden, ref, &run, st, 1, what);
    }
    for (int s = 0; s < w; s++) free(ref[s]);
    comet_world_destroy(world);
    comet_problem_destroy(p);
}

/* Ranks that ask for different protocols (one overlapped, one sequential):
 * every rank reports it, nothing is written, nothing hangs. */
static void mismatch_case(void) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 256, cfg.ffn = 256, cfg.num_experts = 4, cfg.topk = 2, cfg.ep = 2, cfg.max_tokens_per_rank = 64;
    int64_t tokens[2] = {64, 50};
    comet_routing_opts_t ro = {0, 0, 12};
    comet_problem_t *p;
    comet_world_t *world;
    if (comet_problem_create(&p, &cfg, 2, tokens, &ro) || comet_world_create_local(&world, 2, COMET_BACKEND_CUDA)) {
        CHECK(0, "mismatch setup: %s", comet_last_error());
        return;
    }
    comet_problem_poison(p);
    comet_run_t run;
    memset(&run, 0, sizeof run);
    run.n_comm_of_rank[0] = 8, run.n_comm_of_rank[1] = COMET_SEQUENTIAL;
    comet_problem_run(p, world, &run, 0);
    for (int s = 0; s < 2; s++)
        CHECK(run.status[s] == COMET_ERR_INVALID_ARGUMENT && strstr(run.message[s], "different protocols"),
              "rank %d of ranks with different protocols got %s (%s)", s, comet_status_string(run.status[s]),
              run.message[s]);
    CHECK(comet_problem_count_poison(p) == (64 + 50) * 256, "outputs written despite the protocol mismatch");
    /* and the world runs again once they agree */
    run.n_comm_of_rank[0] = run.n_comm_of_rank[1] = 8;
    CHECK(comet_problem_run(p, world, &run, 0) == COMET_SUCCESS, "after a mismatch: %s", comet_last_error());
    comet_world_destroy(world);
    comet_problem_destroy(p);
}

static void bad_routing(int w) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 64, cfg.ffn = 64, cfg.num_experts = 4, cfg.topk = 2, cfg.tp = 1, cfg.ep = w;
    cfg.max_tokens_per_rank = 8;
    int64_t tokens[4] = {8, 8, 8, 8};
    comet_routing_opts_t ro = {0, 0, 9};
    comet_problem_t *p;
    comet_world_t *world;
    if (comet_problem_create(&p, &cfg, w, tokens, &ro) || comet_world_create_local(&world, w, COMET_BACKEND_CUDA)) {
        CHECK(0, "bad routing setup: %s", comet_last_error());
        return;
    }
    p->topk_idx[w - 1][5] = 4; /* out of range on the last rank */
    comet_problem_poison(p);
    comet_run_t run;
    memset(&run, 0, sizeof run);
    comet_problem_run(p, world, &run, 0);
    CHECK(run.status[w - 1] == COMET_ERR_INVALID_ROUTING, "W=%d: bad rank got %s (%s)", w,
          comet_status_string(run.status[w - 1]), run.message[w - 1]);
    if (w > 1)
        CHECK(run.status[0] == COMET_ERR_PEER_FAILED, "W=%d: its peer got %s", w, comet_status_string(run.status[0]));
    CHECK(comet_problem_count_poison(p) == (int64_t)w * 8 * 64, "W=%d: outputs written despite invalid routing", w);
    comet_world_destroy(world);
    comet_problem_destroy(p);
}

/* COMET_LAYER_TEST_WORLDS lists w (or is unset) */
static int world_wanted(int w) { return check_listed("COMET_LAYER_TEST_WORLDS", w); }

int main(void) {
    const int gpus = comet_device_count();
    if (gpus == 0) {
        check_skip("test_layer_gpu", "no GPU");
        return check_summary("test_layer_gpu");
    }
    /* COMET_LAYER_TEST_SMALL=1 (e.g. under compute-sanitizer): the small
     * random and narrow configurations only */
    const int small = getenv("COMET_LAYER_TEST_SMALL") != NULL;
    setenv("COMET_PUSH", "0", 1); /* the pull combine, except where run_with_push asks for push */
    /* GEMM1's tail split on pieces of two k-slices and up (the default, 32, never splits these small
     * shapes): so the modes' bitwise comparisons cover split tiles (unless the caller set it) */
    setenv("COMET_GEMM_SPLIT", "2", 0);
    comet_rng_t rng = {31};
    /* worlds of 1, 2 and (with 4 GPUs or more) 4 ranks: EP, TP and EP x TP */
    const int max_w = gpus >= 4 ? 4 : gpus >= 2 ? 2 : 1;
    int layouts = 0; /* (world, TP) layouts the lists select */
    for (int w = 1; w <= max_w; w *= 2)
        for (int tp = 1; tp <= w; tp++) {
            if (w % tp || !world_wanted(w) || !check_listed("COMET_LAYER_TEST_TPS", tp)) continue;
            const int ep = w / tp;
            layouts++;
            char tag[160];
            /* the presets, scaled down */
            for (int m = 0; !small && m < comet_num_models; m++) {
                const comet_model_t *mod = &comet_models[m];
                comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
                cfg.hidden = mod->hidden / 16, cfg.ffn = mod->ffn / 16, cfg.num_experts = mod->num_experts;
                cfg.topk = mod->topk, cfg.tp = tp, cfg.ep = ep, cfg.max_tokens_per_rank = 96;
                int64_t tokens[4] = {96, 77, 90, 51};
                comet_routing_opts_t ro = {m % 2 ? 0.2 : 0.0, 0, (uint64_t)m};
                snprintf(tag, sizeof tag, "%s/16 W=%d TP=%d EP=%d", mod->name, w, tp, ep);
                run_case(&cfg, tokens, &ro, tag);
            }
            /* random small configurations */
            for (int rep = 0; rep < 6; rep++) {
                comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
                const int64_t experts[] = {1, 4, 16, 64, 256, 8};
                cfg.tp = tp, cfg.ep = ep;
                cfg.hidden = 8 * (1 + (int64_t)(comet_rng_next(&rng) % 24));
                cfg.ffn = tp * 8 * (1 + (int64_t)(comet_rng_next(&rng) % 12));
                cfg.num_experts = ep * ((experts[rep] + ep - 1) / ep);
                int64_t kmax = cfg.num_experts < 8 ? cfg.num_experts : 8;
                cfg.topk = 1 + (int64_t)(comet_rng_next(&rng) % (uint64_t)kmax);
                cfg.activation = rep == 2 ? COMET_ACT_GELU : COMET_ACT_SILU_GATED;
                cfg.max_tokens_per_rank = 1 + (int64_t)(comet_rng_next(&rng) % 150);
                cfg.tile_m = rep % 2 ? 16 : 0;
                int64_t tokens[4];
                for (int s = 0; s < w; s++)
                    tokens[s] = rep == 3 && s == 0 ? (w > 1 ? 0 : 1)
                                                   : (int64_t)(comet_rng_next(&rng) % (uint64_t)(cfg.max_tokens_per_rank + 1));
                comet_routing_opts_t ro = {rep % 3 ? 0.2 : 0.0, cfg.num_experts >= cfg.topk + 2 && rep == 4 ? 5 : 0,
                                           (uint64_t)(rep + 100 * w)};
                snprintf(tag, sizeof tag, "random W=%d TP=%d H=%lld F=%lld E=%lld k=%lld tile_m=%d", w, tp,
                         (long long)cfg.hidden, (long long)cfg.ffn, (long long)cfg.num_experts, (long long)cfg.topk,
                         cfg.tile_m);
                run_case(&cfg, tokens, &ro, tag);
            }
            /* the data movers' narrow paths: hidden % 8 != 0 (scalar
             * accesses), topk > 32 (slots beyond a warp's lanes), row blocks
             * taller than the pull's 128-row batch */
            {
                comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
                cfg.tp = tp, cfg.ep = ep, cfg.hidden = 36, cfg.ffn = 16 * tp, cfg.num_experts = 64, cfg.topk = 40;
                cfg.max_tokens_per_rank = 90, cfg.tile_m = 200;
                int64_t tokens[4] = {90, 61, 90, 33};
                comet_routing_opts_t ro = {0.2, 0, (uint64_t)(7 + w)};
                snprintf(tag, sizeof tag, "narrow W=%d TP=%d H=36 k=40 tile_m=200", w, tp);
                run_case(&cfg, tokens, &ro, tag);
                cfg.hidden = 264, cfg.topk = 3, cfg.tile_m = 0;
                snprintf(tag, sizeof tag, "wide W=%d TP=%d H=264 k=3 (a partial 256-column group)", w, tp);
                run_case(&cfg, tokens, &ro, tag);
                cfg.hidden = 64, cfg.topk = 40; /* the 16-byte dispatch copy's slots beyond a warp's lanes */
                snprintf(tag, sizeof tag, "wide W=%d TP=%d H=64 k=40", w, tp);
                run_case(&cfg, tokens, &ro, tag);
            }
        }
    if (!small && world_wanted(gpus >= 2 ? 2 : 1)) repeat_case(gpus >= 2 ? 2 : 1);
    cudaDeviceProp prop;
    const int hopper = cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 && !getenv("COMET_SIMT_GEMM");
    if (gpus >= 2 && hopper && world_wanted(2)) mismatch_case(); /* the overlapped mode needs the Hopper GEMM */
    if (world_wanted(1)) bad_routing(1);
    if (gpus >= 2 && world_wanted(2)) bad_routing(2);
    if (gpus >= 4 && world_wanted(4)) bad_routing(4);
    const char *worlds = getenv("COMET_LAYER_TEST_WORLDS"), *tps = getenv("COMET_LAYER_TEST_TPS");
    CHECK(layouts > 0, "COMET_LAYER_TEST_WORLDS=%s COMET_LAYER_TEST_TPS=%s select no layout of 1..%d ranks: nothing ran",
          worlds ? worlds : "", tps ? tps : "", max_w);
    return check_summary("test_layer_gpu");
}
