"""The controller's transitions: a pure state machine over `ControllerState`.

No event loop, no sockets, no clock. Every transition takes the request (and ``now``, seconds
on any monotonic clock) and returns what the I/O shell still has to do, as
`Effects`: waiters to wake, rows to free on storage units, capacity and admission
slots freed. Deadlines (leases, put leases, slot leases, suspended units) live in one
heap here; the shell arms a single timer for `ControllerCore.next_deadline` and calls
`ControllerCore.advance` when it fires. A get_meta is decided in one call,
`ControllerCore.decide` (`tq_async._core._gets`): it runs plain samplers, looks
ahead for ``get_batches``, and returns a reply, a wait, or an ``async`` sampler's started call
(`Awaiting`) that the shell awaits and hands to
`ControllerCore.resume`. This is the shape of httpcore's connection pool: pure code
changes state and hands back the I/O left to do, so each guarantee is tested without a loop
(``tests/core/test_core.py``).

The core composes its parts: the get path (``_gets``) with its leases (``_leases``), ready sets
(``_ready``) and sampler calls (``_sampling``); put leases (``_put_leases``); the catalog
(``_catalog``: seal, tags, room, restores); admission (``_admission``); unit liveness
(``_liveness``).

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

import heapq
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import InvalidRequestError
from .._wire._protocol import GetMeta, MetaReply, Placement
from ..samplers import BaseSampler, SequentialSampler
from ._admission import Admission
from ._arrays import live_rows_by_unit
from ._catalog import Catalog
from ._effects import AdmissionConfig, Deadlines, Effects
from ._gets import Gets, Outcome, follower, meta_reply, record_key
from ._leases import GetLeases
from ._liveness import UnitLiveness
from ._put_leases import PutLeases
from ._sampling import (
    TAILS,
    Awaiting,
    Decision,
    SampleCall,
    check_sampler,
    check_task_samplers,
    group_limits,
    split_even,
)
from ._state import ControllerState, Partition, Wakeup

__all__ = [
    "TAILS",
    "AdmissionConfig",
    "Awaiting",
    "ControllerCore",
    "Deadlines",
    "Decision",
    "Effects",
    "Outcome",
    "SampleCall",
    "follower",
    "meta_reply",
    "record_key",
    "split_even",
]


class ControllerCore:
    """Every transition of the controller; see the module docstring.

    Args:
        state: the partitions, units and counters.
        sampler: the default sampler.
        task_samplers: samplers for particular tasks.
        admission: bounds for ``acquire_rollout``.
        deadlines: put-lease and unit-liveness deadlines (`Deadlines`).
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
        self.sampler: BaseSampler = (
            SequentialSampler() if sampler is None else check_sampler(sampler)
        )
        self.task_samplers = check_task_samplers({} if task_samplers is None else task_samplers)
        self.admission = admission or AdmissionConfig()
        self._ids = itertools.count(1)
        #: (deadline, seq, kind, id); stale entries are skipped when popped
        self._timers: list[tuple[float, int, str, Any]] = []
        self.puts = PutLeases(self.state, self.put_lease, self._ids, self._arm, self._clear)
        self.rollouts = Admission(self.state, self.admission, self._arm)
        #: get-side leases and holds
        self.leases = GetLeases(self.state, self._ids, self._arm, self.rollouts)
        #: seal, auto-clear tasks, tags, room for puts, restores, recycled rows
        self.catalog = Catalog(self.state, self.puts, self.leases)
        self.liveness = UnitLiveness(self.state, self.unit_lost_after, self._arm, self.rollouts)
        #: what each get_meta comes to
        self.gets = Gets(self.state, self.leases, self.rollouts, self.sampler, self.task_samplers)
        #: the samplers' prompt groups: a put never overfills one (see BaseSampler.group_tag)
        self.state.group_limits.update(group_limits(self.samplers()))

    @property
    def sampler_calls(self) -> int:
        """Number of sampler invocations (tests use it to prove waiting is event-driven)."""
        return self.gets.sampler_calls

    def samplers(self) -> list[BaseSampler]:
        """Every sampler, default first."""
        return self.gets.samplers()

    # ---- deadlines ---------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When `advance` has something to do next (None: nothing is pending)."""
        timers = self._timers
        while timers and not self._live(*timers[0]):
            heapq.heappop(timers)  # acknowledged, committed, renewed or resumed meanwhile
        return timers[0][0] if timers else None

    def _live(self, deadline: float, _seq: int, kind: str, ident: Any) -> bool:
        """Whether a heap entry still stands for a deadline."""
        if kind == "lease":
            return self.leases.live(ident, deadline)
        if kind == "put":
            return self.puts.live(ident, deadline)
        if kind == "slots":
            return self.rollouts.live(ident, deadline)
        return self.state.suspended.get(ident) == deadline

    def _arm(self, deadline: float, kind: str, ident: Any) -> None:
        heapq.heappush(self._timers, (deadline, next(self._ids), kind, ident))

    def advance(self, now: float) -> Effects:
        """Expire every lease, put lease, slot lease and suspended unit whose deadline is
        ``<= now``."""
        fx = Effects()
        timers = self._timers
        while timers and timers[0][0] <= now:
            deadline, _, kind, ident = heapq.heappop(timers)
            if kind == "lease":
                self.leases.expire(ident, deadline, fx)
            elif kind == "put":
                self.puts.lapse(ident, deadline, fx)
            elif kind == "slots":
                self.rollouts.expire(ident, deadline, fx)
            else:
                self.liveness.on_deadline(ident, deadline, fx)
        return fx

    # ---- get_meta (see _gets) ----------------------------------------------------------------

    def get_meta(self, req: GetMeta, now: float) -> tuple[Decision, Effects]:
        """Start a get_meta: a reply, a sampler call to run, or None (wait for a wake-up).

        ``req.ack`` is applied first. Raises `InvalidRequestError` for a request
        that can never be served as asked.
        """
        fx = self.ack(req.ack, now) if req.ack else Effects()
        return self.gets.look(req, now), fx

    def look(self, req: GetMeta, now: float) -> Decision:
        """Look again after a wake-up (nothing changes unless a recorded batch is re-read)."""
        return self.gets.look(req, now)

    def sampled(
        self, req: GetMeta, call: SampleCall, result: Any, now: float, *, strict: bool = True
    ) -> tuple[Decision, Effects]:
        """Apply a sampler's answer: a reply, or None (see `Gets.sampled`)."""
        return self.gets.sampled(req, call, result, now, strict=strict)

    def decide(
        self, req: GetMeta, now: float, fx: Effects, *, again: bool = False, ahead: bool = True
    ) -> Outcome:
        """A get_meta in one call: ``req.ack`` applied first (unless it looks ``again`` after a
        wake-up), plain samplers run, and with ``ahead`` the batches ``req.also`` asks for
        that can be decided now in ``reply.more``. Returns a reply, None (wait for a
        wake-up) or an ``async`` sampler's call to await and hand to `resume`.

        Every effect goes to ``fx``, also when it raises (`InvalidRequestError` for a
        request that can never be served as asked): apply them either way.
        """
        if req.ack and not again:
            fx.add(self.leases.ack(req.ack, now))
        return self.gets.decide(req, now, fx, ahead=ahead)

    def resume(
        self,
        req: GetMeta,
        awaiting: Awaiting,
        answer: Any,
        now: float,
        fx: Effects,
        *,
        ahead: bool = True,
    ) -> Outcome:
        """Go on with an ``async`` sampler's answer (see `decide`)."""
        return self.gets.resume(req, awaiting, answer, now, fx, ahead=ahead)

    # ---- leases (see _leases) ----------------------------------------------------------------

    def ack(self, lease_ids: Sequence[int], now: float) -> Effects:
        """Acknowledge leases and holds (see `GetLeases.ack`): idempotent."""
        return self.leases.ack(lease_ids, now)

    def cancel(self, req: GetMeta, reply: MetaReply) -> Effects:
        """The caller of ``req`` gave up before it saw ``reply``: undo the answer (see
        `release`). A recorded batch keeps its rows for its key; a peek took nothing."""
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
        """A cancelled fetch gives rows back (see `GetLeases.release`)."""
        return self.leases.release(partition_id, task, rows, incarnation, lease_id)

    # ---- puts (see _put_leases) --------------------------------------------------------------

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
        host: str = "",
    ) -> tuple[Placement, Effects]:
        """Place a put; new rows wait under a put lease (see `PutLeases.begin`);
        ``host``: the producer's host id (new rows prefer a unit there)."""
        return self.puts.begin(
            partition_id, headers, n_rows, rows, keys, now, lease=lease, host=host
        )

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
        holder: bytes = b"",
    ) -> Effects:
        """Make a put visible (see `PutLeases.commit`); rows it gives a policy version
        settle as many admission slots, ``holder``'s first (`Admission.settle`)."""
        fresh = self.rollouts.unversioned(partition_id, rows) if versions is not None else 0
        fx = self.puts.commit(partition_id, rows, fields, tags, versions, put_id, incarnation)
        if fresh:
            self.rollouts.settle(fresh, holder)
        return fx

    # ---- clearing ----------------------------------------------------------------------------

    def clear_rows(
        self,
        partition_id: str,
        rows: Sequence[int],
        incarnation: str | None = None,
        *,
        undo: bool = False,
    ) -> Effects:
        """Remove rows (clear_samples, kv_clear, an undone put).

        Unconsumed rows give their admission slots back, except the rows of a put its
        caller gave up on (``undo``): its producer still holds them, to put again or to
        release, whether the put was undone before or after it committed."""
        p = self.state.partition(partition_id)
        p.check_incarnation(incarnation)
        p.check_rows(rows)  # (before any slot is given back: a refused clear changes nothing)
        return self._clear(p, rows, admission=not undo)

    def _clear(self, p: Partition, rows: Sequence[int], *, admission: bool = True) -> Effects:
        fx = Effects(room=True, wakeups=[Wakeup(p.partition_id)])
        fx.admission = admission and self.rollouts.free_unconsumed(p, rows)
        fx.free.append((p.partition_id, p.incarnation, dict(p.clear_rows(rows))))
        return fx

    def clear_partition(self, partition_id: str) -> Effects:
        """Drop a partition with its leases, holds, put leases and sampler caches (the
        samplers' hooks first: one that raises leaves everything as it was)."""
        st = self.state
        p = st.partition(partition_id)
        for smp in self.samplers():
            _hook(smp, "clear_partition", partition_id)
            _hook(smp, "clear_cache", partition_id)  # TransferQueue's, as its controller calls it
        by_unit = live_rows_by_unit(p)
        fx = Effects(room=True, wakeups=[Wakeup(partition_id)])
        fx.admission = self.rollouts.free_unconsumed(
            p, [r for rows in by_unit.values() for r in rows]
        )
        st.drop_partition(partition_id)
        self._forget_ends(partition_id, None)
        self.leases.forget(p)
        for put_id in p.put_leases:
            self.puts.home.pop(put_id, None)
        whole: dict[int, list[int] | None] = {u: None for u in st.units}
        fx.free.append((partition_id, p.incarnation, whole | dict.fromkeys(by_unit)))
        return fx

    def reset_consumption(self, partition_id: str, task: str | None) -> Effects:
        """Forget what ``task`` (every task if None) consumed, its recorded batches and leases
        (the samplers' hooks first: one that raises leaves everything as it was)."""
        p = self.state.partition(partition_id)
        for smp in self.samplers():
            _hook(smp, "reset_partition", partition_id, task)
        self.leases.reset(p, task)
        self.rollouts.learner_reset(p, task)
        p.reset_consumption(task)
        self._forget_ends(partition_id, task)
        return Effects(wakeups=[Wakeup(partition_id, task)])

    def _forget_ends(self, partition_id: str, task: str | None) -> None:
        """Drop the DP ends of stream owed to ``task``'s ranks (every task's if None) in the
        partition (`ControllerState.dp_ends`)."""
        ends = self.state.dp_ends
        if ends:
            for end in [e for e in ends if e[0] == partition_id and task in (None, e[2])]:
                del ends[end]

    # ---- admission (see _admission) ----------------------------------------------------------

    def free_slots(self, n: int) -> bool:
        """Give back ``n`` admission slots; True if any was outstanding."""
        return self.rollouts.free_slots(n)

    def admissible(self, version: int, n: int) -> bool:
        """Whether a rollout of ``n`` rows at policy ``version`` may start now."""
        return self.rollouts.admissible(version, n)

    def acquire(
        self, version: int, n: int, token: int = 0, holder: bytes = b"", now: float | None = None
    ) -> bool:
        """Admit a rollout if it fits now (True), else leave everything as it is; with
        ``now``, ``holder`` renews its slots (see `Admission.acquire`)."""
        return self.rollouts.acquire(version, n, token, holder, now)

    def renew_slots(self, holder: bytes, peer: bytes, now: float) -> None:
        """``holder``'s client, speaking on connection ``peer``, renews its slots."""
        self.rollouts.named(peer, holder)
        self.rollouts.lease(holder, now)

    def release_slots(self, n: int, holder: bytes = b"") -> bool:
        """``holder`` gives back ``n`` slots it will not put; True if any was outstanding."""
        return self.rollouts.release(n, holder)

    def holder_gone(self, holder: bytes) -> bool:
        """``holder`` is gone: the slots it acquired and never put go back."""
        return self.rollouts.holder_gone(holder)

    def peer_gone(self, peer: bytes) -> bool:
        """Connection ``peer`` ended: the slots of the holder it spoke for go back."""
        return self.rollouts.peer_gone(peer)

    def set_policy_version(self, version: int) -> Effects:
        """The learner moved: rollouts may start, and rows may have gone stale."""
        return self.rollouts.set_policy_version(version)

    # ---- storage units (see _liveness) -------------------------------------------------------

    def unit_down(self, unit: int, now: float, *, recovered: bool = False) -> Effects:
        """A unit missed its liveness deadline, or a recovered controller awaits it: suspend
        it (see `UnitLiveness`)."""
        return self.liveness.unit_down(unit, now, recovered=recovered)

    def unit_up(self, unit: int) -> Effects:
        """A suspended unit came back with its data: its rows are handed out again."""
        return self.liveness.unit_up(unit)

    def unit_lost(self, unit: int) -> Effects:
        """A unit's data is gone (its process died, or it restarted): its rows are lost."""
        return self.liveness.unit_lost(unit)

    def unit_registered(self, unit: int, address: str, host: str = "") -> Effects:
        """A unit process (re)started under ``unit`` on ``host``: what an earlier one held
        is gone."""
        return self.liveness.unit_registered(unit, address, host)

    def unit_returned(self, unit: int, address: str, host: str = "") -> Effects:
        """A unit restarted on its data_dir with its cells: its rows come back."""
        return self.liveness.unit_returned(unit, address, host)


def _hook(sampler: BaseSampler, name: str, *args: Any) -> None:
    """Call ``sampler``'s hook ``name`` (if it has one), before anything changes: what it
    raises fails the call, naming the sampler and the hook."""
    hook = getattr(sampler, name, None)
    if hook is None:
        return
    try:
        hook(*args)
    except Exception as exc:
        raise InvalidRequestError(
            f"sampler {type(sampler).__name__} raised {type(exc).__name__} in {name}: {exc}; "
            "nothing was cleared or reset: fix the sampler's hook and ask again"
        ) from None
