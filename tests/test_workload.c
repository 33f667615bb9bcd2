/*
 * test_workload.c - the benchmark's routing draw, pinned: comet_problem_create's
 * expert ids for two problems (uniform popularity, and skewed with empty
 * experts over four ranks, one of them without tokens) against fixed values.
 * bench/torch_moe.py's routing() draws the same ids in Python so that the
 * PyTorch baseline and the Python step (bench/torch_comet.py) route the
 * rows `comet bench` routes; python/tests/test_torch_baseline.py pins the
 * same values, so a change to either draw fails one of the two.
 * Prints "test_workload: N passed, N failed".
 */
#include <stdint.h>

#include "../harness/workload.h"
#include "check.h"

/* FNV-1a (64-bit) of every rank's expert ids in rank order, each id's four bytes little-endian. */
static uint64_t ids_hash(const comet_problem_t *p) {
    uint64_t h = CHECK_FNV1A_BASIS;
    for (int s = 0; s < p->world_size; s++)
        for (int64_t i = 0; i < p->tokens[s] * p->cfg.topk; i++) {
            const uint32_t v = (uint32_t)p->topk_idx[s][i];
            const unsigned char le[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                                         (unsigned char)(v >> 24)};
            h = check_fnv1a(h, le, 4);
        }
    return h;
}

static comet_problem_t *problem(int64_t experts, int64_t topk, int64_t hidden, int world, const int64_t *tokens,
                                double skew, int64_t zero, uint64_t seed) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = hidden, cfg.ffn = 8, cfg.num_experts = experts, cfg.topk = topk, cfg.ep = world;
    for (int s = 0; s < world; s++)
        if (tokens[s] > cfg.max_tokens_per_rank) cfg.max_tokens_per_rank = tokens[s];
    const comet_routing_opts_t ro = {skew, zero, seed};
    comet_problem_t *p = NULL;
    CHECK(comet_problem_create(&p, &cfg, world, tokens, &ro) == COMET_SUCCESS, "%s", comet_last_error());
    return p;
}

int main(void) {
    /* seed 1, 8 experts, top-2, H 16, 3 tokens on each of 2 ranks */
    const int64_t t2[2] = {3, 3};
    const int32_t want[12] = {5, 2, 2, 1, 1, 5, 6, 5, 4, 7, 4, 2};
    comet_problem_t *p = problem(8, 2, 16, 2, t2, 0.0, 0, 1);
    for (int i = 0; p && i < 12; i++)
        CHECK(p->topk_idx[i / 6][i % 6] == want[i], "id %d: %d, want %d", i, p->topk_idx[i / 6][i % 6], want[i]);
    comet_problem_destroy(p);

    /* seed 3, 64 experts (5 empty), top-4, H 40, skew 0.7, tokens 37, 29, 11, 0 */
    const int64_t t4[4] = {37, 29, 11, 0};
    p = problem(64, 4, 40, 4, t4, 0.7, 5, 3);
    if (p) CHECK(ids_hash(p) == 0x67abbb2681713b18ull, "ids' hash %016llx", (unsigned long long)ids_hash(p));
    comet_problem_destroy(p);
    return check_summary("test_workload");
}
