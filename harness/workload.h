/*
 * harness/workload.h - test and benchmark harness, not part of the library
 * (built into libcomet_harness.a, never into libcomet.a or libcomet.so).
 * What the CLI, the tests and the benchmarks run: model presets, routing
 * generators (uniform, skewed, with empty experts), random inputs, a whole
 * multi-rank problem with every rank's inputs and outputs, and the writer of
 * the tuner's table for `comet tune`. Not part of the library API: it is the
 * shared harness around it.
 */
#ifndef COMET_WORKLOAD_H
#define COMET_WORKLOAD_H

#include <stdint.h>

#include "comet.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- models ---------------------------------------------------------------- */
typedef struct {
    const char *name;
    int64_t hidden, ffn, num_experts, topk;
} comet_model_t;

extern const comet_model_t comet_models[];
extern const int comet_num_models;
/* Preset by name, or NULL. */
const comet_model_t *comet_model_find(const char *name);

/* ---- random numbers (splitmix64: small, seedable, same on every machine) --- */
typedef struct {
    uint64_t state;
} comet_rng_t;
uint64_t comet_rng_next(comet_rng_t *r);
double comet_rng_uniform(comet_rng_t *r);  /* [0, 1) */
double comet_rng_normal(comet_rng_t *r);

/* ---- routing ---------------------------------------------------------------- */
typedef struct {
    double skew;          /* relative std of expert popularity; 0 = uniform */
    int64_t zero_experts; /* this many experts (chosen at random) get no tokens */
    uint64_t seed;
} comet_routing_opts_t;

/* Routing of world_size ranks (tokens[s] tokens each) into topk_idx[s] and
 * topk_w[s] ((tokens[s], topk) each): expert popularity 1 + skew * N(0,1)
 * (floored at 0.01; zero_experts random experts at 0), each token drawing
 * topk distinct experts in proportion, weights a softmax of random logits.
 * The problems below use it; so does bench/gemm_bench.cu. */
comet_status_t comet_routing_draw(int64_t num_experts, int64_t topk, int world_size, const int64_t *tokens,
                                  int32_t *const *topk_idx, float *const *topk_w, const comet_routing_opts_t *ro,
                                  comet_rng_t *rng);

/* ---- a multi-rank problem ----------------------------------------------------
 * Global weights W1 (E, w1_rows_full, H), W2 (E, H, F) are drawn once; each
 * rank gets its experts' TP slices, laid out as include/comet.h documents. */
typedef struct {
    comet_layer_config_t cfg;
    int world_size;
    int64_t *tokens;          /* [W] T of each rank */
    uint16_t *w1_full;        /* (E, 2F or F, H) bf16 */
    uint16_t *w2_full;        /* (E, H, F) bf16 */
    uint16_t **x, **w1, **w2; /* [W] per-rank inputs */
    int32_t **topk_idx;
    float **topk_w;
    uint16_t **y, **y_ref;    /* [W] outputs of the backend under test, of the reference */
    comet_forward_args_t *args;     /* [W] inputs + y */
    comet_forward_args_t *ref_args; /* [W] inputs + y_ref */
} comet_problem_t;

/* tokens: [W] tokens per rank (each <= cfg->max_tokens_per_rank). */
comet_status_t comet_problem_create(comet_problem_t **p, const comet_layer_config_t *cfg, int world_size,
                                    const int64_t *tokens, const comet_routing_opts_t *routing);
void comet_problem_destroy(comet_problem_t *p);
/* Cut every rank's w1/w2 out of w1_full/w2_full again (after a test edits them). */
void comet_problem_slice_weights(comet_problem_t *p);
/* Fill y and y_ref with a NaN pattern, so unwritten outputs are caught. */
void comet_problem_poison(comet_problem_t *p);
/* Draw fresh x and routing for every rank (weights stay). */
comet_status_t comet_problem_redraw(comet_problem_t *p, const comet_routing_opts_t *routing);
/* Elements of y that still hold the poison (never written), over every rank. */
int64_t comet_problem_count_poison(const comet_problem_t *p);
/* Elements of y that differ bitwise from y_ref, over every rank. */
int64_t comet_problem_count_mismatch(const comet_problem_t *p);

/* y checked against the reference on up to sample tokens per rank (evenly
 * spaced, first and last included; sample <= 0: every token) of every rank,
 * or of only_rank when it is >= 0 (a process of a spread world), evaluated one
 * token at a time (no y_ref needed). An element is wrong when it is NaN or
 * |y - ref| > 4 bf16 ulps of |ref| + 1% of the rms of ref's row: what a
 * different fp32 accumulation order in the GEMMs can move. */
typedef struct {
    int64_t elements;  /* checked */
    int64_t differ;    /* not bitwise equal */
    int64_t wrong;     /* over the tolerance */
    double worst;      /* largest |y - ref| / (rms of ref's row) */
} comet_check_t;
comet_status_t comet_problem_check(const comet_problem_t *p, int64_t sample, int only_rank, comet_check_t *out);

/* fn(arg, part, parts) for part 0..parts-1 on as many threads: the online
 * cores (at most 64) where work (~operations) is worth it, else one. Each
 * part's result must not depend on the part count. */
void comet_parts_run(void (*fn)(void *arg, int part, int parts), void *arg, int64_t work);

/* comet_reference_backward's result (bitwise: the same status and outputs),
 * its tokens and experts spread over `threads` threads (at most 64; 0: the
 * online cores where the work is worth it, as many as 8 GiB of per-thread
 * fp32 weight-gradient sums allow). */
comet_status_t comet_reference_backward_parallel(const comet_layer_config_t *cfg, int world_size,
                                                 const comet_backward_args_t *args, int threads);

/* Bytes that cross between ranks in one forward, summed over every ordered
 * pair of ranks (docs: benchmarks "comm GB/s"). CPU engine: each token row a
 * rank pulls for one of its expert slots from another rank (H bf16) and each
 * fp32 partial (H) it stores into another token's home rank. CUDA backend:
 * each token row a rank pulls once for all its slots there (H bf16), and each
 * expert output row (H bf16) that goes to the token's home rank from another
 * (pushed by GEMM1, or pulled with COMET_PUSH=0). */
int64_t comet_problem_link_bytes(const comet_problem_t *p, comet_backend_t backend);

/* ---- running every rank -------------------------------------------------- */
#define COMET_MAX_INPUT_SETS 16
typedef struct {
    int n_comm, chunk_cols; /* when not 0, override every rank's args */
    int n_comm_of_rank[64]; /* when not 0, override that rank's n_comm (tests of disagreeing ranks) */
    int repeats;            /* forward calls per rank (>= 1) */
    int disable;            /* when not 0, COMET_DISABLE_* bits for every rank's args (after one
                             * untimed whole forward, so both sides work on real data) */
    comet_trace_t *trace;   /* when not NULL, attached to every rank's layer for the last call */
    int compare_repeats;    /* when not 0: y poisoned before every call and compared bitwise with
                             * the first call's output after it (not for timing) */
    int repeats_differ[64]; /* out, per rank: calls whose y differed from the first call's */
    int graph;              /* CUDA: capture one forward in a CUDA graph and replay it for every call
                             * (every rank in this process; the ranks agree the capture worked) */
    int input_sets;         /* CUDA, without graph: call i reads x, topk_idx, topk_w and writes y of
                             * set i % input_sets (<= COMET_MAX_INPUT_SETS; 0 or 1: one set), each its
                             * own device buffers holding the rank's tokens rotated by the set's index
                             * (y put back in token order), so every call passes the layer new tensors
                             * and, with enough sets, finds its inputs out of cache */
    int pipeline;           /* CUDA, without graph: every call enqueued before one comet_layer_sync
                             * after the last, each on its own input set (repeats <= COMET_MAX_INPUT_SETS;
                             * input_sets ignored), so calls with different tensors are in flight
                             * together; compare_repeats then compares each set's y after that sync;
                             * ms_median is the whole run's time over repeats. With train: the timed
                             * steps (after the warm-up's, each synced) enqueued back to back, as a
                             * training loop's host runs ahead, one sync after the last; input_sets as
                             * without it; a step's time from events at its start, between its forward
                             * and backward and at the next step's start (the GPU's time a step, the
                             * host's work hidden where it keeps ahead) */
    comet_status_t status[64];   /* per rank, last call (ranks >= 64 not kept) */
    char message[64][256];
    int interleave;         /* when not 0 (disable and graph 0): after one untimed whole forward,
                             * call i leaves out, by i % 4: communication (COMET_DISABLE_COMM), the
                             * GEMMs (COMET_DISABLE_GEMM), both, nothing, so clock drift reaches the
                             * four alike; repeats a multiple of 4 ends on a whole call, whose y is kept
                             * (with train: the backward's sides, the forward always whole) */
    double ms_side[4];      /* out, with interleave: each side's median over its timed calls, slowest
                             * rank of this process: [0] GEMMs only, [1] communication only, [2] whole,
                             * [3] neither (the steps every side keeps: staging, plan, launches, flags) */
    void (*timed)(void *ctx, int end); /* when not NULL: called by the first rank this process runs (its
                             * thread), end 0 just before its first timed call (after the warm-up, the
                             * uploads and any capture; pipelined calls: when that call is enqueued, the
                             * warm-up calls perhaps still running) and end 1 after its last, whatever its
                             * status, if it made the first; the other ranks run within a call of it (a
                             * forward waits on its peers), so the begin must be quick, or the other
                             * ranks' first timed call holds it: e.g. to watch the GPUs' clocks over the
                             * timed calls */
    void *timed_ctx;
    void (*progress)(void *ctx, int done, int calls); /* when not NULL: called by the same rank as timed
                             * (its thread) before each of its calls, done the calls it has made of calls
                             * (repeats), and once more after its last (done == calls) if it made them all;
                             * quick, as timed's begin (e.g. a progress line on a terminal) */
    void *progress_ctx;
    double ms_median;       /* median over timed repeats of the slowest rank's call */
    comet_memory_t memory;  /* what rank 0's layer holds */
    comet_protocol_t protocol; /* out: the protocol rank 0's last forward ran (comet_layer_last_protocol);
                             * struct_size 0 if it ran none */
    int64_t replays;        /* out, CUDA: rank 0's forwards replayed as one graph (src/cuda/replay.c) */
    int64_t captures;       /* out, CUDA: the chains rank 0's layer captured for them (one per protocol) */
    /* training steps (comet bench --train): with train COMET_SAVE_ACTIVATIONS or COMET_SAVE_RECOMPUTE,
     * every call is one step: the training forward (args.save = train; ACTIVATIONS into a caller-owned
     * buffer of comet_layer_saved_bytes) then comet_layer_backward of it (dy random bf16, drawn once
     * per rank from the problem's seed; dx bf16, d_topk_w fp32, dw1 and dw2 bf16 written, not
     * accumulated); ms_median is the step's (forward + backward, the slowest rank's per call),
     * ms_fwd and ms_bwd the medians of its two parts. GPU: events before the forward, between and
     * after the backward, one comet_layer_sync a step; inputs, dy and dx rotated as input_sets says.
     * Not with disable, graph or compare_repeats (refused; pipeline: above); with interleave the sides are the
     * backward's (ms_side from ms_bwd; the check step runs whole). y of the last
     * call is kept, so comet_problem_check checks the training forward's y. */
    int train;
    int64_t train_sample;   /* with train: before the timed steps, one step on this many tokens of
                             * every rank (evenly spaced, first and last included; < 0: every token;
                             * 0: no check), its gradients compared with comet_reference_backward's
                             * on the same tokens into train_check */
    double ms_fwd, ms_bwd;  /* out, with train */
    double ms_host;         /* out, train with pipeline (GPUs): the host's time to enqueue one timed step (its
                             * forward and backward calls; the mean, slowest rank of this process): at or
                             * above ms_median the steps wait for the host */
    comet_protocol_t fwd_protocol; /* out, with train: the protocol of rank 0's last training forward
                             * (`protocol` is then its last backward's) */
    size_t saved_bytes;     /* out, with train: comet_layer_saved_bytes of rank 0's layer (train's save mode;
                             * sized for the worst case of rows: every token of every rank routed here) */
    struct comet_train_check {
        int64_t tokens;       /* tokens checked, over the ranks this process runs */
        int64_t elements[4];  /* checked: [0] dx, [1] d_topk_w, [2] dw1, [3] dw2 */
        int64_t differ[4];    /* not bitwise equal */
        int64_t wrong[4];     /* NaN, or |got - ref| > 8 bf16 ulps of |ref| + 2% of the rms of ref's row
                               * (d_topk_w: of all its values) + for dw1 the error model's slack
                               * (harness/gradslack.h): what another fp32 accumulation order moves
                               * (tests/test_backward_gpu.cu's rule) */
        double worst[4];      /* largest |got - ref| / rms */
        double over[4];       /* largest |got - ref| / its element's tolerance (> 1: wrong) */
        double worst_tol[4];  /* that element's tolerance */
        int64_t worst_at[4];  /* where (the largest over): the element of the rank's dx, d_topk_w, dw1, dw2 (one rank's check) */
    } train_check;
} comet_run_t;

/* Create the layer on every rank of world (one thread per rank; CUDA worlds:
 * inputs copied to each rank's GPU and y copied back; a world spread over
 * processes: only the rank this process holds), run the forward
 * run->repeats times, destroy the layers. The first `warmup` calls are left
 * out of ms_median (and ms_side). With interleave, every side needs a timed
 * call (repeats - warmup >= 4), and disable and graph must be 0. Returns the
 * first failing rank's status, else COMET_SUCCESS. */
comet_status_t comet_problem_run(comet_problem_t *p, comet_world_t *world, comet_run_t *run, int warmup);

/* ---- the tuner's table ---------------------------------------------------
 * Append what `comet tune` measured for cfg over world_size ranks to the
 * table file at path (src/tuner/tuner.h's format, which a world reads from
 * COMET_TUNE_FILE; the header written if the file is new): the fastest
 * n_comm (on CUDA 0 records the sequential chain) and chunk_cols, its ms,
 * at cfg->max_tokens_per_rank tokens a rank. Returns 0, or -1 if cfg is not
 * valid for world_size or the file cannot be written. */
int comet_tune_append(const char *path, const comet_layer_config_t *cfg, int world_size, comet_backend_t backend,
                      int n_comm, int chunk_cols, double ms);

#ifdef __cplusplus
}
#endif

#endif /* COMET_WORKLOAD_H */
