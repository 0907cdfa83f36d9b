"""The controller's journal records: what a durable controller writes, and how it recovers.

Pure: no files, no clock. The I/O shell (`tq_async._controller._journal`) writes one
`PartitionRecord` per partition a request changed and one `ControllerRecord`
per group commit, and hands them back to `recover` when a controller starts on the
same ``data_dir``.

A partition's record is its checkpoint dump (the format ``save_checkpoint`` uses, with the
per-row integer arrays as bytes: `RowsRecord`) plus what a checkpoint leaves out
because a restore starts afresh: the incarnation (old ``BatchMeta`` objects stay valid), the
leases with the seconds they had left, the recorded batches' settled keys and past lease ids
(a late ack still settles), and the uncommitted put leases. Recovery rebuilds partitions
with `Partition.restore` (the checkpoint's own code) and gives leases back through
`adopt` (the code that gives new ones); uncommitted
puts are aborted through `ControllerCore.abort_puts`, expired leases expire through
`ControllerCore.advance`, storage units that served rows are suspended until they come
back with their data (`ControllerCore.unit_down`). Nothing decides twice: every
transition after recovery is the core's.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from .._wire._protocol import FieldDump, PartitionDump
from ._effects import Effects
from ._state import Lease, Partition, PutLease
from ._transitions import ControllerCore

__all__ = [
    "FORMAT",
    "ControllerRecord",
    "LeaseRecord",
    "PartitionRecord",
    "RowsRecord",
    "controller_record",
    "decode_controller",
    "decode_partition",
    "encode",
    "partition_record",
    "recover",
]

#: the journal's format version (a controller refuses a data_dir of another)
FORMAT = 1


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

    @classmethod
    def of(cls, p: Partition) -> RowsRecord:
        return cls(
            partition_id=p.partition_id,
            n_rows=p.n_rows,
            alive=bytes(p.alive),
            origin=p.origin.tobytes(),
            units=p.units.tobytes(),
            tags=list(p.tags),
            row_keys=list(p.row_keys),
            sealed=p.sealed,
            fields=[FieldDump(f.header, bytes(f.produced)) for f in p.fields.values()],
            consumed={t: bytes(c) for t, c in p.consumed.items()},
            deliveries=[(t, d, b, list(rows)) for (t, d, b), rows in p.recorded.items()],
            row_version=p.row_version.tobytes(),
            field_versions={f: v.tobytes() for f, v in p.field_versions.items()},
        )

    def dump(self) -> PartitionDump:
        """The checkpoint format, which `Partition.restore` reads."""
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


class ControllerRecord(msgspec.Struct, array_like=True):
    """The controller's own state (units, admission, samplers), written with every commit."""

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


_encoder = msgspec.msgpack.Encoder()
_partition_decoder = msgspec.msgpack.Decoder(PartitionRecord)
_controller_decoder = msgspec.msgpack.Decoder(ControllerRecord)


def encode(record: PartitionRecord | ControllerRecord) -> bytes:
    return _encoder.encode(record)


def decode_partition(blob: bytes) -> PartitionRecord:
    return _partition_decoder.decode(blob)


def decode_controller(blob: bytes) -> ControllerRecord:
    return _controller_decoder.decode(blob)


def partition_record(p: Partition, now: float, wall: float) -> PartitionRecord:
    """Record ``p`` as it is at ``now`` (the core's clock) and ``wall`` (seconds since the
    epoch: recovery subtracts the time the controller was down from the leases)."""
    leases = [
        LeaseRecord(
            lease.lease_id,
            lease.task,
            list(lease.rows),
            lease.key,
            None if lease.deadline is None else lease.deadline - now,
        )
        for lease in p.leases.values()
    ]
    return PartitionRecord(
        rows=RowsRecord.of(p),
        incarnation=p.incarnation,
        wall=wall,
        leases=leases,
        lease_batch=[(i, t, d, b) for i, (t, d, b) in p.lease_batch.items()],
        settled=sorted(p.settled),
        puts=[(put.put_id, list(put.rows)) for put in p.put_leases.values()],
        dropped=dict(p.dropped),
    )


def controller_record(
    core: ControllerCore, instances: Mapping[int, str], wall: float
) -> ControllerRecord:
    """Record the controller's own state (``instances``: the remote units' tokens)."""
    st = core.state
    sampler_state = {"default": core.sampler.state_dict()}
    sampler_state |= {f"task:{t}": smp.state_dict() for t, smp in core.task_samplers.items()}
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
    )


def recover(
    core: ControllerCore,
    ctl: ControllerRecord,
    parts: Sequence[PartitionRecord],
    now: float,
    wall: float,
    local_units: Mapping[int, str],
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
    """
    st = core.state
    _restart_ids(core, ctl.next_id)
    st.learner_version, st.outstanding = ctl.learner_version, ctl.outstanding
    for pid, tasks in ctl.auto_clear:
        st.auto_clear.setdefault(pid, tuple(tasks))
    for rec in parts:
        _recover_partition(core, rec, now, wall)
    fx = core.abort_puts([put_id for rec in parts for put_id, _ in rec.puts])
    default, by_task = core.sampler, core.task_samplers
    default.load_state_dict(ctl.sampler_state.get("default", {}))
    for t, smp in by_task.items():
        smp.load_state_dict(ctl.sampler_state.get(f"task:{t}", {}))
    for unit, address in ctl.units.items():
        if unit in local_units or unit in ctl.dead_units:
            continue
        st.units[unit] = address
        fx.add(core.unit_down(unit, now))
    for unit in ctl.dead_units:
        st.units.setdefault(unit, ctl.units[unit])
        fx.add(core.unit_lost(unit))
    for unit, address in local_units.items():
        if unit in ctl.units and unit not in ctl.dead_units:
            st.units[unit] = ctl.units[unit]
            fx.add(core.unit_registered(unit, address))  # its rows died with the old process
    fx.add(core.advance(now))  # leases whose time ran out while the controller was down
    return fx


def _restart_ids(core: ControllerCore, next_id: int) -> None:
    """Lease and put ids go on from ``next_id`` (the core and its parts share the counter)."""
    ids = itertools.count(next_id)
    core._ids = core.puts._ids = core.leases._ids = ids


def _recover_partition(core: ControllerCore, rec: PartitionRecord, now: float, wall: float) -> None:
    st = core.state
    dump = rec.rows.dump()
    p = Partition.restore(dump, dump.units)
    p.incarnation = rec.incarnation
    p.unavailable = st.unavailable
    p.groups.limits = st.group_limits
    p.settled = {tuple(k) for k in rec.settled}  # type: ignore[misc]
    p.dropped = dict(rec.dropped)
    st.partitions[p.partition_id] = p
    down = max(0.0, wall - rec.wall)
    for lr in rec.leases:
        deadline = None if lr.left is None else now + max(0.0, lr.left - down)
        core.leases.adopt(p, Lease(lr.lease_id, lr.task, tuple(lr.rows), lr.key, deadline))
    for lease_id, t, d, b in rec.lease_batch:
        p.lease_batch[lease_id] = (t, d, b)
        core.leases.batch_home[lease_id] = p
    for put_id, rows in rec.puts:
        p.put_leases[put_id] = PutLease(put_id, rows, now)
        core.puts.home[put_id] = p
