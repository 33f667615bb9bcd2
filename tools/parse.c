/*
 * tools/parse.c - the command line of the CLI (tools/cli.h): the usage and
 * help texts, the flags, the torchrun environment, and the defaults and
 * checks that turn them into a layer config. Every argument error is
 * refused here, with exit status 2, before anything is allocated.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

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

void cli_usage(FILE *f) {
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

/* cmd's flags into *o (its launch and command set): 0, 1 if help was printed, -1 on
 * an error (printed). */
static int parse_flags(const char *cmd, int argc, char **argv, cli_options_t *o) {
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
        } else if (strcmp(f, "--comm-hidden") == 0 && o->command == CLI_BENCH) {
            o->hidden_metric = 1;
        } else if (strcmp(f, "--graph") == 0 && o->command == CLI_BENCH) {
            o->graph = 1;
        } else if (strcmp(f, "--json") == 0 && v) {
            o->json = v, i++;
        } else if (strcmp(f, "--out") == 0 && v && o->command == CLI_TUNE) {
            o->out = v, i++;
        } else if (strcmp(f, "--trace") == 0 && v) {
            if (strlen(v) + sizeof ".svg" > CLI_TRACE_PATH_MAX) { /* the picture's name beside it must fit too */
                fprintf(stderr, "comet: --trace: the path is longer than %zu characters\n",
                        CLI_TRACE_PATH_MAX - sizeof ".svg");
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

static int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) : fallback;
}

static int launch_from_env(cli_launch_t *l) {
    memset(l, 0, sizeof *l);
    l->size = env_int("WORLD_SIZE", 1);
    if (l->size <= 1) return 0;
    l->on = 1;
    l->rank = env_int("RANK", -1);
    l->local_rank = env_int("LOCAL_RANK", l->rank);
    l->addr = getenv("MASTER_ADDR") && *getenv("MASTER_ADDR") ? getenv("MASTER_ADDR") : "127.0.0.1";
    l->port = env_int("COMET_BOOTSTRAP_PORT", env_int("MASTER_PORT", 29500) + 1);
    if (l->rank < 0 || l->rank >= l->size || l->local_rank < 0 || l->port < 1 || l->port > 65535) {
        fprintf(stderr, "comet: WORLD_SIZE=%d but RANK=%d, LOCAL_RANK=%d, port %d: not a valid launch\n", l->size,
                l->rank, l->local_rank, l->port);
        return -1;
    }
    return 0;
}

/* The launch from the environment, then the command, then its flags (in
 * this order: a bad launch is refused before anything else). */
int cli_parse(const char *cmd, int argc, char **argv, cli_options_t *o) {
    memset(o, 0, sizeof *o);
    if (launch_from_env(&o->launch)) return -1;
    if (strcmp(cmd, "bench") == 0)
        o->command = CLI_BENCH;
    else if (strcmp(cmd, "check") == 0)
        o->command = CLI_CHECK;
    else if (strcmp(cmd, "tune") == 0)
        o->command = CLI_TUNE;
    else {
        fprintf(stderr, "comet: unknown command '%s'\n", cmd);
        cli_usage(stderr);
        return -1;
    }
    const int pr = parse_flags(cmd, argc, argv, o);
    if (pr == 0 && o->command == CLI_TUNE && (o->json || o->trace)) {
        fprintf(stderr, "comet tune: --json and --trace are for bench and check\n");
        return -1;
    }
    return pr;
}

/* Fill in defaults (they depend on the backend) and build the config. */
int cli_configure(cli_result_t *r) {
    cli_options_t *o = &r->opt;
    const cli_launch_t *launch = &o->launch;
    comet_layer_config_t *cfg = &r->cfg;
    const int gpus = r->gpus = comet_device_count();
    const int use_cuda = r->use_cuda =
        launch->on || strcmp(o->backend, "cuda") == 0 || (strcmp(o->backend, "auto") == 0 && gpus > 0);
    if (use_cuda && gpus == 0) {
        fprintf(stderr, "comet: %s: no CUDA device found (or this build has no CUDA backend)\n",
                launch->on ? "a launched world (WORLD_SIZE > 1)" : "--backend cuda");
        return -1;
    }
    if (launch->on && (strcmp(o->backend, "cpu") == 0 || launch->local_rank >= gpus)) {
        fprintf(stderr, "comet: rank %d: a launched world runs on GPUs, LOCAL_RANK %d of %d here\n", launch->rank,
                launch->local_rank, gpus);
        return -1;
    }
    const comet_model_t *m = comet_model_find(o->model);
    const int scale = r->scale = o->scale ? o->scale : (use_cuda ? 1 : 8);
    const int ranks = launch->on ? launch->size : use_cuda ? gpus : 2;
    const int tp = o->tp ? o->tp : 1, ep = o->ep ? o->ep : (o->tp ? 1 : ranks);
    *cfg = (comet_layer_config_t)COMET_LAYER_CONFIG_INIT;
    cfg->hidden = o->hidden ? o->hidden : m->hidden / scale;
    cfg->ffn = o->ffn ? o->ffn : m->ffn / scale;
    cfg->num_experts = o->experts ? o->experts : m->num_experts;
    cfg->topk = o->topk ? o->topk : m->topk;
    cfg->activation = o->activation;
    cfg->tp = tp, cfg->ep = ep;
    const int world = r->world = tp * ep;
    if (launch->on && world != launch->size) {
        fprintf(stderr, "comet: TP*EP = %d ranks, but WORLD_SIZE is %d\n", world, launch->size);
        return -1;
    }
    if (world > CLI_MAX_RANKS || (use_cuda && !launch->on && world > gpus)) {
        fprintf(stderr, "comet: TP*EP = %d ranks, but %s\n", world,
                use_cuda ? "there are not that many GPUs" : "the CPU engine runs at most 64");
        return -1;
    }
    const int64_t total = r->total_tokens = o->tokens ? o->tokens : (use_cuda ? 8192 : 256);
    cfg->max_tokens_per_rank = (total + world - 1) / world;
    for (int s = 0; s < world; s++) r->tokens[s] = total / world + (s < total % world);
    const int tune = o->command == CLI_TUNE; /* fewer timed runs a point of its grid */
    if (o->iters < 0) o->iters = tune ? 3 : use_cuda ? 20 : 5;
    if (o->warmup < 0) o->warmup = tune ? 1 : use_cuda ? 5 : 1;
    if (comet_layer_config_check(cfg, world) != COMET_SUCCESS) {
        fprintf(stderr, "comet: %s\n", comet_last_error());
        return -1;
    }
    if (o->chunk_cols > cfg->hidden) { /* args.chunk_cols: 0..hidden */
        fprintf(stderr, "comet: --chunk %d is wider than hidden %lld\n", o->chunk_cols, (long long)cfg->hidden);
        return -1;
    }
    if (tune && launch->on) {
        fprintf(stderr, "comet tune: runs in one process over the local GPUs (no torchrun launch)\n");
        return -1;
    }
    if (o->graph && launch->on) {
        fprintf(stderr, "comet: --graph needs every rank in this process (not a launch of one process per rank)\n");
        return -1;
    }
    return 0;
}
