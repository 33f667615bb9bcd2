/*
 * layer/dispatch.cuh - the dispatch: pull my experts' token rows from every
 * rank's stage, by token (each token read once, stored into every row of its
 * slots here; the backward's dy rows the same way). The sequential k_dispatch, and the overlapped mode's
 * k_dispatch_ov (GEMM0 its programmatic dependent), which counts the rows it
 * stores into their blocks (block_rows) and releases block_ready for GEMM0.
 *
 * What it is not: a header to include on its own. It is one room of a single
 * translation unit, src/cuda/layer_chain.cu, which includes the rooms in
 * chain order after the plan, context and vector headers (one unit, not
 * relocatable device code, so that device functions shared between steps
 * still inline and the kernels compile as they did in one file).
 * Not here either: the routing copy before the plan (stage.cuh), the GEMMs
 * (gemm.cu, simt_gemm.cuh), the combine (combine.cuh). Needs flags.cuh.
 */

/* 16-byte loads of each of a warp's two tokens in flight a lane
 * (dispatch_copy): up to 512 threads x 2 x 8 x 16 B = 128 KB outstanding a
 * CTA (with 32 tokens or more, hidden a multiple of 2048), to cover NVLink
 * latency with few CTAs; 2048 columns of a token per step. */
#define PULL_UNROLL 8

/* Tokens whose sources a CTA looks up at once (sequential dispatch). */
#define PULL_ROWS 128

/* The overlapped dispatch scans whole row blocks, one row a thread. */
static_assert(COMM_THREADS % COMET_GEMM_TILE_M == 0, "a CTA's threads cover whole row blocks");

/* Dispatch by token (both modes): each token with rows here (the plan's send
 * lists, local rank first) is read once from its home rank's stage and
 * stored into every row its slots have here (row_of_slot), so a token with
 * several of its top-k experts on this rank crosses NVLink once (TP: every
 * slot of every token). Items (tokens) are numbered over the send lists in
 * stage order; first[q] = items before stage q. */
typedef struct {
    const char *src[COMM_THREADS];      /* the token's row in its home rank's stage */
    const int32_t *rows[COMM_THREADS];  /* its row_of_slot: topk entries, -1 = not here */
    int32_t first[COMET_CUDA_MAX_RANKS + 1];
} dispatch_smem_t;

/* first[] of the send lists (one thread). */
__device__ static void dispatch_items(const comet_cuda_ctx_t *c, const comet_plan_t *p, dispatch_smem_t *sm) {
    const int w = c->d.world_size, r = c->d.rank;
    sm->first[0] = 0;
    for (int q = 0; q < w; q++) sm->first[q + 1] = sm->first[q] + p->send_count[comet_rank_of_stage(r, q, w)];
}

/* Items [i0, i0 + nr) of the send lists by the whole CTA: each token's
 * source (its row of the stage at byte offset field of the home rank's
 * symmetric buffer: x, or the backward's dy) and slot rows into shared
 * memory. */
__device__ static void dispatch_lookup(const comet_cuda_ctx_t *c, const comet_plan_t *p, dispatch_smem_t *sm,
                                       size_t field, int32_t i0, int nr) {
    const int w = c->d.world_size, r = c->d.rank;
    const int64_t topk = c->d.topk, slots = c->d.max_tokens * topk;
    const size_t row_bytes = (size_t)c->d.hidden * 2;
    __syncthreads(); /* the previous batch's sources are no longer read */
    for (int k = threadIdx.x; k < nr; k += blockDim.x) {
        int q = 0;
        while (sm->first[q + 1] <= i0 + k) q++;
        const int s = comet_rank_of_stage(r, q, w);
        const int32_t t = p->send_tokens[(int64_t)s * c->d.max_tokens + (i0 + k - sm->first[q])];
        sm->src[k] = c->peers[s] + field + (size_t)t * row_bytes;
        sm->rows[k] = p->row_of_slot + s * slots + t * topk;
    }
    __syncthreads();
}

/* The nr tokens of shared memory by the whole CTA, a warp two tokens at a
 * time (one, where fewer tokens than 2 x warps are left): each lane keeps
 * PULL_UNROLL 16-byte loads of each token in flight,
 * the tokens' slot rows are looked up once (lane j holds slot j's row), then
 * every word is stored into each row. dev/pull/fanout measured this against
 * the CTA-wide pattern it replaced (a word's token and slot rows looked up
 * at each store): 16 CTAs store 1.7x more (894 against 534 GB/s, 4 rows a
 * token, near those SMs' 957 GB/s store ceiling), 132 CTAs 1.6x. Loop trip
 * counts depend on the warp only (the shuffles). */
__device__ static void dispatch_copy(const comet_cuda_ctx_t *c, const dispatch_smem_t *sm, comet_bf16_t *dst, int nr) {
    const int64_t topk = c->d.topk;
    const size_t row_bytes = (size_t)c->d.hidden * 2;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    if (row_bytes % 16) { /* hidden % 8 != 0: one warp a token and row, narrower accesses */
        for (int k = warp; k < nr; k += warps)
            for (int64_t j = 0; j < topk; j++) {
                const int32_t row = sm->rows[k][j];
                if (row >= 0) copy_bytes((char *)dst + row * row_bytes, sm->src[k], row_bytes, lane, 32);
            }
        return;
    }
    const uint32_t words = (uint32_t)(row_bytes / 16);
    /* tokens warp + q x warps: q even the first of the pair, q odd the second
     * (so fewer tokens than 2 x warps still spread over all the warps) */
    for (int k0 = warp; k0 < nr; k0 += 2 * warps) {
        const int two = k0 + warps < nr;
        const int k1 = two ? k0 + warps : k0;
        const uint4 *s0 = (const uint4 *)sm->src[k0], *s1 = (const uint4 *)sm->src[k1];
        const int32_t *r0 = sm->rows[k0], *r1 = sm->rows[k1];
        const int32_t m0 = lane < topk ? r0[lane] : -1, m1 = two && lane < topk ? r1[lane] : -1;
        for (uint32_t b0 = 0; b0 < words; b0 += 32 * PULL_UNROLL) {
            uint4 v0[PULL_UNROLL], v1[PULL_UNROLL];
#pragma unroll
            for (int u = 0; u < PULL_UNROLL; u++) {
                const uint32_t i = b0 + 32 * u + (uint32_t)lane;
                if (i < words) {
                    v0[u] = s0[i];
                    if (two) v1[u] = s1[i];
                }
            }
            for (int64_t j = 0; j < topk; j++) {
                const int32_t d0 = j < 32 ? __shfl_sync(0xffffffffu, m0, (int)j) : r0[j];
                const int32_t d1 = j < 32 ? __shfl_sync(0xffffffffu, m1, (int)j) : two ? r1[j] : -1;
                uint4 *p0 = (uint4 *)((char *)dst + (size_t)(d0 < 0 ? 0 : d0) * row_bytes); /* used where >= 0 */
                uint4 *p1 = (uint4 *)((char *)dst + (size_t)(d1 < 0 ? 0 : d1) * row_bytes);
#pragma unroll
                for (int u = 0; u < PULL_UNROLL; u++) {
                    const uint32_t i = b0 + 32 * u + (uint32_t)lane;
                    if (i >= words) continue;
                    if (d0 >= 0) p0[i] = v0[u];
                    if (d1 >= 0) p1[i] = v1[u];
                }
            }
        }
    }
}

/* Sequential dispatch of the stage at byte offset field into dst: CTAs take
 * PULL_ROWS tokens at a time. */
__device__ static void dispatch_seq(const comet_cuda_ctx_t &c, const comet_plan_t *p, dispatch_smem_t *sm, size_t field,
                                    comet_bf16_t *dst) {
    const int32_t items = sm->first[c.d.world_size];
    for (int32_t i0 = blockIdx.x * PULL_ROWS; i0 < items; i0 += gridDim.x * PULL_ROWS) {
        const uint64_t t0 = TRACE_T0;
        const int nr = items - i0 < PULL_ROWS ? items - i0 : PULL_ROWS;
        dispatch_lookup(&c, p, sm, field, i0, nr);
        dispatch_copy(&c, sm, dst, nr);
        if (c.tr_events) {
            __syncthreads();
            if (threadIdx.x == 0)
                trace_rec(&c, COMM_LANE, COMET_TRACE_COMM, COMM_WORKER, COMET_TRACE_PULL, i0 / PULL_ROWS, -1, t0);
        }
    }
}

/* Sequential dispatch: x's rows into a; the backward's dy rows into o too. */
__global__ void __launch_bounds__(COMM_THREADS, 1) k_dispatch(comet_cuda_ctx_t c) {
    __shared__ dispatch_smem_t sm;
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    if (threadIdx.x == 0) dispatch_items(&c, &p, &sm);
    __syncthreads();
    dispatch_seq(c, &p, &sm, c.lay.x, c.a);
    if (c.state->call.pass == 1) dispatch_seq(c, &p, &sm, c.lay.dy, c.o);
}

/* ---------------------------------------------------------------------------
 * Overlapped mode: communication CTAs beside the GEMM CTAs (cuda_layer.h)
 * ------------------------------------------------------------------------- */

/* One stored row (>= 0) counted into its block; whoever completes the block
 * releases block_ready[b] = e. The caller fenced the rows the count covers. */
__device__ static inline void count_row(const comet_cuda_ctx_t *c, const comet_plan_t *p, int32_t row, uint64_t e) {
    const int32_t b = row / (int32_t)c->d.tile_m; /* blocks tile the padded rows in order (plan.h) */
    if (atomicAdd(&c->block_rows[b], 1u) + 1u == (uint32_t)p->blocks[b].num_rows) {
        __threadfence(); /* every row of the block (counted before), then the flag */
        st_release_gpu(&c->block_ready[b], e);
    }
}

/* Count the rows of the nr tokens in shared memory into their blocks
 * (block_rows); whoever completes a block releases block_ready[b] = epoch,
 * which GEMM0 waits for. */
__device__ static void dispatch_count(const comet_cuda_ctx_t *c, const comet_plan_t *p, const dispatch_smem_t *sm,
                                      int nr, uint64_t e) {
    __threadfence(); /* this CTA's rows, before any block count that includes them */
    __syncthreads();
    for (int k = threadIdx.x; k < nr; k += blockDim.x)
        for (int64_t j = 0; j < c->d.topk; j++)
            if (sm->rows[k][j] >= 0) count_row(c, p, sm->rows[k][j], e);
}

/* The row of a remote token (home rank src_rank) in that rank's stage. */
__device__ static inline const char *remote_src(const comet_cuda_ctx_t *c, int32_t src_rank, int32_t src_token) {
    return c->peers[src_rank] + c->lay.x + (size_t)src_token * (size_t)c->d.hidden * 2;
}

/* Layer 0 of the overlapped mode, one CTA per SM. CTAs n_comm.. copy the
 * local tokens (by token, as the sequential dispatch) and exit: GEMM0, the
 * programmatic dependent launched right after on every SM, starts on their
 * SMs with the local-only row blocks (l0_order begins with them). CTAs
 * 0..n_comm-1 pull the remote tokens meanwhile, blockDim.x / tile_m row
 * blocks a pass in l0_order (GEMM0's order), each token when its first row
 * in that order is reached:
 * read once, stored into all its rows; so blocks complete in the order
 * GEMM0 takes them, and every token crosses NVLink once. Each batch's rows
 * are counted into their blocks (dispatch_count). All these CTAs are
 * resident before any GEMM0 CTA (which takes their SMs as they exit), so
 * GEMM0's waits cannot starve them. */
__global__ void __launch_bounds__(COMM_THREADS, 1) k_dispatch_ov(comet_cuda_ctx_t c) {
    __shared__ dispatch_smem_t sm;
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    const uint64_t e = c.state->epoch;
    const int copy = !(c.disable & COMET_DISABLE_COMM);
    const int n_comm = c.n_comm, me = c.d.rank;
    if ((int)blockIdx.x >= n_comm) { /* local tokens: items [0, first[1]) of the send lists */
        if (threadIdx.x == 0) dispatch_items(&c, &p, &sm);
        __syncthreads();
        /* batches sized to spread the tokens over all these CTAs (16..PULL_ROWS) */
        const int32_t items = sm.first[1], nl = (int32_t)gridDim.x - n_comm;
        int32_t per = (items + nl - 1) / nl;
        per = per < 16 ? 16 : per > PULL_ROWS ? PULL_ROWS : per;
        for (int32_t i0 = ((int32_t)blockIdx.x - n_comm) * per; i0 < items; i0 += nl * per) {
            const uint64_t t0 = TRACE_T0;
            const int nr = items - i0 < per ? items - i0 : per;
            dispatch_lookup(&c, &p, &sm, c.lay.x, i0, nr);
            if (copy) dispatch_copy(&c, &sm, c.a, nr);
            dispatch_count(&c, &p, &sm, nr, e);
            if (c.tr_events) {
                __syncthreads();
                if (threadIdx.x == 0)
                    trace_rec(&c, COMM_LANE, COMET_TRACE_COMM, COMM_WORKER, COMET_TRACE_PULL, i0 / per, -1, t0);
            }
        }
        return;
    }
    const int64_t topk = c.d.topk, slots = c.d.max_tokens * topk;
    /* one row a thread: blockDim.x / tile_m blocks a pass (tile_m is 128: comet_gemm_check) */
    const int32_t nb = p.totals->num_blocks, l0 = p.stage_end[0], tm = (int32_t)c.d.tile_m;
    const int32_t per_pass = (int32_t)blockDim.x / tm;
    __shared__ int n;
    for (int32_t g = l0 + (int32_t)blockIdx.x * per_pass; g < nb; g += n_comm * per_pass) {
        const uint64_t t0 = TRACE_T0;
        __syncthreads(); /* the previous batch is no longer read */
        if (threadIdx.x == 0) n = 0;
        __syncthreads();
        const int32_t li = g + (int32_t)threadIdx.x / tm, k = (int32_t)threadIdx.x % tm;
        const comet_plan_block_t blk = p.blocks[p.l0_order[li < nb ? li : g]];
        const int32_t row = blk.row_start + k;
        const comet_plan_row_t pr = p.rows[row];
        if (li < nb && k < blk.num_rows && pr.src_rank != me) { /* a remote row (the other CTAs copy local ones) */
            /* the token comes with its first row in l0_order, (its block's stage, row) least */
            const int32_t *ros = p.row_of_slot + pr.src_rank * slots + (int64_t)pr.src_token * topk;
            const int64_t key = (int64_t)blk.stage << 32 | row;
            int64_t lo = key;
            for (int64_t j = 0; j < topk; j++) {
                const int32_t r = ros[j];
                if (r < 0) continue;
                const int64_t k2 = (int64_t)p.blocks[r / tm].stage << 32 | r;
                lo = k2 < lo ? k2 : lo;
            }
            if (lo == key) { /* it comes now, with all its rows */
                const int at = atomicAdd(&n, 1);
                sm.src[at] = remote_src(&c, pr.src_rank, pr.src_token);
                sm.rows[at] = ros;
            }
        }
        __syncthreads();
        const int nr = n, pass = (g - l0) / per_pass;
        /* traced: the pass's lookup (aux 2) and copy (aux 3) as parts of it (the rest is the count) */
        const uint64_t t1 = TRACE_T0;
        if (c.tr_events && threadIdx.x == 0)
            trace_rec(&c, COMM_LANE, COMET_TRACE_COMM, COMM_WORKER, COMET_TRACE_PULL, pass, 2, t0);
        if (copy) dispatch_copy(&c, &sm, c.a, nr);
        if (c.tr_events) {
            __syncthreads();
            if (threadIdx.x == 0) trace_rec(&c, COMM_LANE, COMET_TRACE_COMM, COMM_WORKER, COMET_TRACE_PULL, pass, 3, t1);
        }
        dispatch_count(&c, &p, &sm, nr, e);
        if (c.tr_events) {
            __syncthreads();
            if (threadIdx.x == 0) trace_rec(&c, COMM_LANE, COMET_TRACE_COMM, COMM_WORKER, COMET_TRACE_PULL, pass, 1, t0);
        }
    }
}
