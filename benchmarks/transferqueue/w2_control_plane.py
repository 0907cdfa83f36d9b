"""W2 control plane on TransferQueue: get_meta calls per second and latency vs partition size.

The definitions of ``benchmarks/w2_control_plane.py``: a partition of 16k ready one-field rows
(``x`` int64, put in batches of 4096), every call ``async_get_meta(["x"], 8, partition,
mode="fetch", task_name=...)`` with call ``k`` of a client on task ``<client>-<k // 2048>`` so
no call ever lacks rows (TransferQueue would hold its whole controller 5 s and then raise).

TransferQueue serves ~200 of these calls per second, so each phase has a time budget instead of
our fixed call counts: it stops at the call count or when the budget is spent, whichever comes
first, and the rate is calls done / time taken (the note says how many). Phases:

* sequential: one ``AsyncTransferQueueClient``, one call in flight;
* 4 ``AsyncTransferQueueClient`` in this process, each with ``inflight`` coroutines (metric
  name kept as ours, "4 AsyncClients in 1 process", so the rows pair up);
* 4 client processes (spawn), each one ``AsyncTransferQueueClient`` built from the session
  config, released together by a barrier; rate = all calls / (last finish - first start);
* latency at 1k vs 1M rows, first call of a task, and after half of the 1M rows were consumed.

A phase that fails is recorded as a failed result and the next phase runs.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import queue
import traceback
from time import perf_counter
from typing import Any

from ._common import (
    Config,
    Deadline,
    async_client,
    call,
    failure,
    median,
    percentile,
    result,
    tq_session,
)

__all__ = ["run"]

WORKLOAD = "W2"
BATCH = 8
FIELDS = ["x"]


async def _fill(client: Any, pid: str, rows: int, put_batch: int, budget: float = 600) -> int:
    """Put up to ``rows`` one-field rows in batches (stops when ``budget`` s are spent);
    returns the rows put."""
    import torch
    from tensordict import TensorDict

    deadline = Deadline(budget)
    done = 0
    for start in range(0, rows, put_batch):
        if deadline.expired:
            break
        n = min(put_batch, rows - start)
        x = torch.arange(start, start + n, dtype=torch.int64)
        await call(client.async_put(TensorDict({"x": x}, batch_size=[n]), partition_id=pid))
        done += n
    return done


async def _get_meta(client: Any, pid: str, task: str, batch: int = BATCH) -> Any:
    meta = await call(client.async_get_meta(FIELDS, batch, pid, mode="fetch", task_name=task))
    if meta.size != batch:
        raise AssertionError(f"get_meta returned {meta.size} rows, wanted {batch}")
    return meta


async def _load(
    client: Any,
    pid: str,
    calls: int,
    per_task: int,
    inflight: int,
    prefix: str,
    deadline: Deadline,
) -> int:
    """Up to ``calls`` get_meta calls from ``inflight`` coroutines sharing one client, until
    ``deadline``; returns the calls done."""
    counter = itertools.count()
    done = 0

    async def worker() -> None:
        nonlocal done
        while not deadline.expired:
            k = next(counter)
            if k >= calls:
                return
            await _get_meta(client, pid, f"{prefix}-{k // per_task}")
            done += 1

    await asyncio.gather(*(worker() for _ in range(inflight)))
    return done


# ---- one client process of the multi-process variant ------------------------------------------


def _mp_client(
    conf: Any,
    pids: list[str],
    calls: int,
    per_task: int,
    inflight: int,
    budget: float,
    idx: int,
    barrier: Any,
    out: Any,
) -> None:
    try:
        asyncio.run(
            _mp_client_async(conf, pids, calls, per_task, inflight, budget, idx, barrier, out)
        )
    except BaseException:
        out.put(("error", idx, traceback.format_exc()))
        barrier.abort()


async def _mp_client_async(
    conf: Any,
    pids: list[str],
    calls: int,
    per_task: int,
    inflight: int,
    budget: float,
    idx: int,
    barrier: Any,
    out: Any,
) -> None:
    client = async_client(conf, f"w2-mp{idx}")
    try:
        for r, pid in enumerate(pids):
            await asyncio.to_thread(barrier.wait, 300)
            t0 = perf_counter()
            n = await _load(client, pid, calls, per_task, inflight, f"mp{idx}", Deadline(budget))
            out.put(("ok", r, t0, perf_counter(), n))
    finally:
        client.close()


async def _multiprocess(
    conf: Any,
    pids: list[str],
    procs: int,
    calls: int,
    per_task: int,
    inflight: int,
    budget: float,
) -> tuple[list[float], int]:
    """Rates (calls/s) of each round with ``procs`` spawned client processes, and the calls."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(procs)
    out = ctx.Queue()
    workers = [
        ctx.Process(
            target=_mp_client,
            args=(conf, pids, calls, per_task, inflight, budget, i, barrier, out),
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
                msg = await asyncio.to_thread(out.get, True, budget + 300)
            except queue.Empty:
                raise RuntimeError("a W2 client process reported nothing in time") from None
            if msg[0] == "error":
                raise RuntimeError(f"W2 client process {msg[1]} failed:\n{msg[2]}")
            _, r, t0, t1, n = msg
            spans.setdefault(r, []).append((t0, t1, n))
    finally:
        for w in workers:
            await asyncio.to_thread(w.join, 30)
            if w.is_alive():
                w.terminate()
    rates = [
        sum(n for _, _, n in s) / (max(t1 for _, t1, _ in s) - min(t0 for t0, _, _ in s))
        for s in spans.values()
    ]
    return rates, sum(n for s in spans.values() for _, _, n in s)


# ---- the workload -----------------------------------------------------------------------------


async def _sequential(
    cfg: Config, client: Any, rows: int, per_task: int, rounds: int
) -> list[dict[str, Any]]:
    seq_calls = cfg.pick(per_task, per_task)
    budget = cfg.pick(12.0, 5.0)
    rates: list[float] = []
    lat: list[float] = []
    for r in range(rounds):
        pid = f"w2-seq-{r}"
        await _fill(client, pid, rows, 4096)
        deadline = Deadline(budget)
        t_start = perf_counter()
        done = 0
        for k in range(seq_calls):
            if deadline.expired:
                break
            t0 = perf_counter()
            await _get_meta(client, pid, f"seq-{k // per_task}")
            lat.append(perf_counter() - t0)
            done += 1
        rates.append(done / (perf_counter() - t_start))
        await call(client.async_clear_partition(pid))
    return [
        result(
            WORKLOAD,
            "get_meta b8, 1 client sequential",
            median(rates),
            "calls/s",
            best=max(rates),
            n=len(lat),
            note=f"{rows} ready rows, {rounds} rounds of <= {seq_calls} calls / {budget:g} s",
        ),
        result(
            WORKLOAD,
            "get_meta b8 latency p50, sequential",
            median(lat) * 1e6,
            "us",
            best=min(lat) * 1e6,
            higher_is_better=False,
            n=len(lat),
            note=f"p99 {percentile(lat, 99) * 1e6:.0f} us",
        ),
    ]


async def _concurrent(
    cfg: Config, conf: Any, client: Any, rows: int, per_task: int, rounds: int
) -> list[dict[str, Any]]:
    clients = 4
    inflight = cfg.pick(32, 4)
    calls = per_task
    budget = cfg.pick(12.0, 5.0)
    rates: list[float] = []
    total = 0
    extra = [async_client(conf, f"w2-c{i}") for i in range(clients)]
    try:
        for r in range(rounds):
            pid = f"w2-conc-{r}"
            await _fill(client, pid, rows, 4096)
            deadline = Deadline(budget)
            t0 = perf_counter()
            done = await asyncio.gather(
                *(
                    _load(c, pid, calls, per_task, inflight, f"c{i}", deadline)
                    for i, c in enumerate(extra)
                )
            )
            rates.append(sum(done) / (perf_counter() - t0))
            total += sum(done)
            await call(client.async_clear_partition(pid))
    finally:
        for c in extra:
            c.close()
    return [
        result(
            WORKLOAD,
            f"get_meta b8, {clients} AsyncClients in 1 process",
            median(rates),
            "calls/s",
            best=max(rates),
            n=total,
            note=f"{clients} AsyncTransferQueueClient x {inflight} in flight, {rounds} rounds "
            f"of <= {clients * calls} calls / {budget:g} s",
        )
    ]


async def _processes(
    cfg: Config, conf: Any, client: Any, rows: int, per_task: int, rounds: int
) -> list[dict[str, Any]]:
    procs = cfg.pick(4, 1)
    inflight = cfg.pick(32, 4)
    budget = cfg.pick(12.0, 5.0)
    pids = [f"w2-mp-{r}" for r in range(rounds)]
    for pid in pids:
        await _fill(client, pid, rows, 4096)
    try:
        rates, total = await _multiprocess(conf, pids, procs, per_task, per_task, inflight, budget)
    finally:
        for pid in pids:
            await call(client.async_clear_partition(pid))
    return [
        result(
            WORKLOAD,
            f"get_meta b8, {procs} client processes",
            median(rates),
            "calls/s",
            best=max(rates),
            n=total,
            note=f"spawn, 1 AsyncTransferQueueClient x {inflight} in flight each, {rounds} "
            f"rounds of <= {per_task} calls per process / {budget:g} s",
        )
    ]


async def _scaling(cfg: Config, client: Any) -> list[dict[str, Any]]:
    small_rows = 1024
    big_rows = cfg.pick(1 << 20, 1 << 14)
    big_put = cfg.pick(65536, 4096)
    lat_calls = cfg.pick(20, 5)
    lat_rounds = cfg.pick(2, 1)
    big_label = f"{big_rows / 2**20:g}M" if big_rows >= 2**20 else f"{big_rows // 1024}k"
    await _fill(client, "w2-small", small_rows, small_rows)
    t0 = perf_counter()
    filled = await _fill(client, "w2-big", big_rows, big_put, budget=cfg.pick(240, 60))
    big_put_s = perf_counter() - t0
    if filled < big_rows:
        raise RuntimeError(f"put only {filled} of {big_rows} rows in {big_put_s:.0f} s")
    lat: dict[str, list[float]] = {"w2-small": [], "w2-big": []}
    first: dict[str, list[float]] = {"w2-small": [], "w2-big": []}
    for r in range(lat_rounds):
        for pid in ("w2-small", "w2-big"):
            t0 = perf_counter()
            await _get_meta(client, pid, f"lat-{r}")
            first[pid].append(perf_counter() - t0)
            for _ in range(lat_calls):
                t0 = perf_counter()
                await _get_meta(client, pid, f"lat-{r}")
                lat[pid].append(perf_counter() - t0)
    # half the big partition consumed (in big batches), then small batches again
    consumed = 0
    while consumed < big_rows // 2:
        await _get_meta(client, "w2-big", "lat-half", big_put)
        consumed += big_put
    half_lat = []
    for _ in range(lat_calls):
        t0 = perf_counter()
        await _get_meta(client, "w2-big", "lat-half")
        half_lat.append(perf_counter() - t0)
    await call(client.async_clear_partition("w2-small"))
    await call(client.async_clear_partition("w2-big"), timeout=300)

    p50_small = median(lat["w2-small"]) * 1e6
    p50_big = median(lat["w2-big"]) * 1e6
    return [
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
            note=f"@1k: {median(first['w2-small']) * 1e3:.2f} ms",
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


async def _main(cfg: Config, conf: Any) -> list[dict[str, Any]]:
    rows = cfg.pick(16384, 512)
    per_task = rows // BATCH
    rounds = cfg.pick(2, 1)
    out: list[dict[str, Any]] = []
    client = async_client(conf, "w2")
    try:
        # warm-up: sockets, first-use allocations
        await _fill(client, "w2-warm", 64, 64)
        for _ in range(4):
            await _get_meta(client, "w2-warm", "warm")
        await call(client.async_clear_partition("w2-warm"))

        phases: list[tuple[tuple[str, ...], Any]] = [
            (
                ("get_meta b8, 1 client sequential",),
                lambda: _sequential(cfg, client, rows, per_task, rounds),
            ),
            (
                ("get_meta b8, 4 AsyncClients in 1 process",),
                lambda: _concurrent(cfg, conf, client, rows, per_task, rounds),
            ),
            (
                (f"get_meta b8, {cfg.pick(4, 1)} client processes",),
                lambda: _processes(cfg, conf, client, rows, per_task, rounds),
            ),
            (
                ("get_meta b8 p50 @1k rows", "get_meta p50 ratio 1M/1k rows"),
                lambda: _scaling(cfg, client),
            ),
        ]
        for metrics, phase in phases:
            try:
                out.extend(await phase())
            except Exception as e:  # record it, go on with the next phase
                traceback.print_exc()
                why = f"{type(e).__name__}: {e}"
                out.extend(failure(WORKLOAD, m, "", why) for m in metrics)
    finally:
        client.close()
    return out


def run(cfg: Config) -> list[dict[str, Any]]:
    """Run W2 on TransferQueue and return its results."""
    with tq_session(cfg) as conf:
        return asyncio.run(_main(cfg, conf))
