#!/usr/bin/env python3
"""router_collapse.py - why examples/train's routers collapse: trains a preset
(default `tiny`, on the CPU, PyTorch experts) while a hook on MoE.route prints,
for every layer and step, |mean of the MoE input| / mean |input - mean| (how
much of the router's input is one shared vector), the router logits' std over
tokens, and the range of the experts' mean logits. A collapsed router shows a
ratio >> 1 and a logit spread over tokens far below the experts' range.

    PYTHONPATH=python python dev/router_collapse.py [--steps 15] [train.py options]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "train"))
import train  # noqa: E402

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


if __name__ == "__main__":
    train.MoE.route = traced
    args = sys.argv[1:]
    if "--steps" not in args:
        args += ["--steps", "15"]
    out = train.main(["--config", "tiny", "--device", "cpu", "--experts", "torch", "--quiet", *args])
    layers = len(rows) // max(1, len(out["losses"]))
    print("step  layer  |mean| / spread  logit std over tokens  experts' mean-logit range")
    for i, (ratio, spread, rng) in enumerate(rows):
        print("%4d  %5d  %15.2f  %21.4f  %25.4f" % (i // layers + 1, i % layers, ratio, spread, rng))
