"""Ready sets: per ``(task, fields)``, the rows a task can be given now, in readiness order.

A ready set (`ReadySet`, array-backed `ReadyRows`) is built once on first use
(one numpy scan, `ready_mask`) and then kept up to date by its
`Partition` on every commit, consume, release and clear, so
sampling never rescans the partition. Samplers see it through a read-only
`ReadyView`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

__all__ = ["FieldsKey", "ReadyRows", "ReadySet", "ReadyView", "ready_mask"]

FieldsKey = tuple[str, ...]

#: positions in a ready set's order: a partition holds fewer than 2**31 rows at a time
_ROW = np.int32
#: row ids: a partition that lives long enough has more than 2**31 rows over its life
_ID = np.int64


class ReadyRows:
    """Rows in the order they became ready, array-backed (numpy): the ready set's ``rows``.

    It behaves like the insertion-ordered ``dict[int, None]`` it replaces (``row in rows``,
    ``len``, iteration in readiness order, ``rows[row] = None`` appends a row that is not
    there yet), but a ready set of a million rows is built from one numpy mask instead of a
    Python loop: measured on our 2-vCPU box, ``dict.fromkeys`` over 1M rows took 59-77 ms and
    the ``tolist`` feeding it 28-35 ms, where the mask takes 2-7 ms.

    Layout: ``_order[_head:_tail]`` lists rows in readiness order, including dead entries;
    ``_pos[row]`` is the index of the row's live entry in ``_order`` (-1: not ready). An entry
    ``i`` is live iff ``_pos[_order[i]] == i``, so removing a row is O(1) and re-adding it
    appends a new entry (what a dict does). Dead entries are skipped when iterating and
    compacted away once they outnumber live ones (amortised O(1), see ReadySet.discard).
    ``_pos`` starts at row ``_base`` (its partition's first row held, `rebase`): it is
    ``_pos[row - _base]`` that is written ``_pos[row]`` here.

    ``_ov`` and ``_pv`` are memoryviews of ``_order`` and ``_pos``, replaced with them: one
    element read or written through a memoryview costs a third of numpy's (a get_meta
    consumes a batch row by row).
    """

    __slots__ = ("_base", "_dead", "_head", "_len", "_order", "_ov", "_pos", "_pv", "_tail")

    def __init__(self, rows: Any = ()) -> None:
        order = np.array(rows, dtype=_ID).ravel()
        n = len(order)
        self._order = np.empty(max(n + n // 4, 64), dtype=_ID)
        self._order[:n] = order
        self._pos = np.full(max(int(order.max()) + 1 if n else 0, 64), -1, dtype=_ROW)
        self._pos[order] = np.arange(n, dtype=_ROW)
        self._ov, self._pv = self._order.data, self._pos.data
        self._head = 0
        self._tail = self._len = n
        self._dead = 0
        self._base = 0

    @classmethod
    def from_mask(cls, mask: np.ndarray[Any, Any], base: int = 0) -> ReadyRows:
        """The rows where ``mask`` (bool, indexed by row - ``base``) is set, in row order.

        Built without a scatter: fresh memory page-faults at ~1.7 GB/s on the machines we
        measured, so the arrays are sized to the rows (1M rows: ~10 ms), the positions int32.
        """
        self = cls()
        order = np.flatnonzero(mask).astype(_ID)
        if base:
            order += base
        n = len(order)
        self._order = np.empty(max(n + n // 4, 64), dtype=_ID)
        self._order[:n] = order
        pos = np.cumsum(mask, dtype=_ROW)
        pos -= 1
        pos[~mask] = -1
        if len(pos) < 64:
            pos = np.concatenate([pos, np.full(64 - len(pos), -1, dtype=_ROW)])
        self._pos = pos
        self._ov, self._pv = self._order.data, pos.data
        self._tail = self._len = n
        self._base = base
        return self

    def rebase(self, base: int) -> None:
        """Rows below ``base`` are gone for good (none is ready): drop their slots."""
        shift = base - self._base
        if shift <= 0:
            return
        rest = self._pos[shift:]
        self._pos = rest.copy() if len(rest) >= 64 else np.full(64, -1, dtype=_ROW)
        if len(rest) < 64:
            self._pos[: len(rest)] = rest
        self._pv = self._pos.data
        self._base = base

    def __len__(self) -> int:
        return self._len

    def __contains__(self, row: object) -> bool:
        if not isinstance(row, int):
            return False
        i = row - self._base
        return 0 <= i < len(self._pv) and self._pv[i] >= 0

    def __setitem__(self, row: int, _value: None) -> None:
        pos, i = self._pos, row - self._base
        if i >= len(pos):
            grown = np.full(max(2 * len(pos), i + 1), -1, dtype=_ROW)
            grown[: len(pos)] = pos
            self._pos = pos = grown
            self._pv = grown.data
        elif pos.item(i) >= 0:
            return  # already ready: keeps its place, as in a dict
        if self._tail == len(self._order):
            self._compact(grow=True)
        self._order[self._tail] = row
        pos[i] = self._tail
        self._tail += 1
        self._len += 1

    def pop(self, row: int, default: Any = None) -> Any:
        """Remove ``row``; None if it was there, else ``default`` (``dict.pop``'s contract)."""
        pos, row = self._pos, row - self._base
        if row < 0 or row >= len(pos):
            return default
        i = pos.item(row)
        if i < 0:
            return default
        pos[row] = -1
        self._len -= 1
        self._dead += 1
        if i == self._head:  # keep the front live, so prefix reads start at once
            order, tail, head = self._order, self._tail, i + 1
            base = self._base
            while head < tail and pos.item(order.item(head) - base) != head:
                head += 1
            self._dead -= head - i
            self._head = head
        if self._dead > self._len + 1024:
            self._compact(grow=False)
        return None

    def pop_all(self, rows: Sequence[int]) -> None:
        """`pop` each of ``rows`` (the same steps, in one call: a get_meta consumes a batch)."""
        pv, base = self._pv, self._base
        n = len(pv)  # (only adding a row grows it)
        for row in rows:
            row -= base
            if row < 0 or row >= n:
                continue
            i = pv[row]
            if i < 0:
                continue
            pv[row] = -1
            self._len -= 1
            self._dead += 1
            if i == self._head:  # keep the front live (see pop)
                ov, tail, head = self._ov, self._tail, i + 1
                while head < tail and pv[ov[head] - base] != head:
                    head += 1
                self._dead -= head - i
                self._head = head
            if self._dead > self._len + 1024:
                self._compact(grow=False)

    def _compact(self, *, grow: bool) -> None:
        live = self._live_block(self._head, self._tail)
        n = len(live)
        cap = max(2 * n, 64) if grow or len(self._order) > 4 * max(n, 16) else len(self._order)
        if cap < n + 1:
            cap = 2 * n + 64
        order = np.empty(cap, dtype=_ID)
        order[:n] = live
        self._order = order
        self._ov = order.data
        self._pos[live - self._base] = np.arange(n, dtype=_ROW)
        self._head, self._tail, self._dead = 0, n, 0

    def _live_block(self, a: int, b: int) -> np.ndarray[Any, Any]:
        block = self._order[a:b]
        at = self._pos[block - self._base] if self._base else self._pos[block]
        live: np.ndarray[Any, Any] = block[at == np.arange(a, b, dtype=_ROW)]
        return live

    @property
    def dead(self) -> int:
        """Dead entries still in the order array (compacted once they outnumber live ones)."""
        return self._dead

    def __iter__(self) -> Iterator[int]:
        # blocks grow so that a prefix read (a sequential sampler's first k) stays O(k)
        i, step = self._head, 16
        while i < self._tail:
            j = min(i + step, self._tail)
            if self._dead:
                yield from self._live_block(i, j).tolist()
            else:  # no dead entry anywhere (consumed from the front): no mask needed
                yield from self._order[i:j].tolist()
            i, step = j, min(step * 4, 1 << 16)

    def missing(self, rows: Sequence[int]) -> list[int]:
        """Of ``rows``, those not ready, in order (one call for a whole batch)."""
        pv, base = self._pv, self._base
        n = len(pv)  # (``r not in self``, without a method call per row)
        return [
            r for r in rows if not (isinstance(r, int) and 0 <= r - base < n and pv[r - base] >= 0)
        ]

    def to_list(self) -> list[int]:
        """Every ready row, in order."""
        result: list[int] = self._live_block(self._head, self._tail).tolist()
        return result

    def __repr__(self) -> str:
        return f"ReadyRows(len={self._len})"


@dataclass(slots=True)
class ReadySet:
    """Rows produced for every field in ``fields`` and not yet consumed by ``task``."""

    task: str
    fields: FieldsKey
    rows: ReadyRows = field(default_factory=lambda: ReadyRows())

    def discard(self, row: int) -> None:
        """Remove a row (if ready).

        Dead slots are compacted away once they outnumber live rows (inside
        `ReadyRows`): otherwise a sequential sampler's first-k read would skip every
        consumed slot (measured 5-6x slower get_meta once half of a 1M-row partition was
        consumed). Amortised O(1).
        """
        self.rows.pop(row, 0)

    def discard_all(self, rows: Sequence[int]) -> None:
        """Remove every row of ``rows`` that is ready (see `discard`)."""
        self.rows.pop_all(rows)

    @property
    def deleted(self) -> int:
        """Deletions not compacted away yet."""
        return self.rows.dead


class ReadyView(Sequence[int]):
    """A read-only, lazily materialised view of a ready set, given to samplers.

    ``len``, iteration and prefix slices (``view[:k]``) cost O(k); any other indexing builds a
    list once (O(n)) and reuses it for the rest of the call.
    """

    __slots__ = ("_list", "_rows")

    def __init__(self, rows: ReadyRows | Mapping[int, None] | Sequence[int]) -> None:
        self._rows = rows
        self._list: list[int] | None = list(rows) if isinstance(rows, list) else None

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[int]:
        return iter(self._list if self._list is not None else self._rows)

    def __contains__(self, row: object) -> bool:
        return row in self._rows

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if (
            isinstance(index, slice)
            and self._list is None
            and index.start in (None, 0)
            and index.step in (None, 1)
            and index.stop is not None
            and index.stop >= 0
        ):
            return list(itertools.islice(self._rows, index.stop))
        if self._list is None:
            rows = self._rows
            self._list = rows.to_list() if isinstance(rows, ReadyRows) else list(rows)
        return self._list[index]

    def __repr__(self) -> str:
        return f"ReadyView(len={len(self)})"


def ready_mask(
    alive: bytearray, consumed: bytearray, produced: Sequence[bytearray]
) -> np.ndarray[Any, Any]:
    """Which rows are alive, not consumed and produced for every field (one vectorised scan).

    The numpy views of the bytearrays die with this call: a live export would stop them
    from growing.
    """
    mask = np.frombuffer(alive, dtype=np.bool_) & ~np.frombuffer(consumed, dtype=np.bool_)
    for p in produced:
        mask &= np.frombuffer(p, dtype=np.bool_)
    return mask
