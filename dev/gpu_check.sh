#!/usr/bin/env bash
# gpu_check.sh - the one script a GPU call runs for the CUDA backend (from the
# repository root, on the device machine): the test suite (GPU tests
# included) on a build carried from the build machine (build/, linked against
# NCCL 2.28.9, loaded from PyTorch's nvidia.nccl via LD_LIBRARY_PATH), then
# `comet bench` on every model at the given token counts, then optionally the
# PyTorch baseline sweep. Logs and JSON go to $OUT; a short table is printed last.
#   (pygpu: PYTEST_K, pytest -k of the CPU suite, e.g. "not compile": the CPU torch.compile tests take minutes on a fresh machine)
#   STEPS="probe test|gputests sanitize gemm gemmab link bench train pygpu pyvsc example push ab tune trace ncu launch torch regimes" MODELS=... TOKENS=... LAYOUTS="--ep 2;--tp 2" [ITERS=20 WARMUP=5 BENCH_ROUNDS=1] dev/gpu_check.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export COMET_TIMEOUT_MS=${COMET_TIMEOUT_MS:-15000}
# the commit a build directory was made from (make writes DIR/commit), "unknown" without the file
commit_of() { cat "$1/commit" 2>/dev/null || echo unknown; }
# tp and ep of a layout's flags ("--ep 2 --n-comm 8": tp=1 ep=2; a flag left out is 1)
tp_ep_of() {
    tp=1 ep=1
    set -- $1
    while [ $# -ge 2 ]; do case $1 in --tp) tp=$2 ;; --ep) ep=$2 ;; esac; shift; done
}
# the commit in every JSON row (comet bench and the PyTorch baselines): the build's
export COMET_COMMIT=${COMET_COMMIT:-$(commit_of build)}
echo "gpu_check.sh: build/ of commit $COMET_COMMIT (make writes build/commit: run make before carrying build/)"
OUT=${OUT:-/tmp/comet-gpu}; mkdir -p "$OUT"
PIP=$(python3 -c "import nvidia.nccl as m; print(m.__path__[0])" 2>/dev/null)
export LD_LIBRARY_PATH="$PIP/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
STEPS=${STEPS:-test bench}
MODELS=${MODELS:-mixtral-8x7b qwen2-moe phi-3.5-moe deepseek-v3}
TOKENS=${TOKENS:-8192}
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,temperature.gpu --format=csv
summary=()
# the Python package (CUDA build against torch's NCCL), installed once a run for the steps that need it
pip_done=${PIP_DONE:-} # PIP_DONE=1: installed by an earlier call on this (warm) machine
pip_install() {
    [ -n "$pip_done" ] && return
    python3 -m pip install -q --no-build-isolation . > "$OUT/pip.log" 2>&1
    summary+=("pip install: exit $?")
    pip_done=1
}
for step in $STEPS; do
    case $step in
    test)
        COMET_TEST_GPU=1 tests/run.sh build > "$OUT/test.log" 2>&1
        grep -E "FAIL|skipped|test_layer_gpu: " "$OUT/test.log" | head -60
        summary+=("tests: $(tail -n 1 "$OUT/test.log")")
        ;;
    probe) # one GPU: dev/gather/run.sh (one-row TMA layout, row-load rates)
        OUT="$OUT" timeout 200 dev/gather/run.sh > "$OUT/probe.log" 2>&1
        summary+=("gather probe: exit $?")
        cat "$OUT/probe.log"
        ;;
    gputests) # only the GPU test binaries (the CPU suite runs in CI), one log
        # (stdout line-buffered, so that a test the timeout kills still shows how far it got;
        # the log starts empty, so a crashed test cannot show an earlier run's count)
        : > "$OUT/gputests.log"
        for t in build/tests/test_*_gpu; do
            start=$SECONDS name=$(basename "$t")
            timeout "${COMET_TEST_TIMEOUT:-480}" stdbuf -oL "$t" >> "$OUT/gputests.log" 2>&1
            rc=$?
            summary+=("$name: exit $rc after $((SECONDS - start)) s: $(grep -E "^$name: [0-9]+ passed" "$OUT/gputests.log" | tail -n 1)")
        done
        grep -E "FAIL" "$OUT/gputests.log" | head -40
        ;;
    sanitize) # compute-sanitizer on the small configurations (works on Firecracker
              # machines only: on gVisor it refuses the device, which the log shows); on
              # SANITIZE_GPUS (default "0": one GPU; at e2ddd89 two GPUs did not finish in 125 s a tool);
              # at 5215af5 on one H200 memcheck took seconds, racecheck 285 s (SANITIZE_TIMEOUT > 300)
        for tool in memcheck racecheck; do
            CUDA_VISIBLE_DEVICES=${SANITIZE_GPUS:-0} COMET_TIMEOUT_MS=120000 COMET_LAYER_TEST_SMALL=1 COMET_GEMM_TEST_SMALL=1 \
                timeout ${SANITIZE_TIMEOUT:-400} compute-sanitizer --tool $tool \
                --error-exitcode 99 stdbuf -oL build/tests/test_layer_gpu > "$OUT/sanitize-$tool.log" 2>&1
            summary+=("compute-sanitizer $tool test_layer_gpu (small): exit $? $(grep -E 'ERROR SUMMARY|test_layer_gpu: [0-9]' "$OUT/sanitize-$tool.log" | tail -n 2 | tr '\n' ' ')")
            CUDA_VISIBLE_DEVICES=${SANITIZE_GPUS:-0} COMET_TIMEOUT_MS=120000 COMET_BWD_TEST_SMALL=1 \
                timeout ${SANITIZE_TIMEOUT:-400} compute-sanitizer --tool $tool \
                --error-exitcode 99 stdbuf -oL build/tests/test_backward_gpu > "$OUT/sanitize-bwd-$tool.log" 2>&1
            summary+=("compute-sanitizer $tool test_backward_gpu (small): exit $? $(grep -E 'ERROR SUMMARY|test_backward_gpu: [0-9]' "$OUT/sanitize-bwd-$tool.log" | tail -n 2 | tr '\n' ' ')")
        done
        ;;
    gemm) # one GPU: our grouped GEMM vs cuBLAS and its n_compute curve, then torch._grouped_mm
        GEMM_BENCH_CURVE=1 SKIP_TEST=1 OUT="$OUT" timeout 300 bench/run_gemm_bench.sh "${TOKENS%% *}" > "$OUT/gemm.log" 2>&1
        summary+=("gemm_bench: exit $? (gemm.log, gemm_bench.json)")
        timeout 200 python3 bench/torch_grouped_mm.py --tokens "$(tr ' ' , <<<"$TOKENS")" --json "$OUT/grouped_mm.json" \
            >> "$OUT/gemm.log" 2>&1
        summary+=("torch._grouped_mm: exit $? (gemm.log, grouped_mm.json)")
        ;;
    gemmab) # one GPU: gemm_bench under environment variants, interleaved over ROUNDS (GEMM_AB="A;B",
            # default clusters off/on; e.g. "COMET_GEMM_NARROW=0;COMET_GEMM_NARROW=1"; GEMM_BENCH_TP=2 in a
            # variant: the TP2 shapes), on GEMM_MODELS (default: all presets and the dense shapes)
        IFS=';' read -ra variants <<<"${GEMM_AB:-COMET_GEMM_CLUSTER=0;COMET_GEMM_CLUSTER=1}"
        for round in $(seq "${ROUNDS:-2}"); do for v in "${variants[@]}"; do
            echo "== [$v] round $round" >> "$OUT/gemmab.log"
            env $v OUT="$OUT" timeout 200 build/bench/gemm_bench "${TOKENS%% *}" ${GEMM_MODELS:-} >> "$OUT/gemmab.log" 2>&1
            summary+=("gemm_bench [$v] round $round: $(grep -E '^(mixtral|phi|qwen|deepseek)' "$OUT/gemmab.log" | tail -n 8 | awk '{printf "%s/%s %s  ", substr($1,1,4), $4, $6}')")
        done; done
        ;;
    link) # two GPUs: NVLink transport rates (pull, push, TMA bulk, copy engine), idle and beside a GEMM
        OUT="$OUT" timeout 200 build/bench/link_bench > "$OUT/link.log" 2>&1
        summary+=("link_bench: exit $? (link.log, link_bench.json)")
        cat "$OUT/link.log"
        ;;
    push) # push (the default) beside the pull combine (COMET_PUSH=0), sequential and overlapped
        for m in $MODELS; do for t in $TOKENS; do for layout in "--ep 2 --n-comm -1" "--ep 2 --n-comm 8 --comm-hidden"; do
            for push in 1 0; do
                line=$(COMET_PUSH=$push timeout 300 build/comet bench --model "$m" --tokens "$t" $layout --iters ${ITERS:-20} --warmup ${WARMUP:-5} \
                    2>&1 | tee -a "$OUT/bench.log" | grep -A1 '^model' | tail -n 1)
                summary+=("COMET_PUSH=$push $layout: ${line:-FAILED (see bench.log)}")
            done
        done; done; done
        ;;
    bench) # a layout without --n-comm runs the tuner's pick ("auto:" rows); --n-comm -1 the sequential chain;
           # BENCH_ROUNDS=N runs the whole list N times over, so a cell's rows lie a round apart and drift
           # reaches every cell alike (one configuration spreads by up to 11% between calls a minute
           # apart; report.py prints the median of a cell's rows)
        IFS=';' read -ra layouts <<<"${LAYOUTS:---ep 2;--ep 2 --n-comm 8 --comm-hidden;--tp 2;--tp 2 --n-comm 8 --comm-hidden;--ep 1}"
        for round in $(seq "${BENCH_ROUNDS:-1}"); do for m in $MODELS; do for t in $TOKENS; do for layout in "${layouts[@]}"; do
            line=$(timeout 300 build/comet bench --model "$m" --tokens "$t" $layout --iters ${ITERS:-20} --warmup ${WARMUP:-5} --json "$OUT/comet.jsonl" 2>&1 | tee -a "$OUT/bench.log" | grep -A1 '^model' | tail -n 1)
            summary+=("bench $layout: ${line:-FAILED (see bench.log)}")
        done; done; done; done
        ;;
    train) # training steps: `comet bench --train` (training forward + backward) and the PyTorch
           # layer's autograd step (bench/torch_moe.py --train, torchrun on every GPU) in the same call
           # (TRAIN_ARGS: more flags for comet, e.g. "--comm-hidden" or "--recompute"),
           # each model x token count x layout (LAYOUTS as bench's, default EP and TP over every GPU: EP2
           # and TP2 on two, EP4 and TP4 on four; the PyTorch layer runs each layout's TP x EP); report.py pairs them
           # (600 s a run; the gradient check's CPU reference runs on every core: Mixtral EP2 on 8 tokens a
           # rank ~15 s on one core; DeepSeek-V3-style is checked only with --grad-check: minutes)
        n=$(nvidia-smi -L | wc -l)
        IFS=';' read -ra layouts <<<"${LAYOUTS:---ep $n;--tp $n}"
        for m in $MODELS; do for t in $TOKENS; do for layout in "${layouts[@]}"; do
            line=$(timeout 600 build/comet bench --train ${TRAIN_ARGS:-} --model "$m" --tokens "$t" $layout --iters ${ITERS:-20} --warmup ${WARMUP:-5} \
                --json "$OUT/comet-train.jsonl" 2>&1 | tee -a "$OUT/train.log" | grep -A1 '^model' | tail -n 1)
            summary+=("train $m $t $layout: ${line:-FAILED (see train.log)}")
        done; done; done
        for layout in "${layouts[@]}"; do # the PyTorch layer in each layout's TP x EP (the flags after them are comet's)
            tp_ep_of "$layout"
            timeout 600 torchrun --standalone --nproc-per-node "$n" bench/torch_moe.py --train --models "$(tr ' ' , <<<"$MODELS")" \
                --tokens "$(tr ' ' , <<<"$TOKENS")" --tp "$tp" --ep "$ep" --iters ${ITERS:-20} --warmup ${WARMUP:-5} \
                --json "$OUT/torch-train-tp${tp}ep$ep.json" >> "$OUT/train.log" 2>&1
            summary+=("torch --train tp$tp ep$ep: exit $?")
        done
        python3 bench/report.py "$OUT"/torch-train-tp*.json "$OUT/comet-train.jsonl" > "$OUT/train-report.md" 2>&1
        cat "$OUT/train-report.md"
        ;;
    pygpu) # the Python package on the GPUs: pip install (CUDA build against torch's NCCL), pytest
           # (the CUDA autograd tests), the 2-GPU torchrun script (world_from_group, sub-groups, patch_model),
           # the training step through Python and the op's overhead a call (bench/torch_comet.py;
           # PY_PROFILE=1: its torch.profiler tables and traces, py-profile--ep2.txt and .json)
        pip_install
        (cd /tmp && timeout 300 python3 -m pytest -q ${PYTEST_K:+-k "$PYTEST_K"} "$OLDPWD/python/tests" --ignore="$OLDPWD/python/tests/gpu") > "$OUT/pytest.log" 2>&1
        summary+=("pytest: exit $? $(grep -E 'passed|failed' "$OUT/pytest.log" | tail -n 1)")
        timeout 300 torchrun --standalone --nproc-per-node 2 python/tests/gpu/ep_torchrun.py > "$OUT/torchrun.log" 2>&1
        summary+=("ep_torchrun: exit $? $(grep -E '^ep_torchrun:' "$OUT/torchrun.log" | tail -n 1)")
        for layout in "--ep 2" "--tp 2"; do # the training step through Python (bench/torch_comet.py), beside `train`'s C rows
            timeout 600 torchrun --standalone --nproc-per-node 2 bench/torch_comet.py --models "$(tr ' ' , <<<"$MODELS")" \
                --tokens "$(tr ' ' , <<<"$TOKENS")" $layout --json "$OUT/py-train${layout// /}.json" \
                ${PY_PROFILE:+--profile "$OUT/py-profile${layout// /}.txt"} >> "$OUT/py-train.log" 2>&1
            summary+=("torch_comet $layout: exit $?")
        done
        cat "$OUT/py-train.log"
        ;;
    pyvsc) # the training step through Python (bench/torch_comet.py) against the C calls (comet bench --train, from
           # an idle GPU and --back-to-back) on MODELS x TOKENS x LAYOUTS ("--ep N;--tp N", every GPU), ROUNDS rounds
           # (C then Python in odd rounds, Python then C in even ones: the clocks' drift under the power limit
           # reaches both sides alike); report.py's table of the medians. The C rows check their gradients
           # first (Mixtral ~20 s a cell); PYVSC_C="idle b2b" (default) the C runs a cell, "b2b" the
           # back-to-back one only (half the C runs)
        pip_install
        n=$(nvidia-smi -L | wc -l)
        IFS=';' read -ra layouts <<<"${LAYOUTS:---ep $n;--tp $n}"
        pyvsc_c() { # $1: the layout
            for m in $MODELS; do for t in $TOKENS; do for c in ${PYVSC_C:-idle b2b}; do
                b2b=; [ "$c" = b2b ] && b2b=--back-to-back
                timeout 300 build/comet bench --train $b2b --model "$m" --tokens "$t" $1 --json "$OUT/pyvsc-comet.jsonl" \
                    >> "$OUT/pyvsc.log" 2>&1 || summary+=("pyvsc comet $m $t $1 $b2b: exit $?")
            done; done; done
        }
        pyvsc_py() { # $1: the layout, $2: the round
            timeout 600 torchrun --standalone --nproc-per-node "$n" bench/torch_comet.py --models "$(tr ' ' , <<<"$MODELS")" \
                --tokens "$(tr ' ' , <<<"$TOKENS")" $1 --overhead-calls 0 --json "$OUT/pyvsc-python-r$2${1// /}.json" \
                >> "$OUT/pyvsc.log" 2>&1
            summary+=("pyvsc torch_comet round $2 $1: exit $?")
        }
        # one untimed C run first: the first timed cell of a fresh machine ran ~10% slow (Phi-3.5-MoE 4096
        # EP2: 4.335 ms, then 3.912 in round 2; bench/results/training/2026-11-28-py-vs-c-same-routing-h200x2.md)
        read -r m0 _ <<<"$MODELS"; read -r t0 _ <<<"$TOKENS"
        timeout 300 build/comet bench --train --back-to-back --model "$m0" --tokens "$t0" ${layouts[0]} > /dev/null 2>&1
        for round in $(seq "${ROUNDS:-1}"); do for layout in "${layouts[@]}"; do
            if ((round % 2)); then pyvsc_c "$layout"; pyvsc_py "$layout" "$round"
            else pyvsc_py "$layout" "$round"; pyvsc_c "$layout"; fi
        done; done
        python3 bench/report.py "$OUT"/pyvsc-python-*.json "$OUT/pyvsc-comet.jsonl" 2>/dev/null | sed -n '/through Python/,$p'
        ;;
    example) # examples/train on 2 GPUs (run_2gpu.sh: comet's experts, then the PyTorch layer, then the plots)
             # for each of EXAMPLE_CONFIGS (default "mixtral-2gpu qwen2moe-2gpu"), EXAMPLE_ARGS passed on
             # (e.g. "--steps 300"); run_2gpu.sh's CONTROL=1 / RUNS="torch torch-splitk" pass through (the
             # control run for the tolerance); pip installs the package first. The GPU machine has no network: make the
             # corpus here and carry it (run's carry: ".traincache"):
             #   python3 -c "import sys; sys.path.insert(0, 'examples/train'); import data; data.load_corpus('.traincache')" (a python with torch)
        pip_install
        for cfg in ${EXAMPLE_CONFIGS:-mixtral-2gpu qwen2moe-2gpu}; do
            COMET_TRAIN_CACHE=$PWD/.traincache timeout ${EXAMPLE_TIMEOUT:-560} examples/train/run_2gpu.sh "$cfg" \
                "$OUT/example-$cfg" ${EXAMPLE_ARGS:-} > "$OUT/example-$cfg.log" 2>&1
            summary+=("example $cfg: exit $? ($(grep -E 'speedup' "$OUT/example-$cfg.log" | tail -n 1))")
        done
        ;;
    ab) # environment variants alternated (AB="A;B", each "NAME=V ..."; ROUNDS rounds), so clock
        # drift under sustained load hits every variant alike; one summary line per run. COMET_BIN=DIR
        # in a variant runs DIR/comet instead of build/comet (two builds compared: carry both)
        IFS=';' read -ra variants <<<"${AB:-COMET_GEMM_CLUSTER=0;COMET_GEMM_CLUSTER=1}"
        IFS=';' read -ra layouts <<<"${LAYOUTS:---ep 2;--tp 2}"
        for m in $MODELS; do for t in $TOKENS; do for layout in "${layouts[@]}"; do
            for round in $(seq "${ROUNDS:-2}"); do for v in "${variants[@]}"; do
                bin=build
                for kv in $v; do case $kv in COMET_BIN=*) bin=${kv#COMET_BIN=} ;; esac; done
                line=$(env $v COMET_COMMIT="$(commit_of "$bin")" timeout 300 "$bin/comet" bench --model "$m" --tokens "$t" $layout --iters ${ITERS:-20} --warmup ${WARMUP:-5} \
                    --json "$OUT/comet.jsonl" 2>&1 | tee -a "$OUT/bench.log" | grep -A1 '^model' | tail -n 1)
                summary+=("ab round $round [$v] $layout: ${line:-FAILED (see bench.log)}")
            done; done
        done; done; done
        ;;
    tune) # `comet tune` (the sequential chain, then n_comm 4..32) for each model, token count and
          # TUNE_LAYOUTS ("--ep 2;--tp 2"), TUNE_ITERS (10) timed runs a point; the winners go
          # to $OUT/tune.tsv (a table for COMET_TUNE_FILE), the curves to tune.log
        IFS=';' read -ra layouts <<<"${TUNE_LAYOUTS:---ep 2;--tp 2}"
        for m in $MODELS; do for t in $TOKENS; do for layout in "${layouts[@]}"; do
            line=$(timeout 300 build/comet tune --model "$m" --tokens "$t" $layout --iters ${TUNE_ITERS:-10} --warmup 2 \
                --out "$OUT/tune.tsv" 2>&1 | tee -a "$OUT/tune.log" | grep '^best:')
            summary+=("tune $m $t $layout: ${line:-FAILED (see tune.log)}")
        done; done; done
        ;;
    trace) # the overlap as a picture, and its numbers (dev/trace_stats.py): TRACE_MODEL (mixtral-8x7b),
           # TRACE_TOKENS (8192), TRACE_LAYOUT ("--ep 2"), TRACE_MODES ("--n-comm -1;--n-comm 8": sequential,
           # overlapped; "" the tuner's pick, named -auto; "--train" a training step, forward and backward, -train),
           # each mode under every TRACE_AB environment variant (default: none), same seed throughout
        IFS=';' read -ra modes <<<"${TRACE_MODES---n-comm -1;--n-comm 8}"
        IFS=';' read -ra tvars <<<"${TRACE_AB:-}"
        [ ${#tvars[@]} -gt 0 ] || tvars=("")
        for mode in "${modes[@]}"; do
            files=()
            for i in "${!tvars[@]}"; do
                case $mode in *--train*) tag=-train ;; *"n-comm -1"*) tag= ;; "") tag=-auto ;; *) tag=-overlap ;; esac
                name=trace-gpu$tag$( [ ${#tvars[@]} -gt 1 ] && echo "-v$i")
                env ${tvars[$i]} timeout 300 build/comet bench --model "${TRACE_MODEL:-mixtral-8x7b}" --tokens "${TRACE_TOKENS:-8192}" \
                    ${TRACE_LAYOUT:---ep 2} --iters 3 --warmup 1 $mode --trace "$OUT/$name.json" >> "$OUT/bench.log" 2>&1
                summary+=("trace '$mode' [${tvars[$i]}]: exit $? ($OUT/$name.json, .svg)")
                files+=("$OUT/$name.json")
            done
            python3 dev/trace_stats.py "${files[@]}" | tee -a "$OUT/trace_stats.txt"
        done
        # one file for all the pictures and JSON (the device tool returns at most 8 files)
        (cd "$OUT" && tar czf traces.tar.gz trace-gpu*.json trace-gpu*.svg && rm -f trace-gpu*.json trace-gpu*.svg)
        ;;
    ncu) # one GPU: Nsight Compute's duration (and shared-memory bank conflicts) of the layer's small
         # kernels in one `comet bench --ep 1` (NCU_KERNELS regex: 7 kernels a forward by default, the
         # third forward measured; NCU_MODEL, NCU_TOKENS; a Firecracker
         # machine: on gVisor ncu cannot read counters), the clocks left alone. NCU_ARGS: more flags for
         # comet bench; a training step's every kernel (the second step's 28 on the Hopper path):
         #   NCU_ARGS=--train NCU_KERNELS=. NCU_SKIP=28 NCU_COUNT=28 NCU_MODEL=deepseek-v3 NCU_TOKENS=4096
         # NCU_SOURCE=1: also warp-stall sampling by SASS line (SourceCounters) into ncu-sass.csv.gz
         # (read it with dev/ncu_sass.py); give it one kernel (NCU_KERNELS, NCU_COUNT=1)
        src=()
        [ -n "${NCU_SOURCE:-}" ] && src=(--section SourceCounters --section WarpStateStats --import-source no -o /tmp/comet-ncu -f)
        timeout 200 ncu --clock-control none --kernel-name "regex:${NCU_KERNELS:-comet_plan_|k_stage|k_gather_routing|k_plan|k_final|k_dispatch}" \
            --launch-skip "${NCU_SKIP:-14}" --launch-count "${NCU_COUNT:-7}" \
            --metrics gpu__time_duration.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum "${src[@]}" \
            build/comet bench ${NCU_ARGS:-} --model "${NCU_MODEL:-qwen2-moe}" --tokens "${NCU_TOKENS:-16384}" --ep 1 --iters 3 --warmup 1 \
            > "$OUT/ncu.txt" 2>&1
        summary+=("ncu: exit $? (ncu.txt)")
        if [ -n "${NCU_SOURCE:-}" ]; then
            ncu -i /tmp/comet-ncu.ncu-rep --page details >> "$OUT/ncu.txt" 2>&1
            ncu -i /tmp/comet-ncu.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > "$OUT/ncu-sass.csv.gz"
            summary+=("ncu source export: ${PIPESTATUS[0]} (ncu-sass.csv.gz)")
        fi
        # each kernel's name (a line "  name(args) (grid)x(block), ...") and its duration with the unit
        awk '/^  [A-Za-z_][A-Za-z0-9_]*\(/ {k=$1; sub(/\(.*/, "", k)} /gpu__time_duration/ {printf "  %-34s %8s %s\n", k, $NF, $(NF-1)}' "$OUT/ncu.txt"
        ;;
    launch) # one process per GPU, as torchrun starts them (comet_world_create_nccl)
        n=$(nvidia-smi -L | wc -l)
        timeout 300 torchrun --standalone --nproc-per-node "$n" --no-python build/comet check --model mixtral-8x7b \
            --tokens 1024 > "$OUT/launch.log" 2>&1
        summary+=("torchrun launch, $n ranks: exit $? ($(grep -A1 '^model' "$OUT/launch.log" | tail -n 1))")
        ;;
    regimes) # comet and the PyTorch layer (bench/torch_moe.py, torchrun on 2 GPUs) at each of
             # REGIME_ITERS ("20 200") timed forwards after 5 warm-ups, on MODELS x TOKENS x LAYOUTS
             # ("--ep 2;--tp 2"): short calls of a short layer run before the 700 W limit bites
             # (~100 ms), long ones under it. Rows: comet.jsonl (each with its clock over the timed
             # forwards) and torch-<iters>-tp<T>ep<E>.json
        IFS=';' read -ra layouts <<<"${LAYOUTS:---ep 2;--tp 2}"
        for iters in ${REGIME_ITERS:-20 200}; do for layout in "${layouts[@]}"; do
            for m in $MODELS; do for t in $TOKENS; do
                line=$(timeout 300 build/comet bench --model "$m" --tokens "$t" $layout --iters "$iters" --warmup 5 \
                    --json "$OUT/comet.jsonl" 2>&1 | tee -a "$OUT/bench.log" | grep -A1 '^model' | tail -n 1)
                summary+=("regimes comet, $iters forwards, $layout: ${line:-FAILED (see bench.log)}")
            done; done
            tp_ep_of "$layout"
            f="$OUT/torch-$iters-tp${tp}ep${ep}.json"
            timeout 420 torchrun --standalone --nproc-per-node $((tp * ep)) bench/torch_moe.py --models "$(echo $MODELS | tr ' ' ,)" \
                --tokens "$(echo $TOKENS | tr ' ' ,)" --tp "$tp" --ep "$ep" --iters "$iters" --json "$f" >> "$OUT/torch.log" 2>&1
            summary+=("regimes PyTorch, $iters forwards, TP$tp EP$ep: exit $? ($f)")
        done; done
        grep -E "M= *[0-9]+ TP=" "$OUT/torch.log"
        ;;
    torch)
        OUT="$OUT" MODELS="${TORCH_MODELS:-mixtral-8x7b,qwen2-moe,phi-3.5-moe}" TOKENS="${TORCH_TOKENS:-4096,8192,16384}" \
            timeout 420 bench/run_torch_baseline.sh > "$OUT/torch.log" 2>&1
        summary+=("torch baseline: exit $? (table in torch.log)")
        tail -n 40 "$OUT/torch.log"
        ;;
    *)
        echo "gpu_check.sh: no step '$step' (see the STEPS line at the top)" >&2
        summary+=("step $step: unknown, skipped")
        ;;
    esac
done
printf '%s\n' "${summary[@]}"
# the regimes step's PyTorch rows (torch-<iters>-*.json) pair with comet's over as many forwards
[ -f "$OUT/comet.jsonl" ] && python3 bench/report.py bench/results/baselines/*-torch-*.json $(ls "$OUT"/torch-*.json 2>/dev/null) \
    bench/reference-issue5.json "$OUT/comet.jsonl"
# everything under $OUT in one archive too: the device machine hands back its first 8 files by name, so a
# step's JSON can be left out and lost; "00-all.tar.gz" sorts first (the traces step's own archive inside it:
# left out by name, traces.tar.gz was lost once)
all=$(mktemp -d)
if (cd "$OUT" && tar czf "$all/00-all.tar.gz" --exclude='./00-all.tar.gz' .); then mv "$all/00-all.tar.gz" "$OUT/"
else echo "gpu_check.sh: packing $OUT into 00-all.tar.gz failed" >&2; fi
rmdir "$all" 2>/dev/null
