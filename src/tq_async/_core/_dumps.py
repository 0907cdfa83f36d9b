"""A partition in the form a checkpoint keeps it, and back: pure functions over the state.

`partition_dump` is what ``save_checkpoint`` writes of a partition (everything but the
cells, as plain msgpack-able values); `restore_partition` rebuilds a partition from one,
its rows placed where the caller says (a checkpoint loaded into a cluster of other units,
or a durable controller's journal, whose records hold the same form: `dump_rows`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, TypeVar

import numpy as np

from .._errors import InvalidRequestError
from .._wire._protocol import FieldDump, PartitionDump
from ._forgotten import dump_forgotten, load_forgotten
from ._state import ControllerState, FieldState, Partition
from ._versions import PolicyVersions

__all__ = ["dump_rows", "partition_dump", "restore_partition"]

T = TypeVar("T")


def partition_dump(p: Partition, st: ControllerState | None = None) -> PartitionDump:
    """Everything of ``p`` but the cells, as plain msgpack-able values, with what the
    controller's state ``st`` owes its readers (DP ends of stream, recycled rows).

    A dump holds no leases: the rows of an open lease outside a recorded batch are not
    consumed in it, as its expiry would leave them (nobody can acknowledge it after a
    restore); a recorded batch keeps its rows, for its next reader."""
    pid, inc = p.partition_id, p.incarnation
    ends = [] if st is None else st.dp_ends.items()
    recycled: Iterable[tuple[str, str, int]] = () if st is None else st.recycled
    make = partial(
        PartitionDump,
        settled=sorted(p.settled),
        dp_ends=[(e[2], e[3], sorted(ranks)) for e, ranks in ends if e[:2] == (pid, inc)],
        recycled=[
            r
            for i, e, r in recycled
            if (i, e) == (pid, inc) and r >= p.base and p.alive[r - p.base]
        ],
        lost=sorted(p.lost.items()),
        dropped=dict(p.dropped),
    )
    dump = dump_rows(p, make, array.tolist)
    given_back: dict[str, bytearray] = {}
    for lease in p.leases.values():
        if lease.key is None and lease.deadline is not None:
            mask = given_back.get(lease.task)
            if mask is None:
                mask = given_back[lease.task] = bytearray(dump.consumed[lease.task])
            for r in lease.rows:
                if r >= p.base:
                    mask[r - p.base] = 0
    dump.consumed.update((task, bytes(mask)) for task, mask in given_back.items())
    return dump


def dump_rows(p: Partition, make: Callable[..., T], ints: Callable[[array[int]], Any]) -> T:
    """The fields of ``p``'s checkpoint dump (`PartitionDump`'s), handed to ``make``; its
    per-row integer arrays as ``ints`` makes them: ``array.tolist`` for a checkpoint,
    ``array.tobytes`` for the journal's records (`tq_async._core._journal.RowsRecord`)."""
    return make(
        partition_id=p.partition_id,
        n_rows=p.n_rows,
        base=p.base,
        alive=bytes(p.alive),
        origin=ints(p.origin),
        units=ints(p.units),
        tags=list(p.tags),
        row_keys=list(p.row_keys),
        sealed=p.sealed,
        fields=[FieldDump(f.header, bytes(f.produced)) for f in p.fields.values()],
        consumed={t: bytes(c) for t, c in p.consumed.items()},
        deliveries=[(t, d, b, list(rows)) for (t, d, b), rows in p.recorded.items()],
        row_version=ints(p.versions.rows),
        field_versions={f: ints(v) for f, v in p.versions.fields.items()},
        forgotten=dump_forgotten(p),
    )


def restore_partition(dump: PartitionDump, units: Sequence[int]) -> Partition:
    """A partition rebuilt from ``dump``, its rows placed on ``units`` (one per row the
    dump holds: from its ``base`` on).

    Raises:
        InvalidRequestError: the dump's per-row arrays disagree on the number of rows.
    """
    n, base = dump.n_rows - dump.base, dump.base
    arrays = [dump.alive, dump.origin, dump.tags, dump.row_keys, units]
    arrays += [f.produced for f in dump.fields] + list(dump.consumed.values())
    if any(len(a) != n for a in arrays) or not 0 <= base <= dump.n_rows:
        raise InvalidRequestError(
            f"checkpoint of partition {dump.partition_id!r} is inconsistent: per-row arrays "
            f"do not all have {n} rows"
        )
    p = Partition(dump.partition_id)
    p.n_rows, p.base = dump.n_rows, base
    p.alive = bytearray(dump.alive)
    alive = np.frombuffer(dump.alive, np.uint8)  # (numpy: a recovering controller's 1M rows)
    p.n_alive = int(alive.sum(dtype=np.int64))
    p.origin = array("q", dump.origin)
    p.units = array("i", units)
    placed, counts = np.unique(np.frombuffer(p.units, np.intc)[alive != 0], return_counts=True)
    p.unit_rows = dict(zip(placed.tolist(), counts.tolist(), strict=True))
    p.tags = [None if t is None else dict(t) for t in dump.tags]  # ({}: tagged, kept)
    p.row_keys = list(dump.row_keys)
    p.keys = {k: r + base for r, k in enumerate(dump.row_keys) if k is not None and p.alive[r]}
    p.sealed = dump.sealed
    for fd in dump.fields:
        p.fields[fd.header.name] = FieldState(fd.header, 0)
        p.fields[fd.header.name].produced = bytearray(fd.produced)
    for task, mask in dump.consumed.items():
        p.consumed[task] = bytearray(mask)
        both = np.bitwise_and(np.frombuffer(mask, np.uint8), alive)
        p.consumed_count[task] = int(both.sum(dtype=np.int64))
    p.recorded = {(t, d, b): tuple(rows) for t, d, b, rows in dump.deliveries}
    for (t, _, _), rows in p.recorded.items():
        p.mark_recorded(t, [r for r in rows if r >= base])
    p.settled = {(t, d, b) for t, d, b in dump.settled if (t, d, b) in p.recorded}
    p.forgotten = load_forgotten(dump.forgotten)
    p.versions = PolicyVersions.restore(n, dump.row_version, dump.field_versions)
    p.lost = {
        r: unit
        for r, unit in dump.lost
        if 0 <= r < dump.n_rows and (r < base or not p.alive[r - base])
    }
    p.dropped = dict(dump.dropped)
    return p
