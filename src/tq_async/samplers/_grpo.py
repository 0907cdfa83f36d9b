"""Whole prompt groups for GRPO-style training: a batch never splits a group."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import InvalidRequestError
from .._logging import get_logger
from ._base import BaseSampler, SampleResult, check_context
from ._groups import check_group_size, complete_groups

__all__ = ["GRPOGroupNSampler"]

log = get_logger(__name__)


class GRPOGroupNSampler(BaseSampler):
    """Hands out only whole groups of ``n_samples_per_prompt`` rows (one prompt's responses).

    A row's group is the group it was put with, never "any n consecutive row ids":

    * its ``group_key`` tag (e.g. ``tags=[{"uid": 7}, ...]`` on put) when it has one;
    * otherwise the put that allocated it, cut into runs of ``n`` rows (rows of one put are
      contiguous, so a put of ``4 * g`` rows holds ``g`` groups);
    * otherwise, in a pure call with neither ``tags`` nor ``origin``, ``row // n``.

    A group is complete when all ``n`` rows are ready. A request for ``batch_size`` rows gets
    the first ``batch_size // n`` groups to complete while scanning the ready rows (the scan
    stops there, so it costs ``O(batch_size)`` when rows arrive in order), ordered by where
    each group first appears among the ready rows, rows of a group together. Sampled rows are
    consumed. Until enough groups are complete the sampler waits (returns ``([], [])``); once
    the partition is final it returns the complete groups there are, never a partial group.

    Example:
        >>> GRPOGroupNSampler(4).sample([1, 2, 3, 4, 5, 6, 7], 4)
        ([4, 5, 6, 7], [4, 5, 6, 7])

    Args:
        n_samples_per_prompt: rows per group (the rollout ``n``); at least 1 (the default,
            as in TransferQueue: every row is its own group).
        group_key: the tag that names a row's group.

    Raises:
        ValueError: ``n_samples_per_prompt < 1``.
    """

    def __init__(self, n_samples_per_prompt: int = 1, group_key: str = "uid") -> None:
        if n_samples_per_prompt < 1:
            raise InvalidRequestError(
                f"n_samples_per_prompt must be >= 1 (rows per prompt group), "
                f"got {n_samples_per_prompt}"
            )
        self.n_samples_per_prompt = n_samples_per_prompt
        self.group_key = group_key

    @property
    def short_ready_ok(self) -> bool:
        """True: asked on every readiness event, it waits (``([], [])``) by itself."""
        return True

    def sample(
        self,
        ready_indexes: Sequence[int],
        batch_size: int,
        *args: Any,
        tags: Mapping[int, Mapping[str, Any]] | None = None,
        origin: Mapping[int, tuple[int, int]] | None = None,
        final: bool = False,
        tail: str = "uneven",
        **kwargs: Any,
    ) -> SampleResult:
        """Pick the first ``batch_size // n`` complete groups; see the class docstring.

        Args:
            ready_indexes: ready rows in the order they became ready.
            batch_size: rows wanted; a multiple of ``n_samples_per_prompt``.
            *args: ignored (accepted for the contract).
            tags: ``row -> tags`` view from the controller.
            origin: ``row -> (first row of its put, offset in the put)`` from the controller.
            final: no more rows can become ready: return a short batch of whole groups.
            tail: once final with only rows of incomplete groups left: ``"uneven"``
                delivers them (a warning; nothing is lost), ``"drop"`` consumes them
                undelivered (a warning; counted in the partition's status), ``"error"``
                raises.
            **kwargs: other context from the controller (ignored).

        Returns:
            ``(rows, rows)``, or ``([], [])`` while too few groups are complete.

        Raises:
            ValueError: ``batch_size`` is not a positive multiple of ``n_samples_per_prompt``,
                or more than ``n_samples_per_prompt`` ready rows share one group tag.
        """
        n = self.n_samples_per_prompt
        check_group_size(n, batch_size)
        check_context(batch_size, kwargs)
        wanted = batch_size // n
        groups = complete_groups(
            ready_indexes, n, wanted, tags=tags, origin=origin, group_key=self.group_key
        )
        if not groups and final and len(ready_indexes) > 0:
            return self._partial_tail(ready_indexes, batch_size, tail, kwargs)
        if not groups or (len(groups) < wanted and not final):
            return [], []
        rows = [r for g in groups for r in g]
        return rows, list(rows)

    def _partial_tail(
        self, ready_indexes: Sequence[int], batch_size: int, tail: str, kwargs: dict[str, Any]
    ) -> SampleResult:
        """The partition is final and only rows of incomplete groups are left."""
        rows = list(ready_indexes)
        where = {"partition_id": kwargs.get("partition_id"), "task": kwargs.get("task_name")}
        if tail == "drop":
            log.warning("dropping rows of incomplete groups", rows=len(rows), **where)
            return [], rows
        if tail == "error":
            raise ValueError(
                f"the partition is final and {len(rows)} ready row(s) belong to groups of fewer "
                f"than n_samples_per_prompt={self.n_samples_per_prompt} rows; put whole "
                "groups, or ask with tail='uneven' (deliver them) or 'drop'"
            )
        log.warning("delivering rows of incomplete groups", rows=len(rows), **where)
        return rows[:batch_size], rows[:batch_size]

    @property
    def group_size(self) -> int:
        """``n_samples_per_prompt``: groups are never split across ranks."""
        return self.n_samples_per_prompt

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(n_samples_per_prompt={self.n_samples_per_prompt}, "
            f"group_key={self.group_key!r})"
        )
