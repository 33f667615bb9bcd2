/*
 * tma.h - the Hopper (sm_90a) pieces that load tiles into shared memory:
 * mbarrier init / arrive / expect_tx / parity wait, the 2D TMA load, the 1D
 * bulk copy of contiguous bytes, and the host-side tensor map of a row-major
 * bf16 matrix (box of 64 columns, 128B swizzle). Used by the grouped GEMM
 * (gemm.cu), by dev/gather's probe, so the probe measures the loads the GEMM
 * issues, and by dev/combine and dev/pull. CUDA
 * C++ only (inline device code, CUtensorMap from cuda.h; the encoder comes
 * from the driver through the runtime, no -lcuda).
 */
#ifndef COMET_CUDA_TMA_H
#define COMET_CUDA_TMA_H

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

__device__ __forceinline__ uint32_t gm_smem(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void gm_mbar_init(uint64_t *bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(gm_smem(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void gm_mbar_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(gm_smem(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void gm_mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(gm_smem(bar)) : "memory");
}
/* 1 once the phase of the given parity has completed (one try: the hardware may suspend a while). */
__device__ __forceinline__ uint32_t gm_mbar_try_wait(uint64_t *bar, int parity) {
    uint32_t done;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(gm_smem(bar)), "r"(parity)
                 : "memory");
    return done;
}
__device__ __forceinline__ void gm_mbar_wait(uint64_t *bar, int parity) {
    while (!gm_mbar_try_wait(bar, parity)) {
    }
}
/* 2D tile load, coordinates innermost first (k, row). */
__device__ __forceinline__ void gm_tma_load(void *dst, const CUtensorMap *map, int c0, int c1, uint64_t *bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
            gm_smem(dst)),
        "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(gm_smem(bar))
        : "memory");
}
/* 1D bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory. */
__device__ __forceinline__ void gm_bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     gm_smem(dst)),
                 "l"(src), "r"(bytes), "r"(gm_smem(bar))
                 : "memory");
}

typedef CUresult (*gm_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                 const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static gm_encode_fn gm_get_encode(void) {
    static gm_encode_fn fn = NULL;
    if (!fn) {
        cudaDriverEntryPointQueryResult q;
        void *f = NULL;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (gm_encode_fn)f;
    }
    return fn;
}

/* Map over a (rows, cols) row-major bf16 matrix, box box_rows x 64 columns,
 * 128B swizzle, out-of-bounds reads zero. */
static int gm_map(CUtensorMap *m, const void *ptr, int64_t rows, int64_t cols, int box_rows, int l2_promote) {
    gm_encode_fn enc = gm_get_encode();
    if (!enc) return -1;
    cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    cuuint64_t strides[1] = {(cuuint64_t)cols * 2};
    cuuint32_t box[2] = {64, (cuuint32_t)box_rows};
    cuuint32_t es[2] = {1, 1};
    CUresult r = enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)ptr, dims, strides, box, es,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                     l2_promote ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : CU_TENSOR_MAP_L2_PROMOTION_NONE,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? 0 : -1;
}

#endif /* COMET_CUDA_TMA_H */
