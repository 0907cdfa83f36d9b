"""``transfer_queue.metadata``: the batch handles."""

from __future__ import annotations

from .._compat_meta import BatchMeta as BatchMeta
from .._compat_meta import field_schema_of as extract_field_schema
from ..compat import KVBatchMeta as KVBatchMeta

__all__ = ["BatchMeta", "KVBatchMeta", "extract_field_schema"]
