"""The default sampler: the first ``batch_size`` ready rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._base import BaseSampler, SampleResult, check_context

__all__ = ["SequentialSampler"]


class SequentialSampler(BaseSampler):
    """First-ready, first-served: the ``batch_size`` rows that became ready earliest.

    Waits (returns ``([], [])``) until ``batch_size`` rows are ready; once the partition is
    final (sealed and fully produced) it returns the short remainder. It reads none of the
    row views (``tags``, ``origin``, ...), so the controller builds none for it; a subclass
    with a ``sample`` or ``sample_shares`` of its own is given every one.
    """

    short_ready_ok = True
    """True: asked on every readiness event, it waits (``([], [])``) by itself."""

    def sample(
        self,
        ready_indexes: Sequence[int],
        batch_size: int,
        *args: Any,
        final: bool = False,
        **kwargs: Any,
    ) -> SampleResult:
        check_context(batch_size, kwargs)
        if len(ready_indexes) >= batch_size:
            rows = list(ready_indexes[:batch_size])
        elif final and len(ready_indexes) > 0:
            rows = list(ready_indexes)
        else:
            return [], []
        return rows, list(rows)
