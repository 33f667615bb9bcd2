/*
 * backend.c - host side of the CUDA backend: one GPU per rank (local
 * worlds: rank r on device r; comet_world_create_nccl: the device given),
 * buffers sized for the worst case at create time, and a forward that only
 * enqueues work (layer_chain.cu) on the caller's stream: no host
 * synchronisation, so a whole forward can be captured in a CUDA graph. The
 * routing is checked on the device; comet_layer_sync reports what the device
 * found. The GEMM kind is decided at create (the Hopper GEMM on sm_90 for
 * the shapes it takes), the combine at create and the mode and n_comm at
 * each forward by the tuner (comet_protocol_t).
 *
 * Ranks > 1 talk through NCCL symmetric memory (src/comm); a single rank needs
 * no NCCL at all. Compiled only when the CUDA toolkit is present
 * (COMET_WITH_CUDA).
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../comm/comm.h"
#include "../core/runtime.h"
#include "../core/saved.h"
#include "../core/status.h"
#include "../core/validate.h"
#include "plan_kernel.h"
#include "cuda_layer.h"
#include "gemm.h"
#include "replay.h"
#include "../trace/trace.h"
#include "../tuner/tuner.h"

/* The layer's private device buffers (alloc_private sizes and carves them). */
typedef struct {
    comet_cuda_state_t *state; /* the device state (cuda_layer.h) */
    comet_bf16_t *a;           /* (max_rows_padded, H) gathered token rows */
    comet_bf16_t *h;           /* (max_rows_padded, F_local) activations */
    char *scratch;             /* 256 B zeroed: the barrier's float at 0, the GEMM's tile counters at word 16,
                                * the training launches' (G, dX) at word 24;
                                * then GEMM1's tail split workspace (gemm.h), if any */
    uint64_t *block_ready;     /* [max_blocks], then block_rows [max_blocks] uint32 (overlapped dispatch) */
    int32_t *routes;           /* every rank's routing copied here: W x (max_T, topk) int32, then fp32 */
    void *plan_scratch;        /* the plan builder's count table (plan_kernel.h) */
} cuda_buffers_t;

typedef struct {
    comet_comm_t *comm;    /* NULL for a single rank */
    comet_sym_t sym;       /* symmetric buffer (comm) */
    void *sym_single;      /* the same, single rank */
    cuda_buffers_t buf;
    size_t private_bytes;  /* what layer_init allocated */
    int *agree;            /* device word of agree_ranks (ranks in separate processes) */
    uint64_t *gemm_report; /* host-mapped, 8 words: GEMM0's readiness-wait timeout (gemm.h) */
    comet_trace_t *trace;  /* recorder attached by comet_layer_set_trace, or NULL */
    void *tr_events;       /* device [COMET_CUDA_TRACE_LANES][trace->capacity] */
    uint32_t *tr_counts;   /* device [COMET_CUDA_TRACE_LANES] */
    comet_cuda_ctx_t ctx;  /* everything but the call's tensors */
    cudaStream_t last_stream;
    cudaEvent_t order_ev;  /* recorded after each call's chain on its stream (order_calls) */
    int order_live;        /* order_ev holds the last call's end (not recorded inside a capture) */
    int device;
    comet_protocol_t base; /* what create decided: the GEMM kind (Hopper where the device is sm_90 and
                            * comet_gemm_check passes) and the combine (the tuner's) */
    comet_gemm_t *gemm;    /* prepared for gemm_w1/gemm_w2 */
    void *gemm_split;      /* GEMM1's tail split workspace inside buf.scratch, sized at create, or NULL */
    const void *gemm_w1, *gemm_w2;
    char gemm_error[256];  /* why the Hopper GEMM could not be prepared for these weights, or "" */
    comet_cuda_replay_t *replay; /* the chain as a replayed graph (replay.c), or NULL: replay off */
} cuda_layer_t;

static comet_status_t cuda_fail(int rank, cudaError_t e, const char *what) {
    return comet_fail(COMET_ERR_CUDA, "rank %d: %s: %s", rank, what, cudaGetErrorString(e));
}

#define CUDA_TRY(rank, call)                                                     \
    do {                                                                         \
        cudaError_t e_ = (call);                                                 \
        if (e_ != cudaSuccess) return cuda_fail(rank, e_, #call);                \
    } while (0)

static int cuda_device_count(void) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

/* Per-world state: one communicator per rank, shared by the rank's layers.
 * Local worlds create a rank's communicator with its first layer (the ranks
 * agree on a fresh id in the create rendezvous: an NCCL id serves one
 * communicator) and destroy it with its last; a world spread over processes
 * creates its one rank's communicator with the world. */
typedef struct {
    comet_comm_t *comm[COMET_CUDA_MAX_RANKS];
    int layers[COMET_CUDA_MAX_RANKS];
    int device;                 /* external worlds: this rank's device */
    uint64_t *agree_words;      /* external worlds: 3 device words for agree_across_processes, made with
                                 * the world so that a rank short of memory can still take part */
} cuda_world_t;

static int cuda_world_device(const comet_world_t *w) { return ((const cuda_world_t *)w->backend_world)->device; }

static int device_of(const comet_world_t *w, int rank) { return w->local_rank >= 0 ? cuda_world_device(w) : rank; }

static comet_status_t cuda_unique_id(void *id) {
    comet_comm_id_t cid;
    COMET_TRY(comet_comm_unique_id(&cid));
    memcpy(id, cid.bytes, sizeof cid.bytes);
    return COMET_SUCCESS;
}

static comet_status_t cuda_world_init(comet_world_t *w, const void *id, int device) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
        return comet_fail(COMET_ERR_UNSUPPORTED, "no CUDA device: %s",
                          e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found 0");
    if (w->size > COMET_CUDA_MAX_RANKS)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "the CUDA backend runs at most %d ranks", COMET_CUDA_MAX_RANKS);
    if (w->local_rank < 0 && w->size > n)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "%d ranks but only %d CUDA devices", w->size, n);
    if (w->local_rank >= 0 && device >= n)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "device %d, but only %d CUDA devices", device, n);
    cuda_world_t *cw = calloc(1, sizeof *cw);
    if (!cw) return comet_fail(COMET_ERR_OUT_OF_MEMORY, "world: no memory");
    cw->device = device;
    if (w->local_rank >= 0 && w->size > 1) {
        comet_comm_id_t cid;
        memcpy(cid.bytes, id, sizeof cid.bytes);
        comet_status_t st = comet_comm_create(&cw->comm[w->local_rank], w->local_rank, w->size, &cid, device);
        cudaError_t me = st == COMET_SUCCESS ? cudaMalloc((void **)&cw->agree_words, 3 * sizeof(uint64_t)) : cudaSuccess;
        if (st == COMET_SUCCESS && me != cudaSuccess) st = cuda_fail(w->local_rank, me, "the world's agreement words");
        if (st != COMET_SUCCESS) {
            if (cw->comm[w->local_rank]) comet_comm_destroy(cw->comm[w->local_rank]);
            free(cw);
            return st;
        }
    }
    w->backend_world = cw;
    return COMET_SUCCESS;
}

static void cuda_world_destroy(comet_world_t *w) {
    cuda_world_t *cw = w->backend_world;
    if (!cw) return;
    if (w->local_rank >= 0) comet_comm_destroy(cw->comm[w->local_rank]);
    cudaFree(cw->agree_words);
    free(cw);
    w->backend_world = NULL;
}

/* What the ranks of a local world share when a layer is created: a fresh NCCL
 * id, made by the first rank to arrive, used when the ranks have no
 * communicator yet. The rendezvous also checks that the configs agree. */
typedef struct {
    atomic_int refs;
    comet_status_t status;
    char message[512];
    comet_comm_id_t id;
} cuda_shared_t;

typedef struct {
    int ranks;   /* holders of the shared object */
    int need_id; /* the ranks have no communicator yet (the same on every rank) */
} shared_id_arg_t;

static void *make_shared_id(void *arg) {
    const shared_id_arg_t *a = arg;
    cuda_shared_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    atomic_init(&s->refs, a->ranks);
    /* an id starts a listener in NCCL: make one only when it will be used */
    s->status = a->need_id ? comet_comm_unique_id(&s->id) : COMET_SUCCESS;
    snprintf(s->message, sizeof s->message, "%s", comet_last_error());
    return s;
}

static void release_shared_id(cuda_shared_t *s) {
    if (s && atomic_fetch_sub(&s->refs, 1) == 1) free(s);
}

/* The create's first meeting across processes (comet_world_create_nccl):
 * the maximum over the ranks of words[0..2] (a config hash, its complement,
 * and 1 from a rank that failed before it could compare), in place. */
static comet_status_t agree_across_processes(comet_world_t *world, int rank, uint64_t words[3]) {
    const cuda_world_t *cw = world->backend_world;
    uint64_t *dev = cw->agree_words;
    /* the allreduce comes whatever the copy did: a rank that skipped it would leave its peers in it */
    cudaError_t e = cudaMemcpy(dev, words, 3 * sizeof(uint64_t), cudaMemcpyHostToDevice);
    ncclResult_t r = ncclAllReduce(dev, dev, 3, ncclUint64, ncclMax, comet_comm_nccl(cw->comm[rank]), 0);
    if (e != cudaSuccess) return cuda_fail(rank, e, "config check");
    e = r == ncclSuccess ? cudaMemcpy(words, dev, 3 * sizeof(uint64_t), cudaMemcpyDeviceToHost) : cudaSuccess;
    if (r != ncclSuccess) return comet_fail(COMET_ERR_NCCL, "rank %d: config check: %s", rank, ncclGetErrorString(r));
    if (e != cudaSuccess) return cuda_fail(rank, e, "config check");
    return COMET_SUCCESS;
}

/* A rank that failed before its create could compare (its own config, say)
 * still meets its peers where the create's first meeting is: the world's
 * rendezvous (local worlds) or the config check's allreduce (processes), so
 * they return COMET_ERR_PEER_FAILED at once and the ranks stay in step. The
 * caller's own message stays. */
static void cuda_layer_create_failed(comet_world_t *world, int rank) {
    if (world->size < 2) return;
    if (world->local_rank < 0) {
        comet_world_rendezvous_failed(world, rank);
        return;
    }
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", comet_last_error());
    uint64_t words[3] = {0, 0, 1};
    cudaSetDevice(cuda_world_device(world));
    agree_across_processes(world, rank, words);
    comet_fail_copy(COMET_ERR_INTERNAL, msg); /* the message only: the caller returns its own status */
}

/* The rank's communicator, created on first use (local worlds), and checks
 * that every rank brought the same config and combine (push sizes the
 * symmetric buffer, which every rank must allocate alike). */
static comet_status_t join_ranks(comet_layer_t *l, int combine, comet_comm_t **comm) {
    const comet_dims_t *d = &l->dims;
    const int rank = l->rank, w = d->world_size;
    cuda_world_t *cw = l->world->backend_world;
    struct {
        comet_dims_t d;
        int combine;
    } key;
    memset(&key, 0, sizeof key); /* padding hashed too */
    key.d = *d, key.combine = combine;
    key.d.rank = key.d.tp_rank = key.d.ep_rank = 0;
    if (l->world->local_rank < 0) {
        cuda_shared_t *sh = NULL;
        shared_id_arg_t arg = {w, cw->comm[rank] == NULL};
        comet_status_t st = comet_world_rendezvous(l->world, rank, &key, sizeof key, make_shared_id, &arg, (void **)&sh);
        if (st == COMET_SUCCESS && !cw->comm[rank] && sh->status != COMET_SUCCESS) st = comet_fail_copy(sh->status, sh->message);
        if (st == COMET_SUCCESS && !cw->comm[rank]) st = comet_comm_create(&cw->comm[rank], rank, w, &sh->id, rank);
        release_shared_id(sh);
        COMET_TRY(st);
    } else {
        /* across processes: the configs agree when max and min of a hash do */
        uint64_t h = 1469598103934665603ull;
        const unsigned char *b = (const unsigned char *)&key;
        for (size_t i = 0; i < sizeof key; i++) h = (h ^ b[i]) * 1099511628211ull;
        uint64_t agreed[3] = {h, ~h, 0};
        COMET_TRY(agree_across_processes(l->world, rank, agreed));
        if (agreed[2])
            return comet_fail(COMET_ERR_PEER_FAILED, "rank %d: another rank could not create its layer", rank);
        if (agreed[0] != ~agreed[1])
            return comet_fail(COMET_ERR_INVALID_ARGUMENT,
                              "rank %d: ranks passed different configs to comet_layer_create (or chose "
                              "different combines: COMET_PUSH differs)",
                              rank);
    }
    *comm = cw->comm[rank];
    cw->layers[rank]++;
    return COMET_SUCCESS;
}

/* The layer's hold on its rank's communicator ends; a local world's last
 * layer on a rank takes the communicator with it (every rank at once). */
static void leave_ranks(comet_world_t *world, int rank) {
    cuda_world_t *cw = world->backend_world;
    if (--cw->layers[rank] == 0 && world->local_rank < 0) {
        comet_comm_destroy(cw->comm[rank]);
        cw->comm[rank] = NULL;
    }
}

static void free_all(cuda_layer_t *L) {
    if (!L) return;
    cudaSetDevice(L->device);
    comet_gemm_destroy(L->gemm);
    comet_cuda_replay_destroy(L->replay);
    cudaFree(L->buf.state);
    cudaFree(L->buf.a);
    cudaFree(L->buf.h);
    cudaFree(L->buf.scratch);
    cudaFree(L->buf.block_ready);
    cudaFree(L->buf.routes);
    cudaFree(L->buf.plan_scratch);
    if (L->order_ev) cudaEventDestroy(L->order_ev);
    cudaFree(L->ctx.dh);
    cudaFree(L->ctx.gu);
    cudaFree(L->ctx.dwp);
    cudaFree(L->tr_events);
    cudaFree(L->tr_counts);
    cudaFree(L->agree);
    if (L->gemm_report) cudaFreeHost(L->gemm_report);
    cudaFree(L->sym_single);
    if (L->comm) comet_comm_free_symmetric(L->comm, &L->sym);
    free(L);
}

/* A barrier across the ranks (create time only): every rank's flags are
 * zeroed before any rank's first forward reads them. */
static comet_status_t barrier(cuda_layer_t *L, int rank) {
    if (!L->comm) return COMET_SUCCESS;
    float *one = (float *)L->buf.scratch;
    ncclResult_t r = ncclAllReduce(one, one, 1, ncclFloat, ncclSum, comet_comm_nccl(L->comm), 0);
    if (r != ncclSuccess) return comet_fail(COMET_ERR_NCCL, "rank %d: barrier: %s", rank, ncclGetErrorString(r));
    CUDA_TRY(rank, cudaStreamSynchronize(0));
    return COMET_SUCCESS;
}

/* The symmetric buffer of dims d (cuda_layer.h), every field 4 KiB aligned;
 * the receive buffer of pushed o rows only with push. */
static void sym_layout(const comet_dims_t *d, int push, comet_sym_layout_t *lay) {
    size_t off = 0;
#define COMET_SYM_FIELD(field, bytes)                  \
    do {                                               \
        lay->field = off;                              \
        off += ((size_t)(bytes) + 4095) / 4096 * 4096; \
    } while (0)
    COMET_SYM_FIELD(flags, sizeof(comet_sym_flags_t));
    COMET_SYM_FIELD(x, (size_t)(d->max_tokens * d->hidden) * 2);
    COMET_SYM_FIELD(topk_idx, (size_t)(d->max_tokens * d->topk) * 4);
    COMET_SYM_FIELD(topk_w, (size_t)(d->max_tokens * d->topk) * 4);
    COMET_SYM_FIELD(plan, comet_plan_workspace_bytes(d));
    COMET_SYM_FIELD(o, (size_t)(d->max_rows_padded * d->hidden) * 2);
    COMET_SYM_FIELD(recv, push ? (size_t)(d->tp * d->max_tokens * d->topk * d->hidden) * 2 : 0);
    COMET_SYM_FIELD(dy, (size_t)(d->max_tokens * d->hidden) * 2);
    COMET_SYM_FIELD(dwr, (size_t)d->max_rows_padded * 4);
#undef COMET_SYM_FIELD
    lay->total = off;
}

/* Sizes of the private buffers (cuda_buffers_t, in its order); split: GEMM1's
 * tail split workspace (the Hopper GEMM runs and splits). */
#define CUDA_NUM_BUFFERS 7
static void buffer_sizes(const comet_dims_t *d, size_t split, size_t bytes[CUDA_NUM_BUFFERS]) {
    const size_t rows = (size_t)d->max_rows_padded, slots = (size_t)(d->max_tokens * d->topk);
    bytes[0] = sizeof(comet_cuda_state_t);
    bytes[1] = rows * (size_t)d->hidden * 2;
    bytes[2] = rows * (size_t)d->ffn_local * 2;
    bytes[3] = 256 + split;
    bytes[4] = (size_t)d->max_blocks * (sizeof(uint64_t) + sizeof(uint32_t));
    bytes[5] = (size_t)d->world_size * slots * 8;
    bytes[6] = comet_cuda_plan_scratch_bytes(d);
}

/* GEMM1's tail split workspace this layer needs (0: none). */
static size_t split_bytes(const comet_layer_t *l, const cuda_layer_t *L) {
    return L->base.gemm == COMET_GEMM_HOPPER ? comet_gemm_split_bytes(&l->dims, l->knobs.gemm.split_min) : 0;
}

/* The device state of a fresh layer: epoch 0, every rank's staged routing
 * as this GPU sees it, flags zeroed, receive buffers poisoned. */
static comet_status_t init_device_state(const comet_layer_t *l, cuda_layer_t *L, int rank) {
    comet_cuda_ctx_t *c = &L->ctx;
    const comet_dims_t *d = &c->d;
    const int w = d->world_size;
    const size_t slots = (size_t)(d->max_tokens * d->topk);
    comet_cuda_state_t s;
    memset(&s, 0, sizeof s);
    for (int q = 0; q < w; q++) {
        s.peer_idx[q] = (const int32_t *)(c->peers[q] + c->lay.topk_idx);
        s.peer_w[q] = (const float *)(c->peers[q] + c->lay.topk_w);
        s.route_idx[q] = L->buf.routes + (size_t)q * slots;
        s.route_w[q] = (float *)(L->buf.routes + (size_t)w * slots) + (size_t)q * slots;
    }
    CUDA_TRY(rank, cudaMemcpy(c->state, &s, sizeof s, cudaMemcpyHostToDevice));
    CUDA_TRY(rank, cudaMemset(c->sym + c->lay.flags, 0, sizeof(comet_sym_flags_t)));
    /* pushed rows arrive in recv: poisoned (NaN) until they do, so one never sent shows */
    CUDA_TRY(rank, cudaMemset(c->sym + c->lay.recv, 0xff, c->lay.dy - c->lay.recv));
    size_t bytes[CUDA_NUM_BUFFERS];
    buffer_sizes(d, split_bytes(l, L), bytes);
    CUDA_TRY(rank, cudaMemset(L->buf.scratch, 0, bytes[3])); /* the split's counters too (gemm.h: its first 1 KiB) */
    CUDA_TRY(rank, cudaMemset(L->buf.block_ready, 0, bytes[4]));
    CUDA_TRY(rank, cudaDeviceSynchronize());
    return COMET_SUCCESS;
}

static void *agree_token(void *arg) {
    static char token;
    (void)arg;
    return &token;
}

/* Every rank learns whether all of them got this far (st: this rank's
 * status), so that a rank failing alone (out of memory, say) does not leave
 * the others waiting in the next collective. A local world meets on the host
 * (a world rendezvous keyed by "failed": ranks that differ fail, and its
 * timeout bounds the wait); ranks in separate processes through an NCCL
 * allreduce. Returns st, or PEER_FAILED on the ranks that were fine when
 * another was not. */
static comet_status_t agree_ranks(comet_layer_t *l, cuda_layer_t *L, comet_status_t st) {
    const int rank = l->rank;
    if (!L->comm) return st;
    int v = st != COMET_SUCCESS;
    if (l->world->local_rank < 0) {
        void *unused;
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", st != COMET_SUCCESS ? comet_last_error() : "");
        const comet_status_t met = comet_world_rendezvous(l->world, rank, &v, sizeof v, agree_token, NULL, &unused);
        if (st != COMET_SUCCESS) return comet_fail_copy(st, msg);
        if (met == COMET_ERR_INVALID_ARGUMENT) /* the keys differed: another rank failed */
            return comet_fail(COMET_ERR_PEER_FAILED, "rank %d: another rank could not set up its layer", rank);
        return met;
    }
    cudaError_t e = cudaMemcpy(L->agree, &v, sizeof v, cudaMemcpyHostToDevice); /* allocated by layer_init */
    ncclResult_t r = ncclAllReduce(L->agree, L->agree, 1, ncclInt32, ncclMax, comet_comm_nccl(L->comm), 0);
    if (e == cudaSuccess && r == ncclSuccess) e = cudaStreamSynchronize(0);
    if (e == cudaSuccess && r == ncclSuccess) e = cudaMemcpy(&v, L->agree, sizeof v, cudaMemcpyDeviceToHost);
    if (st != COMET_SUCCESS) return st;
    if (r != ncclSuccess) return comet_fail(COMET_ERR_NCCL, "rank %d: layer set-up: %s", rank, ncclGetErrorString(r));
    if (e != cudaSuccess) return cuda_fail(rank, e, "layer set-up");
    if (v) return comet_fail(COMET_ERR_PEER_FAILED, "rank %d: another rank could not set up its layer", rank);
    return COMET_SUCCESS;
}

/* This rank's private buffers, streams and events (no collective: a failure
 * here is agreed on before the symmetric buffer's collective allocation). */
static comet_status_t alloc_private(comet_layer_t *l, cuda_layer_t *L) {
    const comet_dims_t *d = &l->dims;
    const int rank = l->rank, w = d->world_size;
    comet_cuda_ctx_t *c = &L->ctx;
    size_t bytes[CUDA_NUM_BUFFERS];
    buffer_sizes(d, split_bytes(l, L), bytes);
    void **bufs[CUDA_NUM_BUFFERS] = {(void **)&L->buf.state, (void **)&L->buf.a, (void **)&L->buf.h,
                                     (void **)&L->buf.scratch, (void **)&L->buf.block_ready, (void **)&L->buf.routes,
                                     &L->buf.plan_scratch};
    for (int i = 0; i < CUDA_NUM_BUFFERS; i++) {
        cudaError_t e = cudaMalloc(bufs[i], bytes[i] ? bytes[i] : 1);
        if (e != cudaSuccess)
            return comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: cudaMalloc of the layer's buffers: %s", rank,
                              cudaGetErrorString(e));
        L->private_bytes += bytes[i];
    }
    c->state = L->buf.state;
    c->a = L->buf.a, c->h = L->buf.h;
    L->gemm_split = bytes[3] > 256 ? L->buf.scratch + 256 : NULL;
    c->train_sched = (uint32_t *)L->buf.scratch + 24;
    c->block_ready = L->buf.block_ready;
    c->block_rows = (uint32_t *)(c->block_ready + d->max_blocks);
    c->plan_scratch = L->buf.plan_scratch;
    if (l->world->settings.graph_replay) { /* replay.c */
        cudaError_t e = cudaSuccess;
        L->replay = comet_cuda_replay_create(&e);
        if (!L->replay) return cuda_fail(rank, e, "the replay cache's capture stream");
    }
    CUDA_TRY(rank, cudaEventCreateWithFlags(&L->order_ev, cudaEventDisableTiming));
    CUDA_TRY(rank, cudaHostAlloc((void **)&L->gemm_report, 8 * sizeof(uint64_t), cudaHostAllocMapped));
    memset(L->gemm_report, 0, 8 * sizeof(uint64_t));
    CUDA_TRY(rank, cudaHostGetDevicePointer((void **)&c->gemm_report, L->gemm_report, 0));
    CUDA_TRY(rank, (cudaError_t)comet_cuda_layer_warm());
    if (w > 1) { /* the symmetric buffer next is a collective: one rank failing it alone would hang the others */
        size_t free_b = 0, total_b = 0;
        CUDA_TRY(rank, cudaMemGetInfo(&free_b, &total_b));
        const size_t need = c->lay.total + ((size_t)64 << 20); /* its allocation granularity, and a margin */
        if (free_b < need)
            return comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: %zu MiB free on the GPU, the symmetric buffer needs %zu MiB",
                              rank, free_b >> 20, need >> 20);
    }
    return COMET_SUCCESS;
}

/* Buffers of one rank's layer and its device state; on failure everything
 * taken is given back (one path). The ranks agree after the private
 * buffers and again at the end, so a failure on one rank fails all. */
static comet_status_t layer_init(comet_layer_t *l, cuda_layer_t *L) {
    const comet_dims_t *d = &l->dims;
    const int rank = l->rank, w = d->world_size;
    comet_cuda_ctx_t *c = &L->ctx;
    c->d = *d;
    sym_layout(d, L->base.combine == COMET_COMBINE_PUSH, &c->lay);
    if (L->comm && l->world->local_rank >= 0) /* processes agree through NCCL (a failure here still hangs them) */
        CUDA_TRY(rank, cudaMalloc((void **)&L->agree, sizeof(int)));
    COMET_TRY(agree_ranks(l, L, alloc_private(l, L)));
    if (w > 1) {
        COMET_TRY(comet_comm_alloc_symmetric(L->comm, c->lay.total, &L->sym));
        c->sym = L->sym.local;
        for (int q = 0; q < w; q++) c->peers[q] = (char *)L->sym.peers_host[q];
    } else {
        CUDA_TRY(rank, cudaMalloc(&L->sym_single, c->lay.total));
        c->sym = c->peers[0] = (char *)L->sym_single;
    }
    c->plan_ws = c->sym + c->lay.plan; /* peers read my plan's row_of_slot and my o */
    c->o = (comet_bf16_t *)(c->sym + c->lay.o);
    c->timeout_ns = (uint64_t)l->world->settings.timeout_ms * 1000000ull;
    cudaDeviceGetAttribute(&c->num_sms, cudaDevAttrMultiProcessorCount, L->device);
    return agree_ranks(l, L, init_device_state(l, L, rank));
}

static comet_status_t cuda_layer_create(comet_layer_t *l) {
    const int rank = l->rank;
    cuda_layer_t *L = calloc(1, sizeof *L);
    if (!L) {
        const comet_status_t st = comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: no memory", rank);
        cuda_layer_create_failed(l->world, rank);
        return st;
    }
    L->device = device_of(l->world, rank);
    cudaError_t e = cudaSetDevice(L->device);
    comet_status_t st = e == cudaSuccess ? COMET_SUCCESS : cuda_fail(rank, e, "cudaSetDevice");
    int major = 0;
    if (st == COMET_SUCCESS) cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, L->device);
    const comet_protocol_t none = COMET_PROTOCOL_INIT;
    L->base = none;
    L->base.gemm = major == 9 && comet_gemm_check(&l->dims) == NULL && !l->knobs.force_simt ? COMET_GEMM_HOPPER
                                                                                             : COMET_GEMM_SIMT;
    L->base.combine = comet_tuner_combine(&l->dims, COMET_BACKEND_CUDA, L->base.gemm, l->knobs.force_pull);
    const int w = l->dims.world_size;
    if (st != COMET_SUCCESS) cuda_layer_create_failed(l->world, rank); /* meet the peers where join_ranks would */
    const int joined = st == COMET_SUCCESS && w > 1 &&
                       (st = join_ranks(l, (int)L->base.combine, &L->comm)) == COMET_SUCCESS;
    if (st == COMET_SUCCESS) st = layer_init(l, L);
    if (st != COMET_SUCCESS) {
        char msg[1024]; /* the clean-up's own failures must not replace the reason */
        snprintf(msg, sizeof msg, "%s", comet_last_error());
        free_all(L);
        if (joined) leave_ranks(l->world, rank);
        return comet_fail_copy(st, msg);
    }
    l->backend_state = L;
    return COMET_SUCCESS;
}

static void cuda_layer_destroy(comet_layer_t *l) {
    cuda_layer_t *L = l->backend_state;
    if (!L) return;
    cudaSetDevice(L->device);
    cudaDeviceSynchronize(); /* the caller's stream may be gone already */
    barrier(L, l->rank); /* no rank frees memory a peer may still read */
    const int shared_comm = L->comm != NULL;
    free_all(L);
    if (shared_comm) leave_ranks(l->world, l->rank);
    l->backend_state = NULL;
}

/* A layer's calls run in the order they were made, whatever streams they
 * come on (a pipeline schedule puts a micro-batch's backward and the next
 * one's forward on different streams): a call on another stream than the
 * last waits for the last one's end. Not across a capture (the capture
 * orders its own work; an event from outside cannot join it). after: 0
 * before the call's launch, 1 after it. */
static cudaError_t order_calls(cuda_layer_t *L, cudaStream_t s, int after) {
    enum cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    cudaError_t e = cudaStreamIsCapturing(s, &cap);
    if (e != cudaSuccess) return e;
    if (after) {
        L->order_live = cap == cudaStreamCaptureStatusNone;
        return L->order_live ? cudaEventRecord(L->order_ev, s) : cudaSuccess;
    }
    if (!L->order_live || s == L->last_stream || cap != cudaStreamCaptureStatusNone) return cudaSuccess;
    return cudaStreamWaitEvent(s, L->order_ev, 0);
}

/* The Hopper GEMM for the call's weights (c->w1, c->w2), or NULL: the SIMT
 * tiles run (not sm_90, shapes it does not take, or its prepare failed).
 * Tensor maps name the weights: made again (host only, no sync) when they
 * move. */
static void *prepare_gemm(comet_layer_t *l, cuda_layer_t *L, const comet_cuda_ctx_t *c) {
    if (L->base.gemm != COMET_GEMM_HOPPER) return NULL;
    if (!L->gemm || L->gemm_w1 != c->w1 || L->gemm_w2 != c->w2) {
        /* the tile counters live in the layer's scratch, so preparing makes no
         * CUDA call on a stream (a forward may be captured in a graph) */
        comet_gemm_args_t ga = {l->dims, c->plan_ws, c->a, c->w1, c->h, c->w2, c->o, {NULL},
                                (uint32_t *)L->buf.scratch + 16, L->gemm_split, l->knobs.gemm};
        for (int q = 0; L->base.combine == COMET_COMBINE_PUSH && q < l->dims.world_size; q++) /* rank q's receive buffer */
            if (q != l->rank) ga.push[q] = (comet_bf16_t *)(c->peers[q] + c->lay.recv);
        char err[256];
        comet_gemm_destroy(L->gemm);
        L->gemm = NULL;
        /* on failure the SIMT tiles run: returning here would strand the peers; the reason
         * is kept for comet_layer_sync's report */
        L->gemm_error[0] = 0;
        if (comet_gemm_prepare(&ga, &L->gemm, err, sizeof err) != 0) {
            L->gemm = NULL;
            snprintf(L->gemm_error, sizeof L->gemm_error, "%s", err);
        }
        L->gemm_w1 = c->w1, L->gemm_w2 = c->w2;
    }
    return L->gemm;
}

/* The training buffers (cuda_layer.h: dh, dwp), made by the first call
 * that needs them. */
static comet_status_t ensure_training(comet_layer_t *l, cuda_layer_t *L) {
    comet_cuda_ctx_t *c = &L->ctx;
    if (c->dh) return COMET_SUCCESS;
    const comet_dims_t *d = &l->dims;
    const size_t dh = (size_t)d->max_rows_padded * (size_t)d->w1_rows * 2;
    const size_t dwp = (size_t)d->max_rows_padded * (size_t)((d->ffn_local + 63) / 64) * 4;
    cudaError_t e = cudaMalloc((void **)&c->dh, dh);
    if (e == cudaSuccess) e = cudaMalloc((void **)&c->dwp, dwp);
    if (e != cudaSuccess) {
        cudaFree(c->dh);
        c->dh = NULL;
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: cudaMalloc of the training buffers (%zu MiB): %s",
                          l->rank, (dh + dwp) >> 20, cudaGetErrorString(e));
    }
    L->private_bytes += dh + dwp;
    return COMET_SUCCESS;
}

/* The Hopper backward's recompute buffer (cuda_layer.h: gu), made by the
 * first backward that recomputes on the Hopper GEMM. */
static comet_status_t ensure_recompute(comet_layer_t *l, cuda_layer_t *L) {
    comet_cuda_ctx_t *c = &L->ctx;
    if (c->gu) return COMET_SUCCESS;
    const size_t bytes = (size_t)l->dims.max_rows_padded * (size_t)l->dims.w1_rows * 2;
    const cudaError_t e = cudaMalloc((void **)&c->gu, bytes);
    if (e != cudaSuccess) {
        c->gu = NULL;
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: cudaMalloc of the recompute buffer (%zu MiB): %s", l->rank,
                          bytes >> 20, cudaGetErrorString(e));
    }
    L->private_bytes += bytes;
    return COMET_SUCCESS;
}

static comet_status_t cuda_layer_forward(comet_layer_t *l, const comet_forward_args_t *args) {
    cuda_layer_t *L = l->backend_state;
    int64_t t = 0;
    comet_status_t own = comet_check_forward_args(&l->dims, args, 0, &t);
    if (own == COMET_SUCCESS && args->save == COMET_SAVE_ACTIVATIONS) own = ensure_training(l, L);
    comet_cuda_ctx_t c;
    memcpy(&c, &L->ctx, sizeof c); /* padding too: replay.c compares contexts bytewise */
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", comet_last_error());
    comet_cuda_call_t call;
    memset(&call, 0, sizeof call);
    call.host_status = (uint32_t)own;
    void *stream = NULL;
    if (own == COMET_SUCCESS) {
        call.x = args->x.data, call.topk_idx = args->topk_idx.data, call.topk_w = args->topk_w.data;
        call.y = args->y.data, call.num_tokens = t;
        call.layer_id = l->id;
        if (args->save == COMET_SAVE_ACTIVATIONS) { /* k_stage clears the header; k_save_header writes it */
            call.save = args->save, call.saved = args->saved.data;
            c.store_gu = args->disable == 0; /* a measurement saves nothing */
        }
        c.w1 = args->w1.data, c.w2 = args->w2.data;
        stream = args->stream;
    } else if (args && args->struct_size == sizeof(comet_forward_args_t)) {
        stream = args->stream;
    }
    /* Even a rank whose arguments failed runs the protocol steps, so its
     * peers learn of the failure instead of waiting for it. */
    CUDA_TRY(l->rank, cudaSetDevice(L->device));
    CUDA_TRY(l->rank, order_calls(L, (cudaStream_t)stream, 0));
    comet_protocol_t proto = L->base;
    if (own == COMET_SUCCESS) c.gemm = prepare_gemm(l, L, &c);
    /* without the Hopper GEMM (or where its prepare failed: returning would strand the peers) the
     * SIMT tiles run, and they pull */
    if (!c.gemm) proto.gemm = COMET_GEMM_SIMT, proto.combine = COMET_COMBINE_PULL;
    /* the tuner's protocol (its table, else its rule) unless n_comm fixed it; the overlapped mode is
     * chosen for max_tokens, so the same on every rank */
    if (own == COMET_SUCCESS) comet_tuner_choose(l->world->tune, &l->dims, COMET_BACKEND_CUDA, t, args->n_comm, 0, &proto);
    if (c.gemm) {
        c.n_comm = proto.n_comm < c.num_sms - 1 ? proto.n_comm : c.num_sms - 1;
        proto.n_comm = c.n_comm;
        c.push = proto.combine == COMET_COMBINE_PUSH;
        c.disable = args->disable; /* both chains honour it with the Hopper GEMM */
        if (c.store_gu) c.saved = (unsigned char *)args->saved.data; /* GEMM0 stores gu and h there */
    }
    c.protocol = comet_cuda_protocol_word(&proto, 0);
    if (L->trace) {
        c.tr_events = L->tr_events, c.tr_counts = L->tr_counts, c.tr_capacity = (uint32_t)L->trace->capacity;
        CUDA_TRY(l->rank, cudaMemsetAsync(L->tr_counts, 0, COMET_CUDA_TRACE_LANES * sizeof(uint32_t),
                                          (cudaStream_t)stream));
    }
    /* replayed as a graph where replay.c can (tracing keeps the direct launches: its marks are kernels too) */
    int replayed = 0;
    int e = L->replay && own == COMET_SUCCESS && c.gemm && !L->trace
                ? comet_cuda_replay_launch(L->replay, &c, &call, (cudaStream_t)stream, &replayed)
                : comet_cuda_forward_launch(&c, &call, stream);
    if (e != cudaSuccess) return cuda_fail(l->rank, (cudaError_t)e, "launching the forward");
    CUDA_TRY(l->rank, order_calls(L, (cudaStream_t)stream, 1));
    L->last_stream = stream;
    proto.graph_replay = replayed;
    if (own == COMET_SUCCESS) l->protocol = proto, l->has_run = 1;
    l->replays += replayed;
    l->captures = comet_cuda_replay_captures(L->replay);
    if (own != COMET_SUCCESS) return comet_fail_copy(own, msg);
    return COMET_SUCCESS;
}

/* The backward: the sequential chain (layer_chain.cu's backward_chain) with
 * the forward's GEMM kind and combine; launched directly, never replayed. */
static comet_status_t cuda_layer_backward(comet_layer_t *l, const comet_backward_args_t *args) {
    cuda_layer_t *L = l->backend_state;
    int64_t t = 0;
    comet_status_t own = comet_check_backward_args(&l->dims, args, 0, &t);
    /* the weight gradients are stored through tensor maps (gemm_wgrad.h) */
    if (own == COMET_SUCCESS && ((uintptr_t)args->dw1.data % 16 || (uintptr_t)args->dw2.data % 16))
        own = comet_fail(COMET_ERR_INVALID_ARGUMENT, "rank %d: dw1.data %p and dw2.data %p must be 16-byte aligned",
                         l->rank, args->dw1.data, args->dw2.data);
    if (own == COMET_SUCCESS) own = ensure_training(l, L);
    if (own == COMET_SUCCESS && args->save != COMET_SAVE_ACTIVATIONS && L->base.gemm == COMET_GEMM_HOPPER)
        own = ensure_recompute(l, L);
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", comet_last_error());
    comet_cuda_ctx_t c;
    memcpy(&c, &L->ctx, sizeof c);
    comet_cuda_call_t call;
    memset(&call, 0, sizeof call);
    call.host_status = (uint32_t)own;
    call.pass = 1;
    void *stream = NULL;
    if (own == COMET_SUCCESS) {
        call.x = args->x.data, call.topk_idx = args->topk_idx.data, call.topk_w = args->topk_w.data;
        call.y = args->dx.data, call.num_tokens = t;
        call.dy = args->dy.data, call.d_topk_w = args->d_topk_w.data;
        call.dw1 = args->dw1.data, call.dw2 = args->dw2.data;
        call.accumulate = args->accumulate;
        call.wgrad_fp32 = (args->dw2.dtype == COMET_DTYPE_FP32) | (args->dw1.dtype == COMET_DTYPE_FP32) << 1;
        call.layer_id = l->id;
        call.save = args->save == COMET_SAVE_ACTIVATIONS ? COMET_SAVE_ACTIVATIONS : COMET_SAVE_RECOMPUTE;
        call.saved = args->save == COMET_SAVE_ACTIVATIONS ? args->saved.data : NULL;
        c.store_gu = call.save != COMET_SAVE_ACTIVATIONS; /* recompute gu and h */
        c.w1 = args->w1.data, c.w2 = args->w2.data;
        stream = args->stream;
    } else if (args && args->struct_size == sizeof(comet_backward_args_t)) {
        stream = args->stream;
    }
    CUDA_TRY(l->rank, cudaSetDevice(L->device));
    CUDA_TRY(l->rank, order_calls(L, (cudaStream_t)stream, 0));
    comet_protocol_t proto = L->base;
    c.gemm = own == COMET_SUCCESS ? prepare_gemm(l, L, &c) : NULL;
    char err[256];
    if (c.gemm && comet_cuda_wgrad_prepare(&c, &call, c.wgrad, err, sizeof err) != 0) {
        /* this rank's failure: only the protocol steps run (the peers learn of it) */
        own = comet_fail(COMET_ERR_INVALID_ARGUMENT, "rank %d: the weight gradients' GEMM: %s", l->rank, err);
        snprintf(msg, sizeof msg, "%s", comet_last_error());
        call.host_status = (uint32_t)own;
        c.gemm = NULL;
    }
    if (!c.gemm) proto.gemm = COMET_GEMM_SIMT, proto.combine = COMET_COMBINE_PULL;
    proto.mode = COMET_MODE_SEQUENTIAL, proto.n_comm = 0, proto.chunk_cols = 0;
    proto.chosen_by = own == COMET_SUCCESS && args->n_comm != 0 ? COMET_CHOSEN_BY_ARGS : COMET_CHOSEN_BY_RULE;
    c.n_comm = 0, c.push = proto.combine == COMET_COMBINE_PUSH;
    c.disable = c.gemm && own == COMET_SUCCESS ? args->disable : 0; /* honoured with the Hopper GEMM, as the forward's */
    /* traced: the backward's events follow the last forward's (which cleared the counts), so a
     * training step's trace holds both */
    c.tr_events = NULL, c.tr_counts = NULL, c.tr_capacity = 0;
    if (L->trace) c.tr_events = L->tr_events, c.tr_counts = L->tr_counts, c.tr_capacity = (uint32_t)L->trace->capacity;
    c.protocol = comet_cuda_protocol_word(&proto, 1);
    const int e = comet_cuda_backward_launch(&c, &call, stream);
    comet_cuda_wgrad_destroy(c.wgrad); /* their maps went with the launches */
    if (e != cudaSuccess) return cuda_fail(l->rank, (cudaError_t)e, "launching the backward");
    CUDA_TRY(l->rank, order_calls(L, (cudaStream_t)stream, 1));
    L->last_stream = stream;
    if (own == COMET_SUCCESS) l->protocol = proto, l->has_run = 1;
    if (own != COMET_SUCCESS) return comet_fail_copy(own, msg);
    return COMET_SUCCESS;
}

static void cuda_layer_memory(const comet_layer_t *l, comet_memory_t *out) {
    const cuda_layer_t *L = l->backend_state;
    out->symmetric_bytes = L->ctx.lay.total;
    out->private_bytes = L->private_bytes;
}

static comet_status_t cuda_layer_set_trace(comet_layer_t *l, comet_trace_t *t) {
    cuda_layer_t *L = l->backend_state;
    CUDA_TRY(l->rank, cudaSetDevice(L->device));
    cudaFree(L->tr_events), cudaFree(L->tr_counts);
    L->tr_events = NULL, L->tr_counts = NULL, L->trace = NULL;
    if (!t) return COMET_SUCCESS;
    if (t->lanes < COMET_CUDA_TRACE_LANES || l->rank >= t->ranks || t->capacity > UINT32_MAX)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "rank %d: the CUDA backend traces into %d lanes per rank of %d "
                          "ranks; the recorder has %d lanes, %d ranks", l->rank, COMET_CUDA_TRACE_LANES,
                          l->dims.world_size, t->lanes, t->ranks);
    CUDA_TRY(l->rank, cudaMalloc(&L->tr_events, (size_t)COMET_CUDA_TRACE_LANES * (size_t)t->capacity *
                                                    sizeof(comet_trace_event_t)));
    CUDA_TRY(l->rank, cudaMalloc((void **)&L->tr_counts, COMET_CUDA_TRACE_LANES * sizeof(uint32_t)));
    L->trace = t;
    comet_trace_set_layout(t, l->rank, COMET_TRACE_LAYOUT_CUDA);
    return COMET_SUCCESS;
}

/* The last forward's events (and the backward's after it) into this rank's
 * lanes of the recorder. */
static comet_status_t trace_collect(comet_layer_t *l) {
    cuda_layer_t *L = l->backend_state;
    comet_trace_t *t = L->trace;
    uint32_t counts[COMET_CUDA_TRACE_LANES];
    CUDA_TRY(l->rank, cudaMemcpy(counts, L->tr_counts, sizeof counts, cudaMemcpyDeviceToHost));
    for (int lane = 0; lane < COMET_CUDA_TRACE_LANES; lane++) {
        const size_t slot = (size_t)l->rank * (size_t)t->lanes + (size_t)lane;
        const size_t kept = counts[lane] < t->capacity ? counts[lane] : (size_t)t->capacity;
        CUDA_TRY(l->rank, cudaMemcpy(comet_trace_buffer(t) + slot * (size_t)t->capacity,
                                     (const comet_trace_event_t *)L->tr_events + (size_t)lane * (size_t)t->capacity,
                                     kept * sizeof(comet_trace_event_t), cudaMemcpyDeviceToHost));
        comet_trace_counts(t)[slot] = counts[lane];
    }
    return COMET_SUCCESS;
}

static comet_status_t cuda_layer_sync(comet_layer_t *l) {
    cuda_layer_t *L = l->backend_state;
    CUDA_TRY(l->rank, cudaSetDevice(L->device));
    const cudaError_t se = cudaStreamSynchronize(L->last_stream);
    char why[320];
    if (se != cudaSuccess && comet_gemm_timeout_message(L->gemm_report, why, sizeof why)) /* GEMM0 trapped */
        return comet_fail(COMET_ERR_TIMEOUT, "rank %d: %s (%s)", l->rank, why, cudaGetErrorString(se));
    if (se != cudaSuccess) return cuda_fail(l->rank, se, "cudaStreamSynchronize");
    if (L->trace) COMET_TRY(trace_collect(l));
    uint32_t st = 0;
    CUDA_TRY(l->rank, cudaMemcpy(&st, &L->ctx.state->last_status, sizeof st, cudaMemcpyDeviceToHost));
    if (st == COMET_ERR_INVALID_ROUTING)
        return comet_fail(COMET_ERR_INVALID_ROUTING,
                          "rank %d: topk_idx has an expert id outside [0, %lld) or repeated in a row", l->rank,
                          (long long)l->dims.num_experts);
    if (st == COMET_ERR_PEER_FAILED)
        return comet_fail(COMET_ERR_PEER_FAILED, "rank %d: another rank's input was invalid; nothing was written",
                          l->rank);
    if (st == COMET_ERR_INVALID_ARGUMENT) /* this rank's arguments (forward said so), or: */
        return comet_fail(COMET_ERR_INVALID_ARGUMENT,
                          "rank %d: invalid arguments (or saved state another layer or forward wrote), or the "
                          "ranks ran different protocols (a forward beside a backward; sequential or "
                          "overlapped, push or pull combine): n_comm and the tune file must agree on every rank; "
                          "nothing was written%s%s",
                          l->rank, L->gemm_error[0] ? "; this rank runs the SIMT tiles, its Hopper GEMM: " : "",
                          L->gemm_error);
    if (st != COMET_SUCCESS)
        return comet_fail((comet_status_t)st, "rank %d: the last call failed (%s)", l->rank,
                          comet_status_string((comet_status_t)st));
    return COMET_SUCCESS;
}

const comet_backend_ops_t comet_cuda_ops = {
    .name = "cuda",
    .device_count = cuda_device_count,
    .world_init = cuda_world_init,
    .world_destroy = cuda_world_destroy,
    .world_device = cuda_world_device,
    .unique_id = cuda_unique_id,
    .layer_create = cuda_layer_create,
    .layer_create_failed = cuda_layer_create_failed,
    .layer_destroy = cuda_layer_destroy,
    .layer_forward = cuda_layer_forward,
    .layer_backward = cuda_layer_backward,
    .layer_sync = cuda_layer_sync,
    .layer_memory = cuda_layer_memory,
    .layer_set_trace = cuda_layer_set_trace,
};
