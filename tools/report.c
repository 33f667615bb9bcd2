/*
 * tools/report.c - what the CLI says about a run (tools/cli.h), from its
 * cli_result_t alone: the warnings ("comet: warning: ...", stderr) of flags
 * a run ignores or clamps; the backend line before it runs; after, the
 * warnings of the protocol the layer reported, the result row with the
 * check, the notes under it (protocol, memory, inputs, the GPUs' clocks,
 * graph replays, communication hidden) and, with --json, one JSON row
 * appended to the file (bench/report.py reads it).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cli.h"

static const char *const combine_names[] = {"partials", "push", "pull"};
static const char *const gemm_names[] = {"cpu", "hopper", "simt"};
static const char *const chosen_names[] = {"args", "table", "rule"};

void cli_warn(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "comet: warning: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

/* Flags the protocol the layer ran did not follow: --n-comm clamped (the
 * CUDA backend runs at most SMs - 1 communication CTAs) or not run (the
 * sequential chain of the SIMT GEMM), --chunk where nothing chunks (the
 * CUDA backend) or at another width. */
static void warn_ignored(const cli_result_t *r) {
    const cli_options_t *o = &r->opt;
    const comet_protocol_t *p = &r->protocol;
    if (!p->struct_size) return;
    if (o->n_comm > 0 && p->mode == COMET_MODE_SEQUENTIAL)
        cli_warn("--n-comm %d: the layer ran the sequential chain%s", o->n_comm,
                 p->gemm == COMET_GEMM_SIMT ? " (the SIMT GEMM, which runs here, has no overlapped mode)" : "");
    else if (o->n_comm > 0 && p->n_comm != o->n_comm)
        cli_warn("--n-comm %d: the layer ran %d communication %s", o->n_comm, p->n_comm,
                 r->use_cuda ? "CTAs (the CUDA backend runs at most the GPU's SMs - 1)" : "workers");
    if (o->chunk_cols > 0 && p->chunk_cols == 0)
        cli_warn("--chunk %d ignored: nothing chunks on the %s (no chunked combine)", o->chunk_cols,
                 r->use_cuda ? "CUDA backend" : "layer");
    else if (o->chunk_cols > 0 && p->chunk_cols != o->chunk_cols)
        cli_warn("--chunk %d: the layer ran chunks of %d columns", o->chunk_cols, p->chunk_cols);
}

void cli_report_setup(const cli_result_t *r) {
    const cli_options_t *o = &r->opt;
    const cli_launch_t *l = &o->launch;
    if (!cli_speaks(l)) return;
    if (l->on)
        printf("backend: CUDA, %d ranks (one process per GPU: this is rank 0, %s:%d)\n", r->world, l->addr, l->port);
    else if (r->use_cuda)
        printf("backend: CUDA, %d rank%s (one thread per GPU)\n", r->world, r->world > 1 ? "s" : "");
    else
        printf("backend: CPU engine (%d ranks as threads of one process; %s)\n", r->world,
               r->gpus ? "--backend cpu" : "no GPU found");
    if (!o->hidden && !o->ffn && r->scale != 1)
        printf("model: %s scaled down 1/%d in hidden and ffn (hidden %lld, ffn %lld) so the CPU run takes seconds\n",
               o->model, r->scale, (long long)r->cfg.hidden, (long long)r->cfg.ffn);
}

/* One value a GPU (gpu_watch_t's arrays), each as fmt, sep between them. */
static void print_per_gpu(FILE *f, const double *v, int n, const char *sep, const char *fmt) {
    for (int i = 0; i < n; i++) {
        if (i) fputs(sep, f);
        fprintf(f, fmt, v[i]);
    }
}

/* The n_comm cell: what the layer ran, "<n>" or "seq" (the sequential
 * chain, CUDA), as "auto:<n> (table)" / "auto:seq (rule)" where the tuner
 * chose it (its table or its rule) rather than --n-comm. */
static void n_comm_cell(const cli_result_t *r, char *buf, size_t size) {
    const comet_protocol_t *p = &r->protocol;
    if (!p->struct_size) { /* no forward reported one */
        snprintf(buf, size, "%s", r->opt.n_comm == 0 ? "auto" : "-");
        return;
    }
    char ran[16];
    if (p->mode == COMET_MODE_SEQUENTIAL)
        snprintf(ran, sizeof ran, "seq");
    else
        snprintf(ran, sizeof ran, "%d", p->n_comm);
    if (p->chosen_by == COMET_CHOSEN_BY_ARGS)
        snprintf(buf, size, "%s", ran);
    else
        snprintf(buf, size, "auto:%s (%s)", ran, chosen_names[p->chosen_by]);
}

/* The result row under its header: the model's label (a preset, or a
 * custom model: the preset and the sizes that moved off it), n_comm as
 * n_comm_cell, chunk the layer-1 column-chunk width the layer ran ("-"
 * where nothing chunks: CUDA). */
static void print_row(const cli_result_t *r) {
    const comet_layer_config_t *cfg = &r->cfg;
    const int width = (int)strlen(r->model_label) > 14 ? (int)strlen(r->model_label) : 14;
    printf("\n%-*s %7s %3s %3s %4s %4s %6s %6s %16s %6s %10s %11s %9s  %s\n", width, "model", "M", "TP", "EP", "topk", "E",
           "hidden", "ffn", "n_comm", "chunk", "ms", r->use_cuda ? "TFLOP/s/GPU" : "GFLOP/s", "GB/s/GPU",
           "check vs reference");
    char ncomm[40], chunk[16] = "-";
    n_comm_cell(r, ncomm, sizeof ncomm);
    if (r->protocol.chunk_cols > 0) snprintf(chunk, sizeof chunk, "%d", r->protocol.chunk_cols);
    printf("%-*s %7lld %3d %3d %4lld %4lld %6lld %6lld %16s %6s %10.3f %11.2f %9.2f  %s (%lld of %lld %s)\n", width,
           r->model_label,
           (long long)r->total_tokens, cfg->tp, cfg->ep, (long long)cfg->topk, (long long)cfg->num_experts,
           (long long)cfg->hidden, (long long)cfg->ffn, ncomm, chunk, r->ms, r->rate, r->link_gbps,
           r->wrong ? "WRONG" : "ok", (long long)r->wrong, (long long)r->check.elements,
           r->use_cuda ? "sampled elements off" : "elements differ");
}

static void print_clocks(const gpu_watch_t *watch);
static void print_hidden(const cli_result_t *r);

/* --train's row: forward, backward and step ms, the step's rate, the
 * forward's y check and the gradients' check. */
static void print_train_row(const cli_result_t *r) {
    const comet_layer_config_t *cfg = &r->cfg;
    const int width = (int)strlen(r->model_label) > 14 ? (int)strlen(r->model_label) : 14;
    printf("\n%-*s %7s %3s %3s %4s %4s %6s %6s %16s %10s %10s %10s %11s  %s\n", width, "model", "M", "TP", "EP", "topk",
           "E", "hidden", "ffn", "n_comm", "fwd ms", "bwd ms", "step ms", r->use_cuda ? "TFLOP/s/GPU" : "GFLOP/s",
           "check vs reference: y, gradients");
    char ncomm[40];
    n_comm_cell(r, ncomm, sizeof ncomm);
    printf("%-*s %7lld %3d %3d %4lld %4lld %6lld %6lld %16s %10.3f %10.3f %10.3f %11.2f  %s (%lld of %lld), %s (%lld of "
           "%lld %s)\n",
           width, r->model_label, (long long)r->total_tokens, cfg->tp, cfg->ep, (long long)cfg->topk,
           (long long)cfg->num_experts, (long long)cfg->hidden, (long long)cfg->ffn, ncomm, r->fwd_ms, r->bwd_ms, r->ms,
           r->rate, r->wrong ? "WRONG" : "ok", (long long)r->wrong, (long long)r->check.elements,
           r->grad_wrong ? "WRONG" : "ok", (long long)r->grad_wrong, (long long)r->grad_checked,
           r->use_cuda ? "sampled elements off" : "elements differ");
}

/* --train's notes: what a step is, how the gradients were checked. */
static void print_train_notes(const cli_result_t *r) {
    const cli_options_t *o = &r->opt;
    const struct comet_train_check *g = &r->grad;
    static const char *const names[4] = {"dx", "d_topk_w", "dw1", "dw2"};
    printf("(training step: the forward %s, then the backward%s: dy random bf16; dx bf16, d_topk_w fp32, dw1 and dw2 "
           "bf16 written; TFLOP/s: 3x the forward's FLOPs over the step)\n",
           o->recompute ? "saving nothing (--recompute)" : "saving its activations",
           o->recompute ? " recomputing GEMM0" : " reading them");
    printf("(gradients checked before the timed steps, one step on %s: %s)\n",
           r->use_cuda ? "8 sampled tokens of every rank" : "every token",
           r->use_cuda ? "an element is off when NaN or |got - ref| > 8 bf16 ulps of |ref| + 2% of the rms of "
                         "ref's row (d_topk_w: of all its values) + for dw1 the error model's slack for "
                         "cancelling sums (harness/gradslack.h)"
                       : "every element bitwise equal");
    if (!o->launch.on) {
        printf("(gradients, largest difference from the reference / rms, elements not bitwise equal:");
        for (int k = 0; k < 4; k++)
            printf("%s %s %.2e, %lld of %lld", k ? ";" : "", names[k], g->worst[k], (long long)g->differ[k],
                   (long long)g->elements[k]);
        printf(")\n");
    }
    for (int k = 0; k < 2; k++) {
        const comet_protocol_t *proto = k ? &r->protocol : &r->fwd_protocol;
        if (proto->struct_size)
            printf("protocol of the last %s: %s, n_comm %d, %s GEMM, chosen by %s\n", k ? "backward" : "training forward",
                   proto->mode == COMET_MODE_OVERLAPPED ? "overlapped" : "sequential", proto->n_comm,
                   gemm_names[proto->gemm], chosen_names[proto->chosen_by]);
    }
    printf("memory per rank: %.1f MiB symmetric, %.1f MiB private (%s; the saved state, weights and gradients "
           "besides)\n",
           r->memory.symmetric_bytes / 1048576.0, r->memory.private_bytes / 1048576.0, r->use_cuda ? "device" : "host");
    printf("saved state per layer and micro-batch: %.1f MiB (%s; sized for the worst case of rows: every token of "
           "every rank routed to this one)\n",
           r->saved_bytes / 1048576.0, o->recompute ? "recompute: nothing" : "gu and h of every row");
    if (o->command == CLI_BENCH)
        printf("(ms: medians of %d steps of the slowest rank, after %d warm-up steps; step = forward + backward of "
               "each call)\n",
               o->iters, o->warmup);
    if (r->use_cuda) {
        printf("inputs: %d sets of x, routing, y, dy and dx a rank, rotated step by step%s\n", r->input_sets,
               o->back_to_back ? "; the timed steps enqueued back to back (--back-to-back)" : "");
        if (o->back_to_back) /* at or above the step's time, the GPUs wait for the host */
            printf("host: %.3f ms to enqueue a step (its forward and backward calls; the mean, slowest rank)\n",
                   r->host_ms);
        print_clocks(&r->watch);
    }
    print_hidden(r);
}

/* The GPUs' clocks over the timed forwards: one value for every GPU of this
 * node NVML sees. */
static void print_clocks(const gpu_watch_t *watch) {
    if (!watch->n) {
        printf("GPU clocks: not read (NVML not available)\n");
        return;
    }
    unsigned long long why = 0;
    for (int i = 0; i < watch->n; i++) why |= watch->reasons[i];
    printf("GPU clocks over the timed forwards (NVML, every GPU of this node): SM");
    print_per_gpu(stdout, watch->mhz, watch->n, " /", " %.0f");
    if (!gpu_watch_has_power(watch)) {
        printf(" MHz, power not measured (the timed forwards took under %.0f s)", GPU_WATCH_MIN_SPAN);
    } else {
        printf(" MHz, power");
        print_per_gpu(stdout, watch->watts, watch->n, " /", " %.0f");
        printf(" W");
    }
    char text[96];
    printf(", clock limited by %s\n", gpu_power_reasons(why, text, sizeof text));
}

/* --comm-hidden's line (with --train: the backward's sides, the forward run whole). */
static void print_hidden(const cli_result_t *r) {
    const cli_options_t *o = &r->opt;
    const double *side = r->side_ms;
    const char *what = o->train ? "communication hidden in the backward" : "communication hidden";
    if (o->hidden_metric && !r->sides_differ) {
        printf("%s: not measured (the SIMT GEMM fallback runs every call whole)\n", what);
    } else if (o->hidden_metric) {
        char net[64] = "not measurable (comm only <= neither)";
        if (r->comm_hidden_net != -1) snprintf(net, sizeof net, "%.1f%%", 100 * r->comm_hidden_net);
        printf("%s: %.1f%%, %s net of the steps every side keeps (gemm only %.3f ms, comm only "
               "%.3f ms, neither %.3f ms, both %.3f ms; medians of %d %s each, the four interleaved)\n",
               what, 100 * r->comm_hidden, net, side[0], side[1], side[3], side[2], o->iters,
               o->train ? "backwards" : "calls");
    }
}

/* The notes under the row. */
static void print_notes(const cli_result_t *r) {
    const cli_options_t *o = &r->opt;
    const comet_protocol_t *proto = &r->protocol;
    const int bench = o->command == CLI_BENCH;
    if (r->use_cuda && !o->launch.on) /* how far off: the tolerance is 4 bf16 ulps + 1% of the row's rms */
        printf("(largest difference from the reference: %.2e of its row's rms; %lld sampled elements not bitwise equal)\n",
               r->check.worst, (long long)r->check.differ);
    printf("(GB/s/GPU: bytes that cross between ranks -- token rows pulled, %s -- per GPU per second)\n",
           r->use_cuda ? "once per token and rank; expert output rows sent home" : "fp32 partials stored");
    /* a table named but without this configuration (the SIMT GEMM's sequential chain reads none) */
    const char *table = getenv("COMET_TUNE_FILE");
    const int no_entry = table && *table && proto->chosen_by == COMET_CHOSEN_BY_RULE && proto->gemm != COMET_GEMM_SIMT;
    if (proto->struct_size)
        printf("protocol: %s, n_comm %d, %s combine, %s GEMM, chosen by %s%s\n",
               proto->mode == COMET_MODE_OVERLAPPED ? "overlapped" : "sequential", proto->n_comm,
               combine_names[proto->combine], gemm_names[proto->gemm], chosen_names[proto->chosen_by],
               no_entry ? " (COMET_TUNE_FILE holds no entry for this configuration)" : "");
    printf("memory per rank: %.1f MiB symmetric, %.1f MiB private (%s)\n", r->memory.symmetric_bytes / 1048576.0,
           r->memory.private_bytes / 1048576.0, r->use_cuda ? "device" : "host");
    if (bench) printf("(ms: median of %d runs of the slowest rank, after %d warm-up runs)\n", o->iters, o->warmup);
    if (r->use_cuda && bench) {
        printf("inputs: %d sets of x, routing and y a rank, rotated call by call%s\n", r->input_sets,
               r->graph ? " (--graph: the captured forward's one set)" : "");
        print_clocks(&r->watch);
    }
    if (r->use_cuda) /* src/cuda/replay.c: the forward chain captured once, then one graph launch a call */
        printf("forwards replayed as one CUDA graph on rank 0: %lld, from %lld capture%s%s\n", (long long)r->replays,
               (long long)r->captures, r->captures == 1 ? "" : "s",
               r->replays || r->captures ? ""
               : r->protocol.gemm == COMET_GEMM_SIMT ? " (the SIMT GEMM: each forward launched kernel by kernel)"
                                                     : " (graph replay off: each forward launched kernel by kernel)");
    print_hidden(r);
}

/* --json: the result as one line appended to path. Returns 0, or 1 (printed). */
static int append_json(const cli_result_t *r, const char *path) {
    const cli_options_t *o = &r->opt;
    const comet_layer_config_t *cfg = &r->cfg;
    const double *side = r->side_ms;
    FILE *f = fopen(path, "a");
    if (!f) {
        fprintf(stderr, "comet: cannot open %s for appending\n", path);
        return 1;
    }
    time_t now = time(NULL);
    char date[32];
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    const char *commit = getenv("COMET_COMMIT");
    fprintf(f,
            "{\"baseline\": \"comet-%s\", \"date\": \"%s\", \"commit\": \"%s\", \"model\": \"%s\", \"M\": %lld, "
            "\"tp\": %d, \"ep\": %d, \"topk\": %lld, \"experts\": %lld, \"hidden\": %lld, \"ffn\": %lld, "
            "\"skew\": %g, \"zero_experts\": %lld, \"ms\": %.6f, \"rate\": %.3f, \"link_gbps\": %.3f, \"wrong\": %lld, "
            "\"checked\": %lld, \"n_comm\": %d, \"tuned\": %d, \"combine\": \"%s\", \"gemm\": \"%s\", \"comm_hidden\": %.4f, "
            "\"comm_hidden_net\": %.4f, \"graph\": %d, \"replays\": %lld, \"input_sets\": %d, \"sides_ms\": [%.6f, %.6f, %.6f, %.6f], "
            "\"iters\": %d, \"warmup\": %d, \"chunk_cols\": %d, \"chosen_by\": \"%s\", \"custom\": %d",
            r->use_cuda ? "cuda" : "cpu", date, commit ? commit : "unknown", o->model, (long long)r->total_tokens, cfg->tp,
            cfg->ep, (long long)cfg->topk, (long long)cfg->num_experts, (long long)cfg->hidden, (long long)cfg->ffn,
            o->skew, (long long)o->zero_experts, r->ms, r->rate, r->link_gbps, (long long)r->wrong,
            (long long)r->check.elements, r->n_comm, o->n_comm == 0,
            r->protocol.struct_size ? combine_names[r->protocol.combine] : "none",
            r->protocol.struct_size ? gemm_names[r->protocol.gemm] : "none", r->comm_hidden, r->comm_hidden_net, r->graph, (long long)r->replays,
            r->input_sets, side[0], side[1], side[2], side[3], o->iters, o->warmup, r->protocol.chunk_cols,
            r->protocol.struct_size ? chosen_names[r->protocol.chosen_by] : "none", r->custom);
    if (o->train) { /* a training row: ms and rate are the step's */
        const struct comet_train_check *g = &r->grad;
        fprintf(f,
                ", \"train\": 1, \"back_to_back\": %d, \"host_ms\": %.6f, \"save\": \"%s\", \"saved_bytes\": %zu, \"fwd_n_comm\": %d, \"fwd_ms\": %.6f, "
                "\"bwd_ms\": %.6f, \"grad_wrong\": %lld, \"grad_checked\": %lld, \"grad_worst\": [%.4g, %.4g, %.4g, %.4g]",
                o->back_to_back, r->host_ms, o->recompute ? "recompute" : "activations", r->saved_bytes, r->fwd_protocol.n_comm, r->fwd_ms, r->bwd_ms,
                (long long)r->grad_wrong,
                (long long)r->grad_checked, g->worst[0], g->worst[1], g->worst[2], g->worst[3]);
    }
    if (r->watch.n) { /* the GPUs' clocks over the timed forwards, NVML's GPU order */
        fprintf(f, ", \"sm_mhz\": [");
        print_per_gpu(f, r->watch.mhz, r->watch.n, ", ", "%.0f");
        fprintf(f, "]");
        if (gpu_watch_has_power(&r->watch)) { /* not measured: no key */
            fprintf(f, ", \"watts\": [");
            print_per_gpu(f, r->watch.watts, r->watch.n, ", ", "%.1f");
            fprintf(f, "]");
        }
    }
    fprintf(f, "}\n");
    fclose(f);
    return 0;
}

int cli_report(const cli_result_t *r) {
    warn_ignored(r);
    fflush(stderr);
    if (r->opt.train) {
        print_train_row(r);
        print_train_notes(r);
    } else {
        print_row(r);
        print_notes(r);
    }
    return r->opt.json ? append_json(r, r->opt.json) : 0;
}
