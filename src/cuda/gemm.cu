/*
 * gemm.cu - comet's Hopper (sm_90a) grouped GEMM for the MoE layer (API and
 * semantics in gemm.h): GEMM0 with the fused activation and GEMM1, driven by
 * the device-resident plan, with the hooks the layer's kernel chain uses; and
 * the backward's data-gradient GEMMs, G with the activation's backward in its
 * epilogue and dX, which read the weights MN-major.
 *
 * Kernels (comet_gemm0_gated_kernel, comet_gemm0_gelu_kernel,
 * comet_gemm1_kernel, comet_gemm_g_gated_kernel, comet_gemm_g_gelu_kernel,
 * comet_gemm_dx_kernel, and the same six as 2-CTA clusters: one body, mode,
 * cluster and B-layout literals in each): persistent CTAs of 384
 * threads, one per SM (~225 KiB shared memory). Warpgroup 0 is the producer
 * (setmaxnreg 40, 48 in clusters; one thread issues TMA loads of 128B-swizzled 64-wide K
 * slices into a 4-stage ring of 48 KiB stages on mbarriers); warpgroups 1 and
 * 2 are consumers (setmaxnreg 232, 224 in clusters), each computing 64 rows x 256 columns with
 * wgmma m64n256k16 and keeping one k-slice of wgmma in flight. Tile = one plan
 * row block (128 rows) x 256 B rows. Epilogue: activation in fp32 in
 * registers, bf16 (RNE, cvt.rn.bf16x2), stmatrix into a swizzled 64x128 buffer per consumer,
 * TMA store (overlaps the next tile); a consumer whose 64 rows are not all
 * valid stores from registers, masked, so padding rows are never written.
 * Gated SiLU: the 256-row B tile is 128 gate rows + the matching 128 up rows
 * (two TMA loads); the accumulator holds gate in columns 0..127 and up in
 * 128..255, the epilogue pairs them into a 128-wide h tile.
 * A last h tile of <= 64 columns (F_local % 128 in 1..64: Qwen2-MoE at TP2,
 * F_local 704) loads 64 gate + 64 up rows (64-row boxes) and runs wgmma
 * m64n128k16 instead (GM_NARROW; the knob narrow = 0 at prepare turns it off):
 * half the tensor work of the full tile, whose other half was masked columns.
 *
 * 2-CTA clusters with B multicast (dev/gemm's v8: +9% over v5 from clusters
 * and the TMA store together) are a second set of kernels, the default since
 * 2026-11-22 (in the layer on 2x H200, M=16384: DeepSeek +0-4%, Phi-3.5
 * +1-2%, Qwen2 +0-1%, Mixtral within drift); the knob cluster = 0 at prepare
 * runs the single-CTA kernels.
 * Tile walk: each CTA's producer (in clusters CTA 0's, for the pair) claims the next tile with an atomic counter
 * (per comet_gemm_t and GEMM, reset by the last claimer) and hands its id to the
 * consumers in shared memory with the stage; the tile count is derived on the
 * device from plan.totals->num_blocks (no host sync). So one comet_gemm_t
 * runs one GEMM0 and one GEMM1 at a time.
 * GEMM1's tail split (gm_split, gm_split_piece): the tiles that would run
 * in a part-empty last wave run as pieces over K instead, summed in piece
 * order by the CTA that completes a tile.
 * dX and G (tb): the same pipeline with B MN-major, W1 (E, w1_rows, H) and W2
 * (E, H, F_local) as stored: a stage's B is four TMA boxes of 64 N columns x
 * 64 K rows (3D maps, so K rows past an expert's read zero), wgmma with the
 * transpose bit (gm_desc_mn). dX is GEMM1's walk with K = w1_rows (no tail
 * split); G is GEMM0's walk over 256-column tiles of F_local. G's epilogue
 * operands come through the ring: after a tile's k-slices the producer
 * fills the next stages with the tile's g, u and h, one 64-column quarter a
 * stage (3 planes x 128 rows x 64 columns x 2 B = 48 KiB, a stage's size),
 * as the last k-slices free them, so their loads run under the main loop's
 * end and under the quarter before; the epilogue (gm_dact_tile) reads them
 * from shared memory, stores dH through the staging buffer, padding rows as
 * zeros, and the row partials of <G, h>.
 * Not here: the SIMT fallback (layer/simt_gemm.cuh) and the layer's other kernels
 * (layer_chain.cu and its rooms in layer/).
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gemm.h"
#include "tma.h"

#define GM_BM 128
#define GM_BN 256
#define GM_BK 64
#define GM_STAGES 4
#define GM_A_BYTES (GM_BM * GM_BK * 2)           /* 16 KiB */
#define GM_B_BYTES (GM_BN * GM_BK * 2)           /* 32 KiB */
#define GM_STAGE_BYTES (GM_A_BYTES + GM_B_BYTES) /* 48 KiB */
#define GM_CBUF_BYTES (64 * 128 * 2)             /* 16 KiB: 64 rows x 128 cols, two 64x64 boxes */
#define GM_G_BOX_BYTES (GM_BM * 64 * 2)          /* 16 KiB: one plane of a G epilogue stage, 128 rows x 64 cols */
/* 2-CTA clusters: slots of CTA 1's claim ring. CTA 0 publishes claim i only
 * after the empty wait for the last stage of claim i-1, which needs CTA 1's
 * consumers to have released the stage GM_STAGES before it, which needs CTA
 * 1's producer to have read the claim holding that stage: so at most
 * GM_STAGES + 1 claims are unread (one stage a tile), and slot i % GM_RING
 * last held a claim already read. A slot's reuse is ordered only by that
 * chain (release.cta arrives plus the data dependency): 3 slots of slack. */
#define GM_RING 8
/* A stage's tile id (stage_tile) with this bit: its block has <= 64 rows (gm_body). */
/* ... with this bit: a gated tile of <= 64 h columns, F_local's last (gm_body). */
#define GM_NARROW (1 << 29)
#define GM_SMEM_BYTES                                                                                             \
    (GM_STAGES * GM_STAGE_BYTES + 2 * GM_CBUF_BYTES + 1024 + (2 * GM_STAGES + GM_RING) * 8 +                        \
     (2 * GM_STAGES + GM_RING + 1) * 4)
/* GEMM1's tail split (gm_split): at most this many pieces a tile, and this
 * many CTA-tile pieces with an fp32 partial (128 x 256, 128 KiB) in one
 * launch: the workspace is GM_SPLIT_PIECES x 128 KiB (16 MiB) after a 1 KiB
 * header of counters (one a split CTA tile, at most GM_SPLIT_PIECES / 2). */
#define GM_SPLIT_MAX 8
#define GM_SPLIT_PIECES 128
#define GM_SPLIT_HEADER 1024
#define GM_SPLIT_WAVES 6 /* longer walks: no split (Mixtral TP2, 8.2 waves, 2 pieces: 3% slower) */
/* Row blocks walked together (L2 reuse of A and B): the largest power of two
 * up to 16 whose A rows (group x 128 x K bf16) fit in 16 MiB, at least 4.
 * Measured on H200 (gemm_bench, dev/NOTES.md): DeepSeek GEMM0 (K = 7168)
 * 472 -> 532 TFLOP/s from 16 to 8 (29 MiB of A rows crowded the B tiles
 * out of L2), 412 at 32; every other shape flat between 4 and 16.
 * the knob group (comet_gemm_knobs_t: N for both GEMMs, or N0,N1) overrides it
 * for measurements. */
static int gm_group_for(int64_t k) {
    int g = 16;
    while (g > 4 && (int64_t)g * GM_BM * k * 2 > ((int64_t)16 << 20)) g /= 2;
    return g;
}

/* GEMM0's two activations, GEMM1 (and dX, the same with B MN-major), and G with the gated or the GELU
 * backward in its epilogue (gm_dact_pass; its tile walk is GEMM0's). */
enum {
    GM_MODE_GATED = 0,
    GM_MODE_GELU = 1,
    GM_MODE_GEMM1 = 2,
    GM_ACT_NARROW = 3, /* gm_act only: a GM_NARROW tile */
    GM_MODE_DGATED = 4,
    GM_MODE_DGELU = 5
};
/* The four launches (gm_launch's `which`, the timeout report's role): GEMM0, GEMM1, G, dX. */
enum { GM_GEMM0 = 0, GM_GEMM1 = 1, GM_G = 2, GM_DX = 3 };

/* Everything but the tensor maps, passed by value. */
typedef struct {
    int mode;
    int role;       /* GM_GEMM0 .. GM_DX (the timeout report) */
    int k;          /* reduction length: H (GEMM0) or F_local (GEMM1) */
    int n;          /* output width and row stride: F_local or H */
    int b_rows;     /* rows of one expert in the stacked B: w1_rows or H */
    int up_off;     /* gated: F_local (row offset of the up half) */
    int tile_cols;  /* output columns per tile: 128 gated, 256 otherwise */
    int chunk_cols; /* GEMM1 chunk width (multiple of 256); GEMM0: n */
    int group;      /* row blocks per group of the tile walk (gm_group_coords) */
    int narrow;     /* gated: a last h tile of <= 64 columns computes those alone (GM_NARROW) */
    int pdl;        /* launched as a programmatic dependent: wait for the primary before exiting */
    int rank;
    const comet_plan_totals_t *totals;
    const comet_plan_block_t *blocks;
    const int32_t *order; /* GEMM0: l0_order (hooks.l0_order) or NULL; GEMM1: NULL (NULL: blocks in expert order) */
    comet_bf16_t *c;      /* output, for the masked register stores */
    const uint64_t *block_ready;
    const uint64_t *epoch; /* device: what block_ready[b] must reach, read at kernel start */
    uint64_t *chunk_done;
    const uint32_t *skip;
    comet_bf16_t *push[COMET_GEMM_MAX_PUSH]; /* GEMM1 with push: destination of rows homed on rank q, or NULL */
    const comet_plan_row_t *rows;            /* plan rows (their home: src_rank), for the push */
    int push_on;
    int64_t push_tp_rows;                    /* d.tp_rank * d.max_tokens: this rank's rows of a receive buffer */
    int push_topk;
    uint64_t timeout_ns;
    uint64_t *timeout_report;
    uint32_t *sched; /* [0] next tile to claim, [1] CTAs past the end; both back to 0 at kernel end */
    int split_min;   /* GEMM1 tail split (gm_split): fewest k-slices a piece may have; 0: no split */
    int split_ref;   /* the split rule's count of workers: num_sms / 2, whatever this launch's grid */
    uint32_t *split_count; /* per split CTA tile: pieces stored (the last one sums them and resets it) */
    float *split_part;     /* [key][piece][consumer][128 accumulators][128 threads] fp32 partials */
    comet_bf16_t *gu;      /* GEMM0: also store the pre-activation here (NULL: not) */
    float *dwp;            /* G: row partials of <G, h>, (max_rows_padded, dwp_tiles) */
    int gu_ld;             /* row length of gu and dH: w1_rows */
    int dwp_tiles;         /* comet_gemm_dwp_tiles */
} gm_params_t;

struct comet_gemm {
    comet_gemm_args_t args;
    CUtensorMap a0, b0, c0; /* GEMM0: a (box 128x64), w1 (box 128 or 256 rows), h store (64x64) */
    CUtensorMap a1, b1, c1; /* GEMM1: h (box 128x64), w2 (box 256 rows), o store (64x64) */
    CUtensorMap b0h, b1h;   /* w1 (GELU) and w2 with 128-row boxes: the halves clusters multicast; gated w1
                             * with 64-row boxes: GM_NARROW's gate and up rows */
    CUtensorMap b2, b3;     /* G's w2 and dX's w1, MN-major (gm_map_mn); the training launches' other maps
                             * are encoded at each launch (comet_gemm_train_t) */
    int num_sms;
    int cluster_ctas;       /* unless knobs.cluster is 0 at prepare: most CTAs that run as 2-CTA clusters at
                             * once (even); 0: no clusters */
    int group[2];    /* knobs.group at prepare (GEMM0, GEMM1), or 0: gm_group_for */
    int narrow;      /* knobs.narrow at prepare (GM_NARROW) */
    uint32_t *sched; /* device, 4 words: GEMM0's and GEMM1's tile counters */
    int own_sched;   /* sched allocated here (args.sched was NULL) */
    void *split;     /* GEMM1 tail split's workspace (args.split, or allocated here), or NULL: no split */
    int own_split;
    int split_min;   /* knobs.split_min at prepare: 0 off, else fewest k-slices a piece */
};

/* ---------------------------------------------------------------------------
 * Device helpers
 * ------------------------------------------------------------------------- */

__device__ __forceinline__ void gm_tma_store(const CUtensorMap *map, const void *src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"((uint64_t)map),
                 "r"(c0), "r"(c1), "r"(gm_smem(src))
                 : "memory");
}
/* 3D forms (coordinates innermost first): gm_map_planes' stores, gm_map_mn's loads (one CTA, or
 * multicast into both CTAs of the cluster, each one's barrier at the same offset). */
__device__ __forceinline__ void gm_tma_store3(const CUtensorMap *map, const void *src, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"((uint64_t)map),
                 "r"(c0), "r"(c1), "r"(c2), "r"(gm_smem(src))
                 : "memory");
}
__device__ __forceinline__ void gm_tma_load3(void *dst, const CUtensorMap *map, int c0, int c1, int c2, uint64_t *bar,
                                             const int mc) {
    if (mc)
        asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                     " [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(gm_smem(dst)),
                     "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(gm_smem(bar)), "h"((uint16_t)3)
                     : "memory");
    else
        asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(gm_smem(dst)),
                     "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(gm_smem(bar))
                     : "memory");
}
__device__ __forceinline__ void gm_named_bar(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void gm_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void gm_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
#define GM_WGMMA_WAIT(n) asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(n) : "memory")
/* keep the compiler from moving accumulator accesses across wgmma waits */
__device__ __forceinline__ void gm_reg_fence(float *d) {
#pragma unroll
    for (int i = 0; i < 128; i++) asm volatile("" : "+f"(d[i])::"memory");
}
/* K-major, 128B-swizzled shared-memory descriptor: 128-byte rows, 8-row atoms
 * of 1024 bytes (SBO 1024), LBO unused (1); bases 1024-aligned, +32 bytes per
 * k step of 16. */
__device__ __forceinline__ uint64_t gm_desc(const void *p) {
    uint64_t a = gm_smem(p), d = 0;
    d |= (a & 0x3FFFF) >> 4;
    d |= (uint64_t)1 << 16;
    d |= (uint64_t)(1024 >> 4) << 32;
    d |= (uint64_t)1 << 62;
    return d;
}
/* MN-major (B with the transpose bit: dX, G), 128B-swizzled: the stage holds four TMA boxes of 64 N
 * columns (128-byte rows) x 64 K rows, 8 KiB apart; within a box, 8-row atoms of 1024 bytes along K
 * (SBO 1024), the next 64 N columns a box further (LBO 8192); +2048 bytes per k step of 16 rows. */
__device__ __forceinline__ uint64_t gm_desc_mn(const void *p) {
    uint64_t a = gm_smem(p), d = 0;
    d |= (a & 0x3FFFF) >> 4;
    d |= (uint64_t)(8192 >> 4) << 16;
    d |= (uint64_t)(1024 >> 4) << 32;
    d |= (uint64_t)1 << 62;
    return d;
}
__device__ __forceinline__ uint64_t gm_globaltimer(void) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ uint64_t gm_ld_acquire_gpu(const uint64_t *p) {
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
/* two fp32 -> bf16x2 (lo in the low half), round to nearest even: for every
 * non-NaN value the same bits as comet_f32_to_bf16 (a NaN stays a NaN). */
__device__ __forceinline__ uint32_t gm_pack(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

/* wgmma m64n256k16, bf16 x bf16 -> fp32, A K-major and B K-major (TB 0) or MN-major (TB 1, the
 * transpose bit) in shared memory (128B-swizzled descriptors); scale_d == 0 overwrites d. */
template <int TB> __device__ __forceinline__ void gm_wgmma_256(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 0, %131;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TB));
}

/* wgmma m64n128k16, the same operands: 64 accumulators. */
__device__ __forceinline__ void gm_wgmma_128(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

/* Timeout of the block_ready wait: record rank, role, tile, block, value and
 * epoch in the report slot (if any; host-mapped memory stays readable after
 * the trap), then trap. No printf: a call anywhere in this kernel makes ptxas
 * serialise every wgmma (C7510), see dev/gemm/NOTES.md. */
__device__ __forceinline__ void gm_timeout(const gm_params_t &p, int t, int b, uint64_t v, uint64_t epoch) {
    if (p.timeout_report) {
        volatile uint64_t *r = p.timeout_report;
        r[1] = (uint64_t)p.rank;
        r[2] = (uint64_t)p.role;
        r[3] = (uint64_t)t;
        r[4] = (uint64_t)b;
        r[5] = v;
        r[6] = epoch;
        r[7] = blockIdx.x;
        __threadfence_system();
        r[0] = 1;
        __threadfence_system();
    }
    __trap();
}

/* A producer's wait for a readiness flag: spin until ld.acquire.gpu(*flag) >=
 * target; a wait past the timeout (p.timeout_ns, 0: 10 s) is recorded
 * (gm_timeout: tile t, block b) and traps. */
__device__ __forceinline__ void gm_wait_ready(const gm_params_t &p, const uint64_t *flag, uint64_t target, int t, int b) {
    const uint64_t start = gm_globaltimer(), limit = p.timeout_ns ? p.timeout_ns : 10000000000ull;
    uint64_t v;
    while ((v = gm_ld_acquire_gpu(flag)) < target) {
        if (gm_globaltimer() - start > limit) gm_timeout(p, t, b, v, target);
        __nanosleep(128);
    }
}

/* Tile t -> (position in the block list, first output column, chunk). Both
 * roles walk the same list. Groups of `group` blocks are walked column tile
 * by column tile, so CTAs running together share A rows and B tiles in L2. */
__device__ __forceinline__ void gm_group_coords(int t, int nb, int tn_count, int group, int *bi, int *tn) {
    const int per_group = group * tn_count, g = t / per_group, first = g * group;
    int gs = nb - first;
    if (gs > group) gs = group;
    const int r = t - g * per_group;
    *bi = first + r % gs;
    *tn = r / gs;
}

/* GEMM1's tail split: the last wave of a walk whose tiles do not fill the
 * GPU evenly (tiles a wave: split_ref, one per 2-CTA cluster) runs part
 * empty; Mixtral's GEMM1 at 2048 tokens a rank (EP2) makes 272 cluster
 * tiles on 66 clusters, and its fifth wave of 8 took a fifth of the GEMM
 * (dev/NOTES.md). So, in walks of at most GM_SPLIT_WAVES waves, the tiles
 * of the last `us` block pairs, the fewest that cover the last wave's
 * tiles, each run as s pieces over consecutive K ranges (s the largest
 * power of two <= GM_SPLIT_MAX that keeps every piece >= split_min
 * k-slices and the pieces within GM_SPLIT_PIECES; no split below 2); each
 * piece stores its fp32 partial, and the piece that completes a tile sums
 * the partials in piece order and stores the tile. Which tiles split, and
 * where their K ranges break, depends only on the block count, the shape and
 * split_ref: not on clusters, the grid (the overlapped mode's is smaller),
 * chunks or push, so every mode computes every output with the same
 * additions and the layer's modes stay bitwise equal. */
typedef struct {
    int b0; /* first split block (even): blocks b0.. split; nb: none */
    int s;  /* pieces a split tile (1: none) */
} gm_split_t;

__device__ __forceinline__ int gm_nk(const gm_params_t &p) { return (p.k + GM_BK - 1) / GM_BK; }

/* The rule, for nb blocks, n output columns, nk k-slices (host and device). */
__host__ __device__ __forceinline__ gm_split_t gm_split_rule(int nb, int n, int nk, int split_min, int split_ref) {
    gm_split_t r = {nb, 1};
    if (!split_min) return r;
    const int tpu = (n + GM_BN - 1) / GM_BN, units = (nb + 1) / 2, rest = units * tpu % split_ref;
    if (rest == 0 || units * tpu > GM_SPLIT_WAVES * split_ref) return r;
    const int us = (rest + tpu - 1) / tpu;
    int s = GM_SPLIT_MAX;
    while (s > 1 && (2 * us * tpu * s > GM_SPLIT_PIECES || nk < s * split_min)) s /= 2;
    if (s > 1) r.b0 = 2 * (units - us), r.s = s;
    return r;
}
__device__ __forceinline__ gm_split_t gm_split(const gm_params_t &p, int nb, const int mode) {
    if (mode != GM_MODE_GEMM1) return gm_split_t{nb, 1};
    return gm_split_rule(nb, p.n, gm_nk(p), p.split_min, p.split_ref);
}

/* The walk's units (row blocks, or pairs of them with clusters): nu in all,
 * the first udp whole tiles, the rest split into sp.s pieces each. */
__device__ __forceinline__ int gm_udp(int nu, int cl, gm_split_t sp) { return sp.s == 1 ? nu : cl ? sp.b0 / 2 : sp.b0; }

/* Number of tiles (pieces count one each) over nu units. */
__device__ __forceinline__ int gm_num_tiles(const gm_params_t &p, int nu, int cl, gm_split_t sp, const int mode) {
    if (mode != GM_MODE_GEMM1) return nu * ((p.n + p.tile_cols - 1) / p.tile_cols);
    const int udp = gm_udp(nu, cl, sp), wu = udp + (nu - udp) * sp.s;
    const int full = p.n / p.chunk_cols, rest = p.n - full * p.chunk_cols;
    return wu * (full * (p.chunk_cols / GM_BN) + (rest + GM_BN - 1) / GM_BN);
}
/* Tile t over nu units -> the unit, first output column, chunk, end of the
 * chunk's columns, and piece (-1: a whole tile). GEMM1: each chunk's whole
 * tiles in groups, then its split tiles' pieces, a tile's pieces together. */
__device__ __forceinline__ void gm_decode(const gm_params_t &p, int nu, int cl, gm_split_t sp, int t, int *unit,
                                          int *col0, int *chunk, int *col_end, int *piece, const int mode) {
    int bi, tn;
    *piece = -1;
    if (mode != GM_MODE_GEMM1) {
        gm_group_coords(t, nu, (p.n + p.tile_cols - 1) / p.tile_cols, p.group, &bi, &tn);
        *unit = bi;
        *col0 = tn * p.tile_cols;
        *chunk = 0;
        *col_end = p.n;
        return;
    }
    const int udp = gm_udp(nu, cl, sp), usk = nu - udp, wu = udp + usk * sp.s;
    const int tpc = p.chunk_cols / GM_BN, per_chunk = wu * tpc, full = p.n / p.chunk_cols;
    int ch = t / per_chunk;
    const int last = ch >= full; /* the narrower last chunk (selects, no branch) */
    ch = last ? full : ch;
    const int tnc = last ? (p.n - full * p.chunk_cols + GM_BN - 1) / GM_BN : tpc;
    int r = t - ch * per_chunk;
    if (r < udp * tnc) {
        gm_group_coords(r, udp, tnc, p.group, &bi, &tn);
    } else {
        r -= udp * tnc;
        *piece = r % sp.s;
        r /= sp.s;
        bi = udp + r % usk;
        tn = r / usk;
    }
    *unit = bi;
    *chunk = ch;
    *col0 = ch * p.chunk_cols + tn * GM_BN;
    const int end = (ch + 1) * p.chunk_cols;
    *col_end = end < p.n ? end : p.n;
}

/* One CTA's share of tile t: its row block (-1: none; with 2-CTA clusters
 * the unit is a pair of consecutive blocks of the walk, this CTA takes the
 * one of its rank) and its partner's (clusters), the columns, and the K
 * range in k-slices (a piece's, or all of K). */
typedef struct {
    int b, pb, col0, chunk, col_end;
    int piece, pieces, key; /* piece >= 0: of `pieces`, of the split CTA tile `key` (its counter) */
    int k0, nk;
} gm_tile_t;

__device__ __forceinline__ int gm_block_at(const gm_params_t &p, int nb, int pos) {
    return pos >= nb ? -1 : p.order ? p.order[pos] : pos;
}
__device__ __forceinline__ gm_tile_t gm_tile(const gm_params_t &p, int nb, int t, int cl, unsigned rank, const int mode) {
    gm_tile_t o;
    int unit;
    const gm_split_t sp = gm_split(p, nb, mode);
    gm_decode(p, cl ? (nb + 1) / 2 : nb, cl, sp, t, &unit, &o.col0, &o.chunk, &o.col_end, &o.piece, mode);
    const int pos = cl ? 2 * unit + (int)rank : unit;
    o.b = gm_block_at(p, nb, pos);
    o.pb = cl ? gm_block_at(p, nb, 2 * unit + (int)(rank ^ 1u)) : -1;
    const int nk = gm_nk(p);
    o.pieces = sp.s;
    o.key = (pos - sp.b0) * ((p.n + GM_BN - 1) / GM_BN) + o.col0 / GM_BN; /* GEMM1: order NULL, pos is the block */
    o.k0 = o.piece < 0 ? 0 : o.piece * nk / sp.s;
    o.nk = o.piece < 0 ? nk : (o.piece + 1) * nk / sp.s - o.k0;
    return o;
}

/* 2-CTA clusters (dev/gemm v4/v8: the barrier protocol measured there). */
__device__ __forceinline__ unsigned gm_cluster_rank(void) {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void gm_cluster_sync(void) {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
/* arrive on the mbarrier at the same offset in the peer CTA (release.cta semantics: the consumers' wgmma
 * waits already ordered their shared-memory reads; .release.cluster here stalled every k-step, v4 run 2) */
__device__ __forceinline__ void gm_mbar_arrive_peer(uint64_t *bar, unsigned peer) {
    asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\nmbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(
                     gm_smem(bar)),
                 "r"(peer)
                 : "memory");
}
/* CTA 0 -> CTA 1: the tile of claim i, into the peer's ring slot, then its slot barrier (release.cluster) */
__device__ __forceinline__ void gm_ring_publish(volatile int32_t *val, uint64_t *bar, int t) {
    asm volatile("{\n.reg .b32 ra, rb;\nmapa.shared::cluster.u32 ra, %0, 1;\nmapa.shared::cluster.u32 rb, %1, 1;\n"
                 "st.shared::cluster.u32 [ra], %2;\nmbarrier.arrive.release.cluster.shared::cluster.b64 _, [rb];\n}\n" ::"r"(
                     gm_smem((const void *)val)),
                 "r"(gm_smem(bar)), "r"(t)
                 : "memory");
}
__device__ __forceinline__ int gm_ring_receive(volatile int32_t *val, uint64_t *bar, int parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(gm_smem(bar)), "r"(parity)
                     : "memory");
    } while (!done);
    return *val;
}
/* 2D tile load into the same offset of both CTAs of the cluster, each one's barrier at the same offset */
__device__ __forceinline__ void gm_tma_load_mc(void *dst, const CUtensorMap *map, int c0, int c1, uint64_t *bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(gm_smem(dst)),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(gm_smem(bar)), "h"((uint16_t)3)
                 : "memory");
}

/* SiLU on the special-function unit: g * rcp(1 + 2^(-g log2 e)), ex2 and
 * rcp approximate (relative error ~2^-22 against comet_silu's expf and IEEE
 * divide, so h, stored bf16, differs from the reference's by at most one
 * rounding flip, rarely). Five instructions instead of ~30: the gated
 * epilogue runs while no consumer issues wgmma, so its length is lost
 * tensor-core time (dev/NOTES.md). Same limits as comet_silu: -0 for very
 * negative g, g for large g, NaN for NaN and -inf. */
__device__ __forceinline__ float gm_sigmoid(float g) {
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.44269504088896341f));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
    return r;
}
__device__ __forceinline__ float gm_silu(float g) { return g * gm_sigmoid(g); }

/* G's epilogue: comet_gelu_grad (Phi(g) + g phi(g)) from the forward's GELU, Phi(g) =
 * comet_gelu_fast(g) / g (0.5 at 0), phi on the SFU's ex2: within a few 1e-6 of the exact
 * derivative (comet_gelu_fast's error), so dH in bf16 differs from the reference's by a rounding flip
 * at most, rarely. */
__device__ __forceinline__ float gm_gelu_grad(float g) {
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * g * -0.72134752044448170f)); /* exp(-g^2 / 2) */
    const float phi = 0.39894228040143268f * e;
    const float cdf = fabsf(g) > 1e-30f ? __fdividef(comet_gelu_fast(g), g) : 0.5f;
    return cdf + g * phi;
}

/* Output value of accumulator element i (fp32): gated pairs gate column
 * (element i < 64) with up (i + 64, 128 columns further); GELU; or plain.
 * A GM_NARROW tile's n128 accumulators pair i < 32 with i + 32 instead. */
__device__ __forceinline__ float gm_act(const float *d, int i, int mode) {
    if (mode == GM_MODE_GATED) return gm_silu(d[i]) * d[i + 64];
    if (mode == GM_ACT_NARROW) return gm_silu(d[i]) * d[i + 32];
    if (mode == GM_MODE_GELU) return comet_gelu_fast(d[i]); /* comet_gelu's erff spilled here */
    float x; /* an opaque copy: without it ptxas serialises GEMM1's wgmmas (C7520) */
    asm volatile("mov.b32 %0, %1;" : "=f"(x) : "f"(d[i]));
    return x;
}

static_assert(sizeof(comet_plan_row_t) == 16, "gm_push_row reads a plan row as one int4");

/* GEMM1 push: where plan row `row` goes in its home rank's receive buffer
 * (gemm.h), or NULL (this rank's own tokens, padding rows). */
__device__ __forceinline__ comet_bf16_t *gm_push_row(const gm_params_t &p, int row) {
    /* one read-only 16-byte load (the plan does not change during the GEMM), which the
     * compiler may hoist above the pushes' stores */
    const int4 pr = __ldg((const int4 *)(p.rows + row)); /* src_rank, src_token, slot, weight bits */
    comet_bf16_t *base = pr.x >= 0 && pr.x < COMET_GEMM_MAX_PUSH ? p.push[pr.x] : NULL;
    return base ? base + ((p.push_tp_rows + pr.y) * p.push_topk + pr.z) * (int64_t)p.n : NULL;
}

/* GEMM1 push: the staged, swizzled half tile (64 rows x 128 columns, two
 * 64-column boxes) copied row by row into the rows' home ranks. Eight
 * consecutive lanes take one row's 128 bytes of a box, so a warp's store
 * writes four whole lines. */
__device__ __forceinline__ void gm_push_half(const gm_params_t &p, const unsigned char *cbuf, int row0, int col,
                                             int col_lim_half, int tid) {
    const uint32_t cb = gm_smem(cbuf);
    const int box = (tid >> 3) & 1, chunk = tid & 7;
    if (box * 64 >= col_lim_half) return;
    for (int i = 0; i < 8; i++) { /* each row's destination just before its store: the epilogue has no
                                    * registers to hold all eight (that spilled) */
        const int r = i * 8 + (tid >> 4);
        comet_bf16_t *dst = gm_push_row(p, row0 + r);
        if (!dst) continue;
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(cb + box * 8192 + r * 128 + ((chunk ^ (r & 7)) << 4)));
        *(uint4 *)(dst + col + box * 64 + chunk * 8) = v;
    }
}

/* Consumer warpgroup's 64 x (64*nbox) bf16 result (already activated) ->
 * global through the swizzled buffer + TMA store (and, GEMM1 with push, each
 * row to its home rank from the same buffer). Boxes starting at or past
 * col_lim (relative to col0) are skipped; the tensor map clips the rest.
 * plane >= 0: map is gm_map_planes' (gu, dH), the columns those of that plane. */
__device__ __forceinline__ void gm_store_tma(const uint32_t *pk, unsigned char *cbuf, const CUtensorMap *map, int row0,
                                             int col0, int nhalves, int col_lim, int tid, int c, const gm_params_t &p,
                                             const int mode, int plane) {
    const int lane = tid & 31, wi = tid >> 5, mi = lane >> 3;
    const int row = wi * 16 + (mi & 1) * 8 + (lane & 7); /* row (0..63) whose 16-byte chunk this lane addresses */
    const uint32_t cb = gm_smem(cbuf);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        if (h >= nhalves || h * 128 >= col_lim) break;
        if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); /* buffer free again */
        gm_named_bar(2 + c, 128);
#pragma unroll
        for (int jj = 0; jj < 16; jj += 2) {
            const int j = h * 16 + jj, colb = jj + (mi >> 1), box = colb >> 3, chunk = colb & 7;
            const uint32_t addr = cb + box * 8192 + row * 128 + ((chunk ^ (row & 7)) << 4);
            asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
                         "r"(pk[2 * j + 0]), "r"(pk[2 * j + 1]), "r"(pk[2 * j + 2]), "r"(pk[2 * j + 3])
                         : "memory");
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        gm_named_bar(2 + c, 128);
        if (tid == 0) {
            for (int q = 0; q < 2 && h * 128 + q * 64 < col_lim; q++) {
                if (plane >= 0)
                    gm_tma_store3(map, cbuf + q * 8192, col0 + h * 128 + q * 64, plane, row0);
                else
                    gm_tma_store(map, cbuf + q * 8192, col0 + h * 128 + q * 64, row0);
            }
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
        /* the buffer is read here before the next half's barrier lets anyone overwrite it */
        if (mode == GM_MODE_GEMM1 && p.push_on) gm_push_half(p, cbuf, row0, col0 + h * 128, col_lim - h * 128, tid);
    }
}

/* The same from registers, masked to rows < rows and columns < col_lim
 * (and, GEMM1 with push, each valid row to its home rank: 4-byte stores, for
 * the few half tiles with fewer than 64 rows). */
__device__ __forceinline__ void gm_store_regs(const uint32_t *pk, comet_bf16_t *out, int ld, int row0, int col0, int ncols,
                                              int rows, int col_lim, int tid, const gm_params_t &p, const int mode) {
    const int lane = tid & 31, wi = tid >> 5;
    const int r = wi * 16 + (lane >> 2), cb = (lane & 3) * 2;
    if (mode == GM_MODE_GEMM1 && p.push_on) {
        comet_bf16_t *d0 = r < rows ? gm_push_row(p, row0 + r) : NULL, *d1 = r + 8 < rows ? gm_push_row(p, row0 + r + 8) : NULL;
#pragma unroll
        for (int j = 0; j < 32; j++) {
            const int col = cb + j * 8;
            if (j * 8 >= ncols || col >= col_lim) continue;
            if (d0) *(uint32_t *)&d0[col0 + col] = pk[2 * j + 0];
            if (d1) *(uint32_t *)&d1[col0 + col] = pk[2 * j + 1];
        }
    }
#pragma unroll
    for (int j = 0; j < 32; j++) {
        const int col = cb + j * 8;
        if (j * 8 >= ncols || col >= col_lim) continue;
        if (r < rows)
            *(uint32_t *)&out[(size_t)(row0 + r) * ld + col0 + col] = pk[2 * j + 0];
        if (r + 8 < rows)
            *(uint32_t *)&out[(size_t)(row0 + r + 8) * ld + col0 + col] = pk[2 * j + 1];
    }
}

/* A producer's last act (one thread): a stage with tile -1 and no bytes marks
 * the end for the consumers, and the last claimer past the end resets the
 * tile counters for the next launch (with clusters CTA 0 of each pair claims). */
__device__ __forceinline__ void gm_produce_end(const gm_params_t &p, uint64_t *full, uint64_t *empty,
                                               volatile int32_t *stage_tile, int it, int cl, unsigned rank) {
    const int s = it % GM_STAGES, ph = (it / GM_STAGES) & 1;
    gm_mbar_wait(&empty[s], ph ^ 1);
    stage_tile[s] = -1;
    gm_mbar_arrive(&full[s]);
    if (!cl || rank == 0) {
        __threadfence();
        if (atomicAdd(&p.sched[1], 1u) == (cl ? gridDim.x / 2 : gridDim.x) - 1) {
            atomicExch(&p.sched[0], 0u);
            atomicExch(&p.sched[1], 0u);
        }
    }
}

/* A consumer's main loop over the nk k-slices of one tile (from ring position
 * it; returns the position after it), one wgmma group in flight. narrow (a
 * literal at each call; GM_NARROW): the gated tile's h columns 0..63 alone,
 * whose B stage holds 64 gate rows then 64 up rows: n128 into accumulators
 * 0..63 (gate in 0..31, up in 32..63; gm_act pairs them as GM_ACT_NARROW), half the
 * tensor work and two thirds of the bytes of the n256 path. tb (a literal): B
 * MN-major (dX, G: gm_desc_mn, the transpose bit). */
__device__ __forceinline__ int gm_kloop(float *d, unsigned char *base, uint64_t *full, uint64_t *empty, int it, int nk,
                                        int c, int cl, int lane, const int narrow, const int tb) {
    for (int k = 0; k < nk; k++, it++) {
        const int s = it % GM_STAGES, ph = (it / GM_STAGES) & 1;
        if (k > 0) gm_mbar_wait(&full[s], ph);
        unsigned char *sa = base + s * GM_STAGE_BYTES + c * 64 * 128;
        unsigned char *sb = base + s * GM_STAGE_BYTES + GM_A_BYTES;
        gm_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const int acc = (k > 0 || kk > 0) ? 1 : 0;
            if (narrow) {
                gm_wgmma_128(d, gm_desc(sa + kk * 32), gm_desc(sb + kk * 32), acc);
            } else if (tb) {
                gm_wgmma_256<1>(d, gm_desc(sa + kk * 32), gm_desc_mn(sb + kk * 2048), acc);
            } else {
                gm_wgmma_256<0>(d, gm_desc(sa + kk * 32), gm_desc(sb + kk * 32), acc);
            }
        }
        gm_wgmma_commit();
        GM_WGMMA_WAIT(1);
        gm_reg_fence(d);
        if (k > 0 && lane == 0) {
            gm_mbar_arrive(&empty[(it - 1) % GM_STAGES]);
            if (cl) gm_mbar_arrive_peer(&empty[(it - 1) % GM_STAGES], gm_cluster_rank() ^ 1u);
        }
    }
    return it;
}

/* pk = bf16 of the sum, in piece order, of NP partials (thread-major, one
 * consumer's at base, the next piece's 2 x 128 x 128 floats further). */
template <int NP> __device__ __forceinline__ void gm_split_sum(const float *base, uint32_t *pk) {
#pragma unroll
    for (int j = 0; j < 64; j++) {
        float x = __ldcg(base + 2 * j * 128), y = __ldcg(base + (2 * j + 1) * 128);
#pragma unroll
        for (int q = 1; q < NP; q++) {
            x += __ldcg(base + q * 2 * 128 * 128 + 2 * j * 128);
            y += __ldcg(base + q * 2 * 128 * 128 + (2 * j + 1) * 128);
        }
        pk[j] = gm_pack(x, y);
    }
}

/* GEMM1's tail split (gm_split), a consumer after a piece's k-loop: its
 * 64 x 256 fp32 partial into the workspace (thread-major, so each store
 * instruction writes 512 contiguous bytes), the CTA's piece counted once
 * (both consumers), and in the CTA that stored the tile's last piece the
 * partials summed in piece order (deterministic, whichever CTA that is)
 * into pk, bf16. Returns 1 there (pk then goes the store path), 0
 * elsewhere. The last piece also resets the counter for the next launch.
 * The sum (gm_split_sum) has the piece count as a literal, so its loads are
 * independent of each other and the compiler can batch them: a run-time
 * loop over the pieces made one chain of dependent L2 loads per element,
 * and the split lost 0.04 ms on Mixtral instead of gaining 0.09.
 * (Summing into d instead, 32 loads at a time, measured within noise of it and
 * spilled: d is written nowhere else, see the epilogue.) */
__device__ __forceinline__ int gm_split_piece(const gm_params_t &p, const float *d, uint32_t *pk, const gm_tile_t &tl,
                                              int c, int tid, volatile int32_t *last) {
    const int acc = 128 * 128; /* one consumer's partial: 128 accumulators x 128 threads */
    const float *base = p.split_part + ((size_t)tl.key * tl.pieces * 2 + c) * acc + tid;
    float *mine = (float *)base + (size_t)tl.piece * 2 * acc;
#pragma unroll
    for (int i = 0; i < 128; i++) __stcg(mine + i * 128, d[i]);
    __threadfence(); /* every thread's partial, before the count (the barrier makes them thread 128's) */
    gm_named_bar(1, 256);
    if (threadIdx.x == 128) {
        const int done = atomicAdd(&p.split_count[tl.key], 1u) == (unsigned)tl.pieces - 1u;
        if (done) p.split_count[tl.key] = 0; /* every piece counted: nothing else touches it this launch */
        *last = done;
    }
    gm_named_bar(1, 256);
    if (!*last) return 0;
    __threadfence(); /* the other pieces' partials, after their counts */
    if (tl.pieces == 2)
        gm_split_sum<2>(base, pk);
    else if (tl.pieces == 4)
        gm_split_sum<4>(base, pk);
    else
        gm_split_sum<8>(base, pk);
    return 1;
}

/* G's epilogue stages: the quarters (64 columns) of the tile at col0, each one ring stage after
 * the tile's k-slices (gm_body's producer and gm_dact_tile count them alike). */
__device__ __forceinline__ int gm_g_quarters(const gm_params_t &p, int col0) {
    const int cols = p.n - col0 < GM_BN ? p.n - col0 : GM_BN;
    return (cols + 63) / 64;
}

/* The 4-byte word at a shared-memory address (volatile: after the stage's full wait). */
__device__ __forceinline__ uint32_t gm_lds(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

/* A consumer warp is done with ring stage s: its lane 0 arrives (and on the peer CTA's barrier in
 * a cluster, as gm_kloop's releases). */
__device__ __forceinline__ void gm_release(uint64_t *empty, int s, int cl, int lane) {
    __syncwarp();
    if (lane == 0) {
        gm_mbar_arrive(&empty[s]);
        if (cl) gm_mbar_arrive_peer(&empty[s], gm_cluster_rank() ^ 1u);
    }
}

/* G's epilogue, one quarter (64 columns, q) of this consumer's (c) 64 rows (the first `rows` valid)
 * x 256 columns, both planes of dH at once, from G in d (fp32) and include/comet.h backward step 4:
 * dA = w G with the row's weight (w[e]: rows r + 8e), then, from gu's bf16 values, dg (gated SiLU:
 * dA u s (1 + g (1 - s)), s = sigmoid(g), as comet_silu_gated_backward; GELU: dA gm_gelu_grad(g))
 * into pk[0..15] and, gated, du = dA g s into pk[16..31] (gm_store_quarter's words); 0 in padding
 * rows. Also adds this thread's products G h, column by column ascending, to acc[e]. g, u and h
 * come from the ring stage at shared address st (planes of 128 rows x 128 bytes, 128B swizzle: the
 * 16-byte chunk k of row R at chunk k ^ (R & 7), so a warp's 8 rows hit 8 different chunks);
 * columns past col_lim read as 0. */
__device__ __forceinline__ void gm_dact_quarter(const float *d, uint32_t *pk, uint32_t st, int c, int rows, int col_lim,
                                                int tid, const int mode, const int q, const float *w, float *acc) {
    const int lane = tid & 31, wi = tid >> 5;
    const int r = wi * 16 + (lane >> 2), cb = (lane & 3) * 2, sw = lane >> 2; /* sw = R & 7 */
#pragma unroll
    for (int e = 0; e < 2; e++) { /* accumulators 4j + 2e, 4j + 2e + 1: row r + 8e, columns cb + 8j, +1 */
        const int valid = r + 8 * e < rows;
        const uint32_t rb = st + (uint32_t)(c * 64 + r + 8 * e) * 128u + (uint32_t)(lane & 3) * 4u;
        uint32_t g2[8], u2[8], h2[8];
#pragma unroll
        for (int jj = 0; jj < 8; jj++) { /* every load first, then the arithmetic */
            const uint32_t a = rb + (uint32_t)((jj ^ sw) << 4);
            g2[jj] = gm_lds(a);
            u2[jj] = mode == GM_MODE_DGELU ? 0u : gm_lds(a + GM_G_BOX_BYTES);
            h2[jj] = gm_lds(a + 2 * GM_G_BOX_BYTES);
        }
#pragma unroll
        for (int jj = 0; jj < 8; jj++) {
            const int j = q * 8 + jj, in = valid && cb + j * 8 < col_lim;
            const float G0 = d[4 * j + 2 * e], G1 = d[4 * j + 2 * e + 1], dA0 = w[e] * G0, dA1 = w[e] * G1;
            const uint32_t gw = in ? g2[jj] : 0u, uw = in ? u2[jj] : 0u, hw = in ? h2[jj] : 0u;
            const float g0 = __uint_as_float(gw << 16), g1 = __uint_as_float(gw & 0xffff0000u);
            if (mode == GM_MODE_DGELU) {
                pk[2 * jj + e] = valid ? gm_pack(dA0 * gm_gelu_grad(g0), dA1 * gm_gelu_grad(g1)) : 0u;
            } else {
                const float s0 = gm_sigmoid(g0), s1 = gm_sigmoid(g1);
                const float u0 = __uint_as_float(uw << 16), u1 = __uint_as_float(uw & 0xffff0000u);
                const float dg0 = dA0 * u0 * s0 * (1.0f + g0 * (1.0f - s0));
                const float dg1 = dA1 * u1 * s1 * (1.0f + g1 * (1.0f - s1));
                const float du0 = dA0 * g0 * s0, du1 = dA1 * g1 * s1;
                pk[2 * jj + e] = valid ? gm_pack(dg0, dg1) : 0u;
                pk[16 + 2 * jj + e] = valid ? gm_pack(du0, du1) : 0u;
            }
            acc[e] += G0 * __uint_as_float(hw << 16);
            acc[e] += G1 * __uint_as_float(hw & 0xffff0000u);
        }
    }
}

/* One quarter's planes (nplanes 64-row x 64-column boxes, pk[16 * plane + ..]) staged in cbuf (box
 * `plane` at plane x 8 KiB; all 64 rows: padding rows carry the zeros gm_dact_quarter put there) and
 * sent by the TMA to columns col.. of each plane; before the stmatrix the previous quarter's TMA
 * has read the buffer. */
__device__ __forceinline__ void gm_store_quarter(const uint32_t *pk, unsigned char *cbuf, const CUtensorMap *map,
                                                 int row0, int col, int tid, int c, const int nplanes) {
    const int lane = tid & 31, wi = tid >> 5, mi = lane >> 3;
    const int row = wi * 16 + (mi & 1) * 8 + (lane & 7); /* row (0..63) whose 16-byte chunk this lane addresses */
    const uint32_t cb = gm_smem(cbuf);
    if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); /* buffer free again */
    gm_named_bar(2 + c, 128);
#pragma unroll
    for (int plane = 0; plane < nplanes; plane++)
#pragma unroll
        for (int jj = 0; jj < 8; jj += 2) {
            const int chunk = jj + (mi >> 1);
            const uint32_t addr = cb + plane * 8192 + row * 128 + ((chunk ^ (row & 7)) << 4);
            asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
                         "r"(pk[16 * plane + 2 * jj + 0]), "r"(pk[16 * plane + 2 * jj + 1]),
                         "r"(pk[16 * plane + 2 * jj + 2]), "r"(pk[16 * plane + 2 * jj + 3])
                         : "memory");
        }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    gm_named_bar(2 + c, 128);
    if (tid == 0) {
        for (int plane = 0; plane < nplanes; plane++) gm_tma_store3(map, cbuf + plane * 8192, col, plane, row0);
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
}

/* G's epilogue for one consumer, from ring position it (returns the position after the tile's
 * quarters): quarter by quarter, wait for the stage with its g, u, h (gm_body's producer), compute
 * (gm_dact_quarter), release the stage, store through the staging buffer (gm_store_quarter: 32
 * words of pk at a time, both planes; all 64 rows: padding rows get zeros); then each valid row's
 * <G, h> over the tile into dwp[row][col0 / 256], the four threads of a row adding their sums in a
 * fixed tree. A tile without a block (clusters: the pair's missing half) only passes its stages. */
__device__ __forceinline__ int gm_dact_tile(const gm_params_t &p, const float *d, const unsigned char *base,
                                            uint64_t *full, uint64_t *empty, int it, const gm_tile_t &tl,
                                            unsigned char *cbuf, const CUtensorMap *map, int c, int tid, int cl,
                                            const int mode) {
    const int lane = tid & 31, r = (tid >> 5) * 16 + (lane >> 2), nq = gm_g_quarters(p, tl.col0);
    if (tl.b < 0) {
        for (int q = 0; q < nq; q++, it++) {
            gm_mbar_wait(&full[it % GM_STAGES], (it / GM_STAGES) & 1);
            gm_release(empty, it % GM_STAGES, cl, lane);
        }
        return it;
    }
    const comet_plan_block_t blk = p.blocks[tl.b];
    const int rows = blk.num_rows - c * 64, col_lim = tl.col_end - tl.col0, row0 = blk.row_start + c * 64;
    float w[2], acc[2] = {0.0f, 0.0f};
#pragma unroll
    for (int e = 0; e < 2; e++) w[e] = r + 8 * e < rows ? __ldg(&p.rows[row0 + r + 8 * e].weight) : 0.0f;
    uint32_t pk[32];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        if (q >= nq) break;
        const int s = it % GM_STAGES;
        gm_mbar_wait(&full[s], (it / GM_STAGES) & 1);
        gm_dact_quarter(d, pk, gm_smem(base + s * GM_STAGE_BYTES), c, rows, col_lim, tid, mode, q, w, acc);
        gm_release(empty, s, cl, lane);
        it++;
        gm_store_quarter(pk, cbuf, map, row0, tl.col0 + q * 64, tid, c, mode == GM_MODE_DGATED ? 2 : 1);
    }
#pragma unroll
    for (int e = 0; e < 2; e++) {
        float v = acc[e];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (r + 8 * e < rows && (lane & 3) == 0) p.dwp[(int64_t)(row0 + r + 8 * e) * p.dwp_tiles + tl.col0 / GM_BN] = v;
    }
    return it;
}

/* The kernel body; `mode` and `cl` are literals in each of the kernels below,
 * so each holds only its own epilogue (one kernel with a run-time mode held
 * all three for each of the 128 accumulators: 257 KB of SASS, and the
 * instruction fetches of the epilogue cost ~30% of the run time).
 * cl = 1: launched in 2-CTA clusters. CTA 0 claims tiles of pairs of
 * consecutive blocks of the walk and hands each claim to CTA 1 through a ring
 * in CTA 1's shared memory; each CTA computes the block of its rank. When
 * both blocks of a pair belong to one expert they share the B tile: each CTA
 * loads one 128-row half and multicasts it to both, so a stage is free only
 * once the consumers of both CTAs released it (16 arrivals). Otherwise, and
 * with cl = 0, each CTA loads its own B tile. tmbh: B with 128-row boxes (gated: 64-row boxes,
 * GM_NARROW's). tb = 1 (dX, G): B MN-major, tmb gm_map_mn's, four 64-column boxes a stage (a
 * shared tile: two from each CTA). tmg: GEMM0's pre-activation store (p.gu). G: tmbh and tmg are
 * its epilogue operands' maps, gu (column, plane, row) and h, 128-row boxes (gm_map_gu_rows, gm_map). */
__device__ __forceinline__ void gm_body(const CUtensorMap &tma, const CUtensorMap &tmb, const CUtensorMap &tmbh,
                                        const CUtensorMap &tmc, const CUtensorMap &tmg, const gm_params_t &p,
                                        const int mode, const int cl, const int tb) {
    if (p.skip && *p.skip) return; /* both CTAs of a cluster read the same flag */
    extern __shared__ __align__(1024) unsigned char gm_smem_raw[];
    unsigned char *base = (unsigned char *)(((uintptr_t)gm_smem_raw + 1023) & ~(uintptr_t)1023);
    unsigned char *cbufs = base + GM_STAGES * GM_STAGE_BYTES;
    uint64_t *full = (uint64_t *)(cbufs + 2 * GM_CBUF_BYTES);
    uint64_t *empty = full + GM_STAGES;
    uint64_t *ring_full = empty + GM_STAGES; /* cl: CTA 1's claim ring */
    volatile int32_t *stage_tile = (volatile int32_t *)(ring_full + GM_RING); /* tile of a stage's first k-slice */
    volatile int32_t *ring = stage_tile + GM_STAGES;
    volatile int32_t *stage_nk = ring + GM_RING;              /* k-slices of a stage's tile (a piece: its range) */
    volatile int32_t *split_last = stage_nk + GM_STAGES;      /* gm_split_piece: this CTA stored a tile's last piece */
    const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    const unsigned rank = cl ? gm_cluster_rank() : 0u;
    const int nb = p.totals->num_blocks;
    const int ntiles = gm_num_tiles(p, cl ? (nb + 1) / 2 : nb, cl, gm_split(p, nb, mode), mode);

    if (threadIdx.x == 0) {
        for (int s = 0; s < GM_STAGES; s++) {
            gm_mbar_init(&full[s], 1);
            gm_mbar_init(&empty[s], cl ? 16 : 8);
        }
        for (int s = 0; cl && s < GM_RING; s++) gm_mbar_init(&ring_full[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    if (cl) gm_cluster_sync(); /* the peer's barriers exist before anything reaches them */

    if (wg == 0) {
        /* registers: 168 x 384 at launch = 40 x 128 + 232 x 256; the cluster producer needs 48 (it
         * spilled at 40), its consumers get 224 */
        if (cl)
            asm volatile("setmaxnreg.dec.sync.aligned.u32 48;");
        else
            asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 0) {
            const uint64_t epoch = p.block_ready ? *p.epoch : 0; /* device memory: a graph replays it */
            int it = 0;
            for (int i = 0;; i++) {
                /* dynamic claim: the tiles in flight stay a window of consecutive t, so the
                 * CTAs sharing a B tile (neighbours in t) run it at the same time (L2 reuse) */
                int t;
                if (!cl || rank == 0) {
                    t = (int)atomicAdd(&p.sched[0], 1u);
                    if (t >= ntiles) t = -1;
                    if (cl) gm_ring_publish(&ring[i % GM_RING], &ring_full[i % GM_RING], t);
                } else {
                    t = gm_ring_receive(&ring[i % GM_RING], &ring_full[i % GM_RING], (i / GM_RING) & 1);
                }
                if (t < 0) break;
                const gm_tile_t tl = gm_tile(p, nb, t, cl, rank, mode);
                const comet_plan_block_t blk = tl.b >= 0 ? p.blocks[tl.b] : p.blocks[tl.pb];
                const int same = cl && tl.b >= 0 && tl.pb >= 0 && p.blocks[tl.pb].expert == blk.expert;
                if (p.block_ready && tl.b >= 0) {
                    gm_wait_ready(p, &p.block_ready[tl.b], epoch, t, tl.b);
                    asm volatile("fence.proxy.async.global;" ::: "memory");
                }
                const int brow = blk.expert * p.b_rows + tl.col0;
                /* GM_NARROW: 64 gate rows, then 64 up rows (tmbh: 64-row boxes for the gated kernels) */
                const int narrow = mode == GM_MODE_GATED && p.narrow && p.n - tl.col0 <= 64;
                const int bbytes = narrow ? GM_B_BYTES / 2 : GM_B_BYTES;
                for (int k = tl.k0; k < tl.k0 + tl.nk; k++, it++) {
                    const int s = it % GM_STAGES, ph = (it / GM_STAGES) & 1;
                    gm_mbar_wait(&empty[s], ph ^ 1);
                    unsigned char *st = base + s * GM_STAGE_BYTES;
                    if (k == tl.k0) { /* published by the arrive below (release.cta) */
                        stage_tile[s] = t | (narrow ? GM_NARROW : 0);
                        stage_nk[s] = tl.nk;
                    }
                    gm_mbar_expect_tx(&full[s], tl.b >= 0 ? GM_A_BYTES + bbytes : 0); /* no block: no bytes */
                    if (tl.b < 0) continue;
                    gm_tma_load(st, &tma, k * GM_BK, blk.row_start, &full[s]);
                    const CUtensorMap *gmap = narrow ? &tmbh : &tmb; /* gated: gate and up boxes */
                    if (tb) { /* K rows k.. of 64-column boxes, coordinates (column, K row, expert) */
                        for (int q = same ? 2 * (int)rank : 0; q < (same ? 2 * (int)rank + 2 : 4); q++)
                            gm_tma_load3(st + GM_A_BYTES + q * 8192, &tmb, tl.col0 + q * 64, k * GM_BK, blk.expert,
                                         &full[s], same);
                    } else if (same) { /* my half of the shared B tile, into both CTAs (gated: gate or up rows) */
                        const int hrow = mode == GM_MODE_GATED ? brow + (int)rank * p.up_off : brow + (int)rank * (GM_BN / 2);
                        gm_tma_load_mc(st + GM_A_BYTES + rank * (bbytes / 2), mode == GM_MODE_GATED ? gmap : &tmbh,
                                       k * GM_BK, hrow, &full[s]);
                    } else if (mode == GM_MODE_GATED) {
                        gm_tma_load(st + GM_A_BYTES, gmap, k * GM_BK, brow, &full[s]);
                        gm_tma_load(st + GM_A_BYTES + bbytes / 2, gmap, k * GM_BK, brow + p.up_off, &full[s]);
                    } else {
                        gm_tma_load(st + GM_A_BYTES, &tmb, k * GM_BK, brow, &full[s]);
                    }
                }
                if (mode == GM_MODE_DGATED || mode == GM_MODE_DGELU) { /* G's epilogue operands, a quarter a stage */
                    const int nq = gm_g_quarters(p, tl.col0), planes = mode == GM_MODE_DGATED ? 2 : 1;
                    for (int q = 0; q < nq; q++, it++) {
                        const int s = it % GM_STAGES, ph = (it / GM_STAGES) & 1;
                        gm_mbar_wait(&empty[s], ph ^ 1);
                        gm_mbar_expect_tx(&full[s], tl.b >= 0 ? (planes + 1) * GM_G_BOX_BYTES : 0);
                        if (tl.b < 0) continue;
                        unsigned char *st = base + s * GM_STAGE_BYTES;
                        for (int pl = 0; pl < planes; pl++) /* g, then u: tmbh is gu's (column, plane, row) map */
                            gm_tma_load3(st + pl * GM_G_BOX_BYTES, &tmbh, tl.col0 + q * 64, pl, blk.row_start, &full[s], 0);
                        gm_tma_load(st + 2 * GM_G_BOX_BYTES, &tmg, tl.col0 + q * 64, blk.row_start, &full[s]); /* h */
                    }
                }
            }
            gm_produce_end(p, full, empty, stage_tile, it, cl, rank);
        }
    } else {
        if (cl)
            asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
        else
            asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        const int c = wg - 1, lane = tid & 31;
        float d[128];
#pragma unroll
        for (int i = 0; i < 128; i++) d[i] = 0.f;
        int it = 0;
        for (;;) {
            gm_mbar_wait(&full[it % GM_STAGES], (it / GM_STAGES) & 1);
            const int tv = stage_tile[it % GM_STAGES];
            if (tv < 0) break;
            const int nkt = mode == GM_MODE_GEMM1 ? stage_nk[it % GM_STAGES] : gm_nk(p); /* GEMM0: all of K */
            if (mode == GM_MODE_GATED && (tv & GM_NARROW))
                it = gm_kloop(d, base, full, empty, it, nkt, c, cl, lane, 1, 0);
            else
                it = gm_kloop(d, base, full, empty, it, nkt, c, cl, lane, 0, tb);
            GM_WGMMA_WAIT(0);
            gm_reg_fence(d);
            if (lane == 0) {
                gm_mbar_arrive(&empty[(it - 1) % GM_STAGES]);
                if (cl) gm_mbar_arrive_peer(&empty[(it - 1) % GM_STAGES], gm_cluster_rank() ^ 1u);
            }
            /* the tile decoded only now: nothing but tv stays live across the main loop */
            const int t = tv & ~GM_NARROW;
            const gm_tile_t tl = gm_tile(p, nb, t, cl, cl ? gm_cluster_rank() : 0u, mode);
            if (mode == GM_MODE_DGATED || mode == GM_MODE_DGELU) {
                it = gm_dact_tile(p, d, base, full, empty, it, tl, cbufs + c * GM_CBUF_BYTES, &tmc, c, tid, cl, mode);
                continue;
            }
            if (tl.b < 0) continue; /* the same for both consumers: the named barrier below stays matched */
            const comet_plan_block_t blk = p.blocks[tl.b];

            /* epilogue: activation in fp32 (gm_act) and bf16 packing once, uniformly, into pk (d
             * itself is never written here: accumulator writes make ptxas serialise the wgmmas),
             * then the store path of this consumer's rows */
            const int rows = blk.num_rows - c * 64, col_lim = tl.col_end - tl.col0, row0 = blk.row_start + c * 64;
            unsigned char *cbuf = cbufs + c * GM_CBUF_BYTES;
            uint32_t pk[64];
            if (mode == GM_MODE_GEMM1 && tl.piece >= 0) { /* a split tile's piece: only its last CTA goes on */
                if (!gm_split_piece(p, d, pk, tl, c, tid, split_last)) continue;
            } else if (mode == GM_MODE_GATED && (tv & GM_NARROW)) { /* h columns 0..63 only (the store masks the rest) */
#pragma unroll
                for (int i = 0; i < 64; i++)
                    pk[i] = i >= 16 ? 0u : gm_pack(gm_act(d, 2 * i, GM_ACT_NARROW), gm_act(d, 2 * i + 1, GM_ACT_NARROW));
            } else {
#pragma unroll
                for (int i = 0; i < 64; i++)
                    pk[i] = mode == GM_MODE_GATED && i >= 32 ? 0u
                                                             : gm_pack(gm_act(d, 2 * i, mode), gm_act(d, 2 * i + 1, mode));
            }
#pragma unroll
            for (int i = 0; i < 64; i++) asm volatile("" : "+r"(pk[i])); /* keep the packing out of the branches */
            const int ncols = mode == GM_MODE_GATED ? 128 : GM_BN;
            if (rows >= 64)
                gm_store_tma(pk, cbuf, &tmc, row0, tl.col0, ncols / 128, col_lim, tid, c, p, mode, -1);
            else if (rows > 0)
                gm_store_regs(pk, p.c, p.n, row0, tl.col0, ncols, rows, col_lim, tid, p, mode);
            if (mode != GM_MODE_GEMM1 && p.gu) {
                /* the pre-activation too, bf16 (gm_map_planes: gated gate columns in plane 0 from
                 * accumulators 0..63, up in plane 1 from 64..127; a GM_NARROW tile's in 0..31 and 32..63;
                 * GELU g, 256 columns in plane 0), after h (its bits do not depend on this) */
                if (mode == GM_MODE_GATED && (tv & GM_NARROW)) {
#pragma unroll
                    for (int i = 0; i < 64; i++)
                        pk[i] = i < 16 ? gm_pack(d[2 * i], d[2 * i + 1]) : i >= 32 && i < 48 ? gm_pack(d[2 * i - 32], d[2 * i - 31]) : 0u;
                } else {
#pragma unroll
                    for (int i = 0; i < 64; i++) pk[i] = gm_pack(d[2 * i], d[2 * i + 1]);
                }
#pragma unroll
                for (int i = 0; i < 64; i++) asm volatile("" : "+r"(pk[i]));
                if (rows >= 64) {
                    gm_store_tma(pk, cbuf, &tmg, row0, tl.col0, ncols / 128, col_lim, tid, c, p, mode, 0);
                    if (mode == GM_MODE_GATED) gm_store_tma(pk + 32, cbuf, &tmg, row0, tl.col0, 1, col_lim, tid, c, p, mode, 1);
                } else if (rows > 0) {
                    gm_store_regs(pk, p.gu, p.gu_ld, row0, tl.col0, ncols, rows, col_lim, tid, p, mode);
                    if (mode == GM_MODE_GATED)
                        gm_store_regs(pk + 32, p.gu + p.up_off, p.gu_ld, row0, tl.col0, 128, rows, col_lim, tid, p, mode);
                }
            }
            if (p.chunk_done) {
                /* both consumers' stores of this tile are complete and visible, then one release add */
                if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
                asm volatile("fence.proxy.async.global;" ::: "memory");
                __threadfence();
                gm_named_bar(1, 256);
                if (threadIdx.x == 128) {
                    asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(&p.chunk_done[tl.chunk]) : "memory");
                }
            }
        }
        if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); /* stores done before smem goes */
        if (mode == GM_MODE_GEMM1 && p.push_on) __threadfence_system(); /* pushed rows, before the home is told */
    }
    /* cl: no CTA leaves while its peer may still multicast into it or arrive on its barriers */
    if (cl) gm_cluster_sync();
    /* a programmatic dependent's completion then implies its primary's (the
     * kernels after this one in the stream are ordered after this one only);
     * the primary's data came through block_ready, so this costs nothing */
    if (p.pdl && threadIdx.x == 0) asm volatile("griddepcontrol.wait;" ::: "memory");
}

#define GM_KERNEL(name, mode, cl, tb)                                                                         \
    __global__ void __launch_bounds__(384, 1)                                                                 \
        name(const __grid_constant__ CUtensorMap tma, const __grid_constant__ CUtensorMap tmb,               \
             const __grid_constant__ CUtensorMap tmbh, const __grid_constant__ CUtensorMap tmc,              \
             const __grid_constant__ CUtensorMap tmg, const __grid_constant__ gm_params_t p) {               \
        gm_body(tma, tmb, tmbh, tmc, tmg, p, mode, cl, tb);                                                   \
    }
GM_KERNEL(comet_gemm0_gated_kernel, GM_MODE_GATED, 0, 0)
GM_KERNEL(comet_gemm0_gelu_kernel, GM_MODE_GELU, 0, 0)
GM_KERNEL(comet_gemm1_kernel, GM_MODE_GEMM1, 0, 0)
GM_KERNEL(comet_gemm_g_gated_kernel, GM_MODE_DGATED, 0, 1)
GM_KERNEL(comet_gemm_g_gelu_kernel, GM_MODE_DGELU, 0, 1)
GM_KERNEL(comet_gemm_dx_kernel, GM_MODE_GEMM1, 0, 1)
GM_KERNEL(comet_gemm0_gated_cl_kernel, GM_MODE_GATED, 1, 0)
GM_KERNEL(comet_gemm0_gelu_cl_kernel, GM_MODE_GELU, 1, 0)
GM_KERNEL(comet_gemm1_cl_kernel, GM_MODE_GEMM1, 1, 0)
GM_KERNEL(comet_gemm_g_gated_cl_kernel, GM_MODE_DGATED, 1, 1)
GM_KERNEL(comet_gemm_g_gelu_cl_kernel, GM_MODE_DGELU, 1, 1)
GM_KERNEL(comet_gemm_dx_cl_kernel, GM_MODE_GEMM1, 1, 1)
#undef GM_KERNEL

/* Every kernel above, [cluster][GM_K_*]. */
enum { GM_K_GATED, GM_K_GELU, GM_K_GEMM1, GM_K_G_GATED, GM_K_G_GELU, GM_K_DX, GM_NKERNELS };
typedef void (*gm_kernel_fn)(const CUtensorMap, const CUtensorMap, const CUtensorMap, const CUtensorMap,
                             const CUtensorMap, const gm_params_t);
static const gm_kernel_fn gm_kernels[2][GM_NKERNELS] = {
    {comet_gemm0_gated_kernel, comet_gemm0_gelu_kernel, comet_gemm1_kernel, comet_gemm_g_gated_kernel,
     comet_gemm_g_gelu_kernel, comet_gemm_dx_kernel},
    {comet_gemm0_gated_cl_kernel, comet_gemm0_gelu_cl_kernel, comet_gemm1_cl_kernel, comet_gemm_g_gated_cl_kernel,
     comet_gemm_g_gelu_cl_kernel, comet_gemm_dx_cl_kernel}};

/* ---------------------------------------------------------------------------
 * Host side
 * ------------------------------------------------------------------------- */

extern "C" const char *comet_gemm_check(const comet_dims_t *d) {
    if (!d) return "no dims";
    if (d->tile_m != COMET_GEMM_TILE_M) return "the Hopper grouped GEMM needs tile_m == 128";
    if (d->hidden <= 0 || d->hidden % 64) return "the Hopper grouped GEMM needs hidden % 64 == 0";
    /* ffn_local: any multiple of 8 (16-byte rows of h for the tensor maps): a
     * last h tile narrower than the tile is masked at the store (gated: its
     * gate half reads up rows and its up half the next expert's rows or zeros,
     * all in masked columns), GEMM1's last K step reads zeros past F_local */
    if (d->ffn_local <= 0 || d->ffn_local % 8) return "the Hopper grouped GEMM needs ffn_local % 8 == 0";
    if (d->activation != 0 && d->activation != 1) return "the Hopper grouped GEMM knows gated SiLU and GELU only";
    const int64_t lim = (int64_t)1 << 31;
    if (d->max_rows_padded >= lim || d->experts_local * d->w1_rows >= lim || d->experts_local * d->hidden >= lim ||
        d->max_rows_padded * d->hidden >= ((int64_t)1 << 40))
        return "the Hopper grouped GEMM needs row counts below 2^31";
    const int64_t cols = d->hidden > d->ffn_local ? d->hidden : d->ffn_local; /* tiles: below GM_NARROW */
    if ((d->max_rows_padded / GM_BM + 1) * ((cols + 127) / 128) + GM_SPLIT_PIECES * GM_SPLIT_MAX >= GM_NARROW)
        return "the Hopper grouped GEMM needs fewer than 2^29 tiles (max_rows_padded / 128 x max(H, F_local) / 128)";
    return NULL;
}

/* GEMM1's k-slices (gm_nk on the device) and the split rule's workers (split_ref): the host's
 * comet_gemm_split_of and the launch must agree on both. */
static int gm_host_nk(const comet_dims_t *d) { return (int)((d->ffn_local + GM_BK - 1) / GM_BK); }
static int gm_split_ref(const comet_gemm_t *g) { return g->num_sms / 2 > 0 ? g->num_sms / 2 : 1; }

extern "C" size_t comet_gemm_split_bytes(const comet_dims_t *d, int min) {
    if (min <= 0 || comet_gemm_check(d) || gm_host_nk(d) < 2 * min) return 0; /* no two pieces of min slices: never splits */
    return GM_SPLIT_HEADER + (size_t)GM_SPLIT_PIECES * GM_BM * GM_BN * sizeof(float);
}

/* 3D bf16 map, 128B swizzle, out-of-bounds reads zero: dims innermost first, strides of dims 1 and 2
 * in elements. */
static int gm_map3(CUtensorMap *m, const void *ptr, const int64_t dims[3], const int64_t strides[2], const int box[3],
                   int l2_promote) {
    gm_encode_fn enc = gm_get_encode();
    if (!enc) return -1;
    cuuint64_t dm[3] = {(cuuint64_t)dims[0], (cuuint64_t)dims[1], (cuuint64_t)dims[2]};
    cuuint64_t st[2] = {(cuuint64_t)strides[0] * 2, (cuuint64_t)strides[1] * 2};
    cuuint32_t bx[3] = {(cuuint32_t)box[0], (cuuint32_t)box[1], (cuuint32_t)box[2]};
    cuuint32_t es[3] = {1, 1, 1};
    CUresult r = enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, (void *)ptr, dm, st, bx, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     CU_TENSOR_MAP_SWIZZLE_128B,
                     l2_promote ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : CU_TENSOR_MAP_L2_PROMOTION_NONE,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? 0 : -1;
}
/* Stores into (rows, planes x F) rows split in planes of F columns (gu and dH: [g|u] gated, g GELU):
 * (column, plane, row), box 64 columns x 1 plane x 64 rows, clipped at each plane's F. */
static int gm_map_planes(CUtensorMap *m, const void *ptr, int64_t rows, int64_t f, int planes) {
    const int64_t dims[3] = {f, planes, rows}, strides[2] = {f, planes * f};
    const int box[3] = {64, 1, 64};
    return gm_map3(m, ptr, dims, strides, box, 0);
}
/* G's epilogue operands from gu (rows, planes x F): (column, plane, row), box 64 columns x 1 plane x
 * 128 rows (a G epilogue stage's plane). */
static int gm_map_gu_rows(CUtensorMap *m, const void *ptr, int64_t rows, int64_t f, int planes) {
    const int64_t dims[3] = {f, planes, rows}, strides[2] = {f, planes * f};
    const int box[3] = {64, 1, GM_BM};
    return gm_map3(m, ptr, dims, strides, box, 1);
}
/* A stacked weight (experts, k rows, n columns) read MN-major (the dgrad GEMMs' B): (column, K row,
 * expert), box 64 columns x 64 K rows; K rows past an expert's read zero. */
static int gm_map_mn(CUtensorMap *m, const void *ptr, int64_t experts, int64_t k, int64_t n) {
    const int64_t dims[3] = {n, k, experts}, strides[2] = {n, k * n};
    const int box[3] = {64, GM_BK, 1};
    return gm_map3(m, ptr, dims, strides, box, 1);
}

extern "C" int64_t comet_gemm_dwp_tiles(const comet_dims_t *d) { return (d->ffn_local + GM_BN - 1) / GM_BN; }

extern "C" int comet_gemm_prepare(const comet_gemm_args_t *args, comet_gemm_t **out, char *err, size_t err_len) {
    *out = NULL;
    const comet_dims_t *d = &args->d;
    const char *why = comet_gemm_check(d);
    if (why) {
        snprintf(err, err_len, "%s", why);
        return -1;
    }
    if (!gm_get_encode()) {
        snprintf(err, err_len, "cuTensorMapEncodeTiled is not available from the driver");
        return -1;
    }
    comet_gemm_t *g = (comet_gemm_t *)aligned_alloc(64, (sizeof(*g) + 63) / 64 * 64); /* CUtensorMap: 64-aligned */
    if (!g) {
        snprintf(err, err_len, "out of host memory");
        return -1;
    }
    memset(g, 0, sizeof(*g));
    g->args = *args;
    const int64_t mr = d->max_rows_padded, hd = d->hidden, fl = d->ffn_local, el = d->experts_local;
    const int gated = d->activation == 0;
    int bad = 0;
    bad |= gm_map(&g->a0, args->a, mr, hd, 128, 1);
    bad |= gm_map(&g->b0, args->w1, el * d->w1_rows, hd, gated ? 128 : 256, 1);
    bad |= gm_map(&g->c0, args->h, mr, fl, 64, 0);
    bad |= gm_map(&g->a1, args->h, mr, fl, 128, 1);
    bad |= gm_map(&g->b1, args->w2, el * hd, fl, 256, 1);
    bad |= gm_map(&g->c1, args->o, mr, hd, 64, 0);
    bad |= gm_map(&g->b0h, args->w1, el * d->w1_rows, hd, gated ? 64 : 128, 1);
    bad |= gm_map(&g->b1h, args->w2, el * hd, fl, 128, 1);
    bad |= gm_map_mn(&g->b2, args->w2, el, hd, fl);
    bad |= gm_map_mn(&g->b3, args->w1, el, d->w1_rows, hd);
    if (bad) {
        free(g);
        snprintf(err, err_len, "cuTensorMapEncodeTiled rejected a tensor map (pointers must be 16-byte aligned)");
        return -1;
    }
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    g->num_sms = sms > 0 ? sms : 132;
    const comet_gemm_knobs_t *kn = &args->knobs;
    g->narrow = kn->narrow;
    for (int i = 0; i < 2; i++) g->group[i] = kn->group[i] > 0 && kn->group[i] <= 4096 ? kn->group[i] : 0;
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < 2 * GM_NKERNELS && e == cudaSuccess; i++)
        e = cudaFuncSetAttribute(gm_kernels[i / GM_NKERNELS][i % GM_NKERNELS], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 GM_SMEM_BYTES);
    if (e == cudaSuccess && kn->cluster) {
        int most = -1;
        for (int i = 0; i < GM_NKERNELS && e == cudaSuccess; i++) { /* the cluster kernels */
            cudaLaunchConfig_t lc;
            memset(&lc, 0, sizeof lc);
            cudaLaunchAttribute at;
            at.id = cudaLaunchAttributeClusterDimension;
            at.val.clusterDim.x = 2, at.val.clusterDim.y = 1, at.val.clusterDim.z = 1;
            lc.gridDim = dim3((unsigned)(g->num_sms / 2 * 2)), lc.blockDim = dim3(384), lc.dynamicSmemBytes = GM_SMEM_BYTES;
            lc.attrs = &at, lc.numAttrs = 1;
            int n = 0;
            e = cudaOccupancyMaxActiveClusters(&n, (const void *)gm_kernels[1][i], &lc);
            most = most < 0 || n < most ? n : most;
        }
        g->cluster_ctas = e == cudaSuccess && most > 0 ? 2 * most : 0;
    }
    if (e != cudaSuccess) {
        free(g);
        snprintf(err, err_len, "setting up the GEMM kernels (shared memory, cluster occupancy): %s", cudaGetErrorString(e));
        return -1;
    }
    g->sched = args->sched, g->own_sched = args->sched == NULL;
    const size_t split_bytes = comet_gemm_split_bytes(d, kn->split_min);
    g->split = args->split, g->own_split = args->split == NULL && args->sched == NULL && split_bytes > 0;
    g->split_min = split_bytes > 0 ? kn->split_min : 0;
    if (g->own_sched) { /* GEMM0's and GEMM1's counters, then G's and dX's (comet_gemm_train_t.sched NULL) */
        e = cudaMalloc((void **)&g->sched, 8 * sizeof(uint32_t));
        if (e == cudaSuccess) e = cudaMemset(g->sched, 0, 8 * sizeof(uint32_t));
    }
    if (e == cudaSuccess && g->own_split) {
        e = cudaMalloc(&g->split, split_bytes);
        if (e == cudaSuccess) e = cudaMemset(g->split, 0, GM_SPLIT_HEADER);
    }
    if (e != cudaSuccess) {
        if (g->own_sched && g->sched) cudaFree(g->sched);
        if (g->own_split && g->split) cudaFree(g->split);
        free(g);
        snprintf(err, err_len, "tile counters and split workspace: %s", cudaGetErrorString(e));
        return -1;
    }
    *out = g;
    return 0;
}

extern "C" int comet_gemm_cluster_ctas(const comet_gemm_t *g) { return g->cluster_ctas; }

extern "C" int comet_gemm_split_of(const comet_gemm_t *g, int num_blocks, int *first_block) {
    const comet_dims_t *d = &g->args.d;
    const gm_split_t sp =
        gm_split_rule(num_blocks, (int)d->hidden, gm_host_nk(d), g->split ? g->split_min : 0, gm_split_ref(g));
    if (first_block) *first_block = sp.b0;
    return sp.s;
}

extern "C" void comet_gemm_destroy(comet_gemm_t *g) {
    if (!g) return;
    if (g->own_sched) cudaFree(g->sched);
    if (g->own_split) cudaFree(g->split);
    free(g);
}

extern "C" int comet_gemm_timeout_message(const uint64_t *report, char *buf, size_t len) {
    if (!report || report[0] != 1) return 0;
    static const char *const role[4] = {"gemm0", "gemm1", "gemm G", "gemm dX"};
    snprintf(buf, len,
             "comet: rank %llu %s producer cta %llu tile %llu: timed out waiting for block_ready[%llu] "
             "(%llu < epoch %llu)",
             (unsigned long long)report[1], report[2] < 4 ? role[report[2]] : "gemm ?", (unsigned long long)report[7],
             (unsigned long long)report[3], (unsigned long long)report[4], (unsigned long long)report[5],
             (unsigned long long)report[6]);
    return 1;
}

/* One launch of `which` (GM_GEMM0 .. GM_DX; t: the training buffers, or NULL). GEMM1 and dX share
 * the GEMM1 path (chunks, chunk_done, push; dX without the tail split), GEMM0 and G the GEMM0 walk
 * (l0_order). */
static int gm_launch(const comet_gemm_t *g, int which, const comet_gemm_train_t *t, void *stream,
                     const comet_gemm_hooks_t *hooks) {
    const comet_gemm_args_t *a = &g->args;
    const comet_dims_t *d = &a->d;
    const int64_t mr = d->max_rows_padded, hd = d->hidden, fl = d->ffn_local;
    const int gated = d->activation == 0, planes = gated ? 2 : 1;
    uint32_t *sched_bwd = t && t->sched ? t->sched : g->own_sched ? g->sched + 4 : NULL;
    /* the maps of the training buffers (A, C, gu store; G: its epilogue operands too), encoded now */
    CUtensorMap ta, tc, tg, th;
    int bad = 0;
    if (which == GM_GEMM0 && t) {
        bad = !t->gu || gm_map_planes(&tg, t->gu, mr, fl, planes) || (t->h && gm_map(&tc, t->h, mr, fl, 64, 0));
    } else if (which == GM_GEMM1 && t) {
        bad = t->h && gm_map(&ta, t->h, mr, fl, 128, 1);
    } else if (which == GM_G) {
        bad = !t || !t->gu || !t->dy || !t->dh || !t->dwp || !(t->h || a->h) || !sched_bwd;
        if (!bad) /* A: dy; dH store; G's epilogue operands, 128-row boxes: gu (tg: column, plane, row) and h (th) */
            bad = gm_map(&ta, t->dy, mr, hd, 128, 1) || gm_map_planes(&tc, t->dh, mr, fl, planes) ||
                  gm_map_gu_rows(&tg, t->gu, mr, fl, planes) || gm_map(&th, t->h ? t->h : a->h, mr, fl, 128, 1);
    } else if (which == GM_DX) {
        bad = !t || !t->dh || !t->dx || !sched_bwd;
        if (!bad) bad = gm_map(&ta, t->dh, mr, d->w1_rows, 128, 1) || gm_map(&tc, t->dx, mr, hd, 64, 0);
    }
    if (bad) return (int)cudaErrorInvalidValue;
    const int l1 = which == GM_GEMM1 || which == GM_DX; /* the GEMM1 path */
    comet_gemm_hooks_t hk;
    memset(&hk, 0, sizeof(hk));
    if (hooks) hk = *hooks;
    comet_plan_t plan;
    comet_plan_carve(d, (void *)a->plan_ws, &plan);
    gm_params_t p;
    memset(&p, 0, sizeof(p));
    p.role = which;
    p.rank = d->rank;
    p.totals = plan.totals;
    p.blocks = plan.blocks;
    p.rows = plan.rows;
    p.block_ready = hk.block_ready;
    p.epoch = hk.epoch;
    p.chunk_done = l1 ? hk.chunk_done : NULL;
    p.skip = hk.skip;
    if (l1 && hk.push) { /* rows to their home ranks too (args.push) */
        p.push_on = 1;
        p.push_tp_rows = (int64_t)d->tp_rank * d->max_tokens;
        p.push_topk = (int)d->topk;
        for (int q = 0; q < COMET_GEMM_MAX_PUSH; q++) p.push[q] = a->push[q];
    }
    p.timeout_ns = hk.timeout_ns;
    p.timeout_report = hk.timeout_report;
    p.sched = which < GM_G ? g->sched + 2 * which : sched_bwd + 2 * (which - GM_G);
    p.gu_ld = (int)d->w1_rows;
    p.up_off = (int)d->ffn_local;
    if (!l1) {
        p.mode = which == GM_G ? (gated ? GM_MODE_DGATED : GM_MODE_DGELU) : gated ? GM_MODE_GATED : GM_MODE_GELU;
        p.k = (int)d->hidden;
        p.n = (int)d->ffn_local;
        p.b_rows = (int)d->w1_rows;
        p.tile_cols = p.mode == GM_MODE_GATED ? 128 : 256;
        p.chunk_cols = p.n;
        p.order = hk.l0_order ? plan.l0_order : NULL;
        p.c = which == GM_G ? t->dh : t && t->h ? t->h : a->h;
        p.gu = which == GM_GEMM0 && t ? t->gu : NULL; /* GEMM0 stores the pre-activation (G reads gu by its map) */
        if (which == GM_G) {
            p.dwp = t->dwp;
            p.dwp_tiles = (int)comet_gemm_dwp_tiles(d);
        }
    } else {
        int cc = hk.chunk_cols ? hk.chunk_cols : (int)d->hidden;
        if (cc <= 0 || (cc % GM_BN && cc != (int)d->hidden)) return (int)cudaErrorInvalidValue;
        if (cc >= (int)d->hidden) cc = ((int)d->hidden + GM_BN - 1) / GM_BN * GM_BN; /* one chunk */
        p.mode = GM_MODE_GEMM1;
        p.k = which == GM_DX ? (int)d->w1_rows : (int)d->ffn_local;
        p.n = (int)d->hidden;
        p.b_rows = (int)d->hidden;
        p.tile_cols = GM_BN;
        p.chunk_cols = cc;
        p.order = NULL;
        p.c = which == GM_DX ? t->dx : a->o;
        if (which == GM_GEMM1 && g->split && g->split_min) { /* the tail split (gm_split) */
            p.split_min = g->split_min;
            p.split_ref = gm_split_ref(g);
            p.split_count = (uint32_t *)g->split;
            p.split_part = (float *)((char *)g->split + GM_SPLIT_HEADER);
        }
    }
    int grid = hk.num_ctas > 0 ? hk.num_ctas : g->num_sms;
    const int cl = g->cluster_ctas > 0 && grid >= 2; /* 2-CTA clusters: an even grid, at most what fits */
    if (cl) grid = (grid < g->cluster_ctas ? grid : g->cluster_ctas) / 2 * 2;
    p.group = g->group[l1] ? g->group[l1] : gm_group_for(p.k);
    p.narrow = g->narrow;
    if (cl) p.group = p.group / 2 > 1 ? p.group / 2 : 1; /* the walk's units are pairs of blocks there */
    p.pdl = hk.pdl;
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDim = dim3((unsigned)grid), cfg.blockDim = dim3(384), cfg.dynamicSmemBytes = GM_SMEM_BYTES;
    cfg.stream = (cudaStream_t)stream;
    cudaLaunchAttribute attr[2];
    int na = 0;
    if (hk.pdl) {
        attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[na++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (cl) {
        attr[na].id = cudaLaunchAttributeClusterDimension;
        attr[na].val.clusterDim.x = 2, attr[na].val.clusterDim.y = 1, attr[na++].val.clusterDim.z = 1;
    }
    cfg.attrs = attr, cfg.numAttrs = (unsigned)na;
    /* maps: A, B, B halves (GEMM0, GEMM1), C, gu store (GEMM0 with args.gu; the others ignore it) */
    const CUtensorMap *m[5];
    int kern;
    if (which == GM_GEMM0) {
        const CUtensorMap *mm[5] = {&g->a0, &g->b0, &g->b0h, t && t->h ? &tc : &g->c0, t ? &tg : &g->c0};
        memcpy(m, mm, sizeof m);
        kern = gated ? GM_K_GATED : GM_K_GELU;
    } else if (which == GM_GEMM1) {
        const CUtensorMap *mm[5] = {t && t->h ? &ta : &g->a1, &g->b1, &g->b1h, &g->c1, &g->c1};
        memcpy(m, mm, sizeof m);
        kern = GM_K_GEMM1;
    } else if (which == GM_G) {
        const CUtensorMap *mm[5] = {&ta, &g->b2, &tg, &tc, &th}; /* tmbh: gu, tmg: h (G's epilogue operands) */
        memcpy(m, mm, sizeof m);
        kern = gated ? GM_K_G_GATED : GM_K_G_GELU;
    } else {
        const CUtensorMap *mm[5] = {&ta, &g->b3, &g->b3, &tc, &tc};
        memcpy(m, mm, sizeof m);
        kern = GM_K_DX;
    }
    return (int)cudaLaunchKernelEx(&cfg, gm_kernels[cl][kern], *m[0], *m[1], *m[2], *m[3], *m[4], p);
}

extern "C" int comet_gemm_warm(void) {
    for (int i = 0; i < 2 * GM_NKERNELS; i++) {
        cudaFuncAttributes a;
        cudaError_t e = cudaFuncGetAttributes(&a, (const void *)gm_kernels[i / GM_NKERNELS][i % GM_NKERNELS]);
        if (e != cudaSuccess) return (int)e;
    }
    return 0;
}

extern "C" int comet_gemm0_launch(const comet_gemm_t *g, void *stream, const comet_gemm_hooks_t *hooks) {
    return gm_launch(g, GM_GEMM0, NULL, stream, hooks);
}

extern "C" int comet_gemm0_train_launch(const comet_gemm_t *g, const comet_gemm_train_t *t, void *stream,
                                        const comet_gemm_hooks_t *hooks) {
    return t ? gm_launch(g, GM_GEMM0, t, stream, hooks) : (int)cudaErrorInvalidValue;
}

extern "C" int comet_gemm1_launch(const comet_gemm_t *g, void *stream, const comet_gemm_hooks_t *hooks) {
    return gm_launch(g, GM_GEMM1, NULL, stream, hooks);
}

extern "C" int comet_gemm1_train_launch(const comet_gemm_t *g, const comet_gemm_train_t *t, void *stream,
                                        const comet_gemm_hooks_t *hooks) {
    return t ? gm_launch(g, GM_GEMM1, t, stream, hooks) : (int)cudaErrorInvalidValue;
}

extern "C" int comet_gemm_g_launch(const comet_gemm_t *g, const comet_gemm_train_t *t, void *stream,
                                   const comet_gemm_hooks_t *hooks) {
    return gm_launch(g, GM_G, t, stream, hooks);
}

extern "C" int comet_gemm_dx_launch(const comet_gemm_t *g, const comet_gemm_train_t *t, void *stream,
                                    const comet_gemm_hooks_t *hooks) {
    return gm_launch(g, GM_DX, t, stream, hooks);
}
