/*
 * gemm_bench.cu - speed of comet's Hopper grouped GEMM (src/cuda/gemm.h):
 * GEMM0 + gated SiLU and GEMM1 on one GPU for MoE model shapes at M tokens,
 * EP = 1 and TP = 1 (all experts local, whole; or one rank's share, below), random
 * routing (uniform unless skewed, below), beside cuBLAS
 * run per expert (cublasGemmEx in a loop over the host's expert counts; no
 * activation) and cuBLAS dense with the same FLOPs (M = valid rows).
 * TFLOP/s count valid rows only: GEMM0 2*rows*H*2F, GEMM1 2*rows*F*H.
 * Times: median of NREP interleaved rounds (ours, loop, dense per round).
 * Also a sanity count: GEMM1 o vs the cuBLAS loop fed with our h (bf16 ulps).
 * Not a correctness test (tests/test_gemm_gpu.cu is). Prints a table, writes
 * JSON to $OUT/gemm_bench.json (or ./gemm_bench.json).
 * GEMM_BENCH_CURVE=1 (default off) adds the n_compute curve: ours only, with
 * hooks.num_ctas (persistent CTAs; the rest of the SMs are left to
 * communication) in {SMs, SMs-4, SMs-8, SMs-16, SMs-32, SMs/2} (SMs =
 * multiProcessorCount; values < 1 and repeats dropped), median of NREP
 * interleaved rounds of its own; efficiency = (TFLOP/s at n / TFLOP/s at SMs)
 * / (n / SMs), 1.0 = throughput proportional to the CTAs. Printed as a second
 * table and written as the JSON key "curve" of each model (list of
 * {num_ctas, gemm0_ms, gemm0_tflops, gemm0_eff, gemm1_ms, gemm1_tflops,
 * gemm1_eff}; the top level gains "sms").
 * Two dense shapes ride along: dense-4096 and dense-8192 (one expert, topk
 * 1, H = F = N tokens): their gemm1 row is our kernel on the dense N^3 GEMM
 * (plain epilogue) beside cuBLAS on the same; their token count is fixed.
 * GEMM_BENCH_EP=e (1..8, default 1): e ranks of `tokens` tokens each, the
 * GEMMs of rank 0 (its E/e experts, rows from every rank: the per-GPU GEMMs
 * of an EP=e layer at M = e x tokens); GEMM_BENCH_TP=t (default 1; e x t <=
 * 8): t times the ranks, each expert's ffn split t ways, rank 0's slice (the
 * per-GPU GEMMs of a TP=t layer: K of GEMM1 = ffn / t); GEMM_BENCH_SKEW=s (default 0): expert
 * popularity 1 + s N(0,1), the routing of harness/workload.c (comet_routing_draw).
 * Padding rows (an expert's last block past its rows) of A and h hold random
 * values, as in a layer whose buffers held other routings' rows;
 * GEMM_BENCH_PAD_ZERO=1 zeroes them (same work, fewer toggling bits).
 * GEMM_BENCH_SUSTAIN=S (seconds, default 0 off): also ours and the cuBLAS
 * loop each run GEMM0, then GEMM1, back to back for S seconds, alternated,
 * two rounds, as a layer bench keeps the GPU busy (the rounds above leave it idle
 * between launches, so they run at a clock a sustained load does not keep);
 * over each phase's second half: TFLOP/s, SM clock, power and GFLOP per
 * joule through NVML (harness/gpu_power.h; "n/a" without it), printed as a
 * third table and written as the JSON key "sustained".
 * Weight gradients (GEMM_BENCH_WGRAD=0 leaves them out; default on): the
 * backward's two k-grouped GEMMs on the same plan (rows, experts, EP/TP
 * slice), through comet's weight-gradient kernel (src/cuda/gemm_wgrad.h, bf16
 * out) beside a cuBLAS loop per expert (cublasGemmEx, bf16 in, fp32 compute,
 * bf16 out, one GEMM per expert on its valid rows, A^T through the op flags;
 * an expert without rows has its slice zeroed, as ours writes it) and cuBLAS
 * dense (one GEMM with K = valid rows from row 0, the same FLOPs):
 *     dW2_e (m = H, n = F_local):   a = w dy rows (rows x H), b = h rows (rows x F_local)
 *     dW1_e (m = w1_rows, n = H):   a = dH rows (rows x w1_rows), b = x rows (rows x H)
 * per expert C_e (m x n) = sum over e's rows r of a[r]^T b[r]; TFLOP/s count
 * 2*rows*m*n (valid rows). Fresh random inputs (nonzero; padding rows random
 * too, which ours must skip), run after the forward GEMMs' buffers are freed;
 * before the timed rounds both outputs are poisoned (0xff: NaN), ours and the
 * loop run once, and ours is checked against the loop: relative error
 * ||ours - loop|| / ||loop|| over every element of every expert <= 1e-2 (both
 * fp32 sums rounded once to bf16: ~2e-3 expected) and no element non-finite.
 * A failed check is flagged in the table and makes the exit status 1 (after
 * the table and the JSON). Printed as its own table (rows led by the GEMM's
 * name) and written as the JSON keys dw2_* and dw1_* of each model.
 * Usage: gemm_bench [tokens] [model ...]   (default 8192, the four presets and the two dense shapes)
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../src/core/validate.h"
#include "../src/cuda/gemm.h"
#include "../src/cuda/gemm_wgrad.h"
#include "../harness/workload.h"

#include "bench_check.h"
#include "../harness/gpu_power.h"

#define NREP 10
#define NCURVE 6 /* num_ctas points of the GEMM_BENCH_CURVE=1 curve */
#define WGRAD_TOL 1e-2 /* weight gradients: ||ours - cuBLAS loop|| / ||cuBLAS loop|| */

typedef struct {
    const char *name;
    int64_t hidden, ffn, experts, topk;
    int64_t tokens; /* 0: the command line's */
} bmodel_t;

static const bmodel_t models[] = {
    {"mixtral-8x7b", 4096, 14336, 8, 2},
    {"phi-3.5-moe", 4096, 6400, 16, 2},
    {"qwen2-moe", 2048, 1408, 64, 4},
    {"deepseek-v3", 7168, 2048, 256, 8},
    {"dense-4096", 4096, 4096, 1, 1, 4096},
    {"dense-8192", 8192, 8192, 1, 1, 8192},
};

/* uniform in [-scale, scale) from a hash of (i, seed); nonzero: the grid shifted by half a step, so that
 * no value is 0 (the weight gradients' inputs) */
__global__ void k_fill(uint16_t *p, size_t n, uint32_t seed, float scale, int nonzero = 0) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t x = (uint32_t)i * 2654435761u ^ seed;
        x ^= x >> 16, x *= 0x7feb352du, x ^= x >> 15, x *= 0x846ca68bu, x ^= x >> 16;
        p[i] = comet_f32_to_bf16((((float)(x & 0xffffff) + (nonzero ? 0.5f : 0.0f)) / 16777216.0f * 2.0f - 1.0f) * scale);
    }
}

/* sums[0] += sum (got - ref)^2, sums[1] += sum ref^2 over n bf16 elements; *nonfinite += elements where
 * either is not finite (those left out of the sums) */
__global__ void k_relerr(const uint16_t *got, const uint16_t *ref, size_t n, double *sums,
                         unsigned long long *nonfinite) {
    double dd = 0, rr = 0;
    unsigned long long nf = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float g = comet_bf16_to_f32(got[i]), f = comet_bf16_to_f32(ref[i]);
        if (!isfinite(g) || !isfinite(f)) {
            nf++;
            continue;
        }
        const double d = (double)g - (double)f;
        dd += d * d, rr += (double)f * (double)f;
    }
    for (int o = 16; o; o >>= 1) {
        dd += __shfl_down_sync(0xffffffffu, dd, o);
        rr += __shfl_down_sync(0xffffffffu, rr, o);
        nf += __shfl_down_sync(0xffffffffu, nf, o);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicAdd(&sums[0], dd), atomicAdd(&sums[1], rr);
        if (nf) atomicAdd(nonfinite, nf);
    }
}

/* zeroes rows[0..nrows) of a row-major matrix of `width` bf16 columns */
__global__ void k_zero_rows(uint16_t *p, const int32_t *rows, int nrows, int64_t width) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (int64_t)nrows * width;
         i += (int64_t)gridDim.x * blockDim.x)
        p[rows[i / width] * width + i % width] = 0;
}

/* elements of o (valid rows) farther than 2 bf16 ulps from ref */
__global__ void k_compare(const uint16_t *o, const uint16_t *ref, const int32_t *rows, int nrows, int64_t width,
                          unsigned long long *bad) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (int64_t)nrows * width;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = rows[i / width], c = i % width;
        float g = comet_bf16_to_f32(o[r * width + c]), f = comet_bf16_to_f32(ref[r * width + c]);
        float a = fabsf(f), ulp = a > 0 ? ldexpf(1.0f, ilogbf(a) - 7) : 0.0f;
        if (!(fabsf(g - f) <= 2.0f * ulp + 1e-6f)) atomicAdd(bad, 1ull);
    }
}

/* row-major C[M,N] = A[M,K] B[N,K]^T */
static void cublas_nt(cublasHandle_t h, const void *A, const void *B, void *C, int M, int N, int K, int lda, int ldb,
                      int ldc) {
    const float one = 1.0f, zero = 0.0f;
    CKB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_16BF, ldb, A, CUDA_R_16BF, lda, &zero, C,
                     CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* row-major C[m,n] = A[k,m]^T B[k,n] (A, B row-major, k rows: the reduction), bf16 out, fp32 compute.
 * Column-major, cuBLAS sees B as B' (n x k, ld n), A as A' (m x k, ld m) and C as C' = C^T (n x m,
 * ld n): C' = B^T A = B' A'^T, the transpose through the op flags. */
static void cublas_wgrad(cublasHandle_t h, const void *A, const void *B, void *C, int m, int n, int k) {
    const float one = 1.0f, zero = 0.0f;
    CKB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, n, m, k, &one, B, CUDA_R_16BF, n, A, CUDA_R_16BF, m, &zero, C,
                     CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

static int cmp_f(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}
static float median(float *v, int n) {
    qsort(v, (size_t)n, sizeof(float), cmp_f);
    return v[n / 2];
}

/* A sustained phase (sustain_phase): TFLOP/s, mean SM clock (MHz), mean power (W),
 * GFLOP per joule, NVML's clock-limit reasons (bits, OR over the samples). */
typedef struct {
    double tflops, mhz, watts, gflop_per_j;
    unsigned long long reasons;
} bsustain_t;

typedef struct {
    const char *name;
    double tf[2][3]; /* [gemm][ours, loop, dense] */
    double ms[2][3];
    int blocks, rows, rows_padded;
    int split, split_b0; /* GEMM1's tail split (comet_gemm_split_of): pieces (1: none), first split block */
    unsigned long long bad;
    int ncurve;                 /* 0: no curve */
    int curve_ctas[NCURVE];     /* curve_ctas[0] = SMs */
    double curve_ms[2][NCURVE]; /* [gemm][point] */
    double curve_tf[2][NCURVE];
    int nsus;                 /* sustained rounds (0: GEMM_BENCH_SUSTAIN off) */
    bsustain_t sus[2][2][2];  /* [gemm][ours, cuBLAS loop][round] */
    int wgrad;                /* weight gradients run (GEMM_BENCH_WGRAD) */
    const char *wskip[2];     /* != NULL: why this weight gradient was not run (comet_wgrad_check) */
    int64_t wm[2], wn[2];     /* [dW2, dW1]: output rows and columns per expert */
    double wtf[2][3], wms[2][3]; /* [dW2, dW1][ours, loop, dense] */
    double wrel[2];           /* ||ours - loop|| / ||loop|| */
    unsigned long long wnonfinite[2]; /* elements of ours or the loop not finite */
    int wok[2];               /* check passed */
} bresult_t;

/* num_ctas points of the curve: SMs first, then fewer; drops values < 1 and repeats */
static int curve_points(int sms, int *pts) {
    const int want[NCURVE] = {sms, sms - 4, sms - 8, sms - 16, sms - 32, sms / 2};
    int n = 0;
    for (int i = 0; i < NCURVE; i++) {
        int dup = want[i] < 1;
        for (int j = 0; j < n; j++) dup |= pts[j] == want[i];
        if (!dup) pts[n++] = want[i];
    }
    return n;
}

/* (TFLOP/s at point p / TFLOP/s at SMs) / (num_ctas / SMs); 1.0: throughput proportional to the CTAs */
static double curve_eff(const bresult_t *r, int gm, int p, int sms) {
    return r->curve_tf[gm][p] / r->curve_tf[gm][0] / ((double)r->curve_ctas[p] / sms);
}

/* What a timed variant launches: ours (v 0), cuBLAS per expert (1), cuBLAS dense over the rows (2). */
typedef struct {
    comet_gemm_t *g;
    cublasHandle_t cub;
    const uint16_t *a, *w1, *h, *w2;
    uint16_t *hbuf, *oref; /* cuBLAS outputs: GEMM0 (gate|up, no activation), GEMM1 */
    const int64_t *cnt;    /* [E] rows per expert */
    const int32_t *start;  /* [E] padded row offsets */
    int64_t E, H, F, w1_rows;
    int nrows;
} bvar_t;

static void launch_variant(const bvar_t *b, int gm, int v) {
    const int64_t H = b->H, F = b->F;
    if (v == 0) {
        if (gm == 0) CK((cudaError_t)comet_gemm0_launch(b->g, 0, NULL));
        else CK((cudaError_t)comet_gemm1_launch(b->g, 0, NULL));
    } else if (v == 1) {
        for (int64_t e = 0; e < b->E; e++) {
            if (!b->cnt[e]) continue;
            const int64_t r0 = b->start[e];
            if (gm == 0)
                cublas_nt(b->cub, b->a + r0 * H, b->w1 + e * b->w1_rows * H, b->hbuf + r0 * 2 * F, (int)b->cnt[e],
                          (int)b->w1_rows, (int)H, (int)H, (int)H, (int)(2 * F));
            else
                cublas_nt(b->cub, b->h + r0 * F, b->w2 + e * H * F, b->oref + r0 * H, (int)b->cnt[e], (int)H, (int)F,
                          (int)F, (int)F, (int)H);
        }
    } else if (gm == 0) {
        cublas_nt(b->cub, b->a, b->w1, b->hbuf, b->nrows, (int)b->w1_rows, (int)H, (int)H, (int)H, (int)(2 * F));
    } else {
        cublas_nt(b->cub, b->h, b->w2, b->oref, b->nrows, (int)H, (int)F, (int)F, (int)F, (int)H);
    }
}

/* What a timed weight-gradient variant launches: ours (v 0), cuBLAS per expert (1), cuBLAS dense, K = the
 * valid rows from row 0 (2). */
typedef struct {
    comet_wgrad_t *g;
    cublasHandle_t cub;
    const uint16_t *a, *b; /* (max_rows_padded, m), (max_rows_padded, n) */
    uint16_t *cref;        /* cuBLAS output (E, m, n) */
    const int64_t *cnt;    /* [E] rows per expert */
    const int32_t *start;  /* [E] padded row offsets */
    int64_t E, m, n;
    int nrows;
} bwvar_t;

static void launch_wvariant(const bwvar_t *b, int v) {
    const int64_t m = b->m, n = b->n;
    if (v == 0) {
        CK((cudaError_t)comet_wgrad_launch(b->g, 0, NULL));
    } else if (v == 1) {
        for (int64_t e = 0; e < b->E; e++) {
            uint16_t *c = b->cref + e * m * n;
            if (!b->cnt[e]) CK(cudaMemsetAsync(c, 0, 2 * (size_t)(m * n), 0)); /* as ours writes it */
            else
                cublas_wgrad(b->cub, b->a + b->start[e] * m, b->b + b->start[e] * n, c, (int)m, (int)n,
                             (int)b->cnt[e]);
        }
    } else {
        cublas_wgrad(b->cub, b->a, b->b, b->cref, (int)m, (int)n, b->nrows);
    }
}

/* The backward's two weight gradients on run_model's plan (d_ws on the device, cnt and start on the host):
 * which 0 dW2 (m = H, n = F_local), 1 dW1 (m = w1_rows, n = H). Timed as run_model's GEMMs (median of NREP
 * interleaved rounds); checked once first, outputs poisoned. */
static void run_wgrad(const bmodel_t *m, const comet_dims_t *d, const void *d_ws, const int64_t *cnt,
                      const int32_t *start, int nrows, cublasHandle_t cub, bresult_t *res) {
    const int64_t H = d->hidden, F = d->ffn_local, E = d->experts_local, MR = d->max_rows_padded;
    const int64_t ms_[2] = {H, d->w1_rows}, ns_[2] = {F, H};
    res->wgrad = 1;
    int64_t amax = 0, bmax = 0, cmax = 0;
    for (int w = 0; w < 2; w++) {
        res->wm[w] = ms_[w], res->wn[w] = ns_[w];
        res->wskip[w] = comet_wgrad_check(ms_[w], ns_[w]);
        if (res->wskip[w]) {
            fprintf(stderr, "%s: %s skipped: %s\n", m->name, w ? "dW1" : "dW2", res->wskip[w]);
            continue;
        }
        amax = ms_[w] > amax ? ms_[w] : amax, bmax = ns_[w] > bmax ? ns_[w] : bmax;
        cmax = ms_[w] * ns_[w] > cmax ? ms_[w] * ns_[w] : cmax;
    }
    if (!cmax) return;
    uint16_t *a, *b, *c, *cref;
    double *d_sums;
    unsigned long long *d_nf;
    CK(cudaMalloc(&a, 2 * (size_t)(MR * amax)));
    CK(cudaMalloc(&b, 2 * (size_t)(MR * bmax)));
    CK(cudaMalloc(&c, 2 * (size_t)(E * cmax)));
    CK(cudaMalloc(&cref, 2 * (size_t)(E * cmax)));
    CK(cudaMalloc(&d_sums, 2 * sizeof(double)));
    CK(cudaMalloc(&d_nf, sizeof(unsigned long long)));
    cudaEvent_t ev[2];
    CK(cudaEventCreate(&ev[0]));
    CK(cudaEventCreate(&ev[1]));
    for (int w = 0; w < 2; w++) {
        if (res->wskip[w]) continue;
        const int64_t wm = ms_[w], wn = ns_[w];
        const size_t total = (size_t)(E * wm * wn);
        /* fresh inputs, every row (padding rows too) random and nonzero */
        k_fill<<<1024, 256>>>(a, (size_t)(MR * wm), 11 + 2 * w, 1.0f, 1);
        CK(cudaGetLastError());
        k_fill<<<1024, 256>>>(b, (size_t)(MR * wn), 12 + 2 * w, 1.0f, 1);
        CK(cudaGetLastError());
        comet_wgrad_args_t wa;
        memset(&wa, 0, sizeof wa);
        wa.d = *d, wa.plan_ws = d_ws, wa.m = wm, wa.n = wn, wa.a = a, wa.b = b, wa.c = c, wa.out = COMET_WGRAD_BF16;
        comet_wgrad_t *g;
        char err[256];
        if (comet_wgrad_prepare(&wa, &g, err, sizeof err)) {
            fprintf(stderr, "%s: wgrad prepare (%s): %s\n", m->name, w ? "dW1" : "dW2", err);
            exit(1);
        }
        const bwvar_t bw = {g, cub, a, b, cref, cnt, start, E, wm, wn, nrows};
        /* check: both outputs poisoned, one run each, ours against the loop over every element */
        CK(cudaMemset(c, 0xff, 2 * total));
        CK(cudaMemset(cref, 0xff, 2 * total));
        launch_wvariant(&bw, 0);
        launch_wvariant(&bw, 1);
        CK(cudaMemset(d_sums, 0, 2 * sizeof(double)));
        CK(cudaMemset(d_nf, 0, sizeof(unsigned long long)));
        k_relerr<<<1024, 256>>>(c, cref, total, d_sums, d_nf);
        CK(cudaGetLastError());
        double sums[2];
        CK(cudaMemcpy(sums, d_sums, sizeof sums, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(&res->wnonfinite[w], d_nf, sizeof(unsigned long long), cudaMemcpyDeviceToHost));
        res->wrel[w] = sums[1] > 0 ? sqrt(sums[0] / sums[1]) : INFINITY;
        res->wok[w] = res->wnonfinite[w] == 0 && res->wrel[w] <= WGRAD_TOL;
        if (!res->wok[w])
            fprintf(stderr, "%s: %s CHECK FAILED: relative error %.3e against the cuBLAS loop (tolerance %g), %llu "
                    "elements not finite\n", m->name, w ? "dW1" : "dW2", res->wrel[w], WGRAD_TOL, res->wnonfinite[w]);
        float t[3][NREP];
        for (int rep = -2; rep < NREP; rep++)
            for (int v = 0; v < 3; v++) {
                CK(cudaEventRecord(ev[0]));
                launch_wvariant(&bw, v);
                CK(cudaEventRecord(ev[1]));
                CK(cudaEventSynchronize(ev[1]));
                if (rep >= 0) CK(cudaEventElapsedTime(&t[v][rep], ev[0], ev[1]));
            }
        CK(cudaGetLastError());
        const double fl = 2.0 * nrows * (double)wm * (double)wn;
        for (int v = 0; v < 3; v++) {
            const double ms = median(t[v], NREP);
            res->wms[w][v] = ms;
            res->wtf[w][v] = fl / (ms * 1e-3) / 1e12;
        }
        comet_wgrad_destroy(g);
    }
    CK(cudaEventDestroy(ev[0]));
    CK(cudaEventDestroy(ev[1]));
    CK(cudaFree(a));
    CK(cudaFree(b));
    CK(cudaFree(c));
    CK(cudaFree(cref));
    CK(cudaFree(d_sums));
    CK(cudaFree(d_nf));
}

static double wall_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* One sustained phase (GEMM_BENCH_SUSTAIN): variant v's GEMM gm back to
 * back for `secs` seconds, batches of 8 with one batch always queued; over the second half: rate, mean SM clock of the samples (one after
 * each batch), mean power (energy counter / time), GFLOP per joule, and the
 * clock-limit reasons seen (OR). Without NVML, or when a read failed, the
 * power fields stay 0 (printed "n/a"). The phase runs on past `secs` until a
 * batch has finished in its second half. */
static void sustain_phase(const bvar_t *b, int gm, int v, double secs, double flops, const gpu_power_t *pw,
                          bsustain_t *out) {
    cudaEvent_t done[2];
    CK(cudaEventCreateWithFlags(&done[0], cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&done[1], cudaEventDisableTiming));
    memset(out, 0, sizeof *out);
    const double t0 = wall_s();
    double th = 0, mhz = 0;
    long runs = 0, nmhz = 0;
    gpu_power_sample_t s0 = {0, 0, 0}, s;
    int half = 0, power = 1;
    for (long batch = 0;; batch++) {
        for (int i = 0; i < 8; i++) launch_variant(b, gm, v);
        CK(cudaEventRecord(done[batch & 1]));
        if (batch == 0) continue;
        CK(cudaEventSynchronize(done[(batch - 1) & 1])); /* batch - 1 finished, batch queued */
        const double t = wall_s() - t0;
        if (half) {
            runs += 8;
            if (power && gpu_power_read(pw, &s)) mhz += s.mhz, nmhz++, out->reasons |= s.reasons;
        } else if (t >= secs / 2) {
            half = 1, th = t;
            power = gpu_power_read(pw, &s0);
        }
        if (half && runs > 0 && t >= secs) { /* at least one batch in the second half */
            const double span = t - th;
            out->tflops = runs * flops / span / 1e12;
            if (power && nmhz && gpu_power_read(pw, &s)) {
                out->mhz = mhz / nmhz;
                out->watts = (s.joules - s0.joules) / span;
                out->gflop_per_j = out->watts > 0 ? out->tflops * 1e3 / out->watts : 0;
            }
            break;
        }
    }
    CK(cudaDeviceSynchronize());
    CK(cudaGetLastError());
    cudaEventDestroy(done[0]), cudaEventDestroy(done[1]);
}

/* Routing of the run (GEMM_BENCH_EP, GEMM_BENCH_TP, GEMM_BENCH_SKEW): ep x tp
 * ranks of T tokens each; the GEMMs are rank 0's (its E/ep experts, its
 * F/tp slice of each, rows from every rank). */
typedef struct {
    int ep, tp;
    double skew;
} brouting_t;

static void run_model(const bmodel_t *m, int64_t T, const brouting_t *br, cublasHandle_t cub, int sms, int curve,
                      double sustain, int pad_zero, int wgrad, const gpu_power_t *pw, bresult_t *res) {
    memset(res, 0, sizeof *res);
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    const int ep = m->experts == 1 ? 1 : br->ep, tp = m->experts == 1 ? 1 : br->tp; /* the dense shapes: one rank */
    const int world = ep * tp;
    if (m->experts % ep || m->ffn % tp) {
        fprintf(stderr, "%s: GEMM_BENCH_EP=%d does not divide its %lld experts or GEMM_BENCH_TP=%d its ffn %lld\n",
                m->name, ep, (long long)m->experts, tp, (long long)m->ffn);
        exit(2);
    }
    cfg.hidden = m->hidden, cfg.ffn = m->ffn, cfg.num_experts = m->experts, cfg.topk = m->topk;
    cfg.max_tokens_per_rank = T, cfg.tile_m = 128, cfg.ep = ep, cfg.tp = tp;
    comet_dims_t d;
    if (comet_dims_from_config(&cfg, world, 0, &d) != COMET_SUCCESS) {
        fprintf(stderr, "%s: %s\n", m->name, comet_last_error());
        exit(1);
    }
    const char *why = comet_gemm_check(&d);
    if (why) {
        fprintf(stderr, "%s: %s\n", m->name, why);
        exit(1);
    }
    const int64_t H = d.hidden, F = d.ffn_local, E = d.experts_local, K = m->topk, MR = d.max_rows_padded;
    int32_t *idx[COMET_GEMM_MAX_PUSH];
    float *w[COMET_GEMM_MAX_PUSH];
    int64_t tok[COMET_GEMM_MAX_PUSH];
    for (int s = 0; s < world; s++) {
        tok[s] = T;
        idx[s] = (int32_t *)malloc(sizeof(int32_t) * (size_t)(T * K + 1));
        w[s] = (float *)malloc(sizeof(float) * (size_t)(T * K + 1));
    }
    comet_routing_opts_t ro = {br->skew, 0, 0x9e3779b97f4a7c15ull ^ (uint64_t)m->experts};
    comet_rng_t rng = {ro.seed};
    if (comet_routing_draw(m->experts, K, world, tok, idx, w, &ro, &rng) != COMET_SUCCESS) {
        fprintf(stderr, "%s: routing: %s\n", m->name, comet_last_error());
        exit(1);
    }
    size_t ws_bytes = comet_plan_workspace_bytes(&d);
    void *ws = aligned_alloc(64, (ws_bytes + 63) / 64 * 64);
    comet_plan_t pl;
    comet_plan_carve(&d, ws, &pl);
    comet_plan_input_t in = {tok, (const int32_t *const *)idx, (const float *const *)w};
    comet_plan_build(&d, &in, &pl);
    const int nrows = pl.totals->num_rows;
    res->name = m->name, res->blocks = pl.totals->num_blocks, res->rows = nrows;
    res->rows_padded = pl.totals->num_rows_padded;
    const int npad = pl.totals->num_rows_padded - nrows;
    int32_t *valid_rows = (int32_t *)malloc(sizeof(int32_t) * (size_t)(pl.totals->num_rows_padded + 1));
    int32_t *pad_rows = valid_rows + nrows; /* after the valid ones */
    int nv = 0, np = 0;
    for (int64_t r = 0; r < pl.totals->num_rows_padded; r++)
        if (pl.rows[r].src_rank >= 0) valid_rows[nv++] = (int32_t)r;
        else pad_rows[np++] = (int32_t)r;

    void *d_ws;
    uint16_t *a, *w1, *w2, *h, *o, *oref, *hbuf;
    int32_t *d_valid;
    unsigned long long *d_bad;
    CK(cudaMalloc(&d_ws, ws_bytes));
    CK(cudaMemcpy(d_ws, ws, ws_bytes, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&a, 2 * (size_t)(MR * H)));
    CK(cudaMalloc(&w1, 2 * (size_t)(E * d.w1_rows * H)));
    CK(cudaMalloc(&w2, 2 * (size_t)(E * H * F)));
    CK(cudaMalloc(&h, 2 * (size_t)(MR * F)));
    CK(cudaMalloc(&hbuf, 2 * (size_t)(MR * 2 * F))); /* cuBLAS GEMM0 output (gate|up, no activation) */
    CK(cudaMalloc(&o, 2 * (size_t)(MR * H)));
    CK(cudaMalloc(&oref, 2 * (size_t)(MR * H)));
    CK(cudaMalloc(&d_valid, sizeof(int32_t) * (size_t)(pl.totals->num_rows_padded + 1)));
    CK(cudaMalloc(&d_bad, 8));
    CK(cudaMemcpy(d_valid, valid_rows, sizeof(int32_t) * (size_t)pl.totals->num_rows_padded, cudaMemcpyHostToDevice));
    k_fill<<<1024, 256>>>(a, (size_t)(MR * H), 1, 1.0f);
    k_fill<<<1024, 256>>>(w1, (size_t)(E * d.w1_rows * H), 2, 2.0f / sqrtf((float)H));
    k_fill<<<1024, 256>>>(w2, (size_t)(E * H * F), 3, 2.0f / sqrtf((float)F));
    k_fill<<<1024, 256>>>(h, (size_t)(MR * F), 4, 1.0f); /* GEMM0 writes the valid rows only */
    if (pad_zero && npad) {
        k_zero_rows<<<1024, 256>>>(a, d_valid + nrows, npad, H);
        k_zero_rows<<<1024, 256>>>(h, d_valid + nrows, npad, F);
    }
    CK(cudaDeviceSynchronize());

    comet_gemm_args_t ga;
    memset(&ga, 0, sizeof ga); /* no push targets; prepare allocates the tile counters */
    ga.knobs = comet_gemm_knobs_read(); /* COMET_GEMM_* as a layer created now reads them */
    ga.d = d, ga.plan_ws = d_ws, ga.a = a, ga.w1 = w1, ga.h = h, ga.w2 = w2, ga.o = o;
    comet_gemm_t *g;
    char err[256];
    if (comet_gemm_prepare(&ga, &g, err, sizeof err)) {
        fprintf(stderr, "%s: prepare: %s\n", m->name, err);
        exit(1);
    }
    res->split = comet_gemm_split_of(g, res->blocks, &res->split_b0);
    int64_t *cnt = (int64_t *)malloc(sizeof(int64_t) * (size_t)E);
    for (int64_t e = 0; e < E; e++) cnt[e] = pl.expert_count[e];

    cudaEvent_t ev[2];
    CK(cudaEventCreate(&ev[0]));
    CK(cudaEventCreate(&ev[1]));
    const bvar_t bv = {g, cub, a, w1, h, w2, hbuf, oref, cnt, pl.expert_start, E, H, F, d.w1_rows, nrows};
    float t[2][3][NREP];
    for (int rep = -2; rep < NREP; rep++)
        for (int gm = 0; gm < 2; gm++)
            for (int v = 0; v < 3; v++) {
                CK(cudaEventRecord(ev[0]));
                launch_variant(&bv, gm, v);
                CK(cudaEventRecord(ev[1]));
                CK(cudaEventSynchronize(ev[1]));
                if (rep >= 0) CK(cudaEventElapsedTime(&t[gm][v][rep], ev[0], ev[1]));
            }
    CK(cudaGetLastError());
    /* sanity: GEMM1 of ours vs the cuBLAS loop, both from our h (the dense run last wrote oref: redo the loop) */
    for (int64_t e = 0; e < E; e++)
        if (cnt[e]) {
            const int64_t r0 = pl.expert_start[e];
            cublas_nt(cub, h + r0 * F, w2 + e * H * F, oref + r0 * H, (int)cnt[e], (int)H, (int)F, (int)F, (int)F,
                      (int)H);
        }
    CK(cudaMemset(d_bad, 0, 8));
    k_compare<<<1024, 256>>>(o, oref, d_valid, nrows, H, d_bad);
    CK(cudaMemcpy(&res->bad, d_bad, 8, cudaMemcpyDeviceToHost));
    const double fl[2] = {2.0 * nrows * H * (double)d.w1_rows, 2.0 * nrows * F * (double)H};
    for (int gm = 0; gm < 2; gm++)
        for (int v = 0; v < 3; v++) {
            double ms = median(t[gm][v], NREP);
            res->ms[gm][v] = ms;
            res->tf[gm][v] = fl[gm] / (ms * 1e-3) / 1e12;
        }
    /* sustained: ours and the loop alternated, two rounds each */
    res->nsus = sustain > 0 ? 2 : 0;
    for (int gm = 0; gm < 2; gm++)
        for (int round = 0; round < res->nsus; round++)
            for (int v = 0; v < 2; v++) sustain_phase(&bv, gm, v, sustain, fl[gm], pw, &res->sus[gm][v][round]);
    /* n_compute curve: ours with num_ctas persistent CTAs, rounds interleaved over the points */
    res->ncurve = curve ? curve_points(sms, res->curve_ctas) : 0;
    const int most = comet_gemm_cluster_ctas(g); /* clusters: the launch runs an even count, at most this */
    for (int p = 0; most > 0 && p < res->ncurve; p++)
        res->curve_ctas[p] = (res->curve_ctas[p] < most ? res->curve_ctas[p] : most) / 2 * 2;
    if (res->ncurve) {
        float tc[2][NCURVE][NREP];
        for (int rep = -2; rep < NREP; rep++)
            for (int gm = 0; gm < 2; gm++)
                for (int p = 0; p < res->ncurve; p++) {
                    comet_gemm_hooks_t hk;
                    memset(&hk, 0, sizeof hk);
                    hk.num_ctas = res->curve_ctas[p];
                    CK(cudaEventRecord(ev[0]));
                    if (gm == 0) CK((cudaError_t)comet_gemm0_launch(g, 0, &hk));
                    else CK((cudaError_t)comet_gemm1_launch(g, 0, &hk));
                    CK(cudaEventRecord(ev[1]));
                    CK(cudaEventSynchronize(ev[1]));
                    if (rep >= 0) CK(cudaEventElapsedTime(&tc[gm][p][rep], ev[0], ev[1]));
                }
        CK(cudaGetLastError());
        for (int gm = 0; gm < 2; gm++)
            for (int p = 0; p < res->ncurve; p++) {
                double ms = median(tc[gm][p], NREP);
                res->curve_ms[gm][p] = ms;
                res->curve_tf[gm][p] = fl[gm] / (ms * 1e-3) / 1e12;
            }
    }
    comet_gemm_destroy(g);
    cudaEventDestroy(ev[0]), cudaEventDestroy(ev[1]);
    cudaFree(a), cudaFree(w1), cudaFree(w2), cudaFree(h), cudaFree(hbuf), cudaFree(o);
    cudaFree(oref), cudaFree(d_valid), cudaFree(d_bad);
    /* the backward's weight gradients on the same plan, in the memory the forward's buffers held */
    if (wgrad) run_wgrad(m, &d, d_ws, cnt, pl.expert_start, nrows, cub, res);
    cudaFree(d_ws);
    for (int s = 0; s < world; s++) free(idx[s]), free(w[s]);
    free(ws), free(valid_rows), free(cnt);
}

int main(int argc, char **argv) {
    int64_t T = argc > 1 ? atoll(argv[1]) : 8192;
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("gemm_bench: skipped (no GPU)\n");
        return 0;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const char *cv = getenv("GEMM_BENCH_CURVE"), *ev = getenv("GEMM_BENCH_EP"), *tv = getenv("GEMM_BENCH_TP"),
               *sv = getenv("GEMM_BENCH_SKEW"), *pv = getenv("GEMM_BENCH_SUSTAIN"), *zv = getenv("GEMM_BENCH_PAD_ZERO"),
               *wv = getenv("GEMM_BENCH_WGRAD");
    const int curve = cv && atoi(cv) != 0, sms = prop.multiProcessorCount;
    brouting_t br = {ev ? atoi(ev) : 1, tv ? atoi(tv) : 1, sv ? atof(sv) : 0.0};
    const double sustain = pv ? atof(pv) : 0.0;
    const int pad_zero = zv && atoi(zv) != 0, wgrad = !wv || atoi(wv) != 0;
    if (br.ep < 1 || br.tp < 1 || br.ep * br.tp > COMET_GEMM_MAX_PUSH || br.skew < 0 || T < 1 || !(sustain >= 0) ||
        sustain > 600) {
        fprintf(stderr, "gemm_bench: tokens >= 1, GEMM_BENCH_EP x GEMM_BENCH_TP in 1..%d, GEMM_BENCH_SKEW >= 0, "
                "GEMM_BENCH_SUSTAIN in 0..600 s\n", COMET_GEMM_MAX_PUSH);
        return 2;
    }
    gpu_power_t pw = {0, NULL};
    if (sustain > 0) {
        char bus[32];
        CK(cudaDeviceGetPCIBusId(bus, sizeof bus, 0));
        gpu_power_open(&pw, bus);
        if (!pw.ok) fprintf(stderr, "gemm_bench: NVML not available: the sustained rows have no clock or power\n");
    }
    cublasHandle_t cub;
    CKB(cublasCreate(&cub));
    bresult_t res[sizeof models / sizeof models[0]];
    int nres = 0;
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
        int want = argc <= 2;
        for (int a = 2; a < argc; a++) want |= strcmp(argv[a], models[i].name) == 0;
        if (!want) continue;
        run_model(&models[i], models[i].tokens ? models[i].tokens : T, &br, cub, sms, curve, sustain, pad_zero, wgrad,
                  &pw, &res[nres]);
        fprintf(stderr, "%s done\n", models[i].name);
        nres++;
    }
    char date[64];
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", gmtime(&now));
    printf("\ncomet grouped GEMM, %s, %s, %lld tokens a rank x EP=%d x TP=%d ranks (rank 0's experts and ffn slice; "
           "the dense shapes one rank), routing skew %g, padding rows %s, median of %d\n", prop.name, date, (long long)T,
           br.ep, br.tp, br.skew, pad_zero ? "zero" : "random", NREP);
    printf("TFLOP/s on valid rows (ms)  | ours: comet_gemm0 (+SiLU) / comet_gemm1 | cuBLAS loop per expert | cuBLAS dense M=rows\n");
    printf("%-13s %6s %6s %-6s | %-22s | %-22s | %-22s | %s\n", "model", "rows", "blocks", "gemm", "ours", "cuBLAS loop",
           "cuBLAS dense", "ours/loop  o-bad  GEMM1 split");
    for (int r = 0; r < nres; r++)
        for (int gm = 0; gm < 2; gm++) {
            char split[48] = "";
            if (gm && res[r].split > 1)
                snprintf(split, sizeof split, "  blocks %d.. in %d pieces", res[r].split_b0, res[r].split);
            else if (gm)
                snprintf(split, sizeof split, "  none");
            printf("%-13s %6d %6d %-6s | %7.1f (%8.3f ms)    | %7.1f (%8.3f ms)    | %7.1f (%8.3f ms)    | %5.2f  %llu%s\n",
                   res[r].name, res[r].rows, res[r].blocks, gm ? "gemm1" : "gemm0", res[r].tf[gm][0], res[r].ms[gm][0],
                   res[r].tf[gm][1], res[r].ms[gm][1], res[r].tf[gm][2], res[r].ms[gm][2],
                   res[r].tf[gm][0] / res[r].tf[gm][1], gm ? res[r].bad : 0ull, split);
        }
    int wfail = 0;
    if (wgrad) {
        printf("\nweight gradients (backward), per expert C_e (m x n) = sum over its rows of a^T b, bf16 out; "
               "TFLOP/s on valid rows (ms) | ours: comet_wgrad | cuBLAS loop per expert (A^T by op flags) | "
               "cuBLAS dense K=rows; check: ours vs the loop, ||d|| / ||loop|| <= %g, none non-finite\n", WGRAD_TOL);
        printf("%-4s %-13s %6s %6s %6s | %-22s | %-22s | %-22s | %s\n", "gemm", "model", "rows", "m", "n", "ours",
               "cuBLAS loop", "cuBLAS dense", "ours/loop  rel err  check");
        for (int r = 0; r < nres; r++)
            for (int w = 0; w < 2 && res[r].wgrad; w++) {
                const bresult_t *q = &res[r];
                if (q->wskip[w]) {
                    printf("%-4s %-13s %6d %6lld %6lld | skipped: %s\n", w ? "dW1" : "dW2", q->name, q->rows,
                           (long long)q->wm[w], (long long)q->wn[w], q->wskip[w]);
                    continue;
                }
                wfail |= !q->wok[w];
                printf("%-4s %-13s %6d %6lld %6lld | %7.1f (%8.3f ms)    | %7.1f (%8.3f ms)    | %7.1f (%8.3f ms)    | "
                       "%5.2f  %8.2e  %s\n", w ? "dW1" : "dW2", q->name, q->rows, (long long)q->wm[w],
                       (long long)q->wn[w], q->wtf[w][0], q->wms[w][0], q->wtf[w][1], q->wms[w][1], q->wtf[w][2],
                       q->wms[w][2], q->wtf[w][0] / q->wtf[w][1], q->wrel[w], q->wok[w] ? "ok" : "FAIL");
                if (q->wnonfinite[w]) printf("     %llu elements not finite\n", q->wnonfinite[w]);
            }
    }
    if (curve) {
        printf("\nn_compute curve (GEMM_BENCH_CURVE=1): ours with num_ctas of %d SMs, median of %d; "
               "eff = (TFLOP/s / TFLOP/s at %d) / (num_ctas / %d)\n", sms, NREP, sms, sms);
        printf("%-13s %8s | %-32s | %s\n", "model", "num_ctas", "gemm0 (+SiLU): TFLOP/s, ms, eff",
               "gemm1: TFLOP/s, ms, eff");
        for (int r = 0; r < nres; r++)
            for (int p = 0; p < res[r].ncurve; p++) {
                const bresult_t *q = &res[r];
                printf("%-13s %8d | %7.1f %10.3f ms %7.3f    | %7.1f %10.3f ms %7.3f\n", q->name, q->curve_ctas[p],
                       q->curve_tf[0][p], q->curve_ms[0][p], curve_eff(q, 0, p, sms), q->curve_tf[1][p],
                       q->curve_ms[1][p], curve_eff(q, 1, p, sms));
            }
    }
    if (sustain > 0) {
        printf("\nsustained (GEMM_BENCH_SUSTAIN=%g): each GEMM back to back for %g s a phase, ours and the cuBLAS "
               "loop alternated, 2 rounds; over each phase's second half\n", sustain, sustain);
        printf("%-13s %-6s %-5s %5s | %8s %9s %8s %9s  %s\n", "model", "gemm", "run", "round", "TFLOP/s", "SM MHz", "W",
               "GFLOP/J", "clock limited by");
        for (int r = 0; r < nres; r++)
            for (int gm = 0; gm < 2; gm++)
                for (int round = 0; round < res[r].nsus; round++)
                    for (int v = 0; v < 2; v++) {
                        const bsustain_t *q = &res[r].sus[gm][v][round];
                        char why[96];
                        printf("%-13s %-6s %-5s %5d | %8.1f ", res[r].name, gm ? "gemm1" : "gemm0", v ? "loop" : "ours",
                               round, q->tflops);
                        if (q->mhz > 0) /* NVML read in this phase */
                            printf("%9.0f %8.1f %9.1f  %s\n", q->mhz, q->watts, q->gflop_per_j,
                                   gpu_power_reasons(q->reasons, why, sizeof why));
                        else
                            printf("%9s %8s %9s  n/a\n", "n/a", "n/a", "n/a");
                    }
    }
    const char *out = getenv("OUT");
    char path[512];
    snprintf(path, sizeof path, "%s/gemm_bench.json", out && *out ? out : ".");
    FILE *f = fopen(path, "w");
    if (f) {
        fprintf(f, "{\"device\": \"%s\", \"date\": \"%s\", \"tokens\": %lld, \"ep\": %d, \"tp\": %d, \"skew\": %g, \"pad_zero\": %d, \"reps\": %d, ",
                prop.name, date, (long long)T, br.ep, br.tp, br.skew, pad_zero, NREP);
        if (wgrad) fprintf(f, "\"wgrad_out\": \"bf16\", \"wgrad_tol\": %g, ", WGRAD_TOL);
        if (curve) fprintf(f, "\"sms\": %d, ", sms);
        fprintf(f, "\"models\": [\n");
        for (int r = 0; r < nres; r++) {
            fprintf(f,
                    "  {\"model\": \"%s\", \"rows\": %d, \"rows_padded\": %d, \"blocks\": %d, \"gemm1_split\": %d, "
                    "\"gemm1_split_b0\": %d, \"gemm1_bad\": %llu",
                    res[r].name, res[r].rows, res[r].rows_padded, res[r].blocks, res[r].split, res[r].split_b0, res[r].bad);
            const char *vn[3] = {"ours", "cublas_loop", "cublas_dense"};
            for (int gm = 0; gm < 2; gm++)
                for (int v = 0; v < 3; v++)
                    fprintf(f, ", \"gemm%d_%s_tflops\": %.1f, \"gemm%d_%s_ms\": %.4f", gm, vn[v], res[r].tf[gm][v], gm,
                            vn[v], res[r].ms[gm][v]);
            for (int w = 0; w < 2 && res[r].wgrad; w++) {
                const char *wn = w ? "dw1" : "dw2";
                fprintf(f, ",\n   \"%s_m\": %lld, \"%s_n\": %lld", wn, (long long)res[r].wm[w], wn,
                        (long long)res[r].wn[w]);
                if (res[r].wskip[w]) {
                    fprintf(f, ", \"%s_skipped\": \"%s\"", wn, res[r].wskip[w]);
                    continue;
                }
                for (int v = 0; v < 3; v++)
                    fprintf(f, ", \"%s_%s_tflops\": %.1f, \"%s_%s_ms\": %.4f", wn, vn[v], res[r].wtf[w][v], wn, vn[v],
                            res[r].wms[w][v]);
                if (isfinite(res[r].wrel[w])) fprintf(f, ", \"%s_rel_err\": %.3e", wn, res[r].wrel[w]);
                else fprintf(f, ", \"%s_rel_err\": null", wn); /* the loop's output all zero or not finite */
                fprintf(f, ", \"%s_nonfinite\": %llu, \"%s_ok\": %d", wn, res[r].wnonfinite[w], wn, res[r].wok[w]);
            }
            if (res[r].ncurve) {
                fprintf(f, ",\n   \"curve\": [");
                for (int p = 0; p < res[r].ncurve; p++) {
                    fprintf(f, "%s\n    {\"num_ctas\": %d", p ? "," : "", res[r].curve_ctas[p]);
                    for (int gm = 0; gm < 2; gm++)
                        fprintf(f, ", \"gemm%d_ms\": %.4f, \"gemm%d_tflops\": %.1f, \"gemm%d_eff\": %.3f", gm,
                                res[r].curve_ms[gm][p], gm, res[r].curve_tf[gm][p], gm, curve_eff(&res[r], gm, p, sms));
                    fprintf(f, "}");
                }
                fprintf(f, "]");
            }
            if (res[r].nsus) {
                fprintf(f, ",\n   \"sustained\": [");
                for (int gm = 0; gm < 2; gm++)
                    for (int round = 0; round < res[r].nsus; round++)
                        for (int v = 0; v < 2; v++) {
                            const bsustain_t *q = &res[r].sus[gm][v][round];
                            fprintf(f, "%s\n    {\"gemm\": %d, \"run\": \"%s\", \"round\": %d, \"seconds\": %g, \"tflops\": %.1f",
                                    gm || round || v ? "," : "", gm, v ? "cublas_loop" : "ours", round, sustain, q->tflops);
                            if (q->mhz > 0)
                                fprintf(f, ", \"sm_mhz\": %.0f, \"watts\": %.1f, \"gflop_per_j\": %.1f, \"reasons\": %llu",
                                        q->mhz, q->watts, q->gflop_per_j, q->reasons);
                            fprintf(f, "}");
                        }
                fprintf(f, "]");
            }
            fprintf(f, "}%s\n", r + 1 < nres ? "," : "");
        }
        fprintf(f, "]}\n");
        fclose(f);
        printf("wrote %s\n", path);
    }
    cublasDestroy(cub);
    if (wfail) fprintf(stderr, "gemm_bench: a weight-gradient check FAILED (table above)\n");
    return wfail ? 1 : 0;
}
