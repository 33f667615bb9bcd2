/*
 * gemm.h - comet's Hopper (sm_90a) grouped GEMM for the MoE layer: the C ABI
 * of src/cuda/gemm.cu. It is the v8 approach of dev/gemm (TMA + wgmma
 * m64n256k16, warp-specialised, persistent, stmatrix + TMA-store epilogue)
 * driven by the device-resident routing plan (src/plan/plan.h): the number of
 * row blocks is read on the device, so nothing here syncs with the host.
 *
 *   GEMM0: for every plan row block b (expert e, rows [row_start,
 *          row_start + num_rows) of a):  h[rows, n] = act(a[rows] W1[e]^T),
 *          n in [0, F_local); gated SiLU pairs gate row n with up row
 *          F_local + n inside one 256-wide tile; GELU is the erf form.
 *          Tiles in expert order (each expert's weights read from DRAM about
 *          once), or in l0_order (local first: hooks.l0_order), in groups
 *          of 4-16 blocks (gemm.cu).
 *   GEMM1: o[rows, c] = h[rows] W2[e]^T, c in [0, H); tiles column-chunk
 *          major (all blocks of chunk 0, then chunk 1, ...); in a short
 *          walk whose last wave would run part empty, the last blocks'
 *          tiles split over K (comet_gemm_split_bytes).
 * The backward's data-gradient GEMMs (include/comet.h "Backward", steps 2, 4, 5), both with B
 * read MN-major (the weights as stored, through wgmma's transpose bit):
 *   G:     for every plan row block (expert e), G[rows, n] = dy[rows] W2[e], n in [0, F_local),
 *          fp32, never stored; the epilogue, with w = plan.rows[r].weight and dA = w G:
 *          gated, (g, u) = gu[r, n], gu[r, F_local + n], s = sigmoid(g),
 *          dH[r, n] = bf16(dA u s (1 + g (1 - s))), dH[r, F_local + n] = bf16(dA g s);
 *          GELU, dH[r, n] = bf16(dA gelu'(g)); and dwp[r, n / 256] = the row's <G, h> over
 *          the 256 columns of n's tile (fp32, a fixed order), which the layer sums over a
 *          row's tiles in ascending order. Padding rows of a block get dH = 0 (and no dwp).
 *          Tile walk of GEMM0 (l0_order too), tiles of 256 G columns.
 *   dX:    dx[rows, c] = dH[rows] W1[e], c in [0, H), K = w1_rows; GEMM1's walk, chunks,
 *          chunk_done and push (never the tail split).
 * GEMM0 launched with a gu buffer (comet_gemm0_train_launch) also stores the pre-activation
 * (the training forward's saved state, the backward's recompute); its h keeps the same bits.
 * Rounding points of include/comet.h: fp32 accumulation; activation in fp32
 * (comet_gelu_fast of src/core/numerics.h, within 1e-6 of the exact GELU for
 * g >= -2; SiLU with the SFU's ex2 and rcp, within ~2^-22 of comet_silu), h
 * and o stored bf16 (RNE).
 * Padding rows of a block (num_rows < tile_m) are never written (G's dH excepted: zeros).
 * G's activation backward is in fp32 with the SFU's sigmoid (ex2, rcp: ~2^-22 relative to
 * comet_silu_gated_backward's expf and divide) and gelu' from comet_gelu_fast (a few 1e-6),
 * so dH differs from comet_cpu_backward_row's by a bf16 rounding flip at most, rarely, besides
 * G's summation order.
 *
 * What it is not: a general GEMM (only the two MoE shapes above), nor the
 * layer's kernel chain (layer_chain.cu uses the hooks below), nor a fallback: shapes that
 * comet_gemm_check rejects need the SIMT kernels of layer/simt_gemm.cuh.
 * Not part of the public API. No CUDA header needed to include this one.
 */
#ifndef COMET_CUDA_GEMM_H
#define COMET_CUDA_GEMM_H

#include <stddef.h>
#include <stdint.h>

#include "../core/numerics.h"
#include "../core/options.h"
#include "../plan/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Row-block height the kernels need (the plan's tile_m). */
#define COMET_GEMM_TILE_M 128
/* Column tile of GEMM1 (and of GELU GEMM0); GEMM1 chunk widths are multiples of it. */
#define COMET_GEMM_TILE_N 256
/* Ranks GEMM1 can push its output rows to (comet_gemm_args_t.push). */
#define COMET_GEMM_MAX_PUSH 8

/* What one layer's grouped GEMMs work on; all pointers are device pointers. */
typedef struct {
    comet_dims_t d;            /* dims of this rank (plan.h) */
    const void *plan_ws;       /* plan workspace (comet_plan_workspace_bytes(&d)), built on the device or copied there */
    const comet_bf16_t *a;     /* (max_rows_padded, H) gathered token rows */
    const comet_bf16_t *w1;    /* (E_local, w1_rows, H) */
    comet_bf16_t *h;           /* (max_rows_padded, F_local) */
    const comet_bf16_t *w2;    /* (E_local, H, F_local) */
    comet_bf16_t *o;           /* (max_rows_padded, H) */
    /* push[q] != NULL (q < COMET_GEMM_MAX_PUSH): rank q's receive buffer (a
     * peer pointer), where GEMM1 may also store each row of o whose token
     * lives on rank q (plan row: src_rank q, src_token t, slot j), as row
     * (d.tp_rank * d.max_tokens + t) * d.topk + j. Used by launches whose
     * hooks say push; NULL for this rank itself. */
    comet_bf16_t *push[COMET_GEMM_MAX_PUSH];
    uint32_t *sched;           /* device, 4 words zeroed once, kept as long as the GEMM (the tile
                                * counters; every launch leaves them 0), or NULL: prepare allocates
                                * and zeroes its own (synchronous calls: not inside a stream capture) */
    void *split;               /* device, comet_gemm_split_bytes(&d) bytes, its first 1 KiB zeroed once and
                                * kept as long as the GEMM (GEMM1's tail split: counters, fp32 partials),
                                * or NULL: no split, unless sched is NULL too: prepare then allocates its own */
    comet_gemm_knobs_t knobs;  /* cluster, narrow, group, split (src/core/options.h) */
} comet_gemm_args_t;

/* The buffers of the training launches (comet_gemm0_train_launch, comet_gemm_g_launch,
 * comet_gemm_dx_launch), given at each launch since a micro-batch's saved state lives in the
 * caller's memory (their tensor maps are encoded on the host at the launch: no GPU call, fine
 * inside a stream capture). Device pointers, 16-byte aligned; NULL where a launch does not use
 * one (a launch missing one it needs returns cudaErrorInvalidValue). Rows are plan rows. */
typedef struct {
    comet_bf16_t *gu;       /* (max_rows_padded, w1_rows) pre-activation, [g|u] gated (gate at column n,
                             * up at F_local + n), g GELU: GEMM0 stores it, G reads it */
    comet_bf16_t *h;        /* the forward's h (max_rows_padded, F_local), NULL: args.h: GEMM0 (train)
                             * stores it there, GEMM1 (train) and G read it (a saving forward's h goes
                             * straight into the caller's saved state) */
    const comet_bf16_t *dy; /* G's A: (max_rows_padded, H), dy's gathered rows */
    comet_bf16_t *dh;       /* G's output and dX's A: (max_rows_padded, w1_rows), [dg|du] gated, dg GELU */
    float *dwp;             /* G: (max_rows_padded, comet_gemm_dwp_tiles(&d)) fp32 partials of <G, h> */
    comet_bf16_t *dx;       /* dX's output (max_rows_padded, H); with hooks.push also into args.push as
                             * GEMM1's o rows */
    uint32_t *sched;        /* device, 4 words zeroed once and the same at every launch (G's and dX's tile
                             * counters, each launch leaves them 0), or NULL: g's own, which prepare
                             * allocated when args.sched was NULL (else the launch refuses) */
} comet_gemm_train_t;

/* Optional hooks of one launch; a zeroed struct (or NULL) means none. */
typedef struct {
    /* block_ready != NULL: before the first load of a tile of row block b (the
     * block id, index into plan.blocks) the producer spins until
     * ld.acquire.gpu(block_ready[b]) >= *epoch (device memory, read once at
     * kernel start, so a captured graph replays it), then fence.proxy.async.global,
     * then TMA. A wait longer than timeout_ns (0: 10 s) writes rank, role,
     * tile, block, value and epoch into timeout_report (when set) and traps.
     * (No printf in the kernel: any call makes ptxas serialise the wgmmas.) */
    const uint64_t *block_ready;
    const uint64_t *epoch;
    /* GEMM0 and G: walk the row blocks in the plan's l0_order (local rows first,
     * for a launch that waits on block_ready while they arrive) instead of
     * expert order. Expert order reads each expert's W1 about once: the stages of
     * l0_order split every expert's blocks, so its W1 tiles come from DRAM
     * again (Mixtral EP2, 4096 tokens a rank, H200: 3.85 -> 2.54 GB of DRAM
     * reads, +3.4% sustained, dev/NOTES.md). */
    int l0_order;
    /* chunk_done != NULL (GEMM1, dX): after a 128 x 256 tile of chunk c is stored
     * and its TMA stores completed, red.release.gpu.add(chunk_done[c], 1): per
     * call chunk c gains num_blocks * ceil(width_c / 256). The forward's
     * chain uses no chunks (test_gemm_gpu checks the hook); it is there for a
     * combine that runs chunk by chunk beside GEMM1, the backward's dX. */
    uint64_t *chunk_done;
    /* skip != NULL: when *skip != 0 at kernel start, do nothing (the layer's
     * "some rank's input is invalid" flag). */
    const uint32_t *skip;
    int num_ctas;              /* persistent CTAs (one per SM); 0 = every SM */
    int pdl;                   /* launch as a programmatic dependent of the kernel before it in the
                                * stream: CTAs may start once that kernel triggers launch_dependents
                                * (griddepcontrol), on the SMs it leaves free; its results must come
                                * through block_ready (the GEMM waits for it, griddepcontrol.wait,
                                * only before exiting, so its completion implies the primary's) */
    int push;                  /* GEMM1 and dX: also store each o row into args.push[its home rank] (generic
                                * 16-byte stores from the epilogue's staging buffer; over NVLink for peers) */
    int chunk_cols;            /* GEMM1 and dX column-chunk width, multiple of 256; 0 = H (one chunk) */
    uint64_t timeout_ns;
    /* 8 words of host-mapped memory (cudaHostAlloc(..., cudaHostAllocMapped),
     * device pointer here), zeroed by the caller; filled on a timeout and
     * readable on the host after the trap (comet_gemm_timeout_message). */
    uint64_t *timeout_report;
} comet_gemm_hooks_t;

typedef struct comet_gemm comet_gemm_t; /* prepared tensor maps + pointers (host memory) */

/* NULL when the Hopper kernels support dims d, else a sentence saying why not
 * (the layer then falls back to the SIMT kernels). Requirements: tile_m == 128;
 * H % 64 == 0; F_local % 8 == 0; row counts and
 * E_local * rows of the stacked weights below 2^31; fewer than 2^29 tiles
 * (max_rows_padded / 128 x max(H, F_local) / 128). Needs no GPU. */
const char *comet_gemm_check(const comet_dims_t *d);

/* Columns of G a dwp partial covers, and the partials a row has (ceil(F_local / 256)): row r's
 * tile i at dwp[r * comet_gemm_dwp_tiles(d) + i]. */
#define COMET_GEMM_DWP_COLS 256
int64_t comet_gemm_dwp_tiles(const comet_dims_t *d);

/* Bytes of comet_gemm_args_t.split for dims d and knobs.split_min: 0 when
 * GEMM1 never splits (K too short for two pieces, or split_min 0), else 16
 * MiB + 1 KiB.
 * GEMM1's tail split: when its tiles (at most 6 waves of them) leave the
 * last wave part empty, the tiles of the last few row blocks run as 2-8
 * pieces over K, each an fp32
 * partial, summed in piece order by the CTA that completes the tile; which
 * tiles split and where depends only on the plan's block count, the shape
 * and the device's SM count, so every launch mode computes the same bits
 * (gm_split in gemm.cu). */
size_t comet_gemm_split_bytes(const comet_dims_t *d, int split_min);

/* Build the tensor maps once per layer (host, no kernel launch; the tile
 * counters are args->sched, or, when that is NULL, 16 bytes of device memory
 * allocated and zeroed here). Two GEMMs that may run at the same time must not
 * share counters. args->knobs: group, row blocks per group of the tile walk
 * instead of the rule in gemm.cu (4 to 16 by K); cluster (the default),
 * pairs of blocks of one expert share each B tile (multicast), grids then
 * even, at most what fits as clusters; narrow 0, the gated GEMM0's last h
 * tile of <= 64 columns runs at full width, masked, instead of half width.
 * Returns 0 and *out, or -1 with a message in err. Device pointers of args may
 * not move afterwards; comet_gemm_destroy frees *out. */
int comet_gemm_prepare(const comet_gemm_args_t *args, comet_gemm_t **out, char *err, size_t err_len);
void comet_gemm_destroy(comet_gemm_t *g);
/* CTAs the launches of g run as 2-CTA clusters at most (even), or 0: no clusters. */
int comet_gemm_cluster_ctas(const comet_gemm_t *g);

/* GEMM1's tail split for a plan of num_blocks row blocks: the pieces a split
 * tile runs as (1: no split) and, in *first_block (may be NULL), the first
 * block whose tiles split (the rest after it). Host only, no GPU call. */
int comet_gemm_split_of(const comet_gemm_t *g, int num_blocks, int *first_block);

/* Host: 1 and a message naming rank, role, tile and block when the report
 * (host view of hooks.timeout_report) records a timeout, else 0. */
int comet_gemm_timeout_message(const uint64_t *report, char *buf, size_t len);

/* Enqueue GEMM0+activation / GEMM1 on stream (cudaStream_t as void *).
 * Returns the launch status (cudaError_t as int). hooks may be NULL.
 * CTAs claim tiles from a device counter of g (one for GEMM0, one for GEMM1),
 * so one g must not run two GEMM0s (or two GEMM1s) at the same time. */
int comet_gemm0_launch(const comet_gemm_t *g, void *stream, const comet_gemm_hooks_t *hooks);
/* Load the GEMM kernels on the current device now (lazy loading while another
 * kernel spins on a flag can deadlock). Returns a cudaError_t as int. */
int comet_gemm_warm(void);
int comet_gemm1_launch(const comet_gemm_t *g, void *stream, const comet_gemm_hooks_t *hooks);
/* GEMM0 that also stores the pre-activation into t->gu (h into t->h or args.h, the same bits
 * as comet_gemm0_launch's); GEMM0's tile counters and hooks. */
int comet_gemm0_train_launch(const comet_gemm_t *g, const comet_gemm_train_t *t, void *stream,
                             const comet_gemm_hooks_t *hooks);
/* GEMM1 reading h from t->h (NULL: args.h); GEMM1's tile counters and hooks. */
int comet_gemm1_train_launch(const comet_gemm_t *g, const comet_gemm_train_t *t, void *stream,
                             const comet_gemm_hooks_t *hooks);
/* The backward's G (t: dy, gu, h, dh, dwp) and dX (t: dh, dx), as above; hooks as GEMM0's (G:
 * block_ready, epoch, l0_order, skip, num_ctas, pdl, timeout) and GEMM1's (dX: the same but
 * l0_order, plus chunk_done, push, chunk_cols). Their own tile counters (t->sched): G and dX
 * may run beside GEMM0 and GEMM1 of the same g, not beside another G or dX. */
int comet_gemm_g_launch(const comet_gemm_t *g, const comet_gemm_train_t *t, void *stream,
                        const comet_gemm_hooks_t *hooks);
int comet_gemm_dx_launch(const comet_gemm_t *g, const comet_gemm_train_t *t, void *stream,
                         const comet_gemm_hooks_t *hooks);

#ifdef __cplusplus
}
#endif

#endif /* COMET_CUDA_GEMM_H */
