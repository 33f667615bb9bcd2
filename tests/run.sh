#!/usr/bin/env bash
# run.sh BUILD_DIR - run every test binary, the CLI checks, the example
# built against `make install` (tests/test_example.sh), the tree's layout
# (tests/test_layout.sh), the paths into bench/results
# (tests/test_results_links.sh) and the Python package's tests
# (tests/test_python.sh: pytest over BUILD_DIR's libcomet.so), then print
# one closing line "total: N passed, N failed" (exit 1 if anything failed).
set -u
build=${1:-build}
passed=0 failed=0 skipped=0
for t in "$build"/tests/test_*; do
    [ -x "$t" ] || continue
    log=$(mktemp)
    timeout "${COMET_TEST_TIMEOUT:-1800}" "$t" 2>&1 | tee "$log"; rc=${PIPESTATUS[0]}
    out=$(cat "$log"); rm -f "$log"
    [ "$rc" -eq 124 ] && echo "FAIL $t: timed out after ${COMET_TEST_TIMEOUT:-1800} s"
    line=$(printf '%s\n' "$out" | grep -E '^[a-z_]+: [0-9]+ passed, [0-9]+ failed' | tail -n 1)
    if [ -z "$line" ]; then
        echo "FAIL $t: exited $rc without a summary"; failed=$((failed + 1)); continue
    fi
    p=$(sed -E 's/.*: ([0-9]+) passed.*/\1/' <<<"$line"); f=$(sed -E 's/.* ([0-9]+) failed.*/\1/' <<<"$line")
    s=$(grep -oE '[0-9]+ skipped' <<<"$line" | grep -oE '[0-9]+' || true)
    passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + ${s:-0}))
    [ "$rc" -ne 0 ] && [ "$f" -eq 0 ] && { echo "FAIL $t: exit code $rc"; failed=$((failed + 1)); }
done
for src in tests/test_*.cu; do # GPU tests need nvcc to be built at all
    name=$(basename "$src" .cu)
    [ -x "$build/tests/$name" ] || { echo "$name: skipped (not built: no nvcc, or a sanitizer build)"; skipped=$((skipped + 1)); }
done
# The CLI, the example against `make install` (test_example.sh), the tree's layout (test_layout.sh),
# every bench/results path the repository names and the results index (test_results_links.sh),
# the Python package (test_python.sh).
for script in tests/test_cli.sh tests/test_example.sh tests/test_layout.sh tests/test_results_links.sh tests/test_python.sh; do
    name=$(basename "$script" .sh)
    out=$("$script" "$build" 2>&1)
    printf '%s\n' "$out"
    line=$(printf '%s\n' "$out" | grep -E "^$name: [0-9]+ passed" | tail -n 1)
    p=$(sed -E 's/.*: ([0-9]+) passed.*/\1/' <<<"$line"); f=$(sed -E 's/.* ([0-9]+) failed.*/\1/' <<<"$line")
    s=$(grep -oE '[0-9]+ skipped' <<<"$line" | grep -oE '[0-9]+' || true)
    passed=$((passed + ${p:-0})); failed=$((failed + ${f:-1})); skipped=$((skipped + ${s:-0}))
done
if [ "$skipped" -gt 0 ]; then
    echo "total: $passed passed, $failed failed, $skipped skipped"
else
    echo "total: $passed passed, $failed failed"
fi
[ "$failed" -eq 0 ]
