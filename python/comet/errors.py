"""errors.py - comet's status codes (comet_status_t) as Python: the enum
`Status`, the exception `CometError` and one subclass per failing status,
each carrying the status and comet's own message (comet_last_error of the
failing call, read on the thread that made it)."""

import enum

from . import _capi


class Status(enum.IntEnum):
    """comet_status_t."""

    SUCCESS = 0
    INVALID_ARGUMENT = 1  # null pointer, bad config value, bad flag
    INVALID_SHAPE = 2  # tensor shape/dtype mismatch, buffer too small, T > max
    INVALID_ROUTING = 3  # expert id out of range or repeated in a row
    PEER_FAILED = 4  # another rank of the collective call failed
    UNSUPPORTED = 5  # backend, dtype or feature not available in this build
    OUT_OF_MEMORY = 6
    TIMEOUT = 7  # a wait between ranks or workers timed out
    SYSTEM = 8  # thread or OS call failed
    CUDA = 9
    NCCL = 10
    INTERNAL = 11

    @property
    def c_name(self):
        """The C constant's name, e.g. "COMET_ERR_INVALID_SHAPE" (comet_status_string)."""
        return _capi.comet_status_string(int(self)).decode()


class CometError(Exception):
    """A comet call failed. `status` is its Status, `message` comet's message
    (comet_last_error); str(e) is "COMET_ERR_...: message"."""

    def __init__(self, status, message):
        try:
            status = Status(status)
        except ValueError:
            pass  # a status this binding does not know: keep the int
        self.status = status
        self.message = message
        name = status.c_name if isinstance(status, Status) else "status %d" % status
        super().__init__("%s: %s" % (name, message) if message else name)

    def __reduce__(self):  # picklable (multiprocessing, torch.distributed)
        return (type(self), (int(self.status), self.message))


def _subclass(name, status, doc, *bases):
    def __init__(self, message, status=status):
        CometError.__init__(self, status, message)

    def __reduce__(self):
        return (type(self), (self.message,))

    return type(name, (CometError,) + bases, {"__init__": __init__, "__reduce__": __reduce__, "__doc__": doc})


InvalidArgument = _subclass("InvalidArgument", Status.INVALID_ARGUMENT,
                            "COMET_ERR_INVALID_ARGUMENT: null pointer, bad config value, bad flag.", ValueError)
InvalidShape = _subclass("InvalidShape", Status.INVALID_SHAPE,
                         "COMET_ERR_INVALID_SHAPE: tensor shape/dtype mismatch, buffer too small, T > max.",
                         ValueError)
InvalidRouting = _subclass("InvalidRouting", Status.INVALID_ROUTING,
                           "COMET_ERR_INVALID_ROUTING: expert id out of range or repeated in a row.", ValueError)
PeerFailed = _subclass("PeerFailed", Status.PEER_FAILED,
                       "COMET_ERR_PEER_FAILED: another rank of the collective call failed.")
Unsupported = _subclass("Unsupported", Status.UNSUPPORTED,
                        "COMET_ERR_UNSUPPORTED: backend, dtype or feature not available in this build.")
OutOfMemory = _subclass("OutOfMemory", Status.OUT_OF_MEMORY, "COMET_ERR_OUT_OF_MEMORY.", MemoryError)
Timeout = _subclass("Timeout", Status.TIMEOUT, "COMET_ERR_TIMEOUT: a wait between ranks or workers timed out.")
SystemFailure = _subclass("SystemFailure", Status.SYSTEM, "COMET_ERR_SYSTEM: a thread or OS call failed.")
CudaError = _subclass("CudaError", Status.CUDA, "COMET_ERR_CUDA.")
NcclError = _subclass("NcclError", Status.NCCL, "COMET_ERR_NCCL.")
InternalError = _subclass("InternalError", Status.INTERNAL, "COMET_ERR_INTERNAL.")
for _cls in (InvalidArgument, InvalidShape, InvalidRouting, PeerFailed, Unsupported, OutOfMemory, Timeout, SystemFailure, CudaError,
             NcclError, InternalError):
    _cls.__module__ = "comet"
CometError.__module__ = "comet"

_BY_STATUS = {
    Status.INVALID_ARGUMENT: InvalidArgument,
    Status.INVALID_SHAPE: InvalidShape,
    Status.INVALID_ROUTING: InvalidRouting,
    Status.PEER_FAILED: PeerFailed,
    Status.UNSUPPORTED: Unsupported,
    Status.OUT_OF_MEMORY: OutOfMemory,
    Status.TIMEOUT: Timeout,
    Status.SYSTEM: SystemFailure,
    Status.CUDA: CudaError,
    Status.NCCL: NcclError,
    Status.INTERNAL: InternalError,
}


def error(status, message):
    """The exception for a failed status: its subclass, or CometError."""
    cls = _BY_STATUS.get(status)
    return cls(message) if cls else CometError(status, message)


def check(status, what=None):
    """Raise the exception of `status` with comet_last_error() (call it on the
    thread that made the failed call, right after it); return on success.
    `what` (e.g. "comet_layer_create") prefixes the message."""
    if status == 0:
        return
    message = (_capi.comet_last_error() or b"").decode(errors="replace")
    raise error(status, "%s: %s" % (what, message) if what else message)
