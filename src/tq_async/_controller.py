"""The controller service: a thin async shell around :class:`~tq_async._core.ControllerCore`.

The core decides (leases, holds, put leases, recorded and global batches, end-of-stream,
admission, auto-clear, unit liveness) and returns :class:`~tq_async._core.Effects`; this shell
decodes requests, sends replies, runs samplers, arms the core's one deadline timer, tells
storage units to free rows, and wakes waiters.

Every request is answered from the reader callback when it can be (status calls, puts, a
get_meta whose sampler finds rows at once). Only requests that must wait become tasks: a
get_meta with too few ready rows, an async sampler, a clear that tells the storage units.

A waiting get_meta parks on a future registered under ``(partition, task)``; the core hands
back :class:`~tq_async._state.Wakeup` events when production, consumption, sealing, clearing,
an ack or an expiry changes what a task could receive, and only the matching futures are woken.
There is no polling: an idle waiter costs one future until data arrives.
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import structlog
import zmq
from anyio.abc import TaskGroup, TaskStatus

from ._columns import positions_by_unit
from ._core import AdmissionConfig, ControllerCore, Deadlines, Effects, SampleCall, meta_reply
from ._errors import (
    InvalidRequestError,
    KeyNotFound,
    PartitionNotFound,
    ProtocolError,
    RowsNotFound,
    TQError,
    TQTimeoutError,
    WouldBlock,
)
from ._logging import get_logger
from ._metrics import Metrics
from ._protocol import (
    Ack,
    AcquireRollout,
    Cancel,
    CheckConsumption,
    CheckProduction,
    ClearPartition,
    ClearSamples,
    ConsumptionStatus,
    ControllerRequest,
    DumpState,
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
    RegisterUnit,
    Release,
    ReleaseRollout,
    RenewPut,
    ResetConsumption,
    RestoreAbort,
    RestoreBegin,
    RestoreCommit,
    Seal,
    SetPolicyVersion,
    SetTags,
    StalenessStatus,
    StateDump,
    StoreClear,
    StoredColumns,
    StorePut,
    StoreStats,
    StoreStatsReply,
    TakeRecycled,
    UnitInfo,
    controller_request_decoder,
    error_reply,
    ok_reply,
    salvage_rid,
    validate,
)
from ._security import CurveServer
from ._state import ControllerState, Partition, Wakeup
from ._storage import StorageServer
from ._transport import DealerConnection, LogThrottle, RouterEndpoint
from .samplers import BaseSampler

__all__ = ["AdmissionConfig", "ControllerServer", "Deadlines"]

log = get_logger(__name__)

#: replies remembered for deduplicating retried requests (about 1 KiB each)
_REPLY_CACHE = 8192

#: errors that are the caller's fault: answered without a traceback in the log
_EXPECTED = (
    WouldBlock,
    InvalidRequestError,
    KeyNotFound,
    PartitionNotFound,
    RowsNotFound,
    ProtocolError,
    TQTimeoutError,
)


class ControllerServer:
    """Serves a :class:`ControllerCore` on a ROUTER socket.

    Args:
        state: the partitions (a new empty state by default).
        sampler: decides what each get_meta receives (:class:`SequentialSampler` by default).
        task_samplers: samplers for particular tasks (e.g. ``{"update_actor":
            SeqlenBalancedSampler(...)}``); other tasks use ``sampler``.
        allow_pickle: told to clients; storage units enforce it.
        unit_timeout: seconds to wait for a storage unit when the controller calls it (clears).
        metrics: where to record request metrics (disabled by default).
        admission: bounds for ``acquire_rollout`` (staleness and capacity; none by default).
        curve: CURVE keys for this service's socket and its connections to the units.
        local_units: storage units running in this process (``local_cluster`` passes its
            own): a small put sent whole to the controller (:class:`PutInline`) is stored in
            them directly, without a message.
        deadlines: the put-lease and unit-liveness deadlines (:class:`~tq_async.Deadlines`).
        default_lease: seconds of the lease of a fetch that asks for none (None: no lease
            unless asked for).
    """

    def __init__(
        self,
        state: ControllerState | None = None,
        sampler: BaseSampler | None = None,
        *,
        task_samplers: Mapping[str, BaseSampler] | None = None,
        allow_pickle: bool = False,
        unit_timeout: float = 30.0,
        metrics: Metrics | None = None,
        admission: AdmissionConfig | None = None,
        curve: CurveServer | None = None,
        local_units: Mapping[int, StorageServer] | None = None,
        deadlines: Deadlines | None = None,
        default_lease: float | None = None,
    ) -> None:
        self.core = ControllerCore(
            state, sampler, task_samplers=task_samplers, admission=admission, deadlines=deadlines
        )
        self.state = self.core.state
        self.default_lease = default_lease
        #: seconds after which a get_meta waiting on fields (or a partition) that do not
        #: exist logs a warning naming them
        self.waiting_warning_after = 30.0
        self.local_units: dict[int, StorageServer] = dict(local_units or {})
        self.curve = curve
        self._malformed = LogThrottle()
        self.metrics = metrics or Metrics(None, "controller")
        self._admission_waiters: dict[asyncio.Future[None], None] = {}
        self._room_waiters: dict[asyncio.Future[None], None] = {}
        #: set while shutting down: units going away then are not "lost"
        self.stopping = False
        self.allow_pickle = allow_pickle
        self.unit_timeout = unit_timeout
        self.unit_suspend_after = self.core.deadlines.unit_suspend_after
        self._endpoint: RouterEndpoint | None = None
        #: what a same-host client compares through the ipc twin (see _transport)
        self._instance = secrets.token_bytes(16)
        self._tg: TaskGroup | None = None
        self._waiters: dict[str, dict[str, dict[asyncio.Future[None], None]]] = {}
        self._pending: dict[tuple[bytes, int], anyio.CancelScope] = {}
        #: recent replies by (client identity, request id), for retried requests
        self._replies: OrderedDict[tuple[bytes, int], bytes] = OrderedDict()
        self._units: dict[int, DealerConnection] = {}
        #: each remote unit's instance token: a unit that comes back with another lost its data
        self._unit_instance: dict[int, str] = {}
        #: bumped on every wake-up; lets a new waiter know whether to look again
        self._generation = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None

    @property
    def sampler(self) -> BaseSampler:
        """The default sampler."""
        return self.core.sampler

    @property
    def task_samplers(self) -> dict[str, BaseSampler]:
        """Samplers of particular tasks."""
        return self.core.task_samplers

    @property
    def admission(self) -> AdmissionConfig:
        """The bounds of ``acquire_rollout``."""
        return self.core.admission

    @property
    def sampler_calls(self) -> int:
        """Number of sampler invocations (tests use it to prove waiting is event-driven)."""
        return self.core.sampler_calls

    @property
    def address(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("the controller is not serving")
        return self._endpoint.address

    @property
    def waiting(self) -> int:
        """Number of get_meta requests currently parked waiting for data."""
        return len(self._pending)

    async def serve(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind, report the address through ``task_status``, serve until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            self._endpoint = RouterEndpoint(bind, self._on_message, curve=self.curve, twin="uds")
            for unit_id in list(self.state.units):
                self._unit(unit_id)  # connect now, so a unit that dies is noticed at once
            try:
                task_status.started(self._endpoint.address)
                await anyio.sleep_forever()
            finally:
                self.stopping = True
                if self._timer is not None:
                    self._timer.cancel()
                self._endpoint.close()
                for conn in self._units.values():
                    conn.close()
                self._units.clear()
                tg.cancel_scope.cancel()

    # ---- effects -----------------------------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _apply(self, fx: Effects) -> None:
        """Do what a transition of the core left to do."""
        self._notify(fx.wakeups)
        for partition_id, incarnation, by_unit in fx.free:
            self._spawn(self._clear_units, None, 0, partition_id, by_unit, incarnation)
        for policy, n in fx.stale:
            self.metrics.stale(policy, n)
        if fx.room:
            _wake_all(self._room_waiters)
        if fx.admission:
            _wake_all(self._admission_waiters)
        self._rearm()

    def _rearm(self) -> None:
        """Keep one timer armed at the core's next deadline."""
        at = self.core.next_deadline()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None and not self.stopping:
            self._timer = asyncio.get_running_loop().call_at(at, self._on_deadline)

    def _on_deadline(self) -> None:
        self._timer, self._timer_at = None, None
        self._apply(self.core.advance(self._now()))

    # ---- plumbing ----------------------------------------------------------------------------

    def _send_ok(self, peer: bytes, rid: int, payload: Any) -> None:
        if isinstance(payload, (MetaReply, Placement)):
            payload.units_epoch = self.state.units_epoch  # the rows' units may have moved
        self._reply(peer, rid, ok_reply(rid, payload))

    def _send_error(self, peer: bytes, rid: int, exc: BaseException, op: str) -> None:
        if not isinstance(exc, _EXPECTED):
            log.error("request failed", op=op, rid=rid, exc_info=exc)
        self._reply(peer, rid, error_reply(rid, exc))

    def _reply(
        self,
        peer: bytes,
        rid: int,
        header: bytes,
        frames: Sequence[Any] = (),
        *,
        remember: bytes | None = None,
    ) -> None:
        """Send a reply and remember it: a retried request gets it again, not re-executed.

        ``remember`` replaces ``header`` in the cache when the reply carries data frames
        (the cache keeps no cells alive; a retried ``get`` then reads them from the units).
        """
        replies = self._replies
        replies[(peer, rid)] = header if remember is None else remember
        if len(replies) > _REPLY_CACHE:
            replies.popitem(last=False)
        if self._endpoint is not None:
            self._endpoint.send(peer, [header, *frames])

    def _send_meta(self, peer: bytes, rid: int, req: GetMeta, reply: MetaReply) -> None:
        """Answer a get_meta; a ``get`` whose cells are small and local gets them too."""
        inline = self._read_inline(req, reply) if req.inline_bytes > 0 and reply.rows else None
        reply.units_epoch = self.state.units_epoch
        if inline is None:
            self._send_ok(peer, rid, reply)
            return
        without = ok_reply(rid, reply)
        reply.inline, frames = inline
        self._reply(peer, rid, ok_reply(rid, reply), frames, remember=without)

    def _read_inline(
        self, req: GetMeta, reply: MetaReply
    ) -> tuple[list[StoredColumns], list[Any]] | None:
        """The reply's cells from units in this process, or None (remote units, too big)."""
        by_unit = positions_by_unit(reply.units)
        if any(u not in self.local_units for u in by_unit):
            return None
        parts: list[StoredColumns] = []
        frames: list[Any] = []
        size = 0
        for unit_id, positions in by_unit.items():
            rows = reply.rows if len(by_unit) == 1 else [reply.rows[i] for i in positions]
            try:
                got = self.local_units[unit_id].read_local(
                    req.partition_id, rows, reply.fields, req.inline_bytes - size
                )
            except TQError:
                return None  # let the client's own read report it
            if got is None:
                return None  # too big: the client reads from the units
            stored, part = got
            # the frames are what travels (object columns are sized only once encoded)
            size += sum(memoryview(f).nbytes for f in part)
            if size > req.inline_bytes:
                return None
            parts.append(stored)
            frames.extend(part)
        return parts, frames

    def _notify(self, wakeups: Sequence[Wakeup]) -> None:
        if wakeups:
            self._generation += 1
        for w in wakeups:
            by_task = self._waiters.get(w.partition_id)
            if not by_task:
                continue
            tasks = list(by_task) if w.task_name is None else [w.task_name]
            for t in tasks:
                futs = by_task.pop(t, None)
                if futs:
                    for fut in futs:
                        if not fut.done():
                            fut.set_result(None)
            if not by_task:
                del self._waiters[w.partition_id]

    def _register_waiter(self, partition_id: str, task: str) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(partition_id, {}).setdefault(task, {})[fut] = None
        return fut

    def _drop_waiter(self, partition_id: str, task: str, fut: asyncio.Future[None]) -> None:
        by_task = self._waiters.get(partition_id)
        if by_task is not None:
            futs = by_task.get(task)
            if futs is not None:
                futs.pop(fut, None)
                if not futs:
                    del by_task[task]
            if not by_task:
                del self._waiters[partition_id]

    def _spawn(self, coro_fn: Any, *args: Any) -> None:
        if self._tg is None:
            raise RuntimeError("the controller is not serving")
        self._tg.start_soon(coro_fn, *args)

    # ---- dispatch ----------------------------------------------------------------------------

    def _on_message(self, peer: bytes, frames: list[zmq.Frame]) -> None:
        header = frames[0].buffer
        try:
            req: ControllerRequest = controller_request_decoder.decode(header)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            rid = salvage_rid(header)
            self._malformed.warning("malformed controller request", error=str(exc), rid=rid)
            if rid is not None:
                self._send_error(peer, rid, ProtocolError(f"malformed request: {exc}"), "?")
            return
        key = (peer, req.rid)
        cached = self._replies.get(key)
        if cached is not None:  # a retry of a finished request: the same answer again
            if self._endpoint is not None:
                self._endpoint.send(peer, [cached])
            return
        if key in self._pending:
            return  # a retry of a request still waiting: its reply will reach the retry
        body = req.body
        metrics = self.metrics.enabled
        t0 = time.perf_counter() if metrics else 0.0
        ok = True
        try:
            validate(body)
            if isinstance(body, PutInline):
                deferred = self._put_inline(peer, req.rid, body, frames[1:], t0)
            else:
                deferred = self._handle(peer, req.rid, body, t0)
        except Exception as exc:
            ok, deferred = False, False
            self._send_error(peer, req.rid, exc, type(body).__name__)
        if metrics and not deferred:
            self.metrics.request(type(body).__name__, ok, time.perf_counter() - t0)

    def _handle(self, peer: bytes, rid: int, body: Any, t0: float) -> bool:
        """Dispatch one request; True when a task will send the reply (and record metrics)."""
        st, core = self.state, self.core
        if isinstance(body, GetMeta):
            return self._get_meta(peer, rid, body, t0)
        if isinstance(body, PutBegin):
            _check_incarnation(st, body.partition_id, body.incarnation)
            n_new = st.new_rows_needed(body.partition_id, body.n_rows, body.rows, body.keys)
            if not self._room_for(body.partition_id, n_new, body.nowait):
                self._spawn(self._put_begin_waiting, peer, rid, body, n_new, t0)
                return True
            self._put_begin(peer, rid, body)
        elif isinstance(body, PutCommit):
            fx = core.put_commit(
                body.partition_id,
                body.rows,
                body.fields,
                body.tags,
                body.versions,
                body.put_id,
                body.incarnation,
            )
            self._send_ok(peer, rid, None)
            self._apply(fx)
        elif isinstance(body, RenewPut):
            core.renew_puts(body.put_ids, self._now())
            self._send_ok(peer, rid, None)
            self._rearm()
        elif isinstance(body, Cancel):
            scope = self._pending.get((peer, body.target))
            if scope is not None:
                scope.cancel()
        elif isinstance(body, Ack):
            fx = core.ack(body.lease_ids, self._now())
            self._send_ok(peer, rid, None)
            self._apply(fx)
        elif isinstance(body, Release):
            fx = core.release(body.partition_id, body.task_name, body.rows, body.incarnation)
            self._send_ok(peer, rid, None)
            self._apply(fx)
        elif isinstance(body, Hello):
            infos = [UnitInfo(i, a) for i, a in sorted(st.units.items())]
            ep = self._endpoint
            ipc = ep.ipc_address if ep is not None else None
            hello = HelloReply(
                infos, self.allow_pickle, st.capacity, st.units_epoch, ipc, self._instance
            )
            self._send_ok(peer, rid, hello)
        elif isinstance(body, Seal):
            wakeups = st.seal(body.partition_id)
            self._send_ok(peer, rid, None)
            self._notify(wakeups)
        elif isinstance(body, ResetConsumption):
            fx = core.reset_consumption(body.partition_id, body.task_name)
            self._send_ok(peer, rid, None)
            self._apply(fx)
        elif isinstance(body, ClearSamples):
            fx = core.clear_rows(body.partition_id, body.rows, body.incarnation)
            self._clear_then_reply(peer, rid, fx)
        elif isinstance(body, ClearPartition):
            self._clear_then_reply(peer, rid, core.clear_partition(body.partition_id))
        elif isinstance(body, CheckProduction):
            # before the first put, or after a clear, the answer is "not yet" (not an error):
            # a readiness loop may start before the producers do
            p_or_none = st.partitions.get(body.partition_id)
            ok = False
            if p_or_none is not None:
                p = p_or_none
                rows = body.rows if body.rows is not None else _alive_rows(p)
                p.check_rows(rows)
                ok = (
                    bool(rows)
                    and all(f in p.fields for f in body.data_fields)
                    and all(p.is_produced(r, body.data_fields) for r in rows)
                )
            self._send_ok(peer, rid, ok)
        elif isinstance(body, CheckConsumption):
            p_or_none = st.partitions.get(body.partition_id)
            ok = False
            if p_or_none is not None:
                p = p_or_none
                rows = body.rows if body.rows is not None else _alive_rows(p)
                p.check_rows(rows)
                consumed = p.consumed.get(body.task_name)
                ok = bool(rows) and consumed is not None and all(consumed[r] for r in rows)
            self._send_ok(peer, rid, ok)
        elif isinstance(body, ProductionStatus):
            p = st.partition(body.partition_id)
            names = body.data_fields if body.data_fields is not None else list(p.fields)
            self._send_ok(peer, rid, {n: p.production_mask(n) for n in names})
        elif isinstance(body, ConsumptionStatus):
            p = st.partition(body.partition_id)
            self._send_ok(peer, rid, p.consumption_mask(body.task_name))
        elif isinstance(body, ListPartitions):
            self._send_ok(peer, rid, sorted(st.partitions))
        elif isinstance(body, PartitionInfo):
            self._send_ok(peer, rid, st.partition(body.partition_id).info())
        elif isinstance(body, SetTags):
            p = st.partition(body.partition_id)
            p.check_incarnation(body.incarnation)
            p.set_tags(body.rows, body.tags)
            self._send_ok(peer, rid, None)
        elif isinstance(body, KVLookup):
            p = st.partition(body.partition_id)
            rows = p.rows_for_keys(body.keys)
            fields = body.fields if body.fields is not None else list(p.fields)
            if body.available:
                fields = [f for f, fd in p.fields.items() if all(fd.produced[r] for r in rows)]
            for key, r in zip(body.keys, rows, strict=True):
                lacking = [f for f in fields if f not in p.fields or not p.fields[f].produced[r]]
                if lacking:
                    raise KeyNotFound(
                        f"key {key!r} of partition {body.partition_id!r} has no fields "
                        f"{lacking}; put them first or select other fields"
                    )
            self._send_ok(peer, rid, meta_reply(p, rows, fields))
        elif isinstance(body, KVTag):
            if len(body.tags) != len(body.keys):
                raise InvalidRequestError(
                    f"got {len(body.tags)} tag dicts for {len(body.keys)} keys"
                )
            placement, fx = core.put_begin(
                body.partition_id, [], 0, None, body.keys, self._now(), lease=False
            )
            st.partition(body.partition_id).set_tags(placement.rows, body.tags)
            self._send_ok(peer, rid, placement)
            self._apply(fx)
        elif isinstance(body, KVList):
            pids = [body.partition_id] if body.partition_id is not None else list(st.partitions)
            listing = {}
            for pid in pids:
                p = st.partition(pid)
                listing[pid] = {k: p.tags[r] or {} for k, r in p.keys.items()}
            self._send_ok(peer, rid, listing)
        elif isinstance(body, KVClear):
            key_rows = st.partition(body.partition_id).rows_for_keys(body.keys)
            self._clear_then_reply(peer, rid, core.clear_rows(body.partition_id, key_rows))
        elif isinstance(body, KVKeys):
            p = st.partition(body.partition_id)
            p.check_rows(body.rows)
            row_keys = [p.row_keys[r] for r in body.rows]
            if None in row_keys:
                keyless = [r for r, k in zip(body.rows, row_keys, strict=True) if k is None]
                raise KeyNotFound(
                    f"rows {keyless[:8]} of partition {body.partition_id!r} have no key (put "
                    "without one); pass rows written with kv_put / kv_batch_put"
                )
            self._send_ok(peer, rid, row_keys)
        elif isinstance(body, DumpState):
            ids = body.partition_ids if body.partition_ids is not None else list(st.partitions)
            dumps = [st.partition(pid).dump() for pid in ids]
            sampler_state = {"default": self.sampler.state_dict()}
            sampler_state |= {
                f"task:{t}": smp.state_dict() for t, smp in self.task_samplers.items()
            }
            self._send_ok(peer, rid, StateDump(dumps, sampler_state))
        elif isinstance(body, RestoreBegin):
            staged = st.restore_begin(body.state.partitions)
            self._send_ok(peer, rid, {p.partition_id: list(p.units) for p in staged})
        elif isinstance(body, RestoreCommit):
            missing = [pid for pid in body.partition_ids if pid not in st.restoring]
            if missing:
                raise InvalidRequestError(f"partitions {missing} are not being restored")
            for pid in body.partition_ids:
                st.partitions[pid] = st.restoring.pop(pid)
            if body.sampler_state:
                self.sampler.load_state_dict(body.sampler_state.get("default", {}))
                for t, smp in self.task_samplers.items():
                    smp.load_state_dict(body.sampler_state.get(f"task:{t}", {}))
            self._send_ok(peer, rid, None)
            self._notify([Wakeup(pid) for pid in body.partition_ids])
        elif isinstance(body, RestoreAbort):
            for pid in body.partition_ids:
                st.restoring.pop(pid, None)
            everywhere: dict[int, list[int] | None] = dict.fromkeys(st.units)
            for pid in body.partition_ids:
                self._spawn(self._clear_units, None, rid, pid, everywhere)
            self._send_ok(peer, rid, None)
        elif isinstance(body, RegisterTasks):
            if body.tasks:
                st.auto_clear[body.partition_id] = tuple(dict.fromkeys(body.tasks))
            else:
                st.auto_clear.pop(body.partition_id, None)
            self._send_ok(peer, rid, None)
        elif isinstance(body, SetPolicyVersion):
            fx = core.set_policy_version(body.version)
            self._send_ok(peer, rid, None)
            self._apply(fx)
        elif isinstance(body, AcquireRollout):
            if core.acquire(body.policy_version, body.n):
                self._send_ok(peer, rid, None)
                return False
            self._spawn(self._acquire_waiting, peer, rid, body, t0)
            return True
        elif isinstance(body, ReleaseRollout):
            if body.n < 0:
                raise InvalidRequestError(f"release_rollout needs n >= 0, got {body.n}")
            self._send_ok(peer, rid, None)
            self._apply(Effects(admission=core.free_slots(body.n)))
        elif isinstance(body, TakeRecycled):
            if body.max_rows < 1:
                raise InvalidRequestError(f"max_rows must be >= 1, got {body.max_rows}")
            self._send_ok(peer, rid, self._take_recycled(body.max_rows))
        elif isinstance(body, StalenessStatus):
            self._send_ok(
                peer,
                rid,
                {
                    "learner_version": st.learner_version,
                    "outstanding": st.outstanding,
                    "recycled_pending": len(st.recycled),
                    **st.stale_counts,
                },
            )
        elif isinstance(body, RegisterUnit):
            self._register_unit(peer, rid, body)
        elif isinstance(body, LostRows):
            pids = [body.partition_id] if body.partition_id is not None else list(st.partitions)
            lost = {pid: sorted(st.partition(pid).lost) for pid in pids}
            self._send_ok(
                peer,
                rid,
                {
                    "dead_units": sorted(st.dead_units),
                    "suspended_units": sorted(st.suspended),
                    "rows": lost,
                },
            )
        else:  # pragma: no cover - the decoder admits only the types above
            raise ProtocolError(f"unknown request {type(body).__name__}")
        return False

    def _clear_then_reply(self, peer: bytes, rid: int, fx: Effects) -> None:
        """Apply a clear; answer once the storage units freed the rows."""
        (partition_id, incarnation, by_unit), *rest = fx.free
        fx.free = rest
        self._apply(fx)
        self._spawn(self._clear_units, peer, rid, partition_id, by_unit, incarnation)

    def _register_unit(self, peer: bytes, rid: int, body: RegisterUnit) -> None:
        st = self.state
        unit_id = body.unit_id
        if unit_id < 0:
            # the unit asks for an id: the one its address already has (a retry or a
            # restart at the same address), else the next free one
            unit_id = next(
                (i for i, a in st.units.items() if a == body.address),
                max(st.units, default=-1) + 1,
            )
        old = self._units.pop(unit_id, None)
        if old is not None:
            old.close()
        self._unit_instance.pop(unit_id, None)
        fx = self.core.unit_registered(unit_id, body.address)
        self._unit(unit_id)
        self._send_ok(peer, rid, unit_id)
        self._apply(fx)

    # ---- get_meta ----------------------------------------------------------------------------

    def _get_meta(self, peer: bytes, rid: int, req: GetMeta, t0: float) -> bool:
        if req.lease is None and self.default_lease is not None:
            req.lease = self.default_lease
        decision, fx = self.core.get_meta(req, self._now())
        self._apply(fx)
        if isinstance(decision, SampleCall):
            result = decision.run()
            if inspect.isawaitable(result):
                self._spawn(
                    self._get_meta_waiting, peer, rid, req, (decision, result), self._generation, t0
                )
                return True
            decision, fx = self.core.sampled(req, decision, result, self._now())
            self._apply(fx)
        if isinstance(decision, MetaReply):
            self._send_meta(peer, rid, req, decision)
            return False
        self._spawn(self._get_meta_waiting, peer, rid, req, None, self._generation, t0)
        if _why_waiting(self.state, req) is not None:  # a typo would wait silently forever
            asyncio.get_running_loop().call_later(
                self.waiting_warning_after, self._warn_if_still_waiting, peer, rid, req
            )
        return True

    def _warn_if_still_waiting(self, peer: bytes, rid: int, req: GetMeta) -> None:
        why = _why_waiting(self.state, req)
        if (peer, rid) in self._pending and why is not None:
            log.warning(
                f"get_meta has waited {self.waiting_warning_after:g} s: {why}",
                partition=req.partition_id,
                task=req.task_name,
                fields=list(req.data_fields),
            )

    async def _get_meta_waiting(
        self,
        peer: bytes,
        rid: int,
        req: GetMeta,
        first: tuple[SampleCall, Awaitable[Any]] | None,
        generation: int,
        t0: float,
    ) -> None:
        pid, task = req.partition_id, req.task_name
        structlog.contextvars.bind_contextvars(rid=rid, op="GetMeta", partition=pid, task=task)
        core = self.core

        async def work() -> None:
            running = first
            look = self._generation != generation
            while True:
                # register before looking, so a wake-up between the two is never missed
                fut = self._register_waiter(pid, task)
                try:
                    decision: MetaReply | SampleCall | None = None
                    if running is None and look:
                        decision = core.look(req, self._now())
                        if isinstance(decision, SampleCall):
                            result = decision.run()
                            if inspect.isawaitable(result):
                                running = (decision, result)
                            else:
                                decision, fx = core.sampled(req, decision, result, self._now())
                                self._apply(fx)
                    if running is not None:
                        call, pending = running
                        running = None
                        answer = await pending
                        decision, fx = core.sampled(req, call, answer, self._now(), strict=False)
                        self._apply(fx)
                    if isinstance(decision, MetaReply):
                        self._send_meta(peer, rid, req, decision)
                        self.metrics.consumer_wait(time.perf_counter() - t0)
                        return
                    if not fut.done():
                        await fut
                finally:
                    self._drop_waiter(pid, task, fut)
                look = True  # something changed: look again

        await self._waiting_request(
            peer, rid, "GetMeta", t0, req.timeout, lambda: self._get_meta_timeout(req), work
        )

    def _get_meta_timeout(self, req: GetMeta) -> str:
        why = _why_waiting(self.state, req)
        if why is not None:
            return (
                f"get_meta for task {req.task_name!r} timed out after {req.timeout} s: {why}; "
                "nothing was consumed"
            )
        return (
            f"get_meta on partition {req.partition_id!r} for task {req.task_name!r} found "
            f"fewer than {req.batch_size} ready rows within {req.timeout} s; nothing was "
            "consumed"
        )

    # ---- puts --------------------------------------------------------------------------------

    def _put_begin(self, peer: bytes, rid: int, body: PutBegin) -> None:
        placement, fx = self.core.put_begin(
            body.partition_id, body.columns, body.n_rows, body.rows, body.keys, self._now()
        )
        self._send_ok(peer, rid, placement)
        self._apply(fx)

    def _room_for(self, partition_id: str, n_new: int, nowait: bool) -> bool:
        """Whether ``n_new`` rows fit now; raises when they never will, or when ``nowait``."""
        st = self.state
        if st.has_room(partition_id, n_new):
            return True
        if st.capacity is not None and n_new > st.capacity:
            raise InvalidRequestError(
                f"a put of {n_new} new rows can never fit the capacity of "
                f"{st.capacity} rows; split it"
            )
        if nowait:
            raise WouldBlock(
                f"partition {partition_id!r} is at its capacity of {st.capacity} "
                "rows; wait with put(), or free rows (clear, or auto-clear tasks)"
            )
        return False

    def _put_inline(
        self, peer: bytes, rid: int, body: PutInline, frames: list[zmq.Frame], t0: float
    ) -> bool:
        """A :class:`PutInline`; True when a task will answer it.

        With room and a unit in this process, everything happens here: place, store, commit,
        reply. Otherwise a task waits for room and/or forwards the columns to the unit.
        """
        _check_incarnation(self.state, body.partition_id, body.incarnation)
        n_new = self.state.new_rows_needed(body.partition_id, body.n_rows, body.rows, None)
        placed = None
        if self._room_for(body.partition_id, n_new, body.nowait):
            placed = self._inline_place(body)
            unit = self.local_units.get(placed.units[0])
            if unit is not None:
                try:
                    unit.store_local(
                        body.partition_id,
                        placed.rows,
                        body.columns,
                        frames,
                        placed.partition.incarnation,
                    )
                    self._inline_commit(peer, rid, body, placed)
                except BaseException:
                    self._inline_undo(body, placed)
                    raise
                return False
        self._spawn(self._put_inline_task, peer, rid, body, frames, n_new, placed, t0)
        return True

    def _inline_place(self, body: PutInline) -> _Placed:
        placement, fx = self.core.put_begin(
            body.partition_id, body.columns, body.n_rows, body.rows, None, self._now(), lease=False
        )
        if len(set(placement.units)) != 1:
            raise InvalidRequestError(
                "a one-message put must write rows of one storage unit; these rows are on "
                f"units {sorted(set(placement.units))} (the client splits such puts)"
            )
        p = self.state.partitions[body.partition_id]
        return _Placed(p, placement.rows, placement.units, fx)

    def _inline_commit(self, peer: bytes, rid: int, body: PutInline, placed: _Placed) -> None:
        fields = [h.name for h in body.columns]
        incarnation = placed.partition.incarnation  # not cleared while storing
        fx = self.core.put_commit(
            body.partition_id, placed.rows, fields, body.tags, body.versions, 0, incarnation
        )
        fx.add(placed.effects)
        self._send_ok(peer, rid, Placement(placed.rows, placed.units, incarnation=incarnation))
        self._apply(fx)

    def _inline_undo(self, body: PutInline, placed: _Placed) -> None:
        """A one-message put failed after its rows were placed: drop new rows again."""
        p = placed.partition
        if body.rows is not None or self.state.partitions.get(body.partition_id) is not p:
            return  # existing rows (their new cells were never marked produced), or cleared
        # rows may be gone already: lost with their unit, or the partition cleared meanwhile
        rows = [r for r in placed.rows if r < p.n_rows and p.alive[r]]
        if rows:
            self._apply(self.core.clear_rows(body.partition_id, rows))

    async def _put_inline_task(
        self,
        peer: bytes,
        rid: int,
        body: PutInline,
        frames: list[zmq.Frame],
        n_new: int,
        placed: _Placed | None,
        t0: float,
    ) -> None:
        async def work() -> None:
            nonlocal placed
            if placed is None:
                await _until(
                    lambda: self.state.has_room(body.partition_id, n_new), self._room_waiters
                )
                placed = self._inline_place(body)
            unit_id = placed.units[0]
            local = self.local_units.get(unit_id)
            try:
                if local is not None:
                    local.store_local(
                        body.partition_id,
                        placed.rows,
                        body.columns,
                        frames,
                        placed.partition.incarnation,
                    )
                else:
                    store = StorePut(
                        body.partition_id, placed.rows, body.columns, placed.partition.incarnation
                    )
                    await self._unit(unit_id).request(store, frames, timeout=self.unit_timeout)
                self._inline_commit(peer, rid, body, placed)
            except BaseException:
                self._inline_undo(body, placed)
                raise

        def timed_out() -> str:
            if placed is None:
                return (
                    f"partition {body.partition_id!r} stayed at its capacity of "
                    f"{self.state.capacity} rows for {body.timeout} s; nothing was written"
                )
            return f"the put did not complete within {body.timeout} s; nothing was written"

        await self._waiting_request(peer, rid, "PutInline", t0, body.timeout, timed_out, work)

    async def _put_begin_waiting(
        self, peer: bytes, rid: int, body: PutBegin, n_new: int, t0: float
    ) -> None:
        async def work() -> None:
            await _until(lambda: self.state.has_room(body.partition_id, n_new), self._room_waiters)
            self._put_begin(peer, rid, body)

        await self._waiting_request(
            peer,
            rid,
            "PutBegin",
            t0,
            body.timeout,
            lambda: (
                f"partition {body.partition_id!r} stayed at its capacity of "
                f"{self.state.capacity} rows for {body.timeout} s; nothing was written"
            ),
            work,
        )

    # ---- admission ---------------------------------------------------------------------------

    async def _acquire_waiting(
        self, peer: bytes, rid: int, body: AcquireRollout, t0: float
    ) -> None:
        async def work() -> None:
            await _until(
                lambda: self.core.acquire(body.policy_version, body.n), self._admission_waiters
            )
            self._send_ok(peer, rid, None)

        st = self.state
        await self._waiting_request(
            peer,
            rid,
            "AcquireRollout",
            t0,
            body.timeout,
            lambda: (
                f"rollout of policy version {body.policy_version} not admitted within "
                f"{body.timeout} s (learner at {st.learner_version}, {st.outstanding} rows "
                "outstanding); nothing was reserved"
            ),
            work,
        )

    def _take_recycled(self, max_rows: int) -> list[RecycledRows]:
        out: dict[str, list[int]] = {}
        taken = 0
        st = self.state
        while st.recycled and taken < max_rows:
            pid, row = st.recycled.popleft()
            p = st.partitions.get(pid)
            if p is None or not p.alive[row]:
                continue  # its partition was cleared: nothing left to regenerate from
            out.setdefault(pid, []).append(row)
            taken += 1
        return [
            RecycledRows(pid, meta_reply(st.partitions[pid], rows, list(st.partitions[pid].fields)))
            for pid, rows in out.items()
        ]

    async def _waiting_request(
        self,
        peer: bytes,
        rid: int,
        op: str,
        t0: float,
        timeout: float | None,
        timeout_message: Callable[[], str],
        work: Callable[[], Awaitable[None]],
    ) -> None:
        """Run a request that may wait: ``work`` sends the reply.

        The request can be cancelled by the client (``Cancel``), fails with
        :class:`TQTimeoutError` after ``timeout``, and answers any error; nothing it would
        have done happens after it ends.
        """
        scope = anyio.CancelScope()
        self._pending[(peer, rid)] = scope
        ok = False
        try:
            with scope, anyio.fail_after(timeout) if timeout else nullcontext():
                await work()
                ok = not scope.cancel_called
        except TimeoutError:
            self._send_error(peer, rid, TQTimeoutError(timeout_message()), op)
        except Exception as exc:
            self._send_error(peer, rid, exc, op)
        finally:
            self._pending.pop((peer, rid), None)
            if self.metrics.enabled:
                self.metrics.request(op, ok, time.perf_counter() - t0)

    # ---- storage units -----------------------------------------------------------------------

    def _unit(self, unit_id: int) -> DealerConnection:
        conn = self._units.get(unit_id)
        if conn is None:
            conn = self._units[unit_id] = DealerConnection(
                self.state.units[unit_id],
                curve=self.curve.as_client() if self.curve is not None else None,
                on_disconnect=lambda: self._unit_silent(unit_id),
                on_connect=lambda: self._unit_connected(unit_id),
                on_refused=lambda: self._unit_refused(unit_id),
                heartbeat_timeout=self.unit_suspend_after,
            )
        return conn

    def _unit_silent(self, unit_id: int) -> None:
        """A unit's connection broke or went silent: suspend it (its data may still be there)."""
        if self.stopping or unit_id in self.local_units:
            if not self.stopping:  # a unit of this process only goes away when it stops
                self._apply(self.core.unit_lost(unit_id))
            return
        self._apply(self.core.unit_down(unit_id, self._now()))

    def _unit_refused(self, unit_id: int) -> None:
        """Reconnecting to a suspended unit was refused: its process is gone, with its data."""
        if not self.stopping and unit_id in self.state.suspended:
            self._apply(self.core.unit_lost(unit_id))

    def _unit_connected(self, unit_id: int) -> None:
        """A (re)connection to a unit: learn its instance, or check it is the one we had."""
        if not self.stopping and unit_id not in self.local_units and self._tg is not None:
            self._spawn(self._check_unit, unit_id)

    async def _check_unit(self, unit_id: int) -> None:
        conn = self._units.get(unit_id)
        if conn is None:
            return
        try:
            payload, _ = await conn.request(StoreStats(), timeout=self.unit_timeout)
        except TQError:
            return  # still away: the liveness deadlines decide
        if self._units.get(unit_id) is not conn:
            return  # replaced meanwhile (re-registered)
        instance = msgspec.msgpack.decode(payload, type=StoreStatsReply).instance
        known = self._unit_instance.setdefault(unit_id, instance)
        if unit_id not in self.state.suspended:
            return
        if known == instance:
            self._apply(self.core.unit_up(unit_id))
        else:  # another process answers at the unit's address: what it held is gone
            self._apply(self.core.unit_lost(unit_id))

    async def _clear_units(
        self,
        peer: bytes | None,
        rid: int,
        partition_id: str,
        by_unit: Mapping[int, list[int] | None],
        incarnation: str | None = None,
    ) -> None:
        """Tell units to free rows; answer ``peer`` (if any) once all have, or with the errors.

        With ``incarnation``, units free only that incarnation's cells.
        """
        errors: list[str] = []

        async def clear_one(unit_id: int, rows: list[int] | None) -> None:
            try:
                await self._unit(unit_id).request(
                    StoreClear(partition_id, rows, incarnation), timeout=self.unit_timeout
                )
            except TQError as exc:
                errors.append(f"unit {unit_id}: {exc}")

        async with anyio.create_task_group() as tg:
            for unit_id, rows in by_unit.items():
                if unit_id in self.state.units and unit_id not in self.state.dead_units:
                    tg.start_soon(clear_one, unit_id, rows)
        if peer is None:
            if errors:
                log.warning("freeing storage failed", partition=partition_id, errors=errors)
        elif errors:
            self._send_error(
                peer,
                rid,
                TQError(
                    f"partition {partition_id!r} was cleared in the controller, but freeing "
                    f"storage failed: {'; '.join(errors)}"
                ),
                "Clear",
            )
        else:
            self._send_ok(peer, rid, None)


async def _until(predicate: Callable[[], bool], waiters: dict[asyncio.Future[None], None]) -> None:
    """Wait (event-driven) until ``predicate()`` holds; :func:`_wake_all` wakes the waiters."""
    while not predicate():
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters[fut] = None
        try:
            await fut
        finally:
            waiters.pop(fut, None)


def _wake_all(waiters: dict[asyncio.Future[None], None]) -> None:
    for fut in list(waiters):
        if not fut.done():
            fut.set_result(None)
    waiters.clear()


@dataclass(frozen=True, slots=True)
class _Placed:
    """Where a one-message put goes (all rows on one unit), and the effects it owes."""

    partition: Partition
    rows: list[int]
    units: list[int]
    effects: Effects


def _why_waiting(state: ControllerState, req: GetMeta) -> str | None:
    """What a waiting get_meta lacks that more rows of the known fields would not bring."""
    p = state.partitions.get(req.partition_id)
    if p is None:
        return f"partition {req.partition_id!r} does not exist (no put has created it)"
    missing = [f for f in req.data_fields if f not in p.fields]
    if not missing:
        return None
    return (
        f"no row of partition {req.partition_id!r} has the field(s) {missing} (it has "
        f"{sorted(p.fields)}); check the field names"
    )


def _check_incarnation(st: ControllerState, partition_id: str, incarnation: str | None) -> None:
    """A write through a BatchMeta of an earlier incarnation of ``partition_id`` fails."""
    if incarnation is not None:
        p = st.partitions.get(partition_id)
        if p is None:
            raise RowsNotFound(
                f"partition {partition_id!r} was cleared since this BatchMeta was made: its "
                "rows are gone"
            )
        p.check_incarnation(incarnation)


def _alive_rows(p: Partition) -> list[int]:
    return [r for r in range(p.n_rows) if p.alive[r]]
