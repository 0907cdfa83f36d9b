"""The one exception tree of tq_async.

Every error the library raises derives from `TQError`. Each takes a single message
string (so it pickles, and a PyTorch DataLoader can re-raise it from a worker as
``type(exc)(msg)``) and the message says what to do about it.

Errors cross the wire by class name: a service answers a failed request with the name of the
class and its message, and the client re-raises the same class (see `error_from_wire`).
"""

from __future__ import annotations

__all__ = [
    "TQError",
    "ClosedError",
    "BrokenError",
    "TQTimeoutError",
    "ProtocolError",
    "InvalidRequestError",
    "SchemaError",
    "UnsupportedTypeError",
    "PartitionNotFound",
    "RowsNotFound",
    "KeyNotFound",
    "CheckpointError",
    "CheckpointNotFoundError",
    "WouldBlock",
    "ConfigError",
    "AuthenticationError",
    "SessionLostError",
    "DeviceError",
    "StorageFullError",
    "error_from_wire",
    "CALLERS_FAULT",
]


class TQError(Exception):
    """Base class of every error raised by tq_async."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message)

    @property
    def message(self) -> str:
        """The human-readable message (what happened and what to do)."""
        return str(self.args[0]) if self.args else ""


class ClosedError(TQError):
    """The object was closed by its owner and cannot be used any more."""


class BrokenError(TQError):
    """A peer vanished or a connection broke; ``__cause__`` holds the underlying error."""


class TQTimeoutError(TQError, TimeoutError):
    """A request did not complete within its deadline."""


class ProtocolError(TQError):
    """A message on the wire was malformed, truncated or of an unknown kind."""


class InvalidRequestError(TQError, ValueError):
    """A request's arguments are invalid (bad batch size, bad field list, ...)."""


class SchemaError(InvalidRequestError):
    """Data does not match a partition's field schema (dtype, per-row shape, layout)."""


class UnsupportedTypeError(InvalidRequestError, TypeError):
    """A column holds values that cannot travel without pickle, and pickle is not allowed."""


class PartitionNotFound(TQError, KeyError):
    """The named partition does not exist (never created, or cleared)."""

    def __str__(self) -> str:  # KeyError would repr() the message; keep it readable
        return self.message


class KeyNotFound(TQError, KeyError):
    """A KV key (or a field of a key) does not exist in the partition."""

    def __str__(self) -> str:
        return self.message


class WouldBlock(TQError):
    """``put_nowait`` found the capacity full (``put`` would have waited)."""


class CheckpointError(TQError):
    """A checkpoint is missing, corrupt, partial, or of an unknown format version."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory does not exist (also a ``FileNotFoundError``, so
    resume-if-present code written for TransferQueue, ``except FileNotFoundError``, works)."""


class RowsNotFound(TQError, KeyError):
    """Some requested rows do not exist in the partition (never allocated, or cleared)."""

    def __str__(self) -> str:
        return self.message


class ConfigError(InvalidRequestError):
    """A configuration (`Config`, a TOML file) is invalid.

    The message is one line: the offending key, then the problem.
    """


class AuthenticationError(BrokenError):
    """The service refused this client's CURVE keys (or the client has none).

    Check that the client uses the services' public key and that its own public key is in
    the services' allow-list; retrying with the same keys fails the same way.
    """


class SessionLostError(BrokenError):
    """A storage unit has no shared-memory session with this connection: it restarted (at
    the same address, so the connection rode through) since the client set one up, or the
    connection was replaced; or the client found, right before copying into a grant, that
    the unit's arena is another boot's (a durable unit's arena file outlives its process).
    Nothing of the request was done.

    The client sets the session up again and retries the call once by itself; this reaches
    a caller only if that fails too (then retry the call, as after any `BrokenError`).
    """


class StateLostError(BrokenError):
    """The service restarted without the state it had: partitions, rows, consumption and KV
    keys this client knew are gone (a controller at ``durability="memory"``, or one started
    on a new ``data_dir``).

    Raised by the calls made before the client learnt of the restart; the next calls go to
    the new service. Put the data again (or load a checkpoint), and run the service with
    ``--durability process --data-dir DIR`` where a restart must keep the state.
    """


class DeviceError(TQError):
    """A GPU could not be used: no CUDA driver, the device not visible to this process, or
    not enough device memory. Storage units then serve without a device arena (GPU columns go
    through host memory); check ``nvidia-smi`` and ``CUDA_VISIBLE_DEVICES`` on the units'
    host, or lower ``device_cap``.
    """


class StorageFullError(TQError):
    """A storage unit's disk is full (``ENOSPC``) while it writes a put's cells to its
    ``data_dir``: that put was not stored and nothing acknowledged before it is lost; the
    unit keeps serving. Free space on the unit's disk (or clear partitions), then put again.
    """


def _subclasses(cls: type[TQError]) -> list[type[TQError]]:
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _subclasses(direct))]


#: every error travels by its class name; the client re-raises the same class
_BY_NAME: dict[str, type[TQError]] = {cls.__name__: cls for cls in _subclasses(TQError)}

#: errors that are the caller's fault: a service answers them without a traceback in its log
CALLERS_FAULT: tuple[type[TQError], ...] = (
    InvalidRequestError,
    PartitionNotFound,
    RowsNotFound,
    KeyNotFound,
    WouldBlock,
    ProtocolError,
    TQTimeoutError,
    SessionLostError,  # (expected after a restart: the client sets the session up again)
    CheckpointError,  # (a checkpoint that cannot be taken now: the message says why)
)


def error_from_wire(kind: str, message: str) -> TQError:
    """Rebuild the exception a service reported; unknown kinds become a plain `TQError`."""
    cls = _BY_NAME.get(kind)
    if cls is None:  # a subclass defined after this module (e.g. in a data path's module)
        _BY_NAME.update((sub.__name__, sub) for sub in _subclasses(TQError))
        cls = _BY_NAME.get(kind, TQError)
    if cls is TQError and kind != "TQError":
        message = f"{kind}: {message}"
    return cls(message)
