"""A storage unit's durable tier: what its cells write to and read back from a `SegmentStore`.

Functions over a unit (`Unit`: `tq_async._storage._cells.StorageState` is one): a put's
chunks written before it is stored (`write_put`), clears logged (`log_clear`), the index
rewritten once it holds many dead records (`rewrite_index`), the cells taken back after a
restart (`recover`, then `adopt_arena` once the arena file is open), group commits at ``fsync``
level (`begin_commit`, `end_commit`) and segments compacted once mostly dead (`compact`).

The cell index (`tq_async._storage._cell_index.CellIndex`) decides which chunks live; these
functions do the disk's side of it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Protocol

from .._errors import TQError
from .._logging import get_logger
from .._paths._device import DeviceCells
from .._paths._shm import PAGE, Arena, align
from .._wire._columns import column_from_frames, column_to_frames
from ._cell_index import CellIndex, Chunk, PutUndo
from ._segments import ARENA, ClearRecord, Commit, PutRecord, SegmentStore, arena_chunk

__all__ = [
    "Epoch",
    "Unit",
    "adopt_arena",
    "begin_commit",
    "commit_now",
    "compact",
    "end_commit",
    "log_clear",
    "recover",
    "rewrite_index",
    "write_put",
]

log = get_logger(__name__)


class Epoch:
    """At ``fsync``: what the puts of one group commit changed, undone when it fails (a put
    answered with an error changes no cell), and the chunks that died meanwhile, freed once
    it is on the disk (an undone put needs the chunks it overwrote)."""

    __slots__ = ("held", "puts")

    def __init__(self) -> None:
        self.puts: list[PutUndo] = []
        self.held: list[Chunk] = []


class Unit(Protocol):
    """What the durable tier uses of a unit's cells."""

    cells: CellIndex
    disk: SegmentStore | None
    arena: Arena | None
    #: at ``fsync``: the commit in flight (if any), then the one being filled; else empty
    epochs: list[Epoch]

    def free_dead(self) -> None:
        """Release what the chunks on ``cells.dead`` hold."""


def write_put(
    unit: Unit,
    partition_id: str,
    incarnation: str | None,
    rows: Sequence[int],
    chunks: list[Chunk],
    chunk_frames: list[Any],
    chunk_spans: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> None:
    """Write a put's host chunks to disk, data then index record (all or nothing).

    ``chunk_spans``: where each chunk's frames are in the arena, when the caller knows
    (a shared-memory put names them); else they are worked out from the frames.

    Raises:
        StorageFullError: the disk is full: nothing of this put is stored.
    """
    disk = unit.disk
    assert disk is not None
    on_host = [c for c in chunks if c.device is None]
    # cells a client wrote into the arena file are on disk already: only their place
    # is recorded; the others are appended to the segments
    known = chunk_spans if chunk_spans is not None else [None] * len(on_host)
    spans = [
        _arena_spans(unit.arena, c, f, k)
        for c, f, k in zip(on_host, chunk_frames, known, strict=True)
    ]
    written = iter(disk.append([f for f, s in zip(chunk_frames, spans, strict=True) if not s]))
    raw = array("q", rows).tobytes()
    extents, records = [], []
    for c, s in zip(on_host, spans, strict=True):
        if s:
            e, record = arena_chunk(c.header, raw, s)
        else:
            e = next(written)
            record = e.record(c.header, raw)
        extents.append(e)
        records.append(record)
    if any(spans):
        disk.arena_written()
    disk.log(PutRecord(partition_id, incarnation, records))
    for c, e, s in zip(on_host, extents, spans, strict=True):
        c.extent = e
        disk.ref(e)
        if s and c.region is not None:  # its freeing waits for a commit (``defer_frees``)
            c.region.recorded = True


def log_clear(disk: SegmentStore, record: ClearRecord) -> None:
    """Record a clear; on a full disk it is done anyway (clearing is how space comes
    back): a restart may then find those cells again, which nothing refers to."""
    try:
        disk.log(record)
    except TQError as exc:
        log.warning(
            "could not record a clear on disk; the cells are freed now, but a restart may "
            "find them again (unreferenced: only their space is lost until their partition "
            "is cleared again)",
            partition=record.partition,
            error=str(exc),
        )


def rewrite_index(unit: Unit) -> None:
    """Replace the disk's index by one record per live chunk (its dead rows as -1)."""
    assert unit.disk is not None
    try:
        unit.disk.rewrite(unit.cells.live_records())
    except OSError as exc:  # the old index stays: it is still right, only longer
        log.warning("could not rewrite a storage unit's index", error=str(exc))


def recover(unit: Unit) -> int:
    """Take back the cells of ``unit``'s durable store (from its index: the data stays on
    disk until read); returns the chunks recovered."""
    disk, cells = unit.disk, unit.cells
    assert disk is not None
    assert disk.durable
    records = disk.load()
    disk.replaying = True  # until `collect`: a segment may lose its chunks, then take more
    for rec in records:
        if isinstance(rec, ClearRecord):
            cells.clear(rec.partition, rec.rows, rec.incarnation)
        else:
            if rec.incarnation is not None:
                if cells.supersedes(rec.partition, rec.incarnation):
                    cells.clear(rec.partition, None)
                cells.incarnations[rec.partition] = rec.incarnation
            for chunk in cells.restore(rec):
                assert chunk.extent is not None
                disk.ref(chunk.extent)
        unit.free_dead()
    disk.collect()
    if disk.dropped:  # before any new cell may take the dropped ones' place
        rewrite_index(unit)
        if disk.sync:
            commit = disk.begin_commit()
            try:
                disk.commit(commit)
            except TQError as exc:  # a full disk: the unit starts; the next commit has it
                log.warning("could not rewrite a storage unit's index", error=str(exc))
                disk.retry(commit)
                rewrite_index(unit)
    return len(cells.chunks)


def begin_commit(unit: Unit) -> Commit:
    """``unit``'s next group commit (``fsync`` level), with the arena regions freed since the
    last one: their freeing is in its records, so they are reused only after it."""
    assert unit.disk is not None
    commit = unit.disk.begin_commit()
    if unit.epochs:
        commit.epoch = unit.epochs[-1]
        unit.epochs.append(Epoch())
    arena = unit.arena
    if arena is not None and arena.defer_frees:
        commit.freed, arena.deferred = arena.deferred, []
    return commit


def end_commit(unit: Unit, commit: Commit, error: TQError | None = None) -> None:
    """After ``commit`` ran: the chunks that died before it are freed, and its freed
    regions reused. After a failed one its puts are undone (their requests get the error),
    what it had to sync and delete waits for the next one, with the whole index rewritten
    (its clears, compactions: what the cells are now), and its freed regions stay unused (a
    restart may find their old cells again)."""
    epochs, epoch = unit.epochs, commit.epoch
    if isinstance(epoch, Epoch):
        # (a commit of a put from this process may end before the one in flight ended)
        at = next(i for i, e in enumerate(epochs) if e is epoch)
        del epochs[at]
        if error is not None:
            _undo(unit, epoch, epochs[at:])
        elif at == 0:
            _free_held(unit, epoch.held)
        else:  # an earlier commit may still fail: its puts need them
            epochs[0].held += epoch.held
    if error is not None and unit.disk is not None and unit.disk.sync:
        unit.disk.retry(commit)
        rewrite_index(unit)
    arena = unit.arena
    if arena is None or not commit.freed:
        return
    if error is None:
        arena.free_deferred(commit.freed)
    else:
        log.warning(
            "shared memory freed by writes that could not be synced stays unused until the "
            "unit restarts",
            bytes=sum(n for _, n in commit.freed),
            error=str(error),
        )


def commit_now(unit: Unit) -> None:
    """A whole group commit of ``unit`` on this thread (`begin_commit`, the disk's
    ``commit``, `end_commit`).

    Raises:
        StorageFullError: the disk is full (what the commit's puts changed is undone).
        TQError: another I/O error (the same)."""
    assert unit.disk is not None
    commit = begin_commit(unit)
    try:
        unit.disk.commit(commit)
    except TQError as exc:
        end_commit(unit, commit, exc)
        raise
    end_commit(unit, commit)


def _free_held(unit: Unit, held: list[Chunk]) -> None:
    """Free the chunks of ``held`` still dead (each once: one may be listed twice)."""
    dead = unit.cells.dead
    seen: set[int] = set()
    for chunk in held:
        if chunk.live == 0 and id(chunk) not in seen:
            seen.add(id(chunk))
            dead.append(chunk)
    unit.free_dead()


def _undo(unit: Unit, epoch: Epoch, later: list[Epoch]) -> None:
    """Undo the puts of ``epoch`` (its commit failed), the last first; the chunks they
    made die now, those they overwrote live again, the others stay held by the last
    commit (a put of ``later`` may undo its own overwrite of them)."""
    cells = unit.cells
    puts = [p for e in later for p in e.puts]
    for partition_id, rows, fields in reversed(epoch.puts):
        cells.unstore(partition_id, rows, fields, puts)
    dying = {id(c) for c in cells.dead}
    unit.epochs[-1].held += [c for c in epoch.held if c.live == 0 and id(c) not in dying]
    unit.free_dead()


def adopt_arena(unit: Unit, arena: Arena) -> int:
    """``unit``'s arena file is open: the recovered cells in it are views of it again
    (zero copy, no read), their pages reserved; returns the regions reserved.

    Cells of one put share a region; chunks whose pages overlap share one too (a
    rewritten index lists each chunk alone)."""
    unit.arena = arena
    cells = unit.cells
    spans: list[tuple[int, int, int]] = []
    for serial, chunk in cells.chunks.items():
        e = chunk.extent
        if e is not None and e.segment == ARENA and chunk.region is None:
            lo = min((off for off, _ in e.spans), default=e.offset)
            spans.append((lo - lo % PAGE, align(e.end, PAGE), serial))
    spans.sort()
    groups: list[tuple[int, int, list[int]]] = []
    for lo, hi, serial in spans:
        if groups and lo < groups[-1][1]:
            a, b, members = groups[-1]
            members.append(serial)
            groups[-1] = (a, max(b, hi), members)
        else:
            groups.append((lo, hi, [serial]))
    for lo, hi, members in groups:
        region = arena.reserve(lo, hi - lo)
        region.refs = len(members)
        for serial in members:
            chunk = cells.chunks[serial]
            chunk.region = region
            if chunk.column is None:
                assert chunk.extent is not None
                views = [arena.span(off, n) for off, n in chunk.extent.spans]
                chunk.column = column_from_frames(chunk.header, views, chunk.n)
                cells.memory_bytes += chunk.nbytes
    return len(groups)


def _arena_spans(
    arena: Arena | None,
    chunk: Chunk,
    frames: Sequence[Any],
    known: Sequence[tuple[int, int]] | None = None,
) -> list[tuple[int, int]]:
    """Where ``frames`` (of ``chunk``) are in the arena file; [] when they are not all
    there (a memfd arena, or frames that came over a socket). ``known``: the (offset,
    size) of each frame in the arena, as the put named them (else worked out from the
    frames, ~4 us a frame). A frame of no bytes is placed at its region's start."""
    if arena is None or arena.path is None or chunk.region is None or not frames:
        return []
    if known is not None:
        return [(off if n else chunk.region.offset, n) for off, n in known]
    spans = []
    for frame in frames:
        n = memoryview(frame).nbytes
        offset = arena.offset_of(frame) if n else chunk.region.offset
        if offset is None:
            return []
        spans.append((offset, n))
    return spans


def compact(unit: Unit, slack: int, budget: int) -> int:
    """Once ``unit``'s segment files hold more than twice its live chunks' bytes plus
    ``slack`` (cleared rows' space), move the live chunks of mostly dead segments to the
    current one, each with a put record of its live rows (a replay applies it over the first
    one: the same cells), so the old segments die and their files go; at most ``budget``
    bytes. Returns the bytes moved.

    At ``fsync`` the moved chunks' records wait for the next commit, and the old segments
    are deleted only after it (`SegmentStore.release`)."""
    disk = unit.disk
    if disk is None or disk.file_bytes <= max(2 * disk.live_bytes, disk.compacted_at) + slack:
        return 0
    # a pass scans every cell once (which rows each chunk holds): the next one waits for
    # another ``slack`` written after it, however much this one could move (puts call
    # this, so the scan is paid once per ``slack`` bytes at most)
    disk.compacted_at = disk.file_bytes
    targets = set(disk.sparse())
    if not targets:
        return 0
    cells = unit.cells
    moved = 0
    for serial, (pid, rows) in sorted(cells.chunk_rows(targets).items()):
        if moved >= budget:
            break
        chunk = cells.chunks[serial]
        old = chunk.extent
        assert old is not None
        try:
            if chunk.column is not None and not isinstance(chunk.column, DeviceCells):
                frames: list[Any] = list(column_to_frames(chunk.header, chunk.column))
            else:
                frames = disk.read(old)
            (new,) = disk.append([frames])
            if disk.durable:
                record = new.record(chunk.header, rows.tobytes())
                disk.log(PutRecord(pid, cells.incarnations.get(pid), [record]))
        except TQError as exc:  # a full disk: the old segments stay, nothing is lost
            log.warning("could not compact a storage unit's segments", error=str(exc))
            break
        disk.ref(new)
        chunk.extent = new
        disk.release(old)
        moved += old.nbytes
    disk.compacted_at = disk.file_bytes  # after the old files went (process level)
    return moved
