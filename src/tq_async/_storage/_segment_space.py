"""The space of a unit's segment files: their bytes, and the live chunks in each (no I/O).

`SegmentSpace` is the bookkeeping of `tq_async._storage._segments.SegmentStore`, tested
alone: it says when a segment holds no live chunk any more (the store then deletes its file)
and which finished segments are mostly dead (compaction moves their live chunks).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["SegmentSpace"]


class _Extent(Protocol):
    """Where a chunk is (`tq_async._storage._segments.Extent`)."""

    @property
    def segment(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class SegmentSpace:
    """Bytes and live chunks per segment file.

    Segment 0 is the arena file (`tq_async._storage._segments.ARENA`): its chunks are counted
    alive, its file is not a data segment (not in `sizes`).
    """

    def __init__(self) -> None:
        #: live chunks per segment (a segment with none may be deleted)
        self.chunks: dict[int, int] = {}
        #: bytes of live chunks: in all segments, and per segment
        self.live_bytes = 0
        self._live: dict[int, int] = {}
        #: per data segment: its file's bytes; and their sum (live chunks and dead ones)
        self.sizes: dict[int, int] = {}
        self.file_bytes = 0

    def found(self, sizes: dict[int, int]) -> None:
        """The data segments' files are these (a restart found them)."""
        self.sizes = dict(sizes)
        self.file_bytes = sum(sizes.values())

    def grew(self, segment: int, size: int) -> None:
        """``segment``'s file holds ``size`` bytes now (a new segment: 0)."""
        self.file_bytes += size - self.sizes.get(segment, 0)
        self.sizes[segment] = size

    def gone(self, segment: int) -> None:
        """``segment``'s file was deleted."""
        self.file_bytes -= self.sizes.pop(segment, 0)

    def ref(self, extent: _Extent) -> None:
        """A chunk stored at ``extent`` is alive."""
        segment, n = extent.segment, extent.nbytes
        self.chunks[segment] = self.chunks.get(segment, 0) + 1
        self._live[segment] = self._live.get(segment, 0) + n
        self.live_bytes += n

    def release(self, extent: _Extent) -> bool:
        """The chunk at ``extent`` is dead; whether its segment holds no live chunk now."""
        segment, n = extent.segment, extent.nbytes
        left = self.chunks[segment] - 1
        self.live_bytes -= n
        self._live[segment] -= n
        if left:
            self.chunks[segment] = left
            return False
        del self.chunks[segment]
        del self._live[segment]
        return True

    def sparse(self, current: int) -> list[int]:
        """Data segments other than ``current`` less than half of whose bytes are live
        chunks', the emptiest first."""
        live = self._live
        found = [
            (live.get(n, 0), n)
            for n, size in self.sizes.items()
            if n != current and 2 * live.get(n, 0) < size
        ]
        return [n for _, n in sorted(found)]
