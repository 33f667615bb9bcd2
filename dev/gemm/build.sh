#!/bin/bash
# build.sh: builds dev/gemm/gemm for sm_90a and fails on ptxas warnings that mean setmaxnreg was ignored
# (C7508) or wgmma was serialised (C7510-C7520), or on register spills. Writes ptxas.log and gemm.sass.
set -eo pipefail
cd "$(dirname "$0")"
NVCC=${NVCC:-nvcc}
$NVCC -gencode arch=compute_90a,code=sm_90a -O3 -Xptxas -v -lineinfo -o gemm gemm.cu -lcublas 2>&1 | tee ptxas.log
if grep -E "C7508|C751[0-9]|C7520" ptxas.log; then echo "BUILD FAIL: forbidden ptxas warning"; exit 1; fi
if grep -E "[1-9][0-9]* bytes spill" ptxas.log; then echo "BUILD FAIL: spills"; exit 1; fi
if command -v cuobjdump >/dev/null; then cuobjdump -sass gemm > gemm.sass; else echo "no cuobjdump here"; touch gemm.sass; fi
echo "HGMMA count in SASS: $(grep -c HGMMA gemm.sass)"
echo "build ok"
