"""_capi.py - the C API of include/comet.h through ctypes: the library's
loading, its structs (field for field, in the header's order) and every
function's prototype. Private: comet/__init__.py builds the Python API on it.

Which libcomet.so is loaded: $COMET_LIBRARY if set (the test scripts point
it at a `make` build), else the one installed inside this package by
`pip install .`. A library built with the CUDA backend links NCCL and the
CUDA runtime; where torch's (the nvidia.* wheels) are installed, they are
loaded first, so that comet and torch share one NCCL in the process
(`pip install .` builds comet against that NCCL).

ctypes releases the GIL during every call, so the ranks of a CPU world can
make their collective calls from Python threads.
"""

import ctypes
import glob
import json
import os

_HERE = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------------------
# Constants of comet.h.
# ---------------------------------------------------------------------------
COMET_MAX_DIMS = 4
COMET_UNIQUE_ID_BYTES = 128
COMET_SEQUENTIAL = -1
COMET_DISABLE_COMM = 1
COMET_DISABLE_GEMM = 2

# comet_dtype_t
DTYPE_BF16, DTYPE_FP16, DTYPE_FP32, DTYPE_INT32, DTYPE_UINT8 = 0, 1, 2, 3, 4
SAVE_NONE, SAVE_ACTIVATIONS, SAVE_RECOMPUTE = 0, 1, 2
# comet_backend_t
BACKEND_CPU, BACKEND_CUDA = 0, 1
# comet_activation_t
ACT_SILU_GATED, ACT_GELU = 0, 1


# ---------------------------------------------------------------------------
# Structs. Enums are C ints (4 bytes on every ABI comet builds for).
# tests/python: test_capi.py compares every size and offset with the C
# compiler's, and checks that the library accepts each struct_size.
# ---------------------------------------------------------------------------
class _Versioned(ctypes.Structure):
    """A struct that crosses the ABI with its size first (struct_size)."""

    @classmethod
    def init(cls):
        """The C initializer (COMET_*_INIT): struct_size set, every other field 0."""
        return cls(struct_size=ctypes.sizeof(cls))


class comet_tensor_t(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("shape", ctypes.c_int64 * COMET_MAX_DIMS),
    ]


class comet_unique_id_t(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * COMET_UNIQUE_ID_BYTES)]


class comet_world_options_t(_Versioned):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("timeout_ms", ctypes.c_int),
        ("cpu_workers", ctypes.c_int),
        ("tune_file", ctypes.c_char_p),
        ("graph_replay", ctypes.c_int),
    ]

    @classmethod
    def init(cls):
        """COMET_WORLD_OPTIONS_INIT."""
        return cls(ctypes.sizeof(cls), 0, 0, None, 0)


class comet_layer_config_t(_Versioned):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("hidden", ctypes.c_int64),
        ("ffn", ctypes.c_int64),
        ("num_experts", ctypes.c_int64),
        ("topk", ctypes.c_int64),
        ("activation", ctypes.c_int),
        ("dtype", ctypes.c_int),
        ("tp", ctypes.c_int),
        ("ep", ctypes.c_int),
        ("max_tokens_per_rank", ctypes.c_int64),
        ("tile_m", ctypes.c_int),
    ]

    @classmethod
    def init(cls):
        """COMET_LAYER_CONFIG_INIT."""
        return cls(ctypes.sizeof(cls), 0, 0, 0, 0, ACT_SILU_GATED, DTYPE_BF16, 1, 1, 0, 0)


class comet_memory_t(ctypes.Structure):
    _fields_ = [("symmetric_bytes", ctypes.c_size_t), ("private_bytes", ctypes.c_size_t)]


class comet_forward_args_t(_Versioned):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("x", comet_tensor_t),
        ("topk_idx", comet_tensor_t),
        ("topk_w", comet_tensor_t),
        ("w1", comet_tensor_t),
        ("w2", comet_tensor_t),
        ("y", comet_tensor_t),
        ("stream", ctypes.c_void_p),
        ("n_comm", ctypes.c_int),
        ("chunk_cols", ctypes.c_int),
        ("disable", ctypes.c_int),
        ("save", ctypes.c_int),
        ("saved", comet_tensor_t),
    ]


class comet_protocol_t(_Versioned):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("mode", ctypes.c_int),
        ("n_comm", ctypes.c_int),
        ("chunk_cols", ctypes.c_int),
        ("combine", ctypes.c_int),
        ("gemm", ctypes.c_int),
        ("chosen_by", ctypes.c_int),
        ("graph_replay", ctypes.c_int),
    ]


class comet_backward_args_t(_Versioned):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("x", comet_tensor_t),
        ("topk_idx", comet_tensor_t),
        ("topk_w", comet_tensor_t),
        ("w1", comet_tensor_t),
        ("w2", comet_tensor_t),
        ("dy", comet_tensor_t),
        ("dx", comet_tensor_t),
        ("d_topk_w", comet_tensor_t),
        ("dw1", comet_tensor_t),
        ("dw2", comet_tensor_t),
        ("accumulate", ctypes.c_int),
        ("save", ctypes.c_int),
        ("saved", comet_tensor_t),
        ("stream", ctypes.c_void_p),
        ("n_comm", ctypes.c_int),
        ("disable", ctypes.c_int),
    ]


STRUCTS = {
    "comet_tensor_t": comet_tensor_t,
    "comet_unique_id_t": comet_unique_id_t,
    "comet_world_options_t": comet_world_options_t,
    "comet_layer_config_t": comet_layer_config_t,
    "comet_memory_t": comet_memory_t,
    "comet_forward_args_t": comet_forward_args_t,
    "comet_protocol_t": comet_protocol_t,
    "comet_backward_args_t": comet_backward_args_t,
}


# ---------------------------------------------------------------------------
# Loading.
# ---------------------------------------------------------------------------
def _build_info():
    """What `pip install .` recorded about the build ({} for a library from
    $COMET_LIBRARY or a source tree)."""
    try:
        with open(os.path.join(_HERE, "_build_info.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _nvidia_libs(pattern):
    """Files matching `pattern` (e.g. "nccl/lib/libnccl.so.2") under the
    `nvidia` namespace package of torch's CUDA wheels."""
    try:
        import nvidia  # namespace package: no __file__
    except ImportError:
        return []
    found = []
    for d in list(getattr(nvidia, "__path__", [])):
        found += sorted(glob.glob(os.path.join(d, pattern)))
    return found


def _preload_torch_cuda():
    """Load torch's CUDA runtime and NCCL (the nvidia.* wheels), when present,
    with RTLD_GLOBAL before comet, so that a CUDA build of comet resolves
    libcudart and libnccl.so.2 to torch's copies, whichever of comet and torch
    is imported first: torch cannot run with another NCCL (a missing symbol
    at its import), and comet checks the NCCL it gets against the one it was
    built with when it first uses it. Returns the NCCL's path, or None."""
    for path in _nvidia_libs("cu[0-9]*/lib/libcudart.so.[0-9]*") + _nvidia_libs("cuda_runtime/lib/libcudart.so.[0-9]*"):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass
    for path in _nvidia_libs("nccl/lib/libnccl.so.2"):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
        except OSError:
            pass
    return None


def _find_library():
    path = os.environ.get("COMET_LIBRARY")
    if path:
        return path, "COMET_LIBRARY"
    path = os.path.join(_HERE, "libcomet.so")
    if os.path.exists(path):
        return path, "package"
    raise ImportError(
        "comet: libcomet.so not found: %s has none (install the package with `pip install .` from the "
        "repository, or point COMET_LIBRARY at a libcomet.so built by make)" % _HERE
    )


LIBRARY_PATH, LIBRARY_ORIGIN = _find_library()
BUILD_INFO = _build_info()
NCCL_PRELOADED = _preload_torch_cuda() if BUILD_INFO.get("backend") != "cpu" else None
try:
    lib = ctypes.CDLL(LIBRARY_PATH)
except OSError as e:
    raise ImportError("comet: cannot load %s: %s" % (LIBRARY_PATH, e)) from e


def _proto(name, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


_P = ctypes.POINTER
_status = ctypes.c_int
_world_p = ctypes.c_void_p
_layer_p = ctypes.c_void_p
_trace_p = ctypes.c_void_p

comet_status_string = _proto("comet_status_string", ctypes.c_char_p, ctypes.c_int)
comet_last_error = _proto("comet_last_error", ctypes.c_char_p)
comet_version = _proto("comet_version", ctypes.c_int)
comet_device_count = _proto("comet_device_count", ctypes.c_int)

comet_world_create_local = _proto("comet_world_create_local", _status, _P(_world_p), ctypes.c_int, ctypes.c_int)
comet_world_create_nccl = _proto(
    "comet_world_create_nccl", _status, _P(_world_p), ctypes.c_int, ctypes.c_int, _P(comet_unique_id_t), ctypes.c_int
)
comet_world_create_local_opts = _proto(
    "comet_world_create_local_opts", _status, _P(_world_p), ctypes.c_int, ctypes.c_int, _P(comet_world_options_t)
)
comet_get_unique_id = _proto("comet_get_unique_id", _status, _P(comet_unique_id_t))
comet_world_create_nccl_opts = _proto(
    "comet_world_create_nccl_opts", _status, _P(_world_p), ctypes.c_int, ctypes.c_int, _P(comet_unique_id_t),
    ctypes.c_int, _P(comet_world_options_t),
)
comet_world_get_options = _proto("comet_world_get_options", _status, _world_p, _P(comet_world_options_t))
comet_world_destroy = _proto("comet_world_destroy", _status, _world_p)
comet_world_size = _proto("comet_world_size", ctypes.c_int, _world_p)
comet_world_backend = _proto("comet_world_backend", ctypes.c_int, _world_p)
comet_world_local_rank = _proto("comet_world_local_rank", ctypes.c_int, _world_p)
comet_world_device = _proto("comet_world_device", ctypes.c_int, _world_p, ctypes.c_int)

comet_layer_config_check = _proto("comet_layer_config_check", _status, _P(comet_layer_config_t), ctypes.c_int)
comet_layer_create = _proto(
    "comet_layer_create", _status, _P(_layer_p), _world_p, ctypes.c_int, _P(comet_layer_config_t)
)
comet_layer_destroy = _proto("comet_layer_destroy", _status, _layer_p)
comet_layer_memory = _proto("comet_layer_memory", _status, _layer_p, _P(comet_memory_t))
comet_layer_forward = _proto("comet_layer_forward", _status, _layer_p, _P(comet_forward_args_t))
comet_layer_last_protocol = _proto("comet_layer_last_protocol", _status, _layer_p, _P(comet_protocol_t))
comet_layer_sync = _proto("comet_layer_sync", _status, _layer_p)
comet_layer_backward = _proto("comet_layer_backward", _status, _layer_p, _P(comet_backward_args_t))
comet_layer_saved_bytes = _proto(
    "comet_layer_saved_bytes", _status, _layer_p, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)
)
comet_reference_forward = _proto(
    "comet_reference_forward", _status, _P(comet_layer_config_t), ctypes.c_int, _P(comet_forward_args_t)
)
comet_reference_backward = _proto(
    "comet_reference_backward", _status, _P(comet_layer_config_t), ctypes.c_int, _P(comet_backward_args_t)
)

comet_trace_create = _proto("comet_trace_create", _status, _P(_trace_p), ctypes.c_int, ctypes.c_int, ctypes.c_int64)
comet_trace_destroy = _proto("comet_trace_destroy", _status, _trace_p)
comet_trace_clear = _proto("comet_trace_clear", _status, _trace_p)
comet_trace_event_count = _proto("comet_trace_event_count", ctypes.c_int64, _trace_p)
comet_trace_dropped = _proto("comet_trace_dropped", ctypes.c_int64, _trace_p)
comet_trace_write_chrome_json = _proto("comet_trace_write_chrome_json", _status, _trace_p, ctypes.c_char_p)
comet_trace_write_svg = _proto("comet_trace_write_svg", _status, _trace_p, ctypes.c_char_p)
comet_layer_set_trace = _proto("comet_layer_set_trace", _status, _layer_p, _trace_p)
comet_tensor_2d = _proto("comet_tensor_2d", comet_tensor_t, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
comet_tensor_3d = _proto(
    "comet_tensor_3d", comet_tensor_t, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64
)
