"""The controller's journal records (issue 36): the format round-trips and a core rebuilt from
its records is the core that wrote them: partitions, rows, fields, tags, KV keys, consumption,
recorded batches, leases (with the time they had left), uncommitted puts (aborted), units,
admission and ids. Pure: no files, no loop; time is a number the test chooses."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest
import structlog

from tq_async import CheckpointError, SequentialSampler
from tq_async._core._admission import ADMITTED_TOKENS
from tq_async._core._dumps import partition_dump
from tq_async._core._journal import (
    RESERVE_MIN,
    Tracker,
    controller_record,
    decode_controller,
    decode_partition,
    encode,
    partition_record,
    recover,
)
from tq_async._core._recycled import RecycledQueue
from tq_async._core._state import ControllerState, Wakeup
from tq_async._core._transitions import ControllerCore, SampleCall
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import GetMeta, MetaReply

X = ColumnHeader("x", "dense", "int64", ())
UNITS = {0: "tcp://u0", 1: "tcp://u1"}


def new_core() -> ControllerCore:
    return ControllerCore(ControllerState(dict(UNITS)))


def put(core: ControllerCore, n: int, pid: str = "p", **kw: Any) -> list[int]:
    placement, _ = core.put_begin(pid, [X], n, None, None, 0.0)
    core.put_commit(pid, placement.rows, ["x"], kw.get("tags"), None, placement.put_id)
    return placement.rows


def get(core: ControllerCore, req: GetMeta, now: float = 0.0) -> MetaReply:
    decision, _ = core.get_meta(req, now)
    while isinstance(decision, SampleCall):
        decision, _ = core.sampled(req, decision, decision.run(), now)
    assert isinstance(decision, MetaReply)
    return decision


def fetch(n: int, task: str = "t", lease: float | None = None, **cfg: Any) -> GetMeta:
    return GetMeta("p", ["x"], n, task, cfg or None, lease=lease)


def reborn(
    core: ControllerCore, now: float, later: float, *, down: float = 0.0, up: bool = True
) -> ControllerCore:
    """Record ``core`` at ``now``, encode and decode, and recover a new core at ``later``
    after ``down`` seconds of wall-clock time; the units come back (``up``) with their data."""
    parts = [decode_partition(encode(partition_record(p, now, 1000.0))) for p in _parts(core)]
    ctl = decode_controller(encode(controller_record(core, {0: "i0", 1: "i1"}, 1000.0)))
    again = ControllerCore(ControllerState())
    recover(again, ctl, parts, later, 1000.0 + down, {})
    if up:
        for unit in UNITS:
            again.unit_up(unit)
    return again


def _parts(core: ControllerCore) -> list[Any]:
    return list(core.state.partitions.values())


def test_records_round_trip() -> None:
    core = new_core()
    put(core, 4, tags=[{"g": i % 2} for i in range(4)])
    get(core, fetch(2, lease=5.0), now=1.0)
    p = core.state.partitions["p"]
    rec = partition_record(p, 2.0, 123.0)
    assert decode_partition(encode(rec)) == rec
    assert rec.leases[0].left == 4.0
    ctl = controller_record(core, {0: "i0"}, 123.0)
    assert decode_controller(encode(ctl)) == ctl
    assert ctl.units == UNITS


def test_rows_fields_tags_keys_seal_and_consumption_survive() -> None:
    core = new_core()
    put(core, 4, tags=[{"g": i} for i in range(4)])
    kv, _ = core.put_begin("kv", [X], 2, None, ["a", "b"], 0.0)
    core.put_commit("kv", kv.rows, ["x"], None, None, kv.put_id)
    core.catalog.seal("p")
    got = get(core, fetch(2, lease=None))  # consumed for good (no lease)
    before = core.state.partitions["p"]
    again = reborn(core, 0.0, 50.0)
    p = again.state.partitions["p"]
    assert partition_dump(p) == partition_dump(before)
    assert p.incarnation == before.incarnation  # old BatchMetas stay valid
    assert sorted(again.state.partitions["kv"].keys) == ["a", "b"]
    assert p.sealed
    assert [t["g"] for t in p.tags if t] == [0, 1, 2, 3]
    rest = get(again, fetch(4), now=50.0)
    assert sorted(rest.rows) == sorted(set(range(4)) - set(got.rows))  # nothing twice


def test_a_lease_resumes_with_the_time_it_had_left() -> None:
    core = new_core()
    put(core, 4)
    leased = get(core, fetch(2, lease=10.0), now=0.0)
    again = reborn(core, 4.0, 100.0, down=2.0)  # 6 s left when written, 2 s down: 4 s left
    p = again.state.partitions["p"]
    (lease,) = p.leases.values()
    assert lease.lease_id == leased.lease_id
    assert lease.deadline == 104.0
    assert sorted(get(again, fetch(2), now=100.0).rows) == [2, 3]  # not the leased rows
    again.advance(104.0)
    assert sorted(get(again, fetch(2), now=104.0).rows) == sorted(leased.rows)  # expired


def test_a_lease_that_ran_out_while_down_expires_and_an_ack_still_counts() -> None:
    core = new_core()
    put(core, 4)
    a = get(core, fetch(2, lease=10.0))
    b = get(core, fetch(2, lease=10.0))
    again = reborn(core, 1.0, 7.0, down=60.0)
    assert again.state.partitions["p"].leases == {}  # both ran out while the controller was down
    assert sorted(get(again, fetch(4), now=7.0).rows) == sorted([*a.rows, *b.rows])
    core2 = new_core()
    put(core2, 2)
    c = get(core2, fetch(2, lease=10.0))
    back = reborn(core2, 1.0, 7.0)
    back.ack([c.lease_id], 7.0)
    back.advance(1000.0)
    p = back.state.partitions["p"]
    assert p.leases == {}
    assert p.consumed_count["t"] == 2


def test_recorded_batches_replay_identically_and_ids_go_on() -> None:
    core = new_core()
    put(core, 8)
    first = get(core, fetch(4, lease=30.0, batch_index=0))
    again = reborn(core, 1.0, 2.0)
    replay = get(again, fetch(4, lease=30.0, batch_index=0), now=2.0)
    assert replay.rows == first.rows
    assert replay.lease_id == first.lease_id  # a lease belongs to its batch
    nxt = get(again, fetch(4, lease=30.0, batch_index=1), now=2.0)
    assert set(nxt.rows).isdisjoint(first.rows)
    assert nxt.lease_id > first.lease_id  # ids never repeat across a restart


def test_an_uncommitted_put_is_aborted_and_units_wait_to_come_back() -> None:
    core = new_core()
    put(core, 2)
    core.put_begin("p", [X], 3, None, None, 0.0)  # never committed
    again = reborn(core, 0.0, 1.0, up=False)
    p = again.state.partitions["p"]
    assert p.n_alive == 2
    assert p.put_leases == {}
    assert set(again.state.suspended) == {0, 1}  # until they answer with their data
    again.unit_up(0)
    again.unit_up(1)
    assert sorted(get(again, fetch(2), now=1.0).rows) == [0, 1]


def test_units_awaited_after_a_restart_are_not_reported_as_a_fault(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A recovered controller waits for its units to come back with their data: a clean
    restart, not a unit that went silent, so it logs no "storage unit suspended" warning."""
    core = new_core()
    put(core, 2)
    caplog.set_level(logging.INFO, logger="tq_async")
    with structlog.testing.capture_logs() as logs:
        again = reborn(core, 0.0, 1.0, up=False)
    assert set(again.state.suspended) == {0, 1}
    assert not [e for e in logs if e["log_level"] == "warning"], logs
    assert sorted(e["unit"] for e in logs if "awaited" in e["event"]) == [0, 1]
    with structlog.testing.capture_logs() as logs:
        again.unit_down(0, 2.0)  # (already suspended: nothing new)
        again.unit_up(0)
        again.unit_down(0, 3.0)  # silent once it was back: that is a fault
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "storage unit suspended: its rows wait until it comes back or is declared lost"
    ]


def test_a_replay_after_a_restart_waits_for_its_unit_and_is_woken_when_it_is_back() -> None:
    """A recorded batch replayed after a restart, before its unit answered with its data (it
    is suspended until then): the replay waits, and the unit's return wakes it (before: no
    wake-up came, as the recovered partition had built no ready set yet, so the replay waited
    until its timeout)."""
    core = new_core()
    put(core, 4)
    first = get(core, fetch(4, batch_index=0))
    again = reborn(core, 1.0, 2.0, up=False)
    decision, _ = again.get_meta(fetch(4, batch_index=0), 2.0)
    assert decision is None  # its rows are neither handed out nor lost: it waits
    assert Wakeup("p") in again.unit_up(first.units[0]).wakeups
    assert get(again, fetch(4, batch_index=0), now=2.0).rows == first.rows


class _CannotLoad(SequentialSampler):
    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise KeyError("rng")


def test_a_sampler_that_cannot_load_its_state_is_a_clear_error_at_start() -> None:
    """A controller restarted with a sampler whose ``load_state_dict`` raises (another
    sampler than the one that wrote the journal): a `CheckpointError` naming the sampler and
    what to do, not the sampler's bare ``KeyError('rng')``."""
    core = new_core()
    put(core, 2)
    ctl = decode_controller(encode(controller_record(core, {}, 1000.0)))
    parts = [decode_partition(encode(partition_record(p, 0.0, 1000.0))) for p in _parts(core)]
    again = ControllerCore(ControllerState(), _CannotLoad())
    expected = r"sampler _CannotLoad \(default\).*KeyError.*data_dir"
    with pytest.raises(CheckpointError, match=expected):
        recover(again, ctl, parts, 1.0, 1001.0, {})


def test_rows_reserved_while_puts_are_open_are_skipped_by_recovery() -> None:
    core = new_core()
    put(core, 2)
    idle = partition_record(core.state.partitions["p"], 0.0, 1000.0)
    assert idle.reserved == 2  # no put open: nothing ahead, recovery skips nothing
    open_put, _ = core.put_begin("p", [X], 3, None, None, 0.0)  # placed, never committed
    rec = partition_record(core.state.partitions["p"], 0.0, 1000.0)
    assert rec.reserved == 5 + RESERVE_MIN  # ids up to here may be placed before the next
    again = reborn(core, 0.0, 1.0)
    p = again.state.partitions["p"]
    assert p.n_rows == rec.reserved  # the reserved ids are dead rows, never given again
    assert p.n_alive == 2
    assert not any(p.alive[2:])
    assert put(again, 4) == list(range(rec.reserved, rec.reserved + 4))
    assert set(open_put.rows).isdisjoint(put(again, 8))
    assert sorted(get(again, fetch(14), now=1.0).rows) == [
        0,
        1,
        *range(rec.reserved, rec.reserved + 12),
    ]


def test_a_record_reserves_ahead_while_rows_are_added_and_nothing_once_idle() -> None:
    core = new_core()
    tracker = Tracker()
    p = core.state.partitions
    put(core, 3)  # committed: no put open, but rows were added since the last record
    tracker.record(p["p"], 0.0, 1000.0)
    assert tracker.reserved == 3 + RESERVE_MIN  # a one-at-a-time producer's next placement
    put(core, 2000)
    tracker.record(p["p"], 0.0, 1000.0)
    assert tracker.reserved == 2003 + 2 * 2000  # twice what was added since
    tracker.record(p["p"], 0.0, 1000.0)  # added none, but the record before did
    assert tracker.reserved == 2003 + 2 * 2000
    tracker.record(p["p"], 0.0, 1000.0)
    assert tracker.reserved == 2003  # idle for two records: a restart skips nothing


def test_units_of_the_recovering_process_lost_their_cells() -> None:
    core = new_core()
    put(core, 2)
    parts = [partition_record(p, 0.0, 0.0) for p in _parts(core)]
    ctl = controller_record(core, {}, 0.0)
    again = ControllerCore(ControllerState({0: "inproc://new0", 1: "inproc://new1"}))
    recover(again, ctl, parts, 0.0, 0.0, {0: "inproc://new0", 1: "inproc://new1"})
    p = again.state.partitions["p"]
    assert p.n_alive == 0
    assert sorted(p.lost) == [0, 1]
    assert again.state.units == {0: "inproc://new0", 1: "inproc://new1"}
    assert not again.state.dead_units  # new rows go to the new units


def test_admission_and_policy_version_survive() -> None:
    core = new_core()
    core.set_policy_version(3)
    core.state.auto_clear["p"] = ("a", "b")
    again = reborn(core, 0.0, 0.0)
    assert again.state.learner_version == 3
    assert again.state.auto_clear["p"] == ("a", "b")


@pytest.mark.parametrize(
    ("at_run_time", "configured_again", "recovered"),
    [
        ({None: ("b",)}, {None: ("a",)}, {None: ("b",)}),  # register_tasks(["b"]) holds
        ({}, {None: ("a",)}, {}),  # register_tasks([]): stays off
        ({None: ("a",)}, {None: ("c",)}, {None: ("c",)}),  # unchanged: the new configuration
        ({None: ("a",)}, {}, {}),  # unchanged: the configuration dropped it
        ({None: ("a",), "p": ("b",)}, {None: ("a",)}, {None: ("a",), "p": ("b",)}),
    ],
)
def test_auto_clear_set_at_run_time_wins_over_the_configuration_it_started_with(
    at_run_time: dict[str | None, tuple[str, ...]],
    configured_again: dict[str | None, tuple[str, ...]],
    recovered: dict[str | None, tuple[str, ...]],
) -> None:
    """Started with ``auto_clear_tasks = ["a"]``; ``register_tasks`` made it ``at_run_time``;
    restarted with ``configured_again``: what the program changed holds, what it did not
    follows the configuration."""
    core = new_core()
    start = {None: ("a",)}
    core.state.auto_clear = dict(at_run_time)
    ctl = decode_controller(encode(controller_record(core, {}, 1000.0, start)))
    again = ControllerCore(ControllerState())
    again.state.auto_clear = dict(configured_again)
    recover(again, ctl, [], 0.0, 1000.0, {})
    assert again.state.auto_clear == recovered


def test_an_admission_asked_again_by_its_token_is_counted_once_across_a_restart() -> None:
    """An admission's reply lost with the controller: the client asks again with the same
    token, and the recovered controller admits it without taking its slots twice."""
    core = new_core()
    assert core.acquire(0, 3, token=11)
    assert core.acquire(0, 3, token=11)  # the same admission, asked again
    assert core.state.outstanding == 3
    again = reborn(core, 0.0, 0.0)
    assert again.state.outstanding == 3
    assert again.acquire(0, 3, token=11)
    assert again.state.outstanding == 3
    assert again.acquire(0, 3, token=12)  # another admission
    assert again.acquire(0, 2, token=11)  # another row count: not the same admission
    assert again.acquire(0, 3)  # no token: always a new one
    assert again.state.outstanding == 11


def test_a_batch_waiting_for_its_reader_still_holds_its_rows_after_a_restart() -> None:
    """Auto-clear tasks "t" and "u"; "u"'s batch 0 lost its lease (its rank died), then the
    controller restarted: the recovered batch still holds its rows, so "t" acknowledging them
    frees nothing until "u"'s replay is acknowledged."""
    core = new_core()
    core.catalog.register_tasks("p", ["t", "u"])
    put(core, 4)
    get(core, GetMeta("p", ["x"], 4, "u", {"dp_rank": 0, "batch_index": 0}, lease=5.0))
    core.advance(10.0)
    again = reborn(core, 10.0, 10.0)
    other = get(again, fetch(4, lease=5.0), 10.0)
    assert again.ack([other.lease_id], 10.0).free == []
    replay = get(again, GetMeta("p", ["x"], 4, "u", {"dp_rank": 0, "batch_index": 0}, lease=5.0))
    assert replay.rows == [0, 1, 2, 3]
    assert again.ack([replay.lease_id], 10.0).free
    assert again.state.partition("p").held == {}


def test_only_the_latest_admission_tokens_are_remembered() -> None:
    core = new_core()
    for token in range(1, ADMITTED_TOKENS + 2):
        assert core.acquire(0, 1, token=token)
    assert len(core.state.admitted) == ADMITTED_TOKENS
    assert 1 not in core.state.admitted  # the oldest went first
    assert core.acquire(0, 1, token=2)  # still known: not counted again
    assert core.state.outstanding == ADMITTED_TOKENS + 1


def test_a_recovered_partition_records_its_changes_for_watchers() -> None:
    core = new_core()
    put(core, 4)
    again = reborn(core, 0.0, 1.0)
    again.state.events.start()
    got = get(again, fetch(2), now=1.0)
    again.clear_rows("p", [3])
    kinds = [(type(e).__name__, sorted(getattr(e, "rows", []))) for e in again.state.events.take()]
    assert ("RowsConsumed", sorted(got.rows)) in kinds
    assert ("RowsRemoved", [3]) in kinds


def test_the_recycled_queue_is_encoded_again_only_after_it_changed() -> None:
    """The controller's record is written with every commit; its queue of recycled rows is
    encoded once per change (a 100,000-row queue took 17 ms to encode, at every commit), and
    reads back as the list of entries records of earlier versions wrote."""
    q = RecycledQueue()
    assert msgspec.msgpack.decode(q.encoded()) == []
    q.extend([("p", "i", 0), ("p", "i", 1)])
    first = q.encoded()
    assert q.encoded() is first  # unchanged: the same bytes, not encoded again
    q.extendleft([("q", "j", 5)])
    assert q.popleft() == ("q", "j", 5)
    again = q.encoded()
    assert again is not first
    assert bytes(again) == bytes(first)  # the same entries, the same bytes
    old_style = msgspec.msgpack.encode([["p", "i", 0], ["p", "i", 1]])  # a list, as before
    copy = RecycledQueue()
    copy.load(old_style)
    assert list(copy) == list(q) == [("p", "i", 0), ("p", "i", 1)]


def test_a_key_tagged_while_the_put_creating_it_was_open_survives_its_abort() -> None:
    """A kv tag (here an empty one: kv_retrieve_meta(create=True)) of a key whose creating
    put was still open is acknowledged: recovery aborts the put, not the key."""
    core = new_core()
    core.put_begin("kv", [X], 0, None, ["k", "j"], 0.0)  # never committed
    core.catalog.kv_tag("kv", ["k"], [{}], 0.0)
    again = reborn(core, 0.0, 1.0)
    p = again.state.partitions["kv"]
    assert p.keys == {"k": 0}
    assert p.tags[0] == {}
