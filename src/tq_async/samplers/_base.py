"""The sampler contract, identical to TransferQueue's so custom samplers port unchanged.

``sample(ready_indexes, batch_size, *args, **kwargs) -> (sampled, consumed)``

* ``ready_indexes``: rows of the partition that have every requested field and that the task
  has not consumed, in the order they became ready (a read-only sequence; prefix slices such as
  ``ready_indexes[:k]`` are O(k)).
* ``batch_size``: how many rows the caller asked for.
* ``sampled``: the rows handed to the caller (in this order).
* ``consumed``: the rows to mark consumed for the task (usually equal to ``sampled``; a
  with-replacement sampler returns ``[]``; a sampler that assigns rows to several ranks at once
  consumes all of them on the first call).

Returning ``([], [])`` means "not enough yet": the controller waits for the partition's next
readiness event and calls again; it never polls on a timer. ``sample`` may be ``async def``.

The controller passes context as keyword arguments (a sampler whose ``sample`` does not take
``**kwargs`` only receives those it names):

``partition_id``, ``task_name``, ``data_fields``
    what was asked for;
``dp_rank``, ``batch_index``
    from the caller's ``sampling_config`` (``None`` when absent);
``sampling_config``
    the caller's whole ``sampling_config`` dict;
``tags``
    read-only ``row -> Mapping`` view of every row's tags (e.g. ``uid``, ``total_lengths``);
``origin``
    read-only ``row -> (first_row_of_its_put, offset_in_that_put)``;
``final``
    True when no more rows can become ready (the partition is sealed and nothing is still
    being produced): a sampler may then return a short last batch.
``replays_served``
    True when the controller records this delivery under its ``batch_index`` and serves
    repeats itself (a cache needs one read per entry, not one per replica).
``policy_version``, ``versions``, ``stale``
    the learner's announced policy version (-1: none), a read-only ``row -> version`` view
    (-1: none; a row's oldest field version), and a :class:`~tq_async.samplers.StaleRows` sink
    for reporting stale rows (see :class:`~tq_async.samplers.StalenessSampler`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Any

__all__ = ["BaseSampler", "SampleResult", "SharesResult"]

SampleResult = tuple[list[int], list[int]]
#: ``(shares, consumed)``: one list of rows per DP rank, and the rows to mark consumed
SharesResult = tuple[list[list[int]], list[int]]


class BaseSampler:
    """Base class of samplers; subclasses implement :meth:`sample`.

    Stateful samplers also override :meth:`clear_partition` (drop everything cached for a
    partition), :meth:`state_dict` and :meth:`load_state_dict`.
    """

    def sample(
        self, ready_indexes: Sequence[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> SampleResult | Awaitable[SampleResult]:
        """Choose rows for one request; see the module docstring for the contract."""
        raise NotImplementedError

    def sample_shares(
        self, ready_indexes: Sequence[int], batch_size: int, dp_size: int, **kwargs: Any
    ) -> SharesResult | Awaitable[SharesResult] | None:
        """Choose one global batch for ``dp_size`` ranks at once (collective-safe mode).

        The controller calls this when a request's ``sampling_config`` carries ``dp_size``
        (or the sampler was built for several ranks, see :attr:`dp_size_hint`), once per
        ``batch_index``, and records every rank's share before any rank reads its own. It
        then applies the tail policy to shares of unequal length.

        Returns:
            ``(shares, consumed)`` with ``dp_size`` shares (``([], [])``: not enough yet), or
            None (the default): the controller asks :meth:`sample` for ``batch_size *
            dp_size`` rows and cuts them in order into ``dp_size`` shares, keeping runs of
            :attr:`group_size` rows together.
        """
        return None

    @property
    def group_size(self) -> int:
        """Rows that must stay together when a global batch is split across ranks."""
        return 1

    @property
    def dp_size_hint(self) -> int | None:
        """The number of DP ranks the sampler was built for (None: any)."""
        return None

    @property
    def tail_policy(self) -> str | None:
        """The tail policy the sampler was built with (None: the caller's, ``"uneven"``)."""
        return None

    def clear_partition(self, partition_id: str) -> None:
        """Forget everything cached for ``partition_id`` (called when it is cleared)."""
        return None

    def reset_partition(self, partition_id: str, task_name: str | None) -> None:
        """Forget cached assignments after ``reset_consumption`` (all tasks when None)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state, for checkpoints (msgpack-able values only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
