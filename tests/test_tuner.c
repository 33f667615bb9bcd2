/*
 * test_tuner.c - the knobs of a forward call: the analytical rule (the CUDA
 * rule's mode at its boundaries: world, layout, tokens a rank, topk x
 * hidden, an expert's W1 slice, push), the measured table (load, lookup by configuration and nearest token count,
 * malformed lines skipped, backends kept apart, chunk width independent of the
 * rank's token count), and append -> load round trips; values out of range,
 * over-long lines and files that are no table (devices, FIFOs, over 1 MiB).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../src/core/validate.h"
#include "../src/tuner/tuner.h"
#include "check.h"

/* TP x EP ranks, 8 experts of ffn columns; GELU: W1 holds F_local rows an expert, not 2 x F_local */
static comet_dims_t dims_act(int64_t hidden, int64_t ffn, int64_t max_tokens, int64_t topk, int tp, int ep,
                             comet_activation_t act) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = hidden, cfg.ffn = ffn, cfg.num_experts = 8, cfg.topk = topk, cfg.tp = tp, cfg.ep = ep;
    cfg.activation = act;
    cfg.max_tokens_per_rank = max_tokens;
    comet_dims_t d;
    comet_dims_from_config(&cfg, tp * ep, 0, &d);
    return d;
}

static comet_dims_t dims_ffn(int64_t hidden, int64_t ffn, int64_t max_tokens, int64_t topk, int tp, int ep) {
    return dims_act(hidden, ffn, max_tokens, topk, tp, ep, COMET_ACT_SILU_GATED);
}

static comet_dims_t dims_gelu(int64_t hidden, int64_t ffn, int64_t max_tokens, int tp, int ep) {
    return dims_act(hidden, ffn, max_tokens, 2, tp, ep, COMET_ACT_GELU);
}

static comet_dims_t dims_of(int64_t hidden, int64_t max_tokens, int64_t topk, int tp, int ep) {
    return dims_ffn(hidden, 1024, max_tokens, topk, tp, ep);
}

static comet_dims_t dims(int64_t hidden, int64_t max_tokens) { return dims_of(hidden, max_tokens, 2, 1, 2); }

/* The table the checks below pick from (one per world in the library). */
static comet_tune_table_t *table;

static int load(const char *path) {
    comet_tune_table_free(table);
    return comet_tune_table_load(path, &table);
}

/* comet_tuner_choose with the fields of t (n_comm, chunk_cols: the call's;
 * push: the layer's combine) in and the protocol's out. */
static void pick(const comet_dims_t *d, comet_backend_t backend, int64_t tokens, comet_tuning_t *t) {
    comet_protocol_t p = COMET_PROTOCOL_INIT;
    p.gemm = backend == COMET_BACKEND_CUDA ? COMET_GEMM_HOPPER : COMET_GEMM_CPU;
    p.combine = backend != COMET_BACKEND_CUDA ? COMET_COMBINE_PARTIALS : t->push ? COMET_COMBINE_PUSH : COMET_COMBINE_PULL;
    comet_tuner_choose(table, d, backend, tokens, t->n_comm, t->chunk_cols, &p);
    t->n_comm = p.n_comm;
    if (backend != COMET_BACKEND_CUDA) t->chunk_cols = p.chunk_cols;
}

int main(void) {
    /* rule */
    comet_dims_t d = dims(4096, 4096);
    comet_tuning_t t = {0, 0, 0};
    comet_tuner_rule(&d, COMET_BACKEND_CPU, 4096, &t);
    CHECK(t.chunk_cols == 512 && t.n_comm == 2, "rule at hidden 4096: %d %d", t.chunk_cols, t.n_comm);
    const struct {
        comet_dims_t d;
        int push, n_comm;
        const char *what;
    } cuda_cases[] = {
        {dims(4096, 4096), 1, 16, "EP2, 4096 tokens a rank, topk x hidden 8192"},
        {dims_of(4096, 4096, 2, 2, 1), 1, 16, "TP2"},
        {dims_of(8192, 4096, 2, 1, 2), 1, 16, "topk x hidden 16384"},
        {dims_of(8200, 4096, 2, 1, 2), 1, 0, "topk x hidden 16400"},
        {dims_of(7168, 4096, 8, 1, 2), 1, 0, "topk 8 x hidden 7168 (DeepSeek-V3-style)"},
        {dims(4096, 4095), 1, 0, "4095 tokens a rank"},
        {dims_of(4096, 4096, 2, 1, 1), 1, 0, "one rank"},
        {dims_of(4096, 4096, 2, 2, 2), 1, 16, "four ranks, TP2 x EP2"},
        {dims_of(4096, 4096, 2, 1, 4), 1, 16, "four ranks, EP4"},
        {dims_of(7168, 4096, 8, 1, 4), 1, 0, "four ranks, DeepSeek-V3-style"},
        {dims_of(4096, 4096, 2, 2, 4), 1, 16, "eight ranks (not measured; the rule of 2 and 4)"},
        {dims(4096, 4096), 0, 0, "without push (COMET_PUSH=0 or partials: not measured faster)"},
        {dims_ffn(4096, 14336, 4096, 2, 1, 2), 1, 0, "Mixtral EP2: W1 slice above 128 MiB"},
        {dims_ffn(4096, 14336, 4096, 2, 2, 1), 1, 16, "Mixtral TP2: F_local 7168"},
        {dims_ffn(4096, 6400, 4096, 2, 1, 2), 1, 16, "Phi-3.5 EP2: F_local 6400"},
        {dims_ffn(4096, 8192, 4096, 2, 1, 2), 1, 16, "W1 slice 128 MiB (gated: F_local x hidden 2^25)"},
        {dims_ffn(4096, 8200, 4096, 2, 1, 2), 1, 0, "F_local 8200 x hidden 4096"},
        {dims_gelu(4096, 16384, 4096, 1, 2), 1, 16, "GELU: W1 slice 16384 x 4096, 128 MiB"},
        {dims_gelu(4096, 16392, 4096, 1, 2), 1, 0, "GELU: W1 slice 16392 x 4096"},
    };
    for (size_t i = 0; i < sizeof cuda_cases / sizeof cuda_cases[0]; i++) {
        t = (comet_tuning_t){0, 0, cuda_cases[i].push};
        comet_tuner_rule(&cuda_cases[i].d, COMET_BACKEND_CUDA, 4096, &t);
        CHECK(t.n_comm == cuda_cases[i].n_comm, "CUDA rule, %s: n_comm %d, not %d", cuda_cases[i].what,
              cuda_cases[i].n_comm, t.n_comm);
    }
    t = (comet_tuning_t){0, 0, 1};
    comet_tuner_rule(&d, COMET_BACKEND_CUDA, 10, &t);
    CHECK(t.n_comm == 16 && t.chunk_cols == 512, "CUDA rule: by max_tokens, not this rank's 10 tokens: %d %d",
          t.n_comm, t.chunk_cols);
    t = (comet_tuning_t){5, 0, 1};
    comet_tuner_rule(&d, COMET_BACKEND_CUDA, 4096, &t);
    CHECK(t.n_comm == 5, "CUDA rule: an explicit n_comm is kept: %d", t.n_comm);
    comet_dims_t small = dims(20, 8);
    t = (comet_tuning_t){0, 0, 0};
    comet_tuner_rule(&small, COMET_BACKEND_CPU, 3, &t);
    CHECK(t.chunk_cols == 8 && t.n_comm == 1, "rule at hidden 20, 3 tokens: %d %d", t.chunk_cols, t.n_comm);
    t = (comet_tuning_t){5, 24, 0};
    comet_tuner_rule(&d, COMET_BACKEND_CPU, 4096, &t);
    CHECK(t.n_comm == 5 && t.chunk_cols == 24, "set fields are kept");

    /* table */
    char path[] = "/tmp/comet-tune-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    FILE *f = fdopen(fd, "w");
    fprintf(f, "backend\thidden\tffn\texperts\ttopk\ttp\tep\ttokens\tn_comm\tchunk_cols\tms\n"
               "cpu\t4096\t1024\t8\t2\t1\t2\t1000\t3\t256\t1.0\n"
               "cpu\t4096\t1024\t8\t2\t1\t2\t4000\t7\t1024\t1.0\n"
               "cuda\t4096\t1024\t8\t2\t1\t2\t4096\t20\t768\t1.0\n"
               "cuda\t2048\t1024\t8\t2\t1\t2\t4096\t0\t256\t1.0\n"
               "cpu\t2048\t1024\t8\t2\t1\t2\t4096\t0\t256\t1.0\n"
               "cpu\t4096\tnot-a-number\n"
               "gpu\t4096\t1024\t8\t2\t1\t2\t4096\t20\t768\t1.0\n");
    fclose(f);
    CHECK(load(path) == 4, "four good lines (n_comm 0: CUDA only)");
    t = (comet_tuning_t){0, 0, 0};
    pick(&d, COMET_BACKEND_CPU, 900, &t);
    CHECK(t.n_comm == 3, "n_comm from the entry nearest 900 tokens: %d", t.n_comm);
    CHECK(t.chunk_cols == 1024, "chunk from the entry nearest max_tokens 4096: %d", t.chunk_cols);
    comet_tuning_t u = {0, 0, 0};
    pick(&d, COMET_BACKEND_CPU, 3900, &u);
    CHECK(u.n_comm == 7 && u.chunk_cols == t.chunk_cols, "other token count: n_comm %d, same chunk %d", u.n_comm,
          u.chunk_cols);
    t = (comet_tuning_t){0, 0, 0};
    pick(&d, COMET_BACKEND_CUDA, 4096, &t);
    CHECK(t.n_comm == 20, "the CUDA entry for the CUDA backend: %d", t.n_comm);
    t = (comet_tuning_t){0, 0, 0};
    pick(&d, COMET_BACKEND_CUDA, 10, &t);
    CHECK(t.n_comm == 20, "CUDA: n_comm from the entry nearest max_tokens, not this rank's 10 tokens: %d", t.n_comm);
    comet_dims_t seq = dims(2048, 4096);
    t = (comet_tuning_t){0, 0, 1}; /* with push: the rule alone would overlap */
    pick(&seq, COMET_BACKEND_CUDA, 4096, &t);
    CHECK(t.n_comm == 0, "a CUDA entry recording the sequential chain, kept where the rule would overlap: %d",
          t.n_comm);
    comet_dims_t other = dims(2048, 4096);
    t = (comet_tuning_t){0, 0, 0};
    pick(&other, COMET_BACKEND_CPU, 4096, &t);
    CHECK(t.chunk_cols == 256 && t.n_comm == 2, "a configuration not in the table gets the rule: %d %d", t.chunk_cols,
          t.n_comm);
    comet_dims_t cuda_other = dims_of(2048, 4096, 2, 2, 1);
    t = (comet_tuning_t){0, 0, 1};
    pick(&cuda_other, COMET_BACKEND_CUDA, 4096, &t);
    CHECK(t.n_comm == 16, "a CUDA configuration not in the table gets the rule: %d", t.n_comm);
    /* where the rule would overlap, COMET_SEQUENTIAL and the SIMT GEMM keep the sequential chain */
    comet_protocol_t seqp = COMET_PROTOCOL_INIT;
    seqp.gemm = COMET_GEMM_HOPPER, seqp.combine = COMET_COMBINE_PUSH;
    comet_tuner_choose(table, &cuda_other, COMET_BACKEND_CUDA, 4096, COMET_SEQUENTIAL, 0, &seqp);
    CHECK(seqp.mode == COMET_MODE_SEQUENTIAL && seqp.n_comm == 0 && seqp.chosen_by == COMET_CHOSEN_BY_ARGS,
          "COMET_SEQUENTIAL where the rule overlaps: mode %d, n_comm %d, chosen by %d", (int)seqp.mode, seqp.n_comm,
          (int)seqp.chosen_by);
    seqp = (comet_protocol_t)COMET_PROTOCOL_INIT;
    seqp.gemm = COMET_GEMM_SIMT, seqp.combine = COMET_COMBINE_PUSH;
    comet_tuner_choose(table, &cuda_other, COMET_BACKEND_CUDA, 4096, 0, 0, &seqp);
    CHECK(seqp.mode == COMET_MODE_SEQUENTIAL && seqp.n_comm == 0 && seqp.chosen_by == COMET_CHOSEN_BY_RULE,
          "the SIMT GEMM where the rule overlaps: mode %d, n_comm %d, chosen by %d", (int)seqp.mode, seqp.n_comm,
          (int)seqp.chosen_by);

    /* append -> load */
    unlink(path);
    comet_tuning_t w = {4, 64, 0};
    CHECK(comet_tuner_append(path, &other, COMET_BACKEND_CPU, 4096, &w, 2.5) == 0, "append");
    CHECK(comet_tuner_append(path, &d, COMET_BACKEND_CPU, 4096, &w, 2.5) == 0, "append again");
    CHECK(load(path) == 2, "both appended entries load (one header)");
    t = (comet_tuning_t){0, 0, 0};
    pick(&other, COMET_BACKEND_CPU, 4096, &t);
    CHECK(t.n_comm == 4 && t.chunk_cols == 64, "round trip: %d %d", t.n_comm, t.chunk_cols);
    comet_tuning_t again = {6, 128, 0}; /* a re-tune of the same configuration: the later line wins */
    CHECK(comet_tuner_append(path, &other, COMET_BACKEND_CPU, 4096, &again, 2.0) == 0, "append a re-tune");
    CHECK(load(path) == 3, "three entries");
    t = (comet_tuning_t){0, 0, 0};
    pick(&other, COMET_BACKEND_CPU, 4096, &t);
    CHECK(t.n_comm == 6 && t.chunk_cols == 128, "the re-tune wins: %d %d", t.n_comm, t.chunk_cols);
    unlink(path);
    CHECK(load("/nonexistent/dir/table.tsv") == -1, "missing file");

    /* values out of range are skipped like any malformed line */
    f = fopen(path, "w");
    fprintf(f, "backend\thidden\tffn\texperts\ttopk\ttp\tep\ttokens\tn_comm\tchunk_cols\tms\n"
               "cpu\t4096\t1024\t8\t2\t1\t2\t1000\t3\t256\t1.0\n"            /* the one good line */
               "cpu\t4096\t1024\t8\t2\t1\t2\t1000\t3\t4294967295\t1.0\n"     /* chunk_cols wraps to -1 */
               "cpu\t4096\t1024\t8\t2\t1\t2\t1000\t4294967295\t256\t1.0\n"   /* n_comm wraps to -1 */
               "cuda\t4096\t1024\t8\t2\t1\t2\t1000\t4294967298\t256\t1.0\n"  /* n_comm wraps to 2 */
               "cpu\t4096\t1024\t8\t2\t1\t2\t1000\t65\t256\t1.0\n"           /* above the CPU engine's 64 */
               "cpu\t4096\t1024\t8\t2\t1\t2\t1000\t3\t5000\t1.0\n"           /* chunk wider than hidden */
               "cpu\t1099511627776\t1024\t8\t2\t1\t2\t1000\t3\t256\t1.0\n"   /* hidden 2^40 */
               "cpu\t4096\t1024\t8\t9\t1\t2\t1000\t3\t256\t1.0\n"            /* topk > experts */
               "cpu\t4096\t1024\t8\t2\t0\t2\t1000\t3\t256\t1.0\n"            /* tp 0 */
               "cpu\t4096\t1024\t8\t2\t1\t4294967298\t1000\t3\t256\t1.0\n"   /* ep wraps to 2 */
               "cpu\t4096\t1024\t8\t2\t1\t2\t99999999999999999999\t3\t256\t1.0\n" /* tokens overflow */
               "cpu\t4096\t1024\t8\t2\t1\t2\t1000\t3\t256\tnan\n");          /* ms not a number */
    fclose(f);
    CHECK(load(path) == 1, "out-of-range values skipped: %d entries", load(path));
    t = (comet_tuning_t){0, 0, 0};
    pick(&d, COMET_BACKEND_CPU, 1000, &t);
    CHECK(t.n_comm == 3 && t.chunk_cols == 256, "the good line: %d %d", t.n_comm, t.chunk_cols);

    /* a line longer than the loader reads is skipped whole, not read as two */
    f = fopen(path, "w");
    for (int i = 0; i < 511; i++) fputc('#', f);
    fprintf(f, "cpu\t4096\t1024\t8\t2\t1\t2\t1000\t3\t256\t1.0\n");
    fclose(f);
    CHECK(load(path) == 0, "over-long line: %d entries", load(path));

    /* files that are not a table are refused at once: no endless read, no
     * blocking open (alarm: a hang fails the test) */
    alarm(20);
    CHECK(load("/dev/zero") == -1, "/dev/zero");
    CHECK(load("/tmp") == -1, "a directory");
    char fifo[] = "/tmp/comet-tune-fifo-XXXXXX";
    int ffd = mkstemp(fifo);
    if (ffd >= 0) close(ffd), unlink(fifo);
    CHECK(ffd >= 0 && mkfifo(fifo, 0600) == 0, "mkfifo");
    CHECK(load(fifo) == -1, "a FIFO");
    unlink(fifo);
    f = fopen(path, "w"); /* over 1 MiB */
    fprintf(f, "cpu\t4096\t1024\t8\t2\t1\t2\t1000\t3\t256\t1.0\n");
    for (int i = 0; i < (1 << 20) / 64 + 1; i++) fprintf(f, "# %061d\n", i);
    fclose(f);
    CHECK(load(path) == -1, "a table over 1 MiB");
    alarm(0);
    unlink(path);
    CHECK(load(NULL) == 0, "clear");
    comet_tune_table_free(table);
    return check_summary("test_tuner");
}
