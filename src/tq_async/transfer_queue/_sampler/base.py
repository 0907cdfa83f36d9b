"""``transfer_queue.sampler.base``: the sampler base class, at TransferQueue's module path."""

from __future__ import annotations

from tq_async.samplers import BaseSampler as BaseSampler

__all__ = ["BaseSampler"]
