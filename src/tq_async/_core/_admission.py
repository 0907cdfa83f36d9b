"""Rollout admission and stale-row accounting: a pure part of the controller's core.

`Admission` decides whether a rollout may start (``acquire_rollout``: the staleness
bound and the capacity of `AdmissionConfig`), gives slots back as
the learner consumes rows or rows are cleared unconsumed, and counts stale rows once for the
status and the metrics.

Slots not put yet belong to their *holder*: a connection's identity, or the name an
asynchronous client gives itself (the same across its reconnects and a restart of a durable
controller). A named holder's slots are under a *slot lease* its client renews while it
holds any (`lease`); a holder that stops renewing gives them back when it lapses (`expire`).
No loop, no clock: `ControllerCore` calls it with ``now`` and arms its deadlines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .._errors import InvalidRequestError
from .._logging import get_logger
from .._wire._protocol import GetMeta
from ..samplers import StaleRows
from ._effects import AdmissionConfig, Effects
from ._state import ControllerState, Partition, Wakeup

__all__ = ["ADMITTED_TOKENS", "Admission"]

log = get_logger(__name__)

#: admissions remembered by token (`ControllerState.admitted`, journaled with the controller's
#: own state): a client asks again within seconds of losing a reply, while at most a few
#: admissions per producer happen in between
ADMITTED_TOKENS = 256

#: connections whose holder name is remembered (`Admission.peers`): a client's connection
#: is named again by its next renewal, so only the latest few thousand are kept
NAMED_PEERS = 4096


class Admission:
    """Admission slots and stale-row counts over ``state`` (see the module docstring).

    Args:
        state: the controller's state.
        config: the bounds, and the slot lease.
        arm: ``arm(deadline, "slots", holder)`` schedules `expire` (none: slot leases
            never lapse).
    """

    def __init__(
        self,
        state: ControllerState,
        config: AdmissionConfig,
        arm: Callable[[float, str, bytes], None] | None = None,
    ) -> None:
        self.state = state
        self.config = config
        self._arm = arm
        #: connection identity -> the holder its client names itself (learned from its
        #: acquires and renewals; not journaled: a restarted controller learns it again)
        self.peers: dict[bytes, bytes] = {}

    def free_unconsumed(self, p: Partition, rows: Sequence[int]) -> bool:
        """Cleared rows the learner never consumed give their admission slots back."""
        task = self.config.learner_task
        if task is None:
            return False
        consumed, base = p.consumed.get(task), p.base
        freed = sum(
            1
            for r in set(rows)
            if p.is_alive(r)
            and p.versions.rows[r - base] >= 0
            and not (consumed and consumed[r - base])
        )
        return self.free_slots(freed)

    def learner_consumed(self, task: str, p: Partition, rows: Sequence[int]) -> bool:
        """The learner consumed ``rows``: their slots go back; True if any was outstanding."""
        if self.config.learner_task != task:
            return False
        rv, base = p.versions.rows, p.base
        return self.free_slots(sum(1 for r in rows if rv[r - base] >= 0))

    def learner_released(self, task: str, p: Partition, rows: Sequence[int]) -> None:
        """The learner gave ``rows`` back unconsumed (a release, a lease that expired): they
        take again the slots their consumption freed (`learner_consumed`), or consuming
        them again would free them twice."""
        if self.config.learner_task == task:
            rv, base = p.versions.rows, p.base
            self.state.outstanding += sum(1 for r in rows if r >= base and rv[r - base] >= 0)

    def learner_reset(self, p: Partition, task: str | None) -> None:
        """``task``'s consumption of ``p`` is about to be forgotten (every task's if None):
        the learner's rows are unconsumed again and take their slots back (`learner_released`)."""
        learner = self.config.learner_task
        if learner is None or task not in (None, learner):
            return
        consumed = p.consumed.get(learner)
        if consumed is not None:
            alive, base = p.alive, p.base
            rows = [i + base for i in range(len(alive)) if consumed[i] and alive[i]]
            self.learner_released(learner, p, rows)

    def free_slots(self, n: int) -> bool:
        """Give back ``n`` admission slots; True if any was outstanding."""
        if n <= 0:
            return False
        self.state.outstanding = max(0, self.state.outstanding - n)
        return True

    def release(self, n: int, holder: bytes = b"") -> bool:
        """``holder`` gives back ``n`` slots of rollouts that will not be put (a
        ``release_rollout``, an admission cancelled): True if any was outstanding."""
        self.settle(n, holder)
        return self.free_slots(n)

    def unversioned(self, partition_id: str, rows: Sequence[int]) -> int:
        """How many of ``rows`` count against no admission yet (no policy version): a put
        giving them one settles as many slots (`settle`). 0 while no slot has a holder."""
        if not self.state.holders:
            return 0
        p = self.state.partitions.get(partition_id)
        if p is None:
            return 0
        rv, n_rows, base = p.versions.rows, p.n_rows, p.base
        return sum(1 for r in set(rows) if base <= r < n_rows and rv[r - base] < 0)

    def settle(self, n: int, holder: bytes = b"") -> None:
        """``n`` admitted slots were put (or released) by ``holder``: they are settled on
        its own slots first, then on the oldest holders' (a rollout manager acquires, its
        workers put from their own clients). Settled slots stay outstanding until the
        learner consumes their rows; only the unsettled ones go back with their holder."""
        holders, leases = self.state.holders, self.state.slot_leases
        holder = self.peers.get(holder, holder)
        own = holders.get(holder, 0)
        if n < own:  # (the usual put: its own producer's, nothing else to look at)
            holders[holder] = own - n
            return
        n -= holders.pop(holder, 0)
        leases.pop(holder, None)
        for h in list(holders):
            if n <= 0:
                return
            take = min(n, holders[h])
            n -= take
            if take == holders[h]:
                del holders[h]
                leases.pop(h, None)
            else:
                holders[h] -= take

    def holder_gone(self, holder: bytes) -> bool:
        """``holder`` is gone (its process died, or it closed its client): the slots it
        acquired and never put go back. True if any was outstanding."""
        self.state.slot_leases.pop(holder, None)
        return self.free_slots(self.state.holders.pop(holder, 0))

    def peer_gone(self, peer: bytes) -> bool:
        """A client's connection ended (a same-host client's process died, or it closed
        its client): the slots of the holder it named go back (`holder_gone`)."""
        return self.holder_gone(self.peers.pop(peer, peer))

    def named(self, peer: bytes, holder: bytes) -> None:
        """Connection ``peer`` speaks for ``holder`` now: its puts and releases settle
        ``holder``'s slots first, its end (`peer_gone`) gives them back."""
        peers = self.peers
        if peers.get(peer) != holder:
            peers[peer] = holder
            if len(peers) > NAMED_PEERS:
                del peers[next(iter(peers))]

    def lease(self, holder: bytes, now: float) -> None:
        """``holder``'s client renews its slots (it acquired some, or renewed them): they
        lapse a slot lease from ``now`` unless renewed again."""
        if holder not in self.state.holders or self._arm is None:
            return  # (its slots were put meanwhile: nothing to keep)
        deadline = now + self.config.slot_lease
        self.state.slot_leases[holder] = deadline
        self._arm(deadline, "slots", holder)

    def live(self, holder: bytes, deadline: float) -> bool:
        """Whether ``holder``'s slot lease still ends at ``deadline`` (not renewed, put)."""
        return self.state.slot_leases.get(holder) == deadline

    def expire(self, holder: bytes, deadline: float, fx: Effects) -> None:
        """``holder``'s slot lease lapsed at ``deadline`` (its client stopped renewing it: it
        died over TCP, or a restarted controller's holder never came back): its slots not
        put go back."""
        if not self.live(holder, deadline):
            return
        n = self.state.holders.get(holder, 0)
        log.warning(
            "admission slots not renewed by their producer given back",
            slots=n,
            lease_s=self.config.slot_lease,
        )
        fx.admission |= self.holder_gone(holder)

    def recovered(self, leased: Sequence[bytes], now: float) -> None:
        """A restarted controller's recovered holders that renewed: each gets a full slot
        lease for its client to reconnect and renew (`lease`)."""
        for holder in leased:
            self.lease(holder, now)

    def admissible(self, version: int, n: int) -> bool:
        """Whether a rollout of ``n`` rows at policy ``version`` may start now."""
        cfg, st = self.config, self.state
        if cfg.max_staleness is not None and version - max(st.learner_version, 0) > (
            cfg.max_staleness
        ):
            return False
        return cfg.capacity is None or st.outstanding + n <= cfg.capacity

    def acquire(
        self,
        version: int,
        n: int,
        token: int = 0,
        holder: bytes = b"",
        now: float | None = None,
    ) -> bool:
        """Admit a rollout if it fits now (True), else leave everything as it is.

        A ``token`` admitted before (one of the last `ADMITTED_TOKENS`, with as many rows) is
        admitted again without taking slots: its client asks again because the first reply
        was lost (the controller died after recording it). The slots are ``holder``'s until
        rows are put (`settle`): a holder gone gives back those left (`holder_gone`). With
        ``now`` the holder renews them (a slot lease from ``now``: `lease`)."""
        if token and self.state.admitted.get(token) == n:
            return True
        if version < 0 or n < 1:
            raise InvalidRequestError("acquire_rollout needs policy_version >= 0 and n >= 1")
        cap = self.config.capacity
        if cap is not None and n > cap:
            raise InvalidRequestError(
                f"a rollout of {n} rows can never fit the capacity of {cap}; acquire "
                "fewer rows at a time or raise the capacity"
            )
        if not self.admissible(version, n):
            return False
        self.state.outstanding += n
        if holder:
            holders = self.state.holders
            holders[holder] = holders.get(holder, 0) + n
            if now is not None:
                self.lease(holder, now)
        if token:
            admitted = self.state.admitted
            admitted[token] = n
            if len(admitted) > ADMITTED_TOKENS:
                del admitted[next(iter(admitted))]
        return True

    def set_policy_version(self, version: int) -> Effects:
        """The learner moved: rollouts may start, and rows may have gone stale."""
        st = self.state
        if version < st.learner_version:
            log.warning("policy version went backwards", old=st.learner_version, new=version)
        st.learner_version = version
        return Effects(admission=True, wakeups=[Wakeup(pid) for pid in st.partitions])

    def count_stale(self, kind: str, n: int, fx: Effects) -> None:
        """Stale rows handled: the status and the metrics count the same events, once."""
        if n > 0:
            self.state.stale_counts[kind] += n
            fx.stale.append((kind, n))

    def count_kept(
        self, req: GetMeta, stale: StaleRows, delivered: Sequence[int], fx: Effects
    ) -> None:
        """Stale rows a sampler kept count once they are delivered, not when seen."""
        kept = set(stale.kept_rows)
        n = sum(1 for r in delivered if r in kept)
        if n:
            log.warning(
                "delivering stale rows",
                rows=n,
                partition=req.partition_id,
                task=req.task_name,
                learner_version=self.state.learner_version,
            )
            self.count_stale("kept", n, fx)
