#!/bin/bash
# build.sh: builds dev/combine/combine for sm_90a; fails on nvcc errors or register spills. Writes ptxas.log.
set -eo pipefail
cd "$(dirname "$0")"
${NVCC:-nvcc} -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -Xptxas -v -I../../include -o combine combine.cu 2>&1 | tee ptxas.log
if grep -E "[1-9][0-9]* bytes spill" ptxas.log; then echo "BUILD FAIL: spills"; exit 1; fi
echo "build ok"
