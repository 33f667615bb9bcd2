/*
 * forward.c - one Mixture-of-Experts layer forward through comet's public API
 * (comet.h and nothing else from comet), checked against the reference.
 *
 *   1. Create a local world of R ranks (default 2). The CPU backend runs every
 *      rank as a thread of this process. The CUDA backend (rank r on GPU r)
 *      needs a build with -DWITH_CUDA (the tensors then go to GPU memory); it
 *      is used with --cuda, or by itself when comet sees at least R GPUs.
 *   2. Make random bf16 tokens and expert weights and a random top-k routing
 *      for a small model (hidden 256, ffn 512, 8 experts, top-2), its experts
 *      spread over the ranks (EP = R, TP = 1).
 *   3. Run comet_layer_forward on one thread per rank: it is collective.
 *   4. Compute the same outputs with comet_reference_forward and compare:
 *      bitwise on the CPU backend; on CUDA, where the GEMMs add in another
 *      order, within a small relative error.
 *
 * Build against an installed comet (make install PREFIX=...; see the README):
 *   cc -std=c11 forward.c $(pkg-config --cflags --libs comet) -pthread -o forward
 * or `make -C examples` (CUDA_HOME=... adds the CUDA backend).
 * Usage: forward [--cpu | --cuda] [ranks]      ranks: 1, 2, 4 or 8
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <comet.h>
#ifdef WITH_CUDA
#include <cuda_runtime.h>
#endif

enum { HIDDEN = 256, FFN = 512, EXPERTS = 8, TOPK = 2, TOKENS = 100 /* a rank */, MAX_RANKS = 8 };

/* bf16 is the upper half of an fp32: round the lower half away (to nearest even). */
static uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static float absf(float a) { return a < 0 ? -a : a; }

/* Uniform in [-1, 1) from a fixed seed: the same numbers on every run. */
static uint64_t rng_state = 42;
static float uniform(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)(rng_state >> 40) / (float)(1u << 23) - 1.0f;
}

/* One rank: its layer's inputs and outputs (host memory), what its thread reports. */
typedef struct {
    comet_world_t *world;
    int rank;
    const comet_layer_config_t *cfg;
    comet_forward_args_t args, ref; /* the forward's tensors; the same with y_ref as output */
    void *buf[7];                   /* x, topk_idx, topk_w, w1, w2, y, y_ref */
    size_t bytes[7];
    comet_status_t status;
    char error[512];
} rank_t;

/* The tensors of one forward over the 6 buffers x, topk_idx, topk_w, w1, w2, y. */
static comet_forward_args_t make_args(void *const b[6], int64_t experts_local) {
    comet_forward_args_t a = COMET_FORWARD_ARGS_INIT;
    a.x = comet_tensor_2d(b[0], COMET_DTYPE_BF16, TOKENS, HIDDEN);
    a.topk_idx = comet_tensor_2d(b[1], COMET_DTYPE_INT32, TOKENS, TOPK);
    a.topk_w = comet_tensor_2d(b[2], COMET_DTYPE_FP32, TOKENS, TOPK);
    a.w1 = comet_tensor_3d(b[3], COMET_DTYPE_BF16, experts_local, 2 * FFN, HIDDEN); /* gate, up rows */
    a.w2 = comet_tensor_3d(b[4], COMET_DTYPE_BF16, experts_local, HIDDEN, FFN);
    a.y = comet_tensor_2d(b[5], COMET_DTYPE_BF16, TOKENS, HIDDEN);
    return a;
}

/* Random tokens, expert weights and routing for one rank (0 when out of memory). */
static int make_inputs(rank_t *r) {
    const int64_t e_local = EXPERTS / r->cfg->ep;
    const size_t sizes[7] = {2 * TOKENS * HIDDEN, 4 * TOKENS * TOPK, 4 * TOKENS * TOPK,
                             (size_t)(2 * e_local * 2 * FFN * HIDDEN), (size_t)(2 * e_local * HIDDEN * FFN),
                             2 * TOKENS * HIDDEN, 2 * TOKENS * HIDDEN};
    for (int i = 0; i < 7; i++)
        if (!(r->buf[i] = malloc(r->bytes[i] = sizes[i]))) return 0;
    uint16_t *x = r->buf[0], *w1 = r->buf[3], *w2 = r->buf[4];
    int32_t *idx = r->buf[1];
    float *w = r->buf[2];
    for (size_t i = 0; i < sizes[0] / 2; i++) x[i] = float_to_bf16(uniform());
    for (size_t i = 0; i < sizes[3] / 2; i++) w1[i] = float_to_bf16(0.0625f * uniform()); /* ~ 1/sqrt(H) */
    for (size_t i = 0; i < sizes[4] / 2; i++) w2[i] = float_to_bf16(0.044f * uniform());  /* ~ 1/sqrt(F) */
    for (int t = 0; t < TOKENS; t++) { /* TOPK distinct experts a token, weights summing to 1 */
        float sum = 0;
        for (int j = 0, fresh; j < TOPK; j++) {
            do {
                idx[t * TOPK + j] = (int32_t)((uniform() + 1.0f) * 0.5f * EXPERTS) % EXPERTS;
                fresh = 1;
                for (int i = 0; i < j; i++) fresh &= idx[t * TOPK + i] != idx[t * TOPK + j];
            } while (!fresh);
            sum += w[t * TOPK + j] = 1.5f + uniform();
        }
        for (int j = 0; j < TOPK; j++) w[t * TOPK + j] /= sum;
    }
    void *ref_buf[6] = {r->buf[0], r->buf[1], r->buf[2], r->buf[3], r->buf[4], r->buf[6]};
    r->args = make_args(r->buf, e_local);
    r->ref = make_args(ref_buf, e_local);
    return 1;
}

/* A rank's thread: create the layer, run one forward, destroy the layer. All
 * three calls are collective: every rank makes them, in the same order. */
static void *rank_main(void *arg) {
    rank_t *r = arg;
    comet_forward_args_t a = r->args;
#ifdef WITH_CUDA /* the CUDA backend takes GPU memory: copy the inputs to this rank's GPU */
    void *dev[6] = {0};
    cudaStream_t stream = NULL;
    cudaError_t ce = cudaSuccess;
    const int cuda = comet_world_backend(r->world) == COMET_BACKEND_CUDA;
    if (cuda) { /* on an error, go on with NULL tensors: the layer calls fail on every rank alike */
        ce = cudaSetDevice(comet_world_device(r->world, r->rank));
        for (int i = 0; i < 6 && ce == cudaSuccess; i++) ce = cudaMalloc(&dev[i], r->bytes[i]);
        for (int i = 0; i < 5 && ce == cudaSuccess; i++)
            ce = cudaMemcpy(dev[i], r->buf[i], r->bytes[i], cudaMemcpyHostToDevice);
        if (ce == cudaSuccess) ce = cudaStreamCreate(&stream);
        a = make_args(dev, EXPERTS / r->cfg->ep);
        a.stream = stream;
    }
#endif
    comet_layer_t *layer = NULL;
    comet_status_t st = comet_layer_create(&layer, r->world, r->rank, r->cfg);
    if (st == COMET_SUCCESS) st = comet_layer_forward(layer, &a);
    if (st == COMET_SUCCESS) st = comet_layer_sync(layer); /* CUDA: wait for the forward; CPU: done already */
    /* The last error is per thread: keep it before the next call replaces it. */
    if (st != COMET_SUCCESS) snprintf(r->error, sizeof r->error, "%s", comet_last_error());
    const comet_status_t st2 = comet_layer_destroy(layer); /* NULL (create failed everywhere): no-op */
    if (st == COMET_SUCCESS && (st = st2) != COMET_SUCCESS)
        snprintf(r->error, sizeof r->error, "%s", comet_last_error());
#ifdef WITH_CUDA
    if (cuda && ce == cudaSuccess && st == COMET_SUCCESS)
        ce = cudaMemcpy(r->buf[5], dev[5], r->bytes[5], cudaMemcpyDeviceToHost);
    if (ce != cudaSuccess && st == COMET_SUCCESS)
        st = COMET_ERR_CUDA, snprintf(r->error, sizeof r->error, "CUDA: %s", cudaGetErrorString(ce));
    for (int i = 0; i < 6; i++) cudaFree(dev[i]);
    if (stream) cudaStreamDestroy(stream);
#endif
    r->status = st;
    return NULL;
}

int main(int argc, char **argv) {
    int ranks = 2, use_cuda = 0, force_cpu = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--cpu")) force_cpu = 1;
        else if (!strcmp(argv[i], "--cuda")) use_cuda = 1;
        else if ((ranks = atoi(argv[i])) < 1 || ranks > MAX_RANKS || EXPERTS % ranks) {
            fprintf(stderr, "usage: %s [--cpu | --cuda] [ranks: 1, 2, 4 or 8]\n", argv[0]);
            return 2;
        }
    }
#ifdef WITH_CUDA
    use_cuda = use_cuda || (!force_cpu && comet_device_count() >= ranks);
#else
    (void)force_cpu; /* the CPU backend is all this build can run */
    if (use_cuda) {
        fprintf(stderr, "%s: built without -DWITH_CUDA, so it has no GPU buffers for --cuda\n", argv[0]);
        return 2;
    }
#endif
    const int v = comet_version(); /* of the library loaded; COMET_VERSION_CODE: of the header */
    printf("comet %d.%d.%d, ranks %d, %s backend\n", v / 10000, v / 100 % 100, v % 100, ranks, use_cuda ? "CUDA" : "CPU");
    fflush(stdout); /* before any error on stderr */

    /* The layer. Fields not set here keep their COMET_LAYER_CONFIG_INIT
     * defaults: SiLU-gated experts, bf16, TP = 1, the backend's tile height. */
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = HIDDEN, cfg.ffn = FFN, cfg.num_experts = EXPERTS, cfg.topk = TOPK;
    cfg.ep = ranks, cfg.max_tokens_per_rank = TOKENS;
    if (comet_layer_config_check(&cfg, ranks) != COMET_SUCCESS) {
        fprintf(stderr, "comet_layer_config_check: %s\n", comet_last_error());
        return 1;
    }

    rank_t r[MAX_RANKS] = {{0}};
    int failed = 0;
    for (int s = 0; s < ranks && !failed; s++) {
        r[s].rank = s, r[s].cfg = &cfg;
        if (!make_inputs(&r[s])) failed = 1, fprintf(stderr, "out of memory\n");
    }

    /* The world, then one thread per rank. */
    comet_world_t *world = NULL;
    const comet_backend_t backend = use_cuda ? COMET_BACKEND_CUDA : COMET_BACKEND_CPU;
    if (!failed && comet_world_create_local(&world, ranks, backend) != COMET_SUCCESS) {
        fprintf(stderr, "comet_world_create_local: %s\n", comet_last_error());
        failed = 1;
    }
    pthread_t thread[MAX_RANKS];
    int started = 0;
    while (!failed && started < ranks) {
        r[started].world = world;
        if (pthread_create(&thread[started], NULL, rank_main, &r[started])) break;
        started++;
    }
    if (!failed && started < ranks) /* the started ranks wait for it, then time out */
        failed = 1, fprintf(stderr, "pthread_create failed for rank %d\n", started);
    for (int s = 0; s < started; s++) {
        pthread_join(thread[s], NULL);
        if (r[s].status != COMET_SUCCESS)
            failed = 1, fprintf(stderr, "rank %d: %s: %s\n", s, comet_status_string(r[s].status), r[s].error);
    }
    if (comet_world_destroy(world) != COMET_SUCCESS) { /* NULL: no-op */
        fprintf(stderr, "comet_world_destroy: %s\n", comet_last_error());
        failed = 1;
    }

    /* The reference (plain loops over every rank at once), then the comparison. */
    comet_forward_args_t ref[MAX_RANKS];
    for (int s = 0; s < ranks; s++) ref[s] = r[s].ref;
    if (!failed && comet_reference_forward(&cfg, ranks, ref) != COMET_SUCCESS) {
        fprintf(stderr, "comet_reference_forward: %s\n", comet_last_error());
        failed = 1;
    }
    if (!failed) {
        long differ = 0, nan = 0;
        float worst = 0, scale = 0; /* largest |y - y_ref|, largest |y_ref| */
        for (int s = 0; s < ranks; s++)
            for (int i = 0; i < TOKENS * HIDDEN; i++) {
                const uint16_t y = ((uint16_t *)r[s].buf[5])[i], y_ref = ((uint16_t *)r[s].buf[6])[i];
                const float d = absf(bf16_to_float(y) - bf16_to_float(y_ref)), b = absf(bf16_to_float(y_ref));
                differ += y != y_ref, nan += d != d;
                worst = d > worst ? d : worst, scale = b > scale ? b : scale;
            }
        const float rel = scale > 0 ? worst / scale : worst;
        failed = use_cuda ? nan || rel > 2e-2f : differ != 0;
        printf("y: %ld of %d elements differ from the reference (worst %.1e relative): %s\n", differ,
               ranks * TOKENS * HIDDEN, rel, failed ? "FAILED" : use_cuda ? "ok" : "ok, bitwise equal");
    }
    for (int s = 0; s < ranks; s++)
        for (int i = 0; i < 7; i++) free(r[s].buf[i]);
    return failed;
}
