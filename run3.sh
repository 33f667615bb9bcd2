#!/usr/bin/env bash
# 2 GPUs: test_backward_gpu (W = 1, 2) on a45c223's kernels, then training steps at 8192 beside the PyTorch layer
set -u
export NCCL_NVLS_ENABLE=0 COMET_TIMEOUT_MS=15000
PIP=$(python3 -c "import nvidia.nccl as m; print(m.__path__[0])")
export LD_LIBRARY_PATH=$PIP/lib:${LD_LIBRARY_PATH:-}
st=$SECONDS; timeout 200 stdbuf -oL build/tests/test_backward_gpu > $OUT/test-bwd.log 2>&1; rc=$?
T="test_backward_gpu rc $rc $((SECONDS-st)) s: $(grep -E "test_backward_gpu: [0-9]+ passed" $OUT/test-bwd.log | tail -1)"
grep -m5 FAIL $OUT/test-bwd.log
STEPS=train MODELS="qwen2-moe mixtral-8x7b phi-3.5-moe" TOKENS=8192 timeout 360 dev/gpu_check.sh > $OUT/train-summary.txt 2>&1
echo "$T"
tail -n 30 $OUT/train-summary.txt
