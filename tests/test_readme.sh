#!/usr/bin/env bash
# test_readme.sh - README.md as a newcomer follows it, on the CPU, from the
# repository root of a clone (CI runs it from .ci/run, after its Python
# environment is made). Every fenced code block of README.md is taken out and:
#
# - sh / bash / shell / console blocks: each command line runs, in order, in
#   the repository root (console: the "$ " prompt is dropped; comment lines
#   and blank lines are skipped). HOME is a temporary folder, so
#   `make install PREFIX=$HOME/.local` installs there; a line `export V=...`
#   holds for the lines after it in its block. Special lines:
#     `make test`        skipped: CI runs it directly ("covered elsewhere");
#     `pip install ...`  runs in the Python environment (below);
#     a line naming `prog.c` runs in a scratch folder where prog.c is the
#                        README's first C block (wrapped as below).
#   Marks: a README command line whose trailing comment begins with
#     `# GPU`  needs a GPU (or torchrun, one process per GPU) and
#     `# long` takes too long for CI on 2 cores (minutes on the CPU);
#   both are skipped and say so. A line that names a file that only a
#   skipped line makes (e.g. rows.jsonl) is skipped too.
# - c blocks: compiled (-std=c11 -Wall -Wextra -Werror) against the
#   comet that the README's `make install PREFIX=$HOME/.local` installed
#   (pkg-config; else an install of build/ into a temporary prefix), then run
#   (it must exit 0 with nothing on stderr). A block with a main() is
#   compiled as it is; a fragment (no main) is put in a wrapper that
#   declares what "The API in brief" leaves to the reader: main() runs the
#   code above the line `/* on each rank's thread: */`, then one thread per
#   rank runs the rest with `rank`, `world` and the buffers `x`, `idx`, `w`,
#   `w1`, `w2`, `y` of `T` tokens in the block's shapes (zero weights,
#   calloc'd: the pages are never written), then destroys the world.
# - python blocks: run in the Python environment with the installed package
#   (from a scratch folder); a block that imports torch (or transformers) is
#   skipped, saying so, where that is not installed there.
# - paths: every repository path named in README.md and docs/*.md (`docs/`,
#   `bench/`, `src/`, `tools/`, `examples/`, `python/`, `harness/`, `dev/`,
#   `include/`, `tests/`; globs expanded) and every relative markdown link
#   (with its #anchor, against the target's headings) must exist; each
#   missing one is a failure by name.
#
# The Python environment: COMET_README_VENV (a venv, as .ci/run passes its
# own), else a throwaway `python3 -m venv` in the temporary folder.
# Files the commands leave in the tree that git does not ignore (rows.jsonl,
# comet-tune.tsv) and a new examples/forward are removed at the end. Prints one line per check and
# "test_readme: N passed, M failed[, K skipped]"; exit 1 on a failure.
set -u
cd "$(dirname "$0")/.."
repo=$PWD
unset MAKEFLAGS MFLAGS MAKELEVEL
passed=0 failed=0 skipped=0
pass() { passed=$((passed + 1)); echo "test_readme: ok: $1"; }
fail() { failed=$((failed + 1)); echo "FAIL test_readme: $1"; [ -z "${2:-}" ] || printf '%s\n' "$2" | tail -n 25 | sed 's/^/    /'; }
skip() { skipped=$((skipped + 1)); echo "test_readme: skipped: $1"; }
tmp=$(mktemp -d)
untracked() { git -C "$repo" ls-files --others --exclude-standard 2>/dev/null | sort; }
untracked >"$tmp/untracked.before"
# examples/forward (ignored) keeps the rpath of the prefix it was linked with, which
# is gone after this run, and examples/Makefile would not relink it: removed too.
[ -e examples/forward ] && had_example=1 || had_example=0
cleanup() {
    if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
        # only files at the top of the tree, where the README's commands write (comet-tune.tsv,
        # traces): a file someone creates under docs/ or src/ meanwhile is theirs
        untracked | comm -13 "$tmp/untracked.before" - | grep -v / | while IFS= read -r f; do
            echo "test_readme: removing $f (left in the tree by a README command)"; rm -f -- "$repo/$f"; done
    fi
    [ "$had_example" = 1 ] || rm -f "$repo/examples/forward"
    rm -rf "$tmp"
}
trap cleanup EXIT
start=$SECONDS
mkdir -p "$tmp/home" "$tmp/work" "$tmp/blocks"
export HOME=$tmp/home

# ---- the blocks: $tmp/blocks/NN.LANG (NN in README order), LINE in NN.line
python3 - README.md "$tmp/blocks" <<'PY' || { fail "README.md: its code blocks could not be read"; }
import re, sys
text = open(sys.argv[1]).read().split("\n")
out, n, i = sys.argv[2], 0, 0
while i < len(text):
    m = re.match(r"^(`{3,})\s*([\w+-]*)\s*$", text[i])
    if not m:
        i += 1
        continue
    fence, lang, start, body = m.group(1), (m.group(2) or "text").lower(), i + 1, []
    i += 1
    while i < len(text) and not text[i].startswith(fence):
        body.append(text[i])
        i += 1
    i += 1
    lang = {"bash": "sh", "shell": "sh", "console": "console", "py": "python", "python3": "python"}.get(lang, lang)
    n += 1
    open("%s/%02d.%s" % (out, n, lang), "w").write("\n".join(body) + "\n")
    open("%s/%02d.line" % (out, n), "w").write("%d\n" % (start + 1))
PY

# ---- C blocks: a fragment's wrapper (see the header)
wrap_c() { # SRC OUT
    if grep -qE '^[a-z].*\bmain\s*\(' "$1"; then cp "$1" "$2"; return; fi
    python3 - "$1" "$2" <<'PY'
import re, sys
src = open(sys.argv[1]).read()
incl = "".join(l + "\n" for l in src.split("\n") if l.startswith("#"))
body = "\n".join(l for l in src.split("\n") if not l.startswith("#"))
marker = "/* on each rank's thread: */"
pro, _, per_rank = body.partition(marker) if marker in body else ("", "", body)
if not marker in body:  # no world made by the block: one rank on the CPU
    pro = "comet_world_t *world;\ncomet_world_create_local(&world, 1, COMET_BACKEND_CPU);\n"
open(sys.argv[2], "w").write("""/* README.md's C fragment, wrapped by tests/test_readme.sh */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
%s
static comet_world_t *readme_world;

static void *readme_rank(void *arg)
{
    int rank = (int)(intptr_t)arg;
    comet_world_t *world = readme_world;
    enum { T = 4 }; /* tokens on this rank; the shapes below are the block's (Mixtral's) */
    uint16_t *x = calloc((size_t)T * 4096, 2), *y = calloc((size_t)T * 4096, 2);
    int32_t idx[T * 2];
    float w[T * 2];
    uint16_t *w1 = calloc((size_t)4 * 2 * 14336 * 4096, 2), *w2 = calloc((size_t)4 * 4096 * 14336, 2);
    if (!x || !y || !w1 || !w2) { fprintf(stderr, "out of memory\\n"); exit(1); }
    for (int t = 0; t < T; t++)
        for (int k = 0; k < 2; k++) {
            idx[t * 2 + k] = (t + 3 * rank + k) %% 8;
            w[t * 2 + k] = 0.5f;
        }
    {
%s
    }
    free(x); free(y); free(w1); free(w2);
    return NULL;
}

int main(void)
{
%s
    readme_world = world;
    int n = comet_world_size(world);
    pthread_t th[64];
    for (int r = 0; r < n && r < 64; r++) pthread_create(&th[r], NULL, readme_rank, (void *)(intptr_t)r);
    for (int r = 0; r < n && r < 64; r++) pthread_join(th[r], NULL);
    comet_world_destroy(world);
    puts("README C block: ran on every rank");
    return 0;
}
""" % (incl, per_rank, pro))
PY
}
first_c=$(ls "$tmp"/blocks/*.c 2>/dev/null | head -n 1)
[ -z "$first_c" ] || wrap_c "$first_c" "$tmp/work/prog.c"

# ---- the Python environment
if [ -n "${COMET_README_VENV:-}" ]; then
    venv=$COMET_README_VENV
    [ -x "$venv/bin/python3" ] && pass "Python environment: $venv (given)" || fail "COMET_README_VENV=$venv: no bin/python3 there"
else
    venv=$tmp/venv
    if out=$(python3 -m venv "$venv" 2>&1); then pass "Python environment: python3 -m venv (throwaway)"; else fail "python3 -m venv" "$out"; fi
fi

# ---- sh blocks
skipped_words=" "
run_line() { # BLOCKLINE LINE PRELUDE
    local where=$1 line=$2 prelude=$3 cmd mark out rc dir=$repo w
    cmd=$(sed -E 's/[[:space:]]+#.*$//' <<<"$line")
    mark=$(sed -nE 's/^.*[[:space:]]#[[:space:]]*(GPU|long)([^[:alnum:]].*)?$/\1/p' <<<"$line")
    if [ -n "$mark" ]; then
        skip "README:$where: $cmd (marked # $mark)"
        for w in $cmd; do [[ $w =~ ^[[:alnum:]_][[:alnum:]_.-]*\.[[:alnum:]]+$ ]] && skipped_words+="$w "; done # its file names
        return
    fi
    if [[ $cmd =~ ^make\ test([[:space:]]|$) ]]; then
        skip "README:$where: $cmd (covered elsewhere: CI runs make test itself)"; return
    fi
    for w in $cmd; do
        if [[ $skipped_words == *" $w "* ]] && [ ! -e "$dir/$w" ]; then
            skip "README:$where: $cmd (needs $w, made by a skipped line)"; return
        fi
    done
    [[ $cmd == *prog.c* ]] && dir=$tmp/work
    local t0=$SECONDS
    out=$(cd "$dir" && PATH="$venv/bin:$PATH" timeout 300 bash -c "set -eo pipefail; $prelude
$cmd" 2>&1); rc=$?
    if [ "$rc" -eq 0 ]; then
        pass "README:$where: $cmd ($((SECONDS - t0)) s)"
    else
        fail "README:$where: $cmd: exit $rc$([ "$rc" -eq 124 ] && echo ' (timed out after 300 s)')" "$out"
    fi
}
for f in $(ls "$tmp"/blocks/ | grep -vE '\.line$' | sort); do
    f=$tmp/blocks/$f
    first=$(cat "${f%.*}.line") lang=${f##*.}
    case $lang in
    sh | console)
        n=$first prelude=
        while IFS= read -r line; do
            where=$n; n=$((n + 1))
            [ "$lang" = console ] && { [[ $line == '$ '* ]] || continue; line=${line#\$ }; }
            [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
            if [[ $line =~ ^export[[:space:]] ]]; then
                prelude+="$(sed -E 's/[[:space:]]+#.*$//' <<<"$line")"$'\n'
                pass "README:$where: $(sed -E 's/[[:space:]]+#.*$//' <<<"$line") (for the lines after it)"
                continue
            fi
            run_line "$where" "$line" "$prelude"
        done <"$f"
        ;;
    c)
        src=$tmp/work/block$first.c
        wrap_c "$f" "$src"
        pc=$HOME/.local/lib/pkgconfig
        if [ ! -f "$pc/comet.pc" ]; then
            pc=$tmp/prefix/lib/pkgconfig
            [ -f "$pc/comet.pc" ] || make -s --no-print-directory install PREFIX="$tmp/prefix" >/dev/null 2>&1
        fi
        if ! flags=$(PKG_CONFIG_PATH=$pc pkg-config --cflags --libs comet 2>&1); then
            fail "README:$first: C block: no comet to compile against" "$flags"; continue
        fi
        what="C block$(grep -q '\bmain\s*(' "$f" || echo ' (a fragment, wrapped)')"
        if out=$(cc -std=c11 -Wall -Wextra -Werror "$src" $flags -pthread -Wl,-rpath,"${pc%/pkgconfig}" -o "$src.bin" 2>&1); then
            pass "README:$first: $what compiles (-Wall -Wextra -Werror, pkg-config)"
            t0=$SECONDS
            out=$(timeout 300 "$src.bin" 2>"$src.err"); rc=$?
            if [ "$rc" -eq 0 ] && [ ! -s "$src.err" ]; then
                pass "README:$first: $what runs: $(tail -n 1 <<<"$out") ($((SECONDS - t0)) s)"
            else
                fail "README:$first: $what: exit $rc" "$out$(cat "$src.err")"
            fi
        else
            fail "README:$first: $what does not compile" "$out"
        fi
        ;;
    python)
        if grep -qE '^\s*(import|from)\s+torch\b|^\s*import .*\btorch\b' "$f" && ! "$venv/bin/python3" -c 'import torch' >/dev/null 2>&1; then
            skip "README:$first: Python block (imports torch, which this environment lacks)"; continue
        fi
        if grep -qE '^\s*(import|from)\s+transformers\b|^\s*import .*\btransformers\b' "$f" && ! "$venv/bin/python3" -c 'import transformers' >/dev/null 2>&1; then
            skip "README:$first: Python block (imports transformers, which this environment lacks)"; continue
        fi
        t0=$SECONDS
        if out=$(cd "$tmp/work" && timeout 300 "$venv/bin/python3" "$f" 2>&1); then
            pass "README:$first: Python block runs ($((SECONDS - t0)) s)"
        else
            fail "README:$first: Python block: exit $?" "$out"
        fi
        ;;
    *) ;; # text, tables: nothing to run
    esac
done

# ---- paths and links
out=$(python3 - README.md docs/*.md <<'PY'
import glob, os, re, sys
prefixes = "docs|bench|src|tools|examples|python|harness|dev|include|tests"
path_re = re.compile(r"(?<![\w./~$-])((?:%s)/[\w.*/-]*)" % prefixes)
link_re = re.compile(r"\]\(([^)\s]+)\)")
def slugs(md):
    out = set()
    for line in open(md):
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return out
for md in sys.argv[1:]:
    text = open(md).read()
    text_nocode = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    bad, npaths, nlinks = [], set(), 0
    for m in path_re.finditer(text):
        p = m.group(1).rstrip(".")
        npaths.add(p)
        if not glob.glob(p.rstrip("/") if "*" in p else p) and not os.path.exists(p):
            bad.append("path %s: missing" % p)
    for m in link_re.finditer(text_nocode):
        link = m.group(1)
        if re.match(r"^[a-z]+:", link):
            continue
        nlinks += 1
        target, _, anchor = link.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(md), target)) if target else md
        if not os.path.exists(path):
            bad.append("link %s: %s missing" % (link, path))
        elif anchor and path.endswith(".md") and anchor not in slugs(path):
            bad.append("link %s: no heading #%s in %s" % (link, anchor, path))
    for b in sorted(set(bad)):
        print("BAD %s: %s" % (md, b))
    print("OK %s: %d repository paths, %d links" % (md, len(npaths), nlinks))
PY
)
while IFS= read -r line; do
    case $line in
    BAD*) fail "${line#BAD }" ;;
    OK*) what=${line#OK }; grep -q "^BAD ${what%%:*}:" <<<"$out" || pass "$what: all exist" ;;
    esac
done <<<"$out"

echo "test_readme: $((SECONDS - start)) s"
if [ "$skipped" -gt 0 ]; then
    echo "test_readme: $passed passed, $failed failed, $skipped skipped"
else
    echo "test_readme: $passed passed, $failed failed"
fi
[ "$failed" -eq 0 ]
