/*
 * world.c - worlds (groups of ranks in this process) and the rendezvous that
 * pairs up collective calls across rank threads.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime.h"
#include "status.h"
#include "validate.h"

struct comet_rendezvous {
    int64_t seq;
    int arrived;
    int mismatch;             /* a rank brought a different key */
    int failed_rank;          /* a rank that failed before the call (no key), or -1 */
    int no_memory;            /* make() failed */
    int released;             /* ranks that have left with the shared object */
    void *shared;
    void *key;
    size_t key_bytes;
    comet_rendezvous_t *next;
};

static int env_int(const char *name, int fallback, int lo, int hi) {
    const char *s = getenv(name);
    if (!s || !*s) return fallback;
    char *end;
    long v = strtol(s, &end, 10);
    if (*end || v < lo || v > hi) return fallback;
    return (int)v;
}

/* The body of both constructors: local worlds (local_rank < 0) and one rank
 * of a world spread over processes (local_rank >= 0, CUDA only). */
static comet_status_t world_create(comet_world_t **world, int num_ranks, comet_backend_t backend, int local_rank,
                                   const comet_unique_id_t *id, int device) {
    comet_clear_error();
    if (!world) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "world is NULL");
    *world = NULL;
    if (num_ranks < 1 || num_ranks > COMET_MAX_RANKS)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "num_ranks %d is outside [1, %d]", num_ranks, COMET_MAX_RANKS);
#ifndef COMET_WITH_CUDA
    if (backend == COMET_BACKEND_CUDA)
        return comet_fail(COMET_ERR_UNSUPPORTED, "this build has no CUDA backend (built without nvcc); use COMET_BACKEND_CPU");
#endif
    if (backend != COMET_BACKEND_CPU && backend != COMET_BACKEND_CUDA)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "backend %d is not a comet_backend_t", (int)backend);
    comet_world_t *w = calloc(1, sizeof *w);
    int64_t *seq = calloc((size_t)num_ranks, sizeof *seq);
    if (!w || !seq) {
        free(w), free(seq);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "world: no memory");
    }
    w->size = num_ranks;
    w->backend = backend;
    w->timeout_ms = env_int("COMET_TIMEOUT_MS", 60000, 1, 3600 * 1000);
    w->cpu_workers = env_int("COMET_CPU_WORKERS", 2, 1, 256);
    w->next_seq = seq;
    w->local_rank = local_rank;
    atomic_init(&w->aborted, 0);
    atomic_init(&w->live_layers, 0);
#ifdef COMET_WITH_CUDA
    if (backend == COMET_BACKEND_CUDA) {
        comet_status_t st = comet_cuda_world_init(w, id ? id->bytes : NULL, local_rank >= 0 ? device : -1);
        if (st != COMET_SUCCESS) {
            free(w->next_seq);
            free(w);
            return st;
        }
    }
#endif
    (void)id, (void)device;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    *world = w;
    return COMET_SUCCESS;
}

comet_status_t comet_world_create_local(comet_world_t **world, int num_ranks, comet_backend_t backend) {
    return world_create(world, num_ranks, backend, -1, NULL, -1);
}

comet_status_t comet_world_create_nccl(comet_world_t **world, int rank, int world_size, const comet_unique_id_t *id,
                                       int device) {
    comet_clear_error();
    if (!world) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "world is NULL");
    *world = NULL;
    if (!id) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "id is NULL");
    if (world_size < 1 || rank < 0 || rank >= world_size)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "rank %d of world_size %d is not a rank", rank, world_size);
    if (device < 0) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "device %d < 0", device);
    return world_create(world, world_size, COMET_BACKEND_CUDA, rank, id, device);
}

comet_status_t comet_get_unique_id(comet_unique_id_t *id) {
    comet_clear_error();
    if (!id) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "id is NULL");
#ifdef COMET_WITH_CUDA
    return comet_cuda_unique_id(id->bytes);
#else
    return comet_fail(COMET_ERR_UNSUPPORTED, "this build has no CUDA backend (built without nvcc)");
#endif
}

comet_status_t comet_world_destroy(comet_world_t *w) {
    comet_clear_error();
    if (!w) return COMET_SUCCESS;
    const int live = atomic_load(&w->live_layers);
    if (live > 0)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "world still has %d layer%s: destroy them first", live,
                          live == 1 ? "" : "s");
    if (w->pending) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "world still has a collective call in progress");
#ifdef COMET_WITH_CUDA
    if (w->backend == COMET_BACKEND_CUDA) comet_cuda_world_destroy(w);
#endif
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w->next_seq);
    free(w);
    return COMET_SUCCESS;
}

int comet_world_size(const comet_world_t *w) { return w ? w->size : 0; }

comet_backend_t comet_world_backend(const comet_world_t *w) { return w ? w->backend : COMET_BACKEND_CPU; }

int comet_world_local_rank(const comet_world_t *w) { return w ? w->local_rank : -1; }

int comet_world_device(const comet_world_t *w, int rank) {
    if (!w || w->backend != COMET_BACKEND_CUDA || rank < 0 || rank >= w->size) return -1;
    if (w->local_rank < 0) return rank;
#ifdef COMET_WITH_CUDA
    return rank == w->local_rank ? comet_cuda_world_device(w) : -1;
#else
    return -1;
#endif
}

int comet_device_count(void) {
#ifdef COMET_WITH_CUDA
    return comet_cuda_device_count();
#else
    return 0;
#endif
}

comet_status_t comet_world_rendezvous(comet_world_t *w, int rank, const void *key, size_t key_bytes,
                                      comet_make_fn make, void *arg, void **shared) {
    *shared = NULL;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += w->timeout_ms / 1000;
    deadline.tv_nsec += (long)(w->timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) deadline.tv_sec++, deadline.tv_nsec -= 1000000000L;

    pthread_mutex_lock(&w->mu);
    int64_t seq = w->next_seq[rank]++;
    comet_rendezvous_t *rv = w->pending;
    while (rv && rv->seq != seq) rv = rv->next;
    if (!rv) {
        rv = calloc(1, sizeof *rv);
        if (!rv) {
            w->next_seq[rank]--;
            pthread_mutex_unlock(&w->mu);
            return comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: no memory for the shared state of collective call %lld",
                              rank, (long long)seq);
        }
        rv->seq = seq;
        rv->failed_rank = -1;
        rv->next = w->pending;
        w->pending = rv;
    }
    if (!key) { /* a failed rank: it compares and makes nothing */
        if (rv->failed_rank < 0) rv->failed_rank = rank;
    } else if (!rv->key && !rv->mismatch) { /* the first key brought */
        rv->key = malloc(key_bytes ? key_bytes : 1);
        if (rv->key) memcpy(rv->key, key, key_bytes), rv->key_bytes = key_bytes;
        else rv->no_memory = 1;
    } else if (!rv->key || rv->key_bytes != key_bytes || memcmp(rv->key, key, key_bytes) != 0) {
        rv->mismatch = 1;
    }
    /* The shared object is made once every rank has arrived, and only when the
     * call will succeed: no rank is left holding one that the others lack. */
    if (++rv->arrived == w->size && rv->failed_rank < 0 && !rv->mismatch && !rv->no_memory) {
        rv->shared = make(arg);
        rv->no_memory = !rv->shared;
    }
    pthread_cond_broadcast(&w->cv);
    int err = 0;
    while (rv->arrived < w->size && err == 0) err = pthread_cond_timedwait(&w->cv, &w->mu, &deadline);
    if (rv->arrived < w->size) {
        /* Leave the record for late ranks; this world is unusable now. */
        atomic_store(&w->aborted, 1);
        int arrived = rv->arrived;
        pthread_mutex_unlock(&w->mu);
        return comet_fail(COMET_ERR_TIMEOUT, "rank %d: collective call %lld: only %d of %d ranks arrived within %d ms",
                          rank, (long long)seq, arrived, w->size, w->timeout_ms);
    }
    const int mismatch = rv->mismatch, failed_rank = rv->failed_rank, no_memory = rv->no_memory;
    *shared = rv->shared;
    if (++rv->released == w->size) { /* last one out removes the record */
        comet_rendezvous_t **pp = &w->pending;
        while (*pp != rv) pp = &(*pp)->next;
        *pp = rv->next;
        free(rv->key);
        free(rv);
    }
    pthread_mutex_unlock(&w->mu);
    if (failed_rank >= 0)
        return comet_fail(COMET_ERR_PEER_FAILED, "rank %d: rank %d failed before collective call %lld", rank, failed_rank,
                          (long long)seq);
    if (no_memory)
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: no memory for the shared state of collective call %lld",
                          rank, (long long)seq);
    if (mismatch)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT,
                          "rank %d: ranks passed different arguments to collective call %lld", rank, (long long)seq);
    return COMET_SUCCESS;
}

comet_status_t comet_world_rendezvous_failed(comet_world_t *w, int rank) {
    char msg[1024]; /* the caller's own failure stays the message */
    snprintf(msg, sizeof msg, "%s", comet_last_error());
    void *unused;
    comet_status_t st = comet_world_rendezvous(w, rank, NULL, 0, NULL, NULL, &unused);
    comet_fail_copy(st, msg);
    return st;
}
