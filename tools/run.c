/*
 * tools/run.c - what the CLI runs (tools/cli.h): for bench and check, the
 * problem, the world (every rank in this process, or one rank of a
 * torchrun launch), the timed forwards and --comm-hidden's sides, the trace,
 * the check against the reference and the figures, all into one
 * cli_result_t; and `comet tune`'s grid, its table and how the library
 * comes to read it. It prints only the progress lines of the slow steps
 * (and, on a terminal, of the forwards: "forward 12/25, 7 s"); report.c
 * prints the result.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "../harness/bootstrap.h"

static comet_backend_t backend_of(const cli_result_t *r) {
    return r->use_cuda ? COMET_BACKEND_CUDA : COMET_BACKEND_CPU;
}

/* Timed GPU runs rotate their inputs (the benchmarks' rules: "rotated among
 * several buffers larger than L2"): sets of x, routing and y (each rank's
 * tokens rotated, comet_run_t.input_sets), enough that one rank's sets add
 * up to at least 128 MiB, over twice an H100/H200 L2, where
 * COMET_MAX_INPUT_SETS sets allow (below ~8 MiB a set they do not); at
 * least 2, so every call hands the layer new tensors. */
static int input_sets_for(const comet_problem_t *p) {
    int64_t most = 0;
    for (int s = 0; s < p->world_size; s++) most = p->tokens[s] > most ? p->tokens[s] : most;
    const double set_bytes = (double)most * (double)(4 * p->cfg.hidden + 8 * p->cfg.topk) + 1;
    const double want = 128.0 * 1048576.0 / set_bytes + 1; /* rounded up (the cast truncates) */
    return want < 2 ? 2 : want > COMET_MAX_INPUT_SETS ? COMET_MAX_INPUT_SETS : (int)want;
}

/* Large models take a while to draw: say what is coming. */
static void say_inputs(const cli_result_t *r) {
    const comet_layer_config_t *cfg = &r->cfg;
    const double rows = cfg->activation == COMET_ACT_SILU_GATED ? 3.0 : 2.0;
    const double weights = (double)cfg->num_experts * rows * (double)cfg->hidden * (double)cfg->ffn * 2.0;
    const double gib = (2.0 * weights + 3.0 * (double)r->total_tokens * (double)cfg->hidden * 2.0) / (1024.0 * 1024 * 1024);
    if (gib >= 1.0 && cli_speaks(&r->opt.launch)) {
        printf("inputs: drawing %.1f GiB on the host (every expert's weights, then each rank's slice; tokens)\n", gib);
        fflush(stdout);
    }
}

/* The world of every rank in this process, or this process's rank of a
 * launched world: rank 0 makes the NCCL id, the channel (*bs, kept for the
 * results) carries it to the others. */
static comet_status_t create_world(const cli_result_t *r, comet_world_t **w, comet_bootstrap_t **bs) {
    const cli_launch_t *l = &r->opt.launch;
    if (!l->on) return comet_world_create_local(w, r->world, backend_of(r));
    comet_unique_id_t id;
    memset(&id, 0, sizeof id);
    comet_status_t st = comet_bootstrap_open(bs, l->rank, l->size, l->addr, l->port, 120000);
    if (st == COMET_SUCCESS && l->rank == 0) st = comet_get_unique_id(&id);
    if (st == COMET_SUCCESS) st = comet_bootstrap_bcast(*bs, id.bytes, sizeof id.bytes);
    if (st == COMET_SUCCESS) st = comet_world_create_nccl(w, l->rank, l->size, &id, l->local_rank);
    return st;
}

/* The progress line of a run that takes a while: on a terminal (stderr)
 * only, from 2 s into the run, at most once a second, rewritten in place
 * ("forward 12/25, 7 s") and cleared when the forwards end. */
typedef struct {
    int on;           /* stderr is a terminal, and this process prints */
    int shown;        /* a line is on the terminal */
    int warmup;       /* the calls before it are the warm-up */
    const char *what; /* the calls: "forward", "--comm-hidden's sides" */
    double start, last;
} progress_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void progress_note(void *ctx, int done, int calls) {
    progress_t *pg = ctx;
    const double t = now_s();
    if (!pg->on || t - pg->start < 2.0 || t - pg->last < 1.0) return;
    pg->last = t, pg->shown = 1;
    fprintf(stderr, "\r%s %d/%d%s, %.0f s\033[K", pg->what, done, calls, done < pg->warmup ? " (warm-up)" : "",
            t - pg->start);
    fflush(stderr);
}

static void progress_end(progress_t *pg) {
    if (pg->shown) fprintf(stderr, "\r\033[K");
    pg->shown = 0;
}

/* --comm-hidden: first the four sides interleaved call by call (without
 * communication, without GEMMs, without both, whole; without a graph), so
 * that clock drift reaches them alike; then the real call, timed (the GPUs'
 * clocks watched over it: bench on GPUs, the printing process) and later
 * checked. *failed names the step that failed. */
static comet_status_t time_forwards(cli_result_t *r, comet_problem_t *p, comet_world_t *w, comet_run_t *run,
                                    const char **failed) {
    const cli_options_t *o = &r->opt;
    const int bench = o->command == CLI_BENCH;
    progress_t pg = {isatty(STDERR_FILENO) && cli_speaks(&o->launch), 0, 0, "", now_s(), 0};
    run->progress = progress_note, run->progress_ctx = &pg;
    if (o->hidden_metric) {
        comet_run_t sides = *run;
        sides.trace = NULL, sides.graph = 0, sides.interleave = 1, sides.repeats = 4 * run->repeats;
        sides.train_sample = 0; /* the gradients are checked by the real run */
        *failed = o->train ? "--comm-hidden's interleaved training steps" : "--comm-hidden's interleaved forwards";
        pg.what = "--comm-hidden's sides", pg.warmup = 4 * o->warmup;
        const comet_status_t st = comet_problem_run(p, w, &sides, 4 * o->warmup);
        progress_end(&pg);
        memcpy(r->side_ms, sides.ms_side, sizeof r->side_ms);
        if (st != COMET_SUCCESS) return st;
    }
    comet_problem_poison(p);
    *failed = o->train ? "training step" : "forward";
    if (r->use_cuda && bench && cli_speaks(&o->launch)) gpu_watch_open(&r->watch); /* NVML loaded before anything is timed */
    if (r->watch.n) run->timed = gpu_watch_mark, run->timed_ctx = &r->watch;
    pg.what = o->train ? "training step" : "forward", pg.warmup = bench ? o->warmup : 0;
    if (o->train && run->train_sample && cli_speaks(&o->launch)) {
        printf("checking the gradients of %s against the CPU reference (comet_reference_backward)\n",
               run->train_sample < 0 ? "every token" : "8 sampled tokens of every rank");
        fflush(stdout);
    } else if (o->train && cli_speaks(&o->launch)) {
        printf("gradients not checked: a rank's weights pass 4 GiB (--grad-check checks them, in minutes)\n");
        fflush(stdout);
    }
    const comet_status_t st = comet_problem_run(p, w, run, bench ? o->warmup : 0);
    progress_end(&pg);
    run->progress = NULL, run->progress_ctx = NULL; /* pg ends here */
    return st;
}

/* --trace: the last forward (with --train the last step, forward and
 * backward) as Chrome-trace JSON and an SVG picture, in the two files
 * parse.c named (cli_options_t.trace_json, trace_svg). Returns 0, or 1
 * (printed). */
static int write_trace(const cli_options_t *o, const comet_trace_t *trace) {
    if (comet_trace_write_chrome_json(trace, o->trace_json) != COMET_SUCCESS ||
        comet_trace_write_svg(trace, o->trace_svg) != COMET_SUCCESS) {
        fprintf(stderr, "comet: --trace: %s\n", comet_last_error());
        return 1;
    }
    printf("trace: %lld events of the last %s (%lld dropped) -> %s, %s\n", (long long)comet_trace_event_count(trace),
           o->train ? "step (forward and backward)" : "forward", (long long)comet_trace_dropped(trace), o->trace_json,
           o->trace_svg);
    return 0;
}

/* Create the world, run the timed forwards into *r, destroy the world, write
 * the trace. Returns 0, or 1 (printed). */
static int forward(cli_result_t *r, comet_problem_t *p, comet_bootstrap_t **bs) {
    const cli_options_t *o = &r->opt;
    const int bench = o->command == CLI_BENCH;
    comet_world_t *w = NULL;
    if (create_world(r, &w, bs) != COMET_SUCCESS) {
        fprintf(stderr, "comet: %s\n", comet_last_error());
        return 1;
    }
    comet_run_t run;
    memset(&run, 0, sizeof run);
    run.n_comm = o->n_comm, run.chunk_cols = o->chunk_cols;
    run.repeats = bench ? o->warmup + o->iters : 1;
    run.graph = o->graph && r->use_cuda && !o->train;
    run.pipeline = o->back_to_back && r->use_cuda; /* the CPU engine's steps are synchronous: no difference */
    if (o->train) { /* the gradients checked on 8 sampled tokens a rank (GPUs), every token (CPU, bitwise) */
        run.train = o->recompute ? COMET_SAVE_RECOMPUTE : COMET_SAVE_ACTIVATIONS, run.train_sample = r->use_cuda ? 8 : -1;
        /* the host reference writes every expert's dW over the whole weights, on every core
         * (comet_reference_backward_parallel): Mixtral EP2 (1.4 GiB of weights a rank) ~15 s on one core,
         * 8 on two; past 4 GiB a rank (DeepSeek-V3-style, 10.5 GiB at EP2) minutes and ~100 GiB of host
         * memory, so only with --grad-check (test_backward_gpu checks the kernels on every shape class) */
        const comet_layer_config_t *c = &p->cfg;
        const double w_bytes = 2.0 * (double)c->num_experts / c->ep * (double)c->ffn / c->tp * (double)c->hidden *
                               (c->activation == COMET_ACT_GELU ? 2 : 3);
        if (r->use_cuda && !o->grad_check && w_bytes > 4.0 * (double)(1u << 30)) run.train_sample = 0;
    }
    run.input_sets = bench && r->use_cuda && !run.graph ? input_sets_for(p) : 1;
    if (o->graph && !r->use_cuda && cli_speaks(&o->launch))
        cli_warn("--graph is for GPUs; the CPU engine runs without it");
    /* Lanes (CPU engine; the CUDA backend records into its own fixed lanes): the rank's thread,
     * its comm workers, its compute workers. */
    if (o->trace &&
        comet_trace_create(&run.trace, r->world, 1 + (o->n_comm > 0 ? o->n_comm : 2) + 32, 0) != COMET_SUCCESS) {
        fprintf(stderr, "comet: --trace: %s\n", comet_last_error());
        comet_world_destroy(w);
        return 1;
    }
    const char *failed = "forward";
    const comet_status_t st = time_forwards(r, p, w, &run, &failed);
    char why[1024]; /* comet_world_destroy clears the last error */
    snprintf(why, sizeof why, "%s", comet_last_error());
    comet_world_destroy(w);
    int rc = 0;
    if (st != COMET_SUCCESS) {
        fprintf(stderr, "comet: %s failed: %s: %s\n", failed, comet_status_string(st), why);
        rc = 1;
    } else if (run.trace) {
        rc = write_trace(o, run.trace);
    }
    comet_trace_destroy(run.trace);
    r->ms = run.ms_median;
    r->protocol = run.protocol, r->memory = run.memory;
    r->graph = run.graph, r->input_sets = run.input_sets;
    r->replays = run.replays, r->captures = run.captures;
    if (o->train) {
        r->fwd_ms = run.ms_fwd, r->bwd_ms = run.ms_bwd, r->grad = run.train_check, r->saved_bytes = run.saved_bytes;
        r->host_ms = run.ms_host;
        r->fwd_protocol = run.fwd_protocol;
        for (int g = 0; g < 4; g++)
            r->grad_wrong += r->use_cuda ? r->grad.wrong[g] : r->grad.differ[g], r->grad_checked += r->grad.elements[g];
    }
    return rc;
}

/* A launched world: rank 0 gathers every rank's slowest times and check
 * counts. Returns 0, or 1 (printed). */
static int gather(cli_result_t *r, comet_bootstrap_t *bs) {
    enum { N = 3 + 4 + 5 }; /* the row's time, the check's two counts, the four sides; --train's two parts,
                             * the gradient check's two counts and the host's time a step */
    double mine[N] = {r->ms, (double)r->wrong, (double)r->check.elements, r->side_ms[0], r->side_ms[1], r->side_ms[2],
                      r->side_ms[3], r->fwd_ms, r->bwd_ms, (double)r->grad_wrong, (double)r->grad_checked, r->host_ms};
    double all[N * CLI_MAX_RANKS];
    if (comet_bootstrap_gather(bs, mine, sizeof mine, all) != COMET_SUCCESS) {
        fprintf(stderr, "comet: gathering the results: %s\n", comet_last_error());
        return 1;
    }
    if (!cli_speaks(&r->opt.launch)) return 0;
    r->wrong = 0, r->check.elements = 0;
    for (int q = 0; q < r->opt.launch.size; q++) {
        if (all[N * q] > r->ms) r->ms = all[N * q];
        r->wrong += (int64_t)all[N * q + 1], r->check.elements += (int64_t)all[N * q + 2];
        for (int k = 0; k < 4; k++)
            if (all[N * q + 3 + k] > r->side_ms[k]) r->side_ms[k] = all[N * q + 3 + k];
        if (all[N * q + 7] > r->fwd_ms) r->fwd_ms = all[N * q + 7];
        if (all[N * q + 8] > r->bwd_ms) r->bwd_ms = all[N * q + 8];
        if (q > 0) r->grad_wrong += (int64_t)all[N * q + 9], r->grad_checked += (int64_t)all[N * q + 10];
        if (all[N * q + 11] > r->host_ms) r->host_ms = all[N * q + 11];
    }
    return 0;
}

/* The CPU engine must equal the reference bitwise; a GPU within the
 * tolerance of a different GEMM accumulation order, on sampled tokens; a
 * launched world's rank 0 then holds every rank's. Returns 0, or 1 (printed). */
static int check(cli_result_t *r, const comet_problem_t *p, comet_bootstrap_t *bs) {
    const cli_launch_t *l = &r->opt.launch;
    if (r->use_cuda && cli_speaks(l)) {
        printf("checking 16 sampled tokens of every rank against the CPU reference\n");
        fflush(stdout);
    }
    if (comet_problem_check(p, r->use_cuda ? 16 : 0, l->on ? l->rank : -1, &r->check) != COMET_SUCCESS) {
        fprintf(stderr, "comet: check failed to run: %s\n", comet_last_error());
        return 1;
    }
    r->wrong = r->use_cuda ? r->check.wrong : r->check.differ;
    return l->on ? gather(r, bs) : 0;
}

/* The rates, the protocol's n_comm and the communication hidden. */
static void figures(cli_result_t *r, const comet_problem_t *p) {
    const comet_layer_config_t *cfg = &r->cfg;
    double flops = 0;
    for (int s = 0; s < r->world; s++)
        flops += 2.0 * (double)r->tokens[s] * (double)cfg->topk * (double)cfg->hidden * (double)cfg->ffn *
                 (cfg->activation == COMET_ACT_SILU_GATED ? 3 : 2);
    if (r->opt.train) flops *= 3; /* a training step: the forward's GEMMs, then twice as many in the backward */
    r->rate = r->use_cuda ? flops / r->world / (r->ms * 1e9) : flops / (r->ms * 1e6);
    /* the forward's bytes: over a training step (whose backward moves its own) not a figure, 0 */
    r->link_gbps = r->opt.train ? 0 : (double)comet_problem_link_bytes(p, backend_of(r)) / r->world / (r->ms * 1e6);
    /* CUDA: the protocol the layer ran (n_comm > 0 overlapped, 0 the sequential chain, always with
     * the SIMT GEMM) */
    r->n_comm = r->use_cuda ? r->protocol.n_comm : r->opt.n_comm;
    /* the SIMT GEMM fallback ignores args.disable: every side ran whole there */
    r->sides_differ = !(r->use_cuda && r->protocol.gemm == COMET_GEMM_SIMT);
    /* benchmarks.md's figure; and net of the steps every side keeps (staging,
     * plan, launches: t_neither), which that formula counts once too often */
    const double *side = r->side_ms, comm_net = side[1] - side[3];
    const int measured = r->opt.hidden_metric && r->sides_differ;
    r->comm_hidden = measured && side[1] > 0 ? (side[0] + side[1] - side[2]) / side[1] : -1;
    r->comm_hidden_net = measured && comm_net > 0 ? (side[0] + side[1] - side[2] - side[3]) / comm_net : -1;
}

int cli_run(cli_result_t *r) {
    const cli_options_t *o = &r->opt;
    say_inputs(r);
    const comet_routing_opts_t ro = {o->skew, o->zero_experts, o->seed};
    comet_problem_t *p;
    if (comet_problem_create(&p, &r->cfg, r->world, r->tokens, &ro) != COMET_SUCCESS) {
        fprintf(stderr, "comet: %s\n", comet_last_error());
        return 2;
    }
    comet_problem_poison(p);
    comet_bootstrap_t *bs = NULL;
    int rc = forward(r, p, &bs);
    if (rc == 0) rc = check(r, p, bs);
    comet_bootstrap_close(bs);
    if (rc == 0 && cli_speaks(&o->launch)) figures(r, p);
    comet_problem_destroy(p);
    return rc;
}

/* comet tune's chunk widths: hidden/16 .. hidden/2 in multiples of unit
 * columns, distinct. Returns how many (at most 4). */
static int tune_chunks(int64_t hidden, int unit, int chunks[4]) {
    int n = 0;
    for (int div = 16; div >= 2; div /= 2) {
        int c = (int)((hidden / div + unit - 1) / unit * unit);
        if (c < unit) c = unit;
        if (c > hidden) c = (int)hidden;
        if (n == 0 || chunks[n - 1] != c) chunks[n++] = c;
    }
    return n;
}

/* After comet tune appended to path: how the library comes to read it (it
 * reads only the file COMET_TUNE_FILE names, or
 * comet_world_options_t.tune_file), unless COMET_TUNE_FILE names it already. */
static void say_tune_file(const char *path) {
    const char *env = getenv("COMET_TUNE_FILE");
    if (env && strcmp(env, path) == 0) {
        printf("(COMET_TUNE_FILE names it: the library, and comet bench, read it)\n");
        return;
    }
    char cwd[CLI_TRACE_PATH_MAX] = "";
    if (path[0] != '/' && !getcwd(cwd, sizeof cwd)) cwd[0] = 0;
    char full[2 * CLI_TRACE_PATH_MAX];
    snprintf(full, sizeof full, "%s%s%s", cwd, cwd[0] ? "/" : "", path);
    const int plain = strspn(full, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._+-=:,@%") ==
                      strlen(full); /* else quoted for the shell */
    printf("to use it: export COMET_TUNE_FILE=%s%s%s%s\n", plain ? "" : "'", full, plain ? "" : "'",
           env && *env ? " (it names another file now)" : "");
}

int cli_tune(const cli_result_t *r) {
    const int iters = r->opt.iters, warmup = r->opt.warmup, use_cuda = r->use_cuda;
    const comet_routing_opts_t ro = {r->opt.skew, r->opt.zero_experts, r->opt.seed};
    comet_problem_t *p;
    comet_world_t *w = NULL;
    if (comet_problem_create(&p, &r->cfg, r->world, r->tokens, &ro) != COMET_SUCCESS ||
        comet_world_create_local(&w, r->world, backend_of(r)) != COMET_SUCCESS) {
        fprintf(stderr, "comet: %s\n", comet_last_error());
        comet_problem_destroy(p);
        return 2;
    }
    /* communication workers: threads on the CPU engine, CTAs (SMs) on a GPU;
     * chunk widths in multiples of 8 columns (CPU) or of GEMM1's 256-column
     * tile (GPU) */
    const int cpu_comms[] = {1, 2, 3, 4, 6, 8}, gpu_comms[] = {4, 8, 12, 16, 24, 32};
    const int *n_comms = use_cuda ? gpu_comms : cpu_comms;
    int chunks[4], n_chunks = tune_chunks(r->cfg.hidden, use_cuda ? 256 : 8, chunks);
    /* on a GPU the sequential chain first: the table records it as n_comm 0 when it wins; the
     * layer's modes then say what the grid can change: with push the overlapped combine runs after
     * GEMM1, so the chunk width does nothing (one column); the SIMT GEMM has no overlapped mode */
    const int rows = (int)(sizeof cpu_comms / sizeof cpu_comms[0]) + (use_cuda ? 1 : 0);
    int best_n_comm = 0, best_chunk = 0;
    double best_ms = -1, best_ov_ms = -1;
    int best_ov_chunk = chunks[0]; /* recorded with a sequential win: what n_comm > 0 calls then use */
    for (int i = 0; i < rows; i++) {
        const int seq = use_cuda && i == 0, n_comm = seq ? COMET_SEQUENTIAL : n_comms[i - (use_cuda ? 1 : 0)];
        comet_run_t run;
        if (i == (use_cuda ? 1 : 0)) { /* the grid's header, once the sequential run (GPU) said the modes */
            printf("\nms (median of %d) by communication workers (rows) and layer-1 chunk width (columns%s)\n%8s", iters,
                   use_cuda ? "; on GPUs, with no chunked combine, it does nothing: one" : "", "n_comm");
            for (int c = 0; c < n_chunks; c++) printf(" %9d", chunks[c]);
            printf("\n");
        }
        if (!seq) printf("%8d", n_comm);
        for (int c = 0; c < (seq ? 1 : n_chunks); c++) {
            memset(&run, 0, sizeof run);
            run.n_comm = n_comm, run.chunk_cols = chunks[c], run.repeats = warmup + iters;
            run.input_sets = use_cuda ? input_sets_for(p) : 1;
            comet_status_t st = comet_problem_run(p, w, &run, warmup);
            if (st != COMET_SUCCESS) {
                fprintf(stderr, "\ncomet tune: %s: %s\n", comet_status_string(st), comet_last_error());
                comet_world_destroy(w);
                comet_problem_destroy(p);
                return 1;
            }
            if (seq)
                printf("\nthe sequential chain: %.3f ms%s\n", run.ms_median,
                       run.protocol.gemm == COMET_GEMM_SIMT ? " (SIMT GEMM: no overlapped mode)" : "");
            else
                printf(" %9.3f", run.ms_median);
            if (best_ms < 0 || run.ms_median < best_ms)
                best_n_comm = seq ? 0 : n_comm, best_chunk = chunks[c], best_ms = run.ms_median;
            if (!seq && (best_ov_ms < 0 || run.ms_median < best_ov_ms)) best_ov_ms = run.ms_median, best_ov_chunk = chunks[c];
        }
        if (seq && run.protocol.gemm == COMET_GEMM_SIMT) break; /* every n_comm would run the same sequential chain */
        if (use_cuda) n_chunks = 1; /* no chunked combine on GPUs: the width does nothing */
        if (!seq) printf("\n");
        fflush(stdout);
    }
    if (best_n_comm == 0) best_chunk = best_ov_chunk;
    const char *out = r->opt.out; /* cli_parse: --out, else $COMET_TUNE_FILE, else comet-tune.tsv */
    comet_world_destroy(w);
    const int rc = comet_tune_append(out, &r->cfg, r->world, backend_of(r), best_n_comm, best_chunk, best_ms);
    printf("best: n_comm %d%s, chunk %d: %.3f ms; %s %s\n", best_n_comm, use_cuda && best_n_comm == 0 ? " (sequential)" : "",
           best_chunk, best_ms, rc == 0 ? "appended to" : "could not append to", out);
    if (rc == 0) say_tune_file(out);
    comet_problem_destroy(p);
    return rc == 0 ? 0 : 1;
}
