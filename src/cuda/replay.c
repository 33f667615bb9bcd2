/*
 * replay.c - the layer's forward chain (comet_cuda_forward_launch: ~11
 * kernels) captured once as a CUDA graph and replayed call after call.
 *
 * Why: launched one by one, the chain's small kernels (enter, stage, plan,
 * routing copy, the plan builder's two, dispatch, combine, exit) wait for
 * the host to submit them; a forward timed from an idle stream paid 11-47
 * us more than the same forward as a graph (2x H200, comet bench --graph,
 * Qwen2 and Phi-3.5, dcf6fff). A replay costs one graph launch plus one
 * parameter update per layer kernel.
 *
 * How: the key of a chain is the call's context with the call's tensors
 * (x, topk_idx, topk_w, y, num_tokens, host_status) cleared: everything
 * else -- protocol, n_comm, chunk width, disable bits, weights, buffers --
 * is fixed in the captured launches (the GEMMs' tensor maps name the
 * weights, so the weights are part of the key). A miss captures the chain
 * on this cache's own stream (thread-local capture mode: other ranks'
 * threads go on) and instantiates it; each call then gives every node of
 * a kernel whose one parameter is the context (comet_cuda_ctx_kernel) this
 * call's context, and launches the graph on the caller's stream. The
 * GEMM and plan-builder nodes read only the layer's own buffers.
 *
 * Not replayed (launched directly, as before): a caller's stream that is
 * being captured (the caller's graph takes the launches), a protocol that
 * failed to capture or instantiate (remembered), and what backend.c keeps
 * out (tracing, a call whose arguments failed the host checks, the SIMT
 * GEMM, COMET_REPLAY=0 at layer create).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "replay.h"

#define REPLAY_SLOTS 8  /* protocols kept (comet bench --comm-hidden interleaves 4), least recent reused */
#define REPLAY_NODES 32 /* context kernels in one chain (it has at most 10) */

typedef struct {
    int used;     /* 0: free */
    int failed;   /* the capture or instantiation failed: this protocol runs directly */
    uint64_t stamp;
    comet_cuda_ctx_t key;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    int n;
    cudaGraphNode_t node[REPLAY_NODES];
    struct cudaKernelNodeParams params[REPLAY_NODES]; /* as captured; kernelParams replaced at each call */
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

static void slot_release(replay_slot_t *s) {
    if (s->exec) cudaGraphExecDestroy(s->exec);
    if (s->graph) cudaGraphDestroy(s->graph);
    memset(s, 0, sizeof *s);
}

void comet_cuda_replay_destroy(comet_cuda_replay_t *r) {
    if (!r) return;
    for (int i = 0; i < REPLAY_SLOTS; i++) slot_release(&r->slot[i]);
    cudaStreamDestroy(r->cap);
    free(r);
}

/* The context without this call's tensors. The bytes are compared whole,
 * padding included: backend.c memcpys every call's context from the
 * layer's (calloc'd), so its padding is the same from call to call. */
static void key_of(const comet_cuda_ctx_t *c, comet_cuda_ctx_t *k) {
    memcpy(k, c, sizeof *k);
    k->x = NULL, k->topk_idx = NULL, k->topk_w = NULL, k->y = NULL;
    k->num_tokens = 0, k->host_status = 0;
}

/* Capture c's chain into s (graph, exec, the context kernels' nodes). */
static cudaError_t capture(comet_cuda_replay_t *r, replay_slot_t *s, const comet_cuda_ctx_t *c) {
    cudaError_t e = cudaStreamBeginCapture(r->cap, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) return e;
    const cudaError_t le = (cudaError_t)comet_cuda_forward_launch(c, r->cap);
    e = cudaStreamEndCapture(r->cap, &s->graph); /* ends the capture on errors too */
    if (le != cudaSuccess) return le;
    if (e != cudaSuccess) return e;
    size_t num = 0;
    if ((e = cudaGraphGetNodes(s->graph, NULL, &num)) != cudaSuccess) return e;
    cudaGraphNode_t *nodes = malloc((num ? num : 1) * sizeof *nodes);
    if (!nodes) return cudaErrorMemoryAllocation;
    e = cudaGraphGetNodes(s->graph, nodes, &num);
    for (size_t i = 0; e == cudaSuccess && i < num; i++) {
        enum cudaGraphNodeType type;
        if ((e = cudaGraphNodeGetType(nodes[i], &type)) != cudaSuccess || type != cudaGraphNodeTypeKernel) continue;
        struct cudaKernelNodeParams kp;
        if ((e = cudaGraphKernelNodeGetParams(nodes[i], &kp)) != cudaSuccess || !comet_cuda_ctx_kernel(kp.func)) continue;
        if (s->n == REPLAY_NODES) {
            e = cudaErrorNotSupported;
            break;
        }
        s->node[s->n] = nodes[i], s->params[s->n] = kp;
        s->n++;
    }
    free(nodes);
    if (e == cudaSuccess) e = cudaGraphInstantiate(&s->exec, s->graph, 0);
    return e;
}

/* The slot for key: its own, else a free or the least recent one, captured. */
static replay_slot_t *slot_for(comet_cuda_replay_t *r, const comet_cuda_ctx_t *key, const comet_cuda_ctx_t *c) {
    replay_slot_t *s = NULL;
    for (int i = 0; i < REPLAY_SLOTS && !s; i++)
        if (r->slot[i].used && memcmp(&r->slot[i].key, key, sizeof *key) == 0) s = &r->slot[i];
    if (!s) {
        s = &r->slot[0];
        for (int i = 1; i < REPLAY_SLOTS && s->used; i++)
            if (!r->slot[i].used || r->slot[i].stamp < s->stamp) s = &r->slot[i];
        slot_release(s);
        s->used = 1, s->key = *key;
        r->captures++;
        if (capture(r, s, c) != cudaSuccess) {
            cudaGetLastError(); /* capture errors are not sticky; clear the record */
            if (s->exec) cudaGraphExecDestroy(s->exec), s->exec = NULL;
            if (s->graph) cudaGraphDestroy(s->graph), s->graph = NULL;
            s->failed = 1;
        }
    }
    s->stamp = ++r->clock;
    return s;
}

long long comet_cuda_replay_captures(const comet_cuda_replay_t *r) { return r ? r->captures : 0; }

int comet_cuda_replay_launch(comet_cuda_replay_t *r, const comet_cuda_ctx_t *c, cudaStream_t stream, int *replayed) {
    *replayed = 0;
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaError_t e = cudaStreamIsCapturing(stream, &cs);
    if (e != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
        if (e != cudaSuccess) cudaGetLastError();
        return comet_cuda_forward_launch(c, stream);
    }
    comet_cuda_ctx_t key;
    key_of(c, &key);
    replay_slot_t *s = slot_for(r, &key, c);
    if (s->failed) return comet_cuda_forward_launch(c, stream);
    void *args[1] = {(void *)c};
    for (int i = 0; i < s->n && e == cudaSuccess; i++) {
        struct cudaKernelNodeParams kp = s->params[i];
        kp.kernelParams = args, kp.extra = NULL;
        e = cudaGraphExecKernelNodeSetParams(s->exec, s->node[i], &kp);
    }
    if (e == cudaSuccess) e = cudaGraphLaunch(s->exec, stream);
    if (e == cudaSuccess) {
        *replayed = 1;
        return cudaSuccess;
    }
    /* nothing of this call was enqueued: the direct launches still run the protocol the peers wait for */
    cudaGetLastError();
    return comet_cuda_forward_launch(c, stream);
}
