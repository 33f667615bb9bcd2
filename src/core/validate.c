/*
 * validate.c - checks of configs, tensors and routing (see validate.h).
 */
#include "validate.h"

#include <stdio.h>
#include <string.h>

#include "saved.h"
#include "status.h"

#define COMET_DEFAULT_TILE_M 128

static const char *dtype_name(comet_dtype_t t) {
    switch (t) {
    case COMET_DTYPE_BF16: return "bf16";
    case COMET_DTYPE_FP16: return "fp16";
    case COMET_DTYPE_FP32: return "fp32";
    case COMET_DTYPE_INT32: return "int32";
    case COMET_DTYPE_UINT8: return "uint8";
    }
    return "unknown-dtype";
}

/* a * b * c * d (operands >= 0), saturated just past COMET_MAX_BYTES. */
static int64_t capped_product(int64_t a, int64_t b, int64_t c, int64_t d) {
    int64_t r;
    if (__builtin_mul_overflow(a, b, &r) || __builtin_mul_overflow(r, c, &r) || __builtin_mul_overflow(r, d, &r) ||
        r > COMET_MAX_BYTES)
        return COMET_MAX_BYTES + 1;
    return r;
}

/* Before the dims are derived: fields the plan and kernels hold in int32
 * (token and row indices, expert ids in topk_idx), so that every product
 * comet_dims_from_config forms is exact. */
static comet_status_t check_extents(const comet_layer_config_t *cfg) {
    const struct {
        const char *name;
        int64_t value;
    } fields[] = {{"hidden", cfg->hidden},
                  {"ffn", cfg->ffn},
                  {"num_experts", cfg->num_experts},
                  {"max_tokens_per_rank", cfg->max_tokens_per_rank}};
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        if (fields[i].value > INT32_MAX)
            return comet_fail(COMET_ERR_INVALID_ARGUMENT, "config.%s %lld is above 2^31-1", fields[i].name,
                              (long long)fields[i].value);
    const int64_t w = (int64_t)cfg->tp * cfg->ep, el = cfg->num_experts / cfg->ep;
    const int64_t tm = cfg->tile_m ? cfg->tile_m : COMET_DEFAULT_TILE_M;
    if (capped_product(w, cfg->max_tokens_per_rank, cfg->topk, 1) > INT32_MAX)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT,
                          "config too large: %lld ranks x config.max_tokens_per_rank %lld x config.topk %lld routing "
                          "slots do not fit the plan's int32 indices",
                          (long long)w, (long long)cfg->max_tokens_per_rank, (long long)cfg->topk);
    if (el * (tm - 1) > INT32_MAX)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT,
                          "config.tile_m %lld: %lld experts a rank padded to it do not fit the plan's int32 rows",
                          (long long)tm, (long long)el);
    return COMET_SUCCESS;
}

/* After: every byte count a backend sizes from the dims (CPU engine, CUDA
 * symmetric and private buffers, plan workspace, a rank's weights) is at most
 * COMET_MAX_BYTES, so none of their sums overflows int64 or size_t. */
static comet_status_t check_bytes(const comet_dims_t *x) {
    const int64_t w = x->world_size, t = x->max_tokens, h = x->hidden, rows = x->max_rows_padded;
    const struct {
        const char *what;
        int64_t bytes;
    } need[] = {
        {"ranks x config.max_tokens_per_rank x config.hidden (staged tokens, fp32 partials)", capped_product(w, t, h, 4)},
        {"config.tp x config.max_tokens_per_rank x config.topk x config.hidden (rows sent home)",
         capped_product(x->tp * t, x->topk, h, 2)},
        {"config.hidden x the rows a rank receives (ranks x config.max_tokens_per_rank x config.topk)",
         capped_product(rows, h, 2, 1)},
        {"config.ffn / config.tp x the rows a rank receives (ranks x config.max_tokens_per_rank x config.topk)",
         capped_product(rows, x->ffn_local, 2, 1)},
        {"config.num_experts / config.ep x config.ffn / config.tp x config.hidden (a rank's weights)",
         capped_product(x->experts_local, x->w1_rows, h, 2)},
        {"ranks x config.max_tokens_per_rank x config.num_experts / config.ep (the plan's count tables)",
         capped_product(w, t, x->experts_local + 1, 4)},
    };
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++)
        if (need[i].bytes > COMET_MAX_BYTES)
            return comet_fail(COMET_ERR_INVALID_ARGUMENT, "config too large: %s needs more than 2^48 bytes", need[i].what);
    return COMET_SUCCESS;
}

comet_status_t comet_check_struct_size(uint32_t struct_size, size_t expected, const char *what, const char *init) {
    if (struct_size == expected) return COMET_SUCCESS;
    return comet_fail(COMET_ERR_INVALID_ARGUMENT, "%s.struct_size is %u, expected %zu: initialize it with %s", what,
                      struct_size, expected, init);
}

comet_status_t comet_dims_from_config(const comet_layer_config_t *cfg, int world_size, int rank,
                                      comet_dims_t *d) {
    if (!cfg) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "config is NULL");
    COMET_TRY(comet_check_struct_size(cfg->struct_size, sizeof(comet_layer_config_t), "config", "COMET_LAYER_CONFIG_INIT"));
    if (cfg->hidden < 1) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "config.hidden %lld < 1", (long long)cfg->hidden);
    if (cfg->ffn < 1) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "config.ffn %lld < 1", (long long)cfg->ffn);
    if (cfg->num_experts < 1)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "config.num_experts %lld < 1", (long long)cfg->num_experts);
    if (cfg->topk < 1 || cfg->topk > cfg->num_experts)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "config.topk %lld is outside [1, num_experts=%lld]",
                          (long long)cfg->topk, (long long)cfg->num_experts);
    if (cfg->activation != COMET_ACT_SILU_GATED && cfg->activation != COMET_ACT_GELU)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "config.activation %d is not a comet_activation_t",
                          (int)cfg->activation);
    if (cfg->dtype != COMET_DTYPE_BF16)
        return comet_fail(COMET_ERR_UNSUPPORTED, "config.dtype %s: only bf16 is supported",
                          dtype_name(cfg->dtype));
    if (cfg->tp < 1 || cfg->ep < 1)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "config.tp=%d and config.ep=%d must be >= 1", cfg->tp, cfg->ep);
    if ((int64_t)cfg->tp * cfg->ep > COMET_MAX_RANKS)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "tp*ep = %lld exceeds %d ranks",
                          (long long)cfg->tp * cfg->ep, COMET_MAX_RANKS);
    if (world_size > 0 && cfg->tp * cfg->ep != world_size)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "config.tp*config.ep = %d*%d = %d but the world has %d ranks",
                          cfg->tp, cfg->ep, cfg->tp * cfg->ep, world_size);
    if (cfg->num_experts % cfg->ep != 0)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "config.num_experts %lld is not divisible by config.ep %d",
                          (long long)cfg->num_experts, cfg->ep);
    if (cfg->ffn % cfg->tp != 0)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "config.ffn %lld is not divisible by config.tp %d",
                          (long long)cfg->ffn, cfg->tp);
    if (cfg->max_tokens_per_rank < 1)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "config.max_tokens_per_rank %lld < 1",
                          (long long)cfg->max_tokens_per_rank);
    if (cfg->tile_m < 0) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "config.tile_m %d < 0", cfg->tile_m);

    COMET_TRY(check_extents(cfg));

    int w = cfg->tp * cfg->ep;
    if (rank < 0 || rank >= w)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "rank %d is outside [0, %d)", rank, w);

    comet_dims_t x;
    memset(&x, 0, sizeof x);
    x.world_size = w;
    x.rank = rank;
    x.tp = cfg->tp;
    x.ep = cfg->ep;
    x.tp_rank = rank % cfg->tp;
    x.ep_rank = rank / cfg->tp;
    x.hidden = cfg->hidden;
    x.ffn_local = cfg->ffn / cfg->tp;
    x.num_experts = cfg->num_experts;
    x.experts_local = cfg->num_experts / cfg->ep;
    x.topk = cfg->topk;
    x.w1_rows = cfg->activation == COMET_ACT_SILU_GATED ? 2 * x.ffn_local : x.ffn_local;
    x.max_tokens = cfg->max_tokens_per_rank;
    x.tile_m = cfg->tile_m ? cfg->tile_m : COMET_DEFAULT_TILE_M;
    x.max_rows = (int64_t)w * x.max_tokens * (x.topk < x.experts_local ? x.topk : x.experts_local);
    x.max_rows_padded = x.max_rows + x.experts_local * (x.tile_m - 1);
    x.max_blocks = x.max_rows / x.tile_m + x.experts_local;
    x.activation = cfg->activation;
    /* Plans index rows, slots and tokens with int32. */
    if (x.max_rows_padded > INT32_MAX || (int64_t)w * x.max_tokens * x.topk > INT32_MAX)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT,
                          "config too large: %lld rows per rank do not fit the plan's int32 indices",
                          (long long)x.max_rows_padded);
    COMET_TRY(check_bytes(&x));
    if (d) *d = x;
    return COMET_SUCCESS;
}

/* Check one tensor: data present (unless empty), dtype and exact shape. */
static comet_status_t check_tensor(const comet_tensor_t *t, const char *name, comet_dtype_t dtype,
                                   int ndim, const int64_t *shape) {
    char want[128], got[128];
    int64_t numel = 1;
    for (int i = 0; i < ndim; i++) numel *= shape[i];
    int ok = t->dtype == dtype && t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == shape[i];
    if (!ok) {
        int n = snprintf(want, sizeof want, "%s (", dtype_name(dtype));
        for (int i = 0; i < ndim; i++)
            n += snprintf(want + n, sizeof want - (size_t)n, "%s%lld", i ? ", " : "", (long long)shape[i]);
        snprintf(want + n, sizeof want - (size_t)n, ")");
        if (t->ndim < 1 || t->ndim > COMET_MAX_DIMS) {
            snprintf(got, sizeof got, "%s with ndim %d", dtype_name(t->dtype), t->ndim);
        } else {
            n = snprintf(got, sizeof got, "%s (", dtype_name(t->dtype));
            for (int i = 0; i < t->ndim; i++)
                n += snprintf(got + n, sizeof got - (size_t)n, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
            snprintf(got + n, sizeof got - (size_t)n, ")");
        }
        return comet_fail(COMET_ERR_INVALID_SHAPE, "%s: expected %s, got %s", name, want, got);
    }
    if (!t->data && numel > 0) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "%s.data is NULL", name);
    return COMET_SUCCESS;
}

comet_status_t comet_check_save_mode(int save, const char *what) {
    if (save != COMET_SAVE_NONE && save != COMET_SAVE_ACTIVATIONS && save != COMET_SAVE_RECOMPUTE)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT,
                          "%s %d is not COMET_SAVE_NONE, COMET_SAVE_ACTIVATIONS or COMET_SAVE_RECOMPUTE", what, save);
    return COMET_SUCCESS;
}

comet_status_t comet_check_saved(const comet_dims_t *d, int save, const comet_tensor_t *saved) {
    COMET_TRY(comet_check_save_mode(save, "args.save"));
    if (save != COMET_SAVE_ACTIVATIONS) return COMET_SUCCESS;
    const size_t need = comet_saved_bytes(d, save);
    if (saved->dtype != COMET_DTYPE_UINT8 || saved->ndim != 1)
        return comet_fail(COMET_ERR_INVALID_SHAPE, "saved: expected a 1-d uint8 tensor of >= %zu bytes", need);
    if (saved->shape[0] < 0 || (uint64_t)saved->shape[0] < need)
        return comet_fail(COMET_ERR_INVALID_SHAPE,
                          "saved: %lld bytes, the layer saves %zu (comet_layer_saved_bytes)",
                          (long long)saved->shape[0], need);
    if (!saved->data) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "saved.data is NULL");
    if ((uintptr_t)saved->data % 16)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "saved.data %p is not 16-byte aligned", saved->data);
    return COMET_SUCCESS;
}

comet_status_t comet_check_forward_args(const comet_dims_t *d, const comet_forward_args_t *a,
                                        int check_routing, int64_t *num_tokens) {
    if (!a) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "forward args are NULL");
    COMET_TRY(comet_check_struct_size(a->struct_size, sizeof(comet_forward_args_t), "args", "COMET_FORWARD_ARGS_INIT"));
    if (a->n_comm < COMET_SEQUENTIAL)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "args.n_comm %d < %d (COMET_SEQUENTIAL)", a->n_comm,
                          COMET_SEQUENTIAL);
    if (a->disable & ~(COMET_DISABLE_COMM | COMET_DISABLE_GEMM))
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "args.disable %#x has unknown bits", (unsigned)a->disable);
    if (a->chunk_cols < 0 || a->chunk_cols > d->hidden)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "args.chunk_cols %d is outside [0, hidden=%lld]",
                          a->chunk_cols, (long long)d->hidden);
    COMET_TRY(comet_check_saved(d, a->save, &a->saved));
    if (a->x.ndim != 2 || a->x.dtype != COMET_DTYPE_BF16)
        return comet_fail(COMET_ERR_INVALID_SHAPE, "x: expected a 2-d bf16 tensor (T, hidden=%lld)",
                          (long long)d->hidden);
    const int64_t t = a->x.shape[0];
    if (t < 0 || t > d->max_tokens)
        return comet_fail(COMET_ERR_INVALID_SHAPE, "x: %lld tokens, outside [0, max_tokens_per_rank=%lld]",
                          (long long)t, (long long)d->max_tokens);
    const int64_t sx[2] = {t, d->hidden}, sk[2] = {t, d->topk};
    const int64_t s1[3] = {d->experts_local, d->w1_rows, d->hidden};
    const int64_t s2[3] = {d->experts_local, d->hidden, d->ffn_local};
    COMET_TRY(check_tensor(&a->x, "x", COMET_DTYPE_BF16, 2, sx));
    COMET_TRY(check_tensor(&a->topk_idx, "topk_idx", COMET_DTYPE_INT32, 2, sk));
    COMET_TRY(check_tensor(&a->topk_w, "topk_w", COMET_DTYPE_FP32, 2, sk));
    COMET_TRY(check_tensor(&a->w1, "w1", COMET_DTYPE_BF16, 3, s1));
    COMET_TRY(check_tensor(&a->w2, "w2", COMET_DTYPE_BF16, 3, s2));
    COMET_TRY(check_tensor(&a->y, "y", COMET_DTYPE_BF16, 2, sx));

    const int32_t *idx = (const int32_t *)a->topk_idx.data;
    for (int64_t i = 0; check_routing && i < t; i++) {
        for (int64_t j = 0; j < d->topk; j++) {
            int32_t e = idx[i * d->topk + j];
            if (e < 0 || e >= d->num_experts)
                return comet_fail(COMET_ERR_INVALID_ROUTING,
                                  "topk_idx[%lld, %lld] = %d is outside [0, num_experts=%lld)",
                                  (long long)i, (long long)j, (int)e, (long long)d->num_experts);
            for (int64_t k = 0; k < j; k++)
                if (idx[i * d->topk + k] == e)
                    return comet_fail(COMET_ERR_INVALID_ROUTING,
                                      "topk_idx[%lld] repeats expert %d (slots %lld and %lld)",
                                      (long long)i, (int)e, (long long)k, (long long)j);
        }
    }
    *num_tokens = t;
    return COMET_SUCCESS;
}

/* A weight gradient: the weight's shape, bf16 or fp32 (fp32 when accumulating). */
static comet_status_t check_weight_grad(const comet_tensor_t *t, const char *name, int accumulate,
                                        const int64_t shape[3]) {
    const comet_dtype_t dtype = t->dtype == COMET_DTYPE_BF16 && !accumulate ? COMET_DTYPE_BF16 : COMET_DTYPE_FP32;
    if (accumulate && t->dtype != COMET_DTYPE_FP32)
        return comet_fail(COMET_ERR_INVALID_SHAPE, "%s: accumulating needs fp32, got %s", name, dtype_name(t->dtype));
    return check_tensor(t, name, dtype, 3, shape);
}

comet_status_t comet_check_backward_args(const comet_dims_t *d, const comet_backward_args_t *a, int check_routing,
                                         int64_t *num_tokens) {
    if (!a) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "backward args are NULL");
    COMET_TRY(comet_check_struct_size(a->struct_size, sizeof(comet_backward_args_t), "args", "COMET_BACKWARD_ARGS_INIT"));
    if (a->accumulate != 0 && a->accumulate != 1)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "args.accumulate %d is not 0 or 1", a->accumulate);
    if (a->n_comm < COMET_SEQUENTIAL)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "args.n_comm %d < %d (COMET_SEQUENTIAL)", a->n_comm,
                          COMET_SEQUENTIAL);
    if (a->disable & ~(COMET_DISABLE_COMM | COMET_DISABLE_GEMM))
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "args.disable %#x has unknown bits", (unsigned)a->disable);
    COMET_TRY(comet_check_saved(d, a->save, &a->saved));
    /* the forward's inputs, with dx where the forward has y */
    comet_forward_args_t f = COMET_FORWARD_ARGS_INIT;
    f.x = a->x, f.topk_idx = a->topk_idx, f.topk_w = a->topk_w, f.w1 = a->w1, f.w2 = a->w2, f.y = a->dx;
    int64_t t = 0;
    comet_status_t st = comet_check_forward_args(d, &f, check_routing, &t);
    if (st == COMET_ERR_INVALID_SHAPE && strncmp(comet_last_error(), "y:", 2) == 0) { /* named as the caller did */
        char msg[512];
        snprintf(msg, sizeof msg, "dx%s", comet_last_error() + 1);
        return comet_fail_copy(COMET_ERR_INVALID_SHAPE, msg);
    }
    COMET_TRY(st);
    const int64_t sx[2] = {t, d->hidden}, sk[2] = {t, d->topk};
    const int64_t s1[3] = {d->experts_local, d->w1_rows, d->hidden};
    const int64_t s2[3] = {d->experts_local, d->hidden, d->ffn_local};
    COMET_TRY(check_tensor(&a->dy, "dy", COMET_DTYPE_BF16, 2, sx));
    COMET_TRY(check_tensor(&a->d_topk_w, "d_topk_w", COMET_DTYPE_FP32, 2, sk));
    COMET_TRY(check_weight_grad(&a->dw1, "dw1", a->accumulate, s1));
    COMET_TRY(check_weight_grad(&a->dw2, "dw2", a->accumulate, s2));
    *num_tokens = t;
    return COMET_SUCCESS;
}

comet_tensor_t comet_tensor_2d(void *data, comet_dtype_t dtype, int64_t d0, int64_t d1) {
    comet_tensor_t t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dtype;
    t.ndim = 2;
    t.shape[0] = d0;
    t.shape[1] = d1;
    return t;
}

comet_tensor_t comet_tensor_3d(void *data, comet_dtype_t dtype, int64_t d0, int64_t d1, int64_t d2) {
    comet_tensor_t t = comet_tensor_2d(data, dtype, d0, d1);
    t.ndim = 3;
    t.shape[2] = d2;
    return t;
}

comet_status_t comet_layer_config_check(const comet_layer_config_t *cfg, int world_size) {
    comet_clear_error();
    if (world_size < 0)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "world_size %d < 0", world_size);
    return comet_dims_from_config(cfg, world_size, 0, NULL);
}
