"""``python -m benchmarks.watch``: what watching costs (issue 37's targets).

* put -> watcher event: one-row puts, one at a time; a watcher (another task of this process)
  takes each ``fields_produced`` event. Latency from the put's call to the event, against the
  put's own latency, embedded (``local_cluster``) and with ``tq-async serve``.
* get_meta with watchers: sequential ``get_meta(batch_size=8)`` calls against ``tq-async
  serve``, with 0 and with 16 watchers attached (in another process, each taking every event).
* kv_list of a partition with 100k live keys (tagged) through ``AsyncClient``, embedded.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import Any

import anyio
import torch

import tq_async as tq

from ._common import median, percentile


@contextmanager
def serve() -> Iterator[str]:
    """A ``tq-async serve`` process; its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tq_async._deploy._cli", "serve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("TQ_ADDRESS="):
                yield line.split("=", 1)[1].strip()
                break
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


async def put_to_event(address: str, n: int) -> dict[str, float]:
    """p50/p99 of put -> event and of the put itself, in ms."""
    started: dict[int, float] = {}
    lat: list[float] = []
    puts: list[float] = []
    async with tq.AsyncClient.connect(address) as client:
        got_all = anyio.Event()
        async with (
            client.watch(kinds=["fields_produced"]) as events,
            anyio.create_task_group() as tg,
        ):

            async def watcher() -> None:
                async for ev in events:
                    now = perf_counter()
                    for r in ev.rows:  # type: ignore[union-attr]
                        lat.append(now - started[r])
                    if len(lat) >= n:
                        got_all.set()
                        return

            tg.start_soon(watcher)
            x = torch.zeros(1, 64)
            for i in range(n):
                started[i] = t0 = perf_counter()
                await client.put({"x": x}, "w")
                puts.append(perf_counter() - t0)
            await got_all.wait()
    warm = n // 10
    lat, puts = lat[warm:], puts[warm:]
    return {
        "event_p50_ms": percentile(lat, 50) * 1e3,
        "event_p99_ms": percentile(lat, 99) * 1e3,
        "put_p50_ms": percentile(puts, 50) * 1e3,
        "put_p99_ms": percentile(puts, 99) * 1e3,
    }


def _watchers(address: str, n: int, ready: Any) -> None:
    async def main() -> None:
        async with tq.AsyncClient.connect(address) as client:

            async def one() -> None:
                async with client.watch() as events:
                    ready.put(1)
                    async for _ in events:
                        pass

            async with anyio.create_task_group() as tg:
                for _ in range(n):
                    tg.start_soon(one)

    anyio.run(main)


async def get_meta_rate(address: str, calls: int, rounds: int) -> float:
    """Median calls/s of sequential get_meta(batch_size=8) over ``rounds`` fresh tasks."""
    rates = []
    async with tq.AsyncClient.connect(address) as client:
        pid = f"g{perf_counter()}"
        await client.put({"x": torch.arange(calls * 8)}, pid)
        for r in range(rounds):
            t0 = perf_counter()
            for _ in range(calls):
                await client.get_meta(["x"], 8, pid, f"t{r}")
            rates.append(calls / (perf_counter() - t0))
    return median(rates)


async def kv_list_ms(n_keys: int, calls: int) -> float:
    async with tq.local_cluster() as cluster, tq.AsyncClient.connect(cluster.address) as client:
        for i in range(0, n_keys, 4096):
            keys = [f"key-{k}" for k in range(i, min(n_keys, i + 4096))]
            fields = {"x": torch.arange(len(keys))}
            await client.kv_batch_put(keys, "kv", fields, tags=[{"v": 1}] * len(keys))
        times = []
        for _ in range(calls):
            t0 = perf_counter()
            listing = await client.kv_list("kv")
            times.append(perf_counter() - t0)
        assert len(listing["kv"]) == n_keys
    return median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.watch")
    parser.add_argument("--puts", type=int, default=2000)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keys", type=int, default=100_000)
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}

    async def embedded() -> dict[str, float]:
        async with tq.local_cluster() as cluster:
            return await put_to_event(cluster.address, args.puts)

    out["put_to_event_embedded"] = anyio.run(embedded)
    with serve() as address:
        out["put_to_event_serve"] = anyio.run(put_to_event, address, args.puts)
    with serve() as address:
        out["get_meta_per_s_0_watchers"] = anyio.run(
            get_meta_rate, address, args.calls, args.rounds
        )
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Queue()
        proc = ctx.Process(target=_watchers, args=(address, 16, ready), daemon=True)
        proc.start()
        for _ in range(16):
            ready.get(timeout=120)
        out["get_meta_per_s_16_watchers"] = anyio.run(
            get_meta_rate, address, args.calls, args.rounds
        )
        proc.terminate()
        proc.join(timeout=30)
    out["kv_list_100k_ms"] = anyio.run(kv_list_ms, args.keys, 20)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
