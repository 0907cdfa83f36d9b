"""A storage unit's memory tier under ``memory_cap``: chunks leave memory, least recently
used first, and come back when a read needs them.

Functions over a unit's cells (`tq_async._storage._cells.StorageState`): `evict` after a put
or a read (never inside a get: a read's views, and the arena regions they pin, stay valid
until it is answered), `load` when a get needs a chunk that is on disk only. A chunk already
on disk (a durable store) just leaves memory; another is written to the scratch store first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .._errors import TQError
from .._logging import get_logger
from .._paths._device import DeviceCells
from .._paths._shm import Arena, Region
from .._wire._columns import Column, column_from_frames, column_to_frames
from ._cell_index import CellIndex, Chunk
from ._segments import SegmentStore

__all__ = ["Tiered", "evict", "load"]

log = get_logger(__name__)


class Tiered(Protocol):
    """What the memory tier uses of a unit's cells."""

    cells: CellIndex
    disk: SegmentStore | None
    arena: Arena | None
    memory_cap: int | None
    #: chunks spilled from memory, and chunks read back from disk
    spills: int
    disk_reads: int


def evict(unit: Tiered) -> None:
    """Move the least recently used chunks out of memory until it holds ``memory_cap`` (a
    chunk that cannot be written to disk stays in memory, with a warning)."""
    cap, cells = unit.memory_cap, unit.cells
    if cap is None or cells.memory_bytes <= cap:
        return
    disk, lru, arena = unit.disk, cells.lru, unit.arena
    assert disk is not None
    assert lru is not None
    # arena regions shared with chunks of the same put (`Chunk.siblings`) that may stay
    shared: list[tuple[Sequence[Chunk], Region]] = []
    while cells.memory_bytes > cap and lru:
        serial, chunk = lru.popitem(last=False)
        column = chunk.column
        assert column is not None
        assert not isinstance(column, DeviceCells)
        if chunk.extent is None:
            try:
                chunk.extent = disk.append([column_to_frames(chunk.header, column)])[0]
            except TQError as exc:
                log.warning(
                    "could not spill cells to disk: they stay in memory past memory_cap",
                    error=str(exc),
                )
                lru[serial] = chunk
                lru.move_to_end(serial, last=False)
                break
            disk.ref(chunk.extent)
        chunk.column = None
        if chunk.region is not None and arena is not None:
            arena.release(chunk.region)
            if chunk.siblings:
                shared.append((chunk.siblings, chunk.region))
        chunk.region, chunk.siblings = None, ()
        cells.memory_bytes -= chunk.nbytes
        unit.spills += 1
    for siblings, region in shared:
        _unshare(unit, siblings, region)


def _unshare(unit: Tiered, siblings: Sequence[Chunk], region: Region) -> None:
    """A chunk of a put left memory: those of ``siblings`` (its put's) still there get
    copies of their own, so that its arena ``region`` goes now -- a hot field of a put would
    otherwise keep the region, its cold fields' bytes with it, in memory past ``memory_cap``
    (which counts chunks, not the regions they hold). (After an eviction pass: siblings that
    left memory in it are not copied.)"""
    arena = unit.arena
    assert arena is not None
    for other in siblings:
        column = other.column
        if other.region is not region or column is None:
            continue
        assert not isinstance(column, DeviceCells)
        frames = [bytes(memoryview(f)) for f in column_to_frames(other.header, column)]
        other.column = column_from_frames(other.header, frames, other.n)
        other.region, other.siblings = None, ()
        arena.release(region)


def load(unit: Tiered, serial: int, chunk: Chunk) -> Column:
    """Read a spilled chunk back into memory (it is the most recently used now)."""
    assert chunk.extent is not None
    assert unit.disk is not None
    column = column_from_frames(chunk.header, unit.disk.read(chunk.extent), chunk.n)
    chunk.column = column
    unit.cells.memory_bytes += chunk.nbytes
    unit.disk_reads += 1
    if unit.cells.lru is not None:
        unit.cells.lru[serial] = chunk
    return column
