"""The controller's journal records: what a durable controller writes, and how it recovers.

Pure: no files, no clock. The I/O shell (`tq_async._controller._journal`) writes, for every
partition a group commit covers, what changed since its last record (a `PartitionDelta`,
built by a `Tracker`) and now and then the whole partition instead (a `PartitionRecord`, its
snapshot: the first record of a partition, and whenever its deltas since the last snapshot
grew past a share of it, so that recovery replays a bounded tail); with every commit, one
`ControllerRecord`. A controller started on the same ``data_dir`` gets each partition's
snapshot and deltas back, `replay` folds them into one `PartitionRecord`, and `recover`
rebuilds the core from those.

A partition's snapshot is its checkpoint dump (the format ``save_checkpoint`` uses, with the
per-row integer arrays as bytes: `RowsRecord`) plus what a checkpoint leaves out
because a restore starts afresh: the incarnation (old ``BatchMeta`` objects stay valid), the
leases with the seconds they had left, the recorded batches' settled keys and past lease ids
(a late ack still settles), the uncommitted put leases and the lost rows. A delta holds every
per-row value of the rows that changed (the partition marks them: `Changes`) or are new,
the leases given, renewed or ended, and the recorded batches, lease ids, settled keys, put
leases and lost rows added since (those only grow between resets; a reset, or anything the
tracker cannot follow, writes a snapshot instead). Recovery rebuilds partitions with
`restore_partition` (the checkpoint's own code) and gives leases back through
`adopt` (the code that gives new ones); uncommitted
puts are aborted through `ControllerCore.abort_puts`, expired leases expire through
`ControllerCore.advance`, storage units that served rows are suspended until they come
back with their data (`ControllerCore.unit_down`). Nothing decides twice: every
transition after recovery is the core's.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np

from .._wire._columns import ColumnHeader
from .._wire._protocol import FieldDump, PartitionDump
from ._arrays import fill, put_items, take
from ._dumps import dump_rows, restore_partition
from ._effects import Effects
from ._sampling import load_states
from ._state import Changes, Lease, Partition, PutLease
from ._transitions import ControllerCore

__all__ = [
    "FORMAT",
    "READS",
    "ControllerRecord",
    "LeaseRecord",
    "PartitionDelta",
    "PartitionRecord",
    "Tracker",
    "RowsRecord",
    "controller_record",
    "decode_controller",
    "decode_delta",
    "decode_partition",
    "encode",
    "encode_delta",
    "named_samplers",
    "partition_record",
    "row_reservation",
    "skip_reserved",
    "recover",
    "replay",
]

K = TypeVar("K")
V = TypeVar("V")

#: the journal's format version (a controller refuses a data_dir of another it cannot read)
FORMAT = 2
#: the formats a controller reads (1: snapshots only, no deltas; it writes `FORMAT` from then)
READS = (1, 2)


class LeaseRecord(msgspec.Struct, array_like=True):
    """A lease or hold: ``left`` seconds to its deadline when recorded (None: a hold)."""

    lease_id: int
    task: str
    rows: list[int]
    key: tuple[str, int, int] | None
    left: float | None


class RowsRecord(msgspec.Struct, array_like=True):
    """A `PartitionDump` with its per-row integer arrays as machine-order bytes (a
    commit copies them instead of building lists of ints: about 15x faster at 1M rows)."""

    partition_id: str
    n_rows: int
    alive: bytes
    origin: bytes
    units: bytes
    tags: list[dict[str, Any] | None]
    row_keys: list[str | None]
    sealed: bool
    fields: list[FieldDump]
    consumed: dict[str, bytes]
    deliveries: list[tuple[str, int, int, list[int]]]
    row_version: bytes
    field_versions: dict[str, bytes]
    #: the per-row arrays hold the rows from this one on (`Partition.base`)
    base: int = 0
    #: the recorded batches forgotten, ``(task, dp_rank, lo, hi)`` (`Partition.forgotten`)
    forgotten: list[tuple[str, int, int, int]] = []

    @classmethod
    def of(cls, p: Partition) -> RowsRecord:
        return dump_rows(p, cls, array.tobytes)

    def dump(self) -> PartitionDump:
        """The checkpoint format, which `restore_partition` reads."""
        return PartitionDump(
            partition_id=self.partition_id,
            n_rows=self.n_rows,
            alive=self.alive,
            origin=_ints("q", self.origin),
            units=_ints("i", self.units),
            tags=self.tags,
            row_keys=self.row_keys,
            sealed=self.sealed,
            fields=self.fields,
            consumed=self.consumed,
            deliveries=self.deliveries,
            row_version=_ints("q", self.row_version),
            field_versions={f: _ints("q", v) for f, v in self.field_versions.items()},
            base=self.base,
            forgotten=self.forgotten,
        )


def _ints(typecode: str, raw: bytes) -> list[int]:
    a = array(typecode)
    a.frombytes(raw)
    return a.tolist()


class PartitionRecord(msgspec.Struct, array_like=True):
    """Everything the controller knows of one partition, at wall-clock time ``wall``."""

    rows: RowsRecord
    incarnation: str
    wall: float
    leases: list[LeaseRecord]
    #: every lease ever given on a recorded batch: ``(lease_id, task, dp_rank, batch_index)``
    lease_batch: list[tuple[int, str, int, int]]
    settled: list[tuple[str, int, int]]
    #: uncommitted puts: ``(put_id, rows)`` (aborted on recovery)
    puts: list[tuple[int, list[int]]]
    dropped: dict[str, int]
    #: rows lost with a storage unit: ``(row, unit)`` (format 1 has none)
    lost: list[tuple[int, int]] = []
    #: row ids below this may have been handed out (see `row_reservation`; 0: none)
    reserved: int = 0


class ControllerRecord(msgspec.Struct, array_like=True):
    """The controller's own state (units, admission, stale rows, samplers), written with
    every commit."""

    format: int
    wall: float
    #: the next lease / put id (ids stay unique across restarts)
    next_id: int
    units: dict[int, str]
    #: each remote unit's instance token: one that comes back with another lost its data
    instances: dict[int, str]
    dead_units: list[int]
    learner_version: int
    outstanding: int
    #: ``register_tasks`` settings: ``(partition_id or None, tasks)``
    auto_clear: list[tuple[str | None, list[str]]]
    sampler_state: dict[str, Any]
    #: the latest admissions' tokens -> rows (`ControllerState.admitted`)
    admitted: dict[int, int] = msgspec.field(default_factory=dict)
    #: stale rows queued for ``take_recycled``, oldest first: a list of ``(partition_id,
    #: incarnation, row)``, kept encoded between changes (`RecycledQueue.encoded`)
    recycled: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"\x90"))
    #: how many stale rows each policy handled (`ControllerState.stale_counts`)
    stale_counts: dict[str, int] = msgspec.field(default_factory=dict)
    #: the auto-clear settings the controller started with (its configuration's; None: not
    #: recorded): what ``register_tasks`` changed since is told from them (`recover`)
    auto_clear_start: list[tuple[str | None, list[str]]] | None = None
    #: each unit's host id (placement and locality; a unit that is not restarted does not
    #: register again to tell it)
    unit_hosts: dict[int, str] = msgspec.field(default_factory=dict)
    #: DP ranks still to be told a stop_when_consumed end of stream: ``(partition_id,
    #: incarnation, task, batch_index, ranks)`` (`ControllerState.dp_ends`)
    dp_ends: list[tuple[str, str, str, int, list[int]]] = msgspec.field(default_factory=list)
    #: the latest takes of recycled rows by token (`ControllerState.taken`)
    taken: dict[int, list[tuple[str, str, list[int], int]]] = msgspec.field(default_factory=dict)
    #: each holder's admitted slots not put yet, oldest first (`ControllerState.holders`)
    holders: list[tuple[bytes, int]] = msgspec.field(default_factory=list)
    #: the holders whose client renews their slots (`ControllerState.slot_leases`): each
    #: gets a full slot lease when the controller recovers (none in older records: their
    #: holders' slots are kept until put)
    leased: list[bytes] = msgspec.field(default_factory=list)


_encoder = msgspec.msgpack.Encoder()
_partition_decoder = msgspec.msgpack.Decoder(PartitionRecord)
_controller_decoder = msgspec.msgpack.Decoder(ControllerRecord)


def encode(record: PartitionRecord | ControllerRecord) -> bytes:
    return _encoder.encode(record)


def decode_partition(blob: bytes) -> PartitionRecord:
    return _partition_decoder.decode(blob)


def decode_controller(blob: bytes) -> ControllerRecord:
    return _controller_decoder.decode(blob)


class PartitionDelta(msgspec.Struct, array_like=True):
    """What changed in one partition since its previous record, at wall-clock ``wall``.

    ``rows`` (int64, machine order) are the rows that changed or are new; every per-row
    array below holds their values in that order (machine-order bytes, as in `RowsRecord`),
    for every field and task the partition has. Rows below ``base`` are cleared: they are
    not in ``rows``, and a replay drops them (`tq_async._core._arrays.compact`).
    """

    wall: float
    incarnation: str
    n_rows: int
    rows: bytes
    alive: bytes
    origin: bytes
    units: bytes
    row_version: bytes
    produced: dict[str, bytes]
    consumed: dict[str, bytes]
    field_versions: dict[str, bytes]
    tags: list[dict[str, Any] | None]
    row_keys: list[str | None]
    #: fields announced since (in order)
    fields: list[ColumnHeader]
    sealed: bool
    #: leases given or renewed since, with the seconds they had left at ``wall``
    leases: list[LeaseRecord]
    #: leases acknowledged, expired or dropped since
    ended: list[int]
    lease_batch: list[tuple[int, str, int, int]]
    recorded: list[tuple[str, int, int, list[int]]]
    settled: list[tuple[str, int, int]]
    puts: list[tuple[int, list[int]]]
    puts_done: list[int]
    #: the whole ``dropped`` counts, when they changed
    dropped: dict[str, int] | None
    lost: list[tuple[int, int]]
    reserved: int = 0
    base: int = 0


_delta_decoder = msgspec.msgpack.Decoder(PartitionDelta)


def decode_delta(blob: bytes) -> PartitionDelta:
    return _delta_decoder.decode(blob)


#: the numpy types of the per-row arrays (``array`` typecodes ``q`` and ``i``)
_I64, _I32, _U8 = np.dtype(np.int64), np.dtype(np.intc), np.dtype(np.uint8)
#: a partition's deltas since its snapshot are replayed at recovery: once they hold this many
#: records, plus one per this many rows, or this many bytes plus a share of the snapshot's
#: size, the next record is a snapshot again (its cost, paid once per that many commits)
SNAPSHOT_EVERY = 256
SNAPSHOT_ROWS_PER_DELTA = 100
SNAPSHOT_BYTES = 1 << 16
SNAPSHOT_SHARE = 0.5
#: the fewest rows a record reserves ahead (`row_reservation`)
RESERVE_MIN = 1024
#: lease and put ids a recovered controller skips past the last record's next id (more
#: than a controller hands out between two commits)
ID_GAP = 1 << 24


class _Seen:
    """What the journal holds of one partition: enough to tell what changed since."""

    __slots__ = (
        "added",
        "dropped",
        "lease_batch",
        "leases",
        "log_bytes",
        "log_count",
        "lost",
        "n_fields",
        "n_lease_batch",
        "n_lost",
        "n_recorded",
        "n_rows",
        "n_settled",
        "partition",
        "puts",
        "recorded",
        "settled",
        "snap_bytes",
    )

    def __init__(self, p: Partition, snap_bytes: int) -> None:
        self.partition = p
        self.snap_bytes = snap_bytes
        #: rows the last record added (`row_reservation` looks two records back)
        self.added = 0
        self.log_bytes = 0
        self.log_count = 0
        self.mark(p)

    def mark(self, p: Partition) -> None:
        """``p`` as it is now is what the journal holds."""
        self.n_rows = p.n_rows
        self.n_fields = len(p.fields)
        self.leases = {i: (lease, lease.deadline) for i, lease in p.leases.items()}
        self.puts = set(p.put_leases)
        # the containers that only grow between resets: followed by their length
        self.recorded, self.n_recorded = p.recorded, len(p.recorded)
        self.lease_batch, self.n_lease_batch = p.lease_batch, len(p.lease_batch)
        self.lost, self.n_lost = p.lost, len(p.lost)
        self.settled, self.n_settled = p.settled, len(p.settled)
        self.dropped = dict(p.dropped)

    def followable(self, p: Partition) -> bool:
        """Whether a delta can say what changed (else: a snapshot)."""
        ch = p.changes
        return (
            self.partition is p
            and ch is not None
            and not ch.whole
            and p.recorded is self.recorded
            and len(p.recorded) >= self.n_recorded
            and p.lease_batch is self.lease_batch
            and len(p.lease_batch) >= self.n_lease_batch
            and p.lost is self.lost
            and len(p.lost) >= self.n_lost
            and p.settled is self.settled
            and len(p.settled) >= self.n_settled
            and len(p.fields) >= self.n_fields
            and self.log_count < SNAPSHOT_EVERY + p.n_rows // SNAPSHOT_ROWS_PER_DELTA
            and self.log_bytes < SNAPSHOT_BYTES + self.snap_bytes * SNAPSHOT_SHARE
        )


class Tracker:
    """Turns partitions into journal records: a delta of what changed since the partition's
    last record when it can, a snapshot when it must.

    A record is built when the shell is about to write it; the tracker then takes it as
    written. If the write fails, `forget` the partitions it held (their next record is
    a snapshot).
    """

    def __init__(self) -> None:
        self.seen: dict[str, _Seen] = {}
        #: the row reservation of the last record built (`row_reservation`)
        self.reserved = 0

    def record(self, p: Partition, now: float, wall: float) -> tuple[bool, bytes]:
        """``(is_snapshot, blob)``: the record of ``p`` to write now (``now``: the core's
        clock, ``wall``: seconds since the epoch)."""
        seen = self.seen.get(p.partition_id)
        added = p.n_rows - (0 if seen is None else seen.n_rows)
        # rows added by this record or the one before: a producer placing its next rows
        # after the record of its last commit (which added none) still finds them reserved
        self.reserved = row_reservation(p, max(added, 0 if seen is None else seen.added))
        if seen is None or not seen.followable(p):
            blob = self.snapshot(p, now, wall, self.reserved)
            self.seen[p.partition_id].added = added
            return True, blob
        blob = encode_delta(self._delta(p, seen, now, wall))
        seen.log_bytes += len(blob)
        seen.log_count += 1
        seen.added = added
        return False, blob

    def snapshot(self, p: Partition, now: float, wall: float, reserved: int = 0) -> bytes:
        """``p`` whole (reserving row ids up to ``reserved``); the tracker follows it from
        here."""
        blob = encode(partition_record(p, now, wall, reserved))
        self.follow(p, len(blob))
        return blob

    def follow(self, p: Partition, snap_bytes: int, log_bytes: int = 0, log_count: int = 0) -> None:
        """``p`` as it is now is in the journal (a snapshot of ``snap_bytes`` and deltas since:
        ``log_count`` records, ``log_bytes`` bytes); mark its changes from now on."""
        seen = self.seen[p.partition_id] = _Seen(p, snap_bytes)
        seen.log_bytes, seen.log_count = log_bytes, log_count
        p.changes = Changes()

    def forget(self, partition_id: str) -> None:
        """The partition is gone, or its last record was not written."""
        self.seen.pop(partition_id, None)

    def _delta(self, p: Partition, seen: _Seen, now: float, wall: float) -> PartitionDelta:
        ch = p.changes
        assert ch is not None
        changed = ch.rows
        ch.rows = set()
        base = p.base
        if seen.n_rows < p.n_rows:
            changed.update(range(max(seen.n_rows, base), p.n_rows))
        idx = np.array(sorted(r for r in changed if r >= base), dtype=_I64)
        at = idx - base if base else idx
        leases: list[LeaseRecord] = []
        old = seen.leases
        for lease_id, lease in p.leases.items():
            was = old.get(lease_id)
            if was is None or was[0] is not lease or was[1] != lease.deadline:
                leases.append(_lease_record(lease, now))
        ended = [lease_id for lease_id in old if lease_id not in p.leases]
        puts = [(i, list(put.rows)) for i, put in p.put_leases.items() if i not in seen.puts]
        puts_done = [i for i in seen.puts if i not in p.put_leases]
        settled, ch.settled = set(ch.settled), []
        delta = PartitionDelta(
            wall=wall,
            incarnation=p.incarnation,
            n_rows=p.n_rows,
            rows=idx.tobytes(),
            alive=take(p.alive, _U8, at),
            origin=take(p.origin, _I64, at),
            units=take(p.units, _I32, at),
            row_version=take(p.versions.rows, _I64, at),
            produced={name: take(f.produced, _U8, at) for name, f in p.fields.items()},
            consumed={t: take(c, _U8, at) for t, c in p.consumed.items()},
            field_versions={f: take(v, _I64, at) for f, v in p.versions.fields.items()},
            tags=[p.tags[i] for i in at.tolist()],
            row_keys=[p.row_keys[i] for i in at.tolist()],
            fields=[f.header for f in itertools.islice(p.fields.values(), seen.n_fields, None)],
            sealed=p.sealed,
            leases=leases,
            ended=ended,
            lease_batch=[
                (i, t, d, b) for i, (t, d, b) in _appended(p.lease_batch, seen.n_lease_batch)
            ],
            recorded=[
                (t, d, b, list(rows)) for (t, d, b), rows in _appended(p.recorded, seen.n_recorded)
            ],
            settled=sorted(settled),
            puts=puts,
            puts_done=puts_done,
            dropped=dict(p.dropped) if p.dropped != seen.dropped else None,
            lost=_appended(p.lost, seen.n_lost),
            reserved=self.reserved,
            base=base,
        )
        seen.mark(p)
        return delta


def _appended(d: dict[K, V], n_before: int) -> list[tuple[K, V]]:
    """The items added to ``d`` after its first ``n_before`` (it only grew since), from its
    end: the cost is the new items', not the history's (a partition's recorded batches and
    their leases grow for the whole run)."""
    new = len(d) - n_before
    if new <= 0:
        return []
    tail = list(itertools.islice(reversed(d.items()), new))
    tail.reverse()
    return tail


def encode_delta(delta: PartitionDelta) -> bytes:
    return _encoder.encode(delta)


def _lease_record(lease: Lease, now: float) -> LeaseRecord:
    left = None if lease.deadline is None else lease.deadline - now
    return LeaseRecord(lease.lease_id, lease.task, list(lease.rows), lease.key, left)


class _Image:
    """A partition's record being replayed: its per-row arrays as growable raw bytes."""

    def __init__(self, rec: PartitionRecord) -> None:
        r = rec.rows
        self.partition_id = r.partition_id
        self.incarnation = rec.incarnation
        self.wall = rec.wall
        self.n = r.n_rows
        self.base = r.base
        self.alive = bytearray(r.alive)
        self.origin = bytearray(r.origin)
        self.units = bytearray(r.units)
        self.row_version = bytearray(r.row_version)
        self.headers = {f.header.name: f.header for f in r.fields}
        self.produced = {f.header.name: bytearray(f.produced) for f in r.fields}
        self.consumed = {t: bytearray(c) for t, c in r.consumed.items()}
        self.field_versions = {f: bytearray(v) for f, v in r.field_versions.items()}
        self.tags = list(r.tags)
        self.row_keys = list(r.row_keys)
        self.sealed = r.sealed
        self.recorded = {(t, d, b): rows for t, d, b, rows in r.deliveries}
        #: (forgetting batches writes a snapshot: no delta changes it)
        self.forgotten = r.forgotten
        #: lease id -> (its record, the wall-clock time its ``left`` was measured at)
        self.leases = {lr.lease_id: (lr, rec.wall) for lr in rec.leases}
        self.lease_batch = {i: (t, d, b) for i, t, d, b in rec.lease_batch}
        self.settled = {(t, d, b) for t, d, b in rec.settled}
        self.puts = dict(rec.puts)
        self.dropped = dict(rec.dropped)
        self.lost = dict(rec.lost)
        self.reserved = rec.reserved

    def apply(self, d: PartitionDelta) -> None:
        if d.incarnation != self.incarnation:
            raise ValueError(f"a delta of incarnation {d.incarnation} after {self.incarnation}")
        grow, n = d.n_rows - self.n, d.n_rows
        if grow < 0 or d.base < self.base:
            raise ValueError(f"a delta of {n} rows from {d.base} after {self.n} from {self.base}")
        held = self.n - self.base
        for h in d.fields:
            self.headers[h.name] = h
            self.produced.setdefault(h.name, bytearray(held))
        for task in d.consumed:  # tasks (and versioned fields) new since
            if task not in self.consumed:
                self.consumed[task] = bytearray(held)
        for name in d.field_versions:
            if name not in self.field_versions:
                self.field_versions[name] = bytearray(fill(-1, held, 8))
        idx = np.frombuffer(d.rows, _I64) - d.base
        drop = d.base - self.base  # rows cleared and dropped since (`compact`)
        put_items(self.alive, grow, drop, 0, _U8, idx, d.alive)
        put_items(self.origin, grow, drop, 0, _I64, idx, d.origin)
        put_items(self.units, grow, drop, 0, _I32, idx, d.units)
        put_items(self.row_version, grow, drop, -1, _I64, idx, d.row_version)
        for name, buf in self.produced.items():
            put_items(buf, grow, drop, 0, _U8, idx, d.produced.get(name))
        for task, buf in self.consumed.items():
            put_items(buf, grow, drop, 0, _U8, idx, d.consumed.get(task))
        for name, buf in self.field_versions.items():
            put_items(buf, grow, drop, -1, _I64, idx, d.field_versions.get(name))
        for rows in (self.tags, self.row_keys):
            rows.extend(itertools.repeat(None, grow))
            del rows[:drop]
        for i, t, k in zip(idx.tolist(), d.tags, d.row_keys, strict=True):
            self.tags[i] = t
            self.row_keys[i] = k
        self.n, self.base = n, d.base
        self.sealed = d.sealed
        for lease_id in d.ended:
            self.leases.pop(lease_id, None)
        for lr in d.leases:
            self.leases[lr.lease_id] = (lr, d.wall)
        self.lease_batch.update((i, (t, dp, b)) for i, t, dp, b in d.lease_batch)
        self.recorded.update(((t, dp, b), rows) for t, dp, b, rows in d.recorded)
        self.settled.update((t, dp, b) for t, dp, b in d.settled)
        for put_id in d.puts_done:
            self.puts.pop(put_id, None)
        self.puts.update(d.puts)
        if d.dropped is not None:
            self.dropped = dict(d.dropped)
        self.lost.update(d.lost)
        self.reserved = d.reserved  # the last record's (see `row_reservation`)
        self.wall = d.wall

    def skip_reserved(self) -> None:
        """Rows up to the reservation, never written: dead (their ids are not given again)."""
        grow = self.reserved - self.n
        if grow <= 0:
            return
        for buf in (self.alive, *self.produced.values(), *self.consumed.values()):
            buf.extend(bytes(grow))
        self.origin.extend(fill(0, grow, 8))
        self.units.extend(fill(0, grow, 4))
        self.row_version.extend(fill(-1, grow, 8))
        for buf in self.field_versions.values():
            buf.extend(fill(-1, grow, 8))
        self.tags.extend(itertools.repeat(None, grow))
        self.row_keys.extend(itertools.repeat(None, grow))
        self.n = self.reserved

    def record(self) -> PartitionRecord:
        wall = self.wall
        return PartitionRecord(
            rows=RowsRecord(
                partition_id=self.partition_id,
                n_rows=self.n,
                base=self.base,
                alive=bytes(self.alive),
                origin=bytes(self.origin),
                units=bytes(self.units),
                tags=self.tags,
                row_keys=self.row_keys,
                sealed=self.sealed,
                fields=[FieldDump(h, bytes(self.produced[n])) for n, h in self.headers.items()],
                consumed={t: bytes(c) for t, c in self.consumed.items()},
                deliveries=[(t, d, b, list(rows)) for (t, d, b), rows in self.recorded.items()],
                row_version=bytes(self.row_version),
                field_versions={f: bytes(v) for f, v in self.field_versions.items()},
                forgotten=self.forgotten,
            ),
            incarnation=self.incarnation,
            wall=wall,
            leases=[
                lr
                if lr.left is None or at == wall
                # (a wall clock stepped back between the records ages it by nothing)
                else LeaseRecord(
                    lr.lease_id, lr.task, lr.rows, lr.key, lr.left - max(0.0, wall - at)
                )
                for lr, at in self.leases.values()
            ],
            lease_batch=[(i, t, d, b) for i, (t, d, b) in self.lease_batch.items()],
            settled=sorted(self.settled),
            puts=list(self.puts.items()),
            dropped=self.dropped,
            lost=list(self.lost.items()),
            reserved=self.reserved,
        )


def replay(snapshot: PartitionRecord, deltas: Iterable[PartitionDelta]) -> PartitionRecord:
    """``snapshot`` with ``deltas`` (written after it, in order) applied: one record.

    Raises:
        ValueError: a delta that does not follow the snapshot (another incarnation, fewer
            rows).
    """
    image = None
    for d in deltas:
        if image is None:
            image = _Image(snapshot)
        image.apply(d)
    return snapshot if image is None else image.record()


def skip_reserved(rec: PartitionRecord) -> PartitionRecord:
    """``rec`` with its rows up to its reservation (`row_reservation`): those never written
    are dead, so a recovered partition never gives their ids to another put."""
    if rec.reserved <= rec.rows.n_rows:
        return rec
    image = _Image(rec)
    image.skip_reserved()
    return image.record()


def partition_record(p: Partition, now: float, wall: float, reserved: int = 0) -> PartitionRecord:
    """Record ``p`` as it is at ``now`` (the core's clock) and ``wall`` (seconds since the
    epoch: recovery subtracts the time the controller was down from the leases), reserving
    row ids up to ``reserved`` (at least its rows'; see `row_reservation`)."""
    leases = [_lease_record(lease, now) for lease in p.leases.values()]
    return PartitionRecord(
        rows=RowsRecord.of(p),
        incarnation=p.incarnation,
        wall=wall,
        leases=leases,
        lease_batch=[(i, t, d, b) for i, (t, d, b) in p.lease_batch.items()],
        settled=sorted(p.settled),
        puts=[(put.put_id, list(put.rows)) for put in p.put_leases.values()],
        dropped=dict(p.dropped),
        lost=list(p.lost.items()),
        reserved=max(reserved, row_reservation(p, 0)),
    )


def row_reservation(p: Partition, added: int) -> int:
    """The row ids a record of ``p`` reserves: those below may be handed out before the next
    record is written (a put's placement is answered before its commit when its rows are
    reserved by a record on disk, `tq_async._controller._journal`). A controller recovering
    the record skips to it (`skip_reserved`), so a placement it answered but never wrote is
    never given to another put: a late write of that put cannot overwrite another's cells.

    While puts are open, or rows were added lately (``added``: by this record or the one
    before, `Tracker.record`; a producer that puts one batch at a time has none open when its
    commit is written), twice the rows added (what the next commit's wait will see placed),
    at least `RESERVE_MIN`; a partition idle for two records reserves nothing ahead, so
    recovering it skips nothing."""
    if not (p.put_leases or added):
        return p.n_rows
    return p.n_rows + max(RESERVE_MIN, 2 * added)


def controller_record(
    core: ControllerCore,
    instances: Mapping[int, str],
    wall: float,
    auto_clear_start: Mapping[str | None, Sequence[str]] | None = None,
    sampler_state: dict[str, Any] | None = None,
) -> ControllerRecord:
    """Record the controller's own state (``instances``: the remote units' tokens;
    ``auto_clear_start``: the auto-clear settings it started with; ``sampler_state``: the
    samplers' states by name, else each one's ``state_dict()``)."""
    st = core.state
    if sampler_state is None:
        sampler_state = {name: smp.state_dict() for name, smp in named_samplers(core)}
    return ControllerRecord(
        format=FORMAT,
        wall=wall,
        next_id=next(core._ids),
        units=dict(st.units),
        instances=dict(instances),
        dead_units=sorted(st.dead_units),
        learner_version=st.learner_version,
        outstanding=st.outstanding,
        auto_clear=[(pid, list(tasks)) for pid, tasks in st.auto_clear.items()],
        sampler_state=sampler_state,
        admitted=dict(st.admitted),
        recycled=st.recycled.encoded(),
        stale_counts=dict(st.stale_counts),
        auto_clear_start=None
        if auto_clear_start is None
        else [(pid, list(tasks)) for pid, tasks in auto_clear_start.items()],
        unit_hosts=dict(st.unit_hosts),
        dp_ends=[(*end, sorted(ranks)) for end, ranks in st.dp_ends.items()],
        taken=dict(st.taken),
        holders=list(st.holders.items()),
        leased=list(st.slot_leases),
    )


def named_samplers(core: ControllerCore) -> list[tuple[str, Any]]:
    """The samplers under the names their states have in a record (``"default"``,
    ``"task:<name>"``)."""
    return [("default", core.sampler)] + [
        (f"task:{t}", smp) for t, smp in core.task_samplers.items()
    ]


def recover(
    core: ControllerCore,
    ctl: ControllerRecord,
    parts: Sequence[PartitionRecord],
    now: float,
    wall: float,
    local_units: Mapping[int, str],
    follow: Callable[[Partition], None] | None = None,
) -> Effects:
    """Rebuild ``core`` (a new, empty one) from its records.

    Args:
        core: the controller's core, with no partitions yet.
        ctl: the last controller record.
        parts: the last record of every partition.
        now: the core's clock now.
        wall: seconds since the epoch now (the leases lose the time the controller was down).
        local_units: the storage units of this process (their cells died with the old one:
            what they held is lost); every other recorded unit is suspended until it comes
            back with its data or is declared lost.
        follow: called with every partition once it is rebuilt as its record says, before
            the transitions of recovery change it (a `Tracker` follows it from there).
    """
    st = core.state
    # a placement answered before its commit (`row_reservation`) carries a put id the last
    # record may not count: ids go on far past it, never given twice
    _restart_ids(core, ctl.next_id + ID_GAP)
    st.learner_version, st.outstanding = ctl.learner_version, ctl.outstanding
    st.admitted = dict(ctl.admitted)
    st.holders = dict(ctl.holders)
    core.rollouts.recovered(ctl.leased, now)
    st.recycled.load(ctl.recycled)
    st.taken = dict(ctl.taken)
    st.stale_counts.update(ctl.stale_counts)
    st.dp_ends = {(pid, inc, task, i): set(ranks) for pid, inc, task, i, ranks in ctl.dp_ends}
    _recover_auto_clear(st.auto_clear, ctl)
    for rec in parts:
        p = _recover_partition(core, skip_reserved(rec), now, wall)
        core.catalog.hold_recycled(p)
        if follow is not None:
            follow(p)
    fx = core.abort_puts([put_id for rec in parts for put_id, _ in rec.puts])
    load_states(
        named_samplers(core),
        ctl.sampler_state,
        "the controller's journal",
        "start the controller with the samplers that wrote it (or make load_state_dict read "
        "that state), or move the data_dir away to start an empty controller",
    )
    for unit, address in ctl.units.items():
        if unit in local_units or unit in ctl.dead_units:
            continue
        st.units[unit] = address
        st.unit_hosts.setdefault(unit, ctl.unit_hosts.get(unit, ""))
        fx.add(core.unit_down(unit, now, recovered=True))
    for unit in ctl.dead_units:
        st.units.setdefault(unit, ctl.units[unit])
        fx.add(core.unit_lost(unit))
    for unit, address in local_units.items():
        if unit in ctl.units and unit not in ctl.dead_units:
            st.units[unit] = ctl.units[unit]
            fx.add(core.unit_registered(unit, address))  # its rows died with the old process
    fx.add(core.advance(now))  # leases whose time ran out while the controller was down
    return fx


def _recover_auto_clear(settings: dict[str | None, tuple[str, ...]], ctl: ControllerRecord) -> None:
    """Merge the recorded auto-clear settings into ``settings`` (the configuration's, at this
    start): one that ``register_tasks`` changed since the recorded controller started is kept
    (or stays off); the others follow the configuration, which may have changed since."""
    recorded = {pid: tuple(tasks) for pid, tasks in ctl.auto_clear}
    if ctl.auto_clear_start is None:  # a record of an older version: the configuration wins
        for pid, tasks in recorded.items():
            settings.setdefault(pid, tasks)
        return
    start = {pid: tuple(tasks) for pid, tasks in ctl.auto_clear_start}
    for pid in recorded.keys() | start.keys():
        if recorded.get(pid) == start.get(pid):
            continue  # not changed at run time
        if pid in recorded:
            settings[pid] = recorded[pid]
        else:
            settings.pop(pid, None)


def _restart_ids(core: ControllerCore, next_id: int) -> None:
    """Lease and put ids go on from ``next_id`` (the core and its parts share the counter)."""
    ids = itertools.count(next_id)
    core._ids = core.puts._ids = core.leases._ids = ids


def _recover_partition(
    core: ControllerCore, rec: PartitionRecord, now: float, wall: float
) -> Partition:
    st = core.state
    dump = rec.rows.dump()
    p = st.bind(restore_partition(dump, dump.units))
    p.incarnation = rec.incarnation
    p.settled = {tuple(k) for k in rec.settled}  # type: ignore[misc]
    p.dropped = dict(rec.dropped)
    p.lost = dict(rec.lost)
    st.partitions[p.partition_id] = p
    down = max(0.0, wall - rec.wall)
    for lr in rec.leases:
        deadline = None if lr.left is None else now + max(0.0, lr.left - down)
        core.leases.adopt(p, Lease(lr.lease_id, lr.task, tuple(lr.rows), lr.key, deadline))
    for lease_id, t, d, b in rec.lease_batch:
        p.lease_batch[lease_id] = (t, d, b)
        core.leases.batch_home[lease_id] = p
    core.leases.hold_waiting(p)
    for put_id, rows in rec.puts:
        p.put_leases[put_id] = PutLease(put_id, rows, now)
        core.puts.home[put_id] = p
    return p
