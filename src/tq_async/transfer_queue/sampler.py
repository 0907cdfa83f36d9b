"""``transfer_queue.sampler``: the samplers.

A package as in TransferQueue: its submodules (``base``, ``grpo_group_n_sampler``,
``rank_aware_sampler``, ``seqlen_balanced_sampler``, ``sequential_sampler``) live in
``_sampler/``, so that ``transfer_queue.sampler.<module>`` imports (trainers import those paths).
"""

from __future__ import annotations

import os

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

#: where ``import transfer_queue.sampler.<module>`` finds its submodules
__path__ = [os.path.join(os.path.dirname(__file__), "_sampler")]
