/*
 * tuner.c - the measured table and the analytical rule behind
 * comet_tuner_pick (see tuner.h).
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
 * about once; for larger slices that costs more than the dispatch it hides:
 * Mixtral EP2 at M=8192 sequential 4.26 / 4.11 ms against 4.41 / 4.48
 * overlapped, level at M=16384, Mixtral TP2 (7168 x 4096) and Phi-3.5
 * level, 2x H200, 32ae4d5, bench/results/2026-11-22-gemm-power-h200.md; on
 * 4 ranks Mixtral EP4 was already 0.7-1.3% faster sequential, 13fcb21).
 * Before that bound, on 2x H200 (M >= 8192) the rule's cells were
 * Qwen2-MoE, Mixtral and Phi-3.5-MoE: 10 of their 12 such cells faster, 7
 * by 3.6-4.8%, 2 slower by 1.2-2.1%; Mixtral alternated later: +-1.7%, a
 * wash (bench/results/2026-11-22-comet-h200x2-5215af5.md; at 50f5ee0, 8 of
 * the 12 faster, one by 0.1%, and Phi EP2 M=16384 7.6% slower, though its
 * GEMM-only side alone, 4.08 ms, was slower than the sequential layer, 3.96:
 * the clock, -50f5ee0.md). On 4x H200 (M =
 * 16384: TP2 x EP2 and EP4) Qwen2-MoE 7% and 10% faster, Mixtral -0.6% and
 * +1.4%, a wash (-a392388.jsonl; larger worlds not measured). Else 0, the
 * sequential chain: DeepSeek-V3-style (topk 8 x hidden 7168: 1-7% slower
 * overlapped on 2 ranks), Mixtral at EP (F_local 14336), 2048 tokens a rank
 * (even on average), one rank, COMET_PUSH=0 and partials (not measured
 * faster).
 */
#include "tuner.h"

#include <fcntl.h>
#include <math.h>
#include <pthread.h>
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

static pthread_mutex_t table_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t table_once = PTHREAD_ONCE_INIT;
static entry_t *table;
static int table_len;
static int table_loaded; /* a table was loaded (explicitly or from the environment) */

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

int comet_tuner_load(const char *path) {
    entry_t *fresh = NULL;
    int n = 0, cap = 0;
    if (path && *path) {
        FILE *f = open_table(path);
        if (!f) return -1;
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
            e.backend = strcmp(backend, "cuda") == 0 ? COMET_BACKEND_CUDA : COMET_BACKEND_CPU;
            e.hidden = v[0], e.ffn = v[1], e.experts = v[2], e.topk = v[3], e.tp = v[4], e.ep = v[5], e.tokens = v[6];
            e.t.n_comm = (int)v[7], e.t.chunk_cols = (int)v[8];
            if (n == cap) {
                cap = cap ? 2 * cap : 16;
                entry_t *grown = realloc(fresh, sizeof(entry_t) * (size_t)cap);
                if (!grown) break;
                fresh = grown;
            }
            fresh[n++] = e;
        }
        fclose(f);
    }
    pthread_mutex_lock(&table_mu);
    free(table);
    table = fresh, table_len = n, table_loaded = 1;
    pthread_mutex_unlock(&table_mu);
    return n;
}

/* COMET_TUNE_FILE, unless a table was loaded explicitly first. */
static void load_from_env(void) {
    pthread_mutex_lock(&table_mu);
    int loaded = table_loaded;
    pthread_mutex_unlock(&table_mu);
    if (!loaded) comet_tuner_load(getenv("COMET_TUNE_FILE"));
}

/* The entry for this configuration with the token count nearest `tokens`. */
static int lookup(const comet_dims_t *d, comet_backend_t backend, int64_t tokens, comet_tuning_t *out) {
    int found = 0;
    int64_t best = 0;
    pthread_mutex_lock(&table_mu);
    for (int i = 0; i < table_len; i++) {
        const entry_t *e = &table[i];
        if (e->backend != (int)backend || e->hidden != d->hidden || e->ffn != d->ffn_local * d->tp ||
            e->experts != d->num_experts || e->topk != d->topk || e->tp != d->tp || e->ep != d->ep)
            continue;
        int64_t dist = e->tokens > tokens ? e->tokens - tokens : tokens - e->tokens;
        if (!found || dist <= best) found = 1, best = dist, *out = e->t; /* ties: the later line (a re-tune) */
    }
    pthread_mutex_unlock(&table_mu);
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

void comet_tuner_pick(const comet_dims_t *d, comet_backend_t backend, int64_t num_tokens, comet_tuning_t *t) {
    pthread_once(&table_once, load_from_env);
    comet_tuning_t m;
    if (t->chunk_cols == 0 && lookup(d, backend, d->max_tokens, &m) && m.chunk_cols <= d->hidden)
        t->chunk_cols = m.chunk_cols;
    const int64_t for_n = backend == COMET_BACKEND_CUDA ? d->max_tokens : num_tokens; /* CUDA: one protocol */
    const int measured = t->n_comm == 0 && lookup(d, backend, for_n, &m);
    if (measured) t->n_comm = m.n_comm; /* CUDA: 0 there is the sequential chain, which the rule must keep */
    const int n_comm = t->n_comm;
    comet_tuner_rule(d, backend, num_tokens, t);
    if (measured) t->n_comm = n_comm;
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
