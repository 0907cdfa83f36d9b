"""Recorded batches whose rows are all gone: forgotten, their indexes kept as ranges.

A partition keeps every recorded batch ``(task, dp_rank, batch_index)`` so that a replay gets
the same rows. Once every row of a batch is cleared and dropped from the per-row arrays
(`tq_async._core._arrays.compact`) and no lease or hold of it is open, a replay finds none
of its rows: it answers no rows. `forget_cleared` then drops the batch (its settled key
and the ids of its past leases with it) and keeps only that its index was decided, as one
range ``[lo, hi)`` of indexes per ``(task, dp_rank)``: a late replay of a forgotten index
still answers no rows, never a fresh sample. A batch extends the range only where it
touches it (indexes are decided in order, `record_from` keeps them a gap-free prefix): one
that does not stays recorded, as before. A partition ``p`` is untyped here: the state
module imports this one.
"""

from __future__ import annotations

from typing import Any

__all__ = ["dump_forgotten", "forget_cleared", "is_forgotten", "load_forgotten"]

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


def dump_forgotten(p: Any) -> list[tuple[str, int, int, int]]:
    """``p``'s forgotten ranges as a checkpoint keeps them: ``(task, dp_rank, lo, hi)``."""
    return [(t, d, lo, hi) for (t, d), (lo, hi) in p.forgotten.items()]


def load_forgotten(spans: list[tuple[str, int, int, int]]) -> Forgotten:
    """The forgotten ranges a checkpoint kept (`dump_forgotten`)."""
    return {(t, d): (lo, hi) for t, d, lo, hi in spans}
