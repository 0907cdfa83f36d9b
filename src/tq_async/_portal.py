"""One event-loop thread per process for the blocking API, created lazily, reborn after fork.

The loop runs in a daemon thread (anyio's ``start_blocking_portal`` uses a non-daemon
executor thread, which would keep the interpreter from exiting while a client is open).
"""

from __future__ import annotations

import asyncio
import functools
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from ._errors import InvalidRequestError

P = ParamSpec("P")
R = TypeVar("R")

__all__ = [
    "ASYNC_CLIENT",
    "allow_blocking",
    "check_blocking_allowed",
    "tolerating_blocking",
    "get_portal",
    "host_services",
    "stop_hosting",
]

#: event loops running services (``local_cluster``) -> how many clusters each runs
_service_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = (
    weakref.WeakKeyDictionary()
)


def host_services() -> asyncio.AbstractEventLoop:
    """Mark the running event loop as hosting services (until `stop_hosting`)."""
    loop = asyncio.get_running_loop()
    _service_loops[loop] = _service_loops.get(loop, 0) + 1
    return loop


def stop_hosting(loop: asyncio.AbstractEventLoop) -> None:
    """Undo one `host_services`."""
    left = _service_loops.get(loop, 1) - 1
    if left:
        _service_loops[loop] = left
    else:
        _service_loops.pop(loop, None)


def allow_blocking(loop: asyncio.AbstractEventLoop) -> None:
    """Let blocking calls run on ``loop``: a private loop that runs only while its thread
    waits anyway (the synchronous ``StreamingDataset``'s), whose tasks make them."""
    _blocking_loops.add(loop)


#: private event loops whose tasks may make blocking calls (`allow_blocking`)
_blocking_loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()

#: per thread: how many `tolerating_blocking` calls are running
_tolerance = threading.local()


def tolerating_blocking(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn``, whose blocking calls may stop this thread's running event loop (not the
    services' loop: that would deadlock). For TransferQueue's API (``tq_async.compat``),
    whose synchronous functions programs call inside async code (verl's trainer does)."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        _tolerance.depth = getattr(_tolerance, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _tolerance.depth -= 1

    return call


#: what async code uses instead of the blocking client
ASYNC_CLIENT = "`async with tq.AsyncClient.connect(address)`"


def check_blocking_allowed(what: str, instead: str = ASYNC_CLIENT) -> None:
    """Refuse a blocking call on a thread whose event loop is running.

    On the loop that runs services the call would block them, so they could never answer: a
    deadlock that would surface only as a misleading timeout after ``request_timeout``. On
    any other running loop it would stop every other task of that loop for the whole wait,
    silently. Cheap where it passes (a plain thread: one lookup of the running loop).

    Args:
        what: the call, for the message ("a blocking GetMeta").
        instead: the async counterpart async code should use, for the message.

    Raises:
        InvalidRequestError: this thread's event loop is running (and is not a private loop
            of `allow_blocking`; nor, unless it runs services, inside
            `tolerating_blocking`).
    """
    loop = asyncio._get_running_loop()
    if loop is None or loop in _blocking_loops:
        return
    if _service_loops.get(loop):
        raise InvalidRequestError(
            f"{what} would block the event loop that runs tq.local_cluster(), and so the "
            "services it waits for (a deadlock); in async code use `async with "
            "tq.AsyncClient.connect(address)` (or tq.AsyncStreamingDataset), or run the "
            "blocking code in another thread: `await anyio.to_thread.run_sync(fn)`; a "
            "synchronous program starts the services with `with tq.background_cluster(...)`"
        )
    if getattr(_tolerance, "depth", 0):
        return
    raise InvalidRequestError(
        f"{what} would block the running event loop of this thread (every other task of it "
        f"would stop until the reply); in async code use {instead}, or run the blocking code "
        "in another thread: `await anyio.to_thread.run_sync(fn)`"
    )


_lock = threading.Lock()
_portal: BlockingPortal | None = None
_pid: int | None = None


def _forget_after_fork() -> None:
    # The loop thread does not exist in the child: drop the reference without closing it.
    # The lock may have been held by another thread at the fork: the child gets a new one.
    global _portal, _pid, _lock
    _portal = None
    _pid = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def _run(ready: queue.Queue[BlockingPortal | BaseException]) -> None:
    async def main() -> None:
        async with BlockingPortal() as portal:
            ready.put(portal)
            await portal.sleep_until_stopped()

    try:
        anyio.run(main)
    except BaseException as exc:  # pragma: no cover - reported to the caller below
        ready.put(exc)


def get_portal() -> BlockingPortal:
    """The process's portal (an asyncio loop in a daemon thread), started on first use."""
    global _portal, _pid
    with _lock:
        if _portal is None or _pid != os.getpid():
            ready: queue.Queue[BlockingPortal | BaseException] = queue.Queue()
            threading.Thread(target=_run, args=(ready,), name="tq_async-loop", daemon=True).start()
            got = ready.get()
            if isinstance(got, BaseException):
                raise got
            _portal, _pid = got, os.getpid()
        return _portal
