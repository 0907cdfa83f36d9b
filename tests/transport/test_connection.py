"""The client connection's core without sockets: framing, request ids, the table of requests,
what monitor events mean and the errors a broken or silent connection gives."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import anyio
import msgspec
import pytest
import zmq

import tq_async as tq
from tq_async._transport._connection import (
    ConnectionCore,
    Liveness,
    PollBackoff,
    first_of,
    heartbeat_ms,
)
from tq_async._transport._dealer import DealerConnection
from tq_async._transport._unix import Frame
from tq_async._wire._protocol import Cancel, ListPartitions, Reply, encoder, error_reply

_header = msgspec.msgpack.Decoder(tuple[int, Any, bytes])


def _frames(*parts: bytes) -> list[Frame]:
    return [Frame(memoryview(p)) for p in parts]


def _reply(rid: int, payload: object = None, *data: bytes) -> list[Frame]:
    header = encoder.encode(Reply(rid, True, msgspec.Raw(encoder.encode(payload))))
    return _frames(header, *data)


def _gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---- framing and request ids ------------------------------------------------------------------


def test_a_request_is_its_header_then_its_frames_with_a_new_id_each() -> None:
    core = ConnectionCore("tcp://h:1")
    rid1, out1 = core.start(ListPartitions(), [b"a", b"b"])
    rid2, out2 = core.start(Cancel(7), ())
    assert rid2 == rid1 + 1
    assert out1[1:] == [b"a", b"b"]
    rid, _body, client = _header.decode(out1[0])
    assert rid == rid1
    assert client == core.identity
    assert _header.decode(out2[0])[0] == rid2
    assert core.inflight == {rid1: out1, rid2: out2}
    assert core.waiting == {rid1, rid2}
    (oneway,) = core.oneway(ListPartitions())
    assert _header.decode(oneway)[0] == rid2 + 1  # one-way messages take ids too
    assert len(core.inflight) == 2  # ... but nothing waits for them


class _Odd(msgspec.Struct):
    value: Any


def test_a_body_msgpack_cannot_carry_is_the_callers_error_before_anything_is_sent() -> None:
    core = ConnectionCore("tcp://h:1")
    with pytest.raises(tq.InvalidRequestError, match=r"_Odd cannot be sent.*valid UTF-8"):
        core.start(_Odd(2**70), ())  # beyond 64 bits
    assert core.inflight == {}
    assert core.waiting == set()


# ---- the table of requests --------------------------------------------------------------------


def test_a_reply_is_kept_for_its_waiting_request_until_it_finishes() -> None:
    core = ConnectionCore("tcp://h:1")
    rid, _ = core.start(ListPartitions(), ())
    assert core.on_message(_reply(rid, ["p"], b"data")) == rid
    assert rid not in core.inflight  # answered: not re-sent after a reconnect
    got = core.arrived.pop(rid)
    payload, frames = core.finish(rid, got)
    assert msgspec.msgpack.decode(payload) == ["p"]
    assert [bytes(f.buffer) for f in frames] == [b"data"]
    assert core.waiting == set()


def test_a_failure_reply_raises_its_class() -> None:
    core = ConnectionCore("tcp://h:1")
    rid, _ = core.start(ListPartitions(), ())
    header = error_reply(rid, tq.SchemaError("no field x"))
    assert core.on_message(_frames(header)) == rid
    with pytest.raises(tq.SchemaError, match="no field x"):
        core.finish(rid, core.arrived.pop(rid))
    assert core.waiting == set()


def test_an_unreadable_reply_is_dropped() -> None:
    core = ConnectionCore("tcp://h:1")
    rid, _ = core.start(ListPartitions(), ())
    assert core.on_message(_frames(b"\xc1 not msgpack")) is None
    assert core.arrived == {}
    assert rid in core.inflight


def test_an_abandoned_request_hands_its_reply_to_on_abandon_now_or_when_it_arrives() -> None:
    core = ConnectionCore("tcp://h:1")
    undone: list[int] = []

    def undo(reply: Reply, frames: list[Any]) -> None:
        undone.append(reply.rid)

    early, _ = core.start(ListPartitions(), ())
    core.on_message(_reply(early))
    assert not core.abandon(early, undo)  # the reply is there: no Cancel, undone now
    assert undone == [early]

    late, _ = core.start(ListPartitions(), ())
    assert core.abandon(late, undo)  # no reply yet: the service is sent a Cancel
    assert late not in core.inflight
    assert core.waiting == set()
    assert core.on_message(_reply(late)) is None
    assert undone == [early, late]

    undone_by_service, _ = core.start(ListPartitions(), ())
    assert core.abandon(undone_by_service, undo, cancel_undoes=True)
    core.on_message(_reply(undone_by_service))
    assert undone == [early, late]  # the service undid it on the Cancel


def test_an_on_abandon_that_fails_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    core = ConnectionCore("tcp://h:1")

    def undo(reply: Reply, frames: list[Any]) -> None:
        raise RuntimeError("boom")

    rid, _ = core.start(ListPartitions(), ())
    core.abandon(rid, undo)
    assert core.on_message(_reply(rid)) is None  # the reader goes on
    rid, _ = core.start(ListPartitions(), ())
    core.on_message(_reply(rid))
    assert not core.abandon(rid, undo)  # the caller's own error is not replaced


def test_a_failed_connection_forgets_what_it_would_resend_or_undo() -> None:
    core = ConnectionCore("tcp://h:1")
    rid, _ = core.start(ListPartitions(), ())
    core.abandon(rid, lambda reply, frames: None)
    core.start(ListPartitions(), ())
    core.forget_all()
    assert core.inflight == {}
    assert core.orphans == {}


# ---- liveness ---------------------------------------------------------------------------------


def test_monitor_events_connect_refuse_and_break() -> None:
    core = ConnectionCore("tcp://h:1", refused_is_broken=True)
    core.handshaken = False
    seen = core.on_monitor(zmq.EVENT_CONNECT_RETRIED, 0)  # the first attempt was refused
    assert seen.broken
    assert seen.why is not None
    assert "nothing listens at tcp://h:1" in seen.why
    error = core.disconnected(seen.why)
    assert core.connected is False
    with pytest.raises(tq.BrokenError, match="nothing listens at tcp://h:1"):
        core.check_usable(closed=False)  # the precise reason outlives the event
    assert str(error) == seen.why

    assert core.on_monitor(zmq.EVENT_CONNECTED, 0).connected
    assert core.connected
    core.check_usable(closed=False)
    core.on_monitor(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
    seen = core.on_monitor(zmq.EVENT_DISCONNECTED, 0)
    assert seen.broken
    assert seen.fail is None
    assert seen.why is None
    core.disconnected()
    # libzmq reports one retry as it schedules the reconnection, a second on a refusal
    assert not core.on_monitor(zmq.EVENT_CONNECT_RETRIED, 0).refused
    assert core.on_monitor(zmq.EVENT_CONNECT_RETRIED, 0).refused


def test_a_send_refused_after_the_service_refused_the_handshake_says_why() -> None:
    """A request sent while the service refuses this client's CURVE key can fail at the send
    itself (ZMQ has no pipe to the service: EAGAIN) rather than wait: its error is the
    refusal, not "Resource temporarily unavailable" (found by a loaded CI run of
    `test_refused_curve_keys_are_an_authentication_failure`). Once handshaken, a failed
    send is only broken."""
    core = ConnectionCore("tcp://h:1")
    core.handshaken = False
    core.on_monitor(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 0)
    error = core.broken("Hello", zmq.Again())
    assert isinstance(error, tq.AuthenticationError)
    assert "rejected this client's CURVE key" in str(error)
    core.on_monitor(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
    error = core.broken("Hello", zmq.Again())
    assert not isinstance(error, tq.AuthenticationError)
    assert "Hello to tcp://h:1 failed" in str(error)


def test_a_refused_first_attempt_is_only_broken_when_asked() -> None:
    core = ConnectionCore("tcp://h:1")
    seen = core.on_monitor(zmq.EVENT_CONNECT_RETRIED, 0)
    assert not seen.broken
    assert core.connected is None
    # ... but it is a refusal, for an owner that watches them (the controller's link to a
    # unit that died right after it registered: before, it was never told, and the unit
    # stayed "up" for good)
    assert seen.refused


def test_a_drop_during_the_handshake_is_not_a_tq_async_service() -> None:
    core = ConnectionCore("tcp://h:1", refused_is_broken=True)
    core.handshaken = False
    assert core.on_monitor(zmq.EVENT_CONNECTED, 0).connected
    # the first bare drop may be a CURVE service that did not say so yet: ZMQ dials again
    # (its retry is not a refusal), and a second bare drop is a peer that is no service
    assert core.on_monitor(zmq.EVENT_DISCONNECTED, 0) == Liveness()
    assert core.on_monitor(zmq.EVENT_CONNECT_RETRIED, 0) == Liveness()
    assert core.on_monitor(zmq.EVENT_CONNECTED, 0).connected
    seen = core.on_monitor(zmq.EVENT_DISCONNECTED, 0)
    assert seen.broken
    assert isinstance(seen.fail, tq.BrokenError)
    assert "not a tq_async service" in str(seen.fail)


@pytest.mark.parametrize("curve", [False, True])
def test_a_handshake_nobody_answered_is_not_called_a_foreign_service(
    monkeypatch: pytest.MonkeyPatch, curve: bool
) -> None:
    """A paused service (SIGSTOP): its kernel accepts the connection, nothing answers the
    ZMTP handshake, ZMQ gives up after its handshake interval (30 s), twice. The error said
    "what listens there is not a tq_async service" (with CURVE: "dropped the security
    handshake", a key problem); it says what is known: nothing answered within that time,
    the process may be paused, overloaded or not a tq_async service."""
    from tq_async._transport import _connection

    now = [100.0]
    monkeypatch.setattr(_connection, "_clock", lambda: now[0])
    keys = tq.CurveClient(*(b"x" * 40,) * 3) if curve else None
    core = ConnectionCore("tcp://h:1", refused_is_broken=True, curve=keys)
    core.handshaken = False
    seen = Liveness()
    for _ in range(2):
        assert core.on_monitor(zmq.EVENT_CONNECTED, 0).connected
        now[0] += 30.0  # ZMQ's handshake interval passes in silence
        seen = core.on_monitor(zmq.EVENT_DISCONNECTED, 0)
        if seen.broken:
            break
        assert core.on_monitor(zmq.EVENT_CONNECT_RETRIED, 0) == Liveness()
    assert seen.broken
    assert seen.fail is None, seen.fail  # (no refusal: a resumed process is welcome)
    error = core.disconnected(seen.why)
    assert type(error) is tq.BrokenError, error
    with pytest.raises(tq.BrokenError, match="nothing answered"):
        core.check_usable(closed=False)  # what later requests say too
    message = str(error)
    assert "nothing answered the ZMTP handshake within 30 s" in message, message
    assert "paused" in message, message
    assert "is not a tq_async service" not in message, message


def test_curve_refusals_say_what_to_fix() -> None:
    core = ConnectionCore("tcp://h:1")
    seen = core.on_monitor(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 0)
    assert isinstance(seen.fail, tq.AuthenticationError)
    assert "curve=tq.CurveClient" in str(seen.fail)
    seen = core.on_monitor(
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    )
    assert isinstance(seen.fail, tq.AuthenticationError)
    assert "uses CURVE encryption" in str(seen.fail)
    assert core.on_monitor(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, 0).fail is None


def test_a_refusal_read_before_any_request_is_still_the_requests_error() -> None:
    # the blocking connection reads the monitor when a request starts: the refusal and the
    # disconnect that follows it may both be read before the request waits for anything
    core = ConnectionCore("tcp://h:1")
    core.handshaken = False
    core.on_monitor(zmq.EVENT_CONNECTED, 0)
    core.on_monitor(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
    seen = core.on_monitor(zmq.EVENT_DISCONNECTED, 0)
    assert isinstance(seen.fail, tq.AuthenticationError)  # not "not a tq_async service"
    core.disconnected(seen.why)
    for _ in range(2):
        with pytest.raises(tq.AuthenticationError, match="uses CURVE encryption"):
            core.check_usable(closed=False)
    core.on_monitor(zmq.EVENT_CONNECTED, 0)
    core.on_monitor(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)  # e.g. the service got the keys
    core.check_usable(closed=False)
    assert core.refusal is None


def test_why_broken_tells_a_live_process_from_a_gone_one() -> None:
    core = ConnectionCore("tcp://h:1")
    assert "stopped, vanished or is not answering" in core.why_broken()  # across hosts
    assert "check that the service is running" in str(core.timed_out("GetMeta", 2))
    core.peer_pid = os.getpid()
    assert f"its process {os.getpid()} still exists" in core.why_broken()
    error = core.timed_out("GetMeta", 2)
    assert isinstance(error, tq.TQTimeoutError)
    assert "GetMeta to tcp://h:1 got no reply within 2 s" in str(error)
    assert "raise the timeout if it is only slow" in str(error)
    core.peer_pid = _gone_pid()
    assert core.why_broken() == "the service stopped or vanished"
    error = core.disconnected()
    assert "the connection to tcp://h:1 broke (the service stopped or vanished)" in str(error)
    assert "vanished" in str(core.disconnected(closed_by_peer=True))
    with pytest.raises(tq.BrokenError, match=r"is broken \(the service stopped or vanished\)"):
        core.check_usable(closed=False)
    broken = core.broken("Put", OSError("EPIPE"))
    assert "Put to tcp://h:1 failed: EPIPE (the service stopped or vanished)" in str(broken)


def test_a_closed_or_inherited_connection_is_never_used() -> None:
    core = ConnectionCore("tcp://h:1")
    with pytest.raises(tq.ClosedError, match="is closed"):
        core.check_usable(closed=True)
    core.pid = -1  # opened in another process (before a fork)
    with pytest.raises(tq.ClosedError, match="another process"):
        core.check_open(closed=False)


# ---- waiting ----------------------------------------------------------------------------------


def test_the_poll_backs_off_after_misses_and_resets_on_a_catch() -> None:
    poll = PollBackoff(1e-4)
    polled = []
    for _ in range(11):  # miss, skip 1, miss, skip 2, miss, skip 4, ...
        polled.append(poll.should_poll())
        if polled[-1]:
            poll.miss()
    assert polled == [True, False, True, False, False, True] + [False] * 4 + [True]
    for _ in range(PollBackoff.MAX_SKIP * 4):
        if poll.should_poll():
            poll.miss()
    assert poll._skip <= PollBackoff.MAX_SKIP
    while not poll.should_poll():
        pass
    poll.hit()
    assert poll.should_poll()
    assert poll.caught_replies == 1
    assert poll.missed_replies > 3


def test_an_attempt_waits_until_the_deadline_or_the_next_retry() -> None:
    assert first_of(None, None) is None
    assert first_of(5.0, None) == 5.0
    assert first_of(None, 2.0) == 2.0
    assert first_of(5.0, 2.0) == 2.0
    assert first_of(1.0, 2.0) == 1.0


def test_heartbeats_notice_a_silent_peer_after_the_timeout() -> None:
    assert heartbeat_ms(None) == (2_000, 10_000)
    assert heartbeat_ms(1.0) == (250, 1_000)
    assert heartbeat_ms(0.1) == (50, 100)


def test_heartbeat_timeouts_stay_within_what_zmq_takes() -> None:
    # zmq keeps the timeout in a C int (ms): a longer one raised OverflowError when the
    # controller linked to its units; and 0 ms turns ZMTP's timeout off (a unit silent for
    # good was never suspended), so a tiny timeout is 1 ms, not 0
    assert heartbeat_ms(3e6) == (2_000, 2**31 - 1)
    assert heartbeat_ms(1e300) == (2_000, 2**31 - 1)
    assert heartbeat_ms(1e-9) == (50, 1)


def test_a_request_names_its_client_so_a_handed_over_connection_is_still_recognised() -> None:
    # a ZMQ ROUTER that hands a client's identity over to its new connection renames the old
    # one: its unread messages come out under a made-up routing id; the header names the
    # client again, so the service recognises a retry (and answers the live connection)
    from tq_async._wire._protocol import ListPartitions, controller_request_decoder, salvage_rid

    core = ConnectionCore("tcp://127.0.0.1:1")
    rid, outgoing = core.start(ListPartitions(), [])
    req = controller_request_decoder.decode(outgoing[0])
    assert (req.rid, req.client) == (rid, core.identity)
    assert salvage_rid(outgoing[0]) == rid
    old_style = msgspec.msgpack.encode((7, ListPartitions()))  # a header without it decodes
    assert controller_request_decoder.decode(old_style).client is None


def test_a_request_waits_up_to_its_deadline_with_a_retry_every_retry_after() -> None:
    core = ConnectionCore("tcp://h:1", retry_after=10.0)
    assert core.next_wait(None, 5.0) == (10.0, False)  # no deadline: keep-alive resends
    assert core.next_wait(100.0, 0.0) == (10.0, False)  # a retry before the deadline
    assert core.next_wait(100.0, 95.0) == (5.0, True)  # the last attempt: up to the deadline
    assert core.next_wait(100.0, 100.0) is None  # the deadline passed
    core.retry_after = None
    assert core.next_wait(None, 0.0) == (None, False)  # waits until it is answered
    assert core.next_wait(100.0, 40.0) == (60.0, True)


def test_a_same_host_twin_is_named_after_the_address_the_program_gave() -> None:
    core = ConnectionCore("uds://@tq-1", known_as="tcp://h:1")
    assert (core.known_as, core.name, core.unix) == ("tcp://h:1", "tcp://h:1 (uds://@tq-1)", True)
    core = ConnectionCore("tcp://h:1")
    assert (core.known_as, core.name, core.unix) == ("tcp://h:1", "tcp://h:1", False)


async def test_a_retired_connection_breaks_its_waiting_requests_retryably() -> None:
    """A connection its owner replaced (a same-host twin, a unit that moved or registered
    again) fails what still waits on it with BrokenError, "retry"; `close()` by the program
    keeps ClosedError."""
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # takes requests, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        for end, expected in [("retire", tq.BrokenError), ("close", tq.ClosedError)]:
            conn = DealerConnection(f"tcp://127.0.0.1:{port}")
            failed: list[BaseException] = []
            async with anyio.create_task_group() as tg:

                async def wait(
                    conn: DealerConnection = conn, failed: list[BaseException] = failed
                ) -> None:
                    try:
                        await conn.request(ListPartitions(), timeout=30)
                    except tq.TQError as error:
                        failed.append(error)

                tg.start_soon(wait)
                await anyio.wait_all_tasks_blocked()
                if end == "retire":
                    conn.retire("by a test")
                else:
                    conn.close()
            [exc] = failed
            assert type(exc) is expected, repr(exc)
            if end == "retire":
                assert "replaced (by a test)" in str(exc)
                assert "retry" in str(exc)
    finally:
        silent.close(linger=0)


def test_a_refused_first_attempt_at_a_host_name_may_be_a_name_that_does_not_resolve() -> None:
    # ZMQ reports a name that does not resolve as a refused attempt: "the connection was
    # refused" alone sent the user looking for a service on a host that does not exist
    named = ConnectionCore("tcp://no-such-host.invalid:5555", refused_is_broken=True)
    assert "does not resolve" in str(named.on_monitor(zmq.EVENT_CONNECT_RETRIED, 0).why)
    for literal in ("tcp://127.0.0.1:9", "tcp://[::1]:9", "ipc:///tmp/x"):
        core = ConnectionCore(literal, refused_is_broken=True)
        why = str(core.on_monitor(zmq.EVENT_CONNECT_RETRIED, 0).why)
        assert "was refused" in why
        assert "resolve" not in why
