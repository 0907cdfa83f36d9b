"""The blocking client's connection: the I/O shell under the generated :class:`tq_async.Client`.

Same wire, same semantics as :class:`tq_async._transport._dealer.DealerConnection` (request ids,
retries that reconnect under the same identity, keep-alive resends of waiting requests,
``Cancel`` for an abandoned request, ``on_abandon`` for a reply that came too late, the
transport's failures as :class:`~tq_async.BrokenError`), but all I/O happens in the calling
thread: a request sends, then waits in ``poll`` on its socket (and, for ZMQ, the socket's
monitor) until its reply, a failure or its deadline. No event loop, no thread hand-off: a
round trip costs the two wake-ups of the wire itself.

Rules a blocking connection enforces at once (never a hang):

- **One thread at a time.** A request made while another thread's request is using the
  same connection raises :class:`~tq_async.InvalidRequestError` naming the rule.
- **Not on a running event loop.** A request from a thread whose event loop is running would
  stop that loop for the whole wait (and, on the loop that hosts ``local_cluster`` services,
  deadlock them): refused at once, naming :class:`~tq_async.AsyncClient`.
- **Fork.** A connection opened in another process is never touched; the client above
  re-creates its connections in the child (:meth:`ClientBase._check_process`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import zmq
import zmq.utils.monitor

from .._errors import (
    BrokenError,
    ClosedError,
    InvalidRequestError,
    TQTimeoutError,
    error_from_wire,
)
from .._logging import get_logger
from .._portal import check_blocking_allowed
from .._sync_primitives import next_timer, run_due_timers
from .._wire._protocol import Cancel, Reply, decode_error_payload, encoder, reply_decoder
from ._dealer import (
    DEFAULT_BUSY_POLL,
    MAX_BUSY_POLL,
    check_frames,
    dropped_handshake,
    mechanism_mismatch,
    process_state,
    rejected,
)
from ._endpoints import zmq_context
from ._routes import copy_frames, local_route
from ._security import CurveClient
from ._unix import HELLO, MessageStream, abstract_name

__all__ = ["DEFAULT_BUSY_POLL", "MAX_BUSY_POLL", "BlockingConnection", "check_frames"]

log = get_logger(__name__)

_HEARTBEAT_IVL_MS = 2_000
_HEARTBEAT_TIMEOUT_MS = 10_000
_Got = tuple[Reply, list[Any]]
_POLLIN = int(zmq.POLLIN)
#: a write to a service that reads nothing (paused) fails after this long without a timeout
_WRITE_WAIT = 60.0


class _BusyPoll:
    """:class:`tq_async._transport._dealer.BusyPoll` for a blocking wait: read the Unix socket for
    up to
    ``budget`` seconds before parking in ``poll``; after a poll that caught nothing the next
    1, 2, ... 64 requests park at once."""

    __slots__ = ("_backoff", "_skip", "budget")

    def __init__(self, budget: float) -> None:
        self.budget, self._backoff, self._skip = budget, 0, 0

    def caught(self, done: Callable[[], bool], read: Callable[[], None]) -> bool:
        if self._skip:
            self._skip -= 1
            return False
        end = time.perf_counter() + self.budget
        while not done():
            read()
            if not done() and time.perf_counter() >= end:
                self._backoff = min(2 * self._backoff or 1, 64)
                self._skip = self._backoff
                return False
        self._backoff = 0
        return True


class BlockingConnection:
    """One socket to one service, driven by the calling thread (see the module docstring)."""

    def __init__(
        self,
        address: str,
        *,
        curve: CurveClient | None = None,
        on_disconnect: Callable[[], None] | None = None,
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
        #: a refused connection attempt means nothing listens there (before the first
        #: successful connection); afterwards a refusal is a restarting service
        self.refused_is_broken = refused_is_broken
        self.connected: bool | None = None
        self._broken_why: str | None = None
        self.reconnects = 0
        self._curve = curve
        self._identity = uuid.uuid4().bytes
        self._on_disconnect = on_disconnect
        self._retries = 0
        self._inflight: dict[int, list[Any]] = {}
        #: request id -> its reply, arrived (for the request that waits, or a late one)
        self._arrived: dict[int, _Got] = {}
        self._waiting: int | None = None
        self._failure: BaseException | None = None
        self._orphans: dict[int, Callable[[Reply, list[Any]], None]] = {}
        self._rids = itertools.count(1)
        self._pid = os.getpid()
        self._busy = threading.Lock()
        self._owner: int | None = None
        self._closed = False
        self.inproc = False
        self.peer_pid: int | None = None
        self._stream: MessageStream | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._wake_fd: int | None = None
        self._peer_gone = False
        self._handshaken = True
        #: the longest a write waits for room in a full Unix socket (the request's timeout)
        self._write_wait = _WRITE_WAIT
        self._open()
        self._busy_poll: _BusyPoll | None = (
            _BusyPoll(busy_poll) if busy_poll > 0 and self._stream is not None else None
        )

    # ---- sockets ---------------------------------------------------------------------------

    def _open(self) -> None:
        self._poller = select.poll()
        if self.address.startswith("uds://"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(abstract_name(self.address))
            except OSError as exc:
                sock.close()
                raise BrokenError(f"cannot connect to {self.name!r}: {exc}") from exc
            self._stream = MessageStream(sock)
            self._write([HELLO, self._identity])
            self._poller.register(sock.fileno(), select.POLLIN)
            self.connected = True
            return
        context = zmq_context()
        route = None if self._curve is not None else local_route(self.address, context)
        self.inproc = route is not None
        sock = context.socket(zmq.DEALER)
        if self._curve is not None:
            self._curve.apply(sock)
        sock.setsockopt(zmq.IDENTITY, self._identity)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        monitor = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_CONNECT_RETRIED
            | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        self._handshaken = route is not None
        try:
            if route is None:
                sock.connect(self.address)
            else:
                sock.connect(route.inproc)
                if self._wake_fd is None:
                    self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                route.watchers.add(self)
                self.connected = True
        except zmq.ZMQError as exc:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            raise BrokenError(f"cannot connect to {self.name!r}: {exc}") from exc
        self._sock, self._monitor = sock, monitor
        self._zpoller = zmq.Poller()
        self._zpoller.register(sock, zmq.POLLIN)
        self._zpoller.register(monitor, zmq.POLLIN)
        if self._wake_fd is not None:
            self._zpoller.register(self._wake_fd, zmq.POLLIN)

    def _release(self) -> None:
        if self._stream is not None:
            self._stream.sock.close()
            self._stream = None
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            assert self._monitor is not None
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._sock = self._monitor = None

    def reconnect(self) -> None:
        """Replace the socket (same identity) and resend every request still in flight."""
        if self._closed:
            return
        self._release()
        self.connected = None
        self._open()
        self.reconnects += 1
        for frames in list(self._inflight.values()):
            with contextlib.suppress(zmq.ZMQError, OSError):
                self._send(frames)

    def peer_closed(self) -> None:
        """The in-process endpoint closed (any thread): wake a waiting request."""
        self._peer_gone = True
        if self._wake_fd is not None:
            with contextlib.suppress(OSError):
                os.eventfd_write(self._wake_fd, 1)

    # ---- reading ---------------------------------------------------------------------------

    def _write(self, frames: Sequence[Any]) -> None:
        stream = self._stream
        assert stream is not None
        stream.write(frames, _nothing)
        deadline = time.monotonic() + self._write_wait
        while stream.blocked and not stream.eof:  # the socket is full: wait until it drains
            left = deadline - time.monotonic()
            if left <= 0:
                stream.eof = True  # a message half written: the stream cannot go on
                raise zmq.ZMQError(
                    zmq.EAGAIN, f"the service read nothing for {self._write_wait:g} s"
                )
            select.select([], [stream.sock], [], left)
            stream.flush()
        if stream.eof:
            raise zmq.ZMQError(zmq.EHOSTUNREACH, "the connection is closed")

    def _send(self, frames: Sequence[Any]) -> None:
        if self._stream is not None:
            if self._stream.eof:
                raise zmq.ZMQError(zmq.EHOSTUNREACH, "the connection is closed")
            self._write(frames)
        elif self._sock is not None:
            # never blocks (as the async connection): a DEALER without a peer (its inproc
            # endpoint closed) would wait forever; zmq.Again becomes BrokenError
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)

    def _read(self) -> None:
        """Take every message that arrived, without blocking."""
        if self._stream is not None:
            stream = self._stream
            stream.fill()
            while stream.messages:
                self._on_frames(stream.messages.popleft())
            if stream.eof and self.connected is not False:
                self._disconnected(closed_by_peer=True)
            return
        sock = self._sock
        if sock is None:
            return
        while int(sock.getsockopt(zmq.EVENTS)) & _POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._on_frames(frames)
        self._drain_monitor()
        if self._peer_gone and self.inproc and self.connected is not False:
            self._disconnected()

    def _park(self, seconds: float | None) -> None:
        """Block until something arrives (or ``seconds`` pass), then read it."""
        ms = -1 if seconds is None else max(0, int(seconds * 1000 + 0.999))
        if self._stream is not None:
            self._poller.poll(ms)
        else:
            events = dict(self._zpoller.poll(None if ms < 0 else ms))
            if self._wake_fd is not None and self._wake_fd in events:
                with contextlib.suppress(OSError):
                    os.eventfd_read(self._wake_fd)
        self._read()

    def _on_frames(self, frames: list[Any]) -> None:
        try:
            reply = reply_decoder.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("dropped an unreadable reply", peer=self.name)
            return
        self._inflight.pop(reply.rid, None)
        if reply.rid == self._waiting:
            self._arrived[reply.rid] = (reply, frames[1:])
            return
        orphan = self._orphans.pop(reply.rid, None)
        if orphan is not None:
            try:
                orphan(reply, frames[1:])
            except Exception:
                log.exception("undoing an abandoned request failed", peer=self.name)

    def _drain_monitor(self) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        while True:
            try:
                msg = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            parsed = zmq.utils.monitor.parse_monitor_message(msg)
            event = parsed["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
                self._retries = 0
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshaken = True
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._fail(rejected(self.name, self._curve, "rejected this client's CURVE key"))
            elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                if parsed["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                    self._fail(mechanism_mismatch(self.name, self._curve))
            elif event == zmq.EVENT_DISCONNECTED:
                self._retries = 0
                if not self._handshaken:  # dropped during the handshake: not an outage
                    self._fail(dropped_handshake(self.name, self._curve))
                self._disconnected()
            elif (
                event == zmq.EVENT_CONNECT_RETRIED
                and self.connected is not False
                and self.refused_is_broken
            ):
                # the first connection attempt was refused: nothing listens there
                self._disconnected(
                    f"nothing listens at {self.name} (the connection was refused); "
                    "check the address and that the service runs there"
                )

    def _disconnected(self, why: str | None = None, *, closed_by_peer: bool = False) -> None:
        self.connected = False
        #: a precise reason (nothing listens there) outlives the event: a request made after
        #: the event was read gives it, not a guess from the peer's process state
        self._broken_why = why
        if why is None:
            cause = "the service stopped or vanished" if closed_by_peer else self._why_broken()
            why = (
                f"the connection to {self.name} broke ({cause}); requests in flight are "
                "lost: retry once it is back"
            )
        self._fail(BrokenError(why))
        if self._on_disconnect is not None:
            self._on_disconnect()

    def _fail(self, exc: BaseException) -> None:
        if self._waiting is not None and self._failure is None:
            self._failure = exc
        self._inflight.clear()
        self._orphans.clear()

    # ---- requests --------------------------------------------------------------------------

    def request(
        self,
        body: msgspec.Struct,
        frames: Sequence[Any] = (),
        *,
        timeout: float | None = None,
        on_abandon: Callable[[Reply, list[Any]], None] | None = None,
        cancel_undoes: bool = False,
    ) -> tuple[msgspec.Raw, list[Any]]:
        """Send ``body`` (+ data frames) and wait, in this thread, for the reply.

        Same contract as :meth:`tq_async._transport._dealer.DealerConnection.request`; an interrupt
        (``KeyboardInterrupt``) while waiting cancels the request on the service.
        """
        if not self._busy.acquire(blocking=False):
            raise self._shared_error()
        self._owner = threading.get_ident()
        try:
            check_blocking_allowed(f"a blocking tq.Client request ({type(body).__name__})")
            self._check_open()
            self._read()  # what happened since the last request (broken, back, late replies)
            self._check_usable()
            if self.inproc and frames:
                frames = copy_frames(frames, incoming=False)
            rid = next(self._rids)
            outgoing = [_encode_request(rid, body), *frames]
            self._inflight[rid] = outgoing
            self._waiting, self._failure = rid, None
            self._write_wait = _WRITE_WAIT if timeout is None else timeout
            try:
                with self.transport_errors(type(body).__name__):
                    self._send(outgoing)
                got = self._reply_to(rid, outgoing, timeout)
                if got is None:
                    raise TQTimeoutError(
                        f"{type(body).__name__} to {self.name} got no reply within "
                        f"{timeout} s; {self._why_silent()}"
                    )
                reply, rframes = got
                if reply.ok and self.inproc and rframes:
                    rframes = copy_frames(rframes, incoming=True)
            except BaseException:
                self._abandon(rid, on_abandon, cancel_undoes)
                raise
            finally:
                self._waiting = None
            if not reply.ok:
                kind, message = decode_error_payload(reply.payload)
                raise error_from_wire(kind, message)
            return reply.payload, rframes
        finally:
            self._owner = None
            self._busy.release()

    def _shared_error(self) -> InvalidRequestError:
        return InvalidRequestError(
            f"this tq.Client's connection to {self.name} is in use by another thread: a "
            "blocking Client serves one thread at a time (its calls run in the calling "
            "thread); give each thread its own tq.Client, or use tq.AsyncClient"
        )

    def _check_usable(self) -> None:
        self._check_open()
        if self.connected is False:
            if self._broken_why is not None:
                raise BrokenError(self._broken_why)
            raise BrokenError(
                f"the connection to {self.name} is broken ({self._why_broken()}); retry "
                "once it is back"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"the connection to {self.name} is closed")
        if self._pid != os.getpid():
            raise ClosedError(
                "this connection was opened in another process (before a fork); its client "
                "re-creates its connections in this process on its next call"
            )

    def _reply_to(self, rid: int, outgoing: list[Any], timeout: float | None) -> _Got | None:
        """The reply to ``rid``, or None once ``timeout`` passed (retries as the async
        connection does: reconnect with a deadline, keep-alive resend without)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            wait = (
                remaining
                if self.retry_after is None
                else (self.retry_after if remaining is None else min(self.retry_after, remaining))
            )
            if wait is not None and wait <= 0:
                return None
            got = self._attempt(rid, wait)
            if got is not None:
                return got
            if remaining is not None and wait is not None and wait >= remaining:
                return None
            if deadline is None:
                with contextlib.suppress(zmq.ZMQError, OSError):
                    self._send(outgoing)
            else:
                log.info("no reply yet: reconnecting and retrying", peer=self.name, rid=rid)
                self.reconnect()

    def _attempt(self, rid: int, wait: float | None) -> _Got | None:
        arrived = self._arrived

        def done() -> bool:
            return rid in arrived or self._failure is not None

        if self._busy_poll is not None and not done():
            self._busy_poll.caught(done, self._read)
        end = None if wait is None else time.monotonic() + wait
        while not done():
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return None
            timer = next_timer()
            if timer is not None and (left is None or timer < left):
                left = timer
            self._park(left)
            run_due_timers()
        if self._failure is not None:
            raise self._failure
        return arrived.pop(rid)

    def _abandon(
        self,
        rid: int,
        on_abandon: Callable[[Reply, list[Any]], None] | None,
        cancel_undoes: bool = False,
    ) -> None:
        self._inflight.pop(rid, None)
        got = self._arrived.pop(rid, None)
        if got is not None:
            if on_abandon is not None:
                try:
                    on_abandon(*got)
                except Exception:
                    log.exception("undoing an abandoned request failed", peer=self.name)
            return
        if on_abandon is not None and not cancel_undoes:
            self._orphans[rid] = on_abandon  # (the service undoes it itself otherwise)
        self.send_best_effort(Cancel(rid))

    def send_oneway(self, body: msgspec.Struct) -> None:
        """Send a request whose reply nobody waits for (dropped on arrival)."""
        if self._closed or self._pid != os.getpid():
            return
        if self._owner not in (None, threading.get_ident()):
            raise self._shared_error()
        with self.transport_errors(type(body).__name__):
            self._send([encoder.encode((next(self._rids), body))])

    def send_best_effort(self, body: msgspec.Struct) -> bool:
        """:meth:`send_oneway` whose failure is logged, not raised (clean-up messages)."""
        try:
            self.send_oneway(body)
        except (BrokenError, InvalidRequestError) as exc:
            log.debug("one-way message not sent", peer=self.name, error=str(exc))
            return False
        return not self._closed

    @contextlib.contextmanager
    def transport_errors(self, what: str) -> Iterator[None]:
        """The transport's own failures become :class:`BrokenError`."""
        try:
            yield
        except (zmq.ZMQError, OSError) as exc:
            raise BrokenError(
                f"{what} to {self.name} failed: {exc} (the service stopped or vanished); "
                "retry once it is back"
            ) from exc

    def _why_silent(self) -> str:
        if process_state(self.peer_pid) is not None:
            return f"{self._why_broken()}; raise the timeout if it is only slow"
        return "check that the service is running, or raise the timeout"

    def _why_broken(self) -> str:
        state = process_state(self.peer_pid)
        if state is None:
            return (
                "the service stopped or vanished"
                if self.peer_pid is not None
                else "the service stopped, vanished or is not answering"
            )
        paused = " and is paused (SIGSTOP)" if state in ("T", "t") else ""
        return f"the service is not answering: its process {self.peer_pid} still exists{paused}"

    def close(self) -> None:
        """Close the socket (in the process that opened it; a forked child leaves it be)."""
        if self._closed:
            return
        self._closed = True
        if self._pid == os.getpid():
            self._release()
            if self._wake_fd is not None:
                os.close(self._wake_fd)
                self._wake_fd = None
        self._inflight.clear()
        self._orphans.clear()


def _nothing() -> None:
    """A blocking write drains the socket itself (no writer callback)."""


def _encode_request(rid: int, body: msgspec.Struct) -> bytes:
    try:
        return encoder.encode((rid, body))
    except (TypeError, OverflowError, UnicodeEncodeError, ValueError) as exc:
        raise InvalidRequestError(
            f"{type(body).__name__} cannot be sent: {exc}; pass ids as valid UTF-8 text, "
            "ints within 64 bits and plain values (None, bool, int, float, str, bytes, "
            "lists and dicts of those)"
        ) from None
