#!/usr/bin/env bash
# test_layout.sh - the source tree keeps its architecture: the library reads
# the environment in one file (src/core/options.c); only src/api/backends.c
# knows whether the CUDA backend was compiled in; the include graph of src/,
# folder by folder, has no cycle (src/api on top, then the backends, then
# core and plan). Prints "test_layout: N passed, N failed".
set -u
cd "$(dirname "$0")/.."
python3 - <<'PY'
import os, re, sys
passed = failed = 0
def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print("FAIL test_layout:", what)

sources = [os.path.join(d, f) for d, _, fs in os.walk("src") for f in fs if re.search(r"\.(c|h|cu|cuh)$", f)]
def code_of(path):  # without comments, so that prose naming a variable does not count
    text = open(path).read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)

env = sorted(p for p in sources if re.search(r"\b(getenv|setenv|unsetenv)\s*\(", code_of(p)))
check(env == ["src/core/options.c"], "the environment is read or written in %s, not only src/core/options.c" % env)

cuda_ifdef = sorted(p for p in sources if "COMET_WITH_CUDA" in code_of(p))
check(cuda_ifdef == ["src/api/backends.c"], "COMET_WITH_CUDA is tested in %s, not only src/api/backends.c" % cuda_ifdef)

# folder graph: an edge a -> b when a file in src/a includes one in src/b
edges = {}
for p in sources:
    here = os.path.dirname(p)
    for inc in re.findall(r'#\s*include\s+"([^"]+)"', code_of(p)):
        target = os.path.normpath(os.path.join(here, inc))
        if not target.startswith("src/"):
            continue  # comet.h
        a, b = here.split("/")[1], target.split("/")[1]
        if a != b:
            edges.setdefault(a, set()).add(b)
state, cycle = {}, []
def visit(n, path):
    state[n] = 1
    for m in sorted(edges.get(n, ())):
        if state.get(m) == 1 and not cycle:
            cycle.extend(path[path.index(m):] + [m] if m in path else [n, m])
        elif m not in state:
            visit(m, path + [m])
    state[n] = 2
for n in sorted(edges):
    if n not in state:
        visit(n, [n])
check(not cycle, "the include graph of src/ has a cycle: %s" % " -> ".join(cycle))
check(not edges.get("core", set()) - {"plan"}, "src/core includes %s (it may include src/plan only)" % sorted(edges.get("core", set())))
print("test_layout: %d passed, %d failed" % (passed, failed))
sys.exit(1 if failed else 0)
PY
