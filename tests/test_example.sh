#!/usr/bin/env bash
# test_example.sh BUILD_DIR - comet as a user gets it: `make install` of
# BUILD_DIR into a temporary prefix, examples/forward.c built against that
# prefix by examples/Makefile (pkg-config --cflags --libs comet; without
# pkg-config, the same flags read from comet.pc) and linked with the shared
# library, then run: on the CPU backend its layer must equal the reference
# bitwise. In a build with CUDA the example's CUDA variant is built and run too
# (the CUDA backend where there are GPUs for its ranks; else the CPU backend,
# and --cuda must fail with comet's error message). Sanitizer builds have no
# shared library: skipped. Prints "test_example: N passed, N failed".
set -u
build=${1:-build}
cd "$(dirname "$0")/.."
unset MAKEFLAGS MFLAGS MAKELEVEL # the knobs below say how to build, not the make that runs the tests
passed=0 failed=0
pass() { passed=$((passed + 1)); echo "test_example: ok: $1"; }
fail() { failed=$((failed + 1)); echo "FAIL test_example $1"; [ -z "${2:-}" ] || printf '%s\n' "$2" | tail -n 20; }
summary() { echo "test_example: $passed passed, $failed failed${1:+, $1 skipped}"; [ "$failed" -eq 0 ]; exit; }

[ -f "$build/make.vars" ] || { fail "no $build/make.vars: build with make first"; summary; }
var() { sed -n "s/^$1=//p" "$build/make.vars"; } # the build's knobs (CC, SAN, NVCC, ...)
if [ -n "$(var SAN)" ]; then
    echo "test_example: skipped (a sanitizer build has no shared library)"
    summary 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

# make install with the knobs the build was made with: it must only copy.
knobs=()
while IFS= read -r line; do [[ $line == \#* ]] || knobs+=("$line"); done <"$build/make.vars"
touch "$tmp/stamp"
sleep 0.01
if out=$(make -s --no-print-directory install BUILD="$build" "${knobs[@]}" PREFIX="$prefix" 2>&1); then
    rebuilt=$(find "$build" -name '*.o' -newer "$tmp/stamp" | head -n 3)
    missing=$(for f in include/comet.h lib/libcomet.a lib/libcomet.so lib/libcomet.so.0 lib/pkgconfig/comet.pc; do
        [ -e "$prefix/$f" ] || echo "$f"; done)
    if [ -n "$rebuilt$missing" ]; then
        fail "make install" "rebuilt: ${rebuilt:-none}; missing: ${missing:-none}"
    else
        pass "make install PREFIX=<tmp>"
    fi
else
    fail "make install" "$out"
fi

# The compile and link flags: pkg-config, else comet.pc read by sed.
pc=$prefix/lib/pkgconfig/comet.pc
if command -v pkg-config >/dev/null; then
    cflags=$(PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config --cflags comet)
    libs=$(PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config --libs comet)
    how="flags from pkg-config"
else
    pcvar() { sed -n "s/^$1: *//p" "$pc" | sed "s|\${libdir}|$(sed -n 's/^libdir=//p' "$pc")|g; s|\${includedir}|$(sed -n 's/^includedir=//p' "$pc")|g"; }
    cflags=$(pcvar Cflags) libs=$(pcvar Libs)
    how="flags from comet.pc by sed: no pkg-config here"
fi

# build NAME DIR [make variables...]: examples/Makefile into DIR.
build_example() {
    local name=$1 dir=$2 out; shift 2
    mkdir -p "$dir"
    if out=$(make -s --no-print-directory -C examples O="$dir" CC="$(var CC)" COMET_CFLAGS="$cflags" \
        COMET_LIBS="$libs" "$@" 2>&1) && [ -x "$dir/forward" ]; then
        if command -v readelf >/dev/null && ! readelf -d "$dir/forward" | grep -q 'NEEDED.*libcomet\.so\.0'; then
            fail "$name: not linked with libcomet.so.0" "$(readelf -d "$dir/forward")"
        else
            pass "$name ($how)"
        fi
    else
        fail "$name" "$out"
    fi
}
# run NAME WANT_RC PATTERN -- command...
run() {
    local name=$1 want=$2 pat=$3 out rc; shift 4
    out=$("$@" 2>&1); rc=$?
    if [ "$rc" -eq "$want" ] && grep -qE -- "$pat" <<<"$out"; then
        pass "$name: $(tail -n 1 <<<"$out")"
    else
        fail "$name: rc=$rc (want $want)" "$out"
    fi
}

build_example "build examples/forward.c" "$tmp/cpu" CUDA_HOME=
run "forward --cpu" 0 'ok, bitwise equal' -- "$tmp/cpu/forward" --cpu
run "forward 4" 0 'ok, bitwise equal' -- "$tmp/cpu/forward" 4
run "forward 3 (usage)" 2 'usage' -- "$tmp/cpu/forward" 3
if [ -n "$(var NVCC)" ]; then
    cuda_home=$(var CUDA_HOME)
    build_example "build examples/forward.c with CUDA" "$tmp/cuda" CUDA_HOME="$cuda_home"
    out=$("$tmp/cuda/forward" 2>&1)
    if grep -q 'CUDA backend' <<<"$out"; then # GPUs for 2 ranks: it ran the CUDA backend
        run "forward (CUDA build, CUDA backend)" 0 ': ok' -- "$tmp/cuda/forward"
    else
        run "forward (CUDA build, CPU backend)" 0 'ok, bitwise equal' -- "$tmp/cuda/forward"
        run "forward --cuda (no GPUs for it)" 1 'comet_world_create_local: .+' -- "$tmp/cuda/forward" --cuda
    fi
fi
summary
