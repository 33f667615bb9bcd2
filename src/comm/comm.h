/*
 * comm.h - comet's NCCL runtime layer (internal, not part of the public API):
 * communicators, the NCCL version guard, symmetric memory windows and the
 * peer-pointer tables that let plain CUDA C kernels load and store into every
 * rank's buffer over NVLink.
 *
 * Flow (design.md section 4):
 *   id   : comet_comm_unique_id (one rank, shared with the others)
 *   comm : comet_comm_create on every rank (collective), one GPU per rank;
 *          checks ncclGetVersion() == NCCL_VERSION_CODE, forces
 *          NCCL_NVLS_ENABLE=0, ncclCommInitRankConfig, ncclDevCommCreate with
 *          zeroed requirements (no multimem, ever)
 *   mem  : comet_comm_alloc_symmetric (collective): ncclMemAlloc +
 *          ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC) + a device array of
 *          W peer base pointers written by a tiny kernel (src/comm/nccl_shim.cu)
 *   end  : comet_comm_free_symmetric (collective), comet_comm_destroy.
 *
 * Single node: comet runs one process with one thread per GPU; every rank's
 * thread calls the collective functions in the same order (processes work
 * too: the id is 128 plain bytes). Every rank must be load/store reachable
 * (one NVLink/P2P domain); otherwise comet_comm_create fails with
 * COMET_ERR_UNSUPPORTED.
 *
 * Errors: every call returns a comet_status_t and sets comet_last_error()
 * (COMET_ERR_NCCL / COMET_ERR_CUDA carry NCCL's or CUDA's error string).
 * Nothing here prints or exits. The header needs no CUDA or NCCL header: the
 * NCCL and CUDA handle types are declared by their struct tags.
 */
#ifndef COMET_COMM_H
#define COMET_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "comet.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ncclComm;           /* ncclComm_t   == struct ncclComm *          */
struct ncclWindow_vidmem;  /* ncclWindow_t == struct ncclWindow_vidmem * */
struct CUstream_st;        /* cudaStream_t == struct CUstream_st *       */

#define COMET_COMM_ID_BYTES 128 /* == NCCL_UNIQUE_ID_BYTES, checked in comm.c */
#define COMET_COMM_MAX_RANKS 64

typedef struct {
    char bytes[COMET_COMM_ID_BYTES];
} comet_comm_id_t;

typedef struct comet_comm comet_comm_t;

/* A symmetric buffer: the same size on every rank, each rank's copy reachable
 * by loads and stores from every rank's GPU. Filled by
 * comet_comm_alloc_symmetric; the caller only reads the fields. */
typedef struct {
    void *local;                      /* this rank's buffer (device pointer from ncclMemAlloc) */
    void **peers;                     /* device array [world_size]: peers[p] is rank p's buffer as
                                         this GPU addresses it (LSA mapping; peers[rank] is this
                                         rank's own buffer through its window mapping) */
    void *peers_host[COMET_COMM_MAX_RANKS]; /* host copy of the same table */
    size_t bytes;                     /* usable bytes (the request rounded up to 4096) */
    struct ncclWindow_vidmem *window; /* ncclWindow_t, for kernels that use NCCL's device API */
} comet_sym_t;

/* Fill *id from ncclGetUniqueId (on one rank; hand the bytes to the others).
 * Also applies the NCCL version guard and the NVLS-off rule. */
comet_status_t comet_comm_unique_id(comet_comm_id_t *id);

/* Collective: rank `rank` of `world_size` (1..COMET_COMM_MAX_RANKS) on CUDA
 * device `device`. Leaves `device` current on the calling thread. */
comet_status_t comet_comm_create(comet_comm_t **comm, int rank, int world_size,
                                 const comet_comm_id_t *id, int device);

/* Call on every rank after its last collective; NULL is a no-op. Symmetric
 * buffers still allocated are released first (a collective step, so every
 * rank must call it). After a failed NCCL call the comm is aborted instead
 * (ncclCommAbort), which waits for no peer. */
comet_status_t comet_comm_destroy(comet_comm_t *comm);

/* Collective: allocate `bytes` (> 0, equal on every rank) of symmetric memory.
 * The contents start undefined. */
comet_status_t comet_comm_alloc_symmetric(comet_comm_t *comm, size_t bytes, comet_sym_t *out);
/* Collective: release a buffer from comet_comm_alloc_symmetric; zeroes *sym.
 * A zeroed comet_sym_t is a no-op. */
comet_status_t comet_comm_free_symmetric(comet_comm_t *comm, comet_sym_t *sym);

/* Private (non-symmetric) device memory, counted in the memory report. */
comet_status_t comet_comm_alloc_private(comet_comm_t *comm, size_t bytes, void **ptr);
comet_status_t comet_comm_free_private(comet_comm_t *comm, void *ptr);

int comet_comm_rank(const comet_comm_t *comm);
int comet_comm_size(const comet_comm_t *comm);
int comet_comm_device(const comet_comm_t *comm);
/* The NCCL communicator, for collectives (baselines, references). */
struct ncclComm *comet_comm_nccl(const comet_comm_t *comm);

/* Device memory this comm allocated and still holds: symmetric (the sizes
 * asked of ncclMemAlloc; it may round further up to its allocation
 * granularity) and private (peer tables, comet_comm_alloc_private). NCCL's
 * own internal buffers are not counted. */
typedef struct {
    size_t symmetric_bytes;
    size_t private_bytes;
    int symmetric_buffers;
} comet_comm_memory_t;
void comet_comm_memory(const comet_comm_t *comm, comet_comm_memory_t *out);

/* The version guard on its own: COMET_SUCCESS when `loaded` (an
 * ncclGetVersion code) equals the NCCL_VERSION_CODE comet was compiled
 * against, else COMET_ERR_NCCL with a message naming both and the fix.
 * comet_comm_nccl_versions reports both codes (loaded = 0 if unknown). */
comet_status_t comet_comm_check_version(int loaded);
void comet_comm_nccl_versions(int *loaded, int *built);

#ifdef __cplusplus
}
#endif

#endif /* COMET_COMM_H */
