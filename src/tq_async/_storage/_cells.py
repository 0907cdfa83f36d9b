"""The cells of a storage unit: a plain, socket-free store (testable alone).

A unit keeps what it received: each put becomes one *chunk* per column, holding views of the
message's frames (no copy, no re-serialisation). An index maps ``(partition, field, row)`` to
``(chunk, position)``. Reading rows that are one run of one chunk sends a view of it (zero
copy); other selections are gathered once into one buffer. A chunk is freed when its last row
is cleared or overwritten.

A put through the unit's shared-memory arena (`tq_async._paths._shm`) stores views of an
arena region (freed with the last chunk); `StorageState.read_shm` answers a read with
arena spans instead of frames. Bytes that leave through a socket are copied out of the arena
first, since a region may be reused as soon as its rows are gone.

Tiers. A unit with a durable `SegmentStore` (``data_dir`` at durability
``process`` / ``fsync``) writes each put's chunks to its segment files before the put is
stored (so before it is acknowledged), and logs clears; a unit restarted on the directory
gets its cells back with `StorageState.recover` (from the index: the chunks stay on disk until
read). With ``memory_cap``, chunks in RAM past the cap leave it, least recently used first
(spilled: to a scratch store at ``memory`` level, already on disk otherwise), and are read back
when a get needs them. Eviction runs after a put or a read, never inside `StorageState.get`:
a read's views (and the arena regions they pin) stay valid until it is answered. Cells in the
device arena stay there (never written, never spilled).
"""

from __future__ import annotations

import itertools
import math
import secrets
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._core._state import stale_incarnation
from .._errors import InvalidRequestError, ProtocolError, RowsNotFound, SchemaError, TQError
from .._logging import get_logger
from .._paths._device import DeviceArena, DeviceCells
from .._paths._nixl import UnitNixl
from .._paths._shm import PAGE, Arena, Region, align
from .._transport._hosts import LOCALITY_KEYS
from .._wire._columns import (
    ITEM_SIZES,
    Column,
    ColumnHeader,
    JaggedColumn,
    column_frame_count,
    column_from_frames,
    column_nbytes,
    column_to_frames,
    join_columns,
    take_rows,
)
from .._wire._protocol import StoredColumns, StoreStatsReply
from ._segments import (
    ARENA,
    ClearRecord,
    Commit,
    Extent,
    PutRecord,
    SegmentStore,
    arena_extent,
)

__all__ = ["OverBudget", "StorageState", "adopt_arena", "begin_commit", "compact", "end_commit"]

log = get_logger(__name__)

#: cleared incarnations remembered per unit (a late put into one of them is refused)
_RETIRED = 4096
#: the index is rewritten once it holds this many records more than twice the live chunks
_REWRITE_SLACK = 4096
#: segments are compacted once their files hold this many bytes more than twice the live
#: chunks', at most ``_COMPACT_BUDGET`` bytes moved by one clear (on the unit's event loop)
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


#: a cell is ``chunk serial << _CELL_BITS | position in the chunk``
_CELL_BITS = 32
_POSITION = (1 << _CELL_BITS) - 1


class _Chunk:
    __slots__ = ("column", "device", "extent", "header", "live", "n", "nbytes", "region")

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
        self.memory_cap = memory_cap
        #: bytes of cells in memory (host memory: the arena or message frames, not a device)
        self.memory_bytes = 0
        #: chunks in memory that may leave it, least recently used first (with memory_cap)
        self._lru: OrderedDict[int, _Chunk] = OrderedDict()
        #: chunks spilled from memory, and chunks read back from disk
        self.spills = 0
        self.disk_reads = 0
        self._replaying = False
        #: the unit's device arena, if any (see `tq_async._paths._device`; set by the server)
        self.device: DeviceArena | None = None
        #: the unit's NIXL agent with the arena registered (set by the server; None: no NIXL)
        self.nixl: UnitNixl | None = None
        #: locality: the unit's host id, and payload bytes moved by where the client runs
        self.host = ""
        self.locality = dict.fromkeys(LOCALITY_KEYS, 0)
        #: the same for reads, by the task that read (``StoreGet.task``)
        self.task_locality: dict[str, dict[str, int]] = {}
        # partition -> field -> row -> cell: ``serial << 32 | position`` of the row in the
        # chunk ``_chunks[serial]`` (a plain int: a tuple holding the chunk would be one more
        # object for the garbage collector to scan, per cell -- most of a 1M-row put)
        self._index: dict[str, dict[str, dict[int, int]]] = {}
        self._chunks: dict[int, _Chunk] = {}
        self._serials = itertools.count(1)
        self.resident_bytes = 0
        #: the partition incarnation whose cells ``_index[partition]`` holds (when known)
        self._incarnation: dict[str, str] = {}
        #: incarnations cleared (or replaced by a newer one) lately: their puts are refused
        self._retired: OrderedDict[tuple[str, str], None] = OrderedDict()

    def _retire(self, partition_id: str, incarnation: str) -> None:
        self._retired[(partition_id, incarnation)] = None
        if len(self._retired) > _RETIRED:
            self._retired.popitem(last=False)

    def _check_incarnation(self, partition_id: str, incarnation: str | None) -> None:
        """Raise `RowsNotFound` when ``incarnation`` is not the one held."""
        if incarnation is None:
            return
        held = self._incarnation.get(partition_id)
        if held is not None and held != incarnation:
            raise RowsNotFound(stale_incarnation(partition_id))
        if (partition_id, incarnation) in self._retired:
            raise RowsNotFound(
                f"partition {partition_id!r} was cleared since this BatchMeta was made (its id "
                "may have been re-created since): its rows are gone; fetch a new BatchMeta"
            )

    def _adopt(self, partition_id: str, incarnation: str | None) -> None:
        """A put of ``incarnation``: cells of an older one still here are dropped.

        The controller creates a new incarnation only after clearing the old one, so cells
        of another incarnation belong to a cleared partition whose StoreClear is late.
        """
        if incarnation is None:
            return
        if (partition_id, incarnation) in self._retired:
            self._check_incarnation(partition_id, incarnation)
        held = self._incarnation.get(partition_id)
        if held == incarnation:
            return
        if held is not None:
            self.clear(partition_id, None)
        self._incarnation[partition_id] = incarnation

    def put(
        self,
        partition_id: str,
        rows: Sequence[int],
        headers: Sequence[ColumnHeader],
        frames: Any,
        region: Region | None = None,
        *,
        incarnation: str | None = None,
        device: tuple[Region, dict[int, int]] | None = None,
    ) -> None:
        """Store columns for ``rows`` (frames in header order). All-or-nothing.

        ``region``: the arena region ``frames`` are views of; each stored chunk takes a
        reference (the caller keeps its own). ``device``: a device arena region and, by
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
        expected = sum(column_frame_count(h) for i, h in enumerate(headers) if i not in on_device)
        if expected != len(frames):
            raise ProtocolError(f"StorePut carries {len(frames)} frames, its header {expected}")
        chunks: list[_Chunk] = []
        chunk_frames: list[Any] = []
        pos = 0
        for i, h in enumerate(headers):
            if h.kind == "pickle" and not self.allow_pickle:
                raise SchemaError(
                    f"field {h.name!r} is pickled but this storage unit does not allow pickle; "
                    "start it with allow_pickle=True in trusted deployments only"
                )
            if i in on_device:
                assert device is not None
                if h.kind != "dense":
                    raise ProtocolError(f"field {h.name!r} on a device must be dense")
                cells = DeviceCells(on_device[i], ITEM_SIZES[h.dtype] * math.prod(h.shape), n)
                chunks.append(_Chunk(h, cells, None, device[0]))
                continue
            k = column_frame_count(h)
            chunks.append(_Chunk(h, column_from_frames(h, frames[pos : pos + k], n), region))
            chunk_frames.append(frames[pos : pos + k])
            pos += k
        if self._durable and not self._replaying and chunk_frames:
            self._write(partition_id, incarnation, rows, chunks, chunk_frames)
        if region is not None:
            region.refs += sum(c.region is not None for c in chunks)
        if device is not None:
            device[0].refs += len(on_device)
        fields = self._index.setdefault(partition_id, {})
        for chunk in chunks:
            index = fields.setdefault(chunk.header.name, {})
            serial = self._add(chunk)
            # cells overwritten release their old chunk; the index is then updated in one C
            # loop (a Python loop over a 1M-row put took most of its time)
            for r in index.keys() & rows:
                self._drop(index[r] >> _CELL_BITS)
            first = serial << _CELL_BITS
            index.update(zip(rows, range(first, first + n), strict=True))
        self.evict()
        compact(self)  # overwritten cells leave dead chunks too

    def _write(
        self,
        partition_id: str,
        incarnation: str | None,
        rows: Sequence[int],
        chunks: list[_Chunk],
        chunk_frames: list[Any],
    ) -> None:
        """Write a put's host chunks to disk, data then index record (all or nothing).

        Raises:
            StorageFullError: the disk is full: nothing of this put is stored.
        """
        disk = self.disk
        assert disk is not None
        on_host = [c for c in chunks if c.device is None]
        # cells a client wrote into the arena file are on disk already: only their place
        # is recorded; the others are appended to the segments
        spans = [_arena_spans(self.arena, c, f) for c, f in zip(on_host, chunk_frames, strict=True)]
        written = iter(disk.append([f for f, s in zip(chunk_frames, spans, strict=True) if not s]))
        extents = [arena_extent(s) if s else next(written) for s in spans]
        raw = array("q", rows).tobytes()
        disk.log(
            PutRecord(
                partition_id,
                incarnation,
                [e.record(c.header, raw) for c, e in zip(on_host, extents, strict=True)],
            )
        )
        for c, e in zip(on_host, extents, strict=True):
            c.extent = e
            disk.ref(e)

    def _add(self, chunk: _Chunk) -> int:
        """Keep ``chunk``; its serial."""
        serial = next(self._serials)
        self._chunks[serial] = chunk
        self.resident_bytes += chunk.nbytes
        if chunk.column is not None and chunk.device is None:
            self.memory_bytes += chunk.nbytes
            if self.memory_cap is not None:
                self._lru[serial] = chunk
        return serial

    def _drop(self, serial: int) -> None:
        """One cell of chunk ``serial`` is gone (overwritten or cleared)."""
        chunk = self._chunks[serial]
        chunk.live -= 1
        if chunk.live == 0:
            del self._chunks[serial]
            self.resident_bytes -= chunk.nbytes
            if chunk.column is not None and chunk.device is None:
                self.memory_bytes -= chunk.nbytes
            self._lru.pop(serial, None)
            if chunk.region is not None and self.arena is not None:
                self.arena.release(chunk.region)
            if chunk.device is not None and self.device is not None:
                self.device.release(chunk.device)
            if chunk.extent is not None and self.disk is not None:
                self.disk.release(chunk.extent)

    # ---- tiers -------------------------------------------------------------------------------

    def evict(self) -> None:
        """Move the least recently used chunks out of memory until it holds ``memory_cap``.

        A chunk already on disk (durable store) just leaves memory; another is written to the
        scratch store first (a failure leaves it in memory, with a warning).
        """
        cap = self.memory_cap
        if cap is None or self.memory_bytes <= cap:
            return
        disk, lru = self.disk, self._lru
        assert disk is not None
        while self.memory_bytes > cap and lru:
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
                    return
                disk.ref(chunk.extent)
            chunk.column = None
            if chunk.region is not None and self.arena is not None:
                self.arena.release(chunk.region)
            chunk.region = None
            self.memory_bytes -= chunk.nbytes
            self.spills += 1

    def _load(self, serial: int, chunk: _Chunk) -> Column:
        """Read a spilled chunk back into memory (it is the most recently used now)."""
        assert chunk.extent is not None
        assert self.disk is not None
        column = column_from_frames(chunk.header, self.disk.read(chunk.extent), chunk.n)
        chunk.column = column
        self.memory_bytes += chunk.nbytes
        self.disk_reads += 1
        if self.memory_cap is not None:
            self._lru[serial] = chunk
        return column

    def recover(self) -> int:
        """Take back the cells of a durable store (from its index: the data stays on disk
        until read); returns the chunks recovered."""
        disk = self.disk
        assert disk is not None
        assert disk.durable
        records = disk.load()
        self._replaying = disk.replaying = True  # until `collect`
        try:
            for rec in records:
                if isinstance(rec, ClearRecord):
                    self.clear(rec.partition, rec.rows, incarnation=rec.incarnation)
                else:
                    self._restore(rec)
        finally:
            self._replaying = False
        disk.collect()
        if disk.dropped:  # before any new cell may take the dropped ones' place
            self._rewrite_index()
            if disk.sync:
                disk.commit(disk.begin_commit())
        return len(self._chunks)

    def _restore(self, rec: PutRecord) -> None:
        """Replay a put record: its chunks, on disk, take their rows (as `put` does)."""
        self._adopt(rec.partition, rec.incarnation)
        assert self.disk is not None
        fields = self._index.setdefault(rec.partition, {})
        for c in rec.chunks:
            rows = array("q")
            rows.frombytes(c.rows)
            pairs = [(r, i) for i, r in enumerate(rows) if r >= 0]
            if not pairs:
                continue
            chunk = _Chunk(c.header, None, None, extent=c.extent, n=len(rows))
            chunk.live = len(pairs)
            self.disk.ref(c.extent)
            index = fields.setdefault(c.header.name, {})
            first = self._add(chunk) << _CELL_BITS
            for r in index.keys() & {r for r, _ in pairs}:
                self._drop(index[r] >> _CELL_BITS)
            index.update((r, first + i) for r, i in pairs)
        if not fields:
            del self._index[rec.partition]

    def _rewrite_index(self) -> None:
        """Replace the disk's index by one record per live chunk (its dead rows as -1)."""
        assert self.disk is not None
        try:
            self.disk.rewrite(_live_records(self._index, self._chunks, self._incarnation))
        except OSError as exc:  # the old index stays: it is still right, only longer
            log.warning("could not rewrite a storage unit's index", error=str(exc))

    def get(
        self,
        partition_id: str,
        rows: Sequence[int],
        fields: Sequence[str],
        *,
        max_bytes: int | None = None,
        incarnation: str | None = None,
        touched: list[_Chunk] | None = None,
        device_ok: bool = False,
    ) -> tuple[list[ColumnHeader], list[Column | list[DeviceCells]]]:
        """Columns for ``fields`` of ``rows`` in that order (views when possible).

        ``touched`` collects the chunks read (to pin their arena regions). Cells in the
        device arena are copied to the host, unless ``device_ok``: then a field whose cells
        all are there (with one row shape) comes as their pieces, a list of DeviceCells.

        Raises:
            RowsNotFound: a row is not stored, or ``incarnation`` (of the partition, None:
                not checked) was cleared, its id maybe reused since.
            OverBudget: the cells take more than ``max_bytes`` (checked on the views, before
                anything is copied together).
        """
        budget = max_bytes
        self._check_incarnation(partition_id, incarnation)
        stored = self._index.get(partition_id)
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
            # runs of consecutive cells of one chunk: cells [start, end)
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
                    self._take(start, end, pieces, piece_headers, touched)
                start, end = cell, cell + 1
            if start >= 0:
                self._take(start, end, pieces, piece_headers, touched)
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
                if device_ok and len(on_device) == len(pieces) and len(set(piece_headers)) == 1:
                    headers.append(piece_headers[0])
                    columns.append(on_device)
                    continue
                host = [self._to_host(h, p) for h, p in zip(piece_headers, pieces, strict=True)]
            else:
                host = pieces  # type: ignore[assignment]
            # rows put with different shapes: dense if they share one, else jagged
            header, column = join_columns(piece_headers, host)
            headers.append(header)
            columns.append(column)
        return headers, columns

    def _take(
        self,
        start: int,
        end: int,
        pieces: list[Column | DeviceCells],
        headers: list[ColumnHeader],
        touched: list[_Chunk] | None,
    ) -> None:
        """Append the cells ``[start, end)`` (one chunk's) to ``pieces``."""
        serial = start >> _CELL_BITS
        chunk = self._chunks[serial]
        a = start & _POSITION
        column = chunk.column
        if column is None:
            column = self._load(serial, chunk)
        elif self.memory_cap is not None and serial in self._lru:
            self._lru.move_to_end(serial)
        if isinstance(column, DeviceCells):
            pieces.append(column.rows(a, a + end - start))
        else:
            pieces.append(take_rows(column, [(a, a + end - start)]))
        headers.append(chunk.header)
        if touched is not None:
            touched.append(chunk)

    def _to_host(self, header: ColumnHeader, piece: Column | DeviceCells) -> Column:
        """``piece`` in host memory (cells in the device arena are copied out)."""
        if not isinstance(piece, DeviceCells):
            return piece
        assert self.device is not None  # device cells exist only while the arena does
        self.device.fallbacks += 1
        return column_from_frames(header, [self.device.read(piece.offset, piece.nbytes)], piece.n)

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
        touched: list[_Chunk] = []
        headers, columns = self.get(
            partition_id,
            rows,
            fields,
            touched=touched,
            incarnation=incarnation,
            device_ok=device_ok,
        )
        frames: list[Any] = []
        device_spans: list[list[tuple[int, int]]] = []
        for h, c in zip(headers, columns, strict=True):
            if isinstance(c, list):
                device_spans.append([(p.offset, p.nbytes) for p in c])
            else:
                device_spans.append([])
                frames.extend(column_to_frames(h, c))
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
        held = self._incarnation.get(partition_id)
        if incarnation is not None and held is not None and held != incarnation:
            if rows is None:
                self._retire(partition_id, incarnation)
            return 0  # the cells here are of a newer incarnation
        if rows is None:
            for inc in (incarnation, held):
                if inc is not None:
                    self._retire(partition_id, inc)
        stored = self._index.get(partition_id)
        if stored is None:
            self._incarnation.pop(partition_id, None)
            return 0
        if self._durable and not self._replaying:
            self._log_clear(
                ClearRecord(partition_id, None if rows is None else list(rows), incarnation)
            )
        try:
            return self._clear(partition_id, stored, rows)
        finally:
            if (
                self._durable
                and not self._replaying
                and self.disk is not None
                and self.disk.records > 2 * len(self._chunks) + _REWRITE_SLACK
            ):
                self._rewrite_index()
            if not self._replaying:
                compact(self)

    def _log_clear(self, record: ClearRecord) -> None:
        """Record a clear; on a full disk it is done anyway (clearing is how space comes
        back): a restart may then find those cells again, which nothing refers to."""
        assert self.disk is not None
        try:
            self.disk.log(record)
        except TQError as exc:
            log.warning(
                "could not record a clear on disk; the cells are freed now, but a restart may "
                "find them again (unreferenced: only their space is lost until their partition "
                "is cleared again)",
                partition=record.partition,
                error=str(exc),
            )

    def _clear(
        self, partition_id: str, stored: dict[str, dict[int, int]], rows: Sequence[int] | None
    ) -> int:
        if rows is None:
            self._incarnation.pop(partition_id, None)
            freed = max((len(ix) for ix in stored.values()), default=0)
            for index in stored.values():
                for cell in index.values():
                    self._drop(cell >> _CELL_BITS)
            del self._index[partition_id]
            return freed
        freed_rows: set[int] = set()
        for index in stored.values():
            for r in rows:
                entry = index.pop(r, None)
                if entry is not None:
                    self._drop(entry >> _CELL_BITS)
                    freed_rows.add(r)
        if all(not ix for ix in stored.values()):
            del self._index[partition_id]
            self._incarnation.pop(partition_id, None)
        return len(freed_rows)

    def stats(self) -> StoreStatsReply:
        rows = sum(
            max((len(ix) for ix in fields.values()), default=0) for fields in self._index.values()
        )
        arena = self.arena
        if arena is None:
            reply = StoreStatsReply(len(self._index), rows, self.resident_bytes, self.instance)
            reply.host, reply.locality = self.host, dict(self.locality)
            reply.task_locality = self._task_locality()
            return self._tier_stats(reply)
        return self._tier_stats(
            StoreStatsReply(
                len(self._index),
                rows,
                self.resident_bytes,
                self.instance,
                shm_bytes=arena.live_bytes,
                shm_idle_bytes=arena.idle_bytes,
                shm_cap=arena.cap,
                shm_fallbacks=arena.fallbacks,
                shm_puts=arena.puts,
                shm_reads=arena.reads,
                nixl_puts=self.nixl.puts if self.nixl is not None else 0,
                nixl_reads=self.nixl.reads if self.nixl is not None else 0,
                nixl_registered_bytes=self.nixl.registered_bytes if self.nixl is not None else 0,
                **self._device_stats(),
                host=self.host,
                locality=dict(self.locality),
                shm_locked_bytes=arena.locked_bytes(),
                task_locality=self._task_locality(),
            )
        )

    def _task_locality(self) -> dict[str, dict[str, int]]:
        return {task: dict(counts) for task, counts in sorted(self.task_locality.items())}

    def _tier_stats(self, reply: StoreStatsReply) -> StoreStatsReply:
        reply.memory_bytes = self.memory_bytes
        reply.memory_cap = self.memory_cap or 0
        reply.spills, reply.disk_reads = self.spills, self.disk_reads
        if self.disk is not None:
            reply.disk_bytes = self.disk.live_bytes
        return reply

    def _device_stats(self) -> dict[str, int]:
        device = self.device
        if device is None:
            return {}
        return {
            "device_bytes": device.live_bytes,
            "device_cap": device.cap,
            "device_puts": device.puts,
            "device_reads": device.reads,
            "device_fallbacks": device.fallbacks,
            "device_out_bytes": device.out_bytes,
            "device_out_us": int(device.out_seconds * 1e6),
        }


def begin_commit(state: StorageState) -> Commit:
    """``state``'s next group commit (``fsync`` level), with the arena regions freed since the
    last one: their freeing is in its records, so they are reused only after it."""
    assert state.disk is not None
    commit = state.disk.begin_commit()
    arena = state.arena
    if arena is not None and arena.defer_frees:
        commit.freed, arena.deferred = arena.deferred, []
    return commit


def end_commit(state: StorageState, commit: Commit, error: TQError | None = None) -> None:
    """After ``commit`` ran: its freed regions are reused; after a failed one they stay
    unused (a restart may find their old cells again)."""
    arena = state.arena
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


def adopt_arena(state: StorageState, arena: Arena) -> int:
    """``state``'s arena file is open: the recovered cells in it are views of it again
    (zero copy, no read), their pages reserved; returns the regions reserved.

    Cells of one put share a region; chunks whose pages overlap share one too (a
    rewritten index lists each chunk alone)."""
    state.arena = arena
    spans: list[tuple[int, int, int]] = []
    for serial, chunk in state._chunks.items():
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
            chunk = state._chunks[serial]
            chunk.region = region
            if chunk.column is None:
                assert chunk.extent is not None
                views = [arena.span(off, n) for off, n in chunk.extent.spans]
                chunk.column = column_from_frames(chunk.header, views, chunk.n)
                state.memory_bytes += chunk.nbytes
    return len(groups)


def _arena_spans(
    arena: Arena | None, chunk: _Chunk, frames: Sequence[Any]
) -> list[tuple[int, int]]:
    """Where ``frames`` (of ``chunk``) are in the arena file; [] when they are not all
    there (a memfd arena, or frames that came over a socket)."""
    if arena is None or arena.path is None or chunk.region is None or not frames:
        return []
    spans = []
    for frame in frames:
        n = memoryview(frame).nbytes
        offset = arena.offset_of(frame) if n else chunk.region.offset
        if offset is None:
            return []
        spans.append((offset, n))
    return spans


def compact(state: StorageState, budget: int = _COMPACT_BUDGET) -> int:
    """Once ``state``'s segment files hold much more than its live chunks (cleared rows'
    space), move the live chunks of mostly dead segments to the current one, each with a put
    record of its live rows (a replay applies it over the first one: the same cells), so the
    old segments die and their files go; at most ``budget`` bytes. Returns the bytes moved.

    At ``fsync`` the moved chunks' records wait for the next commit, and the old segments
    are deleted only after it (`SegmentStore.release`)."""
    disk = state.disk
    if (
        disk is None
        or disk.file_bytes <= max(2 * disk.live_bytes, disk.compacted_at) + _COMPACT_SLACK
    ):
        return 0
    # a pass scans every cell once (which rows each chunk holds): the next one waits for
    # another _COMPACT_SLACK written after it, however much this one could move (puts call
    # this, so the scan is paid once per _COMPACT_SLACK bytes at most)
    disk.compacted_at = disk.file_bytes
    targets = set(disk.sparse())
    if not targets:
        return 0
    owners = _chunk_rows(state._index, state._chunks, targets)
    moved = 0
    for serial, (pid, rows) in sorted(owners.items()):
        if moved >= budget:
            break
        chunk = state._chunks[serial]
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
                disk.log(PutRecord(pid, state._incarnation.get(pid), [record]))
        except TQError as exc:  # a full disk: the old segments stay, nothing is lost
            log.warning("could not compact a storage unit's segments", error=str(exc))
            break
        disk.ref(new)
        chunk.extent = new
        disk.release(old)
        moved += old.nbytes
    disk.compacted_at = disk.file_bytes  # after the old files went (process level)
    return moved


def _chunk_rows(
    stored: dict[str, dict[str, dict[int, int]]],
    chunks: dict[int, _Chunk],
    segments: set[int] | None = None,
) -> dict[int, tuple[str, array[int]]]:
    """Per live chunk on disk (in ``segments``, when given): its partition and the row at
    each of its positions (-1: a position no longer alive)."""
    live: dict[int, tuple[str, array[int]]] = {}
    for pid, fields in stored.items():
        for index in fields.values():
            for row, cell in index.items():
                serial = cell >> _CELL_BITS
                entry = live.get(serial)
                if entry is None:
                    extent = chunks[serial].extent
                    if extent is None or (segments is not None and extent.segment not in segments):
                        continue  # in the device arena (never on disk), or not asked for
                    entry = live[serial] = (pid, array("q", [-1]) * chunks[serial].n)
                entry[1][cell & _POSITION] = row
    return live


def _live_records(
    stored: dict[str, dict[str, dict[int, int]]],
    chunks: dict[int, _Chunk],
    incarnations: dict[str, str],
) -> list[PutRecord | ClearRecord]:
    """One put record per live chunk on disk, in the order they were put; rows no longer
    alive in it are -1 (a rewritten index replays to the same cells)."""
    live = _chunk_rows(stored, chunks)
    records: list[PutRecord | ClearRecord] = []
    for serial, (pid, rows) in sorted(live.items()):
        chunk = chunks[serial]
        e = chunk.extent
        assert e is not None
        records.append(
            PutRecord(pid, incarnations.get(pid), [e.record(chunk.header, rows.tobytes())])
        )
    return records
