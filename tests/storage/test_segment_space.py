"""SegmentSpace alone: the segment files' bytes and the live chunks in each (no I/O)."""

from __future__ import annotations

from tq_async._storage._segment_space import SegmentSpace
from tq_async._storage._segments import ARENA, Extent


def at(segment: int, offset: int, n: int) -> Extent:
    return Extent(segment, offset, (n,), 0)


def test_a_segment_is_empty_when_its_last_live_chunk_is_released() -> None:
    space = SegmentSpace()
    space.grew(1, 300)
    a, b = at(1, 0, 100), at(1, 100, 200)
    space.ref(a)
    space.ref(b)
    assert space.chunks == {1: 2}
    assert space.live_bytes == 300
    assert not space.release(a)
    assert space.live_bytes == 200
    assert space.release(b)  # the store may delete the file now
    assert space.chunks == {}
    assert space.live_bytes == 0
    assert space.file_bytes == 300  # until it is deleted
    space.gone(1)
    assert space.file_bytes == 0
    assert space.sizes == {}


def test_file_bytes_follow_the_files_found_grown_and_gone() -> None:
    space = SegmentSpace()
    space.found({1: 1000, 3: 500})
    assert space.file_bytes == 1500
    space.grew(4, 0)  # a new segment
    space.grew(4, 64)
    space.grew(4, 128)
    assert space.sizes == {1: 1000, 3: 500, 4: 128}
    assert space.file_bytes == 1628
    space.gone(3)
    space.gone(7)  # never known: nothing changes
    assert space.file_bytes == 1128


def test_sparse_lists_finished_segments_under_half_live_emptiest_first() -> None:
    space = SegmentSpace()
    space.found({1: 1000, 2: 1000, 3: 1000, 4: 1000})
    space.ref(at(1, 0, 400))  # 40 % live
    space.ref(at(2, 0, 600))  # 60 %: kept
    space.ref(at(3, 0, 100))  # 10 %
    # segment 4 holds nothing live, but it is the current one
    assert space.sparse(current=4) == [3, 1]
    assert space.sparse(current=5) == [4, 3, 1]


def test_arena_chunks_are_counted_alive_but_the_arena_is_no_data_segment() -> None:
    space = SegmentSpace()
    space.ref(at(ARENA, 4096, 10))
    assert space.chunks == {ARENA: 1}
    assert space.live_bytes == 10
    assert space.sparse(current=1) == []
    assert space.file_bytes == 0
    assert space.release(at(ARENA, 4096, 10))
