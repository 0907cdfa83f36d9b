"""Writing your own sampler: two small ones, run as plain functions and inside a cluster.

A sampler answers one question per ``get_meta`` request: given the rows ready for this task
(``ready_indexes``, in the order they became ready), which rows does this request get
(``sampled``) and which become consumed (``consumed``)? Returning ``([], [])`` means "not
enough yet": the controller waits for the partition to change and asks again. Context comes
as keyword arguments; name the ones you need (``tags``, ``final``, ``dp_rank``...) and take
``**kwargs`` for the rest. The controller asks only once ``batch_size`` rows are ready or the
partition is final (TransferQueue's contract); a sampler that sets ``short_ready_ok = True``
is asked on every readiness event, with however many rows are ready.

Run it with ``python examples/custom_sampler.py``.
"""

from __future__ import annotations

import asyncio
import heapq
import random
from collections.abc import Mapping, Sequence
from typing import Any

from tq_async.samplers import BaseSampler, SampleResult


class PrioritySampler(BaseSampler):
    """Highest ``priority`` tag first (ties: the row that became ready first).

    Rows without the tag count as priority 0. Sampled rows are consumed. Waits until
    ``batch_size`` rows are ready; once the partition is final it returns the rest.

    Args:
        key: the tag holding a row's priority.
    """

    def __init__(self, key: str = "priority") -> None:
        self.key = key

    def sample(
        self,
        ready_indexes: Sequence[int],
        batch_size: int,
        *args: Any,
        tags: Mapping[int, Mapping[str, Any]] | None = None,
        final: bool = False,
        **kwargs: Any,
    ) -> SampleResult:
        """Take the ``batch_size`` ready rows with the highest priority."""
        if len(ready_indexes) < batch_size and not (final and len(ready_indexes) > 0):
            return [], []

        def priority(pos_row: tuple[int, int]) -> tuple[float, int]:
            pos, row = pos_row
            row_tags = tags.get(row) if tags is not None else None
            value = row_tags.get(self.key, 0) if row_tags is not None else 0
            return float(value), -pos  # earlier ready position wins a tie

        # O(n log batch_size): one pass over the ready rows, no full sort.
        best = heapq.nlargest(batch_size, enumerate(ready_indexes), key=priority)
        rows = [row for _, row in best]
        return rows, list(rows)


class WithReplacementSampler(BaseSampler):
    """Random rows with replacement; nothing is consumed, so rows can come back any time.

    Args:
        seed: seed of the private ``random.Random`` (same seed, same draws).
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._rng = random.Random(seed)

    def sample(
        self, ready_indexes: Sequence[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> SampleResult:
        """Draw ``batch_size`` rows uniformly, with replacement, from the ready rows."""
        if len(ready_indexes) == 0:
            return [], []
        return self._rng.choices(list(ready_indexes), k=batch_size), []

    def state_dict(self) -> dict[str, Any]:
        """The seed and how far the generator has advanced (msgpack-able).

        Returns:
            ``{"seed": ..., "rng": [...]}``.
        """
        version, internal, gauss = self._rng.getstate()
        return {"seed": self.seed, "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the draws from a :meth:`state_dict`.

        Args:
            state: a previous :meth:`state_dict`.
        """
        self.seed = state["seed"]
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))


def main() -> None:
    """Call both samplers as plain functions on a fake ready list (no cluster needed)."""
    ready = list(range(10))
    tags = {row: {"priority": row % 4} for row in ready}

    priority = PrioritySampler()
    print("priority, 4 rows:      ", priority.sample(ready, 4, tags=tags))
    print("priority, not enough:  ", priority.sample(ready[:2], 4, tags=tags))
    print("priority, final:       ", priority.sample(ready[:2], 4, tags=tags, final=True))

    replacement = WithReplacementSampler(seed=42)
    print("with replacement:      ", replacement.sample(ready, 6))
    state = replacement.state_dict()
    again = replacement.sample(ready, 6)
    replacement.load_state_dict(state)
    assert replacement.sample(ready, 6) == again, "restoring the state replays the draws"


async def demo_cluster() -> None:
    """Run :class:`PrioritySampler` inside a local cluster through the public API."""
    import torch
    from tensordict import TensorDict

    import tq_async as tq

    async with (
        tq.local_cluster(num_storage_units=1, sampler=PrioritySampler()) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        td = TensorDict({"input_ids": torch.arange(8 * 4).reshape(8, 4)}, batch_size=[8])
        await client.put(
            td, partition_id="train@0", tags=[{"priority": p} for p in [0, 3, 1, 3, 2, 0, 1, 2]]
        )
        meta = await client.get_meta(
            data_fields=["input_ids"], batch_size=4, partition_id="train@0", task_name="demo"
        )
        print("cluster, highest priority first:", meta)


if __name__ == "__main__":
    main()
    asyncio.run(demo_cluster())
