#!/bin/bash
# build.sh - builds the NCCL runtime layer's test (tests/test_comm_gpu.cu with
# src/comm/, src/core/status.c, tests/check.c) into one binary, outside the
# Makefile, against a chosen NCCL. Run from the repository root:
#   dev/comm/build.sh OUTDIR [NCCL_INCLUDE_DIR] [NCCL_LIB_DIR]
# Defaults: the CUDA toolkit's include/ and lib/ (2.28.9 on the build machine).
# The NCCL include dir goes first on every include path, so a different
# nccl.h elsewhere (e.g. the system's 2.28.3) is never picked up.
set -euo pipefail
OUTDIR=${1:?usage: dev/comm/build.sh OUTDIR [NCCL_INC] [NCCL_LIB]}
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
NCCL_INC=${2:-$CUDA_HOME/include}
NCCL_LIB=${3:-$CUDA_HOME/lib}
CC=${CC:-cc}
mkdir -p "$OUTDIR"
echo "build.sh: nvcc $(nvcc --version | tail -1); nccl.h from $NCCL_INC: $(grep -m1 'define NCCL_VERSION_CODE' "$NCCL_INC/nccl.h"); libnccl from $NCCL_LIB"
CFLAGS="-O2 -g -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -pthread -Iinclude"
NVFLAGS="-O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Iinclude -Xptxas -warn-spills"
$CC $CFLAGS -c src/core/status.c -o "$OUTDIR/status.o"
$CC $CFLAGS -c tests/check.c -o "$OUTDIR/check.o"
$CC $CFLAGS -I"$NCCL_INC" -I"$CUDA_HOME/include" -c src/comm/comm.c -o "$OUTDIR/comm.o"
nvcc $NVFLAGS -I"$NCCL_INC" -c src/comm/nccl_shim.cu -o "$OUTDIR/nccl_shim.o"
nvcc $NVFLAGS -I"$NCCL_INC" -Itests -c "${TEST_SRC:-tests/test_comm_gpu.cu}" -o "$OUTDIR/test_comm_gpu.o"
nvcc -gencode arch=compute_90a,code=sm_90a "$OUTDIR"/{test_comm_gpu,comm,nccl_shim,status,check}.o \
    -L"$NCCL_LIB" -l:libnccl.so.2 -lpthread -o "$OUTDIR/test_comm_gpu"
echo "build.sh: built $OUTDIR/test_comm_gpu"
