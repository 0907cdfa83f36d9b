"""``client.watch()``: the controller's events as an async iterator.

A `Watcher` long-polls the controller (`WatchNext`):
each request asks for the events after the last one it got and returns once some match, so
nothing is pushed and nothing is held between requests. Breaking out of the loop or
cancelling it leaves nothing behind: a request still waiting is cancelled on the controller.
`Watcher.incarnation` and `Watcher.seq` say where it stands; a new watch with
``since=seq, incarnation=incarnation`` goes on from there, with no gap and no duplicate, or
starts with one `Resync` when the controller cannot tell the
events in between.

Watchers of one client with the same filter share their requests (`Feed`): those at the same
position wait for one answer, and one that comes later to a position the others passed takes
the answer they got, with no request.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence
from types import TracebackType

from ..._errors import InvalidRequestError
from ..._wire._checks import check_id, check_int, check_seconds
from ..._wire._events import EVENT_KINDS, AnyEvent, WatchBatch
from ..._wire._protocol import WatchNext
from ._base import Links, as_int
from ._feeds import Feed, Position

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover - depends on the Python version
    from typing_extensions import Self

__all__ = ["Watcher"]


class Watcher:
    """The iterator ``client.watch()`` returns (see the module docstring).

    ``async with client.watch() as events`` subscribes on entering, so that no event after
    that point is missed; a plain ``async for ev in client.watch()`` subscribes on its first
    step.
    """

    def __init__(
        self,
        links: Links,
        partition_id: str | None,
        kinds: Sequence[str] | None,
        since: int | None,
        incarnation: str | None,
        max_lag: int | None,
        poll: float,
    ) -> None:
        if partition_id is not None:
            partition_id = check_id("partition_id", partition_id)
        if kinds is not None:
            if isinstance(kinds, str):
                kinds = [kinds]
            unknown = [k for k in kinds if k not in EVENT_KINDS]
            if unknown:
                raise InvalidRequestError(
                    f"unknown event kinds {unknown}; the kinds are {list(EVENT_KINDS)}"
                )
        if since is not None:
            since = check_int("since", as_int(since))
        if max_lag is not None:
            max_lag = check_int("max_lag", as_int(max_lag), 1)
        self._links = links
        self._body = WatchNext(
            since,
            incarnation,
            partition_id,
            None if kinds is None else list(kinds),
            max_lag=max_lag,
            poll=float(check_seconds("poll", poll, optional=False) or 30.0),
        )
        kinds_key = None if kinds is None else tuple(kinds)
        filter_key = (partition_id, kinds_key, max_lag, self._body.poll, self._body.max_events)
        #: shared with the client's other watchers of this filter
        self._feed = links.feeds.feed(filter_key)
        self._feed.join(self)
        self._events: deque[AnyEvent] = deque()
        self._closed = False
        #: the controller incarnation the position counts in (None: not subscribed yet)
        self.incarnation: str | None = incarnation
        #: the last event yielded (or, before any, where the watch started)
        self.seq: int | None = since

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> AnyEvent:
        while not self._events:
            if self._closed:
                raise StopAsyncIteration
            await self._next_batch()
        ev = self._events.popleft()
        self.seq = ev.seq
        return ev

    async def start(self) -> None:
        """Subscribe now (a watch without ``since`` sees the events from here on)."""
        if self._body.since is None:
            await self._next_batch()

    async def aclose(self) -> None:
        """Stop: the iteration ends (nothing waits on the controller between steps)."""
        self._closed = True
        self._events.clear()
        self._feed.leave(self)

    async def _next_batch(self) -> None:
        body = self._body
        feed = self._feed
        if body.since is None or feed.alone:  # subscribing, or nobody to share with
            body.watchers = 1
            batch = await self._ask()
        else:
            self._links.check_process()  # (a forked child waits on no request of the parent)
            position = (body.incarnation, body.since)
            while True:
                answer = feed.answer(position, body.max_lag)
                if answer is not None:
                    batch = answer
                    break
                flight = feed.in_flight(position)
                if flight is None:
                    batch = await self._lead(feed, position)
                    break
                answer = await flight.wait()  # the answer it brought (None: this one asks)
                if answer is not None:
                    batch = answer
                    break
        self._take(batch)

    async def _lead(self, feed: Feed, position: Position) -> WatchBatch:
        """Ask for the watchers at ``position``; they share the answer, never a failure."""
        done = feed.lead(position)
        # the controller paces its watchers, not their requests: one asking for all is
        # charged as all of them (answered as often as each would be, at a fraction of the cost)
        self._body.watchers = feed.watchers
        batch = None
        try:
            batch = await self._ask()
        finally:
            feed.landed(position, done, batch)
        return batch

    async def _ask(self) -> WatchBatch:
        body = self._body
        wait = body.poll + self._links.request_timeout
        batch: WatchBatch = await self._links.call(body, WatchBatch, timeout=wait)
        return batch

    def _take(self, batch: WatchBatch) -> None:
        body = self._body
        if body.since is None:
            self.seq = batch.cursor
        body.since, body.incarnation = batch.cursor, batch.incarnation
        self.incarnation = batch.incarnation
        self._events.extend(batch.events)
