#!/usr/bin/env bash
# run_2gpu.sh [CONFIG] [OUT] [train.py options...] - the comparison on 2 GPUs:
# CONFIG (default mixtral-2gpu; or qwen2moe-2gpu) with comet's experts, then
# with the PyTorch layer, same seed and data, then plot.py on the two logs.
# Writes OUT/{comet,torch}.jsonl, their console output, OUT/loss.png and
# OUT/speed.png (default OUT: train-CONFIG). Needs a CUDA build of comet
# (pip install . where nvcc and torch's NCCL are found) and matplotlib.
# PROFILE=1: each run also writes OUT/{comet,torch}-profile.txt (train.py --profile).
# CONTROL=1: a third run, the PyTorch layer with its GEMMs summed in another order (--torch-split-k,
# OUT/torch-splitk.jsonl): how far two runs apart only by rounding drift (the tolerance for comet's).
# RUNS="torch torch-splitk": only those runs (of comet, torch, torch-splitk, comet-rerun: comet's run again,
# OUT/comet-rerun.jsonl, which plot.py compares with comet's bit for bit; e.g. RUNS="comet comet-rerun" with
# --deterministic).
#   examples/train/run_2gpu.sh mixtral-2gpu out/mixtral --steps 200
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
config=${1:-mixtral-2gpu}
out=${2:-train-$config}
shift $(( $# > 2 ? 2 : $# ))
mkdir -p "$out"
runs=${RUNS:-comet torch${CONTROL:+ torch-splitk}}
logs=()
for run in $runs; do
    case $run in
    comet | torch) flags=(--experts "$run") ;;
    comet-rerun) flags=(--experts comet) ;;
    torch-splitk) flags=(--experts torch --torch-split-k) ;;
    *) echo "run_2gpu.sh: RUNS: no run $run (comet, torch, torch-splitk)" >&2; exit 2 ;;
    esac
    torchrun --standalone --nproc-per-node 2 "$here/train.py" --config "$config" "${flags[@]}" \
        --json-log "$out/$run.jsonl" ${PROFILE:+--profile "$out/$run-profile.txt"} "$@" 2>&1 | tee "$out/$run.txt"
    logs+=("$out/$run.jsonl")
done
python3 "$here/plot.py" "${logs[@]}" -o "$out" | tee "$out/summary.txt"
