/*
 * nccl_shim.h - C ABI of src/comm/nccl_shim.cu, the only comet code that
 * touches NCCL's C++ device API (nccl_device.h). Used by comm.c alone.
 * Functions return NCCL's or CUDA's own codes; comm.c turns them into
 * comet statuses and messages.
 */
#ifndef COMET_NCCL_SHIM_H
#define COMET_NCCL_SHIM_H

#include <cuda_runtime.h>
#include <nccl.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct comet_devcomm comet_devcomm_t; /* wraps an ncclDevComm */

/* ncclDevCommCreate with the requirements struct zeroed (no multimem, no
 * barriers, no GIN requested). Fills the device comm's rank, size, and LSA
 * (load/store accessible) team: lsa_rank within lsa_size. On failure *out is
 * NULL. Collective. */
ncclResult_t comet_shim_devcomm_create(ncclComm_t comm, comet_devcomm_t **out, int *rank,
                                       int *nranks, int *lsa_rank, int *lsa_size);
/* ncclDevCommDestroy and free. NULL is a no-op. */
ncclResult_t comet_shim_devcomm_destroy(ncclComm_t comm, comet_devcomm_t *dc);

/* Launch one tiny kernel on `stream` that writes table[p] =
 * ncclGetLsaPointer(win, 0, lsa index of world rank p) for p in [0, nranks).
 * Every rank must be in this rank's LSA team. Returns the launch status. */
cudaError_t comet_shim_export_peers(const comet_devcomm_t *dc, ncclWindow_t win, void **table,
                                    cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* COMET_NCCL_SHIM_H */
