"""The controller's transitions: a pure state machine over :class:`ControllerState`.

No event loop, no sockets, no clock. Every transition takes the request (and ``now``, seconds
on any monotonic clock) and returns what the I/O shell still has to do, as
:class:`Effects`: waiters to wake, rows to free on storage units, capacity and admission
slots freed. Deadlines (leases, put leases, suspended units) live in one heap here; the
shell arms a single timer for :meth:`ControllerCore.next_deadline` and calls
:meth:`ControllerCore.advance` when it fires. Running a sampler is an effect too, because a
sampler may be ``async def``: :meth:`ControllerCore.get_meta` returns a :class:`SampleCall`,
the shell runs it (awaiting it if need be) and feeds the answer to
:meth:`ControllerCore.sampled`. This is the shape of httpcore's connection pool: pure code
changes state and hands back the I/O left to do, so each guarantee is tested without a loop
(``tests/test_core.py``).

The words, used everywhere:

* **recorded batch**: the rows delivered under ``(task, dp_rank, batch_index)``; every later
  read of that key (a replica, a replay, a restarted consumer) gets the same rows.
* **lease**: delivered rows that stay consumed only once acknowledged before a deadline. A
  lease belongs to its recorded batch, not to the caller: replays share it and an ack from any
  reader settles it. At expiry, rows of a recorded batch wait for the next reader of that key;
  rows leased without a ``batch_index`` go back to the task's pool.
* **hold**: a lease without a deadline; it keeps auto-clear away until acknowledged and never
  blocks end-of-stream.
* **put lease**: the new rows of a put not yet committed. Renewed by the producer while it
  writes; when it lapses (a dead producer) the rows are reclaimed, never visible.
* **global batch**: with ``dp_size`` in ``sampling_config`` batch ``b`` of a task is decided
  for every DP rank at once, so every rank gets the same number of batches.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
from collections.abc import Awaitable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from .._errors import InvalidRequestError, TQError
from .._logging import get_logger
from .._wire._protocol import GetMeta, MetaReply, Placement
from ..samplers import BaseSampler, SequentialSampler, StaleRows
from ._admission import Admission
from ._catalog import Catalog
from ._effects import AdmissionConfig, Deadlines, Effects
from ._liveness import UnitLiveness
from ._put_leases import PutLeases
from ._state import (
    ControllerState,
    Lease,
    Partition,
    ReadyView,
    RecordKey,
    RowOrigin,
    RowTags,
    RowVersions,
    Wakeup,
)

__all__ = [
    "TAILS",
    "AdmissionConfig",
    "ControllerCore",
    "Deadlines",
    "Decision",
    "Effects",
    "SampleCall",
]

log = get_logger(__name__)

#: what a final global batch that cannot be split evenly does (see :class:`ControllerCore`)
TAILS = ("uneven", "drop", "error")


@dataclass(slots=True, eq=False)
class SampleCall:
    """An effect: run the sampler on these ready rows, then feed the answer back.

    ``dp_size`` is set for a global batch (:meth:`BaseSampler.sample_shares`, or
    :meth:`BaseSampler.sample` for ``batch_size * dp_size`` rows).
    """

    partition: Partition
    sampler: BaseSampler
    ready: ReadyView
    batch_size: int
    ctx: dict[str, Any]
    final: bool
    stale: StaleRows
    dp_size: int | None = None
    #: the recorded batch the answer goes to (None: not recorded)
    key: RecordKey | None = None
    #: the sampler answered through ``sample_shares``
    shares: bool = False
    #: a batch below the asked one, decided first (``record_from``): this request for it
    earlier: GetMeta | None = None

    def run(self) -> Any:
        """Call the sampler: its answer, or an awaitable of it.

        An exception the sampler raises (``ValueError``, ...) reaches the caller as
        :class:`InvalidRequestError` naming the sampler, without a server traceback.
        """
        try:
            result = self._call()
        except TQError:
            raise
        except Exception as exc:
            raise sampler_error(self.sampler, exc) from None
        if inspect.isawaitable(result):
            return _Mapped(self.sampler, result)
        return result

    def _call(self) -> Any:
        if self.dp_size is not None:
            shares = getattr(self.sampler, "sample_shares", None)
            ctx = {k: v for k, v in self.ctx.items() if k != "dp_size"}
            answer = (
                None if shares is None else shares(self.ready, self.batch_size, self.dp_size, **ctx)
            )
            if answer is not None:
                self.shares = True
                return answer
            return self.sampler.sample(self.ready, self.batch_size * self.dp_size, **self.ctx)
        return self.sampler.sample(self.ready, self.batch_size, **self.ctx)


#: what get_meta can come to: a reply, "run the sampler", or None (wait for a wake-up)
Decision = MetaReply | SampleCall | None


class ControllerCore:
    """Every transition of the controller; see the module docstring.

    Args:
        state: the partitions, units and counters.
        sampler: the default sampler.
        task_samplers: samplers for particular tasks.
        admission: bounds for ``acquire_rollout``.
        deadlines: put-lease and unit-liveness deadlines (:class:`Deadlines`).
    """

    def __init__(
        self,
        state: ControllerState | None = None,
        sampler: BaseSampler | None = None,
        *,
        task_samplers: Mapping[str, BaseSampler] | None = None,
        admission: AdmissionConfig | None = None,
        deadlines: Deadlines | None = None,
    ) -> None:
        self.deadlines = deadlines or Deadlines()
        self.put_lease = self.deadlines.put_lease
        self.unit_lost_after = self.deadlines.unit_lost_after
        self.state = state or ControllerState()
        self.sampler: BaseSampler = sampler if sampler is not None else SequentialSampler()
        self.task_samplers: dict[str, BaseSampler] = dict(task_samplers or {})
        self.admission = admission or AdmissionConfig()
        #: per sampler: the keywords its ``sample`` takes, its DP size hint and tail policy
        self._kwargs = {id(smp): _accepted_kwargs(smp) for smp in self.samplers()}
        self._hints = {
            id(smp): (getattr(smp, "dp_size_hint", None), getattr(smp, "tail_policy", None))
            for smp in self.samplers()
        }
        self._ids = itertools.count(1)
        #: lease id -> the partition holding it (gone with the partition)
        self._lease_home: dict[int, Partition] = {}
        #: lease id of a recorded batch -> its partition, also after the lease ended
        self._batch_home: dict[int, Partition] = {}
        #: (deadline, seq, kind, id); stale entries are skipped when popped
        self._timers: list[tuple[float, int, str, int]] = []
        self.puts = PutLeases(self.state, self.put_lease, self._ids, self._arm, self._clear)
        #: seal, auto-clear tasks, tags, room for puts, restores, recycled rows
        self.catalog = Catalog(self.state, self.puts)
        self.rollouts = Admission(self.state, self.admission)
        self.liveness = UnitLiveness(self.state, self.unit_lost_after, self._arm)
        #: number of sampler invocations (tests use it to prove waiting is event-driven)
        self.sampler_calls = 0

    # ---- samplers ----------------------------------------------------------------------------

    def samplers(self) -> list[BaseSampler]:
        """Every sampler, default first."""
        return [self.sampler, *self.task_samplers.values()]

    def sampler_for(self, task: str) -> BaseSampler:
        return self.task_samplers.get(task, self.sampler)

    # ---- deadlines ---------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When :meth:`advance` has something to do next (None: nothing is pending)."""
        timers = self._timers
        while timers and not self._live(*timers[0]):
            heapq.heappop(timers)  # acknowledged, committed, renewed or resumed meanwhile
        return timers[0][0] if timers else None

    def _live(self, deadline: float, _seq: int, kind: str, ident: int) -> bool:
        """Whether a heap entry still stands for a deadline."""
        if kind == "lease":
            p = self._lease_home.get(ident)
            return p is not None and p.leases[ident].deadline == deadline
        if kind == "put":
            return self.puts.live(ident, deadline)
        return self.state.suspended.get(ident) == deadline

    def _arm(self, deadline: float, kind: str, ident: int) -> None:
        heapq.heappush(self._timers, (deadline, next(self._ids), kind, ident))

    def advance(self, now: float) -> Effects:
        """Expire every lease, put lease and suspended unit whose deadline is ``<= now``."""
        fx = Effects()
        timers = self._timers
        while timers and timers[0][0] <= now:
            deadline, _, kind, ident = heapq.heappop(timers)
            if kind == "lease":
                self._expire_lease(ident, deadline, fx)
            elif kind == "put":
                self.puts.lapse(ident, deadline, fx)
            else:
                self.liveness.on_deadline(ident, deadline, fx)
        return fx

    # ---- get_meta ----------------------------------------------------------------------------

    def get_meta(self, req: GetMeta, now: float) -> tuple[Decision, Effects]:
        """Start a get_meta: a reply, a sampler call to run, or None (wait for a wake-up).

        ``req.ack`` is applied first. Raises :class:`InvalidRequestError` for a request
        that can never be served as asked.
        """
        fx = self.ack(req.ack, now) if req.ack else Effects()
        return self.look(req, now), fx

    def look(self, req: GetMeta, now: float) -> Decision:
        """Look again after a wake-up (nothing changes unless a recorded batch is re-read)."""
        p = self.state.partitions.get(req.partition_id)
        if p is None:
            return None
        dp_size = self._dp_size(req)
        key = record_key(req)
        if dp_size is not None and key is None:
            raise InvalidRequestError(
                "a global batch (dp_size) needs sampling_config with dp_rank and batch_index"
            )
        if key is not None:
            recorded = self._recorded(req, p, key, now)
            if recorded is not None:
                return recorded
            earlier = _first_undecided(req, p, key)
            if earlier is not None:
                # record_from: batches below this one are decided first, lowest first
                call = self._sample(earlier, p, dp_size)
                call.key, call.earlier = record_key(earlier), earlier
                return call
        call = self._sample(req, p, dp_size)
        call.key = key
        return call

    def _sample(self, req: GetMeta, p: Partition, dp_size: int | None) -> SampleCall:
        """The sampler call for ``req`` on the rows ready for it now."""
        rs = p.ready_set(req.task_name, req.data_fields)
        return self._call(req, p, ReadyView(rs.rows), p.is_final(req.task_name, rs), dp_size)

    def _dp_size(self, req: GetMeta) -> int | None:
        cfg = req.sampling_config
        if cfg is None:
            return None
        dp_size = cfg.get("dp_size")
        if dp_size is None:
            dp_size = self._hints[id(self.sampler_for(req.task_name))][0]
            if dp_size is None or cfg.get("batch_index") is None:
                return None
        if req.mode != "fetch":
            return None
        if not isinstance(dp_size, int) or isinstance(dp_size, bool) or dp_size < 1:
            raise InvalidRequestError(f"sampling_config dp_size must be an int >= 1: {dp_size!r}")
        rank = cfg.get("dp_rank") or 0
        if not isinstance(rank, int) or not 0 <= rank < dp_size:
            raise InvalidRequestError(
                f"sampling_config dp_rank {rank!r} is out of range for dp_size={dp_size}"
            )
        return dp_size

    def _call(
        self, req: GetMeta, p: Partition, ready: ReadyView, final: bool, dp_size: int | None
    ) -> SampleCall:
        cfg = req.sampling_config or {}
        if "record_from" in cfg:  # the controller's, not the sampler's
            cfg = {k: v for k, v in cfg.items() if k != "record_from"}
        sampler = self.sampler_for(req.task_name)
        ctx: dict[str, Any] = {
            "partition_id": req.partition_id,
            "task_name": req.task_name,
            "data_fields": list(req.data_fields),
            "dp_rank": None if dp_size is not None else cfg.get("dp_rank"),
            "batch_index": cfg.get("batch_index"),
            "sampling_config": cfg,
            "tags": RowTags(p),
            "origin": RowOrigin(p),
            "final": final,
            "replays_served": req.mode == "fetch" and cfg.get("batch_index") is not None,
            "policy_version": self.state.learner_version,
            "versions": RowVersions(p),
            "stale": StaleRows(),
            "tail": self._tail(req, sampler),
        }
        if cfg:
            # sampling_config entries also arrive as keywords (TransferQueue passes them so,
            # e.g. priority_scores); the controller's own context wins on a name clash
            ctx = {str(k): v for k, v in cfg.items()} | ctx
        stale = ctx["stale"]
        accepted = self._kwargs.get(id(sampler))
        if accepted is not None:
            ctx = {k: v for k, v in ctx.items() if k in accepted}
        self.sampler_calls += 1
        return SampleCall(p, sampler, ready, req.batch_size, ctx, final, stale, dp_size)

    def _tail(self, req: GetMeta, sampler: BaseSampler) -> str:
        cfg = req.sampling_config
        tail = (cfg.get("tail") if cfg else None) or self._hints[id(sampler)][1] or "uneven"
        if tail not in TAILS:
            raise InvalidRequestError(f"sampling_config tail must be one of {TAILS}: {tail!r}")
        return str(tail)

    def sampled(
        self, req: GetMeta, call: SampleCall, result: Any, now: float, *, strict: bool = True
    ) -> tuple[Decision, Effects]:
        """Apply a sampler's answer: a reply, or None (nothing yet: wait).

        With ``strict=False`` (the answer of an async sampler, computed while the state
        could move) an answer that no longer fits is dropped and None returned, so the
        shell samples again.

        The answer for a batch below the asked one (``record_from``) records that batch and
        comes to what :meth:`look` says next: the next such batch's sampler call, or the
        asked batch's; its end of stream is the asked batch's too.
        """
        earlier = call.earlier
        if earlier is None:
            return self._apply_sample(req, call, result, now, strict)
        decision, fx = self._apply_sample(earlier, call, result, now, strict)
        if isinstance(decision, MetaReply) and not decision.end_of_stream:
            return self.look(req, now), fx
        return decision, fx

    def _apply_sample(
        self, req: GetMeta, call: SampleCall, result: Any, now: float, strict: bool
    ) -> tuple[Decision, Effects]:
        fx = Effects()
        p = call.partition
        if self.state.partitions.get(req.partition_id) is not p:
            return None, fx  # cleared while an async sampler ran
        key = call.key
        if key is not None:
            recorded = self._recorded(req, p, key, now)
            if recorded is not None:
                return recorded, fx  # a replica decided the batch meanwhile
        try:
            if call.dp_size is None:
                sampled, consumed = check_result(result)
                shares = [sampled]
            else:
                shares, consumed = self._global_shares(req, call, result)
            final = call.final
            if call.stale and req.mode == "fetch":
                self._apply_stale(req, p, call.stale, fx)
                final = p.is_final(req.task_name, p.ready_set(req.task_name, req.data_fields))
            delivered = [r for share in shares for r in share]
            check_sampled(req, p, delivered)
            if call.stale.kept_rows and req.mode == "fetch":
                self.rollouts.count_kept(req, call.stale, delivered, fx)
            if req.mode == "fetch" and consumed:
                p.check_rows(consumed)
                p.consume(req.task_name, consumed)
                count_dropped(req, p, consumed, delivered)
                self._after_consume(req.task_name, p, consumed, delivered, fx)
        except TQError:
            if strict:
                raise
            return None, fx  # the state moved while an async sampler ran: sample again
        if not delivered:
            if consumed:
                final = p.is_final(req.task_name, p.ready_set(req.task_name, req.data_fields))
            if final or (req.stop_when_consumed and all_consumed(p, req.task_name)):
                return MetaReply([], [], [], list(req.data_fields), end_of_stream=True), fx
            return None, fx
        if key is None:
            reply = meta_reply(p, shares[0], req.data_fields)
            if req.mode == "fetch" and self._holding(req, p):
                reply.lease_id = self._new_lease(p, req, tuple(shares[0]), None, now)
            return reply, fx
        task, _, index = key
        if call.dp_size is None:
            p.recorded[key] = tuple(shares[0])
        else:
            for r, share in enumerate(shares):
                p.recorded[(task, r, index)] = tuple(share)
        recorded = self._recorded(req, p, key, now)
        assert recorded is not None
        return recorded, fx

    def _global_shares(
        self, req: GetMeta, call: SampleCall, result: Any
    ) -> tuple[list[list[int]], list[int]]:
        """The ``dp_size`` shares of a global batch, after the tail policy."""
        assert call.dp_size is not None
        dp_size, group = call.dp_size, int(getattr(call.sampler, "group_size", 1))
        if call.shares:
            shares, consumed = check_shares(result, dp_size)
        else:
            sampled, consumed = check_result(result)
            shares = split_even(sampled, dp_size, group)
        lengths = {len(s) for s in shares}
        if len(lengths) <= 1:
            return shares, consumed
        tail = str(call.ctx.get("tail") or self._tail(req, call.sampler))
        if tail == "error":
            raise InvalidRequestError(
                f"the last global batch of partition {req.partition_id!r} for task "
                f"{req.task_name!r} has {sum(map(len, shares))} rows, which do not split evenly "
                f"over dp_size={dp_size} (shares of {sorted(lengths)} rows); put a multiple of "
                "dp_size x batch_size rows, or ask with tail='uneven' or 'drop'"
            )
        if tail == "drop":
            keep = min(lengths)
            dropped = sum(len(s) - keep for s in shares)
            log.warning(
                "dropping the uneven tail of a global batch",
                partition=req.partition_id,
                task=req.task_name,
                rows=dropped,
                dp_size=dp_size,
            )
            shares = [s[:keep] for s in shares]
        return shares, consumed

    # ---- recorded batches and leases ---------------------------------------------------------

    def _holding(self, req: GetMeta, p: Partition) -> bool:
        """Whether delivered rows are held until acknowledged (a lease, or auto-clear)."""
        return req.lease is not None or self.state.auto_clears(p, req.task_name)

    def _recorded(self, req: GetMeta, p: Partition, key: RecordKey, now: float) -> MetaReply | None:
        """The recorded batch ``key``, with its lease; None if it was never decided."""
        rows = p.recorded.get(key)
        if rows is None:
            return None
        reply = meta_reply(p, list(rows), req.data_fields)
        if req.mode != "fetch" or not rows:
            return reply
        lease_id = p.batch_leases.get(key)
        if lease_id is not None:  # the batch's lease: shared, and taken over by a new reader
            lease = p.leases[lease_id]
            if req.lease is not None:
                deadline = now + req.lease
                if lease.deadline is None:
                    lease.deadline = deadline
                    p.open_leases[lease.task] = p.open_leases.get(lease.task, 0) + 1
                    self._arm(deadline, "lease", lease_id)
                elif deadline > lease.deadline:
                    lease.deadline = deadline
                    self._arm(deadline, "lease", lease_id)
            reply.lease_id = lease_id
        elif key not in p.settled and self._holding(req, p):
            reply.lease_id = self._new_lease(p, req, rows, key, now)
        return reply

    def _new_lease(
        self,
        p: Partition,
        req: GetMeta,
        rows: tuple[int, ...],
        key: RecordKey | None,
        now: float,
    ) -> int:
        lease_id = next(self._ids)
        deadline = None if req.lease is None else now + req.lease
        p.leases[lease_id] = Lease(lease_id, req.task_name, rows, key, deadline)
        self._lease_home[lease_id] = p
        if key is not None:
            p.batch_leases[key] = lease_id
            p.lease_batch[lease_id] = key
            self._batch_home[lease_id] = p
        if deadline is not None:
            p.open_leases[req.task_name] = p.open_leases.get(req.task_name, 0) + 1
            self._arm(deadline, "lease", lease_id)
        held = p.held
        for r in rows:
            held[r] = held.get(r, 0) + 1
        self.state.events.lease(p.partition_id, req.task_name, lease_id, rows, req.lease)
        return lease_id

    def _drop_lease(self, p: Partition, lease: Lease, *, acked: bool = False) -> None:
        del p.leases[lease.lease_id]
        self.state.events.lease_ended(p.partition_id, lease.task, lease.lease_id, acked=acked)
        self._lease_home.pop(lease.lease_id, None)
        if lease.key is not None and p.batch_leases.get(lease.key) == lease.lease_id:
            del p.batch_leases[lease.key]
        if lease.deadline is not None:
            p.open_leases[lease.task] -= 1
            if not p.open_leases[lease.task]:
                del p.open_leases[lease.task]
        held = p.held
        for r in lease.rows:
            n = held.get(r, 0) - 1
            if n > 0:
                held[r] = n
            else:
                held.pop(r, None)

    def ack(self, lease_ids: Sequence[int], now: float) -> Effects:
        """Acknowledge leases and holds: their rows stay consumed for good.

        An ack of a recorded batch settles it for every reader. Unknown ids (already
        acknowledged, expired, or of a cleared partition) are ignored: acks are idempotent.
        """
        fx = Effects()
        for lease_id in lease_ids:
            p = self._lease_home.get(lease_id)
            if p is None:
                fx.add(self._late_ack(lease_id))
                continue
            lease = p.leases[lease_id]
            self._drop_lease(p, lease, acked=True)
            if lease.key is not None:
                p.settled.add(lease.key)
            if lease.deadline is not None:
                fx.wakeups.append(Wakeup(p.partition_id, lease.task))  # end-of-stream may be due
            self._auto_clear(p, lease.rows, fx)
        return fx

    def _late_ack(self, lease_id: int) -> Effects:
        """An ack of an expired (or replaced) lease of a recorded batch still settles it.

        Its rows never left the batch, so the consumer's work stands. An expired lease
        without a batch is ignored: its rows went back to the pool (at-least-once).
        """
        p = self._batch_home.get(lease_id)
        if p is None or self.state.partitions.get(p.partition_id) is not p:
            return Effects()
        key = p.lease_batch[lease_id]
        if key in p.settled or key not in p.recorded:
            return Effects()
        live = p.batch_leases.get(key)
        if live is not None:
            return self.ack([live], 0.0)  # the batch's current lease, settled for everyone
        p.settled.add(key)
        fx = Effects()
        self._auto_clear(p, p.recorded[key], fx)
        return fx

    def _expire_lease(self, lease_id: int, deadline: float, fx: Effects) -> None:
        p = self._lease_home.get(lease_id)
        if p is None:
            return
        lease = p.leases[lease_id]
        if lease.deadline != deadline:
            return  # renewed (a stale heap entry)
        self._drop_lease(p, lease)
        if lease.key is not None:
            # the rows stay recorded and consumed: the next reader of the batch gets them
            log.info(
                "lease expired: the batch waits for its next reader",
                partition=p.partition_id,
                task=lease.task,
                batch=lease.key,
                rows=len(lease.rows),
            )
        elif p.release(lease.task, lease.rows):
            log.info(
                "lease expired: rows go back to the task",
                partition=p.partition_id,
                task=lease.task,
                rows=len(lease.rows),
            )
        fx.wakeups.append(Wakeup(p.partition_id, lease.task))

    def cancel(self, req: GetMeta, reply: MetaReply) -> Effects:
        """The caller of ``req`` gave up before it saw ``reply``: undo the answer (see
        :meth:`release`). A recorded batch keeps its rows for its key; a peek took nothing."""
        if req.mode != "fetch" or not reply.rows or record_key(req) is not None:
            return Effects()
        rows, incarnation, lease_id = reply.rows, reply.incarnation, reply.lease_id
        return self.release(req.partition_id, req.task_name, rows, incarnation, lease_id)

    def release(
        self,
        partition_id: str,
        task: str,
        rows: Sequence[int],
        incarnation: str | None = None,
        lease_id: int = 0,
    ) -> Effects:
        """A cancelled fetch gives rows back: ready again for ``task`` (unless recorded).

        This is the ``cancel`` transition of a fetch whose caller never saw its reply
        (:meth:`cancel` for a request still waiting): its lease or hold (``lease_id``) is
        dropped, not acknowledged — an expiry must not give the rows back a second time,
        and a hold's rows are not auto-cleared — and its rows are ready for ``task`` again.
        Rows of a recorded batch stay with the batch (its next reader gets them), and so
        does its lease.
        """
        fx = Effects()
        p = self.state.partition(partition_id)
        p.check_incarnation(incarnation)
        lease = p.leases.get(lease_id) if lease_id else None
        if lease is not None and lease.key is None and lease.task == task:
            self._drop_lease(p, lease)
            if lease.deadline is not None:
                fx.wakeups.append(Wakeup(partition_id, task))  # end-of-stream may be due
        recorded = {r for batch in p.recorded.values() for r in batch} if p.recorded else ()
        back = [r for r in rows if r not in recorded]
        if back and p.release(task, back):
            fx.wakeups.append(Wakeup(partition_id, task))
        return fx

    # ---- production --------------------------------------------------------------------------

    # ---- puts (see _put_leases) -------------------------------------------------------------

    def put_begin(
        self,
        partition_id: str,
        headers: Sequence[Any],
        n_rows: int,
        rows: Sequence[int] | None,
        keys: Sequence[str] | None,
        now: float,
        *,
        lease: bool = True,
    ) -> tuple[Placement, Effects]:
        """Place a put; new rows wait under a put lease (see :meth:`PutLeases.begin`)."""
        return self.puts.begin(partition_id, headers, n_rows, rows, keys, now, lease=lease)

    def abort_puts(self, put_ids: Sequence[int]) -> Effects:
        """A producer gave up puts before committing: their new rows are reclaimed now."""
        return self.puts.abort(put_ids)

    def renew_puts(self, put_ids: Sequence[int], now: float) -> None:
        """The producer is alive and still writing: push the put leases' deadlines."""
        self.puts.renew(put_ids, now)

    def put_commit(
        self,
        partition_id: str,
        rows: Sequence[int],
        fields: Sequence[str],
        tags: Sequence[Any] | None,
        versions: Sequence[int] | None,
        put_id: int = 0,
        incarnation: str | None = None,
    ) -> Effects:
        """Make a put visible (see :meth:`PutLeases.commit`)."""
        return self.puts.commit(partition_id, rows, fields, tags, versions, put_id, incarnation)

    # ---- clearing ----------------------------------------------------------------------------

    def clear_rows(
        self, partition_id: str, rows: Sequence[int], incarnation: str | None = None
    ) -> Effects:
        """Remove rows (clear_samples, kv_clear, an undone put)."""
        p = self.state.partition(partition_id)
        p.check_incarnation(incarnation)
        return self._clear(p, rows)

    def _clear(self, p: Partition, rows: Sequence[int]) -> Effects:
        fx = Effects(room=True, wakeups=[Wakeup(p.partition_id)])
        fx.admission = self.rollouts.free_unconsumed(p, rows)
        fx.free.append((p.partition_id, p.incarnation, dict(p.clear_rows(rows))))
        return fx

    def clear_partition(self, partition_id: str) -> Effects:
        """Drop a partition with its leases, holds, put leases and sampler caches."""
        st = self.state
        p = st.partition(partition_id)
        by_unit = p.live_rows_by_unit()
        fx = Effects(room=True, wakeups=[Wakeup(partition_id)])
        fx.admission = self.rollouts.free_unconsumed(
            p, [r for rows in by_unit.values() for r in rows]
        )
        st.drop_partition(partition_id)
        for lease_id in p.leases:
            self._lease_home.pop(lease_id, None)
        for lease_id in p.lease_batch:
            self._batch_home.pop(lease_id, None)
        for put_id in p.put_leases:
            self.puts.home.pop(put_id, None)
        for smp in self.samplers():
            smp.clear_partition(partition_id)
            clear_cache = getattr(smp, "clear_cache", None)
            if clear_cache is not None:
                clear_cache(partition_id)  # TransferQueue's hook, as its controller calls it
        whole: dict[int, list[int] | None] = {u: None for u in st.units}
        fx.free.append((partition_id, p.incarnation, whole | dict.fromkeys(by_unit)))
        return fx

    def reset_consumption(self, partition_id: str, task: str | None) -> Effects:
        """Forget what ``task`` (every task if None) consumed, its recorded batches and leases."""
        p = self.state.partition(partition_id)
        for lease in list(p.leases.values()):
            if task is None or lease.task == task:
                self._drop_lease(p, lease)
        p.settled = {k for k in p.settled if task is not None and k[0] != task}
        for lease_id, key in list(p.lease_batch.items()):
            if task is None or key[0] == task:
                del p.lease_batch[lease_id]
                self._batch_home.pop(lease_id, None)
        p.recorded = {k: v for k, v in p.recorded.items() if task is not None and k[0] != task}
        p.reset_consumption(task)
        for smp in self.samplers():
            smp.reset_partition(partition_id, task)
        return Effects(wakeups=[Wakeup(partition_id, task)])

    # ---- consumption side effects ------------------------------------------------------------

    def _after_consume(
        self,
        task: str,
        p: Partition,
        rows: Sequence[int],
        delivered: Sequence[int],
        fx: Effects,
    ) -> None:
        """Admission slots, auto-clear and "all consumed" waiters follow consumption."""
        if self.rollouts.learner_consumed(task, p, rows):
            fx.admission = True
        if all_consumed(p, task):
            # waiters of this task asking stop_when_consumed can end their stream now
            fx.wakeups.append(Wakeup(p.partition_id, task))
        if self.state.auto_clears(p, task) and delivered:
            # delivered rows of an auto-clear task are held until acknowledged; only the
            # rows consumed undelivered (a dropped tail, stale rows) can go now
            given = set(delivered)
            rows = [r for r in rows if r not in given]
        self._auto_clear(p, rows, fx)

    def _auto_clear(self, p: Partition, rows: Sequence[int], fx: Effects) -> None:
        """Free rows every auto-clear task consumed, unless a consumer still holds them."""
        if not self.state.auto_clear or self.state.partitions.get(p.partition_id) is not p:
            return
        held = p.held
        done = [r for r in self.state.auto_clear_done(p, rows) if r not in held]
        if done:
            fx.room = True
            fx.free.append((p.partition_id, p.incarnation, dict(p.clear_rows(done, "auto_clear"))))

    def _apply_stale(self, req: GetMeta, p: Partition, stale: StaleRows, fx: Effects) -> None:
        """Consume the rows a sampler found stale; queue recycled prompts; count."""
        consumed = p.consumed.get(req.task_name)
        st = self.state
        self.rollouts.count_stale(
            "kept", stale.kept - len(stale.kept_rows), fx
        )  # counts without rows
        for kind, rows in (("dropped", stale.dropped), ("recycled", stale.recycled)):
            valid = [
                r
                for r in dict.fromkeys(rows)
                if 0 <= r < p.n_rows and p.alive[r] and not (consumed and consumed[r])
            ]
            if not valid:
                continue
            p.consume(req.task_name, valid)
            self._after_consume(req.task_name, p, valid, (), fx)
            self.rollouts.count_stale(kind, len(valid), fx)
            if kind == "recycled":
                st.recycled.extend((p.partition_id, r) for r in valid)

    # ---- admission (see _admission) ----------------------------------------------------------

    def free_slots(self, n: int) -> bool:
        """Give back ``n`` admission slots; True if any was outstanding."""
        return self.rollouts.free_slots(n)

    def admissible(self, version: int, n: int) -> bool:
        """Whether a rollout of ``n`` rows at policy ``version`` may start now."""
        return self.rollouts.admissible(version, n)

    def acquire(self, version: int, n: int) -> bool:
        """Admit a rollout if it fits now (True), else leave everything as it is."""
        return self.rollouts.acquire(version, n)

    def set_policy_version(self, version: int) -> Effects:
        """The learner moved: rollouts may start, and rows may have gone stale."""
        return self.rollouts.set_policy_version(version)

    # ---- storage units (see _liveness) -------------------------------------------------------

    def unit_down(self, unit: int, now: float) -> Effects:
        """A unit missed its liveness deadline: suspend it (see :class:`UnitLiveness`)."""
        return self.liveness.unit_down(unit, now)

    def unit_up(self, unit: int) -> Effects:
        """A suspended unit came back with its data: its rows are handed out again."""
        return self.liveness.unit_up(unit)

    def unit_lost(self, unit: int) -> Effects:
        """A unit's data is gone (its process died, or it restarted): its rows are lost."""
        return self.liveness.unit_lost(unit)

    def unit_registered(self, unit: int, address: str) -> Effects:
        """A unit process (re)started under ``unit``: what an earlier one held is gone."""
        return self.liveness.unit_registered(unit, address)


# ---- pure helpers ------------------------------------------------------------------------------


def _accepted_kwargs(sampler: Any) -> frozenset[str] | None:
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


def check_sampled(req: GetMeta, p: Partition, delivered: Sequence[int]) -> None:
    """The sampler's rows exist and have the request's fields."""
    p.check_rows(delivered)
    # rows of the ready set have every field by construction: check only the others
    ready = p.ready_set(req.task_name, req.data_fields).rows
    for r in delivered:
        if r not in ready and not p.is_produced(r, req.data_fields):
            raise InvalidRequestError(
                f"the sampler returned row {r}, which lacks some of {req.data_fields}"
            )


def count_dropped(
    req: GetMeta, p: Partition, consumed: Sequence[int], delivered: Sequence[int]
) -> None:
    """Count rows consumed without being delivered (a dropped tail), once each."""
    if len(consumed) == len(delivered):
        return
    given = set(delivered)
    n = sum(1 for r in consumed if r not in given)
    if n:
        p.dropped[req.task_name] = p.dropped.get(req.task_name, 0) + n


def _first_undecided(req: GetMeta, p: Partition, key: RecordKey) -> GetMeta | None:
    """With ``record_from`` in the request's ``sampling_config``: the request for the lowest
    batch index in ``[record_from, batch_index)`` not decided yet for ``(task, dp_rank)``,
    else None. Deciding those first keeps the recorded indexes a gap-free prefix when several
    readers share the index space (DataLoader workers), in one round trip."""
    cfg = req.sampling_config
    start = cfg.get("record_from") if cfg else None
    if start is None:
        return None
    task, rank, index = key
    recorded = p.recorded
    for i in range(max(int(start), 0), index):
        if (task, rank, i) not in recorded:
            assert cfg is not None
            return msgspec.structs.replace(req, sampling_config={**cfg, "batch_index": i}, ack=None)
    return None


def record_key(req: GetMeta) -> RecordKey | None:
    """``(task, dp_rank, batch_index)`` of a fetch that names its batch, else None."""
    cfg = req.sampling_config
    if req.mode != "fetch" or not cfg or cfg.get("batch_index") is None:
        return None
    dp_rank = cfg.get("dp_rank") or 0
    return (req.task_name, int(dp_rank), int(cfg["batch_index"]))


def follower(req: GetMeta, index: int, after: int) -> GetMeta:
    """The request deciding batch ``index`` of ``req.also`` once batch ``after`` (the one
    before it in the request) is decided: the same fetch under ``index``, deciding the
    indexes between first (``record_from``), answered now or not at all (``timeout=0``)."""
    cfg = {**(req.sampling_config or {}), "batch_index": index, "record_from": after + 1}
    return msgspec.structs.replace(req, sampling_config=cfg, timeout=0, ack=None, also=None)


def all_consumed(p: Partition, task: str) -> bool:
    """The partition holds rows and ``task`` consumed every one of them."""
    return p.n_alive > 0 and p.consumed_count.get(task, 0) >= p.n_alive


def meta_reply(p: Partition, rows: list[int], fields: Sequence[str]) -> MetaReply:
    """The reply naming ``rows`` of ``p`` (their units, tags and versions)."""
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
        incarnation=p.incarnation,
        keys=[p.row_keys[r] for r in rows] if p.keys else None,
    )


def sampler_error(sampler: Any, exc: Exception) -> InvalidRequestError:
    """A sampler's own exception, as the caller sees it (no server traceback)."""
    return InvalidRequestError(
        f"sampler {type(sampler).__name__} raised {type(exc).__name__}: {exc}; check the "
        "request (batch_size, sampling_config) against what the sampler accepts"
    )


class _Mapped:
    """An async sampler's answer, its exceptions mapped like a sync sampler's; ``close()``
    drops it unawaited (the sampler's coroutine is closed unstarted, a future cancelled)."""

    __slots__ = ("result", "sampler")

    def __init__(self, sampler: Any, result: Awaitable[Any]) -> None:
        self.sampler = sampler
        self.result = result

    def __await__(self) -> Generator[Any, None, Any]:
        try:
            return (yield from self.result.__await__())
        except TQError:
            raise
        except Exception as exc:
            raise sampler_error(self.sampler, exc) from None

    def close(self) -> None:
        if inspect.iscoroutine(self.result):
            self.result.close()
        elif isinstance(self.result, asyncio.Future):
            self.result.cancel()


def check_result(result: Any) -> tuple[list[int], list[int]]:
    """A sampler's ``(sampled, consumed)`` as two lists of ints, or InvalidRequestError."""
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


def check_shares(result: Any, dp_size: int) -> tuple[list[list[int]], list[int]]:
    """A ``sample_shares`` answer: ``dp_size`` lists of rows (or none) and the consumed rows."""
    try:
        shares_in, consumed_in = result
        shares = [[int(r) for r in share] for share in shares_in]
        consumed = [int(r) for r in consumed_in]
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(
            "sample_shares must return (shares, consumed): one list of rows per rank and "
            f"the rows to consume; got {type(result).__name__}"
        ) from exc
    if not shares:
        return [[] for _ in range(dp_size)], consumed
    if len(shares) != dp_size:
        raise InvalidRequestError(
            f"sample_shares returned {len(shares)} shares for {dp_size} ranks"
        )
    return shares, consumed


def split_even(rows: Sequence[int], dp_size: int, group: int = 1) -> list[list[int]]:
    """Cut ``rows`` in order into ``dp_size`` shares, runs of ``group`` rows kept together.

    Share lengths differ by at most one group (earlier ranks get the longer shares); when
    ``len(rows)`` is not a multiple of ``group`` the rows are split one by one.
    """
    if group < 1 or len(rows) % group:
        group = 1
    n_groups = len(rows) // group
    base, extra = divmod(n_groups, dp_size)
    shares = []
    start = 0
    for rank in range(dp_size):
        size = (base + (rank < extra)) * group
        shares.append(list(rows[start : start + size]))
        start += size
    return shares
