/*
 * test_options.c - the world's options and the protocol a layer reports:
 * comet_world_options_t set in code, the environment as the fallback, every
 * default filled in by comet_world_get_options, bad options refused with
 * nothing created; comet_layer_last_protocol before and after a forward
 * (CPU engine: overlapped, the fp32 partials' combine, the chooser named).
 */
#include <stdlib.h>
#include <string.h>

#include "../harness/workload.h"
#include "check.h"

static void test_options(void) {
    unsetenv("COMET_TIMEOUT_MS"), unsetenv("COMET_CPU_WORKERS"), unsetenv("COMET_TUNE_FILE"), unsetenv("COMET_REPLAY");
    comet_world_t *w = NULL;
    comet_world_options_t got = COMET_WORLD_OPTIONS_INIT;
    CHECK(comet_world_create_local_opts(&w, 2, COMET_BACKEND_CPU, NULL) == COMET_SUCCESS, "NULL options: %s",
          comet_last_error());
    CHECK(comet_world_get_options(w, &got) == COMET_SUCCESS && got.timeout_ms == 60000 && got.cpu_workers == 2 &&
              strcmp(got.tune_file, "") == 0 && got.graph_replay == 1,
          "defaults: timeout %d, workers %d, tune '%s', replay %d", got.timeout_ms, got.cpu_workers, got.tune_file,
          got.graph_replay);
    comet_world_options_t small = {0};
    CHECK(comet_world_get_options(w, &small) == COMET_ERR_INVALID_ARGUMENT, "get_options without struct_size");
    comet_world_destroy(w);

    /* the environment fills what the options leave at 0; the options win over it */
    setenv("COMET_TIMEOUT_MS", "1234", 1), setenv("COMET_CPU_WORKERS", "3", 1), setenv("COMET_REPLAY", "0", 1);
    comet_world_options_t o = COMET_WORLD_OPTIONS_INIT;
    o.cpu_workers = 5, o.tune_file = "/nonexistent/table.tsv";
    CHECK(comet_world_create_local_opts(&w, 2, COMET_BACKEND_CPU, &o) == COMET_SUCCESS, "options: %s",
          comet_last_error());
    CHECK(comet_world_get_options(w, &got) == COMET_SUCCESS && got.timeout_ms == 1234 && got.cpu_workers == 5 &&
              strcmp(got.tune_file, "/nonexistent/table.tsv") == 0 && got.graph_replay == -1,
          "env and options: timeout %d, workers %d, tune '%s', replay %d", got.timeout_ms, got.cpu_workers,
          got.tune_file, got.graph_replay);
    comet_world_destroy(w);
    unsetenv("COMET_TIMEOUT_MS"), unsetenv("COMET_CPU_WORKERS"), unsetenv("COMET_REPLAY");

    /* bad options: refused, nothing created */
    comet_world_options_t bad[5];
    for (int i = 0; i < 5; i++) bad[i] = (comet_world_options_t)COMET_WORLD_OPTIONS_INIT;
    bad[0].struct_size = 8, bad[1].timeout_ms = -1, bad[2].cpu_workers = 257, bad[3].graph_replay = 2;
    char long_path[5000];
    memset(long_path, 'a', sizeof long_path - 1), long_path[sizeof long_path - 1] = 0;
    bad[4].tune_file = long_path;
    for (int i = 0; i < 5; i++) {
        w = (comet_world_t *)&bad; /* must be reset to NULL */
        CHECK(comet_world_create_local_opts(&w, 2, COMET_BACKEND_CPU, &bad[i]) == COMET_ERR_INVALID_ARGUMENT &&
                  w == NULL && strstr(comet_last_error(), "options") != NULL,
              "bad options %d: %s", i, comet_last_error());
    }
    /* a tune file that is not a table (a directory) is an error, not an empty table */
    o = (comet_world_options_t)COMET_WORLD_OPTIONS_INIT;
    o.tune_file = "/tmp";
    CHECK(comet_world_create_local_opts(&w, 2, COMET_BACKEND_CPU, &o) == COMET_ERR_INVALID_ARGUMENT && w == NULL,
          "a directory as the tune file: %s", comet_last_error());
}

static void test_protocol(void) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 64, cfg.ffn = 64, cfg.num_experts = 4, cfg.topk = 2, cfg.ep = 1, cfg.max_tokens_per_rank = 16;
    comet_world_t *w = NULL;
    comet_layer_t *l = NULL;
    CHECK(comet_world_create_local(&w, 1, COMET_BACKEND_CPU) == COMET_SUCCESS, "world");
    CHECK(comet_layer_create(&l, w, 0, &cfg) == COMET_SUCCESS, "layer: %s", comet_last_error());
    comet_protocol_t p = COMET_PROTOCOL_INIT;
    CHECK(comet_layer_last_protocol(l, &p) == COMET_ERR_INVALID_ARGUMENT, "a protocol before any forward");
    int64_t tokens[1] = {16};
    comet_routing_opts_t ro = {0, 0, 3};
    comet_problem_t *prob = NULL;
    CHECK(comet_problem_create(&prob, &cfg, 1, tokens, &ro) == COMET_SUCCESS, "problem");
    comet_forward_args_t a = prob->args[0];
    a.n_comm = 3;
    CHECK(comet_layer_forward(l, &a) == COMET_SUCCESS, "forward: %s", comet_last_error());
    CHECK(comet_layer_last_protocol(l, &p) == COMET_SUCCESS && p.mode == COMET_MODE_OVERLAPPED && p.n_comm == 3 &&
              p.combine == COMET_COMBINE_PARTIALS && p.gemm == COMET_GEMM_CPU && p.chosen_by == COMET_CHOSEN_BY_ARGS &&
              p.chunk_cols > 0 && p.graph_replay == 0,
          "after n_comm 3: mode %d n_comm %d combine %d gemm %d chosen %d chunk %d", (int)p.mode, p.n_comm,
          (int)p.combine, (int)p.gemm, (int)p.chosen_by, p.chunk_cols);
    a.n_comm = 0;
    CHECK(comet_layer_forward(l, &a) == COMET_SUCCESS && comet_layer_last_protocol(l, &p) == COMET_SUCCESS &&
              p.chosen_by == COMET_CHOSEN_BY_RULE && p.n_comm >= 1,
          "n_comm 0: the rule chose %d (by %d)", p.n_comm, (int)p.chosen_by);
    a.n_comm = 1000; /* refused: the last protocol stays the last forward that ran */
    CHECK(comet_layer_forward(l, &a) == COMET_ERR_INVALID_ARGUMENT && comet_layer_last_protocol(l, &p) == COMET_SUCCESS &&
              p.chosen_by == COMET_CHOSEN_BY_RULE,
          "after a refused call: chosen by %d", (int)p.chosen_by);
    comet_protocol_t short_p = COMET_PROTOCOL_INIT;
    short_p.struct_size = 4;
    CHECK(comet_layer_last_protocol(l, &short_p) == COMET_ERR_INVALID_ARGUMENT, "protocol without struct_size");
    comet_problem_destroy(prob);
    comet_layer_destroy(l);
    CHECK(comet_world_destroy(w) == COMET_SUCCESS, "destroy");
}

int main(void) {
    test_options();
    test_protocol();
    return check_summary("test_options");
}
