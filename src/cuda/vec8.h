/*
 * vec8.h - vector accesses of the data movers: 8 columns at once (one
 * 16-byte bf16 access, two for fp32; with vec 0, n <= 8 scalar accesses),
 * element i of 8 packed bf16. Device code (the combine, src/cuda/layer/combine.cuh;
 * dev/combine), CUDA C++.
 */
#ifndef COMET_CUDA_VEC8_H
#define COMET_CUDA_VEC8_H

#include <stdint.h>

#include "../core/numerics.h"

/* vec: the address is 16-byte aligned and all 8 columns exist; else n (<= 8) scalar accesses. */
__device__ static inline uint4 ld8_bf16(const comet_bf16_t *p, int n, int vec) {
    if (vec) return *(const uint4 *)p;
    uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (i < n) w[i / 2] |= (uint32_t)p[i] << (16 * (i % 2));
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* Element i (0..7) of 8 packed bf16, as a float (exact). */
__device__ static inline float bf16_at(uint4 r, int i) {
    const uint32_t w = i < 2 ? r.x : i < 4 ? r.y : i < 6 ? r.z : r.w;
    return __uint_as_float(i % 2 ? w & 0xffff0000u : w << 16);
}

/* 8 fp32 (the n that exist; two 16-byte accesses when vec). */
__device__ static inline void ld8_f32(const float *p, float v[8], int n, int vec) {
    if (vec) {
        const float4 a = ((const float4 *)p)[0], b = ((const float4 *)p)[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = i < n ? p[i] : 0.0f;
}

__device__ static inline void st8_f32(float *p, const float v[8], int n, int vec) {
    if (vec) {
        ((float4 *)p)[0] = make_float4(v[0], v[1], v[2], v[3]);
        ((float4 *)p)[1] = make_float4(v[4], v[5], v[6], v[7]);
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (i < n) p[i] = v[i];
}

__device__ static inline void st8_bf16(comet_bf16_t *p, const float v[8], int n, int vec) {
    if (vec) {
        uint32_t w[4];
        for (int i = 0; i < 4; i++)
            w[i] = (uint32_t)comet_f32_to_bf16(v[2 * i]) | (uint32_t)comet_f32_to_bf16(v[2 * i + 1]) << 16;
        *(uint4 *)p = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (i < n) p[i] = comet_f32_to_bf16(v[i]);
    }
}

#endif /* COMET_CUDA_VEC8_H */
