/*
 * cpu_tiles.h - the multi-rank engine's register tiles of cpu_math.h's
 * arithmetic: the same operations on the same operands in the same order per
 * output element, several outputs at a time so that an operand loaded (and
 * widened from bf16) once serves several of them. Every function here is
 * bitwise the cpu_math.h step it names; the engine's tests
 * (tests/test_engine.c, tests/test_engine_backward.c) compare with the
 * references, which use cpu_math.h alone.
 *
 * Vectors are GCC/clang vector extensions of 4 floats: an element-wise
 * IEEE add or multiply is the scalar one (the build has -ffp-contract=off:
 * no fused multiply-adds), so lane i of acc += s * v is sum[i] += s * v[i].
 */
#ifndef COMET_CPU_TILES_H
#define COMET_CPU_TILES_H

#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

typedef float cpu_v4f __attribute__((vector_size(16)));
typedef uint16_t cpu_v8u16 __attribute__((vector_size(16)));

/* p[0:8) in fp32: lo = p[0:4), hi = p[4:8). */
static inline void cpu_bf16x8(const comet_bf16_t *p, cpu_v4f *lo, cpu_v4f *hi) {
#if (defined(__clang__) || __GNUC__ >= 12) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* a bf16 is the high half of its fp32: interleave with zeros */
    cpu_v8u16 x, z = {0, 0, 0, 0, 0, 0, 0, 0};
    memcpy(&x, p, sizeof x);
    const cpu_v8u16 l = __builtin_shufflevector(z, x, 0, 8, 1, 9, 2, 10, 3, 11);
    const cpu_v8u16 h = __builtin_shufflevector(z, x, 4, 12, 5, 13, 6, 14, 7, 15);
    memcpy(lo, &l, sizeof l);
    memcpy(hi, &h, sizeof h);
#else
    const cpu_v4f l = {comet_bf16_to_f32(p[0]), comet_bf16_to_f32(p[1]), comet_bf16_to_f32(p[2]),
                       comet_bf16_to_f32(p[3])};
    const cpu_v4f h = {comet_bf16_to_f32(p[4]), comet_bf16_to_f32(p[5]), comet_bf16_to_f32(p[6]),
                       comet_bf16_to_f32(p[7])};
    *lo = l, *hi = h;
#endif
}

/* comet_cpu_dot's end from its eight lanes after k: the tail k..n-1 into
 * lane k mod 8, then the fixed pairwise sum. */
static inline float cpu_dot_finish(cpu_v4f lo, cpu_v4f hi, const comet_bf16_t *a, const comet_bf16_t *b, int64_t k,
                                   int64_t n) {
    float acc[8] = {lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]};
    for (; k < n; k++) acc[k & 7] += comet_bf16_to_f32(a[k]) * comet_bf16_to_f32(b[k]);
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* out[2 i + j] = comet_cpu_dot(a_i, b_j, n), bitwise, for i, j in {0, 1}. */
static inline void cpu_dot2x2(const comet_bf16_t *a0, const comet_bf16_t *a1, const comet_bf16_t *b0,
                              const comet_bf16_t *b1, int64_t n, float out[4]) {
    cpu_v4f c00l = {0}, c00h = {0}, c01l = {0}, c01h = {0}, c10l = {0}, c10h = {0}, c11l = {0}, c11h = {0};
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        cpu_v4f a0l, a0h, a1l, a1h, b0l, b0h, b1l, b1h;
        cpu_bf16x8(a0 + k, &a0l, &a0h);
        cpu_bf16x8(b0 + k, &b0l, &b0h);
        c00l += a0l * b0l, c00h += a0h * b0h;
        cpu_bf16x8(b1 + k, &b1l, &b1h);
        c01l += a0l * b1l, c01h += a0h * b1h;
        cpu_bf16x8(a1 + k, &a1l, &a1h);
        c10l += a1l * b0l, c10h += a1h * b0h;
        c11l += a1l * b1l, c11h += a1h * b1h;
    }
    out[0] = cpu_dot_finish(c00l, c00h, a0, b0, k, n);
    out[1] = cpu_dot_finish(c01l, c01h, a0, b1, k, n);
    out[2] = cpu_dot_finish(c10l, c10h, a1, b0, k, n);
    out[3] = cpu_dot_finish(c11l, c11h, a1, b1, k, n);
}

/* out_i[j - j0] = comet_cpu_dot(a_i, b + j * ldb, n) for j in [j0, j1),
 * i < 2 (a1 and out1 NULL: one row): each pair of rows and pair of columns
 * as one cpu_dot2x2. */
static inline void cpu_dots(const comet_bf16_t *a0, const comet_bf16_t *a1, const comet_bf16_t *b, int64_t ldb,
                            int64_t j0, int64_t j1, int64_t n, float *out0, float *out1) {
    int64_t j = j0;
    if (a1)
        for (; j + 2 <= j1; j += 2) {
            float o[4];
            cpu_dot2x2(a0, a1, b + j * ldb, b + (j + 1) * ldb, n, o);
            out0[j - j0] = o[0], out0[j + 1 - j0] = o[1], out1[j - j0] = o[2], out1[j + 1 - j0] = o[3];
        }
    for (; j < j1; j++) {
        out0[j - j0] = comet_cpu_dot(a0, b + j * ldb, n);
        if (a1) out1[j - j0] = comet_cpu_dot(a1, b + j * ldb, n);
    }
}

#endif /* COMET_CPU_TILES_H */
