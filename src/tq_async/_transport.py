"""ZMQ sockets driven from the asyncio loop's reader callback.

PERF_NOTES measured ~46-50k req/s for a plain socket drained from ``loop.add_reader`` against
12-19k/s for ``zmq.asyncio``'s awaitable ``recv``/``send``: the futures and poller plumbing of
zmq.asyncio is the cost. So both ends here use plain non-blocking sockets:

* :class:`RouterEndpoint` (services): a ROUTER socket; each incoming message is handed to a
  synchronous callback; replies are sent with ``NOBLOCK`` (the send queue is unbounded, so a
  send never blocks the loop).
* :class:`DealerConnection` (clients): one long-lived DEALER socket per peer, multiplexing any
  number of in-flight requests by request id; each request awaits a plain future.

ZMQ's FD is edge-triggered and a ``send`` may consume the edge of an incoming message, so the
reader drains until ``EVENTS`` reports nothing more to read, and every send schedules one
more drain.

**Same-host twin.** A TCP endpoint also binds an abstract Unix socket (``ipc://@tq-<random>``:
no file, gone with the process). Services advertise it; a client on the same host (the
name is listed in its ``/proc/net/unix``) that proves it reached the same service through
it (a token) uses it instead: local_cluster measured about twice the get_meta rate over ipc
than over TCP.

**In-process shortcut.** A service endpoint also binds an ``inproc://`` endpoint and records
it under its public address; a :class:`DealerConnection` opened in the same process (same
ZMQ context, no CURVE) connects there instead. No I/O thread, no kernel copies, no cross-thread
wake-ups: measured on this box, a one-row put after 10 ms idle went from ~0.96 to ~0.6-0.75 ms,
sequential get_meta from ~4-5k/s to ~10-11k/s and an 8.4 MB put from ~2.4 to ~5 GB/s
(``benchmarks/RESULTS.md``). inproc hands message buffers over by reference, so to keep the
semantics of a socket (the receiver owns what it got) an in-process connection copies its
outgoing data frames, and the data frames it receives, into buffers of its own (recycled:
see :mod:`tq_async._buffers`). inproc has no connection events, so a closing endpoint tells
its in-process connections itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import msgspec
import zmq
import zmq.utils.monitor

from ._buffers import buffer_pool
from ._errors import (
    AuthenticationError,
    BrokenError,
    ClosedError,
    InvalidRequestError,
    ProtocolError,
    TQTimeoutError,
    error_from_wire,
)
from ._logging import get_logger
from ._protocol import Cancel, Reply, decode_error_payload, encoder, reply_decoder
from ._security import CurveClient, CurveServer
from ._unix import UnixListener, UnixSocket

__all__ = [
    "RouterEndpoint",
    "DealerConnection",
    "zmq_context",
    "normalize_bind",
    "same_host_ipc",
]

log = get_logger(__name__)

#: Messages handled per reader callback before yielding to other tasks (fairness).
_DRAIN_BUDGET = 512
#: ZMTP heartbeats on client connections: a silent peer is dropped after the timeout.
_HEARTBEAT_IVL_MS = 2_000
_HEARTBEAT_TIMEOUT_MS = 10_000


class LogThrottle:
    """Let ``burst`` warnings through per ``window`` seconds, then count the rest.

    Malformed input is worth a warning, but a flood of it must not become a flood of logs.
    """

    def __init__(self, burst: int = 10, window: float = 10.0) -> None:
        self.burst = burst
        self.window = window
        self._start = 0.0
        self._seen = 0

    def warning(self, event: str, **fields: Any) -> None:
        now = time.monotonic()
        if now - self._start > self.window:
            if self._seen > self.burst:
                log.warning("suppressed warnings", count=self._seen - self.burst, event=event)
            self._start, self._seen = now, 0
        self._seen += 1
        if self._seen <= self.burst:
            log.warning(event, **fields)


def zmq_context() -> zmq.Context[Any]:
    """The process-wide ZMQ context (a fresh one after ``fork``)."""
    return zmq.Context.instance()


def normalize_bind(address: str) -> str:
    """``tcp://host:0`` means "any free port" (ZMQ spells it ``*``)."""
    if address.startswith("tcp://") and address.endswith(":0"):
        return address[:-2] + ":*"
    return address


def same_host_ipc(address: str | None) -> bool:
    """True if ``address`` is an abstract Unix socket (``ipc://@name``) bound in this
    network namespace: listed in ``/proc/net/unix``. Checked before connecting, since a ZMQ
    connect to a missing endpoint does not fail, it waits."""
    if not address or not address.startswith(("ipc://@", "uds://@")):
        return False
    name = "@" + address[len("ipc://@") :]
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            return any(line.rstrip("\n").endswith(" " + name) for line in f)
    except OSError:
        return False


def is_loopback(address: str) -> bool:
    """True for ``tcp://127.x``/``localhost``/``[::1]``, ``ipc://`` and ``inproc://``."""
    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


#: Copies of at least this many bytes in all run on a worker thread (the loop may be the
#: services' own); smaller ones cost less than the hop.
_THREAD_COPY_BYTES = 16 << 20


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
    if sum(memoryview(f).nbytes for f in frames) >= _THREAD_COPY_BYTES:
        return await anyio.to_thread.run_sync(copy, frames)
    return copy(frames)


class _LocalRoute:
    """An endpoint's in-process twin: where same-process connections go, and who to tell
    when it closes."""

    def __init__(self, inproc: str, context: zmq.Context[Any]) -> None:
        self.inproc = inproc
        self.context = context
        self.pid = os.getpid()
        self.watchers: weakref.WeakSet[DealerConnection] = weakref.WeakSet()


#: public address of an endpoint of this process -> its inproc twin
_local_routes: dict[str, _LocalRoute] = {}
_local_routes_lock = threading.Lock()


def _local_route(address: str, context: zmq.Context[Any]) -> _LocalRoute | None:
    with _local_routes_lock:
        route = _local_routes.get(address)
    if route is None or route.pid != os.getpid() or route.context is not context:
        return None
    return route


class _Drained:
    """Shared reader plumbing: register the FD, drain while EVENTS says POLLIN, re-drain
    after sends."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._fd: int = sock.getsockopt(zmq.FD)  # type: ignore[assignment]
        self._drain_scheduled = False
        self._closed = False
        self._loop.add_reader(self._fd, self._drain)

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        raise NotImplementedError

    def _drain(self) -> None:
        self._drain_scheduled = False
        if self._closed:
            return
        sock = self._sock
        for _ in range(_DRAIN_BUDGET):
            try:
                # asking EVENTS costs 1.7 us; a recv that finds nothing raises zmq.Again, 4.1 us
                events: int = sock.getsockopt(zmq.EVENTS)  # type: ignore[assignment]
                if not events & zmq.POLLIN:
                    return
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                log.warning("zmq receive failed", error=str(exc))
                return
            try:
                self._on_frames(frames)
            except Exception:  # a handler bug must not kill the reader
                log.exception("message handler failed")
        # budget exhausted: let other tasks run, then continue
        self._schedule_drain()

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and not self._closed:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _send(self, frames: Sequence[Any]) -> None:
        self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        self._schedule_drain()

    def _close_socket(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release_socket()

    def _release_socket(self) -> None:
        with contextlib.suppress(RuntimeError, ValueError):  # the loop may be closed already
            self._loop.remove_reader(self._fd)
        self._sock.close(linger=0)

    def _adopt_socket(self, sock: zmq.Socket[Any]) -> None:
        """Start reading a replacement socket (after :meth:`_release_socket`)."""
        self._sock = sock
        self._fd = sock.getsockopt(zmq.FD)  # type: ignore[assignment]
        self._loop.add_reader(self._fd, self._drain)
        self._schedule_drain()


class RouterEndpoint(_Drained):
    """A bound ROUTER socket; ``on_message(peer, frames)`` runs for each request."""

    def __init__(
        self,
        bind: str,
        on_message: Callable[[bytes, list[zmq.Frame]], None],
        *,
        context: zmq.Context[Any] | None = None,
        curve: CurveServer | None = None,
        twin: str | None = "ipc",
    ) -> None:
        sock = (context or zmq_context()).socket(zmq.ROUTER)
        if curve is not None:
            curve.apply(sock)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # a client that reconnects with the same identity takes it over (retries)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(normalize_bind(bind))
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise BrokenError(f"cannot bind {bind!r}: {exc}; choose another address") from exc
        self.address: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.address.startswith("tcp://0.0.0.0:"):
            self.address = self.address.replace("0.0.0.0", "127.0.0.1", 1)
        #: an abstract Unix socket twin of a TCP endpoint, for clients on this host
        #: (see :func:`same_host_ipc`); None for other transports
        self.ipc_address: str | None = None
        self._unix: UnixListener | None = None
        if self.address.startswith("tcp://") and sys.platform == "linux" and twin:
            name = f"tq-{uuid.uuid4().hex}"
            try:
                if twin == "uds" and curve is None:  # a Unix socket has no CURVE: ipc then
                    self._unix = UnixListener(
                        name, asyncio.get_running_loop(), self._on_unix_message
                    )
                    self.ipc_address = self._unix.address
                else:
                    sock.bind(f"ipc://@{name}")
                    self.ipc_address = f"ipc://@{name}"
            except (zmq.ZMQError, OSError) as exc:  # not fatal: same-host clients use TCP
                log.debug("no same-host twin for a tcp endpoint", error=str(exc))
        self._route: _LocalRoute | None = None
        if curve is None:  # CURVE applies to network transports only: no shortcut then
            route = _LocalRoute(f"inproc://tq-{uuid.uuid4().hex}", sock.context)
            sock.bind(route.inproc)
            with _local_routes_lock:
                _local_routes[self.address] = route
            self._route = route
        self._on_message = on_message
        super().__init__(sock)

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            log.warning("dropped a message without a header frame")
            return
        self._on_message(frames[0].bytes, frames[1:])

    def _on_unix_message(self, peer: bytes, frames: list[Any]) -> None:
        if not self._closed:
            self._on_message(peer, frames)

    def send(self, peer: bytes, frames: Sequence[Any]) -> None:
        """Send a reply to ``peer``; a peer that disconnected is logged and skipped."""
        if self._closed:
            return
        try:
            if self._unix is not None and self._unix.has(peer):
                self._unix.send(peer, frames)
            else:
                self._send([peer, *frames])
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client went away
            log.debug("reply dropped", error=str(exc))

    def close(self) -> None:
        if self._unix is not None:
            self._unix.close()
            self._unix = None
        route, self._route = self._route, None
        if route is not None:
            with _local_routes_lock:
                if _local_routes.get(self.address) is route:
                    del _local_routes[self.address]
        self._close_socket()
        if route is not None:
            for conn in list(route.watchers):
                conn._peer_closed()


class DealerConnection(_Drained):
    """One DEALER socket to one service, shared by every request of one client.

    Requests are ``[header, *frames]`` with ``header = msgpack([rid, body])``. Each call
    awaits its own future; replies may come in any order.
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
    ) -> None:
        self.address = address
        self.retry_after = retry_after
        #: a refused connection attempt counts as broken (requests fail fast with
        #: BrokenError instead of waiting for a peer that is not there, e.g. a storage
        #: unit that was restarted on another address)
        self._refused_is_broken = refused_is_broken
        #: False once the connection broke, until it is re-established
        self.connected: bool | None = None
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
        self._pending: dict[int, asyncio.Future[tuple[Reply, list[zmq.Frame]]]] = {}
        self._inflight: dict[int, list[Any]] = {}
        self._orphans: dict[int, Callable[[Reply, list[zmq.Frame]], None]] = {}
        self._rids = itertools.count(1)
        self._pid = os.getpid()
        #: connected through the in-process twin of the service's endpoint
        self.inproc = False
        sock, monitor = self._open()
        super().__init__(sock)
        self._watch(monitor)

    def _open(self) -> tuple[Any, zmq.Socket[Any] | None]:
        if self.address.startswith("uds://"):
            try:
                usock = UnixSocket(self.address, self._identity, self._unix_eof)
            except OSError as exc:
                raise BrokenError(f"cannot connect to {self.address!r}: {exc}") from exc
            self.connected = True
            return usock, None
        route = None if self._curve is not None else _local_route(self.address, self._context)
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
            raise BrokenError(f"cannot connect to {self.address!r}: {exc}") from exc
        return sock, monitor

    def _unix_eof(self) -> None:
        """The Unix socket's peer closed it: stop reading (the FD stays readable at EOF)."""
        with contextlib.suppress(RuntimeError, ValueError):
            self._loop.remove_reader(self._fd)
        if not self._closed:
            self._disconnected()

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
            with contextlib.suppress(zmq.ZMQError):
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
            event = zmq.utils.monitor.parse_monitor_message(msg)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
                self._retries = 0
                if self._on_connect is not None:
                    self._on_connect()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshaken = True
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._fail_pending(self._rejected("rejected this client's CURVE key"))
            elif event == zmq.EVENT_DISCONNECTED:
                self._retries = 0
                if not self._handshaken:  # dropped during the handshake: not an outage
                    self._fail_pending(self._rejected("dropped the security handshake"))
                self._disconnected()
            elif event != zmq.EVENT_CONNECT_RETRIED:
                continue
            elif self.connected is not False:
                # the first connection attempt was refused: nothing listens there
                if self._refused_is_broken:
                    self._disconnected()
            else:
                # libzmq reports one retry when it schedules the reconnection after a
                # disconnect; a second one means a connection attempt failed: nothing
                # listens there any more (a paused process still accepts connections)
                self._retries += 1
                if self._retries == 2 and self._on_refused is not None:
                    self._on_refused()

    def _rejected(self, what: str) -> AuthenticationError:
        if self._curve is None:
            hint = (
                "the services there use CURVE keys (connect with curve=tq.CurveClient("
                "server_public, client_public, client_secret)), or what listens there is not "
                "a tq_async service"
            )
        else:
            hint = (
                "check that server_public_key is the services' public key and that this "
                "client's public key is in their allow-list (--curve-allow); retrying with "
                "the same keys fails the same way"
            )
        return AuthenticationError(f"the service at {self.address} {what}: {hint}")

    def _disconnected(self) -> None:
        self.connected = False
        self._fail_pending(
            BrokenError(
                f"the connection to {self.address} broke (the service stopped or "
                "vanished); requests in flight are lost: retry once it is back"
            )
        )
        if self._on_disconnect is not None:
            self._on_disconnect()

    def _peer_closed(self) -> None:
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
            log.warning("dropped an unreadable reply", peer=self.address)
            return
        data = frames[1:]
        fut = self._pending.pop(reply.rid, None)
        self._inflight.pop(reply.rid, None)
        if fut is not None:
            if not fut.done():
                fut.set_result((reply, data))
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
    ) -> tuple[msgspec.Raw, list[Any]]:
        """Send ``body`` (+ data frames) and wait for the reply's payload and frames.

        Args:
            body: the request struct.
            frames: data frames sent after the header (zero-copy).
            timeout: seconds to wait for the reply; None waits until cancelled.
            on_abandon: called with the reply if it arrives after this call was cancelled or
                timed out (lets the caller undo what the service did for it).

        Raises:
            TQTimeoutError: no reply within ``timeout`` (the service is told to cancel).
            ClosedError: the connection was closed.
            TQError: the service answered with an error (re-raised as its class).

        Cancellation: the service is sent a ``Cancel`` for this request; if the reply was
        already on its way, ``on_abandon`` receives it.
        """
        if self._closed:
            raise ClosedError(f"the connection to {self.address} is closed")
        if self._pid != os.getpid():
            raise ClosedError(
                "this connection was opened in another process (before a fork); "
                "connect a new client in this process"
            )
        if self.connected is False:
            raise BrokenError(
                f"the connection to {self.address} is broken (the service stopped or "
                "vanished); retry once it is back"
            )
        if self.inproc and frames:
            frames = await private_frames(frames, incoming=False)
        rid = next(self._rids)
        outgoing = [_encode_request(rid, body), *frames]
        self._inflight[rid] = outgoing
        try:
            self._send(outgoing)
        except zmq.ZMQError as exc:
            self._inflight.pop(rid, None)
            raise BrokenError(f"cannot send to {self.address}: {exc}") from exc
        loop = self._loop
        deadline = None if timeout is None else loop.time() + timeout
        try:
            while True:
                fut: asyncio.Future[tuple[Reply, list[zmq.Frame]]] = loop.create_future()
                self._pending[rid] = fut
                remaining = None if deadline is None else deadline - loop.time()
                wait = remaining
                if self.retry_after is not None:
                    wait = (
                        self.retry_after if remaining is None else min(self.retry_after, remaining)
                    )
                if wait is not None and wait <= 0:
                    raise TimeoutError
                # one plain timer per attempt (anyio.fail_after/asyncio.wait cost 30+ us each)
                timer = None if wait is None else loop.call_later(wait, _tick, fut)
                try:
                    reply, rframes = await fut
                    break
                except _Tick:
                    pass
                finally:
                    if timer is not None:
                        timer.cancel()
                if remaining is not None and wait is not None and wait >= remaining:
                    raise TimeoutError
                if deadline is None:
                    # A long wait (e.g. get_meta until data arrives) is legitimate; re-send the
                    # same request as a keep-alive: the service ignores it while the request
                    # is pending and answers from its reply cache if the reply was lost.
                    with contextlib.suppress(zmq.ZMQError):
                        self._send(outgoing)
                else:
                    log.info("no reply yet: reconnecting and retrying", peer=self.address, rid=rid)
                    self.reconnect()
        except TimeoutError:
            self._abandon(rid, on_abandon)
            raise TQTimeoutError(
                f"{type(body).__name__} to {self.address} got no reply within {timeout} s; "
                "check that the service is running, or raise the timeout"
            ) from None
        except BaseException:
            self._abandon(rid, on_abandon)
            raise
        if not reply.ok:
            kind, message = decode_error_payload(reply.payload)
            raise error_from_wire(kind, message)
        if self.inproc and rframes:
            return reply.payload, await private_frames(rframes, incoming=True)
        return reply.payload, rframes

    def _abandon(
        self, rid: int, on_abandon: Callable[[Reply, list[zmq.Frame]], None] | None
    ) -> None:
        self._inflight.pop(rid, None)
        fut = self._pending.pop(rid, None)
        if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
            # the reply arrived in the same loop iteration as the cancellation
            if on_abandon is not None:
                on_abandon(*fut.result())
            return
        if on_abandon is not None:
            self._orphans[rid] = on_abandon
        if not self._closed:
            with contextlib.suppress(zmq.ZMQError):
                self._send([encoder.encode((next(self._rids), Cancel(rid)))])

    def send_oneway(self, body: msgspec.Struct) -> None:
        """Send a request whose reply nobody waits for (it is dropped on arrival)."""
        if not self._closed:
            self._send([encoder.encode((next(self._rids), body))])

    def close(self) -> None:
        """Close the socket; requests still waiting fail with :class:`ClosedError`."""
        if self._closed:
            return
        self._unwatch()
        self._close_socket()
        self._fail_pending(ClosedError(f"the connection to {self.address} was closed"))


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


class _Tick(Exception):
    """A request's retry timer fired (internal: never leaves :meth:`DealerConnection.request`)."""


def _tick(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(_Tick())


def check_frames(frames: Sequence[zmq.Frame], expected: int, what: str) -> None:
    """Raise :class:`ProtocolError` if a message does not carry ``expected`` data frames."""
    if len(frames) != expected:
        raise ProtocolError(f"{what} carries {len(frames)} data frames, expected {expected}")
