# Generated from src/tq_async/_client/_async/_query.py by scripts/unasync.py:
# do not edit; change the source and run `python scripts/unasync.py`.
"""A read's arguments, checked once: `MetaQuery`.

`get_meta`, `get` and
`get_batches` keep their explicit signatures (for users and type
checkers); each checks its arguments once with `meta_query` and passes the query down
the read path (`GetPath`), which reads them from it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

from ..._errors import InvalidRequestError
from ..._meta import BatchMeta, check_meta
from ..._paths._device_copy import check_device
from ..._wire._checks import (
    MAX_INT,
    as_seconds,
    check_also,
    check_flag,
    check_id,
    check_int,
    check_sampling_config,
    check_seconds,
)
from ..._wire._protocol import GetMeta
from ._base import as_int, check_fields

__all__ = ["MetaQuery", "check_nested", "lease_ids", "meta_query"]


class MetaQuery(NamedTuple):
    """The checked arguments of one read (see `get_meta`)."""

    fields: list[str]
    batch_size: int
    partition_id: str
    task_name: str
    #: a copy of the caller's ``sampling_config`` (None when empty)
    config: dict[str, Any] | None
    mode: str
    timeout: float | None
    stop_when_consumed: bool
    lease: float | None
    #: the lease ids of the batches this read acknowledges
    ack: list[int] | None
    #: the later batch indexes decided in the same round trip (``get_batches``)
    also: list[int] | None = None
    #: ``get_data``'s ``nested`` and ``device``, checked
    nested: bool | frozenset[str] = False
    device: Any = None
    #: ``get``: leave an auto-clear task's hold on the rows once they are read (the caller
    #: acknowledges them later)
    keep_hold: bool = False

    @property
    def batch_index(self) -> Any:
        """The ``batch_index`` the config names, if any."""
        return self.config.get("batch_index") if self.config else None

    @property
    def recorded(self) -> bool:
        """A fetch under a ``batch_index``: its rows stay recorded (replayable) even when the
        call is abandoned, so they are not released."""
        return self.mode == "fetch" and self.batch_index is not None

    def request(self, inline_bytes: int, host: str = "") -> GetMeta:
        """The controller's request, asking for cells inline up to ``inline_bytes``, from a
        client on ``host`` (see ``_transport/_hosts.py``)."""
        return GetMeta(
            self.partition_id,
            self.fields,
            self.batch_size,
            self.task_name,
            self.config,
            self.mode,
            self.timeout,
            self.stop_when_consumed,
            self.lease,
            self.ack,
            inline_bytes,
            self.also,
            host=host,
        )


def meta_query(
    data_fields: Sequence[str],
    batch_size: int,
    partition_id: str,
    task_name: str,
    sampling_config: Mapping[str, Any] | None = None,
    *,
    mode: str = "fetch",
    timeout: float | None = None,
    stop_when_consumed: bool = False,
    lease: float | None = None,
    ack: BatchMeta | Sequence[BatchMeta] | None = None,
    also: Sequence[int] | None = None,
    nested: bool | Collection[str] = False,
    device: Any = None,
    keep_hold: bool = False,
) -> MetaQuery:
    """Check a read's arguments (before anything is sent) into a `MetaQuery`.

    Raises:
        InvalidRequestError: an argument is not what the read takes (the message names it).
    """
    # (every get_meta runs this: a check whose argument is left at its default is skipped,
    # the defaults being valid)
    as_nested = nested if nested is False else check_nested(nested)
    target = None if device is None else check_device(device, here=True)
    fields = check_fields(data_fields)
    if type(batch_size) is not int or not 1 <= batch_size <= MAX_INT:
        batch_size = check_int("batch_size", batch_size, 1)
    task_name = check_id("task_name", task_name)
    partition_id = check_id("partition_id", partition_id)
    if mode != "fetch" and mode != "peek":
        raise InvalidRequestError(f"mode must be 'fetch' or 'peek', got {mode!r}")
    if timeout is not None:
        timeout = _check_timeout(timeout)
    if lease is not None:
        lease = check_seconds("lease", lease)
    cfg = None if sampling_config is None else _config(sampling_config)
    if cfg is not None:
        _check_dp_config(cfg)
        check_sampling_config(cfg)
    wanted = None if also is None else [as_int(j) for j in also]
    if wanted is not None:
        check_also(wanted, cfg, mode)
    return MetaQuery(
        fields,
        batch_size,
        partition_id,
        task_name,
        cfg,
        mode,
        timeout,
        stop_when_consumed
        if stop_when_consumed is False
        else check_flag("stop_when_consumed", stop_when_consumed),
        lease,
        None if ack is None else lease_ids(ack),
        wanted,
        as_nested,
        target,
        bool(keep_hold),
    )


def _check_timeout(timeout: Any) -> float:
    """A read's ``timeout`` other than None: finite seconds >= 0 (0: answer what is ready
    now), as a float."""
    seconds = as_seconds("timeout", timeout)
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidRequestError(
            f"timeout must be finite seconds >= 0 or None, got {timeout!r}; pass e.g. "
            "timeout=30, timeout=0 to answer only what is ready now, or timeout=None to wait "
            "without a deadline"
        )
    return seconds


def lease_ids(metas: Any) -> list[int] | None:
    """The lease ids of the leased batches among ``metas`` (a `BatchMeta` or a sequence of
    them; None when there are none).

    Raises:
        InvalidRequestError: ``metas`` is neither (the message names what it is).
    """
    if metas is None:
        return None
    if isinstance(metas, BatchMeta):
        return [metas.lease_id] if metas.lease_id else None
    if isinstance(metas, (str, bytes)) or not isinstance(metas, Sequence):
        check_meta(metas, "ack")  # (raises, naming what it got)
    return [m.lease_id for m in metas if check_meta(m, "ack").lease_id] or None


_TAILS = ("uneven", "drop", "error")
#: the ``sampling_config`` entries that are ints
_INT_KEYS = ("dp_rank", "dp_size", "batch_index", "record_from")


def _config(sampling_config: Any) -> dict[str, Any] | None:
    """A copy of a ``sampling_config`` (None when empty), checked to be a dict of names."""
    if not isinstance(sampling_config, Mapping):
        raise InvalidRequestError(
            f"sampling_config must be a dict, e.g. {{'dp_rank': 0, 'batch_index': 3}}, got "
            f"{type(sampling_config).__name__} {sampling_config!r:.80}"
        )
    for key in sampling_config:
        if not isinstance(key, str):
            raise InvalidRequestError(
                f"sampling_config's keys are names (strings), got {key!r} of type "
                f"{type(key).__name__}"
            )
    cfg = dict(sampling_config)
    for key in _INT_KEYS:  # numpy's ints (a rank from a config) as the ints they are
        value = cfg.get(key)
        if value is not None and type(value) is not int:
            cfg[key] = as_int(value)
    return cfg or None


def _check_dp_config(cfg: Mapping[str, Any] | None) -> None:
    """A ``sampling_config``'s ``dp_size`` and ``tail``, checked before anything is sent."""
    if not cfg or (cfg.get("dp_size") is None and "tail" not in cfg):
        return
    dp_size = cfg.get("dp_size")
    if dp_size is None:
        raise InvalidRequestError(
            "sampling_config sets 'tail' without 'dp_size': the tail policy shares the last "
            "global batch among dp_size ranks; add 'dp_size'"
        )
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise InvalidRequestError(
            f"sampling_config['dp_size'] must be a positive integer, got {dp_size!r}"
        )
    tail = cfg.get("tail", "uneven")
    if tail not in _TAILS:
        raise InvalidRequestError(
            f"sampling_config['tail'] must be one of {', '.join(map(repr, _TAILS))}, got {tail!r}"
        )
    for key in ("dp_rank", "batch_index"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidRequestError(
                f"sampling_config with dp_size needs {key!r} as a non-negative integer (batch "
                f"b is decided for all ranks at once), got {value!r}"
            )
    if cfg["dp_rank"] >= dp_size:
        raise InvalidRequestError(
            f"sampling_config['dp_rank'] {cfg['dp_rank']} is out of range for dp_size="
            f"{dp_size}; ranks are 0..{dp_size - 1}"
        )


def check_nested(nested: Any) -> bool | frozenset[str]:
    """``get_data``'s ``nested``: a bool, or the field names as a frozenset."""
    if isinstance(nested, bool):
        return nested
    if isinstance(nested, str) or not isinstance(nested, Collection):
        raise InvalidRequestError(
            f"nested must be True/False or a list of field names, got {nested!r}"
        )
    if not all(isinstance(f, str) for f in nested):
        raise InvalidRequestError(f"nested must list field names (strings), got {nested!r}")
    return frozenset(nested)
