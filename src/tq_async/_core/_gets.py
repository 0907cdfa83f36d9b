"""The get path, decided in one place: what a get_meta (and the batches it asks for ahead)
comes to.

`Gets.decide` takes a request and returns what it comes to — a reply (with the batches
``GetMeta.also`` asks for that can be decided now in ``reply.more``), None (wait for a
wake-up), or an ``async`` sampler's started call (`Awaiting`)
for the shell to await and hand to `Gets.resume` — and collects every effect of the
request in one `Effects`, applied once by the shell. Plain
samplers are run here; a batch below the asked one (``record_from``) is decided first.

The steps, each usable alone (``tests/core/test_core.py`` drives them one by one): `Gets.look`
says which sampler call a request needs (or the recorded batch it re-reads), and
`Gets.sampled` applies a sampler's answer: consumption, stale rows, the tail of a global
batch, recorded batches and their leases (`tq_async._core._leases`), auto-clear and
admission follow-ups.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from .._errors import InvalidRequestError, TQError
from .._logging import get_logger
from .._wire._checks import MAX_DP_SIZE
from .._wire._protocol import GetMeta, MetaReply
from ..samplers import BaseSampler, SequentialSampler, StaleRows
from ._admission import Admission
from ._assign import local_shares
from ._effects import Effects
from ._forgotten import is_forgotten
from ._leases import GetLeases
from ._ready import ReadyView
from ._sampling import (
    TAILS,
    Awaiting,
    Decision,
    SampleCall,
    accepted_kwargs,
    apply_tail,
    check_result,
    check_shares,
    split_even,
    too_few,
)
from ._state import (
    ControllerState,
    Partition,
    RecordKey,
    Wakeup,
)
from ._views import RowHosts, RowOrigin, RowTags, RowVersions

__all__ = ["Gets", "all_consumed", "follower", "meta_reply", "record_key"]

log = get_logger(__name__)

#: what a request comes to in one step: a reply, a wait (None), or an async sampler to await
Outcome = MetaReply | Awaiting | None


class _Again:
    """An ``async`` sampler's answer no longer fits the state: look again at once."""


AGAIN = _Again()


class Gets:
    """What every get_meta comes to (see the module docstring).

    Args:
        state: the partitions.
        leases: the get-side leases and holds.
        rollouts: admission (the learner's consumption frees slots; stale rows are counted).
        sampler: the default sampler.
        task_samplers: samplers of particular tasks.
    """

    def __init__(
        self,
        state: ControllerState,
        leases: GetLeases,
        rollouts: Admission,
        sampler: BaseSampler,
        task_samplers: Mapping[str, BaseSampler],
    ) -> None:
        self.state = state
        self.leases = leases
        self.rollouts = rollouts
        self.sampler = sampler
        self.task_samplers = task_samplers
        #: per sampler: the keywords its ``sample`` takes, its DP size hint and tail policy
        self._kwargs = {id(smp): accepted_kwargs(smp) for smp in self.samplers()}
        self._hints = {
            id(smp): (getattr(smp, "dp_size_hint", None), getattr(smp, "tail_policy", None))
            for smp in self.samplers()
        }
        #: built-in samplers given no row views, whose answers are not checked again
        self._trusted = {id(smp) for smp in self.samplers() if _trusted(smp)}
        #: number of sampler invocations (tests use it to prove waiting is event-driven)
        self.sampler_calls = 0
        #: locality: ``(task, dp_rank)`` -> the host id its last request came from
        self.rank_hosts: dict[tuple[str, int], str] = {}

    def samplers(self) -> list[BaseSampler]:
        """Every sampler, default first."""
        return [self.sampler, *self.task_samplers.values()]

    def sampler_for(self, task: str) -> BaseSampler:
        return self.task_samplers.get(task, self.sampler)

    # ---- one request, one step ---------------------------------------------------------------

    def decide(self, req: GetMeta, now: float, fx: Effects, *, ahead: bool = True) -> Outcome:
        """What ``req`` comes to now; its effects go to ``fx`` (also when it raises: the shell
        applies them either way). ``req.ack`` is not applied here (see
        `decide`); with ``ahead``, a reply
        carries the batches ``req.also`` asks for that can be decided now."""
        return self._settle(req, self.look(req, now), now, fx, ahead)

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
        """Go on with an ``async`` sampler's ``answer`` (computed while the state could move:
        an answer that no longer fits is dropped, and the request samples again)."""
        decision, more = self.sampled(req, awaiting.call, answer, now, strict=False)
        fx.add(more)
        return self._settle(req, decision, now, fx, ahead)

    def _settle(
        self, req: GetMeta, decision: Decision, now: float, fx: Effects, ahead: bool
    ) -> Outcome:
        """Run the sampler calls ``decision`` leads to (one per batch a ``record_from``
        decides first, then the asked batch's) until a reply, a wait, or an ``async``
        sampler's call; a reply then looks ahead."""
        while isinstance(decision, SampleCall):
            result = decision.run()
            if type(result) is not tuple and inspect.isawaitable(result):
                return Awaiting(decision, result)
            decision, more = self.sampled(req, decision, result, now)
            fx.add(more)
        if ahead and isinstance(decision, MetaReply) and req.also:
            decided = self._ahead(req, decision, now, fx)
            if decided:
                decision.more = decided
        return decision

    def _ahead(self, req: GetMeta, first: MetaReply, now: float, fx: Effects) -> list[MetaReply]:
        """The batches ``req.also`` names that can be decided now, in order: up to the first
        that cannot (or that ends the stream, fails, or needs an ``async`` sampler's answer)."""
        out: list[MetaReply] = []
        if first.end_of_stream or req.also is None:
            return out
        after = int((req.sampling_config or {})["batch_index"])  # checked: also needs it
        ends = self.state.dp_ends
        for index in req.also:
            sub = follower(req, index, after)
            owed = ends_now(ends, req)
            try:
                decision = self._settle(sub, self.look(sub, now), now, fx, False)
            except Exception as exc:  # raised again when that batch is asked for itself
                log.debug("a batch asked for with also= failed", batch_index=index, error=repr(exc))
                break
            if isinstance(decision, Awaiting):  # nothing is decided until it is awaited
                close = getattr(decision.answer, "close", None)
                if close is not None:
                    close()
                break
            if not isinstance(decision, MetaReply) or decision.end_of_stream:
                restore_ends(ends, owed)  # an end met here reaches no reader: none was told
                break
            out.append(decision)
            after = index
        return out

    # ---- the steps ---------------------------------------------------------------------------

    def look(self, req: GetMeta, now: float) -> Decision:
        """Look again after a wake-up (nothing changes unless a recorded batch is re-read)."""
        p = self.state.partitions.get(req.partition_id)
        if p is None:
            return None
        dp_size = self._dp_size(req)
        key = record_key(req)
        if req.host and key is not None:  # a rank that moves host is followed
            self.rank_hosts[(req.task_name, key[1])] = req.host
        if dp_size is not None:
            if key is None:
                raise InvalidRequestError(
                    "a global batch (dp_size) needs sampling_config with dp_rank and batch_index"
                )
            check_rank_batch(req, self.sampler_for(req.task_name), dp_size)
        if key is not None:
            if p.unavailable and on_suspended(p, key):
                return None  # its rows are neither handed out nor lost: wait for their unit
            recorded = self._recorded(req, p, key, now)
            if recorded is not None:
                return recorded
            if dp_size is not None and told_end(self.state.dp_ends, p, key):
                return MetaReply([], [], [], list(req.data_fields), end_of_stream=True)
            earlier = _first_undecided(req, p, key)
            if earlier is not None:
                # record_from: batches below this one are decided first, lowest first
                below = record_key(earlier)
                if dp_size is not None and owes_end(self.state.dp_ends, p, below):
                    # the rank's stream ends there: its reader of that batch is told it
                    return MetaReply([], [], [], list(req.data_fields), end_of_stream=True)
                decision = self._sample(earlier, p, dp_size)
                if isinstance(decision, MetaReply):  # the end, met at the lower batch
                    owe_end(self.state.dp_ends, p, below, dp_size)
                return _keyed(decision, below, earlier)
        return _keyed(self._sample(req, p, dp_size), key, None)

    def _sample(self, req: GetMeta, p: Partition, dp_size: int | None) -> Decision:
        """The sampler call for ``req`` on the rows ready for it now, None (wait), or the
        end of a ``stop_when_consumed`` stream (a sampler not asked yet is not asked)."""
        if dp_size is not None:
            check_undecided(req, p, dp_size)
        ready, final = p.offer(req.task_name, req.data_fields)
        if not final and too_few(self.sampler_for(req.task_name), req, ready, dp_size):
            if req.stop_when_consumed and all_consumed(p, req.task_name):
                return end_of_stream(self.state.dp_ends, req, p, record_key(req), dp_size, final)
            return None
        return self._call(req, p, ready, final, dp_size)

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
        return checked_dp_size(dp_size, cfg.get("dp_rank") or 0)

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
            "final": final,
            "replays_served": req.mode == "fetch" and cfg.get("batch_index") is not None,
            "peek": req.mode != "fetch",
            "policy_version": self.state.learner_version,
            "tail": self._tail(req, sampler),
            "rank_host": req.host,
            "rank_hosts": self._rank_hosts(req, dp_size),
        }
        trusted = id(sampler) in self._trusted
        stale = None
        if not trusted:  # the views, for a sampler that may read them
            stale = StaleRows()
            ctx["tags"], ctx["origin"], ctx["versions"] = RowTags(p), RowOrigin(p), RowVersions(p)
            ctx["stale"], ctx["row_hosts"] = stale, RowHosts(p, self.state.unit_hosts)
        if cfg:
            # sampling_config entries also arrive as keywords (TransferQueue passes them so,
            # e.g. priority_scores); the controller's own context wins on a name clash
            ctx = {str(k): v for k, v in cfg.items()} | ctx
        accepted = self._kwargs.get(id(sampler))
        if accepted is not None:
            ctx = {k: v for k, v in ctx.items() if k in accepted}
        self.sampler_calls += 1
        return SampleCall(
            p, sampler, ready, req.batch_size, ctx, final, stale, dp_size, trusted, moves=p.moves
        )

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
        could move) an answer that no longer fits because rows were consumed or removed
        meanwhile is dropped and the request samples again at once (what `look` says
        now); an answer that did not fit when it was asked for raises, as a plain
        sampler's does.

        The answer for a batch below the asked one (``record_from``) records that batch and
        comes to what `look` says next: the next such batch's sampler call, or the
        asked batch's; its end of stream is the asked batch's too.
        """
        earlier = call.earlier
        decision, fx = self._apply_sample(earlier or req, call, result, now, strict)
        if decision is AGAIN or (
            earlier is not None and isinstance(decision, MetaReply) and not decision.end_of_stream
        ):
            return self.look(req, now), fx
        if earlier is not None and isinstance(decision, MetaReply):
            # the end, met at the lower batch: its own reader is told it too
            owe_end(self.state.dp_ends, call.partition, call.key, call.dp_size)
        assert not isinstance(decision, _Again)
        return decision, fx

    def _apply_sample(
        self, req: GetMeta, call: SampleCall, result: Any, now: float, strict: bool
    ) -> tuple[Decision | _Again, Effects]:
        fx = Effects()
        p = call.partition
        if self.state.partitions.get(req.partition_id) is not p:
            return AGAIN, fx  # cleared while an async sampler ran
        key = call.key
        if key is not None:
            if p.unavailable and on_suspended(p, key):
                return None, fx  # a replica decided the batch meanwhile, on a suspended unit
            recorded = self._recorded(req, p, key, now)
            if recorded is not None:
                return recorded, fx  # a replica decided the batch meanwhile
        try:
            if call.dp_size is None:
                sampled, consumed = check_result(result)
                shares = [sampled]
            else:
                check_undecided(req, p, call.dp_size)  # (an async sampler: the state moved)
                shares, consumed = self._global_shares(req, call, result)
                located = call.shares and getattr(call.sampler, "locality_aware", False)
                shares = shares if located else self._by_host(req, p, shares)
            delivered = [r for share in shares for r in share]
            if not call.trusted:
                check_sampled(req, p, delivered, call.sampler)
            if req.mode == "fetch" and consumed and consumed != delivered:
                check_answered(p, consumed, call.sampler)  # (delivered: checked above)
            final = call.final
            if call.stale and req.mode == "fetch":  # the answer holds: stale rows go now
                if consumed:
                    p.check_consume(req.task_name, consumed)
                self._apply_stale(req, p, call.stale, consumed, fx)
                final = p.is_final(req.task_name, p.ready_set(req.task_name, req.data_fields))
            if call.stale and call.stale.kept_rows and req.mode == "fetch":
                self.rollouts.count_kept(req, call.stale, delivered, fx)
            if req.mode == "fetch" and consumed:
                p.consume(req.task_name, consumed)
                count_dropped(req, p, consumed, delivered)
                self._after_consume(req.task_name, p, consumed, delivered, fx)
        except TQError:
            if strict or p.moves == call.moves:
                raise  # (an async sampler's answer that was wrong when it was asked for)
            return AGAIN, fx  # the state moved while an async sampler ran: sample again
        if not delivered:
            if consumed:
                final = p.is_final(req.task_name, p.ready_set(req.task_name, req.data_fields))
            if final or (req.stop_when_consumed and all_consumed(p, req.task_name)):
                return end_of_stream(self.state.dp_ends, req, p, key, call.dp_size, final), fx
            return None, fx
        if key is None:
            reply = meta_reply(p, shares[0], req.data_fields)
            if req.mode == "fetch" and self._holding(req, p):
                reply.lease_id = self.leases.new_lease(p, req, tuple(shares[0]), None, now)
            return reply, fx
        task, _, index = key
        if call.dp_size is None:
            p.recorded[key] = tuple(shares[0])
            p.mark_recorded(task, shares[0])
        else:
            for r, share in enumerate(shares):
                p.recorded[(task, r, index)] = tuple(share)
                p.mark_recorded(task, share)
            for r in range(len(shares)):  # the other ranks' shares wait for them
                if r != key[1]:
                    self.leases.hold_batch(p, (task, r, index))
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
        if len({len(s) for s in shares}) <= 1:
            return shares, consumed
        tail = str(call.ctx.get("tail") or self._tail(req, call.sampler))
        return apply_tail(req, shares, tail), consumed

    def _rank_hosts(self, req: GetMeta, dp_size: int | None) -> list[str] | None:
        """Each rank's host id for a global batch (``""``: not asked yet, or locality off with
        ``placement = "round_robin"``); None for a single rank's request."""
        if dp_size is None:
            return None
        if self.state.placer.mode == "round_robin":
            return [""] * dp_size
        return [self.rank_hosts.get((req.task_name, r), "") for r in range(dp_size)]

    def _by_host(self, req: GetMeta, p: Partition, shares: list[list[int]]) -> list[list[int]]:
        """The shares handed to the ranks that find most of them on their own host (see
        `tq_async._core._assign`; the sampler's order when nothing is gained, with
        ``placement = "round_robin"`` (locality off), or when the sampler split the batch by
        locality itself (`BaseSampler.locality_aware`))."""
        if self.state.placer.mode == "round_robin":
            return shares
        hosts = [self.rank_hosts.get((req.task_name, r), "") for r in range(len(shares))]
        unit_hosts, units, base = self.state.unit_hosts, p.units, p.base
        return local_shares(shares, hosts, lambda row: unit_hosts.get(units[row - base], ""))

    def _holding(self, req: GetMeta, p: Partition) -> bool:
        """Whether delivered rows are held until acknowledged (a lease, or auto-clear)."""
        return req.lease is not None or self.state.auto_clears(p, req.task_name)

    def _recorded(self, req: GetMeta, p: Partition, key: RecordKey, now: float) -> MetaReply | None:
        """The recorded batch ``key``, with its lease; None if it was never decided. Rows
        lost with a storage unit since are left out (never handed out again), as are rows
        cleared long since (the partition holds nothing of them: `_arrays.compact`; nor,
        once no lease or hold waits on it, of the batch: `_forgotten`)."""
        rows = p.recorded.get(key)
        if rows is None:
            # forgotten once its rows were all gone: a replay still finds none of them
            return meta_reply(p, [], req.data_fields) if is_forgotten(p, key) else None
        lost, base = p.lost, p.base
        given = list(rows)
        if lost or (given and min(given) < base):
            given = [r for r in given if r not in lost and r >= base]
        reply = meta_reply(p, given, req.data_fields)
        if req.mode != "fetch" or not rows:
            return reply
        lease_id = p.batch_leases.get(key)
        if lease_id is not None:  # the batch's lease: shared, and taken over by a new reader
            self.leases.take_over(p, lease_id, req, now)
            reply.lease_id = lease_id
        elif key not in p.settled and self._holding(req, p):
            reply.lease_id = self.leases.new_lease(p, req, rows, key, now)
        return reply

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
        if not self.state.auto_clear:
            return  # no task auto-clears
        if self.state.auto_clears(p, task) and delivered:
            # delivered rows of an auto-clear task are held until acknowledged; only the
            # rows consumed undelivered (a dropped tail, stale rows) can go now
            given = set(delivered)
            rows = [r for r in rows if r not in given]
        self.leases.auto_clear(p, rows, fx)

    def _apply_stale(
        self, req: GetMeta, p: Partition, stale: StaleRows, taken: Sequence[int], fx: Effects
    ) -> None:
        """Consume the rows a sampler found stale (but those its answer consumes itself,
        ``taken``); queue recycled prompts; count."""
        answer = set(taken)
        st = self.state
        self.rollouts.count_stale(
            "kept", stale.kept - len(stale.kept_rows), fx
        )  # counts without rows
        for kind, rows in (("dropped", stale.dropped), ("recycled", stale.recycled)):
            consumed = p.consumed.get(req.task_name)  # (a row both dropped and recycled: once)
            valid = [
                r
                for r in dict.fromkeys(rows)
                if p.base <= r < p.n_rows
                and p.alive[r - p.base]
                and not (consumed and consumed[r - p.base])
                and r not in answer
            ]
            if not valid:
                continue
            p.consume(req.task_name, valid)
            if kind == "recycled":
                # queued, and held there: auto-clear must leave them to `take_recycled`
                st.recycled.extend((p.partition_id, p.incarnation, r) for r in valid)
                self.leases.hold_recycled(p, valid)
            self._after_consume(req.task_name, p, valid, (), fx)
            self.rollouts.count_stale(kind, len(valid), fx)


def _trusted(sampler: BaseSampler) -> bool:
    """``sampler`` answers with the built-in `SequentialSampler.sample`: it reads no row
    views and no ``stale``, and answers a prefix of the ready rows it is given."""
    cls = type(sampler)
    return (
        getattr(cls, "sample", None) is SequentialSampler.sample
        and getattr(cls, "sample_shares", None) is BaseSampler.sample_shares
    )


def checked_dp_size(dp_size: Any, rank: Any) -> int:
    """The ``dp_size`` of a global batch (the request's, or its sampler's hint), checked
    with the asking ``rank``: deciding one costs time and memory in ``dp_size``."""
    if not isinstance(dp_size, int) or isinstance(dp_size, bool) or not 1 <= dp_size <= MAX_DP_SIZE:
        raise InvalidRequestError(
            f"sampling_config dp_size must be an int in [1, {MAX_DP_SIZE}]: {dp_size!r}"
        )
    if not isinstance(rank, int) or not 0 <= rank < dp_size:
        raise InvalidRequestError(
            f"sampling_config dp_rank {rank!r} is out of range for dp_size={dp_size}"
        )
    return dp_size


def check_rank_batch(req: GetMeta, sampler: BaseSampler, dp_size: int) -> None:
    """A rank's ``batch_size`` holds whole groups of the sampler's `group_size`: else
    every global batch, not only the last, would split unevenly over the ranks (and
    ``tail="drop"`` would drop whole groups at every step)."""
    group = int(getattr(sampler, "group_size", 1))
    if group > 1 and req.batch_size % group:
        raise InvalidRequestError(
            f"batch_size ({req.batch_size}) must be a multiple of n_samples_per_prompt "
            f"({group}) with dp_size={dp_size}: each rank's batch holds whole prompt groups; "
            f"ask for a multiple of {group} rows per rank"
        )


def check_undecided(req: GetMeta, p: Partition, dp_size: int) -> None:
    """No rank's share of the global batch ``req`` would decide is recorded: a batch
    decided with another ``dp_size`` (or without one) would be decided again over it, its
    ranks' recorded rows replaced (a replay getting other rows, a share never delivered)."""
    key = record_key(req)
    assert key is not None
    task, rank, index = key
    recorded = p.recorded
    for r in range(dp_size):
        if r != rank and ((task, r, index) in recorded or is_forgotten(p, (task, r, index))):
            raise InvalidRequestError(
                f"batch_index {index} of task {task!r} in partition {p.partition_id!r} was "
                f"decided for dp_rank {r} but not for dp_rank {rank}: it was decided with a "
                f"smaller dp_size than {dp_size}, or without dp_size; every rank of a task asks "
                "for a batch with the dp_size it was decided with (a restarted job too), or "
                "reset the task's consumption (reset_consumption) to decide anew"
            )


def check_sampled(req: GetMeta, p: Partition, delivered: Sequence[int], sampler: Any) -> None:
    """The sampler's rows exist, have the request's fields and are not on a suspended
    storage unit."""
    check_answered(p, delivered, sampler)
    # rows of the ready set have every field by construction: check only the others
    ready = p.ready_set(req.task_name, req.data_fields).rows
    for r in ready.missing(delivered):
        if not p.is_produced(r, req.data_fields):
            raise InvalidRequestError(
                f"sampler {type(sampler).__name__} returned row {r}, which lacks some of "
                f"{req.data_fields}; a sampler answers rows of the ready_indexes it is given"
            )
        if not p.available(r):
            raise InvalidRequestError(
                f"the sampler returned row {r}, which is on storage unit {p.units[r - p.base]}, "
                "suspended: its rows are not handed out until it comes back; sample from "
                "the ready rows (ready_indexes)"
            )


def check_answered(p: Partition, rows: Sequence[int], sampler: Any) -> None:
    """Every row a sampler answered exists and is alive (as `Partition.check_rows`, but
    the error names the sampler: the caller of get_meta named no row)."""
    r = p.first_missing(rows)
    if r is not None:
        raise InvalidRequestError(
            f"sampler {type(sampler).__name__} answered row {r}: {p.why_missing(r)}; a "
            "sampler answers rows of the ready_indexes it is given"
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
        if (task, rank, i) not in recorded and not is_forgotten(p, (task, rank, i)):
            assert cfg is not None
            return msgspec.structs.replace(req, sampling_config={**cfg, "batch_index": i}, ack=None)
    return None


def on_suspended(p: Partition, key: RecordKey) -> bool:
    """Whether the recorded batch ``key`` holds rows of a suspended unit: neither handed out
    nor lost, it waits for the unit to come back (or be lost: then it goes without them)."""
    rows = p.recorded.get(key)
    return rows is not None and not all(map(p.available, rows))


def told_end(ends: dict[tuple[str, str, str, int], set[int]], p: Partition, key: RecordKey) -> bool:
    """Whether another DP rank got a stop_when_consumed end of stream at this global batch
    (`ControllerState.dp_ends`): this rank is told once, then the index is decided anew
    (for a next round)."""
    if not ends:
        return False
    task, rank, index = key
    end = (p.partition_id, p.incarnation, task, index)
    owed = ends.get(end)
    if owed is None or rank not in owed:
        return False
    owed.discard(rank)
    if not owed:
        del ends[end]
    return True


def ends_now(
    ends: dict[tuple[str, str, str, int], set[int]], req: GetMeta
) -> dict[tuple[str, str, str, int], set[int]] | None:
    """A copy of the DP ends of stream owed (`ControllerState.dp_ends`) before a batch
    asked for ahead (``also=``) is decided, when it may change them (None: it cannot)."""
    return {e: set(ranks) for e, ranks in ends.items()} if req.stop_when_consumed or ends else None


def restore_ends(
    ends: dict[tuple[str, str, str, int], set[int]],
    owed: dict[tuple[str, str, str, int], set[int]] | None,
) -> None:
    """Put back the ends owed before a batch asked for ahead met the end of the stream: that
    reply is not handed over, so no rank was told it (nor told what it was owed)."""
    if owed is not None and ends != owed:
        ends.clear()
        ends.update(owed)


def owes_end(
    ends: dict[tuple[str, str, str, int], set[int]], p: Partition, key: RecordKey | None
) -> bool:
    """Whether the rank of ``key`` is owed an end of stream at its batch (`told_end`,
    which tells it, is for the reader of that batch)."""
    if not ends or key is None:
        return False
    task, rank, index = key
    return rank in ends.get((p.partition_id, p.incarnation, task, index), ())


def owe_end(
    ends: dict[tuple[str, str, str, int], set[int]],
    p: Partition,
    key: RecordKey | None,
    dp_size: int | None,
) -> None:
    """The end of stream met at ``key``'s global batch went to a reader of another batch
    of the rank (``record_from``): the reader of ``key`` is owed it too, as the other ranks
    are, so it does not decide that batch anew once rows come."""
    if key is not None and dp_size is not None and dp_size > 1:
        task, rank, index = key
        ends.setdefault((p.partition_id, p.incarnation, task, index), set()).add(rank)


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
    """The partition holds rows and ``task`` consumed every one of them for good: no lease
    of the task is open (its rows come back if it runs out), as for an end of stream after
    a seal."""
    return (
        p.n_alive > 0 and p.consumed_count.get(task, 0) >= p.n_alive and not p.open_leases.get(task)
    )


def meta_reply(p: Partition, rows: list[int], fields: Sequence[str]) -> MetaReply:
    """The reply naming ``rows`` of ``p`` (their units, tags and versions)."""
    tags, units, base = p.tags, p.units, p.base
    at = [r - base for r in rows] if base else rows
    versions = {
        f: [fv[i] for i in at] for f in fields if (fv := p.versions.fields.get(f)) is not None
    }
    return MetaReply(
        rows,
        [units[i] for i in at],
        [tags[i] or {} for i in at],
        list(fields),
        versions=versions,
        incarnation=p.incarnation,
        keys=[p.row_keys[i] for i in at] if p.keys else None,
    )


def _keyed(call: Decision, key: RecordKey | None, earlier: GetMeta | None) -> Decision:
    """``call`` marked with the recorded batch its answer goes to (and the earlier request)."""
    if isinstance(call, SampleCall):
        call.key, call.earlier = key, earlier
    return call


def end_of_stream(
    ends: dict[tuple[str, str, str, int], set[int]],
    req: GetMeta,
    p: Partition,
    key: RecordKey | None,
    dp_size: int | None,
    final: bool,
) -> MetaReply:
    """The end of ``req``'s stream; a ``stop_when_consumed`` one (not ``final``) of a global
    batch is owed to the other ranks at that index too (`ControllerState.dp_ends`): rows may
    come before they ask it, and a rank that stepped on alone would wait in its all_reduce
    for ever."""
    if key is not None and dp_size is not None and dp_size > 1 and not final:
        ends[(p.partition_id, p.incarnation, key[0], key[2])] = set(range(dp_size)) - {key[1]}
    return MetaReply([], [], [], list(req.data_fields), end_of_stream=True)
