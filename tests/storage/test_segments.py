"""A unit's cells on disk (issue 36): `SegmentStore` under `StorageState`, as plain classes.

No sockets, no loop: a durable state restarted on its directory has every cell back (from the
index, without reading the data), a torn tail is dropped with a warning, damaged bytes are an
error when read, ``memory_cap`` spills and reads back exactly, cleared space is reclaimed, and
a full disk fails a put whole while everything stored before stays.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog

import tq_async as tq
from tq_async._storage import _cells, _segments
from tq_async._storage._cells import StorageState
from tq_async._storage._durable import begin_commit, commit_now, end_commit, rewrite_index
from tq_async._storage._index_frames import PAYLOAD
from tq_async._storage._segments import (
    MARKER,
    ClearRecord,
    PutRecord,
    SegmentStore,
    claim_unit_dir,
)
from tq_async._wire._columns import ColumnHeader, JaggedColumn, column_to_frames

DENSE = ColumnHeader("x", "dense", "int64", (4,))  # 32 bytes per row
JAGGED = ColumnHeader("j", "jagged", "uint8", ())


def frames_of(rows: list[int], seed: int) -> list[Any]:
    """A dense and a jagged column for ``rows``, their values derived from ``seed``."""
    dense = np.arange(seed, seed + 4 * len(rows), dtype=np.int64).reshape(len(rows), 4)
    lengths = np.array([1 + (seed + r) % 7 for r in rows])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = ((np.arange(int(offsets[-1])) + seed) % 251).astype(np.uint8).reshape(-1, 1)
    frames: list[Any] = [bytearray(dense.tobytes())]
    frames += [bytearray(bytes(f)) for f in column_to_frames(JAGGED, JaggedColumn(values, offsets))]
    return frames


def put(state: StorageState, pid: str, rows: list[int], seed: int, inc: str = "i1") -> None:
    state.put(pid, rows, [DENSE, JAGGED], frames_of(rows, seed), incarnation=inc)


def cells(state: StorageState, pid: str, rows: list[int]) -> tuple[list[Any], list[bytes]]:
    """Row by row: the dense row's values and the jagged row's bytes."""
    _, (x, j) = state.get(pid, rows, ["x", "j"])
    assert isinstance(j, JaggedColumn)
    dense = x.data.view(np.int64).reshape(len(rows), 4).tolist()  # type: ignore[union-attr]
    off = j.offsets
    jag = [bytes(j.values[off[i] : off[i + 1]].tobytes()) for i in range(len(rows))]
    return dense, jag


def durable(path: Path, **kw: Any) -> StorageState:
    claim_unit_dir(str(path), 0)
    state = StorageState(disk=SegmentStore(str(path), **kw))
    state.recover()
    return state


def test_a_durable_state_comes_back_from_its_index_without_reading_data(tmp_path: Path) -> None:
    state = durable(tmp_path)
    put(state, "p", [0, 1, 2, 3], 10)
    put(state, "p", [2, 3, 4], 20)  # overwrites rows 2 and 3
    put(state, "q", [0, 1], 30)
    state.clear("p", [1])
    put(state, "r", [5], 40)
    state.clear("r", None)
    expected = cells(state, "p", [0, 2, 3, 4]), cells(state, "q", [0, 1])
    state.disk.close()  # type: ignore[union-attr]

    again = StorageState(disk=SegmentStore(str(tmp_path)))
    assert again.recover() > 0
    assert again.disk is not None
    assert again.disk.bytes_read == 0
    assert again.memory_bytes == 0  # every chunk still on disk
    assert (cells(again, "p", [0, 2, 3, 4]), cells(again, "q", [0, 1])) == expected
    with pytest.raises(tq.RowsNotFound):
        again.get("p", [1], ["x"])
    with pytest.raises(tq.RowsNotFound):
        again.get("r", [5], ["x"])
    assert again.stats().rows == 4 + 2


def test_a_torn_index_tail_is_dropped_with_a_warning(tmp_path: Path) -> None:
    state = durable(tmp_path)
    put(state, "p", [0, 1], 1)
    index = tmp_path / "index.log"
    whole = index.stat().st_size
    put(state, "p", [2, 3], 2)  # its record is torn below: it was never acknowledged
    state.disk.close()  # type: ignore[union-attr]
    with index.open("r+b") as f:
        f.truncate(whole + (index.stat().st_size - whole) // 2)
    with structlog.testing.capture_logs() as logs:
        again = durable(tmp_path)
    assert any("torn tail" in e["event"] and e["log_level"] == "warning" for e in logs)
    assert index.stat().st_size == whole  # cut back: the next record follows a whole one
    assert cells(again, "p", [0, 1]) == cells(_fresh(tmp_path / "model", 1), "p", [0, 1])
    with pytest.raises(tq.RowsNotFound):
        again.get("p", [2], ["x"])
    put(again, "p", [2], 3)
    again.disk.close()  # type: ignore[union-attr]
    assert durable(tmp_path).stats().rows == 3


def test_segments_without_their_index_are_a_clear_error_not_an_empty_unit(
    tmp_path: Path,
) -> None:
    """An index deleted by hand (no crash removes it): the segments' cells cannot be found,
    and a unit that started empty, deleting them, would come back under its old instance
    token, taken for the unit that holds its rows."""
    state = durable(tmp_path)
    put(state, "p", [0, 1], 1)
    state.disk.close()  # type: ignore[union-attr]
    (tmp_path / "index.log").unlink()
    with pytest.raises(tq.TQError, match=r"index .* is missing, but 1 segment files"):
        durable(tmp_path)
    assert [p.stat().st_size > 0 for p in tmp_path.glob("seg-*.dat")] == [True]  # kept


def test_a_bad_checksum_at_the_end_of_the_index_is_a_torn_tail(tmp_path: Path) -> None:
    state = durable(tmp_path)
    put(state, "p", [0], 1)
    put(state, "p", [1], 2)
    state.disk.close()  # type: ignore[union-attr]
    index = tmp_path / "index.log"
    data = bytearray(index.read_bytes())
    data[-1] ^= 0xFF
    index.write_bytes(bytes(data))
    with structlog.testing.capture_logs() as logs:
        again = durable(tmp_path)
    assert any("torn tail" in e["event"] for e in logs)
    assert again.stats().rows == 1


@pytest.mark.parametrize("where", ["payload", "length"])
def test_a_bad_record_before_whole_ones_is_damage_not_a_torn_tail(
    tmp_path: Path, where: str
) -> None:
    """Bit rot in the middle of the index (a crash only cuts its end): the start truncated
    the index there, silently losing the acknowledged puts after it (and serving the values
    they overwrote). It refuses to start now, saying what to do, the index left as it was."""
    state = durable(tmp_path)
    put(state, "p", [0], 1)
    index = tmp_path / "index.log"
    start = index.stat().st_size
    put(state, "p", [1], 2)  # its record goes bad
    put(state, "p", [0, 2], 3)  # acknowledged after it (overwrites row 0)
    state.disk.close()  # type: ignore[union-attr]
    data = bytearray(index.read_bytes())
    data[start + (3 if where == "length" else 20)] ^= 0x40  # a length beyond the file
    index.write_bytes(bytes(data))
    with pytest.raises(tq.TQError, match=rf"damaged at byte {start}\b.*move the data_dir away"):
        durable(tmp_path)
    assert index.read_bytes() == bytes(data)  # nothing cut
    # what the search for whole records after a bad one looks for (a torn tail has none)
    for record in (PutRecord("p", None, []), ClearRecord("p", None, None)):
        assert _segments._frame(record)[8:9] == PAYLOAD


def test_a_chunk_whose_bytes_were_torn_from_its_segment_is_dropped(tmp_path: Path) -> None:
    state = durable(tmp_path)
    put(state, "p", [0, 1], 1)
    put(state, "q", [0, 1], 2)
    state.disk.close()  # type: ignore[union-attr]
    (segment,) = tmp_path.glob("seg-*.dat")
    with segment.open("r+b") as f:  # as if the index reached the disk and the data did not
        f.truncate(segment.stat().st_size - 3)
    with structlog.testing.capture_logs() as logs:
        again = durable(tmp_path)
    assert any("missing" in e["event"] for e in logs)
    assert cells(again, "p", [0, 1]) == cells(_fresh(tmp_path / "model", 1), "p", [0, 1])
    with pytest.raises(tq.RowsNotFound):
        again.get("q", [0], ["j"])


def test_a_unit_at_fsync_whose_index_lost_cells_restarts_on_a_full_disk(tmp_path: Path) -> None:
    """At ``fsync`` a start that dropped cells whose bytes were gone rewrites the index at
    once; on a full disk that commit failed, and so did the start (StorageFullError),
    though a unit restarted on a full disk comes back. It starts now (a warning), and the
    next commit writes the index, once there is room."""
    state = durable(tmp_path, sync=True)
    put(state, "p", [0, 1], 1)
    put(state, "q", [0, 1], 2)
    commit_now(state)
    state.disk.close()  # type: ignore[union-attr]
    (segment,) = tmp_path.glob("seg-*.dat")
    with segment.open("r+b") as f:  # as if the index reached the disk and the data did not
        f.truncate(segment.stat().st_size - 3)
    writer = FullDisk()
    writer.full = True
    with structlog.testing.capture_logs() as logs:
        again = durable(tmp_path, sync=True, write=writer)
    assert any("could not rewrite" in e["event"] for e in logs)
    model = _fresh(tmp_path / "model", 1)
    assert cells(again, "p", [0, 1]) == cells(model, "p", [0, 1])
    writer.full = False
    commit_now(again)
    again.disk.close()  # type: ignore[union-attr]
    with structlog.testing.capture_logs() as logs:
        third = durable(tmp_path, sync=True)
    assert not [e for e in logs if e["log_level"] == "warning"], logs
    assert cells(third, "p", [0, 1]) == cells(model, "p", [0, 1])


@pytest.mark.parametrize("sync", [False, True])
def test_restarts_after_a_clear_warn_of_no_missing_cells(tmp_path: Path, sync: bool) -> None:
    """A segment whose chunks were all cleared is deleted by the start that replays the
    clear: the index is rewritten with it, so a later start finds no record naming a deleted
    segment and warns of no "missing" cells (none were)."""
    state = durable(tmp_path, sync=sync)
    put(state, "p", [0, 1], 1)
    state.clear("p", None)
    state.disk.close()  # type: ignore[union-attr]
    for _ in range(2):
        with structlog.testing.capture_logs() as logs:
            again = durable(tmp_path, sync=sync)
        assert not [e for e in logs if e["log_level"] == "warning"], logs
        assert again.stats().rows == 0
        again.disk.close()  # type: ignore[union-attr]


@pytest.mark.parametrize("sync", [False, True])
def test_a_segment_deleted_once_its_cells_died_is_no_loss_but_one_deleted_by_hand_is(
    tmp_path: Path, sync: bool
) -> None:
    """A running unit deletes a segment once its cells died (cleared, overwritten); the
    index still names them until it is rewritten, and the next start says nothing of them.
    A segment deleted by hand lost live cells: that is still a warning."""
    state = durable(tmp_path, sync=sync, segment_bytes=64)
    put(state, "p", [0, 1], 1)
    put(state, "q", [0, 1], 2)  # (a segment each)
    put(state, "q", [0, 1], 3)  # q's first segment: overwritten
    state.clear("p", None)
    state.disk.commit(state.disk.begin_commit())  # type: ignore[union-attr]
    state.disk.close()  # type: ignore[union-attr]
    with structlog.testing.capture_logs() as logs:
        again = durable(tmp_path, sync=sync, segment_bytes=64)
    assert not [e for e in logs if e["log_level"] == "warning"], logs
    assert again.stats().rows == 2
    put(again, "r", [0], 4)
    again.disk.close()  # type: ignore[union-attr]
    for segment in sorted(tmp_path.glob("seg-*.dat"))[:-1]:  # all but r's, the newest
        segment.unlink()
    with structlog.testing.capture_logs() as logs:
        durable(tmp_path, sync=sync, segment_bytes=64)
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert "missing" in warning["event"]
    assert warning["segment_gone"] == 4  # q's live cells: two rows, both columns


def test_damaged_bytes_are_an_error_when_read(tmp_path: Path) -> None:
    state = durable(tmp_path)
    put(state, "p", [0, 1], 1)
    state.disk.close()  # type: ignore[union-attr]
    (segment,) = tmp_path.glob("seg-*.dat")
    data = bytearray(segment.read_bytes())
    data[5] ^= 0xFF
    segment.write_bytes(bytes(data))
    again = durable(tmp_path)
    with pytest.raises(tq.TQError, match="damaged"):
        again.get("p", [0], ["x"])


@pytest.mark.parametrize("level", ["memory", "process", "fsync"])
def test_a_partition_four_times_memory_cap_round_trips_exactly(tmp_path: Path, level: str) -> None:
    cap = 64 << 10
    if level == "memory":  # spill only: a scratch store
        disk = SegmentStore(str(tmp_path), durable=False, segment_bytes=32 << 10)
        disk.load()
    else:
        claim_unit_dir(str(tmp_path), 0)
        disk = SegmentStore(str(tmp_path), sync=level == "fsync", segment_bytes=32 << 10)
        disk.load()
    state = StorageState(disk=disk, memory_cap=cap)
    model = _fresh(tmp_path / "model", None)
    rows_per_put = 64  # ~2.4 KiB dense + jagged per put... 4 x cap needs many
    seed = 0
    row = 0
    while state.resident_bytes < 4 * cap:
        rows = list(range(row, row + rows_per_put))
        put(state, "p", rows, seed)
        put(model, "p", rows, seed)
        assert state.memory_bytes <= cap  # what stays in memory is bounded by the cap
        seed, row = seed + 1, row + rows_per_put
    if level == "fsync":
        disk.commit(disk.begin_commit())
    assert state.spills > 0
    all_rows = list(range(row))
    rng = np.random.default_rng(0)
    for _ in range(3):  # in order, then shuffled: every cell comes back exactly
        assert cells(state, "p", all_rows) == cells(model, "p", all_rows)
        state.evict()
        assert state.memory_bytes <= cap
        all_rows = rng.permutation(all_rows).tolist()
    assert state.disk_reads > 0
    stats = state.stats()
    assert stats.memory_bytes <= cap
    assert stats.memory_cap == cap
    assert stats.disk_bytes > 0
    state.clear("p", None)
    assert state.memory_bytes == 0
    assert state.resident_bytes == 0
    assert disk.live_bytes == 0
    if level == "fsync":  # dead segments go once the index that named them is synced
        disk.commit(disk.begin_commit())
    assert len(list(tmp_path.glob("seg-*.dat"))) == 1  # only the segment being written


def test_cleared_space_is_reclaimed_and_the_index_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cells, "_REWRITE_SLACK", 8)
    claim_unit_dir(str(tmp_path), 0)
    disk = SegmentStore(str(tmp_path), segment_bytes=4 << 10)
    disk.load()
    state = StorageState(disk=disk)
    for i in range(40):
        put(state, "old", list(range(i * 16, i * 16 + 16)), i)
    put(state, "keep", [0, 1, 2], 99)
    segments = len(list(tmp_path.glob("seg-*.dat")))
    assert segments > 5
    for i in range(40):  # row by row: many clear records, then the index is rewritten
        state.clear("old", list(range(i * 16, i * 16 + 16)))
    assert len(list(tmp_path.glob("seg-*.dat"))) <= 2  # fully dead segments are deleted
    assert disk.records < 10  # rewritten: one record per live chunk
    expected = cells(state, "keep", [0, 1, 2])
    disk.close()
    again = durable(tmp_path)
    assert cells(again, "keep", [0, 1, 2]) == expected
    assert again.stats().rows == 3


class FullDisk:
    """A write seam: fails with ENOSPC while ``full`` (what a full disk does)."""

    def __init__(self) -> None:
        self.full = False

    def __call__(self, fd: int, data: Any) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.write(fd, data)


def test_a_full_disk_fails_the_put_whole_and_keeps_what_was_stored(tmp_path: Path) -> None:
    writer = FullDisk()
    claim_unit_dir(str(tmp_path), 0)
    disk = SegmentStore(str(tmp_path), write=writer)
    disk.load()
    state = StorageState(disk=disk)
    put(state, "p", [0, 1], 1)
    before = cells(state, "p", [0, 1])
    size = os.path.getsize(next(tmp_path.glob("seg-*.dat")))
    writer.full = True
    with pytest.raises(tq.StorageFullError, match="free space"):
        put(state, "p", [1, 2], 2)  # would overwrite row 1: it must not
    assert os.path.getsize(next(tmp_path.glob("seg-*.dat"))) == size  # cut back
    assert cells(state, "p", [0, 1]) == before
    with pytest.raises(tq.RowsNotFound):
        state.get("p", [2], ["x"])
    writer.full = False  # space was freed: the unit carries on
    put(state, "p", [2], 3)
    writer.full = True  # clearing still works on a full disk: it is how space comes back
    with structlog.testing.capture_logs() as logs:
        assert state.clear("other", None) == 0
        put_ok = state.stats().rows
        state.clear("p", [2])
    assert any("could not record a clear" in e["event"] for e in logs)
    assert state.stats().rows == put_ok - 1
    disk.close()
    again = durable(tmp_path)
    assert cells(again, "p", [0, 1]) == before
    assert again.stats().rows == 3  # the unrecorded clear's cells are found again


def test_a_write_that_could_not_be_cut_back_leaves_later_cells_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that failed midway and whose bytes could not be cut back (the truncate failed
    too) left the segment longer than the store knew: the next puts' cells were recorded
    where they were not (acknowledged, then "damaged" when read). The next put starts a new
    segment now."""
    writer = FullDisk()
    claim_unit_dir(str(tmp_path), 0)
    disk = SegmentStore(str(tmp_path), write=writer)
    disk.load()
    state = StorageState(disk=disk)
    put(state, "p", [0], 1)

    def half_then_full(fd: int, data: Any) -> int:
        if writer.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        writer.full = True  # the next write of this put finds the disk full
        return os.write(fd, memoryview(data)[: len(data) // 2])

    def no_truncate(fd: int, size: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as patch:
        patch.setattr(disk, "_write", half_then_full)
        patch.setattr(os, "ftruncate", no_truncate)
        with pytest.raises(tq.StorageFullError):
            put(state, "p", [1], 2)
    writer.full = False
    put(state, "p", [1], 3)
    model = _fresh(tmp_path / "model", None)
    put(model, "p", [0], 1)
    put(model, "p", [1], 3)
    disk.close()
    assert cells(durable(tmp_path), "p", [0, 1]) == cells(model, "p", [0, 1])


def put_and_commit(state: StorageState, pid: str, rows: list[int], seed: int) -> None:
    """`put`, then (at ``fsync``) the group commit that answers it."""
    put(state, pid, rows, seed)
    if state.disk is not None and state.disk.sync:
        state.disk.commit(state.disk.begin_commit())


@pytest.mark.parametrize("sync", [False, True])
def test_an_index_record_that_could_not_be_cut_back_is_cut_before_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: bool
) -> None:
    """A record written halfway whose bytes could not be cut back (the truncate failed too)
    stayed in the index, and the next puts' records followed it: a bad record before whole
    ones, which a start refuses. It is cut before the next record is written now (and the
    put that finds it still cannot be fails)."""
    claim_unit_dir(str(tmp_path), 0)
    disk = SegmentStore(str(tmp_path), sync=sync)
    disk.load()
    state = StorageState(disk=disk)
    put_and_commit(state, "p", [0], 1)
    torn = []

    def half_then_full(fd: int, data: Any) -> int:
        if not os.readlink(f"/proc/self/fd/{fd}").endswith("index.log"):
            return os.write(fd, data)
        if torn:
            raise OSError(errno.ENOSPC, "No space left on device")
        torn.append(fd)
        return os.write(fd, memoryview(data)[: len(data) // 2])

    def no_truncate(fd: int, size: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as patch:
        patch.setattr(disk, "_write", half_then_full)
        patch.setattr(os, "ftruncate", no_truncate)
        with pytest.raises(tq.StorageFullError):
            put_and_commit(state, "p", [1], 2)
        if not sync:  # (at fsync its record waits for a commit: nothing to cut yet)
            with pytest.raises(tq.TQError, match="could not use its data_dir"):
                put(state, "q", [0], 3)  # the index still cannot be cut back
    put_and_commit(state, "p", [2], 4)
    disk.close()
    model = _fresh(tmp_path / "model", None)
    put(model, "p", [0], 1)
    put(model, "p", [2], 4)
    again = durable(tmp_path)
    assert cells(again, "p", [0, 2]) == cells(model, "p", [0, 2])


def test_an_index_rewrite_that_fails_after_its_rename_keeps_later_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rewritten index was renamed into place, then opened again for appending: when that
    open failed (no file descriptor left), the store kept appending to the old file, gone
    from the directory, and the next acknowledged puts were not there after a restart. The
    descriptor that wrote it is kept for appending now: nothing is opened after the rename."""
    state = durable(tmp_path)
    put(state, "p", [0], 1)
    real = os.open

    def no_fd_for_the_index(path: Any, flags: int, *args: Any) -> int:
        if str(path).endswith("index.log"):
            raise OSError(errno.EMFILE, "Too many open files")
        return real(path, flags, *args)

    with monkeypatch.context() as patch:
        patch.setattr(os, "open", no_fd_for_the_index)
        rewrite_index(state)
    put(state, "p", [1], 2)  # acknowledged
    state.disk.close()  # type: ignore[union-attr]
    model = _fresh(tmp_path / "model", None)
    put(model, "p", [0], 1)
    put(model, "p", [1], 2)
    assert cells(durable(tmp_path), "p", [0, 1]) == cells(model, "p", [0, 1])


@pytest.mark.parametrize("sync", [False, True])
def test_a_segment_file_that_cannot_be_made_fails_the_put_and_not_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: bool
) -> None:
    """The next segment file could not be made (no inode, no file descriptor left): the put
    got a raw OSError, and the store kept the full segment's descriptor, closed already, to
    close again when the next put started a segment (EBADF, or another file's descriptor
    by then). The put fails with StorageFullError now, and the next one goes through."""
    state = durable(tmp_path, sync=sync, segment_bytes=1)  # a new segment every put
    put_and_commit(state, "p", [0], 1)
    real = os.open

    def no_new_segment(path: Any, flags: int, *args: Any) -> int:
        if os.path.basename(str(path)).startswith("seg-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, flags, *args)

    with monkeypatch.context() as patch:
        patch.setattr(os, "open", no_new_segment)
        with pytest.raises(tq.StorageFullError):
            put_and_commit(state, "p", [1], 2)
    put_and_commit(state, "p", [2], 3)
    put_and_commit(state, "p", [3], 4)
    state.disk.close()  # type: ignore[union-attr]
    model = _fresh(tmp_path / "model", None)
    for row, seed in [(0, 1), (2, 3), (3, 4)]:
        put(model, "p", [row], seed)
    rows = [0, 2, 3]
    assert cells(durable(tmp_path, sync=sync), "p", rows) == cells(model, "p", rows)


class FullIndex:
    """A write seam: writes to ``index.log`` fail with ENOSPC while ``full`` (the data fit in
    the disk's last blocks, the record did not: at ``fsync`` it is written at the commit)."""

    def __init__(self) -> None:
        self.full = False

    def __call__(self, fd: int, data: Any) -> int:
        if self.full and "index.log" in os.readlink(f"/proc/self/fd/{fd}"):  # (.tmp too)
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.write(fd, data)


def test_a_put_whose_group_commit_failed_changes_no_cell(tmp_path: Path) -> None:
    """At ``fsync`` a put's cells took their rows before its group commit: one whose
    commit failed (StorageFullError) left them there, and rows it overwrote served its
    values until a restart brought the old ones back. Its cells are undone now."""
    writer = FullIndex()
    claim_unit_dir(str(tmp_path), 0)
    disk = SegmentStore(str(tmp_path), sync=True, write=writer)
    disk.load()
    state = StorageState(disk=disk)
    put(state, "p", [0, 1], 1)
    commit_now(state)
    before = cells(state, "p", [0, 1])
    writer.full = True
    put(state, "p", [1, 2], 2)  # overwrites row 1; answered after the commit below
    with pytest.raises(tq.StorageFullError):
        commit_now(state)
    assert cells(state, "p", [0, 1]) == before  # what the unit serves meanwhile
    with pytest.raises(tq.RowsNotFound):
        state.get("p", [2], ["x"])
    disk.close()
    assert cells(durable(tmp_path), "p", [0, 1]) == before  # what the disk holds


def test_a_clear_whose_group_commit_failed_gives_its_space_back_at_the_next(
    tmp_path: Path,
) -> None:
    """At ``fsync`` a clear whose commit failed (the disk full down to the index's last
    block) lost its record, and the segments it emptied, forgotten by the store, were
    never deleted while the unit ran: clearing brought no space back, and a restart found
    the cells again. The next commit deletes them and writes the whole index now."""
    writer = FullIndex()
    claim_unit_dir(str(tmp_path), 0)
    disk = SegmentStore(str(tmp_path), sync=True, write=writer, segment_bytes=1)
    disk.load()
    state = StorageState(disk=disk)
    for seed in range(4):  # a segment each
        put(state, "p", [seed], seed)
    commit_now(state)
    writer.full = True
    assert state.clear("p", None) == 4
    with pytest.raises(tq.StorageFullError):
        commit_now(state)
    writer.full = False
    commit_now(state)  # the next request's
    assert len(list(tmp_path.glob("seg-*.dat"))) == 1  # only the segment being written
    assert disk.live_bytes == 0
    disk.close()
    assert durable(tmp_path).stats().rows == 0


def test_puts_of_two_failed_commits_in_a_row_are_undone_each(tmp_path: Path) -> None:
    """A put waiting for the next commit overwrote a row of a put whose commit (in flight)
    then failed: that row keeps the later put's cells; when the later commit fails too,
    the row has the cells both overwrote again (and the disk agrees)."""
    writer = FullIndex()
    claim_unit_dir(str(tmp_path), 0)
    disk = SegmentStore(str(tmp_path), sync=True, write=writer)
    disk.load()
    state = StorageState(disk=disk)
    put(state, "p", [0, 1, 2], 1)
    commit_now(state)
    before = cells(state, "p", [0, 1, 2])
    writer.full = True
    put(state, "p", [1, 2], 2)
    in_flight = begin_commit(state)
    put(state, "p", [2], 3)  # overwrites the first failed put's row 2: waits for the next
    later = _fresh(tmp_path / "model", None)
    put(later, "p", [0, 1, 2], 1)
    put(later, "p", [2], 3)
    with pytest.raises(tq.StorageFullError):
        disk.commit(in_flight)
    end_commit(state, in_flight, tq.StorageFullError("full"))
    assert cells(state, "p", [0, 1, 2]) == cells(later, "p", [0, 1, 2])
    with pytest.raises(tq.StorageFullError):
        commit_now(state)
    assert cells(state, "p", [0, 1, 2]) == before
    writer.full = False
    put(state, "p", [0], 4)
    commit_now(state)
    assert state.cells.dead == []
    disk.close()
    again = durable(tmp_path)
    assert cells(again, "p", [1, 2]) == cells(state, "p", [1, 2])
    assert cells(again, "p", [0]) == cells(state, "p", [0])


def test_a_commit_that_ends_before_an_earlier_failed_one_frees_nothing_it_needs(
    tmp_path: Path,
) -> None:
    """A put from this process is committed on its own thread while the loop's commit is
    in flight, and may end first: the puts of the commit that ended were taken for those
    of the oldest (a put on the disk undone, a failed one kept), and the chunks that died
    in it would be freed though the earlier commit, failing after, undoes a put that
    overwrote one of them. Each commit undoes its own puts now, and its dead chunks wait
    for the earlier one."""
    writer = FullIndex()
    claim_unit_dir(str(tmp_path), 0)
    disk = SegmentStore(str(tmp_path), sync=True, write=writer, segment_bytes=1)
    disk.load()
    state = StorageState(disk=disk)
    put(state, "p", [0, 1], 1)  # X: a segment of its own
    commit_now(state)
    before = cells(state, "p", [0, 1])
    put(state, "p", [0], 2)  # overwrites X's row 0
    in_flight = begin_commit(state)
    writer.full = True
    with pytest.raises(tq.StorageFullError):
        disk.commit(in_flight)  # its end waits on the loop
    writer.full = False
    put(state, "p", [1], 3)  # overwrites X's row 1: X is dead (until the undo below)
    commit_now(state)  # the put from this process: ends first
    end_commit(state, in_flight, tq.StorageFullError("full"))
    model = _fresh(tmp_path / "model", None)
    put(model, "p", [0, 1], 1)
    put(model, "p", [1], 3)
    assert cells(state, "p", [0, 1]) == cells(model, "p", [0, 1])
    assert cells(state, "p", [0]) == (before[0][:1], before[1][:1])
    commit_now(state)
    disk.close()
    assert cells(durable(tmp_path), "p", [0, 1]) == cells(model, "p", [0, 1])


@pytest.mark.parametrize("sync", [False, True])
def test_a_segment_file_that_cannot_be_deleted_fails_no_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: bool
) -> None:
    """Deleting a dead segment's file failed (EIO, a file system gone read-only): the clear
    (at ``process``; at ``fsync`` its commit, written already) raised the raw OSError, half
    way through freeing its chunks. The file stays now (a warning; a restart deletes it)."""
    state = durable(tmp_path, sync=sync, segment_bytes=1)  # a segment every put
    for seed in range(3):
        put(state, "p", [seed], seed)
    if sync:
        commit_now(state)
    real = os.unlink

    def no_unlink(path: Any, *args: Any, **kw: Any) -> None:
        if os.path.basename(str(path)).startswith("seg-"):
            raise OSError(errno.EIO, "Input/output error")
        real(path, *args, **kw)

    with monkeypatch.context() as patch, structlog.testing.capture_logs() as logs:
        patch.setattr(os, "unlink", no_unlink)
        assert state.clear("p", [0, 1]) == 2
        if sync:
            commit_now(state)
    assert any("could not delete" in e["event"] for e in logs)
    assert state.disk is not None
    assert state.disk.live_bytes == state.cells.resident_bytes
    put(state, "p", [3], 3)
    if sync:
        commit_now(state)
    state.disk.close()
    again = durable(tmp_path, sync=sync)
    assert again.stats().rows == 2
    assert len(list(tmp_path.glob("seg-*.dat"))) == 3  # rows 2, 3, the current: no dead one


def test_a_full_disk_while_spilling_keeps_the_cells_in_memory(tmp_path: Path) -> None:
    writer = FullDisk()
    disk = SegmentStore(str(tmp_path), durable=False, write=writer)
    disk.load()
    state = StorageState(disk=disk, memory_cap=1)
    writer.full = True
    with structlog.testing.capture_logs() as logs:
        put(state, "p", [0, 1], 1)
    assert any("stay in memory" in e["event"] for e in logs)
    assert state.memory_bytes > 1
    assert state.spills == 0
    writer.full = False
    put(state, "p", [2], 2)
    assert state.memory_bytes <= 1
    assert state.spills == 4
    assert cells(state, "p", [0, 1]) == cells(_fresh(tmp_path / "m", 1), "p", [0, 1])


def test_fsync_level_index_records_wait_for_the_group_commit(tmp_path: Path) -> None:
    claim_unit_dir(str(tmp_path), 0)
    disk = SegmentStore(str(tmp_path), sync=True)
    disk.load()
    state = StorageState(disk=disk)
    put(state, "p", [0], 1)
    put(state, "p", [1], 2)  # two puts, one commit
    assert disk.pending
    assert (tmp_path / "index.log").stat().st_size == 0  # a crash now: nothing was acked
    disk.commit(disk.begin_commit())
    assert not disk.pending
    disk.close()
    assert durable(tmp_path).stats().rows == 2


def test_a_unit_directory_is_claimed_once(tmp_path: Path) -> None:
    unit, instance = claim_unit_dir(str(tmp_path), None)
    assert unit is None
    assert instance.startswith("disk-")
    assert claim_unit_dir(str(tmp_path), 3) == (3, instance)  # the same unit: same token
    mark = json.loads((tmp_path / MARKER).read_text())
    mark["unit_id"] = 3
    (tmp_path / MARKER).write_text(json.dumps(mark))
    assert claim_unit_dir(str(tmp_path), None) == (3, instance)
    with pytest.raises(tq.ConfigError, match="belongs to storage unit 3"):
        claim_unit_dir(str(tmp_path), 4)
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    (ctl / MARKER).write_text(json.dumps({"kind": "controller", "format": 1}))
    with pytest.raises(tq.ConfigError, match="belongs to a controller"):
        claim_unit_dir(str(ctl), 0)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(tq.ConfigError, match="not empty"):
        claim_unit_dir(str(other), 0)
    with pytest.raises(tq.ConfigError, match="not a directory"):
        claim_unit_dir(str(tmp_path / "missing"), 0)


def _fresh(path: Path, seed: int | None) -> StorageState:
    """A state in memory only (with partition ``p`` rows 0, 1 put from ``seed``)."""
    state = StorageState()
    if seed is not None:
        put(state, "p", [0, 1], seed)
    return state


async def test_a_cluster_with_memory_cap_streams_a_partition_four_times_its_cap() -> None:
    """Through real puts and gets (shared memory and socket): exact, memory bounded."""
    import torch

    cap = 1 << 20
    async with tq.local_cluster(num_storage_units=1, memory_cap=cap) as cluster:
        for data_path in ("auto", "zmq"):
            async with tq.AsyncClient.connect(cluster.address, data_path=data_path) as client:
                batches = [
                    torch.randn(64, 1024, generator=torch.Generator().manual_seed(i))
                    for i in range(16)
                ]
                metas = [await client.put({"x": b}, data_path) for b in batches]  # 4 MiB
                unit = cluster.units[0].state
                assert unit.memory_bytes <= cap
                for meta, b in reversed(list(zip(metas, batches, strict=True))):
                    assert torch.equal((await client.get_data(meta))["x"], b)
                stats = (await client.storage_stats())[0]
                assert stats["memory_bytes"] <= cap
                assert stats["memory_cap"] == cap
                assert stats["spills"] > 0
                assert stats["disk_reads"] > 0
                await client.clear_partition(data_path)
        assert cluster.units[0].state.disk.live_bytes == 0  # type: ignore[union-attr]


async def test_memory_cap_bounds_text_columns_too() -> None:
    """A list column's strings count against the cap (they counted 0 bytes: never spilled)."""
    cap = 256 << 10
    async with (
        tq.local_cluster(num_storage_units=1, memory_cap=cap) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        batches = [[f"{i}:{r}:" + "t" * 1024 for r in range(64)] for i in range(16)]  # 1 MiB
        metas = [await client.put({"text": b}, "p") for b in batches]
        assert cluster.units[0].state.memory_bytes <= cap
        for meta, b in reversed(list(zip(metas, batches, strict=True))):
            assert (await client.get_data(meta)).get("text").tolist() == b
        stats = (await client.storage_stats())[0]
        assert stats["memory_bytes"] <= cap
        assert stats["spills"] > 0


def test_memory_cap_in_config_toml_and_cli(tmp_path: Path) -> None:
    from tq_async._deploy._cli import _build_parser, _given, config_from_args

    toml = tmp_path / "c.toml"
    toml.write_text("memory_cap = 1000000\n")
    assert tq.Config.from_toml(toml).memory_cap == 1_000_000
    with pytest.raises(tq.ConfigError, match="memory_cap"):
        tq.Config(memory_cap=-1)
    argv = ["serve", "storage", "--controller", "tcp://127.0.0.1:1", "--memory-cap", "4096"]
    argv += ["--durability", "process", "--data-dir", str(tmp_path)]
    parser = _build_parser()
    config = config_from_args(parser.parse_args(argv), _given(parser, argv))
    assert (config.memory_cap, config.durability, config.data_dir) == (
        4096,
        "process",
        str(tmp_path),
    )


def test_memory_cap_bounds_the_idle_shared_memory_too(tmp_path: Path) -> None:
    """Freed arena pages a unit keeps for reuse count against its memory_cap (5 % of it, at
    most the usual 256 MiB): a unit's RSS stays within the cap + 10 % (``benchmarks.spill
    --rss``)."""
    from tq_async._storage._server import DEFAULT_SHM_IDLE, StorageServer

    capped = StorageServer(0, memory_cap=100 << 20, data_dir=str(tmp_path))
    plain = StorageServer(1)
    told = StorageServer(2, memory_cap=100 << 20, shm_idle_bytes=0, data_dir=str(tmp_path))
    try:
        assert capped.shm_path.idle_bytes == (100 << 20) // 20
        assert plain.shm_path.idle_bytes == DEFAULT_SHM_IDLE
        assert told.shm_path.idle_bytes == 0
    finally:
        for server in (capped, plain, told):
            server._close_disk()


def _live_segments_exist(state: StorageState) -> None:
    """Every chunk on disk counts in its segment's live chunks, and its file is there."""
    disk = state.disk
    assert disk is not None
    want: dict[int, int] = {}
    for chunk in state.cells.chunks.values():
        if chunk.extent is not None:
            want[chunk.extent.segment] = want.get(chunk.extent.segment, 0) + 1
    assert want == disk.space.chunks
    for segment in want:
        assert os.path.exists(disk._path(segment)), f"segment {segment} holds live cells"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cap", [None, 4096, 0], ids=["no-cap", "cap", "cap-0"])
def test_random_puts_clears_and_restarts_keep_every_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, cap: int | None
) -> None:
    """Random overwrites, clears, reads (evicting past the cap) and restarts on small
    segments with frequent index rewrites and compactions, against a model: every live row
    reads back as last put, and no segment holding live cells is ever deleted. (A segment
    that held no live chunk for a while during a restart's replay -- it was the current one
    when its chunks were cleared, then took new ones -- was deleted with the new ones.)"""
    import random

    monkeypatch.setattr(_cells, "_REWRITE_SLACK", 8)
    monkeypatch.setattr(_cells, "_COMPACT_SLACK", 0)  # compact whenever half is dead
    monkeypatch.setattr(_cells, "_COMPACT_BUDGET", 4096)  # a few chunks at a time
    header = ColumnHeader("x", "dense", "int64", (64,))
    rng = random.Random(seed)
    claim_unit_dir(str(tmp_path), 0)

    def start() -> StorageState:
        state = StorageState(
            disk=SegmentStore(str(tmp_path), segment_bytes=16 << 10), memory_cap=cap
        )
        state.recover()
        _live_segments_exist(state)
        return state

    def read(state: StorageState, rows: list[int]) -> list[int]:
        _, (x,) = state.get("p", rows, ["x"])
        return np.frombuffer(bytes(x.data), np.int64).reshape(len(rows), 64)[:, 0].tolist()  # type: ignore[union-attr]

    state = start()
    model: dict[int, int] = {}
    for _ in range(300):
        op = rng.random()
        if op < 0.6:
            rows = rng.sample(range(200), rng.randint(1, 12))
            v = rng.randint(0, 1 << 30)
            data = np.array([[v + r] * 64 for r in rows], dtype=np.int64)
            state.put("p", rows, [header], [bytearray(data.tobytes())], incarnation="i")
            model.update((r, v + r) for r in rows)
        elif op < 0.75 and model:
            rows = rng.sample(sorted(model), min(len(model), rng.randint(1, 10)))
            state.clear("p", rows, incarnation="i")
            for r in rows:
                del model[r]
        elif op < 0.9 and model:
            rows = rng.sample(sorted(model), min(len(model), rng.randint(1, 10)))
            assert read(state, rows) == [model[r] for r in rows]
            state.evict()
        else:
            assert state.disk is not None
            state.disk.close()
            state = start()
            if model:
                assert read(state, sorted(model)) == [model[r] for r in sorted(model)]
        _live_segments_exist(state)
    assert state.disk is not None
    state.disk.close()


@pytest.mark.parametrize("level", ["memory", "process", "fsync"])
def test_cleared_rows_space_comes_back_from_half_dead_segments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, level: str
) -> None:
    """Three puts of every four cleared leave every segment partly alive: once the files hold
    much more than the live cells, the live chunks of mostly dead segments move to the
    current one and the old files go; a restart finds every remaining row (the moved
    chunks' records replay over their first ones). (A chunk goes whole: one live row keeps
    its put's bytes.)"""
    monkeypatch.setattr(_cells, "_COMPACT_SLACK", 8 << 10)
    if level == "memory":  # spilled cells in a scratch store (memory_cap 0)
        disk = SegmentStore(str(tmp_path), durable=False, segment_bytes=8 << 10)
        disk.load()
        state = StorageState(disk=disk, memory_cap=0)
    else:
        claim_unit_dir(str(tmp_path), 0)
        disk = SegmentStore(str(tmp_path), sync=level == "fsync", segment_bytes=8 << 10)
        state = StorageState(disk=disk)
        state.recover()
    for k in range(64):  # 64 puts of 64 rows (~3 KB a put): ~25 segments
        put(state, "p", list(range(64 * k, 64 * k + 64)), k)
        state.evict()
    if level == "fsync":
        disk.commit(disk.begin_commit())
    full = disk.file_bytes
    kept = [r for k in range(0, 64, 4) for r in range(64 * k, 64 * k + 64)]
    expected = cells(state, "p", kept)
    state.evict()
    state.clear("p", sorted(set(range(64 * 64)) - set(kept)), incarnation="i1")
    if level == "fsync":
        disk.commit(disk.begin_commit())
    assert disk.file_bytes <= 2 * disk.live_bytes + (8 << 10) + disk.segment_bytes
    assert disk.file_bytes < full / 2
    assert cells(state, "p", kept) == expected
    if level != "memory":
        disk.close()
        again = durable(tmp_path, sync=level == "fsync")
        assert cells(again, "p", kept) == expected
        assert again.stats().rows == len(kept)


def test_overwritten_rows_space_comes_back_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hot rows put again and again (a keyed buffer) leave dead chunks beside the few that
    stay: puts compact as clears do, so the files stay within twice the live cells."""
    monkeypatch.setattr(_cells, "_COMPACT_SLACK", 8 << 10)
    state = durable(tmp_path, segment_bytes=8 << 10)
    model = _fresh(tmp_path / "model", None)
    disk = state.disk
    assert disk is not None
    for k in range(200):  # every tenth put: new rows that stay; the others: the hot rows
        rows = list(range(1000 + 64 * k, 1064 + 64 * k)) if k % 10 == 0 else list(range(64))
        put(state, "p", rows, k)
        put(model, "p", rows, k)
        assert disk.file_bytes <= 2 * disk.live_bytes + (8 << 10) + 2 * disk.segment_bytes
    every = list(range(64)) + [
        r for k in range(0, 200, 10) for r in range(1000 + 64 * k, 1064 + 64 * k)
    ]
    expected = cells(model, "p", every)
    assert cells(state, "p", every) == expected
    disk.close()
    again = durable(tmp_path)
    assert cells(again, "p", every) == expected


def test_fsync_records_logged_after_an_index_rewrite_reach_the_disk(tmp_path: Path) -> None:
    """At ``fsync`` an index rewrite waits for the next commit; a put recorded after it in the
    same commit window was dropped by that commit (only the rewrite was written), so an
    acknowledged put was gone after a restart (found by test_segment_kills: compaction logs
    right after a clear's rewrite; under load any put can)."""
    state = durable(tmp_path, sync=True)
    disk = state.disk
    assert disk is not None
    put(state, "p", [0, 1], 1)
    disk.commit(disk.begin_commit())
    rewrite_index(state)  # as a clear does past _REWRITE_SLACK
    put(state, "q", [5, 6], 2)  # recorded after it, before the commit
    disk.commit(disk.begin_commit())
    expected = cells(state, "p", [0, 1]), cells(state, "q", [5, 6])
    disk.close()
    again = durable(tmp_path, sync=True)
    assert (cells(again, "p", [0, 1]), cells(again, "q", [5, 6])) == expected


@pytest.mark.parametrize("level", ["memory", "process"])
def test_a_hot_field_does_not_hold_its_puts_evicted_fields_in_shared_memory(
    tmp_path: Path, level: str
) -> None:
    """The columns of a put through shared memory are views of one arena region. Reading
    one field (a small hot one) keeps its chunk in memory while the put's big fields leave
    it: the region -- the big fields' bytes with it -- stayed taken as long as the small
    chunk lived, so the unit held ~4x its ``memory_cap`` of shared memory while
    ``memory_bytes`` said it was under the cap."""
    from tq_async._paths._shm import Arena, align

    big = ColumnHeader("big", "dense", "float32", (1024,))  # 256 KiB per put
    small = ColumnHeader("small", "dense", "int64", ())  # 512 bytes per put
    cap = 1 << 20
    arena = Arena(64 << 20, idle_bytes=0)
    if level == "memory":
        disk = SegmentStore(str(tmp_path), durable=False)
        disk.load()
    else:
        claim_unit_dir(str(tmp_path), 0)
        disk = SegmentStore(str(tmp_path))
        disk.load()
    state = StorageState(arena=arena, disk=disk, memory_cap=cap)
    rows = list(range(64))
    values = {}
    try:
        for k in range(16):  # 4 MiB: four times the cap
            x = np.random.default_rng(k).random((64, 1024), dtype=np.float32)
            ids = np.arange(64, dtype=np.int64) + 1000 * k
            values[k] = x, ids
            region = arena.alloc(align(x.nbytes) + ids.nbytes)  # as a client's grant
            assert region is not None
            spans = [(region.offset, x.nbytes), (region.offset + align(x.nbytes), ids.nbytes)]
            frames = []
            for (off, n), a in zip(spans, (x, ids), strict=True):
                arena.view[off : off + n] = np.frombuffer(a.tobytes(), np.uint8)
                frames.append(arena.span(off, n))
            state.put(f"p{k}", rows, [big, small], frames, region, spans=spans)
            arena.release(region)  # the put's own reference (`ShmPath.put`)
            for j in range(k + 1):  # the small field is read all the time
                state.read(f"p{j}", rows, ["small"])
            assert state.memory_bytes <= cap
            assert arena.live_bytes <= 1.1 * cap, (k, arena.live_bytes)  # deployment.md
        for k, (x, ids) in values.items():  # every cell reads back exactly
            _, (gx, gids) = state.get(f"p{k}", rows, ["big", "small"])
            assert bytes(gx.data) == x.tobytes()  # type: ignore[union-attr]
            assert bytes(gids.data) == ids.tobytes()  # type: ignore[union-attr]
        state.clear("p0", None)
    finally:
        disk.close()
        arena.close()


def test_an_fsync_commit_thread_leaves_the_segment_space_to_the_loop(tmp_path: Path) -> None:
    """At ``fsync`` a group commit runs on a thread of its own (`GroupCommits`) while the
    unit's loop goes on with puts, which grow the space's counters, and compactions, which
    iterate its segments. The thread deleted the dead segments from the space itself,
    racing with them: an update of ``file_bytes`` lost, or a put failing with "dictionary
    changed size during iteration" after its cells were stored. The loop forgets them when
    it takes the commit; the thread only removes their files."""
    import threading

    state = durable(tmp_path, sync=True, segment_bytes=4 << 10)
    disk = state.disk
    assert disk is not None
    for k in range(8):
        put(state, "old", list(range(16 * k, 16 * k + 16)), k)
    disk.commit(disk.begin_commit())
    state.clear("old", None)  # its segments die: deleted by the next commit
    commit = disk.begin_commit()
    assert commit.dead
    space = disk.space
    before = dict(space.sizes), space.file_bytes, dict(space.chunks)
    thread = threading.Thread(target=disk.commit, args=(commit,))
    thread.start()
    thread.join(timeout=10)
    assert (dict(space.sizes), space.file_bytes, dict(space.chunks)) == before
    assert disk.file_bytes == sum(f.stat().st_size for f in tmp_path.glob("seg-*.dat"))
    assert len(list(tmp_path.glob("seg-*.dat"))) == 1  # the files are gone all the same
    disk.close()


def test_a_read_that_fails_leaves_memory_within_the_cap(tmp_path: Path) -> None:
    """A read takes its spilled cells back into memory, and they leave it again once it is
    answered. A read that failed -- over the inline budget a controller in the unit's process
    gives it (`StorageServer.read_local`, on every ``get_meta`` asking for inline cells), or
    naming a row not stored -- left them all in memory past ``memory_cap`` until the unit's
    next put or read. (An inline read now reads nothing from disk: the client that asked
    reads the cells from the unit then, one disk read, not two.)"""
    disk = SegmentStore(str(tmp_path), durable=False)
    disk.load()
    cap = 4 << 10
    state = StorageState(disk=disk, memory_cap=cap)
    model = _fresh(tmp_path, None)
    for k in range(16):  # ~2.5 KiB a put: most of it on disk
        put(state, "p", list(range(64 * k, 64 * k + 64)), k)
        put(model, "p", list(range(64 * k, 64 * k + 64)), k)
    assert state.memory_bytes <= cap
    every = list(range(64 * 16))
    with pytest.raises(_cells.OverBudget):
        state.read("p", every, ["x", "j"], max_bytes=1 << 10)
    assert state.memory_bytes <= cap
    with pytest.raises(_cells.OverBudget):  # even within budget: the client reads them
        state.read("p", every, ["x", "j"], max_bytes=1 << 30)
    assert state.disk_reads == 0  # an inline read reads nothing back from disk
    with pytest.raises(tq.RowsNotFound):
        state.read("p", [*every, 99999], ["x"])
    assert state.memory_bytes <= cap
    assert cells(state, "p", every) == cells(model, "p", every)
    disk.close()


def test_reading_back_from_many_segments_keeps_few_files_open(tmp_path: Path) -> None:
    """Cells read back from disk kept one open file per segment they were read from, for
    as long as the segment lived: a unit spilling a partition much larger than its memory
    (1 TiB is 16k segments of 64 MiB) ran out of file descriptors ("Too many open files",
    reported as a disk problem), and so did its clients' connections."""
    disk = SegmentStore(str(tmp_path), durable=False, segment_bytes=4 << 10)
    disk.load()
    state = StorageState(disk=disk, memory_cap=0)
    model = _fresh(tmp_path, None)
    for k in range(300):  # ~2.5 KiB a put: ~150 segments
        put(state, "p", list(range(64 * k, 64 * k + 64)), k)
        put(model, "p", list(range(64 * k, 64 * k + 64)), k)
    assert len(list(tmp_path.glob("seg-*.dat"))) > 100
    before = len(os.listdir("/proc/self/fd"))
    for k in range(300):
        rows = list(range(64 * k, 64 * k + 64))
        assert cells(state, "p", rows) == cells(model, "p", rows)
        state.evict()
    assert len(os.listdir("/proc/self/fd")) - before <= 64
    disk.close()
