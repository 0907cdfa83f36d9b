"""An opt-in logging setup for applications (the library itself never configures logging)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

__all__ = ["configure_logging"]


def configure_logging(level: int | str = "INFO", *, json: bool = False) -> None:
    """Configure structlog for an application that uses tq_async.

    tq_async logs through ``structlog.get_logger(__name__)`` and never calls this itself;
    applications that have no logging setup of their own may call it once at start-up.

    Args:
        level: the lowest level printed (``"DEBUG"``, ``"INFO"``, ``logging.WARNING``, ...).
        json: one JSON object per line (for log shippers) instead of coloured console lines.
    """
    numeric = logging.getLevelName(level) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
