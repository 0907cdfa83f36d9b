"""Slot leases: the admission slots of a holder that names itself (an asynchronous client)
lapse unless its client renews them, so a producer that died where nothing tells the
controller (over TCP), or that held slots across a restart of a durable controller and never
came back, gives them back; one that renews keeps them, across the restart too."""

from __future__ import annotations

import msgspec
import pytest

from tq_async._core._effects import AdmissionConfig
from tq_async._core._journal import (
    ControllerRecord,
    controller_record,
    decode_controller,
    encode,
    recover,
)
from tq_async._core._state import ControllerState
from tq_async._core._transitions import ControllerCore
from tq_async._errors import InvalidRequestError
from tq_async._wire._columns import ColumnHeader

X = ColumnHeader("x", "dense", "int64", ())
A, B = b"holder-a", b"holder-b"
PEER_A, PEER_B = b"connection-a", b"connection-b"
LEASE = 10.0


def new_core(capacity: int = 4) -> ControllerCore:
    admission = AdmissionConfig(capacity=capacity, learner_task="learn", slot_lease=LEASE)
    return ControllerCore(ControllerState({0: "inproc://u0"}), admission=admission)


def put(core: ControllerCore, n: int, peer: bytes) -> None:
    placement, _ = core.put_begin("p", [X], n, None, None, 0.0)
    core.put_commit("p", placement.rows, ["x"], None, [0] * n, placement.put_id, None, peer)


def test_slots_not_renewed_come_back_when_their_lease_lapses() -> None:
    """A holder whose client stopped renewing (it died over TCP) gives its slots back one
    lease after its last renewal; the renewed one keeps its own."""
    core = new_core()
    assert core.acquire(0, 2, holder=A, now=0.0)
    assert core.acquire(0, 2, holder=B, now=0.0)
    assert core.next_deadline() == LEASE
    core.renew_slots(B, PEER_B, 6.0)
    core.renew_slots(B, PEER_B, 12.0)
    fx = core.advance(LEASE)
    assert fx.admission
    assert core.state.holders == {B: 2}
    assert core.state.outstanding == 2
    assert core.next_deadline() == 12.0 + LEASE
    assert not core.advance(20.0).admission  # B renewed at 12: alive, however slow
    assert core.state.holders == {B: 2}


def test_slots_put_need_no_lease() -> None:
    """A holder whose slots were all put has no lease left: nothing lapses, a late renewal
    changes nothing, and the put rows stay outstanding until the learner consumes them."""
    core = new_core()
    assert core.acquire(0, 2, holder=A, now=0.0)
    core.renew_slots(A, PEER_A, 1.0)
    put(core, 2, PEER_A)
    assert core.state.holders == {}
    assert core.state.slot_leases == {}
    assert core.next_deadline() is None
    core.renew_slots(A, PEER_A, 2.0)
    assert core.state.slot_leases == {}
    assert not core.advance(100.0).admission
    assert core.state.outstanding == 2


def test_a_put_settles_the_holder_its_connection_names_first() -> None:
    """A holder is a name, not a connection: a put (or a release) on a connection that
    named its holder settles that holder's slots first, not the oldest holders'."""
    core = new_core(capacity=8)
    assert core.acquire(0, 3, holder=A, now=0.0)
    assert core.acquire(0, 3, holder=B, now=0.0)
    core.renew_slots(B, PEER_B, 0.0)
    put(core, 2, PEER_B)
    assert core.state.holders == {A: 3, B: 1}
    assert core.release_slots(1, PEER_B)
    assert core.state.holders == {A: 3}
    assert core.state.slot_leases == {A: LEASE}


def test_a_named_holders_connection_ending_gives_its_slots_back_at_once() -> None:
    """A same-host client's Unix socket ends (its process died): the holder it named gives
    its slots back at once, without waiting for the lease; a connection that named none
    gives back its own (an unnamed holder: a blocking client)."""
    core = new_core()
    assert core.acquire(0, 2, holder=A, now=0.0)
    core.renew_slots(A, PEER_A, 0.0)
    assert core.acquire(0, 1, holder=PEER_B)  # unnamed: the connection holds them
    assert core.peer_gone(PEER_A)
    assert core.state.holders == {PEER_B: 1}
    assert core.state.slot_leases == {}
    assert core.next_deadline() is None  # (its lease's timer is stale, dropped)
    assert core.peer_gone(PEER_B)
    assert core.state.outstanding == 0


def test_unnamed_holders_never_lapse() -> None:
    """A holder that never renews (a blocking client, whose timers fire only while it waits
    in a call) has no lease: its slots stay until put, released, or its connection ends."""
    core = new_core()
    assert core.acquire(0, 2, holder=PEER_A)
    assert core.next_deadline() is None
    assert not core.advance(1e9).admission
    assert core.state.holders == {PEER_A: 2}


def test_recovered_holders_get_a_full_lease_and_keep_it_by_renewing() -> None:
    """A durable controller restarted: the holders that renewed start with a full lease;
    the one whose client renews again (it reconnected) keeps its slots and its put settles
    them, the one that never comes back gives its slots back; an unnamed holder is kept."""
    core = new_core(capacity=5)
    assert core.acquire(0, 2, holder=A, now=0.0)
    assert core.acquire(0, 2, holder=B, now=0.0)
    assert core.acquire(0, 1, holder=PEER_A)
    ctl = decode_controller(encode(controller_record(core, {}, 1000.0)))
    again = new_core(capacity=5)
    recover(again, ctl, [], 500.0, 1000.0, {0: "inproc://u0"})
    assert again.state.slot_leases == {A: 500.0 + LEASE, B: 500.0 + LEASE}
    again.renew_slots(A, b"new-connection", 505.0)
    assert again.advance(500.0 + LEASE).admission  # B never came back
    assert again.state.holders == {A: 2, PEER_A: 1}
    put(again, 2, b"new-connection")
    assert again.state.holders == {PEER_A: 1}
    assert again.state.outstanding == 3


def test_a_record_without_leases_still_loads() -> None:
    """A journal written before slot leases: its holders load, kept until put (no lease)."""
    old = msgspec.structs.replace(
        controller_record(new_core(), {}, 1000.0), holders=[(A, 2)], outstanding=2
    )
    fields = msgspec.structs.astuple(old)[:-1]  # (no ``leased``: an older record)
    ctl = decode_controller(msgspec.msgpack.encode(fields))
    assert isinstance(ctl, ControllerRecord)
    again = new_core()
    recover(again, ctl, [], 0.0, 1000.0, {0: "inproc://u0"})
    assert again.state.holders == {A: 2}
    assert again.state.slot_leases == {}
    assert not again.advance(1e9).admission
    assert again.state.holders == {A: 2}


@pytest.mark.parametrize("lease", [0, -1.0, float("inf"), float("nan"), True, "60"])
def test_a_bad_slot_lease_is_refused(lease: object) -> None:
    with pytest.raises(InvalidRequestError, match="slot_lease"):
        AdmissionConfig(slot_lease=lease)  # type: ignore[arg-type]
