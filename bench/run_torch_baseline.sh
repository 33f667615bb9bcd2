#!/usr/bin/env bash
# run_torch_baseline.sh - the PyTorch baseline sweep of the issue tables on the
# local GPUs: every model preset at M in {4096, 8192, 16384}, on 2 GPUs as
# (TP,EP) = (1,2) and (2,1), and on one GPU. JSON and a markdown table go to
# ${OUT:-bench/results/baselines}. Uses the python3 that has torch. TRAIN=1:
# the training step instead (forward + backward with autograd, torch_moe.py
# --train; ../shared/docs/training.md section 6), files named -torch-train-,
# in ${OUT:-bench/results/training}. bench/results/README.md says how a kept
# file is named and indexed.
set -euo pipefail
cd "$(dirname "$0")/.."

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export COMET_COMMIT=${COMET_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
day=$(date -u +%Y-%m-%d)
train=() what=torch
out=${OUT:-bench/results/baselines}
if [ "${TRAIN:-0}" = 1 ]; then train=(--train); what=torch-train; out=${OUT:-bench/results/training}; fi
mkdir -p "$out"
models=${MODELS:-mixtral-8x7b,qwen2-moe,phi-3.5-moe,deepseek-v3}
tokens=${TOKENS:-4096,8192,16384}
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
files=()
if [ "$gpus" -ge 2 ]; then
    for layout in "1 2" "2 1"; do
        set -- $layout
        f="$out/$day-$what-tp$1ep$2.json"
        torchrun --standalone --nproc-per-node 2 bench/torch_moe.py --models "$models" --tokens "$tokens" \
            --tp "$1" --ep "$2" "${train[@]}" --json "$f"
        files+=("$f")
    done
fi
f="$out/$day-$what-1gpu.json"
python3 bench/torch_moe.py --models "$models" --tokens "$tokens" "${train[@]}" --json "$f"
files+=("$f")
python3 bench/report.py "${files[@]}" | tee "$out/$day-$what-baseline.md"
