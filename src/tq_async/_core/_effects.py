"""The records the controller's pure core takes and returns: its configuration and effects.

`Effects` is what a transition of `ControllerCore` (or
of the
parts it composes, `tq_async._core._admission` and `tq_async._core._liveness`) leaves the
I/O
shell to do; `AdmissionConfig` and `Deadlines` configure them, and `check_capacity` checks
the backpressure setting.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from .._errors import InvalidRequestError
from .._wire._checks import check_int, integral
from ._state import Wakeup

__all__ = ["AdmissionConfig", "Deadlines", "Effects", "check_capacity"]


@dataclass(frozen=True)
class AdmissionConfig:
    """Bounds on asynchronous rollouts, enforced by ``acquire_rollout``.

    Attributes:
        max_staleness: a rollout of policy version ``v`` may start only while
            ``v - learner_version <= max_staleness`` (None: no version bound).
        capacity: the most rows admitted and not yet consumed by ``learner_task`` (None: no
            bound). Unconsumed rows are never evicted: producers wait instead.
        learner_task: the task whose consumption frees admission slots (needed with
            ``capacity``).
        slot_lease: seconds an asynchronous client's admitted slots not put yet stay
            its own without a renewal. The client renews them every third of it while it
            holds any (a timer of its event loop), so only the slots of a producer that died
            (over TCP, where nothing tells the controller) or whose loop was blocked that long
            come back; a restarted durable controller gives the holders it recovers a full
            lease to renew them.
    """

    max_staleness: int | None = None
    capacity: int | None = None
    learner_task: str | None = None
    slot_lease: float = 60.0

    def __post_init__(self) -> None:
        lease: object = self.slot_lease
        seconds = float(lease) if isinstance(lease, numbers.Real) else math.nan
        if isinstance(lease, bool) or not 0 < seconds < math.inf:
            raise InvalidRequestError(f"slot_lease must be a positive number of seconds: {lease!r}")
        object.__setattr__(self, "slot_lease", seconds)  # (numpy's floats as floats)
        # (numpy's ints, as configs hold them, kept as the ints they are)
        if self.max_staleness is not None:
            object.__setattr__(
                self, "max_staleness", check_int("max_staleness", self.max_staleness)
            )
        if self.capacity is not None:
            object.__setattr__(self, "capacity", check_int("capacity", self.capacity, 1))
        if self.capacity is not None and self.learner_task is None:
            raise InvalidRequestError(
                "capacity must be >= 1 and needs learner_task (whose consumption frees slots)"
            )


@dataclass(frozen=True)
class Deadlines:
    """How long the controller waits before it gives up on a silent peer.

    Attributes:
        put_lease: seconds the new rows of a put stay reserved without a commit or a
            renewal. A live producer renews every third of it while its columns travel, so
            only a dead producer's rows are reclaimed (never visible; capacity freed;
            end-of-stream no longer waits for them).
        unit_suspend_after: seconds a storage unit may stay silent (no ZMTP heartbeat
            answered) before it is *suspended*: its rows are neither handed out nor lost,
            end-of-stream waits for them, new puts avoid it. A unit whose process is gone
            (reconnecting is refused, or another process answers) is lost at once.
        unit_lost_after: seconds a suspended unit has to come back with its data before its
            rows are declared lost (``lost_rows()``; end-of-stream stops waiting for them).
        waiting_warning_after: seconds a get_meta may wait silently before the controller
            logs one warning saying why it waits: fields no row has (a typo, or a task that
            never wrote them), a partition that does not exist, or a partition that is not
            sealed and got no new rows in that time (a forgotten ``seal``). A field or
            partition one or two edits from a known one is said at once ("did you mean
            'input_ids'?"), whatever this is.
    """

    put_lease: float = 60.0
    unit_suspend_after: float = 10.0
    unit_lost_after: float = 120.0
    waiting_warning_after: float = 30.0

    def __post_init__(self) -> None:
        names = ("put_lease", "unit_suspend_after", "unit_lost_after", "waiting_warning_after")
        for name in names:
            value = getattr(self, name)
            seconds = float(value) if isinstance(value, numbers.Real) else math.nan
            if isinstance(value, bool) or not 0 < seconds < math.inf:
                raise InvalidRequestError(f"{name} must be a positive number of seconds: {value!r}")
            object.__setattr__(self, name, seconds)  # (numpy's floats as floats)
        if self.unit_lost_after < self.unit_suspend_after:
            raise InvalidRequestError(
                "unit_lost_after must be at least unit_suspend_after (a unit is suspended "
                "first, and lost only later)"
            )


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
