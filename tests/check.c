/*
 * check.c - see check.h.
 */
#include "check.h"

#include <stdarg.h>

static int passed, failed, skipped;

void check_record(int ok, const char *file, int line, const char *expr, const char *fmt, ...) {
    if (ok) {
        passed++;
        return;
    }
    failed++;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAIL %s:%d: %s: ", file, line, expr);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

void check_skip(const char *what, const char *why) {
    skipped++;
    printf("%s: skipped (%s)\n", what, why);
}

int check_summary(const char *name) {
    if (skipped)
        printf("%s: %d passed, %d failed, %d skipped\n", name, passed, failed, skipped);
    else
        printf("%s: %d passed, %d failed\n", name, passed, failed);
    return failed ? 1 : 0;
}
