"""``local_cluster``: a controller and storage units as tasks in the caller's event loop."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import structlog
from prometheus_client import CollectorRegistry

from ._controller import AdmissionConfig, ControllerServer
from ._errors import InvalidRequestError
from ._metrics import Metrics, controller_collector, serve_metrics, storage_collector
from ._security import CurveServer
from ._state import ControllerState, check_capacity
from ._storage import DEFAULT_SHM_CAP, StorageServer
from ._transport import is_loopback
from .samplers import BaseSampler

__all__ = ["LocalCluster", "local_cluster"]

log = structlog.get_logger(__name__)


@dataclass
class LocalCluster:
    """A running cluster: connect clients to :attr:`address`.

    Attributes:
        address: the controller's endpoint.
        controller: the controller service (its ``state`` is inspectable in tests).
        units: the storage unit services.
    """

    address: str
    controller: ControllerServer
    units: list[StorageServer] = field(default_factory=list)
    metrics_url: str | None = None

    @property
    def unit_addresses(self) -> list[str]:
        return [u.address for u in self.units]


@asynccontextmanager
async def local_cluster(
    num_storage_units: int = 2,
    sampler: BaseSampler | None = None,
    *,
    task_samplers: Mapping[str, BaseSampler] | None = None,
    host: str = "127.0.0.1",
    bind: str | None = None,
    transport: str = "ipc",
    allow_pickle: bool = False,
    metrics_registry: CollectorRegistry | None = None,
    serve_metrics_on: str | None = None,
    admission: AdmissionConfig | None = None,
    curve: CurveServer | None = None,
    capacity: int | None = None,
    capacity_scope: str = "partition",
    shm_cap: int = DEFAULT_SHM_CAP,
) -> AsyncIterator[LocalCluster]:
    """Run a controller and ``num_storage_units`` storage units in this event loop.

    Every service binds its own ZMQ socket, so clients in other processes of this host can
    connect to ``cluster.address`` too. Leaving the block stops them.

    Args:
        num_storage_units: how many storage units (rows of one put go to one unit,
            round-robin across puts).
        sampler: the controller's sampler (:class:`~tq_async.SequentialSampler` by default).
        task_samplers: samplers for particular tasks, e.g. ``{"update_actor":
            tq.SeqlenBalancedSampler(dp_size=4)}``; other tasks use ``sampler``.
        host: the interface to bind with ``transport="tcp"``; loopback by default.
        bind: the controller's full bind address (overrides ``host`` and ``transport`` for
            the controller), e.g. ``"tcp://127.0.0.1:5555"``.
        transport: ``"ipc"`` (default: Unix sockets in a private temporary directory, about
            twice the bandwidth of loopback TCP) or ``"tcp"`` (a free port each on ``host``).
        allow_pickle: allow columns of arbitrary Python objects (pickle runs code on load:
            trusted deployments only).
        metrics_registry: a ``prometheus_client.CollectorRegistry`` to record metrics in
            (off by default; the global registry is never used).
        serve_metrics_on: ``"host:port"`` to serve the registry over HTTP (port 0: any
            free port; see ``cluster.metrics_url``). Needs ``metrics_registry``.
        admission: staleness and capacity bounds enforced by ``acquire_rollout``.
        curve: CURVE keys: encrypt every socket and admit only the allowed client keys.
        capacity: backpressure: the most live rows per partition (``capacity_scope=
            "partition"``) or in all partitions (``"global"``). A full ``put`` waits and
            ``put_nowait`` raises ``WouldBlock``; rows free only when cleared (explicitly, or
            by auto-clear, see ``register_tasks``): unconsumed data is never evicted.
        shm_cap: bytes of shared memory per storage unit for clients in other processes of
            this host (0: off; at the cap, puts go over the socket). Pages are used only
            once written.

    Yields:
        A :class:`LocalCluster`.

    Raises:
        BrokenError: an address could not be bound.
    """
    if num_storage_units < 1:
        raise InvalidRequestError(f"num_storage_units must be >= 1, got {num_storage_units}")
    if transport not in ("ipc", "tcp"):
        raise InvalidRequestError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
    sockdir = tempfile.mkdtemp(prefix="tq-") if transport == "ipc" else None

    def endpoint(name: str) -> str:
        return f"ipc://{sockdir}/{name}" if sockdir else f"tcp://{host}:0"

    controller_bind = bind or endpoint("controller")
    if not is_loopback(controller_bind):
        log.warning(
            "binding a non-loopback interface: anyone who can reach it can read and write data",
            address=controller_bind,
        )
    capacity, capacity_global = check_capacity(capacity, capacity_scope)
    if serve_metrics_on is not None and metrics_registry is None:
        raise InvalidRequestError("serve_metrics_on needs a metrics_registry")
    stop_metrics = None
    try:
        async with anyio.create_task_group() as tg:
            units = [
                StorageServer(
                    i,
                    allow_pickle=allow_pickle,
                    metrics=Metrics(metrics_registry, "storage"),
                    curve=curve,
                    shm_cap=shm_cap,
                )
                for i in range(num_storage_units)
            ]
            addresses = {}
            for unit in units:
                address = await tg.start(unit.serve, endpoint(f"unit{unit.unit_id}"))
                addresses[unit.unit_id] = address
            state = ControllerState(addresses)
            state.capacity, state.capacity_global = capacity, capacity_global
            controller = ControllerServer(
                state,
                sampler,
                task_samplers=task_samplers,
                allow_pickle=allow_pickle,
                metrics=Metrics(metrics_registry, "controller"),
                admission=admission,
                curve=curve,
                local_units={u.unit_id: u for u in units},
            )
            address = await tg.start(controller.serve, controller_bind)
            cluster = LocalCluster(address, controller, units)
            if metrics_registry is not None:
                metrics_registry.register(
                    controller_collector(controller.state, lambda: controller.waiting)
                )
                metrics_registry.register(storage_collector({u.unit_id: u.state for u in units}))
                if serve_metrics_on is not None:
                    host_part, _, port_part = serve_metrics_on.rpartition(":")
                    cluster.metrics_url, stop_metrics = serve_metrics(
                        metrics_registry, host_part or "127.0.0.1", int(port_part or 0)
                    )
            try:
                yield cluster
            finally:
                tg.cancel_scope.cancel()
    finally:
        if stop_metrics is not None:
            await anyio.to_thread.run_sync(stop_metrics)
        if sockdir is not None:
            shutil.rmtree(sockdir, ignore_errors=True)
