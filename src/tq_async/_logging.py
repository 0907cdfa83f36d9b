"""Logging: structured key-values through standard ``logging`` loggers named after modules.

Every module logs with ``log = get_logger(__name__)``: a structlog ``BoundLogger`` (so calls
read ``log.warning("unit lost", unit=3)``) that wraps ``logging.getLogger(__name__)``, with its
own processors and without ``structlog.configure``. So the application's logging
configuration decides what is shown and where: a program that configures nothing gets
nothing on stdout and, as Python's default has it, only warnings and errors on stderr. Each
record's message reads ``event key=value ...``; its ``tq_event`` attribute holds the
key-values for structured formatters.

Python prints a record no handler takes with `logging.lastResort`, as its bare message:
a line that does not say it is a warning, nor whose. The ``tq_async`` logger therefore has one
handler of its own (`_LastResort`, the library's counterpart of the usual
``NullHandler``): it prints exactly what the last resort would, when it would, prefixed with
the level and the logger (``WARNING tq_async._controller: ...``), and nothing as soon as the
application has a handler that sees the record (``logging.basicConfig``, pytest's capture,
`configure_logging`) or silenced the last resort (``logging.lastResort = None``). It
configures nothing else: no level, no root handler, no structlog set-up.

``configure_logging`` is an opt-in set-up for applications (and ``tq-async serve``) that
have none of their own.
"""

from __future__ import annotations

import json as _json
import logging
import sys
from collections.abc import MutableMapping
from datetime import datetime, timezone
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from ._errors import InvalidRequestError

__all__ = ["configure_logging", "get_logger"]


def _captured(logger: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
    """Hand the event to ``structlog.testing.capture_logs()`` while one is active."""
    for processor in structlog.get_config()["processors"]:
        if isinstance(processor, structlog.testing.LogCapture):
            processor(logger, method, dict(event_dict))  # raises DropEvent
    return event_dict


def _to_stdlib(
    logger: WrappedLogger, method: str, event_dict: EventDict
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The last processor: what ``logging.Logger.<method>`` is called with."""
    exc_info = event_dict.pop("exc_info", None)
    event = str(event_dict.get("event", ""))
    pairs = " ".join(f"{k}={v!r}" for k, v in event_dict.items() if k != "event")
    message = f"{event} {pairs}" if pairs else event
    kwargs: dict[str, Any] = {"extra": {"tq_event": dict(event_dict)}}
    if exc_info:
        kwargs["exc_info"] = exc_info
    return (message,), kwargs


_PROCESSORS: list[Processor] = [
    structlog.stdlib.filter_by_level,  # first: a disabled level costs one check
    structlog.contextvars.merge_contextvars,
    _captured,
    _to_stdlib,
]


class _LastResort(logging.Handler):
    """`logging.lastResort` for tq_async's records, with the level and the logger.

    It acts only where the last resort would: no other handler on the record's way up the
    logger tree, and the last resort enabled, at its level (warnings and errors).
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        fallback = logging.lastResort
        if fallback is None or record.levelno < fallback.level or self._taken(record.name):
            return
        try:
            sys.stderr.write(self.format(record) + "\n")  # stderr as it is now (pytest swaps it)
            sys.stderr.flush()
        except Exception:
            self.handleError(record)

    def _taken(self, name: str) -> bool:
        """Whether another handler sees records of logger ``name`` (as ``callHandlers`` walks)."""
        logger: logging.Logger | None = logging.getLogger(name)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return True
            if not logger.propagate:
                return False
            logger = logger.parent
        return False


if not any(isinstance(h, _LastResort) for h in logging.getLogger("tq_async").handlers):
    logging.getLogger("tq_async").addHandler(_LastResort())


def get_logger(name: str) -> Any:
    """The structured logger of module ``name`` (a ``logging.getLogger(name)`` underneath)."""
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


class StructuredFormatter(logging.Formatter):
    """Renders records as structlog does: coloured or plain console lines, or JSON.

    Args:
        mode: ``"console"`` (coloured), ``"plain"`` (the same without ANSI codes) or
            ``"json"`` (one object per line).
    """

    def __init__(self, mode: str = "plain") -> None:
        super().__init__()
        self.mode = mode
        self._console = structlog.dev.ConsoleRenderer(colors=mode == "console")

    def format(self, record: logging.LogRecord) -> str:
        event: MutableMapping[str, Any] = dict(getattr(record, "tq_event", None) or {})
        event.setdefault("event", record.getMessage())
        when = datetime.fromtimestamp(record.created, tz=timezone.utc)
        head = {
            "timestamp": when.isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        event = {**head, **event}
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        if self.mode == "json":
            return _json.dumps(event, default=repr)
        return str(self._console(None, record.levelname.lower(), event))


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler `configure_logging` installs (replaced by a second call)."""


def configure_logging(
    level: int | str = "INFO", *, json: bool = False, stream: TextIO | None = None
) -> None:
    """Show tq_async's logs (and structlog's) on stderr: an opt-in for applications.

    The library never calls this. It adds one handler to the ``tq_async`` logger (a second
    call replaces it) and configures structlog for the application's own structlog loggers;
    with a logging set-up of your own, skip it: tq_async's records go through the standard
    ``logging`` loggers named after its modules (``tq_async._client._async._client``, ...).

    Args:
        level: the lowest level shown, as a name in any case (``"debug"``, ``"INFO"``) or a
            number (``logging.WARNING``).
        json: one JSON object per line (for log shippers). Otherwise coloured lines on a
            terminal and plain lines (no ANSI codes) elsewhere.
        stream: where to write (``sys.stderr`` by default).

    Raises:
        ValueError: an unknown level name.
    """
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise InvalidRequestError(f"unknown log level {level!r}; use debug, info, warning or error")
    out = stream if stream is not None else sys.stderr
    tty = bool(getattr(out, "isatty", lambda: False)())
    mode = "json" if json else ("console" if tty else "plain")
    root = logging.getLogger("tq_async")
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    handler = _Handler(out)
    handler.setFormatter(StructuredFormatter(mode))
    root.addHandler(handler)
    root.setLevel(numeric)
    root.propagate = False  # shown once, here, not again by the application's root handlers
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=mode == "console")
    )
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
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
