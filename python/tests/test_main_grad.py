"""test_main_grad.py - gradient accumulation into fp32 main grads
(MoEExperts(main_grad=True), moe_experts(main_grads=)) on CPU tensors, one
rank (the CPU engine).

The relation tested, bit for bit: comet_layer_backward with accumulate = 1
computes each element's fp32 sum over the call's rows exactly as with
accumulate = 0 and fp32 outputs (comet.h, backward step 7), then adds it to
the buffer once (o = o + sum, one fp32 add). So after micro-batches
1..N, in the order their backwards ran,

    main_grad == (((m0 + g_1) + g_2) + ... + g_N)

evaluated in fp32 left to right (torch's `m += g`, IEEE round to nearest),
where m0 is the buffer before (zeros after zero_main_grad()) and g_i the
fp32 dW1 / dW2 that the same layer's backward writes for micro-batch i
with accumulate = 0 into fp32 outputs. The sum is not the bf16 gradients'
(no bf16 rounding of g_i or of the running sum), and fp32 addition is not
associative, so the order of the backwards matters: the tests hold it.

  1. N micro-batches (T across two token-bound buckets of the layer cache),
     both activations and save modes, from zeros and from a non-zero buffer;
     w1.grad, w2.grad stay None; dx and d_topk_w bitwise as without main
     grads;
  2. micro-batches in flight: four forwards, then their backwards in another
     order;
  3. torch.utils.checkpoint (non-reentrant and reentrant) around each
     micro-batch: its backward runs once, the main grads bitwise as without
     checkpointing;
  4. torch.compile(fullgraph=True) (static and dynamic shapes): the backward
     op mutates the buffers (mutates_args), bitwise as eager; replacing a
     buffer between steps reaches the compiled code;
  5. a frozen weight gets nothing added; T = 0 adds nothing;
     zero_main_grad(); module.to(); opcheck of the ops;
  6. errors: a main_grad that is not fp32, of the wrong shape, on another
     device, not contiguous, missing, overlapping; one of the pair only.
Skipped as a whole without torch."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: comet.torch's main grads are not tested")

import comet  # noqa: E402
import comet.torch as ct  # noqa: E402
from test_autograd import bits_equal, leaf, problem  # noqa: E402

E, H, F = 6, 60, 20


def fp32_grads(x, idx, w, w1, w2, r, activation="silu_gated"):
    """g = (dW1, dW2) in fp32: a one-rank CPU layer's backward with
    accumulate = 0 into fp32 outputs, for loss = sum(y.float() * r) (dy =
    r rounded to bf16, as autograd hands it to the op)."""
    T = x.shape[0]
    cfg = comet.LayerConfig(hidden=H, ffn=F, num_experts=E, topk=idx.shape[1], max_tokens_per_rank=max(T, 1),
                            activation=activation)
    d = lambda t, dt: comet.TensorDesc(t.data_ptr(), dt, tuple(t.shape))  # noqa: E731
    dy = r.float().bfloat16()
    y = torch.empty_like(x)
    outs = (torch.empty_like(x), torch.empty_like(w), torch.full(w1.shape, float("nan")),
            torch.full(w2.shape, float("nan")))
    ins = (d(x, "bf16"), d(idx, "int32"), d(w, "fp32"), d(w1, "bf16"), d(w2, "bf16"))
    with comet.World(1, "cpu") as world, world.layer(0, cfg) as layer:
        layer.forward(*ins, d(y, "bf16"), save="none")
        layer.backward(*ins, d(dy, "bf16"), d(outs[0], "bf16"), d(outs[1], "fp32"), d(outs[2], "fp32"),
                       d(outs[3], "fp32"), save="recompute", accumulate=False)
    return outs[2], outs[3]


def fp32_sum(m0, gs):
    """((m0 + g_1) + g_2) + ... in fp32, left to right."""
    m = m0.clone()
    for g in gs:
        m += g
    return m


def batches(Ts=(30, 200, 7, 30), activation="silu_gated", seed=40):
    """Micro-batches of one layer: the weights of the first, x, idx, w, r of each."""
    out = [problem(T=T, H=H, F=F, E=E, activation=activation, seed=seed + i) for i, T in enumerate(Ts)]
    w1, w2 = out[0][3], out[0][4]
    return w1, w2, [(x, idx, w, r) for x, idx, w, _, _, r in out]


def step(module, x, idx, w, r):
    return (module(x, idx, w).float() * r).sum()


@pytest.mark.parametrize("activation", ["silu_gated", "gelu"])
@pytest.mark.parametrize("save", ["activations", "recompute"])
def test_main_grads_are_the_fp32_sum_of_the_micro_batches(activation, save):
    w1, w2, mbs = batches(activation=activation)
    gs = [fp32_grads(x, idx, w, w1, w2, r, activation) for x, idx, w, r in mbs]
    m = ct.MoEExperts(w1, w2, activation=activation, save=save, main_grad=True).requires_grad_()
    plain = ct.MoEExperts(w1, w2, activation=activation, save=save).requires_grad_()
    assert m.w1.main_grad.dtype == torch.float32 and not m.w1.main_grad.any() and not m.w2.main_grad.any()
    for x, idx, w, r in mbs:
        xs, ws = [leaf(x), leaf(w)], [leaf(x), leaf(w)]
        step(m, xs[0], idx, xs[1], r).backward()
        step(plain, ws[0], idx, ws[1], r).backward()
        assert bits_equal(xs[0].grad, ws[0].grad) and bits_equal(xs[1].grad, ws[1].grad)  # dx, d_topk_w unchanged
    assert m.w1.grad is None and m.w2.grad is None
    for k, name in enumerate(("w1", "w2")):
        got = getattr(m, name).main_grad
        want = fp32_sum(torch.zeros_like(got), [g[k] for g in gs])
        assert bits_equal(got, want), name
        # not the sum of the bf16 gradients (each rounded once): what main grads are for
        assert not bits_equal(got, fp32_sum(torch.zeros_like(got), [g[k].bfloat16().float() for g in gs])), name
        # without main grads, .grad is bf16(g_1) + bf16(g_2) + ... added in bf16 (autograd's accumulation,
        # each add rounded to bf16): what the fp32 main grad avoids
        bf16_sum = gs[0][k].bfloat16()
        for g in gs[1:]:
            bf16_sum = bf16_sum + g[k].bfloat16()
        assert bits_equal(getattr(plain, name).grad, bf16_sum), name
    # the expert no row chose (E-1): nothing added
    assert not m.w1.main_grad[-1].any() and not m.w2.main_grad[-1].any()
    # zero_main_grad(), then one more micro-batch: its g alone
    m.zero_main_grad()
    x, idx, w, r = mbs[2]
    step(m, x, idx, w, r).backward()
    assert bits_equal(m.w1.main_grad, fp32_sum(torch.zeros(w1.shape), [gs[2][0]]))
    assert bits_equal(m.w2.main_grad, fp32_sum(torch.zeros(w2.shape), [gs[2][1]]))


def test_main_grads_add_to_what_the_buffers_hold():
    """Buffers the user owns (Megatron's DDP: views into its grad buffer),
    holding values: the gradients are added to them in fp32."""
    w1, w2, mbs = batches(Ts=(30, 7))
    gs = [fp32_grads(x, idx, w, w1, w2, r) for x, idx, w, r in mbs]
    g = torch.Generator().manual_seed(3)
    flat = torch.empty(w1.numel() + w2.numel()).uniform_(-1, 1, generator=g)
    m0 = flat.clone()
    m = ct.MoEExperts(w1, w2, main_grad=True).requires_grad_()
    m.w1.main_grad, m.w2.main_grad = flat[:w1.numel()].view(w1.shape), flat[w1.numel():].view(w2.shape)
    for x, idx, w, r in mbs:
        step(m, x, idx, w, r).backward()
    assert bits_equal(m.w1.main_grad, fp32_sum(m0[:w1.numel()].view(w1.shape), [g[0] for g in gs]))
    assert bits_equal(m.w2.main_grad, fp32_sum(m0[w1.numel():].view(w2.shape), [g[1] for g in gs]))
    assert m.w1.main_grad.data_ptr() == flat.data_ptr()  # in place, into the user's buffer


@pytest.mark.parametrize("save", ["activations", "recompute"])
def test_micro_batches_in_flight(save):
    """Four forwards, then their backwards in the order 2, 0, 3, 1: the main
    grads are the fp32 sum in that order (each backward uses its own saved
    state; the buffers, mutated by every backward, are not saved tensors, so
    autograd's version check does not refuse the later backwards)."""
    w1, w2, mbs = batches()
    gs = [fp32_grads(x, idx, w, w1, w2, r) for x, idx, w, r in mbs]
    m = ct.MoEExperts(w1, w2, save=save, main_grad=True).requires_grad_()
    losses = [step(m, leaf(x), idx, leaf(w), r) for x, idx, w, r in mbs]
    order = (2, 0, 3, 1)
    for i in order:
        losses[i].backward()
    assert bits_equal(m.w1.main_grad, fp32_sum(torch.zeros(w1.shape), [gs[i][0] for i in order]))
    assert bits_equal(m.w2.main_grad, fp32_sum(torch.zeros(w2.shape), [gs[i][1] for i in order]))
    assert m.w1.grad is None and m.w2.grad is None


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("save", ["activations", "recompute"])
def test_activation_checkpointing(save, reentrant):
    """Each micro-batch under torch.utils.checkpoint: the forward runs twice
    (the second time in the backward, recomputing), the backward once, so
    each micro-batch is added once: bitwise the fp32 sum."""
    from torch.utils.checkpoint import checkpoint

    w1, w2, mbs = batches(Ts=(30, 7, 45))
    gs = [fp32_grads(x, idx, w, w1, w2, r) for x, idx, w, r in mbs]
    m = ct.MoEExperts(w1, w2, save=save, main_grad=True).requires_grad_()
    calls = []
    hook = m.register_forward_pre_hook(lambda *_: calls.append(1))  # pre: the recompute may stop early

    def block(x, idx, w):
        return m(x * 1, idx, w)  # x * 1: reentrant needs a recomputed input

    for x, idx, w, r in mbs:
        y = checkpoint(block, leaf(x), idx, leaf(w), use_reentrant=reentrant)
        (y.float() * r).sum().backward()
    hook.remove()
    assert len(calls) == 2 * len(mbs)  # recomputed: the forward ran twice a micro-batch
    assert bits_equal(m.w1.main_grad, fp32_sum(torch.zeros(w1.shape), [g[0] for g in gs]))
    assert bits_equal(m.w2.main_grad, fp32_sum(torch.zeros(w2.shape), [g[1] for g in gs]))
    assert m.w1.grad is None and m.w2.grad is None


def _compile_or_skip(fn, **kw):
    compiled = torch.compile(fn, fullgraph=True, **kw)

    def run(*args):
        try:
            return compiled(*args)
        except Exception as e:  # noqa: BLE001 - a compiler that does not work here is a skip, not our failure
            if "moe_experts" in str(e) or "main_grad" in str(e) or isinstance(
                    e, (comet.CometError, AssertionError, NotImplementedError)):
                raise
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            pytest.skip("torch.compile does not work with this torch here: %s" % msg[:200])
    return run


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_forward_and_backward(dynamic):
    """torch.compile(fullgraph=True) of a step: the forward reads
    w1.main_grad and w2.main_grad (graph inputs), the compiled backward runs
    comet::moe_experts_backward_accumulate, which mutates them: bitwise as
    eager, micro-batch after micro-batch; a buffer replaced between steps
    is the one the compiled code adds to."""
    w1, w2, mbs = batches(Ts=(30, 30, 30) if not dynamic else (30, 45, 7))
    eager = ct.MoEExperts(w1, w2, main_grad=True).requires_grad_()
    comp = ct.MoEExperts(w1, w2, main_grad=True).requires_grad_()
    fn = _compile_or_skip(step, dynamic=dynamic)
    for x, idx, w, r in mbs:
        xe, xc = leaf(x), leaf(x)
        step(eager, xe, idx, w, r).backward()
        fn(comp, xc, idx, w, r).backward()
        assert bits_equal(xe.grad, xc.grad)
        assert bits_equal(eager.w1.main_grad, comp.w1.main_grad)
        assert bits_equal(eager.w2.main_grad, comp.w2.main_grad)
    assert comp.w1.grad is None and comp.w2.grad is None
    # new buffers (what Megatron's DDP does when it rebuilds its grad buffer)
    comp.w1.main_grad, comp.w2.main_grad = torch.zeros(w1.shape), torch.zeros(w2.shape)
    eager.zero_main_grad()
    x, idx, w, r = mbs[0]
    step(eager, x, idx, leaf(w), r).backward()
    fn(comp, x, idx, leaf(w), r).backward()
    assert bits_equal(eager.w1.main_grad, comp.w1.main_grad) and eager.w1.main_grad.any()
    assert bits_equal(eager.w2.main_grad, comp.w2.main_grad)


def test_functional_main_grads():
    """moe_experts(..., main_grads=(g1, g2)): the same accumulation for
    weights held outside a module."""
    w1, w2, mbs = batches(Ts=(30, 7))
    gs = [fp32_grads(x, idx, w, w1, w2, r) for x, idx, w, r in mbs]
    p1, p2 = leaf(w1), leaf(w2)
    g1, g2 = torch.zeros(w1.shape), torch.zeros(w2.shape)
    for x, idx, w, r in mbs:
        (ct.moe_experts(x, idx, w, p1, p2, main_grads=(g1, g2)).float() * r).sum().backward()
    assert bits_equal(g1, fp32_sum(torch.zeros(w1.shape), [g[0] for g in gs]))
    assert bits_equal(g2, fp32_sum(torch.zeros(w2.shape), [g[1] for g in gs]))
    assert p1.grad is None and p2.grad is None
    # nothing requires grad, or no_grad: nothing recorded, nothing added
    x, idx, w, r = mbs[0]
    before = g1.clone()
    ct.moe_experts(x, idx, w, w1, w2, main_grads=(g1, g2))
    with torch.no_grad():
        ct.moe_experts(x, idx, w, p1, p2, main_grads=(g1, g2))
    assert bits_equal(g1, before)


def test_frozen_weight_and_empty_batch():
    w1, w2, mbs = batches(Ts=(30,))
    x, idx, w, r = mbs[0]
    g = fp32_grads(x, idx, w, w1, w2, r)
    m = ct.MoEExperts(w1, w2, main_grad=True)
    m.w2.requires_grad_()  # w1 frozen: its main grad gets nothing
    xl = leaf(x)
    step(m, xl, idx, w, r).backward()
    assert not m.w1.main_grad.any() and bits_equal(m.w2.main_grad, fp32_sum(torch.zeros(w2.shape), [g[1]]))
    assert xl.grad is not None and m.w1.grad is None and m.w2.grad is None
    # both frozen, x trained: dx bitwise as without main grads, nothing added
    m.requires_grad_(False)
    m.zero_main_grad()
    xl, xp = leaf(x), leaf(x)
    step(m, xl, idx, w, r).backward()
    step(ct.MoEExperts(w1, w2), xp, idx, w, r).backward()
    assert bits_equal(xl.grad, xp.grad) and not m.w1.main_grad.any() and not m.w2.main_grad.any()
    # T = 0: nothing added
    m.requires_grad_()
    step(m, x, idx, w, r).backward()
    before = m.w1.main_grad.clone(), m.w2.main_grad.clone()
    step(m, leaf(x[:0]), idx[:0], w[:0], r[:0]).backward()
    assert bits_equal(m.w1.main_grad, before[0]) and bits_equal(m.w2.main_grad, before[1])


def test_module_plumbing():
    w1, w2, _ = batches(Ts=(7,))
    m = ct.MoEExperts(w1, w2, main_grad=True)
    assert "main_grad=True" in repr(m)
    assert set(m.state_dict()) == {"w1", "w2"}  # main grads are attributes, not state
    m.w1.main_grad.fill_(1.0)
    m.zero_main_grad()
    assert not m.w1.main_grad.any()
    m.w1.main_grad = None
    m.zero_main_grad()  # reallocates
    assert m.w1.main_grad.shape == w1.shape and m.w1.main_grad.dtype == torch.float32
    m.to("cpu")
    assert m.w1.main_grad.device == m.w1.device
    with pytest.raises(RuntimeError, match="built without main_grad=True"):
        ct.MoEExperts(w1, w2).zero_main_grad()


def test_opcheck():
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck is not in this torch")
    w1, w2, mbs = batches(Ts=(9,))
    x, idx, w, r = mbs[0]
    g1, g2 = torch.zeros(w1.shape), torch.zeros(w2.shape)
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(torch.ops.comet.moe_experts.default,
                          (leaf(x), idx, leaf(w), leaf(w1), leaf(w2), "silu_gated", "activations", 0, g1, g2),
                          test_utils=tests)
    saved = torch.ops.comet.moe_experts(x, idx, w, w1, w2, "silu_gated", "activations", 0)[1]
    torch.library.opcheck(torch.ops.comet.moe_experts_backward_accumulate.default,
                          (r.bfloat16(), x, idx, w, w1, w2, saved, g1, g2, "silu_gated", "activations", 0),
                          test_utils=tests)


def test_errors():
    w1, w2, mbs = batches(Ts=(9,))
    x, idx, w, r = mbs[0]
    m = ct.MoEExperts(w1, w2, main_grad=True).requires_grad_()
    good = m.w1.main_grad
    for bad, exc, msg in ((good.bfloat16(), TypeError, r"w1.main_grad must be torch.float32 .*got torch.bfloat16"),
                          (good.double(), TypeError, "w1.main_grad must be torch.float32"),
                          (good[:2], ValueError, r"w1.main_grad must have w1's shape \(6, 40, 60\), got \(2, 40, 60\)"),
                          (good.to("meta"), ValueError, "w1.main_grad is on meta, w1 on cpu"),
                          (good.transpose(1, 2).contiguous().transpose(1, 2), ValueError,
                           "w1.main_grad must be contiguous"),
                          (None, ValueError, r"w1.main_grad is missing \(None\): call zero_main_grad\(\)"),
                          ([0.0], TypeError, "w1.main_grad must be a torch.Tensor, got list")):
        m.w1.main_grad = bad
        with pytest.raises(exc, match=msg):
            m(x, idx, w)
    m.w1.main_grad = good
    m.w2.main_grad = torch.zeros(w1.shape)
    with pytest.raises(ValueError, match="w2.main_grad must have w2's shape"):
        m(x, idx, w)
    # the functional form: pairs only, not overlapping
    g1, g2 = torch.zeros(w1.shape), torch.zeros(w2.shape)
    p1, p2 = leaf(w1), leaf(w2)
    with pytest.raises(TypeError, match="main_grads must be a pair"):
        ct.moe_experts(x, idx, w, p1, p2, main_grads=g1)
    with pytest.raises(ValueError, match="main grads come in pairs .w1's and w2's.: got only w1's"):
        ct.moe_experts(x, idx, w, p1, p2, main_grads=(g1, None))
    flat = torch.zeros(w1.numel() + 10)
    with pytest.raises(ValueError, match="w1.main_grad and w2.main_grad overlap in memory"):
        ct.moe_experts(x, idx, w, p1, p2, main_grads=(flat[:w1.numel()].view(w1.shape),
                                                      flat[10:10 + w2.numel()].view(w2.shape)))
    # the ops, called directly
    saved = torch.ops.comet.moe_experts(x, idx, w, w1, w2, "silu_gated", "activations", 0)[1]
    with pytest.raises(ValueError, match="main grads come in pairs"):
        torch.ops.comet.moe_experts(x, idx, w, w1, w2, "silu_gated", "activations", 0, g1)
    with pytest.raises(TypeError, match="moe_experts_backward_accumulate: w2.main_grad must be torch.float32"):
        torch.ops.comet.moe_experts_backward_accumulate(r.bfloat16(), x, idx, w, w1, w2, saved, g1, g2.bfloat16(),
                                                        "silu_gated", "activations", 0)
    # nothing was added by the refused calls
    assert not g1.any() and not g2.any() and not m.w1.main_grad.any()
