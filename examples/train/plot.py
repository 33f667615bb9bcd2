#!/usr/bin/env python3
"""plot.py - the curves of train.py runs (their --json-log JSON lines), side by side:

    python examples/train/plot.py comet.jsonl torch.jsonl -o plots/

writes plots/loss.png (train loss of every run, thin, with its moving
average, and validation loss as markers, on one figure) and plots/speed.png
(step time and tokens/s a step, with each run's median after warm-up in the
legend), and prints a summary table. Each run is labelled by its experts
backend (comet / torch) unless --labels says otherwise. Needs matplotlib
(pip install matplotlib)."""

import argparse
import json
import os
import statistics
import sys


def read(path):
    recs = [json.loads(line) for line in open(path) if line.strip()]
    head = next((r for r in recs if r.get("type") == "header"), {})
    train = [r for r in recs if r.get("type") == "train"]
    val = [r for r in recs if r.get("type") == "val"]
    return head, train, val


def smooth(v, n):
    out, acc = [], 0.0
    for i, x in enumerate(v):
        acc += x
        if i >= n:
            acc -= v[i - n]
        out.append(acc / min(i + 1, n))
    return out


def agreement(a, b):
    """Two runs' train losses step by step and their validation losses: a line."""
    la, lb = [r["loss"] for r in a[1]], [r["loss"] for r in b[1]]
    n = min(len(la), len(lb))
    if not n:
        return "no common steps"
    d = [abs(x - y) for x, y in zip(la[:n], lb[:n])]
    last = d[-50:]
    va, vb = {r["step"]: r["val_loss"] for r in a[2]}, {r["step"]: r["val_loss"] for r in b[2]}
    common = sorted(set(va) & set(vb))
    vals = ", ".join("%d: %.4f" % (s, abs(va[s] - vb[s])) for s in common)
    return "max %.4f over %d steps (first 5: %.2e), mean %.4f over the last %d; validation %s" % (
        max(d), n, max(d[:5]), sum(last) / len(last), len(last), vals or "-")


def bitwise(a, b):
    """Two runs of the same configuration, step by step: are their losses and gradient norms the same bits?"""
    n = min(len(a[1]), len(b[1]))
    for ra, rb in zip(a[1][:n], b[1][:n]):
        for key in ("loss", "grad_norm"):
            if ra.get(key) != rb.get(key):
                return "not bitwise: step %d's %s differs (%r against %r), %d common steps" % (
                    ra["step"], key, ra.get(key), rb.get(key), n)
    va, vb = [r["val_loss"] for r in a[2]], [r["val_loss"] for r in b[2]]
    m = min(len(va), len(vb))
    if va[:m] != vb[:m]:
        return "train steps bitwise over %d steps, validation not" % n
    return "bitwise equal: loss and gradient norm over %d steps%s" % (n, ", validation at %d points" % m if m else "")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0].split(" - ", 1)[1])
    p.add_argument("logs", nargs="+", help="train.py --json-log files (comet's and torch's)")
    p.add_argument("-o", "--out", default="plots", help="output folder (default plots/)")
    p.add_argument("--labels", help="comma-separated labels, one a log")
    p.add_argument("--smooth", type=int, default=0, help="moving-average window (default: steps / 20)")
    args = p.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot.py: needs matplotlib (pip install matplotlib)")
    runs = [read(f) for f in args.logs]
    labels = args.labels.split(",") if args.labels else [
        "%s%s (%s)" % (h.get("experts", os.path.basename(f)), ", split K" if h.get("torch_split_k") else "",
                       h.get("config_name", "?")) for f, (h, _, _) in zip(args.logs, runs)]
    os.makedirs(args.out, exist_ok=True)
    title = ", ".join(sorted({"%s, %d rank(s), %s" % (h.get("config_name"), h.get("world", 1), h.get("device"))
                              for h, _, _ in runs}))

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for (head, train, val), label, color in zip(runs, labels, ["C0", "C1", "C2", "C3", "C4"]):
        steps = [r["step"] for r in train]
        loss = [r["loss"] for r in train]
        n = args.smooth or max(1, len(loss) // 20)
        ax.plot(steps, loss, color=color, alpha=0.3, lw=0.8)
        ax.plot(steps, smooth(loss, n), color=color, lw=1.6, label="%s train (avg of %d)" % (label, n))
        if val:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", color=color, ms=5,
                    label="%s validation" % label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats a byte)")
    ax.set_title("loss: " + title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "loss.png"), dpi=120)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    print("%-24s %6s %10s %12s %12s %8s %10s" % ("run", "steps", "final", "final val", "median ms", "tok/s",
                                                 "MFU"))
    for (head, train, val), label, color in zip(runs, labels, ["C0", "C1", "C2", "C3", "C4"]):
        steps = [r["step"] for r in train]
        ms = [r["step_ms"] for r in train]
        tps = [r["tokens_per_s"] for r in train]
        warm = ms[min(len(ms) - 1, max(1, len(ms) // 10)):]
        med = statistics.median(warm)
        mfu = statistics.median([r["mfu"] for r in train][len(ms) - len(warm):])
        a1.plot(steps, ms, color=color, lw=1, label="%s: median %.1f ms" % (label, med))
        a2.plot(steps, tps, color=color, lw=1, label="%s: median %.0f tok/s, MFU %.1f%%" % (
            label, head.get("tokens_per_step", 0) / med * 1e3, 100 * mfu))
        print("%-24s %6d %10.4f %12s %12.1f %8.0f %9.1f%%" % (
            label[:24], len(train), train[-1]["loss"], "%.4f" % val[-1]["val_loss"] if val else "-", med,
            head.get("tokens_per_step", 0) / med * 1e3, 100 * mfu))
    # the pair compared: two runs, or (with a control run) comet's and the plain PyTorch run
    kind = [("torch-splitk" if h.get("torch_split_k") else h.get("experts")) for h, _, _ in runs]
    pair = (0, 1) if len(runs) == 2 else (kind.index("comet"), kind.index("torch")) if {
        "comet", "torch"} <= set(kind) else None
    if pair and runs[pair[0]][1] and runs[pair[1]][1]:
        a, b = runs[pair[0]][1], runs[pair[1]][1]
        n = min(len(a), len(b))
        wa = [r["step_ms"] for r in a[n // 10:n]]
        wb = [r["step_ms"] for r in b[n // 10:n]]
        if wa and wb:
            print("step time %s / %s: %.3f (speedup of %s: %.2fx)" % (
                labels[pair[1]], labels[pair[0]], statistics.median(wb) / statistics.median(wa), labels[pair[0]],
                statistics.median(wb) / statistics.median(wa)))
    # how far runs drift apart: comet against PyTorch, and PyTorch against its control (another summation
    # order: the rounding noise alone)
    for x, y in (("comet", "torch"), ("torch", "torch-splitk")):
        if x in kind and y in kind:
            print("loss |%s - %s|: %s" % (x, y, agreement(runs[kind.index(x)], runs[kind.index(y)])))
    # the same backend twice (run_2gpu.sh's comet-rerun): is a rerun the same bits?
    for i, x in enumerate(kind):
        if x in kind[:i]:
            print("rerun of %s (%s, %s): %s" % (x, args.logs[kind.index(x)], args.logs[i],
                                               bitwise(runs[kind.index(x)], runs[i])))
    for a, y in ((a1, "step time (ms)"), (a2, "tokens/s (all ranks)")):
        a.set_xlabel("step")
        a.set_ylabel(y)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    a1.set_yscale("log")
    fig.suptitle("speed: " + title)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "speed.png"), dpi=120)
    plt.close(fig)
    print("wrote %s and %s" % (os.path.join(args.out, "loss.png"), os.path.join(args.out, "speed.png")))


if __name__ == "__main__":
    main()
