/*
 * plan_kernel.cu - the plan builder of src/plan/plan_impl.h compiled for the
 * device, so that a rank builds its plan from every rank's routing (read
 * through peer pointers) without a host synchronisation.
 *
 * Today one thread runs the sequential phases; splitting the phases over a
 * block is the next step (plan_impl.h keeps each phase a loop over
 * independent items or a prefix sum so the result will not change).
 */
#define COMET_PLAN_DEVICE_ONLY
#define COMET_PLAN_API static __device__
#include "../plan/plan_impl.h"
#include "plan_kernel.h"

__global__ void comet_plan_build_kernel(comet_dims_t d, comet_plan_input_t in, void *workspace) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    comet_plan_t plan;
    comet_plan_carve(&d, workspace, &plan);
    comet_plan_build(&d, &in, &plan);
}

extern "C" cudaError_t comet_cuda_plan_build(const comet_dims_t *d, const comet_plan_input_t *in, void *workspace,
                                             cudaStream_t stream) {
    comet_plan_build_kernel<<<1, 32, 0, stream>>>(*d, *in, workspace);
    return cudaGetLastError();
}
