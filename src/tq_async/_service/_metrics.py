"""Prometheus metrics, opt-in, on a registry the application passes in (``prometheus_client``
is imported only then: the collectors computed when scraped and the HTTP server are in
`tq_async._service._exposition`, imported by services whose metrics are on).

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

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._errors import InvalidRequestError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["Metrics", "metrics_address"]

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
        from prometheus_client import Counter, Histogram  # (metrics on: `_exposition`)

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
        from prometheus_client import Counter

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
