"""test_api.py - comet's C API from Python (no torch): worlds and layers,
their lifecycle, errors raised as exceptions with comet's message, the
forward on the CPU backend against comet.reference_forward (bitwise, as the
contract says), one rank from ctypes buffers (no numpy) and two ranks from
two Python threads (numpy), the protocol, memory, traces."""

import ctypes
import os
import pickle
import re
import threading

import pytest

import comet

from conftest import ROOT, bf16_bits, routing, small_config

# ---------------------------------------------------------------------------
# Library facts, statuses and errors.
# ---------------------------------------------------------------------------


def test_version_and_devices():
    assert re.fullmatch(r"\d+\.\d+\.\d+", comet.version())
    assert comet.__version__ == comet.version()
    header = os.path.join(ROOT, "include", "comet.h")
    if os.path.exists(header):
        text = open(header).read()
        parts = [re.search(r"#define COMET_VERSION_%s (\d+)" % p, text).group(1) for p in ("MAJOR", "MINOR", "PATCH")]
        assert comet.version() == ".".join(parts)
    n = comet.device_count()
    assert isinstance(n, int) and n >= 0
    info = comet.build_info()
    assert os.path.exists(info["library"]) and info["origin"] in ("package", "COMET_LIBRARY")


def test_status_names_and_exception_classes():
    assert comet.Status.INVALID_SHAPE.c_name == "COMET_ERR_INVALID_SHAPE"
    assert comet.Status.SUCCESS.c_name == "COMET_SUCCESS"
    for cls, status in ((comet.InvalidArgument, 1), (comet.InvalidShape, 2), (comet.InvalidRouting, 3),
                        (comet.PeerFailed, 4), (comet.Unsupported, 5), (comet.OutOfMemory, 6), (comet.Timeout, 7),
                        (comet.SystemFailure, 8), (comet.CudaError, 9), (comet.NcclError, 10),
                        (comet.InternalError, 11)):
        e = cls("what went wrong")
        assert isinstance(e, comet.CometError) and e.status == status and e.message == "what went wrong"
        assert str(e) == "%s: what went wrong" % comet.Status(status).c_name
        again = pickle.loads(pickle.dumps(e))
        assert type(again) is cls and again.message == e.message
    assert issubclass(comet.InvalidShape, ValueError) and issubclass(comet.OutOfMemory, MemoryError)
    assert comet.CometError(99, "x").status == 99  # a status this binding does not know


# ---------------------------------------------------------------------------
# Worlds.
# ---------------------------------------------------------------------------


def test_world_lifecycle_and_options():
    world = comet.World(2, "cpu", timeout_ms=1234, cpu_workers=3, tune_file="", graph_replay=-1)
    assert (world.size, world.backend, world.local_rank) == (2, comet.Backend.CPU, -1)
    assert world.options == comet.WorldOptions(timeout_ms=1234, cpu_workers=3, tune_file="", graph_replay=-1)
    assert world.device(0) == -1 and world.handle != 0
    assert "size=2" in repr(world)
    world.close()
    world.close()  # twice: a no-op
    assert world.handle == 0 and "closed" in repr(world)
    with pytest.raises(ValueError, match="closed"):
        world.options
    with comet.World(1, comet.Backend.CPU) as w:
        assert w.options.timeout_ms >= 1


def test_world_errors_carry_comets_message(tmp_path):
    with pytest.raises(comet.InvalidArgument, match=r"comet_world_create_local: num_ranks 0 is outside"):
        comet.World(0)
    with pytest.raises(comet.InvalidArgument, match="timeout_ms"):
        comet.World(1, timeout_ms=-5)
    with pytest.raises(comet.InvalidArgument, match="not a table"):
        comet.World(1, tune_file=str(tmp_path))  # a folder is not a tune table
    with pytest.raises(ValueError, match='"cpu", "cuda"'):
        comet.World(1, backend="gpu")
    if comet.device_count() == 0:
        # a CPU-only build: no CUDA backend; a CUDA build here: no device
        with pytest.raises((comet.Unsupported, comet.CudaError)) as e:
            comet.World(1, "cuda")
        assert e.value.message


def test_world_spread_over_processes_is_checked():
    with pytest.raises(ValueError, match="128"):
        comet.World.from_unique_id(0, 1, b"short", 0)
    if comet.build_info().get("backend") == "cpu":
        with pytest.raises(comet.Unsupported):
            comet.get_unique_id()


def test_config_check():
    small_config().check()
    small_config().check(world_size=1)
    with pytest.raises(comet.InvalidArgument, match=r"config.topk 5 is outside \[1, num_experts=4\]"):
        small_config(topk=5).check()
    with pytest.raises(comet.InvalidArgument, match="the world has 2 ranks"):
        small_config().check(world_size=2)
    with pytest.raises(comet.Unsupported, match="only bf16"):
        small_config(dtype="fp32").check()
    with pytest.raises(ValueError, match="activation"):
        small_config(activation="relu")
    cfg = small_config(activation="gelu", tp=2, ep=2, ffn=40)
    assert cfg.w1_shape == (2, 20, 60) and cfg.w2_shape == (2, 60, 20)


def test_world_close_waits_for_its_layers():
    world = comet.World(1)
    layer = world.layer(0, small_config())
    with pytest.raises(comet.InvalidArgument):
        world.close()  # a layer lives: the world stays
    assert world.handle != 0
    mem = layer.memory()
    assert mem.symmetric_bytes > 0 and mem.private_bytes > 0
    with pytest.raises(comet.InvalidArgument, match="no forward"):
        layer.last_protocol()
    layer.close()
    layer.close()
    with pytest.raises(ValueError, match="closed"):
        layer.memory()
    world.close()


def test_layer_create_errors():
    with comet.World(1) as world:
        with pytest.raises(comet.InvalidArgument, match=r"config.tp\*config.ep = 1\*2 = 2 but the world has 1 ranks"):
            world.layer(0, small_config(ep=2))
        with pytest.raises(comet.InvalidArgument, match="config.topk 9"):
            world.layer(0, small_config(topk=9))
        with pytest.raises(comet.InvalidArgument, match="rank 1"):
            world.layer(1, small_config())


# ---------------------------------------------------------------------------
# One rank from ctypes buffers: no numpy.
# ---------------------------------------------------------------------------


class CtypesProblem:
    """One rank's inputs and outputs in ctypes arrays (W = 1)."""

    def __init__(self, cfg, tokens, rng):
        H, topk = cfg.hidden, cfg.topk
        self.shapes = {"x": (tokens, H), "topk_idx": (tokens, topk), "topk_w": (tokens, topk), "w1": cfg.w1_shape,
                       "w2": cfg.w2_shape, "y": (tokens, H)}
        n = {k: _numel(s) for k, s in self.shapes.items()}
        self.x = (ctypes.c_uint16 * n["x"])(*[bf16_bits(rng.uniform(-1, 1)) for _ in range(n["x"])])
        idx, w = routing(rng, tokens, cfg.num_experts, topk)
        self.topk_idx = (ctypes.c_int32 * n["topk_idx"])(*idx)
        self.topk_w = (ctypes.c_float * n["topk_w"])(*w)
        self.w1 = (ctypes.c_uint16 * n["w1"])(*[bf16_bits(rng.uniform(-0.15, 0.15)) for _ in range(n["w1"])])
        self.w2 = (ctypes.c_uint16 * n["w2"])(*[bf16_bits(rng.uniform(-0.2, 0.2)) for _ in range(n["w2"])])
        self.y = (ctypes.c_uint16 * n["y"])()

    def tensors(self, y=None):
        dtypes = {"x": "bf16", "topk_idx": "int32", "topk_w": "fp32", "w1": "bf16", "w2": "bf16", "y": "bf16"}
        bufs = {k: getattr(self, k) for k in dtypes}
        if y is not None:
            bufs["y"] = y
        return [comet.TensorDesc(ctypes.addressof(bufs[k]), dtypes[k], self.shapes[k]) for k in dtypes]


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize("activation", ["silu_gated", "gelu"])
def test_forward_one_rank_from_ctypes_equals_reference(rng, activation):
    cfg = small_config(activation=activation)
    p = CtypesProblem(cfg, 37, rng)
    with comet.World(1) as world, world.layer(0, cfg) as layer:
        tensors = p.tensors()
        assert layer.forward(*tensors) is tensors[5]  # returns y
        proto = layer.last_protocol()
        assert (proto.mode, proto.combine, proto.gemm) == (comet.Mode.OVERLAPPED, comet.Combine.PARTIALS,
                                                           comet.GemmKind.CPU)
        assert proto.chosen_by in (comet.Choice.BY_RULE, comet.Choice.BY_TABLE) and proto.n_comm >= 1
        layer.forward(*p.tensors(), n_comm=2, chunk_cols=16)
        proto = layer.last_protocol()
        assert (proto.chosen_by, proto.n_comm, proto.chunk_cols) == (comet.Choice.BY_ARGS, 2, 16)
        layer.sync()  # CPU: at once
    y_ref = (ctypes.c_uint16 * len(p.y))()
    comet.reference_forward(cfg, [p.tensors(y=y_ref)])
    assert bytes(p.y) == bytes(y_ref) and any(p.y)


def test_forward_errors_write_nothing(rng):
    cfg = small_config()
    p = CtypesProblem(cfg, 5, rng)
    ctypes.memset(p.y, 0x7F, ctypes.sizeof(p.y))  # a sentinel that must survive the failures
    sentinel = bytes(p.y)
    with comet.World(1) as world, world.layer(0, cfg) as layer:
        x, idx, w, w1, w2, y = p.tensors()
        bad_x = comet.TensorDesc(x.data, "bf16", (5, 59))
        with pytest.raises(comet.InvalidShape, match=r"comet_layer_forward: .*x: expected bf16 \(5, 60\), got bf16 "
                                                      r"\(5, 59\)"):
            layer.forward(bad_x, idx, w, w1, w2, y)
        p.topk_idx[3] = 9
        with pytest.raises(comet.InvalidRouting, match=r"topk_idx\[1, 1\] = 9 is outside \[0, num_experts=4\)"):
            layer.forward(x, idx, w, w1, w2, y)
        p.topk_idx[3] = p.topk_idx[2]
        with pytest.raises(comet.InvalidRouting, match=r"topk_idx\[1\] repeats expert"):
            layer.forward(x, idx, w, w1, w2, y)
        with pytest.raises(comet.InvalidShape, match="max_tokens_per_rank=40"):
            layer.forward(comet.TensorDesc(x.data, "bf16", (41, 60)), idx, w, w1, w2, y)
        with pytest.raises(comet.InvalidArgument, match="n_comm"):
            layer.forward(x, idx, w, w1, w2, y, n_comm=-2)
        with pytest.raises(TypeError, match="TensorDesc or a numpy array"):
            layer.forward([1, 2], idx, w, w1, w2, y)
    assert bytes(p.y) == sentinel
    with pytest.raises(comet.InvalidShape, match="rank 0: "):
        comet.reference_forward(cfg, [(bad_x, idx, w, w1, w2, y)])
    with pytest.raises(ValueError, match="has no y"):
        comet.reference_forward(cfg, [dict(x=x, topk_idx=idx, topk_w=w, w1=w1, w2=w2)])


def test_trace(rng, tmp_path):
    cfg = small_config()
    p = CtypesProblem(cfg, 12, rng)
    with comet.World(1) as world, world.layer(0, cfg) as layer, comet.Trace(1) as trace:
        layer.set_trace(trace)
        layer.forward(*p.tensors())
        layer.set_trace(None)
        assert trace.event_count > 0 and trace.dropped == 0
        trace.write_chrome_json(tmp_path / "t.json")
        trace.write_svg(tmp_path / "t.svg")
        trace.clear()
        assert trace.event_count == 0
    assert (tmp_path / "t.json").read_text().lstrip().startswith(("{", "["))
    assert "<svg" in (tmp_path / "t.svg").read_text()
    with pytest.raises(comet.InvalidArgument):
        comet.Trace(0)


# ---------------------------------------------------------------------------
# Two ranks from two Python threads (numpy).
# ---------------------------------------------------------------------------


def rank_inputs(np, cfg, tokens, seed):
    """Rank inputs as numpy arrays (bf16 as uint16 bits), for every rank."""
    gen = np.random.default_rng(seed)
    ranks = []
    for t in tokens:
        idx = np.stack([gen.permutation(cfg.num_experts)[:cfg.topk] for _ in range(t)]).astype(np.int32)
        idx = idx.reshape(t, cfg.topk)
        ranks.append(dict(
            x=comet.float_to_bf16(gen.uniform(-1, 1, (t, cfg.hidden))),
            topk_idx=np.ascontiguousarray(idx),
            topk_w=gen.uniform(0.1, 1, (t, cfg.topk)).astype(np.float32),
            w1=comet.float_to_bf16(gen.uniform(-0.15, 0.15, cfg.w1_shape)),
            w2=comet.float_to_bf16(gen.uniform(-0.2, 0.2, cfg.w2_shape)),
            y=np.full((t, cfg.hidden), 0x7F7F, dtype=np.uint16),
        ))
    return ranks


def run_ranks(world, cfg, ranks, **forward_kw):
    """One thread a rank: layer create, forward, last_protocol, close (all
    collective but the protocol). Returns (protocols, exceptions) by rank."""
    protos, errors = [None] * len(ranks), [None] * len(ranks)

    def body(r):
        try:
            with world.layer(r, cfg) as layer:
                try:
                    a = ranks[r]
                    layer.forward(a["x"], a["topk_idx"], a["topk_w"], a["w1"], a["w2"], a["y"], **forward_kw)
                    protos[r] = layer.last_protocol()
                except comet.CometError as e:
                    errors[r] = e
        except comet.CometError as e:
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank's thread hangs"
    return protos, errors


@pytest.mark.parametrize("tp,ep,activation", [(1, 2, "silu_gated"), (2, 1, "silu_gated"), (1, 2, "gelu")])
def test_two_ranks_from_threads_equal_reference(tp, ep, activation):
    np = pytest.importorskip("numpy", reason="numpy is needed for the two-rank problem")
    cfg = small_config(tp=tp, ep=ep, activation=activation)
    ranks = rank_inputs(np, cfg, [33, 17], seed=7 + tp)
    if tp == 2:  # TP: each rank holds its ffn slice of every expert; inputs of one model
        assert cfg.ffn_local == 10
    with comet.World(2, timeout_ms=30000) as world:
        protos, errors = run_ranks(world, cfg, ranks)
    assert errors == [None, None]
    # the CPU engine sizes each rank's communication workers by its own tokens: n_comm may differ
    assert protos[0].mode == protos[1].mode and protos[0].combine == comet.Combine.PARTIALS
    refs = [dict(r, y=np.zeros_like(r["y"])) for r in ranks]
    comet.reference_forward(cfg, refs)
    for r in range(2):
        assert np.array_equal(ranks[r]["y"], refs[r]["y"]), "rank %d differs from the reference" % r
        assert np.isfinite(comet.bf16_to_float(ranks[r]["y"])).all()


def test_two_ranks_routing_error_fails_every_rank():
    np = pytest.importorskip("numpy", reason="numpy is needed for the two-rank problem")
    cfg = small_config(ep=2)
    ranks = rank_inputs(np, cfg, [8, 8], seed=3)
    ranks[1]["topk_idx"][2, 0] = 4  # out of [0, 4)
    with comet.World(2, timeout_ms=30000) as world:
        protos, errors = run_ranks(world, cfg, ranks)
    assert isinstance(errors[1], comet.InvalidRouting) and "topk_idx[2, 0] = 4" in errors[1].message
    assert isinstance(errors[0], comet.PeerFailed)
    for r in range(2):
        assert (ranks[r]["y"] == 0x7F7F).all(), "rank %d wrote y on a failed forward" % r


def test_numpy_arrays_are_checked():
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match="float64 has no comet dtype"):
        comet.as_tensor(np.zeros((2, 2)), "x")
    with pytest.raises(ValueError, match="C-contiguous"):
        comet.as_tensor(np.zeros((4, 4), dtype=np.float32)[:, :2], "topk_w")
    t = comet.as_tensor(np.zeros((3, 5), dtype=np.uint16))
    assert (t.dtype, t.shape) == (comet.DType.BF16, (3, 5))


def test_bf16_helpers():
    np = pytest.importorskip("numpy")
    f = np.array([1.0, -2.5, 1 + 2 ** -8, 1 + 3 * 2 ** -8, np.inf, np.nan], dtype=np.float32)
    b = comet.float_to_bf16(f)
    assert list(b[:5]) == [0x3F80, 0xC020, 0x3F80, 0x3F82, 0x7F80]  # ties to even
    assert np.isnan(comet.bf16_to_float(b)[5])
    assert np.array_equal(comet.bf16_to_float(b[:2]), f[:2])


def test_reference_backward_runs():
    np = pytest.importorskip("numpy")
    cfg = small_config()
    (r,) = rank_inputs(np, cfg, [9], seed=11)
    r.pop("y")
    r.update(dy=comet.float_to_bf16(np.ones((9, cfg.hidden), dtype=np.float32)),
             dx=np.zeros((9, cfg.hidden), dtype=np.uint16), d_topk_w=np.zeros((9, cfg.topk), dtype=np.float32),
             dw1=np.zeros(cfg.w1_shape, dtype=np.float32), dw2=np.zeros(cfg.w2_shape, dtype=np.float32))
    comet.reference_backward(cfg, [r], accumulate=True)
    assert r["dx"].any() and r["d_topk_w"].any() and r["dw1"].any() and r["dw2"].any()
    with pytest.raises(comet.InvalidShape, match="accumulating needs fp32"):
        comet.reference_backward(cfg, [dict(r, dw1=np.zeros(cfg.w1_shape, dtype=np.uint16))], accumulate=True)
