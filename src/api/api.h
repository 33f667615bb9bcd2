/*
 * api.h - what the public calls of src/api share: the backend table of each
 * backend this build has (backends.c). Not part of the public API.
 */
#ifndef COMET_API_H
#define COMET_API_H

#include "../core/runtime.h"

/* The operations of backend b, or NULL when this build lacks it (CUDA
 * without nvcc). */
const comet_backend_ops_t *comet_backend_ops(comet_backend_t b);

#endif /* COMET_API_H */
