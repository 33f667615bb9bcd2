#!/bin/bash
# run.sh: the one script the GPU call runs (one GPU, from anywhere): build, memcheck the tiny config, then
# every version on every config (bitwise check against the CPU reference, then the median of 25 timed runs).
# Logs go to $OUT (or ./out). Prints the table last.
export NCCL_NVLS_ENABLE=0
cd "$(dirname "$0")"
O=${OUT:-./out}; mkdir -p "$O"
./build.sh > "$O/combine-build.log" 2>&1 || { cat "$O/combine-build.log"; exit 1; }
grep -E "Used" "$O/combine-build.log"
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 ./combine 0 tiny > "$O/combine-memcheck.log" 2>&1
echo "memcheck (tiny, every version): exit $? $(grep -E 'ERROR SUMMARY' "$O/combine-memcheck.log")"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
timeout ${TO:-300} ./combine ${VERS:-0} > "$O/combine.log" 2>&1
rc=$?
echo "combine: exit $rc"
cat "$O/combine.log"
exit $rc
