"""W2 control plane: get_meta calls per second and latency against partition size.

A partition holds 16k ready one-field rows (``x``: int64, put in batches of 4096); every call
is ``get_meta(["x"], batch_size=8, mode="fetch")``, so it really consumes rows. Call ``k`` of a
client uses task ``<client>-<k // 2048>``: each task takes exactly the 2048 batches of 8 that
the 16k rows hold, so no call ever waits for data (the first call of a task builds its ready
set; that cost is included).

* sequential: one AsyncClient, one call in flight.
* 4 AsyncClients in this process, each with ``inflight`` coroutines looping on get_meta.
* 4 client processes (multiprocessing spawn), each one AsyncClient with ``inflight``
  coroutines; the processes start each round together (a barrier) and the rate is the calls of
  all of them over the span from the first start to the last finish.
* latency at 1k vs 1M rows: p50 of single get_meta calls near the start of a fresh task on a
  partition of 1024 rows and one of 1,048,576 rows (16 puts of 65536). The first call of a
  task (which scans the partition to build the ready set) is reported on its own. An extra,
  informational point: the same p50 on the 1M partition after half of it was consumed.

Each phase runs ``rounds`` times on a fresh partition; rates are reported as median and best.
"""

from __future__ import annotations

import itertools
import queue
import traceback
from multiprocessing.context import ForkServerContext, SpawnContext
from time import perf_counter
from typing import Any

import anyio

from ._common import Config, median, open_cluster, percentile, result, settle

__all__ = ["run"]

WORKLOAD = "W2"
BATCH = 8
FIELDS = ["x"]


async def _fill(client: Any, pid: str, rows: int, put_batch: int) -> float:
    """Put ``rows`` one-field rows in batches; returns the seconds it took."""
    import torch

    t0 = perf_counter()
    for start in range(0, rows, put_batch):
        n = min(put_batch, rows - start)
        await client.put({"x": torch.arange(start, start + n, dtype=torch.int64)}, partition_id=pid)
    return perf_counter() - t0


async def _load(
    client: Any, pid: str, calls: int, per_task: int, inflight: int, prefix: str
) -> None:
    """``calls`` get_meta calls from ``inflight`` coroutines sharing one client."""
    counter = itertools.count()

    async def worker() -> None:
        while True:
            k = next(counter)
            if k >= calls:
                return
            meta = await client.get_meta(FIELDS, BATCH, pid, f"{prefix}-{k // per_task}")
            if len(meta) != BATCH:
                raise AssertionError(f"get_meta returned {len(meta)} rows, wanted {BATCH}")

    async with anyio.create_task_group() as tg:
        for _ in range(inflight):
            tg.start_soon(worker)


# ---- one client process of the multi-process variant ----------------------------------------


def _mp_client(
    address: str,
    pids: list[str],
    calls: int,
    per_task: int,
    inflight: int,
    idx: int,
    barrier: Any,
    out: Any,
) -> None:
    try:
        anyio.run(_mp_client_async, address, pids, calls, per_task, inflight, idx, barrier, out)
    except BaseException:
        out.put(("error", idx, traceback.format_exc()))
        barrier.abort()


async def _mp_client_async(
    address: str,
    pids: list[str],
    calls: int,
    per_task: int,
    inflight: int,
    idx: int,
    barrier: Any,
    out: Any,
) -> None:
    import tq_async as tq

    async with tq.AsyncClient.connect(address) as client:
        for r, pid in enumerate(pids):
            await anyio.to_thread.run_sync(barrier.wait, 300)
            t0 = perf_counter()
            await _load(client, pid, calls, per_task, inflight, f"mp{idx}")
            out.put(("ok", r, t0, perf_counter(), calls))


async def _multiprocess(
    ctx: SpawnContext | ForkServerContext,
    address: str,
    pids: list[str],
    procs: int,
    calls: int,
    per_task: int,
    inflight: int,
) -> list[float]:
    """Rates (calls/s) of each round with ``procs`` client processes (``cfg.processes()``)."""
    barrier = ctx.Barrier(procs)
    out = ctx.Queue()
    workers = [
        ctx.Process(
            target=_mp_client,
            args=(address, pids, calls, per_task, inflight, i, barrier, out),
            daemon=True,
        )
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    spans: dict[int, list[tuple[float, float, int]]] = {}
    try:
        for _ in range(procs * len(pids)):
            try:
                msg = await anyio.to_thread.run_sync(out.get, True, 300)
            except queue.Empty:
                raise RuntimeError("a W2 client process reported nothing within 300 s") from None
            if msg[0] == "error":
                raise RuntimeError(f"W2 client process {msg[1]} failed:\n{msg[2]}")
            _, r, t0, t1, n = msg
            spans.setdefault(r, []).append((t0, t1, n))
    finally:
        for w in workers:
            await anyio.to_thread.run_sync(w.join, 30)
            if w.is_alive():
                w.terminate()
    # perf_counter is CLOCK_MONOTONIC: comparable across processes on one machine
    return [
        sum(n for _, _, n in s) / (max(t1 for _, t1, _ in s) - min(t0 for t0, _, _ in s))
        for s in spans.values()
    ]


# ---- the workload -----------------------------------------------------------------------------


async def _main(cfg: Config) -> list[dict[str, Any]]:
    import tq_async as tq

    rows = cfg.pick(16384, 512)
    per_task = rows // BATCH
    rounds = cfg.pick(3, 1)
    seq_calls = cfg.pick(2 * per_task, per_task)
    clients = 4
    procs = cfg.pick(4, 1)
    inflight = cfg.pick(32, 4)
    calls_per_client = cfg.pick(2 * per_task, per_task)
    small_rows = 1024
    big_rows = cfg.pick(1 << 20, 1 << 14)
    big_put = cfg.pick(65536, 4096)
    lat_calls = cfg.pick(120, 20)
    lat_rounds = cfg.pick(5, 1)
    out: list[dict[str, Any]] = []

    with anyio.fail_after(cfg.pick(900, 90)):
        async with open_cluster(cfg) as address, tq.AsyncClient.connect(address) as client:
            # warm-up: sockets, first-use allocations
            await _fill(client, "w2-warm", 64, 64)
            for _ in range(4):
                await client.get_meta(FIELDS, BATCH, "w2-warm", "warm")
            await client.clear_partition("w2-warm")

            # sequential
            seq_rates: list[float] = []
            seq_lat: list[float] = []
            for r in range(rounds):
                pid = f"w2-seq-{r}"
                await _fill(client, pid, rows, 4096)
                settle()
                t_start = perf_counter()
                for k in range(seq_calls):
                    t0 = perf_counter()
                    await client.get_meta(FIELDS, BATCH, pid, f"seq-{k // per_task}")
                    seq_lat.append(perf_counter() - t0)
                seq_rates.append(seq_calls / (perf_counter() - t_start))
                await client.clear_partition(pid)
            out.append(
                result(
                    WORKLOAD,
                    "get_meta b8, 1 client sequential",
                    median(seq_rates),
                    "calls/s",
                    best=max(seq_rates),
                    n=len(seq_lat),
                    note=f"{rows} ready rows, {rounds} rounds; a new task (ready-set build) "
                    f"every {per_task} calls",
                )
            )
            out.append(
                result(
                    WORKLOAD,
                    "get_meta b8 latency p50, sequential",
                    median(seq_lat) * 1e6,
                    "us",
                    best=min(seq_lat) * 1e6,
                    higher_is_better=False,
                    n=len(seq_lat),
                    note=f"p99 {percentile(seq_lat, 99) * 1e6:.0f} us",
                )
            )

            # 4 AsyncClients in this process
            conc_rates: list[float] = []
            extra = [tq.AsyncClient.connect(address) for _ in range(clients)]
            try:
                for c in extra:
                    await c.open()
                for r in range(rounds):
                    pid = f"w2-conc-{r}"
                    await _fill(client, pid, rows, 4096)
                    settle()
                    t0 = perf_counter()
                    async with anyio.create_task_group() as tg:
                        for i, c in enumerate(extra):
                            tg.start_soon(
                                _load, c, pid, calls_per_client, per_task, inflight, f"c{i}"
                            )
                    conc_rates.append(clients * calls_per_client / (perf_counter() - t0))
                    await client.clear_partition(pid)
            finally:
                for c in extra:
                    await c.aclose()
            out.append(
                result(
                    WORKLOAD,
                    f"get_meta b8, {clients} AsyncClients in 1 process",
                    median(conc_rates),
                    "calls/s",
                    best=max(conc_rates),
                    n=rounds * clients * calls_per_client,
                    note=f"{inflight} in flight per client, {rounds} rounds",
                )
            )

            # client processes
            pids = [f"w2-mp-{r}" for r in range(rounds)]
            for pid in pids:
                await _fill(client, pid, rows, 4096)
            mp_rates = await _multiprocess(
                cfg.processes(), address, pids, procs, calls_per_client, per_task, inflight
            )
            for pid in pids:
                await client.clear_partition(pid)
            out.append(
                result(
                    WORKLOAD,
                    f"get_meta b8, {procs} client processes",
                    median(mp_rates),
                    "calls/s",
                    best=max(mp_rates),
                    n=rounds * procs * calls_per_client,
                    note=f"spawn, 1 AsyncClient x {inflight} in flight each, {rounds} rounds",
                )
            )

            # latency at 1k vs 1M rows
            await _fill(client, "w2-small", small_rows, small_rows)
            big_put_s = await _fill(client, "w2-big", big_rows, big_put)
            lat: dict[str, list[float]] = {"w2-small": [], "w2-big": []}
            first: dict[str, list[float]] = {"w2-small": [], "w2-big": []}
            for r in range(lat_rounds):
                for pid in ("w2-small", "w2-big"):
                    t0 = perf_counter()
                    await client.get_meta(FIELDS, BATCH, pid, f"lat-{r}")
                    first[pid].append(perf_counter() - t0)
                    for _ in range(lat_calls):
                        t0 = perf_counter()
                        await client.get_meta(FIELDS, BATCH, pid, f"lat-{r}")
                        lat[pid].append(perf_counter() - t0)
            # half the big partition consumed (in big batches), then small batches again
            half_task = "lat-half"
            consumed = 0
            while consumed < big_rows // 2:
                await client.get_meta(FIELDS, big_put, "w2-big", half_task)
                consumed += big_put
            half_lat = []
            for _ in range(lat_calls):
                t0 = perf_counter()
                await client.get_meta(FIELDS, BATCH, "w2-big", half_task)
                half_lat.append(perf_counter() - t0)
            await client.clear_partition("w2-small")
            await client.clear_partition("w2-big")

    p50_small = median(lat["w2-small"]) * 1e6
    p50_big = median(lat["w2-big"]) * 1e6
    big_label = f"{big_rows / 2**20:g}M" if big_rows >= 2**20 else f"{big_rows // 1024}k"
    out += [
        result(
            WORKLOAD,
            "get_meta b8 p50 @1k rows",
            p50_small,
            "us",
            best=min(lat["w2-small"]) * 1e6,
            higher_is_better=False,
            n=len(lat["w2-small"]),
            note=f"{small_rows} rows, first {lat_calls} calls of {lat_rounds} fresh tasks",
        ),
        result(
            WORKLOAD,
            f"get_meta b8 p50 @{big_label} rows",
            p50_big,
            "us",
            best=min(lat["w2-big"]) * 1e6,
            higher_is_better=False,
            n=len(lat["w2-big"]),
            note=f"{big_rows} rows, first {lat_calls} calls of {lat_rounds} fresh tasks",
        ),
        result(
            WORKLOAD,
            "get_meta p50 ratio 1M/1k rows",
            p50_big / p50_small,
            "x",
            higher_is_better=False,
            note=f"big partition: {big_rows} rows" if cfg.smoke else "",
        ),
        result(
            WORKLOAD,
            f"first get_meta of a task @{big_label} rows",
            median(first["w2-big"]) * 1e3,
            "ms",
            best=min(first["w2-big"]) * 1e3,
            higher_is_better=False,
            n=len(first["w2-big"]),
            note=f"ready-set build; @1k: {median(first['w2-small']) * 1e3:.2f} ms",
        ),
        result(
            WORKLOAD,
            f"get_meta b8 p50 @{big_label} rows, half consumed",
            median(half_lat) * 1e6,
            "us",
            best=min(half_lat) * 1e6,
            higher_is_better=False,
            n=len(half_lat),
            note="informational: cost after a long consumed prefix",
        ),
        result(
            WORKLOAD,
            f"put {big_label} one-field rows",
            big_put_s,
            "s",
            higher_is_better=False,
            n=1,
            note=f"{big_rows // big_put} puts of {big_put} rows",
        ),
    ]
    return out


def run(cfg: Config) -> list[dict[str, Any]]:
    """Run W2 and return its results."""
    return anyio.run(_main, cfg)
