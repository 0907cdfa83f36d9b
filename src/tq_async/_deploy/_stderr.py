"""Where ``tq-async serve`` writes its logs: stderr, without ever blocking the event loop.

A launcher may pipe a service's stderr and read it late, or never. A write to a full pipe
blocks, and a log line written from the event loop then stops the service: it answers
nothing more. `LogStream` queues the lines (up to `LIMIT` bytes) and a thread of its
own writes them; while the reader lags that far behind, the lines that do not fit are
dropped and counted, and one line says how many once there is room again.
"""

from __future__ import annotations

import json as _json
import os
import select
import threading
import time
import weakref
from collections import deque
from datetime import datetime, timezone

__all__ = ["LogStream", "close_all"]

#: bytes of lines queued at most (a launcher that reads stderr late gets them all)
LIMIT = 4 << 20
#: at close, give up writing what is queued once nothing could be written for this long
IDLE_AT_CLOSE = 1.0


class LogStream:
    """A text stream for `configure_logging`: ``write`` queues, a thread writes to ``fd``.

    The thread writes with ``os.write`` on a descriptor of its own (a duplicate of ``fd``):
    no lock of ``sys.stderr`` is held while a write blocks, so the process exits even when
    the thread never finishes one. A descriptor that fails (the reader closed the pipe, the
    terminal went away) drops every line from then on.

    Args:
        fd: where the lines go (stderr's descriptor).
        limit: bytes queued at most.
        json: the lines are JSON objects (``--log-json``): so is the note of those dropped.
    """

    def __init__(self, fd: int, limit: int = LIMIT, *, json: bool = False) -> None:
        self._json = json
        try:
            self._fd = os.dup(fd)
        except OSError:  # closed (a launcher that gave the service none): lines are dropped
            self._fd = -1
        self._tty = self._fd >= 0 and os.isatty(fd)
        self._limit = limit
        self._ready = threading.Condition()
        self._lines: deque[bytes] = deque()
        self._queued = 0  # bytes in _lines and in the write under way
        self._dropped = 0  # lines dropped since the last note saying so
        self._closed = False
        self._broken = self._fd < 0
        self._wrote_at = time.monotonic()  # when a write last made progress
        self._thread = threading.Thread(target=self._run, name="tq-async-stderr", daemon=True)
        self._thread.start()
        _STREAMS.add(self)

    def isatty(self) -> bool:
        return self._tty

    def write(self, text: str) -> int:
        """Queue ``text`` (dropped, and counted, when it does not fit)."""
        data = text.encode("utf-8", "backslashreplace")
        with self._ready:
            if self._broken or self._closed:
                return len(text)
            note = self._note() if self._dropped else b""
            if self._queued + len(note) + len(data) > self._limit:
                self._dropped += max(1, data.count(b"\n"))
                return len(text)
            if note:
                self._dropped = 0
                self._append(note)
            self._append(data)
        return len(text)

    def flush(self) -> None:
        """Nothing to do: the thread writes as soon as the descriptor takes it."""

    def close(self, idle: float = IDLE_AT_CLOSE) -> None:
        """Write what is queued, giving up once nothing could be written for ``idle``
        seconds (a reader that never reads does not keep the process from exiting)."""
        with self._ready:
            if self._closed:
                return
            if self._dropped and not self._broken:
                self._append(self._note())
            self._closed = True
            self._ready.notify()
        while self._thread.is_alive():
            self._thread.join(idle)
            if time.monotonic() - self._wrote_at >= idle:
                return  # the thread stays blocked in its write: a daemon, left to the exit
        if self._fd >= 0:
            os.close(self._fd)

    def _note(self) -> bytes:
        event = "log lines dropped: stderr was not read fast enough"
        if not self._json:
            return f"tq-async: {self._dropped} {event}\n".encode()
        when = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        note = {"timestamp": when, "level": "warning", "logger": __name__, "event": event}
        return (_json.dumps({**note, "count": self._dropped}) + "\n").encode()

    def _append(self, data: bytes) -> None:
        self._lines.append(data)
        self._queued += len(data)
        self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._lines and not self._closed:
                    self._ready.wait()
                if not self._lines:
                    return
                data = b"".join(self._lines)
                self._lines.clear()
            try:
                self._write_all(data)
            except OSError:
                with self._ready:
                    self._broken = True
                    self._lines.clear()
                    self._queued = 0
                return
            with self._ready:
                self._queued -= len(data)

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._fd, view) :]
            except BlockingIOError:  # a descriptor someone made non-blocking: wait for room
                select.select([], [self._fd], [])
                continue
            self._wrote_at = time.monotonic()


_STREAMS: weakref.WeakSet[LogStream] = weakref.WeakSet()


def close_all(idle: float = IDLE_AT_CLOSE) -> None:
    """`LogStream.close` every stream of this process: before it ends abruptly (a second
    signal), the lines it logged last come out."""
    for stream in list(_STREAMS):
        stream.close(idle)
