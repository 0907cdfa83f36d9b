"""``transfer_queue.dataloader``: the streaming dataset and loader.

A package as in TransferQueue: its submodules (``streaming_dataset``,
``streaming_dataloader``) live in ``_dataloader/``, so that ``transfer_queue.dataloader.<module>``
imports (trainers import those paths).
"""

from __future__ import annotations

import os

from ..compat import StreamingDataLoader as StreamingDataLoader
from ..compat import StreamingDataset as StreamingDataset

__all__ = ["StreamingDataLoader", "StreamingDataset"]

#: where ``import transfer_queue.dataloader.<module>`` finds its submodules
__path__ = [os.path.join(os.path.dirname(__file__), "_dataloader")]
