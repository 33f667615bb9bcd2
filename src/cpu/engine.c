/*
 * engine.c - the multi-rank CPU engine: W ranks as threads of one process,
 * each with n_comm communication workers and n_compute compute workers that
 * overlap communication with the GEMMs as the GPU's overlapped mode does
 * (layer 0 the same; in layer 1 the experts' ranks send fp32 partials home
 * here, where the GPU's experts' ranks push their output rows home and the
 * home forms the same partials: the same arithmetic). Its
 * outputs are bitwise identical to the references' (reference.c,
 * reference_backward.c), so plan and protocol bugs show up on machines
 * without GPUs. This file holds the layers, the protocol every collective
 * call runs and the forward; engine_backward.c the backward's arithmetic on
 * the same protocol; engine.h their shared state.
 *
 * Shared ("symmetric") memory, one cpu_sym_t per rank, carved in make_shared:
 *   x           (max_T, H) bf16    this rank's tokens, staged for peers to pull
 *   dy          (max_T, H) bf16    the backward's dy, staged likewise
 *   topk_idx    (max_T, topk) i32  its routing, read by every peer's planner
 *   topk_w      (max_T, topk) f32
 *   partials    (W, max_T, H) f32  [q][t] written by rank q: its top-k partial
 *   dtw_parts   (TP, max_T, topk) f32  backward: [tp][t][j] written by rank
 *                                  (ep of slot j's expert, tp): its <G, a>
 *   partial_flag (W, H) u64        [q][c] = epoch once rank q wrote chunk c
 *   entry, done                    epoch flags (below)
 * Private memory per rank: the plan, the expert-grouped rows a (rows, H), the
 * activations h (rows, F_local), the expert outputs o (rows, H), a ready flag
 * per row block, and completion counters of layer 0 and of each layer-1 chunk
 * (the backward's own buffers: engine.h, cpu_backward_t).
 *
 * Flags are monotone epoch counters, never reset: producers publish with a
 * release store (or add), consumers spin with acquire loads; every spin has a
 * timeout that names rank, role and tile. Forwards and backwards share the
 * epochs (every rank makes its collective calls in the same order). One call,
 * epoch k, on rank r:
 *   1. wait done[q] >= k-1 for all q (nobody still reads my stage)
 *   2. stage x/topk (backward: and dy) into my shared slot, store my input
 *      status, entry = k
 *   3. wait entry[q] >= k for all q; any failed status -> every rank returns
 *      an error having written nothing
 *   4. build the plan from every rank's staged routing
 *   5. (backward: the compute workers' head first, the weights'
 *      transposes, every worker's done before any layer-0 tile)
 *      layer 0: comm workers copy rows into a (backward: dy rows beside
 *      them), block by block in local-first order, and set block_ready[b] =
 *      k; compute workers run the layer-0 tiles in the same order, each after
 *      block_ready[b] >= k, then count l0_done. Forward: GEMM0 and the
 *      activation, 32-column tiles (a training forward also keeps gu, and h
 *      in the caller's saved state). Backward: whole rows: gu and a (saved,
 *      or GEMM0 again), G = dy W2_e, the activation's backward dH, <G, a>
 *   6. layer 1: compute workers run the layer-1 tiles chunk by chunk over all
 *      blocks (forward: GEMM1 -> o; backward: dX = dH W1_e) and add to
 *      l1_done[c]; comm workers, once chunk c is complete, do each token's
 *      top-k reduce over its rows here (backward: weights 1) and store the
 *      partial into the token's home rank (backward, with chunk 0: each
 *      row's <G, a> into dtw_parts), then partial_flag = k; the home rank,
 *      once every rank flagged chunk c, sums the partials in ascending rank
 *      order into y (dx; with chunk 0, d_topk_w from dtw_parts, ascending
 *      tp). Backward: then the compute workers' weight-gradient tiles, WG_KB
 *      output rows each, beside the combine
 *   7. done = k
 * Comm workers do their tasks in the order send(0), send(1), recv(0),
 * send(2), recv(1), ...: a recv(c) waits only on sends(c) of peers, which no
 * later task precedes, so the protocol cannot deadlock.
 *
 * Tracing (comet_layer_set_trace): with a recorder attached, every task of a
 * forward and every wait that did not hold at once is recorded as one event
 * into the worker's own lane (src/trace/trace.h): lane 0 the rank's thread,
 * 1..n_comm the comm workers, then the compute workers. Without one, the
 * only cost is a NULL check per task. Backwards are not recorded.
 */
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../core/saved.h"
#include "../core/status.h"
#include "../core/validate.h"
#include "../trace/trace.h"
#include "../tuner/tuner.h"
#include "cpu_math.h"
#include "engine.h"

#define GEMM0_TILE_N 32 /* activation columns per layer-0 tile */

/* ---------------------------------------------------------------------------
 * Waiting
 * ------------------------------------------------------------------------- */

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void record_error(comet_layer_t *l, comet_status_t st, const char *msg) {
    cpu_layer_t *L = l->backend_state;
    pthread_mutex_lock(&L->err_mu);
    if (L->err == COMET_SUCCESS) {
        L->err = st;
        snprintf(L->err_msg, sizeof L->err_msg, "%s", msg);
    }
    pthread_mutex_unlock(&L->err_mu);
}

/* Spin until *flag >= target (acquire). On timeout, or when another wait of
 * the world timed out, record "rank R <role> <worker>: <what>" and return -1. */
static int wait_geq(comet_layer_t *l, flag_t *flag, uint64_t target, const char *role, int worker,
                    const char *what_fmt, ...) COMET_PRINTF(6, 7);
static int wait_geq(comet_layer_t *l, flag_t *flag, uint64_t target, const char *role, int worker,
                    const char *what_fmt, ...) {
    double start = 0;
    for (uint64_t spin = 0;; spin++) {
        uint64_t v = atomic_load_explicit(flag, memory_order_acquire);
        if (v >= target) return 0;
        if ((spin & 63) != 63) continue;
        sched_yield();
        if ((spin & 1023) != 1023) continue;
        if (start == 0) start = now_ms();
        int aborted = atomic_load(&l->world->aborted);
        int timed_out = now_ms() - start > l->world->settings.timeout_ms;
        if (!aborted && !timed_out) continue;
        char what[256], msg[512];
        va_list ap;
        va_start(ap, what_fmt);
        vsnprintf(what, sizeof what, what_fmt, ap);
        va_end(ap);
        if (timed_out) {
            atomic_store(&l->world->aborted, 1);
            snprintf(msg, sizeof msg, "rank %d %s %d: timed out after %d ms waiting for %s (flag %llu < %llu)",
                     l->rank, role, worker, l->world->settings.timeout_ms, what, (unsigned long long)v,
                     (unsigned long long)target);
        } else {
            snprintf(msg, sizeof msg, "rank %d %s %d: gave up waiting for %s: another wait of the world timed out",
                     l->rank, role, worker, what);
        }
        record_error(l, COMET_ERR_TIMEOUT, msg);
        return -1;
    }
}

/* ---------------------------------------------------------------------------
 * Tracing: called only when L->rec is set
 * ------------------------------------------------------------------------- */

/* Record one step of (role, worker) into its lane, from t0 to now. In a
 * backward the forward's layer kinds (and a wait's for them) become their
 * backward twins. */
void cpu_trace_step(comet_layer_t *l, int role, int worker, int kind, int64_t index, int64_t aux, uint64_t t0) {
    cpu_layer_t *L = l->backend_state;
    int lane = role == COMET_TRACE_HOST ? 0 : role == COMET_TRACE_COMM ? 1 + worker : 1 + L->n_comm + worker;
    if (L->backward && kind <= COMET_TRACE_RECV) kind += COMET_TRACE_BWD;
    if (L->backward && kind == COMET_TRACE_WAIT && aux >= 0 && aux <= COMET_TRACE_RECV) aux += COMET_TRACE_BWD;
    comet_trace_event_t ev = {t0, comet_trace_now_ns(), (int32_t)index, (int32_t)aux, (uint16_t)l->rank,
                              (uint16_t)worker, (uint8_t)role, (uint8_t)kind, (uint16_t)L->epoch};
    comet_trace_record(L->rec, lane, &ev);
}

/* Start of a wait worth recording: now, if tracing and the flag does not hold
 * yet; else 0 (nothing to record). */
static uint64_t trace_wait_begin(const cpu_layer_t *L, flag_t *flag, uint64_t target) {
    if (!L->rec || atomic_load_explicit(flag, memory_order_relaxed) >= target) return 0;
    return comet_trace_now_ns();
}

static comet_status_t cpu_layer_set_trace(comet_layer_t *l, comet_trace_t *trace) {
    cpu_layer_t *L = l->backend_state;
    if (!L) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "rank %d: the layer has no CPU state", l->rank);
    L->trace = trace;
    comet_trace_set_layout(trace, l->rank, COMET_TRACE_LAYOUT_CPU);
    return COMET_SUCCESS;
}

/* ---------------------------------------------------------------------------
 * Create / destroy
 * ------------------------------------------------------------------------- */

static size_t align64(size_t n) { return (n + 63) / 64 * 64; }

static size_t sym_bytes(const comet_dims_t *d) {
    const size_t w = (size_t)d->world_size, t = (size_t)d->max_tokens, hd = (size_t)d->hidden;
    return 2 * align64(t * hd * sizeof(comet_bf16_t)) + 2 * align64(t * (size_t)d->topk * 4) +
           align64(w * t * hd * sizeof(float)) + align64((size_t)d->tp * t * (size_t)d->topk * sizeof(float)) +
           align64(w * hd * sizeof(flag_t));
}

static void *make_shared(void *arg) {
    const comet_dims_t *d = arg;
    const size_t w = (size_t)d->world_size, t = (size_t)d->max_tokens, hd = (size_t)d->hidden;
    cpu_shared_t *sh = calloc(1, sizeof *sh);
    cpu_sym_t *ranks = calloc(w, sizeof *ranks);
    char *block = calloc(w, sym_bytes(d));
    if (!sh || !ranks || !block) {
        free(sh), free(ranks), free(block);
        return NULL;
    }
    atomic_init(&sh->refs, (int)w);
    sh->world_size = (int)w;
    sh->rank = ranks;
    sh->block = block;
    for (size_t q = 0; q < w; q++) {
        char *p = block + q * sym_bytes(d);
        cpu_sym_t *s = &ranks[q];
        s->x = (comet_bf16_t *)p, p += align64(t * hd * sizeof(comet_bf16_t));
        s->dy = (comet_bf16_t *)p, p += align64(t * hd * sizeof(comet_bf16_t));
        s->topk_idx = (int32_t *)p, p += align64(t * (size_t)d->topk * 4);
        s->topk_w = (float *)p, p += align64(t * (size_t)d->topk * 4);
        s->partials = (float *)p, p += align64(w * t * hd * sizeof(float));
        s->dtw_parts = (float *)p, p += align64((size_t)d->tp * t * (size_t)d->topk * sizeof(float));
        s->partial_flag = (flag_t *)p;
        for (size_t i = 0; i < w * hd; i++) atomic_init(&s->partial_flag[i], 0);
        atomic_init(&s->entry, 0);
        atomic_init(&s->done, 0);
    }
    return sh;
}

static void release_shared(cpu_shared_t *sh) {
    if (sh && atomic_fetch_sub(&sh->refs, 1) == 1) {
        free(sh->block);
        free(sh->rank);
        free(sh);
    }
}

static void free_private(cpu_layer_t *L) {
    free(L->plan_ws);
    free(L->a), free(L->h), free(L->o);
    free(L->block_ready), free(L->l1_done), free(L->l1_base);
    free(L->bw.dh), free(L->bw.dxr), free(L->bw.dtw), free(L->bw.w1t), free(L->bw.w2t);
    free(L->bw.gu_tmp), free(L->bw.sum_tmp), free(L->bw.scale_tmp);
    pthread_mutex_destroy(&L->err_mu);
    free(L);
}

void *cpu_take(cpu_layer_t *L, size_t bytes, int aligned) {
    void *ptr = aligned ? aligned_alloc(64, bytes) : malloc(bytes);
    if (ptr) L->private_bytes += bytes;
    return ptr;
}

/* The create's first meeting is the world's rendezvous (cpu_layer_create). */
static void cpu_layer_create_failed(comet_world_t *world, int rank) {
    if (world->size > 1) comet_world_rendezvous_failed(world, rank);
}

static comet_status_t cpu_layer_create(comet_layer_t *l) {
    const comet_dims_t *d = &l->dims;
    cpu_layer_t *L = calloc(1, sizeof *L);
    if (!L) {
        const comet_status_t st = comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: no memory for the layer", l->rank);
        cpu_layer_create_failed(l->world, l->rank);
        return st;
    }
    pthread_mutex_init(&L->err_mu, NULL);
    const size_t rows = (size_t)d->max_rows_padded, hd = (size_t)d->hidden;
    L->plan_ws = cpu_take(L, align64(comet_plan_workspace_bytes(d)), 1);
    L->a = cpu_take(L, rows * hd * sizeof(comet_bf16_t) + 1, 0);
    L->h = cpu_take(L, rows * (size_t)d->ffn_local * sizeof(comet_bf16_t) + 1, 0);
    L->o = cpu_take(L, rows * hd * sizeof(comet_bf16_t) + 1, 0);
    L->block_ready = cpu_take(L, (size_t)d->max_blocks * sizeof(flag_t), 0);
    L->l1_done = cpu_take(L, hd * sizeof(flag_t), 0);
    L->l1_base = cpu_take(L, hd * sizeof(uint64_t), 0);
    if (!L->plan_ws || !L->a || !L->h || !L->o || !L->block_ready || !L->l1_done || !L->l1_base) {
        free_private(L);
        const comet_status_t st = comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: no memory for the layer's buffers", l->rank);
        cpu_layer_create_failed(l->world, l->rank); /* the peers learn of it at once */
        return st;
    }
    memset(L->l1_base, 0, hd * sizeof(uint64_t));
    comet_plan_carve(d, L->plan_ws, &L->plan);
    for (int64_t b = 0; b < d->max_blocks; b++) atomic_init(&L->block_ready[b], 0);
    for (size_t c = 0; c < hd; c++) atomic_init(&L->l1_done[c], 0);
    atomic_init(&L->l0_done, 0);
    atomic_init(&L->head_done, 0);

    /* Collective: every rank must bring the same config. */
    void *shared = NULL;
    comet_dims_t key = *d;
    key.rank = key.tp_rank = key.ep_rank = 0;
    comet_status_t st = comet_world_rendezvous(l->world, l->rank, &key, sizeof key, make_shared, &key, &shared);
    if (st != COMET_SUCCESS) {
        release_shared(shared);
        free_private(L);
        return st;
    }
    L->sh = shared;
    l->backend_state = L;
    return COMET_SUCCESS;
}

static void cpu_layer_memory(const comet_layer_t *l, comet_memory_t *out) {
    out->symmetric_bytes = sym_bytes(&l->dims);
    out->private_bytes = ((const cpu_layer_t *)l->backend_state)->private_bytes;
}

static void cpu_layer_destroy(comet_layer_t *l) {
    cpu_layer_t *L = l->backend_state;
    if (!L) return;
    release_shared(L->sh);
    free_private(L);
    l->backend_state = NULL;
}

/* ---------------------------------------------------------------------------
 * Workers
 * ------------------------------------------------------------------------- */

typedef struct {
    comet_layer_t *l;
    int index;
} worker_t;

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static void *compute_worker(void *arg) {
    worker_t *wk = arg;
    comet_layer_t *l = wk->l;
    cpu_layer_t *L = l->backend_state;
    const comet_dims_t *d = &l->dims;
    const comet_plan_t *p = &L->plan;
    const int64_t hd = d->hidden, fl = d->ffn_local, nb = p->totals->num_blocks;
    const int64_t nt0 = (fl + L->l0_tile - 1) / L->l0_tile;
    const int gemm = !(L->disable & COMET_DISABLE_GEMM);

    /* The head (the backward's transposes), every worker's done before layer 0. */
    if (L->head) {
        const uint64_t th = L->rec ? comet_trace_now_ns() : 0;
        if (gemm) L->head(l, wk->index);
        if (th) cpu_trace_step(l, COMET_TRACE_GEMM, wk->index, COMET_TRACE_TRANSPOSE, -1, -1, th);
        atomic_fetch_add_explicit(&L->head_done, 1, memory_order_release);
        if (wait_geq(l, &L->head_done, L->head_base + (uint64_t)L->n_compute, "gemm worker", wk->index,
                     "the other workers' heads (%d workers)", L->n_compute))
            return NULL;
    }

    /* Layer 0: blocks in local-first order, l0_tile columns a tile. */
    uint64_t mine = 0;
    for (int64_t i = wk->index; i < nb * nt0; i += L->n_compute) {
        int32_t b = p->l0_order[i / nt0];
        const comet_plan_block_t *blk = &p->blocks[b];
        int64_t n0 = (i % nt0) * L->l0_tile, n1 = min64(n0 + L->l0_tile, fl);
        uint64_t tw = trace_wait_begin(L, &L->block_ready[b], L->epoch);
        if (wait_geq(l, &L->block_ready[b], L->epoch, "gemm worker", wk->index,
                     "rows of block %d (expert %d, rows %d..%d, stage %d)", b, blk->expert, blk->row_start,
                     blk->row_start + blk->num_rows - 1, blk->stage))
            return NULL;
        if (tw) cpu_trace_step(l, COMET_TRACE_GEMM, wk->index, COMET_TRACE_WAIT, b, COMET_TRACE_GEMM0, tw);
        uint64_t t0 = L->rec ? comet_trace_now_ns() : 0;
        if (gemm) L->layer0(l, wk->index, blk, n0, n1);
        if (t0) cpu_trace_step(l, COMET_TRACE_GEMM, wk->index, COMET_TRACE_GEMM0, b, i % nt0, t0);
        mine++;
    }
    atomic_fetch_add_explicit(&L->l0_done, mine, memory_order_release);
    uint64_t tw = trace_wait_begin(L, &L->l0_done, L->l0_base + (uint64_t)(nb * nt0));
    if (wait_geq(l, &L->l0_done, L->l0_base + (uint64_t)(nb * nt0), "gemm worker", wk->index,
                 "layer 0 to finish (%lld tiles)", (long long)(nb * nt0)))
        return NULL;
    if (tw) cpu_trace_step(l, COMET_TRACE_GEMM, wk->index, COMET_TRACE_WAIT, -1, COMET_TRACE_GEMM1, tw);

    /* Layer 1: column chunk by column chunk across all blocks. */
    for (int64_t i = wk->index; i < L->n_chunks * nb; i += L->n_compute) {
        int64_t c = i / nb;
        const comet_plan_block_t *blk = &p->blocks[p->l0_order[i % nb]];
        int64_t c0 = c * L->chunk_cols, c1 = min64(c0 + L->chunk_cols, hd);
        uint64_t t0 = L->rec ? comet_trace_now_ns() : 0;
        if (gemm) L->layer1(l, wk->index, blk, c0, c1);
        if (t0) cpu_trace_step(l, COMET_TRACE_GEMM, wk->index, COMET_TRACE_GEMM1, p->l0_order[i % nb], c, t0);
        atomic_fetch_add_explicit(&L->l1_done[c], 1, memory_order_release);
    }
    if (L->tail && gemm) L->tail(l, wk->index);
    return NULL;
}

/* Top-k reduce of chunk c for the tokens of home rank h that have rows here,
 * stored into h's partials, then flagged; with chunk 0 of a backward, also
 * the rows' <G, a> into h's dtw_parts. */
static int send_chunk(comet_layer_t *l, int worker, int64_t c, int h) {
    cpu_layer_t *L = l->backend_state;
    const comet_dims_t *d = &l->dims;
    const comet_plan_t *p = &L->plan;
    const int64_t hd = d->hidden, topk = d->topk, nb = p->totals->num_blocks;
    uint64_t tw = trace_wait_begin(L, &L->l1_done[c], L->l1_base[c] + (uint64_t)nb);
    if (wait_geq(l, &L->l1_done[c], L->l1_base[c] + (uint64_t)nb, "comm worker", worker,
                 "layer-1 tiles of chunk %lld (%lld blocks)", (long long)c, (long long)nb))
        return -1;
    if (tw) cpu_trace_step(l, COMET_TRACE_COMM, worker, COMET_TRACE_WAIT, c, COMET_TRACE_SEND, tw);
    uint64_t t0 = L->rec ? comet_trace_now_ns() : 0;
    int64_t c0 = c * L->chunk_cols, c1 = min64(c0 + L->chunk_cols, hd);
    cpu_sym_t *home = &L->sh->rank[h];
    const int32_t *ros = p->row_of_slot + (int64_t)h * d->max_tokens * topk;
    const int32_t *list = p->send_tokens + (int64_t)h * d->max_tokens;
    float *dtw = home->dtw_parts + (int64_t)d->tp_rank * d->max_tokens * topk;
    for (int32_t i = 0; !(L->disable & COMET_DISABLE_COMM) && i < p->send_count[h]; i++) {
        int64_t t = list[i];
        float *acc = home->partials + ((int64_t)l->rank * d->max_tokens + t) * hd;
        for (int64_t col = c0; col < c1; col++) acc[col] = 0.0f;
        for (int64_t j = 0; j < topk; j++) {
            int32_t row = ros[t * topk + j];
            if (row < 0) continue;
            comet_cpu_topk_accumulate(acc, L->unit_weights ? 1.0f : p->rows[row].weight, L->combined + row * hd, c0, c1);
            if (L->row_dtw && c == 0) dtw[t * topk + j] = L->row_dtw[row];
        }
    }
    atomic_store_explicit(&home->partial_flag[(int64_t)l->rank * hd + c], L->epoch, memory_order_release);
    if (t0) cpu_trace_step(l, COMET_TRACE_COMM, worker, COMET_TRACE_SEND, c, h, t0);
    return 0;
}

/* Sum chunk c of every local token's partials, ascending rank, into the
 * output; with chunk 0 of a backward, also d_topk_w: each slot's parts,
 * ascending tp, from 0. */
static int recv_chunk(comet_layer_t *l, int worker, int64_t c) {
    cpu_layer_t *L = l->backend_state;
    const comet_dims_t *d = &l->dims;
    const comet_plan_t *p = &L->plan;
    const int64_t hd = d->hidden, topk = d->topk;
    cpu_sym_t *me = &L->sh->rank[l->rank];
    uint64_t tw = 0;
    for (int q = 0; q < d->world_size; q++) {
        if (!tw) tw = trace_wait_begin(L, &me->partial_flag[(int64_t)q * hd + c], L->epoch);
        if (wait_geq(l, &me->partial_flag[(int64_t)q * hd + c], L->epoch, "comm worker", worker,
                     "partials of chunk %lld from rank %d", (long long)c, q))
            return -1;
    }
    if (tw) cpu_trace_step(l, COMET_TRACE_COMM, worker, COMET_TRACE_WAIT, c, COMET_TRACE_RECV, tw);
    uint64_t t0 = L->rec ? comet_trace_now_ns() : 0;
    int64_t c0 = c * L->chunk_cols, c1 = min64(c0 + L->chunk_cols, hd);
    for (int64_t t = 0; !(L->disable & COMET_DISABLE_COMM) && t < L->num_tokens; t++) {
        const int32_t *groups = p->home_groups + t * topk;
        for (int64_t col = c0; col < c1; col++) {
            float acc = 0.0f;
            for (int32_t g = 0; g < p->home_group_count[t]; g++)
                for (int tp = 0; tp < d->tp; tp++) {
                    int64_t q = (int64_t)groups[g] * d->tp + tp;
                    acc += me->partials[(q * d->max_tokens + t) * hd + col];
                }
            L->out[t * hd + col] = comet_f32_to_bf16(acc);
        }
        for (int64_t j = 0; L->d_topk_w && c == 0 && j < topk; j++) {
            float acc = 0.0f;
            for (int tp = 0; tp < d->tp; tp++) acc += me->dtw_parts[((int64_t)tp * d->max_tokens + t) * topk + j];
            L->d_topk_w[t * topk + j] = acc;
        }
    }
    if (t0) cpu_trace_step(l, COMET_TRACE_COMM, worker, COMET_TRACE_RECV, c, -1, t0);
    return 0;
}

static void *comm_worker(void *arg) {
    worker_t *wk = arg;
    comet_layer_t *l = wk->l;
    cpu_layer_t *L = l->backend_state;
    const comet_dims_t *d = &l->dims;
    const comet_plan_t *p = &L->plan;
    const int64_t hd = d->hidden, nb = p->totals->num_blocks;
    const int w = d->world_size, n = L->n_comm;

    /* Layer 0: pull rows (and dy rows), block by block in local-first order. */
    for (int64_t i = wk->index; i < nb; i += n) {
        int32_t b = p->l0_order[i];
        const comet_plan_block_t *blk = &p->blocks[b];
        uint64_t t0 = L->rec ? comet_trace_now_ns() : 0;
        for (int64_t row = blk->row_start; !(L->disable & COMET_DISABLE_COMM) && row < blk->row_start + blk->num_rows; row++) {
            const comet_plan_row_t *pr = &p->rows[row];
            const cpu_sym_t *src = &L->sh->rank[pr->src_rank];
            memcpy(L->a + row * hd, src->x + (int64_t)pr->src_token * hd, (size_t)hd * sizeof(comet_bf16_t));
            if (L->pull_dy)
                memcpy(L->pull_dy + row * hd, src->dy + (int64_t)pr->src_token * hd, (size_t)hd * sizeof(comet_bf16_t));
        }
        atomic_store_explicit(&L->block_ready[b], L->epoch, memory_order_release);
        if (t0) cpu_trace_step(l, COMET_TRACE_COMM, wk->index, COMET_TRACE_PULL, b, blk->stage, t0);
    }

    /* Layer 1: send(0), send(1), recv(0), send(2), recv(1), ..., recv(C-1). */
    for (int64_t c = 0; c <= L->n_chunks; c++) {
        for (int hi = 0; c < L->n_chunks && hi < w; hi++)
            if ((c * w + hi) % n == wk->index && send_chunk(l, wk->index, c, (l->rank + 1 + hi) % w)) return NULL;
        if (c >= 1 && (c - 1) % n == wk->index && recv_chunk(l, wk->index, c - 1)) return NULL;
    }
    return NULL;
}

static comet_status_t run_workers(comet_layer_t *l) {
    cpu_layer_t *L = l->backend_state;
    int total = L->n_comm + L->n_compute;
    pthread_t *threads = malloc(sizeof(pthread_t) * (size_t)total);
    worker_t *args = malloc(sizeof(worker_t) * (size_t)total);
    if (!threads || !args) {
        free(threads), free(args);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: no memory for workers", l->rank);
    }
    int started = 0;
    comet_status_t st = COMET_SUCCESS;
    for (; started < total; started++) {
        int comm = started < L->n_comm;
        args[started].l = l;
        args[started].index = comm ? started : started - L->n_comm;
        if (pthread_create(&threads[started], NULL, comm ? comm_worker : compute_worker, &args[started])) {
            /* Workers already running would wait forever for the missing ones. */
            atomic_store(&l->world->aborted, 1);
            st = comet_fail(COMET_ERR_SYSTEM, "rank %d: could not start worker thread %d of %d", l->rank,
                            started, total);
            break;
        }
    }
    for (int i = 0; i < started; i++) pthread_join(threads[i], NULL);
    free(threads), free(args);
    if (st == COMET_SUCCESS && L->err != COMET_SUCCESS) st = comet_fail_copy(L->err, L->err_msg);
    return st;
}

/* ---------------------------------------------------------------------------
 * A collective call: entry, plan, workers, done
 * ------------------------------------------------------------------------- */

/* Wait until every rank's flag (entry or done) reaches target. */
static comet_status_t wait_all_ranks(comet_layer_t *l, int use_done, uint64_t target) {
    cpu_layer_t *L = l->backend_state;
    for (int q = 0; q < l->dims.world_size; q++) {
        flag_t *f = use_done ? &L->sh->rank[q].done : &L->sh->rank[q].entry;
        if (wait_geq(l, f, target, "host", 0, "rank %d to %s epoch %llu", q,
                     use_done ? "finish" : "enter", (unsigned long long)target))
            return comet_fail_copy(L->err, L->err_msg);
    }
    return COMET_SUCCESS;
}

comet_status_t cpu_enter(comet_layer_t *l, comet_status_t own, int64_t t, const comet_protocol_t *proto,
                         const void *x, const void *topk_idx, const void *topk_w, const void *dy) {
    cpu_layer_t *L = l->backend_state;
    const comet_dims_t *d = &l->dims;
    cpu_sym_t *me = &L->sh->rank[l->rank];
    const uint64_t epoch = ++L->epoch;
    L->err = COMET_SUCCESS;
    uint64_t th = L->rec ? comet_trace_now_ns() : 0;
    COMET_TRY(wait_all_ranks(l, 1, epoch - 1));
    if (th) cpu_trace_step(l, COMET_TRACE_HOST, 0, COMET_TRACE_BARRIER, 0, -1, th);

    /* Stage inputs (or the failure) for the peers. */
    me->status = own;
    snprintf(me->message, sizeof me->message, "%s", own == COMET_SUCCESS ? "" : comet_last_error());
    if (own == COMET_SUCCESS && t > 0) { /* with T = 0 the data pointers may be NULL */
        memcpy(me->x, x, (size_t)(t * d->hidden) * sizeof(comet_bf16_t));
        memcpy(me->topk_idx, topk_idx, (size_t)(t * d->topk) * sizeof(int32_t));
        memcpy(me->topk_w, topk_w, (size_t)(t * d->topk) * sizeof(float));
        if (dy) memcpy(me->dy, dy, (size_t)(t * d->hidden) * sizeof(comet_bf16_t));
    }
    if (own == COMET_SUCCESS) {
        me->token_count = t;
        me->chunk_cols = proto->chunk_cols;
    }
    atomic_store_explicit(&me->entry, epoch, memory_order_release);
    if (th) th = comet_trace_now_ns();
    COMET_TRY(wait_all_ranks(l, 0, epoch));
    if (th) cpu_trace_step(l, COMET_TRACE_HOST, 0, COMET_TRACE_BARRIER, 1, -1, th);

    /* Any failure anywhere: every rank returns without writing. */
    comet_status_t st = COMET_SUCCESS;
    char msg[512];
    if (own != COMET_SUCCESS) {
        st = own;
        snprintf(msg, sizeof msg, "%s", me->message);
    }
    for (int q = 0; q < d->world_size && st == COMET_SUCCESS; q++) {
        cpu_sym_t *peer = &L->sh->rank[q];
        if (peer->status != COMET_SUCCESS) {
            st = COMET_ERR_PEER_FAILED;
            snprintf(msg, sizeof msg, "rank %d failed with %s: %s", q,
                     comet_status_string((comet_status_t)peer->status), peer->message);
        } else if (peer->chunk_cols != proto->chunk_cols) {
            st = COMET_ERR_INVALID_ARGUMENT;
            snprintf(msg, sizeof msg, "chunk_cols differ across ranks: %d on rank %d, %d on rank %d",
                     proto->chunk_cols, l->rank, peer->chunk_cols, q);
        }
    }
    if (st != COMET_SUCCESS) {
        atomic_store_explicit(&me->done, epoch, memory_order_release);
        return comet_fail_copy(st, msg);
    }

    /* Plan from every rank's staged routing. */
    if (th) th = comet_trace_now_ns();
    const int w = d->world_size;
    const int32_t *idx[COMET_MAX_RANKS];
    const float *wt[COMET_MAX_RANKS];
    int64_t counts[COMET_MAX_RANKS];
    for (int q = 0; q < w; q++) {
        idx[q] = L->sh->rank[q].topk_idx;
        wt[q] = L->sh->rank[q].topk_w;
        counts[q] = L->sh->rank[q].token_count;
    }
    comet_plan_input_t in = {counts, idx, wt};
    comet_plan_build(d, &in, &L->plan);
    if (th) cpu_trace_step(l, COMET_TRACE_HOST, 0, COMET_TRACE_PLAN, -1, -1, th);

    L->num_tokens = t;
    L->n_comm = proto->n_comm;
    L->n_compute = l->world->settings.cpu_workers;
    L->chunk_cols = proto->chunk_cols;
    L->n_chunks = (int)((d->hidden + proto->chunk_cols - 1) / proto->chunk_cols);
    l->protocol = *proto, l->has_run = 1;
    return COMET_SUCCESS;
}

comet_status_t cpu_run(comet_layer_t *l) {
    cpu_layer_t *L = l->backend_state;
    const int64_t nb = L->plan.totals->num_blocks;
    L->l0_tiles = nb * ((l->dims.ffn_local + L->l0_tile - 1) / L->l0_tile);
    COMET_TRY(run_workers(l));
    L->l0_base += (uint64_t)L->l0_tiles;
    if (L->head) L->head_base += (uint64_t)L->n_compute;
    for (int c = 0; c < L->n_chunks; c++) L->l1_base[c] += (uint64_t)nb;
    atomic_store_explicit(&L->sh->rank[l->rank].done, L->epoch, memory_order_release);
    return COMET_SUCCESS;
}

comet_status_t cpu_check_n_comm(int n_comm) {
    if (n_comm > COMET_CPU_MAX_N_COMM)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "args.n_comm %d is above %d, the CPU engine's most workers",
                          n_comm, COMET_CPU_MAX_N_COMM);
    return COMET_SUCCESS;
}

comet_status_t cpu_check_saved_alignment(const comet_tensor_t *saved) {
    if ((uintptr_t)saved->data % sizeof(comet_bf16_t))
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "saved.data %p is not 2-byte aligned (its gu and h are bf16)",
                          saved->data);
    return COMET_SUCCESS;
}

/* ---------------------------------------------------------------------------
 * Forward
 * ------------------------------------------------------------------------- */

/* Layer 0: GEMM0 and the activation into h, or into a training forward's
 * saved h, which then also takes gu. */
static void forward_layer0(comet_layer_t *l, int worker, const comet_plan_block_t *blk, int64_t n0, int64_t n1) {
    cpu_layer_t *L = l->backend_state;
    const comet_dims_t *d = &l->dims;
    const int64_t hd = d->hidden, fl = d->ffn_local, r1 = d->w1_rows;
    const comet_bf16_t *w1_e = L->w1 + (int64_t)blk->expert * r1 * hd;
    (void)worker;
    for (int64_t row = blk->row_start; row < blk->row_start + blk->num_rows; row++)
        comet_cpu_gemm0_gu_row(d, L->a + row * hd, w1_e, n0, n1, L->fwd_h + row * fl,
                               L->fwd_gu ? L->fwd_gu + row * r1 : NULL);
}

/* Layer 1: GEMM1 into o. */
static void forward_layer1(comet_layer_t *l, int worker, const comet_plan_block_t *blk, int64_t c0, int64_t c1) {
    cpu_layer_t *L = l->backend_state;
    const comet_dims_t *d = &l->dims;
    const int64_t hd = d->hidden, fl = d->ffn_local;
    const comet_bf16_t *w2_e = L->w2 + (int64_t)blk->expert * hd * fl;
    (void)worker;
    for (int64_t row = blk->row_start; row < blk->row_start + blk->num_rows; row++)
        comet_cpu_gemm1_row(d, L->fwd_h + row * fl, w2_e, c0, c1, L->o + row * hd);
}

static comet_status_t cpu_layer_forward(comet_layer_t *l, const comet_forward_args_t *args) {
    cpu_layer_t *L = l->backend_state;
    const comet_dims_t *d = &l->dims;
    int64_t t = 0;
    comet_status_t own = comet_check_forward_args(d, args, 1, &t);
    if (own == COMET_SUCCESS) own = cpu_check_n_comm(args->n_comm);
    if (own == COMET_SUCCESS && args->save == COMET_SAVE_ACTIVATIONS) own = cpu_check_saved_alignment(&args->saved);
    comet_protocol_t proto = COMET_PROTOCOL_INIT; /* the CPU engine's GEMM and fp32 partials' combine */
    if (own == COMET_SUCCESS) /* COMET_SEQUENTIAL: this engine always overlaps */
        comet_tuner_choose(l->world->tune, d, COMET_BACKEND_CPU, t, args->n_comm > 0 ? args->n_comm : 0,
                           args->chunk_cols, &proto);
    L->rec = L->trace, L->backward = 0;
    COMET_TRY(cpu_enter(l, own, t, &proto, args->x.data, args->topk_idx.data, args->topk_w.data, NULL));

    /* A training forward keeps gu and h in the saved state (not a measurement's). */
    const int save = args->save == COMET_SAVE_ACTIVATIONS && args->disable == 0;
    char *saved = args->saved.data;
    L->w1 = args->w1.data;
    L->w2 = args->w2.data;
    L->out = args->y.data;
    L->disable = args->disable;
    L->l0_tile = GEMM0_TILE_N;
    L->head = NULL, L->layer0 = forward_layer0, L->layer1 = forward_layer1, L->tail = NULL;
    L->fwd_h = save ? (comet_bf16_t *)(saved + comet_saved_h_offset(d)) : L->h;
    L->fwd_gu = save ? (comet_bf16_t *)(saved + comet_saved_gu_offset(d)) : NULL;
    L->pull_dy = NULL;
    L->combined = L->o, L->unit_weights = 0;
    L->row_dtw = NULL, L->d_topk_w = NULL;
    COMET_TRY(cpu_run(l));
    if (save) { /* the header last */
        const comet_saved_header_t hdr = {COMET_SAVED_MAGIC, l->id, t, L->plan.totals->num_rows};
        memcpy(saved, &hdr, sizeof hdr);
    }
    return COMET_SUCCESS;
}

const comet_backend_ops_t comet_cpu_ops = {
    .name = "cpu",
    .layer_create = cpu_layer_create,
    .layer_create_failed = cpu_layer_create_failed,
    .layer_destroy = cpu_layer_destroy,
    .layer_forward = cpu_layer_forward,
    .layer_backward = cpu_layer_backward,
    .layer_memory = cpu_layer_memory,
    .layer_set_trace = cpu_layer_set_trace,
};
