/*
 * bench_check.h - the benchmarks' checks of CUDA and cuBLAS return codes:
 * print the call, file and line, and exit(1) (a benchmark has nothing to
 * clean up). For the benchmarks under bench/ only; the library reports
 * errors as statuses.
 */
#ifndef COMET_BENCH_CHECK_H
#define COMET_BENCH_CHECK_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x)                                                                                        \
    do {                                                                                             \
        cudaError_t e_ = (x);                                                                        \
        if (e_ != cudaSuccess) {                                                                     \
            fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
            exit(1);                                                                                 \
        }                                                                                            \
    } while (0)
#define CKB(x)                                                                                       \
    do {                                                                                             \
        cublasStatus_t s_ = (x);                                                                     \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                           \
            fprintf(stderr, "cuBLAS error %d at %s:%d: %s\n", (int)s_, __FILE__, __LINE__, #x);      \
            exit(1);                                                                                 \
        }                                                                                            \
    } while (0)

#endif
