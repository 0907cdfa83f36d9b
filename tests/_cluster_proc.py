"""Test helpers that run in other processes: a ``tq-async serve`` cluster, a resume reader, and
children forked warm (`warm_python`).

A DataLoader worker (forked or spawned) must reach the cluster over TCP while the test's own
thread is blocked iterating, so these tests run the services in a child process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from multiprocessing import forkserver
from types import TracebackType
from typing import Any

_START_TIMEOUT = 60.0

#: what a `warm_python` child has imported before it starts: the client (with torch and
#: tensordict, ~4.5 s of CPU for every fresh interpreter), a unit's durable cells
_WARM_MODULES = [
    "tq_async",
    "tq_async._client._async._client",
    "tq_async._storage._segments",
    "tensordict",
]
#: the environment the test session started with (this module is imported while the tests
#: are collected): what the fork server, and so every child forked from it, runs with
_SESSION_ENV = dict(os.environ)


def warm_context() -> Any:
    """The ``forkserver`` multiprocessing context whose server preloaded `_WARM_MODULES`: one
    per test process, started on first use with the session's environment -- not with what
    the test that happens to start it monkeypatched (every later child would inherit it)."""
    ctx = mp.get_context("forkserver")
    if not _warm_started:
        ctx.set_forkserver_preload(_WARM_MODULES)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(_SESSION_ENV)
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _warm_started.append(True)
    return ctx


_warm_started: list[bool] = []


def free_port() -> int:
    """A loopback TCP port free now (for a service that must come back at the same address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class WarmProcess:
    """A `warm_python` child: as much of a ``subprocess.Popen`` (binary pipes) as these tests
    use -- ``stdin`` and ``stdout`` (both ways of one socket), ``stderr`` (if asked for, else
    the test process's), ``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``; SIGKILLed on
    leaving its ``with`` (if still running)."""

    def __init__(self, code: str, argv: Sequence[str], *, stderr: bool = False) -> None:
        ctx = warm_context()
        ours, theirs = socket.socketpair()
        err = socket.socketpair() if stderr else (None, None)
        args = (code, list(argv), theirs, err[1])
        self._proc = ctx.Process(target=_run_code, args=args, daemon=True)
        self._proc.start()
        self.stdin = ours.makefile("wb")
        self.stdout = ours.makefile("rb")
        self.stderr = None if err[0] is None else err[0].makefile("rb")
        for sock in (theirs, ours, *err):  # (ours closes with the last of its files)
            if sock is not None:
                sock.close()
        self.pid = self._proc.pid

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired("warm_python", timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:  # (not reaped yet: its pid is still its own)
            os.kill(self._proc.pid or 0, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.poll() is None:
            sigkill(self)
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()


def warm_python(code: str, *argv: str, stderr: bool = False) -> WarmProcess:
    """``python -c CODE ARGV...`` without the interpreter's start: forked from a server
    that imported the client once (per test process), so a child that connects a client
    starts in a fraction of a second, not ~4.5 s of CPU. It is a process of its own, killed
    as any other; its stdin and stdout (and its stderr, with ``stderr``: then read it, or a
    child that writes much blocks) are `WarmProcess`'s. Its environment is the server's (this
    process's when the first one started): not for a child that needs a variable set since,
    nor for code that must patch a module before its first import."""
    return WarmProcess(code, argv, stderr=stderr)


def _run_code(code: str, argv: list[str], sock: socket.socket, err: socket.socket | None) -> None:
    """In a `warm_python` child: ``sock`` as stdin and stdout (``err`` as stderr, if given),
    then ``code`` as ``__main__``."""
    os.dup2(sock.fileno(), 0)
    os.dup2(sock.fileno(), 1)
    sock.close()
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own, for its life
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    if err is not None:
        os.dup2(err.fileno(), 2)
        err.close()
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    sys.argv = ["-c", *argv]
    try:
        exec(compile(code, "<warm_python>", "exec"), {"__name__": "__main__"})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def sigkill(proc: subprocess.Popen[bytes] | WarmProcess) -> None:
    """SIGKILL ``proc`` and wait for it to be gone."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


@contextmanager
def serve_cluster(storage_units: int = 2, args: Sequence[str] = ()) -> Iterator[str]:
    """Run ``tq-async serve`` (plus ``args``) in a subprocess; yield its address; terminate
    it on exit."""
    with serve_role("--storage-units", str(storage_units), *args) as (_, address):
        yield address


@contextmanager
def serve_role(
    *argv: str, line: str = "TQ_ADDRESS="
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Run ``tq-async serve ARGV...`` (``controller``, ``storage ...``); yield the process and
    what follows ``line`` in its output (``TQ_UNIT=`` for a unit); terminate it on exit."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tq_async._deploy._cli", "serve", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        yield proc, _read_address(proc, line.encode())
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def _read_address(proc: subprocess.Popen[bytes], prefix: bytes = b"TQ_ADDRESS=") -> str:
    """The ``TQ_ADDRESS=`` line, waited for with a deadline (the child may fail to start)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + _START_TIMEOUT
    pending = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(prefix):
                    return line.decode().strip().split("=", 1)[1]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("tq-async serve did not print its address in time")
            if sel.select(timeout=left):
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"tq-async serve exited with {proc.wait(timeout=10)}")
                pending += chunk


def resume_and_read(kwargs: Mapping[str, Any], state: Mapping[str, Any]) -> list[Any]:
    """In a fresh process: build a StreamingDataset, load ``state``, read to end of stream.

    Returns ``[(batch_index, rows, x values), ...]`` for every micro-batch.
    """
    from tq_async._datasets._torch import StreamingDataset

    ds = StreamingDataset(**kwargs)
    ds.load_state_dict(state)
    out: list[Any] = [
        (meta.batch_index, list(meta.global_indexes), td["x"].tolist()) for td, meta in ds
    ]
    out.append(("state", ds.state_dict()))
    return out


def put_cuda_and_exit(address: str) -> None:
    """In a fresh process: put a CUDA column into partition "gone", seal it, exit."""
    import torch

    import tq_async as tq

    with tq.Client.connect(address) as client:
        x = torch.arange(64 * 4096, device="cuda", dtype=torch.float32).reshape(64, 4096)
        client.put({"x": x}, partition_id="gone")
        client.seal("gone")
