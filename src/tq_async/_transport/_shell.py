"""What the two client connection shells do alike around their `ConnectionCore`.

The asynchronous `tq_async._transport._dealer.DealerConnection` and the blocking
`tq_async._transport._sync_dealer.BlockingConnection` differ in how they wait (a future on
the event loop, ``poll`` in the calling thread); everything else they do the same way, here:
the options they take, the DEALER socket they open (and its in-process twin), following its
monitor, reconnecting and resending what is in flight, a broken connection, an abandoned
request, one-way messages and the transport's failures as `BrokenError`.

A shell supplies its I/O: ``_send`` (frames to the socket), ``_open``/``_release`` (its
socket, replaced on a reconnect), ``_fail`` (the requests that wait fail), ``_unix_eof``
(its Unix socket ended), ``_closed`` and ``_monitor`` (None: a Unix socket reports its end
itself), and ``send_oneway``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.utils.monitor

from .._errors import BrokenError, InvalidRequestError
from .._logging import get_logger
from .._wire._protocol import Cancel, Reply
from ._connection import MONITOR_EVENTS, ConnectionCore, heartbeat_ms
from ._endpoints import zmq_context
from ._routes import LocalRoute, local_route
from ._security import CurveClient

__all__ = ["ConnectionShell"]

log = get_logger(__name__)


class ConnectionShell:
    """The part of a client connection both shells share (see the module docstring).

    Args:
        address: the service's address (``tcp://``, ``ipc://``, ``inproc://`` or a same-host
            ``uds://``).
        context: the ZMQ context (default: the process's).
        curve: CURVE keys (None: no encryption).
        on_disconnect: called when the connection breaks.
        on_connect: called when it is (re-)established.
        on_refused: called when a connection attempt was refused (after a disconnect, or
            before the connection was ever up).
        heartbeat_timeout: seconds of silence after which ZMTP heartbeats drop the peer.
        retry_after: seconds without a reply after which a request goes out again.
        refused_is_broken: a refused connection attempt counts as broken.
        busy_poll: seconds a request on a same-host Unix socket polls for its reply.
        known_as: the address the program gave, when ``address`` is its same-host twin.
    """

    _closed: bool
    _monitor: zmq.Socket[Any] | None

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
        self._core = ConnectionCore(
            address,
            known_as=known_as,
            curve=curve,
            refused_is_broken=refused_is_broken,
            retry_after=retry_after,
        )
        self.address = address
        #: the address the program gave, when ``address`` is its same-host twin
        self.known_as = self._core.known_as
        #: how messages name the peer: the program's address, then the socket used
        self.name = self._core.name
        self._context = context or zmq_context()
        self._on_disconnect = on_disconnect
        self._on_connect = on_connect
        self._on_refused = on_refused
        self._heartbeat = heartbeat_ms(heartbeat_timeout)
        #: the messages in flight (the core's table), re-sent after a reconnect
        self._inflight = self._core.inflight
        self._start(busy_poll)

    # ---- what a shell supplies ---------------------------------------------------------------

    if TYPE_CHECKING:  # (declared only: `DrainedSocket` supplies ``_send`` to the async shell)
        #: the socket the shell owns (each shell sets it)
        _sock: Any

        def _send(self, frames: Sequence[Any]) -> None: ...

        def send_oneway(self, body: msgspec.Struct) -> None: ...

        def close(
            self, error: BaseException | None = None, *, farewell: Sequence[msgspec.Struct] = ()
        ) -> None: ...

    def _start(self, busy_poll: float) -> None:
        """Open the socket and set up the shell's own state (the end of ``__init__``)."""
        raise NotImplementedError

    def _open(self) -> None:
        """Open a socket (same identity) in place of the released one."""
        raise NotImplementedError

    def _release(self) -> None:
        """Close the socket (and stop following it)."""
        raise NotImplementedError

    def _fail(self, exc: BaseException) -> None:
        """The requests that wait fail with ``exc``; nothing in flight is re-sent."""
        raise NotImplementedError

    def _unix_eof(self) -> None:
        """The Unix socket ended (its peer closed it, or a write found it dead)."""
        raise NotImplementedError

    # ---- the core's state, as the client sees it ---------------------------------------------

    @property
    def connected(self) -> bool | None:
        """None until the first connection, False once broken (until it is back)."""
        return self._core.connected

    def is_broken(self) -> bool:
        """Whether the connection broke (``connected`` is False, until it is back), as far
        as this shell has read it: the blocking one reads what happened first."""
        return self._core.connected is False

    @property
    def refused_is_broken(self) -> bool:
        """A refused connection attempt counts as broken (see `ConnectionCore`)."""
        return self._core.refused_is_broken

    @refused_is_broken.setter
    def refused_is_broken(self, value: bool) -> None:
        self._core.refused_is_broken = value

    @property
    def reconnects(self) -> int:
        """How many times the socket was replaced (after a request got no reply in time)."""
        return self._core.reconnects

    @property
    def inproc(self) -> bool:
        """Connected through the in-process twin of the service's endpoint."""
        return self._core.inproc

    @property
    def peer_pid(self) -> int | None:
        """The service's process, when known to be on this host (its shared-memory hello)."""
        return self._core.peer_pid

    @peer_pid.setter
    def peer_pid(self, pid: int | None) -> None:
        self._core.peer_pid = pid

    # ---- the socket --------------------------------------------------------------------------

    def _dealer_socket(self) -> tuple[zmq.Socket[Any], zmq.Socket[Any], LocalRoute | None]:
        """A DEALER socket to the service, its monitor, and the endpoint's in-process twin it
        goes through (None: over the address); the shell registers with that route.

        Raises:
            InvalidRequestError: ZMQ cannot parse the address.
            BrokenError: the socket cannot connect.
        """
        core = self._core
        curve = core.curve
        route = None if curve is not None else local_route(core.address, self._context)
        core.inproc = route is not None
        sock = self._context.socket(zmq.DEALER)
        if curve is not None:
            curve.apply(sock)
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
            sock.connect(core.address if route is None else route.inproc)
        except zmq.ZMQError as exc:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            if exc.errno == zmq.EINVAL:  # malformed: a retry fails the same way
                raise InvalidRequestError(
                    f"cannot connect to {self.name!r}: {exc}; write the address as "
                    "tcp://HOST:PORT (the TQ_ADDRESS=... line `tq-async serve` prints)"
                ) from exc
            raise BrokenError(f"cannot connect to {self.name!r}: {exc}") from exc
        if route is not None:
            core.connected = True  # inproc reports no connection events
        return sock, monitor, route

    def reconnect(self) -> None:
        """Replace the socket (same identity) and resend every request still in flight.

        Services deduplicate by (identity, request id), so a request that did arrive is
        not executed twice: its cached reply is sent again.
        """
        if self._closed:
            return
        self._release()
        self._core.connected = None
        self._open()
        self._core.reconnects += 1
        for frames in list(self._inflight.values()):
            with contextlib.suppress(zmq.ZMQError, OSError):
                self._send(frames)
        for rid in list(self._core.cancelled):  # (the service ignores a second Cancel)
            with contextlib.suppress(zmq.ZMQError, OSError):
                self._send(self._core.oneway(Cancel(rid)))

    def _retry(self, rid: int, outgoing: list[Any], keepalive: bool) -> None:
        """A request got no reply within ``retry_after`` seconds (see `first_of`): without
        a deadline it goes out again as a keep-alive; with one, over ZMQ, the socket is
        replaced and it is resent (a Unix socket loses no reply without ending)."""
        if keepalive:
            with contextlib.suppress(zmq.ZMQError, OSError):
                self._send(outgoing)
        elif not self._core.unix:
            log.info("no reply yet: reconnecting and retrying", peer=self.name, rid=rid)
            self.reconnect()

    def _drain_monitor(self) -> None:
        """Act on what the socket's monitor reported (`ConnectionCore.on_monitor`)."""
        monitor = self._monitor
        if self._closed or monitor is None:
            return
        while True:
            try:
                msg = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:  # (zmq.Again: nothing more)
                return
            parsed = zmq.utils.monitor.parse_monitor_message(msg)
            seen = self._core.on_monitor(parsed["event"], parsed["value"])
            if seen.connected and self._on_connect is not None:
                self._on_connect()
            if seen.fail is not None:
                self._fail(seen.fail)
            if seen.broken:
                self._disconnected(seen.why)
            if seen.refused and self._on_refused is not None:
                self._on_refused()

    def _disconnected(self, why: str | None = None, *, closed_by_peer: bool = False) -> None:
        self._fail(self._core.disconnected(why, closed_by_peer=closed_by_peer))
        self._purge()
        if self._on_disconnect is not None:
            self._on_disconnect()

    def break_off(self, why: str) -> None:
        """Break the connection as a disconnect does (``why``: the requests' `BrokenError`),
        for an owner that declared its peer gone while no break was reported: a connection
        refused before its handshake ever completed reports none, and what was sent on it
        waits (ZMQ keeps it for a peer that may come) -- the waiting requests fail, the
        socket's queue is dropped, ``on_disconnect`` runs."""
        if not self._closed:
            self._disconnected(why)

    def _purge(self) -> None:
        """Drop what the ZMQ socket still queues for the peer that went away: a request
        just failed with `BrokenError` (sent after the peer died, before the monitor said
        so) must never reach a service that comes back at the address (ZMQ would deliver
        it on reconnecting: a put reported failed ran on the restarted service). A new
        socket of the same identity replaces it; LINGER 0 discards the old one's queue."""
        if self._closed or self._core.unix or self._core.inproc:
            return  # a Unix socket queues nothing; an in-process peer has no address
        # disconnecting first tells the socket's I/O thread at once to drop the queue and
        # stop dialling; a close alone goes through ZMQ's reaper thread, and while a loaded
        # machine left that thread waiting, the old dialler reached a service back at the
        # address and delivered the queue (tests/transport/test_transport.py)
        with contextlib.suppress(zmq.ZMQError, AttributeError):  # (a socket closed already)
            self._sock.disconnect(self._core.address)
        self._release()
        self._open()  # (a TCP connect never fails here: it is dialled later)

    # ---- requests ----------------------------------------------------------------------------

    def _abandon(
        self,
        rid: int,
        on_abandon: Callable[[Reply, list[Any]], None] | None,
        cancel_undoes: bool = False,
    ) -> None:
        if self._core.abandon(rid, on_abandon, cancel_undoes):
            self.send_best_effort(Cancel(rid))

    def retire(self, why: str, *, farewell: Sequence[msgspec.Struct] = ()) -> None:
        """Close a connection its owner replaced (``why``: by what): the requests still
        waiting on it may have been taken or not, so they break with a `BrokenError` that
        says to retry (`ClosedError` is for a client its own program closed). ``farewell``:
        one-way messages sent last (best effort), as `close` sends them."""
        self.close(
            BrokenError(
                f"the connection to {self.name} was replaced ({why}) while this request "
                "waited; retry"
            ),
            farewell=farewell,
        )

    def send_best_effort(self, body: msgspec.Struct) -> bool:
        """`send_oneway` for clean-up that must not replace the caller's outcome (an
        unpin after a read, a Cancel, a renewal): a broken connection (or, blocking, one
        another thread uses) is logged, not raised; the service frees what the message was
        about when it notices the client is gone.

        Returns:
            Whether the message was handed to the socket.
        """
        try:
            self.send_oneway(body)
        except (BrokenError, InvalidRequestError) as exc:
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
        """The error of a send the transport refused (see `transport_errors`); what the
        monitor reported meanwhile is taken first (a refused handshake is why ZMQ had no
        pipe to send on, and is reported before the pipe goes)."""
        self._drain_monitor()
        error = self._core.broken(what, exc)
        if self._core.unix and not self._closed:
            # a Unix socket that fails a write is dead (EPIPE: the peer is gone): say so now
            # rather than when its end is read (a blocking connection reads nothing between
            # calls: every later call would fail the same way instead of finding the
            # service again)
            self._unix_eof()
        return error
