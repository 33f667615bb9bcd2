/*
 * rendezvous.c - the meeting point that pairs up collective calls across the
 * rank threads of a world (runtime.h).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime.h"
#include "status.h"

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

void comet_rendezvous_init(comet_world_t *w) {
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
}

void comet_rendezvous_destroy(comet_world_t *w) {
    while (w->pending) { /* only in a world a timeout aborted: calls some ranks never joined */
        comet_rendezvous_t *rv = w->pending;
        w->pending = rv->next;
        free(rv->key);
        free(rv);
    }
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
}

comet_status_t comet_world_rendezvous(comet_world_t *w, int rank, const void *key, size_t key_bytes,
                                      comet_make_fn make, void *arg, void **shared) {
    *shared = NULL;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += w->settings.timeout_ms / 1000;
    deadline.tv_nsec += (long)(w->settings.timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) deadline.tv_sec++, deadline.tv_nsec -= 1000000000L;

    pthread_mutex_lock(&w->mu);
    if (atomic_load(&w->aborted)) { /* a wait timed out before: no collective call meets any more */
        pthread_mutex_unlock(&w->mu);
        return comet_fail(COMET_ERR_TIMEOUT, "rank %d: a wait of this world timed out before; it runs no more "
                          "collective calls (destroy it)", rank);
    }
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
                          rank, (long long)seq, arrived, w->size, w->settings.timeout_ms);
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
