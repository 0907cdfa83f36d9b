"""The cells of a storage unit: a plain, socket-free store (testable alone).

A unit keeps what it received: each put becomes one *chunk* per column, holding views of the
message's frames (no copy, no re-serialisation). An index (`tq_async._storage._cell_index`)
maps ``(partition, field, row)`` to ``(chunk, position)``. Reading rows that are one run of
one chunk sends a view of it (zero copy); other selections are gathered once into one buffer.
A chunk is freed when its last row is cleared or overwritten.

A put through the unit's shared-memory arena (`tq_async._paths._shm`) stores views of an
arena region (freed with the last chunk); `StorageState.read_shm` answers a read with
arena spans instead of frames. Bytes that leave through a socket are copied out of the arena
first, since a region may be reused as soon as its rows are gone.

Tiers. A unit with a durable `SegmentStore` (``data_dir`` at durability
``process`` / ``fsync``) writes each put's chunks to its segment files before the put is
stored (so before it is acknowledged), and logs clears; a unit restarted on the directory
gets its cells back with `StorageState.recover` (from the index: the chunks stay on disk until
read). The disk's side of this is `tq_async._storage._durable`. With ``memory_cap``, chunks
in RAM past the cap leave it, least recently used first (spilled: to a scratch store at
``memory`` level, already on disk otherwise), and are read back when a get needs them
(`tq_async._storage._tiers`). Eviction runs after a put or a read, never inside
`StorageState.get`: a read's views (and the arena regions they pin) stay valid until it is
answered. Cells in the device arena stay there (never written, never spilled).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator, Sequence
from typing import Any, TypeAlias

import numpy as np

from .._errors import InvalidRequestError, ProtocolError, RowsNotFound, SchemaError
from .._logging import get_logger
from .._paths._device import DeviceArena, DeviceCells, DeviceJaggedCells
from .._paths._nixl import UnitNixl
from .._paths._shm import PAGE, Arena, Region, align
from .._transport._hosts import LOCALITY_KEYS
from .._wire._columns import (
    DENSE,
    JAGGED,
    Column,
    ColumnHeader,
    JaggedColumn,
    column_frame_count,
    column_from_frames,
    column_nbytes,
    column_to_frames,
    frame_buffer,
    join_columns,
    take_rows,
)
from .._wire._protocol import StoredColumns, StoreStatsReply
from ._cell_index import CELL_BITS, POSITION, CellIndex, Chunk, FieldUndo
from ._durable import (
    Epoch,
    adopt_arena,
    begin_commit,
    commit_now,
    compact,
    end_commit,
    log_clear,
    recover,
    rewrite_index,
    write_put,
)
from ._segments import ClearRecord, SegmentStore
from ._tiers import evict, load
from ._unit_stats import unit_stats

__all__ = [
    "DevicePut",
    "OverBudget",
    "StorageState",
    "adopt_arena",
    "begin_commit",
    "commit_now",
    "end_commit",
]

#: a put's device arena grant and, by column position, its cells' span in the arena
DevicePut: TypeAlias = tuple[Region, dict[int, tuple[int, int]]]

log = get_logger(__name__)

# when a put or a clear starts a pass of the durable tier (read on each call: tests lower them)
#: the index is rewritten once it holds this many records more than twice the live chunks
_REWRITE_SLACK = 4096
#: segments are compacted once their files hold this many bytes more than twice the live
#: chunks', at most ``_COMPACT_BUDGET`` bytes moved by one pass (on the unit's event loop;
#: `tq_async._storage._durable.compact`)
_COMPACT_SLACK = 64 << 20
_COMPACT_BUDGET = 64 << 20


class OverBudget(Exception):
    """A read limited to some bytes would take more (internal: the caller reads otherwise)."""


def _joined_nbytes(pieces: Sequence[Column]) -> int:
    """``column_nbytes(concat_columns(pieces))``, computed on the views (no copy)."""
    size = sum(column_nbytes(p) for p in pieces)
    if isinstance(pieces[0], JaggedColumn):
        size -= 8 * (len(pieces) - 1)  # one offsets array of n + 1, not one per piece
    return size


class StorageState:
    """The cells of one unit; synchronous and socket-free (testable alone).

    Args:
        allow_pickle: accept pickled columns.
        arena: the unit's shared memory, if any (regions of chunks are released into it).
        disk: where cells go on disk: a durable store (every put is written, clears are
            logged, `recover` reads it back) or a scratch one (spilled cells only).
        memory_cap: most bytes of cells kept in memory (None: no bound); needs ``disk``.
        instance: the unit's instance token (default: a new random one; a durable unit's
            comes from its directory, so that the controller knows its cells survived).
    """

    def __init__(
        self,
        *,
        allow_pickle: bool = False,
        arena: Arena | None = None,
        disk: SegmentStore | None = None,
        memory_cap: int | None = None,
        instance: str | None = None,
    ) -> None:
        if memory_cap is not None and (memory_cap < 0 or disk is None):
            raise InvalidRequestError(
                f"memory_cap must be >= 0 and needs a disk to spill to, got {memory_cap}"
            )
        self.allow_pickle = allow_pickle
        #: random per process: the controller tells a resumed unit from a restarted one
        self.instance = instance or secrets.token_hex(8)
        self.arena = arena
        self.disk = disk
        #: written on every put (a durable store), not only when spilled
        self._durable = disk is not None and disk.durable
        #: at ``fsync``: the group commit in flight (if any), then the one being filled
        self.epochs = [Epoch()] if self._durable and disk is not None and disk.sync else []
        self.memory_cap = memory_cap
        #: where each cell is, and the chunks' lives (see `CellIndex`)
        self.cells = CellIndex(lru=memory_cap is not None)
        # the index's own dicts (never replaced), one attribute away in the read loop
        self._chunks, self._lru = self.cells.chunks, self.cells.lru
        #: chunks spilled from memory, and chunks read back from disk
        self.spills = 0
        self.disk_reads = 0
        #: the unit's device arena, if any (see `tq_async._paths._device`; set by the server)
        self.device: DeviceArena | None = None
        #: the unit's NIXL agent with the arena registered (set by the server; None: no NIXL)
        self.nixl: UnitNixl | None = None
        #: locality: the unit's host id, and payload bytes moved by where the client runs
        self.host = ""
        self.locality = dict.fromkeys(LOCALITY_KEYS, 0)
        #: the same for reads, by the task that read (``StoreGet.task``)
        self.task_locality: dict[str, dict[str, int]] = {}

    @property
    def resident_bytes(self) -> int:
        """Bytes of the cells held (in memory, on a device or on disk only)."""
        return self.cells.resident_bytes

    @property
    def memory_bytes(self) -> int:
        """Bytes of cells in host memory (the arena or message frames, not a device)."""
        return self.cells.memory_bytes

    def _adopt(self, partition_id: str, incarnation: str | None) -> None:
        """A put of ``incarnation``: cells of an older one still here are dropped."""
        if incarnation is None:
            return
        if self.cells.supersedes(partition_id, incarnation):
            self.clear(partition_id, None)
        self.cells.incarnations[partition_id] = incarnation

    def put(
        self,
        partition_id: str,
        rows: Sequence[int],
        headers: Sequence[ColumnHeader],
        frames: Any,
        region: Region | None = None,
        *,
        incarnation: str | None = None,
        device: DevicePut | None = None,
        spans: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Store columns for ``rows`` (frames in header order). All-or-nothing.

        ``region``: the arena region ``frames`` are views of; each stored chunk takes a
        reference (the caller keeps its own). ``spans``: where in the arena each frame is
        (offset, size), when the caller knows (a durable unit records them instead of
        working them out from the frames). ``device``: a device arena region and, by
        header position, where in it a column's cells are (those columns have no frames);
        each of their chunks takes a reference of it.

        Raises:
            RowsNotFound: ``incarnation`` (of the partition) was cleared meanwhile.
        """
        self._adopt(partition_id, incarnation)
        n = len(rows)
        if n == 0:
            raise InvalidRequestError("a put needs at least one row")
        if len(set(rows)) != n:
            raise InvalidRequestError("a put lists the same row twice")
        on_device = device[1] if device is not None else {}
        expected = sum(
            _device_frame_count(h) if i in on_device else column_frame_count(h)
            for i, h in enumerate(headers)
        )
        if expected != len(frames):
            raise ProtocolError(f"StorePut carries {len(frames)} frames, its header {expected}")
        chunks: list[Chunk] = []
        chunk_frames: list[Any] = []
        chunk_spans: list[Sequence[tuple[int, int]]] | None = None if spans is None else []
        pos = 0
        for i, h in enumerate(headers):
            if h.kind == "pickle" and not self.allow_pickle:
                raise SchemaError(
                    f"field {h.name!r} is pickled but this storage unit does not allow pickle; "
                    "start it with allow_pickle=True in trusted deployments only"
                )
            if i in on_device:
                assert device is not None
                k = _device_frame_count(h)
                placed = _device_cells(h, *on_device[i], n, frames[pos : pos + k])
                chunks.append(Chunk(h, placed, None, device[0]))
                pos += k
                continue
            k = column_frame_count(h)
            chunks.append(Chunk(h, column_from_frames(h, frames[pos : pos + k], n), region))
            chunk_frames.append(frames[pos : pos + k])
            if chunk_spans is not None:
                assert spans is not None
                chunk_spans.append(spans[pos : pos + k])
            pos += k
        if self._durable and chunk_frames:
            write_put(self, partition_id, incarnation, rows, chunks, chunk_frames, chunk_spans)
        if region is not None:
            shared = [c for c in chunks if c.region is not None]
            region.refs += len(shared)
            if self.memory_cap is not None and len(shared) > 1:
                for c in shared:
                    c.siblings = shared
        if device is not None:
            device[0].refs += len(on_device)
        cells = self.cells
        if self.epochs:  # fsync: undone if its commit fails
            undo: list[FieldUndo] = []
            cells.store(partition_id, rows, chunks, undo)
            self.epochs[-1].puts.append((partition_id, rows, undo))
        else:
            cells.store(partition_id, rows, chunks)
        if cells.dead:  # overwritten cells
            self._bury(overwritten=True)
        self.evict()
        compact(self, _COMPACT_SLACK, _COMPACT_BUDGET)  # overwritten cells leave dead chunks too

    def _bury(self, *, overwritten: bool = False) -> None:
        """Free the dead chunks; at ``fsync`` those a put not yet committed overwrote
        (``overwritten``: all of them) once the next commit is on the disk (they live
        again if it fails: see `tq_async._storage._durable.Epoch`)."""
        epochs, dead = self.epochs, self.cells.dead
        if epochs and not overwritten:
            kept = {
                id(c)
                for e in epochs
                for *_, fields in e.puts
                for *_, o in fields
                for c in o.values()
            }
            if kept:
                epochs[-1].held += [c for c in dead if id(c) in kept]
                dead[:] = [c for c in dead if id(c) not in kept]
        elif epochs:
            epochs[-1].held += dead
            dead.clear()
        self.free_dead()

    def free_dead(self) -> None:
        """Release what the chunks whose last cell went hold (`CellIndex.dead`): their arena
        region, device arena region, disk extent."""
        arena, device, disk = self.arena, self.device, self.disk
        for chunk in self.cells.dead:
            if chunk.region is not None and arena is not None:
                arena.release(chunk.region)
            chunk.region = None
            if chunk.device is not None and device is not None:
                device.release(chunk.device)
            chunk.device = None
            if chunk.extent is not None and disk is not None:
                disk.release(chunk.extent)
            chunk.extent = None
        self.cells.dead.clear()

    # ---- tiers -------------------------------------------------------------------------------

    def evict(self) -> None:
        """Move the least recently used chunks out of memory until it holds ``memory_cap``
        (`tq_async._storage._tiers.evict`)."""
        evict(self)

    def _load(self, serial: int, chunk: Chunk) -> Column:
        """Read a spilled chunk back into memory (it is the most recently used now)."""
        return load(self, serial, chunk)

    def recover(self) -> int:
        """Take back the cells of a durable store (from its index: the data stays on disk
        until read); returns the chunks recovered."""
        return recover(self)

    def get(
        self,
        partition_id: str,
        rows: Sequence[int],
        fields: Sequence[str],
        *,
        max_bytes: int | None = None,
        incarnation: str | None = None,
        touched: list[Chunk] | None = None,
        device_ok: bool = False,
        jagged_ok: bool = True,
    ) -> tuple[list[ColumnHeader], list[Column | list[DeviceCells]]]:
        """Columns for ``fields`` of ``rows`` in that order (views when possible).

        ``touched`` collects the chunks read (to pin their arena regions). Cells in the
        device arena are copied to the host, unless ``device_ok``: then a field whose cells
        all are there (with one row shape) comes as their pieces, a list of DeviceCells
        (a jagged field only with ``jagged_ok``: older readers take dense ones only).

        Raises:
            RowsNotFound: a row is not stored, or ``incarnation`` (of the partition, None:
                not checked) was cleared, its id maybe reused since.
            OverBudget: the cells take more than ``max_bytes`` (checked on the views, before
                anything is copied together), or some are on disk only (a read limited in
                bytes is an inline one: it reads nothing back from disk).
        """
        budget = max_bytes
        from_disk = max_bytes is None
        self.cells.check(partition_id, incarnation)
        stored = self.cells.index.get(partition_id)
        if stored is None:
            raise RowsNotFound(
                f"this storage unit holds nothing of partition {partition_id!r} (cleared?)"
            )
        headers: list[ColumnHeader] = []
        columns: list[Column | list[DeviceCells]] = []
        for name in fields:
            index = stored.get(name)
            if index is None:
                raise RowsNotFound(f"field {name!r} of partition {partition_id!r} is not stored")
            pieces: list[Column | DeviceCells] = []
            piece_headers: list[ColumnHeader] = []
            for start, end in _runs(index, rows, name, partition_id):
                self._take(start, end, pieces, piece_headers, touched, from_disk)
            if not pieces:  # no rows requested
                raise InvalidRequestError("a get needs at least one row")
            on_device = [p for p in pieces if isinstance(p, DeviceCells)]
            if budget is not None:
                if on_device:  # a reader on this host takes them device to device
                    raise OverBudget("cells in the device arena are not sent inline")
                budget -= _joined_nbytes(pieces)  # type: ignore[arg-type]
                if budget < 0:
                    raise OverBudget(f"the cells take more than {max_bytes} bytes")
            if on_device:
                if (
                    device_ok
                    and (jagged_ok or piece_headers[0].kind != JAGGED)
                    and len(on_device) == len(pieces)
                    and len(set(piece_headers)) == 1
                ):
                    headers.append(piece_headers[0])
                    columns.append(on_device)
                    continue
                host = [
                    _to_host(self.device, h, p) for h, p in zip(piece_headers, pieces, strict=True)
                ]
            else:
                host = pieces  # type: ignore[assignment]
            # rows put with different shapes: dense if they share one, else jagged
            header, column = join_columns(piece_headers, host)
            headers.append(header)
            columns.append(column)
        return headers, columns

    @contextlib.contextmanager
    def _evicting_on_failure(self) -> Iterator[None]:
        """Around a `get` whose reply is built here: when it fails, what it read back from
        disk leaves memory again (nothing holds a view of it: no reply follows to evict
        after)."""
        try:
            yield
        except BaseException:
            self.evict()
            raise

    def _take(
        self,
        start: int,
        end: int,
        pieces: list[Column | DeviceCells],
        headers: list[ColumnHeader],
        touched: list[Chunk] | None,
        from_disk: bool = True,
    ) -> None:
        """Append the cells ``[start, end)`` (one chunk's) to ``pieces`` (``from_disk``:
        read back from disk if they are there only; else `OverBudget`)."""
        serial = start >> CELL_BITS
        chunk = self._chunks[serial]
        a = start & POSITION
        column = chunk.column
        if column is None:
            if not from_disk:
                raise OverBudget("cells on disk are not sent inline")
            column = self._load(serial, chunk)
        elif self._lru is not None and serial in self._lru:
            self._lru.move_to_end(serial)
        if isinstance(column, DeviceCells):
            pieces.append(column.rows(a, a + end - start))
        else:
            pieces.append(take_rows(column, [(a, a + end - start)]))
        headers.append(chunk.header)
        if touched is not None:
            touched.append(chunk)

    def read(
        self,
        partition_id: str,
        rows: Sequence[int],
        fields: Sequence[str],
        *,
        max_bytes: int | None = None,
        incarnation: str | None = None,
    ) -> tuple[StoredColumns, list[Any]]:
        """`get`, as it travels: the reply's header and the columns' frames."""
        with self._evicting_on_failure():
            headers, columns = self.get(
                partition_id, rows, fields, max_bytes=max_bytes, incarnation=incarnation
            )
        frames: list[Any] = []
        for h, c in zip(headers, columns, strict=True):
            assert not isinstance(c, list)  # device_ok=False: host columns only
            frames.extend(column_to_frames(h, c))
        arena = self.arena
        if arena is not None:
            # a region may be reused once its rows are gone: what leaves by socket is a copy
            frames = [bytes(f) if arena.offset_of(f) is not None else f for f in frames]
        self.evict()
        return StoredColumns(len(rows), headers), frames

    def read_shm(
        self,
        partition_id: str,
        rows: Sequence[int],
        fields: Sequence[str],
        incarnation: str | None = None,
        *,
        device_ok: bool = False,
        jagged_ok: bool = True,
    ) -> tuple[StoredColumns, list[Region], list[Region]] | None:
        """`get` as arena spans: views of regions where the cells already are, the
        rest copied into a new region. Returns the reply, the regions to pin (each holding
        one more reference) and the device arena regions to pin (likewise), or None when
        the arena has no room (read by socket).

        With ``device_ok``, fields whose cells are in the device arena stay there: the reply
        lists their spans in it (`StoredColumns.device_spans`), and they have no
        frames.
        """
        arena = self.arena
        assert arena is not None
        touched: list[Chunk] = []
        with self._evicting_on_failure():
            headers, columns = self.get(
                partition_id,
                rows,
                fields,
                touched=touched,
                incarnation=incarnation,
                device_ok=device_ok,
                jagged_ok=jagged_ok,
            )
        frames: list[Any] = []
        device_spans: list[list[tuple[int, int]]] = []
        device_offsets: list[bytes | None] = []
        for h, c in zip(headers, columns, strict=True):
            device_offsets.append(_joined_offsets(c) if isinstance(c, list) else None)
            if isinstance(c, list):
                device_spans.append([(p.offset, p.nbytes) for p in c])
            else:
                device_spans.append([])
                frames.extend(column_to_frames(h, c))
        placed = _place(arena, frames)
        if placed is None:
            return None
        spans, copy = placed
        pinned = list({id(c.region): c.region for c in touched if c.region is not None}.values())
        for region in pinned:
            region.refs += 1
        if copy is not None:
            pinned.append(copy)
        self.evict()  # the reply's regions are pinned: what leaves memory now is safe
        stored = StoredColumns(len(rows), headers, shm_spans=spans)
        on_device: list[Region] = []
        if any(device_spans):
            stored.device_spans = device_spans
            if any(o is not None for o in device_offsets):
                stored.device_offsets = device_offsets
            on_device = list(
                {id(c.device): c.device for c in touched if c.device is not None}.values()
            )
            for region in on_device:
                region.refs += 1
        return stored, pinned, on_device

    def clear(
        self, partition_id: str, rows: Sequence[int] | None, *, incarnation: str | None = None
    ) -> int:
        """Free rows (all rows of the partition when None); returns rows freed.

        With ``incarnation``, only that incarnation's cells: a clear arriving after a newer
        incarnation's put frees nothing of it.
        """
        cells = self.cells
        freed = cells.clear(partition_id, rows, incarnation)
        if freed is None:
            return 0
        disk = self.disk
        if self._durable:
            assert disk is not None
            log_clear(
                disk, ClearRecord(partition_id, None if rows is None else list(rows), incarnation)
            )
        self._bury()
        if (
            self._durable
            and disk is not None
            and disk.records > 2 * len(cells.chunks) + _REWRITE_SLACK
        ):
            rewrite_index(self)
        compact(self, _COMPACT_SLACK, _COMPACT_BUDGET)
        return freed

    def stats(self) -> StoreStatsReply:
        """The unit's counters (see `tq_async._storage._unit_stats`)."""
        return unit_stats(self)


def _runs(
    index: Any, rows: Sequence[int], name: str, partition_id: str
) -> Iterator[tuple[int, int]]:
    """``rows``' cells of field ``name`` as runs of consecutive cells of one chunk: cells
    ``[start, end)``, in the order of ``rows``.

    Raises:
        RowsNotFound: a row of ``rows`` is not stored.
    """
    start = end = -1
    for r in rows:
        try:
            cell = index[r]
        except KeyError:
            raise RowsNotFound(
                f"row {r} of field {name!r} in partition {partition_id!r} is not stored "
                "(never written, or cleared)"
            ) from None
        if cell == end:  # the next position in the same chunk
            end += 1
            continue
        if start >= 0:
            yield start, end
        start, end = cell, cell + 1
    if start >= 0:
        yield start, end


def _to_host(
    device: DeviceArena | None, header: ColumnHeader, piece: Column | DeviceCells
) -> Column:
    """``piece`` in host memory (cells in ``device``, the unit's device arena, are copied
    out)."""
    if not isinstance(piece, DeviceCells):
        return piece
    assert device is not None  # device cells exist only while the arena does
    device.fallbacks += 1
    if isinstance(piece, DeviceJaggedCells):
        values = device.read(piece.offset, piece.nbytes)
        offsets = piece.offsets - piece.offsets[0]
        return column_from_frames(header, [values, offsets], piece.n)
    return column_from_frames(header, [device.read(piece.offset, piece.nbytes)], piece.n)


def _place(arena: Arena, frames: list[Any]) -> tuple[list[tuple[int, int]], Region | None] | None:
    """Where ``frames`` are in ``arena``, as ``(offset, size)`` spans: views of the arena
    where they are, the others copied into one new region (returned: the reader pins it).
    None when the arena has no room for the copies."""
    offsets = [arena.offset_of(f) for f in frames]
    sizes = [memoryview(f).nbytes for f in frames]
    extra = sum(align(n) for off, n in zip(offsets, sizes, strict=True) if off is None and n)
    copy: Region | None = None
    if extra:
        copy = arena.alloc(extra)
        if copy is None:
            return None
    spans: list[tuple[int, int]] = []
    pos = copy.offset if copy is not None else 0
    for f, off, n in zip(frames, offsets, sizes, strict=True):
        if n == 0:
            spans.append((PAGE, 0))
        elif off is not None:
            spans.append((off, n))
        else:
            arena.view[pos : pos + n] = np.frombuffer(memoryview(f).cast("B"), np.uint8)
            spans.append((pos, n))
            pos += align(n)
    return spans, copy


def _device_frame_count(header: ColumnHeader) -> int:
    """Frames of a column whose cells are in the device arena: a jagged one's offsets."""
    return 1 if header.kind == JAGGED else 0


def _device_cells(
    header: ColumnHeader, offset: int, nbytes: int, n: int, frames: Sequence[Any]
) -> DeviceCells:
    """The cells of ``n`` rows a put left in the device arena at ``[offset, +nbytes)`` (a
    dense column's span is checked against its rows already); a jagged column's offsets
    (its one frame) are checked against the span and copied (the frame may be a view of
    shared memory the chunk does not hold)."""
    if header.kind == DENSE:
        return DeviceCells(offset, header.item_bytes(), n)
    if header.kind != JAGGED:
        raise ProtocolError(f"field {header.name!r} on a device must be dense or jagged")
    item = header.item_bytes()
    raw = np.frombuffer(frame_buffer(frames[0]), dtype=np.uint8)
    if raw.nbytes != (n + 1) * 8:
        raise ProtocolError(f"the offsets of field {header.name!r} are not {n + 1} int64")
    offsets = raw.view(np.int64).copy()
    if (
        int(offsets[0]) != 0
        or bool((offsets[1:] < offsets[:-1]).any())
        or int(offsets[-1]) * item != nbytes
    ):
        raise ProtocolError(f"field {header.name!r} has jagged offsets that disagree with its span")
    return DeviceJaggedCells(offset, item, offsets)


def _joined_offsets(pieces: list[DeviceCells]) -> bytes | None:
    """The offsets (int64, from 0) of a jagged column read as device ``pieces``, joined in
    row order (None: a dense column)."""
    jagged = [p for p in pieces if isinstance(p, DeviceJaggedCells)]
    if not jagged:
        return None
    lengths = np.concatenate([np.diff(p.offsets) for p in jagged])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets.tobytes()
