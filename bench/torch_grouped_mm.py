"""torch_grouped_mm.py - speed of PyTorch's torch._grouped_mm on the per-GPU
shapes of bench/gemm_bench.cu: the MoE model presets at M tokens, EP = 1 (all
experts on the one GPU), TP = 1, uniform random routing (each token picks
topk distinct experts), bf16, rows grouped by expert (offsets form: 2D A, 3D B,
int32 cumulative row counts), called as bench/torch_moe.py calls it.

  GEMM0:      (rows x H) @ (H x 2F) per expert, W1 = [gate; up] (E, 2F, H);
              timed alone and followed by gated SiLU silu(gate) * up in fp32
              torch ops, back to bf16 (as torch_moe.py)
  GEMM1:      (rows x F) @ (F x H) per expert, W2 (E, H, F)
TFLOP/s count valid rows only (rows = M * topk): GEMM0 2*rows*H*2F, GEMM1
2*rows*F*H. Times: CUDA events, --warmup runs, then the median of --iters
rounds (GEMM0, GEMM0 + SiLU, GEMM1 interleaved in each round). A shape that
runs out of GPU memory is reported as OOM and skipped. Every shape is checked
on sampled rows of the first and last non-empty expert against fp32 matmuls.

Run on one GPU (Hopper or newer; torch with torch._grouped_mm):
  python3 bench/torch_grouped_mm.py --tokens 8192
  python3 bench/torch_grouped_mm.py --models qwen2-moe,deepseek-v3 --tokens 4096,8192,16384 --json out.json
Prints a markdown table; --json writes {"machine": ..., "baseline":
"torch._grouped_mm", "records": [...]} (machine as torch_moe.py writes it;
commit from $COMET_COMMIT).
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from torch_moe import MODELS, describe  # the same presets and machine record as the layer baseline


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated presets (default: all four)")
    p.add_argument("--tokens", default="8192", help="comma-separated M (tokens on the GPU)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default="", help="write the records and the machine here")
    return p.parse_args()


def gemm0(a, w1, offs):
    return torch._grouped_mm(a, w1.transpose(1, 2), offs=offs)


def gemm0_act(a, w1, offs, f):
    g = torch._grouped_mm(a, w1.transpose(1, 2), offs=offs)
    return (F.silu(g[:, :f].float()) * g[:, f:].float()).to(torch.bfloat16)


def gemm1(h, w2, offs):
    return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)


def check(a, w1, h, w2, counts, offs, f, n=16):
    """Largest relative error (Frobenius, per GEMM) on up to n rows of the first and
    last non-empty expert: gated-SiLU GEMM0 and GEMM1 against fp32 matmuls."""
    got_h, got_o = gemm0_act(a, w1, offs, f), gemm1(h, w2, offs)
    cnt = counts.tolist()
    ends = offs.tolist()
    nz = [e for e, c in enumerate(cnt) if c > 0]
    worst = 0.0
    for e in sorted({nz[0], nz[-1]}):
        r0 = ends[e] - cnt[e]
        r1 = min(ends[e], r0 + n)
        g = a[r0:r1].float() @ w1[e].float().t()
        want_h = F.silu(g[:, :f]) * g[:, f:]
        want_o = h[r0:r1].float() @ w2[e].float().t()
        for got, want in ((got_h[r0:r1].float(), want_h), (got_o[r0:r1].float(), want_o)):
            worst = max(worst, float((got - want).norm() / want.norm().clamp_min(1e-30)))
    return worst


def run_shape(name, hidden, ffn, e_num, topk, m, w1, w2, args, device):
    gen = torch.Generator(device=device).manual_seed(1000 * args.seed + m)
    # uniform routing: topk distinct experts per token (top-k of uniform noise)
    idx = torch.rand(m, e_num, device=device, generator=gen).topk(topk, dim=1).indices
    counts = torch.bincount(idx.reshape(-1), minlength=e_num)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = m * topk
    a = torch.randn(rows, hidden, device=device, generator=gen, dtype=torch.bfloat16)
    h = torch.randn(rows, ffn, device=device, generator=gen, dtype=torch.bfloat16)
    err = check(a, w1, h, w2, counts, offs, ffn)
    ops = (lambda: gemm0(a, w1, offs), lambda: gemm0_act(a, w1, offs, ffn), lambda: gemm1(h, w2, offs))
    for _ in range(args.warmup):
        for op in ops:
            op()
    torch.cuda.synchronize()
    times = [[], [], []]
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for _ in range(args.iters):
        for k, op in enumerate(ops):
            ev[0].record()
            op()
            ev[1].record()
            ev[1].synchronize()
            times[k].append(ev[0].elapsed_time(ev[1]))
    ms = [statistics.median(t) for t in times]
    fl0, fl1 = 2.0 * rows * hidden * 2 * ffn, 2.0 * rows * ffn * hidden
    return {"model": name, "M": m, "ep": 1, "tp": 1, "topk": topk, "experts": e_num, "hidden": hidden, "ffn": ffn,
            "rows": rows, "min_expert_rows": int(counts.min()), "max_expert_rows": int(counts.max()),
            "gemm0_ms": ms[0], "gemm0_act_ms": ms[1], "gemm1_ms": ms[2],
            "gemm0_tflops": fl0 / (ms[0] * 1e9), "gemm0_act_tflops": fl0 / (ms[1] * 1e9),
            "gemm1_tflops": fl1 / (ms[2] * 1e9), "iters": args.iters, "check_rel_err": err}


def is_oom(exc):
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc)


def weights(e_num, hidden, ffn, device):
    """W1 (E, 2F, H): rows [0, F) gate, [F, 2F) up; W2 (E, H, F); drawn in bf16."""
    gen = torch.Generator(device=device).manual_seed(1234)
    w1 = torch.randn(e_num, 2 * ffn, hidden, device=device, generator=gen, dtype=torch.bfloat16)
    w1.mul_(hidden ** -0.5)
    w2 = torch.randn(e_num, hidden, ffn, device=device, generator=gen, dtype=torch.bfloat16)
    w2.mul_(ffn ** -0.5)
    return w1, w2


def main():
    args = parse()
    if not hasattr(torch, "_grouped_mm"):
        raise SystemExit(f"torch {torch.__version__} has no torch._grouped_mm")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    tokens = [int(v) for v in args.tokens.split(",")]
    records = []
    for name in args.models.split(","):
        hidden, ffn, e_num, topk = MODELS[name]
        w1 = w2 = rec = None
        try:
            w1, w2 = weights(e_num, hidden, ffn, device)
        except RuntimeError as exc:
            if not is_oom(exc):
                raise
        if w1 is None:  # outside the except block: its traceback no longer holds tensors
            torch.cuda.empty_cache()
            print(f"{name}: OOM allocating the weights, skipped", flush=True)
            records += [{"model": name, "M": m, "error": "out of memory (weights)"} for m in tokens]
            continue
        for m in tokens:
            rec = None
            try:
                rec = run_shape(name, hidden, ffn, e_num, topk, m, w1, w2, args, device)
            except RuntimeError as exc:
                if not is_oom(exc):
                    raise
            if rec is None:
                torch.cuda.empty_cache()
                print(f"{name} M={m}: OOM, skipped", flush=True)
                records.append({"model": name, "M": m, "error": "out of memory"})
                continue
            records.append(rec)
            print(f"{name:14s} M={m:6d}  gemm0 {rec['gemm0_ms']:8.3f} ms  +act {rec['gemm0_act_ms']:8.3f} ms  "
                  f"gemm1 {rec['gemm1_ms']:8.3f} ms  check rel err {rec['check_rel_err']:.2e}", flush=True)
            assert rec["check_rel_err"] < 2e-2, f"{name} M={m}: relative error {rec['check_rel_err']} against fp32"
        del w1, w2
        torch.cuda.empty_cache()
    mach = describe(1)
    print(f"\ntorch._grouped_mm, {mach['gpu']}, torch {mach['torch']}, CUDA {mach['cuda']}, EP=1 TP=1, "
          f"uniform routing, bf16, median of {args.iters}\n")
    print("| model | M | GEMM0 ms | GEMM0+act ms | GEMM0 TFLOP/s | GEMM1 ms | GEMM1 TFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in records:
        if "error" in r:
            print(f"| {r['model']} | {r['M']} | OOM | OOM | - | OOM | - |")
        else:
            print(f"| {r['model']} | {r['M']} | {r['gemm0_ms']:.3f} | {r['gemm0_act_ms']:.3f} | "
                  f"{r['gemm0_tflops']:.1f} | {r['gemm1_ms']:.3f} | {r['gemm1_tflops']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": mach, "baseline": "torch._grouped_mm", "records": records}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
