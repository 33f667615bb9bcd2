/*
 * status.h - internal error reporting: set the calling thread's last-error
 * message and return a status in one expression.
 *
 *   if (cfg->topk < 1) return comet_fail(COMET_ERR_INVALID_ARGUMENT, "topk %lld < 1", ...);
 *
 * Library code never prints or exits; it fails through here.
 */
#ifndef COMET_STATUS_H
#define COMET_STATUS_H

#include "comet.h"

#if defined(__GNUC__)
#define COMET_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define COMET_PRINTF(a, b)
#endif

/* Set the last-error message (printf-style) and return status. */
comet_status_t comet_fail(comet_status_t status, const char *fmt, ...) COMET_PRINTF(2, 3);
/* Set the last-error message from another thread's message (worker -> caller). */
comet_status_t comet_fail_copy(comet_status_t status, const char *message);
/* Clear the last error: every successful public call starts with this. */
void comet_clear_error(void);

/* Evaluate a call returning comet_status_t; return its status on failure. */
#define COMET_TRY(call)                              \
    do {                                             \
        comet_status_t comet_try_st_ = (call);       \
        if (comet_try_st_ != COMET_SUCCESS) return comet_try_st_; \
    } while (0)

#endif /* COMET_STATUS_H */
