"""What a partition holds grows with its live rows, not with every row it ever had.

Row ids are never reused; a long run puts and clears hundreds of millions of rows through
one partition. The per-row arrays drop the cleared rows at their front
(`tq_async._core._arrays.compact`), so these tests count the entries the structures hold
after many put/clear cycles (never wall time), and check that everything that reads a row
by its id still finds it after the arrays moved."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest

from tq_async._controller._queries import _kv_answer
from tq_async._core import _arrays, _leases
from tq_async._core._dumps import partition_dump, restore_partition
from tq_async._core._journal import (
    controller_record,
    decode_controller,
    decode_partition,
    encode,
    partition_record,
    recover,
)
from tq_async._core._ready import ReadyRows
from tq_async._core._state import KV_CHUNK_BITS, ControllerState, Partition
from tq_async._core._transitions import ControllerCore, SampleCall
from tq_async._errors import RowsNotFound
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import GetMeta, MetaReply

X = ColumnHeader("x", "dense", "int64", ())


def new_core() -> ControllerCore:
    return ControllerCore(ControllerState({0: "inproc://u0", 1: "inproc://u1"}))


def put(
    core: ControllerCore,
    n: int,
    tags: Sequence[dict[str, Any]] | None = None,
    versions: Sequence[int] | None = None,
) -> list[int]:
    placement, _ = core.put_begin("p", [X], n, None, None, 0.0)
    core.put_commit("p", placement.rows, ["x"], tags, versions, placement.put_id)
    return placement.rows


def get(core: ControllerCore, task: str, n: int, **cfg: Any) -> MetaReply:
    return get_request(core, GetMeta("p", ["x"], n, task, cfg or None))


def get_request(core: ControllerCore, request: GetMeta) -> MetaReply:
    decision, _ = core.get_meta(request, 0.0)
    while isinstance(decision, SampleCall):
        decision, _ = core.sampled(request, decision, decision.run(), 0.0)
    assert isinstance(decision, MetaReply)
    return decision


def per_row_arrays(p: Partition) -> Iterator[Sequence[Any]]:
    """Every structure of ``p`` with an entry per row."""
    yield from (p.alive, p.origin, p.units, p.tags, p.row_keys, p.versions.rows)
    yield from p.versions.fields.values()
    yield from (f.produced for f in p.fields.values())
    yield from p.consumed.values()
    yield from p.recorded_rows.values()
    yield from (rs.rows._pos for rs in p.ready.values())


def test_a_partition_holds_its_live_rows_not_every_row_it_ever_had(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_arrays, "COMPACT_ROWS", 1024)  # (the default's 64 Ki rows: slower)
    core = new_core()
    steps, batch = 100, 500  # 50,000 rows over its life, at most 500 alive at a time
    for step in range(steps):
        rows = put(core, batch, versions=[step] * batch)
        assert get(core, "a", batch).rows == rows
        assert get(core, "b", batch, batch_index=step).rows == rows  # a recorded batch
        core.clear_rows("p", rows)
    p = core.state.partition("p")
    assert p.n_rows == steps * batch
    assert p.n_alive == 0
    most = 2 * _arrays.COMPACT_ROWS + 64  # what may wait for the next drop
    assert max(len(a) for a in per_row_arrays(p)) <= most
    assert p.base >= steps * batch - most


def test_rows_keep_their_ids_and_state_after_the_arrays_dropped_cleared_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_arrays, "COMPACT_ROWS", 4)
    core = new_core()
    old = put(core, 8, tags=[{"g": i} for i in range(8)], versions=list(range(8)))
    recorded = get(core, "b", 8, batch_index=0)
    keep = put(core, 4, tags=[{"g": 10 + i} for i in range(4)], versions=[7] * 4)
    core.clear_rows("p", old)
    p = core.state.partition("p")
    assert p.base == 8
    assert len(p.alive) == 4
    # the live rows: same ids, tags, versions, units; readable and consumable
    reply = get(core, "a", 4)
    assert reply.rows == keep
    assert reply.tags == [{"g": 10 + i} for i in range(4)]
    assert reply.versions == {"x": [7] * 4}
    assert len(reply.units) == 4
    # a cleared row below the arrays is not found (not another row's state)
    with pytest.raises(RowsNotFound, match="row 0 does not exist"):
        core.clear_rows("p", [0])
    assert p.release("a", old) == []
    # a replay of a recorded batch whose rows were all cleared: nothing of them is left
    assert get(core, "b", 8, batch_index=0).rows == []
    assert recorded.rows == old
    # a checkpoint's dump restores the same partition
    again = restore_partition(partition_dump(p), list(p.units))
    assert partition_dump(again) == partition_dump(p)
    assert again.keys == p.keys
    assert again.n_alive == p.n_alive
    # and new rows continue the ids
    assert put(core, 2) == [12, 13]
    assert get(core, "a", 2).rows == [12, 13]


def test_keys_and_tags_follow_their_rows_after_a_drop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_arrays, "COMPACT_ROWS", 2)
    core = new_core()
    first, _ = core.put_begin("p", [X], 0, None, ["a", "b", "c"], 0.0)
    core.put_commit("p", first.rows, ["x"], [{"t": 1}, {"t": 2}, {"t": 3}], None, first.put_id)
    second, _ = core.put_begin("p", [X], 0, None, ["d"], 0.0)
    core.put_commit("p", second.rows, ["x"], [{"t": 4}], None, second.put_id)
    core.clear_rows("p", first.rows)
    p = core.state.partition("p")
    assert p.base == 3
    assert p.keys == {"d": 3}
    assert p.rows_for_keys(["d"]) == [3]
    core.catalog.set_tags("p", [3], [{"u": 5}])
    assert p.tags[3 - p.base] == {"t": 4, "u": 5}
    assert p.groups.rows("t", 4) == {3}


def test_a_ready_set_takes_row_ids_past_2_31() -> None:
    """A partition that outlives 2**31 rows (2.5 days at 10k rows/s) still samples."""
    big = 2**31 + 5
    rows = ReadyRows.from_mask(np.ones(3, dtype=np.bool_), big)
    assert list(rows) == [big, big + 1, big + 2]
    rows[big + 3] = None
    rows.pop(big)
    assert rows.to_list() == [big + 1, big + 2, big + 3]
    assert rows.missing([big, big + 1]) == [big]


def test_a_ready_set_drops_the_slots_of_rows_below_its_base() -> None:
    rows = ReadyRows(range(10))
    for r in range(6):
        rows.pop(r)
    rows.rebase(6)
    assert list(rows) == [6, 7, 8, 9]
    assert 5 not in rows
    assert 7 in rows
    rows[12] = None
    rows.pop(7)
    assert rows.missing([6, 7, 12, 3]) == [7, 3]
    assert rows.to_list() == [6, 8, 9, 12]


class _NoScan(dict[str, Partition]):
    """Partitions that refuse a pass over all of them."""

    def values(self) -> Any:
        raise AssertionError("a pass over every partition")

    def items(self) -> Any:
        raise AssertionError("a pass over every partition")

    def __iter__(self) -> Any:
        raise AssertionError("a pass over every partition")


def _loads_of_every_partition(st: ControllerState) -> dict[int, int]:
    loads: dict[int, int] = {}
    for p in [*st.partitions.values(), *st.restoring.values()]:
        for unit, n in p.unit_rows.items():
            loads[unit] = loads.get(unit, 0) + n
    return {u: n for u, n in loads.items() if n}


def test_a_put_places_its_rows_without_a_pass_over_every_partition() -> None:
    st = ControllerState({u: f"inproc://u{u}" for u in range(4)})
    st.unit_hosts = {0: "a", 1: "a", 2: "b", 3: "b"}  # placement by host: by the units' loads
    for i in range(20):
        st.put_begin(f"p{i}", [X], 2, None, host="a")
    scanned = st.partitions = _NoScan(st.partitions)
    st.put_begin("p0", [X], 3, None, host="a")
    st.put_begin("new", [X], 1, None, host="b")
    st.partitions = dict(dict.items(scanned))
    # the loads it reads are every partition's: after clears, a drop and an aborted restore
    st.partitions["p1"].clear_rows([0])
    st.drop_partition("p2")
    staged = st.bind(restore_partition(partition_dump(st.partitions["p3"]), [3, 3]))
    st.restoring["r"] = staged
    assert {u: n for u, n in st.unit_loads().items() if n} == _loads_of_every_partition(st)
    core = ControllerCore(st)
    core.catalog.restore_abort(["r"])
    assert {u: n for u, n in st.unit_loads().items() if n} == _loads_of_every_partition(st)


def _journal_round_trip(core: ControllerCore) -> ControllerCore:
    """``core`` recorded, encoded, decoded and recovered into a new core."""
    parts = [
        decode_partition(encode(partition_record(p, 0.0, 1000.0)))
        for p in core.state.partitions.values()
    ]
    ctl = decode_controller(encode(controller_record(core, {0: "i0", 1: "i1"}, 1000.0)))
    again = ControllerCore(ControllerState())
    recover(again, ctl, parts, 0.0, 1000.0, {})
    for unit in (0, 1):
        again.unit_up(unit)
    return again


def test_recorded_batches_whose_rows_are_gone_do_not_grow_with_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job reads a recorded batch per step from one partition for days: the batches whose
    rows were all cleared long since are forgotten (with their settled keys and lease ids),
    and a late replay of one is still the replay of a batch whose rows are gone, never a
    fresh sample."""
    monkeypatch.setattr(_arrays, "COMPACT_ROWS", 1024)
    monkeypatch.setattr(_leases, "BATCH_HOME_MIN", 16)
    core = new_core()
    core.catalog.register_tasks("p", ["b"])
    steps, batch = 200, 100  # 20,000 rows and 400 recorded batches over its life
    for step in range(steps):
        rows = put(core, batch)
        for rank in (0, 1):
            request = GetMeta("p", ["x"], 50, "b", {"batch_index": step, "dp_rank": rank}, lease=60)
            reply = get_request(core, request)
            assert reply.rows == rows[50 * rank : 50 * rank + 50]
            core.ack([reply.lease_id], 0.0)  # auto-clear frees them
    p = core.state.partition("p")
    assert p.n_alive == 0
    most = 2 * 2 * (2 * _arrays.COMPACT_ROWS // batch + 1)  # what may wait for the next drop
    assert len(p.recorded) <= most
    assert len(p.settled) <= most
    assert len(p.lease_batch) <= most
    assert len(core.leases.batch_home) <= 2 * most
    for again in (core, _journal_round_trip(core)):
        q = again.state.partition("p")
        fresh = put(again, 10)
        # a late replay of a forgotten batch: its rows are gone; the new rows stay ready
        old = get_request(again, GetMeta("p", ["x"], 10, "b", {"batch_index": 3}, lease=60))
        assert old.rows == []
        assert old.lease_id == 0
        nxt = get_request(again, GetMeta("p", ["x"], 10, "b", {"batch_index": steps}))
        assert nxt.rows == fresh
        assert len(q.recorded) <= most + 1
    # a checkpoint keeps what was forgotten
    restored = restore_partition(partition_dump(p), list(p.units))
    assert partition_dump(restored) == partition_dump(p)
    # a reset of the task's consumption decides every index anew
    core.reset_consumption("p", "b")
    assert p.forgotten == {}
    assert get_request(core, GetMeta("p", ["x"], 10, "b", {"batch_index": 3})).rows != []


def test_the_kv_chunks_to_list_again_follow_the_live_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A partition of keyed rows nobody lists (``kv_list``) for a long run: the chunks marked
    for the listing to encode again are those of its live rows, not one per chunk it ever
    had; a listing after the arrays dropped cleared rows lists the live keys only."""
    monkeypatch.setattr(_arrays, "COMPACT_ROWS", 64)
    core = new_core()
    chunk = 1 << KV_CHUNK_BITS
    steps = 40  # 40 chunks of keyed rows over its life, one alive at a time
    before: list[int] = []
    for step in range(steps):
        keys = [f"k{step}-{i}" for i in range(chunk)]
        placement, _ = core.put_begin("p", [X], 0, None, keys, 0.0)
        core.put_commit("p", placement.rows, ["x"], None, None, placement.put_id)
        if step == steps // 2:  # listed once midway: its cache follows from there
            _kv_answer(core.state.partition("p"), True)
        if before:
            core.clear_rows("p", before)
        before = placement.rows
    p = core.state.partition("p")
    assert p.base >= chunk * (steps - 3)
    assert len(p.kv_dirty) <= 3
    listed = msgspec.msgpack.decode(_kv_answer(p, True))
    assert listed[0] == len(p.keys) == chunk
    assert _kv_answer(p, False) is not None


def test_tasks_that_hold_nothing_in_a_partition_leave_no_per_row_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long run reads one partition under a new task name now and then (an evaluation per
    step): a task whose rows are all cleared, with nothing ready, leased or recorded, keeps
    no per-row array nor ready set (each put extended and each commit walked every one of
    them, for every task name the partition ever saw); it reads on as a task that never
    read."""
    monkeypatch.setattr(_arrays, "COMPACT_ROWS", 64)
    core = new_core()
    for step in range(300):
        rows = put(core, 10)
        assert get(core, f"eval{step}", 10).rows == rows
        assert get(core, "train", 5).rows == rows[:5]
        core.clear_rows("p", rows)
    p = core.state.partition("p")
    assert len(p.consumed) <= 2 * 64 // 10 + 2
    assert len(p.ready) <= 2 * 64 // 10 + 2
    assert len(p.consumed_count) == len(p.consumed)
    rows = put(core, 4)
    assert get(core, "eval0", 4).rows == rows  # a task dropped reads again
    assert get(core, "train", 4).rows == rows
