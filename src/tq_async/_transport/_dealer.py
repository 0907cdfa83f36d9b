"""The client's connection: one DEALER socket per service, any number of requests in flight.

The asynchronous shell around `ConnectionCore` (the
framing, request ids, table of requests and liveness it shares with the blocking
`BlockingConnection`): each request awaits its own
future and replies may come in any order. A request with a deadline that has no reply after
``retry_after`` seconds reconnects (same identity) and is sent again: services deduplicate
retried requests, so nothing runs twice. The connection follows the service's liveness
(ZMTP heartbeats, the socket monitor) and reports it through callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import types
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, cast

import msgspec
import zmq
import zmq.utils.monitor

from .._errors import BrokenError, ClosedError
from .._logging import get_logger
from .._wire._protocol import Cancel, Reply
from ._connection import (
    DEFAULT_BUSY_POLL,
    MAX_BUSY_POLL,
    MONITOR_EVENTS,
    ConnectionCore,
    ConnectionState,
    Got,
    PollBackoff,
    check_frames,
    first_of,
    heartbeat_ms,
    process_state,
)
from ._endpoints import zmq_context
from ._router import DrainedSocket
from ._routes import local_route, private_frames
from ._security import CurveClient
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
_clock = time.perf_counter


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
        end = _clock() + self.budget
        while not fut.done():
            read()
            if not fut.done() and _clock() >= end:
                self.miss()
                return False
        self.hit()
        return True


class DealerConnection(ConnectionState, DrainedSocket):
    """One DEALER socket to one service, shared by every request of one client.

    Each call awaits its own future; replies may come in any order. With ``busy_poll`` > 0, a
    request over a same-host Unix socket polls for its reply briefly before parking
    (`BusyPoll`).
    """

    def __init__(
        self,
        address: str,
        *,
        context: zmq.Context[Any] | None = None,
        curve: CurveClient | None = None,
        on_disconnect: Callable[[], None] | None = None,
        on_connect: Callable[[], None] | None = None,
        on_refused: Callable[[], None] | None = None,
        heartbeat_timeout: float | None = None,
        retry_after: float | None = None,
        refused_is_broken: bool = False,
        busy_poll: float = 0.0,
        known_as: str | None = None,
    ) -> None:
        self.address = address
        #: the address the program gave, when ``address`` is its same-host twin
        self.known_as = known_as or address
        #: how messages name the peer: the program's address, then the socket used
        self.name = address if self.known_as == address else f"{self.known_as} ({address})"
        self.retry_after = retry_after
        self._core = ConnectionCore(
            address, curve=curve, refused_is_broken=refused_is_broken, name=self.name
        )
        self._context = context or zmq_context()
        self._curve = curve
        self._on_disconnect = on_disconnect
        self._on_connect = on_connect
        self._on_refused = on_refused
        self._heartbeat = heartbeat_ms(heartbeat_timeout)
        #: request id -> the future its waiting attempt awaits (a reply, or the failure)
        self._pending: dict[int, asyncio.Future[None]] = {}
        #: the messages in flight (the core's table), re-sent after a reconnect
        self._inflight = self._core.inflight
        sock, monitor = self._open()
        super().__init__(sock)
        self._watch(monitor)
        #: only a Unix socket's reply can be read by polling (ZMQ's arrive through its I/O
        #: thread; an in-process service runs on this very loop)
        unix = isinstance(sock, UnixSocket)
        self._busy_poll = BusyPoll(busy_poll) if busy_poll > 0 and unix else None

    def _open(self) -> tuple[Any, zmq.Socket[Any] | None]:
        core = self._core
        if self.address.startswith("uds://"):
            try:
                usock = UnixSocket(self.address, core.identity, self._unix_eof)
            except OSError as exc:
                raise BrokenError(f"cannot connect to {self.name!r}: {exc}") from exc
            core.connected = True
            return usock, None
        route = None if self._curve is not None else local_route(self.address, self._context)
        core.inproc = route is not None
        sock = self._context.socket(zmq.DEALER)
        if self._curve is not None:
            self._curve.apply(sock)
        sock.setsockopt(zmq.IDENTITY, core.identity)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        # a peer whose host vanishes without closing the connection is noticed by heartbeats
        sock.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat[0])
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._heartbeat[1])
        # a closed connection is reported on this monitor socket (no polling); a refused
        # connection attempt tells that nothing listens at the address (any more)
        monitor = sock.get_monitor_socket(MONITOR_EVENTS)
        core.handshaken = route is not None
        try:
            if route is None:
                sock.connect(self.address)
            else:
                sock.connect(route.inproc)
                route.watchers.add(self)
                core.connected = True  # inproc reports no connection events
        except zmq.ZMQError as exc:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            raise BrokenError(f"cannot connect to {self.name!r}: {exc}") from exc
        return sock, monitor

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

    def reconnect(self) -> None:
        """Replace the socket (same identity) and resend every request still in flight.

        Services deduplicate by (identity, request id), so a request that did arrive is
        not executed twice: its cached reply is sent again.
        """
        if self._closed:
            return
        self._unwatch()
        self._release_socket()
        self._core.connected = None
        sock, monitor = self._open()
        self._core.reconnects += 1
        self._adopt_socket(sock)
        self._watch(monitor)
        for frames in list(self._inflight.values()):
            with contextlib.suppress(zmq.ZMQError, OSError):
                self._send(frames)

    def _drain_monitor(self) -> None:
        if self._closed or self._monitor is None:
            return
        while True:
            try:
                msg = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:  # (zmq.Again: nothing more)
                return
            parsed = zmq.utils.monitor.parse_monitor_message(msg)
            seen = self._core.on_monitor(parsed["event"], parsed["value"])
            if seen.connected and self._on_connect is not None:
                self._on_connect()
            if seen.fail is not None:
                self._fail_pending(seen.fail)
            if seen.broken:
                self._disconnected(seen.why)
            if seen.refused and self._on_refused is not None:
                self._on_refused()

    def _disconnected(self, why: str | None = None, *, closed_by_peer: bool = False) -> None:
        self._fail_pending(self._core.disconnected(why, closed_by_peer=closed_by_peer))
        self._purge()
        if self._on_disconnect is not None:
            self._on_disconnect()

    def _purge(self) -> None:
        """Drop what the ZMQ socket still queues for the peer that went away: a request
        just failed with `BrokenError` (sent after the peer died, before the monitor said
        so) must never reach a service that comes back at the address (ZMQ would deliver
        it on reconnecting: a put reported failed ran on the restarted service). A new
        socket of the same identity replaces it; LINGER 0 discards the old one's queue."""
        if self._closed or self._monitor is None or self._core.inproc:
            return  # a Unix socket queues nothing; an in-process peer has no address
        self._unwatch()
        self._release_socket()
        sock, monitor = self._open()  # (a TCP connect never fails here: it is dialled later)
        self._adopt_socket(sock)
        self._watch(monitor)

    def peer_closed(self) -> None:
        """The in-process endpoint closed (inproc reports no disconnect event); thread-safe."""

        def on_loop() -> None:
            if self.inproc and not self._closed:
                self._disconnected()

        with contextlib.suppress(RuntimeError):  # the connection's loop is closed already
            self._loop.call_soon_threadsafe(on_loop)

    def _fail_pending(self, exc: BaseException) -> None:
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

    async def _reply_to(self, rid: int, outgoing: list[Any], timeout: float | None) -> Got | None:
        """The reply to ``rid``, or None once ``timeout`` passed without one; every
        ``retry_after`` seconds without a reply it goes out again
        (`first_of`)."""
        loop = self._loop
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            remaining = None if deadline is None else deadline - loop.time()
            wait = first_of(remaining, self.retry_after)
            if wait is not None and wait <= 0:
                return None
            got = await self._attempt(rid, wait)
            if got is not None:
                return got
            if remaining is not None and wait is not None and wait >= remaining:
                return None
            if deadline is None:
                with contextlib.suppress(zmq.ZMQError, OSError):
                    self._send(outgoing)
            elif self._edge_triggered:  # ZMQ; a Unix socket loses no reply without ending
                log.info("no reply yet: reconnecting and retrying", peer=self.name, rid=rid)
                self.reconnect()

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

    def _abandon(
        self,
        rid: int,
        on_abandon: Callable[[Reply, list[zmq.Frame]], None] | None,
        cancel_undoes: bool = False,
    ) -> None:
        if self._core.abandon(rid, on_abandon, cancel_undoes):
            self.send_best_effort(Cancel(rid))

    def send_oneway(self, body: msgspec.Struct) -> None:
        """Send a request whose reply nobody waits for (it is dropped on arrival).

        Raises:
            BrokenError: the connection is broken (nothing was sent).
        """
        if not self._closed:
            with self.transport_errors(type(body).__name__):
                self._send(self._core.oneway(body))

    def send_best_effort(self, body: msgspec.Struct) -> bool:
        """`send_oneway` for clean-up that must not replace the caller's outcome (an
        unpin after a read, a Cancel, a renewal): a broken connection is logged, not raised;
        the service frees what the message was about when it notices the client is gone.

        Returns:
            Whether the message was handed to the socket.
        """
        try:
            self.send_oneway(body)
        except BrokenError as exc:
            log.debug("one-way message not sent", peer=self.name, error=str(exc))
            return False
        return not self._closed

    @contextlib.contextmanager
    def transport_errors(self, what: str) -> Iterator[None]:
        """The one place where the transport's own failures (``zmq.ZMQError``, the Unix
        socket's ``OSError``) become `BrokenError` for every call of the client,
        requests and one-way messages alike."""
        try:
            yield
        except (zmq.ZMQError, OSError) as exc:
            raise self._broken(what, exc) from exc

    def _broken(self, what: str, exc: BaseException) -> BrokenError:
        """The error of a send the transport refused (see `transport_errors`)."""
        error = self._core.broken(what, exc)
        if not self._edge_triggered and not self._closed:
            # a Unix socket that fails a write is dead (EPIPE: the peer is gone): say so now
            # rather than when its end is read
            self._unix_eof()
        return error

    def close(self, error: BaseException | None = None) -> None:
        """Close the socket; requests still waiting fail with ``error`` (default:
        `ClosedError`; a connection replaced because it broke passes a `BrokenError`)."""
        if self._closed:
            return
        self._unwatch()
        self._close_socket()
        self._fail_pending(error or ClosedError(f"the connection to {self.name} was closed"))


@types.coroutine
def _yield() -> Generator[None, None, None]:
    """Let the event loop run the other ready tasks once (``asyncio.sleep(0)`` without its
    call overhead; anyio's checkpoint adds a backend lookup, ~2 us)."""
    yield


def _no_reply_yet(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
