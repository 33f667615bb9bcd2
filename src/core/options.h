/*
 * options.h - every setting the library takes from outside the call
 * arguments: the public comet_world_options_t resolved against the
 * environment (at world create), and the measurement knobs that only the
 * environment sets (at layer create). options.c is the one file of the
 * library that reads or writes environment variables; the rest of the
 * library sees the typed fields below. Not part of the public API.
 */
#ifndef COMET_OPTIONS_H
#define COMET_OPTIONS_H

#include "comet.h"

#ifdef __cplusplus
extern "C" {
#endif

#define COMET_PATH_MAX 4096

/* A world's settings: comet_world_options_t with every default filled in. */
typedef struct {
    int timeout_ms;                  /* every wait between ranks or workers */
    int cpu_workers;                 /* compute workers per rank (CPU backend) */
    int graph_replay;                /* CUDA: 1 replay the layer's captured chain, 0 launch kernel by kernel */
    char tune_file[COMET_PATH_MAX];  /* the tuner's table, "" none */
} comet_settings_t;

/* Knobs of the Hopper grouped GEMM (src/cuda/gemm.h); the defaults are the
 * measured winners (docs/decisions.md), the environment changes them only
 * for measurements. */
typedef struct {
    int cluster;   /* 2-CTA clusters sharing B tiles by multicast; COMET_GEMM_CLUSTER=0: single CTAs */
    int narrow;    /* gated GEMM0's last h tile of <= 64 columns at half width; COMET_GEMM_NARROW=0: masked full */
    int group[2];  /* row blocks a tile walk takes together (GEMM0, GEMM1); 0: by the reduction length;
                    * COMET_GEMM_GROUP=N or N0,N1 */
    int split_min; /* GEMM1's tail split: fewest 64-wide k-slices a piece may have, 0: no split;
                    * COMET_GEMM_SPLIT (default 32: 16-slice pieces lost 1% on DeepSeek's K 2048,
                    * 50-56 gained 6-11%) */
} comet_gemm_knobs_t;

#define COMET_GEMM_KNOBS_DEFAULT {1, 1, {0, 0}, 32}

/* Measurement knobs of one layer, read when it is created. They change how a
 * layer runs, never what it computes; every rank must see the same values. */
typedef struct {
    int force_simt;          /* COMET_SIMT_GEMM set: the SIMT GEMM tiles where the Hopper GEMM could run */
    int force_pull;          /* COMET_PUSH=0: the pull combine where push could run */
    comet_gemm_knobs_t gemm;
} comet_layer_knobs_t;

/* The settings of a world created with options (NULL: every field default):
 * a field left at its default takes the environment's value, else the
 * built-in one. Fails on a bad field (struct_size, values out of range, a
 * path too long) with a message; a bad environment value is ignored, as
 * unset. (World create then also refuses a tune file that exists and is not
 * a table, whichever named it.) */
comet_status_t comet_settings_resolve(const comet_world_options_t *options, comet_settings_t *out);

/* The measurement knobs from the environment (layer create), and the GEMM's
 * part of them alone (for tests and benchmarks of the GEMM). */
void comet_layer_knobs_read(comet_layer_knobs_t *out);
comet_gemm_knobs_t comet_gemm_knobs_read(void);

/* NVLink multicast (NVLS) off for every NCCL communicator this process
 * makes: sets NCCL_NVLS_ENABLE=0 unless it is 0 already (src/comm). */
comet_status_t comet_env_nvls_off(void);

#ifdef __cplusplus
}
#endif

#endif /* COMET_OPTIONS_H */
