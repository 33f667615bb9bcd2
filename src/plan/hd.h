/*
 * hd.h - the one macro that lets plain C compile for the host and, unchanged,
 * inside CUDA kernels. Used by code shared between the CPU backend and the GPU
 * (plans, numerics). Not part of the public API.
 */
#ifndef COMET_HD_H
#define COMET_HD_H

#ifdef __CUDACC__
#define COMET_HD __host__ __device__
#else
#define COMET_HD
#endif

#endif /* COMET_HD_H */
