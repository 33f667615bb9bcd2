/*
 * gemm_wgrad.cu - comet's Hopper (sm_90a) k-grouped weight-gradient GEMM
 * (API and semantics in gemm_wgrad.h): C_e = sum over expert e's rows of
 * a[r]^T b[r], the rows counted by the device-resident plan.
 *
 * Kernels (comet_wgrad_bf16_kernel, comet_wgrad_f32_kernel,
 * comet_wgrad_f32_add_kernel: one body, the output mode a literal in each):
 * persistent CTAs of 384 threads, one per SM, striding over the tiles
 * (expert, 128-row m tile, 256-column n tile) in a fixed order. Warpgroup 0
 * is the producer (setmaxnreg 40; one thread issues the TMA loads of each
 * 64-row k slice into a 4-stage ring of 48 KiB stages on mbarriers: a as two
 * boxes of 64 m columns x 64 rows, b as four boxes of 64 n columns x 64
 * rows, 128B-swizzled); warpgroups 1 and 2 are consumers (setmaxnreg 232),
 * each computing 64 m rows x 256 n columns with wgmma m64n256k16, both
 * operands MN-major from shared memory (the transpose bits set), one k slice
 * of wgmma in flight. Epilogue (wg_store_tma): bf16 (RNE) and fp32 += are
 * staged in a 16 KiB swizzled buffer per consumer and sent by the TMA (a
 * tensor store, or a tensor reduce-add: one fp32 add per element, done in
 * L2), so the SM goes on with the next tile; fp32 written is stored from
 * registers (wg_store), masked to m and n.
 *
 * MN-major 128B-swizzled operands (wg_desc): a TMA box row is 64 elements of
 * the m (or n) dimension, 128 bytes, one box row per k row, 8 k rows a
 * 1024-byte swizzle atom. The descriptor's stride byte offset (SBO) is the
 * step between groups of 8 k rows (1024), its leading byte offset (LBO) the
 * step between 64-element groups of the m (n) dimension: the next box, 8 KiB
 * further. A k step of 16 rows moves the start address by 2 KiB.
 *
 * Padding rows: a k slice reads 64 rows from the expert's first row on, so
 * only an expert's last slice can hold rows past its count (never past the
 * expert's padded span when tile_m is a multiple of 64; past it, the next
 * expert's rows or the tensor map's zeros, masked the same way). Before the
 * tensor cores read that slice, each consumer zeroes its rows past the count
 * in its own a box and in half of the b boxes (generic stores, then
 * fence.proxy.async and a barrier of both consumers), so they add exact
 * zeros whatever they held (NaN too).
 * Tiles: expert major; inside an expert, groups of m tiles (as many as keep
 * the group's a rows within 16 MiB of L2: all of them for ~2000 rows and
 * m <= 4096) walked n tile by n tile, so the CTAs running together share b
 * columns and a rows in L2.
 * Not here: a split over K (the reduction is one CTA's, in row order: the
 * output bits do not depend on the grid), the layer's use (backward chain).
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_wgrad.h"
#include "tma.h"

#define WG_BM 128
#define WG_BN 256
#define WG_BK 64
#define WG_STAGES 4
#define WG_BOX_BYTES (64 * WG_BK * 2)              /* 8 KiB: 64 m (n) columns x 64 rows */
#define WG_A_BYTES (2 * WG_BOX_BYTES)              /* 16 KiB */
#define WG_STAGE_BYTES (WG_A_BYTES + 4 * WG_BOX_BYTES) /* 48 KiB */
#define WG_CBUF_BYTES (2 * 64 * 128)               /* 16 KiB: one consumer's epilogue staging (wg_store_tma) */
#define WG_INFO_INTS 4                             /* per stage: expert (-1: end), m tile, n tile, nk */
#define WG_SMEM_BYTES                                                                                             \
    (WG_STAGES * WG_STAGE_BYTES + 2 * WG_CBUF_BYTES + 1024 + 2 * WG_STAGES * 8 + WG_STAGES * WG_INFO_INTS * 4)
#define WG_L2_GROUP_BYTES ((int64_t)16 << 20)

/* Everything but the tensor maps, passed by value. */
typedef struct {
    int m, n;     /* output rows and columns per expert */
    int mt, nt;   /* m tiles (128 rows), n tiles (256 columns) */
    int ntiles;   /* experts * mt * nt */
    const int32_t *expert_start, *expert_count;
    void *c;
    const uint32_t *skip;
} wg_params_t;

struct comet_wgrad {
    comet_wgrad_args_t args;
    CUtensorMap ta, tb; /* a and b, boxes of 64 columns x 64 rows */
    CUtensorMap tc;     /* bf16 and fp32 +=: c as (experts, m, n), boxes of 1 x 64 rows x 128 bytes (wg_map_c) */
    wg_params_t p;
    int num_sms;
};

/* ---------------------------------------------------------------------------
 * Device helpers
 * ------------------------------------------------------------------------- */

__device__ __forceinline__ void wg_named_bar(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
#define WG_WAIT(n) asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(n) : "memory")
/* keep the compiler from moving accumulator accesses across wgmma waits */
__device__ __forceinline__ void wg_reg_fence(float *d) {
#pragma unroll
    for (int i = 0; i < 128; i++) asm volatile("" : "+f"(d[i])::"memory");
}
/* MN-major, 128B-swizzled descriptor (see the top of the file): LBO 8 KiB
 * (next 64-element group of m or n: the next box), SBO 1024 (next 8 k rows),
 * base 1024-aligned. */
__device__ __forceinline__ uint64_t wg_desc(const void *p) {
    const uint64_t a = gm_smem(p);
    return ((a & 0x3FFFF) >> 4) | ((uint64_t)(WG_BOX_BYTES >> 4) << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}
/* two fp32 -> bf16x2 (lo in the low half), round to nearest even */
__device__ __forceinline__ uint32_t wg_pack(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

/* wgmma m64n256k16, bf16 x bf16 -> fp32, A (64 m x 16 k) and B (16 k x 256 n)
 * both MN-major in shared memory (transpose bits 1, 1); scale_d == 0
 * overwrites d. */
__device__ __forceinline__ void wg_wgmma(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

/* Tile t -> expert, m tile, n tile. Inside an expert, groups of g m tiles
 * (the most whose a rows, g x 128 x rows x 2 bytes, fit WG_L2_GROUP_BYTES)
 * are walked n tile by n tile. Producer and consumers decode alike. */
__device__ __forceinline__ void wg_decode(const wg_params_t &p, int t, int *e, int *mi, int *ni) {
    const int per = p.mt * p.nt;
    *e = t / per;
    const int r = t - *e * per;
    const int64_t rows = p.expert_count[*e] > 0 ? p.expert_count[*e] : 1;
    int64_t g = WG_L2_GROUP_BYTES / (rows * WG_BM * 2);
    g = g < 1 ? 1 : g > p.mt ? p.mt : g;
    const int gi = r / ((int)g * p.nt), first = gi * (int)g;
    const int gs = p.mt - first < (int)g ? p.mt - first : (int)g;
    const int rr = r - first * p.nt;
    *mi = first + rr % gs;
    *ni = rr / gs;
}

/* A consumer's k loop over the nk slices of one tile (from ring position it;
 * returns the position after it), one wgmma group in flight. The last slice,
 * when it holds rows past the expert's count (last < WG_BK valid rows), has
 * those rows zeroed first: this consumer's a box and b boxes 2c, 2c + 1. */
__device__ __forceinline__ int wg_kloop(float *d, unsigned char *base, uint64_t *full, uint64_t *empty, int it, int nk,
                                        int last, int c, int tid) {
    const int lane = tid & 31;
    for (int k = 0; k < nk; k++, it++) {
        const int s = it % WG_STAGES, ph = (it / WG_STAGES) & 1;
        if (k > 0) gm_mbar_wait(&full[s], ph);
        unsigned char *sa = base + s * WG_STAGE_BYTES + c * WG_BOX_BYTES;
        unsigned char *sb = base + s * WG_STAGE_BYTES + WG_A_BYTES;
        if (k == nk - 1 && last < WG_BK) {
            const int n16 = (WG_BK - last) * 8; /* 16-byte chunks past the count in one box */
            const uint4 z = make_uint4(0u, 0u, 0u, 0u);
            for (int i = tid; i < n16; i += 128) {
                *(uint4 *)(sa + last * 128 + i * 16) = z;
                *(uint4 *)(sb + (2 * c) * WG_BOX_BYTES + last * 128 + i * 16) = z;
                *(uint4 *)(sb + (2 * c + 1) * WG_BOX_BYTES + last * 128 + i * 16) = z;
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            wg_named_bar(1, 256);
        }
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < WG_BK / 16; kk++)
            wg_wgmma(d, wg_desc(sa + kk * 2048), wg_desc(sb + kk * 2048), (k > 0 || kk > 0) ? 1 : 0);
        wg_commit();
        WG_WAIT(1);
        wg_reg_fence(d);
        if (k > 0 && lane == 0) gm_mbar_arrive(&empty[(it - 1) % WG_STAGES]);
    }
    return it;
}

/* COMET_WGRAD_F32's epilogue, one consumer: its 64 rows x 256 columns
 * (accumulator layout of wgmma m64nNk16: warp w, lane l hold rows 16w + l/4
 * and + 8, columns 8j + 2(l%4) and + 1) stored into c_e from registers (each
 * quad of lanes writes a whole 32-byte sector), masked to m and n. zero: the
 * expert has no rows, the sum is 0. */
__device__ __forceinline__ void wg_store(const float *d, const wg_params_t &p, int e, int mi, int ni, int c, int tid,
                                         int zero) {
    const int lane = tid & 31, w = tid >> 5;
    const int row = mi * WG_BM + c * 64 + w * 16 + (lane >> 2);
    const int col0 = ni * WG_BN + 2 * (lane & 3);
    const int ok0 = row < p.m, ok1 = row + 8 < p.m;
    const int64_t i0 = ((int64_t)e * p.m + row) * p.n + col0, i1 = i0 + (int64_t)8 * p.n;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        if (col0 + 8 * j >= p.n) break;
        const float x0 = zero ? 0.f : d[4 * j], y0 = zero ? 0.f : d[4 * j + 1];
        const float x1 = zero ? 0.f : d[4 * j + 2], y1 = zero ? 0.f : d[4 * j + 3];
        float2 *o = (float2 *)p.c;
        if (ok0) o[(i0 + 8 * j) >> 1] = make_float2(x0, y0);
        if (ok1) o[(i1 + 8 * j) >> 1] = make_float2(x1, y1);
    }
}

/* The TMA epilogue (COMET_WGRAD_BF16 and COMET_WGRAD_F32_ADD): one
 * consumer's 64 rows x 256 columns staged in cbuf (16 KiB: two 128B-swizzled
 * boxes of 64 rows x 128 bytes) a chunk at a time, 128 bf16 or 64 fp32
 * columns, and sent by the TMA: bf16 stored (cp.async.bulk.tensor), fp32
 * added (cp.reduce.async.bulk.tensor .add: one fp32 add per element in L2).
 * The SM is free for the next tile as soon as the chunks are staged (the
 * register stores and, for +=, the loads of c were exposed in every tile).
 * The tensor map (3D: n, m, experts) clips rows past m and columns past n.
 * Before a chunk overwrites cbuf, the previous chunk's TMA has read it.
 * zero: the expert has no rows (bf16: zeros written; += never gets here). */
__device__ __forceinline__ void wg_store_tma(const float *d, const CUtensorMap &tc, unsigned char *cbuf, int e, int mi,
                                             int ni, int m, int n, int c, int tid, int zero, const int mode) {
    const int lane = tid & 31, r0 = (tid >> 5) * 16 + (lane >> 2), row_g = mi * WG_BM + c * 64;
    if (row_g >= m) return; /* the same for the whole consumer: its named barrier stays matched */
    const uint32_t cb = gm_smem(cbuf);
    const int cols = mode == COMET_WGRAD_BF16 ? 128 : 64; /* columns a chunk: two boxes of 128 bytes a row */
#pragma unroll
    for (int h = 0; h < WG_BN / cols; h++) {
        const int col_g = ni * WG_BN + cols * h;
        if (col_g >= n) break;
        if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); /* cbuf free again */
        wg_named_bar(2 + c, 128);
#pragma unroll
        for (int jj = 0; jj < cols / 8; jj++) {
            const int j = cols / 8 * h + jj, cc = 8 * jj + 2 * (lane & 3); /* column in the chunk */
            const int box = cc / (cols / 2), byte = (cc % (cols / 2)) * (mode == COMET_WGRAD_BF16 ? 2 : 4);
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const int r = r0 + 8 * half;
                const uint32_t addr = cb + box * 8192 + r * 128 + (((byte >> 4) ^ (r & 7)) << 4) + (byte & 15);
                const float x = zero ? 0.f : d[4 * j + 2 * half], y = zero ? 0.f : d[4 * j + 2 * half + 1];
                if (mode == COMET_WGRAD_BF16)
                    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(wg_pack(x, y)) : "memory");
                else
                    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y) : "memory");
            }
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        wg_named_bar(2 + c, 128);
        if (tid == 0) {
            for (int b = 0; b < 2 && col_g + cols / 2 * b < n; b++) {
                if (mode == COMET_WGRAD_BF16)
                    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"(
                                     (uint64_t)&tc),
                                 "r"(col_g + cols / 2 * b), "r"(row_g), "r"(e), "r"(cb + b * 8192)
                                 : "memory");
                else
                    asm volatile(
                        "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"(
                            (uint64_t)&tc),
                        "r"(col_g + cols / 2 * b), "r"(row_g), "r"(e), "r"(cb + b * 8192)
                        : "memory");
            }
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
    }
}

/* The kernel body; `mode` is a literal in each kernel below. */
__device__ __forceinline__ void wg_body(const CUtensorMap &ta, const CUtensorMap &tb, const CUtensorMap &tc,
                                        const wg_params_t &p, const int mode) {
    if (p.skip && *p.skip) return;
    extern __shared__ __align__(1024) unsigned char wg_smem_raw[];
    unsigned char *base = (unsigned char *)(((uintptr_t)wg_smem_raw + 1023) & ~(uintptr_t)1023);
    unsigned char *cbufs = base + WG_STAGES * WG_STAGE_BYTES;
    uint64_t *full = (uint64_t *)(cbufs + 2 * WG_CBUF_BYTES);
    uint64_t *empty = full + WG_STAGES;
    volatile int32_t *info = (volatile int32_t *)(empty + WG_STAGES); /* [stage][WG_INFO_INTS] */
    const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;

    if (threadIdx.x == 0) {
        for (int s = 0; s < WG_STAGES; s++) {
            gm_mbar_init(&full[s], 1);
            gm_mbar_init(&empty[s], 8); /* lane 0 of each consumer warp */
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 0) {
            int it = 0;
            for (int t = blockIdx.x; t < p.ntiles; t += gridDim.x) {
                int e, mi, ni;
                wg_decode(p, t, &e, &mi, &ni);
                const int row0 = p.expert_start[e], cnt = p.expert_count[e];
                const int nk = cnt > 0 ? (cnt + WG_BK - 1) / WG_BK : 0;
                const int m0 = mi * WG_BM, n0 = ni * WG_BN;
                /* boxes wholly past m or n are not loaded (their stale rows feed masked outputs only) */
                const int na = m0 + 64 < p.m ? 2 : 1, nb = (p.n - n0 + 63) / 64 < 4 ? (p.n - n0 + 63) / 64 : 4;
                for (int k = 0; k < (nk > 0 ? nk : 1); k++, it++) {
                    const int s = it % WG_STAGES, ph = (it / WG_STAGES) & 1;
                    gm_mbar_wait(&empty[s], ph ^ 1);
                    if (k == 0) { /* published by the arrive below (release.cta) */
                        info[s * WG_INFO_INTS + 0] = e;
                        info[s * WG_INFO_INTS + 1] = mi;
                        info[s * WG_INFO_INTS + 2] = ni;
                        info[s * WG_INFO_INTS + 3] = nk;
                    }
                    if (nk == 0) { /* an expert without rows: the tile alone, no bytes */
                        gm_mbar_arrive(&full[s]);
                        continue;
                    }
                    unsigned char *st = base + s * WG_STAGE_BYTES;
                    const int r = row0 + k * WG_BK;
                    gm_mbar_expect_tx(&full[s], (uint32_t)((na + nb) * WG_BOX_BYTES));
                    for (int i = 0; i < na; i++) gm_tma_load(st + i * WG_BOX_BYTES, &ta, m0 + 64 * i, r, &full[s]);
                    for (int j = 0; j < nb; j++)
                        gm_tma_load(st + WG_A_BYTES + j * WG_BOX_BYTES, &tb, n0 + 64 * j, r, &full[s]);
                }
            }
            /* the end: a stage with expert -1 and no bytes */
            const int s = it % WG_STAGES, ph = (it / WG_STAGES) & 1;
            gm_mbar_wait(&empty[s], ph ^ 1);
            info[s * WG_INFO_INTS + 0] = -1;
            gm_mbar_arrive(&full[s]);
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        const int c = wg - 1, lane = tid & 31;
        float d[128];
#pragma unroll
        for (int i = 0; i < 128; i++) d[i] = 0.f;
        int it = 0;
        for (;;) {
            const int s0 = it % WG_STAGES;
            gm_mbar_wait(&full[s0], (it / WG_STAGES) & 1);
            const int e = info[s0 * WG_INFO_INTS + 0];
            if (e < 0) break;
            const int mi = info[s0 * WG_INFO_INTS + 1], ni = info[s0 * WG_INFO_INTS + 2];
            const int nk = info[s0 * WG_INFO_INTS + 3];
            if (nk > 0) {
                const int last = p.expert_count[e] - (nk - 1) * WG_BK; /* valid rows of the last slice */
                it = wg_kloop(d, base, full, empty, it, nk, last, c, tid);
                WG_WAIT(0);
                wg_reg_fence(d);
            } else {
                it++;
            }
            if (lane == 0) gm_mbar_arrive(&empty[(it - 1) % WG_STAGES]);
            if (mode == COMET_WGRAD_F32)
                wg_store(d, p, e, mi, ni, c, tid, nk == 0);
            else if (nk > 0 || mode == COMET_WGRAD_BF16) /* += of an expert without rows: c_e left as it is */
                wg_store_tma(d, tc, cbufs + c * WG_CBUF_BYTES, e, mi, ni, p.m, p.n, c, tid, nk == 0, mode);
        }
        if (mode != COMET_WGRAD_F32 && tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); /* before smem goes */
    }
}

#define WG_KERNEL(name, mode)                                                                               \
    __global__ void __launch_bounds__(384, 1) name(const __grid_constant__ CUtensorMap ta,                 \
                                                   const __grid_constant__ CUtensorMap tb,                 \
                                                   const __grid_constant__ CUtensorMap tc,                 \
                                                   const __grid_constant__ wg_params_t p) {                \
        wg_body(ta, tb, tc, p, mode);                                                                       \
    }
WG_KERNEL(comet_wgrad_bf16_kernel, COMET_WGRAD_BF16)
WG_KERNEL(comet_wgrad_f32_kernel, COMET_WGRAD_F32)
WG_KERNEL(comet_wgrad_f32_add_kernel, COMET_WGRAD_F32_ADD)
#undef WG_KERNEL

static const void *const wg_kernels[3] = {(const void *)comet_wgrad_bf16_kernel, (const void *)comet_wgrad_f32_kernel,
                                          (const void *)comet_wgrad_f32_add_kernel};

/* ---------------------------------------------------------------------------
 * Host side
 * ------------------------------------------------------------------------- */

/* c as a 3D tensor (n, m, experts) of bf16 or fp32 (elem bytes), boxes of
 * 128 bytes of columns x 64 rows x 1 expert, 128B swizzle (wg_store_tma). */
static int wg_map_c(CUtensorMap *map, void *c, int64_t experts, int64_t m, int64_t n, int elem) {
    gm_encode_fn enc = gm_get_encode();
    if (!enc) return -1;
    cuuint64_t dims[3] = {(cuuint64_t)n, (cuuint64_t)m, (cuuint64_t)experts};
    cuuint64_t strides[2] = {(cuuint64_t)n * elem, (cuuint64_t)(m * n) * elem};
    cuuint32_t box[3] = {(cuuint32_t)(128 / elem), 64, 1};
    cuuint32_t es[3] = {1, 1, 1};
    CUresult r = enc(map, elem == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, c, dims,
                     strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? 0 : -1;
}

extern "C" const char *comet_wgrad_check(int64_t m, int64_t n) {
    if (m <= 0 || n <= 0) return "the weight-gradient GEMM needs m > 0 and n > 0";
    if (m % 8 || n % 8) return "the weight-gradient GEMM needs m % 8 == 0 and n % 8 == 0 (16-byte rows)";
    if (m >= ((int64_t)1 << 24) || n >= ((int64_t)1 << 24)) return "the weight-gradient GEMM needs m, n below 2^24";
    return NULL;
}

extern "C" int comet_wgrad_prepare(const comet_wgrad_args_t *args, comet_wgrad_t **out, char *err, size_t err_len) {
    *out = NULL;
    const comet_dims_t *d = &args->d;
    const char *why = comet_wgrad_check(args->m, args->n);
    if (!why && (d->experts_local <= 0 || d->max_rows_padded <= 0 || d->max_rows_padded >= ((int64_t)1 << 31)))
        why = "the weight-gradient GEMM needs experts_local > 0 and 0 < max_rows_padded < 2^31";
    const int64_t mt = (args->m + WG_BM - 1) / WG_BM, nt = (args->n + WG_BN - 1) / WG_BN;
    if (!why && d->experts_local * mt * nt >= ((int64_t)1 << 31)) why = "the weight-gradient GEMM needs fewer than 2^31 tiles";
    if (!why && (args->out < COMET_WGRAD_BF16 || args->out > COMET_WGRAD_F32_ADD)) why = "unknown output mode";
    if (why) {
        snprintf(err, err_len, "%s", why);
        return -1;
    }
    if (!gm_get_encode()) {
        snprintf(err, err_len, "cuTensorMapEncodeTiled is not available from the driver");
        return -1;
    }
    comet_wgrad_t *g = (comet_wgrad_t *)aligned_alloc(64, (sizeof(*g) + 63) / 64 * 64); /* CUtensorMap: 64-aligned */
    if (!g) {
        snprintf(err, err_len, "out of host memory");
        return -1;
    }
    memset(g, 0, sizeof(*g));
    g->args = *args;
    if (gm_map(&g->ta, args->a, d->max_rows_padded, args->m, WG_BK, 1) ||
        gm_map(&g->tb, args->b, d->max_rows_padded, args->n, WG_BK, 1)) {
        free(g);
        snprintf(err, err_len, "cuTensorMapEncodeTiled rejected a tensor map (pointers must be 16-byte aligned)");
        return -1;
    }
    if (args->out != COMET_WGRAD_F32 &&
        wg_map_c(&g->tc, args->c, d->experts_local, args->m, args->n, args->out == COMET_WGRAD_BF16 ? 2 : 4)) {
        free(g);
        snprintf(err, err_len, "cuTensorMapEncodeTiled rejected c's tensor map (c must be 16-byte aligned)");
        return -1;
    }
    comet_plan_t plan; /* pointers into the device workspace: nothing is read here */
    comet_plan_carve(d, (void *)args->plan_ws, &plan);
    g->p.m = (int)args->m, g->p.n = (int)args->n, g->p.mt = (int)mt, g->p.nt = (int)nt;
    g->p.ntiles = (int)(d->experts_local * mt * nt);
    g->p.expert_start = plan.expert_start, g->p.expert_count = plan.expert_count;
    g->p.c = args->c;
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    g->num_sms = sms > 0 ? sms : 132;
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < 3 && e == cudaSuccess; i++)
        e = cudaFuncSetAttribute(wg_kernels[i], cudaFuncAttributeMaxDynamicSharedMemorySize, WG_SMEM_BYTES);
    if (e != cudaSuccess) {
        free(g);
        snprintf(err, err_len, "setting up the weight-gradient kernels: %s", cudaGetErrorString(e));
        return -1;
    }
    *out = g;
    return 0;
}

extern "C" void comet_wgrad_destroy(comet_wgrad_t *g) { free(g); }

extern "C" int comet_wgrad_launch(const comet_wgrad_t *g, void *stream, const comet_wgrad_hooks_t *hooks) {
    wg_params_t p = g->p;
    p.skip = hooks ? hooks->skip : NULL;
    int grid = hooks && hooks->num_ctas > 0 ? hooks->num_ctas : g->num_sms;
    if (grid > p.ntiles) grid = p.ntiles;
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDim = dim3((unsigned)grid), cfg.blockDim = dim3(384), cfg.dynamicSmemBytes = WG_SMEM_BYTES;
    cfg.stream = (cudaStream_t)stream;
    cudaError_t e;
    if (g->args.out == COMET_WGRAD_BF16)
        e = cudaLaunchKernelEx(&cfg, comet_wgrad_bf16_kernel, g->ta, g->tb, g->tc, p);
    else if (g->args.out == COMET_WGRAD_F32)
        e = cudaLaunchKernelEx(&cfg, comet_wgrad_f32_kernel, g->ta, g->tb, g->tc, p);
    else
        e = cudaLaunchKernelEx(&cfg, comet_wgrad_f32_add_kernel, g->ta, g->tb, g->tc, p);
    return (int)e;
}
