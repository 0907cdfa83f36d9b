"""The controller's transitions (ControllerCore) tested alone: no loop, no socket, no clock.

Each defect of the exactly-once issue has a test here; time is a number the test chooses.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
import structlog

from tq_async import (
    GRPOGroupNSampler,
    InvalidRequestError,
    RankAwareSampler,
    RowsNotFound,
    SeqlenBalancedSampler,
    SequentialSampler,
    StalenessSampler,
)
from tq_async._core._dumps import partition_dump
from tq_async._core._effects import AdmissionConfig
from tq_async._core._liveness import orphan_cells
from tq_async._core._state import ControllerState, Wakeup
from tq_async._core._transitions import (
    ControllerCore,
    Deadlines,
    Effects,
    SampleCall,
    follower,
    split_even,
)
from tq_async._wire._checks import validate
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import GetMeta, HeldRows, MetaReply, PartitionDump, StoreClear
from tq_async.samplers import BaseSampler

X = ColumnHeader("x", "dense", "int64", ())


def new_core(sampler: BaseSampler | None = None, n_units: int = 2, **kw: Any) -> ControllerCore:
    state = ControllerState({u: f"inproc://u{u}" for u in range(n_units)})
    return ControllerCore(state, sampler, **kw)


def put(
    core: ControllerCore,
    n: int,
    pid: str = "p",
    tags: Sequence[dict[str, Any]] | None = None,
    now: float = 0.0,
) -> list[int]:
    placement, _ = core.put_begin(pid, [X], n, None, None, now)
    core.put_commit(pid, placement.rows, ["x"], tags, None, placement.put_id)
    return placement.rows


def req(
    batch_size: int,
    task: str = "t",
    pid: str = "p",
    lease: float | None = None,
    ack: list[int] | None = None,
    **cfg: Any,
) -> GetMeta:
    return GetMeta(pid, ["x"], batch_size, task, cfg or None, lease=lease, ack=ack)


def get(core: ControllerCore, request: GetMeta, now: float = 0.0) -> MetaReply | None:
    """What the shell does: run the sampler until there is a reply or nothing (wait)."""
    decision, _ = core.get_meta(request, now)
    while isinstance(decision, SampleCall):
        decision, _ = core.sampled(request, decision, decision.run(), now)
    return decision


def rows_of(reply: MetaReply | None) -> list[int]:
    assert reply is not None
    assert not reply.end_of_stream
    return list(reply.rows)


def is_end(reply: MetaReply | None) -> bool:
    return reply is not None and reply.end_of_stream


# ---- 1. end of stream while a lease is open ------------------------------------------------


def test_no_end_of_stream_while_a_lease_is_open() -> None:
    core = new_core()
    put(core, 16)
    core.state.seal("p")
    dead = get(core, req(8, lease=1.0), now=0.0)  # consumer A leases 8 rows, then dies
    alive = get(core, req(8, lease=1.0), now=0.0)  # consumer B takes the other 8
    assert alive is not None
    core.ack([alive.lease_id], 0.5)
    assert get(core, req(8, lease=1.0), now=0.5) is None  # waits: A's lease is open
    fx = core.advance(1.0)  # A's lease expires
    assert Wakeup("p", "t") in fx.wakeups
    again = get(core, req(8, lease=1.0), now=1.0)
    assert sorted(rows_of(again)) == sorted(rows_of(dead))  # B gets A's rows
    assert again is not None
    core.ack([again.lease_id], 1.1)
    assert is_end(get(core, req(8), now=1.1))


def test_an_ack_lets_end_of_stream_through_and_wakes_the_task() -> None:
    core = new_core()
    put(core, 4)
    core.state.seal("p")
    got = get(core, req(4, lease=10.0))
    assert get(core, req(4)) is None
    assert got is not None
    fx = core.ack([got.lease_id], 1.0)
    assert Wakeup("p", "t") in fx.wakeups
    assert is_end(get(core, req(4), now=1.0))


def test_stop_when_consumed_waits_for_an_open_lease_too() -> None:
    """A consumer that dies holding a lease on the last rows keeps a stop_when_consumed
    stream from ending, as it keeps a sealed one (before: the others ended at once, and
    the rows its expiry gave back were processed by nobody)."""
    core = new_core()
    put(core, 4)
    dead = get(core, req(4, lease=1.0))
    assert rows_of(dead) == [0, 1, 2, 3]
    waiting = msgspec.structs.replace(req(4, lease=1.0), stop_when_consumed=True)
    assert get(core, waiting, now=0.5) is None  # the dead consumer's rows may come back
    fx = core.advance(1.0)
    assert Wakeup("p", "t") in fx.wakeups
    again = get(core, waiting, now=1.0)
    assert rows_of(again) == [0, 1, 2, 3]
    assert again is not None
    acked = msgspec.structs.replace(waiting, ack=[again.lease_id])
    assert is_end(get(core, acked, now=1.5))


class BatchOnly(BaseSampler):
    """A TransferQueue-style sampler (no ``short_ready_ok``): asked only once a whole batch
    is ready, or the partition is final."""

    def sample(self, ready_indexes: Sequence[int], batch_size: int, **_: Any) -> Any:
        rows = list(ready_indexes)[:batch_size]
        return rows, rows


def test_stop_when_consumed_ends_the_stream_of_a_sampler_not_asked_yet() -> None:
    """A task that consumed every row asks with stop_when_consumed: its stream ends, also
    with a sampler that is asked only once a whole batch is ready (before: that sampler was
    never asked, so the end never came and the request waited for ever); DP ranks too."""
    core = new_core(BatchOnly())
    put(core, 4)
    assert rows_of(get(core, req(4))) == [0, 1, 2, 3]
    assert is_end(get(core, msgspec.structs.replace(req(4), stop_when_consumed=True)))
    assert get(core, req(4)) is None  # without it: waits for more rows, as before
    put(core, 4, pid="q")
    ranks = [req(2, pid="q", batch_index=0, dp_rank=r, dp_size=2) for r in (0, 1)]
    assert [rows_of(get(core, r)) for r in ranks] == [[0, 1], [2, 3]]
    ranks = [
        msgspec.structs.replace(
            req(2, pid="q", batch_index=1, dp_rank=r, dp_size=2), stop_when_consumed=True
        )
        for r in (0, 1)
    ]
    assert is_end(get(core, ranks[0]))
    put(core, 4, pid="q")  # rows come before rank 1 asks: it ends at the same step
    assert is_end(get(core, ranks[1]))


def test_holds_do_not_block_end_of_stream() -> None:
    core = new_core()
    core.state.auto_clear["p"] = ("t",)
    put(core, 4)
    core.state.seal("p")
    got = get(core, req(4))
    assert got is not None
    assert got.lease_id
    assert is_end(get(core, req(4)))
    assert core.next_deadline() is None  # a hold never expires


# ---- 2. replay during an open lease --------------------------------------------------------


def test_a_replay_shares_the_batch_lease_and_an_ack_settles_it() -> None:
    core = new_core()
    put(core, 8)
    first = get(core, req(4, lease=1.0, dp_rank=0, batch_index=0), now=0.0)
    # the consumer restarts and re-reads its batch before the lease expires
    replay = get(core, req(4, lease=1.0, dp_rank=0, batch_index=0), now=0.5)
    assert first is not None
    assert replay is not None
    assert replay.rows == first.rows
    assert replay.lease_id == first.lease_id
    core.ack([replay.lease_id], 0.6)  # the replay's ack settles the batch
    fx = core.advance(10.0)
    assert fx.wakeups == []
    assert core.next_deadline() is None
    rest = get(core, req(4))  # nothing acknowledged comes back into the pool
    assert rows_of(rest) == [r for r in range(8) if r not in first.rows]
    settled = get(core, req(4, lease=1.0, dp_rank=0, batch_index=0), now=11.0)
    assert settled is not None
    assert settled.rows == first.rows
    assert settled.lease_id == 0


def test_a_replay_takes_the_lease_over() -> None:
    core = new_core()
    put(core, 4)
    first = get(core, req(4, lease=1.0, dp_rank=0, batch_index=0), now=0.0)
    get(core, req(4, lease=5.0, dp_rank=0, batch_index=0), now=0.9)
    core.advance(1.0)  # the first deadline passes: the lease lives on (taken over)
    assert first is not None
    assert core.state.partition("p").leases[first.lease_id].deadline == 5.9


def test_an_expired_recorded_batch_goes_to_its_next_reader_only() -> None:
    core = new_core()
    put(core, 8)
    core.state.seal("p")
    first = get(core, req(4, lease=1.0, dp_rank=0, batch_index=0), now=0.0)
    core.advance(2.0)  # expired: the rows stay with the batch, never back into the pool
    other = get(core, req(8, lease=1.0, dp_rank=1, batch_index=0), now=2.0)
    assert first is not None
    assert other is not None
    assert set(other.rows).isdisjoint(first.rows)
    # a TP peer (or the restarted consumer) of rank 0 still gets the same rows, newly leased
    peer = get(core, req(4, lease=1.0, dp_rank=0, batch_index=0), now=2.0)
    assert peer is not None
    assert peer.rows == first.rows
    assert peer.lease_id
    assert peer.lease_id != first.lease_id


# ---- 3. SeqlenBalancedSampler with leases ---------------------------------------------------


def test_seqlen_global_batch_is_recorded_for_every_rank() -> None:
    core = new_core(SeqlenBalancedSampler(dp_size=2))
    put(core, 32, tags=[{"total_lengths": 10 + r} for r in range(32)])
    core.state.seal("p")
    seen: list[int] = []
    for b in range(4):
        shares = [get(core, req(4, lease=1.0, dp_rank=r, batch_index=b), now=0.0) for r in (0, 1)]
        seen += [row for s in shares for row in rows_of(s)]
    core.advance(5.0)  # every lease expires un-acked
    again = [
        rows_of(get(core, req(4, lease=1.0, dp_rank=r, batch_index=b), now=5.0))
        for b in range(4)
        for r in (0, 1)
    ]
    assert sorted(row for share in again for row in share) == list(range(32))
    assert sorted(seen) == list(range(32))  # nothing lost, nothing twice


# ---- 4. a producer killed between allocating rows and committing them -----------------------


def test_a_lapsed_put_lease_reclaims_rows_and_frees_capacity() -> None:
    core = new_core(deadlines=Deadlines(put_lease=5.0))
    core.state.capacity = 16
    put(core, 8)
    placement, _ = core.put_begin("p", [X], 8, None, None, 0.0)  # the producer dies here
    core.state.seal("p")
    assert rows_of(get(core, req(8))) == list(range(8))
    assert get(core, req(8)) is None  # waits: a live put lease may still commit
    assert not core.state.has_room("p", 1)
    fx = core.advance(5.0)
    assert fx.room
    incarnation = core.state.partition("p").incarnation
    assert fx.free == [("p", incarnation, {placement.units[0]: placement.rows})]
    assert Wakeup("p") in fx.wakeups
    assert is_end(get(core, req(8), now=5.0))
    assert core.state.has_room("p", 8)
    with pytest.raises(RowsNotFound, match="put lease"):
        core.put_commit("p", placement.rows, ["x"], None, None, placement.put_id)


def test_an_aborted_put_is_not_logged_as_a_lapsed_put_lease() -> None:
    """A put its client gave up (cancelled, timed out: `AbortPut`) is reclaimed at once.
    That logged the warning of a dead producer ("put lease lapsed"), once per cancelled put
    of a trainer's timeout loop; only a lease that really lapses warns now."""
    core = new_core(deadlines=Deadlines(put_lease=5.0))
    aborted, _ = core.put_begin("p", [X], 4, None, None, 0.0)
    core.put_begin("p", [X], 4, None, None, 0.0)  # its producer dies
    with structlog.testing.capture_logs() as logs:
        fx = core.abort_puts([aborted.put_id])
        assert fx.free  # reclaimed at once
        assert not [e for e in logs if e["log_level"] == "warning"]
        core.advance(5.0)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "put lease lapsed: reclaiming the rows of an uncommitted put"
    ]


def test_a_renewed_put_lease_keeps_a_slow_producers_rows() -> None:
    core = new_core(deadlines=Deadlines(put_lease=5.0))
    placement, _ = core.put_begin("p", [X], 4, None, None, 0.0)
    core.renew_puts([placement.put_id], 4.0)
    core.advance(6.0)
    core.put_commit("p", placement.rows, ["x"], None, None, placement.put_id)
    assert rows_of(get(core, req(4), now=6.0)) == placement.rows


def test_a_put_committed_without_its_put_id_is_not_reclaimed() -> None:
    core = new_core(deadlines=Deadlines(put_lease=5.0))
    placement, _ = core.put_begin("p", [X], 4, None, None, 0.0)
    core.put_commit("p", placement.rows, ["x"], None, None)  # an older client
    core.advance(6.0)
    assert rows_of(get(core, req(4), now=6.0)) == placement.rows


# ---- 8. a stalled unit is suspended, not lost -----------------------------------------------


def test_a_suspended_unit_resumes_with_its_rows() -> None:
    core = new_core(deadlines=Deadlines(unit_lost_after=60.0))
    put(core, 4)  # unit 0
    put(core, 4)  # unit 1
    core.state.seal("p")
    core.unit_down(1, now=0.0)
    assert get(core, req(8)) is None  # rows 4..7 are neither ready nor lost
    assert rows_of(get(core, req(4))) == [0, 1, 2, 3]
    assert get(core, req(4)) is None  # end-of-stream waits for the suspended unit's rows
    placement, _ = core.put_begin("q", [X], 2, None, None, 0.0)
    assert placement.units == [0, 0]  # new puts avoid it
    fx = core.unit_up(1)
    assert Wakeup("p") in fx.wakeups
    assert rows_of(get(core, req(4))) == [4, 5, 6, 7]
    assert is_end(get(core, req(4)))
    assert core.state.partition("p").lost == {}


def test_a_units_suspension_and_return_are_logged_with_its_address(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The warning "storage unit suspended" (and "resumed") named the unit's id only, where
    "storage unit lost" gives its address too: an operator of a multi-host cluster had to
    look the id up."""
    core = new_core(deadlines=Deadlines(unit_lost_after=60.0))
    with caplog.at_level(logging.INFO, logger="tq_async"):
        core.unit_down(1, now=0.0)
        core.unit_up(1)
    told = {r.tq_event["event"].split(":")[0]: r.tq_event for r in caplog.records}  # type: ignore[attr-defined]
    assert told["storage unit suspended"]["address"] == "inproc://u1"
    assert told["storage unit resumed"]["address"] == "inproc://u1"


def test_a_unit_suspended_too_long_is_lost() -> None:
    core = new_core(deadlines=Deadlines(unit_lost_after=60.0))
    put(core, 4)
    put(core, 4)
    core.state.seal("p")
    core.unit_down(1, now=0.0)
    assert core.next_deadline() == 60.0
    assert core.advance(59.0).wakeups == []
    fx = core.advance(60.0)
    assert Wakeup("p") in fx.wakeups
    assert sorted(core.state.partition("p").lost) == [4, 5, 6, 7]
    assert rows_of(get(core, req(8), now=60.0)) == [0, 1, 2, 3]
    assert is_end(get(core, req(8), now=60.0))  # lost rows no longer hold it back


@pytest.mark.parametrize("back", ["up", "lost"])
def test_a_recorded_batch_on_a_suspended_unit_waits_for_it(back: str) -> None:
    """Rank 0 of a DP job decides global batch 0: rank 1's share is recorded, on unit 1. Unit
    1 is then suspended: its rows are "neither handed out nor lost", so rank 1's request for
    its share (a replay of rank 0's too) waits (before: it got rows of a unit that does not
    answer, and its read hung). When the unit comes back (the waiters are woken) rank 1 gets
    its share; when it is lost, its share without the lost rows."""
    core = new_core(deadlines=Deadlines(unit_lost_after=60.0))
    put(core, 4)  # unit 0
    put(core, 4)  # unit 1
    rank0 = req(4, batch_index=0, dp_rank=0, dp_size=2)
    rank1 = req(4, batch_index=0, dp_rank=1, dp_size=2)
    assert rows_of(get(core, rank0)) == [0, 1, 2, 3]
    core.unit_down(1, now=0.0)
    assert get(core, rank1) is None
    assert rows_of(get(core, rank0)) == [0, 1, 2, 3]  # unit 0 serves: its replay goes on
    fx = core.unit_up(1) if back == "up" else core.advance(60.0)
    assert Wakeup("p") in fx.wakeups
    assert rows_of(get(core, rank1, now=60.0)) == ([4, 5, 6, 7] if back == "up" else [])


class _Twice(SequentialSampler):
    """Answers the first ready row twice (a with-replacement draw), consuming it once."""

    def sample(self, ready: Any, batch_size: int, *args: Any, **kwargs: Any) -> Any:
        rows = list(ready)[:1]
        return (rows * 2, rows) if rows else ([], [])


def test_a_lease_on_a_row_answered_twice_gives_it_back_once() -> None:
    """A sampler answered one row twice in a batch and consumed it once; the batch's lease ran
    out. The row goes back to the task once: before, each copy was released, and the task's
    consumed count went below zero (-1), so "every row consumed" (end of stream with
    ``stop_when_consumed``, ``partition_info``) was off by one for ever."""
    core = new_core(_Twice())
    put(core, 2)
    assert rows_of(get(core, req(2, lease=5.0))) == [0, 0]
    core.advance(10.0)  # the lease ran out
    p = core.state.partition("p")
    assert p.consumed_count["t"] == 0
    again = [rows_of(get(core, req(2), now=10.0)) for _ in range(2)]
    assert sorted(again) == [[0, 0], [1, 1]]
    assert p.consumed_count["t"] == 2
    drained = GetMeta("p", ["x"], 2, "t", None, stop_when_consumed=True)
    assert is_end(get(core, drained, now=10.0))  # every row consumed: the stream ends


def test_a_restarted_unit_loses_what_it_held() -> None:
    core = new_core()
    put(core, 4)
    put(core, 4)
    core.unit_down(1, now=0.0)
    core.unit_registered(1, "tcp://127.0.0.1:1")
    assert sorted(core.state.partition("p").lost) == [4, 5, 6, 7]
    assert 1 not in core.state.dead_units
    assert 1 not in core.state.suspended


# ---- 9. a hold never acknowledged does not survive clear_partition --------------------------


def test_clear_partition_drops_leases_and_holds() -> None:
    core = new_core()
    core.state.auto_clear["p"] = ("t",)
    put(core, 4)
    hold = get(core, req(2))
    lease = get(core, req(2, lease=5.0))
    assert hold is not None
    assert lease is not None
    p = core.state.partition("p")
    assert p.leases
    assert p.held
    incarnation = p.incarnation
    fx = core.clear_partition("p")
    assert fx.free == [("p", incarnation, {0: None, 1: None})]  # whole: every unit, all rows
    assert fx.room
    put(core, 4)  # the id is reused
    assert core.advance(10.0).wakeups == []  # the old lease is gone with its partition
    assert core.ack([hold.lease_id, lease.lease_id], 10.0).free == []
    assert core.state.partition("p").held == {}


def test_auto_clear_keeps_the_rows_of_a_recorded_batch_waiting_for_its_reader() -> None:
    """A DP rank of task "u" reads batch 0 under a lease and dies; the lease expires and the
    batch waits for its next reader. Task "t" acknowledges the same rows: both auto-clear
    tasks consumed them, but the batch still owes them to "u" (before: they were freed, and
    the restarted rank's replay named rows whose cells were gone). Once the replay is
    acknowledged, they go."""
    core = new_core()
    core.catalog.register_tasks("p", ["t", "u"])
    put(core, 4)
    first = get(core, req(4, "u", lease=5.0, batch_index=0, dp_rank=0))
    assert rows_of(first) == [0, 1, 2, 3]
    core.advance(10.0)  # the rank is gone: its lease expires
    other = get(core, req(4, lease=5.0), now=10.0)
    assert other is not None
    assert core.ack([other.lease_id], 10.0).free == []  # "u"'s batch still needs them
    p = core.state.partition("p")
    assert all(p.alive[r] for r in range(4))
    replay = get(core, req(4, "u", lease=5.0, batch_index=0, dp_rank=0), now=11.0)
    assert rows_of(replay) == [0, 1, 2, 3]
    freed = core.ack([replay.lease_id], 11.0).free
    assert freed
    assert sorted(r for _, _, by_unit in freed for rows in by_unit.values() for r in rows) == [
        0,
        1,
        2,
        3,
    ]
    assert not any(p.alive[r] for r in range(4))
    assert p.held == {}


def test_auto_clear_keeps_the_shares_of_ranks_that_have_not_read_their_global_batch() -> None:
    """Rank 0 of a DP job (task "u", dp_size 2) decides global batch 0: rank 1's share is
    recorded for it. Task "t" acknowledges the same rows before rank 1 asks: rank 1's share
    must still be there for it (before: auto-clear freed it, and rank 1 got rows whose cells
    were gone)."""
    core = new_core()
    core.catalog.register_tasks("p", ["t", "u"])
    put(core, 8)
    rank0 = get(core, req(4, "u", lease=5.0, batch_index=0, dp_rank=0, dp_size=2))
    assert rows_of(rank0) == [0, 1, 2, 3]
    other = get(core, req(8, lease=5.0))
    assert other is not None
    assert core.ack([other.lease_id], 0.0).free == []
    rank1 = get(core, req(4, "u", lease=5.0, batch_index=0, dp_rank=1, dp_size=2))
    p = core.state.partition("p")
    assert rows_of(rank1) == [4, 5, 6, 7]
    assert all(p.alive[r] for r in rank1.rows)
    core.ack([rank0.lease_id, rank1.lease_id], 0.0)
    assert p.n_alive == 0
    assert p.held == {}


def test_a_restored_checkpoints_recorded_batches_hold_their_rows_for_their_readers() -> None:
    """A checkpoint taken while rank 0 of a DP job (auto-clear task "u", dp_size 2) had read
    global batch 0 and rank 1 had not: restored, the recorded batches wait for their
    readers (a checkpoint has no leases), so task "t" acknowledging every row frees none of
    them; each rank then reads its share again, and acknowledging it frees the rows.
    Before, the restored batches held nothing: "t"'s acknowledgement freed all eight rows,
    and the ranks were given rows whose cells were gone. A batch acknowledged before the
    checkpoint (auto-clear task "v"'s) stays settled: it holds nothing (else no row would
    ever be freed)."""
    core = new_core()
    core.catalog.register_tasks("p", ["t", "u", "v"])
    put(core, 8)
    rank0 = get(core, req(4, "u", lease=5.0, batch_index=0, dp_rank=0, dp_size=2))
    assert rows_of(rank0) == [0, 1, 2, 3]
    done = get(core, req(8, "v", lease=5.0, batch_index=0, dp_rank=0))
    assert done is not None
    core.ack([done.lease_id], 0.0)
    dumps = [partition_dump(core.state.partition("p"))]
    assert dumps[0].settled == [("v", 0, 0)]
    dumps = msgspec.msgpack.decode(msgspec.msgpack.encode(dumps), type=list[PartitionDump])

    again = new_core()
    again.catalog.register_tasks("p", ["t", "u", "v"])
    again.catalog.restore_begin(dumps)
    again.catalog.restore_commit(["p"], None, (again.sampler, again.task_samplers))
    p = again.state.partition("p")
    other = get(again, req(8, lease=5.0))
    assert rows_of(other) == list(range(8))
    assert again.ack([other.lease_id], 0.0).free == []  # "u"'s batches still need them
    assert all(p.alive[r] for r in range(8))
    shares = [
        get(again, req(4, "u", lease=5.0, batch_index=0, dp_rank=rank, dp_size=2))
        for rank in (0, 1)
    ]
    assert [rows_of(s) for s in shares] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert again.ack([s.lease_id for s in shares if s is not None], 0.0).free
    assert p.n_alive == 0
    assert p.held == {}


def test_registering_auto_clear_frees_the_rows_every_task_consumed_already() -> None:
    """Auto-clear registered once the tasks consumed rows (consumers that started first):
    those rows are freed at once, as later ones are when consumed (before: nothing touched
    them again, and they stayed until the partition was cleared). Rows still held (a lease)
    and a recorded batch waiting for its reader keep theirs."""
    core = new_core()
    put(core, 4)
    put(core, 4, pid="q")
    put(core, 4, pid="own")
    assert rows_of(get(core, req(2))) == [0, 1]
    leased = get(core, req(1, lease=5.0))
    waiting = get(core, req(1, lease=1.0, batch_index=0))
    assert rows_of(waiting) == [3]
    core.advance(1.0)  # its lease ran out: the batch waits for its next reader
    assert rows_of(get(core, req(4, pid="q"))) == [0, 1, 2, 3]
    assert rows_of(get(core, req(4, pid="own"))) == [0, 1, 2, 3]
    core.catalog.register_tasks("own", ["other"])  # its own setting: not the default's
    fx = core.catalog.register_tasks("p", ["t"])
    assert fx.room
    p = core.state.partition("p")
    assert [p.alive[r] for r in range(4)] == [0, 0, 1, 1]  # leased, waiting: kept
    core.catalog.register_tasks(None, ["t"])  # every partition without its own setting
    assert core.state.partition("q").n_alive == 0
    assert core.state.partition("own").n_alive == 4
    assert leased is not None
    core.ack([leased.lease_id], 2.0)
    assert p.alive[2] == 0


def test_a_partition_being_restored_is_not_created_by_a_put_meanwhile() -> None:
    """A put (or a seal with create=True) into a partition a checkpoint load has staged but
    not committed yet is refused (before: it created the partition, and the load's commit
    replaced it: the put's acknowledged rows vanished, and the load's cells, sent to the
    units without an incarnation, overwrote the put's)."""
    core = new_core()
    put(core, 4)
    dump = partition_dump(core.state.partition("p"))
    again = new_core()
    again.catalog.restore_begin([dump])
    with pytest.raises(InvalidRequestError, match="being restored from a checkpoint"):
        put(again, 3)
    with pytest.raises(InvalidRequestError, match="being restored from a checkpoint"):
        again.catalog.seal("p", create=True)
    with pytest.raises(InvalidRequestError, match="being restored from a checkpoint"):
        again.catalog.kv_tag("p", ["k"], [{"a": 1}], 0.0)
    assert "p" not in again.state.partitions
    again.catalog.restore_commit(["p"], None, (again.sampler, again.task_samplers))
    assert again.state.partition("p").n_alive == 4
    assert put(again, 3) == [4, 5, 6]  # loaded: puts go on as usual


def test_a_late_ack_of_a_waiting_batch_lets_auto_clear_free_its_rows() -> None:
    core = new_core()
    core.catalog.register_tasks("p", ["t", "u"])
    put(core, 2)
    first = get(core, req(2, "u", lease=5.0, batch_index=0, dp_rank=0))
    assert first is not None
    core.advance(10.0)
    other = get(core, req(2, lease=5.0), now=10.0)
    assert other is not None
    core.ack([other.lease_id], 10.0)
    assert core.ack([first.lease_id], 10.0).free  # the expired lease's ack settles the batch
    assert core.state.partition("p").held == {}


# ---- 10. DP ranks in lockstep ---------------------------------------------------------------


def lockstep(
    core: ControllerCore,
    dp_size: int,
    batch_size: int,
    tail: str | None = None,
    n_replicas: int = 1,
) -> list[list[list[int]]]:
    """Every rank (and replica) reads batch after batch until every rank sees the end."""
    extra = {"tail": tail} if tail else {}
    per_rank: list[list[list[int]]] = [[] for _ in range(dp_size)]
    b = 0
    while True:
        replies = [
            [
                get(core, req(batch_size, dp_rank=r, batch_index=b, dp_size=dp_size, **extra))
                for _ in range(n_replicas)
            ]
            for r in range(dp_size)
        ]
        ends = {is_end(rep) for reps in replies for rep in reps}
        assert len(ends) == 1, f"ranks disagree on the end at batch {b}"
        if ends == {True}:
            return per_rank
        for r, reps in enumerate(replies):
            assert len({tuple(rows_of(rep)) for rep in reps}) == 1  # replicas agree
            per_rank[r].append(rows_of(reps[0]))
        b += 1


SAMPLERS = {
    "sequential": lambda: SequentialSampler(),
    "grpo": lambda: GRPOGroupNSampler(4),
    "rank_aware": lambda: RankAwareSampler(GRPOGroupNSampler(4), n_replicas=2),
    "seqlen": lambda: SeqlenBalancedSampler(n_samples_per_prompt=4, dp_size=2),
    "staleness": lambda: StalenessSampler(SequentialSampler()),
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_every_sampler_gives_every_rank_the_same_number_of_batches(name: str) -> None:
    core = new_core(SAMPLERS[name]())
    # 43 groups of 4 = 172 rows: does not divide by 2 ranks x 16 rows
    put(core, 172, tags=[{"uid": r // 4, "total_lengths": 10 + r % 7} for r in range(172)])
    core.state.seal("p")
    per_rank = lockstep(core, dp_size=2, batch_size=16, n_replicas=2)
    assert len(per_rank[0]) == len(per_rank[1])
    every = [row for batches in per_rank for batch in batches for row in batch]
    assert sorted(every) == list(range(172))  # uneven: nothing lost, nothing twice


def test_uneven_tail_may_give_a_rank_an_empty_batch() -> None:
    core = new_core()
    put(core, 5)
    core.state.seal("p")
    per_rank = lockstep(core, dp_size=4, batch_size=2)
    assert [len(batches) for batches in per_rank] == [1, 1, 1, 1]
    assert sorted(len(batches[0]) for batches in per_rank) == [1, 1, 1, 2]
    per_rank_2 = lockstep(new_sealed(1), dp_size=2, batch_size=2)
    assert per_rank_2 == [[[0]], [[]]]  # a rank gets an empty batch, never a hang


def new_sealed(n: int, sampler: BaseSampler | None = None) -> ControllerCore:
    core = new_core(sampler)
    put(core, n)
    core.state.seal("p")
    return core


def test_drop_tail_counts_the_dropped_rows() -> None:
    core = new_sealed(11)
    per_rank = lockstep(core, dp_size=2, batch_size=4, tail="drop")
    assert [len(b) for b in per_rank] == [2, 2]
    delivered = sorted(r for batches in per_rank for batch in batches for r in batch)
    assert [[len(batch) for batch in batches] for batches in per_rank] == [[4, 1], [4, 1]]
    assert len(delivered) == len(set(delivered)) == 10  # one row of the tail dropped
    assert core.state.partition("p").dropped == {"t": 1}
    assert core.state.partition("p").consumed_count["t"] == 11


def test_error_tail_raises_and_consumes_nothing() -> None:
    core = new_sealed(3)
    with pytest.raises(InvalidRequestError, match="do not split evenly over dp_size=2"):
        get(core, req(2, dp_rank=0, batch_index=0, dp_size=2, tail="error"))
    assert core.state.partition("p").consumed_count.get("t", 0) == 0


def test_grpo_rows_of_incomplete_groups_follow_the_tail_policy() -> None:
    for tail, expect_dropped in (("uneven", 0), ("drop", 2)):
        core = new_core(GRPOGroupNSampler(4))
        put(core, 8)
        put(core, 2, tags=[{"uid": "late"}] * 2)
        core.state.seal("p")
        got = rows_of(get(core, req(8, tail=tail)))
        assert got == list(range(8))
        rest = get(core, req(4, tail=tail))
        if expect_dropped:
            assert is_end(rest)
            assert core.state.partition("p").dropped == {"t": 2}
        else:
            assert rows_of(rest) == [8, 9]


def test_bad_dp_size_and_tail_are_refused() -> None:
    core = new_sealed(4)
    with pytest.raises(InvalidRequestError, match="dp_rank 2 is out of range for dp_size=2"):
        get(core, req(2, dp_rank=2, batch_index=0, dp_size=2))
    with pytest.raises(InvalidRequestError, match="tail must be one of"):
        get(core, req(2, dp_rank=0, batch_index=0, dp_size=2, tail="pad"))
    with pytest.raises(InvalidRequestError, match="needs sampling_config with dp_rank"):
        get(core, req(2, dp_size=2))


@pytest.mark.timeout(20)
def test_a_huge_dp_size_is_refused_at_once() -> None:
    """Deciding a global batch costs the controller time and memory in ``dp_size``: one
    request with dp_size 10**9 stalled it for hours (every other client with it). Refused
    at the wire, and by the core, naming the bound."""
    core = new_sealed(4)
    huge = req(2, batch_index=0, dp_rank=0, dp_size=10**9)
    with pytest.raises(InvalidRequestError, match=r"dp_size.*\[1, 65536\]"):
        validate(huge)
    with pytest.raises(InvalidRequestError, match=r"dp_size must be an int in \[1, 65536\]"):
        get(core, huge)
    assert core.state.partition("p").consumed_count.get("t", 0) == 0


def test_a_global_batch_is_never_decided_again_over_its_recorded_shares() -> None:
    """Batch 0 decided for dp_size 2, then asked for by a rank of dp_size 3 (or a batch
    recorded without dp_size, then asked for with it): refused, nothing consumed (before:
    decided again over the recorded shares, so rank 0's replay got other rows and rank 1's
    first share was consumed and never delivered)."""
    core = new_sealed(12)
    rank0 = rows_of(get(core, req(2, batch_index=0, dp_rank=0, dp_size=2)))
    consumed = core.state.partition("p").consumed_count["t"]
    with pytest.raises(InvalidRequestError, match="decided for dp_rank 0 but not for dp_rank 2"):
        get(core, req(2, batch_index=0, dp_rank=2, dp_size=3))
    assert core.state.partition("p").consumed_count["t"] == consumed
    assert rows_of(get(core, req(2, batch_index=0, dp_rank=0, dp_size=2))) == rank0
    assert rows_of(get(core, req(2, batch_index=0, dp_rank=1, dp_size=2))) == [2, 3]
    plain = rows_of(get(core, req(2, batch_index=1)))  # rank 0, no dp_size
    with pytest.raises(InvalidRequestError, match="or without dp_size"):
        get(core, req(2, batch_index=1, dp_rank=1, dp_size=2))
    assert rows_of(get(core, req(2, batch_index=1))) == plain


def test_split_even_keeps_groups_together() -> None:
    assert split_even(list(range(8)), 2, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_even(list(range(12)), 2, 4) == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]]
    assert split_even(list(range(3)), 2, 4) == [[0, 1], [2]]  # not whole groups: row by row
    assert split_even([], 3) == [[], [], []]


def test_effects_fold() -> None:
    a = Effects(wakeups=[Wakeup("p")], room=True)
    a.add(Effects(free=[("p", "i1", {0: [1]})], admission=True, stale=[("kept", 2)]))
    assert a == Effects([Wakeup("p")], [("p", "i1", {0: [1]})], True, True, [("kept", 2)])


def test_a_late_ack_of_a_recorded_batch_still_settles_it() -> None:
    core = new_core()
    put(core, 4)
    core.state.seal("p")
    got = get(core, req(4, lease=1.0, dp_rank=0, batch_index=0))
    core.advance(2.0)  # expired: the rows wait for the batch's next reader
    assert got is not None
    # nothing went back to the pool, and no lease is open: the pool's readers may end
    assert is_end(get(core, req(4)))
    core.ack([got.lease_id], 3.0)  # the consumer was only slow: its work stands
    assert ("t", 0, 0) in core.state.partition("p").settled
    replay = get(core, req(4, lease=1.0, dp_rank=0, batch_index=0), now=3.0)
    assert replay is not None
    assert replay.rows == got.rows
    assert replay.lease_id == 0


def test_a_late_ack_of_a_pooled_lease_is_ignored() -> None:
    core = new_core()
    put(core, 4)
    got = get(core, req(4, lease=1.0))
    core.advance(2.0)  # expired: back to the pool (at-least-once)
    assert got is not None
    core.ack([got.lease_id], 3.0)
    assert rows_of(get(core, req(4), now=3.0)) == got.rows


# ---- the catalogue: seal, auto-clear tasks, tags, room for puts, cancellation -----------------


def test_room_for_decides_wait_refuse_or_go() -> None:
    from tq_async import WouldBlock

    core = new_core()
    core.state.capacity = 4
    put(core, 3)
    assert core.catalog.room_for("p", 1, nowait=False)
    assert not core.catalog.room_for("p", 2, nowait=False)  # waits for room
    with pytest.raises(WouldBlock, match="capacity of 4"):
        core.catalog.room_for("p", 2, nowait=True)
    with pytest.raises(InvalidRequestError, match="never fit"):
        core.catalog.room_for("p", 5, nowait=False)


def test_seal_and_register_tasks_go_through_the_catalogue() -> None:
    core = new_core()
    rows = put(core, 2)
    fx = core.catalog.seal("p")
    assert fx.wakeups == [Wakeup("p")]
    core.catalog.register_tasks("p", ["t", "t"])
    assert core.state.auto_clear["p"] == ("t",)
    reply = get(core, req(2))
    assert rows_of(reply) == rows
    core.catalog.register_tasks("p", [])
    assert "p" not in core.state.auto_clear


def test_register_tasks_with_no_tasks_turns_a_partition_off_under_a_default_too() -> None:
    """``register_tasks([], pid)`` turns auto-clear off for ``pid`` (before: with a default
    setting, from ``auto_clear_tasks`` or ``register_tasks(tasks)``, it only dropped the
    partition's own setting, and the default freed its rows once consumed)."""
    core = new_core()
    core.catalog.register_tasks(None, ["t"])
    core.catalog.register_tasks("p", ["t", "u"])
    core.catalog.register_tasks("p", [])
    put(core, 2)
    reply = get(core, req(2))
    core.ack([reply.lease_id], 0.0)
    assert core.state.partition("p").n_alive == 2  # kept: auto-clear is off there
    put(core, 2, pid="q")
    reply = get(core, req(2, pid="q"))
    core.ack([reply.lease_id], 0.0)
    assert core.state.partition("q").n_alive == 0  # the default's
    core.catalog.register_tasks(None, [])  # no default: nothing left to turn off
    core.catalog.register_tasks("p", [])
    assert "p" not in core.state.auto_clear


def test_set_tags_checks_the_incarnation() -> None:
    core = new_core()
    rows = put(core, 2)
    p = core.state.partition("p")
    core.catalog.set_tags("p", rows, [{"a": 1}, {"a": 2}], p.incarnation)
    assert p.tags[rows[1]] == {"a": 2}
    with pytest.raises(RowsNotFound):
        core.catalog.set_tags("p", rows, [{}, {}], "another-incarnation")


@pytest.mark.parametrize("lease", [None, 5.0])
def test_a_cancelled_fetch_gives_rows_back_and_drops_its_lease(lease: float | None) -> None:
    core = new_core()
    put(core, 4)
    reply = get(core, req(4, lease=lease))
    assert reply is not None
    core.release("p", "t", reply.rows, reply.incarnation, reply.lease_id)
    assert not core.state.partition("p").leases
    again = get(core, req(4, lease=lease), now=1.0)
    assert rows_of(again) == reply.rows
    assert again is not None
    core.ack([again.lease_id], 1.0)
    # the first lease's deadline passes: nothing is given back a second time
    core.advance(100.0)
    assert get(core, req(1), now=100.0) is None


def test_a_release_after_its_lease_ran_out_takes_nothing_from_the_next_reader() -> None:
    """A fetch whose lease expired before its caller gave the rows back (a `get` whose read
    outlasted the lease, a late Cancel): the expiry gave them back already, and another
    consumer may hold them now. The release gives nothing back (before: it took them from
    that consumer's open lease, and a third consumer got them though it acknowledged)."""
    core = new_core()
    put(core, 4)
    first = get(core, req(4, lease=1.0))
    assert rows_of(first) == [0, 1, 2, 3]
    core.advance(1.0)  # the lease runs out: the rows go back to the task
    second = get(core, req(4, lease=10.0), now=1.0)
    assert rows_of(second) == [0, 1, 2, 3]
    assert first is not None
    assert second is not None
    core.release("p", "t", first.rows, first.incarnation, first.lease_id)
    assert get(core, req(1, lease=10.0), now=1.5) is None  # still the second reader's
    core.ack([second.lease_id], 2.0)
    core.release("p", "t", second.rows, second.incarnation, second.lease_id)  # acked: final
    assert get(core, req(1), now=2.0) is None


def test_a_released_batch_goes_back_whatever_other_tasks_recorded() -> None:
    """Rows a task released are ready for it again even when another task's recorded batch
    holds them (before: any task's recorded batch kept them, and the releasing task never
    got them again); a batch recorded by the task itself keeps its rows for its key."""
    core = new_core()
    put(core, 4)
    recorded = get(core, req(4, task="u", batch_index=0, dp_rank=0))
    assert rows_of(recorded) == [0, 1, 2, 3]
    reply = get(core, req(4))
    assert rows_of(reply) == [0, 1, 2, 3]
    core.release("p", "t", reply.rows)
    assert rows_of(get(core, req(4))) == [0, 1, 2, 3]
    put(core, 4)
    own = get(core, req(4, batch_index=0, dp_rank=0))
    assert rows_of(own) == [4, 5, 6, 7]
    core.release("p", "t", own.rows)  # recorded: stays with batch 0
    assert get(core, req(1)) is None
    assert rows_of(get(core, req(4, batch_index=0, dp_rank=0))) == [4, 5, 6, 7]


def test_a_release_looks_at_its_own_rows_not_the_tasks_whole_history() -> None:
    """Which released rows stay with a recorded batch is told from the rows themselves (a
    mask per task, kept as batches are recorded): a release never walks every batch the task
    ever recorded (before: it built the set of all their rows, O(the run's history), on
    each release). The answers are the same; also after a reset and a checkpoint restore."""

    class Watched(dict):  # type: ignore[type-arg]
        walks = 0

        def items(self) -> Any:
            Watched.walks += 1
            return super().items()

    core = new_core()
    put(core, 64)
    for b in range(8):  # a history of recorded batches
        rows_of(get(core, req(4, batch_index=b, dp_rank=0)))
    p = core.state.partition("p")
    p.recorded = Watched(p.recorded)
    plain = get(core, req(4))
    assert rows_of(plain) == [32, 33, 34, 35]
    core.release("p", "t", [*plain.rows, 0, 1])  # 0 and 1 are batch 0's: they stay
    assert Watched.walks == 0
    rest = rows_of(get(core, req(32)))
    assert sorted(rest) == list(range(32, 64))  # 32-35 back, 0 and 1 not
    assert rows_of(get(core, req(4, batch_index=0, dp_rank=0))) == [0, 1, 2, 3]
    again = new_core()
    again.catalog.restore_begin([partition_dump(p)])
    again.catalog.restore_commit(["p"], None, (again.sampler, again.task_samplers))
    again.release("p", "t", [4, 5])  # batch 1's, in the restored partition too
    assert rows_of(get(again, req(4, batch_index=1, dp_rank=0))) == [4, 5, 6, 7]
    core.state.partition("p").reset_consumption("t")  # no batches: every row goes back
    core.release("p", "t", [8])
    assert p.recorded_rows.get("t") is None


def test_a_refused_clear_gives_back_no_admission_slot() -> None:
    """A clear naming a row that is gone (cleared, lost) fails whole: the live rows it named
    keep their admission slots (before: their slots were freed though they stayed, and the
    learner consuming them freed them a second time, admitting past the capacity)."""
    core = new_core(admission=AdmissionConfig(capacity=10, learner_task="learn"))
    assert core.acquire(0, 4)
    placement, _ = core.put_begin("p", [X], 4, None, None, 0.0)
    core.put_commit("p", placement.rows, ["x"], None, [0] * 4, placement.put_id)
    with pytest.raises(RowsNotFound):
        core.clear_rows("p", [0, 99])
    assert core.state.partition("p").n_alive == 4
    assert core.state.outstanding == 4


def test_an_aborted_put_reclaims_its_rows_at_once() -> None:
    core = new_core()
    placement, _ = core.put_begin("p", [X], 3, None, None, 0.0)
    fx = core.abort_puts([placement.put_id, 999])
    assert fx.free  # the units free the cells
    p = core.state.partition("p")
    assert p.n_alive == 0
    assert not p.put_leases


def test_cancel_undoes_a_fetch_but_not_a_recorded_batch_or_a_peek() -> None:
    core = new_core()
    put(core, 4)
    pooled = req(2, lease=5.0)
    reply = get(core, pooled)
    assert reply is not None
    core.cancel(pooled, reply)
    assert not core.state.partition("p").leases
    assert sorted(rows_of(get(core, req(4)))) == [0, 1, 2, 3]  # all four ready again
    core2 = new_core()
    put(core2, 4)
    keyed = GetMeta("p", ["x"], 2, "t", {"dp_rank": 0, "batch_index": 0})
    first = get(core2, keyed)
    assert first is not None
    core2.cancel(keyed, first)
    assert rows_of(get(core2, keyed)) == first.rows  # the batch keeps its rows


# ---- record_from: batches below the asked one are decided first ----------------------------


def test_record_from_decides_the_lower_batches_first_in_order() -> None:
    core = new_core()
    put(core, 16)
    got = get(core, req(4, batch_index=3, dp_rank=0, record_from=0))
    assert rows_of(got) == [12, 13, 14, 15]  # batches 0, 1, 2 took the rows before it
    for b in range(3):  # recorded: every reader of those indexes gets them
        assert rows_of(get(core, req(4, batch_index=b, dp_rank=0))) == list(range(4 * b, 4 * b + 4))
    assert core.state.partitions["p"].consumed_count["t"] == 16


def test_record_from_skips_decided_batches_and_an_empty_range_is_plain() -> None:
    core = new_core()
    put(core, 12)
    assert rows_of(get(core, req(4, batch_index=1, dp_rank=0))) == [0, 1, 2, 3]
    # 1 is decided: only 0 is left below 2; record_from == batch_index decides nothing else
    assert rows_of(get(core, req(4, batch_index=2, dp_rank=0, record_from=0))) == [8, 9, 10, 11]
    assert rows_of(get(core, req(4, batch_index=0, dp_rank=0))) == [4, 5, 6, 7]
    put(core, 4)
    assert rows_of(get(core, req(4, batch_index=3, dp_rank=0, record_from=3))) == [12, 13, 14, 15]


def test_record_from_ends_the_stream_where_a_lower_batch_ends_it() -> None:
    core = new_core()
    put(core, 4)
    core.state.seal("p")
    assert is_end(get(core, req(4, batch_index=2, dp_rank=0, record_from=0)))
    assert rows_of(get(core, req(4, batch_index=0, dp_rank=0))) == [0, 1, 2, 3]
    assert is_end(get(core, req(4, batch_index=1, dp_rank=0)))


def test_record_from_waits_on_a_lower_batch_and_keeps_what_it_decided() -> None:
    core = new_core()
    put(core, 4)
    assert get(core, req(4, batch_index=2, dp_rank=0, record_from=0)) is None  # waits on 1
    assert (("t", 0, 0)) in core.state.partitions["p"].recorded  # 0 stays decided
    put(core, 8)
    assert rows_of(get(core, req(4, batch_index=2, dp_rank=0, record_from=0))) == [8, 9, 10, 11]
    assert rows_of(get(core, req(4, batch_index=1, dp_rank=0))) == [4, 5, 6, 7]


def test_record_from_decides_global_batches_for_every_rank() -> None:
    core = new_core()
    put(core, 12)
    got = get(core, req(2, batch_index=2, dp_rank=1, dp_size=2, record_from=0))
    assert rows_of(got) == [10, 11]
    recorded = core.state.partitions["p"].recorded
    assert [list(recorded[("t", r, b)]) for b in range(2) for r in range(2)] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]


def test_samplers_never_see_record_from() -> None:
    seen: list[dict[str, Any]] = []

    class Spy(BaseSampler):
        def sample(self, ready_indexes, batch_size, *args, **kwargs):  # type: ignore[no-untyped-def,override]
            seen.append(kwargs)
            rows = list(ready_indexes)[:batch_size]
            return rows, rows

    core = new_core(Spy())
    put(core, 8)
    rows_of(get(core, req(4, batch_index=1, dp_rank=0, record_from=0)))
    assert [k["batch_index"] for k in seen] == [0, 1]
    assert all("record_from" not in k and "record_from" not in k["sampling_config"] for k in seen)


def test_a_batch_asked_for_with_also_is_the_same_fetch_answered_now_or_not() -> None:
    """``follower``: what the shell asks the core for each index of ``GetMeta.also``."""
    core = new_core()
    put(core, 16)
    asked = GetMeta("p", ["x"], 4, "t", {"batch_index": 0, "dp_rank": 1}, lease=5.0)
    asked.also, asked.ack, asked.timeout = [2], [7], None
    sub = follower(asked, 2, 0)
    assert sub.sampling_config == {"batch_index": 2, "dp_rank": 1, "record_from": 1}
    assert (sub.timeout, sub.ack, sub.also, sub.lease) == (0, None, None, 5.0)
    assert asked.sampling_config == {"batch_index": 0, "dp_rank": 1}  # left as it was
    rows_of(get(core, asked))
    assert rows_of(get(core, sub)) == [8, 9, 10, 11]  # batch 1 was decided first
    assert rows_of(get(core, req(4, batch_index=1, dp_rank=1))) == [4, 5, 6, 7]


def test_record_from_is_checked() -> None:
    from tq_async._wire._checks import check_sampling_config

    with pytest.raises(InvalidRequestError, match="record_from'\\] needs 'batch_index'"):
        check_sampling_config({"record_from": 0})
    with pytest.raises(InvalidRequestError, match="record_from"):
        check_sampling_config({"record_from": -1, "batch_index": 2})
    with pytest.raises(InvalidRequestError, match="at most 65536 are decided in one request"):
        check_sampling_config({"record_from": 0, "batch_index": 10**9})
    check_sampling_config({"record_from": 5, "batch_index": 2})  # above: nothing to decide


# ---- a prompt group never holds rows of two prompts (issue 38) -----------------------------

GROUPING = {
    "grpo": lambda: GRPOGroupNSampler(4),
    "rank_aware": lambda: RankAwareSampler(GRPOGroupNSampler(4), n_replicas=2),
    "staleness": lambda: StalenessSampler(GRPOGroupNSampler(4)),
    "seqlen": lambda: SeqlenBalancedSampler(n_samples_per_prompt=4, dp_size=2),
}


@pytest.mark.parametrize("name", sorted(GROUPING))
def test_a_put_giving_one_uid_more_than_n_rows_is_refused(name: str) -> None:
    core = new_core(task_samplers={"learner": GROUPING[name]()})
    put(core, 3, tags=[{"uid": 0}] * 3)
    put(core, 4, tags=[{"uid": 1}] * 4)
    placement, _ = core.put_begin("p", [X], 2, None, None, 0.0)
    with pytest.raises(InvalidRequestError, match=r"uid=0.*rows \[0, 1, 2\].*\[7, 8\]"):
        core.put_commit("p", placement.rows, ["x"], [{"uid": 0}] * 2, None, placement.put_id)
    p = core.state.partition("p")
    assert placement.rows == [7, 8]
    assert p.tags[7] is None  # nothing of it committed
    assert not p.fields["x"].produced[7]
    assert placement.put_id in p.put_leases
    core.abort_puts([placement.put_id])  # what the client does when its commit fails
    assert p.n_alive == 7
    assert put(core, 1, tags=[{"uid": 0}]) == [9]  # the 4th row of uid 0 is fine


def test_a_reused_uid_is_refused_at_set_tags_and_free_again_after_a_clear() -> None:
    core = new_core(GRPOGroupNSampler(2))
    put(core, 2, tags=[{"uid": "a"}] * 2)
    rows = put(core, 2, tags=[{"uid": "b"}] * 2)
    with pytest.raises(InvalidRequestError, match="uid='a'"):
        core.catalog.set_tags("p", rows[:1], [{"uid": "a"}])
    assert core.state.partition("p").tags[rows[0]] == {"uid": "b"}  # nothing applied
    core.clear_rows("p", [0, 1])
    core.catalog.set_tags("p", rows, [{"uid": "a"}] * 2)  # uid "a" is free again
    assert rows_of(get(core, req(2))) == rows


def test_kv_tags_giving_one_uid_more_than_n_rows_create_no_key() -> None:
    core = new_core(GRPOGroupNSampler(2))
    core.catalog.kv_tag("p", ["a", "b"], [{"uid": 7}] * 2, 0.0)
    with pytest.raises(InvalidRequestError, match=r"uid=7.*rows \[0, 1\]"):
        core.catalog.kv_tag("p", ["c"], [{"uid": 7}], 0.0)
    with pytest.raises(InvalidRequestError, match="uid=8"):
        core.catalog.kv_tag("q", ["a", "b", "c", "a"], [{"uid": 8}] * 4, 0.0)
    assert sorted(core.state.partition("p").keys) == ["a", "b"]
    assert "q" not in core.state.partitions
    core.catalog.kv_tag("p", ["a", "b"], [{"uid": 7}] * 2, 0.0)  # the same rows again: fine


def test_a_key_two_open_puts_create_is_reclaimed_only_when_both_gave_up() -> None:
    """Two keyed puts of one new key: each holds its row under its put lease, so either one
    giving up leaves the key to the other, and only both giving up reclaim it."""
    core = new_core()
    first, _ = core.put_begin("p", [X], 0, None, ["k", "j"], 0.0)
    second, _ = core.put_begin("p", [X], 0, None, ["k"], 0.0)
    assert second.rows == first.rows[:1]
    assert second.put_id  # (the second holds the key too)
    core.abort_puts([first.put_id])
    p = core.state.partition("p")
    assert p.keys == {"k": 0}  # "j" (the first's alone) reclaimed, "k" left to the second
    core.put_commit("p", second.rows, ["x"], None, None, second.put_id, second.incarnation)
    assert p.fields["x"].produced[0]
    third, _ = core.put_begin("p", [X], 0, None, ["m"], 0.0)
    fourth, _ = core.put_begin("p", [X], 0, None, ["m"], 0.0)
    core.abort_puts([third.put_id, fourth.put_id])
    assert "m" not in p.keys


def test_uid_reuse_is_allowed_without_a_grouping_sampler() -> None:
    core = new_core()  # sequential: tags do not group rows
    put(core, 6, tags=[{"uid": 0}] * 6)
    core_n1 = new_core(GRPOGroupNSampler())  # n=1: every row is its own group
    put(core_n1, 6, tags=[{"uid": 0}] * 6)


class _Opaque(BaseSampler):
    """A custom sampler around GRPO the controller cannot see into (no group_tag)."""

    def __init__(self) -> None:
        super().__init__()
        self.grpo = GRPOGroupNSampler(4)

    def sample(self, ready_indexes: Any, batch_size: int, *args: Any, **kw: Any) -> Any:
        return self.grpo.sample(ready_indexes, batch_size, *args, **kw)


def test_a_uid_with_too_many_rows_fails_the_first_get_that_sees_it() -> None:
    core = new_core(_Opaque())
    for k in range(4):  # A0, B0, A1, B1, ... all under uid 0
        put(core, 1, tags=[{"uid": 0, "src": f"A{k}"}])
        put(core, 1, tags=[{"uid": 0, "src": f"B{k}"}])
    core.state.seal("p")
    with pytest.raises(InvalidRequestError, match=r"uid=0.*rows \[0, 1, 2, 3, 4, 5, 6, 7\]"):
        get(core, req(4))
    assert core.state.partition("p").consumed_count.get("t", 0) == 0


def _held(pid: str, incarnation: str, rows: Sequence[int]) -> HeldRows:
    return HeldRows(pid, incarnation, np.asarray(rows, "<i8").tobytes())


def test_a_returning_units_cells_of_dropped_rows_are_the_orphans() -> None:
    """`orphan_cells`: what a unit back with its cells holds that the controller dropped
    meanwhile (cleared rows, rows placed on another unit, a partition gone or made again);
    its own live rows, an open put's rows, rows past the end and unknown incarnations are
    kept."""
    core = new_core(n_units=2)
    put(core, 6)  # rows 0-5 on one unit
    opened, _ = core.put_begin("p", [X], 2, None, None, 0.0)  # rows 6, 7: not committed
    p = core.state.partition("p")
    a, b = p.units[0], p.units[6]
    assert a != b  # (placement alternates the units)
    assert set(p.units[:6]) == {a}
    assert set(p.units[6:8]) == {b}
    inc = p.incarnation
    core.clear_rows("p", [1, 2])
    put(core, 2, pid="q")
    old_q = core.state.partition("q").incarnation
    core.clear_partition("q")
    put(core, 1, pid="q")  # made again: another incarnation
    held = [
        _held("p", inc, [0, 1, 2, 3, 4, 5, 6, 7, 99]),
        _held("q", old_q, [0, 1]),
        _held("gone", "abc", [0]),
        _held("unknown", "", [0]),
    ]
    gone = [StoreClear("q", None, old_q), StoreClear("gone", None, "abc")]
    # unit a: its dead rows and the open put's (placed on b); its live rows stay
    assert orphan_cells(core.state, a, held) == [StoreClear("p", [1, 2, 6, 7], inc), *gone]
    # unit b: every row of a; the open put's rows, its own, stay
    assert orphan_cells(core.state, b, held) == [StoreClear("p", [0, 1, 2, 3, 4, 5], inc), *gone]
    assert opened.rows == [6, 7]
