/*
 * plan_kernel.h - C interface of the device plan builder (plan_kernel.cu).
 */
#ifndef COMET_PLAN_KERNEL_H
#define COMET_PLAN_KERNEL_H

#include <cuda_runtime.h>

#include "../plan/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest max(E_local + 1, W) the parallel builder handles (shared-memory
 * bitmasks); above it a single thread runs the sequential builder. */
#define COMET_PLAN_MAX_KEYS 1024

/* Device scratch the builder needs beside the workspace (a table of row
 * counts per source rank, chunk of 1024 tokens and local expert; rows per
 * local expert and stage). */
size_t comet_cuda_plan_scratch_bytes(const comet_dims_t *d);

/* Called on the host between the parallel builder's two kernels (step 1:
 * after count), with the stream: e.g. to enqueue trace marks. */
typedef cudaError_t (*comet_plan_step_hook_t)(void *arg, int step, cudaStream_t stream);

/* Build rank d->rank's plan on the device into workspace (device memory of
 * comet_plan_workspace_bytes(d)), using scratch (comet_cuda_plan_scratch_bytes
 * of device memory, contents irrelevant; not shared with a concurrent build).
 * in's arrays (token_count, the pointer arrays and what they point to) must
 * be device-accessible. When skip is not NULL and *skip != 0 at run time,
 * nothing is built. Asynchronous on stream (two kernels; between, when not
 * NULL, is called after the first); returns the launch status. */
cudaError_t comet_cuda_plan_build(const comet_dims_t *d, const comet_plan_input_t *in, void *workspace, void *scratch,
                                  const uint32_t *skip, cudaStream_t stream, comet_plan_step_hook_t between, void *arg);

#ifdef __cplusplus
}
#endif

#endif /* COMET_PLAN_KERNEL_H */
