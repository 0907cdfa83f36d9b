"""What a partition forgets of its history once the arrays dropped cleared rows
(`tq_async._core._arrays.compact`): recorded batches whose rows are all gone, and the
per-row state of tasks that hold nothing.

**Recorded batches**, forgotten, their indexes kept as ranges.

A partition keeps every recorded batch ``(task, dp_rank, batch_index)`` so that a replay gets
the same rows. Once every row of a batch is cleared and dropped from the per-row arrays
(`tq_async._core._arrays.compact`) and no lease or hold of it is open, a replay finds none
of its rows: it answers no rows. `forget_cleared` then drops the batch (its settled key
and the ids of its past leases with it) and keeps only that its index was decided, as one
range ``[lo, hi)`` of indexes per ``(task, dp_rank)``: a late replay of a forgotten index
still answers no rows, never a fresh sample. A batch extends the range only where it
touches it (indexes are decided in order, `record_from` keeps them a gap-free prefix): one
that does not stays recorded, as before.

**Tasks that hold nothing**: a task of ``p`` none of whose consumed rows is alive, with no
ready row, no recorded batch and no lease or hold, loses its consumption array and its ready
sets (`forget_idle_tasks`): each put extended every task's array and each commit walked
every ready set, for every task name the partition ever saw. It reads on as a task that
never read (its arrays of zeros and empty ready sets are made again on its next read).

A partition ``p`` is untyped here: the state module imports this one.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "dump_forgotten",
    "forget_cleared",
    "forget_idle_tasks",
    "is_forgotten",
    "load_forgotten",
]

#: ``(task, dp_rank)`` -> the batch indexes ``[lo, hi)`` decided and forgotten
Forgotten = dict[tuple[str, int], tuple[int, int]]


def is_forgotten(p: Any, key: tuple[str, int, int]) -> bool:
    """Whether the recorded batch ``key`` of ``p`` was decided and forgotten."""
    span = p.forgotten.get(key[:2]) if p.forgotten else None
    return span is not None and span[0] <= key[2] < span[1]


def forget_cleared(p: Any) -> None:
    """Forget the recorded batches of ``p`` whose rows are all below ``p.base`` (cleared and
    dropped) and that no lease or hold waits on, where they extend their rank's range. The
    containers are replaced, not changed: the journal then writes a snapshot."""
    base, leased, held = p.base, p.batch_leases, p.batch_holds
    gone: dict[tuple[str, int], set[int]] = {}
    for key, rows in p.recorded.items():
        if (not rows or max(rows) < base) and key not in leased and key not in held:
            gone.setdefault(key[:2], set()).add(key[2])
    drop: set[tuple[str, int, int]] = set()
    for rank, indexes in gone.items():
        lo, hi = p.forgotten.get(rank) or (min(indexes), min(indexes))
        while hi in indexes:
            hi += 1
        while lo - 1 in indexes:
            lo -= 1
        if lo < hi:
            p.forgotten[rank] = (lo, hi)
            drop.update((*rank, i) for i in indexes if lo <= i < hi)
    if not drop:
        return
    p.recorded = {k: rows for k, rows in p.recorded.items() if k not in drop}
    p.settled = {k for k in p.settled if k not in drop}
    p.lease_batch = {i: k for i, k in p.lease_batch.items() if k not in drop}


def forget_idle_tasks(p: Any) -> None:
    """Drop the consumption arrays and ready sets of the tasks of ``p`` that hold nothing
    (see the module docstring); the journal then writes a snapshot."""
    busy = {key[0] for key in p.recorded} | {lease.task for lease in p.leases.values()}
    busy.update(t for (t, _), rs in p.ready.items() if len(rs.rows))
    idle = {t for t, n in p.consumed_count.items() if not n and t not in busy}
    if not idle:
        return
    for t in idle:
        del p.consumed[t], p.consumed_count[t]
        p.recorded_rows.pop(t, None)
    p.ready = {k: rs for k, rs in p.ready.items() if k[0] not in idle}
    if p.changes is not None:
        p.changes.whole = True


def dump_forgotten(p: Any) -> list[tuple[str, int, int, int]]:
    """``p``'s forgotten ranges as a checkpoint keeps them: ``(task, dp_rank, lo, hi)``."""
    return [(t, d, lo, hi) for (t, d), (lo, hi) in p.forgotten.items()]


def load_forgotten(spans: list[tuple[str, int, int, int]]) -> Forgotten:
    """The forgotten ranges a checkpoint kept (`dump_forgotten`)."""
    return {(t, d): (lo, hi) for t, d, lo, hi in spans}
