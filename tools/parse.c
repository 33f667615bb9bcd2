/*
 * tools/parse.c - the command line of the CLI (tools/cli.h): the usage and
 * help texts, the flags (one table: the commands that take each, whether it
 * takes a value), the torchrun environment, and the defaults and checks
 * that turn them into a layer config. Every argument error is refused here,
 * with exit status 2, before anything is allocated, each with its own
 * message: an unknown flag, model or command (with "did you mean" the
 * nearest by edit distance), a flag of another command, a missing value, a
 * bad number, a number out of range, a bad choice.
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

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
    "  --backend B        auto (default), cpu, cuda\n";

/* The flags of the runs that write results (bench, check). */
static const char *const output_help =
    "  --json FILE        append the result as one JSON line (bench/report.py reads it)\n"
    "  --trace FILE       record every worker's steps in the last forward (with --train the last\n"
    "                     step, forward and backward): a picture (SVG) and\n"
    "                     Chrome-trace JSON (Perfetto, chrome://tracing); x.svg or x.json writes\n"
    "                     both x.svg and x.json, another name FILE the JSON to FILE, the SVG to FILE.svg\n";

void cli_usage(FILE *f) {
    fprintf(f,
            "usage: comet <command> [flags]\n\n"
            "commands:\n"
            "  bench    time one MoE layer forward on every rank and check it against the reference\n"
            "  check    run one configuration once and compare it with the reference (bitwise on the CPU)\n"
            "  tune     time a configuration over the run-time knobs; record the fastest for the library\n"
            "  help     this text; `comet <command> --help` for a command's flags\n"
            "(a flag's value follows it, or '=': --tokens 512, --tokens=512)\n\n"
            "comet runs Mixture-of-Experts layers across GPUs with computation-communication\n"
            "overlap. With GPUs it runs on all of them (one rank each); without, on the CPU\n"
            "engine (ranks as threads) with a scaled-down model.\n");
}

static void command_usage(const char *cmd, FILE *f) {
    if (strcmp(cmd, "bench") == 0)
        fprintf(f, "usage: comet bench [flags]\n\nTime the forward of one MoE layer (median over --iters after --warmup)\n"
                   "and check the output against the reference: bitwise on the CPU engine; on GPUs 16\n"
                   "sampled tokens a rank, within the tolerance of a different fp32 summation order.\n\nflags:\n%s%s"
                   "  --iters N          timed runs (default 20 on GPUs, 5 on CPU)\n"
                   "  --warmup N         untimed runs first (default 5 on GPUs, 1 on CPU)\n"
                   "  --comm-hidden      also time the same protocol with the GEMMs left out, with the\n"
                   "                     communication left out and with both, call by call interleaved\n"
                   "                     with whole calls (no graph), and report the communication hidden\n"
                   "                     from those medians: (t_gemm_only + t_comm_only - t) / t_comm_only,\n"
                   "                     and the same with the steps every side keeps (t_neither)\n"
                   "                     subtracted from each (GPUs: the Hopper GEMM; with --train the\n"
                   "                     backward's sides, the forward run whole)\n"
                   "  --graph            GPUs: capture one forward in a CUDA graph and time its replays (no\n"
                   "                     launch overhead, as a graph-captured training step sees it)\n"
                   "  --train            time training steps instead: the training forward (saving its\n"
                   "                     activations) then the backward (dy random bf16; dx, d_topk_w and bf16\n"
                   "                     dw1, dw2 written); forward, backward and step ms, the step's rate (3x\n"
                   "                     the forward's FLOPs); the gradients first checked against the\n"
                   "                     reference on sampled tokens (every token on the CPU engine, bitwise)\n"
                   "  --recompute        with --train: the forward saves nothing, the backward recomputes\n"
                   "  --back-to-back     with --train on GPUs: the timed steps enqueued back to back, one\n"
                   "                     sync after the last (as a training loop's host runs ahead); a step's\n"
                   "                     time is the GPU's, the host's work before it hidden; also prints the\n"
                   "                     host's time to enqueue a step\n"
                   "  --grad-check       with --train on GPUs: check the gradients also where a rank's\n"
                   "                     weights pass 4 GiB (DeepSeek-V3-style: the host reference then takes\n"
                   "                     minutes and ~100 GiB of host memory)\n",
                flag_help, output_help);
    else if (strcmp(cmd, "tune") == 0)
        fprintf(f, "usage: comet tune [flags]\n\nTime one configuration over a grid of run-time knobs (communication\n"
                   "workers x layer-1 chunk width), print the curve, and append the fastest to a\n"
                   "table file that the library reads from COMET_TUNE_FILE.\n\nflags (--n-comm and --chunk are what it sweeps):\n%s"
                   "  --iters N          timed runs per point (default 3)\n"
                   "  --warmup N         untimed runs first, per point (default 1)\n"
                   "  --out FILE         table to append to (default $COMET_TUNE_FILE, else comet-tune.tsv)\n",
                flag_help);
    else
        fprintf(f, "usage: comet check [flags]\n\nRun one configuration once and compare its output with the reference:\n"
                   "bitwise on the CPU engine (exit status 0 only if every element matches); on GPUs 16\n"
                   "sampled tokens a rank, within the tolerance of a different fp32 summation order\n"
                   "(exit status 0 only if none is off).\n\nflags:\n%s%s"
                   "  --train            check a training step instead: the training forward, then the\n"
                   "                     backward's dx, d_topk_w, dw1 and dw2 against comet_reference_backward\n"
                   "                     (every token on the CPU engine, bitwise; 8 sampled tokens a rank on GPUs)\n"
                   "  --recompute        with --train: the forward saves nothing, the backward recomputes\n"
                   "  --grad-check       with --train on GPUs: also where a rank's weights pass 4 GiB\n",
                flag_help, output_help);
}

/* ---- the flags --------------------------------------------------------------
 * Every flag, the commands that take it and whether it takes a value: the
 * parser looks names up here, and an unknown name is compared with these
 * ("did you mean"). */
enum { FOR_BENCH = 1 << CLI_BENCH, FOR_CHECK = 1 << CLI_CHECK, FOR_TUNE = 1 << CLI_TUNE };
#define FOR_ALL (FOR_BENCH | FOR_CHECK | FOR_TUNE)
typedef struct {
    const char *name;
    int commands; /* FOR_* bits */
    int value;    /* takes a value */
} flag_t;
static const flag_t flags[] = {
    {"--model", FOR_ALL, 1},        {"--tokens", FOR_ALL, 1},     {"--tp", FOR_ALL, 1},
    {"--ep", FOR_ALL, 1},           {"--topk", FOR_ALL, 1},       {"--experts", FOR_ALL, 1},
    {"--hidden", FOR_ALL, 1},       {"--ffn", FOR_ALL, 1},        {"--scale", FOR_ALL, 1},
    {"--activation", FOR_ALL, 1},   {"--skew", FOR_ALL, 1},       {"--zero-experts", FOR_ALL, 1},
    {"--n-comm", FOR_ALL, 1},       {"--chunk", FOR_ALL, 1},      {"--seed", FOR_ALL, 1},
    {"--backend", FOR_ALL, 1},      {"--iters", FOR_ALL, 1},      {"--warmup", FOR_ALL, 1},
    {"--json", FOR_BENCH | FOR_CHECK, 1}, {"--trace", FOR_BENCH | FOR_CHECK, 1},
    {"--train", FOR_BENCH | FOR_CHECK, 0}, {"--recompute", FOR_BENCH | FOR_CHECK, 0},
    {"--grad-check", FOR_BENCH | FOR_CHECK, 0}, {"--back-to-back", FOR_BENCH, 0},
    {"--comm-hidden", FOR_BENCH, 0}, {"--graph", FOR_BENCH, 0},   {"--out", FOR_TUNE, 1},
    {"--help", FOR_ALL, 0},
};
enum { NUM_FLAGS = (int)(sizeof flags / sizeof flags[0]) };
static const char *const commands[] = {"bench", "check", "tune", "help"};

/* Edit distance (insertions, deletions, substitutions and swaps of two
 * neighbours; case ignored) of a and b, and in *to_prefix the least of a
 * and any beginning of b ("deepsek" is 1 from "deepseek-v3"'s); 99 when
 * either is longer than 63 characters. */
static int edit_distance(const char *a, const char *b, int *to_prefix) {
    const int n = (int)strlen(a), m = (int)strlen(b);
    *to_prefix = 99;
    if (n > 63 || m > 63) return 99;
    int d[64][64];
    for (int i = 0; i <= n; i++) d[i][0] = i;
    for (int j = 0; j <= m; j++) d[0][j] = j;
    for (int i = 1; i <= n; i++)
        for (int j = 1; j <= m; j++) {
            const int same = tolower((unsigned char)a[i - 1]) == tolower((unsigned char)b[j - 1]);
            int v = d[i - 1][j - 1] + !same;
            if (d[i - 1][j] + 1 < v) v = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < v) v = d[i][j - 1] + 1;
            if (i > 1 && j > 1 && tolower((unsigned char)a[i - 1]) == tolower((unsigned char)b[j - 2]) &&
                tolower((unsigned char)a[i - 2]) == tolower((unsigned char)b[j - 1]) && d[i - 2][j - 2] + 1 < v)
                v = d[i - 2][j - 2] + 1;
            d[i][j] = v;
        }
    for (int j = 0; j <= m; j++)
        if (d[n][j] < *to_prefix) *to_prefix = d[n][j];
    return d[n][m];
}

/* The candidate that s most likely meant, or NULL: the one nearest by
 * edit_distance (to the whole name, or from 4 characters on to its
 * beginning: "mixtral" for "mixtral-8x7b", "--tokenz" for "--tokens"), at
 * most a third of s's length away (at least 1), when no other is as near. */
static const char *did_you_mean(const char *s, const char *const *cands, int n) {
    const size_t len = strlen(s);
    const char *best = NULL;
    int best_d = (int)(len / 3 > 1 ? len / 3 : 1) + 1, ties = 0;
    for (int i = 0; i < n; i++) {
        int prefix;
        int d = edit_distance(s, cands[i], &prefix);
        if (len >= 4 && prefix < d) d = prefix;
        if (len == 3 && strncasecmp(cands[i], s, len) == 0) d = 0; /* "phi" */
        if (d < best_d)
            best_d = d, best = cands[i], ties = 0;
        else if (d == best_d && best)
            ties++;
    }
    return ties ? NULL : best;
}

/* " did you mean X?" for s among the names, or "". */
static const char *suggestion(const char *s, const char *const *cands, int n, char *buf, size_t size) {
    const char *m = did_you_mean(s, cands, n);
    if (!m) return "";
    snprintf(buf, size, "; did you mean %s?", m);
    return buf;
}

static const char *flag_suggestion(const char *s, char *buf, size_t size) {
    const char *names[NUM_FLAGS];
    for (int i = 0; i < NUM_FLAGS; i++) names[i] = flags[i].name;
    char dashed[72]; /* "-tokens", "tokens": compared as "--tokens" */
    const char *bare = s;
    while (*bare == '-') bare++;
    snprintf(dashed, sizeof dashed, "--%s", bare);
    return suggestion(dashed, names, NUM_FLAGS, buf, size);
}

static const char *model_suggestion(const char *s, char *buf, size_t size) {
    const char *names[64];
    const int n = comet_num_models < 64 ? comet_num_models : 64;
    for (int i = 0; i < n; i++) names[i] = comet_models[i].name;
    return suggestion(s, names, n, buf, size);
}

static const char *command_names(int commands, char *buf, size_t size) {
    const char *names[3] = {"comet bench", "comet check", "comet tune"};
    int k = 0, count = 0;
    for (int c = 0; c < 3; c++) count += (commands >> c) & 1;
    buf[0] = 0;
    for (int c = 0; c < 3; c++)
        if (commands >> c & 1) {
            const size_t at = strlen(buf);
            snprintf(buf + at, size - at, "%s%s", k == 0 ? "" : k == count - 1 ? " and " : ", ", names[c]);
            k++;
        }
    return buf;
}

/* A whole number in [lo, hi]: "needs a whole number" when s is none (or
 * empty), "in [lo, hi]" when it is out of range. */
static int parse_int(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end) { /* end == s: no digits, e.g. '' */
        fprintf(stderr, "comet: %s needs a whole number, got '%s'\n", flag, s);
        return -1;
    }
    if (errno || v < lo || v > hi) {
        fprintf(stderr, "comet: %s needs a whole number in [%lld, %lld], got '%s'\n", flag, (long long)lo,
                (long long)hi, s);
        return -1;
    }
    *out = v;
    return 0;
}

/* One of choices (n of them): its index, else -1 (printed: "must be a, b
 * or c, got 'x'"). */
static int parse_choice(const char *flag, const char *s, const char *const *choices, int n) {
    for (int i = 0; i < n; i++)
        if (strcmp(s, choices[i]) == 0) return i;
    char list[256] = "";
    for (int i = 0; i < n; i++) {
        const size_t at = strlen(list);
        snprintf(list + at, sizeof list - at, "%s%s", i == 0 ? "" : i == n - 1 ? " or " : ", ", choices[i]);
    }
    fprintf(stderr, "comet: %s must be %s, got '%s'\n", flag, list, s);
    return -1;
}

static int ends_with(const char *s, const char *tail) {
    const size_t n = strlen(s), k = strlen(tail);
    return n >= k && strcasecmp(s + n - k, tail) == 0;
}

/* --trace's two files (cli_options_t): x.svg or x.json gives the picture
 * x.svg and the JSON x.json; another name FILE the JSON FILE and the
 * picture FILE.svg. Returns 0, or -1 when either name would not fit
 * (printed: refused, not truncated). */
static int trace_names(const char *path, char *json, char *svg) {
    const size_t n = strlen(path), max = CLI_TRACE_PATH_MAX - 1;
    const int is_svg = ends_with(path, ".svg"), is_json = ends_with(path, ".json");
    const size_t base = is_svg ? n - 4 : is_json ? n - 5 : n; /* the name without its extension */
    const size_t longest = is_svg ? max - 1 : is_json ? max : max - 4;
    if (n > longest) {
        fprintf(stderr, "comet: --trace: the path is longer than %zu characters\n", longest);
        return -1;
    }
    if (is_svg || is_json)
        snprintf(json, CLI_TRACE_PATH_MAX, "%.*s.json", (int)base, path);
    else
        snprintf(json, CLI_TRACE_PATH_MAX, "%s", path);
    snprintf(svg, CLI_TRACE_PATH_MAX, "%.*s.svg", (int)base, path);
    return 0;
}

/* A value that is the next flag ("--json --tokens 8"), not a value. */
static int looks_like_flag(const char *v) { return v[0] == '-' && v[1] == '-'; }

/* cmd's flags into *o (its launch and command set): 0, 1 if help was printed, -1 on
 * an error (printed). A flag's value is the next argument, or follows '=' (--tokens=512). */
static int parse_flags(const char *cmd, int argc, char **argv, cli_options_t *o) {
    static const char *const backends[] = {"auto", "cpu", "cuda"}, *const activations[] = {"silu", "gelu"};
    o->model = "mixtral-8x7b";
    o->seed = 1;
    o->iters = -1, o->warmup = -1;
    o->backend = "auto";
    for (int i = 0; i < argc; i++) {
        const char *arg = argv[i], *v = NULL, *eq = strchr(arg, '=');
        char name[64], hint[96];
        const size_t name_len = eq && arg[0] == '-' ? (size_t)(eq - arg) : strlen(arg);
        snprintf(name, sizeof name, "%.*s", (int)(name_len < sizeof name ? name_len : sizeof name - 1), arg);
        const char *f = name;
        if (strcmp(f, "-h") == 0) f = "--help";
        const flag_t *fl = NULL;
        for (int k = 0; k < NUM_FLAGS; k++)
            if (strcmp(f, flags[k].name) == 0) fl = &flags[k];
        if (!fl && arg[0] != '-') {
            fprintf(stderr, "comet %s: unexpected argument '%s'", cmd, arg);
            if (comet_model_find(arg)) fprintf(stderr, "; did you mean --model %s?", arg);
            fprintf(stderr, " (flags: comet %s --help)\n", cmd);
            return -1;
        }
        if (!fl) {
            fprintf(stderr, "comet %s: unknown flag '%s'%s (flags: comet %s --help)\n", cmd, name,
                    flag_suggestion(name, hint, sizeof hint), cmd);
            return -1;
        }
        if (!(fl->commands >> o->command & 1)) {
            char names[64];
            fprintf(stderr, "comet %s: %s is a flag of %s\n", cmd, f, command_names(fl->commands, names, sizeof names));
            return -1;
        }
        if (eq && !fl->value) {
            fprintf(stderr, "comet: %s takes no value, got '%s'\n", f, arg);
            return -1;
        }
        if (fl->value) {
            v = eq ? eq + 1 : i + 1 < argc ? argv[++i] : NULL;
            if (!v || (!eq && looks_like_flag(v))) {
                fprintf(stderr, "comet: %s needs a value%s%s%s\n", f, v ? " (got the flag '" : "", v ? v : "",
                        v ? "')" : "");
                return -1;
            }
        }
        int64_t n;
#define INT_FLAG(flag, lo, hi, dst)                  \
    if (strcmp(f, flag) == 0) {                      \
        if (parse_int(flag, v, lo, hi, &n)) return -1; \
        dst = n;                                     \
        continue;                                    \
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
        if (strcmp(f, "--help") == 0) {
            command_usage(cmd, stdout);
            return 1;
        } else if (strcmp(f, "--model") == 0) {
            if (!comet_model_find(v)) {
                fprintf(stderr, "comet: unknown model '%s'%s (presets:", v, model_suggestion(v, hint, sizeof hint));
                for (int m = 0; m < comet_num_models; m++) fprintf(stderr, "%s %s", m ? "," : "", comet_models[m].name);
                fprintf(stderr, ")\n");
                return -1;
            }
            o->model = v;
        } else if (strcmp(f, "--activation") == 0) {
            const int a = parse_choice(f, v, activations, 2);
            if (a < 0) return -1;
            o->activation = a == 1 ? COMET_ACT_GELU : COMET_ACT_SILU_GATED;
        } else if (strcmp(f, "--skew") == 0) {
            char *end;
            o->skew = strtod(v, &end);
            if (end == v || *end || !(o->skew >= 0 && o->skew <= 10)) { /* '', nan, inf */
                fprintf(stderr, "comet: --skew needs a number in [0, 10], got '%s'\n", v);
                return -1;
            }
        } else if (strcmp(f, "--comm-hidden") == 0) {
            o->hidden_metric = 1;
        } else if (strcmp(f, "--graph") == 0) {
            o->graph = 1;
        } else if (strcmp(f, "--train") == 0) {
            o->train = 1;
        } else if (strcmp(f, "--recompute") == 0) {
            o->recompute = 1;
        } else if (strcmp(f, "--grad-check") == 0) {
            o->grad_check = 1;
        } else if (strcmp(f, "--back-to-back") == 0) {
            o->back_to_back = 1;
        } else if (strcmp(f, "--json") == 0) {
            o->json = v;
        } else if (strcmp(f, "--out") == 0) {
            o->out = v;
        } else if (strcmp(f, "--trace") == 0) {
            if (trace_names(v, o->trace_json, o->trace_svg)) return -1;
            o->trace = v;
        } else if (strcmp(f, "--backend") == 0) {
            const int b = parse_choice(f, v, backends, 3);
            if (b < 0) return -1;
            o->backend = backends[b];
        }
    }
    return 0;
}

/* A file a flag writes (--json, --trace, tune's table): refused before
 * anything runs where it could not be written: an empty name, a directory,
 * a file without write permission, a directory that does not exist or
 * does not let a file be made in it. Returns 0, or -1 (printed). */
static int check_writable(const char *flag, const char *path) {
    struct stat st;
    const char *sep = flag[0] == '-' ? " " : "="; /* --json FILE, COMET_TUNE_FILE=FILE */
    if (!*path) {
        fprintf(stderr, "comet: %s needs a file name, got ''\n", flag);
        return -1;
    }
    if (stat(path, &st) == 0) {
        if (S_ISDIR(st.st_mode)) {
            fprintf(stderr, "comet: %s%s%s: is a directory, not a file\n", flag, sep, path);
            return -1;
        }
        if (access(path, W_OK) != 0) {
            fprintf(stderr, "comet: %s%s%s: cannot write to it (%s)\n", flag, sep, path, strerror(errno));
            return -1;
        }
        return 0;
    }
    if (errno != ENOENT && errno != ENOTDIR) { /* EACCES, ELOOP, ... (ENOTDIR: the directory's check says) */
        fprintf(stderr, "comet: %s%s%s: %s\n", flag, sep, path, strerror(errno));
        return -1;
    }
    char *dir = strdup(path);
    if (!dir) return 0; /* the write itself will say */
    char *slash = strrchr(dir, '/');
    const char *d = !slash ? "." : slash == dir ? "/" : (*slash = 0, dir);
    int rc = 0;
    if (stat(d, &st) != 0) {
        if (errno == ENOENT)
            fprintf(stderr, "comet: %s%s%s: the directory %s does not exist\n", flag, sep, path, d);
        else
            fprintf(stderr, "comet: %s%s%s: the directory %s: %s\n", flag, sep, path, d, strerror(errno));
        rc = -1;
    } else if (!S_ISDIR(st.st_mode)) {
        fprintf(stderr, "comet: %s%s%s: %s is not a directory\n", flag, sep, path, d);
        rc = -1;
    } else if (access(d, W_OK | X_OK) != 0) {
        fprintf(stderr, "comet: %s%s%s: cannot create a file in %s (%s)\n", flag, sep, path, d, strerror(errno));
        rc = -1;
    }
    free(dir);
    return rc;
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
        char hint[96];
        if (cmd[0] == '-') /* a flag where the command goes: "comet --tokens 64" */
            fprintf(stderr, "comet: '%s' is not a command; the command comes first (comet bench %s ...)\n", cmd, cmd);
        else
            fprintf(stderr, "comet: unknown command '%s'%s\n", cmd,
                    suggestion(cmd, commands, (int)(sizeof commands / sizeof commands[0]), hint, sizeof hint));
        cli_usage(stderr);
        return -1;
    }
    const int pr = parse_flags(cmd, argc, argv, o);
    if (pr) return pr;
    if (o->command == CLI_TUNE && !o->out) { /* where the library reads a table by default, else here */
        const char *env = getenv("COMET_TUNE_FILE");
        o->out = env && *env ? env : "comet-tune.tsv";
    }
    /* the files the run writes, checked before it runs (the JSON row: rank 0's; the trace: every rank's) */
    if ((o->json && cli_speaks(&o->launch) && check_writable("--json", o->json)) ||
        (o->trace && (check_writable("--trace", o->trace_json) || check_writable("--trace", o->trace_svg))) ||
        (o->out && check_writable(getenv("COMET_TUNE_FILE") && o->out == getenv("COMET_TUNE_FILE")
                                      ? "COMET_TUNE_FILE" : "--out", o->out)))
        return -1;
    return 0;
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
    /* a size other than the (scaled) preset's: a custom model, labelled with the sizes that moved */
    const int64_t got[4] = {cfg->hidden, cfg->ffn, cfg->num_experts, cfg->topk};
    const int64_t preset[4] = {m->hidden / scale, m->ffn / scale, m->num_experts, m->topk};
    static const char *const size_names[4] = {"hidden", "ffn", "experts", "topk"};
    char moved[160] = "";
    for (int k = 0; k < 4; k++)
        if (got[k] != preset[k]) {
            const size_t at = strlen(moved);
            snprintf(moved + at, sizeof moved - at, ", %s %lld", size_names[k], (long long)got[k]);
        }
    r->custom = moved[0] != 0;
    if (r->custom)
        snprintf(r->model_label, sizeof r->model_label, "custom (%s%s)", o->model, moved);
    else
        snprintf(r->model_label, sizeof r->model_label, "%s", o->model);
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
    if (cli_speaks(launch)) { /* flags this run ignores */
        if (!use_cuda && o->n_comm == COMET_SEQUENTIAL && !tune)
            cli_warn("--n-comm -1 (the sequential chain) is for GPUs: the CPU engine always overlaps, with the "
                     "tuner's workers");
        if (tune && (o->n_comm || o->chunk_cols))
            cli_warn("--n-comm and --chunk ignored: comet tune times its own grid of them");
        if (o->command == CLI_CHECK && (o->iters >= 0 || o->warmup >= 0))
            cli_warn("--iters and --warmup ignored: comet check runs one forward");
        if (o->scale && o->hidden && o->ffn)
            cli_warn("--scale %d ignored: --hidden and --ffn set the layer's sizes", o->scale);
    }
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
    if (o->recompute && !o->train) {
        fprintf(stderr, "comet: --recompute is a variant of --train (add --train)\n");
        return -1;
    }
    if (o->grad_check && !o->train) {
        fprintf(stderr, "comet: --grad-check is a variant of --train (add --train)\n");
        return -1;
    }
    if (o->back_to_back && !o->train) {
        fprintf(stderr, "comet: --back-to-back is a variant of --train (add --train)\n");
        return -1;
    }
    if (o->back_to_back && o->hidden_metric) {
        fprintf(stderr, "comet: --back-to-back and --comm-hidden do not go together (the sides are timed step by step)\n");
        return -1;
    }
    if (o->train && cli_speaks(launch)) {
        if (o->graph) cli_warn("--graph ignored with --train: the steps are launched call by call");
    }
    if (o->graph && launch->on) {
        fprintf(stderr, "comet: --graph needs every rank in this process (not a launch of one process per rank)\n");
        return -1;
    }
    return 0;
}
