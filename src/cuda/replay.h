/*
 * replay.h - the layer's forward chain captured once as a CUDA graph and
 * replayed call after call (replay.c says why and when).
 */
#ifndef COMET_CUDA_REPLAY_H
#define COMET_CUDA_REPLAY_H

#include <cuda_runtime.h>

#include "cuda_layer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct comet_cuda_replay comet_cuda_replay_t;

/* A cache of captured chains for one rank's layer, on the current device
 * (it owns a capture stream there). NULL with *err set on failure. */
comet_cuda_replay_t *comet_cuda_replay_create(cudaError_t *err);
void comet_cuda_replay_destroy(comet_cuda_replay_t *r);

/* Enqueue the forward of call on stream, as comet_cuda_forward_launch
 * does: by replaying the chain captured for ctx (captured now on a miss),
 * or by launching it directly where a replay cannot stand in (the stream is
 * being captured, or this context failed to capture). *replayed says which
 * (1 replayed). Returns a cudaError_t as an int. */
int comet_cuda_replay_launch(comet_cuda_replay_t *r, const comet_cuda_ctx_t *ctx, const comet_cuda_call_t *call,
                             cudaStream_t stream, int *replayed);

/* Chains captured so far (a capture per protocol; more means keys churn). */
long long comet_cuda_replay_captures(const comet_cuda_replay_t *r);


#ifdef __cplusplus
}
#endif

#endif /* COMET_CUDA_REPLAY_H */
