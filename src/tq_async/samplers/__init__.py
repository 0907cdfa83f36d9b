"""Samplers decide which ready rows each get_meta request receives."""

from ._base import BaseSampler as BaseSampler
from ._base import SampleResult as SampleResult
from ._sequential import SequentialSampler as SequentialSampler

__all__ = ["BaseSampler", "SampleResult", "SequentialSampler"]
