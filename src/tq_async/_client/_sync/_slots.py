# Generated from src/tq_async/_client/_async/_slots.py by scripts/unasync.py:
# do not edit; change the source and run `python scripts/unasync.py`.
"""The admission slots a client holds and has not put yet, and their renewal (`HeldSlots`).

An asynchronous client holds the slots its ``acquire_rollout`` admits under a name of its own
(`HeldSlots.holder`, the same across its reconnects), not under its connection: while it
holds any it renews them every third of the controller's slot lease (a timer of its event
loop, no task), so a producer that dies where nothing tells the controller (over TCP), or
that is gone when a restarted durable controller comes back, gives them back after a lease,
and a live one keeps them, however slow, across a restart too.

The count is the client's own view: slots admitted minus the new rows it put with a policy
version and the slots it released. Another client's put may settle this one's slots first
(a rollout manager acquires, its workers put), so the count may stay above the controller's:
renewing a holder with nothing left changes nothing there.

A blocking client's timers fire only while it waits in a call, so it could not renew slots
while its caller generates: it names no holder, and its connection holds its slots (kept
until put or released, or until its Unix socket ends).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from ..._sync_primitives import TIMERS_FIRE_IDLE, Repeater
from ..._transport._sync_dealer import BlockingConnection
from ..._wire._protocol import RenewSlots

__all__ = ["HeldSlots"]


class HeldSlots:
    """The slots of one client and their renewal (see the module docstring).

    Args:
        controller: the client's connection to the controller now (None: closed).
    """

    __slots__ = ("_controller", "_held", "_lease", "_renewal", "holder")

    def __init__(self, controller: Callable[[], BlockingConnection | None]) -> None:
        #: the name the client holds slots under (empty: its connection holds them)
        self.holder = uuid.uuid4().bytes if TIMERS_FIRE_IDLE else b""
        self._controller = controller
        self._held = 0
        self._lease = 0.0
        self._renewal: Repeater | None = None

    @property
    def held(self) -> int:
        """The slots this client holds and has not put or released, as far as it knows."""
        return self._held

    def acquired(self, n: int, lease: float | None) -> None:
        """``n`` slots were admitted under `holder`, renewed within ``lease`` seconds
        (None: the connection holds them, nothing to renew)."""
        if lease is None or lease <= 0 or not self.holder:
            return
        self._held += n
        if self._renewal is None or lease != self._lease:
            self.stop()
            self._lease = lease
            self._renewal = Repeater(lease / 3, self._renew)

    def settled(self, n: int) -> None:
        """``n`` of them were put (new rows with a policy version) or released."""
        if self._renewal is None:
            return
        self._held = max(0, self._held - n)
        if not self._held:
            self.stop()

    def stop(self) -> None:
        """Renew nothing any more (none held, or the client closed)."""
        if self._renewal is not None:
            self._renewal.cancel()
            self._renewal = None

    def _renew(self) -> None:
        conn = self._controller()
        if conn is not None:
            conn.send_best_effort(RenewSlots(self.holder))
