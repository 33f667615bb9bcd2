#!/usr/bin/env python3
"""ncu_sass.py - where a kernel's warps wait, by SASS line: the warp-stall
samples of an Nsight Compute SourceCounters export, totalled by stall reason,
listed for the most-sampled instructions, and summed over line ranges (a
kernel's prologue, main loop, epilogue, ...: find the boundaries in the top
list, e.g. the HGMMA lines and the first global load of the epilogue).

Make the export on the device machine (gpu_check.sh's ncu step with
NCU_SOURCE=1 does both):
    ncu --section SourceCounters --section WarpStateStats -k regex:NAME ... -o rep
    ncu -i rep.ncu-rep --page source --csv --print-source sass > NAME-sass.csv

Usage: dev/ncu_sass.py FILE.csv[.gz] [--top N] [--ranges a,b,c]
  --top N      the N instructions with the most samples (default 30)
  --ranges L   line numbers (0-based rows of the listing) that cut it into
               ranges; each range's share of all samples and its top stalls
Samples count every warp: a producer warp idling at a barrier counts as
much as a consumer warp in its main loop.
"""
import argparse
import collections
import csv
import gzip
import sys


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    # row 0 names the kernel, row 1 is the header
    hdr = rows[1]
    ix = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    recs = []
    for line, r in enumerate(rows[2:]):
        if len(r) < len(hdr):
            continue
        n = lambda k: int(r[ix[k]] or 0)
        recs.append((line, r[ix["Source"]].strip(), n("Warp Stall Sampling (All Samples)"),
                     {k[len("stall_"):]: n(k) for k in stalls}, n("Instructions Executed")))
    return rows[0][1] if len(rows[0]) > 1 else "?", recs


def top_stalls(counter, total, k):
    return ", ".join(f"{s} {v / total * 100:.1f}" for s, v in counter.most_common(k) if v)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--ranges", default="")
    a = ap.parse_args()
    kernel, recs = load(a.file)
    total = sum(r[2] for r in recs)
    if total == 0:
        sys.exit(f"{a.file}: no stall samples (was SourceCounters collected?)")
    allst = collections.Counter()
    for r in recs:
        allst.update(r[3])
    print(f"{kernel}\n{total} samples over {len(recs)} instructions; by stall (% of samples): "
          f"{top_stalls(allst, total, 10)}")
    if a.top:
        print(f"{'line':>5} {'share':>6} {'executed':>10}  instruction{'':60s}top stalls (samples)")
        for line, src, s, st, ex in sorted(sorted(recs, key=lambda r: -r[2])[:a.top]):
            why = ", ".join(f"{k} {v}" for k, v in sorted(st.items(), key=lambda kv: -kv[1])[:3] if v)
            print(f"{line:5d} {s / total * 100:5.1f}% {ex:10d}  {src[:70]:70s} {why}")
    if a.ranges:
        cuts = [0] + [int(c) for c in a.ranges.split(",")] + [len(recs)]
        for lo, hi in zip(cuts, cuts[1:]):
            sel = [r for r in recs if lo <= r[0] < hi]
            c = collections.Counter()
            for r in sel:
                c.update(r[3])
            print(f"lines [{lo}, {hi}): {sum(r[2] for r in sel) / total * 100:5.1f}% of samples; "
                  f"{top_stalls(c, total, 5)}")


if __name__ == "__main__":
    main()
