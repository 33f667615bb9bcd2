/*
 * test_trace.c - the trace recorder on the multi-rank CPU engine.
 *   plan:     multi-rank problems traced for one forward; the Chrome-trace
 *             JSON is read back and every task of each rank's plan appears
 *             exactly once (pulls: one per block; GEMM0: blocks x column
 *             tiles; GEMM1: blocks x chunks; sends: chunks x ranks; receives:
 *             one per chunk), every worker with work has its lane, every
 *             interval has begin <= end; the SVG has one lane per worker
 *   bitwise:  the output with tracing on equals the output with tracing off
 *             and the reference, bit for bit
 *   overflow: a recorder too small for the run (few events per lane, too few
 *             lanes, too few ranks) counts what it drops and still writes
 *   api:      bad arguments, NULL handling, clear; a recorder too large
 *             for memory or for size_t fails cleanly
 *   train:    a training step (forward and backward) traced: the backward's
 *             steps in their own kinds, as many as the forward's of each
 *             layer step (the same plan), one transpose event a compute
 *             worker, one weight-gradient event a task; the gradients with
 *             tracing on bitwise the reference's
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../src/core/runtime.h"
#include "../src/core/validate.h"
#include "../src/plan/plan.h"
#include "../src/trace/trace.h"
#include "../harness/workload.h"
#include "check.h"

#define ENGINE_GEMM0_TILE_N 32 /* GEMM0_TILE_N of src/cpu/engine.c: columns of one layer-0 tile */

static char json_path[256], svg_path[256];

/* Run p on a fresh CPU world: `repeats` calls, the last one traced with
 * trace (may be NULL), then the reference into y_ref. n_compute receives the
 * world's compute workers. */
static comet_status_t run_traced(comet_problem_t *p, int n_comm, int chunk, int repeats, comet_trace_t *trace,
                                 int *n_compute) {
    comet_world_t *world;
    comet_status_t st = comet_world_create_local(&world, p->world_size, COMET_BACKEND_CPU);
    if (st) return st;
    if (n_compute) *n_compute = world->settings.cpu_workers;
    comet_run_t run;
    memset(&run, 0, sizeof run);
    run.n_comm = n_comm, run.chunk_cols = chunk, run.repeats = repeats, run.trace = trace;
    comet_problem_poison(p);
    st = comet_problem_run(p, world, &run, 0);
    comet_world_destroy(world);
    if (st == COMET_SUCCESS) st = comet_reference_forward(&p->cfg, p->world_size, p->ref_args); /* poison hit y_ref too */
    return st;
}

static char *read_all(const char *path, long *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) n = 0;
    if (s) s[n] = 0;
    fclose(f);
    if (len) *len = n;
    return s;
}

static int count_substr(const char *s, const char *needle) {
    int n = 0;
    for (const char *q = s; (q = strstr(q, needle)); q += strlen(needle)) n++;
    return n;
}

/* Brackets and braces balance outside strings, and the text is one object. */
static int json_balanced(const char *s) {
    int depth = 0, in_str = 0, seen = 0;
    for (const char *c = s; *c; c++) {
        if (in_str) {
            if (*c == '\\' && c[1]) c++;
            else if (*c == '"') in_str = 0;
            continue;
        }
        if (*c == '"') in_str = 1;
        else if (*c == '{' || *c == '[') depth++, seen = 1;
        else if (*c == '}' || *c == ']') {
            if (--depth < 0) return 0;
        }
    }
    while (*s == ' ' || *s == '\n') s++;
    return seen && depth == 0 && !in_str && *s == '{';
}

typedef struct {
    int n_blocks, n_tiles0, n_chunks;
    int *pull, *gemm0, *gemm1, *send, *recv; /* times seen */
} rank_tasks_t;

/* The plan every rank builds from the staged routing (same inputs). */
static int plan_blocks(const comet_problem_t *p, int rank) {
    comet_dims_t d;
    if (comet_dims_from_config(&p->cfg, p->world_size, rank, &d) != COMET_SUCCESS) return -1;
    void *ws = aligned_alloc(64, (comet_plan_workspace_bytes(&d) + 63) / 64 * 64);
    if (!ws) return -1;
    comet_plan_t plan;
    comet_plan_carve(&d, ws, &plan);
    comet_plan_input_t in = {p->tokens, (const int32_t *const *)p->topk_idx, (const float *const *)p->topk_w};
    comet_plan_build(&d, &in, &plan);
    int nb = plan.totals->num_blocks;
    free(ws);
    return nb;
}

static void test_plan(int tp, int ep, const int64_t *tokens, int n_comm, int chunk, double skew, int zero_experts) {
    const int w = tp * ep;
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 64, cfg.ffn = 96 * tp, cfg.num_experts = 8, cfg.topk = 2, cfg.tp = tp, cfg.ep = ep;
    cfg.max_tokens_per_rank = 16, cfg.tile_m = 4;
    comet_routing_opts_t ro = {skew, zero_experts, 7};
    comet_problem_t *p;
    if (comet_problem_create(&p, &cfg, w, tokens, &ro) != COMET_SUCCESS) {
        CHECK(0, "problem: %s", comet_last_error());
        return;
    }
    comet_trace_t *tr;
    CHECK(comet_trace_create(&tr, w, 0, 0) == COMET_SUCCESS, "create: %s", comet_last_error());
    int n_compute = 0;
    comet_status_t st = run_traced(p, n_comm, chunk, 2, tr, &n_compute);
    CHECK(st == COMET_SUCCESS, "W=%d traced run: %s", w, comet_last_error());
    CHECK(comet_trace_dropped(tr) == 0, "W=%d: %lld dropped", w, (long long)comet_trace_dropped(tr));
    CHECK(comet_problem_count_mismatch(p) == 0, "W=%d traced output differs from the reference", w);

    /* Events in the buffer: begin <= end, from the last call only. */
    {
        int64_t bad = 0, n = 0;
        uint16_t call = 0;
        int call_set = 0, calls_differ = 0;
        for (int64_t s = 0; s < (int64_t)tr->ranks * tr->lanes; s++)
            for (int64_t i = 0; i < (int64_t)tr->counts[s] && i < tr->capacity; i++) {
                const comet_trace_event_t *e = &tr->events[s * tr->capacity + i];
                bad += e->t_begin_ns > e->t_end_ns;
                if (!call_set) call = e->call, call_set = 1;
                calls_differ += e->call != call;
                n++;
            }
        CHECK(bad == 0, "W=%d: %lld events end before they begin", w, (long long)bad);
        CHECK(calls_differ == 0 && call == 2, "W=%d: events of calls other than the last (call %d)", w, call);
        CHECK(n == comet_trace_event_count(tr) && n > 0, "W=%d: %lld events, count says %lld", w, (long long)n,
              (long long)comet_trace_event_count(tr));
    }

    CHECK(comet_trace_write_chrome_json(tr, json_path) == COMET_SUCCESS, "json: %s", comet_last_error());
    CHECK(comet_trace_write_svg(tr, svg_path) == COMET_SUCCESS, "svg: %s", comet_last_error());

    /* What each rank must have done. */
    const int64_t fl = cfg.ffn / tp;
    const int n_chunks = (int)((cfg.hidden + chunk - 1) / chunk);
    rank_tasks_t rt[8];
    for (int r = 0; r < w; r++) {
        rank_tasks_t *t = &rt[r];
        t->n_blocks = plan_blocks(p, r);
        t->n_tiles0 = (int)((fl + ENGINE_GEMM0_TILE_N - 1) / ENGINE_GEMM0_TILE_N);
        t->n_chunks = n_chunks;
        int nb = t->n_blocks > 0 ? t->n_blocks : 1;
        t->pull = calloc((size_t)nb, sizeof(int));
        t->gemm0 = calloc((size_t)(nb * t->n_tiles0), sizeof(int));
        t->gemm1 = calloc((size_t)(nb * n_chunks), sizeof(int));
        t->send = calloc((size_t)(n_chunks * w), sizeof(int));
        t->recv = calloc((size_t)n_chunks, sizeof(int));
    }

    long len = 0;
    char *js = read_all(json_path, &len);
    CHECK(js && len > 0, "cannot read %s", json_path);
    if (js) {
        CHECK(json_balanced(js), "W=%d: the JSON is not one balanced object", w);
        CHECK(strstr(js, "\"traceEvents\"") != NULL, "W=%d: no traceEvents", w);
        int lanes_named[8][3][64];
        memset(lanes_named, 0, sizeof lanes_named);
        int lanes_used[8][3][64];
        memset(lanes_used, 0, sizeof lanes_used);
        int64_t x_events = 0, bad_interval = 0, bad_field = 0, out_of_plan = 0, bad_name = 0;
        for (char *line = strtok(js, "\n"); line; line = strtok(NULL, "\n")) {
            char *ev = strstr(line, "{\"ph\": \"");
            if (!ev) continue;
            int pid, tid;
            static const char thread_name[] = "{\"ph\": \"M\", \"name\": \"thread_name\"";
            if (strncmp(ev, thread_name, strlen(thread_name)) == 0) {
                char *q = strstr(ev, "\"pid\": ");
                if (q && sscanf(q, "\"pid\": %d, \"tid\": %d", &pid, &tid) == 2 && pid >= 0 && pid < w &&
                    tid / 1000 < 3 && tid % 1000 < 64)
                    lanes_named[pid][tid / 1000][tid % 1000]++;
                continue;
            }
            if (strncmp(ev, "{\"ph\": \"X\"", 10) != 0) continue;
            x_events++;
            char *q = strstr(ev, "\"pid\": ");
            double ts, dur;
            char kind[32];
            int index, aux, call;
            if (!q || sscanf(q, "\"pid\": %d, \"tid\": %d, \"ts\": %lf, \"dur\": %lf, \"args\": {\"kind\": \"%31[^\"]\", "
                                "\"index\": %d, \"aux\": %d, \"call\": %d}}",
                             &pid, &tid, &ts, &dur, kind, &index, &aux, &call) != 8 ||
                pid < 0 || pid >= w || tid / 1000 > 2 || tid % 1000 >= 64) {
                bad_field++;
                continue;
            }
            bad_interval += ts < 0 || dur < 0;
            /* The event's name is the trainer's title of its kind; args.step the short label. */
            int kind_id = -1;
            for (int k = 0; k < COMET_TRACE_NUM_KINDS; k++)
                if (strcmp(kind, comet_trace_kind_name(k)) == 0) kind_id = k;
            char want[96];
            snprintf(want, sizeof want, "\"name\": \"%s\"", comet_trace_kind_title(kind_id));
            bad_name += kind_id < 0 || strstr(ev, want) == NULL || strstr(ev, "\"step\": \"") == NULL;
            lanes_used[pid][tid / 1000][tid % 1000]++;
            rank_tasks_t *t = &rt[pid];
            int *slot = NULL;
            if (strcmp(kind, "pull") == 0 && index >= 0 && index < t->n_blocks) slot = &t->pull[index];
            else if (strcmp(kind, "gemm0") == 0 && index >= 0 && index < t->n_blocks && aux >= 0 && aux < t->n_tiles0)
                slot = &t->gemm0[index * t->n_tiles0 + aux];
            else if (strcmp(kind, "gemm1") == 0 && index >= 0 && index < t->n_blocks && aux >= 0 && aux < n_chunks)
                slot = &t->gemm1[index * n_chunks + aux];
            else if (strcmp(kind, "send") == 0 && index >= 0 && index < n_chunks && aux >= 0 && aux < w)
                slot = &t->send[index * w + aux];
            else if (strcmp(kind, "recv") == 0 && index >= 0 && index < n_chunks) slot = &t->recv[index];
            else if (strcmp(kind, "wait") && strcmp(kind, "barrier") && strcmp(kind, "plan"))
                out_of_plan++;
            if (slot) (*slot)++;
            /* Roles: comm steps on comm lanes, GEMM tiles on GEMM lanes. */
            if ((strcmp(kind, "pull") == 0 || strcmp(kind, "send") == 0 || strcmp(kind, "recv") == 0) && tid / 1000 != 1)
                out_of_plan++;
            if ((strcmp(kind, "gemm0") == 0 || strcmp(kind, "gemm1") == 0) && tid / 1000 != 2) out_of_plan++;
        }
        CHECK(x_events == comet_trace_event_count(tr), "W=%d: %lld events in the JSON, %lld recorded", w,
              (long long)x_events, (long long)comet_trace_event_count(tr));
        CHECK(bad_field == 0, "W=%d: %lld events not parsed", w, (long long)bad_field);
        CHECK(bad_name == 0, "W=%d: %lld events without their kind's title as name", w, (long long)bad_name);
        CHECK(bad_interval == 0, "W=%d: %lld intervals with negative time or duration", w, (long long)bad_interval);
        CHECK(out_of_plan == 0, "W=%d: %lld events outside the plan or on the wrong lane", w, (long long)out_of_plan);

        int expected_lanes = 0;
        for (int r = 0; r < w; r++) {
            rank_tasks_t *t = &rt[r];
            int wrong = 0;
            for (int b = 0; b < t->n_blocks; b++) {
                wrong += t->pull[b] != 1;
                for (int k = 0; k < t->n_tiles0; k++) wrong += t->gemm0[b * t->n_tiles0 + k] != 1;
                for (int c = 0; c < n_chunks; c++) wrong += t->gemm1[b * n_chunks + c] != 1;
            }
            for (int c = 0; c < n_chunks; c++) {
                wrong += t->recv[c] != 1;
                for (int h = 0; h < w; h++) wrong += t->send[c * w + h] != 1;
            }
            CHECK(t->n_blocks >= 0 && wrong == 0,
                  "W=%d rank %d: %d tasks not seen exactly once (%d blocks x %d tiles, %d chunks)", w, r, wrong,
                  t->n_blocks, t->n_tiles0, n_chunks);
            /* Lanes: the host, every comm worker, every GEMM worker that had a task. */
            CHECK(lanes_named[r][0][0] == 1 && lanes_used[r][0][0] >= 3, "W=%d rank %d: host lane missing", w, r);
            expected_lanes++;
            for (int k = 0; k < n_comm; k++) {
                int has = k < t->n_blocks || k < n_chunks * w || k < n_chunks;
                CHECK(!has || (lanes_named[r][1][k] == 1 && lanes_used[r][1][k] > 0),
                      "W=%d rank %d: comm worker %d has no lane", w, r, k);
                expected_lanes += has;
            }
            for (int k = 0; k < n_compute && k < 64; k++) {
                int has = k < t->n_blocks * (t->n_tiles0 > n_chunks ? t->n_tiles0 : n_chunks);
                CHECK(!has || (lanes_named[r][2][k] == 1 && lanes_used[r][2][k] > 0),
                      "W=%d rank %d: GEMM worker %d has no lane", w, r, k);
                expected_lanes += has;
            }
        }
        free(js);
        js = read_all(json_path, NULL);
        CHECK(js && count_substr(js, ": rank thread\"}}") == w && strstr(js, "\"name\": \"rank 0: compute worker 0\"}"),
              "W=%d: JSON thread names", w);
        free(js);

        char *svg = read_all(svg_path, NULL);
        CHECK(svg != NULL, "cannot read %s", svg_path);
        if (svg) {
            CHECK(strncmp(svg, "<?xml", 5) == 0 && strstr(svg, "</svg>") != NULL, "W=%d: not an SVG document", w);
            int lanes = count_substr(svg, "<g class=\"lane\"");
            CHECK(lanes == expected_lanes, "W=%d: %d lanes in the SVG, %d workers", w, lanes, expected_lanes);
            CHECK(count_substr(svg, "data-role=\"host\"") == w, "W=%d: %d host lanes", w,
                  count_substr(svg, "data-role=\"host\""));
            CHECK(count_substr(svg, "class=\"rank\"") == w, "W=%d: rank groups", w);
            CHECK(strstr(svg, "#181;s") != NULL, "W=%d: no time axis in microseconds", w);
            /* The summary: one line per rank, the shared clock said. */
            CHECK(count_substr(svg, "</tspan> layer ") == w && strstr(svg, "share one clock (CLOCK_MONOTONIC)"),
                  "W=%d: summary lines", w);
            /* Lanes named for what the CPU engine runs on them. */
            CHECK(count_substr(svg, ": rank thread</text>") == w && strstr(svg, ">rank 0: comm worker 0</text>") &&
                      strstr(svg, ">rank 0: compute worker 0</text>"),
                  "W=%d: lanes not named rank thread / comm worker / compute worker", w);
            for (int k = 0; k < COMET_TRACE_NUM_KINDS; k++) /* the legend */
                CHECK(strstr(svg, comet_trace_kind_title(k)) != NULL, "W=%d: %s not in the SVG", w,
                      comet_trace_kind_title(k));
            free(svg);
        }
    }
    for (int r = 0; r < w; r++)
        free(rt[r].pull), free(rt[r].gemm0), free(rt[r].gemm1), free(rt[r].send), free(rt[r].recv);

    /* Tracing off: the same bits. */
    uint16_t *y_on[8];
    for (int r = 0; r < w; r++) {
        size_t n = (size_t)(p->tokens[r] * cfg.hidden);
        y_on[r] = malloc(n * 2 + 2);
        memcpy(y_on[r], p->y[r], n * 2);
    }
    st = run_traced(p, n_comm, chunk, 1, NULL, NULL);
    CHECK(st == COMET_SUCCESS, "W=%d untraced run: %s", w, comet_last_error());
    int same = 1;
    for (int r = 0; r < w; r++) {
        same &= memcmp(y_on[r], p->y[r], (size_t)(p->tokens[r] * cfg.hidden) * 2) == 0;
        free(y_on[r]);
    }
    CHECK(same, "W=%d: output with tracing on differs from tracing off", w);
    CHECK(comet_problem_count_mismatch(p) == 0, "W=%d untraced output differs from the reference", w);
    comet_trace_destroy(tr);
    comet_problem_destroy(p);
}

/* ---- overflow ----------------------------------------------------------------
 * Lanes of 3 events, 2 lanes per rank (host and comm 0; the rest are out of
 * range), and a recorder for 1 rank of a 2-rank world. */
static void test_overflow(void) {
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 64, cfg.ffn = 96, cfg.num_experts = 4, cfg.topk = 2, cfg.tp = 1, cfg.ep = 2;
    cfg.max_tokens_per_rank = 16, cfg.tile_m = 4;
    int64_t tokens[2] = {16, 11};
    comet_routing_opts_t ro = {0, 0, 3};
    comet_problem_t *p;
    if (comet_problem_create(&p, &cfg, 2, tokens, &ro) != COMET_SUCCESS) {
        CHECK(0, "problem: %s", comet_last_error());
        return;
    }
    struct {
        int ranks, lanes;
        int64_t events;
    } cases[3] = {{2, 2, 3}, {1, 0, 0}, {2, 0, 1}};
    for (int i = 0; i < 3; i++) {
        comet_trace_t *tr;
        if (comet_trace_create(&tr, cases[i].ranks, cases[i].lanes, cases[i].events) != COMET_SUCCESS) {
            CHECK(0, "create: %s", comet_last_error());
            continue;
        }
        comet_status_t st = run_traced(p, 2, 16, 1, tr, NULL);
        CHECK(st == COMET_SUCCESS, "case %d: run: %s", i, comet_last_error());
        CHECK(comet_problem_count_mismatch(p) == 0, "case %d: output differs from the reference", i);
        int64_t kept = comet_trace_event_count(tr), dropped = comet_trace_dropped(tr);
        CHECK(dropped > 0, "case %d: nothing dropped (%lld kept)", i, (long long)kept);
        CHECK(kept > 0 && kept <= (int64_t)tr->ranks * tr->lanes * tr->capacity, "case %d: %lld kept", i,
              (long long)kept);
        CHECK(comet_trace_write_chrome_json(tr, json_path) == COMET_SUCCESS, "case %d: json: %s", i,
              comet_last_error());
        CHECK(comet_trace_write_svg(tr, svg_path) == COMET_SUCCESS, "case %d: svg: %s", i, comet_last_error());
        char *js = read_all(json_path, NULL);
        CHECK(js && json_balanced(js) && count_substr(js, "{\"ph\": \"X\"") == kept, "case %d: JSON of %lld events", i,
              (long long)kept);
        free(js);
        CHECK(comet_trace_clear(tr) == COMET_SUCCESS && comet_trace_event_count(tr) == 0 &&
                  comet_trace_dropped(tr) == 0,
              "case %d: clear", i);
        comet_trace_destroy(tr);
    }
    comet_problem_destroy(p);
}

/* ---- api ----------------------------------------------------------------------- */
static void test_api(void) {
    comet_trace_t *tr = (comet_trace_t *)&tr;
    CHECK(comet_trace_create(NULL, 1, 0, 0) == COMET_ERR_INVALID_ARGUMENT, "NULL out");
    CHECK(comet_trace_create(&tr, 0, 0, 0) == COMET_ERR_INVALID_ARGUMENT && tr == NULL, "0 ranks");
    CHECK(comet_trace_create(&tr, 1, -1, 0) == COMET_ERR_INVALID_ARGUMENT, "negative lanes");
    CHECK(comet_trace_create(&tr, 1, 0, -5) == COMET_ERR_INVALID_ARGUMENT, "negative events");
    CHECK(strstr(comet_last_error(), "events_per_lane") != NULL, "message names the field: %s", comet_last_error());
    CHECK(comet_trace_destroy(NULL) == COMET_SUCCESS, "destroy NULL");
    CHECK(comet_layer_set_trace(NULL, NULL) == COMET_ERR_INVALID_ARGUMENT, "set_trace on NULL layer");
    CHECK(comet_trace_event_count(NULL) == 0 && comet_trace_dropped(NULL) == 0, "counts of NULL");
    CHECK(comet_trace_write_svg(NULL, svg_path) == COMET_ERR_INVALID_ARGUMENT, "write NULL trace");
    CHECK(comet_trace_create(&tr, 1, 1, 1) == COMET_SUCCESS, "create: %s", comet_last_error());
    /* An empty trace still writes valid files. */
    CHECK(comet_trace_write_chrome_json(tr, json_path) == COMET_SUCCESS, "empty json: %s", comet_last_error());
    CHECK(comet_trace_write_svg(tr, svg_path) == COMET_SUCCESS, "empty svg: %s", comet_last_error());
    char *js = read_all(json_path, NULL);
    CHECK(js && json_balanced(js), "empty trace: JSON not balanced");
    free(js);
    CHECK(comet_trace_write_svg(tr, "/nonexistent-dir/x.svg") == COMET_ERR_SYSTEM &&
              strstr(comet_last_error(), "/nonexistent-dir/x.svg") != NULL,
          "unwritable path: %s", comet_last_error());
    /* Recording outside the recorder is counted, never written. */
    comet_trace_event_t ev = {1, 2, 0, 0, 5, 0, COMET_TRACE_COMM, COMET_TRACE_PULL, 1};
    comet_trace_record(tr, 0, &ev);
    ev.rank = 0;
    comet_trace_record(tr, 3, &ev);
    comet_trace_record(tr, 0, &ev);
    comet_trace_record(tr, 0, &ev);
    CHECK(comet_trace_event_count(tr) == 1 && comet_trace_dropped(tr) == 3, "kept %lld dropped %lld",
          (long long)comet_trace_event_count(tr), (long long)comet_trace_dropped(tr));
    comet_trace_destroy(tr);
}

/* ---- summary -------------------------------------------------------------------
 * Hand-made events: rank 0 (no backend) with GEMMs on two lanes, dispatch
 * and a send around a wait; rank 1 (the CUDA layout) 3.2 us later with a
 * stream step and a GEMM1 kernel only. The summary's numbers, the lane
 * names of both layouts and the ranks' offsets. */
static void test_summary(void) {
    comet_trace_t *tr;
    if (comet_trace_create(&tr, 2, 11, 8) != COMET_SUCCESS) {
        CHECK(0, "create: %s", comet_last_error());
        return;
    }
    const comet_trace_event_t ev[] = {
        {0, 50, 1, -1, 0, 0, COMET_TRACE_HOST, COMET_TRACE_BARRIER, 1},  {100, 300, 0, 0, 0, 0, COMET_TRACE_GEMM, COMET_TRACE_GEMM0, 1},
        {250, 400, 1, 0, 0, 1, COMET_TRACE_GEMM, COMET_TRACE_GEMM0, 1}, {350, 500, 0, 0, 0, 0, COMET_TRACE_COMM, COMET_TRACE_PULL, 1},
        {500, 600, 0, 3, 0, 0, COMET_TRACE_COMM, COMET_TRACE_WAIT, 1},  {600, 700, 0, 1, 0, 0, COMET_TRACE_COMM, COMET_TRACE_SEND, 1},
        {3200, 3300, 1, -1, 1, 0, COMET_TRACE_HOST, COMET_TRACE_BARRIER, 1},
        {3400, 5400, -1, -1, 1, 1, COMET_TRACE_GEMM, COMET_TRACE_GEMM1, 1}};
    const int lane[] = {0, 9, 10, 1, 1, 1, 0, 10};
    for (int i = 0; i < 8; i++) comet_trace_record(tr, lane[i], &ev[i]);
    comet_trace_set_layout(tr, 1, COMET_TRACE_LAYOUT_CUDA);
    comet_trace_set_layout(tr, 7, COMET_TRACE_LAYOUT_CUDA); /* outside: ignored */
    CHECK(comet_trace_write_chrome_json(tr, json_path) == COMET_SUCCESS, "json: %s", comet_last_error());
    CHECK(comet_trace_write_svg(tr, svg_path) == COMET_SUCCESS, "svg: %s", comet_last_error());
    char *js = read_all(json_path, NULL), *svg = read_all(svg_path, NULL);
    CHECK(js && json_balanced(js), "summary: JSON not balanced");
    /* rank 0: layer 0..700 ns; GEMM union [100, 400]; comm union [350, 500] + [600, 700]; overlap [350, 400] */
    CHECK(js && strstr(js, "\"layer_us_max\": 2.200") &&
              strstr(js, "{\"rank\": 0, \"backend\": \"unknown\", \"start_us\": 0.000, \"layer_us\": 0.700, "
                         "\"gemm_busy_us\": 0.300, \"comm_busy_us\": 0.250, \"comm_hidden_us\": 0.050, \"comm_hidden\": 0.2000}") &&
              strstr(js, "{\"rank\": 1, \"backend\": \"cuda\", \"start_us\": 3.200, \"layer_us\": 2.200, "
                         "\"gemm_busy_us\": 2.000, \"comm_busy_us\": 0.000, \"comm_hidden_us\": 0.000, \"comm_hidden\": null}"),
          "summary in otherData:\n%.900s", js ? js : "");
    CHECK(js && strstr(js, "\"name\": \"rank 1 (+3.2 us)\"") && strstr(js, "\"name\": \"rank 1: GEMM1 kernel\"") &&
              strstr(js, "\"name\": \"rank 1: stream\"") && strstr(js, "\"name\": \"rank 0: gemm 1\"") &&
              strstr(js, "\"name\": \"rank 0: host\""),
          "summary: process and thread names");
    CHECK(svg && strstr(svg, "layer 2.2 us (slowest rank") && strstr(svg, "250.0 ns") == NULL &&
              strstr(svg, "layer 0.7 us (starts at +0.0 us) | GEMM busy 0.3 us | communication busy 0.2 us, 20.0% of it hidden") &&
              strstr(svg, "layer 2.2 us (starts at +3.2 us) | GEMM busy 2.0 us | communication busy 0.0 us, none to hide") &&
              strstr(svg, ">rank 1 (+3.2 us)</text>") && strstr(svg, "own %globaltimer"),
          "summary lines in the SVG");
    free(js), free(svg);
    comet_trace_destroy(tr);
}

/* ---- too large ------------------------------------------------------------------ */
/* The allocation failure below is real (a recorder of 2^52 bytes): the
 * sanitizers' allocators return NULL for it, as libc's does, instead of
 * aborting the test. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "allocator_may_return_null=1"; }
const char *__tsan_default_options(void);
const char *__tsan_default_options(void) { return "allocator_may_return_null=1"; }

static void test_too_large(void) {
    comet_trace_t *tr = (comet_trace_t *)&tr;
    comet_status_t st = comet_trace_create(&tr, 1, 65536, (int64_t)1 << 31); /* 2^47 events of 32 bytes */
    CHECK(st == COMET_ERR_OUT_OF_MEMORY && tr == NULL && strstr(comet_last_error(), "65536 lanes"),
          "out of memory: %s \"%s\"", comet_status_string(st), comet_last_error());
    tr = (comet_trace_t *)&tr;
    st = comet_trace_create(&tr, 65535, 65536, (int64_t)1 << 31); /* ranks x lanes x events x 32 overflows */
    CHECK((st == COMET_ERR_INVALID_ARGUMENT || st == COMET_ERR_OUT_OF_MEMORY) && tr == NULL,
          "size overflow: %s \"%s\"", comet_status_string(st), comet_last_error());
}

/* ---- a training step ------------------------------------------------------------- */
static void test_train(int tp, int ep, const int64_t *tokens) {
    const int w = tp * ep;
    comet_layer_config_t cfg = COMET_LAYER_CONFIG_INIT;
    cfg.hidden = 64, cfg.ffn = 96 * tp, cfg.num_experts = 8, cfg.topk = 2, cfg.tp = tp, cfg.ep = ep;
    cfg.max_tokens_per_rank = 16, cfg.tile_m = 4;
    comet_routing_opts_t ro = {0.2, 1, 9};
    comet_problem_t *p;
    if (comet_problem_create(&p, &cfg, w, tokens, &ro) != COMET_SUCCESS) {
        CHECK(0, "train: problem: %s", comet_last_error());
        return;
    }
    comet_trace_t *tr;
    comet_world_t *world;
    CHECK(comet_trace_create(&tr, w, 0, 0) == COMET_SUCCESS, "train: create: %s", comet_last_error());
    CHECK(comet_world_create_local(&world, w, COMET_BACKEND_CPU) == COMET_SUCCESS, "train: world: %s", comet_last_error());
    const int n_compute = world->settings.cpu_workers;
    comet_run_t run;
    memset(&run, 0, sizeof run);
    run.n_comm = 2, run.repeats = 2, run.trace = tr, run.train = COMET_SAVE_ACTIVATIONS, run.train_sample = -1;
    comet_status_t st = comet_problem_run(p, world, &run, 0);
    comet_world_destroy(world);
    CHECK(st == COMET_SUCCESS, "train W=%d: %s", w, comet_last_error());
    CHECK(comet_trace_dropped(tr) == 0, "train W=%d: %lld dropped", w, (long long)comet_trace_dropped(tr));
    const struct comet_train_check *g = &run.train_check;
    CHECK(st == COMET_SUCCESS && g->elements[2] > 0 && !g->differ[0] && !g->differ[1] && !g->differ[2] && !g->differ[3],
          "train W=%d: traced gradients not bitwise the reference's (%lld %lld %lld %lld differ)", w,
          (long long)g->differ[0], (long long)g->differ[1], (long long)g->differ[2], (long long)g->differ[3]);
    CHECK(comet_trace_write_chrome_json(tr, json_path) == COMET_SUCCESS, "train: json: %s", comet_last_error());
    CHECK(comet_trace_write_svg(tr, svg_path) == COMET_SUCCESS, "train: svg: %s", comet_last_error());
    char *js = read_all(json_path, NULL);
    int64_t count[8][COMET_TRACE_NUM_KINDS];
    memset(count, 0, sizeof count);
    for (const char *q = js ? strstr(js, "\"ph\": \"X\"") : NULL; q; q = strstr(q + 1, "\"ph\": \"X\"")) {
        const char *pid = strstr(q, "\"pid\": "), *kind = strstr(q, "\"kind\": \"");
        if (!pid || !kind) break;
        const int r = atoi(pid + 7);
        char name[32] = "";
        sscanf(kind + 9, "%31[^\"]", name);
        for (int k = 0; k < COMET_TRACE_NUM_KINDS; k++)
            if (r >= 0 && r < 8 && strcmp(name, comet_trace_kind_name(k)) == 0) count[r][k]++;
    }
    const int64_t r1 = 2 * 96, tasks = (cfg.num_experts / ep) * ((r1 + 3) / 4 + (cfg.hidden + 3) / 4); /* WG_KB 4 */
    for (int r = 0; r < w; r++) {
        const int64_t *c = count[r];
        CHECK(c[COMET_TRACE_BPULL] == c[COMET_TRACE_PULL] && c[COMET_TRACE_BGEMM1] == c[COMET_TRACE_GEMM1] &&
                  c[COMET_TRACE_BSEND] == c[COMET_TRACE_SEND] && c[COMET_TRACE_BRECV] == c[COMET_TRACE_RECV] &&
                  c[COMET_TRACE_BGEMM0] == c[COMET_TRACE_PULL] && c[COMET_TRACE_PULL] > 0,
              "train W=%d rank %d: the backward's steps (pull %lld, gemm0 %lld, gemm1 %lld, send %lld, recv %lld) are "
              "not the forward's (pull %lld blocks, gemm1 %lld, send %lld, recv %lld)", w, r,
              (long long)c[COMET_TRACE_BPULL], (long long)c[COMET_TRACE_BGEMM0], (long long)c[COMET_TRACE_BGEMM1],
              (long long)c[COMET_TRACE_BSEND], (long long)c[COMET_TRACE_BRECV], (long long)c[COMET_TRACE_PULL],
              (long long)c[COMET_TRACE_GEMM1], (long long)c[COMET_TRACE_SEND], (long long)c[COMET_TRACE_RECV]);
        CHECK(c[COMET_TRACE_TRANSPOSE] == n_compute, "train W=%d rank %d: %lld transpose events, %d workers", w, r,
              (long long)c[COMET_TRACE_TRANSPOSE], n_compute);
        CHECK(c[COMET_TRACE_WGRAD] == tasks, "train W=%d rank %d: %lld weight-gradient events, %lld tasks", w, r,
              (long long)c[COMET_TRACE_WGRAD], (long long)tasks);
    }
    free(js);
    comet_trace_destroy(tr);
    comet_problem_destroy(p);
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(json_path, sizeof json_path, "%s/comet_test_trace_%d.json", tmp && *tmp ? tmp : "/tmp", (int)getpid());
    snprintf(svg_path, sizeof svg_path, "%s/comet_test_trace_%d.svg", tmp && *tmp ? tmp : "/tmp", (int)getpid());
    test_api();
    test_too_large();
    test_summary();
    int64_t t2[2] = {13, 9}, t4[4] = {7, 0, 11, 5}, t1[1] = {16};
    test_plan(1, 2, t2, 2, 16, 0.0, 0);
    test_plan(2, 2, t4, 3, 24, 0.3, 2);
    test_plan(1, 4, t4, 2, 64, 0.0, 0);
    test_plan(1, 1, t1, 1, 40, 0.0, 0);
    test_overflow();
    int64_t tt2[2] = {11, 16}, tt4[4] = {5, 0, 16, 9};
    test_train(1, 2, tt2);
    test_train(2, 2, tt4);
    test_train(2, 1, tt2);
    remove(json_path);
    remove(svg_path);
    return check_summary("test_trace");
}
