/*
 * cuda_layer.h - what the host side of the CUDA backend (src/cuda/backend.c)
 * hands to the layer kernels (src/cuda/layer_chain.cu and its rooms in
 * src/cuda/layer/): one plain struct passed by value to every kernel, and the
 * C ABI of the launchers. No CUDA header needed: streams travel as void *.
 *
 * Symmetric buffer of each rank (the same layout on every rank, so a peer's
 * field is at the same offset in the peer's buffer), carved by backend.c:
 *   flags     comet_sym_flags_t (4 KiB aligned)
 *   x         (max_T, H) bf16           staged tokens, pulled by peers
 *   topk_idx  (max_T, topk) int32       staged routing, read by peers' planners
 *   topk_w    (max_T, topk) fp32
 *   plan      comet_plan_t workspace    my plan (peers read its row_of_slot)
 *   o         (max_rows_padded, H) bf16 my expert outputs (GEMM1), pulled by
 *                                       the home ranks of their tokens
 *   recv      (TP, max_T, topk, H) bf16 with the push combine: [tp][t][j] the o row
 *                                       of my token t's slot j computed by the rank
 *                                       with tp index tp of the slot's EP group,
 *                                       stored by that rank's GEMM1 epilogue
 *   dy        (max_T, H) bf16           backward: staged dy, pulled by peers
 *   dwr       (max_rows_padded) fp32    backward: each row's slice of <G, a>, read by
 *                                       the home ranks of their tokens (d_topk_w)
 *
 * Flags are monotone epoch counters (never reset), written with
 * st.release.sys and read with ld.acquire.sys. One forward, epoch e (kept in
 * device memory, so a captured graph replays correctly):
 *   enter    the call's tensors into state->call; e = ++epoch; wait done[q] >= e-1 for every rank q
 *   stage    copy x/idx/w into my stage; check my routing on the device
 *   publish  my status, my T, my protocol (comet_cuda_protocol_word), entry = e
 *            (k_plan's thread 0, before its wait)
 *   plan     wait entry[q] >= e; any bad status, or a mode unlike mine (the
 *            ranks chose different protocols) -> skip (nothing written);
 *            copy every rank's staged routing here (all SMs), build my plan
 *            from it (two launches, plan_kernel.cu)
 *   dispatch pull my experts' token rows from the peers' stages: each token
 *            once, stored into every row of its slots here (the overlapped
 *            mode pulls by row block, beside GEMM0)
 *   gemm0    h = act(a W1^T)
 *   gemm1    o = h W2^T; with push its epilogue also stores each o row into
 *            the recv buffer of its token's home rank
 *   signal   o_ready[me] = e on every rank (my o, and the rows I pushed, are
 *            complete; every k_final(_flat) CTA's thread 0, before its skip
 *            check and its wait)
 *   combine  wait o_ready[q] >= e for all q; for each of my tokens and each
 *            contributing rank q (ascending): q's partial = top-k reduce
 *            (ascending slot, fmaf) over the o rows of its slots on q, pulled
 *            from q's o at the rows q's plan gives (row_of_slot), or with
 *            push read from my recv[tp of q][t][j] (my own rows: my o); y = the
 *            partials summed in ascending rank order (fp32), stored bf16
 *   exit     done = e
 * One backward (comet_cuda_backward_launch) runs the same protocol with
 * the data steps of the backward (layer_chain.cu's backward_chain): dy is
 * staged and pulled beside x (into o, which the backward's dX overwrites
 * later), the combine sums the dX rows with weights 1 into dx, and the home
 * ranks read every slot's <G, a> slices from dwr for d_topk_w.
 * Every wait times out (timeout_ns) with a message naming rank, role and
 * index, then traps: never a silent hang (GEMM0's readiness wait writes its
 * report into gemm_report, which comet_layer_sync turns into the error).
 */
#ifndef COMET_CUDA_LAYER_H
#define COMET_CUDA_LAYER_H

#include <stddef.h>
#include <stdint.h>

#include "comet.h"
#include "../core/numerics.h"
#include "../plan/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

#define COMET_CUDA_MAX_RANKS 64
/* Trace lanes of one rank on a GPU: 0 the stream's own steps, 1..8 the
 * communication CTAs (CTA index mod 8), 9 GEMM0, 10 GEMM1. */
#define COMET_CUDA_TRACE_LANES 11

/* Head of every rank's symmetric buffer. */
typedef struct {
    uint64_t entry;           /* epoch whose inputs are staged */
    uint64_t done;            /* last finished epoch */
    uint64_t status;          /* comet_status_t of this rank's input check, this epoch */
    uint64_t token_count;     /* T of this rank, this epoch */
    uint64_t mode;            /* this epoch's protocol (comet_cuda_protocol_word): every rank must run the same */
    uint64_t o_ready[COMET_CUDA_MAX_RANKS]; /* [q] = e once rank q's o (and plan, and pushed rows) are complete */
} comet_sym_flags_t;

typedef struct {
    size_t flags, x, topk_idx, topk_w, plan, o, recv, dy, dwr, total; /* byte offsets, total size */
} comet_sym_layout_t;

/* One call's tensors (comet_layer_forward's arguments). They reach the
 * device through k_enter's parameters alone, which stores them in the
 * layer's state (comet_cuda_state_t.call) for the kernels after it: so a
 * replayed chain (replay.c) changes one node's parameters a call. */
typedef struct {
    const comet_bf16_t *x;   /* (T, H) */
    const int32_t *topk_idx; /* (T, topk) */
    const float *topk_w;     /* (T, topk) */
    comet_bf16_t *y;         /* (T, H): y (forward), dx (backward) */
    int64_t num_tokens;
    uint32_t host_status;    /* comet_status_t of the host-side checks of this call */
    int32_t pass;            /* 0 forward, 1 backward */
    int32_t save;            /* comet_save_t: forward, writes saved; backward, reads it (ACTIVATIONS) */
    int32_t accumulate;      /* backward: dw1, dw2 added to (fp32) */
    int32_t wgrad_fp32;      /* backward: bit 0 dw2, bit 1 dw1 is fp32 (else bf16): bit `which` of k_wgrad */
    int32_t pad_;
    uint64_t layer_id;       /* comet_layer_t's id: the saved state's header names it */
    unsigned char *saved;    /* saved state (src/core/saved.h), or NULL */
    const comet_bf16_t *dy;  /* backward: (T, H) */
    float *d_topk_w;         /* backward: (T, topk) */
    void *dw1, *dw2;         /* backward: (E_local, w1_rows, H), (E_local, H, F_local), bf16 or fp32 */
} comet_cuda_call_t;

/* Private device state of one rank's layer. */
typedef struct {
    comet_cuda_call_t call;   /* this call's tensors (k_enter) */
    uint64_t epoch;           /* current epoch */
    uint32_t own_status;      /* routing check of this call (atomicMax of status codes) */
    uint32_t skip;            /* 1: some rank's input is invalid this epoch: write nothing */
    uint32_t last_status;     /* comet_status_t to report: own failure, or PEER_FAILED */
    uint32_t pad_;
    uint64_t mark_begin[7];   /* trace: %globaltimer when each marked step was reached (exit.cuh's k_mark) */
    int64_t token_count[COMET_CUDA_MAX_RANKS];   /* T of every rank, this epoch */
    const int32_t *peer_idx[COMET_CUDA_MAX_RANKS]; /* every rank's staged topk_idx (peer memory) */
    const float *peer_w[COMET_CUDA_MAX_RANKS];     /* every rank's staged topk_w (peer memory) */
    int32_t *route_idx[COMET_CUDA_MAX_RANKS];      /* local copies of those, which the plan reads */
    float *route_w[COMET_CUDA_MAX_RANKS];
} comet_cuda_state_t;

typedef struct {
    comet_dims_t d;
    comet_sym_layout_t lay;
    char *sym;                     /* my symmetric buffer */
    char *peers[COMET_CUDA_MAX_RANKS]; /* every rank's symmetric buffer, as this GPU addresses it */
    comet_cuda_state_t *state;     /* device */
    void *plan_ws;                 /* in sym (lay.plan), comet_plan_workspace_bytes(d) */
    void *plan_scratch;            /* private, comet_cuda_plan_scratch_bytes(d) */
    comet_bf16_t *a;               /* (max_rows_padded, H) gathered token rows */
    comet_bf16_t *h;               /* (max_rows_padded, F_local) activations */
    comet_bf16_t *o;               /* in sym (lay.o): (max_rows_padded, H) expert outputs; backward: the
                                    * gathered dy rows, then bf16(w dy), then the dX rows */
    /* training (allocated by the first call that needs them, else NULL) */
    comet_bf16_t *dh;              /* (max_rows_padded, w1_rows): gu where GEMM0 stores it, then dH */
    comet_bf16_t *gu;              /* (max_rows_padded, w1_rows): the Hopper backward's recomputed gu (its G
                                    * does not write dH over the gu it reads), or NULL: in dh */
    float *dwp;                    /* (max_rows_padded, ceil(F_local / 64)): <G, a> per row and column tile
                                    * (64 columns a tile on the SIMT tiles, 256 on the Hopper GEMM) */
    int store_gu;                  /* GEMM0 also stores gu (bf16): into dh, or a saving forward's on the
                                    * Hopper GEMM into `saved` */
    unsigned char *saved;          /* a saving forward on the Hopper GEMM: the caller's saved state, where
                                    * GEMM0 stores gu and h and GEMM1 reads h (part of replay.c's key);
                                    * else NULL (the SIMT tiles store into dh and h, k_save copies) */
    uint32_t *train_sched;         /* device, 4 words zeroed at create: the Hopper G's and dX's tile counters */
    void *wgrad[2];                /* host: the backward's dW2 and dW1 on the Hopper GEMM (comet_cuda_wgrad_prepare) */
    /* this call's protocol and weights (its tensors: comet_cuda_call_t) */
    const comet_bf16_t *w1;        /* (E_local, w1_rows, H) */
    const comet_bf16_t *w2;        /* (E_local, H, F_local) */
    uint64_t timeout_ns;
    int num_sms;
    void *gemm;                    /* host: prepared Hopper GEMM (gemm.h) for this call's weights, or NULL: SIMT tiles */
    uint64_t protocol;             /* comet_cuda_protocol_word of this call's protocol, published for the
                                    * ranks to compare */
    /* overlapped mode (n_comm > 0, Hopper GEMM only): in layer 0, one
     * dispatch CTA per SM: those beyond n_comm copy the local tokens and
     * exit, the n_comm communication CTAs pull the remote tokens in GEMM0's
     * block order; all count the rows stored per block and release
     * block_ready[b] when its last row is in, which GEMM0 waits for. GEMM0
     * follows on the same stream as a programmatic dependent on every SM
     * (its CTAs take the copiers' SMs at once and the pullers' SMs when the
     * pulls are done). Layer 1 has no comm CTAs: GEMM1 runs on every SM
     * (and pushes, with the push combine), and the sequential chain's signal
     * and combine follow. */
    int n_comm;                    /* 0: the sequential chain */
    int push;                      /* GEMM1 pushes o rows into their home ranks' recv; the combine reads
                                    * them there after GEMM1 */
    int disable;                   /* COMET_DISABLE_* bits (measurement only) */
    uint64_t *block_ready;         /* device [max_blocks] */
    uint32_t *block_rows;          /* device [max_blocks]: the overlapped dispatch's rows stored per block */
    uint64_t *gemm_report;         /* host-mapped (device address): GEMM0's readiness-wait timeout report */
    /* tracing (comet_layer_set_trace): events in the layout of
     * src/trace/trace.h, [COMET_CUDA_TRACE_LANES][tr_capacity], counts per lane */
    void *tr_events;               /* device, or NULL: not tracing */
    uint32_t *tr_counts;           /* device [COMET_CUDA_TRACE_LANES] */
    uint32_t tr_capacity;
} comet_cuda_ctx_t;


/* The protocol as the ranks compare it on the device (k_plan): mode and
 * combine in one word. n_comm and the GEMM kind may differ between ranks
 * (a rank whose Hopper GEMM could not be prepared runs the SIMT tiles and,
 * sequential with the pull combine, meets its peers' rows as they do). The
 * one encoding of comet_protocol_t for the device. */
static inline uint64_t comet_cuda_protocol_word(const comet_protocol_t *p, int pass) {
    return 1u + (uint64_t)p->mode + 4u * (uint64_t)p->combine + 16u * (uint64_t)pass;
}

/* Enqueue one whole forward (every step above) of the call's tensors on
 * stream. Returns the CUDA launch status as an int (cudaError_t). With
 * call->host_status != 0 (this rank's arguments failed the host checks)
 * only the protocol steps run: the failure is published, every rank skips
 * its data steps and writes nothing. */
int comet_cuda_forward_launch(const comet_cuda_ctx_t *ctx, const comet_cuda_call_t *call, void *stream);
/* Enqueue one whole backward of call (call->pass 1) on stream: the
 * forward's protocol steps with the backward's data steps (the sequential
 * chain). Same return and failure behaviour as the forward's launch. */
int comet_cuda_backward_launch(const comet_cuda_ctx_t *ctx, const comet_cuda_call_t *call, void *stream);
/* The Hopper backward's weight-gradient GEMMs for call, into ctx->wgrad
 * before the launch (so that a failure is this rank's status, not a chain
 * stopped half way): 0, or -1 with a message in err. Host only. */
int comet_cuda_wgrad_prepare(const comet_cuda_ctx_t *ctx, const comet_cuda_call_t *call, void *out[2], char *err,
                             size_t err_len);
void comet_cuda_wgrad_destroy(void *w[2]);
/* k_enter, the chain's first kernel and the only one that takes the call's
 * tensors (its parameters: the context, then the call). */
const void *comet_cuda_enter_kernel(void);
/* Load every kernel of the layer (and the GEMM) on the current device. */
int comet_cuda_layer_warm(void);

#ifdef __cplusplus
}
#endif

#endif /* COMET_CUDA_LAYER_H */
