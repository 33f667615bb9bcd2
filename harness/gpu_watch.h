/*
 * harness/gpu_watch.h - benchmark harness (header only, used by the CLI's
 * tools/run.c and tools/report.c), not part of the library: what the GPUs'
 * clocks did over the timed forwards of a `comet bench` call: a thread
 * samples every GPU of this node through NVML
 * (harness/gpu_power.h) every 10 ms (5 ms a GPU beyond two); at the end, each
 * GPU's mean SM clock over the samples, its mean power (energy counter over
 * the span, if it lasted a second) and the clock-limit reasons seen. The
 * bench opens the watch before the run (gpu_watch_open: NVML's loading and
 * init stay out of every timed call), and the runner's comet_run_t.timed
 * mark starts and stops the thread (gpu_watch_mark) around the timed
 * forwards alone. Over the whole call, with the weight and input uploads,
 * the graph capture and the warm-up, the means read high (1x H200, Mixtral
 * M=16384 EP1: 20 forwards 1638-1692 MHz and 348-386 W, 200 forwards
 * 1477-1504 MHz and 599-623 W, at the same 17.3-17.8 ms a forward). Under
 * sustained load an H200 runs at its 700 W limit and a GEMM-bound layer
 * moves by up to 10% from call to call with the clock, so a bench row
 * records it. Without NVML nothing is watched (n = 0).
 */
#ifndef COMET_HARNESS_GPU_WATCH_H
#define COMET_HARNESS_GPU_WATCH_H

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "gpu_power.h"

#define GPU_WATCH_MAX 16
/* Shortest span (s) whose mean power the energy counter gives: it moves in
 * steps of tens of ms (1x H200: 801-868 W over 0.35 s under a 700 W limit, 0
 * W over the 22 ms of 20 Qwen2 forwards). */
#define GPU_WATCH_MIN_SPAN 1.0

typedef struct {
    int n;       /* GPUs watched; 0: none (no NVML) */
    int running; /* the sampling thread runs (gpu_watch_start .. gpu_watch_stop) */
    gpu_power_t dev[GPU_WATCH_MAX];
    double t0, joules0[GPU_WATCH_MAX], mhz_sum[GPU_WATCH_MAX];
    long samples[GPU_WATCH_MAX];
    unsigned long long reasons[GPU_WATCH_MAX]; /* OR over the samples */
    double span;                                     /* gpu_watch_stop: seconds watched */
    double mhz[GPU_WATCH_MAX], watts[GPU_WATCH_MAX]; /* gpu_watch_stop's results (0: not read; watts also 0
                                                      * for a span under GPU_WATCH_MIN_SPAN) */
    atomic_int stop;
    pthread_t thread;
} gpu_watch_t;

static inline double gpu_watch_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static inline void *gpu_watch_loop(void *arg) {
    gpu_watch_t *w = (gpu_watch_t *)arg;
    /* 10 ms, or 5 ms a GPU on nodes of more than two: each tick makes three NVML calls a GPU */
    const long ms = w->n > 2 ? 5L * w->n : 10L;
    const struct timespec tick = {ms / 1000, (ms % 1000) * 1000 * 1000};
    while (!atomic_load(&w->stop)) {
        nanosleep(&tick, NULL);
        for (int i = 0; i < w->n; i++) {
            gpu_power_sample_t s;
            if (gpu_power_read(&w->dev[i], &s)) w->mhz_sum[i] += s.mhz, w->samples[i]++, w->reasons[i] |= s.reasons;
        }
    }
    return NULL;
}

/* Opens every GPU NVML sees (at most GPU_WATCH_MAX): the library's loading and
 * nvmlInit (can take hundreds of ms) happen here, before anything is timed;
 * w->n = 0 when it cannot. */
static inline void gpu_watch_open(gpu_watch_t *w) {
    memset(w, 0, sizeof *w);
    const int n = gpu_power_count() < GPU_WATCH_MAX ? gpu_power_count() : GPU_WATCH_MAX;
    for (int i = 0; i < n; i++) {
        gpu_power_sample_t s;
        gpu_power_open_index(&w->dev[i], i);
        if (!gpu_power_read(&w->dev[i], &s)) return; /* w->n stays 0 */
    }
    w->n = n;
}

/* Starts the sampling thread on an opened watch (nothing without GPUs). */
static inline void gpu_watch_start(gpu_watch_t *w) {
    if (!w->n || w->running) return;
    for (int i = 0; i < w->n; i++) {
        gpu_power_sample_t s;
        w->joules0[i] = gpu_power_read(&w->dev[i], &s) ? s.joules : 0;
    }
    w->t0 = gpu_watch_now();
    atomic_init(&w->stop, 0);
    w->running = pthread_create(&w->thread, NULL, gpu_watch_loop, w) == 0;
}

/* Whether gpu_watch_stop's span was long enough for watts[] to be measured. */
static inline int gpu_watch_has_power(const gpu_watch_t *w) { return w->span >= GPU_WATCH_MIN_SPAN; }

/* Stops the thread and fills span, mhz[] and watts[] (a GPU with no sample in
 * between gets one now). */
static inline void gpu_watch_stop(gpu_watch_t *w) {
    if (!w->running) return;
    atomic_store(&w->stop, 1);
    pthread_join(w->thread, NULL);
    w->running = 0;
    w->span = gpu_watch_now() - w->t0;
    for (int i = 0; i < w->n; i++) {
        gpu_power_sample_t s;
        if (!gpu_power_read(&w->dev[i], &s)) continue;
        if (!w->samples[i]) w->mhz_sum[i] = s.mhz, w->samples[i] = 1, w->reasons[i] |= s.reasons;
        w->mhz[i] = w->mhz_sum[i] / w->samples[i];
        w->watts[i] = gpu_watch_has_power(w) && w->joules0[i] > 0 ? (s.joules - w->joules0[i]) / w->span : 0;
    }
}

/* comet_run_t.timed's shape: start watching (end 0), or stop (end 1); w a gpu_watch_t
 * gpu_watch_open has opened. */
static inline void gpu_watch_mark(void *w, int end) {
    if (end)
        gpu_watch_stop((gpu_watch_t *)w);
    else
        gpu_watch_start((gpu_watch_t *)w);
}

#endif
