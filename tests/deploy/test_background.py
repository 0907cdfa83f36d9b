"""``background_cluster``: services on a daemon thread for synchronous code."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import tq_async as tq


def test_background_cluster_serves_blocking_clients() -> None:
    with (
        tq.background_cluster(num_storage_units=2) as cluster,
        tq.Client.connect(cluster.address) as client,
    ):
        assert isinstance(cluster.address, str)
        client.put({"x": torch.arange(4)}, partition_id="p")
        td, _ = client.get(["x"], 4, "p", "t")
        assert td["x"].tolist() == [0, 1, 2, 3]
        assert len(cluster.cluster.units) == 2
        assert not cluster.closed
    assert cluster.closed
    assert "closed" in repr(cluster)


def test_close_is_idempotent_bounded_and_stops_the_thread() -> None:
    before = {t.name for t in threading.enumerate()}
    cluster = tq.background_cluster(num_storage_units=1, sampler=tq.GRPOGroupNSampler(2))
    t0 = time.monotonic()
    cluster.close()
    cluster.close()
    assert time.monotonic() - t0 < cluster.close_timeout
    assert not cluster._thread.is_alive()
    assert {t.name for t in threading.enumerate()} <= before | {"tq_async-loop"}
    with pytest.raises(tq.ClosedError), cluster:
        pass


def test_bind_errors_and_bad_arguments_are_raised_in_the_caller() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(tq.BrokenError):
            tq.background_cluster(num_storage_units=1, bind=f"tcp://127.0.0.1:{port}")
    with pytest.raises(tq.InvalidRequestError, match="num_units"):
        tq.background_cluster(num_units=1)
    with pytest.raises(tq.InvalidRequestError, match="num_storage_units"):
        tq.background_cluster(num_storage_units=0)


def test_other_processes_attach_to_its_address() -> None:
    code = (
        "import sys, torch, tq_async as tq\n"
        "with tq.Client.connect(sys.argv[1]) as c:\n"
        "    c.put({'x': torch.arange(3)}, partition_id='p')\n"
    )
    with (
        tq.background_cluster(num_storage_units=1) as cluster,
        tq.Client.connect(cluster.address) as client,
    ):
        subprocess.run([sys.executable, "-c", code, cluster.address], check=True, timeout=60)
        assert client.get(["x"], 3, "p", "t", timeout=10)[0]["x"].tolist() == [0, 1, 2]
