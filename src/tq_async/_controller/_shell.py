"""What every part of the controller service shares: the core, the loop's plumbing.

:class:`ControllerShell` holds the attributes
:class:`~tq_async._controller._server.ControllerServer`
sets up and the plumbing its handlers use: applying the core's effects, the one deadline
timer, the reply cache that answers retried requests, parking requests that must wait, and
spawning tasks. It also keeps the links to the storage units: registering them, watching
their liveness (a unit that goes silent is suspended, one whose process is gone is lost) and
telling them to free rows. The request handlers live in :mod:`tq_async._controller._server` and
:mod:`tq_async._controller._puts`.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup

from .._core._state import ControllerState, Wakeup
from .._core._transitions import ControllerCore, Effects
from .._errors import ClosedError, InvalidRequestError, TQError, TQTimeoutError
from .._logging import get_logger
from .._service._loop import DEFERRED, Incoming, Service
from .._service._parking import ParkingLot
from .._storage._server import StorageServer
from .._transport._dealer import DealerConnection
from .._transport._security import CurveServer
from .._wire._protocol import (
    MetaReply,
    Placement,
    RegisterUnit,
    StoreClear,
    StoreStats,
    StoreStatsReply,
    ok_reply,
)
from ._watch import WatchHub

__all__ = ["ControllerShell"]

log = get_logger(__name__)

#: replies remembered for deduplicating retried requests (about 1 KiB each)
_REPLY_CACHE = 8192
#: seconds a unit holding an id has to answer before a newcomer with that id replaces it
_HOLDER_PROBE = 2.0


class ControllerShell(Service):
    """The controller's shared state and plumbing (see the module docstring)."""

    name = "controller"
    core: ControllerCore
    curve: CurveServer | None
    unit_suspend_after: float
    #: each remote unit's instance token: a unit that comes back with another lost its data
    _unit_instance: dict[int, str]
    local_units: dict[int, StorageServer]
    unit_timeout: float
    #: set while shutting down: units going away then are not "lost"
    stopping: bool
    #: requests parked under what they wait for: ``(partition, task)``, "room", "admission"
    lot: ParkingLot
    #: the event log and its watchers (``client.watch()``)
    watch: WatchHub
    _tg: TaskGroup | None
    #: requests that are waiting, by (client identity, request id)
    _pending: dict[tuple[bytes, int], anyio.CancelScope]
    #: recent replies by (client identity, request id), for retried requests
    _replies: OrderedDict[tuple[bytes, int], bytes]
    _units: dict[int, DealerConnection]
    #: unit ids whose holder is being probed for a newcomer
    _registering: set[int]
    _timer: asyncio.TimerHandle | None
    _timer_at: float | None

    @property
    def state(self) -> ControllerState:
        """The core's state, for reading: every change goes through a transition of
        :attr:`core` (``tests/test_layering.py`` checks the shell's modules)."""
        return self.core.state

    # ---- effects -----------------------------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _apply(self, fx: Effects) -> None:
        """Do what a transition of the core left to do."""
        self.watch.drain()
        self._notify(fx.wakeups)
        for partition_id, incarnation, by_unit in fx.free:
            self._spawn(self._clear_units, None, 0, partition_id, by_unit, incarnation)
        for policy, n in fx.stale:
            self.metrics.stale(policy, n)
        if fx.room:
            self.lot.unpark("room")
        if fx.admission:
            self.lot.unpark("admission")
        self._rearm()

    def _notify(self, wakeups: Sequence[Wakeup]) -> None:
        """Wake the get_metas the wake-ups concern (a whole partition when no task is named)."""
        for w in wakeups:
            if w.task_name is not None:
                self.lot.unpark((w.partition_id, w.task_name))
            else:
                self.lot.unpark_if(partial(_of_partition, w.partition_id))

    def _rearm(self) -> None:
        """Keep one timer armed at the core's next deadline."""
        at = self.core.next_deadline()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None and not self.stopping:
            self._timer = asyncio.get_running_loop().call_at(at, self._on_deadline)

    def _on_deadline(self) -> None:
        self._timer, self._timer_at = None, None
        self._apply(self.core.advance(self._now()))

    def _spawn_waiting(self, msg: Incoming, coro_fn: Any, *args: Any) -> None:
        """Spawn a request that may wait (it runs :meth:`_waiting_request`). It can be
        cancelled from now on: a ``Cancel`` read before its task starts still finds it."""
        self._pending[(msg.peer, msg.rid)] = anyio.CancelScope()
        self._spawn(coro_fn, *args)

    def _spawn(self, coro_fn: Any, *args: Any) -> None:
        if self._tg is None:
            raise ClosedError(
                "the controller is not serving: start it with `await tg.start(server.serve)`"
            )
        self._tg.start_soon(coro_fn, *args)

    # ---- replies -----------------------------------------------------------------------------

    def is_retry(self, peer: bytes, rid: int) -> bool:
        """A retry of a finished request gets the same answer; one still waiting, nothing."""
        cached = self._replies.get((peer, rid))
        if cached is not None:
            if self._endpoint is not None:
                self._endpoint.send(peer, [cached])
            return True
        return (peer, rid) in self._pending  # its reply will reach the retry

    def send(self, peer: bytes, rid: int, header: bytes, frames: Sequence[Any] = ()) -> None:
        """Send a reply and remember it: a retried request gets it again, not re-executed."""
        self._remember(peer, rid, header)
        if self._endpoint is not None:
            self._endpoint.send(peer, [header, *frames])

    def send_ok(self, peer: bytes, rid: int, payload: Any, frames: Sequence[Any] = ()) -> None:
        """Answer ``rid``; a reply naming rows' units carries the units' epoch."""
        if isinstance(payload, (MetaReply, Placement)):
            payload.units_epoch = self.state.units_epoch  # the rows' units may have moved
        self.send(peer, rid, ok_reply(rid, payload), frames)

    def _remember(self, peer: bytes, rid: int, header: bytes) -> None:
        replies = self._replies
        replies[(peer, rid)] = header
        if len(replies) > _REPLY_CACHE:
            replies.popitem(last=False)

    # ---- waiting -----------------------------------------------------------------------------

    async def _waiting_request(
        self,
        peer: bytes,
        rid: int,
        op: str,
        t0: float,
        timeout: float | None,
        timeout_message: Callable[[], str],
        work: Callable[[], Awaitable[None]],
    ) -> None:
        """Run a request that may wait: ``work`` sends the reply.

        The request can be cancelled by the client (``Cancel``), fails with
        :class:`TQTimeoutError` after ``timeout``, and answers any error; nothing it would
        have done happens after it ends.
        """
        # registered when the request was spawned (a Cancel may have come since)
        scope = self._pending.setdefault((peer, rid), anyio.CancelScope())
        ok = False
        try:
            with scope, anyio.fail_after(timeout) if timeout else nullcontext():
                await work()
                ok = not scope.cancel_called
        except TimeoutError:
            self.send_error(peer, rid, TQTimeoutError(timeout_message()), op)
        except Exception as exc:
            self.send_error(peer, rid, exc, op)
        finally:
            self._pending.pop((peer, rid), None)
            if self.metrics.enabled:
                self.metrics.request(op, ok, time.perf_counter() - t0)

    # ---- storage units -----------------------------------------------------------------------

    def _on_register_unit(self, msg: Incoming, body: RegisterUnit) -> Any:
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
            return self._register(unit_id, body.address)
        held = st.units.get(unit_id)
        if held is None or held == body.address or unit_id in st.dead_units:
            return self._register(unit_id, body.address)
        if unit_id in self._registering:
            raise InvalidRequestError(
                f"another storage unit is registering with id {unit_id} right now; give each "
                "unit its own --unit-id (or leave it out to get a free id)"
            )
        if unit_id in self.local_units:
            raise _held(unit_id, held)
        self._registering.add(unit_id)
        self._spawn(self._register_if_gone, msg.peer, msg.rid, unit_id, body.address, held)
        return DEFERRED

    async def _register_if_gone(
        self, peer: bytes, rid: int, unit_id: int, address: str, held: str
    ) -> None:
        """Register ``address`` under ``unit_id`` unless the unit holding it answers."""
        try:
            alive = unit_id not in self.state.suspended
            if alive:
                try:
                    await self._unit(unit_id).request(
                        StoreStats(), timeout=min(self.unit_timeout, _HOLDER_PROBE)
                    )
                except TQError:
                    alive = False  # gone (or too stalled to serve): the newcomer replaces it
            if alive:
                self.send_error(peer, rid, _held(unit_id, held), "RegisterUnit")
            else:
                self.send_ok(peer, rid, self._register(unit_id, address))
        finally:
            self._registering.discard(unit_id)

    def _register(self, unit_id: int, address: str) -> int:
        old = self._units.pop(unit_id, None)
        if old is not None:
            old.close()
        self._unit_instance.pop(unit_id, None)
        self._apply(self.core.unit_registered(unit_id, address))
        self._unit(unit_id)
        return unit_id

    def _unit(self, unit_id: int) -> DealerConnection:
        conn = self._units.get(unit_id)
        if conn is None:
            conn = self._units[unit_id] = DealerConnection(
                self.state.units[unit_id],
                curve=self.curve.as_client() if self.curve is not None else None,
                on_disconnect=lambda: self._unit_silent(unit_id),
                on_connect=lambda: self._unit_connected(unit_id),
                on_refused=lambda: self._unit_refused(unit_id),
                heartbeat_timeout=self.unit_suspend_after,
            )
        return conn

    def _unit_silent(self, unit_id: int) -> None:
        """A unit's connection broke or went silent: suspend it (its data may still be there)."""
        if self.stopping or unit_id in self.local_units:
            if not self.stopping:  # a unit of this process only goes away when it stops
                self._apply(self.core.unit_lost(unit_id))
            return
        self._apply(self.core.unit_down(unit_id, self._now()))

    def _unit_refused(self, unit_id: int) -> None:
        """Reconnecting to a suspended unit was refused: its process is gone, with its data."""
        if not self.stopping and unit_id in self.state.suspended:
            self._apply(self.core.unit_lost(unit_id))

    def _unit_connected(self, unit_id: int) -> None:
        """A (re)connection to a unit: learn its instance, or check it is the one we had."""
        if not self.stopping and unit_id not in self.local_units and self._tg is not None:
            self._spawn(self._check_unit, unit_id)

    async def _check_unit(self, unit_id: int) -> None:
        conn = self._units.get(unit_id)
        if conn is None:
            return
        try:
            payload, _ = await conn.request(StoreStats(), timeout=self.unit_timeout)
        except TQError:
            return  # still away: the liveness deadlines decide
        if self._units.get(unit_id) is not conn:
            return  # replaced meanwhile (re-registered)
        instance = msgspec.msgpack.decode(payload, type=StoreStatsReply).instance
        known = self._unit_instance.setdefault(unit_id, instance)
        if unit_id not in self.state.suspended:
            return
        if known == instance:
            self._apply(self.core.unit_up(unit_id))
        else:  # another process answers at the unit's address: what it held is gone
            self._apply(self.core.unit_lost(unit_id))

    async def _clear_units(
        self,
        peer: bytes | None,
        rid: int,
        partition_id: str,
        by_unit: Mapping[int, list[int] | None],
        incarnation: str | None = None,
    ) -> None:
        """Tell units to free rows; answer ``peer`` (if any) once all have, or with the errors.

        With ``incarnation``, units free only that incarnation's cells.
        """
        errors: list[str] = []

        async def clear_one(unit_id: int, rows: list[int] | None) -> None:
            try:
                await self._unit(unit_id).request(
                    StoreClear(partition_id, rows, incarnation), timeout=self.unit_timeout
                )
            except TQError as exc:
                errors.append(f"unit {unit_id}: {exc}")

        async with anyio.create_task_group() as tg:
            for unit_id, rows in by_unit.items():
                if unit_id in self.state.units and unit_id not in self.state.dead_units:
                    tg.start_soon(clear_one, unit_id, rows)
        if peer is None:
            if errors:
                log.warning("freeing storage failed", partition=partition_id, errors=errors)
        elif errors:
            self.send_error(
                peer,
                rid,
                TQError(
                    f"partition {partition_id!r} was cleared in the controller, but freeing "
                    f"storage failed: {'; '.join(errors)}"
                ),
                "Clear",
            )
        else:
            self.send_ok(peer, rid, None)


def _held(unit_id: int, holder: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"storage unit id {unit_id} is held by a live unit at {holder}; give this unit another "
        "--unit-id, or leave --unit-id out to get a free id (a unit restarted under its id is "
        "accepted once the old process is gone)"
    )


def _of_partition(partition_id: str, key: object) -> bool:
    """Whether a parking key is a get_meta's on ``partition_id``."""
    return isinstance(key, tuple) and key[0] == partition_id
