"""``local_cluster``: a controller and storage units as tasks in the caller's event loop."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskGroup

from .._controller._journal import check_controller_dir
from .._controller._server import AdmissionConfig, ControllerServer, Deadlines
from .._core._effects import check_capacity
from .._core._placement import Placer, check_placement
from .._core._state import ControllerState
from .._errors import ConfigError, InvalidRequestError
from .._paths._nixl import check_data_path
from .._portal import host_services, stop_hosting
from .._service._config import Config, device_indexes, per_unit
from .._service._metrics import Metrics, metrics_address
from .._service._serve import first_tq_error, only_error, warn_if_exposed
from .._storage._dir_marker import unit_data_dir
from .._storage._server import DEFAULT_SHM_CAP, StorageServer
from .._storage._unit_dir import locked_dir
from .._transport._inherited import release
from .._transport._security import CurveServer
from .._wire._checks import integral
from ..samplers import BaseSampler

if sys.version_info < (3, 11):  # pragma: no cover - depends on the Python version
    from exceptiongroup import BaseExceptionGroup
if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["LocalCluster", "local_cluster"]

#: the lock an ipc cluster holds in its sockets' directory (one nobody holds: a killed one's)
_SOCKDIR_LOCK = "tq-local-cluster.lock"


@dataclass
class LocalCluster:
    """A running cluster: connect clients to `address`.

    Attributes:
        address: the controller's endpoint.
        controller: the controller service (its ``state`` is inspectable in tests).
        units: the storage unit services.
        metrics_url: where the Prometheus metrics are served (``serve_metrics_on``; None
            when they are not).
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
    deadlines: Deadlines | None = None,
    shm_cap: int = DEFAULT_SHM_CAP,
    data_path: str = "auto",
    placement: str = "auto",
    host_id: str | Sequence[str] | None = None,
    durability: str = "memory",
    data_dir: str | None = None,
    memory_cap: int | None = None,
    config: Config | None = None,
) -> AsyncIterator[LocalCluster]:
    """Run a controller and ``num_storage_units`` storage units in this event loop.

    Every service binds its own ZMQ socket, so clients in other processes of this host can
    connect to ``cluster.address`` too. Leaving the block stops them.

    Args:
        num_storage_units: how many storage units (rows of one put go to one unit; see
            ``placement``).
        sampler: the controller's sampler (`SequentialSampler` by default).
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
            (off by default; the global registry is never used). The figures read from
            the cluster's state (rows, partitions, the units' bytes and locality) leave it
            when the cluster stops; the request counters stay.
        serve_metrics_on: ``"host:port"`` to serve the registry over HTTP (port 0: any
            free port; see ``cluster.metrics_url``). Needs ``metrics_registry``.
        admission: staleness and capacity bounds enforced by ``acquire_rollout``.
        curve: CURVE keys: encrypt every socket and admit only the allowed client keys.
        capacity: backpressure: the most live rows per partition (``capacity_scope=
            "partition"``) or in all partitions (``"global"``). A full ``put`` waits and
            ``put_nowait`` raises ``WouldBlock``; rows free only when cleared (explicitly, or
            by auto-clear, see ``register_tasks``): unconsumed data is never evicted.
        capacity_scope: ``"partition"`` or ``"global"`` (see ``capacity``).
        deadlines: how long the controller waits for a producer's uncommitted put and for
            a silent storage unit (`Deadlines`).
        shm_cap: bytes of shared memory per storage unit for clients in other processes of
            this host (0: off; at the cap, puts go over the socket). Pages are used only
            once written.
        data_path: what the storage units offer besides the socket (``"auto"``, ``"shm"``,
            ``"nixl"``, ``"zmq"``; see `Config`).
        placement: which unit a put's new rows go to: ``"auto"`` (the default: ``"local"``
            while the units span more than one host), ``"local"`` (a unit on the producer's
            host, the least-loaded there) or ``"round_robin"``; see `Config`.
        host_id: the storage units' host id (default: ``$TQ_HOST_ID``, the Ray node id or
            the machine's), or one per unit: labels that make one machine look like
            several hosts (tests and benchmarks of locality).
        durability: ``"memory"`` (default), ``"process"`` or ``"fsync"``: the controller
            journals its state under ``data_dir`` and unit N keeps its cells under
            ``data_dir/units/unit-N``, so the cluster started again on ``data_dir`` comes
            back with its rows (see `Config` and ``docs/guarantees.md``).
        data_dir: the controller's journal directory, holding the units' directories (for
            ``process`` / ``fsync``; at ``memory`` with ``memory_cap``, where the units
            spill).
        memory_cap: most bytes of cells each storage unit keeps in memory; colder ones are
            spilled and read back on demand (None: no bound): at ``memory`` into a scratch
            directory under ``data_dir``, or the system's temporary directory without one.
        config: the whole deployment as a `Config` (e.g.
            ``tq.Config.from_toml("grpo.toml")``), the same one ``tq-async serve --config``
            and ``tq_async.ray.launch(config=...)`` take. The arguments it covers must then
            be left at their defaults; ``transport`` and ``metrics_registry`` still apply.

    Yields:
        A `LocalCluster`.

    Raises:
        BrokenError: an address could not be bound.
        ConfigError: ``config`` is bad (a sampler factory does not import or raises, ...),
            or an argument was given both in it and explicitly.
    """
    plan = _plan(
        config,
        metrics_registry,
        num_storage_units=num_storage_units,
        sampler=sampler,
        task_samplers=task_samplers,
        host=host,
        bind=bind,
        allow_pickle=allow_pickle,
        serve_metrics_on=serve_metrics_on,
        admission=admission,
        curve=curve,
        capacity=capacity,
        capacity_scope=capacity_scope,
        deadlines=deadlines,
        shm_cap=shm_cap,
        data_path=data_path,
        placement=placement,
        host_id=host_id,
        durability=durability,
        data_dir=data_dir,
        memory_cap=memory_cap,
    )
    if transport not in ("ipc", "tcp"):
        raise InvalidRequestError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
    if transport == "ipc":
        plan.make_sockdir()
    controller_bind = plan.bind or plan.endpoint("controller")
    warn_if_exposed(controller_bind, "cluster", plan.options["curve"])
    raised: list[BaseException] = []  # what the caller's block raised, if anything
    hosting = host_services()  # blocking clients on this loop's thread fail at once
    try:
        async with anyio.create_task_group() as tg:
            cluster = await _start(tg, plan, controller_bind)
            try:
                yield cluster
            except BaseException as exc:
                raised.append(exc)
                raise
            finally:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        _unwrap(group, raised)
    finally:
        stop_hosting(hosting)
        if plan.stop_metrics is not None:  # (shielded: a cancelled block stops it too)
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(plan.stop_metrics)
        for unregister in plan.unregister:  # (a registry kept for a later cluster)
            unregister()
        plan.remove_sockdir()
    if raised:
        raise raised[0]


@dataclass
class _Plan:
    """``local_cluster``'s arguments once a Config is folded in, and what it started."""

    options: dict[str, Any]
    num_storage_units: int
    host: str
    bind: str | None
    capacity: int | None
    capacity_global: bool
    serve_metrics_on: str | None
    auto_clear: list[str]
    shm_cap: int
    data_path: str
    registry: CollectorRegistry | None
    #: the ipc sockets' directory, and its lock (held while the cluster runs)
    sockdir: str | None = None
    sockdir_lock: int = -1
    stop_metrics: Callable[[], None] | None = None
    #: what takes the cluster's gauges out of the registry again
    unregister: list[Callable[[], None]] = field(default_factory=list)
    #: GPU memory per unit for cells put from GPUs (Config.device_cap), and which GPU
    device_cap: int = 0
    device_indexes: list[int] = field(default_factory=list)
    #: where new rows go (Config.placement), and each unit's host id (None: found out)
    placement: str = "auto"
    host_ids: list[str | None] = field(default_factory=list)
    #: bytes of cells each unit keeps in memory (Config.memory_cap; None: no bound)
    memory_cap: int | None = None

    def make_sockdir(self) -> None:
        """Make the directory of the ipc sockets, locked while the cluster runs (those of
        killed clusters there, which nobody holds, are removed first)."""
        self.sockdir, self.sockdir_lock = locked_dir(
            tempfile.gettempdir(), "tq-", _SOCKDIR_LOCK, "the sockets of a local_cluster"
        )

    def remove_sockdir(self) -> None:
        if self.sockdir is not None:
            shutil.rmtree(self.sockdir, ignore_errors=True)
            release(self.sockdir_lock)  # removed first: no sweep finds it unlocked
            self.sockdir, self.sockdir_lock = None, -1

    def endpoint(self, name: str) -> str:
        return f"ipc://{self.sockdir}/{name}" if self.sockdir else f"tcp://{self.host}:0"


def _plan(config: Config | None, registry: CollectorRegistry | None, **given: Any) -> _Plan:
    """Fold ``config`` (if any) into the explicit arguments, and check them."""
    options = {
        k: given[k]
        for k in (
            "sampler",
            "task_samplers",
            "allow_pickle",
            "admission",
            "curve",
            "deadlines",
            "durability",
            "data_dir",
        )
    }
    auto_clear: list[str] = []
    if config is not None:
        _check_no_overlap(**given)
        options = config.controller_options()
        given |= {
            "num_storage_units": config.num_storage_units,
            "host": config.host,
            "bind": config.bind,
            "capacity": config.capacity,
            "capacity_scope": config.capacity_scope,
            "serve_metrics_on": config.metrics_on,
            "shm_cap": config.shm_cap,
            "data_path": config.data_path,
            "placement": config.placement,
            "host_id": config.host_id,
            "memory_cap": config.memory_cap,
        }
        auto_clear = config.auto_clear_tasks
        if config.metrics_on is not None and registry is None:
            from prometheus_client import CollectorRegistry  # (metrics on)

            registry = CollectorRegistry()
    units = given["num_storage_units"]
    if type(units) is not int and not isinstance(units, bool):
        units = given["num_storage_units"] = integral(units)  # numpy's ints
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise InvalidRequestError(f"num_storage_units must be an int >= 1, got {units!r}")
    capacity, capacity_global = check_capacity(given["capacity"], given["capacity_scope"])
    if given["serve_metrics_on"] is not None:
        if registry is None:
            raise InvalidRequestError("serve_metrics_on needs a metrics_registry")
        metrics_address(given["serve_metrics_on"], "serve_metrics_on")
    plan = _Plan(
        options,
        given["num_storage_units"],
        given["host"],
        given["bind"],
        capacity,
        capacity_global,
        given["serve_metrics_on"],
        auto_clear,
        given["shm_cap"],
        check_data_path(given["data_path"]),
        registry,
    )
    plan.device_indexes = [0] * plan.num_storage_units
    if config is not None:
        plan.device_cap = config.device_cap
        plan.device_indexes = device_indexes(config.device_index, plan.num_storage_units)
    plan.placement = check_placement(given["placement"])
    plan.memory_cap = given["memory_cap"]
    plan.host_ids = _host_ids(given["host_id"], plan.num_storage_units)
    return plan


def _host_ids(host_id: Any, n: int) -> list[str | None]:
    """Each unit's host id: one for all, or one per unit (None: each unit finds out)."""
    ids: list[Any] = per_unit("host_id", "host ids", host_id, n)
    for one in ids:
        if one is not None and not isinstance(one, str):
            raise InvalidRequestError(
                f"host_id must be a string, a list of one per storage unit, or None (each "
                f"unit's host), got {type(one).__name__} {one!r}"
            )
    return ids


async def _start(tg: TaskGroup, plan: _Plan, controller_bind: str) -> LocalCluster:
    """Start the units, then the controller that knows them; register the metrics."""
    options, registry = plan.options, plan.registry
    durability, data_dir = options.get("durability", "memory"), options.get("data_dir")
    unit_dirs: list[str | None] = [None] * plan.num_storage_units
    if durability != "memory" and data_dir is not None:
        # each unit's cells under the controller's directory: the whole cluster restarted on
        # it comes back with its rows (units/unit-N: the same unit every time); checked first,
        # so that a missing or foreign one gets no units/ made in it
        check_controller_dir(data_dir)
        unit_dirs = [unit_data_dir(data_dir, i, create=True) for i in range(plan.num_storage_units)]
    elif data_dir is not None and plan.memory_cap is not None:
        # cells past the cap spill into a scratch directory of each unit's there (removed
        # when it stops), not into the system's temporary directory
        unit_dirs = [data_dir] * plan.num_storage_units
    units = [
        StorageServer(
            i,
            allow_pickle=options["allow_pickle"],
            metrics=Metrics(registry, "storage"),
            curve=options["curve"],
            shm_cap=plan.shm_cap,
            data_path=plan.data_path,
            device_cap=plan.device_cap,
            device_index=plan.device_indexes[i],
            host_id=plan.host_ids[i],
            memory_cap=plan.memory_cap,
            durability=durability if unit_dirs[i] is not None else "memory",
            data_dir=unit_dirs[i],
        )
        for i in range(plan.num_storage_units)
    ]
    addresses = {}
    for unit in units:
        addresses[unit.unit_id] = await tg.start(unit.serve, plan.endpoint(f"unit{unit.unit_id}"))
    state = ControllerState(addresses)
    state.capacity, state.capacity_global = plan.capacity, plan.capacity_global
    state.placer = Placer(plan.placement)
    state.unit_hosts = {u.unit_id: u.host_id for u in units}
    if plan.auto_clear:
        state.auto_clear[None] = tuple(dict.fromkeys(plan.auto_clear))
    controller = ControllerServer(
        state,
        **options,
        metrics=Metrics(registry, "controller"),
        local_units={u.unit_id: u for u in units},
    )
    # the program's own code may run on this loop: then the loop's CPU time per request says
    # nothing of what taking a request costs, and watchers are charged their handlers' time
    # only (`tq-async serve` and `background_cluster`, whose loops run nothing else, turn
    # the price back on)
    controller.watch.price_requests = False
    address = await tg.start(controller.serve, controller_bind)
    cluster = LocalCluster(address, controller, units)
    if registry is not None:
        from .._service._exposition import (  # (metrics on)
            controller_collector,
            register,
            serve_metrics,
            storage_collector,
        )

        plan.unregister += [
            register(registry, controller_collector(controller.state, lambda: controller.waiting)),
            register(registry, storage_collector({u.unit_id: u.state for u in units})),
        ]
        if plan.serve_metrics_on is not None:
            cluster.metrics_url, plan.stop_metrics = serve_metrics(
                registry, *metrics_address(plan.serve_metrics_on)
            )
    return cluster


def _unwrap(group: BaseExceptionGroup[BaseException], raised: list[BaseException]) -> None:
    """What `local_cluster`'s task group raised, as the caller should see it.

    The task group wraps what the caller's block raised: it is handed back as itself (the
    caller raises it after the cleanup: returns), so that ``except ValueError`` around ``async
    with local_cluster()`` works. A service that could not start (a taken port:
    `BrokenError`) comes out as itself too; anything else stays grouped.
    """
    if raised:
        if only_error(group, raised[0]):
            return
        raise group
    failed = first_tq_error(group)
    if failed is not None and only_error(group, failed):
        raise failed from None
    raise group


#: local_cluster's arguments that a Config also sets, with their defaults
_CONFIG_COVERS: dict[str, Any] = {
    "num_storage_units": 2,
    "sampler": None,
    "task_samplers": None,
    "host": "127.0.0.1",
    "bind": None,
    "allow_pickle": False,
    "serve_metrics_on": None,
    "admission": None,
    "curve": None,
    "capacity": None,
    "capacity_scope": "partition",
    "deadlines": None,
    "shm_cap": DEFAULT_SHM_CAP,
    "data_path": "auto",
    "placement": "auto",
    "host_id": None,
    "durability": "memory",
    "data_dir": None,
    "memory_cap": None,
}


def _check_no_overlap(**given: Any) -> None:
    for name, value in given.items():
        if value != _CONFIG_COVERS[name]:
            raise ConfigError(
                f"{name}: given both as an argument and by config=; set it in the Config "
                f"(config.replace({name}=...)) or drop config="
            )
