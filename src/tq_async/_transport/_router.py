"""ZMQ sockets driven from the asyncio loop's reader callback; the services' endpoint.

PERF_NOTES measured ~46-50k req/s for a plain socket drained from ``loop.add_reader`` against
12-19k/s for ``zmq.asyncio``'s awaitable ``recv``/``send``: the futures and poller plumbing of
zmq.asyncio is the cost. So both ends here use plain non-blocking sockets:

* `RouterEndpoint` (services): a ROUTER socket; each incoming message is handed to a
  synchronous callback; replies are sent with ``NOBLOCK`` (the send queue is unbounded, so a
  send never blocks the loop).
* `DealerConnection` (clients): one long-lived DEALER socket per peer, multiplexing any
  number of in-flight requests by request id; each request awaits a plain future.

ZMQ's FD is edge-triggered and a ``send`` may consume the edge of an incoming message, so the
reader drains until ``EVENTS`` reports nothing more to read, and every send schedules one
more drain.

**Same-host twin.** A TCP endpoint also binds an abstract Unix socket (``ipc://@tq-<random>``:
no file, gone with the process). Services advertise it; a client on the same host (the
name is listed in its ``/proc/net/unix``) that proves it reached the same service through
it (a token) uses it instead: local_cluster measured about twice the get_meta rate over ipc
than over TCP.

**In-process shortcut**: a service endpoint also binds an ``inproc://`` twin for connections
of its own process (`tq_async._transport._routes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.utils.monitor

from .._errors import (
    BrokenError,
)
from .._logging import get_logger
from ._endpoints import READS, normalize_bind, zmq_context
from ._inherited import serving, stopped_serving
from ._routes import LocalRoute, local_routes, local_routes_lock
from ._security import CurveServer
from ._unix import BACKLOG, UnixListener

__all__ = ["DrainedSocket", "RouterEndpoint"]

log = get_logger(__name__)


#: Messages handled per reader callback before yielding to other tasks (fairness).
_DRAIN_BUDGET = 512
# zmq's flags as plain ints: an operation on its IntFlag members (``events & zmq.POLLIN``)
# builds an enum member, ~0.5-1 us each on Python 3.11, several times per request
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
# pyzmq's ``send_multipart`` checks every frame, then ORs SNDMORE into the flags (an enum
# operation) and goes through ``zmq.Socket.send``'s keyword handling once per frame: ~2.8 us
# for a two-frame reply where the socket's own ``send`` takes ~0.6 us. Frames of these
# types need no check (anything else takes pyzmq's way, its checks included).
_zmq_send = zmq.backend.Socket.send
_PLAIN_FRAMES = (bytes, zmq.Frame, memoryview)


def _edge_triggered(sock: Any) -> bool:
    """Whether ``sock``'s FD signals edges (ZMQ's does) rather than a level (a Unix socket's:
    readable for as long as unread bytes wait, so nothing needs re-reading after a send)."""
    return not getattr(sock, "level_triggered", False)


def _recv_message(sock: Any) -> list[Any]:
    """One whole message, without blocking. A ZMQ frame says itself whether more follow
    (``recv_multipart`` asks the socket ``RCVMORE`` per frame, building an enum each time)."""
    if not isinstance(sock, zmq.Socket):
        return sock.recv_multipart(_NOBLOCK, copy=False)  # type: ignore[no-any-return]
    frames = [sock.recv(_NOBLOCK, copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(_NOBLOCK, copy=False))
    return frames


def _send_message(sock: zmq.Socket[Any], frames: Sequence[Any]) -> None:
    """``sock.send_multipart(frames, flags=NOBLOCK, copy=False)``, at a third of its cost."""
    for f in frames:
        if type(f) not in _PLAIN_FRAMES:
            sock.send_multipart(frames, flags=_NOBLOCK, copy=False)
            return
    last = len(frames) - 1
    for i, f in enumerate(frames):
        _zmq_send(sock, f, _NOBLOCK if i == last else _SNDMORE_NOBLOCK, False)


class DrainedSocket:
    """Shared reader plumbing: register the FD, drain while EVENTS says POLLIN, re-drain
    after sends."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._fd: int = sock.getsockopt(zmq.FD)  # type: ignore[assignment]
        self._edge_triggered = _edge_triggered(sock)
        self._drain_scheduled = False
        #: set while `_drain` reads: a send then needs no drain of its own (see `_send`)
        self._draining = False
        self._closed = False
        self._loop.add_reader(self._fd, self._drain)

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        raise NotImplementedError

    def _drain(self) -> None:
        self._drain_scheduled = False
        if self._closed:
            return
        sock = self._sock
        self._draining = True
        try:
            for _ in range(_DRAIN_BUDGET):
                try:
                    # asking EVENTS costs 1.7 us; a recv that finds nothing raises zmq.Again,
                    # 4.1 us. It is asked after every message handled, so also after any
                    # reply the handler sent on this socket (which may have taken the edge).
                    events: int = sock.getsockopt(_EVENTS)  # type: ignore[assignment]
                    if not events & _POLLIN:
                        return
                    frames = _recv_message(sock)
                except zmq.Again:
                    return
                except zmq.ZMQError as exc:
                    log.warning("zmq receive failed", error=str(exc))
                    return
                try:
                    self._on_frames(frames)
                except Exception:  # a handler bug must not kill the reader
                    log.exception("message handler failed")
        finally:
            self._draining = False
        # budget exhausted: let other tasks run, then continue
        self._schedule_drain()

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and not self._closed:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _send(self, frames: Sequence[Any]) -> None:
        if not self._edge_triggered:  # a Unix socket: level-triggered, nothing to re-read
            self._sock.send_multipart(frames, flags=_NOBLOCK, copy=False)
            return
        sock = self._sock
        _send_message(sock, frames)
        # a send may have consumed ZMQ's read edge: look again. Inside `_drain` its loop asks
        # EVENTS next anyway; elsewhere EVENTS says now whether a message waits (one that
        # arrives later signals the FD again), which costs less than a drain's round trip
        # through the loop
        if self._draining or self._drain_scheduled:
            return
        try:
            events: int = sock.getsockopt(_EVENTS)  # type: ignore[assignment]
        except zmq.ZMQError:
            events = _POLLIN  # let the drain see (and log) what is wrong
        if events & _POLLIN:
            self._schedule_drain()

    def _close_socket(self, linger: int = 0) -> None:
        """Close for good; ``linger``: ms ZMQ's I/O thread may still spend sending what is
        queued (in the background: nothing waits for it)."""
        if self._closed:
            return
        self._closed = True
        self._release_socket(linger)

    def _release_socket(self, linger: int = 0) -> None:
        with contextlib.suppress(RuntimeError, ValueError):  # the loop may be closed already
            self._loop.remove_reader(self._fd)
        self._sock.close(linger=linger)

    def _adopt_socket(self, sock: zmq.Socket[Any]) -> None:
        """Start reading a replacement socket (after `_release_socket`)."""
        self._sock = sock
        self._fd = sock.getsockopt(zmq.FD)  # type: ignore[assignment]
        self._edge_triggered = _edge_triggered(sock)
        self._loop.add_reader(self._fd, self._drain)
        self._schedule_drain()


def _refuse_a_live_path(bind: str) -> None:
    """ZMQ binds an ``ipc://`` path by replacing the file there, a running service's too
    (which then serves no new client): refuse a path something listens on, as a taken TCP
    port is refused. A file nothing listens on (its process was killed) is replaced.

    Raises:
        zmq.ZMQError: EADDRINUSE, a service listens at ``bind``.
    """
    if not bind.startswith("ipc://") or bind.startswith(("ipc://@", "ipc://*")):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)  # a listener with a full accept queue says EAGAIN
        try:
            probe.connect(bind[len("ipc://") :])
        except BlockingIOError:
            pass
        except OSError:  # nothing there, or nothing listening
            return
    raise zmq.ZMQError(errno.EADDRINUSE, "a service listens there")


class RouterEndpoint(DrainedSocket):
    """A bound ROUTER socket; ``on_message(peer, frames)`` runs for each request.

    ``on_gone(peer)`` runs when a client of the same-host Unix socket twin is gone (see
    `UnixListener`); ZMQ tells a ROUTER nothing of the kind.
    """

    def __init__(
        self,
        bind: str,
        on_message: Callable[[bytes, list[zmq.Frame]], None],
        *,
        context: zmq.Context[Any] | None = None,
        curve: CurveServer | None = None,
        twin: str | None = "ipc",
        on_gone: Callable[[bytes], None] | None = None,
    ) -> None:
        address = normalize_bind(bind)  # (before a socket exists)
        sock = (context or zmq_context()).socket(zmq.ROUTER)
        if curve is not None:
            curve.apply(sock)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # a client that reconnects with the same identity takes it over (retries)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.LINGER, 0)
        # ZMQ's default accept queue is 100: thousands of clients connecting at once overflowed
        # it and their SYNs were retried after 1, 3, 7, ... s (a handshake then missed its
        # deadline); the kernel caps this at net.core.somaxconn
        sock.setsockopt(zmq.BACKLOG, BACKLOG)
        try:
            _refuse_a_live_path(bind)
            sock.bind(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise BrokenError(f"cannot bind {bind!r}: {exc}; choose another address") from exc
        self.address: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        #: what a forked child closes of this endpoint (see `tq_async._transport._inherited`)
        self._served = [self.address]
        if self.address.startswith("tcp://0.0.0.0:"):
            self.address = self.address.replace("0.0.0.0", "127.0.0.1", 1)
        #: an abstract Unix socket twin of a TCP endpoint, for clients on this host
        #: (see `same_host_ipc`); None for other transports
        self.ipc_address: str | None = None
        self._unix: UnixListener | None = None
        if self.address.startswith("tcp://") and sys.platform == "linux" and twin:
            name = f"tq-{uuid.uuid4().hex}"
            try:
                if twin == "uds" and curve is None:  # a Unix socket has no CURVE: ipc then
                    self._unix = UnixListener(
                        name, asyncio.get_running_loop(), self._on_unix_message, on_gone
                    )
                    self.ipc_address = self._unix.address
                else:
                    sock.bind(f"ipc://@{name}")
                    self.ipc_address = f"ipc://@{name}"
                    self._served.append(self.ipc_address)
            except (zmq.ZMQError, OSError) as exc:  # not fatal: same-host clients use TCP
                log.debug("no same-host twin for a tcp endpoint", error=str(exc))
        self._route: LocalRoute | None = None
        if curve is None:  # CURVE applies to network transports only: no shortcut then
            route = LocalRoute(f"inproc://tq-{uuid.uuid4().hex}", sock.context)
            sock.bind(route.inproc)
            with local_routes_lock:
                local_routes[self.address] = route
            self._route = route
        self._on_message = on_message
        for address in self._served:
            serving(address)
        super().__init__(sock)

    def _drain(self) -> None:
        READS.read(super()._drain)

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            log.warning("dropped a message without a header frame")
            return
        READS.handled += 1
        self._on_message(frames[0].bytes, frames[1:])

    def _on_unix_message(self, peer: bytes, frames: list[Any]) -> None:
        if not self._closed:
            READS.handled += 1
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
        for address in self._served:
            stopped_serving(address)
        self._served = []
        route, self._route = self._route, None
        if route is not None:
            with local_routes_lock:
                if local_routes.get(self.address) is route:
                    del local_routes[self.address]
        self._close_socket()
        if route is not None:
            for conn in list(route.watchers):
                conn.peer_closed()
