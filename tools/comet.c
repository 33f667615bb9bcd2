/*
 * comet.c - the command-line tool's main(): it dispatches the commands.
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
 * process is one rank on GPU LOCAL_RANK, and rank 0 prints for all. Exit
 * status: 0; 1 when a run failed or its check found elements off; 2 for a
 * command line refused before anything runs (an unknown flag, model or
 * command with "did you mean", a missing or bad value, an output file that
 * could not be written) or a problem that cannot be made. A flag the run
 * ignores or clamps is a warning ("comet: warning: ..."), not an error. The
 * parts (tools/cli.h): parse.c the command line, run.c the runs, report.c
 * their output.
 */
#include <stdio.h>
#include <string.h>

#include "cli.h"

int main(int argc, char **argv) {
    if (argc < 2) {
        cli_usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
        cli_usage(stdout);
        return 0;
    }
    if (strcmp(cmd, "--version") == 0) {
        printf("comet %d.%d.%d\n", COMET_VERSION_MAJOR, COMET_VERSION_MINOR, COMET_VERSION_PATCH);
        return 0;
    }
    cli_result_t r;
    memset(&r, 0, sizeof r);
    const int pr = cli_parse(cmd, argc - 2, argv + 2, &r.opt);
    if (pr) return pr > 0 ? 0 : 2;
    if (cli_configure(&r)) return 2;
    cli_report_setup(&r);
    if (r.opt.command == CLI_TUNE) return cli_tune(&r);
    const int rc = cli_run(&r);
    if (rc) return rc;
    if (cli_speaks(&r.opt.launch) && cli_report(&r)) return 1;
    return r.wrong || r.grad_wrong ? 1 : 0;
}
