#!/usr/bin/env bash
# session 17 call 6 (2x H200): bench/torch_moe.py with the bf16 glu on all 24 cells at 20 forwards,
# then comet on the Mixtral, Qwen2 and Phi cells in the same call
set -u
export COMET_COMMIT=b7a9774 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PIP=$(python3 -c "import nvidia.nccl as m; print(m.__path__[0])")
export LD_LIBRARY_PATH="$PIP/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
start=$SECONDS
for lay in "1 2" "2 1"; do set -- $lay
  timeout 150 torchrun --standalone --nproc-per-node 2 bench/torch_moe.py --models mixtral-8x7b,qwen2-moe,phi-3.5-moe,deepseek-v3 \
    --tokens 4096,8192,16384 --tp $1 --ep $2 --iters 20 --json $OUT/torch-20-tp${1}ep${2}.json >> $OUT/torch.log 2>&1
  echo "torch TP$1 EP$2 rc $? at $((SECONDS-start)) s"
done
grep -E "M= *[0-9]+ TP=" $OUT/torch.log
for lay in "--ep 2" "--tp 2"; do for m in mixtral-8x7b qwen2-moe phi-3.5-moe; do for t in 4096 8192 16384; do
  [ $((SECONDS-start)) -gt 230 ] && break 3
  timeout 60 build/comet bench --model $m --tokens $t $lay --iters 20 --warmup 5 --json $OUT/comet.jsonl > /dev/null 2>> $OUT/comet.err
done; done; done
echo "comet rows: $(wc -l < $OUT/comet.jsonl) at $((SECONDS-start)) s"
