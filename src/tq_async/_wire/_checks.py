"""Checks of the numbers in requests: msgspec checks types, these check ranges.

Every service calls `validate` right after decoding a request
(`tq_async._wire._protocol`), and clients run the same checks before sending, so one
caller's NaN can never reach a timer heap or an ``array`` shared with other callers.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, overload

from .._errors import InvalidRequestError
from ._columns import ITEM_SIZES, KINDS, ColumnHeader
from ._protocol import (
    Ack,
    AcquireRollout,
    GetMeta,
    PutBegin,
    PutCommit,
    PutInline,
    RegisterUnit,
    ReleaseRollout,
    RenewSlots,
    RestoreBegin,
    ReturnRecycled,
    SetPolicyVersion,
    StorePut,
    TakeRecycled,
    WatchNext,
)

__all__ = [
    "MAX_WATCHERS",
    "MAX_ALSO",
    "MAX_DP_SIZE",
    "MAX_INT",
    "MAX_PUT_ROWS",
    "MAX_RECORD_SPAN",
    "MAX_UNIT_ID",
    "as_int",
    "as_seconds",
    "check_also",
    "check_flag",
    "check_headers",
    "check_id",
    "check_int",
    "check_ints",
    "check_sampling_config",
    "check_seconds",
    "check_text",
    "integral",
    "validate",
]

#: the most watchers one shared watch request may ask for
MAX_WATCHERS = 1 << 16
#: the largest int the services keep (rows, versions and counts live in int64 arrays)
MAX_INT = 2**63 - 1
#: the most rows one put may allocate
MAX_PUT_ROWS = 2**31 - 1
#: storage unit ids live in int32 arrays
MAX_UNIT_ID = 2**31 - 1
#: the longest name a client holds admission slots under (`AcquireRollout.holder`)
MAX_HOLDER = 64
_INF = math.inf


@overload
def check_seconds(name: str, value: Any, *, optional: Literal[False]) -> float: ...
@overload
def check_seconds(name: str, value: Any, *, optional: bool = True) -> float | None: ...
def check_seconds(name: str, value: Any, *, optional: bool = True) -> float | None:
    """``value`` as positive finite seconds (or None when ``optional``), a float: any real
    number is taken (numpy's ``float32`` and ``int64`` too, as configs hold them).

    Raises:
        InvalidRequestError: naming ``name``, for NaN, infinities, zero, negatives and
            non-numbers.
    """
    if value is None and optional:
        return None
    seconds = as_seconds(name, value, optional)
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequestError(
            f"{name} must be positive, finite seconds{' or None' if optional else ''}, got "
            f"{value!r}; pass e.g. {name}=30"
            + (f" (or {name}=None to wait without a deadline)" if optional else "")
        )
    return seconds


def check_text(what: str, value: str) -> str:
    """``value`` if it can travel as UTF-8 (msgpack strings are UTF-8).

    Raises:
        InvalidRequestError: naming ``what``, e.g. for a lone surrogate (``'\\ud800'``, what
            ``os.fsdecode`` makes of undecodable bytes).
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{what} {value!r} is not valid UTF-8 text ({exc.reason} at position "
            f"{exc.start}); ids travel as UTF-8: remove or replace that character"
        ) from None
    return value


def check_id(what: str, value: Any) -> str:
    """``value`` as an id (``what``: a partition id, a task name): a non-empty string that
    travels as UTF-8 (a ``str`` subclass, such as numpy's ``str_``, as the plain ``str``).

    Raises:
        InvalidRequestError: naming ``what``, for anything else (a wrong type reached the
            controller's decoder: a ProtocolError it logged as a malformed request).
    """
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(
            f"{what} must be a non-empty string, got {type(value).__name__} {value!r:.80}"
        )
    return check_text(what, value if type(value) is str else str.__str__(value))


def check_flag(name: str, value: Any) -> bool:
    """``value`` as a bool: True or False (numpy's ``bool_`` too).

    Raises:
        InvalidRequestError: naming ``name``, for anything else (a string such as "no" is
            no flag; it reached the services' decoder as a malformed request).
    """
    if type(value) is bool:
        return value
    if type(value).__name__ == "bool" and type(value).__module__ == "numpy":
        return bool(value)
    raise InvalidRequestError(
        f"{name} must be True or False, got {type(value).__name__} {value!r:.80}"
    )


def check_int(name: str, value: Any, lo: int = 0, hi: int = MAX_INT) -> int:
    """``value`` as a plain int in ``[lo, hi]`` (an integral scalar, such as numpy's
    ``int64``, as its int: see `as_int`).

    Raises:
        InvalidRequestError: naming ``name``, for non-ints (bools included) and values out
            of range.
    """
    n: int = value if type(value) is int else as_int(name, value)
    if not lo <= n <= hi:
        raise InvalidRequestError(f"{name} must be an int in [{lo}, {hi}], got {n}")
    return n


def as_int(name: str, value: Any) -> int:
    """``value`` as a plain int: an int, or an integral scalar (numpy's ``int64``, a
    one-element integer tensor), as configs and arrays hold them.

    Raises:
        InvalidRequestError: naming ``name``, for bools and anything not integral.
    """
    if not isinstance(value, bool) and "bool" not in str(getattr(value, "dtype", "")):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise InvalidRequestError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def integral(value: Any) -> Any:
    """An integral number (numpy's ``int64``, a one-element integer tensor) as a plain int;
    anything else, a bool too, unchanged (the range check that follows names it)."""
    if isinstance(value, bool):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def as_seconds(name: str, value: Any, optional: bool = True) -> float:
    """``value`` as a float: any real number but a bool (numpy's too)."""
    if type(value) is float:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequestError(
            f"{name} must be a number of seconds{' or None' if optional else ''}, "
            f"got {type(value).__name__} {value!r}"
        )
    return float(value)


def check_ints(name: str, values: Sequence[Any] | None, lo: int = 0, hi: int = MAX_INT) -> None:
    """Every item of ``values`` (when given) is an int in ``[lo, hi]``."""
    if values is None:
        return
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise InvalidRequestError(
                f"{name} must hold ints in [{lo}, {hi}], got {v!r}"
                + ("; a policy version is a non-negative int" if name == "policy_version" else "")
            )


#: the most batches one get_meta decides ahead of its own (``record_from``)
MAX_RECORD_SPAN = 1 << 16

#: the most batches one get_meta asks for besides its own (``also``)
MAX_ALSO = 64

#: the most DP ranks one global batch is decided for (each decision costs the controller
#: time and memory in ``dp_size``: one client's huge value would stall every other)
MAX_DP_SIZE = 1 << 16


def check_sampling_config(cfg: Mapping[str, Any] | None) -> None:
    """``dp_rank``, ``batch_index`` and ``record_from`` of a sampling config, when set, are
    ints >= 0 (``record_from`` only with ``batch_index``), and ``dp_size`` an int >= 1."""
    if not cfg:
        return
    for key, lo in (("dp_rank", 0), ("batch_index", 0), ("dp_size", 1), ("record_from", 0)):
        v = cfg.get(key)
        if v is not None:
            hi = MAX_DP_SIZE if key == "dp_size" else MAX_INT
            check_int(f"sampling_config[{key!r}]", v, lo, hi)
    record_from = cfg.get("record_from")
    if record_from is not None:
        index = cfg.get("batch_index")
        if index is None:
            raise InvalidRequestError(
                "sampling_config['record_from'] needs 'batch_index': it names the batches below "
                "batch_index to decide first"
            )
        if index - record_from > MAX_RECORD_SPAN:
            raise InvalidRequestError(
                f"sampling_config['record_from'] is {index - record_from} batches below "
                f"batch_index; at most {MAX_RECORD_SPAN} are decided in one request (it is "
                "meant for the few batches of readers sharing an index space)"
            )


def check_also(also: Sequence[int], cfg: Mapping[str, Any] | None, mode: str) -> None:
    """``also`` names at most `MAX_ALSO` increasing batch indexes above the request's
    own ``batch_index``, within `MAX_RECORD_SPAN` of it, for a ``fetch``."""
    first = cfg.get("batch_index") if cfg else None
    if mode != "fetch" or first is None:
        raise InvalidRequestError(
            "also= needs a fetch whose sampling_config names a batch_index (the batches it "
            "asks for are recorded under their indexes, like the asked one)"
        )
    if len(also) > MAX_ALSO:
        raise InvalidRequestError(
            f"also= names {len(also)} batches; at most {MAX_ALSO} ride with one request"
        )
    check_ints("also", also)
    below = first
    for j in also:
        if j <= below:
            raise InvalidRequestError(
                f"also= must name increasing batch indexes above batch_index {first}, got "
                f"{list(also)}"
            )
        below = j
    if below - first > MAX_RECORD_SPAN:
        raise InvalidRequestError(
            f"also= reaches {below - first} batches above batch_index {first}; at most "
            f"{MAX_RECORD_SPAN}"
        )


def check_headers(columns: Sequence[ColumnHeader]) -> None:
    """Column headers name a known kind and dtype, and a shape of non-negative sizes."""
    for h in columns:
        if h.kind not in KINDS:
            raise InvalidRequestError(
                f"column {h.name!r} has kind {h.kind!r}; expected one of {list(KINDS)}"
            )
        if h.kind in ("dense", "jagged") and h.dtype not in ITEM_SIZES:
            raise InvalidRequestError(f"column {h.name!r} has unknown dtype {h.dtype!r}")
        check_ints(f"the shape of column {h.name!r}", h.shape, 0, MAX_PUT_ROWS)


def _restore(b: RestoreBegin) -> None:
    for d in b.state.partitions:
        check_int(f"n_rows of partition {d.partition_id!r}", d.n_rows)
        check_int(f"base of partition {d.partition_id!r}", d.base, 0, d.n_rows)
        check_ints("origin", d.origin)
        check_ints("row_version", d.row_version, -1)
        for name, versions in d.field_versions.items():
            check_ints(f"the versions of field {name!r}", versions, -1)
        check_headers([f.header for f in d.fields])
        for _, index, ranks in d.dp_ends:
            check_int("the batch_index of a DP end of stream", index)
            check_ints("the DP ranks of an end of stream", ranks)
        check_ints("the recycled rows", d.recycled, 0, d.n_rows - 1)


def _get_meta(b: GetMeta) -> None:
    # the decoder guarantees the types: test the ranges first, name the culprit after
    # (the checks run on every get_meta; this way they cost well under a microsecond)
    if not 0 < b.batch_size <= MAX_INT:
        check_int("batch_size", b.batch_size, 1)
    if b.timeout is not None and not 0.0 < b.timeout < _INF and b.timeout != 0:
        check_seconds("timeout", b.timeout)
    if b.lease is not None and not 0.0 < b.lease < _INF:
        check_seconds("lease", b.lease)
    if not 0 <= b.inline_bytes <= MAX_INT:
        check_int("inline_bytes", b.inline_bytes)
    if b.ack:
        check_ints("ack", b.ack)
    if b.sampling_config:
        check_sampling_config(b.sampling_config)
    if b.also is not None:
        check_also(b.also, b.sampling_config, b.mode)
    if not b.data_fields:
        raise InvalidRequestError("data_fields must name at least one field")
    if b.mode not in ("fetch", "peek"):
        raise InvalidRequestError(f"mode must be 'fetch' or 'peek', got {b.mode!r}")
    if not b.task_name:
        raise InvalidRequestError("task_name must be a non-empty string")


def _put_begin(b: PutBegin) -> None:
    check_headers(b.columns)
    check_int("n_rows", b.n_rows, 0, MAX_PUT_ROWS)
    check_seconds("timeout", b.timeout)


def _put_commit(b: PutCommit) -> None:
    check_ints("policy_version", b.versions)


def _put_inline(b: PutInline) -> None:
    check_headers(b.columns)
    check_int("n_rows", b.n_rows, 0, MAX_PUT_ROWS)
    check_ints("policy_version", b.versions)
    check_seconds("timeout", b.timeout)


def _acquire(b: AcquireRollout) -> None:
    check_int("policy_version", b.policy_version)
    check_int("n", b.n, 1)
    check_seconds("timeout", b.timeout)
    check_int("token", b.token, 0)
    _holder(b.holder)


def _release(b: ReleaseRollout) -> None:
    check_int("n", b.n)
    _holder(b.holder)


def _holder(holder: bytes) -> None:
    if len(holder) > MAX_HOLDER:
        raise InvalidRequestError(f"a slot holder's name is {MAX_HOLDER} bytes at most")


def _watch_next(b: WatchNext) -> None:
    if b.since is not None:
        check_int("since", b.since)
    check_int("max_events", b.max_events, 1)
    if b.max_lag is not None:
        check_int("max_lag", b.max_lag, 1)
    check_seconds("poll", b.poll, optional=False)
    check_int("watchers", b.watchers, 1, MAX_WATCHERS)


_CHECKS: dict[type[Any], Callable[[Any], object]] = {
    WatchNext: _watch_next,
    GetMeta: _get_meta,
    PutBegin: _put_begin,
    PutCommit: _put_commit,
    PutInline: _put_inline,
    AcquireRollout: _acquire,
    RegisterUnit: lambda b: check_int("unit_id", b.unit_id, -1, MAX_UNIT_ID),
    SetPolicyVersion: lambda b: check_int("version", b.version),
    ReleaseRollout: _release,
    RenewSlots: lambda b: _holder(b.holder),
    TakeRecycled: lambda b: check_int("max_rows", b.max_rows, 1),
    ReturnRecycled: lambda b: check_ints("rows", b.rows),
    Ack: lambda b: check_ints("lease_ids", b.lease_ids),
    RestoreBegin: _restore,
    StorePut: lambda b: check_headers(b.columns),
}


def validate(body: Any) -> None:
    """Check the numbers of a decoded request body; services call it right after decoding.

    Raises:
        InvalidRequestError: an argument is out of range (NaN, infinite, negative, too
            large); the message names it.
    """
    check = _CHECKS.get(type(body))
    if check is not None:
        check(body)
