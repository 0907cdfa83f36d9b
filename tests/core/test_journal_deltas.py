"""The controller's journal as deltas (issue 36): after any sequence of transitions and group
commits, each partition's snapshot with its deltas replayed is the live partition's record,
and a core recovered from the journal is the live core. Random transitions (puts with tags,
versions and keys, uncommitted and aborted puts, fetches with leases, holds and recorded
batches, acks, releases, expiries, clears, tags, seals, resets, lost units, dropped
partitions), commits of random subsets of the partitions, and snapshots forced often so the
compaction is exercised too. Pure: the journal's tables are dicts here."""

from __future__ import annotations

import random
from typing import Any

import pytest

from _recovered import assert_recovered_as
from tq_async import _errors
from tq_async._core import _arrays, _journal
from tq_async._core._arrays import live_rows
from tq_async._core._journal import (
    PartitionRecord,
    Tracker,
    controller_record,
    decode_controller,
    decode_delta,
    decode_partition,
    encode,
    partition_record,
    recover,
    replay,
)
from tq_async._core._state import ControllerState
from tq_async._core._transitions import ControllerCore, SampleCall
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import GetMeta, MetaReply

X = ColumnHeader("x", "dense", "int64", ())
Y = ColumnHeader("y", "dense", "float32", ())
UNITS = {0: "tcp://u0", 1: "tcp://u1", 2: "tcp://u2"}
PIDS = ("p", "q", "kv")
WALL = 1_000.0  # wall-clock time is the core's clock plus this


class Journal:
    """The SQLite tables' semantics: a snapshot replaces a partition's deltas."""

    def __init__(self) -> None:
        self.tracker = Tracker()
        self.snaps: dict[str, bytes] = {}
        self.deltas: dict[str, list[bytes]] = {}
        self.ctl = b""

    def commit(self, core: ControllerCore, pids: Any, now: float) -> None:
        for pid in pids:
            p = core.state.partitions.get(pid)
            if p is None:
                self.snaps.pop(pid, None)
                self.deltas.pop(pid, None)
                self.tracker.forget(pid)
                continue
            whole, blob = self.tracker.record(p, now, now + WALL)
            if whole:
                self.snaps[pid] = blob
                self.deltas[pid] = []
            else:
                self.deltas[pid].append(blob)
        self.ctl = encode(controller_record(core, {}, now + WALL))

    def record(self, pid: str) -> PartitionRecord:
        snap = decode_partition(self.snaps[pid])
        return replay(snap, [decode_delta(b) for b in self.deltas[pid]])

    def recover(self, now: float) -> ControllerCore:
        again = ControllerCore(ControllerState())
        parts = [self.record(pid) for pid in self.snaps]
        recover(again, decode_controller(self.ctl), parts, now, now + WALL, {})
        for unit in UNITS:
            if unit not in again.state.dead_units:
                again.unit_up(unit)
        return again


def normal(rec: PartitionRecord) -> dict[str, Any]:
    """A record as comparable values (lease times rounded, unordered parts sorted)."""
    return {
        "rows": rec.rows,
        "incarnation": rec.incarnation,
        "leases": sorted(
            (lr.lease_id, lr.task, lr.rows, lr.key, None if lr.left is None else round(lr.left, 6))
            for lr in rec.leases
        ),
        "lease_batch": rec.lease_batch,
        "settled": sorted(rec.settled),
        "puts": sorted(rec.puts),
        "dropped": rec.dropped,
        "lost": sorted(rec.lost),
    }


def get(core: ControllerCore, req: GetMeta, now: float) -> MetaReply | None:
    decision, _ = core.get_meta(req, now)
    while isinstance(decision, SampleCall):
        decision, _ = core.sampled(req, decision, decision.run(), now)
    return decision if isinstance(decision, MetaReply) else None


class World:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.core = ControllerCore(ControllerState(dict(UNITS)))
        self.now = 0.0
        self.leases: list[int] = []
        self.uncommitted: list[tuple[str, list[int], int]] = []
        self.batch = 0
        self.lost_one = False

    def rows(self, pid: str) -> list[int]:
        p = self.core.state.partitions.get(pid)
        return [] if p is None else live_rows(p)

    def step(self) -> None:
        rng, core, now = self.rng, self.core, self.now
        pid = rng.choice(PIDS[:2])
        op = rng.randrange(17)
        try:
            if op <= 3:  # a put of new rows, maybe with tags and versions
                n = rng.randint(1, 6)
                tags = [{"g": rng.randrange(3)} if rng.random() < 0.5 else None for _ in range(n)]
                versions = [rng.randrange(5)] * n if rng.random() < 0.3 else None
                placement, _ = core.put_begin(pid, [X], n, None, None, now)
                if rng.random() < 0.2:
                    self.uncommitted.append((pid, placement.rows, placement.put_id))
                    return
                core.put_commit(pid, placement.rows, ["x"], tags, versions, placement.put_id)
            elif op == 4 and self.uncommitted:  # commit or abort an earlier put
                put = self.uncommitted.pop(rng.randrange(len(self.uncommitted)))
                if rng.random() < 0.5:
                    core.put_commit(put[0], put[1], ["x"], None, None, put[2])
                else:
                    core.abort_puts([put[2]])
            elif op == 5:  # a KV put: new keys and existing ones
                keys = rng.sample([f"k{i}" for i in range(12)], rng.randint(1, 4))
                placement, _ = core.put_begin("kv", [X], 0, None, keys, now, lease=False)
                core.put_commit("kv", placement.rows, ["x"], None, None)
            elif op == 6 and self.rows(pid):  # a second field on existing rows
                rows = rng.sample(self.rows(pid), min(3, len(self.rows(pid))))
                core.put_begin(pid, [Y], 0, rows, None, now)
                core.put_commit(pid, rows, ["y"], [{"y": 1}] * len(rows), None)
            elif op <= 9:  # a fetch: lease, hold, or a recorded batch
                task = rng.choice(["t1", "t2"])
                cfg = {"batch_index": self.batch} if op == 9 else None
                self.batch += op == 9 and rng.random() < 0.7
                lease = rng.choice([None, 3.0, 10.0])
                req = GetMeta(pid, ["x"], rng.randint(1, 4), task, cfg, lease=lease)
                got = get(core, req, now)
                if got is not None and got.lease_id:
                    self.leases.append(got.lease_id)
            elif op == 10 and self.leases:
                core.ack(rng.sample(self.leases, min(2, len(self.leases))), now)
            elif op == 11:
                req = GetMeta(pid, ["x"], 2, "t1", None, lease=5.0)
                got = get(core, req, now)
                if got is not None:
                    core.release(pid, "t1", got.rows, got.incarnation, got.lease_id)
            elif op == 12 and self.rows(pid):
                rows = self.rows(pid)  # one row, or the oldest half (a trainer's step)
                oldest = rng.random() < 0.5
                core.clear_rows(pid, rows[: len(rows) // 2] if oldest else rng.sample(rows, 1))
            elif op == 13 and self.rows(pid):
                rows = rng.sample(self.rows(pid), 1)
                core.catalog.set_tags(pid, rows, [{"h": rng.randrange(9)}])
            elif op == 14:
                rare = rng.random()
                if rare < 0.3:
                    core.reset_consumption(pid, rng.choice([None, "t1"]))
                elif rare < 0.4 and pid in core.state.partitions:
                    core.clear_partition(pid)
                elif rare < 0.5:
                    core.catalog.seal(pid, create=True)
                elif rare < 0.55 and not self.lost_one:
                    self.lost_one = True
                    core.unit_lost(2)
            else:
                self.now += rng.choice([0.5, 2.0, 6.0])
                core.advance(self.now)
        except _errors.TQError:
            pass  # a refused transition changes nothing


@pytest.mark.parametrize("seed", range(24))
def test_replayed_deltas_are_the_live_state(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    if seed % 2:  # snapshots often: compaction in the middle of everything
        monkeypatch.setattr(_journal, "SNAPSHOT_EVERY", rng.randint(1, 6))
        monkeypatch.setattr(_journal, "SNAPSHOT_BYTES", 0)
    dropping = seed % 4 in (1, 2)  # partitions drop their cleared front rows as soon as they can
    if dropping:
        monkeypatch.setattr(_arrays, "COMPACT_ROWS", 1)
    dropped = False
    world = World(rng)
    journal = Journal()
    core = world.core
    deltas = 0
    for _ in range(40):
        for _ in range(rng.randint(1, 12)):
            world.step()
        # a group commit writes the partitions its requests marked; the others wait
        journal.commit(core, [pid for pid in PIDS if rng.random() < 0.7], world.now)
        deltas += sum(map(len, journal.deltas.values()))
        dropped = dropped or any(p.base for p in core.state.partitions.values())
        if rng.random() < 0.3:
            journal.commit(core, PIDS, world.now)
            for pid, p in core.state.partitions.items():
                live = partition_record(p, world.now, world.now + WALL)
                assert normal(journal.record(pid)) == normal(live)
            assert set(journal.snaps) == set(core.state.partitions)
    # as recovery does (a put whose commit was refused, its rows cleared, is open too)
    core.abort_puts([i for p in core.state.partitions.values() for i in p.put_leases])
    journal.commit(core, PIDS, world.now)
    assert deltas  # the deltas were exercised, not only snapshots
    assert dropped == dropping  # and so were partitions whose arrays start past row 0
    again = journal.recover(world.now)
    assert set(again.state.partitions) == set(core.state.partitions)
    for pid, p in core.state.partitions.items():
        q = again.state.partitions[pid]
        assert_recovered_as(q, p)  # the live rows, then the ids its last record reserved
        assert q.incarnation == p.incarnation
        assert q.lost == p.lost
        assert {i: x.rows for i, x in q.leases.items()} == {i: x.rows for i, x in p.leases.items()}
        for i, x in p.leases.items():
            assert q.leases[i].deadline == pytest.approx(x.deadline)
        assert q.settled == p.settled
        assert q.lease_batch == p.lease_batch
        assert q.keys == p.keys
        assert q.consumed_count == p.consumed_count
        assert q.n_alive == p.n_alive


def test_a_delta_holds_only_what_changed() -> None:
    core = ControllerCore(ControllerState(dict(UNITS)))
    placement, _ = core.put_begin("p", [X], 10_000, None, None, 0.0)
    core.put_commit("p", placement.rows, ["x"], None, None, placement.put_id)
    journal = Journal()
    journal.commit(core, ["p"], 0.0)
    snapshot = len(journal.snaps["p"])
    got = get(core, GetMeta("p", ["x"], 4, "t", None, lease=30.0), 0.0)
    assert got is not None
    journal.commit(core, ["p"], 1.0)
    (delta,) = journal.deltas["p"]
    assert len(delta) < 400 < snapshot  # four rows and a lease, not ten thousand rows
    assert decode_delta(delta).leases[0].rows == got.rows
    core.reset_consumption("p", None)  # a reset rewrites the partition whole
    journal.commit(core, ["p"], 2.0)
    assert journal.deltas["p"] == []
    assert normal(journal.record("p")) == normal(
        partition_record(core.state.partitions["p"], 2.0, 2.0 + WALL)
    )


def test_deltas_that_outgrow_their_snapshot_become_a_snapshot() -> None:
    core = ControllerCore(ControllerState(dict(UNITS)))
    placement, _ = core.put_begin("p", [X], 1000, None, None, 0.0)
    core.put_commit("p", placement.rows, ["x"], None, None, placement.put_id)
    journal = Journal()
    journal.commit(core, ["p"], 0.0)
    first = journal.snaps["p"]
    most = 0
    for i in range(_journal.SNAPSHOT_EVERY + 50):
        get(core, GetMeta("p", ["x"], 1, f"t{i % 3}", None), 0.0)
        journal.commit(core, ["p"], 0.0)
        most = max(most, len(journal.deltas["p"]))
    assert journal.snaps["p"] != first  # compacted into a new snapshot
    assert most <= _journal.SNAPSHOT_EVERY + 1000 // _journal.SNAPSHOT_ROWS_PER_DELTA
    assert normal(journal.record("p")) == normal(
        partition_record(core.state.partitions["p"], 0.0, WALL)
    )


def test_a_wall_clock_stepped_back_between_records_does_not_lengthen_a_lease() -> None:
    """A lease's seconds left are aged, at replay, by the wall-clock time between its record
    and the partition's last one. An NTP step back (here one hour) between them made that
    negative: the lease came back after a restart with an hour more than it was given."""
    core = ControllerCore(ControllerState(dict(UNITS)))
    placement, _ = core.put_begin("p", [X], 4, None, None, 0.0)
    core.put_commit("p", placement.rows, ["x"], None, None, placement.put_id)
    tracker = Tracker()
    whole, snap = tracker.record(core.state.partitions["p"], 0.0, 10_000.0)
    assert whole
    leased = get(core, GetMeta("p", ["x"], 2, "t", None, lease=10.0), 0.0)
    assert leased is not None
    _, with_lease = tracker.record(core.state.partitions["p"], 1.0, 10_001.0)
    get(core, GetMeta("p", ["x"], 1, "u", None), 2.0)  # another change, after the step back
    _, later = tracker.record(core.state.partitions["p"], 2.0, 10_002.0 - 3600.0)
    rec = replay(decode_partition(snap), [decode_delta(with_lease), decode_delta(later)])
    (lease,) = rec.leases
    assert lease.left is not None
    assert lease.left <= 9.0  # 9 s left when recorded; never more
    again = ControllerCore(ControllerState())
    recover(again, controller_record(core, {}, rec.wall), [rec], 50.0, rec.wall, {})
    (back,) = again.state.partitions["p"].leases.values()
    assert back.deadline is not None
    assert back.deadline <= 59.0
