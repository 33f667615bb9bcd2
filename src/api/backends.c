/*
 * backends.c - the backends this build has: the one place that knows
 * whether the CUDA backend was compiled in (COMET_WITH_CUDA).
 */
#include "api.h"

const comet_backend_ops_t *comet_backend_ops(comet_backend_t b) {
    switch (b) {
    case COMET_BACKEND_CPU:
        return &comet_cpu_ops;
    case COMET_BACKEND_CUDA:
#ifdef COMET_WITH_CUDA
        return &comet_cuda_ops;
#else
        return NULL;
#endif
    }
    return NULL;
}
