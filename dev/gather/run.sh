#!/bin/bash
# run.sh: builds and runs gather_probe on the GPU machine (one GPU): the layout check, then the
# three load ways' rates, each in its own process. Prints a table; logs in ${OUT:-/tmp}/gather.log.
# Exits with the layout check's status (0: one-row TMA loads lay a stage out as a box load does).
cd "$(dirname "$0")"
NVCC=${NVCC:-nvcc}
log=${OUT:-/tmp}/gather.log
$NVCC -gencode arch=compute_90a,code=sm_90a -O3 -o gather_probe gather_probe.cu > "$log" 2>&1 || { cat "$log"; exit 2; }
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader | head -n 1
timeout 60 ./gather_probe layout 2>&1 | tee -a "$log"
layout_rc=${PIPESTATUS[0]}
echo "layout exit $layout_rc"
printf '%-28s %-6s %6s %12s %14s %12s\n' "A stage loads" "rows" "CTAs" "GB/s (med)" "per CTA" "GB/s (best)"
for m in 0 2 1; do timeout 60 ./gather_probe rate $m 2>&1 | tee -a "$log"; echo "rate $m exit ${PIPESTATUS[0]}"; done
echo "GEMM0 needs ~17.8 GB/s of A per SM at 600 TFLOP/s (132 SMs)."
exit "$layout_rc"
