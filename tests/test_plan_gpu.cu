/*
 * test_plan_gpu.cu - the plan built on the GPU (src/cuda/plan_kernel.cu, the
 * parallel builder, and the serial one past COMET_PLAN_MAX_KEYS) is byte for
 * byte the plan built on the host, over random routings and every (TP, EP)
 * layout of W in {1, 2, 4, 8}, with more than 1024 tokens per rank (several
 * chunks) in some cases, on scratch poisoned before. Both workspaces are poisoned alike
 * first, so an element one side writes and the other does not shows up.
 * Without a GPU it prints "skipped (no GPU)".
 */
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "../src/core/validate.h"
#include "../src/cuda/plan_kernel.h"
#include "../harness/workload.h"
#include "check.h"

static void check_case(const comet_layer_config_t *cfg, int w, const comet_problem_t *p, const char *tag) {
    /* routing of every rank on the device, as peer pointers would give it */
    int32_t *d_idx[8];
    float *d_wt[8];
    int32_t **d_idx_arr;
    float **d_wt_arr;
    int64_t *d_counts;
    for (int s = 0; s < w; s++) {
        size_t n = (size_t)(p->tokens[s] * cfg->topk) + 1;
        CUDA_OK(cudaMalloc(&d_idx[s], n * sizeof(int32_t)));
        CUDA_OK(cudaMalloc(&d_wt[s], n * sizeof(float)));
        CUDA_OK(cudaMemcpy(d_idx[s], p->topk_idx[s], (n - 1) * sizeof(int32_t), cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(d_wt[s], p->topk_w[s], (n - 1) * sizeof(float), cudaMemcpyHostToDevice));
    }
    CUDA_OK(cudaMalloc(&d_idx_arr, sizeof(void *) * (size_t)w));
    CUDA_OK(cudaMalloc(&d_wt_arr, sizeof(void *) * (size_t)w));
    CUDA_OK(cudaMalloc(&d_counts, sizeof(int64_t) * (size_t)w));
    CUDA_OK(cudaMemcpy(d_idx_arr, d_idx, sizeof(void *) * (size_t)w, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_wt_arr, d_wt, sizeof(void *) * (size_t)w, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_counts, p->tokens, sizeof(int64_t) * (size_t)w, cudaMemcpyHostToDevice));
    for (int r = 0; r < w; r++) {
        comet_dims_t d;
        comet_dims_from_config(cfg, w, r, &d);
        size_t bytes = comet_plan_workspace_bytes(&d);
        void *host = aligned_alloc(64, (bytes + 63) / 64 * 64), *back = malloc(bytes), *dev;
        memset(host, 0xab, bytes);
        comet_plan_t plan;
        comet_plan_carve(&d, host, &plan);
        comet_plan_input_t hin = {p->tokens, (const int32_t *const *)p->topk_idx, (const float *const *)p->topk_w};
        comet_plan_build(&d, &hin, &plan);
        void *scratch;
        CUDA_OK(cudaMalloc(&dev, bytes));
        CUDA_OK(cudaMemset(dev, 0xab, bytes));
        CUDA_OK(cudaMalloc(&scratch, comet_cuda_plan_scratch_bytes(&d)));
        CUDA_OK(cudaMemset(scratch, 0x5a, comet_cuda_plan_scratch_bytes(&d))); /* the builder must not rely on it */
        comet_plan_input_t din = {d_counts, (const int32_t *const *)d_idx_arr, (const float *const *)d_wt_arr};
        CUDA_OK(comet_cuda_plan_build(&d, &din, dev, scratch, NULL, 0, NULL, NULL));
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(back, dev, bytes, cudaMemcpyDeviceToHost));
        CHECK(memcmp(host, back, bytes) == 0, "%s rank %d: device plan differs from the host plan", tag, r);
        cudaFree(dev), cudaFree(scratch);
        free(host), free(back);
    }
    for (int s = 0; s < w; s++) cudaFree(d_idx[s]), cudaFree(d_wt[s]);
    cudaFree(d_idx_arr), cudaFree(d_wt_arr), cudaFree(d_counts);
}

int main(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        check_skip("test_plan_gpu", "no GPU");
        return check_summary("test_plan_gpu");
    }
    comet_rng_t rng = {99};
    const int worlds[] = {1, 2, 4, 8};
    /* 1024 experts on one rank: past COMET_PLAN_MAX_KEYS, the serial builder */
    const int64_t experts[] = {1, 8, 64, 512, 1024};
    for (int wi = 0; wi < 4; wi++)
        for (int tp = 1; tp <= worlds[wi]; tp *= 2)
            for (int rep = 0; rep < 5; rep++) {
                int w = worlds[wi], ep = w / tp;
                comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
                cfg.hidden = 8, cfg.ffn = 4 * tp, cfg.tp = tp, cfg.ep = ep;
                cfg.num_experts = ep * ((experts[rep] + ep - 1) / ep);
                cfg.topk = 1 + (int64_t)(comet_rng_next(&rng) % (uint64_t)(cfg.num_experts < 8 ? cfg.num_experts : 8));
                cfg.max_tokens_per_rank = 1 + (int64_t)(comet_rng_next(&rng) % (rep >= 2 ? 3000 : 200)); /* several 1024-token chunks */
                cfg.tile_m = rep == 3 ? 128 : 1 + (int)(comet_rng_next(&rng) % 16);
                int64_t tokens[8];
                for (int s = 0; s < w; s++) tokens[s] = (int64_t)(comet_rng_next(&rng) % (uint64_t)(cfg.max_tokens_per_rank + 1));
                comet_routing_opts_t ro = {rep % 2 ? 0.2 : 0.0, 0, (uint64_t)rep};
                comet_problem_t *p;
                if (comet_problem_create(&p, &cfg, w, tokens, &ro) != COMET_SUCCESS) {
                    CHECK(0, "problem: %s", comet_last_error());
                    continue;
                }
                char tag[128];
                snprintf(tag, sizeof tag, "W=%d TP=%d E=%lld topk=%lld tile_m=%d", w, tp, (long long)cfg.num_experts,
                         (long long)cfg.topk, cfg.tile_m);
                check_case(&cfg, w, p, tag);
                comet_problem_destroy(p);
            }
    return check_summary("test_plan_gpu");
}
