/*
 * world.c - the public world calls: groups of ranks, their options, and the
 * backend each world runs on.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api.h"
#include "../core/status.h"
#include "../core/validate.h"
#include "../tuner/tuner.h"

/* The body of the constructors: local worlds (local_rank < 0) and one rank
 * of a world spread over processes (local_rank >= 0, CUDA only). */
static comet_status_t world_create(comet_world_t **world, int num_ranks, comet_backend_t backend, int local_rank,
                                   const comet_unique_id_t *id, int device, const comet_world_options_t *options) {
    if (num_ranks < 1 || num_ranks > COMET_MAX_RANKS)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "num_ranks %d is outside [1, %d]", num_ranks, COMET_MAX_RANKS);
    if (backend != COMET_BACKEND_CPU && backend != COMET_BACKEND_CUDA)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "backend %d is not a comet_backend_t", (int)backend);
    const comet_backend_ops_t *ops = comet_backend_ops(backend);
    if (!ops)
        return comet_fail(COMET_ERR_UNSUPPORTED, "this build has no CUDA backend (built without nvcc); use COMET_BACKEND_CPU");
    comet_settings_t settings;
    COMET_TRY(comet_settings_resolve(options, &settings));
    comet_world_t *w = calloc(1, sizeof *w);
    int64_t *seq = calloc((size_t)num_ranks, sizeof *seq);
    if (!w || !seq) {
        free(w), free(seq);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "world: no memory");
    }
    w->size = num_ranks;
    w->backend = backend;
    w->ops = ops;
    w->settings = settings;
    w->next_seq = seq;
    w->local_rank = local_rank;
    atomic_init(&w->aborted, 0);
    atomic_init(&w->live_layers, 0);
    /* a file that does not exist (yet) is an empty table; one that is not a table is an error */
    const int entries = comet_tune_table_load(settings.tune_file, &w->tune);
    comet_status_t st = w->tune ? COMET_SUCCESS : comet_fail(COMET_ERR_OUT_OF_MEMORY, "world: no memory");
    if (st == COMET_SUCCESS && entries < 0 && access(settings.tune_file, F_OK) == 0)
        st = comet_fail(COMET_ERR_INVALID_ARGUMENT,
                        "the tune file %s (options.tune_file or COMET_TUNE_FILE) is not a table: not a readable "
                        "regular file, or over 1 MiB", settings.tune_file);
    if (st == COMET_SUCCESS && ops->world_init) st = ops->world_init(w, id ? id->bytes : NULL, local_rank >= 0 ? device : -1);
    if (st != COMET_SUCCESS) {
        comet_tune_table_free(w->tune);
        free(w->next_seq);
        free(w);
        return st;
    }
    comet_rendezvous_init(w);
    *world = w;
    return COMET_SUCCESS;
}

comet_status_t comet_world_create_local_opts(comet_world_t **world, int num_ranks, comet_backend_t backend,
                                             const comet_world_options_t *options) {
    comet_clear_error();
    if (!world) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "world is NULL");
    *world = NULL;
    return world_create(world, num_ranks, backend, -1, NULL, -1, options);
}

comet_status_t comet_world_create_local(comet_world_t **world, int num_ranks, comet_backend_t backend) {
    return comet_world_create_local_opts(world, num_ranks, backend, NULL);
}

comet_status_t comet_world_create_nccl_opts(comet_world_t **world, int rank, int world_size,
                                            const comet_unique_id_t *id, int device,
                                            const comet_world_options_t *options) {
    comet_clear_error();
    if (!world) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "world is NULL");
    *world = NULL;
    if (!id) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "id is NULL");
    if (world_size < 1 || rank < 0 || rank >= world_size)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "rank %d of world_size %d is not a rank", rank, world_size);
    if (device < 0) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "device %d < 0", device);
    return world_create(world, world_size, COMET_BACKEND_CUDA, rank, id, device, options);
}

comet_status_t comet_world_create_nccl(comet_world_t **world, int rank, int world_size, const comet_unique_id_t *id,
                                       int device) {
    return comet_world_create_nccl_opts(world, rank, world_size, id, device, NULL);
}

comet_status_t comet_world_get_options(const comet_world_t *w, comet_world_options_t *out) {
    comet_clear_error();
    if (!w || !out) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "world or out is NULL");
    COMET_TRY(comet_check_struct_size(out->struct_size, sizeof(comet_world_options_t), "out", "COMET_WORLD_OPTIONS_INIT"));
    const comet_world_options_t o = {sizeof(comet_world_options_t), w->settings.timeout_ms, w->settings.cpu_workers,
                                     w->settings.tune_file, w->settings.graph_replay ? 1 : -1};
    *out = o;
    return COMET_SUCCESS;
}

comet_status_t comet_get_unique_id(comet_unique_id_t *id) {
    comet_clear_error();
    if (!id) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "id is NULL");
    const comet_backend_ops_t *ops = comet_backend_ops(COMET_BACKEND_CUDA);
    if (!ops) return comet_fail(COMET_ERR_UNSUPPORTED, "this build has no CUDA backend (built without nvcc)");
    return ops->unique_id(id->bytes);
}

comet_status_t comet_world_destroy(comet_world_t *w) {
    comet_clear_error();
    if (!w) return COMET_SUCCESS;
    if (w->pending && !atomic_load(&w->aborted))
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "world still has a collective call in progress");
    const int live = atomic_load(&w->live_layers);
    if (live > 0)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "world still has %d layer%s: destroy them first", live,
                          live == 1 ? "" : "s");
    if (w->ops->world_destroy) w->ops->world_destroy(w);
    comet_rendezvous_destroy(w);
    comet_tune_table_free(w->tune);
    free(w->next_seq);
    free(w);
    return COMET_SUCCESS;
}

int comet_world_size(const comet_world_t *w) { return w ? w->size : 0; }

comet_backend_t comet_world_backend(const comet_world_t *w) { return w ? w->backend : COMET_BACKEND_CPU; }

int comet_world_local_rank(const comet_world_t *w) { return w ? w->local_rank : -1; }

int comet_world_device(const comet_world_t *w, int rank) {
    if (!w || !w->ops->world_device || rank < 0 || rank >= w->size) return -1;
    if (w->local_rank < 0) return rank;
    return rank == w->local_rank ? w->ops->world_device(w) : -1;
}

int comet_device_count(void) {
    const comet_backend_ops_t *ops = comet_backend_ops(COMET_BACKEND_CUDA);
    return ops ? ops->device_count() : 0;
}
