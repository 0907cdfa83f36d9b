"""The controller service: a thin async shell around :class:`~tq_async._state.ControllerState`.

Every request is answered from the reader callback when it can be (status calls, puts, a
get_meta whose sampler finds rows at once). Only requests that must wait become tasks: a
get_meta with too few ready rows, an async sampler, a clear that tells the storage units.

A waiting get_meta parks on a future registered under ``(partition, task)``; the state hands
back :class:`~tq_async._state.Wakeup` events when production, consumption, sealing or clearing
changes what a task could receive, and only the matching futures are woken. There is no timer
and no polling: an idle waiter costs one future until data arrives.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
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
    TakeRecycled,
    UnitInfo,
    controller_request_decoder,
    error_reply,
    ok_reply,
    salvage_rid,
)
from ._security import CurveServer
from ._state import (
    ControllerState,
    Partition,
    ReadyView,
    RowOrigin,
    RowTags,
    RowVersions,
    Wakeup,
)
from ._storage import StorageServer
from ._transport import DealerConnection, LogThrottle, RouterEndpoint
from .samplers import BaseSampler, SampleResult, SequentialSampler, StaleRows

__all__ = ["AdmissionConfig", "ControllerServer"]

log = structlog.get_logger(__name__)

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


def _kwargs_filter(sampler: Any) -> frozenset[str] | None:
    """Names ``sampler.sample`` accepts as keywords, or None when it takes ``**kwargs``."""
    try:
        params = inspect.signature(sampler.sample).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(
        p.name
        for p in params
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )


@dataclass
class _Lease:
    partition: Partition
    task: str
    rows: list[int]
    key: tuple[str, int, int] | None
    timer: asyncio.TimerHandle | None  # None: a hold for auto-clear, released by ack only


class _Attempt:
    """What one sampler call needs to be finished after an ``await``."""

    __slots__ = ("final", "partition", "result", "stale")

    def __init__(self, partition: Partition, result: Any, final: bool, stale: StaleRows) -> None:
        self.partition = partition
        self.result = result
        self.final = final
        self.stale = stale


@dataclass(frozen=True)
class AdmissionConfig:
    """Bounds on asynchronous rollouts, enforced by ``acquire_rollout`` (see issue: staleness).

    Attributes:
        max_staleness: a rollout of policy version ``v`` may start only while
            ``v - learner_version <= max_staleness`` (None: no version bound).
        capacity: the most rows admitted and not yet consumed by ``learner_task`` (None: no
            bound). Unconsumed rows are never evicted: producers wait instead.
        learner_task: the task whose consumption frees admission slots (needed with
            ``capacity``).
    """

    max_staleness: int | None = None
    capacity: int | None = None
    learner_task: str | None = None

    def __post_init__(self) -> None:
        if self.max_staleness is not None and self.max_staleness < 0:
            raise InvalidRequestError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.capacity is not None and (self.capacity < 1 or self.learner_task is None):
            raise InvalidRequestError(
                "capacity must be >= 1 and needs learner_task (whose consumption frees slots)"
            )


class ControllerServer:
    """Serves a :class:`ControllerState` on a ROUTER socket.

    Args:
        state: the state machine (a new empty one by default).
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
    ) -> None:
        self.state = state or ControllerState()
        self.local_units: dict[int, StorageServer] = dict(local_units or {})
        self.curve = curve
        self._malformed = LogThrottle()
        self.metrics = metrics or Metrics(None, "controller")
        self.admission = admission or AdmissionConfig()
        self._admission_waiters: dict[asyncio.Future[None], None] = {}
        self._room_waiters: dict[asyncio.Future[None], None] = {}
        #: set while shutting down: units going away then are not "lost"
        self.stopping = False
        self.sampler: BaseSampler = sampler if sampler is not None else SequentialSampler()
        self.task_samplers: dict[str, BaseSampler] = dict(task_samplers or {})
        self.allow_pickle = allow_pickle
        self.unit_timeout = unit_timeout
        self._sampler_kwargs = {
            id(smp): _kwargs_filter(smp) for smp in (self.sampler, *self.task_samplers.values())
        }
        self._endpoint: RouterEndpoint | None = None
        #: what a same-host client compares through the ipc twin (see _transport)
        self._instance = secrets.token_bytes(16)
        self._tg: TaskGroup | None = None
        self._waiters: dict[str, dict[str, dict[asyncio.Future[None], None]]] = {}
        self._pending: dict[tuple[bytes, int], anyio.CancelScope] = {}
        self._leases: dict[int, _Lease] = {}
        #: rows under a lease or hold: partition -> row -> number of holders
        self._held: dict[str, dict[int, int]] = {}
        self._lease_ids = itertools.count(1)
        #: recent replies by (client identity, request id), for retried requests
        self._replies: OrderedDict[tuple[bytes, int], bytes] = OrderedDict()
        self._units: dict[int, DealerConnection] = {}
        #: number of sampler invocations (tests use it to prove waiting is event-driven)
        self.sampler_calls = 0
        #: bumped on every wake-up; lets a new waiter know whether to look again
        self._generation = 0

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
                self._endpoint.close()
                for conn in self._units.values():
                    conn.close()
                self._units.clear()
                tg.cancel_scope.cancel()

    # ---- plumbing ----------------------------------------------------------------------------

    def _send_ok(self, peer: bytes, rid: int, payload: Any) -> None:
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
        st = self.state
        if isinstance(body, GetMeta):
            return self._get_meta(peer, rid, body, t0)
        if isinstance(body, PutBegin):
            n_new = st.new_rows_needed(body.partition_id, body.n_rows, body.rows, body.keys)
            if not self._room_for(body.partition_id, n_new, body.nowait):
                self._spawn(self._put_begin_waiting, peer, rid, body, n_new, t0)
                return True
            self._put_begin(peer, rid, body)
        elif isinstance(body, PutCommit):
            p = st.partition(body.partition_id)
            gained = p.commit(body.rows, body.fields, body.tags, body.versions)
            self._send_ok(peer, rid, None)
            self._notify([Wakeup(body.partition_id, t) for t in gained])
        elif isinstance(body, Cancel):
            scope = self._pending.get((peer, body.target))
            if scope is not None:
                scope.cancel()
        elif isinstance(body, Ack):
            self._commit_leases(body.lease_ids)
            self._send_ok(peer, rid, None)
        elif isinstance(body, Release):
            p = st.partition(body.partition_id)
            if p.release(body.task_name, body.rows):
                self._notify([Wakeup(body.partition_id, body.task_name)])
            self._send_ok(peer, rid, None)
        elif isinstance(body, Hello):
            infos = [UnitInfo(i, a) for i, a in sorted(st.units.items())]
            ep = self._endpoint
            ipc = ep.ipc_address if ep is not None else None
            reply = HelloReply(infos, self.allow_pickle, st.capacity, ipc, self._instance)
            self._send_ok(peer, rid, reply)
        elif isinstance(body, Seal):
            sealed = st.partitions.get(body.partition_id)
            if sealed is None:
                sealed = st.partitions[body.partition_id] = Partition(body.partition_id)
            sealed.sealed = True
            self._send_ok(peer, rid, None)
            self._notify([Wakeup(body.partition_id)])
        elif isinstance(body, ResetConsumption):
            st.partition(body.partition_id).reset_consumption(body.task_name)
            for smp in self._all_samplers():
                smp.reset_partition(body.partition_id, body.task_name)
            self._send_ok(peer, rid, None)
            self._notify([Wakeup(body.partition_id, body.task_name)])
        elif isinstance(body, ClearSamples):
            p = st.partition(body.partition_id)
            self._free_unconsumed(p, body.rows)
            by_unit = p.clear_rows(body.rows)
            self._rows_freed()
            self._notify([Wakeup(body.partition_id)])
            self._spawn(self._clear_units, peer, rid, body.partition_id, by_unit)
        elif isinstance(body, ClearPartition):
            p = st.partition(body.partition_id)
            by_unit = p.live_rows_by_unit()
            self._free_unconsumed(p, [r for rows in by_unit.values() for r in rows])
            del st.partitions[body.partition_id]
            self._rows_freed()
            for smp in self._all_samplers():
                smp.clear_partition(body.partition_id)
            self._notify([Wakeup(body.partition_id)])
            whole = {u: None for u in st.units} | dict.fromkeys(by_unit)
            self._spawn(self._clear_units, peer, rid, body.partition_id, whole)
        elif isinstance(body, CheckProduction):
            p = st.partition(body.partition_id)
            rows = body.rows if body.rows is not None else _alive_rows(p)
            p.check_rows(rows)
            ok = all(f in p.fields for f in body.data_fields) and all(
                p.is_produced(r, body.data_fields) for r in rows
            )
            self._send_ok(peer, rid, ok)
        elif isinstance(body, CheckConsumption):
            p = st.partition(body.partition_id)
            rows = body.rows if body.rows is not None else _alive_rows(p)
            p.check_rows(rows)
            consumed = p.consumed.get(body.task_name)
            self._send_ok(peer, rid, consumed is not None and all(consumed[r] for r in rows))
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
            st.partition(body.partition_id).set_tags(body.rows, body.tags)
            self._send_ok(peer, rid, None)
        elif isinstance(body, KVLookup):
            p = st.partition(body.partition_id)
            rows = p.rows_for_keys(body.keys)
            fields = body.fields if body.fields is not None else list(p.fields)
            for key, r in zip(body.keys, rows, strict=True):
                lacking = [f for f in fields if f not in p.fields or not p.fields[f].produced[r]]
                if lacking:
                    raise KeyNotFound(
                        f"key {key!r} of partition {body.partition_id!r} has no fields "
                        f"{lacking}; put them first or select other fields"
                    )
            self._send_ok(peer, rid, _meta_reply(p, rows, fields))
        elif isinstance(body, KVTag):
            if len(body.tags) != len(body.keys):
                raise InvalidRequestError(
                    f"got {len(body.tags)} tag dicts for {len(body.keys)} keys"
                )
            rows, units, wakeups = st.put_begin(body.partition_id, [], 0, None, body.keys)
            st.partition(body.partition_id).set_tags(rows, body.tags)
            self._send_ok(peer, rid, Placement(rows, units))
            self._notify(wakeups)
        elif isinstance(body, KVList):
            pids = [body.partition_id] if body.partition_id is not None else list(st.partitions)
            listing = {}
            for pid in pids:
                p = st.partition(pid)
                listing[pid] = {k: p.tags[r] or {} for k, r in p.keys.items()}
            self._send_ok(peer, rid, listing)
        elif isinstance(body, KVClear):
            p = st.partition(body.partition_id)
            key_rows = p.rows_for_keys(body.keys)
            self._free_unconsumed(p, key_rows)
            by_unit = p.clear_rows(key_rows)
            self._rows_freed()
            self._notify([Wakeup(body.partition_id)])
            self._spawn(self._clear_units, peer, rid, body.partition_id, by_unit)
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
            if body.version < st.learner_version:
                log.warning(
                    "policy version went backwards", old=st.learner_version, new=body.version
                )
            st.learner_version = body.version
            self._send_ok(peer, rid, None)
            self._wake_admission()
            # rows may have gone stale: let waiting samplers look again (and drop them)
            self._notify([Wakeup(pid) for pid in list(self._waiters)])
        elif isinstance(body, AcquireRollout):
            return self._acquire(peer, rid, body, t0)
        elif isinstance(body, ReleaseRollout):
            if body.n < 0:
                raise InvalidRequestError(f"release_rollout needs n >= 0, got {body.n}")
            self._free_slots(body.n)
            self._send_ok(peer, rid, None)
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
            st.units[unit_id] = body.address
            st.dead_units.discard(unit_id)  # a restarted unit takes new rows again
            self._unit(unit_id)
            self._send_ok(peer, rid, unit_id)
        elif isinstance(body, LostRows):
            pids = [body.partition_id] if body.partition_id is not None else list(st.partitions)
            lost = {pid: sorted(st.partition(pid).lost) for pid in pids}
            self._send_ok(peer, rid, {"dead_units": sorted(st.dead_units), "rows": lost})
        else:  # pragma: no cover - the decoder admits only the types above
            raise ProtocolError(f"unknown request {type(body).__name__}")
        return False

    # ---- get_meta ----------------------------------------------------------------------------

    def _get_meta(self, peer: bytes, rid: int, req: GetMeta, t0: float) -> bool:
        _validate_get_meta(req)
        if req.ack:
            self._commit_leases(req.ack)
        outcome = self._attempt(req)
        if isinstance(outcome, MetaReply):
            self._send_meta(peer, rid, req, outcome)
            return False
        self._spawn(self._get_meta_waiting, peer, rid, req, outcome, self._generation, t0)
        return True

    def _call_sampler(
        self, req: GetMeta, p: Partition, ready: ReadyView, final: bool, stale: StaleRows
    ) -> Any:
        cfg = req.sampling_config or {}
        ctx: dict[str, Any] = {
            "partition_id": req.partition_id,
            "task_name": req.task_name,
            "data_fields": list(req.data_fields),
            "dp_rank": cfg.get("dp_rank"),
            "batch_index": cfg.get("batch_index"),
            "sampling_config": cfg,
            "tags": RowTags(p),
            "origin": RowOrigin(p),
            "final": final,
            "replays_served": req.mode == "fetch" and cfg.get("batch_index") is not None,
            "policy_version": self.state.learner_version,
            "versions": RowVersions(p),
            "stale": stale,
        }
        sampler = self.task_samplers.get(req.task_name, self.sampler)
        accepted = self._sampler_kwargs[id(sampler)]
        if accepted is not None:
            ctx = {k: v for k, v in ctx.items() if k in accepted}
        self.sampler_calls += 1
        return sampler.sample(ready, req.batch_size, **ctx)

    def _all_samplers(self) -> list[BaseSampler]:
        return [self.sampler, *self.task_samplers.values()]

    def _attempt(self, req: GetMeta) -> MetaReply | _Attempt | None:
        """Try to answer now: a reply, an in-flight async sampler call, or None (wait)."""
        p = self.state.partitions.get(req.partition_id)
        if p is None:
            return None
        logged = self._logged(req, p)
        if logged is not None:
            return logged
        rs = p.ready_set(req.task_name, req.data_fields)
        final = p.is_final(req.task_name, rs)
        stale = StaleRows()
        result = self._call_sampler(req, p, ReadyView(rs.rows), final, stale)
        if inspect.isawaitable(result):
            return _Attempt(p, result, final, stale)
        return self._finish(req, p, result, final, stale, strict=True)

    def _logged(self, req: GetMeta, p: Partition) -> MetaReply | None:
        key = _delivery_key(req)
        if key is None:
            return None
        rows = p.deliveries.get(key)
        return None if rows is None else _meta_reply(p, list(rows), req.data_fields)

    def _finish(
        self,
        req: GetMeta,
        p: Partition,
        result: Any,
        final: bool,
        stale: StaleRows,
        *,
        strict: bool,
    ) -> MetaReply | None:
        """Apply a sampler's answer; None means "nothing yet" (or, if not strict, retry)."""
        sampled, consumed = _check_result(result)
        if self.state.partitions.get(req.partition_id) is not p:
            return None  # cleared while an async sampler ran
        logged = self._logged(req, p)
        if logged is not None:
            return logged
        if stale and req.mode == "fetch":
            self._apply_stale(req, p, stale)
            final = p.is_final(req.task_name, p.ready_set(req.task_name, req.data_fields))
        try:
            p.check_rows(sampled)
            # rows of the ready set have every field by construction: check only the others
            ready = p.ready_set(req.task_name, req.data_fields).rows
            for r in sampled:
                if r not in ready and not p.is_produced(r, req.data_fields):
                    raise InvalidRequestError(
                        f"the sampler returned row {r}, which lacks some of {req.data_fields}"
                    )
            # A lease, or a task whose rows are auto-cleared, holds the delivered rows until
            # acknowledged: auto-clear must not free rows the consumer has yet to read.
            holding = bool(
                req.mode == "fetch"
                and consumed
                and sampled
                and (req.lease is not None or self.state.auto_clears(p, req.task_name))
            )
            if req.mode == "fetch" and consumed:
                # consumed-but-not-sampled is allowed (e.g. a dropped tail)
                p.check_rows(consumed)
                p.consume(req.task_name, consumed)
                held = set(sampled) if holding else set()
                self._after_consume(req.task_name, p, [r for r in consumed if r not in held])
        except TQError:
            if strict:
                raise
            return None  # the state moved while an async sampler ran: sample again
        if not sampled:
            if consumed:
                final = p.is_final(req.task_name, p.ready_set(req.task_name, req.data_fields))
            if final or (req.stop_when_consumed and _all_consumed(p, req.task_name)):
                return MetaReply([], [], [], list(req.data_fields), end_of_stream=True)
            return None
        key = _delivery_key(req)
        if key is not None:
            p.deliveries[key] = tuple(sampled)
        reply = _meta_reply(p, sampled, req.data_fields)
        if holding:
            reply.lease_id = self._lease(req, p, sampled, key)
        return reply

    # ---- leases ------------------------------------------------------------------------------

    def _lease(
        self, req: GetMeta, p: Partition, rows: list[int], key: tuple[str, int, int] | None
    ) -> int:
        """Lease delivered rows: unless acknowledged in time they go back to the task.

        Without ``req.lease`` this is a hold (no expiry) that only keeps auto-clear away
        from the rows until the consumer acknowledges (``get`` does after reading).
        """
        lease_id = next(self._lease_ids)
        timer = None
        if req.lease is not None:
            timer = asyncio.get_running_loop().call_later(req.lease, self._expire_lease, lease_id)
        self._leases[lease_id] = _Lease(p, req.task_name, rows, key, timer)
        held = self._held.setdefault(p.partition_id, {})
        for r in rows:
            held[r] = held.get(r, 0) + 1
        return lease_id

    def _unhold(self, lease: _Lease) -> None:
        held = self._held.get(lease.partition.partition_id)
        if held is None:
            return
        for r in lease.rows:
            n = held.get(r, 0) - 1
            if n > 0:
                held[r] = n
            else:
                held.pop(r, None)
        if not held:
            del self._held[lease.partition.partition_id]

    def _commit_leases(self, lease_ids: Sequence[int]) -> None:
        for lease_id in lease_ids:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                continue
            if lease.timer is not None:
                lease.timer.cancel()
            self._unhold(lease)
            p = lease.partition
            if self.state.partitions.get(p.partition_id) is p:
                self._auto_clear(p, lease.rows)

    def _expire_lease(self, lease_id: int) -> None:
        """Redeliver: the rows of an unacknowledged lease become ready again for its task."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        self._unhold(lease)
        p = lease.partition
        if self.state.partitions.get(p.partition_id) is not p:
            return  # the partition was cleared meanwhile
        if lease.key is not None and p.deliveries.get(lease.key) == tuple(lease.rows):
            del p.deliveries[lease.key]
        if p.release(lease.task, lease.rows):
            log.info(
                "lease expired: rows go back to the task",
                partition=p.partition_id,
                task=lease.task,
                rows=len(lease.rows),
            )
            self._notify([Wakeup(p.partition_id, lease.task)])

    # ---- backpressure ------------------------------------------------------------------------

    def _put_begin(self, peer: bytes, rid: int, body: PutBegin) -> None:
        rows, units, wakeups = self.state.put_begin(
            body.partition_id, body.columns, body.n_rows, body.rows, body.keys
        )
        self._send_ok(peer, rid, Placement(rows, units))
        self._notify(wakeups)

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

    # ---- one-message puts ----------------------------------------------------------------------

    def _put_inline(
        self, peer: bytes, rid: int, body: PutInline, frames: list[zmq.Frame], t0: float
    ) -> bool:
        """A :class:`PutInline`; True when a task will answer it.

        With room and a unit in this process, everything happens here: place, store, commit,
        reply. Otherwise a task waits for room and/or forwards the columns to the unit.
        """
        n_new = self.state.new_rows_needed(body.partition_id, body.n_rows, body.rows, None)
        placed = None
        if self._room_for(body.partition_id, n_new, body.nowait):
            placed = self._inline_place(body)
            unit = self.local_units.get(placed.units[0])
            if unit is not None:
                try:
                    unit.store_local(body.partition_id, placed.rows, body.columns, frames)
                    self._inline_commit(peer, rid, body, placed)
                except BaseException:
                    self._inline_undo(body, placed, remote=False)
                    raise
                return False
        self._spawn(self._put_inline_task, peer, rid, body, frames, n_new, placed, t0)
        return True

    def _inline_place(self, body: PutInline) -> _Placed:
        rows, units, wakeups = self.state.put_begin(
            body.partition_id, body.columns, body.n_rows, body.rows
        )
        if len(set(units)) != 1:
            raise InvalidRequestError(
                "a one-message put must write rows of one storage unit; these rows are on "
                f"units {sorted(set(units))} (the client splits such puts)"
            )
        return _Placed(self.state.partitions[body.partition_id], rows, units, wakeups)

    def _inline_commit(self, peer: bytes, rid: int, body: PutInline, placed: _Placed) -> None:
        p = self.state.partition(body.partition_id)
        fields = [h.name for h in body.columns]
        gained = p.commit(placed.rows, fields, body.tags, body.versions)
        self._send_ok(peer, rid, Placement(placed.rows, placed.units))
        self._notify([*placed.wakeups, *(Wakeup(body.partition_id, t) for t in gained)])

    def _inline_undo(self, body: PutInline, placed: _Placed, *, remote: bool) -> None:
        """A one-message put failed after its rows were placed: drop new rows again."""
        p = placed.partition
        if body.rows is not None or self.state.partitions.get(body.partition_id) is not p:
            return  # existing rows (their new cells were never marked produced), or cleared
        # rows may be gone already: lost with their unit, or the partition cleared meanwhile
        rows = [r for r in placed.rows if r < p.n_rows and p.alive[r]]
        if not rows:
            return
        self._free_unconsumed(p, rows)
        by_unit = p.clear_rows(rows)
        self._rows_freed()
        self._notify([Wakeup(body.partition_id)])
        if remote:
            self._spawn(self._clear_units, None, 0, body.partition_id, by_unit)
        else:
            for unit_id, rows in by_unit.items():
                local = self.local_units.get(unit_id)
                if local is not None:
                    local.state.clear(body.partition_id, rows)

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
                    local.store_local(body.partition_id, placed.rows, body.columns, frames)
                else:
                    store = StorePut(body.partition_id, placed.rows, body.columns)
                    await self._unit(unit_id).request(store, frames, timeout=self.unit_timeout)
                self._inline_commit(peer, rid, body, placed)
            except BaseException:
                self._inline_undo(body, placed, remote=local is None)
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

    def _rows_freed(self) -> None:
        """Rows were cleared: puts waiting for capacity may fit now."""
        _wake_all(self._room_waiters)

    def _after_consume(self, task: str, p: Partition, rows: Sequence[int]) -> None:
        """Admission slots, auto-clear and "all consumed" waiters follow consumption."""
        self._learner_consumed(task, p, rows)
        if _all_consumed(p, task):
            # waiters of this task asking stop_when_consumed can end their stream now
            self._notify([Wakeup(p.partition_id, task)])
        self._auto_clear(p, rows)

    def _auto_clear(self, p: Partition, rows: Sequence[int]) -> None:
        """Free rows every auto-clear task consumed, unless a consumer still holds them."""
        held = self._held.get(p.partition_id, {})
        done = [r for r in self.state.auto_clear_done(p, rows) if r not in held]
        if done:
            by_unit = p.clear_rows(done)
            self._spawn(self._clear_units, None, 0, p.partition_id, by_unit)
            self._rows_freed()

    # ---- staleness and admission -------------------------------------------------------------

    def _apply_stale(self, req: GetMeta, p: Partition, stale: StaleRows) -> None:
        """Consume the rows a sampler found stale; queue recycled prompts; count."""
        consumed = p.consumed.get(req.task_name)
        st = self.state
        st.stale_counts["kept"] += stale.kept
        for kind, rows in (("dropped", stale.dropped), ("recycled", stale.recycled)):
            valid = [
                r
                for r in dict.fromkeys(rows)
                if 0 <= r < p.n_rows and p.alive[r] and not (consumed and consumed[r])
            ]
            if not valid:
                continue
            p.consume(req.task_name, valid)
            self._after_consume(req.task_name, p, valid)
            st.stale_counts[kind] += len(valid)
            if kind == "recycled":
                st.recycled.extend((p.partition_id, r) for r in valid)
        if stale.dropped or stale.recycled or stale.kept:
            self.metrics.stale(stale)

    def _free_unconsumed(self, p: Partition, rows: Sequence[int]) -> None:
        """Cleared rows the learner never consumed give their admission slots back."""
        task = self.admission.learner_task
        if task is None:
            return
        consumed = p.consumed.get(task)
        freed = sum(
            1
            for r in set(rows)
            if 0 <= r < p.n_rows
            and p.alive[r]
            and p.row_version[r] >= 0
            and not (consumed and consumed[r])
        )
        if freed:
            self._free_slots(freed)

    def _learner_consumed(self, task: str, p: Partition, rows: Sequence[int]) -> None:
        """Consumption by the learner task frees admission slots of versioned rows."""
        if self.admission.learner_task != task:
            return
        freed = sum(1 for r in rows if p.row_version[r] >= 0)
        if freed:
            self._free_slots(freed)

    def _free_slots(self, n: int) -> None:
        self.state.outstanding = max(0, self.state.outstanding - n)
        self._wake_admission()

    def _wake_admission(self) -> None:
        _wake_all(self._admission_waiters)

    def _admissible(self, version: int, n: int) -> bool:
        cfg, st = self.admission, self.state
        if cfg.max_staleness is not None and version - max(st.learner_version, 0) > (
            cfg.max_staleness
        ):
            return False
        return cfg.capacity is None or st.outstanding + n <= cfg.capacity

    def _acquire(self, peer: bytes, rid: int, body: AcquireRollout, t0: float) -> bool:
        if body.n < 1 or body.policy_version < 0:
            raise InvalidRequestError("acquire_rollout needs policy_version >= 0 and n >= 1")
        cap = self.admission.capacity
        if cap is not None and body.n > cap:
            raise InvalidRequestError(
                f"a rollout of {body.n} rows can never fit the capacity of {cap}; acquire "
                "fewer rows at a time or raise the capacity"
            )
        if self._admissible(body.policy_version, body.n):
            self.state.outstanding += body.n
            self._send_ok(peer, rid, None)
            return False
        self._spawn(self._acquire_waiting, peer, rid, body, t0)
        return True

    async def _acquire_waiting(
        self, peer: bytes, rid: int, body: AcquireRollout, t0: float
    ) -> None:
        async def work() -> None:
            await _until(
                lambda: self._admissible(body.policy_version, body.n), self._admission_waiters
            )
            self.state.outstanding += body.n
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
            RecycledRows(
                pid, _meta_reply(st.partitions[pid], rows, list(st.partitions[pid].fields))
            )
            for pid, rows in out.items()
        ]

    async def _get_meta_waiting(
        self,
        peer: bytes,
        rid: int,
        req: GetMeta,
        first: _Attempt | None,
        generation: int,
        t0: float,
    ) -> None:
        pid, task = req.partition_id, req.task_name
        structlog.contextvars.bind_contextvars(rid=rid, op="GetMeta", partition=pid, task=task)

        async def work() -> None:
            attempt: MetaReply | _Attempt | None = first
            look = self._generation != generation
            while True:
                # register before looking, so a wake-up between the two is never missed
                fut = self._register_waiter(pid, task)
                try:
                    if attempt is None and look:
                        attempt = self._attempt(req)
                    if isinstance(attempt, _Attempt):
                        answer = await attempt.result
                        attempt = self._finish(
                            req,
                            attempt.partition,
                            answer,
                            attempt.final,
                            attempt.stale,
                            strict=False,
                        )
                    if isinstance(attempt, MetaReply):
                        self._send_meta(peer, rid, req, attempt)
                        self.metrics.consumer_wait(time.perf_counter() - t0)
                        return
                    if not fut.done():
                        await fut
                finally:
                    self._drop_waiter(pid, task, fut)
                attempt, look = None, True  # something changed: look again

        await self._waiting_request(
            peer,
            rid,
            "GetMeta",
            t0,
            req.timeout,
            lambda: (
                f"get_meta on partition {pid!r} for task {task!r} found fewer than "
                f"{req.batch_size} ready rows within {req.timeout} s; nothing was consumed"
            ),
            work,
        )

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
                on_disconnect=lambda: self._unit_lost(unit_id),
            )
        return conn

    def _unit_lost(self, unit_id: int) -> None:
        """A unit's connection broke: its rows are lost (its memory went with it)."""
        if self.stopping or unit_id in self.state.dead_units:
            return
        self.state.dead_units.add(unit_id)
        lost = {pid: p.lose_unit(unit_id) for pid, p in self.state.partitions.items()}
        log.error(
            "storage unit lost",
            unit=unit_id,
            address=self.state.units.get(unit_id),
            rows_lost={pid: len(rows) for pid, rows in lost.items() if rows},
        )
        self._notify([Wakeup(pid) for pid, rows in lost.items() if rows])

    async def _clear_units(
        self,
        peer: bytes | None,
        rid: int,
        partition_id: str,
        by_unit: Mapping[int, list[int] | None],
    ) -> None:
        """Tell units to free rows; answer ``peer`` (if any) once all have, or with the errors."""
        errors: list[str] = []

        async def clear_one(unit_id: int, rows: list[int] | None) -> None:
            try:
                await self._unit(unit_id).request(
                    StoreClear(partition_id, rows), timeout=self.unit_timeout
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
    """Where a one-message put goes (all rows on one unit), and the wake-ups it owes."""

    partition: Partition
    rows: list[int]
    units: list[int]
    wakeups: list[Wakeup]


def _all_consumed(p: Partition, task: str) -> bool:
    """The partition holds rows and ``task`` consumed every one of them."""
    return p.n_alive > 0 and p.consumed_count.get(task, 0) >= p.n_alive


def _alive_rows(p: Partition) -> list[int]:
    return [r for r in range(p.n_rows) if p.alive[r]]


def _delivery_key(req: GetMeta) -> tuple[str, int, int] | None:
    cfg = req.sampling_config
    if req.mode != "fetch" or not cfg or cfg.get("batch_index") is None:
        return None
    dp_rank = cfg.get("dp_rank") or 0
    return (req.task_name, int(dp_rank), int(cfg["batch_index"]))


def _meta_reply(p: Partition, rows: list[int], fields: Sequence[str]) -> MetaReply:
    tags = p.tags
    versions = {
        f: [fv[r] for r in rows] for f in fields if (fv := p.field_versions.get(f)) is not None
    }
    return MetaReply(
        rows,
        [p.units[r] for r in rows],
        [tags[r] or {} for r in rows],
        list(fields),
        versions=versions,
    )


def _check_result(result: Any) -> SampleResult:
    try:
        sampled, consumed = result
        sampled = [int(r) for r in sampled]
        consumed = [int(r) for r in consumed]
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(
            "a sampler must return (sampled, consumed), two lists of row indexes; "
            f"got {type(result).__name__}"
        ) from exc
    return sampled, consumed


def _validate_get_meta(req: GetMeta) -> None:
    if req.batch_size <= 0:
        raise InvalidRequestError(f"batch_size must be a positive integer, got {req.batch_size}")
    if not req.data_fields:
        raise InvalidRequestError("data_fields must name at least one field")
    if req.mode not in ("fetch", "peek"):
        raise InvalidRequestError(f"mode must be 'fetch' or 'peek', got {req.mode!r}")
    if req.timeout is not None and req.timeout <= 0:
        raise InvalidRequestError(f"timeout must be positive or None, got {req.timeout}")
    if req.lease is not None and req.lease <= 0:
        raise InvalidRequestError(f"lease must be positive seconds or None, got {req.lease}")
    if not req.task_name:
        raise InvalidRequestError("task_name must be a non-empty string")
