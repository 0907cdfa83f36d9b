"""The client's connection: one DEALER socket per service, any number of requests in flight.

Requests are ``[header, *frames]`` with ``header = msgpack([rid, body])``; each awaits its own
future and replies may come in any order. A request with a deadline that has no reply after
``retry_after`` seconds reconnects (same identity) and is sent again: services deduplicate
retried requests, so nothing runs twice. The connection follows the service's liveness
(ZMTP heartbeats, the socket monitor) and reports it through callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio.lowlevel
import msgspec
import zmq
import zmq.utils.monitor

from .._errors import (
    AuthenticationError,
    BrokenError,
    ClosedError,
    InvalidRequestError,
    ProtocolError,
    TQTimeoutError,
    error_from_wire,
)
from .._logging import get_logger
from .._wire._protocol import Cancel, Reply, decode_error_payload, encoder, reply_decoder
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


#: Seconds a client's request polls a same-host connection for its reply (:class:`BusyPoll`).
DEFAULT_BUSY_POLL = 1e-4
#: the longest poll a client may ask for (longer would only burn CPU: a reply that takes
#: longer is worth parking for)
MAX_BUSY_POLL = 0.01
#: ZMTP heartbeats on client connections: a silent peer is dropped after the timeout.
_HEARTBEAT_IVL_MS = 2_000
_HEARTBEAT_TIMEOUT_MS = 10_000


class BusyPoll:
    """Whether, and how long, a request reads its connection for the reply before parking.

    A parked process takes 25-30 us to wake up on the VMs this runs on, and a round trip
    between two processes crosses two wake-ups: a blocking Unix-socket ping-pong measured
    ~60 us, the same with both sides polling ~4 us, and asyncio on both sides 78 us against
    23 us when the client polls for the reply (``python -m benchmarks.probes socket-rtt``,
    40-byte messages, 2-vCPU VM).
    So a request on a same-host connection with nothing else in flight yields to the event
    loop once (other tasks run, and a fast reply is often there already), then reads its
    socket for up to ``budget`` seconds before it parks like any other.

    Polling costs CPU for as long as it lasts, and finds nothing when the service has a
    reason to wait (a get_meta waiting for data): after a poll that caught nothing, the next
    1, 2, 4, ... 64 requests park at once; a caught reply resets that. Services never poll.
    """

    __slots__ = ("_backoff", "_skip", "budget", "caught_replies", "missed_replies")

    #: the most requests that park at once after polls that caught nothing
    MAX_SKIP = 64

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self._backoff = 0
        self._skip = 0
        #: polls that caught their reply / that spent the budget and parked
        self.caught_replies = 0
        self.missed_replies = 0

    async def caught(self, fut: asyncio.Future[Any], read: Callable[[], None]) -> bool:
        """Yield once, then ``read()`` until ``fut`` is done or the budget is spent.

        Returns:
            True when ``fut`` is done (its reply, or the connection's failure, arrived).
        """
        if self._skip:
            self._skip -= 1
            return False
        await anyio.lowlevel.checkpoint()  # fairness: a call never completes without yielding
        end = time.perf_counter() + self.budget
        while not fut.done():
            read()
            if not fut.done() and time.perf_counter() >= end:
                self.missed_replies += 1
                self._backoff = min(2 * self._backoff or 1, self.MAX_SKIP)
                self._skip = self._backoff
                return False
        self.caught_replies += 1
        self._backoff = 0
        return True


class DealerConnection(DrainedSocket):
    """One DEALER socket to one service, shared by every request of one client.

    Requests are ``[header, *frames]`` with ``header = msgpack([rid, body])``. Each call
    awaits its own future; replies may come in any order. With ``busy_poll`` > 0, a request
    over a same-host Unix socket polls for its reply briefly before parking
    (:class:`BusyPoll`).
    """

    _pid_counter = itertools.count(1)

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
        #: a refused connection attempt counts as broken (requests fail fast with
        #: BrokenError instead of waiting for a peer that is not there, e.g. a storage
        #: unit that was restarted on another address)
        self.refused_is_broken = refused_is_broken
        #: False once the connection broke, until it is re-established
        self.connected: bool | None = None
        self._broken_why: str | None = None
        self.reconnects = 0
        self._context = context or zmq_context()
        self._curve = curve
        # a fixed identity: after a reconnect the service routes replies to the new socket
        # and recognises retried requests (same identity, same request id)
        self._identity = uuid.uuid4().bytes
        self._on_disconnect = on_disconnect
        self._on_connect = on_connect
        self._on_refused = on_refused
        self._retries = 0
        self._heartbeat_timeout_ms = (
            _HEARTBEAT_TIMEOUT_MS if heartbeat_timeout is None else int(heartbeat_timeout * 1000)
        )
        self._pending: dict[int, _ReplyFuture] = {}
        self._inflight: dict[int, list[Any]] = {}
        self._orphans: dict[int, Callable[[Reply, list[zmq.Frame]], None]] = {}
        self._rids = itertools.count(1)
        self._pid = os.getpid()
        #: connected through the in-process twin of the service's endpoint
        self.inproc = False
        #: the service's process, when known to be on this host (its shared-memory hello)
        self.peer_pid: int | None = None
        sock, monitor = self._open()
        super().__init__(sock)
        self._watch(monitor)
        #: only a Unix socket's reply can be read by polling (ZMQ's arrive through its I/O
        #: thread; an in-process service runs on this very loop)
        unix = isinstance(sock, UnixSocket)
        self._busy_poll = BusyPoll(busy_poll) if busy_poll > 0 and unix else None

    def _open(self) -> tuple[Any, zmq.Socket[Any] | None]:
        if self.address.startswith("uds://"):
            try:
                usock = UnixSocket(self.address, self._identity, self._unix_eof)
            except OSError as exc:
                raise BrokenError(f"cannot connect to {self.name!r}: {exc}") from exc
            self.connected = True
            return usock, None
        route = None if self._curve is not None else local_route(self.address, self._context)
        self.inproc = route is not None
        sock = self._context.socket(zmq.DEALER)
        if self._curve is not None:
            self._curve.apply(sock)
        sock.setsockopt(zmq.IDENTITY, self._identity)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        # a peer whose host vanishes without closing the connection is noticed by heartbeats
        timeout_ms = self._heartbeat_timeout_ms
        sock.setsockopt(zmq.HEARTBEAT_IVL, min(_HEARTBEAT_IVL_MS, max(timeout_ms // 4, 50)))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        # a closed connection is reported on this monitor socket (no polling); a refused
        # connection attempt tells that nothing listens at the address (any more)
        monitor = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_CONNECT_RETRIED
            | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        )
        #: the security handshake (NULL or CURVE) completed on this socket
        self._handshaken = route is not None
        try:
            if route is None:
                sock.connect(self.address)
            else:
                sock.connect(route.inproc)
                route.watchers.add(self)
                self.connected = True  # inproc reports no connection events
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
        self.connected = None
        sock, monitor = self._open()
        self.reconnects += 1
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
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            parsed = zmq.utils.monitor.parse_monitor_message(msg)
            event = parsed["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
                self._retries = 0
                if self._on_connect is not None:
                    self._on_connect()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshaken = True
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._fail_pending(
                    rejected(self.name, self._curve, "rejected this client's CURVE key")
                )
            elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                if parsed["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                    self._fail_pending(mechanism_mismatch(self.name, self._curve))
            elif event == zmq.EVENT_DISCONNECTED:
                self._retries = 0
                if not self._handshaken:  # dropped during the handshake: not an outage
                    self._fail_pending(dropped_handshake(self.name, self._curve))
                self._disconnected()
            elif event != zmq.EVENT_CONNECT_RETRIED:
                continue
            elif self.connected is not False:
                # the first connection attempt was refused: nothing listens there
                if self.refused_is_broken:
                    self._disconnected(
                        f"nothing listens at {self.name} (the connection was refused); "
                        "check the address and that the service runs there"
                    )
            else:
                # libzmq reports one retry when it schedules the reconnection after a
                # disconnect; a second one means a connection attempt failed: nothing
                # listens there any more (a paused process still accepts connections)
                self._retries += 1
                if self._retries == 2 and self._on_refused is not None:
                    self._on_refused()

    def _disconnected(self, why: str | None = None, *, closed_by_peer: bool = False) -> None:
        self.connected = False
        #: a precise reason (nothing listens there) outlives the event: a request made after
        #: the event was read gives it, not a guess from the peer's process state
        self._broken_why = why
        if why is None:
            # a peer that closed the connection itself is gone (a paused one closes nothing)
            cause = "the service stopped or vanished" if closed_by_peer else self._why_broken()
            why = (
                f"the connection to {self.name} broke ({cause}); requests in flight are "
                "lost: retry once it is back"
            )
        self._fail_pending(BrokenError(why))
        if self._on_disconnect is not None:
            self._on_disconnect()

    def peer_closed(self) -> None:
        """The in-process endpoint closed (inproc reports no disconnect event); thread-safe."""

        def on_loop() -> None:
            if self.inproc and not self._closed:
                self._disconnected()

        with contextlib.suppress(RuntimeError):  # the connection's loop is closed already
            self._loop.call_soon_threadsafe(on_loop)

    def _fail_pending(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, {}
        self._inflight.clear()
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._orphans.clear()

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        try:
            reply = reply_decoder.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("dropped an unreadable reply", peer=self.name)
            return
        data = frames[1:]
        fut = self._pending.get(reply.rid)
        self._inflight.pop(reply.rid, None)
        if fut is not None:
            # the entry stays until the request itself ends: a request cancelled after its
            # reply arrived, but before it ran again, still finds the reply (_abandon)
            if not fut.done():
                fut.set_result((reply, data))
            elif _holds_reply(fut) is None:
                # the attempt's timer fired, or the caller was cancelled, just before: keep
                # the reply for the next attempt or for _abandon
                self._pending[reply.rid] = arrived = self._loop.create_future()
                arrived.set_result((reply, data))
            return
        orphan = self._orphans.pop(reply.rid, None)
        if orphan is not None:
            orphan(reply, data)

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
        self._check_usable()
        if self.inproc and frames:
            frames = await private_frames(frames, incoming=False)
        rid = next(self._rids)
        outgoing = [_encode_request(rid, body), *frames]
        self._inflight[rid] = outgoing
        try:
            self._send(outgoing)
        except (zmq.ZMQError, OSError) as exc:  # (a context manager costs ~1 us a call)
            self._inflight.pop(rid, None)
            raise self._broken(type(body).__name__, exc) from exc
        try:
            got = await self._reply_to(rid, outgoing, timeout)
            if got is None:
                raise TQTimeoutError(
                    f"{type(body).__name__} to {self.name} got no reply within {timeout} "
                    f"s; {self._why_silent()}"
                )
            reply, rframes = got
            if reply.ok and self.inproc and rframes:
                rframes = await private_frames(rframes, incoming=True)
        except BaseException:
            # cancelled or timed out at any point, even after the reply arrived: the
            # service is told, or the reply goes to on_abandon (the caller never saw it)
            self._abandon(rid, on_abandon, cancel_undoes)
            raise
        self._pending.pop(rid, None)
        if not reply.ok:
            kind, message = decode_error_payload(reply.payload)
            raise error_from_wire(kind, message)
        return reply.payload, rframes

    def _check_usable(self) -> None:
        """Raise if a request cannot be sent on this connection at all."""
        if self._closed:
            raise ClosedError(f"the connection to {self.name} is closed")
        if self._pid != os.getpid():
            raise ClosedError(
                "this connection was opened in another process (before a fork); "
                "connect a new client in this process"
            )
        if self.connected is False:
            if self._broken_why is not None:
                raise BrokenError(self._broken_why)
            raise BrokenError(
                f"the connection to {self.name} is broken ({self._why_broken()}); retry "
                "once it is back"
            )

    def _why_silent(self) -> str:
        """What a timed-out request's caller should check."""
        if process_state(self.peer_pid) is not None:
            return f"{self._why_broken()}; raise the timeout if it is only slow"
        return "check that the service is running, or raise the timeout"

    def _why_broken(self) -> str:
        """Why the service went away, as far as this side can tell: a same-host service
        whose process still exists is only not answering (paused, swapping, overloaded)."""
        state = process_state(self.peer_pid)
        if state is None:
            # across hosts a paused service and a vanished one look the same
            known = self.peer_pid is not None
            return (
                "the service stopped or vanished"
                if known
                else ("the service stopped, vanished or is not answering")
            )
        paused = " and is paused (SIGSTOP)" if state in ("T", "t") else ""
        return f"the service is not answering: its process {self.peer_pid} still exists{paused}"

    async def _reply_to(
        self, rid: int, outgoing: list[Any], timeout: float | None
    ) -> tuple[Reply, list[zmq.Frame]] | None:
        """The reply to ``rid``, or None once ``timeout`` passed without one.

        Every ``retry_after`` seconds without a reply, the request goes out again: a request
        with a deadline reconnects first (its reply may have been lost with the connection);
        one without (e.g. a get_meta waiting for data) is re-sent as a keep-alive, which the
        service ignores while the request is pending and answers from its reply cache if the
        reply was lost.
        """
        loop = self._loop
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            remaining = None if deadline is None else deadline - loop.time()
            wait = _first_of(remaining, self.retry_after)
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
            elif self._edge_triggered:  # ZMQ; a Unix socket is level-triggered
                log.info("no reply yet: reconnecting and retrying", peer=self.name, rid=rid)
                self.reconnect()
            # A Unix socket loses no reply without ending (its end is reported): silence is a
            # busy service, and waiting up to the deadline is the backpressure. Reconnecting
            # there made thousands of waiting clients storm a saturated service's listen queue
            # (8,192 clients: BrokenError "listen queue is full", benchmarks/RESULTS.md).

    async def _attempt(self, rid: int, wait: float | None) -> tuple[Reply, list[zmq.Frame]] | None:
        """Wait up to ``wait`` seconds (None: no limit) for ``rid``'s reply; None if none came.

        One plain loop timer per attempt resolves the future with None: anyio.fail_after or
        asyncio.wait cost 30+ us each on this path.
        """
        pending = self._pending
        if rid in pending:
            got = _holds_reply(pending[rid])
            if got is not None:
                return got  # arrived as the last attempt's timer fired
        alone = len(pending) == (rid in pending)
        fut: _ReplyFuture = self._loop.create_future()
        pending[rid] = fut
        if alone and self._busy_poll is not None and await self._busy_poll.caught(fut, self._drain):
            return fut.result()
        if wait is None:
            return await fut
        timer = self._loop.call_later(wait, _no_reply_yet, fut)
        try:
            return await fut
        finally:
            timer.cancel()

    def _abandon(
        self,
        rid: int,
        on_abandon: Callable[[Reply, list[zmq.Frame]], None] | None,
        cancel_undoes: bool = False,
    ) -> None:
        self._inflight.pop(rid, None)
        fut = self._pending.pop(rid, None)
        got = None if fut is None else _holds_reply(fut)
        if got is not None:
            # the reply arrived, but the caller gave up before it saw it
            if on_abandon is not None:
                try:
                    on_abandon(*got)
                except Exception:  # clean-up must not replace the caller's own error
                    log.exception("undoing an abandoned request failed", peer=self.name)
            return
        if on_abandon is not None and not cancel_undoes:
            self._orphans[rid] = on_abandon
        self.send_best_effort(Cancel(rid))

    def send_oneway(self, body: msgspec.Struct) -> None:
        """Send a request whose reply nobody waits for (it is dropped on arrival).

        Raises:
            BrokenError: the connection is broken (nothing was sent).
        """
        if not self._closed:
            with self.transport_errors(type(body).__name__):
                self._send([encoder.encode((next(self._rids), body))])

    def send_best_effort(self, body: msgspec.Struct) -> bool:
        """:meth:`send_oneway` for clean-up that must not replace the caller's outcome (an
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
        socket's ``OSError``) become :class:`BrokenError` for every call of the client,
        requests and one-way messages alike."""
        try:
            yield
        except (zmq.ZMQError, OSError) as exc:
            raise self._broken(what, exc) from exc

    def _broken(self, what: str, exc: BaseException) -> BrokenError:
        """The error of a send the transport refused (see :meth:`transport_errors`)."""
        return BrokenError(
            f"{what} to {self.name} failed: {exc} ({self._why_broken()}); retry once it is back"
        )

    def close(self) -> None:
        """Close the socket; requests still waiting fail with :class:`ClosedError`."""
        if self._closed:
            return
        self._unwatch()
        self._close_socket()
        self._fail_pending(ClosedError(f"the connection to {self.name} was closed"))


def mechanism_mismatch(address: str, curve: CurveClient | None) -> AuthenticationError:
    """The service and this client disagree on CURVE (one uses it, the other not)."""
    if curve is None:
        return rejected(address, curve, "uses CURVE encryption")
    return AuthenticationError(
        f"the service at {address} does not use CURVE encryption: connect without "
        "curve=, or start the services with CURVE keys (--curve-cert)"
    )


def dropped_handshake(address: str, curve: CurveClient | None) -> BrokenError:
    """The peer closed the connection before the ZMTP handshake completed."""
    if curve is not None:  # most likely the wrong server key
        return rejected(address, curve, "dropped the security handshake")
    # a CURVE service announces its mechanism first (EVENT_HANDSHAKE_FAILED_PROTOCOL):
    # a bare drop is a peer that accepts connections but does not speak ZMTP
    return BrokenError(
        f"the peer at {address} accepted the connection and closed it before the "
        "ZMTP handshake: what listens there is not a tq_async service (or it was "
        "stopping); check the address (the TQ_ADDRESS=... line `tq-async serve` prints)"
    )


def rejected(address: str, curve: CurveClient | None, what: str) -> AuthenticationError:
    """The service refused this client's security handshake (``what`` it did)."""
    if curve is None:
        hint = (
            "the services there use CURVE keys (connect with curve=tq.CurveClient("
            "server_public, client_public, client_secret))"
        )
    else:
        hint = (
            "check that server_public_key is the services' public key and that this "
            "client's public key is in their allow-list (--curve-allow); retrying with "
            "the same keys fails the same way"
        )
    return AuthenticationError(f"the service at {address} {what}: {hint}")


def _encode_request(rid: int, body: msgspec.Struct) -> bytes:
    """The request header; a value msgpack cannot carry is the caller's error, raised
    before anything is sent (a safety net: the client checks arguments more precisely)."""
    try:
        return encoder.encode((rid, body))
    except (TypeError, OverflowError, UnicodeEncodeError, ValueError) as exc:
        raise InvalidRequestError(
            f"{type(body).__name__} cannot be sent: {exc}; pass ids as valid UTF-8 text, "
            "ints within 64 bits and plain values (None, bool, int, float, str, bytes, "
            "lists and dicts of those)"
        ) from None


#: a request's reply, or None when an attempt's timer fired first
_ReplyFuture = asyncio.Future[tuple[Reply, list[zmq.Frame]] | None]


def process_state(pid: int | None) -> str | None:
    """The state letter of a process of this host (``R``, ``S``, ``T``...), None if gone
    or unknown."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) S ...": comm may hold spaces and parentheses, the state follows the last ")"
    fields = stat[stat.rfind(b")") + 2 :].split(b" ", 1)
    state = fields[0].decode(errors="replace")
    return None if state in ("Z", "X", "x") else state


def _holds_reply(fut: _ReplyFuture) -> tuple[Reply, list[zmq.Frame]] | None:
    """The reply ``fut`` resolved to; None while it waits, or if it timed out, was
    cancelled or failed."""
    if not fut.done() or fut.cancelled() or fut.exception() is not None:
        return None
    return fut.result()


def _no_reply_yet(fut: _ReplyFuture) -> None:
    if not fut.done():
        fut.set_result(None)


def _first_of(remaining: float | None, retry_after: float | None) -> float | None:
    """Seconds the next attempt waits: until the deadline or the next retry, if any."""
    if retry_after is None:
        return remaining
    return retry_after if remaining is None else min(retry_after, remaining)


def check_frames(frames: Sequence[zmq.Frame], expected: int, what: str) -> None:
    """Raise :class:`ProtocolError` if a message does not carry ``expected`` data frames."""
    if len(frames) != expected:
        raise ProtocolError(f"{what} carries {len(frames)} data frames, expected {expected}")
