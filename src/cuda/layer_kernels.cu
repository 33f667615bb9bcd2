/*
 * layer_kernels.cu - the sequential CUDA layer: one forward as a chain of
 * kernels on one stream, with no host synchronisation (cuda_layer.h lists the
 * steps and the flag protocol). This is the unfused baseline and the fallback
 * on GPUs without Hopper features; the fused COMET kernels replace the
 * dispatch+gemm0 and gemm1+combine pairs.
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

/* Spin until *flag >= target; on timeout name rank, role and index, then trap. */
__device__ static void wait_geq(const uint64_t *flag, uint64_t target, const comet_cuda_ctx_t *c,
                                const char *role, int index) {
    uint64_t start = globaltimer();
    uint64_t v;
    while ((v = ld_acquire_sys(flag)) < target) {
        if (globaltimer() - start > c->timeout_ns) {
            printf("comet: rank %d %s %d: timed out after %llu ms waiting for a flag (%llu < %llu)\n", c->d.rank,
                   role, index, (unsigned long long)(c->timeout_ns / 1000000), (unsigned long long)v,
                   (unsigned long long)target);
            __trap();
        }
        __nanosleep(64);
    }
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

/* ---------------------------------------------------------------------------
 * enter / stage / publish / plan
 * ------------------------------------------------------------------------- */

__global__ void k_enter(comet_cuda_ctx_t c) {
    comet_cuda_state_t *s = c.state;
    uint64_t e = s->epoch + 1;
    s->epoch = e;
    s->own_status = 0;
    for (int q = 0; q < c.d.world_size; q++) wait_geq(&flags_of(&c, q)->done, e - 1, &c, "enter: done of rank", q);
}

__global__ void k_stage(comet_cuda_ctx_t c) {
    if (c.host_status) {
        if (blockIdx.x == 0 && threadIdx.x == 0) atomicMax(&c.state->own_status, c.host_status);
        return;
    }
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, nth = (size_t)gridDim.x * blockDim.x;
    const int64_t t = c.num_tokens, k = c.d.topk;
    copy_bytes(c.sym + c.lay.x, c.x, (size_t)(t * c.d.hidden) * 2, tid, nth);
    copy_bytes(c.sym + c.lay.topk_idx, c.topk_idx, (size_t)(t * k) * 4, tid, nth);
    copy_bytes(c.sym + c.lay.topk_w, c.topk_w, (size_t)(t * k) * 4, tid, nth);
    for (size_t i = tid; i < (size_t)t; i += nth) { /* the routing check of include/comet.h */
        const int32_t *row = c.topk_idx + i * k;
        int bad = 0;
        for (int64_t j = 0; j < k; j++) {
            bad |= row[j] < 0 || row[j] >= c.d.num_experts;
            for (int64_t m = 0; m < j; m++) bad |= row[m] == row[j];
        }
        if (bad) atomicMax(&c.state->own_status, 3u /* COMET_ERR_INVALID_ROUTING */);
    }
    __threadfence_system();
}

__global__ void k_publish(comet_cuda_ctx_t c) {
    comet_sym_flags_t *f = flags_of(&c, c.d.rank);
    f->status = c.state->own_status;
    f->token_count = (uint64_t)c.num_tokens;
    __threadfence_system();
    st_release_sys(&f->entry, c.state->epoch);
}

/* Wait for every rank's staged inputs; decide whether this epoch runs. */
__global__ void k_plan(comet_cuda_ctx_t c) {
    if (threadIdx.x != 0) return;
    comet_cuda_state_t *s = c.state;
    const uint64_t e = s->epoch, t0 = TRACE_T0;
    uint32_t bad = 0;
    for (int q = 0; q < c.d.world_size; q++) {
        comet_sym_flags_t *f = flags_of(&c, q);
        wait_geq(&f->entry, e, &c, "plan: entry of rank", q);
        bad |= f->status != 0;
        s->token_count[q] = (int64_t)f->token_count;
    }
    s->skip = bad;
    s->last_status = s->own_status ? s->own_status : (bad ? 4u /* COMET_ERR_PEER_FAILED */ : 0u);
    trace_rec(&c, 0, COMET_TRACE_HOST, 0, COMET_TRACE_BARRIER, 1, -1, t0);
    /* the plan itself: comet_cuda_plan_build, launched next */
}

/* ---------------------------------------------------------------------------
 * Vector accesses: 8 bf16 or 8 fp32 columns at once. vec: the address is
 * 16-byte aligned and all 8 columns exist; else n (<= 8) scalar accesses.
 * ------------------------------------------------------------------------- */

__device__ static inline uint4 ld8_bf16(const comet_bf16_t *p, int n, int vec) {
    if (vec) return *(const uint4 *)p;
    uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (i < n) w[i / 2] |= (uint32_t)p[i] << (16 * (i % 2));
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* Element i (0..7) of 8 packed bf16, as a float (exact). */
__device__ static inline float bf16_at(uint4 r, int i) {
    const uint32_t w = i < 2 ? r.x : i < 4 ? r.y : i < 6 ? r.z : r.w;
    return __uint_as_float(i % 2 ? w & 0xffff0000u : w << 16);
}

__device__ static inline void st8_f32(float *p, const float v[8], int n, int vec) {
    if (vec) {
        ((float4 *)p)[0] = make_float4(v[0], v[1], v[2], v[3]);
        ((float4 *)p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (i < n) p[i] = v[i];
    }
}

__device__ static inline void ld8_f32(const float *p, float v[8], int n, int vec) {
    if (vec) {
        const float4 a = ((const float4 *)p)[0], b = ((const float4 *)p)[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = i < n ? p[i] : 0.0f;
    }
}

__device__ static inline void st8_bf16(comet_bf16_t *p, const float v[8], int n, int vec) {
    if (vec) {
        uint32_t w[4];
        for (int i = 0; i < 4; i++)
            w[i] = (uint32_t)comet_f32_to_bf16(v[2 * i]) | (uint32_t)comet_f32_to_bf16(v[2 * i + 1]) << 16;
        *(uint4 *)p = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (i < n) p[i] = comet_f32_to_bf16(v[i]);
    }
}

/* Rows of a pull in flight per thread: enough bytes outstanding per CTA
 * (512 threads x 8 x 16 B = 64 KB) to cover NVLink latency with few CTAs. */
#define PULL_UNROLL 8

/* Rows whose sources a CTA looks up at once. */
#define PULL_ROWS 128

/* The token rows of one block, pulled from their home ranks' stages into a,
 * by the whole CTA (both dispatch kernels use it), PULL_ROWS rows at a time:
 * their sources go to shared memory, then every thread keeps PULL_UNROLL
 * 16-byte loads in flight before it stores them. */
__device__ static void pull_rows(const comet_cuda_ctx_t *c, const comet_plan_t *p, const comet_plan_block_t *blk) {
    __shared__ const char *src_of[PULL_ROWS];
    const size_t row_bytes = (size_t)c->d.hidden * 2;
    for (int r0 = 0; r0 < blk->num_rows; r0 += PULL_ROWS) {
        const int nr = blk->num_rows - r0 < PULL_ROWS ? blk->num_rows - r0 : PULL_ROWS;
        __syncthreads(); /* the previous sources are no longer read */
        for (int r = threadIdx.x; r < nr; r += blockDim.x) {
            const comet_plan_row_t pr = p->rows[blk->row_start + r0 + r];
            src_of[r] = c->peers[pr.src_rank] + c->lay.x + (size_t)pr.src_token * row_bytes;
        }
        __syncthreads();
        char *dst = (char *)(c->a + (size_t)(blk->row_start + r0) * c->d.hidden);
        if (row_bytes % 16) { /* hidden % 8 != 0: one warp a row, narrower accesses */
            for (int r = threadIdx.x / 32; r < nr; r += blockDim.x / 32)
                copy_bytes(dst + r * row_bytes, src_of[r], row_bytes, threadIdx.x % 32, 32);
            continue;
        }
        const uint32_t per_row = (uint32_t)(row_bytes / 16), total = per_row * (uint32_t)nr;
        for (uint32_t base = 0; base < total; base += blockDim.x * PULL_UNROLL) {
            uint4 v[PULL_UNROLL];
#pragma unroll
            for (int u = 0; u < PULL_UNROLL; u++) {
                const uint32_t i = base + u * blockDim.x + threadIdx.x;
                if (i < total) v[u] = ((const uint4 *)src_of[i / per_row])[i % per_row];
            }
#pragma unroll
            for (int u = 0; u < PULL_UNROLL; u++) {
                const uint32_t i = base + u * blockDim.x + threadIdx.x;
                if (i < total) ((uint4 *)dst)[i] = v[u];
            }
        }
    }
}

/* ---------------------------------------------------------------------------
 * dispatch: pull my experts' token rows from every rank's stage
 * ------------------------------------------------------------------------- */

__global__ void __launch_bounds__(COMM_THREADS, 1) k_dispatch(comet_cuda_ctx_t c) {
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    const int nb = p.totals->num_blocks;
    for (int i = blockIdx.x; i < nb; i += gridDim.x) {
        const uint64_t t0 = TRACE_T0;
        const comet_plan_block_t blk = p.blocks[p.l0_order[i]];
        pull_rows(&c, &p, &blk);
        if (c.tr_events) {
            __syncthreads();
            if (threadIdx.x == 0) trace_rec(&c, COMM_LANE, COMET_TRACE_COMM, COMM_WORKER, COMET_TRACE_PULL, p.l0_order[i], blk.stage, t0);
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

/* The top-k reduce (ascending slot, fmaf, from 0) over token t's rows on
 * this rank, for the columns g0 + gi*256 + lane*8 + e (gi < groups, below
 * c1) into acc[gi * 8 + e]; groups (<= COL_GROUPS) a constant where it is
 * inlined, so the arrays of unused groups vanish. Slot j's row and weight come from lane j (row, w) for
 * j < 32 and from memory (ros_t = row_of_slot of t) beyond. Every lane of the
 * warp calls it (shuffles). The send and the home's own partial use it, so
 * both give the same bits. */
__device__ static __forceinline__ void topk_reduce(const comet_cuda_ctx_t *c, const comet_plan_t *p,
                                                   const int32_t *ros_t, int32_t row, float w, int64_t g0, int64_t c1,
                                                   int groups, float *acc) {
    const int64_t hd = c->d.hidden, k = c->d.topk;
    const int lane = threadIdx.x % 32, vec = hd % 8 == 0;
#pragma unroll
    for (int gi = 0; gi < COL_GROUPS; gi++)
        if (gi < groups)
            for (int e = 0; e < 8; e++) acc[gi * 8 + e] = 0.0f;
    for (int64_t j0 = 0; j0 < k; j0 += SLOT_BATCH) {
        int32_t r[SLOT_BATCH];
        float wj[SLOT_BATCH];
        uint4 v[SLOT_BATCH][COL_GROUPS];
#pragma unroll
        for (int u = 0; u < SLOT_BATCH; u++) {
            const int64_t j = j0 + u;
            r[u] = -1, wj[u] = 0.0f;
            if (j < 32) {
                r[u] = __shfl_sync(0xffffffffu, row, (int)j), wj[u] = __shfl_sync(0xffffffffu, w, (int)j);
            } else if (j < k) {
                r[u] = ros_t[j];
                wj[u] = r[u] >= 0 ? p->rows[r[u]].weight : 0.0f;
            }
            if (j >= k) r[u] = -1;
#pragma unroll
            for (int gi = 0; gi < COL_GROUPS; gi++) {
                const int64_t col = g0 + gi * 256 + lane * 8;
                const int cn = gi < groups ? cols_below(col, c1) : 0;
                if (r[u] >= 0 && cn) v[u][gi] = ld8_bf16(c->o + (int64_t)r[u] * hd + col, cn, vec && cn == 8);
            }
        }
#pragma unroll
        for (int u = 0; u < SLOT_BATCH; u++)
#pragma unroll
            for (int gi = 0; gi < COL_GROUPS; gi++) {
                const int cn = gi < groups ? cols_below(g0 + gi * 256 + lane * 8, c1) : 0;
                if (r[u] >= 0 && cn)
                    for (int e = 0; e < 8; e++) acc[gi * 8 + e] = fmaf(wj[u], bf16_at(v[u][gi], e), acc[gi * 8 + e]);
            }
    }
}

/* Columns [c0, c1) of home rank h's tokens that have rows here (h != me):
 * the top-k reduce stored into h's partials[me][t]. One warp a token, 8
 * columns a lane, COL_GROUPS x 256 columns at once. The routing of a token is
 * fetched in three steps over the three tokens ahead (its index, the rows of
 * its slots, their weights), so no load is waited on where it was issued. */
__device__ static void reduce_into_home(const comet_cuda_ctx_t *c, const comet_plan_t *p, int h, int64_t c0,
                                        int64_t c1) {
    const int64_t hd = c->d.hidden, k = c->d.topk, mt = c->d.max_tokens;
    const int32_t *ros = p->row_of_slot + (int64_t)h * mt * k;
    const int32_t *tokens = p->send_tokens + (int64_t)h * mt;
    float *dst = (float *)(c->peers[h] + c->lay.partials) + (int64_t)c->d.rank * mt * hd;
    const int lane = threadIdx.x % 32, vec = hd % 8 == 0;
    const int64_t n = p->send_count[h], s = (int64_t)gridDim.x * (blockDim.x / 32);
    int64_t i = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    /* token i (t0, row0, w0), i + s (t1, row1), i + 2s (t2) */
    int64_t t0 = i < n ? tokens[i] : 0, t1 = i + s < n ? tokens[i + s] : 0, t2 = i + 2 * s < n ? tokens[i + 2 * s] : 0;
    int32_t row0 = i < n && lane < k ? ros[t0 * k + lane] : -1, row1 = i + s < n && lane < k ? ros[t1 * k + lane] : -1;
    float w0 = row0 >= 0 ? p->rows[row0].weight : 0.0f;
    for (; i < n; i += s) {
        const int64_t t3 = i + 3 * s < n ? tokens[i + 3 * s] : 0;
        const int32_t row2 = i + 2 * s < n && lane < k ? ros[t2 * k + lane] : -1;
        const float w1 = row1 >= 0 ? p->rows[row1].weight : 0.0f;
        for (int64_t g0 = c0; g0 < c1; g0 += 256 * COL_GROUPS) {
            float acc[COL_GROUPS * 8];
            topk_reduce(c, p, ros + t0 * k, row0, w0, g0, c1, COL_GROUPS, acc);
#pragma unroll
            for (int gi = 0; gi < COL_GROUPS; gi++) {
                const int64_t col = g0 + gi * 256 + lane * 8;
                const int cn = cols_below(col, c1);
                if (cn) st8_f32(dst + t0 * hd + col, acc + gi * 8, cn, vec && cn == 8);
            }
        }
        t0 = t1, row0 = row1, w0 = w1;
        t1 = t2, row1 = row2;
        t2 = t3;
    }
}

/* Column groups of the final sum a lane works on at once (fp32 partials are
 * twice as wide as the bf16 rows; 2 spills registers). */
#define SUM_GROUPS 1

/* Columns [c0, c1) of y for every local token: the partials of the
 * contributing ranks summed in ascending rank order (from 0), this rank's own
 * computed here by topk_reduce instead of read back. One warp a token;
 * routing fetched a token ahead, weights in the iteration before use. */
__device__ static void sum_partials(const comet_cuda_ctx_t *c, const comet_plan_t *p, int64_t c0, int64_t c1) {
    const int64_t hd = c->d.hidden, mt = c->d.max_tokens, k = c->d.topk;
    const float *partials = (const float *)(c->sym + c->lay.partials);
    const int32_t *ros = p->row_of_slot + (int64_t)c->d.rank * mt * k;
    const int lane = threadIdx.x % 32, tp = c->d.tp, me = c->d.rank;
    const int vec_in = hd % 8 == 0, vec_out = vec_in && ((uintptr_t)c->y % 16) == 0;
    const int64_t n = c->num_tokens, s = (int64_t)gridDim.x * (blockDim.x / 32);
    int64_t t = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    /* token t: groups (ng0, grp0 in lane g), rows of my slots (row0), weights (w0); token t + s: ng1, grp1, row1 */
    int ng0 = t < n ? p->home_group_count[t] : 0, ng1 = t + s < n ? p->home_group_count[t + s] : 0;
    int32_t grp0 = t < n && lane < k ? p->home_groups[t * k + lane] : 0;
    int32_t grp1 = t + s < n && lane < k ? p->home_groups[(t + s) * k + lane] : 0;
    int32_t row0 = t < n && lane < k ? ros[t * k + lane] : -1, row1 = t + s < n && lane < k ? ros[(t + s) * k + lane] : -1;
    float w0 = row0 >= 0 ? p->rows[row0].weight : 0.0f;
    for (; t < n; t += s) {
        const int64_t t2 = t + 2 * s;
        const int ng2 = t2 < n ? p->home_group_count[t2] : 0;
        const int32_t grp2 = t2 < n && lane < k ? p->home_groups[t2 * k + lane] : 0;
        const int32_t row2 = t2 < n && lane < k ? ros[t2 * k + lane] : -1;
        const float w1 = row1 >= 0 ? p->rows[row1].weight : 0.0f;
        const int nq = ng0 * tp; /* contributing ranks, ascending: group-major, then tp */
        for (int64_t g0 = c0; g0 < c1; g0 += 256 * SUM_GROUPS) {
            float acc[SUM_GROUPS][8], mine[SUM_GROUPS * 8];
#pragma unroll
            for (int gi = 0; gi < SUM_GROUPS; gi++)
                for (int e = 0; e < 8; e++) acc[gi][e] = 0.0f;
            for (int q0 = 0; q0 < nq; q0 += SLOT_BATCH) {
                float v[SLOT_BATCH][SUM_GROUPS][8];
                int64_t q[SLOT_BATCH];
#pragma unroll
                for (int u = 0; u < SLOT_BATCH; u++) { /* the peers' partials: loads in flight */
                    const int qi = q0 + u, gi = qi / tp;
                    const int32_t group = gi < 32 ? __shfl_sync(0xffffffffu, grp0, gi & 31)
                                                  : (qi < nq ? p->home_groups[t * k + gi] : 0);
                    q[u] = qi < nq ? (int64_t)group * tp + qi % tp : -1;
#pragma unroll
                    for (int g = 0; g < SUM_GROUPS; g++) {
                        const int64_t col = g0 + g * 256 + lane * 8;
                        const int cn = cols_below(col, c1);
                        if (q[u] >= 0 && q[u] != me && cn)
                            ld8_f32(partials + (q[u] * mt + t) * hd + col, v[u][g], cn, vec_in && cn == 8);
                    }
                }
                int has_me = 0;
#pragma unroll
                for (int u = 0; u < SLOT_BATCH; u++) has_me |= q[u] == me;
                if (has_me) /* mine, while those loads fly */
                    topk_reduce(c, p, ros + t * k, row0, w0, g0, c1, SUM_GROUPS, mine);
#pragma unroll
                for (int u = 0; u < SLOT_BATCH; u++)
#pragma unroll
                    for (int g = 0; g < SUM_GROUPS; g++)
                        if (q[u] >= 0 && cols_below(g0 + g * 256 + lane * 8, c1))
                            for (int e = 0; e < 8; e++) acc[g][e] += q[u] == me ? mine[g * 8 + e] : v[u][g][e];
            }
#pragma unroll
            for (int g = 0; g < SUM_GROUPS; g++) {
                const int64_t col = g0 + g * 256 + lane * 8;
                const int cn = cols_below(col, c1);
                if (cn) st8_bf16(c->y + t * hd + col, acc[g], cn, vec_out && cn == 8);
            }
        }
        ng0 = ng1, grp0 = grp1, row0 = row1, w0 = w1;
        ng1 = ng2, grp1 = grp2, row1 = row2;
    }
}

/* Top-k reduce of every home rank's tokens that have rows here, stored into
 * the home's partials[me][t]. */
__global__ void __launch_bounds__(COMM_THREADS, 1) k_combine(comet_cuda_ctx_t c) {
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    for (int hi = 0; hi < c.d.world_size - 1; hi++) { /* my own tokens: k_final */
        const uint64_t t0 = TRACE_T0;
        const int h = (c.d.rank + 1 + hi) % c.d.world_size;
        reduce_into_home(&c, &p, h, 0, c.d.hidden);
        if (c.tr_events && threadIdx.x == 0) trace_rec(&c, COMM_LANE, COMET_TRACE_COMM, COMM_WORKER, COMET_TRACE_SEND, -1, h, t0);
    }
    __threadfence_system();
}

__global__ void k_signal(comet_cuda_ctx_t c) {
    for (int q = 0; q < c.d.world_size; q++) st_release_sys(&flags_of(&c, q)->partial_flag[c.d.rank], c.state->epoch);
}

__global__ void __launch_bounds__(COMM_THREADS, 1) k_final(comet_cuda_ctx_t c) {
    if (c.state->skip) return;
    const uint64_t e = c.state->epoch, t0 = TRACE_T0;
    comet_sym_flags_t *mine = flags_of(&c, c.d.rank);
    if (threadIdx.x == 0)
        for (int q = 0; q < c.d.world_size; q++) wait_geq(&mine->partial_flag[q], e, &c, "final: partials of rank", q);
    __syncthreads();
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    sum_partials(&c, &p, 0, c.d.hidden);
    if (c.tr_events) {
        __syncthreads();
        if (threadIdx.x == 0) trace_rec(&c, COMM_LANE, COMET_TRACE_COMM, COMM_WORKER, COMET_TRACE_RECV, -1, -1, t0);
    }
}

/* Trace: mark where a GEMM starts (which 0/1, end 0) or record it (end 1) as
 * one interval of the GEMM lane (the GEMM kernels themselves record nothing). */
__global__ void k_mark(comet_cuda_ctx_t c, int which, int end) {
    if (!end) {
        c.state->gemm_begin[which] = globaltimer();
        return;
    }
    trace_rec(&c, 9 + which, COMET_TRACE_GEMM, which, which ? COMET_TRACE_GEMM1 : COMET_TRACE_GEMM0, -1, -1,
              c.state->gemm_begin[which]);
}

__global__ void k_exit(comet_cuda_ctx_t c) {
    __threadfence_system();
    st_release_sys(&flags_of(&c, c.d.rank)->done, c.state->epoch);
}


/* ---------------------------------------------------------------------------
 * Overlapped mode: communication CTAs beside the GEMM CTAs (cuda_layer.h)
 * ------------------------------------------------------------------------- */

/* Layer 0: pull the rows of each block (local-first order) and release it to
 * GEMM0, which waits on block_ready[b] >= epoch. */
__global__ void __launch_bounds__(COMM_THREADS, 1) k_dispatch_ov(comet_cuda_ctx_t c) {
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    const uint64_t e = c.state->epoch;
    const int nb = p.totals->num_blocks;
    for (int i = blockIdx.x; i < nb; i += gridDim.x) {
        const uint64_t t0 = TRACE_T0;
        const int32_t b = p.l0_order[i];
        const comet_plan_block_t blk = p.blocks[b];
        if (!(c.disable & COMET_DISABLE_COMM)) pull_rows(&c, &p, &blk);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            st_release_gpu(&c.block_ready[b], e);
            trace_rec(&c, COMM_LANE, COMET_TRACE_COMM, COMM_WORKER, COMET_TRACE_PULL, b, blk.stage, t0);
        }
    }
}

/* Tiles GEMM1 stores into chunk c this call (its completion hook adds one per
 * 128 x 256 tile). */
__device__ static inline uint64_t chunk_tiles(const comet_cuda_ctx_t *c, int nb, int chunk) {
    const int64_t c0 = (int64_t)chunk * c->chunk_cols;
    const int64_t width = c->d.hidden - c0 < c->chunk_cols ? c->d.hidden - c0 : c->chunk_cols;
    return (uint64_t)nb * (uint64_t)((width + 255) / 256);
}

/* Layer 1: send(0), send(1), recv(0), send(2), recv(1), ...: a send waits for
 * the chunk's GEMM1 tiles, top-k reduces every home rank's tokens over the
 * chunk's columns into the home's partials, and the last comm CTA to finish
 * flags the chunk on every home; a recv waits for every rank's flag of the
 * chunk and sums the partials in ascending rank order into y. */
__global__ void __launch_bounds__(COMM_THREADS, 1) k_combine_ov(comet_cuda_ctx_t c) {
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    const uint64_t e = c.state->epoch;
    const int w = c.d.world_size, me = c.d.rank;
    const int64_t hd = c.d.hidden;
    const int n_chunks = (int)((hd + c.chunk_cols - 1) / c.chunk_cols);
    comet_cuda_overlap_t *ov = c.ov;
    __shared__ uint64_t base;
    if (c.state->skip) { /* nothing is sent; keep the chunk flags in step */
        if (blockIdx.x == 0 && threadIdx.x == 0)
            for (int q = 0; q < w; q++)
                for (int ch = 0; ch < n_chunks; ch++) st_release_sys(&flags_of(&c, q)->chunk_flag[me][ch], e);
        return;
    }
    const int nb = p.totals->num_blocks;
    for (int step = 0; step <= n_chunks; step++) {
        if (step < n_chunks) { /* send(step) */
            const int ch = step;
            const int64_t c0 = (int64_t)ch * c.chunk_cols, c1 = c0 + c.chunk_cols < hd ? c0 + c.chunk_cols : hd;
            uint64_t t0 = TRACE_T0;
            const uint64_t tiles = c.disable & COMET_DISABLE_GEMM ? 0 : chunk_tiles(&c, nb, ch); /* no GEMM, no tiles */
            if (threadIdx.x == 0) {
                base = ov->chunk_base[ch];
                wait_geq(&ov->chunk_done[ch], base + tiles, &c, "comm: GEMM1 tiles of chunk", ch);
                trace_rec(&c, COMM_LANE, COMET_TRACE_COMM, COMM_WORKER, COMET_TRACE_WAIT, ch, COMET_TRACE_SEND, t0);
            }
            __syncthreads();
            t0 = TRACE_T0;
            for (int hi = 0; !(c.disable & COMET_DISABLE_COMM) && hi < w - 1; hi++) reduce_into_home(&c, &p, (me + 1 + hi) % w, c0, c1);
            __threadfence_system();
            __syncthreads();
            if (threadIdx.x == 0) trace_rec(&c, COMM_LANE, COMET_TRACE_COMM, COMM_WORKER, COMET_TRACE_SEND, ch, -1, t0);
            if (threadIdx.x == 0 && atomicAdd(&ov->arrived[ch], 1u) == gridDim.x - 1) { /* the last comm CTA */
                ov->arrived[ch] = 0;
                ov->chunk_base[ch] = base + tiles;
                __threadfence_system();
                for (int q = 0; q < w; q++) st_release_sys(&flags_of(&c, q)->chunk_flag[me][ch], e);
            }
        }
        if (step >= 1) { /* recv(step - 1) */
            const int ch = step - 1;
            const int64_t c0 = (int64_t)ch * c.chunk_cols, c1 = c0 + c.chunk_cols < hd ? c0 + c.chunk_cols : hd;
            comet_sym_flags_t *mine = flags_of(&c, me);
            uint64_t t0 = TRACE_T0;
            if (threadIdx.x == 0) {
                for (int q = 0; q < w; q++) wait_geq(&mine->chunk_flag[q][ch], e, &c, "comm: partials of chunk from rank", q);
                trace_rec(&c, COMM_LANE, COMET_TRACE_COMM, COMM_WORKER, COMET_TRACE_WAIT, ch, COMET_TRACE_RECV, t0);
            }
            __syncthreads();
            t0 = TRACE_T0;
            if (!(c.disable & COMET_DISABLE_COMM)) sum_partials(&c, &p, c0, c1);
            __syncthreads();
            if (threadIdx.x == 0) trace_rec(&c, COMM_LANE, COMET_TRACE_COMM, COMM_WORKER, COMET_TRACE_RECV, ch, -1, t0);
        }
    }
}

/* ---------------------------------------------------------------------------
 * Host side
 * ------------------------------------------------------------------------- */

/* Load every kernel of the layer now: with lazy module loading, a kernel
 * loaded for the first time while another spins on a flag can deadlock. */
extern "C" int comet_cuda_layer_warm(void) {
    const void *fns[] = {(const void *)k_enter, (const void *)k_stage, (const void *)k_publish, (const void *)k_plan,
                         (const void *)k_dispatch, (const void *)k_gemm0, (const void *)k_gemm1,
                         (const void *)k_combine, (const void *)k_signal, (const void *)k_final, (const void *)k_exit,
                         (const void *)k_dispatch_ov, (const void *)k_combine_ov, (const void *)k_mark};
    for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
        cudaFuncAttributes a;
        cudaError_t e = cudaFuncGetAttributes(&a, fns[i]);
        if (e != cudaSuccess) return (int)e;
    }
    return comet_gemm_warm();
}

extern "C" void comet_cuda_sym_layout(const comet_dims_t *d, comet_sym_layout_t *lay) {
    size_t off = 0;
#define COMET_SYM_FIELD(field, bytes)                       \
    do {                                                    \
        lay->field = off;                                   \
        off += ((size_t)(bytes) + 4095) / 4096 * 4096;      \
    } while (0)
    COMET_SYM_FIELD(flags, sizeof(comet_sym_flags_t));
    COMET_SYM_FIELD(x, (size_t)(d->max_tokens * d->hidden) * 2);
    COMET_SYM_FIELD(topk_idx, (size_t)(d->max_tokens * d->topk) * 4);
    COMET_SYM_FIELD(topk_w, (size_t)(d->max_tokens * d->topk) * 4);
    COMET_SYM_FIELD(partials, (size_t)(d->world_size * d->max_tokens * d->hidden) * 4);
#undef COMET_SYM_FIELD
    lay->total = off;
}

extern "C" int comet_cuda_forward_launch(const comet_cuda_ctx_t *ctx, void *stream_ptr) {
    cudaStream_t stream = (cudaStream_t)stream_ptr;
    const comet_cuda_ctx_t c = *ctx;
    const comet_dims_t *d = &c.d;
    const int grid = c.num_sms > 0 ? c.num_sms : 132;
    const unsigned blocks_y = (unsigned)(d->max_blocks < 65535 ? d->max_blocks : 65535);
    k_enter<<<1, 1, 0, stream>>>(c);
    k_stage<<<grid, 256, 0, stream>>>(c);
    k_publish<<<1, 1, 0, stream>>>(c);
    k_plan<<<1, 32, 0, stream>>>(c);
    comet_plan_input_t in;
    in.token_count = c.state->token_count; /* device addresses inside the state */
    in.topk_idx = c.state->peer_idx;
    in.topk_w = c.state->peer_w;
    cudaError_t pe = comet_cuda_plan_build(d, &in, c.plan_ws, &c.state->skip, stream);
    if (pe != cudaSuccess) return (int)pe;
    if (c.gemm && c.n_comm > 0) { /* overlapped: comm CTAs on stream2 beside the GEMM CTAs */
        cudaStream_t s2 = (cudaStream_t)c.stream2;
        cudaError_t e = cudaEventRecord((cudaEvent_t)c.ev_plan, stream);
        if (e == cudaSuccess) e = cudaStreamWaitEvent(s2, (cudaEvent_t)c.ev_plan, 0);
        if (e != cudaSuccess) return (int)e;
        comet_gemm_hooks_t hooks;
        memset(&hooks, 0, sizeof hooks);
        hooks.skip = &c.state->skip;
        hooks.num_ctas = c.num_sms - c.n_comm;
        hooks.timeout_ns = c.timeout_ns;
        hooks.block_ready = c.block_ready;
        hooks.epoch = c.host_epoch;
        const int gemm_on = !(c.disable & COMET_DISABLE_GEMM);
        k_dispatch_ov<<<c.n_comm, COMM_THREADS, 0, s2>>>(c);
        if (c.tr_events && gemm_on) k_mark<<<1, 1, 0, stream>>>(c, 0, 0);
        int ge = gemm_on ? comet_gemm0_launch((const comet_gemm_t *)c.gemm, stream, &hooks) : 0;
        if (ge != cudaSuccess) return ge;
        if (c.tr_events && gemm_on) k_mark<<<1, 1, 0, stream>>>(c, 0, 1);
        k_combine_ov<<<c.n_comm, COMM_THREADS, 0, s2>>>(c);
        hooks.block_ready = NULL;
        hooks.chunk_done = c.ov->chunk_done; /* device address inside the overlap state */
        hooks.chunk_cols = c.chunk_cols;
        if (c.tr_events && gemm_on) k_mark<<<1, 1, 0, stream>>>(c, 1, 0);
        ge = gemm_on ? comet_gemm1_launch((const comet_gemm_t *)c.gemm, stream, &hooks) : 0;
        if (ge != cudaSuccess) return ge;
        if (c.tr_events && gemm_on) k_mark<<<1, 1, 0, stream>>>(c, 1, 1);
        e = cudaEventRecord((cudaEvent_t)c.ev_comm, s2);
        if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, (cudaEvent_t)c.ev_comm, 0);
        if (e != cudaSuccess) return (int)e;
        k_exit<<<1, 1, 0, stream>>>(c);
        return (int)cudaGetLastError();
    }
    k_dispatch<<<grid, COMM_THREADS, 0, stream>>>(c);
    if (c.gemm) { /* Hopper grouped GEMM */
        comet_gemm_hooks_t hooks;
        memset(&hooks, 0, sizeof hooks);
        hooks.skip = &c.state->skip;
        hooks.num_ctas = c.num_sms;
        if (c.tr_events) k_mark<<<1, 1, 0, stream>>>(c, 0, 0);
        int ge = comet_gemm0_launch((const comet_gemm_t *)c.gemm, stream, &hooks);
        if (ge != cudaSuccess) return ge;
        if (c.tr_events) k_mark<<<1, 1, 0, stream>>>(c, 0, 1);
        if (c.tr_events) k_mark<<<1, 1, 0, stream>>>(c, 1, 0);
        ge = comet_gemm1_launch((const comet_gemm_t *)c.gemm, stream, &hooks);
        if (ge != cudaSuccess) return ge;
        if (c.tr_events) k_mark<<<1, 1, 0, stream>>>(c, 1, 1);
    } else {
        if (c.tr_events) k_mark<<<1, 1, 0, stream>>>(c, 0, 0);
        k_gemm0<<<dim3((unsigned)((d->ffn_local + TILE - 1) / TILE), blocks_y), 256, 0, stream>>>(c);
        if (c.tr_events) k_mark<<<1, 1, 0, stream>>>(c, 0, 1);
        if (c.tr_events) k_mark<<<1, 1, 0, stream>>>(c, 1, 0);
        k_gemm1<<<dim3((unsigned)((d->hidden + TILE - 1) / TILE), blocks_y), 256, 0, stream>>>(c);
        if (c.tr_events) k_mark<<<1, 1, 0, stream>>>(c, 1, 1);
    }
    k_combine<<<grid, COMM_THREADS, 0, stream>>>(c);
    k_signal<<<1, 1, 0, stream>>>(c);
    k_final<<<grid, COMM_THREADS, 0, stream>>>(c);
    k_exit<<<1, 1, 0, stream>>>(c);
    return (int)cudaGetLastError();
}
