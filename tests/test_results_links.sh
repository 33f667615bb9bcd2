#!/usr/bin/env bash
# test_results_links.sh - bench/results stays findable: every path
# `bench/results/...` that a text file of the repository names exists (a
# glob, or a placeholder such as <day> or <EP>, must match at least one
# file); every relative markdown link of a report in bench/results exists;
# a dated results-file name (<yyyy-mm-dd>-<...>.md|jsonl|json|log|tsv)
# named anywhere is the name of a file under bench/results (so a stale name
# from before a move is caught even without its folder; only the index's
# column of former names may name the old ones); every file under
# bench/results sits in a topic folder, is named <date>-<what>-... without a
# bare commit hash, and is named by the index, bench/results/README.md.
# Quick (no build, GPU or network); reads the files git tracks, or every
# file when this is no git checkout. Prints "test_results_links: N passed,
# N failed" (with each failure named); exit 1 on a failure.
set -u
cd "$(dirname "$0")/.."
python3 - <<'PY'
import glob, os, re, subprocess, sys

passed = failed = 0
def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print("FAIL test_results_links:", what)

try:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, text=True, check=True).stdout
    files = sorted(set(f for f in out.split("\0") if f and os.path.isfile(f)))
except (OSError, subprocess.CalledProcessError):
    files = sorted(os.path.join(d, f)[2:] for d, ds, fs in os.walk(".") for f in fs
                   if not d.startswith(("./.git", "./build")))
def text_of(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None  # binary

EXT = r"(?:md|jsonl|json|log|tsv)"
path_re = re.compile(r"(?<![\w./-])(bench/results(?:/[\w.*<>|-]*)*)")
name_re = re.compile(r"(?<![\w.-])(20\d\d-\d\d-\d\d-[\w.-]*?\.%s)(?![\w-])" % EXT)
link_re = re.compile(r"\]\(([^)\s]+)\)")
results = [f for f in files if f.startswith("bench/results/")]
basenames = set(os.path.basename(f) for f in results)

def exists(p):
    p = p.rstrip(".,;:")
    if re.search(r"[*<]", p):
        pattern = re.sub(r"<[^>]*>", "*", p)
        return bool(glob.glob(pattern))
    return os.path.exists(p)

# 1. every bench/results/... path named in a text file exists
npaths = 0
for f in files:
    text = text_of(f)
    if not text or "bench/results" not in text:
        continue
    for m in path_re.finditer(text):
        p = m.group(1)
        npaths += 1
        line = text.count("\n", 0, m.start()) + 1
        check(exists(p), "%s:%d names %s, which does not exist" % (f, line, p))
# 2. every dated results-file name is a file's name under bench/results (the
# index's table of every file keeps each one's former name in its last column)
former = set(re.findall(r"^\|.*\| `([^`]+)` \|$", text_of("bench/results/README.md") or "", flags=re.M))
for f in files:
    text = text_of(f)
    if not text:
        continue
    for m in name_re.finditer(text):
        name = m.group(1)
        if f == "bench/results/README.md" and name in former:
            continue
        line = text.count("\n", 0, m.start()) + 1
        check(name in basenames, "%s:%d names %s: no such file under bench/results" % (f, line, name))
# 3. relative links of the markdown under bench/results
for f in results:
    if not f.endswith(".md"):
        continue
    text = re.sub(r"^```.*?^```", "", text_of(f) or "", flags=re.S | re.M)
    for m in link_re.finditer(text):
        link = m.group(1).split("#")[0]
        if not link or re.match(r"^[a-z]+:", link):
            continue
        target = os.path.normpath(os.path.join(os.path.dirname(f), link))
        check(os.path.exists(target), "%s links %s: %s missing" % (f, m.group(1), target))
# 4. the layout: topic folders, names, the index
index = text_of("bench/results/README.md") or ""
check(bool(index), "bench/results/README.md (the index) is missing")
for f in results:
    rel = f[len("bench/results/"):]
    name = os.path.basename(f)
    if name == "README.md":
        continue
    check("/" in rel, "%s lies at the top of bench/results, not in a topic folder" % f)
    check(re.match(r"^20\d\d-\d\d-\d\d-[a-z0-9][a-z0-9.-]*\.%s$" % EXT, name) is not None,
          "%s: not named <date>-<what>-<machine>[-<variant>].<ext> (lower case)" % f)
    hashes = [p for p in re.split(r"[-.]", name) if re.fullmatch(r"[0-9a-f]{7,40}", p)
              and re.search(r"[a-f]", p) and re.search(r"[0-9]", p)]
    check(not hashes, "%s: a commit hash (%s) in its name; the index or the header records the commit" % (f, hashes[0] if hashes else ""))
    check(rel in index, "%s is not in the index, bench/results/README.md" % f)
print("test_results_links: %d paths, %d files under bench/results" % (npaths, len(results)))
print("test_results_links: %d passed, %d failed" % (passed, failed))
sys.exit(1 if failed else 0)
PY
