"""``transfer_queue.utils.logging_utils``: the logger helper TransferQueue's recipes call."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..._logging import get_logger as _get_logger

__all__ = ["get_logger"]


def get_logger(name: str | None, default_level: str = "WARNING", **_: Any) -> Any:
    """A structured logger for ``name`` that prints, as TransferQueue's helper does.

    The program asks for it by name (TransferQueue's recipes log their progress through it),
    so, like TransferQueue's, it sets that logger's level from ``TQ_LOGGING_LEVEL`` (else
    ``default_level``) and gives it a stderr handler when neither it nor the root logger has
    one. tq_async's own loggers are left alone.
    """
    logger = logging.getLogger(name)
    level = os.environ.get("TQ_LOGGING_LEVEL", default_level)
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(asctime)s - %(levelname)s - %(name)s - %(message)s")
        )
        logger.addHandler(handler)
    return _get_logger(logger.name)
