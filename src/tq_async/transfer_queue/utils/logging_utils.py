"""``transfer_queue.utils.logging_utils``: loggers."""

from __future__ import annotations

from typing import Any

from ..._logging import get_logger as _get_logger

__all__ = ["get_logger"]


def get_logger(
    name: str, default_level: Any = None, level_env_var: str | None = None, **_: Any
) -> Any:
    """tq_async's structured logger for ``name`` (``logger.info("text", key=value)`` and
    ``logger.info(f"text")`` both work). ``default_level`` and ``level_env_var`` are accepted
    and ignored: the application configures logging (``tq_async.configure_logging``)."""
    return _get_logger(name)
