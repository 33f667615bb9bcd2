// fanout.cu: how fast a few SMs can store token rows into several rows each (the overlapped
// dispatch's fan-out), on one GPU. The question behind it (dev/NOTES.md, ninth session): the
// overlapped mode's 16 pulling CTAs move Qwen2 TP2's ~33 MB of remote rows at ~70-100 GB/s even
// with no GEMM beside them ("comm only" side), where 16 CTAs stream 318 GB/s over the same link
// (bench/link_bench). Each pulled row is stored once per slot here (4x in TP2, ~2x in EP2), and
// the excess time over the sequential chain grows with those stores (TP2 +338 us, EP2 +237 us):
// so is a CTA's store rate the limit, and do the TMA unit's bulk stores raise it?
//
// One GPU, local source rows (the link is not the question): N token rows of H bf16 are each
// copied into AMP rows of dst, scattered by a random permutation as the plan scatters them.
// Ways (each checked row by row against src, dst poisoned before):
//   store - no reads: the CTAs store a constant into the AMP x N rows (the store ceiling);
//   regs  - the library's dispatch_copy: 512 threads, 12 16-byte loads in flight a thread, each
//           value stored AMP times;
//   warp  - a warp a row pair: each lane loads 8 16-byte words of each of two rows (16 in flight),
//           the rows' AMP targets looked up once (lane j holds target j, by shuffle), then stores;
//           no divisions, no per-store lookups;
//   bulk  - one thread a CTA: each row read into a shared-memory stage by cp.async.bulk (16 stages
//           of one row) and stored AMP times by cp.async.bulk global <- shared, 8 rows' stores in
//           flight while the next 8 rows load.
// GB/s = rows read (N x H x 2 bytes) / time; stores are AMP times that. Median of 9 runs.
// Usage: ./fanout   (prints a table)
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "../../src/cuda/tma.h"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); exit(1); } } while (0)

#define THREADS 512
#define UNROLL 12
#define STAGES 16
#define LAG 8 /* rows whose stores may still read their stage */
#define MAX_AMP 8

enum { WAY_STORE, WAY_REGS, WAY_WARP, WAY_BULK, NWAYS };
static const char *way_name[NWAYS] = {"store", "regs", "warp", "bulk"};

typedef struct {
    const uint4 *src; /* N rows */
    uint4 *dst;       /* N * amp rows */
    const int32_t *to; /* N x amp: the dst row of token t's copy j */
    int n, amp, row16; /* row16 = 16-byte words a row */
} prob_t;

__global__ void __launch_bounds__(THREADS, 1) k_store(prob_t p) {
    const uint4 v = make_uint4(0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u);
    const uint32_t total = (uint32_t)p.n * (uint32_t)p.amp * (uint32_t)p.row16;
    for (uint32_t i = blockIdx.x * THREADS + threadIdx.x; i < total; i += gridDim.x * THREADS) p.dst[i] = v;
}

/* dispatch_copy's loop over a CTA's batches of tokens (blocks of 128 tokens round robin) */
__global__ void __launch_bounds__(THREADS, 1) k_regs(prob_t p) {
    const uint32_t per_row = (uint32_t)p.row16;
    for (int t0 = blockIdx.x * 128; t0 < p.n; t0 += gridDim.x * 128) {
        const int nr = p.n - t0 < 128 ? p.n - t0 : 128;
        const uint32_t total = per_row * (uint32_t)nr;
        for (uint32_t base = 0; base < total; base += THREADS * UNROLL) {
            uint4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                const uint32_t i = base + u * THREADS + threadIdx.x;
                if (i < total) v[u] = p.src[(size_t)(t0 + i / per_row) * per_row + i % per_row];
            }
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                const uint32_t i = base + u * THREADS + threadIdx.x;
                if (i >= total) continue;
                const int32_t *to = p.to + (size_t)(t0 + i / per_row) * p.amp;
                for (int j = 0; j < p.amp; j++) p.dst[(size_t)to[j] * per_row + i % per_row] = v[u];
            }
        }
    }
}

/* warps take row pairs (2w, 2w + 1), w = global warp index, + all warps; rows of 256 words (H = 2048) */
#define WARP_WORDS 8 /* 16-byte words a lane and row: 32 x 8 x 16 B = one 4 KB row */
__global__ void __launch_bounds__(THREADS, 1) k_warp(prob_t p) {
    const int lane = threadIdx.x % 32, nwarps = gridDim.x * (THREADS / 32);
    for (int r0 = 2 * (blockIdx.x * (THREADS / 32) + threadIdx.x / 32); r0 < p.n; r0 += 2 * nwarps) {
        const int rows = p.n - r0 < 2 ? 1 : 2;
        int32_t to0 = lane < p.amp ? p.to[(size_t)r0 * p.amp + lane] : 0;
        int32_t to1 = lane < p.amp && rows > 1 ? p.to[(size_t)(r0 + 1) * p.amp + lane] : 0;
        uint4 v[2][WARP_WORDS];
#pragma unroll
        for (int u = 0; u < WARP_WORDS; u++) {
            v[0][u] = p.src[(size_t)r0 * p.row16 + u * 32 + lane];
            if (rows > 1) v[1][u] = p.src[(size_t)(r0 + 1) * p.row16 + u * 32 + lane];
        }
        for (int j = 0; j < p.amp; j++) {
            const int32_t d0 = __shfl_sync(0xffffffffu, to0, j), d1 = __shfl_sync(0xffffffffu, to1, j);
#pragma unroll
            for (int u = 0; u < WARP_WORDS; u++) {
                p.dst[(size_t)d0 * p.row16 + u * 32 + lane] = v[0][u];
                if (rows > 1) p.dst[(size_t)d1 * p.row16 + u * 32 + lane] = v[1][u];
            }
        }
    }
}

__device__ __forceinline__ void bulk_store(void *dst, const void *src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(gm_smem(src)), "r"(bytes)
                 : "memory");
}

/* one thread drives the CTA's rows (tokens blockIdx.x, + gridDim.x, ...) through STAGES stages */
__global__ void k_bulk(prob_t p) {
    extern __shared__ __align__(128) unsigned char stage[]; /* STAGES x row bytes */
    __shared__ __align__(8) uint64_t bar[STAGES];
    if (threadIdx.x != 0) return;
    const uint32_t row_bytes = (uint32_t)p.row16 * 16;
    for (int s = 0; s < STAGES; s++) gm_mbar_init(&bar[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    const int mine = (p.n - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x; /* rows of this CTA */
    for (int r = 0; r < mine && r < STAGES; r++) { /* the first loads */
        gm_mbar_expect_tx(&bar[r], row_bytes);
        gm_bulk_load(stage + (size_t)r * row_bytes, p.src + (size_t)(blockIdx.x + r * gridDim.x) * p.row16, row_bytes, &bar[r]);
    }
    for (int r = 0; r < mine; r++) {
        const int s = r % STAGES, t = (int)blockIdx.x + r * (int)gridDim.x;
        gm_mbar_wait(&bar[s], (r / STAGES) & 1);
        for (int j = 0; j < p.amp; j++)
            bulk_store(p.dst + (size_t)p.to[(size_t)t * p.amp + j] * p.row16, stage + (size_t)s * row_bytes, row_bytes);
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        /* row r - LAG's stores have read their stage: load row r - LAG + STAGES into it */
        asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(LAG) : "memory");
        const int old = r - LAG, next = old + STAGES;
        if (old >= 0 && next < mine) {
            const int so = old % STAGES;
            gm_mbar_expect_tx(&bar[so], row_bytes);
            gm_bulk_load(stage + (size_t)so * row_bytes, p.src + (size_t)(blockIdx.x + next * gridDim.x) * p.row16, row_bytes,
                      &bar[so]);
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

/* rows of dst that differ from what the way should have stored */
__global__ void k_check(prob_t p, int way, unsigned long long *bad) {
    const uint4 c = make_uint4(0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u);
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (int64_t)p.n * p.amp * p.row16;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t slot = i / p.row16, w16 = i % p.row16; /* slot = t * amp + j */
        const uint4 want = way == WAY_STORE ? c : p.src[(slot / p.amp) * p.row16 + w16];
        const uint4 got = p.dst[(int64_t)p.to[slot] * p.row16 + w16];
        if (got.x != want.x || got.y != want.y || got.z != want.z || got.w != want.w) atomicAdd(bad, 1ull);
    }
}

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

static void launch(int way, int ctas, const prob_t *p) {
    if (way == WAY_STORE) k_store<<<ctas, THREADS>>>(*p);
    if (way == WAY_REGS) k_regs<<<ctas, THREADS>>>(*p);
    if (way == WAY_WARP) k_warp<<<ctas, THREADS>>>(*p);
    if (way == WAY_BULK) k_bulk<<<ctas, 32, STAGES * p->row16 * 16>>>(*p);
}

int main(void) {
    const int n = 8192, hidden = 2048, row16 = hidden * 2 / 16; /* k_warp assumes row16 = 256 */
    const size_t row_bytes = (size_t)hidden * 2;
    uint4 *src, *dst;
    int32_t *to;
    unsigned long long *bad;
    CK(cudaMalloc(&src, (size_t)n * row_bytes));
    CK(cudaMalloc(&dst, (size_t)n * MAX_AMP * row_bytes));
    CK(cudaMalloc(&to, (size_t)n * MAX_AMP * 4));
    CK(cudaMalloc(&bad, 8));
    CK(cudaFuncSetAttribute(k_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, STAGES * (int)row_bytes));
    /* random source bits (never zeros) */
    uint32_t *h = (uint32_t *)malloc((size_t)n * row_bytes);
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < (size_t)n * row_bytes / 4; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        h[i] = (uint32_t)x | 0x00010001u;
    }
    CK(cudaMemcpy(src, h, (size_t)n * row_bytes, cudaMemcpyHostToDevice));
    free(h);
    int32_t *perm = (int32_t *)malloc((size_t)n * MAX_AMP * 4);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const int amps[] = {1, 2, 4}, ctas[] = {16, 32, 132};
    int wrong = 0;
    printf("%-6s %4s %5s %10s %12s %6s\n", "way", "amp", "ctas", "read GB/s", "store GB/s", "bad");
    for (int ai = 0; ai < 3; ai++) {
        const int amp = amps[ai];
        for (int i = 0; i < n * amp; i++) perm[i] = i;
        for (int i = n * amp - 1; i > 0; i--) { /* Fisher-Yates */
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            const int k = (int)(x % (uint64_t)(i + 1));
            const int32_t tmp = perm[i];
            perm[i] = perm[k], perm[k] = tmp;
        }
        CK(cudaMemcpy(to, perm, (size_t)n * amp * 4, cudaMemcpyHostToDevice));
        const prob_t p = {src, dst, to, n, amp, row16};
        for (int way = 0; way < NWAYS; way++)
            for (int ci = 0; ci < 3; ci++) {
                CK(cudaMemset(dst, 0xff, (size_t)n * amp * row_bytes)); /* poison */
                launch(way, ctas[ci], &p);
                CK(cudaGetLastError());
                CK(cudaMemset(bad, 0, 8));
                k_check<<<264, 256>>>(p, way, bad);
                unsigned long long nbad = 0;
                CK(cudaMemcpy(&nbad, bad, 8, cudaMemcpyDeviceToHost));
                wrong |= nbad != 0;
                float ms[9];
                for (int it = 0; it < 9; it++) {
                    CK(cudaEventRecord(e0));
                    launch(way, ctas[ci], &p);
                    CK(cudaEventRecord(e1));
                    CK(cudaEventSynchronize(e1));
                    CK(cudaEventElapsedTime(&ms[it], e0, e1));
                }
                qsort(ms, 9, sizeof ms[0], cmp_float);
                const double gbs = (double)n * row_bytes / (ms[4] * 1e-3) / 1e9;
                printf("%-6s %4d %5d %10.1f %12.1f %6llu\n", way_name[way], amp, ctas[ci], way == WAY_STORE ? 0.0 : gbs,
                       gbs * amp, nbad);
            }
    }
    free(perm);
    printf("%s\n", wrong ? "WRONG: some way stored bad rows" : "all rows checked: equal");
    return wrong;
}
