/*
 * test_wgrad_gpu.cu - the Hopper k-grouped weight-gradient GEMM
 * (src/cuda/gemm_wgrad.h) against a CPU sum in double: C_e = sum over expert
 * e's rows of a[r]^T b[r], over plans built on the host from random
 * routings (skewed, experts with no rows, one row, slices of exactly 64
 * rows, long experts, m and n tails). Inputs are random bf16; padding rows
 * and the rows past the plan hold NaN, which must not reach the result.
 * Each case runs the three output modes: bf16 and fp32 written (output
 * poisoned with NaN first: every element must be written, empty experts as
 * zeros) and fp32 accumulated (c += sum on random values, some -0: empty
 * experts' bits unchanged). Tolerance, with S_ij the sum of |a b| over the
 * expert's K rows: fp32 |got - ref| <= 3e-6 sqrt(K) S_ij (the fp32
 * accumulation error is ~sqrt(K) 2^-24 S, a missing row is ~S/K), plus one
 * ulp of the result for bf16 (rounded once) and for the accumulated add.
 * Also: the same bits from a repeated launch, from 7 CTAs instead of one per
 * SM and from a CUDA graph replay; skip leaves c untouched.
 * Small cases are checked element by element (odd m tile counts and one
 * expert of 11 m tiles among them); the model-sized ones (Mixtral,
 * Qwen2-MoE and DeepSeek-V3-style dW2 and dW1) on 4096 sampled elements plus every element's
 * being written, and timed (informational: TFLOP/s over the valid rows).
 * Without a GPU, or on one that is not sm_90, it prints "skipped".
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../src/core/validate.h"
#include "../src/cuda/gemm_wgrad.h"
#include "../harness/workload.h"
#include "check.h"

typedef struct {
    const char *tag;
    int64_t m, n;         /* output per expert */
    int64_t experts, topk, tokens;
    int zero_experts;     /* experts with no rows */
    double skew;          /* 0 uniform; >0: popularity u^(1+4 skew) */
    int round_robin;      /* token t -> expert t % E (exact counts) */
    int timed;            /* model-sized: sampled check and timing */
} wcase_t;

/* splitmix64 step (fast fill of the large inputs) */
static uint64_t mix(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
/* bf16 uniform in (-1, 1) from 16 random bits, never 0 */
static uint16_t bits_bf16(uint32_t r) {
    const float u = ((float)(r & 0xffff) + 0.5f) / 65536.0f * 2.0f - 1.0f;
    return comet_f32_to_bf16(u);
}

static void make_routing(const wcase_t *c, comet_rng_t *rng, int32_t *idx, float *w) {
    double *pop = (double *)malloc(sizeof(double) * (size_t)c->experts);
    for (int64_t e = 0; e < c->experts; e++) pop[e] = c->skew > 0 ? pow(0.05 + comet_rng_uniform(rng), 1.0 + 4.0 * c->skew) : 1.0;
    for (int z = 0; z < c->zero_experts; z++) pop[(z * 7 + 3) % c->experts] = 0.0;
    double total = 0;
    for (int64_t e = 0; e < c->experts; e++) total += pop[e];
    for (int64_t t = 0; t < c->tokens; t++)
        for (int64_t j = 0; j < c->topk; j++) {
            int32_t e = (int32_t)((t + j) % c->experts);
            while (!c->round_robin) {
                const double x = comet_rng_uniform(rng) * total;
                double acc = 0;
                e = -1;
                for (int64_t q = 0; q < c->experts && e < 0; q++) {
                    acc += pop[q];
                    if (x < acc && pop[q] > 0) e = (int32_t)q;
                }
                if (e < 0) continue;
                int dup = 0;
                for (int64_t q = 0; q < j; q++) dup |= idx[t * c->topk + q] == e;
                if (!dup) break;
            }
            idx[t * c->topk + j] = e;
            w[t * c->topk + j] = 0.5f;
        }
    free(pop);
}

static float bf(uint16_t h) { return comet_bf16_to_f32(h); }

/* got (fp32 value of the output) against ref, abs-sum s over k rows; mode a comet_wgrad_out_t */
static int close_to(double got, double ref, double s, int64_t k, int mode) {
    if (!isfinite(got)) return 0;
    double tol = 3e-6 * sqrt((double)(k > 0 ? k : 1)) * s;
    if (mode == COMET_WGRAD_BF16 && ref != 0) tol += ldexp(1.0, ilogb(fabs(ref)) - 7);
    if (mode == COMET_WGRAD_F32_ADD && ref != 0) tol += ldexp(1.0, ilogb(fabs(ref)) - 23);
    return fabs(got - ref) <= tol;
}

/* the accumulated mode's starting values: a hash, some -0 */
static float start_value(int64_t i) {
    if (i % 97 == 0) return -0.0f;
    return (float)((uint32_t)(i * 2654435761u) % 2001u) / 1000.0f - 1.0f;
}

static double now_flops_tf(double flops, float ms) { return flops / ((double)ms * 1e-3) / 1e12; }

static void run_case(const wcase_t *c, uint64_t seed) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 256, cfg.ffn = 256, cfg.num_experts = c->experts, cfg.topk = c->topk; /* rows only */
    cfg.max_tokens_per_rank = c->tokens, cfg.tile_m = 128;
    comet_dims_t d;
    if (comet_dims_from_config(&cfg, 1, 0, &d) != COMET_SUCCESS) {
        CHECK(0, "%s: dims: %s", c->tag, comet_last_error());
        return;
    }
    const char *why = comet_wgrad_check(c->m, c->n);
    CHECK(why == NULL, "%s: shape rejected: %s", c->tag, why ? why : "");
    if (why) return;
    comet_rng_t rng = {seed};
    const int64_t T = c->tokens, K = c->topk, E = d.experts_local, MR = d.max_rows_padded, m = c->m, n = c->n;
    int32_t *idx = (int32_t *)malloc(sizeof(int32_t) * (size_t)(T * K));
    float *wts = (float *)malloc(sizeof(float) * (size_t)(T * K));
    make_routing(c, &rng, idx, wts);
    const size_t ws_bytes = comet_plan_workspace_bytes(&d);
    void *ws = aligned_alloc(64, (ws_bytes + 63) / 64 * 64);
    memset(ws, 0, ws_bytes);
    comet_plan_t pl;
    comet_plan_carve(&d, ws, &pl);
    int64_t tok[1] = {T};
    const int32_t *idxp[1] = {idx};
    const float *wp[1] = {wts};
    comet_plan_input_t in = {tok, idxp, wp};
    comet_plan_build(&d, &in, &pl);

    /* a, b: random bf16 in valid rows, NaN in padding rows and past the plan */
    uint16_t *a = (uint16_t *)malloc(2 * (size_t)(MR * m)), *b = (uint16_t *)malloc(2 * (size_t)(MR * n));
    memset(a, 0xff, 2 * (size_t)(MR * m));
    memset(b, 0xff, 2 * (size_t)(MR * n));
    uint64_t st = seed * 7919u + 1;
    int64_t nrows = 0, empty = 0;
    for (int64_t e = 0; e < E; e++) {
        empty += pl.expert_count[e] == 0;
        for (int64_t r = pl.expert_start[e]; r < pl.expert_start[e] + pl.expert_count[e]; r++, nrows++) {
            for (int64_t i = 0; i < m; i += 4) {
                const uint64_t z = mix(&st);
                for (int q = 0; q < 4 && i + q < m; q++) a[r * m + i + q] = bits_bf16((uint32_t)(z >> (16 * q)));
            }
            for (int64_t i = 0; i < n; i += 4) {
                const uint64_t z = mix(&st);
                for (int q = 0; q < 4 && i + q < n; q++) b[r * n + i + q] = bits_bf16((uint32_t)(z >> (16 * q)));
            }
        }
    }

    /* reference: all elements (small cases) or a sample (model-sized), in double */
    const int64_t total = E * m * n;
    const int64_t nref = c->timed ? 4096 : total;
    int64_t *ref_at = (int64_t *)malloc(sizeof(int64_t) * (size_t)nref);
    double *ref = (double *)calloc((size_t)nref, sizeof(double)), *refs = (double *)calloc((size_t)nref, sizeof(double));
    if (!c->timed) {
        float *af = (float *)malloc(sizeof(float) * (size_t)m), *bfl = (float *)malloc(sizeof(float) * (size_t)n);
        for (int64_t i = 0; i < total; i++) ref_at[i] = i;
        for (int64_t e = 0; e < E; e++)
            for (int64_t r = pl.expert_start[e]; r < pl.expert_start[e] + pl.expert_count[e]; r++) {
                for (int64_t i = 0; i < m; i++) af[i] = bf(a[r * m + i]);
                for (int64_t j = 0; j < n; j++) bfl[j] = bf(b[r * n + j]);
                for (int64_t i = 0; i < m; i++) {
                    double *o = ref + (e * m + i) * n, *os = refs + (e * m + i) * n;
                    const double ai = af[i];
                    for (int64_t j = 0; j < n; j++) {
                        const double p = ai * (double)bfl[j];
                        o[j] += p;
                        os[j] += fabs(p);
                    }
                }
            }
        free(af), free(bfl);
    } else {
        for (int64_t s = 0; s < nref; s++) {
            /* the first and last rows and columns of every expert, then random elements */
            const int64_t e = s % E, q = s / E;
            int64_t i = (int64_t)(mix(&st) % (uint64_t)m), j = (int64_t)(mix(&st) % (uint64_t)n);
            if (q == 0) i = 0, j = 0;
            if (q == 1) i = m - 1, j = n - 1;
            if (q == 2) i = m - 1, j = 0;
            if (q == 3) i = 0, j = n - 1;
            ref_at[s] = (e * m + i) * n + j;
            for (int64_t r = pl.expert_start[e]; r < pl.expert_start[e] + pl.expert_count[e]; r++) {
                const double p = (double)bf(a[r * m + i]) * (double)bf(b[r * n + j]);
                ref[s] += p, refs[s] += fabs(p);
            }
        }
    }

    void *d_ws, *d_c;
    uint16_t *d_a, *d_b;
    uint32_t *d_skip;
    CUDA_OK(cudaMalloc(&d_ws, ws_bytes));
    CUDA_OK(cudaMalloc(&d_a, 2 * (size_t)(MR * m)));
    CUDA_OK(cudaMalloc(&d_b, 2 * (size_t)(MR * n)));
    CUDA_OK(cudaMalloc(&d_c, 4 * (size_t)total));
    CUDA_OK(cudaMalloc(&d_skip, 4));
    CUDA_OK(cudaMemcpy(d_ws, ws, ws_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_a, a, 2 * (size_t)(MR * m), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_b, b, 2 * (size_t)(MR * n), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(d_skip, 0, 4));
    float *start = (float *)malloc(4 * (size_t)total);
    for (int64_t i = 0; i < total; i++) start[i] = start_value(i);
    void *got = malloc(4 * (size_t)total), *again = malloc(4 * (size_t)total);
    cudaStream_t s1;
    CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    const double flops = 2.0 * (double)nrows * (double)m * (double)n;
    printf("%s: %lld experts (%lld empty), %lld rows, m %lld n %lld\n", c->tag, (long long)E, (long long)empty,
           (long long)nrows, (long long)m, (long long)n);

    static const char *const mode_name[3] = {"bf16", "fp32", "fp32 +="};
    for (int mode = 0; mode < 3; mode++) {
        comet_wgrad_args_t ga;
        memset(&ga, 0, sizeof ga);
        ga.d = d, ga.plan_ws = d_ws, ga.m = m, ga.n = n, ga.a = d_a, ga.b = d_b, ga.c = d_c, ga.out = mode;
        comet_wgrad_t *g = NULL;
        char err[256];
        const int rc = comet_wgrad_prepare(&ga, &g, err, sizeof err);
        CHECK(rc == 0, "%s: prepare (%s): %s", c->tag, mode_name[mode], err);
        if (rc) continue;
        const size_t bytes = (mode == 0 ? 2 : 4) * (size_t)total;
        /* output: poisoned (written modes) or the start values (accumulated) */
        /* (then a device sync: s1 does not wait for the legacy stream, whose memset and pageable
         * copy may still run when the call returns) */
#define WG_RESET()                                                                      \
    do {                                                                                \
        if (mode == 2) CUDA_OK(cudaMemcpy(d_c, start, bytes, cudaMemcpyHostToDevice)); \
        else CUDA_OK(cudaMemset(d_c, 0xff, bytes));                                     \
        CUDA_OK(cudaDeviceSynchronize());                                               \
    } while (0)
        /* skip set: nothing written */
        WG_RESET();
        comet_wgrad_hooks_t hk;
        memset(&hk, 0, sizeof hk);
        CUDA_OK(cudaMemset(d_skip, 1, 4));
        CUDA_OK(cudaDeviceSynchronize());
        hk.skip = d_skip;
        CHECK(comet_wgrad_launch(g, s1, &hk) == 0, "%s: launch (skip)", c->tag);
        CUDA_OK(cudaStreamSynchronize(s1));
        CUDA_OK(cudaMemset(d_skip, 0, 4));
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(got, d_c, bytes, cudaMemcpyDeviceToHost));
        if (mode == 2) CHECK(memcmp(got, start, bytes) == 0, "%s: %s: skip set, yet c changed", c->tag, mode_name[mode]);
        else {
            int64_t written = 0;
            for (size_t i = 0; i < bytes; i++) written += ((unsigned char *)got)[i] != 0xff;
            CHECK(written == 0, "%s: %s: skip set, yet %lld bytes written", c->tag, mode_name[mode], (long long)written);
        }
        /* the run checked (the skip word read as 0 now) */
        WG_RESET();
        CHECK(comet_wgrad_launch(g, s1, &hk) == 0, "%s: launch", c->tag);
        CUDA_OK(cudaStreamSynchronize(s1));
        CUDA_OK(cudaGetLastError());
        CUDA_OK(cudaMemcpy(got, d_c, bytes, cudaMemcpyDeviceToHost));
        int64_t bad = 0, unwritten = 0, empty_changed = 0, first = -1;
        double fgot = 0, fref = 0;
        for (int64_t s = 0; s < nref; s++) {
            const int64_t at = ref_at[s], e = at / (m * n);
            const int64_t k = pl.expert_count[e];
            double v, want = ref[s];
            if (mode == 0) v = bf(((uint16_t *)got)[at]);
            else v = ((float *)got)[at];
            if (mode == 2) {
                if (k == 0) {
                    empty_changed += memcmp((float *)got + at, start + at, 4) != 0;
                    continue;
                }
                want += (double)start[at];
            }
            if (!close_to(v, want, refs[s], k, mode)) {
                if (first < 0) first = at, fgot = v, fref = want;
                bad++;
            }
        }
        if (mode != 2) /* every element written: no NaN left */
            for (int64_t i = 0; i < total; i++)
                unwritten += mode == 0 ? isnan(bf(((uint16_t *)got)[i])) : isnan(((float *)got)[i]);
        CHECK(bad == 0 && unwritten == 0 && empty_changed == 0,
              "%s: %s: %lld of %lld checked elements over tolerance (first at %lld: got %.9g, want %.9g), %lld "
              "NaN, %lld elements of empty experts changed",
              c->tag, mode_name[mode], (long long)bad, (long long)nref, (long long)first, fgot, fref,
              (long long)unwritten, (long long)empty_changed);

        /* the same bits again: a repeated launch, 7 CTAs, a graph replay */
        static const char *const how[3] = {"a repeated launch", "7 CTAs", "a CUDA graph replay"};
        for (int r = 0; r < 3; r++) {
            WG_RESET();
            comet_wgrad_hooks_t h2 = hk;
            if (r == 1) h2.num_ctas = 7;
            if (r < 2) {
                CHECK(comet_wgrad_launch(g, s1, &h2) == 0, "%s: launch (%s)", c->tag, how[r]);
            } else {
                cudaGraph_t graph;
                cudaGraphExec_t exec;
                CUDA_OK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeThreadLocal));
                const int lrc = comet_wgrad_launch(g, s1, &h2);
                CUDA_OK(cudaStreamEndCapture(s1, &graph));
                CHECK(lrc == 0, "%s: launch in a capture", c->tag);
                CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
                CUDA_OK(cudaGraphLaunch(exec, s1));
                CUDA_OK(cudaStreamSynchronize(s1));
                cudaGraphExecDestroy(exec);
                cudaGraphDestroy(graph);
            }
            CUDA_OK(cudaStreamSynchronize(s1));
            CUDA_OK(cudaMemcpy(again, d_c, bytes, cudaMemcpyDeviceToHost));
            CHECK(memcmp(got, again, bytes) == 0, "%s: %s: %s gave other bits", c->tag, mode_name[mode], how[r]);
        }

        if (c->timed) { /* median of 9 timed launches after 2 warm-ups (accumulating onto whatever is there) */
            float ms[9];
            for (int r = 0; r < 11; r++) {
                CUDA_OK(cudaEventRecord(e0, s1));
                CHECK(comet_wgrad_launch(g, s1, &hk) == 0, "%s: timed launch", c->tag);
                CUDA_OK(cudaEventRecord(e1, s1));
                CUDA_OK(cudaEventSynchronize(e1));
                if (r >= 2) CUDA_OK(cudaEventElapsedTime(&ms[r - 2], e0, e1));
            }
            for (int i = 0; i < 9; i++)
                for (int j = i + 1; j < 9; j++)
                    if (ms[j] < ms[i]) {
                        const float t = ms[i];
                        ms[i] = ms[j], ms[j] = t;
                    }
            printf("test_wgrad_gpu: timing %-28s %-8s %8.3f ms  %6.1f TFLOP/s  (min %.3f ms, max %.3f ms)\n", c->tag,
                   mode_name[mode], ms[4], now_flops_tf(flops, ms[4]), ms[0], ms[8]);
        }
        comet_wgrad_destroy(g);
#undef WG_RESET
    }
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    cudaStreamDestroy(s1);
    cudaFree(d_ws), cudaFree(d_a), cudaFree(d_b), cudaFree(d_c), cudaFree(d_skip);
    free(idx), free(wts), free(ws), free(a), free(b), free(ref_at), free(ref), free(refs), free(start), free(got),
        free(again);
}

int main(void) {
    /* shape checks (no GPU needed) */
    CHECK(comet_wgrad_check(4096, 14336) == NULL, "Mixtral dW2 rejected");
    CHECK(comet_wgrad_check(28672, 4096) == NULL, "Mixtral dW1 rejected");
    CHECK(comet_wgrad_check(2048, 1408) == NULL, "Qwen2 dW2 rejected");
    CHECK(comet_wgrad_check(72, 40) == NULL, "72 x 40 rejected");
    CHECK(comet_wgrad_check(4096, 1340) != NULL, "n 1340 (rows not 16-byte multiples) accepted");
    CHECK(comet_wgrad_check(0, 64) != NULL, "m 0 accepted");
    int n = 0;
    cudaDeviceProp prop;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0 || cudaGetDeviceProperties(&prop, 0) != cudaSuccess ||
        prop.major != 9) {
        check_skip("test_wgrad_gpu", "no GPU or not sm_90");
        return check_summary("test_wgrad_gpu");
    }
    printf("test_wgrad_gpu: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    static const wcase_t cases[] = {
        /* tag, m, n, E, topk, T, zero experts, skew, round robin, timed */
        {"m256 n512 E8 k2", 256, 512, 8, 2, 600, 0, 0.0, 0, 0},
        {"tails m72 n40 E5 k2, 1 empty", 72, 40, 5, 2, 260, 1, 0.0, 0, 0},
        {"m200 n328 E6 k3 skewed, 2 empty", 200, 328, 6, 3, 333, 2, 1.0, 0, 0},
        {"one row m128 n256", 128, 256, 4, 1, 1, 0, 0.0, 0, 0},
        {"slices of 64 rows m192 n320 E2", 192, 320, 2, 1, 256, 0, 0.0, 1, 0},
        {"long K m136 n264 E2 k1 skewed", 136, 264, 2, 1, 3000, 0, 1.0, 0, 0},
        {"qwen2-like m256 n192 E32 k4 skewed, 3 empty", 256, 192, 32, 4, 1024, 3, 1.0, 0, 0},
        {"odd m tiles m320 n200 E4 k2 skewed, 1 empty", 320, 200, 4, 2, 300, 1, 1.0, 0, 0},
        {"eleven m tiles m1408 n136 E3 k1", 1408, 136, 3, 1, 300, 0, 0.0, 0, 0},
        {"mixtral dW2 (EP2) H4096 F14336", 4096, 14336, 4, 1, 8192, 0, 0.0, 0, 1},
        {"mixtral dW1 (EP2) 2F28672 H4096", 28672, 4096, 4, 1, 8192, 0, 0.0, 0, 1},
        {"qwen2 dW2 H2048 F1408 E60", 2048, 1408, 60, 4, 4096, 0, 0.0, 0, 1},
        {"qwen2 dW1 2F2816 H2048 E60", 2816, 2048, 60, 4, 4096, 0, 0.0, 0, 1},
        {"deepseek dW2 H7168 F2048 E32", 7168, 2048, 32, 8, 2048, 0, 0.0, 0, 1},
        {"deepseek dW1 2F4096 H7168 E32", 4096, 7168, 32, 8, 2048, 0, 0.0, 0, 1},
    };
    const int small = getenv("COMET_WGRAD_TEST_SMALL") != NULL; /* only the small cases (e.g. under a sanitizer) */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (!small || !cases[i].timed) run_case(&cases[i], 100 + i);
    return check_summary("test_wgrad_gpu");
}
