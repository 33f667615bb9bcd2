/*
 * test_gemm_gpu.cu - the Hopper grouped GEMM (src/cuda/gemm.h) against the CPU
 * arithmetic of src/cpu/cpu_math.h: GEMM0 + activation (gated SiLU, GELU) and
 * GEMM1 over plans built on the host from random routings (Mixtral-like,
 * Qwen2-like many small experts, experts with zero rows, one expert only,
 * narrow last GEMM1 chunk, gated last h tiles of <= 64 columns), within two bf16 ulps; outputs are poisoned
 * (0xFFFF) first and padding rows must stay poisoned. Hooks: chunk_done
 * counts, block_ready released late by another kernel (on fewer CTAs; GEMM0
 * in l0_order, then again in expert order, the same bits), skip,
 * and the block_ready timeout (in a forked child, which must trap and leave a
 * report). Every case runs twice: without clusters (COMET_GEMM_CLUSTER=0) and
 * in 2-CTA clusters sharing B tiles (the default); the cases
 * with a gated last h tile of <= 64 columns also at full width (COMET_GEMM_NARROW=0), and every
 * case again with GEMM1's tail split forced on (COMET_GEMM_SPLIT=1: pieces of one k-slice and up),
 * with and without clusters; one case splits under the default rule (on 132 SMs).
 * The training launches (check_backward, in the passes with and without clusters and the
 * last-h-tile pass): GEMM0 storing gu (h's bits unchanged), G (dH, padding rows 0, dwp) and
 * dX (push into a receive buffer, chunk_done) against the CPU, each step from the GPU's own
 * input to it, the same bits again (G waiting for blocks released late in l0_order), skip;
 * and an informational timing line per case (TFLOP/s of GEMM0, GEMM0 with gu, GEMM1, G, dX); the
 * backward line ends with a digest of G's outputs (dH, dwp over the valid rows): two builds whose
 * lines match computed the same bits.
 * Also the device GELU against the exact one.
 * Not a speed test (bench/gemm_bench.cu). Without a GPU, or on one that is
 * not sm_90, it prints "skipped".
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../src/core/validate.h"
#include "../src/cpu/cpu_math.h"
#include "../src/cuda/gemm.h"
#include "../harness/workload.h"
#include "check.h"

typedef struct {
    const char *tag;
    int64_t hidden, ffn, experts, topk, tokens;
    int activation;
    int zero_experts;   /* experts with no rows */
    double skew;        /* 0 uniform; >0: popularity u^(1+skew*4) */
    int chunk_cols;     /* GEMM1 chunk width (0: one chunk) */
    int max_check_rows; /* rows checked against the CPU (all if the problem is smaller) */
} gcase_t;

static uint16_t rand_bf16(comet_rng_t *r, float scale) {
    return comet_f32_to_bf16((float)(comet_rng_uniform(r) * 2.0 - 1.0) * scale);
}


/* got within two bf16 ulps of ref, or within atol: the floor for values
 * near zero, where the fp32 sums of another order differ by more than ulps
 * of the (cancelled) result (row_atol). */
static int close_bf16(uint16_t got, uint16_t ref, float atol) {
    float g = comet_bf16_to_f32(got), f = comet_bf16_to_f32(ref);
    if (isnan(g) || isnan(f)) return 0;
    float a = fabsf(f);
    float ulp = a > 0 ? ldexpf(1.0f, ilogbf(a) - 7) : 0.0f;
    return fabsf(g - f) <= 2.0f * ulp + atol;
}

/* The absolute floor of a reference row of n values: 2^-14 of its largest
 * finite magnitude (fp32 sums over K <= 16384 terms differ between orders by
 * ~sqrt(K) x 2^-24 of their terms' size, 100x below; a wrong element is off
 * by its own size), and at least 1e-6. */
static float row_atol(const uint16_t *ref, int64_t n) {
    float m = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float v = fabsf(comet_bf16_to_f32(ref[i]));
        if (isfinite(v) && v > m) m = v;
    }
    return fmaxf(ldexpf(m, -14), 1e-6f);
}

/* Random routing of T tokens over E experts (distinct per token). */
static void make_routing(const gcase_t *c, comet_rng_t *rng, int32_t *idx, float *w) {
    double *pop = (double *)malloc(sizeof(double) * (size_t)c->experts);
    for (int64_t e = 0; e < c->experts; e++) {
        double u = 0.05 + comet_rng_uniform(rng);
        pop[e] = c->skew > 0 ? pow(u, 1.0 + 4.0 * c->skew) : 1.0;
    }
    for (int z = 0; z < c->zero_experts; z++) pop[(z * 7 + 3) % c->experts] = 0.0; /* distinct for E > 7 */
    double total = 0;
    for (int64_t e = 0; e < c->experts; e++) total += pop[e];
    for (int64_t t = 0; t < c->tokens; t++)
        for (int64_t j = 0; j < c->topk; j++) {
            int32_t e;
            for (;;) {
                double x = comet_rng_uniform(rng) * total, acc = 0;
                e = (int32_t)(c->experts - 1);
                for (int64_t q = 0; q < c->experts; q++) {
                    acc += pop[q];
                    if (x < acc && pop[q] > 0) {
                        e = (int32_t)q;
                        break;
                    }
                }
                if (pop[e] == 0) continue;
                int dup = 0;
                for (int64_t m = 0; m < j; m++) dup |= idx[t * c->topk + m] == e;
                if (!dup) break;
            }
            idx[t * c->topk + j] = e;
            w[t * c->topk + j] = (float)comet_rng_uniform(rng);
        }
    free(pop);
}

/* comet_gelu_fast as the GELU epilogue computes it (device ex2, FMA
 * contraction, flush-to-zero), at g = (i - n/2) * step. */
__global__ void k_gelu_sweep(float *out, int n, float step) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = comet_gelu_fast((float)(i - n / 2) * step);
}

/* The device GELU against the exact one (g/2 erfc(-g/sqrt 2), double): relative
 * error under 1.5e-6 for g >= -2, under 5e-5 wherever the result is a normal
 * float (the host form measures 6.5e-7 and 2e-5, tests/test_numerics.c). */
static void check_gelu_device(void) {
    const int n = 2800001;
    const float step = 1e-5f;
    float *d_out, *out = (float *)malloc(sizeof(float) * (size_t)n);
    CUDA_OK(cudaMalloc(&d_out, sizeof(float) * (size_t)n));
    k_gelu_sweep<<<512, 256>>>(d_out, n, step);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(out, d_out, sizeof(float) * (size_t)n, cudaMemcpyDeviceToHost));
    double near = 0, all = 0;
    for (int i = 0; i < n; i++) {
        const float g = (float)(i - n / 2) * step;
        const double ref = 0.5 * (double)g * erfc(-(double)g / sqrt(2.0));
        if (fabs(ref) < 1e-37) continue;
        const double err = fabs((double)out[i] - ref) / fabs(ref);
        all = err > all ? err : all;
        if (g >= -2.0f) near = err > near ? err : near;
    }
    CHECK(near < 1.5e-6 && all < 5e-5, "device comet_gelu_fast: worst relative error %.3g for g >= -2, %.3g overall",
          near, all);
    printf("test_gemm_gpu: device GELU worst relative error %.3g for g >= -2, %.3g overall\n", near, all);
    cudaFree(d_out);
    free(out);
}

__global__ void k_release_late(uint64_t *ready, int n, uint64_t epoch, unsigned spin_ns) {
    /* blocks in reverse, each after a pause: GEMM0 tiles must wait for them */
    for (int b = n - 1; b >= 0; b--) {
        uint64_t t0, t1;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
        while (t1 - t0 < spin_ns);
        asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(ready + b), "l"(epoch) : "memory");
    }
}

static int is_padding_row(const comet_plan_t *pl, const comet_dims_t *d, int64_t row) {
    for (int64_t e = 0; e < d->experts_local; e++)
        if (row >= pl->expert_start[e] && row < pl->expert_start[e + 1])
            return row >= pl->expert_start[e] + pl->expert_count[e];
    return 1; /* beyond num_rows_padded */
}

static int split_cases; /* cases whose GEMM1 ran split tiles (comet_gemm_split_of) */

/* The four launches of gemm.h in one form (t: the training buffers, unused by GEMM0 and GEMM1). */
typedef int (*launch_fn)(const comet_gemm_t *g, const comet_gemm_train_t *t, void *s, const comet_gemm_hooks_t *hk);
static int launch_gemm0(const comet_gemm_t *g, const comet_gemm_train_t *t, void *s, const comet_gemm_hooks_t *hk) {
    (void)t;
    return comet_gemm0_launch(g, s, hk);
}
static int launch_gemm1(const comet_gemm_t *g, const comet_gemm_train_t *t, void *s, const comet_gemm_hooks_t *hk) {
    (void)t;
    return comet_gemm1_launch(g, s, hk);
}

/* A GEMM (launch, with t) launched again with hooks hk (NULL: none) into its output d_out
 * (poisoned first) writes want's bits; got receives them. With release, k_release_late on
 * stream rs sets release[0..n) to 3 in reverse while it runs (hk then waits for them: fewer CTAs,
 * so that k_release_late finds an SM). 0 after a failed CUDA call (recorded). */
static int relaunch_same(const comet_gemm_t *g, launch_fn launch, const comet_gemm_train_t *t,
                         const comet_gemm_hooks_t *hk, uint64_t *release, int n, cudaStream_t rs, void *d_out,
                         const uint16_t *want, uint16_t *got, size_t bytes, const char *tag, const char *what) {
    cudaError_t e = cudaMemset(d_out, 0xff, bytes);
    if (e == cudaSuccess && release) e = cudaMemset(release, 0, sizeof(uint64_t) * (size_t)n);
    if (e == cudaSuccess) e = cudaDeviceSynchronize(); /* rs does not wait for the legacy stream's memsets */
    if (e == cudaSuccess) {
        CHECK(launch(g, t, 0, hk) == 0, "%s: %s: launch", tag, what);
        if (release) k_release_late<<<1, 1, 0, rs>>>(release, n, 3, 20000);
        e = cudaDeviceSynchronize();
    }
    if (e == cudaSuccess) e = cudaMemcpy(got, d_out, bytes, cudaMemcpyDeviceToHost);
    CHECK(e == cudaSuccess, "%s: %s: %s", tag, what, cudaGetErrorString(e));
    if (e != cudaSuccess) return 0;
    CHECK(memcmp(want, got, bytes) == 0, "%s: %s: the bits differ", tag, what);
    return 1;
}

/* What the backward checks share with run_case. */
typedef struct {
    const gcase_t *c;
    const comet_dims_t *d;
    const comet_plan_t *pl;
    const comet_gemm_args_t *ga; /* run_case's GEMM (prepared again here, with a push target) */
    const uint16_t *a, *w1, *w2, *h; /* host: gathered rows, weights, the forward's h (GEMM0 without gu) */
    uint16_t *d_h;                    /* device h (holds h's bits) */
    uint64_t *d_ready, *d_epoch, *d_chunk;
    cudaStream_t rs;
    int sms, timing;
    comet_rng_t *rng;
} bwd_ctx_t;

/* Milliseconds a launch takes (events, the mean of 10 after 2 warm-ups; NaN after a failure). */
static float time_launch(const comet_gemm_t *g, launch_fn launch, const comet_gemm_train_t *t) {
    cudaEvent_t e0, e1;
    float ms = 0;
    int bad = cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess;
    for (int i = 0; i < 2; i++) bad |= launch(g, t, 0, NULL) != 0;
    bad |= cudaEventRecord(e0, 0) != cudaSuccess;
    for (int i = 0; i < 10; i++) bad |= launch(g, t, 0, NULL) != 0;
    bad |= cudaEventRecord(e1, 0) != cudaSuccess || cudaEventSynchronize(e1) != cudaSuccess;
    bad |= cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess;
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    CHECK(!bad, "timing: a CUDA call failed");
    return bad ? NAN : ms / 10;
}

/* The training launches against the CPU (include/comet.h "Backward" steps 1, 2, 4, 5 as
 * comet_cpu_backward_row computes them, each step from the GPU's own bf16 input to it, so each is
 * checked alone): GEMM0 with gu (h bits unchanged, gu within two bf16 ulps of the CPU's rounded fp32
 * sums), G (dH within two ulps of the activation backward of the CPU's fp32 G from the GPU's gu,
 * padding rows of each block 0; dwp within 1e-4 of the row tile's sum of |G h|), dX (two ulps,
 * padding rows untouched, each row also pushed into its home slot, chunk_done counts). Repeated
 * launches, and G waiting for blocks released late in l0_order, give the same bits; skip writes
 * nothing. */
static void check_backward(const bwd_ctx_t *x) {
    const gcase_t *c = x->c;
    const comet_dims_t *d = x->d;
    const comet_plan_t *pl = x->pl;
    const int64_t H = d->hidden, F = d->ffn_local, W1 = d->w1_rows, MR = d->max_rows_padded;
    const int64_t NT = comet_gemm_dwp_tiles(d), T = c->tokens, K = c->topk;
    const int nb = pl->totals->num_blocks, gated = d->activation == 0;
    /* dy: random rows per token, gathered by plan row (padding rows NaN) */
    uint16_t *dy = (uint16_t *)malloc(2 * (size_t)(T * H)), *dyr = (uint16_t *)malloc(2 * (size_t)(MR * H));
    for (int64_t i = 0; i < T * H; i++) dy[i] = rand_bf16(x->rng, 1.0f);
    memset(dyr, 0xff, 2 * (size_t)(MR * H));
    for (int64_t r = 0; r < pl->totals->num_rows_padded; r++)
        if (pl->rows[r].src_rank >= 0) memcpy(dyr + r * H, dy + (int64_t)pl->rows[r].src_token * H, 2 * (size_t)H);
    uint16_t *d_gu, *d_dy, *d_dh, *d_dx, *d_recv;
    float *d_dwp;
    const size_t b_gu = 2 * (size_t)(MR * W1), b_x = 2 * (size_t)(MR * H), b_dwp = sizeof(float) * (size_t)(MR * NT);
    const size_t b_recv = 2 * (size_t)(T * K * H);
    CUDA_OK(cudaMalloc(&d_gu, b_gu));
    CUDA_OK(cudaMalloc(&d_dy, b_x));
    CUDA_OK(cudaMalloc(&d_dh, b_gu));
    CUDA_OK(cudaMalloc(&d_dx, b_x));
    CUDA_OK(cudaMalloc(&d_recv, b_recv));
    CUDA_OK(cudaMalloc(&d_dwp, b_dwp));
    CUDA_OK(cudaMemcpy(d_dy, dyr, b_x, cudaMemcpyHostToDevice));
    comet_gemm_train_t t;
    memset(&t, 0, sizeof t); /* sched NULL: g's own counters */
    t.gu = d_gu, t.dy = d_dy, t.dh = d_dh, t.dwp = d_dwp, t.dx = d_dx; /* h: args.h */
    uint16_t *gu = (uint16_t *)malloc(b_gu), *dh = (uint16_t *)malloc(b_gu), *dx = (uint16_t *)malloc(b_x);
    uint16_t *tmp = (uint16_t *)malloc(b_gu > b_x ? b_gu : b_x), *recv = (uint16_t *)malloc(b_recv);
    float *dwp = (float *)malloc(b_dwp), *dwp2 = (float *)malloc(b_dwp);
    comet_gemm_args_t ga = *x->ga;
    ga.push[0] = d_recv; /* this rank's own tokens' slots (world of one) */
    comet_gemm_t *gb = NULL;
    char err[256];
    CHECK(comet_gemm_prepare(&ga, &gb, err, sizeof err) == 0, "%s: prepare with a push target: %s", c->tag, err);
    if (!gb) return;
    const comet_gemm_t *g = gb;

    /* GEMM0 storing gu: h's bits as without it */
    CUDA_OK(cudaMemset(d_gu, 0xff, b_gu));
    CHECK(relaunch_same(g, (launch_fn)comet_gemm0_train_launch, &t, NULL, NULL, 0, 0, x->d_h, x->h, tmp,
                        2 * (size_t)(MR * F), c->tag, "GEMM0 storing gu: h against GEMM0's"),
          "%s: GEMM0 with gu", c->tag);
    CUDA_OK(cudaMemcpy(gu, d_gu, b_gu, cudaMemcpyDeviceToHost));

    /* G, then dX with chunk counters and the push into a receive buffer of this rank's tokens */
    CUDA_OK(cudaMemset(d_dh, 0xff, b_gu));
    CUDA_OK(cudaMemset(d_dwp, 0xff, b_dwp));
    CUDA_OK(cudaMemset(d_dx, 0xff, b_x));
    CUDA_OK(cudaMemset(d_recv, 0xff, b_recv));
    CUDA_OK(cudaMemset(x->d_chunk, 0, 64 * sizeof(uint64_t)));
    CHECK(comet_gemm_g_launch(g, &t, 0, NULL) == 0, "%s: G launch", c->tag);
    comet_gemm_hooks_t hk;
    memset(&hk, 0, sizeof hk);
    hk.chunk_done = x->d_chunk, hk.chunk_cols = c->chunk_cols, hk.push = 1;
    CHECK(comet_gemm_dx_launch(g, &t, 0, &hk) == 0, "%s: dX launch", c->tag);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(dh, d_dh, b_gu, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(dwp, d_dwp, b_dwp, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(dx, d_dx, b_x, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(recv, d_recv, b_recv, cudaMemcpyDeviceToHost));
    uint64_t chunk_cnt[64];
    CUDA_OK(cudaMemcpy(chunk_cnt, x->d_chunk, sizeof chunk_cnt, cudaMemcpyDeviceToHost));
    const int64_t cc = c->chunk_cols ? c->chunk_cols : H;
    int bad_chunks = 0;
    for (int ch = 0; ch < 64; ch++) {
        const int64_t w = ch * cc >= H ? 0 : (ch + 1) * cc < H ? cc : H - ch * cc;
        bad_chunks += chunk_cnt[ch] != (uint64_t)nb * (uint64_t)((w + 255) / 256);
    }
    CHECK(bad_chunks == 0, "%s: dX chunk_done counters wrong in %d chunks", c->tag, bad_chunks);

    /* padding: gu and dx untouched outside valid rows, dH 0 in each block's padding rows */
    int64_t pad_gu = 0, pad_dx = 0, pad_dh = 0, bad_push = 0;
    for (int b = 0; b < nb; b++)
        for (int64_t r = pl->blocks[b].row_start + pl->blocks[b].num_rows; r < pl->blocks[b].row_start + 128; r++) {
            for (int64_t i = 0; i < W1; i++) pad_gu += gu[r * W1 + i] != 0xffff, pad_dh += dh[r * W1 + i] != 0;
            for (int64_t i = 0; i < H; i++) pad_dx += dx[r * H + i] != 0xffff;
        }
    for (int b = 0; b < nb; b++)
        for (int i = 0; i < pl->blocks[b].num_rows; i++) {
            const int64_t r = pl->blocks[b].row_start + i;
            const comet_plan_row_t pr = pl->rows[r];
            bad_push += memcmp(recv + ((int64_t)pr.src_token * K + pr.slot) * H, dx + r * H, 2 * (size_t)H) != 0;
        }
    CHECK(pad_gu == 0 && pad_dx == 0 && pad_dh == 0 && bad_push == 0,
          "%s: padding rows: %lld of gu, %lld of dx written, %lld of dH not 0; %lld pushed dX rows differ", c->tag,
          (long long)pad_gu, (long long)pad_dx, (long long)pad_dh, (long long)bad_push);

    /* values against the CPU on a sample of rows (every block's first and last) */
    const int64_t nrows = pl->totals->num_rows;
    const int all = nrows <= c->max_check_rows;
    float *G = (float *)malloc(sizeof(float) * (size_t)F), *acc = (float *)malloc(sizeof(float) * (size_t)H);
    uint16_t *ref = (uint16_t *)malloc(2 * (size_t)(W1 > H ? W1 : H));
    int64_t checked = 0, bad_gu = 0, bad_dh = 0, bad_dwp = 0, bad_dx = 0;
    double worst_dwp = 0;
    for (int b = 0; b < nb; b++) {
        const comet_plan_block_t blk = pl->blocks[b];
        const uint16_t *w1e = x->w1 + (int64_t)blk.expert * W1 * H, *w2e = x->w2 + (int64_t)blk.expert * H * F;
        for (int i = 0; i < blk.num_rows; i++) {
            if (!(all || i == 0 || i == blk.num_rows - 1 || comet_rng_uniform(x->rng) < (double)c->max_check_rows / (double)nrows))
                continue;
            const int64_t r = blk.row_start + i;
            const float w = pl->rows[r].weight;
            /* step 1: gu */
            for (int64_t n = 0; n < W1; n++) ref[n] = comet_f32_to_bf16(comet_cpu_dot(x->a + r * H, w1e + n * H, H));
            float atol = row_atol(ref, W1);
            for (int64_t n = 0; n < W1; n++) bad_gu += !close_bf16(gu[r * W1 + n], ref[n], atol);
            /* steps 2 and 4: G in fp32 (c ascending), dH from the GPU's gu */
            for (int64_t n = 0; n < F; n++) G[n] = 0.0f;
            for (int64_t k = 0; k < H; k++) {
                const float v = comet_bf16_to_f32(dyr[r * H + k]);
                for (int64_t n = 0; n < F; n++) G[n] += v * comet_bf16_to_f32(w2e[k * F + n]);
            }
            for (int64_t n = 0; n < F; n++) {
                const float g = comet_bf16_to_f32(gu[r * W1 + n]), dA = w * G[n];
                if (gated) {
                    float dg, du;
                    comet_silu_gated_backward(g, comet_bf16_to_f32(gu[r * W1 + F + n]), dA, &dg, &du);
                    ref[n] = comet_f32_to_bf16(dg), ref[F + n] = comet_f32_to_bf16(du);
                } else {
                    ref[n] = comet_f32_to_bf16(dA * comet_gelu_grad(g));
                }
            }
            atol = row_atol(ref, W1);
            for (int64_t n = 0; n < W1; n++) bad_dh += !close_bf16(dh[r * W1 + n], ref[n], atol);
            /* step 3's partials: <G, h> over each 256-column tile */
            for (int64_t q = 0; q < NT; q++) {
                double sum = 0, mag = 0;
                for (int64_t n = q * 256; n < F && n < (q + 1) * 256; n++) {
                    const double v = (double)G[n] * comet_bf16_to_f32(x->h[r * F + n]);
                    sum += v, mag += fabs(v);
                }
                const double err = fabs((double)dwp[r * NT + q] - sum);
                if (!(err <= 1e-4 * mag + 1e-30)) bad_dwp++;
                if (mag > 0 && err / mag > worst_dwp) worst_dwp = err / mag;
            }
            /* step 5: dX from the GPU's dH (k ascending) */
            for (int64_t n = 0; n < H; n++) acc[n] = 0.0f;
            for (int64_t k = 0; k < W1; k++) {
                const float v = comet_bf16_to_f32(dh[r * W1 + k]);
                for (int64_t n = 0; n < H; n++) acc[n] += v * comet_bf16_to_f32(w1e[k * H + n]);
            }
            for (int64_t n = 0; n < H; n++) ref[n] = comet_f32_to_bf16(acc[n]);
            atol = row_atol(ref, H);
            for (int64_t n = 0; n < H; n++) bad_dx += !close_bf16(dx[r * H + n], ref[n], atol);
            checked++;
        }
    }
    CHECK(bad_gu == 0 && bad_dh == 0 && bad_dwp == 0 && bad_dx == 0,
          "%s: backward over tolerance: gu %lld, dH %lld, dwp %lld (worst relative %.3g), dX %lld (%lld rows checked)",
          c->tag, (long long)bad_gu, (long long)bad_dh, (long long)bad_dwp, worst_dwp, (long long)bad_dx,
          (long long)checked);
    /* G's digest (dH, dwp over the valid rows): the inputs are seeded, so two builds' kernels can be
     * compared on the same case */
    uint64_t bits = CHECK_FNV1A_BASIS;
    for (int b = 0; b < nb; b++) {
        const int64_t r0 = pl->blocks[b].row_start, nr = pl->blocks[b].num_rows;
        bits = check_fnv1a(bits, dh + r0 * W1, sizeof(uint16_t) * (size_t)(nr * W1));
        bits = check_fnv1a(bits, dwp + r0 * NT, sizeof(float) * (size_t)(nr * NT));
    }
    printf("%s: backward: %lld rows checked, gu/dH/dwp/dX bad %lld/%lld/%lld/%lld (dwp worst %.2g of sum |G h|), padding "
           "ok %d, push ok %d, G bits %016llx\n", c->tag, (long long)checked, (long long)bad_gu, (long long)bad_dh,
           (long long)bad_dwp, (long long)bad_dx, worst_dwp, pad_gu + pad_dx + pad_dh == 0, bad_push == 0,
           (unsigned long long)bits);

    /* the same bits again: G waiting for blocks released late, in l0_order, on fewer CTAs; dX plain */
    memset(&hk, 0, sizeof hk);
    hk.block_ready = x->d_ready, hk.epoch = x->d_epoch, hk.l0_order = 1, hk.num_ctas = x->sms - 8;
    hk.timeout_ns = 5000000000ull;
    relaunch_same(g, comet_gemm_g_launch, &t, &hk, x->d_ready, nb, x->rs, d_dh, dh, tmp, b_gu, c->tag,
                  "G again, waiting for blocks released late (l0_order)");
    CUDA_OK(cudaMemcpy(dwp2, d_dwp, b_dwp, cudaMemcpyDeviceToHost));
    int64_t dwp_diff = 0;
    for (int b = 0; b < nb; b++)
        for (int i = 0; i < pl->blocks[b].num_rows; i++) {
            const int64_t r = pl->blocks[b].row_start + i;
            dwp_diff += memcmp(dwp + r * NT, dwp2 + r * NT, sizeof(float) * (size_t)NT) != 0;
        }
    CHECK(dwp_diff == 0, "%s: G again: dwp of %lld rows differ", c->tag, (long long)dwp_diff);
    relaunch_same(g, comet_gemm_dx_launch, &t, NULL, NULL, 0, 0, d_dx, dx, tmp, b_x, c->tag, "dX again");

    /* skip: neither writes */
    uint32_t *d_skip;
    CUDA_OK(cudaMalloc(&d_skip, 4));
    CUDA_OK(cudaMemset(d_skip, 1, 4));
    CUDA_OK(cudaMemset(d_dh, 0xff, b_gu));
    CUDA_OK(cudaMemset(d_dx, 0xff, b_x));
    memset(&hk, 0, sizeof hk);
    hk.skip = d_skip;
    CHECK(comet_gemm_g_launch(g, &t, 0, &hk) == 0 && comet_gemm_dx_launch(g, &t, 0, &hk) == 0, "%s: launch (skip)",
          c->tag);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(dh, d_dh, b_gu, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(dx, d_dx, b_x, cudaMemcpyDeviceToHost));
    int64_t written = 0;
    for (int64_t i = 0; i < MR * W1; i++) written += dh[i] != 0xffff;
    for (int64_t i = 0; i < MR * H; i++) written += dx[i] != 0xffff;
    CHECK(written == 0, "%s: skip set, yet %lld elements of dH and dX written", c->tag, (long long)written);
    cudaFree(d_skip);

    if (x->timing) { /* informational: TFLOP/s over the valid rows, this GPU */
        const double m = (double)nrows, f0 = 2 * m * W1 * H, f1 = 2 * m * F * H;
        const float t0 = time_launch(g, launch_gemm0, NULL), t0g = time_launch(g, (launch_fn)comet_gemm0_train_launch, &t);
        const float t1 = time_launch(g, launch_gemm1, NULL), tg = time_launch(g, comet_gemm_g_launch, &t);
        const float tx = time_launch(g, comet_gemm_dx_launch, &t);
        printf("%s: timing (%lld rows): GEMM0 %.1f, +gu %.1f, GEMM1 %.1f, G %.1f, dX %.1f TFLOP/s (%.3f %.3f %.3f %.3f %.3f ms)\n",
               c->tag, (long long)nrows, f0 / t0 / 1e9, f0 / t0g / 1e9, f1 / t1 / 1e9, f1 / tg / 1e9, f0 / tx / 1e9, t0,
               t0g, t1, tg, tx);
    }
    comet_gemm_destroy(gb);
    cudaFree(d_gu), cudaFree(d_dy), cudaFree(d_dh), cudaFree(d_dx), cudaFree(d_recv), cudaFree(d_dwp);
    free(dy), free(dyr), free(gu), free(dh), free(dx), free(tmp), free(recv), free(dwp), free(dwp2), free(G), free(acc),
        free(ref);
}

/* bwd: 0 the forward only; 1 also the training launches (check_backward); 2 those timed too */
static void run_case(const gcase_t *c, uint64_t seed, int bwd) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = c->hidden, cfg.ffn = c->ffn, cfg.num_experts = c->experts, cfg.topk = c->topk;
    cfg.activation = (comet_activation_t)c->activation;
    cfg.max_tokens_per_rank = c->tokens, cfg.tile_m = 128;
    comet_dims_t d;
    if (comet_dims_from_config(&cfg, 1, 0, &d) != COMET_SUCCESS) {
        CHECK(0, "%s: dims: %s", c->tag, comet_last_error());
        return;
    }
    const char *why = comet_gemm_check(&d);
    CHECK(why == NULL, "%s: shape rejected: %s", c->tag, why ? why : "");
    if (why) return;
    comet_rng_t rng = {seed};
    const int64_t T = c->tokens, K = c->topk, H = d.hidden, F = d.ffn_local, E = d.experts_local;
    const int64_t MR = d.max_rows_padded;
    int32_t *idx = (int32_t *)malloc(sizeof(int32_t) * (size_t)(T * K));
    float *wts = (float *)malloc(sizeof(float) * (size_t)(T * K));
    make_routing(c, &rng, idx, wts);
    size_t ws_bytes = comet_plan_workspace_bytes(&d);
    void *ws = aligned_alloc(64, (ws_bytes + 63) / 64 * 64);
    memset(ws, 0, ws_bytes);
    comet_plan_t pl;
    comet_plan_carve(&d, ws, &pl);
    int64_t tok[1] = {T};
    const int32_t *idxp[1] = {idx};
    const float *wp[1] = {wts};
    comet_plan_input_t in = {tok, idxp, wp};
    comet_plan_build(&d, &in, &pl);
    const int nb = pl.totals->num_blocks;

    /* inputs: x (T, H); a = gathered rows, padding rows NaN */
    const size_t n_w1 = (size_t)(E * d.w1_rows * H), n_w2 = (size_t)(E * H * F);
    uint16_t *x = (uint16_t *)malloc(2 * (size_t)(T * H));
    uint16_t *a = (uint16_t *)malloc(2 * (size_t)(MR * H));
    uint16_t *w1 = (uint16_t *)malloc(2 * n_w1), *w2 = (uint16_t *)malloc(2 * n_w2);
    for (int64_t i = 0; i < T * H; i++) x[i] = rand_bf16(&rng, 1.0f);
    for (size_t i = 0; i < n_w1; i++) w1[i] = rand_bf16(&rng, 2.0f / sqrtf((float)H));
    for (size_t i = 0; i < n_w2; i++) w2[i] = rand_bf16(&rng, 2.0f / sqrtf((float)F));
    memset(a, 0xff, 2 * (size_t)(MR * H));
    for (int64_t r = 0; r < pl.totals->num_rows_padded; r++)
        if (pl.rows[r].src_rank >= 0) memcpy(a + r * H, x + (int64_t)pl.rows[r].src_token * H, 2 * (size_t)H);

    void *d_ws;
    uint16_t *d_a, *d_w1, *d_w2, *d_h, *d_o;
    uint64_t *d_flags;
    uint32_t *d_skip;
    const int nchunk_max = 64;
    CUDA_OK(cudaMalloc(&d_ws, ws_bytes));
    CUDA_OK(cudaMalloc(&d_a, 2 * (size_t)(MR * H)));
    CUDA_OK(cudaMalloc(&d_w1, 2 * n_w1));
    CUDA_OK(cudaMalloc(&d_w2, 2 * n_w2));
    CUDA_OK(cudaMalloc(&d_h, 2 * (size_t)(MR * F)));
    CUDA_OK(cudaMalloc(&d_o, 2 * (size_t)(MR * H)));
    CUDA_OK(cudaMalloc(&d_flags, sizeof(uint64_t) * (size_t)(d.max_blocks + nchunk_max + 1)));
    CUDA_OK(cudaMalloc(&d_skip, 4));
    CUDA_OK(cudaMemcpy(d_ws, ws, ws_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_a, a, 2 * (size_t)(MR * H), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_w1, w1, 2 * n_w1, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_w2, w2, 2 * n_w2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(d_h, 0xff, 2 * (size_t)(MR * F)));
    CUDA_OK(cudaMemset(d_o, 0xff, 2 * (size_t)(MR * H)));
    CUDA_OK(cudaMemset(d_flags, 0, sizeof(uint64_t) * (size_t)(d.max_blocks + nchunk_max)));
    uint64_t *d_ready = d_flags, *d_chunk = d_flags + d.max_blocks, *d_epoch = d_chunk + nchunk_max;
    const uint64_t three = 3; /* the epoch the released blocks reach */
    CUDA_OK(cudaMemcpy(d_epoch, &three, sizeof three, cudaMemcpyHostToDevice));

    comet_gemm_args_t ga;
    memset(&ga, 0, sizeof ga); /* no push targets; prepare allocates the tile counters */
    ga.knobs = comet_gemm_knobs_read(); /* COMET_GEMM_* as a layer created now reads them */
    ga.d = d, ga.plan_ws = d_ws, ga.a = d_a, ga.w1 = d_w1, ga.h = d_h, ga.w2 = d_w2, ga.o = d_o;
    comet_gemm_t *g = NULL;
    char err[256];
    int rc = comet_gemm_prepare(&ga, &g, err, sizeof err);
    CHECK(rc == 0, "%s: prepare: %s", c->tag, err);
    if (rc == 0) {
        const char *cl = getenv("COMET_GEMM_CLUSTER");
        const int want = !(cl && strcmp(cl, "0") == 0);
        CHECK((comet_gemm_cluster_ctas(g) > 0) == want, "%s: COMET_GEMM_CLUSTER=%s, yet %d CTAs as 2-CTA clusters",
              c->tag, cl ? cl : "(unset)", comet_gemm_cluster_ctas(g));
    }
    if (rc) return;
    /* GEMM1's tail split for this plan (the same rule as the device's) */
    int split_b0 = nb;
    const int pieces = comet_gemm_split_of(g, nb, &split_b0);
    split_cases += pieces > 1;
    int sms_now = 0;
    CUDA_OK(cudaDeviceGetAttribute(&sms_now, cudaDevAttrMultiProcessorCount, 0));
    if (strstr(c->tag, "(split)") && !getenv("COMET_GEMM_SPLIT") && sms_now == 132) /* the rule's own numbers */
        CHECK(pieces > 1 && split_b0 > 0, "%s: GEMM1 tail split expected by default on 132 SMs, got %d pieces from block %d",
              c->tag, pieces, split_b0);

    /* skip: nothing written */
    CUDA_OK(cudaMemset(d_skip, 1, 4));
    comet_gemm_hooks_t hk;
    memset(&hk, 0, sizeof hk);
    hk.skip = d_skip;
    CHECK(comet_gemm0_launch(g, 0, &hk) == 0, "%s: launch (skip)", c->tag);
    CHECK(comet_gemm1_launch(g, 0, &hk) == 0, "%s: launch (skip)", c->tag);
    CUDA_OK(cudaDeviceSynchronize());
    uint16_t *h = (uint16_t *)malloc(2 * (size_t)(MR * F)), *o = (uint16_t *)malloc(2 * (size_t)(MR * H));
    CUDA_OK(cudaMemcpy(h, d_h, 2 * (size_t)(MR * F), cudaMemcpyDeviceToHost));
    int64_t written = 0;
    for (int64_t i = 0; i < MR * F; i++) written += h[i] != 0xffff;
    CHECK(written == 0, "%s: skip set, yet %lld elements of h written", c->tag, (long long)written);

    /* GEMM0: blocks released late (reverse order) by another kernel, GEMM0 on fewer CTAs */
    int sms = 0;
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaStream_t s1, s2;
    CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    /* COMET_GEMM_TEST_NOHOOKS=1: plain launches (to tell kernel faults from hook faults) */
    const int nohooks = getenv("COMET_GEMM_TEST_NOHOOKS") != NULL;
    memset(&hk, 0, sizeof hk);
    if (!nohooks) {
        hk.block_ready = d_ready;
        hk.epoch = d_epoch;
        hk.l0_order = 1; /* the layer's overlapped walk (the plain launches above walk expert order) */
        hk.num_ctas = sms - 8;
        hk.timeout_ns = 5000000000ull;
    }
    uint64_t *report_h = NULL, *report_d = NULL;
    CUDA_OK(cudaHostAlloc(&report_h, 64, cudaHostAllocMapped));
    CUDA_OK(cudaHostGetDevicePointer(&report_d, report_h, 0));
    memset(report_h, 0, 64);
    hk.timeout_report = report_d;
    /* load k_release_late before GEMM0 runs: with lazy module loading, loading a kernel while
     * another one runs waits for it, and GEMM0 waits for k_release_late (a deadlock) */
    k_release_late<<<1, 1, 0, s2>>>(d_ready, 0, 3, 0);
    CUDA_OK(cudaStreamSynchronize(s2));
    CHECK(comet_gemm0_launch(g, s1, &hk) == 0, "%s: gemm0 launch", c->tag);
    if (!nohooks) k_release_late<<<1, 1, 0, s2>>>(d_ready, nb, 3, 20000);
    {
        cudaError_t e = cudaStreamSynchronize(s1);
        char msg[256];
        if (e != cudaSuccess && comet_gemm_timeout_message(report_h, msg, sizeof msg)) printf("%s\n", msg);
        CUDA_OK(e);
    }
    cudaFreeHost(report_h);
    CUDA_OK(cudaStreamSynchronize(s2));

    /* GEMM1 with chunk counters */
    memset(&hk, 0, sizeof hk);
    hk.chunk_done = nohooks ? NULL : d_chunk;
    hk.chunk_cols = c->chunk_cols;
    CHECK(comet_gemm1_launch(g, s1, &hk) == 0, "%s: gemm1 launch", c->tag);
    CUDA_OK(cudaStreamSynchronize(s1));
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(h, d_h, 2 * (size_t)(MR * F), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(o, d_o, 2 * (size_t)(MR * H), cudaMemcpyDeviceToHost));
    uint64_t chunk_cnt[64];
    CUDA_OK(cudaMemcpy(chunk_cnt, d_chunk, sizeof chunk_cnt, cudaMemcpyDeviceToHost));

    /* chunk counters: blocks x column tiles of each chunk */
    const int64_t cc = c->chunk_cols ? c->chunk_cols : H;
    int bad_chunks = 0, nch = (int)((H + cc - 1) / cc);
    for (int ch = 0; ch < nch; ch++) {
        int64_t wdt = (ch + 1) * cc < H ? cc : H - ch * cc;
        uint64_t want = (uint64_t)nb * (uint64_t)((wdt + 255) / 256);
        if (chunk_cnt[ch] != want) bad_chunks++;
    }
    for (int ch = nch; ch < 64; ch++) bad_chunks += chunk_cnt[ch] != 0;
    if (nohooks) bad_chunks = 0;
    CHECK(bad_chunks == 0, "%s: chunk_done counters wrong in %d chunks (chunk 0: %llu)", c->tag, bad_chunks,
          (unsigned long long)chunk_cnt[0]);

    /* padding rows untouched */
    int64_t pad_h = 0, pad_o = 0;
    for (int64_t r = 0; r < MR; r++)
        if (is_padding_row(&pl, &d, r)) {
            for (int64_t i = 0; i < F; i++) pad_h += h[r * F + i] != 0xffff;
            for (int64_t i = 0; i < H; i++) pad_o += o[r * H + i] != 0xffff;
        }
    CHECK(pad_h == 0 && pad_o == 0, "%s: padding written: %lld in h, %lld in o", c->tag, (long long)pad_h,
          (long long)pad_o);

    /* values vs the CPU: all valid rows, or a sample with every block's first and last row */
    const int64_t nrows = pl.totals->num_rows;
    int64_t checked = 0, bad_h = 0, bad_o = 0;
    uint16_t *ref_h = (uint16_t *)malloc(2 * (size_t)F), *ref_o = (uint16_t *)malloc(2 * (size_t)H);
    const int all = nrows <= c->max_check_rows;
    double first_bad = 0, first_ref = 0, first_atol = 0; /* the first bad h element: difference, reference, floor */
    for (int b = 0; b < nb; b++) {
        const comet_plan_block_t blk = pl.blocks[b];
        for (int i = 0; i < blk.num_rows; i++) {
            int pick = all || i == 0 || i == blk.num_rows - 1 ||
                       comet_rng_uniform(&rng) < (double)c->max_check_rows / (double)nrows;
            if (!pick) continue;
            const int64_t r = blk.row_start + i;
            comet_cpu_gemm0_row(&d, a + r * H, w1 + (int64_t)blk.expert * d.w1_rows * H, 0, F, ref_h);
            const float atol_h = row_atol(ref_h, F);
            for (int64_t n = 0; n < F; n++)
                if (!close_bf16(h[r * F + n], ref_h[n], atol_h)) {
                    if (!bad_h) {
                        first_bad = comet_bf16_to_f32(h[r * F + n]) - comet_bf16_to_f32(ref_h[n]);
                        first_ref = comet_bf16_to_f32(ref_h[n]), first_atol = atol_h;
                    }
                    bad_h++;
                }
            comet_cpu_gemm1_row(&d, h + r * F, w2 + (int64_t)blk.expert * H * F, 0, H, ref_o);
            const float atol_o = row_atol(ref_o, H);
            for (int64_t n = 0; n < H; n++) bad_o += !close_bf16(o[r * H + n], ref_o[n], atol_o);
            checked++;
        }
    }
    CHECK(bad_h == 0 && bad_o == 0,
          "%s: %lld of h, %lld of o over tolerance (%lld rows checked; first bad h: diff %g, reference %g, floor %g)",
          c->tag, (long long)bad_h, (long long)bad_o, (long long)checked, first_bad, first_ref, first_atol);
    printf("%s: %d blocks, %lld rows (%lld checked, %s), h/o bad %lld/%lld, padding written %lld/%lld, GEMM1 split: "
           "blocks %d.. in %d pieces\n", c->tag, nb, (long long)nrows, (long long)checked, all ? "all" : "sampled",
           (long long)bad_h, (long long)bad_o, (long long)pad_h, (long long)pad_o, pieces > 1 ? split_b0 : nb, pieces);

    /* a second GEMM0 in expert order (the first walked l0_order, unless COMET_GEMM_TEST_NOHOOKS made
     * both walk one order) writes the same bits, and a third in expert order waiting for blocks
     * released late in reverse: slower, never stuck */
    uint16_t *h2 = (uint16_t *)malloc(2 * (size_t)(MR * F));
    if (!relaunch_same(g, launch_gemm0, NULL, NULL, NULL, 0, 0, d_h, h, h2, 2 * (size_t)(MR * F), c->tag,
                       "GEMM0 in expert order against l0_order's"))
        return;
    if (!nohooks) {
        memset(&hk, 0, sizeof hk);
        hk.block_ready = d_ready, hk.epoch = d_epoch, hk.num_ctas = sms - 8, hk.timeout_ns = 5000000000ull;
        uint64_t *rep_h = NULL, *rep_d = NULL; /* a timeout's report, as for the first hooked launch */
        CUDA_OK(cudaHostAlloc(&rep_h, 64, cudaHostAllocMapped));
        CUDA_OK(cudaHostGetDevicePointer(&rep_d, rep_h, 0));
        memset(rep_h, 0, 64);
        hk.timeout_report = rep_d;
        const int ok = relaunch_same(g, launch_gemm0, NULL, &hk, d_ready, nb, s2, d_h, h, h2, 2 * (size_t)(MR * F), c->tag,
                                     "GEMM0 in expert order waiting for blocks released late");
        char msg[256];
        if (!ok && comet_gemm_timeout_message(rep_h, msg, sizeof msg)) printf("%s\n", msg);
        cudaFreeHost(rep_h);
        if (!ok) return;
    }
    free(h2);
    if (bwd) {
        const bwd_ctx_t bx = {c, &d, &pl, &ga, a, w1, w2, h, d_h, d_ready, d_epoch, d_chunk, s2, sms, bwd == 2, &rng};
        check_backward(&bx);
    }

    /* a second GEMM1 (tile counters reset by the first) writes the same bits */
    uint16_t *o2 = (uint16_t *)malloc(2 * (size_t)(MR * H));
    if (!relaunch_same(g, launch_gemm1, NULL, NULL, NULL, 0, 0, d_o, o, o2, 2 * (size_t)(MR * H), c->tag, "second GEMM1 against the first"))
        return;

    /* the device split what the rule says: GEMM1 prepared without the split (knobs.split_min 0)
     * gives the whole tiles' rows the same bits and, on the large split case (other sums of K,
     * random inputs), the split blocks' rows some other bits */
    if (pieces > 1) {
        comet_gemm_args_t whole = ga;
        whole.knobs.split_min = 0;
        comet_gemm_t *g0 = NULL;
        rc = comet_gemm_prepare(&whole, &g0, err, sizeof err);
        CHECK(rc == 0 && comet_gemm_split_of(g0, nb, NULL) == 1, "%s: prepare without the split: %s", c->tag,
              rc ? err : "it still splits");
        if (rc == 0) {
            CUDA_OK(cudaMemset(d_o, 0xff, 2 * (size_t)(MR * H)));
            CHECK(comet_gemm1_launch(g0, 0, NULL) == 0, "%s: gemm1 launch without the split", c->tag);
            CUDA_OK(cudaDeviceSynchronize());
            CUDA_OK(cudaMemcpy(o2, d_o, 2 * (size_t)(MR * H), cudaMemcpyDeviceToHost));
            int64_t whole_diff = 0, split_diff = 0;
            for (int b = 0; b < nb; b++)
                for (int64_t i = 0; i < pl.blocks[b].num_rows * H; i++) {
                    const int64_t e = pl.blocks[b].row_start * H + i;
                    if (o[e] != o2[e]) *(b < split_b0 ? &whole_diff : &split_diff) += 1;
                }
            const int large = strstr(c->tag, "(split)") != NULL;
            CHECK(whole_diff == 0 && (!large || split_diff > 0),
                  "%s: against GEMM1 without the split, %lld elements of whole tiles differ (want 0), %lld of "
                  "split tiles%s", c->tag, (long long)whole_diff, (long long)split_diff, large ? " (want > 0)" : "");
            comet_gemm_destroy(g0);
        }
    }
    free(o2);

    comet_gemm_destroy(g);
    cudaStreamDestroy(s1), cudaStreamDestroy(s2);
    cudaFree(d_ws), cudaFree(d_a), cudaFree(d_w1), cudaFree(d_w2), cudaFree(d_h), cudaFree(d_o);
    cudaFree(d_flags), cudaFree(d_skip);
    free(idx), free(wts), free(ws), free(x), free(a), free(w1), free(w2), free(h), free(o), free(ref_h), free(ref_o);
}

/* Child process: block_ready never set -> the producer must time out, leave a
 * report and trap. Exit 0 when the launch failed and the report names block
 * 0's wait. */
static int timeout_child(void) {
    gcase_t c = {"timeout", 256, 128, 2, 1, 64, 0, 0, 0, 0, 0};
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = c.hidden, cfg.ffn = c.ffn, cfg.num_experts = c.experts, cfg.topk = c.topk;
    cfg.max_tokens_per_rank = c.tokens, cfg.tile_m = 128;
    comet_dims_t d;
    if (comet_dims_from_config(&cfg, 1, 0, &d) != COMET_SUCCESS) return 2;
    comet_rng_t rng = {5};
    int32_t idx[64];
    float w[64];
    make_routing(&c, &rng, idx, w);
    size_t ws_bytes = comet_plan_workspace_bytes(&d);
    void *ws = aligned_alloc(64, (ws_bytes + 63) / 64 * 64);
    comet_plan_t pl;
    comet_plan_carve(&d, ws, &pl);
    int64_t tok[1] = {64};
    const int32_t *ip[1] = {idx};
    const float *wp[1] = {w};
    comet_plan_input_t in = {tok, ip, wp};
    comet_plan_build(&d, &in, &pl);
    void *d_ws, *buf;
    uint64_t *ready, *report_h, *report_d;
    if (cudaMalloc(&d_ws, ws_bytes) || cudaMalloc(&buf, 8 << 20) || cudaMalloc(&ready, 4096)) return 3;
    cudaMemcpy(d_ws, ws, ws_bytes, cudaMemcpyHostToDevice);
    cudaMemset(buf, 0, 8 << 20);
    cudaMemset(ready, 0, 4096);
    if (cudaHostAlloc(&report_h, 64, cudaHostAllocMapped) || cudaHostGetDevicePointer(&report_d, report_h, 0)) return 4;
    memset(report_h, 0, 64);
    comet_gemm_args_t ga;
    memset(&ga, 0, sizeof ga); /* no push targets; prepare allocates the tile counters */
    ga.knobs = comet_gemm_knobs_read(); /* COMET_GEMM_* as a layer created now reads them */
    uint16_t *p = (uint16_t *)buf;
    const size_t part = (size_t)1 << 18; /* elements; every operand of this shape fits */
    ga.d = d, ga.plan_ws = d_ws, ga.a = p, ga.w1 = p + part, ga.h = p + 2 * part, ga.w2 = p + 3 * part,
    ga.o = p + 4 * part;
    comet_gemm_t *g;
    char err[256];
    if (comet_gemm_prepare(&ga, &g, err, sizeof err)) return 5;
    comet_gemm_hooks_t hk;
    memset(&hk, 0, sizeof hk);
    uint64_t *epoch = NULL, seven = 7;
    if (cudaMalloc((void **)&epoch, sizeof seven) != cudaSuccess ||
        cudaMemcpy(epoch, &seven, sizeof seven, cudaMemcpyHostToDevice) != cudaSuccess)
        return 7;
    hk.block_ready = ready;
    hk.epoch = epoch;
    hk.timeout_ns = 50000000ull; /* 50 ms */
    hk.timeout_report = report_d;
    if (comet_gemm0_launch(g, 0, &hk)) return 6;
    cudaError_t e = cudaDeviceSynchronize();
    char msg[256];
    int have = comet_gemm_timeout_message(report_h, msg, sizeof msg);
    printf("test_gemm_gpu: timeout child: sync said \"%s\"; report: %s\n", cudaGetErrorString(e),
           have ? msg : "(none)");
    fflush(stdout);
    return e != cudaSuccess && have && report_h[6] == 7 && report_h[2] == 0 ? 0 : 1;
}

int main(void) {
    /* The timeout children first (without and with 2-CTA clusters), before
     * this process touches CUDA (fork and CUDA do not mix). */
    int n = 0, child_rc[2] = {0, 0};
    for (int cl = 0; cl < 2; cl++) {
        pid_t pid = fork();
        if (pid == 0) {
            setenv("COMET_GEMM_CLUSTER", cl ? "1" : "0", 1);
            if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) _exit(100);
            cudaDeviceProp prop;
            cudaGetDeviceProperties(&prop, 0);
            if (prop.major != 9) _exit(100);
            _exit(getenv("COMET_GEMM_TEST_SMALL") ? 0 : timeout_child()); /* no planted trap under a sanitizer */
        }
        int status = 0;
        waitpid(pid, &status, 0);
        child_rc[cl] = WIFEXITED(status) ? WEXITSTATUS(status) : 200;
        if (child_rc[cl] == 100) break;
    }
    if (child_rc[0] == 100 || cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        check_skip("test_gemm_gpu", child_rc[0] == 100 ? "no GPU or not sm_90" : "no GPU");
        return check_summary("test_gemm_gpu");
    }
    for (int cl = 0; cl < 2; cl++)
        CHECK(child_rc[cl] == 0, "block_ready timeout%s: the child exited %d (want: trapped with a report, 0)",
              cl ? " (2-CTA clusters)" : "", child_rc[cl]);

    static const gcase_t cases[] = {
        /* tag, H, F, E, topk, T, act, zero experts, skew, chunk, rows checked */
        {"mixtral-like gated H4096 F1792 E8 k2", 4096, 1792, 8, 2, 700, 0, 0, 0.0, 1024, 96},
        {"qwen2-like gated H2048 F1408 E32 k4 skewed, 3 empty", 2048, 1408, 32, 4, 1024, 0, 3, 1.0, 512, 160},
        {"one expert gated H512 F256", 512, 256, 1, 1, 300, 0, 0, 0.0, 0, 100000},
        {"gelu H1088 F320 E4 k2, 1 empty, chunk 512 (last 64)", 1088, 320, 4, 2, 200, 1, 1, 0.0, 512, 100000},
        {"gelu H1024 F576 E8 k3 skewed", 1024, 576, 8, 3, 333, 1, 0, 1.5, 256, 100000},
        {"one token gated E4 k1", 256, 128, 4, 1, 1, 0, 0, 0.0, 0, 100000},
        {"full blocks gated H256 F384 E2 k1", 256, 384, 2, 1, 256, 0, 0, 0.0, 0, 100000},
        {"qwen2-TP2-like gated H2048 F704 (last h tile half) E30 k4", 2048, 704, 30, 4, 600, 0, 0, 0.5, 512, 100000},
        {"gated H512 F200 (h tile of 72, K tail of 8) E6 k2", 512, 200, 6, 2, 250, 0, 1, 0.0, 256, 100000},
        {"gated H1024 F168 (last h tile of 40: n128) E5 k2", 1024, 168, 5, 2, 260, 0, 0, 0.3, 256, 100000},
        {"gelu H768 F136 (K tail of 8) E5 k2", 768, 136, 5, 2, 190, 1, 0, 0.0, 256, 100000},
        /* 12 blocks x 16 column tiles = 96 cluster tiles on 66 clusters: the last 4 blocks in 2 pieces */
        {"gated H4096 F4096 E4 k2, chunk 1024 (split)", 4096, 4096, 4, 2, 600, 0, 0, 0.0, 1024, 40},
    };
    check_gelu_device();
    /* COMET_GEMM_TEST_SMALL=1 (e.g. under compute-sanitizer): only the small cases */
    const int small = getenv("COMET_GEMM_TEST_SMALL") != NULL;
    /* every case without clusters and as 2-CTA clusters sharing B tiles (the default; read at prepare) */
    static const char *const pass[2] = {"without clusters (COMET_GEMM_CLUSTER=0)", "in 2-CTA clusters (the default)"};
    for (int cl = 0; cl < 2; cl++) {
        if (cl == 1) unsetenv("COMET_GEMM_CLUSTER");
        else setenv("COMET_GEMM_CLUSTER", "0", 1);
        printf("test_gemm_gpu: the cases %s\n", pass[cl]);
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            if (!small || cases[i].hidden * cases[i].ffn * cases[i].experts <= 16 * 1024 * 1024) run_case(&cases[i], 1000 + i, 1 + cl);
    }
    unsetenv("COMET_GEMM_CLUSTER");
    /* GEMM1's tail split with pieces of one k-slice and up (COMET_GEMM_SPLIT=1, read at prepare): most
     * cases split then, in clusters and without */
    setenv("COMET_GEMM_SPLIT", "1", 1);
    for (int cl = 0; cl < 2; cl++) {
        if (cl) unsetenv("COMET_GEMM_CLUSTER");
        else setenv("COMET_GEMM_CLUSTER", "0", 1);
        printf("test_gemm_gpu: the cases with the tail split forced (COMET_GEMM_SPLIT=1), %s\n",
               cl ? "in 2-CTA clusters" : "without clusters");
        split_cases = 0;
        int ran = 0;
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            if (!small || cases[i].hidden * cases[i].ffn * cases[i].experts <= 16 * 1024 * 1024) {
                run_case(&cases[i], 3000 + i, 0);
                ran++;
            }
        CHECK(2 * split_cases >= ran, "COMET_GEMM_SPLIT=1: only %d of %d cases split GEMM1", split_cases, ran);
    }
    unsetenv("COMET_GEMM_SPLIT");
    unsetenv("COMET_GEMM_CLUSTER");
    /* the gated last h tiles of <= 64 columns once more at full width, masked (COMET_GEMM_NARROW=0) */
    setenv("COMET_GEMM_NARROW", "0", 1);
    printf("test_gemm_gpu: the last-h-tile cases at full width (COMET_GEMM_NARROW=0)\n");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (strstr(cases[i].tag, "last h tile")) run_case(&cases[i], 2000 + i, 1);
    unsetenv("COMET_GEMM_NARROW");

    /* shape checks (need no GPU, run here anyway) */
    comet_dims_t d;
    memset(&d, 0, sizeof d);
    d.tile_m = 64, d.hidden = 4096, d.ffn_local = 14336, d.activation = 0;
    CHECK(comet_gemm_check(&d) != NULL, "tile_m 64 accepted");
    d.tile_m = 128, d.ffn_local = 1340;
    CHECK(comet_gemm_check(&d) != NULL, "gated F_local 1340 (rows of h not 16-byte multiples) accepted");
    d.ffn_local = 704;
    CHECK(comet_gemm_check(&d) == NULL, "gated F_local 704 rejected");
    d.activation = 1;
    CHECK(comet_gemm_check(&d) == NULL, "GELU F_local 704 rejected");
    d.hidden = 4000;
    CHECK(comet_gemm_check(&d) != NULL, "H 4000 accepted");
    return check_summary("test_gemm_gpu");
}
