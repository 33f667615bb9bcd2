"""conftest.py - shared by the Python tests: which comet they test (printed in
pytest's header), the repository root, and small problems whose inputs are
made without numpy or torch (bf16 bits from Python floats)."""

import os
import random
import struct

import pytest

import comet

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_report_header(config):
    info = comet.build_info()
    return "comet %s: %s (%s%s)" % (
        comet.version(), info["library"], info["origin"],
        ", %s build" % info["backend"] if "backend" in info else "")


def bf16_bits(f):
    """The bf16 bits of a Python float, rounded to nearest even."""
    u = struct.unpack("<I", struct.pack("<f", f))[0]
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def small_config(**kw):
    args = dict(hidden=60, ffn=20, num_experts=4, topk=2, max_tokens_per_rank=40)
    args.update(kw)
    return comet.LayerConfig(**args)


def routing(rng, tokens, num_experts, topk):
    """topk distinct expert ids a token (a flat list, row-major) and weights."""
    idx, w = [], []
    for _ in range(tokens):
        idx += rng.sample(range(num_experts), topk)
        w += [rng.uniform(0.1, 1.0) for _ in range(topk)]
    return idx, w


@pytest.fixture
def rng():
    return random.Random(1234)
