"""The client's connection: one DEALER socket per service, any number of requests in flight.

The asynchronous shell around `ConnectionCore` (the framing, request ids, table of requests
and liveness it shares with the blocking `BlockingConnection`, with what both shells do alike
in `ConnectionShell`): each request awaits its own future and replies may come in any order.
A request with a deadline that has no reply after ``retry_after`` seconds reconnects (same
identity) and is sent again: services deduplicate retried requests, so nothing runs twice.
The connection follows the service's liveness (ZMTP heartbeats, the socket monitor) and
reports it through callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import Callable, Generator, Sequence
from typing import Any, cast

import msgspec
import zmq

from .._errors import BrokenError, ClosedError, InvalidRequestError
from .._logging import get_logger
from .._wire._protocol import Cancel, Reply
from ._connection import (
    DEFAULT_BUSY_POLL,
    MAX_BUSY_POLL,
    Got,
    PollBackoff,
    check_frames,
    process_state,
)
from ._router import DrainedSocket
from ._routes import private_frames
from ._shell import ConnectionShell
from ._unix import UnixSocket

__all__ = [
    "DEFAULT_BUSY_POLL",
    "MAX_BUSY_POLL",
    "BusyPoll",
    "DealerConnection",
    "check_frames",
    "process_state",
]

log = get_logger(__name__)

#: how long ZMQ's I/O thread may go on sending the ``Cancel``s of a connection closed with
#: requests waiting (in the background; to a peer that is gone they are dropped after it)
CANCEL_LINGER_MS = 1000


class BusyPoll(PollBackoff):
    """Whether, and how long, a request reads its connection for the reply before parking.

    A request on a same-host connection with nothing else in flight yields to the event loop
    once (other tasks run, and a fast reply is often there already), then reads its socket
    for up to ``budget`` seconds before it parks like any other; the back-off after polls
    that caught nothing is `PollBackoff`'s.
    """

    __slots__ = ()

    async def caught(self, fut: asyncio.Future[Any], read: Callable[[], None]) -> bool:
        """Yield once, then ``read()`` until ``fut`` is done or the budget is spent.

        Returns:
            True when ``fut`` is done (its reply, or the connection's failure, arrived).
        """
        if not self.should_poll():
            return False
        await _yield()  # fairness: a call never completes without yielding
        return self.spin(fut.done, read)


class DealerConnection(ConnectionShell, DrainedSocket):
    """One DEALER socket to one service, shared by every request of one client.

    Each call awaits its own future; replies may come in any order. With ``busy_poll`` > 0, a
    request over a same-host Unix socket polls for its reply briefly before parking
    (`BusyPoll`). Takes `ConnectionShell`'s arguments.
    """

    def _start(self, busy_poll: float) -> None:
        #: request id -> the future its waiting attempt awaits (a reply, or the failure)
        self._pending: dict[int, asyncio.Future[None]] = {}
        sock, monitor = self._connect()
        DrainedSocket.__init__(self, sock)
        self._watch(monitor)
        #: only a Unix socket's reply can be read by polling (ZMQ's arrive through its I/O
        #: thread; an in-process service runs on this very loop)
        self._busy_poll = BusyPoll(busy_poll) if busy_poll > 0 and self._core.unix else None

    def _connect(self) -> tuple[Any, zmq.Socket[Any] | None]:
        core = self._core
        if core.unix:
            try:
                usock = UnixSocket(self.address, core.identity, self._unix_eof)
            except OSError as exc:
                raise BrokenError(f"cannot connect to {self.name!r}: {exc}") from exc
            core.connected = True
            return usock, None
        sock, monitor, route = self._dealer_socket()
        if route is not None:
            route.watchers.add(self)
        return sock, monitor

    def _open(self) -> None:
        sock, monitor = self._connect()
        self._adopt_socket(sock)
        self._watch(monitor)

    def _release(self) -> None:
        self._unwatch()
        self._release_socket()

    def _unix_eof(self) -> None:
        """The Unix socket's peer closed it: stop reading (the FD stays readable at EOF)."""
        with contextlib.suppress(RuntimeError, ValueError):
            self._loop.remove_reader(self._fd)
        if not self._closed:
            self._disconnected(closed_by_peer=True)

    def _watch(self, monitor: zmq.Socket[Any] | None) -> None:
        self._monitor = monitor
        if monitor is None:
            return  # a Unix socket reports its end itself
        self._monitor_fd: int = monitor.getsockopt(zmq.FD)  # type: ignore[assignment]
        self._loop.add_reader(self._monitor_fd, self._drain_monitor)
        # the FD is edge-triggered: events queued before add_reader would never be signalled
        self._loop.call_soon(self._drain_monitor)

    def _unwatch(self) -> None:
        if self._monitor is None:
            return
        with contextlib.suppress(RuntimeError, ValueError):
            self._loop.remove_reader(self._monitor_fd)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)

    def peer_closed(self) -> None:
        """The in-process endpoint closed (inproc reports no disconnect event); thread-safe."""

        def on_loop() -> None:
            if self.inproc and not self._closed:
                self._disconnected()

        with contextlib.suppress(RuntimeError):  # the connection's loop is closed already
            self._loop.call_soon_threadsafe(on_loop)

    def _fail(self, exc: BaseException) -> None:
        self._core.forget_all()
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(exc)

    def _drain(self) -> None:
        """Read what arrived: a Unix socket's messages in one read (ZMQ's as any socket's)."""
        if self._edge_triggered:  # ZMQ; a Unix socket is level-triggered
            super()._drain()
            return
        self._drain_scheduled = False
        if self._closed:
            return
        for frames in cast(UnixSocket, self._sock).take_messages():
            try:
                self._on_frames(frames)
            except Exception:  # a handler bug must not kill the reader
                log.exception("message handler failed")

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        rid = self._core.on_message(frames)
        if rid is not None:
            fut = self._pending.get(rid)
            if fut is not None and not fut.done():
                fut.set_result(None)

    async def request(
        self,
        body: msgspec.Struct,
        frames: Sequence[Any] = (),
        *,
        timeout: float | None = None,
        on_abandon: Callable[[Reply, list[zmq.Frame]], None] | None = None,
        cancel_undoes: bool = False,
    ) -> tuple[msgspec.Raw, list[Any]]:
        """Send ``body`` (+ data frames) and wait for the reply's payload and frames.

        Args:
            body: the request struct.
            frames: data frames sent after the header (zero-copy).
            timeout: seconds to wait for the reply; None waits until cancelled.
            on_abandon: called with the reply if it arrives after this call was cancelled or
                timed out (lets the caller undo what the service did for it).
            cancel_undoes: the service undoes an answered request itself when its
                ``Cancel`` arrives: ``on_abandon`` runs only for a reply that arrived before
                the call gave up (no ``Cancel`` is sent for it then).

        Raises:
            TQTimeoutError: no reply within ``timeout`` (the service is told to cancel).
            ClosedError: the connection was closed.
            TQError: the service answered with an error (re-raised as its class).

        Cancellation: the service is sent a ``Cancel`` for this request; if the reply was
        already on its way, ``on_abandon`` receives it.
        """
        core = self._core
        self._check_usable()
        if core.inproc and frames:
            frames = await private_frames(frames, incoming=False)
        rid, outgoing = core.start(body, frames)
        try:
            self._send(outgoing)
        except (zmq.ZMQError, OSError) as exc:  # (a context manager costs ~1 us a call)
            core.abandon(rid, None)
            raise self._broken(type(body).__name__, exc) from exc
        except BaseException:  # nothing went out: nothing to cancel, nothing to resend
            core.abandon(rid, None)
            raise
        try:
            got = await self._reply_to(rid, outgoing, timeout)
            if got is None:
                raise core.timed_out(type(body).__name__, timeout)
            reply, rframes = got
            if reply.ok and core.inproc and rframes:
                got = reply, await private_frames(rframes, incoming=True)
        except BaseException:
            # cancelled or timed out at any point, even after the reply arrived: the
            # service is told, or the reply goes to on_abandon (the caller never saw it)
            self._abandon(rid, on_abandon, cancel_undoes)
            raise
        return core.finish(rid, got)

    def _check_usable(self) -> None:
        """Raise if a request cannot be sent on this connection at all."""
        self._core.check_usable(self._closed)
        self.check_loop()

    def check_loop(self) -> None:
        """Raise `InvalidRequestError` unless the running event loop is this connection's."""
        if asyncio.get_running_loop() is not self._loop:
            # its socket is read by the loop that opened it (another thread's, or one an
            # earlier ``asyncio.run`` closed): a request here would never see its reply
            raise InvalidRequestError(
                f"this connection to {self.name} was opened on another event loop: an "
                "AsyncClient belongs to the event loop that opened it; open one on this loop "
                "(`async with tq.AsyncClient.connect(address)`), or give each thread its own "
                "tq.Client"
            )

    async def _reply_to(self, rid: int, outgoing: list[Any], timeout: float | None) -> Got | None:
        """The reply to ``rid``, or None once ``timeout`` passed without one; every
        ``retry_after`` seconds without a reply it goes out again (`ConnectionShell._retry`)."""
        clock = self._loop.time
        deadline = None if timeout is None else clock() + timeout
        while (step := self._core.next_wait(deadline, clock())) is not None:
            wait, last = step
            got = await self._attempt(rid, wait)
            if got is not None or last:
                return got
            self._retry(rid, outgoing, deadline is None)
        return None

    async def _attempt(self, rid: int, wait: float | None) -> Got | None:
        """Wait up to ``wait`` seconds (None: no limit) for ``rid``'s reply; None if none came.

        One plain loop timer per attempt resolves the future: anyio.fail_after or
        asyncio.wait cost 30+ us each on this path.
        """
        arrived = self._core.arrived
        if rid in arrived:
            return arrived.pop(rid)  # arrived as the last attempt's timer fired
        pending = self._pending
        alone = not pending
        fut: asyncio.Future[None] = self._loop.create_future()
        pending[rid] = fut
        timer = None
        try:
            if alone and self._busy_poll is not None:
                await self._busy_poll.caught(fut, self._drain)
            if wait is not None and not fut.done():
                timer = self._loop.call_later(wait, _no_reply_yet, fut)
            await fut  # (raises the connection's failure)
        finally:
            del pending[rid]
            if timer is not None:
                timer.cancel()
        return arrived.pop(rid, None)

    def send_oneway(self, body: msgspec.Struct) -> None:
        """Send a request whose reply nobody waits for (it is dropped on arrival).

        Raises:
            BrokenError: the connection is broken (nothing was sent).
        """
        if not self._closed:
            with self.transport_errors(type(body).__name__):
                self._send(self._core.oneway(body))

    def close(
        self, error: BaseException | None = None, *, farewell: Sequence[msgspec.Struct] = ()
    ) -> None:
        """Close the socket; requests still waiting fail with ``error`` (default:
        `ClosedError`; a connection replaced because it broke passes a `BrokenError`).

        Closed by its program (no ``error``), the connection first sends a ``Cancel`` for
        each request still waiting, as a cancelled call does: a get_meta parked at the
        controller would otherwise take the task's next rows for nobody. ``farewell``: one-way
        messages sent last (best effort), e.g. the aborts of a closing client's open puts.
        """
        if self._closed:
            return
        cancels = 0
        if error is None:
            core = self._core
            for rid in [rid for rid in core.waiting if rid not in core.arrived]:
                cancels += self.send_best_effort(Cancel(rid))
        for body in farewell:
            cancels += self.send_best_effort(body)
        self._unwatch()
        # (the Cancels are queued: ZMQ's I/O thread sends them after the close)
        self._close_socket(CANCEL_LINGER_MS if cancels else 0)
        self._fail(error or ClosedError(f"the connection to {self.name} was closed"))


@types.coroutine
def _yield() -> Generator[None, None, None]:
    """Let the event loop run the other ready tasks once (``asyncio.sleep(0)`` without its
    call overhead; anyio's checkpoint adds a backend lookup, ~2 us)."""
    yield


def _no_reply_yet(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
