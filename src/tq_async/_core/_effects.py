"""The records the controller's pure core takes and returns: its configuration and effects.

`Effects` is what a transition of `ControllerCore` (or
of the
parts it composes, `tq_async._core._admission` and `tq_async._core._liveness`) leaves the
I/O
shell to do; `AdmissionConfig` and `Deadlines` configure them (defined in
`tq_async._core._settings`, which the services' configuration imports alone), and
`check_capacity` checks the backpressure setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._errors import InvalidRequestError
from .._wire._checks import integral
from ._settings import AdmissionConfig as AdmissionConfig
from ._settings import Deadlines as Deadlines
from ._state import Wakeup

__all__ = ["AdmissionConfig", "Deadlines", "Effects", "check_capacity"]


@dataclass(slots=True)
class Effects:
    """The I/O a transition leaves to the shell."""

    #: waiters to wake
    wakeups: list[Wakeup] = field(default_factory=list)
    #: rows to free on storage units: ``(partition_id, incarnation, {unit: rows or None})``
    #: (None: every row of that incarnation)
    free: list[tuple[str, str, dict[int, list[int] | None]]] = field(default_factory=list)
    #: live rows were freed: puts waiting for capacity may fit now
    room: bool = False
    #: admission slots were freed (or the learner moved): waiting rollouts may start
    admission: bool = False
    #: stale rows handled, ``(policy, n)``: for the metrics (the state counts them too)
    stale: list[tuple[str, int]] = field(default_factory=list)

    def add(self, other: Effects) -> None:
        """Fold ``other`` into this one."""
        self.wakeups.extend(other.wakeups)
        self.free.extend(other.free)
        self.room |= other.room
        self.admission |= other.admission
        self.stale.extend(other.stale)


def check_capacity(capacity: int | None, scope: str) -> tuple[int | None, bool]:
    """Validate a capacity setting; ``(capacity, capacity is global)`` (numpy's ints taken
    as ints)."""
    if capacity is not None and type(capacity) is not int and not isinstance(capacity, bool):
        capacity = integral(capacity)
    if capacity is not None and (
        isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity < 2**63
    ):  # an int64: the controller's replies carry it
        raise InvalidRequestError(
            f"capacity must be from 1 to {2**63 - 1} rows, or None, got {capacity!r}"
        )
    if scope not in ("partition", "global"):
        raise InvalidRequestError(f"capacity_scope must be 'partition' or 'global', got {scope!r}")
    return capacity, scope == "global"
