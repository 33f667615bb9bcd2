/*
 * gather_probe.cu - can GEMM0 read its A tiles straight from the token rows
 * (a gather by the plan's row -> token map) instead of from the rows the
 * dispatch copies? That copy writes topk x every token here (DeepSeek TP2
 * M=16384: 1.9 GB a rank, 0.59 ms; Qwen2 TP2: 0.12 ms of 1.42), and with a
 * gather it would vanish: local tokens read from the stage, remote ones from
 * the copy engine's staging. Two questions, one GPU, seconds:
 *
 * 1. Layout. A GEMM0 A stage is 128 rows x 64 bf16 (16 KiB), 128B-swizzled,
 *    1024-byte aligned, as wgmma reads it. Do 128 one-row TMA loads (box 64
 *    x 1, SWIZZLE_128B) into stage + 128 r give the same bytes as one
 *    128-row box load of the same rows stored contiguously (i.e. is the
 *    swizzle a function of the shared-memory address)? And do 16-byte
 *    cp.async stores with the swizzle done by hand (16-byte chunk c of row r
 *    at r*128 + ((c ^ (r % 8)) * 16))?
 * 2. Rate. A stages per second, one CTA per SM, a 4-stage ring (the
 *    producer waits for a free stage, the consumer only waits and frees):
 *    box TMA of contiguous rows, 128 row-TMAs, cp.async by 128 threads;
 *    rows random from a 16384 x 7168 matrix (L2-cold) and from 256 rows
 *    (L2-hot, as GEMM0's reuse of an A tile across the N tiles).
 *    GEMM0 needs one A stage per 128x256x64 MMA step: at 600 TFLOP/s that is
 *    ~2.3 TB/s of A over 132 SMs (~17.8 GB/s an SM, mostly L2 hits).
 *
 * Build and run: dev/gather/run.sh (prints a table; `gather_probe layout`
 * exits 1 if a layout differs, `gather_probe rate 0|1|2` times one way).
 * Not part of the library; its results go to dev/NOTES.md.
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../src/cuda/tma.h" /* the GEMM's own mbarrier and TMA helpers and tensor maps */

/* Row r (0..127) of a 128-row x 64-column bf16 stage, 128B-swizzled as a box
 * TMA load lays it out (16-byte chunk c at r * 128 + (c ^ (r % 8)) * 16;
 * layout_kernel checks the bytes), from src (the row's first of those 64
 * columns) by eight 16-byte cp.async; chunks at or past `left` columns read
 * nothing and store zeros (left: a multiple of 8). Completion: gm_cp_commit,
 * then gm_cp_wait; the bytes reach wgmma only after gm_fence_smem by the
 * thread that waited (cp.async writes through the generic proxy, wgmma reads
 * through the async one). (These four were in src/cuda/tma.h for GEMM0 by
 * gather until it was removed; its last version is commit 0e55400.) */
__device__ __forceinline__ void gm_cp_row(unsigned char *stage, const uint16_t *src, int r, int left) {
#pragma unroll
    for (int c = 0; c < 8; c++)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(gm_smem(stage + r * 128 + ((c ^ (r & 7)) * 16))),
                     "l"(src + c * 8), "r"(c * 8 < left ? 16 : 0)
                     : "memory");
}
__device__ __forceinline__ void gm_cp_commit(void) { asm volatile("cp.async.commit_group;" ::: "memory"); }
/* All but the n most recent groups of this thread have landed (n: a literal). */
#define gm_cp_wait(n) asm volatile("cp.async.wait_group %0;" ::"n"(n) : "memory")
__device__ __forceinline__ void gm_fence_smem(void) { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(2);                                                                           \
        }                                                                                      \
    } while (0)

#define STAGE_BYTES 16384
#define RING 4
#define K_COLS 7168 /* DeepSeek hidden: the reduction length of GEMM0 */

/* Question 1: the same 128 rows (idx) at column block col, three ways, into out[0..2]. */
__global__ void layout_kernel(const __grid_constant__ CUtensorMap box_map, const __grid_constant__ CUtensorMap row_map,
                              const uint16_t *x, const int32_t *idx, int col, unsigned char *out) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char *s = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    __shared__ uint64_t bar[2];
    const int t = threadIdx.x;
    if (t == 0) {
        gm_mbar_init(&bar[0], 1), gm_mbar_init(&bar[1], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (t == 0) {
        gm_mbar_expect_tx(&bar[0], STAGE_BYTES);
        gm_tma_load(s, &box_map, col, 0, &bar[0]); /* the gathered rows, stored contiguously */
        gm_mbar_expect_tx(&bar[1], STAGE_BYTES);
        for (int r = 0; r < 128; r++) gm_tma_load(s + STAGE_BYTES + r * 128, &row_map, col, idx[r], &bar[1]);
    }
    gm_cp_row(s + 2 * STAGE_BYTES, x + (int64_t)idx[t] * K_COLS + col, t, 64);
    gm_cp_commit();
    asm volatile("cp.async.wait_all;" ::: "memory");
    gm_mbar_wait(&bar[0], 0), gm_mbar_wait(&bar[1], 0);
    __syncthreads();
    for (int i = t; i < 3 * STAGE_BYTES; i += blockDim.x) out[i] = s[i];
}

/* Question 2: `steps` A stages per CTA through a RING-stage ring. mode 0: one
 * box TMA of 128 contiguous rows; 1: 128 row-TMAs of rows idx; 2: cp.async by
 * threads 0..127 (rows idx), as GEMM0's gather producer did it (each row
 * looked up once a row set, arrivals deferred until a group has landed,
 * up to RING - 1 groups in flight). Warp 4 (threads 128..159) consumes. */
__global__ void __launch_bounds__(160, 1) rate_kernel(const __grid_constant__ CUtensorMap box_map,
                                                      const __grid_constant__ CUtensorMap row_map, const uint16_t *x,
                                                      const int32_t *idx, int64_t n_idx, int64_t rows, int steps,
                                                      int mode, int hot, int64_t offset) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char *s = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    __shared__ uint64_t full[RING], empty[RING];
    const int t = threadIdx.x;
    if (t == 0) {
        for (int i = 0; i < RING; i++) gm_mbar_init(&full[i], mode == 2 ? 128 : 1), gm_mbar_init(&empty[i], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int kb = K_COLS / 64;
    if (t < 128) { /* producer */
        if (mode != 2 && t >= 32) return; /* idle producers must not trail the ring: a lap behind, parity aliasing hangs them at the end */
        const uint16_t *src = x;
        int pend = 0;
        for (int i = 0; i < steps; i++) {
            const int st = i % RING, lap = i / RING;
            if (lap > 0) gm_mbar_wait(&empty[st], (lap - 1) & 1);
            unsigned char *dst = s + st * STAGE_BYTES;
            const int64_t step = offset + (int64_t)blockIdx.x * steps + i;
            const int col = (int)(step % kb) * 64;
            const int64_t base = (step / kb * 128) % n_idx; /* 128 rows of idx, a new set every kb steps */
            if (mode == 2) {
                if (i == 0 || col == 0) src = x + (int64_t)idx[base + t] * K_COLS;
                gm_cp_row(dst, src + col, t, 64);
                gm_cp_commit();
                if (++pend == RING - 1) { /* the oldest group landed: its arrival */
                    gm_cp_wait(RING - 2);
                    gm_fence_smem();
                    gm_mbar_arrive(&full[(i + 1 - pend--) % RING]);
                }
            } else if (mode == 0) {
                if (t == 0) {
                    gm_mbar_expect_tx(&full[st], STAGE_BYTES);
                    /* hot: within the first 256 rows, as the row ways' hot set */
                    gm_tma_load(dst, &box_map, col, (int)(hot ? base % 129 : base % (rows - 127)), &full[st]);
                }
            } else if (t < 32) { /* mode 1: warp 0; one coalesced int4 of row ids a lane, before any TMA */
                const int4 r4 = reinterpret_cast<const int4 *>(idx + base)[t];
                if (t == 0) gm_mbar_expect_tx(&full[st], STAGE_BYTES);
                __syncwarp();
                unsigned char *d = dst + t * 4 * 128;
                gm_tma_load(d, &row_map, col, r4.x, &full[st]);
                gm_tma_load(d + 128, &row_map, col, r4.y, &full[st]);
                gm_tma_load(d + 256, &row_map, col, r4.z, &full[st]);
                gm_tma_load(d + 384, &row_map, col, r4.w, &full[st]);
            }
        }
        if (mode == 2) {
            gm_cp_wait(0);
            gm_fence_smem();
            for (; pend > 0; pend--) gm_mbar_arrive(&full[(steps - pend) % RING]);
        }
    } else if (t == 128) { /* consumer: waits, frees */
        for (int i = 0; i < steps; i++) {
            const int st = i % RING;
            gm_mbar_wait(&full[st], (i / RING) & 1);
            gm_mbar_arrive(&empty[st]);
        }
    }
}

/* Map over (rows, K_COLS) bf16, box 64 x box_rows, 128B swizzle (the GEMM's gm_map). */
static CUtensorMap make_map(const void *p, int64_t rows, int box_rows) {
    CUtensorMap m;
    if (gm_map(&m, p, rows, K_COLS, box_rows, 1)) {
        fprintf(stderr, "cuTensorMapEncodeTiled failed (or is not available from the driver)\n");
        exit(2);
    }
    return m;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* one part a process: a fault (a row-TMA the hardware refuses, say) leaves the others to run */
    const int layout = argc > 1 && strcmp(argv[1], "layout") == 0, rate_mode = argc > 2 ? atoi(argv[2]) : -1;
    if (!layout && !(argc > 2 && strcmp(argv[1], "rate") == 0 && rate_mode >= 0 && rate_mode <= 2))
        return fprintf(stderr, "usage: gather_probe layout | gather_probe rate 0|1|2\n"), 2;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int64_t rows = 16384, n_idx = 1 << 19;
    const size_t xbytes = (size_t)rows * K_COLS * 2;
    uint16_t *hx = (uint16_t *)malloc(xbytes);
    int32_t *hidx = (int32_t *)malloc(sizeof(int32_t) * n_idx), *hhot = (int32_t *)malloc(sizeof(int32_t) * n_idx);
    uint64_t z = 88172645463325252ull;
    for (size_t i = 0; i < xbytes / 2; i++) z ^= z << 13, z ^= z >> 7, z ^= z << 17, hx[i] = (uint16_t)(z >> 20);
    for (int64_t i = 0; i < n_idx; i++) {
        z ^= z << 13, z ^= z >> 7, z ^= z << 17;
        hidx[i] = (int32_t)(z % rows), hhot[i] = (int32_t)(z % 256);
    }
    uint16_t *x, *g;
    int32_t *idx, *hot;
    unsigned char *out;
    CK(cudaMalloc(&x, xbytes));
    CK(cudaMalloc(&g, 128 * K_COLS * 2));
    CK(cudaMalloc(&idx, sizeof(int32_t) * n_idx));
    CK(cudaMalloc(&hot, sizeof(int32_t) * n_idx));
    CK(cudaMalloc(&out, 3 * STAGE_BYTES));
    CK(cudaMemcpy(x, hx, xbytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(idx, hidx, sizeof(int32_t) * n_idx, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(hot, hhot, sizeof(int32_t) * n_idx, cudaMemcpyHostToDevice));
    for (int r = 0; r < 128; r++) /* the first 128 rows of idx, stored contiguously */
        CK(cudaMemcpy(g + (size_t)r * K_COLS, x + (size_t)hidx[r] * K_COLS, K_COLS * 2, cudaMemcpyDeviceToDevice));
    const CUtensorMap gmap = make_map(g, 128, 128), xbox = make_map(x, rows, 128),
                      xrow = make_map(x, rows, 1);

    /* 1. layout */
    int bad = 0;
    const size_t lsmem = 3 * STAGE_BYTES + 1024;
    CK(cudaFuncSetAttribute(layout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)lsmem));
    unsigned char *h = (unsigned char *)malloc(3 * STAGE_BYTES);
    for (int col = 0; layout && col < K_COLS; col += 64 * 37) {
        CK(cudaMemset(out, 0xa5, 3 * STAGE_BYTES));
        layout_kernel<<<1, 128, lsmem>>>(gmap, xrow, x, idx, col, out);
        CK(cudaGetLastError());
        CK(cudaMemcpy(h, out, 3 * STAGE_BYTES, cudaMemcpyDeviceToHost));
        const int row_tma = memcmp(h, h + STAGE_BYTES, STAGE_BYTES) == 0, cp = memcmp(h, h + 2 * STAGE_BYTES, STAGE_BYTES) == 0;
        printf("layout, column %5d: row-TMA %s, cp.async with the swizzle by hand %s\n", col,
               row_tma ? "same bytes as the box" : "DIFFERS", cp ? "same bytes" : "DIFFERS");
        bad |= !row_tma || !cp;
    }

    /* 2. rate */
    /* > half of an SM's shared memory: one CTA an SM, as the GEMM */
    const size_t rsmem = 120 * 1024;
    CK(cudaFuncSetAttribute(rate_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)rsmem));
    const int all_steps = 2048; /* a CTA's stages on all SMs (4.4 GB a run); one CTA takes 256 */
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    static const char *const modes[3] = {"box TMA (contiguous rows)", "128 row-TMAs by a warp", "cp.async, 128 threads"};
    if (layout) return bad;
    const int kb = K_COLS / 64, reps = 5;
    if ((int64_t)prop.multiProcessorCount * all_steps / kb * 128 > n_idx) return fprintf(stderr, "idx too short\n"), 2;
    for (int hotset = 0; hotset < 2; hotset++)
        for (int ctas = 1; ctas <= prop.multiProcessorCount; ctas = ctas == 1 ? prop.multiProcessorCount : ctas + 1) {
            const int32_t *rows_of = hotset ? hot : idx;
            const int steps = ctas == 1 ? 256 : all_steps;
            /* warm-up (clocks up) on rows the timed runs do not start with */
            rate_kernel<<<ctas, 160, rsmem>>>(xbox, xrow, x, rows_of, n_idx, rows, 512, rate_mode, hotset,
                                              (int64_t)ctas * steps * reps);
            float ms[reps];
            for (int rep = 0; rep < reps; rep++) {
                CK(cudaEventRecord(e0));
                rate_kernel<<<ctas, 160, rsmem>>>(xbox, xrow, x, rows_of, n_idx, rows, steps, rate_mode, hotset,
                                                  (int64_t)ctas * steps * rep);
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                CK(cudaGetLastError());
                CK(cudaEventElapsedTime(&ms[rep], e0, e1));
            }
            for (int i = 1; i < reps; i++) /* sort: median and best */
                for (int j = i; j > 0 && ms[j] < ms[j - 1]; j--) {
                    const float v = ms[j];
                    ms[j] = ms[j - 1], ms[j - 1] = v;
                }
            const double bytes = (double)ctas * steps * STAGE_BYTES;
            printf("%-28s %-6s %6d %12.1f %14.1f %12.1f\n", modes[rate_mode], hotset ? "hot" : "cold", ctas,
                   bytes / (ms[reps / 2] * 1e6), bytes / (ms[reps / 2] * 1e6) / ctas, bytes / (ms[0] * 1e6));
        }
    return 0;
}
