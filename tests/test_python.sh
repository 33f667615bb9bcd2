#!/usr/bin/env bash
# test_python.sh BUILD_DIR - the Python package (python/comet) over
# BUILD_DIR's libcomet.so: pytest on python/tests with PYTHONPATH=python and
# COMET_LIBRARY=BUILD_DIR/libcomet.so, with the python3 on PATH (a venv's,
# say). Installs nothing: without python3 or pytest it is skipped, and the
# tests that need numpy or torch skip themselves, each with its reason. A
# sanitizer build has no shared library: skipped. Prints
# "test_python: N passed, N failed[, N skipped]" (pytest's errors count as
# failed).
set -u
build=${1:-build}
cd "$(dirname "$0")/.."
summary() { echo "test_python: $1 passed, $2 failed${3:+, $3 skipped}"; [ "$2" -eq 0 ]; exit; }

py=$(command -v python3 || true)
[ -n "$py" ] || { echo "test_python: skipped (no python3 on PATH)"; summary 0 0 1; }
if ! "$py" -c 'import pytest' 2>/dev/null; then
    echo "test_python: skipped (pytest is not installed for $py: python3 -m pip install pytest numpy)"
    summary 0 0 1
fi
if [ -f "$build/make.vars" ] && [ -n "$(sed -n 's/^SAN=//p' "$build/make.vars")" ]; then
    echo "test_python: skipped (a sanitizer build has no shared library)"
    summary 0 0 1
fi
[ -e "$build/libcomet.so" ] || { echo "FAIL test_python: no $build/libcomet.so: build with make first"; summary 0 1; }

log=$(mktemp)
trap 'rm -f "$log"' EXIT
# -rs: every skip with its reason; no cache folder in the tree
COMET_LIBRARY=$PWD/$build/libcomet.so PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} \
    timeout "${COMET_TEST_TIMEOUT:-1800}" "$py" -m pytest -p no:cacheprovider -rs -q python/tests 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
line=$(grep -E '^=*[^=]*[0-9]+ (passed|failed|skipped|errors?)' "$log" | tail -n 1)
count() { grep -oE "[0-9]+ $1" <<<"$line" | grep -oE '[0-9]+' | head -n 1; }
p=$(count passed) f=$(count failed) s=$(count skipped) e=$(count 'errors?')
f=$((${f:-0} + ${e:-0}))
if [ -z "$line" ] || { [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; }; then
    echo "FAIL test_python: pytest exited $rc${line:+ ($line)}"
    f=$((f + 1))
fi
[ "${s:-0}" -gt 0 ] && summary "${p:-0}" "$f" "$s"
summary "${p:-0}" "$f"
