"""``AsyncClient``: put, get_meta, get_data and every controller call, over pooled sockets.

One client holds one DEALER socket to the controller and one per storage unit, opened on
first use and shared by every concurrent call (requests are multiplexed by id). A put is
three steps — ask the controller for rows and placement, send each unit its slice, commit —
and the rows become visible to consumers only at the commit, with their tags.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import os
from collections.abc import Collection, Generator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NoReturn, TypeVar

import anyio
import msgspec
import torch
import zmq
from tensordict import TensorDict, TensorDictBase

from ._buffers import buffer_pool
from ._checkpoint import ClientLink, load_checkpoint, save_checkpoint
from ._codec import check_text, columns_from_batch, columns_to_tensordict, tags_for_wire
from ._columns import (
    Column,
    ColumnHeader,
    column_frame_count,
    column_from_frames,
    column_nbytes,
    column_to_frames,
    join_columns,
    position_runs,
    positions_by_unit,
    reorder_column,
    take_rows,
)
from ._errors import (
    BrokenError,
    ClosedError,
    InvalidRequestError,
    ProtocolError,
    RowsNotFound,
    SchemaError,
    TQError,
    TQTimeoutError,
)
from ._logging import get_logger
from ._meta import BatchMeta
from ._protocol import (
    Ack,
    AcquireRollout,
    CheckConsumption,
    CheckProduction,
    ClearPartition,
    ClearSamples,
    ConsumptionStatus,
    GetMeta,
    Hello,
    HelloReply,
    KVClear,
    KVKeys,
    KVList,
    KVLookup,
    KVTag,
    ListPartitions,
    LostRows,
    MetaReply,
    PartitionInfo,
    Placement,
    ProductionStatus,
    PutBegin,
    PutCommit,
    PutInline,
    RecycledRows,
    RegisterTasks,
    Release,
    ReleaseRollout,
    RenewPut,
    Reply,
    ResetConsumption,
    Seal,
    SetPolicyVersion,
    SetTags,
    ShmAlloc,
    ShmFrames,
    ShmFree,
    ShmGrant,
    ShmHello,
    ShmHelloReply,
    StalenessStatus,
    StoredColumns,
    StoreGet,
    StorePut,
    StoreStats,
    StoreStatsReply,
    TakeRecycled,
    check_int,
    check_ints,
    check_sampling_config,
    check_seconds,
)
from ._security import CurveClient
from ._serve import check_address
from ._shm import ArenaMap, align
from ._transport import DealerConnection, same_host_ipc

__all__ = ["AsyncClient"]

log = get_logger(__name__)

T = TypeVar("T")
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def _decode(payload: msgspec.Raw, typ: type[T] | Any) -> T:
    dec = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.msgpack.Decoder(typ)
    try:
        return dec.decode(payload)  # type: ignore[no-any-return]
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"unexpected reply payload: {exc}") from exc


def _check_fields(data_fields: Any) -> list[str]:
    if isinstance(data_fields, str) or not isinstance(data_fields, (list, tuple)):
        raise InvalidRequestError(
            f"data_fields must be a list of field names, got {type(data_fields).__name__} "
            f"{data_fields!r}; write data_fields=[{data_fields!r}]"
        )
    if not data_fields or not all(isinstance(f, str) and f for f in data_fields):
        raise InvalidRequestError(
            f"data_fields must be a non-empty list of non-empty strings, got {data_fields!r}"
        )
    for f in data_fields:
        check_text("field name", f)
    return list(data_fields)


def _check_batch_size(batch_size: Any) -> int:
    return check_int("batch_size", batch_size, 1)


_TAILS = ("uneven", "drop", "error")


def _check_dp_config(cfg: Mapping[str, Any] | None) -> None:
    """A ``sampling_config``'s ``dp_size`` and ``tail``, checked before anything is sent."""
    if not cfg or (cfg.get("dp_size") is None and "tail" not in cfg):
        return
    dp_size = cfg.get("dp_size")
    if dp_size is None:
        raise InvalidRequestError(
            "sampling_config sets 'tail' without 'dp_size': the tail policy shares the last "
            "global batch among dp_size ranks; add 'dp_size'"
        )
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise InvalidRequestError(
            f"sampling_config['dp_size'] must be a positive integer, got {dp_size!r}"
        )
    tail = cfg.get("tail", "uneven")
    if tail not in _TAILS:
        raise InvalidRequestError(
            f"sampling_config['tail'] must be one of {', '.join(map(repr, _TAILS))}, got {tail!r}"
        )
    for key in ("dp_rank", "batch_index"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidRequestError(
                f"sampling_config with dp_size needs {key!r} as a non-negative integer (batch "
                f"b is decided for all ranks at once), got {value!r}"
            )
    if cfg["dp_rank"] >= dp_size:
        raise InvalidRequestError(
            f"sampling_config['dp_rank'] {cfg['dp_rank']} is out of range for dp_size="
            f"{dp_size}; ranks are 0..{dp_size - 1}"
        )


@dataclass(frozen=True, slots=True)
class _Put:
    """A validated, encoded put on its way to the services."""

    partition_id: str
    meta: BatchMeta | None
    keys: Sequence[str] | None
    headers: list[ColumnHeader]
    columns: list[Column]
    n: int
    tags: list[dict[str, Any] | None] | None
    versions: list[int] | None


class AsyncClient:
    """Talks to a tq_async controller and its storage units.

    Use it as an async context manager::

        async with tq.AsyncClient.connect(address) as client:
            meta = await client.put(td, partition_id="train@0")

    Args:
        address: the controller's endpoint (``cluster.address``, or what ``tq-async serve``
            printed).
        connect_timeout: seconds :meth:`open` waits for the controller's first answer (at
            most ``request_timeout``) before it fails with :class:`~tq_async.TQTimeoutError`
            naming the address: with nothing listening there, ZMQ would wait forever.
        request_timeout: seconds any single non-waiting request may take before it fails with
            :class:`~tq_async.TQTimeoutError` (a dead service never hangs the caller).
        allow_pickle: let this client pickle values msgpack cannot carry. None follows the
            controller's setting.
        curve: CURVE keys, when the services require them (see :class:`~tq_async.CurveClient`).
        retry_after: when a request with a deadline has no reply after this many seconds,
            reconnect (same identity) and resend it; services deduplicate retried requests,
            so nothing runs twice. None disables retries.
        inline_put_bytes: a put of at most this many bytes whose rows sit on one storage
            unit (new rows always do) goes to the controller in one message, which stores
            and commits it (:class:`~tq_async._protocol.PutInline`): one round trip instead
            of three, and the lowest put-to-consumer latency. Larger puts send their columns
            straight to the units. 0 disables it.
        inline_get_bytes: :meth:`get` asks the controller to send the cells along with the
            batch's metadata when they sit in storage units of the controller's own process
            (``local_cluster``, ``tq-async serve``) and take at most this many bytes: one
            round trip instead of two. Otherwise it reads them from the units. 0 disables it.
        shared_memory: with a storage unit on this host (verified: the client must read a
            token the unit wrote into its shared memory), puts of at least 64 KiB copy their
            column bytes straight into the unit's memory and reads copy out of it, instead of
            sending them through a socket (see ``docs/deployment.md``). False always uses
            the socket.
        same_host: False treats every service as remote: no shared memory (whatever
            ``shared_memory`` says) and the addresses exactly as given.

    A client belongs to the event loop (and process) that opened it.
    """

    def __init__(
        self,
        address: str,
        *,
        request_timeout: float = 60.0,
        connect_timeout: float = 10.0,
        allow_pickle: bool | None = None,
        curve: CurveClient | None = None,
        retry_after: float | None = 10.0,
        inline_put_bytes: int = 65536,
        inline_get_bytes: int = 1 << 20,
        shared_memory: bool = True,
        same_host: bool = True,
    ) -> None:
        check_int("inline_put_bytes", inline_put_bytes)
        check_int("inline_get_bytes", inline_get_bytes)
        check_seconds("request_timeout", request_timeout, optional=False)
        check_seconds("retry_after", retry_after)
        self.inline_get_bytes = inline_get_bytes
        check_address(address)
        if connect_timeout <= 0:
            raise InvalidRequestError(f"connect_timeout must be > 0 seconds, got {connect_timeout}")
        self.connect_timeout = connect_timeout
        self.address = address
        self.inline_put_bytes = inline_put_bytes
        self.request_timeout = request_timeout
        self.curve = curve
        self.retry_after = retry_after
        self._allow_pickle_opt = allow_pickle
        self.allow_pickle = bool(allow_pickle)
        self._controller: DealerConnection | None = None
        self._unit_addresses: dict[int, str] = {}
        self._units: dict[int, DealerConnection] = {}
        self._capacity: int | None = None
        #: the units epoch of the last Hello, and the newest a reply carried: when they
        #: differ a unit moved (restarted on a new address) and the units are asked again
        self._units_epoch = 0
        self._epoch_seen = 0
        self._refreshing: anyio.Event | None = None
        self._hello: HelloReply | None = None
        #: connection address -> the address the controller lists for its unit (differs
        #: for a verified same-host twin, which is not a move)
        self._stands_for: dict[str, str] = {}
        self.shared_memory = bool(shared_memory and same_host)
        self.same_host = same_host
        #: unit id -> its verified arena mapping (None: that unit is reached by socket only)
        self._arenas: dict[int, ArenaMap | None] = {}
        self._link_locks: dict[int, anyio.Lock] = {}

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        request_timeout: float = 60.0,
        connect_timeout: float = 10.0,
        allow_pickle: bool | None = None,
        curve: CurveClient | None = None,
        retry_after: float | None = 10.0,
        inline_put_bytes: int = 65536,
        inline_get_bytes: int = 1 << 20,
        shared_memory: bool = True,
        same_host: bool = True,
    ) -> AsyncClient:
        """A client for ``address``; enter it with ``async with`` to open the connection."""
        return cls(
            address,
            request_timeout=request_timeout,
            connect_timeout=connect_timeout,
            allow_pickle=allow_pickle,
            curve=curve,
            retry_after=retry_after,
            inline_put_bytes=inline_put_bytes,
            inline_get_bytes=inline_get_bytes,
            shared_memory=shared_memory,
            same_host=same_host,
        )

    def __await__(self) -> Generator[Any, None, NoReturn]:
        # `client = await AsyncClient.connect(...)` is a natural guess: say what works
        raise InvalidRequestError(
            "AsyncClient.connect(...) is not awaited: use `async with "
            "tq.AsyncClient.connect(address) as client: ...` (or `client = "
            "tq.AsyncClient.connect(address)`, `await client.open()`, and later `await "
            "client.aclose()`)"
        )

    async def __aenter__(self) -> AsyncClient:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Connect to the controller and learn the storage units.

        Raises:
            TQTimeoutError: the controller did not answer within ``connect_timeout``.
            AuthenticationError: the services refused this client's CURVE keys.
        """
        if self._controller is not None:
            return
        self._controller = DealerConnection(
            self.address, curve=self.curve, retry_after=self.retry_after
        )
        wait = min(self.connect_timeout, self.request_timeout)
        try:
            try:
                hello = await self._refresh_units(timeout=wait)
            except TQTimeoutError:
                raise TQTimeoutError(
                    f"nothing answered at {self.address} within {wait:g} s (connect_timeout); "
                    "check the address (the TQ_ADDRESS=... line "
                    "`tq-async serve` prints), that the services run, and that this host can "
                    "reach them"
                ) from None
            if self.same_host:
                await self._prefer_ipc(hello)
        except BaseException:
            if self._controller is not None:
                self._controller.close()
                self._controller = None
            raise

    async def _prefer_ipc(self, hello: HelloReply) -> None:
        """Talk to the controller through its same-host ipc twin, once proven to be the same
        controller (its instance token); otherwise keep the given address."""
        if not hello.instance or not same_host_ipc(hello.ipc) or self._controller is None:
            return
        assert hello.ipc is not None
        conn = DealerConnection(hello.ipc, curve=self.curve, retry_after=self.retry_after)
        try:
            payload, _ = await conn.request(Hello(), timeout=min(self.request_timeout, 5.0))
            again: HelloReply = _decode(payload, HelloReply)
            ok = again.instance == hello.instance
        except BaseException:
            conn.close()
            raise
        if not ok:
            conn.close()
            return
        self._controller.close()
        self._controller = conn

    async def aclose(self) -> None:
        """Close every socket; calls still waiting fail with :class:`~tq_async.ClosedError`."""
        if self._controller is not None:
            self._controller.close()
            self._controller = None
        for conn in self._units.values():
            conn.close()
        self._units.clear()
        for arena in self._arenas.values():
            if arena is not None:
                arena.close()
        self._arenas.clear()

    @property
    def closed(self) -> bool:
        return self._controller is None

    async def _refresh_units(self, timeout: float | bool = True) -> HelloReply:
        """Ask the controller for the units; drop connections to addresses that changed."""
        if self._refreshing is not None:  # one Hello at a time serves every caller
            await self._refreshing.wait()
            if self._hello is not None:
                return self._hello
        self._refreshing = done = anyio.Event()
        try:
            hello: HelloReply = await self._call(Hello(), HelloReply, timeout=timeout)
        finally:
            self._refreshing = None
            done.set()
        self._hello = hello
        addresses = {u.unit_id: u.address for u in hello.units}
        for unit_id, conn in list(self._units.items()):
            if self._stands_for.get(conn.address, conn.address) != addresses.get(unit_id):
                log.info(
                    "storage unit moved", unit=unit_id, old=conn.address, new=addresses.get(unit_id)
                )
                del self._units[unit_id]
                self._forget_arena(unit_id)
                conn.close()
        self._unit_addresses = addresses
        self._units_epoch = self._epoch_seen = hello.units_epoch
        self._capacity = hello.capacity
        if self._allow_pickle_opt is None:
            self.allow_pickle = hello.allow_pickle
        return hello

    def _note_epoch(self, epoch: int) -> None:
        """A reply's units epoch: a new one makes the next unit call ask for the units."""
        if epoch:
            self._epoch_seen = epoch

    def _ctl(self) -> DealerConnection:
        if self._controller is None:
            raise ClosedError(
                "the client is not connected; use `async with AsyncClient.connect(address)`"
            )
        return self._controller

    async def _unit(self, unit_id: int) -> DealerConnection:
        if self._epoch_seen != self._units_epoch:
            await self._refresh_units()
        conn = self._units.get(unit_id)
        if conn is None:
            if unit_id not in self._unit_addresses:
                await self._refresh_units()
            try:
                address = self._unit_addresses[unit_id]
            except KeyError:
                raise ProtocolError(
                    f"the controller placed rows on unknown unit {unit_id}"
                ) from None
            conn = self._units[unit_id] = DealerConnection(
                address,
                curve=self.curve,
                retry_after=self.retry_after,
                refused_is_broken=True,
                on_disconnect=lambda: self._forget_arena(unit_id),
            )
        return conn

    async def _unit_request(
        self, unit_id: int, body: msgspec.Struct, frames: Sequence[Any] = ()
    ) -> tuple[msgspec.Raw, list[Any]]:
        """An idempotent request to a storage unit; if its connection broke and the unit is
        back on a new address (restarted under its id), the request is sent there once."""
        conn = await self._unit(unit_id)
        try:
            return await conn.request(body, frames, timeout=self.request_timeout)
        except (BrokenError, ClosedError):
            if self._controller is None:
                raise
            try:
                moved = await self._unit_moved(unit_id, conn)
            except TQError:
                moved = False  # the controller is not answering either: report the unit
            if not moved:
                raise
        log.info("retrying at the storage unit's new address", unit=unit_id)
        conn = await self._unit(unit_id)
        return await conn.request(body, frames, timeout=self.request_timeout)

    async def _unit_moved(self, unit_id: int, conn: DealerConnection) -> bool:
        """Whether the controller now knows ``unit_id`` at another address than ``conn``'s."""
        listed = self._stands_for.get(conn.address, conn.address)
        if self._units.get(unit_id) is conn:  # nobody asked since this connection broke
            await self._refresh_units()
        if self._units.get(unit_id) is conn and listed != conn.address:
            # a same-host twin broke though the unit did not move: go back to its listed
            # address (the twin is verified again on the next data link)
            del self._units[unit_id]
            self._forget_arena(unit_id)
            conn.close()
            return True
        return self._unit_addresses.get(unit_id) not in (None, listed)

    def _forget_arena(self, unit_id: int) -> None:
        """The unit's connection broke: unmap its arena (a restarted unit has a new one, and
        a dead unit's memory is freed once nobody maps it)."""
        arena = self._arenas.pop(unit_id, None)
        if arena is not None:
            arena.close()

    async def _data_link(self, unit_id: int) -> tuple[DealerConnection, ArenaMap | None]:
        """The unit's connection and, if it is on this host (verified once per unit), its
        arena mapped here. A verified unit is then reached through its ipc twin too."""
        conn = await self._unit(unit_id)
        if not self.shared_memory or conn.inproc:
            return conn, None  # in-process connections copy once already
        if unit_id in self._arenas:
            return conn, self._arenas[unit_id]
        lock = self._link_locks.setdefault(unit_id, anyio.Lock())
        async with lock:
            if unit_id not in self._arenas:
                try:
                    await self._link(unit_id, conn)
                except (BrokenError, ClosedError):
                    # the unit went away: the socket path (and its retry at the unit's new
                    # address, _unit_request) decides what happens; link again next time
                    return conn, None
        return self._units.get(unit_id, conn), self._arenas.get(unit_id)

    async def _link(self, unit_id: int, conn: DealerConnection) -> None:
        payload, _ = await conn.request(ShmHello(os.getpid()), timeout=self.request_timeout)
        hello: ShmHelloReply | None = _decode(payload, ShmHelloReply | None)
        arena = None
        if hello is not None:
            try:
                arena = ArenaMap(hello.pid, hello.fd, hello.size, hello.token)
            except (OSError, ValueError) as exc:  # another host, namespace or user
                log.debug("no shared memory with this unit", unit=unit_id, error=str(exc))
        self._arenas[unit_id] = arena
        if arena is None or hello is None or not same_host_ipc(hello.ipc):
            return
        assert hello.ipc is not None
        ipc = DealerConnection(
            hello.ipc,
            curve=self.curve,
            retry_after=self.retry_after,
            on_disconnect=lambda: self._forget_arena(unit_id),
        )
        try:
            # says hello for this connection too (shared memory is granted per connection)
            payload, _ = await ipc.request(
                ShmHello(os.getpid()), timeout=min(self.request_timeout, 5.0)
            )
            again: ShmHelloReply | None = _decode(payload, ShmHelloReply | None)
        except BaseException:
            ipc.close()
            raise
        if again is None or again.token != hello.token or self._units.get(unit_id) is not conn:
            ipc.close()
            return
        self._units[unit_id] = ipc
        self._stands_for[ipc.address] = conn.address
        conn.close()

    async def _call(
        self,
        body: msgspec.Struct,
        typ: Any,
        *,
        timeout: float | bool | None = True,
    ) -> Any:
        payload, _ = await self._ctl().request(
            body, timeout=self.request_timeout if timeout is True else timeout or None
        )
        return _decode(payload, typ)

    # ---- put ---------------------------------------------------------------------------------

    async def put(
        self,
        data: TensorDictBase | Mapping[str, Any],
        partition_id: str | None = None,
        *,
        meta: BatchMeta | None = None,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        policy_version: int | Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> BatchMeta:
        """Write a batch: new rows of ``partition_id``, or new fields of the rows in ``meta``.

        Args:
            data: a ``TensorDict(batch_size=[n])`` or a dict of columns (tensors ``[n, ...]``,
                jagged nested tensors, lists of ``n`` tensors, lists of ``n`` plain values).
            partition_id: where new rows go (created on first put). Omit when ``meta`` is given.
            meta: rows to add fields to (from an earlier put or get_meta); ``data`` must have
                ``len(meta)`` rows in the same order.
            tags: one dict per row (or None), merged into each row's tags atomically with the
                data becoming visible.
            policy_version: the policy version that produced this data (one int, or one per
                row); recorded per field, so a trajectory appended across versions keeps each
                segment's version. A row's version is its oldest field's.
            timeout: when the cluster has a capacity and it is full, wait at most this many
                seconds for room (None: until room is made or the call is cancelled).

        Returns:
            A :class:`BatchMeta` of the written rows.

        Raises:
            SchemaError: columns disagree on rows, or contradict the partition's schema.
            UnsupportedTypeError: a value cannot travel without pickle.
            TQTimeoutError: no room within ``timeout`` (nothing was written).

        Cancellation: new rows that were allocated but not committed are cleared (best
        effort); nothing half-written ever becomes visible.
        """
        return await self._put(
            data,
            partition_id,
            meta=meta,
            tags=tags,
            keys=None,
            policy_version=policy_version,
            timeout=timeout,
        )

    async def put_nowait(
        self,
        data: TensorDictBase | Mapping[str, Any],
        partition_id: str | None = None,
        *,
        meta: BatchMeta | None = None,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        policy_version: int | Sequence[int] | None = None,
    ) -> BatchMeta:
        """:meth:`put`, but raise :class:`~tq_async.WouldBlock` instead of waiting for room."""
        return await self._put(
            data,
            partition_id,
            meta=meta,
            tags=tags,
            keys=None,
            policy_version=policy_version,
            nowait=True,
        )

    async def _put(
        self,
        data: TensorDictBase | Mapping[str, Any],
        partition_id: str | None,
        *,
        meta: BatchMeta | None,
        tags: Sequence[Mapping[str, Any] | None] | None,
        keys: Sequence[str] | None,
        policy_version: int | Sequence[int] | None = None,
        timeout: float | None = None,
        nowait: bool = False,
    ) -> BatchMeta:
        if meta is not None:
            if partition_id is not None and partition_id != meta.partition_id:
                raise InvalidRequestError(
                    f"partition_id {partition_id!r} contradicts meta.partition_id "
                    f"{meta.partition_id!r}; pass only meta"
                )
            partition_id = meta.partition_id
        if not isinstance(partition_id, str) or not partition_id:
            raise InvalidRequestError("put needs a partition_id (a non-empty string) or a meta")
        check_text("partition_id", partition_id)
        n, headers, columns = columns_from_batch(data, allow_pickle=self.allow_pickle)
        if meta is not None and n != len(meta):
            raise SchemaError(f"the batch has {n} rows but meta has {len(meta)}; they must match")
        if keys is not None and n != len(keys):
            raise SchemaError(f"the batch has {n} rows but {len(keys)} keys; they must match")
        tag_list: list[dict[str, Any] | None] | None = None
        if tags is not None:
            if len(tags) != n:
                raise InvalidRequestError(f"got {len(tags)} tag dicts for {n} rows")
            tag_list = tags_for_wire(tags)
        versions = _check_versions(policy_version, n)
        check_seconds("timeout", timeout)
        # a put may wait for capacity: the deadline is the caller's timeout plus the usual one
        deadline: float | bool | None = True
        if self._capacity is not None and not nowait:
            deadline = None if timeout is None else timeout + self.request_timeout
        fields = [h.name for h in headers]
        put = _Put(partition_id, meta, keys, headers, columns, n, tag_list, versions)
        if (
            keys is None
            and (meta is None or len(set(meta.units)) == 1)
            and sum(column_nbytes(c) for c in columns) <= self.inline_put_bytes
        ):
            placement = await self._put_inline(put, nowait, timeout, deadline)
        else:
            placement = await self._put_in_three(put, nowait, timeout, deadline)
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
        )
        frames: list[Any] = []
        for h, c in zip(put.headers, put.columns, strict=True):
            frames.extend(column_to_frames(h, c))

        def on_abandon(reply: Reply, _frames: list[zmq.Frame]) -> None:
            # the caller gave up (cancelled, timed out) but the put landed: undo new rows, as
            # a failed three-step put does
            if reply.ok and meta is None and self._controller is not None:
                late: Placement = _decode(reply.payload, Placement)
                undo = ClearSamples(put.partition_id, late.rows, late.incarnation)
                self._controller.send_oneway(undo)

        payload, _ = await self._ctl().request(
            body,
            frames,
            timeout=self.request_timeout if deadline is True else deadline or None,
            on_abandon=on_abandon,
        )
        placement: Placement = _decode(payload, Placement)
        self._note_epoch(placement.units_epoch)
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
        )
        placement: Placement = await self._call(begin, Placement, timeout=deadline)
        self._note_epoch(placement.units_epoch)
        fields = [h.name for h in headers]
        renewal = self._renew_put(placement)
        try:
            await self._store(partition_id, placement, headers, put.columns)
            commit = PutCommit(
                partition_id,
                placement.rows,
                fields,
                put.tags,
                put.versions,
                put_id=placement.put_id,
                incarnation=placement.incarnation,
            )
            await self._call(commit, None)
        except BaseException:
            if meta is None and keys is None:
                with anyio.move_on_after(5, shield=True):
                    try:
                        undo = ClearSamples(partition_id, placement.rows, placement.incarnation)
                        await self._call(undo, None)
                    except RowsNotFound:
                        pass  # already gone (e.g. lost with their storage unit)
                    except Exception as exc:  # the original error matters more
                        log.warning("could not clear rows of a failed put", error=str(exc))
            raise
        finally:
            if renewal is not None:
                renewal.cancel()
        return placement

    def _renew_put(self, placement: Placement) -> _PutRenewal | None:
        """Keep a put's lease alive while its columns travel (a timer, no task).

        The controller reclaims the new rows of a put whose producer stops renewing (it
        died between PutBegin and PutCommit); a live producer renews every third of the
        lease, so a slow put is never reclaimed.
        """
        if not placement.put_id or self._controller is None:
            return None
        return _PutRenewal(self._controller, placement.put_id, placement.put_lease / 3)

    async def _store(
        self,
        partition_id: str,
        placement: Placement,
        headers: list[ColumnHeader],
        columns: list[Column],
    ) -> None:
        by_unit = positions_by_unit(placement.units)

        async def store_one(unit: int, positions: list[int]) -> None:
            if len(by_unit) == 1:
                rows, cols = placement.rows, columns
            else:
                runs = position_runs(positions)
                rows = [placement.rows[i] for i in positions]
                cols = [take_rows(c, runs) for c in columns]
            frames: list[Any] = []
            for h, c in zip(headers, cols, strict=True):
                frames.extend(column_to_frames(h, c))
            store = StorePut(partition_id, rows, headers, placement.incarnation)
            conn, arena = await self._data_link(unit)
            big = sum(memoryview(f).nbytes for f in frames) >= _SHM_MIN_BYTES
            if big and arena is not None and await self._store_shm(conn, arena, store, frames):
                return
            await self._unit_request(unit, store, frames)

        if len(by_unit) == 1:
            ((unit, positions),) = by_unit.items()
            await store_one(unit, positions)
            return
        async with anyio.create_task_group() as tg:
            for unit, positions in by_unit.items():
                tg.start_soon(store_one, unit, positions)

    async def _store_shm(
        self, conn: DealerConnection, arena: ArenaMap, body: StorePut, frames: list[Any]
    ) -> bool:
        """Put ``frames`` through the unit's arena; False if it is full (use the socket)."""
        nbytes = sum(align(memoryview(f).nbytes) for f in frames)
        payload, _ = await conn.request(ShmAlloc(nbytes), timeout=self.request_timeout)
        grant: ShmGrant | None = _decode(payload, ShmGrant | None)
        if grant is None:
            return False
        try:
            try:
                arena.check(grant.offset, grant.size, "a shared-memory grant")
            except ValueError as exc:
                raise ProtocolError(f"{exc}; the storage unit's reply is corrupt") from None
            if grant.size < nbytes:
                raise ProtocolError("a shared-memory grant is smaller than asked for")
            if nbytes >= _THREAD_COPY_BYTES:
                spans = await anyio.to_thread.run_sync(arena.write, grant.offset, frames)
            else:
                spans = arena.write(grant.offset, frames)
            body.shm = ShmFrames(grant.grant, spans)
            await conn.request(body, timeout=self.request_timeout)
        except BaseException:
            # the unit ignores a grant it consumed already (a put that reached it)
            conn.send_oneway(ShmFree([grant.grant], []))
            raise
        return True

    # ---- get ---------------------------------------------------------------------------------

    async def get_meta(
        self,
        data_fields: Sequence[str],
        batch_size: int,
        partition_id: str,
        task_name: str,
        sampling_config: Mapping[str, Any] | None = None,
        *,
        mode: str = "fetch",
        timeout: float | None = None,
        stop_when_consumed: bool = False,
        lease: float | None = None,
        ack: BatchMeta | Sequence[BatchMeta] | None = None,
    ) -> BatchMeta:
        """Ask the controller for ``batch_size`` rows that have ``data_fields``, for a task.

        Waits (event-driven, no polling) until the sampler finds enough rows. In ``"fetch"``
        mode the rows are marked consumed for ``task_name``; ``"peek"`` consumes nothing.

        Args:
            data_fields: the fields the rows must have (and that ``get_data`` will read).
            batch_size: rows wanted (a sampler may return a short last batch once the
                partition is sealed).
            partition_id: the partition to read; it need not exist yet.
            task_name: the consuming task; each task consumes every row once.
            sampling_config: passed to the sampler, e.g. ``{"dp_rank": 0, "batch_index": 3}``.
                With ``batch_index``, the same ``(task, dp_rank, batch_index)`` always
                returns the same rows (replicas and replays read the recorded batch). With
                ``dp_size`` too (and optionally ``tail``: ``"uneven"``, ``"drop"`` or
                ``"error"``), batch ``b`` is decided for all ``dp_size`` ranks at once, every
                rank gets a reply for it and the stream ends for all ranks at the same
                ``batch_index``; under ``"uneven"`` a rank's share may be empty (0 rows,
                ``end_of_stream`` False).
            mode: ``"fetch"`` or ``"peek"``.
            timeout: seconds to wait for rows; None waits until data arrives or the call is
                cancelled.
            stop_when_consumed: also return end-of-stream (instead of waiting) once the
                partition holds rows and the task has consumed all of them, sealed or not.
            lease: seconds the delivered rows stay leased to this caller. Unless
                acknowledged in time (:meth:`ack`, or ``ack=`` on the next request), they
                return to the task and are delivered again: at-least-once, and exactly-once
                for consumers that acknowledge.
            ack: batches this request acknowledges (typically the previous one).

        Returns:
            A :class:`BatchMeta`; it is empty with ``end_of_stream=True`` when the partition is
            sealed and every row has been consumed by the task. With ``dp_size`` in
            ``sampling_config`` it may also be empty without ``end_of_stream``: this rank's
            share of the last global batch; run the step anyway so collectives stay in step.

        Raises:
            TQTimeoutError: not enough rows within ``timeout`` (nothing was consumed).
            InvalidRequestError: bad arguments (e.g. ``data_fields`` not a list).

        Cancellation: the controller drops the waiting request; if rows had already been
        handed out, they are released back to the task (a batch recorded under a
        ``batch_index`` stays readable by that index instead).
        """
        meta, _, _ = await self._get_meta(
            data_fields,
            batch_size,
            partition_id,
            task_name,
            sampling_config,
            mode=mode,
            timeout=timeout,
            stop_when_consumed=stop_when_consumed,
            lease=lease,
            ack=ack,
            inline_bytes=0,
        )
        return meta

    async def _get_meta(
        self,
        data_fields: Sequence[str],
        batch_size: int,
        partition_id: str,
        task_name: str,
        sampling_config: Mapping[str, Any] | None,
        *,
        mode: str,
        timeout: float | None,
        stop_when_consumed: bool,
        lease: float | None,
        ack: BatchMeta | Sequence[BatchMeta] | None,
        inline_bytes: int,
    ) -> tuple[BatchMeta, MetaReply, list[Any]]:
        """:meth:`get_meta`, plus the raw reply and its frames (cells sent inline)."""
        fields = _check_fields(data_fields)
        _check_batch_size(batch_size)
        if not isinstance(task_name, str) or not task_name:
            raise InvalidRequestError(f"task_name must be a non-empty string, got {task_name!r}")
        if not isinstance(partition_id, str) or not partition_id:
            raise InvalidRequestError(
                f"partition_id must be a non-empty string, got {partition_id!r}"
            )
        check_text("task_name", task_name)
        check_text("partition_id", partition_id)
        if mode not in ("fetch", "peek"):
            raise InvalidRequestError(f"mode must be 'fetch' or 'peek', got {mode!r}")
        check_seconds("timeout", timeout)
        check_seconds("lease", lease)
        cfg = dict(sampling_config) if sampling_config else None
        _check_dp_config(cfg)
        check_sampling_config(cfg)
        logged = mode == "fetch" and cfg is not None and cfg.get("batch_index") is not None
        req = GetMeta(
            partition_id,
            fields,
            batch_size,
            task_name,
            cfg,
            mode,
            timeout,
            stop_when_consumed,
            lease,
            _lease_ids(ack),
            inline_bytes,
        )

        def on_abandon(reply: Reply, _frames: list[zmq.Frame]) -> None:
            if not reply.ok or mode != "fetch" or logged:
                return
            late: MetaReply = _decode(reply.payload, MetaReply)
            if late.rows and self._controller is not None:
                self._controller.send_oneway(Release(partition_id, task_name, late.rows))

        client_deadline = None if timeout is None else timeout + self.request_timeout
        payload, frames = await self._ctl().request(
            req, timeout=client_deadline, on_abandon=on_abandon
        )
        got: MetaReply = _decode(payload, MetaReply)
        self._note_epoch(got.units_epoch)
        meta = BatchMeta(
            partition_id=partition_id,
            global_indexes=got.rows,
            field_names=got.fields,
            units=got.units,
            tags=got.tags,
            task_name=task_name,
            batch_index=cfg.get("batch_index") if cfg else None,
            end_of_stream=got.end_of_stream,
            policy_versions=got.versions,
            lease_id=got.lease_id,
            incarnation=got.incarnation,
            keys=got.keys or [],
        )
        return meta, got, frames

    async def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        nested: bool | Collection[str] = False,
    ) -> TensorDict:
        """Read the cells of ``meta``'s rows (``fields`` defaults to ``meta.field_names``).

        A field whose rows were put with different shapes (a rollout padded per batch) comes
        back dense when the rows read share a shape, and as a jagged nested tensor when they
        differ in their first dimension. Rows that differ in a later dimension cannot form one
        tensor: reading them together raises :class:`~tq_async.SchemaError`.

        Args:
            meta: the rows to read.
            fields: the fields to read (default: ``meta.field_names``).
            nested: ``True``, or the names of fields, to get tensor fields back as jagged
                nested tensors even when their rows share a shape (rows of at least one
                dimension; a dense ``[B, L]`` becomes a nested tensor of ``B`` rows of length
                ``L``), for code that wants one type whatever was put.

        Returns:
            ``TensorDict(batch_size=[len(meta)])``: dense columns as tensors (views of the
            received buffers when one unit holds the rows), jagged columns as jagged nested
            tensors, other columns as ``NonTensorStack``. A ``meta`` of 0 rows (end of
            stream, or a rank's empty share of a global batch) gives an empty
            ``TensorDict(batch_size=[0])`` without asking any storage unit.

        Raises:
            RowsNotFound: some rows were cleared.
            SchemaError: rows of a field differ in more than their first dimension.

        Cancellation: nothing changes on the services (reads have no side effects).
        """
        names = list(fields) if fields is not None else list(meta.field_names)
        as_nested = _check_nested(nested)
        n = len(meta)
        if n == 0 or not names:
            return TensorDict({}, batch_size=[n])
        headers, columns = await self._fetch_columns(meta, names)
        return columns_to_tensordict(n, headers, columns, nested=as_nested)

    async def _fetch_columns(
        self, meta: BatchMeta, names: list[str]
    ) -> tuple[list[ColumnHeader], list[Column]]:
        """Columns ``names`` of ``meta``'s rows, in ``meta`` order, fetched from every unit."""
        by_unit = positions_by_unit(meta.units)
        parts: dict[int, tuple[list[ColumnHeader], list[Column]]] = {}

        async def fetch(unit: int, positions: list[int]) -> None:
            rows = (
                meta.global_indexes
                if len(by_unit) == 1
                else [meta.global_indexes[i] for i in positions]
            )
            conn, arena = await self._data_link(unit)
            get = StoreGet(meta.partition_id, rows, names, meta.incarnation, shm=arena is not None)
            if arena is None:
                payload, frames = await self._unit_request(unit, get)
            else:

                def on_abandon(reply: Reply, _frames: list[zmq.Frame]) -> None:
                    _release_pin(conn, reply)

                payload, frames = await conn.request(
                    get, timeout=self.request_timeout, on_abandon=on_abandon
                )
            stored: StoredColumns = _decode(payload, StoredColumns)
            if stored.shm_spans is not None:
                try:
                    if arena is None or frames:
                        raise ProtocolError("an unexpected shared-memory reply")
                    frames = await _copy_spans(arena, stored.shm_spans)
                finally:
                    conn.send_oneway(ShmFree([], [stored.pin]))
            parts[unit] = _stored_columns(stored, frames, len(rows))

        if len(by_unit) == 1:
            ((unit, positions),) = by_unit.items()
            await fetch(unit, positions)
        else:
            async with anyio.create_task_group() as tg:
                for unit, positions in by_unit.items():
                    tg.start_soon(fetch, unit, positions)
        return _merge_parts(len(meta), by_unit, parts)

    async def get(
        self,
        data_fields: Sequence[str],
        batch_size: int,
        partition_id: str,
        task_name: str,
        sampling_config: Mapping[str, Any] | None = None,
        *,
        mode: str = "fetch",
        timeout: float | None = None,
        stop_when_consumed: bool = False,
        lease: float | None = None,
        ack: BatchMeta | Sequence[BatchMeta] | None = None,
        nested: bool | Collection[str] = False,
    ) -> tuple[TensorDict, BatchMeta]:
        """``get_meta`` then ``get_data``: the rows' data and their :class:`BatchMeta`.

        One round trip when the controller can send the cells along (they sit in storage
        units of its own process and take at most ``inline_get_bytes``); two otherwise. The
        result is the same either way. ``nested`` is :meth:`get_data`'s. A batch of 0 rows
        (end of stream, or with ``dp_size`` a rank's empty share) comes with an empty
        ``TensorDict(batch_size=[0])``; no storage unit is asked.

        Cancellation: if the data was not delivered, fetched rows are released back to the
        task (unless recorded under a ``batch_index``, which stays replayable).
        """
        as_nested = _check_nested(nested)
        meta, got, frames = await self._get_meta(
            data_fields,
            batch_size,
            partition_id,
            task_name,
            sampling_config,
            mode=mode,
            timeout=timeout,
            stop_when_consumed=stop_when_consumed,
            lease=lease,
            ack=ack,
            inline_bytes=self.inline_get_bytes,
        )
        try:
            if not len(meta):  # end of stream or an empty share: no unit to ask
                td = TensorDict({}, batch_size=[0])
            elif got.inline is not None:  # the controller sent the cells along: no get_data
                headers, columns = _merge_parts(len(meta), *_inline_parts(got, frames))
                td = columns_to_tensordict(len(meta), headers, columns, nested=as_nested)
            else:
                td = await self.get_data(meta, nested=as_nested)
            if lease is None and meta.lease_id and self._controller is not None:
                # an auto-clear hold: the data is read, the rows may be freed now
                self._controller.send_oneway(Ack([meta.lease_id]))
        except BaseException:
            if mode == "fetch" and meta.batch_index is None and len(meta):
                with anyio.move_on_after(5, shield=True):
                    await self.release(meta)
            if lease is None and meta.lease_id and self._controller is not None:
                self._controller.send_oneway(Ack([meta.lease_id]))  # drop the hold
            raise
        return td, meta

    async def ack(self, metas: BatchMeta | Sequence[BatchMeta]) -> None:
        """Acknowledge leased batches: their rows stay consumed (no redelivery)."""
        ids = _lease_ids(metas)
        if ids:
            await self._call(Ack(ids), None)

    async def release(self, meta: BatchMeta) -> None:
        """Give rows a task fetched back to it: they become ready again for ``meta.task_name``."""
        if meta.task_name is None:
            raise InvalidRequestError("release needs a BatchMeta returned by get_meta")
        body = Release(meta.partition_id, meta.task_name, meta.global_indexes, meta.incarnation)
        await self._call(body, None)

    # ---- controller calls --------------------------------------------------------------------

    async def lost_rows(self, partition_id: str | None = None) -> dict[str, Any]:
        """Rows lost with storage units that went away.

        A unit that stops answering is first *suspended* (its rows are neither handed out
        nor lost; end-of-stream waits for them); it is declared lost when its process is
        confirmed gone (reconnecting is refused, or another process answers at its address)
        or after ``unit_lost_after`` seconds.

        Returns:
            ``{"dead_units": [unit ids], "suspended_units": [unit ids], "rows":
            {partition_id: [rows lost]}}``.
        """
        return dict(await self._call(LostRows(partition_id), dict[str, Any]))

    async def storage_stats(self) -> dict[int, dict[str, Any]]:
        """What each storage unit holds, asked of every unit in parallel.

        Returns:
            ``{unit_id: {"partitions", "rows", "resident_bytes", "shm_bytes",
            "shm_idle_bytes", "shm_cap", "shm_fallbacks", "shm_puts", "shm_reads"}}``:
            cells held, shared memory in use, freed shared memory kept for reuse, the cap
            (0: no shared memory), and puts/reads over the socket because the arena was full
            and through shared memory (totals).

        Raises:
            TQTimeoutError: a unit did not answer within ``request_timeout``.

        Cancellation: nothing changes on the services.
        """
        await self._refresh_units()
        out: dict[int, dict[str, Any]] = {}

        async def ask(unit_id: int) -> None:
            conn = await self._unit(unit_id)
            payload, _ = await conn.request(StoreStats(), timeout=self.request_timeout)
            out[unit_id] = msgspec.structs.asdict(_decode(payload, StoreStatsReply))

        async with anyio.create_task_group() as tg:
            for unit_id in self._unit_addresses:
                tg.start_soon(ask, unit_id)
        return dict(sorted(out.items()))

    async def register_tasks(self, tasks: Sequence[str], partition_id: str | None = None) -> None:
        """Auto-clear: free each row once every task in ``tasks`` has consumed it.

        Applies to ``partition_id``, or to every partition without its own setting when None;
        an empty ``tasks`` turns it off. Cleared rows can no longer be replayed by
        ``batch_index``: use auto-clear for streams that are read once.

        A fetch by one of these tasks holds its rows until the consumer acknowledges them,
        so they are never freed before they are read: :meth:`get` acknowledges after
        reading; after :meth:`get_meta` + :meth:`get_data`, call :meth:`ack`.
        """
        await self._call(RegisterTasks(list(tasks), partition_id), None)

    async def seal(self, partition_id: str) -> None:
        """No more rows will be added: drained consumers then see end-of-stream."""
        await self._call(Seal(partition_id), None)

    async def reset_consumption(self, partition_id: str, task_name: str | None = None) -> None:
        """Make every row of the partition ready again for ``task_name`` (all tasks if None)."""
        await self._call(ResetConsumption(partition_id, task_name), None)

    async def clear_samples(self, meta: BatchMeta) -> None:
        """Remove ``meta``'s rows from the partition and free their storage."""
        body = ClearSamples(meta.partition_id, list(meta.global_indexes), meta.incarnation)
        await self._call(body, None)

    async def clear_partition(self, partition_id: str) -> None:
        """Remove the partition with all its rows, state and sampler caches; free storage."""
        await self._call(ClearPartition(partition_id), None)

    async def check_production_status(
        self,
        partition_id: str,
        data_fields: Sequence[str],
        global_indexes: Sequence[int] | None = None,
    ) -> bool:
        """True when every given row (all rows if None) has every field in ``data_fields``."""
        fields = _check_fields(data_fields)
        rows = list(global_indexes) if global_indexes is not None else None
        return bool(await self._call(CheckProduction(partition_id, fields, rows), bool))

    async def check_consumption_status(
        self, partition_id: str, task_name: str, global_indexes: Sequence[int] | None = None
    ) -> bool:
        """True when ``task_name`` has consumed every given row (all rows if None)."""
        rows = list(global_indexes) if global_indexes is not None else None
        return bool(await self._call(CheckConsumption(partition_id, task_name, rows), bool))

    async def production_status(
        self, partition_id: str, data_fields: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Per field, a bool tensor over row ids: is the cell produced (cleared rows: False)."""
        fields = None if data_fields is None else _check_fields(data_fields)
        masks = await self._call(ProductionStatus(partition_id, fields), dict[str, bytes])
        return {k: _mask(v) for k, v in masks.items()}

    async def consumption_status(self, partition_id: str, task_name: str) -> torch.Tensor:
        """A bool tensor over row ids: has ``task_name`` consumed the row."""
        return _mask(await self._call(ConsumptionStatus(partition_id, task_name), bytes))

    async def list_partitions(self) -> list[str]:
        """Ids of every partition the controller knows."""
        return list(await self._call(ListPartitions(), list[str]))

    async def partition_info(self, partition_id: str) -> dict[str, Any]:
        """Row counts, schema, sealed flag and per-task consumed counts of a partition."""
        return dict(await self._call(PartitionInfo(partition_id), dict[str, Any]))

    async def set_tags(self, meta: BatchMeta, tags: Sequence[Mapping[str, Any]]) -> None:
        """Merge ``tags[i]`` into the tags of row ``meta.global_indexes[i]`` (atomically)."""
        if len(tags) != len(meta):
            raise InvalidRequestError(f"got {len(tags)} tag dicts for {len(meta)} rows")
        wire_tags = [t or {} for t in tags_for_wire(tags)]
        body = SetTags(meta.partition_id, list(meta.global_indexes), wire_tags, meta.incarnation)
        await self._call(body, None)

    # ---- staleness control -------------------------------------------------------------------

    async def set_policy_version(self, version: int) -> None:
        """The learner announces its policy version (after each update).

        Wakes producers waiting in :meth:`acquire_rollout` and lets samplers re-check rows
        for staleness.
        """
        await self._call(SetPolicyVersion(check_int("version", _as_int(version))), None)

    async def acquire_rollout(
        self, policy_version: int, n: int = 1, *, timeout: float | None = None
    ) -> None:
        """Wait until a rollout of ``policy_version`` producing ``n`` rows may start.

        Waits (event-driven) while ``policy_version - learner_version > max_staleness`` or
        while ``n`` more rows would exceed the capacity (see ``AdmissionConfig``); then
        reserves ``n`` slots, freed when the learner task consumes the rows (or by
        :meth:`release_rollout`, or when unconsumed rows are cleared).

        Raises:
            TQTimeoutError: not admitted within ``timeout`` (nothing reserved).
            InvalidRequestError: ``n`` can never fit the capacity.

        Cancellation: the waiting request is dropped; nothing is reserved.
        """
        body = AcquireRollout(
            check_int("policy_version", _as_int(policy_version)),
            check_int("n", _as_int(n), 1),
            check_seconds("timeout", timeout),
        )
        deadline = None if timeout is None else timeout + self.request_timeout
        await self._ctl().request(body, timeout=deadline)

    async def release_rollout(self, n: int) -> None:
        """Give back ``n`` admission slots of rollouts that will not be put."""
        await self._call(ReleaseRollout(check_int("n", _as_int(n))), None)

    async def take_recycled(self, max_rows: int = 1024) -> list[BatchMeta]:
        """Take stale rows whose prompts must be regenerated, one BatchMeta per partition.

        Each recycled row is handed out exactly once; read its prompt fields with
        :meth:`get_data` and put the regenerated sample as a new row.
        """
        body = TakeRecycled(check_int("max_rows", _as_int(max_rows), 1))
        got = await self._call(body, list[RecycledRows])
        return [
            BatchMeta(
                partition_id=r.partition_id,
                global_indexes=r.meta.rows,
                field_names=r.meta.fields,
                units=r.meta.units,
                tags=r.meta.tags,
                policy_versions=r.meta.versions,
                incarnation=r.meta.incarnation,
            )
            for r in got
        ]

    async def staleness_status(self) -> dict[str, int]:
        """Learner version, outstanding admitted rows, and stale rows dropped/recycled/kept."""
        return dict(await self._call(StalenessStatus(), dict[str, int]))

    # ---- KV API ------------------------------------------------------------------------------

    async def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: TensorDictBase | Mapping[str, Any] | None,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> BatchMeta:
        """Write ``fields`` for ``keys`` (row ``i`` of ``fields`` belongs to ``keys[i]``).

        New keys get new rows; existing keys are updated in place, field by field (fields
        not in ``fields`` keep their values). ``tags`` are merged into each key's tags
        atomically with the data becoming visible. With ``fields=None`` only the tags change
        (missing keys are created). The returned :class:`BatchMeta` names every field the keys
        have (not only this call's) and carries the keys.

        Raises:
            SchemaError: ``fields`` has a different number of rows than ``keys``.
            InvalidRequestError: a key repeats, new keys go to a sealed partition, or neither
                ``fields`` nor ``tags`` is given.
        """
        key_list = _check_keys(keys)
        if fields is None:
            if tags is None:
                raise InvalidRequestError("kv_batch_put needs fields, tags, or both")
            if len(tags) != len(key_list):
                raise InvalidRequestError(f"got {len(tags)} tag dicts for {len(key_list)} keys")
            tag_dicts = [dict(t) if t else {} for t in tags]
            placement: Placement = await self._call(
                KVTag(partition_id, key_list, tag_dicts), Placement
            )
            return BatchMeta(
                partition_id=partition_id,
                global_indexes=placement.rows,
                field_names=placement.fields or [],
                units=placement.units,
                tags=tag_dicts,
                keys=list[str | None](key_list),
            )
        return await self._put(fields, partition_id, meta=None, tags=tags, keys=key_list)

    async def kv_retrieve_meta(
        self, keys: Sequence[str], partition_id: str, create: bool = False
    ) -> BatchMeta:
        """A :class:`BatchMeta` of ``keys``' rows, naming the fields every key has.

        Args:
            keys: the keys, in the order the rows should have.
            partition_id: their partition.
            create: create missing keys (rows without fields) instead of failing.

        Raises:
            KeyNotFound: a key is missing (and ``create`` is False).
            PartitionNotFound: the partition does not exist (and ``create`` is False).

        Cancellation: without ``create`` nothing changes; with it, keys may have been created
        (without fields or tags) if the controller received the request.
        """
        key_list = _check_keys(keys)
        if create:
            return await self.kv_batch_put(key_list, partition_id, None, [{}] * len(key_list))
        got: MetaReply = await self._call(
            KVLookup(partition_id, key_list, None, available=True), MetaReply
        )
        return BatchMeta(
            partition_id=partition_id,
            global_indexes=got.rows,
            field_names=got.fields,
            units=got.units,
            tags=got.tags,
            keys=list[str | None](key_list),
        )

    async def kv_put(
        self,
        key: str,
        partition_id: str,
        fields: TensorDictBase | Mapping[str, Any] | None = None,
        tag: Mapping[str, Any] | None = None,
    ) -> BatchMeta:
        """Write one key's ``fields`` and/or merge ``tag`` into its tags.

        ``fields`` is a ``TensorDict`` of batch size ``[]`` or ``[1]``, or a mapping from field
        name to the key's value (a tensor is one dense row; other values travel as msgpack).
        With ``fields=None`` only the tags change (the key is created if missing).
        """
        if fields is None:
            if tag is None:
                raise InvalidRequestError("kv_put needs fields, a tag, or both")
            body = KVTag(partition_id, _check_keys([key]), [tags_for_wire([tag])[0] or {}])
            placement: Placement = await self._call(body, Placement)
            return BatchMeta(
                partition_id=partition_id,
                global_indexes=placement.rows,
                field_names=placement.fields or [],
                units=placement.units,
                incarnation=placement.incarnation,
                tags=[dict(tag)],
                keys=[key],
            )
        return await self.kv_batch_put([key], partition_id, _one_row(fields), [tag])

    async def kv_batch_get(
        self,
        keys: Sequence[str],
        partition_id: str,
        select_fields: Sequence[str] | None = None,
    ) -> TensorDict:
        """The fields of ``keys``, row ``i`` for ``keys[i]`` (every field when not selected).

        Raises:
            KeyNotFound: a key is missing, or lacks a selected field (the error names it);
                never a silently shorter result.
        """
        fields = None if select_fields is None else _check_fields(select_fields)
        body = KVLookup(partition_id, _check_keys(keys), fields)
        got: MetaReply = await self._call(body, MetaReply)
        self._note_epoch(got.units_epoch)
        meta = BatchMeta(
            partition_id=partition_id,
            global_indexes=got.rows,
            field_names=got.fields,
            units=got.units,
            tags=got.tags,
            incarnation=got.incarnation,
            keys=list(keys),
        )
        return await self.get_data(meta)

    async def kv_list(
        self, partition_id: str | None = None
    ) -> dict[str, dict[str, dict[str, Any]]]:
        """``{partition_id: {key: tags}}`` for one partition, or for all when None."""
        listing = await self._call(KVList(partition_id), dict[str, dict[str, dict[str, Any]]])
        return dict(listing)

    async def kv_retrieve_keys(self, global_indexes: Sequence[int], partition_id: str) -> list[str]:
        """The key of each row in ``global_indexes`` (rows written with kv_put / kv_batch_put).

        Raises:
            KeyNotFound: a row was put without a key (the error names it).
            RowsNotFound: a row does not exist (never allocated, or cleared).
            InvalidRequestError: ``global_indexes`` is not a list of non-negative ints.

        Cancellation: nothing changes (a read).
        """
        rows = _check_rows(global_indexes, "global_indexes")
        return list(await self._call(KVKeys(partition_id, rows), list[str]))

    async def kv_clear(self, keys: Sequence[str], partition_id: str) -> None:
        """Remove ``keys`` and free their storage; a missing key fails the whole call."""
        await self._call(KVClear(partition_id, _check_keys(keys)), None)

    # ---- checkpoints -------------------------------------------------------------------------

    async def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        partition_ids: Sequence[str] | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Write partitions (all by default), their state, tags, keys and cells to ``path``.

        ``metadata`` (a dict of JSON values, e.g. ``{"step": 10}``) is stored with the
        checkpoint; read it back with :func:`tq_async.checkpoint_metadata`.

        The directory is written under a temporary name and renamed into place, so ``path``
        holds either a whole checkpoint or what it held before. Take it while producers are
        paused: the controller state is a consistent snapshot, cells are read right after it.

        Raises:
            CheckpointError: ``path`` cannot be written.
            InvalidRequestError: ``metadata`` is not a dict of JSON values.
        """
        await save_checkpoint(self._checkpoint_link(), os.fspath(path), partition_ids, metadata)

    async def load_checkpoint(self, path: str | os.PathLike[str]) -> list[str]:
        """Restore a checkpoint written by :meth:`save_checkpoint`; returns the partition ids.

        Works onto any number of storage units. Every file is verified before anything is
        loaded, and the restored partitions appear all at once or not at all.

        Raises:
            CheckpointError: the checkpoint is missing, corrupt, partial or of another format
                version (nothing was loaded).
            InvalidRequestError: a partition of the checkpoint already exists.
        """
        return await load_checkpoint(self._checkpoint_link(), os.fspath(path))

    def _checkpoint_link(self) -> ClientLink:
        return ClientLink(self._call, self._fetch_columns, self._unit_request)


def _as_int(value: Any) -> Any:
    """Integral numbers (numpy and torch scalars too) as an int; anything else unchanged
    (the range check that follows names it)."""
    if isinstance(value, (bool, int)):
        return value
    try:
        as_int = operator.index(value)
    except TypeError:
        return value
    return as_int


def _check_versions(policy_version: int | Sequence[int] | None, n: int) -> list[int] | None:
    """One policy version per row (an int >= 0 each), or None."""
    if policy_version is None:
        return None
    one = _as_int(policy_version)
    if isinstance(one, (int, str, bytes)) or not hasattr(one, "__iter__"):
        versions = [one] * n
    else:
        versions = [_as_int(v) for v in one]
    if len(versions) != n:
        raise InvalidRequestError(
            f"policy_version must be one int >= 0 or {n} of them, got {len(versions)}"
        )
    check_ints("policy_version", versions)
    return versions


def _lease_ids(metas: BatchMeta | Sequence[BatchMeta] | None) -> list[int] | None:
    if metas is None:
        return None
    items = [metas] if isinstance(metas, BatchMeta) else list(metas)
    return [m.lease_id for m in items if m.lease_id] or None


def _check_nested(nested: Any) -> bool | frozenset[str]:
    if isinstance(nested, bool):
        return nested
    if isinstance(nested, str) or not isinstance(nested, Collection):
        raise InvalidRequestError(
            f"nested must be True/False or a list of field names, got {nested!r}"
        )
    if not all(isinstance(f, str) for f in nested):
        raise InvalidRequestError(f"nested must list field names (strings), got {nested!r}")
    return frozenset(nested)


def _check_rows(rows: Any, name: str) -> list[int]:
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise InvalidRequestError(f"{name} must be a list of row ids, got {type(rows).__name__}")
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in rows):
        raise InvalidRequestError(f"{name} must hold non-negative ints, got {list(rows)[:8]!r}")
    return [int(r) for r in rows]


def _check_keys(keys: Any) -> list[str]:
    if isinstance(keys, str) or not isinstance(keys, (list, tuple)):
        raise InvalidRequestError(f"keys must be a list of strings, got {type(keys).__name__}")
    if not keys or not all(isinstance(k, str) for k in keys):
        raise InvalidRequestError("keys must be a non-empty list of strings")
    for k in keys:
        check_text("key", k)
    return list(keys)


def _one_row(fields: TensorDictBase | Mapping[str, Any]) -> TensorDictBase | dict[str, Any]:
    """One key's fields as a one-row batch."""
    if isinstance(fields, TensorDictBase):
        if fields.batch_size == torch.Size([]):
            return fields.unsqueeze(0)
        if fields.batch_size == torch.Size([1]):
            return fields
        raise SchemaError(
            f"kv_put takes one key's fields (batch size [] or [1]), got {list(fields.batch_size)}"
            "; use kv_batch_put for several keys"
        )
    return {
        name: value.unsqueeze(0) if isinstance(value, torch.Tensor) else [value]
        for name, value in fields.items()
    }


def _mask(raw: bytes) -> torch.Tensor:
    if not raw:
        return torch.zeros(0, dtype=torch.bool)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.bool)


#: puts smaller than this go through the socket even to a unit on this host: one round trip
#: instead of two (grant, then put) costs less than the copy it saves
_SHM_MIN_BYTES = 64 << 10
#: copies at least this big run on a worker thread (as in the in-process path)
_THREAD_COPY_BYTES = 16 << 20


def _release_pin(conn: DealerConnection, reply: Reply) -> None:
    """Unpin a shared-memory read whose caller gave up before copying it."""
    if not reply.ok:
        return
    with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
        stored: StoredColumns = _decode(reply.payload, StoredColumns)
        if stored.shm_spans is not None:
            conn.send_oneway(ShmFree([], [stored.pin]))


async def _copy_spans(arena: ArenaMap, spans: Sequence[tuple[int, int]]) -> list[Any]:
    """Copies of the arena's ``spans``, in buffers of our own (pooled, like inproc reads)."""
    for off, n in spans:
        try:
            arena.check(off, n, "a shared-memory span")
        except ValueError as exc:
            raise ProtocolError(f"{exc}; the storage unit's reply is corrupt") from None

    def copy() -> list[Any]:
        view = arena.view
        return [
            b""
            if n == 0
            else buffer_pool.copy(view[off : off + n])
            if n >= zmq.COPY_THRESHOLD
            else bytearray(view[off : off + n])
            for off, n in spans
        ]

    if sum(n for _, n in spans) >= _THREAD_COPY_BYTES:
        return await anyio.to_thread.run_sync(copy)
    return copy()


def _stored_columns(
    stored: StoredColumns, frames: Sequence[Any], n_rows: int
) -> tuple[list[ColumnHeader], list[Column]]:
    """Rebuild the columns of one unit's part from its frames (all of them, exactly)."""
    if stored.n_rows != n_rows:
        raise ProtocolError(f"a storage part carries {stored.n_rows} rows, expected {n_rows}")
    columns: list[Column] = []
    pos = 0
    for h in stored.columns:
        k = column_frame_count(h)  # too few frames: column_from_frames says so
        columns.append(column_from_frames(h, frames[pos : pos + k], n_rows))
        pos += k
    if pos != len(frames):
        raise ProtocolError("a storage reply carried extra frames")
    return stored.columns, columns


def _inline_parts(
    got: MetaReply, frames: Sequence[Any]
) -> tuple[dict[int, list[int]], dict[int, tuple[list[ColumnHeader], list[Column]]]]:
    """The per-unit parts a get_meta reply carried inline (``got.inline``)."""
    assert got.inline is not None
    by_unit = positions_by_unit(got.units)
    if len(got.inline) != len(by_unit):
        raise ProtocolError(
            f"an inline reply carries {len(got.inline)} parts for {len(by_unit)} units"
        )
    parts: dict[int, tuple[list[ColumnHeader], list[Column]]] = {}
    pos = 0
    for (unit, positions), stored in zip(by_unit.items(), got.inline, strict=True):
        k = sum(column_frame_count(h) for h in stored.columns)
        parts[unit] = _stored_columns(stored, frames[pos : pos + k], len(positions))
        pos += k
    if pos != len(frames):
        raise ProtocolError("an inline reply carried extra frames")
    return by_unit, parts


def _merge_parts(
    n: int,
    by_unit: dict[int, list[int]],
    parts: dict[int, tuple[list[ColumnHeader], list[Column]]],
) -> tuple[list[ColumnHeader], list[Column]]:
    """One column per field, rows back in batch order, from the parts of several units."""
    if len(by_unit) == 1:
        return parts[next(iter(by_unit))]
    order = [pos for positions in by_unit.values() for pos in positions]
    inverse = [0] * n
    for i, pos in enumerate(order):
        inverse[pos] = i
    names = parts[next(iter(by_unit))][0]
    headers, columns = [], []
    for j in range(len(names)):
        # units may answer one field with different row shapes: join them like a unit does
        header, merged = join_columns(
            [parts[u][0][j] for u in by_unit], [parts[u][1][j] for u in by_unit]
        )
        headers.append(header)
        columns.append(reorder_column(merged, inverse))
    return headers, columns


class _PutRenewal:
    """Sends RenewPut for one put every ``interval`` seconds until cancelled (timer-driven)."""

    __slots__ = ("_conn", "_handle", "_interval", "_put_id")

    def __init__(self, conn: DealerConnection, put_id: int, interval: float) -> None:
        self._conn, self._put_id, self._interval = conn, put_id, interval
        self._handle = asyncio.get_running_loop().call_later(interval, self._renew)

    def _renew(self) -> None:
        self._conn.send_oneway(RenewPut([self._put_id]))
        self._handle = asyncio.get_running_loop().call_later(self._interval, self._renew)

    def cancel(self) -> None:
        self._handle.cancel()
