"""The blocking Client: from a plain thread, inside a running loop, in another process."""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import textwrap

import anyio
import pytest
import torch

import tq_async as tq


def test_client_from_a_plain_thread() -> None:
    async def main() -> None:
        async with tq.local_cluster(num_storage_units=1) as cluster:

            def blocking() -> list[int]:
                with tq.Client.connect(cluster.address) as client:
                    client.put({"x": torch.arange(4)}, partition_id="p")
                    td, _meta = client.get(["x"], 4, "p", "t")
                    assert client.check_consumption_status("p", "t")
                    return td["x"].tolist()

            assert await anyio.to_thread.run_sync(blocking) == [0, 1, 2, 3]

    anyio.run(main)


async def test_client_called_from_inside_a_running_loop() -> None:
    async with tq.local_cluster(num_storage_units=1) as cluster:
        # Blocking calls from a coroutine block this loop, so the cluster must live elsewhere:
        # here the test hands the blocking work to a thread, the loop keeps serving.
        def blocking() -> int:
            with tq.Client.connect(cluster.address) as client:
                client.put({"x": torch.ones(3)}, partition_id="p")
                return len(client.get_meta(["x"], 3, "p", "t"))

        assert await anyio.to_thread.run_sync(blocking) == 3


def test_client_inside_a_foreign_running_loop(tmp_path: object) -> None:
    """A sync Client used from code that runs inside someone else's event loop (a separate
    server): refused at once, naming tq.AsyncClient, rather than freezing that loop for every
    wait; the same calls handed to a thread work."""
    script = textwrap.dedent(
        """
        import asyncio, time, torch, tq_async as tq
        import subprocess, sys
        proc = subprocess.Popen([sys.executable, "-m", "tq_async._deploy._cli", "serve",
                                 "--storage-units", "1"], stdout=subprocess.PIPE, text=True)
        address = proc.stdout.readline().strip().split("=", 1)[1]
        def blocking():
            with tq.Client.connect(address) as client:
                client.put({"x": torch.arange(3)}, partition_id="p")
                return client.get(["x"], 3, "p", "t")[0]["x"].tolist()
        async def inside_loop():
            tq.Client  # its first lookup imports the blocking client: not the time measured
            t0 = time.monotonic()
            try:
                blocking()   # blocking calls in a coroutine
            except tq.InvalidRequestError as exc:
                print(f"refused after {time.monotonic() - t0:.3f} s: {exc}")
            return await asyncio.to_thread(blocking)
        try:
            print(asyncio.run(inside_loop()))
        finally:
            proc.terminate(); proc.wait(10)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    *_, refused, result = out.stdout.strip().splitlines()
    assert result == "[0, 1, 2]"
    assert refused.startswith("refused after 0.0")  # at once, not after a wait
    assert "would block the running event loop" in refused
    assert "tq.AsyncClient.connect(address)" in refused


def _child(address: str, queue: mp.Queue[object]) -> None:
    with tq.Client.connect(address) as client:
        client.put({"x": torch.arange(5), "s": list("abcde")}, partition_id="p")
        td, _ = client.get(["x", "s"], 5, "p", "child")
        queue.put((td["x"].tolist(), td.get("s").tolist()))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_client_in_a_separate_process(method: str) -> None:
    ctx = mp.get_context(method)

    async def main() -> None:
        async with tq.local_cluster(num_storage_units=2) as cluster:
            if method == "fork":
                # use the portal in the parent first: the child must build its own after fork
                def parent_use() -> None:
                    with tq.Client.connect(cluster.address) as c:
                        c.list_partitions()

                await anyio.to_thread.run_sync(parent_use)
            queue = ctx.Queue()
            proc = ctx.Process(target=_child, args=(cluster.address, queue))
            proc.start()
            try:
                result = await anyio.to_thread.run_sync(queue.get, True, 60)
            finally:
                await anyio.to_thread.run_sync(proc.join, 30)
            assert result == ([0, 1, 2, 3, 4], list("abcde"))
            assert proc.exitcode == 0

    anyio.run(main)


def test_closed_client_raises_closed_error() -> None:
    client = tq.Client("tcp://127.0.0.1:1")
    with pytest.raises(tq.ClosedError, match="not connected"):
        client.list_partitions()
    assert os.getpid() > 0


@pytest.mark.parametrize("cls", [tq.Client, tq.AsyncClient])
def test_pickling_a_client_says_to_send_its_address(cls: type) -> None:
    """Ray and multiprocessing pickle what they ship: a client (its sockets are this
    process's) is refused with a TQError saying what to do, not pyzmq's TypeError."""
    client = cls("tcp://127.0.0.1:5555")
    for ship in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(tq.InvalidRequestError, match="cannot be pickled") as err:
            ship(client)
        assert "tcp://127.0.0.1:5555" in str(err.value)
        assert f"tq.{cls.__name__}.connect(address)" in str(err.value)


def test_pickling_an_open_client_says_to_send_its_address() -> None:
    with (
        tq.background_cluster(num_storage_units=1) as cluster,
        tq.Client.connect(cluster.address) as client,
    ):
        client.put({"x": torch.arange(2)}, partition_id="p")
        with pytest.raises(tq.InvalidRequestError, match="cannot be pickled"):
            pickle.dumps(client)
        assert len(client.get_meta(["x"], 2, "p", "t")) == 2  # the client goes on
