"""``tq-async serve ...`` child processes for tests: start one, read the lines it prints, stop it.

Shared by the CLI, status, logging, example and multihost tests (a helper module at ``tests/``,
on pytest's ``pythonpath``, so no test module imports another).
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

#: generous: a service starts in ~0.3 s, but CI boxes are slow when several start at once
START_TIMEOUT = 60.0


class Service:
    """A ``tq-async serve ...`` child process; stdout is read line by line, stderr to a file."""

    def __init__(self, argv: Sequence[str], stderr_path: Path, prefix: Sequence[str] = ()) -> None:
        self.stderr_path = stderr_path
        self._stderr = stderr_path.open("w")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tq_async._deploy._cli", "serve", *argv],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    def wait_line(self, prefix: str, timeout: float = START_TIMEOUT) -> str:
        """The rest of the first stdout line starting with ``prefix`` (bounded wait)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {prefix!r} line within {timeout} s: {self.stderr()}")
                if not sel.select(timeout=left):
                    continue
                line = self.proc.stdout.readline()
                if not line:
                    code = self.proc.wait(timeout=10)
                    raise RuntimeError(f"service exited with {code}: {self.stderr()}")
                if line.startswith(prefix):
                    return line[len(prefix) :].strip()

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the process and return its exit code (killed after 20 s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


@contextmanager
def service(
    argv: Sequence[str], stderr_path: Path, prefix: Sequence[str] = ()
) -> Iterator[Service]:
    """Run ``tq-async serve *argv``; always killed on exit."""
    svc = Service(argv, stderr_path, prefix)
    try:
        yield svc
    finally:
        svc.close()


@contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port that is bound but never listens: every connection is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def parse_unit(line: str) -> tuple[int, str]:
    unit_id, address = line.split()
    return int(unit_id), address
