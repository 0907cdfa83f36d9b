"""The controller's get path: get_meta, its waiting, its answer, and a Cancel of it.

The core decides a request in one call (`decide`:
it runs plain samplers and decides the batches a ``get_batches`` asks for ahead) and collects
its effects, applied here once. This part awaits an ``async`` sampler's answer in a task and
hands it back (`resume`), parks a request
that must wait in the `ParkingLot` under
``(partition, task)`` until a `Wakeup` concerns it, sends the
cells of a small ``get`` from units of this process along, and warns about a request that
waits on something that will not come (a misspelled field or partition, a partition nobody
seals).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection
from typing import Any

import structlog

from .._core._state import ControllerState
from .._core._transitions import Awaiting, Effects, Outcome, record_key
from .._errors import TQError, TQTimeoutError
from .._logging import get_logger
from .._service._loop import DEFERRED, SENT, Handler, Incoming
from .._transport._hosts import same_host
from .._wire._columns import positions_by_unit
from .._wire._protocol import Cancel, GetMeta, MetaReply, StoredColumns, ok_reply
from ._shell import Shell
from ._units import UnitLinks

__all__ = ["GetPath"]

#: answered fetches a late Cancel can still undo: a client cancels within a round trip of
#: the answer, so this only needs to outlast the fetches answered meanwhile (~100 B each)
FETCHES_REMEMBERED = 16384

log = get_logger(__name__)


class GetPath:
    """The get_meta handlers of `ControllerServer`.

    Args:
        shell: the controller's plumbing.
        links: the links to the storage units (a ``get``'s cells are read from those of this
            process).
        default_lease: seconds of the lease of a fetch that asks for none.
        waiting_warning_after: seconds after which a get_meta waiting on what will not come
            logs a warning saying so.
    """

    def __init__(
        self,
        shell: Shell,
        links: UnitLinks,
        *,
        default_lease: float | None,
        waiting_warning_after: float,
    ) -> None:
        self.shell = shell
        self.core = shell.core
        self.links = links
        self.default_lease = default_lease
        #: seconds after which a get_meta waiting on fields (or a partition) that do not
        #: exist, or on an unsealed partition that got no new rows, logs a warning saying so
        self.waiting_warning_after = waiting_warning_after
        #: unsealed partitions watched for going quiet while a task waits on them
        self._quiet: dict[tuple[str, str], _QuietWatch] = {}
        #: (task, what, name, known name) of the typos already said (see _warn_if_typo)
        self._typos_said: set[tuple[str, str, str, str]] = set()
        #: recent answered fetches (client, request id) -> what a late Cancel gives back
        self._fetched: OrderedDict[tuple[bytes, int], tuple[Any, ...]] = OrderedDict()

    @property
    def state(self) -> ControllerState:
        """The core's state, for reading."""
        return self.shell.state

    def on_cancel(self, msg: Incoming, body: Cancel) -> Any:
        key = (msg.peer, body.target)
        if self.shell.watch.cancel(key):
            return SENT  # a parked watch: gone
        scope = self.shell.pending.get(key)
        if scope is not None:
            scope.cancel()  # still waiting: it ends without consuming anything
            return SENT  # one-way
        undo = self._fetched.pop(key, None)
        if undo is not None:
            # answered, but the caller gave up before the reply reached it: the rows go
            # back now, before any later request of that client is served (a client-side
            # Release after the late reply arrived could come after its end-of-stream)
            self.shell.apply(self.core.release(*undo))
        late = self.shell.undos.pop(key, None)
        if late is not None:
            # an admitted rollout, recycled rows taken, whose caller gave up (its client may
            # be closing: a reply arriving then would undo nothing): undone now
            late()
        elif undo is None:
            self.shell.cancelled_unseen(key)
        return SENT

    def send_meta(self, peer: bytes, rid: int, req: GetMeta, reply: MetaReply) -> None:
        """Answer a get_meta (with the batches its ``also`` asked for that the core decided
        along, ``reply.more``); a ``get`` whose cells are small and local gets them too.

        A retried ``get`` is answered without the cells (it reads them from the units).
        """
        scope = self.shell.pending.get((peer, rid)) if self.shell.pending else None
        if scope is not None and scope.cancel_called:
            # the Cancel came while the answer was on its way (the waiting request had
            # already been woken): the caller is gone, so the rows go back, unsent
            self.shell.apply(self.core.cancel(req, reply))
            return
        if reply.rows and req.mode == "fetch" and record_key(req) is None:
            self._remember_fetch(peer, rid, req, reply)
        answers = [reply, *reply.more] if reply.more else [reply]
        if req.mode == "fetch" and self.shell.metrics.enabled:
            self._count_locality(req, answers)
        epoch = self.state.units_epoch
        for r in answers:
            r.units_epoch = epoch
        inline: list[tuple[MetaReply, list[StoredColumns]]] = []
        frames: list[Any] = []
        budget = req.inline_bytes
        for r in answers:
            got = self._read_inline(req, r, budget) if budget > 0 and r.rows else None
            if got is not None:
                inline.append((r, got[0]))
                frames += got[1]
                budget -= got[2]
        if not inline:
            self.shell.send_ok(peer, rid, reply)
            return
        without = ok_reply(rid, reply)
        for r, parts in inline:
            r.inline = parts
        self.shell.send(peer, rid, ok_reply(rid, reply), frames)
        self.shell.remember(peer, rid, without)  # the cache keeps no cells alive

    def _count_locality(self, req: GetMeta, answers: list[MetaReply]) -> None:
        """Count the delivered rows by whether their unit is on the consumer's host."""
        hosts = self.state.unit_hosts
        for r in answers:
            same = sum(1 for u in r.units if same_host(hosts.get(u, ""), req.host))
            self.shell.metrics.delivered(req.task_name, same, len(r.units) - same)

    def _remember_fetch(self, peer: bytes, rid: int, req: GetMeta, reply: MetaReply) -> None:
        """What a Cancel of this answered fetch undoes (the last ``_REPLY_CACHE`` fetches)."""
        fetched = self._fetched
        fetched[(peer, rid)] = _undo_of(req, reply)
        if len(fetched) > FETCHES_REMEMBERED:
            fetched.popitem(last=False)

    def _read_inline(
        self, req: GetMeta, reply: MetaReply, budget: int
    ) -> tuple[list[StoredColumns], list[Any], int] | None:
        """The reply's cells from units in this process and their size in bytes, or None
        (remote units, more than ``budget`` bytes)."""
        by_unit = positions_by_unit(reply.units)
        if any(u not in self.links.local_units for u in by_unit):
            return None
        parts: list[StoredColumns] = []
        frames: list[Any] = []
        size = 0
        for unit_id, positions in by_unit.items():
            rows = reply.rows if len(by_unit) == 1 else [reply.rows[i] for i in positions]
            try:
                got = self.links.local_units[unit_id].read_local(
                    req.partition_id, rows, reply.fields, budget - size, req.host, req.task_name
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

    def on_get_meta(self, msg: Incoming, req: GetMeta) -> Any:
        if req.lease is None and self.default_lease is not None:
            req.lease = self.default_lease
        fx = Effects()
        try:  # one call into the core decides the request; its effects are applied once
            decision = self.core.decide(req, self.shell.now(), fx)
        finally:
            self.shell.apply(fx)
        if isinstance(decision, Awaiting):
            self.shell.spawn_waiting(
                msg, self._get_meta_waiting, msg, req, decision, self.shell.lot.generation
            )
            return DEFERRED
        if isinstance(decision, MetaReply):
            self.send_meta(msg.peer, msg.rid, req, decision)
            return SENT
        if req.timeout == 0:  # answer now or not at all
            self.shell.send_error(
                msg.peer, msg.rid, TQTimeoutError(self._get_meta_timeout(req)), "GetMeta"
            )
            return SENT
        self.shell.spawn_waiting(
            msg, self._get_meta_waiting, msg, req, None, self.shell.lot.generation
        )
        self._warn_if_typo(req)
        if _why_waiting(self.state, req) is not None:  # a typo would wait silently forever
            self.shell.call_later(
                self.waiting_warning_after, self._warn_if_still_waiting, msg.peer, msg.rid, req
            )
        elif (req.partition_id, req.task_name) not in self._quiet:
            # a forgotten seal would too: one watch per (partition, task) with waiters
            self._watch_quiet(_QuietWatch(req, _progress(self.state, req)))
        return DEFERRED

    def _watch_quiet(self, watch: _QuietWatch) -> None:
        key = (watch.req.partition_id, watch.req.task_name)
        self._quiet[key] = watch
        self.shell.call_later(self.waiting_warning_after, self._check_quiet, key)

    def _check_quiet(self, key: tuple[str, str]) -> None:
        """Warn once if the task still waits on an unsealed partition that made no progress."""
        watch = self._quiet.pop(key)
        p = self.state.partitions.get(key[0])
        if self.shell.stopping or not self.shell.lot.parked(key) or p is None or p.sealed:
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

    def _warn_if_typo(self, req: GetMeta) -> None:
        """Say at once (not after ``waiting_warning_after``) when a waiting get_meta names a
        field or partition one or two edits from a known one: almost surely a typo. Once per
        (task, name, known name): a consumer that really waits for it is told only once."""
        typo = _typo(self.state, req)
        if typo is None or (req.task_name, *typo) in self._typos_said:
            return
        if len(self._typos_said) >= 1024:  # bounded: forgetting means saying one again
            self._typos_said.clear()
        self._typos_said.add((req.task_name, *typo))
        what, name, known = typo
        log.warning(
            f"get_meta waits for {what} {name!r}, which does not exist: did you mean {known!r}? "
            f"(it waits until a put creates {name!r}; its timeout error will say this again)",
            partition=req.partition_id,
            task=req.task_name,
            fields=list(req.data_fields),
        )

    def _warn_if_still_waiting(self, peer: bytes, rid: int, req: GetMeta) -> None:
        why = _why_waiting(self.state, req)
        if (peer, rid) in self.shell.pending and why is not None:
            log.warning(
                f"get_meta has waited {self.waiting_warning_after:g} s: {why}",
                partition=req.partition_id,
                task=req.task_name,
                fields=list(req.data_fields),
            )

    def _decide(
        self, peer: bytes, rid: int, req: GetMeta, awaiting: Awaiting | None, answer: Any
    ) -> Outcome:
        """Look again after a wake-up (``awaiting`` None), or go on with an ``async``
        sampler's answer: one call into the core, its effects applied once. A request
        cancelled meanwhile decides no batch ahead (its answer is undone, not sent)."""
        scope = self.shell.pending.get((peer, rid))
        ahead = scope is None or not scope.cancel_called
        fx = Effects()
        try:
            if awaiting is None:
                return self.core.decide(req, self.shell.now(), fx, again=True, ahead=ahead)
            return self.core.resume(req, awaiting, answer, self.shell.now(), fx, ahead=ahead)
        finally:
            self.shell.apply(fx)

    async def _get_meta_waiting(
        self,
        msg: Incoming,
        req: GetMeta,
        first: Awaiting | None,
        generation: int,
    ) -> None:
        peer, rid, t0 = msg.peer, msg.rid, msg.t0
        pid, task = req.partition_id, req.task_name
        structlog.contextvars.bind_contextvars(rid=rid, op="GetMeta", partition=pid, task=task)

        async def work() -> None:
            awaiting = first
            # woken since the request was decided, before this task took a ticket: look again
            look = self.shell.lot.generation != generation
            while True:
                # a ticket before looking, so a wake-up between the two is never missed
                with self.shell.lot.ticket((pid, task)) as fut:
                    decision: Outcome = None
                    if awaiting is not None:  # the first call's async sampler
                        decision, awaiting = awaiting, None
                    elif look:
                        decision, look = self._decide(peer, rid, req, None, None), False
                    while isinstance(decision, Awaiting):
                        answer = await decision.answer
                        decision = self._decide(peer, rid, req, decision, answer)
                    if isinstance(decision, MetaReply):
                        self.send_meta(peer, rid, req, decision)
                        self.shell.metrics.consumer_wait(time.perf_counter() - t0)
                        return
                    if req.timeout == 0:  # a sampler's answer was awaited, rows are not
                        raise TimeoutError
                    if not fut.done() and not look:  # (a wake-up the first answer missed)
                        await fut
                look = True  # something changed: look again

        await self.shell.waiting_request(
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

    def handlers(self) -> dict[type, Handler]:
        """The request types this part handles, and their handlers."""
        return {GetMeta: self.on_get_meta, Cancel: self.on_cancel}


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
    """The arguments of `ControllerCore.release` that undo a fetch's answer.

    Only atomic values (the rows as a tuple, not the reply's list): the garbage collector
    stops tracking such a tuple, and 16,384 remembered fetches tracked cost the control
    plane ~10 % of its calls in full collections (W2, 4 clients in one process).
    """
    return (req.partition_id, req.task_name, tuple(reply.rows), reply.incarnation, reply.lease_id)


def _why_waiting(state: ControllerState, req: GetMeta) -> str | None:
    """What a waiting get_meta lacks that more rows of the known fields would not bring."""
    p = state.partitions.get(req.partition_id)
    if p is None:
        known = sorted(state.partitions)
        guess = _close_match(req.partition_id, known)
        return (
            f"partition {req.partition_id!r} does not exist (no put has created it); "
            f"known partitions: {known[:20]}" + (f"; did you mean {guess!r}?" if guess else "")
        )
    missing = [f for f in req.data_fields if f not in p.fields]
    if not missing:
        return None
    guesses = [(f, _close_match(f, p.fields)) for f in missing]
    hint = "".join(f"; did you mean {g!r} for {f!r}?" for f, g in guesses if g)
    return (
        f"no row of partition {req.partition_id!r} has the field(s) {missing} (it has "
        f"{sorted(p.fields)}){hint}; check the field names, and that the task that writes "
        "them is running (it may have failed)"
    )


def _typo(state: ControllerState, req: GetMeta) -> tuple[str, str, str] | None:
    """``(what, name, known name)`` when the request names a partition or field that does not
    exist but is one or two edits from one that does."""
    p = state.partitions.get(req.partition_id)
    if p is None:
        guess = _close_match(req.partition_id, state.partitions)
        return None if guess is None else ("partition", req.partition_id, guess)
    for f in req.data_fields:
        if f not in p.fields:
            guess = _close_match(f, p.fields)
            if guess is not None:
                return "field", f, guess
    return None


def _close_match(name: str, known: Collection[str]) -> str | None:
    """The known name one or two edits from ``name`` (the closest, first on a tie), if any.

    Short names allow fewer edits (none below 3 characters, one below 6), and names that
    differ only in their digits are siblings, not typos (``train@4`` waits for the step
    after ``train@3``; ``reward2`` next to ``reward1``).
    """
    allowed = min(2, len(name) // 3)
    if allowed == 0 or len(known) > 4096:  # a cheap check on a wait, not a search
        return None
    best: tuple[int, str] | None = None
    for k in known:
        if abs(len(k) - len(name)) > allowed or _siblings(k, name):
            continue
        d = _edits(name, k, allowed)
        if d <= allowed and (best is None or d < best[0]):
            best = (d, k)
    return None if best is None else best[1]


def _siblings(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are the same once their digits are taken out."""
    return "".join(c for c in a if not c.isdigit()) == "".join(c for c in b if not c.isdigit())


def _edits(a: str, b: str, cap: int) -> int:
    """Levenshtein distance of ``a`` and ``b`` (insert, delete, substitute), or ``cap + 1``
    as soon as it is known to exceed ``cap``."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        if min(current) > cap:
            return cap + 1
        previous = current
    return previous[-1]
