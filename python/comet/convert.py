"""comet.convert - expert weights from the frameworks people use into comet's
layout, and back (needs torch; not transformers, not Megatron).

comet's layout (include/comet.h). A world of W = TP x EP ranks; rank
r = ep * TP + tp holds experts [ep*E_local, (ep+1)*E_local) (E_local = E/EP)
and, of each, the ffn slice tp: columns [tp*F_local, (tp+1)*F_local) of the
unsliced F (F_local = F/TP). Per rank:

    w1  (E_local, 2*F_local, H) bf16, gated SiLU: rows [0, F_local) the gate
        slice, rows [F_local, 2*F_local) the up slice (the same columns of up);
        (E_local, F_local, H) bf16 for GELU (no up projection);
    w2  (E_local, H, F_local) bf16: the down projection's slice.

FFN_e(x) = act(x w1[e]^T) w2[e]^T, h = silu(gate) * up (or gelu(x w1^T)).
Every `from_*` function returns (w1, w2) for one rank: new bf16 contiguous
tensors on the inputs' device (never views of the inputs; fp32/fp16 weights
are rounded to bf16 to nearest even), and reads only that rank's experts.
Every `to_*` function takes what the W ranks hold (a sequence of W (w1, w2)
pairs indexed by rank, or of objects with .w1 and .w2 such as
comet.torch.MoEExperts; with W = 1 the pair itself) and rebuilds the
unsliced experts, bf16: a round trip of bf16 weights is exact.

Sources (H = hidden, F = the expert's ffn, E = experts):

- HF Mixtral, transformers 4.x: `block_sparse_moe.experts[i]` with nn.Linear
  `w1` = gate (F, H), `w3` = up (F, H), `w2` = down (H, F) (their .weight);
  h = silu(w1(x)) * w3(x), FFN = w2(h).  `from_hf_mixtral`, `to_hf_mixtral`.
- HF Qwen2-MoE / Qwen3-MoE, transformers 4.x: `mlp.experts[i]` with
  `gate_proj` (F, H), `up_proj` (F, H), `down_proj` (H, F).
  `from_hf_qwen_moe` (= from_hf_qwen2_moe = from_hf_qwen3_moe), `to_hf_qwen_moe`.
  Qwen2-MoE's shared expert (`mlp.shared_expert`, `shared_expert_gate`) is a
  dense MLP every token takes: not an expert of comet's layer, not converted.
- Fused experts: one module with `gate_up_proj` (E, 2F, H) and `down_proj`
  (E, H, F), as transformers 5 stores Mixtral's, Qwen2-MoE's and Qwen3-MoE's
  experts (MixtralExperts etc.: `gate, up = linear(x, gate_up_proj[e]).chunk(2,
  -1)`): gate first, rows [0, F) the gate and [F, 2F) the up projection,
  order="gate_first" (the default). order="interleaved" reads gate rows at
  even and up rows at odd indices (gate_up[:, 0::2], gate_up[:, 1::2]), the
  layout of some fused checkpoints. `from_fused`, `to_fused`. The
  from_hf_* functions take such a module too (gate first). Layouts stored
  transposed, (E, H, 2F) (Llama 4's, gpt-oss's), need gate_up.transpose(1, 2)
  first; gpt-oss's clamped, biased SwiGLU is not comet's activation.
- Megatron-Core, read from megatron/core/transformer/moe/experts.py
  (GroupedMLP and its sharded_state_dict; TEGroupedMLP and SequentialMLP
  hold the same per rank). What is assumed:
  * The distributed checkpoint's `experts.linear_fc1.weight` is (E, 2F, H)
    with, per expert, [gate; up] over the whole F (GroupedMLP's
    sh_ten_build_fn puts a TP rank's gate half at fragment tp of 2*TP and its
    up half at TP + tp), and `experts.linear_fc2.weight` is (E, H, F): the
    gate-first fused layout above, nn.Linear orientation. `from_megatron`,
    `to_megatron` (gated=False: fc1 (E, F, H), no up).
  * A GroupedMLP's own parameters on one rank are that rank's slices already,
    stored transposed: weight1 (H, E_local*2F_local), which its forward views
    as (E_local, H, 2F_local) and whose output it splits with chunk(2, -1) into
    [gate | up] (glu = act(x[0]) * x[1]); weight2 (E_local*F_local, H), viewed
    as (E_local, F_local, H). Megatron's expert-TP rank tp and EP rank ep are
    comet's rank ep*TP + tp. `from_megatron_grouped_mlp`,
    `to_megatron_grouped_mlp`. (TEGroupedMLP's `linear_fc1.weight{i}` (2F_local,
    H) and `linear_fc2.weight{i}` (H, F_local), and SequentialMLP's
    `local_experts[i].linear_fc1/linear_fc2.weight`, are nn.Linear-oriented
    with the same [gate; up] halves: torch.stack them to get w1 and w2.)

Wrong shapes, counts or ranks raise ValueError, a wrong type TypeError, each
naming the function, the tensor and the shape expected.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "rank_coords",
    "from_experts",
    "from_hf_mixtral",
    "from_hf_qwen_moe",
    "from_hf_qwen2_moe",
    "from_hf_qwen3_moe",
    "from_fused",
    "from_megatron",
    "from_megatron_grouped_mlp",
    "gather",
    "to_experts",
    "to_hf_mixtral",
    "to_hf_qwen_moe",
    "to_hf_qwen2_moe",
    "to_hf_qwen3_moe",
    "to_fused",
    "to_megatron",
    "to_megatron_grouped_mlp",
]

_ORDERS = ("gate_first", "interleaved")


# ---------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------
def rank_coords(rank: int, tp: int = 1, ep: int = 1, *, fn: str = "rank_coords") -> Tuple[int, int]:
    """(ep_index, tp_index) of `rank` in a TP x EP world: rank = ep_index * TP + tp_index."""
    for name, v in (("tp", tp), ("ep", ep), ("rank", rank)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError("%s: %s must be an int, got %r" % (fn, name, v))
    if tp < 1 or ep < 1:
        raise ValueError("%s: tp=%d and ep=%d must both be >= 1" % (fn, tp, ep))
    if not 0 <= rank < tp * ep:
        raise ValueError("%s: rank %d is outside [0, TP x EP = %d)" % (fn, rank, tp * ep))
    return rank // tp, rank % tp


def _shape(t) -> tuple:
    return tuple(t.shape)


def _tensor(t, fn: str, name: str, ndim: int) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError("%s: %s must be a torch.Tensor, got %s" % (fn, name, type(t).__name__))
    if t.dim() != ndim:
        raise ValueError("%s: %s must be %d-d, got shape %s" % (fn, name, ndim, _shape(t)))
    if not (t.is_floating_point()):
        raise TypeError("%s: %s must be a floating-point tensor, got %s" % (fn, name, t.dtype))
    return t.detach()


def _bf16(t: Tensor) -> Tensor:
    """A new bf16 contiguous tensor (never a view of t)."""
    return t.to(dtype=torch.bfloat16, memory_format=torch.contiguous_format, copy=True)


def _split(E: int, F: int, tp: int, ep: int, rank: int, fn: str) -> Tuple[int, int, int, int]:
    """(e0, e1, f0, f1): the experts and ffn columns rank holds."""
    ep_i, tp_i = rank_coords(rank, tp, ep, fn=fn)
    if E % ep:
        raise ValueError("%s: %d experts do not divide into EP=%d groups (E must be a multiple of EP)" % (fn, E, ep))
    if F % tp:
        raise ValueError("%s: ffn F=%d does not divide into TP=%d slices (F must be a multiple of TP)" % (fn, F, tp))
    El, Fl = E // ep, F // tp
    return ep_i * El, (ep_i + 1) * El, tp_i * Fl, (tp_i + 1) * Fl


def _stacked(ws, fn: str, name: str) -> Tuple[object, int, tuple]:
    """ws: a 3-d tensor (E, a, b) or a sequence of E 2-d tensors (a, b) of one
    shape. Returns (ws, E, (a, b)); a sequence is checked element by element."""
    if isinstance(ws, Tensor):
        t = _tensor(ws, fn, name, 3)
        return t, t.shape[0], _shape(t)[1:]
    try:
        n = len(ws)
    except TypeError:
        raise TypeError("%s: %s must be a 3-d tensor (E, ., .) or a sequence of E 2-d tensors, got %s"
                        % (fn, name, type(ws).__name__)) from None
    if n == 0:
        raise ValueError("%s: %s holds no experts" % (fn, name))
    first = None
    out = []
    for e in range(n):
        t = _tensor(ws[e], fn, "%s[%d]" % (name, e), 2)
        if first is None:
            first = _shape(t)
        elif _shape(t) != first:
            raise ValueError("%s: %s[%d] is %s, %s[0] is %s: every expert must have one shape"
                             % (fn, name, e, _shape(t), name, first))
        out.append(t)
    return out, n, first


def _one_device(fn: str, **tensors) -> None:
    devices = {}
    for name, t in tensors.items():
        if t is None:
            continue
        ts = [t] if isinstance(t, Tensor) else list(t)
        for x in ts:
            devices.setdefault(x.device, name)
    if len(devices) > 1:
        raise ValueError("%s: the weights are on several devices (%s): put them on one"
                         % (fn, ", ".join("%s on %s" % (n, d) for d, n in devices.items())))


# ---------------------------------------------------------------------------
# Into comet's layout.
# ---------------------------------------------------------------------------
def from_experts(gate, up, down, *, tp: int = 1, ep: int = 1, rank: int = 0,
                 _fn: str = "from_experts",
                 _names: Tuple[str, str, str] = ("gate", "up", "down")) -> Tuple[Tensor, Tensor]:
    """(w1, w2) of `rank` from unsliced per-expert projections in nn.Linear
    orientation (out_features, in_features):

    Args:
        gate: (E, F, H) tensor, or a sequence of E (F, H) tensors (any float dtype).
        up: the same shapes as gate (gated SiLU: h = silu(x gate^T) * (x up^T)),
            or None for GELU (h = gelu(x gate^T); w1 then has F_local rows).
        down: (E, H, F) tensor, or a sequence of E (H, F) tensors.
        tp, ep, rank: the world (TP x EP ranks) and the rank whose slice to return.

    Returns:
        w1: (E/EP, 2F/TP, H) bf16 ([gate slice; up slice]), or (E/EP, F/TP, H) with up=None.
        w2: (E/EP, H, F/TP) bf16.
    """
    gname, uname, dname = _names
    gate, E, (F, H) = _stacked(gate, _fn, gname)
    if up is not None:
        up, Eu, shape_u = _stacked(up, _fn, uname)
        if Eu != E or shape_u != (F, H):
            raise ValueError("%s: %s is %d x %s, %s is %d x %s: they must match (E experts of (F, H))"
                             % (_fn, uname, Eu, shape_u, gname, E, (F, H)))
    down, Ed, shape_d = _stacked(down, _fn, dname)
    if Ed != E or shape_d != (H, F):
        raise ValueError("%s: %s must be %d experts of (H=%d, F=%d) to match %s's (F, H) = %s, got %d of %s"
                         % (_fn, dname, E, H, F, gname, (F, H), Ed, shape_d))
    _one_device(_fn, **{gname: gate, uname: up, dname: down})
    e0, e1, f0, f1 = _split(E, F, tp, ep, rank, _fn)
    with torch.no_grad():
        if isinstance(gate, Tensor):
            g = gate[e0:e1, f0:f1]
            u = up[e0:e1, f0:f1] if up is not None else None
        else:
            g = torch.stack([gate[e][f0:f1] for e in range(e0, e1)])
            u = torch.stack([up[e][f0:f1] for e in range(e0, e1)]) if up is not None else None
        if isinstance(down, Tensor):
            d = down[e0:e1, :, f0:f1]
        else:
            d = torch.stack([down[e][:, f0:f1] for e in range(e0, e1)])
        if u is not None:
            w1 = torch.cat([g.to(torch.bfloat16), u.to(torch.bfloat16)], dim=1)
        else:
            w1 = _bf16(g)
        return w1.contiguous(), _bf16(d)


def _experts_of(obj):
    """The experts inside a MoE block (an object with .experts), else obj."""
    if not hasattr(obj, "__len__") and not hasattr(obj, "gate_up_proj") and hasattr(obj, "experts"):
        return obj.experts
    return obj


def _weight(obj, attr: str, fn: str, where: str, hint: str) -> Tensor:
    if not hasattr(obj, attr):
        raise ValueError("%s: %s has no attribute %r (%s)" % (fn, where, attr, hint))
    w = getattr(obj, attr)
    if not isinstance(w, Tensor):
        if not hasattr(w, "weight"):
            raise ValueError("%s: %s.%s has no .weight and is not a tensor (%s)" % (fn, where, attr, hint))
        w = w.weight
    if not isinstance(w, Tensor):
        raise TypeError("%s: %s.%s.weight is a %s, not a torch.Tensor" % (fn, where, attr, type(w).__name__))
    return w


def _from_hf(experts, attrs: Tuple[str, str, str], hint: str, fn: str, tp: int, ep: int, rank: int):
    experts = _experts_of(experts)
    if hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj") and not hasattr(experts, "__len__"):
        # transformers 5's fused experts module: gate first
        gu = _weight(experts, "gate_up_proj", fn, "experts", "fused experts hold gate_up_proj and down_proj")
        dn = _weight(experts, "down_proj", fn, "experts", "fused experts hold gate_up_proj and down_proj")
        return from_fused(gu, dn, order="gate_first", tp=tp, ep=ep, rank=rank, _fn=fn)
    try:
        n = len(experts)
    except TypeError:
        raise TypeError("%s: experts must be a sequence of expert modules (%s), a MoE block with .experts, or a fused "
                        "experts module (gate_up_proj, down_proj), got %s"
                        % (fn, hint, type(experts).__name__)) from None
    if n == 0:
        raise ValueError("%s: no experts" % fn)
    ws = [[_weight(experts[e], a, fn, "experts[%d]" % e, hint) for e in range(n)] for a in attrs]
    return from_experts(*ws, tp=tp, ep=ep, rank=rank, _fn=fn, _names=attrs)


def from_hf_mixtral(experts, *, tp: int = 1, ep: int = 1, rank: int = 0) -> Tuple[Tensor, Tensor]:
    """(w1, w2) of `rank` from HF Mixtral's experts.

    Args:
        experts: `block_sparse_moe.experts` (a sequence of E objects with
            `w1` = gate, `w3` = up, `w2` = down: nn.Linear layers or tensors,
            .weight (F, H), (F, H), (H, F), any float dtype), or the block
            itself (`block_sparse_moe`, an object with .experts), or a fused
            experts module (gate_up_proj (E, 2F, H) gate first, down_proj
            (E, H, F): transformers 5).
        tp, ep, rank: the world and the rank whose slice to return.

    Returns:
        w1 (E/EP, 2F/TP, H) bf16 and w2 (E/EP, H, F/TP) bf16, contiguous.
    """
    return _from_hf(experts, ("w1", "w3", "w2"), "HF Mixtral experts have w1 (gate), w3 (up), w2 (down)",
                    "from_hf_mixtral", tp, ep, rank)


def from_hf_qwen_moe(experts, *, tp: int = 1, ep: int = 1, rank: int = 0) -> Tuple[Tensor, Tensor]:
    """(w1, w2) of `rank` from HF Qwen2-MoE's or Qwen3-MoE's experts.

    Args:
        experts: `mlp.experts` (a sequence of E objects with `gate_proj`
            (F, H), `up_proj` (F, H), `down_proj` (H, F): nn.Linear layers or
            tensors, any float dtype), or the block (`mlp`; its shared expert
            is not converted), or a fused experts module (gate_up_proj
            (E, 2F, H) gate first, down_proj (E, H, F): transformers 5).
        tp, ep, rank: the world and the rank whose slice to return.

    Returns:
        w1 (E/EP, 2F/TP, H) bf16 and w2 (E/EP, H, F/TP) bf16, contiguous.
    """
    return _from_hf(experts, ("gate_proj", "up_proj", "down_proj"),
                    "HF Qwen-MoE experts have gate_proj, up_proj, down_proj", "from_hf_qwen_moe", tp, ep, rank)


from_hf_qwen2_moe = from_hf_qwen_moe
from_hf_qwen3_moe = from_hf_qwen_moe


def from_fused(gate_up: Tensor, down: Tensor, *, order: str = "gate_first", tp: int = 1, ep: int = 1,
               rank: int = 0, _fn: str = "from_fused") -> Tuple[Tensor, Tensor]:
    """(w1, w2) of `rank` from fused, unsliced experts.

    Args:
        gate_up: (E, 2F, H), any float dtype. order="gate_first": rows [0, F)
            the gate, [F, 2F) the up projection (transformers 5's
            gate_up_proj, Megatron's fc1); order="interleaved": gate rows at
            even indices, up rows at odd ones.
        down: (E, H, F).
        tp, ep, rank: the world and the rank whose slice to return.

    Returns:
        w1 (E/EP, 2F/TP, H) bf16 and w2 (E/EP, H, F/TP) bf16, contiguous.
    """
    if order not in _ORDERS:
        raise ValueError('%s: order %r is not "gate_first" or "interleaved"' % (_fn, order))
    gate_up = _tensor(gate_up, _fn, "gate_up", 3)
    down = _tensor(down, _fn, "down", 3)
    E, rows, H = gate_up.shape
    if rows % 2:
        raise ValueError("%s: gate_up must be (E, 2F, H) (gate and up rows), got %s: %d rows is odd"
                         % (_fn, _shape(gate_up), rows))
    F = rows // 2
    if _shape(down) != (E, H, F):
        raise ValueError("%s: down must be (E=%d, H=%d, F=%d) to match gate_up %s, got %s"
                         % (_fn, E, H, F, _shape(gate_up), _shape(down)))
    if order == "gate_first":
        gate, up = gate_up[:, :F], gate_up[:, F:]
    else:
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    return from_experts(gate, up, down, tp=tp, ep=ep, rank=rank, _fn=_fn)


def from_megatron(fc1: Tensor, fc2: Tensor, *, gated: bool = True, tp: int = 1, ep: int = 1,
                  rank: int = 0) -> Tuple[Tensor, Tensor]:
    """(w1, w2) of `rank` from Megatron-Core's unsliced grouped experts, as
    its distributed checkpoint holds them (`experts.linear_fc1.weight`,
    `experts.linear_fc2.weight`; see the module's docstring for what is
    assumed).

    Args:
        fc1: (E, 2F, H) with gated=True (SwiGLU: per expert [gate; up], the
            gate's F rows first), (E, F, H) with gated=False (GELU).
        fc2: (E, H, F).
        gated, tp, ep, rank: the activation's kind, the world, the rank.

    Returns:
        w1 (E/EP, 2F/TP or F/TP, H) bf16 and w2 (E/EP, H, F/TP) bf16, contiguous.
    """
    fn = "from_megatron"
    if gated:
        return from_fused(fc1, fc2, order="gate_first", tp=tp, ep=ep, rank=rank, _fn=fn)
    fc1 = _tensor(fc1, fn, "fc1", 3)
    fc2 = _tensor(fc2, fn, "fc2", 3)
    E, F, H = fc1.shape
    if _shape(fc2) != (E, H, F):
        raise ValueError("%s: fc2 must be (E=%d, H=%d, F=%d) to match fc1 %s (gated=False), got %s"
                         % (fn, E, H, F, _shape(fc1), _shape(fc2)))
    return from_experts(fc1, None, fc2, tp=tp, ep=ep, rank=rank, _fn=fn, _names=("fc1", "up", "fc2"))


def from_megatron_grouped_mlp(weight1: Tensor, weight2: Tensor, *, num_local_experts: int,
                              gated: bool = True) -> Tuple[Tensor, Tensor]:
    """(w1, w2) from a Megatron-Core GroupedMLP's parameters on one rank
    (already that rank's experts and ffn slice: no tp/ep/rank to give).

    Args:
        weight1: (H, E_local * 2 F_local) (gated; E_local * F_local columns
            for GELU), viewed by Megatron as (E_local, H, 2 F_local) with
            [gate | up] halves on the last axis.
        weight2: (E_local * F_local, H), viewed as (E_local, F_local, H).
        num_local_experts: E_local.
        gated: SwiGLU (True) or a plain activation (False).

    Returns:
        w1 (E_local, 2 F_local or F_local, H) bf16 and w2 (E_local, H, F_local) bf16.
    """
    fn = "from_megatron_grouped_mlp"
    weight1 = _tensor(weight1, fn, "weight1", 2)
    weight2 = _tensor(weight2, fn, "weight2", 2)
    El = num_local_experts
    if isinstance(El, bool) or not isinstance(El, int) or El < 1:
        raise ValueError("%s: num_local_experts must be an int >= 1, got %r" % (fn, El))
    H, cols = weight1.shape
    if cols % El:
        raise ValueError("%s: weight1 %s's %d columns are not num_local_experts=%d equal groups"
                         % (fn, _shape(weight1), cols, El))
    rows = cols // El
    if gated and rows % 2:
        raise ValueError("%s: weight1 %s gives each expert %d columns, odd: gated=True needs [gate | up] halves"
                         % (fn, _shape(weight1), rows))
    Fl = rows // 2 if gated else rows
    if _shape(weight2) != (El * Fl, H):
        raise ValueError("%s: weight2 must be (E_local * F_local = %d, H=%d) to match weight1 %s, got %s"
                         % (fn, El * Fl, H, _shape(weight1), _shape(weight2)))
    with torch.no_grad():
        w1 = _bf16(weight1.reshape(El, H, rows).transpose(1, 2))
        w2 = _bf16(weight2.reshape(El, Fl, H).transpose(1, 2))
    return w1, w2


# ---------------------------------------------------------------------------
# Back: from what the ranks hold to unsliced experts.
# ---------------------------------------------------------------------------
def _rank_pairs(ranks, fn: str) -> Tuple[List[Tuple[Tensor, Tensor]], list]:
    """The (w1, w2) of every rank, and what was given for each."""
    if isinstance(ranks, (tuple, list)) and len(ranks) == 2 and isinstance(ranks[0], Tensor):
        ranks = [ranks]  # W = 1: the pair itself
    elif hasattr(ranks, "w1") and hasattr(ranks, "w2"):
        ranks = [ranks]  # one module
    try:
        n = len(ranks)
    except TypeError:
        raise TypeError("%s: ranks must be a sequence of (w1, w2) pairs, one a rank, got %s"
                        % (fn, type(ranks).__name__)) from None
    out = []
    for r in range(n):
        item = ranks[r]
        if hasattr(item, "w1") and hasattr(item, "w2"):
            w1, w2 = item.w1, item.w2
        else:
            try:
                w1, w2 = item
            except (TypeError, ValueError):
                raise TypeError("%s: ranks[%d] must be a (w1, w2) pair or an object with .w1 and .w2, got %s"
                                % (fn, r, type(item).__name__)) from None
        out.append((_tensor(w1, fn, "ranks[%d]'s w1" % r, 3), _tensor(w2, fn, "ranks[%d]'s w2" % r, 3)))
    return out, [ranks[r] for r in range(n)]


def gather(ranks, *, tp: int = 1, ep: int = 1) -> Tuple[Tensor, Tensor]:
    """The unsliced experts in comet's layout (what a one-rank world holds)
    from what every rank of a TP x EP world holds.

    Args:
        ranks: W = TP x EP entries indexed by rank, each a (w1, w2) pair or an
            object with .w1 and .w2 (comet.torch.MoEExperts): w1
            (E_local, 2F_local or F_local, H), w2 (E_local, H, F_local), one
            shape for every rank. With W = 1, the pair (or module) itself.
        tp, ep: the world.

    Returns:
        w1 (E, 2F, H) bf16 ([gate; up], gated) or (E, F, H) (GELU), and
        w2 (E, H, F) bf16.
    """
    fn = "gather"
    pairs, items = _rank_pairs(ranks, fn)
    rank_coords(0, tp, ep, fn=fn)
    if len(pairs) != tp * ep:
        raise ValueError("%s: %d ranks given for TP=%d x EP=%d = %d" % (fn, len(pairs), tp, ep, tp * ep))
    for r, item in enumerate(items):  # modules (MoEExperts) say which rank they hold
        held = tuple(getattr(item, a, None) for a in ("rank", "tp", "ep"))
        if None not in held and held != (r, tp, ep):
            raise ValueError("%s: ranks[%d] holds rank %d of a TP=%d x EP=%d world, not rank %d of TP=%d x EP=%d"
                             % (fn, r, held[0], held[1], held[2], r, tp, ep))
    El, rows, H = pairs[0][0].shape
    Fl = pairs[0][1].shape[2]
    if _shape(pairs[0][1]) != (El, H, Fl) or rows not in (Fl, 2 * Fl):
        raise ValueError("%s: rank 0's w1 %s and w2 %s are not (E_local, 2F_local or F_local, H) and "
                         "(E_local, H, F_local)" % (fn, _shape(pairs[0][0]), _shape(pairs[0][1])))
    for r, (w1, w2) in enumerate(pairs):
        if _shape(w1) != (El, rows, H) or _shape(w2) != (El, H, Fl):
            raise ValueError("%s: rank %d holds w1 %s and w2 %s, rank 0 holds %s and %s: every rank holds one shape"
                             % (fn, r, _shape(w1), _shape(w2), (El, rows, H), (El, H, Fl)))
    _one_device(fn, w1=[p[0] for p in pairs], w2=[p[1] for p in pairs])
    gated = rows == 2 * Fl
    with torch.no_grad():
        groups = [pairs[e * tp:(e + 1) * tp] for e in range(ep)]  # rank = ep * TP + tp
        w2 = torch.cat([torch.cat([p[1] for p in g], dim=2) for g in groups], dim=0)
        gate = torch.cat([torch.cat([p[0][:, :Fl] for p in g], dim=1) for g in groups], dim=0)
        if gated:
            up = torch.cat([torch.cat([p[0][:, Fl:] for p in g], dim=1) for g in groups], dim=0)
            w1 = torch.cat([gate.to(torch.bfloat16), up.to(torch.bfloat16)], dim=1)
        else:
            w1 = _bf16(gate)
        return w1.contiguous(), _bf16(w2)


def to_experts(ranks, *, tp: int = 1, ep: int = 1) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """The unsliced experts in nn.Linear orientation from what the ranks hold
    (`ranks` as gather's).

    Returns:
        gate (E, F, H) bf16, up (E, F, H) bf16 (None for GELU weights), and
        down (E, H, F) bf16.
    """
    w1, w2 = gather(ranks, tp=tp, ep=ep)
    F = w2.shape[2]
    if w1.shape[1] == 2 * F:
        return w1[:, :F], w1[:, F:], w2
    return w1, None, w2


def _to_hf(ranks, tp, ep, names, fn):
    gate, up, down = to_experts(ranks, tp=tp, ep=ep)
    if up is None:
        raise ValueError("%s: these are GELU weights (w1 has F_local rows): %s experts are gated (gate and up)"
                         % (fn, fn[len("to_"):]))
    g, u, d = names
    return [{g: gate[e], u: up[e], d: down[e]} for e in range(gate.shape[0])]


def to_hf_mixtral(ranks, *, tp: int = 1, ep: int = 1) -> List[dict]:
    """HF Mixtral's experts from what the ranks hold (`ranks` as gather's):
    a list of E state dicts {"w1.weight": gate (F, H), "w3.weight": up (F, H),
    "w2.weight": down (H, F)}, bf16 (`experts[i].load_state_dict(d[i])`)."""
    return _to_hf(ranks, tp, ep, ("w1.weight", "w3.weight", "w2.weight"), "to_hf_mixtral")


def to_hf_qwen_moe(ranks, *, tp: int = 1, ep: int = 1) -> List[dict]:
    """HF Qwen2-MoE's / Qwen3-MoE's experts from what the ranks hold (`ranks`
    as gather's): a list of E state dicts {"gate_proj.weight": (F, H),
    "up_proj.weight": (F, H), "down_proj.weight": (H, F)}, bf16."""
    return _to_hf(ranks, tp, ep, ("gate_proj.weight", "up_proj.weight", "down_proj.weight"), "to_hf_qwen_moe")


to_hf_qwen2_moe = to_hf_qwen_moe
to_hf_qwen3_moe = to_hf_qwen_moe


def to_fused(ranks, *, tp: int = 1, ep: int = 1, order: str = "gate_first") -> Tuple[Tensor, Tensor]:
    """Fused experts from what the ranks hold (`ranks` as gather's):
    gate_up (E, 2F, H) bf16 (order as from_fused's) and down (E, H, F) bf16."""
    if order not in _ORDERS:
        raise ValueError('to_fused: order %r is not "gate_first" or "interleaved"' % (order,))
    gate, up, down = to_experts(ranks, tp=tp, ep=ep)
    if up is None:
        raise ValueError("to_fused: these are GELU weights (w1 has F_local rows): no gate_up to fuse")
    if order == "gate_first":
        return torch.cat([gate, up], dim=1), down
    E, F, H = gate.shape
    return torch.stack([gate, up], dim=2).reshape(E, 2 * F, H), down


def to_megatron(ranks, *, tp: int = 1, ep: int = 1) -> Tuple[Tensor, Tensor]:
    """Megatron-Core's unsliced grouped experts (as from_megatron reads them)
    from what the ranks hold: fc1 (E, 2F, H) [gate; up] (gated) or (E, F, H)
    (GELU), and fc2 (E, H, F), bf16."""
    return gather(ranks, tp=tp, ep=ep)


def to_megatron_grouped_mlp(w1: Tensor, w2: Tensor) -> Tuple[Tensor, Tensor]:
    """One rank's GroupedMLP parameters from that rank's comet weights (the
    inverse of from_megatron_grouped_mlp): weight1 (H, E_local * rows) and
    weight2 (E_local * F_local, H), bf16, with rows = w1.shape[1]."""
    fn = "to_megatron_grouped_mlp"
    (w1, w2), = _rank_pairs([(w1, w2)], fn)[0]
    El, rows, H = w1.shape
    Fl = w2.shape[2]
    if _shape(w2) != (El, H, Fl) or rows not in (Fl, 2 * Fl):
        raise ValueError("%s: w1 %s and w2 %s are not (E_local, 2F_local or F_local, H) and (E_local, H, F_local)"
                         % (fn, _shape(w1), _shape(w2)))
    with torch.no_grad():
        return (_bf16(w1.transpose(1, 2)).reshape(H, El * rows), _bf16(w2.transpose(1, 2)).reshape(El * Fl, H))
