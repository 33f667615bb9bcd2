/*
 * comet.c - the command-line tool.
 *
 *   comet bench [flags]   time one MoE layer forward and check it against the reference
 *   comet check [flags]   run one configuration once and compare it with the reference
 *   comet tune [flags]    time a configuration over the run-time knobs, record the fastest
 *   comet help | --help | --version
 *
 * With GPUs (and a build with the CUDA backend) they run on every local GPU,
 * one rank each; without, on the multi-rank CPU engine (ranks are threads)
 * with the default model scaled down so that a run takes seconds. The tool
 * says which in its output. Launched by torchrun (WORLD_SIZE > 1), each
 * process is one rank on GPU LOCAL_RANK, and rank 0 prints for all.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comet.h"
#include "../harness/bootstrap.h"
#include "../harness/workload.h"
#include "../harness/gpu_watch.h"

typedef struct {
    const char *model;
    int64_t tokens; /* M over all ranks; 0 = default */
    int tp, ep;     /* 0 = default */
    int64_t topk, experts, hidden, ffn; /* 0 = from the model */
    int scale;      /* divide hidden and ffn; 0 = default for the backend */
    comet_activation_t activation;
    double skew;
    int64_t zero_experts;
    int n_comm, chunk_cols;
    uint64_t seed;
    int iters, warmup;
    const char *backend;
    const char *json;
    const char *trace;
    const char *out;
    int hidden_metric; /* --comm-hidden: also time the gemm-only and comm-only runs */
    int graph;         /* --graph: replay one captured forward (GPUs, one process) */
} options_t;

static const char *const flag_help =
    "  --model NAME       mixtral-8x7b (default), qwen2-moe, phi-3.5-moe, deepseek-v3\n"
    "  --tokens M         tokens over all ranks (default 8192 on GPUs, 256 on the CPU engine)\n"
    "  --tp N, --ep N     parallel layout; TP*EP ranks (default: EP over all GPUs; CPU: EP=2)\n"
    "  --topk K           experts per token (default: the model's)\n"
    "  --experts E        number of experts (default: the model's)\n"
    "  --hidden H, --ffn F  layer sizes (default: the model's, divided by --scale)\n"
    "  --scale S          divide the model's hidden and ffn by S (default 8 on CPU, 1 on GPU)\n"
    "  --activation A     silu (gated, default) or gelu\n"
    "  --skew S           relative std of expert popularity (0 = uniform, default)\n"
    "  --zero-experts N   N experts receive no tokens (default 0)\n"
    "  --n-comm N         communication workers per rank (0 = tuner, default: its table, else its\n"
    "                     rule; -1 = the sequential chain on GPUs)\n"
    "  --chunk N          layer-1 column-chunk width (0 = tuner, default)\n"
    "  --seed S           random seed for inputs and routing (default 1)\n"
    "  --backend B        auto (default), cpu, cuda\n"
    "  --json FILE        append the result as one JSON line (bench/report.py reads it)\n"
    "  --trace FILE       record every worker's steps in the last forward as\n"
    "                     Chrome-trace JSON in FILE (Perfetto, chrome://tracing) and a\n"
    "                     picture in FILE with .svg in place of .json\n";

static void usage(FILE *f) {
    fprintf(f,
            "usage: comet <command> [flags]\n\n"
            "commands:\n"
            "  bench    time one MoE layer forward on every rank and check it against the reference\n"
            "  check    run one configuration once and compare it bitwise with the reference\n"
            "  tune     time a configuration over the run-time knobs; record the fastest for the library\n"
            "  help     this text; `comet <command> --help` for a command's flags\n\n"
            "comet runs Mixture-of-Experts layers across GPUs with computation-communication\n"
            "overlap. With GPUs it runs on all of them (one rank each); without, on the CPU\n"
            "engine (ranks as threads) with a scaled-down model.\n");
}

static void command_usage(const char *cmd, FILE *f) {
    if (strcmp(cmd, "bench") == 0)
        fprintf(f, "usage: comet bench [flags]\n\nTime the forward of one MoE layer (median over --iters after --warmup)\n"
                   "and check the output against the reference: bitwise on the CPU engine; on GPUs 16\n"
                   "sampled tokens a rank, within the tolerance of a different fp32 summation order.\n\nflags:\n%s"
                   "  --iters N          timed runs (default 20 on GPUs, 5 on CPU)\n"
                   "  --warmup N         untimed runs first (default 5 on GPUs, 1 on CPU)\n"
                   "  --comm-hidden      also time the same protocol with the GEMMs left out, with the\n"
                   "                     communication left out and with both, call by call interleaved\n"
                   "                     with whole calls (no graph), and report the communication hidden\n"
                   "                     from those medians: (t_gemm_only + t_comm_only - t) / t_comm_only,\n"
                   "                     and the same with the steps every side keeps (t_neither)\n"
                   "                     subtracted from each (GPUs: the Hopper GEMM)\n"
                   "  --graph            GPUs: capture one forward in a CUDA graph and time its replays (no\n"
                   "                     launch overhead, as a graph-captured training step sees it)\n",
                flag_help);
    else if (strcmp(cmd, "tune") == 0)
        fprintf(f, "usage: comet tune [flags]\n\nTime one configuration over a grid of run-time knobs (communication\n"
                   "workers x layer-1 chunk width), print the curve, and append the fastest to a\n"
                   "table file that the library reads from COMET_TUNE_FILE.\n\nflags (not --json, --trace):\n%s"
                   "  --iters N          timed runs per point (default 3)\n"
                   "  --warmup N         untimed runs first, per point (default 1)\n"
                   "  --out FILE         table to append to (default $COMET_TUNE_FILE, else comet-tune.tsv)\n",
                flag_help);
    else
        fprintf(f, "usage: comet check [flags]\n\nRun one configuration once and compare its output with the reference:\n"
                   "bitwise on the CPU engine (exit status 0 only if every element matches); on GPUs 16\n"
                   "sampled tokens a rank, within the tolerance of a different fp32 summation order\n"
                   "(exit status 0 only if none is off).\n\nflags:\n%s",
                flag_help);
}

static int parse_int(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char *end;
    errno = 0;
    long long v = s ? strtoll(s, &end, 10) : 0;
    if (!s || end == s || errno || *end || v < lo || v > hi) { /* end == s: no digits, e.g. '' */
        fprintf(stderr, "comet: %s needs a whole number in [%lld, %lld], got '%s'\n", flag, (long long)lo,
                (long long)hi, s ? s : "");
        return -1;
    }
    *out = v;
    return 0;
}

#define TRACE_PATH_MAX ((size_t)4096) /* --trace FILE and the .svg name made from it, with the NUL */

/* Returns 0 ok, 1 help printed, -1 error. */
static int parse(const char *cmd, int argc, char **argv, options_t *o) {
    memset(o, 0, sizeof *o);
    o->model = "mixtral-8x7b";
    o->seed = 1;
    o->iters = -1, o->warmup = -1;
    o->backend = "auto";
    for (int i = 0; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int64_t n;
        if (strcmp(f, "--help") == 0 || strcmp(f, "-h") == 0) {
            command_usage(cmd, stdout);
            return 1;
        }
#define INT_FLAG(name, lo, hi, dst)                                   \
    if (strcmp(f, name) == 0) {                                       \
        if (parse_int(name, v, lo, hi, &n)) return -1;                \
        dst = n;                                                      \
        i++;                                                          \
        continue;                                                     \
    }
        INT_FLAG("--tokens", 1, 1 << 24, o->tokens)
        INT_FLAG("--tp", 1, 1024, o->tp)
        INT_FLAG("--ep", 1, 1024, o->ep)
        INT_FLAG("--topk", 1, 1 << 16, o->topk)
        INT_FLAG("--experts", 1, 1 << 16, o->experts)
        INT_FLAG("--hidden", 1, 1 << 20, o->hidden)
        INT_FLAG("--ffn", 1, 1 << 20, o->ffn)
        INT_FLAG("--scale", 1, 1024, o->scale)
        INT_FLAG("--zero-experts", 0, 1 << 16, o->zero_experts)
        INT_FLAG("--n-comm", COMET_SEQUENTIAL, 1024, o->n_comm)
        INT_FLAG("--chunk", 0, 1 << 20, o->chunk_cols)
        INT_FLAG("--seed", 0, INT64_MAX, o->seed)
        INT_FLAG("--iters", 1, 100000, o->iters)
        INT_FLAG("--warmup", 0, 100000, o->warmup)
#undef INT_FLAG
        if (strcmp(f, "--model") == 0 && v) {
            if (!comet_model_find(v)) {
                fprintf(stderr, "comet: unknown model '%s'; presets:", v);
                for (int m = 0; m < comet_num_models; m++) fprintf(stderr, " %s", comet_models[m].name);
                fprintf(stderr, "\n");
                return -1;
            }
            o->model = v, i++;
        } else if (strcmp(f, "--activation") == 0 && v && (strcmp(v, "silu") == 0 || strcmp(v, "gelu") == 0)) {
            o->activation = strcmp(v, "gelu") == 0 ? COMET_ACT_GELU : COMET_ACT_SILU_GATED, i++;
        } else if (strcmp(f, "--skew") == 0 && v) {
            char *end;
            o->skew = strtod(v, &end);
            if (end == v || *end || !(o->skew >= 0 && o->skew <= 10)) { /* '', nan, inf */
                fprintf(stderr, "comet: --skew needs a number in [0, 10], got '%s'\n", v);
                return -1;
            }
            i++;
        } else if (strcmp(f, "--comm-hidden") == 0 && strcmp(cmd, "bench") == 0) {
            o->hidden_metric = 1;
        } else if (strcmp(f, "--graph") == 0 && strcmp(cmd, "bench") == 0) {
            o->graph = 1;
        } else if (strcmp(f, "--json") == 0 && v) {
            o->json = v, i++;
        } else if (strcmp(f, "--out") == 0 && v && strcmp(cmd, "tune") == 0) {
            o->out = v, i++;
        } else if (strcmp(f, "--trace") == 0 && v) {
            if (strlen(v) + sizeof ".svg" > TRACE_PATH_MAX) { /* the picture's name beside it must fit too */
                fprintf(stderr, "comet: --trace: the path is longer than %zu characters\n",
                        TRACE_PATH_MAX - sizeof ".svg");
                return -1;
            }
            o->trace = v, i++;
        } else if (strcmp(f, "--backend") == 0 && v &&
                   (strcmp(v, "auto") == 0 || strcmp(v, "cpu") == 0 || strcmp(v, "cuda") == 0)) {
            o->backend = v, i++;
        } else {
            fprintf(stderr, "comet %s: unknown flag or bad value: '%s'%s%s\n", cmd, f, v ? " " : "", v ? v : "");
            command_usage(cmd, stderr);
            return -1;
        }
    }
    return 0;
}

/* torchrun-style launch: one process per rank, from RANK, WORLD_SIZE,
 * LOCAL_RANK (the GPU), MASTER_ADDR and MASTER_PORT. The processes exchange
 * the NCCL id (and, at the end, their results) over a TCP channel on
 * COMET_BOOTSTRAP_PORT, by default MASTER_PORT + 1 (torchrun's own store holds
 * MASTER_PORT). */
typedef struct {
    int on, rank, size, local_rank, port;
    const char *addr;
} launch_t;

static launch_t launch;

static int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) : fallback;
}

static int launch_from_env(void) {
    memset(&launch, 0, sizeof launch);
    launch.size = env_int("WORLD_SIZE", 1);
    if (launch.size <= 1) return 0;
    launch.on = 1;
    launch.rank = env_int("RANK", -1);
    launch.local_rank = env_int("LOCAL_RANK", launch.rank);
    launch.addr = getenv("MASTER_ADDR") && *getenv("MASTER_ADDR") ? getenv("MASTER_ADDR") : "127.0.0.1";
    launch.port = env_int("COMET_BOOTSTRAP_PORT", env_int("MASTER_PORT", 29500) + 1);
    if (launch.rank < 0 || launch.rank >= launch.size || launch.local_rank < 0 || launch.port < 1 || launch.port > 65535) {
        fprintf(stderr, "comet: WORLD_SIZE=%d but RANK=%d, LOCAL_RANK=%d, port %d: not a valid launch\n", launch.size,
                launch.rank, launch.local_rank, launch.port);
        return -1;
    }
    return 0;
}

/* Printing is rank 0's job in a launched world. */
static int speaks(void) { return !launch.on || launch.rank == 0; }

/* One value a GPU (gpu_watch_t's arrays), each as fmt, sep between them. */
static void print_per_gpu(FILE *f, const double *v, int n, const char *sep, const char *fmt) {
    for (int i = 0; i < n; i++) {
        if (i) fputs(sep, f);
        fprintf(f, fmt, v[i]);
    }
}

/* Fill in defaults (they depend on the backend) and build the config. */
static int configure(options_t *o, comet_layer_config_t *cfg, int64_t *tokens, int *world, int *use_cuda) {
    const int gpus = comet_device_count();
    *use_cuda = launch.on || strcmp(o->backend, "cuda") == 0 || (strcmp(o->backend, "auto") == 0 && gpus > 0);
    if (*use_cuda && gpus == 0) {
        fprintf(stderr, "comet: %s: no CUDA device found (or this build has no CUDA backend)\n",
                launch.on ? "a launched world (WORLD_SIZE > 1)" : "--backend cuda");
        return -1;
    }
    if (launch.on && (strcmp(o->backend, "cpu") == 0 || launch.local_rank >= gpus)) {
        fprintf(stderr, "comet: rank %d: a launched world runs on GPUs, LOCAL_RANK %d of %d here\n", launch.rank,
                launch.local_rank, gpus);
        return -1;
    }
    const comet_model_t *m = comet_model_find(o->model);
    int scale = o->scale ? o->scale : (*use_cuda ? 1 : 8);
    int ranks = launch.on ? launch.size : *use_cuda ? gpus : 2;
    int tp = o->tp ? o->tp : 1, ep = o->ep ? o->ep : (o->tp ? 1 : ranks);
    *cfg = (comet_layer_config_t)COMET_LAYER_CONFIG_INIT;
    cfg->hidden = o->hidden ? o->hidden : m->hidden / scale;
    cfg->ffn = o->ffn ? o->ffn : m->ffn / scale;
    cfg->num_experts = o->experts ? o->experts : m->num_experts;
    cfg->topk = o->topk ? o->topk : m->topk;
    cfg->activation = o->activation;
    cfg->tp = tp, cfg->ep = ep;
    *world = tp * ep;
    if (launch.on && *world != launch.size) {
        fprintf(stderr, "comet: TP*EP = %d ranks, but WORLD_SIZE is %d\n", *world, launch.size);
        return -1;
    }
    if (*world > 64 || (*use_cuda && !launch.on && *world > gpus)) {
        fprintf(stderr, "comet: TP*EP = %d ranks, but %s\n", *world,
                *use_cuda ? "there are not that many GPUs" : "the CPU engine runs at most 64");
        return -1;
    }
    int64_t total = o->tokens ? o->tokens : (*use_cuda ? 8192 : 256);
    cfg->max_tokens_per_rank = (total + *world - 1) / *world;
    for (int s = 0; s < *world; s++) tokens[s] = total / *world + (s < total % *world);
    if (o->iters < 0) o->iters = *use_cuda ? 20 : 5;
    if (o->warmup < 0) o->warmup = *use_cuda ? 5 : 1;
    if (comet_layer_config_check(cfg, *world) != COMET_SUCCESS) {
        fprintf(stderr, "comet: %s\n", comet_last_error());
        return -1;
    }
    if (o->chunk_cols > cfg->hidden) { /* args.chunk_cols: 0..hidden */
        fprintf(stderr, "comet: --chunk %d is wider than hidden %lld\n", o->chunk_cols, (long long)cfg->hidden);
        return -1;
    }
    if (!speaks())
        return 0;
    if (launch.on)
        printf("backend: CUDA, %d ranks (one process per GPU: this is rank 0, %s:%d)\n", *world, launch.addr,
               launch.port);
    else if (*use_cuda)
        printf("backend: CUDA, %d rank%s (one thread per GPU)\n", *world, *world > 1 ? "s" : "");
    else
        printf("backend: CPU engine (%d ranks as threads of one process; %s)\n", *world,
               gpus ? "--backend cpu" : "no GPU found");
    if (!o->hidden && !o->ffn && scale != 1)
        printf("model: %s scaled down 1/%d in hidden and ffn (hidden %lld, ffn %lld) so the CPU run takes seconds\n",
               m->name, scale, (long long)cfg->hidden, (long long)cfg->ffn);
    return 0;
}

static const char *const combine_names[] = {"partials", "push", "pull"};
static const char *const gemm_names[] = {"cpu", "hopper", "simt"};
static const char *const chosen_names[] = {"args", "table", "rule"};

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

static int run(const char *cmd, int argc, char **argv) {
    int is_bench = strcmp(cmd, "bench") == 0;
    options_t o;
    int pr = parse(cmd, argc, argv, &o);
    if (pr) return pr > 0 ? 0 : 2;
    comet_layer_config_t cfg;
    int64_t tokens[64];
    int world, use_cuda;
    if (configure(&o, &cfg, tokens, &world, &use_cuda)) return 2;
    if (o.graph && launch.on && launch.size > 1) {
        fprintf(stderr, "comet: --graph needs every rank in this process (not a launch of one process per rank)\n");
        return 2;
    }

    comet_routing_opts_t ro = {o.skew, o.zero_experts, o.seed};
    comet_problem_t *p;
    { /* large models take a while to draw: say what is coming */
        const double rows = cfg.activation == COMET_ACT_SILU_GATED ? 3.0 : 2.0;
        const double weights = (double)cfg.num_experts * rows * (double)cfg.hidden * (double)cfg.ffn * 2.0;
        int64_t total = 0;
        for (int s = 0; s < world; s++) total += tokens[s];
        const double gib = (2.0 * weights + 3.0 * (double)total * (double)cfg.hidden * 2.0) / (1024.0 * 1024 * 1024);
        if (gib >= 1.0 && speaks()) {
            printf("inputs: drawing %.1f GiB on the host (every expert's weights, then each rank's slice; tokens)\n", gib);
            fflush(stdout);
        }
    }
    if (comet_problem_create(&p, &cfg, world, tokens, &ro) != COMET_SUCCESS) {
        fprintf(stderr, "comet: %s\n", comet_last_error());
        return 2;
    }
    comet_problem_poison(p);
    comet_world_t *w = NULL;
    comet_bootstrap_t *bs = NULL;
    comet_status_t ws;
    if (launch.on) { /* rank 0 makes the id, the channel carries it to the others */
        comet_unique_id_t id;
        memset(&id, 0, sizeof id);
        ws = comet_bootstrap_open(&bs, launch.rank, launch.size, launch.addr, launch.port, 120000);
        if (ws == COMET_SUCCESS && launch.rank == 0) ws = comet_get_unique_id(&id);
        if (ws == COMET_SUCCESS) ws = comet_bootstrap_bcast(bs, id.bytes, sizeof id.bytes);
        if (ws == COMET_SUCCESS) ws = comet_world_create_nccl(&w, launch.rank, launch.size, &id, launch.local_rank);
    } else {
        ws = comet_world_create_local(&w, world, use_cuda ? COMET_BACKEND_CUDA : COMET_BACKEND_CPU);
    }
    if (ws != COMET_SUCCESS) {
        fprintf(stderr, "comet: %s\n", comet_last_error());
        comet_bootstrap_close(bs);
        comet_problem_destroy(p);
        return 1;
    }
    comet_run_t r;
    memset(&r, 0, sizeof r);
    r.n_comm = o.n_comm, r.chunk_cols = o.chunk_cols;
    r.repeats = is_bench ? o.warmup + o.iters : 1;
    r.graph = o.graph && use_cuda;
    r.input_sets = is_bench && use_cuda && !r.graph ? input_sets_for(p) : 1;
    if (o.graph && !use_cuda && speaks()) fprintf(stderr, "comet: --graph is for GPUs; the CPU engine runs without it\n");
    /* Lanes (CPU engine; the CUDA backend records into its own fixed lanes): the rank's thread,
     * its comm workers, its compute workers. */
    if (o.trace && comet_trace_create(&r.trace, world, 1 + (o.n_comm > 0 ? o.n_comm : 2) + 32, 0) != COMET_SUCCESS) {
        fprintf(stderr, "comet: --trace: %s\n", comet_last_error());
        comet_world_destroy(w);
        comet_bootstrap_close(bs);
        comet_problem_destroy(p);
        return 1;
    }
    /* --comm-hidden: first the four sides interleaved call by call (without
     * communication, without GEMMs, without both, whole; without a graph),
     * so that clock drift reaches them alike; the real call below is timed
     * and checked */
    double side_ms[4] = {0, 0, 0, 0}; /* gemm only, comm only, whole, neither (workload.h ms_side) */
    comet_status_t st = COMET_SUCCESS;
    const char *failed = "forward";
    if (o.hidden_metric) {
        comet_run_t sides = r;
        sides.trace = NULL, sides.graph = 0, sides.interleave = 1, sides.repeats = 4 * r.repeats;
        st = comet_problem_run(p, w, &sides, 4 * o.warmup);
        memcpy(side_ms, sides.ms_side, sizeof side_ms);
        failed = "--comm-hidden's interleaved forwards";
    }
    gpu_watch_t watch; /* the GPUs' clocks over the timed forwards (bench on GPUs, the printing process) */
    watch.n = 0;
    if (st == COMET_SUCCESS) {
        comet_problem_poison(p);
        failed = "forward";
        if (use_cuda && is_bench && speaks()) gpu_watch_open(&watch); /* NVML loaded before anything is timed */
        if (watch.n) r.timed = gpu_watch_mark, r.timed_ctx = &watch;
        st = comet_problem_run(p, w, &r, is_bench ? o.warmup : 0);
    }
    char why[1024]; /* comet_world_destroy clears the last error */
    snprintf(why, sizeof why, "%s", comet_last_error());
    comet_world_destroy(w);
    if (st != COMET_SUCCESS) {
        fprintf(stderr, "comet: %s failed: %s: %s\n", failed, comet_status_string(st), why);
        comet_bootstrap_close(bs);
        comet_trace_destroy(r.trace);
        comet_problem_destroy(p);
        return 1;
    }
    if (r.trace) {
        char svg[TRACE_PATH_MAX];
        size_t n = strlen(o.trace);
        int ext = n >= 5 && strcmp(o.trace + n - 5, ".json") == 0;
        snprintf(svg, sizeof svg, "%.*s.svg", (int)(ext ? n - 5 : n), o.trace);
        if (comet_trace_write_chrome_json(r.trace, o.trace) != COMET_SUCCESS ||
            comet_trace_write_svg(r.trace, svg) != COMET_SUCCESS) {
            fprintf(stderr, "comet: --trace: %s\n", comet_last_error());
            comet_bootstrap_close(bs);
            comet_trace_destroy(r.trace);
            comet_problem_destroy(p);
            return 1;
        }
        printf("trace: %lld events of the last forward (%lld dropped) -> %s, %s\n",
               (long long)comet_trace_event_count(r.trace), (long long)comet_trace_dropped(r.trace), o.trace, svg);
        comet_trace_destroy(r.trace);
    }
    /* The CPU engine must equal the reference bitwise; a GPU within the
     * tolerance of a different GEMM accumulation order, on sampled tokens. */
    comet_check_t chk;
    if (use_cuda && speaks()) {
        printf("checking 16 sampled tokens of every rank against the CPU reference\n");
        fflush(stdout);
    }
    if (comet_problem_check(p, use_cuda ? 16 : 0, launch.on ? launch.rank : -1, &chk) != COMET_SUCCESS) {
        fprintf(stderr, "comet: check failed to run: %s\n", comet_last_error());
        comet_bootstrap_close(bs);
        comet_problem_destroy(p);
        return 1;
    }
    int64_t bad = use_cuda ? chk.wrong : chk.differ, total = 0;
    if (launch.on) { /* rank 0 reports for every rank: the slowest times, every check */
        enum { N = 3 + 4 }; /* the row's time, the check's two counts, the four sides */
        double mine[N] = {r.ms_median, (double)bad, (double)chk.elements, side_ms[0], side_ms[1], side_ms[2], side_ms[3]};
        double all[N * 64];
        comet_status_t gs = comet_bootstrap_gather(bs, mine, sizeof mine, all);
        comet_bootstrap_close(bs);
        if (gs != COMET_SUCCESS) {
            fprintf(stderr, "comet: gathering the results: %s\n", comet_last_error());
            comet_problem_destroy(p);
            return 1;
        }
        if (!speaks()) {
            comet_problem_destroy(p);
            return bad ? 1 : 0;
        }
        bad = 0, chk.elements = 0;
        for (int q = 0; q < launch.size; q++) {
            if (all[N * q] > r.ms_median) r.ms_median = all[N * q];
            bad += (int64_t)all[N * q + 1], chk.elements += (int64_t)all[N * q + 2];
            for (int k = 0; k < 4; k++)
                if (all[N * q + 3 + k] > side_ms[k]) side_ms[k] = all[N * q + 3 + k];
        }
    }
    double flops = 0;
    for (int s = 0; s < world; s++) {
        total += p->tokens[s];
        flops += 2.0 * (double)p->tokens[s] * (double)cfg.topk * (double)cfg.hidden * (double)cfg.ffn *
                 (cfg.activation == COMET_ACT_SILU_GATED ? 3 : 2);
    }
    /* CUDA: the protocol the layer ran (n_comm > 0 overlapped, 0 the sequential chain, always with
     * the SIMT GEMM); shown "<n>" / "seq", "auto:<n>" / "auto:seq" where the tuner picked it */
    const comet_protocol_t *proto = &r.protocol;
    const int ran_comm = use_cuda ? proto->n_comm : o.n_comm;
    const double link_gbps =
        (double)comet_problem_link_bytes(p, use_cuda ? COMET_BACKEND_CUDA : COMET_BACKEND_CPU) / world /
        (r.ms_median * 1e6);
    printf("\n%-14s %7s %3s %3s %4s %4s %6s %6s %9s %10s %11s %9s  %s\n", "model", "M", "TP", "EP", "topk", "E",
           "hidden", "ffn", "n_comm", "ms", use_cuda ? "TFLOP/s/GPU" : "GFLOP/s", "GB/s/GPU", "check vs reference");
    char ncomm[32], how[16];
    const char *auto_tag = o.n_comm == 0 ? "auto:" : "";
    if (use_cuda && ran_comm > 0)
        snprintf(how, sizeof how, "%s%d", auto_tag, ran_comm);
    else if (use_cuda)
        snprintf(how, sizeof how, "%sseq", auto_tag);
    else
        snprintf(how, sizeof how, o.n_comm > 0 ? "%d" : "auto", o.n_comm);
    snprintf(ncomm, sizeof ncomm, "%s", how);
    double rate = use_cuda ? flops / world / (r.ms_median * 1e9) : flops / (r.ms_median * 1e6);
    printf("%-14s %7lld %3d %3d %4lld %4lld %6lld %6lld %9s %10.3f %11.2f %9.2f  %s (%lld of %lld %s)\n", o.model,
           (long long)total, cfg.tp, cfg.ep, (long long)cfg.topk, (long long)cfg.num_experts, (long long)cfg.hidden,
           (long long)cfg.ffn, ncomm, r.ms_median, rate, link_gbps, bad ? "WRONG" : "ok", (long long)bad,
           (long long)chk.elements, use_cuda ? "sampled elements off" : "elements differ");
    if (use_cuda && !launch.on) /* how far off: the tolerance is 4 bf16 ulps + 1% of the row's rms */
        printf("(largest difference from the reference: %.2e of its row's rms; %lld sampled elements not bitwise equal)\n",
               chk.worst, (long long)chk.differ);
    printf("(GB/s/GPU: bytes that cross between ranks -- token rows pulled, %s -- per GPU per second)\n",
           use_cuda ? "once per token and rank; expert output rows sent home" : "fp32 partials stored");
    if (proto->struct_size)
        printf("protocol: %s, n_comm %d, %s combine, %s GEMM, chosen by %s\n",
               proto->mode == COMET_MODE_OVERLAPPED ? "overlapped" : "sequential", proto->n_comm, combine_names[proto->combine],
               gemm_names[proto->gemm], chosen_names[proto->chosen_by]);
    printf("memory per rank: %.1f MiB symmetric, %.1f MiB private (%s)\n", r.memory.symmetric_bytes / 1048576.0,
           r.memory.private_bytes / 1048576.0, use_cuda ? "device" : "host");
    if (is_bench) printf("(ms: median of %d runs of the slowest rank, after %d warm-up runs)\n", o.iters, o.warmup);
    if (use_cuda && is_bench)
        printf("inputs: %d sets of x, routing and y a rank, rotated call by call%s\n", r.input_sets,
               r.graph ? " (--graph: the captured forward's one set)" : "");
    if (use_cuda && is_bench && watch.n) { /* one line for every GPU of this node NVML sees */
        unsigned long long why = 0;
        for (int i = 0; i < watch.n; i++) why |= watch.reasons[i];
        printf("GPU clocks over the timed forwards (NVML, every GPU of this node): SM");
        print_per_gpu(stdout, watch.mhz, watch.n, " /", " %.0f");
        if (!gpu_watch_has_power(&watch)) {
            printf(" MHz, power not measured (the timed forwards took under %.0f s)", GPU_WATCH_MIN_SPAN);
        } else {
            printf(" MHz, power");
            print_per_gpu(stdout, watch.watts, watch.n, " /", " %.0f");
            printf(" W");
        }
        char text[96];
        printf(", clock limited by %s\n", gpu_power_reasons(why, text, sizeof text));
    } else if (use_cuda && is_bench) {
        printf("GPU clocks: not read (NVML not available)\n");
    }
    if (use_cuda) /* src/cuda/replay.c: the forward chain captured once, then one graph launch a call */
        printf("forwards replayed as one CUDA graph on rank 0: %lld, from %lld capture%s%s\n", (long long)r.replays,
               (long long)r.captures, r.captures == 1 ? "" : "s",
               r.replays || r.captures ? "" : " (graph replay off: each forward launched kernel by kernel)");
    /* the SIMT GEMM fallback ignores args.disable: every side ran whole there */
    const int sides_differ = !(use_cuda && proto->gemm == COMET_GEMM_SIMT);
    /* benchmarks.md's figure; and net of the steps every side keeps (staging,
     * plan, launches: t_neither), which that formula counts once too often */
    const double comm_net = side_ms[1] - side_ms[3];
    double hidden = o.hidden_metric && sides_differ && side_ms[1] > 0
                        ? (side_ms[0] + side_ms[1] - side_ms[2]) / side_ms[1]
                        : -1;
    double hidden_net = o.hidden_metric && sides_differ && comm_net > 0
                            ? (side_ms[0] + side_ms[1] - side_ms[2] - side_ms[3]) / comm_net
                            : -1;
    if (o.hidden_metric && !sides_differ)
        printf("communication hidden: not measured (the SIMT GEMM fallback runs every call whole)\n");
    else if (o.hidden_metric) {
        char net[64] = "not measurable (comm only <= neither)";
        if (hidden_net != -1) snprintf(net, sizeof net, "%.1f%%", 100 * hidden_net);
        printf("communication hidden: %.1f%%, %s net of the steps every side keeps (gemm only %.3f ms, comm only "
               "%.3f ms, neither %.3f ms, both %.3f ms; medians of %d calls each, the four interleaved)\n",
               100 * hidden, net, side_ms[0], side_ms[1], side_ms[3], side_ms[2], o.iters);
    }
    if (o.json) {
        FILE *f = fopen(o.json, "a");
        if (!f) {
            fprintf(stderr, "comet: cannot open %s for appending\n", o.json);
            comet_problem_destroy(p);
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
                "\"iters\": %d, \"warmup\": %d",
                use_cuda ? "cuda" : "cpu", date, commit ? commit : "unknown", o.model, (long long)total, cfg.tp, cfg.ep,
                (long long)cfg.topk, (long long)cfg.num_experts, (long long)cfg.hidden, (long long)cfg.ffn, o.skew,
                (long long)o.zero_experts, r.ms_median, rate, link_gbps, (long long)bad, (long long)chk.elements,
                ran_comm, o.n_comm == 0, combine_names[proto->combine], gemm_names[proto->gemm], hidden, hidden_net, r.graph, (long long)r.replays, r.input_sets, side_ms[0], side_ms[1],
                side_ms[2], side_ms[3], o.iters, o.warmup);
        if (watch.n) { /* the GPUs' clocks over the timed forwards, NVML's GPU order */
            fprintf(f, ", \"sm_mhz\": [");
            print_per_gpu(f, watch.mhz, watch.n, ", ", "%.0f");
            fprintf(f, "]");
            if (gpu_watch_has_power(&watch)) { /* not measured: no key */
                fprintf(f, ", \"watts\": [");
                print_per_gpu(f, watch.watts, watch.n, ", ", "%.1f");
                fprintf(f, "]");
            }
        }
        fprintf(f, "}\n");
        fclose(f);
    }
    comet_problem_destroy(p);
    return bad ? 1 : 0;
}

/* comet tune: the grid, the curve, the best point appended to the table. */
static int tune(int argc, char **argv) {
    options_t o;
    int pr = parse("tune", argc, argv, &o);
    if (pr) return pr > 0 ? 0 : 2;
    if (o.json || o.trace) {
        fprintf(stderr, "comet tune: --json and --trace are for bench and check\n");
        return 2;
    }
    /* before configure fills in bench's defaults */
    const int iters = o.iters > 0 ? o.iters : 3, warmup = o.warmup >= 0 ? o.warmup : 1;
    comet_layer_config_t cfg;
    int64_t tokens[64];
    int world, use_cuda;
    if (configure(&o, &cfg, tokens, &world, &use_cuda)) return 2;
    if (launch.on) {
        fprintf(stderr, "comet tune: runs in one process over the local GPUs (no torchrun launch)\n");
        return 2;
    }
    comet_routing_opts_t ro = {o.skew, o.zero_experts, o.seed};
    comet_problem_t *p;
    comet_world_t *w = NULL;
    if (comet_problem_create(&p, &cfg, world, tokens, &ro) != COMET_SUCCESS ||
        comet_world_create_local(&w, world, use_cuda ? COMET_BACKEND_CUDA : COMET_BACKEND_CPU) != COMET_SUCCESS) {
        fprintf(stderr, "comet: %s\n", comet_last_error());
        comet_problem_destroy(p);
        return 2;
    }
    /* communication workers: threads on the CPU engine, CTAs (SMs) on a GPU;
     * chunk widths hidden/16 .. hidden/2 in multiples of 8 columns (CPU) or
     * of GEMM1's 256-column tile (GPU), distinct */
    const int cpu_comms[] = {1, 2, 3, 4, 6, 8}, gpu_comms[] = {4, 8, 12, 16, 24, 32};
    const int *n_comms = use_cuda ? gpu_comms : cpu_comms, unit = use_cuda ? 256 : 8;
    int chunks[4], n_chunks = 0;
    for (int div = 16; div >= 2; div /= 2) {
        int c = (int)((cfg.hidden / div + unit - 1) / unit * unit);
        if (c < unit) c = unit;
        if (c > cfg.hidden) c = (int)cfg.hidden;
        if (n_chunks == 0 || chunks[n_chunks - 1] != c) chunks[n_chunks++] = c;
    }
    /* on a GPU the sequential chain first: the table records it as n_comm 0 when it wins; the
     * layer's modes then say what the grid can change: with push the overlapped combine runs after
     * GEMM1, so the chunk width does nothing (one column); the SIMT GEMM has no overlapped mode */
    const int rows = (int)(sizeof cpu_comms / sizeof cpu_comms[0]) + (use_cuda ? 1 : 0);
    struct {
        int n_comm, chunk_cols;
    } best = {0, 0};
    double best_ms = -1, best_ov_ms = -1;
    int best_ov_chunk = chunks[0]; /* recorded with a sequential win: what n_comm > 0 calls then use */
    int pushed = 0;                /* GPU: the layer pushes (one chunk column) */
    for (int i = 0; i < rows; i++) {
        const int seq = use_cuda && i == 0, n_comm = seq ? COMET_SEQUENTIAL : n_comms[i - (use_cuda ? 1 : 0)];
        comet_run_t r;
        if (i == (use_cuda ? 1 : 0)) { /* the grid's header, once the sequential run (GPU) said the modes */
            printf("\nms (median of %d) by communication workers (rows) and layer-1 chunk width (columns%s)\n%8s", iters,
                   pushed ? "; with push it does nothing: one" : "", "n_comm");
            for (int c = 0; c < n_chunks; c++) printf(" %9d", chunks[c]);
            printf("\n");
        }
        if (!seq) printf("%8d", n_comm);
        for (int c = 0; c < (seq ? 1 : n_chunks); c++) {
            memset(&r, 0, sizeof r);
            r.n_comm = n_comm, r.chunk_cols = chunks[c], r.repeats = warmup + iters;
            r.input_sets = use_cuda ? input_sets_for(p) : 1;
            comet_status_t st = comet_problem_run(p, w, &r, warmup);
            if (st != COMET_SUCCESS) {
                fprintf(stderr, "\ncomet tune: %s: %s\n", comet_status_string(st), comet_last_error());
                comet_world_destroy(w);
                comet_problem_destroy(p);
                return 1;
            }
            if (seq)
                printf("\nthe sequential chain: %.3f ms%s\n", r.ms_median, r.protocol.gemm == COMET_GEMM_SIMT ? " (SIMT GEMM: no overlapped mode)" : "");
            else
                printf(" %9.3f", r.ms_median);
            if (best_ms < 0 || r.ms_median < best_ms)
                best.n_comm = seq ? 0 : n_comm, best.chunk_cols = chunks[c], best_ms = r.ms_median;
            if (!seq && (best_ov_ms < 0 || r.ms_median < best_ov_ms)) best_ov_ms = r.ms_median, best_ov_chunk = chunks[c];
        }
        if (seq && r.protocol.gemm == COMET_GEMM_SIMT) break; /* every n_comm would run the same sequential chain */
        if (use_cuda) n_chunks = 1, pushed = 1; /* no chunked combine on GPUs: the width does nothing */
        if (!seq) printf("\n");
        fflush(stdout);
    }
    if (best.n_comm == 0) best.chunk_cols = best_ov_chunk;
    const char *out = o.out ? o.out : getenv("COMET_TUNE_FILE");
    if (!out || !*out) out = "comet-tune.tsv";
    comet_world_destroy(w);
    int rc = comet_tune_append(out, &cfg, world, use_cuda ? COMET_BACKEND_CUDA : COMET_BACKEND_CPU, best.n_comm,
                               best.chunk_cols, best_ms);
    printf("best: n_comm %d%s, chunk %d: %.3f ms; %s %s\n", best.n_comm, use_cuda && best.n_comm == 0 ? " (sequential)" : "",
           best.chunk_cols, best_ms,
           rc == 0 ? "appended to" : "could not append to", out);
    comet_problem_destroy(p);
    return rc == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(cmd, "--version") == 0) {
        printf("comet %d.%d.%d\n", COMET_VERSION_MAJOR, COMET_VERSION_MINOR, COMET_VERSION_PATCH);
        return 0;
    }
    if (launch_from_env()) return 2;
    if (strcmp(cmd, "bench") == 0 || strcmp(cmd, "check") == 0) return run(cmd, argc - 2, argv + 2);
    if (strcmp(cmd, "tune") == 0) return tune(argc - 2, argv + 2);
    fprintf(stderr, "comet: unknown command '%s'\n", cmd);
    usage(stderr);
    return 2;
}
