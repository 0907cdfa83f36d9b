# Generated from src/tq_async/_client/_async/_get.py by scripts/unasync.py:
# do not edit; change the source and run `python scripts/unasync.py`.
"""The client's reads: get_meta (which rows), get_data (their cells), get (both at once).

``get`` takes the cells along with the metadata when the controller can send them (one round
trip); otherwise the cells come from each unit, through its shared memory on the same host.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import zmq

from ..._core._gone import cleared_under_read
from ..._errors import (
    BrokenError,
    ClosedError,
    InvalidRequestError,
    PartitionNotFound,
    ProtocolError,
    RowsNotFound,
    SessionLostError,
)
from ..._logging import get_logger
from ..._meta import BatchMeta, check_meta
from ..._paths._device_copy import check_device, copies_to, read_onto, to_device_now
from ..._paths._pinned import pin_arena
from ..._paths._shm import ArenaMap
from ..._sync_primitives import cleanup_scope, run_each, run_sync_off_loop
from ..._transport._sync_dealer import BlockingConnection
from ..._wire._buffers import buffer_pool
from ..._wire._codec import (
    DeviceColumn,
    column_value,
    columns_to_tensordict,
    torch_dtype,
)
from ..._wire._columns import (
    DENSE,
    JAGGED,
    Column,
    ColumnHeader,
    column_frame_count,
    column_from_frames,
    empty_column,
    join_columns,
    positions_by_unit,
    reorder_column,
)
from ..._wire._protocol import (
    Ack,
    FieldSchema,
    MetaReply,
    Release,
    Reply,
    ShmFree,
    StoredColumns,
    StoreGet,
)
from ._base import THREAD_COPY_BYTES, Links, check_fields
from ._query import MetaQuery, check_nested, lease_ids
from ._replies import decode

if TYPE_CHECKING:  # imported when a program uses one (see `_wire._tensordicts`)
    from tensordict import TensorDict

__all__ = ["GetPath"]

log = get_logger(__name__)


def _copy_spans(arena: ArenaMap, spans: Sequence[tuple[int, int]]) -> list[Any]:
    """Copies of the arena's ``spans``, in buffers of our own (pooled, like inproc reads)."""
    for off, n in spans:
        try:
            arena.check(off, n, "a shared-memory span")
        except ValueError as exc:
            raise ProtocolError(f"{exc}; the storage unit's reply is corrupt") from None
    try:
        # held until the copy is done: the mapping outlives a close meanwhile (the unit's
        # connection broke), so a copy under way never reads unmapped memory
        view = arena.view
    except AttributeError:
        raise BrokenError(
            "the connection to the storage unit broke during a same-host read (its shared "
            "memory is unmapped); retry once it is back"
        ) from None

    def copy() -> list[Any]:
        frames = [
            b""
            if n == 0
            else buffer_pool.copy(view[off : off + n])
            if n >= zmq.COPY_THRESHOLD
            else bytearray(view[off : off + n])
            for off, n in spans
        ]
        arena.check_copied(view)
        return frames

    if sum(n for _, n in spans) >= THREAD_COPY_BYTES:
        return run_sync_off_loop(copy)
    return copy()


def _read_onto(
    arena: ArenaMap, stored: StoredColumns, device: torch.device
) -> tuple[list[Any], dict[int, DeviceColumn]]:
    """A same-host read onto ``device``: its dense columns copied host to device straight
    out of the arena (page-locked), by position, and the other columns' frames copied
    into buffers of our own (`_copy_spans`)."""
    assert stored.shm_spans is not None
    spans, n = stored.shm_spans, stored.n_rows
    in_device_arena = stored.device_spans or []
    host: list[tuple[int, int]] = []
    direct: list[tuple[int, tuple[int, int], torch.dtype]] = []
    pos = 0
    for j, h in enumerate(stored.columns):
        if j < len(in_device_arena) and in_device_arena[j]:
            continue  # read device to device out of the unit's device arena
        k = column_frame_count(h)
        mine = spans[pos : pos + k]
        pos += k
        dtype = _dense_dtype(h)
        if dtype is not None and len(mine) == 1 and mine[0][1] == n * h.item_bytes() > 0:
            direct.append((j, mine[0], dtype))
        else:
            host.extend(mine)
    if pos != len(spans):
        raise ProtocolError("a storage reply names more shared-memory spans than its columns")
    frames = _copy_spans(arena, host)
    if not direct:
        return frames, {}
    for _, (off, nbytes), _ in direct:
        try:
            arena.check(off, nbytes, "a shared-memory span")
        except ValueError as exc:
            raise ProtocolError(f"{exc}; the storage unit's reply is corrupt") from None
    moved = read_onto(arena, [span for _, span, _ in direct], device)
    on_device = {
        j: DeviceColumn(t.view(dtype).view((n, *stored.columns[j].shape)))
        for (j, _, dtype), t in zip(direct, moved, strict=True)
    }
    return frames, on_device


def _pinned_target(device: torch.device | None, arena: ArenaMap | None) -> torch.device | None:
    """``device`` when a read onto it copies straight out of a same-host unit's
    page-locked memory (see tq_async._paths._pinned), else None."""
    if device is None or arena is None or not (pin_arena() and copies_to(device)):
        return None
    return device


def _dense_dtype(header: ColumnHeader) -> torch.dtype | None:
    """The torch dtype of a dense column (None: not dense, or no torch dtype)."""
    if header.kind != DENSE or not header.dtype:
        return None
    try:
        return torch_dtype(header.dtype)
    except ProtocolError:
        return None


def _stored_columns(
    stored: StoredColumns,
    frames: Sequence[Any],
    n_rows: int,
    on_device: dict[int, DeviceColumn] | None = None,
) -> tuple[list[ColumnHeader], list[Column | DeviceColumn]]:
    """Rebuild the columns of one unit's part from its frames (all of them, exactly) and
    the columns read from its device arena (``on_device``, by position)."""
    if stored.n_rows != n_rows:
        raise ProtocolError(f"a storage part carries {stored.n_rows} rows, expected {n_rows}")
    columns: list[Column | DeviceColumn] = []
    pos = 0
    for j, h in enumerate(stored.columns):
        if on_device and j in on_device:
            columns.append(on_device[j])
            continue
        k = column_frame_count(h)  # too few frames: column_from_frames says so
        columns.append(column_from_frames(h, frames[pos : pos + k], n_rows))
        pos += k
    if pos != len(frames):
        raise ProtocolError("a storage reply carried extra frames")
    return stored.columns, columns


def _inline_parts(
    got: MetaReply, frames: Sequence[Any]
) -> tuple[dict[int, list[int]], dict[int, tuple[list[ColumnHeader], list[Column | DeviceColumn]]]]:
    """The per-unit parts a get_meta reply carried inline (``got.inline``)."""
    assert got.inline is not None
    by_unit = positions_by_unit(got.units)
    if len(got.inline) != len(by_unit):
        raise ProtocolError(
            f"an inline reply carries {len(got.inline)} parts for {len(by_unit)} units"
        )
    parts: dict[int, tuple[list[ColumnHeader], list[Column | DeviceColumn]]] = {}
    pos = 0
    for (unit, positions), stored in zip(by_unit.items(), got.inline, strict=True):
        k = sum(column_frame_count(h) for h in stored.columns)
        parts[unit] = _stored_columns(stored, frames[pos : pos + k], len(positions))
        pos += k
    if pos != len(frames):
        raise ProtocolError("an inline reply carried extra frames")
    return by_unit, parts


def _batch_meta(
    got: MetaReply, partition_id: str, task_name: str, batch_index: int | None
) -> BatchMeta:
    """The `BatchMeta` of a get_meta reply."""
    return BatchMeta(
        partition_id=partition_id,
        global_indexes=got.rows,
        field_names=got.fields,
        units=got.units,
        tags=got.tags,
        task_name=task_name,
        batch_index=batch_index,
        end_of_stream=got.end_of_stream,
        policy_versions=got.versions,
        lease_id=got.lease_id,
        incarnation=got.incarnation,
        keys=got.keys or [],
    )


def _inline_frame_count(got: MetaReply) -> int:
    """How many of a reply's frames carry its own inline cells."""
    if got.inline is None:
        return 0
    return sum(column_frame_count(h) for stored in got.inline for h in stored.columns)


def _merge_parts(
    n: int,
    by_unit: dict[int, list[int]],
    parts: dict[int, tuple[list[ColumnHeader], list[Column | DeviceColumn]]],
) -> tuple[list[ColumnHeader], list[Column | DeviceColumn]]:
    """One column per field, rows back in batch order, from the parts of several units."""
    if len(by_unit) == 1:
        return parts[next(iter(by_unit))]
    order = [pos for positions in by_unit.values() for pos in positions]
    inverse = [0] * n
    for i, pos in enumerate(order):
        inverse[pos] = i
    names = parts[next(iter(by_unit))][0]
    headers: list[ColumnHeader] = []
    columns: list[Column | DeviceColumn] = []
    for j in range(len(names)):
        pieces = [parts[u][1][j] for u in by_unit]
        piece_headers = [parts[u][0][j] for u in by_unit]
        device = next((p.tensor.device for p in pieces if isinstance(p, DeviceColumn)), None)
        if device is not None and len(set(piece_headers)) == 1 and piece_headers[0].kind == JAGGED:
            headers.append(piece_headers[0])
            columns.append(_join_jagged(piece_headers[0], pieces, inverse, device))
            continue
        if device is not None and len(set(piece_headers)) == 1:  # joined on the device
            tensors = [_tensor_on(piece_headers[0], p, device) for p in pieces]
            index = torch.tensor(inverse, device=device)
            headers.append(piece_headers[0])
            columns.append(DeviceColumn(torch.cat(tensors).index_select(0, index)))
            continue
        # units may answer one field with different row shapes: join them like a unit does
        host = [_host_column(h, p) for h, p in zip(piece_headers, pieces, strict=True)]
        header, merged = join_columns(piece_headers, host)
        headers.append(header)
        columns.append(reorder_column(merged, inverse))
    return headers, columns


def _tensor_on(header: ColumnHeader, column: Column | DeviceColumn, device: Any) -> torch.Tensor:
    if isinstance(column, DeviceColumn):
        return column.tensor.to(device, non_blocking=True)
    tensor: torch.Tensor = column_value(header, column)
    return tensor.to(device)


def _host_column(header: ColumnHeader, column: Column | DeviceColumn) -> Column:
    """``column`` in host memory (a part read from a device arena is copied to the host)."""
    if not isinstance(column, DeviceColumn):
        return column
    return column.on_host(header, column.tensor.cpu())


def _join_jagged(
    header: ColumnHeader, pieces: list[Column | DeviceColumn], inverse: list[int], device: Any
) -> DeviceColumn:
    """Jagged ``pieces`` (some on ``device``) joined there, row ``i`` being row
    ``inverse[i]`` of them one after another."""
    values, lengths = [], []
    for p in pieces:
        if isinstance(p, DeviceColumn):
            assert p.offsets is not None
            values.append(p.tensor.to(device, non_blocking=True))
            lengths.append(p.offsets[1:] - p.offsets[:-1])
        else:
            nested = column_value(header, p)
            values.append(nested.values().to(device))
            lengths.append(nested.offsets().diff())
    length = torch.cat(lengths)
    starts = torch.cumsum(length, 0) - length
    index = torch.tensor(inverse, dtype=torch.int64)
    picked = length[index]
    offsets = torch.zeros(len(picked) + 1, dtype=torch.int64)
    torch.cumsum(picked, 0, out=offsets[1:])
    shift = torch.repeat_interleave(starts[index] - offsets[:-1], picked)
    rows = (torch.arange(int(offsets[-1])) + shift).to(device, non_blocking=True)
    return DeviceColumn(torch.cat(values).index_select(0, rows), offsets)


def _read_fields(fields: Any) -> list[str]:
    """`get_data`'s ``fields``, checked: names (any sequence of them; an empty one reads
    no column)."""
    if not isinstance(fields, (str, bytes, list, tuple)):
        with contextlib.suppress(TypeError):  # (not iterable: check_fields names it)
            fields = list(fields)
    if type(fields) in (list, tuple) and not fields:
        return []
    return check_fields(fields, "fields")


def _release_pin(conn: BlockingConnection, reply: Reply) -> None:
    """Unpin a shared-memory read whose caller gave up before copying it."""
    if not reply.ok:
        return
    with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
        stored: StoredColumns = decode(reply.payload, StoredColumns)
        if stored.shm_spans is not None:
            conn.send_best_effort(ShmFree([], [stored.pin]))


class GetPath:
    """The read path of a client: `get_meta`,
    `get_data`, `get`, ``ack`` and
    ``release``, over the client's links."""

    def __init__(self, links: Links, *, inline_get_bytes: int) -> None:
        self._links = links
        self.inline_get_bytes = inline_get_bytes
        #: id of its BatchMeta -> (the BatchMeta, its process), for the gets whose rows were
        #: taken and whose cells are being read
        self._reading: dict[int, tuple[BatchMeta, int]] = {}

    def farewell(self) -> list[Release]:
        """What a client closing while gets of this process read their cells sends last: their
        rows, given back (those gets fail with ClosedError; nobody else gets the rows)."""
        pid = os.getpid()
        taken, self._reading = self._reading, {}  # (one swap: a reading thread pops after)
        return [_give_back(meta) for meta, owner in taken.values() if owner == pid]

    def meta_call(
        self, query: MetaQuery, inline_bytes: int
    ) -> tuple[BatchMeta, MetaReply, list[Any]]:
        """`get_meta` of a checked ``query``, plus the raw reply
        and its frames (cells sent inline, up to ``inline_bytes``); the client's
        ``get_meta`` calls it directly (one coroutine less per call on the control plane's
        hottest path)."""
        req = query.request(inline_bytes, self._links.host_id)
        partition_id, task_name = query.partition_id, query.task_name
        skip_undo = query.mode != "fetch" or query.recorded

        def on_abandon(reply: Reply, _frames: list[zmq.Frame]) -> None:
            if not reply.ok or skip_undo:
                return
            late: MetaReply = decode(reply.payload, MetaReply)
            if late.rows and self._links.controller is not None:
                undo = Release(partition_id, task_name, late.rows, late.incarnation, late.lease_id)
                self._links.controller.send_best_effort(undo)

        timeout = query.timeout
        client_deadline = None if timeout is None else timeout + self._links.request_timeout
        controller = self._links.controller_link()
        payload, frames = controller.request(
            req, timeout=client_deadline, on_abandon=on_abandon, cancel_undoes=True
        )
        got: MetaReply = decode(payload, MetaReply)
        self._links.note_epoch(got.units_epoch)
        return _batch_meta(got, partition_id, task_name, query.batch_index), got, frames

    def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        nested: bool | Collection[str] = False,
        device: Any = None,
    ) -> TensorDict:
        """Read the cells of ``meta``'s rows (``fields`` defaults to ``meta.field_names``)."""
        meta = check_meta(meta, "get_data")
        names = list(meta.field_names) if fields is None else _read_fields(fields)
        as_nested = check_nested(nested)
        target = check_device(device, here=True)
        n = len(meta)
        if n == 0 or not names:
            return to_device_now(self._empty(meta, names, as_nested), target)
        # onto a device: columns in a device arena of a unit on this host go device to device
        on = target if target is not None and not as_nested else None
        headers, columns = self.fetch_columns(meta, names, device=on)
        return to_device_now(columns_to_tensordict(n, headers, columns, nested=as_nested), target)

    def _empty(
        self, meta: BatchMeta, names: list[str], nested: bool | frozenset[str]
    ) -> TensorDict:
        """A batch of 0 rows: end of stream has no columns; any other (a rank's empty share)
        carries every field with 0 rows, its dtype and row shape, as a non-empty batch of
        the same fields would (one question to the controller, no storage unit)."""
        if meta.end_of_stream or not names or len(meta):
            from tensordict import TensorDict

            return TensorDict({}, batch_size=[len(meta)])
        headers = self._links.call(FieldSchema(meta.partition_id, names), list[ColumnHeader])
        by_name = {h.name: h for h in headers}
        known = [by_name[f] for f in names if f in by_name]
        return columns_to_tensordict(0, known, [empty_column(h) for h in known], nested=nested)

    def fetch_host_columns(
        self, meta: BatchMeta, names: list[str]
    ) -> tuple[list[ColumnHeader], list[Column]]:
        """`fetch_columns` into host memory (what a checkpoint writes)."""
        headers, columns = self.fetch_columns(meta, names)
        host: list[Column] = []
        for c in columns:
            assert not isinstance(c, DeviceColumn)  # no device named: every column is host's
            host.append(c)
        return headers, host

    def fetch_columns(
        self, meta: BatchMeta, names: list[str], *, device: torch.device | None = None
    ) -> tuple[list[ColumnHeader], list[Column | DeviceColumn]]:
        """Columns ``names`` of ``meta``'s rows, in ``meta`` order, fetched from every unit.

        With ``device``, columns a unit on this host keeps in its device arena (of that kind
        of device) come as `DeviceColumn` on ``device``, copied device to device.
        """
        by_unit = positions_by_unit(meta.units)
        parts: dict[int, tuple[list[ColumnHeader], list[Column | DeviceColumn]]] = {}

        def fetch(unit: int, positions: list[int]) -> None:
            rows = (
                meta.global_indexes
                if len(by_unit) == 1
                else [meta.global_indexes[i] for i in positions]
            )
            conn, arena = self._links.data_link(unit)
            nixl = None
            if arena is None and self._links.nixl is not None:  # another host: NIXL
                nixl = self._links.nixl.link(unit, conn, self._links.request_timeout)
            shm = arena is not None or nixl is not None
            view = None
            if device is not None and arena is not None and self._links.devices is not None:
                view = self._links.devices.link(unit, conn, self._links.request_timeout)
                if view is not None and view.device.type != device.type:
                    view = None
            onto = _pinned_target(device, arena)
            get = StoreGet(
                meta.partition_id,
                rows,
                names,
                meta.incarnation,
                shm=shm,
                device=view is not None,
                host=self._links.host_id,
                pinned=onto is not None,
                task=meta.task_name or "",
                jagged=view is not None,
            )
            on_device: dict[int, DeviceColumn] | None = None
            try:
                payload, frames = self._ask(unit, conn, get)
            except SessionLostError:
                if not get.shm:
                    raise
                # the unit restarted under this connection: read through its socket this
                # time (the next data call sets shared memory up again)
                self._links.session_lost(unit, arena)
                get.shm = get.device = get.pinned = False
                payload, frames = self._links.unit_request(unit, get)
            stored: StoredColumns = decode(payload, StoredColumns)
            if stored.shm_spans is not None:
                if not shm or frames:
                    conn.send_best_effort(ShmFree([], [stored.pin]))
                    raise ProtocolError("an unexpected shared-memory reply")
                stored, frames, on_device = self._copy_out(
                    unit, conn, get, stored, arena, nixl, (onto, view, device)
                )
            parts[unit] = _stored_columns(stored, frames, len(rows), on_device)

        if len(by_unit) == 1:
            ((unit, positions),) = by_unit.items()
            fetch(unit, positions)
        else:
            run_each(fetch, by_unit.items())
        return _merge_parts(len(meta), by_unit, parts)

    def _ask(
        self, unit: int, conn: BlockingConnection, get: StoreGet
    ) -> tuple[msgspec.Raw, list[Any]]:
        """A read's request to ``unit``: on the connection its shared memory (or NIXL) is
        granted to when ``get.shm`` (a pin the call gives up on is released), else on the
        socket path, which follows a unit restarted on a new address."""
        if get.shm:

            def on_abandon(reply: Reply, _frames: list[zmq.Frame]) -> None:
                _release_pin(conn, reply)

            try:
                return conn.request(get, timeout=self._links.request_timeout, on_abandon=on_abandon)
            except (BrokenError, ClosedError):
                # the unit went away (its memory with it): through the socket path (a
                # durable unit's rows are back at its new address)
                get.shm = get.device = get.pinned = False
        return self._links.unit_request(unit, get)

    def _copy_out(
        self,
        unit: int,
        conn: BlockingConnection,
        get: StoreGet,
        stored: StoredColumns,
        arena: ArenaMap | None,
        nixl: Any,
        targets: tuple[torch.device | None, Any, torch.device | None],
    ) -> tuple[StoredColumns, list[Any], dict[int, DeviceColumn] | None]:
        """A shared-memory (or NIXL) reply's columns, copied out of the unit's memory (its
        pin freed after); read through the socket instead when the NIXL transfer failed, or
        when a durable unit restarted under the copy (the next data call sets shared memory
        up again). ``targets``: `_read_arena`'s ``onto``, ``view`` and ``device``."""
        assert stored.shm_spans is not None
        try:
            if arena is not None:
                try:
                    with self._links.same_host_units.copying(unit):
                        frames, on_device = self._read_arena(arena, stored, *targets)
                    return stored, frames, on_device
                except SessionLostError:
                    self._links.session_lost(unit, arena)
                    get.device = get.pinned = False
            else:
                assert nixl is not None
                assert self._links.nixl is not None
                got = self._links.nixl.read(
                    unit, nixl, stored.shm_spans, self._links.request_timeout
                )
                if got is not None:
                    return stored, got, None
        finally:
            conn.send_best_effort(ShmFree([], [stored.pin]))
        get.shm = False
        payload, frames = self._links.unit_request(unit, get)
        return decode(payload, StoredColumns), frames, None

    def _read_arena(
        self,
        arena: ArenaMap,
        stored: StoredColumns,
        onto: torch.device | None,
        view: Any,
        device: torch.device | None,
    ) -> tuple[list[Any], dict[int, DeviceColumn] | None]:
        """A same-host read's columns out of the unit's arena (onto ``onto`` straight out
        of page-locked memory) and its device arena (``view``, onto ``device``)."""
        assert stored.shm_spans is not None
        on_device: dict[int, DeviceColumn] | None = None
        try:
            if onto is not None:
                frames, on_device = _read_onto(arena, stored, onto)
            else:
                frames = _copy_spans(arena, stored.shm_spans)
        except BrokenError:  # the arena was unmapped: by the client's close? (ClosedError)
            self._links.ctl()
            raise
        if stored.device_spans is not None:
            if view is None or device is None or self._links.devices is None:
                raise ProtocolError("an unexpected device arena reply")
            got_device = self._links.devices.read(view, stored, device)
            on_device = (on_device or {}) | got_device
        return frames, on_device

    def get(self, query: MetaQuery) -> tuple[TensorDict, BatchMeta]:
        """``get_meta`` then ``get_data`` of a checked ``query``: the rows' data and their
        `BatchMeta`."""
        meta, got, frames = self.meta_call(query, self.inline_get_bytes)
        # (a recorded batch keeps its rows and its hold: its next reader takes them over)
        undo = query.mode == "fetch" and meta.batch_index is None and len(meta) > 0
        if undo:
            self._reading[id(meta)] = (meta, os.getpid())
        try:
            td = self._read(meta, got, frames, query.nested, query.device)
        except BaseException as exc:
            # the rows go back, and their lease or hold is dropped with them (unless the
            # client closed meanwhile: its farewell gave them back)
            if undo and self._reading.pop(id(meta), None) is not None:
                with cleanup_scope(5):
                    try:
                        self.release(meta)
                    except (RowsNotFound, PartitionNotFound):
                        pass  # gone with their partition (cleared): nothing to give back
                    except Exception as why:  # the read's own outcome matters more
                        log.warning("could not give back the rows of a failed get", error=str(why))
            if isinstance(exc, RowsNotFound):
                raise RowsNotFound(cleared_under_read(meta.partition_id, "get")) from exc
            raise
        if undo and self._reading.pop(id(meta), None) is None:
            raise ClosedError(
                "the client was closed while this get read its rows: they were given back"
            )
        self._end_hold(meta, query)  # an auto-clear hold: the data is read, rows may go
        return td, meta

    def get_batches(self, query: MetaQuery) -> list[tuple[TensorDict, BatchMeta]]:
        """`get` of the batch the query's ``batch_index`` names, and of the batches its
        ``also`` names that can be decided at once, in one round trip."""
        meta, got, frames = self.meta_call(query, self.inline_get_bytes)
        partition_id, task_name = query.partition_id, query.task_name
        as_nested, target = query.nested, query.device
        answers = [(meta, got)]
        for index, follower in zip(query.also or (), got.more or (), strict=False):
            answers.append((_batch_meta(follower, partition_id, task_name, index), follower))
        out: list[tuple[TensorDict, BatchMeta]] = []
        pos = 0
        # (if a read fails or is cancelled, the batches not read stay recorded under their
        # indexes, each with its rows and its hold: their next readers take them over)
        for m, g in answers:
            k = _inline_frame_count(g)
            try:
                td = self._read(m, g, frames[pos : pos + k], as_nested, target)
            except RowsNotFound as exc:
                raise RowsNotFound(cleared_under_read(partition_id, "get_batches")) from exc
            out.append((td, m))
            pos += k
            self._end_hold(m, query)
        if pos != len(frames):
            raise ProtocolError("a get_meta reply carried extra frames")
        return out

    def _read(
        self,
        meta: BatchMeta,
        got: MetaReply,
        frames: Sequence[Any],
        as_nested: bool | frozenset[str],
        target: Any,
    ) -> TensorDict:
        """The data of a get_meta reply: sent inline, read from the units, or empty."""
        if not len(meta):  # end of stream or an empty share: no unit to ask
            return to_device_now(self._empty(meta, list(meta.field_names), as_nested), target)
        if got.inline is not None:  # the controller sent the cells along: no get_data
            headers, columns = _merge_parts(len(meta), *_inline_parts(got, frames))
            td = columns_to_tensordict(len(meta), headers, columns, nested=as_nested)
            return to_device_now(td, target)
        return self.get_data(meta, nested=as_nested, device=target)

    def _end_hold(self, meta: BatchMeta, query: MetaQuery) -> None:
        """Drop the auto-clear hold a fetch without ``lease`` put on its rows (unless the
        caller keeps it, to acknowledge the rows itself)."""
        if query.lease is not None or query.keep_hold:
            return
        if meta.lease_id and self._links.controller is not None:
            self._links.controller.send_best_effort(Ack([meta.lease_id]))

    def ack(self, metas: BatchMeta | Sequence[BatchMeta]) -> None:
        """Acknowledge leased batches: their rows stay consumed (no redelivery)."""
        ids = lease_ids(metas)
        if ids:
            self._links.call(Ack(ids), None)

    def release(self, meta: BatchMeta) -> None:
        """Give rows a task fetched back to it: they become ready again for ``meta.task_name``."""
        meta = check_meta(meta, "release")
        if meta.task_name is None:
            raise InvalidRequestError("release needs a BatchMeta returned by get_meta")
        self._links.call(_give_back(meta), None)


def _give_back(meta: BatchMeta) -> Release:
    """The request that gives the rows of ``meta`` (fetched, not recorded) back to its task,
    dropping their lease or hold."""
    assert meta.task_name is not None
    return Release(
        meta.partition_id,
        meta.task_name,
        meta.global_indexes,
        meta.incarnation,
        meta.lease_id or 0,
    )
