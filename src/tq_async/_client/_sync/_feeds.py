# Generated from src/tq_async/_client/_async/_feeds.py by scripts/unasync.py:
# do not edit; change the source and run `python scripts/unasync.py`.
"""Watchers of one client that ask alike share one request (`Feeds`).

A watcher long-polls the controller for the events after its position (``WatchNext``). Sixteen
watchers of one client with the same filter, standing at the same position, would each park a
request and decode the same answer: a `Feed` (one per filter, per client) lets the first of
them ask (the *leader*) while the others wait for its answer, and keeps each answer, by the
position it answers, until every other watcher of the feed took it (at most the last
`KEPT_ANSWERS`): for the watchers that come to that position later. A lone watcher keeps
nothing (answers held longer than needed make every garbage collection walk them).

Nothing else changes: an answer is what the controller would have told any watcher at that
position (each still sees every event after its own position once, in order, or a
``Resync``). A leader that fails or is cancelled shares nothing: the slot is freed and the next
waiting watcher asks itself (errors are never shared). A watcher further behind than the kept
answers asks alone, and the controller's history and ``max_lag`` apply to it as before.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..._sync_primitives import Handoff
from ..._wire._events import WatchBatch

__all__ = ["Feed", "Feeds", "Position"]

#: a watcher's position: the controller incarnation (None: "this one") and the last event seen
Position = tuple[str | None, int]

#: answers a feed keeps (the oldest is dropped first)
KEPT_ANSWERS = 64


class Feed:
    """The recent answers and the requests in flight of the watchers of one client that share
    a filter. No I/O: the watcher asks, the feed tells who asks and keeps what came back."""

    __slots__ = ("__weakref__", "_answers", "_flight", "_newest", "_watchers", "kept")

    def __init__(self, kept: int = KEPT_ANSWERS) -> None:
        self.kept = kept
        #: the watchers of this feed (a watcher left by ``break`` goes with the collector)
        self._watchers: weakref.WeakSet[Any] = weakref.WeakSet()
        #: position -> the answer to a request from there and how many watchers have yet to
        #: take it (insertion order: oldest first)
        self._answers: dict[Position, _Kept] = {}
        #: position -> what the request from there in flight brings the watchers waiting
        #: for it (its answer; None: it failed or was cancelled)
        self._flight: dict[Position, Handoff[WatchBatch]] = {}
        #: the furthest cursor an answer reached, by incarnation
        self._newest: tuple[str, int] | None = None

    def join(self, watcher: Any) -> None:
        """``watcher`` takes its answers from this feed."""
        self._watchers.add(watcher)

    @property
    def watchers(self) -> int:
        """How many watchers take their answers from this feed."""
        return len(self._watchers)

    @property
    def alone(self) -> bool:
        """Whether one watcher (or none) takes its answers from this feed: nothing to share."""
        return len(self._watchers) <= 1

    def leave(self, watcher: Any) -> None:
        """``watcher`` was closed: answers are no longer kept for it."""
        self._watchers.discard(watcher)

    def answer(self, position: Position, max_lag: int | None = None) -> WatchBatch | None:
        """The kept answer to a request from ``position``, taken by the caller (None: none
        kept, or the watcher is more than ``max_lag`` events behind the newest answer: the
        controller decides)."""
        kept = self._answers.get(position)
        if kept is None:
            return None
        batch = kept.batch
        if max_lag is not None and self._newest is not None:
            incarnation, cursor = self._newest
            if batch.incarnation == incarnation and cursor - position[1] > max_lag:
                return None
        kept.waiting -= 1
        if kept.waiting <= 0:
            del self._answers[position]
        return batch

    def in_flight(self, position: Position) -> Handoff[WatchBatch] | None:
        """What a request from ``position`` in flight hands its waiters when it ends (None:
        none in flight)."""
        return self._flight.get(position)

    def lead(self, position: Position) -> Handoff[WatchBatch]:
        """The caller asks from ``position``; others wait for what it hands them."""
        done: Handoff[WatchBatch] = Handoff()
        self._flight[position] = done
        return done

    def landed(
        self, position: Position, done: Handoff[WatchBatch], batch: WatchBatch | None
    ) -> None:
        """The request `lead` announced ended with ``batch`` (None: it failed or was
        cancelled: nothing is kept and the next watcher asks itself): the watchers waiting
        for it take it at once, and it is kept for the others."""
        if self._flight.get(position) is done:
            del self._flight[position]
        took = done.give(batch)
        if batch is not None and (batch.cursor, batch.incarnation) != (position[1], position[0]):
            # (an empty answer at the same position, the end of a poll, tells nothing)
            self._keep(position, batch, 1 + took)

    def _keep(self, position: Position, batch: WatchBatch, took: int) -> None:
        newest = self._newest
        if newest is None or newest[0] != batch.incarnation or newest[1] < batch.cursor:
            self._newest = (batch.incarnation, batch.cursor)
        waiting = len(self._watchers) - took  # (the caller and its waiters took it)
        if waiting <= 0:
            return
        answers = self._answers
        answers.pop(position, None)
        answers[position] = _Kept(batch, waiting)
        while len(answers) > self.kept:
            del answers[next(iter(answers))]

    def after_fork(self) -> None:
        """In a forked child: the parent's requests in flight are not this process's."""
        self._flight = {}


class _Kept:
    """An answer kept for the watchers that have yet to take it."""

    __slots__ = ("batch", "waiting")

    def __init__(self, batch: WatchBatch, waiting: int) -> None:
        self.batch = batch
        self.waiting = waiting


class Feeds:
    """A client's feeds, by filter; a feed lives as long as a watcher holds it (a watcher
    left by ``break`` is never closed: only the garbage collector tells it is gone)."""

    __slots__ = ("_feeds",)

    def __init__(self) -> None:
        self._feeds: weakref.WeakValueDictionary[Any, Feed] = weakref.WeakValueDictionary()

    def feed(self, key: Any) -> Feed:
        """The feed of the watchers whose filter is ``key`` (hashable)."""
        feed = self._feeds.get(key)
        if feed is None:
            feed = self._feeds[key] = Feed()
        return feed

    def __len__(self) -> int:
        return len(self._feeds)

    def after_fork(self) -> None:
        """In a forked child: no watcher waits on a request of the parent's."""
        for feed in list(self._feeds.values()):
            feed.after_fork()
