/*
 * replay.c - the layer's forward chain (comet_cuda_forward_launch: ~11
 * kernels) captured once as a CUDA graph and replayed call after call.
 *
 * Why: launched one by one, the chain's small kernels (enter, stage, plan,
 * routing copy, the plan builder's two, dispatch, combine, exit) wait for
 * the host to submit them; a forward timed from an idle stream paid 11-47
 * us more than the same forward as a graph (2x H200, comet bench --graph,
 * Qwen2 and Phi-3.5, dcf6fff).
 *
 * How: a call's tensors (comet_cuda_call_t) reach the device through
 * k_enter's parameters alone; every other kernel reads them from the
 * layer's state (but a saving forward's saved state, which GEMM0's tensor
 * maps address: it is in the context). So the chain is a function of the
 * context (protocol, n_comm, disable bits, weights, buffers, saved state: the key, compared
 * bytewise, key_of), captured once per context on this cache's own stream
 * (thread-local capture mode: the other ranks' threads go on) and
 * instantiated; each call then sets the k_enter node's parameters
 * (cudaGraphExecKernelNodeSetParams: one node, whatever the chain holds)
 * and launches the graph on the caller's stream.
 *
 * Not replayed (launched directly, as before): a caller's stream that is
 * being captured (the caller's graph takes the launches), a context whose
 * capture or instantiation failed (remembered), misses after
 * REPLAY_MAX_CAPTURES captures (a layer whose weights move call after call
 * would capture every call), and what backend.c keeps out (tracing, a call
 * whose arguments failed the host checks, the SIMT GEMM, graph replay off
 * in the world's options).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "replay.h"

#define REPLAY_SLOTS 8         /* contexts kept (comet bench --comm-hidden interleaves 4), least recent reused */
#define REPLAY_MAX_CAPTURES 64 /* then a miss launches directly */

typedef struct {
    int used;   /* 0: free */
    int failed; /* the capture or instantiation failed: this context runs directly */
    uint64_t stamp;
    comet_cuda_ctx_t key;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cudaGraphNode_t enter;                /* the k_enter node */
    struct cudaKernelNodeParams enter_kp; /* as captured; kernelParams replaced at each call */
} replay_slot_t;

struct comet_cuda_replay {
    cudaStream_t cap;
    uint64_t clock;
    long long captures;
    replay_slot_t slot[REPLAY_SLOTS];
};

comet_cuda_replay_t *comet_cuda_replay_create(cudaError_t *err) {
    comet_cuda_replay_t *r = calloc(1, sizeof *r);
    *err = r ? cudaStreamCreateWithFlags(&r->cap, cudaStreamNonBlocking) : cudaErrorMemoryAllocation;
    if (*err != cudaSuccess) {
        free(r);
        return NULL;
    }
    return r;
}

/* The slot's graph and exec, if any, destroyed (its key and flags kept). */
static void slot_drop_graph(replay_slot_t *s) {
    if (s->exec) cudaGraphExecDestroy(s->exec), s->exec = NULL;
    if (s->graph) cudaGraphDestroy(s->graph), s->graph = NULL;
}

static void slot_release(replay_slot_t *s) {
    slot_drop_graph(s);
    memset(s, 0, sizeof *s);
}

void comet_cuda_replay_destroy(comet_cuda_replay_t *r) {
    if (!r) return;
    for (int i = 0; i < REPLAY_SLOTS; i++) slot_release(&r->slot[i]);
    cudaStreamDestroy(r->cap);
    free(r);
}

long long comet_cuda_replay_captures(const comet_cuda_replay_t *r) { return r ? r->captures : 0; }

/* The key of a context: its bytes, with the host's GEMM object reduced to
 * whether there is one (the kernels test no more; the captured GEMM nodes
 * depend on the weights, which the key holds), so weights that come back
 * after a re-prepare find their chain. */
static void key_of(const comet_cuda_ctx_t *c, comet_cuda_ctx_t *k) {
    memcpy(k, c, sizeof *k);
    k->gemm = c->gemm ? (void *)1 : NULL;
}

/* Capture ctx's chain (with this call's tensors) into s: graph, exec and
 * its one k_enter node. */
static cudaError_t capture(comet_cuda_replay_t *r, replay_slot_t *s, const comet_cuda_ctx_t *c,
                           const comet_cuda_call_t *call) {
    cudaError_t e = cudaStreamBeginCapture(r->cap, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) return e;
    const cudaError_t le = (cudaError_t)comet_cuda_forward_launch(c, call, r->cap);
    e = cudaStreamEndCapture(r->cap, &s->graph); /* ends the capture on errors too */
    if (le != cudaSuccess) return le;
    if (e != cudaSuccess) return e;
    size_t num = 0;
    if ((e = cudaGraphGetNodes(s->graph, NULL, &num)) != cudaSuccess) return e;
    cudaGraphNode_t *nodes = malloc((num ? num : 1) * sizeof *nodes);
    if (!nodes) return cudaErrorMemoryAllocation;
    e = cudaGraphGetNodes(s->graph, nodes, &num);
    int enters = 0;
    for (size_t i = 0; e == cudaSuccess && i < num; i++) {
        enum cudaGraphNodeType type;
        if ((e = cudaGraphNodeGetType(nodes[i], &type)) != cudaSuccess || type != cudaGraphNodeTypeKernel) continue;
        struct cudaKernelNodeParams kp;
        if ((e = cudaGraphKernelNodeGetParams(nodes[i], &kp)) != cudaSuccess || kp.func != comet_cuda_enter_kernel())
            continue;
        s->enter = nodes[i], s->enter_kp = kp;
        enters++;
    }
    free(nodes);
    if (e == cudaSuccess && enters != 1) e = cudaErrorNotSupported; /* the call could not reach the chain */
    if (e == cudaSuccess) e = cudaGraphInstantiate(&s->exec, s->graph, 0);
    return e;
}

/* The slot for c: its own, else (below REPLAY_MAX_CAPTURES) a free or the
 * least recent one, captured; NULL: launch directly. */
static replay_slot_t *slot_for(comet_cuda_replay_t *r, const comet_cuda_ctx_t *c, const comet_cuda_call_t *call) {
    comet_cuda_ctx_t key;
    key_of(c, &key);
    replay_slot_t *s = NULL;
    for (int i = 0; i < REPLAY_SLOTS && !s; i++)
        if (r->slot[i].used && memcmp(&r->slot[i].key, &key, sizeof key) == 0) s = &r->slot[i];
    if (!s) {
        if (r->captures >= REPLAY_MAX_CAPTURES) return NULL;
        s = &r->slot[0];
        for (int i = 1; i < REPLAY_SLOTS && s->used; i++)
            if (!r->slot[i].used || r->slot[i].stamp < s->stamp) s = &r->slot[i];
        slot_release(s);
        s->used = 1;
        s->key = key;
        r->captures++;
        if (capture(r, s, c, call) != cudaSuccess) {
            cudaGetLastError(); /* the capture's own error, not sticky: cleared before the direct launches */
            slot_drop_graph(s); /* the slot keeps its key, marked failed: this context runs directly */
            s->failed = 1;
        }
    }
    s->stamp = ++r->clock;
    return s->failed ? NULL : s;
}

int comet_cuda_replay_launch(comet_cuda_replay_t *r, const comet_cuda_ctx_t *c, const comet_cuda_call_t *call,
                             cudaStream_t stream, int *replayed) {
    *replayed = 0;
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaError_t e = cudaStreamIsCapturing(stream, &cs);
    if (e != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
        if (e != cudaSuccess) cudaGetLastError();
        return comet_cuda_forward_launch(c, call, stream);
    }
    replay_slot_t *s = slot_for(r, c, call);
    if (!s) return comet_cuda_forward_launch(c, call, stream);
    void *args[2] = {(void *)c, (void *)call};
    struct cudaKernelNodeParams kp = s->enter_kp;
    kp.kernelParams = args, kp.extra = NULL;
    e = cudaGraphExecKernelNodeSetParams(s->exec, s->enter, &kp);
    if (e == cudaSuccess) e = cudaGraphLaunch(s->exec, stream);
    if (e == cudaSuccess) {
        *replayed = 1;
        return cudaSuccess;
    }
    /* nothing of this call was enqueued: the direct launches still run the protocol the peers wait
     * for, and so will this context's later calls (a failure here would recur) */
    cudaGetLastError();
    s->failed = 1;
    return comet_cuda_forward_launch(c, call, stream);
}
