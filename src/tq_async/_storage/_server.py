"""Storage units: in-memory cell stores behind a thin ROUTER server.

A unit keeps what it received: each put becomes one *chunk* per column, holding views of the
message's frames (no copy, no re-serialisation). An index maps ``(partition, field, row)`` to
``(chunk, position)``. Reading rows that are one run of one chunk sends a view of it (zero
copy); other selections are gathered once into one buffer. A chunk is freed when its last row
is cleared or overwritten.

Clients on the unit's host put and read through the unit's shared-memory arena
(:mod:`tq_async._paths._shm`): a put's chunks are then views of an arena region (freed with the last
chunk), and a read replies with arena spans instead of frames, pinned until the client has
copied them out. Bytes that leave through a socket are copied out of the arena first, since
a region may be reused as soon as its rows are gone.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np
from anyio.abc import TaskGroup, TaskStatus

from .._core._state import stale_incarnation
from .._errors import (
    ClosedError,
    DeviceError,
    InvalidRequestError,
    ProtocolError,
    RowsNotFound,
    SchemaError,
)
from .._logging import get_logger
from .._paths._device import DeviceArena, DeviceCells, device_span_ok, open_device_arena
from .._paths._nixl import Claims, UnitNixl, check_data_path
from .._paths._nixl import load as load_nixl
from .._paths._shm import PAGE, Arena, Region, Watcher, align, next_id
from .._service._loop import DEFERRED, SENT, Handler, Incoming, Service, WithFrames
from .._service._metrics import Metrics
from .._transport._router import RouterEndpoint
from .._transport._security import CurveServer
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
from .._wire._protocol import (
    Cancel,
    DeviceHello,
    DeviceHelloReply,
    NixlHello,
    NixlHelloReply,
    ShmAlloc,
    ShmFree,
    ShmGrant,
    ShmHello,
    ShmHelloReply,
    StoreClear,
    StoredColumns,
    StoreGet,
    StorePut,
    StoreStats,
    StoreStatsReply,
    storage_request_decoder,
)

__all__ = ["OverBudget", "StorageState", "StorageServer"]

log = get_logger(__name__)

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
        #: the unit's device arena, if any (see :mod:`tq_async._paths._device`; set by the server)
        self.device: DeviceArena | None = None
        #: the unit's NIXL agent with the arena registered (set by the server; None: no NIXL)
        self.nixl: UnitNixl | None = None
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
        """Raise :class:`RowsNotFound` when ``incarnation`` is not the one held."""
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
        """:meth:`get`, as it travels: the reply's header and the columns' frames."""
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
        """:meth:`get` as arena spans: views of regions where the cells already are, the
        rest copied into a new region. Returns the reply, the regions to pin (each holding
        one more reference) and the device arena regions to pin (likewise), or None when
        the arena has no room (read by socket).

        With ``device_ok``, fields whose cells are in the device arena stay there: the reply
        lists their spans in it (:attr:`StoredColumns.device_spans`), and they have no
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
            return StoreStatsReply(len(self._index), rows, self.resident_bytes, self.instance)
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
        )

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
        }


#: default shared-memory arena per unit (address space; pages are used only once written)
DEFAULT_SHM_CAP = 1 << 30
#: default bound on freed arena pages kept for reuse
DEFAULT_SHM_IDLE = 256 << 20


class StorageServer(Service):
    """Serves one :class:`StorageState` on a ROUTER socket (every handler is synchronous but
    the first NIXL hellos', which wait for the agent being made on a worker thread).

    Args:
        unit_id: this unit's id.
        allow_pickle: accept pickled columns.
        metrics: where to count requests and bytes.
        curve: CURVE keys (network transports).
        shm_cap: bytes of shared memory for clients on this host (see :mod:`tq_async._paths._shm`);
            0 turns the shared-memory path off. At the cap, puts go over the socket.
        shm_idle_bytes: most bytes of freed shared memory kept resident for reuse.
        data_path: what this unit offers besides the socket: ``"auto"`` (shared memory to
            clients on its host, NIXL to the others when installed), ``"shm"``, ``"nixl"``
            (NIXL to every client; its arena is the one shared memory would use) or
            ``"zmq"`` (the socket only).
        device_cap: bytes of GPU memory for cells put from GPUs by clients on this host (see
            :mod:`tq_async._paths._device`; 0: none). Needs shared memory (``shm_cap``) too.
        device_index: which GPU (its CUDA index as this process sees it) holds them.
    """

    name = "storage"

    def __init__(
        self,
        unit_id: int,
        *,
        allow_pickle: bool = False,
        metrics: Metrics | None = None,
        curve: CurveServer | None = None,
        shm_cap: int = DEFAULT_SHM_CAP,
        shm_idle_bytes: int = DEFAULT_SHM_IDLE,
        data_path: str = "auto",
        device_cap: int = 0,
        device_index: int = 0,
    ) -> None:
        if shm_cap < 0 or shm_idle_bytes < 0:
            raise InvalidRequestError(
                f"shm_cap and shm_idle_bytes must be >= 0, got {shm_cap} and {shm_idle_bytes}"
            )
        if device_cap < 0 or device_index < 0:
            raise InvalidRequestError(
                f"device_cap and device_index must be >= 0, got {device_cap} and {device_index}"
            )
        self.device_cap = device_cap
        self.device_index = device_index
        self.unit_id = unit_id
        self.data_path = check_data_path(data_path)
        self.curve = curve
        self.shm_cap = shm_cap
        self.shm_idle_bytes = shm_idle_bytes
        self.state = StorageState(allow_pickle=allow_pickle)
        super().__init__(metrics or Metrics(None, "storage"), storage_request_decoder)
        self.handlers = self._handler_table()
        self._watcher: Watcher | None = None
        #: shared memory: client identity -> its pid; grants and read pins by id
        self._shm_peers: dict[bytes, int] = {}
        self._grants: dict[int, tuple[bytes, int, Region]] = {}
        self._pins: dict[int, tuple[bytes, int, list[Region]]] = {}
        #: device arena: grants by id (as shared-memory ones), and the device regions a read
        #: pin holds (by the pin's id in ``_pins``)
        self._device_grants: dict[int, tuple[bytes, int, Region]] = {}
        self._device_pins: dict[int, list[Region]] = {}
        #: NIXL: the clients that use the unit's agent (``state.nixl``, made on the first hello)
        self._nixl_peers: set[bytes] = set()
        #: set once the agent is made (or failed to be): NIXL hellos that came meanwhile wait
        self._nixl_ready: anyio.Event | None = None
        self._tg: TaskGroup | None = None
        #: grants and pins of NIXL clients, released when abandoned (see Claims)
        self.nixl_claims = Claims()
        #: set (and replaced) whenever shared memory is given back (tests wait on it)
        self.shm_released = anyio.Event()

    @property
    def arena(self) -> Arena | None:
        """The shared-memory arena (None when off or not serving)."""
        return self.state.arena

    @property
    def nixl(self) -> UnitNixl | None:
        """The unit's NIXL agent with the arena registered (None: no NIXL client yet)."""
        return self.state.nixl

    @property
    def address(self) -> str:
        if self._endpoint is None:
            raise ClosedError(
                "the storage unit is not serving: start it with `await tg.start(unit.serve)`"
            )
        return self._endpoint.address

    async def serve(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind, report the address through ``task_status``, serve until cancelled."""
        self._endpoint = RouterEndpoint(bind, self.on_message, curve=self.curve, twin="uds")
        try:
            self._open_arena()
            await self._open_device_arena()
            async with anyio.create_task_group() as tg:  # ends (NIXL set up) before the arena
                self._tg = tg
                if self.data_path == "nixl" and self.arena is not None:
                    await self._start_nixl()  # asked for: ready before the first client
                task_status.started(self._endpoint.address)
                await anyio.sleep_forever()
        finally:
            self._tg = None
            self._endpoint.close()
            self._close_arena()

    # ---- shared memory -----------------------------------------------------------------------

    def _open_arena(self) -> None:
        if self.data_path == "zmq":
            return
        if not self.shm_cap or not hasattr(os, "memfd_create") or not hasattr(os, "pidfd_open"):
            return
        try:
            arena = Arena(
                self.shm_cap, idle_bytes=self.shm_idle_bytes, name=f"tq-unit-{self.unit_id}"
            )
        except OSError as exc:
            log.warning("no shared memory for same-host clients", error=str(exc))
            return
        self.state.arena = arena
        loop = asyncio.get_running_loop()
        self._watcher = Watcher(loop.add_reader, loop.remove_reader)

    async def _open_device_arena(self) -> None:
        """The device arena (on a worker thread: a CUDA context takes a while); without a
        GPU or shared memory the unit goes on without one, saying why."""
        if not self.device_cap or self.arena is None:
            if self.device_cap:
                log.warning("no device arena: it needs shared memory (shm_cap > 0)")
            return
        try:
            self.state.device = await anyio.to_thread.run_sync(
                open_device_arena, self.device_index, self.device_cap
            )
        except (DeviceError, OSError, InvalidRequestError) as exc:
            log.warning("no device arena: GPU cells go through host memory", error=str(exc))

    def _close_arena(self) -> None:
        device, self.state.device = self.state.device, None
        if device is not None:
            device.close()
        self._device_grants.clear()
        self._device_pins.clear()
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        arena, self.state.arena = self.state.arena, None
        if self.state.nixl is not None:  # deregistered before the arena is unmapped
            self.state.nixl.close()
            self.state.nixl = None
            self._nixl_peers.clear()
        self._nixl_ready = None
        if arena is not None:
            arena.close()
        self._shm_peers.clear()
        self._grants.clear()
        self._pins.clear()

    def _shm_hello(self, peer: bytes, body: ShmHello) -> ShmHelloReply | None:
        arena = self.arena
        if arena is None or self._watcher is None or body.pid <= 0 or self.data_path == "nixl":
            return None
        try:
            self._watcher.watch(body.pid, self._client_exited)
        except OSError:  # not visible from here: another host or PID namespace
            return None
        self._shm_peers[peer] = body.pid
        ipc = self._endpoint.ipc_address if self._endpoint is not None else None
        return ShmHelloReply(os.getpid(), arena.fd, arena.cap, arena.token, ipc)

    def _shm_pid(self, peer: bytes) -> int:
        pid = self._shm_peers.get(peer)
        if pid is None and peer in self._nixl_peers:
            return 0  # a NIXL client: claims go back when it frees them
        if pid is None or self.arena is None:
            raise InvalidRequestError(
                "this client has not set up shared memory with this unit (ShmHello first); "
                "use the socket path"
            )
        return pid

    def _shm_alloc(self, peer: bytes, body: ShmAlloc) -> ShmGrant | None:
        pid = self._shm_pid(peer)
        self._expire_nixl_claims()
        arena = self.arena
        assert arena is not None
        if body.nbytes <= 0:
            raise InvalidRequestError(f"ShmAlloc nbytes must be > 0, got {body.nbytes}")
        if body.device:
            return self._device_alloc(peer, pid, body.nbytes)
        region = arena.alloc(body.nbytes) if body.nbytes <= arena.cap else None
        if region is None:
            arena.fallbacks += 1
            return None
        grant = next_id()
        self._grants[grant] = (peer, pid, region)
        if pid == 0:
            self.nixl_claims.note("grant", grant)
        return ShmGrant(grant, region.offset, region.size)

    def _device_hello(self, peer: bytes, body: DeviceHello) -> DeviceHelloReply | None:
        device = self.state.device
        if device is None or self._shm_peers.get(peer) != body.pid:
            return None  # no arena, or not a verified same-host peer
        memory = device.memory
        if memory.kind == "cuda" and body.pid == os.getpid():
            return None  # CUDA opens no IPC handle in the process that made it
        return DeviceHelloReply(memory.kind, memory.handle, device.cap, memory.device, device.token)

    def _device_alloc(self, peer: bytes, pid: int, nbytes: int) -> ShmGrant | None:
        device = self.state.device
        if device is None or pid == 0:
            raise InvalidRequestError(
                "this unit has no device arena for this client (DeviceHello first)"
            )
        region = device.alloc(nbytes) if nbytes <= device.cap else None
        if region is None:
            device.fallbacks += 1
            return None
        grant = next_id()
        self._device_grants[grant] = (peer, pid, region)
        return ShmGrant(grant, region.offset, region.size)

    def _device_columns(self, peer: bytes, body: StorePut) -> tuple[Region, dict[int, int]]:
        """Where a put's device columns are, checked against its grant (consumed; the
        caller releases the grant's reference)."""
        assert body.device is not None
        device = self.state.device
        entry = self._device_grants.pop(body.device.grant, None)
        if device is None or entry is None or entry[0] != peer:
            if entry is not None:  # another client's: not consumed
                self._device_grants[body.device.grant] = entry
            raise InvalidRequestError(
                f"device arena grant {body.device.grant} is unknown to this unit (never "
                "given, used already, freed, or another client's); put again"
            )
        region = entry[2]
        where: dict[int, int] = {}
        cols, spans = body.device.columns, body.device.spans
        ok = len(cols) == len(spans) and len(set(cols)) == len(cols)
        for col, (off, n) in zip(cols, spans, strict=False):
            ok = ok and 0 <= col < len(body.columns) and device_span_ok(off, n, region.size)
            where[col] = region.offset + off
        if not ok:
            device.release(region)
            raise ProtocolError("a put's device columns are described wrongly; put again")
        return region, where

    def _shm_frames(self, peer: bytes, body: StorePut) -> tuple[list[Any], Region]:
        """The frames a shared-memory put names, checked against its grant (consumed)."""
        assert body.shm is not None
        arena = self.arena
        entry = self._grants.get(body.shm.grant)
        if arena is None or entry is None or entry[0] != peer:
            raise InvalidRequestError(
                f"shared-memory grant {body.shm.grant} is unknown to this unit (never given, "
                "used already, freed, or another client's); put again"
            )
        del self._grants[body.shm.grant]
        region = entry[2]
        try:
            on_device = set(body.device.columns) if body.device is not None else set()
            expected = sum(
                column_frame_count(h) for i, h in enumerate(body.columns) if i not in on_device
            )
            spans = body.shm.spans
            if len(spans) != expected:
                raise ProtocolError(
                    f"a shared-memory put names {len(spans)} spans, its columns need {expected}"
                )
            frames: list[Any] = []
            for off, n in spans:
                if off < 0 or n < 0 or off + n > region.size:
                    raise ProtocolError(
                        f"a shared-memory span [{off}, +{n}) lies outside its grant of "
                        f"{region.size} bytes; the description is corrupt"
                    )
                frames.append(arena.span(region.offset + off, n))
        except BaseException:
            arena.release(region)
            self._notify_shm()
            raise
        return frames, region

    def _shm_free(self, peer: bytes, body: ShmFree) -> None:
        arena = self.arena
        if arena is None:
            return
        for gid in body.grants:
            entry = self._grants.get(gid)
            if entry is not None and entry[0] == peer:
                del self._grants[gid]
                arena.release(entry[2])
            entry = self._device_grants.get(gid)
            if entry is not None and entry[0] == peer:
                self._release_device([self._device_grants.pop(gid)[2]])
        for pid_ in body.pins:
            pin = self._pins.get(pid_)
            if pin is not None and pin[0] == peer:
                del self._pins[pid_]
                for region in pin[2]:
                    arena.release(region)
                self._release_device(self._device_pins.pop(pid_, []))
        self._notify_shm()

    def _release_device(self, regions: list[Region]) -> None:
        device = self.state.device
        if device is not None:
            for region in regions:
                device.release(region)

    def _client_exited(self, pid: int) -> None:
        """A client process is gone: its grants and pins go back to the arena."""
        arena = self.arena
        for peer in [p for p, q in self._shm_peers.items() if q == pid]:
            del self._shm_peers[peer]
        for gid in [g for g, e in self._grants.items() if e[1] == pid]:
            region = self._grants.pop(gid)[2]
            if arena is not None:
                arena.release(region)
        for key in [k for k, e in self._pins.items() if e[1] == pid]:
            regions = self._pins.pop(key)[2]
            if arena is not None:
                for region in regions:
                    arena.release(region)
            self._release_device(self._device_pins.pop(key, []))
        for gid in [g for g, e in self._device_grants.items() if e[1] == pid]:
            self._release_device([self._device_grants.pop(gid)[2]])
        log.debug("released the shared memory of an exited client", pid=pid)
        self._notify_shm()

    def _nixl_offered(self) -> bool:
        if self.arena is None or self.data_path not in ("auto", "nixl"):
            return False
        # UCX does not encrypt: an encrypted unit offers NIXL only if told to
        return self.curve is None or self.data_path == "nixl"

    def _nixl_hello(self, peer: bytes, body: NixlHello) -> NixlHelloReply | None:
        """Offer a client the NIXL path (None: the unit offers none, or NIXL failed)."""
        arena, unit = self.arena, self.nixl
        if arena is None or unit is None or not self._nixl_offered():
            return None
        self._nixl_peers.add(peer)
        log.debug("a NIXL client", unit=self.unit_id, agent=body.agent)
        return NixlHelloReply(unit.metadata, unit.name, arena.base, arena.cap)

    async def _start_nixl(self) -> None:
        """Make the unit's NIXL agent and register the arena, once, on a worker thread (it
        takes ~0.5 s: the unit serves other requests meanwhile); without NIXL, or when it
        fails, the unit offers the socket and shared memory only."""
        arena = self.arena
        if self._nixl_ready is not None or arena is None:
            return
        ready = self._nixl_ready = anyio.Event()
        limit, arena.idle_limit = arena.idle_limit, arena.cap  # pages stay the registered ones

        def make() -> UnitNixl | None:
            nixl = load_nixl()
            return None if nixl is None else UnitNixl(nixl, arena.base, arena.cap)

        unit = None
        try:
            # not abandoned when cancelled: the agent is kept (and closed with the arena)
            unit = await anyio.to_thread.run_sync(make)
        except Exception as exc:
            log.warning("NIXL could not register the arena: socket only", error=str(exc))
            self.data_path = "shm"
        finally:
            if unit is None:
                arena.idle_limit = limit
            self.state.nixl = unit
            ready.set()

    async def _nixl_hello_waiting(self, msg: Incoming, body: NixlHello) -> None:
        """Answer a NIXL hello once the agent is made (the first hellos of a unit)."""
        await self._start_nixl()  # the first hello starts it, the others find it started
        assert self._nixl_ready is not None
        await self._nixl_ready.wait()
        try:
            reply = self._nixl_hello(msg.peer, body)
        except Exception as exc:
            self.send_error(msg.peer, msg.rid, exc, "NixlHello")
            self.record("NixlHello", False, msg.t0)
            return
        self.send_ok(msg.peer, msg.rid, reply)
        self.record("NixlHello", True, msg.t0)

    def _expire_nixl_claims(self) -> None:
        """Release the grants and pins of NIXL clients that held them past the claims' ttl."""
        if not len(self.nixl_claims):
            return

        def live(kind: str, claim: int) -> bool:
            return claim in (self._grants if kind == "grant" else self._pins)

        arena = self.arena
        for kind, claim in self.nixl_claims.expired(live):
            grant = self._grants.pop(claim) if kind == "grant" else None
            regions = [grant[2]] if grant is not None else self._pins.pop(claim)[2]
            log.warning("released the claim of a silent NIXL client", kind=kind, id=claim)
            if arena is not None:
                for region in regions:
                    arena.release(region)
        self._notify_shm()

    def _notify_shm(self) -> None:
        self.shm_released.set()
        self.shm_released = anyio.Event()

    def _read_shm(self, peer: bytes, body: StoreGet) -> StoredColumns | None:
        pid = self._shm_pid(peer)
        self._expire_nixl_claims()
        device_ok = body.device and self.state.device is not None and pid > 0
        got = self.state.read_shm(
            body.partition_id, body.rows, body.fields, body.incarnation, device_ok=device_ok
        )
        if got is None:
            assert self.arena is not None
            self.arena.fallbacks += 1
            return None
        stored, regions, on_device = got
        stored.pin = next_id()
        self._pins[stored.pin] = (peer, pid, regions)
        if on_device:
            assert self.state.device is not None
            self._device_pins[stored.pin] = on_device
            self.state.device.reads += 1
        if pid == 0:
            self.nixl_claims.note("pin", stored.pin)
        assert self.arena is not None
        if self.nixl is not None and peer in self._nixl_peers:
            self.nixl.reads += 1
        else:
            self.arena.reads += 1
        return stored

    def store_local(
        self,
        partition_id: str,
        rows: Sequence[int],
        headers: Sequence[ColumnHeader],
        frames: Any,
        incarnation: str | None = None,
    ) -> None:
        """A :class:`StorePut` from a controller in this process, without a message."""
        t0 = time.perf_counter()
        ok = False
        try:
            self.state.put(partition_id, rows, headers, frames, incarnation=incarnation)
            ok = True
        finally:
            if self.metrics.enabled:
                self.metrics.transfer("in", sum(memoryview(f).nbytes for f in frames))
                self.metrics.request("StorePut", ok, time.perf_counter() - t0)

    def read_local(
        self, partition_id: str, rows: Sequence[int], fields: Sequence[str], max_bytes: int
    ) -> tuple[StoredColumns, list[Any]] | None:
        """A :class:`StoreGet` from a controller in this process, without a message; None
        when the cells take more than ``max_bytes`` (nothing is copied then)."""
        t0 = time.perf_counter()
        ok = False
        try:
            stored, frames = self.state.read(partition_id, rows, fields, max_bytes=max_bytes)
            ok = True
        except OverBudget:
            return None
        finally:
            if self.metrics.enabled:
                if ok:
                    self.metrics.transfer("out", sum(memoryview(f).nbytes for f in frames))
                self.metrics.request("StoreGet", ok, time.perf_counter() - t0)
        return stored, frames

    def _handler_table(self) -> dict[type, Handler]:
        return {
            StorePut: self._on_store_put,
            StoreGet: self._on_store_get,
            StoreClear: self._on_store_clear,
            StoreStats: self._on_store_stats,
            ShmHello: self._on_shm_hello,
            DeviceHello: self._on_device_hello,
            ShmAlloc: self._on_shm_alloc,
            ShmFree: self._on_shm_free,
            NixlHello: self._on_nixl_hello,
            Cancel: self._on_cancel,
        }

    def _on_store_put(self, msg: Incoming, body: StorePut) -> None:
        device = self._device_columns(msg.peer, body) if body.device is not None else None
        try:
            data = self._store_put(msg, body, device)
        finally:
            if device is not None:
                self._release_device([device[0]])
        if device is not None:
            assert self.state.device is not None
            self.state.device.puts += 1
        if self.metrics.enabled:
            self.metrics.transfer("in", sum(memoryview(f).nbytes for f in data))

    def _store_put(
        self, msg: Incoming, body: StorePut, device: tuple[Region, dict[int, int]] | None
    ) -> list[Any]:
        """Store a put's columns (frames, shared-memory spans or device cells); its frames."""
        if body.shm is None:
            data: list[Any] = msg.frames[1:]
            self.state.put(
                body.partition_id,
                body.rows,
                body.columns,
                data,
                incarnation=body.incarnation,
                device=device,
            )
            return data
        if len(msg.frames) != 1:
            raise ProtocolError("a shared-memory put carries no data frames")
        data, region = self._shm_frames(msg.peer, body)
        arena = self.arena
        assert arena is not None
        try:
            self.state.put(
                body.partition_id,
                body.rows,
                body.columns,
                data,
                region,
                incarnation=body.incarnation,
                device=device,
            )
            if self.nixl is not None and msg.peer in self._nixl_peers:
                self.nixl.puts += 1
            else:
                arena.puts += 1
        finally:
            arena.release(region)
        return data

    def _on_store_get(self, msg: Incoming, body: StoreGet) -> Any:
        shm = self._read_shm(msg.peer, body) if body.shm else None
        if shm is not None:
            if self.metrics.enabled:
                assert shm.shm_spans is not None
                self.metrics.transfer("out", sum(n for _, n in shm.shm_spans))
            return shm
        stored, out = self.state.read(
            body.partition_id, body.rows, body.fields, incarnation=body.incarnation
        )
        if self.metrics.enabled:
            self.metrics.transfer("out", sum(memoryview(f).nbytes for f in out))
        return WithFrames(stored, out)

    def _on_store_clear(self, msg: Incoming, body: StoreClear) -> int:
        return self.state.clear(body.partition_id, body.rows, incarnation=body.incarnation)

    def _on_store_stats(self, msg: Incoming, body: StoreStats) -> StoreStatsReply:
        return self.state.stats()

    def _on_shm_hello(self, msg: Incoming, body: ShmHello) -> ShmHelloReply | None:
        return self._shm_hello(msg.peer, body)

    def _on_device_hello(self, msg: Incoming, body: DeviceHello) -> DeviceHelloReply | None:
        return self._device_hello(msg.peer, body)

    def _on_shm_alloc(self, msg: Incoming, body: ShmAlloc) -> ShmGrant | None:
        return self._shm_alloc(msg.peer, body)

    def _on_shm_free(self, msg: Incoming, body: ShmFree) -> Any:
        self._shm_free(msg.peer, body)
        return SENT  # one-way

    def _on_nixl_hello(self, msg: Incoming, body: NixlHello) -> Any:
        if self.nixl is not None or self._tg is None or not self._nixl_offered():
            return self._nixl_hello(msg.peer, body)
        if self._nixl_ready is not None and self._nixl_ready.is_set():
            return None  # NIXL failed to start: the socket
        self._tg.start_soon(self._nixl_hello_waiting, msg, body)
        return DEFERRED

    def _on_cancel(self, msg: Incoming, body: Cancel) -> Any:
        return SENT  # every storage op completes at once; nothing to cancel
