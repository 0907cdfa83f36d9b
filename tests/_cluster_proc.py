"""Test helpers that run in other processes: a ``tq-async serve`` cluster and a resume reader.

A DataLoader worker (forked or spawned) must reach the cluster over TCP while the test's own
thread is blocked iterating, so these tests run the services in a child process.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

_START_TIMEOUT = 60.0


def free_port() -> int:
    """A loopback TCP port free now (for a service that must come back at the same address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def sigkill(proc: subprocess.Popen[bytes]) -> None:
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
