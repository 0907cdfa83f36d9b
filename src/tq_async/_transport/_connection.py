"""The client connection's core, without I/O: what the asynchronous
`DealerConnection` and the blocking
`BlockingConnection` share (with the I/O both do alike, `ConnectionShell`).

A `ConnectionCore` knows the wire and the bookkeeping of one connection and decides;
the shells around it own the sockets and the waiting (a future on the event loop, ``poll`` in
the calling thread) and do what it says:

* **framing**: a request is ``[header, *frames]`` with ``header = msgpack([rid, body])``; a
  reply's header decodes to a `Reply`;
* **request ids** and the **table of requests**: the messages in flight (re-sent after a
  reconnect), the requests whose caller waits, the replies that arrived for them, and the
  ``on_abandon`` handlers of requests nobody waits for any more;
* **liveness**: what a socket monitor event means (connected, a CURVE refusal, a handshake
  dropped, a refused connection attempt), why the connection broke, why a request got no
  reply, and the `TQError` each of these becomes;
* the busy poll's **back-off** (`PollBackoff`).

Model: httpcore's ``h11``-driven connection (decide in one pure place, then do the I/O).
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import msgspec
import zmq

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
from .._wire._protocol import Reply, decode_error_payload, encoder, reply_decoder
from ._security import CurveClient

__all__ = [
    "DEFAULT_BUSY_POLL",
    "MAX_BUSY_POLL",
    "MONITOR_EVENTS",
    "ConnectionCore",
    "Got",
    "Liveness",
    "PollBackoff",
    "check_frames",
    "dropped_handshake",
    "first_of",
    "heartbeat_ms",
    "mechanism_mismatch",
    "process_state",
    "rejected",
]

log = get_logger(__name__)
_clock = time.perf_counter

#: Seconds a client's request polls a same-host connection for its reply (`PollBackoff`).
DEFAULT_BUSY_POLL = 1e-4
#: the longest poll a client may ask for (longer would only burn CPU: a reply that takes
#: longer is worth parking for)
MAX_BUSY_POLL = 0.01
#: Cancels of abandoned requests a connection sends again after a reconnect, until their
#: reply comes (the most recent: a request whose reply never comes is forgotten)
_CANCELS_KEPT = 1024
#: a handshake dropped this long after the connection was accepted was never answered (ZMQ
#: gives up after its handshake interval, 30 s); a peer that refuses drops it at once
_SILENT_HANDSHAKE = 5.0
#: ZMTP heartbeats on client connections: a silent peer is dropped after the timeout.
_HEARTBEAT_IVL_MS = 2_000
_HEARTBEAT_TIMEOUT_MS = 10_000
#: zmq keeps socket options in a C int: the longest heartbeat timeout it takes (24.8 days)
_MAX_HEARTBEAT_TIMEOUT_MS = 2**31 - 1
#: the socket monitor events a connection follows (`ConnectionCore.on_monitor`)
MONITOR_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)
# zmq's constants as plain ints (an IntFlag comparison builds an enum member)
_CONNECTED = int(zmq.EVENT_CONNECTED)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_CONNECT_RETRIED = int(zmq.EVENT_CONNECT_RETRIED)
_HANDSHAKE_SUCCEEDED = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
_HANDSHAKE_FAILED_AUTH = int(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_HANDSHAKE_FAILED_PROTOCOL = int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)

#: a reply: its header and its data frames
Got = tuple[Reply, list[Any]]


def heartbeat_ms(timeout: float | None) -> tuple[int, int]:
    """ZMTP heartbeat interval and timeout (ms) for a connection: a peer whose host vanishes
    without closing the connection is noticed after ``timeout`` seconds (default 10): at
    least 1 ms (0 would turn ZMTP's timeout off), at most what zmq takes (24.8 days)."""
    if timeout is None:
        timeout_ms = _HEARTBEAT_TIMEOUT_MS
    else:
        timeout_ms = max(1, min(int(timeout * 1000), _MAX_HEARTBEAT_TIMEOUT_MS))
    return min(_HEARTBEAT_IVL_MS, max(timeout_ms // 4, 50)), timeout_ms


class Liveness(NamedTuple):
    """What a socket monitor event asks the connection's shell to do."""

    #: the connection is (re-)established
    connected: bool = False
    #: fail the requests that wait with this error (the service refused this client)
    fail: BaseException | None = None
    #: the connection broke: the shell calls its ``_disconnected(why)``
    broken: bool = False
    why: str | None = None
    #: a connection attempt after a disconnect was refused: nothing listens there any more
    refused: bool = False


_NOTHING = Liveness()


class PollBackoff:
    """When a request polls its same-host connection for the reply, and for how long.

    A parked process takes 25-30 us to wake up on the VMs this runs on, and a round trip
    between two processes crosses two wake-ups: a blocking Unix-socket ping-pong measured
    ~60 us, the same with both sides polling ~4 us, and asyncio on both sides 78 us against
    23 us when the client polls for the reply (``python -m benchmarks.probes socket-rtt``,
    40-byte messages, 2-vCPU VM). So a request on a same-host connection reads its socket for
    up to ``budget`` seconds before it parks.

    Polling costs CPU for as long as it lasts, and finds nothing when the service has a
    reason to wait (a get_meta waiting for data): after a poll that caught nothing, the next
    1, 2, 4, ... 64 requests park at once; a caught reply resets that. Services never poll.
    The shells decide when to poll (`poll`; the async shell's `BusyPoll` yields first).
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

    def should_poll(self) -> bool:
        """Whether this request polls (False: it parks at once, backing off)."""
        if self._skip:
            self._skip -= 1
            return False
        return True

    def hit(self) -> None:
        """The poll caught its reply: the next request polls again."""
        self.caught_replies += 1
        self._backoff = 0

    def spin(self, done: Callable[[], bool], read: Callable[[], None]) -> bool:
        """``read()`` until ``done()`` or until the budget is spent (a hit, or a miss).

        Returns:
            Whether ``done()`` came true (its reply, or the connection's failure, arrived).
        """
        end = _clock() + self.budget
        while not done():
            read()
            if not done() and _clock() >= end:
                self.miss()
                return False
        self.hit()
        return True

    def poll(self, done: Callable[[], bool], read: Callable[[], None]) -> bool:
        """`spin`, unless backing off after polls that caught nothing (the blocking
        shell's busy poll: it parks in ``poll`` afterwards)."""
        return self.should_poll() and self.spin(done, read)

    def miss(self) -> None:
        """The poll spent its budget: the next requests park at once, twice as many as
        after the previous miss (up to `MAX_SKIP`)."""
        self.missed_replies += 1
        self._backoff = min(2 * self._backoff or 1, self.MAX_SKIP)
        self._skip = self._backoff


class ConnectionCore:
    """One connection's wire and bookkeeping (see the module docstring); no I/O.

    Shared state of a connection, read and written by its shell: ``connected`` (None until the
    first connection, False once broken, until re-established), ``inproc``, ``peer_pid``,
    ``reconnects``.
    """

    def __init__(
        self,
        address: str,
        *,
        known_as: str | None = None,
        curve: CurveClient | None = None,
        refused_is_broken: bool = False,
        retry_after: float | None = None,
    ) -> None:
        self.address = address
        #: the address the program gave, when ``address`` is its same-host twin
        self.known_as = known_as or address
        #: how messages name the peer: the program's address, then the socket used
        self.name = address if self.known_as == address else f"{self.known_as} ({address})"
        #: a same-host Unix socket: it reports its end itself, and loses no reply without
        #: ending (`first_of`)
        self.unix = address.startswith("uds://")
        #: seconds without a reply after which a request goes out again (`first_of`)
        self.retry_after = retry_after
        self.curve = curve
        #: a refused connection attempt counts as broken (requests fail fast with
        #: BrokenError instead of waiting for a peer that is not there, e.g. a storage
        #: unit that was restarted on another address)
        self.refused_is_broken = refused_is_broken
        #: False once the connection broke, until it is re-established
        self.connected: bool | None = None
        #: a precise reason (nothing listens there) outlives the event: a request made after
        #: the event was read gives it, not a guess from the peer's process state
        self.broken_why: str | None = None
        #: the service's last refusal of this client's handshake (CURVE keys, not ZMTP):
        #: the error of the requests made while the connection is down, even when the
        #: event was read before any request waited for it
        self.refusal: BaseException | None = None
        self.reconnects = 0
        #: the security handshake (NULL or CURVE) completed on the current socket
        self.handshaken = True
        #: connected through the in-process twin of the service's endpoint
        self.inproc = False
        #: the service's process, when known to be on this host (its shared-memory hello)
        self.peer_pid: int | None = None
        # a fixed identity: after a reconnect the service routes replies to the new socket
        # and recognises retried requests (same identity, same request id)
        self.identity = uuid.uuid4().bytes
        self.pid = os.getpid()
        #: request id -> its message, until its reply arrives (re-sent after a reconnect)
        self.inflight: dict[int, list[Any]] = {}
        #: the requests whose caller waits for the reply
        self.waiting: set[int] = set()
        #: replies that arrived for a waiting request, until its caller takes them
        self.arrived: dict[int, Got] = {}
        #: request id -> what to do with a reply nobody waits for any more
        self.orphans: dict[int, Callable[[Reply, list[Any]], None]] = {}
        #: requests abandoned with a ``Cancel``, until a reply to them arrives: a reconnect
        #: sends their Cancels again (one queued on the socket it replaces is lost with it)
        self.cancelled: OrderedDict[int, None] = OrderedDict()
        self._rids = itertools.count(1)
        self._retries = 0
        #: when the current connection was accepted (how long its handshake went unanswered)
        self._connected_at = 0.0
        #: a handshake was dropped bare and ZMQ dials again (see `on_monitor`)
        self._redialled = False

    # ---- requests ------------------------------------------------------------------------

    def start(self, body: msgspec.Struct, frames: Sequence[Any]) -> tuple[int, list[Any]]:
        """A new request: its id and its message, in flight and waited for from now on.

        Raises:
            InvalidRequestError: ``body`` holds a value msgpack cannot carry.
        """
        rid = next(self._rids)
        outgoing = [_encode_request(rid, body, self.identity), *frames]
        self.inflight[rid] = outgoing
        self.waiting.add(rid)
        return rid, outgoing

    def oneway(self, body: msgspec.Struct) -> list[Any]:
        """The message of a request whose reply nobody waits for (dropped on arrival)."""
        return [encoder.encode((next(self._rids), body, self.identity))]

    def on_message(self, frames: list[Any]) -> int | None:
        """A message from the service: the id of the waiting request its reply is for (kept
        in `arrived`), or None (an unreadable message, or a reply nobody waits for,
        handed to the request's ``on_abandon``)."""
        try:
            reply = reply_decoder.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("dropped an unreadable reply", peer=self.name)
            return None
        rid = reply.rid
        self.inflight.pop(rid, None)
        if rid in self.waiting:
            # kept until the request itself ends: a request cancelled after its reply
            # arrived, but before it saw it, still finds the reply (abandon)
            self.arrived[rid] = (reply, frames[1:])
            return rid
        if self.cancelled:
            self.cancelled.pop(rid, None)
        orphan = self.orphans.pop(rid, None)
        if orphan is not None:
            _undo(orphan, (reply, frames[1:]), self.name)
        return None

    def finish(self, rid: int, got: Got) -> tuple[msgspec.Raw, list[Any]]:
        """The request ended with its reply: its payload and frames.

        Raises:
            TQError: the service answered with an error (re-raised as its class).
        """
        self.waiting.discard(rid)
        reply, rframes = got
        if not reply.ok:
            kind, message = decode_error_payload(reply.payload)
            raise error_from_wire(kind, message)
        return reply.payload, rframes

    def abandon(
        self,
        rid: int,
        on_abandon: Callable[[Reply, list[Any]], None] | None,
        cancel_undoes: bool = False,
    ) -> bool:
        """The caller gave up on ``rid`` (cancelled, timed out, failed): a reply that arrived
        goes to ``on_abandon`` now, a later one when it arrives (unless the service undoes it
        itself on the ``Cancel``).

        Returns:
            Whether the service is to be sent a ``Cancel`` (no reply arrived yet).
        """
        self.waiting.discard(rid)
        self.inflight.pop(rid, None)
        got = self.arrived.pop(rid, None)
        if got is not None:
            # the reply arrived, but the caller gave up before it saw it
            if on_abandon is not None:
                _undo(on_abandon, got, self.name)
            return False
        if on_abandon is not None and not cancel_undoes:
            self.orphans[rid] = on_abandon
        if not self.unix:  # (a Unix socket loses nothing without ending)
            cancelled = self.cancelled
            cancelled[rid] = None
            if len(cancelled) > _CANCELS_KEPT:
                cancelled.popitem(last=False)
        return True

    def next_wait(self, deadline: float | None, now: float) -> tuple[float | None, bool] | None:
        """How long a request's next attempt waits for its reply (None: no limit) and
        whether it is its last (it waits up to ``deadline``: a silent one ends the request),
        or None once ``deadline`` passed; an attempt that ends silent and not last is
        followed by a retry (`first_of`).
        """
        retry_after = self.retry_after  # (first_of, inlined: this runs for every request)
        if deadline is None:
            return None if retry_after is not None and retry_after <= 0 else (retry_after, False)
        remaining = deadline - now
        wait = remaining if retry_after is None or retry_after > remaining else retry_after
        return None if wait <= 0 else (wait, wait >= remaining)

    def forget_all(self) -> None:
        """The connection failed or closed: nothing in flight is re-sent, no late reply is
        undone here (the service frees what it held when it notices the client is gone)."""
        self.inflight.clear()
        self.orphans.clear()
        self.cancelled.clear()

    # ---- liveness ------------------------------------------------------------------------

    def on_monitor(self, event: int, value: int) -> Liveness:
        """What a socket monitor event means for this connection."""
        if event == _CONNECTED:
            self.connected = True
            self._retries = 0
            self._connected_at = _clock()
            return Liveness(connected=True)
        if event == _HANDSHAKE_SUCCEEDED:
            self.handshaken = True
            self.refusal = None
            self._redialled = False
        elif event == _HANDSHAKE_FAILED_AUTH:
            self.refusal = rejected(self.name, self.curve, "rejected this client's CURVE key")
            return Liveness(fail=self.refusal)
        elif event == _HANDSHAKE_FAILED_PROTOCOL:
            if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                self.refusal = mechanism_mismatch(self.name, self.curve)
                return Liveness(fail=self.refusal)
        elif event == _DISCONNECTED:
            self._retries = 0
            if self.handshaken:
                return Liveness(broken=True)
            # dropped during the handshake: not an outage
            silent = _clock() - self._connected_at
            if self.refusal is None:
                if silent >= _SILENT_HANDSHAKE:
                    # nobody answered: a paused or overloaded process, or no ZMTP there; it
                    # is not a refusal (a redial may find the process resumed)
                    if self._redialled:
                        return Liveness(broken=True, why=unanswered_handshake(self.name, silent))
                    self._redialled = True
                    self._retries = -1
                    return _NOTHING
                if self.curve is None and not self._redialled:
                    # a CURVE service that read this client's greeting before it sent its
                    # own mechanism drops it bare (over ipc, always): ZMQ dials again, and
                    # that attempt tells (EVENT_HANDSHAKE_FAILED_PROTOCOL); a peer that
                    # does not speak ZMTP drops that one bare too
                    self._redialled = True
                    self._retries = -1  # (the retry libzmq reports as it schedules it)
                    return _NOTHING
                self.refusal = dropped_handshake(self.name, self.curve)
            return Liveness(fail=self.refusal, broken=True)
        elif event != _CONNECT_RETRIED:
            pass
        elif self._retries < 0:
            self._retries = 0  # the redial after a handshake dropped bare
        elif self.connected is not False:
            # the first connection attempt was refused: nothing listens there
            if self.refused_is_broken:
                # (ZMQ reports a host name that does not resolve the same way)
                how = "was refused"
                if not _literal_host(self.address):
                    how += ", or the host name does not resolve"
                return Liveness(
                    broken=True,
                    why=(
                        f"nothing listens at {self.name} (the connection {how}); "
                        "check the address and that the service runs there"
                    ),
                )
            # (an owner watching refusals learns it: a service that died before this
            # connection was ever up is gone as much as one that died after)
            return Liveness(refused=True)
        else:
            # libzmq reports one retry when it schedules the reconnection after a
            # disconnect; a second one means a connection attempt failed: nothing
            # listens there any more (a paused process still accepts connections)
            self._retries += 1
            if self._retries == 2:
                return Liveness(refused=True)
        return _NOTHING

    def disconnected(self, why: str | None = None, *, closed_by_peer: bool = False) -> BrokenError:
        """The connection broke (``why``, if known precisely): the error of the requests
        that wait, and of those made until it is back."""
        self.connected = False
        self.broken_why = why
        if why is None:
            # a peer that closed the connection itself is gone (a paused one closes nothing)
            cause = "the service stopped or vanished" if closed_by_peer else self.why_broken()
            why = (
                f"the connection to {self.name} broke ({cause}); requests in flight are "
                "lost: retry once it is back"
            )
        return BrokenError(why)

    def check_open(self, closed: bool) -> None:
        """Raise if this connection can never be used again (closed, or another process's)."""
        if closed:
            raise ClosedError(f"the connection to {self.name} is closed")
        if self.pid != os.getpid():
            raise ClosedError(
                "this connection was opened in another process (before a fork); its client "
                "re-creates its connections in this process on its next call"
            )

    def check_usable(self, closed: bool) -> None:
        """Raise if a request cannot be sent on this connection now."""
        self.check_open(closed)
        if self.connected is False:
            if self.refusal is not None:
                raise _again(self.refusal)
            if self.broken_why is not None:
                raise BrokenError(self.broken_why)
            raise BrokenError(
                f"the connection to {self.name} is broken ({self.why_broken()}); retry "
                "once it is back"
            )

    def broken(self, what: str, exc: BaseException) -> BrokenError:
        """The error of a send the transport refused (``zmq.ZMQError``, the Unix socket's
        ``OSError``), for every call of the client, requests and one-way messages alike:
        the service's refusal of this client's handshake when that is why (ZMQ has no pipe
        to a service that refused it: the send fails with EAGAIN)."""
        if self.refusal is not None and not self.handshaken:
            return cast(BrokenError, _again(self.refusal))
        if getattr(exc, "errno", None) == zmq.EMSGSIZE:  # too big for a same-host socket
            return BrokenError(
                f"{what} to {self.name} failed: {exc}; this connection ends, and one to the "
                "service's TCP address carries it"
            )
        return BrokenError(
            f"{what} to {self.name} failed: {exc} ({self.why_broken()}); retry once it is back"
        )

    def timed_out(self, what: str, timeout: float | None) -> TQTimeoutError:
        """The error of a request that got no reply within ``timeout`` seconds."""
        return TQTimeoutError(
            f"{what} to {self.name} got no reply within {timeout} s; {self.why_silent()}"
        )

    def why_silent(self) -> str:
        """What a timed-out request's caller should check."""
        if process_state(self.peer_pid) is not None:
            return f"{self.why_broken()}; raise the timeout if it is only slow"
        return "check that the service is running, or raise the timeout"

    def why_broken(self) -> str:
        """Why the service went away, as far as this side can tell: a same-host service
        whose process still exists is only not answering (paused, swapping, overloaded)."""
        state = process_state(self.peer_pid)
        if state is None:
            # across hosts a paused service and a vanished one look the same
            return (
                "the service stopped or vanished"
                if self.peer_pid is not None
                else "the service stopped, vanished or is not answering"
            )
        paused = " and is paused (SIGSTOP)" if state in ("T", "t") else ""
        return f"the service is not answering: its process {self.peer_pid} still exists{paused}"


def _literal_host(address: str) -> bool:
    """Whether ``address`` names its host by IP address (or has no host: ipc, inproc)."""
    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def first_of(remaining: float | None, retry_after: float | None) -> float | None:
    """Seconds the next attempt waits: until the deadline or the next retry, if any.

    Every ``retry_after`` seconds without a reply the request goes out again: a request with
    a deadline over ZMQ reconnects first (its reply may have been lost with the connection);
    one without (e.g. a get_meta waiting for data) is re-sent as a keep-alive, which the
    service ignores while the request is pending and answers from its reply cache if the
    reply was lost. A Unix socket loses no reply without ending (its end is reported):
    silence is a busy service, and waiting up to the deadline is the backpressure.
    Reconnecting there made thousands of waiting clients storm a saturated service's listen
    queue (8,192 clients: BrokenError "listen queue is full", benchmarks/RESULTS.md).
    """
    if retry_after is None:
        return remaining
    return retry_after if remaining is None else min(retry_after, remaining)


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


def unanswered_handshake(address: str, seconds: float) -> str:
    """Why nothing answered the ZMTP handshake: the peer accepted the connection (its
    kernel does, for a paused process too) and stayed silent until ZMQ gave up."""
    return (
        f"the peer at {address} accepted the connection, but nothing answered the ZMTP "
        f"handshake within {seconds:.0f} s: the process there may be paused (SIGSTOP), "
        "overloaded, or not a tq_async service; check that the service runs there and is "
        "not stopped (`kill -CONT` resumes a paused one), and the address (the "
        "TQ_ADDRESS=... line `tq-async serve` prints); retry once it answers"
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


def check_frames(frames: Sequence[Any], expected: int, what: str) -> None:
    """Raise `ProtocolError` if a message does not carry ``expected`` data frames."""
    if len(frames) != expected:
        raise ProtocolError(f"{what} carries {len(frames)} data frames, expected {expected}")


def _again(exc: BaseException) -> BaseException:
    """A new error like ``exc`` (one raised again would carry its old traceback along)."""
    return type(exc)(*exc.args)


def _encode_request(rid: int, body: msgspec.Struct, identity: bytes) -> bytes:
    """The request header (``identity``: see ``ControllerRequest.client``); a value msgpack
    cannot carry is the caller's error, raised before anything is sent (a safety net: the
    client checks arguments more precisely)."""
    try:
        return encoder.encode((rid, body, identity))
    except (TypeError, OverflowError, UnicodeEncodeError, ValueError, NotImplementedError) as exc:
        raise InvalidRequestError(
            f"{type(body).__name__} cannot be sent: {exc}; pass ids as valid UTF-8 text, "
            "ints within 64 bits and plain values (None, bool, int, float, str, bytes, "
            "lists and dicts of those)"
        ) from None


def _undo(on_abandon: Callable[[Reply, list[Any]], None], got: Got, address: str) -> None:
    """Hand an abandoned request's reply to its ``on_abandon``; clean-up must not replace
    the caller's own error, nor stop the reader."""
    try:
        on_abandon(*got)
    except Exception:
        log.exception("undoing an abandoned request failed", peer=address)
