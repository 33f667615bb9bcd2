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

#include "../plan/hd.h"

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

/* f rounded to bf16 (as comet_f32_to_bf16), back in fp32: a contract's rounding point in fp32 arithmetic. */
COMET_HD static inline float comet_bf16_round(float f) { return comet_bf16_to_f32(comet_f32_to_bf16(f)); }

COMET_HD static inline float comet_silu(float g) { return g / (1.0f + expf(-g)); }

/* The gated SiLU's backward (include/comet.h, backward step 4): from the
 * pre-activation (g, u) and the gradient dA of h = silu(g) u, the gradients
 * of g and u, evaluated in this order. */
COMET_HD static inline void comet_silu_gated_backward(float g, float u, float dA, float *dg, float *du) {
    const float s = 1.0f / (1.0f + expf(-g));
    *dg = dA * u * s * (1.0f + g * (1.0f - s));
    *du = dA * g * s;
}

/* d gelu(g) / dg, erf form: Phi(g) + g phi(g). */
COMET_HD static inline float comet_gelu_grad(float g) {
    return 0.5f * (1.0f + erff(g * 0.70710678118654752f)) + g * 0.39894228040143268f * expf(-0.5f * g * g);
}

/* GELU, erf form (torch.nn.GELU() default). */
COMET_HD static inline float comet_gelu(float g) {
    return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f));
}

/* The same GELU with fewer registers, for the Hopper GEMM's epilogue (erff
 * there spilled). erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z/2), z >= 0,
 * is the classic Chebyshev fit with fractional error below 1.2e-7 for every
 * z; 1 + erf(x) is erfc(-x) for x < 0 and 2 - erfc(x) otherwise, so the
 * result keeps about that relative accuracy for every g (tests/test_numerics.c
 * measures the host form: under 1e-6 for g >= -2, 2e-5 in the far negative
 * tail; on the GPU the exponential is the special-function unit's ex2, a few
 * 1e-7 more). For g >= -2 it and comet_gelu differ by a few fp32 ulps, so h
 * in bf16 by a rounding flip at most; below about -4.4 comet_gelu's 1 + erff
 * cancels (absolute error ~3e-8 on results under ~1e-5), so there the two
 * differ by several bf16 ulps of a tiny value. Infinities and NaN as
 * comet_gelu; with flush-to-zero on the GPU, -0 below about g = -13. */
COMET_HD static inline float comet_gelu_fast(float g) {
    const float x = g * 0.70710678118654752f, z = fabsf(x);
    const float t = 1.0f / (1.0f + 0.5f * z);
    float p = 0.17087277f;
    p = fmaf(p, t, -0.82215223f);
    p = fmaf(p, t, 1.48851587f);
    p = fmaf(p, t, -1.13520398f);
    p = fmaf(p, t, 0.27886807f);
    p = fmaf(p, t, -0.18628806f);
    p = fmaf(p, t, 0.09678418f);
    p = fmaf(p, t, 0.37409196f);
    p = fmaf(p, t, 1.00002368f);
    p = fmaf(p, t, -1.26551223f);
    const float a = (p - z * z) * 1.44269504088896341f; /* log2 of erfc / t */
#ifdef __CUDA_ARCH__
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(a));
#else
    const float e = exp2f(a);
#endif
    const float erfc_z = t * e;
    return 0.5f * g * (x < 0.0f ? erfc_z : 2.0f - erfc_z);
}

#endif /* COMET_NUMERICS_H */
