#!/bin/bash
# run.sh - on the GPU machine (device `run`, from the repository root): picks
# the nccl.h whose version equals the NCCL library it will load (PyTorch's
# bundled nvidia.nccl, 2.28.9; the system's 2.28.3 would break the device
# API), builds the comm test with dev/comm/build.sh, runs it with that
# library first on LD_LIBRARY_PATH, then once more without it to show the
# version guard refusing the system NCCL. Logs go to $OUT.
# Falls back to a carried prebuilt binary (build/comm-dev/test_comm_gpu,
# made on the build machine against 2.28.9) when no matching header is found.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/comet-comm}
mkdir -p "$OUT"
ver_of() { sed -n 's/^#define NCCL_VERSION_CODE \([0-9]*\).*/\1/p' "$1" 2>/dev/null | head -1; }
{
    date -u
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
    nvidia-smi topo -m
    nvcc --version | tail -1
    PIP=$(python3 -c "import nvidia.nccl as m; print(m.__path__[0])")
    PIPVER=$(python3 -c "import importlib.metadata as m; print(m.version('nvidia-nccl-cu13'))" 2>/dev/null)
    echo "pip nvidia.nccl: $PIP (version $PIPVER)"; ls "$PIP" "$PIP/lib" "$PIP/include" 2>&1
    ldconfig -p | grep -i nccl
    for h in "$PIP/include/nccl.h" /usr/local/cuda/include/nccl.h /usr/include/nccl.h; do
        [ -f "$h" ] && echo "$h: NCCL_VERSION_CODE $(ver_of "$h"), nccl_device.h: $(ls "$(dirname "$h")/nccl_device.h" 2>/dev/null || echo missing)"
    done
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"
PIP=$(python3 -c "import nvidia.nccl as m; print(m.__path__[0])")
PIPVER=$(python3 -c "import importlib.metadata as m; print(m.version('nvidia-nccl-cu13'))" 2>/dev/null)
WANT=$(echo "$PIPVER" | awk -F. '{printf "%d", $1*10000 + $2*100 + $3}')
INC=""
for d in "$PIP/include" /usr/local/cuda/include /usr/include; do
    if [ "$(ver_of "$d/nccl.h")" = "$WANT" ] && [ -f "$d/nccl_device.h" ]; then INC=$d; break; fi
done
BIN=""
if [ -n "$INC" ]; then
    echo "run.sh: compiling against $INC/nccl.h ($WANT) for $PIP/lib/libnccl.so.2 ($PIPVER)"
    TEST_SRC=${TEST_SRC:-tests/test_comm_gpu.cu} dev/comm/build.sh /tmp/comm-build "$INC" "$PIP/lib" >"$OUT/build.log" 2>&1 \
        && BIN=/tmp/comm-build/test_comm_gpu
    cat "$OUT/build.log"
fi
if [ -z "$BIN" ] && [ -x build/comm-dev/test_comm_gpu ]; then
    echo "run.sh: no matching header here (or the build failed): using the carried build/comm-dev/test_comm_gpu"
    BIN=build/comm-dev/test_comm_gpu
fi
[ -n "$BIN" ] || { echo "run.sh: nothing to run"; exit 1; }
echo "== $BIN with LD_LIBRARY_PATH=$PIP/lib"
LD_LIBRARY_PATH="$PIP/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_DEBUG=INFO NCCL_DEBUG_FILE="$OUT/nccl_debug.%p.log" \
    timeout 240 "$BIN" >"$OUT/test_comm_gpu.log" 2>&1
RC=$?
cat "$OUT/test_comm_gpu.log"; echo "rc=$RC"
echo "== guard demo: $BIN with the default loader path (system NCCL expected)"
timeout 60 "$BIN" >"$OUT/guard_demo.log" 2>&1
echo "rc=$? (a refusal is expected when the system NCCL differs)"; cat "$OUT/guard_demo.log"
exit $RC
