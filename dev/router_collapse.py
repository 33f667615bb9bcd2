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
coherent input by lr x S x F = lr x FREAL, as on the GPU. Prints max load at
steps 10/20/40/60 and the loss.

    PYTHONPATH=python python dev/router_collapse.py --proxy [--stop-after 60] [train.py options]

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

rows = []
route = train.MoE.route


def traced(self, h):
    if not self.training:  # validation's calls
        return route(self, h)
    with torch.no_grad():
        hf = h.float()
        mean = hf.mean(0)
        logits = torch.nn.functional.linear(hf, self.router.weight.float())
        rows.append((float(mean.norm() / (hf - mean).norm(dim=-1).mean()), float(logits.std(0).mean()),
                     float(logits.mean(0).max() - logits.mean(0).min())))
    return route(self, h)


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
    layers = len(rows) // max(1, len(out["losses"]))
    print("step  layer  |mean| / spread  logit std over tokens  experts' mean-logit range")
    for i, (ratio, spread, rng) in enumerate(rows):
        print("%4d  %5d  %15.2f  %21.4f  %25.4f" % (i // layers + 1, i % layers, ratio, spread, rng))
