"""comet - Mixture-of-Experts layers across GPUs with fine-grained
computation-communication overlap, from Python.

`import comet` needs neither torch nor numpy: it is the C API
(include/comet.h) through ctypes over the libcomet.so that `pip install .`
built into this package (or the one $COMET_LIBRARY names).

    import comet
    cfg = comet.LayerConfig(hidden=256, ffn=512, num_experts=8, topk=2, max_tokens_per_rank=128)
    with comet.World(1, "cpu") as world, world.layer(0, cfg) as layer:
        layer.forward(x, topk_idx, topk_w, w1, w2, y)   # numpy arrays or comet.TensorDesc

`comet.torch` (needs torch) has the layer as a PyTorch op:
comet.torch.moe_experts(x, topk_idx, topk_w, w1, w2), and the nn.Module
comet.torch.MoEExperts; `comet.convert` (needs torch) turns HF and Megatron
expert weights into comet's per-rank layout and back.

Every failure raises a comet.CometError subclass (InvalidArgument,
InvalidShape, InvalidRouting, PeerFailed, Unsupported, ...) carrying the
status and comet's message.
"""

from .api import (
    DISABLE_COMM,
    DISABLE_GEMM,
    SEQUENTIAL,
    Activation,
    Backend,
    Choice,
    Combine,
    DType,
    GemmKind,
    Layer,
    LayerConfig,
    Memory,
    Mode,
    Protocol,
    Save,
    TensorDesc,
    Trace,
    World,
    WorldOptions,
    as_tensor,
    bf16_to_float,
    build_info,
    device_count,
    float_to_bf16,
    get_unique_id,
    reference_backward,
    reference_forward,
    version,
)
from .errors import (
    CometError,
    CudaError,
    InternalError,
    InvalidArgument,
    InvalidRouting,
    InvalidShape,
    NcclError,
    OutOfMemory,
    PeerFailed,
    Status,
    SystemFailure,
    Timeout,
    Unsupported,
)

__version__ = version()
