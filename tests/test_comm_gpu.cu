/*
 * test_comm_gpu.cu - the NCCL runtime layer (src/comm/) on real GPUs, and the
 * measurement tool for it. One thread per GPU (as `comet bench` runs):
 *   - version guard: loaded libnccl == the headers' NCCL_VERSION_CODE (prints
 *     both); the guard's message for a mismatch; NCCL_NVLS_ENABLE forced to 0
 *   - comms, a 256 MiB symmetric buffer and a flag buffer on every rank
 *   - every rank fills its buffer with rank-specific random words (never 0),
 *     a device flag handshake (st.release.sys / ld.acquire.sys epochs), then
 *     every rank reads every peer's buffer through the peer-pointer table and
 *     checks it word for word
 *   - cross-GPU flag round trip (ranks 0 and 1), timed over many iterations
 *   - pull (read peer, write local) and push (read local, write peer) copy
 *     bandwidth over peer pointers, 256 MiB, several block counts, with one
 *     rank active (uni) and all ranks at once (bi)
 *   - ncclAlltoAll of 256 MiB per rank, timed with CUDA events (reference)
 * Every device wait has a timeout (COMET_TIMEOUT_MS, default 10000 here) that
 * reports the rank and returns an error: never a silent hang.
 * Without a GPU it prints "test_comm_gpu: skipped (no GPU)".
 */
#include <atomic>

#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../src/comm/comm.h"
#include "check.h"

#define MAXG 8
#define BUF_BYTES ((size_t)256 << 20)
#define FLAG_BYTES 4096
#define FL_HS 0      /* [p]: handshake epoch from rank p */
#define FL_PING 128  /* on rank 1: ping epoch from rank 0 */
#define FL_PONG 129  /* on rank 0: pong epoch from rank 1 */
#define RT_WARM 200
#define RT_ITERS 20000
#define BW_WARM 2
#define BW_REPS 10
#define A2A_WARM 3
#define A2A_REPS 10

static const int kBlocks[] = {4, 8, 16, 32, 64, 132};
#define NB (int)(sizeof kBlocks / sizeof kBlocks[0])

/* ------------------------------------------------------------ device side */

__device__ __forceinline__ uint64_t word_of(uint64_t rank, uint64_t i) {
    uint64_t z = (rank + 1) * 0x9E3779B97F4A7C15ull + i * 0xD1B54A32D192ED03ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (z ^ (z >> 31)) | 1ull; /* never zero */
}

__device__ __forceinline__ uint64_t now_ns(void) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void st_release_sys(uint64_t *p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t *p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

/* err[0] = 1 on timeout, err[1] = flag slot, err[2] = value seen, err[3] = value wanted */
__device__ bool wait_geq(const uint64_t *flag, uint64_t want, uint64_t timeout_ns, uint64_t slot,
                         unsigned long long *err) {
    uint64_t t0 = now_ns();
    uint64_t v;
    while ((v = ld_acquire_sys(flag)) < want) {
        if (now_ns() - t0 > timeout_ns) {
            err[0] = 1, err[1] = slot, err[2] = v, err[3] = want;
            return false;
        }
    }
    return true;
}

__global__ void fill_kernel(uint64_t *buf, size_t n, int rank) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        buf[i] = word_of((uint64_t)rank, i);
}

/* one thread: publish epoch into every peer's slot [FL_HS + rank], then wait for all */
__global__ void handshake_kernel(void **flag_peers, uint64_t *my_flags, int rank, int W, uint64_t epoch,
                                 uint64_t timeout_ns, unsigned long long *err) {
    __threadfence_system(); /* the fill kernel's stores before the flag */
    for (int p = 0; p < W; p++) st_release_sys((uint64_t *)flag_peers[p] + FL_HS + rank, epoch);
    for (int p = 0; p < W; p++)
        if (!wait_geq(my_flags + FL_HS + p, epoch, timeout_ns, FL_HS + p, err)) return;
}

/* every rank checks every peer's buffer through the device peer table */
__global__ void check_kernel(void **peers, int W, size_t n, unsigned long long *bad,
                             unsigned long long *first_bad) {
    for (int p = 0; p < W; p++) {
        const uint64_t *b = (const uint64_t *)peers[p];
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
            if (b[i] != word_of((uint64_t)p, i)) {
                atomicAdd(bad, 1ull);
                atomicMin(first_bad, ((unsigned long long)p << 48) | i);
            }
    }
}

/* ranks 0 and 1; out[0] = ns for the timed iterations */
__global__ void pingpong_kernel(uint64_t *peer_flags, uint64_t *my_flags, int rank, uint64_t base, int warm,
                                int iters, uint64_t timeout_ns, unsigned long long *err,
                                unsigned long long *out) {
    uint64_t t0 = 0;
    for (int i = 1; i <= warm + iters; i++) {
        if (i == warm + 1) t0 = now_ns();
        uint64_t e = base + (uint64_t)i;
        if (rank == 0) {
            st_release_sys(peer_flags + FL_PING, e);
            if (!wait_geq(my_flags + FL_PONG, e, timeout_ns, FL_PONG, err)) return;
        } else {
            if (!wait_geq(my_flags + FL_PING, e, timeout_ns, FL_PING, err)) return;
            st_release_sys(peer_flags + FL_PONG, e);
        }
    }
    out[0] = now_ns() - t0;
}

__global__ void copy_kernel(const int4 *__restrict__ src, int4 *__restrict__ dst, size_t n) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        int4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        dst[i] = a, dst[i + stride] = b, dst[i + 2 * stride] = c, dst[i + 3 * stride] = d;
    }
    for (; i < n; i += stride) dst[i] = src[i];
}

/* ------------------------------------------------------------- host side */

typedef struct {
    int ok;
    char err[1024];
    unsigned long long mismatches, first_bad;
    int peers_distinct;       /* every peer pointer distinct and non-null */
    double rt_us;             /* round trip, rank 0 only */
    double pull_bi[NB], push_bi[NB], pull_uni[NB], push_uni[NB]; /* GB/s (1e9) */
    double a2a_ms;
    comet_comm_memory_t mem;
    comet_status_t free_st, destroy_st;
} rank_result_t;

static int W;
static comet_comm_id_t g_id;
static pthread_barrier_t g_bar;
static std::atomic<int> g_fail;
static uint64_t g_timeout_ns;
static rank_result_t g_res[MAXG];

/* host barrier that also agrees on failure: false once any rank failed */
static bool all_ok(int rank) {
    if (!g_res[rank].ok) g_fail.store(1);
    pthread_barrier_wait(&g_bar);
    bool ok = g_fail.load() == 0;
    pthread_barrier_wait(&g_bar); /* everyone has read before anyone can set it again */
    return ok;
}

#define RFAIL(...)                                                        \
    do {                                                                  \
        snprintf(res->err, sizeof res->err, __VA_ARGS__);                 \
        res->ok = 0;                                                      \
    } while (0)
#define CU(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess && res->ok) RFAIL("rank %d: %s: %s", rank, #call, cudaGetErrorString(e_)); \
    } while (0)
#define CO(call)                                                                                   \
    do {                                                                                           \
        comet_status_t s_ = (call);                                                                \
        if (s_ != COMET_SUCCESS && res->ok)                                                        \
            RFAIL("rank %d: %s: %s: %s", rank, #call, comet_status_string(s_), comet_last_error());  \
    } while (0)

static void check_err_word(rank_result_t *res, int rank, const unsigned long long *h_err, const char *what) {
    if (h_err[0] && res->ok)
        RFAIL("rank %d: %s: timeout waiting on flag slot %llu (saw %llu, want %llu)", rank, what, h_err[1], h_err[2],
              h_err[3]);
}

static double time_copy(int rank, bool active, cudaStream_t s, cudaEvent_t a, cudaEvent_t b, const void *src,
                        void *dst, int blocks, rank_result_t *res) {
    size_t n = BUF_BYTES / sizeof(int4);
    for (int i = 0; i < BW_WARM && active; i++)
        copy_kernel<<<blocks, 512, 0, s>>>((const int4 *)src, (int4 *)dst, n);
    CU(cudaStreamSynchronize(s));
    all_ok(rank);
    float ms = 0;
    if (active) {
        CU(cudaEventRecord(a, s));
        for (int i = 0; i < BW_REPS; i++) copy_kernel<<<blocks, 512, 0, s>>>((const int4 *)src, (int4 *)dst, n);
        CU(cudaGetLastError());
        CU(cudaEventRecord(b, s));
        CU(cudaEventSynchronize(b));
        CU(cudaEventElapsedTime(&ms, a, b));
    }
    all_ok(rank);
    return active && ms > 0 ? (double)BUF_BYTES * BW_REPS / (ms * 1e-3) / 1e9 : 0.0;
}

static void *rank_main(void *arg) {
    int rank = (int)(intptr_t)arg;
    rank_result_t *res = &g_res[rank];
    res->ok = 1;
    comet_comm_t *c = NULL;
    comet_sym_t buf = {0}, flags = {0};
    void *priv = NULL, *a2a_recv = NULL;
    cudaStream_t s = NULL;
    cudaEvent_t ev0 = NULL, ev1 = NULL;
    unsigned long long *d_misc = NULL, h_misc[8];
    const int blocks_fill = 132 * 4;

    CO(comet_comm_create(&c, rank, W, &g_id, rank));
    if (!all_ok(rank)) goto out;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CU(cudaEventCreate(&ev0));
    CU(cudaEventCreate(&ev1));
    CU(cudaMalloc(&d_misc, sizeof h_misc));
    if (!all_ok(rank)) goto out;
    CO(comet_comm_alloc_symmetric(c, BUF_BYTES, &buf));
    if (!all_ok(rank)) goto out;
    CO(comet_comm_alloc_symmetric(c, FLAG_BYTES, &flags));
    if (!all_ok(rank)) goto out;
    CO(comet_comm_alloc_private(c, BUF_BYTES, &priv));
    CO(comet_comm_alloc_private(c, BUF_BYTES, &a2a_recv));
    comet_comm_memory(c, &res->mem);
    res->peers_distinct = 1;
    for (int p = 0; p < W; p++)
        for (int q = 0; q < p; q++)
            if (!buf.peers_host[p] || buf.peers_host[p] == buf.peers_host[q]) res->peers_distinct = 0;
    CU(cudaMemsetAsync(flags.local, 0, FLAG_BYTES, s));
    CU(cudaMemsetAsync(d_misc, 0, sizeof h_misc, s));
    CU(cudaMemsetAsync((char *)d_misc + 5 * 8, 0xff, 8, s)); /* first_bad = max */
    CU(cudaStreamSynchronize(s));
    if (!all_ok(rank)) goto out; /* every rank's flags are zero before anyone signals */

    /* 1. fill, handshake, check every peer's buffer */
    {
        size_t n = BUF_BYTES / 8;
        fill_kernel<<<blocks_fill, 256, 0, s>>>((uint64_t *)buf.local, n, rank);
        handshake_kernel<<<1, 1, 0, s>>>(flags.peers, (uint64_t *)flags.local, rank, W, 1, g_timeout_ns, d_misc);
        check_kernel<<<blocks_fill, 256, 0, s>>>(buf.peers, W, n, d_misc + 4, d_misc + 5);
        CU(cudaGetLastError());
        CU(cudaMemcpyAsync(h_misc, d_misc, sizeof h_misc, cudaMemcpyDeviceToHost, s));
        CU(cudaStreamSynchronize(s));
        if (res->ok) {
            check_err_word(res, rank, h_misc, "handshake");
            res->mismatches = h_misc[0] ? ~0ull : h_misc[4];
            res->first_bad = h_misc[5];
        }
    }
    if (!all_ok(rank)) goto out;

    /* 2. flag round trip between ranks 0 and 1 */
    if (W >= 2 && rank < 2) {
        pingpong_kernel<<<1, 1, 0, s>>>((uint64_t *)flags.peers_host[1 - rank], (uint64_t *)flags.local, rank, 0,
                                        RT_WARM, RT_ITERS, g_timeout_ns, d_misc, d_misc + 6);
        CU(cudaGetLastError());
        CU(cudaMemcpyAsync(h_misc, d_misc, sizeof h_misc, cudaMemcpyDeviceToHost, s));
        CU(cudaStreamSynchronize(s));
        check_err_word(res, rank, h_misc, "flag round trip");
        if (rank == 0 && res->ok) res->rt_us = (double)h_misc[6] / RT_ITERS / 1e3;
    }
    if (!all_ok(rank)) goto out;

    /* 3. pull / push over peer pointers: peer = next rank */
    {
        int peer = (rank + 1) % W;
        for (int b = 0; b < NB; b++) {
            res->pull_uni[b] = time_copy(rank, rank == 0, s, ev0, ev1, buf.peers_host[peer], priv, kBlocks[b], res);
            res->push_uni[b] = time_copy(rank, rank == 0, s, ev0, ev1, priv, buf.peers_host[peer], kBlocks[b], res);
            res->pull_bi[b] = time_copy(rank, true, s, ev0, ev1, buf.peers_host[peer], priv, kBlocks[b], res);
            res->push_bi[b] = time_copy(rank, true, s, ev0, ev1, priv, buf.peers_host[peer], kBlocks[b], res);
        }
    }
    if (!all_ok(rank)) goto out;

    /* 4. ncclAlltoAll, 256 MiB per rank (send: priv, recv: a2a_recv) */
    {
        ncclComm_t nc = comet_comm_nccl(c);
        size_t count = BUF_BYTES / sizeof(float) / (size_t)W;
        ncclResult_t r = ncclSuccess;
        for (int i = 0; i < A2A_WARM && r == ncclSuccess; i++)
            r = ncclAlltoAll(priv, a2a_recv, count, ncclFloat, nc, s);
        CU(cudaStreamSynchronize(s));
        all_ok(rank);
        CU(cudaEventRecord(ev0, s));
        for (int i = 0; i < A2A_REPS && r == ncclSuccess; i++)
            r = ncclAlltoAll(priv, a2a_recv, count, ncclFloat, nc, s);
        CU(cudaEventRecord(ev1, s));
        CU(cudaEventSynchronize(ev1));
        float ms = 0;
        CU(cudaEventElapsedTime(&ms, ev0, ev1));
        if (r != ncclSuccess && res->ok) RFAIL("rank %d: ncclAlltoAll: %s", rank, ncclGetErrorString(r));
        res->a2a_ms = ms / A2A_REPS;
    }
    all_ok(rank);

out:
    if (s) cudaStreamSynchronize(s);
    if (ev0) cudaEventDestroy(ev0);
    if (ev1) cudaEventDestroy(ev1);
    if (s) cudaStreamDestroy(s);
    if (d_misc) cudaFree(d_misc);
    pthread_barrier_wait(&g_bar);
    if (c) {
        /* free one buffer explicitly, leave the rest to destroy */
        res->free_st = comet_comm_free_symmetric(c, &buf);
        if (res->free_st != COMET_SUCCESS && res->ok)
            RFAIL("rank %d: comet_comm_free_symmetric: %s", rank, comet_last_error());
        res->destroy_st = comet_comm_destroy(c);
        if (res->destroy_st != COMET_SUCCESS && res->ok)
            RFAIL("rank %d: comet_comm_destroy: %s", rank, comet_last_error());
    }
    return NULL;
}

static void fmt_version(int code, char *out, size_t n) {
    snprintf(out, n, "%d.%d.%d", code / 10000, code / 100 % 100, code % 100);
}

int main(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        check_skip("test_comm_gpu", "no GPU");
        return check_summary("test_comm_gpu");
    }
    W = n < MAXG ? n : MAXG;
    const char *to = getenv("COMET_TIMEOUT_MS");
    g_timeout_ns = (uint64_t)(to && atoi(to) > 0 ? atoi(to) : 10000) * 1000000ull;

    /* version guard */
    int loaded = 0, built = 0;
    comet_comm_nccl_versions(&loaded, &built);
    char lv[32], bv[32];
    fmt_version(loaded, lv, sizeof lv);
    fmt_version(built, bv, sizeof bv);
    printf("test_comm_gpu: NCCL headers %s (NCCL_VERSION_CODE %d), loaded libnccl %s (ncclGetVersion %d); %d GPU(s)\n",
           bv, built, lv, loaded, n);
    CHECK(comet_comm_check_version(built) == COMET_SUCCESS, "guard refuses equal versions: %s", comet_last_error());
    int fake = built == 22803 ? 22809 : 22803;
    char fv[32];
    fmt_version(fake, fv, sizeof fv);
    CHECK(comet_comm_check_version(fake) == COMET_ERR_NCCL && strstr(comet_last_error(), fv) &&
              strstr(comet_last_error(), bv) && strstr(comet_last_error(), "LD_LIBRARY_PATH"),
          "guard message for %s vs %s: '%s'", fv, bv, comet_last_error());
    CHECK(comet_comm_create(NULL, 0, 1, &g_id, 0) == COMET_ERR_INVALID_ARGUMENT, "NULL comm accepted");
    comet_comm_t *bad = NULL;
    CHECK(comet_comm_create(&bad, 0, 0, &g_id, 0) == COMET_ERR_INVALID_ARGUMENT && !bad, "world_size 0 accepted");
    CHECK(comet_comm_create(&bad, 2, 2, &g_id, 0) == COMET_ERR_INVALID_ARGUMENT && !bad, "rank 2 of 2 accepted");
    CHECK(comet_comm_destroy(NULL) == COMET_SUCCESS, "destroy(NULL)");

    comet_status_t st = comet_comm_unique_id(&g_id);
    if (loaded != built) {
        CHECK(st == COMET_ERR_NCCL, "unique_id passed the guard with mismatched versions");
        printf("test_comm_gpu: version guard refused as it must: %s\n", comet_last_error());
        CHECK(loaded == built, "loaded libnccl %s != headers %s: GPU part not run", lv, bv);
        return check_summary("test_comm_gpu");
    }
    CHECK(st == COMET_SUCCESS, "comet_comm_unique_id: %s", comet_last_error());
    const char *nv = getenv("NCCL_NVLS_ENABLE");
    CHECK(nv && strcmp(nv, "0") == 0, "NCCL_NVLS_ENABLE is '%s' after comet_comm_unique_id", nv ? nv : "(unset)");
    if (st != COMET_SUCCESS) return check_summary("test_comm_gpu");

    pthread_barrier_init(&g_bar, NULL, (unsigned)W);
    pthread_t th[MAXG];
    for (int r = 0; r < W; r++) pthread_create(&th[r], NULL, rank_main, (void *)(intptr_t)r);
    for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
    pthread_barrier_destroy(&g_bar);

    bool all = true;
    for (int r = 0; r < W; r++) {
        rank_result_t *x = &g_res[r];
        CHECK(x->ok, "%s", x->err);
        all = all && x->ok;
        if (!x->ok) continue;
        CHECK(x->mismatches == 0, "rank %d: %llu words of peer buffers differ (first: peer %llu word %llu)", r,
              x->mismatches, x->first_bad >> 48, x->first_bad & 0xffffffffffffull);
        CHECK(x->peers_distinct, "rank %d: peer pointers not distinct or NULL", r);
        CHECK(x->mem.symmetric_bytes == BUF_BYTES + FLAG_BYTES && x->mem.symmetric_buffers == 2,
              "rank %d: symmetric memory reported %zu bytes in %d buffers", r, x->mem.symmetric_bytes,
              x->mem.symmetric_buffers);
        CHECK(x->mem.private_bytes == 2 * BUF_BYTES + 2 * sizeof(void *) * (size_t)W,
              "rank %d: private memory reported %zu bytes", r, x->mem.private_bytes);
    }

    /* the table, last */
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    printf("\ntest_comm_gpu: %d x %s, NCCL %s, NCCL_NVLS_ENABLE=%s\n", W, prop.name, lv, nv ? nv : "(unset)");
    printf("  peer check     : %s (%d ranks x %zu MiB read through peer pointers)\n",
           all ? "exact" : "FAILED", W, BUF_BYTES >> 20);
    if (W >= 2 && all)
        printf("  flag round trip: %.3f us (ranks 0<->1, mean of %d)\n", g_res[0].rt_us, RT_ITERS);
    printf("  memory per rank: symmetric %.1f MiB, private %.1f MiB\n", g_res[0].mem.symmetric_bytes / 1048576.0,
           g_res[0].mem.private_bytes / 1048576.0);
    if (all) {
        printf("  copy GB/s over peer pointers, 256 MiB, 512 threads/block (bi: min over ranks, all at once)\n");
        printf("  %7s %9s %9s %9s %9s\n", "blocks", "pull-uni", "push-uni", "pull-bi", "push-bi");
        for (int b = 0; b < NB; b++) {
            double pb = 1e30, sb = 1e30;
            for (int r = 0; r < W; r++) {
                if (g_res[r].pull_bi[b] < pb) pb = g_res[r].pull_bi[b];
                if (g_res[r].push_bi[b] < sb) sb = g_res[r].push_bi[b];
            }
            printf("  %7d %9.1f %9.1f %9.1f %9.1f\n", kBlocks[b], g_res[0].pull_uni[b], g_res[0].push_uni[b], pb, sb);
        }
        double a2a = 0;
        for (int r = 0; r < W; r++)
            if (g_res[r].a2a_ms > a2a) a2a = g_res[r].a2a_ms;
        printf("  ncclAlltoAll 256 MiB/rank: %.3f ms (max over ranks, mean of %d), %.1f GB/s per rank\n", a2a,
               A2A_REPS, a2a > 0 ? (double)BUF_BYTES / (a2a * 1e-3) / 1e9 : 0.0);
    }
    return check_summary("test_comm_gpu");
}
