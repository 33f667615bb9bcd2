// gemm.cu: comet's scratch bf16 GEMM for Hopper (sm_90a), llm.c-style numbered versions.
//   C[M,N] (bf16, row-major) = A[M,K] (bf16, K-contiguous) * B[N,K]^T (bf16, nn.Linear weight layout), fp32 accumulate.
// Versions:
//   1: mma.sync m16n8k16 tiled kernel (128x128x32 tile, 8 warps, register-prefetch double buffer). Baseline.
//   2: TMA (128B swizzle) + mbarrier 4-stage ring, 1 producer warpgroup + 2 consumer warpgroups (setmaxnreg),
//      wgmma m64n256k16, 128x256x64 tile, one CTA per tile, epilogue straight from registers.
//   3: v2 made persistent (grid = #SMs), grouped tile order, ring continues across tiles so the producer
//      prefetches the next tile during the epilogue, consumers keep one wgmma batch in flight (wait_group 1).
//   4: v3 + 2-CTA clusters along M, B tile multicast (each CTA loads one 128-row half of B for both).
//   5: v3 grouped along M for MoE (./gemm 5 runs the MoE cases for v5 and v8) (stacked A with per-expert row blocks padded to 128, stacked weights [E,N,K]).
//   6: v4 + stream-K for the last partial wave (fp32 workspace fixup, deterministic order).
//   7: v4 + epilogue via stmatrix into swizzled smem + TMA store (overlaps the store with the next tile).
//   8: MoE grouped (v5 layout) with 2-CTA clusters (B multicast when a pair shares the expert) + TMA-store epilogue.
//   9: v3 with ping-pong consumers: each consumer warpgroup owns whole 128x128 tiles, alternating, so one runs wgmma
//      while the other runs its epilogue (v7's TMA store); 6-stage ring of 32 KiB stages.
//  10: v3 with three consumer warpgroups of m64n128: 192x128 tiles (a 64-row-granular MoE tile's full shape).
//  11: the same with four: 256x128 tiles, 640 threads.
//  12: v11 grouped for MoE at 64-row granularity (./gemm 5 runs it beside v5 and v8): a unit is up to 256 rows of
//      one expert, a consumer per 64-row group, absent groups neither loaded nor computed.
//  13: v12 with v8's machinery: 2-CTA clusters (B multicast when both units of a pair are one expert's) and the
//      stmatrix + TMA-store epilogue for full groups, box by box through an 8 KiB buffer a consumer (4 stages).
// Usage: ./gemm [version|0=all dense] [M N K]   (no shape: the built-in shape list); ./gemm 5 (or 8): MoE cases.
// Needs N%8==0, K%8==0. Best dense: v7 (v9 not yet measured); best MoE: v8.
// Every version is checked against cuBLAS (elementwise, bf16 tolerance) and against a CPU double
// reference on random sampled entries, with fresh random non-zero inputs and a NaN-poisoned output.
#include <cuda_runtime.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); exit(1); } } while (0)
#define CKB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "cuBLAS error %d at %s:%d: %s\n", (int)s_, __FILE__, __LINE__, #x); exit(1); } } while (0)
#define CKD(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { fprintf(stderr, "CUDA driver error %d at %s:%d: %s\n", (int)r_, __FILE__, __LINE__, #x); exit(1); } } while (0)

typedef __nv_bfloat16 bf16;

#include "../../src/cuda/tma.h"
#include "wgmma_gen.h"

// ---------------------------------------------------------------------------------------------
// small device helpers
// ---------------------------------------------------------------------------------------------
// smem addresses, mbarrier init / arrive / expect_tx / parity wait and the 2D TMA load: the library's own
// (src/cuda/tma.h: gm_smem, gm_mbar_*, gm_tma_load)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
#define WGMMA_WAIT(n) asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(n) : "memory")
// keep the compiler from moving accumulator reads/writes across wgmma waits
__device__ __forceinline__ void reg_fence(float* d, int n) {
    #pragma unroll
    for (int i = 0; i < n; i++) asm volatile("" : "+f"(d[i]) :: "memory");
}

// shared-memory matrix descriptor for a K-major tile with 128B swizzle: rows of 128 bytes, 8-row atoms
// of 1024 bytes (SBO = 1024). LBO is unused for swizzled K-major (set to 1). Tile bases are 1024-aligned;
// stepping k by 16 elements inside the atom = +32 bytes on the start address.
__device__ __forceinline__ uint64_t make_desc_sw128(const void* p) {
    uint64_t a = gm_smem(p);
    uint64_t d = 0;
    d |= (a & 0x3FFFF) >> 4;
    d |= (uint64_t)1 << 16;
    d |= (uint64_t)(1024 >> 4) << 32;
    d |= (uint64_t)1 << 62;  // 128B swizzle
    return d;
}

// grouped tile order: walks GROUP_M tile-rows together so concurrently running CTAs share A and B in L2
__device__ __forceinline__ void tile_coords(int t, int tiles_m, int tiles_n, int group_m, int* tm, int* tn) {
    int per_group = group_m * tiles_n;
    int g = t / per_group;
    int first_m = g * group_m;
    int gs = tiles_m - first_m; if (gs > group_m) gs = group_m;
    int r = t - g * per_group;
    *tm = first_m + r % gs;
    *tn = r / gs;
}

// ---------------------------------------------------------------------------------------------
// v1: mma.sync m16n8k16 baseline
// ---------------------------------------------------------------------------------------------
#define V1_BM 128
#define V1_BN 128
#define V1_BK 32
#define V1_LD 40  // padded row (bf16 elements): 80 bytes, conflict-free 32-bit fragment loads

__device__ __forceinline__ void mma_bf16_16816(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__global__ __launch_bounds__(256) void gemm_v1(const bf16* __restrict__ A, const bf16* __restrict__ B, bf16* __restrict__ C,
                                               int M, int N, int K) {
    __shared__ __align__(16) bf16 sA[2][V1_BM * V1_LD];
    __shared__ __align__(16) bf16 sB[2][V1_BN * V1_LD];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int wm = warp >> 2, wn = warp & 3;  // warp tile 64 x 32
    int bm = blockIdx.y * V1_BM, bn = blockIdx.x * V1_BN;
    float acc[4][4][4];
    for (int i = 0; i < 4; i++) for (int j = 0; j < 4; j++) for (int r = 0; r < 4; r++) acc[i][j][r] = 0.f;

    uint4 ra[2], rb[2];
    int nk = (K + V1_BK - 1) / V1_BK;
    // load k-tile kt into registers (16-byte chunks, zero outside the matrix)
#define V1_LOAD(kt) do { \
        for (int i = 0; i < 2; i++) { \
            int c = tid + i * 256, row = c >> 2, kc = (c & 3) * 8, kg = (kt) * V1_BK + kc; \
            uint4 z = make_uint4(0, 0, 0, 0); \
            ra[i] = (bm + row < M && kg < K) ? *(const uint4*)(A + (size_t)(bm + row) * K + kg) : z; \
            rb[i] = (bn + row < N && kg < K) ? *(const uint4*)(B + (size_t)(bn + row) * K + kg) : z; \
        } } while (0)
#define V1_STORE(buf) do { \
        for (int i = 0; i < 2; i++) { \
            int c = tid + i * 256, row = c >> 2, kc = (c & 3) * 8; \
            *(uint4*)&sA[buf][row * V1_LD + kc] = ra[i]; \
            *(uint4*)&sB[buf][row * V1_LD + kc] = rb[i]; \
        } } while (0)

    V1_LOAD(0);
    V1_STORE(0);
    __syncthreads();
    for (int kt = 0; kt < nk; kt++) {
        int buf = kt & 1;
        if (kt + 1 < nk) V1_LOAD(kt + 1);
        #pragma unroll
        for (int kk = 0; kk < V1_BK; kk += 16) {
            uint32_t af[4][4], bfr[4][2];
            #pragma unroll
            for (int mi = 0; mi < 4; mi++) {
                const bf16* p = &sA[buf][(wm * 64 + mi * 16 + (lane >> 2)) * V1_LD + kk + (lane & 3) * 2];
                af[mi][0] = *(const uint32_t*)(p);
                af[mi][1] = *(const uint32_t*)(p + 8 * V1_LD);
                af[mi][2] = *(const uint32_t*)(p + 8);
                af[mi][3] = *(const uint32_t*)(p + 8 * V1_LD + 8);
            }
            #pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                const bf16* p = &sB[buf][(wn * 32 + ni * 8 + (lane >> 2)) * V1_LD + kk + (lane & 3) * 2];
                bfr[ni][0] = *(const uint32_t*)(p);
                bfr[ni][1] = *(const uint32_t*)(p + 8);
            }
            #pragma unroll
            for (int mi = 0; mi < 4; mi++)
                #pragma unroll
                for (int ni = 0; ni < 4; ni++) mma_bf16_16816(acc[mi][ni], af[mi], bfr[ni]);
        }
        if (kt + 1 < nk) V1_STORE(buf ^ 1);
        __syncthreads();
    }
#undef V1_LOAD
#undef V1_STORE
    #pragma unroll
    for (int mi = 0; mi < 4; mi++)
        #pragma unroll
        for (int ni = 0; ni < 4; ni++) {
            int row = bm + wm * 64 + mi * 16 + (lane >> 2);
            int col = bn + wn * 32 + ni * 8 + (lane & 3) * 2;
            if (col < N) {
                if (row < M) *(__nv_bfloat162*)&C[(size_t)row * N + col] = __floats2bfloat162_rn(acc[mi][ni][0], acc[mi][ni][1]);
                if (row + 8 < M) *(__nv_bfloat162*)&C[(size_t)(row + 8) * N + col] = __floats2bfloat162_rn(acc[mi][ni][2], acc[mi][ni][3]);
            }
        }
}

// ---------------------------------------------------------------------------------------------
// v2 / v3: TMA + wgmma, warp-specialised
// ---------------------------------------------------------------------------------------------
#define H_BM 128
#define H_BN 256
#define H_BK 64
#define H_STAGES 4
#define H_A_BYTES (H_BM * H_BK * 2)          // 16 KiB
#define H_B_BYTES (H_BN * H_BK * 2)          // 32 KiB
#define H_STAGE_BYTES (H_A_BYTES + H_B_BYTES)
#define H_SMEM_BYTES (H_STAGES * H_STAGE_BYTES + 1024 + 2 * H_STAGES * 8)
#define GROUP_M 16

// consumer warpgroup's 64x256 accumulator -> bf16 global, masked
__device__ __forceinline__ void store_acc_64x256(const float* d, bf16* C, int M, int N, int row0, int col0, int lane, int warp_in_wg) {
    int r = row0 + warp_in_wg * 16 + (lane >> 2);
    int cb = col0 + (lane & 3) * 2;
    #pragma unroll
    for (int j = 0; j < 32; j++) {
        int col = cb + j * 8;
        if (col < N) {
            if (r < M) *(__nv_bfloat162*)&C[(size_t)r * N + col] = __floats2bfloat162_rn(d[4 * j + 0], d[4 * j + 1]);
            if (r + 8 < M) *(__nv_bfloat162*)&C[(size_t)(r + 8) * N + col] = __floats2bfloat162_rn(d[4 * j + 2], d[4 * j + 3]);
        }
    }
}

__global__ __launch_bounds__(384, 1) void gemm_v2(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                                                  bf16* __restrict__ C, int M, int N, int K) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint64_t* full = (uint64_t*)(base + H_STAGES * H_STAGE_BYTES);
    uint64_t* empty = full + H_STAGES;
    int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    int tiles_m = (M + H_BM - 1) / H_BM, tiles_n = (N + H_BN - 1) / H_BN;
    int tm, tn;
    tile_coords(blockIdx.x, tiles_m, tiles_n, GROUP_M, &tm, &tn);
    int nk = (K + H_BK - 1) / H_BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < H_STAGES; s++) { gm_mbar_init(&full[s], 1); gm_mbar_init(&empty[s], 8); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 0) {
            for (int k = 0; k < nk; k++) {
                int s = k % H_STAGES, ph = (k / H_STAGES) & 1;
                gm_mbar_wait(&empty[s], ph ^ 1);
                unsigned char* st = base + s * H_STAGE_BYTES;
                gm_mbar_expect_tx(&full[s], H_STAGE_BYTES);
                gm_tma_load(st, &tmA, k * H_BK, tm * H_BM, &full[s]);
                gm_tma_load(st + H_A_BYTES, &tmB, k * H_BK, tn * H_BN, &full[s]);
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        int c = wg - 1, lane = tid & 31, w = tid >> 5;
        float d[128];
        #pragma unroll
        for (int i = 0; i < 128; i++) d[i] = 0.f;
        for (int k = 0; k < nk; k++) {
            int s = k % H_STAGES, ph = (k / H_STAGES) & 1;
            gm_mbar_wait(&full[s], ph);
            unsigned char* sa = base + s * H_STAGE_BYTES + c * 64 * 128;
            unsigned char* sb = base + s * H_STAGE_BYTES + H_A_BYTES;
            wgmma_fence();
            #pragma unroll
            for (int kk = 0; kk < 4; kk++)
                wgmma_m64n256k16(d, make_desc_sw128(sa + kk * 32), make_desc_sw128(sb + kk * 32), 1);
            wgmma_commit();
            WGMMA_WAIT(0);
            reg_fence(d, 128);
            if (lane == 0) gm_mbar_arrive(&empty[s]);
        }
        store_acc_64x256(d, C, M, N, tm * H_BM + c * 64, tn * H_BN, lane, w);
    }
}

// The producer of v3 and v9 (one thread): the CTA's tiles t = blockIdx.x, + gridDim.x, ... in grouped order,
// each k-slice's A (H_BM rows) and B (bn rows) through a ring of `stages` stages of stage_bytes, A first.
__device__ __forceinline__ void produce_ab(const CUtensorMap* tmA, const CUtensorMap* tmB, unsigned char* base, uint64_t* full,
                                           uint64_t* empty, int ntiles, int tiles_m, int tiles_n, int nk, int stages, int stage_bytes,
                                           int bn) {
    int it = 0;
    for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
        int tm, tn;
        tile_coords(t, tiles_m, tiles_n, GROUP_M, &tm, &tn);
        for (int k = 0; k < nk; k++, it++) {
            int s = it % stages, ph = (it / stages) & 1;
            gm_mbar_wait(&empty[s], ph ^ 1);
            unsigned char* st = base + s * stage_bytes;
            gm_mbar_expect_tx(&full[s], stage_bytes);
            gm_tma_load(st, tmA, k * H_BK, tm * H_BM, &full[s]);
            gm_tma_load(st + H_A_BYTES, tmB, k * H_BK, tn * bn, &full[s]);
        }
    }
}

__global__ __launch_bounds__(384, 1) void gemm_v3(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                                                  bf16* __restrict__ C, int M, int N, int K) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint64_t* full = (uint64_t*)(base + H_STAGES * H_STAGE_BYTES);
    uint64_t* empty = full + H_STAGES;
    int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    int tiles_m = (M + H_BM - 1) / H_BM, tiles_n = (N + H_BN - 1) / H_BN;
    int ntiles = tiles_m * tiles_n;
    int nk = (K + H_BK - 1) / H_BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < H_STAGES; s++) { gm_mbar_init(&full[s], 1); gm_mbar_init(&empty[s], 8); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 0) produce_ab(&tmA, &tmB, base, full, empty, ntiles, tiles_m, tiles_n, nk, H_STAGES, H_STAGE_BYTES, H_BN);
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        int c = wg - 1, lane = tid & 31, w = tid >> 5;
        float d[128];
        #pragma unroll
        for (int i = 0; i < 128; i++) d[i] = 0.f;
        int it = 0;
        for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
            int tm, tn;
            tile_coords(t, tiles_m, tiles_n, GROUP_M, &tm, &tn);
            for (int k = 0; k < nk; k++, it++) {
                int s = it % H_STAGES, ph = (it / H_STAGES) & 1;
                gm_mbar_wait(&full[s], ph);
                unsigned char* sa = base + s * H_STAGE_BYTES + c * 64 * 128;
                unsigned char* sb = base + s * H_STAGE_BYTES + H_A_BYTES;
                wgmma_fence();
                #pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    wgmma_m64n256k16(d, make_desc_sw128(sa + kk * 32), make_desc_sw128(sb + kk * 32), (k > 0 || kk > 0) ? 1 : 0);
                wgmma_commit();
                WGMMA_WAIT(1);
                reg_fence(d, 128);
                if (k > 0 && lane == 0) gm_mbar_arrive(&empty[(it - 1) % H_STAGES]);
            }
            WGMMA_WAIT(0);
            reg_fence(d, 128);
            if (lane == 0) gm_mbar_arrive(&empty[(it - 1) % H_STAGES]);
            store_acc_64x256(d, C, M, N, tm * H_BM + c * 64, tn * H_BN, lane, w);
        }
    }
}


// ---------------------------------------------------------------------------------------------
// v4: v3 + 2-CTA clusters along M. The two CTAs of a cluster compute tiles (2*tm2, tn) and (2*tm2+1, tn), which
// share the same 256-row B tile: each CTA loads its own A tile and one 128-row half of B, multicast to both CTAs.
// A stage is free only when the consumers of BOTH CTAs released it (empty count 16, remote arrive via mapa).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t cluster_ctarank() { uint32_t r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r; }
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
// arrive on the mbarrier at the same smem offset in CTA `cta` of this cluster
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
    asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\nmbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n"
                 :: "r"(gm_smem(bar)), "r"(cta) : "memory");
}
__device__ __forceinline__ void tma_load_2d_mc(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar, uint16_t mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;"
                 :: "r"(gm_smem(dst)), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(gm_smem(bar)), "h"(mask) : "memory");
}

__global__ __launch_bounds__(384, 1) void gemm_v4(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmBh,
                                                  bf16* __restrict__ C, int M, int N, int K) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint64_t* full = (uint64_t*)(base + H_STAGES * H_STAGE_BYTES);
    uint64_t* empty = full + H_STAGES;
    int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    uint32_t rank = cluster_ctarank();
    int tiles_m = (M + H_BM - 1) / H_BM, tiles_n = (N + H_BN - 1) / H_BN;
    int tiles_m2 = (tiles_m + 1) / 2;
    int nsuper = tiles_m2 * tiles_n;
    int cid = blockIdx.x >> 1, ncl = gridDim.x >> 1;
    int nk = (K + H_BK - 1) / H_BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < H_STAGES; s++) { gm_mbar_init(&full[s], 1); gm_mbar_init(&empty[s], 16); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    cluster_sync_all();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 0) {
            int it = 0;
            for (int t = cid; t < nsuper; t += ncl) {
                int tm2, tn;
                tile_coords(t, tiles_m2, tiles_n, GROUP_M / 2, &tm2, &tn);
                int tm = tm2 * 2 + rank;
                int has_a = tm < tiles_m;  // odd tiles_m: the last pair's second tile is empty (B still needed by peer)
                for (int k = 0; k < nk; k++, it++) {
                    int s = it % H_STAGES, ph = (it / H_STAGES) & 1;
                    gm_mbar_wait(&empty[s], ph ^ 1);
                    unsigned char* st = base + s * H_STAGE_BYTES;
                    gm_mbar_expect_tx(&full[s], has_a ? H_STAGE_BYTES : H_B_BYTES);
                    if (has_a) gm_tma_load(st, &tmA, k * H_BK, tm * H_BM, &full[s]);
                    tma_load_2d_mc(st + H_A_BYTES + rank * (H_B_BYTES / 2), &tmBh, k * H_BK, tn * H_BN + rank * (H_BN / 2), &full[s], 0x3);
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        int c = wg - 1, lane = tid & 31, w = tid >> 5;
        float d[128];
        #pragma unroll
        for (int i = 0; i < 128; i++) d[i] = 0.f;
        int it = 0;
        for (int t = cid; t < nsuper; t += ncl) {
            int tm2, tn;
            tile_coords(t, tiles_m2, tiles_n, GROUP_M / 2, &tm2, &tn);
            int tm = tm2 * 2 + rank;
            for (int k = 0; k < nk; k++, it++) {
                int s = it % H_STAGES, ph = (it / H_STAGES) & 1;
                gm_mbar_wait(&full[s], ph);
                unsigned char* sa = base + s * H_STAGE_BYTES + c * 64 * 128;
                unsigned char* sb = base + s * H_STAGE_BYTES + H_A_BYTES;
                wgmma_fence();
                #pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    wgmma_m64n256k16(d, make_desc_sw128(sa + kk * 32), make_desc_sw128(sb + kk * 32), (k > 0 || kk > 0) ? 1 : 0);
                wgmma_commit();
                WGMMA_WAIT(1);
                reg_fence(d, 128);
                if (k > 0 && lane == 0) { int sp = (it - 1) % H_STAGES; gm_mbar_arrive(&empty[sp]); mbar_arrive_cluster(&empty[sp], rank ^ 1); }
            }
            WGMMA_WAIT(0);
            reg_fence(d, 128);
            if (lane == 0) { int sp = (it - 1) % H_STAGES; gm_mbar_arrive(&empty[sp]); mbar_arrive_cluster(&empty[sp], rank ^ 1); }
            if (tm < tiles_m) store_acc_64x256(d, C, M, N, tm * H_BM + c * 64, tn * H_BN, lane, w);
        }
    }
    // no CTA may exit while its peer can still multicast into its smem or arrive on its barriers
    __syncwarp();
    cluster_sync_all();
}


// ---------------------------------------------------------------------------------------------
// v5: grouped along M for MoE ("contiguous" layout). A is one stacked [Mtot, K] buffer in which expert e owns
// the row block [off_e, off_e + pad128(m_e)); B is the stacked weights [E, N, K], one tensor map over [E*N, K]
// rows; C is [Mtot, N] in A's row layout. Per 128-row M tile: tile_expert[tm] (which weight) and tile_rows[tm]
// (valid rows, the rest is padding and never written). Zero-row experts own no tiles. A 256-row B box may run
// into the next expert's rows when N % 256 != 0: those only feed output columns >= N, which are masked.
// Otherwise v3 (persistent, grouped order, 4-stage TMA ring, 2 consumer warpgroups).
// ---------------------------------------------------------------------------------------------
__global__ __launch_bounds__(384, 1) void gemm_v5_grouped(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                                                          bf16* __restrict__ C, int Mtot, int N, int K,
                                                          const int* __restrict__ tile_expert, const int* __restrict__ tile_rows) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint64_t* full = (uint64_t*)(base + H_STAGES * H_STAGE_BYTES);
    uint64_t* empty = full + H_STAGES;
    int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    int tiles_m = Mtot / H_BM, tiles_n = (N + H_BN - 1) / H_BN;
    int ntiles = tiles_m * tiles_n;
    int nk = (K + H_BK - 1) / H_BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < H_STAGES; s++) { gm_mbar_init(&full[s], 1); gm_mbar_init(&empty[s], 8); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 0) {
            int it = 0;
            for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
                int tm, tn;
                tile_coords(t, tiles_m, tiles_n, GROUP_M, &tm, &tn);
                int brow = tile_expert[tm] * N + tn * H_BN;
                for (int k = 0; k < nk; k++, it++) {
                    int s = it % H_STAGES, ph = (it / H_STAGES) & 1;
                    gm_mbar_wait(&empty[s], ph ^ 1);
                    unsigned char* st = base + s * H_STAGE_BYTES;
                    gm_mbar_expect_tx(&full[s], H_STAGE_BYTES);
                    gm_tma_load(st, &tmA, k * H_BK, tm * H_BM, &full[s]);
                    gm_tma_load(st + H_A_BYTES, &tmB, k * H_BK, brow, &full[s]);
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        int c = wg - 1, lane = tid & 31, w = tid >> 5;
        float d[128];
        #pragma unroll
        for (int i = 0; i < 128; i++) d[i] = 0.f;
        int it = 0;
        for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
            int tm, tn;
            tile_coords(t, tiles_m, tiles_n, GROUP_M, &tm, &tn);
            for (int k = 0; k < nk; k++, it++) {
                int s = it % H_STAGES, ph = (it / H_STAGES) & 1;
                gm_mbar_wait(&full[s], ph);
                unsigned char* sa = base + s * H_STAGE_BYTES + c * 64 * 128;
                unsigned char* sb = base + s * H_STAGE_BYTES + H_A_BYTES;
                wgmma_fence();
                #pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    wgmma_m64n256k16(d, make_desc_sw128(sa + kk * 32), make_desc_sw128(sb + kk * 32), (k > 0 || kk > 0) ? 1 : 0);
                wgmma_commit();
                WGMMA_WAIT(1);
                reg_fence(d, 128);
                if (k > 0 && lane == 0) gm_mbar_arrive(&empty[(it - 1) % H_STAGES]);
            }
            WGMMA_WAIT(0);
            reg_fence(d, 128);
            if (lane == 0) gm_mbar_arrive(&empty[(it - 1) % H_STAGES]);
            int row_end = tm * H_BM + tile_rows[tm];
            store_acc_64x256(d, C, row_end, N, tm * H_BM + c * 64, tn * H_BN, lane, w);
        }
    }
}


// ---------------------------------------------------------------------------------------------
// v6: v4 + stream-K tail. With U cluster tiles (256x256) over P clusters, the first U - U%P tiles run
// data-parallel as in v4; the k-blocks of the last U%P tiles are flattened and cut into P equal ranges of L
// k-blocks, one per cluster, so the last partial wave becomes ~ (U%P)/P of a tile instead of a whole one.
// A tile cut between ranges is fixed up through an fp32 workspace: every contributor writes its partial
// accumulators (thread-major, coalesced), fences, takes a ticket; the last one sums all partials in slot order
// (deterministic) and stores bf16 C, then resets the ticket (counters self-clean for the next launch).
// Host enables the tail split only when L >= nk/4 (at most ~5 contributors per tile).
// ---------------------------------------------------------------------------------------------
struct SkWork { int tile, kb, ke, sk_u; };  // sk_u: tail tile index (>=0) when part of the stream-K region, else -1
struct SkIter { int idx, pos, end; };

// next work piece of cluster cid; returns 0 when done
__device__ __forceinline__ int sk_next(SkIter* s, SkWork* w, int cid, int ncl, int dp_tiles, int nk) {
    int t = cid + s->idx * ncl;
    if (t < dp_tiles) { s->idx++; w->tile = t; w->kb = 0; w->ke = nk; w->sk_u = -1; return 1; }
    if (s->pos >= s->end) return 0;
    int u = s->pos / nk, kb = s->pos - u * nk;
    int ke = kb + (s->end - s->pos); if (ke > nk) ke = nk;
    w->tile = dp_tiles + u; w->kb = kb; w->ke = ke; w->sk_u = u;
    s->pos += ke - kb;
    return 1;
}

__global__ __launch_bounds__(384, 1) void gemm_v6(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmBh,
                                                  bf16* __restrict__ C, int M, int N, int K,
                                                  int dp_tiles, int sk_len, int sk_total, int sk_maxc,
                                                  float* __restrict__ ws, int* __restrict__ tickets) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ int s_last;
    unsigned char* base = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint64_t* full = (uint64_t*)(base + H_STAGES * H_STAGE_BYTES);
    uint64_t* empty = full + H_STAGES;
    int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    uint32_t rank = cluster_ctarank();
    int tiles_m = (M + H_BM - 1) / H_BM, tiles_n = (N + H_BN - 1) / H_BN;
    int tiles_m2 = (tiles_m + 1) / 2;
    int cid = blockIdx.x >> 1, ncl = gridDim.x >> 1;
    int nk = (K + H_BK - 1) / H_BK;
    SkIter si;
    si.idx = 0;
    si.pos = cid * sk_len; if (si.pos > sk_total) si.pos = sk_total;
    si.end = si.pos + sk_len; if (si.end > sk_total) si.end = sk_total;
    SkWork w;

    if (threadIdx.x == 0) {
        for (int s = 0; s < H_STAGES; s++) { gm_mbar_init(&full[s], 1); gm_mbar_init(&empty[s], 16); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    cluster_sync_all();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 0) {
            int it = 0;
            while (sk_next(&si, &w, cid, ncl, dp_tiles, nk)) {
                int tm2, tn;
                tile_coords(w.tile, tiles_m2, tiles_n, GROUP_M / 2, &tm2, &tn);
                int tm = tm2 * 2 + rank;
                int has_a = tm < tiles_m;
                for (int k = w.kb; k < w.ke; k++, it++) {
                    int s = it % H_STAGES, ph = (it / H_STAGES) & 1;
                    gm_mbar_wait(&empty[s], ph ^ 1);
                    unsigned char* st = base + s * H_STAGE_BYTES;
                    gm_mbar_expect_tx(&full[s], has_a ? H_STAGE_BYTES : H_B_BYTES);
                    if (has_a) gm_tma_load(st, &tmA, k * H_BK, tm * H_BM, &full[s]);
                    tma_load_2d_mc(st + H_A_BYTES + rank * (H_B_BYTES / 2), &tmBh, k * H_BK, tn * H_BN + rank * (H_BN / 2), &full[s], 0x3);
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        int c = wg - 1, lane = tid & 31, wi = tid >> 5;
        int ct = c * 128 + tid;  // consumer thread 0..255
        float d[128];
        #pragma unroll
        for (int i = 0; i < 128; i++) d[i] = 0.f;
        int it = 0;
        while (sk_next(&si, &w, cid, ncl, dp_tiles, nk)) {
            int tm2, tn;
            tile_coords(w.tile, tiles_m2, tiles_n, GROUP_M / 2, &tm2, &tn);
            int tm = tm2 * 2 + rank;
            for (int k = w.kb; k < w.ke; k++, it++) {
                int s = it % H_STAGES, ph = (it / H_STAGES) & 1;
                gm_mbar_wait(&full[s], ph);
                unsigned char* sa = base + s * H_STAGE_BYTES + c * 64 * 128;
                unsigned char* sb = base + s * H_STAGE_BYTES + H_A_BYTES;
                wgmma_fence();
                #pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    wgmma_m64n256k16(d, make_desc_sw128(sa + kk * 32), make_desc_sw128(sb + kk * 32), (k > w.kb || kk > 0) ? 1 : 0);
                wgmma_commit();
                WGMMA_WAIT(1);
                reg_fence(d, 128);
                if (k > w.kb && lane == 0) { int sp = (it - 1) % H_STAGES; gm_mbar_arrive(&empty[sp]); mbar_arrive_cluster(&empty[sp], rank ^ 1); }
            }
            WGMMA_WAIT(0);
            reg_fence(d, 128);
            if (lane == 0) { int sp = (it - 1) % H_STAGES; gm_mbar_arrive(&empty[sp]); mbar_arrive_cluster(&empty[sp], rank ^ 1); }
            if (tm >= tiles_m) continue;  // empty second tile of an odd pair
            if (w.sk_u < 0 || (w.kb == 0 && w.ke == nk)) {
                store_acc_64x256(d, C, M, N, tm * H_BM + c * 64, tn * H_BN, lane, wi);
                continue;
            }
            // stream-K fixup
            int u = w.sk_u;
            int r0 = (u * nk) / sk_len;                       // first range touching tail tile u
            int r1 = ((u + 1) * nk - 1) / sk_len;             // last one
            int cnt = r1 - r0 + 1;
            int mine = cid - r0;
            float* slot0 = ws + ((size_t)(u * sk_maxc) * 2 + rank) * (H_BM * H_BN);
            // slot j of (u, rank) at slot0 + j * 2 * H_BM * H_BN
            float* my = slot0 + (size_t)mine * 2 * (H_BM * H_BN);
            #pragma unroll
            for (int i = 0; i < 128; i++) __stcg(&my[i * 256 + ct], d[i]);
            __threadfence();
            asm volatile("bar.sync 1, 256;" ::: "memory");
            if (ct == 0) {
                int old = atomicAdd(&tickets[u * 2 + rank], 1);
                s_last = (old == cnt - 1);
                if (old == cnt - 1) tickets[u * 2 + rank] = 0;
            }
            asm volatile("bar.sync 1, 256;" ::: "memory");
            if (s_last) {
                __threadfence();
                // j outer (fixed order: deterministic sum), i inner unrolled: 128 independent loads in flight
                #pragma unroll
                for (int i = 0; i < 128; i++) d[i] = 0.f;
                for (int j = 0; j < cnt; j++) {
                    const float* sj = slot0 + (size_t)j * 2 * (H_BM * H_BN) + ct;
                    #pragma unroll
                    for (int i = 0; i < 128; i++) d[i] += __ldcg(&sj[i * 256]);
                }
                store_acc_64x256(d, C, M, N, tm * H_BM + c * 64, tn * H_BN, lane, wi);
            }
        }
    }
    __syncwarp();
    cluster_sync_all();
}


// ---------------------------------------------------------------------------------------------
// v7: v4 with the epilogue through shared memory: stmatrix (bf16, 128B-swizzled 64x64 boxes) + TMA store
// (cp.async.bulk.tensor shared->global, clipped at the M/N edges by the tensor map), so the consumer
// warpgroups hand the store to the copy engine and go on with the next tile. Each consumer warpgroup owns a
// 16 KiB buffer (64 rows x 128 cols, two boxes) and stores its 64x256 result in two halves.
// smem: 4 stages x 48 KiB + 2 x 16 KiB + barriers (+1 KiB alignment slack) = 230464 bytes (limit 232448).
// ---------------------------------------------------------------------------------------------
#define H7_CBUF_BYTES (64 * 128 * 2)
#define H7_SMEM_BYTES (H_STAGES * H_STAGE_BYTES + 2 * H7_CBUF_BYTES + 1024 + 2 * H_STAGES * 8)

__device__ __forceinline__ void named_bar(int id, int n) { asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t*)&v;
}
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 :: "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(gm_smem(src)) : "memory");
}

// consumer warpgroup c's 64 x (128 nh) accumulator -> C via smem + TMA store (tid: 0..127 within the warpgroup;
// nh = 2 for v7's 64x256, 1 for each 64-row half of v9's 128x128)
__device__ __forceinline__ void epilogue_tma(const float* d, unsigned char* cbuf, const CUtensorMap* tmC, int row0, int col0, int tid, int c,
                                             int nh) {
    int lane = tid & 31, wi = tid >> 5;
    int mi = lane >> 3;
    int row = wi * 16 + (mi & 1) * 8 + (lane & 7);  // row (0..63) whose 16-byte chunk this lane addresses
    uint32_t cb = gm_smem(cbuf);
    #pragma unroll
    for (int h = 0; h < 2; h++) {
        if (h >= nh) break;
        if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // buffer no longer read by the last store
        named_bar(2 + c, 128);
        #pragma unroll
        for (int jj = 0; jj < 16; jj += 2) {
            int j = h * 16 + jj;
            int colb = jj + (mi >> 1);                 // 16-byte chunk (8 cols) within this 128-col half
            int box = colb >> 3, chunk = colb & 7;
            uint32_t addr = cb + box * 8192 + row * 128 + ((chunk ^ (row & 7)) << 4);
            stmatrix_x4(addr, pack_bf16(d[4 * j + 0], d[4 * j + 1]), pack_bf16(d[4 * j + 2], d[4 * j + 3]),
                        pack_bf16(d[4 * j + 4], d[4 * j + 5]), pack_bf16(d[4 * j + 6], d[4 * j + 7]));
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        named_bar(2 + c, 128);
        if (tid == 0) {
            tma_store_2d(tmC, cbuf, col0 + h * 128, row0);
            tma_store_2d(tmC, cbuf + 8192, col0 + h * 128 + 64, row0);
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
    }
}

__global__ __launch_bounds__(384, 1) void gemm_v7(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmBh,
                                                  const __grid_constant__ CUtensorMap tmC, int M, int N, int K) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    unsigned char* cbufs = base + H_STAGES * H_STAGE_BYTES;
    uint64_t* full = (uint64_t*)(cbufs + 2 * H7_CBUF_BYTES);
    uint64_t* empty = full + H_STAGES;
    int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    uint32_t rank = cluster_ctarank();
    int tiles_m = (M + H_BM - 1) / H_BM, tiles_n = (N + H_BN - 1) / H_BN;
    int tiles_m2 = (tiles_m + 1) / 2;
    int nsuper = tiles_m2 * tiles_n;
    int cid = blockIdx.x >> 1, ncl = gridDim.x >> 1;
    int nk = (K + H_BK - 1) / H_BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < H_STAGES; s++) { gm_mbar_init(&full[s], 1); gm_mbar_init(&empty[s], 16); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    cluster_sync_all();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 0) {
            int it = 0;
            for (int t = cid; t < nsuper; t += ncl) {
                int tm2, tn;
                tile_coords(t, tiles_m2, tiles_n, GROUP_M / 2, &tm2, &tn);
                int tm = tm2 * 2 + rank;
                int has_a = tm < tiles_m;
                for (int k = 0; k < nk; k++, it++) {
                    int s = it % H_STAGES, ph = (it / H_STAGES) & 1;
                    gm_mbar_wait(&empty[s], ph ^ 1);
                    unsigned char* st = base + s * H_STAGE_BYTES;
                    gm_mbar_expect_tx(&full[s], has_a ? H_STAGE_BYTES : H_B_BYTES);
                    if (has_a) gm_tma_load(st, &tmA, k * H_BK, tm * H_BM, &full[s]);
                    tma_load_2d_mc(st + H_A_BYTES + rank * (H_B_BYTES / 2), &tmBh, k * H_BK, tn * H_BN + rank * (H_BN / 2), &full[s], 0x3);
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        int c = wg - 1, lane = tid & 31;
        float d[128];
        #pragma unroll
        for (int i = 0; i < 128; i++) d[i] = 0.f;
        int it = 0;
        for (int t = cid; t < nsuper; t += ncl) {
            int tm2, tn;
            tile_coords(t, tiles_m2, tiles_n, GROUP_M / 2, &tm2, &tn);
            int tm = tm2 * 2 + rank;
            for (int k = 0; k < nk; k++, it++) {
                int s = it % H_STAGES, ph = (it / H_STAGES) & 1;
                gm_mbar_wait(&full[s], ph);
                unsigned char* sa = base + s * H_STAGE_BYTES + c * 64 * 128;
                unsigned char* sb = base + s * H_STAGE_BYTES + H_A_BYTES;
                wgmma_fence();
                #pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    wgmma_m64n256k16(d, make_desc_sw128(sa + kk * 32), make_desc_sw128(sb + kk * 32), (k > 0 || kk > 0) ? 1 : 0);
                wgmma_commit();
                WGMMA_WAIT(1);
                reg_fence(d, 128);
                if (k > 0 && lane == 0) { int sp = (it - 1) % H_STAGES; gm_mbar_arrive(&empty[sp]); mbar_arrive_cluster(&empty[sp], rank ^ 1); }
            }
            WGMMA_WAIT(0);
            reg_fence(d, 128);
            if (lane == 0) { int sp = (it - 1) % H_STAGES; gm_mbar_arrive(&empty[sp]); mbar_arrive_cluster(&empty[sp], rank ^ 1); }
            if (tm < tiles_m) epilogue_tma(d, cbufs + c * H7_CBUF_BYTES, &tmC, tm * H_BM + c * 64, tn * H_BN, tid, c, 2);
        }
        if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // stores done before smem goes away
    }
    __syncwarp();
    cluster_sync_all();
}


// ---------------------------------------------------------------------------------------------
// v8: MoE grouped along M (v5's layout and tables) on v7's machinery: 2-CTA clusters over pairs of M tiles,
// TMA-store epilogue. When both tiles of a pair belong to the same expert, each CTA loads one 128-row half of
// the B tile and multicasts it (as v4); when they belong to different experts (or the second tile does not
// exist), each CTA loads its own full 256-row B tile. Either way a CTA expects 48 KiB per stage (0 for a
// non-existent tile), so the barrier protocol is v4's. Full tiles store through smem + TMA; an expert's last,
// partial tile stores straight from registers, masked to its valid rows (padding rows are never written).
// ---------------------------------------------------------------------------------------------
__global__ __launch_bounds__(384, 1) void gemm_v8_grouped(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                                                          const __grid_constant__ CUtensorMap tmBh, const __grid_constant__ CUtensorMap tmC,
                                                          bf16* __restrict__ C, int Mtot, int N, int K,
                                                          const int* __restrict__ tile_expert, const int* __restrict__ tile_rows) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    unsigned char* cbufs = base + H_STAGES * H_STAGE_BYTES;
    uint64_t* full = (uint64_t*)(cbufs + 2 * H7_CBUF_BYTES);
    uint64_t* empty = full + H_STAGES;
    int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    uint32_t rank = cluster_ctarank();
    int tiles_m = Mtot / H_BM, tiles_n = (N + H_BN - 1) / H_BN;
    int tiles_m2 = (tiles_m + 1) / 2;
    int nsuper = tiles_m2 * tiles_n;
    int cid = blockIdx.x >> 1, ncl = gridDim.x >> 1;
    int nk = (K + H_BK - 1) / H_BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < H_STAGES; s++) { gm_mbar_init(&full[s], 1); gm_mbar_init(&empty[s], 16); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    cluster_sync_all();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 0) {
            int it = 0;
            for (int t = cid; t < nsuper; t += ncl) {
                int tm2, tn;
                tile_coords(t, tiles_m2, tiles_n, GROUP_M / 2, &tm2, &tn);
                int tm = tm2 * 2 + rank, ptm = tm2 * 2 + (rank ^ 1);
                int e = tm < tiles_m ? tile_expert[tm] : -1;
                int pe = ptm < tiles_m ? tile_expert[ptm] : -2;
                int same = e == pe;
                int brow = e * N + tn * H_BN;
                for (int k = 0; k < nk; k++, it++) {
                    int s = it % H_STAGES, ph = (it / H_STAGES) & 1;
                    gm_mbar_wait(&empty[s], ph ^ 1);
                    unsigned char* st = base + s * H_STAGE_BYTES;
                    gm_mbar_expect_tx(&full[s], e >= 0 ? H_STAGE_BYTES : 0);
                    if (e >= 0) {
                        gm_tma_load(st, &tmA, k * H_BK, tm * H_BM, &full[s]);
                        if (same) tma_load_2d_mc(st + H_A_BYTES + rank * (H_B_BYTES / 2), &tmBh, k * H_BK, brow + rank * (H_BN / 2), &full[s], 0x3);
                        else gm_tma_load(st + H_A_BYTES, &tmB, k * H_BK, brow, &full[s]);
                    }
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        int c = wg - 1, lane = tid & 31, wi = tid >> 5;
        float d[128];
        #pragma unroll
        for (int i = 0; i < 128; i++) d[i] = 0.f;
        int it = 0;
        for (int t = cid; t < nsuper; t += ncl) {
            int tm2, tn;
            tile_coords(t, tiles_m2, tiles_n, GROUP_M / 2, &tm2, &tn);
            int tm = tm2 * 2 + rank;
            for (int k = 0; k < nk; k++, it++) {
                int s = it % H_STAGES, ph = (it / H_STAGES) & 1;
                gm_mbar_wait(&full[s], ph);
                unsigned char* sa = base + s * H_STAGE_BYTES + c * 64 * 128;
                unsigned char* sb = base + s * H_STAGE_BYTES + H_A_BYTES;
                wgmma_fence();
                #pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    wgmma_m64n256k16(d, make_desc_sw128(sa + kk * 32), make_desc_sw128(sb + kk * 32), (k > 0 || kk > 0) ? 1 : 0);
                wgmma_commit();
                WGMMA_WAIT(1);
                reg_fence(d, 128);
                if (k > 0 && lane == 0) { int sp = (it - 1) % H_STAGES; gm_mbar_arrive(&empty[sp]); mbar_arrive_cluster(&empty[sp], rank ^ 1); }
            }
            WGMMA_WAIT(0);
            reg_fence(d, 128);
            if (lane == 0) { int sp = (it - 1) % H_STAGES; gm_mbar_arrive(&empty[sp]); mbar_arrive_cluster(&empty[sp], rank ^ 1); }
            if (tm < tiles_m) {
                int rows = tile_rows[tm];
                if (rows == H_BM) epilogue_tma(d, cbufs + c * H7_CBUF_BYTES, &tmC, tm * H_BM + c * 64, tn * H_BN, tid, c, 2);
                else store_acc_64x256(d, C, tm * H_BM + rows, N, tm * H_BM + c * 64, tn * H_BN, lane, wi);
            }
        }
        if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
    __syncwarp();
    cluster_sync_all();
}


// ---------------------------------------------------------------------------------------------
// v9: ping-pong consumers (v3's persistent walk, no clusters). Each consumer warpgroup owns whole 128x128
// tiles (two wgmma m64n128k16 a k16 step, 128 fp32 accumulators a thread), the CTA's tiles alternating
// between them; the producer fills one 6-stage ring of 32 KiB stages (A 128x64 + B 128x64) in tile order,
// so one warpgroup runs wgmma while the other runs its epilogue (v7's stmatrix + TMA store, per 64-row
// half), and the tensor cores no longer idle during epilogues. An order barrier per consumer lets a
// consumer start tile j only once the other has passed its full waits of tile j-1: a parity wait tells
// only adjacent phases apart, so waiting on a ring position before the position a lap earlier was loaded
// would pass on the old phase (a review found this hang in the first version, before any GPU run). Costs: 128x128 tiles move 33% more bytes into shared memory per
// FLOP than 128x256 (32 KiB per 2.1 MFLOP against 48 per 4.2), and each wgmma reads 20% more shared memory.
// smem: 6 x 32 KiB + 2 x 16 KiB + barriers (+1 KiB alignment slack) = 230512 bytes (limit 232448).
// ---------------------------------------------------------------------------------------------
#define P9_BN 128
#define P9_STAGES 6
#define P9_B_BYTES (P9_BN * H_BK * 2)  // 16 KiB
#define P9_STAGE_BYTES (H_A_BYTES + P9_B_BYTES)
#define P9_SMEM_BYTES (P9_STAGES * P9_STAGE_BYTES + 2 * H7_CBUF_BYTES + 1024 + 2 * P9_STAGES * 8 + 2 * 8)

__global__ __launch_bounds__(384, 1) void gemm_v9(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                                                  const __grid_constant__ CUtensorMap tmC, int M, int N, int K) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    unsigned char* cbufs = base + P9_STAGES * P9_STAGE_BYTES;
    uint64_t* full = (uint64_t*)(cbufs + 2 * H7_CBUF_BYTES);
    uint64_t* empty = full + P9_STAGES;
    uint64_t* order = empty + P9_STAGES;  // order[c]: the other consumer is through the main loop of a tile
    int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    int tiles_m = (M + H_BM - 1) / H_BM, tiles_n = (N + P9_BN - 1) / P9_BN, ntiles = tiles_m * tiles_n;
    int nk = (K + H_BK - 1) / H_BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < P9_STAGES; s++) { gm_mbar_init(&full[s], 1); gm_mbar_init(&empty[s], 4); }  // one consumer's 4 warps
        gm_mbar_init(&order[0], 1); gm_mbar_init(&order[1], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 0) produce_ab(&tmA, &tmB, base, full, empty, ntiles, tiles_m, tiles_n, nk, P9_STAGES, P9_STAGE_BYTES, P9_BN);
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        int c = wg - 1, lane = tid & 31;
        float d[128];  // rows 0..63: d[0..63], rows 64..127: d[64..127]
        #pragma unroll
        for (int i = 0; i < 128; i++) d[i] = 0.f;
        // this CTA's tiles j = c, c + 2, ...: tile j's k-slices are ring positions j nk .. (j + 1) nk - 1
        for (int j = c, t = blockIdx.x + c * gridDim.x; t < ntiles; j += 2, t += 2 * gridDim.x) {
            int tm, tn;
            tile_coords(t, tiles_m, tiles_n, GROUP_M, &tm, &tn);
            int it = j * nk;
            if (j > 0) gm_mbar_wait(&order[c], ((j - 1) >> 1) & 1);  // tile j-1 is the other's ((j-1)>>1)-th
            for (int k = 0; k < nk; k++, it++) {
                int s = it % P9_STAGES, ph = (it / P9_STAGES) & 1;
                gm_mbar_wait(&full[s], ph);
                unsigned char* sa = base + s * P9_STAGE_BYTES;
                unsigned char* sb = sa + H_A_BYTES;
                wgmma_fence();
                #pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    wgmma_m64n128k16(d, make_desc_sw128(sa + kk * 32), make_desc_sw128(sb + kk * 32), (k > 0 || kk > 0) ? 1 : 0);
                    wgmma_m64n128k16(d + 64, make_desc_sw128(sa + 64 * 128 + kk * 32), make_desc_sw128(sb + kk * 32),
                                     (k > 0 || kk > 0) ? 1 : 0);
                }
                wgmma_commit();
                WGMMA_WAIT(1);
                reg_fence(d, 128);
                if (k > 0 && lane == 0) gm_mbar_arrive(&empty[(it - 1) % P9_STAGES]);
            }
            if (tid == 0) gm_mbar_arrive(&order[c ^ 1]);  // my full waits of this tile are done: the other may start
            WGMMA_WAIT(0);
            reg_fence(d, 128);
            if (lane == 0) gm_mbar_arrive(&empty[(it - 1) % P9_STAGES]);
            epilogue_tma(d, cbufs + c * H7_CBUF_BYTES, &tmC, tm * H_BM, tn * P9_BN, tid, c, 1);
            epilogue_tma(d + 64, cbufs + c * H7_CBUF_BYTES, &tmC, tm * H_BM + 64, tn * P9_BN, tid, c, 1);
        }
        if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // stores done before smem goes away
    }
}

// ---------------------------------------------------------------------------------------------
// v10 / v11: v3's persistent grouped walk with NC consumer warpgroups of wgmma m64n128k16 each (64 fp32
// accumulators a thread): tiles of (64 NC) x 128, one A box of 64 NC rows and one 128-row B box a k-slice
// (40 KiB at NC 3, 48 at NC 4), a 4-stage ring, register epilogue (store_acc_64x128). The question they
// answer: does a tile of 64-row groups sharing one 128-row B tile keep v3's rate? An MoE tile of that shape
// could skip absent row groups, so padding would fall to 64-row granularity (dev/NOTES.md, thirteenth
// session). Registers: NC 3 (512 threads, 128 at launch): producer 40, consumers 152; NC 4 (640, 96 at
// launch): producer 24, consumers 112.
// ---------------------------------------------------------------------------------------------
#define G_BN 128
#define G_STAGES 4
#define G_B_BYTES (G_BN * H_BK * 2)  // 16 KiB
#define G_STAGE_BYTES(nc) ((nc) * 64 * H_BK * 2 + G_B_BYTES)
#define G_SMEM_BYTES(nc) (G_STAGES * G_STAGE_BYTES(nc) + 1024 + 2 * G_STAGES * 8)

__device__ __forceinline__ void store_acc_64x128(const float* d, bf16* C, int M, int N, int row0, int col0, int lane, int warp_in_wg) {
    int r = row0 + warp_in_wg * 16 + (lane >> 2);
    int cb = col0 + (lane & 3) * 2;
    #pragma unroll
    for (int j = 0; j < 16; j++) {
        int col = cb + j * 8;
        if (col < N) {
            if (r < M) *(__nv_bfloat162*)&C[(size_t)r * N + col] = __floats2bfloat162_rn(d[4 * j + 0], d[4 * j + 1]);
            if (r + 8 < M) *(__nv_bfloat162*)&C[(size_t)(r + 8) * N + col] = __floats2bfloat162_rn(d[4 * j + 2], d[4 * j + 3]);
        }
    }
}

__device__ __forceinline__ void gemm_groups_body(const CUtensorMap& tmA, const CUtensorMap& tmB, bf16* C, int M, int N, int K,
                                                 const int nc) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    const int stage_bytes = G_STAGE_BYTES(nc), bm = 64 * nc;
    uint64_t* full = (uint64_t*)(base + G_STAGES * stage_bytes);
    uint64_t* empty = full + G_STAGES;
    int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    int tiles_m = (M + bm - 1) / bm, tiles_n = (N + G_BN - 1) / G_BN, ntiles = tiles_m * tiles_n;
    int nk = (K + H_BK - 1) / H_BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < G_STAGES; s++) { gm_mbar_init(&full[s], 1); gm_mbar_init(&empty[s], 4 * nc); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        if (nc == 4) asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
        else asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 0) {
            int it = 0;
            for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
                int tm, tn;
                tile_coords(t, tiles_m, tiles_n, GROUP_M, &tm, &tn);
                for (int k = 0; k < nk; k++, it++) {
                    int s = it % G_STAGES, ph = (it / G_STAGES) & 1;
                    gm_mbar_wait(&empty[s], ph ^ 1);
                    unsigned char* st = base + s * stage_bytes;
                    gm_mbar_expect_tx(&full[s], stage_bytes);
                    gm_tma_load(st, &tmA, k * H_BK, tm * bm, &full[s]);
                    gm_tma_load(st + nc * 64 * H_BK * 2, &tmB, k * H_BK, tn * G_BN, &full[s]);
                }
            }
        }
    } else {
        if (nc == 4) asm volatile("setmaxnreg.inc.sync.aligned.u32 112;");
        else asm volatile("setmaxnreg.inc.sync.aligned.u32 152;");
        int c = wg - 1, lane = tid & 31, w = tid >> 5;
        float d[64];
        #pragma unroll
        for (int i = 0; i < 64; i++) d[i] = 0.f;
        int it = 0;
        for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
            int tm, tn;
            tile_coords(t, tiles_m, tiles_n, GROUP_M, &tm, &tn);
            for (int k = 0; k < nk; k++, it++) {
                int s = it % G_STAGES, ph = (it / G_STAGES) & 1;
                gm_mbar_wait(&full[s], ph);
                unsigned char* sa = base + s * stage_bytes + c * 64 * 128;
                unsigned char* sb = base + s * stage_bytes + nc * 64 * H_BK * 2;
                wgmma_fence();
                #pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    wgmma_m64n128k16(d, make_desc_sw128(sa + kk * 32), make_desc_sw128(sb + kk * 32), (k > 0 || kk > 0) ? 1 : 0);
                wgmma_commit();
                WGMMA_WAIT(1);
                reg_fence(d, 64);
                if (k > 0 && lane == 0) gm_mbar_arrive(&empty[(it - 1) % G_STAGES]);
            }
            WGMMA_WAIT(0);
            reg_fence(d, 64);
            if (lane == 0) gm_mbar_arrive(&empty[(it - 1) % G_STAGES]);
            store_acc_64x128(d, C, M, N, tm * bm + c * 64, tn * G_BN, lane, w);
        }
    }
}
__global__ __launch_bounds__(512, 1) void gemm_v10(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                                                   bf16* __restrict__ C, int M, int N, int K) {
    gemm_groups_body(tmA, tmB, C, M, N, K, 3);
}
__global__ __launch_bounds__(640, 1) void gemm_v11(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                                                   bf16* __restrict__ C, int M, int N, int K) {
    gemm_groups_body(tmA, tmB, C, M, N, K, 4);
}

// v12: v11's tile over MoE units. units[u] = (expert, first row, rows 1..256) in v5's layout (each expert's
// rows from a 128-aligned offset); a tile is a unit x 128 columns of the expert's weights; the producer loads
// only the unit's ceil(rows / 64) 64-row A boxes, and a consumer whose group is absent only waits for and
// frees the stages. So a unit of g groups costs g / 4 of a full tile's tensor work: padding falls to 64-row
// granularity, and every group shares the one 16 KiB B slice a k-slice.
__global__ __launch_bounds__(640, 1) void gemm_v12_groups(const __grid_constant__ CUtensorMap tmA64, const __grid_constant__ CUtensorMap tmB,
                                                          bf16* __restrict__ C, int Mtot, int N, int K, const int4* __restrict__ units,
                                                          int nunits) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    const int stage_bytes = G_STAGE_BYTES(4);
    uint64_t* full = (uint64_t*)(base + G_STAGES * stage_bytes);
    uint64_t* empty = full + G_STAGES;
    int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    int tiles_n = (N + G_BN - 1) / G_BN, ntiles = nunits * tiles_n;
    int nk = (K + H_BK - 1) / H_BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < G_STAGES; s++) { gm_mbar_init(&full[s], 1); gm_mbar_init(&empty[s], 16); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
        if (tid == 0) {
            int it = 0;
            for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
                int tu, tn;
                tile_coords(t, nunits, tiles_n, GROUP_M, &tu, &tn);
                const int4 u = units[tu];
                const int groups = (u.z + 63) / 64, brow = u.x * N + tn * G_BN;
                for (int k = 0; k < nk; k++, it++) {
                    int s = it % G_STAGES, ph = (it / G_STAGES) & 1;
                    gm_mbar_wait(&empty[s], ph ^ 1);
                    unsigned char* st = base + s * stage_bytes;
                    gm_mbar_expect_tx(&full[s], groups * 64 * H_BK * 2 + G_B_BYTES);
                    for (int g = 0; g < groups; g++) gm_tma_load(st + g * 64 * 128, &tmA64, k * H_BK, u.y + g * 64, &full[s]);
                    gm_tma_load(st + 4 * 64 * H_BK * 2, &tmB, k * H_BK, brow, &full[s]);
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 112;");
        int c = wg - 1, lane = tid & 31, w = tid >> 5;
        float d[64];
        #pragma unroll
        for (int i = 0; i < 64; i++) d[i] = 0.f;
        int it = 0;
        for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
            int tu, tn;
            tile_coords(t, nunits, tiles_n, GROUP_M, &tu, &tn);
            const int4 u = units[tu];
            // this consumer's group holds rows: warp-uniform through the shuffle (a branch on a value ptxas
            // cannot prove uniform around the wgmmas serialised them: C7518, the first v12 build)
            const int mine = __shfl_sync(0xffffffffu, c * 64 < u.z ? 1 : 0, 0);
            if (mine) {
                for (int k = 0; k < nk; k++, it++) {
                    int s = it % G_STAGES, ph = (it / G_STAGES) & 1;
                    gm_mbar_wait(&full[s], ph);
                    unsigned char* sa = base + s * stage_bytes + c * 64 * 128;
                    unsigned char* sb = base + s * stage_bytes + 4 * 64 * H_BK * 2;
                    wgmma_fence();
                    #pragma unroll
                    for (int kk = 0; kk < 4; kk++)
                        wgmma_m64n128k16(d, make_desc_sw128(sa + kk * 32), make_desc_sw128(sb + kk * 32), (k > 0 || kk > 0) ? 1 : 0);
                    wgmma_commit();
                    WGMMA_WAIT(1);
                    reg_fence(d, 64);
                    if (k > 0 && lane == 0) gm_mbar_arrive(&empty[(it - 1) % G_STAGES]);
                }
                WGMMA_WAIT(0);
                reg_fence(d, 64);
                if (lane == 0) gm_mbar_arrive(&empty[(it - 1) % G_STAGES]);
                store_acc_64x128(d, C, u.y + u.z, N, u.y + c * 64, tn * G_BN, lane, w);
            } else {
                for (int k = 0; k < nk; k++, it++) {  // nothing of these stages is read here
                    gm_mbar_wait(&full[it % G_STAGES], (it / G_STAGES) & 1);
                    if (lane == 0) gm_mbar_arrive(&empty[it % G_STAGES]);
                }
            }
        }
    }
}

// v13: v12's units in 2-CTA clusters. The cluster takes units (2 u, 2 u + 1) x the same 128 columns; when both
// are one expert's, each CTA loads 64 of the 128 B rows and multicasts them to both (a stage is free once the
// consumers of both CTAs released it: 32 arrivals), else each loads its own 128. Full 64-row groups store
// through stmatrix + TMA one 64x64 box at a time (epilogue_tma_boxes), partial ones from registers. 4 stages of
// 48 KiB + 4 x 8 KiB store buffers (the first version had 3 stages and 16 KiB buffers: the ring then held one
// k-slice ahead and v13 ran 26% under v8 on the big case). Registers: producer 40 (it spilled at 24 and 32),
// consumers 104 (58368 of the 61440 = 640 x 96 at launch).
#define G13_STAGES 4
#define G13_CBUF_BYTES (64 * 64 * 2)
#define G13_SMEM_BYTES (G13_STAGES * G_STAGE_BYTES(4) + 4 * G13_CBUF_BYTES + 1024 + 2 * G13_STAGES * 8)

// A consumer's 64x128 fp32 result (d[0..63]) -> bf16 through an 8 KiB swizzled buffer, box (64 columns) by
// box: wait until the buffer's last store has read it, stmatrix, fence, one TMA store (epilogue_tma's steps).
__device__ __forceinline__ void epilogue_tma_boxes(const float* d, unsigned char* cbuf, const CUtensorMap* tmC, int row0, int col0,
                                                   int tid, int c) {
    int lane = tid & 31, wi = tid >> 5, mi = lane >> 3;
    int row = wi * 16 + (mi & 1) * 8 + (lane & 7);
    uint32_t cb = gm_smem(cbuf);
    #pragma unroll
    for (int b = 0; b < 2; b++) {
        if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        named_bar(2 + c, 128);
        #pragma unroll
        for (int jj = 0; jj < 8; jj += 2) {
            int j = b * 8 + jj, chunk = jj + (mi >> 1);
            uint32_t addr = cb + row * 128 + ((chunk ^ (row & 7)) << 4);
            stmatrix_x4(addr, pack_bf16(d[4 * j + 0], d[4 * j + 1]), pack_bf16(d[4 * j + 2], d[4 * j + 3]),
                        pack_bf16(d[4 * j + 4], d[4 * j + 5]), pack_bf16(d[4 * j + 6], d[4 * j + 7]));
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        named_bar(2 + c, 128);
        if (tid == 0) {
            tma_store_2d(tmC, cbuf, col0 + b * 64, row0);
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
    }
}
__global__ __launch_bounds__(640, 1) void gemm_v13_groups(const __grid_constant__ CUtensorMap tmA64, const __grid_constant__ CUtensorMap tmB,
                                                          const __grid_constant__ CUtensorMap tmBq, const __grid_constant__ CUtensorMap tmC,
                                                          bf16* __restrict__ C, int Mtot, int N, int K, const int4* __restrict__ units,
                                                          int nunits) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    const int stage_bytes = G_STAGE_BYTES(4), b_off = 4 * 64 * H_BK * 2;
    unsigned char* cbufs = base + G13_STAGES * stage_bytes;
    uint64_t* full = (uint64_t*)(cbufs + 4 * G13_CBUF_BYTES);
    uint64_t* empty = full + G13_STAGES;
    int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    uint32_t rank = cluster_ctarank();
    int tiles_n = (N + G_BN - 1) / G_BN, nu2 = (nunits + 1) / 2, nsuper = nu2 * tiles_n;
    int cid = blockIdx.x >> 1, ncl = gridDim.x >> 1;
    int nk = (K + H_BK - 1) / H_BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < G13_STAGES; s++) { gm_mbar_init(&full[s], 1); gm_mbar_init(&empty[s], 32); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    cluster_sync_all();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 0) {
            int it = 0;
            for (int t = cid; t < nsuper; t += ncl) {
                int tu2, tn;
                tile_coords(t, nu2, tiles_n, GROUP_M / 2, &tu2, &tn);
                const int iu = 2 * tu2 + (int)rank, ip = 2 * tu2 + (int)(rank ^ 1);
                const int4 u = iu < nunits ? units[iu] : make_int4(-1, 0, 0, 0);
                const int pe = ip < nunits ? units[ip].x : -2;
                const int same = u.x >= 0 && u.x == pe, groups = (u.z + 63) / 64, brow = u.x * N + tn * G_BN;
                for (int k = 0; k < nk; k++, it++) {
                    int s = it % G13_STAGES, ph = (it / G13_STAGES) & 1;
                    gm_mbar_wait(&empty[s], ph ^ 1);
                    unsigned char* st = base + s * stage_bytes;
                    gm_mbar_expect_tx(&full[s], u.x >= 0 ? groups * 64 * H_BK * 2 + G_B_BYTES : 0);
                    if (u.x < 0) continue;
                    for (int g = 0; g < groups; g++) gm_tma_load(st + g * 64 * 128, &tmA64, k * H_BK, u.y + g * 64, &full[s]);
                    if (same) tma_load_2d_mc(st + b_off + rank * (G_B_BYTES / 2), &tmBq, k * H_BK, brow + rank * (G_BN / 2), &full[s], 0x3);
                    else gm_tma_load(st + b_off, &tmB, k * H_BK, brow, &full[s]);
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 104;");
        int c = wg - 1, lane = tid & 31, w = tid >> 5;
        float d[64];
        #pragma unroll
        for (int i = 0; i < 64; i++) d[i] = 0.f;
        int it = 0;
        for (int t = cid; t < nsuper; t += ncl) {
            int tu2, tn;
            tile_coords(t, nu2, tiles_n, GROUP_M / 2, &tu2, &tn);
            const int iu = 2 * tu2 + (int)rank;
            const int4 u = iu < nunits ? units[iu] : make_int4(-1, 0, 0, 0);
            // warp-uniform (a shuffle) so that ptxas sees the wgmmas' branch as uniform (v12's C7518)
            const int mine = __shfl_sync(0xffffffffu, u.x >= 0 && c * 64 < u.z ? 1 : 0, 0);
            if (mine) {
                for (int k = 0; k < nk; k++, it++) {
                    int s = it % G13_STAGES, ph = (it / G13_STAGES) & 1;
                    gm_mbar_wait(&full[s], ph);
                    unsigned char* sa = base + s * stage_bytes + c * 64 * 128;
                    unsigned char* sb = base + s * stage_bytes + b_off;
                    wgmma_fence();
                    #pragma unroll
                    for (int kk = 0; kk < 4; kk++)
                        wgmma_m64n128k16(d, make_desc_sw128(sa + kk * 32), make_desc_sw128(sb + kk * 32), (k > 0 || kk > 0) ? 1 : 0);
                    wgmma_commit();
                    WGMMA_WAIT(1);
                    reg_fence(d, 64);
                    if (k > 0 && lane == 0) { int sp = (it - 1) % G13_STAGES; gm_mbar_arrive(&empty[sp]); mbar_arrive_cluster(&empty[sp], rank ^ 1); }
                }
                WGMMA_WAIT(0);
                reg_fence(d, 64);
                if (lane == 0) { int sp = (it - 1) % G13_STAGES; gm_mbar_arrive(&empty[sp]); mbar_arrive_cluster(&empty[sp], rank ^ 1); }
                if (u.z - c * 64 >= 64) epilogue_tma_boxes(d, cbufs + c * G13_CBUF_BYTES, &tmC, u.y + c * 64, tn * G_BN, tid, c);
                else store_acc_64x128(d, C, u.y + u.z, N, u.y + c * 64, tn * G_BN, lane, w);
            } else {
                for (int k = 0; k < nk; k++, it++) {  // nothing of these stages is read here
                    int s = it % G13_STAGES;
                    gm_mbar_wait(&full[s], (it / G13_STAGES) & 1);
                    if (lane == 0) { gm_mbar_arrive(&empty[s]); mbar_arrive_cluster(&empty[s], rank ^ 1); }
                }
            }
        }
        if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
    __syncwarp();
    cluster_sync_all();
}

// ---------------------------------------------------------------------------------------------
// host side
// ---------------------------------------------------------------------------------------------
typedef CUresult (*EncodeTiledFn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                                  const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                  CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
static EncodeTiledFn g_encode = NULL;

// tensor map over a [rows, K] K-contiguous bf16 matrix, box = box_rows x 64, 128B swizzle, OOB -> zero
static CUtensorMap make_tmap(const bf16* ptr, int rows, int K, int box_rows) {
    if (!g_encode) {
        cudaDriverEntryPointQueryResult q;
        CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", (void**)&g_encode, 12000, cudaEnableDefault, &q));
        if (q != cudaDriverEntryPointSuccess || !g_encode) { fprintf(stderr, "cuTensorMapEncodeTiled not found\n"); exit(1); }
    }
    CUtensorMap m;
    cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows};
    cuuint64_t strides[1] = {(cuuint64_t)K * 2};
    cuuint32_t box[2] = {64, (cuuint32_t)box_rows};
    cuuint32_t es[2] = {1, 1};
    CKD(g_encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void*)ptr, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                 CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    return m;
}

// tensor map over C [M, N] bf16 row-major, 64x64 boxes, 128B swizzle (TMA store clips at the edges)
static CUtensorMap make_tmap_c(const bf16* ptr, int M, int N) {
    CUtensorMap m;
    cuuint64_t dims[2] = {(cuuint64_t)N, (cuuint64_t)M};
    cuuint64_t strides[1] = {(cuuint64_t)N * 2};
    cuuint32_t box[2] = {64, 64};
    cuuint32_t es[2] = {1, 1};
    CKD(g_encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void*)ptr, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                 CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    return m;
}

static int g_num_sms = 132;

static CUtensorMap g_tBh;  // B map with 128-row boxes (v4 multicast halves)
static CUtensorMap g_tC;   // C map, 64x64 boxes, 128B swizzle (v7 and v9 TMA-store epilogue)
static CUtensorMap g_tA192, g_tA256;  // A maps with 192- and 256-row boxes (v10, v11)

static void run_version(int v, const bf16* A, const bf16* B, bf16* C, int M, int N, int K, const CUtensorMap* tA, const CUtensorMap* tB) {
    if (v == 1) {
        dim3 grid((N + V1_BN - 1) / V1_BN, (M + V1_BM - 1) / V1_BM);
        gemm_v1<<<grid, 256>>>(A, B, C, M, N, K);
    } else if (v == 2) {
        int tiles = ((M + H_BM - 1) / H_BM) * ((N + H_BN - 1) / H_BN);
        gemm_v2<<<tiles, 384, H_SMEM_BYTES>>>(*tA, *tB, C, M, N, K);
    } else if (v == 3) {
        int tiles = ((M + H_BM - 1) / H_BM) * ((N + H_BN - 1) / H_BN);
        int grid = tiles < g_num_sms ? tiles : g_num_sms;
        gemm_v3<<<grid, 384, H_SMEM_BYTES>>>(*tA, *tB, C, M, N, K);
    } else if (v == 4) {
        int tiles_m = (M + H_BM - 1) / H_BM, tiles_n = (N + H_BN - 1) / H_BN;
        int nsuper = ((tiles_m + 1) / 2) * tiles_n;
        cudaLaunchConfig_t cfg; memset(&cfg, 0, sizeof(cfg));
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = 2; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
        cfg.blockDim = dim3(384, 1, 1); cfg.dynamicSmemBytes = H_SMEM_BYTES; cfg.stream = 0; cfg.attrs = at; cfg.numAttrs = 1;
        static int max_clusters = 0;
        if (!max_clusters) {
            cfg.gridDim = dim3(2 * (g_num_sms / 2), 1, 1);
            CK(cudaOccupancyMaxActiveClusters(&max_clusters, (void*)gemm_v4, &cfg));
            printf("v4: max active 2-CTA clusters = %d\n", max_clusters);
            if (max_clusters < 1) { fprintf(stderr, "v4 cannot launch\n"); exit(1); }
        }
        int ncl = nsuper < max_clusters ? nsuper : max_clusters;
        cfg.gridDim = dim3(2 * ncl, 1, 1);
        void* args[6] = {(void*)tA, (void*)&g_tBh, (void*)&C, (void*)&M, (void*)&N, (void*)&K};
        CK(cudaLaunchKernelExC(&cfg, (const void*)gemm_v4, args));
    } else if (v == 6) {
        int tiles_m = (M + H_BM - 1) / H_BM, tiles_n = (N + H_BN - 1) / H_BN;
        int U = ((tiles_m + 1) / 2) * tiles_n;
        int nk = (K + H_BK - 1) / H_BK;
        cudaLaunchConfig_t cfg; memset(&cfg, 0, sizeof(cfg));
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = 2; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
        cfg.blockDim = dim3(384, 1, 1); cfg.dynamicSmemBytes = H_SMEM_BYTES; cfg.stream = 0; cfg.attrs = at; cfg.numAttrs = 1;
        static int max_clusters = 0;
        if (!max_clusters) {
            cfg.gridDim = dim3(2 * (g_num_sms / 2), 1, 1);
            CK(cudaOccupancyMaxActiveClusters(&max_clusters, (void*)gemm_v6, &cfg));
            if (max_clusters < 1) { fprintf(stderr, "v6 cannot launch\n"); exit(1); }
        }
        int P = U < max_clusters ? U : max_clusters;
        int tail = U % P;
        int dp = U - tail, sk_len = 1, sk_total = 0, maxc = 1;
        if (tail) {
            sk_total = tail * nk;
            sk_len = (sk_total + P - 1) / P;
            if (sk_len * 4 < nk) { dp = U; sk_total = 0; sk_len = 1; }  // too fine a split: plain data-parallel tail
            else maxc = nk / sk_len + 2;
        }
        static float* ws = NULL; static int* tk = NULL; static size_t ws_floats = 0, tk_n = 0;
        size_t need = (size_t)(U - dp) * maxc * 2 * H_BM * H_BN;
        if (need > ws_floats) { if (ws) CK(cudaFree(ws)); CK(cudaMalloc(&ws, need * 4)); ws_floats = need; }
        if ((size_t)(U - dp) * 2 > tk_n || !tk) {
            if (tk) CK(cudaFree(tk));
            tk_n = (size_t)(U - dp) * 2 + 2;
            CK(cudaMalloc(&tk, tk_n * 4)); CK(cudaMemset(tk, 0, tk_n * 4));
        }
        static int printed = 0;
        if (printed != U * 1000 + P) { printed = U * 1000 + P; printf("v6: U=%d clusters=%d dp=%d tail=%d sk_len=%d (nk=%d) maxc=%d\n", U, P, dp, U - dp, sk_len, nk, maxc); }
        cfg.gridDim = dim3(2 * P, 1, 1);
        void* args[12] = {(void*)tA, (void*)&g_tBh, (void*)&C, (void*)&M, (void*)&N, (void*)&K, (void*)&dp, (void*)&sk_len, (void*)&sk_total,
                          (void*)&maxc, (void*)&ws, (void*)&tk};
        CK(cudaLaunchKernelExC(&cfg, (const void*)gemm_v6, args));
    } else if (v == 7) {
        int tiles_m = (M + H_BM - 1) / H_BM, tiles_n = (N + H_BN - 1) / H_BN;
        int nsuper = ((tiles_m + 1) / 2) * tiles_n;
        cudaLaunchConfig_t cfg; memset(&cfg, 0, sizeof(cfg));
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = 2; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
        cfg.blockDim = dim3(384, 1, 1); cfg.dynamicSmemBytes = H7_SMEM_BYTES; cfg.stream = 0; cfg.attrs = at; cfg.numAttrs = 1;
        static int max_clusters = 0;
        if (!max_clusters) {
            cfg.gridDim = dim3(2 * (g_num_sms / 2), 1, 1);
            CK(cudaOccupancyMaxActiveClusters(&max_clusters, (void*)gemm_v7, &cfg));
            printf("v7: max active 2-CTA clusters = %d, smem %d\n", max_clusters, (int)H7_SMEM_BYTES);
            if (max_clusters < 1) { fprintf(stderr, "v7 cannot launch\n"); exit(1); }
        }
        int ncl = nsuper < max_clusters ? nsuper : max_clusters;
        cfg.gridDim = dim3(2 * ncl, 1, 1);
        void* args[6] = {(void*)tA, (void*)&g_tBh, (void*)&g_tC, (void*)&M, (void*)&N, (void*)&K};
        CK(cudaLaunchKernelExC(&cfg, (const void*)gemm_v7, args));
    } else if (v == 9) {  // B with 128-row boxes: g_tBh
        int tiles = ((M + H_BM - 1) / H_BM) * ((N + P9_BN - 1) / P9_BN);
        int grid = tiles < g_num_sms ? tiles : g_num_sms;
        gemm_v9<<<grid, 384, P9_SMEM_BYTES>>>(*tA, g_tBh, g_tC, M, N, K);
    } else if (v == 10 || v == 11) {  // B with 128-row boxes: g_tBh
        int nc = v == 10 ? 3 : 4;
        int tiles = ((M + 64 * nc - 1) / (64 * nc)) * ((N + G_BN - 1) / G_BN);
        int grid = tiles < g_num_sms ? tiles : g_num_sms;
        if (v == 10) gemm_v10<<<grid, 512, G_SMEM_BYTES(3)>>>(g_tA192, g_tBh, C, M, N, K);
        else gemm_v11<<<grid, 640, G_SMEM_BYTES(4)>>>(g_tA256, g_tBh, C, M, N, K);
    }
    CK(cudaGetLastError());
}
#define NVERSIONS 11
#define MOE_ONLY(v) ((v) == 5 || (v) == 8) /* grouped versions: ./gemm 5 or 8, not in the dense table */
static const char* vname[NVERSIONS + 1] = {"cuBLAS", "v1 mma.sync 128x128", "v2 TMA+wgmma ws", "v3 persistent", "v4 2-CTA mcast B", "v5 (MoE: ./gemm 5)", "v6 v4+stream-K tail", "v7 v4+TMA-store epi", "v8 (MoE: ./gemm 8)", "v9 ping-pong 128x128", "v10 3x m64n128 192x128", "v11 4x m64n128 256x128"};

static void run_cublas(cublasHandle_t h, const bf16* A, const bf16* B, bf16* C, int M, int N, int K) {
    float alpha = 1.f, beta = 0.f;
    // column-major view: C^T[N,M] = B[N,K] (= (K x N col-major)^T) * A^T (K x M col-major)
    CKB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, B, CUDA_R_16BF, K, A, CUDA_R_16BF, K, &beta, C, CUDA_R_16BF, N,
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

__device__ __forceinline__ uint32_t hash32(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16; return x;
}
// uniform in [-1,1] with |x| >= 1/64 (never zero)
__global__ void init_rand(bf16* p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = hash32((uint32_t)i * 0x9E3779B9U ^ hash32(seed + (uint32_t)(i >> 32) * 0x85ebca6bU));
        float u = (h >> 8) * (1.0f / 16777216.0f) * 2.f - 1.f;
        if (fabsf(u) < 1.f / 64.f) u = (u < 0.f ? -1.f : 1.f) / 64.f;
        p[i] = __float2bfloat16(u);
    }
}
__global__ void poison(bf16* p, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        ((unsigned short*)p)[i] = 0xFFFF;  // NaN
}
struct CmpRes { unsigned long long bad, nan; unsigned int max_err_bits, max_rel_bits; double se, sr; };
// elementwise: |x-r| <= rtol*|r| + atol ; NaN always bad
__global__ void compare(const bf16* x, const bf16* r, size_t n, float rtol, float atol, CmpRes* res) {
    unsigned long long bad = 0, nan = 0; float me = 0.f, mr = 0.f; double se = 0, sr = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float a = __bfloat162float(x[i]), b = __bfloat162float(r[i]);
        if (isnan(a) || isnan(b)) { nan++; bad++; continue; }
        float e = fabsf(a - b);
        if (e > rtol * fabsf(b) + atol) bad++;
        me = fmaxf(me, e);
        mr = fmaxf(mr, e / (fabsf(b) + atol));
        se += (double)e * e; sr += (double)b * b;
    }
    atomicAdd(&res->bad, bad); atomicAdd(&res->nan, nan);
    atomicMax(&res->max_err_bits, __float_as_uint(me)); atomicMax(&res->max_rel_bits, __float_as_uint(mr));
    atomicAdd(&res->se, se); atomicAdd(&res->sr, sr);
}
__global__ void gather(const bf16* C, const int* rows, const int* cols, int n, int N, float* out) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __bfloat162float(C[(size_t)rows[i] * N + cols[i]]);
}

static float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static int cmp_float(const void* a, const void* b) { float x = *(const float*)a, y = *(const float*)b; return (x > y) - (x < y); }

#define NSAMP 512
#define NTIMED 25

// ---------------------------------------------------------------------------------------------
// MoE grouped check + timing (./gemm 5): reference = cuBLAS per expert on the valid rows, plus CPU samples
// ---------------------------------------------------------------------------------------------
static void moe_case(cublasHandle_t h, int E, int N, int K, const int* m, double* out_tf, double* out_cub, double* out_dense, double* out_tf8,
                     double* out_tf12, double* out_tf13, int* out_ok) {
    int off[256], Mtot = 0, valid = 0;
    for (int e = 0; e < E; e++) { off[e] = Mtot; Mtot += (m[e] + H_BM - 1) / H_BM * H_BM; valid += m[e]; }
    printf("\n=== MoE grouped: E=%d N=%d K=%d valid rows=%d padded rows=%d; m =", E, N, K, valid, Mtot);
    for (int e = 0; e < E; e++) printf(" %d", m[e]);
    printf(" ===\n");
    int tiles_m = Mtot / H_BM;
    int* hte = (int*)malloc(tiles_m * 4); int* htr = (int*)malloc(tiles_m * 4);
    for (int e = 0; e < E; e++)
        for (int r = 0; r < m[e]; r += H_BM) { int tm = (off[e] + r) / H_BM; hte[tm] = e; htr[tm] = m[e] - r < H_BM ? m[e] - r : H_BM; }
    int *dte, *dtr;
    CK(cudaMalloc(&dte, tiles_m * 4)); CK(cudaMalloc(&dtr, tiles_m * 4));
    // v12's units: up to 256 rows of one expert from its offset
    int nunits = 0;
    for (int e = 0; e < E; e++) nunits += (m[e] + 255) / 256;
    int4* hun = (int4*)malloc((nunits + 1) * sizeof(int4));
    for (int e = 0, u = 0; e < E; e++)
        for (int r = 0; r < m[e]; r += 256) hun[u++] = make_int4(e, off[e] + r, m[e] - r < 256 ? m[e] - r : 256, 0);
    int4* dun;
    CK(cudaMalloc(&dun, (nunits + 1) * sizeof(int4)));
    CK(cudaMemcpy(dun, hun, nunits * sizeof(int4), cudaMemcpyHostToDevice));
    long long groups = 0;
    for (int u = 0; u < nunits; u++) groups += (hun[u].z + 63) / 64;
    printf("v12 units %d, 64-row groups %lld (%lld rows computed) against v5's %d blocks (%d rows)\n", nunits, groups, groups * 64, tiles_m,
           tiles_m * H_BM);
    CK(cudaMemcpy(dte, hte, tiles_m * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(dtr, htr, tiles_m * 4, cudaMemcpyHostToDevice));
    size_t nA = (size_t)Mtot * K, nB = (size_t)E * N * K, nC = (size_t)Mtot * N;
    bf16 *A, *B, *C, *Cref;
    CK(cudaMalloc(&A, nA * 2)); CK(cudaMalloc(&B, nB * 2)); CK(cudaMalloc(&C, nC * 2)); CK(cudaMalloc(&Cref, nC * 2));
    CUtensorMap tA = make_tmap(A, Mtot, K, H_BM), tB = make_tmap(B, E * N, K, H_BN);
    init_rand<<<1024, 256>>>(A, nA, 777); CK(cudaGetLastError());
    init_rand<<<1024, 256>>>(B, nB, 778); CK(cudaGetLastError());
    poison<<<1024, 256>>>(C, nC); CK(cudaGetLastError());
    poison<<<1024, 256>>>(Cref, nC); CK(cudaGetLastError());
    float alpha = 1.f, beta = 0.f;
#define MOE_CUBLAS() do { for (int e = 0; e < E; e++) if (m[e]) \
        CKB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, m[e], K, &alpha, B + (size_t)e * N * K, CUDA_R_16BF, K, A + (size_t)off[e] * K, \
                         CUDA_R_16BF, K, &beta, Cref + (size_t)off[e] * N, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)); } while (0)
    int grid = tiles_m * ((N + H_BN - 1) / H_BN); if (grid > g_num_sms) grid = g_num_sms;
#define MOE_V5() do { gemm_v5_grouped<<<grid, 384, H_SMEM_BYTES>>>(tA, tB, C, Mtot, N, K, dte, dtr); CK(cudaGetLastError()); } while (0)
    CUtensorMap tBh = make_tmap(B, E * N, K, H_BN / 2), tC = make_tmap_c(C, Mtot, N);
    cudaLaunchConfig_t cfg8; memset(&cfg8, 0, sizeof(cfg8));
    cudaLaunchAttribute at8[1];
    at8[0].id = cudaLaunchAttributeClusterDimension;
    at8[0].val.clusterDim.x = 2; at8[0].val.clusterDim.y = 1; at8[0].val.clusterDim.z = 1;
    cfg8.blockDim = dim3(384, 1, 1); cfg8.dynamicSmemBytes = H7_SMEM_BYTES; cfg8.stream = 0; cfg8.attrs = at8; cfg8.numAttrs = 1;
    cfg8.gridDim = dim3(2 * (g_num_sms / 2), 1, 1);
    int maxcl8 = 0;
    CK(cudaOccupancyMaxActiveClusters(&maxcl8, (void*)gemm_v8_grouped, &cfg8));
    int nsuper8 = ((tiles_m + 1) / 2) * ((N + H_BN - 1) / H_BN);
    cfg8.gridDim = dim3(2 * (nsuper8 < maxcl8 ? nsuper8 : maxcl8), 1, 1);
    void* args8[10] = {(void*)&tA, (void*)&tB, (void*)&tBh, (void*)&tC, (void*)&C, (void*)&Mtot, (void*)&N, (void*)&K, (void*)&dte, (void*)&dtr};
#define MOE_V8() do { CK(cudaLaunchKernelExC(&cfg8, (const void*)gemm_v8_grouped, args8)); } while (0)
    CUtensorMap tA64 = make_tmap(A, Mtot, K, 64);
    int grid12 = nunits * ((N + G_BN - 1) / G_BN); if (grid12 > g_num_sms) grid12 = g_num_sms;
#define MOE_V12() do { gemm_v12_groups<<<grid12, 640, G_SMEM_BYTES(4)>>>(tA64, tBh, C, Mtot, N, K, dun, nunits); CK(cudaGetLastError()); } while (0)
    CUtensorMap tBq = make_tmap(B, E * N, K, 64);
    cudaLaunchConfig_t cfg13 = cfg8;
    cfg13.blockDim = dim3(640, 1, 1); cfg13.dynamicSmemBytes = G13_SMEM_BYTES;
    cfg13.gridDim = dim3(2 * (g_num_sms / 2), 1, 1);
    int maxcl13 = 0;
    CK(cudaOccupancyMaxActiveClusters(&maxcl13, (void*)gemm_v13_groups, &cfg13));
    int nsuper13 = ((nunits + 1) / 2) * ((N + G_BN - 1) / G_BN);
    cfg13.gridDim = dim3(2 * (nsuper13 < maxcl13 ? nsuper13 : maxcl13), 1, 1);
    void* args13[10] = {(void*)&tA64, (void*)&tBh, (void*)&tBq, (void*)&tC, (void*)&C, (void*)&Mtot, (void*)&N, (void*)&K, (void*)&dun, (void*)&nunits};
#define MOE_V13() do { CK(cudaLaunchKernelExC(&cfg13, (const void*)gemm_v13_groups, args13)); } while (0)
#define MOE_RUN(ver) do { if ((ver) == 5) MOE_V5(); else if ((ver) == 8) MOE_V8(); else if ((ver) == 12) MOE_V12(); else MOE_V13(); } while (0)
    int ok = 1;
    float atol = 1e-3f * sqrtf((float)K), rtol = 1.6e-2f;
    CmpRes* dres; CK(cudaMalloc(&dres, sizeof(CmpRes)));
    for (int ver = 5; ver <= 13; ver += ver == 5 ? 3 : ver == 8 ? 4 : 1) {
    const char* vn = ver == 5 ? "v5 grouped" : ver == 8 ? "v8 grouped cl+tma" : ver == 12 ? "v12 64-row groups" : "v13 groups cl+tma";
    init_rand<<<1024, 256>>>(A, nA, 777 + ver); CK(cudaGetLastError());
    init_rand<<<1024, 256>>>(B, nB, 778 + ver); CK(cudaGetLastError());
    poison<<<1024, 256>>>(C, nC); CK(cudaGetLastError());
    poison<<<1024, 256>>>(Cref, nC); CK(cudaGetLastError());
    MOE_CUBLAS();
    MOE_RUN(ver);
    CK(cudaDeviceSynchronize());
    CmpRes hr; memset(&hr, 0, sizeof(hr));
    CK(cudaMemcpy(dres, &hr, sizeof(hr), cudaMemcpyHostToDevice));
    for (int e = 0; e < E; e++) if (m[e]) { compare<<<512, 256>>>(C + (size_t)off[e] * N, Cref + (size_t)off[e] * N, (size_t)m[e] * N, rtol, atol, dres); CK(cudaGetLastError()); }
    CK(cudaMemcpy(&hr, dres, sizeof(hr), cudaMemcpyDeviceToHost));
    float me, mr; memcpy(&me, &hr.max_err_bits, 4); memcpy(&mr, &hr.max_rel_bits, 4);
    printf("[%s] vs cuBLAS per expert: bad=%llu nan=%llu max_abs_err=%.4g max_rel_err=%.4g rel_l2=%.3g\n", vn, hr.bad, hr.nan, me, mr,
           sqrt(hr.se / (hr.sr > 0 ? hr.sr : 1)));
    if (hr.bad) ok = 0;
    // padding rows must stay untouched (still the 0xFFFF poison)
    {
        unsigned short* hc = (unsigned short*)malloc(nC * 2);
        CK(cudaMemcpy(hc, C, nC * 2, cudaMemcpyDeviceToHost));
        long long touched = 0;
        for (int e = 0; e < E; e++) {
            int pe = (m[e] + H_BM - 1) / H_BM * H_BM;
            for (int r = m[e]; r < pe; r++) for (int j = 0; j < N; j++) touched += hc[(size_t)(off[e] + r) * N + j] != 0xFFFF;
        }
        printf("[%s] padding-row elements written: %lld (must be 0)\n", vn, touched);
        if (touched) ok = 0;
        // CPU double reference on samples of valid rows
        uint16_t* hA = (uint16_t*)malloc(nA * 2); uint16_t* hB = (uint16_t*)malloc(nB * 2);
        CK(cudaMemcpy(hA, A, nA * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(hB, B, nB * 2, cudaMemcpyDeviceToHost));
        srand(99); int cbad = 0; double maxrel = 0;
        for (int i = 0; i < NSAMP; i++) {
            int e; do { e = rand() % E; } while (!m[e]);
            int r = (i & 1) ? m[e] - 1 : rand() % m[e], j = (i & 2) ? N - 1 : rand() % N;
            double acc = 0;
            const uint16_t* a = hA + (size_t)(off[e] + r) * K; const uint16_t* b = hB + ((size_t)e * N + j) * K;
            for (int k = 0; k < K; k++) acc += (double)bf2f(a[k]) * (double)bf2f(b[k]);
            double got = bf2f(hc[(size_t)(off[e] + r) * N + j]);
            double err = fabs(got - acc);
            if (!(err <= 8e-3 * fabs(acc) + atol)) cbad++;
            double rel = err / (fabs(acc) + atol); if (!(rel <= maxrel)) maxrel = rel;
        }
        printf("[%s] vs CPU double (%d samples): bad=%d max_rel_err=%.4g\n", vn, NSAMP, cbad, maxrel);
        if (cbad) ok = 0;
        free(hc); free(hA); free(hB);
    }
    }
    // timing: v5, cuBLAS loop over experts, and one dense cuBLAS GEMM with the same valid-row count (M=valid) for scale
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    // timed interleaved (one run of each variant per round) so clock/thermal drift hits all variants alike
    float ts[6][NTIMED]; double flops = 2.0 * valid * N * K;
#define MOE_WHICH(w) do { if ((w) == 0) MOE_V5(); else if ((w) == 1) MOE_CUBLAS(); else if ((w) == 2) run_cublas(h, A, B, Cref, valid, N, K); \
                          else if ((w) == 3) MOE_V8(); else if ((w) == 4) MOE_V12(); else MOE_V13(); } while (0)
    for (int r = 0; r < 3; r++) for (int which = 0; which < 6; which++) MOE_WHICH(which);
    CK(cudaDeviceSynchronize());
    for (int r = 0; r < NTIMED; r++)
        for (int which = 0; which < 6; which++) {
            CK(cudaEventRecord(e0));
            MOE_WHICH(which);
            CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); CK(cudaEventElapsedTime(&ts[which][r], e0, e1));
        }
    for (int which = 0; which < 6; which++) {
        qsort(ts[which], NTIMED, sizeof(float), cmp_float);
        double tf = flops / (ts[which][NTIMED / 2] * 1e-3) / 1e12;
        const char* nm[6] = {"v5 grouped (1 launch)", "cuBLAS loop per expert", "cuBLAS dense M=valid", "v8 grouped cluster+TMA store",
                             "v12 64-row groups", "v13 groups cluster+TMA store"};
        printf("[%s] median %.4f ms (min %.4f max %.4f) = %.1f TFLOP/s (valid-row flops)\n", nm[which], ts[which][NTIMED / 2], ts[which][0],
               ts[which][NTIMED - 1], tf);
        if (which == 0) *out_tf = tf; else if (which == 1) *out_cub = tf; else if (which == 2) *out_dense = tf; else if (which == 3) *out_tf8 = tf;
        else if (which == 4) *out_tf12 = tf; else *out_tf13 = tf;
    }
#undef MOE_WHICH
    *out_ok = ok;
#undef MOE_CUBLAS
#undef MOE_V5
#undef MOE_V8
#undef MOE_V12
#undef MOE_V13
#undef MOE_RUN
    CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
    CK(cudaFree(A)); CK(cudaFree(B)); CK(cudaFree(C)); CK(cudaFree(Cref)); CK(cudaFree(dte)); CK(cudaFree(dtr)); CK(cudaFree(dres)); CK(cudaFree(dun));
    free(hte); free(htr); free(hun);
}

static void moe_main(cublasHandle_t h, const char* devname) {
    CK(cudaFuncSetAttribute(gemm_v5_grouped, cudaFuncAttributeMaxDynamicSharedMemorySize, H_SMEM_BYTES));
    CK(cudaFuncSetAttribute(gemm_v8_grouped, cudaFuncAttributeMaxDynamicSharedMemorySize, H7_SMEM_BYTES));
    CK(cudaFuncSetAttribute(gemm_v12_groups, cudaFuncAttributeMaxDynamicSharedMemorySize, G_SMEM_BYTES(4)));
    CK(cudaFuncSetAttribute(gemm_v13_groups, cudaFuncAttributeMaxDynamicSharedMemorySize, G13_SMEM_BYTES));
    int m1[8] = {3000, 0, 5, 2500, 1800, 4100, 1200, 700};
    int m2[32], m3[64];
    srand(4242);
    for (int e = 0; e < 32; e++) m2[e] = rand() % 300;
    m2[3] = 0; m2[7] = 1; m2[20] = 0;
    for (int e = 0; e < 64; e++) m3[e] = 108 + rand() % 42;  // DeepSeek's GEMM0 at M=4096 EP2: ~128 +- 11 rows an expert
    double tf[3], cub[3], dense[3], tf8[3], tf12[3], tf13[3]; int ok[3];
    moe_case(h, 8, 4096, 7168, m1, &tf[0], &cub[0], &dense[0], &tf8[0], &tf12[0], &tf13[0], &ok[0]);
    moe_case(h, 32, 7168, 2048, m2, &tf[1], &cub[1], &dense[1], &tf8[1], &tf12[1], &tf13[1], &ok[1]);
    moe_case(h, 64, 4096, 7168, m3, &tf[2], &cub[2], &dense[2], &tf8[2], &tf12[2], &tf13[2], &ok[2]);
    printf("\n==== MoE SUMMARY (%s) TFLOP/s on valid rows, median of %d ====\n", devname, NTIMED);
    printf("%-30s | %-11s | %-11s | %-11s | %-11s | %-22s | %-20s\n", "case (ok = v5, v8, v12, v13)", "v5 grouped", "v8 grouped",
           "v12 groups", "v13 gr cl", "cuBLAS loop/expert", "cuBLAS dense M=valid");
    const char* cn[3] = {"E=8 N=4096 K=7168 (big)", "E=32 N=7168 K=2048 (small)", "E=64 N=4096 K=7168 (~128 a)"};
    for (int i = 0; i < 3; i++)
        printf("%-27s %-3s| %-11.1f | %-11.1f | %-11.1f | %-11.1f | %-22.1f | %-20.1f\n", cn[i], ok[i] ? "ok" : "BAD", tf[i], tf8[i], tf12[i],
               tf13[i], cub[i], dense[i]);
}


int main(int argc, char** argv) {
    int only = argc > 1 ? atoi(argv[1]) : 0;
    /* the last two: short K, as the MoE GEMM1s of Qwen2 (K = F 1408) and DeepSeek-V3 (K = F 2048), where v7's
     * epilogues idle the tensor cores longest (v9's case) */
    int shapes[8][3] = {{4096, 4096, 4096}, {8192, 8192, 8192}, {1000, 4096, 4096}, {2048, 1000, 1000}, {1100, 1000, 1000}, {4480, 4096, 2000},
                        {16384, 2048, 1408}, {32768, 7168, 2048}};
    int nshapes = 8;
    if (argc > 4) { shapes[0][0] = atoi(argv[2]); shapes[0][1] = atoi(argv[3]); shapes[0][2] = atoi(argv[4]); nshapes = 1; }

    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    g_num_sms = prop.multiProcessorCount;
    printf("device: %s, %d SMs, smem/block optin %zu\n", prop.name, prop.multiProcessorCount, (size_t)prop.sharedMemPerBlockOptin);
    CK(cudaFuncSetAttribute(gemm_v2, cudaFuncAttributeMaxDynamicSharedMemorySize, H_SMEM_BYTES));
    CK(cudaFuncSetAttribute(gemm_v3, cudaFuncAttributeMaxDynamicSharedMemorySize, H_SMEM_BYTES));
    CK(cudaFuncSetAttribute(gemm_v4, cudaFuncAttributeMaxDynamicSharedMemorySize, H_SMEM_BYTES));
    CK(cudaFuncSetAttribute(gemm_v6, cudaFuncAttributeMaxDynamicSharedMemorySize, H_SMEM_BYTES));
    CK(cudaFuncSetAttribute(gemm_v7, cudaFuncAttributeMaxDynamicSharedMemorySize, H7_SMEM_BYTES));
    CK(cudaFuncSetAttribute(gemm_v9, cudaFuncAttributeMaxDynamicSharedMemorySize, P9_SMEM_BYTES));
    CK(cudaFuncSetAttribute(gemm_v10, cudaFuncAttributeMaxDynamicSharedMemorySize, G_SMEM_BYTES(3)));
    CK(cudaFuncSetAttribute(gemm_v11, cudaFuncAttributeMaxDynamicSharedMemorySize, G_SMEM_BYTES(4)));
    cublasHandle_t h;
    CKB(cublasCreate(&h));
    if (only == 5 || only == 8) { moe_main(h, prop.name); CKB(cublasDestroy(h)); return 0; }

    double tflops[8][NVERSIONS + 1];
    int ok_all[8][NVERSIONS + 1];
    memset(ok_all, 0, sizeof(ok_all));
    for (int si = 0; si < nshapes; si++) for (int v = 0; v <= NVERSIONS; v++) tflops[si][v] = 0;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    uint32_t seed = 12345;

    for (int si = 0; si < nshapes; si++) {
        int M = shapes[si][0], N = shapes[si][1], K = shapes[si][2];
        if (N % 8 || K % 8) { printf("shape %dx%dx%d unsupported (N%%8, K%%8)\n", M, N, K); continue; }
        printf("\n=== M=%d N=%d K=%d ===\n", M, N, K);
        size_t nA = (size_t)M * K, nB = (size_t)N * K, nC = (size_t)M * N;
        bf16 *A, *B, *C, *Cref;
        CK(cudaMalloc(&A, nA * 2)); CK(cudaMalloc(&B, nB * 2)); CK(cudaMalloc(&C, nC * 2)); CK(cudaMalloc(&Cref, nC * 2));
        uint16_t* hA = (uint16_t*)malloc(nA * 2); uint16_t* hB = (uint16_t*)malloc(nB * 2);
        int *dr, *dc; float* dv;
        CK(cudaMalloc(&dr, NSAMP * 4)); CK(cudaMalloc(&dc, NSAMP * 4)); CK(cudaMalloc(&dv, NSAMP * 4));
        CmpRes* dres; CK(cudaMalloc(&dres, sizeof(CmpRes)));
        CUtensorMap tA = make_tmap(A, M, K, H_BM), tB = make_tmap(B, N, K, H_BN);
        g_tBh = make_tmap(B, N, K, H_BN / 2);
        g_tA192 = make_tmap(A, M, K, 192), g_tA256 = make_tmap(A, M, K, 256);
        g_tC = make_tmap_c(C, M, N);
        float atol = 1e-3f * sqrtf((float)K), rtol = 1.6e-2f;

        for (int v = 0; v <= NVERSIONS; v++) {
            if (MOE_ONLY(v) || (v && only && v != only)) continue;
            // ---- correctness, fresh inputs each version ----
            init_rand<<<1024, 256>>>(A, nA, seed++); CK(cudaGetLastError());
            init_rand<<<1024, 256>>>(B, nB, seed++); CK(cudaGetLastError());
            poison<<<1024, 256>>>(Cref, nC); CK(cudaGetLastError());
            poison<<<1024, 256>>>(C, nC); CK(cudaGetLastError());
            run_cublas(h, A, B, Cref, M, N, K);
            bf16* out = Cref;
            if (v) { run_version(v, A, B, C, M, N, K, &tA, &tB); out = C; }
            CK(cudaDeviceSynchronize());
            CmpRes hr; memset(&hr, 0, sizeof(hr));
            int ok = 1;
            if (v) {
                CK(cudaMemcpy(dres, &hr, sizeof(hr), cudaMemcpyHostToDevice));
                compare<<<1024, 256>>>(C, Cref, nC, rtol, atol, dres); CK(cudaGetLastError());
                CK(cudaMemcpy(&hr, dres, sizeof(hr), cudaMemcpyDeviceToHost));
                float me, mr; memcpy(&me, &hr.max_err_bits, 4); memcpy(&mr, &hr.max_rel_bits, 4);
                printf("[%s] vs cuBLAS: bad=%llu nan=%llu max_abs_err=%.4g max_rel_err=%.4g rel_l2=%.3g\n", vname[v], hr.bad, hr.nan,
                       me, mr, sqrt(hr.se / (hr.sr > 0 ? hr.sr : 1)));
                if (hr.bad) ok = 0;
            }
            // CPU double reference on sampled entries
            CK(cudaMemcpy(hA, A, nA * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(hB, B, nB * 2, cudaMemcpyDeviceToHost));
            int hr_[NSAMP], hc_[NSAMP]; float hv[NSAMP];
            srand(seed * 7 + v);
            for (int i = 0; i < NSAMP; i++) {
                hr_[i] = rand() % M; hc_[i] = rand() % N;
                if (i < 4) { hr_[i] = (i & 1) ? M - 1 : 0; hc_[i] = (i & 2) ? N - 1 : 0; }  // corners
            }
            CK(cudaMemcpy(dr, hr_, sizeof(hr_), cudaMemcpyHostToDevice));
            CK(cudaMemcpy(dc, hc_, sizeof(hc_), cudaMemcpyHostToDevice));
            gather<<<(NSAMP + 255) / 256, 256>>>(out, dr, dc, NSAMP, N, dv); CK(cudaGetLastError());
            CK(cudaMemcpy(hv, dv, sizeof(hv), cudaMemcpyDeviceToHost));
            double maxrel = 0; int cbad = 0;
            for (int i = 0; i < NSAMP; i++) {
                double acc = 0;
                const uint16_t* a = hA + (size_t)hr_[i] * K; const uint16_t* b = hB + (size_t)hc_[i] * K;
                for (int k = 0; k < K; k++) acc += (double)bf2f(a[k]) * (double)bf2f(b[k]);
                double e = fabs(hv[i] - acc);
                if (!(e <= 8e-3 * fabs(acc) + atol)) cbad++;  // bf16 output rounding is <= 2^-9 relative
                double rel = e / (fabs(acc) + atol);
                if (!(rel <= maxrel)) maxrel = rel;
            }
            printf("[%s] vs CPU double (%d samples): bad=%d max_rel_err=%.4g\n", vname[v], NSAMP, cbad, maxrel);
            if (cbad) ok = 0;
            ok_all[si][v] = ok;

            // ---- timing ----
            float ts[NTIMED];
            for (int r = 0; r < 3; r++) { if (v) run_version(v, A, B, C, M, N, K, &tA, &tB); else run_cublas(h, A, B, Cref, M, N, K); }
            CK(cudaDeviceSynchronize());
            for (int r = 0; r < NTIMED; r++) {
                CK(cudaEventRecord(e0));
                if (v) run_version(v, A, B, C, M, N, K, &tA, &tB); else run_cublas(h, A, B, Cref, M, N, K);
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                CK(cudaEventElapsedTime(&ts[r], e0, e1));
            }
            qsort(ts, NTIMED, sizeof(float), cmp_float);
            double med = ts[NTIMED / 2];
            tflops[si][v] = 2.0 * M * N * K / (med * 1e-3) / 1e12;
            printf("[%s] median %.4f ms (min %.4f max %.4f) = %.1f TFLOP/s  %s\n", vname[v], med, ts[0], ts[NTIMED - 1], tflops[si][v],
                   ok ? "CORRECT" : "WRONG");
            // check the timed output too (the last timed run) for the versions
            if (v) {
                CK(cudaDeviceSynchronize());
                run_cublas(h, A, B, Cref, M, N, K);
                memset(&hr, 0, sizeof(hr));
                CK(cudaMemcpy(dres, &hr, sizeof(hr), cudaMemcpyHostToDevice));
                compare<<<1024, 256>>>(C, Cref, nC, rtol, atol, dres); CK(cudaGetLastError());
                CK(cudaMemcpy(&hr, dres, sizeof(hr), cudaMemcpyDeviceToHost));
                if (hr.bad) { printf("[%s] after timing: bad=%llu (race?)\n", vname[v], hr.bad); ok_all[si][v] = 0; }
            }
        }
        CK(cudaFree(A)); CK(cudaFree(B)); CK(cudaFree(C)); CK(cudaFree(Cref)); CK(cudaFree(dr)); CK(cudaFree(dc)); CK(cudaFree(dv));
        CK(cudaFree(dres));
        free(hA); free(hB);
    }
    printf("\n==== SUMMARY (%s) TFLOP/s, median of %d, [ok]/[BAD] = correctness ====\n", prop.name, NTIMED);
    printf("%-22s", "shape MxNxK");
    for (int v = 0; v <= NVERSIONS; v++) if (!MOE_ONLY(v)) printf(" | %-20s", vname[v]);
    printf("\n");
    for (int si = 0; si < nshapes; si++) {
        char sh[64]; snprintf(sh, sizeof(sh), "%dx%dx%d", shapes[si][0], shapes[si][1], shapes[si][2]);
        printf("%-22s", sh);
        for (int v = 0; v <= NVERSIONS; v++) {
            if (MOE_ONLY(v)) continue;
            if (v && only && v != only) { printf(" | %-20s", "-"); continue; }
            char cell[64];
            if (v) snprintf(cell, sizeof(cell), "%.1f (%.0f%%) %s", tflops[si][v], 100.0 * tflops[si][v] / tflops[si][0], ok_all[si][v] ? "ok" : "BAD");
            else snprintf(cell, sizeof(cell), "%.1f %s", tflops[si][v], ok_all[si][v] ? "ok" : "BAD");
            printf(" | %-20s", cell);
        }
        printf("\n");
    }
    CKB(cublasDestroy(h));
    return 0;
}
