"""report.py - turn benchmark JSON files (bench/results/*.json) into one
markdown table: configuration, layer ms, expert-GEMM ms, TFLOP/s and share.

  python3 bench/report.py bench/results/2026-11-22-torch-h200x2-*.json > table.md
"""
import json
import sys


def main(paths):
    rows, machines = [], []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        m = doc["machine"]
        machines.append(f"{m['gpus']}x {m['gpu']}, driver {m['driver']}, CUDA {m['cuda']}, torch {m['torch']}, "
                        f"NCCL {m['nccl']}, {m['date']}, commit {m['commit']}")
        for r in doc["records"]:
            rows.append((doc["baseline"], r))
    print("| baseline | model | M | TP | EP | skew | layer ms | GEMM ms | GEMM TFLOP/s | GEMM share | check rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for base, r in sorted(rows, key=lambda br: (br[1]["model"], br[1]["M"], br[1]["tp"], br[1]["ep"])):
        print(f"| {base} | {r['model']} | {r['M']} | {r['tp']} | {r['ep']} | {r['skew']} | {r['ms']:.3f} | "
              f"{r['gemm_ms']:.3f} | {r['gemm_tflops']:.0f} | {100 * r['gemm_share']:.0f}% | {r['check_rel_err']:.1e} |")
    print()
    for m in sorted(set(machines)):
        print(f"- {m}")


if __name__ == "__main__":
    main(sys.argv[1:])
