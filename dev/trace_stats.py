#!/usr/bin/env python3
"""trace_stats.py - numbers from `comet bench --trace` files (Chrome-trace JSON):
per rank and step kind, how many intervals, their median and 90th-percentile
length, the busy time summed over workers, and the span from the first begin
to the last end. Pull intervals are split by their aux field: on the CUDA
path "pull aux=-1" is a dispatch batch (sequential chain, or the overlapped
mode's local copies) and "pull aux=1" a pass of the overlapped mode's
remote pulls, "aux=2" and "aux=3" that pass's lookup and copy (the rest of
it is the count; src/trace/trace.h); on the CPU engine aux is a stage. The
CUDA path's plan comes in three intervals (routing copy, the builder's
count and fill-and-finish kernels, each with the launch gap before it;
older traces have four: fill and finish apart). With two or more files
(e.g. the same call under two settings, same seed) each row shows every
file's figures side by side, so a change in the remote pulls' pass length is
a change in their rate (the passes move the same rows).

The writer's summary per rank comes first (otherData: layer time, GEMM and
communication busy time, the share of communication hidden behind GEMMs;
docs/trace.md), then a timeline per file and rank: each step's first begin and last
end, and the gap before it (launch gaps and waits of the sequential chain).

  dev/trace_stats.py A.json [B.json ...]
"""
import json
import statistics
import sys

# the CUDA path's plan intervals by index (src/trace/trace.h); older traces, with an index 3, had
# the fill and the finish apart (and index 3 the whole serial builder)
PLAN_STEPS = {0: "routing copy", 1: "count", 2: "fill+finish"}
PLAN_STEPS_OLD = {0: "routing copy", 1: "count", 2: "fill", 3: "finish (or the serial builder)"}


def load(path):
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    # steps by args.kind (the short id: pull, gemm0, ...); the event names are the trainer's titles
    # ("dispatch (pull token rows)", ...) since they were renamed, the bare ids before
    old = any(e["args"]["kind"] == "plan" and e["args"].get("index") == 3 for e in events)
    groups = {}
    for e in events:
        kind = e["args"]["kind"]
        if kind == "pull":
            kind = "pull aux=%d" % e["args"]["aux"]
        elif kind == "plan" and e["args"]["index"] >= 0:
            kind = "plan %d %s" % (e["args"]["index"], (PLAN_STEPS_OLD if old else PLAN_STEPS).get(e["args"]["index"], ""))
        groups.setdefault((e["pid"], kind), []).append((e["ts"], e["dur"]))
    return groups


def stats(items):
    durs = sorted(d for _, d in items)
    p90 = durs[min(len(durs) - 1, int(0.9 * len(durs)))]
    span = max(t + d for t, d in items) - min(t for t, _ in items)
    return "%5d %9.1f %9.1f %10.1f %9.1f" % (len(durs), statistics.median(durs), p90, sum(durs), span)


def timeline(path, table):
    """Per rank, each step's first begin and last end (us from the rank's
    first event) in order of first begin, and the gap since the latest end of
    the steps before it (negative: they overlap)."""
    print("timeline of %s (us from each rank's first event; wait intervals left out)" % path)
    for rank in sorted(set(r for r, _ in table)):
        steps = [(min(t for t, _ in v), max(t + d for t, d in v), k) for (r, k), v in table.items()
                 if r == rank and k != "wait"]
        steps.sort()
        t0, last = steps[0][0], None
        for b, e, k in steps:
            gap = "" if last is None else "%+9.1f" % (b - last)
            print("  r%d %-22s %9.1f %9.1f %9s" % (rank, k, b - t0, e - t0, gap))
            last = e if last is None else max(last, e)


def summary(path):
    """The writer's per-rank summary (otherData.ranks; traces since it was added)."""
    with open(path) as f:
        ranks = json.load(f).get("otherData", {}).get("ranks", [])
    for r in ranks:
        hid = "-" if r["comm_hidden"] is None else "%.1f%%" % (100 * r["comm_hidden"])
        print("  r%d layer %.1f us (starts +%.1f) | GEMM busy %.1f us | comm busy %.1f us, hidden %s"
              % (r["rank"], r["layer_us"], r["start_us"], r["gemm_busy_us"], r["comm_busy_us"], hid))


def main(paths):
    if not paths:
        sys.exit(__doc__.strip())
    for p in paths:
        summary(p)
    tables = [load(p) for p in paths]
    for p, t in zip(paths, tables):
        timeline(p, t)
    keys = sorted(set(k for t in tables for k in t))
    head = "%5s %9s %9s %10s %9s" % ("n", "med us", "p90 us", "busy us", "span us")
    print("%-26s " % "rank / step" + " | ".join(head for _ in paths))
    for i, p in enumerate(paths):
        print("  file %d: %s" % (i + 1, p))
    for rank, kind in keys:
        cells = [stats(t[(rank, kind)]) if (rank, kind) in t else "%-45s" % "  -" for t in tables]
        print("%-26s " % ("r%d %s" % (rank, kind)) + " | ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:])
