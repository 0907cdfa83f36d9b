"""Shared pieces of the workloads: configuration, result dicts, statistics, clusters."""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import shutil
import statistics
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import partial
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any

import anyio

from ._proc import ServeProcess

__all__ = [
    "SYSTEM",
    "Config",
    "result",
    "percentile",
    "median",
    "rate_stats",
    "settle",
    "Cluster",
    "durable_dir",
    "minor_faults",
    "open_cluster",
    "open_cluster_handle",
]

SYSTEM = "tq_async"


@dataclass(frozen=True)
class Config:
    """What the runner asks of a workload.

    Attributes:
        smoke: tiny sizes (CI): exercises every code path in a few seconds, measures nothing.
        mode: ``"embedded"`` (cluster in this event loop) or ``"process"`` (``tq-async serve``
            in a subprocess; clients here, over loopback TCP).
        storage_units: storage units of the cluster.
        durability: the cluster's ``durability`` (``memory``, ``process``, ``fsync``).
        data_dir: where a durable cluster keeps its journal: each cluster a workload opens
            gets a fresh directory under it (removed afterwards), so runs never recover
            each other's state. Put it on the disk being measured.
    """

    smoke: bool = False
    mode: str = "embedded"
    storage_units: int = 2
    durability: str = "memory"
    data_dir: str | None = None

    def pick(self, full: Any, smoke: Any) -> Any:
        """``smoke`` in smoke mode, else ``full``."""
        return smoke if self.smoke else full

    def processes(self) -> SpawnContext | ForkServerContext:
        """Where a workload's client processes come from: spawned, as measured; at --smoke
        forked from one server that imported torch, tensordict and tq_async once for all of
        them (a spawned process spends ~4 s of CPU on those imports before its first call)."""
        if not self.smoke:
            return multiprocessing.get_context("spawn")
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "tensordict", "tq_async", "anyio"])
        return ctx


def result(
    workload: str,
    metric: str,
    value: float,
    unit: str,
    *,
    best: float | None = None,
    higher_is_better: bool = True,
    n: int | None = None,
    note: str = "",
    **extra: Any,
) -> dict[str, Any]:
    """One measured number as a plain dict (the ``--json`` schema).

    ``value`` is the headline (a median unless the metric says otherwise), ``best`` the best
    repetition (max or min according to ``higher_is_better``); ``system`` and ``mode`` are
    filled in by the runner unless given.
    """
    out: dict[str, Any] = {
        "workload": workload,
        "metric": metric,
        "value": float(value),
        "unit": unit,
        "best": None if best is None else float(best),
        "higher_is_better": higher_is_better,
        "n": n,
        "note": note,
    }
    out.update(extra)
    return out


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in 0..100) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    k = max(0, math.ceil(p / 100 * len(ordered)) - 1)
    return ordered[min(k, len(ordered) - 1)]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def rate_stats(nbytes: int, seconds: Sequence[float]) -> tuple[float, float]:
    """``(median, best)`` throughput in GB/s (1e9 bytes) for operations moving ``nbytes``."""
    return nbytes / median(seconds) / 1e9, nbytes / min(seconds) / 1e9


@dataclass(frozen=True)
class Cluster:
    """A running cluster: its controller address and the pid of the process serving it."""

    address: str
    pid: int


@contextmanager
def durable_dir(cfg: Config) -> Iterator[str | None]:
    """A fresh, empty directory under ``cfg.data_dir`` for one cluster (None at
    ``memory``), removed afterwards."""
    if cfg.durability == "memory":
        yield None
        return
    if cfg.data_dir is None:
        raise ValueError(f"durability {cfg.durability!r} needs --data-dir DIR")
    os.makedirs(cfg.data_dir, exist_ok=True)
    path = tempfile.mkdtemp(prefix="tq-bench-", dir=cfg.data_dir)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@asynccontextmanager
async def open_cluster_handle(cfg: Config) -> AsyncIterator[Cluster]:
    """A running cluster for ``cfg.mode`` (embedded: served by this process), at
    ``cfg.durability``."""
    with durable_dir(cfg) as data_dir:
        if cfg.mode == "embedded":
            import tq_async as tq

            async with tq.local_cluster(
                num_storage_units=cfg.storage_units,
                durability=cfg.durability,  # type: ignore[arg-type]
                data_dir=data_dir,
            ) as cluster:
                yield Cluster(cluster.address, os.getpid())
        elif cfg.mode == "process":
            args = ["--storage-units", str(cfg.storage_units)]
            if data_dir is not None:
                args += ["--durability", cfg.durability, "--data-dir", data_dir]
            server = await anyio.to_thread.run_sync(partial(ServeProcess, role=args))
            try:
                yield Cluster(server.address, server.pid)
            finally:
                await anyio.to_thread.run_sync(server.stop)
        else:
            raise ValueError(f"unknown mode {cfg.mode!r}")


@asynccontextmanager
async def open_cluster(cfg: Config) -> AsyncIterator[str]:
    """A running cluster for ``cfg.mode``; yields the controller address."""
    async with open_cluster_handle(cfg) as cluster:
        yield cluster.address


def minor_faults(pid: int) -> int:
    """Minor page faults of process ``pid`` so far (field 10 of ``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def settle() -> None:
    """Start a timed round from a clean garbage-collector state (a full collection now).

    ``import torch`` leaves ~310,000 objects the collector tracks; a generation-2 collection
    then takes 100-150 ms on the reference box. Where those collections land depends on how
    many objects the code allocated so far, so without this a ~1-s round contains one or not
    by the phase of the collector, and a change that allocates a few objects more or less
    moves a median by 15 % (W2 before/after the merge of issues 23-28, RESULTS.md). timeit
    disables the collector while timing for the same reason; collecting before each round
    keeps it on during the round but starts every round from the same state.
    """
    gc.collect()
