/*
 * nccl_shim.cu - the C ABI shim over NCCL's C++ device API (see
 * nccl_shim.h): creates the device communicator and exports a window's
 * peer base pointers into a device array with one tiny kernel, so comet's
 * hot kernels stay plain CUDA C and take `void **peers`.
 *
 * ncclGetLsaPointer(win, offset, i) addresses the i-th member of this rank's
 * LSA team; world rank p maps to lsa index lsaRank + (p - rank) (the LSA team
 * is a contiguous run of world ranks), valid when p is in the team. The
 * addresses stay valid until the window is deregistered.
 */
#include <nccl_device.h>
#include <stdlib.h>
#include <string.h>

#include "nccl_shim.h"

struct comet_devcomm {
    ncclDevComm dev;
};

extern "C" ncclResult_t comet_shim_devcomm_create(ncclComm_t comm, comet_devcomm_t **out, int *rank,
                                                  int *nranks, int *lsa_rank, int *lsa_size) {
    *out = NULL;
    comet_devcomm_t *dc = (comet_devcomm_t *)calloc(1, sizeof *dc);
    if (!dc) return ncclSystemError;
    ncclDevCommRequirements reqs;
    memset(&reqs, 0, sizeof reqs); /* 2.28 has no initializer; never lsaMultimem */
    ncclResult_t r = ncclDevCommCreate(comm, &reqs, &dc->dev);
    if (r != ncclSuccess) {
        free(dc);
        return r;
    }
    *rank = dc->dev.rank;
    *nranks = dc->dev.nRanks;
    *lsa_rank = dc->dev.lsaRank;
    *lsa_size = dc->dev.lsaSize;
    *out = dc;
    return ncclSuccess;
}

extern "C" ncclResult_t comet_shim_devcomm_destroy(ncclComm_t comm, comet_devcomm_t *dc) {
    if (!dc) return ncclSuccess;
    ncclResult_t r = ncclDevCommDestroy(comm, &dc->dev);
    free(dc);
    return r;
}

__global__ void comet_export_peers_kernel(ncclDevComm dev, ncclWindow_t win, void **table) {
    int p = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (p >= dev.nRanks) return;
    int lsa = ncclTeamRankToLsa(dev, ncclTeamWorld(dev), p);
    table[p] = (lsa >= 0 && lsa < dev.lsaSize) ? ncclGetLsaPointer(win, 0, lsa) : NULL;
}

extern "C" cudaError_t comet_shim_export_peers(const comet_devcomm_t *dc, ncclWindow_t win, void **table,
                                               cudaStream_t stream) {
    int n = dc->dev.nRanks;
    comet_export_peers_kernel<<<(n + 63) / 64, 64, 0, stream>>>(dc->dev, win, table);
    return cudaGetLastError();
}
