"""comet.torch - comet's MoE experts as a PyTorch op (needs torch).

    y = comet.torch.moe_experts(x, topk_idx, topk_w, w1, w2, activation="silu_gated")

runs `torch.ops.comet.moe_experts`, a torch.library custom op with a fake
(meta) implementation and a registered autograd, so it runs eagerly, under
torch.compile (fullgraph=True, dynamic shapes included), activation
checkpointing and autograd. The process holds every expert: the op runs a
one-rank comet world (W = 1, TP = EP = 1) on the tensors' device.

- CPU tensors run comet's CPU engine (python/tests/test_torch.py: bitwise
  against comet.reference_forward and a pure-torch implementation of
  comet.h's semantics).
- CUDA tensors run comet's CUDA backend on the tensors' device and the
  current stream, in a build with the CUDA backend (`pip install .` where
  nvcc and torch's NCCL are found; python/tests run their CUDA cases and
  python/tests/gpu the 2-GPU ones where torch and comet see GPUs). The
  forward is asynchronous; routing content (expert ids in range, distinct
  per row) is checked on the device and reported by synchronize().

Training. The op returns (y, saved): with save="activations" (the default)
a forward that autograd records keeps its saved state (every routed row's
gu and h, comet_layer_saved_bytes) in a uint8 tensor from torch's
allocator, one per forward, so any number of micro-batches may be in
flight; save="recompute" keeps nothing and the backward reruns GEMM0. The
backward, the op `torch.ops.comet.moe_experts_backward`, calls
comet_layer_backward on the forward's layer (CUDA: on the current stream)
and returns dx (bf16), d_topk_w (fp32), dw1 and dw2 (bf16, the weights'
layouts; no gradient for topk_idx): CPU tensors on the CPU engine (bitwise
comet_reference_backward's), CUDA tensors on the CUDA backend.
python/tests/test_autograd.py and test_training.py test it.

Main grads (Megatron's gradient-accumulation fusion). MoEExperts(...,
main_grad=True) keeps fp32 buffers w1.main_grad and w2.main_grad
(attributes on the Parameters, as Megatron's DDP sets them; zeroed by
zero_main_grad() or by their owner) and its backward adds dW1, dW2 to them
in fp32 (comet_layer_backward with accumulate = 1: the call's fp32 sum added
once per element, no bf16 rounding) and gives w1, w2 no gradient (.grad
stays None); moe_experts(..., main_grads=(g1, g2)) does the same for
weights held elsewhere. The buffers go to the forward op as inputs it only
checks, ride on the autograd context (not saved tensors: every backward
in flight mutates them), and the backward op
`torch.ops.comet.moe_experts_backward_accumulate` mutates them
(mutates_args), so micro-batches in flight, activation checkpointing and
torch.compile(fullgraph=True) work; python/tests/test_main_grad.py.

Layers live out of the graph. The one-rank layers are cached per (device,
H, F, E, topk, activation, token bound), the bound being T rounded up to a
power of two (at least 128); each stays until clear_cache(), so the saved
state of a forward stays valid for its backward. A MoEExperts built with
world= (world_from_group: the ranks of a torch.distributed group, one GPU
each) owns a layer of that world instead, and the op names it by an id.

comet.torch.MoEExperts is an nn.Module holding one rank's w1 and w2, built
from HF Mixtral / Qwen-MoE experts, fused or Megatron weights through
comet.convert; its forward is this op. patch_model(model) puts it into an
HF transformers Mixtral / Qwen2-MoE / Qwen3-MoE model in place of each
sparse MoE block's experts.
"""

import contextlib
import ctypes
import itertools
import threading
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

import comet

__all__ = ["moe_experts", "clear_cache", "synchronize", "MoEExperts", "world_from_group", "patch_model"]

_ACTIVATIONS = ("silu_gated", "gelu")
_SAVES = ("activations", "recompute", "none")


# ---------------------------------------------------------------------------
# Checks (the eager ops and their fakes share them, so compile-time tracing
# fails with the same messages).
# ---------------------------------------------------------------------------
def _check(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w1: Tensor, w2: Tensor, activation: str,
           ep: int = 1) -> None:
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
    if not 1 <= topk_idx.shape[1] <= E * ep:
        raise ValueError("moe_experts: topk %s is outside [1, E=%s]" % (topk_idx.shape[1], E * ep))


def _check_save(save: str) -> None:
    if save not in _SAVES:
        raise ValueError('moe_experts: save %r is not "activations", "recompute" or "none"' % (save,))


# ---------------------------------------------------------------------------
# The layers behind the ops, kept out of the graph: the op's `layer`
# argument is 0 for this process's one-rank layers (cached per device, shape
# and token bound) or the id of a layer over a torch.distributed group
# (MoEExperts with world=).
# ---------------------------------------------------------------------------
class _Entry:
    """One layer, and the lock that keeps its calls on one thread at a time."""

    def __init__(self, layer: comet.Layer):
        self.lock = threading.Lock()
        self.layer = layer
        self.saved_bytes = layer.saved_bytes("activations")


_cache_lock = threading.Lock()
_worlds: Dict[Tuple[str, int], comet.World] = {}
_cached: Dict[tuple, _Entry] = {}
_registered: Dict[int, _Entry] = {}
_next_id = itertools.count(1)
_accumulate_lock = threading.Lock()


def _device(t: Tensor) -> torch.device:
    """t's device with its index (CUDA: the current device when unnamed)."""
    if t.device.type == "cuda" and t.device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return t.device


def _world(device: torch.device) -> comet.World:
    key = (device.type, device.index if device.index is not None else -1)
    world = _worlds.get(key)
    if world is None:
        if device.type == "cpu":
            world = comet.World(1, "cpu")
        else:
            if comet.device_count() == 0:
                raise RuntimeError("moe_experts: CUDA tensors need a build of comet with the CUDA backend and a GPU it "
                                   "sees; this libcomet.so sees none (%s)" % comet.build_info().get(
                                       "reason", "comet.build_info()"))
            with torch.cuda.device(device):  # a one-rank world on this device
                world = comet.World.from_unique_id(0, 1, comet.get_unique_id(), device.index)
        _worlds[key] = world
    return world


def _max_tokens(T: int) -> int:
    """The token bound of the one-rank layer that runs T tokens: the next
    power of two, at least 128 (a handful of layers for any mix of T)."""
    return max(128, 1 << (T - 1).bit_length())


def _one_rank(device: torch.device, H: int, F: int, E: int, topk: int, activation: str, T: int) -> _Entry:
    key = (str(device), H, F, E, topk, activation, _max_tokens(T))
    with _cache_lock:
        entry = _cached.get(key)
        if entry is None:
            cfg = comet.LayerConfig(hidden=H, ffn=F, num_experts=E, topk=topk, max_tokens_per_rank=key[-1],
                                    activation=activation)
            entry = _cached[key] = _Entry(_world(device).layer(0, cfg))
        return entry


def _registered_entry(layer: int) -> _Entry:
    entry = _registered.get(layer)
    if entry is None:
        raise ValueError("moe_experts: layer %d is not a live comet.torch layer (closed, or from another process)"
                         % layer)
    return entry


def _entry(layer: int, x: Tensor, topk_idx: Tensor, w1: Tensor, w2: Tensor, activation: str) -> _Entry:
    if layer:
        return _registered_entry(layer)
    return _one_rank(_device(x), x.shape[1], w2.shape[2], w1.shape[0], topk_idx.shape[1], activation, x.shape[0])


def _ep(layer: int) -> int:
    return _registered_entry(layer).layer.config.ep if layer else 1


_SHAPE = ctypes.c_int64 * comet._capi.COMET_MAX_DIMS


def _desc(t: Tensor, dtype: comet.DType) -> comet._capi.comet_tensor_t:
    """The C descriptor of a contiguous tensor of 1 to 4 dims, built directly (half a TensorDesc's host time:
    a training step passes 18)"""
    shape = t.shape
    return comet._capi.comet_tensor_t(t.data_ptr() or None, dtype, len(shape), _SHAPE(*shape))


def _stream(device: torch.device):
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


def clear_cache() -> None:
    """Close every cached one-rank layer and world (their memory is freed).
    Not while an op runs on another thread, nor between a training forward
    and its backward (the backward refuses state saved by a closed layer)."""
    with _cache_lock:
        entries = list(_cached.values())
        _cached.clear()
        worlds = list(_worlds.values())
        _worlds.clear()
    for entry in entries:
        with entry.lock:
            entry.layer.close()
    for world in worlds:
        world.close()


def synchronize(device=None) -> None:
    """Wait for the last forward or backward of every layer on `device`
    (None: all) and raise what comet found (CUDA: comet.InvalidRouting for
    expert ids out of range or repeated in a row). On CPU tensors every error
    is raised by the op itself; this returns at once (python/tests/test_torch.py
    checks both)."""
    device = None if device is None else str(torch.device(device))
    with _cache_lock:
        entries = [e for k, e in _cached.items() if device is None or k[0] == device]
        entries += list(_registered.values()) if device is None or device.startswith("cuda") else []
    for entry in entries:
        with entry.lock:
            try:
                entry.layer.sync()
            except comet.InvalidArgument as e:  # no forward yet on this layer
                if "no forward" not in e.message:
                    raise


# ---------------------------------------------------------------------------
# The ops.
# ---------------------------------------------------------------------------
def _run(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w1: Tensor, w2: Tensor, activation: str, save: str,
         layer: int) -> Tuple[Tensor, Tensor]:
    _check_save(save)
    _check(x, topk_idx, topk_w, w1, w2, activation, _ep(layer))
    y = torch.empty_like(x)
    if x.shape[0] == 0 and not layer:  # one rank, no tokens: no layer needed
        return y, x.new_empty((0,), dtype=torch.uint8)
    entry = _entry(layer, x, topk_idx, w1, w2, activation)
    saved = x.new_empty((entry.saved_bytes if save == "activations" else 0,), dtype=torch.uint8)
    device = _device(x)
    with entry.lock, (torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()):
        entry.layer.forward(_desc(x, comet.DType.BF16), _desc(topk_idx, comet.DType.INT32),
                            _desc(topk_w, comet.DType.FP32), _desc(w1, comet.DType.BF16), _desc(w2, comet.DType.BF16),
                            _desc(y, comet.DType.BF16), stream=_stream(device), save=save,
                            saved=_desc(saved, comet.DType.UINT8) if saved.numel() else None)
    return y, saved


@torch.library.custom_op("comet::moe_experts", mutates_args=())
def _moe_experts(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w1: Tensor, w2: Tensor, activation: str, save: str,
                 layer: int, main_grad1: Optional[Tensor] = None,
                 main_grad2: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(y, saved): y (T, H) bf16, the layer of x; saved (n) uint8, the state
    this forward keeps for its backward (save "activations": n =
    comet_layer_saved_bytes; "recompute", "none": n = 0). layer: 0 runs a
    one-rank layer of this process, else a MoEExperts layer's id.
    main_grad1, main_grad2: None, or fp32 buffers in w1's and w2's shapes
    that the backward adds dW1 and dW2 to (comet_backward_args_t.accumulate)
    instead of returning w1's and w2's gradients; the forward only checks
    them."""
    return _run_checked(x, topk_idx, topk_w, w1, w2, activation, save, layer, main_grad1, main_grad2)


def _run_checked(x, topk_idx, topk_w, w1, w2, activation, save, layer, main_grad1=None, main_grad2=None):
    """moe_experts' forward with the main grads checked: the op's implementation and the eager path's"""
    _check_main_grads(w1, w2, main_grad1, main_grad2, real=True)
    return _run(x, topk_idx, topk_w, w1, w2, activation, save, layer)


@_moe_experts.register_fake
def _moe_experts_fake(x, topk_idx, topk_w, w1, w2, activation, save, layer, main_grad1=None, main_grad2=None):
    _check_save(save)
    _check(x, topk_idx, topk_w, w1, w2, activation, _ep(layer))
    _check_main_grads(w1, w2, main_grad1, main_grad2)
    T = x.shape[0]
    if save != "activations" or (not layer and isinstance(T, int) and T == 0):
        n = 0
    elif layer or isinstance(T, int):  # the layer the eager op will run says how many bytes it saves
        n = _entry(layer, x, topk_idx, w1, w2, activation).saved_bytes
    else:  # T symbolic: the one-rank layer's token bound, hence the size, is known only when it runs
        n = torch.library.get_ctx().new_dynamic_size()
    return torch.empty_like(x), x.new_empty((n,), dtype=torch.uint8)


def _backward_check(dy: Tensor, x: Tensor, topk_idx: Tensor, topk_w: Tensor, w1: Tensor, w2: Tensor, saved: Tensor,
                    activation: str, save: str, layer: int) -> None:
    _check_save(save)
    _check(x, topk_idx, topk_w, w1, w2, activation, _ep(layer))
    if dy.dtype != torch.bfloat16 or tuple(dy.shape) != tuple(x.shape) or dy.device != x.device:
        raise ValueError("moe_experts_backward: dy must be bf16 %s on %s like x, got %s %s on %s"
                         % (tuple(x.shape), x.device, dy.dtype, tuple(dy.shape), dy.device))
    if not dy.is_contiguous():
        raise ValueError("moe_experts_backward: dy must be contiguous: call .contiguous()")
    if saved.dtype != torch.uint8 or saved.dim() != 1 or saved.device != x.device:
        raise ValueError("moe_experts_backward: saved must be the 1-d uint8 tensor moe_experts returned on %s, got "
                         "%s %s on %s" % (x.device, saved.dtype, tuple(saved.shape), saved.device))


def _run_backward(dy: Tensor, x: Tensor, topk_idx: Tensor, topk_w: Tensor, w1: Tensor, w2: Tensor, saved: Tensor,
                  activation: str, save: str, layer: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    _backward_check(dy, x, topk_idx, topk_w, w1, w2, saved, activation, save, layer)
    dx, d_topk_w = torch.empty_like(x), torch.empty_like(topk_w)
    dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
    if x.shape[0] == 0 and not layer:  # one rank, no rows: every gradient is zero
        return dx, d_topk_w, dw1.zero_(), dw2.zero_()
    _layer_backward(dy, x, topk_idx, topk_w, w1, w2, saved, activation, save, layer, dx, d_topk_w, dw1, dw2,
                    comet.DType.BF16, contextlib.nullcontext())
    return dx, d_topk_w, dw1, dw2


@torch.library.custom_op("comet::moe_experts_backward", mutates_args=())
def _moe_experts_backward(dy: Tensor, x: Tensor, topk_idx: Tensor, topk_w: Tensor, w1: Tensor, w2: Tensor,
                          saved: Tensor, activation: str, save: str,
                          layer: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, d_topk_w, dw1, dw2) of comet.h's backward for dy = dL/dy: dx (T,
    H) bf16, d_topk_w (T, topk) fp32, dw1 and dw2 bf16 in w1's and w2's
    shapes. saved, save: what moe_experts returned and was given."""
    return _run_backward(dy, x, topk_idx, topk_w, w1, w2, saved, activation, save, layer)


@_moe_experts_backward.register_fake
def _moe_experts_backward_fake(dy, x, topk_idx, topk_w, w1, w2, saved, activation, save, layer):
    _backward_check(dy, x, topk_idx, topk_w, w1, w2, saved, activation, save, layer)
    return torch.empty_like(x), torch.empty_like(topk_w), torch.empty_like(w1), torch.empty_like(w2)


def _accumulate_check(dy, x, topk_idx, topk_w, w1, w2, saved, main_grad1, main_grad2, activation, save, layer):
    _backward_check(dy, x, topk_idx, topk_w, w1, w2, saved, activation, save, layer)
    if main_grad1 is None or main_grad2 is None:
        raise ValueError("moe_experts_backward_accumulate: main_grad1 and main_grad2 are both required")
    _check_main_grads(w1, w2, main_grad1, main_grad2, "moe_experts_backward_accumulate")


@torch.library.custom_op("comet::moe_experts_backward_accumulate", mutates_args=("main_grad1", "main_grad2"))
def _moe_experts_backward_accumulate(dy: Tensor, x: Tensor, topk_idx: Tensor, topk_w: Tensor, w1: Tensor,
                                     w2: Tensor, saved: Tensor, main_grad1: Tensor, main_grad2: Tensor,
                                     activation: str, save: str, layer: int) -> Tuple[Tensor, Tensor]:
    """(dx, d_topk_w) of comet.h's backward for dy = dL/dy, as
    moe_experts_backward's, and dW1, dW2 added to main_grad1, main_grad2
    (fp32, w1's and w2's shapes) in fp32: comet_layer_backward with
    accumulate = 1, one fp32 add per element of the call's fp32 sum (no bf16
    rounding); an expert no row chose keeps its main grad unchanged (CPU
    engine: adds +0.0)."""
    return _run_backward_accumulate(dy, x, topk_idx, topk_w, w1, w2, saved, main_grad1, main_grad2, activation, save,
                                    layer)


def _run_backward_accumulate(dy: Tensor, x: Tensor, topk_idx: Tensor, topk_w: Tensor, w1: Tensor, w2: Tensor,
                             saved: Tensor, main_grad1: Tensor, main_grad2: Tensor, activation: str, save: str,
                             layer: int) -> Tuple[Tensor, Tensor]:
    _accumulate_check(dy, x, topk_idx, topk_w, w1, w2, saved, main_grad1, main_grad2, activation, save, layer)
    _check_main_grads(w1, w2, main_grad1, main_grad2, "moe_experts_backward_accumulate", real=True)
    dx, d_topk_w = torch.empty_like(x), torch.empty_like(topk_w)
    if x.shape[0] == 0 and not layer:  # one rank, no rows: nothing to add
        return dx, d_topk_w
    # _accumulate_lock: backwards of layers of other token bounds (other entries) may add to the same buffers
    # from other threads; CPU adds are synchronous, so one at a time (CUDA: launches, ordered by the streams)
    _layer_backward(dy, x, topk_idx, topk_w, w1, w2, saved, activation, save, layer, dx, d_topk_w, main_grad1,
                    main_grad2, comet.DType.FP32, _accumulate_lock)
    return dx, d_topk_w


def _layer_backward(dy, x, topk_idx, topk_w, w1, w2, saved, activation, save, layer, dx, d_topk_w, dw1, dw2,
                    dw_dtype, lock):
    """comet_layer_backward on the op's layer into dx, d_topk_w and dw1, dw2: written (bf16) or, fp32, added to
    (accumulate), holding lock besides the layer's"""
    entry = _entry(layer, x, topk_idx, w1, w2, activation)
    device = _device(x)
    ins = (_desc(x, comet.DType.BF16), _desc(topk_idx, comet.DType.INT32), _desc(topk_w, comet.DType.FP32),
           _desc(w1, comet.DType.BF16), _desc(w2, comet.DType.BF16), _desc(dy, comet.DType.BF16))
    outs = (_desc(dx, comet.DType.BF16), _desc(d_topk_w, comet.DType.FP32), _desc(dw1, dw_dtype),
            _desc(dw2, dw_dtype))
    with lock, entry.lock, (torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()):
        entry.layer.backward(*ins, *outs, save=save, saved=_desc(saved, comet.DType.UINT8) if saved.numel() else None,
                             accumulate=dw_dtype == comet.DType.FP32, stream=_stream(device))


@_moe_experts_backward_accumulate.register_fake
def _moe_experts_backward_accumulate_fake(dy, x, topk_idx, topk_w, w1, w2, saved, main_grad1, main_grad2, activation,
                                          save, layer):
    _accumulate_check(dy, x, topk_idx, topk_w, w1, w2, saved, main_grad1, main_grad2, activation, save, layer)
    return torch.empty_like(x), torch.empty_like(topk_w)


def _check_main_grads(w1: Tensor, w2: Tensor, main_grad1: Optional[Tensor], main_grad2: Optional[Tensor],
                      who: str = "moe_experts", real: bool = False) -> None:
    """main grads: both None, or fp32 contiguous tensors in w1's and w2's
    shapes on their device; real (the eager ops, tensors with addresses):
    not overlapping each other."""
    if (main_grad1 is None) != (main_grad2 is None):
        raise ValueError("%s: main grads come in pairs (w1's and w2's): got only %s's"
                         % (who, "w1" if main_grad2 is None else "w2"))
    if main_grad1 is None:
        return
    for name, g, w in (("w1", main_grad1, w1), ("w2", main_grad2, w2)):
        if not isinstance(g, Tensor):
            raise TypeError("%s: %s.main_grad must be a torch.Tensor, got %s" % (who, name, type(g).__name__))
        if g.dtype != torch.float32:
            raise TypeError("%s: %s.main_grad must be torch.float32 (fp32 gradients are accumulated into it), got %s"
                            % (who, name, g.dtype))
        if tuple(g.shape) != tuple(w.shape):
            raise ValueError("%s: %s.main_grad must have %s's shape %s, got %s"
                             % (who, name, name, tuple(w.shape), tuple(g.shape)))
        if g.device != w.device:
            raise ValueError("%s: %s.main_grad is on %s, %s on %s" % (who, name, g.device, name, w.device))
        if not g.is_contiguous():
            raise ValueError("%s: %s.main_grad must be contiguous (comet adds into it in place)" % (who, name))
    if real and main_grad1.numel() and main_grad2.numel():
        a0, b0 = main_grad1.data_ptr(), main_grad2.data_ptr()
        if a0 < b0 + main_grad2.numel() * 4 and b0 < a0 + main_grad1.numel() * 4:
            raise ValueError("%s: w1.main_grad and w2.main_grad overlap in memory" % who)


def _setup_context(ctx, inputs, output):
    x, topk_idx, topk_w, w1, w2, activation, save, layer = inputs[:8]
    ctx.save_for_backward(x, topk_idx, topk_w, w1, w2, output[1])
    ctx.activation, ctx.save, ctx.layer = activation, save, layer
    # The main grads ride on ctx, not in save_for_backward: the backward of
    # every other micro-batch in flight mutates them (a version bump that
    # saved tensors would refuse), and they are accumulators, not state.
    ctx.main_grads = tuple(inputs[8:10]) if len(inputs) > 8 and inputs[8] is not None else None
    # The saved state (uint8) never has a gradient: autograd would otherwise
    # materialize one, a zero tensor of comet_layer_saved_bytes filled at
    # every backward (GPU: ~1.4 GB for Mixtral EP2 at 8192 tokens).
    ctx.set_materialize_grads(False)


def _backward(ctx, grad, _grad_saved):
    x, topk_idx, topk_w, w1, w2, saved = ctx.saved_tensors
    # grad None (not materialized: y's gradient arrived undefined): the backward of dy = 0, as before
    dy = torch.zeros_like(x) if grad is None else grad.to(torch.bfloat16).contiguous()
    eager = getattr(ctx, "eager", False)  # _EagerExperts: the implementations called directly, not the ops
    if ctx.main_grads is None:
        dx, d_topk_w, dw1, dw2 = (_run_backward if eager else torch.ops.comet.moe_experts_backward)(
            dy, x, topk_idx, topk_w, w1, w2, saved, ctx.activation, ctx.save, ctx.layer)
        return dx, None, d_topk_w, dw1, dw2, None, None, None, None, None
    # main grads: dW1, dW2 go into them in fp32; w1 and w2 get no gradient (w.grad stays None, as Megatron's
    # gradient-accumulation fusion). A weight that does not require grad has its dW added to a scratch buffer,
    # never read: left uninitialized (zeroing it cost a write of the fp32 weight's bytes every backward).
    g1, g2 = (g if ctx.needs_input_grad[i] else torch.empty_like(g)
              for i, g in ((3, ctx.main_grads[0]), (4, ctx.main_grads[1])))
    dx, d_topk_w = (_run_backward_accumulate if eager else torch.ops.comet.moe_experts_backward_accumulate)(
        dy, x, topk_idx, topk_w, w1, w2, saved, g1, g2, ctx.activation, ctx.save, ctx.layer)
    return dx, None, d_topk_w, None, None, None, None, None, None, None


_moe_experts.register_autograd(_backward, setup_context=_setup_context)


class _EagerExperts(torch.autograd.Function):
    """comet::moe_experts in eager mode without torch.library's dispatch: the
    same implementation, setup_context and backward, the backward calling the
    implementations of the backward ops directly. A training step's host work
    outside the C calls, a tiny layer on a 2-core CPU, runs alternated:
    490-543 us through the op, 278-337 this way. On 2x H200, Qwen2-MoE at
    4096 tokens back to back: +21.7% over the C calls through the op, +1.0%
    this way (bench/results/training/2026-11-28-py-vs-c-eager-h200x2.md)."""

    @staticmethod
    def forward(ctx, *inputs):  # ctx in forward: a separate setup_context binds the arguments at every call
        output = _run_checked(*inputs)
        _setup_context(ctx, inputs, output)
        ctx.eager = True
        return output

    backward = staticmethod(_backward)


def _plain(*tensors) -> bool:
    """Eager tensors the eager path can run: not traced (torch.compile, export), no dispatch mode (fake
    tensors, FX tracing, flop counters: they see the op), no tensor subclass but Parameter."""
    return (not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and all(type(t) in (Tensor, torch.nn.Parameter) for t in tensors))


def _experts(recorded, *inputs):
    """(y, saved) of comet::moe_experts(*inputs): the op, or on plain eager tensors _EagerExperts (recorded:
    autograd records the call) or the implementation itself (nothing to record)"""
    if not _plain(*(t for t in inputs if isinstance(t, Tensor))):
        return _moe_experts(*inputs)
    return _EagerExperts.apply(*inputs) if recorded else _run_checked(*inputs)


def moe_experts(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w1: Tensor, w2: Tensor, *,
                activation: str = "silu_gated", save: str = "activations",
                main_grads: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
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
        save: what a forward that autograd records keeps for its backward:
            "activations" (every routed row's gu and h, a uint8 tensor of
            comet_layer_saved_bytes from torch's allocator) or "recompute"
            (nothing: the backward reruns GEMM0). Either gives the same
            gradients, bit for bit. A forward autograd does not record
            (torch.no_grad(), no input requiring grad) saves nothing.
        main_grads: None, or (g1, g2): fp32 contiguous tensors in w1's and
            w2's shapes on their device (Megatron's `main_grad`, see
            MoEExperts(main_grad=True)). The backward then adds dW1 to g1
            and dW2 to g2 in fp32 (comet_layer_backward with accumulate=1:
            the call's fp32 sum added once per element, no bf16 rounding)
            and gives w1 and w2 no gradient (their .grad stays None); a
            weight that does not require grad gets nothing added. The
            backward is the op torch.ops.comet.moe_experts_backward_accumulate,
            which mutates g1 and g2 (mutates_args), so it also runs in a
            torch.compile'd backward.

    Returns:
        y: (T, H) bfloat16, on x's device.

    Every tensor must be on x's device (CPU, or CUDA with a CUDA build of
    comet); x, topk_idx and topk_w are made contiguous (a copy when they are
    not), w1 and w2 must be contiguous. Raises TypeError or ValueError for a
    wrong dtype, shape or device, and comet.InvalidRouting (a ValueError,
    carrying comet's message) for an expert id out of range or repeated in a
    row (CUDA: reported by synchronize()). Differentiable in x, topk_w, w1
    and w2: the backward is comet_layer_backward on the same layer (CUDA: on
    the current stream); a CPU engine without a backward runs its
    specification, comet_reference_backward (the same bits, slower).
    """
    return _call(x, topk_idx, topk_w, w1, w2, activation, save, 0, main_grads)


def _call(x, topk_idx, topk_w, w1, w2, activation, save, layer, main_grads=None):
    if save not in ("activations", "recompute"):
        raise ValueError('moe_experts: save %r is not "activations" or "recompute"' % (save,))
    if not isinstance(x, Tensor):
        raise TypeError("moe_experts: x must be a torch.Tensor, got %s" % type(x).__name__)
    if topk_idx.dtype == torch.int64:
        topk_idx = topk_idx.to(torch.int32)
    if topk_w.dtype in (torch.bfloat16, torch.float16):
        topk_w = topk_w.to(torch.float32)
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_w, w1, w2))
    if main_grads is not None:
        if not isinstance(main_grads, (tuple, list)) or len(main_grads) != 2:
            raise TypeError("moe_experts: main_grads must be a pair (w1's, w2's) of fp32 tensors, got %r"
                            % (type(main_grads).__name__,))
        _check_main_grads(w1, w2, main_grads[0], main_grads[1])
        if recorded and (w1.requires_grad or w2.requires_grad):  # else no weight gradient to add
            y, _ = _experts(True, x.contiguous(), topk_idx.contiguous(), topk_w.contiguous(), w1, w2, activation,
                            save, layer, main_grads[0], main_grads[1])
            return y
    y, _ = _experts(recorded, x.contiguous(), topk_idx.contiguous(), topk_w.contiguous(), w1, w2, activation,
                    save if recorded else "none", layer)
    return y


# ---------------------------------------------------------------------------
# Worlds over a torch.distributed group.
# ---------------------------------------------------------------------------
def _broadcast_id(group, make_id) -> bytes:
    """Rank 0 of `group` calls make_id() (128 bytes) and broadcasts them over
    the group; every rank returns them. A failure of make_id on rank 0
    reaches every rank (a flag byte travels with the id), so none waits in
    the broadcast. The buffer is a CPU tensor where the group's backend has
    one for CPU (gloo), else a CUDA tensor on the current device (nccl)."""
    import torch.distributed as dist

    n = comet._capi.COMET_UNIQUE_ID_BYTES
    backend = str(dist.get_backend(group))
    device = torch.device("cpu") if "gloo" in backend else torch.device("cuda", torch.cuda.current_device())
    buf = torch.zeros(n + 1, dtype=torch.uint8)
    failure = None
    if dist.get_rank(group) == 0:
        try:
            uid = make_id()
            buf[1:] = torch.frombuffer(bytearray(uid), dtype=torch.uint8)
            buf[0] = 1
        except Exception as e:  # noqa: BLE001 - raised below, after the peers heard of it
            failure = e
    buf = buf.to(device)
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast(buf, src=src, group=group)
    buf = buf.cpu()
    if failure is not None:
        raise failure
    if int(buf[0]) != 1:
        raise RuntimeError("world_from_group: rank 0 of the group could not make comet's unique id (its error "
                           "says why)")
    return bytes(buf[1:].tolist())


def world_from_group(group=None, *, timeout_ms: int = 0, tune_file: Optional[str] = None,
                     graph_replay: int = 0) -> comet.World:
    """A comet world over the ranks of a torch.distributed process group
    (None: the default group), one GPU each: rank 0 of the group makes the
    unique id (comet.get_unique_id), the group broadcasts its bytes, and
    every rank creates its world on its current CUDA device
    (comet_world_create_nccl_opts(rank in group, group size, id,
    torch.cuda.current_device())). Collective over the group; only its ranks
    take part, so a sub-group (the EP group of a DP x EP mesh, say) works.
    The world's rank is the rank in the group.

    Set the device first (torch.cuda.set_device). The world runs comet's
    CUDA backend: a process without a GPU, or a CPU-only build of comet,
    gets a RuntimeError saying so (before any communication). Options as
    comet.World (0 / None: the environment's or the default). Close the
    world (world.close(), on every rank) after its layers."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("world_from_group: torch.distributed is not initialized (torch.distributed."
                           "init_process_group first)")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("world_from_group: this process is not a member of the group")
    if not torch.cuda.is_available() or comet.device_count() == 0:
        why = ("torch sees no GPU" if not torch.cuda.is_available() else
               "this libcomet.so has no CUDA backend or sees no GPU (%s)"
               % comet.build_info().get("reason", "comet.build_info()"))
        raise RuntimeError("world_from_group: a comet world over processes runs comet's CUDA backend, one GPU per "
                           "rank (comet_world_create_nccl), and %s. On CPU tensors use comet.torch.moe_experts or "
                           "MoEExperts without a world (a one-rank CPU world in this process)" % why)
    uid = _broadcast_id(group, comet.get_unique_id)
    return comet.World.from_unique_id(rank, size, uid, torch.cuda.current_device(), timeout_ms=timeout_ms,
                                      tune_file=tune_file, graph_replay=graph_replay)


# ---------------------------------------------------------------------------
# The module.
# ---------------------------------------------------------------------------
class MoEExperts(torch.nn.Module):
    """The experts of one MoE layer as one rank of a TP x EP world holds them
    (comet's layout, include/comet.h; rank = ep * TP + tp holds experts
    [ep*E_local, (ep+1)*E_local) and the ffn slice tp).

    Parameters (created with requires_grad=False; module.requires_grad_()
    trains them: the backward gives w1.grad and w2.grad, bf16, or with
    main_grad=True adds to w1.main_grad and w2.main_grad, fp32):
        w1: (E_local, 2*F_local, H) bfloat16 for activation="silu_gated"
            (rows [0, F_local) the gate slice, [F_local, 2*F_local) the up
            slice); (E_local, F_local, H) bfloat16 for "gelu".
        w2: (E_local, H, F_local) bfloat16.
    with E_local = num_experts / ep and F_local = ffn / tp.

    Attributes: num_experts (E), ffn (F, unsliced), hidden (H), tp, ep, rank,
    activation, save, world (None: this process holds every expert).

    Build it from a framework's weights with from_hf_mixtral,
    from_hf_qwen2_moe (= from_hf_qwen3_moe), from_fused or from_megatron
    (comet.convert does the layout and the TP slicing of gate and up); back
    with comet.convert.to_hf_mixtral(modules, tp=, ep=) etc., which take the
    W modules (one a rank).

    forward(x, topk_idx, topk_w) runs comet.torch.moe_experts. Without a
    world the module holds every expert and the whole ffn (tp = ep = 1) and
    runs a one-rank layer on x's device; with world= (world_from_group: the
    TP x EP ranks of a process group, one GPU each) it runs its layer of
    that world, created here (collective: every rank builds its module in
    the same order), for this rank's tokens: T <= max_tokens_per_rank, the
    expert ids global. Its arguments and result match transformers 5's
    fused experts modules (MixtralExperts etc.: forward(hidden_states,
    top_k_index, top_k_weights)).

    main_grad=True (Megatron's main grads with gradient-accumulation
    fusion): w1.main_grad and w2.main_grad are fp32 zeros in the weights'
    shapes, attributes of the Parameters (not in the state_dict; moved by
    module.to(device)). Each backward adds dW1 and dW2 to them in fp32
    through comet's accumulate = 1 and returns no weight gradient: w1.grad
    and w2.grad stay None, so an optimizer reads the main grads (or the
    owner copies them to .grad). After micro-batches whose backwards ran in
    the order 1..N, main_grad == ((m0 + g_1) + ...) + g_N in fp32, bit for
    bit, g_i the fp32 gradient the layer's backward writes with
    accumulate = 0. zero_main_grad() zeroes them (between optimizer
    steps); the owner may replace them with its own fp32 contiguous
    tensors of the same shapes (Megatron's DDP: views into its grad
    buffer): every forward reads w.main_grad again and checks it. A weight
    that does not require grad gets nothing added.
    """

    def __init__(self, w1: Tensor, w2: Tensor, *, activation: str = "silu_gated", tp: int = 1, ep: int = 1,
                 rank: int = 0, save: str = "activations", world: Optional[comet.World] = None,
                 topk: Optional[int] = None, max_tokens_per_rank: Optional[int] = None, main_grad: bool = False):
        """w1, w2: this rank's weights, bfloat16 (shapes in the class
        docstring; made contiguous); activation: "silu_gated" or "gelu";
        tp, ep, rank: the world and this rank; save: "activations" or
        "recompute" (moe_experts); world: a comet.World over processes
        (world_from_group) of tp * ep ranks whose rank `rank` this process
        holds, with topk and max_tokens_per_rank (the bound on every rank's
        T) for its layer; main_grad: accumulate the weights' gradients into
        fp32 w1.main_grad and w2.main_grad (the class docstring)."""
        super().__init__()
        from comet.convert import rank_coords

        rank_coords(rank, tp, ep, fn="MoEExperts")
        if activation not in _ACTIVATIONS:
            raise ValueError('MoEExperts: activation %r is not "silu_gated" or "gelu"' % (activation,))
        if save not in ("activations", "recompute"):
            raise ValueError('MoEExperts: save %r is not "activations" or "recompute"' % (save,))
        for name, t in (("w1", w1), ("w2", w2)):
            if not isinstance(t, Tensor):
                raise TypeError("MoEExperts: %s must be a torch.Tensor, got %s" % (name, type(t).__name__))
            if t.dtype != torch.bfloat16:
                raise TypeError("MoEExperts: %s must be torch.bfloat16, got %s (comet.convert's functions return "
                                "bf16)" % (name, t.dtype))
            if t.dim() != 3:
                raise ValueError("MoEExperts: %s must be 3-d, got shape %s" % (name, tuple(t.shape)))
        El, rows, H = w1.shape
        Fl = w2.shape[2]
        gated = activation == "silu_gated"
        if tuple(w2.shape) != (El, H, Fl) or rows != (2 * Fl if gated else Fl):
            raise ValueError("MoEExperts: w1 %s and w2 %s are not (E_local, %s, H) and (E_local, H, F_local) for %s"
                             % (tuple(w1.shape), tuple(w2.shape), "2*F_local" if gated else "F_local", activation))
        self.w1 = torch.nn.Parameter(w1.detach().contiguous(), requires_grad=False)
        self.w2 = torch.nn.Parameter(w2.detach().contiguous(), requires_grad=False)
        self.activation, self.save = activation, save
        self.tp, self.ep, self.rank = tp, ep, rank
        self.num_experts, self.ffn, self.hidden = El * ep, Fl * tp, H
        self.world, self._layer = world, 0
        self.main_grad = bool(main_grad)
        if self.main_grad:
            self.zero_main_grad()
        if world is not None:
            if world.size != tp * ep or world.local_rank != rank:
                raise ValueError("MoEExperts: the world has %d ranks and this process holds rank %d of it; the "
                                 "module is rank %d of TP=%d x EP=%d" % (world.size, world.local_rank, rank, tp, ep))
            if topk is None or max_tokens_per_rank is None:
                raise ValueError("MoEExperts: a module with a world needs topk and max_tokens_per_rank (its layer's "
                                 "config, equal on every rank)")
            cfg = comet.LayerConfig(hidden=H, ffn=self.ffn, num_experts=self.num_experts, topk=topk,
                                    max_tokens_per_rank=max_tokens_per_rank, activation=activation, tp=tp, ep=ep)
            entry = _Entry(world.layer(rank, cfg))
            with _cache_lock:
                self._layer = next(_next_id)
                _registered[self._layer] = entry

    def zero_main_grad(self) -> None:
        """main_grad=True: zero w1.main_grad and w2.main_grad in place (a
        weight whose main_grad is None gets a new fp32 zero buffer in its
        shape, on its device). Call it between optimizer steps, as
        Megatron's DDP zeroes its grad buffer; or zero (or replace) the
        buffers yourself."""
        if not self.main_grad:
            raise RuntimeError("MoEExperts.zero_main_grad: the module was built without main_grad=True")
        for w in (self.w1, self.w2):
            if getattr(w, "main_grad", None) is None:
                w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            else:
                w.main_grad.zero_()

    def _main_grads(self) -> Optional[Tuple[Tensor, Tensor]]:
        if not self.main_grad:
            return None
        grads = getattr(self.w1, "main_grad", None), getattr(self.w2, "main_grad", None)
        for name, g in zip(("w1", "w2"), grads):
            if g is None:
                raise ValueError("MoEExperts(main_grad=True): %s.main_grad is missing (None): call zero_main_grad() "
                                 "or set it to an fp32 tensor in %s's shape" % (name, name))
        _check_main_grads(self.w1, self.w2, grads[0], grads[1], "MoEExperts(main_grad=True)")
        return grads

    def _apply(self, fn, *args, **kwargs):
        # module.to(device) / .cuda() move the Parameters' data: their main grads follow (staying fp32)
        out = super()._apply(fn, *args, **kwargs)
        for w in (self.w1, self.w2):
            g = getattr(w, "main_grad", None) if self.main_grad else None
            if isinstance(g, Tensor) and g.device != w.device:
                w.main_grad = g.to(w.device)
        return out

    def close(self) -> None:
        """Collective (a module with a world, on every rank): destroy its
        comet layer. Without a world a no-op. Closing twice is a no-op."""
        if self._layer:
            with _cache_lock:
                entry = _registered.pop(self._layer)
            self._layer = 0
            with entry.lock:
                entry.layer.close()

    @classmethod
    def from_hf_mixtral(cls, experts, *, tp: int = 1, ep: int = 1, rank: int = 0, **options) -> "MoEExperts":
        """From HF Mixtral's `block_sparse_moe.experts` (E modules with w1 =
        gate (F, H), w3 = up (F, H), w2 = down (H, F)), the block, or a fused
        experts module (gate_up_proj (E, 2F, H), down_proj (E, H, F)): this
        rank's slice, bf16 (comet.convert.from_hf_mixtral). options: the
        constructor's save, world, topk, max_tokens_per_rank."""
        from comet import convert

        w1, w2 = convert.from_hf_mixtral(experts, tp=tp, ep=ep, rank=rank)
        return cls(w1, w2, tp=tp, ep=ep, rank=rank, **options)

    @classmethod
    def from_hf_qwen2_moe(cls, experts, *, tp: int = 1, ep: int = 1, rank: int = 0, **options) -> "MoEExperts":
        """From HF Qwen2-MoE's or Qwen3-MoE's `mlp.experts` (E modules with
        gate_proj (F, H), up_proj (F, H), down_proj (H, F)), the block (its
        shared expert is not included), or a fused experts module: this
        rank's slice, bf16 (comet.convert.from_hf_qwen_moe). options: the
        constructor's save, world, topk, max_tokens_per_rank."""
        from comet import convert

        w1, w2 = convert.from_hf_qwen_moe(experts, tp=tp, ep=ep, rank=rank)
        return cls(w1, w2, tp=tp, ep=ep, rank=rank, **options)

    from_hf_qwen3_moe = from_hf_qwen2_moe

    @classmethod
    def from_fused(cls, gate_up: Tensor, down: Tensor, *, order: str = "gate_first", tp: int = 1, ep: int = 1,
                   rank: int = 0, **options) -> "MoEExperts":
        """From fused experts: gate_up (E, 2F, H) (order "gate_first" or
        "interleaved"), down (E, H, F) (comet.convert.from_fused)."""
        from comet import convert

        w1, w2 = convert.from_fused(gate_up, down, order=order, tp=tp, ep=ep, rank=rank)
        return cls(w1, w2, tp=tp, ep=ep, rank=rank, **options)

    @classmethod
    def from_megatron(cls, fc1: Tensor, fc2: Tensor, *, gated: bool = True, tp: int = 1, ep: int = 1,
                      rank: int = 0, **options) -> "MoEExperts":
        """From Megatron-Core's unsliced grouped experts: fc1 (E, 2F, H)
        [gate; up] (gated) or (E, F, H) (gated=False: GELU), fc2 (E, H, F)
        (comet.convert.from_megatron)."""
        from comet import convert

        w1, w2 = convert.from_megatron(fc1, fc2, gated=gated, tp=tp, ep=ep, rank=rank)
        return cls(w1, w2, activation="silu_gated" if gated else "gelu", tp=tp, ep=ep, rank=rank, **options)

    def forward(self, x: Tensor, topk_idx: Tensor, topk_w: Tensor) -> Tensor:
        """y[t] = sum_j topk_w[t, j] * FFN_{topk_idx[t, j]}(x[t]) (comet.torch.moe_experts).

        Args:
            x: (..., H), bfloat16 (another float dtype is rounded to bf16:
                comet computes in bf16 with fp32 accumulation).
            topk_idx: (..., topk) int32 or int64, expert ids in [0, E),
                distinct within a row.
            topk_w: (..., topk) float32, bfloat16 or float16 routing weights.

        Returns:
            y: (..., H) in x's dtype and on x's device.
        """
        if (self.tp != 1 or self.ep != 1) and self.world is None:
            raise NotImplementedError(
                "MoEExperts: this module holds rank %d of a TP=%d x EP=%d world (experts %d..%d, ffn slice %d of %d) "
                "and has no comet world: build it with world=comet.torch.world_from_group(group) (one GPU a rank), "
                "or run a %d-rank comet.Layer with these w1, w2" % (
                    self.rank, self.tp, self.ep, self.rank // self.tp * (self.num_experts // self.ep),
                    (self.rank // self.tp + 1) * (self.num_experts // self.ep) - 1, self.rank % self.tp, self.tp,
                    self.tp * self.ep))
        if self.world is not None and not self._layer:
            raise ValueError("MoEExperts: the module's comet layer is closed")
        if not isinstance(x, Tensor):
            raise TypeError("MoEExperts: x must be a torch.Tensor, got %s" % type(x).__name__)
        if x.dim() < 1 or x.shape[-1] != self.hidden:
            raise ValueError("MoEExperts: x must be (..., H=%d), got %s" % (self.hidden, tuple(x.shape)))
        lead = x.shape[:-1]
        if topk_idx.shape[:-1] != lead or topk_w.shape != topk_idx.shape or topk_idx.dim() != x.dim():
            raise ValueError("MoEExperts: topk_idx %s and topk_w %s must both be (%s, topk) for x %s"
                             % (tuple(topk_idx.shape), tuple(topk_w.shape), ", ".join(map(str, lead)) or "",
                                tuple(x.shape)))
        k = topk_idx.shape[-1]
        y = _call(x.reshape(-1, self.hidden).to(torch.bfloat16), topk_idx.reshape(-1, k),
                  topk_w.reshape(-1, k).to(torch.float32), self.w1, self.w2, self.activation, self.save, self._layer,
                  self._main_grads())
        return y.to(x.dtype).reshape(x.shape)

    def extra_repr(self) -> str:
        return "num_experts=%d, hidden=%d, ffn=%d, activation=%s, tp=%d, ep=%d, rank=%d, save=%s%s" % (
            self.num_experts, self.hidden, self.ffn, self.activation, self.tp, self.ep, self.rank, self.save,
            ", main_grad=True" if self.main_grad else "")


# ---------------------------------------------------------------------------
# HF transformers models.
# ---------------------------------------------------------------------------
_HF_BLOCKS = {"MixtralSparseMoeBlock": "from_hf_mixtral", "Qwen2MoeSparseMoeBlock": "from_hf_qwen2_moe",
              "Qwen3MoeSparseMoeBlock": "from_hf_qwen3_moe"}


def patch_model(model: torch.nn.Module, group=None, *, save: str = "activations",
                max_tokens_per_rank: Optional[int] = None) -> torch.nn.Module:
    """Run the experts of an HF transformers Mixtral, Qwen2-MoE or Qwen3-MoE
    model with comet, in place: each sparse MoE block's `experts` (the fused
    experts module of transformers 5: gate_up_proj, down_proj) becomes a
    MoEExperts with the same weights (comet.convert), trainable where they
    were; the router (`gate`) and a shared expert stay torch. Returns model.

        model = AutoModelForCausalLM.from_pretrained(...)
        comet.torch.patch_model(model)

    group None: this process holds every expert and runs comet on the
    model's device (CPU: comet's CPU engine, one rank). A torch.distributed
    group: expert parallelism over it (world_from_group, one GPU a rank):
    rank r of G keeps experts [r*E/G, (r+1)*E/G) and runs its own tokens,
    each at most max_tokens_per_rank (batch x sequence, required then);
    the other weights stay replicated. save: "activations" or "recompute"
    (moe_experts).

    The patched model's state_dict names the experts' weights
    `experts.w1` and `experts.w2` (comet's layout); comet.convert's
    to_hf_mixtral / to_hf_qwen_moe give HF's back. The computation follows
    comet.h's rounding points (bf16 with fp32 accumulation): a model in
    another dtype gets its experts' input rounded to bf16 and their output
    converted back."""
    blocks = [(name, m) for name, m in model.named_modules() if type(m).__name__ in _HF_BLOCKS]
    if not blocks:
        raise ValueError("patch_model: %s has no sparse MoE block comet knows (%s)"
                         % (type(model).__name__, ", ".join(sorted(_HF_BLOCKS))))
    world, rank, size = None, 0, 1
    if group is not None:
        import torch.distributed as dist

        if max_tokens_per_rank is None:
            raise ValueError("patch_model: with a group, max_tokens_per_rank (the bound on every rank's batch x "
                             "sequence tokens) sizes comet's layers")
        world = world_from_group(group)
        rank, size = world.local_rank, dist.get_world_size(group)
    for name, block in blocks:
        experts = block.experts
        if isinstance(experts, MoEExperts):
            continue
        if not hasattr(experts, "gate_up_proj"):
            raise ValueError("patch_model: %s.experts is a %s, not a fused experts module (gate_up_proj, down_proj): "
                             "patch_model needs transformers >= 5" % (name, type(experts).__name__))
        trainable = experts.gate_up_proj.requires_grad
        options = dict(save=save)
        if world is not None:
            options.update(world=world, topk=block.gate.top_k, max_tokens_per_rank=max_tokens_per_rank)
        new = getattr(MoEExperts, _HF_BLOCKS[type(block).__name__])(experts, ep=size, rank=rank, **options)
        block.experts = new.requires_grad_(trainable)
    return model
