/*
 * plan_kernel.cu - the plan of src/plan/plan.h built on the device, byte for
 * byte the plan that plan_impl.h builds on the host (tests/test_plan_gpu.cu
 * checks it), so that a rank builds its plan from every rank's routing with
 * no host synchronisation.
 *
 * Two launches over chunks of 1024 tokens of every source rank (grid
 * chunks x W, one token per thread; the fill's grid has one more row,
 * whose block (0, 0) is the finish and whose other blocks exit):
 *   count:  rows per local expert and chunk, and tokens with a row here per
 *           chunk, into a small table in the caller's scratch (and the home
 *           groups of this rank's own tokens);
 *   fill:   each chunk finds where its rows start from the table (expert
 *           starts: a scan over experts of the padded totals; before them the
 *           rows of earlier stages and of earlier chunks of its stage) and
 *           writes them. Inside a chunk the host's order (by token, then slot)
 *           is recovered exactly: a token names an expert at most once, so
 *           each thread sets its bit in a per-expert bitmask of the chunk and
 *           its rank among the chunk's rows of that expert is the popcount of
 *           the bits below it; the send lists are one more key ("token has a
 *           row here");
 *   finish: one more block of the fill's launch, beside the chunks, from
 *           the table alone: counts, starts, totals, padding rows, row
 *           blocks (a block's stage, that of its last row, from the rows
 *           each expert has up to each stage) and the local-first block
 *           order (the same stable ranking with the stage as the key).
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
/* A key's words lie PLAN_STRIDE apart: the lanes of a warp read word w of
 * different keys at once, which with a stride of 32 words all fall into one
 * bank (a 32-way conflict every read) */
#define PLAN_STRIDE (PLAN_WORDS + 1)

/* Rank of this thread's item among the chunk's items with the same key and a
 * lower thread index: popcount of the key's bits below the thread. */
__device__ static inline int rank_below(const uint32_t *bits, int key) {
    const int w = threadIdx.x / 32, b = threadIdx.x % 32;
    int r = __popc(bits[key * PLAN_STRIDE + w] & ((1u << b) - 1u));
#pragma unroll 8 /* the words' loads in flight together */
    for (int i = 0; i < w; i++) r += __popc(bits[key * PLAN_STRIDE + i]);
    return r;
}

__device__ static inline int key_total(const uint32_t *bits, int key) {
    int n = 0;
#pragma unroll 8
    for (int i = 0; i < PLAN_WORDS; i++) n += __popc(bits[key * PLAN_STRIDE + i]);
    return n;
}

__device__ static inline void clear_bits(uint32_t *bits, int keys) {
    for (int i = threadIdx.x; i < keys * PLAN_STRIDE; i += blockDim.x) bits[i] = 0;
}

__device__ static inline void set_bit(uint32_t *bits, int key) {
    atomicOr(&bits[key * PLAN_STRIDE + threadIdx.x / 32], 1u << (threadIdx.x % 32));
}

/* One plan row by a single 16-byte store (rows lie 16-byte aligned: plan_impl.h). */
__device__ static inline void store_row(comet_plan_row_t *row, int32_t src_rank, int32_t src_token, int32_t slot,
                                        float weight) {
    static_assert(sizeof(comet_plan_row_t) == 16 && COMET_PLAN_ALIGN % 16 == 0, "a row is one 16-byte store");
    *(int4 *)row = make_int4(src_rank, src_token, slot, __float_as_int(weight));
}

/* The first i in [0, n) with a[i] > x, for ascending a with a[n - 1] > x. */
__device__ static inline int first_above(const int32_t *a, int n, int32_t x) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (a[mid] > x) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* Chunks of PLAN_THREADS tokens per source rank (at least one). */
static int64_t plan_chunks(const comet_dims_t *d) {
    const int64_t c = (d->max_tokens + PLAN_THREADS - 1) / PLAN_THREADS;
    return c > 0 ? c : 1;
}

/* Exclusive prefix sum over the block (PLAN_THREADS threads, one value
 * each); *total gets the sum. Uses wsum[PLAN_WORDS + 1] of shared memory. */
__device__ static int block_scan(int v, int *wsum, int *total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) wsum[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = wsum[lane];
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        wsum[lane] = w; /* inclusive over warps */
        if (lane == 31) wsum[PLAN_WORDS] = w;
    }
    __syncthreads();
    const int r = x - v + (warp ? wsum[warp - 1] : 0);
    *total = wsum[PLAN_WORDS];
    __syncthreads(); /* wsum reusable */
    return r;
}

/* Count: cnt[(s * chunks + c) * keys + e] = rows of local expert e among
 * chunk c of rank s's tokens, key el = tokens of the chunk with a row here. */
__global__ void __launch_bounds__(PLAN_THREADS) comet_plan_count(comet_dims_t d, comet_plan_input_t in, void *workspace,
                                                                 int32_t *cnt, const uint32_t *skip) {
    extern __shared__ int32_t scount[]; /* [el + 1] */
    if (skip && *skip) return;
    const int s = blockIdx.y, c = blockIdx.x, tid = threadIdx.x;
    const int64_t el = d.experts_local, topk = d.topk, e0 = (int64_t)d.ep_rank * el;
    const int64_t t = (int64_t)c * PLAN_THREADS + tid, n = in.token_count[s];
    const int32_t *idx = in.topk_idx[s];
    for (int64_t e = tid; e <= el; e += PLAN_THREADS) scount[e] = 0;
    __syncthreads();
    int any = 0;
#pragma unroll 4 /* the index loads of several slots in flight at once */
    for (int64_t j = 0; j < topk; j++) { /* every thread takes each step: full-warp match */
        const int64_t e = t < n ? (int64_t)idx[t * topk + j] - e0 : -1;
        const int key = e >= 0 && e < el ? (int)e : -1;
        any |= key >= 0;
        const unsigned same = __match_any_sync(0xffffffffu, key);
        if (key >= 0 && tid % 32 == __ffs(same) - 1) atomicAdd(&scount[key], __popc(same));
    }
    const unsigned senders = __ballot_sync(0xffffffffu, any);
    if (tid % 32 == 0 && senders) atomicAdd(&scount[el], __popc(senders));
    __syncthreads();
    int32_t *out = cnt + ((int64_t)s * gridDim.x + c) * (el + 1);
    for (int64_t e = tid; e <= el; e += PLAN_THREADS) out[e] = scount[e];

    /* EP groups of each of this rank's tokens, ascending (as plan_impl.h) */
    if (s != d.rank || t >= n) return;
    comet_plan_t p;
    comet_plan_carve(&d, workspace, &p);
    int32_t *g = p.home_groups + t * topk;
    int32_t ng = 0;
    for (int64_t j = 0; j < topk; j++) {
        const int32_t grp = (int32_t)(idx[t * topk + j] / el);
        int dup = 0;
        for (int32_t m = 0; m < ng; m++) dup |= g[m] == grp;
        if (dup) continue;
        int32_t k = ng;
        while (k > 0 && g[k - 1] > grp) {
            g[k] = g[k - 1];
            k--;
        }
        g[k] = grp;
        ng++;
    }
    p.home_group_count[t] = ng;
}

/* The count table's sums for every key k (local experts, then the send key
 * el), by the whole block: the table's (rank, chunk) entries are dealt out
 * to blockDim / keys groups of threads (a group reads one entry's keys, so
 * the loads coalesce and a thread has few of them in flight, not a chain of
 * W x chunks), and the groups' partial sums meet in shared memory.
 *   tot[k]: the key's rows (tokens for the send key) over the whole table;
 *   bef[k] (when not NULL): those before chunk (s, c) in the key's order,
 *     for experts (stage, chunk), for the send key rank s's earlier chunks;
 *   by_rank[s2] (when not NULL): the send key's tokens of source rank s2.
 * The arrays are shared memory ([keys], [keys], [W]); ends with a barrier. */
__device__ static void table_sums(const comet_dims_t &d, const int32_t *cnt, int chunks, int s, int c, int *tot,
                                  int *bef, int *by_rank) {
    const int w = d.world_size, r = d.rank, keys = (int)d.experts_local + 1, tid = threadIdx.x;
    const int groups = blockDim.x / keys, entries = w * chunks;
    for (int k = tid; k < keys; k += blockDim.x) {
        tot[k] = 0;
        if (bef) bef[k] = 0;
    }
    if (by_rank)
        for (int q = tid; q < w; q += blockDim.x) by_rank[q] = 0;
    __syncthreads();
    const int k = tid % keys, g = tid / keys, q = comet_stage_of(r, s, w);
    if (g < groups) {
        int t = 0, b = 0;
#pragma unroll 4
        for (int i = g; i < entries; i += groups) {
            const int v = cnt[(int64_t)i * keys + k], s2 = i / chunks, c2 = i % chunks;
            const int q2 = comet_stage_of(r, s2, w);
            t += v;
            if (k == keys - 1) { /* the send key */
                b += s2 == s && c2 < c ? v : 0;
                if (by_rank && v) atomicAdd(&by_rank[s2], v);
            } else {
                b += q2 < q || (q2 == q && c2 < c) ? v : 0;
            }
        }
        if (t) atomicAdd(&tot[k], t);
        if (bef && b) atomicAdd(&bef[k], b);
    }
    __syncthreads();
}

__device__ static void plan_finish(const comet_dims_t &d, void *workspace, const int32_t *cnt, int32_t *stage_rows,
                                   int chunks, uint32_t *bits, int *wsum);

/* Grid (chunks, W + 1): blocks (c, s + 1) fill chunk c of rank s's tokens;
 * block (0, 0), the first the hardware starts (so never in a second wave
 * behind the fill blocks), is the finish, which needs the count table only. */
__global__ void __launch_bounds__(PLAN_THREADS) comet_plan_fill(comet_dims_t d, comet_plan_input_t in, void *workspace,
                                                                const int32_t *cnt, int32_t *stage_rows,
                                                                const uint32_t *skip) {
    extern __shared__ uint32_t bits[]; /* [el + 1][PLAN_STRIDE], then tot[el + 1], base[el + 1] (the finish: its own) */
    __shared__ int wsum[PLAN_WORDS + 1];
    if (skip && *skip) return;
    const int s = (int)blockIdx.y - 1, c = blockIdx.x, chunks = gridDim.x, tid = threadIdx.x;
    if (s < 0) {
        if (c == 0) plan_finish(d, workspace, cnt, stage_rows, chunks, bits, wsum);
        return;
    }
    const int64_t el = d.experts_local, topk = d.topk, tm = d.tile_m, e0 = (int64_t)d.ep_rank * el;
    const int64_t n = in.token_count[s];
    if ((int64_t)c * PLAN_THREADS >= n) return; /* the whole block: nothing to write */
    const int send_key = (int)el;
    int32_t *tot = (int32_t *)(bits + (el + 1) * PLAN_STRIDE), *base = tot + el + 1;
    comet_plan_t p;
    comet_plan_carve(&d, workspace, &p);

    /* where this chunk's rows of each expert start (the expert's padded
     * start, then the rows before this chunk); where its send-list entries start */
    table_sums(d, cnt, chunks, s, c, tot, base, NULL);
    int all;
    const int start = block_scan(tid < el ? (int)((tot[tid] + tm - 1) / tm * tm) : 0, wsum, &all);
    if (tid < el) base[tid] += start;
    clear_bits(bits, (int)el + 1);
    __syncthreads();

    const int64_t t = (int64_t)c * PLAN_THREADS + tid;
    const int live = t < n;
    const int32_t *idx = in.topk_idx[s];
    int any = 0;
    for (int64_t j = 0; live && j < topk; j++) {
        const int64_t e = (int64_t)idx[t * topk + j] - e0;
        if (e >= 0 && e < el) set_bit(bits, (int)e), any = 1;
    }
    if (any) set_bit(bits, send_key);
    __syncthreads();
    if (!live) return;
    if (any) p.send_tokens[(int64_t)s * d.max_tokens + base[el] + rank_below(bits, send_key)] = (int32_t)t;
    const float *wt = in.topk_w[s];
    int32_t *ros = p.row_of_slot + (int64_t)s * d.max_tokens * topk;
    for (int64_t j = 0; j < topk; j++) {
        const int64_t e = (int64_t)idx[t * topk + j] - e0;
        if (e < 0 || e >= el) {
            ros[t * topk + j] = -1;
            continue;
        }
        const int32_t row = base[e] + rank_below(bits, (int)e);
        store_row(&p.rows[row], s, (int32_t)t, (int32_t)j, wt[t * topk + j]);
        ros[t * topk + j] = row;
    }
}

/* The finish, by one block of the fill's launch (bits: its dynamic shared
 * memory, [W][PLAN_STRIDE], then aux[max(el + 1, W)], tot[el + 1],
 * by_rank[W]; stage_rows: el x W ints of scratch). Reads nothing the fill
 * writes, and writes only what the fill does not (the padding rows lie
 * beyond each expert's filled rows). */
__device__ static void plan_finish(const comet_dims_t &d, void *workspace, const int32_t *cnt, int32_t *stage_rows,
                                   int chunks, uint32_t *bits, int *wsum) {
    comet_plan_t p;
    comet_plan_carve(&d, workspace, &p);
    const int w = d.world_size, r = d.rank, tid = threadIdx.x, nt = blockDim.x;
    const int64_t el = d.experts_local, tm = d.tile_m;
    int32_t *aux = (int32_t *)(bits + w * PLAN_STRIDE), *tot = aux + (el + 1 > w ? el + 1 : w), *by_rank = tot + el + 1;

    /* counts, padded starts, totals; the fill's end of each expert (cursor) */
    table_sums(d, cnt, chunks, 0, 0, tot, NULL, by_rank);
    const int total = tid < el ? tot[tid] : 0;
    int padded_all, rows_all, blocks_all;
    const int padded = tid < el ? (int)((total + tm - 1) / tm * tm) : 0;
    const int start = block_scan(padded, wsum, &padded_all);
    block_scan(total, wsum, &rows_all);
    const int nblk = tid < el ? (int)((total + tm - 1) / tm) : 0;
    const int first_block = block_scan(nblk, wsum, &blocks_all);
    int pads_all; /* padding rows, spread over the block: tot[e] = those of experts <= e */
    const int pads = padded - total, pads_end = block_scan(pads, wsum, &pads_all) + pads;
    if (tid < el) {
        p.expert_count[tid] = total;
        p.expert_start[tid] = start;
        p.cursor[tid] = start + total;
        aux[tid] = first_block;
        tot[tid] = pads_end;
    }
    if (tid == 0) {
        aux[el] = blocks_all;
        p.expert_start[el] = padded_all;
        p.totals->num_rows = rows_all;
        p.totals->num_rows_padded = padded_all;
        p.totals->num_blocks = blocks_all;
    }
    for (int s = tid; s < w; s += nt) p.send_count[s] = by_rank[s];
    __syncthreads();
    for (int32_t i = tid; i < pads_all; i += nt) { /* padding row i: expert e, the first with tot[e] > i */
        const int e = first_above(tot, (int)el, i);
        store_row(&p.rows[p.cursor[e] + i - (e ? tot[e - 1] : 0)], -1, -1, -1, 0.0f);
    }
    /* stage_rows[e * W + q]: expert e's rows from stages <= q (its rows lie
     * in stage order, then by chunk: the fill's order): its rows of each
     * stage, then their running sums */
    for (int64_t i = tid; i < el * w; i += nt) {
        const int64_t e = i / w;
        const int32_t *col = cnt + (int64_t)comet_rank_of_stage(r, (int)(i % w), w) * chunks * (el + 1) + e;
        int v = 0;
#pragma unroll 4
        for (int c = 0; c < chunks; c++) v += col[(int64_t)c * (el + 1)];
        stage_rows[i] = v;
    }
    __syncthreads();
    for (int64_t e = tid; e < el; e += nt)
        for (int q = 1; q < w; q++) stage_rows[e * w + q] += stage_rows[e * w + q - 1];
    __syncthreads();

    /* row blocks in expert order, one thread per block (its expert: the last
     * with first block <= b, aux[e] being the first block of expert e); its
     * stage is its last row's: the first stage up to which the expert has
     * more rows than that row's index in it */
    const int32_t nb = blocks_all;
    for (int32_t b = tid; b < nb; b += nt) {
        const int lo = first_above(aux, (int)el + 1, b) - 1; /* aux[0] = 0 <= b < aux[el] = blocks_all */
        const int32_t st = p.expert_start[lo] + (b - aux[lo]) * (int32_t)tm, end = p.expert_start[lo] + p.expert_count[lo];
        comet_plan_block_t blk;
        blk.expert = lo;
        blk.row_start = st;
        blk.num_rows = (int32_t)(end - st < tm ? end - st : tm);
        const int32_t last = (b - aux[lo]) * (int32_t)tm + blk.num_rows - 1; /* its index in the expert */
        blk.stage = first_above(stage_rows + (int64_t)lo * w, w, last); /* stage_rows[lo][w - 1], all its rows, is */
        p.blocks[b] = blk;
    }
    __syncthreads();

    /* local-first order: stable ranking of blocks by stage (counts in
     * by_rank, whose send counts are stored) */
    for (int q = tid; q < w; q += nt) by_rank[q] = 0;
    __syncthreads();
    for (int32_t b = tid; b < nb; b += nt) atomicAdd(&by_rank[p.blocks[b].stage], 1);
    __syncthreads();
    if (tid == 0)
        for (int q = 0, end = 0; q < w; q++) {
            aux[q] = end;
            end += by_rank[q];
            p.stage_end[q] = end;
        }
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
}

/* The sequential builder, one thread: for plans with more experts per rank
 * than shared memory holds bitmasks for. */
__global__ void comet_plan_build_serial(comet_dims_t d, comet_plan_input_t in, void *workspace, const uint32_t *skip) {
    if (threadIdx.x != 0 || (skip && *skip)) return;
    comet_plan_t plan;
    comet_plan_carve(&d, workspace, &plan);
    comet_plan_build(&d, &in, &plan);
}

/* Scratch: the count table [W][chunks][el + 1], then the finish's
 * stage_rows [el][W]. */
extern "C" size_t comet_cuda_plan_scratch_bytes(const comet_dims_t *d) {
    const int64_t w = d->world_size, el = d->experts_local;
    return (size_t)(w * plan_chunks(d) * (el + 1) + el * w) * sizeof(int32_t);
}

extern "C" cudaError_t comet_cuda_plan_build(const comet_dims_t *d, const comet_plan_input_t *in, void *workspace,
                                             void *scratch, const uint32_t *skip, cudaStream_t stream,
                                             comet_plan_step_hook_t between, void *arg) {
    const int64_t el = d->experts_local, w = d->world_size;
    const int64_t keys = el + 1 > w ? el + 1 : w;
    if (keys > COMET_PLAN_MAX_KEYS) {
        comet_plan_build_serial<<<1, 32, 0, stream>>>(*d, *in, workspace, skip);
        return cudaGetLastError();
    }
    /* the shared-memory limit is per device: raise it on the current one */
    const int most = COMET_PLAN_MAX_KEYS * (PLAN_STRIDE + 3) * (int)sizeof(uint32_t);
    const size_t fill_smem = (size_t)(el + 1) * (PLAN_STRIDE + 2) * sizeof(uint32_t);
    const size_t finish_smem = (size_t)keys * (PLAN_STRIDE + 3) * sizeof(uint32_t);
    const size_t smem = fill_smem > finish_smem ? fill_smem : finish_smem; /* one launch runs both */
    cudaError_t e = cudaSuccess;
    if (smem > 48 * 1024) e = cudaFuncSetAttribute(comet_plan_fill, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
    if (e != cudaSuccess) return e;
    const int64_t chunks = plan_chunks(d);
    int32_t *cnt = (int32_t *)scratch, *stage_rows = cnt + w * chunks * (el + 1);
    comet_plan_count<<<dim3((unsigned)chunks, (unsigned)w), PLAN_THREADS, (size_t)(el + 1) * sizeof(int32_t), stream>>>(
        *d, *in, workspace, cnt, skip);
    if (between && (e = between(arg, 1, stream)) != cudaSuccess) return e;
    comet_plan_fill<<<dim3((unsigned)chunks, (unsigned)w + 1), PLAN_THREADS, smem, stream>>>(*d, *in, workspace, cnt,
                                                                                            stage_rows, skip);
    return cudaGetLastError();
}
