"""``tq-async status ADDRESS``: a running ``tq-async serve`` on one screen, as JSON, live."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import tq_async as tq
from _services import START_TIMEOUT, refused_port, service


def _status(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tq_async._deploy._cli", "status", *argv],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


async def test_status_shows_partitions_tasks_and_units(tmp_path: Path) -> None:
    with service([], tmp_path / "serve.err") as svc:
        address = svc.wait_line("TQ_ADDRESS=")
        async with tq.AsyncClient.connect(address) as client:
            await client.put({"x": torch.arange(4)}, "p")
            await client.get_meta(["x"], 2, "p", "t", lease=60)
            await client.seal("p")

            done = _status(address)
            assert done.returncode == 0, done.stderr
            screen = done.stdout
            assert f"tq-async cluster at {address}" in screen
            assert "p: 4 rows, sealed, fields: x" in screen
            assert "task t: consumed 2, ready 2, leased 2" in screen
            assert "unit 0 [up]" in screen
            assert "unit 1 [up]" in screen
            assert "policy version: -1" in screen

            done = _status(address, "--json")
            assert done.returncode == 0, done.stderr
            status = json.loads(done.stdout)
            info = status["partitions"]["p"]
            assert (info["rows"], info["sealed"], info["consumed"]) == (4, True, {"t": 2})
            assert (info["ready"], info["leased"]) == ({"t": 2}, {"t": 2})
            assert sum(u["rows"] for u in status["units"].values()) == 4
            assert {u["state"] for u in status["units"].values()} == {"up"}
        assert svc.stop() == 0


def test_status_watch_prints_again_when_the_cluster_changes(tmp_path: Path) -> None:
    with service([], tmp_path / "serve.err") as svc:
        address = svc.wait_line("TQ_ADDRESS=")
        argv = ["status", address, "--json", "--watch", "--screens", "2"]
        with subprocess.Popen(
            [sys.executable, "-m", "tq_async._deploy._cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        ) as watcher:
            assert watcher.stdout is not None
            first = json.loads(watcher.stdout.readline())  # subscribed before it printed
            assert first["partitions"] == {}
            with tq.Client.connect(address) as client:
                client.put({"x": torch.arange(3)}, "p")
            second = json.loads(watcher.stdout.readline())
            assert second["partitions"]["p"]["rows"] in (0, 3)  # a screen per change
            assert watcher.wait(timeout=START_TIMEOUT) == 0
        assert svc.stop() == 0


def test_status_of_nothing_fails_clearly() -> None:
    with refused_port() as port:
        done = _status(f"tcp://127.0.0.1:{port}")
    assert done.returncode == 1
    assert "tq-async: error:" in done.stderr
