#!/usr/bin/env bash
# test_cli.sh BUILD_DIR - the command-line tool: help on every subcommand, bench --train,
# bad flags, values and output files rejected with exit status 2 and their
# own messages ("did you mean" included), warnings for flags a run ignores,
# `comet check` and `comet bench` run on the CPU engine and report a bitwise
# match (GPU runs are covered by test_layer_gpu), the row's n_comm, chunk
# and custom-model label, the trace's files, the progress line, comet tune's
# table and bench reading it; bench/report.py's usage and columns on made-up
# rows. Prints "test_cli: N passed, N failed".
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
expect bad-flag 2 "unknown flag '--frob' \(flags: comet bench --help\)" -- "$comet" bench --frob
expect bad-number 2 "--tokens needs a whole number, got 'abc'" -- "$comet" check --tokens abc
expect bad-number-frac 2 "--tokens needs a whole number, got '1.5'" -- "$comet" check --tokens 1.5
expect bad-model 2 "unknown model 'gpt' \(presets: mixtral-8x7b, qwen2-moe" -- "$comet" check --model gpt
# "did you mean": the nearest flag, model or command by edit distance (or a name's beginning)
expect mean-flag 2 "unknown flag '--tokenz'; did you mean --tokens\?" -- "$comet" bench --tokenz 64
expect mean-flag-dash 2 "unknown flag '-seed'; did you mean --seed\?" -- "$comet" check -seed 3
expect mean-flag-none 2 "unknown flag '--to' \(flags" -- "$comet" check --to 3 # --tokens, --topk, --tp: no guess
expect mean-model 2 "unknown model 'mixtral'; did you mean mixtral-8x7b\?" -- "$comet" check --model mixtral
expect mean-model-typo 2 "did you mean deepseek-v3\?" -- "$comet" check --model deepsek
expect mean-command 2 "unknown command 'benhc'; did you mean bench\?" -- "$comet" benhc
expect flag-first 2 "'--tokens' is not a command; the command comes first" -- "$comet" --tokens 64
expect mean-positional 2 "unexpected argument 'qwen2-moe'; did you mean --model qwen2-moe\?" -- "$comet" check qwen2-moe
# a missing value, a bad number, a bad choice: each its own message
expect missing-value 2 "^comet: --tokens needs a value$" -- "$comet" check --tokens
expect missing-value-flag 2 "--json needs a value \(got the flag '--tokens'\)" -- "$comet" check --json --tokens 8
expect bad-choice 2 "--backend must be auto, cpu or cuda, got 'tpu'" -- "$comet" check --backend tpu
expect bad-activation 2 "--activation must be silu or gelu, got 'relu'" -- "$comet" check --activation relu
expect other-command 2 "comet check: --graph is a flag of comet bench$" -- "$comet" check --graph
expect no-value-flag 2 "--graph takes no value" -- "$comet" bench --graph=1
expect flag-equals 0 'ok \(0 of' -- "$comet" check --backend=cpu --tokens=8 --scale=64
expect bad-layout 2 "not divisible by config.ep" -- "$comet" check --backend cpu --experts 5 --ep 2
expect topk-too-big 2 "topk" -- "$comet" check --backend cpu --topk 9
expect n-comm-range 2 "n-comm needs a whole number in \[-1, 1024\]" -- "$comet" check --n-comm -2
# NaN, infinities and empty values are refused before anything runs (--skew nan with
# --zero-experts looped forever; an empty value was taken as 0)
expect skew-nan 2 "--skew needs a number in \[0, 10\], got 'nan'" -- timeout 10 "$comet" check --backend cpu --tokens 8 --skew nan --zero-experts 2
expect skew-inf 2 "--skew needs a number" -- timeout 10 "$comet" check --backend cpu --tokens 8 --skew inf
expect skew-empty 2 "--skew needs a number in \[0, 10\], got ''" -- timeout 10 "$comet" check --backend cpu --tokens 8 --skew ''
expect tokens-empty 2 "--tokens needs a whole number, got ''" -- "$comet" check --backend cpu --tokens ''
for flag in --n-comm --chunk --seed --warmup --zero-experts; do
    expect "empty$flag" 2 "$flag needs a whole number" -- "$comet" check --backend cpu --tokens 8 "$flag" ''
done
# --chunk wider than hidden is refused with the config, before anything is drawn
expect chunk-wide 2 "--chunk 100000 is wider than hidden 512" -- "$comet" check --backend cpu --tokens 8 --chunk 100000
# a failed forward says why (the reason outlived the world's destroy)
expect forward-reason 1 "forward failed: COMET_ERR_INVALID_ARGUMENT: .*n_comm 100" -- "$comet" check --backend cpu --tokens 8 --n-comm 100
# a --trace path too long for the picture's name beside it (4093 characters, valid for the
# JSON itself: its .svg name would not fit) is refused, not written to a truncated name
ldir=$(mktemp -d) long="$ldir/"
while [ ${#long} -lt 4091 ]; do long="$long./"; done
long="${long}$(printf 't%.0s' $(seq $((4093 - ${#long}))))"
expect trace-long 2 "--trace: the path is longer than 4091 characters" -- "$comet" check --backend cpu --tokens 8 --trace "$long"
expect trace-long-nothing 0 '^0$' -- bash -c 'ls "$1" | wc -l' _ "$ldir"
rm -rf "$ldir"
expect graph-cpu 0 'the CPU engine runs without it' -- "$comet" bench --backend cpu --scale 64 --tokens 16 --iters 1 --warmup 0 --graph
expect n-comm-seq-cpu 0 ' auto:[0-9]+ \(rule\) +[0-9]+ .* ok \(0 of' -- "$comet" check --backend cpu --tokens 16 --n-comm -1
# flags a run ignores or clamps: a warning on stderr, and the run goes on
expect n-comm-seq-cpu-warn 0 '^comet: warning: --n-comm -1 \(the sequential chain\) is for GPUs: the CPU engine always overlaps' -- "$comet" check --backend cpu --tokens 16 --n-comm -1
expect check-iters-warn 0 '^comet: warning: --iters and --warmup ignored: comet check runs one forward' -- "$comet" check --backend cpu --scale 64 --tokens 8 --iters 3
expect scale-warn 0 '^comet: warning: --scale 4 ignored: --hidden and --ffn set' -- "$comet" check --backend cpu --tokens 8 --scale 4 --hidden 64 --ffn 32
expect chunk-cpu-no-warn 0 '^none$' -- bash -c '"$1" check --backend cpu --scale 64 --tokens 8 --n-comm 2 --chunk 16 2>&1 | grep -c "warning" | sed "s/^0$/none/"' _ "$comet"
if [ "${COMET_TEST_GPU:-0}" = 0 ]; then # CI: no GPU here
    expect cuda-absent 2 "no CUDA device found" -- "$comet" check --backend cuda
fi
# the row: n_comm and chunk width the layer ran, and who chose them (the arguments: plain numbers;
# the tuner's rule or table: "auto:<n> (rule)")
expect row-args 0 '^qwen2-moe .* 3 +24 +[0-9.]+ .* ok \(0 of' -- "$comet" check --backend cpu --model qwen2-moe --scale 16 --tokens 8 --n-comm 3 --chunk 24
expect row-header 0 '^model .* ffn +n_comm +chunk +ms ' -- "$comet" check --backend cpu --tokens 8
expect row-rule 0 '^mixtral-8x7b .* auto:1 \(rule\) +64 +[0-9.]+ .* ok \(0 of' -- "$comet" check --backend cpu --tokens 8
# sizes off the preset's: a custom model in the row; JSON "model" keeps the preset, with "custom": 1
expect custom-row 0 '^custom \(mixtral-8x7b, hidden 256, topk 4\) +8 +1 +2 +4 +8 +256 .* ok \(0 of' -- "$comet" check --backend cpu --tokens 8 --hidden 256 --topk 4
expect custom-not 0 '^mixtral-8x7b +8 ' -- "$comet" check --backend cpu --tokens 8 --hidden 512 # the scaled preset's own
# a progress line on a terminal from 2 s into the forwards, none when stderr is not one (each run
# stopped after 3 s)
if command -v script >/dev/null && command -v timeout >/dev/null; then
    expect progress-tty 124 'forward [0-9]+/100000, [0-9]+ s' -- script -qec "timeout -s INT 3 $comet bench --backend cpu --scale 64 --tokens 16 --iters 100000 --warmup 0" /dev/null
fi
expect progress-pipe 0 '^0$' -- bash -c 'timeout -s INT 3 "$1" bench --backend cpu --scale 64 --tokens 16 --iters 100000 --warmup 0 2>&1 | grep -c "forward [0-9]*/" || true' _ "$comet"
expect check-default 0 'ok \(0 of [0-9]+ elements differ\)' -- "$comet" check --backend cpu --tokens 64
expect check-tp 0 'ok \(0 of' -- "$comet" check --backend cpu --model qwen2-moe --tp 2 --ep 2 --tokens 37 --skew 0.2 --zero-experts 5 --n-comm 3
expect check-gelu 0 'ok \(0 of' -- "$comet" check --backend cpu --model phi-3.5-moe --activation gelu --tp 2 --ep 1 --tokens 9 --chunk 40
expect bench-small 0 'median of 2 runs' -- "$comet" bench --backend cpu --model deepseek-v3 --scale 32 --tokens 16 --iters 2 --warmup 0
# --trace: Chrome-trace JSON and an SVG beside it, for bench and check
tdir=$(mktemp -d)
expect bench-trace 0 'trace: [1-9][0-9]* events of the last forward \(0 dropped\)' -- "$comet" bench --backend cpu --scale 32 --tokens 32 --iters 2 --warmup 0 --n-comm 2 --trace "$tdir/b.json"
# with --train on the CPU engine: the last step, the backward's steps in their own kinds
expect train-trace 0 'trace: [1-9][0-9]* events of the last step \(forward and backward\) \(0 dropped\)' -- "$comet" bench --train --backend cpu --scale 32 --tokens 32 --iters 2 --warmup 0 --n-comm 2 --trace "$tdir/t.json"
expect train-trace-kinds 0 '^ok$' -- bash -c 'grep -q "\"kind\": \"wgrad\"" "$1" && grep -q "\"kind\": \"bwd_send\"" "$1" && grep -q "\"kind\": \"gemm1\"" "$1" && grep -q "backward: weight gradients" "$2" && echo ok' _ "$tdir/t.json" "$tdir/t.svg"
expect check-trace 0 'ok \(0 of' -- "$comet" check --backend cpu --model qwen2-moe --scale 16 --tp 2 --ep 2 --tokens 24 --trace "$tdir/c"
# --trace x.svg: the picture in x.svg, the JSON in x.json
expect trace-svg-name 0 'trace: [1-9][0-9]* events .* -> .*/s\.json, .*/s\.svg$' -- "$comet" check --backend cpu --scale 64 --tokens 8 --trace "$tdir/s.svg"
expect trace-svg-files 0 '^ok$' -- bash -c 'grep -q "</svg>" "$1.svg" && grep -q "traceEvents" "$1.json" && echo ok' _ "$tdir/s"
for f in "$tdir/b.json" "$tdir/b.svg" "$tdir/c" "$tdir/c.svg"; do
    expect "trace-file-$(basename "$f")" 0 '^ok$' -- bash -c '[ -s "$1" ] && echo ok' _ "$f"
done
# valid-looking JSON: one object with traceEvents, complete events with ts/dur, every rank named
expect trace-json 0 '^ok$' -- bash -c 'head -c1 "$1" | grep -q "{" && tail -c2 "$1" | grep -q "}" &&
    grep -q "\"traceEvents\": \[" "$1" && grep -q "\"ph\": \"X\".*\"ts\": [0-9.]*, \"dur\": [0-9.]*" "$1" &&
    grep -q "\"name\": \"rank 1 (+[0-9.]* us)\"" "$1" && grep -q "\"kind\": \"gemm1\"" "$1" && grep -q "\"kind\": \"send\"" "$1" &&
    { ! command -v python3 >/dev/null || python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$1"; } && echo ok' _ "$tdir/b.json"
expect bench-json-tuned 0 '"n_comm": 0, "tuned": 1,' -- bash -c '"$1" bench --backend cpu --scale 64 --tokens 16 --iters 1 --warmup 0 --json "$2" >/dev/null && cat "$2"' _ "$comet" "$tdir/tuned.jsonl"
expect bench-json-iters 0 '"iters": 1, "warmup": 0[,}]' -- cat "$tdir/tuned.jsonl"
expect bench-json-chosen 0 '"chunk_cols": 8, "chosen_by": "rule", "custom": 0[,}]' -- cat "$tdir/tuned.jsonl"
expect bench-json-custom 0 '"model": "qwen2-moe", .*"hidden": 64, .*"custom": 1[,}]' -- bash -c '"$1" bench --backend cpu --model qwen2-moe --hidden 64 --scale 64 --tokens 16 --iters 1 --warmup 0 --json "$2" >/dev/null && cat "$2"' _ "$comet" "$tdir/custom.jsonl"
# --train: training steps on the CPU engine, the gradients bitwise the reference's, a JSON row marked train
expect train 0 '^mixtral-8x7b .* ok \(0 of [0-9]+\), ok \(0 of [0-9]+ elements differ\)' -- "$comet" bench --backend cpu --train --tokens 32 --scale 64 --iters 2 --warmup 1
expect train-recompute 0 'the forward saving nothing \(--recompute\)' -- "$comet" bench --backend cpu --train --recompute --tp 2 --ep 1 --tokens 32 --scale 64 --iters 2 --warmup 1
expect train-saved 0 '^saved state per layer and micro-batch: [0-9.]*[1-9][0-9.]* MiB \(gu and h of every row' -- "$comet" bench --backend cpu --train --tokens 32 --scale 64 --iters 1 --warmup 0
expect train-saved-recompute 0 '^saved state per layer and micro-batch: 0.0 MiB \(recompute: nothing' -- "$comet" bench --backend cpu --train --recompute --tokens 32 --scale 64 --iters 1 --warmup 0
expect recompute-alone 2 '--recompute is a variant of --train' -- "$comet" bench --backend cpu --recompute
expect grad-check-alone 2 '--grad-check is a variant of --train' -- "$comet" bench --backend cpu --grad-check
expect back-to-back-alone 2 '--back-to-back is a variant of --train' -- "$comet" bench --backend cpu --back-to-back
expect back-to-back-comm-hidden 2 '--back-to-back and --comm-hidden do not go together' -- "$comet" bench --backend cpu --train --back-to-back --comm-hidden
expect back-to-back-check 2 '--back-to-back is a flag of comet bench' -- "$comet" check --backend cpu --train --back-to-back
expect check-train 0 'ok \(0 of [0-9]+ elements differ\)' -- "$comet" check --backend cpu --train --tokens 32 --scale 64
# --comm-hidden with --train: the backward's four sides interleaved (the forward whole), then the real steps checked
expect train-comm-hidden 0 '^communication hidden in the backward: -?[0-9.]+%, .*medians of 4 backwards each' -- "$comet" bench --backend cpu --train --comm-hidden --tokens 32 --scale 64 --iters 4 --warmup 1
expect train-comm-hidden-check 0 'ok \(0 of [0-9]+\), ok \(0 of [0-9]+ elements differ\)' -- "$comet" bench --backend cpu --train --comm-hidden --tokens 32 --scale 64 --iters 4 --warmup 1
tj=$(mktemp /tmp/comet-train-XXXXXX)
"$comet" bench --backend cpu --train --model qwen2-moe --tokens 24 --scale 32 --iters 2 --warmup 0 --json "$tj" >/dev/null 2>&1
expect train-json 0 '"train": 1, "back_to_back": 0, "host_ms": 0\.0+, "save": "activations", "saved_bytes": [1-9][0-9]*, "fwd_n_comm": [0-9]+, "fwd_ms": [0-9.]+, "bwd_ms": [0-9.]+, "grad_wrong": 0, "grad_checked": [1-9]' -- cat "$tj"
if command -v python3 >/dev/null; then
    expect report-train 0 '\| qwen2-moe \| 24 \| 1 \| 2 \| 0 \| activations \| .* \| [0-9.]+ / - \| 0/[0-9]+ \| 0/[0-9]+ \|' -- python3 "$(dirname "$0")/../bench/report.py" "$tj"
    # bench/torch_comet.py's records (the step through Python) beside the C row of the same configuration
    printf '%s\n' '{"meta": {"device": "made-up", "gpus": 2, "torch": "x", "date": "2026-11-28", "commit": "x"},' \
        ' "records": [{"model": "qwen2-moe", "tokens": 24, "tp": 1, "ep": 2, "save": "activations", "python": true,' \
        ' "train": true, "step_ms": 1e6, "step_ms_back_to_back": 2e6, "host_ms_back_to_back": 3}, {"overhead": true}]}' > "$tdir/py.json"
    expect report-python 0 '^\| qwen2-moe \| 24 \| 1 \| 2 \| activations \| [0-9.]+ \| 1000000\.000 \| \+[0-9.]+% \| - \| 2000000\.000 \| - \| - / 3\.000 \| 1 C, 1 Python \|$' -- python3 "$(dirname "$0")/../bench/report.py" "$tdir/py.json" "$tj"
    expect report-skips 0 'not a layer.s rows, skipped' -- bash -c 'echo "{\"device\": \"x\", \"models\": []}" > "$1/g.json" && python3 "$2" "$1/g.json" "$3" 2>&1' _ "$tdir" "$(dirname "$0")/../bench/report.py" "$tj"
fi
rm -f "$tj"
if command -v python3 >/dev/null; then # bench/report.py: a custom row is its own model, not the preset's
    expect report-custom 0 '^\| custom \(qwen2-moe, hidden 64, ffn 22, experts 64, topk 4\) \| 16 \|' -- python3 "$(dirname "$0")/../bench/report.py" "$tdir/custom.jsonl"
fi
expect trace-svg 0 '^ok$' -- bash -c 'grep -q "</svg>" "$1" && [ "$(grep -c "<g class=\"lane\"" "$1")" -ge 4 ] && echo ok' _ "$tdir/c.svg"
# the files a run writes are checked before it runs (exit 2, nothing run)
expect trace-bad-path 2 '^comet: --trace /nonexistent-dir/t\.json: the directory /nonexistent-dir does not exist$' -- "$comet" check --backend cpu --tokens 8 --trace /nonexistent-dir/t.json
expect json-bad-path 2 '^comet: --json /nonexistent-dir/r\.jsonl: the directory /nonexistent-dir does not exist$' -- "$comet" bench --backend cpu --tokens 8 --json /nonexistent-dir/r.jsonl
expect json-dir 2 "^comet: --json $tdir: is a directory, not a file$" -- "$comet" bench --backend cpu --tokens 8 --json "$tdir"
expect json-under-file 2 "is not a directory$" -- "$comet" bench --backend cpu --tokens 8 --json "$tdir/b.svg/r.jsonl"
expect json-empty 2 "^comet: --json needs a file name, got ''$" -- "$comet" bench --backend cpu --tokens 8 --json ''
expect tune-out-bad 2 '^comet: --out /nonexistent-dir/t\.tsv: the directory /nonexistent-dir does not exist$' -- "$comet" tune --backend cpu --out /nonexistent-dir/t.tsv
expect tune-env-bad 2 '^comet: COMET_TUNE_FILE=/nonexistent-dir/t\.tsv: the directory' -- env COMET_TUNE_FILE=/nonexistent-dir/t.tsv "$comet" tune --backend cpu
if [ "$(id -u)" != 0 ]; then # root writes anywhere
    mkdir "$tdir/ro" && chmod a-w "$tdir/ro"
    expect json-read-only 2 "cannot create a file in $tdir/ro" -- "$comet" bench --backend cpu --tokens 8 --json "$tdir/ro/r.jsonl"
fi
if [ "${COMET_TEST_GPU:-0}" = 0 ]; then # without a GPU, --backend cuda is refused before any trace
    expect trace-cuda 2 'no CUDA device found' -- "$comet" bench --backend cuda --trace "$tdir/x.json"
fi
rm -rf "$tdir"
if [ "${COMET_TEST_GPU:-0}" = 0 ]; then # torchrun-style launch needs GPUs; without, a clear refusal
    expect launch-no-gpu 2 "launched world .*no CUDA device" -- env WORLD_SIZE=2 RANK=0 "$comet" check
fi
expect launch-bad-env 2 "not a valid launch" -- env WORLD_SIZE=2 RANK=5 "$comet" check
expect comm-hidden 0 'communication hidden: -?[0-9.]+%, (-?[0-9.]+%|not measurable [^)]*\)) net of the steps every side keeps \(gemm only [0-9.]+ ms, comm only [0-9.]+ ms, neither [0-9.]+ ms' -- "$comet" bench --backend cpu --scale 64 --tokens 32 --iters 2 --warmup 0 --comm-hidden
tune_out=$(mktemp -u /tmp/comet-tune-cli-XXXXXX)
expect tune-help 0 'usage: comet tune' -- "$comet" tune --help
expect tune-knobs-warn 0 'warning: --n-comm and --chunk ignored: comet tune times its own grid' -- "$comet" tune --backend cpu --scale 64 --tokens 8 --iters 1 --warmup 0 --n-comm 2 --out "$tune_out.knobs"
rm -f "$tune_out.knobs"
expect tune-json 2 'comet tune: --json is a flag of comet bench and comet check' -- "$comet" tune --backend cpu --json /tmp/x.jsonl
expect tune 0 "best: n_comm [0-9]+, chunk [0-9]+: .* appended to $tune_out" -- "$comet" tune --backend cpu --scale 64 --tokens 32 --iters 1 --out "$tune_out"
[ "$(wc -l < "$tune_out" 2>/dev/null)" = 2 ] && passed=$((passed + 1)) || { failed=$((failed + 1)); echo "FAIL test_cli tune-file: $tune_out"; }
rm -f "$tune_out"
# without --out or COMET_TUNE_FILE, comet tune writes comet-tune.tsv here and says how the library
# comes to read it; comet bench then says its choice came from the table, and where it did not
tune_dir=$(mktemp -d)
comet_abs="$(cd "$(dirname "$comet")" && pwd)/$(basename "$comet")"
(cd "$tune_dir" && env -u COMET_TUNE_FILE "$comet_abs" tune --backend cpu --scale 64 --tokens 32 --iters 1 >"$tune_dir/out" 2>&1)
expect tune-default 0 'appended to comet-tune\.tsv$' -- cat "$tune_dir/out"
expect tune-default-hint 0 "^to use it: export COMET_TUNE_FILE=$tune_dir/comet-tune\.tsv$" -- cat "$tune_dir/out"
expect tune-default-file 0 '^ok$' -- bash -c '[ -s "$1/comet-tune.tsv" ] && echo ok' _ "$tune_dir"
expect bench-table 0 '^mixtral-8x7b .* auto:[0-9]+ \(table\) +[0-9]+ ' -- env COMET_TUNE_FILE="$tune_dir/comet-tune.tsv" "$comet" bench --backend cpu --scale 64 --tokens 32 --iters 1 --warmup 0
expect bench-table-none 0 'chosen by rule \(COMET_TUNE_FILE holds no entry for this configuration\)' -- env COMET_TUNE_FILE="$tune_dir/comet-tune.tsv" "$comet" bench --backend cpu --scale 32 --tokens 32 --iters 1 --warmup 0
expect tune-named 0 '^\(COMET_TUNE_FILE names it' -- env COMET_TUNE_FILE="$tune_dir/comet-tune.tsv" "$comet" tune --backend cpu --scale 64 --tokens 32 --iters 1
rm -rf "$tune_dir"
# bench/report.py: the roofline column (rate / 804, GB/s / 348: the larger), comm hidden
# (-1 = not measured, printed "-"; other values below 0 are measurements) and the whole layer
# over its GEMM-only side (sides_ms [gemm only, comm only, whole, neither]; "-" without them)
if command -v python3 >/dev/null; then
    rj=$(mktemp /tmp/comet-report-XXXXXX)
    row='{"baseline": "comet-cuda", "date": "2026-11-22T00:00:00Z", "commit": "t", "model": "m", "M": 16, "tp": 1, "ep": 2, "skew": 0, "ms": 2.0, "rate": 402.0, "link_gbps": 10.0, "wrong": 0, "checked": 8, "n_comm": 0'
    printf '%s, "comm_hidden": -0.0287, "comm_hidden_net": 0.5}\n%s, "M": 32, "comm_hidden": -1}\n' "$row" "$row" > "$rj"
    report="$(dirname "$0")/../bench/report.py"
    expect report-help 0 '^usage: python3 bench/report.py \[REFERENCE.json\] FILE' -- python3 "$report" --help
    expect report-no-args 2 '^usage: python3 bench/report.py' -- python3 "$report"
    expect report-bad-option 2 'report.py: unknown option --frob' -- python3 "$report" --frob
    expect report-missing 2 'report.py: no such file: /nonexistent.jsonl' -- python3 "$report" /nonexistent.jsonl
    expect report-hidden 0 '\| 16 \| 1 \| 2 \| 0 \| seq \| 2\.000 \| - \| - \| 402 \| 50% \| -3% \| 50% \| - \| 0/8 \|' -- python3 "$report" "$rj"
    expect report-unmeasured 0 '\| 32 \| 1 \| 2 \| 0 \| seq \| .* \| 50% \| - \| - \| - \| 0/8 \| - \|' -- python3 "$report" "$rj"
    # the GPUs' SM clocks during the call (sm_mhz, NVML's order), "-" without them
    rc=$(mktemp /tmp/comet-report-XXXXXX)
    printf '%s, "comm_hidden": -1, "sm_mhz": [1392, 1401], "watts": [689.0, 692.5]}\n' "$row" > "$rc"
    expect report-clocks 0 '\| 0/8 \| 1392/1401 \|' -- python3 "$report" "$rc"
    rm -f "$rc"
    rs=$(mktemp /tmp/comet-report-XXXXXX)
    printf '%s, "comm_hidden": 0.5, "sides_ms": [2.0, 1.0, 2.08, 0.1]}\n%s, "M": 32, "comm_hidden": 0.5, "sides_ms": [2.0, 1.0, 2.2, 0.1]}\n' "$row" "$row" > "$rs"
    expect report-over 0 '\| 16 \| 1 \| 2 \| 0 \| seq \| .* \| 50% \| 50% \| - \| \+4\.0% \| 0/8 \|' -- python3 "$report" "$rs"
    expect report-within 0 'Within 5% of GEMM-only \(the target\): 1 of 2 rows measured with --comm-hidden: m 16 TP1 EP2\.' -- python3 "$report" "$rs"
    rm -f "$rs"
    # and the grid against a reference table: 2.0 ms against 5.0 and 3.0 (M=16 and 32): 2.50x and 1.50x
    ref=$(mktemp /tmp/comet-ref-XXXXXX)
    printf '{"reference": "r", "rows": [{"model": "m", "M": 16, "tp": 1, "ep": 2, "ms": 5.0}, {"model": "m", "M": 32, "tp": 1, "ep": 2, "ms": 3.0}, {"model": "m", "M": 32, "tp": 2, "ep": 1, "ms": 3.0}]}' > "$ref"
    expect report-grid 0 '\| m \| 2\.00 ms \(2\.50x\) / - \| 2\.00 ms \(1\.50x\) / - \|' -- python3 "$report" "$ref" "$rj"
    expect report-mean 0 'Mean speedup over 2 cells: 2\.00x \(geometric 1\.94x\); lowest 1\.50x, highest 2\.50x' -- python3 "$report" "$ref" "$rj"
    # a default run (tuned: the tuner's pick) goes to the auto grid, "ov" where it picked the overlapped mode
    printf '%s, "M": 32, "tp": 2, "ep": 1, "n_comm": 16, "tuned": 1, "comm_hidden": -1}\n' "$row" >> "$rj"
    expect report-auto 0 '\| 32 \| 2 \| 1 \| 0 \| auto: n_comm 16 \|' -- python3 "$report" "$rj"
    # rows that record their timed forwards pair with a PyTorch row over as many, and other than 20
    # show in the mode: 2.0 ms against the 200-forward row's 6.0 (3.00x), not the 20-forward one's 5.0
    rf=$(mktemp /tmp/comet-report-XXXXXX) t20=$(mktemp /tmp/comet-torch-XXXXXX) t200=$(mktemp /tmp/comet-torch-XXXXXX)
    mach='"machine": {"gpus": 2, "gpu": "g", "driver": "d", "cuda": "c", "torch": "t", "nccl": "n", "date": "x", "commit": "t"}'
    trow='"model": "m", "M": 16, "tp": 1, "ep": 2, "topk": 2, "experts": 8, "hidden": 32, "ffn": 16, "skew": 0, "zero_experts": 0, "gemm_ms": 1.0, "gemm_tflops": 1.0, "gemm_share": 0.5, "check_rel_err": 0.001'
    printf '{%s, "baseline": "pytorch", "records": [{%s, "ms": 5.0, "iters": 20, "warmup": 5}]}' "$mach" "$trow" > "$t20"
    printf '{%s, "baseline": "pytorch", "records": [{%s, "ms": 6.0, "iters": 200, "warmup": 5}]}' "$mach" "$trow" > "$t200"
    printf '%s, "comm_hidden": -1, "iters": 200, "warmup": 5}\n' "$row" > "$rf"
    expect report-forwards 0 '\| seq, 200 forwards \| 2\.000 \| 6\.000 \| 3\.00x \|' -- python3 "$report" "$t200" "$t20" "$rf"
    rm -f "$rf" "$t20" "$t200"
    expect report-auto-grid 0 '\| m \| - / - \| - / 2\.00 ms \(1\.50x, ov\) \|' -- python3 "$report" "$ref" "$rj"
    rm -f "$rj" "$ref"
else
    echo "test_cli: bench/report.py skipped (no python3)"
fi
echo "test_cli: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
