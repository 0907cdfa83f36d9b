"""``transfer_queue.sampler.sequential_sampler``: TransferQueue's module path."""

from __future__ import annotations

from tq_async.samplers import SequentialSampler as SequentialSampler

__all__ = ["SequentialSampler"]
