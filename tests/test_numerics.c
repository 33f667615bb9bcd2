/*
 * test_numerics.c - bf16 conversion (round to nearest even, NaN, infinities)
 * and the activations, against values worked out by hand; the GEMM's GELU
 * (comet_gelu_fast) against the exact GELU over a sweep.
 */
#include <math.h>
#include <string.h>

#include "../src/core/numerics.h"
#include "check.h"

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

int main(void) {
    /* exact values survive */
    const float exact[] = {0.0f, 1.0f, -2.0f, 0.5f, 3.0f, 65280.0f, -0.0f};
    for (size_t i = 0; i < sizeof exact / sizeof exact[0]; i++)
        CHECK(comet_bf16_to_f32(comet_f32_to_bf16(exact[i])) == exact[i], "%g", exact[i]);
    CHECK(comet_f32_to_bf16(-0.0f) == 0x8000, "sign of -0");
    /* ties go to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 */
    CHECK(comet_f32_to_bf16(from_bits(0x3f808000u)) == 0x3f80, "tie rounds down to even");
    CHECK(comet_f32_to_bf16(from_bits(0x3f818000u)) == 0x3f82, "tie rounds up to even");
    CHECK(comet_f32_to_bf16(from_bits(0x3f808001u)) == 0x3f81, "above half rounds up");
    CHECK(comet_f32_to_bf16(from_bits(0x3f807fffu)) == 0x3f80, "below half rounds down");
    /* overflow to infinity, infinities and NaN */
    CHECK(comet_f32_to_bf16(from_bits(0x7f7fffffu)) == 0x7f80, "max float rounds to inf");
    CHECK(comet_f32_to_bf16(INFINITY) == 0x7f80, "inf");
    CHECK(comet_f32_to_bf16(-INFINITY) == 0xff80, "-inf");
    uint16_t n = comet_f32_to_bf16(NAN);
    CHECK((n & 0x7f80) == 0x7f80 && (n & 0x7f) != 0, "NaN stays NaN: %#x", n);
    CHECK(comet_f32_to_bf16(from_bits(0x7f800001u)) != 0x7f80, "NaN with low payload is not inf");
    /* activations */
    CHECK(comet_silu(0.0f) == 0.0f, "silu(0)");
    CHECK(fabsf(comet_silu(1.0f) - 0.7310586f) < 1e-6f, "silu(1) = %.7f", comet_silu(1.0f));
    CHECK(fabsf(comet_silu(-20.0f)) < 1e-7f, "silu(-20)");
    CHECK(comet_gelu(0.0f) == 0.0f, "gelu(0)");
    CHECK(fabsf(comet_gelu(1.0f) - 0.8413447f) < 1e-6f, "gelu(1) = %.7f", comet_gelu(1.0f));
    CHECK(fabsf(comet_gelu(-1.0f) + 0.1586553f) < 1e-6f, "gelu(-1) = %.7f", comet_gelu(-1.0f));
    /* the GEMM epilogue's GELU: relative error against the exact GELU
     * (g/2 erfc(-g/sqrt 2) in double) over g in [-14, 14] (past it the result
     * is g or underflows): below 1e-6 (a few fp32 ulps) for g >= -2, below
     * 3e-5 in the far negative tail (rounding of z^2 in the exponent), where
     * comet_gelu's 1 + erff cancels to 0 (relative error 1). bf16 keeps 2^-8. */
    double worst_fast = 0, worst_near = 0, worst_erff = 0;
    for (int i = -1400000; i <= 1400000; i++) {
        const float g = (float)i * 1e-5f;
        const double ref = 0.5 * (double)g * erfc(-(double)g / sqrt(2.0));
        if (fabs(ref) < 1e-30) continue;
        const double ef = fabs(comet_gelu_fast(g) - ref) / fabs(ref), ee = fabs(comet_gelu(g) - ref) / fabs(ref);
        worst_fast = ef > worst_fast ? ef : worst_fast;
        if (g >= -2.0f) worst_near = ef > worst_near ? ef : worst_near;
        if (g >= -2.0f) worst_erff = ee > worst_erff ? ee : worst_erff;
    }
    CHECK(worst_near < 1e-6 && worst_fast < 3e-5, "gelu_fast: worst relative error %.3g for g >= -2, %.3g overall",
          worst_near, worst_fast);
    CHECK(comet_gelu_fast(0.0f) == 0.0f && comet_gelu_fast(INFINITY) == INFINITY && isnan(comet_gelu_fast(NAN)) &&
              isnan(comet_gelu_fast(-INFINITY)) == isnan(comet_gelu(-INFINITY)),
          "gelu_fast: 0, inf, NaN, -inf");
    printf("test_numerics: gelu_fast worst relative error %.3g for g >= -2 (comet_gelu %.3g), %.3g overall\n",
           worst_near, worst_erff, worst_fast);
    return check_summary("test_numerics");
}
