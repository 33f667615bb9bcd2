/*
 * status.c - status strings (one table) and the per-thread last-error message.
 */
#include "status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static const char *const status_names[COMET_NUM_STATUS] = {
    [COMET_SUCCESS] = "COMET_SUCCESS",
    [COMET_ERR_INVALID_ARGUMENT] = "COMET_ERR_INVALID_ARGUMENT",
    [COMET_ERR_INVALID_SHAPE] = "COMET_ERR_INVALID_SHAPE",
    [COMET_ERR_INVALID_ROUTING] = "COMET_ERR_INVALID_ROUTING",
    [COMET_ERR_PEER_FAILED] = "COMET_ERR_PEER_FAILED",
    [COMET_ERR_UNSUPPORTED] = "COMET_ERR_UNSUPPORTED",
    [COMET_ERR_OUT_OF_MEMORY] = "COMET_ERR_OUT_OF_MEMORY",
    [COMET_ERR_TIMEOUT] = "COMET_ERR_TIMEOUT",
    [COMET_ERR_SYSTEM] = "COMET_ERR_SYSTEM",
    [COMET_ERR_CUDA] = "COMET_ERR_CUDA",
    [COMET_ERR_NCCL] = "COMET_ERR_NCCL",
    [COMET_ERR_INTERNAL] = "COMET_ERR_INTERNAL",
};

static _Thread_local char last_error[1024];

const char *comet_status_string(comet_status_t status) {
    if ((int)status < 0 || status >= COMET_NUM_STATUS) return "COMET_ERR_UNKNOWN";
    return status_names[status];
}

const char *comet_last_error(void) { return last_error; }

int comet_version(void) { return COMET_VERSION_CODE; }

comet_status_t comet_fail(comet_status_t status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

comet_status_t comet_fail_copy(comet_status_t status, const char *message) {
    snprintf(last_error, sizeof last_error, "%s", message);
    return status;
}

void comet_clear_error(void) { last_error[0] = '\0'; }
