"""test_torch_baseline.py - bench/torch_moe.py, the PyTorch layer comet is
benchmarked against, on the CPU (gloo processes under torchrun, a per-expert
matmul loop, a model shrunk by --scale): every layout it runs (EP, TP, and
EP x TP with comet's rank mapping) passes its own check against an fp32
evaluation of sampled tokens (the script asserts: relative error of y below
2e-2, of the training step's gradients below 5e-2), forward and --train. The
numbers it prints are read back here too, so a run that checked nothing
fails. Skipped as a whole without torch."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="torch is not installed: bench/torch_moe.py is not tested")
pytest.importorskip("torch.distributed.run", reason="torch.distributed is not available")
pytest.importorskip("numpy", reason="numpy is not installed: bench/torch_moe.py's routing needs it")

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "torch_moe.py")


def torchrun(nproc, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), SCRIPT,
           "--device", "cpu", "--models", "qwen2-moe", "--tokens", "128", "--scale", "4", "--iters", "1",
           "--warmup", "0", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, OMP_NUM_THREADS="1"), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.parametrize("nproc,layout", [(2, ("--ep", "2")), (2, ("--tp", "2")), (4, ("--tp", "2", "--ep", "2"))])
def test_layouts_pass_their_check(nproc, layout):
    tp = layout[layout.index("--tp") + 1] if "--tp" in layout else "1"
    ep = layout[layout.index("--ep") + 1] if "--ep" in layout else "1"
    fwd = torchrun(nproc, *layout)
    m = re.search(r"TP=%s EP=%s .* check rel err ([0-9.e+-]+)" % (tp, ep), fwd)
    assert m and float(m.group(1)) < 2e-2, fwd
    train = torchrun(nproc, "--train", *layout)
    m = re.search(r"TP=%s EP=%s +train: .* check rel err y ([0-9.e+-]+), dx ([0-9.e+-]+), d_topk_w ([0-9.e+-]+), "
                  r"dw1 ([0-9.e+-]+), dw2 ([0-9.e+-]+)" % (tp, ep), train)
    assert m, train
    errs = [float(v) for v in m.groups()]
    assert errs[0] < 2e-2 and max(errs) < 5e-2 and min(errs) > 0, errs  # 0: nothing compared


def fnv1a_ids(ids):
    """FNV-1a (64-bit) of expert ids, each id's four bytes little-endian (as tests/test_workload.c)."""
    h = 0xCBF29CE484222325
    for v in ids:
        for b in int(v).to_bytes(4, "little"):
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def test_routing_is_comet_bench_s():
    """torch_moe.routing draws the expert ids of `comet bench`'s problems (harness/workload.c): the values
    tests/test_workload.c pins for the C draw, so the baselines route the rows the C calls route."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        from torch_moe import routing
    finally:
        sys.path.pop(0)
    ids = [routing(1, [3, 3], 16, 8, 2, r)[0].reshape(-1).tolist() for r in (0, 1)]
    assert ids[0] + ids[1] == [5, 2, 2, 1, 1, 5, 6, 5, 4, 7, 4, 2]
    tokens = [37, 29, 11, 0]
    drawn = [routing(3, tokens, 40, 64, 4, r, skew=0.7, zero=5) for r in range(4)]
    assert fnv1a_ids(v for idx, _ in drawn for v in idx.reshape(-1).tolist()) == 0x67ABBB2681713B18
    for (idx, w), t in zip(drawn, tokens):  # distinct ids a token; weights a softmax
        assert idx.shape == (t, 4) and w.shape == (t, 4)
        assert all(len(set(row)) == 4 for row in idx.tolist())
        assert t == 0 or abs(float(w.sum(1).max()) - 1) < 1e-6
