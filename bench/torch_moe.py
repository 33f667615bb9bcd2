"""torch_moe.py - the PyTorch baseline: one MoE layer forward the way users run
it today (Megatron-style), timed with the same workloads and flags as
`comet bench`, so both print side by side.

  EP (TP=1): permute -> all-to-all (host sync for the split sizes, as Megatron's
             all-to-all dispatcher does) -> regroup by expert ->
             torch._grouped_mm + gated SiLU + torch._grouped_mm -> all-to-all
             back -> unpermute -> weighted top-k sum
  TP (EP=1): all-gather tokens and routing -> permute -> grouped GEMMs on the
             rank's ffn slice -> weighted top-k sum -> reduce-scatter (bf16)
  EP x TP:   Megatron's expert-tensor-parallelism: TP's all-gather within the
             TP group, EP's path on the gathered tokens within the EP group
             (the experts on the rank's ffn slice), TP's reduce-scatter
Ranks as comet's (include/comet.h): rank = ep * TP + tp; rank (ep, tp) holds
experts [ep*E/EP, (ep+1)*E/EP), each's tp-th ffn slice; its TP group is the
ranks of its ep, its EP group the ranks of its tp. Each rank holds M / (TP*EP)
tokens and gets y for them.

The routing is `comet bench`'s (routing(): harness/workload.c's draw for the same
--seed, --skew and --zero-experts, replayed in numpy), so both route the same rows
to the same experts; --input-sets rotate its tokens, as comet bench's sets do. x, dy
and the weights come from comet bench's distributions (uniform_bf16).

Run with torchrun (one process per GPU); one GPU works with plain python:
  torchrun --nproc-per-node 2 bench/torch_moe.py --models mixtral-8x7b --tokens 4096,8192 --ep 2
Every configuration is checked against an fp32 evaluation of sampled tokens
before it is timed. Prints a table on rank 0 and, with --json, writes the
records with the machine's description.

--train times one training step instead (../shared/docs/training.md section 6):
the same layer's forward with autograd, then y.backward(dy) (dy random bf16):
gradients of x, topk_w (fp32), w1 and w2 (bf16, the parameters' dtype; set
to None before every step, so written, not accumulated). The all-to-alls are
autograd Functions around dist.all_to_all_single (backward: the all-to-all
with the splits swapped), TP's all-gathers backward a reduce-scatter and its
reduce-scatter an all-gather (within the sub-groups in EP x TP). On CUDA each
expert's rows are padded to a multiple of 8 (zero rows, as torchtitan does) for
torch._grouped_mm's backward, whose dW GEMM needs 16-byte aligned group offsets.
Forward, backward and step ms (CUDA events: before the forward, between, after
the backward; median over the iters of the slowest rank's), the step's TFLOP/s (3x the forward's FLOPs). Before
timing, one step on 8 sampled tokens a rank is checked against an fp32
autograd evaluation of those tokens (every rank's, all-gathered): relative
error (norm) of y, dx, d_topk_w and of the rank's dw1, dw2 slices. Records
carry "train": true and "saved_bytes": what autograd keeps from one forward
for its backward on the largest rank (the distinct storages of its saved
tensors, the weights and the step's inputs left out).
  torchrun --nproc-per-node 2 bench/torch_moe.py --train --models qwen2-moe --tokens 4096 --ep 2
--device cpu (gloo; a per-expert matmul loop where torch._grouped_mm's
backward does not run on the CPU; wall-clock times) is only for testing this
script without GPUs (--scale shrinks the model); its times mean nothing:
  torchrun --nproc-per-node 4 bench/torch_moe.py --device cpu --train --models qwen2-moe --tokens 256 --tp 2 --ep 2
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

MODELS = {  # name: (hidden, ffn per expert, experts, topk), as harness/workload.c
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "qwen2-moe": (2048, 1408, 64, 4),
    "phi-3.5-moe": (4096, 6400, 16, 2),
    "deepseek-v3": (7168, 2048, 256, 8),
}


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="mixtral-8x7b", help="comma-separated presets")
    p.add_argument("--tokens", default="8192", help="comma-separated M (tokens over all ranks)")
    p.add_argument("--tp", type=int, default=0)
    p.add_argument("--ep", type=int, default=0)
    p.add_argument("--topk", type=int, default=0, help="override the model's topk")
    p.add_argument("--experts", type=int, default=0, help="override the model's expert count")
    p.add_argument("--skew", type=float, default=0.0, help="relative std of expert popularity")
    p.add_argument("--zero-experts", type=int, default=0, help="experts that receive no tokens")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--input-sets", type=int, default=3, help="inputs rotated between runs (larger than L2)")
    p.add_argument("--json", default="", help="write the records here (rank 0)")
    p.add_argument("--scale", type=int, default=1, help="divide the model's hidden and ffn (tests)")
    p.add_argument("--train", action="store_true", help="time forward + backward (autograd) instead of the forward")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: gloo, a per-expert loop and wall-clock times, to test the script without GPUs "
                   "(times mean nothing)")
    return p.parse_args()


def all_to_all(x, out_splits, in_splits, group):
    """dist.all_to_all_single over group into a new tensor: in_splits[r] rows of x to its rank r,
    out_splits[r] rows from it"""
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_gather(x, group):
    """the rows of every rank of group, stacked in its rank order"""
    out = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def reduce_scatter(x, group):
    """the sum over the ranks of group of x, this rank's share of the rows"""
    out = x.new_empty(x.shape[0] // dist.get_world_size(group), *x.shape[1:])
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class AllToAll(torch.autograd.Function):
    """all_to_all with autograd: the backward is the all-to-all with the splits swapped"""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return all_to_all(g, in_splits, out_splits, ctx.group), None, None, None


class AllGather(torch.autograd.Function):
    """all_gather with autograd: the backward is the reduce-scatter (sum) of the gradient"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter(g, ctx.group), None


class ReduceScatter(torch.autograd.Function):
    """reduce_scatter with autograd: the backward is the all-gather of the gradient"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group), None


def layout_groups(tp, ep, rank):
    """(TP group, EP group) of rank = ep_rank * tp + tp_rank, comet's rank mapping (include/comet.h): the
    tp ranks of its ep_rank (they share experts, each an ffn slice), the ep ranks of its tp_rank (they hold
    the same ffn slice of different experts). None for the whole world (the default group) or one rank.
    Every rank creates every group, in the same order, as dist.new_group requires."""
    if tp == 1 or ep == 1:
        return None, None
    tp_groups = [dist.new_group([e * tp + i for i in range(tp)]) for e in range(ep)]
    ep_groups = [dist.new_group([e * tp + i for e in range(ep)]) for i in range(tp)]
    return tp_groups[rank // tp], ep_groups[rank % tp]


def inverse(perm):
    """the inverse of a permutation (index_select by it undoes index_select by perm, with autograd)"""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def rel_err(got, want):
    """||got - want|| / ||want|| in fp64 (0 when both are 0)"""
    got, want = got.double(), want.double()
    den = want.norm()
    return float((got - want).norm() / den) if den > 0 else float((got - want).norm())


def uniform_bf16(shape, scale, gen, device):
    """bf16 values uniform in [-scale, scale): the distribution `comet bench` draws its x, dy (scale 1) and
    weights (1/sqrt(H) for W1, 1/sqrt(F) for W2) from (harness/workload.c's fill_bf16), so both sides multiply
    alike-distributed operands (a GEMM's power under the GPU's limit depends on its data)."""
    return torch.empty(shape, device=device).uniform_(-scale, scale, generator=gen).to(torch.bfloat16)


GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's step
MASK64 = (1 << 64) - 1


def splitmix64(state, n):
    """The n outputs (numpy uint64) of harness/workload.c's comet_rng_next from `state` (a Python int): the
    k-th of them mixes state + k * GOLDEN, so any stretch of the stream is drawn at once."""
    z = (np.uint64(state) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(GOLDEN))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def routing(seed, tokens, hidden, e_num, topk, rank, skew=0.0, zero=0, device="cpu"):
    """Rank `rank`'s topk_idx (int64, torch's index type) and topk_w (fp32) of `comet bench`'s routing,
    drawn as harness/workload.c draws it (comet_problem_redraw: every rank's x, then comet_routing_draw) for
    the seed, the ranks' token counts `tokens` and the hidden size: expert popularity 1 + skew * N(0,1)
    floored at 0.01 (zero random experts at 0), each token drawing topk distinct experts in proportion. The
    expert ids are the C draw's exactly (so a comparison with the C calls routes the same rows); the weights
    may differ from C's in the last bit (libm)."""
    state = (seed * GOLDEN + 7 + sum(tokens) * hidden * GOLDEN) & MASK64  # after the ranks' x

    def take(n, keep=True):  # the next n draws (skipped, without keep)
        nonlocal state
        out = splitmix64(state, n) if keep else None
        state = (state + n * GOLDEN) & MASK64
        return out

    def uniform(z):
        return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53

    def normal(z):  # pairs (u, v) of draws
        u, v = uniform(z[0::2]), uniform(z[1::2])
        return np.sqrt(-2.0 * np.log(1.0 - u)) * np.cos(6.283185307179586 * v)

    pop = np.maximum(1.0 + skew * normal(take(2 * e_num)), 0.01)
    for _ in range(zero):  # distinct random experts, one draw a try
        while True:
            e = int(take(1)[0] % np.uint64(e_num))
            if pop[e] > 0:
                pop[e] = 0.0
                break
    take(3 * topk * sum(tokens[:rank]), keep=False)  # the earlier ranks' picks: a uniform and a normal each
    t = tokens[rank]
    z = take(3 * topk * t).reshape(t, topk, 3)
    mass = np.tile(pop, (t, 1))
    left = np.full(t, np.cumsum(pop)[-1])  # summed in expert order, as the C loop
    idx = np.empty((t, topk), dtype=np.int32)
    logit = np.empty((t, topk))
    rows = np.arange(t)
    for j in range(topk):
        u = uniform(z[:, j, 0]) * left
        acc = np.cumsum(mass, axis=1)  # sequential, as the C loop's running sum (a 0 mass adds nothing)
        live = mass > 0
        over = live & (acc > u[:, None])
        last_live = e_num - 1 - np.argmax(live[:, ::-1], axis=1)
        pick = np.where(over.any(axis=1), np.argmax(over, axis=1), last_live)
        left -= mass[rows, pick]
        mass[rows, pick] = 0.0
        idx[:, j] = pick
        logit[:, j] = np.exp(normal(z[:, j, 1:].reshape(-1)))
    norm = logit[:, 0].copy()
    for j in range(1, topk):  # in order, as the C loop (numpy's sum pairs them)
        norm += logit[:, j]
    w = (logit / norm[:, None]).astype(np.float32)
    return torch.from_numpy(idx).long().to(device), torch.from_numpy(w).to(device)


GROUP_ALIGN = 8  # rows: 16 bytes of bf16


def pad_groups(rows, counts):
    """rows grouped by expert (counts) into a buffer where every group starts at a multiple of GROUP_ALIGN
    rows, zero rows between: torch._grouped_mm's backward runs a grouped GEMM over the rows (dW: the groups
    along its K dimension), whose TMA loads need each group's start 16-byte aligned there (torchtitan pads
    bf16 groups to 8 rows for it). The last group runs to a size known on the host (no sync), so no row
    lies past offs[-1] (those the grouped GEMMs leave unwritten, dX included). Returns the buffer (with
    autograd: index_copy), offs (int32), and each row's place in it (index_select gives the rows back)."""
    n, g = rows.shape[0], counts.numel()
    size = (n + (GROUP_ALIGN - 1) * g + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    end_pad, end = torch.cumsum(padded, 0), torch.cumsum(counts, 0)
    grp = torch.repeat_interleave(torch.arange(g, device=rows.device), counts, output_size=n)
    dst = torch.arange(n, device=rows.device) + (end_pad - padded - (end - counts))[grp]
    offs = end_pad.to(torch.int32)
    offs[-1] = size
    return rows.new_zeros(size, rows.shape[1]).index_copy(0, dst, rows), offs, dst


def expert_ffn(x, w1, w2):
    """fp32 evaluation of one expert: act(x W1^T) W2^T, W1 = [gate; up]."""
    f = w1.shape[0] // 2
    g = x.float() @ w1.float().t()
    h = (F.silu(g[:, :f]) * g[:, f:]).to(torch.bfloat16).float()
    return h @ w2.float().t()


class Layer:
    def __init__(self, cfg, rank, world, device, groups):
        self.hidden, self.ffn, self.e_num, self.topk, self.tp, self.ep = cfg
        self.rank, self.world, self.device = rank, world, device
        self.tp_rank, self.ep_rank = rank % self.tp, rank // self.tp  # rank = ep_rank * tp + tp_rank, as comet
        self.tp_group, self.ep_group = groups  # layout_groups
        self.el = self.e_num // self.ep
        self.fl = self.ffn // self.tp
        gen = torch.Generator(device=device).manual_seed(1234)  # same full weights on every rank
        h, f = self.hidden, self.ffn
        self.w1_full = uniform_bf16((self.e_num, 2 * f, h), h ** -0.5, gen, device)
        self.w2_full = uniform_bf16((self.e_num, h, f), f ** -0.5, gen, device)
        e0, s0 = self.ep_rank * self.el, self.tp_rank * self.fl
        gate = self.w1_full[e0:e0 + self.el, s0:s0 + self.fl]
        up = self.w1_full[e0:e0 + self.el, f + s0:f + s0 + self.fl]
        self.w1 = torch.cat([gate, up], dim=1).contiguous()              # (E_local, 2F/TP, H)
        self.w2 = self.w2_full[e0:e0 + self.el, :, s0:s0 + self.fl].contiguous()  # (E_local, H, F/TP)
        self.gemm_events = None
        self.train = False  # forward: autograd through the collectives (the Functions above)
        self.loop = device.type != "cuda"  # torch._grouped_mm's backward does not run on the CPU

    def experts(self, rows, counts):
        """Grouped GEMM0 + gated SiLU + grouped GEMM1 over rows grouped by local expert.
        The activation is Megatron's unfused glu, silu(gate) * up in bf16: two
        elementwise passes. (Until the seventeenth session it went through fp32,
        silu(gate.float()) * up.float(), then to bf16: five passes with fp32
        intermediates, which made this layer slower than the issue's reference:
        bench/results/baselines/2026-11-22-torch-activation-h200x2.md.)"""
        offs = torch.cumsum(counts, 0).to(torch.int32)
        ev = self.gemm_events
        if ev is not None:
            ev[0].record()
        if self.train and not self.loop:  # CUDA autograd: groups padded for the backward's grouped GEMMs
            padded, offs, dst = pad_groups(rows, counts)
            g = torch._grouped_mm(padded, self.w1.transpose(1, 2), offs=offs)
            a = F.silu(g[:, :self.fl]) * g[:, self.fl:]
            o = torch._grouped_mm(a, self.w2.transpose(1, 2), offs=offs).index_select(0, dst)
        elif self.loop:  # --device cpu: one matmul per expert
            bounds = [0] + offs.tolist()
            outs = []
            for e in range(len(bounds) - 1):
                r = rows[bounds[e]:bounds[e + 1]]
                g = r @ self.w1[e].t()
                outs.append((F.silu(g[:, :self.fl]) * g[:, self.fl:]) @ self.w2[e].t())
            o = torch.cat(outs) if outs else rows.new_empty(0, self.hidden)
        else:
            g = torch._grouped_mm(rows, self.w1.transpose(1, 2), offs=offs)
            a = F.silu(g[:, :self.fl]) * g[:, self.fl:]
            o = torch._grouped_mm(a, self.w2.transpose(1, 2), offs=offs)
        if ev is not None:
            ev[1].record()
        return o

    def forward(self, x, idx, w):
        """y for this rank's tokens. TP > 1 (Megatron's expert-tensor-parallelism): the TP group's tokens
        and routing all-gathered first, the partial sums over the rank's ffn slice reduce-scattered (bf16)
        last; between, the EP path over the EP group on those tokens (EP = 1: every expert is local).
        self.train: autograd through the collectives (the all-gathers' backward a reduce-scatter, the
        reduce-scatter's an all-gather)"""
        if self.tp == 1:
            return self.forward_ep(x, idx, w)
        gather, scatter = (AllGather.apply, ReduceScatter.apply) if self.train else (all_gather, reduce_scatter)
        g = self.tp_group
        part = self.forward_ep(gather(x, g), all_gather(idx, g), gather(w, g))
        return scatter(part, g)

    def unpermute(self, rows, perm):
        """rows back to their places before index_select(0, perm): a scatter, in training an
        index_select by the inverse permutation (autograd)"""
        if self.train:
            return rows.index_select(0, inverse(perm))
        out = torch.empty_like(rows)
        out[perm] = rows
        return out

    def forward_ep(self, x, idx, w):
        """the top-k sum of x's rows over the experts of the EP group, each on this rank's ffn slice: permute
        by expert, all-to-all to the expert's rank (the split sizes synced to the host), regroup by local
        expert, experts, all the way back, weighted top-k sum (bf16). self.train: the all-to-alls through
        AllToAll (backward: the splits swapped)"""
        t, k, wsz, el = x.shape[0], self.topk, self.ep, self.el
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        x_perm = x.index_select(0, order // k)
        counts = torch.bincount(flat, minlength=self.e_num)
        if wsz == 1:
            back = self.experts(x_perm, counts)
        else:
            counts_recv = torch.empty_like(counts)
            dist.all_to_all_single(counts_recv, counts, group=self.ep_group)
            splits = torch.stack([counts.view(wsz, el).sum(1), counts_recv.view(wsz, el).sum(1)]).cpu()  # host sync
            send, recv_n = splits[0].tolist(), splits[1].tolist()
            a2a = AllToAll.apply if self.train else all_to_all
            recv = a2a(x_perm, recv_n, send, self.ep_group)
            # rows arrive grouped (source, expert); regroup them (expert, source)
            chunk = torch.repeat_interleave(torch.arange(wsz * el, device=x.device), counts_recv,
                                            output_size=recv.shape[0])
            perm2 = torch.argsort((chunk % el) * wsz + chunk // el, stable=True)
            o = self.experts(recv.index_select(0, perm2), counts_recv.view(wsz, el).sum(0))
            back = a2a(self.unpermute(o, perm2), send, recv_n, self.ep_group)
        slots = self.unpermute(back, order)
        return (slots.view(t, k, -1).float() * w.unsqueeze(-1)).sum(1).to(torch.bfloat16)

    def step(self, x, idx, w, dy, events=None):
        """one training step: y = forward (autograd), y.backward(dy); the gradients of x, topk_w (fp32),
        w1, w2 (bf16) written (the parameters' set to None first). events: three CUDA events recorded
        before the forward, between, after the backward"""
        self.w1.grad = self.w2.grad = None
        x = x.detach().requires_grad_()
        w = w.detach().requires_grad_()
        if events:
            events[0].record()
        y = self.forward(x, idx, w)
        if events:
            events[1].record()
        y.backward(dy)
        if events:
            events[2].record()
        return y, x.grad, w.grad

    def check_train(self, x, idx, w, dy, n=8):
        """one step on n sampled tokens of every rank against an fp32 autograd evaluation of those tokens
        (every rank's, all-gathered): relative errors (norm) of y, dx, d_topk_w and this rank's dw1, dw2
        slices. The loss <y, dy> is linear in y, so the evaluation runs expert by expert (one expert's
        fp32 weights alive at a time: all of them with their gradients are over 80 GB for DeepSeek-V3),
        and dw1, dw2 are compared expert by expert in fp64 (an expert the sample leaves out: against 0)"""
        pick = torch.linspace(0, x.shape[0] - 1, n, device=x.device).long()
        xs, idxs, ws, dys = x[pick].contiguous(), idx[pick].contiguous(), w[pick].contiguous(), dy[pick].contiguous()
        y, dx, dtw = self.step(xs, idxs, ws, dys)
        dw1, dw2 = self.w1.grad, self.w2.grad  # bf16, as the step wrote them
        self.w1.grad = self.w2.grad = None

        def gather(v):
            return all_gather(v, None) if self.world > 1 else v

        gx, gidx, gw, gdy = gather(xs), gather(idxs), gather(ws), gather(dys)
        fx = gx.float().requires_grad_()
        fw = gw.float().requires_grad_()
        fdy = gdy.float()
        f, s0, h = self.ffn, self.tp_rank * self.fl, self.hidden
        y_ref = torch.zeros(fx.shape[0], h, device=x.device)
        e0 = self.ep_rank * self.el
        sq = {"dw1": [0.0, 0.0], "dw2": [0.0, 0.0]}  # sum of squares: difference, reference

        def add(name, got, want):
            got = got.double()
            sq[name][0] += float((got - want.double()).square().sum()) if want is not None else float(got.square().sum())
            sq[name][1] += float(want.double().square().sum()) if want is not None else 0.0

        used = set(torch.unique(gidx).tolist())
        for e in sorted(used):
            tok, slot = (gidx == e).nonzero(as_tuple=True)
            mine_e = e0 <= e < e0 + self.el
            w1e = self.w1_full[e].float().requires_grad_(mine_e)
            w2e = self.w2_full[e].float().requires_grad_(mine_e)
            g = fx[tok] @ w1e.t()
            o = fw[tok, slot].unsqueeze(-1) * ((F.silu(g[:, :f]) * g[:, f:]) @ w2e.t())
            y_ref.index_add_(0, tok, o.detach())
            (o * fdy[tok]).sum().backward()  # into fx.grad, fw.grad and (this rank's experts) w1e, w2e
            if mine_e:
                g1 = w1e.grad
                add("dw1", dw1[e - e0], torch.cat([g1[s0:s0 + self.fl], g1[f + s0:f + s0 + self.fl]]))
                add("dw2", dw2[e - e0], w2e.grad[:, s0:s0 + self.fl])
            del w1e, w2e, g, o
        for le in range(self.el):  # experts no sampled token chose: their gradients must be 0
            if e0 + le not in used:
                add("dw1", dw1[le], None)
                add("dw2", dw2[le], None)

        def rel(name):
            d, r = sq[name]
            return (d / r) ** 0.5 if r > 0 else d ** 0.5

        lo = self.rank * xs.shape[0]
        mine = slice(lo, lo + xs.shape[0])
        return {"y": rel_err(y.detach().float(), y_ref[mine]), "dx": rel_err(dx.float(), fx.grad[mine]),
                "d_topk_w": rel_err(dtw, fw.grad[mine]), "dw1": rel("dw1"), "dw2": rel("dw2")}

    def check(self, x, idx, w, y, n=8):
        """Relative error of y on n sampled tokens against an fp32 evaluation."""
        pick = torch.linspace(0, x.shape[0] - 1, n, device=x.device).long()
        want = torch.zeros(n, self.hidden, device=x.device)
        for i, t in enumerate(pick.tolist()):
            for j in range(self.topk):
                e = int(idx[t, j])
                want[i] += w[t, j] * expert_ffn(x[t:t + 1], self.w1_full[e], self.w2_full[e])[0]
        got = y[pick].float()
        return float((got - want).norm() / want.norm())


def median_max_over_ranks(times, world, device):
    t = torch.tensor(times, device=device)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def describe(world):
    if not torch.cuda.is_available():
        return {"gpu": "cpu", "gpus": world, "sms": 0, "driver": "none", "cuda": "none", "torch": torch.__version__,
                "nccl": "none", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "commit": os.environ.get("COMET_COMMIT", "unknown")}
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.split("\n")[0].strip()
    except OSError:
        driver = "unknown"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
    return {"gpu": props.name, "gpus": world, "sms": props.multi_processor_count, "driver": driver,
            "cuda": torch.version.cuda, "torch": torch.__version__, "nccl": nccl,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": os.environ.get("COMET_COMMIT", "unknown")}


class WallEvent:
    """torch.cuda.Event's record / elapsed_time by the wall clock (--device cpu)"""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3

    def synchronize(self):
        pass


def event(device):
    """a timing event: CUDA's, or WallEvent on the CPU"""
    return torch.cuda.Event(enable_timing=True) if device.type == "cuda" else WallEvent()


def autograd_saved_bytes(layer, x, idx, w, dy):
    """bytes autograd keeps from one training forward for its backward, this rank: the distinct storages its
    saved tensors hold, the weights and the step's inputs x and topk_w left out (every layer keeps those;
    comet's counterpart is comet_layer_saved_bytes)"""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    inputs = {t.untyped_storage().data_ptr() for t in (layer.w1, layer.w2, x, w)}
    kept = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in inputs:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer.forward(x, idx, w)
    y.backward(dy)
    layer.w1.grad = layer.w2.grad = None
    return sum(kept.values())


def train_one(args, layer, name, m, sets, rank, world, device):
    """--train: one configuration's training steps (the check first), its record"""
    hidden, ffn, topk = layer.hidden, layer.ffn, layer.topk
    layer.train = True
    layer.w1.requires_grad_(True)
    layer.w2.requires_grad_(True)
    dys = []
    for s, (x, _, _) in enumerate(sets):
        gen = torch.Generator(device=device).manual_seed(1000 * (args.seed + 7 * s) + 500 + rank)
        dys.append(uniform_bf16(x.shape, 1.0, gen, device))
    errs = layer.check_train(*sets[0], dys[0])
    saved = autograd_saved_bytes(layer, *sets[0], dys[0])
    for i in range(args.warmup):
        layer.step(*sets[i % len(sets)], dys[i % len(sets)])
    fwd, bwd, step = [], [], []
    for i in range(args.iters):
        ev = [event(device) for _ in range(3)]
        layer.step(*sets[i % len(sets)], dys[i % len(sets)], events=ev)
        ev[2].synchronize()
        fwd.append(ev[0].elapsed_time(ev[1]))
        bwd.append(ev[1].elapsed_time(ev[2]))
        step.append(ev[0].elapsed_time(ev[2]))
    layer.w1.grad = layer.w2.grad = None
    layer.w1.requires_grad_(False)
    layer.w2.requires_grad_(False)
    layer.train = False
    fwd_ms, bwd_ms = median_max_over_ranks(fwd, world, device), median_max_over_ranks(bwd, world, device)
    ms = median_max_over_ranks(step, world, device)
    flops = 3 * 2.0 * m * topk * hidden * ffn * 3 / world  # per GPU: 3x the forward's
    grad_err = max(errs[g] for g in ("dx", "d_topk_w", "dw1", "dw2"))
    saved = int(median_max_over_ranks([float(saved)], world, device))  # the largest rank's
    rec = {"model": name, "M": m, "tp": layer.tp, "ep": layer.ep, "topk": topk, "experts": layer.e_num,
           "hidden": hidden, "ffn": ffn, "skew": args.skew, "zero_experts": args.zero_experts, "train": True,
           "ms": ms, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "tflops": flops / (ms * 1e9), "saved_bytes": saved,
           "check_rel_err": errs["y"], "grad_rel_err": grad_err, "grad_rel_errs": errs,
           "iters": args.iters, "warmup": args.warmup}
    if rank == 0:
        print(f"{name:14s} M={m:6d} TP={layer.tp} EP={layer.ep}  train: forward {fwd_ms:8.3f} ms  backward "
              f"{bwd_ms:8.3f} ms  step {ms:8.3f} ms ({rec['tflops']:6.1f} TFLOP/s, saved {saved / 2**20:.1f} MiB)  "
              f"check rel err y {errs['y']:.2e}, "
              + ", ".join(f"{g} {errs[g]:.2e}" for g in ("dx", "d_topk_w", "dw1", "dw2")), flush=True)
    assert errs["y"] < 2e-2, f"{name} M={m}: y's relative error {errs['y']} against the fp32 evaluation"
    assert grad_err < 5e-2, f"{name} M={m}: gradients' relative errors {errs} against the fp32 autograd evaluation"
    return rec


def main():
    args = parse()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        if world > 1:
            dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        if world > 1:
            dist.init_process_group("gloo")
    tp = args.tp or (world // args.ep if args.ep else 1)  # default: EP over all GPUs
    ep = world // tp
    assert tp * ep == world, f"tp*ep = {tp}*{ep} != world size {world}"
    groups = layout_groups(tp, ep, rank)
    records = []
    for name in args.models.split(","):
        hidden, ffn, e_num, topk = MODELS[name]
        e_num, topk = args.experts or e_num, args.topk or topk
        hidden, ffn = hidden // args.scale, ffn // args.scale
        layer = Layer((hidden, ffn, e_num, topk, tp, ep), rank, world, device, groups)
        for m in [int(v) for v in args.tokens.split(",")]:
            t = m // world
            idx, w = routing(args.seed, [t] * world, hidden, e_num, topk, rank, args.skew, args.zero_experts, device)
            sets = []
            for s in range(args.input_sets):  # the routing's tokens rotated by s, as comet bench's input sets
                gen = torch.Generator(device=device).manual_seed(1000 * (args.seed + 7 * s) + rank)
                x = uniform_bf16((t, hidden), 1.0, gen, device)
                sets.append((x, idx.roll(-s, 0), w.roll(-s, 0)))
            if args.train:
                records.append(train_one(args, layer, name, m, sets, rank, world, device))
                continue
            y = layer.forward(*sets[0])
            err = layer.check(*sets[0], y)
            for i in range(args.warmup):
                layer.forward(*sets[i % len(sets)])
            times = []
            for i in range(args.iters):
                a, b = event(device), event(device)
                a.record()
                layer.forward(*sets[i % len(sets)])
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            ms = median_max_over_ranks(times, world, device)
            gemm = []  # an instrumented pass: time of the two grouped GEMMs + activation
            for i in range(args.iters):
                layer.gemm_events = (event(device), event(device))
                layer.forward(*sets[i % len(sets)])
                layer.gemm_events[1].synchronize()
                gemm.append(layer.gemm_events[0].elapsed_time(layer.gemm_events[1]))
            layer.gemm_events = None
            gemm_ms = median_max_over_ranks(gemm, world, device)
            flops = 2.0 * m * topk * hidden * ffn * 3 / world  # per GPU
            rec = {"model": name, "M": m, "tp": tp, "ep": ep, "topk": topk, "experts": e_num, "hidden": hidden,
                   "ffn": ffn, "skew": args.skew, "zero_experts": args.zero_experts, "ms": ms,
                   "gemm_ms": gemm_ms, "gemm_tflops": flops / (gemm_ms * 1e9), "gemm_share": gemm_ms / ms,
                   "check_rel_err": err, "iters": args.iters, "warmup": args.warmup}
            records.append(rec)
            if rank == 0:
                print(f"{name:14s} M={m:6d} TP={tp} EP={ep}  {ms:8.3f} ms  gemm {gemm_ms:7.3f} ms "
                      f"({rec['gemm_tflops']:6.1f} TFLOP/s, {100 * rec['gemm_share']:4.1f}% of layer)  "
                      f"check rel err {err:.2e}", flush=True)
            assert err < 2e-2, f"{name} M={m}: relative error {err} against the fp32 evaluation"
        del layer
        torch.cuda.empty_cache()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": describe(world), "baseline": "pytorch", "records": records}, f, indent=1)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
