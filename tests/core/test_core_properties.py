"""Random interleavings of put / get_meta(lease) / ack / expiry / replay / consumer death /
cancellation (a fetch whose reply its caller never saw, a put abandoned after its placement) /
tags / seal / clears / epoch resets / reads ahead (``also=``) / storage units going silent and
coming back / a controller restarted from its journal, by the consumers of three tasks over
the same rows: "t" (the default sampler), "u" (whole prompt groups, `GRPOGroupNSampler`) and
"g" (a DP job of two ranks reading global batches), with and without auto-clear; checked
against a model of the guarantees (docs/guarantees.md). Loop-free: ControllerCore, every
transition the controller's shell calls."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tq_async._core import _arrays
from tq_async._core._forgotten import is_forgotten
from tq_async._core._journal import (
    controller_record,
    decode_controller,
    decode_partition,
    encode,
    partition_record,
    recover,
)
from tq_async._core._state import ControllerState
from tq_async._core._transitions import ControllerCore, Deadlines, SampleCall
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import GetMeta, MetaReply
from tq_async.samplers import GRPOGroupNSampler

X = ColumnHeader("x", "dense", "int64", ())
LEASE = 5.0
#: a silent unit is never declared lost here (its rows would be gone: another model)
DEADLINES = Deadlines(put_lease=LEASE, unit_lost_after=1e9)
#: task "u" reads whole prompt groups of this many rows (`GRPOGroupNSampler`): each run of
#: GROUP rows of a put is a group
GROUP = 2


def new_core(state: ControllerState) -> ControllerCore:
    return ControllerCore(state, task_samplers={"u": GRPOGroupNSampler(GROUP)}, deadlines=DEADLINES)


#: the task of each consumer: two of task "t", one of task "u", two of task "g" (the same
#: rows, each task consuming every one of them on its own)
TASKS = ("t", "t", "u", "g", "g")
#: consumers 3 and 4 are ranks 0 and 1 of a DP job of task "g": they read global batches
#: (``dp_size`` 2, `DP_BS` rows a rank) and must end at the same step
RANKS = {3: 0, 4: 1}
DP_BS = 2


@dataclass
class Consumer:
    alive: bool = True
    next_batch: int = 0
    #: recorded batches it read and has not acknowledged: batch index -> (rows, lease id)
    open: dict[int, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    #: unkeyed deliveries not acknowledged: lease id -> rows
    loose: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: a recorded batch it fetched but never saw (cancelled): read that key again
    redo: bool = False
    #: a DP rank: the batch index its end of stream came at
    eos: int | None = None


class Model:
    """Drives a ControllerCore and checks every answer against the guarantees."""

    def __init__(self, auto_clear: bool = False) -> None:
        self.core = new_core(ControllerState({0: "inproc://u0", 1: "inproc://u1"}))
        #: storage units suspended now (silent: their rows wait, neither handed out nor lost)
        self.down: set[int] = set()
        #: rows are freed once both tasks consumed them and nothing holds them
        self.auto_clear = auto_clear
        if auto_clear:
            self.core.catalog.register_tasks("p", sorted(set(TASKS)))
        self.now = 0.0
        #: ids of the rows committed (an aborted put's ids are never visible)
        self.committed: list[int] = []
        #: rows a producer cleared (``clear_samples``): owed to nobody from then on
        self.cleared: set[int] = set()
        self.sealed = False
        #: per task: how many times each row was acknowledged
        self.acked: dict[str, Counter[int]] = {t: Counter() for t in TASKS}
        #: rows a recorded batch (task, rank, index) resolved to, the first time
        self.recorded: dict[tuple[str, int, int], tuple[int, ...]] = {}
        self.consumers = [Consumer() for _ in TASKS]
        self.settled: set[tuple[str, int, int]] = set()
        #: each committed row's prompt group for task "u" (its put, offset // GROUP)
        self.group: dict[int, tuple[int, int]] = {}
        self.puts = 0

    def request(self, c: int, keyed: bool, n: int, index: int, lease: float | None) -> GetMeta:
        """Consumer ``c``'s fetch: a DP rank's is always its share of global batch ``index``."""
        if c in RANKS:
            cfg = {"dp_rank": RANKS[c], "batch_index": index, "dp_size": len(RANKS)}
            return GetMeta("p", ["x"], DP_BS, TASKS[c], cfg, lease=lease)
        cfg = {"dp_rank": c, "batch_index": index} if keyed else None
        if TASKS[c] == "u":  # whole groups: a multiple of the group size
            n = GROUP * max(1, n // GROUP)
        return GetMeta("p", ["x"], n, TASKS[c], cfg, lease=lease)

    @staticmethod
    def key(c: int, index: int) -> tuple[str, int, int]:
        return (TASKS[c], RANKS.get(c, c), index)

    def record(self, c: int, index: int, rows: tuple[int, ...]) -> None:
        """A recorded batch read: always the same rows; a global batch's shares disjoint."""
        assert self.recorded.setdefault(self.key(c, index), rows) == rows
        if c in RANKS:
            shares = [self.recorded.get(("g", r, index)) for r in RANKS.values()]
            known = [set(share) for share in shares if share is not None]
            assert sum(map(len, known)) == len(set().union(*known)), "shares overlap"

    def get(self, request: GetMeta) -> MetaReply | None:
        decision, _ = self.core.get_meta(request, self.now)
        while isinstance(decision, SampleCall):
            decision, _ = self.core.sampled(request, decision, decision.run(), self.now)
        if isinstance(decision, MetaReply) and decision.rows:
            p = self.core.state.partition("p")
            dead = [r for r in decision.rows if not p.is_alive(r) and r not in self.cleared]
            if request.task_name == "u" and not self.sealed:  # GRPO: only whole groups
                groups = Counter(self.group[r] for r in decision.rows)
                sizes = Counter(self.group.values())
                split = [g for g, k in groups.items() if k != sizes[g]]
                assert not split, f"groups {split} delivered split before the end"
            assert not dead, f"rows {dead} delivered after auto-clear freed them"
        return decision

    def put(self, n: int) -> None:
        if self.sealed:
            return
        placement, _ = self.core.put_begin("p", [X], n, None, None, self.now)
        self.core.put_commit("p", placement.rows, ["x"], None, None, placement.put_id)
        self.committed += placement.rows
        self.puts += 1
        for offset, r in enumerate(placement.rows):
            self.group[r] = (self.puts, offset // GROUP)

    def abort_put(self, n: int) -> None:
        """A put whose caller gave up after its placement: its rows are never visible."""
        if self.sealed:
            return
        placement, _ = self.core.put_begin("p", [X], n, None, None, self.now)
        self.core.abort_puts([placement.put_id])
        p = self.core.state.partition("p")
        assert not any(p.is_alive(r) for r in placement.rows), "an aborted put left rows"
        assert not p.put_leases, "an aborted put left its put lease"

    def cancel(self, c: int, keyed: bool, n: int, lease: bool) -> None:
        """A fetch answered but its caller cancelled before it saw the reply: the client
        gives the rows back (``release`` with the fetch's lease); a recorded batch keeps
        them for the next reader of its key."""
        who, task = self.consumers[c], TASKS[c]
        keyed = keyed or c in RANKS
        if not who.alive or (keyed and who.redo):
            return
        reply = self.get(self.request(c, keyed, n, who.next_batch, LEASE if lease else None))
        if reply is None or reply.end_of_stream:
            return
        for r in reply.rows:
            assert self.acked[task][r] == 0, f"acknowledged row {r} delivered again"
        if keyed:
            self.record(c, who.next_batch, tuple(reply.rows))
            who.redo = True
            return
        self.core.release("p", task, reply.rows, reply.incarnation, reply.lease_id)
        p = self.core.state.partition("p")
        assert reply.lease_id not in p.leases, "a cancelled fetch kept its lease"
        consumed = p.consumed.get(task)
        assert consumed is not None
        assert not any(r >= p.base and consumed[r - p.base] for r in reply.rows), (
            "a cancelled fetch consumed rows"
        )

    def tag(self, row: int) -> None:
        if row < len(self.committed):
            r = self.committed[row]
            if not self.core.state.partition("p").is_alive(r):
                return  # auto-cleared: tagging it is refused (RowsNotFound), as it should be
            self.core.catalog.set_tags("p", [r], [{"seen": row}])
            p = self.core.state.partition("p")
            assert p.tags[r - p.base] == {"seen": row}

    def seal(self) -> None:
        self.sealed = True
        self.core.catalog.seal("p", create=True)

    def read(self, c: int, keyed: bool, n: int) -> None:
        who, task = self.consumers[c], TASKS[c]
        keyed = keyed or c in RANKS
        if not who.alive:
            return
        reply = self.get(self.request(c, keyed, n, who.next_batch, LEASE))
        if reply is None:
            return
        if reply.end_of_stream:
            self.check_end(task)
            if c in RANKS:
                assert who.eos in (None, who.next_batch), "a DP rank's end moved"
                who.eos = who.next_batch
            return
        rows = tuple(reply.rows)
        for r in rows:
            assert self.acked[task][r] == 0, f"acknowledged row {r} delivered again"
        if keyed:
            self.record(c, who.next_batch, rows)
            if rows:  # (a rank's empty share of an uneven last batch has nothing to ack)
                who.open[who.next_batch] = (rows, reply.lease_id)
            who.next_batch += 1
            who.redo = False
        else:
            who.loose[reply.lease_id] = rows

    def read_ahead(self, c: int, n: int) -> None:
        """A keyed read asking for the next two batches too (``also``: a DataLoader's
        prefetch): each batch decided ahead is recorded, under a lease of its own."""
        who, task = self.consumers[c], TASKS[c]
        if not who.alive:
            return
        req = self.request(c, True, n, who.next_batch, LEASE)
        req.also = [who.next_batch + 1, who.next_batch + 2]
        reply = self.get(req)
        if reply is None:
            return
        for one in [reply, *(reply.more or [])]:
            if one.end_of_stream:
                self.check_end(task)
                if c in RANKS:
                    who.eos = who.next_batch
                return
            rows = tuple(one.rows)
            for r in rows:
                assert self.acked[task][r] == 0, f"acknowledged row {r} delivered again"
            self.record(c, who.next_batch, rows)
            if rows:
                who.open[who.next_batch] = (rows, one.lease_id)
            who.next_batch += 1
            who.redo = False

    def ack(self, c: int) -> None:
        who = self.consumers[c]
        if not who.alive:
            return
        for index, (rows, lease_id) in who.open.items():
            self.settle(TASKS[c], rows, lease_id, self.key(c, index))
        for lease_id, rows in who.loose.items():
            self.settle(TASKS[c], rows, lease_id)
        who.open.clear()
        who.loose.clear()

    def settle(
        self,
        task: str,
        rows: tuple[int, ...],
        lease_id: int,
        key: tuple[str, int, int] | None = None,
    ) -> None:
        """Acknowledge; count the rows once if the ack must take effect.

        A recorded batch is settled by any ack of any of its leases, even a late one (its
        rows never left it); an expired lease without a batch is ignored (the rows went
        back to the pool and are read again: at-least-once).
        """
        live = lease_id in self.core.leases.home
        self.core.ack([lease_id], self.now)
        if key is not None:
            if key not in self.settled:
                self.settled.add(key)
                self.acked[task].update(rows)
            p = self.core.state.partition("p")
            # (or forgotten: its rows all cleared and dropped, it is never replayed either)
            assert key in p.settled or is_forgotten(p, key)
        elif live:
            self.acked[task].update(rows)

    def crash(self) -> None:
        """The controller is killed and restarted on its journal. Every answer waits for the
        record of what it shows, so the record is taken now; the units come back."""
        core, wall = self.core, 1000.0 + self.now
        parts = [partition_record(p, self.now, wall) for p in core.state.partitions.values()]
        ctl = controller_record(core, {0: "i0", 1: "i1"}, wall)
        again = new_core(ControllerState())
        recover(
            again,
            decode_controller(encode(ctl)),
            [decode_partition(encode(rec)) for rec in parts],
            self.now,
            wall,
            {},
        )
        for unit in (0, 1):  # (a unit still silent stays suspended)
            if unit not in self.down:
                again.unit_up(unit)
        self.core = again

    def suspend(self, unit: int) -> None:
        """A storage unit goes silent (at most one at a time: puts need a unit)."""
        if not self.down:
            self.down.add(unit)
            self.core.unit_down(unit, self.now)

    def resume(self, unit: int) -> None:
        """A silent unit answers again, with its cells."""
        if unit in self.down:
            self.down.discard(unit)
            self.core.unit_up(unit)

    def reset(self, which: int) -> None:
        """A new epoch for one task (``reset_consumption``): its consumption, recorded
        batches and leases are forgotten, and its consumers start again from batch 0; every
        live row is owed to it once more. (Not with auto-clear: rows freed before the reset
        are gone for good, which the model does not follow.)"""
        if self.auto_clear or "p" not in self.core.state.partitions:
            return
        task = sorted(set(TASKS))[which % len(set(TASKS))]
        stale = [
            lease_id
            for c, t in enumerate(TASKS)
            if t == task
            for lease_id in [
                *(lid for _, lid in self.consumers[c].open.values()),
                *self.consumers[c].loose,
            ]
        ]
        self.core.reset_consumption("p", task)
        self.core.ack(stale, self.now)  # a consumer of the old epoch acks late: ignored
        self.acked[task] = Counter()
        self.recorded = {k: v for k, v in self.recorded.items() if k[0] != task}
        self.settled = {k for k in self.settled if k[0] != task}
        for c, t in enumerate(TASKS):
            if t == task:
                self.consumers[c] = Consumer(alive=self.consumers[c].alive)
        p = self.core.state.partition("p")
        assert not p.consumed_count.get(task), "a reset task still counts consumed rows"
        assert not any(lease.task == task for lease in p.leases.values()), "a lease survived"

    def kill(self, c: int) -> None:
        self.consumers[c].alive = False

    def restart(self, c: int) -> None:
        """A new process for consumer ``c``: it replays its un-acknowledged recorded batches."""
        who = self.consumers[c]
        replays = sorted(who.open)
        self.consumers[c] = Consumer(next_batch=who.next_batch, redo=who.redo)
        for index in replays:
            reply = self.get(self.request(c, True, 1, index, LEASE))
            assert reply is not None
            assert tuple(reply.rows) == self.recorded[self.key(c, index)]  # the same rows
            self.settle(TASKS[c], tuple(reply.rows), reply.lease_id, self.key(c, index))

    def advance(self, dt: float) -> None:
        self.now += dt
        self.core.advance(self.now)

    def check_end(self, task: str) -> None:
        p = self.core.state.partition("p")
        assert self.sealed, "end of stream before seal"
        assert not p.open_leases.get(task), "end of stream while a lease is open"
        assert p.consumed_count.get(task, 0) == p.n_alive, "end of stream with rows unread"

    def clear(self, i: int) -> None:
        """A producer clears one committed row (``clear_samples``)."""
        if i < len(self.committed):
            r = self.committed[i]
            if self.core.state.partition("p").is_alive(r):
                self.core.clear_rows("p", [r])
                self.cleared.add(r)

    def check_acked(self, task: str) -> None:
        """Every row acknowledged by ``task`` once at most; every row not cleared, once."""
        acked = self.acked[task]
        assert all(n == 1 for n in acked.values()), f"a row acknowledged twice by {task}"
        assert set(acked) <= set(self.committed), f"{task} acknowledged unknown rows"
        missing = set(self.committed) - self.cleared - set(acked)
        assert not missing, f"rows {sorted(missing)} never delivered to {task}"

    def drain_rank(self, c: int) -> None:
        """DP rank ``c`` reads its global batches to the end, acknowledging each."""
        for _ in range(len(self.committed) + 3):
            if self.consumers[c].eos is not None:
                return
            self.read(c, True, DP_BS)
            self.ack(c)
        raise AssertionError(f"DP rank {RANKS[c]}'s stream did not end")

    def finish(self) -> None:
        """Seal, let every lease run out, restart the dead, and read to the end."""
        for unit in sorted(self.down):
            self.resume(unit)
        self.seal()
        self.advance(2 * LEASE)
        for c in range(len(self.consumers)):
            if not self.consumers[c].alive:
                self.restart(c)
            else:
                self.ack(c)
            if self.consumers[c].redo:  # the cancelled batch, read again under its key
                self.read(c, True, 1)
                self.ack(c)
        # rank 0 runs ahead to its end (deciding every global batch, so rank 1's shares
        # are recorded for it), the other tasks finish, then rank 1 catches up
        self.drain_rank(3)
        for task in sorted(set(TASKS) - {"g"}):
            for _ in range(len(self.committed) + 2):
                reply = self.get(GetMeta("p", ["x"], 4, task, None, lease=LEASE))
                assert reply is not None, f"the end of stream never came for {task}"
                if reply.end_of_stream:
                    self.check_end(task)
                    break
                self.settle(task, tuple(reply.rows), reply.lease_id)
            else:
                raise AssertionError(f"the stream did not end for {task}")
            self.check_acked(task)
        self.drain_rank(4)
        ends = {self.consumers[c].eos for c in RANKS}
        assert len(ends) == 1, f"DP ranks ended at different steps: {ends}"
        self.check_acked("g")
        if self.auto_clear:  # every row consumed by both tasks and acknowledged: all freed
            p = self.core.state.partition("p")
            assert p.n_alive == 0, f"{p.n_alive} rows never auto-cleared"
            assert not p.held, "holds left"


ops = st.one_of(
    st.tuples(st.just("put"), st.integers(1, 6)),
    st.tuples(st.just("read"), st.integers(0, len(TASKS) - 1), st.booleans(), st.integers(1, 5)),
    st.tuples(st.just("ack"), st.integers(0, len(TASKS) - 1)),
    st.tuples(st.just("kill"), st.integers(0, len(TASKS) - 1)),
    st.tuples(st.just("restart"), st.integers(0, len(TASKS) - 1)),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 2.0, LEASE + 1])),
    st.tuples(st.just("seal")),
    st.tuples(
        st.just("cancel"),
        st.integers(0, len(TASKS) - 1),
        st.booleans(),
        st.integers(1, 5),
        st.booleans(),
    ),
    st.tuples(st.just("abort_put"), st.integers(1, 4)),
    st.tuples(st.just("tag"), st.integers(0, 30)),
    st.tuples(st.just("crash")),
    st.tuples(st.just("reset"), st.integers(0, 2)),
    st.tuples(st.just("read_ahead"), st.integers(0, len(TASKS) - 1), st.integers(1, 3)),
    st.tuples(st.just("clear"), st.integers(0, 30)),
    st.tuples(st.just("suspend"), st.integers(0, 1)),
    st.tuples(st.just("resume"), st.integers(0, 1)),
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, max_size=40), st.booleans(), st.booleans())
def test_random_interleavings_keep_the_guarantees(
    program: list[tuple[object, ...]], auto_clear: bool, dropping: bool
) -> None:
    # dropping: the partition drops its cleared front rows as soon as it can
    default = _arrays.COMPACT_ROWS
    _arrays.COMPACT_ROWS = 1 if dropping else default
    try:
        _run(program, auto_clear)
    finally:
        _arrays.COMPACT_ROWS = default


def _run(program: list[tuple[object, ...]], auto_clear: bool) -> None:
    m = Model(auto_clear)
    for op, *args in program:
        if op == "seal":
            m.seal()
        elif op == "crash":
            m.crash()
        elif op == "reset":
            m.reset(*args)  # type: ignore[arg-type]
        elif op == "read_ahead":
            m.read_ahead(*args)  # type: ignore[arg-type]
        elif op == "clear":
            m.clear(*args)  # type: ignore[arg-type]
        elif op == "suspend":
            m.suspend(*args)  # type: ignore[arg-type]
        elif op == "resume":
            m.resume(*args)  # type: ignore[arg-type]
        elif op == "cancel":
            m.cancel(*args)  # type: ignore[arg-type]
        elif op == "abort_put":
            m.abort_put(*args)  # type: ignore[arg-type]
        elif op == "tag":
            m.tag(*args)  # type: ignore[arg-type]
        elif op == "put":
            m.put(*args)  # type: ignore[arg-type]
        elif op == "read":
            m.read(*args)  # type: ignore[arg-type]
        elif op == "ack":
            m.ack(*args)  # type: ignore[arg-type]
        elif op == "kill":
            m.kill(*args)  # type: ignore[arg-type]
        elif op == "restart":
            if not m.consumers[args[0]].alive:  # type: ignore[index]
                m.restart(*args)  # type: ignore[arg-type]
        else:
            m.advance(*args)  # type: ignore[arg-type]
    m.finish()
