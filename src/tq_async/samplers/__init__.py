"""Samplers decide which ready rows each get_meta request receives."""

from ._base import BaseSampler as BaseSampler
from ._base import SampleResult as SampleResult
from ._grpo import GRPOGroupNSampler as GRPOGroupNSampler
from ._kk import get_seqlen_balanced_partitions as get_seqlen_balanced_partitions
from ._kk import karmarkar_karp as karmarkar_karp
from ._rank_aware import RankAwareSampler as RankAwareSampler
from ._seqlen import SeqlenBalancedSampler as SeqlenBalancedSampler
from ._sequential import SequentialSampler as SequentialSampler
from ._staleness import StalenessSampler as StalenessSampler
from ._staleness import StaleRows as StaleRows

__all__ = [
    "BaseSampler",
    "GRPOGroupNSampler",
    "RankAwareSampler",
    "SampleResult",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "StaleRows",
    "StalenessSampler",
    "get_seqlen_balanced_partitions",
    "karmarkar_karp",
]
