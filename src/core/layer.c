/*
 * layer.c - the public layer calls: argument checks common to every backend,
 * then dispatch to the backend chosen when the world was created.
 */
#include <stdlib.h>
#include <string.h>

#include "runtime.h"
#include "status.h"
#include "validate.h"
#include "../trace/trace.h"

#ifndef COMET_WITH_CUDA /* worlds refuse the CUDA backend in such builds; these are never reached */
comet_status_t comet_cuda_layer_create(comet_layer_t *l) {
    return comet_fail(COMET_ERR_UNSUPPORTED, "rank %d: no CUDA backend in this build", l->rank);
}
void comet_cuda_layer_destroy(comet_layer_t *l) { (void)l; }
comet_status_t comet_cuda_layer_forward(comet_layer_t *l, const comet_forward_args_t *a) {
    (void)a;
    return comet_fail(COMET_ERR_UNSUPPORTED, "rank %d: no CUDA backend in this build", l->rank);
}
comet_status_t comet_cuda_layer_sync(comet_layer_t *l) { return comet_cuda_layer_forward(l, NULL); }
void comet_cuda_layer_memory(const comet_layer_t *l, comet_memory_t *out) { (void)l, memset(out, 0, sizeof *out); }
void comet_cuda_layer_modes(const comet_layer_t *l, char *buf, size_t len) {
    (void)l;
    if (len) buf[0] = 0;
}
int comet_cuda_layer_last_n_comm(const comet_layer_t *l) {
    (void)l;
    return 0;
}
int64_t comet_cuda_layer_replays(const comet_layer_t *l, int64_t *captures) {
    (void)l;
    if (captures) *captures = 0;
    return 0;
}
comet_status_t comet_cuda_layer_set_trace(comet_layer_t *l, comet_trace_t *t) {
    (void)t;
    return comet_cuda_layer_forward(l, NULL);
}
#endif

/* A rank that fails before its backend's create (its own config, say) still
 * meets its peers at the create's first rendezvous (CPU engine; CUDA local
 * worlds of 2+ ranks: join_ranks), so that they return COMET_ERR_PEER_FAILED
 * at once instead of waiting out the timeout, and the ranks' collective calls
 * stay in step. Ranks in other processes (comet_world_create_nccl) are not
 * told: they meet in NCCL, which this rank does not reach. */
static comet_status_t create_failed(comet_world_t *world, int rank, comet_status_t st) {
    if (world->local_rank < 0 && world->size > 1) comet_world_rendezvous_failed(world, rank);
    return st;
}

comet_status_t comet_layer_create(comet_layer_t **out, comet_world_t *world, int rank,
                                  const comet_layer_config_t *cfg) {
    comet_clear_error();
    if (!out) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "layer is NULL");
    *out = NULL;
    if (!world) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "world is NULL");
    if (rank < 0 || rank >= world->size)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "rank %d is outside [0, %d)", rank, world->size);
    if (world->local_rank >= 0 && rank != world->local_rank)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "rank %d: this process holds rank %d of the world", rank,
                          world->local_rank);
    comet_dims_t dims;
    comet_status_t cst = comet_dims_from_config(cfg, world->size, rank, &dims);
    if (cst != COMET_SUCCESS) return create_failed(world, rank, cst);
    comet_layer_t *l = calloc(1, sizeof *l);
    if (!l) return create_failed(world, rank, comet_fail(COMET_ERR_OUT_OF_MEMORY, "layer: no memory"));
    l->world = world;
    l->rank = rank;
    l->cfg = *cfg;
    l->dims = dims;
    comet_status_t st = l->world->backend == COMET_BACKEND_CUDA ? comet_cuda_layer_create(l) : comet_cpu_layer_create(l);
    if (st != COMET_SUCCESS) {
        free(l);
        return st;
    }
    atomic_fetch_add(&world->live_layers, 1);
    *out = l;
    return COMET_SUCCESS;
}

comet_status_t comet_layer_destroy(comet_layer_t *l) {
    comet_clear_error();
    if (!l) return COMET_SUCCESS;
    if (l->world->backend == COMET_BACKEND_CUDA)
        comet_cuda_layer_destroy(l);
    else
        comet_cpu_layer_destroy(l);
    atomic_fetch_sub(&l->world->live_layers, 1);
    free(l);
    return COMET_SUCCESS;
}

comet_status_t comet_layer_forward(comet_layer_t *l, const comet_forward_args_t *args) {
    comet_clear_error();
    if (!l) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "layer is NULL");
    if (l->world->backend == COMET_BACKEND_CUDA) return comet_cuda_layer_forward(l, args);
    return comet_cpu_layer_forward(l, args);
}

comet_status_t comet_layer_memory(const comet_layer_t *l, comet_memory_t *out) {
    comet_clear_error();
    if (!l || !out) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "layer or out is NULL");
    if (l->world->backend == COMET_BACKEND_CUDA)
        comet_cuda_layer_memory(l, out);
    else
        comet_cpu_layer_memory(l, out);
    return COMET_SUCCESS;
}

comet_status_t comet_layer_sync(comet_layer_t *l) {
    comet_clear_error();
    if (!l) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "layer is NULL");
    if (l->world->backend == COMET_BACKEND_CUDA) return comet_cuda_layer_sync(l);
    return COMET_SUCCESS; /* the CPU backend reports everything synchronously */
}
