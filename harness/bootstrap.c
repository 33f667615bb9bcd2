/*
 * harness/bootstrap.c - harness code, not part of the library
 * (libcomet_harness.a): the TCP channel between rank 0 and every other rank (see
 * bootstrap.h). Rank 0 accepts size-1 connections; each connecting rank first
 * sends its rank number, so rank 0 files the sockets by rank. Messages are
 * fixed-size: the caller knows n on every side.
 */
#include "bootstrap.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../src/core/status.h"

struct comet_bootstrap {
    int rank, size, timeout_ms;
    int *peer; /* rank 0: [size] sockets by rank (peer[0] unused); others: peer[0] to rank 0 */
};

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* Send or receive exactly n bytes, each wait bounded by the timeout. */
static comet_status_t xfer(const comet_bootstrap_t *bs, int fd, void *buf, size_t n, int sending, const char *what) {
    char *p = buf;
    double deadline = now_ms() + bs->timeout_ms;
    while (n > 0) {
        struct pollfd pfd = {fd, (short)(sending ? POLLOUT : POLLIN), 0};
        int left = (int)(deadline - now_ms());
        int r = left > 0 ? poll(&pfd, 1, left) : 0;
        if (r == 0)
            return comet_fail(COMET_ERR_TIMEOUT, "rank %d: bootstrap: timed out after %d ms in %s", bs->rank,
                              bs->timeout_ms, what);
        if (r < 0 && errno == EINTR) continue;
        ssize_t k = r < 0 ? -1 : sending ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (k <= 0)
            return comet_fail(COMET_ERR_SYSTEM, "rank %d: bootstrap: %s: %s", bs->rank, what,
                              k == 0 ? "the peer closed the connection" : strerror(errno));
        p += k, n -= (size_t)k;
    }
    return COMET_SUCCESS;
}

void comet_bootstrap_close(comet_bootstrap_t *bs) {
    if (!bs) return;
    for (int i = 0; i < (bs->rank == 0 ? bs->size : 1); i++)
        if (bs->peer[i] >= 0) close(bs->peer[i]);
    free(bs->peer);
    free(bs);
}

static comet_status_t listen_and_accept(comet_bootstrap_t *bs, const char *host, int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return comet_fail(COMET_ERR_SYSTEM, "rank 0: bootstrap: socket: %s", strerror(errno));
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)port);
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    (void)host; /* rank 0 listens on every interface; host is where the others find it */
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(fd, bs->size) != 0) {
        comet_status_t st = comet_fail(COMET_ERR_SYSTEM, "rank 0: bootstrap: cannot listen on port %d: %s", port,
                                       strerror(errno));
        close(fd);
        return st;
    }
    comet_status_t st = COMET_SUCCESS;
    for (int joined = 1; joined < bs->size && st == COMET_SUCCESS; joined++) {
        struct pollfd pfd = {fd, POLLIN, 0};
        if (poll(&pfd, 1, bs->timeout_ms) <= 0) {
            st = comet_fail(COMET_ERR_TIMEOUT, "rank 0: bootstrap: only %d of %d ranks connected to port %d within %d ms",
                            joined, bs->size, port, bs->timeout_ms);
            break;
        }
        int c = accept(fd, NULL, NULL);
        int32_t r = -1;
        if (c < 0) {
            st = comet_fail(COMET_ERR_SYSTEM, "rank 0: bootstrap: accept: %s", strerror(errno));
        } else if ((st = xfer(bs, c, &r, sizeof r, 0, "reading a peer's rank")) != COMET_SUCCESS) {
            close(c);
        } else if (r < 1 || r >= bs->size || bs->peer[r] >= 0) {
            close(c);
            st = comet_fail(COMET_ERR_INVALID_ARGUMENT, "rank 0: bootstrap: a peer announced rank %d (world of %d)",
                            (int)r, bs->size);
        } else {
            setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            bs->peer[r] = c;
        }
    }
    close(fd);
    return st;
}

static comet_status_t connect_to_root(comet_bootstrap_t *bs, const char *host, int port) {
    char service[16];
    snprintf(service, sizeof service, "%d", port);
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host ? host : "127.0.0.1", service, &hints, &res) != 0 || !res)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "rank %d: bootstrap: cannot resolve '%s'", bs->rank,
                          host ? host : "127.0.0.1");
    double deadline = now_ms() + bs->timeout_ms;
    int fd = -1;
    while (fd < 0 && now_ms() < deadline) { /* rank 0 may not listen yet */
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
            close(fd);
            fd = -1;
            usleep(20000);
        }
    }
    freeaddrinfo(res);
    if (fd < 0)
        return comet_fail(COMET_ERR_TIMEOUT, "rank %d: bootstrap: could not reach rank 0 at %s:%d within %d ms",
                          bs->rank, host ? host : "127.0.0.1", port, bs->timeout_ms);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    bs->peer[0] = fd;
    int32_t r = bs->rank;
    return xfer(bs, fd, &r, sizeof r, 1, "announcing this rank");
}

comet_status_t comet_bootstrap_open(comet_bootstrap_t **out, int rank, int size, const char *host, int port,
                                    int timeout_ms) {
    *out = NULL;
    if (size < 1 || rank < 0 || rank >= size || port < 1 || port > 65535 || timeout_ms < 1)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "bootstrap: rank %d of %d, port %d: not valid", rank, size, port);
    comet_bootstrap_t *bs = calloc(1, sizeof *bs);
    int *peer = malloc(sizeof(int) * (size_t)size);
    if (!bs || !peer) {
        free(bs), free(peer);
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "bootstrap: no memory");
    }
    for (int i = 0; i < size; i++) peer[i] = -1;
    bs->rank = rank, bs->size = size, bs->timeout_ms = timeout_ms, bs->peer = peer;
    comet_status_t st = size == 1 ? COMET_SUCCESS : rank == 0 ? listen_and_accept(bs, host, port)
                                                              : connect_to_root(bs, host, port);
    if (st != COMET_SUCCESS) {
        comet_bootstrap_close(bs);
        return st;
    }
    *out = bs;
    return COMET_SUCCESS;
}

comet_status_t comet_bootstrap_bcast(comet_bootstrap_t *bs, void *buf, size_t n) {
    if (bs->rank != 0) return xfer(bs, bs->peer[0], buf, n, 0, "receiving a broadcast");
    for (int r = 1; r < bs->size; r++) COMET_TRY(xfer(bs, bs->peer[r], buf, n, 1, "broadcasting"));
    return COMET_SUCCESS;
}

comet_status_t comet_bootstrap_gather(comet_bootstrap_t *bs, const void *mine, size_t n, void *all) {
    if (bs->rank != 0) return xfer(bs, bs->peer[0], (void *)mine, n, 1, "sending to rank 0");
    memcpy(all, mine, n);
    for (int r = 1; r < bs->size; r++) COMET_TRY(xfer(bs, bs->peer[r], (char *)all + (size_t)r * n, n, 0, "gathering"));
    return COMET_SUCCESS;
}
