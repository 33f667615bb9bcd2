#!/usr/bin/env python3
"""padding.py - per cell of the issue's table (the presets of
harness/workload.c, M in 4096/8192/16384, TP2 or EP2): rank 0's expert
rows under a uniform routing draw per cell (each token picks topk distinct
experts, as comet_routing_draw does without skew, but from Python's RNG, so
the counts differ from comet's by a few percent and move with --seed), the
padding that 128-row blocks add (and what 64-row granularity would leave),
the GEMM time of valid and padded rows at a given rate, and the time to
stream rank 0's expert weights once from HBM. The FLOPs and weights assume
gated experts (gate, up and down: 3 x F_local x H a GEMM pair), as all four
presets are. An estimate for planning, not a measurement.

Usage: dev/padding.py [--rate TFLOPS] [--hbm TB/s] [--seed N]
(defaults 660 TFLOP/s on computed rows, between the 593 measured for
DeepSeek at M=4096 and the ~690 of large experts; 4.8 TB/s: H200 HBM3e)
"""
import argparse
import os
import random
import re


def presets():
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness", "workload.c")
    text = open(src).read()
    return [(m[0], *map(int, m[1:])) for m in re.findall(r'\{"([a-z0-9.-]+)", (\d+), (\d+), (\d+), (\d+)\}', text)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=660.0, help="GEMM TFLOP/s on computed (padded) rows (default 660)")
    ap.add_argument("--hbm", type=float, default=4.8, help="HBM TB/s")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    print("| model | M | layout | rows | padding (128) | padding (64) | GEMMs valid / padded ms | weights GB -> ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, hidden, ffn, experts, topk in presets():
        for m in (4096, 8192, 16384):
            for tp, ep in ((1, 2), (2, 1)):
                el, fl = experts // ep, ffn // tp
                count = [0] * experts
                for _ in range(m):
                    for e in rng.sample(range(experts), topk):
                        count[e] += 1
                c = count[:el]  # rank 0's experts (EP) or every expert's slice (TP)
                rows = sum(c)
                p128 = sum((x + 127) // 128 * 128 for x in c)
                p64 = sum((x + 63) // 64 * 64 for x in c)
                flop_per_row = 2 * hidden * 3 * fl  # GEMM0 (gate and up) and GEMM1
                wbytes = el * 3 * fl * hidden * 2
                print(f"| {name} | {m} | TP{tp} EP{ep} | {rows} | {100 * (p128 / rows - 1):.1f}% | "
                      f"{100 * (p64 / rows - 1):.1f}% | {rows * flop_per_row / a.rate / 1e9:.2f} / "
                      f"{p128 * flop_per_row / a.rate / 1e9:.2f} | {wbytes / 1e9:.2f} -> {wbytes / a.hbm / 1e9:.2f} |")


if __name__ == "__main__":
    main()
