"""Identical rows for every reader of one ``(dp_rank, batch_index)``, whoever asks first.

Tensor- and pipeline-parallel ranks of one data-parallel group must train on the same rows.
They ask independently and in any order; the first to ask for a ``batch_index`` runs the
inner sampler and the others get a copy of its answer.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import anyio

from ._base import (
    BaseSampler,
    SampleResult,
    SharesResult,
    WrappingSampler,
    check_context,
    inner_sampler,
    int_arg,
)
from ._cache import ShareCache, reads_needed
from ._sequential import SequentialSampler

__all__ = ["RankAwareSampler"]

_Key = tuple[str, str, int, int]


class _Flight:
    """A first request whose async inner call is still running."""

    __slots__ = ("epoch", "finished", "pending", "runner", "sampled", "waiters")

    def __init__(self, epoch: int, pending: Awaitable[SampleResult]) -> None:
        self.epoch = epoch
        self.finished = False
        self.sampled: list[int] = []
        self.waiters: list[anyio.Event] = []
        #: the inner call, and the coroutine awaiting it (what `sample` returned)
        self.pending = pending
        self.runner: Coroutine[Any, Any, SampleResult] | None = None

    def abandoned(self) -> bool:
        """The coroutine `sample` returned was closed before it ran (e.g. the controller
        dropped a batch asked for ahead): it will never finish, so the inner call is closed
        too and the key is free again."""
        runner = self.runner
        if self.finished or runner is None:
            return False
        if inspect.getcoroutinestate(runner) != inspect.CORO_CLOSED:
            return False
        if inspect.iscoroutine(self.pending):
            self.pending.close()
        return True


def kwargs_filter(fn: Callable[..., Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """What the controller does for us: pass a sampler only the keywords it accepts."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins / C callables: pass everything
        return lambda kw: kw
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return lambda kw: kw
    names = frozenset(
        p.name
        for p in params
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )
    return lambda kw: {k: v for k, v in kw.items() if k in names}


class RankAwareSampler(WrappingSampler):
    """Every request for one ``(partition_id, task_name, dp_rank, batch_index)`` gets the same rows.

    The first request for a key (from any replica of the rank, in any order) calls ``inner``
    and caches its ``sampled`` rows; it returns ``(sampled, consumed)``, so the rows are
    consumed once. Later requests for the key get ``(sampled, [])``. Requests without a
    ``dp_rank`` or ``batch_index`` go straight to ``inner``; an empty answer from ``inner``
    ("not enough yet") is not cached.

    If ``inner.sample`` is ``async def``, `sample` returns an awaitable, and concurrent
    requests for a key that is still being sampled wait for the first one instead of sampling
    again.

    The cache is bounded: an entry is dropped after ``n_replicas`` reads (after the first read
    when the controller passes ``replays_served=True``, as it then serves repeats itself),
    when its partition is cleared or its task's consumption is reset, and, oldest first with
    a warning, when more than ``max_entries`` are held.

    Args:
        inner: the sampler that picks the rows (default `SequentialSampler`).
        n_replicas: how many readers share each ``dp_rank`` (e.g. TP size x PP size).
        max_entries: the most keys kept at once.

    Raises:
        InvalidRequestError: (a ValueError) ``n_replicas`` or ``max_entries`` is no int
            (numpy's ints are taken) or below 1, or ``inner`` is no sampler instance.
    """

    def __init__(
        self,
        inner: BaseSampler | None = None,
        n_replicas: int = 1,
        max_entries: int = 65536,
    ) -> None:
        self.n_replicas = int_arg(
            "n_replicas", n_replicas, why=" (readers per dp_rank, e.g. tp_size * pp_size)"
        )
        inner = inner_sampler(type(self).__name__, inner)
        self.inner: BaseSampler = SequentialSampler() if inner is None else inner
        self._cache = ShareCache(int_arg("max_entries", max_entries), type(self).__name__)
        self._inner_kwargs = kwargs_filter(self.inner.sample)
        # Keys whose first (async) inner call is still running, so others wait instead of
        # sampling the same rows again.
        self._in_flight: dict[_Key, _Flight] = {}
        # Bumped by clear/reset: an inner call that started before must not cache its answer.
        self._epoch = 0

    @property
    def cache_size(self) -> int:
        """Number of keys currently cached."""
        return len(self._cache)

    def sample(
        self, ready_indexes: Sequence[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> SampleResult | Awaitable[SampleResult]:
        """Answer from the cache, or ask ``inner`` and cache; see the class docstring.

        Cancelling the awaitable (async ``inner`` only) caches nothing; waiting readers of the
        same key then ask ``inner`` themselves. Closed unawaited (``close()``), it closes
        ``inner``'s call, and the next request for the key asks ``inner`` again.

        Args:
            ready_indexes: ready rows in the order they became ready.
            batch_size: rows wanted.
            *args: passed to ``inner``.
            **kwargs: controller context; ``partition_id``, ``task_name``, ``dp_rank`` and
                ``batch_index`` form the key, ``replays_served`` sets the read count, and all
                that ``inner.sample`` accepts is passed on.

        Returns:
            ``(sampled, consumed)`` for the first request of a key, ``(sampled, [])`` for the
            others; an awaitable of that when ``inner`` is async.
        """
        check_context(batch_size, kwargs)
        dp_rank, batch_index = kwargs.get("dp_rank"), kwargs.get("batch_index")
        if dp_rank is None or batch_index is None:
            return self.inner.sample(ready_indexes, batch_size, *args, **self._inner_kwargs(kwargs))
        key: _Key = (
            kwargs.get("partition_id", ""),
            kwargs.get("task_name", ""),
            dp_rank,
            batch_index,
        )
        if kwargs.get("peek"):  # nothing is handed out: neither counted nor cached
            cached = self._cache.peek(key, 0)
            if cached is not None:
                return cached, []
            return self.inner.sample(ready_indexes, batch_size, *args, **self._inner_kwargs(kwargs))
        cached = self._cache.read(key, 0)
        if cached is not None:
            return cached, []
        flight = self._in_flight.get(key)
        if flight is not None and flight.abandoned():
            del self._in_flight[key]
            flight = None
        if flight is not None:
            return self._wait_and_sample(flight, key, ready_indexes, batch_size, args, kwargs)
        result = self.inner.sample(ready_indexes, batch_size, *args, **self._inner_kwargs(kwargs))
        reads = reads_needed(self.n_replicas, kwargs)
        if inspect.isawaitable(result):
            flight = self._in_flight[key] = _Flight(self._epoch, result)
            runner = flight.runner = self._finish(key, flight, result, reads)
            return runner
        return self._store(key, result, reads, self._epoch)

    async def _finish(
        self, key: _Key, flight: _Flight, pending: Awaitable[SampleResult], reads: int
    ) -> SampleResult:
        try:
            result = await pending
            flight.sampled = list(result[0])
            return self._store(key, result, reads, flight.epoch)
        finally:
            flight.finished = True
            if self._in_flight.get(key) is flight:
                del self._in_flight[key]
            for waiter in flight.waiters:
                waiter.set()

    async def _wait_and_sample(
        self,
        flight: _Flight,
        key: _Key,
        ready_indexes: Sequence[int],
        batch_size: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> SampleResult:
        if not flight.finished:  # it may have finished before this coroutine first ran
            # Created here, inside the event loop, so sample() itself needs no running loop.
            done = anyio.Event()
            flight.waiters.append(done)
            await done.wait()
        if flight.sampled and flight.epoch == self._epoch:
            # Same rows as the first reader; count the read if the entry is still cached.
            cached = self._cache.read(key, 0)
            return (cached if cached is not None else list(flight.sampled)), []
        # The first reader got nothing, was cancelled, or the partition was reset: start over.
        result = self.sample(ready_indexes, batch_size, *args, **kwargs)
        if inspect.isawaitable(result):
            return await result
        return result

    def _store(self, key: _Key, result: SampleResult, reads: int, epoch: int) -> SampleResult:
        sampled, consumed = result
        if sampled and reads > 1 and epoch == self._epoch:
            self._cache.add(key, {0: list(sampled)}, {0: reads - 1})
        return list(sampled), list(consumed)

    def sample_shares(
        self, ready_indexes: Sequence[int], batch_size: int, dp_size: int, **kwargs: Any
    ) -> SharesResult | Awaitable[SharesResult] | None:
        """``inner``'s: the controller records a global batch for every rank itself."""
        check_context(batch_size, kwargs, dp_size)
        return self.inner.sample_shares(ready_indexes, batch_size, dp_size, **kwargs)

    def clear_partition(self, partition_id: str) -> None:
        """Drop every cached key of ``partition_id`` (and tell ``inner``).

        Args:
            partition_id: the partition being cleared.
        """
        self._epoch += 1
        self._cache.clear(partition_id)
        self._forget_abandoned()
        self.inner.clear_partition(partition_id)

    def reset_partition(self, partition_id: str, task_name: str | None) -> None:
        """Drop the cached keys of ``task_name`` (all tasks when None) in ``partition_id``.

        Args:
            partition_id: the partition whose consumption was reset.
            task_name: the task reset, or None for every task.
        """
        self._epoch += 1
        self._cache.clear(partition_id, task_name)
        self._forget_abandoned()
        self.inner.reset_partition(partition_id, task_name)

    def _forget_abandoned(self) -> None:
        """Drop the in-flight marks of calls that will never run (see `_Flight.abandoned`)."""
        for key in [k for k, f in self._in_flight.items() if f.abandoned()]:
            del self._in_flight[key]

    def state_dict(self) -> dict[str, Any]:
        """The cached keys and rows plus ``inner``'s state (msgpack-able).

        Returns:
            ``{"entries": [...], "inner": inner.state_dict()}``.
        """
        return {"entries": self._cache.state_dict(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned.

        Args:
            state: a previous `state_dict`.
        """
        self._cache.load_state_dict(list(state.get("entries", [])))
        self.inner.load_state_dict(dict(state.get("inner", {})))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.inner!r}, n_replicas={self.n_replicas}, "
            f"max_entries={self._cache.max_entries})"
        )
