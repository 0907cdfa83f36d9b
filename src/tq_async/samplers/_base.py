"""The sampler contract, identical to TransferQueue's so custom samplers port unchanged.

``sample(ready_indexes, batch_size, *args, **kwargs) -> (sampled, consumed)``

* ``ready_indexes``: rows of the partition that have every requested field and that the task
  has not consumed, in the order they became ready (a read-only sequence; prefix slices such as
  ``ready_indexes[:k]`` are O(k)).
* ``batch_size``: how many rows the caller asked for.
* ``sampled``: the rows handed to the caller (in this order).
* ``consumed``: the rows to mark consumed for the task (usually equal to ``sampled``; a
  with-replacement sampler returns ``[]``; a sampler that assigns rows to several ranks at once
  consumes all of them on the first call).

Returning ``([], [])`` means "not enough yet": the controller waits for the partition's next
readiness event and calls again; it never polls on a timer. ``sample`` may be ``async def``.

As in TransferQueue, the controller calls a sampler only once at least ``batch_size`` rows are
ready (``batch_size * dp_size`` for a global batch) or the partition is final, unless the
sampler's `short_ready_ok` is True (tq_async's own samplers: they are asked
on every readiness event and decide themselves, e.g. whole GRPO groups out of order).

The controller passes context as keyword arguments (a sampler whose ``sample`` does not take
``**kwargs`` only receives those it names):

``partition_id``, ``task_name``, ``data_fields``
    what was asked for;
``dp_rank``, ``batch_index``
    from the caller's ``sampling_config`` (``None`` when absent);
``sampling_config``
    the caller's whole ``sampling_config`` dict; each of its entries also arrives as a
    keyword of its own (as TransferQueue passes them), unless it clashes with a name here;
``tags``
    read-only ``row -> Mapping`` view of every row's tags (e.g. ``uid``, ``total_lengths``);
``origin``
    read-only ``row -> (first_row_of_its_put, offset_in_that_put)``;
``final``
    True when no more rows can become ready (the partition is sealed and nothing is still
    being produced): a sampler may then return a short last batch.
``replays_served``
    True when the controller records this batch under its ``batch_index`` (a recorded
    batch) and serves repeats itself (a cache needs one read per entry, not one per replica).
``peek``
    True for ``get_meta(mode="peek")``: nothing is consumed or handed out, so a sampler
    that remembers its answers (a cache of shares) neither stores this one nor counts it as
    a read.
``policy_version``, ``versions``, ``stale``
    the learner's announced policy version (-1: none), a read-only ``row -> version`` view
    (-1: none; a row's oldest field version), and a `StaleRows` sink
    for reporting stale rows (see `StalenessSampler`).
``row_hosts``, ``rank_host``, ``rank_hosts``
    locality (a preference, never needed for correctness): a read-only ``row -> host id``
    view (the host of the unit holding the row; ``""``: unknown), the asking rank's host
    id, and for a global batch each rank's host id in rank order (``""``: not known yet;
    all ``""`` with ``placement="round_robin"``). A sampler that splits a global batch by
    locality itself says so with `locality_aware`; otherwise the controller hands its
    shares to ranks by host afterwards.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

import msgspec

from .._errors import InvalidRequestError, UnsupportedTypeError
from .._wire._checks import MAX_INT, as_int

__all__ = [
    "BaseSampler",
    "SampleResult",
    "SharesResult",
    "WrappingSampler",
    "check_context",
    "inner_sampler",
    "int_arg",
    "share_arg",
    "tag_name",
]

SampleResult = tuple[list[int], list[int]]
#: ``(shares, consumed)``: one list of rows per DP rank, and the rows to mark consumed
SharesResult = tuple[list[list[int]], list[int]]


def _index(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidRequestError(f"a sampler needs {name} as an integer >= {low}, got {value!r}")


def check_context(batch_size: Any, kwargs: Mapping[str, Any], dp_size: Any = None) -> None:
    """Refuse a context no request could carry: what ``get_meta`` checks before the
    controller calls a sampler, checked again for a sampler called directly (as
    TransferQueue's tests and users do).

    Raises:
        InvalidRequestError: ``batch_size`` or ``dp_size`` below 1, ``dp_rank`` or
            ``batch_index`` negative or not an int, ``dp_rank`` not below ``dp_size``.
    """
    if type(batch_size) is not int or batch_size < 1:
        _index("batch_size", batch_size, 1)
    dp_rank = kwargs.get("dp_rank")
    if dp_rank is None and kwargs.get("batch_index") is None and dp_size is None:
        cfg = kwargs.get("sampling_config")
        if not cfg or cfg.get("dp_size") is None:
            return  # the common pooled fetch: nothing more to check
    if dp_rank is not None:
        _index("dp_rank", dp_rank, 0)
    if (batch_index := kwargs.get("batch_index")) is not None:
        _index("batch_index", batch_index, 0)
    if dp_size is None:
        cfg = kwargs.get("sampling_config")
        dp_size = cfg.get("dp_size") if isinstance(cfg, Mapping) else None
    if dp_size is not None:
        _index("dp_size", dp_size, 1)
        if dp_rank is not None and dp_rank >= dp_size:
            raise InvalidRequestError(
                f"a sampler got dp_rank {dp_rank} for dp_size {dp_size}; ranks are 0..{dp_size - 1}"
            )


class BaseSampler(ABC):
    """Base class of samplers; subclasses implement `sample` (abstract, as in
    TransferQueue: ``BaseSampler()`` is a ``TypeError``).

    Stateful samplers also override `clear_partition` (drop everything cached for a
    partition), `state_dict` and `load_state_dict`.

    TransferQueue's sampler surface is here too, so its custom samplers run unchanged:
    ``self._states`` (a dict; by convention the cache
    ``_states[partition_id][task_name][dp_rank][batch_index]``), `has_cached_result`,
    `clear_cache` (the controller calls it when a partition is cleared; `reset_partition`
    drops a task's entries when its consumption is reset),
    `save_checkpoint` / `load_checkpoint` (their state goes into tq_async
    checkpoints through the default `state_dict`), and calling the sampler forwards to
    `sample`.
    """

    def __init__(self) -> None:
        self._states: dict[Any, Any] = {}

    @property
    def _states(self) -> dict[Any, Any]:
        # created on first use too, for subclasses whose __init__ skips super().__init__()
        return self.__dict__.setdefault("_states", {})  # type: ignore[no-any-return]

    @_states.setter
    def _states(self, value: dict[Any, Any]) -> None:
        self.__dict__["_states"] = value

    def __call__(
        self, ready_indexes: Sequence[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> SampleResult | Awaitable[SampleResult]:
        """``sampler(...)`` is ``sampler.sample(...)`` (as in TransferQueue)."""
        return self.sample(ready_indexes, batch_size, *args, **kwargs)

    def has_cached_result(
        self, partition_id: str, task_name: str, sampling_config: Mapping[str, Any] | None = None
    ) -> bool:
        """True when ``_states`` holds an entry for the ``dp_rank`` and ``batch_index`` of
        ``sampling_config`` under ``partition_id`` and ``task_name`` (False without a
        ``dp_rank``)."""
        cfg = sampling_config or {}
        dp_rank = cfg.get("dp_rank")
        if dp_rank is None:
            return False
        by_rank = self._states.get(partition_id, {}).get(task_name, {})
        return dp_rank in by_rank and cfg.get("batch_index") in by_rank[dp_rank]

    def clear_cache(self, partition_id: str) -> None:
        """Drop ``_states[partition_id]`` (the controller calls this when the partition is
        cleared, after `clear_partition`)."""
        self._states.pop(partition_id, None)

    def save_checkpoint(self) -> dict[str, Any]:
        """TransferQueue's checkpoint hook: the sampler's state (``{"_states": ...}`` by
        default). Values must be msgpack-able (str/int/float/bool/None/bytes/list/dict)."""
        return {"_states": self._states}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        """Restore what `save_checkpoint` returned."""
        self._states = dict(state.get("_states", {}))

    @abstractmethod
    def sample(
        self, ready_indexes: Sequence[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> SampleResult | Awaitable[SampleResult]:
        """Choose rows for one request; see the module docstring for the contract."""

    def sample_shares(
        self, ready_indexes: Sequence[int], batch_size: int, dp_size: int, **kwargs: Any
    ) -> SharesResult | Awaitable[SharesResult] | None:
        """Choose one global batch for ``dp_size`` ranks at once (collective-safe mode).

        The controller calls this when a request's ``sampling_config`` carries ``dp_size``
        (or the sampler was built for several ranks, see `dp_size_hint`), once per
        ``batch_index``, and records every rank's share before any rank reads its own. It
        then applies the tail policy to shares of unequal length.

        Returns:
            ``(shares, consumed)`` with ``dp_size`` shares (``([], [])``: not enough yet), or
            None (the default): the controller asks `sample` for ``batch_size *
            dp_size`` rows and cuts them in order into ``dp_size`` shares, keeping runs of
            `group_size` rows together.
        """
        return None

    @property
    def short_ready_ok(self) -> bool:
        """False (the default, TransferQueue's contract): the controller calls `sample`
        only once ``batch_size`` rows are ready (``batch_size * dp_size`` for a global batch)
        or the partition is final. True: on every readiness event, with however many rows are
        ready (the sampler returns ``([], [])`` to wait). tq_async's own samplers are True; a
        custom sampler that hands out short batches on purpose sets ``short_ready_ok = True``
        in its class body."""
        return False

    @property
    def group_size(self) -> int:
        """Rows that must stay together when a global batch is split across ranks."""
        return 1

    @property
    def locality_aware(self) -> bool:
        """True when `sample_shares` already gives ``shares[r]`` to rank ``r`` by where rows
        live (``row_hosts`` / ``rank_hosts``): the controller then keeps that order. False
        (the default): the controller hands the shares to ranks by host itself
        (`tq_async._core._assign`), which only permutes them."""
        return False

    @property
    def group_tag(self) -> tuple[str, int] | None:
        """``(tag, n)`` when the sampler groups rows by a tag: at most ``n`` rows of a
        partition share one value of ``tag`` (None, the default: tags group nothing).

        The controller refuses a put (or ``set_tags``) that would give one value more rows,
        so two prompts under one ``uid`` never mix into a group.
        """
        return None

    @property
    def dp_size_hint(self) -> int | None:
        """The number of DP ranks the sampler was built for (None: any)."""
        return None

    @property
    def tail_policy(self) -> str | None:
        """The tail policy the sampler was built with (None: the caller's, ``"uneven"``)."""
        return None

    def clear_partition(self, partition_id: str) -> None:
        """Forget everything cached for ``partition_id`` (called when it is cleared)."""
        return None

    def reset_partition(self, partition_id: str, task_name: str | None) -> None:
        """Forget cached assignments after ``reset_consumption`` (all tasks when None): by
        default ``_states[partition_id][task_name]`` (``_states[partition_id]`` when None),
        the TransferQueue cache of a new epoch's batches."""
        by_task = self._states.get(partition_id)
        if task_name is None:
            self._states.pop(partition_id, None)
        elif isinstance(by_task, dict):
            by_task.pop(task_name, None)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state, for checkpoints (msgpack-able values only).

        By default, what `save_checkpoint` returns (when it holds anything).

        Raises:
            UnsupportedTypeError: that state holds values msgpack cannot carry.
        """
        state = self.save_checkpoint()
        if state == {"_states": {}}:
            return {}
        try:
            msgspec.msgpack.encode(state)
        except (TypeError, ValueError, OverflowError) as exc:
            raise UnsupportedTypeError(
                f"sampler {type(self).__name__}: its save_checkpoint() state cannot be stored "
                f"in a checkpoint ({exc}); return plain values (str/int/float/bool/None/bytes/"
                "list/dict) from save_checkpoint, e.g. an RNG's get_state() as a list"
            ) from None
        return {"save_checkpoint": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        if "save_checkpoint" in state:
            self.load_checkpoint(state["save_checkpoint"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class WrappingSampler(BaseSampler):
    """A sampler around an ``inner`` one: the traits the controller reads are ``inner``'s."""

    inner: BaseSampler

    def has_cached_result(
        self, partition_id: str, task_name: str, sampling_config: Mapping[str, Any] | None = None
    ) -> bool:
        """True when this sampler's ``_states`` or ``inner``'s holds the answer (a
        TransferQueue-style ``inner`` caching the shares of other ranks)."""
        if super().has_cached_result(partition_id, task_name, sampling_config):
            return True
        has = getattr(self.inner, "has_cached_result", None)
        return bool(has is not None and has(partition_id, task_name, sampling_config))

    def clear_cache(self, partition_id: str) -> None:
        """Drop ``_states[partition_id]``, here and in ``inner``."""
        super().clear_cache(partition_id)
        clear = getattr(self.inner, "clear_cache", None)
        if clear is not None:
            clear(partition_id)

    @property
    def short_ready_ok(self) -> bool:
        """``inner``'s: it is what sees the ready rows."""
        return self.inner.short_ready_ok

    @property
    def group_size(self) -> int:
        """``inner``'s."""
        return self.inner.group_size

    @property
    def locality_aware(self) -> bool:
        """``inner``'s."""
        return bool(getattr(self.inner, "locality_aware", False))

    @property
    def group_tag(self) -> tuple[str, int] | None:
        """``inner``'s."""
        return self.inner.group_tag

    @property
    def dp_size_hint(self) -> int | None:
        """``inner``'s."""
        return self.inner.dp_size_hint

    @property
    def tail_policy(self) -> str | None:
        """``inner``'s."""
        return self.inner.tail_policy


def int_arg(name: str, value: Any, lo: int = 1, hi: int = MAX_INT, why: str = "") -> int:
    """A sampler's int argument ``name`` (numpy's ints too, as configs hold them) in
    ``[lo, hi]``, as a plain int; ``why`` says what it counts, for the error.

    Raises:
        InvalidRequestError: naming ``name``, for a float, a string, None, a bool or a value
            out of range (each was taken, or failed later with a bare TypeError).
    """
    n = value if type(value) is int else as_int(name, value)
    if n < lo:
        raise InvalidRequestError(f"{name} must be >= {lo}{why}, got {n}")
    if n > hi:
        raise InvalidRequestError(f"{name} must be at most {hi}{why}, got {n}")
    return n


def share_arg(name: str, value: Any) -> float:
    """A sampler's fraction argument ``name`` (numpy's floats too): a real number >= 0."""
    share = float(value) if isinstance(value, numbers.Real) else math.nan
    if isinstance(value, bool) or not share >= 0:
        raise InvalidRequestError(f"{name} must be a number >= 0 (0.05: 5 %), got {value!r}")
    return share


def tag_name(name: str, value: Any) -> str:
    """A sampler's tag name argument (``group_key``, ``length_key``): a string."""
    if not isinstance(value, str):
        raise InvalidRequestError(
            f"{name} must name a tag (a string), got {type(value).__name__} {value!r}"
        )
    return value


def inner_sampler(owner: str, inner: Any) -> BaseSampler | None:
    """A wrapping sampler's ``inner`` (None: the default): a sampler instance."""
    if inner is None or isinstance(inner, BaseSampler):
        return inner
    if isinstance(inner, type) and issubclass(inner, BaseSampler):
        raise InvalidRequestError(
            f"{owner}(inner=...) takes a sampler instance, got the class {inner.__name__}: "
            f"pass {inner.__name__}()"
        )
    raise InvalidRequestError(
        f"{owner}(inner=...) takes a sampler instance (a BaseSampler, e.g. "
        f"tq.SequentialSampler()), got {type(inner).__name__} {inner!r:.80}"
    )
