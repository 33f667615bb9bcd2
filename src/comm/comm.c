/*
 * comm.c - comet's NCCL runtime layer: version guard, NVLS-off rule,
 * communicators, symmetric windows and peer-pointer tables (see comm.h).
 * C11 host code; the NCCL device API is reached through nccl_shim.cu.
 *
 * NVLS (NVLink multicast) must stay off on the shared machines: before NCCL
 * is first initialised (ncclGetUniqueId or ncclCommInitRank*), this file sets
 * NCCL_NVLS_ENABLE=0 in the environment, overwriting any other value (a
 * setenv that does not overwrite would keep a user's "1"). NCCL reads its
 * parameters from the environment once per process, so this only holds if
 * comet initialises NCCL first in the process; a process where another
 * library already initialised NCCL must export NCCL_NVLS_ENABLE=0 itself.
 * The device communicator never requests multimem.
 */
#include "comm.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "../core/options.h"
#include "../core/status.h"
#include "nccl_shim.h"

_Static_assert(sizeof(comet_comm_id_t) == sizeof(ncclUniqueId), "comet_comm_id_t must hold an ncclUniqueId");
_Static_assert(COMET_COMM_ID_BYTES == NCCL_UNIQUE_ID_BYTES, "id size");

#define COMET_COMM_MAX_SYM 64

typedef struct {
    void *local;
    void **peers;
    ncclWindow_t win;
    size_t bytes;
} sym_slot_t;

typedef struct {
    void *ptr;
    size_t bytes;
} priv_slot_t;

struct comet_comm {
    ncclComm_t nccl;
    comet_devcomm_t *dev;
    cudaStream_t stream;   /* for the runtime's own small kernels and copies */
    int rank, size, device;
    int lsa_rank, lsa_size;
    int broken;            /* an NCCL call failed: destroy aborts instead */
    sym_slot_t sym[COMET_COMM_MAX_SYM];
    int nsym;
    priv_slot_t *priv;
    int npriv, cap_priv;
    size_t sym_bytes, priv_bytes;
};

/* ---------------------------------------------------------------- errors */

static comet_status_t nccl_fail(comet_comm_t *c, ncclResult_t r, const char *what) {
    const char *detail = ncclGetLastError(c ? c->nccl : NULL);
    if (c) c->broken = 1;
    if (c)
        return comet_fail(COMET_ERR_NCCL, "rank %d: %s failed: %s%s%s", c->rank, what, ncclGetErrorString(r),
                          detail && *detail ? ": " : "", detail ? detail : "");
    return comet_fail(COMET_ERR_NCCL, "%s failed: %s%s%s", what, ncclGetErrorString(r), detail && *detail ? ": " : "",
                      detail ? detail : "");
}

static comet_status_t cuda_fail(const comet_comm_t *c, cudaError_t e, const char *what) {
    return comet_fail(COMET_ERR_CUDA, "rank %d (device %d): %s failed: %s (%s)", c ? c->rank : -1,
                      c ? c->device : -1, what, cudaGetErrorString(e), cudaGetErrorName(e));
}

/* ------------------------------------------------------ version and NVLS */

static void version_parts(int code, int *maj, int *min, int *patch) {
    if (code >= 10000) { /* NCCL >= 2.9: major*10000 + minor*100 + patch */
        *maj = code / 10000, *min = code / 100 % 100, *patch = code % 100;
    } else {             /* older: major*1000 + minor*100 + patch */
        *maj = code / 1000, *min = code / 100 % 10, *patch = code % 100;
    }
}

void comet_comm_nccl_versions(int *loaded, int *built) {
    int v = 0;
    if (ncclGetVersion(&v) != ncclSuccess) v = 0;
    if (loaded) *loaded = v;
    if (built) *built = NCCL_VERSION_CODE;
}

comet_status_t comet_comm_check_version(int loaded) {
    if (loaded == NCCL_VERSION_CODE) return COMET_SUCCESS;
    int a, b, c, x, y, z;
    version_parts(loaded, &a, &b, &c);
    version_parts(NCCL_VERSION_CODE, &x, &y, &z);
    return comet_fail(COMET_ERR_NCCL,
                      "NCCL version mismatch: the loaded libnccl is %d.%d.%d but comet was compiled against "
                      "NCCL %d.%d.%d headers; NCCL's device API has no ABI stability (a mismatch crashes "
                      "kernels with illegal addresses), so they must be equal. Load the matching "
                      "libnccl.so.2 first, e.g. export LD_LIBRARY_PATH=\"$(python3 -c 'import nvidia.nccl as m; "
                      "print(m.__path__[0])')/lib:$LD_LIBRARY_PATH\" for PyTorch's bundled NCCL, or rebuild comet "
                      "against the headers of the NCCL you load",
                      a, b, c, x, y, z);
}

static comet_status_t guard_version(void) {
    int v = 0;
    ncclResult_t r = ncclGetVersion(&v);
    if (r != ncclSuccess) return nccl_fail(NULL, r, "ncclGetVersion");
    return comet_comm_check_version(v);
}

/* ------------------------------------------------------------ lifecycle */

comet_status_t comet_comm_unique_id(comet_comm_id_t *id) {
    if (!id) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "comet_comm_unique_id: id is NULL");
    COMET_TRY(guard_version());
    COMET_TRY(comet_env_nvls_off());
    ncclUniqueId uid;
    ncclResult_t r = ncclGetUniqueId(&uid);
    if (r != ncclSuccess) return nccl_fail(NULL, r, "ncclGetUniqueId");
    memcpy(id->bytes, uid.internal, sizeof id->bytes);
    return COMET_SUCCESS;
}

comet_status_t comet_comm_create(comet_comm_t **comm, int rank, int world_size, const comet_comm_id_t *id,
                                 int device) {
    if (!comm || !id) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "comet_comm_create: comm or id is NULL");
    *comm = NULL;
    if (world_size < 1 || world_size > COMET_COMM_MAX_RANKS)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "comet_comm_create: world_size %d not in [1, %d]", world_size,
                          COMET_COMM_MAX_RANKS);
    if (rank < 0 || rank >= world_size)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "comet_comm_create: rank %d not in [0, %d)", rank, world_size);
    if (device < 0) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "comet_comm_create: device %d < 0", device);
    COMET_TRY(guard_version());
    COMET_TRY(comet_env_nvls_off());

    comet_comm_t *c = calloc(1, sizeof *c);
    if (!c) return comet_fail(COMET_ERR_OUT_OF_MEMORY, "comet_comm_create: out of host memory");
    c->rank = rank, c->size = world_size, c->device = device;
    comet_status_t st = COMET_SUCCESS;
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) {
        st = cuda_fail(c, e, "cudaSetDevice");
        free(c);
        return st;
    }
    ncclUniqueId uid;
    memcpy(uid.internal, id->bytes, sizeof uid.internal);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 1;
    cfg.commName = "comet";
    ncclResult_t r = ncclCommInitRankConfig(&c->nccl, world_size, uid, rank, &cfg);
    if (r != ncclSuccess) {
        c->nccl = NULL;
        st = nccl_fail(c, r, "ncclCommInitRankConfig");
        free(c);
        return st;
    }
    int dr = -1, dn = -1;
    r = comet_shim_devcomm_create(c->nccl, &c->dev, &dr, &dn, &c->lsa_rank, &c->lsa_size);
    if (r != ncclSuccess) {
        st = nccl_fail(c, r, "ncclDevCommCreate");
        goto fail;
    }
    if (dr != rank || dn != world_size) {
        st = comet_fail(COMET_ERR_INTERNAL, "rank %d: device communicator reports rank %d of %d, expected %d of %d",
                        rank, dr, dn, rank, world_size);
        goto fail;
    }
    if (c->lsa_size != world_size) {
        st = comet_fail(COMET_ERR_UNSUPPORTED,
                        "rank %d: only %d of %d ranks are load/store reachable (LSA team); comet needs every rank in "
                        "one NVLink/P2P domain (multi-node needs a per-node split, not in this build)",
                        rank, c->lsa_size, world_size);
        goto fail;
    }
    e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        c->stream = NULL;
        st = cuda_fail(c, e, "cudaStreamCreateWithFlags");
        goto fail;
    }
    *comm = c;
    return COMET_SUCCESS;
fail:;
    char msg[1024]; /* keep the first message across the cleanup */
    strncpy(msg, comet_last_error(), sizeof msg - 1);
    msg[sizeof msg - 1] = '\0';
    c->broken = 1; /* the peers may not reach the next collective: abort, don't wait */
    comet_comm_destroy(c);
    return comet_fail_copy(st, msg);
}

static comet_status_t release_sym(comet_comm_t *c, int i) {
    comet_status_t st = COMET_SUCCESS;
    sym_slot_t *s = &c->sym[i];
    cudaError_t e = cudaDeviceSynchronize(); /* no kernel may still use it */
    if (e != cudaSuccess) st = cuda_fail(c, e, "cudaDeviceSynchronize before freeing a symmetric buffer");
    if (!c->broken) {
        ncclResult_t r = ncclCommWindowDeregister(c->nccl, s->win);
        if (r != ncclSuccess && st == COMET_SUCCESS) st = nccl_fail(c, r, "ncclCommWindowDeregister");
    }
    ncclResult_t r = ncclMemFree(s->local);
    if (r != ncclSuccess && st == COMET_SUCCESS) st = nccl_fail(c, r, "ncclMemFree");
    e = cudaFree(s->peers);
    if (e != cudaSuccess && st == COMET_SUCCESS) st = cuda_fail(c, e, "cudaFree(peer table)");
    c->sym_bytes -= s->bytes;
    c->priv_bytes -= sizeof(void *) * (size_t)c->size;
    c->sym[i] = c->sym[--c->nsym];
    return st;
}

comet_status_t comet_comm_destroy(comet_comm_t *c) {
    if (!c) return COMET_SUCCESS;
    comet_status_t st = COMET_SUCCESS, s2;
    cudaError_t e = cudaSetDevice(c->device);
    if (e != cudaSuccess) st = cuda_fail(c, e, "cudaSetDevice");
    while (c->nsym > 0) {
        s2 = release_sym(c, c->nsym - 1);
        if (st == COMET_SUCCESS) st = s2;
    }
    for (int i = 0; i < c->npriv; i++) {
        e = cudaFree(c->priv[i].ptr);
        if (e != cudaSuccess && st == COMET_SUCCESS) st = cuda_fail(c, e, "cudaFree(private)");
    }
    free(c->priv);
    if (c->dev && !c->broken) {
        ncclResult_t r = comet_shim_devcomm_destroy(c->nccl, c->dev);
        if (r != ncclSuccess && st == COMET_SUCCESS) st = nccl_fail(c, r, "ncclDevCommDestroy");
    } else if (c->dev) {
        free(c->dev); /* the abort below releases what NCCL holds for it */
    }
    if (c->stream) {
        e = cudaStreamDestroy(c->stream);
        if (e != cudaSuccess && st == COMET_SUCCESS) st = cuda_fail(c, e, "cudaStreamDestroy");
    }
    if (c->nccl) {
        ncclResult_t r = c->broken ? ncclCommAbort(c->nccl) : ncclCommDestroy(c->nccl);
        if (r != ncclSuccess && st == COMET_SUCCESS) {
            c->nccl = NULL;
            st = nccl_fail(c, r, c->broken ? "ncclCommAbort" : "ncclCommDestroy");
        }
    }
    free(c);
    return st;
}

/* ----------------------------------------------------- symmetric memory */

comet_status_t comet_comm_alloc_symmetric(comet_comm_t *c, size_t bytes, comet_sym_t *out) {
    if (!c || !out) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "comet_comm_alloc_symmetric: NULL argument");
    memset(out, 0, sizeof *out);
    if (bytes == 0) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "comet_comm_alloc_symmetric: 0 bytes");
    if (bytes > SIZE_MAX - NCCL_WIN_REQUIRED_ALIGNMENT)
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "comet_comm_alloc_symmetric: %zu bytes", bytes);
    if (c->nsym == COMET_COMM_MAX_SYM)
        return comet_fail(COMET_ERR_UNSUPPORTED, "rank %d: more than %d symmetric buffers", c->rank,
                          COMET_COMM_MAX_SYM);
    bytes = (bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT * NCCL_WIN_REQUIRED_ALIGNMENT;
    cudaError_t e = cudaSetDevice(c->device);
    if (e != cudaSuccess) return cuda_fail(c, e, "cudaSetDevice");

    sym_slot_t s = {0};
    s.bytes = bytes;
    ncclResult_t r = ncclMemAlloc(&s.local, bytes);
    if (r != ncclSuccess) {
        /* a local failure: the peers may now wait in the register below */
        c->broken = 1;
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: ncclMemAlloc(%zu bytes) failed: %s", c->rank, bytes,
                          ncclGetErrorString(r));
    }
    r = ncclCommWindowRegister(c->nccl, s.local, bytes, &s.win, NCCL_WIN_COLL_SYMMETRIC);
    if (r != ncclSuccess) {
        comet_status_t st = nccl_fail(c, r, "ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC)");
        ncclMemFree(s.local);
        return st;
    }
    comet_status_t st = COMET_SUCCESS;
    e = cudaMalloc((void **)&s.peers, sizeof(void *) * (size_t)c->size);
    if (e != cudaSuccess) {
        s.peers = NULL;
        st = e == cudaErrorMemoryAllocation ? comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: cudaMalloc(peer table)",
                                                         c->rank)
                                            : cuda_fail(c, e, "cudaMalloc(peer table)");
        goto fail;
    }
    e = comet_shim_export_peers(c->dev, s.win, s.peers, c->stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(out->peers_host, s.peers, sizeof(void *) * (size_t)c->size, cudaMemcpyDeviceToHost,
                            c->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess) {
        st = cuda_fail(c, e, "exporting the peer-pointer table");
        goto fail;
    }
    for (int p = 0; p < c->size; p++)
        if (!out->peers_host[p]) {
            st = comet_fail(COMET_ERR_INTERNAL, "rank %d: no load/store pointer to rank %d's window", c->rank, p);
            goto fail;
        }
    c->sym[c->nsym++] = s;
    c->sym_bytes += bytes;
    c->priv_bytes += sizeof(void *) * (size_t)c->size;
    out->local = s.local;
    out->peers = s.peers;
    out->bytes = bytes;
    out->window = s.win;
    return COMET_SUCCESS;
fail:
    /* the register succeeded everywhere, so deregistering is a collective all ranks reach
       only if they failed alike; a lone failure marks the comm broken instead */
    c->broken = 1;
    cudaFree(s.peers);
    ncclMemFree(s.local);
    memset(out, 0, sizeof *out);
    return st;
}

comet_status_t comet_comm_free_symmetric(comet_comm_t *c, comet_sym_t *sym) {
    if (!c || !sym) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "comet_comm_free_symmetric: NULL argument");
    if (!sym->local) return COMET_SUCCESS;
    for (int i = 0; i < c->nsym; i++)
        if (c->sym[i].local == sym->local) {
            cudaError_t e = cudaSetDevice(c->device);
            if (e != cudaSuccess) return cuda_fail(c, e, "cudaSetDevice");
            comet_status_t st = release_sym(c, i);
            memset(sym, 0, sizeof *sym);
            return st;
        }
    return comet_fail(COMET_ERR_INVALID_ARGUMENT, "rank %d: comet_comm_free_symmetric: %p is not a live buffer of "
                      "this comm", c->rank, sym->local);
}

/* ------------------------------------------------------- private memory */

comet_status_t comet_comm_alloc_private(comet_comm_t *c, size_t bytes, void **ptr) {
    if (!c || !ptr) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "comet_comm_alloc_private: NULL argument");
    *ptr = NULL;
    if (c->npriv == c->cap_priv) {
        int cap = c->cap_priv ? 2 * c->cap_priv : 16;
        priv_slot_t *n = realloc(c->priv, sizeof *n * (size_t)cap);
        if (!n) return comet_fail(COMET_ERR_OUT_OF_MEMORY, "comet_comm_alloc_private: out of host memory");
        c->priv = n, c->cap_priv = cap;
    }
    cudaError_t e = cudaSetDevice(c->device);
    if (e != cudaSuccess) return cuda_fail(c, e, "cudaSetDevice");
    void *p = NULL;
    e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e == cudaErrorMemoryAllocation)
        return comet_fail(COMET_ERR_OUT_OF_MEMORY, "rank %d: cudaMalloc(%zu bytes): out of device memory", c->rank,
                          bytes);
    if (e != cudaSuccess) return cuda_fail(c, e, "cudaMalloc");
    c->priv[c->npriv++] = (priv_slot_t){p, bytes};
    c->priv_bytes += bytes;
    *ptr = p;
    return COMET_SUCCESS;
}

comet_status_t comet_comm_free_private(comet_comm_t *c, void *ptr) {
    if (!c) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "comet_comm_free_private: comm is NULL");
    if (!ptr) return COMET_SUCCESS;
    for (int i = 0; i < c->npriv; i++)
        if (c->priv[i].ptr == ptr) {
            cudaError_t e = cudaSetDevice(c->device);
            if (e == cudaSuccess) e = cudaFree(ptr);
            c->priv_bytes -= c->priv[i].bytes;
            c->priv[i] = c->priv[--c->npriv];
            return e == cudaSuccess ? COMET_SUCCESS : cuda_fail(c, e, "cudaFree(private)");
        }
    return comet_fail(COMET_ERR_INVALID_ARGUMENT, "rank %d: comet_comm_free_private: %p was not allocated here",
                      c->rank, ptr);
}

/* ------------------------------------------------------------- queries */

int comet_comm_rank(const comet_comm_t *c) { return c->rank; }
int comet_comm_size(const comet_comm_t *c) { return c->size; }
int comet_comm_device(const comet_comm_t *c) { return c->device; }
struct ncclComm *comet_comm_nccl(const comet_comm_t *c) { return c->nccl; }

void comet_comm_memory(const comet_comm_t *c, comet_comm_memory_t *out) {
    out->symmetric_bytes = c->sym_bytes;
    out->private_bytes = c->priv_bytes;
    out->symmetric_buffers = c->nsym;
}
