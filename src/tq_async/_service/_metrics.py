"""Prometheus metrics, opt-in, on a registry the application passes in.

Nothing is registered at import time and the global registry is never touched: a service
records metrics only when it was given a `prometheus_client.CollectorRegistry`. Names
follow the Prometheus naming guide (``_total`` only on counters, base units); partition ids are
never label values (unbounded), task names and op names are.

=====================================  ======  ===============================================
name                                   type    labels
=====================================  ======  ===============================================
tq_requests_total                      counter service, op, outcome (ok | error)
tq_request_duration_seconds            hist.   service, op
tq_transfer_bytes_total                counter service, direction (in | out)
tq_consumer_wait_seconds               hist.   (time a get_meta waited for rows)
tq_rows_delivered_total                counter task, locality (same_host | other_host): rows
                                               handed to consumers, by whether their unit is
                                               on the consumer's host
tq_stale_rows_total                    counter policy (dropped | recycled | kept)
tq_rows_ready                          gauge   task (rows ready and not consumed, all partitions)
tq_rows_unconsumed                     gauge   task (rows alive and not consumed by the task)
tq_partitions                          gauge   (partitions held by the controller)
tq_storage_resident_bytes              gauge   unit (bytes of cells held by a storage unit)
tq_storage_shm_bytes                   gauge   unit (shared memory in use by a unit's cells/reads)
tq_storage_shm_idle_bytes              gauge   unit (freed shared memory kept resident for reuse)
tq_storage_shm_fallbacks_total         counter unit (puts/reads over the socket: arena full)
tq_storage_nixl_puts_total             counter unit (puts whose bytes a client WROTE with NIXL)
tq_storage_nixl_reads_total            counter unit (reads whose bytes a client READ with NIXL)
tq_storage_nixl_registered_bytes       gauge   unit (bytes a unit registered with NIXL: its arena)
tq_storage_locality_bytes_total        counter unit, direction (in | out), locality (same_host |
                                               other_host): payload bytes a unit moved for
                                               clients of its own host and of others
tq_storage_task_locality_bytes_total   counter unit, task, locality (same_host | other_host):
                                               payload bytes a unit served to each task's
                                               readers on its own host and on others
tq_get_meta_waiting                    gauge   (get_meta requests parked waiting for rows)
tq_transfer_fallbacks_total            counter reason (error | timeout): a client process's NIXL
                                               transfers that went over the socket instead
                                               (`transfer_collector`)
=====================================  ======  ===============================================
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .._core._figures import ready_counts
from .._errors import BrokenError, InvalidRequestError
from .._paths._nixl import fallbacks as nixl_fallbacks

if TYPE_CHECKING:
    from .._core._state import ControllerState
    from .._paths._nixl import UnitNixl
    from .._paths._shm import Arena

__all__ = [
    "Metrics",
    "metrics_address",
    "register",
    "serve_metrics",
    "controller_collector",
    "storage_collector",
    "transfer_collector",
]

_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1, 0.5, 1, 5, 30)


class Metrics:
    """The request metrics of one service; every method is a no-op without a registry.

    Args:
        registry: where to register; None disables metrics.
        service: ``"controller"`` or ``"storage"`` (a label value).
    """

    def __init__(self, registry: CollectorRegistry | None, service: str) -> None:
        self.enabled = registry is not None
        self.service = service
        self._children: dict[tuple[str, str], Any] = {}
        self._durations: dict[str, Any] = {}
        self._registry = registry
        if registry is None:
            return
        self._requests = _shared(
            registry,
            "tq_requests_total",
            lambda: Counter(
                "tq_requests",
                "Requests served, by operation and outcome.",
                ["service", "op", "outcome"],
                registry=registry,
            ),
        )
        self._duration = _shared(
            registry,
            "tq_request_duration_seconds",
            lambda: Histogram(
                "tq_request_duration_seconds",
                "Time from receiving a request to sending its reply.",
                ["service", "op"],
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
        )
        self._bytes = _shared(
            registry,
            "tq_transfer_bytes_total",
            lambda: Counter(
                "tq_transfer_bytes",
                "Payload bytes received (in) and sent (out) by storage units.",
                ["service", "direction"],
                registry=registry,
            ),
        )
        self._stale = _shared(
            registry,
            "tq_stale_rows_total",
            lambda: Counter(
                "tq_stale_rows",
                "Rows found too stale when sampled, by what was done with them.",
                ["policy"],
                registry=registry,
            ),
        )
        self._wait = _shared(
            registry,
            "tq_consumer_wait_seconds",
            lambda: Histogram(
                "tq_consumer_wait_seconds",
                "Time a get_meta request waited for enough ready rows.",
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
        )

    def delivered(self, task: str, same_host: int, other_host: int) -> None:
        """Count rows handed to a consumer of ``task``: on its host, and elsewhere."""
        registry = self._registry
        if registry is None:
            return
        counter = _shared(
            registry,
            "tq_rows_delivered_total",
            lambda: Counter(
                "tq_rows_delivered",
                "Rows handed to consumers, by task and by whether the unit holding them is "
                "on the consumer's host (same_host) or not (other_host, or hosts unknown).",
                ["task", "locality"],
                registry=registry,
            ),
        )
        if same_host:
            counter.labels(task, "same_host").inc(same_host)
        if other_host:
            counter.labels(task, "other_host").inc(other_host)

    def request(self, op: str, ok: bool, seconds: float) -> None:
        """Count one request and observe its duration."""
        if not self.enabled:
            return
        key = (op, "ok" if ok else "error")
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._requests.labels(self.service, *key)
        child.inc()
        hist = self._durations.get(op)
        if hist is None:
            hist = self._durations[op] = self._duration.labels(self.service, op)
        hist.observe(seconds)

    def transfer(self, direction: str, nbytes: int) -> None:
        """Count payload bytes moved in or out."""
        if self.enabled:
            self._bytes.labels(self.service, direction).inc(nbytes)

    def stale(self, policy: str, n: int) -> None:
        """Count ``n`` stale rows handled by ``policy`` (``dropped``, ``recycled``, ``kept``)."""
        if self.enabled and n:
            self._stale.labels(policy).inc(n)

    def consumer_wait(self, seconds: float) -> None:
        """Observe how long a get_meta waited for rows."""
        if self.enabled:
            self._wait.observe(seconds)


_SHARED_LOCK = threading.Lock()
_SHARED: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Any]] = weakref.WeakKeyDictionary()


def _shared(registry: CollectorRegistry, name: str, make: Callable[[], Any]) -> Any:
    """One metric object per (registry, name): services of one cluster share a registry."""
    with _SHARED_LOCK:
        metrics = _SHARED.setdefault(registry, {})
        if name not in metrics:
            metrics[name] = make()
        return metrics[name]


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


def metrics_address(address: str, key: str = "metrics_on") -> tuple[str, int]:
    """``"HOST:PORT"`` (``metrics_on``) as ``(host, port)``: no host is loopback, no port 0;
    an IPv6 host in brackets (``[::1]:9100``) comes without them.

    Raises:
        InvalidRequestError: no ``:``, or a port that is not a number from 0 to 65535 (the
            message starts with ``key``).
    """
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if sep and (port == "" or (port.isascii() and port.isdigit() and int(port) <= 65535)):
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        return host or "127.0.0.1", int(port or 0)
    raise InvalidRequestError(
        f"{key}: expected HOST:PORT (a port from 0 to 65535; 0: any free port), got {address!r}"
    )


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
