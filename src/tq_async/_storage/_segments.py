"""A storage unit's cells on disk: append-only segment files and an index log.

A plain class (`SegmentStore`) that owns the files under one directory; it knows chunks
(one column of one put) by where their bytes are (`Extent`), never partitions or rows' meaning:
the unit's cells (`tq_async._storage._cells`) decide what to write, keep and read back.

Files:

- ``seg-NNNNNNNN.dat``: append-only data, each chunk's frames back to back. A new segment is
  started past ``segment_bytes``; a segment none of whose chunks is alive any more is deleted
  (a cleared partition's space comes back).
- ``index.log``: one record per put (its chunks: header, rows, extent, crc32 of the bytes) and
  per clear, each ``[length u32][crc32 u32][msgpack]`` (`tq_async._storage._index_frames`).
  A unit restarted on its directory reads this file only, never the data. When it holds
  many more records than live chunks it is rewritten (one record per live chunk; written
  aside, then renamed over the old one).
- ``arena.dat``: the unit's shared-memory arena (`tq_async._paths._shm.Arena` on a file): cells
  a same-host client put through shared memory are already in this file when the put
  arrives, so they are not written again: their index record names where they are in it
  (segment 0, `ARENA`, one offset per frame, no checksum). ``arena.boot`` says whether the
  arena's cells are all on the disk (``fsync``) or only in the OS's page cache (``process``,
  with the boot it was written in): after a machine crash the page cache is gone and the
  ``process`` level's arena cells with it, so they are dropped with a warning, never read torn.
- ``tq-async-data-dir.json``: the marker saying which unit the directory belongs to, and its
  instance token (`claim_unit_dir`).

Order of writes: a put's data, then its index record. At ``process`` level both go to the
operating system at once (``write()``, no fsync): a SIGKILL loses nothing written. At
``fsync`` level index records wait in memory for the next group commit (`begin_commit` then
`commit`, run off the event loop): the data segments (and the arena file) are fsynced first,
then the records are written and the index fsynced, so an index record on disk always names
data on disk; every put waiting for that commit shares its two fsyncs. (An arena region freed
at ``fsync`` level is reused only after the commit of the record that freed it: see
``defer_frees`` of `tq_async._paths._shm.Arena`.)

A torn tail (a record cut short or with a bad checksum at the end of the index, a chunk whose
bytes lie past the end of its segment) can only hold writes nobody acknowledged: `load`
drops it with a warning. A bad record followed by whole ones is no torn tail (a crash only
cuts the end: the disk damaged it) and `load` refuses it (`TQError`): dropping what follows
would lose acknowledged puts, and skipping the bad one could serve values it overwrote. A
chunk's bytes are checked against its crc32 when read back.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .._errors import StorageFullError, TQError
from .._logging import get_logger
from .._paths._dirs import sync_dir
from .._wire._columns import ColumnHeader
from ._dir_marker import MARKER, claim_unit_dir
from ._gone_cells import GoneCells
from ._index_frames import check_torn, frame, frames
from ._segment_space import SegmentSpace

__all__ = [
    "ARENA",
    "ARENA_FILE",
    "MARKER",
    "ChunkRecord",
    "ClearRecord",
    "Commit",
    "Extent",
    "PutRecord",
    "SegmentStore",
    "claim_unit_dir",
]

log = get_logger(__name__)

_INDEX = "index.log"
#: the segment number of cells in the unit's arena file (data segments start at 1)
ARENA = 0
ARENA_FILE = "arena.dat"
_ARENA_BOOT = "arena.boot"
#: the crc of a chunk that has none (cells in the arena file)
NO_CRC = -1
#: most segment files a store keeps open for reading (the least recently read is closed)
_READERS = 32


class Extent(msgspec.Struct, frozen=True):
    """Where a chunk's bytes are: ``segment``, from ``offset``, frames of ``sizes`` bytes
    back to back, or each at its own offset (``offsets``: cells in the arena file).

    (A struct: made for every chunk of every durable put, where a frozen dataclass's
    ``__init__`` cost 8x as much.)"""

    segment: int
    offset: int
    sizes: tuple[int, ...]
    crc: int
    offsets: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    @property
    def spans(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of each frame in its file."""
        if self.offsets is not None:
            return list(zip(self.offsets, self.sizes, strict=True))
        out, pos = [], self.offset
        for n in self.sizes:
            out.append((pos, n))
            pos += n
        return out

    @property
    def end(self) -> int:
        """Where the chunk's last byte ends in its file."""
        return max(off + n for off, n in self.spans) if self.sizes else self.offset

    def record(self, header: ColumnHeader, rows: bytes) -> ChunkRecord:
        """The index record of a chunk stored here."""
        offsets = None if self.offsets is None else list(self.offsets)
        return ChunkRecord(
            header, rows, self.segment, self.offset, list(self.sizes), self.crc, offsets
        )


def arena_chunk(
    header: ColumnHeader, rows: bytes, spans: Sequence[tuple[int, int]]
) -> tuple[Extent, ChunkRecord]:
    """The extent and the index record of a chunk of ``rows`` whose frames are at ``spans``
    (offset, size) of the arena file."""
    offsets = [off for off, _ in spans]
    sizes = [n for _, n in spans]
    extent = Extent(ARENA, offsets[0], tuple(sizes), NO_CRC, tuple(offsets))
    return extent, ChunkRecord(header, rows, ARENA, offsets[0], sizes, NO_CRC, offsets)


class ChunkRecord(msgspec.Struct, array_like=True):
    """One chunk of a put: its column header, rows (int64, machine order; -1: a position no
    longer alive, in a rewritten index) and its extent."""

    header: ColumnHeader
    rows: bytes
    segment: int
    offset: int
    sizes: list[int]
    crc: int
    #: each frame's offset (cells in the arena file); None: back to back from ``offset``
    offsets: list[int] | None = None

    @property
    def extent(self) -> Extent:
        offsets = None if self.offsets is None else tuple(self.offsets)
        return Extent(self.segment, self.offset, tuple(self.sizes), self.crc, offsets)


class PutRecord(msgspec.Struct, array_like=True, tag=0):
    """A put's chunks (all of them or none: one record)."""

    partition: str
    incarnation: str | None
    chunks: list[ChunkRecord]


class ClearRecord(msgspec.Struct, array_like=True, tag=1):
    """A clear (``rows`` None: the whole partition)."""

    partition: str
    rows: list[int] | None
    incarnation: str | None


Record = PutRecord | ClearRecord
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def _frame(record: Record) -> bytes:
    return frame(_encoder.encode(record))


@dataclass(slots=True)
class Commit:
    """What one group commit makes durable (taken on the event loop, written off it)."""

    fds: list[int]
    records: list[bytes]
    #: file descriptors of full segments, closed once synced
    closing: list[int] = field(default_factory=list)
    #: dead segments, deleted once the index no longer needs them (already forgotten by the
    #: store's space when the commit is taken: its thread only removes their files)
    dead: list[int] = field(default_factory=list)
    #: the whole index, rewritten (None: ``records`` are appended)
    rewrite: list[bytes] | None = None
    #: sync the directory too (a segment file was created: its name must be on the disk)
    sync_dir: bool = False
    #: arena regions freed by the records it writes: reusable once it is on the disk
    #: (`tq_async._storage._durable.begin_commit` fills it, `end_commit` frees them)
    freed: list[tuple[int, int]] = field(default_factory=list)
    #: the puts it answers (`tq_async._storage._durable.Epoch`, undone if it fails)
    epoch: Any = None


class SegmentStore:
    """The segment files and index of one directory (see the module docstring).

    Args:
        directory: where the files are (claimed by the caller).
        durable: write an index (a unit restarted on the directory finds its cells); False: a
            scratch store for spilled cells, nothing to recover.
        sync: fsync level: index records wait for `commit` (group commit).
        segment_bytes: a new segment file is started past this size.
        write: ``write(fd, buffer) -> bytes written`` (``os.write``; tests inject failures).
    """

    def __init__(
        self,
        directory: str,
        *,
        durable: bool = True,
        sync: bool = False,
        segment_bytes: int = 64 << 20,
        write: Callable[[int, Any], int] = os.write,
    ) -> None:
        self.directory = directory
        self.durable = durable
        self.sync = sync
        self.segment_bytes = segment_bytes
        self._write = write
        #: the files' bytes and the live chunks in each (a segment with none is deleted, the
        #: current one kept)
        self.space = SegmentSpace()
        #: files open for reading
        self._readers = _Readers(self._path)
        self._segment = 0
        self._fd = -1
        self._size = 0
        self._index_fd = -1
        #: where the index ends, past a failed write that could not be cut back (-1: none)
        self._index_end = -1
        #: index records written (or waiting for the next commit) since the last rewrite
        self.records = 0
        #: fsync level: records and finished segments waiting for the next commit
        self._pending: list[bytes] = []
        self._closing: list[int] = []
        self._dead: list[int] = []
        self._rewrite: list[bytes] | None = None
        #: held from `begin_commit` to the end of its `commit`: commits run one at a time, in
        #: the order they were taken (the index's records stay in order)
        self._commit_lock = threading.Lock()
        #: the arena file (`use_arena`): fsynced with the segments, read for recovered cells
        self.arena_path = os.path.join(directory, ARENA_FILE)
        self._arena_fd = -1
        #: the current segment has bytes the next commit must sync
        self._unsynced = False
        #: the arena file holds cells the next commit must sync (a sync of a file with
        #: nothing new still costs a disk cache flush: ~3 ms here)
        self._arena_unsynced = False
        #: a file was created since the directory was last synced
        self._new_file = False
        #: set by whoever replays `load`'s records until its `collect` (see `release`)
        self.replaying = False
        #: `load` dropped chunks whose bytes are gone: the index must be rewritten before
        #: new cells may take their place (the arena reuses space)
        self.dropped = False
        #: the data segments the loaded index names (until `collect`)
        self._named: set[int] = set()
        #: `file_bytes` after the last compaction pass (`tq_async._storage._durable.compact`)
        self.compacted_at = 0
        self.bytes_written = 0
        self.bytes_read = 0

    # ---- opening -----------------------------------------------------------------------------

    def load(self) -> list[PutRecord | ClearRecord]:
        """Read the index (never the data): its records in order, the torn tail dropped.

        Opens the files for writing: new data goes to a new segment.
        """
        records: list[PutRecord | ClearRecord] = []
        sizes = self._segment_sizes()
        if self.durable and ARENA in sizes and not _arena_trusted(self.directory):
            del sizes[ARENA]  # its chunks are dropped by `_whole`, with a warning
        path = os.path.join(self.directory, _INDEX)
        # the highest segment a record names (its file may be gone: all its chunks dead)
        named = 0
        missing = {"gone": 0, "short": 0, "lost": 0}
        new_index = self.durable and _new_index(path, sizes)
        if self.durable and not new_index:
            with open(path, "rb") as f:
                data = f.read()
            records, good, named = _parse_index(data, sizes, missing)
            if good < len(data):
                check_torn(data, good, path, _decoder.decode)
                log.warning(
                    "discarded the torn tail of a storage unit's index (a write cut short by a "
                    "crash: nothing in it was acknowledged)",
                    index=path,
                    kept_bytes=good,
                    dropped_bytes=len(data) - good,
                )
                with open(path, "r+b") as f:
                    f.truncate(good)
        if missing["gone"] or missing["short"]:
            self.dropped = True  # the index is rewritten without them (after this load)
        # a segment of dead chunks is deleted while the records naming them stay until the
        # index is rewritten: only cells no later record cleared or overwrote were lost
        if missing["lost"] or missing["short"]:
            log.warning(
                "discarded cells of a storage unit whose bytes are missing from their segment "
                "(segment gone: cells that died before it was deleted, or a segment deleted "
                "by hand; cut short: a write a crash interrupted, never acknowledged)",
                data_dir=self.directory,
                segment_gone=missing["lost"],
                cut_short=missing["short"],
            )
        self.records = len(records)
        self._named = {c.segment for r in records if isinstance(r, PutRecord) for c in r.chunks}
        self.space.found({n: size for n, size in sizes.items() if n != ARENA})
        # never a number a record still names: a new file under a dead segment's name would
        # take the dead chunks' records as its own on the next restart (and be deleted when
        # they die again during the replay, live cells with it)
        self._segment = max(named, max((n for n in sizes if n != ARENA), default=0))
        if self.durable:
            self._index_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            if new_index and self.sync:
                sync_dir(self.directory)  # its name is on the disk before any segment's
        self._roll()
        return records

    def _segment_sizes(self) -> dict[int, int]:
        out = {}
        with contextlib.suppress(FileNotFoundError):
            out[ARENA] = os.path.getsize(self.arena_path)
        for name in os.listdir(self.directory):
            if name.startswith("seg-") and name.endswith(".dat"):
                try:
                    out[int(name[4:-4])] = os.path.getsize(os.path.join(self.directory, name))
                except ValueError:
                    continue
        return out

    def _path(self, segment: int) -> str:
        if segment == ARENA:
            return self.arena_path
        return os.path.join(self.directory, f"seg-{segment:08d}.dat")

    # ---- the arena file ------------------------------------------------------------------------

    def use_arena(self) -> None:
        """The unit's arena is the file `arena_path` from now on: say whether its cells are
        synced (``fsync``: once what this boot wrote is synced) or only written in this boot.

        A mark that says so already is not written again (a unit restarted on a full disk
        keeps its shared memory): it was synced before it was renamed into place, and the
        directory is synced all the same (a killed unit may have renamed it unsynced).

        Raises:
            OSError: the mark cannot be written (the unit goes without shared memory)."""
        if self._arena_fd < 0:
            self._arena_fd = os.open(self.arena_path, os.O_RDWR | os.O_CLOEXEC)
        if self.sync:
            os.fdatasync(self._arena_fd)
        mark = {"synced": True} if self.sync else {"synced": False, "boot": _boot_id()}
        path = os.path.join(self.directory, _ARENA_BOOT)
        if _read_mark(path) != mark:
            _write_mark(path, mark)
        sync_dir(self.directory)  # the arena file's name and its mark's (else a crash trusts it)

    def _roll(self) -> None:
        """Start the next segment file (the full one is closed, after its sync at fsync).

        Raises:
            OSError: the file cannot be made (the current one stays)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        fd = os.open(self._path(self._segment + 1), flags, 0o644)
        if self._fd >= 0:
            if self.sync:
                self._closing.append(self._fd)
            else:
                os.close(self._fd)
            if not self.space.chunks.get(self._segment):
                self._gone(self._segment)
        self._segment += 1
        self._fd = fd
        self._size = 0
        self.space.grew(self._segment, 0)
        self._new_file = True  # its name reaches the disk with the directory's next sync

    # ---- writing -----------------------------------------------------------------------------

    def append(self, chunks: Sequence[Sequence[Any]]) -> list[Extent]:
        """Write the frames of ``chunks`` to the current segment (to the OS: no fsync).

        All or nothing: after a failure the segment is cut back to where it was.

        Raises:
            StorageFullError: the disk is full (ENOSPC, EDQUOT).
            TQError: another I/O error.
        """
        if self._size >= self.segment_bytes:
            try:
                self._roll()
            except OSError as exc:
                raise _io_error(exc, self.directory, "making a segment file") from exc
        start = pos = self._size
        extents = []
        try:
            for frames in chunks:
                sizes = []
                crc = 0
                offset = pos
                for frame in frames:
                    view = memoryview(frame).cast("B")
                    crc = zlib.crc32(view, crc)
                    self._write_all(view)
                    sizes.append(view.nbytes)
                    pos += view.nbytes
                extents.append(Extent(self._segment, offset, tuple(sizes), crc))
        except OSError as exc:
            if not self._cut(self._fd, start):
                # the file ends past what the store knows: cells appended after it would be
                # recorded where they are not; the next put starts a new segment
                self._size = self.segment_bytes
            raise _io_error(exc, self.directory, "writing cells") from exc
        self._size = pos
        self.space.grew(self._segment, pos)
        self._unsynced |= pos > start
        self.bytes_written += pos - start
        return extents

    def arena_written(self) -> None:
        """A put's cells were recorded in the arena file: the next commit syncs it."""
        self._arena_unsynced = True

    def _write_all(self, view: memoryview) -> None:
        done = 0
        while done < view.nbytes:
            done += self._write(self._fd, view[done:])

    def _cut(self, fd: int, size: int) -> bool:
        """Cut a failed write back to ``size``; whether it could be."""
        try:
            os.ftruncate(fd, size)
        except OSError as exc:  # the index never names what is past ``size``: only waste
            log.warning("could not cut back a failed write", error=str(exc), dir=self.directory)
            return False
        return True

    def log(self, record: PutRecord | ClearRecord) -> None:
        """Add ``record`` to the index: now (process level) or at the next commit (fsync).

        Raises:
            StorageFullError: the disk is full (the index is cut back: nothing half-written).
        """
        if not self.durable:
            return
        frame = _frame(record)
        self.records += 1
        if self.sync:
            self._pending.append(frame)
            return
        try:
            self._append_index(frame)
        except OSError as exc:
            raise _io_error(exc, self.directory, "writing the index") from exc

    def _append_index(self, blob: bytes, *, sync: bool = False) -> None:
        """Append ``blob`` to the index (then fdatasync it, with ``sync``), all or nothing: a
        failed write is cut back, before the next one when it could not be at once (a record
        torn in the middle of the index would stop the next start).

        Raises:
            OSError: the write failed, or a failed one still cannot be cut back."""
        fd = self._index_fd
        size = self._index_end
        if size >= 0:
            if not self._cut(fd, size):
                raise OSError(errno.EIO, "a failed write cannot be cut back from the index")
            self._index_end = -1
        else:
            size = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(blob)
            done = 0
            while done < len(blob):
                done += self._write(fd, view[done:])
            if sync:
                os.fdatasync(fd)
        except OSError:
            if not self._cut(fd, size):
                self._index_end = size
            raise

    @property
    def pending(self) -> bool:
        """Whether a commit has something to do (fsync level)."""
        return bool(self._pending or self._closing or self._dead or self._rewrite is not None)

    def begin_commit(self) -> Commit:
        """Take what the next commit writes (on the event loop; `commit` runs in a thread).

        Waits for a commit still running; every `begin_commit` must be followed by its
        `commit` (which releases the next one)."""
        self._commit_lock.acquire()
        fds = [self._fd] if self._unsynced else []
        if self._arena_fd >= 0 and self._arena_unsynced:
            fds.append(self._arena_fd)
        self._unsynced = self._arena_unsynced = False
        commit = Commit(fds, self._pending, self._closing, self._dead, self._rewrite)
        commit.sync_dir, self._new_file = self._new_file, False
        self._pending, self._closing, self._dead, self._rewrite = [], [], [], None
        # forgotten here, on the loop: the commit's thread only removes their files (the
        # loop's puts and compactions use the space meanwhile)
        for segment in commit.dead:
            self._forget(segment)
        return commit

    def commit(self, commit: Commit) -> None:
        """Make ``commit`` durable: data fsynced, then index records written and fsynced.

        Raises:
            StorageFullError: the disk is full.
            TQError: another I/O error.
        """
        try:
            self._commit(commit)
        finally:
            self._commit_lock.release()

    def _commit(self, commit: Commit) -> None:
        try:
            # fdatasync: the data and what reading it needs (the size), not the timestamps
            # (fsync would commit the file system's journal for an mtime change on every put)
            for fd in [*commit.fds, *commit.closing]:
                os.fdatasync(fd)
            if commit.sync_dir:
                sync_dir(self.directory)
            if commit.rewrite is not None:
                # the rewrite holds every record before it; those logged since follow it
                self._replace_index([*commit.rewrite, *commit.records])
            elif commit.records:
                self._append_index(b"".join(commit.records), sync=True)
        except OSError as exc:  # (`retry` takes it up again)
            raise _io_error(exc, self.directory, "syncing cells") from exc
        for fd in commit.closing:
            os.close(fd)
        for segment in commit.dead:
            self._remove(segment)

    def retry(self, commit: Commit) -> None:
        """``commit`` failed (on the event loop, after it): the next one syncs its files
        and the directory, and deletes its dead segments; its records are dropped (the
        caller rewrites the index, or logs them again)."""
        if self._fd in commit.fds:  # (a segment finished since is on ``_closing``)
            self._unsynced = True
        if self._arena_fd >= 0 and self._arena_fd in commit.fds:
            self._arena_unsynced = True
        self._closing[:0] = commit.closing
        self._dead[:0] = commit.dead
        self._new_file |= commit.sync_dir

    def rewrite(self, records: Sequence[PutRecord | ClearRecord]) -> None:
        """Replace the index with ``records`` (one per live chunk: the old ones are dead)."""
        frames = [_frame(r) for r in records]
        if self.sync:
            self._pending = []
            self._rewrite = frames
        else:
            self._replace_index(frames)
        self.records = len(frames)

    def _replace_index(self, frames: list[bytes]) -> None:
        path = os.path.join(self.directory, _INDEX)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        try:
            blob = memoryview(b"".join(frames))
            done = 0
            while done < len(blob):
                done += self._write(fd, blob[done:])
            if self.sync:
                os.fsync(fd)
            os.replace(tmp, path)
        except OSError:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        # appended to through the descriptor that wrote it: nothing after the rename may fail
        # and leave the store appending to the old file, gone from the directory
        old, self._index_fd = self._index_fd, fd
        self._index_end = -1  # (a new file: whole)
        os.close(old)
        if self.sync:
            try:
                sync_dir(self.directory)
            except OSError:
                self._new_file = True  # (the rename reaches the disk with the next commit)
                raise

    # ---- chunks' lives -----------------------------------------------------------------------

    def ref(self, extent: Extent) -> None:
        """A chunk stored at ``extent`` is alive."""
        self.space.ref(extent)

    def release(self, extent: Extent) -> None:
        """The chunk at ``extent`` is dead; its segment goes when it held the last one."""
        if not self.space.release(extent):
            return
        # the arena's space is the arena's; while a restart replays the index, a segment
        # may hold no live chunk for a while and then take new ones (it was the current one
        # then): `collect` deletes what is dead once the replay is over
        if extent.segment not in (self._segment, ARENA) and not self.replaying:
            self._gone(extent.segment)

    @property
    def live_bytes(self) -> int:
        """Bytes of live chunks in the segment files."""
        return self.space.live_bytes

    @property
    def file_bytes(self) -> int:
        """Bytes of the data segments' files (live chunks and dead ones)."""
        return self.space.file_bytes

    def sparse(self) -> list[int]:
        """Finished segments less than half of whose bytes are live chunks', the emptiest
        first (`tq_async._storage._durable.compact` moves their live chunks)."""
        return self.space.sparse(self._segment)

    def collect(self) -> None:
        """Delete every segment no live chunk is in (after a restart's records are applied:
        the replay `load` began is over)."""
        self.replaying = False
        for segment in self._segment_sizes():
            if segment not in (self._segment, ARENA) and segment not in self.space.chunks:
                self._unlink(segment)
                # its records go with the index's rewrite: a later start would take the cells
                # they name (all dead) for cells missing from their segment
                self.dropped |= segment in self._named
        self._named = set()

    def _gone(self, segment: int) -> None:
        if self.sync:
            self._dead.append(segment)  # the index may still name it until the next commit
        else:
            self._unlink(segment)

    def _unlink(self, segment: int) -> None:
        self._forget(segment)
        self._remove(segment)

    def _forget(self, segment: int) -> None:
        """``segment`` is no data segment any more (its file goes: `_remove`)."""
        self.space.gone(segment)
        self._readers.forget(segment)

    def _remove(self, segment: int) -> None:
        _delete(self._path(segment))

    # ---- reading -----------------------------------------------------------------------------

    def read(self, extent: Extent) -> list[memoryview]:
        """The frames of the chunk at ``extent`` (one read; checked against its crc32).

        Raises:
            TQError: the bytes are damaged or cannot be read.
        """
        try:
            fd = self._readers.open(extent.segment)
            view = memoryview(bytearray(extent.nbytes))
            done = 0
            for offset, n in extent.spans:
                got = 0
                while got < n:
                    k = os.preadv(fd, [view[done + got : done + n]], offset + got)
                    if k == 0:
                        break
                    got += k
                done += got
                if got < n:
                    break
        except OSError as exc:
            raise _io_error(exc, self.directory, "reading cells back") from exc
        if done < extent.nbytes or (extent.crc != NO_CRC and zlib.crc32(view) != extent.crc):
            raise TQError(
                f"cells in {self._path(extent.segment)} at offset {extent.offset} are damaged "
                "(checksum mismatch): the disk lost them; these rows cannot be read, clear them "
                "and put them again"
            )
        self.bytes_read += extent.nbytes
        frames = []
        pos = 0
        for n in extent.sizes:
            frames.append(view[pos : pos + n])
            pos += n
        return frames

    def close(self) -> None:
        """Close every file (a scratch store's directory is removed by its owner)."""
        for fd in [self._fd, self._index_fd, self._arena_fd, *self._closing]:
            if fd >= 0:
                os.close(fd)
        self._fd = self._index_fd = self._arena_fd = -1
        self._closing = []
        self._readers.close()


class _Readers:
    """Segment files open for reading, the least recently read first: at most ``_READERS``
    (a unit may spill to thousands of segments). ``path``: a segment's file."""

    def __init__(self, path: Callable[[int], str]) -> None:
        self._path = path
        self._fds: OrderedDict[int, int] = OrderedDict()

    def open(self, segment: int) -> int:
        """A descriptor of ``segment``'s file (raises OSError)."""
        fds = self._fds
        fd = fds.get(segment)
        if fd is None:
            fd = fds[segment] = os.open(self._path(segment), os.O_RDONLY)
            if len(fds) > _READERS:
                os.close(fds.popitem(last=False)[1])
        else:
            fds.move_to_end(segment)
        return fd

    def forget(self, segment: int) -> None:
        """``segment``'s file goes: close it, if open."""
        fd = self._fds.pop(segment, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _parse_index(
    data: bytes, sizes: dict[int, int], missing: dict[str, int]
) -> tuple[list[PutRecord | ClearRecord], int, int]:
    """The records of an index file's bytes, up to a torn tail: each without the chunks whose
    bytes are not in ``sizes`` (`_whole`: counted in ``missing``); the bytes they take, and
    the highest segment a record names."""
    records: list[PutRecord | ClearRecord] = []
    good = named = 0
    gone = GoneCells()
    for rec, end in frames(data, _decoder.decode):
        if isinstance(rec, PutRecord):
            named = max(named, max((c.segment for c in rec.chunks), default=0))
        whole = _whole(rec, sizes, missing)
        if isinstance(rec, ClearRecord):
            gone.cleared(rec.partition, rec.rows)
        else:
            assert isinstance(whole, PutRecord)
            gone.put(rec.partition, rec.incarnation, rec.chunks, whole.chunks)
        records.append(whole)
        good = end
    missing["lost"] = gone.count()
    return records, good, named


def _whole(
    rec: PutRecord | ClearRecord, sizes: dict[int, int], missing: dict[str, int]
) -> PutRecord | ClearRecord:
    """``rec`` without chunks whose bytes are not (all) in their segment; ``missing`` counts
    them: ``"gone"`` (the segment was deleted: its chunks died before, or by hand) and
    ``"short"`` (a write cut short by a crash)."""
    if isinstance(rec, ClearRecord):
        return rec
    whole = []
    for c in rec.chunks:
        size = sizes.get(c.segment)
        if size is None:
            missing["gone"] += 1
        elif c.extent.end > size:
            missing["short"] += 1
        else:
            whole.append(c)
    if len(whole) < len(rec.chunks):
        return PutRecord(rec.partition, rec.incarnation, whole)
    return rec


def _new_index(index: str, sizes: dict[int, int]) -> bool:
    """Whether ``index`` is missing: a new store's. `TQError` if segment files (of ``sizes``)
    hold bytes (an index is made before the first segment and only ever replaced by a rename,
    no crash removes it): without it their cells cannot be found, and a unit starting empty
    would be taken for the one that holds them."""
    if os.path.exists(index):
        return False
    held = sorted(n for n, size in sizes.items() if n != ARENA and size)
    if held:
        raise TQError(
            f"the storage unit's index {index} is missing, but {len(held)} segment files in "
            f"{os.path.dirname(index)} hold cells it would name (seg-{held[0]:08d}.dat...): "
            "restore index.log from a backup, or move the data_dir away to start an empty unit "
            "(the controller then counts the rows it held lost)"
        )
    return True


def _arena_trusted(directory: str) -> bool:
    """Whether the arena file of ``directory`` holds what its records say: synced at
    ``fsync`` level, or written at ``process`` level in this boot (the page cache survived)."""
    mark = _read_mark(os.path.join(directory, _ARENA_BOOT))
    if mark is None:
        return True  # no arena cells were ever recorded
    boot = _boot_id()
    if isinstance(mark, dict) and (mark.get("synced") or (boot and mark.get("boot") == boot)):
        return True
    log.warning(
        "the machine restarted since this storage unit's shared-memory cells were written "
        "at durability 'process' (the page cache holding them is gone): they are dropped; "
        "use durability 'fsync' to keep cells across a machine crash",
        data_dir=directory,
    )
    return False


def _write_mark(path: str, mark: dict[str, Any]) -> None:
    """Write the arena file's mark: synced aside, then renamed into place (the caller syncs
    the directory)."""
    with open(path + ".tmp", "w") as f:
        json.dump(mark, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _read_mark(path: str) -> Any:
    """The arena file's mark at ``path`` (None: none was ever written; {}: unreadable)."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def _delete(path: str) -> None:
    """Delete a dead segment's file; one that cannot be is left (a warning: only its space
    is lost, a restart deletes it: `SegmentStore.collect`)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not delete a dead segment file", error=str(exc), path=path)


def _boot_id() -> str:
    """This boot of the machine (a page cache written in another boot is gone)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""  # unknown: never equal to a recorded boot, so never trusted unsynced


def _io_error(exc: OSError, directory: str, doing: str) -> TQError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFullError(
            f"the storage unit's disk is full ({doing} under {directory}): this request was not "
            "stored, and nothing acknowledged before it is lost; free space on that disk (or "
            "clear partitions you no longer need) and put again"
        )
    return TQError(
        f"the storage unit could not use its data_dir {directory} ({doing}: {exc}); check the "
        "disk, then put again"
    )
