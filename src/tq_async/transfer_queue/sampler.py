"""``transfer_queue.sampler``: the samplers."""

from __future__ import annotations

from ..samplers import BaseSampler as BaseSampler
from ..samplers import GRPOGroupNSampler as GRPOGroupNSampler
from ..samplers import RankAwareSampler as RankAwareSampler
from ..samplers import SeqlenBalancedSampler as SeqlenBalancedSampler
from ..samplers import SequentialSampler as SequentialSampler

__all__ = [
    "BaseSampler",
    "GRPOGroupNSampler",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
    "SequentialSampler",
]
