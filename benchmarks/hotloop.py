"""Steady hot loops to attach a profiler to (the profiles in RESULTS.md came from these).

``python -m benchmarks.hotloop OP [--mode embedded|process] [--seconds N]`` warms up, prints
``START pid=<client pid> server=<cluster pid>``, then repeats one operation for N seconds and
prints its latency percentiles. Attach while it runs, e.g.::

    py-spy record --pid <pid> --duration 6 -r 250 --native -f raw -o put.txt
    perf record -F 999 -g -p <pid> -- sleep 6      # kernel + libzmq I/O thread too

OPs: ``put`` (8.4 MB dense batch, partitions cleared every 16 puts), ``get`` (get_data of
fresh 256-row batches), ``get_meta256`` (peek of 256 rows), ``get_meta8`` (fetch, 16k rows),
``put1`` (one-row put), ``put65536`` (65536 one-field rows).
"""

from __future__ import annotations

import argparse
import os
import sys
from time import perf_counter
from typing import Any

import anyio

from ._common import Config, open_cluster_handle, percentile
from .w1_data_plane import DENSE_FIELDS, _make_batch

OPS = ("put", "get", "get_meta256", "get_meta8", "put1", "put65536")


async def _loop(op: str, client: Any, seconds: float, server_pid: int) -> list[float]:
    import torch

    batches = [_make_batch("dense", 256, 2048, (128, 4096), s)[0] for s in range(4)]
    fields = list(DENSE_FIELDS)
    state = {"k": 0}

    async def put() -> None:
        k = state["k"]
        await client.put(batches[k % 4], partition_id=f"put-{k // 16}")
        if k % 16 == 15:
            await client.clear_partition(f"put-{k // 16}")

    async def get() -> float:
        """Times get_data only (the puts that provide fresh rows are not timed)."""
        k = state["k"]
        if k % 16 == 0:
            for i in range(16):
                await client.put(batches[i % 4], partition_id=f"get-{k}")
            state["metas"] = [
                await client.get_meta(fields, 256, f"get-{k}", "r") for _ in range(16)
            ]
        t0 = perf_counter()
        await client.get_data(state["metas"][k % 16])
        elapsed = perf_counter() - t0
        if k % 16 == 15:
            await client.clear_partition(f"get-{k - 15}")
        return elapsed

    async def get_meta256() -> None:
        await client.get_meta(fields, 256, "peek", "p", mode="peek")

    async def get_meta8() -> None:
        k = state["k"]
        await client.get_meta(["x"], 8, "m8", f"t{k // 2048}")

    async def put1() -> None:
        x = torch.tensor([perf_counter()], dtype=torch.float64)
        await client.put({"t": x}, partition_id=f"p1-{state['k'] // 5000}")

    async def put65536() -> None:
        k = state["k"]
        await client.put({"x": torch.arange(65536)}, partition_id=f"big-{k // 16}")
        if k % 16 == 15:
            await client.clear_partition(f"big-{k // 16}")

    fn: Any = {
        "put": put,
        "get": get,
        "get_meta256": get_meta256,
        "get_meta8": get_meta8,
        "put1": put1,
        "put65536": put65536,
    }[op]
    if op == "get_meta256":
        await client.put(batches[0], partition_id="peek")
    if op == "get_meta8":
        for start in range(0, 16384, 4096):  # W2's partition: a new task every 2048 calls
            await client.put({"x": torch.arange(start, start + 4096)}, partition_id="m8")
    for _ in range(32):  # warm-up
        await fn()
        state["k"] += 1
    print(f"START pid={os.getpid()} server={server_pid}", flush=True)
    lat: list[float] = []
    end = perf_counter() + seconds
    while perf_counter() < end:
        t0 = perf_counter()
        timed = await fn()
        lat.append(perf_counter() - t0 if timed is None else timed)
        state["k"] += 1
    return lat


async def _main(op: str, mode: str, seconds: float) -> None:
    import tq_async as tq

    async with (
        open_cluster_handle(Config(mode=mode)) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        lat = await _loop(op, client, seconds, cluster.pid)
    ms = [v * 1e3 for v in lat]
    print(
        f"{op} [{mode}]: n={len(ms)} p50 {percentile(ms, 50):.3f} p99 {percentile(ms, 99):.3f} "
        f"max {max(ms):.1f} ms; mean {sum(ms) / len(ms):.3f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hotloop", description=__doc__)
    parser.add_argument("op", choices=OPS)
    parser.add_argument("--mode", choices=["embedded", "process"], default="embedded")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    anyio.run(_main, args.op, args.mode, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
