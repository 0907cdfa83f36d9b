"""The arguments of the streaming datasets, checked: `AsyncStreamingDataset`'s and a
``state_dict`` to resume from (`parse_state`, which the torch adapter's main process uses
too)."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import InvalidRequestError

__all__ = ["check_args", "checked_name", "parse_state", "positive_int"]


def positive_int(name: str, value: Any, *, zero: bool = False) -> int:
    """``value`` as a plain int >= 1 (>= 0 with ``zero``); numpy's ints are taken (configs
    hold them)."""
    low = 0 if zero else 1
    n = value if type(value) is int else as_int(value)
    if type(n) is not int or n < low:
        kind = "a non-negative" if zero else "a positive"
        raise InvalidRequestError(f"{name} must be {kind} integer, got {value!r}")
    return n


def as_int(value: Any) -> Any:
    """An integral number (numpy's, a one-element integer tensor) as an int; anything else
    (a bool too) unchanged."""
    try:
        return value if isinstance(value, bool) else operator.index(value)
    except TypeError:
        return value


_TAILS = ("uneven", "drop", "error")


def field_list(data_fields: Any) -> Any:
    """``data_fields`` kept in a 1-D numpy array, as the list of its names (anything else as
    given: `check_args` checks it)."""
    if isinstance(data_fields, np.ndarray) and data_fields.ndim == 1:
        return data_fields.tolist()
    return data_fields


def check_args(
    address: Any,
    data_fields: Any,
    dp_rank: Any,
    sampling_config: Mapping[str, Any] | None,
    dp_size: int | None,
    tail: str | None,
    fetch_batch_fn: Any,
    process_batch_fn: Any,
) -> tuple[dict[str, Any], int | None, str | None]:
    """The dataset's arguments that need more than a type check: ``(sampling_config,
    dp_size, tail)`` once checked."""
    # (the torch adapter passes a blocking client's async-shaped view: anything with get_meta)
    if not isinstance(address, str) and not callable(getattr(address, "get_meta", None)):
        raise InvalidRequestError(
            f"address must be the controller's address or an AsyncClient, got "
            f"{type(address).__name__}"
        )
    if isinstance(address, str):
        checked_name("address", address)
    if isinstance(data_fields, str) or not isinstance(data_fields, Sequence):
        hint = repr(data_fields) if isinstance(data_fields, str) else "'input_ids', ..."
        raise InvalidRequestError(
            f"data_fields must be a list of field names, got {data_fields!r:.80}; "
            f"write data_fields=[{hint}]"
        )
    if not data_fields or not all(isinstance(f, str) and f for f in data_fields):
        raise InvalidRequestError(
            f"data_fields must be a non-empty list of non-empty strings, got {data_fields!r}"
        )
    dp_rank = positive_int("dp_rank", dp_rank, zero=True)
    config = dict(sampling_config or {})
    if "batch_index" in config:
        raise InvalidRequestError(
            "sampling_config must not set 'batch_index': the dataset sets it for every "
            "batch; use reset(), step() or load_state_dict() to move"
        )
    if config.get("dp_rank", dp_rank) != dp_rank:
        raise InvalidRequestError(
            f"sampling_config sets dp_rank={config['dp_rank']!r} but dp_rank={dp_rank!r}; "
            "pass the rank only as dp_rank"
        )
    dp_size, tail = _check_dp(dp_rank, dp_size, tail)
    for key, value in (("dp_size", dp_size), ("tail", tail)):
        if key in config and config[key] != value:
            raise InvalidRequestError(
                f"sampling_config sets {key}={config[key]!r} but the dataset's {key} is "
                f"{value!r}; pass it only as the dataset's {key}= argument"
            )
    for hook_name, hook in (
        ("fetch_batch_fn", fetch_batch_fn),
        ("process_batch_fn", process_batch_fn),
    ):
        if hook is not None and not callable(hook):
            raise InvalidRequestError(f"{hook_name} must be callable, got {hook!r}")
    return config, dp_size, tail


def _check_dp(dp_rank: Any, dp_size: Any, tail: Any) -> tuple[int | None, str | None]:
    """Validate ``dp_size`` and ``tail`` (and ``dp_rank`` against ``dp_size``)."""
    dp_rank = positive_int("dp_rank", dp_rank, zero=True)
    if tail is not None and tail not in _TAILS:
        raise InvalidRequestError(
            f"tail must be one of {', '.join(map(repr, _TAILS))} or None, got {tail!r}"
        )
    if dp_size is None:
        if tail is not None:
            raise InvalidRequestError(
                f"tail={tail!r} needs dp_size: the tail policy shares the last global batch "
                "among dp_size ranks; pass dp_size= as well"
            )
        return None, tail
    dp_size = positive_int("dp_size", dp_size)
    if dp_rank >= dp_size:
        raise InvalidRequestError(
            f"dp_rank {dp_rank} is out of range for dp_size={dp_size}; ranks are 0..{dp_size - 1}"
        )
    return dp_size, tail


def checked_name(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{name} must be a non-empty string, got {value!r}")
    return value


def parse_state(
    state: Mapping[str, Any],
    task_name: str,
    dp_rank: int,
    dp_size: int | None = None,
    micro_batch_size: int | None = None,
) -> tuple[str, int, int]:
    """Validate a ``state_dict``; return ``(partition_id, batch_index, micro_batch_index)``.

    A state without ``dp_size`` (saved before it existed) resumes under any ``dp_size``;
    one without ``micro_batch_size``, under any micro-batch size.
    """
    if not isinstance(state, Mapping):
        raise InvalidRequestError(
            f"load_state_dict needs the dict state_dict() returned, got {type(state).__name__}"
        )
    if state.get("version") != 1:
        raise InvalidRequestError(
            f"unknown dataset state version {state.get('version')!r}; it was not saved by "
            "this version's state_dict()"
        )
    if state.get("task_name") != task_name or state.get("dp_rank") != dp_rank:
        raise InvalidRequestError(
            f"the state was saved by task {state.get('task_name')!r} dp_rank "
            f"{state.get('dp_rank')!r}, but this dataset reads task {task_name!r} dp_rank "
            f"{dp_rank}; build the dataset with the same task_name and dp_rank to resume"
        )
    if state.get("dp_size", dp_size) != dp_size:
        raise InvalidRequestError(
            f"the state was saved with dp_size={state.get('dp_size')!r}, but this dataset has "
            f"dp_size={dp_size!r}; the recorded global batches were shared among that many "
            "ranks, so resume with the same dp_size"
        )
    try:
        partition_id = checked_name("partition_id", state["partition_id"])
        index = positive_int("batch_index", state["batch_index"], zero=True)
        micro = positive_int("micro_batch_index", state["micro_batch_index"], zero=True)
    except KeyError as exc:
        raise InvalidRequestError(f"the dataset state lacks {exc}; pass state_dict()") from None
    saved = state.get("micro_batch_size", micro_batch_size)
    if micro and saved != micro_batch_size:
        raise InvalidRequestError(
            f"the state was saved after {micro} micro-batches of batch {index} with "
            f"micro_batch_size={saved!r}, but this dataset has micro_batch_size="
            f"{micro_batch_size!r}: its micro-batches would cut the batch elsewhere (rows "
            "skipped or delivered twice); resume with the same micro_batch_size, or from a "
            "state saved at a batch boundary (micro_batch_index 0)"
        )
    return partition_id, index, micro
