/*
 * layer/combine.cuh - the combine: the signal (my o complete, announced to
 * every rank), then y of every local token from the o rows of every
 * contributing rank (pulled, or pushed here by GEMM1; the backward's dx the
 * same way from the dX rows, with every weight 1: fmaf(1, o, acc) is the
 * plain fp32 sum include/comet.h's backward step 6 asks for): the combine's sources
 * and lanes, the top-k reduce (reduce_batch, rank_partial) summed in
 * ascending rank order, the flat combine (flat_entry, flat_token) where a
 * token's entries fit a warp, and the kernels k_final and k_final_flat
 * (final_flat, host side, picks one).
 *
 * What it is not: a header to include on its own. It is one room of a single
 * translation unit, src/cuda/layer_chain.cu, which includes the rooms in
 * chain order after the plan, context and vector headers (one unit, not
 * relocatable device code, so that device functions shared between steps
 * still inline and the kernels compile as they did in one file).
 * Not here either: the pushes of o rows home (GEMM1's epilogue, gemm.cu), the
 * done flag (exit.cuh). Needs flags.cuh.
 */

/* Slots, and 256-column groups, whose loads a lane issues before it uses
 * them: 2 x 2 x 16 B = 64 B in flight a lane, 32 KB a 512-thread CTA (more
 * spills registers at the 128 a thread that 512-thread CTAs allow). */
#define SLOT_BATCH 2
#define COL_GROUPS 2

/* Columns of a lane's 8 from col that lie below c1 (0..8). */
__device__ static inline int cols_below(int64_t col, int64_t c1) {
    return col < c1 ? (int)(c1 - col < 8 ? c1 - col : 8) : 0;
}

/* What a warp holds of one token for the combine: lane l < topk*tp stands
 * for slot j = l / tp on the rank with tp index l % tp of the slot's EP group:
 * the group (g), the slot's weight (w) and its row on that rank (row, -1 if
 * none); lane i < topk holds the token's i-th contributing group, ascending
 * (grp), and every lane the group count (ng). */
typedef struct {
    int64_t t;
    int32_t g, row, grp, ng;
    float w;
} combine_lane_t;

/* The combine's inputs, set up once per CTA: every rank's row_of_slot for my
 * tokens (their plans lie in their symmetric buffers) and my staged routing. */
typedef struct {
    const int32_t *ros[COMET_CUDA_MAX_RANKS]; /* rank q: row of (home me, t, j) at [t * topk + j] */
    const comet_bf16_t *o_of[COMET_CUDA_MAX_RANKS]; /* rank q's o rows: q's o, or with push my recv */
    int pushed[COMET_CUDA_MAX_RANKS];               /* with push, q != me: rows at recv[tp of q][t][j] */
    const int32_t *idx;                       /* my staged topk_idx */
    const float *wts;                         /* my staged topk_w */
    int unit;                                 /* backward: every weight 1 (dx: the dX rows summed) */
} combine_src_t;

__device__ static void combine_src_init(const comet_cuda_ctx_t *c, combine_src_t *src) {
    for (int q = threadIdx.x; q < c->d.world_size; q += blockDim.x) {
        comet_plan_t pq;
        comet_plan_carve(&c->d, c->peers[q] + c->lay.plan, &pq);
        src->ros[q] = pq.row_of_slot + (int64_t)c->d.rank * c->d.max_tokens * c->d.topk;
        src->pushed[q] = c->push && q != c->d.rank;
        src->o_of[q] = (const comet_bf16_t *)(src->pushed[q] ? c->sym + c->lay.recv : c->peers[q] + c->lay.o);
    }
    if (threadIdx.x == 0) {
        src->idx = (const int32_t *)(c->sym + c->lay.topk_idx);
        src->wts = (const float *)(c->sym + c->lay.topk_w);
        src->unit = c->state->call.pass == 1;
    }
    __syncthreads();
}

/* Where rank q (tp index tpi) has slot j of my token t: with push my recv
 * row [tpi][t][j] (computed), else the row q's plan gives (a load, remote
 * for other ranks). */
__device__ static inline int32_t slot_row(const comet_cuda_ctx_t *c, const combine_src_t *src, int q, int tpi,
                                          int64_t t, int64_t j) {
    const int64_t k = c->d.topk;
    return src->pushed[q] ? (int32_t)(((int64_t)tpi * c->d.max_tokens + t) * k + j) : src->ros[q][t * k + j];
}

/* Step 1 of a token's lane data (local loads): t, g, w, grp, ng. */
__device__ static inline combine_lane_t combine_lane_local(const comet_cuda_ctx_t *c, const comet_plan_t *p,
                                                           const combine_src_t *src, int64_t t, int live) {
    const int64_t k = c->d.topk;
    const int lane = threadIdx.x % 32, tp = c->d.tp;
    combine_lane_t x = {t, 0, -1, 0, 0, 0.0f};
    if (!live) return x;
    const int64_t j = lane / tp;
    if (j < k && lane < k * tp) {
        x.g = (int32_t)(src->idx[t * k + j] / c->d.experts_local);
        x.w = src->unit ? 1.0f : src->wts[t * k + j];
    }
    if (lane < k) x.grp = p->home_groups[t * k + lane];
    x.ng = p->home_group_count[t];
    return x;
}

/* Step 2 (a load from the slot's rank, remote for other ranks): row. */
__device__ static inline void combine_lane_row(const comet_cuda_ctx_t *c, const combine_src_t *src, int live,
                                               combine_lane_t *x) {
    const int64_t k = c->d.topk;
    const int lane = threadIdx.x % 32, tp = c->d.tp;
    if (!live || lane >= k * tp || lane / tp >= k) return;
    x->row = slot_row(c, src, x->g * tp + lane % tp, lane % tp, x->t, lane / tp);
}

/* One batch of n slots of a top-k reduce over ng 256-column groups (both
 * constants at the call), by every lane of a warp: part[gi * 8 + e]
 * += wj[u] * o[r[u]] (fmaf, u ascending; r[u] < 0: no row) for the lane's
 * columns g0 + gi*256 + lane*8 + e (gi < ng) below c1, every row's loads
 * issued before the first is used. */
__device__ static __forceinline__ void reduce_batch(const comet_bf16_t *o, int64_t hd, const int32_t r[SLOT_BATCH],
                                                    const float wj[SLOT_BATCH], int n, int ng, int64_t g0,
                                                    int64_t c1, float *part) {
    const int lane = threadIdx.x % 32, vec = hd % 8 == 0;
    uint4 v[SLOT_BATCH][COL_GROUPS];
#pragma unroll
    for (int u = 0; u < SLOT_BATCH; u++)
#pragma unroll
        for (int gi = 0; gi < COL_GROUPS; gi++) {
            const int64_t col = g0 + gi * 256 + lane * 8;
            const int cn = cols_below(col, c1);
            if (u < n && gi < ng && r[u] >= 0 && cn) v[u][gi] = ld8_bf16(o + (int64_t)r[u] * hd + col, cn, vec && cn == 8);
        }
#pragma unroll
    for (int u = 0; u < SLOT_BATCH; u++)
#pragma unroll
        for (int gi = 0; gi < COL_GROUPS; gi++) {
            const int cn = cols_below(g0 + gi * 256 + lane * 8, c1);
            if (u < n && gi < ng && r[u] >= 0 && cn)
                for (int e = 0; e < 8; e++) part[gi * 8 + e] = fmaf(wj[u], bf16_at(v[u][gi], e), part[gi * 8 + e]);
        }
}

/* Rank q's partial of token x.t (q = group g, tp index tpi): the top-k reduce
 * (ascending slot, fmaf, from 0) over the token's slots in group g, with the
 * bf16 rows of q's o, for columns g0 + gi*256 + lane*8 + e (gi < COL_GROUPS,
 * below c1) into part[gi * 8 + e]. Slots whose lane is beyond the warp are
 * read directly. Every lane of the warp calls it (shuffles). */
__device__ static void rank_partial(const comet_cuda_ctx_t *c, const combine_src_t *src, const combine_lane_t *x,
                                    int32_t g, int tpi, int64_t g0, int64_t c1, float *part) {
    const int64_t hd = c->d.hidden, k = c->d.topk;
    const int tp = c->d.tp;
    const int q = g * tp + tpi;
#pragma unroll
    for (int i = 0; i < COL_GROUPS * 8; i++) part[i] = 0.0f;
    for (int64_t j0 = 0; j0 < k; j0 += SLOT_BATCH) {
        int32_t r[SLOT_BATCH];
        float wj[SLOT_BATCH];
#pragma unroll
        for (int u = 0; u < SLOT_BATCH; u++) {
            const int64_t j = j0 + u, l = j * tp + tpi;
            int32_t gj = -1;
            r[u] = -1, wj[u] = 0.0f;
            if (l < 32) {
                const int32_t rr = __shfl_sync(0xffffffffu, x->row, (int)l);
                const float ww = __shfl_sync(0xffffffffu, x->w, (int)l);
                gj = __shfl_sync(0xffffffffu, x->g, (int)l);
                if (j < k) r[u] = rr, wj[u] = ww;
            } else if (j < k) {
                gj = (int32_t)(src->idx[x->t * k + j] / c->d.experts_local);
                wj[u] = src->unit ? 1.0f : src->wts[x->t * k + j];
                if (gj == g) r[u] = slot_row(c, src, q, tpi, x->t, j);
            }
            if (j >= k || gj != g) r[u] = -1;
        }
        reduce_batch(src->o_of[q], hd, r, wj, SLOT_BATCH, COL_GROUPS, g0, c1, part);
    }
}

/* A 64-bit word of the call in the state (k_enter stored it there), loaded
 * at every use by a volatile load (an L1 hit): plain loads, hoisted and held
 * across the combine's loops, spill registers. */
__device__ static inline uint64_t call_word(const void *p) {
    uint64_t v;
    asm volatile("ld.global.u64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

/* The call's y. */
__device__ static inline uintptr_t call_y(const comet_cuda_ctx_t *c) { return (uintptr_t)call_word(&c->state->call.y); }

/* A lane's sums (its 8 columns of each of COL_GROUPS 256-column groups
 * from g0, those below c1) into token t's y as bf16. */
__device__ static inline void store_y(const comet_cuda_ctx_t *c, int64_t t, int64_t g0, int64_t c1, const float *acc,
                                      int vec_out) {
    const int lane = threadIdx.x % 32;
    comet_bf16_t *y = (comet_bf16_t *)call_y(c);
#pragma unroll
    for (int gi = 0; gi < COL_GROUPS; gi++) {
        const int64_t col = g0 + gi * 256 + lane * 8;
        const int cn = cols_below(col, c1);
        if (cn) st8_bf16(y + t * c->d.hidden + col, acc + gi * 8, cn, vec_out && cn == 8);
    }
}

/* Entries whose rows a lane of the flat combine loads before it uses them:
 * FLAT_BATCH x COL_GROUPS x 16 B = 128 B in flight a lane, twice the group
 * by group batches' (dev/combine: 3.5-3.9 TB/s against 2.9-3.1). */
#define FLAT_BATCH 4

/* A token's entries in the order of the combine's sums, lane e holding the
 * e-th: its row's address (NULL: no row) and weight; bit e of start: the
 * entry opens a new (group, tp index) partial; of has: it has a row. */
typedef struct {
    const comet_bf16_t *row;
    float w;
    uint32_t start, has;
} flat_entry_t;

/* The token's entries (topk x tp <= 32) put in the (group, tp index, slot)
 * order of pull_combine's sums. Every lane calls it. */
__device__ static inline flat_entry_t flat_entry(const comet_cuda_ctx_t *c, const combine_src_t *src,
                                                 const combine_lane_t *x) {
    const int64_t k = c->d.topk;
    const int lane = threadIdx.x % 32, tp = c->d.tp, ents = (int)(k * tp), mine = lane < ents;
    const int32_t q = x->g * tp + lane % tp;
    const int32_t key = mine ? q * (int32_t)k + lane / tp : 0x7fffffff; /* unique: a slot has one group */
    int pos = 0, from = 0;
    for (int l = 0; l < ents; l++) pos += __shfl_sync(0xffffffffu, key, l) < key;
    for (int l = 0; l < ents; l++) from = __shfl_sync(0xffffffffu, pos, l) == lane ? l : from;
    const comet_bf16_t *row = mine && x->row >= 0 ? src->o_of[q] + (int64_t)x->row * c->d.hidden : NULL;
    flat_entry_t f;
    f.row = (const comet_bf16_t *)__shfl_sync(0xffffffffu, (unsigned long long)row, from);
    f.w = __shfl_sync(0xffffffffu, x->w, from);
    const int32_t fq = __shfl_sync(0xffffffffu, q, from), pq = __shfl_up_sync(0xffffffffu, fq, 1);
    f.start = __ballot_sync(0xffffffffu, lane > 0 && lane < ents && fq != pq);
    f.has = __ballot_sync(0xffffffffu, lane < ents && f.row != NULL);
    return f;
}

/* Columns [c0, c1) of token t's y from its ents entries in flat order (f):
 * batches of FLAT_BATCH entries across the (group, tp index) boundaries,
 * each boundary adding the finished partial (an fmaf chain from 0) to acc --
 * the sums of rank_partial and pull_combine, bit for bit, with the loads of
 * a whole batch in flight. Every lane calls it. */
__device__ static void flat_token(const comet_cuda_ctx_t *c, flat_entry_t f, int ents, int64_t t, int64_t c0,
                                  int64_t c1, int vec_out) {
    const int64_t hd = c->d.hidden;
    const int lane = threadIdx.x % 32, vec = hd % 8 == 0;
    for (int64_t g0 = c0; g0 < c1; g0 += 256 * COL_GROUPS) {
        float acc[COL_GROUPS * 8], part[COL_GROUPS * 8];
#pragma unroll
        for (int i = 0; i < COL_GROUPS * 8; i++) acc[i] = 0.0f, part[i] = 0.0f;
        for (int b0 = 0; b0 < ents; b0 += FLAT_BATCH) {
            uint4 v[FLAT_BATCH][COL_GROUPS];
#pragma unroll
            for (int u = 0; u < FLAT_BATCH; u++) {
                const int e = b0 + u;
                const comet_bf16_t *row =
                    (const comet_bf16_t *)__shfl_sync(0xffffffffu, (unsigned long long)f.row, e & 31);
#pragma unroll
                for (int gi = 0; gi < COL_GROUPS; gi++) {
                    const int64_t col = g0 + gi * 256 + lane * 8;
                    const int cn = cols_below(col, c1);
                    if (e < ents && row && cn) v[u][gi] = ld8_bf16(row + col, cn, vec && cn == 8);
                }
            }
#pragma unroll
            for (int u = 0; u < FLAT_BATCH; u++) {
                const int e = b0 + u;
                if (e >= ents) break;
                if (f.start >> e & 1) { /* a new (group, tp index): the finished partial into acc */
#pragma unroll
                    for (int i = 0; i < COL_GROUPS * 8; i++) acc[i] += part[i], part[i] = 0.0f;
                }
                const float wj = __shfl_sync(0xffffffffu, f.w, e & 31);
#pragma unroll
                for (int gi = 0; gi < COL_GROUPS; gi++) {
                    const int cn = cols_below(g0 + gi * 256 + lane * 8, c1);
                    if (f.has >> e & 1 && cn)
                        for (int i = 0; i < 8; i++) part[gi * 8 + i] = fmaf(wj, bf16_at(v[u][gi], i), part[gi * 8 + i]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < COL_GROUPS * 8; i++) acc[i] += part[i];
        store_y(c, t, g0, c1, acc, vec_out);
    }
}

/* Columns [c0, c1) of y for every local token: each contributing rank's
 * partial (rank_partial: from that rank's o rows, pulled or pushed here)
 * summed in ascending rank order (fp32, from 0), stored bf16; flat (a
 * literal at each call, for topk x tp <= 32): the same sums by
 * flat_token, whose registers need the group loop's compiled out. One warp a token, 8
 * columns a lane; a token's routing is fetched over the two tokens before it
 * (local loads two ahead, the rows on the slots' ranks one ahead), so no load
 * is waited on where it was issued. */
__device__ static __forceinline__ void pull_combine(const comet_cuda_ctx_t *c, const comet_plan_t *p,
                                                    const combine_src_t *src, int64_t c0, int64_t c1, const int flat) {
    const int64_t hd = c->d.hidden, s = (int64_t)gridDim.x * (blockDim.x / 32);
    const int64_t n = (int64_t)call_word(&c->state->call.num_tokens); /* and y (call_y) at every store */
    const int tp = c->d.tp;
    const int vec_out = hd % 8 == 0 && (call_y(c) % 16) == 0;
    int64_t t = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    combine_lane_t x0 = combine_lane_local(c, p, src, t, t < n), x1 = combine_lane_local(c, p, src, t + s, t + s < n);
    combine_lane_row(c, src, t < n, &x0);
    for (; t < n; t += s) {
        combine_lane_t x2 = combine_lane_local(c, p, src, t + 2 * s, t + 2 * s < n);
        combine_lane_row(c, src, t + s < n, &x1);
        if (flat) {
            flat_token(c, flat_entry(c, src, &x0), (int)(c->d.topk * tp), t, c0, c1, vec_out);
            x0 = x1, x1 = x2;
            continue;
        }
        for (int64_t g0 = c0; g0 < c1; g0 += 256 * COL_GROUPS) {
            float acc[COL_GROUPS * 8], part[COL_GROUPS * 8];
#pragma unroll
            for (int i = 0; i < COL_GROUPS * 8; i++) acc[i] = 0.0f;
            for (int gi = 0; gi < x0.ng; gi++) {
                const int32_t g = gi < 32 ? __shfl_sync(0xffffffffu, x0.grp, gi & 31)
                                          : p->home_groups[t * c->d.topk + gi];
                for (int tpi = 0; tpi < tp; tpi++) {
                    rank_partial(c, src, &x0, g, tpi, g0, c1, part);
#pragma unroll
                    for (int i = 0; i < COL_GROUPS * 8; i++) acc[i] += part[i];
                }
            }
            store_y(c, t, g0, c1, acc, vec_out);
        }
        x0 = x1, x1 = x2;
    }
}

/* The combine after GEMM1, in both modes (pulling the rows, or reading those pushed here):
 * first the signal (every CTA's thread 0, so that none waits on a CTA not
 * yet resident): my o (and plan), complete as the kernels before this one
 * ended, announced to every rank;
 * then, once every rank's o is complete, y of every local token over all columns;
 * flat (a literal in each kernel): k_final_flat, where the layer's shape
 * allows it (final_flat). */
__device__ static __forceinline__ void final_body(const comet_cuda_ctx_t &c, const int flat) {
    const uint64_t e = c.state->epoch, t0 = TRACE_T0;
    if (threadIdx.x == 0) {
        __threadfence_system();
        for (int q = 0; q < c.d.world_size; q++) st_release_sys(&flags_of(&c, q)->o_ready[c.d.rank], e);
    }
    if (c.state->skip || (c.disable & COMET_DISABLE_COMM)) return; /* the measurement without communication */
    comet_sym_flags_t *mine = flags_of(&c, c.d.rank);
    if (threadIdx.x == 0)
        for (int q = 0; q < c.d.world_size; q++) wait_geq(&mine->o_ready[q], e, &c, "combine: o of rank", q);
    __shared__ combine_src_t src;
    combine_src_init(&c, &src);
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    pull_combine(&c, &p, &src, 0, c.d.hidden, flat);
    if (c.tr_events) {
        __syncthreads();
        if (threadIdx.x == 0) trace_rec(&c, COMM_LANE, COMET_TRACE_COMM, COMM_WORKER, COMET_TRACE_RECV, -1, -1, t0);
    }
}

__global__ void __launch_bounds__(COMM_THREADS, 1) k_final(comet_cuda_ctx_t c) { final_body(c, 0); }
__global__ void __launch_bounds__(COMM_THREADS, 1) k_final_flat(comet_cuda_ctx_t c) { final_body(c, 1); }

/* The combine's entries of a token fit a warp. */
static inline int final_flat(const comet_cuda_ctx_t *c) { return c->d.topk * c->d.tp <= 32; }
