"""The controller's put handlers: place rows, wait for room, store small puts directly.

A put is two requests, `PutBegin` (place the rows under a put lease) and
`PutCommit` (make the cells visible), with `RenewPut` keeping the lease while
the columns travel to the units. A small put is one `PutInline`: with room and a unit
in this process it is placed, stored, committed and answered in the reader callback;
otherwise a task waits for room and/or forwards the columns to the unit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from .._core._state import ControllerState, Partition
from .._core._transitions import Effects
from .._errors import BrokenError, InvalidRequestError, RowsNotFound, TQError, TQTimeoutError
from .._service._loop import DEFERRED, SENT, Handler, Incoming
from .._wire._protocol import (
    AbortPut,
    Placement,
    PutBegin,
    PutCommit,
    PutInline,
    RenewPut,
    StorePut,
)
from ._shell import Shell
from ._units import UnitLinks

__all__ = ["PutPath"]


class PutPath:
    """The put handlers of `ControllerServer`."""

    def __init__(self, shell: Shell, links: UnitLinks) -> None:
        self.shell = shell
        self.core = shell.core
        self.links = links

    @property
    def state(self) -> ControllerState:
        """The core's state, for reading."""
        return self.shell.state

    def on_put_begin(self, msg: Incoming, body: PutBegin) -> Any:
        _check_incarnation(self.state, body.partition_id, body.incarnation)
        n_new = self.state.new_rows_needed(body.partition_id, body.n_rows, body.rows, body.keys)
        if not self._room_for(body.partition_id, n_new, body.nowait):
            self.shell.spawn_waiting(msg, self._put_begin_waiting, msg.peer, msg.rid, body, msg.t0)
            return DEFERRED
        self._put_begin(msg.peer, msg.rid, body)
        return SENT

    def on_put_commit(self, msg: Incoming, body: PutCommit) -> None:
        fx = self.core.put_commit(
            body.partition_id,
            body.rows,
            body.fields,
            body.tags,
            body.versions,
            body.put_id,
            body.incarnation,
            msg.peer,
        )
        self.shell.apply(fx)

    def on_abort_put(self, msg: Incoming, body: AbortPut) -> list[int]:
        fx = self.core.abort_puts(body.put_ids)
        # the rows reclaimed (a keyed put's caller frees their cells it sent)
        rows = sorted(r for _, _, by_unit in fx.free for rs in by_unit.values() for r in rs or ())
        self.shell.apply(fx)
        return rows

    def on_renew_put(self, msg: Incoming, body: RenewPut) -> None:
        self.core.renew_puts(body.put_ids, self.shell.now())
        self.shell.rearm()

    def _put_begin(self, peer: bytes, rid: int, body: PutBegin) -> None:
        placement, fx = self.core.put_begin(
            body.partition_id,
            body.columns,
            body.n_rows,
            body.rows,
            body.keys,
            self.shell.now(),
            host=body.host,
        )
        if placement.put_id:  # a late Cancel (its caller gave up) aborts it at once
            put_ids = [placement.put_id]
            self.shell.undo_on_cancel(
                peer, rid, lambda: self.shell.apply(self.core.abort_puts(put_ids))
            )
        self.shell.send_ok(peer, rid, placement)
        self.shell.apply(fx)

    def _room_for(self, partition_id: str, n_new: int, nowait: bool) -> bool:
        """Whether ``n_new`` rows fit now; raises when they never will, or when ``nowait``."""
        return self.core.catalog.room_for(partition_id, n_new, nowait)

    def on_put_inline(self, msg: Incoming, body: PutInline) -> Any:
        """A `PutInline`.

        With room and a unit in this process, everything happens here: place, store, commit,
        reply. Otherwise a task waits for room and/or forwards the columns to the unit.
        """
        _check_incarnation(self.state, body.partition_id, body.incarnation)
        n_new = self.state.new_rows_needed(body.partition_id, body.n_rows, body.rows, None)
        placed = None
        if self._room_for(body.partition_id, n_new, body.nowait):
            placed = self._inline_place(body)
            unit = self.links.local_units.get(placed.units[0])
            if unit is not None:
                try:
                    unit.store_local(
                        body.partition_id,
                        placed.rows,
                        body.columns,
                        msg.frames[1:],
                        placed.partition.incarnation,
                        host=body.host,
                    )
                    self._inline_commit(msg.peer, msg.rid, body, placed)
                except BaseException:
                    self._inline_undo(body, placed)
                    raise
                return SENT
            self._hold(body, placed)
        frames = msg.frames[1:]
        self.shell.spawn_waiting(
            msg, self._put_inline_task, msg.peer, msg.rid, body, frames, n_new, placed, msg.t0
        )
        return DEFERRED

    def _hold(self, body: PutInline, placed: _Placed) -> None:
        """New rows of a put that waits for its unit: under a put lease while it waits (a
        journal written meanwhile records a put to abort, not rows nobody will write)."""
        new = placed.rows if body.rows is None else []
        if new:
            placed.put_id = self.core.puts.hold(placed.partition, new, self.shell.now())
            self.shell.rearm()  # (its lapse)

    def _inline_place(self, body: PutInline) -> _Placed:
        placement, fx = self.core.put_begin(
            body.partition_id,
            body.columns,
            body.n_rows,
            body.rows,
            None,
            self.shell.now(),
            lease=False,
            host=body.host,
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
            body.partition_id,
            placed.rows,
            fields,
            body.tags,
            body.versions,
            placed.put_id,
            incarnation,
            peer,
        )
        fx.add(placed.effects)
        if body.rows is None:  # new rows: a late Cancel (its caller gave up) drops them
            pid, rows = body.partition_id, placed.rows

            def undo() -> None:  # (the client's clear of an undone put: admission kept)
                with contextlib.suppress(TQError):  # gone already (a clear, a lost unit)
                    self.shell.apply(self.core.clear_rows(pid, rows, incarnation, undo=True))

            self.shell.undo_on_cancel(peer, rid, undo)
        self.shell.send_ok(peer, rid, Placement(placed.rows, placed.units, incarnation=incarnation))
        self.shell.apply(fx)

    def _inline_undo(self, body: PutInline, placed: _Placed) -> None:
        """A one-message put failed after its rows were placed: drop new rows again."""
        if body.rows is not None:
            return  # existing rows: their new cells were never marked produced
        if placed.put_id:
            fx = self.core.abort_puts([placed.put_id])
        else:
            fx = self.core.puts.undo(body.partition_id, placed.rows, placed.partition.incarnation)
        self.shell.apply(fx)

    async def _put_inline_task(
        self,
        peer: bytes,
        rid: int,
        body: PutInline,
        frames: list[Any],
        n_new: int,
        placed: _Placed | None,
        t0: float,
    ) -> None:
        async def work() -> None:
            nonlocal placed
            if placed is None:
                await self.shell.lot.until(
                    "room", lambda: self.state.has_room(body.partition_id, n_new)
                )
                placed = self._inline_place(body)
            unit_id = placed.units[0]
            local = self.links.local_units.get(unit_id)
            if local is None and not placed.put_id:
                self._hold(body, placed)
            try:
                if local is not None:
                    local.store_local(
                        body.partition_id,
                        placed.rows,
                        body.columns,
                        frames,
                        placed.partition.incarnation,
                        host=body.host,
                    )
                else:
                    store = StorePut(
                        body.partition_id,
                        placed.rows,
                        body.columns,
                        placed.partition.incarnation,
                        host=body.host,
                    )
                    try:
                        await self.links.conn(unit_id).request(
                            store, frames, timeout=self.links.unit_timeout
                        )
                    except (BrokenError, TQTimeoutError) as exc:
                        raise _unit_failed(exc, unit_id) from exc
                self._inline_commit(peer, rid, body, placed)
            except BaseException:
                self._inline_undo(body, placed)
                raise

        def timed_out() -> str:
            if placed is None:
                return (
                    f"{self.state.at_capacity(body.partition_id)} (still after "
                    f"{body.timeout} s); nothing was written"
                )
            return f"the put did not complete within {body.timeout} s; nothing was written"

        await self.shell.waiting_request(peer, rid, "PutInline", t0, body.timeout, timed_out, work)

    async def _put_begin_waiting(self, peer: bytes, rid: int, body: PutBegin, t0: float) -> None:
        def room() -> bool:
            # a keyed put's new keys are counted again: keys cleared meanwhile are new now
            pid = body.partition_id
            n_new = self.state.new_rows_needed(pid, body.n_rows, body.rows, body.keys)
            return self._room_for(pid, n_new, False)

        async def work() -> None:
            await self.shell.lot.until("room", room)
            self._put_begin(peer, rid, body)

        await self.shell.waiting_request(
            peer,
            rid,
            "PutBegin",
            t0,
            body.timeout,
            lambda: (
                f"{self.state.at_capacity(body.partition_id)} (still after {body.timeout} s); "
                "nothing was written"
            ),
            work,
        )

    def handlers(self) -> dict[type, Handler]:
        """The request types this part handles, and their handlers."""
        return {
            PutBegin: self.on_put_begin,
            PutCommit: self.on_put_commit,
            PutInline: self.on_put_inline,
            RenewPut: self.on_renew_put,
            AbortPut: self.on_abort_put,
        }


def _unit_failed(exc: BrokenError | TQTimeoutError, unit_id: int) -> TQError:
    """A forwarded put's error, as its client reads it: the address is a unit's (the client
    talks to the controller), and what to do is to put again (not to wait for the unit)."""
    return type(exc)(
        f"storage unit {unit_id}, where this put's rows were placed, failed them: {exc} -- "
        "nothing of this put was written; put it again"
    )


@dataclass(slots=True)
class _Placed:
    """Where a one-message put goes (all rows on one unit), and the effects it owes."""

    partition: Partition
    rows: list[int]
    units: list[int]
    effects: Effects
    #: the put lease of its new rows while it waits for a unit (0: none)
    put_id: int = 0


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
