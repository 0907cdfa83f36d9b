"""``transfer_queue.sampler.rank_aware_sampler``: TransferQueue's module path."""

from __future__ import annotations

from tq_async.samplers import RankAwareSampler as RankAwareSampler

__all__ = ["RankAwareSampler"]
