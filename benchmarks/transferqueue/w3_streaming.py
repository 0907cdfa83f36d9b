"""W3 streaming latency on TransferQueue: put start -> a streaming consumer has the row.

The definitions of ``benchmarks/w3_wakeup.py``: a producer puts one-row batches on a fixed
10 ms schedule; the row carries ``t`` (float64) = ``time.perf_counter()`` taken just before the
put is called (CLOCK_MONOTONIC, comparable across processes); the first 5 rows are warm-up.

The consumer is TransferQueue's own streaming consumer, ``StreamingDataset`` (``batch_size=1``,
``micro_batch_size=1``), with the controller in ``polling_mode`` and the ``RankAwareSampler``,
as its streaming tutorial sets them up: without ``polling_mode`` a ``get_meta`` for rows not
yet there holds the whole controller 5 s and then raises. The dataset's ``fetch_batch_fn`` hook
is given a function that makes the same two client calls as its default (``get_meta`` with the
dataset's sampling config, then ``get_data``) and also notes when ``get_meta`` returned, so both
put -> get_meta and put -> data in hand are reported. Phases:

* same process: the dataset iterated in a thread of this process (its own client), the producer
  an ``AsyncTransferQueueClient`` on this process's event loop;
* consumer process: the dataset in a spawned process;
* informational: a hand-written busy loop on ``get_meta`` (polling mode returns an empty batch at
  once) in a spawned process -- the best latency TransferQueue allows, at the cost of a core.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import threading
import traceback
from collections.abc import Callable
from time import perf_counter
from typing import Any

from ._common import (
    Config,
    Deadline,
    async_client,
    call,
    failure,
    percentile,
    result,
    sync_client,
    tq_session,
)

__all__ = ["run"]

WORKLOAD = "W3"
INTERVAL = 0.010
WARMUP = 5
FIELDS = ["t"]


def _timed_fetch(stamps: list[float]) -> Callable[..., tuple[Any, Any]]:
    """A ``fetch_batch_fn`` for StreamingDataset: its default's two calls, plus a timestamp."""

    def fetch(
        tq_client: Any,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        task_name: str,
        sampling_config: dict[str, Any],
        batch_index: int,
    ) -> tuple[Any, Any]:
        config = {**sampling_config, "batch_index": batch_index, "partition_id": partition_id}
        meta = tq_client.get_meta(
            data_fields=data_fields,
            batch_size=batch_size,
            partition_id=partition_id,
            task_name=task_name,
            sampling_config=config,
        )
        if meta.size == 0:
            return None, meta
        stamps.append(perf_counter())
        return tq_client.get_data(meta), meta

    return fetch


def _t_of(batch: Any) -> float:
    return float(batch["t"].reshape(-1)[0])


def _consume_dataset(
    conf: Any, pid: str, task: str, n: int, stop: Any
) -> tuple[list[float], list[float]]:
    """Latencies (s) of ``n`` rows read through a StreamingDataset: to get_meta, to data."""
    from transfer_queue import StreamingDataset

    stamps: list[float] = []
    dataset = StreamingDataset(
        config=conf,
        batch_size=1,
        micro_batch_size=1,
        data_fields=FIELDS,
        partition_id=pid,
        task_name=task,
        dp_rank=0,
        fetch_batch_fn=_timed_fetch(stamps),
    )
    to_meta: list[float] = []
    to_data: list[float] = []
    for batch, _meta in dataset:
        t2 = perf_counter()
        t0 = _t_of(batch)
        to_meta.append(stamps[len(to_data)] - t0)
        to_data.append(t2 - t0)
        if len(to_data) >= n or stop.is_set():
            break
    return to_meta, to_data


def _consume_busy(conf: Any, pid: str, task: str, n: int, stop: Any) -> tuple[list[float], ...]:
    """The same through a loop that calls get_meta again at once when it returns nothing."""
    client = sync_client(conf, "w3-busy")
    to_meta: list[float] = []
    to_data: list[float] = []
    try:
        while len(to_data) < n and not stop.is_set():
            config = {"dp_rank": 0, "batch_index": len(to_data), "task_name": task}
            config["partition_id"] = pid
            meta = client.get_meta(FIELDS, 1, pid, task_name=task, sampling_config=config)
            if meta.size == 0:
                continue
            t1 = perf_counter()
            td = client.get_data(meta)
            t2 = perf_counter()
            t0 = _t_of(td)
            to_meta.append(t1 - t0)
            to_data.append(t2 - t0)
    finally:
        client.close()
    return to_meta, to_data


CONSUMERS = {"dataset": _consume_dataset, "busy": _consume_busy}


def _consumer_process(kind: str, conf: Any, pid: str, n: int, ready: Any, out: Any) -> None:
    try:
        ready.set()
        out.put(("ok", CONSUMERS[kind](conf, pid, f"consumer-{kind}", n, threading.Event())))
    except BaseException:
        out.put(("error", traceback.format_exc()))


async def _produce(client: Any, pid: str, n: int) -> None:
    import torch
    from tensordict import TensorDict

    start = perf_counter()
    for i in range(n):
        delay = start + i * INTERVAL - perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        td = TensorDict({"t": torch.tensor([perf_counter()], dtype=torch.float64)}, batch_size=[1])
        await call(client.async_put(td, partition_id=pid))


def _stats(label: str, to_meta: list[float], to_data: list[float], n: int) -> list[dict[str, Any]]:
    out = []
    for what, values in (("get_meta", to_meta[WARMUP:]), ("get_data", to_data[WARMUP:])):
        ms = [v * 1e3 for v in values]
        out += [
            result(
                WORKLOAD,
                f"put->{what} {name} ({label})",
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
    return out


def _failed(label: str, why: str) -> list[dict[str, Any]]:
    return [
        failure(WORKLOAD, f"put->{what} {name} ({label})", "ms", why)
        for what in ("get_meta", "get_data")
        for name in ("p50", "p99")
    ]


async def _same_process(cfg: Config, conf: Any, n: int) -> list[dict[str, Any]]:
    pid = "w3-local"
    res: dict[str, Any] = {}
    stop = threading.Event()

    def consume() -> None:
        try:
            res["ok"] = _consume_dataset(conf, pid, "consumer-local", n, stop)
        except BaseException:
            res["error"] = traceback.format_exc()

    thread = threading.Thread(target=consume, name="w3-consumer", daemon=True)
    producer = async_client(conf, "w3-producer")
    try:
        thread.start()
        await asyncio.sleep(0.1)
        await _produce(producer, pid, n)
        await asyncio.to_thread(thread.join, cfg.pick(120, 60))
        if thread.is_alive():
            stop.set()
            raise RuntimeError("the StreamingDataset consumer did not get every row in time")
        if "error" in res:
            raise RuntimeError(f"the StreamingDataset consumer failed:\n{res['error']}")
        await call(producer.async_clear_partition(pid))
    finally:
        producer.close()
    return _stats("same process", *res["ok"], n)


async def _other_process(cfg: Config, conf: Any, kind: str, n: int, label: str) -> list[Any]:
    pid = f"w3-{kind}"
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    q = ctx.Queue()
    proc = ctx.Process(target=_consumer_process, args=(kind, conf, pid, n, ready, q), daemon=True)
    proc.start()
    producer = async_client(conf, "w3-producer")
    try:
        if not await asyncio.to_thread(ready.wait, 120):
            raise RuntimeError("the W3 consumer process did not start within 120 s")
        await asyncio.sleep(0.2)
        await _produce(producer, pid, n)
        try:
            msg = await asyncio.to_thread(q.get, True, cfg.pick(120, 60))
        except queue.Empty:
            raise RuntimeError("the W3 consumer process did not get every row in time") from None
        if msg[0] == "error":
            raise RuntimeError(f"the W3 consumer process failed:\n{msg[1]}")
        await call(producer.async_clear_partition(pid))
    finally:
        producer.close()
        await asyncio.to_thread(proc.join, 10)
        if proc.is_alive():
            proc.terminate()
    return _stats(label, *msg[1], n)


async def _main(cfg: Config, conf: Any) -> list[dict[str, Any]]:
    n = cfg.pick(450, 20) + WARMUP
    out: list[dict[str, Any]] = []
    phases: list[tuple[str, Callable[[], Any]]] = [
        ("same process", lambda: _same_process(cfg, conf, n)),
        ("consumer process", lambda: _other_process(cfg, conf, "dataset", n, "consumer process")),
        (
            "busy-poll get_meta, consumer process",
            lambda: _other_process(cfg, conf, "busy", n, "busy-poll get_meta, consumer process"),
        ),
    ]
    for label, phase in phases:
        deadline = Deadline(cfg.pick(300, 120))
        try:
            out.extend(await asyncio.wait_for(phase(), deadline.remaining()))
        except Exception as e:  # record it, go on with the next phase
            traceback.print_exc()
            out.extend(_failed(label, f"{type(e).__name__}: {e}"))
    return out


def run(cfg: Config) -> list[dict[str, Any]]:
    """Run W3 on TransferQueue and return its results."""
    from transfer_queue import RankAwareSampler

    with tq_session(cfg, polling_mode=True, sampler=RankAwareSampler) as conf:
        return asyncio.run(_main(cfg, conf))
