/*
 * check.h - the tests' tiny harness: CHECK records a pass or a failure (with
 * file, line and a printf message), check_summary prints
 * "<name>: N passed, N failed" and gives the exit code.
 */
#ifndef COMET_CHECK_H
#define COMET_CHECK_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

void check_record(int ok, const char *file, int line, const char *expr, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
int check_summary(const char *name);
/* Prints "skipped (<why>)" and counts it in the summary. */
void check_skip(const char *what, const char *why);
/* Whether v is in the comma-separated list of numbers in environment
 * variable var (unset or empty: every value is): the GPU tests' selectors of
 * world sizes and layouts. */
int check_listed(const char *var, int v);
/* FNV-1a (64-bit) over n bytes, continuing from h (CHECK_FNV1A_BASIS to
 * start): the tests' digests of outputs they compare across builds or pin. */
#define CHECK_FNV1A_BASIS 0xcbf29ce484222325ull
uint64_t check_fnv1a(uint64_t h, const void *p, size_t n);

#define CHECK(cond, ...) check_record(!!(cond), __FILE__, __LINE__, #cond, __VA_ARGS__)

#ifdef __CUDACC__
/* In a void test function: a failed CUDA call is a failed check, then return. */
#define CUDA_OK(call)                                                  \
    do {                                                               \
        cudaError_t e_ = (call);                                       \
        if (e_ != cudaSuccess) {                                       \
            CHECK(0, "%s: %s", #call, cudaGetErrorString(e_));         \
            return;                                                    \
        }                                                              \
    } while (0)
#endif

#ifdef __cplusplus
}
#endif

#endif /* COMET_CHECK_H */
