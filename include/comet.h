/*
 * comet.h - the public C API of comet: Mixture-of-Experts layers across GPUs
 * with fine-grained computation-communication overlap.
 *
 * This header is the whole public API and its documentation. What is not
 * declared here is private. C99, usable from C++ (extern "C").
 *
 * Vocabulary
 *   W        number of ranks in a world, W = TP x EP.
 *   rank     0..W-1; rank = ep * TP + tp (TP is the inner index).
 *   T        tokens held by one rank in one forward call (may differ per rank),
 *            T <= max_tokens_per_rank.
 *   E        num_experts (global); E_local = E / EP experts per rank.
 *   F        ffn (per expert, unsliced); F_local = F / TP.
 *   H        hidden.
 *
 * Semantics of one forward call (the contract every backend meets)
 *   Rank (ep, tp) holds experts [ep*E_local, (ep+1)*E_local) and, of each, the
 *   tp-th slice of the ffn dimension. For each token t of each rank:
 *
 *     y[t] = sum_j topk_w[t,j] * FFN_{topk_idx[t,j]}(x[t])
 *     FFN_e(x) = act(x W1_e^T) W2_e^T
 *
 *   with these rounding points, which are part of the contract:
 *     1. GEMM0 (x W1^T) accumulates in fp32; the activation is computed in fp32
 *        and its output h stored in bf16 (the layer's input dtype).
 *     2. GEMM1 (h W2^T) accumulates in fp32; its output o is stored in bf16.
 *     3. On each rank r, the partial p_r[t] = sum over the slots j of token t
 *        whose expert lives on r, in ascending j, of topk_w[t,j] * o_j, in fp32
 *        (acc = fmaf(w, o, acc), starting from 0).
 *     4. On the token's home rank, y[t] = sum over the ranks r that hold at least
 *        one of t's experts, in ascending r, of p_r[t], in fp32, then stored in
 *        bf16 (round to nearest even). Tokens with no contributing rank cannot
 *        exist (topk >= 1).
 *   The sum order is fixed, so results are bitwise deterministic run to run.
 *   With TP > 1 every rank of the owning EP group contributes its ffn slice.
 *
 *   Valid: any topk in [1, E]; any E divisible by EP; ffn divisible by TP;
 *   experts receiving no tokens; T = 0..max_tokens_per_rank, T not a multiple
 *   of any tile size. The topk expert ids of one token must be distinct.
 *   Invalid input returns an error status, sets the last-error message, and
 *   writes nothing to any output.
 *
 * Threads and ranks
 *   A world is a group of W ranks. Collective calls (comet_layer_create,
 *   comet_layer_forward, comet_layer_destroy) must be made by every rank of the
 *   world, each from its own thread (CPU backend) or process/device (CUDA
 *   backend), in the same order. Each rank's calls for one layer come from one
 *   thread at a time.
 */
#ifndef COMET_H
#define COMET_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define COMET_VERSION_MAJOR 0
#define COMET_VERSION_MINOR 1
#define COMET_VERSION_PATCH 0
#define COMET_VERSION_CODE \
    (COMET_VERSION_MAJOR * 10000 + COMET_VERSION_MINOR * 100 + COMET_VERSION_PATCH)

/* ---------------------------------------------------------------------------
 * Status codes. Every public call returns one; comet_last_error() gives the
 * message of the most recent failure on the calling thread.
 * ------------------------------------------------------------------------- */
typedef enum {
    COMET_SUCCESS = 0,
    COMET_ERR_INVALID_ARGUMENT = 1, /* null pointer, bad config value, bad flag */
    COMET_ERR_INVALID_SHAPE = 2,    /* tensor shape/dtype mismatch, buffer too small, T > max */
    COMET_ERR_INVALID_ROUTING = 3,  /* expert id out of range or repeated in a row */
    COMET_ERR_PEER_FAILED = 4,      /* another rank of the collective call failed */
    COMET_ERR_UNSUPPORTED = 5,      /* backend, dtype or feature not available in this build */
    COMET_ERR_OUT_OF_MEMORY = 6,
    COMET_ERR_TIMEOUT = 7,          /* a wait between ranks or workers timed out (CPU worlds then refuse
                                     * every later collective call at once: destroy them) */
    COMET_ERR_SYSTEM = 8,           /* thread or OS call failed */
    COMET_ERR_CUDA = 9,
    COMET_ERR_NCCL = 10,
    COMET_ERR_INTERNAL = 11,
    COMET_NUM_STATUS = 12
} comet_status_t;

/* Short constant name of a status, e.g. "COMET_ERR_INVALID_SHAPE". */
const char *comet_status_string(comet_status_t status);
/* Message of the last failed call on this thread ("" if none). Valid until
 * the next comet call on this thread. */
const char *comet_last_error(void);
/* COMET_VERSION_CODE of the library actually loaded. */
int comet_version(void);

/* ---------------------------------------------------------------------------
 * Tensors: a pointer with its dtype and shape, so every call can check that
 * what it was given is what it needs. Row-major, densely packed.
 * ------------------------------------------------------------------------- */
typedef enum {
    COMET_DTYPE_BF16 = 0, /* uint16_t storage, bfloat16 */
    COMET_DTYPE_FP16 = 1, /* reserved: not yet supported by any backend */
    COMET_DTYPE_FP32 = 2,
    COMET_DTYPE_INT32 = 3,
    COMET_DTYPE_UINT8 = 4 /* bytes: the state a training forward saves for its backward */
} comet_dtype_t;

#define COMET_MAX_DIMS 4

typedef struct {
    void *data;                     /* host pointer (CPU backend) or device pointer (CUDA) */
    comet_dtype_t dtype;
    int ndim;                       /* 1..COMET_MAX_DIMS */
    int64_t shape[COMET_MAX_DIMS];  /* shape[0] outermost */
} comet_tensor_t;

/* Convenience constructors. */
comet_tensor_t comet_tensor_2d(void *data, comet_dtype_t dtype, int64_t d0, int64_t d1);
comet_tensor_t comet_tensor_3d(void *data, comet_dtype_t dtype, int64_t d0, int64_t d1,
                               int64_t d2);

/* ---------------------------------------------------------------------------
 * Worlds: a group of ranks that run layers together.
 * ------------------------------------------------------------------------- */
typedef enum {
    COMET_BACKEND_CPU = 0,  /* ranks are threads of one process; the specification engine */
    COMET_BACKEND_CUDA = 1  /* one GPU per rank (local worlds: rank r on device r), NCCL symmetric memory underneath */
} comet_backend_t;

typedef struct comet_world comet_world_t;

/* Create a world of num_ranks ranks living in this process: every rank is a
 * thread that calls the collective functions (CUDA backend: rank r drives
 * device r). Not collective: one thread creates it and hands it to the rank
 * threads. */
comet_status_t comet_world_create_local(comet_world_t **world, int num_ranks,
                                        comet_backend_t backend);
/* Worlds spread over the processes of one host (torchrun --standalone and
 * the like, CUDA backend; several hosts are not supported: every rank must
 * reach every other's memory): one process per rank. One rank makes the id,
 * the launcher hands its bytes to the others (e.g. over torch.distributed),
 * and every rank creates its world with it: collective over the ranks. */
#define COMET_UNIQUE_ID_BYTES 128
typedef struct {
    char bytes[COMET_UNIQUE_ID_BYTES];
} comet_unique_id_t;
comet_status_t comet_get_unique_id(comet_unique_id_t *id);
/* This process's rank of world_size, on CUDA device `device`. Its layers are
 * created and run with this rank only. */
comet_status_t comet_world_create_nccl(comet_world_t **world, int rank, int world_size,
                                       const comet_unique_id_t *id, int device);

/* Options of a world, for callers that set them in code rather than in the
 * environment. A field left at 0 (NULL) takes the environment variable named
 * beside it, read once when the world is created, else the default. */
typedef struct {
    uint32_t struct_size;  /* [in] sizeof(comet_world_options_t): set by the initializer */
    int timeout_ms;        /* [in] every wait between ranks or workers inside a layer, 1..3600000;
                            *      0: COMET_TIMEOUT_MS, else 60000 */
    int cpu_workers;       /* [in] compute workers per rank on the CPU engine, 1..256;
                            *      0: COMET_CPU_WORKERS, else 2 */
    const char *tune_file; /* [in] the tuner's table (`comet tune` writes one): NULL: COMET_TUNE_FILE, else
                            *      none; "": none. Read when the world is created; a file that does not
                            *      exist (yet) is an empty table, one that is not a table (not a regular
                            *      file, over 1 MiB) fails the create with COMET_ERR_INVALID_ARGUMENT */
    int graph_replay;      /* [in] CUDA backend: 1 replays each layer's kernel chain as a captured graph,
                            *      -1 launches its kernels one by one; 0: -1 if COMET_REPLAY=0, else 1 */
} comet_world_options_t;

#define COMET_WORLD_OPTIONS_INIT {sizeof(comet_world_options_t), 0, 0, NULL, 0}

/* comet_world_create_local and comet_world_create_nccl with options (NULL:
 * every field at its default). */
comet_status_t comet_world_create_local_opts(comet_world_t **world, int num_ranks, comet_backend_t backend,
                                             const comet_world_options_t *options);
comet_status_t comet_world_create_nccl_opts(comet_world_t **world, int rank, int world_size,
                                            const comet_unique_id_t *id, int device,
                                            const comet_world_options_t *options);
/* The options the world runs with, every default filled in (tune_file ""
 * for none; the string lives as long as the world). out->struct_size must be
 * set (COMET_WORLD_OPTIONS_INIT). */
comet_status_t comet_world_get_options(const comet_world_t *world, comet_world_options_t *out);

/* Destroy a world after all its layers are destroyed: while one lives it
 * returns COMET_ERR_INVALID_ARGUMENT and the world stays. NULL is a no-op. */
comet_status_t comet_world_destroy(comet_world_t *world);
int comet_world_size(const comet_world_t *world);
comet_backend_t comet_world_backend(const comet_world_t *world);
/* The one rank this process holds (comet_world_create_nccl), or -1 when every
 * rank of the world lives in this process. */
int comet_world_local_rank(const comet_world_t *world);
/* The CUDA device rank `rank` runs on in this process (-1 on the CPU backend,
 * or for a rank another process holds). */
int comet_world_device(const comet_world_t *world, int rank);
/* CUDA devices the CUDA backend can use; 0 without GPUs or in builds without
 * the CUDA backend. */
int comet_device_count(void);

/* ---------------------------------------------------------------------------
 * Layer configuration.
 * ------------------------------------------------------------------------- */
typedef enum {
    COMET_ACT_SILU_GATED = 0, /* h = silu(g) * u, W1 rows [0,F_local) gate, [F_local,2F_local) up */
    COMET_ACT_GELU = 1        /* h = gelu(g) (erf form), W1 has F_local rows */
} comet_activation_t;

typedef struct {
    uint32_t struct_size;        /* [in] sizeof(comet_layer_config_t): set by the initializer */
    int64_t hidden;              /* [in] H */
    int64_t ffn;                 /* [in] F, per expert, before TP slicing */
    int64_t num_experts;         /* [in] E, global */
    int64_t topk;                /* [in] experts per token, 1..E */
    comet_activation_t activation;
    comet_dtype_t dtype;         /* [in] activations and weights; BF16 */
    int tp;                      /* [in] tensor-parallel degree (slices ffn) */
    int ep;                      /* [in] expert-parallel degree (splits experts) */
    int64_t max_tokens_per_rank; /* [in] upper bound on T; sizes every buffer */
    int tile_m;                  /* [in] row-block height of the plans; 0 = backend default */
} comet_layer_config_t;

#define COMET_LAYER_CONFIG_INIT                                                   \
    {                                                                             \
        sizeof(comet_layer_config_t), 0, 0, 0, 0, COMET_ACT_SILU_GATED,           \
            COMET_DTYPE_BF16, 1, 1, 0, 0                                          \
    }

/* Check a config on its own (without a world): COMET_SUCCESS or the status and
 * a message naming the offending field. world_size 0 skips the TP*EP check.
 * hidden, ffn, num_experts and max_tokens_per_rank must be below 2^31, and no
 * buffer a rank sizes from them (tokens, partials, rows, weights) above 2^48
 * bytes. */
comet_status_t comet_layer_config_check(const comet_layer_config_t *cfg, int world_size);

typedef struct comet_layer comet_layer_t;

/* Collective: create the layer on this rank. All ranks must pass equal
 * configs. When one rank cannot (an invalid config, out of memory, say), it
 * returns its own status and the others COMET_ERR_PEER_FAILED, without waiting
 * out the timeout; the world stays usable (worlds spread over processes
 * too: the ranks meet in NCCL's config check). */
comet_status_t comet_layer_create(comet_layer_t **layer, comet_world_t *world, int rank,
                                  const comet_layer_config_t *cfg);
/* Collective. NULL is a no-op (and not collective). */
comet_status_t comet_layer_destroy(comet_layer_t *layer);

/* Memory this rank's layer holds, sized for the worst case at create time:
 * symmetric (reachable by every rank) and private. CPU backend: staged
 * tokens, routing, fp32 partials and flags symmetric; plan, gathered rows,
 * activations and expert outputs private (host memory). CUDA backend: staged
 * tokens, routing, flags, the plan, the expert outputs and, with the push
 * combine, the receive buffer of expert output rows pushed home symmetric;
 * gathered rows, activations, a local copy of every rank's routing, the plan
 * builder's and the overlapped mode's state private (device memory). Both
 * backends' symmetric memory also holds the backward's dy stage and its
 * rows' <G, a>; the first training call (a forward that saves, or a
 * backward) adds its private buffers (CUDA: dH and the G's partials, and
 * the recomputed gu on the Hopper path; CPU: dH and dX rows, the weights'
 * transposes). */
typedef struct {
    size_t symmetric_bytes;
    size_t private_bytes;
} comet_memory_t;
comet_status_t comet_layer_memory(const comet_layer_t *layer, comet_memory_t *out);

/* ---------------------------------------------------------------------------
 * Forward.
 * ------------------------------------------------------------------------- */
typedef struct {
    uint32_t struct_size;    /* [in] sizeof(comet_forward_args_t): set by the initializer */
    comet_tensor_t x;        /* [in]  (T, H) bf16: this rank's tokens */
    comet_tensor_t topk_idx; /* [in]  (T, topk) int32: global expert ids, distinct per row */
    comet_tensor_t topk_w;   /* [in]  (T, topk) fp32: routing weights */
    comet_tensor_t w1;       /* [in]  (E_local, 2*F_local, H) bf16 gated, (E_local, F_local, H) gelu */
    comet_tensor_t w2;       /* [in]  (E_local, H, F_local) bf16 */
    comet_tensor_t y;        /* [out] (T, H) bf16 */
    void *stream;            /* [in]  cudaStream_t (CUDA backend); ignored by the CPU backend */
    int n_comm;              /* [in]  communication workers (CPU engine: 1..64, else
                              *       COMET_ERR_INVALID_ARGUMENT) or CTAs beside GEMM0 (CUDA:
                              *       > 0 runs the overlapped mode where the Hopper GEMM runs, capped at
                              *       SMs - 1); 0 = the tuner's choice (src/tuner/tuner.h);
                              *       COMET_SEQUENTIAL = the sequential chain (CUDA; the CPU engine, which
                              *       always overlaps, takes it as 0). Every rank must ask for the same
                              *       mode: > 0 on all, 0 on all, or COMET_SEQUENTIAL on all */
    int chunk_cols;          /* [in]  CPU engine: layer-1 column-chunk width, 0..hidden; 0 = the tuner's choice;
                              *       ignored by the CUDA backend (no chunked combine there) */
    int disable;             /* [in]  measurement only: COMET_DISABLE_* bits; y is then undefined */
    int save;                /* [in]  comet_save_t: what this forward keeps for a backward (training) */
    comet_tensor_t saved;    /* [out] COMET_SAVE_ACTIVATIONS: (n) uint8, n >= comet_layer_saved_bytes(layer,
                              *       COMET_SAVE_ACTIVATIONS), 16-byte aligned: caller-owned, handed to the
                              *       backward of this micro-batch; ignored otherwise. A forward with disable
                              *       bits (a measurement) or one that fails saves nothing (CUDA: it clears
                              *       the header first, so a backward then refuses the buffer) */
} comet_forward_args_t;

/* For "communication hidden" (bench): run the protocol with one side's work
 * (or both sides') left out (its flags still go up, so the other side runs as in the real
 * call). The CPU engine and the CUDA layer with the Hopper GEMM (sequential
 * and overlapped) honour them; every rank must pass the same bits. */
#define COMET_DISABLE_COMM 1 /* no rows copied, no partials reduced, sent or summed */
#define COMET_DISABLE_GEMM 2 /* no GEMM arithmetic (CUDA: the GEMM kernels are not launched) */

/* args.n_comm: no communication CTAs, the sequential chain (CUDA backend). */
#define COMET_SEQUENTIAL (-1)

#define COMET_FORWARD_ARGS_INIT \
    {sizeof(comet_forward_args_t), {0}, {0}, {0}, {0}, {0}, {0}, 0, 0, 0, 0, 0, {0}}

/* ---------------------------------------------------------------------------
 * Protocol: how a forward ran. The tuner chooses it (a table measured by
 * `comet tune`, else an analytical rule: src/tuner/tuner.h) unless the call's
 * n_comm fixed it. Every rank of a forward runs the same mode and combine
 * (and, on the CPU engine, the same chunk width); n_comm may differ between
 * ranks (the CPU engine's rule picks it from the rank's own token count).
 * ------------------------------------------------------------------------- */
typedef enum {
    COMET_MODE_SEQUENTIAL = 0, /* dispatch, GEMM0, GEMM1, combine one after another (CUDA) */
    COMET_MODE_OVERLAPPED = 1  /* communication beside the GEMMs: n_comm workers (CPU) or CTAs (CUDA) */
} comet_mode_t;

typedef enum {
    COMET_COMBINE_PARTIALS = 0, /* CPU engine: each rank sends fp32 partials home, column chunk by chunk */
    COMET_COMBINE_PUSH = 1,     /* CUDA: GEMM1 stores each expert output row into its token's home rank */
    COMET_COMBINE_PULL = 2      /* CUDA: the home rank reads expert output rows from the ranks that made them
                                 * (where push cannot run: the SIMT GEMM, more than 8 ranks) */
} comet_combine_t;

typedef enum {
    COMET_GEMM_CPU = 0,    /* the CPU engine's loops */
    COMET_GEMM_HOPPER = 1, /* the Hopper (sm_90a) grouped GEMM: TMA, wgmma, warp specialised */
    COMET_GEMM_SIMT = 2    /* plain CUDA tiles: other GPUs, or shapes the Hopper GEMM does not take */
} comet_gemm_kind_t;

typedef enum {
    COMET_CHOSEN_BY_ARGS = 0,  /* args.n_comm fixed the mode */
    COMET_CHOSEN_BY_TABLE = 1, /* the tuner's table held this configuration */
    COMET_CHOSEN_BY_RULE = 2   /* the tuner's analytical rule */
} comet_choice_t;

typedef struct {
    uint32_t struct_size;      /* [in] sizeof(comet_protocol_t): set by the initializer */
    comet_mode_t mode;         /* [out] */
    int n_comm;                /* [out] communication workers (CPU) or CTAs beside GEMM0 (CUDA overlapped);
                                *       0 in the sequential mode */
    int chunk_cols;            /* [out] layer-1 column-chunk width (CPU engine); 0 on the CUDA backend */
    comet_combine_t combine;   /* [out] */
    comet_gemm_kind_t gemm;    /* [out] */
    comet_choice_t chosen_by;  /* [out] what decided mode and n_comm */
    int graph_replay;          /* [out] CUDA: 1 if the forward replayed the layer's captured kernel chain */
} comet_protocol_t;

#define COMET_PROTOCOL_INIT {sizeof(comet_protocol_t), COMET_MODE_SEQUENTIAL, 0, 0, COMET_COMBINE_PARTIALS, \
                             COMET_GEMM_CPU, COMET_CHOSEN_BY_ARGS, 0}

/* The protocol of this rank's last forward or backward (launched, on the
 * CUDA backend). Before the first: COMET_ERR_INVALID_ARGUMENT. */
comet_status_t comet_layer_last_protocol(const comet_layer_t *layer, comet_protocol_t *out);

/* Collective: every rank calls it with its own tokens. On failure no output is
 * written on any rank: a rank whose own input is invalid returns the specific
 * status; the others return COMET_ERR_PEER_FAILED.
 * CPU backend: synchronous; every status is final when the call returns.
 * CUDA backend: asynchronous on args->stream, with no host synchronisation
 * (capturable in a CUDA graph; a captured forward names this call's tensors
 * and the layer's buffers, so replay it only while those stay as they were:
 * same weights, no change of trace). Outside a capture, the layer replays
 * its own kernel chain as a graph: the first call of each protocol (mode,
 * n_comm, disable bits, weights) captures and instantiates it (a one-off
 * host cost; after a layer's first 64 captures a miss launches directly),
 * later calls launch it (options.graph_replay -1: the kernels one by one). Shapes are checked at once; the routing
 * content (device memory) is checked on the device: comet_layer_sync reports
 * it, and an invalid routing on any rank leaves every y untouched. */
comet_status_t comet_layer_forward(comet_layer_t *layer, const comet_forward_args_t *args);

/* Wait for this rank's last forward (or backward) and return what the device found:
 * COMET_SUCCESS, COMET_ERR_INVALID_ROUTING (this rank's topk_idx),
 * COMET_ERR_PEER_FAILED (another rank's) or COMET_ERR_INVALID_ARGUMENT (this
 * rank's arguments, or the ranks ran different protocols: n_comm and the
 * tuner's table must agree). CPU backend: COMET_SUCCESS at once.
 * CUDA backend: a wait between ranks that times out (options.timeout_ms) prints
 * rank, role and index and traps; this then returns COMET_ERR_TIMEOUT (GEMM0's
 * readiness wait, with its report) or COMET_ERR_CUDA (the others: the message
 * went to stdout), and the device context is unusable. */
comet_status_t comet_layer_sync(comet_layer_t *layer);

/* ---------------------------------------------------------------------------
 * Reference: the specification as plain loops, for every rank at once, in the
 * calling thread. inputs[r] holds rank r's x, topk_idx, topk_w, w1, w2 and y
 * (other fields ignored). Validates everything before writing any y.
 * ------------------------------------------------------------------------- */
comet_status_t comet_reference_forward(const comet_layer_config_t *cfg, int world_size,
                                       const comet_forward_args_t *inputs);

/* ---------------------------------------------------------------------------
 * Backward (training). Given dy, the gradient of the loss with respect to y,
 * the layer's gradients with respect to x, topk_w, w1 and w2 follow from the
 * forward's semantics. The contract fixes their rounding points and every
 * sum that crosses rows or ranks, as the forward's does. For each row r =
 * (token t, slot j) whose expert e = topk_idx[t,j] lives on rank q (q's ffn
 * slice of e), w = topk_w[t,j]:
 *   1. gu = x_t W1_e^T, fp32 accumulation, stored bf16 ([g|u], 2 F_local,
 *      gated; g, F_local, GELU); a = the forward's h (its activation of the
 *      fp32 accumulators, stored bf16).
 *   2. G = dy_t W2_e: (F_local) in fp32 (fp32 accumulation over H).
 *   3. d_topk_w[t,j] = the sum over the TP ranks of e's EP group, in
 *      ascending tp, of that rank's <G, a> over its slice (fp32
 *      accumulation), in fp32 from 0.
 *   4. dA = w * G (fp32); the activation's backward in fp32 from gu's bf16
 *      values: gated, s = sigmoid(g), dg = dA * u * s * (1 + g (1 - s)),
 *      du = dA * g * s; GELU (erf), dg = dA * (Phi(g) + g phi(g)). dH =
 *      [dg|du] (or dg) stored bf16.
 *   5. dX_r = dH W1_e: (H), fp32 accumulation over W1's rows, stored bf16.
 *   6. On the token's home rank, dx[t] = the sum over the ranks q that hold
 *      at least one of t's experts, in ascending q, of (the sum over t's
 *      slots on q, in ascending j, of dX_r, in fp32 from 0), in fp32 from 0,
 *      stored bf16: the forward's combine with weights 1.
 *   7. dW2_e = sum over e's rows r of bf16(w * dy_t)^T a_r, dW1_e = sum over
 *      e's rows r of dH_r^T x_t: fp32 accumulation (order free, as a GEMM's),
 *      then rounded once to the output's dtype, or added in fp32 to it
 *      (accumulate: main-grad style, across micro-batches).
 * The sums of rows (6, 7) and the cross-rank sums (3, 6) have a fixed order,
 * so every backend is bitwise deterministic run to run.
 * ------------------------------------------------------------------------- */
typedef struct {
    uint32_t struct_size;    /* [in] sizeof(comet_backward_args_t): set by the initializer */
    comet_tensor_t x;        /* [in]  (T, H) bf16: this rank's tokens, as in the forward */
    comet_tensor_t topk_idx; /* [in]  (T, topk) int32, as in the forward */
    comet_tensor_t topk_w;   /* [in]  (T, topk) fp32, as in the forward */
    comet_tensor_t w1;       /* [in]  (E_local, w1_rows, H) bf16, as in the forward */
    comet_tensor_t w2;       /* [in]  (E_local, H, F_local) bf16, as in the forward */
    comet_tensor_t dy;       /* [in]  (T, H) bf16: the gradient of y */
    comet_tensor_t dx;       /* [out] (T, H) bf16 */
    comet_tensor_t d_topk_w; /* [out] (T, topk) fp32 */
    comet_tensor_t dw1;      /* [out] (E_local, w1_rows, H) bf16 or fp32: this rank's experts' slices */
    comet_tensor_t dw2;      /* [out] (E_local, H, F_local) bf16 or fp32 */
    int accumulate;          /* [in]  0: dw1, dw2 written; 1: added to (both fp32) */
    int save;                /* [in]  comet_save_t of the forward this backward follows: ACTIVATIONS reads
                              *       saved; RECOMPUTE (or NONE) recomputes gu and h (one more GEMM0) */
    comet_tensor_t saved;    /* [in]  COMET_SAVE_ACTIVATIONS: what that forward wrote (same layer, same
                              *       x and routing); ignored otherwise */
    void *stream;            /* [in]  cudaStream_t (CUDA backend); ignored by the CPU backend */
    int n_comm;              /* [in]  as the forward's: 0 = the tuner's choice, > 0 communication workers
                              *       (CPU) or CTAs (CUDA), COMET_SEQUENTIAL = the sequential chain */
    int disable;             /* [in]  measurement only, as the forward's: COMET_DISABLE_* bits (COMM: no
                              *       rows pulled, combined or summed; GEMM: no GEMM arithmetic, the
                              *       weight gradients' included); the gradients are then undefined */
} comet_backward_args_t;

#define COMET_BACKWARD_ARGS_INIT \
    {sizeof(comet_backward_args_t), {0}, {0}, {0}, {0}, {0}, {0}, {0}, {0}, {0}, {0}, 0, 0, {0}, NULL, 0, 0}

/* What a training forward keeps for its backward. Several micro-batches may
 * be in flight (pipeline schedules, gradient accumulation, activation
 * checkpointing), so the saved state lives in caller memory, never in the
 * layer: one buffer per forward, handed to the backward of the same
 * micro-batch. Either way the backward gathers x's rows again (from
 * args.x) and rebuilds the routing plan from args.topk_idx. */
typedef enum {
    COMET_SAVE_NONE = 0,        /* inference: nothing kept (the backward then recomputes) */
    COMET_SAVE_ACTIVATIONS = 1, /* the forward writes every row's gu and h (bf16, the bits its
                                 * GEMM0 computed) into saved; the backward reads them */
    COMET_SAVE_RECOMPUTE = 2    /* nothing kept: the backward reruns GEMM0 on the gathered rows,
                                 * which gives the same bits (comet_layer_saved_bytes: 0) */
} comet_save_t;

/* Bytes of saved state one forward of this layer writes with mode save,
 * sized for the worst case of the config (every token of every rank routed
 * here: the row count is known only on the device): a header, then per
 * row (max_tokens_per_rank * world * min(topk, E_local) rows, padded to
 * row blocks) gu and h in bf16, 2 * (w1_rows + F_local) bytes. */
comet_status_t comet_layer_saved_bytes(const comet_layer_t *layer, int save, size_t *bytes);

/* Collective: the layer's backward for this rank's tokens (every rank calls
 * it, in the same order as its other collective calls). Semantics, rounding
 * points and sums as above; for one layer the result does not depend on save
 * or n_comm (bitwise, run to run; the CPU engine's is the reference's bits).
 * On failure nothing is written to dx, d_topk_w, dw1 or dw2 on any rank (as
 * the forward: a rank's own bad input gives its status, the others
 * COMET_ERR_PEER_FAILED). Saved state from another layer, from a forward with
 * other tokens (T), or from a forward that failed or saved nothing is refused
 * (COMET_ERR_INVALID_ARGUMENT). CPU backend: synchronous. CUDA backend:
 * asynchronous on args->stream, no host synchronisation, capturable in a
 * graph once a first training call has run outside the capture (it allocates
 * the layer's training buffers); comet_layer_sync reports what the device
 * found. A layer's calls (forward and backward) run in the order they are
 * made on every backend, whatever streams they come on (CUDA: a call on
 * another stream than the last waits for it, outside captures). */
comet_status_t comet_layer_backward(comet_layer_t *layer, const comet_backward_args_t *args);

/* The backward's specification as plain loops, for every rank at once, in
 * the calling thread: args[r] holds rank r's inputs and outputs. Validates
 * everything before writing anything; the outputs of every rank are then
 * written (dw1 and dw2 also for experts no token chose: zero, or unchanged
 * when accumulating). */
comet_status_t comet_reference_backward(const comet_layer_config_t *cfg, int world_size,
                                        const comet_backward_args_t *args);

/* ---------------------------------------------------------------------------
 * Trace: record what every worker of every rank did, and when, during the
 * forward calls of the layers it is attached to (and, on the CPU engine,
 * their backward calls, in the backward's own kinds), then write it as a
 * Chrome-trace JSON file (Perfetto, chrome://tracing) or an SVG picture with
 * one lane per rank and worker. Off unless attached; costs nothing then.
 * Recording takes no lock: every worker writes its own lane of a fixed-size
 * buffer; events that do not fit are dropped and counted, never a failure.
 * Both backends record (the CUDA backend into 11 lanes per rank, below;
 * comet_layer_sync copies the last forward's events into the recorder).
 * ------------------------------------------------------------------------- */
typedef struct comet_trace comet_trace_t;

/* A recorder for ranks 0..num_ranks-1 with lanes_per_rank lanes (a rank's
 * thread plus its workers: 1 + n_comm + compute workers) of events_per_lane
 * events (32 bytes each). 0 picks a default (32 lanes, 16384 events). */
comet_status_t comet_trace_create(comet_trace_t **trace, int num_ranks, int lanes_per_rank,
                                  int64_t events_per_lane);
/* Destroy a recorder no layer uses any more (detach first). NULL is a no-op. */
comet_status_t comet_trace_destroy(comet_trace_t *trace);
/* Forget every event (not while a traced forward runs). */
comet_status_t comet_trace_clear(comet_trace_t *trace);
/* Events kept, and events dropped because a lane was full (or the rank or
 * lane was outside the recorder). Read them when no traced forward runs. */
int64_t comet_trace_event_count(const comet_trace_t *trace);
int64_t comet_trace_dropped(const comet_trace_t *trace);
/* Write the events as Chrome-trace JSON: one process per rank, one thread per
 * worker, one complete ("X") event per step, microseconds from the earliest
 * event. */
comet_status_t comet_trace_write_chrome_json(const comet_trace_t *trace, const char *path);
/* Write the events as an SVG picture: one lane per rank x worker, comm and
 * GEMM steps in different colors, layer 0 light and layer 1 dark, waits as
 * thin grey bars, a time axis in microseconds. */
comet_status_t comet_trace_write_svg(const comet_trace_t *trace, const char *path);

/* Attach a recorder to this rank's layer (NULL detaches). Not collective:
 * each rank attaches its own layer, between forward calls, from the thread
 * that calls them; ranks may share one recorder (each writes its own lanes;
 * a rank or lane the recorder lacks counts its events as dropped).
 * Every later forward of this layer records until detached (CPU engine:
 * every backward too; the CUDA backend records forwards only). CUDA backend:
 * the recorder needs >= 11 lanes per rank (the stream's steps, communication
 * CTAs by index mod 8, GEMM0, GEMM1: the GEMMs as whole-kernel intervals);
 * comet_layer_sync copies the last forward's events into it. */
comet_status_t comet_layer_set_trace(comet_layer_t *layer, comet_trace_t *trace);

#ifdef __cplusplus
}
#endif

#endif /* COMET_H */
