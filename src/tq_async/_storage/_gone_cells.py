"""Which cells of a storage unit's index were lost with a segment, not merely dead in it.

A unit deletes a segment once every cell in it died (cleared, overwritten, its partition's
incarnation replaced), while the index records naming those cells stay until the index is
rewritten. So a restart that finds a record naming a deleted segment follows the later
records: only the cells none of them cleared or overwrote were lost (a segment deleted by
hand); the rest died before their segment went, and are no news.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .._wire._columns import ColumnHeader

__all__ = ["GoneCells"]


class ChunkRecord(Protocol):
    """What is read of a `tq_async._storage._segments.ChunkRecord`."""

    @property
    def header(self) -> ColumnHeader: ...

    @property
    def rows(self) -> bytes: ...


class GoneCells:
    """The cells of chunks whose segment is gone, by partition, as ``(field, row)``, forgotten
    as later records clear or overwrite them."""

    def __init__(self) -> None:
        self.cells: dict[str, set[tuple[str, int]]] = {}
        self.incarnations: dict[str, str | None] = {}

    def cleared(self, partition: str, rows: list[int] | None) -> None:
        """A clear of ``rows`` (None: all) of ``partition``."""
        held = self.cells.get(partition)
        if held is None:
            return
        if rows is None:
            del self.cells[partition]
        else:
            cleared = set(rows)
            self.cells[partition] = {c for c in held if c[1] not in cleared}

    def put(
        self,
        partition: str,
        incarnation: str | None,
        chunks: Sequence[ChunkRecord],
        whole: Sequence[ChunkRecord],
    ) -> None:
        """A put of ``chunks``, of which ``whole`` have their bytes (the others' are gone)."""
        held = self.cells.get(partition)
        if held is not None:
            if incarnation is not None and incarnation != self.incarnations[partition]:
                del self.cells[partition]  # a new incarnation: the partition's old cells died
            else:
                for c in whole:
                    held.difference_update((c.header.name, r) for r in _rows(c))
        if len(whole) < len(chunks):
            kept = {id(c) for c in whole}
            held = self.cells.setdefault(partition, set())
            self.incarnations[partition] = incarnation
            for c in chunks:
                if id(c) not in kept:
                    held.update((c.header.name, r) for r in _rows(c))

    def count(self) -> int:
        """The cells lost so far."""
        return sum(len(cells) for cells in self.cells.values())


def _rows(chunk: ChunkRecord) -> list[int]:
    """The live rows a chunk record names (``-1``: a dead position of a rewritten index)."""
    return [r for r in memoryview(chunk.rows).cast("q") if r >= 0]
