"""moe_torch.py - the experts the way PyTorch users run them today
(Megatron-style), with autograd: bench/torch_moe.py's --train layer as a
module (same steps, same communication).

  EP (TP=1): permute by expert -> all-to-all (host sync for the split sizes,
             as Megatron's all-to-all dispatcher) -> regroup by local expert
             -> grouped GEMM, silu(gate) * up in bf16, grouped GEMM ->
             all-to-all back -> unpermute -> weighted top-k sum (fp32)
  TP (EP=1): all-gather tokens and routing -> permute -> grouped GEMMs on the
             rank's ffn slice -> weighted top-k sum -> reduce-scatter

The GEMMs are torch._grouped_mm on CUDA GPUs that run it (sm90+), else one
matmul per expert (CPU: _grouped_mm's backward does not run there). The
all-to-alls, all-gathers and reduce-scatters are autograd Functions over
torch.distributed (the backward of an all-to-all is the all-to-all with the
splits swapped). Weights: comet's layout, w1 (E_local, 2*F_local, H) [gate
slice; up slice], w2 (E_local, H, F_local), bf16.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        gi = g.new_empty(sum(in_splits), *g.shape[1:])
        dist.all_to_all_single(gi, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return gi, None, None, None


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, world, group):
        ctx.world, ctx.group = world, group
        out = x.new_empty(world * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        gi = g.new_empty(g.shape[0] // ctx.world, *g.shape[1:])
        dist.reduce_scatter_tensor(gi, g.contiguous(), group=ctx.group)
        return gi, None, None


class ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, world, group):
        ctx.world, ctx.group = world, group
        out = x.new_empty(x.shape[0] // world, *x.shape[1:])
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        gi = g.new_empty(ctx.world * g.shape[0], *g.shape[1:])
        dist.all_gather_into_tensor(gi, g.contiguous(), group=ctx.group)
        return gi, None, None


def _inverse(perm):
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def grouped_mm_works(device: torch.device) -> bool:
    """torch._grouped_mm (forward and backward) on this device: CUDA sm90+."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


class TorchExperts(torch.nn.Module):
    """One rank's experts of a TP x EP world (TP == 1 or EP == 1), forward
    (x (T, H), topk_idx (T, k), topk_w (T, k) fp32) -> y (T, H) bf16, every
    rank its own tokens. w1, w2: bf16 Parameters, comet's layout."""

    def __init__(self, w1, w2, *, num_experts, tp=1, ep=1, rank=0, group=None):
        super().__init__()
        assert tp == 1 or ep == 1, "the PyTorch layer runs TP or EP, not both (comet runs both)"
        self.w1 = torch.nn.Parameter(w1.detach().contiguous())
        self.w2 = torch.nn.Parameter(w2.detach().contiguous())
        self.num_experts, self.tp, self.ep, self.rank, self.group = num_experts, tp, ep, rank, group
        self.el, self.fl = w1.shape[0], w2.shape[2]
        self.grouped = grouped_mm_works(w1.device)
        self.split_k = False  # a control run: each GEMM summed in another order (halves of K, the second first)

    def _mm(self, a, w):
        """a @ w.t() in bf16; with split_k the fp32 sum of the two halves of K, the second half first, then
        rounded to bf16: the same GEMM summed in another order (what two correct kernels may differ by)."""
        if not self.split_k:
            return a @ w.t()
        k = a.shape[1] // 2
        return (a[:, k:].float() @ w[:, k:].float().t() + a[:, :k].float() @ w[:, :k].float().t()).to(a.dtype)

    @staticmethod
    def _gmm(a, w, offs, split_k):
        """torch._grouped_mm of a's rows with their experts' w (E, N, K), bf16 out; with split_k the two
        halves of K, each its own grouped GEMM rounded to bf16, summed in fp32 (the second first) and
        rounded again: one more rounding a GEMM than the per-expert path's fp32 halves."""
        wt = w.transpose(1, 2)
        if not split_k:
            return torch._grouped_mm(a, wt, offs=offs)
        k = a.shape[1] // 2
        hi = torch._grouped_mm(a[:, k:], wt[:, k:, :], offs=offs)
        lo = torch._grouped_mm(a[:, :k], wt[:, :k, :], offs=offs)
        return (hi.float() + lo.float()).to(a.dtype)

    def experts(self, rows, counts):
        if self.grouped:
            offs = torch.cumsum(counts, 0).to(torch.int32)
            g = self._gmm(rows, self.w1, offs, self.split_k)
            return self._gmm(F.silu(g[:, :self.fl]) * g[:, self.fl:], self.w2, offs, self.split_k)
        outs = []
        for e, r in enumerate(torch.split(rows, counts.tolist())):
            g = self._mm(r, self.w1[e])
            outs.append(self._mm(F.silu(g[:, :self.fl]) * g[:, self.fl:], self.w2[e]))
        return torch.cat(outs)

    def forward(self, x, idx, w):
        x = x.to(torch.bfloat16)
        w = w.float()
        return self._tp(x, idx, w) if self.tp > 1 else self._ep(x, idx, w)

    def _ep(self, x, idx, w):
        t, k, wsz, el = x.shape[0], idx.shape[1], self.ep, self.el
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        x_perm = x.index_select(0, order // k)
        counts = torch.bincount(flat, minlength=self.num_experts)
        if wsz == 1:
            back = self.experts(x_perm, counts)
        else:
            counts_recv = torch.empty_like(counts)
            dist.all_to_all_single(counts_recv, counts, group=self.group)
            splits = torch.stack([counts.view(wsz, el).sum(1), counts_recv.view(wsz, el).sum(1)]).cpu()  # host sync
            send, recv_n = splits[0].tolist(), splits[1].tolist()
            recv = AllToAll.apply(x_perm, recv_n, send, self.group)
            chunk = torch.repeat_interleave(torch.arange(wsz * el, device=x.device), counts_recv,
                                            output_size=recv.shape[0])
            perm2 = torch.argsort((chunk % el) * wsz + chunk // el, stable=True)  # (source, expert) -> (expert, source)
            o = self.experts(recv.index_select(0, perm2), counts_recv.view(wsz, el).sum(0))
            back = AllToAll.apply(o.index_select(0, _inverse(perm2)), send, recv_n, self.group)
        slots = back.index_select(0, _inverse(order))
        return (slots.view(t, k, -1).float() * w.unsqueeze(-1)).sum(1).to(torch.bfloat16)

    def _tp(self, x, idx, w):
        t, k, wsz = x.shape[0], idx.shape[1], self.tp
        x_all = AllGather.apply(x, wsz, self.group)
        w_all = AllGather.apply(w, wsz, self.group)
        idx_all = idx.new_empty(wsz * t, k)
        dist.all_gather_into_tensor(idx_all, idx.contiguous(), group=self.group)
        flat = idx_all.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.el)
        o = self.experts(x_all.index_select(0, order // k), counts)
        slots = o.index_select(0, _inverse(order))
        part = (slots.view(wsz * t, k, -1).float() * w_all.unsqueeze(-1)).sum(1).to(torch.bfloat16)
        return ReduceScatter.apply(part, wsz, self.group)
