/*
 * layer/flags.cuh - what every step of the CUDA layer's kernel chain shares:
 * the memory-order accesses of the flag protocol (st_release_sys,
 * ld_acquire_sys, st_release_gpu; the protocol is in cuda_layer.h), the
 * global timer and trace_rec, the flag waits that name the waiter and trap on
 * timeout (wait_flag, wait_geq), flags_of (a rank's flags), the byte copies of
 * the data movers (copy_bytes, copy_wide), and the constants of a
 * communication CTA (COMM_THREADS, COMM_LANE, COMM_WORKER, TRACE_T0).
 *
 * What it is not: a header to include on its own. It is one room of a single
 * translation unit, src/cuda/layer_chain.cu, which includes the rooms in
 * chain order after the plan, context and vector headers (one unit, not
 * relocatable device code, so that device functions shared between steps
 * still inline and the kernels compile as they did in one file). This room
 * comes first; it defines no kernel.
 */

__device__ static inline void st_release_sys(uint64_t *p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ static inline uint64_t ld_acquire_sys(const uint64_t *p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ static inline void st_release_gpu(uint64_t *p, uint64_t v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ static inline uint64_t globaltimer(void) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* One trace event from t0 to now into a lane (no-op when not tracing). The
 * backward's communication steps run the forward's code: their kinds
 * (pull .. recv) become the backward's twins here. */
__device__ static void trace_rec(const comet_cuda_ctx_t *c, int lane, int role, int worker, int kind, int index,
                                 int aux, uint64_t t0) {
    if (!c->tr_events) return;
    if (role == COMET_TRACE_COMM && kind <= COMET_TRACE_RECV && c->state->call.pass == 1) kind += COMET_TRACE_BWD;
    const unsigned n = atomicAdd(&c->tr_counts[lane], 1u);
    if (n >= c->tr_capacity) return; /* counted, so the host reports it as dropped */
    comet_trace_event_t ev;
    ev.t_begin_ns = t0, ev.t_end_ns = globaltimer();
    ev.index = index, ev.aux = aux;
    ev.rank = (uint16_t)c->d.rank, ev.worker = (uint16_t)worker;
    ev.role = (uint8_t)role, ev.kind = (uint8_t)kind;
    ev.call = (uint16_t)c->state->epoch;
    ((comet_trace_event_t *)c->tr_events)[(size_t)lane * c->tr_capacity + n] = ev;
}

/* Threads of a CTA that moves rows (dispatch, combine, final sum; in the
 * overlapped mode one such CTA an SM beside the GEMM's). */
#define COMM_THREADS 512

/* The comm lane and worker of this CTA. */
#define COMM_LANE (1 + (int)(blockIdx.x % 8))
#define COMM_WORKER ((int)(blockIdx.x % 8))
#define TRACE_T0 (c.tr_events ? globaltimer() : 0)

/* Spin until *flag >= target; on timeout name rank, role and index, then
 * trap. Not inlined, and given scalars only, so that its printf takes no
 * registers from the data movers that call it. */
__device__ static __noinline__ void wait_flag(const uint64_t *flag, uint64_t target, uint64_t timeout_ns, int rank,
                                              const char *role, int index) {
    uint64_t start = globaltimer();
    uint64_t v;
    while ((v = ld_acquire_sys(flag)) < target) {
        if (globaltimer() - start > timeout_ns) {
            printf("comet: rank %d %s %d: timed out after %llu ms waiting for a flag (%llu < %llu)\n", rank, role,
                   index, (unsigned long long)(timeout_ns / 1000000), (unsigned long long)v,
                   (unsigned long long)target);
            __trap();
        }
        __nanosleep(64);
    }
}

__device__ static inline void wait_geq(const uint64_t *flag, uint64_t target, const comet_cuda_ctx_t *c,
                                       const char *role, int index) {
    wait_flag(flag, target, c->timeout_ns, c->d.rank, role, index);
}

__device__ static inline comet_sym_flags_t *flags_of(const comet_cuda_ctx_t *c, int q) {
    return (comet_sym_flags_t *)(c->peers[q] + c->lay.flags);
}

/* Copy n bytes with the widest access both pointers and n allow. */
__device__ static void copy_bytes(void *dst, const void *src, size_t n, size_t tid, size_t nthreads) {
    if ((((uintptr_t)dst | (uintptr_t)src | n) & 15) == 0) {
        uint4 *d = (uint4 *)dst;
        const uint4 *s = (const uint4 *)src;
        for (size_t i = tid; i < n / 16; i += nthreads) d[i] = s[i];
    } else if ((((uintptr_t)dst | (uintptr_t)src | n) & 3) == 0) {
        uint32_t *d = (uint32_t *)dst;
        const uint32_t *s = (const uint32_t *)src;
        for (size_t i = tid; i < n / 4; i += nthreads) d[i] = s[i];
    } else {
        uint16_t *d = (uint16_t *)dst;
        const uint16_t *s = (const uint16_t *)src;
        for (size_t i = tid; i < n / 2; i += nthreads) d[i] = s[i];
    }
}

/* 16-byte loads a thread of copy_wide keeps in flight: copy_bytes has one
 * at a time (a store between loads, which the compiler may not pass), ~0.8
 * TB/s with 256 threads an SM where HBM wants ~18 KB in flight an SM. */
#define COPY_UNROLL 8

/* copy_bytes for large copies by whole grids: where both pointers are
 * 16-byte aligned, the whole 16-byte words with COPY_UNROLL loads in flight
 * a thread, the tail (n % 16 bytes) by copy_bytes. */
__device__ static void copy_wide(void *dst, const void *src, size_t n, size_t tid, size_t nthreads) {
    if ((((uintptr_t)dst | (uintptr_t)src) & 15) != 0) {
        copy_bytes(dst, src, n, tid, nthreads);
        return;
    }
    uint4 *d = (uint4 *)dst;
    const uint4 *s = (const uint4 *)src;
    const size_t n16 = n / 16;
    if (n % 16) copy_bytes((char *)dst + n16 * 16, (const char *)src + n16 * 16, n % 16, tid, nthreads);
    for (size_t base = tid; base < n16; base += nthreads * COPY_UNROLL) {
        uint4 v[COPY_UNROLL];
#pragma unroll
        for (int u = 0; u < COPY_UNROLL; u++)
            if (base + u * nthreads < n16) v[u] = s[base + u * nthreads];
#pragma unroll
        for (int u = 0; u < COPY_UNROLL; u++)
            if (base + u * nthreads < n16) d[base + u * nthreads] = v[u];
    }
}
