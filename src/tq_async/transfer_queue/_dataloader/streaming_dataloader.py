"""``transfer_queue.dataloader.streaming_dataloader``: TransferQueue's module path."""

from __future__ import annotations

from tq_async.compat import StreamingDataLoader as StreamingDataLoader

__all__ = ["StreamingDataLoader"]
