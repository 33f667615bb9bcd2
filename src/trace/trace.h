/*
 * trace.h - the trace recorder (internal side): the event layout every
 * backend writes, the lock-free per-lane buffers, and the hook a backend
 * implements to take a recorder. The public calls (create, destroy, write
 * Chrome-trace JSON and SVG, attach to a layer) are declared in comet.h.
 *
 * Event layout (32 bytes, comet_trace_event_t below). One event is one
 * interval of one worker: a layer-0 pull of a block, a GEMM0 or GEMM1 tile, a
 * send (top-k reduce into a home rank) or receive (final sum) of a layer-1
 * chunk, a wait on a flag that did not hold at once, or a host step of the
 * rank's own thread (barrier, plan). Times are nanoseconds of one clock per
 * recorder: CLOCK_MONOTONIC on the CPU engine; %globaltimer on a GPU. The
 * writers only ever use differences, and subtract the earliest begin.
 *
 * Buffer layout (what a GPU path fills, then copies into the host recorder):
 *   events  [ranks][lanes][capacity] comet_trace_event_t
 *   counts  [ranks][lanes]           uint32_t, events offered to the lane
 * A writer of lane (r, l) takes n = counts[r][l]++ (a plain increment on the
 * CPU, where only the lane's owner writes it; atomicAdd on a GPU, where a
 * lane may be one thread block) and stores the event into
 * events[r][l][n] only if n < capacity. Events beyond capacity are dropped,
 * and counted: dropped = sum over lanes of max(0, counts - capacity). Nothing
 * is ever written outside the buffer, and the recording path takes no lock.
 * A GPU backend allocates a device buffer of comet_trace_buffer_bytes() with
 * this layout, zeroes the counts, lets its kernels write, and copies it back
 * with comet_trace_buffer()/comet_trace_counts() as destinations; then the
 * writers below work unchanged.
 *
 * Lanes of one rank on the CPU engine: 0 is the rank's thread,
 * 1..n_comm the communication workers, then the GEMM workers. The lane is
 * only a storage slot: the writers place an event by (rank, role, worker),
 * which the event carries, so n_comm may change between traced calls.
 *
 * Not part of the public API.
 */
#ifndef COMET_TRACE_H
#define COMET_TRACE_H

#include <stdint.h>
#include <time.h>

#include "comet.h"

/* What a worker did. index/aux say which piece of the plan it was. */
enum {
    COMET_TRACE_PULL = 0,    /* comm, layer 0: rows of block `index` (latest source stage `aux`) copied into a;
                              * CUDA dispatch: batch `index` of tokens (aux -1); overlapped mode's
                              * remote pulls: pass `index` over the remote row blocks (aux 1), and
                              * inside it its lookup (aux 2) and its copy (aux 3); the rest is the count */
    COMET_TRACE_GEMM0 = 1,   /* gemm, layer 0: block `index`, column tile `aux` (GEMM0 + activation) */
    COMET_TRACE_GEMM1 = 2,   /* gemm, layer 1: block `index`, column chunk `aux` */
    COMET_TRACE_SEND = 3,    /* comm, layer 1: chunk `index` reduced and stored into home rank `aux` */
    COMET_TRACE_RECV = 4,    /* comm, layer 1: chunk `index` of every local token summed into y */
    COMET_TRACE_WAIT = 5,    /* any: spin on a flag; `aux` = kind of the step it waits to do, `index` its index */
    COMET_TRACE_BARRIER = 6, /* host: wait for every rank; index 0 = previous call done, 1 = entry */
    COMET_TRACE_PLAN = 7,    /* host: build the plan from every rank's staged routing (CPU: index -1;
                              * CUDA: index 0 the routing copy, 1 and 2 the builder's kernels) */
    /* The backward's steps (the CUDA backend records G, dX and the two weight gradients as one
     * event a kernel, index -1, the weight gradient's aux 1 for dW1 and 2 for dW2):
     * its layer 0 and 1 run the forward's protocol on other data, the kinds above + COMET_TRACE_BWD */
    COMET_TRACE_BPULL = 8,     /* comm: x and dy rows of block `index` (latest source stage `aux`) */
    COMET_TRACE_BGEMM0 = 9,    /* gemm: block `index` (aux 0): G = dy W2^T, the activation's backward dH, <G, a> */
    COMET_TRACE_BGEMM1 = 10,   /* gemm: block `index`, column chunk `aux`: dX = dH W1 */
    COMET_TRACE_BSEND = 11,    /* comm: dx chunk `index` reduced and stored into home rank `aux` */
    COMET_TRACE_BRECV = 12,    /* comm: dx chunk `index` of every local token summed */
    COMET_TRACE_TRANSPOSE = 13, /* gemm: the worker's share of the weights' transposes (index -1) */
    COMET_TRACE_WGRAD = 14,    /* gemm: weight-gradient task `index` of local expert `aux` (WG_KB rows of dW1,
                                * then of dW2) */
    COMET_TRACE_NUM_KINDS = 15
};
#define COMET_TRACE_BWD (COMET_TRACE_BPULL - COMET_TRACE_PULL) /* a forward kind's backward twin: + this */

/* Who did it. */
enum { COMET_TRACE_HOST = 0, COMET_TRACE_COMM = 1, COMET_TRACE_GEMM = 2 };

typedef struct {
    uint64_t t_begin_ns; /* clock of the recorder (CPU: CLOCK_MONOTONIC; GPU: %globaltimer) */
    uint64_t t_end_ns;   /* >= t_begin_ns */
    int32_t index;       /* block, chunk, ... (see the kinds); -1 none */
    int32_t aux;         /* second index (see the kinds); -1 none */
    uint16_t rank;
    uint16_t worker;     /* index within its role */
    uint8_t role;        /* COMET_TRACE_HOST, _COMM, _GEMM */
    uint8_t kind;        /* COMET_TRACE_PULL ... */
    uint16_t call;       /* forward call number on this rank, low 16 bits */
} comet_trace_event_t;

#ifdef __cplusplus /* the event layout is shared with the CUDA kernels (src/cuda/layer/flags.cuh) */
static_assert(sizeof(comet_trace_event_t) == 32, "the trace event layout is 32 bytes (shared with device code)");
#else
_Static_assert(sizeof(comet_trace_event_t) == 32, "the trace event layout is 32 bytes (shared with device code)");

/* Which backend fills a rank's lanes: what the writers call its lanes and
 * whether its clock is shared with the other ranks. Set by the backend when
 * it attaches (comet_trace_set_layout); only labels depend on it. */
enum {
    COMET_TRACE_LAYOUT_UNKNOWN = 0, /* "host", "comm i", "gemm i" */
    COMET_TRACE_LAYOUT_CPU = 1,     /* rank thread, comm worker i, compute worker i; one CLOCK_MONOTONIC for all ranks */
    COMET_TRACE_LAYOUT_CUDA = 2     /* stream, comm CTAs i mod 8, GEMM0 kernel, GEMM1 kernel; the GPU's own %globaltimer */
};

struct comet_trace {
    int ranks, lanes;
    uint8_t *layout;              /* [ranks] COMET_TRACE_LAYOUT_*, kept by comet_trace_clear */
    int64_t capacity;             /* events per lane */
    comet_trace_event_t *events;  /* [ranks][lanes][capacity] */
    uint32_t *counts;             /* [ranks][lanes] */
    _Atomic int64_t out_of_range; /* events for a rank or lane the recorder does not have */
};

/* Nanoseconds of the CPU recorder's clock. */
static inline uint64_t comet_trace_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Record one event into lane `lane` of ev->rank. Only the lane's owner calls
 * this for a lane while a forward runs. Never fails: an event that does not
 * fit is counted as dropped. */
void comet_trace_record(comet_trace_t *t, int lane, const comet_trace_event_t *ev);

/* The lane layout of `rank` (COMET_TRACE_LAYOUT_*): called by a backend's
 * layer_set_trace; a rank outside the recorder is ignored. Each rank sets
 * only its own byte, so ranks attaching at once do not race. */
void comet_trace_set_layout(comet_trace_t *t, int rank, int layout);

/* Buffer views for a backend that fills the recorder in bulk (see above). */
size_t comet_trace_buffer_bytes(const comet_trace_t *t);
comet_trace_event_t *comet_trace_buffer(comet_trace_t *t);
uint32_t *comet_trace_counts(comet_trace_t *t);

/* Short name of a kind ("pull", "gemm0", ...) and of a role ("host", ...). */
const char *comet_trace_kind_name(int kind);
const char *comet_trace_role_name(int role);
/* What the step is to a model trainer ("dispatch (pull token rows)", "expert
 * GEMM 1 (x W1, activation)", ...): the writers' event names. The short names
 * above stay the machine-readable ids (JSON args.kind). */
const char *comet_trace_kind_title(int kind);
/* Layer of a kind: 0, 1, or -1 (host, wait). */
int comet_trace_kind_layer(int kind);

#endif /* C only: the recorder */

#endif /* COMET_TRACE_H */
