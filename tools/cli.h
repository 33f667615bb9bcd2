/*
 * tools/cli.h - the command-line tool's parts, over one result struct:
 * parse.c turns the command line and the torchrun environment into
 * cli_options_t and checks it against the machine and the files the run
 * will write (every argument error exits 2 there, before anything is
 * allocated; a flag the run ignores is a warning); run.c runs a bench or
 * check and fills a cli_result_t with what it produced, and runs `comet
 * tune`'s grid; report.c prints the warnings, a result's console lines and
 * appends its JSON row; comet.c's main() dispatches. The CLI uses the public API (include/comet.h)
 * and the harness (the headers of harness/) only.
 */
#ifndef COMET_CLI_H
#define COMET_CLI_H

#include <stdint.h>
#include <stdio.h>

#include "comet.h"
#include "../harness/gpu_watch.h"
#include "../harness/workload.h"

#define CLI_TRACE_PATH_MAX ((size_t)4096) /* each of --trace's two file names, with the NUL */
#define CLI_MAX_RANKS 64                  /* the runner's and the CPU engine's most ranks */

typedef enum { CLI_BENCH, CLI_CHECK, CLI_TUNE } cli_command_t;

/* torchrun-style launch: one process per rank, from RANK, WORLD_SIZE,
 * LOCAL_RANK (the GPU), MASTER_ADDR and MASTER_PORT. The processes exchange
 * the NCCL id (and, at the end, their results) over a TCP channel on
 * COMET_BOOTSTRAP_PORT, by default MASTER_PORT + 1 (torchrun's own store holds
 * MASTER_PORT). on = 0: one process runs every rank. */
typedef struct {
    int on, rank, size, local_rank, port;
    const char *addr;
} cli_launch_t;

/* The command and its flags (cli_configure fills in iters and warmup). */
typedef struct {
    cli_command_t command;
    cli_launch_t launch;
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
    char trace_json[CLI_TRACE_PATH_MAX]; /* --trace's two files: x.svg or x.json gives x.json and x.svg, */
    char trace_svg[CLI_TRACE_PATH_MAX];  /* another FILE gives FILE (JSON) and FILE.svg */
    const char *out; /* tune: --out, else $COMET_TUNE_FILE, else comet-tune.tsv (cli_parse) */
    int hidden_metric; /* --comm-hidden: also time the gemm-only and comm-only runs */
    int graph;         /* --graph: replay one captured forward (GPUs, one process) */
    int train;         /* --train: time training steps (forward saving activations, then backward) */
    int recompute;     /* --recompute (with --train): the forward saves nothing, the backward recomputes */
    int grad_check;    /* --grad-check (with --train): check the gradients on GPUs whatever the weights' size */
    int back_to_back;  /* --back-to-back (with --train): the timed steps enqueued back to back (GPUs) */
} cli_options_t;

/* Everything one bench or check run produced. In a launched world rank 0
 * holds every rank's timings and check (the slowest times, the counts
 * summed); the other ranks, which print nothing, fill in their own up to
 * `wrong` and no figures. */
typedef struct {
    cli_options_t opt;
    /* the configuration (cli_configure) */
    comet_layer_config_t cfg;
    int world;                       /* ranks: TP * EP */
    int use_cuda;                    /* the CUDA backend, else the CPU engine */
    int gpus;                        /* the GPUs this process sees */
    int scale;                       /* the model's hidden and ffn divided by it */
    int custom;                      /* --hidden, --ffn, --experts or --topk moved a size off the preset's */
    char model_label[192];           /* the row's model: the preset, or "custom (mixtral-8x7b, hidden 1024)" */
    int64_t tokens[CLI_MAX_RANKS];   /* each rank's */
    int64_t total_tokens;            /* M: over all ranks */
    /* the timed forwards (cli_run; comet_run_t's) */
    double ms;                       /* median of the slowest rank's calls */
    double side_ms[4];               /* --comm-hidden: gemm only, comm only, whole, neither */
    comet_protocol_t protocol;       /* what rank 0's last forward ran (--train: its last backward) */
    comet_protocol_t fwd_protocol;   /* --train: what rank 0's last training forward ran */
    comet_memory_t memory;           /* what rank 0's layer held */
    int graph, input_sets;           /* as the run had them */
    int64_t replays, captures;       /* CUDA: rank 0's forwards replayed as one graph, its captures */
    gpu_watch_t watch;               /* the GPUs' clocks over the timed forwards (n = 0: not watched) */
    /* the check against the reference */
    comet_check_t check;
    int64_t wrong;                   /* CPU: elements not bitwise equal; GPUs: sampled elements off */
    /* figures */
    int n_comm;                      /* CUDA: the protocol's (0: the sequential chain); CPU: --n-comm */
    double rate;                     /* TFLOP/s a GPU (CUDA), GFLOP/s (CPU) */
    double link_gbps;                /* bytes between ranks a GPU per second (comet_problem_link_bytes) */
    int sides_differ;                /* the sides left parts out (not the SIMT GEMM, which runs whole) */
    double comm_hidden, comm_hidden_net; /* -1: not measured */
    /* --train: ms is the step's (forward + backward), rate the step's (3x the forward's FLOPs) */
    double fwd_ms, bwd_ms;           /* medians of the slowest rank's forward and backward */
    double host_ms;                  /* --back-to-back: the host's time to enqueue a step, slowest rank (0: not measured) */
    size_t saved_bytes;              /* the saved state a layer of rank 0 asks for (comet_layer_saved_bytes) */
    struct comet_train_check grad;   /* the gradients against the reference on the sampled tokens */
    int64_t grad_wrong;              /* CPU: gradient elements not bitwise equal; GPUs: off the tolerance */
    int64_t grad_checked;            /* gradient elements checked (over the ranks) */
} cli_result_t;

/* Printing is rank 0's job in a launched world. */
static inline int cli_speaks(const cli_launch_t *l) { return !l->on || l->rank == 0; }

/* parse.c. The tool's usage (`comet help`). */
void cli_usage(FILE *f);
/* Read the launch from the environment, the command cmd and its flags argv
 * into *o. Returns 0, 1 if help was printed, -1 on an error (printed). */
int cli_parse(const char *cmd, int argc, char **argv, cli_options_t *o);
/* Fill in r->opt's defaults (they depend on the backend), build the config
 * and check it: r->cfg, world, use_cuda, gpus, scale, tokens. Returns 0, or
 * -1 on an error (printed). */
int cli_configure(cli_result_t *r);

/* run.c. Run a bench or check of r's configuration into *r: 0, else the
 * exit status (1, or 2 for a problem that cannot be made), the error printed. */
int cli_run(cli_result_t *r);
/* comet tune: the grid of knobs, the curve, the best appended to the table.
 * Returns the exit status. */
int cli_tune(const cli_result_t *r);

/* report.c. "comet: warning: ..." on stderr, where a flag is ignored or
 * clamped (the run goes on). */
void cli_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* The backend and the model's scale, before anything runs. */
void cli_report_setup(const cli_result_t *r);
/* The warnings of the protocol the run reported (--n-comm clamped or not run,
 * --chunk ignored), the result's console lines, then its JSON row (--json).
 * Returns 0, or 1 if the row could not be appended. */
int cli_report(const cli_result_t *r);

#endif /* COMET_CLI_H */
