"""Storage units: in-memory cell stores behind a thin ROUTER server.

A unit keeps what it received: each put becomes one *chunk* per column, holding views of the
message's frames (no copy, no re-serialisation). An index maps ``(partition, field, row)`` to
``(chunk, position)``. Reading rows that are one run of one chunk sends a view of it (zero
copy); other selections are gathered once into one buffer. A chunk is freed when its last row
is cleared or overwritten.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import anyio
import msgspec
import zmq
from anyio.abc import TaskStatus

from ._columns import (
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
from ._errors import InvalidRequestError, ProtocolError, RowsNotFound, SchemaError
from ._logging import get_logger
from ._metrics import Metrics
from ._protocol import (
    Cancel,
    StorageRequest,
    StoreClear,
    StoredColumns,
    StoreGet,
    StorePut,
    StoreStats,
    StoreStatsReply,
    error_reply,
    ok_reply,
    salvage_rid,
    storage_request_decoder,
    validate,
)
from ._security import CurveServer
from ._state import stale_incarnation
from ._transport import LogThrottle, RouterEndpoint

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


class _Chunk:
    __slots__ = ("column", "header", "live", "nbytes")

    def __init__(self, header: ColumnHeader, column: Column) -> None:
        self.header = header
        self.column = column
        self.live = len(column)
        self.nbytes = column_nbytes(column)


class StorageState:
    """The cells of one unit; synchronous and socket-free (testable alone)."""

    def __init__(self, *, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle
        #: random per process: the controller tells a resumed unit from a restarted one
        self.instance = secrets.token_hex(8)
        # partition -> field -> row -> (chunk, position)
        self._index: dict[str, dict[str, dict[int, tuple[_Chunk, int]]]] = {}
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
        *,
        incarnation: str | None = None,
    ) -> None:
        """Store columns for ``rows`` (frames in header order). All-or-nothing.

        Raises:
            RowsNotFound: ``incarnation`` (of the partition) was cleared meanwhile.
        """
        self._adopt(partition_id, incarnation)
        n = len(rows)
        if n == 0:
            raise InvalidRequestError("a put needs at least one row")
        if len(set(rows)) != n:
            raise InvalidRequestError("a put lists the same row twice")
        expected = sum(column_frame_count(h) for h in headers)
        if expected != len(frames):
            raise ProtocolError(f"StorePut carries {len(frames)} frames, its header {expected}")
        chunks: list[_Chunk] = []
        pos = 0
        for h in headers:
            if h.kind == "pickle" and not self.allow_pickle:
                raise SchemaError(
                    f"field {h.name!r} is pickled but this storage unit does not allow pickle; "
                    "start it with allow_pickle=True in trusted deployments only"
                )
            k = column_frame_count(h)
            chunks.append(_Chunk(h, column_from_frames(h, frames[pos : pos + k], n)))
            pos += k
        fields = self._index.setdefault(partition_id, {})
        for chunk in chunks:
            index = fields.setdefault(chunk.header.name, {})
            self.resident_bytes += chunk.nbytes
            for i, r in enumerate(rows):
                old = index.get(r)
                if old is not None:
                    self._drop(old[0])
                index[r] = (chunk, i)

    def _drop(self, chunk: _Chunk) -> None:
        chunk.live -= 1
        if chunk.live == 0:
            self.resident_bytes -= chunk.nbytes

    def get(
        self,
        partition_id: str,
        rows: Sequence[int],
        fields: Sequence[str],
        *,
        max_bytes: int | None = None,
        incarnation: str | None = None,
    ) -> tuple[list[ColumnHeader], list[Column]]:
        """Columns for ``fields`` of ``rows`` in that order (views when possible).

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
        columns: list[Column] = []
        for name in fields:
            index = stored.get(name)
            if index is None:
                raise RowsNotFound(f"field {name!r} of partition {partition_id!r} is not stored")
            pieces: list[Column] = []
            piece_headers: list[ColumnHeader] = []
            run_chunk: _Chunk | None = None
            a = b = 0
            for r in rows:
                try:
                    chunk, i = index[r]
                except KeyError:
                    raise RowsNotFound(
                        f"row {r} of field {name!r} in partition {partition_id!r} is not stored "
                        "(never written, or cleared)"
                    ) from None
                if chunk is run_chunk and i == b:
                    b += 1
                    continue
                if run_chunk is not None:
                    pieces.append(take_rows(run_chunk.column, [(a, b)]))
                    piece_headers.append(run_chunk.header)
                run_chunk, a, b = chunk, i, i + 1
            if run_chunk is not None:
                pieces.append(take_rows(run_chunk.column, [(a, b)]))
                piece_headers.append(run_chunk.header)
            if not pieces:  # no rows requested
                raise InvalidRequestError("a get needs at least one row")
            if budget is not None:
                budget -= _joined_nbytes(pieces)
                if budget < 0:
                    raise OverBudget(f"the cells take more than {max_bytes} bytes")
            # rows put with different shapes: dense if they share one, else jagged
            header, column = join_columns(piece_headers, pieces)
            headers.append(header)
            columns.append(column)
        return headers, columns

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
            frames.extend(column_to_frames(h, c))
        return StoredColumns(len(rows), headers), frames

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
                for chunk, _ in index.values():
                    self._drop(chunk)
            del self._index[partition_id]
            return freed
        freed_rows: set[int] = set()
        for index in stored.values():
            for r in rows:
                entry = index.pop(r, None)
                if entry is not None:
                    self._drop(entry[0])
                    freed_rows.add(r)
        if all(not ix for ix in stored.values()):
            del self._index[partition_id]
            self._incarnation.pop(partition_id, None)
        return len(freed_rows)

    def stats(self) -> StoreStatsReply:
        rows = sum(
            max((len(ix) for ix in fields.values()), default=0) for fields in self._index.values()
        )
        return StoreStatsReply(len(self._index), rows, self.resident_bytes, self.instance)


class StorageServer:
    """Serves one :class:`StorageState` on a ROUTER socket (all handlers are synchronous)."""

    def __init__(
        self,
        unit_id: int,
        *,
        allow_pickle: bool = False,
        metrics: Metrics | None = None,
        curve: CurveServer | None = None,
    ) -> None:
        self.unit_id = unit_id
        self.curve = curve
        self._malformed = LogThrottle()
        self.state = StorageState(allow_pickle=allow_pickle)
        self.metrics = metrics or Metrics(None, "storage")
        self._endpoint: RouterEndpoint | None = None

    @property
    def address(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("the storage unit is not serving")
        return self._endpoint.address

    async def serve(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind, report the address through ``task_status``, serve until cancelled."""
        self._endpoint = RouterEndpoint(bind, self._on_message, curve=self.curve)
        try:
            task_status.started(self._endpoint.address)
            await anyio.sleep_forever()
        finally:
            self._endpoint.close()

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

    def _on_message(self, peer: bytes, frames: list[zmq.Frame]) -> None:
        assert self._endpoint is not None
        header = frames[0].buffer
        try:
            req: StorageRequest = storage_request_decoder.decode(header)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            rid = salvage_rid(header)
            self._malformed.warning("malformed storage request", error=str(exc), rid=rid)
            if rid is not None:
                self._endpoint.send(peer, [error_reply(rid, ProtocolError(str(exc)))])
            return
        body = req.body
        metrics = self.metrics.enabled
        t0 = time.perf_counter() if metrics else 0.0
        try:
            validate(body)
            if isinstance(body, StorePut):
                self.state.put(
                    body.partition_id,
                    body.rows,
                    body.columns,
                    frames[1:],
                    incarnation=body.incarnation,
                )
                reply: list[Any] = [ok_reply(req.rid, None)]
                if metrics:
                    self.metrics.transfer("in", sum(f.buffer.nbytes for f in frames[1:]))
            elif isinstance(body, StoreGet):
                stored, out = self.state.read(
                    body.partition_id, body.rows, body.fields, incarnation=body.incarnation
                )
                reply = [ok_reply(req.rid, stored), *out]
                if metrics:
                    self.metrics.transfer("out", sum(memoryview(f).nbytes for f in out))
            elif isinstance(body, StoreClear):
                freed = self.state.clear(body.partition_id, body.rows, incarnation=body.incarnation)
                reply = [ok_reply(req.rid, freed)]
            elif isinstance(body, StoreStats):
                reply = [ok_reply(req.rid, self.state.stats())]
            elif isinstance(body, Cancel):
                return  # every storage op completes at once; nothing to cancel
            else:  # pragma: no cover - the decoder admits only the types above
                raise ProtocolError(f"unknown storage request {type(body).__name__}")
        except Exception as exc:
            if not isinstance(exc, (InvalidRequestError, RowsNotFound, ProtocolError)):
                log.exception("storage request failed", rid=req.rid, op=type(body).__name__)
            reply = [error_reply(req.rid, exc)]
            metrics_ok = False
        else:
            metrics_ok = True
        self._endpoint.send(peer, reply)
        if metrics:
            self.metrics.request(type(body).__name__, metrics_ok, time.perf_counter() - t0)
