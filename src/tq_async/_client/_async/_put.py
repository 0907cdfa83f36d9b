"""The client's puts: validate and encode a batch, place its rows, store, commit.

A put is three steps — ask the controller for rows and placement, send each unit its slice
(through the unit's shared memory on the same host), commit — or one message to the
controller for a small put whose rows sit on one unit (`PutInline`). The rows become
visible to consumers only at the commit, with their tags.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from ..._core._gone import cleared_under_put
from ..._errors import (
    InvalidRequestError,
    PartitionNotFound,
    RowsNotFound,
    SchemaError,
    SessionLostError,
)
from ..._logging import get_logger
from ..._meta import BatchMeta, check_meta
from ..._paths._device_copy import (
    DeviceFrame,
    copy_frames,
    frame_nbytes,
    stage_frames,
    to_host,
)
from ..._paths._shm import ArenaMap, align
from ..._primitives import Repeater, cleanup_scope, run_each, run_sync_off_loop
from ..._transport._dealer import DealerConnection
from ..._wire._checks import check_id, check_ints, check_seconds
from ..._wire._codec import DeviceColumn, columns_from_batch, tags_for_wire
from ..._wire._columns import (
    Column,
    ColumnHeader,
    column_nbytes,
    column_to_frames,
    position_runs,
    positions_by_unit,
    take_rows,
)
from ..._wire._protocol import (
    AbortPut,
    ClearSamples,
    Placement,
    PutBegin,
    PutCommit,
    PutInline,
    RenewPut,
    Reply,
    ShmAlloc,
    ShmFrames,
    ShmFree,
    StoreClear,
    StorePut,
)
from ._base import THREAD_COPY_BYTES, Links, as_int, tag_rows
from ._device_links import keeps_on_device
from ._device_puts import give_back_lent, keep_spares, lend_ahead, place_device_columns
from ._replies import ask_grant, decode
from ._slots import HeldSlots

if TYPE_CHECKING:  # imported when a program uses one (see `_wire._tensordicts`)
    from tensordict import TensorDictBase

__all__ = ["PutPath"]

log = get_logger(__name__)


#: puts smaller than this go through the socket even to a unit on this host: one round trip
#: instead of two (grant, then put) costs less than the copy it saves
_SHM_MIN_BYTES = 64 << 10


def _check_versions(policy_version: int | Sequence[int] | None, n: int) -> list[int] | None:
    """One policy version per row (an int >= 0 each), or None."""
    if policy_version is None:
        return None
    one = as_int(policy_version)
    if isinstance(one, (int, str, bytes)) or not hasattr(one, "__iter__"):
        versions = [one] * n
    else:
        versions = [as_int(v) for v in one]
    if len(versions) != n:
        raise InvalidRequestError(
            f"policy_version must be one int >= 0 or {n} of them, got {len(versions)}"
        )
    check_ints("policy_version", versions)
    return versions


def _take_rows(
    column: Column | DeviceColumn, runs: Sequence[tuple[int, int]]
) -> Column | DeviceColumn:
    """`take_rows`, for device columns too (their rows joined on the device)."""
    if not isinstance(column, DeviceColumn):
        return take_rows(column, runs)
    return column.take(runs)


@dataclass(frozen=True, slots=True)
class _Put:
    """A validated, encoded put on its way to the services."""

    partition_id: str
    meta: BatchMeta | None
    keys: Sequence[str] | None
    headers: list[ColumnHeader]
    columns: list[Column | DeviceColumn]
    n: int
    tags: list[dict[str, Any] | None] | None
    versions: list[int] | None


async def _undo(
    links: Links, put: _Put, placement: Placement, sent: list[tuple[DealerConnection, StorePut]]
) -> None:
    """Reclaim what a three-step put that failed (or was cancelled) after its placement
    holds: its put lease, its new rows and the cells it sent (best effort: the put's own
    error is what its caller gets)."""
    controller = links.controller
    if controller is None:
        return  # closed meanwhile: the close aborted the put (`PutPath.farewell`)
    partition_id = put.partition_id
    if put.keys is not None:
        if placement.put_id:
            # its new keys' rows are reclaimed at once, those no other call binds meanwhile
            # (another put of the key, a tag): their cells are freed as below
            reclaimed = await _abort_keyed(links, placement.put_id)
            _free_sent(partition_id, sent, reclaimed)
        return
    if placement.put_id:
        # new rows not committed are reclaimed at once
        controller.send_best_effort(AbortPut([placement.put_id]))
    if put.meta is not None:
        return
    gone = False
    with cleanup_scope(5):
        try:
            undo = ClearSamples(partition_id, placement.rows, placement.incarnation, undo=True)
            await links.call(undo, None)
            gone = True
        except (RowsNotFound, PartitionNotFound):
            gone = True  # already gone (e.g. lost with their storage unit, or cleared)
        except Exception as exc:  # the original error matters more
            log.warning("could not clear rows of a failed put", error=str(exc))
    if gone:
        _free_sent(partition_id, sent, None)


def _free_sent(
    partition_id: str, sent: list[tuple[DealerConnection, StorePut]], rows: set[int] | None
) -> None:
    """Free the cells a failed put sent, of ``rows`` (None: all), which the controller no
    longer has.

    The clear the controller sends a unit travels on another connection than the put's
    columns, which may still be on their way (megabytes through the socket): the unit would
    store them after it, for rows nobody has. A clear sent after them on their own
    connection frees them -- only once the controller has no such rows: a commit whose
    reply was lost may have been journaled, and its cells must stay."""
    for conn, store in sent:
        mine = store.rows if rows is None else [r for r in store.rows if r in rows]
        if mine:
            conn.send_best_effort(StoreClear(partition_id, mine, store.incarnation))


async def _abort_keyed(links: Links, put_id: int) -> set[int]:
    """Abort a keyed put: the rows the controller reclaimed (none if it could not say)."""
    with cleanup_scope(5):
        try:
            return set(await links.call(AbortPut([put_id]), list[int]))
        except Exception as exc:  # the original error matters more
            log.warning("could not abort a failed keyed put", error=str(exc))
    return set()


class PutPath:
    """The put path of a client: `put` and `put_nowait` (and the keyed puts of the KV
    calls) through `write`, over the client's links."""

    def __init__(self, links: Links, *, inline_put_bytes: int) -> None:
        self._links = links
        self.inline_put_bytes = inline_put_bytes
        #: put id -> the process that placed it, for puts not yet committed or aborted
        self._open: dict[int, int] = {}
        #: the admission slots this client holds: its puts settle them, renewed while held
        self.slots = HeldSlots(links)

    def farewell(self) -> list[AbortPut]:
        """What a client closing while puts of this process are in flight sends last: their
        aborts (they fail with ClosedError; their rows are reclaimed at once, not when the
        put lease lapses). Its admission slots are renewed no more."""
        self.slots.stop()
        pid = os.getpid()
        mine = sorted(put_id for put_id, owner in self._open.items() if owner == pid)
        self._open.clear()
        return [AbortPut(mine)] if mine else []

    async def write(
        self,
        data: TensorDictBase | Mapping[str, Any],
        partition_id: str | None,
        *,
        meta: BatchMeta | None,
        tags: Sequence[Mapping[str, Any] | None] | None,
        keys: Sequence[str] | None = None,
        policy_version: int | Sequence[int] | None = None,
        timeout: float | None = None,
        nowait: bool = False,
    ) -> BatchMeta:
        """Write a batch: `put` (new rows of ``partition_id``, or new fields of the rows in
        ``meta``), `put_nowait` (``nowait``: `WouldBlock` instead of waiting for room), or a
        keyed put of the KV calls (``keys``)."""
        if meta is not None:
            meta = check_meta(meta, "put")
            if partition_id is not None and partition_id != meta.partition_id:
                raise InvalidRequestError(
                    f"partition_id {partition_id!r} contradicts meta.partition_id "
                    f"{meta.partition_id!r}; pass only meta"
                )
            partition_id = meta.partition_id
        if not isinstance(partition_id, str) or not partition_id:
            raise InvalidRequestError("put needs a partition_id (a non-empty string) or a meta")
        partition_id = check_id("partition_id", partition_id)
        # big dense GPU columns may move device to device (to a unit on this host with a
        # device arena); the other CUDA columns: pinned copies, waited for off the loop
        keep = keeps_on_device if self._links.devices is not None else None
        data = await to_host(data, keep)
        n, headers, columns = columns_from_batch(
            data, allow_pickle=self._links.allow_pickle, keep=keep
        )
        if meta is not None and n != len(meta):
            raise SchemaError(f"the batch has {n} rows but meta has {len(meta)}; they must match")
        if keys is not None and n != len(keys):
            raise SchemaError(f"the batch has {n} rows but {len(keys)} keys; they must match")
        tag_list: list[dict[str, Any] | None] | None = None
        if tags is not None:
            tag_list = tags_for_wire(tag_rows(tags, n))
        versions = _check_versions(policy_version, n)
        timeout = check_seconds("timeout", timeout)
        # a put may wait for capacity: the deadline is the caller's timeout plus the usual one
        deadline: float | bool | None = True
        if self._links.capacity is not None and not nowait:
            deadline = None if timeout is None else timeout + self._links.request_timeout
        fields = [h.name for h in headers]
        put = _Put(partition_id, meta, keys, headers, columns, n, tag_list, versions)
        if keys is None and (meta is None or len(set(meta.units)) == 1) and self._small(columns):
            placement = await self._put_inline(put, nowait, timeout, deadline)
        else:
            placement = await self._put_in_three(put, nowait, timeout, deadline)
        if versions is not None and meta is None and keys is None:
            self.slots.settled(n)  # (new rows given a version settle slots)
        written_versions = {f: list(versions) for f in fields} if versions else {}
        if meta is None:
            out_tags = [t or {} for t in tag_list] if tag_list else []
            return BatchMeta(
                partition_id=partition_id,
                global_indexes=placement.rows,
                # a keyed put names every field its keys have, not only this put's
                field_names=list(dict.fromkeys([*(placement.fields or ()), *fields])),
                units=placement.units,
                tags=out_tags,
                policy_versions=written_versions,
                incarnation=placement.incarnation,
                keys=list(keys) if keys is not None else [],
            )
        merged_tags = [dict(t) for t in meta.tags] if meta.tags else [{} for _ in range(n)]
        if tag_list:
            for m, t in zip(merged_tags, tag_list, strict=True):
                if t:
                    m.update(t)
        return msgspec.structs.replace(
            meta,
            field_names=list(dict.fromkeys([*meta.field_names, *fields])),
            units=placement.units,
            tags=merged_tags if (meta.tags or tag_list) else [],
            policy_versions=meta.policy_versions | written_versions,
            incarnation=placement.incarnation or meta.incarnation,
        )

    def _small(self, columns: list[Column | DeviceColumn]) -> bool:
        """Whether a put's columns go in one message to the controller (`PutInline`;
        device columns never do)."""
        size = 0
        for c in columns:
            if isinstance(c, DeviceColumn):
                return False
            size += column_nbytes(c)
        return size <= self.inline_put_bytes

    async def _put_inline(
        self, put: _Put, nowait: bool, timeout: float | None, deadline: float | bool | None
    ) -> Placement:
        """One round trip: the controller places, stores and commits (see PutInline)."""
        meta = put.meta
        body = PutInline(
            put.partition_id,
            put.headers,
            n_rows=put.n if meta is None else 0,
            rows=None if meta is None else list(meta.global_indexes),
            tags=put.tags,
            versions=put.versions,
            nowait=nowait,
            timeout=timeout,
            incarnation=None if meta is None else meta.incarnation,
            host=self._links.host_id,
        )
        frames: list[Any] = []
        for h, c in zip(put.headers, put.columns, strict=True):
            assert not isinstance(c, DeviceColumn)  # those take three steps
            frames.extend(column_to_frames(h, c))

        def on_abandon(reply: Reply, _frames: list[zmq.Frame]) -> None:
            # the caller gave up (cancelled, timed out) but the put landed: undo new rows, as
            # a failed three-step put does
            if reply.ok and meta is None and self._links.controller is not None:
                late: Placement = decode(reply.payload, Placement)
                undo = ClearSamples(put.partition_id, late.rows, late.incarnation, undo=True)
                self._links.controller.send_best_effort(undo)

        controller = await self._links.controller_link()
        payload, _ = await controller.request(
            body,
            frames,
            timeout=self._links.request_timeout if deadline is True else deadline or None,
            on_abandon=on_abandon,
            cancel_undoes=True,  # (a reply still on its way: the controller clears the rows)
        )
        placement: Placement = decode(payload, Placement)
        self._links.note_epoch(placement.units_epoch)
        return placement

    async def _put_in_three(
        self, put: _Put, nowait: bool, timeout: float | None, deadline: float | bool | None
    ) -> Placement:
        """PutBegin (placement) -> StorePut to each unit -> PutCommit."""
        partition_id, meta, keys, headers = put.partition_id, put.meta, put.keys, put.headers
        begin = PutBegin(
            partition_id,
            headers,
            n_rows=put.n if meta is None and keys is None else 0,
            rows=None if meta is None else list(meta.global_indexes),
            keys=None if keys is None else list(keys),
            nowait=nowait,
            timeout=timeout,
            incarnation=None if meta is None else meta.incarnation,
            host=self._links.host_id,
        )

        def on_abandon(reply: Reply, _frames: list[zmq.Frame]) -> None:
            # placed, but the caller gave up before it knew: reclaim the new rows now (not
            # when the put lease lapses: until then they hold capacity and end-of-stream)
            if reply.ok and self._links.controller is not None:
                late: Placement = decode(reply.payload, Placement)
                if late.put_id:
                    self._links.controller.send_best_effort(AbortPut([late.put_id]))

        controller = await self._links.controller_link()
        answer: list[msgspec.Raw] = []

        async def place() -> None:
            payload, _ = await controller.request(
                begin,
                timeout=self._links.request_timeout if deadline is True else deadline or None,
                on_abandon=on_abandon,
                cancel_undoes=True,  # (a reply still on its way: the controller aborts the put)
            )
            answer.append(payload)

        if meta is None or not any(isinstance(c, DeviceColumn) for c in put.columns):
            await place()
        else:  # the units are known: their device grants are asked for meanwhile
            lend = partial(lend_ahead, self._links, put.columns, meta.units)
            await run_each(lambda job: job(), [(place,), (lend,)])
        placement: Placement = decode(answer[0], Placement)
        self._links.note_epoch(placement.units_epoch)
        fields = [h.name for h in headers]
        renewal = self._renew_put(placement)
        sent: list[tuple[DealerConnection, StorePut]] = []
        if placement.put_id:
            self._open[placement.put_id] = os.getpid()
        try:
            try:
                await self._store(partition_id, placement, headers, put.columns, sent)
            except RowsNotFound as exc:
                if meta is not None:
                    raise
                # a unit refuses the cells of a partition incarnation cleared meanwhile
                raise RowsNotFound(cleared_under_put(partition_id)) from exc
            commit = PutCommit(
                partition_id,
                placement.rows,
                fields,
                put.tags,
                put.versions,
                put_id=placement.put_id,
                incarnation=placement.incarnation,
            )
            await self._links.call(commit, None)
        except BaseException:
            await _undo(self._links, put, placement, sent)
            raise
        finally:
            self._open.pop(placement.put_id, None)
            if renewal is not None:
                renewal.cancel()
        return placement

    def _renew_put(self, placement: Placement) -> Repeater | None:
        """Keep a put's lease alive while its columns travel (a timer, no task).

        The controller reclaims the new rows of a put whose producer stops renewing (it
        died between PutBegin and PutCommit); a live producer renews every third of the
        lease, so a slow put is never reclaimed.
        """
        if not placement.put_id or self._links.controller is None:
            return None
        conn, renew = self._links.controller, RenewPut([placement.put_id])
        return Repeater(placement.put_lease / 3, lambda: conn.send_best_effort(renew))

    async def _store(
        self,
        partition_id: str,
        placement: Placement,
        headers: list[ColumnHeader],
        columns: list[Column | DeviceColumn],
        sent: list[tuple[DealerConnection, StorePut]],
    ) -> None:
        """Send each unit its slice of the put; ``sent`` gets each `StorePut` as it goes
        out, with its connection."""
        by_unit = positions_by_unit(placement.units)

        async def store_one(unit: int, positions: list[int]) -> None:
            if len(by_unit) == 1:
                rows, cols = placement.rows, columns
            else:
                runs = position_runs(positions)
                rows = [placement.rows[i] for i in positions]
                cols = [_take_rows(c, runs) for c in columns]
            store = StorePut(
                partition_id, rows, headers, placement.incarnation, host=self._links.host_id
            )
            conn, arena = await self._links.data_link(unit)
            try:
                await self._store_at(unit, conn, arena, store, cols, sent)
            except SessionLostError:
                # the unit restarted under this connection: nothing was stored; set its
                # shared memory (and device arena) up again and send once more
                store.shm, store.spare, store.device, store.device_spare = None, 0, None, 0
                self._links.session_lost(unit, arena)
                conn, arena = await self._links.data_link(unit)
                await self._store_at(unit, conn, arena, store, cols, sent)

        if len(by_unit) == 1:
            ((unit, positions),) = by_unit.items()
            await store_one(unit, positions)
            return
        await run_each(store_one, by_unit.items())

    async def _store_at(
        self,
        unit: int,
        conn: DealerConnection,
        arena: ArenaMap | None,
        store: StorePut,
        cols: list[Column | DeviceColumn],
        sent: list[tuple[DealerConnection, StorePut]],
    ) -> None:
        """Send ``unit`` its slice of a put (``store``, its columns ``cols``) on ``conn``,
        its device columns into its device arena first when it has one."""
        kept = await place_device_columns(self._links, unit, conn, arena, store, cols)
        try:
            sent.append((conn, store))
            await self._send(unit, conn, arena, store, kept)
        except BaseException:
            if store.device is not None:  # the unit ignores a grant it consumed
                conn.send_best_effort(ShmFree([store.device.grant], []))
            raise
        finally:
            if store.device_spare:
                self._links.same_host_units.asked(unit, device=True)

    async def _send(
        self,
        unit: int,
        conn: DealerConnection,
        arena: ArenaMap | None,
        store: StorePut,
        kept: list[tuple[ColumnHeader, Column | DeviceColumn]],
    ) -> None:
        """Send ``unit`` its slice of a put (``store``; ``kept``: its columns still to send):
        through its shared memory, NIXL or the socket."""
        frames: list[Any] = []
        for h, c in kept:
            if isinstance(c, DeviceColumn) and c.offsets is not None:
                # a jagged column whose values are in the unit's device arena: its offsets
                frames.append(c.offsets.numpy())
            elif isinstance(c, DeviceColumn):  # copied by its device into the arena
                frames.append(DeviceFrame(c.tensor))
            else:
                frames.extend(column_to_frames(h, c))
        on_device = any(isinstance(f, DeviceFrame) for f in frames)
        big = on_device or sum(frame_nbytes(f) for f in frames) >= _SHM_MIN_BYTES
        if big and arena is not None and await self._store_shm(unit, conn, arena, store, frames):
            return
        if on_device:  # the arena is full: through pinned host memory, by socket
            frames = await stage_frames(frames)
        if big and arena is None and self._links.nixl is not None:  # another host: NIXL
            peer = await self._links.nixl.link(unit, conn, self._links.request_timeout)
            if peer is not None and await self._links.nixl.put(
                unit, conn, peer, store, frames, self._links.request_timeout
            ):
                return
        if store.device is None:
            await self._links.unit_request(unit, store, frames)
            return
        # on the connection of its device grant (no other knows it), answered with what
        # the unit lent ahead
        timeout, give_back = self._links.request_timeout, give_back_lent(conn, store)
        payload, _ = await conn.request(store, frames, timeout=timeout, on_abandon=give_back)
        assert arena is not None  # (the device path needs shared memory)
        keep_spares(self._links, unit, conn, arena, store, payload)

    async def _store_shm(
        self,
        unit: int,
        conn: DealerConnection,
        arena: ArenaMap,
        body: StorePut,
        frames: list[Any],
    ) -> bool:
        """Put ``frames`` through the unit's arena; False if it is full (use the socket).
        `DeviceFrame`s are copied by their device, into page-locked chunks of the grant.

        The grant is the one the unit lent with the answer to the last put, when it is big
        enough; each put asks for the next one (a put without ``ShmAlloc``: three round trips).
        """
        nbytes = sum(align(frame_nbytes(f)) for f in frames)
        on_device = any(isinstance(f, DeviceFrame) for f in frames)
        timeout = self._links.request_timeout
        units = self._links.same_host_units
        grant = None if on_device else units.take_spare(unit, conn, nbytes)
        if grant is None:
            ask = ShmAlloc(nbytes, pinned=on_device)
            grant = await ask_grant(conn, ask, timeout, arena, "a shared-memory grant")
            if grant is None:
                return False
        asking = not on_device and units.ask_spare(unit)
        if asking:  # a next put as large (a smaller one: the unit frees the tail)
            body.spare = nbytes

        try:
            if on_device:
                with units.copying(unit):
                    spans = await copy_frames(arena, grant.offset, frames, THREAD_COPY_BYTES)
            elif nbytes >= THREAD_COPY_BYTES:
                with units.copying(unit):
                    spans = await run_sync_off_loop(arena.write, grant.offset, frames)
            else:
                spans = arena.write(grant.offset, frames)
            body.shm = ShmFrames(grant.grant, spans)
            if units.arenas.get(unit) is not arena:
                # another call found the unit restarted and set shared memory up again while
                # this one copied: the grant is the old boot's (nothing is sent)
                raise SessionLostError(
                    "the storage unit restarted while this put copied into its shared memory; "
                    "nothing was stored: set shared memory up again and send the put again"
                )
            payload, _ = await conn.request(
                body, timeout=timeout, on_abandon=give_back_lent(conn, body)
            )
        except BaseException:
            # the unit ignores a grant it consumed already (a put that reached it)
            conn.send_best_effort(ShmFree([grant.grant], []))
            raise
        finally:
            if asking:
                units.asked(unit)
        keep_spares(self._links, unit, conn, arena, body, payload)
        return True
