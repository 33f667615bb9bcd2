/*
 * runtime.h - the objects behind the public handles (comet_world_t,
 * comet_layer_t) and the calls a backend implements. Not part of the public
 * API.
 *
 * A world of the CPU backend is W threads of one process. Collective calls
 * meet in a rendezvous: the i-th collective create on every rank receives the
 * same shared object, which stands for memory that every rank can load and
 * store (on GPUs: NCCL symmetric windows).
 */
#ifndef COMET_RUNTIME_H
#define COMET_RUNTIME_H

#include <pthread.h>
#include <stdatomic.h>

#include "comet.h"
#include "../plan/plan.h"

typedef struct comet_rendezvous comet_rendezvous_t;

struct comet_world {
    int size;
    comet_backend_t backend;
    int timeout_ms;          /* every wait between ranks or workers; env COMET_TIMEOUT_MS */
    int cpu_workers;         /* compute workers per rank (CPU backend); env COMET_CPU_WORKERS */
    atomic_int aborted;      /* set once any wait timed out: every other wait gives up */
    atomic_int live_layers;  /* layers created and not yet destroyed: the world outlives them */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int64_t *next_seq;       /* [size] collective sequence number of each rank */
    comet_rendezvous_t *pending;
    int local_rank;          /* -1: every rank lives in this process; else the one rank here */
    void *backend_world;     /* the backend's per-world state (CUDA: communicators) */
};

struct comet_layer {
    comet_world_t *world;
    int rank;
    comet_layer_config_t cfg;
    comet_dims_t dims;
    void *backend_state;
};

/* Collective meeting point. Once all size ranks arrived, the last one creates
 * the shared object with its make(arg) and every rank gets it in *shared.
 * key is compared across ranks (e.g. a config): a mismatch fails every rank
 * (and nothing is made). key NULL: this rank failed before the call; it meets
 * the others so that they return COMET_ERR_PEER_FAILED at once and every
 * rank's sequence of collective calls stays in step. */
typedef void *(*comet_make_fn)(void *arg);
comet_status_t comet_world_rendezvous(comet_world_t *w, int rank, const void *key, size_t key_bytes,
                                      comet_make_fn make, void *arg, void **shared);
/* The rendezvous of a rank that failed before a collective call (key NULL);
 * the calling thread's last-error message stays. */
comet_status_t comet_world_rendezvous_failed(comet_world_t *w, int rank);

/* CUDA backend (src/cuda/backend.c), in builds with COMET_WITH_CUDA. */
int comet_cuda_device_count(void);
/* device < 0: a local world (rank r on device r); else w->local_rank's device,
 * joining the others through id (128 bytes). */
comet_status_t comet_cuda_world_init(comet_world_t *w, const void *id, int device);
void comet_cuda_world_destroy(comet_world_t *w);
int comet_cuda_world_device(const comet_world_t *w); /* the local rank's device */
comet_status_t comet_cuda_unique_id(void *id);
comet_status_t comet_cuda_layer_create(comet_layer_t *layer);
void comet_cuda_layer_destroy(comet_layer_t *layer);
comet_status_t comet_cuda_layer_forward(comet_layer_t *layer, const comet_forward_args_t *args);
comet_status_t comet_cuda_layer_sync(comet_layer_t *layer);
void comet_cuda_layer_memory(const comet_layer_t *layer, comet_memory_t *out);
/* The create-time knobs a layer runs with (cuda_layer.h), as comma-separated
 * words into buf: "push", "partials", "ce" (the overlapped mode's
 * copy-engine dispatch), "simt" (the SIMT GEMM fallback instead of the
 * Hopper GEMM), "replay" (the chain replayed as a graph, replay.c: with the
 * Hopper GEMM unless COMET_REPLAY=0); "" if none. */
void comet_cuda_layer_modes(const comet_layer_t *layer, char *buf, size_t len);
/* The protocol of the layer's last forward launched: its n_comm (> 0, the
 * overlapped mode, as the tuner or args chose it and capped) or 0 (the
 * sequential chain). */
int comet_cuda_layer_last_n_comm(const comet_layer_t *layer);
/* Forwards of the layer replayed as one CUDA graph (src/cuda/replay.c) since
 * create, and (if captures is not NULL) the chains captured for them. */
int64_t comet_cuda_layer_replays(const comet_layer_t *layer, int64_t *captures);

/* CPU backend (src/cpu/engine.c). */
comet_status_t comet_cpu_layer_create(comet_layer_t *layer);
void comet_cpu_layer_destroy(comet_layer_t *layer);
comet_status_t comet_cpu_layer_forward(comet_layer_t *layer, const comet_forward_args_t *args);
void comet_cpu_layer_memory(const comet_layer_t *layer, comet_memory_t *out);

#endif /* COMET_RUNTIME_H */
