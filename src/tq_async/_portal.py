"""One event-loop thread per process for the blocking API, created lazily, reborn after fork.

The loop runs in a daemon thread (anyio's ``start_blocking_portal`` uses a non-daemon
executor thread, which would keep the interpreter from exiting while a client is open).
"""

from __future__ import annotations

import os
import queue
import threading

import anyio
from anyio.from_thread import BlockingPortal

__all__ = ["get_portal"]

_lock = threading.Lock()
_portal: BlockingPortal | None = None
_pid: int | None = None


def _forget_after_fork() -> None:
    # The loop thread does not exist in the child: drop the reference without closing it.
    global _portal, _pid
    _portal = None
    _pid = None


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
