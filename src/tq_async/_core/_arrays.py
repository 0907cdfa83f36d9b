"""A partition's per-row arrays taken whole: dropping their cleared front, scans of the live
rows, masks, and the arrays as raw bytes (the journal's records).

The arrays hold the rows from the partition's ``base`` on (row ``r`` at index ``r - base``,
see `tq_async._core._state`); what here takes or answers rows takes or answers their ids.
A partition ``p`` is untyped here: the state module imports this one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._forgotten import forget_cleared, forget_idle_tasks

__all__ = [
    "COMPACT_ROWS",
    "KV_CHUNK_BITS",
    "compact",
    "consumption_mask",
    "fill",
    "live_rows",
    "live_rows_by_unit",
    "production_mask",
    "put_items",
    "rows_on",
    "take",
]

#: the fewest cleared rows at the front of a partition's arrays that `compact` drops
COMPACT_ROWS = 1 << 16
#: ``kv_list``'s cache re-encodes rows in chunks of ``1 << KV_CHUNK_BITS`` (see ``kv_dirty``)
KV_CHUNK_BITS = 12


def compact(p: Any) -> None:
    """Drop the cleared rows at the front of ``p``'s per-row arrays once they are at least
    `COMPACT_ROWS` and at least as many as the rows after them (each row is moved O(1)
    times, amortised); ``p.base`` moves past them. Rows are allocated in order and mostly
    cleared in order, so the arrays follow the live rows, not every row ``p`` ever had;
    nor do its recorded batches (those whose rows are all dropped are forgotten:
    `tq_async._core._forgotten`)."""
    dead = p.alive.find(1, p.dead_front)
    p.dead_front = dead = len(p.alive) if dead < 0 else dead
    if dead < COMPACT_ROWS or 2 * dead < len(p.alive):
        return
    for buf in (p.alive, p.origin, p.units, p.tags, p.row_keys):
        del buf[:dead]
    for buf in (*(f.produced for f in p.fields.values()), *p.consumed.values()):
        del buf[:dead]
    for mask in p.recorded_rows.values():
        del mask[:dead]
    p.versions.drop(dead)
    p.base += dead
    p.dead_front = 0
    for rs in p.ready.values():
        rs.rows.rebase(p.base)
    if p.kv_dirty:  # chunks wholly below ``base``: nothing of them is left to list
        p.kv_dirty = {c for c in p.kv_dirty if c >= p.base >> KV_CHUNK_BITS}
    forget_cleared(p)
    forget_idle_tasks(p)


def rows_on(p: Any, unit: int) -> list[int]:
    """The live rows of ``p`` whose cells ``unit`` holds."""
    alive, units, base = p.alive, p.units, p.base
    return [i + base for i in range(len(alive)) if alive[i] and units[i] == unit]


def live_rows(p: Any) -> list[int]:
    """Every live row of ``p``, in order."""
    alive, base = p.alive, p.base
    return [i + base for i in range(len(alive)) if alive[i]]


def live_rows_by_unit(p: Any) -> dict[int, list[int]]:
    """The live rows of ``p`` by the unit that holds their cells."""
    by_unit: dict[int, list[int]] = {}
    alive, units, base = p.alive, p.units, p.base
    for i in range(len(alive)):
        if alive[i]:
            by_unit.setdefault(units[i], []).append(i + base)
    return by_unit


def production_mask(p: Any, name: str) -> bytes:
    """1 for each row of ``p`` (from row 0) alive with a cell of field ``name``."""
    f = p.fields.get(name)
    if f is None:
        return bytes(p.n_rows)
    return bytes(p.base) + bytes(a & b for a, b in zip(f.produced, p.alive, strict=True))


def consumption_mask(p: Any, task: str) -> bytes:
    """1 for each row of ``p`` (from row 0) that ``task`` consumed."""
    c = p.consumed.get(task)
    if c is None:
        return bytes(p.n_rows)
    return bytes(p.base) + bytes(c)


def take(buf: Any, dtype: np.dtype[Any], idx: np.ndarray[Any, Any]) -> bytes:
    """The items ``idx`` of the array ``buf`` (of ``dtype``), as bytes."""
    out: bytes = np.frombuffer(buf, dtype)[idx].tobytes()
    return out


def fill(value: int, n: int, size: int) -> bytes:
    """``n`` items of ``size`` bytes, each ``value`` (0 or -1), as bytes."""
    return b"\xff" * (n * size) if value == -1 else bytes(n * size)


def put_items(
    buf: bytearray,
    grow: int,
    drop: int,
    fill_value: int,
    dtype: np.dtype[Any],
    idx: np.ndarray[Any, Any],
    values: bytes | None,
) -> None:
    """Grow the array ``buf`` (raw bytes of ``dtype``) by ``grow`` items of ``fill_value``,
    drop its first ``drop`` items, then set the items ``idx`` to ``values`` (None: the array
    is new since, its items stay ``fill_value``)."""
    if grow:
        buf.extend(fill(fill_value, grow, dtype.itemsize))
    if drop:
        del buf[: drop * dtype.itemsize]
    if values is not None and len(idx):
        view = np.frombuffer(buf, dtype)
        view[idx] = np.frombuffer(values, dtype)
        del view
