/*
 * options.c - the one file of the library that reads (or writes) the
 * environment. Each variable is read once: the world's at world create, the
 * measurement knobs at layer create (options.h).
 *
 *   COMET_TIMEOUT_MS    every wait between ranks or workers (1..3600000, default 60000)
 *   COMET_CPU_WORKERS   compute workers per rank on the CPU engine (1..256, default 2)
 *   COMET_TUNE_FILE     the tuner's table (default: none)
 *   COMET_REPLAY        0: CUDA layers launch their kernels one by one (default: replay)
 *   COMET_SIMT_GEMM     set: the SIMT GEMM tiles where the Hopper GEMM could run (measurement)
 *   COMET_PUSH          0: the pull combine where push could run (measurement)
 *   COMET_GEMM_CLUSTER, COMET_GEMM_NARROW, COMET_GEMM_GROUP, COMET_GEMM_SPLIT:
 *                       the Hopper GEMM's knobs (options.h; measurement)
 *   NCCL_NVLS_ENABLE    written: 0 before any communicator exists
 */
#include "options.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"
#include "validate.h"

/* The integer value of variable name within [lo, hi], or fallback when it is
 * unset, empty, not a whole number or out of range. */
static int env_int(const char *name, int fallback, int lo, int hi) {
    const char *s = getenv(name);
    if (!s || !*s) return fallback;
    char *end;
    const long v = strtol(s, &end, 10);
    if (*end || v < lo || v > hi) return fallback;
    return (int)v;
}

static int env_is(const char *name, const char *value) {
    const char *s = getenv(name);
    return s && strcmp(s, value) == 0;
}

comet_status_t comet_settings_resolve(const comet_world_options_t *o, comet_settings_t *out) {
    memset(out, 0, sizeof *out);
    comet_world_options_t none = COMET_WORLD_OPTIONS_INIT;
    if (!o) o = &none;
    COMET_TRY(comet_check_struct_size(o->struct_size, sizeof(comet_world_options_t), "options", "COMET_WORLD_OPTIONS_INIT"));
    if (o->timeout_ms < 0 || o->timeout_ms > 3600 * 1000)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "options.timeout_ms %d is outside [0, 3600000]", o->timeout_ms);
    if (o->cpu_workers < 0 || o->cpu_workers > 256)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "options.cpu_workers %d is outside [0, 256]", o->cpu_workers);
    if (o->graph_replay < -1 || o->graph_replay > 1)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "options.graph_replay %d is not -1, 0 or 1", o->graph_replay);
    if (o->tune_file && strlen(o->tune_file) >= sizeof out->tune_file)
        return comet_fail(COMET_ERR_INVALID_ARGUMENT, "options.tune_file is longer than %d bytes", COMET_PATH_MAX - 1);
    const char *tune = o->tune_file ? o->tune_file : getenv("COMET_TUNE_FILE");
    if (tune && strlen(tune) >= sizeof out->tune_file) tune = NULL; /* a bad environment value: as unset */
    out->timeout_ms = o->timeout_ms ? o->timeout_ms : env_int("COMET_TIMEOUT_MS", 60000, 1, 3600 * 1000);
    out->cpu_workers = o->cpu_workers ? o->cpu_workers : env_int("COMET_CPU_WORKERS", 2, 1, 256);
    out->graph_replay = o->graph_replay ? o->graph_replay > 0 : !env_is("COMET_REPLAY", "0");
    if (tune) strcpy(out->tune_file, tune);
    return COMET_SUCCESS;
}

comet_gemm_knobs_t comet_gemm_knobs_read(void) {
    comet_gemm_knobs_t k = COMET_GEMM_KNOBS_DEFAULT;
    k.cluster = !env_is("COMET_GEMM_CLUSTER", "0");
    k.narrow = !env_is("COMET_GEMM_NARROW", "0");
    const char *grp = getenv("COMET_GEMM_GROUP");
    for (int i = 0; grp && i < 2; i++) { /* "N" sets both, "N0,N1" each */
        const char *v = i && strchr(grp, ',') ? strchr(grp, ',') + 1 : grp;
        const int n = atoi(v);
        k.group[i] = n > 0 && n <= 4096 ? n : 0;
    }
    const char *split = getenv("COMET_GEMM_SPLIT");
    if (split && *split) {
        const int n = atoi(split);
        k.split_min = n > 0 && n <= 4096 ? n : 0;
    }
    return k;
}

void comet_layer_knobs_read(comet_layer_knobs_t *k) {
    memset(k, 0, sizeof *k);
    k->force_simt = getenv("COMET_SIMT_GEMM") != NULL;
    k->force_pull = env_is("COMET_PUSH", "0");
    k->gemm = comet_gemm_knobs_read();
}

static pthread_mutex_t env_mu = PTHREAD_MUTEX_INITIALIZER;

comet_status_t comet_env_nvls_off(void) {
    comet_status_t st = COMET_SUCCESS;
    pthread_mutex_lock(&env_mu);
    if (!env_is("NCCL_NVLS_ENABLE", "0") && setenv("NCCL_NVLS_ENABLE", "0", 1) != 0)
        st = comet_fail(COMET_ERR_SYSTEM, "setenv(NCCL_NVLS_ENABLE=0) failed; NVLink multicast must stay off");
    pthread_mutex_unlock(&env_mu);
    return st;
}
