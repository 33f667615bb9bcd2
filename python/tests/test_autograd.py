"""test_autograd.py - autograd of comet.torch.moe_experts on CPU tensors:
its registered backward is the op comet::moe_experts_backward, which runs
comet_layer_backward on the forward's layer (a CPU engine without a
backward: comet_reference_backward, include/comet.h, "Backward
(training)", the same bits), one rank (W = 1).

  1. Against an exact model: loss = sum(y * r) for a random r; the op's
     x.grad, topk_w.grad, w1.grad, w2.grad against pure-torch float64 autograd
     of the same layer from the same bf16/fp32 inputs (no intermediate
     rounding; silu-gated and GELU, erf form). The contract rounds h, dH, dX_r,
     bf16(w dy) and the outputs to bf16 (u = 2^-8 each), so each element is
     compared with the scale of its row, as tests/test_backward.c's check
     "(a)" does: dx[t, :] with the rms of the exact dx[t, :], dw1[e, n, :]
     with that of the exact dw1[e, n, :], dw2[e, c, :] likewise, d_topk_w
     with the rms of the whole exact d_topk_w (its few slots are dot products
     that may cancel). Bound: |grad - exact| <= ULPS * 2^-7 * scale, i.e.
     ULPS bf16 ulps of a number of that scale (2^-7 is one bf16 ulp at 1),
     with ULPS = 8 for dx, dw1, dw2 (bf16 outputs after two or three bf16
     rounding points each) and 4 for d_topk_w (fp32 output, one bf16 input,
     a). test_backward.c's bound A, a first-order worst case, lets 4 to 16
     such ulps through (its "(a)"); measured here over the 5 cases below:
     dx <= 2.6, d_topk_w <= 1.2, dw1 <= 3.7, dw2 <= 3.8 ulps (-s prints
     them). Experts no row chose have a gradient of exactly 0.
  2. Bitwise: the op's gradients equal a direct comet.reference_backward call.
  3. torch.library.opcheck on both ops (gradcheck is not usable in bf16).
  4. torch.compile(fullgraph=True): of the forward, then .backward() through
     the compiled backward graph (which calls comet::moe_experts_backward);
     and of forward + torch.autograd.grad in one graph (with dynamo's
     trace_autograd_ops where the torch has it): bitwise as eager.
  5. CUDA tensors: close to the CPU's gradients (skipped without a GPU, or
     where the CUDA backend has no backward yet: comet.Unsupported).
  6. The backward makes no gradient for the saved state (no tensor of its
     size), and a y whose gradient arrives as None gives zero gradients.
  7. Eager calls take a torch.autograd.Function around the op's
     implementation (less host time); under a dispatch mode the op runs:
     the same bits.
Skipped as a whole without torch."""

import contextlib

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: comet.torch's autograd is not tested")

import comet  # noqa: E402
import comet.torch as ct  # noqa: E402

ULPS = {"dx": 8, "d_topk_w": 4, "dw1": 8, "dw2": 8}  # bound 1, in bf16 ulps of each row's scale


def problem(T=37, H=60, F=20, E=6, topk=2, activation="silu_gated", seed=0, unused_expert=True):
    """x, topk_idx, topk_w, w1, w2 (H, F not multiples of 8); expert E-1 is
    chosen by no row when unused_expert (its gradients must be 0)."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * F if activation == "silu_gated" else F
    x = torch.empty(T, H).uniform_(-1, 1, generator=g).bfloat16()
    n = E - 1 if unused_expert else E
    idx = torch.stack([torch.randperm(n, generator=g)[:topk] for _ in range(T)]).reshape(T, topk).int()
    w = torch.empty(T, topk).uniform_(0.1, 1, generator=g)
    # W1 scaled up so g reaches the activations' curved parts (as test_backward.c does)
    w1 = (torch.empty(E, rows, H).uniform_(-1, 1, generator=g) * 0.5).bfloat16()
    w2 = (torch.empty(E, H, F).uniform_(-1, 1, generator=g) * 0.3).bfloat16()
    r = torch.empty(T, H).uniform_(-1, 1, generator=g)
    return x, idx, w, w1, w2, r


def exact_model(x, idx, w, w1, w2, activation):
    """y (T, H) float64 with no intermediate rounding, differentiable in x, w, w1, w2."""
    F = w2.shape[2]
    y = torch.zeros(x.shape, dtype=torch.float64)
    for j in range(idx.shape[1]):
        e = idx[:, j].long()
        gu = torch.einsum("trh,th->tr", w1[e], x)
        if activation == "silu_gated":
            h = torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]
        else:
            h = torch.nn.functional.gelu(gu)  # erf form
        o = torch.einsum("thf,tf->th", w2[e], h)
        y = y + w[:, j:j + 1] * o
    return y


def leaf(t, dtype=None):
    return t.detach().clone().to(dtype or t.dtype).requires_grad_()


def op_grads(x, idx, w, w1, w2, r, activation):
    ins = [leaf(t) for t in (x, w, w1, w2)]
    y = ct.moe_experts(ins[0], idx, ins[1], ins[2], ins[3], activation=activation)
    (y.float() * r).sum().backward()
    return [t.grad for t in ins]


def exact_grads(x, idx, w, w1, w2, r, activation):
    ins = [leaf(t, torch.float64) for t in (x, w, w1, w2)]
    y = exact_model(ins[0], idx, ins[1], ins[2], ins[3], activation)
    (y * r.double()).sum().backward()
    return [t.grad for t in ins]


def bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                              b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


def direct_reference_backward(x, idx, w, w1, w2, dy, activation):
    """comet.reference_backward on torch tensors (W = 1)."""
    T, H = x.shape
    cfg = comet.LayerConfig(hidden=H, ffn=w2.shape[2], num_experts=w1.shape[0], topk=idx.shape[1],
                            max_tokens_per_rank=T, activation=activation)
    out = (torch.empty_like(x), torch.empty_like(w), torch.empty_like(w1), torch.empty_like(w2))
    d = lambda t, dt: comet.TensorDesc(t.data_ptr(), dt, tuple(t.shape))  # noqa: E731
    comet.reference_backward(cfg, [(d(x, "bf16"), d(idx, "int32"), d(w, "fp32"), d(w1, "bf16"), d(w2, "bf16"),
                                    d(dy, "bf16"), d(out[0], "bf16"), d(out[1], "fp32"), d(out[2], "bf16"),
                                    d(out[3], "bf16"))])
    return out


CASES = [("silu_gated", dict()), ("gelu", dict()),
         ("silu_gated", dict(T=64, H=128, F=48, E=8, topk=3, seed=1)),
         ("gelu", dict(T=64, H=128, F=48, E=8, topk=3, seed=2)),
         ("silu_gated", dict(T=5, H=16, F=8, E=3, topk=1, seed=3))]


@pytest.mark.parametrize("activation,kw", CASES)
def test_grads_close_to_float64_autograd(activation, kw):
    x, idx, w, w1, w2, r = problem(activation=activation, **kw)
    got = op_grads(x, idx, w, w1, w2, r, activation)
    want = exact_grads(x, idx, w, w1, w2, r, activation)
    names = ("dx", "d_topk_w", "dw1", "dw2")
    for name, g, e, t in zip(names, got, want, (x, w, w1, w2)):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        e = e.double()
        if name == "d_topk_w":
            scale = e.pow(2).mean().sqrt().expand_as(e)
        else:
            scale = e.pow(2).mean(dim=-1, keepdim=True).sqrt().expand_as(e)
        err = (g.double() - e).abs()
        bound = ULPS[name] * 2.0 ** -7 * scale
        ratio = float((err / (2.0 ** -7 * scale).clamp_min(1e-300)).max())
        print("%s %s %s: worst |err| = %.3g bf16 ulps of the row's scale (bound %d)" % (activation, kw, name, ratio,
                                                                                        ULPS[name]))
        bad = err > bound
        assert not bad.any(), "%s: %d of %d elements beyond %d ulps of their row's scale, worst %.3g ulps" % (
            name, int(bad.sum()), err.numel(), ULPS[name], ratio)
    # the expert no row chose: exactly zero gradients
    assert torch.equal(got[2][-1].float(), torch.zeros_like(got[2][-1].float()))
    assert torch.equal(got[3][-1].float(), torch.zeros_like(got[3][-1].float()))


@pytest.mark.parametrize("activation", ["silu_gated", "gelu"])
def test_grads_equal_comet_reference_backward_bitwise(activation):
    x, idx, w, w1, w2, r = problem(activation=activation, T=50, E=7, topk=3, seed=4, unused_expert=False)
    got = op_grads(x, idx, w, w1, w2, r, activation)
    dy = r.float().bfloat16()  # d(sum(y.float() * r))/dy, as autograd hands it to the op: r rounded to bf16
    want = direct_reference_backward(x, idx, w, w1, w2, dy, activation)
    for name, g, e in zip(("dx", "d_topk_w", "dw1", "dw2"), got, want):
        assert bits_equal(g, e), name
    # and the backward op itself, called directly
    ops = torch.ops.comet.moe_experts_backward(dy, x, idx, w, w1, w2, torch.empty(0, dtype=torch.uint8), activation,
                                               "recompute", 0)
    for name, g, e in zip(("dx", "d_topk_w", "dw1", "dw2"), ops, want):
        assert bits_equal(g, e), name


def test_grad_dtypes_follow_the_inputs():
    x, idx, w, w1, w2, r = problem(T=9, seed=5)
    wb = leaf(w.bfloat16())
    xl = leaf(x)
    y = ct.moe_experts(xl, idx.long(), wb, w1, w2)  # int64 ids, bf16 routing weights: converted inside
    (y.float() * r).sum().backward()
    assert wb.grad.dtype == torch.bfloat16 and xl.grad.dtype == torch.bfloat16
    # only what requires grad gets one; T = 0 gives zeros
    w1l, w2l = leaf(w1), leaf(w2)
    ct.moe_experts(x[:0], idx[:0], w[:0], w1l, w2l).float().sum().backward()
    assert torch.equal(w1l.grad.float(), torch.zeros(w1.shape)) and torch.equal(w2l.grad.float(), torch.zeros(w2.shape))


def test_module_parameters_train_on_cpu():
    x, idx, w, w1, w2, r = problem(T=12, seed=6)
    m = ct.MoEExperts(w1, w2)
    m.requires_grad_(True)
    (m(x, idx, w).float() * r).sum().backward()
    want = op_grads(x, idx, w, w1, w2, r, "silu_gated")
    assert bits_equal(m.w1.grad, want[2]) and bits_equal(m.w2.grad, want[3])


def test_backward_makes_no_gradient_for_the_saved_state():
    """The saved state (uint8, comet_layer_saved_bytes) has no gradient:
    the backward allocates no tensor of its size (autograd materializing a
    zero gradient for it filled that many bytes every backward), and a y
    that took no part in the loss still gives zero gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x, idx, w, w1, w2, r = problem(T=9, seed=7)
    xl, wl = leaf(x), leaf(w)
    y = ct.moe_experts(xl, idx, wl, w1, w2)
    n = ct._entry(0, x, idx, w1, w2, "silu_gated").saved_bytes

    class Sizes(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.seen.append((str(func), t.dtype, t.numel()))
            return out

    with Sizes():
        (y.float() * r).sum().backward()
    assert not [s for s in Sizes.seen if s[1] == torch.uint8 or s[2] == n], Sizes.seen
    want = op_grads(x, idx, w, w1, w2, r, "silu_gated")
    assert bits_equal(xl.grad, want[0]) and bits_equal(wl.grad, want[1])

    class Drop(torch.autograd.Function):  # b, with no gradient for a: a's backward gets None
        @staticmethod
        def forward(ctx, a, b):
            return b.clone()

        @staticmethod
        def backward(ctx, g):
            return None, g

    # a y whose gradient reaches the op as None (not materialized): the gradients of dy = 0
    xl.grad, wl.grad = None, None
    Drop.apply(ct.moe_experts(xl, idx, wl, w1, w2), r.sum()).backward()
    assert xl.grad is None or torch.equal(xl.grad.float(), torch.zeros(x.shape))
    assert wl.grad is None or torch.equal(wl.grad, torch.zeros(w.shape))


def test_opcheck_both_ops():
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck is not in this torch")
    x, idx, w, w1, w2, r = problem(T=9, seed=7)
    xl, wl, w1l, w2l = (leaf(t) for t in (x, w, w1, w2))
    # the forward with inputs that require grad: schema, fake, and the registered autograd
    for save in ("activations", "recompute"):
        torch.library.opcheck(torch.ops.comet.moe_experts.default, (xl, idx, wl, w1l, w2l, "silu_gated", save, 0),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
        saved = torch.ops.comet.moe_experts(x, idx, w, w1, w2, "silu_gated", save, 0)[1]
        torch.library.opcheck(torch.ops.comet.moe_experts_backward.default,
                              (r.bfloat16(), x, idx, w, w1, w2, saved, "silu_gated", save, 0),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def _compiled_or_skip(fn):
    def run(*args):
        try:
            return torch.compile(fn, fullgraph=True)(*args)
        except Exception as e:  # noqa: BLE001 - a compiler that does not work here is a skip, not our failure
            if "moe_experts" in str(e) or isinstance(e, (comet.CometError, AssertionError, NotImplementedError)):
                raise
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            pytest.skip("torch.compile does not work with this torch here: %s" % msg[:200])
    return run


@pytest.mark.parametrize("activation", ["silu_gated", "gelu"])
def test_torch_compile_forward_and_backward_bitwise(activation):
    x, idx, w, w1, w2, r = problem(activation=activation, T=16, seed=8)

    def step(x, idx, w, w1, w2, r):
        y = ct.moe_experts(x, idx, w, w1, w2, activation=activation)
        loss = (y.float() * r).sum()
        return loss

    eager_ins = [leaf(t) for t in (x, w, w1, w2)]
    eager = step(eager_ins[0], idx, *eager_ins[1:], r)
    eager.backward()
    comp_ins = [leaf(t) for t in (x, w, w1, w2)]
    loss = _compiled_or_skip(step)(comp_ins[0], idx, *comp_ins[1:], r)
    loss.backward()  # the AOT-compiled backward graph, which calls comet::moe_experts_backward
    torch.testing.assert_close(loss, eager)  # inductor's fp32 sum adds in another order; y, dy are bitwise
    for a, b in zip(eager_ins, comp_ins):
        assert bits_equal(a.grad, b.grad)


def test_torch_compile_forward_and_autograd_grad_in_one_graph():
    config = torch._dynamo.config
    if not hasattr(config, "trace_autograd_ops"):
        pytest.skip("this torch's dynamo cannot trace torch.autograd.grad (no trace_autograd_ops)")
    x, idx, w, w1, w2, r = problem(T=16, seed=9)

    def step(x, idx, w, w1, w2, r):
        y = ct.moe_experts(x, idx, w, w1, w2)
        return torch.autograd.grad((y.float() * r).sum(), [x, w, w1, w2])

    ins = [leaf(t) for t in (x, w, w1, w2)]
    eager = step(ins[0], idx, *ins[1:], r)
    with config.patch(trace_autograd_ops=True):
        compiled = _compiled_or_skip(step)(ins[0], idx, *ins[1:], r)
    for a, b in zip(eager, compiled):
        assert bits_equal(a, b)


cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and comet.device_count() > 0),
    reason="no GPU for comet's CUDA backend here: the CUDA backward is not tested")


@cuda
def test_cuda_backward_close_to_cpu():
    x, idx, w, w1, w2, r = problem(T=64, H=256, F=128, E=8)
    cpu = op_grads(x, idx, w, w1, w2, r, "silu_gated")
    try:
        gpu = op_grads(*(t.cuda() for t in (x, idx, w, w1, w2, r)), "silu_gated")
        ct.synchronize()
    except comet.Unsupported as e:
        pytest.skip("this build's CUDA backend has no backward: %s" % e.message)
    for name, a, b in zip(("dx", "d_topk_w", "dw1", "dw2"), gpu, cpu):
        assert a.device.type == "cuda" and a.dtype == b.dtype, name
        torch.testing.assert_close(a.cpu().float(), b.float(), rtol=2 ** -5, atol=2 ** -7)  # the GEMMs' order


class _PassThrough(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that runs every op as it is and names the ops it saw."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("main_grads", [False, True])
def test_eager_path_is_the_op(main_grads, device):
    """Eager calls on plain tensors run the op's implementation through a torch.autograd.Function (no
    torch.library dispatch: less host time a step); under a dispatch mode (fake tensors, tracing, counters)
    the op itself runs. Both give the same bits: y and every gradient, written or added to fp32 main grads."""
    shape = dict(T=24) if device == "cpu" else dict(T=64, H=256, F=128, E=8)  # the CUDA kernels' multiples of 8
    x, idx, w, w1, w2, r = (t.to(device) for t in problem(seed=11, **shape))
    got = []
    for mode in (None, _PassThrough()):
        ins = [leaf(t) for t in (x, w, w1, w2)]
        mg = (torch.full(w1.shape, 0.25, device=device), torch.full(w2.shape, -0.5, device=device)) if main_grads else None
        with mode if mode is not None else contextlib.nullcontext():
            y = ct.moe_experts(ins[0], idx, ins[1], ins[2], ins[3], main_grads=mg)
            (y.float() * r).sum().backward()
        if mode is None:
            assert type(y.grad_fn).__name__.startswith("_EagerExperts"), type(y.grad_fn).__name__
        else:
            assert "comet.moe_experts.default" in mode.ops, mode.ops
            assert ("comet.moe_experts_backward_accumulate.default" if main_grads
                    else "comet.moe_experts_backward.default") in mode.ops, mode.ops
        got.append([y] + [t.grad for t in ins] + (list(mg) if mg else []))
    for a, b in zip(*got):
        assert (a is None and b is None) or bits_equal(a, b)
