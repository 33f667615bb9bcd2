"""test_convert.py - comet.convert (framework weights into comet's per-rank
layout and back) and comet.torch.MoEExperts, on synthetic HF-like experts
built from torch.nn.Linear with random weights (no transformers, no
Megatron), E in {4, 8}, TP in {1, 2}, EP in {1, 2}:

  1. round trips HF -> comet (every rank) -> HF are exact (bf16 weights;
     fp32 weights come back rounded to bf16), for Mixtral's w1/w3/w2,
     Qwen-MoE's gate_proj/up_proj/down_proj, fused gate_up (gate first and
     interleaved), Megatron's fc1/fc2 and a GroupedMLP's own parameters;
  2. concatenating what every rank holds (here, in the test, by comet.h's
     rule rank = ep * TP + tp) reproduces the unsliced experts bitwise;
  3. MoEExperts' forward (W = 1) against a pure-torch HF-style forward,
     y = sum_j topk_w[:, j] * (silu(x Wg^T) * (x Wu^T)) Wd^T in fp32, within
     the stated bf16 tolerance (TOLERANCE below);
  4. for TP, EP > 1: the sum over the ranks of a pure-torch forward of each
     rank's slice equals the unsliced forward in fp64 (1e-12: the slicing is
     exact algebra) and, with comet's rounding points (h and o bf16 per rank,
     the partials summed in fp32, y bf16), within the same tolerance; and
     comet.reference_forward on the W ranks' weights (comet's specification,
     a real W-rank world's arithmetic) within it too;
  5. wrong shapes, counts and ranks raise with messages naming the tensor.

Skipped as a whole without torch."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: comet.convert and comet.torch.MoEExperts are "
                                            "not tested")

import comet  # noqa: E402
import comet.convert as cv  # noqa: E402
import comet.torch as ct  # noqa: E402

H, F, T, TOPK = 48, 32, 29, 2
WORLDS = [(tp, ep) for ep in (1, 2) for tp in (1, 2)]
KINDS = {
    "mixtral": (("w1", "w3", "w2"), cv.from_hf_mixtral, cv.to_hf_mixtral),
    "qwen": (("gate_proj", "up_proj", "down_proj"), cv.from_hf_qwen_moe, cv.to_hf_qwen_moe),
}

# TOLERANCE: comet rounds h (the activation's output) and o (each expert's
# output, per rank) to bf16 once each: 2^-9 relative each, so at most
# 2^-8 * M together, M = sum_j topk_w[:, j] * |h_j| |W_down|^T (the forward
# with absolute values); and y once: 2^-9 |y|. The bound below doubles that
# for fp32 accumulation in another order (H, F < 64: ~1e-6 relative).


def within_tolerance(y, y_ref, M):
    """Elementwise |y - y_ref| <= 2^-7 M + 2^-8 |y_ref|; returns (ok, the worst ratio)."""
    err = (y.double() - y_ref.double()).abs()
    bound = 2.0 ** -7 * M.double() + 2.0 ** -8 * y_ref.double().abs()
    return bool((err <= bound).all()), float((err / bound).max())


# ---------------------------------------------------------------------------
# Synthetic HF-like experts.
# ---------------------------------------------------------------------------
class Expert(torch.nn.Module):
    """One HF-style gated expert: three nn.Linear layers named as `names`
    (gate, up, down) with forward down(silu(gate(x)) * up(x))."""

    def __init__(self, names, g, dtype):
        super().__init__()
        self.names = names
        for name, (out_f, in_f) in zip(names, ((F, H), (F, H), (H, F))):
            lin = torch.nn.Linear(in_f, out_f, bias=False, dtype=dtype)
            with torch.no_grad():
                lin.weight.copy_(torch.empty(out_f, in_f).uniform_(-1, 1, generator=g) / in_f ** 0.5 * 2)
            setattr(self, name, lin)

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(torch.nn.functional.silu(gate(x)) * up(x))


class Block(torch.nn.Module):
    """A sparse MoE block as HF 4.x has it: .experts, a ModuleList."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts


class FusedExperts(torch.nn.Module):
    """transformers 5's fused experts: gate_up_proj (E, 2F, H) gate first, down_proj (E, H, F)."""

    def __init__(self, gate_up, down):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(gate_up.clone())
        self.down_proj = torch.nn.Parameter(down.clone())


def hf_experts(kind, E, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed + 100 * E)
    return torch.nn.ModuleList([Expert(KINDS[kind][0], g, dtype) for _ in range(E)])


def stacked(experts, names):
    """gate (E, F, H), up (E, F, H), down (E, H, F) from HF modules."""
    return tuple(torch.stack([getattr(ex, n).weight.detach() for ex in experts]) for n in names)


def routing(E, seed=1, T=T, topk=TOPK):
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(T, H).uniform_(-1, 1, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(T)])
    w = torch.empty(T, topk).uniform_(0.1, 1, generator=g)
    return x, idx, w


# ---------------------------------------------------------------------------
# Pure-torch forwards.
# ---------------------------------------------------------------------------
def hf_forward(x, idx, w, gate, up, down, dtype=torch.float32):
    """The HF-style experts' forward, expert by expert as HF loops:
    y = sum_j w[:, j] * (silu(x gate_e^T) * (x up_e^T)) down_e^T in `dtype`
    (up None: gelu(x gate_e^T) down_e^T); also M, the same with |h| and
    |down| (the tolerance's scale)."""
    y = torch.zeros(x.shape[0], down.shape[1], dtype=dtype)
    M = torch.zeros_like(y)
    xd = x.to(dtype)
    for j in range(idx.shape[1]):
        for e in idx[:, j].unique().tolist():
            rows = idx[:, j] == e
            g = xd[rows] @ gate[e].to(dtype).T
            h = torch.nn.functional.silu(g) * (xd[rows] @ up[e].to(dtype).T) if up is not None else \
                torch.nn.functional.gelu(g)
            wj = w[rows, j:j + 1].to(dtype)
            y[rows] += wj * (h @ down[e].to(dtype).T)
            M[rows] += wj * (h.abs() @ down[e].to(dtype).abs().T)
    return y, M


def rank_partial(x, idx, w, w1, w2, tp, ep, rank, comet_rounding):
    """What rank `rank` contributes to every token, from its (w1, w2): the
    slots whose expert it holds, its ffn slice. comet_rounding: h and o
    rounded to bf16, the partial in fp32 (comet.h's points 1-3); else fp64."""
    ep_i, _ = cv.rank_coords(rank, tp, ep)
    El, rows, _ = w1.shape
    Fl = w2.shape[2]
    dtype = torch.float32 if comet_rounding else torch.float64
    p = torch.zeros(x.shape[0], w2.shape[1], dtype=dtype)
    xd = x.to(dtype)
    for j in range(idx.shape[1]):
        for e in idx[:, j].unique().tolist():
            if not ep_i * El <= e < (ep_i + 1) * El:
                continue
            le, sel = e - ep_i * El, idx[:, j] == e
            gu = xd[sel] @ w1[le].to(dtype).T
            h = torch.nn.functional.silu(gu[:, :Fl]) * gu[:, Fl:] if rows == 2 * Fl else \
                torch.nn.functional.gelu(gu)
            if comet_rounding:
                h = h.bfloat16().float()
            o = h @ w2[le].to(dtype).T
            if comet_rounding:
                o = o.bfloat16().float()
            p[sel] += w[sel, j:j + 1].to(dtype) * o
    return p


def comet_world_forward(x, idx, w, ranks, tp, ep, activation="silu_gated"):
    """comet.reference_forward for a TP x EP world whose rank r holds
    ranks[r] = (w1, w2); the tokens are split over the ranks (each rank is
    the home of a chunk); returns the y of every token."""
    W = tp * ep
    E = ranks[0][0].shape[0] * ep
    cfg = comet.LayerConfig(hidden=H, ffn=ranks[0][1].shape[2] * tp, num_experts=E, topk=idx.shape[1],
                            max_tokens_per_rank=x.shape[0], activation=activation, tp=tp, ep=ep)
    d = lambda t, dt: comet.TensorDesc(t.data_ptr(), dt, tuple(t.shape))  # noqa: E731
    chunks = torch.arange(x.shape[0]).tensor_split(W)
    args, ys = [], []
    for r in range(W):
        sel = chunks[r]
        xr, ir, wr = x[sel].contiguous(), idx[sel].int().contiguous(), w[sel].contiguous()
        y = torch.empty_like(xr)
        ys.append(y)
        args.append((d(xr, "bf16"), d(ir, "int32"), d(wr, "fp32"), d(ranks[r][0], "bf16"), d(ranks[r][1], "bf16"),
                     d(y, "bf16"), xr, ir, wr))
    comet.reference_forward(cfg, [a[:6] for a in args])
    return torch.cat(ys)


# ---------------------------------------------------------------------------
# 1-2. Layout: round trips, what the ranks hold.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("E", [4, 8])
@pytest.mark.parametrize("tp,ep", WORLDS)
def test_round_trip_hf_comet_hf_is_exact(kind, E, tp, ep):
    names, from_hf, to_hf = KINDS[kind]
    experts = hf_experts(kind, E)
    ranks = [from_hf(experts, tp=tp, ep=ep, rank=r) for r in range(tp * ep)]
    for w1, w2 in ranks:
        assert w1.shape == (E // ep, 2 * F // tp, H) and w2.shape == (E // ep, H, F // tp)
        assert w1.dtype == w2.dtype == torch.bfloat16 and w1.is_contiguous() and w2.is_contiguous()
    back = to_hf(ranks, tp=tp, ep=ep)
    assert len(back) == E
    for e in range(E):
        assert sorted(back[e]) == sorted(n + ".weight" for n in names)
        for n in names:
            assert torch.equal(back[e][n + ".weight"], getattr(experts[e], n).weight), (e, n)
    # into fresh modules through load_state_dict, and the modules' own forward agrees
    fresh = hf_experts(kind, E, seed=7)
    for e in range(E):
        fresh[e].load_state_dict(back[e])
    x = torch.randn(5, H, dtype=torch.bfloat16)
    assert all(torch.equal(fresh[e](x), experts[e](x)) for e in range(E))
    # the block (an object with .experts) and a duck-typed plain list read the same
    assert all(torch.equal(a, b) for a, b in zip(from_hf(Block(experts), tp=tp, ep=ep, rank=tp * ep - 1),
                                                 ranks[-1]))
    plain = [type("E", (), {n: getattr(ex, n).weight for n in names})() for ex in experts]
    assert all(torch.equal(a, b) for a, b in zip(from_hf(plain, tp=tp, ep=ep, rank=0), ranks[0]))


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("E", [4, 8])
@pytest.mark.parametrize("tp,ep", WORLDS)
def test_ranks_concatenate_to_the_unsliced_experts(kind, E, tp, ep):
    """rank = ep_i * TP + tp_i holds experts [ep_i E/EP, (ep_i+1) E/EP) and
    columns [tp_i F/TP, (tp_i+1) F/TP) of gate, up (w1's two halves) and
    down: concatenated here by that rule alone, not by comet.convert."""
    names, from_hf, _ = KINDS[kind]
    experts = hf_experts(kind, E, seed=3)
    gate, up, down = stacked(experts, names)
    ranks = [from_hf(experts, tp=tp, ep=ep, rank=r) for r in range(tp * ep)]
    Fl = F // tp
    rank = lambda ep_i, tp_i: ranks[ep_i * tp + tp_i]  # noqa: E731
    cat_g = torch.cat([torch.cat([rank(i, t)[0][:, :Fl] for t in range(tp)], 1) for i in range(ep)], 0)
    cat_u = torch.cat([torch.cat([rank(i, t)[0][:, Fl:] for t in range(tp)], 1) for i in range(ep)], 0)
    cat_d = torch.cat([torch.cat([rank(i, t)[1] for t in range(tp)], 2) for i in range(ep)], 0)
    assert torch.equal(cat_g, gate) and torch.equal(cat_u, up) and torch.equal(cat_d, down)
    # comet.convert.gather does the same, and to_experts splits it back
    w1, w2 = cv.gather(ranks, tp=tp, ep=ep)
    assert torch.equal(w1, torch.cat([gate, up], 1)) and torch.equal(w2, down)
    g2, u2, d2 = cv.to_experts(ranks, tp=tp, ep=ep)
    assert torch.equal(g2, gate) and torch.equal(u2, up) and torch.equal(d2, down)


def test_fp32_weights_are_rounded_to_bf16_once():
    experts = hf_experts("mixtral", 4, dtype=torch.float32)
    gate, up, down = stacked(experts, ("w1", "w3", "w2"))
    assert not torch.equal(gate.bfloat16().float(), gate)  # the weights are not bf16 values
    ranks = [cv.from_hf_mixtral(experts, tp=2, ep=2, rank=r) for r in range(4)]
    back = cv.to_hf_mixtral(ranks, tp=2, ep=2)
    for e in range(4):
        assert torch.equal(back[e]["w1.weight"], gate[e].bfloat16())
        assert torch.equal(back[e]["w3.weight"], up[e].bfloat16())
        assert torch.equal(back[e]["w2.weight"], down[e].bfloat16())


@pytest.mark.parametrize("E", [4, 8])
@pytest.mark.parametrize("tp,ep", WORLDS)
def test_fused_gate_first_and_interleaved(E, tp, ep):
    experts = hf_experts("qwen", E, seed=5)
    gate, up, down = stacked(experts, ("gate_proj", "up_proj", "down_proj"))
    first = torch.cat([gate, up], 1)  # (E, 2F, H): transformers 5's gate_up_proj
    inter = torch.stack([gate, up], 2).reshape(E, 2 * F, H)  # gate rows even, up rows odd
    assert torch.equal(inter[:, 0::2], gate) and torch.equal(inter[:, 1::2], up)
    for r in range(tp * ep):
        want = cv.from_hf_qwen_moe(experts, tp=tp, ep=ep, rank=r)
        for got in (cv.from_fused(first, down, tp=tp, ep=ep, rank=r),
                    cv.from_fused(inter, down, order="interleaved", tp=tp, ep=ep, rank=r),
                    cv.from_hf_qwen_moe(FusedExperts(first, down), tp=tp, ep=ep, rank=r),
                    cv.from_hf_mixtral(Block(FusedExperts(first, down)), tp=tp, ep=ep, rank=r)):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ranks = [cv.from_fused(first, down, tp=tp, ep=ep, rank=r) for r in range(tp * ep)]
    gu, dn = cv.to_fused(ranks, tp=tp, ep=ep)
    assert torch.equal(gu, first) and torch.equal(dn, down)
    gu, dn = cv.to_fused(ranks, tp=tp, ep=ep, order="interleaved")
    assert torch.equal(gu, inter) and torch.equal(dn, down)


def test_results_are_new_tensors_never_views():
    experts = hf_experts("mixtral", 4)
    gate, up, down = stacked(experts, ("w1", "w3", "w2"))
    first = torch.cat([gate, up], 1)
    for w in cv.from_fused(first, down) + cv.from_megatron(gate, down, gated=False):
        for src in (first, down, gate):
            assert w.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    w1, w2 = cv.from_hf_mixtral(experts)
    assert not w1.requires_grad and not w2.requires_grad  # detached from the nn.Linear parameters


def megatron_grouped_mlp_params(fc1, fc2, tp, ep, rank):
    """A GroupedMLP's weight1 (H, E_local * 2F_local) and weight2
    (E_local * F_local, H) on rank (ep_i, tp_i), built from the unsliced
    checkpoint tensors by Megatron's rule as read in experts.py: expert e's
    fc1 on the rank is [gate slice tp_i; up slice tp_i] (2F_local, H), stored
    transposed, (H, 2F_local), the E_local of them back to back in memory
    (weight1.view(E_local, H, -1)); fc2's slice (H, F_local) stored as
    (F_local, H) (weight2.view(E_local, -1, H))."""
    ep_i, tp_i = divmod(rank, tp)
    E = fc1.shape[0]
    El, Fl = E // ep, F // tp
    es = range(ep_i * El, (ep_i + 1) * El)
    fs = slice(tp_i * Fl, (tp_i + 1) * Fl)
    per_expert_fc1 = [torch.cat([fc1[e, :F][fs], fc1[e, F:][fs]], 0).T for e in es]  # (H, 2F_local)
    per_expert_fc2 = [fc2[e][:, fs].T for e in es]  # (F_local, H)
    weight1 = torch.stack(per_expert_fc1).contiguous().view(H, El * 2 * Fl)
    weight2 = torch.stack(per_expert_fc2).contiguous().view(El * Fl, H)
    return weight1, weight2


@pytest.mark.parametrize("E", [4, 8])
@pytest.mark.parametrize("tp,ep", WORLDS)
def test_megatron(E, tp, ep):
    experts = hf_experts("mixtral", E, seed=9)
    gate, up, down = stacked(experts, ("w1", "w3", "w2"))
    fc1, fc2 = torch.cat([gate, up], 1), down  # the checkpoint's experts.linear_fc1/fc2.weight
    ranks = []
    x, idx, w = routing(E, seed=11)
    for r in range(tp * ep):
        w1, w2 = cv.from_megatron(fc1, fc2, tp=tp, ep=ep, rank=r)
        want = cv.from_hf_mixtral(experts, tp=tp, ep=ep, rank=r)
        assert torch.equal(w1, want[0]) and torch.equal(w2, want[1])
        ranks.append((w1, w2))
        # a GroupedMLP's own parameters on this rank, both ways
        weight1, weight2 = megatron_grouped_mlp_params(fc1, fc2, tp, ep, r)
        El = E // ep
        g1, g2 = cv.from_megatron_grouped_mlp(weight1, weight2, num_local_experts=El)
        assert torch.equal(g1, w1) and torch.equal(g2, w2)
        b1, b2 = cv.to_megatron_grouped_mlp(w1, w2)
        assert torch.equal(b1, weight1) and torch.equal(b2, weight2)
        # GroupedMLP's forward as experts.py writes it (gmm with trans_b=False,
        # glu = act(chunk[0]) * chunk[1]), in fp64, equals this rank's partial
        v1, v2 = weight1.double().view(El, H, -1), weight2.double().view(El, -1, H)
        p = torch.zeros(T, H, dtype=torch.float64)
        ep_i = r // tp
        for j in range(TOPK):
            for e in idx[:, j].unique().tolist():
                if ep_i * El <= e < (ep_i + 1) * El:
                    sel = idx[:, j] == e
                    a, b = torch.chunk(x[sel].double() @ v1[e - ep_i * El], 2, dim=-1)
                    p[sel] += w[sel, j:j + 1].double() * ((torch.nn.functional.silu(a) * b) @ v2[e - ep_i * El])
        torch.testing.assert_close(p, rank_partial(x, idx, w, w1, w2, tp, ep, r, False), rtol=1e-12, atol=1e-12)
    b1, b2 = cv.to_megatron(ranks, tp=tp, ep=ep)
    assert torch.equal(b1, fc1) and torch.equal(b2, fc2)


@pytest.mark.parametrize("tp,ep", WORLDS)
def test_megatron_gelu(tp, ep):
    g = torch.Generator().manual_seed(13)
    fc1 = (torch.empty(4, F, H).uniform_(-0.3, 0.3, generator=g)).bfloat16()
    fc2 = (torch.empty(4, H, F).uniform_(-0.3, 0.3, generator=g)).bfloat16()
    ranks = [cv.from_megatron(fc1, fc2, gated=False, tp=tp, ep=ep, rank=r) for r in range(tp * ep)]
    assert ranks[0][0].shape == (4 // ep, F // tp, H)
    b1, b2 = cv.to_megatron(ranks, tp=tp, ep=ep)
    assert torch.equal(b1, fc1) and torch.equal(b2, fc2)
    g1, u1, d1 = cv.to_experts(ranks, tp=tp, ep=ep)
    assert u1 is None and torch.equal(g1, fc1) and torch.equal(d1, fc2)
    weight1, weight2 = cv.to_megatron_grouped_mlp(*ranks[-1])
    assert weight1.shape == (H, 4 // ep * F // tp)
    back = cv.from_megatron_grouped_mlp(weight1, weight2, num_local_experts=4 // ep, gated=False)
    assert torch.equal(back[0], ranks[-1][0]) and torch.equal(back[1], ranks[-1][1])
    # the forward: sum over ranks in fp64 = unsliced, and comet's W-rank world within tolerance
    x, idx, w = routing(4, seed=14)
    full, M = hf_forward(x, idx, w, fc1, None, fc2, torch.float64)
    summed = sum(rank_partial(x, idx, w, w1, w2, tp, ep, r, False) for r, (w1, w2) in enumerate(ranks))
    torch.testing.assert_close(summed, full, rtol=1e-12, atol=1e-12)
    ok, worst = within_tolerance(comet_world_forward(x, idx, w, ranks, tp, ep, "gelu"), full, M)
    assert ok, worst


# ---------------------------------------------------------------------------
# 3-4. The forward.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("E", [4, 8])
def test_module_forward_equals_hf_style_forward(kind, E):
    names, _, _ = KINDS[kind]
    experts = hf_experts(kind, E, seed=17)
    gate, up, down = stacked(experts, names)
    m = ct.MoEExperts.from_hf_mixtral(experts) if kind == "mixtral" else ct.MoEExperts.from_hf_qwen2_moe(experts)
    assert (m.num_experts, m.ffn, m.hidden, m.tp, m.ep, m.rank) == (E, F, H, 1, 1, 0)
    assert sorted(m.state_dict()) == ["w1", "w2"] and not m.w1.requires_grad
    x, idx, w = routing(E, seed=E)
    y = m(x, idx, w)
    assert y.dtype == torch.bfloat16 and y.shape == (T, H)
    assert torch.equal(y, ct.moe_experts(x, idx, w, m.w1, m.w2))
    y_ref, M = hf_forward(x, idx, w, gate, up, down)
    ok, worst = within_tolerance(y, y_ref, M)
    assert ok, "worst |y - y_ref| / bound = %g" % worst
    # the HF modules' own forward (fp32 copies), weighted by topk_w, is that reference too
    ref = torch.zeros(T, H)
    for j in range(TOPK):
        for t in range(T):
            ref[t] += w[t, j] * experts[int(idx[t, j])].float()(x[t:t + 1].float())[0]
    torch.testing.assert_close(ref, y_ref, rtol=1e-5, atol=1e-6)
    # (B, S, H) fp32 in: the same numbers, fp32 out, routing of shape (B, S, topk)
    y3 = m(x.float().reshape(1, T, H), idx.reshape(1, T, TOPK), w.bfloat16().reshape(1, T, TOPK))
    assert y3.dtype == torch.float32 and y3.shape == (1, T, H)
    assert torch.equal(y3[0], m(x, idx, w.bfloat16()).float())


def test_the_tolerance_sees_a_wrong_convention():
    """The forward's tolerance is not vacuous: reading gate-first weights as
    interleaved, or swapping gate and up, leaves it."""
    experts = hf_experts("mixtral", 4, seed=19)
    gate, up, down = stacked(experts, ("w1", "w3", "w2"))
    x, idx, w = routing(4, seed=20)
    y_ref, M = hf_forward(x, idx, w, gate, up, down)
    good = ct.MoEExperts.from_fused(torch.cat([gate, up], 1), down)
    assert within_tolerance(good(x, idx, w), y_ref, M)[0]
    for bad in (ct.MoEExperts.from_fused(torch.cat([gate, up], 1), down, order="interleaved"),
                ct.MoEExperts.from_fused(torch.cat([up, gate], 1), down)):
        ok, worst = within_tolerance(bad(x, idx, w), y_ref, M)
        assert not ok and worst > 10, worst


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("E", [4, 8])
@pytest.mark.parametrize("tp,ep", [w for w in WORLDS if w != (1, 1)])
def test_ranks_forward_sums_to_the_unsliced_forward(kind, E, tp, ep):
    names, from_hf, _ = KINDS[kind]
    experts = hf_experts(kind, E, seed=21)
    gate, up, down = stacked(experts, names)
    ranks = [from_hf(experts, tp=tp, ep=ep, rank=r) for r in range(tp * ep)]
    x, idx, w = routing(E, seed=22)
    # exact algebra: fp64, no rounding
    full64, M = hf_forward(x, idx, w, gate, up, down, torch.float64)
    summed64 = sum(rank_partial(x, idx, w, w1, w2, tp, ep, r, False) for r, (w1, w2) in enumerate(ranks))
    torch.testing.assert_close(summed64, full64, rtol=1e-12, atol=1e-12)
    # comet's rounding points per rank (h, o bf16; partials summed in fp32 in rank order; y bf16)
    p = torch.zeros(T, H)
    for r, (w1, w2) in enumerate(ranks):
        p = p + rank_partial(x, idx, w, w1, w2, tp, ep, r, True)
    ok, worst = within_tolerance(p.bfloat16(), full64, M)
    assert ok, "pure torch per rank: worst |y - y_ref| / bound = %g" % worst
    # comet's specification for the W-rank world, on these weights
    y = comet_world_forward(x, idx, w, ranks, tp, ep)
    ok, worst = within_tolerance(y, full64, M)
    assert ok, "comet.reference_forward: worst |y - y_ref| / bound = %g" % worst
    # and the one-rank module on the gathered weights
    m = ct.MoEExperts(*cv.gather(ranks, tp=tp, ep=ep))
    assert within_tolerance(m(x, idx, w), full64, M)[0]


def test_rank_module_holds_its_slice_and_refuses_the_forward():
    experts = hf_experts("qwen", 8, seed=23)
    mods = [ct.MoEExperts.from_hf_qwen3_moe(experts, tp=2, ep=2, rank=r) for r in range(4)]
    assert [(m.num_experts, m.ffn, m.rank) for m in mods] == [(8, F, r) for r in range(4)]
    assert mods[3].w1.shape == (4, F, H) and "tp=2, ep=2, rank=3" in repr(mods[3])
    back = cv.to_hf_qwen2_moe(mods, tp=2, ep=2)  # the modules themselves go back
    with pytest.raises(ValueError, match=r"gather: ranks\[1\] holds rank 2 of a TP=2 x EP=2 world, not rank 1"):
        cv.to_hf_qwen2_moe([mods[0], mods[2], mods[1], mods[3]], tp=2, ep=2)
    with pytest.raises(ValueError, match=r"ranks\[0\] holds rank 0 of a TP=2 x EP=2 world, not rank 0 of TP=4 x EP=1"):
        cv.gather(mods, tp=4)
    assert all(torch.equal(back[e]["up_proj.weight"], experts[e].up_proj.weight) for e in range(8))
    x, idx, w = routing(8)
    with pytest.raises(NotImplementedError,
                       match=r"rank 3 of a TP=2 x EP=2 world \(experts 4\.\.7, ffn slice 1 of 2\)"):
        mods[3](x, idx, w)
    g = ct.MoEExperts.from_megatron(*cv.to_megatron(mods, tp=2, ep=2), tp=2, ep=2, rank=1)
    assert torch.equal(g.w1, mods[1].w1) and torch.equal(g.w2, mods[1].w2)


def test_gelu_module_forward():
    g = torch.Generator().manual_seed(29)
    fc1 = torch.empty(4, F, H).uniform_(-0.3, 0.3, generator=g).bfloat16()
    fc2 = torch.empty(4, H, F).uniform_(-0.3, 0.3, generator=g).bfloat16()
    m = ct.MoEExperts.from_megatron(fc1, fc2, gated=False)
    assert m.activation == "gelu" and m.w1.shape == (4, F, H)
    x, idx, w = routing(4, seed=30)
    y_ref, M = hf_forward(x, idx, w, fc1, None, fc2)
    ok, worst = within_tolerance(m(x, idx, w), y_ref, M)
    assert ok, worst


# ---------------------------------------------------------------------------
# 5. Errors.
# ---------------------------------------------------------------------------
def test_wrong_shapes_and_worlds_raise_clearly():
    experts = hf_experts("mixtral", 4)
    gate, up, down = stacked(experts, ("w1", "w3", "w2"))
    with pytest.raises(ValueError, match=r"from_hf_mixtral: rank 4 is outside \[0, TP x EP = 4\)"):
        cv.from_hf_mixtral(experts, tp=2, ep=2, rank=4)
    with pytest.raises(ValueError, match="from_hf_mixtral: 4 experts do not divide into EP=3 groups"):
        cv.from_hf_mixtral(experts, ep=3)
    with pytest.raises(ValueError, match="from_hf_mixtral: ffn F=32 does not divide into TP=3 slices"):
        cv.from_hf_mixtral(experts, tp=3)
    with pytest.raises(ValueError, match="tp=0 and ep=1 must both be >= 1"):
        cv.from_hf_mixtral(experts, tp=0)
    with pytest.raises(TypeError, match="from_hf_mixtral: rank must be an int"):
        cv.from_hf_mixtral(experts, rank=0.0)
    # one expert with another shape
    odd = hf_experts("mixtral", 4)
    odd[2].w3 = torch.nn.Linear(H, F + 2, bias=False)
    with pytest.raises(ValueError, match=r"from_hf_mixtral: w3\[2\] is \(34, 48\), w3\[0\] is \(32, 48\)"):
        cv.from_hf_mixtral(odd)
    odd = hf_experts("mixtral", 4)
    for ex in odd:
        ex.w2 = torch.nn.Linear(F, H + 1, bias=False)
    with pytest.raises(ValueError, match=r"from_hf_mixtral: w2 must be 4 experts of \(H=48, F=32\)"):
        cv.from_hf_mixtral(odd)
    # the other framework's names
    with pytest.raises(ValueError, match=r"experts\[0\] has no attribute 'w1' \(HF Mixtral experts have w1 \(gate\), "
                                         r"w3 \(up\), w2 \(down\)\)"):
        cv.from_hf_mixtral(hf_experts("qwen", 4))
    with pytest.raises(ValueError, match=r"from_hf_qwen_moe: experts\[0\] has no attribute 'gate_proj'"):
        cv.from_hf_qwen_moe(experts)
    with pytest.raises(TypeError, match="experts must be a sequence of expert modules"):
        cv.from_hf_mixtral(42)
    with pytest.raises(ValueError, match="from_hf_mixtral: no experts"):
        cv.from_hf_mixtral([])
    # fused and Megatron
    with pytest.raises(ValueError, match=r"from_fused: gate_up must be \(E, 2F, H\) .*: 63 rows is odd"):
        cv.from_fused(torch.zeros(4, 63, H), down)
    with pytest.raises(ValueError, match=r"from_fused: down must be \(E=4, H=48, F=32\) to match gate_up"):
        cv.from_fused(torch.cat([gate, up], 1), down[:, :, :16])
    with pytest.raises(ValueError, match="from_fused: gate_up must be 3-d, got shape"):
        cv.from_fused(gate[0], down)
    with pytest.raises(ValueError, match='order .gate_last. is not "gate_first" or "interleaved"'):
        cv.from_fused(torch.cat([gate, up], 1), down, order="gate_last")
    with pytest.raises(ValueError, match=r"from_megatron: down must be \(E=4, H=48, F=32\)"):
        cv.from_megatron(torch.cat([gate, up], 1), down.transpose(1, 2))
    with pytest.raises(ValueError, match=r"from_megatron: fc2 must be \(E=4, H=48, F=32\) to match fc1"):
        cv.from_megatron(gate, down[:, :, :8], gated=False)
    with pytest.raises(ValueError, match="weight1 .* columns are not num_local_experts=3 equal groups"):
        cv.from_megatron_grouped_mlp(torch.zeros(H, 128), torch.zeros(64, H), num_local_experts=3)
    with pytest.raises(ValueError, match=r"weight2 must be \(E_local \* F_local = 64, H=48\)"):
        cv.from_megatron_grouped_mlp(torch.zeros(H, 128), torch.zeros(128, H), num_local_experts=2)
    # back
    ranks = [cv.from_hf_mixtral(experts, tp=2, rank=r) for r in range(2)]
    with pytest.raises(ValueError, match=r"gather: 2 ranks given for TP=2 x EP=2 = 4"):
        cv.to_hf_mixtral(ranks, tp=2, ep=2)
    with pytest.raises(ValueError, match="gather: rank 1 holds w1"):
        cv.gather([ranks[0], (ranks[1][0][:2], ranks[1][1][:2])], tp=2)
    with pytest.raises(TypeError, match=r"ranks\[1\] must be a \(w1, w2\) pair"):
        cv.gather([ranks[0], 3], tp=2)
    with pytest.raises(ValueError, match="to_hf_mixtral: these are GELU weights"):
        cv.to_hf_mixtral(cv.from_megatron(gate, down, gated=False))
    # the module
    w1, w2 = cv.from_hf_mixtral(experts)
    with pytest.raises(TypeError, match="MoEExperts: w1 must be torch.bfloat16, got torch.float32"):
        ct.MoEExperts(w1.float(), w2)
    with pytest.raises(ValueError, match=r"MoEExperts: w1 \(4, 64, 48\) and w2 \(4, 48, 16\) are not"):
        ct.MoEExperts(w1, w2[:, :, :16].contiguous())
    with pytest.raises(ValueError, match=r"for gelu"):
        ct.MoEExperts(w1, w2, activation="gelu")
    m = ct.MoEExperts(w1, w2)
    x, idx, w = routing(4)
    with pytest.raises(ValueError, match=r"MoEExperts: x must be \(\.\.\., H=48\), got \(29, 47\)"):
        m(x[:, :47], idx, w)
    with pytest.raises(ValueError, match=r"topk_idx \(28, 2\) and topk_w \(28, 2\) must both be \(29, topk\)"):
        m(x, idx[1:], w[1:])
