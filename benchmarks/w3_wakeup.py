"""W3 wake-up latency: how soon a waiting consumer sees a row after its put started.

A consumer loops on ``get_meta(["t"], batch_size=1)`` (it is parked in the controller while
no row is ready) and then ``get_data``; a producer puts one-row batches on a fixed 10 ms
schedule. The row carries ``t`` (float64) = ``time.perf_counter()`` taken just before
``put`` is called; ``perf_counter`` is CLOCK_MONOTONIC, comparable across processes.

Two consumers, each in this process (own AsyncClient, same event loop as the producer) and in a
spawned process:

* the raw client: put-start -> get_meta returned (p50/p90/p99/max) and -> data in hand
  (p50/p99);
* the issue's definition, an :class:`~tq_async.AsyncStreamingDataset` (``batch_size=1``,
  default prefetch): put-start -> the item in hand in the ``async for`` body (p50/p90/p99/max).

The first few puts are warm-up and dropped.
"""

from __future__ import annotations

import queue
import traceback
from multiprocessing.context import ForkServerContext, SpawnContext
from time import perf_counter
from typing import Any

import anyio

from ._common import Config, open_cluster, percentile, result

__all__ = ["run"]

WORKLOAD = "W3"
INTERVAL = 0.010
WARMUP = 5


async def _consume(client: Any, pid: str, n: int) -> tuple[list[float], list[float]]:
    """Latencies (s) of ``n`` rows: to get_meta returned, to data in hand."""
    to_meta: list[float] = []
    to_data: list[float] = []
    for _ in range(n):
        meta = await client.get_meta(["t"], 1, pid, "consumer")
        t1 = perf_counter()
        td = await client.get_data(meta)
        t2 = perf_counter()
        t0 = float(td["t"][0])
        to_meta.append(t1 - t0)
        to_data.append(t2 - t0)
    return to_meta, to_data


async def _consume_dataset(address: Any, pid: str, n: int) -> tuple[list[float], list[float]]:
    """Latencies (s) of ``n`` rows read through a streaming dataset: to the item in hand."""
    import tq_async as tq

    to_item: list[float] = []
    ds = tq.AsyncStreamingDataset(address, ["t"], 1, 1, pid, "consumer")
    async with ds:
        async for batch, _ in ds:
            to_item.append(perf_counter() - float(batch["t"][0]))
            if len(to_item) == n:
                break
    return to_item, []


async def _produce(client: Any, pid: str, n: int) -> None:
    import torch

    start = perf_counter()
    for i in range(n):
        delay = start + i * INTERVAL - perf_counter()
        if delay > 0:
            await anyio.sleep(delay)
        await client.put(
            {"t": torch.tensor([perf_counter()], dtype=torch.float64)}, partition_id=pid
        )


def _consumer_process(address: str, pid: str, n: int, dataset: bool, ready: Any, out: Any) -> None:
    try:
        out.put(("ok", anyio.run(_consumer_process_async, address, pid, n, dataset, ready)))
    except BaseException:
        out.put(("error", traceback.format_exc()))


async def _consumer_process_async(
    address: str, pid: str, n: int, dataset: bool, ready: Any
) -> tuple[list[float], list[float]]:
    import tq_async as tq

    async with tq.AsyncClient.connect(address) as client:
        ready.set()
        if dataset:
            return await _consume_dataset(client, pid, n)
        return await _consume(client, pid, n)


def _dataset_stats(label: str, to_item: list[float], n: int) -> list[dict[str, Any]]:
    ms = [v * 1e3 for v in to_item[WARMUP:]]
    return [
        result(
            WORKLOAD,
            f"put->dataset item {name} ({label})",
            percentile(ms, p) if p < 100 else max(ms),
            "ms",
            higher_is_better=False,
            n=len(ms),
            note=f"AsyncStreamingDataset batch_size=1; {n} puts every {INTERVAL * 1e3:g} ms"
            if name == "p50"
            else "",
        )
        for name, p in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))
    ]


def _stats(label: str, to_meta: list[float], to_data: list[float], n: int) -> list[dict[str, Any]]:
    to_meta = to_meta[WARMUP:]
    to_data = to_data[WARMUP:]
    ms = [v * 1e3 for v in to_meta]
    out = [
        result(
            WORKLOAD,
            f"put->get_meta {name} ({label})",
            percentile(ms, p) if p < 100 else max(ms),
            "ms",
            higher_is_better=False,
            n=len(ms),
            note=f"{n} puts every {INTERVAL * 1e3:g} ms, first {WARMUP} dropped"
            if name == "p50"
            else "",
        )
        for name, p in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))
    ]
    data_ms = [v * 1e3 for v in to_data]
    out += [
        result(
            WORKLOAD,
            f"put->get_data {name} ({label})",
            percentile(data_ms, p),
            "ms",
            higher_is_better=False,
            n=len(data_ms),
        )
        for name, p in (("p50", 50), ("p99", 99))
    ]
    return out


async def _same_process(
    address: str, pid: str, n: int, dataset: bool
) -> tuple[list[float], list[float]]:
    import tq_async as tq

    async with (
        tq.AsyncClient.connect(address) as producer,
        tq.AsyncClient.connect(address) as consumer,
    ):
        res: dict[str, tuple[list[float], list[float]]] = {}

        async def consume() -> None:
            if dataset:
                res["c"] = await _consume_dataset(consumer, pid, n)
            else:
                res["c"] = await _consume(consumer, pid, n)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.sleep(0.1)  # let the consumer park in get_meta first
            await _produce(producer, pid, n)
        await producer.clear_partition(pid)
    return res["c"]


async def _other_process(
    ctx: SpawnContext | ForkServerContext, address: str, pid: str, n: int, dataset: bool
) -> tuple[list[float], list[float]]:
    import tq_async as tq

    ready = ctx.Event()
    q = ctx.Queue()
    proc = ctx.Process(
        target=_consumer_process, args=(address, pid, n, dataset, ready, q), daemon=True
    )
    proc.start()
    try:
        if not await anyio.to_thread.run_sync(ready.wait, 120):
            raise RuntimeError("the W3 consumer process did not start within 120 s")
        async with tq.AsyncClient.connect(address) as producer:
            await anyio.sleep(0.2)  # the consumer is now parked in get_meta
            await _produce(producer, pid, n)
            try:
                msg = await anyio.to_thread.run_sync(q.get, True, 60)
            except queue.Empty:
                raise RuntimeError("the W3 consumer process reported nothing") from None
            await producer.clear_partition(pid)
        if msg[0] == "error":
            raise RuntimeError(f"the W3 consumer process failed:\n{msg[1]}")
        got: tuple[list[float], list[float]] = msg[1]
        return got
    finally:
        await anyio.to_thread.run_sync(proc.join, 30)
        if proc.is_alive():
            proc.terminate()


async def _main(cfg: Config) -> list[dict[str, Any]]:
    n = cfg.pick(450, 20) + WARMUP
    ctx = cfg.processes()
    out: list[dict[str, Any]] = []
    with anyio.fail_after(cfg.pick(300, 60)):
        async with open_cluster(cfg) as address:
            out += _stats("same process", *await _same_process(address, "w3-l", n, False), n)
            out += _stats(
                "consumer process", *await _other_process(ctx, address, "w3-r", n, False), n
            )
            to_item, _ = await _same_process(address, "w3-dl", n, True)
            out += _dataset_stats("same process", to_item, n)
            to_item, _ = await _other_process(ctx, address, "w3-dr", n, True)
            out += _dataset_stats("consumer process", to_item, n)
    return out


def run(cfg: Config) -> list[dict[str, Any]]:
    """Run W3 and return its results."""
    return anyio.run(_main, cfg)
