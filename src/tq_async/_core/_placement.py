"""Placement: which storage unit a put's new rows go to. A pure part of the controller's core.

All new rows of one put go to one unit (a batch read back as it was written is one contiguous
slice on one unit; a GRPO group, put together by its producer, stays together too). Which one:

- ``"round_robin"``: the live units in turn, put after put (the order of every release before
  locality); it also turns off handing a global batch's shares to ranks by host
  (`tq_async._core._assign`).
- ``"local"``: a unit on the producer's host when there is one, the least-loaded of them;
  otherwise, or when that host's units hold more than `SPILL_RATIO` times the mean
  load of all live units (a host's load is its units' mean) *and* more than the mean plus
  the put's own rows (so that a few puts from one host while the cluster is nearly empty do
  not spill), the least-loaded unit of another host. Load is what the controller knows
  without asking: live rows per unit.
- ``"auto"`` (the default): ``"local"`` while the live units span more than one host, else
  ``"round_robin"`` (on one host locality cannot matter, and puts keep their old order).

Only live units take rows: a lost or suspended unit is no candidate, so a host whose units
are all down sends its producers' puts elsewhere at once. A host id is a preference, never a
correctness input: placement is recorded per row and an unknown or spoofed host id only
changes which unit is chosen. Ties go round-robin, so equal loads still spread. No loop, no
clock, no sockets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .._errors import InvalidRequestError

__all__ = ["MODES", "SPILL_RATIO", "Placer", "check_placement"]

#: a host whose units hold more than this times the mean load sends new rows elsewhere
SPILL_RATIO = 1.2

#: the placement policies (see the module docstring)
MODES = ("auto", "local", "round_robin")


def check_placement(mode: str) -> str:
    """Validate a placement policy name."""
    if mode not in MODES:
        raise InvalidRequestError(
            f"placement must be one of {', '.join(repr(m) for m in MODES)}, got {mode!r}"
        )
    return mode


class Placer:
    """Chooses the unit of each put (see the module docstring).

    Args:
        mode: ``"auto"``, ``"local"`` or ``"round_robin"``.
    """

    def __init__(self, mode: str = "auto") -> None:
        self.mode = check_placement(mode)
        self._turn = 0

    def effective_mode(self, live: Sequence[int], hosts: Mapping[int, str]) -> str:
        """``"local"`` or ``"round_robin"``: what ``"auto"`` means for these live units."""
        if self.mode != "auto":
            return self.mode
        known = {hosts.get(u, "") for u in live}
        known.discard("")
        return "local" if len(known) > 1 else "round_robin"

    def choose(
        self,
        live: Sequence[int],
        hosts: Mapping[int, str],
        loads: Mapping[int, int],
        producer_host: str = "",
        n_rows: int = 0,
    ) -> int:
        """The unit for a put of ``n_rows`` new rows from ``producer_host``.

        Args:
            live: the units that may take rows (neither lost nor suspended), not empty.
            hosts: each unit's host id (missing or ``""``: unknown).
            loads: each unit's load (live rows); missing: 0.
            producer_host: the putting client's host id (``""``: unknown).
            n_rows: the put's new rows (the slack before its host spills).
        """
        ordered = sorted(live)
        turn = self._turn
        self._turn += 1
        if self.effective_mode(ordered, hosts) == "round_robin":
            return ordered[turn % len(ordered)]
        local = [u for u in ordered if producer_host and hosts.get(u, "") == producer_host]
        if local and not _over(local, ordered, loads, n_rows):
            return _least_loaded(local, loads, turn)
        others = [u for u in ordered if u not in local]
        return _least_loaded(others or ordered, loads, turn)


def _mean(units: Sequence[int], loads: Mapping[int, int]) -> float:
    return sum(loads.get(u, 0) for u in units) / len(units)


def _over(local: Sequence[int], live: Sequence[int], loads: Mapping[int, int], slack: int) -> bool:
    """Whether the producer's host holds more than its share: ``SPILL_RATIO`` x the mean,
    and more than the mean plus ``slack`` rows."""
    host, mean = _mean(local, loads), _mean(live, loads)
    return host > SPILL_RATIO * mean and host > mean + slack


def _least_loaded(units: Sequence[int], loads: Mapping[int, int], turn: int) -> int:
    """The least-loaded of ``units``; ties broken in turn (so equal loads still spread)."""
    low = min(loads.get(u, 0) for u in units)
    tied = [u for u in units if loads.get(u, 0) == low]
    return tied[turn % len(tied)]
