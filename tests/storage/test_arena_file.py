"""A durable unit's shared-memory arena is a file of its data_dir (issue 36), as plain classes.

Cells a same-host client puts through the arena are in the operating system's files when the
put arrives: the unit records where they are (no second copy into a segment), and a unit
restarted on its directory maps them again (no read). At ``fsync`` level a region freed by a
clear is reused only after the commit that recorded the clear; at ``process`` level cells
written in an earlier boot of the machine (its page cache gone) are dropped, and forgotten.
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
from test_segments import DENSE, JAGGED, cells, frames_of

import tq_async as tq
from _cluster_proc import serve_cluster
from tq_async._paths import _shm
from tq_async._paths._shm import PAGE, Arena, ArenaMap
from tq_async._storage import _segments
from tq_async._storage._cells import StorageState, adopt_arena, begin_commit, end_commit
from tq_async._storage._segments import ARENA, ARENA_FILE, PutRecord, SegmentStore, claim_unit_dir

CAP = 256 * PAGE


def open_unit(path: Path, *, sync: bool = False, arena: bool = True) -> StorageState:
    """A durable unit's state on ``path`` as a restarted unit opens it: recover, then map the
    arena file and adopt the recovered cells in it."""
    claim_unit_dir(str(path), 0)
    state = StorageState(disk=SegmentStore(str(path), sync=sync))
    state.recover()
    if arena:
        assert state.disk is not None
        mapped = Arena(CAP, idle_bytes=0, path=str(path / ARENA_FILE), defer_frees=sync)
        state.disk.use_arena()
        adopt_arena(state, mapped)
    return state


def arena_put(
    state: StorageState, pid: str, rows: list[int], seed: int, *, named: bool = True
) -> tuple[int, int]:
    """What `ShmPath.put` does for a client: write the columns into a granted region, store
    views of it naming where they are (``named``: else the unit works it out from the
    views), drop the grant's reference. The region's (offset, size)."""
    arena = state.arena
    assert arena is not None
    parts = frames_of(rows, seed)
    spans = ArenaMap.layout(0, [len(p) for p in parts])
    region = arena.alloc(spans[-1][0] + spans[-1][1])
    assert region is not None
    views = []
    for (off, n), part in zip(spans, parts, strict=True):
        arena.view[region.offset + off : region.offset + off + n] = np.frombuffer(part, np.uint8)
        views.append(arena.span(region.offset + off, n))
    named_spans = [(region.offset + off, n) for off, n in spans] if named else None
    state.put(pid, rows, [DENSE, JAGGED], views, region, incarnation="i1", spans=named_spans)
    arena.release(region)
    return region.offset, region.size


def commit(state: StorageState) -> None:
    """The server's group commit: sync, then reuse the regions its records freed."""
    assert state.disk is not None
    done = begin_commit(state)
    state.disk.commit(done)
    end_commit(state, done)


def close(state: StorageState) -> None:
    assert state.disk is not None
    state.disk.close()
    if state.arena is not None:
        state.arena.close()


def arena_records(path: Path) -> list[Any]:
    store = SegmentStore(str(path))
    records = [r for r in store.load() if isinstance(r, PutRecord)]
    store.close()
    return [c for r in records for c in r.chunks]


@pytest.mark.parametrize("named", [True, False], ids=["spans named", "spans worked out"])
@pytest.mark.parametrize("level", ["process", "fsync"])
def test_cells_put_through_the_arena_file_are_recorded_not_copied(
    tmp_path: Path, level: str, named: bool
) -> None:
    sync = level == "fsync"
    state = open_unit(tmp_path, sync=sync)
    arena_put(state, "p", [0, 1, 2, 3], 10, named=named)
    arena_put(state, "p", [2, 3, 4], 20, named=named)  # overwrites rows 2 and 3
    arena_put(state, "q", [0, 1], 30, named=named)
    state.clear("p", [1])
    if sync:
        commit(state)
    expected = cells(state, "p", [0, 2, 3, 4]), cells(state, "q", [0, 1])
    assert state.disk is not None
    assert state.disk.bytes_written == 0  # no segment holds a byte of them
    assert {c.segment for c in arena_records(tmp_path)} == {ARENA}
    close(state)

    # a unit without shared memory (data_path zmq) reads them from the file
    plain = open_unit(tmp_path, sync=sync, arena=False)
    assert (cells(plain, "p", [0, 2, 3, 4]), cells(plain, "q", [0, 1])) == expected
    close(plain)

    again = open_unit(tmp_path, sync=sync)
    assert again.disk is not None
    assert again.arena is not None
    assert again.disk.bytes_read == 0  # mapped again, not read
    assert (cells(again, "p", [0, 2, 3, 4]), cells(again, "q", [0, 1])) == expected
    # their regions are taken: new puts fill the rest of the arena without touching them
    while again.arena.alloc(PAGE) is not None:
        pass
    assert (cells(again, "p", [0, 2, 3, 4]), cells(again, "q", [0, 1])) == expected
    close(again)


def test_the_spans_a_put_names_are_recorded_as_those_worked_out_from_its_views(
    tmp_path: Path,
) -> None:
    """A shared-memory put names where its frames are (`ShmPath.put`), sparing the unit the
    work of finding them from the views: the records are the same either way."""
    records = []
    for named in (True, False):
        path = tmp_path / str(named)
        path.mkdir()
        state = open_unit(path)
        arena_put(state, "p", [0, 1, 2, 3], 10, named=named)
        arena_put(state, "p", [5], 20, named=named)
        close(state)
        records.append(arena_records(path))
    assert records[0] == records[1]
    assert len(records[0]) == 4  # two puts of two columns


def test_fsync_level_reuses_a_cleared_region_only_after_its_commit(tmp_path: Path) -> None:
    state = open_unit(tmp_path, sync=True)
    arena = state.arena
    assert arena is not None
    offset, size = arena_put(state, "p", [0, 1], 1)
    commit(state)
    state.clear("p", None)  # its record waits for the next commit
    assert arena.deferred == [(offset, size)]
    taken = arena.alloc(size)
    assert taken is not None
    assert taken.offset != offset
    arena.release(taken)
    commit(state)
    assert arena.deferred == []
    again = arena.alloc(size)
    assert again is not None
    assert again.offset == offset
    close(state)


def test_fsync_level_reuses_at_once_a_region_no_record_names(tmp_path: Path) -> None:
    """A read's copy, a grant never used and the tail of a spare trimmed off a put hold no
    recorded cell: nothing waits for a commit to reuse them. (They waited for the next
    put's or clear's commit: a same-host reader at ``fsync`` with no put going on filled
    the arena with its copies, each read after that going over the socket, their pages
    counted nowhere in ``storage_stats``.)"""
    state = open_unit(tmp_path, sync=True)
    arena = state.arena
    assert arena is not None
    arena_put(state, "p", [0, 1], 1)
    arena_put(state, "p", [2], 2)
    commit(state)
    live = arena.live_bytes
    for _ in range(3 * CAP // PAGE):  # more reads than the arena could hold copies of
        got = state.read_shm("p", [0, 1, 2], ["x", "j"], "i1")  # two puts: copied together
        assert got is not None
        _, pinned, _ = got
        for region in pinned:
            arena.release(region)
        grant = arena.alloc(2 * PAGE)  # a grant given back unused
        assert grant is not None
        arena.trim(grant, PAGE)  # (a spare larger than the put it carried)
        arena.release(grant)
    assert arena.deferred == []
    assert arena.live_bytes == live
    state.clear("p", None)  # the cells' regions: only after the clear's commit
    assert len(arena.deferred) == 2
    close(state)


def test_a_region_freed_at_process_level_is_reused_at_once(tmp_path: Path) -> None:
    state = open_unit(tmp_path)
    arena = state.arena
    assert arena is not None
    offset, size = arena_put(state, "p", [0, 1], 1)
    state.clear("p", None)  # recorded before its region is freed
    assert arena.deferred == []
    again = arena.alloc(size)
    assert again is not None
    assert again.offset == offset
    close(state)


def test_process_level_cells_of_another_boot_are_dropped_and_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_segments, "_boot_id", lambda: "boot-a")
    state = open_unit(tmp_path)
    arena_put(state, "p", [0, 1], 1)
    state.put("q", [0], [DENSE, JAGGED], frames_of([0], 2), incarnation="i1")  # a socket put
    close(state)

    monkeypatch.setattr(_segments, "_boot_id", lambda: "boot-b")  # the machine restarted
    with structlog.testing.capture_logs() as logs:
        after = open_unit(tmp_path)
    assert any("machine restarted" in e["event"] for e in logs)
    assert after.stats().rows == 1  # the socket put's row: its segment was written
    assert cells(after, "q", [0]) == cells(after, "q", [0])
    arena_put(after, "r", [7], 3)  # may take the dropped cells' place
    close(after)

    # the index forgot the dropped cells: they never come back over the new ones
    third = open_unit(tmp_path)
    assert third.stats().rows == 2
    assert cells(third, "r", [7])[0] == [[3, 4, 5, 6]]
    close(third)


def test_fsync_level_cells_survive_another_boot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_segments, "_boot_id", lambda: "boot-a")
    state = open_unit(tmp_path, sync=True)
    arena_put(state, "p", [0, 1], 1)
    commit(state)
    expected = cells(state, "p", [0, 1])
    close(state)
    monkeypatch.setattr(_segments, "_boot_id", lambda: "boot-b")
    after = open_unit(tmp_path, sync=True)
    assert cells(after, "p", [0, 1]) == expected
    close(after)


def test_the_arena_files_mark_is_on_the_disk_before_any_cell_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``process`` level: ``arena.boot`` (cells written in this boot only) is synced, renamed
    into place and the directory synced; a machine crash that lost its name would leave no
    mark, and an arena file without one is trusted (its lost cells read back unchecked)."""
    synced: list[str] = []
    fsync = os.fsync

    def record(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    close(open_unit(tmp_path))
    mark = synced.index(str(tmp_path / "arena.boot.tmp"))
    assert str(tmp_path) in synced[mark + 1 :]


def test_an_arena_files_mark_is_written_only_when_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unit restarted on a full disk could not rewrite ``arena.boot`` and went without
    shared memory: a mark that says so already is kept (the directory is synced all the
    same: a killed unit may have renamed it unsynced); one that must change is written."""
    monkeypatch.setattr(_segments, "_boot_id", lambda: "boot-a")
    mark = tmp_path / "arena.boot"
    close(open_unit(tmp_path))
    written = mark.stat().st_ino
    synced: list[str] = []
    fsync = os.fsync

    def record(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    close(open_unit(tmp_path))  # the same boot, the same level
    assert mark.stat().st_ino == written
    assert synced == [str(tmp_path)]
    monkeypatch.setattr(_segments, "_boot_id", lambda: "boot-b")
    close(open_unit(tmp_path))  # another boot
    assert json.loads(mark.read_text()) == {"synced": False, "boot": "boot-b"}
    close(open_unit(tmp_path, sync=True))  # another level
    assert json.loads(mark.read_text()) == {"synced": True}


def test_a_larger_arena_file_keeps_its_size(tmp_path: Path) -> None:
    """A unit restarted with a smaller shm_cap still reaches cells past the new cap."""
    claim_unit_dir(str(tmp_path), 0)
    state = StorageState(disk=SegmentStore(str(tmp_path)))
    state.recover()
    assert state.disk is not None
    big = Arena(2 * CAP, idle_bytes=0, path=str(tmp_path / ARENA_FILE))
    state.disk.use_arena()
    adopt_arena(state, big)
    filler = big.alloc(CAP)  # the next put lands past CAP
    arena_put(state, "p", [0, 1], 5)
    assert filler is not None
    big.release(filler)
    expected = cells(state, "p", [0, 1])
    close(state)
    again = open_unit(tmp_path)  # CAP < the file's size
    assert again.arena is not None
    assert again.arena.cap == 2 * CAP
    assert cells(again, "p", [0, 1]) == expected
    assert os.path.getsize(tmp_path / ARENA_FILE) == 2 * CAP
    close(again)


def test_a_client_writes_a_synced_arena_file_with_pwrite(tmp_path: Path) -> None:
    """At ``fsync`` level the unit says ``write_through``: the client writes puts with
    ``pwrite`` (the file's pages are clean after each commit and would fault if stored to
    through the mapping); the unit sees the bytes through its mapping all the same."""
    arena = Arena(CAP, idle_bytes=0, path=str(tmp_path / ARENA_FILE), defer_frees=True)
    mapped = ArenaMap(os.getpid(), arena.fd, arena.cap, arena.token, write_through=True)
    assert mapped.fd >= 0
    region = arena.alloc(3 * PAGE)
    assert region is not None
    parts = [bytes(range(256)) * 10, b"tail"]
    spans = mapped.write(region.offset, parts)
    assert spans == ArenaMap.layout(0, [len(p) for p in parts])
    for (off, n), part in zip(spans, parts, strict=True):
        assert bytes(arena.span(region.offset + off, n)) == part
    mapped.close()
    assert mapped.fd == -1
    arena.close()


async def test_an_io_error_writing_a_put_into_a_synced_arena_file_is_a_tqerror(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At ``fsync`` level a same-host client writes a put into the unit's arena file with
    ``pwrite``: an I/O error there (the unit's disk failing) reached the caller as a raw
    OSError. A TQError now, saying what to do; nothing was stored, the next put goes through."""
    import torch

    def failing(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    want = torch.arange(64 * 1024).reshape(64, 1024)
    args = ("--durability", "fsync", "--data-dir", str(tmp_path))
    with serve_cluster(1, args) as address:
        async with tq.AsyncClient.connect(address, request_timeout=30) as client:
            with monkeypatch.context() as patch:
                patch.setattr(os, "pwrite", failing)
                with pytest.raises(tq.TQError, match="check the storage unit's disk") as got:
                    await client.put({"x": want + 1}, "p")
            assert not isinstance(got.value, OSError)
            meta = await client.put({"x": want}, "p")
            assert torch.equal((await client.get_data(meta))["x"], want)
            stats = (await client.storage_stats())[0]
            assert (stats["shm_puts"], stats["rows"]) == (1, 64)  # the failed put: nothing


def test_a_group_commit_syncs_only_the_files_written_since_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync of a file with nothing new still flushes the disk's cache (~3 ms on this
    project's VM): a commit after arena puts syncs the arena file, not the segment; one
    after a socket put the segment, not the arena file; both are then clean."""
    state = open_unit(tmp_path, sync=True)
    disk = state.disk
    assert disk is not None
    arena_fd = os.open(disk.arena_path, os.O_RDONLY)
    synced: list[int] = []
    real = os.fdatasync

    def recording(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", recording)
    arena_ino = os.fstat(arena_fd).st_ino
    os.close(arena_fd)
    index_ino = os.stat(tmp_path / _segments._INDEX).st_ino

    arena_put(state, "p", [0, 1], 1)
    commit(state)
    assert synced == [arena_ino, index_ino]

    synced.clear()
    state.put("q", [0], [DENSE, JAGGED], frames_of([0], 2), incarnation="i1")  # a socket put
    commit(state)
    assert arena_ino not in synced
    assert synced[-1] == index_ino
    assert len(synced) == 2  # the segment, then the index

    rows_before = state.stats().rows
    close(state)
    again = open_unit(tmp_path, sync=True)
    assert again.stats().rows == rows_before == 3
    close(again)


class _Fallocate:
    """The arena's `fallocate` seam: records the spans it reserves; fails with ENOSPC while
    ``full`` (a full disk, without root)."""

    def __init__(self) -> None:
        self.full = False
        self.spans: list[tuple[int, int]] = []

    def __call__(self, fd: int, offset: int, length: int) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.spans.append((offset, length))
        os.posix_fallocate(fd, offset, length)


def test_an_arena_file_lends_only_regions_whose_disk_blocks_are_reserved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The arena file is sparse and mapped shared: a store into a page the full disk has no
    block for kills the process storing (SIGBUS), a client copying a put or the unit copying
    a read. A region's blocks are reserved before it is lent; on a full disk none is (the
    caller uses the socket, where a put fails with StorageFullError). Pages reserved and kept
    idle are not reserved again; pages given back (a hole again) are."""
    seam = _Fallocate()
    monkeypatch.setattr(_shm, "fallocate", seam)
    arena = Arena(CAP, idle_bytes=4 * PAGE, path=str(tmp_path / ARENA_FILE))
    assert seam.spans == [(0, PAGE)]  # the token's page, before it is written
    region = arena.alloc(3 * PAGE)
    assert region is not None
    assert seam.spans[-1] == (region.offset, 3 * PAGE)
    arena.release(region)  # idle: its blocks stay
    seam.full = True
    again = arena.alloc(3 * PAGE)  # reserved already: lent on a full disk too
    assert again is not None
    assert again.offset == region.offset
    live = arena.live_bytes
    assert arena.alloc(4 * PAGE) is None  # fresh pages: no room for them
    assert arena.live_bytes == live
    seam.full = False
    fresh = arena.alloc(4 * PAGE)  # the refused region was left free
    assert fresh is not None
    assert fresh.offset == region.offset + 3 * PAGE
    assert seam.spans[-1] == (fresh.offset, 4 * PAGE)
    arena.release(again)
    arena.release(fresh)  # past idle_bytes: given back (a hole again)
    n = len(seam.spans)
    big = arena.alloc(7 * PAGE)
    assert big is not None
    assert big.offset == region.offset
    assert seam.spans[n:] == [(fresh.offset, 4 * PAGE)]  # only the pages given back
    arena.close()


def test_an_arena_file_whose_blocks_fail_for_another_reason_says_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``posix_fallocate`` failing for another reason than a full disk (an I/O error, a file
    system that refuses it) left every same-host put on the socket without a word: a
    warning now, once, with the reason (a full disk says so where the put fails)."""
    arena = Arena(CAP, idle_bytes=0, path=str(tmp_path / ARENA_FILE))
    seam = _Fallocate()
    monkeypatch.setattr(_shm, "fallocate", seam)
    seam.full = True
    with structlog.testing.capture_logs() as logs:
        assert arena.alloc(PAGE) is None
    assert not logs  # a full disk: the put fails on the socket with StorageFullError

    def failing(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_shm, "fallocate", failing)
    with structlog.testing.capture_logs() as logs:
        assert arena.alloc(PAGE) is None
        assert arena.alloc(2 * PAGE) is None
    (warning,) = logs
    assert warning["log_level"] == "warning"
    assert "Input/output error" in warning["error"]
    arena.close()


def test_an_arena_file_whose_first_page_has_no_room_is_an_oserror(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new arena file on a full disk: an OSError naming the file (the unit starts without
    shared memory), not a SIGBUS when its token is written."""
    seam = _Fallocate()
    seam.full = True
    monkeypatch.setattr(_shm, "fallocate", seam)
    path = tmp_path / ARENA_FILE
    with pytest.raises(OSError, match="arena's first page") as got:
        Arena(CAP, path=str(path))
    assert got.value.errno == errno.ENOSPC
    assert got.value.filename == str(path)
