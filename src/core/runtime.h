/*
 * runtime.h - the objects behind the public handles (comet_world_t,
 * comet_layer_t) and the operations table a backend implements
 * (src/cpu/engine.c, src/cuda/backend.c; src/api picks one per world). Not
 * part of the public API.
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
#include "options.h"
#include "../plan/plan.h"

typedef struct comet_rendezvous comet_rendezvous_t;
typedef struct comet_backend_ops comet_backend_ops_t;
typedef struct comet_tune_table comet_tune_table_t; /* src/tuner/tuner.h */

struct comet_world {
    int size;
    comet_backend_t backend;
    const comet_backend_ops_t *ops;
    comet_settings_t settings;  /* options and environment, resolved at create (options.h) */
    comet_tune_table_t *tune;   /* the tuner's table, read from settings.tune_file at create */
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
    comet_layer_knobs_t knobs;   /* measurement knobs, read at create (options.h) */
    comet_protocol_t protocol;   /* of the last forward (set by the backend's forward) */
    uint64_t id;                 /* unique in the process: saved state names the layer that wrote it */
    int has_run;                 /* a forward or backward was launched */
    int64_t replays, captures;   /* CUDA: forwards replayed as one graph, chains captured (src/cuda/replay.c) */
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
/* The rendezvous' part of a world: set up and torn down with it (rendezvous.c). */
void comet_rendezvous_init(comet_world_t *w);
void comet_rendezvous_destroy(comet_world_t *w);

/* What a backend implements. A world holds its backend's table; the public
 * calls (src/api) check their arguments and call through it. The layer_*
 * entries are required, except layer_sync; the others may be NULL where the
 * backend has nothing to do (a CPU world has no device, no NCCL id). */
struct comet_backend_ops {
    const char *name;
    int (*device_count)(void);
    /* a world's backend state: device < 0 a local world (rank r on device r),
     * else w->local_rank's device, joining the others through id (128 bytes) */
    comet_status_t (*world_init)(comet_world_t *w, const void *id, int device);
    void (*world_destroy)(comet_world_t *w);
    int (*world_device)(const comet_world_t *w); /* the local rank's device */
    comet_status_t (*unique_id)(void *id);       /* 128 bytes */
    comet_status_t (*layer_create)(comet_layer_t *layer);
    /* a rank that failed before layer_create (its own config, say) meets its
     * peers where layer_create would first meet them, so that they fail at
     * once (COMET_ERR_PEER_FAILED) and every rank stays in step; keeps the
     * calling thread's last-error message */
    void (*layer_create_failed)(comet_world_t *world, int rank);
    void (*layer_destroy)(comet_layer_t *layer);
    /* forward and backward set layer->protocol (and has_run) when they launch */
    comet_status_t (*layer_forward)(comet_layer_t *layer, const comet_forward_args_t *args);
    /* NULL: the backend has no backward (COMET_ERR_UNSUPPORTED) */
    comet_status_t (*layer_backward)(comet_layer_t *layer, const comet_backward_args_t *args);
    comet_status_t (*layer_sync)(comet_layer_t *layer);
    void (*layer_memory)(const comet_layer_t *layer, comet_memory_t *out);
    comet_status_t (*layer_set_trace)(comet_layer_t *layer, comet_trace_t *trace);
};

/* The backends (src/cpu/engine.c; src/cuda/backend.c in builds with CUDA). */
extern const comet_backend_ops_t comet_cpu_ops;
extern const comet_backend_ops_t comet_cuda_ops;

#endif /* COMET_RUNTIME_H */
