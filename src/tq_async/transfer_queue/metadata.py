"""``transfer_queue.metadata``: the batch handles."""

from __future__ import annotations

from ..compat import KVBatchMeta as KVBatchMeta
from ..compat._batch_meta import BatchMeta as BatchMeta
from ..compat._batch_meta import field_schema_of as extract_field_schema

__all__ = ["BatchMeta", "KVBatchMeta", "extract_field_schema"]
