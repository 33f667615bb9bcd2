/*
 * gemm_wgrad.h - comet's Hopper (sm_90a) k-grouped weight-gradient GEMM for
 * the MoE layer's backward: the C ABI of src/cuda/gemm_wgrad.cu.
 *
 * For every local expert e (rows counted on the device by the routing plan,
 * src/plan/plan.h: e's valid rows are [expert_start[e], expert_start[e] +
 * expert_count[e]) of the padded, expert-grouped row order):
 *
 *     C_e (m x n) = sum over e's valid rows r, in plan row order, of a[r]^T b[r]
 *
 * a: (max_rows_padded, m) bf16 row-major, b: (max_rows_padded, n) bf16
 * row-major, c: (E_local, m, n). The rows are the reduction (K) dimension, so
 * both operands are MN-major for the tensor cores. The layer's two uses
 * (include/comet.h, Backward, rounding point 7):
 *     dW2_e (H x F_local)     : a = bf16(w dy) rows (m = H),  b = h rows (n = F_local)
 *     dW1_e (w1_rows x H)     : a = dH rows (m = w1_rows),    b = x rows (n = H)
 * Rounding: fp32 accumulation over the rows, then c written bf16 (RNE,
 * rounded once), written fp32, or accumulated in fp32 (c += the sum, one add
 * per element, main-grad style: the TMA's reduce-add, round to nearest).
 * Padding rows (past expert_count inside an expert's padded span) never
 * contribute, whatever they hold (NaN too): in the last 64-row slice of an
 * expert the consumers zero the shared-memory rows past the count, in both
 * operands, before the tensor cores read them (gemm_wgrad.cu).
 * An expert with no rows: its c_e written as zeros, or left unchanged when
 * accumulating.
 * Deterministic: every output element is one CTA's sum over its expert's rows
 * in ascending 64-row slices, 16 rows per tensor-core step (no split over K,
 * no atomics), so repeated runs give the same bits.
 * No host sync: the row counts are read on the device at kernel start, so a
 * launch can be captured in a CUDA graph.
 *
 * Not part of the public API. No CUDA header needed to include this one.
 */
#ifndef COMET_CUDA_GEMM_WGRAD_H
#define COMET_CUDA_GEMM_WGRAD_H

#include <stddef.h>
#include <stdint.h>

#include "../core/numerics.h"
#include "../plan/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What the kernel does with c. */
typedef enum {
    COMET_WGRAD_BF16 = 0,    /* c (bf16) = bf16(sum), round to nearest even */
    COMET_WGRAD_F32 = 1,     /* c (fp32) = sum */
    COMET_WGRAD_F32_ADD = 2  /* c (fp32) += sum */
} comet_wgrad_out_t;

/* One weight-gradient GEMM; pointers are device pointers. */
typedef struct {
    comet_dims_t d;        /* dims of this rank (experts_local, max_rows_padded) */
    const void *plan_ws;   /* plan workspace (comet_plan_workspace_bytes(&d)) on the device */
    int64_t m, n;          /* output rows and columns per expert */
    const comet_bf16_t *a; /* (max_rows_padded, m) */
    const comet_bf16_t *b; /* (max_rows_padded, n) */
    void *c;               /* (experts_local, m, n): bf16 for COMET_WGRAD_BF16, else fp32 */
    int out;               /* comet_wgrad_out_t */
} comet_wgrad_args_t;

/* Optional hooks of one launch; a zeroed struct (or NULL) means none. */
typedef struct {
    const uint32_t *skip; /* != NULL: when *skip != 0 at kernel start, do nothing */
    int num_ctas;         /* persistent CTAs; 0 = one per SM */
} comet_wgrad_hooks_t;

typedef struct comet_wgrad comet_wgrad_t; /* prepared tensor maps + pointers (host memory) */

/* NULL when the kernel supports an m x n output per expert, else a sentence
 * saying why not. Requirements: m, n > 0 and multiples of 8 (16-byte rows
 * for the tensor maps; tiles past m or n are masked at the store), both below
 * 2^24. Needs no GPU. */
const char *comet_wgrad_check(int64_t m, int64_t n);

/* Build the tensor maps (host, no kernel launch, no allocation on the
 * device). Returns 0 and *out, or -1 with a message in err. Device pointers
 * of args may not move afterwards; comet_wgrad_destroy frees *out. */
int comet_wgrad_prepare(const comet_wgrad_args_t *args, comet_wgrad_t **out, char *err, size_t err_len);
void comet_wgrad_destroy(comet_wgrad_t *g);

/* Enqueue the GEMM on stream (cudaStream_t as void *); hooks may be NULL.
 * Returns the launch status (cudaError_t as int). No tile counters (CTAs
 * stride over the tiles), so nothing needs resetting between launches. */
int comet_wgrad_launch(const comet_wgrad_t *g, void *stream, const comet_wgrad_hooks_t *hooks);

#ifdef __cplusplus
}
#endif

#endif /* COMET_CUDA_GEMM_WGRAD_H */
