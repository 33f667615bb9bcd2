#!/usr/bin/env python3
"""router_collapse.py - why examples/train's routers collapse: trains a preset
(default `tiny`, on the CPU, PyTorch experts) while a hook on MoE.route prints,
for every layer and step, |mean of the MoE input| / mean |input - mean| (how
much of the router's input is one shared vector), the router logits' std over
tokens, and the range of the experts' mean logits. A collapsed router shows a
ratio >> 1 and a logit spread over tokens far below the experts' range.

    PYTHONPATH=python python dev/router_collapse.py [--steps 15] [train.py options]

--proxy: mixtral-2gpu's CPU proxy instead (H 4096, 3 layers, 8 experts top-2, its
lr schedule of 300 steps, stopped after --stop-after, default 60; 2 x 256 tokens a
step, bf16 autocast, PyTorch experts, fused AdamW) whose experts have F 256 but
act like F 14336 (FREAL) in the two ways that matter for the router: the down
projection w2 is S x a parameter (S = FREAL / F = 56), the parameter initialised to
w2_init sqrt(FREAL / F) / S, so the experts' output at init is as large as the
GPU model's and one Adam step (lr a parameter element) moves the output of a
coherent input by lr x S x F = lr x FREAL, as on the GPU.

Both print a table of every layer and step (the statistics above and the max
load, the most loaded expert's routed slots over the mean) and, every 5
steps, the worst layer's max load and the loss (the step's and the mean of
the last 5). train.py's options pass through (e.g. --router sinkhorn or
--router softmax, --lr, --aux-loss). --sweep adds, for every layer and step,
the max load each selection would give that step's logits: softmax top-k and
train.sinkhorn_topk after 1 to 32 iterations (how its count was chosen).

    PYTHONPATH=python python dev/router_collapse.py --proxy [--stop-after 60] [--sweep] [train.py options]

Results (2 CPU cores shared with other jobs, ~3-12 s a step; max load of the worst
layer, 4.0 = every token to the same 2 experts):
  The proxy without the F emulation (S = 1, F 256) does not collapse in 38 steps
  (max 2.6): small experts get small Adam steps (lr x 256), so the earlier proxies
  were too gentle. With it, the preset's defaults collapse like the GPU run, a
  bit sooner (2.81 at step 10, 3.98 at 15, 4.0 at 20; GPU 3.09 at 12, 4.0 at 48),
  while the MoE input's |mean| / spread stays 0.26-0.32 in every layer: on this
  proxy the routers do not collapse because the input is one shared vector (as on
  `tiny`), but while the experts' outputs grow fast (layer 2's output spread 48 ->
  144 in 12 steps).
  (candidates: see examples/train/README.md, "The router collapse on the CPU proxy")
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "train"))
import train  # noqa: E402
from moe_torch import TorchExperts  # noqa: E402

FREAL, PROXY_F = 14336, 256

SWEEP_ITERS = (1, 2, 4, 8, 12, 16, 32)
rows, loads, sweeps = [], [], []
sweep = False
route = train.MoE.route


def max_load(topi, experts):
    n = torch.bincount(topi.reshape(-1), minlength=experts).float()
    return float(n.max() / n.mean())


def traced(self, h):
    if not self.training:  # validation's calls
        return route(self, h)
    with torch.no_grad():
        hf = h.float()
        mean = hf.mean(0)
        logits = torch.nn.functional.linear(hf, self.router.weight.float())
        rows.append((float(mean.norm() / (hf - mean).norm(dim=-1).mean()), float(logits.std(0).mean()),
                     float(logits.mean(0).max() - logits.mean(0).min())))
        if sweep:  # the max load this layer's logits would get from each selection
            sweeps.append([max_load(logits.topk(self.topk, -1).indices, self.E)] +
                          [max_load(train.sinkhorn_topk(logits, self.topk, n), self.E) for n in SWEEP_ITERS])
    out = route(self, h)
    loads.append(max_load(out[1], self.E))
    return out


def proxy_patches(s):
    """The F emulation (w2 = s x parameter) and fused AdamW (CPU: no parameter-sized temporaries)."""
    adamw = torch.optim.AdamW

    def fused_adamw(*a, **k):
        k["fused"] = True
        return adamw(*a, **k)
    torch.optim.AdamW = fused_adamw
    expert_weights = train.expert_weights

    def weights(c, *a, **k):
        w1, w2 = expert_weights(c, *a, **k)
        return w1, (w2.float() * math.sqrt(FREAL / c.ffn) / s).to(w2.dtype)
    train.expert_weights = weights

    def experts(self, rows, counts):
        outs = []
        for e, r in enumerate(torch.split(rows, counts.tolist())):
            g = r @ self.w1[e].t()
            outs.append((torch.nn.functional.silu(g[:, :self.fl]) * g[:, self.fl:]) @ (self.w2[e] * s).t())
        return torch.cat(outs)
    TorchExperts.experts = experts


if __name__ == "__main__":
    train.MoE.route = traced
    args = sys.argv[1:]
    if "--sweep" in args:
        args.remove("--sweep")
        sweep = True
    if "--proxy" in args:
        args.remove("--proxy")
        proxy_patches(FREAL / PROXY_F)
        if "--stop-after" not in args:
            args += ["--stop-after", "60"]
        out = train.main(["--config", "mixtral-2gpu", "--experts", "torch", "--device", "cpu", "--dtype", "bf16",
                          "--no-compile", "--set", "ffn=%d" % PROXY_F, "--seq-len", "256", "--batch-size", "2",
                          "--accum", "1", "--val-every", "0", "--set", "val_batches=1", "--log-every", "5", *args])
    else:
        if "--steps" not in args:
            args += ["--steps", "15"]
        out = train.main(["--config", "tiny", "--device", "cpu", "--experts", "torch", "--quiet", *args])
    losses = out["losses"]
    layers = len(rows) // max(1, len(losses))
    print("step  layer  |mean| / spread  logit std over tokens  experts' mean-logit range  max load")
    for i, (ratio, spread, rng) in enumerate(rows):
        print("%4d  %5d  %15.2f  %21.4f  %25.4f  %8.2f" % (i // layers + 1, i % layers, ratio, spread, rng, loads[i]))
    if sweep:
        print("max load of each layer's logits selected by softmax top-k and by Sinkhorn top-k after N iterations")
        print("step  layer  softmax" + "".join("%7s" % ("N=%d" % n) for n in SWEEP_ITERS))
        for i, v in enumerate(sweeps):
            print("%4d  %5d  %7.2f" % (i // layers + 1, i % layers, v[0]) + "".join("%7.2f" % x for x in v[1:]))
    print("step  max load (worst layer)  loss  loss (mean of the last 5 steps)")
    for step in range(5, len(losses) + 1, 5):
        last = losses[max(0, step - 5):step]
        print("%4d  %22.2f  %.4f  %.4f" % (step, max(loads[(step - 1) * layers:step * layers]), losses[step - 1],
                                            sum(last) / len(last)))
