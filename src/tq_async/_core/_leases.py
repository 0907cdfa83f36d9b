"""Get-side leases: what delivered rows owe until the consumer acknowledges them.

A **lease** keeps delivered rows consumed only once acknowledged before a deadline; a
**hold** (a lease without one) keeps auto-clear away until acknowledged. A lease belongs to
its recorded batch, not to the caller: replays share it and an ack from any reader settles it
(see `tq_async._core._transitions` for the words). `GetLeases` gives, takes over,
acknowledges, expires and releases them, and frees the rows every auto-clear task consumed
once nobody holds them. Plain bookkeeping over the partitions; deadlines go to the core's one
heap through ``arm``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from .._logging import get_logger
from .._wire._protocol import GetMeta
from ._admission import Admission
from ._effects import Effects
from ._state import ControllerState, Lease, Partition, RecordKey, Wakeup

__all__ = ["RECYCLED_HOLDER", "GetLeases"]

#: the task name on the hold of rows a `take_recycled` handed out (acknowledged by its caller
#: once their prompts are read: auto-clear may free them then)
RECYCLED_HOLDER = "take_recycled"

#: the fewest ids `GetLeases.batch_home` holds before it drops those of forgotten batches
BATCH_HOME_MIN = 1024

log = get_logger(__name__)


class GetLeases:
    """Every lease and hold of the get side (see the module docstring).

    Args:
        state: the partitions.
        ids: the core's id counter (lease ids are unique among put ids too).
        arm: ``arm(deadline, "lease", lease_id)`` puts a deadline on the core's heap.
        rollouts: admission, whose slots rows given back to the learner take again.
    """

    def __init__(
        self,
        state: ControllerState,
        ids: itertools.count[int],
        arm: Callable[[float, str, int], None],
        rollouts: Admission,
    ) -> None:
        self.state = state
        self.rollouts = rollouts
        self._ids = ids
        self._arm = arm
        #: lease id -> the partition holding it (gone with the partition)
        self.home: dict[int, Partition] = {}
        #: lease id of a recorded batch -> its partition, also after the lease ended (until
        #: the batch is forgotten: `tq_async._core._forgotten`; `_prune` drops those)
        self.batch_home: dict[int, Partition] = {}
        #: `batch_home` is pruned once it holds this many ids
        self._prune_at = BATCH_HOME_MIN

    def live(self, lease_id: int, deadline: float) -> bool:
        """Whether a heap entry still stands for the lease's deadline."""
        p = self.home.get(lease_id)
        return p is not None and p.leases[lease_id].deadline == deadline

    def forget(self, p: Partition) -> None:
        """``p`` is gone (cleared): its leases and recorded batches with it."""
        for lease_id in p.leases:
            self.home.pop(lease_id, None)
        for lease_id in p.lease_batch:
            self.batch_home.pop(lease_id, None)

    def reset(self, p: Partition, task: str | None) -> None:
        """Drop the leases and recorded batches of ``task`` (every task if None)."""
        for lease in list(p.leases.values()):
            if task is None or lease.task == task:
                self.drop(p, lease)
        p.settled = {k for k in p.settled if task is not None and k[0] != task}
        for key in [k for k in p.batch_holds if task is None or k[0] == task]:
            _unhold(p, p.batch_holds.pop(key))
        for lease_id, key in list(p.lease_batch.items()):
            if task is None or key[0] == task:
                del p.lease_batch[lease_id]
                self.batch_home.pop(lease_id, None)
        p.recorded = {k: v for k, v in p.recorded.items() if task is not None and k[0] != task}
        p.forgotten = {k: v for k, v in p.forgotten.items() if task is not None and k[0] != task}
        p.recorded_rows = {
            t: m for t, m in p.recorded_rows.items() if task is not None and t != task
        }

    def take_over(self, p: Partition, lease_id: int, req: GetMeta, now: float) -> None:
        """A new reader of a recorded batch takes its lease over: a lease asked for pushes
        the deadline (a hold becomes a lease)."""
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

    def new_lease(
        self,
        p: Partition,
        req: GetMeta,
        rows: tuple[int, ...],
        key: RecordKey | None,
        now: float,
    ) -> int:
        lease_id = next(self._ids)
        deadline = None if req.lease is None else now + req.lease
        self.adopt(p, Lease(lease_id, req.task_name, rows, key, deadline))
        self.state.events.lease(p.partition_id, req.task_name, lease_id, rows, req.lease)
        return lease_id

    def adopt(self, p: Partition, lease: Lease) -> None:
        """Give ``lease`` (a new one, or one a recovering controller read from its journal)."""
        lease_id, key, deadline = lease.lease_id, lease.key, lease.deadline
        p.leases[lease_id] = lease
        self.home[lease_id] = p
        if key is not None:
            p.batch_leases[key] = lease_id
            p.lease_batch[lease_id] = key
            self.batch_home[lease_id] = p
            if len(self.batch_home) >= self._prune_at:
                self._prune()
        if deadline is not None:
            p.open_leases[lease.task] = p.open_leases.get(lease.task, 0) + 1
            self._arm(deadline, "lease", lease_id)
        _hold(p, lease.rows)

    def _prune(self) -> None:
        """Drop the ids of `batch_home` whose batch its partition forgot; prune again once
        as many more were added (each id is looked at O(1) times, amortised)."""
        home = self.batch_home
        for lease_id in [i for i, p in home.items() if i not in p.lease_batch]:
            del home[lease_id]
        self._prune_at = max(BATCH_HOME_MIN, 2 * len(home))

    def drop(self, p: Partition, lease: Lease, *, acked: bool = False) -> None:
        del p.leases[lease.lease_id]
        self.state.events.lease_ended(p.partition_id, lease.task, lease.lease_id, acked=acked)
        self.home.pop(lease.lease_id, None)
        if lease.key is not None and p.batch_leases.get(lease.key) == lease.lease_id:
            del p.batch_leases[lease.key]
        if lease.deadline is not None:
            p.open_leases[lease.task] -= 1
            if not p.open_leases[lease.task]:
                del p.open_leases[lease.task]
        _unhold(p, lease.rows)

    def ack(self, lease_ids: Sequence[int], now: float) -> Effects:
        """Acknowledge leases and holds: their rows stay consumed for good.

        An ack of a recorded batch settles it for every reader. Unknown ids (already
        acknowledged, expired, or of a cleared partition) are ignored: acks are idempotent.
        """
        fx = Effects()
        for lease_id in lease_ids:
            p = self.home.get(lease_id)
            if p is None:
                fx.add(self._late_ack(lease_id))
                continue
            lease = p.leases[lease_id]
            self.drop(p, lease, acked=True)
            if lease.key is not None:
                _settle(p, lease.key)
            if lease.deadline is not None:
                fx.wakeups.append(Wakeup(p.partition_id, lease.task))  # end-of-stream may be due
            self.auto_clear(p, lease.rows, fx)
        return fx

    def _late_ack(self, lease_id: int) -> Effects:
        """An ack of an expired (or replaced) lease of a recorded batch still settles it.

        Its rows never left the batch, so the consumer's work stands. An expired lease
        without a batch is ignored: its rows went back to the pool (at-least-once).
        """
        p = self.batch_home.get(lease_id)
        if p is None or self.state.partitions.get(p.partition_id) is not p:
            return Effects()
        key = p.lease_batch.get(lease_id)  # (None: the batch was forgotten, its rows gone)
        if key is None or key in p.settled or key not in p.recorded:
            return Effects()
        live = p.batch_leases.get(key)
        if live is not None:
            return self.ack([live], 0.0)  # the batch's current lease, settled for everyone
        _settle(p, key)
        fx = Effects()
        self.auto_clear(p, p.recorded[key], fx)
        return fx

    def expire(self, lease_id: int, deadline: float, fx: Effects) -> None:
        p = self.home.get(lease_id)
        if p is None:
            return
        lease = p.leases[lease_id]
        if lease.deadline != deadline:
            return  # renewed (a stale heap entry)
        self.drop(p, lease)
        if lease.key is not None:
            # the rows stay recorded and consumed: the next reader of the batch gets them,
            # and auto-clear leaves them to it
            self.hold_batch(p, lease.key)
            log.info(
                "lease expired: the batch waits for its next reader",
                partition=p.partition_id,
                task=lease.task,
                batch=lease.key,
                rows=len(lease.rows),
            )
        elif self._release(p, lease.task, lease.rows):
            log.info(
                "lease expired: rows go back to the task",
                partition=p.partition_id,
                task=lease.task,
                rows=len(lease.rows),
            )
        fx.wakeups.append(Wakeup(p.partition_id, lease.task))

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
        (`cancel` for a request still waiting): its lease or hold (``lease_id``) is
        dropped, not acknowledged — an expiry must not give the rows back a second time,
        and a hold's rows are not auto-cleared — and its rows are ready for ``task`` again.
        Rows of a recorded batch stay with the batch (its next reader gets them), and so
        does its lease. A lease that ended gives nothing back: it expired (its rows went
        back then, and another consumer may hold them now) or was acknowledged.
        """
        fx = Effects()
        p = self.state.partition(partition_id)
        p.check_incarnation(incarnation)
        lease = p.leases.get(lease_id) if lease_id else None
        if lease_id and lease is None:
            return fx
        if lease is not None and lease.key is None and lease.task == task:
            self.drop(p, lease)
            if lease.deadline is not None:
                fx.wakeups.append(Wakeup(partition_id, task))  # end-of-stream may be due
        # (only ``task``'s batches: another task's record of a row is no claim on it here)
        mask, base = p.recorded_rows.get(task), p.base
        back = [
            r for r in rows if mask is None or not 0 <= r - base < len(mask) or not mask[r - base]
        ]
        if back and self._release(p, task, back):
            fx.wakeups.append(Wakeup(partition_id, task))
        return fx

    def _release(self, p: Partition, task: str, rows: Sequence[int]) -> bool:
        """Undo the consumption of ``rows`` by ``task``; True if any row became ready again.

        Rows the learner gives back are admitted and unconsumed again: they take back the
        admission slots their consumption freed, or consuming them again frees them twice."""
        back = p.release(task, rows)
        self.rollouts.learner_released(task, p, back)
        return bool(back)

    def hold_batch(self, p: Partition, key: RecordKey) -> None:
        """Recorded batch ``key``, unsettled and without a lease (its lease ran out, or a
        rank's share of a global batch it has not read yet), holds its rows until it is
        settled (acknowledged by its next reader): auto-clear must not free rows it owes.
        Only for an auto-clear task (the rows of others are never its concern)."""
        rows = p.recorded.get(key)
        if rows is None or key in p.settled or key in p.batch_holds:
            return
        if not self.state.auto_clears(p, key[0]):
            return
        p.batch_holds[key] = rows
        _hold(p, rows)

    def hold_recycled(self, p: Partition, rows: Sequence[int]) -> None:
        """``rows`` of ``p`` are queued for `take_recycled`: auto-clear keeps them until they
        are taken and acknowledged (their prompts must be read). One hold per queue entry,
        given up by `take_recycled` for the hold of its caller (`hold_taken`)."""
        _hold(p, rows)

    def unhold_recycled(self, p: Partition, rows: Sequence[int]) -> None:
        """``rows`` of ``p`` left the `take_recycled` queue (`hold_recycled`)."""
        _unhold(p, rows)

    def hold_taken(self, p: Partition, rows: Sequence[int]) -> int:
        """The hold of a `take_recycled` caller on ``rows``, acknowledged as a lease (its
        id); 0 when no task of ``p`` auto-clears (nothing would free them)."""
        if not self.state.auto_clear.get(p.partition_id, self.state.auto_clear.get(None)):
            return 0
        lease_id = next(self._ids)
        self.adopt(p, Lease(lease_id, RECYCLED_HOLDER, tuple(rows), None, None))
        self.state.events.lease(p.partition_id, RECYCLED_HOLDER, lease_id, rows, None)
        return lease_id

    def drop_taken(self, p: Partition, lease_id: int) -> None:
        """A `take_recycled` caller gave up before it saw its rows: its hold goes (not
        acknowledged; the rows are queued again, held there)."""
        lease = p.leases.get(lease_id)
        if lease is not None and lease.task == RECYCLED_HOLDER:
            self.drop(p, lease)

    def hold_waiting(self, p: Partition) -> None:
        """``p`` was rebuilt (a restart, a checkpoint restored): its recorded batches with no
        lease, waiting for their next reader, hold their rows again (`hold_batch`)."""
        for key in p.recorded:
            if key not in p.batch_leases:
                self.hold_batch(p, key)

    def auto_clear(self, p: Partition, rows: Sequence[int], fx: Effects) -> None:
        """Free rows every auto-clear task consumed, unless a consumer still holds them."""
        if not self.state.auto_clear or self.state.partitions.get(p.partition_id) is not p:
            return
        held = p.held
        done = [r for r in self.state.auto_clear_done(p, rows) if r not in held]
        if done:
            fx.room = True
            # rows the learner never consumed (it is not an auto-clear task) never reach it
            if self.rollouts.free_unconsumed(p, done):
                fx.admission = True
            fx.free.append((p.partition_id, p.incarnation, dict(p.clear_rows(done, "auto_clear"))))


def _settle(p: Partition, key: tuple[str, int, int]) -> None:
    """A recorded batch is settled (acknowledged): never replayed again, its rows no longer
    held for it; the journal's next delta names it (`Changes.settled`)."""
    p.settled.add(key)
    rows = p.batch_holds.pop(key, None)
    if rows is not None:
        _unhold(p, rows)
    if p.changes is not None:
        p.changes.settled.append(key)


def _hold(p: Partition, rows: Sequence[int]) -> None:
    """One holder more for each of ``rows``."""
    held = p.held
    for r in rows:
        held[r] = held.get(r, 0) + 1


def _unhold(p: Partition, rows: Sequence[int]) -> None:
    """One holder less for each of ``rows``."""
    held = p.held
    for r in rows:
        n = held.get(r, 0) - 1
        if n > 0:
            held[r] = n
        else:
            held.pop(r, None)
