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
"""

from __future__ import annotations

import itertools
import math
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._core._state import stale_incarnation
from .._errors import InvalidRequestError, ProtocolError, RowsNotFound, SchemaError
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

__all__ = ["OverBudget", "StorageState"]

#: cleared incarnations remembered per unit (a late put into one of them is refused)
_RETIRED = 4096


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
    __slots__ = ("column", "device", "header", "live", "nbytes", "region")

    def __init__(
        self,
        header: ColumnHeader,
        column: Column | DeviceCells,
        region: Region | None,
        device: Region | None = None,
    ) -> None:
        self.header = header
        self.column = column
        self.live = len(column)
        self.nbytes = column.nbytes if isinstance(column, DeviceCells) else column_nbytes(column)
        #: the arena region the column's views point into (None: message frames)
        self.region = region
        #: the device arena region the cells are in (``column`` is then DeviceCells)
        self.device = device


class StorageState:
    """The cells of one unit; synchronous and socket-free (testable alone).

    Args:
        allow_pickle: accept pickled columns.
        arena: the unit's shared memory, if any (regions of chunks are released into it).
    """

    def __init__(self, *, allow_pickle: bool = False, arena: Arena | None = None) -> None:
        self.allow_pickle = allow_pickle
        #: random per process: the controller tells a resumed unit from a restarted one
        self.instance = secrets.token_hex(8)
        self.arena = arena
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
            pos += k
        if region is not None:
            region.refs += sum(c.region is not None for c in chunks)
        if device is not None:
            device[0].refs += len(on_device)
        fields = self._index.setdefault(partition_id, {})
        for chunk in chunks:
            index = fields.setdefault(chunk.header.name, {})
            self.resident_bytes += chunk.nbytes
            serial = next(self._serials)
            self._chunks[serial] = chunk
            # cells overwritten release their old chunk; the index is then updated in one C
            # loop (a Python loop over a 1M-row put took most of its time)
            for r in index.keys() & rows:
                self._drop(index[r] >> _CELL_BITS)
            first = serial << _CELL_BITS
            index.update(zip(rows, range(first, first + n), strict=True))

    def _drop(self, serial: int) -> None:
        """One cell of chunk ``serial`` is gone (overwritten or cleared)."""
        chunk = self._chunks[serial]
        chunk.live -= 1
        if chunk.live == 0:
            del self._chunks[serial]
            self.resident_bytes -= chunk.nbytes
            if chunk.region is not None and self.arena is not None:
                self.arena.release(chunk.region)
            if chunk.device is not None and self.device is not None:
                self.device.release(chunk.device)

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
        chunk = self._chunks[start >> _CELL_BITS]
        a = start & _POSITION
        column = chunk.column
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
            return reply
        return StoreStatsReply(
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

    def _task_locality(self) -> dict[str, dict[str, int]]:
        return {task: dict(counts) for task, counts in sorted(self.task_locality.items())}

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
