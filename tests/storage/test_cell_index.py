"""CellIndex alone: where each cell is, the chunks' lives, incarnations (no I/O)."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from tq_async._errors import RowsNotFound
from tq_async._storage._cell_index import CELL_BITS, POSITION, CellIndex, Chunk
from tq_async._storage._segments import ChunkRecord, Extent, PutRecord
from tq_async._wire._columns import ColumnHeader, column_from_frames

X = ColumnHeader("x", "dense", "int64", (2,))  # 16 bytes per row
Y = ColumnHeader("y", "dense", "int8", ())  # 1 byte per row


def chunk(header: ColumnHeader, n: int, *, extent: Extent | None = None) -> Chunk:
    """A chunk of ``n`` rows in memory."""
    dtype = np.int64 if header.dtype == "int64" else np.int8
    data = np.zeros((n, *header.shape), dtype=dtype)
    return Chunk(
        header, column_from_frames(header, [bytearray(data.tobytes())], n), None, extent=extent
    )


def where(cells: CellIndex, pid: str, field: str, row: int) -> tuple[Chunk, int]:
    """The chunk holding a cell, and the cell's position in it."""
    cell = cells.index[pid][field][row]
    return cells.chunks[cell >> CELL_BITS], cell & POSITION


def test_a_stored_put_maps_each_row_to_its_position_in_its_chunk() -> None:
    cells = CellIndex()
    x, y = chunk(X, 3), chunk(Y, 3)
    cells.store("p", [7, 5, 9], [x, y])
    assert [where(cells, "p", "x", r) for r in (7, 5, 9)] == [(x, 0), (x, 1), (x, 2)]
    assert where(cells, "p", "y", 9) == (y, 2)
    assert cells.resident_bytes == cells.memory_bytes == 3 * 16 + 3
    assert cells.rows() == 3
    assert cells.dead == []


def test_overwriting_every_cell_of_a_chunk_makes_it_dead_and_only_then() -> None:
    cells = CellIndex()
    old = chunk(X, 3)
    cells.store("p", [0, 1, 2], [old])
    cells.store("p", [0, 1], [chunk(X, 2)])
    assert old.live == 1
    assert cells.dead == []
    new = chunk(X, 1)
    cells.store("p", [2], [new])
    assert cells.dead == [old]  # its last cell went: the owner frees its regions
    assert cells.resident_bytes == cells.memory_bytes == 3 * 16
    assert where(cells, "p", "x", 2) == (new, 0)
    assert cells.rows() == 3


def test_clearing_rows_counts_the_rows_freed_and_the_dead_chunks() -> None:
    cells = CellIndex()
    x, y = chunk(X, 3), chunk(Y, 3)
    cells.store("p", [0, 1, 2], [x, y])
    assert cells.clear("p", [1, 5]) == 1  # row 5 was never stored
    assert cells.dead == []
    assert cells.clear("p", [0, 2]) == 2
    assert set(map(id, cells.dead)) == {id(x), id(y)}
    assert cells.index == {}
    assert cells.chunks == {}
    assert cells.resident_bytes == cells.memory_bytes == 0


def test_the_rows_held_are_those_with_a_cell_of_any_field() -> None:
    cells = CellIndex()
    cells.store("p", [4, 0], [chunk(X, 2)])
    cells.store("p", [9], [chunk(Y, 1)])  # another field only
    cells.store("q", [1, 2], [chunk(X, 2)])
    cells.clear("q", [1, 2])
    assert cells.held_rows() == {"p": [0, 4, 9]}


def test_clearing_a_partition_nothing_of_which_is_here_is_none() -> None:
    cells = CellIndex()
    assert cells.clear("p", None) is None  # nothing to record
    cells.store("p", [0], [chunk(X, 1)])
    assert cells.clear("p", None) == 1
    assert cells.clear("p", [0]) is None


def test_a_cleared_incarnation_is_refused_and_a_newer_ones_cells_are_kept() -> None:
    cells = CellIndex()
    cells.incarnations["p"] = "a"
    cells.store("p", [0], [chunk(X, 1)])
    cells.check("p", "a")
    cells.check("p", None)
    with pytest.raises(RowsNotFound):
        cells.check("p", "b")  # another incarnation holds the partition
    assert cells.supersedes("p", "b")  # a put of b clears a's cells first
    assert not cells.supersedes("p", "a")
    assert cells.clear("p", None, "b") is None  # a late clear of another one frees nothing
    assert cells.rows() == 1
    assert cells.clear("p", None, "a") == 1
    assert cells.incarnations == {}
    with pytest.raises(RowsNotFound, match="cleared"):
        cells.check("p", "a")
    with pytest.raises(RowsNotFound):
        cells.supersedes("p", "a")  # a put into a cleared incarnation
    with pytest.raises(RowsNotFound):
        cells.check("p", "b")  # retired by the late clear above


def test_only_chunks_in_host_memory_are_in_the_lru_order() -> None:
    cells = CellIndex(lru=True)
    on_disk = Chunk(X, None, None, extent=Extent(1, 0, (32,), 0), n=2)
    a, b = chunk(X, 1), chunk(X, 1)
    cells.store("p", [0], [a])
    cells.store("p", [1, 2], [on_disk])
    cells.store("p", [3], [b])
    assert list(cells.lru.values()) == [a, b]  # type: ignore[union-attr]
    assert cells.memory_bytes == 32
    assert cells.resident_bytes == 64
    cells.clear("p", [0])
    assert list(cells.lru.values()) == [b]  # type: ignore[union-attr]
    assert CellIndex().lru is None


def test_a_restored_record_takes_its_live_rows_and_replays_over_older_cells() -> None:
    cells = CellIndex()
    first = ChunkRecord(X, array("q", [0, 1, 2]).tobytes(), 1, 0, [48], 7)
    (c,) = cells.restore(PutRecord("p", "a", [first]))
    assert c.column is None
    assert c.extent == first.extent
    # a rewritten index: row 1 moved on (-1), rows 0 and 2 still in the first chunk
    again = ChunkRecord(X, array("q", [-1, 1, -1]).tobytes(), 2, 0, [48], 8)
    (d,) = cells.restore(PutRecord("p", "a", [again]))
    assert d.live == 1
    assert where(cells, "p", "x", 1) == (d, 1)
    assert c.live == 2
    dead = ChunkRecord(X, array("q", [-1]).tobytes(), 2, 48, [16], 9)
    assert cells.restore(PutRecord("q", None, [dead])) == []  # nothing alive: not kept
    assert "q" not in cells.index


def test_live_records_list_each_chunk_on_disk_with_its_dead_rows_as_minus_one() -> None:
    cells = CellIndex()
    cells.incarnations["p"] = "a"
    first = chunk(X, 3, extent=Extent(1, 0, (48,), 5))
    cells.store("p", [0, 1, 2], [first, chunk(Y, 3)])  # y only in memory: not listed
    cells.store("p", [1], [chunk(X, 1, extent=Extent(1, 48, (16,), 6))])
    records = cells.live_records()
    assert [(r.partition, r.incarnation) for r in records] == [("p", "a"), ("p", "a")]
    rows = [array("q", r.chunks[0].rows).tolist() for r in records]  # type: ignore[union-attr]
    assert rows == [[0, -1, 2], [1]]
    assert [r.chunks[0].offset for r in records] == [0, 48]  # type: ignore[union-attr]
    assert list(cells.chunk_rows({2})) == []  # no live chunk in segment 2
