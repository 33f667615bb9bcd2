/*
 * layer_kernels.cu - the CUDA layer: one forward as a chain of kernels on
 * the caller's stream, with no host synchronisation (cuda_layer.h lists the
 * steps and the flag protocol): the sequential chain, and the overlapped
 * mode (Hopper GEMM): k_dispatch_ov with GEMM0 as its programmatic
 * dependent; GEMM1 on every SM (pushing its rows home with the push
 * combine), then the combine.
 *
 * The expert GEMMs run on the Hopper grouped GEMM (gemm.cu) when the shapes
 * suit it (comet_gemm_check), else on the simple SIMT tiles below, which are
 * correct for any shape.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#define COMET_PLAN_DEVICE_ONLY
#define COMET_PLAN_API static __device__
#include "../plan/plan_impl.h"

#include "cuda_layer.h"
#include "gemm.h"
#include "plan_kernel.h"
#include "vec8.h"
#include "../trace/trace.h"
#include "comet.h"

/* ---------------------------------------------------------------------------
 * Flags and waits
 * ------------------------------------------------------------------------- */

__device__ static inline void st_release_sys(uint64_t *p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ static inline uint64_t ld_acquire_sys(const uint64_t *p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ static inline void st_release_gpu(uint64_t *p, uint64_t v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ static inline uint64_t globaltimer(void) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* One trace event from t0 to now into a lane (no-op when not tracing). */
__device__ static void trace_rec(const comet_cuda_ctx_t *c, int lane, int role, int worker, int kind, int index,
                                 int aux, uint64_t t0) {
    if (!c->tr_events) return;
    const unsigned n = atomicAdd(&c->tr_counts[lane], 1u);
    if (n >= c->tr_capacity) return; /* counted, so the host reports it as dropped */
    comet_trace_event_t ev;
    ev.t_begin_ns = t0, ev.t_end_ns = globaltimer();
    ev.index = index, ev.aux = aux;
    ev.rank = (uint16_t)c->d.rank, ev.worker = (uint16_t)worker;
    ev.role = (uint8_t)role, ev.kind = (uint8_t)kind;
    ev.call = (uint16_t)c->state->epoch;
    ((comet_trace_event_t *)c->tr_events)[(size_t)lane * c->tr_capacity + n] = ev;
}

/* Threads of a CTA that moves rows (dispatch, combine, final sum; in the
 * overlapped mode one such CTA an SM beside the GEMM's). */
#define COMM_THREADS 512

/* The comm lane and worker of this CTA. */
#define COMM_LANE (1 + (int)(blockIdx.x % 8))
#define COMM_WORKER ((int)(blockIdx.x % 8))
#define TRACE_T0 (c.tr_events ? globaltimer() : 0)

/* Spin until *flag >= target; on timeout name rank, role and index, then
 * trap. Not inlined, and given scalars only, so that its printf takes no
 * registers from the data movers that call it. */
__device__ static __noinline__ void wait_flag(const uint64_t *flag, uint64_t target, uint64_t timeout_ns, int rank,
                                              const char *role, int index) {
    uint64_t start = globaltimer();
    uint64_t v;
    while ((v = ld_acquire_sys(flag)) < target) {
        if (globaltimer() - start > timeout_ns) {
            printf("comet: rank %d %s %d: timed out after %llu ms waiting for a flag (%llu < %llu)\n", rank, role,
                   index, (unsigned long long)(timeout_ns / 1000000), (unsigned long long)v,
                   (unsigned long long)target);
            __trap();
        }
        __nanosleep(64);
    }
}

__device__ static inline void wait_geq(const uint64_t *flag, uint64_t target, const comet_cuda_ctx_t *c,
                                       const char *role, int index) {
    wait_flag(flag, target, c->timeout_ns, c->d.rank, role, index);
}

__device__ static inline comet_sym_flags_t *flags_of(const comet_cuda_ctx_t *c, int q) {
    return (comet_sym_flags_t *)(c->peers[q] + c->lay.flags);
}

/* Copy n bytes with the widest access both pointers and n allow. */
__device__ static void copy_bytes(void *dst, const void *src, size_t n, size_t tid, size_t nthreads) {
    if ((((uintptr_t)dst | (uintptr_t)src | n) & 15) == 0) {
        uint4 *d = (uint4 *)dst;
        const uint4 *s = (const uint4 *)src;
        for (size_t i = tid; i < n / 16; i += nthreads) d[i] = s[i];
    } else if ((((uintptr_t)dst | (uintptr_t)src | n) & 3) == 0) {
        uint32_t *d = (uint32_t *)dst;
        const uint32_t *s = (const uint32_t *)src;
        for (size_t i = tid; i < n / 4; i += nthreads) d[i] = s[i];
    } else {
        uint16_t *d = (uint16_t *)dst;
        const uint16_t *s = (const uint16_t *)src;
        for (size_t i = tid; i < n / 2; i += nthreads) d[i] = s[i];
    }
}

/* 16-byte loads a thread of copy_wide keeps in flight: copy_bytes has one
 * at a time (a store between loads, which the compiler may not pass), ~0.8
 * TB/s with 256 threads an SM where HBM wants ~18 KB in flight an SM. */
#define COPY_UNROLL 8

/* copy_bytes for large copies by whole grids: where both pointers are
 * 16-byte aligned, the whole 16-byte words with COPY_UNROLL loads in flight
 * a thread, the tail (n % 16 bytes) by copy_bytes. */
__device__ static void copy_wide(void *dst, const void *src, size_t n, size_t tid, size_t nthreads) {
    if ((((uintptr_t)dst | (uintptr_t)src) & 15) != 0) {
        copy_bytes(dst, src, n, tid, nthreads);
        return;
    }
    uint4 *d = (uint4 *)dst;
    const uint4 *s = (const uint4 *)src;
    const size_t n16 = n / 16;
    if (n % 16) copy_bytes((char *)dst + n16 * 16, (const char *)src + n16 * 16, n % 16, tid, nthreads);
    for (size_t base = tid; base < n16; base += nthreads * COPY_UNROLL) {
        uint4 v[COPY_UNROLL];
#pragma unroll
        for (int u = 0; u < COPY_UNROLL; u++)
            if (base + u * nthreads < n16) v[u] = s[base + u * nthreads];
#pragma unroll
        for (int u = 0; u < COPY_UNROLL; u++)
            if (base + u * nthreads < n16) d[base + u * nthreads] = v[u];
    }
}

/* ---------------------------------------------------------------------------
 * enter / stage / publish / plan
 * ------------------------------------------------------------------------- */

/* The call's tensors into the state (every kernel after this one reads them
 * there), the next epoch, and wait until every rank is done with the last. */
__global__ void k_enter(comet_cuda_ctx_t c, comet_cuda_call_t call) {
    comet_cuda_state_t *s = c.state;
    s->call = call;
    uint64_t e = s->epoch + 1;
    s->epoch = e;
    s->own_status = 0;
    for (int q = 0; q < c.d.world_size; q++) wait_geq(&flags_of(&c, q)->done, e - 1, &c, "enter: done of rank", q);
}

__global__ void k_stage(comet_cuda_ctx_t c) {
    const comet_cuda_call_t a = c.state->call;
    if (a.host_status) {
        if (blockIdx.x == 0 && threadIdx.x == 0) atomicMax(&c.state->own_status, a.host_status);
        return;
    }
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, nth = (size_t)gridDim.x * blockDim.x;
    const int64_t t = a.num_tokens, k = c.d.topk;
    copy_wide(c.sym + c.lay.x, a.x, (size_t)(t * c.d.hidden) * 2, tid, nth);
    copy_wide(c.sym + c.lay.topk_idx, a.topk_idx, (size_t)(t * k) * 4, tid, nth);
    copy_wide(c.sym + c.lay.topk_w, a.topk_w, (size_t)(t * k) * 4, tid, nth);
    for (size_t i = tid; i < (size_t)t; i += nth) { /* the routing check of include/comet.h */
        const int32_t *row = a.topk_idx + i * k;
        int bad = 0;
        for (int64_t j = 0; j < k; j++) {
            bad |= row[j] < 0 || row[j] >= c.d.num_experts;
            for (int64_t m = 0; m < j; m++) bad |= row[m] == row[j];
        }
        if (bad) atomicMax(&c.state->own_status, 3u /* COMET_ERR_INVALID_ROUTING */);
    }
    __threadfence_system();
}

/* Publish my staged inputs, wait for every rank's; decide whether this
 * epoch runs. */
__global__ void k_plan(comet_cuda_ctx_t c) {
    if (threadIdx.x != 0) return;
    comet_cuda_state_t *s = c.state;
    const uint64_t e = s->epoch, t0 = TRACE_T0;
    const uint64_t mode = c.protocol; /* every rank must run the same (comet_cuda_protocol_word) */
    comet_sym_flags_t *own = flags_of(&c, c.d.rank);
    own->status = s->own_status;
    own->token_count = (uint64_t)s->call.num_tokens;
    own->mode = mode;
    __threadfence_system();
    st_release_sys(&own->entry, e);
    uint32_t bad = 0, other_mode = 0;
    for (int q = 0; q < c.d.world_size; q++) {
        comet_sym_flags_t *f = flags_of(&c, q);
        wait_geq(&f->entry, e, &c, "plan: entry of rank", q);
        bad |= f->status != 0;
        other_mode |= f->mode != mode;
        s->token_count[q] = (int64_t)f->token_count;
    }
    s->skip = bad | other_mode;
    s->last_status = s->own_status ? s->own_status
                     : bad         ? 4u  /* COMET_ERR_PEER_FAILED */
                     : other_mode  ? 1u  /* COMET_ERR_INVALID_ARGUMENT: the ranks' protocols differ */
                                   : 0u;
    trace_rec(&c, 0, COMET_TRACE_HOST, 0, COMET_TRACE_BARRIER, 1, -1, t0);
    /* the plan itself: comet_cuda_plan_build, launched next */
}

/* 16-byte loads of each of a warp's two tokens in flight a lane
 * (dispatch_copy): up to 512 threads x 2 x 8 x 16 B = 128 KB outstanding a
 * CTA (with 32 tokens or more, hidden a multiple of 2048), to cover NVLink
 * latency with few CTAs; 2048 columns of a token per step. */
#define PULL_UNROLL 8

/* Tokens whose sources a CTA looks up at once (sequential dispatch). */
#define PULL_ROWS 128

/* The overlapped dispatch scans whole row blocks, one row a thread. */
static_assert(COMM_THREADS % COMET_GEMM_TILE_M == 0, "a CTA's threads cover whole row blocks");

/* Every rank's staged routing copied here by all CTAs, so that the plan
 * builder reads local memory instead of waiting on remote loads; and, in the
 * overlapped mode, the dispatch's row counts per block zeroed. */
__global__ void k_gather_routing(comet_cuda_ctx_t c) {
    comet_cuda_state_t *s = c.state;
    if (s->skip) return;
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, nth = (size_t)gridDim.x * blockDim.x;
    if (c.n_comm > 0) /* the overlapped dispatch counts rows per block from 0 */
        for (size_t b = tid; b < (size_t)c.d.max_blocks; b += nth) c.block_rows[b] = 0;
    for (int q = 0; q < c.d.world_size; q++) {
        const size_t n = (size_t)(s->token_count[q] * c.d.topk) * 4;
        copy_wide(s->route_idx[q], s->peer_idx[q], n, tid, nth);
        copy_wide(s->route_w[q], s->peer_w[q], n, tid, nth);
    }
}

/* ---------------------------------------------------------------------------
 * dispatch: pull my experts' token rows from every rank's stage
 * ------------------------------------------------------------------------- */

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
 * source and slot rows into shared memory. */
__device__ static void dispatch_lookup(const comet_cuda_ctx_t *c, const comet_plan_t *p, dispatch_smem_t *sm,
                                       int32_t i0, int nr) {
    const int w = c->d.world_size, r = c->d.rank;
    const int64_t topk = c->d.topk, slots = c->d.max_tokens * topk;
    const size_t row_bytes = (size_t)c->d.hidden * 2;
    __syncthreads(); /* the previous batch's sources are no longer read */
    for (int k = threadIdx.x; k < nr; k += blockDim.x) {
        int q = 0;
        while (sm->first[q + 1] <= i0 + k) q++;
        const int s = comet_rank_of_stage(r, q, w);
        const int32_t t = p->send_tokens[(int64_t)s * c->d.max_tokens + (i0 + k - sm->first[q])];
        sm->src[k] = c->peers[s] + c->lay.x + (size_t)t * row_bytes;
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
__device__ static void dispatch_copy(const comet_cuda_ctx_t *c, const dispatch_smem_t *sm, int nr) {
    const int64_t topk = c->d.topk;
    const size_t row_bytes = (size_t)c->d.hidden * 2;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    if (row_bytes % 16) { /* hidden % 8 != 0: one warp a token and row, narrower accesses */
        for (int k = warp; k < nr; k += warps)
            for (int64_t j = 0; j < topk; j++) {
                const int32_t row = sm->rows[k][j];
                if (row >= 0) copy_bytes((char *)c->a + row * row_bytes, sm->src[k], row_bytes, lane, 32);
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
                uint4 *p0 = (uint4 *)((char *)c->a + (size_t)(d0 < 0 ? 0 : d0) * row_bytes); /* used where >= 0 */
                uint4 *p1 = (uint4 *)((char *)c->a + (size_t)(d1 < 0 ? 0 : d1) * row_bytes);
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

/* Sequential dispatch: CTAs take PULL_ROWS tokens at a time. */
__global__ void __launch_bounds__(COMM_THREADS, 1) k_dispatch(comet_cuda_ctx_t c) {
    __shared__ dispatch_smem_t sm;
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    if (threadIdx.x == 0) dispatch_items(&c, &p, &sm);
    __syncthreads();
    const int32_t items = sm.first[c.d.world_size];
    for (int32_t i0 = blockIdx.x * PULL_ROWS; i0 < items; i0 += gridDim.x * PULL_ROWS) {
        const uint64_t t0 = TRACE_T0;
        const int nr = items - i0 < PULL_ROWS ? items - i0 : PULL_ROWS;
        dispatch_lookup(&c, &p, &sm, i0, nr);
        dispatch_copy(&c, &sm, nr);
        if (c.tr_events) {
            __syncthreads();
            if (threadIdx.x == 0)
                trace_rec(&c, COMM_LANE, COMET_TRACE_COMM, COMM_WORKER, COMET_TRACE_PULL, i0 / PULL_ROWS, -1, t0);
        }
    }
}

/* ---------------------------------------------------------------------------
 * Simple grouped GEMM tiles: 64 rows x 64 columns per block, 256 threads,
 * 4x4 outputs per thread, fp32 accumulation. out = A (rows, K) * B (N, K)^T.
 * ------------------------------------------------------------------------- */

#define TILE 64
#define TK 32

/* acc[i][j] += sum_k A[row0 + ty*4 + i][k] * B[col0 + tx*4 + j][k] */
__device__ static void tile_mac(const comet_bf16_t *a, int64_t lda, int rows, const comet_bf16_t *b,
                                int64_t ldb, int cols, int64_t kdim, float acc[4][4]) {
    __shared__ float as[TK][TILE + 1], bs[TK][TILE + 1];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    for (int64_t k0 = 0; k0 < kdim; k0 += TK) {
        for (int i = threadIdx.x; i < TILE * TK; i += blockDim.x) {
            int r = i / TK, k = i % TK;
            as[k][r] = r < rows && k0 + k < kdim ? comet_bf16_to_f32(a[r * lda + k0 + k]) : 0.0f;
            bs[k][r] = r < cols && k0 + k < kdim ? comet_bf16_to_f32(b[r * ldb + k0 + k]) : 0.0f;
        }
        __syncthreads();
        for (int k = 0; k < TK; k++)
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) acc[i][j] += as[k][ty * 4 + i] * bs[k][tx * 4 + j];
        __syncthreads();
    }
}

/* h = act(a W1^T): columns [n0, n0+64) of the activation; gated uses W1 rows
 * n (gate) and F_local + n (up). */
__global__ void k_gemm0(comet_cuda_ctx_t c) {
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    const int64_t hd = c.d.hidden, fl = c.d.ffn_local, n0 = (int64_t)blockIdx.x * TILE;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16, gated = c.d.activation == 0;
    const int cols = (int)(fl - n0 < TILE ? fl - n0 : TILE);
    for (int bi = blockIdx.y; bi < p.totals->num_blocks; bi += gridDim.y) {
        const comet_plan_block_t blk = p.blocks[bi];
        const comet_bf16_t *w1 = c.w1 + (int64_t)blk.expert * c.d.w1_rows * hd;
        for (int r0 = 0; r0 < blk.num_rows; r0 += TILE) {
            const int rows = blk.num_rows - r0 < TILE ? blk.num_rows - r0 : TILE;
            const comet_bf16_t *a = c.a + (int64_t)(blk.row_start + r0) * hd;
            float g[4][4] = {{0}}, u[4][4] = {{0}};
            tile_mac(a, hd, rows, w1 + n0 * hd, hd, cols, hd, g);
            if (gated) tile_mac(a, hd, rows, w1 + (fl + n0) * hd, hd, cols, hd, u);
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) {
                    int r = ty * 4 + i, n = tx * 4 + j;
                    if (r >= rows || n >= cols) continue;
                    float v = gated ? comet_silu(g[i][j]) * u[i][j] : comet_gelu(g[i][j]);
                    c.h[(int64_t)(blk.row_start + r0 + r) * fl + n0 + n] = comet_f32_to_bf16(v);
                }
        }
    }
}

/* o = h W2^T: columns [c0, c0+64) of hidden. */
__global__ void k_gemm1(comet_cuda_ctx_t c) {
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    const int64_t hd = c.d.hidden, fl = c.d.ffn_local, c0 = (int64_t)blockIdx.x * TILE;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int cols = (int)(hd - c0 < TILE ? hd - c0 : TILE);
    for (int bi = blockIdx.y; bi < p.totals->num_blocks; bi += gridDim.y) {
        const comet_plan_block_t blk = p.blocks[bi];
        const comet_bf16_t *w2 = c.w2 + (int64_t)blk.expert * hd * fl;
        for (int r0 = 0; r0 < blk.num_rows; r0 += TILE) {
            const int rows = blk.num_rows - r0 < TILE ? blk.num_rows - r0 : TILE;
            float acc[4][4] = {{0}};
            tile_mac(c.h + (int64_t)(blk.row_start + r0) * fl, fl, rows, w2 + c0 * fl, fl, cols, fl, acc);
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) {
                    int r = ty * 4 + i, n = tx * 4 + j;
                    if (r < rows && n < cols) c.o[(int64_t)(blk.row_start + r0 + r) * hd + c0 + n] = comet_f32_to_bf16(acc[i][j]);
                }
        }
    }
}

/* ---------------------------------------------------------------------------
 * combine / signal / final / exit
 * ------------------------------------------------------------------------- */

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
        x.w = src->wts[t * k + j];
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
                wj[u] = src->wts[x->t * k + j];
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

/* The combine of the sequential chain (and of the overlapped mode with push):
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

/* Trace: mark where a step starts (end 0) or record it (end 1) as one
 * interval: which 0 and 1 are GEMM0 and GEMM1 (their own lanes), 2 the plan
 * (the stream's lane; index: 0 the routing copy, 1 and 2 the builder's
 * count and fill-and-finish kernels, each with the launch gap before it; 2
 * the whole builder where the sequential one runs). The kernels
 * of those steps record nothing themselves. */
__global__ void k_mark(comet_cuda_ctx_t c, int which, int end, int index) {
    if (!end) {
        c.state->mark_begin[which] = globaltimer();
        return;
    }
    if (which == 2)
        trace_rec(&c, 0, COMET_TRACE_HOST, 0, COMET_TRACE_PLAN, index, -1, c.state->mark_begin[2]);
    else
        trace_rec(&c, 9 + which, COMET_TRACE_GEMM, which, which ? COMET_TRACE_GEMM1 : COMET_TRACE_GEMM0, -1, -1,
                  c.state->mark_begin[which]);
}

__global__ void k_exit(comet_cuda_ctx_t c) {
    __threadfence_system();
    st_release_sys(&flags_of(&c, c.d.rank)->done, c.state->epoch);
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
            dispatch_lookup(&c, &p, &sm, i0, nr);
            if (copy) dispatch_copy(&c, &sm, nr);
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
        if (copy) dispatch_copy(&c, &sm, nr);
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

/* ---------------------------------------------------------------------------
 * Host side
 * ------------------------------------------------------------------------- */

extern "C" const void *comet_cuda_enter_kernel(void) { return (const void *)k_enter; }

/* Load every kernel of the layer now: with lazy module loading, a kernel
 * loaded for the first time while another spins on a flag can deadlock. */
extern "C" int comet_cuda_layer_warm(void) {
    const void *fns[] = {(const void *)k_enter, (const void *)k_stage, (const void *)k_plan,
                         (const void *)k_gather_routing,
                         (const void *)k_dispatch, (const void *)k_gemm0, (const void *)k_gemm1,
                         (const void *)k_final,
                         (const void *)k_final_flat, (const void *)k_exit,
                         (const void *)k_dispatch_ov,
                         (const void *)k_mark};
    for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
        cudaFuncAttributes a;
        cudaError_t e = cudaFuncGetAttributes(&a, fns[i]);
        if (e != cudaSuccess) return (int)e;
    }
    return comet_gemm_warm();
}

/* Hopper GEMM `which` (0 or 1) with hooks, marked for the trace (a launch
 * programmatically dependent on the kernel before it, hooks->pdl, must follow
 * that kernel directly: its begin mark goes before that kernel instead). */
static int launch_gemm(const comet_cuda_ctx_t *c, int which, const comet_gemm_hooks_t *hooks, cudaStream_t stream) {
    if (c->tr_events && !hooks->pdl) k_mark<<<1, 1, 0, stream>>>(*c, which, 0, -1);
    const int ge = which ? comet_gemm1_launch((const comet_gemm_t *)c->gemm, stream, hooks)
                         : comet_gemm0_launch((const comet_gemm_t *)c->gemm, stream, hooks);
    if (ge != cudaSuccess) return ge;
    if (c->tr_events) k_mark<<<1, 1, 0, stream>>>(*c, which, 1, -1);
    return cudaSuccess;
}

static int forward_chain(const comet_cuda_ctx_t *ctx, cudaStream_t stream);

extern "C" int comet_cuda_forward_launch(const comet_cuda_ctx_t *ctx, const comet_cuda_call_t *call, void *stream_ptr) {
    cudaStream_t stream = (cudaStream_t)stream_ptr;
    const comet_cuda_ctx_t c = *ctx;
    const int grid = c.num_sms > 0 ? c.num_sms : 132;
    k_enter<<<1, 1, 0, stream>>>(c, *call);
    k_stage<<<grid, 256, 0, stream>>>(c);
    k_plan<<<1, 32, 0, stream>>>(c);
    const int e = forward_chain(&c, stream);
    if (e != cudaSuccess) return e;
    k_exit<<<1, 1, 0, stream>>>(c);
    return (int)cudaGetLastError();
}

/* Tracing: the plan step `step` ends here and the next begins (the
 * builder's hook between its kernels; arg is the comet_cuda_ctx_t). */
static cudaError_t plan_mark(void *arg, int step, cudaStream_t stream) {
    const comet_cuda_ctx_t *c = (const comet_cuda_ctx_t *)arg;
    k_mark<<<1, 1, 0, stream>>>(*c, 2, 1, step);
    k_mark<<<1, 1, 0, stream>>>(*c, 2, 0, -1);
    return cudaGetLastError();
}

static int forward_chain(const comet_cuda_ctx_t *ctx, cudaStream_t stream) {
    const comet_cuda_ctx_t c = *ctx;
    const comet_dims_t *d = &c.d;
    const int grid = c.num_sms > 0 ? c.num_sms : 132;
    const unsigned blocks_y = (unsigned)(d->max_blocks < 65535 ? d->max_blocks : 65535);
    if (c.tr_events) k_mark<<<1, 1, 0, stream>>>(c, 2, 0, -1);
    k_gather_routing<<<grid, 256, 0, stream>>>(c);
    if (c.tr_events) {
        const cudaError_t me = plan_mark((void *)&c, 0, stream);
        if (me != cudaSuccess) return (int)me;
    }
    comet_plan_input_t in;
    in.token_count = c.state->token_count; /* device addresses inside the state */
    in.topk_idx = (const int32_t *const *)c.state->route_idx;
    in.topk_w = (const float *const *)c.state->route_w;
    cudaError_t pe = comet_cuda_plan_build(d, &in, c.plan_ws, c.plan_scratch, &c.state->skip, stream,
                                           c.tr_events ? plan_mark : NULL, (void *)&c);
    if (pe != cudaSuccess) return (int)pe;
    if (c.tr_events) k_mark<<<1, 1, 0, stream>>>(c, 2, 1, 2);
    if (c.gemm && c.n_comm > 0) { /* overlapped: n_comm pulling CTAs, then their SMs join GEMM0 */
        comet_gemm_hooks_t hooks;
        memset(&hooks, 0, sizeof hooks);
        hooks.skip = &c.state->skip;
        hooks.num_ctas = c.num_sms; /* programmatic dependent of the pulls: CTAs start as SMs come free */
        hooks.pdl = 1;
        hooks.timeout_ns = c.timeout_ns;
        hooks.block_ready = c.block_ready;
        hooks.l0_order = 1; /* the pulls complete blocks in this order */
        hooks.epoch = &c.state->epoch; /* device address inside the state */
        hooks.timeout_report = c.gemm_report;
        const int gemm_on = !(c.disable & COMET_DISABLE_GEMM);
        if (c.tr_events && gemm_on) k_mark<<<1, 1, 0, stream>>>(c, 0, 0, -1);
        k_dispatch_ov<<<grid, COMM_THREADS, 0, stream>>>(c);
        int ge = gemm_on ? launch_gemm(&c, 0, &hooks, stream) : 0;
        if (ge != cudaSuccess) return ge;
        hooks.block_ready = NULL;
        hooks.pdl = 0;
        /* layer 1: GEMM1 on every SM, pushing rows home with the push combine; the combine follows */
        hooks.num_ctas = c.num_sms;
        /* measurement without communication: no pushes either (the pushes ride inside GEMM1, so
         * "comm only" (no GEMMs) has none: there the figure covers layer 0's pulls and the combine) */
        hooks.push = c.push && !(c.disable & COMET_DISABLE_COMM);
        ge = gemm_on ? launch_gemm(&c, 1, &hooks, stream) : 0;
        if (ge != cudaSuccess) return ge;
    } else if (c.gemm) { /* sequential, Hopper grouped GEMM (measurements: one side left out, c.disable) */
        const int gemm_on = !(c.disable & COMET_DISABLE_GEMM), comm_on = !(c.disable & COMET_DISABLE_COMM);
        if (comm_on) k_dispatch<<<grid, COMM_THREADS, 0, stream>>>(c);
        comet_gemm_hooks_t hooks;
        memset(&hooks, 0, sizeof hooks);
        hooks.skip = &c.state->skip;
        hooks.num_ctas = c.num_sms;
        int ge = gemm_on ? launch_gemm(&c, 0, &hooks, stream) : 0;
        if (ge != cudaSuccess) return ge;
        hooks.push = c.push && comm_on; /* o rows to their home ranks too: the combine then reads local memory */
        ge = gemm_on ? launch_gemm(&c, 1, &hooks, stream) : 0;
        if (ge != cudaSuccess) return ge;
    } else { /* sequential, SIMT tiles */
        k_dispatch<<<grid, COMM_THREADS, 0, stream>>>(c);
        if (c.tr_events) k_mark<<<1, 1, 0, stream>>>(c, 0, 0, -1);
        k_gemm0<<<dim3((unsigned)((d->ffn_local + TILE - 1) / TILE), blocks_y), 256, 0, stream>>>(c);
        if (c.tr_events) k_mark<<<1, 1, 0, stream>>>(c, 0, 1, -1);
        if (c.tr_events) k_mark<<<1, 1, 0, stream>>>(c, 1, 0, -1);
        k_gemm1<<<dim3((unsigned)((d->hidden + TILE - 1) / TILE), blocks_y), 256, 0, stream>>>(c);
        if (c.tr_events) k_mark<<<1, 1, 0, stream>>>(c, 1, 1, -1);
    }
    if (final_flat(&c))
        k_final_flat<<<grid, COMM_THREADS, 0, stream>>>(c);
    else
        k_final<<<grid, COMM_THREADS, 0, stream>>>(c);
    return (int)cudaGetLastError();
}
