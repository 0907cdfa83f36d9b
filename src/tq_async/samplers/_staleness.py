"""Bounded staleness for asynchronous RL: never hand out rows produced by too old a policy."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

from .._errors import InvalidRequestError
from .._logging import get_logger
from ._base import (
    BaseSampler,
    SampleResult,
    SharesResult,
    WrappingSampler,
    check_context,
    inner_sampler,
    int_arg,
)
from ._sequential import SequentialSampler

__all__ = ["StaleRows", "StalenessSampler"]

log = get_logger(__name__)

_POLICIES = ("drop", "recycle", "keep")


class StaleRows:
    """Where a sampler reports stale rows (the controller passes one as ``stale=``).

    After the sampler returns, the controller marks dropped and recycled rows consumed for the
    task (in ``"fetch"`` mode), queues recycled rows' prompts for regeneration, and counts
    each policy in its staleness status and metrics -- events that happened, once each: a
    row dropped or recycled when it is consumed, a kept row when it is delivered (not each
    time a sampler sees it while a request waits, nor in ``"peek"`` mode).

    Attributes:
        dropped: rows reported by `drop`.
        recycled: rows reported by `recycle`.
        kept_rows: rows reported by `keep`.
        kept: how many rows `keep` reported.
    """

    __slots__ = ("dropped", "kept", "kept_rows", "recycled")

    def __init__(self) -> None:
        self.dropped: list[int] = []
        self.recycled: list[int] = []
        self.kept_rows: list[int] = []
        self.kept = 0

    def drop(self, rows: Sequence[int]) -> None:
        """These rows are discarded (consumed, never delivered)."""
        self.dropped.extend(rows)

    def recycle(self, rows: Sequence[int]) -> None:
        """These rows are discarded and their prompts queued for regeneration (once each)."""
        self.recycled.extend(rows)

    def keep(self, rows: Sequence[int] | int) -> None:
        """These stale rows may be delivered anyway: those delivered are counted, with a
        warning. (An int, the older form, reports a count without the rows: counted as is.)"""
        if isinstance(rows, int):
            self.kept += rows
            return
        self.kept_rows.extend(rows)
        self.kept += len(rows)

    def __bool__(self) -> bool:
        return bool(self.dropped or self.recycled or self.kept)


class StalenessSampler(WrappingSampler):
    """Filters out rows whose policy version lags the learner's by more than ``max_staleness``.

    A row's version is the oldest version among its fields (``put(..., policy_version=v)``);
    the learner announces its own with ``set_policy_version``. Rows with
    ``learner_version - row_version > max_staleness`` are stale and handled by ``on_stale``:

    ``"drop"``
        consumed without being delivered;
    ``"recycle"``
        as drop, and the rows are queued so producers regenerate their prompts
        (``take_recycled``), each exactly once;
    ``"keep"``
        delivered anyway, with a warning and a count.

    The remaining rows go to ``inner`` (any sampler: GRPO, RankAware, SeqlenBalanced, ...).
    Rows without a version are never stale. Cost: one pass over the ready rows per call.

    Args:
        inner: the sampler choosing among fresh rows (`SequentialSampler` by default).
        max_staleness: the largest allowed ``learner_version - row_version`` (>= 0).
        on_stale: ``"drop"``, ``"recycle"`` or ``"keep"``.
    """

    def __init__(
        self,
        inner: BaseSampler | None = None,
        max_staleness: int = 0,
        on_stale: str = "drop",
    ) -> None:
        max_staleness = int_arg("max_staleness", max_staleness, 0)
        if on_stale not in _POLICIES:
            raise InvalidRequestError(f"on_stale must be one of {_POLICIES}, got {on_stale!r}")
        inner = inner_sampler(type(self).__name__, inner)
        self.inner = inner if inner is not None else SequentialSampler()
        self.max_staleness = max_staleness
        self.on_stale = on_stale
        params = inspect.signature(self.inner.sample).parameters.values()
        self._inner_takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self._inner_names = {p.name for p in params}

    def sample(
        self, ready_indexes: Sequence[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> SampleResult | Awaitable[SampleResult]:
        """Split ready rows into fresh and stale, report the stale, let ``inner`` choose."""
        check_context(batch_size, kwargs)
        learner = kwargs.get("policy_version")
        versions: Mapping[int, int] | None = kwargs.get("versions")
        sink: StaleRows | None = kwargs.get("stale")
        candidates: Sequence[int] = ready_indexes
        if learner is not None and learner >= 0 and versions is not None:
            oldest_ok = learner - self.max_staleness
            stale = [r for r in ready_indexes if 0 <= versions[r] < oldest_ok]
            if stale:
                if self.on_stale == "keep":
                    if sink is not None:
                        sink.keep(stale)  # the controller warns about those it delivers
                    else:
                        log.warning(
                            "stale rows may be delivered",
                            rows=len(stale),
                            learner_version=learner,
                            max_staleness=self.max_staleness,
                        )
                else:
                    if sink is not None:
                        (sink.drop if self.on_stale == "drop" else sink.recycle)(stale)
                    gone = set(stale)
                    candidates = [r for r in ready_indexes if r not in gone]
        inner_kwargs = (
            kwargs
            if self._inner_takes_kwargs
            else {k: v for k, v in kwargs.items() if k in self._inner_names}
        )
        return self.inner.sample(candidates, batch_size, *args, **inner_kwargs)

    def sample_shares(
        self, ready_indexes: Sequence[int], batch_size: int, dp_size: int, **kwargs: Any
    ) -> SharesResult | Awaitable[SharesResult] | None:
        """``inner``'s global batch among fresh rows (None when ``inner`` has none).

        Stale rows are reported only when ``inner`` chooses here: when it returns None the
        controller calls `sample`, which reports them itself.
        """
        check_context(batch_size, kwargs, dp_size)
        learner = kwargs.get("policy_version")
        versions: Mapping[int, int] | None = kwargs.get("versions")
        sink: StaleRows | None = kwargs.get("stale")
        stale: list[int] = []
        if learner is not None and learner >= 0 and versions is not None:
            oldest_ok = learner - self.max_staleness
            stale = [r for r in ready_indexes if 0 <= versions[r] < oldest_ok]
        candidates: Sequence[int] = ready_indexes
        if stale and self.on_stale != "keep":
            gone = set(stale)
            candidates = [r for r in ready_indexes if r not in gone]
        result = self.inner.sample_shares(candidates, batch_size, dp_size, **kwargs)
        if result is not None and sink is not None and stale:
            # kept rows: the controller counts (and warns about) those it delivers
            policy = {"drop": sink.drop, "recycle": sink.recycle, "keep": sink.keep}
            policy[self.on_stale](stale)
        return result

    def clear_partition(self, partition_id: str) -> None:
        """Forward to ``inner``."""
        self.inner.clear_partition(partition_id)

    def reset_partition(self, partition_id: str, task_name: str | None) -> None:
        """Forward to ``inner``."""
        self.inner.reset_partition(partition_id, task_name)

    def state_dict(self) -> dict[str, Any]:
        """``inner``'s state."""
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``inner``'s state."""
        self.inner.load_state_dict(state.get("inner", {}))

    def __repr__(self) -> str:
        return (
            f"StalenessSampler({self.inner!r}, max_staleness={self.max_staleness}, "
            f"on_stale={self.on_stale!r})"
        )
