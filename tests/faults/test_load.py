"""Load: 512 client coroutines in 4 processes put and get 4,096 rows a process (TQ_LOAD_ROWS).

Zero rows lost or duplicated, and the service's memory is flat once the data is cleared.
The service runs with ``--capacity``: producers outpace consumers (a put is one round trip,
a get two), so without backpressure the backlog -- and the memory -- would grow all run long
and "mid-run" would not be a steady state to compare with.

The suite runs a count of rows (16 puts a producer; the capacity's worth in all), not a
duration: what it proves (every row put is got once, memory flat after clear) does not need a
long run, and a count does not lose its run to slow process starts. ``TQ_LOAD_SECONDS=60``
runs the benchmark RESULTS.md quotes: producers put for that long instead, whatever the count.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from typing import Any

import anyio
import pytest
import torch

import tq_async as tq
from _cluster_proc import warm_context

PROCESSES = 4
COROUTINES = 128  # per process: half put, half get
ROWS = 4
ROWS_A_PROCESS = int(os.environ.get("TQ_LOAD_ROWS", "4096"))  # a multiple of ROWS
SECONDS = float(os.environ.get("TQ_LOAD_SECONDS", "0"))  # > 0: put for that long (RESULTS.md: 60)
CAPACITY = 16384  # rows in the partition at most: producers wait beyond it


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def worker(address: str, index: int, seconds: float, out: Any) -> None:
    """Producers put ROWS_A_PROCESS rows in all (or for ``seconds``), consumers get until end
    of stream."""

    async def main() -> None:
        produced: list[int] = []
        consumed: list[int] = []
        quota = math.inf if seconds else ROWS_A_PROCESS
        half = anyio.Event()
        async with tq.AsyncClient.connect(address, request_timeout=120) as client:
            start = time.monotonic()
            deadline = start + seconds if seconds else math.inf
            claimed = 0  # rows the producers have started to put

            async def producer(c: int) -> None:
                nonlocal claimed
                seq = 0
                while claimed < quota and time.monotonic() < deadline:
                    claimed += ROWS
                    base = ((index * COROUTINES + c) << 32) | seq
                    ids = torch.arange(base, base + ROWS, dtype=torch.int64)
                    await client.put({"id": ids, "payload": torch.zeros(ROWS, 256)}, "load")
                    produced.extend(ids.tolist())
                    if len(produced) * 2 >= quota:
                        half.set()
                    seq += ROWS

            async def consumer() -> None:
                while True:
                    td, meta = await client.get(["id", "payload"], ROWS, "load", "load")
                    if meta.end_of_stream:
                        return
                    consumed.extend(td["id"].tolist())

            async def halfway() -> None:
                with anyio.move_on_after(seconds / 2 if seconds else math.inf):
                    await half.wait()  # half its rows put (or half its time gone): mid-run
                out.put(("half", index))

            async with anyio.create_task_group() as consumers:
                for _ in range(COROUTINES // 2):
                    consumers.start_soon(consumer)
                async with anyio.create_task_group() as producers:
                    producers.start_soon(halfway)
                    for c in range(COROUTINES // 2):
                        producers.start_soon(producer, c)
                out.put(("done", index))  # the parent seals once every worker is done
                putting = time.monotonic() - start
        out.put(("result", index, produced, consumed, putting))

    anyio.run(main)


@pytest.mark.timeout(SECONDS + 300)
def test_512_coroutines_in_4_processes_lose_and_duplicate_nothing() -> None:
    service = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tq_async._deploy._cli",
            "serve",
            "--storage-units",
            "2",
            "--capacity",
            str(CAPACITY),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    # the workers fork from the session's warm server (the client and tensordict imported):
    # four spawned processes would each import torch and tensordict first, ~4 s of CPU
    # apiece, all of it before the load starts; the server imports while the service starts
    ctx = warm_context()
    out: Any = ctx.Queue()
    workers: list[Any] = []
    try:
        assert service.stdout is not None
        address = service.stdout.readline().strip().split("=", 1)[1]
        with tq.Client.connect(address) as client:
            client.register_tasks(["load"])  # rows are freed as soon as they are consumed
            workers = [
                ctx.Process(target=worker, args=(address, i, SECONDS, out))
                for i in range(PROCESSES)
            ]
            for w in workers:
                w.start()
            events: dict[str, list[Any]] = {"half": [], "done": [], "result": []}
            rss_during = 0.0
            budget = time.monotonic() + SECONDS + 240
            while len(events["result"]) < PROCESSES:
                msg = out.get(timeout=max(1.0, budget - time.monotonic()))
                events[msg[0]].append(msg)
                if msg[0] == "half" and len(events["half"]) == PROCESSES:
                    rss_during = rss_mb(service.pid)
                if msg[0] == "done" and len(events["done"]) == PROCESSES:
                    client.seal("load")  # consumers drain what is left, then see the end
            produced = [i for msg in events["result"] for i in msg[2]]
            consumed = [i for msg in events["result"] for i in msg[3]]
            assert produced
            if not SECONDS:
                assert len(produced) == PROCESSES * ROWS_A_PROCESS
            assert len(set(produced)) == len(produced)
            assert len(consumed) == len(set(consumed)), "a row was delivered twice"
            assert set(consumed) == set(produced), "a row was lost"
            seconds = max(msg[4] for msg in events["result"])  # the longest put window
            assert client.partition_info("load")["rows"] == 0  # auto-cleared as consumed
            client.clear_partition("load")
            rss_after = rss_mb(service.pid)
            print(
                f"\nload: {len(produced)} rows put and got by {PROCESSES * COROUTINES} "
                f"coroutines in {PROCESSES} processes in {seconds:.1f} s "
                f"({len(produced) / seconds:.0f} rows/s); service RSS {rss_during:.0f} MB "
                f"mid-run, {rss_after:.0f} MB after clear"
            )
            assert rss_after < rss_during * 1.25 + 32, "memory is not flat after clear"
    finally:
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
        service.terminate()
        service.wait(30)
        if service.stdout is not None:
            service.stdout.close()
