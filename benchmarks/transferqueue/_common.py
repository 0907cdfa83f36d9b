"""Shared pieces of the TransferQueue workloads: config, result dicts, a Ray + TQ session.

The result schema is the one of ``benchmarks._common.result`` (``python -m benchmarks``), kept
in step by hand because this package runs in another virtual environment (no anyio, no
tq_async there).
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from collections.abc import Awaitable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "MODE",
    "RAY_NUM_CPUS",
    "SYSTEM",
    "Config",
    "Deadline",
    "async_client",
    "call",
    "failure",
    "median",
    "percentile",
    "result",
    "sync_client",
    "tq_session",
]

SYSTEM = "transferqueue"
#: TransferQueue always runs its controller and storage units as Ray actors (processes).
MODE = "ray"
#: A controller and two storage units reserve one Ray CPU each: with ``num_cpus=2`` its
#: ``init`` waits forever for the third actor, so Ray gets 4 logical CPUs on the 2-core box.
RAY_NUM_CPUS = 4
#: Upper bound of one client call; TransferQueue has no client-side timeout of its own.
CALL_TIMEOUT_S = 60.0

T = TypeVar("T")


@dataclass(frozen=True)
class Config:
    """What the TransferQueue runner asks of a workload (see ``benchmarks._common.Config``)."""

    smoke: bool = False
    storage_units: int = 2

    def pick(self, full: Any, smoke: Any) -> Any:
        """``smoke`` in smoke mode, else ``full``."""
        return smoke if self.smoke else full


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
    """One measured number as a plain dict: the ``--json`` schema of ``python -m benchmarks``."""
    out: dict[str, Any] = {
        "workload": workload,
        "metric": metric,
        "value": float(value),
        "unit": unit,
        "best": None if best is None else float(best),
        "higher_is_better": higher_is_better,
        "n": n,
        "note": note,
        "system": SYSTEM,
        "mode": MODE,
    }
    out.update(extra)
    return out


def failure(workload: str, metric: str, unit: str, why: str, **extra: Any) -> dict[str, Any]:
    """A measurement that could not be taken: value NaN, ``failed`` set, the reason in the note."""
    return result(workload, metric, float("nan"), unit, note=f"FAILED: {why}", failed=True, **extra)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in 0..100) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    k = max(0, math.ceil(p / 100 * len(ordered)) - 1)
    return ordered[min(k, len(ordered) - 1)]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


class Deadline:
    """A time budget: ``expired`` once ``seconds`` have passed since construction."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.perf_counter() + seconds

    @property
    def expired(self) -> bool:
        return time.perf_counter() >= self.end

    def remaining(self) -> float:
        return max(0.0, self.end - time.perf_counter())


async def call(aw: Awaitable[T], timeout: float = CALL_TIMEOUT_S) -> T:
    """Await one TransferQueue client call, bounded in time (it has no timeout of its own)."""
    return await asyncio.wait_for(aw, timeout)


def _quiet_env() -> None:
    # TransferQueue clamps its torch thread count to the physical cores and logs a warning on
    # every put/get when the default (8) is higher; setting it to the clamped value changes
    # nothing but the log noise. Ray's usage-stats reporter is switched off (no network).
    os.environ.setdefault("TQ_NUM_THREADS", str(os.cpu_count() or 1))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


# before anything imports transfer_queue (it reads these at import time)
_quiet_env()


@contextmanager
def tq_session(cfg: Config, *, polling_mode: bool = False, sampler: Any = None) -> Iterator[Any]:
    """A fresh local Ray instance with TransferQueue's controller and storage units on it.

    Yields the merged TransferQueue config (its ``controller.zmq_info`` and ``backend`` let
    other processes build clients without Ray). Always closes TransferQueue and shuts Ray down.
    """
    _quiet_env()
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    controller: dict[str, Any] = {"polling_mode": polling_mode}
    if sampler is not None:
        controller["sampler"] = sampler
    conf = OmegaConf.create(
        {
            "controller": controller,
            "backend": {"SimpleStorage": {"num_data_storage_units": cfg.storage_units}},
        },
        flags={"allow_objects": True},
    )
    # address="local": always a new instance, never whatever cluster another user started.
    ray.init(address="local", num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False)
    try:
        yield tq.init(conf)
    finally:
        try:
            tq.close()
        finally:
            ray.shutdown()


def _storage_args(conf: Any) -> tuple[str, Any]:
    backend = conf.backend.storage_backend
    return backend, conf.backend[backend]


def async_client(conf: Any, name: str) -> Any:
    """An ``AsyncTransferQueueClient`` built from the session config (as its datasets do)."""
    _quiet_env()
    from transfer_queue.client import AsyncTransferQueueClient

    client = AsyncTransferQueueClient(f"{name}_{os.getpid()}", conf.controller.zmq_info)
    backend, backend_conf = _storage_args(conf)
    client.initialize_storage_manager(manager_type=backend, config=backend_conf)
    return client


def sync_client(conf: Any, name: str) -> Any:
    """A blocking ``TransferQueueClient`` (its own event-loop thread) from the session config."""
    _quiet_env()
    from transfer_queue import TransferQueueClient

    client = TransferQueueClient(f"{name}_{os.getpid()}", conf.controller.zmq_info)
    backend, backend_conf = _storage_args(conf)
    client.initialize_storage_manager(manager_type=backend, config=backend_conf)
    return client
