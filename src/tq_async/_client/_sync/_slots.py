# Generated from src/tq_async/_client/_async/_slots.py by scripts/unasync.py:
# do not edit; change the source and run `python scripts/unasync.py`.
"""The admission slots a client holds and has not put yet, and their renewal (`HeldSlots`).

An asynchronous client holds the slots its ``acquire_rollout`` admits under a name of its own
(`HeldSlots.holder`, the same across its reconnects), not under its connection: while it
holds any it renews them every third of the controller's slot lease (a timer of its event
loop, no task), so a producer that dies where nothing tells the controller (over TCP), or
that is gone when a restarted durable controller comes back, gives them back after a lease,
and a live one keeps them, however slow, across a restart too: a renewal that finds the
connection broken (a same-host controller's Unix socket dies with it) finds the controller
again in the background, as the next call would, and renews there.

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

from ..._errors import StateLostError, TQError
from ..._logging import get_logger
from ..._sync_primitives import TIMERS_FIRE_IDLE, Repeater, spawn
from ..._wire._protocol import RenewSlots
from ._base import Links

__all__ = ["HeldSlots"]

log = get_logger(__name__)


class HeldSlots:
    """The slots of one client and their renewal (see the module docstring).

    Args:
        links: the client's links (its connection to the controller, found again when it
            broke).
    """

    __slots__ = ("_held", "_lease", "_links", "_rejoining", "_renewal", "holder")

    def __init__(self, links: Links) -> None:
        #: the name the client holds slots under (empty: its connection holds them)
        self.holder = uuid.uuid4().bytes if TIMERS_FIRE_IDLE else b""
        self._links = links
        self._rejoining = False
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
        conn = self._links.controller
        if conn is None:
            return
        if conn.connected is not False and conn.send_best_effort(RenewSlots(self.holder)):
            return
        if not self._rejoining:  # broken: the controller found again first, as a call would
            self._rejoining = True
            spawn(self._rejoin)

    def _rejoin(self) -> None:
        try:
            conn = self._links.controller_link()
            conn.send_best_effort(RenewSlots(self.holder))
        except StateLostError:
            self.stop()  # (the controller lost its state: these slots with it)
        except TQError as exc:  # (still away, or closed: the next renewal tries again)
            log.debug("admission slots not renewed", error=str(exc))
        finally:
            self._rejoining = False
