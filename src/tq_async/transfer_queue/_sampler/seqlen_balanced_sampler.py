"""``transfer_queue.sampler.seqlen_balanced_sampler``: TransferQueue's module path."""

from __future__ import annotations

from tq_async.samplers import SeqlenBalancedSampler as SeqlenBalancedSampler
from tq_async.samplers import get_seqlen_balanced_partitions as get_seqlen_balanced_partitions
from tq_async.samplers import karmarkar_karp as karmarkar_karp

__all__ = ["SeqlenBalancedSampler", "get_seqlen_balanced_partitions", "karmarkar_karp"]
