/*
 * plan_kernel.cu - the plan of src/plan/plan.h built on the device by one
 * block of 1024 threads, byte for byte the plan that plan_impl.h builds on the
 * host (tests/test_plan_gpu.cu checks it), so that a rank builds its plan from
 * every rank's routing (read through peer pointers) with no host
 * synchronisation.
 *
 * The host builder is sequential; here every phase is parallel and the
 * sequential orders are recovered exactly:
 *   - rows of an expert are ordered by (stage, token, slot). A token names an
 *     expert at most once, so inside one source rank the order is by token:
 *     tokens are taken 1024 at a time (one per thread), each thread sets its
 *     bit in a per-expert bitmask of the chunk, and its rank among the chunk's
 *     rows of that expert is the popcount of the bits below it;
 *   - the send lists ride along as one more key ("token has a row here"),
 *     and the local-first block order uses the same stable ranking with the
 *     stage as the key.
 * Experts per rank are limited by shared memory (COMET_PLAN_MAX_KEYS); above
 * it, and for the reference, the sequential builder of plan_impl.h runs in
 * one thread.
 */
#define COMET_PLAN_DEVICE_ONLY
#define COMET_PLAN_API static __device__
#include "../plan/plan_impl.h"

#include "plan_kernel.h"

#define PLAN_THREADS 1024
#define PLAN_WORDS (PLAN_THREADS / 32) /* bitmask words per key and chunk */

/* Rank of this thread's item among the chunk's items with the same key and a
 * lower thread index: popcount of the key's bits below the thread. */
__device__ static inline int rank_below(const uint32_t *bits, int key) {
    const int w = threadIdx.x / 32, b = threadIdx.x % 32;
    int r = __popc(bits[key * PLAN_WORDS + w] & ((1u << b) - 1u));
    for (int i = 0; i < w; i++) r += __popc(bits[key * PLAN_WORDS + i]);
    return r;
}

__device__ static inline int key_total(const uint32_t *bits, int key) {
    int n = 0;
    for (int i = 0; i < PLAN_WORDS; i++) n += __popc(bits[key * PLAN_WORDS + i]);
    return n;
}

__device__ static inline void clear_bits(uint32_t *bits, int keys) {
    for (int i = threadIdx.x; i < keys * PLAN_WORDS; i += blockDim.x) bits[i] = 0;
}

__device__ static inline void set_bit(uint32_t *bits, int key) {
    atomicOr(&bits[key * PLAN_WORDS + threadIdx.x / 32], 1u << (threadIdx.x % 32));
}

__global__ void __launch_bounds__(PLAN_THREADS) comet_plan_build_parallel(comet_dims_t d, comet_plan_input_t in,
                                                                          void *workspace, const uint32_t *skip) {
    extern __shared__ uint32_t bits[]; /* [keys][PLAN_WORDS], then aux[keys] */
    __shared__ int32_t send_base;
    if (skip && *skip) return;
    comet_plan_t p;
    comet_plan_carve(&d, workspace, &p);
    const int w = d.world_size, r = d.rank, tid = threadIdx.x, nt = blockDim.x;
    const int64_t el = d.experts_local, topk = d.topk, tm = d.tile_m, e0 = (int64_t)d.ep_rank * el;
    const int64_t slots = d.max_tokens * topk;
    const int keys = (int)(el + 1 > w ? el + 1 : w); /* key el: "token has a row here" (send lists) */
    int32_t *aux = (int32_t *)(bits + keys * PLAN_WORDS); /* first block of each expert; next slot of each stage */

    /* 1. rows per local expert, counted in shared memory (aux), one atomic per
     * warp and expert (a few hot experts would serialise per-slot atomics) */
    for (int64_t e = tid; e < el; e += nt) aux[e] = 0;
    __syncthreads();
    for (int s = 0; s < w; s++) {
        const int64_t n = in.token_count[s] * topk;
        for (int64_t base = 0; base < n; base += nt) { /* every thread takes each step: full-warp match */
            const int64_t i = base + tid;
            const int64_t e = i < n ? (int64_t)in.topk_idx[s][i] - e0 : -1;
            const int key = e >= 0 && e < el ? (int)e : -1;
            const unsigned same = __match_any_sync(0xffffffffu, key);
            if (key >= 0 && (int)(threadIdx.x % 32) == __ffs(same) - 1) atomicAdd(&aux[key], __popc(same));
        }
    }
    __syncthreads();
    for (int64_t e = tid; e < el; e += nt) p.expert_count[e] = aux[e];
    __syncthreads();

    /* 2. padded prefix sums (el is small: one thread) */
    if (tid == 0) {
        int32_t rows = 0;
        p.expert_start[0] = 0;
        for (int64_t e = 0; e < el; e++) {
            p.expert_start[e + 1] = p.expert_start[e] + (int32_t)((p.expert_count[e] + tm - 1) / tm * tm);
            p.cursor[e] = p.expert_start[e];
            rows += p.expert_count[e];
        }
        p.totals->num_rows = rows;
        p.totals->num_rows_padded = p.expert_start[el];
    }
    __syncthreads();

    /* 3. fill rows in (stage, token, slot) order, 1024 tokens at a time; and
     * the send lists: the tokens of each home rank with a row here, ascending
     * (key el of the bitmasks) */
    const int send_key = (int)el;
    for (int q = 0; q < w; q++) {
        const int s = comet_rank_of_stage(r, q, w);
        const int32_t *idx = in.topk_idx[s];
        const float *wt = in.topk_w[s];
        int32_t *ros = p.row_of_slot + (int64_t)s * slots;
        int32_t *list = p.send_tokens + (int64_t)s * d.max_tokens;
        if (tid == 0) send_base = 0;
        for (int64_t base = 0; base < in.token_count[s]; base += nt) {
            const int64_t t = base + tid;
            const int live = t < in.token_count[s];
            clear_bits(bits, send_key + 1);
            __syncthreads();
            int any = 0;
            for (int64_t j = 0; live && j < topk; j++) {
                int64_t e = (int64_t)idx[t * topk + j] - e0;
                if (e >= 0 && e < el) set_bit(bits, (int)e), any = 1;
            }
            if (any) set_bit(bits, send_key);
            __syncthreads();
            if (any) list[send_base + rank_below(bits, send_key)] = (int32_t)t;
            for (int64_t j = 0; live && j < topk; j++) {
                int64_t e = (int64_t)idx[t * topk + j] - e0;
                if (e < 0 || e >= el) {
                    ros[t * topk + j] = -1;
                    continue;
                }
                int32_t row = p.cursor[e] + rank_below(bits, (int)e);
                comet_plan_row_t pr;
                pr.src_rank = s;
                pr.src_token = (int32_t)t;
                pr.slot = (int32_t)j;
                pr.weight = wt[t * topk + j];
                p.rows[row] = pr;
                ros[t * topk + j] = row;
            }
            __syncthreads();
            for (int64_t e = tid; e < el; e += nt) p.cursor[e] += key_total(bits, (int)e);
            if (tid == 0) send_base += key_total(bits, send_key);
            __syncthreads();
        }
        if (tid == 0) p.send_count[s] = send_base;
    }
    for (int64_t e = 0; e < el; e++) /* padding rows */
        for (int32_t i = p.expert_start[e] + p.expert_count[e] + tid; i < p.expert_start[e + 1]; i += nt) {
            comet_plan_row_t pad = {-1, -1, -1, 0.0f};
            p.rows[i] = pad;
        }

    /* 4. row blocks in expert order: block ids by a prefix over experts */
    if (tid == 0) {
        int32_t nb = 0;
        for (int64_t e = 0; e < el; e++) {
            aux[e] = nb;
            nb += (int32_t)((p.expert_count[e] + tm - 1) / tm);
        }
        p.totals->num_blocks = nb;
    }
    __syncthreads();
    for (int64_t e = tid; e < el; e += nt) {
        const int32_t end = p.expert_start[e] + p.expert_count[e];
        int32_t b = aux[e];
        for (int32_t start = p.expert_start[e]; start < end; start += (int32_t)tm, b++) {
            comet_plan_block_t blk;
            blk.expert = (int32_t)e;
            blk.row_start = start;
            blk.num_rows = (int32_t)(end - start < tm ? end - start : tm);
            blk.stage = comet_stage_of(r, p.rows[start + blk.num_rows - 1].src_rank, w);
            p.blocks[b] = blk;
        }
    }
    __syncthreads();

    /* 5. local-first order: stable ranking of blocks by stage */
    const int32_t nb = p.totals->num_blocks;
    for (int q = tid; q < w; q += nt) p.stage_end[q] = 0;
    __syncthreads();
    for (int32_t bb = 0; bb < nb; bb += nt) { /* stage counts */
        if (bb + tid < nb) atomicAdd(&p.stage_end[p.blocks[bb + tid].stage], 1);
    }
    __syncthreads();
    if (tid == 0)
        for (int q = 1; q < w; q++) p.stage_end[q] += p.stage_end[q - 1];
    __syncthreads();
    for (int q = tid; q < w; q += nt) aux[q] = q ? p.stage_end[q - 1] : 0;
    __syncthreads();
    for (int32_t bb = 0; bb < nb; bb += nt) {
        const int32_t b = bb + tid;
        clear_bits(bits, w);
        __syncthreads();
        if (b < nb) set_bit(bits, p.blocks[b].stage);
        __syncthreads();
        if (b < nb) p.l0_order[aux[p.blocks[b].stage] + rank_below(bits, p.blocks[b].stage)] = b;
        __syncthreads();
        for (int q = tid; q < w; q += nt) aux[q] += key_total(bits, q);
        __syncthreads();
    }

    /* 6. EP groups of each local token, ascending (as plan_impl.h) */
    const int32_t *own = in.topk_idx[r];
    for (int64_t t = tid; t < in.token_count[r]; t += nt) {
        int32_t *g = p.home_groups + t * topk;
        int32_t n = 0;
        for (int64_t j = 0; j < topk; j++) {
            int32_t grp = (int32_t)(own[t * topk + j] / el);
            int dup = 0;
            for (int32_t m = 0; m < n; m++) dup |= g[m] == grp;
            if (dup) continue;
            int32_t k = n;
            while (k > 0 && g[k - 1] > grp) {
                g[k] = g[k - 1];
                k--;
            }
            g[k] = grp;
            n++;
        }
        p.home_group_count[t] = n;
    }
}

/* The sequential builder, one thread: for plans with more experts per rank
 * than shared memory holds bitmasks for. */
__global__ void comet_plan_build_serial(comet_dims_t d, comet_plan_input_t in, void *workspace, const uint32_t *skip) {
    if (threadIdx.x != 0 || (skip && *skip)) return;
    comet_plan_t plan;
    comet_plan_carve(&d, workspace, &plan);
    comet_plan_build(&d, &in, &plan);
}

extern "C" cudaError_t comet_cuda_plan_build(const comet_dims_t *d, const comet_plan_input_t *in, void *workspace,
                                             const uint32_t *skip, cudaStream_t stream) {
    const int64_t keys = d->experts_local + 1 > d->world_size ? d->experts_local + 1 : d->world_size;
    if (keys > COMET_PLAN_MAX_KEYS) {
        comet_plan_build_serial<<<1, 32, 0, stream>>>(*d, *in, workspace, skip);
        return cudaGetLastError();
    }
    const size_t smem = (size_t)keys * (PLAN_WORDS + 1) * sizeof(uint32_t);
    if (smem > 48 * 1024) { /* the limit is per device: set it on the current one */
        cudaError_t e = cudaFuncSetAttribute(comet_plan_build_parallel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             COMET_PLAN_MAX_KEYS * (PLAN_WORDS + 1) * (int)sizeof(uint32_t));
        if (e != cudaSuccess) return e;
    }
    comet_plan_build_parallel<<<1, PLAN_THREADS, smem, stream>>>(*d, *in, workspace, skip);
    return cudaGetLastError();
}
