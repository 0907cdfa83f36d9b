"""The request loop both services share: decode, validate, dispatch by type, answer.

A service (the controller, a storage unit) is a table of handlers, one small method per
message type, built once. `Service.on_message` is the only place that decodes a
request, maps an exception to an error reply, and records the request's metrics. A handler
returns the payload of its ``ok`` reply, a `WithFrames` when data frames travel with
it, or one of two markers: `SENT` (it answered, or the message is one-way) and
`DEFERRED` (a task it started will answer and record the metrics).

Which errors are the caller's fault is decided once (`CALLERS_FAULT`):
those are answered quietly; a peer's outage (`BrokenError`: a storage unit gone) is
answered with a warning, throttled (an outage fails every request that reaches the peer);
anything else is answered too, and logged with its traceback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from .._errors import CALLERS_FAULT, BrokenError, ProtocolError
from .._logging import get_logger
from .._transport._endpoints import LogThrottle
from .._transport._router import RouterEndpoint
from .._wire._checks import validate
from .._wire._protocol import error_reply, misdirected, ok_reply, salvage_rid
from ._metrics import Metrics

__all__ = ["DEFERRED", "REQUESTS", "SENT", "Incoming", "RequestStats", "Service", "WithFrames"]

log = get_logger(__name__)

#: a handler answered itself (or the message wants no answer): record the metrics now
SENT: Any = object()
#: a task the handler started answers and records the metrics
DEFERRED: Any = object()


@dataclass(slots=True)
class Incoming:
    """Who sent a request, under which id, with which frames, received when."""

    peer: bytes
    rid: int
    frames: list[Any]
    t0: float


@dataclass(slots=True)
class WithFrames:
    """An ``ok`` reply's payload with data frames after it."""

    payload: Any
    frames: Sequence[Any]


Handler = Callable[[Incoming, Any], Any]


class RequestStats:
    """The requests the services of this process took, and the CPU time of a sample of their
    handlers (every `SAMPLE_EVERY`-th): what is left of the loop's CPU time per request is
    what reading, decoding and dispatching one costs (the watch pacer prices a watcher's
    request with it)."""

    __slots__ = ("handler_seconds", "requests", "sampled")

    def __init__(self) -> None:
        self.requests = 0
        self.sampled = 0
        self.handler_seconds = 0.0


#: this process's (one per process: every service's requests share its CPU)
REQUESTS = RequestStats()
#: one request in this many has its handler timed (a clock read costs ~1 us)
SAMPLE_EVERY = 32


class Service:
    """The shared request loop; subclasses fill `handlers` and may override the hooks.

    Attributes:
        name: what the log calls this service (``"controller"``, ``"storage"``).
        metrics: request counts and latencies (disabled by default).
        handlers: message type -> handler.
    """

    name = "service"

    def __init__(self, metrics: Metrics, decoder: msgspec.msgpack.Decoder[Any]) -> None:
        self.metrics = metrics
        self._decoder = decoder
        self._malformed = LogThrottle()
        #: requests failed by a peer's outage: its liveness has its own lines, one is enough
        self._outages = LogThrottle(burst=1)
        self._endpoint: RouterEndpoint | None = None
        self.handlers: Mapping[type, Handler] = {}

    # ---- hooks -------------------------------------------------------------------------------

    def send(self, peer: bytes, rid: int, header: bytes, frames: Sequence[Any] = ()) -> None:
        """Send a reply (the controller also remembers it for retries)."""
        if self._endpoint is not None:
            self._endpoint.send(peer, [header, *frames])

    def is_retry(self, peer: bytes, rid: int) -> bool:
        """Whether ``rid`` from ``peer`` was answered or is being answered (then: done)."""
        return False

    # ---- replies -----------------------------------------------------------------------------

    def send_ok(self, peer: bytes, rid: int, payload: Any, frames: Sequence[Any] = ()) -> None:
        """Answer ``rid`` with ``payload`` (and data ``frames``)."""
        self.send(peer, rid, ok_reply(rid, payload), frames)

    def send_error(self, peer: bytes, rid: int, exc: BaseException, op: str) -> None:
        """Answer ``rid`` with ``exc``; log its traceback unless it is the caller's fault
        or a peer's outage (a throttled warning: no bug to trace)."""
        if isinstance(exc, CALLERS_FAULT):
            pass
        elif isinstance(exc, BrokenError):
            self._outages.warning(f"{self.name} request failed", op=op, rid=rid, error=str(exc))
        else:
            log.error(f"{self.name} request failed", op=op, rid=rid, exc_info=exc)
        self.send(peer, rid, error_reply(rid, exc))

    def record(self, op: str, ok: bool, t0: float) -> None:
        """Count a finished request (a no-op while metrics are off)."""
        if self.metrics.enabled:
            self.metrics.request(op, ok, time.perf_counter() - t0)

    # ---- the loop ----------------------------------------------------------------------------

    def on_message(self, peer: bytes, frames: list[Any]) -> None:
        """Handle one request from ``peer`` (the endpoint's reader callback)."""
        header = frames[0].buffer
        try:
            req = self._decoder.decode(header)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            rid = salvage_rid(header)
            why = misdirected(header, self.name) or f"malformed request: {exc}"
            self._malformed.warning(f"malformed {self.name} request", error=why, rid=rid)
            if rid is not None:
                self.send_error(peer, rid, ProtocolError(why), "?")
            return
        rid, body = req.rid, req.body
        if req.client is not None and len(peer) == 5 and not peer[0]:
            # a routing id libzmq made up: the ROUTER handed this client's identity over to
            # its new connection (a reconnect) and renamed the old one, whose unread
            # messages come out under it. They are the client's: retries must be
            # recognised (else a put resent after the reconnect runs twice) and answers
            # must reach its live connection.
            peer = req.client
        if self.is_retry(peer, rid):
            return
        msg = Incoming(peer, rid, frames, time.perf_counter() if self.metrics.enabled else 0.0)
        stats = REQUESTS
        stats.requests += 1
        try:
            validate(body)
            if stats.requests % SAMPLE_EVERY:
                result = self.handlers[type(body)](msg, body)
            else:
                started = time.thread_time()
                result = self.handlers[type(body)](msg, body)
                stats.handler_seconds += time.thread_time() - started
                stats.sampled += 1
        except Exception as exc:
            self.send_error(peer, rid, exc, type(body).__name__)
            self.record(type(body).__name__, False, msg.t0)
            return
        if result is DEFERRED:
            return
        if result is not SENT:
            if isinstance(result, WithFrames):
                self.send_ok(peer, rid, result.payload, result.frames)
            else:
                self.send_ok(peer, rid, result)
        if self.metrics.enabled:
            self.record(type(body).__name__, True, msg.t0)
