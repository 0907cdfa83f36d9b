"""Storage-unit liveness: a pure part of the controller's core.

A unit that goes silent is *suspended* (its rows are neither handed out nor lost, end-of-stream
waits for them, new puts avoid it); it resumes when it comes back with its data, and is
*lost* when its process is confirmed gone or after ``Deadlines.unit_lost_after``. No loop,
no clock: `ControllerCore` calls it with ``now`` and arms its
deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .._logging import get_logger
from .._wire._events import UnitBack, UnitLost, UnitSuspended
from .._wire._protocol import HeldRows, StoreClear
from ._admission import Admission
from ._arrays import rows_on
from ._effects import Effects
from ._state import ControllerState, Wakeup

__all__ = ["UnitLiveness", "orphan_cells"]

log = get_logger(__name__)


class UnitLiveness:
    """Suspends, resumes and loses storage units of ``state``.

    Args:
        state: the controller's state.
        lost_after: seconds a suspended unit has to come back.
        arm: ``arm(deadline, "unit", unit)`` schedules `on_deadline`.
        rollouts: admission, to which lost rows the learner never consumed give their
            slots back.
    """

    def __init__(
        self,
        state: ControllerState,
        lost_after: float,
        arm: Callable[[float, str, int], None],
        rollouts: Admission,
    ) -> None:
        self.state = state
        self.rollouts = rollouts
        self.unit_lost_after = lost_after
        self._arm = arm

    def unit_down(self, unit: int, now: float, *, recovered: bool = False) -> Effects:
        """A unit missed its liveness deadline: suspend it (rows neither handed out nor lost).

        End-of-stream waits for its rows and new puts avoid it. It resumes with
        `unit_up`; `unit_lost` (or ``unit_lost_after`` seconds) loses its rows.
        ``recovered``: a controller restarted from its journal awaits the unit (no fault).
        """
        st = self.state
        if unit in st.dead_units or unit in st.suspended or unit not in st.units:
            return Effects()
        st.suspended[unit] = now + self.unit_lost_after
        st.unavailable.add(unit)
        self._arm(st.suspended[unit], "unit", unit)
        for p in st.partitions.values():
            for rs in p.ready.values():
                away = [r for r in rs.rows if p.units[r - p.base] == unit]
                for r in away:
                    rs.discard(r)
                if away:
                    p.moves += 1  # an async sampler's answer naming them samples again
        if st.events.on:
            st.events.add(UnitSuspended(unit=unit))
        if recovered:
            log.info(
                "storage unit awaited after the controller's restart: its rows wait until it "
                "comes back or is declared lost",
                unit=unit,
                address=st.units.get(unit),
                lost_after=self.unit_lost_after,
            )
        else:
            log.warning(
                "storage unit suspended: its rows wait until it comes back or is declared lost",
                unit=unit,
                address=st.units.get(unit),
                lost_after=self.unit_lost_after,
            )
        return Effects()

    def unit_up(self, unit: int) -> Effects:
        """A suspended unit came back with its data: its rows are handed out again."""
        st = self.state
        if st.suspended.pop(unit, None) is None:
            return Effects()
        st.unavailable.discard(unit)
        if st.events.on:
            st.events.add(UnitBack(unit=unit))
        fx = Effects()
        for pid, p in st.partitions.items():
            if unit in set(p.units):  # (a recorded batch of its rows may wait, see _gets)
                p.ready.clear()  # rebuilt on next use, with the unit's rows
                fx.wakeups.append(Wakeup(pid))
        log.info("storage unit resumed", unit=unit, address=st.units.get(unit))
        return fx

    def unit_lost(self, unit: int) -> Effects:
        """A unit's data is gone (its process died, or it restarted): its rows are lost."""
        st = self.state
        st.suspended.pop(unit, None)
        st.unavailable.discard(unit)
        if unit in st.dead_units:
            return Effects()
        st.dead_units.add(unit)
        fx = Effects(room=True)
        lost = {}
        for pid, p in st.partitions.items():
            # they never reach the learner: their slots go back, as cleared rows' do
            if self.rollouts.free_unconsumed(p, rows_on(p, unit)):
                fx.admission = True
            rows = p.lose_unit(unit)
            if rows:
                lost[pid] = len(rows)
                fx.wakeups.append(Wakeup(pid))
        if st.events.on:
            st.events.add(UnitLost(unit=unit))
        log.error("storage unit lost", unit=unit, address=st.units.get(unit), rows_lost=lost)
        return fx

    def unit_registered(self, unit: int, address: str, host: str = "") -> Effects:
        """A unit process (re)started under ``unit`` on ``host`` (its host id, ``""``:
        unknown): what an earlier one held is gone."""
        st = self.state
        fx = Effects()
        held_rows = any(unit in set(p.units) for p in st.partitions.values())
        if unit in st.units and (unit in st.suspended or held_rows):
            fx = self.unit_lost(unit)
        if st.units.get(unit) != address:
            st.units_epoch += 1  # clients learn the new address from their next reply
        st.units[unit] = address
        st.unit_hosts[unit] = host
        if unit in st.dead_units:  # a restarted unit takes new rows again
            st.dead_units.discard(unit)
            if st.events.on:  # (watchers saw it lost: it is up, without its old rows)
                st.events.add(UnitBack(unit=unit))
        return fx

    def unit_returned(self, unit: int, address: str, host: str = "") -> Effects:
        """A unit process restarted on its data_dir with the cells its predecessor held
        (the same instance token): its rows are handed out again, at its new address."""
        st = self.state
        if unit not in st.units or unit in st.dead_units:
            return self.unit_registered(unit, address, host)  # lost meanwhile: rows gone
        if st.units[unit] != address:
            st.units_epoch += 1  # clients learn the new address from their next reply
        st.units[unit] = address
        st.unit_hosts[unit] = host
        return self.unit_up(unit)

    def on_deadline(self, unit: int, deadline: float, fx: Effects) -> None:
        """A suspended unit's deadline passed: lose it, unless it resumed meanwhile."""
        if self.state.suspended.get(unit) == deadline:
            fx.add(self.unit_lost(unit))


def orphan_cells(state: ControllerState, unit: int, held: Sequence[HeldRows]) -> list[StoreClear]:
    """What ``unit``, back with its cells, holds and the controller no longer has, as the
    clears that free it: cells of rows the controller dropped while it could not tell the
    unit (a clear or an aborted put while the unit was away, or before the controller's
    restart), of rows placed on another unit (a put whose placement the controller lost
    with its restart, placed again elsewhere: rows never change units), and of partition
    incarnations it no longer has.

    Kept: cells of this unit's live rows (an uncommitted put's too: its rows are alive), of
    rows past the partition's end (a put may place them on this unit any moment), and of an
    unknown incarnation. Each clear names its incarnation, so a partition created again
    since frees nothing of its own.
    """
    out: list[StoreClear] = []
    for h in held:
        if not h.incarnation:
            continue
        p = state.partitions.get(h.partition_id)
        if p is None or p.incarnation != h.incarnation:
            out.append(StoreClear(h.partition_id, None, h.incarnation))
            continue
        rows = np.frombuffer(h.rows, "<i8")
        rows = rows[(rows >= 0) & (rows < p.n_rows)]
        held_now = len(p.alive)  # (rows below ``p.base`` are cleared)
        at = rows - p.base
        alive = np.frombuffer(p.alive, np.uint8, count=held_now)
        units = np.frombuffer(p.units, np.int32, count=held_now)
        kept = at >= 0
        kept[kept] = (alive[at[kept]] != 0) & (units[at[kept]] == unit)
        stale = rows[~kept]
        if len(stale):
            out.append(StoreClear(h.partition_id, stale.tolist(), h.incarnation))
    return out
