#!/bin/bash
# run.sh: builds and runs dev/pull/fanout on one GPU (sm_90a), from anywhere; fails on nvcc errors,
# register spills or a wrong row. Logs to $OUT (or ./out).
set -o pipefail
cd "$(dirname "$0")"
O=${OUT:-./out}; mkdir -p "$O"
${NVCC:-nvcc} -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -Xptxas -v -o fanout fanout.cu > "$O/fanout-build.log" 2>&1 \
    || { cat "$O/fanout-build.log"; exit 1; }
if grep -E "[1-9][0-9]* bytes spill" "$O/fanout-build.log"; then echo "BUILD FAIL: spills"; exit 1; fi
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
timeout ${TO:-120} ./fanout | tee "$O/fanout.log"
