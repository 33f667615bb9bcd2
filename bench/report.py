"""report.py - benchmark results (bench/results/) as markdown tables.

Reads PyTorch baseline files (one JSON document with "records", written by
torch_moe.py --json) and comet files (JSON lines, written by
`comet bench --json`). Prints the PyTorch table when only baselines are given;
with both, one row per configuration with each side's time, the speedup
(t_pytorch / t_comet, same inputs' shape, same machine) and the roofline
fraction of ../shared/docs/benchmarks.md, max(flops / GEMM peak, bytes / link rate) /
t_comet, i.e. max(TFLOP/s / peak, GB/s / link) per GPU, against measured
peaks on H200 (environment GEMM_PEAK_TFLOPS, default 804: cuBLAS dense
8192^3 on a cold H200, dev/gemm/NOTES.md; LINK_GBPS, default 348: one
direction of the NVLink pair, bench/link_bench.cu's best rate with SMs).
The last column is each GPU's mean SM clock during the row's call (`comet
bench` rows since bdc3fe2, NVML; over the timed forwards alone since
2607d6f): GEMM-bound rows move with it. Rows that record their timed
forwards ("iters": comet and torch_moe.py since the 16th session) pair
with a PyTorch row over as many, and a count other than the reference's 20
shows in the mode ("seq, 200 forwards"): short calls of a short layer run
before the GPU's power limit bites, long ones under it.
A comet row of a custom model (sizes moved off the preset's: "custom": 1,
rows since the cliux branch) is its own model, "custom (<preset>, hidden
H, ffn F, experts E, topk K)", paired with no baseline or reference cell.

With a reference file (bench/reference-issue5.json: {"reference": ...,
"rows": [...]}, the table of issue 5) it also prints, for each mode, the
README's grid (model x M, EP2 / TP2 cells: ms and speedup over the
reference) and the mean, geometric mean and range of those speedups over
the cells both have (uniform routing, no element wrong). A cell with
several rows of one mode (rounds of an A/B, variants the rows do not
record) shows their median and how many.

  python3 bench/report.py bench/results/baselines/2026-11-22-torch-*.json
  python3 bench/report.py bench/results/*/*.json bench/results/*/*.jsonl   (other benches' files skipped, named on stderr)
  python3 bench/report.py bench/reference-issue5.json bench/results/forward/<day>-forward-24cells-<machine>.jsonl
  python3 bench/report.py --help

Records of bench/torch_comet.py (comet's training step through Python,
"meta" and "records") go to a table of their own beside the C rows of the
same configuration, both timed from an idle GPU and back to back (comet
bench --train --back-to-back).

Training rows (`comet bench --train`: "train": 1; torch_moe.py --train:
"train": true) go to their own table, "Training steps": each side's
forward, backward and step ms (medians of the slowest rank's), the
speedup of the step (PyTorch step / comet step, same configuration and
timed count), comet's step rate (3x the forward's FLOPs) and both checks
(y, gradients); they never enter the forward's tables or grids.
"""
import json
import math
import os
import statistics
import sys

GEMM_PEAK_TFLOPS = float(os.environ.get("GEMM_PEAK_TFLOPS", "804"))
LINK_GBPS = float(os.environ.get("LINK_GBPS", "348"))


def load(paths):
    torch_rows, comet_rows, python_rows, reference, machines = [], [], [], [], set()
    for path in paths:
        with open(path) as f:
            text = f.read()
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            doc = None
        if isinstance(doc, dict) and doc.get("baseline") == "torch._grouped_mm":
            continue  # GEMM-only figures (bench/torch_grouped_mm.py), not layer times
        if isinstance(doc, dict) and "reference" in doc:
            reference += doc["rows"]
            machines.add(f"reference: {doc['reference']}")
            continue
        if isinstance(doc, dict) and "records" in doc and "meta" in doc:  # bench/torch_comet.py: comet via Python
            m = doc["meta"]
            machines.add(f"comet through Python: {m['gpus']}x {m['device']}, torch {m['torch']}, {m['date'][:10]}, "
                         f"commit {m['commit']}")
            python_rows += [r for r in doc["records"] if "model" in r]  # not the op's overhead a call
            continue
        if isinstance(doc, dict) and "records" in doc:
            m = doc["machine"]
            machines.add(f"{m['gpus']}x {m['gpu']}, driver {m['driver']}, CUDA {m['cuda']}, torch {m['torch']}, "
                         f"NCCL {m['nccl']}, {m['date']}, commit {m['commit']}")
            torch_rows += doc["records"]
        elif isinstance(doc, dict) and "baseline" not in doc:  # gemm_bench's, link_bench's: no layer rows
            print(f"report.py: {path}: not a layer's rows, skipped", file=sys.stderr)
        else:
            try:
                rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError:
                print(f"report.py: {path}: neither JSON nor JSON lines, skipped", file=sys.stderr)
                continue
            if not all(isinstance(r, dict) and "baseline" in r for r in rows):  # e.g. examples/train's logs
                print(f"report.py: {path}: not comet bench rows, skipped", file=sys.stderr)
                continue
            for r in rows:
                if r.get("custom"):  # sizes moved off the preset's: its own model, paired with no baseline
                    r["model"] = (f"custom ({r['model']}, hidden {r['hidden']}, ffn {r['ffn']}, "
                                  f"experts {r['experts']}, topk {r['topk']})")
                comet_rows.append(r)
                machines.add(f"comet {r['baseline']}, {r['date'][:10]}, commit {r['commit']}")
    return torch_rows, comet_rows, python_rows, reference, sorted(machines)


def key(r):
    """a configuration; training rows (comet bench --train, torch_moe.py --train: "train") pair only with each
    other"""
    return (r["model"], r["M"], r["tp"], r["ep"], r.get("skew", 0.0), bool(r.get("train")))


def train_tables(torch_rows, comet_rows):
    """training steps (forward + backward of one layer): comet's rows beside PyTorch's step, or PyTorch's alone"""
    tt = [r for r in torch_rows if r.get("train")]
    ct = [r for r in comet_rows if r.get("train")]
    if not tt and not ct:
        return
    print("\nTraining steps (forward + backward of one layer, ms; TFLOP/s: 3x the forward's FLOPs over the step):\n")
    if not ct:
        print("| model | M | TP | EP | skew | forward ms | backward ms | step ms | TFLOP/s/GPU | check rel err (y, grads) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in sorted(tt, key=key):
            print(f"| {r['model']} | {r['M']} | {r['tp']} | {r['ep']} | {r['skew']} | {r['fwd_ms']:.3f} | "
                  f"{r['bwd_ms']:.3f} | {r['ms']:.3f} | {r.get('tflops', 0):.0f} | "
                  f"{r['check_rel_err']:.1e}, {r.get('grad_rel_err', 0):.1e} |")
        return
    print("| model | M | TP | EP | skew | save | mode | comet fwd ms | comet bwd ms | comet step ms | PyTorch fwd ms | "
          "PyTorch bwd ms | PyTorch step ms | speedup | comet TFLOP/s/GPU | saved MiB: comet / PyTorch | "
          "check y (wrong/checked) | gradients (wrong/checked) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(ct, key=lambda r: (key(r), r.get("save", ""), r.get("n_comm", 0))):
        same = [b for b in tt if key(b) == key(r) and b.get("iters", 20) == r.get("iters", 20)]
        b = same[-1] if same and r.get("skew", 0.0) == 0 else None
        tb = (f"{b['fwd_ms']:.3f} | {b['bwd_ms']:.3f} | {b['ms']:.3f} | {b['ms'] / r['ms']:.2f}x" if b
              else "- | - | - | -")
        mode = mode_of(r) + (f": {ran_of(r)}" if r.get("tuned") else "")
        if "fwd_n_comm" in r and r.get("gemm") != "cpu":  # n_comm is the backward's; the training forward's its own
            mode += f" (forward: {ran_of(dict(r, n_comm=r['fwd_n_comm']))})"
        mib = lambda row: f"{row['saved_bytes'] / 2**20:.1f}" if row and "saved_bytes" in row else "-"
        print(f"| {r['model']} | {r['M']} | {r['tp']} | {r['ep']} | {r['skew']} | {r.get('save', 'activations')} | "
              f"{mode} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {r['ms']:.3f} | {tb} | {r['rate']:.0f} | "
              f"{mib(r)} / {mib(b)} | {r['wrong']}/{r['checked']} | {r.get('grad_wrong', 0)}/{r.get('grad_checked', 0)} |")


def python_table(python_rows, comet_rows):
    """the training step through Python (bench/torch_comet.py) beside the C calls' (comet bench --train), each
    timed from an idle GPU and back to back (torch_comet.py's second figure, comet's --back-to-back rows): the
    median of each side's rows of a configuration (rounds of a call), "-" where a side has none"""
    if not python_rows:
        return
    ct = [r for r in comet_rows if r.get("train") and not r.get("skew")]

    def med(v):
        return statistics.median(v) if v else None

    def cell(a, b):
        return (f"{a:.3f} | {b:.3f} | {100 * (b / a - 1):+.1f}%" if a and b else
                f"{a:.3f} | - | -" if a else f"- | {b:.3f} | -" if b else "- | - | -")

    def key(r, m):  # a configuration: Python rows name M "tokens", the C rows "M"
        return (r["model"], r[m], r["tp"], r["ep"], r.get("save", "activations"))

    print("\nThe training step through Python (comet.torch) against the C calls (ms, medians of the rows; "
          "+: Python slower):\n")
    print("| model | M | TP | EP | save | C from an idle GPU | Python | over C | C back to back | Python | over C "
          "| host ms a step back to back: C / Python | rows |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in sorted({key(r, "tokens") for r in python_rows}):
        py = [r for r in python_rows if key(r, "tokens") == c]
        cs = [r for r in ct if key(r, "M") == c]
        c_idle = med([r["ms"] for r in cs if not r.get("back_to_back")])
        c_b2b = med([r["ms"] for r in cs if r.get("back_to_back")])
        p_idle = med([r["step_ms"] for r in py])
        p_b2b = med([r["step_ms_back_to_back"] for r in py if "step_ms_back_to_back" in r])  # rows since 2026-11-28
        c_host = med([r["host_ms"] for r in cs if r.get("back_to_back") and "host_ms" in r])
        p_host = med([r["host_ms_back_to_back"] for r in py if "host_ms_back_to_back" in r])
        host = " / ".join(f"{v:.3f}" if v else "-" for v in (c_host, p_host))
        print(f"| {c[0]} | {c[1]} | {c[2]} | {c[3]} | {c[4]} | {cell(c_idle, p_idle)} | {cell(c_b2b, p_b2b)} | "
              f"{host} | {len(cs)} C, {len(py)} Python |")


def ran_of(r):
    """the protocol that ran: seq (the sequential chain) or the overlapped mode's n_comm; the CPU
    engine (gemm "cpu"), which always overlaps its workers, as itself"""
    if r.get("gemm") == "cpu":
        return f"CPU engine, n_comm {r['n_comm']}" if r.get("n_comm", 0) > 0 else "CPU engine"
    return f"n_comm {r['n_comm']}" if r.get("n_comm", 0) > 0 else "seq"


def mode_of(r):
    """ran_of, or auto where the tuner picked it (a run without --n-comm: `tuned`, rows since ed4c0bd),
    and the knobs that change the path"""
    mode = "auto" if r.get("tuned") else ran_of(r)
    mode += " ce" if r.get("ce") else ""  # the copy-engine dispatch
    mode += " partials" if r.get("partials") else ""  # the combine by partials
    mode += " gather" if r.get("gather") else ""  # GEMM0 by gather
    mode += ", graph" if r.get("graph") else ""
    # timed forwards other than the reference's 20 (rows since the 16th session record them): a
    # short call of a short layer runs before the GPU's power limit bites, a long one under it
    mode += f", {r['iters']} forwards" if r.get("iters", 20) != 20 else ""
    return mode


def grids(comet_rows, reference):
    """the README's grid for each mode: model x M, cells 'EP2 / TP2' (ms, speedup over the reference)"""
    ref = {(r["model"], r["M"], r["tp"], r["ep"]): r["ms"] for r in reference}
    models = list(dict.fromkeys(r["model"] for r in reference))
    tokens = sorted({r["M"] for r in reference})
    layouts = sorted({(r["tp"], r["ep"]) for r in reference})  # (1, 2) then (2, 1)
    # seq, auto, n_comm 8, n_comm 16
    for mode in sorted({mode_of(r) for r in comet_rows}, key=lambda m: (len(m), m)):
        rows, overlapped = {}, set()  # overlapped: auto cells where the tuner picked the overlapped mode ("ov")
        for r in comet_rows:
            if mode_of(r) == mode and r.get("skew", 0.0) == 0 and r.get("wrong", 0) == 0:
                rows.setdefault((r["model"], r["M"], r["tp"], r["ep"]), []).append(r["ms"])
                if r.get("tuned") and r.get("n_comm", 0) > 0:
                    overlapped.add((r["model"], r["M"], r["tp"], r["ep"]))
        speedups, by_model = [], {}
        lines = []
        for m in models:
            cells = []
            for t in tokens:
                parts = []
                for lay in layouts:
                    ms, b = rows.get((m, t) + lay), ref.get((m, t) + lay)
                    if ms and b:
                        med = statistics.median(ms)
                        speedups.append(b / med)
                        by_model.setdefault(m, []).append(b / med)
                        n = f", median of {len(ms)}" if len(ms) > 1 else ""
                        ov = ", ov" if (m, t) + lay in overlapped else ""
                        parts.append(f"{med:.2f} ms ({b / med:.2f}x{n}{ov})")
                    else:
                        parts.append("-")
                cells.append(" / ".join(parts))
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        if not speedups:
            continue
        print(f"\n{mode}, against the reference:\n")
        print("| model | " + " | ".join(f"M={t}" + (" (" + " / ".join(f"TP{a},EP{b}" for a, b in layouts) + ")"
                                                   if i == 0 else "") for i, t in enumerate(tokens)) + " |")
        print("|---|" + "---|" * len(tokens))
        print("\n".join(lines))
        geo = math.exp(sum(math.log(x) for x in speedups) / len(speedups))
        print(f"\nMean speedup over {len(speedups)} cells: {sum(speedups) / len(speedups):.2f}x (geometric {geo:.2f}x); "
              f"lowest {min(speedups):.2f}x, highest {max(speedups):.2f}x; "
              + ", ".join(f"{m} {min(v):.2f}-{max(v):.2f}x" for m, v in by_model.items()) + ".")


def main(paths):
    torch_rows, comet_rows, python_rows, reference, machines = load(paths)
    all_torch, all_comet = torch_rows, comet_rows
    # training rows have their own table (train_tables); the forward's tables and grids take the others
    torch_rows = [r for r in torch_rows if not r.get("train")]
    comet_rows = [r for r in comet_rows if not r.get("train")]
    if not comet_rows and not torch_rows:
        pass
    elif not comet_rows:
        print("| model | M | TP | EP | skew | layer ms | GEMM ms | GEMM TFLOP/s | GEMM share | check rel err |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in sorted(torch_rows, key=key):
            print(f"| {r['model']} | {r['M']} | {r['tp']} | {r['ep']} | {r['skew']} | {r['ms']:.3f} | "
                  f"{r['gemm_ms']:.3f} | {r['gemm_tflops']:.0f} | {100 * r['gemm_share']:.0f}% | "
                  f"{r['check_rel_err']:.1e} |")
    else:
        def baseline_of(r):
            """the PyTorch row of r's configuration (the last given); where the rows record their timed
            forwards (torch_moe.py and comet since the 16th session; older rows: 20), one over as many"""
            same = [b for b in torch_rows if key(b) == key(r)]
            if any("iters" in b for b in same):
                same = [b for b in same if b.get("iters", 20) == r.get("iters", 20)]
            return same[-1] if same else None

        # mode: seq (the sequential chain) or the overlapped mode's n_comm (ce: copy-engine dispatch),
        # "auto: ..." where the tuner picked it; comm hidden only where --comm-hidden measured it
        print("| model | M | TP | EP | skew | mode | comet ms | PyTorch ms | speedup | comet TFLOP/s/GPU | "
              "roofline | comm hidden | net | over GEMM-only | check (wrong/checked) | SM MHz |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        within = []  # rows measured with --comm-hidden whose whole layer is within 5% of its GEMM-only side
        for r in sorted(comet_rows, key=lambda r: (key(r), r.get("n_comm", 0))):
            b = baseline_of(r) if r.get("skew", 0.0) == 0 else None  # the baseline runs uniform routing only
            tb = f"{b['ms']:.3f}" if b else "-"
            sp = f"{b['ms'] / r['ms']:.2f}x" if b else "-"
            mode = mode_of(r) + (f": {ran_of(r)}" if r.get("tuned") else "")
            # -1: not measured (no --comm-hidden); below 0 is a measurement: the layer slower than both parts
            hidden = f"{100 * r['comm_hidden']:.0f}%" if r.get("comm_hidden", -1) != -1 else "-"
            # net of the steps every side keeps (the fourth side, rows since session 8; else "-")
            net = f"{100 * r['comm_hidden_net']:.0f}%" if r.get("comm_hidden_net", -1) != -1 else "-"
            roof = max(r["rate"] / GEMM_PEAK_TFLOPS, r.get("link_gbps", 0.0) / LINK_GBPS)
            # the whole layer against the same kernel's GEMM-only side, both from the interleaved sides
            # (sides_ms: gemm only, comm only, whole, neither; all 0 without --comm-hidden)
            sides = r.get("sides_ms") or [0.0] * 4
            over = f"{100 * (sides[2] / sides[0] - 1):+.1f}%" if sides[0] > 0 else "-"
            if sides[0] > 0:
                within.append((sides[2] <= 1.05 * sides[0], f"{r['model']} {r['M']} TP{r['tp']} EP{r['ep']}"
                               + (f" skew {r['skew']}" if r.get("skew", 0) else "")))
            # the GPUs' mean SM clocks during the call (rows since bdc3fe2; NVML's GPU order)
            mhz = "/".join(f"{m:.0f}" for m in r["sm_mhz"]) if r.get("sm_mhz") else "-"
            print(f"| {r['model']} | {r['M']} | {r['tp']} | {r['ep']} | {r['skew']} | {mode} | {r['ms']:.3f} | {tb} | "
                  f"{sp} | {r['rate']:.0f} | {100 * roof:.0f}% | {hidden} | {net} | {over} | "
                  f"{r['wrong']}/{r['checked']} | {mhz} |")
        if within:
            ok = sorted({name for good, name in within if good})
            print(f"\nWithin 5% of GEMM-only (the target): {sum(g for g, _ in within)} of {len(within)} rows measured "
                  f"with --comm-hidden" + (f": {', '.join(ok)}." if ok else "."))
        if reference:
            grids(comet_rows, reference)
    train_tables(all_torch, all_comet)
    python_table(python_rows, all_comet)
    print()
    for m in machines:
        print(f"- {m}")


USAGE = """usage: python3 bench/report.py [REFERENCE.json] FILE...

Benchmark results as markdown tables: PyTorch baselines (torch_moe.py --json),
comet rows (comet bench --json FILE, JSON lines) and, with a reference table
(bench/reference-issue5.json), the README's grid against it.

  python3 bench/report.py bench/results/baselines/<day>-torch-*.json
  python3 bench/report.py bench/results/*/*.json bench/results/*/*.jsonl   (other benches' files skipped, named on stderr)
  python3 bench/report.py bench/reference-issue5.json results.jsonl

environment: GEMM_PEAK_TFLOPS (default 804) and LINK_GBPS (default 348), the
peaks of the roofline column."""


if __name__ == "__main__":
    args = sys.argv[1:]
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        sys.exit(0)
    if not args or any(a.startswith("-") for a in args):
        bad = [a for a in args if a.startswith("-")]
        print((f"report.py: unknown option {bad[0]}\n" if bad else "") + USAGE, file=sys.stderr)
        sys.exit(2)
    missing = [a for a in args if not os.path.isfile(a)]
    if missing:
        print(f"report.py: no such file: {missing[0]}", file=sys.stderr)
        sys.exit(2)
    main(args)
