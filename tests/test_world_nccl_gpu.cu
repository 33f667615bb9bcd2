/*
 * test_world_nccl_gpu.cu - a world spread over processes, as torchrun runs
 * it: two child processes, one rank and one GPU each, joined by an id that
 * rank 0 makes (comet_get_unique_id) and hands over through a pipe
 * (comet_world_create_nccl). Each rank runs both parallel layouts of a
 * scaled-down Mixtral layer and checks its own tokens against the reference;
 * ranks that pass different configs to comet_layer_create both fail with
 * COMET_ERR_INVALID_ARGUMENT; a config invalid on one rank fails it with its
 * own status and the other with COMET_ERR_PEER_FAILED, and the world runs
 * again. The parent touches no CUDA (a forked child may
 * not inherit an initialised CUDA). Needs two GPUs; otherwise prints
 * "skipped (needs 2 GPUs)".
 */
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../harness/workload.h"
#include "check.h"

#define SKIP_CODE 77

/* One layout on this rank (the runner runs the rank this process holds), then
 * this rank's tokens against the reference: the other's y is in the other
 * process. */
static int run_layout(comet_world_t *w, int rank, int tp, int ep) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 512, cfg.ffn = 1792, cfg.num_experts = 8, cfg.topk = 2, cfg.tp = tp, cfg.ep = ep;
    cfg.max_tokens_per_rank = 200;
    int64_t tokens[2] = {200, 133};
    comet_routing_opts_t ro = {0.2, 0, 5};
    comet_problem_t *p;
    if (comet_problem_create(&p, &cfg, 2, tokens, &ro) != COMET_SUCCESS) return 1;
    comet_problem_poison(p);
    comet_run_t run;
    memset(&run, 0, sizeof run);
    comet_status_t st = comet_problem_run(p, w, &run, 0);
    fprintf(stderr, "rank %d TP=%d EP=%d: %s %s\n", rank, tp, ep, comet_status_string(st), comet_last_error());
    comet_check_t chk;
    memset(&chk, 0, sizeof chk);
    if (st == COMET_SUCCESS) comet_problem_check(p, 0, rank, &chk);
    fprintf(stderr, "rank %d TP=%d EP=%d: %lld of %lld elements off the reference\n", rank, tp, ep,
            (long long)chk.wrong, (long long)chk.elements);
    comet_problem_destroy(p);
    return st != COMET_SUCCESS || chk.wrong != 0 || chk.elements == 0;
}

static int child(int rank, int fd) {
    if (comet_device_count() < 2) return SKIP_CODE;
    comet_unique_id_t id;
    if (rank == 0) {
        if (comet_get_unique_id(&id) != COMET_SUCCESS) return 1;
        if (write(fd, id.bytes, sizeof id.bytes) != (ssize_t)sizeof id.bytes) return 1;
    } else if (read(fd, id.bytes, sizeof id.bytes) != (ssize_t)sizeof id.bytes) {
        return 1;
    }
    close(fd);
    comet_world_t *w;
    if (comet_world_create_nccl(&w, rank, 2, &id, rank) != COMET_SUCCESS) {
        fprintf(stderr, "rank %d: %s\n", rank, comet_last_error());
        return 1;
    }
    int failed = run_layout(w, rank, 1, 2) + run_layout(w, rank, 2, 1);
    /* configs that differ across ranks are refused on both */
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 256, cfg.ffn = rank ? 512 : 768, cfg.num_experts = 4, cfg.topk = 2, cfg.ep = 2;
    cfg.max_tokens_per_rank = 8;
    comet_layer_t *l = NULL;
    comet_status_t st = comet_layer_create(&l, w, rank, &cfg);
    failed += st != COMET_ERR_INVALID_ARGUMENT || l != NULL;
    fprintf(stderr, "rank %d, differing configs: %s %s\n", rank, comet_status_string(st), comet_last_error());
    /* a config invalid on rank 1 alone: it fails with its own status, rank 0 with PEER_FAILED (it
     * does not wait in NCCL), and both then run a layer again */
    cfg.ffn = 512, cfg.hidden = rank ? 0 : 256;
    st = comet_layer_create(&l, w, rank, &cfg);
    failed += st != (rank ? COMET_ERR_INVALID_ARGUMENT : COMET_ERR_PEER_FAILED) || l != NULL;
    fprintf(stderr, "rank %d, config invalid on rank 1: %s %s\n", rank, comet_status_string(st), comet_last_error());
    failed += run_layout(w, rank, 1, 2);
    failed += comet_world_destroy(w) != COMET_SUCCESS;
    return failed ? 1 : 0;
}

int main(void) {
    int fds[2];
    if (pipe(fds) != 0) {
        CHECK(0, "pipe");
        return check_summary("test_world_nccl_gpu");
    }
    pid_t pid[2];
    for (int r = 0; r < 2; r++) {
        pid[r] = fork();
        if (pid[r] == 0) {
            close(fds[r == 0 ? 0 : 1]);
            _exit(child(r, fds[r == 0 ? 1 : 0]));
        }
    }
    close(fds[0]), close(fds[1]);
    int code[2] = {1, 1};
    for (int r = 0; r < 2; r++) {
        int status = 0;
        if (pid[r] > 0 && waitpid(pid[r], &status, 0) == pid[r] && WIFEXITED(status)) code[r] = WEXITSTATUS(status);
    }
    if (code[0] == SKIP_CODE || code[1] == SKIP_CODE) {
        check_skip("test_world_nccl_gpu", "needs 2 GPUs");
        return check_summary("test_world_nccl_gpu");
    }
    CHECK(code[0] == 0, "rank 0 process exited %d", code[0]);
    CHECK(code[1] == 0, "rank 1 process exited %d", code[1]);
    return check_summary("test_world_nccl_gpu");
}
