"""The controller's state machine as a plain class: no sockets, no event loop."""

from __future__ import annotations

import pytest

from tq_async import InvalidRequestError, PartitionNotFound, RowsNotFound, SchemaError
from tq_async._core._ready import ReadyView
from tq_async._core._state import ControllerState, Wakeup
from tq_async._core._views import RowOrigin, RowTags
from tq_async._wire._columns import ColumnHeader

IDS = ColumnHeader("ids", "dense", "int64", (4,))
REW = ColumnHeader("rew", "dense", "float32", ())


def new_rows(st: ControllerState, n: int, headers: list[ColumnHeader], pid: str = "p") -> list[int]:
    rows, _, _ = st.put_begin(pid, headers, n, None)
    return rows


def test_put_begin_creates_partition_and_wakes_its_waiters() -> None:
    st = ControllerState({0: "a", 1: "b"})
    rows, units, wakeups = st.put_begin("p", [IDS], 3, None)
    assert rows == [0, 1, 2]
    assert units == [0, 0, 0]  # one put, one unit
    assert wakeups == [Wakeup("p")]
    rows2, units2, wakeups2 = st.put_begin("p", [IDS], 2, None)
    assert rows2 == [3, 4]
    assert units2 == [1, 1]  # round-robin across puts
    assert wakeups2 == []


def test_rows_become_ready_only_at_commit() -> None:
    st = ControllerState({0: "a"})
    rows = new_rows(st, 3, [IDS])
    p = st.partition("p")
    rs = p.ready_set("t", ["ids"])
    assert list(rs.rows) == []
    assert p.commit(rows, ["ids"], None) == ["t"]
    assert list(rs.rows) == [0, 1, 2]


def test_ready_requires_every_field() -> None:
    st = ControllerState({0: "a"})
    rows = new_rows(st, 2, [IDS, REW])
    p = st.partition("p")
    p.commit(rows, ["ids"], None)
    assert list(p.ready_set("t", ["ids"]).rows) == [0, 1]
    both = p.ready_set("t", ["rew", "ids"])
    assert list(both.rows) == []
    p.commit([1], ["rew"], None)
    assert list(both.rows) == [1]


def test_consume_is_per_task_and_never_twice() -> None:
    st = ControllerState({0: "a"})
    rows = new_rows(st, 4, [IDS])
    p = st.partition("p")
    p.commit(rows, ["ids"], None)
    a, b = p.ready_set("a", ["ids"]), p.ready_set("b", ["ids"])
    p.consume("a", [0, 1])
    assert list(a.rows) == [2, 3]
    assert list(b.rows) == [0, 1, 2, 3]
    with pytest.raises(InvalidRequestError, match="already consumed"):
        p.consume("a", [1])
    assert p.release("a", [1])
    assert list(a.rows) == [2, 3, 1]


def test_final_needs_seal_and_nothing_pending() -> None:
    st = ControllerState({0: "a"})
    rows = new_rows(st, 2, [IDS])
    p = st.partition("p")
    rs = p.ready_set("t", ["ids"])
    p.sealed = True
    assert not p.is_final("t", rs)  # rows allocated but not produced yet
    p.commit(rows, ["ids"], None)
    # final: no *more* rows can become ready; the ready ones are the sampler's last batch
    assert p.is_final("t", rs)
    p.sealed = False
    assert not p.is_final("t", rs)


def test_schema_changes_are_rejected_and_change_nothing() -> None:
    st = ControllerState({0: "a"})
    new_rows(st, 2, [IDS])
    with pytest.raises(SchemaError, match=r"'ids' is dense int64\[4\].*int32\[4\]"):
        st.put_begin("p", [ColumnHeader("ids", "dense", "int32", (4,))], 2, None)
    with pytest.raises(SchemaError, match="twice"):
        st.put_begin("p", [REW, REW], 1, None)
    assert st.partition("p").n_rows == 2
    assert "rew" not in st.partition("p").fields


def test_sealed_partition_refuses_new_rows_but_accepts_fields() -> None:
    st = ControllerState({0: "a"})
    rows = new_rows(st, 2, [IDS])
    st.partition("p").sealed = True
    with pytest.raises(InvalidRequestError, match="sealed"):
        st.put_begin("p", [IDS], 1, None)
    got, units, _ = st.put_begin("p", [REW], 0, rows)
    assert got == rows
    assert units == [0, 0]


def test_unknown_partition_rows_and_units() -> None:
    st = ControllerState({})
    with pytest.raises(PartitionNotFound, match="'nope'"):
        st.partition("nope")
    with pytest.raises(InvalidRequestError, match="no storage units"):
        st.put_begin("p", [IDS], 1, None)
    st.units[0] = "a"
    new_rows(st, 1, [IDS])
    with pytest.raises(RowsNotFound, match="row 5"):
        st.put_begin("p", [REW], 0, [5])
    with pytest.raises(InvalidRequestError, match="at least one row"):
        st.put_begin("p", [IDS], 0, None)


def test_clear_rows_updates_counts_and_ready_sets() -> None:
    st = ControllerState({0: "a", 1: "b"})
    r1 = new_rows(st, 2, [IDS])
    r2 = new_rows(st, 2, [IDS])
    p = st.partition("p")
    p.commit(r1 + r2, ["ids"], None)
    rs = p.ready_set("t", ["ids"])
    p.consume("t", [0])
    assert p.clear_rows([0, 2]) == {0: [0], 1: [2]}
    assert p.n_alive == 2
    assert p.consumed_count["t"] == 0
    assert list(rs.rows) == [1, 3]
    with pytest.raises(RowsNotFound):
        p.check_rows([0])


def test_tags_merge_and_views() -> None:
    st = ControllerState({0: "a"})
    rows = new_rows(st, 3, [IDS])
    p = st.partition("p")
    p.commit(rows, ["ids"], [{"uid": 1}, None, {"uid": 2}])
    p.set_tags([0], [{"total_lengths": 9}])
    tags = RowTags(p)
    assert dict(tags[0]) == {"uid": 1, "total_lengths": 9}
    assert dict(tags[1]) == {}
    with pytest.raises(TypeError):
        tags[0]["uid"] = 5  # type: ignore[index]
    origin = RowOrigin(p)
    assert origin[2] == (0, 2)
    assert len(tags) == len(origin) == 3


def test_ready_view_prefix_slices_are_lazy() -> None:
    rows = dict.fromkeys(range(100_000))
    view = ReadyView(rows)
    assert view[:3] == [0, 1, 2]
    assert view._list is None  # a prefix slice did not materialise the list
    assert view[-1] == 99_999
    assert len(view) == 100_000
    assert 5 in view


def test_reset_consumption_forgets_deliveries() -> None:
    st = ControllerState({0: "a"})
    rows = new_rows(st, 2, [IDS])
    p = st.partition("p")
    p.commit(rows, ["ids"], None)
    p.ready_set("t", ["ids"])
    p.consume("t", rows)
    p.recorded[("t", 0, 0)] = tuple(rows)
    p.reset_consumption("t")
    assert p.recorded == {}
    assert list(p.ready_set("t", ["ids"]).rows) == rows


def test_waiting_on_a_field_not_announced_yet() -> None:
    st = ControllerState({0: "a"})
    rows = new_rows(st, 2, [IDS])
    p = st.partition("p")
    rs = p.ready_set("t", ["ids", "rew"])  # a consumer asks before any put mentions "rew"
    assert p.commit(rows, ["ids"], None) == []
    st.put_begin("p", [REW], 0, rows)
    assert p.commit(rows, ["rew"], None) == ["t"]
    assert list(rs.rows) == rows


def test_ready_set_compacts_after_many_deletions() -> None:
    st = ControllerState({0: "a"})
    rows = new_rows(st, 5000, [IDS])
    p = st.partition("p")
    p.commit(rows, ["ids"], None)
    rs = p.ready_set("t", ["ids"])
    p.consume("t", rows[:4000])
    assert rs.deleted < 2000  # rebuilt along the way: prefix scans skip no dead slots
    assert list(rs.rows)[:3] == [4000, 4001, 4002]
    assert ReadyView(rs.rows)[:2] == [4000, 4001]


def test_ready_rows_behaves_like_an_ordered_dict() -> None:
    """Random adds/removes against the insertion-ordered dict the array-backed set replaces."""
    import random

    from tq_async._core._ready import ReadyRows

    rng = random.Random(7)
    model: dict[int, None] = dict.fromkeys([3, 1, 2])
    rows = ReadyRows([3, 1, 2])
    for step in range(20_000):
        r = rng.randrange(3000)
        if rng.random() < 0.55:
            model[r] = None
            rows[r] = None
        else:
            assert rows.pop(r, 0) == model.pop(r, 0)
        assert len(rows) == len(model)
        if step % 997 == 0:
            assert list(rows) == list(model)
            assert rows.to_list() == list(model)
            assert ReadyView(rows)[:5] == list(model)[:5]
            assert all((r in rows) == (r in model) for r in range(-1, 3100, 7))
    assert list(rows) == list(model)
    assert rows.dead <= len(rows) + 1024
