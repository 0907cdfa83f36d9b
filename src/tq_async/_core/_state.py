"""The controller's state machine: partitions, production, consumption, readiness.

Plain classes, no event loop, no sockets: every method is synchronous and either changes the
state or answers from it. The async controller (`tq_async._controller._server`) owns one
`ControllerState`, runs samplers, and wakes waiters for the
`Wakeup` events the state hands back.

Layout of one partition (``n`` rows allocated so far, ids ``0..n-1``, never reused):

* ``alive[row]`` (bytearray): 1 until the row is cleared;
* ``produced[field][row]`` (bytearray per field): 1 once a committed put wrote the cell;
* ``consumed[task][row]`` (bytearray per task): 1 once the task took the row;
* ``tags[row]``, ``origin[row]`` (first row of the put that allocated it) and ``units[row]``
  (the storage unit that holds the row's cells; placement is recorded, never recomputed).
* ``versions``: which policy version produced each cell, per field and per row
  (`tq_async._core._versions`).

The arrays grow geometrically (``bytearray``/``array`` amortised appends) and hold the rows
from ``base`` on (row ``r`` at index ``r - base``): every row below ``base`` is cleared, and
once the cleared rows at the front outnumber the rest, they are dropped (rows are allocated
in order and mostly cleared in order: `tq_async._core._arrays.compact`), so a partition's
memory follows its live rows, not every row it ever had. A per-(task, fields)
**ready set** (`tq_async._core._ready`: rows in the order they became ready) is built
once on first use (one numpy scan) and then kept up to date on every commit, consume, release
and clear, so sampling never rescans the partition.
"""

from __future__ import annotations

import itertools
import secrets
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import (
    BrokenError,
    InvalidRequestError,
    KeyNotFound,
    PartitionNotFound,
    RowsNotFound,
    SchemaError,
)
from .._wire._columns import ColumnHeader
from .._wire._events import PartitionCleared
from ._arrays import KV_CHUNK_BITS, compact, rows_on
from ._events import Outbox
from ._gone import stale_incarnation
from ._groups import TagGroups
from ._placement import Placer
from ._ready import FieldsKey, ReadyRows, ReadySet, ReadyView, ready_mask
from ._recycled import RecycledQueue
from ._versions import PolicyVersions

__all__ = [
    "ControllerState",
    "Partition",
    "Wakeup",
    "Changes",
    "RecordKey",
    "Lease",
    "PutLease",
    "KV_CHUNK_BITS",
]

#: ``(task_name, dp_rank, batch_index)``: what a delivered batch is recorded under.
RecordKey = tuple[str, int, int]
#: the events of a partition no state owns: never recorded
_NO_EVENTS = Outbox()
#: the prefix of the partitions tq_async keeps for its own bookkeeping (``tq_async.compat``'s
#: numbering of partitions): their rows are not the program's, so no capacity counts them
INTERNAL_PARTITION_PREFIX = "__tq_async"


@dataclass(frozen=True, slots=True)
class Wakeup:
    """Waiters of ``partition_id`` (only those of ``task_name``, unless it is None) may proceed."""

    partition_id: str
    task_name: str | None = None


@dataclass(slots=True, eq=False)
class Lease:
    """Rows delivered to a task that stay consumed only once acknowledged.

    With a ``deadline`` it is a lease: un-acknowledged at the deadline, rows of an unkeyed
    lease go back to the task's pool, and rows of a recorded batch (``key``) wait for the next
    reader of that batch. Without one it is a *hold*: it only keeps auto-clear away from the
    rows until the consumer acknowledges, and never blocks end-of-stream.
    """

    lease_id: int
    task: str
    rows: tuple[int, ...]
    key: RecordKey | None
    deadline: float | None


@dataclass(slots=True, eq=False)
class PutLease:
    """New rows of a put that is not committed yet; reclaimed if the producer stops renewing."""

    put_id: int
    rows: list[int]
    deadline: float


class Changes:
    """What changed in a partition since the controller's journal last wrote it (see
    `tq_async._core._journal`): the rows whose state changed (new rows are found by their
    number), or ``whole`` (rewrite it all). Marking more than changed is harmless."""

    __slots__ = ("rows", "settled", "whole")

    def __init__(self) -> None:
        self.rows: set[int] = set()
        self.settled: list[tuple[str, int, int]] = []  # batches settled (`settle`)
        self.whole = False


class FieldState:
    """One field of a partition: its header, and which rows hold a cell of it."""

    __slots__ = ("header", "produced")

    def __init__(self, header: ColumnHeader, n_rows: int) -> None:
        self.header = header
        self.produced = bytearray(n_rows)


class Partition:
    """One table of rows x fields and its consumption state. See the module docstring."""

    def __init__(self, partition_id: str) -> None:
        self.partition_id = partition_id
        #: a random id of this incarnation of the partition id: unique across clears,
        #: controller restarts and checkpoint restores (a counter would repeat)
        self.incarnation = secrets.token_hex(8)
        self.n_rows = 0
        self.n_alive = 0
        #: the first row the per-row arrays hold (every row below is cleared; `_arrays.compact`)
        self.base = 0
        #: rows from ``base`` to ``base + dead_front`` are cleared (where `compact` looks on)
        self.dead_front = 0
        self.alive = bytearray()
        self.origin = array("q")
        self.units = array("i")
        #: live rows per storage unit (the load placement balances)
        self.unit_rows: dict[int, int] = {}
        #: the same in every partition of the owning state (shared: `ControllerState.bind`)
        self.loads: dict[int, int] = {}
        self.tags: list[dict[str, Any] | None] = []
        self.fields: dict[str, FieldState] = {}
        self.consumed: dict[str, bytearray] = {}
        self.consumed_count: dict[str, int] = {}
        self.ready: dict[tuple[str, FieldsKey], ReadySet] = {}
        self.sealed = False
        #: the recorded batches: ``(task, dp_rank, batch_index)`` -> the rows delivered
        self.recorded: dict[RecordKey, tuple[int, ...]] = {}
        #: the recorded batches forgotten once their rows were all gone, by ``(task, dp_rank)``:
        #: the indexes ``[lo, hi)`` (`tq_async._core._forgotten`)
        self.forgotten: dict[tuple[str, int], tuple[int, int]] = {}
        #: per task, 1 for each row in one of its recorded batches (`mark_recorded`)
        self.recorded_rows: dict[str, bytearray] = {}
        #: KV API: user key -> row, and each row's key (None for rows put without a key)
        self.keys: dict[str, int] = {}
        self.row_keys: list[str | None] = []
        #: bumped when keys or tags change: a cached ``kv_list`` answer of an older one is stale
        self.kv_version = 0
        #: the chunks of ``KV_CHUNK`` rows whose keys or tags changed since the ``kv_list``
        #: cache last took them (`take_kv_dirty`): it re-encodes those only
        self.kv_dirty: set[int] = set()
        #: rows lost with a storage unit: row -> unit
        self.lost: dict[int, int] = {}
        #: which policy produced each cell: per field that carried a version, per row the oldest
        self.versions = PolicyVersions()
        #: storage units whose rows are not handed out now (suspended: neither ready nor
        #: lost); shared with the owning `ControllerState`
        self.unavailable: set[int] = set()
        #: where row changes are recorded for watchers: the owning state's (see _events)
        self.events = _NO_EVENTS
        # ---- leases (maintained by `GetLeases`) ----
        self.leases: dict[int, Lease] = {}
        #: leases with a deadline per task: end-of-stream waits while any is open
        self.open_leases: dict[str, int] = {}
        #: rows under a lease, a hold or a waiting batch -> holders (auto-clear leaves them)
        self.held: dict[int, int] = {}
        #: recorded batches of an auto-clear task without a lease (it ran out, or a rank has
        #: not read its share of a global batch yet): they hold their rows until settled
        self.batch_holds: dict[RecordKey, tuple[int, ...]] = {}
        #: the live lease of each recorded batch (a lease belongs to the batch)
        self.batch_leases: dict[RecordKey, int] = {}
        #: recorded batches acknowledged for good: replays carry no new lease
        self.settled: set[RecordKey] = set()
        #: every lease ever given on a recorded batch -> the batch: a late ack still settles it
        self.lease_batch: dict[int, RecordKey] = {}
        #: uncommitted puts of new rows, by put id
        self.put_leases: dict[int, PutLease] = {}
        #: rows a task consumed without their being delivered (a dropped tail)
        self.dropped: dict[str, int] = {}
        #: the rows sharing a value of a grouping tag (a prompt group), kept up to date
        self.groups = TagGroups(lambda: enumerate(self.tags, self.base))
        #: what changed since the journal last wrote this partition (None: no journal)
        self.changes: Changes | None = None
        #: bumped by each change that can make a sampler's answer stop fitting (rows
        #: consumed or removed): an ``async`` sampler's rejected answer tells by it whether
        #: the state moved while it ran (sample again) or the answer is wrong (an error)
        self.moves = 0

    # ---- schema and allocation ---------------------------------------------------------------

    def check_schema(self, headers: Sequence[ColumnHeader]) -> None:
        """Raise `SchemaError` if a column contradicts its field's schema."""
        seen: set[str] = set()
        for h in headers:
            if h.name in seen:
                raise SchemaError(f"field {h.name!r} appears twice in one put")
            seen.add(h.name)
            known = self.fields.get(h.name)
            if known is not None and not known.header.accepts(h):
                # row shapes may change from put to put; dtype and row dimensions may not
                raise SchemaError(
                    f"field {h.name!r} is {known.header.describe()} in partition "
                    f"{self.partition_id!r} but the put sent {h.describe()}; a field keeps its "
                    "dtype and its rows' number of dimensions: convert the column or use a new "
                    "field name"
                )

    def add_fields(self, headers: Sequence[ColumnHeader]) -> None:
        for h in headers:
            if h.name not in self.fields:
                self.fields[h.name] = FieldState(h, self.n_rows - self.base)

    def allocate(self, n: int, unit: int) -> range:
        """Allocate ``n`` new rows on ``unit``; they exist but nothing is produced yet."""
        first = self.n_rows
        self.n_rows += n
        self.n_alive += n
        self.alive.extend(b"\x01" * n)
        self.origin.extend(itertools.repeat(first, n))
        self.units.extend(itertools.repeat(unit, n))
        self.unit_rows[unit] = self.unit_rows.get(unit, 0) + n
        self.loads[unit] = self.loads.get(unit, 0) + n
        self.tags.extend(itertools.repeat(None, n))
        self.row_keys.extend(itertools.repeat(None, n))
        self.versions.grow(n)
        for f in self.fields.values():
            f.produced.extend(bytes(n))
        for c in self.consumed.values():
            c.extend(bytes(n))
        return range(first, first + n)

    def check_incarnation(self, incarnation: str | None) -> None:
        """Raise `RowsNotFound` if ``incarnation`` (from a BatchMeta) is another one."""
        if incarnation is not None and incarnation != self.incarnation:
            raise RowsNotFound(stale_incarnation(self.partition_id))

    def check_rows(self, rows: Sequence[int]) -> None:
        """Raise `RowsNotFound` unless every row exists and is alive."""
        r = self.first_missing(rows)
        if r is not None:
            if r in self.lost:
                raise RowsNotFound(f"{self.why_missing(r)}; lost_rows() lists every lost row")
            raise RowsNotFound(
                f"{self.why_missing(r)}; use the BatchMeta a put or get_meta returned"
            )

    def first_missing(self, rows: Sequence[int]) -> int | None:
        """The first of ``rows`` that does not exist or is not alive (None: none)."""
        n, alive, base = self.n_rows, self.alive, self.base
        for r in rows:
            if not (base <= r < n and alive[r - base]):
                return r
        return None

    def is_alive(self, row: int) -> bool:
        """Whether ``row`` exists and is not cleared."""
        i = row - self.base
        return 0 <= i < len(self.alive) and bool(self.alive[i])

    def why_missing(self, r: int) -> str:
        """Why row ``r`` (not alive) cannot be handed out."""
        if r in self.lost:
            return (
                f"row {r} of partition {self.partition_id!r} was lost with storage unit "
                f"{self.lost[r]}"
            )
        return (
            f"row {r} does not exist in partition {self.partition_id!r} (never allocated, "
            "or cleared)"
        )

    # ---- production --------------------------------------------------------------------------

    def commit(
        self,
        rows: Sequence[int],
        fields: Sequence[str],
        tags: Sequence[Any] | None,
        versions: Sequence[int] | None = None,
    ) -> list[str]:
        """Mark ``fields`` of ``rows`` produced, merge ``tags`` and record policy ``versions``.

        Returns the tasks that gained ready rows.
        """
        self.check_rows(rows)
        if self.changes is not None:
            self.changes.rows.update(rows)
        missing = [f for f in fields if f not in self.fields]
        if missing:
            raise SchemaError(f"fields {missing} were not announced by put_begin")
        if tags is not None and len(tags) != len(rows):
            raise InvalidRequestError(f"got {len(tags)} tag dicts for {len(rows)} rows")
        if tags is not None and self.groups.limits:
            self.groups.check(self.partition_id, rows, tags)
        if versions is not None:
            self.versions.record(rows, fields, versions, self.base)
        base = self.base
        for name in fields:
            produced = self.fields[name].produced
            for r in rows:
                produced[r - base] = 1
        if tags is not None:
            for r, t in zip(rows, tags, strict=True):
                if t:
                    self._merge_tags(r, t)
        gained: list[str] = []
        changed = set(fields)
        for (task, key), rs in self.ready.items():
            if changed.isdisjoint(key) or not all(f in self.fields for f in key):
                continue  # untouched, or waits for a field no put has announced yet
            consumed = self.consumed[task]
            produced_arrays = [self.fields[f].produced for f in key]
            before = len(rs.rows)
            for r in rows:
                i = r - base
                if not consumed[i] and all(p[i] for p in produced_arrays) and self.available(r):
                    rs.rows[r] = None
            if len(rs.rows) != before and task not in gained:
                gained.append(task)
        return gained

    def _merge_tags(self, row: int, tags: Mapping[str, Any]) -> None:
        self.kv_version += 1
        self.kv_dirty.add(row >> KV_CHUNK_BITS)
        current = self.tags[row - self.base]
        self.groups.merged(row, current, tags)
        if current is None:
            self.tags[row - self.base] = dict(tags)
        else:
            current.update(tags)

    def set_tags(self, rows: Sequence[int], tags: Sequence[Mapping[str, Any]]) -> None:
        """Merge ``tags[i]`` into row ``rows[i]``'s tags (atomic for the whole call)."""
        if len(tags) != len(rows):
            raise InvalidRequestError(f"got {len(tags)} tag dicts for {len(rows)} rows")
        self.check_rows(rows)
        self.groups.check(self.partition_id, rows, tags)
        if self.changes is not None:
            self.changes.rows.update(rows)
        for r, t in zip(rows, tags, strict=True):
            self._merge_tags(r, t)

    def available(self, row: int) -> bool:
        """Whether ``row``'s storage unit is serving (not suspended)."""
        return not self.unavailable or self.units[row - self.base] not in self.unavailable

    def is_produced(self, row: int, fields: Sequence[str]) -> bool:
        i = row - self.base
        return all(self.fields[f].produced[i] for f in fields)

    # ---- consumption -------------------------------------------------------------------------

    def _task_array(self, task: str) -> bytearray:
        arr = self.consumed.get(task)
        if arr is None:
            arr = self.consumed[task] = bytearray(self.n_rows - self.base)
            self.consumed_count[task] = 0
        return arr

    def ready_set(self, task: str, fields: Sequence[str]) -> ReadySet:
        """The ready set for ``(task, fields)``, built on first use (one scan), then maintained."""
        key = tuple(sorted(set(fields)))
        rs = self.ready.get((task, key))
        if rs is None:
            consumed = self._task_array(task)
            rs = ReadySet(task, key)
            if all(f in self.fields for f in key):
                mask = ready_mask(self.alive, consumed, [self.fields[f].produced for f in key])
                if self.unavailable:  # rows of suspended units are neither ready nor lost
                    units = np.frombuffer(self.units, dtype=np.int32)
                    mask &= ~np.isin(units, list(self.unavailable))
                rs.rows = ReadyRows.from_mask(mask, self.base)
            self.ready[(task, key)] = rs
        return rs

    def consume(self, task: str, rows: Sequence[int]) -> None:
        """Mark ``rows`` consumed by ``task`` (they leave every ready set of the task)."""
        consumed = self.check_consume(task, rows)
        if self.changes is not None:
            self.changes.rows.update(rows)
        self.moves += 1
        base = self.base
        for r in rows:
            consumed[r - base] = 1
        self.consumed_count[task] += len(rows)
        self.events.consumed(self.partition_id, task, rows)
        for (t, _), rs in self.ready.items():
            if t == task:
                rs.discard_all(rows)

    def check_consume(self, task: str, rows: Sequence[int]) -> bytearray:
        """Raise `InvalidRequestError` unless ``task`` may consume ``rows`` (each once, none
        consumed already); the task's consumption array."""
        consumed = self._task_array(task)
        if len(rows) > 1 and len(set(rows)) != len(rows):
            raise InvalidRequestError(
                f"a sampler consumed the same row twice in one call (partition "
                f"{self.partition_id!r}, task {task!r}); consume each row once"
            )
        base = self.base
        for r in rows:
            if consumed[r - base]:
                raise InvalidRequestError(
                    f"row {r} of partition {self.partition_id!r} was already consumed by task "
                    f"{task!r}; a sampler must not consume a row twice"
                )
        return consumed

    def release(self, task: str, rows: Sequence[int]) -> list[int]:
        """Undo ``consume`` for rows still alive; the rows that became ready again (each
        once: a batch may name a row twice, as a with-replacement sampler answers)."""
        consumed = self.consumed.get(task)
        if consumed is None:
            return []
        n, alive, base = self.n_rows, self.alive, self.base
        back = [
            r
            for r in dict.fromkeys(rows)
            if base <= r < n and alive[r - base] and consumed[r - base]
        ]
        if self.changes is not None:
            self.changes.rows.update(back)
        for r in back:
            consumed[r - base] = 0
        self.consumed_count[task] -= len(back)
        self.events.released(self.partition_id, task, back)
        for (t, key), rs in self.ready.items():
            if t == task and all(f in self.fields for f in key):
                for r in back:
                    if self.is_produced(r, key) and self.available(r):
                        rs.rows[r] = None
        return back

    def reset_consumption(self, task: str | None) -> None:
        """Forget what ``task`` (every task if None) consumed (its count of rows dropped
        undelivered too); its ready sets are rebuilt."""
        tasks = list(self.consumed) if task is None else [task]
        if task is None:
            self.dropped.clear()
        else:
            self.dropped.pop(task, None)
        self.events.reset(self.partition_id, task)
        if self.changes is not None:
            self.changes.whole = True
        for t in tasks:
            if t in self.consumed:
                self.consumed[t] = bytearray(self.n_rows - self.base)
                self.consumed_count[t] = 0
            for key in [k for k in self.ready if k[0] == t]:
                del self.ready[key]
            for dk in [k for k in self.recorded if k[0] == t]:
                del self.recorded[dk]
            self.recorded_rows.pop(t, None)

    def mark_recorded(self, task: str, rows: Sequence[int]) -> None:
        """``rows`` are in a recorded batch of ``task`` (`recorded_rows`: a release tells
        which of its rows stay with a batch from them, not from every batch recorded)."""
        mask = self.recorded_rows.get(task)
        n, base = self.n_rows - self.base, self.base
        if mask is None:
            mask = self.recorded_rows[task] = bytearray(n)
        elif len(mask) < n:
            mask.extend(bytes(n - len(mask)))
        for r in rows:
            mask[r - base] = 1

    def offer(self, task: str, fields: Sequence[str]) -> tuple[ReadyView, bool]:
        """What a sampler of ``task`` asking for ``fields`` is offered: a view of the ready
        rows, and whether no more can come (`is_final`)."""
        rs = self.ready_set(task, fields)
        return ReadyView(rs.rows), self.is_final(task, rs)

    def is_final(self, task: str, rs: ReadySet) -> bool:
        """No more rows can reach ``task`` through ``rs``.

        Sealed; every alive row consumed or ready (none still being produced, none on a
        suspended unit, none under a live put lease: none pending); and no lease of the task
        open (its rows could still come back).
        """
        pending = self.n_alive - self.consumed_count.get(task, 0) - len(rs.rows)
        return self.sealed and pending == 0 and not self.open_leases.get(task)

    # ---- clearing ----------------------------------------------------------------------------

    def clear_rows(self, rows: Sequence[int], reason: str = "clear") -> dict[int, list[int]]:
        """Remove rows; return the rows to free on each storage unit (``reason``: for
        watchers)."""
        self.check_rows(rows)
        if self.changes is not None:
            self.changes.rows.update(rows)
        self.moves += 1
        by_unit: dict[int, list[int]] = {}
        base = self.base
        for r in set(rows):
            i = r - base
            self.alive[i] = 0
            self.groups.cleared(r, self.tags[i])
            self.tags[i] = None
            key = self.row_keys[i]
            if key is not None:
                del self.keys[key]
                self.row_keys[i] = None
            by_unit.setdefault(self.units[i], []).append(r)
            for task, consumed in self.consumed.items():
                if consumed[i]:
                    consumed[i] = 0
                    self.consumed_count[task] -= 1
            for rs in self.ready.values():
                rs.discard(r)
        self.n_alive -= sum(len(v) for v in by_unit.values())
        self.kv_version += 1
        self.kv_dirty.update({r >> KV_CHUNK_BITS for r in rows})
        self.events.rows_removed(self.partition_id, set(rows), reason)
        for unit, freed in by_unit.items():
            self.unit_rows[unit] -= len(freed)
            self.loads[unit] -= len(freed)
        compact(self)
        return by_unit

    def lose_unit(self, unit: int) -> list[int]:
        """Rows held by a dead unit are lost: never handed out again, reported by lost_rows."""
        rows = rows_on(self, unit)
        if rows:
            self.clear_rows(rows, "lost")
            self.lost.update(dict.fromkeys(rows, unit))
        return rows

    # ---- keys (KV API) -----------------------------------------------------------------------

    def rows_for_keys(self, keys: Sequence[str]) -> list[int]:
        """The row of each key; raise `KeyNotFound` naming every missing key."""
        missing = [k for k in keys if k not in self.keys]
        if missing:
            raise KeyNotFound(
                f"keys {missing[:10]}{' ...' if len(missing) > 10 else ''} are not in partition "
                f"{self.partition_id!r}; kv_list() shows the keys it has"
            )
        return [self.keys[k] for k in keys]

    def take_kv_dirty(self) -> set[int]:
        """The chunks (row >> `KV_CHUNK_BITS`) whose keys or tags changed since the last call
        (what ``kv_list``'s cache must encode again)."""
        dirty, self.kv_dirty = self.kv_dirty, set()
        return dirty

    def bind_keys(self, keys: Sequence[str], unit: int) -> tuple[list[int], list[int]]:
        """Rows for ``keys``: existing keys keep their row, new keys get new rows on ``unit``."""
        if len(set(keys)) != len(keys):
            raise InvalidRequestError("the same key appears twice in one call")
        new_keys = [k for k in keys if k not in self.keys]
        if new_keys:
            if self.sealed:
                raise InvalidRequestError(
                    f"partition {self.partition_id!r} is sealed: new keys {new_keys[:5]} cannot "
                    "be added; update existing keys only, or use a new partition"
                )
            for key, row in zip(new_keys, self.allocate(len(new_keys), unit), strict=True):
                self.keys[key] = row
                self.row_keys[row - self.base] = key
                self.kv_dirty.add(row >> KV_CHUNK_BITS)
            self.kv_version += 1
        rows = [self.keys[k] for k in keys]
        return rows, [self.units[r - self.base] for r in rows]


class ControllerState:
    """Every partition of one controller, plus the storage units it places rows on.

    Placement: all new rows of one put go to one unit, so a batch read back as it was
    written is one contiguous zero-copy slice on one unit; which unit is decided by
    `Placer` (on the producer's host when it can).
    """

    def __init__(self, units: Mapping[int, str] | None = None) -> None:
        self.partitions: dict[str, Partition] = {}
        self.units: dict[int, str] = dict(units or {})
        #: each unit's host id ("" or missing: unknown), and who chooses a put's unit
        self.unit_hosts: dict[int, str] = {}
        self.placer = Placer()
        #: partitions being restored from a checkpoint: invisible until committed
        self.restoring: dict[str, Partition] = {}
        #: what the partitions being restored owe their readers, `dp_ends` and `recycled`
        #: once committed: ``(task, batch_index, ranks)`` and rows
        self.restoring_owed: dict[str, tuple[list[tuple[str, int, list[int]]], list[int]]] = {}
        #: storage units declared lost: their rows are lost, new rows avoid them
        self.dead_units: set[int] = set()
        #: storage units that missed their liveness deadline -> when they are declared lost;
        #: their rows are neither handed out nor lost, new rows avoid them
        self.suspended: dict[int, float] = {}
        #: the units whose rows are not handed out now (shared with every partition)
        self.unavailable: set[int] = set()
        #: bumped whenever a unit's address changes (clients then ask for the units again);
        #: starts at random so that a restarted controller's epoch differs too
        self.units_epoch = secrets.randbits(30) + 1
        #: the learner's policy version (-1: never announced)
        self.learner_version = -1
        #: admitted rollouts not yet consumed by the learner (see AdmissionConfig)
        self.outstanding = 0
        #: the latest admissions' tokens -> rows: a client asking again with one (its reply
        #: was lost) is admitted without taking the slots twice (`Admission.acquire`)
        self.admitted: dict[int, int] = {}
        #: each holder's (a client's identity) admitted slots whose rows are not put yet,
        #: oldest holder first: a holder gone (`Admission.holder_gone`) gives them back
        self.holders: dict[bytes, int] = {}
        #: the holders whose client renews their slots (`Admission.lease`) -> when they
        #: lapse (the core's clock): one that stops renewing gives its slots back
        self.slot_leases: dict[bytes, float] = {}
        #: stale rows whose prompts must be regenerated: (partition_id, incarnation, row),
        #: taken once
        self.recycled = RecycledQueue()
        #: the latest takes' tokens -> what each handed out, ``(partition_id, incarnation,
        #: rows, hold lease id)`` per partition: a client asking again with one (its reply
        #: was lost) gets the same rows (`Catalog.take_recycled`)
        self.taken: dict[int, list[tuple[str, str, list[int], int]]] = {}
        #: how many stale rows each policy handled
        self.stale_counts = {"dropped": 0, "recycled": 0, "kept": 0}
        #: a stop_when_consumed end of stream one DP rank got at a global batch index (more
        #: rows may come before its peers ask the same index): ``(partition_id, incarnation,
        #: task, batch_index)`` -> the ranks still to be told (`Gets.look`)
        self.dp_ends: dict[tuple[str, str, str, int], set[int]] = {}
        #: backpressure: the most live rows per partition (or in all, when capacity_global)
        self.capacity: int | None = None
        self.capacity_global = False
        #: auto-clear: rows are cleared once every listed task consumed them (None: default)
        self.auto_clear: dict[str | None, tuple[str, ...]] = {}
        #: tag -> the most rows of a partition one value of it may have (the samplers' prompt
        #: groups, see ``BaseSampler.group_tag``; shared with every partition)
        self.group_limits: dict[str, int] = {}
        #: the events transitions record for watchers (see _events)
        self.events = Outbox()
        #: live rows per storage unit in every bound partition (`bind`; `unbind` when one is
        #: dropped): a put's placement reads it, without a pass over the partitions
        self.loads: dict[int, int] = {}

    def new_rows_needed(
        self, partition_id: str, n_rows: int, rows: Sequence[int] | None, keys: Sequence[str] | None
    ) -> int:
        """How many rows a put would add (0 when it only writes to existing rows)."""
        if rows is not None:
            return 0
        if keys is not None:
            p = self.partitions.get(partition_id)
            return len(keys) if p is None else sum(1 for k in set(keys) if k not in p.keys)
        return n_rows

    def has_room(self, partition_id: str, n_new: int) -> bool:
        """Whether ``n_new`` more live rows fit the capacity."""
        if self.capacity is None or n_new == 0:
            return True
        if partition_id.startswith(INTERNAL_PARTITION_PREFIX):
            return True
        if self.capacity_global:
            live = sum(
                p.n_alive
                for pid, p in self.partitions.items()
                if not pid.startswith(INTERNAL_PARTITION_PREFIX)
            )
        else:
            p = self.partitions.get(partition_id)
            live = p.n_alive if p is not None else 0
        return live + n_new <= self.capacity

    def at_capacity(self, partition_id: str) -> str:
        """What is full when a put into ``partition_id`` finds no room, for messages: the
        partition, or every partition together (``capacity_scope="global"``)."""
        if self.capacity_global:
            return f"all partitions together are at their capacity of {self.capacity} rows"
        return f"partition {partition_id!r} is at its capacity of {self.capacity} rows"

    def auto_clears(self, p: Partition, task: str) -> bool:
        """Whether ``task`` is one of the auto-clear tasks of ``p``."""
        tasks = self.auto_clear.get(p.partition_id, self.auto_clear.get(None))
        return bool(tasks) and task in tasks  # type: ignore[operator]

    def auto_clear_done(self, p: Partition, rows: Sequence[int]) -> list[int]:
        """Of ``rows``, those every auto-clear task of ``p`` has consumed (still alive)."""
        tasks = self.auto_clear.get(p.partition_id, self.auto_clear.get(None))
        if not tasks:
            return []
        arrays = [p.consumed.get(t) for t in tasks]
        if any(a is None for a in arrays):
            return []
        base = p.base
        return [
            r
            for r in dict.fromkeys(rows)
            if r >= base and p.alive[r - base] and all(a[r - base] for a in arrays if a)
        ]

    def new_partition(self, partition_id: str) -> Partition:
        """A new empty partition bound to this state (not registered until the caller does)."""
        return self.bind(Partition(partition_id))

    def bind(self, p: Partition) -> Partition:
        """``p`` shares this state's suspended units, prompt-group limits, event outbox and
        unit loads (its rows count in them until `unbind`)."""
        p.unavailable = self.unavailable
        p.groups.limits = self.group_limits
        p.events = self.events
        if p.loads is not self.loads:
            for unit, n in p.unit_rows.items():
                self.loads[unit] = self.loads.get(unit, 0) + n
            p.loads = self.loads
        return p

    def unbind(self, p: Partition) -> None:
        """``p`` is gone: its rows leave the unit loads."""
        if p.loads is self.loads:
            for unit, n in p.unit_rows.items():
                self.loads[unit] -= n
            p.loads = {}

    def drop_partition(self, partition_id: str) -> Partition:
        """Forget a partition (``clear_partition``)."""
        p = self.partitions.pop(partition_id)
        self.unbind(p)
        if self.events.on:
            self.events.add(PartitionCleared(partition_id=partition_id, incarnation=p.incarnation))
        return p

    def seal(self, partition_id: str, *, create: bool = False) -> list[Wakeup]:
        """No more new rows in ``partition_id``.

        A partition that does not exist raises `PartitionNotFound` (a misspelled id
        would otherwise be created sealed while the real one stays open); ``create=True``
        creates it empty and sealed.
        """
        p = self.partitions.get(partition_id)
        if p is None and not create:
            raise PartitionNotFound(
                f"cannot seal partition {partition_id!r}: it does not exist (never put to, or "
                f"cleared); known partitions: {sorted(self.partitions)[:20]}. Check the id, "
                "or pass create=True to create it empty and sealed"
            )
        if p is None:
            self.check_not_restoring(partition_id)
            p = self.partitions[partition_id] = self.new_partition(partition_id)
        p.sealed = True
        return [Wakeup(partition_id)]

    def check_not_restoring(self, partition_id: str) -> None:
        """Raise `InvalidRequestError` if a checkpoint load staged ``partition_id``: one
        created meanwhile would be replaced by the load's commit (its rows gone)."""
        if partition_id in self.restoring:
            raise InvalidRequestError(
                f"partition {partition_id!r} is being restored from a checkpoint "
                "(load_checkpoint): a put or a seal cannot create it meanwhile; write to it "
                "once the load returned (it holds the checkpoint's rows then), or use another "
                "partition"
            )

    def partition(self, partition_id: str) -> Partition:
        p = self.partitions.get(partition_id)
        if p is None:
            raise PartitionNotFound(
                f"partition {partition_id!r} does not exist (never put to, or cleared); "
                f"known partitions: {sorted(self.partitions)[:20]}"
            )
        return p

    def unit_loads(self) -> dict[int, int]:
        """Live rows per storage unit, in every partition (those a checkpoint load stages
        too: their rows are on the units)."""
        return dict(self.loads)

    def live_units(self) -> list[int]:
        """The units that may take rows (neither lost nor suspended), in id order."""
        return sorted(u for u in self.units if u not in self.dead_units and u not in self.suspended)

    def pick_unit(self, host: str = "", n_rows: int = 0) -> int:
        """The unit for a put of ``n_rows`` new rows from a producer on ``host`` (see
        `Placer`)."""
        if not self.units:
            raise InvalidRequestError(
                "the controller has no storage units; start at least one (local_cluster "
                "num_storage_units >= 1, or `tq-async serve storage`)"
            )
        ids = self.live_units()
        if not ids:
            raise BrokenError(
                f"every storage unit ({sorted(self.units)}) is down or suspended; restart "
                "them (they register again) before putting"
            )
        local = self.placer.effective_mode(ids, self.unit_hosts) == "local"
        loads = self.unit_loads() if local else {}  # round-robin needs none
        return self.placer.choose(ids, self.unit_hosts, loads, host, n_rows)

    def put_begin(
        self,
        partition_id: str,
        headers: Sequence[ColumnHeader],
        n_rows: int,
        rows: Sequence[int] | None,
        keys: Sequence[str] | None = None,
        host: str = "",
    ) -> tuple[list[int], list[int], list[Wakeup]]:
        """Validate a put and find its rows. Returns ``(rows, units, wakeups)``.

        Exactly one of: ``n_rows`` new rows, existing ``rows``, or ``keys`` (existing keys keep
        their rows, new keys get new rows). New rows create the partition on first use.
        Nothing is visible to consumers until the put is committed. ``host``: the
        producer's host id (new rows prefer a unit there).
        """
        wakeups: list[Wakeup] = []
        if rows is not None:
            known = self.partition(partition_id)
            known.check_schema(headers)
            known.check_rows(rows)
            known.add_fields(headers)
            return list(rows), [known.units[r - known.base] for r in rows], wakeups
        if keys is None and n_rows <= 0:
            raise InvalidRequestError(f"a put needs at least one row, got {n_rows}")
        if keys is not None and not keys:
            raise InvalidRequestError("a keyed put needs at least one key")
        p = self.partitions.get(partition_id)
        fresh = p is None
        if p is None:
            self.check_not_restoring(partition_id)
            p = self.new_partition(partition_id)
        p.check_schema(headers)
        if keys is None and p.sealed:
            raise InvalidRequestError(
                f"partition {partition_id!r} is sealed: no new rows can be added; "
                "put into a new partition, or add fields to existing rows with meta="
            )
        unit = self.pick_unit(host, n_rows if keys is None else len(keys))
        if keys is not None:
            got_rows, units = p.bind_keys(keys, unit)  # validates before changing anything
        else:
            got_rows, units = list(p.allocate(n_rows, unit)), [unit] * n_rows
        p.add_fields(headers)
        if fresh:
            self.partitions[partition_id] = p
            wakeups.append(Wakeup(partition_id))
        return got_rows, units, wakeups
