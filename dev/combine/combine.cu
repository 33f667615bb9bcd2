// combine.cu: the layer's local combine (src/cuda/layer/combine.cuh, pull_combine) as a standalone
// experiment, to find a data mover that reads the expert output rows near the HBM rate. The library's
// reads 1.3-2 TB/s (dev/NOTES.md, session 7): latency-bound, 16 warps x 64 B a lane in flight an SM.
//
//   y[t][c] = bf16( sum over groups g (ascending) of part_g ),  part_g = fmaf chain over the token's
//             entries e of group g (ascending) of w[e] * o[row[e]][c], from 0;  acc from 0, fp32.
// That is the library's arithmetic: a group stands for one (EP group, TP rank) pair of a token, its
// entries for the token's slots there. Every version must give the same bits as the CPU reference.
// Rows are scattered (a random permutation), as the plan scatters them.
//
// Versions (./combine VERSION CONFIG, 0 = all):
//   1: the library's pattern: a warp a token, 512-column passes (2 x 256), per group batches of 2
//      entries, each batch's 4 loads a lane in flight before its FMAs; entries of the next token
//      prefetched into lanes.
//   2: flattened: batches of 4 entries across group boundaries (the boundaries kept for the sums),
//      512-column passes: 8 loads a lane in flight.
//   3: flattened, batches of 8 entries, 256-column passes: 8 loads a lane in flight, fewer registers
//      for the sums.
//   4: rows into shared memory by TMA bulk copies (cp.async.bulk, one per row segment of 1024
//      columns), a producer warp a CTA and 8 reducing warps, a ring of stages on mbarriers: the bytes
//      in flight take no registers.
//   0 also runs a plain read of o (every row once, coalesced) as the ceiling.
// Usage: ./combine [version] [config]   configs: see CONFIGS below (default: all).
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "../../src/cuda/tma.h"
#include "../../src/cuda/vec8.h"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); exit(1); } } while (0)

typedef struct { const char *name; int T, H, K, G; } config_t;
// K = entries a token (topk x tp rows it sums), G = groups (EP group x TP rank pairs), K % G == 0
static const config_t CONFIGS[] = {
    {"tiny", 300, 2048, 4, 2}, /* for compute-sanitizer */
    {"mixtral-ep2", 8192, 4096, 2, 2},  {"mixtral-tp2", 8192, 4096, 4, 2}, {"qwen2-ep2", 8192, 2048, 4, 2},
    {"qwen2-tp2", 8192, 2048, 8, 2},    {"deepseek-ep2", 8192, 7168, 8, 2}, {"deepseek-tp2", 8192, 7168, 16, 2},
};
#define NCONFIGS (int)(sizeof CONFIGS / sizeof CONFIGS[0])

typedef struct {
    const uint16_t *o;   // (T*K) x H bf16
    const int32_t *row;  // T x K
    const float *w;      // T x K
    uint16_t *y;         // T x H
    int T, H, K, gs;     // gs = K / G entries a group
} prob_t;

// ---------------------------------------------------------------------------------------------
// register movers (versions 1-3)
// ---------------------------------------------------------------------------------------------
// the token's entry `lane` (row, weight), or (-1, 0) past the tokens or the entries
__device__ __forceinline__ void entry_of(const prob_t &p, int64_t t, int lane, int32_t *row, float *w) {
    *row = -1, *w = 0.0f;
    if (t < p.T && lane < p.K) *row = p.row[t * p.K + lane], *w = p.w[t * p.K + lane];
}

// Version 1: per group, batches of 2 entries x 2 column groups (the library's SLOT_BATCH x COL_GROUPS).
__global__ void __launch_bounds__(512, 1) v1_kernel(prob_t p) {
    const int lane = threadIdx.x % 32, wpc = blockDim.x / 32;
    const int64_t s = (int64_t)gridDim.x * wpc;
    int64_t t = (int64_t)blockIdx.x * wpc + threadIdx.x / 32;
    int32_t row, nrow;
    float w, nw;
    entry_of(p, t, lane, &row, &w);
    for (; t < p.T; t += s) {
        entry_of(p, t + s, lane, &nrow, &nw);
        for (int g0 = 0; g0 < p.H; g0 += 512) {
            float acc[16];
            for (int i = 0; i < 16; i++) acc[i] = 0.0f;
            for (int g = 0; g < p.K / p.gs; g++) {
                float part[16];
                for (int i = 0; i < 16; i++) part[i] = 0.0f;
                for (int j0 = 0; j0 < p.gs; j0 += 2) {
                    uint4 v[2][2];
                    int32_t r[2];
                    float wj[2];
#pragma unroll
                    for (int u = 0; u < 2; u++) {
                        const int e = g * p.gs + j0 + u;
                        r[u] = __shfl_sync(0xffffffffu, row, e & 31), wj[u] = __shfl_sync(0xffffffffu, w, e & 31);
                        if (j0 + u >= p.gs) r[u] = -1;
#pragma unroll
                        for (int gi = 0; gi < 2; gi++)
                            if (r[u] >= 0) v[u][gi] = *(const uint4 *)(p.o + (int64_t)r[u] * p.H + g0 + gi * 256 + lane * 8);
                    }
#pragma unroll
                    for (int u = 0; u < 2; u++)
#pragma unroll
                        for (int gi = 0; gi < 2; gi++)
                            if (r[u] >= 0)
                                for (int i = 0; i < 8; i++) part[gi * 8 + i] = fmaf(wj[u], bf16_at(v[u][gi], i), part[gi * 8 + i]);
                }
                for (int i = 0; i < 16; i++) acc[i] += part[i];
            }
            for (int gi = 0; gi < 2; gi++) st8_bf16(p.y + t * p.H + g0 + gi * 256 + lane * 8, acc + gi * 8, 8, 1);
        }
        row = nrow, w = nw;
    }
}

// Versions 2 and 3: the token's entries in batches of R across group boundaries, CG 256-column groups a pass.
template <int R, int CG>
__global__ void __launch_bounds__(512, 1) flat_kernel(prob_t p) {
    const int lane = threadIdx.x % 32, wpc = blockDim.x / 32;
    const int64_t s = (int64_t)gridDim.x * wpc;
    int64_t t = (int64_t)blockIdx.x * wpc + threadIdx.x / 32;
    int32_t row, nrow;
    float w, nw;
    entry_of(p, t, lane, &row, &w);
    for (; t < p.T; t += s) {
        entry_of(p, t + s, lane, &nrow, &nw);
        for (int g0 = 0; g0 < p.H; g0 += 256 * CG) {
            float acc[8 * CG], part[8 * CG];
#pragma unroll
            for (int i = 0; i < 8 * CG; i++) acc[i] = 0.0f, part[i] = 0.0f;
            for (int b0 = 0; b0 < p.K; b0 += R) {
                uint4 v[R][CG];
                int32_t r[R];
                float wj[R];
#pragma unroll
                for (int u = 0; u < R; u++) {
                    r[u] = __shfl_sync(0xffffffffu, row, (b0 + u) & 31), wj[u] = __shfl_sync(0xffffffffu, w, (b0 + u) & 31);
                    if (b0 + u >= p.K) r[u] = -1;
#pragma unroll
                    for (int gi = 0; gi < CG; gi++)
                        if (r[u] >= 0) v[u][gi] = *(const uint4 *)(p.o + (int64_t)r[u] * p.H + g0 + gi * 256 + lane * 8);
                }
#pragma unroll
                for (int u = 0; u < R; u++) {
                    const int e = b0 + u;
                    if (e >= p.K) break;
                    if (e > 0 && e % p.gs == 0) { /* a new group: the finished one into acc */
#pragma unroll
                        for (int i = 0; i < 8 * CG; i++) acc[i] += part[i], part[i] = 0.0f;
                    }
#pragma unroll
                    for (int gi = 0; gi < CG; gi++)
                        for (int i = 0; i < 8; i++) part[gi * 8 + i] = fmaf(wj[u], bf16_at(v[u][gi], i), part[gi * 8 + i]);
                }
            }
#pragma unroll
            for (int i = 0; i < 8 * CG; i++) acc[i] += part[i];
#pragma unroll
            for (int gi = 0; gi < CG; gi++) st8_bf16(p.y + t * p.H + g0 + gi * 256 + lane * 8, acc + gi * 8, 8, 1);
        }
        row = nrow, w = nw;
    }
}

// ---------------------------------------------------------------------------------------------
// version 4: TMA bulk copies into a ring of shared-memory stages
// ---------------------------------------------------------------------------------------------
// (its 4-column steps; the library's combine by bulk copies, which used them, measured slower and
// was removed: dev/NOTES.md, session 8)
// part[i] = fmaf(w, element i of the 4 packed bf16 v, part[i]), i ascending.
__device__ static inline void fmaf4_bf16(float w, uint2 v, float part[4]) {
    part[0] = fmaf(w, __uint_as_float(v.x << 16), part[0]);
    part[1] = fmaf(w, __uint_as_float(v.x & 0xffff0000u), part[1]);
    part[2] = fmaf(w, __uint_as_float(v.y << 16), part[2]);
    part[3] = fmaf(w, __uint_as_float(v.y & 0xffff0000u), part[3]);
}

// 4 floats as packed bf16 (round to nearest even).
__device__ static inline uint2 pack4_bf16(const float v[4]) {
    return make_uint2((uint32_t)comet_f32_to_bf16(v[0]) | (uint32_t)comet_f32_to_bf16(v[1]) << 16,
                      (uint32_t)comet_f32_to_bf16(v[2]) | (uint32_t)comet_f32_to_bf16(v[3]) << 16);
}

#define BK_CW 1024           // columns a work item (one row segment = 2 KiB)
#define BK_CONSUMERS 8       // reducing warps; 256 threads x 4 columns = 1024
#define BK_SMEM (200 * 1024) // ring bytes at most

// The token of the CTA's n-th item (item blockIdx.x + n * grid), or T (no entries) past the items.
__device__ __forceinline__ int64_t item_token(const prob_t &p, int64_t n, int64_t items, int chunks) {
    const int64_t it = (int64_t)blockIdx.x + n * gridDim.x;
    return it < items ? it / chunks : p.T;
}

// Work item i = (token i / chunks, column chunk i % chunks); CTA b takes items b, b + grid, ...
// Stage layout: K row segments of BK_CW bf16, then K weights (fp32).
__global__ void __launch_bounds__(32 * (BK_CONSUMERS + 1), 1) v4_kernel(prob_t p, int stages) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) uint64_t full[16], empty[16];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int chunks = p.H / BK_CW;
    const int64_t items = (int64_t)p.T * chunks;
    const uint32_t seg = BK_CW * 2, stage_bytes = (uint32_t)(p.K * seg + ((p.K * 4 + 15) / 16) * 16);
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; s++) gm_mbar_init(&full[s], 1), gm_mbar_init(&empty[s], BK_CONSUMERS);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == BK_CONSUMERS) { /* the producer warp: lane j copies the item's row j */
        // items in groups of 4: the next group's rows and weights (a lane's entry of each) are loaded
        // while this group's copies are issued, so the loads have 4 items of issue to land
        int32_t cur[4], nxt[4];
        float cw[4], nw[4];
#pragma unroll
        for (int u = 0; u < 4; u++) entry_of(p, item_token(p, u, items, chunks), lane, &cur[u], &cw[u]);
        for (int64_t g = 0;; g++) {
#pragma unroll
            for (int u = 0; u < 4; u++) entry_of(p, item_token(p, 4 * (g + 1) + u, items, chunks), lane, &nxt[u], &nw[u]);
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int64_t n = 4 * g + u, it = (int64_t)blockIdx.x + n * gridDim.x;
                if (it >= items) return;
                const int s = (int)(n % stages);
                unsigned char *st = ring + (size_t)s * stage_bytes;
                if (lane == 0) gm_mbar_wait(&empty[s], (int)(((n / stages) & 1) ^ 1));
                __syncwarp();
                if (lane < p.K) ((float *)(st + p.K * seg))[lane] = cw[u];
                __syncwarp();
                if (lane == 0) gm_mbar_expect_tx(&full[s], (uint32_t)p.K * seg); /* arrives: the weights' stores before it */
                __syncwarp();
                const int64_t c0 = (it % chunks) * BK_CW;
                if (lane < p.K) gm_bulk_load(st + lane * seg, p.o + (int64_t)cur[u] * p.H + c0, seg, &full[s]);
            }
#pragma unroll
            for (int u = 0; u < 4; u++) cur[u] = nxt[u], cw[u] = nw[u];
        }
    }
    /* reducing warps: thread x of 256 takes columns 4x .. 4x+3 of the chunk */
    const int x = threadIdx.x;
    for (int64_t n = 0;; n++) {
        const int64_t it = (int64_t)blockIdx.x + n * gridDim.x;
        if (it >= items) break;
        const int s = (int)(n % stages);
        const unsigned char *st = ring + (size_t)s * stage_bytes;
        gm_mbar_wait(&full[s], (int)((n / stages) & 1));
        const float *wt = (const float *)(st + p.K * seg);
        float acc[4] = {0, 0, 0, 0}, part[4] = {0, 0, 0, 0};
        for (int e = 0; e < p.K; e++) {
            if (e > 0 && e % p.gs == 0)
                for (int i = 0; i < 4; i++) acc[i] += part[i], part[i] = 0.0f;
            fmaf4_bf16(wt[e], *(const uint2 *)(st + e * seg + x * 8), part);
        }
        for (int i = 0; i < 4; i++) acc[i] += part[i];
        __syncwarp();
        if (lane == 0) gm_mbar_arrive(&empty[s]); /* the warp's reads of the stage are done */
        const int64_t t = it / chunks, c = (it % chunks) * BK_CW + x * 4;
        *(uint2 *)(p.y + t * p.H + c) = pack4_bf16(acc);
    }
}

// ---------------------------------------------------------------------------------------------
// version 0: the ceiling, a plain coalesced read of every row (sum kept so the loads stay)
// ---------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(512) read_kernel(const uint4 *o, int64_t n, uint32_t *sink) {
    uint32_t x = 0;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x * 8;
    for (int64_t b = (int64_t)blockIdx.x * blockDim.x * 8 + threadIdx.x; b < n; b += stride) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = b + u * blockDim.x < n ? o[b + u * blockDim.x] : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < 8; u++) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (x == 0x12345678u) *sink = x;
}

// ---------------------------------------------------------------------------------------------
// host
// ---------------------------------------------------------------------------------------------
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng_next(void) {
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return rng_state;
}
static float rng_unit(void) { return (float)((rng_next() >> 40) * (1.0 / 16777216.0)); }

static void reference(const config_t *c, const uint16_t *o, const int32_t *row, const float *w, uint16_t *y) {
    const int gs = c->K / c->G;
    for (int64_t t = 0; t < c->T; t++)
        for (int64_t col = 0; col < c->H; col++) {
            float acc = 0.0f, part = 0.0f;
            for (int e = 0; e < c->K; e++) {
                if (e > 0 && e % gs == 0) acc += part, part = 0.0f;
                part = fmaf(w[t * c->K + e], comet_bf16_to_f32(o[(int64_t)row[t * c->K + e] * c->H + col]), part);
            }
            acc += part;
            y[t * c->H + col] = comet_f32_to_bf16(acc);
        }
}

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static const char *NAMES[5] = {"read o once (ceiling)", "v1 library pattern", "v2 flat R4 x 512 col",
                               "v3 flat R8 x 256 col", "v4 TMA bulk to smem"};

// Runs version v on the problem; returns the median ms, or -1 on a failed check (printed).
static float run_version(int v, const config_t *c, prob_t p, const uint16_t *y_ref, uint16_t *y_host, uint32_t *sink,
                         int sms) {
    const int64_t ybytes = (int64_t)c->T * c->H * 2;
    const int gs = c->K / c->G;
    int stages = 0;
    size_t smem = 0;
    if (v == 4) {
        const uint32_t stage_bytes = (uint32_t)(c->K * BK_CW * 2 + ((c->K * 4 + 15) / 16) * 16);
        stages = (int)(BK_SMEM / stage_bytes);
        if (stages > 16) stages = 16;
        if (stages < 2 || c->H % BK_CW) {
            printf("  %-24s skipped (a stage of %u bytes, H %d)\n", NAMES[v], stage_bytes, c->H);
            return 0;
        }
        smem = (size_t)stages * stage_bytes;
        CK(cudaFuncSetAttribute(v4_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    }
    (void)gs;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float ms[25];
    for (int rep = -1; rep < 25; rep++) {
        if (rep <= 0) CK(cudaMemset(p.y, 0xff, ybytes)); /* poisoned before the checked run */
        CK(cudaEventRecord(e0));
        switch (v) {
        case 0: read_kernel<<<sms * 4, 512>>>((const uint4 *)p.o, (int64_t)c->T * c->K * c->H / 8, sink); break;
        case 1: v1_kernel<<<sms, 512>>>(p); break;
        case 2: flat_kernel<4, 2><<<sms, 512>>>(p); break;
        case 3: flat_kernel<8, 1><<<sms, 512>>>(p); break;
        case 4: v4_kernel<<<sms, 32 * (BK_CONSUMERS + 1), smem>>>(p, stages); break;
        }
        CK(cudaGetLastError());
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        if (rep >= 0) CK(cudaEventElapsedTime(&ms[rep], e0, e1));
        if (rep == 0 && v) { /* the check, on the first timed run's output */
            CK(cudaMemcpy(y_host, p.y, ybytes, cudaMemcpyDeviceToHost));
            int64_t bad = 0, first = -1;
            for (int64_t i = 0; i < (int64_t)c->T * c->H; i++)
                if (y_host[i] != y_ref[i]) bad++, first = first < 0 ? i : first;
            if (bad) {
                CK(cudaEventDestroy(e0));
                CK(cudaEventDestroy(e1));
                printf("  %-24s WRONG: %lld of %lld elements differ from the reference (first at token %lld col %lld)\n",
                       NAMES[v], (long long)bad, (long long)c->T * c->H, (long long)(first / c->H), (long long)(first % c->H));
                return -1;
            }
        }
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    qsort(ms, 25, sizeof(float), cmp_float);
    return ms[12];
}

int main(int argc, char **argv) {
    const int only_v = argc > 1 ? atoi(argv[1]) : 0;
    const char *only_c = argc > 2 ? argv[2] : NULL;
    int dev = 0, sms = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    printf("combine experiment on %s (%d SMs); GB/s = (rows read + y written) / median time of 25\n", prop.name, sms);
    int failed = 0, ran = 0;
    printf("%-14s %-24s %9s %9s\n", "config", "version", "ms", "GB/s");
    for (int ci = 0; ci < NCONFIGS; ci++) {
        const config_t *c = &CONFIGS[ci];
        if (only_c && strcmp(only_c, c->name)) continue;
        ran++;
        const int64_t nrows = (int64_t)c->T * c->K, obytes = nrows * c->H * 2, ybytes = (int64_t)c->T * c->H * 2;
        uint16_t *o = (uint16_t *)malloc(obytes), *y_ref = (uint16_t *)malloc(ybytes), *y_host = (uint16_t *)malloc(ybytes);
        int32_t *row = (int32_t *)malloc(nrows * 4);
        float *w = (float *)malloc(nrows * 4);
        if (!o || !y_ref || !y_host || !row || !w) { fprintf(stderr, "host memory\n"); return 1; }
        for (int64_t i = 0; i < nrows * c->H; i++) o[i] = comet_f32_to_bf16(2.0f * rng_unit() - 1.0f);
        for (int64_t i = 0; i < nrows; i++) row[i] = (int32_t)i, w[i] = 0.05f + rng_unit();
        for (int64_t i = nrows - 1; i > 0; i--) { /* scattered rows */
            const int64_t j = (int64_t)(rng_next() % (uint64_t)(i + 1));
            const int32_t tmp = row[i];
            row[i] = row[j], row[j] = tmp;
        }
        reference(c, o, row, w, y_ref);
        prob_t p = {NULL, NULL, NULL, NULL, c->T, c->H, c->K, c->K / c->G};
        void *d_o, *d_row, *d_w, *d_y;
        uint32_t *sink;
        CK(cudaMalloc(&d_o, obytes));
        CK(cudaMalloc(&d_row, nrows * 4));
        CK(cudaMalloc(&d_w, nrows * 4));
        CK(cudaMalloc(&d_y, ybytes));
        CK(cudaMalloc(&sink, 4));
        CK(cudaMemcpy(d_o, o, obytes, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_row, row, nrows * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_w, w, nrows * 4, cudaMemcpyHostToDevice));
        p.o = (const uint16_t *)d_o, p.row = (const int32_t *)d_row, p.w = (const float *)d_w, p.y = (uint16_t *)d_y;
        for (int v = 0; v <= 4; v++) {
            if (only_v && v != only_v && v != 0) continue;
            const float t = run_version(v, c, p, y_ref, y_host, sink, sms);
            if (t < 0) { failed = 1; continue; }
            if (t == 0) continue;
            const double bytes = (double)(v ? obytes + ybytes : obytes);
            if (obytes < 256ll << 20) /* L2-resident: a check, not an HBM rate */
                printf("%-14s %-24s %9s %9s\n", c->name, NAMES[v], "checked", "(in L2)");
            else
                printf("%-14s %-24s %9.4f %9.1f\n", c->name, NAMES[v], t, bytes / (t * 1e6));
        }
        CK(cudaFree(d_o)); CK(cudaFree(d_row)); CK(cudaFree(d_w)); CK(cudaFree(d_y)); CK(cudaFree(sink));
        free(o), free(y_ref), free(y_host), free(row), free(w);
    }
    if (!ran) {
        fprintf(stderr, "no config named %s\n", only_c);
        return 2;
    }
    printf(failed ? "SOME VERSION WRONG\n" : "all versions bitwise equal to the reference\n");
    return failed;
}
