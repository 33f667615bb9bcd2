/*
 * test_numerics.c - bf16 conversion (round to nearest even, NaN, infinities)
 * and the activations, against values worked out by hand.
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
    return check_summary("test_numerics");
}
