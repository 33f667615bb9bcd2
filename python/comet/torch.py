"""comet.torch - comet's MoE experts as a PyTorch op (needs torch).

    y = comet.torch.moe_experts(x, topk_idx, topk_w, w1, w2, activation="silu_gated")

is `torch.ops.comet.moe_experts`, a torch.library custom op with a fake
(meta) implementation, so it runs eagerly and under torch.compile
(fullgraph=True included). This process holds every expert: the op runs a
one-rank comet world (W = 1, TP = EP = 1) on the tensors' device.

- CPU tensors run comet's CPU engine (python/tests/test_torch.py, where torch
  is installed: bitwise against comet.reference_forward and against a
  pure-torch implementation of comet.h's semantics).
- CUDA tensors run comet's CUDA backend on the tensors' device and the current
  stream, in a build with the CUDA backend (`pip install .` where nvcc and
  torch's NCCL are found). NOT YET RUN: written to the C API's contract;
  python/tests/test_torch.py's CUDA tests run where torch and comet see a GPU
  (they skip elsewhere, CI included). The forward is asynchronous; routing
  content (expert ids in range, distinct per row) is checked on the device
  and reported by comet.torch.synchronize().

The worlds and layers live in a cache kept out of the graph, one layer per
(device, H, F, E, topk, activation), sized for the largest T seen (rounded up
to a power of two); clear_cache() frees them.

Forward only: the op has no backward yet (it comes with comet's backward);
autograd through it raises NotImplementedError.
"""

import threading
from typing import Dict, Tuple

import torch
from torch import Tensor

import comet

__all__ = ["moe_experts", "clear_cache", "synchronize"]

_ACTIVATIONS = ("silu_gated", "gelu")


# ---------------------------------------------------------------------------
# Checks (the eager op and its fake share them, so compile-time tracing fails
# with the same messages).
# ---------------------------------------------------------------------------
def _check(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w1: Tensor, w2: Tensor, activation: str) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError('moe_experts: activation %r is not "silu_gated" or "gelu"' % (activation,))
    named = (("x", x, torch.bfloat16, 2), ("topk_idx", topk_idx, torch.int32, 2), ("topk_w", topk_w, torch.float32, 2),
             ("w1", w1, torch.bfloat16, 3), ("w2", w2, torch.bfloat16, 3))
    for name, t, dtype, ndim in named:
        if t.dtype != dtype:
            raise TypeError("moe_experts: %s must be %s, got %s" % (name, dtype, t.dtype))
        if t.dim() != ndim:
            raise ValueError("moe_experts: %s must be %d-d, got shape %s" % (name, ndim, tuple(t.shape)))
        if t.device != x.device:
            raise ValueError("moe_experts: %s is on %s, x on %s: every tensor must be on one device"
                             % (name, t.device, x.device))
        if not t.is_contiguous():
            raise ValueError("moe_experts: %s must be contiguous (row-major, densely packed): call .contiguous()"
                             % name)
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError("moe_experts: tensors on %s: comet runs CPU and CUDA tensors" % x.device)
    T, H = x.shape
    E, rows, H1 = w1.shape
    F = w2.shape[2]
    if topk_idx.shape != topk_w.shape or topk_idx.shape[0] != T:
        raise ValueError("moe_experts: topk_idx %s and topk_w %s must both be (T=%s, topk)"
                         % (tuple(topk_idx.shape), tuple(topk_w.shape), T))
    want_rows = 2 * F if activation == "silu_gated" else F
    if H1 != H or rows != want_rows:
        raise ValueError("moe_experts: w1 must be (E, %s, H=%s) for %s with w2 (E, H, F=%s), got %s"
                         % ("2F" if activation == "silu_gated" else "F", H, activation, F, tuple(w1.shape)))
    if tuple(w2.shape) != (E, H, F):
        raise ValueError("moe_experts: w2 must be (E=%s, H=%s, F), got %s" % (E, H, tuple(w2.shape)))
    if not 1 <= topk_idx.shape[1] <= E:
        raise ValueError("moe_experts: topk %s is outside [1, E=%s]" % (topk_idx.shape[1], E))


# ---------------------------------------------------------------------------
# The layers behind the op, kept out of the graph.
# ---------------------------------------------------------------------------
class _Entry:
    """One cached layer: its world, the T it is sized for, and the lock that
    keeps its calls on one thread at a time."""

    def __init__(self):
        self.lock = threading.Lock()
        self.layer = None
        self.max_tokens = 0


_cache_lock = threading.Lock()
_worlds: Dict[Tuple[str, int], comet.World] = {}
_layers: Dict[tuple, _Entry] = {}


def _world(device: torch.device) -> comet.World:
    key = (device.type, device.index if device.index is not None else -1)
    world = _worlds.get(key)
    if world is None:
        if device.type == "cpu":
            world = comet.World(1, "cpu")
        else:  # UNTESTED: a one-rank world on this device (comet_world_create_nccl with its own id)
            with torch.cuda.device(device):
                world = comet.World.from_unique_id(0, 1, comet.get_unique_id(), device.index)
        _worlds[key] = world
    return world


def _entry(device: torch.device, H: int, F: int, E: int, topk: int, activation: str) -> _Entry:
    key = (str(device), H, F, E, topk, activation)
    with _cache_lock:
        entry = _layers.get(key)
        if entry is None:
            entry = _layers[key] = _Entry()
        return entry


def _desc(t: Tensor, dtype: comet.DType) -> comet.TensorDesc:
    return comet.TensorDesc(t.data_ptr(), dtype, tuple(t.shape))


def _run(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w1: Tensor, w2: Tensor, activation: str) -> Tensor:
    _check(x, topk_idx, topk_w, w1, w2, activation)
    T, H = x.shape
    E, _, _ = w1.shape
    F, topk = w2.shape[2], topk_idx.shape[1]
    y = torch.empty_like(x)
    if T == 0:
        return y
    device = x.device
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    entry = _entry(device, H, F, E, topk, activation)
    with entry.lock:
        if T > entry.max_tokens:  # (re)create, sized for the next power of two
            max_tokens = max(128, 1 << (T - 1).bit_length())
            cfg = comet.LayerConfig(hidden=H, ffn=F, num_experts=E, topk=topk, max_tokens_per_rank=max_tokens,
                                    activation=activation)
            with _cache_lock:
                world = _world(device)
            if entry.layer is not None:
                entry.layer.close()
                entry.layer, entry.max_tokens = None, 0
            entry.layer = world.layer(0, cfg)
            entry.max_tokens = max_tokens
        args = (_desc(x, comet.DType.BF16), _desc(topk_idx, comet.DType.INT32), _desc(topk_w, comet.DType.FP32),
                _desc(w1, comet.DType.BF16), _desc(w2, comet.DType.BF16), _desc(y, comet.DType.BF16))
        if device.type == "cpu":
            entry.layer.forward(*args)
        else:  # UNTESTED: the CUDA backend, asynchronous on the current stream
            with torch.cuda.device(device):
                entry.layer.forward(*args, stream=torch.cuda.current_stream(device).cuda_stream)
    return y


def clear_cache() -> None:
    """Close every cached layer and world (their memory is freed). Not while
    an op runs on another thread."""
    with _cache_lock:
        entries = list(_layers.values())
        _layers.clear()
        worlds = list(_worlds.values())
        _worlds.clear()
    for entry in entries:
        with entry.lock:
            if entry.layer is not None:
                entry.layer.close()
                entry.layer = None
    for world in worlds:
        world.close()


def synchronize(device=None) -> None:
    """Wait for the last forward of every cached layer on `device` (None: all)
    and raise what comet found (CUDA: comet.InvalidRouting for expert ids out
    of range or repeated in a row). On CPU tensors every error is raised by the
    op itself; this returns at once. UNTESTED on CUDA."""
    device = None if device is None else str(torch.device(device))
    with _cache_lock:
        entries = [(k, e) for k, e in _layers.items() if device is None or k[0] == device]
    for _, entry in entries:
        with entry.lock:
            if entry.layer is not None:
                try:
                    entry.layer.sync()
                except comet.InvalidArgument as e:  # no forward yet on this layer
                    if "no forward" not in e.message:
                        raise


# ---------------------------------------------------------------------------
# The op.
# ---------------------------------------------------------------------------
@torch.library.custom_op("comet::moe_experts", mutates_args=())
def _moe_experts(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w1: Tensor, w2: Tensor, activation: str) -> Tensor:
    return _run(x, topk_idx, topk_w, w1, w2, activation)


@_moe_experts.register_fake
def _moe_experts_fake(x, topk_idx, topk_w, w1, w2, activation):
    _check(x, topk_idx, topk_w, w1, w2, activation)
    return torch.empty_like(x)  # (T, H) bf16


def _backward(ctx, grad):
    raise NotImplementedError(
        "comet.torch.moe_experts has no backward yet: it comes with comet's backward (comet_reference_backward is "
        "the specification); run the forward under torch.no_grad() or detach its inputs")


def _setup_context(ctx, inputs, output):
    pass


_moe_experts.register_autograd(_backward, setup_context=_setup_context)


def moe_experts(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w1: Tensor, w2: Tensor, *,
                activation: str = "silu_gated") -> Tensor:
    """The MoE experts of one layer, every expert in this process:

        y[t] = sum_j topk_w[t, j] * FFN_{topk_idx[t, j]}(x[t])
        FFN_e(x) = act(x w1[e]^T) w2[e]^T

    with comet.h's rounding points: fp32 accumulation; the activation in fp32,
    h stored bf16; the expert output o stored bf16; the weighted sum over the
    slots in fp32 in slot order (fma), then y stored bf16.

    Args:
        x: (T, H) bfloat16, the tokens.
        topk_idx: (T, topk) int32 or int64 (converted to int32): expert ids in
            [0, E), distinct within a row.
        topk_w: (T, topk) float32 routing weights (bfloat16/float16 are
            converted to float32, exactly).
        w1: (E, 2F, H) bfloat16 for activation="silu_gated" (rows [0, F) the
            gate, [F, 2F) the up projection: h = silu(gate) * up);
            (E, F, H) for "gelu" (h = gelu(x w1^T), erf form).
        w2: (E, H, F) bfloat16.
        activation: "silu_gated" or "gelu".

    Returns:
        y: (T, H) bfloat16, on x's device.

    Every tensor must be on x's device (CPU, or CUDA with a CUDA build of
    comet); x, topk_idx and topk_w are made contiguous (a copy when they are
    not), w1 and w2 must be contiguous. Raises TypeError or ValueError for a
    wrong dtype, shape or device, and comet.InvalidRouting (a ValueError,
    carrying comet's message) for an expert id out of range or repeated in a
    row (CUDA: reported by synchronize()). No backward yet.
    """
    if not isinstance(x, Tensor):
        raise TypeError("moe_experts: x must be a torch.Tensor, got %s" % type(x).__name__)
    if topk_idx.dtype == torch.int64:
        topk_idx = topk_idx.to(torch.int32)
    if topk_w.dtype in (torch.bfloat16, torch.float16):
        topk_w = topk_w.to(torch.float32)
    return _moe_experts(x.contiguous(), topk_idx.contiguous(), topk_w.contiguous(), w1, w2, activation)
