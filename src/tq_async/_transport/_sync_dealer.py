"""The blocking client's connection: the I/O shell under the generated `tq_async.Client`.

The blocking shell around `ConnectionCore`, which it
shares with `tq_async._transport._dealer.DealerConnection` (with what both shells do alike
in `ConnectionShell`): same wire, same semantics
(request ids,
retries that reconnect under the same identity, keep-alive resends of waiting requests,
``Cancel`` for an abandoned request, ``on_abandon`` for a reply that came too late, the
transport's failures as `BrokenError`), but all I/O happens in the calling
thread: a request sends, then waits in ``poll`` on its socket (and, for ZMQ, the socket's
monitor) until its reply, a failure or its deadline. No event loop, no thread hand-off: a
round trip costs the two wake-ups of the wire itself.

Rules a blocking connection enforces at once (never a hang):

- **One thread at a time.** A request made while another thread's request is using the
  same connection raises `InvalidRequestError` naming the rule. A one-way message (the
  clean-up of a call that returned: an ``Ack``, an unpin) sent meanwhile is left to that
  thread, which sends it while it waits and before it lets go of the connection.
- **Not on a running event loop.** A request from a thread whose event loop is running would
  stop that loop for the whole wait (and, on the loop that hosts ``local_cluster`` services,
  deadlock them): refused at once, naming `AsyncClient`.
- **Fork.** A connection opened in another process is never touched; the client above
  re-creates its connections in the child (`ClientBase._check_process`).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

from .._errors import BrokenError, ClosedError, InvalidRequestError
from .._logging import get_logger
from .._portal import check_blocking_allowed
from .._sync_primitives import next_timer, run_due_timers
from .._wire._protocol import Reply
from ._connection import (
    DEFAULT_BUSY_POLL,
    MAX_BUSY_POLL,
    Got,
    PollBackoff,
    check_frames,
)
from ._routes import copy_frames
from ._shell import ConnectionShell
from ._unix import HELLO, MessageStream, abstract_name

__all__ = ["DEFAULT_BUSY_POLL", "MAX_BUSY_POLL", "BlockingConnection", "check_frames"]

log = get_logger(__name__)

_POLLIN = int(zmq.POLLIN)
#: ms ZMQ may spend sending a closing connection's farewell messages, or the ``Cancel`` of a
#: request whose connection another thread closed (in the background)
CLOSE_LINGER_MS = 1000
#: a write to a service that reads nothing (paused) fails after this long without a timeout
_WRITE_WAIT = 60.0
#: the longest a request parks before it looks again whether another thread closed its
#: connection (sockets are not thread-safe: the closing thread leaves them to the request)
_PARK_SLICE = 1.0


class BlockingConnection(ConnectionShell):
    """One socket to one service, driven by the calling thread (see the module docstring);
    takes `ConnectionShell`'s arguments."""

    def _start(self, busy_poll: float) -> None:
        #: the failure of the connection while a request waits (raised by that request)
        self._failure: BaseException | None = None
        self._busy = threading.Lock()
        #: guards ``_owner`` and ``_closed``: a close from another thread while a request
        #: runs leaves the sockets to that request, which releases them (`_shut`)
        self._state = threading.Lock()
        self._owner: int | None = None
        #: one-way messages of threads that found the connection in use (guarded by
        #: ``_state``): the thread that holds it sends them (`_send_deferred`)
        self._deferred: list[list[Any]] = []
        self._closed = False
        self._released = False
        self._farewell: list[msgspec.Struct] = []
        self._stream: MessageStream | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._monitor = None
        self._wake_fd: int | None = None
        self._peer_gone = False
        #: the thread that read the connection last, in `is_broken`: its request reads
        #: nothing again first
        self._caught_up: int | None = None
        #: the longest a write waits for room in a full Unix socket (the request's timeout)
        self._write_wait = _WRITE_WAIT
        self._open()
        self._busy_poll = PollBackoff(busy_poll) if busy_poll > 0 and self._core.unix else None

    # ---- sockets ---------------------------------------------------------------------------

    def _open(self) -> None:
        core = self._core
        self._poller = select.poll()
        if core.unix:
            usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            # non-blocking, as the async connection's: a blocking connect waits, unbounded,
            # while the listener's queue is full; EAGAIN then, and the caller keeps the
            # socket it has (a same-host switch falls back)
            usock.setblocking(False)
            try:
                usock.connect(abstract_name(self.address))
            except BlockingIOError as exc:
                usock.close()
                raise BrokenError(
                    f"cannot connect to {self.name!r}: the service's listen queue is full"
                ) from exc
            except OSError as exc:
                usock.close()
                raise BrokenError(f"cannot connect to {self.name!r}: {exc}") from exc
            self._stream = MessageStream(usock)
            self._write([HELLO, core.identity])
            self._poller.register(usock.fileno(), select.POLLIN)
            core.connected = True
            return
        sock, monitor, route = self._dealer_socket()
        if route is not None:
            if self._wake_fd is None:
                self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            route.watchers.add(self)
        self._sock, self._monitor = sock, monitor
        self._zpoller = zmq.Poller()
        self._zpoller.register(sock, zmq.POLLIN)
        self._zpoller.register(monitor, zmq.POLLIN)
        if self._wake_fd is not None:
            self._zpoller.register(self._wake_fd, zmq.POLLIN)

    def _release(self, linger: int = 0) -> None:
        if self._stream is not None:
            self._stream.sock.close()
            self._stream = None
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            assert self._monitor is not None
            self._monitor.close(linger=0)
            self._sock.close(linger=linger)
            self._sock = self._monitor = None

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
            # (in slices: ``select`` takes no timeout of years, e.g. ``request_timeout=1e12``)
            select.select([], [stream.sock], [], min(left, _PARK_SLICE))
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
                self._unix_eof()
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
        """Block until something arrives (or ``seconds`` pass, at most `_PARK_SLICE`), then
        read it."""
        if seconds is None or seconds > _PARK_SLICE:
            seconds = _PARK_SLICE
        ms = max(0, int(seconds * 1000 + 0.999))
        if self._stream is not None:
            self._poller.poll(ms)
        else:
            events = dict(self._zpoller.poll(ms))
            if self._wake_fd is not None and self._wake_fd in events:
                with contextlib.suppress(OSError):
                    os.eventfd_read(self._wake_fd)
        self._read()

    def _on_frames(self, frames: list[Any]) -> None:
        self._core.on_message(frames)  # a reply for this thread's request waits in arrived

    def _fail(self, exc: BaseException) -> None:
        if self._core.waiting and self._failure is None:
            self._failure = exc
        self._core.forget_all()

    def _unix_eof(self) -> None:
        self._disconnected(closed_by_peer=True)

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

        Same contract as `tq_async._transport._dealer.DealerConnection.request`; an interrupt
        (``KeyboardInterrupt``) while waiting cancels the request on the service.
        """
        if not self._busy.acquire(blocking=False):
            raise self._shared_error()
        with self._state:
            self._owner = threading.get_ident()
        try:
            check_blocking_allowed(f"a blocking tq.Client request ({type(body).__name__})")
            self._check_open()
            if self._caught_up != self._owner:
                self._read()  # what happened since the last request (broken, back, late replies)
            self._caught_up = None
            self._check_usable()
            core = self._core
            if core.inproc and frames:
                frames = copy_frames(frames, incoming=False)
            rid, outgoing = core.start(body, frames)
            self._failure = None
            self._write_wait = _WRITE_WAIT if timeout is None else timeout
            try:
                with self.transport_errors(type(body).__name__):
                    self._send(outgoing)
                got = self._reply_to(rid, outgoing, timeout)
                if got is None:
                    raise core.timed_out(type(body).__name__, timeout)
                reply, rframes = got
                if reply.ok and core.inproc and rframes:
                    got = reply, copy_frames(rframes, incoming=True)
            except BaseException:
                self._abandon(rid, on_abandon, cancel_undoes)
                raise
            return core.finish(rid, got)
        finally:
            self._let_go()

    def is_broken(self) -> bool:
        """Whether the connection broke, once what happened on it since its last request is
        read (its end, a late reply): a blocking connection reads nothing between calls, so
        a service that restarted meanwhile is seen here, before the client picks the
        connection for a call (which then finds the service again instead of failing). The
        request this thread makes next does not read again. A connection another thread
        uses is left to it."""
        if not self._closed and self._busy.acquire(blocking=False):
            with self._state:
                self._owner = threading.get_ident()
            try:
                self._read()
                self._caught_up = self._owner
            finally:
                self._let_go()
        return self._core.connected is False

    def _shared_error(self) -> InvalidRequestError:
        return InvalidRequestError(
            f"this tq.Client's connection to {self.name} is in use by another thread: a "
            "blocking Client serves one thread at a time (its calls run in the calling "
            "thread); give each thread its own tq.Client, or use tq.AsyncClient"
        )

    def _check_usable(self) -> None:
        self._core.check_usable(self._closed)

    def _check_open(self) -> None:
        self._core.check_open(self._closed)

    def _reply_to(self, rid: int, outgoing: list[Any], timeout: float | None) -> Got | None:
        """The reply to ``rid``, or None once ``timeout`` passed (retries as the async
        connection does: `ConnectionShell._retry`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (step := self._core.next_wait(deadline, time.monotonic())) is not None:
            wait, last = step
            got = self._attempt(rid, wait)
            if got is not None or last:
                return got
            self._retry(rid, outgoing, deadline is None)
        return None

    def _attempt(self, rid: int, wait: float | None) -> Got | None:
        arrived = self._core.arrived

        def done() -> bool:
            return rid in arrived or self._failure is not None or self._closed

        if self._busy_poll is not None and not done():
            self._busy_poll.poll(done, self._read)
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
            if self._deferred:  # another thread's clean-up, not left waiting on this request
                self._send_deferred()
        if rid in arrived:
            return arrived.pop(rid)
        if self._closed:  # by another thread
            raise ClosedError(f"the connection to {self.name} was closed")
        assert self._failure is not None
        raise self._failure

    def send_oneway(self, body: msgspec.Struct) -> None:
        """Send a request whose reply nobody waits for (dropped on arrival); while another
        thread uses the connection, that thread sends it (see the module docstring)."""
        if self._released or self._core.pid != os.getpid():
            return  # (closed by another thread, a request's Cancel still goes out)
        frames = self._core.oneway(body)
        if self._owner == threading.get_ident():  # (within this thread's own request)
            with self.transport_errors(type(body).__name__):
                self._send(frames)
            return
        if not self._busy.acquire(blocking=False):
            with self._state:
                self._deferred.append(frames)
            self._take_over()  # (the other thread may have let go meanwhile: sent here)
            return
        with self._state:
            self._owner = threading.get_ident()
        try:
            with self.transport_errors(type(body).__name__):
                self._send(frames)
        finally:
            self._let_go()

    def _send_quietly(self, messages: Sequence[list[Any]]) -> None:
        """Send one-way messages, best effort (their senders were told so), from the thread
        that holds the connection."""
        for frames in messages:
            try:
                self._send(frames)
            except (zmq.ZMQError, OSError) as exc:
                log.debug("one-way message not sent", peer=self.name, error=str(exc))

    def _send_deferred(self) -> None:
        """Send the one-way messages other threads left to this one (it holds the connection)."""
        with self._state:
            messages, self._deferred = self._deferred, []
        self._send_quietly(messages)

    def _let_go(self) -> None:
        """Release the connection this thread holds (``_busy``), once the one-way messages
        other threads left to it are sent; a close by another thread meanwhile is carried
        out here. Looks again after the release: a message left, or a close made, just
        before it is seen to by this thread, unless another holds the connection by then
        (and sees to it itself)."""
        while True:
            if self._deferred:
                self._send_deferred()
            with self._state:
                closed = self._closed
                if not closed:
                    self._owner = None
            if closed:  # (by another thread while this request ran: its Cancel may be queued)
                self._shut(CLOSE_LINGER_MS)
                with self._state:
                    self._owner = None
            self._busy.release()
            left = self._deferred or (self._closed and not self._released)
            if not left or not self._busy.acquire(blocking=False):
                return
            with self._state:
                self._owner = threading.get_ident()

    def _take_over(self) -> None:
        """Send the messages left to the thread holding the connection, if none holds it."""
        if self._busy.acquire(blocking=False):
            with self._state:
                self._owner = threading.get_ident()
            self._let_go()

    def close(
        self, error: BaseException | None = None, *, farewell: Sequence[msgspec.Struct] = ()
    ) -> None:
        """Close the socket (in the process that opened it; a forked child leaves it be);
        ``farewell``: one-way messages sent last, best effort. Called from another thread
        while a request waits, it leaves the sockets to that request, which fails with
        `ClosedError` within `_PARK_SLICE`, sends the service its ``Cancel`` and the
        farewell, and releases them (``error`` is not used: see `retire`'s callers).
        """
        me = threading.get_ident()
        with self._state:
            if self._closed:
                return
            self._closed = True
            self._farewell = list(farewell)
            if self._owner not in (None, me):
                return
        if self._owner == me:
            self._shut()
        elif self._busy.acquire(blocking=False):
            try:
                self._shut()
            finally:
                self._busy.release()
        # (else another thread took the connection just now: it shuts it as it lets go)

    def _shut(self, linger: int = 0) -> None:
        """Release the sockets of a closed connection (once), the one-way messages left to
        it and its farewell sent first (by the thread that holds it)."""
        if self._released:
            return
        with self._state:
            messages, self._deferred = self._deferred, []
        messages += [self._core.oneway(body) for body in self._farewell]
        if self._core.pid == os.getpid():
            self._send_quietly(messages)
        self._released = True
        if self._core.pid == os.getpid():
            self._release(CLOSE_LINGER_MS if messages else linger)
            if self._wake_fd is not None:
                os.close(self._wake_fd)
                self._wake_fd = None
        self._core.forget_all()


def _nothing() -> None:
    """A blocking write drains the socket itself (no writer callback)."""
