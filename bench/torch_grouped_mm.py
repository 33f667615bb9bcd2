"""torch_grouped_mm.py - speed of PyTorch's torch._grouped_mm on the per-GPU
shapes of bench/gemm_bench.cu: the MoE model presets at M tokens, EP = 1 (all
experts on the one GPU), TP = 1, uniform random routing (each token picks
topk distinct experts), bf16, rows grouped by expert (offsets form: 2D A, 3D B,
int32 cumulative row counts), called as bench/torch_moe.py calls it.

  GEMM0:      (rows x H) @ (H x 2F) per expert, W1 = [gate; up] (E, 2F, H);
              timed alone and followed by gated SiLU silu(gate) * up in fp32
              torch ops, back to bf16 (as torch_moe.py)
  GEMM1:      (rows x F) @ (F x H) per expert, W2 (E, H, F)
and the backward's two weight gradients (bench/gemm_bench.cu's dW rows), the
k-grouped form that torch._grouped_mm's autograd uses for its 3D operand's
gradient: a 2D x 2D _grouped_mm with offs over the rows (the reduction),
written here as the weights' layout needs it:
  dW2:        (w dy)^T h per expert: _grouped_mm(dy.t(), h, offs) -> (E, H, F),
              m = H, n = F (dy: rows x H, h: rows x F)
  dW1:        dH^T x per expert: _grouped_mm(dgu.t(), a, offs) -> (E, 2F, H),
              m = 2F, n = H (dgu: rows x 2F, a: rows x H)
TFLOP/s count valid rows only (rows = M * topk): GEMM0 2*rows*H*2F, GEMM1
2*rows*F*H, dW2 2*rows*H*F, dW1 2*rows*2F*H. Times: CUDA events, --warmup
runs, then the median of --iters rounds (GEMM0, GEMM0 + SiLU, GEMM1, dW2, dW1
interleaved in each round). A shape that runs out of GPU memory is reported
as OOM and skipped. Every shape is checked on sampled rows of the first and
last non-empty expert against fp32 matmuls (the dW GEMMs on 16 sampled output
rows of those experts).
The dW rows need torch._grouped_mm's backward: a probe at start runs autograd
through a small _grouped_mm and compares its weight gradient with the explicit
2D x 2D call; where either is missing or fails (older torch, another GPU),
the dW rows are skipped with a message saying why, and the records carry
"wgrad_skipped". --no-wgrad leaves them out.

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
    p.add_argument("--no-wgrad", action="store_true", help="leave out the backward's weight-gradient GEMMs")
    return p.parse_args()


def gemm0(a, w1, offs):
    return torch._grouped_mm(a, w1.transpose(1, 2), offs=offs)


def gemm0_act(a, w1, offs, f):
    g = torch._grouped_mm(a, w1.transpose(1, 2), offs=offs)
    return (F.silu(g[:, :f].float()) * g[:, f:].float()).to(torch.bfloat16)


def gemm1(h, w2, offs):
    return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)


def wgrad(x, y, offs):
    """Per expert e: x_e^T y_e over e's rows (offs: cumulative row counts), (E, x cols, y cols): the 2D x 2D
    (k-grouped) _grouped_mm that autograd runs for the weight's gradient."""
    return torch._grouped_mm(x.t(), y, offs=offs)


def wgrad_probe(device):
    """None when torch._grouped_mm's backward works here, else a sentence saying why not: autograd through
    a small _grouped_mm (2D x 3D, offs, uneven groups), its weight gradient compared with wgrad() and an
    fp32 reference."""
    try:
        gen = torch.Generator(device=device).manual_seed(7)
        offs = torch.tensor([40, 72, 136], dtype=torch.int32, device=device)  # uneven row counts, not 16-aligned
        x = torch.randn(136, 64, device=device, generator=gen, dtype=torch.bfloat16).requires_grad_()
        w = torch.randn(3, 128, 64, device=device, generator=gen, dtype=torch.bfloat16).requires_grad_()
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        g = torch.randn(y.shape, device=device, generator=gen, dtype=torch.bfloat16)
        y.backward(g)
        if w.grad is None:
            return "autograd gave no weight gradient through torch._grouped_mm"
        explicit = wgrad(g, x.detach(), offs)
        bounds = [0] + offs.tolist()
        want = torch.stack([g[bounds[e]:bounds[e + 1]].float().t() @ x.detach()[bounds[e]:bounds[e + 1]].float()
                            for e in range(3)])
        scale = want.norm().clamp_min(1e-30)
        for what, got in (("autograd's", w.grad), ("the explicit 2D x 2D call's", explicit)):
            err = float((got.float() - want).norm() / scale)
            if not err < 2e-2:
                return f"{what} weight gradient is off by {err:.2e} (relative) on the probe"
        torch.cuda.synchronize()
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return f"torch._grouped_mm's backward failed on the probe: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


def check_wgrad(x, y, got, counts, offs, n=16):
    """Largest relative error (Frobenius) of got = wgrad(x, y, offs) on n sampled output rows of the first and
    last non-empty expert against an fp32 matmul."""
    cnt = counts.tolist()
    ends = offs.tolist()
    nz = [e for e, c in enumerate(cnt) if c > 0]
    idx = torch.linspace(0, x.shape[1] - 1, n, device=x.device).long()
    worst = 0.0
    for e in sorted({nz[0], nz[-1]}):
        r0, r1 = ends[e] - cnt[e], ends[e]
        want = x[r0:r1, idx].float().t() @ y[r0:r1].float()
        err = (got[e, idx].float() - want).norm() / want.norm().clamp_min(1e-30)
        worst = max(worst, float(err))
    return worst


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
    ops = [lambda: gemm0(a, w1, offs), lambda: gemm0_act(a, w1, offs, ffn), lambda: gemm1(h, w2, offs)]
    wskip, werr = args.wgrad_skipped, None
    if wskip is None:  # the weight gradients: w dy (rows x H) and dH (rows x 2F), fresh random
        dy = torch.randn(rows, hidden, device=device, generator=gen, dtype=torch.bfloat16)
        dgu = torch.randn(rows, 2 * ffn, device=device, generator=gen, dtype=torch.bfloat16)
        try:
            werr = max(check_wgrad(dy, h, wgrad(dy, h, offs), counts, offs),
                       check_wgrad(dgu, a, wgrad(dgu, a, offs), counts, offs))
        except RuntimeError as exc:  # the forward rows still run
            wskip = ("out of memory (dW)" if is_oom(exc) else
                     f"torch._grouped_mm's k-grouped call failed on this shape: {str(exc).splitlines()[0]}")
        if wskip is None:
            ops += [lambda: wgrad(dy, h, offs), lambda: wgrad(dgu, a, offs)]
        else:  # outside the except block: its traceback no longer holds tensors
            del dy, dgu
            torch.cuda.empty_cache()
            print(f"{name} M={m}: dW rows skipped: {wskip}", flush=True)
    for _ in range(args.warmup):
        for op in ops:
            op()
    torch.cuda.synchronize()
    times = [[] for _ in ops]
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
    rec = {"model": name, "M": m, "ep": 1, "tp": 1, "topk": topk, "experts": e_num, "hidden": hidden, "ffn": ffn,
           "rows": rows, "min_expert_rows": int(counts.min()), "max_expert_rows": int(counts.max()),
           "gemm0_ms": ms[0], "gemm0_act_ms": ms[1], "gemm1_ms": ms[2],
           "gemm0_tflops": fl0 / (ms[0] * 1e9), "gemm0_act_tflops": fl0 / (ms[1] * 1e9),
           "gemm1_tflops": fl1 / (ms[2] * 1e9), "iters": args.iters, "check_rel_err": err}
    if wskip is None:  # dW2: m = H, n = F; dW1: m = 2F, n = H (the same FLOPs as GEMM1 and GEMM0)
        rec.update({"dw2_m": hidden, "dw2_n": ffn, "dw1_m": 2 * ffn, "dw1_n": hidden,
                    "dw2_ms": ms[3], "dw1_ms": ms[4], "dw2_tflops": fl1 / (ms[3] * 1e9),
                    "dw1_tflops": fl0 / (ms[4] * 1e9), "dw_check_rel_err": werr})
    else:
        rec["wgrad_skipped"] = wskip
    return rec


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
    args.wgrad_skipped = "--no-wgrad" if args.no_wgrad else wgrad_probe(device)
    if args.wgrad_skipped and not args.no_wgrad:
        print(f"torch {torch.__version__}: the dW rows are skipped: {args.wgrad_skipped}", flush=True)
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
            dw = (f"  dW2 {rec['dw2_ms']:8.3f} ms  dW1 {rec['dw1_ms']:8.3f} ms  dW check rel err "
                  f"{rec['dw_check_rel_err']:.2e}" if "dw2_ms" in rec else "")
            print(f"{name:14s} M={m:6d}  gemm0 {rec['gemm0_ms']:8.3f} ms  +act {rec['gemm0_act_ms']:8.3f} ms  "
                  f"gemm1 {rec['gemm1_ms']:8.3f} ms  check rel err {rec['check_rel_err']:.2e}{dw}", flush=True)
            assert rec["check_rel_err"] < 2e-2, f"{name} M={m}: relative error {rec['check_rel_err']} against fp32"
            assert rec.get("dw_check_rel_err", 0.0) < 2e-2, \
                f"{name} M={m}: dW relative error {rec['dw_check_rel_err']} against fp32"
        del w1, w2
        torch.cuda.empty_cache()
    mach = describe(1)
    print(f"\ntorch._grouped_mm, {mach['gpu']}, torch {mach['torch']}, CUDA {mach['cuda']}, EP=1 TP=1, "
          f"uniform routing, bf16, median of {args.iters}\n")
    print("| model | M | GEMM0 ms | GEMM0+act ms | GEMM0 TFLOP/s | GEMM1 ms | GEMM1 TFLOP/s "
          "| dW2 ms | dW2 TFLOP/s | dW1 ms | dW1 TFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in records:
        if "error" in r:
            print(f"| {r['model']} | {r['M']} | OOM | OOM | - | OOM | - | OOM | - | OOM | - |")
        else:
            dw = (f"{r['dw2_ms']:.3f} | {r['dw2_tflops']:.1f} | {r['dw1_ms']:.3f} | {r['dw1_tflops']:.1f}"
                  if "dw2_ms" in r else "skipped | - | skipped | -")
            print(f"| {r['model']} | {r['M']} | {r['gemm0_ms']:.3f} | {r['gemm0_act_ms']:.3f} | "
                  f"{r['gemm0_tflops']:.1f} | {r['gemm1_ms']:.3f} | {r['gemm1_tflops']:.1f} | {dw} |")
    if args.wgrad_skipped:
        print(f"\ndW rows skipped: {args.wgrad_skipped}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": mach, "baseline": "torch._grouped_mm", "records": records}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
