"""``transfer_queue.utils``: the helpers TransferQueue's recipes import."""

from __future__ import annotations

from .logging_utils import get_logger as get_logger

__all__ = ["get_logger"]
