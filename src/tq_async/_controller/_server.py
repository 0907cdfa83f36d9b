"""The controller service: a thin async shell around
:class:`~tq_async._core._transitions.ControllerCore`.

The core decides (leases, holds, put leases, recorded and global batches, end-of-stream,
admission, auto-clear, unit liveness) and returns :class:`~tq_async._core._transitions.Effects`;
this shell
decodes requests, sends replies, runs samplers, arms the core's one deadline timer, tells
storage units to free rows, and wakes waiters.

Every request is answered from the reader callback when it can be (status calls, puts, a
get_meta whose sampler finds rows at once). Only requests that must wait become tasks: a
get_meta with too few ready rows, an async sampler, a clear that tells the storage units.

Requests are dispatched through a table of one small handler per message type
(:mod:`tq_async._service._loop` decodes, answers and maps errors); read-only requests are answered
by :mod:`tq_async._controller._queries`, puts by :mod:`tq_async._controller._puts`, and the plumbing
(effects, timer, reply cache, storage-unit links) is :mod:`tq_async._controller._shell`.

A waiting get_meta parks in the :class:`~tq_async._service._parking.ParkingLot` under
``(partition, task)``; the core hands back :class:`~tq_async._core._state.Wakeup` events when
production, consumption, sealing, clearing, an ack or an expiry changes what a task could
receive, and only the matching keys are unparked.
There is no polling: an idle waiter costs one future until data arrives.
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Mapping
from functools import partial
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus

from .._core._state import ControllerState
from .._core._transitions import (
    AdmissionConfig,
    ControllerCore,
    Deadlines,
    Decision,
    Effects,
    SampleCall,
    follower,
    meta_reply,
    record_key,
)
from .._errors import ClosedError, InvalidRequestError, TQError, TQTimeoutError
from .._logging import get_logger
from .._service._loop import DEFERRED, SENT, Handler, Incoming
from .._service._metrics import Metrics
from .._service._parking import ParkingLot
from .._storage._server import StorageServer
from .._transport._dealer import DealerConnection
from .._transport._router import RouterEndpoint
from .._transport._security import CurveServer
from .._wire._columns import positions_by_unit
from .._wire._protocol import (
    AbortPut,
    Ack,
    AcquireRollout,
    Cancel,
    ClearPartition,
    ClearSamples,
    GetMeta,
    Hello,
    HelloReply,
    KVClear,
    KVTag,
    MetaReply,
    Placement,
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
    StoredColumns,
    TakeRecycled,
    UnitInfo,
    WatchNext,
    controller_request_decoder,
    ok_reply,
)
from ..samplers import BaseSampler
from ._puts import ControllerPuts
from ._queries import QUERIES
from ._watch import WatchHub

__all__ = ["AdmissionConfig", "ControllerServer", "Deadlines"]

#: answered fetches a late Cancel can still undo: a client cancels within a round trip of
#: the answer, so this only needs to outlast the fetches answered meanwhile (~100 B each)
_FETCHES_REMEMBERED = 16384

log = get_logger(__name__)


class ControllerServer(ControllerPuts):
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
        super().__init__(metrics or Metrics(None, "controller"), controller_request_decoder)
        self.core = ControllerCore(
            state, sampler, task_samplers=task_samplers, admission=admission, deadlines=deadlines
        )
        self.default_lease = default_lease
        #: seconds after which a get_meta waiting on fields (or a partition) that do not
        #: exist, or on an unsealed partition that got no new rows, logs a warning saying so
        self.waiting_warning_after = self.core.deadlines.waiting_warning_after
        #: unsealed partitions watched for going quiet while a task waits on them
        self._quiet: dict[tuple[str, str], _QuietWatch] = {}
        self.local_units: dict[int, StorageServer] = dict(local_units or {})
        self.curve = curve
        self.lot = ParkingLot()
        self.watch = WatchHub(self)
        #: set while shutting down: units going away then are not "lost"
        self.stopping = False
        self.allow_pickle = allow_pickle
        self.unit_timeout = unit_timeout
        self.unit_suspend_after = self.core.deadlines.unit_suspend_after
        #: what a same-host client compares through the ipc twin (see _router)
        self._instance = secrets.token_bytes(16)
        self._tg: TaskGroup | None = None
        self._pending: dict[tuple[bytes, int], anyio.CancelScope] = {}
        self._replies: OrderedDict[tuple[bytes, int], bytes] = OrderedDict()
        #: recent answered fetches (client, request id) -> what a late Cancel gives back
        self._fetched: OrderedDict[tuple[bytes, int], tuple[Any, ...]] = OrderedDict()
        self._units: dict[int, DealerConnection] = {}
        self._registering: set[int] = set()
        self._unit_instance: dict[int, str] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self.handlers = self._handler_table()

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
            raise ClosedError(
                "the controller is not serving: start it with `await tg.start(server.serve)`"
            )
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
            self._endpoint = RouterEndpoint(bind, self.on_message, curve=self.curve, twin="uds")
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

    def _handler_table(self) -> dict[type, Handler]:
        """One handler per request type (the read-only ones answer from :data:`QUERIES`)."""
        table: dict[type, Handler] = {
            typ: partial(_query, self.core, answer) for typ, answer in QUERIES.items()
        }
        table |= {
            GetMeta: self._on_get_meta,
            PutBegin: self._on_put_begin,
            PutCommit: self._on_put_commit,
            PutInline: self._on_put_inline,
            RenewPut: self._on_renew_put,
            AbortPut: self._on_abort_put,
            Cancel: self._on_cancel,
            Ack: self._on_ack,
            Release: self._on_release,
            Hello: self._on_hello,
            Seal: self._on_seal,
            ResetConsumption: self._on_reset_consumption,
            ClearSamples: self._on_clear_samples,
            ClearPartition: self._on_clear_partition,
            SetTags: self._on_set_tags,
            KVTag: self._on_kv_tag,
            KVClear: self._on_kv_clear,
            RestoreBegin: self._on_restore_begin,
            RestoreCommit: self._on_restore_commit,
            RestoreAbort: self._on_restore_abort,
            RegisterTasks: self._on_register_tasks,
            SetPolicyVersion: self._on_set_policy_version,
            AcquireRollout: self._on_acquire_rollout,
            ReleaseRollout: self._on_release_rollout,
            TakeRecycled: self._on_take_recycled,
            RegisterUnit: self._on_register_unit,
            WatchNext: self.watch.on_watch_next,
        }
        return table

    # ---- consumption -------------------------------------------------------------------------

    def _on_cancel(self, msg: Incoming, body: Cancel) -> Any:
        key = (msg.peer, body.target)
        if self.watch.cancel(key):
            return SENT  # a parked watch: gone
        scope = self._pending.get(key)
        if scope is not None:
            scope.cancel()  # still waiting: it ends without consuming anything
            return SENT  # one-way
        undo = self._fetched.pop(key, None)
        if undo is not None:
            # answered, but the caller gave up before the reply reached it: the rows go
            # back now, before any later request of that client is served (a client-side
            # Release after the late reply arrived could come after its end-of-stream)
            self._apply(self.core.release(*undo))
        return SENT

    def _on_ack(self, msg: Incoming, body: Ack) -> None:
        self._apply(self.core.ack(body.lease_ids, self._now()))

    def _on_release(self, msg: Incoming, body: Release) -> None:
        fx = self.core.release(
            body.partition_id, body.task_name, body.rows, body.incarnation, body.lease_id
        )
        self._apply(fx)

    def _on_seal(self, msg: Incoming, body: Seal) -> None:
        self._apply(self.core.catalog.seal(body.partition_id, create=body.create))

    def _on_reset_consumption(self, msg: Incoming, body: ResetConsumption) -> None:
        self._apply(self.core.reset_consumption(body.partition_id, body.task_name))

    def _on_register_tasks(self, msg: Incoming, body: RegisterTasks) -> None:
        self._apply(self.core.catalog.register_tasks(body.partition_id, body.tasks))

    def _on_hello(self, msg: Incoming, body: Hello) -> HelloReply:
        st = self.state
        infos = [UnitInfo(i, a) for i, a in sorted(st.units.items())]
        ipc = self._endpoint.ipc_address if self._endpoint is not None else None
        return HelloReply(
            infos, self.allow_pickle, st.capacity, st.units_epoch, ipc, self._instance
        )

    # ---- clears, tags, KV --------------------------------------------------------------------

    def _on_clear_samples(self, msg: Incoming, body: ClearSamples) -> Any:
        fx = self.core.clear_rows(body.partition_id, body.rows, body.incarnation)
        return self._clear_then_reply(msg, fx)

    def _on_clear_partition(self, msg: Incoming, body: ClearPartition) -> Any:
        return self._clear_then_reply(msg, self.core.clear_partition(body.partition_id))

    def _on_kv_clear(self, msg: Incoming, body: KVClear) -> Any:
        key_rows = self.state.partition(body.partition_id).rows_for_keys(body.keys)
        return self._clear_then_reply(msg, self.core.clear_rows(body.partition_id, key_rows))

    def _clear_then_reply(self, msg: Incoming, fx: Effects) -> Any:
        """Apply a clear; answer once the storage units freed the rows."""
        (partition_id, incarnation, by_unit), *rest = fx.free
        fx.free = rest
        self._apply(fx)
        self._spawn(self._clear_units, msg.peer, msg.rid, partition_id, by_unit, incarnation)
        return DEFERRED

    def _on_set_tags(self, msg: Incoming, body: SetTags) -> None:
        fx = self.core.catalog.set_tags(body.partition_id, body.rows, body.tags, body.incarnation)
        self._apply(fx)

    def _on_kv_tag(self, msg: Incoming, body: KVTag) -> Placement:
        placement, fx = self.core.catalog.kv_tag(
            body.partition_id, body.keys, body.tags, self._now()
        )
        self._apply(fx)
        return placement

    # ---- checkpoints -------------------------------------------------------------------------

    def _on_restore_begin(self, msg: Incoming, body: RestoreBegin) -> dict[str, list[int]]:
        return self.core.catalog.restore_begin(body.state.partitions)

    def _on_restore_commit(self, msg: Incoming, body: RestoreCommit) -> None:
        samplers = (self.sampler, self.task_samplers)
        fx = self.core.catalog.restore_commit(body.partition_ids, body.sampler_state, samplers)
        self._apply(fx)

    def _on_restore_abort(self, msg: Incoming, body: RestoreAbort) -> None:
        everywhere = self.core.catalog.restore_abort(body.partition_ids)
        for pid in body.partition_ids:
            self._spawn(self._clear_units, None, msg.rid, pid, everywhere)

    # ---- get_meta ----------------------------------------------------------------------------

    def _send_meta(self, peer: bytes, rid: int, req: GetMeta, reply: MetaReply) -> None:
        """Answer a get_meta, with the batches its ``also`` asks for that can be decided now;
        a ``get`` whose cells are small and local gets them too.

        A retried ``get`` is answered without the cells (it reads them from the units).
        """
        scope = self._pending.get((peer, rid)) if self._pending else None
        if scope is not None and scope.cancel_called:
            # the Cancel came while the answer was on its way (the waiting request had
            # already been woken): the caller is gone, so the rows go back, unsent
            self._apply(self.core.cancel(req, reply))
            return
        if reply.rows and req.mode == "fetch" and record_key(req) is None:
            self._remember_fetch(peer, rid, req, reply)
        answers = [(req, reply), *self._also(req, reply)] if req.also else [(req, reply)]
        epoch = self.state.units_epoch
        for _, r in answers:
            r.units_epoch = epoch
        if len(answers) > 1:
            reply.more = [r for _, r in answers[1:]]
        inline: list[tuple[MetaReply, list[StoredColumns]]] = []
        frames: list[Any] = []
        budget = req.inline_bytes
        for sub, r in answers:
            got = self._read_inline(sub, r, budget) if budget > 0 and r.rows else None
            if got is not None:
                inline.append((r, got[0]))
                frames += got[1]
                budget -= got[2]
        if not inline:
            self.send_ok(peer, rid, reply)
            return
        without = ok_reply(rid, reply)
        for r, parts in inline:
            r.inline = parts
        self.send(peer, rid, ok_reply(rid, reply), frames)
        self._remember(peer, rid, without)  # the cache keeps no cells alive

    def _also(self, req: GetMeta, first: MetaReply) -> list[tuple[GetMeta, MetaReply]]:
        """The batches ``req.also`` names that can be decided now, in order: up to the first
        that cannot (or that ends the stream, fails, or needs an ``async`` sampler's answer)."""
        out: list[tuple[GetMeta, MetaReply]] = []
        if first.end_of_stream or req.also is None:
            return out
        after = int((req.sampling_config or {})["batch_index"])  # checked: also needs it
        for index in req.also:
            sub = follower(req, index, after)
            try:
                decision, running = self._settle(sub, self.core.look(sub, self._now()))
            except Exception as exc:  # raised again when that batch is asked for itself
                log.debug("a batch asked for with also= failed", batch_index=index, error=repr(exc))
                break
            if running is not None:  # nothing is decided until it is awaited: left undone
                close = getattr(running[1], "close", None)
                if close is not None:
                    close()
                break
            if not isinstance(decision, MetaReply) or decision.end_of_stream:
                break
            out.append((sub, decision))
            after = index
        return out

    def _remember_fetch(self, peer: bytes, rid: int, req: GetMeta, reply: MetaReply) -> None:
        """What a Cancel of this answered fetch undoes (the last ``_REPLY_CACHE`` fetches)."""
        fetched = self._fetched
        fetched[(peer, rid)] = _undo_of(req, reply)
        if len(fetched) > _FETCHES_REMEMBERED:
            fetched.popitem(last=False)

    def _read_inline(
        self, req: GetMeta, reply: MetaReply, budget: int
    ) -> tuple[list[StoredColumns], list[Any], int] | None:
        """The reply's cells from units in this process and their size in bytes, or None
        (remote units, more than ``budget`` bytes)."""
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
                    req.partition_id, rows, reply.fields, budget - size
                )
            except TQError:
                return None  # let the client's own read report it
            if got is None:
                return None  # too big: the client reads from the units
            stored, part = got
            # the frames are what travels (object columns are sized only once encoded)
            size += sum(memoryview(f).nbytes for f in part)
            if size > budget:
                return None
            parts.append(stored)
            frames.extend(part)
        return parts, frames, size

    def _on_get_meta(self, msg: Incoming, req: GetMeta) -> Any:
        if req.lease is None and self.default_lease is not None:
            req.lease = self.default_lease
        decision, fx = self.core.get_meta(req, self._now())
        self._apply(fx)
        decision, running = self._settle(req, decision)
        if running is not None:
            self._spawn_waiting(msg, self._get_meta_waiting, msg, req, running, self.lot.generation)
            return DEFERRED
        if isinstance(decision, MetaReply):
            self._send_meta(msg.peer, msg.rid, req, decision)
            return SENT
        if req.timeout == 0:  # answer now or not at all
            self.send_error(
                msg.peer, msg.rid, TQTimeoutError(self._get_meta_timeout(req)), "GetMeta"
            )
            return SENT
        self._spawn_waiting(msg, self._get_meta_waiting, msg, req, None, self.lot.generation)
        if _why_waiting(self.state, req) is not None:  # a typo would wait silently forever
            asyncio.get_running_loop().call_later(
                self.waiting_warning_after, self._warn_if_still_waiting, msg.peer, msg.rid, req
            )
        elif (req.partition_id, req.task_name) not in self._quiet:
            # a forgotten seal would too: one watch per (partition, task) with waiters
            self._watch_quiet(_QuietWatch(req, _progress(self.state, req)))
        return DEFERRED

    def _settle(
        self, req: GetMeta, decision: Decision
    ) -> tuple[Decision, tuple[SampleCall, Awaitable[Any]] | None]:
        """Run the sampler calls ``decision`` leads to (one per batch a ``record_from`` decides
        first, then the asked batch's) until a reply, a wait (None), or an ``async`` sampler's
        call, returned with its awaitable to be awaited."""
        while isinstance(decision, SampleCall):
            result = decision.run()
            if inspect.isawaitable(result):
                return None, (decision, result)
            decision, fx = self.core.sampled(req, decision, result, self._now())
            self._apply(fx)
        return decision, None

    def _watch_quiet(self, watch: _QuietWatch) -> None:
        key = (watch.req.partition_id, watch.req.task_name)
        self._quiet[key] = watch
        asyncio.get_running_loop().call_later(self.waiting_warning_after, self._check_quiet, key)

    def _check_quiet(self, key: tuple[str, str]) -> None:
        """Warn once if the task still waits on an unsealed partition that made no progress."""
        watch = self._quiet.pop(key)
        p = self.state.partitions.get(key[0])
        if self.stopping or not self.lot.parked(key) or p is None or p.sealed:
            return  # nobody waits (or a new watch starts with the next waiter), or sealed
        progress = _progress(self.state, watch.req)
        if progress != watch.progress:
            self._watch_quiet(_QuietWatch(watch.req, progress))
            return
        if not watch.warned:
            pid, task = key
            consumed = p.consumed_count.get(task, 0)
            log.warning(
                f"get_meta for task {task!r} has waited {self.waiting_warning_after:g} s on "
                f"partition {pid!r}, which is not sealed and got no new rows in that time "
                f"(the task consumed {consumed} of its {p.n_alive} rows); if no more rows will "
                f"come, seal it (client.seal({pid!r})) so that drained consumers see "
                "end-of-stream, or bound the wait with get_meta(..., timeout=...) or "
                "stop_when_consumed=True",
                partition=pid,
                task=task,
                consumed=consumed,
                rows=p.n_alive,
            )
        self._watch_quiet(_QuietWatch(watch.req, progress, warned=True))

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
        msg: Incoming,
        req: GetMeta,
        first: tuple[SampleCall, Awaitable[Any]] | None,
        generation: int,
    ) -> None:
        peer, rid, t0 = msg.peer, msg.rid, msg.t0
        pid, task = req.partition_id, req.task_name
        structlog.contextvars.bind_contextvars(rid=rid, op="GetMeta", partition=pid, task=task)
        core = self.core

        async def work() -> None:
            running = first
            look = self.lot.generation != generation
            while True:
                # a ticket before looking, so a wake-up between the two is never missed
                with self.lot.ticket((pid, task)) as fut:
                    decision: Decision = None
                    if running is None and look:
                        decision, running = self._settle(req, core.look(req, self._now()))
                    while running is not None:
                        call, pending = running
                        answer = await pending
                        decision, fx = core.sampled(req, call, answer, self._now(), strict=False)
                        self._apply(fx)
                        decision, running = self._settle(req, decision)
                    if isinstance(decision, MetaReply):
                        self._send_meta(peer, rid, req, decision)
                        self.metrics.consumer_wait(time.perf_counter() - t0)
                        return
                    if req.timeout == 0:  # a sampler's answer was awaited, rows are not
                        raise TimeoutError
                    if not fut.done():
                        await fut
                look = True  # something changed: look again

        await self._waiting_request(
            peer, rid, "GetMeta", t0, req.timeout or None, lambda: self._get_meta_timeout(req), work
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

    # ---- admission ---------------------------------------------------------------------------

    def _on_set_policy_version(self, msg: Incoming, body: SetPolicyVersion) -> None:
        self._apply(self.core.set_policy_version(body.version))

    def _on_acquire_rollout(self, msg: Incoming, body: AcquireRollout) -> Any:
        if self.core.acquire(body.policy_version, body.n):
            return None
        self._spawn_waiting(msg, self._acquire_waiting, msg.peer, msg.rid, body, msg.t0)
        return DEFERRED

    def _on_release_rollout(self, msg: Incoming, body: ReleaseRollout) -> None:
        if body.n < 0:
            raise InvalidRequestError(f"release_rollout needs n >= 0, got {body.n}")
        self._apply(Effects(admission=self.core.free_slots(body.n)))

    def _on_take_recycled(self, msg: Incoming, body: TakeRecycled) -> list[RecycledRows]:
        if body.max_rows < 1:
            raise InvalidRequestError(f"max_rows must be >= 1, got {body.max_rows}")
        return self._take_recycled(body.max_rows)

    async def _acquire_waiting(
        self, peer: bytes, rid: int, body: AcquireRollout, t0: float
    ) -> None:
        async def work() -> None:
            await self.lot.until(
                "admission", lambda: self.core.acquire(body.policy_version, body.n)
            )
            self.send_ok(peer, rid, None)

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
        out = self.core.catalog.take_recycled(max_rows)
        st = self.state
        return [
            RecycledRows(pid, meta_reply(st.partitions[pid], rows, list(st.partitions[pid].fields)))
            for pid, rows in out.items()
        ]


class _QuietWatch:
    """A task waits on an unsealed partition: what it looked like when the watch started."""

    __slots__ = ("progress", "req", "warned")

    def __init__(self, req: GetMeta, progress: tuple[Any, ...], *, warned: bool = False) -> None:
        self.req = req
        self.progress = progress
        #: warned about this stretch of quiet already (once per stretch)
        self.warned = warned


def _progress(state: ControllerState, req: GetMeta) -> tuple[Any, ...]:
    """What changes when a partition gets rows (or fields of rows) or the task consumes.

    Counting produced cells is linear in the rows, but runs once per watch period.
    """
    p = state.partitions.get(req.partition_id)
    if p is None:
        return ()
    produced = tuple(
        p.fields[f].produced.count(1) if f in p.fields else -1 for f in req.data_fields
    )
    return (
        p.incarnation,
        p.n_rows,
        p.n_alive,
        p.consumed_count.get(req.task_name, 0),
        len(p.put_leases),
        produced,
    )


def _undo_of(req: GetMeta, reply: MetaReply) -> tuple[Any, ...]:
    """The arguments of :meth:`ControllerCore.release` that undo a fetch's answer.

    Only atomic values (the rows as a tuple, not the reply's list): the garbage collector
    stops tracking such a tuple, and 16,384 remembered fetches tracked cost the control
    plane ~10 % of its calls in full collections (W2, 4 clients in one process).
    """
    return (req.partition_id, req.task_name, tuple(reply.rows), reply.incarnation, reply.lease_id)


def _query(core: ControllerCore, answer: Any, msg: Incoming, body: Any) -> Any:
    return answer(core, body)


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
        f"{sorted(p.fields)}); check the field names, and that the task that writes them "
        "is running (it may have failed)"
    )
