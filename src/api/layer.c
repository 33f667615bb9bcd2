/*
 * layer.c - the public layer calls: argument checks common to every backend,
 * then the world's backend (runtime.h's operations table).
 */
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "../core/saved.h"
#include "../core/status.h"
#include "../core/validate.h"

/* A rank that fails before its backend's create (its own config, say) still
 * meets its peers where that create would first meet them, so that they
 * return COMET_ERR_PEER_FAILED at once instead of waiting out the timeout,
 * and the ranks' collective calls stay in step. */
static comet_status_t create_failed(comet_world_t *world, int rank, comet_status_t st) {
    world->ops->layer_create_failed(world, rank);
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
    const comet_status_t cst = comet_dims_from_config(cfg, world->size, rank, &dims);
    if (cst != COMET_SUCCESS) return create_failed(world, rank, cst);
    comet_layer_t *l = calloc(1, sizeof *l);
    if (!l) return create_failed(world, rank, comet_fail(COMET_ERR_OUT_OF_MEMORY, "layer: no memory"));
    l->world = world;
    l->rank = rank;
    l->cfg = *cfg;
    l->dims = dims;
    static atomic_uint_fast64_t next_id = 1;
    l->id = atomic_fetch_add(&next_id, 1);
    comet_layer_knobs_read(&l->knobs);
    const comet_protocol_t none = COMET_PROTOCOL_INIT;
    l->protocol = none;
    comet_status_t st = world->ops->layer_create(l);
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
    l->world->ops->layer_destroy(l);
    atomic_fetch_sub(&l->world->live_layers, 1);
    free(l);
    return COMET_SUCCESS;
}

comet_status_t comet_layer_forward(comet_layer_t *l, const comet_forward_args_t *args) {
    comet_clear_error();
    if (!l) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "layer is NULL");
    return l->world->ops->layer_forward(l, args);
}

comet_status_t comet_layer_backward(comet_layer_t *l, const comet_backward_args_t *args) {
    comet_clear_error();
    if (!l) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "layer is NULL");
    if (!l->world->ops->layer_backward)
        return comet_fail(COMET_ERR_UNSUPPORTED, "rank %d: the %s backend has no backward yet", l->rank,
                          l->world->ops->name);
    return l->world->ops->layer_backward(l, args);
}

comet_status_t comet_layer_saved_bytes(const comet_layer_t *l, int save, size_t *bytes) {
    comet_clear_error();
    if (!l || !bytes) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "layer or bytes is NULL");
    COMET_TRY(comet_check_save_mode(save, "save"));
    *bytes = comet_saved_bytes(&l->dims, save);
    return COMET_SUCCESS;
}

comet_status_t comet_layer_memory(const comet_layer_t *l, comet_memory_t *out) {
    comet_clear_error();
    if (!l || !out) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "layer or out is NULL");
    l->world->ops->layer_memory(l, out);
    return COMET_SUCCESS;
}

comet_status_t comet_layer_sync(comet_layer_t *l) {
    comet_clear_error();
    if (!l) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "layer is NULL");
    return l->world->ops->layer_sync ? l->world->ops->layer_sync(l) : COMET_SUCCESS;
}

comet_status_t comet_layer_set_trace(comet_layer_t *l, comet_trace_t *trace) {
    comet_clear_error();
    if (!l) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "layer is NULL");
    return l->world->ops->layer_set_trace(l, trace);
}

comet_status_t comet_layer_last_protocol(const comet_layer_t *l, comet_protocol_t *out) {
    comet_clear_error();
    if (!l || !out) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "layer or out is NULL");
    COMET_TRY(comet_check_struct_size(out->struct_size, sizeof(comet_protocol_t), "out", "COMET_PROTOCOL_INIT"));
    if (!l->has_run) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "rank %d: the layer has run no forward or backward yet", l->rank);
    *out = l->protocol;
    return COMET_SUCCESS;
}
