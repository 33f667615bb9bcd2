/*
 * tuner.c - the measured table and the analytical rule behind
 * comet_tuner_choose (see tuner.h).
 *
 * Rule: chunk_cols about hidden/8, a multiple of 8 columns, so the
 * reduce-and-send of chunk c overlaps the GEMM of chunk c+1 while each chunk
 * stays wide enough to amortise its flag; n_comm on the CPU engine 2 unless
 * the call is tiny; on the CUDA backend the overlapped mode with 16 CTAs
 * where it measured faster: 2 or more ranks with push, at least 4096 tokens
 * a rank, topk x hidden at most 16384, an expert's W1 slice (w1_rows x
 * hidden bf16; gated: 2 x F_local x hidden) at most 128 MiB (the
 * overlapped mode walks GEMM0 local first, which reads every expert's W1
 * once a stage, where the sequential chain walks expert order and reads it
 * about once; for larger slices that costs more than the dispatch it
 * hides). Else the sequential chain. The measurements behind each bound are
 * in docs/decisions.md.
 */
#include "tuner.h"

#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../core/validate.h"

typedef struct {
    int backend;
    int64_t hidden, ffn, experts, topk, tp, ep, tokens;
    comet_tuning_t t;
} entry_t;

struct comet_tune_table {
    entry_t *entries;
    int len;
};

#define TABLE_MAX_BYTES (1 << 20)  /* larger files are not tables */
#define TABLE_MAX_CUDA_N_COMM 1024  /* the CUDA backend caps n_comm at SMs - 1 anyway */

/* The values of one line (hidden ffn experts topk tp ep tokens n_comm
 * chunk_cols) and its ms are what a valid config and knobs give. */
static int entry_in_range(int cuda, const long long v[9], double ms) {
    for (int i = 0; i < 4; i++)
        if (v[i] < 1 || v[i] > INT32_MAX) return 0;
    if (v[3] > v[2] || v[4] < 1 || v[4] > COMET_MAX_RANKS || v[5] < 1 || v[5] > COMET_MAX_RANKS ||
        v[4] * v[5] > COMET_MAX_RANKS)
        return 0;
    if (v[6] < 0 || v[6] > INT32_MAX) return 0;
    if (v[7] < (cuda ? 0 : 1) || v[7] > (cuda ? TABLE_MAX_CUDA_N_COMM : COMET_CPU_MAX_N_COMM)) return 0;
    return v[8] >= 1 && v[8] <= v[0] && isfinite(ms) && ms >= 0;
}

/* path opened for reading if it is a regular file of at most TABLE_MAX_BYTES
 * (no blocking open of a FIFO, no endless read of a device), else NULL. */
static FILE *open_table(const char *path) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return NULL;
    struct stat st;
    FILE *f = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size <= TABLE_MAX_BYTES ? fdopen(fd, "r") : NULL;
    if (!f) close(fd);
    return f;
}

void comet_tune_table_free(comet_tune_table_t *table) {
    if (!table) return;
    free(table->entries);
    free(table);
}

int comet_tune_table_load(const char *path, comet_tune_table_t **out) {
    comet_tune_table_t *tab = calloc(1, sizeof *tab);
    *out = tab;
    if (!tab || !path || !*path) return 0;
    FILE *f = open_table(path);
    if (!f) return -1;
    int cap = 0;
    char line[512], backend[16];
    long total = 0;
    while (fgets(line, sizeof line, f) && (total += (long)strlen(line)) <= TABLE_MAX_BYTES) {
        entry_t e;
        long long v[9];
        double ms;
        if (!strchr(line, '\n') && !feof(f)) { /* longer than any table line: skip it whole */
            int c;
            while ((c = fgetc(f)) != EOF && c != '\n') total++;
            continue;
        }
        if (sscanf(line, "%15s %lld %lld %lld %lld %lld %lld %lld %lld %lld %lf", backend, &v[0], &v[1], &v[2],
                   &v[3], &v[4], &v[5], &v[6], &v[7], &v[8], &ms) != 11)
            continue; /* the header, or a malformed line */
        if (strcmp(backend, "cpu") != 0 && strcmp(backend, "cuda") != 0) continue;
        const int cuda = strcmp(backend, "cuda") == 0; /* n_comm 0 there: the sequential chain */
        if (!entry_in_range(cuda, v, ms)) continue;
        e.backend = cuda ? COMET_BACKEND_CUDA : COMET_BACKEND_CPU;
        e.hidden = v[0], e.ffn = v[1], e.experts = v[2], e.topk = v[3], e.tp = v[4], e.ep = v[5], e.tokens = v[6];
        e.t.n_comm = (int)v[7], e.t.chunk_cols = (int)v[8], e.t.push = 0;
        if (tab->len == cap) {
            cap = cap ? 2 * cap : 16;
            entry_t *grown = realloc(tab->entries, sizeof(entry_t) * (size_t)cap);
            if (!grown) break;
            tab->entries = grown;
        }
        tab->entries[tab->len++] = e;
    }
    fclose(f);
    return tab->len;
}

/* The entry for this configuration with the token count nearest `tokens`. */
static int lookup(const comet_tune_table_t *tab, const comet_dims_t *d, comet_backend_t backend, int64_t tokens,
                  comet_tuning_t *out) {
    int found = 0;
    int64_t best = 0;
    for (int i = 0; tab && i < tab->len; i++) {
        const entry_t *e = &tab->entries[i];
        if (e->backend != (int)backend || e->hidden != d->hidden || e->ffn != d->ffn_local * d->tp ||
            e->experts != d->num_experts || e->topk != d->topk || e->tp != d->tp || e->ep != d->ep)
            continue;
        int64_t dist = e->tokens > tokens ? e->tokens - tokens : tokens - e->tokens;
        if (!found || dist <= best) found = 1, best = dist, *out = e->t; /* ties: the later line (a re-tune) */
    }
    return found;
}

void comet_tuner_rule(const comet_dims_t *d, comet_backend_t backend, int64_t num_tokens, comet_tuning_t *t) {
    if (t->chunk_cols == 0) {
        int64_t c = (d->hidden + 7) / 8;
        c = (c + 7) / 8 * 8;
        if (c > d->hidden) c = d->hidden;
        t->chunk_cols = (int)c;
    }
    if (t->n_comm == 0 && backend != COMET_BACKEND_CUDA) t->n_comm = num_tokens * d->topk >= 64 ? 2 : 1;
    if (t->n_comm == 0 && backend == COMET_BACKEND_CUDA && t->push && d->world_size >= 2 && d->max_tokens >= 4096 &&
        d->topk * d->hidden <= 16384 && d->w1_rows * d->hidden <= ((int64_t)1 << 26))
        t->n_comm = 16;
}

comet_combine_t comet_tuner_combine(const comet_dims_t *d, comet_backend_t backend, comet_gemm_kind_t gemm,
                                    int force_pull) {
    if (backend != COMET_BACKEND_CUDA) return COMET_COMBINE_PARTIALS;
    const int can_push = gemm == COMET_GEMM_HOPPER && d->world_size >= 2 && d->world_size <= COMET_TUNER_MAX_PUSH;
    return can_push && !force_pull ? COMET_COMBINE_PUSH : COMET_COMBINE_PULL;
}

void comet_tuner_choose(const comet_tune_table_t *table, const comet_dims_t *d, comet_backend_t backend,
                        int64_t num_tokens, int n_comm, int chunk_cols, comet_protocol_t *p) {
    const int cuda = backend == COMET_BACKEND_CUDA;
    comet_tuning_t t = {n_comm > 0 ? n_comm : 0, chunk_cols, p->combine == COMET_COMBINE_PUSH};
    comet_tuning_t m;
    if (t.chunk_cols == 0 && lookup(table, d, backend, d->max_tokens, &m) && m.chunk_cols <= d->hidden)
        t.chunk_cols = m.chunk_cols;
    p->chosen_by = COMET_CHOSEN_BY_ARGS;
    /* n_comm -1 below: the sequential chain, decided, which the rule must keep */
    if (cuda && (n_comm == COMET_SEQUENTIAL || p->gemm != COMET_GEMM_HOPPER)) {
        t.n_comm = -1; /* asked for, or the only chain without the Hopper GEMM's hooks */
        if (n_comm == 0) p->chosen_by = COMET_CHOSEN_BY_RULE;
    } else if (t.n_comm == 0 && lookup(table, d, backend, cuda ? d->max_tokens : num_tokens, &m)) {
        t.n_comm = m.n_comm ? m.n_comm : -1; /* CUDA: one protocol for every rank; 0 there is sequential */
        p->chosen_by = COMET_CHOSEN_BY_TABLE;
    } else if (t.n_comm == 0) {
        p->chosen_by = COMET_CHOSEN_BY_RULE;
    }
    comet_tuner_rule(d, backend, num_tokens, &t);
    if (t.n_comm < 0) t.n_comm = 0;
    p->n_comm = t.n_comm;
    p->mode = !cuda || t.n_comm > 0 ? COMET_MODE_OVERLAPPED : COMET_MODE_SEQUENTIAL;
    p->chunk_cols = cuda ? 0 : t.chunk_cols;
}
int comet_tuner_append(const char *path, const comet_dims_t *d, comet_backend_t backend, int64_t tokens,
                       const comet_tuning_t *t, double ms) {
    FILE *f = fopen(path, "a+");
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    if (ftell(f) == 0) fprintf(f, "backend\thidden\tffn\texperts\ttopk\ttp\tep\ttokens\tn_comm\tchunk_cols\tms\n");
    fprintf(f, "%s\t%lld\t%lld\t%lld\t%lld\t%d\t%d\t%lld\t%d\t%d\t%.6f\n",
            backend == COMET_BACKEND_CUDA ? "cuda" : "cpu", (long long)d->hidden, (long long)(d->ffn_local * d->tp),
            (long long)d->num_experts, (long long)d->topk, d->tp, d->ep, (long long)tokens, t->n_comm, t->chunk_cols, ms);
    return fclose(f) == 0 ? 0 : -1;
}
