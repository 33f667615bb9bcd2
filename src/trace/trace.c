/*
 * trace.c - the trace recorder: fixed-size per-lane event buffers (layout in
 * trace.h), the public create/destroy/clear/count calls, attaching a recorder
 * to a layer, and the two writers: Chrome-trace JSON and an SVG picture with
 * one lane per rank x worker.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/status.h"
#include "trace.h"

#define DEFAULT_LANES 32
#define DEFAULT_EVENTS (1 << 14)

/* ---------------------------------------------------------------------------
 * Recorder
 * ------------------------------------------------------------------------- */

comet_status_t comet_trace_create(comet_trace_t **out, int num_ranks, int lanes_per_rank, int64_t events_per_lane) {
    comet_clear_error();
    if (!out) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "trace is NULL");
    *out = NULL;
    if (num_ranks < 1 || num_ranks > 65535)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "trace: num_ranks %d is outside [1, 65535]", num_ranks);
    if (lanes_per_rank < 0 || lanes_per_rank > 65536)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "trace: lanes_per_rank %d is outside [0, 65536]",
                          lanes_per_rank);
    if (events_per_lane < 0 || events_per_lane > ((int64_t)1 << 31))
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "trace: events_per_lane %lld is outside [0, 2^31]",
                          (long long)events_per_lane);
    const int lanes = lanes_per_rank ? lanes_per_rank : DEFAULT_LANES;
    const int64_t capacity = events_per_lane ? events_per_lane : DEFAULT_EVENTS;
    size_t n_lanes, n_events, bytes; /* bytes: comet_trace_buffer_bytes */
    if (__builtin_mul_overflow((size_t)num_ranks, (size_t)lanes, &n_lanes) ||
        __builtin_mul_overflow(n_lanes, (size_t)capacity, &n_events) ||
        __builtin_mul_overflow(n_events, sizeof(comet_trace_event_t), &bytes))
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "trace: %d x %d lanes of %lld events of %zu bytes overflow",
                          num_ranks, lanes, (long long)capacity, sizeof(comet_trace_event_t));
    comet_trace_t *t = calloc(1, sizeof *t);
    if (!t) return comet_fail(COMET_ERR_OUT_OF_MEMORY, "trace: no memory");
    t->ranks = num_ranks;
    t->lanes = lanes;
    t->capacity = capacity;
    atomic_init(&t->out_of_range, 0);
    t->layout = calloc((size_t)num_ranks, sizeof *t->layout);
    t->counts = calloc(n_lanes, sizeof *t->counts);
    t->events = calloc(n_events, sizeof *t->events);
    if (!t->layout || !t->counts || !t->events) { /* the message from the locals: destroy frees t */
        comet_trace_destroy(t);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "trace: no memory for %d x %d lanes of %lld events", num_ranks,
                          lanes, (long long)capacity);
    }
    *out = t;
    return COMET_SUCCESS;
}

comet_status_t comet_trace_destroy(comet_trace_t *t) {
    comet_clear_error();
    if (!t) return COMET_SUCCESS;
    free(t->layout);
    free(t->counts);
    free(t->events);
    free(t);
    return COMET_SUCCESS;
}

comet_status_t comet_trace_clear(comet_trace_t *t) {
    comet_clear_error();
    if (!t) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "trace is NULL");
    memset(t->counts, 0, (size_t)t->ranks * (size_t)t->lanes * sizeof *t->counts);
    atomic_store(&t->out_of_range, 0);
    return COMET_SUCCESS;
}

void comet_trace_record(comet_trace_t *t, int lane, const comet_trace_event_t *ev) {
    if (ev->rank >= t->ranks || lane < 0 || lane >= t->lanes) {
        atomic_fetch_add_explicit(&t->out_of_range, 1, memory_order_relaxed);
        return;
    }
    const size_t slot = (size_t)ev->rank * (size_t)t->lanes + (size_t)lane;
    uint32_t n = t->counts[slot];
    if (n != UINT32_MAX) t->counts[slot] = n + 1; /* saturate: a full lane stays full */
    if ((int64_t)n < t->capacity) t->events[slot * (size_t)t->capacity + n] = *ev;
}

void comet_trace_set_layout(comet_trace_t *t, int rank, int layout) {
    if (t && rank >= 0 && rank < t->ranks) t->layout[rank] = (uint8_t)layout;
}

size_t comet_trace_buffer_bytes(const comet_trace_t *t) {
    return (size_t)t->ranks * (size_t)t->lanes * (size_t)t->capacity * sizeof(comet_trace_event_t);
}
comet_trace_event_t *comet_trace_buffer(comet_trace_t *t) { return t->events; }
uint32_t *comet_trace_counts(comet_trace_t *t) { return t->counts; }

static int64_t kept_in(const comet_trace_t *t, size_t slot) {
    int64_t n = t->counts[slot];
    return n < t->capacity ? n : t->capacity;
}

int64_t comet_trace_event_count(const comet_trace_t *t) {
    if (!t) return 0;
    int64_t n = 0;
    for (size_t s = 0; s < (size_t)t->ranks * (size_t)t->lanes; s++) n += kept_in(t, s);
    return n;
}

int64_t comet_trace_dropped(const comet_trace_t *t) {
    if (!t) return 0;
    int64_t n = atomic_load(&((comet_trace_t *)t)->out_of_range);
    for (size_t s = 0; s < (size_t)t->ranks * (size_t)t->lanes; s++) n += (int64_t)t->counts[s] - kept_in(t, s);
    return n;
}

/* ---------------------------------------------------------------------------
 * Names
 * ------------------------------------------------------------------------- */

static const char *const kind_names[COMET_TRACE_NUM_KINDS] = {
    "pull", "gemm0", "gemm1", "send", "recv", "wait", "barrier", "plan",
    "bwd_pull", "bwd_gemm0", "bwd_gemm1", "bwd_send", "bwd_recv", "transpose", "wgrad"};

/* What a model trainer calls each step: the event names of the JSON and the
 * SVG's legend and tooltips. GEMM0 is the experts' first matmul (x W1, with
 * the gated activation), GEMM1 their second (h W2). */
static const char *const kind_titles[COMET_TRACE_NUM_KINDS] = {
    "dispatch (pull token rows)", "expert GEMM 1 (x W1, activation)", "expert GEMM 2 (h W2)",
    "combine (send partials)",    "combine (sum partials into y)",    "wait",
    "barrier (sync ranks)",       "plan (route tokens)",
    "backward: pull x and dy rows", "backward: G = dy W2^T, dH",      "backward: dX = dH W1",
    "backward: send dx partials",   "backward: sum dx partials",      "backward: transpose weights",
    "backward: weight gradients"};

const char *comet_trace_kind_name(int kind) {
    return kind >= 0 && kind < COMET_TRACE_NUM_KINDS ? kind_names[kind] : "unknown";
}

const char *comet_trace_kind_title(int kind) {
    return kind >= 0 && kind < COMET_TRACE_NUM_KINDS ? kind_titles[kind] : "unknown";
}

const char *comet_trace_role_name(int role) {
    return role == COMET_TRACE_HOST ? "host" : role == COMET_TRACE_COMM ? "comm" : role == COMET_TRACE_GEMM ? "gemm" : "other";
}

int comet_trace_kind_layer(int kind) {
    switch (kind) {
    case COMET_TRACE_PULL:
    case COMET_TRACE_GEMM0: return 0;
    case COMET_TRACE_GEMM1:
    case COMET_TRACE_SEND:
    case COMET_TRACE_RECV: return 1;
    default: return -1; /* the backward's kinds too: the header spans are the forward's layers */
    }
}

/* "gemm0 b3 t2", "send c1 to r0", "wait for gemm1 c2", ... */
static void event_label(const comet_trace_event_t *e, char *buf, size_t n) {
    const char *k = comet_trace_kind_name(e->kind);
    switch (e->kind) {
    case COMET_TRACE_PULL: snprintf(buf, n, "pull b%d", e->index); break;
    case COMET_TRACE_GEMM0: snprintf(buf, n, "gemm0 b%d t%d", e->index, e->aux); break;
    case COMET_TRACE_GEMM1: snprintf(buf, n, "gemm1 b%d c%d", e->index, e->aux); break;
    case COMET_TRACE_SEND: snprintf(buf, n, "send c%d to r%d", e->index, e->aux); break;
    case COMET_TRACE_RECV: snprintf(buf, n, "recv c%d", e->index); break;
    case COMET_TRACE_BPULL: snprintf(buf, n, "bwd pull b%d", e->index); break;
    case COMET_TRACE_BGEMM0: snprintf(buf, n, "bwd gemm0 b%d", e->index); break;
    case COMET_TRACE_BGEMM1: snprintf(buf, n, "bwd gemm1 b%d c%d", e->index, e->aux); break;
    case COMET_TRACE_BSEND: snprintf(buf, n, "bwd send c%d to r%d", e->index, e->aux); break;
    case COMET_TRACE_BRECV: snprintf(buf, n, "bwd recv c%d", e->index); break;
    case COMET_TRACE_WGRAD: /* CUDA: one kernel (index -1) of dW1 or dW2 (aux) */
        if (e->index < 0) snprintf(buf, n, "wgrad dW%d", e->aux);
        else snprintf(buf, n, "wgrad e%d task %d", e->aux, e->index);
        break;
    case COMET_TRACE_WAIT: snprintf(buf, n, "wait for %s %d", comet_trace_kind_name(e->aux), e->index); break;
    case COMET_TRACE_BARRIER: snprintf(buf, n, "barrier (%s)", e->index ? "entry" : "previous call done"); break;
    default: snprintf(buf, n, "%s", k); break;
    }
}

/* What a lane holds, by the rank's backend: "rank 1: comm CTAs 3 mod 8",
 * "rank 0: compute worker 2", ... (without "rank r: " when `with_rank` is 0). */
static void lane_label(const comet_trace_t *t, int rank, int role, int worker, int with_rank, char *buf, size_t n) {
    char pre[24] = "";
    if (with_rank) snprintf(pre, sizeof pre, "rank %d: ", rank);
    const int layout = rank < t->ranks ? t->layout[rank] : COMET_TRACE_LAYOUT_UNKNOWN;
    if (layout == COMET_TRACE_LAYOUT_CUDA) {
        if (role == COMET_TRACE_HOST) snprintf(buf, n, "%sstream", pre);
        else if (role == COMET_TRACE_COMM) snprintf(buf, n, "%scomm CTAs %d mod 8", pre, worker);
        else if (role == COMET_TRACE_GEMM && worker < 2) snprintf(buf, n, "%sGEMM%d kernel", pre, worker);
        else snprintf(buf, n, "%s%s %d", pre, comet_trace_role_name(role), worker);
    } else if (layout == COMET_TRACE_LAYOUT_CPU) {
        if (role == COMET_TRACE_HOST) snprintf(buf, n, "%srank thread", pre);
        else if (role == COMET_TRACE_COMM) snprintf(buf, n, "%scomm worker %d", pre, worker);
        else if (role == COMET_TRACE_GEMM) snprintf(buf, n, "%scompute worker %d", pre, worker);
        else snprintf(buf, n, "%s%s %d", pre, comet_trace_role_name(role), worker);
    } else if (role == COMET_TRACE_HOST) {
        snprintf(buf, n, "%shost", pre);
    } else {
        snprintf(buf, n, "%s%s %d", pre, comet_trace_role_name(role), worker);
    }
}

/* ---------------------------------------------------------------------------
 * Collected view for the writers: kept events, sorted lanes, time origin.
 * ------------------------------------------------------------------------- */

typedef struct {
    int rank, role, worker;
} lane_key_t;

typedef struct {
    comet_trace_event_t *ev;
    int64_t n;
    lane_key_t *lanes;
    int64_t n_lanes;
    uint64_t t0, t1; /* earliest begin, latest end */
} view_t;

static int cmp_lane(const void *a, const void *b) {
    const lane_key_t *x = a, *y = b;
    if (x->rank != y->rank) return x->rank - y->rank;
    if (x->role != y->role) return x->role - y->role;
    return x->worker - y->worker;
}

/* By lane, then by begin: the writers walk each lane's events in one run. */
static int cmp_event(const void *a, const void *b) {
    const comet_trace_event_t *x = a, *y = b;
    lane_key_t kx = {x->rank, x->role, x->worker}, ky = {y->rank, y->role, y->worker};
    int c = cmp_lane(&kx, &ky);
    if (c) return c;
    return (x->t_begin_ns > y->t_begin_ns) - (x->t_begin_ns < y->t_begin_ns);
}

static int same_lane(const comet_trace_event_t *e, const lane_key_t *k) {
    return e->rank == k->rank && e->role == k->role && e->worker == k->worker;
}

static void view_free(view_t *v) {
    free(v->ev);
    free(v->lanes);
}

static comet_status_t view_make(const comet_trace_t *t, view_t *v) {
    memset(v, 0, sizeof *v);
    if (!t) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "trace is NULL");
    int64_t total = comet_trace_event_count(t);
    v->ev = malloc((size_t)(total ? total : 1) * sizeof *v->ev);
    v->lanes = malloc((size_t)(total ? total : 1) * sizeof *v->lanes);
    if (!v->ev || !v->lanes) {
        view_free(v);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "trace: no memory to write %lld events", (long long)total);
    }
    for (size_t s = 0; s < (size_t)t->ranks * (size_t)t->lanes; s++) {
        int64_t k = kept_in(t, s);
        memcpy(v->ev + v->n, t->events + s * (size_t)t->capacity, (size_t)k * sizeof *v->ev);
        v->n += k;
    }
    v->t0 = UINT64_MAX;
    for (int64_t i = 0; i < v->n; i++) {
        const comet_trace_event_t *e = &v->ev[i];
        if (e->t_begin_ns < v->t0) v->t0 = e->t_begin_ns;
        if (e->t_end_ns > v->t1) v->t1 = e->t_end_ns;
        v->lanes[i] = (lane_key_t){e->rank, e->role, e->worker};
    }
    if (v->n == 0) v->t0 = v->t1 = 0;
    qsort(v->ev, (size_t)v->n, sizeof *v->ev, cmp_event);
    qsort(v->lanes, (size_t)v->n, sizeof *v->lanes, cmp_lane);
    for (int64_t i = 0; i < v->n; i++)
        if (v->n_lanes == 0 || cmp_lane(&v->lanes[v->n_lanes - 1], &v->lanes[i]) != 0) v->lanes[v->n_lanes++] = v->lanes[i];
    return COMET_SUCCESS;
}

static double us_since(const view_t *v, uint64_t ns) { return (double)(ns - v->t0) * 1e-3; }

static comet_status_t open_out(const char *path, FILE **f) {
    if (!path) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "trace: path is NULL");
    *f = fopen(path, "w");
    if (!*f) return comet_fail(COMET_ERR_SYSTEM, "trace: cannot open %s for writing: %s", path, strerror(errno));
    return COMET_SUCCESS;
}

static comet_status_t close_out(FILE *f, const char *path) {
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) return comet_fail(COMET_ERR_SYSTEM, "trace: writing %s failed", path);
    return COMET_SUCCESS;
}

/* What both writers start with: the sorted view of the events and the file. */
static comet_status_t view_open(const comet_trace_t *t, const char *path, view_t *v, FILE **f) {
    COMET_TRY(view_make(t, v));
    comet_status_t st = open_out(path, f);
    if (st != COMET_SUCCESS) view_free(v);
    return st;
}

/* ---------------------------------------------------------------------------
 * Summary per rank: the layer's time, the busy time of the GEMM and of the
 * communication steps, and how much of the communication overlapped GEMMs.
 * Times within one rank only (one clock), so they hold whatever the ranks'
 * clocks are.
 * ------------------------------------------------------------------------- */

typedef struct {
    int present;
    uint64_t first, last;                /* the rank's first begin and last end */
    uint64_t gemm_ns, comm_ns, hidden_ns; /* |U gemm|, |U comm|, |U comm n U gemm| */
} rank_sum_t;

typedef struct {
    uint64_t b, e;
} span_t;

static int cmp_span(const void *a, const void *b) {
    const span_t *x = a, *y = b;
    return (x->b > y->b) - (x->b < y->b);
}

static int is_gemm(int kind) {
    return kind == COMET_TRACE_GEMM0 || kind == COMET_TRACE_GEMM1 || kind == COMET_TRACE_BGEMM0 ||
           kind == COMET_TRACE_BGEMM1 || kind == COMET_TRACE_TRANSPOSE || kind == COMET_TRACE_WGRAD;
}
static int is_comm(int kind) {
    return kind == COMET_TRACE_PULL || kind == COMET_TRACE_SEND || kind == COMET_TRACE_RECV ||
           kind == COMET_TRACE_BPULL || kind == COMET_TRACE_BSEND || kind == COMET_TRACE_BRECV;
}

/* The rank's intervals of the kinds `pick` takes, as a sorted union of
 * disjoint spans in s (room for v->n); returns how many. */
static int64_t union_of(const view_t *v, int rank, int (*pick)(int), span_t *s) {
    int64_t n = 0;
    for (int64_t i = 0; i < v->n; i++) {
        const comet_trace_event_t *e = &v->ev[i];
        if (e->rank == rank && pick(e->kind))
            s[n++] = (span_t){e->t_begin_ns, e->t_end_ns > e->t_begin_ns ? e->t_end_ns : e->t_begin_ns};
    }
    qsort(s, (size_t)n, sizeof *s, cmp_span);
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (m && s[i].b <= s[m - 1].e) {
            if (s[i].e > s[m - 1].e) s[m - 1].e = s[i].e;
        } else {
            s[m++] = s[i];
        }
    }
    return m;
}

static uint64_t length_of(const span_t *s, int64_t n) {
    uint64_t t = 0;
    for (int64_t i = 0; i < n; i++) t += s[i].e - s[i].b;
    return t;
}

/* out[0..max_rank]; 0 on success, -1 out of memory. */
static int summarize(const view_t *v, int max_rank, rank_sum_t *out) {
    span_t *a = malloc((size_t)(v->n ? v->n : 1) * sizeof *a), *b = malloc((size_t)(v->n ? v->n : 1) * sizeof *b);
    if (!a || !b) {
        free(a), free(b);
        return -1;
    }
    for (int r = 0; r <= max_rank; r++) {
        rank_sum_t *o = &out[r];
        memset(o, 0, sizeof *o);
        o->first = UINT64_MAX;
        for (int64_t i = 0; i < v->n; i++) {
            const comet_trace_event_t *e = &v->ev[i];
            if (e->rank != r) continue;
            o->present = 1;
            if (e->t_begin_ns < o->first) o->first = e->t_begin_ns;
            if (e->t_end_ns > o->last) o->last = e->t_end_ns;
        }
        if (!o->present) {
            o->first = 0;
            continue;
        }
        if (o->last < o->first) o->last = o->first;
        int64_t na = union_of(v, r, is_gemm, a), nb = union_of(v, r, is_comm, b);
        o->gemm_ns = length_of(a, na), o->comm_ns = length_of(b, nb);
        for (int64_t i = 0, j = 0; i < na && j < nb;) { /* two sorted disjoint lists: their overlap */
            uint64_t lo = a[i].b > b[j].b ? a[i].b : b[j].b, hi = a[i].e < b[j].e ? a[i].e : b[j].e;
            if (hi > lo) o->hidden_ns += hi - lo;
            if (a[i].e < b[j].e) i++;
            else j++;
        }
    }
    free(a), free(b);
    return 0;
}

static const char *layout_name(const comet_trace_t *t, int rank) {
    const int l = rank < t->ranks ? t->layout[rank] : COMET_TRACE_LAYOUT_UNKNOWN;
    return l == COMET_TRACE_LAYOUT_CPU ? "cpu" : l == COMET_TRACE_LAYOUT_CUDA ? "cuda" : "unknown";
}

/* The view's highest rank and its summaries (NULL: out of memory; the
 * caller frees). */
static rank_sum_t *view_summary(const view_t *v, int *max_rank) {
    *max_rank = v->n_lanes ? v->lanes[v->n_lanes - 1].rank : -1;
    rank_sum_t *sums = malloc((size_t)(*max_rank + 2) * sizeof *sums);
    if (sums && summarize(v, *max_rank, sums) != 0) free(sums), sums = NULL;
    return sums;
}

/* "rank 1 (+3.2 us)": where the rank's first event lies on the common axis. */
static void rank_title(const view_t *v, const rank_sum_t *o, int rank, char *buf, size_t n) {
    snprintf(buf, n, "rank %d (+%.1f us)", rank, us_since(v, o->first));
}

/* "812.3 us" or "226.073 ms". */
static void time_text(double us, char *buf, size_t n) {
    if (us < 10000) snprintf(buf, n, "%.1f us", us);
    else snprintf(buf, n, "%.3f ms", us * 1e-3);
}

/* "80.1% of it hidden behind GEMMs", or "none to hide". */
static void hidden_text(const rank_sum_t *o, char *buf, size_t n) {
    if (o->comm_ns) snprintf(buf, n, "%.1f%% of it hidden behind GEMMs", 100.0 * (double)o->hidden_ns / (double)o->comm_ns);
    else snprintf(buf, n, "none to hide");
}

/* ---------------------------------------------------------------------------
 * Chrome-trace JSON
 * ------------------------------------------------------------------------- */

comet_status_t comet_trace_write_chrome_json(const comet_trace_t *t, const char *path) {
    comet_clear_error();
    view_t v;
    FILE *f;
    COMET_TRY(view_open(t, path, &v, &f));
    int max_rank;
    rank_sum_t *sums = view_summary(&v, &max_rank);
    if (!sums) {
        fclose(f), view_free(&v);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "trace: no memory for the summary");
    }
    /* otherData: the summary the picture's top lines show, per rank (us). */
    fprintf(f, "{\"displayTimeUnit\": \"ns\",\n \"otherData\": {\"tool\": \"comet\", \"events\": %lld, \"dropped\": %lld",
            (long long)v.n, (long long)comet_trace_dropped(t));
    double layer_max = 0;
    for (int r = 0; r <= max_rank; r++)
        if (sums[r].present && (double)(sums[r].last - sums[r].first) * 1e-3 > layer_max)
            layer_max = (double)(sums[r].last - sums[r].first) * 1e-3;
    fprintf(f, ", \"layer_us_max\": %.3f, \"ranks\": [", layer_max);
    for (int r = 0, any = 0; r <= max_rank; r++) {
        const rank_sum_t *o = &sums[r];
        if (!o->present) continue;
        fprintf(f, "%s\n  {\"rank\": %d, \"backend\": \"%s\", \"start_us\": %.3f, \"layer_us\": %.3f, \"gemm_busy_us\": %.3f, "
                   "\"comm_busy_us\": %.3f, \"comm_hidden_us\": %.3f, \"comm_hidden\": ",
                any++ ? "," : "", r, layout_name(t, r), us_since(&v, o->first), (double)(o->last - o->first) * 1e-3,
                (double)o->gemm_ns * 1e-3, (double)o->comm_ns * 1e-3, (double)o->hidden_ns * 1e-3);
        if (o->comm_ns) fprintf(f, "%.4f}", (double)o->hidden_ns / (double)o->comm_ns);
        else fprintf(f, "null}");
    }
    fprintf(f, "]},\n \"traceEvents\": [\n");
    const char *sep = "  ";
    int last_rank = -1;
    for (int64_t i = 0; i < v.n_lanes; i++) {
        const lane_key_t *k = &v.lanes[i];
        if (k->rank != last_rank) {
            char pname[48];
            rank_title(&v, &sums[k->rank], k->rank, pname, sizeof pname);
            fprintf(f, "%s{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": %d, \"args\": {\"name\": \"%s\"}}", sep,
                    k->rank, pname);
            sep = ",\n  ";
            fprintf(f, "%s{\"ph\": \"M\", \"name\": \"process_sort_index\", \"pid\": %d, \"args\": {\"sort_index\": %d}}",
                    sep, k->rank, k->rank);
            last_rank = k->rank;
        }
        int tid = k->role * 1000 + k->worker;
        char name[64];
        lane_label(t, k->rank, k->role, k->worker, 1, name, sizeof name);
        fprintf(f, "%s{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": %d, \"tid\": %d, \"args\": {\"name\": \"%s\"}}",
                sep, k->rank, tid, name);
        fprintf(f, "%s{\"ph\": \"M\", \"name\": \"thread_sort_index\", \"pid\": %d, \"tid\": %d, \"args\": {\"sort_index\": %d}}",
                sep, k->rank, tid, tid);
    }
    for (int64_t i = 0; i < v.n; i++) {
        const comet_trace_event_t *e = &v.ev[i];
        char label[96];
        event_label(e, label, sizeof label);
        int layer = comet_trace_kind_layer(e->kind);
        double ts = us_since(&v, e->t_begin_ns);
        double dur = e->t_end_ns >= e->t_begin_ns ? (double)(e->t_end_ns - e->t_begin_ns) * 1e-3 : 0.0;
        fprintf(f,
                "%s{\"ph\": \"X\", \"name\": \"%s\", \"cat\": \"%s%s%s\", \"pid\": %d, \"tid\": %d, \"ts\": %.3f, "
                "\"dur\": %.3f, \"args\": {\"kind\": \"%s\", \"index\": %d, \"aux\": %d, \"call\": %d, \"step\": \"%s\"}}",
                sep, comet_trace_kind_title(e->kind), comet_trace_role_name(e->role), layer >= 0 ? (layer ? ",layer1" : ",layer0") : "",
                e->kind == COMET_TRACE_WAIT ? ",wait" : "", e->rank, e->role * 1000 + e->worker, ts, dur,
                comet_trace_kind_name(e->kind), e->index, e->aux, e->call, label);
        sep = ",\n  ";
    }
    fprintf(f, "\n ]\n}\n");
    free(sums);
    view_free(&v);
    return close_out(f, path);
}

/* ---------------------------------------------------------------------------
 * SVG
 * ------------------------------------------------------------------------- */

#define SVG_WIDTH 1400.0
#define SVG_LEFT 180.0  /* lane labels */
#define SVG_RIGHT 30.0
#define SVG_LANE 16.0   /* lane height */
#define SVG_HEADER 18.0 /* rank header with the layer bands */
#define SVG_GAP 10.0    /* between ranks */

static const char *kind_color(int kind) {
    switch (kind) {
    case COMET_TRACE_PULL: return "#6baed6";   /* comm, layer 0: light blue */
    case COMET_TRACE_SEND: return "#08519c";   /* comm, layer 1: dark blue */
    case COMET_TRACE_RECV: return "#54278f";   /* comm, layer 1: purple */
    case COMET_TRACE_GEMM0: return "#fdae6b";  /* gemm, layer 0: light orange */
    case COMET_TRACE_GEMM1: return "#d94801";  /* gemm, layer 1: dark orange */
    case COMET_TRACE_PLAN: return "#74c476";   /* host: green */
    case COMET_TRACE_BPULL: return "#9ecae1";  /* the backward: the forward's hues, lighter or shifted */
    case COMET_TRACE_BSEND: return "#4292c6";
    case COMET_TRACE_BRECV: return "#9e9ac8";
    case COMET_TRACE_BGEMM0: return "#fdd0a2";
    case COMET_TRACE_BGEMM1: return "#f16913";
    case COMET_TRACE_TRANSPOSE: return "#bcbddc";
    case COMET_TRACE_WGRAD: return "#a50f15";  /* dark red: the weight-gradient tiles */
    case COMET_TRACE_BARRIER: return "#d9d9d9";
    default: return "#969696";                 /* waits */
    }
}

/* A tick step of 1, 2 or 5 x 10^k giving about `want` ticks over span. */
static double tick_step(double span, int want) {
    double raw = span / want, p = 1;
    while (p * 10 <= raw) p *= 10;
    while (p > raw) p /= 10;
    return raw >= 5 * p ? 5 * p : raw >= 2 * p ? 2 * p : p;
}

comet_status_t comet_trace_write_svg(const comet_trace_t *t, const char *path) {
    comet_clear_error();
    view_t v;
    FILE *f;
    COMET_TRY(view_open(t, path, &v, &f));
    /* Vertical layout: every rank a header row (layer bands), then its lanes. */
    double *lane_y = malloc((size_t)(v.n_lanes ? v.n_lanes : 1) * sizeof(double));
    int max_rank;
    rank_sum_t *sums = view_summary(&v, &max_rank);
    double *rank_y = malloc((size_t)(max_rank + 2) * sizeof(double));
    if (!lane_y || !rank_y || !sums) {
        free(lane_y), free(rank_y), free(sums), fclose(f), view_free(&v);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "trace: no memory for the picture");
    }
    /* Top: title, one summary line per rank, the clock note, legend, bands note. */
    int n_present = 0, any_gpu = 0;
    double layer_max = 0;
    for (int r = 0; r <= max_rank; r++) {
        if (!sums[r].present) continue;
        n_present++;
        any_gpu |= r < t->ranks && t->layout[r] == COMET_TRACE_LAYOUT_CUDA;
        if ((double)(sums[r].last - sums[r].first) * 1e-3 > layer_max)
            layer_max = (double)(sums[r].last - sums[r].first) * 1e-3;
    }
    const double summary_y = 36, note_y = summary_y + 14.0 * n_present, legend_y = note_y + 29,
                 top = legend_y + 48; /* the first rank's header (the legend's two rows above) */
    double y = top;
    for (int64_t i = 0; i < v.n_lanes; i++) {
        if (i == 0 || v.lanes[i].rank != v.lanes[i - 1].rank) {
            if (i) y += SVG_GAP;
            rank_y[v.lanes[i].rank] = y;
            y += SVG_HEADER;
        }
        lane_y[i] = y;
        y += SVG_LANE;
    }
    const double plot_w = SVG_WIDTH - SVG_LEFT - SVG_RIGHT, axis_y = y + 6, height = axis_y + 40;
    const double span_us = v.n ? (v.t1 > v.t0 ? (double)(v.t1 - v.t0) * 1e-3 : 1e-3) : 1.0;
#define X_OF(ns) (SVG_LEFT + us_since(&v, (ns)) / span_us * plot_w)

    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
               "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
               "font-family=\"Helvetica, Arial, sans-serif\" font-size=\"11\">\n"
               "<!-- comet trace: one lane per rank x worker; %lld events, %lld dropped -->\n"
               "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
            SVG_WIDTH, height, SVG_WIDTH, height, (long long)v.n, (long long)comet_trace_dropped(t));
    char tl[32];
    time_text(layer_max, tl, sizeof tl);
    fprintf(f, "<text x=\"10\" y=\"18\" font-size=\"14\" font-weight=\"bold\">comet trace: %d rank%s, layer %s "
               "(slowest rank, first event to last), %lld events%s</text>\n",
            n_present, n_present == 1 ? "" : "s", tl, (long long)v.n,
            comet_trace_dropped(t) ? " (some dropped: lanes were full)" : "");
    fprintf(f, "<g class=\"summary\">\n");
    for (int r = 0, line = 0; r <= max_rank; r++) {
        const rank_sum_t *o = &sums[r];
        if (!o->present) continue;
        char lt[32], gt[32], ct[32], hid[48];
        time_text((double)(o->last - o->first) * 1e-3, lt, sizeof lt);
        time_text((double)o->gemm_ns * 1e-3, gt, sizeof gt);
        time_text((double)o->comm_ns * 1e-3, ct, sizeof ct);
        hidden_text(o, hid, sizeof hid);
        fprintf(f, "<text x=\"10\" y=\"%.1f\" data-rank=\"%d\"><tspan font-weight=\"bold\">rank %d:</tspan> layer %s "
                   "(starts at +%.1f us) | GEMM busy %s | communication busy %s, %s</text>\n",
                summary_y + 14.0 * line++, r, r, lt, us_since(&v, o->first), gt, ct, hid);
    }
    fprintf(f, "<text x=\"10\" y=\"%.1f\" fill=\"#555\">layer: the rank's first event to its last; busy: time "
               "when at least one of its lanes runs that kind of step (waits not counted); hidden: the communication "
               "time during which a GEMM also ran (per rank, from its own events only).</text>\n"
               "<text x=\"10\" y=\"%.1f\" fill=\"#555\">%s</text>\n</g>\n",
            note_y, note_y + 13, any_gpu ? "Each GPU's times come from its own %globaltimer: a rank's +offset includes its "
                              "clock's difference from the others' (each rank's own numbers above hold)."
                            : "All ranks share one clock (CLOCK_MONOTONIC): a rank's +offset, where its first event lies after the "
                              "earliest one, is real.");
    /* Legend. */
    /* Legend: the forward's and the host's kinds, then the backward's on a second row. */
    static const int legend[] = {COMET_TRACE_PULL,   COMET_TRACE_GEMM0,  COMET_TRACE_GEMM1,     COMET_TRACE_SEND,
                                 COMET_TRACE_RECV,   COMET_TRACE_WAIT,   COMET_TRACE_PLAN,      COMET_TRACE_BARRIER,
                                 COMET_TRACE_BPULL,  COMET_TRACE_BGEMM0, COMET_TRACE_BGEMM1,    COMET_TRACE_BSEND,
                                 COMET_TRACE_BRECV,  COMET_TRACE_TRANSPOSE, COMET_TRACE_WGRAD};
    double lx = 10;
    for (int i = 0; i < (int)(sizeof legend / sizeof legend[0]); i++) {
        const double ly = legend_y + (legend[i] >= COMET_TRACE_BPULL ? 16 : 0);
        if (legend[i] == COMET_TRACE_BPULL) lx = 10;
        fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"12\" height=\"%d\" fill=\"%s\"/><text x=\"%.1f\" y=\"%.1f\">%s</text>\n",
                lx, ly + (legend[i] == COMET_TRACE_WAIT ? 3 : 0), legend[i] == COMET_TRACE_WAIT ? 4 : 10,
                kind_color(legend[i]), lx + 16, ly + 10,
                comet_trace_kind_title(legend[i]));
        lx += 24 + 6.2 * (double)strlen(comet_trace_kind_title(legend[i]));
    }
    fprintf(f, "<text x=\"10\" y=\"%.1f\" fill=\"#555\">bands above each rank: span of layer 0 (dispatch + expert GEMM 1) "
               "and of layer 1 (expert GEMM 2 + combine); communication is hidden where its bars share a time with "
               "GEMM bars</text>\n",
            legend_y + 24);
    /* Grid and time axis. */
    double step = tick_step(span_us, 10);
    fprintf(f, "<g class=\"axis\" stroke=\"#ccc\" stroke-width=\"0.5\">\n");
    for (double u = 0; u <= span_us * 1.0001; u += step)
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n", SVG_LEFT + u / span_us * plot_w,
                top - 2, SVG_LEFT + u / span_us * plot_w, axis_y);
    fprintf(f, "</g>\n<g class=\"axis-labels\" text-anchor=\"middle\">\n");
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n", SVG_LEFT, axis_y,
            SVG_LEFT + plot_w, axis_y);
    for (double u = 0; u <= span_us * 1.0001; u += step)
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\">%g</text>\n", SVG_LEFT + u / span_us * plot_w, axis_y + 14, u);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\">time (&#181;s from the first event)</text>\n</g>\n",
            SVG_LEFT + plot_w / 2, axis_y + 32);
    /* Rank headers with the span of each layer. */
    for (int r = 0; r <= max_rank; r++) {
        uint64_t lo[2] = {UINT64_MAX, UINT64_MAX}, hi[2] = {0, 0};
        int any = 0;
        for (int64_t i = 0; i < v.n; i++) {
            const comet_trace_event_t *e = &v.ev[i];
            int layer = comet_trace_kind_layer(e->kind);
            if (e->rank != r || layer < 0) continue;
            any = 1;
            if (e->t_begin_ns < lo[layer]) lo[layer] = e->t_begin_ns;
            if (e->t_end_ns > hi[layer]) hi[layer] = e->t_end_ns;
        }
        int present = 0;
        for (int64_t i = 0; i < v.n_lanes; i++) present |= v.lanes[i].rank == r;
        if (!present) continue;
        double ry = rank_y[r];
        char rt[48];
        rank_title(&v, &sums[r], r, rt, sizeof rt);
        fprintf(f, "<g class=\"rank\" data-rank=\"%d\">\n<text x=\"10\" y=\"%.1f\" font-weight=\"bold\">%s</text>\n",
                r, ry + 12, rt);
        for (int layer = 0; any && layer < 2; layer++) {
            if (lo[layer] == UINT64_MAX) continue;
            double x0 = X_OF(lo[layer]), x1 = X_OF(hi[layer]);
            fprintf(f, "<rect class=\"phase\" x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"6\" fill=\"%s\">"
                       "<title>rank %d layer %d: %.1f - %.1f us</title></rect>\n",
                    x0, ry + 2 + layer * 7, x1 - x0 > 0.5 ? x1 - x0 : 0.5, layer ? "#a50f15" : "#fcbba1", r, layer,
                    us_since(&v, lo[layer]), us_since(&v, hi[layer]));
            fprintf(f, "<text x=\"%.2f\" y=\"%.1f\" font-size=\"7\" fill=\"#333\">layer %d</text>\n",
                    x1 + 3 > SVG_WIDTH - 28 ? x0 - 28 : x1 + 3, ry + 8 + layer * 7, layer);
        }
        fprintf(f, "</g>\n");
    }
    /* Lanes (events are sorted by lane). */
    for (int64_t i = 0, j = 0; i < v.n_lanes; i++) {
        const lane_key_t *k = &v.lanes[i];
        char name[64];
        lane_label(t, k->rank, k->role, k->worker, 1, name, sizeof name);
        fprintf(f,
                "<g class=\"lane\" data-rank=\"%d\" data-role=\"%s\" data-worker=\"%d\">\n"
                "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\"/>\n"
                "<text x=\"18\" y=\"%.1f\">%s</text>\n",
                k->rank, comet_trace_role_name(k->role), k->worker, SVG_LEFT, lane_y[i], plot_w, SVG_LANE - 2,
                i % 2 ? "#f7f7f7" : "#efefef", lane_y[i] + 11, name);
        for (; j < v.n && same_lane(&v.ev[j], k); j++) {
            const comet_trace_event_t *e = &v.ev[j];
            char label[96];
            event_label(e, label, sizeof label);
            double x0 = X_OF(e->t_begin_ns), x1 = X_OF(e->t_end_ns >= e->t_begin_ns ? e->t_end_ns : e->t_begin_ns);
            int wait = e->kind == COMET_TRACE_WAIT;
            fprintf(f, "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\"%s><title>%s: %s: %.2f - %.2f us</title></rect>\n",
                    x0, lane_y[i] + (wait ? 5 : 1), x1 - x0 > 1.2 ? x1 - x0 : 1.2, wait ? 4.0 : SVG_LANE - 4,
                    kind_color(e->kind), wait ? "" : " stroke=\"white\" stroke-width=\"0.2\"",
                    comet_trace_kind_title(e->kind), label,
                    us_since(&v, e->t_begin_ns), us_since(&v, e->t_end_ns));
        }
        fprintf(f, "</g>\n");
    }
#undef X_OF
    fprintf(f, "</svg>\n");
    free(lane_y), free(rank_y), free(sums);
    view_free(&v);
    return close_out(f, path);
}
