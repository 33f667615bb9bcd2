/*
 * check.c - see check.h.
 */
#include "check.h"

#include <stdarg.h>
#include <stdlib.h>

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

uint64_t check_fnv1a(uint64_t h, const void *p, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char *)p)[i]) * 0x100000001b3ull;
    return h;
}

int check_listed(const char *var, int v) {
    const char *list = getenv(var);
    if (!list || !*list) return 1;
    for (const char *s = list; *s;) {
        char *end;
        const long n = strtol(s, &end, 10);
        if (end == s) { /* not a number: skip one character */
            s++;
            continue;
        }
        if (n == v) return 1;
        s = end;
    }
    return 0;
}
