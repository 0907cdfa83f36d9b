"""The cell index of a storage unit: which chunk holds each cell, and the chunks' lives.

A plain class with no I/O (`CellIndex`), tested alone. A put's columns become *chunks*
(`Chunk`: one column of one put, in memory, on a device, on disk); the index maps
``(partition, field, row)`` to a cell, ``chunk serial << CELL_BITS | position``. It counts
each chunk's live cells, the bytes held and in memory, the least recently used order of
chunks that may leave memory, and which partition incarnations are held or were cleared.

It decides; the unit (`tq_async._storage._cells.StorageState`) does the I/O: a chunk whose
last cell went is put on `CellIndex.dead`, and the unit releases what it holds (its arena
region, device region, disk extent) once the operation is decided.
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from .._core._gone import stale_incarnation
from .._errors import RowsNotFound
from .._paths._device import DeviceCells
from .._paths._shm import Region
from .._wire._columns import Column, ColumnHeader, column_nbytes
from ._segments import ClearRecord, Extent, PutRecord

__all__ = ["CELL_BITS", "POSITION", "CellIndex", "Chunk", "FieldUndo", "PutUndo"]

#: a cell is ``chunk serial << CELL_BITS | position in the chunk``
CELL_BITS = 32
POSITION = (1 << CELL_BITS) - 1
#: cleared incarnations remembered per unit (a late put into one of them is refused)
_RETIRED = 4096


class Chunk:
    """One column of one put: its cells in memory, in the device arena, or on disk only."""

    __slots__ = (
        "column",
        "device",
        "extent",
        "header",
        "live",
        "n",
        "nbytes",
        "region",
        "siblings",
    )

    def __init__(
        self,
        header: ColumnHeader,
        column: Column | DeviceCells | None,
        region: Region | None,
        device: Region | None = None,
        *,
        extent: Extent | None = None,
        n: int = 0,
    ) -> None:
        self.header = header
        #: the cells in memory (None: only on disk, at ``extent``)
        self.column = column
        self.n = n if column is None else len(column)
        self.live = self.n
        if column is None:
            assert extent is not None
            self.nbytes = extent.nbytes
        else:
            self.nbytes = (
                column.nbytes if isinstance(column, DeviceCells) else column_nbytes(column)
            )
        #: the arena region the column's views point into (None: message frames)
        self.region = region
        #: the device arena region the cells are in (``column`` is then DeviceCells)
        self.device = device
        #: where the cells are on disk (None: in memory only)
        self.extent = extent
        #: the chunks of its put whose columns are views of ``region`` too (this one with
        #: them; set where chunks may leave memory: see `StorageState.evict`)
        self.siblings: Sequence[Chunk] = ()


#: what a put overwrote in one field: the field, the put's chunk serial, the cells it
#: overwrote by row, and their chunks by serial (`CellIndex.store`, `CellIndex.unstore`)
FieldUndo = tuple[str, int, dict[int, int], dict[int, Chunk]]
#: a put to undo: its partition, rows and `FieldUndo` per field
PutUndo = tuple[str, Sequence[int], list[FieldUndo]]


def _hand_over(
    later: list[PutUndo],
    partition_id: str,
    name: str,
    row: int,
    cell: int,
    prev: int | None,
    owners: dict[int, Chunk],
) -> None:
    """The put of ``later`` that overwrote ``cell`` (of a put undone) puts back ``prev``
    (None: no cell) instead when it is undone in turn."""
    for pid, _, fields in later:
        if pid != partition_id:
            continue
        for field, _, old, theirs in fields:
            if field == name and old.get(row) == cell:
                if prev is None:
                    del old[row]
                else:
                    old[row] = prev
                    theirs[prev >> CELL_BITS] = owners[prev >> CELL_BITS]
                return


class CellIndex:
    """Where each cell of a unit is, and which chunks are alive (no I/O).

    Args:
        lru: keep the least recently used order of chunks in host memory (a unit with a
            ``memory_cap`` evicts by it).
    """

    def __init__(self, *, lru: bool = False) -> None:
        # partition -> field -> row -> cell: ``serial << 32 | position`` of the row in the
        # chunk ``chunks[serial]`` (a plain int: a tuple holding the chunk would be one more
        # object for the garbage collector to scan, per cell -- most of a 1M-row put)
        self.index: dict[str, dict[str, dict[int, int]]] = {}
        self.chunks: dict[int, Chunk] = {}
        self._serials = itertools.count(1)
        #: bytes of live chunks, and of those in host memory (the arena or message frames)
        self.resident_bytes = 0
        self.memory_bytes = 0
        #: chunks in host memory, least recently used first (only with ``lru``)
        self.lru: OrderedDict[int, Chunk] | None = OrderedDict() if lru else None
        #: chunks whose last cell went since the owner last freed them (regions, extents)
        self.dead: list[Chunk] = []
        #: the partition incarnation whose cells ``index[partition]`` holds (when known)
        self.incarnations: dict[str, str] = {}
        #: incarnations cleared (or replaced by a newer one) lately: their puts are refused
        self._retired: OrderedDict[tuple[str, str], None] = OrderedDict()

    # ---- incarnations ------------------------------------------------------------------------

    def check(self, partition_id: str, incarnation: str | None) -> None:
        """Raise `RowsNotFound` when ``incarnation`` (None: not checked) is not the one held."""
        if incarnation is None:
            return
        held = self.incarnations.get(partition_id)
        if held is not None and held != incarnation:
            raise RowsNotFound(stale_incarnation(partition_id))
        if (partition_id, incarnation) in self._retired:
            raise RowsNotFound(
                f"partition {partition_id!r} was cleared since this BatchMeta was made (its id "
                "may have been re-created since): its rows are gone; fetch a new BatchMeta"
            )

    def supersedes(self, partition_id: str, incarnation: str) -> bool:
        """Whether a put of ``incarnation`` finds cells of another one (to clear first).

        The controller creates a new incarnation only after clearing the old one, so cells
        of another incarnation belong to a cleared partition whose StoreClear is late.

        Raises:
            RowsNotFound: ``incarnation`` was cleared.
        """
        if (partition_id, incarnation) in self._retired:
            self.check(partition_id, incarnation)
        held = self.incarnations.get(partition_id)
        return held is not None and held != incarnation

    def _retire(self, partition_id: str, incarnation: str) -> None:
        self._retired[(partition_id, incarnation)] = None
        if len(self._retired) > _RETIRED:
            self._retired.popitem(last=False)

    # ---- chunks' lives -----------------------------------------------------------------------

    def add(self, chunk: Chunk) -> int:
        """Keep ``chunk``; its serial."""
        serial = next(self._serials)
        self._keep(serial, chunk)
        return serial

    def _keep(self, serial: int, chunk: Chunk) -> None:
        """Count ``chunk`` (``serial``) among the chunks held (and those in memory)."""
        self.chunks[serial] = chunk
        self.resident_bytes += chunk.nbytes
        if chunk.column is not None and chunk.device is None:
            self.memory_bytes += chunk.nbytes
            if self.lru is not None:
                self.lru[serial] = chunk

    def drop(self, serial: int) -> None:
        """One cell of chunk ``serial`` is gone (overwritten or cleared)."""
        chunk = self.chunks[serial]
        chunk.live -= 1
        if chunk.live == 0:
            del self.chunks[serial]
            self.resident_bytes -= chunk.nbytes
            if chunk.column is not None and chunk.device is None:
                self.memory_bytes -= chunk.nbytes
            if self.lru is not None:
                self.lru.pop(serial, None)
            self.dead.append(chunk)

    def store(
        self,
        partition_id: str,
        rows: Sequence[int],
        chunks: Sequence[Chunk],
        undo: list[FieldUndo] | None = None,
    ) -> None:
        """``chunks`` (one per field, of a put of ``rows``) take their rows' cells; cells
        overwritten release their old chunk. ``undo``: where to note, per field, what the
        put overwrote (`unstore` puts it back)."""
        n = len(rows)
        fields = self.index.setdefault(partition_id, {})
        chunks_by_serial = self.chunks
        for chunk in chunks:
            index = fields.setdefault(chunk.header.name, {})
            serial = self.add(chunk)
            # the index is updated in one C loop (a Python loop over a 1M-row put took most
            # of its time)
            overwritten = index.keys() & rows
            if undo is not None:
                old = {r: index[r] for r in overwritten}
                owners = {c >> CELL_BITS for c in old.values()}
                undo.append(
                    (chunk.header.name, serial, old, {s: chunks_by_serial[s] for s in owners})
                )
            for r in overwritten:
                self.drop(index[r] >> CELL_BITS)
            first = serial << CELL_BITS
            index.update(zip(rows, range(first, first + n), strict=True))

    def unstore(
        self, partition_id: str, rows: Sequence[int], undo: list[FieldUndo], later: list[PutUndo]
    ) -> None:
        """Undo a put of ``rows`` (`store` noted ``undo``): its cells still in place give way
        to the ones it overwrote (their chunks live again); a cell cleared since stays
        cleared; one overwritten since by a put of ``later`` (not undone) is that put's to
        undo: it then puts back what this one overwrote."""
        fields = self.index.get(partition_id)
        if fields is None:
            return  # cleared since
        for name, serial, old, owners in reversed(undo):
            index = fields.get(name)
            if index is None:
                continue
            first = serial << CELL_BITS
            for pos, r in enumerate(rows):
                cell = index.get(r)
                prev = old.get(r)
                if cell != first + pos:
                    if cell is not None:  # overwritten since
                        _hand_over(later, partition_id, name, r, first + pos, prev, owners)
                    continue
                if prev is None:
                    del index[r]
                else:
                    index[r] = prev
                    self._revive(prev >> CELL_BITS, owners[prev >> CELL_BITS])
                self.drop(serial)
            if not index:
                del fields[name]
        if not fields:
            del self.index[partition_id]

    def _revive(self, serial: int, chunk: Chunk) -> None:
        """One cell of ``chunk`` (``serial``) is back; a dead chunk lives again."""
        if serial in self.chunks:
            chunk.live += 1
            return
        chunk.live = 1
        self._keep(serial, chunk)

    def restore(self, record: PutRecord) -> list[Chunk]:
        """Replay a put record: its chunks, on disk, take their rows (as `store` does);
        returns the chunks kept (each then holds its extent).

        A chunk's row -1 is a position no longer alive (a rewritten index)."""
        fields = self.index.setdefault(record.partition, {})
        kept: list[Chunk] = []
        for c in record.chunks:
            rows = array("q")
            rows.frombytes(c.rows)
            pairs = [(r, i) for i, r in enumerate(rows) if r >= 0]
            if not pairs:
                continue
            chunk = Chunk(c.header, None, None, extent=c.extent, n=len(rows))
            chunk.live = len(pairs)
            kept.append(chunk)
            index = fields.setdefault(c.header.name, {})
            first = self.add(chunk) << CELL_BITS
            for r in index.keys() & {r for r, _ in pairs}:
                self.drop(index[r] >> CELL_BITS)
            index.update((r, first + i) for r, i in pairs)
        if not fields:
            del self.index[record.partition]
        return kept

    def clear(
        self, partition_id: str, rows: Sequence[int] | None, incarnation: str | None = None
    ) -> int | None:
        """Free rows (all of the partition when None): the rows freed, or None when nothing
        of the partition is here to clear (a clear to record on disk is one that returns a
        number).

        With ``incarnation``, only that incarnation's cells: a clear arriving after a newer
        incarnation's put frees nothing of it.
        """
        held = self.incarnations.get(partition_id)
        if incarnation is not None and held is not None and held != incarnation:
            if rows is None:
                self._retire(partition_id, incarnation)
            return None  # the cells here are of a newer incarnation
        if rows is None:
            for inc in (incarnation, held):
                if inc is not None:
                    self._retire(partition_id, inc)
        stored = self.index.get(partition_id)
        if stored is None:
            self.incarnations.pop(partition_id, None)
            return None
        if rows is None:
            self.incarnations.pop(partition_id, None)
            freed = max((len(ix) for ix in stored.values()), default=0)
            for index in stored.values():
                for cell in index.values():
                    self.drop(cell >> CELL_BITS)
            del self.index[partition_id]
            return freed
        freed_rows: set[int] = set()
        for index in stored.values():
            for r in rows:
                entry = index.pop(r, None)
                if entry is not None:
                    self.drop(entry >> CELL_BITS)
                    freed_rows.add(r)
        if all(not ix for ix in stored.values()):
            del self.index[partition_id]
            self.incarnations.pop(partition_id, None)
        return len(freed_rows)

    # ---- reading the index -------------------------------------------------------------------

    def rows(self) -> int:
        """Rows held, over all partitions (a partition's: its field with the most)."""
        return sum(
            max((len(ix) for ix in fields.values()), default=0) for fields in self.index.values()
        )

    def layout(
        self, partition_id: str, field: str, rows: Sequence[int]
    ) -> list[tuple[ColumnHeader, int]]:
        """Runs of ``rows`` (in that order) whose cells of ``field`` were put with one column
        header: ``(header, rows in the run)``.

        Raises:
            RowsNotFound: a row of ``field`` is not stored.
        """
        index = self.index.get(partition_id, {}).get(field)
        runs: list[tuple[ColumnHeader, int]] = []
        serial = -1
        for r in rows:
            cell = None if index is None else index.get(r)
            if cell is None:
                raise RowsNotFound(
                    f"row {r} of field {field!r} in partition {partition_id!r} is not stored "
                    "(never written, or cleared)"
                )
            if cell >> CELL_BITS != serial:
                serial = cell >> CELL_BITS
                header = self.chunks[serial].header
                if not runs or runs[-1][0] != header:
                    runs.append((header, 0))
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        return runs

    def held_rows(self) -> dict[str, list[int]]:
        """The rows of each partition with a cell here (any field), sorted."""
        held: dict[str, list[int]] = {}
        for pid, fields in self.index.items():
            rows: set[int] = set()
            for index in fields.values():
                rows.update(index)
            if rows:
                held[pid] = sorted(rows)
        return held

    def chunk_rows(self, segments: set[int] | None = None) -> dict[int, tuple[str, array[int]]]:
        """Per live chunk on disk (in ``segments``, when given): its partition and the row at
        each of its positions (-1: a position no longer alive)."""
        chunks = self.chunks
        live: dict[int, tuple[str, array[int]]] = {}
        for pid, fields in self.index.items():
            for index in fields.values():
                for row, cell in index.items():
                    serial = cell >> CELL_BITS
                    entry = live.get(serial)
                    if entry is None:
                        extent = chunks[serial].extent
                        if extent is None or (
                            segments is not None and extent.segment not in segments
                        ):
                            continue  # in the device arena (never on disk), or not asked for
                        entry = live[serial] = (pid, array("q", [-1]) * chunks[serial].n)
                    entry[1][cell & POSITION] = row
        return live

    def live_records(self) -> list[PutRecord | ClearRecord]:
        """One put record per live chunk on disk, in the order they were put; rows no longer
        alive in it are -1 (a rewritten index replays to the same cells)."""
        records: list[PutRecord | ClearRecord] = []
        for serial, (pid, rows) in sorted(self.chunk_rows().items()):
            chunk = self.chunks[serial]
            e = chunk.extent
            assert e is not None
            records.append(
                PutRecord(pid, self.incarnations.get(pid), [e.record(chunk.header, rows.tobytes())])
            )
        return records
