"""The controller's links to its storage units.

`UnitLinks` registers the units (giving each its id), keeps one connection to each,
watches their liveness (a unit that goes silent is suspended, one whose process is gone is
lost) and tells them to free rows. What a unit's coming and going does to the rows is decided
by the core (`UnitLiveness`); this part does the I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from .._core._liveness import orphan_cells
from .._core._state import ControllerState
from .._errors import InvalidRequestError, TQError
from .._logging import get_logger
from .._service._loop import DEFERRED, Incoming
from .._storage._dir_marker import DISK_INSTANCE
from .._transport._dealer import DealerConnection
from .._transport._security import CurveServer
from .._wire._protocol import RegisterUnit, StoreClear, StoreStats, StoreStatsReply
from ._shell import Shell

if TYPE_CHECKING:  # (a `serve controller` process never imports the units' code)
    from .._storage._server import StorageServer

__all__ = ["UnitLinks"]

log = get_logger(__name__)

#: seconds a unit holding an id has to answer before a newcomer with that id replaces it
_HOLDER_PROBE = 2.0


class UnitLinks:
    """One connection per storage unit, their registration and liveness (see the module
    docstring).

    Args:
        shell: the controller's plumbing.
        local_units: storage units running in this process.
        curve: CURVE keys for the connections to the units.
        unit_timeout: seconds to wait for a unit when the controller calls it.
        suspend_after: seconds of silence after which a unit is suspended.
    """

    def __init__(
        self,
        shell: Shell,
        local_units: Mapping[int, StorageServer],
        curve: CurveServer | None,
        unit_timeout: float,
        suspend_after: float,
    ) -> None:
        self.shell = shell
        self.core = shell.core
        self.local_units: dict[int, StorageServer] = dict(local_units)
        self.curve = curve
        self.unit_timeout = unit_timeout
        self.suspend_after = suspend_after
        #: the connections, by unit id
        self.conns: dict[int, DealerConnection] = {}
        #: unit ids whose holder is being probed for a newcomer
        self._registering: set[int] = set()
        #: each remote unit's instance token: a unit that comes back with another lost its data
        self._unit_instance: dict[int, str] = {}

    @property
    def state(self) -> ControllerState:
        """The core's state, for reading."""
        return self.shell.state

    def connect_all(self) -> None:
        """Connect to every known unit now, so that a unit that dies is noticed at once."""
        for unit_id in list(self.state.units):
            self.conn(unit_id)

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()

    # ---- registration ------------------------------------------------------------------------

    def on_register_unit(self, msg: Incoming, body: RegisterUnit) -> Any:
        """Give a unit its id; an id held by a live unit elsewhere is refused.

        Registering again is how a restarted unit comes back: accepted at the address the id
        already has (that endpoint can only be the new process), once the id's unit is lost
        or suspended, or when the old unit does not answer a probe.
        """
        st = self.state
        unit_id = body.unit_id
        if unit_id < 0:
            # the unit asks for an id: the one its address already has (a retry or a
            # restart at the same address), else the next free one
            unit_id = next(
                (i for i, a in st.units.items() if a == body.address),
                max([*st.units, *self._registering], default=-1) + 1,
            )
            return self._register(unit_id, body.address, body.host, body.instance)
        held = st.units.get(unit_id)
        if (
            held is None
            or held == body.address
            or unit_id in st.dead_units
            or self._returns(unit_id, body.instance)
        ):
            return self._register(unit_id, body.address, body.host, body.instance)
        if unit_id in self._registering:
            raise InvalidRequestError(
                f"another storage unit is registering with id {unit_id} right now; give each "
                "unit its own --unit-id (or leave it out to get a free id)"
            )
        if unit_id in self.local_units:
            raise _held(unit_id, held)
        self._registering.add(unit_id)
        self.shell.spawn(
            self._register_if_gone,
            msg.peer,
            msg.rid,
            unit_id,
            body.address,
            held,
            body.host,
            body.instance,
        )
        return DEFERRED

    def _returns(self, unit_id: int, instance: str) -> bool:
        """Whether a registration under ``unit_id`` with ``instance`` is the unit's own
        process restarted on its data_dir (its cells outlived the old process): the same
        durable instance token as the one the controller knew."""
        return bool(instance) and self._unit_instance.get(unit_id) == instance

    async def _register_if_gone(
        self,
        peer: bytes,
        rid: int,
        unit_id: int,
        address: str,
        held: str,
        host: str = "",
        instance: str = "",
    ) -> None:
        """Register ``address`` under ``unit_id`` unless the unit holding it answers."""
        try:
            alive = unit_id not in self.state.suspended
            if alive:
                try:
                    await self.conn(unit_id).request(
                        StoreStats(), timeout=min(self.unit_timeout, _HOLDER_PROBE)
                    )
                except TQError:
                    alive = False  # gone (or too stalled to serve): the newcomer replaces it
            if alive:
                self.shell.send_error(peer, rid, _held(unit_id, held), "RegisterUnit")
            else:
                self.shell.send_ok(peer, rid, self._register(unit_id, address, host, instance))
        finally:
            self._registering.discard(unit_id)

    def _register(self, unit_id: int, address: str, host: str = "", instance: str = "") -> int:
        old = self.conns.pop(unit_id, None)
        if old is not None:  # what was forwarded on it (a one-message put, a clear) breaks
            old.retire(f"storage unit {unit_id} registered again: it restarted")
        returns = self._returns(unit_id, instance)
        if returns:
            log.info("storage unit came back with its cells", unit=unit_id, address=address)
            self.shell.apply_unasked(self.core.unit_returned(unit_id, address, host))
        else:
            self.shell.apply_unasked(self.core.unit_registered(unit_id, address, host))
        self._unit_instance.pop(unit_id, None)
        if instance:
            self._unit_instance[unit_id] = instance
        self.conn(unit_id)
        if returns and self.shell.tg is not None:
            self.shell.spawn(self._free_orphans, unit_id)
        return unit_id

    # ---- liveness ----------------------------------------------------------------------------

    def conn(self, unit_id: int) -> DealerConnection:
        """The connection to ``unit_id`` (opened on first use)."""
        conn = self.conns.get(unit_id)
        if conn is None:
            conn = self.conns[unit_id] = DealerConnection(
                self.state.units[unit_id],
                curve=self.curve.as_client() if self.curve is not None else None,
                on_disconnect=lambda: self._unit_silent(unit_id),
                on_connect=lambda: self._unit_connected(unit_id),
                on_refused=lambda: self._unit_refused(unit_id),
                heartbeat_timeout=self.suspend_after,
            )
        return conn

    def _unit_silent(self, unit_id: int) -> None:
        """A unit's connection broke or went silent: suspend it (its data may still be there)."""
        shell = self.shell
        if shell.stopping or unit_id in self.local_units:
            if not shell.stopping:  # a unit of this process only goes away when it stops
                shell.apply_unasked(shell.core.unit_lost(unit_id))
            return
        shell.apply_unasked(shell.core.unit_down(unit_id, shell.now()))

    def _unit_refused(self, unit_id: int) -> None:
        """Reconnecting to a suspended unit was refused: its process is gone, with its data
        -- unless it keeps its cells on disk: then it stays suspended until it comes back
        (re-registers with its instance token) or ``unit_lost_after`` runs out."""
        shell = self.shell
        if shell.stopping or unit_id in self.local_units or unit_id not in self.state.units:
            return
        if unit_id not in self.state.suspended and unit_id not in self.state.dead_units:
            # refused before the link was ever up: the unit died right after registering or
            # before its handshake completed (no disconnect suspended it, nor failed what was
            # forwarded to it: a one-message put waited for the unit's timeout); breaking
            # the link does both (`_unit_silent`)
            conn = self.conns.get(unit_id)
            if conn is not None:
                conn.break_off(
                    f"storage unit {unit_id} at {conn.name} refused the connection before it "
                    "was ever up (its process is gone or restarting); requests in flight to "
                    "it are lost: retry"
                )
            shell.apply_unasked(self.core.unit_down(unit_id, shell.now()))
        if self._unit_instance.get(unit_id, "").startswith(DISK_INSTANCE):
            return
        if unit_id in self.state.suspended:
            shell.apply_unasked(self.core.unit_lost(unit_id))

    def _unit_connected(self, unit_id: int) -> None:
        """A (re)connection to a unit: learn its instance, or check it is the one we had."""
        shell = self.shell
        if not shell.stopping and unit_id not in self.local_units and shell.tg is not None:
            shell.spawn(self._check_unit, unit_id)

    async def _check_unit(self, unit_id: int) -> None:
        conn = self.conns.get(unit_id)
        if conn is None:
            return
        try:
            payload, _ = await conn.request(StoreStats(), timeout=self.unit_timeout)
        except TQError:
            return  # still away: the liveness deadlines decide
        if self.conns.get(unit_id) is not conn:
            return  # replaced meanwhile (re-registered)
        instance = msgspec.msgpack.decode(payload, type=StoreStatsReply).instance
        known = self._unit_instance.setdefault(unit_id, instance)
        if unit_id not in self.state.suspended:
            return
        if known == instance:
            self.shell.apply_unasked(self.core.unit_up(unit_id))
            await self._free_orphans(unit_id)
        else:  # another process answers at the unit's address: what it held is gone
            self.shell.apply_unasked(self.core.unit_lost(unit_id))

    async def _free_orphans(self, unit_id: int) -> None:
        """A unit back with its cells: free those of rows the controller dropped while it
        could not tell the unit (its clears were lost with the connection, or with the
        controller's own restart), by listing what the unit holds (`orphan_cells`)."""
        conn = self.conns.get(unit_id)
        if conn is None:
            return
        try:
            payload, _ = await conn.request(StoreStats(rows=True), timeout=self.unit_timeout)
        except TQError:
            return  # away again: the next return tries again
        if self.conns.get(unit_id) is not conn:
            return
        held = msgspec.msgpack.decode(payload, type=StoreStatsReply).held
        clears = orphan_cells(self.state, unit_id, held)
        if clears:
            log.info(
                "freeing the cells a storage unit held of rows the controller dropped",
                unit=unit_id,
                partitions=len(clears),
                rows=sum(len(c.rows) if c.rows is not None else 0 for c in clears),
            )
        for c in clears:  # (a failure is logged there; the next return tries again)
            await self.clear_units(None, 0, c.partition_id, {unit_id: c.rows}, c.incarnation)

    # ---- freeing rows ------------------------------------------------------------------------

    def free(
        self, partition_id: str, by_unit: Mapping[int, list[int] | None], incarnation: str | None
    ) -> None:
        """Tell the units to free rows, in a task (failures are logged)."""
        self.shell.spawn(self.clear_units, None, 0, partition_id, by_unit, incarnation)

    def _away(self, unit_id: int) -> bool:
        """Whether ``unit_id`` is lost (its cells are gone) or suspended (it frees what the
        clears it missed cleared once back, `_free_orphans`)."""
        return unit_id in self.state.dead_units or unit_id in self.state.suspended

    async def clear_units(
        self,
        peer: bytes | None,
        rid: int,
        partition_id: str,
        by_unit: Mapping[int, list[int] | None],
        incarnation: str | None = None,
    ) -> None:
        """Tell units to free rows; answer ``peer`` (if any) once all have, or with the errors.

        With ``incarnation``, units free only that incarnation's cells. A lost unit's cells
        are gone; a suspended unit frees its cells once back (`_free_orphans`).
        """
        errors: list[str] = []

        async def clear_one(unit_id: int, rows: list[int] | None) -> None:
            try:
                await self.conn(unit_id).request(
                    StoreClear(partition_id, rows, incarnation), timeout=self.unit_timeout
                )
            except TQError as exc:
                if not self._away(unit_id):  # (one that went away frees them once back)
                    errors.append(f"unit {unit_id}: {exc}")

        st = self.state
        async with anyio.create_task_group() as tg:
            for unit_id, rows in by_unit.items():
                # a suspended unit is not asked (a paused one would keep the clear waiting
                # for the unit's timeout): it frees what it missed once back (`_free_orphans`)
                if unit_id in st.units and not self._away(unit_id):
                    tg.start_soon(clear_one, unit_id, rows)
        if peer is None:
            if errors:
                log.warning("freeing storage failed", partition=partition_id, errors=errors)
        elif errors:
            self.shell.send_error(
                peer,
                rid,
                TQError(
                    f"partition {partition_id!r} was cleared in the controller, but freeing "
                    f"storage failed: {'; '.join(errors)}"
                ),
                "Clear",
            )
        else:
            self.shell.send_ok(peer, rid, None)


def _held(unit_id: int, holder: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"storage unit id {unit_id} is held by a live unit at {holder}; give this unit another "
        "--unit-id, or leave --unit-id out to get a free id (a unit restarted under its id is "
        "accepted once the old process is gone)"
    )
