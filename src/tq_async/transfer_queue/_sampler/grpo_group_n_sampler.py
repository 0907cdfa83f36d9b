"""``transfer_queue.sampler.grpo_group_n_sampler``: TransferQueue's module path."""

from __future__ import annotations

from tq_async.samplers import GRPOGroupNSampler as GRPOGroupNSampler

__all__ = ["GRPOGroupNSampler"]
