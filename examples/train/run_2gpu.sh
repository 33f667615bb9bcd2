#!/usr/bin/env bash
# run_2gpu.sh [CONFIG] [OUT] [train.py options...] - the comparison on 2 GPUs:
# CONFIG (default mixtral-2gpu; or qwen2moe-2gpu) with comet's experts, then
# with the PyTorch layer, same seed and data, then plot.py on the two logs.
# Writes OUT/{comet,torch}.jsonl, their console output, OUT/loss.png and
# OUT/speed.png (default OUT: train-CONFIG). Needs a CUDA build of comet
# (pip install . where nvcc and torch's NCCL are found) and matplotlib.
# PROFILE=1: each run also writes OUT/{comet,torch}-profile.txt (train.py --profile).
#   examples/train/run_2gpu.sh mixtral-2gpu out/mixtral --steps 200
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
config=${1:-mixtral-2gpu}
out=${2:-train-$config}
shift $(( $# > 2 ? 2 : $# ))
mkdir -p "$out"
for experts in comet torch; do
    torchrun --standalone --nproc-per-node 2 "$here/train.py" --config "$config" --experts "$experts" \
        --json-log "$out/$experts.jsonl" ${PROFILE:+--profile "$out/$experts-profile.txt"} "$@" 2>&1 | tee "$out/$experts.txt"
done
python3 "$here/plot.py" "$out/comet.jsonl" "$out/torch.jsonl" -o "$out" | tee "$out/summary.txt"
