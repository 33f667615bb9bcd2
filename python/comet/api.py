"""api.py - comet's C API as Python objects, without torch or numpy:
worlds, layer configs, layers and their forward, the protocol a forward ran,
the reference, traces. Each object owns its C handle; every failure raises
a CometError subclass carrying comet's message (comet/errors.py).

Tensors are passed as TensorDesc (a pointer, a dtype and a shape: raw
memory of any origin) or, when numpy is installed, as C-contiguous numpy
arrays (bf16 as uint16 arrays of bf16 bits: see float_to_bf16). The CPU
backend reads host memory; the CUDA backend device memory.

Collective calls (World.layer, Layer.forward, Layer.close) must be made by
every rank of a world; on the CPU backend each rank from its own thread
(ctypes releases the GIL during the call, so Python threads work).
"""

import ctypes
import dataclasses
import enum
import warnings
import weakref
from typing import Optional, Sequence, Tuple

from . import _capi
from .errors import check

# ---------------------------------------------------------------------------
# Library facts.
# ---------------------------------------------------------------------------


def version() -> str:
    """The version of the libcomet.so loaded, "MAJOR.MINOR.PATCH"."""
    v = _capi.comet_version()
    return "%d.%d.%d" % (v // 10000, v // 100 % 100, v % 100)


def device_count() -> int:
    """CUDA devices the CUDA backend can use (0 without GPUs or in a CPU-only build)."""
    return _capi.comet_device_count()


def build_info() -> dict:
    """How the loaded library was built and found: "library" (its path),
    "origin" ("package" or "COMET_LIBRARY"), "backend" ("cuda" or "cpu", as
    `pip install .` built it; absent for a library from COMET_LIBRARY),
    "reason" (why that backend), "nccl" (the NCCL it was built against, CUDA
    builds) and "nccl_loaded" (torch's libnccl.so.2 loaded before comet, or
    None)."""
    info = dict(_capi.BUILD_INFO)
    info.update(library=_capi.LIBRARY_PATH, origin=_capi.LIBRARY_ORIGIN, nccl_loaded=_capi.NCCL_PRELOADED)
    return info


# ---------------------------------------------------------------------------
# Enums of comet.h.
# ---------------------------------------------------------------------------
class DType(enum.IntEnum):
    """comet_dtype_t."""

    BF16 = 0  # uint16 storage of bfloat16
    FP16 = 1  # reserved: no backend supports it yet
    FP32 = 2
    INT32 = 3
    UINT8 = 4  # bytes: the state a training forward saves for its backward


class Save(enum.IntEnum):
    """comet_save_t: what a training forward keeps for its backward. "none"
    (inference), "activations" (the forward writes every row's gu and h
    into the caller's `saved` buffer, Layer.saved_bytes long; the backward
    reads them) or "recompute" (nothing kept: the backward reruns GEMM0)."""

    NONE = 0
    ACTIVATIONS = 1
    RECOMPUTE = 2


class Backend(enum.IntEnum):
    """comet_backend_t: "cpu" (ranks are threads of this process) or "cuda" (one GPU a rank)."""

    CPU = 0
    CUDA = 1


class Activation(enum.IntEnum):
    """comet_activation_t: "silu_gated" (h = silu(g) * u; W1 rows [0, F) gate, [F, 2F) up) or "gelu" (erf form)."""

    SILU_GATED = 0
    GELU = 1


class Mode(enum.IntEnum):
    """comet_mode_t."""

    SEQUENTIAL = 0
    OVERLAPPED = 1


class Combine(enum.IntEnum):
    """comet_combine_t."""

    PARTIALS = 0
    PUSH = 1
    PULL = 2


class GemmKind(enum.IntEnum):
    """comet_gemm_kind_t."""

    CPU = 0
    HOPPER = 1
    SIMT = 2


class Choice(enum.IntEnum):
    """comet_choice_t: what decided a forward's mode and n_comm."""

    BY_ARGS = 0
    BY_TABLE = 1
    BY_RULE = 2


SEQUENTIAL = _capi.COMET_SEQUENTIAL  # Layer.forward(n_comm=SEQUENTIAL): the sequential chain (CUDA)
DISABLE_COMM = _capi.COMET_DISABLE_COMM  # measurement only: no communication work (y undefined)
DISABLE_GEMM = _capi.COMET_DISABLE_GEMM  # measurement only: no GEMM arithmetic (y undefined)


def _enum(cls, value, what):
    if type(value) is cls:  # already a member (the common case, per tensor of every call): as cls(value)
        return value
    if isinstance(value, str):
        try:
            return cls[value.upper()]
        except KeyError:
            names = ", ".join('"%s"' % m.name.lower() for m in cls)
            raise ValueError("%s %r is not one of %s" % (what, value, names)) from None
    return cls(value)


# ---------------------------------------------------------------------------
# Tensors.
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorDesc:
    """comet_tensor_t: `data` (an address: host memory for the CPU backend,
    device memory for CUDA; 0 only when the tensor is empty), `dtype` (DType
    or "bf16", "fp32", "int32") and `shape` (1 to 4 dims, row-major, densely
    packed)."""

    data: int
    dtype: DType
    shape: Tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "dtype", _enum(DType, self.dtype, "dtype"))
        object.__setattr__(self, "shape", tuple(map(int, self.shape)))
        object.__setattr__(self, "data", int(self.data or 0))
        if not 1 <= len(self.shape) <= _capi.COMET_MAX_DIMS:
            raise ValueError("a comet tensor has 1 to %d dims, got shape %s" % (_capi.COMET_MAX_DIMS, self.shape))

    def to_c(self) -> _capi.comet_tensor_t:
        t = _capi.comet_tensor_t()
        t.data = self.data or None
        t.dtype = int(self.dtype)
        t.ndim = len(self.shape)
        for i, s in enumerate(self.shape):
            t.shape[i] = s
        return t


_NUMPY_DTYPES = {"uint16": DType.BF16, "float16": DType.FP16, "float32": DType.FP32, "int32": DType.INT32,
                 "uint8": DType.UINT8}


def as_tensor(obj, name="tensor") -> TensorDesc:
    """A TensorDesc for `obj`: a TensorDesc, or a C-contiguous numpy array of
    uint16 (bf16 bits), float32, int32, float16 or uint8."""
    if isinstance(obj, TensorDesc):
        return obj
    if type(obj).__module__ == "numpy" and hasattr(obj, "__array_interface__"):
        dtype = _NUMPY_DTYPES.get(obj.dtype.name)
        if dtype is None:
            raise TypeError("%s: numpy dtype %s has no comet dtype (bf16 travels as uint16 bits: comet.float_to_bf16; "
                            "float32; int32)" % (name, obj.dtype))
        if not obj.flags["C_CONTIGUOUS"]:
            raise ValueError("%s: the array must be C-contiguous (numpy.ascontiguousarray)" % name)
        return TensorDesc(obj.ctypes.data, dtype, obj.shape)
    raise TypeError("%s: expected a comet.TensorDesc or a numpy array, got %s" % (name, type(obj).__name__))


def _c_tensor(obj, name) -> _capi.comet_tensor_t:
    """The comet_tensor_t of `obj`: as_tensor's, or obj itself when it is
    one already (comet.torch builds them from tensors directly)."""
    return obj if isinstance(obj, _capi.comet_tensor_t) else as_tensor(obj, name).to_c()


def float_to_bf16(a):
    """numpy: float32 array -> uint16 array of its bf16 bits, rounded to
    nearest even (NaN stays NaN), as comet rounds."""
    import numpy as np

    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


def bf16_to_float(a):
    """numpy: uint16 array of bf16 bits -> float32 array (exact)."""
    import numpy as np

    return (np.ascontiguousarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------------------
# Configs and results.
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class LayerConfig:
    """comet_layer_config_t: one MoE layer (include/comet.h).

    hidden (H), ffn (F per expert, before TP slicing), num_experts (E,
    global), topk (1..E), activation ("silu_gated" or "gelu"), tp and ep
    (TP x EP = the world's ranks), max_tokens_per_rank (bound on T; sizes
    every buffer), tile_m (0: the backend's default), dtype ("bf16" only)."""

    hidden: int
    ffn: int
    num_experts: int
    topk: int
    max_tokens_per_rank: int
    activation: Activation = Activation.SILU_GATED
    tp: int = 1
    ep: int = 1
    tile_m: int = 0
    dtype: DType = DType.BF16

    def __post_init__(self):
        self.activation = _enum(Activation, self.activation, "activation")
        self.dtype = _enum(DType, self.dtype, "dtype")

    @property
    def experts_local(self) -> int:
        return self.num_experts // self.ep

    @property
    def ffn_local(self) -> int:
        return self.ffn // self.tp

    @property
    def w1_shape(self) -> Tuple[int, int, int]:
        """A rank's w1: (E_local, 2 F_local, H) gated, (E_local, F_local, H) gelu."""
        rows = 2 * self.ffn_local if self.activation == Activation.SILU_GATED else self.ffn_local
        return (self.experts_local, rows, self.hidden)

    @property
    def w2_shape(self) -> Tuple[int, int, int]:
        """A rank's w2: (E_local, H, F_local)."""
        return (self.experts_local, self.hidden, self.ffn_local)

    def to_c(self) -> _capi.comet_layer_config_t:
        c = _capi.comet_layer_config_t.init()
        c.hidden, c.ffn, c.num_experts, c.topk = self.hidden, self.ffn, self.num_experts, self.topk
        c.activation, c.dtype = int(self.activation), int(self.dtype)
        c.tp, c.ep, c.max_tokens_per_rank, c.tile_m = self.tp, self.ep, self.max_tokens_per_rank, self.tile_m
        return c

    def check(self, world_size: int = 0) -> None:
        """comet_layer_config_check: raise a CometError naming the offending
        field (world_size 0 skips the TP x EP check)."""
        check(_capi.comet_layer_config_check(ctypes.byref(self.to_c()), world_size), "comet_layer_config_check")


@dataclasses.dataclass(frozen=True)
class WorldOptions:
    """comet_world_options_t as a world runs with it, every default filled in."""

    timeout_ms: int
    cpu_workers: int
    tune_file: str  # "" for none
    graph_replay: int


@dataclasses.dataclass(frozen=True)
class Protocol:
    """comet_protocol_t: how a forward ran (Layer.last_protocol)."""

    mode: Mode
    n_comm: int  # communication workers (CPU) or CTAs beside GEMM0 (CUDA overlapped); 0 sequential
    chunk_cols: int  # layer-1 column-chunk width (CPU engine); 0 on CUDA
    combine: Combine
    gemm: GemmKind
    chosen_by: Choice
    graph_replay: bool  # CUDA: the forward replayed the layer's captured kernel chain


@dataclasses.dataclass(frozen=True)
class Memory:
    """comet_memory_t: bytes a rank's layer holds (symmetric: reachable by every rank)."""

    symmetric_bytes: int
    private_bytes: int


def _options(timeout_ms=0, cpu_workers=0, tune_file=None, graph_replay=0):
    o = _capi.comet_world_options_t.init()
    o.timeout_ms, o.cpu_workers, o.graph_replay = int(timeout_ms), int(cpu_workers), int(graph_replay)
    o.tune_file = None if tune_file is None else str(tune_file).encode()
    return o


def get_unique_id() -> bytes:
    """comet_get_unique_id: the 128 bytes one rank makes and hands to every
    rank of a world spread over processes (World.from_unique_id). CUDA builds."""
    uid = _capi.comet_unique_id_t()
    check(_capi.comet_get_unique_id(ctypes.byref(uid)), "comet_get_unique_id")
    return ctypes.string_at(ctypes.addressof(uid), _capi.COMET_UNIQUE_ID_BYTES)  # all 128, NULs included


# ---------------------------------------------------------------------------
# Worlds.
# ---------------------------------------------------------------------------
class World:
    """A group of ranks that run layers together (comet_world_create_local_opts).

    World(num_ranks, backend="cpu"|"cuda", timeout_ms=0, cpu_workers=0,
    tune_file=None, graph_replay=0): every rank lives in this process (CPU:
    threads; CUDA: rank r on device r). An option left at 0 (None) takes its
    environment variable, else the default (README, "Options and
    environment"). Close it (or use `with`) after its layers are closed."""

    def __init__(self, num_ranks: int, backend="cpu", *, timeout_ms: int = 0, cpu_workers: int = 0,
                 tune_file: Optional[str] = None, graph_replay: int = 0):
        backend = _enum(Backend, backend, "backend")
        opts = _options(timeout_ms, cpu_workers, tune_file, graph_replay)
        handle = ctypes.c_void_p()
        check(_capi.comet_world_create_local_opts(ctypes.byref(handle), int(num_ranks), int(backend),
                                                  ctypes.byref(opts)), "comet_world_create_local")
        self._init(handle)

    @classmethod
    def from_unique_id(cls, rank: int, world_size: int, unique_id: bytes, device: int, *, timeout_ms: int = 0,
                       cpu_workers: int = 0, tune_file: Optional[str] = None, graph_replay: int = 0) -> "World":
        """comet_world_create_nccl_opts: this process's `rank` of a world
        spread over processes (CUDA backend, on CUDA device `device`);
        collective over the ranks, which all pass the bytes of one
        get_unique_id()."""
        if len(unique_id) != _capi.COMET_UNIQUE_ID_BYTES:
            raise ValueError("unique_id has %d bytes, expected %d (comet.get_unique_id)"
                             % (len(unique_id), _capi.COMET_UNIQUE_ID_BYTES))
        uid = _capi.comet_unique_id_t()
        ctypes.memmove(ctypes.addressof(uid), bytes(unique_id), _capi.COMET_UNIQUE_ID_BYTES)
        opts = _options(timeout_ms, cpu_workers, tune_file, graph_replay)
        handle = ctypes.c_void_p()
        check(_capi.comet_world_create_nccl_opts(ctypes.byref(handle), int(rank), int(world_size), ctypes.byref(uid),
                                                 int(device), ctypes.byref(opts)), "comet_world_create_nccl")
        self = cls.__new__(cls)
        self._init(handle)
        return self

    def _init(self, handle):
        self._handle = handle
        self._layers = weakref.WeakSet()
        self.size = _capi.comet_world_size(handle)
        self.backend = Backend(_capi.comet_world_backend(handle))
        self.local_rank = _capi.comet_world_local_rank(handle)  # -1: every rank lives in this process

    @property
    def handle(self) -> int:
        """The comet_world_t* (0 once closed)."""
        return self._handle.value or 0

    def _live(self):
        if not self._handle:
            raise ValueError("the world is closed")
        return self._handle

    @property
    def options(self) -> WorldOptions:
        """The options the world runs with (comet_world_get_options)."""
        o = _capi.comet_world_options_t.init()
        check(_capi.comet_world_get_options(self._live(), ctypes.byref(o)), "comet_world_get_options")
        return WorldOptions(o.timeout_ms, o.cpu_workers, (o.tune_file or b"").decode(), o.graph_replay)

    def device(self, rank: int) -> int:
        """The CUDA device `rank` runs on in this process (-1 on the CPU backend)."""
        return _capi.comet_world_device(self._live(), int(rank))

    def layer(self, rank: int, config: LayerConfig) -> "Layer":
        """Collective: create `config`'s layer on `rank` (comet_layer_create)."""
        return Layer(self, rank, config)

    def close(self) -> None:
        """comet_world_destroy. Its layers must be closed first (else
        InvalidArgument, and the world stays). Closing twice is a no-op."""
        if self._handle:
            check(_capi.comet_world_destroy(self._handle), "comet_world_destroy")
            self._handle = ctypes.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_handle", None) and not len(self._layers):
            try:
                _capi.comet_world_destroy(self._handle)
            except Exception:  # interpreter shutdown
                pass

    def __repr__(self):
        state = "" if self._handle else ", closed"
        return "comet.World(size=%d, backend=%s%s)" % (self.size, self.backend.name.lower(), state)


# ---------------------------------------------------------------------------
# Layers.
# ---------------------------------------------------------------------------
def _stream(stream):
    """A cudaStream_t address (None for the default stream) from an address
    or an object with .cuda_stream (torch.cuda.Stream)."""
    if stream is not None:
        stream = getattr(stream, "cuda_stream", stream)
    return stream or None


class Layer:
    """One rank's MoE layer (comet_layer_create). Made by World.layer;
    forward and close are collective."""

    def __init__(self, world: World, rank: int, config: LayerConfig):
        c = config.to_c()
        handle = ctypes.c_void_p()
        check(_capi.comet_layer_create(ctypes.byref(handle), world._live(), int(rank), ctypes.byref(c)),
              "comet_layer_create")
        self._handle = handle
        self.world, self.rank, self.config = world, int(rank), dataclasses.replace(config)
        self._trace = None
        world._layers.add(self)

    @property
    def handle(self) -> int:
        """The comet_layer_t* (0 once closed)."""
        return self._handle.value or 0

    def _live(self):
        if not self._handle:
            raise ValueError("the layer is closed")
        return self._handle

    def forward(self, x, topk_idx, topk_w, w1, w2, y, *, stream=None, n_comm: int = 0, chunk_cols: int = 0,
                disable: int = 0, save="none", saved=None):
        """Collective: y = the layer of x (comet_layer_forward). Returns y.

        x (T, H) bf16: this rank's tokens; topk_idx (T, topk) int32: global
        expert ids, distinct per row; topk_w (T, topk) fp32: routing
        weights; w1 (E_local, 2 F_local, H) bf16 gated, (E_local, F_local, H)
        gelu; w2 (E_local, H, F_local) bf16; y (T, H) bf16, written. Each a
        TensorDesc, a numpy array (bf16 as uint16 bits) or a comet_tensor_t
        (comet._capi's, taken as it is).
        stream: a cudaStream_t address or an object with .cuda_stream (CUDA;
        ignored by the CPU backend). n_comm, chunk_cols, disable: as
        comet_forward_args_t (0: the tuner's choice). save (Save or "none",
        "activations", "recompute"): what this forward keeps for a backward;
        "activations" writes it into saved, a (n) uint8 buffer of n >=
        saved_bytes("activations"), handed to the backward of the same
        micro-batch. CPU: synchronous; CUDA: asynchronous on `stream` (sync()
        reports routing errors)."""
        a = _capi.comet_forward_args_t.init()
        for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_w", topk_w), ("w1", w1), ("w2", w2), ("y", y)):
            setattr(a, name, _c_tensor(t, name))
        a.stream = _stream(stream)
        a.n_comm, a.chunk_cols, a.disable = int(n_comm), int(chunk_cols), int(disable)
        a.save = int(_enum(Save, save, "save"))
        if saved is not None:
            a.saved = _c_tensor(saved, "saved")
        check(_capi.comet_layer_forward(self._live(), ctypes.byref(a)), "comet_layer_forward")
        return y

    def saved_bytes(self, save="activations") -> int:
        """Bytes of saved state one forward with `save` writes
        (comet_layer_saved_bytes): the worst case of the config; 0 for
        "none" and "recompute"."""
        n = ctypes.c_size_t()
        check(_capi.comet_layer_saved_bytes(self._live(), int(_enum(Save, save, "save")), ctypes.byref(n)),
              "comet_layer_saved_bytes")
        return n.value

    def backward(self, x, topk_idx, topk_w, w1, w2, dy, dx, d_topk_w, dw1, dw2, *, save="recompute", saved=None,
                 accumulate: bool = False, stream=None, n_comm: int = 0) -> None:
        """Collective: the layer's backward for this rank's tokens
        (comet_layer_backward): writes dx (T, H) bf16, d_topk_w (T, topk)
        fp32, dw1 and dw2 (w1's and w2's shapes, bf16 or fp32; with
        accumulate=True both fp32 and added to). x, topk_idx, topk_w, w1, w2
        as the forward's; dy (T, H) bf16. save: the forward's mode
        ("activations" reads that forward's `saved`; "recompute" or "none"
        reruns GEMM0). stream, n_comm: as forward. Backends without a
        backward raise Unsupported."""
        a = _capi.comet_backward_args_t.init()
        for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_w", topk_w), ("w1", w1), ("w2", w2), ("dy", dy),
                        ("dx", dx), ("d_topk_w", d_topk_w), ("dw1", dw1), ("dw2", dw2)):
            setattr(a, name, _c_tensor(t, name))
        a.accumulate = int(bool(accumulate))
        a.save = int(_enum(Save, save, "save"))
        if saved is not None:
            a.saved = _c_tensor(saved, "saved")
        a.stream = _stream(stream)
        a.n_comm = int(n_comm)
        check(_capi.comet_layer_backward(self._live(), ctypes.byref(a)), "comet_layer_backward")

    def sync(self) -> None:
        """comet_layer_sync: wait for this rank's last forward (CUDA) and raise
        what the device found (InvalidRouting, PeerFailed, ...)."""
        check(_capi.comet_layer_sync(self._live()), "comet_layer_sync")

    def last_protocol(self) -> Protocol:
        """How this rank's last forward ran (comet_layer_last_protocol);
        InvalidArgument before the first forward."""
        p = _capi.comet_protocol_t.init()
        check(_capi.comet_layer_last_protocol(self._live(), ctypes.byref(p)), "comet_layer_last_protocol")
        return Protocol(Mode(p.mode), p.n_comm, p.chunk_cols, Combine(p.combine), GemmKind(p.gemm),
                        Choice(p.chosen_by), bool(p.graph_replay))

    def memory(self) -> Memory:
        """Bytes this rank's layer holds (comet_layer_memory)."""
        m = _capi.comet_memory_t()
        check(_capi.comet_layer_memory(self._live(), ctypes.byref(m)), "comet_layer_memory")
        return Memory(m.symmetric_bytes, m.private_bytes)

    def set_trace(self, trace: Optional["Trace"]) -> None:
        """Record this rank's later forwards into `trace` (None detaches); not collective."""
        check(_capi.comet_layer_set_trace(self._live(), trace._live() if trace else None), "comet_layer_set_trace")
        self._trace = trace  # keeps the recorder alive while attached

    def close(self) -> None:
        """Collective: comet_layer_destroy. Closing twice is a no-op."""
        if self._handle:
            handle, self._handle = self._handle, ctypes.c_void_p()
            self.world._layers.discard(self)
            check(_capi.comet_layer_destroy(handle), "comet_layer_destroy")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # Destroying is collective: only a one-rank world's layer can be
        # destroyed by the garbage collector; others are left (and warned of).
        if not getattr(self, "_handle", None):
            return
        if self.world.size == 1 and self.world.local_rank < 0:
            try:
                _capi.comet_layer_destroy(self._handle)
            except Exception:  # interpreter shutdown
                pass
        else:
            warnings.warn("comet.Layer of rank %d was not closed: its memory stays (closing is collective)"
                          % self.rank, ResourceWarning, stacklevel=2)

    def __repr__(self):
        state = "" if self._handle else ", closed"
        return "comet.Layer(rank=%d, %r%s)" % (self.rank, self.config, state)


# ---------------------------------------------------------------------------
# The reference.
# ---------------------------------------------------------------------------
_FORWARD_FIELDS = ("x", "topk_idx", "topk_w", "w1", "w2", "y")
_BACKWARD_FIELDS = ("x", "topk_idx", "topk_w", "w1", "w2", "dy", "dx", "d_topk_w", "dw1", "dw2")


def _rank_args(struct, fields, ranks, what):
    arr = (struct * len(ranks))()
    for r, tensors in enumerate(ranks):
        if not hasattr(tensors, "keys"):
            if len(tensors) != len(fields):
                raise ValueError("%s: rank %d has %d tensors, expected %d (%s)"
                                 % (what, r, len(tensors), len(fields), ", ".join(fields)))
            tensors = dict(zip(fields, tensors))
        arr[r] = struct.init()
        for name in fields:
            if name not in tensors:
                raise ValueError("%s: rank %d has no %s" % (what, r, name))
            setattr(arr[r], name, as_tensor(tensors[name], "rank %d %s" % (r, name)).to_c())
    return arr


def reference_forward(config: LayerConfig, ranks: Sequence) -> None:
    """comet_reference_forward: the specification as plain loops, for every
    rank of a world of len(ranks) ranks, in this thread. ranks[r] holds rank
    r's x, topk_idx, topk_w, w1, w2 and y (a mapping with those keys, or a
    sequence in that order; shapes and dtypes as Layer.forward); each y is
    written. Validates everything before writing any y."""
    if not ranks:
        raise ValueError("reference_forward: no ranks")
    args = _rank_args(_capi.comet_forward_args_t, _FORWARD_FIELDS, ranks, "reference_forward")
    check(_capi.comet_reference_forward(ctypes.byref(config.to_c()), len(ranks), args), "comet_reference_forward")


def reference_backward(config: LayerConfig, ranks: Sequence, *, accumulate: bool = False) -> None:
    """comet_reference_backward: the backward's specification, for every rank.
    ranks[r] holds x, topk_idx, topk_w, w1, w2 (as the forward), dy (T, H)
    bf16, and the outputs dx (T, H) bf16, d_topk_w (T, topk) fp32, dw1 and
    dw2 (w1's and w2's shapes, bf16 or fp32; fp32 with accumulate=True,
    which adds to them)."""
    if not ranks:
        raise ValueError("reference_backward: no ranks")
    args = _rank_args(_capi.comet_backward_args_t, _BACKWARD_FIELDS, ranks, "reference_backward")
    for r in range(len(ranks)):
        args[r].accumulate = int(bool(accumulate))
    check(_capi.comet_reference_backward(ctypes.byref(config.to_c()), len(ranks), args), "comet_reference_backward")


# ---------------------------------------------------------------------------
# Traces.
# ---------------------------------------------------------------------------
class Trace:
    """A recorder of what every worker of every rank did during the forwards
    of the layers attached to it (Layer.set_trace), written as Chrome-trace
    JSON or SVG (comet_trace_create; 0: defaults)."""

    def __init__(self, num_ranks: int, lanes_per_rank: int = 0, events_per_lane: int = 0):
        handle = ctypes.c_void_p()
        check(_capi.comet_trace_create(ctypes.byref(handle), int(num_ranks), int(lanes_per_rank),
                                       int(events_per_lane)), "comet_trace_create")
        self._handle = handle

    def _live(self):
        if not self._handle:
            raise ValueError("the trace is closed")
        return self._handle

    @property
    def event_count(self) -> int:
        return _capi.comet_trace_event_count(self._live())

    @property
    def dropped(self) -> int:
        return _capi.comet_trace_dropped(self._live())

    def clear(self) -> None:
        check(_capi.comet_trace_clear(self._live()), "comet_trace_clear")

    def write_chrome_json(self, path: str) -> None:
        check(_capi.comet_trace_write_chrome_json(self._live(), str(path).encode()), "comet_trace_write_chrome_json")

    def write_svg(self, path: str) -> None:
        check(_capi.comet_trace_write_svg(self._live(), str(path).encode()), "comet_trace_write_svg")

    def close(self) -> None:
        """comet_trace_destroy (detach it from every layer first)."""
        if self._handle:
            handle, self._handle = self._handle, ctypes.c_void_p()
            check(_capi.comet_trace_destroy(handle), "comet_trace_destroy")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_handle", None):
            try:
                _capi.comet_trace_destroy(self._handle)
            except Exception:  # interpreter shutdown
                pass
