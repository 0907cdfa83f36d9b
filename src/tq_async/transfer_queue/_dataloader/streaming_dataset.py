"""``transfer_queue.dataloader.streaming_dataset``: TransferQueue's module path."""

from __future__ import annotations

from tq_async.compat import StreamingDataset as StreamingDataset
from tq_async.compat import chunk_batch_fn as chunk_batch_fn

__all__ = ["StreamingDataset", "chunk_batch_fn"]
