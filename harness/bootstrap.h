/*
 * harness/bootstrap.h - harness code, not part of the library
 * (libcomet_harness.a): the small out-of-band channel that ranks in different
 * processes (torchrun style: RANK, WORLD_SIZE, MASTER_ADDR) use before they
 * share anything else: rank 0 listens on a TCP port, every other rank
 * connects; rank 0 can then broadcast bytes (the NCCL unique id) and gather
 * fixed-size records (results) from every rank. Every wait times out.
 * The CLI's torchrun launch and its test use it.
 */
#ifndef COMET_BOOTSTRAP_H
#define COMET_BOOTSTRAP_H

#include <stddef.h>

#include "comet.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct comet_bootstrap comet_bootstrap_t;

/* Collective over `size` processes: rank 0 listens on host:port (host may be
 * NULL: every interface), the others connect to host:port, retrying until
 * timeout_ms. */
comet_status_t comet_bootstrap_open(comet_bootstrap_t **bs, int rank, int size, const char *host, int port,
                                    int timeout_ms);
/* Rank 0's n bytes of buf reach every rank's buf. */
comet_status_t comet_bootstrap_bcast(comet_bootstrap_t *bs, void *buf, size_t n);
/* Every rank's n bytes of mine land in rank 0's all[rank * n]; all may be
 * NULL on other ranks. */
comet_status_t comet_bootstrap_gather(comet_bootstrap_t *bs, const void *mine, size_t n, void *all);
/* NULL is a no-op. */
void comet_bootstrap_close(comet_bootstrap_t *bs);

#ifdef __cplusplus
}
#endif

#endif /* COMET_BOOTSTRAP_H */
