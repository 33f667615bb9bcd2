#!/usr/bin/env bash
# test_cli.sh BUILD_DIR - the command-line tool: help on every subcommand,
# bad flags rejected with exit status 2, `comet check` and `comet bench` run
# on the CPU engine and report a bitwise match (GPU runs are covered by
# test_layer_gpu). Prints "test_cli: N passed, N failed".
set -u
comet=${1:-build}/comet
passed=0 failed=0
expect() { # expect NAME WANT_RC GREP_PATTERN -- command...
    local name=$1 want=$2 pat=$3; shift 4
    local out rc
    out=$("$@" 2>&1); rc=$?
    if [ "$rc" -eq "$want" ] && grep -qE -- "$pat" <<<"$out"; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1)); echo "FAIL test_cli $name: rc=$rc (want $want), output:"; printf '%s\n' "$out" | head -20
    fi
}
expect help 0 'commands:' -- "$comet" --help
expect help-cmd 0 'bench' -- "$comet" help
expect bench-help 0 'usage: comet bench' -- "$comet" bench --help
expect check-help 0 'usage: comet check' -- "$comet" check --help
expect version 0 '^comet [0-9]+\.[0-9]+\.[0-9]+' -- "$comet" --version
expect no-command 2 'usage' -- "$comet"
expect bad-command 2 "unknown command 'frob'" -- "$comet" frob
expect bad-flag 2 "unknown flag" -- "$comet" bench --frob
expect bad-number 2 "--tokens needs a whole number" -- "$comet" check --tokens abc
expect bad-model 2 "unknown model 'gpt'" -- "$comet" check --model gpt
expect bad-layout 2 "not divisible by config.ep" -- "$comet" check --backend cpu --experts 5 --ep 2
expect topk-too-big 2 "topk" -- "$comet" check --backend cpu --topk 9
if [ "${COMET_TEST_GPU:-0}" = 0 ]; then # CI: no GPU here
    expect cuda-absent 2 "no CUDA device found" -- "$comet" check --backend cuda
fi
expect check-default 0 'ok \(0 of [0-9]+ elements differ\)' -- "$comet" check --backend cpu --tokens 64
expect check-tp 0 'ok \(0 of' -- "$comet" check --backend cpu --model qwen2-moe --tp 2 --ep 2 --tokens 37 --skew 0.2 --zero-experts 5 --n-comm 3
expect check-gelu 0 'ok \(0 of' -- "$comet" check --backend cpu --model phi-3.5-moe --activation gelu --tp 2 --ep 1 --tokens 9 --chunk 40
expect bench-small 0 'median of 2 runs' -- "$comet" bench --backend cpu --model deepseek-v3 --scale 32 --tokens 16 --iters 2 --warmup 0
echo "test_cli: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
