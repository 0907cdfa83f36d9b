"""Whole prompt groups for GRPO-style training: a batch never splits a group."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import InvalidRequestError
from .._logging import get_logger
from ._base import SampleResult, check_context, int_arg, tag_name
from ._groups import GroupingSampler, check_group_size, complete_groups

__all__ = ["GRPOGroupNSampler"]

log = get_logger(__name__)


class GRPOGroupNSampler(GroupingSampler):
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
    consumed. Until enough groups are complete the sampler waits (returns ``([], [])``).

    Once the partition is final (sealed, every put committed), a request gets the complete
    groups there are (a short batch, still of whole groups). Rows of groups that can never
    complete (fewer than ``n`` rows put under a ``uid``, or a put of a number of rows that
    is not a multiple of ``n``) come last, and the ``tail`` policy decides what happens to
    them: the sampler's own ``tail`` (what a pooled request follows), or a global batch's
    ``sampling_config={"dp_size": ..., "tail": ...}`` (see "DP ranks in lockstep" in
    ``docs/guarantees.md``):

    * ``"uneven"`` (the default): they are delivered, up to ``batch_size`` rows per request,
      as a **partial group** (rows of several incomplete groups may share that batch), with
      a warning from the ``tq_async.samplers._grpo`` logger; nothing is lost. Ask for
      ``"drop"`` when every batch must hold whole groups only.
    * ``"drop"``: they are consumed undelivered, with a warning, and counted in
      ``partition_info(...)["dropped"]``; every batch holds whole groups only.
    * ``"error"``: the request fails (``InvalidRequestError`` through the controller,
      ``ValueError`` called directly); nothing is consumed.

    A group never holds rows of two prompts: through the controller, a put (or
    ``set_tags``) that would give one ``group_key`` value more than ``n`` rows of a partition
    is refused whole (`group_tag`), and a get whose group's value has more than ``n``
    rows fails; called directly, more than ``n`` ready rows under one value raise
    ``ValueError``.

    Example:
        >>> GRPOGroupNSampler(4).sample([1, 2, 3, 4, 5, 6, 7], 4)
        ([4, 5, 6, 7], [4, 5, 6, 7])

    Args:
        n_samples_per_prompt: rows per group (the rollout ``n``); at least 1 (the default,
            as in TransferQueue: every row is its own group).
        group_key: the tag that names a row's group.
        tail: ``"uneven"``, ``"drop"`` or ``"error"`` (see above); None (the default): the
            request's (``"uneven"`` unless a global batch asks otherwise).

    Raises:
        InvalidRequestError: ``n_samples_per_prompt`` is no int (numpy's ints are taken) or
            below 1, ``group_key`` no string, or ``tail`` is unknown.
    """

    def __init__(
        self, n_samples_per_prompt: int = 1, group_key: str = "uid", tail: str | None = None
    ) -> None:
        n = int_arg("n_samples_per_prompt", n_samples_per_prompt, why=" (rows per prompt group)")
        if tail not in (None, "uneven", "drop", "error"):
            raise InvalidRequestError(f"tail must be 'uneven', 'drop' or 'error', got {tail!r}")
        self.n_samples_per_prompt = n
        self.group_key = tag_name("group_key", group_key)
        self.tail = tail

    @property
    def tail_policy(self) -> str | None:
        """``tail`` as given (None: the request's, ``"uneven"`` by default)."""
        return self.tail

    def sample(
        self,
        ready_indexes: Sequence[int],
        batch_size: int,
        *args: Any,
        tags: Mapping[int, Mapping[str, Any]] | None = None,
        origin: Mapping[int, tuple[int, int]] | None = None,
        final: bool = False,
        tail: str | None = None,
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
                delivers them as a partial group (a warning; nothing is lost), ``"drop"``
                consumes them undelivered (a warning; counted in the partition's status),
                ``"error"`` raises; None: the sampler's own ``tail``, else ``"uneven"`` (the
                controller passes the request's policy, which is the sampler's unless a
                global batch asks for another).
            **kwargs: other context from the controller (ignored).

        Returns:
            ``(rows, rows)``, or ``([], [])`` while too few groups are complete.

        Raises:
            ValueError: ``batch_size`` is not a positive multiple of ``n_samples_per_prompt``;
                more than ``n_samples_per_prompt`` rows share one group tag (ready ones, or
                any of the partition's through the controller's ``tags``); ``tail="error"``
                with only rows of incomplete groups left.
        """
        n = self.n_samples_per_prompt
        check_group_size(n, batch_size)
        check_context(batch_size, kwargs)
        wanted = batch_size // n
        groups = complete_groups(
            ready_indexes, n, wanted, tags=tags, origin=origin, group_key=self.group_key
        )
        if not groups and final and len(ready_indexes) > 0:
            policy = tail or self.tail or "uneven"
            return self._partial_tail(ready_indexes, batch_size, policy, kwargs)
        if not groups or (len(groups) < wanted and not final):
            return [], []
        rows = [r for g in groups for r in g]
        return rows, list(rows)

    def _partial_tail(
        self, ready_indexes: Sequence[int], batch_size: int, tail: str, kwargs: dict[str, Any]
    ) -> SampleResult:
        """The partition is final and only rows of incomplete groups are left."""
        rows = list(ready_indexes)
        n = self.n_samples_per_prompt
        pid, task = kwargs.get("partition_id"), kwargs.get("task_name")
        where = {"partition": pid, "task": task, "rows": len(rows), "n_samples_per_prompt": n}
        head = f"GRPOGroupNSampler({n}): partition {pid!r} is final and {len(rows)} ready row(s) "
        head += f"belong to prompt groups of fewer than {n} rows, which can never complete"
        if tail == "drop":
            log.warning(
                f"{head}; dropping {len(rows)} rows undelivered (tail='drop'; counted in "
                "partition_info()['dropped'])",
                **where,
            )
            return [], rows
        if tail == "error":
            raise ValueError(
                f"the partition is final and {len(rows)} ready row(s) belong to groups of fewer "
                f"than n_samples_per_prompt={self.n_samples_per_prompt} rows; put whole "
                "groups, or build the sampler with tail='uneven' (deliver them) or 'drop'"
            )
        given = rows[:batch_size]
        log.warning(
            f"{head}; delivering them as a partial group of {len(given)} rows (tail='uneven', "
            f"the default); build the sampler with GRPOGroupNSampler({n}, tail='drop') to drop "
            "them or tail='error' to fail instead (a global batch with dp_size may also pass "
            "sampling_config={'tail': 'drop'})",
            **where,
        )
        return given, list(given)

    def __repr__(self) -> str:
        tail = "" if self.tail is None else f", tail={self.tail!r}"
        return (
            f"{type(self).__name__}(n_samples_per_prompt={self.n_samples_per_prompt}, "
            f"group_key={self.group_key!r}{tail})"
        )
