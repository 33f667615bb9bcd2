/*
 * link_bench.cu - how fast one GPU can move rows from or to its peer over
 * NVLink, the facts behind the overlapped dispatch's transport (the pulling
 * CTAs of the overlapped mode read only 5-7 GB/s each beside GEMM0:
 * bench/results/modes/2026-11-22-overlapped-layer0-h200x2.md). Both GPUs move
 * `MiB` to each other at once, in four ways:
 *   pull  - CTAs load 16-byte words from the peer's buffer (PULL_UNROLL in
 *           flight a thread, as the layer's dispatch) and store them locally;
 *   push  - CTAs load locally and store into the peer's buffer;
 *   bulk  - one thread a CTA drives cp.async.bulk copies (the TMA unit) of
 *           16 KiB pieces from the peer's buffer into shared memory, 4 in
 *           flight, and bulk stores them locally;
 *   ce    - the copy engine (cudaMemcpyPeerAsync), no CTAs;
 * the SM ways on 1..all CTAs, each on idle GPUs and beside a cuBLAS bf16
 * GEMM (8192^3, in a loop on another stream) on both GPUs, launched after
 * the copy so that the copy holds its SMs, as GEMM0 follows the dispatch.
 * GB/s per GPU and direction = bytes / (time of the copy's own events); every
 * copy is checked (destination poisoned first, compared after). Prints a
 * table, writes JSON to $OUT/link_bench.json (or ./link_bench.json).
 * Usage: link_bench [MiB]   (default 64; needs 2 GPUs with peer access)
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_check.h"

#define THREADS 512
#define PULL_UNROLL 12 /* as the layer's dispatch had it up to 510045a (then in src/cuda/layer_kernels.cu) */
#define BULK_PIECE 16384
#define BULK_STAGES 4
#define BUSY_GEMMS 12
#define BUSY_N 8192

enum { WAY_PULL, WAY_PUSH, WAY_BULK, WAY_CE, NWAYS };
static const char *way_name[NWAYS] = {"pull", "push", "bulk", "ce"};

/* dst[i] = src[i] over n 16-byte words, PULL_UNROLL loads in flight a thread */
__global__ void __launch_bounds__(THREADS, 1) k_copy(uint4 *dst, const uint4 *src, size_t n) {
    const size_t stride = (size_t)gridDim.x * THREADS * PULL_UNROLL;
    for (size_t base = (size_t)blockIdx.x * THREADS * PULL_UNROLL; base < n; base += stride) {
        uint4 v[PULL_UNROLL];
#pragma unroll
        for (int u = 0; u < PULL_UNROLL; u++) {
            const size_t i = base + (size_t)u * THREADS + threadIdx.x;
            if (i < n) v[u] = src[i];
        }
#pragma unroll
        for (int u = 0; u < PULL_UNROLL; u++) {
            const size_t i = base + (size_t)u * THREADS + threadIdx.x;
            if (i < n) dst[i] = v[u];
        }
    }
}

__device__ static inline uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* Pieces blockIdx.x, +gridDim.x, ... of BULK_PIECE bytes (n a multiple):
 * thread 0 keeps BULK_STAGES bulk loads from src in flight into shared
 * memory and bulk-stores each completed piece to dst. */
__global__ void __launch_bounds__(32, 1) k_bulk(char *dst, const char *src, size_t n) {
    extern __shared__ __align__(128) char buf[];
    __shared__ __align__(8) uint64_t full[BULK_STAGES];
    if (threadIdx.x != 0) return;
    const size_t pieces = n / BULK_PIECE;
    for (int s = 0; s < BULK_STAGES; s++)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    uint32_t phase[BULK_STAGES] = {0};
    size_t issued = blockIdx.x, done = blockIdx.x;
    for (int s = 0; s < BULK_STAGES && issued < pieces; s++, issued += gridDim.x) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&full[s])), "r"(BULK_PIECE));
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         smem_u32(buf + s * BULK_PIECE)),
                     "l"(src + issued * BULK_PIECE), "r"(BULK_PIECE), "r"(smem_u32(&full[s]))
                     : "memory");
    }
    for (int s = 0; done < pieces; s = (s + 1) % BULK_STAGES, done += gridDim.x) {
        uint32_t ok = 0;
        while (!ok)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(ok)
                         : "r"(smem_u32(&full[s])), "r"(phase[s])
                         : "memory");
        phase[s] ^= 1;
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + done * BULK_PIECE),
                     "r"(smem_u32(buf + s * BULK_PIECE)), "r"(BULK_PIECE)
                     : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (issued < pieces) { /* the stage is free again once its store has read it */
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&full[s])),
                         "r"(BULK_PIECE));
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                             smem_u32(buf + s * BULK_PIECE)),
                         "l"(src + issued * BULK_PIECE), "r"(BULK_PIECE), "r"(smem_u32(&full[s]))
                         : "memory");
            issued += gridDim.x;
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void k_fill(uint32_t *p, size_t n, uint32_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = (uint32_t)i * 2654435761u ^ seed;
}

/* bf16 pairs in [1, 2) with random mantissas (finite; not zeros, which draw less power) */
__global__ void k_fill_bf16(uint32_t *p, size_t n, uint32_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = (((uint32_t)i * 2654435761u ^ seed) & 0x007f007fu) | 0x3f803f80u;
}

__global__ void k_diff(const uint32_t *a, const uint32_t *b, size_t n, unsigned long long *bad) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        if (a[i] != b[i]) atomicAdd(bad, 1ull);
}

typedef struct {
    cudaStream_t copy, busy;
    cudaEvent_t e0, e1;
    cublasHandle_t blas;
    void *src, *dst, *ga, *gb, *gc; /* src: what the peer reads or this GPU pushes; dst: where it lands */
    unsigned long long *bad;
} gpu_t;

static gpu_t g[2];
static size_t bytes;

/* n cuBLAS GEMMs (BUSY_N^3, bf16, fp32 accumulation) on GPU d's busy stream */
static void busy_gemms(int d, int n) {
    const float one = 1.0f, zero = 0.0f;
    for (int i = 0; i < n; i++)
        CKB(cublasGemmEx(g[d].blas, CUBLAS_OP_T, CUBLAS_OP_N, BUSY_N, BUSY_N, BUSY_N, &one, g[d].ga, CUDA_R_16BF, BUSY_N,
                         g[d].gb, CUDA_R_16BF, BUSY_N, &zero, g[d].gc, CUDA_R_16BF, BUSY_N, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT));
}

/* One measurement: both GPUs move `bytes` to each other by `way` on `ctas`
 * CTAs, optionally beside BUSY_GEMMS cuBLAS GEMMs; returns the slower GPU's
 * GB/s, or -1 when a copy came out wrong. */
static double measure(int way, int ctas, int busy) {
    for (int d = 0; d < 2; d++) {
        CK(cudaSetDevice(d));
        CK(cudaMemsetAsync(g[d].dst, 0xa5, bytes, g[d].copy));
        CK(cudaStreamSynchronize(g[d].copy));
    }
    for (int d = 0; d < 2; d++) {
        const int p = 1 - d;
        CK(cudaSetDevice(d));
        CK(cudaEventRecord(g[d].e0, g[d].copy));
        /* pull and bulk and ce: d reads p's src into its own dst; push: d writes its src into p's dst */
        if (way == WAY_PULL) k_copy<<<ctas, THREADS, 0, g[d].copy>>>((uint4 *)g[d].dst, (const uint4 *)g[p].src, bytes / 16);
        if (way == WAY_PUSH) k_copy<<<ctas, THREADS, 0, g[d].copy>>>((uint4 *)g[p].dst, (const uint4 *)g[d].src, bytes / 16);
        if (way == WAY_BULK)
            k_bulk<<<ctas, 32, BULK_STAGES * BULK_PIECE, g[d].copy>>>((char *)g[d].dst, (const char *)g[p].src, bytes);
        if (way == WAY_CE) CK(cudaMemcpyPeerAsync(g[d].dst, d, g[p].src, p, bytes, g[d].copy));
        CK(cudaGetLastError());
        CK(cudaEventRecord(g[d].e1, g[d].copy));
    }
    for (int d = 0; busy && d < 2; d++) { /* after both copies, so that they start together */
        CK(cudaSetDevice(d));
        busy_gemms(d, BUSY_GEMMS);
    }
    double worst = 1e30;
    for (int d = 0; d < 2; d++) {
        CK(cudaSetDevice(d));
        CK(cudaDeviceSynchronize());
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, g[d].e0, g[d].e1));
        const double gbps = (double)bytes / (ms * 1e-3) / 1e9;
        if (gbps < worst) worst = gbps;
    }
    /* check: every dst equals the src it was copied from */
    for (int d = 0; d < 2; d++) {
        const int p = 1 - d;
        const int reader = way == WAY_PUSH ? p : d; /* whose dst received d's or p's src */
        const int writer_src = way == WAY_PUSH ? d : p;
        CK(cudaSetDevice(reader));
        CK(cudaMemset(g[reader].bad, 0, 8));
        k_diff<<<512, 256>>>((const uint32_t *)g[reader].dst, (const uint32_t *)g[writer_src].src, bytes / 4, g[reader].bad);
        unsigned long long bad = 0;
        CK(cudaMemcpy(&bad, g[reader].bad, 8, cudaMemcpyDeviceToHost));
        if (bad) {
            fprintf(stderr, "link_bench: %s on %d CTAs: %llu words wrong on GPU %d\n", way_name[way], ctas, bad, reader);
            return -1;
        }
    }
    return worst;
}

int main(int argc, char **argv) {
    const long mib = argc > 1 ? atol(argv[1]) : 64;
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2 || mib < 1) {
        printf("link_bench: skipped (needs 2 GPUs and MiB >= 1; found %d GPUs)\n", n);
        return 0;
    }
    bytes = (size_t)mib << 20;
    int sms = 0, can = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaDeviceCanAccessPeer(&can, 0, 1));
    if (!can) {
        printf("link_bench: skipped (GPUs 0 and 1 have no peer access)\n");
        return 0;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const size_t gm = (size_t)BUSY_N * BUSY_N * 2;
    for (int d = 0; d < 2; d++) {
        CK(cudaSetDevice(d));
        CK(cudaDeviceEnablePeerAccess(1 - d, 0));
        CK(cudaStreamCreateWithFlags(&g[d].copy, cudaStreamNonBlocking));
        CK(cudaStreamCreateWithFlags(&g[d].busy, cudaStreamNonBlocking));
        CK(cudaEventCreate(&g[d].e0));
        CK(cudaEventCreate(&g[d].e1));
        CKB(cublasCreate(&g[d].blas));
        CKB(cublasSetStream(g[d].blas, g[d].busy));
        CK(cudaMalloc(&g[d].src, bytes));
        CK(cudaMalloc(&g[d].dst, bytes));
        CK(cudaMalloc(&g[d].ga, gm));
        CK(cudaMalloc(&g[d].gb, gm));
        CK(cudaMalloc(&g[d].gc, gm));
        CK(cudaMalloc(&g[d].bad, 8));
        k_fill<<<1024, 256>>>((uint32_t *)g[d].src, bytes / 4, 0x9e3779b9u * (d + 1));
        k_fill_bf16<<<1024, 256>>>((uint32_t *)g[d].ga, gm / 4, 0x3c003c00u);
        k_fill_bf16<<<1024, 256>>>((uint32_t *)g[d].gb, gm / 4, 0x3c003c01u);
        CK(cudaFuncSetAttribute(k_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, BULK_STAGES * BULK_PIECE));
        busy_gemms(d, 1); /* cuBLAS's first-call set-up, out of the timed rows */
        CK(cudaDeviceSynchronize());
    }
    int ctas[] = {1, 4, 8, 16, 32, 64, sms};
    const int nc = sizeof ctas / sizeof ctas[0];
    const char *out = getenv("OUT");
    char path[4096];
    snprintf(path, sizeof path, "%s/link_bench.json", out ? out : ".");
    FILE *js = fopen(path, "w");
    if (js) fprintf(js, "{\"device\": \"%s\", \"sms\": %d, \"mib\": %ld, \"rows\": [\n", prop.name, sms, mib);
    printf("link_bench: %s x2, %ld MiB each way at once, GB/s per GPU and direction (slower GPU)\n", prop.name, mib);
    printf("%-5s %6s %10s %12s\n", "way", "CTAs", "idle", "beside GEMM");
    int first = 1, wrong = 0;
    for (int way = 0; way < NWAYS; way++)
        for (int i = 0; i < nc; i++) {
            if (way == WAY_CE && i > 0) break; /* no CTAs */
            const int c = way == WAY_CE ? 0 : ctas[i];
            measure(way, c ? c : 1, 0); /* warm-up */
            const double idle = measure(way, c ? c : 1, 0), busy = measure(way, c ? c : 1, 1);
            wrong |= idle < 0 || busy < 0;
            printf("%-5s %6d %10.1f %12.1f\n", way_name[way], c, idle, busy);
            if (js) {
                fprintf(js, "%s  {\"way\": \"%s\", \"ctas\": %d, \"idle_gbps\": %.1f, \"busy_gbps\": %.1f}", first ? "" : ",\n",
                        way_name[way], c, idle, busy);
                first = 0;
            }
        }
    if (js) {
        fprintf(js, "\n]}\n");
        fclose(js);
        printf("wrote %s\n", path);
    }
    if (wrong) fprintf(stderr, "link_bench: some copies came out wrong (rows with -1.0)\n");
    return wrong;
}
