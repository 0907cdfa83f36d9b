"""In-process routes: a service endpoint's ``inproc://`` twin, and private copies of frames.

A service endpoint also binds an ``inproc://`` endpoint and records it under its public
address; a `DealerConnection` opened in the same process (same
ZMQ
context, no CURVE) connects there instead. No I/O thread, no kernel copies, no cross-thread
wake-ups: measured on this box, a one-row put after 10 ms idle went from ~0.96 to ~0.6-0.75 ms,
sequential get_meta from ~4-5k/s to ~10-11k/s and an 8.4 MB put from ~2.4 to ~5 GB/s
(``benchmarks/RESULTS.md``). inproc hands message buffers over by reference, so to keep the
semantics of a socket (the receiver owns what it got) an in-process connection copies its
outgoing data frames, and the data frames it receives, into buffers of its own (recycled:
see `tq_async._wire._buffers`). inproc has no connection events, so a closing endpoint tells
its in-process connections itself (`RouteWatcher.peer_closed`).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import anyio
import zmq
import zmq.utils.monitor

from .._logging import get_logger
from .._wire._buffers import buffer_pool

__all__ = [
    "LocalRoute",
    "RouteWatcher",
    "local_route",
    "local_routes",
    "local_routes_lock",
    "copy_frames",
    "private_frames",
]

log = get_logger(__name__)

#: Copies of at least this many bytes in all run on a worker thread (the loop may be the
#: services' own); smaller ones cost less than the hop.
THREAD_COPY_BYTES = 16 << 20


def _private(frame: Any) -> Any:
    view = memoryview(frame)
    # pooled memory for big buffers: fresh multi-MiB blocks page-fault (see _buffers)
    return buffer_pool.copy(view) if view.nbytes >= zmq.COPY_THRESHOLD else bytearray(view)


def _copy_out(frames: Sequence[Any]) -> list[Any]:
    # zmq.Frame objects are message buffers already (forwarded, never written); below its
    # copy threshold pyzmq copies by itself
    return [
        f if isinstance(f, zmq.Frame) or memoryview(f).nbytes < zmq.COPY_THRESHOLD else _private(f)
        for f in frames
    ]


def _copy_in(frames: Sequence[zmq.Frame]) -> list[Any]:
    return [_private(f.buffer) for f in frames]


async def private_frames(frames: Sequence[Any], *, incoming: bool) -> list[Any]:
    """Data frames of an inproc message, copied so that sender and receiver share nothing.

    inproc hands buffers over by reference: a put would leave the caller's tensor memory in
    the store, and a read would hand out the stored cells themselves. Outgoing, the caller's
    buffers are copied; incoming, every frame becomes a writable buffer of its own.
    """
    copy = _copy_in if incoming else _copy_out
    if sum(memoryview(f).nbytes for f in frames) >= THREAD_COPY_BYTES:
        return await anyio.to_thread.run_sync(copy, frames)
    return copy(frames)


def copy_frames(frames: Sequence[Any], *, incoming: bool) -> list[Any]:
    """`private_frames` in the calling thread (the blocking client's)."""
    return _copy_in(frames) if incoming else _copy_out(frames)


class RouteWatcher(Protocol):
    """A connection that goes through a route (told when its endpoint closes)."""

    def peer_closed(self) -> None:
        """The endpoint on the other end of the route closed."""


class LocalRoute:
    """An endpoint's in-process twin: where same-process connections go, and who to tell
    when it closes."""

    def __init__(self, inproc: str, context: zmq.Context[Any]) -> None:
        self.inproc = inproc
        self.context = context
        self.pid = os.getpid()
        self.watchers: weakref.WeakSet[RouteWatcher] = weakref.WeakSet()


#: public address of an endpoint of this process -> its inproc twin
local_routes: dict[str, LocalRoute] = {}
local_routes_lock = threading.Lock()


def _after_fork() -> None:
    # held by another thread at the fork, it would stay held in the child (routes of the
    # parent's endpoints are ignored there anyway: pid check in local_route)
    local_routes_lock._at_fork_reinit()  # type: ignore[attr-defined]


os.register_at_fork(after_in_child=_after_fork)


def local_route(address: str, context: zmq.Context[Any]) -> LocalRoute | None:
    with local_routes_lock:
        route = local_routes.get(address)
    if route is None or route.pid != os.getpid() or route.context is not context:
        return None
    return route
