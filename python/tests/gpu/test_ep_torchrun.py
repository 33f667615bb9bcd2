"""test_ep_torchrun.py - runs ep_torchrun.py (comet.torch over a
torch.distributed group, one GPU a process) under torchrun on 2 GPUs;
skipped without 2 GPUs and a CUDA build of comet."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import comet  # noqa: E402


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and comet.device_count() >= 2),
                    reason="needs 2 GPUs and a CUDA build of comet: comet.torch over a process group is not tested")
def test_ep_torchrun():
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ep_torchrun.py")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          script], capture_output=True, text=True, timeout=600)
    print(out.stdout[-8000:], out.stderr[-4000:])
    assert out.returncode == 0 and "0 failed" in out.stdout
