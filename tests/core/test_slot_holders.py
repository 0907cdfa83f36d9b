"""Admission slots tied to their holder (the client that acquired them): a holder gone
gives back the slots it never put; puts, from the holder or from another client, settle
slots first; the holders survive a restart of a durable controller."""

from __future__ import annotations

import pytest

from tq_async._core import _arrays
from tq_async._core._effects import AdmissionConfig
from tq_async._core._journal import controller_record, decode_controller, encode, recover
from tq_async._core._state import ControllerState
from tq_async._core._transitions import ControllerCore, SampleCall
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import GetMeta, MetaReply

X = ColumnHeader("x", "dense", "int64", ())
A, B, W = b"producer-a", b"producer-b", b"worker"


def new_core(capacity: int = 4) -> ControllerCore:
    admission = AdmissionConfig(capacity=capacity, learner_task="learn")
    return ControllerCore(ControllerState({0: "inproc://u0"}), admission=admission)


def put(core: ControllerCore, n: int, holder: bytes, version: int | None = 0) -> list[int]:
    placement, _ = core.put_begin("p", [X], n, None, None, 0.0)
    versions = None if version is None else [version] * n
    core.put_commit("p", placement.rows, ["x"], None, versions, placement.put_id, None, holder)
    return placement.rows


def learn(core: ControllerCore, n: int) -> None:
    req = GetMeta("p", ["x"], n, "learn", None)
    decision, _ = core.get_meta(req, 0.0)
    while isinstance(decision, SampleCall):
        decision, _ = core.sampled(req, decision, decision.run(), 0.0)
    assert isinstance(decision, MetaReply)
    assert len(decision.rows) == n


def test_a_holder_gone_gives_back_the_slots_it_never_put() -> None:
    """A producer acquired and died before its put: its slots come back, and only its own
    (another producer, alive and slow, keeps its slots)."""
    core = new_core()
    assert core.acquire(0, 2, holder=A)
    assert core.acquire(0, 2, holder=B)
    assert not core.acquire(0, 1, holder=W)  # full
    assert core.holder_gone(A)
    assert core.state.outstanding == 2
    assert core.state.holders == {B: 2}
    assert core.acquire(0, 2, holder=W)
    assert not core.holder_gone(b"never-acquired")
    assert core.state.outstanding == 4


def test_put_rows_stay_outstanding_until_the_learner_consumes_them() -> None:
    """A holder's put settles its slots: dying after it gives nothing back (its rows wait for
    the learner, whose consumption frees them), so the capacity is never exceeded."""
    core = new_core()
    assert core.acquire(0, 3, holder=A)
    put(core, 2, A)
    assert core.state.holders == {A: 1}
    assert core.holder_gone(A)  # the one never put
    assert core.state.outstanding == 2
    learn(core, 2)
    assert core.state.outstanding == 0


def test_a_put_from_another_client_settles_the_oldest_holders_slots() -> None:
    """A rollout manager acquires, its workers put from their own clients: the workers'
    puts settle the manager's slots, so the manager closing frees none of the put rows."""
    core = new_core(capacity=8)
    assert core.acquire(0, 3, holder=A)
    assert core.acquire(0, 3, holder=B)
    put(core, 4, W)  # settles A's 3, then 1 of B's
    assert core.state.holders == {B: 2}
    put(core, 1, B)  # its own first
    assert core.state.holders == {B: 1}
    assert not core.holder_gone(A)
    assert core.holder_gone(B)
    assert core.state.outstanding == 5


def test_only_rows_given_their_first_version_settle_slots() -> None:
    """Rows put without a policy version count against no admission, nor do rows that had
    one already (a second field of the same rollout): neither settles a slot."""
    core = new_core()
    assert core.acquire(0, 4, holder=A)
    put(core, 2, A, version=None)
    rows = put(core, 2, A)
    core.put_commit("p", rows, ["x"], None, [0, 0], 0, None, A)  # the same rows again
    assert core.state.holders == {A: 2}


def test_release_rollout_and_a_cancelled_admission_settle_their_holders_slots() -> None:
    core = new_core()
    assert core.acquire(0, 4, holder=A)
    assert core.release_slots(3, A)
    assert core.state.holders == {A: 1}
    assert core.state.outstanding == 1
    assert core.holder_gone(A)
    assert core.state.outstanding == 0
    assert core.state.holders == {}


def test_the_holders_survive_a_restart() -> None:
    """A durable controller records each holder's slots: recovered, a holder gone after the
    restart gives its slots back there too (once its identity is known there: see
    tests/faults/test_dead_producers.py)."""
    core = new_core()
    assert core.acquire(0, 2, holder=A)
    assert core.acquire(0, 1, holder=B)
    ctl = decode_controller(encode(controller_record(core, {}, 1000.0)))
    again = new_core()
    recover(again, ctl, [], 0.0, 1000.0, {})
    assert list(again.state.holders.items()) == [(A, 2), (B, 1)]
    assert again.holder_gone(A)
    assert again.state.outstanding == 1


def test_a_put_settles_slots_in_a_partition_whose_cleared_front_was_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows are counted by their ids, not their places in the partition's arrays: once the
    cleared rows at the front are dropped (the arrays start at ``base``), a holder's put of
    new rows still settles its slots (it counted row ``r`` at place ``r`` before)."""
    monkeypatch.setattr(_arrays, "COMPACT_ROWS", 2)
    core = new_core(capacity=8)
    assert core.acquire(0, 4, holder=A)
    old = put(core, 4, A)
    learn(core, 4)
    core.clear_rows("p", old)
    assert core.state.partitions["p"].base == 4
    assert core.acquire(0, 2, holder=B)
    put(core, 2, B)
    assert core.state.holders == {}
    assert not core.holder_gone(B)  # nothing left to give back: its rows wait for the learner
    assert core.state.outstanding == 2
