/*
 * validate.h - every check of caller input, in one place, shared by all
 * backends and the reference: configs, tensors and routing. Each check either
 * passes or returns a status with a message naming the field and the values;
 * none writes anything but the dims it is asked to fill.
 */
#ifndef COMET_VALIDATE_H
#define COMET_VALIDATE_H

#include "comet.h"
#include "../plan/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest world size the runtime accepts. */
#define COMET_MAX_RANKS 1024

/* Most communication workers (args.n_comm, tuner table) a rank of the CPU
 * engine starts. */
#define COMET_CPU_MAX_N_COMM 64

/* Most bytes any one buffer a backend sizes from a config may take (256 TiB):
 * configs past it are refused, so no size computed from the dims overflows. */
#define COMET_MAX_BYTES ((int64_t)1 << 48)

/* The struct_size of a versioned struct the caller passed (what: its name
 * in the message; init: the initializer that sets it). */
comet_status_t comet_check_struct_size(uint32_t struct_size, size_t expected, const char *what, const char *init);

/* Check cfg for a world of world_size ranks (0: skip the TP*EP check) and, if
 * dims is not NULL, fill it for rank. hidden, ffn, num_experts and
 * max_tokens_per_rank must fit int32, and every buffer COMET_MAX_BYTES. */
comet_status_t comet_dims_from_config(const comet_layer_config_t *cfg, int world_size, int rank,
                                      comet_dims_t *dims);

/* Check one rank's forward arguments against its dims: tensors present, of the
 * right dtype and shape, T <= max_tokens and, when check_routing is set (host
 * memory), expert ids in [0, E) and distinct per row. The CUDA backend checks
 * the routing on the device instead. On success *num_tokens = T. */
comet_status_t comet_check_forward_args(const comet_dims_t *d, const comet_forward_args_t *args,
                                        int check_routing, int64_t *num_tokens);

/* save is a comet_save_t (what: its name in the message). */
comet_status_t comet_check_save_mode(int save, const char *what);

/* A training call's save mode (comet_save_t) and, for
 * COMET_SAVE_ACTIVATIONS, its saved tensor: 1-d uint8 of at least
 * comet_saved_bytes (src/core/saved.h). */
comet_status_t comet_check_saved(const comet_dims_t *d, int save, const comet_tensor_t *saved);

/* The same for one rank's backward arguments: the forward's inputs, dy and
 * dx (T, H) bf16, d_topk_w (T, topk) fp32, dw1 and dw2 of the weights'
 * shapes in bf16 or fp32 (fp32 when accumulating). */
comet_status_t comet_check_backward_args(const comet_dims_t *d, const comet_backward_args_t *args,
                                         int check_routing, int64_t *num_tokens);

#ifdef __cplusplus
}
#endif

#endif /* COMET_VALIDATE_H */
