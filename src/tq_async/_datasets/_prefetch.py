"""The prefetcher of `AsyncStreamingDataset`: batches read ahead, in order.

One background task (a *producer*), started in the dataset's task group, loads batches
``index, index + stride, ...`` into a bounded memory stream; the dataset takes them from the
other end, one per call to `Prefetcher.next`. The prefetcher knows no client, partition
or tensor: it asks its owner where the position is (``position()``) and how to load a batch
(``load(index, generation)``), so it is tested alone with plain objects
(``tests/datasets/test_prefetch.py``).

Invariants:

* at most ``depth`` batches are loaded ahead of the one being delivered: the stream holds
  ``depth - 1`` items and the producer holds one more while it waits to send;
* batches come out in index order from the position; an item for another index (a move
  while it was on its way, or a hand-off lost to a cancellation) restarts the producer at
  the position, never delivers out of order;
* a load that raises is handed over and raised by `Prefetcher.next` at the position it
  happened; the producer stops, and the next call starts a new one at the same index.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeAlias, TypeVar

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._logging import get_logger

__all__ = ["Prefetcher"]

log = get_logger(__name__)

T = TypeVar("T")

#: ``load(index, generation)``: the batch at ``index``, None at the end of the stream
LoadFn: TypeAlias = Callable[[int, int], Awaitable[T | None]]

#: ``position() -> (index, generation, stride)``: where the owner's delivery stands now
PositionFn: TypeAlias = Callable[[], tuple[int, int, int]]


@dataclass(slots=True)
class _Loaded(Generic[T]):
    """The batch at ``index`` (producer -> consumer); ``batch`` None: the stream ended there."""

    index: int
    batch: T | None


@dataclass(slots=True)
class _Failed:
    """Loading raised; the consumer re-raises it at the same position."""

    error: Exception


@dataclass(slots=True)
class _Producer(Generic[T]):
    scope: anyio.CancelScope
    receive: MemoryObjectReceiveStream[_Loaded[T] | _Failed]


class Prefetcher(Generic[T]):
    """Batches loaded ahead of the position by one task, at most ``depth`` of them.

    Args:
        depth: batches loaded ahead of the one being delivered (positive).
        load: ``async load(index, generation)``: the batch at ``index``; None at the end
            of the stream. ``generation`` is the owner's, read when the producer started.
        position: ``position() -> (index, generation, stride)``: the owner's next batch
            index, its generation (bumped by every move) and the step between indexes.
    """

    def __init__(self, depth: int, load: LoadFn[T], position: PositionFn) -> None:
        self.depth = depth
        self._load = load
        self._position = position
        self._producer: _Producer[T] | None = None

    @property
    def running(self) -> bool:
        """Whether a producer is loading (or holds batches loaded ahead)."""
        return self._producer is not None

    async def next(self, tg: TaskGroup) -> T | None:
        """The batch at the owner's position; None at the end of the stream.

        Starts a producer in ``tg`` at the position when none runs. If the owner moves while
        this waits (`drop`), it carries on from the new position.

        Raises:
            Exception: whatever ``load`` raised for the batch at the position (the producer
                is dropped; calling again loads that batch again).

        Cancellation: the producer carries on; a batch it hands over after the cancellation
        is taken by the next call (or, if lost, makes the next call restart the producer).
        """
        while True:
            producer = self._producer or self._start(tg)
            try:
                item = await producer.receive.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                # the producer was dropped (a move) while we waited: start over
                if self._producer is producer:
                    self.drop()
                continue
            if self._producer is not producer:
                continue  # moved while this item was on its way
            if isinstance(item, _Failed):
                self.drop()
                raise item.error
            index = self._position()[0]
            if item.index != index:
                # Defensive: a hand-off lost to a cancellation would show up here. The batch
                # is recorded under its index; restart the producer at the position.
                log.debug("prefetch out of step, restarting", expected=index, got=item.index)
                self.drop()
                continue
            if item.batch is None:
                self.drop()
            return item.batch

    def drop(self) -> None:
        """Stop the producer and forget what it loaded ahead (the owner moved, or left)."""
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.scope.cancel()
            producer.receive.close()

    def _start(self, tg: TaskGroup) -> _Producer[T]:
        index, generation, _ = self._position()
        send, receive = anyio.create_memory_object_stream[_Loaded[T] | _Failed](self.depth - 1)
        producer = _Producer(anyio.CancelScope(), receive)
        self._producer = producer
        tg.start_soon(self._produce, producer.scope, send, index, generation)
        return producer

    async def _produce(
        self,
        scope: anyio.CancelScope,
        send: MemoryObjectSendStream[_Loaded[T] | _Failed],
        index: int,
        generation: int,
    ) -> None:
        """Load batches ``index, index + stride, ...`` into ``send`` until end or cancel."""
        with send, scope:
            while True:
                item: _Loaded[T] | _Failed
                try:
                    item = _Loaded(index, await self._load(index, generation))
                except Exception as exc:  # handed to the consumer, raised where it reads
                    log.debug("fetch failed", batch_index=index, error=repr(exc))
                    item = _Failed(exc)
                try:
                    await send.send(item)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return  # the consumer dropped this producer
                if isinstance(item, _Failed) or item.batch is None:
                    return
                index += self._position()[2]
