"""``transfer_queue.dataloader``: the streaming dataset and loader."""

from __future__ import annotations

from ..compat import StreamingDataLoader as StreamingDataLoader
from ..compat import StreamingDataset as StreamingDataset

__all__ = ["StreamingDataLoader", "StreamingDataset"]
