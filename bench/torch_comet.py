"""torch_comet.py - comet through PyTorch: one MoE layer's training step
(forward + backward) through comet.torch.MoEExperts on a world made from the
torch.distributed group, timed the way `comet bench --train` times the C
calls (each step from an idle GPU) and back to back (as `--back-to-back`
does, with the host's time to issue a step), so the Python layer's cost
shows beside the C numbers (the same expert ids as comet bench's, from
torch_moe.routing, and its inputs' distributions); and the op's overhead
per call on a tiny layer (eager, and replayed in a CUDA graph).

Run with torchrun, one process per GPU:
  torchrun --standalone --nproc-per-node 2 bench/torch_comet.py --models mixtral-8x7b --tokens 8192 --ep 2
Prints a table on rank 0 and, with --json, writes records (marked "python")
that bench/report.py can set beside `comet bench --train --json` rows.
"""
import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import comet
import comet.torch as ct
from torch_moe import MODELS, routing, uniform_bf16  # the presets, comet bench's routing and inputs (same directory)


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="mixtral-8x7b", help="comma-separated presets")
    p.add_argument("--tokens", default="8192", help="comma-separated M (tokens over all ranks)")
    p.add_argument("--tp", type=int, default=0)
    p.add_argument("--ep", type=int, default=0)
    p.add_argument("--save", default="activations", choices=("activations", "recompute"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--overhead-calls", type=int, default=200, help="calls of the tiny layer (0: skip it)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="", help="write the records here (rank 0)")
    p.add_argument("--profile", default="", metavar="FILE",
                   help="torch.profiler over 3 training steps of each cell: rank 0 writes the ops by CUDA and by "
                        "CPU time to FILE (appended, a section a cell) and a Chrome trace to FILE.<cell>.json")
    return p.parse_args()


def slowest(ms, device):
    """The slowest rank's value (a layer is as fast as its slowest rank)."""
    t = torch.tensor([ms], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def time_steps(step, iters, warmup, device):
    """Median ms of step() over iters after warmup, CUDA events around each (each step from an idle GPU, as
    `comet bench` times the C calls: the host's work before the first kernel counts)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_back_to_back(step, iters):
    """(GPU ms, host ms, forward ms, backward ms) a step over iters steps issued back to back (the host runs
    ahead, as in a training loop): the median of the steps' times, each from its start event to the next
    step's (as `comet bench --train --back-to-back` times the C calls: the first step's wait for the host
    counts once, not in a mean), the host's mean time to issue a step (at or above the GPU's, the GPU waits
    for it), and the medians of the step's two parts split by an event between the forward and the
    backward (as the C rows' fwd_ms and bwd_ms)."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    mid = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    t = time.perf_counter()
    for i in range(iters):
        ev[i].record()
        step(after_forward=mid[i].record)
    host = (time.perf_counter() - t) * 1e3 / iters
    ev[iters].record()
    ev[iters].synchronize()
    med = lambda f: statistics.median(f(i) for i in range(iters))  # noqa: E731
    return (med(lambda i: ev[i].elapsed_time(ev[i + 1])), host, med(lambda i: ev[i].elapsed_time(mid[i])),
            med(lambda i: mid[i].elapsed_time(ev[i + 1])))


def profile_steps(step, path, tag, rank):
    """torch.profiler over 3 steps; rank 0 appends the ops by CUDA and by CPU time to path."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    if rank == 0:
        ka = prof.key_averages()
        with open(path, "a") as f:
            f.write("== %s: 3 steps, by self CUDA time\n%s\n" % (
                tag, ka.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60)))
            f.write("== %s: 3 steps, by self CPU time\n%s\n" % (
                tag, ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)))
        prof.export_chrome_trace("%s.%s.json" % (path, tag))


def replayed_training_forwards(step, layer, n):
    """Of n training steps, how many forwards replayed the layer's captured kernel chain
    (Layer.last_protocol().graph_replay, read between the forward and the backward, which sets its own):
    a saving forward's graph is keyed on its saved state's address, so a step whose saved state comes from
    another block of torch's allocator captures anew (a host cost `comet bench`, with one saved buffer,
    never pays)."""
    replays = []
    for _ in range(n):
        step(after_forward=lambda: replays.append(layer.last_protocol().graph_replay))
    return sum(replays)


def cell(world, model, m_tokens, tp, ep, rank, args, device):
    hd, ffn, e_num, topk = MODELS[model]
    w = tp * ep
    t = m_tokens // w
    gen = torch.Generator(device=device).manual_seed(args.seed + rank)
    e_local, f_local = e_num // ep, ffn // tp
    w1 = uniform_bf16((e_local, 2 * f_local, hd), hd ** -0.5, gen, device)  # comet bench's distributions
    w2 = uniform_bf16((e_local, hd, f_local), ffn ** -0.5, gen, device)
    mod = ct.MoEExperts(w1, w2, tp=tp, ep=ep, rank=rank, save=args.save, world=world, topk=topk,
                        max_tokens_per_rank=t).requires_grad_()
    x = uniform_bf16((t, hd), 1.0, gen, device).requires_grad_()
    idx, wts = routing(args.seed, [t] * w, hd, e_num, topk, rank, device=device)  # comet bench's ids (uniform)
    idx = idx.to(torch.int32).contiguous()
    wts.requires_grad_()
    dy = uniform_bf16((t, hd), 1.0, gen, device)

    def step(after_forward=None):
        for p in (x, wts, mod.w1, mod.w2):
            p.grad = None
        y = mod(x, idx, wts)
        if after_forward:
            after_forward()
        y.backward(dy)

    def forward():
        with torch.no_grad():
            mod(x, idx, wts)

    step_ms = slowest(time_steps(step, args.iters, args.warmup, device), device)
    b2b = [slowest(v, device) for v in time_back_to_back(step, args.iters)]
    fwd_ms = slowest(time_steps(forward, args.iters, args.warmup, device), device)
    replays = replayed_training_forwards(step, ct._registered[mod._layer].layer, 8)
    if args.profile:
        profile_steps(step, args.profile, "%s-%d-tp%dep%d" % (model, m_tokens, tp, ep), rank)
    mod.close()
    flop = 3 * 2 * 3 * m_tokens * topk * hd * ffn  # forward 2*(3 GEMMs of H x F) a routed row; training 3x
    return {"model": model, "tokens": m_tokens, "tp": tp, "ep": ep, "save": args.save, "python": True, "train": True,
            "step_ms": step_ms, "step_ms_back_to_back": b2b[0], "host_ms_back_to_back": b2b[1],
            "fwd_ms_back_to_back": b2b[2], "bwd_ms_back_to_back": b2b[3], "fwd_ms": fwd_ms,
            "tflops": flop / w / (step_ms * 1e-3) / 1e12, "train_forwards_replayed": replays}


def overhead(args, device):
    """us per call of the op on a tiny one-rank layer: eager, and replayed in a CUDA graph."""
    gen = torch.Generator(device=device).manual_seed(args.seed)
    hd, f, e, k, t = 256, 256, 8, 2, 64
    w1 = torch.randn(e, 2 * f, hd, generator=gen, device=device).bfloat16()
    w2 = torch.randn(e, hd, f, generator=gen, device=device).bfloat16()
    x = torch.randn(t, hd, generator=gen, device=device).bfloat16()
    idx, wts = routing(args.seed, [t], hd, e, k, 0, device=device)
    idx = idx.to(torch.int32).contiguous()
    n = args.overhead_calls
    with torch.no_grad():
        ct.moe_experts(x, idx, wts, w1, w2)  # the layer made and its kernels loaded
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            ct.moe_experts(x, idx, wts, w1, w2)
        b.record()
        b.synchronize()
        eager = a.elapsed_time(b) * 1e3 / n
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ct.moe_experts(x, idx, wts, w1, w2)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            ct.moe_experts(x, idx, wts, w1, w2)
        g.replay()
        torch.cuda.synchronize()
        a.record()
        for _ in range(n):
            g.replay()
        b.record()
        b.synchronize()
        graph = a.elapsed_time(b) * 1e3 / n
    return {"overhead": True, "eager_us": eager, "graph_us": graph, "tokens": t, "hidden": hd}


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    tp = args.tp or (1 if not args.ep else size // args.ep)
    ep = args.ep or size // tp
    if tp * ep != size:
        raise SystemExit("torch_comet.py: tp %d x ep %d is not the world's %d ranks" % (tp, ep, size))
    world = ct.world_from_group()
    records = []
    for model in args.models.split(","):
        for m in (int(v) for v in args.tokens.split(",")):
            records.append(cell(world, model, m, tp, ep, rank, args, device))
            if rank == 0:
                r = records[-1]
                print("%-14s M=%-6d TP=%d EP=%d %-11s step %8.3f ms (back to back %8.3f = forward %.3f + backward "
                      "%.3f, the host's %8.3f)  forward alone %8.3f ms  %6.1f TFLOP/s a GPU  training forwards "
                      "replayed %d of 8"
                      % (model, m, tp, ep, r["save"], r["step_ms"], r["step_ms_back_to_back"], r["fwd_ms_back_to_back"],
                         r["bwd_ms_back_to_back"], r["host_ms_back_to_back"], r["fwd_ms"], r["tflops"],
                         r["train_forwards_replayed"]), flush=True)
    if args.overhead_calls and rank == 0:
        r = overhead(args, device)
        records.append(r)
        print("the op on a tiny layer (T=%d, H=%d): %.1f us a call eager, %.1f us replayed in a CUDA graph"
              % (r["tokens"], r["hidden"], r["eager_us"], r["graph_us"]), flush=True)
    dist.barrier()
    world.close()
    if rank == 0 and args.json:
        meta = {"device": torch.cuda.get_device_name(device), "gpus": size, "torch": torch.__version__,
                "comet": comet.version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "commit": os.environ.get("COMET_COMMIT", "unknown")}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
