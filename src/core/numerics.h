/*
 * numerics.h - the scalar arithmetic of the contract (include/comet.h,
 * "rounding points"): bf16 <-> fp32 conversion with round-to-nearest-even, and
 * the activations. Shared by the CPU backend and the GPU kernels so both round
 * the same way. Not part of the public API.
 */
#ifndef COMET_NUMERICS_H
#define COMET_NUMERICS_H

#include <math.h>
#include <stdint.h>

#include "hd.h"

typedef uint16_t comet_bf16_t; /* storage of one bfloat16 */

typedef union {
    float f;
    uint32_t u;
} comet_f32_bits_t;

COMET_HD static inline float comet_bf16_to_f32(comet_bf16_t h) {
    comet_f32_bits_t b;
    b.u = (uint32_t)h << 16;
    return b.f;
}

/* Round to nearest even; NaN stays NaN (quiet), infinities stay infinite. */
COMET_HD static inline comet_bf16_t comet_f32_to_bf16(float f) {
    comet_f32_bits_t b;
    b.f = f;
    if ((b.u & 0x7fffffffu) > 0x7f800000u) return (comet_bf16_t)((b.u >> 16) | 0x0040u);
    b.u += 0x7fffu + ((b.u >> 16) & 1u);
    return (comet_bf16_t)(b.u >> 16);
}

COMET_HD static inline float comet_silu(float g) { return g / (1.0f + expf(-g)); }

/* GELU, erf form (torch.nn.GELU() default). */
COMET_HD static inline float comet_gelu(float g) {
    return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f));
}

#endif /* COMET_NUMERICS_H */
