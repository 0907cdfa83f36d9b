"""Prometheus exposition, for services whose metrics are on (`tq_async._service._metrics`
lists the metrics): the gauges computed from a service's state when scraped, and the HTTP
server. Imported only where a registry was given: a service without metrics never imports
``prometheus_client``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .._core._figures import ready_counts
from .._errors import BrokenError
from .._paths._nixl import fallbacks as nixl_fallbacks

if TYPE_CHECKING:
    from .._core._state import ControllerState
    from .._paths._nixl import UnitNixl
    from .._paths._shm import Arena

__all__ = [
    "controller_collector",
    "register",
    "serve_metrics",
    "storage_collector",
    "transfer_collector",
]


def register(registry: CollectorRegistry, collector: Collector) -> Callable[[], None]:
    """Register ``collector`` in ``registry``; returns what unregisters it, called when its
    service stops (a registry kept for a later cluster would otherwise show the stopped
    cluster's gauges beside the new one's, each family twice)."""
    registry.register(collector)

    def unregister() -> None:
        with contextlib.suppress(KeyError):  # (already gone)
            registry.unregister(collector)

    return unregister


class _Collector(Collector):
    def __init__(self, collect: Callable[[], Iterator[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        return self._collect()


def controller_collector(state: ControllerState, waiting: Callable[[], int]) -> Collector:
    """Gauges computed from the controller's state when scraped (no hot-path cost)."""

    def collect() -> Iterator[GaugeMetricFamily]:
        ready = GaugeMetricFamily(
            "tq_rows_ready", "Rows ready and not consumed, per task.", labels=["task"]
        )
        unconsumed = GaugeMetricFamily(
            "tq_rows_unconsumed", "Rows alive and not consumed, per task.", labels=["task"]
        )
        ready_by_task: dict[str, int] = {}
        unconsumed_by_task: dict[str, int] = {}
        for p in list(state.partitions.values()):
            for task, n in ready_counts(p).items():
                ready_by_task[task] = ready_by_task.get(task, 0) + n
            for task, count in list(p.consumed_count.items()):
                unconsumed_by_task[task] = unconsumed_by_task.get(task, 0) + p.n_alive - count
        for task, n in sorted(ready_by_task.items()):
            ready.add_metric([task], n)
        for task, n in sorted(unconsumed_by_task.items()):
            unconsumed.add_metric([task], n)
        yield ready
        yield unconsumed
        yield GaugeMetricFamily(
            "tq_partitions", "Partitions held by the controller.", value=len(state.partitions)
        )
        yield GaugeMetricFamily(
            "tq_get_meta_waiting", "get_meta requests waiting for rows.", value=waiting()
        )

    return _Collector(collect)


class UnitGauges(Protocol):
    """What `storage_collector` reads of a storage unit's state (``StorageState``)."""

    @property
    def resident_bytes(self) -> int: ...

    @property
    def arena(self) -> Arena | None: ...

    @property
    def nixl(self) -> UnitNixl | None: ...

    @property
    def locality(self) -> dict[str, int]: ...

    @property
    def task_locality(self) -> dict[str, dict[str, int]]: ...


#: the ``tq_storage_*{unit}`` metrics of one value per unit: (kind, name, help, the part of
#: the unit's `UnitGauges` that holds the value ("": the unit's own; a unit without that
#: part reports nothing), the attribute of that part)
_PER_UNIT: tuple[tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, str, str], ...] = (
    (
        GaugeMetricFamily,
        "tq_storage_resident_bytes",
        "Bytes of cells held by a storage unit.",
        "",
        "resident_bytes",
    ),
    (
        GaugeMetricFamily,
        "tq_storage_shm_bytes",
        "Shared memory in use by a storage unit (cells and reads in flight).",
        "arena",
        "live_bytes",
    ),
    (
        GaugeMetricFamily,
        "tq_storage_shm_idle_bytes",
        "Freed shared memory a storage unit keeps resident for reuse (bounded).",
        "arena",
        "idle_bytes",
    ),
    (
        CounterMetricFamily,
        "tq_storage_shm_fallbacks",
        "Same-host puts and reads that went over the socket because the arena was full.",
        "arena",
        "fallbacks",
    ),
    (
        CounterMetricFamily,
        "tq_storage_nixl_puts",
        "Puts whose bytes a client wrote into a storage unit's arena with NIXL.",
        "nixl",
        "puts",
    ),
    (
        CounterMetricFamily,
        "tq_storage_nixl_reads",
        "Reads whose bytes a client read out of a storage unit's arena with NIXL.",
        "nixl",
        "reads",
    ),
    (
        GaugeMetricFamily,
        "tq_storage_nixl_registered_bytes",
        "Bytes a storage unit registered with NIXL (its arena, once a NIXL client came).",
        "nixl",
        "registered_bytes",
    ),
)


def storage_collector(units: dict[int, UnitGauges]) -> Collector:
    """The ``tq_storage_*{unit}`` metrics of the given units, computed when scraped."""

    def collect() -> Iterator[Metric]:
        per_unit = [
            (kind(name, text, labels=["unit"]), part, attr)
            for kind, name, text, part, attr in _PER_UNIT
        ]
        locality = CounterMetricFamily(
            "tq_storage_locality_bytes",
            "Payload bytes a storage unit moved, by direction and by whether the client was "
            "on the unit's host.",
            labels=["unit", "direction", "locality"],
        )
        by_task = CounterMetricFamily(
            "tq_storage_task_locality_bytes",
            "Payload bytes a storage unit served to each task's readers, by whether the "
            "reader was on the unit's host.",
            labels=["unit", "task", "locality"],
        )
        for unit_id, st in sorted(units.items()):
            for key, n in sorted(st.locality.items()):
                direction, _, where = key.partition("_")
                locality.add_metric([str(unit_id), direction, where], n)
            for task, counts in sorted(getattr(st, "task_locality", {}).items()):
                for key, n in sorted(counts.items()):
                    by_task.add_metric([str(unit_id), task, key.partition("_")[2]], n)
            for family, part, attr in per_unit:
                holder = getattr(st, part) if part else st
                if holder is not None:
                    family.add_metric([str(unit_id)], getattr(holder, attr))
        yield from (family for family, _, _ in per_unit)
        yield from (locality, by_task)

    return _Collector(collect)


def transfer_collector() -> Collector:
    """``tq_transfer_fallbacks_total{reason}``: NIXL transfers of this process's clients that
    failed and went over the socket instead (register it in the client's process:
    ``registry.register(tq_async.lowlevel.transfer_collector())``)."""

    def collect() -> Iterator[Metric]:
        c = CounterMetricFamily(
            "tq_transfer_fallbacks",
            "Client requests whose NIXL transfer failed and that went over the socket.",
            labels=["reason"],
        )
        for reason, n in sorted(nixl_fallbacks.items()):
            c.add_metric([reason], n)
        yield c

    return _Collector(collect)


def serve_metrics(
    registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0
) -> tuple[str, Callable[[], None]]:
    """Serve ``registry`` over HTTP (a daemon thread). Returns ``(url, stop)``.

    Raises:
        BrokenError: ``host:port`` could not be bound (taken, or no such interface).
    """
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise BrokenError(
            f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; choose another "
            "address (metrics_on, --metrics-on)"
        ) from exc
    url = f"http://{f'[{host}]' if ':' in host else host}:{server.server_port}/metrics"

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return url, stop
