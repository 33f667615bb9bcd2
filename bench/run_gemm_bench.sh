#!/usr/bin/env bash
# run_gemm_bench.sh - build and run the grouped-GEMM tests and benchmark on a
# GPU machine (Hopper, sm_90a): standalone nvcc build into $B (default
# /tmp/comet_gemm; it does not need the rest of the CUDA backend or NCCL: the
# C library is compiled CPU-only, src/api too, as harness/workload.c's runner
# refers to the layer API, which the GEMM binaries never call) of
# the forward's grouped GEMM (src/cuda/gemm.cu) and the backward's k-grouped
# weight-gradient GEMM (src/cuda/gemm_wgrad.cu), ptxas check of both (no
# C7508/C751x/C7520; spills reported), tests/test_gemm_gpu and
# tests/test_wgrad_gpu, then bench/gemm_bench (forward GEMMs and the weight
# gradients against cuBLAS: tables on stdout, JSON into $OUT or .). Not a CI step.
#   bench/run_gemm_bench.sh [tokens] [model ...]      SKIP_TEST=1 skips the tests;
#   MEMCHECK=1 adds compute-sanitizer memcheck over the tests' small cases;
#   gemm_bench's environment passes through (GEMM_BENCH_WGRAD=0: no weight gradients)
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
B=${B:-/tmp/comet_gemm}
OUTDIR=${OUT:-.}
NVCC=${NVCC:-nvcc}
NVF="-O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Iinclude"
mkdir -p "$B/obj"
for f in src/api/*.c src/core/*.c src/plan/*.c src/cpu/*.c src/tuner/*.c src/trace/*.c harness/workload.c tests/check.c; do
    cc -O2 -std=c11 -D_GNU_SOURCE -pthread -Iinclude -c "$f" -o "$B/obj/$(basename "$f" .c).o" &
done
wait
for k in gemm gemm_wgrad; do
    rm -f "$B/$k.o"
    $NVCC $NVF -lineinfo -Xptxas -v -c src/cuda/$k.cu -o "$B/$k.o" 2>&1 | grep -v deprecat > "$OUTDIR/${k}_ptxas.log" &
done
wait
cat "$OUTDIR/gemm_ptxas.log" "$OUTDIR/gemm_wgrad_ptxas.log"
for k in gemm gemm_wgrad; do
    if grep -E "C7508|C7510|C7511|C7515|C7520" "$OUTDIR/${k}_ptxas.log"; then echo "BUILD FAIL: forbidden ptxas warning ($k.cu)"; exit 1; fi
    test -s "$B/$k.o" || { echo "BUILD FAIL: src/cuda/$k.cu"; exit 1; }
    grep -E "[1-9][0-9]* bytes spill" "$OUTDIR/${k}_ptxas.log" && echo "NOTE: spills above ($k.cu)" || true
    if command -v cuobjdump >/dev/null; then echo "HGMMA in SASS of $k.o: $(cuobjdump -sass "$B/$k.o" | grep -c HGMMA)"; fi
done
$NVCC $NVF tests/test_gemm_gpu.cu "$B/gemm.o" "$B"/obj/*.o -lcudart -o "$B/test_gemm_gpu" &
$NVCC $NVF tests/test_wgrad_gpu.cu "$B/gemm_wgrad.o" "$B"/obj/*.o -lcudart -o "$B/test_wgrad_gpu" &
$NVCC $NVF bench/gemm_bench.cu "$B/gemm.o" "$B/gemm_wgrad.o" "$B"/obj/*.o -lcublas -lcudart -ldl -o "$B/gemm_bench" &
wait
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv || true
rc=0
if [ "${SKIP_TEST:-0}" != 1 ]; then
    "$B/test_gemm_gpu" || { rc=$?; echo "test_gemm_gpu FAILED (exit $rc)"; }
    "$B/test_wgrad_gpu" || { rc=$?; echo "test_wgrad_gpu FAILED (exit $rc)"; }
fi
"$B/gemm_bench" "$@" || rc=$?
if [ "${MEMCHECK:-0}" = 1 ]; then
    COMET_GEMM_TEST_SMALL=1 compute-sanitizer --tool memcheck --print-limit 20 "$B/test_gemm_gpu" 2>&1 | tail -n 25
    COMET_WGRAD_TEST_SMALL=1 compute-sanitizer --tool memcheck --print-limit 20 "$B/test_wgrad_gpu" 2>&1 | tail -n 25
fi
exit $rc
