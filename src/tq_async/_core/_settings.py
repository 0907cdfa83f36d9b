"""The controller core's settings, `AdmissionConfig` and `Deadlines` (re-exported by
`tq_async._core._effects`): records with their checks only, so that a configuration
(``Config``, ``tq-async serve``'s flags) reads them without importing the core, as a storage
unit's process does."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .._errors import InvalidRequestError
from .._wire._checks import check_int

__all__ = ["AdmissionConfig", "Deadlines"]


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
