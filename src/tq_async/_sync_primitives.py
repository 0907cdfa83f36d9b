"""The blocking twins of `tq_async._primitives` (used by the generated blocking
client).

A blocking client runs in its caller's thread and waits on one connection at a time, so
"concurrently" means "one after the other", a worker thread is the calling thread, and a
repeating timer fires while a request of this thread waits (`run_due_timers`, called
from the connection's wait loop in `tq_async._transport._sync_dealer`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

__all__ = [
    "TIMERS_FIRE_IDLE",
    "Event",
    "Handoff",
    "Lock",
    "Repeater",
    "cleanup_scope",
    "next_timer",
    "run_due_timers",
    "run_each",
    "run_sync_off_loop",
    "spawn",
]

T = TypeVar("T")

Lock = threading.Lock
Event = threading.Event

#: a `Repeater` fires only while a request of its thread waits, never while its caller
#: does its own work
TIMERS_FIRE_IDLE = False


def run_sync_off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, here: a blocking caller has no event loop to keep free."""
    return fn(*args)


def run_each(fn: Callable[..., None], items: Iterable[tuple[Any, ...]]) -> None:
    """``fn(*item)`` for every item, one after the other; the first failure stops."""
    for item in items:
        fn(*item)


@contextlib.contextmanager
def cleanup_scope(seconds: float) -> Iterator[None]:
    """Clean-up after a failure: a blocking request is bounded by its own timeout."""
    del seconds
    yield


def spawn(fn: Callable[[], Any]) -> None:
    """Nothing: a blocking client has no background to run ``fn`` in (its timers fire only
    while it waits in a call, so it never asks for one)."""
    del fn


class Handoff(Generic[T]):
    """A value one thread brings to the threads that wait for it: ``handoff.wait()`` returns
    what `give` gave (None: nothing came)."""

    __slots__ = ("_event", "_lock", "_value", "_waiting")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._value: T | None = None
        self._waiting = 0

    def is_set(self) -> bool:
        """Whether `give` was called."""
        return self._event.is_set()

    def wait(self) -> T | None:
        with self._lock:
            given = self._event.is_set()
            if not given:
                self._waiting += 1
        if not given:
            self._event.wait()
        return self._value

    def give(self, value: T | None) -> int:
        """Hand ``value`` to the waiting threads (and to later ones); how many took it."""
        with self._lock:
            self._value = value
            self._event.set()
            taken, self._waiting = self._waiting, 0
        return taken


class _Timers(threading.local):
    def __init__(self) -> None:
        self.active: list[Repeater] = []


_timers = _Timers()


class Repeater:
    """Calls ``fn()`` every ``interval`` seconds, while a request of this thread waits, until
    cancelled."""

    __slots__ = ("_due", "_fn", "_interval")

    def __init__(self, interval: float, fn: Callable[[], Any]) -> None:
        self._fn, self._interval = fn, interval
        self._due = time.monotonic() + interval
        _timers.active.append(self)

    def cancel(self) -> None:
        with contextlib.suppress(ValueError):
            _timers.active.remove(self)


def next_timer() -> float | None:
    """Seconds until this thread's next timer is due (None: none)."""
    if not _timers.active:
        return None
    return max(0.0, min(r._due for r in _timers.active) - time.monotonic())


def run_due_timers() -> None:
    """Fire this thread's timers that are due."""
    if not _timers.active:
        return
    now = time.monotonic()
    for r in list(_timers.active):
        if r._due <= now:
            r._due = now + r._interval
            r._fn()
