"""Addresses and the process's ZMQ context: binding, same-host and loopback checks.

Also `LogThrottle`, which keeps a flood of malformed input from becoming a flood of
logs, and `READS`, what the services' reader callbacks cost.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.utils.monitor

from .._errors import InvalidRequestError
from .._logging import get_logger

__all__ = [
    "READS",
    "SAMPLE_READS",
    "LogThrottle",
    "ReaderCost",
    "is_loopback",
    "normalize_bind",
    "same_host_ipc",
    "zmq_context",
]

log = get_logger(__name__)


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


class ReaderCost:
    """What the services' reader callbacks cost: the CPU time of a sample of them (one call
    in `SAMPLE_READS`) and the requests those handled.

    A request's cost beyond its handler (reading it off the socket, decoding, dispatching,
    sending the answer) is read from them (the watch pacer prices a watcher's request with
    it). The loop's other work (replies of the units a controller forwards to, timers, tasks
    a handler started) is not in them: it is no request's intake.
    """

    __slots__ = ("calls", "handled", "messages", "seconds")

    def __init__(self) -> None:
        self.calls = 0
        #: requests handled by the readers (each counts itself: `handled`)
        self.handled = 0
        #: requests handled and CPU seconds taken by the sampled calls
        self.messages = 0
        self.seconds = 0.0

    def read(self, callback: Callable[[], None]) -> None:
        """Run a reader ``callback``, timing one call in `SAMPLE_READS`."""
        self.calls += 1
        if self.calls % SAMPLE_READS:
            callback()
            return
        t0, handled = time.thread_time(), self.handled
        try:
            callback()
        finally:
            self.seconds += time.thread_time() - t0
            self.messages += self.handled - handled


#: the reader calls timed (a clock read costs ~0.5 us; a call reads one request or many)
SAMPLE_READS = 16
#: this process's (every service's readers share its CPU)
READS = ReaderCost()


#: the context whose socket cap was set (the class holds the instance anyway)
_sized: zmq.Context[Any] | None = None


def zmq_context() -> zmq.Context[Any]:
    """The process-wide ZMQ context (a fresh one after ``fork``).

    ZMQ caps a context at 1,023 sockets by default, whatever the process's file-descriptor
    limit: a process with 512 clients (one socket each to the controller, and one per unit
    until the same-host link replaces it) ran into ``ZMQError: Too many open files`` with
    thousands of descriptors to spare. The cap follows ``RLIMIT_NOFILE`` instead, taken when
    the context is made (it applies from the first socket on); its cost is a few bytes of
    slot table per possible socket.
    """
    global _sized
    ctx: zmq.Context[Any] = zmq.Context.instance()
    if ctx is not _sized:  # a new instance (first use, or after a fork)
        _sized = ctx
        want = min(_nofile_soft(), ctx.get(zmq.SOCKET_LIMIT))
        if want > ctx.get(zmq.MAX_SOCKETS):
            ctx.set(zmq.MAX_SOCKETS, want)
    return ctx


def _nofile_soft() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def normalize_bind(address: str) -> str:
    """``tcp://host:0`` means "any free port" (ZMQ spells it ``*``).

    Raises:
        InvalidRequestError: a ``tcp://`` port past 65535 (ZMQ binds it modulo 65536: a
            typo's ``:99999`` served at port 34463).
    """
    if not address.startswith("tcp://"):
        return address
    port = address.rpartition(":")[2]
    if port.isdigit() and int(port) > 65535:
        raise InvalidRequestError(
            f"cannot bind {address!r}: the port must be from 0 to 65535 (0: any free port)"
        )
    if port == "0":
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
