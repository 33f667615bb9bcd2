/*
 * test_plan.c - plan metadata checked exactly: one routing worked out by hand
 * (every count, offset, row, block, order and list), then random routings
 * over many layouts checked against brute-force properties of the contract
 * (each routed slot lands in exactly one row, local-first stage order, blocks
 * cover the rows, send lists and home groups are exact).
 */
#include <stdlib.h>
#include <string.h>

#include "../src/core/validate.h"
#include "../src/plan/plan.h"
#include "../harness/workload.h"
#include "check.h"

typedef struct {
    comet_dims_t d;
    void *ws;
    comet_plan_t plan;
} built_t;

static void build(built_t *b, const comet_layer_config_t *cfg, int rank, const comet_plan_input_t *in) {
    comet_status_t st = comet_dims_from_config(cfg, cfg->tp * cfg->ep, rank, &b->d);
    CHECK(st == COMET_SUCCESS, "dims: %s", comet_last_error());
    b->ws = aligned_alloc(64, (comet_plan_workspace_bytes(&b->d) + 63) / 64 * 64);
    memset(b->ws, 0xab, comet_plan_workspace_bytes(&b->d)); /* poison */
    comet_plan_carve(&b->d, b->ws, &b->plan);
    comet_plan_build(&b->d, in, &b->plan);
}

static int row_is(const comet_plan_row_t *r, int s, int t, int j) {
    return r->src_rank == s && r->src_token == t && r->slot == j;
}

static void test_by_hand(void) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 8, cfg.ffn = 4, cfg.num_experts = 4, cfg.topk = 2, cfg.tp = 1, cfg.ep = 2;
    cfg.max_tokens_per_rank = 4, cfg.tile_m = 2;
    const int32_t idx0[] = {0, 2, 1, 0, 3, 2}; /* rank 0: 3 tokens */
    const int32_t idx1[] = {0, 1, 2, 0};       /* rank 1: 2 tokens */
    const float w0[] = {.1f, .2f, .3f, .4f, .5f, .6f}, w1[] = {.7f, .8f, .9f, 1.f};
    const int64_t counts[] = {3, 2};
    const int32_t *idx[] = {idx0, idx1};
    const float *wt[] = {w0, w1};
    comet_plan_input_t in = {counts, idx, wt};

    built_t b;
    build(&b, &cfg, 0, &in); /* rank 0 holds experts 0 and 1 */
    comet_plan_t *p = &b.plan;
    CHECK(p->totals->num_rows == 6 && p->totals->num_rows_padded == 6 && p->totals->num_blocks == 3,
          "totals %d %d %d", p->totals->num_rows, p->totals->num_rows_padded, p->totals->num_blocks);
    CHECK(p->expert_count[0] == 4 && p->expert_count[1] == 2, "counts %d %d", p->expert_count[0], p->expert_count[1]);
    CHECK(p->expert_start[0] == 0 && p->expert_start[1] == 4 && p->expert_start[2] == 6, "starts");
    CHECK(row_is(&p->rows[0], 0, 0, 0) && row_is(&p->rows[1], 0, 1, 1), "expert 0 local rows first");
    CHECK(row_is(&p->rows[2], 1, 0, 0) && row_is(&p->rows[3], 1, 1, 1), "expert 0 remote rows");
    CHECK(row_is(&p->rows[4], 0, 1, 0) && row_is(&p->rows[5], 1, 0, 1), "expert 1 rows");
    CHECK(p->rows[1].weight == .4f && p->rows[5].weight == .8f, "row weights");
    CHECK(p->blocks[0].expert == 0 && p->blocks[0].row_start == 0 && p->blocks[0].num_rows == 2 &&
              p->blocks[0].stage == 0, "block 0");
    CHECK(p->blocks[1].expert == 0 && p->blocks[1].row_start == 2 && p->blocks[1].stage == 1, "block 1");
    CHECK(p->blocks[2].expert == 1 && p->blocks[2].row_start == 4 && p->blocks[2].stage == 1, "block 2");
    CHECK(p->l0_order[0] == 0 && p->l0_order[1] == 1 && p->l0_order[2] == 2, "l0 order");
    CHECK(p->stage_end[0] == 1 && p->stage_end[1] == 3, "stage ends %d %d", p->stage_end[0], p->stage_end[1]);
    const int32_t ros0[] = {0, -1, 4, 1, -1, -1}, ros1[] = {2, 5, -1, 3};
    CHECK(memcmp(p->row_of_slot, ros0, sizeof ros0) == 0, "row_of_slot of rank 0's tokens");
    CHECK(memcmp(p->row_of_slot + 4 * 2, ros1, sizeof ros1) == 0, "row_of_slot of rank 1's tokens");
    CHECK(p->send_count[0] == 2 && p->send_tokens[0] == 0 && p->send_tokens[1] == 1, "send list to rank 0");
    CHECK(p->send_count[1] == 2 && p->send_tokens[4] == 0 && p->send_tokens[5] == 1, "send list to rank 1");
    CHECK(p->home_group_count[0] == 2 && p->home_groups[0] == 0 && p->home_groups[1] == 1, "token 0 groups");
    CHECK(p->home_group_count[1] == 1 && p->home_groups[2] == 0, "token 1 groups");
    CHECK(p->home_group_count[2] == 1 && p->home_groups[4] == 1, "token 2 groups");
    free(b.ws);

    build(&b, &cfg, 1, &in); /* rank 1 holds experts 2 and 3; its own rows first */
    p = &b.plan;
    CHECK(p->expert_count[0] == 3 && p->expert_count[1] == 1, "rank 1 counts");
    CHECK(p->expert_start[1] == 4 && p->expert_start[2] == 6, "rank 1 starts");
    CHECK(row_is(&p->rows[0], 1, 1, 0) && row_is(&p->rows[1], 0, 0, 1) && row_is(&p->rows[2], 0, 2, 1),
          "rank 1 expert 2 rows: local first");
    CHECK(p->rows[3].src_rank == -1 && p->rows[5].src_rank == -1, "padding rows marked");
    CHECK(row_is(&p->rows[4], 0, 2, 0), "rank 1 expert 3 row");
    CHECK(p->totals->num_blocks == 3 && p->blocks[1].num_rows == 1, "rank 1 blocks");
    CHECK(p->blocks[0].stage == 1 && p->stage_end[0] == 0 && p->stage_end[1] == 3, "rank 1 stages");
    CHECK(p->send_count[1] == 1 && p->send_tokens[4] == 1, "rank 1 sends one own token");
    free(b.ws);
}

/* Brute-force properties of one rank's plan. */
static void check_plan_properties(const built_t *b, const comet_plan_input_t *in, const char *tag) {
    const comet_dims_t *d = &b->d;
    const comet_plan_t *p = &b->plan;
    const int w = d->world_size, r = d->rank;
    const int64_t el = d->experts_local, topk = d->topk, e0 = d->ep_rank * el, tm = d->tile_m;
    int64_t want_rows = 0;
    int ok = 1;
    /* every routed slot to a local expert is exactly one row with its data */
    for (int s = 0; s < w; s++)
        for (int64_t t = 0; t < in->token_count[s]; t++)
            for (int64_t j = 0; j < topk; j++) {
                int64_t e = in->topk_idx[s][t * topk + j] - e0;
                int32_t row = p->row_of_slot[(s * d->max_tokens + t) * topk + j];
                if (e < 0 || e >= el) {
                    ok &= row == -1;
                    continue;
                }
                want_rows++;
                ok &= row >= p->expert_start[e] && row < p->expert_start[e] + p->expert_count[e];
                if (row >= 0) ok &= row_is(&p->rows[row], s, (int)t, (int)j) && p->rows[row].weight == in->topk_w[s][t * topk + j];
            }
    CHECK(ok, "%s: rows and row_of_slot agree with the routing", tag);
    CHECK(p->totals->num_rows == want_rows, "%s: %d rows, want %lld", tag, p->totals->num_rows, (long long)want_rows);
    /* padded offsets, stage order inside each expert */
    ok = p->expert_start[0] == 0;
    for (int64_t e = 0; e < el; e++) {
        int64_t len = p->expert_start[e + 1] - p->expert_start[e];
        ok &= len % tm == 0 && len >= p->expert_count[e] && len < p->expert_count[e] + tm;
        for (int32_t i = p->expert_start[e] + 1; i < p->expert_start[e] + p->expert_count[e]; i++) {
            const comet_plan_row_t *a = &p->rows[i - 1], *c = &p->rows[i];
            int64_t ka = ((int64_t)comet_stage_of(r, a->src_rank, w) * d->max_tokens + a->src_token) * topk + a->slot;
            int64_t kc = ((int64_t)comet_stage_of(r, c->src_rank, w) * d->max_tokens + c->src_token) * topk + c->slot;
            ok &= ka < kc;
        }
        for (int32_t i = p->expert_start[e] + p->expert_count[e]; i < p->expert_start[e + 1]; i++)
            ok &= p->rows[i].src_rank == -1;
    }
    CHECK(ok, "%s: padded offsets and (stage, token, slot) order", tag);
    /* blocks cover the valid rows, block b at padded row b * tile_m (the
     * overlapped dispatch finds a row's block by division); their stage is
     * the max of their rows */
    int64_t covered = 0;
    ok = 1;
    for (int32_t bi = 0; bi < p->totals->num_blocks; bi++) {
        const comet_plan_block_t *blk = &p->blocks[bi];
        ok &= blk->num_rows >= 1 && blk->num_rows <= tm && blk->row_start == bi * tm;
        ok &= blk->row_start + blk->num_rows <= p->expert_start[blk->expert] + p->expert_count[blk->expert];
        int mx = 0;
        for (int32_t i = blk->row_start; i < blk->row_start + blk->num_rows; i++) {
            int st = comet_stage_of(r, p->rows[i].src_rank, w);
            mx = st > mx ? st : mx;
        }
        ok &= mx == blk->stage;
        covered += blk->num_rows;
    }
    CHECK(ok && covered == want_rows, "%s: blocks cover %lld of %lld rows", tag, (long long)covered, (long long)want_rows);
    /* l0 order: a permutation, stages ascending, ties by block id */
    ok = 1;
    char *seen = calloc((size_t)p->totals->num_blocks + 1, 1);
    for (int32_t i = 0; i < p->totals->num_blocks; i++) {
        int32_t bi = p->l0_order[i];
        ok &= bi >= 0 && bi < p->totals->num_blocks && !seen[bi];
        if (ok) seen[bi] = 1;
        if (ok && i > 0) {
            const comet_plan_block_t *a = &p->blocks[p->l0_order[i - 1]], *c = &p->blocks[bi];
            ok &= a->stage < c->stage || (a->stage == c->stage && p->l0_order[i - 1] < bi);
        }
    }
    for (int q = 0; q < w; q++) {
        int32_t n = 0;
        for (int32_t bi = 0; bi < p->totals->num_blocks; bi++) n += p->blocks[bi].stage <= q;
        ok &= p->stage_end[q] == n;
    }
    free(seen);
    CHECK(ok, "%s: local-first block order and stage ends", tag);
    /* send lists: exactly the tokens with a row here, ascending */
    ok = 1;
    for (int s = 0; s < w; s++) {
        int32_t n = 0;
        for (int64_t t = 0; t < in->token_count[s]; t++) {
            int here = 0;
            for (int64_t j = 0; j < topk; j++) {
                int64_t e = in->topk_idx[s][t * topk + j] - e0;
                here |= e >= 0 && e < el;
            }
            if (here) ok &= n < p->send_count[s] && p->send_tokens[s * d->max_tokens + n++] == t;
        }
        ok &= n == p->send_count[s];
    }
    CHECK(ok, "%s: send lists", tag);
    /* home groups: the sorted set of EP groups of each local token */
    ok = 1;
    for (int64_t t = 0; t < in->token_count[r]; t++) {
        int32_t n = 0;
        for (int g = 0; g < d->ep; g++) {
            int used = 0;
            for (int64_t j = 0; j < topk; j++) used |= in->topk_idx[r][t * topk + j] / el == g;
            if (used) ok &= n < p->home_group_count[t] && p->home_groups[t * topk + n++] == g;
        }
        ok &= n == p->home_group_count[t];
    }
    CHECK(ok, "%s: home groups", tag);
}

static void test_random(void) {
    comet_rng_t rng = {12345};
    const int worlds[] = {1, 2, 4, 8};
    int cases = 0;
    for (int wi = 0; wi < 4; wi++) {
        int w = worlds[wi];
        for (int tp = 1; tp <= w; tp *= 2) {
            for (int rep = 0; rep < 6; rep++) {
                int ep = w / tp;
                comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
                cfg.hidden = 8, cfg.ffn = 4 * tp, cfg.tp = tp, cfg.ep = ep;
                const int64_t experts[] = {1, 2, 3, 8, 64, 512};
                cfg.num_experts = ep * ((experts[rep] + ep - 1) / ep);
                cfg.topk = 1 + (int64_t)(comet_rng_next(&rng) % (uint64_t)(cfg.num_experts < 8 ? cfg.num_experts : 8));
                cfg.max_tokens_per_rank = 1 + (int64_t)(comet_rng_next(&rng) % 40);
                cfg.tile_m = 1 + (int)(comet_rng_next(&rng) % 9);
                int64_t tokens[8];
                for (int s = 0; s < w; s++) /* includes 0 and the max */
                    tokens[s] = (int64_t)(comet_rng_next(&rng) % (uint64_t)(cfg.max_tokens_per_rank + 1));
                comet_routing_opts_t ro = {rep % 2 ? 0.2 : 0.0,
                                           cfg.num_experts > cfg.topk + 1 ? (rep % 3 == 2 ? 1 : 0) : 0,
                                           (uint64_t)rep};
                comet_problem_t *pr;
                comet_status_t st = comet_problem_create(&pr, &cfg, w, tokens, &ro);
                CHECK(st == COMET_SUCCESS, "problem: %s", comet_last_error());
                if (st) continue;
                comet_plan_input_t in = {pr->tokens, (const int32_t *const *)pr->topk_idx,
                                         (const float *const *)pr->topk_w};
                for (int r = 0; r < w; r++) {
                    built_t b;
                    char tag[160];
                    snprintf(tag, sizeof tag, "W=%d TP=%d EP=%d E=%lld topk=%lld tile_m=%d rank %d", w, tp, ep,
                             (long long)cfg.num_experts, (long long)cfg.topk, cfg.tile_m, r);
                    build(&b, &cfg, r, &in);
                    check_plan_properties(&b, &in, tag);
                    free(b.ws);
                }
                comet_problem_destroy(pr);
                cases++;
            }
        }
    }
    printf("test_plan: %d random layouts checked\n", cases);
}

/* Bytes crossing between ranks, worked out by hand for the routing above. */
static void test_link_bytes(void) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 8, cfg.ffn = 4, cfg.num_experts = 4, cfg.topk = 2, cfg.tp = 1, cfg.ep = 2;
    cfg.max_tokens_per_rank = 2;
    int64_t tokens[2] = {2, 1};
    comet_routing_opts_t ro = {0, 0, 1};
    comet_problem_t *p;
    if (comet_problem_create(&p, &cfg, 2, tokens, &ro) != COMET_SUCCESS) {
        CHECK(0, "problem: %s", comet_last_error());
        return;
    }
    const int32_t r0[] = {0, 2, 1, 0}, r1[] = {0, 1};
    memcpy(p->topk_idx[0], r0, sizeof r0), memcpy(p->topk_idx[1], r1, sizeof r1);
    /* rank 0 token 0: one row to rank 1 (2H) and its partial back (4H); token 1
     * stays home; rank 1 token 0: two rows to rank 0 (4H), one partial (4H) */
    const int64_t cpu = comet_problem_link_bytes(p, COMET_BACKEND_CPU),
                  cuda = comet_problem_link_bytes(p, COMET_BACKEND_CUDA);
    CHECK(cpu == 14 * 8, "EP=2 link bytes %lld, want %d", (long long)cpu, 14 * 8);
    /* CUDA: rank 1's token 0 is pulled once for its two slots (2H), rank 0's
     * token 0 once (2H); the three slot rows come back as expert outputs (2H each) */
    CHECK(cuda == 10 * 8, "EP=2 link bytes (CUDA) %lld, want %d", (long long)cuda, 10 * 8);
    comet_problem_destroy(p);
    cfg.tp = 2, cfg.ep = 1; /* TP: the other rank pulls every slot's row and returns every token's partial */
    if (comet_problem_create(&p, &cfg, 2, tokens, &ro) != COMET_SUCCESS) return;
    CHECK(comet_problem_link_bytes(p, COMET_BACKEND_CPU) == (3 * 2 * 2 + 3 * 4) * 8, "TP=2 link bytes %lld",
          (long long)comet_problem_link_bytes(p, COMET_BACKEND_CPU));
    /* CUDA: each token pulled once by the other rank (2H), the other rank's
     * output row of every slot back (2H each) */
    CHECK(comet_problem_link_bytes(p, COMET_BACKEND_CUDA) == (3 * 2 + 3 * 2 * 2) * 8, "TP=2 link bytes (CUDA) %lld",
          (long long)comet_problem_link_bytes(p, COMET_BACKEND_CUDA));
    comet_problem_destroy(p);
}

int main(void) {
    test_by_hand();
    test_link_bytes();
    test_random();
    return check_summary("test_plan");
}
