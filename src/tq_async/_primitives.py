"""The few concurrency primitives the client logic uses, asynchronous flavour.

The client's logic is written once, as async code (`tq_async._client._async._client` and its
modules), and its blocking twin is generated from it (``scripts/unasync.py``): the generator
rewrites ``import`` of this module into `tq_async._sync_primitives`, which offers the
same names with blocking semantics. So the client modules use *these* names, never anyio or
asyncio directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from typing import Any, Generic, TypeVar

import anyio
import anyio.to_thread

from ._errors import TQError

if sys.version_info < (3, 11):  # pragma: no cover - depends on the Python version
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "TIMERS_FIRE_IDLE",
    "Event",
    "Handoff",
    "Lock",
    "Repeater",
    "cleanup_scope",
    "run_each",
    "run_sync_off_loop",
    "spawn",
]

T = TypeVar("T")

#: a `Repeater` fires while its caller does its own work too (a timer of the event loop)
TIMERS_FIRE_IDLE = True

Lock = anyio.Lock
Event = anyio.Event


async def run_sync_off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a worker thread (a long copy must not stall the event loop)."""
    return await anyio.to_thread.run_sync(fn, *args)


async def run_each(
    fn: Callable[..., Coroutine[Any, Any, None]], items: Iterable[tuple[Any, ...]]
) -> None:
    """``fn(*item)`` for every item, concurrently; the first failure cancels the rest and is
    raised alone, as one call would raise it (the first ``TQError`` of the task group's
    exception group, never the group)."""
    try:
        async with anyio.create_task_group() as tg:
            for item in items:
                tg.start_soon(fn, *item)
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        raise next((e for e in leaves if isinstance(e, TQError)), leaves[0]) from None


def _leaves(group: BaseExceptionGroup[Any]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


@contextlib.contextmanager
def cleanup_scope(seconds: float) -> Iterator[None]:
    """Clean-up after a failure: shielded from cancellation, bounded to ``seconds``."""
    with anyio.move_on_after(seconds, shield=True):
        yield


#: the tasks `spawn` started, until they end (the loop keeps only weak references)
_spawned: set[asyncio.Task[None]] = set()


def spawn(fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``fn()`` as a task of the running loop, in the background (it handles its own
    errors; one it lets out ends it, unseen)."""
    task = asyncio.get_running_loop().create_task(fn())
    _spawned.add(task)
    task.add_done_callback(_spawned.discard)


class Handoff(Generic[T]):
    """A value one task brings to the tasks that wait for it: ``await handoff.wait()``
    returns what `give` gave (None: nothing came). Each waiter awaits a future of its own (a
    waiter cancelled takes nothing from the others), and resumes with the value: no lock or
    event to go through again (a task woken costs a few steps, paid by every watcher of a
    shared watch at every answer)."""

    __slots__ = ("_futures", "_given", "_value")

    def __init__(self) -> None:
        self._futures: list[asyncio.Future[T | None]] = []
        self._given = False
        self._value: T | None = None

    def is_set(self) -> bool:
        """Whether `give` was called."""
        return self._given

    def wait(self) -> Awaitable[T | None]:
        fut: asyncio.Future[T | None] = asyncio.get_running_loop().create_future()
        if self._given:
            fut.set_result(self._value)
        else:
            self._futures.append(fut)
        return fut

    def give(self, value: T | None) -> int:
        """Hand ``value`` to the waiting tasks (and to later ones); how many took it."""
        self._given, self._value = True, value
        futures, self._futures = self._futures, []
        taken = 0
        for fut in futures:
            if not fut.done():  # (cancelled: its task is gone)
                fut.set_result(value)
                taken += 1
        return taken


class Repeater:
    """Calls ``fn()`` every ``interval`` seconds until cancelled (a loop timer, no task)."""

    __slots__ = ("_fn", "_handle", "_interval")

    def __init__(self, interval: float, fn: Callable[[], Any]) -> None:
        self._fn, self._interval = fn, interval
        self._handle = asyncio.get_running_loop().call_later(interval, self._fire)

    def _fire(self) -> None:
        self._fn()
        self._handle = asyncio.get_running_loop().call_later(self._interval, self._fire)

    def cancel(self) -> None:
        self._handle.cancel()
