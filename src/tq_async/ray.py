"""Run a tq_async cluster as Ray actors, and attach to it from other Ray jobs.

Ray only *places and supervises* the services; it never carries data. Each actor runs the same
server code as `local_cluster` (a
`ControllerServer` or a `StorageServer`) in
the actor's asyncio event loop, bound to a ZMQ endpoint on its node. Clients anywhere — the
driver, Ray tasks, Ray actors, plain processes — connect to the returned address with
`AsyncClient` or `Client`, and tensors go straight from the
client's socket to the unit's, never through the object store:

    import ray
    import tq_async as tq
    import tq_async.ray

    ray.init()
    cluster = tq_async.ray.launch(num_storage_units=4, name="tq", namespace="rl")

    @ray.remote
    def rollout(address: str) -> None:
        with tq.Client.connect(address) as client:
            client.put(td, partition_id="train@0")

    ray.get(rollout.remote(cluster.address))
    ...
    cluster.shutdown()

Another Ray job attaches by name: ``tq_async.ray.attach("tq", namespace="rl").address``.

Needs the ``ray`` extra: ``pip install 'tq_async[ray]'``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import msgspec

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tq_async.ray needs Ray; install it with `pip install 'tq_async[ray]'`"
    ) from exc

from ._errors import BrokenError, ConfigError, InvalidRequestError, TQError, TQTimeoutError
from ._logging import get_logger
from ._service._config import Config, device_indexes
from ._service._serve import first_tq_error, serve_controller, serve_storage
from ._transport._hosts import ENV_HOST_ID
from ._transport._security import CurveServer
from .samplers import BaseSampler

__all__ = ["RayCluster", "attach", "launch", "select_nodes"]

log = get_logger(__name__)

#: ``placement`` keys understood in the mapping form.
_PLACEMENT_KEYS = frozenset({"nodes", "resources"})


class _ServiceActor:
    """One tq_async service in a Ray actor's event loop (wrapped by ``ray.remote`` below).

    ``run`` holds the service's task group for the actor's whole life, so the server is a
    structured task of a method call, not a stray background task; ``ready`` reports its
    address (or the error that stopped it) and ``stop`` ends ``run``.
    """

    def __init__(self) -> None:
        # Created lazily: they must belong to the actor's event loop, which __init__ may not run
        # in.
        self._started: anyio.Event | None = None
        self._stop: anyio.Event | None = None
        self._unit_id: int | None = None
        self._address: str | None = None
        self._error: TQError | None = None
        self._description: dict[str, Any] = {}

    def _events(self) -> tuple[anyio.Event, anyio.Event]:
        if self._started is None or self._stop is None:
            self._started, self._stop = anyio.Event(), anyio.Event()
        return self._started, self._stop

    async def run(self, role: str, host: str | None, options: dict[str, Any]) -> None:
        """Serve ``role`` (``"controller"`` or ``"storage"``) until `stop`."""
        started, stop = self._events()
        node_ip = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call,unused-ignore]
        bind = f"tcp://{host or node_ip}:0"
        # A wildcard host listens everywhere but must publish something routable.
        advertise = node_ip if host in ("0.0.0.0", "*") else None
        try:
            async with anyio.create_task_group() as tg:
                if role == "controller":
                    self._address = await tg.start(
                        partial(serve_controller, bind, advertise=advertise, **options)
                    )
                else:
                    self._unit_id, self._address = await tg.start(
                        partial(serve_storage, bind=bind, advertise=advertise, **options)
                    )
                started.set()
                await stop.wait()
                tg.cancel_scope.cancel()
        except BaseException as exc:
            self._error = first_tq_error(exc) or BrokenError(f"the {role} service failed: {exc}")
            started.set()
            raise

    async def ready(self) -> tuple[int | None, str]:
        """Wait until the service serves; returns ``(unit_id, address)``."""
        started, _ = self._events()
        await started.wait()
        if self._error is not None:
            raise self._error
        assert self._address is not None
        return self._unit_id, self._address

    async def stop(self) -> None:
        """End `run` (the service closes its socket)."""
        self._events()[1].set()

    async def set_description(self, description: dict[str, Any]) -> None:
        """Record what `attach` returns (the controller actor holds it)."""
        self._description = description

    async def describe(self) -> dict[str, Any]:
        """What `set_description` recorded."""
        return self._description

    async def get_config(self) -> dict[str, Any]:
        """TransferQueue's name for `describe` (its ``"address"`` is what
        ``tq_async.compat.StreamingDataset(config=...)`` reads)."""
        return self._description


_RemoteService = ray.remote(_ServiceActor)


@dataclass(frozen=True)
class RayCluster:
    """A tq_async cluster running as Ray actors (from `launch` or `attach`).

    It holds only names and addresses, so it pickles and can be passed to Ray tasks (though
    passing ``cluster.address``, a string, is all a client needs).

    Attributes:
        name: the controller actor's name; units are named ``f"{name}.unit{i}"``.
        namespace: the Ray namespace of the actors.
        address: the controller's endpoint: ``AsyncClient.connect(cluster.address)``.
        unit_addresses: each storage unit's endpoint, by unit id.
    """

    name: str
    namespace: str
    address: str
    unit_addresses: Mapping[int, str]
    _actor_names: tuple[str, ...] = field(default=(), repr=False)

    def shutdown(self, *, timeout: float = 30.0) -> None:
        """Stop and kill this cluster's actors (and no others); data in it is lost.

        Any handle can do it, including one from `attach`. Calling it again, or after
        the actors are gone, does nothing.

        Args:
            timeout: seconds to wait for the actors to stop gracefully and then to be gone.
        """
        actors = []
        for actor_name in self._actor_names:
            try:
                actors.append(ray.get_actor(actor_name, namespace=self.namespace))
            except ValueError:  # already gone
                continue
        _stop_and_kill(actors, timeout)
        log.info("tq_async cluster shut down", name=self.name, namespace=self.namespace)


def _stop_and_kill(actors: Sequence[Any], timeout: float) -> None:
    """Ask actors to stop their services, kill them, and wait until Ray reports them dead."""
    if not actors:
        return
    deadline = time.monotonic() + timeout
    stops = [a.stop.remote() for a in actors]
    # Graceful first (sockets closed in order); a dead or stuck actor is killed regardless.
    ray.wait(stops, num_returns=len(stops), timeout=max(0.0, min(5.0, timeout / 2)))
    for actor in actors:
        ray.kill(actor, no_restart=True)
    # A call to a killed actor fails once Ray has marked it dead (and dropped its name).
    for actor in actors:
        try:
            ray.get(actor.describe.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            continue
        except ray.exceptions.GetTimeoutError:
            log.warning("an actor was killed but is not reported dead yet", actor=str(actor))


def _alive_nodes() -> list[dict[str, Any]]:
    if not ray.is_initialized():
        raise InvalidRequestError(
            "Ray is not initialised in this process; call ray.init() (or ray.init(address=...) "
            "to join a running cluster) before tq_async.ray.launch/attach"
        )
    everything: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call,unused-ignore]
    nodes = [n for n in everything if n.get("Alive")]
    return nodes


def select_nodes(placement: str | Sequence[str] | Mapping[str, Any] | None) -> list[str]:
    """Node ids the services go to, in round-robin order (the controller on the first).

    Args:
        placement: ``None`` or ``"spread"``: every alive node (this process's node first);
            a sequence of node ids; or a mapping with ``"nodes"`` (node ids) and/or
            ``"resources"`` (e.g. ``{"tq_storage": 1}``: only nodes that declare at least
            that much of each resource).

    Returns:
        The selected node ids.

    Raises:
        InvalidRequestError: no alive node matches, a named node is not alive, or the
            placement is malformed.
    """
    nodes = _alive_nodes()
    by_id = {str(n["NodeID"]): n for n in nodes}
    here = str(ray.get_runtime_context().get_node_id())
    ordered = sorted(by_id, key=lambda nid: (nid != here, nid))
    wanted: Sequence[str] | None = None
    resources: Mapping[str, float] = {}
    if placement is None or placement == "spread":
        pass
    elif isinstance(placement, str):
        raise InvalidRequestError(
            f"placement {placement!r} is not understood; use 'spread', a list of node ids, or "
            "{'resources': {...}} / {'nodes': [...]}"
        )
    elif isinstance(placement, Mapping):
        unknown = set(placement) - _PLACEMENT_KEYS
        if unknown:
            raise InvalidRequestError(
                f"unknown placement keys {sorted(unknown)}; use 'nodes' and/or 'resources'"
            )
        wanted = placement.get("nodes")
        resources = placement.get("resources") or {}
        if not isinstance(resources, Mapping):
            raise InvalidRequestError(
                f"placement['resources'] must map resource names to amounts, got {resources!r}"
            )
    else:
        wanted = placement
    if wanted is not None:
        wanted = [str(w) for w in wanted]
        dead = [w for w in wanted if w not in by_id]
        if dead or not wanted:
            raise InvalidRequestError(
                f"placement names nodes that are not alive Ray nodes: {dead or wanted}; "
                f"alive nodes are {ordered} (ray.nodes())"
            )
        ordered = list(dict.fromkeys(wanted))
    if resources:
        ordered = [
            nid
            for nid in ordered
            if all(by_id[nid].get("Resources", {}).get(k, 0) >= v for k, v in resources.items())
        ]
        if not ordered:
            raise InvalidRequestError(
                f"no alive Ray node has the resources {dict(resources)}; start nodes with "
                f"`ray start --resources='{{\"{next(iter(resources))}\": 1}}'` (or "
                "ray.init(resources=...)), or change placement"
            )
    return ordered


def _unit_actor_name(name: str, unit_id: int) -> str:
    return f"{name}.unit{unit_id}"


def _resolve(ref: Any, deadline: float, what: str) -> Any:
    """``ray.get`` with a deadline, translating Ray's errors into tq_async's."""
    try:
        return ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
    except ray.exceptions.GetTimeoutError:
        raise TQTimeoutError(
            f"{what} did not start in time; check `ray status` for pending actors (the "
            "placement may need resources no node has free), or raise launch(timeout=...)"
        ) from None
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, TQError):
            raise type(cause)(f"{what}: {cause}") from exc
        raise BrokenError(f"{what} failed: {exc}") from exc
    except ray.exceptions.RayActorError as exc:
        raise BrokenError(f"{what} died while starting: {exc}") from exc


def launch(
    num_storage_units: int = 2,
    *,
    name: str = "tq_async",
    namespace: str = "tq_async",
    placement: str | Sequence[str] | Mapping[str, Any] | None = None,
    sampler: BaseSampler | None = None,
    allow_pickle: bool = False,
    curve: CurveServer | None = None,
    host: str | None = None,
    detached: bool = False,
    num_cpus: float = 0.0,
    actor_options: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    config: Config | None = None,
) -> RayCluster:
    """Start a controller and ``num_storage_units`` storage units as named Ray actors.

    The controller goes to the first selected node and unit ``i`` to node ``i % len(nodes)``
    (see `select_nodes`). Each service binds a free port on its node's IP
    (``ray.util.get_node_ip_address()``) and units register with the controller, exactly as
    ``tq-async serve storage`` does. Blocks until every service serves.

    Args:
        num_storage_units: how many storage units.
        name: the controller actor's name (units are ``f"{name}.unit{i}"``); unique per
            namespace. Other jobs `attach` by it.
        namespace: the Ray namespace of the actors.
        placement: where the services go: ``None``/``"spread"`` (round-robin over alive
            nodes), a list of node ids, or ``{"resources": {"tq_storage": 1}}`` (nodes that
            declare the resource) and/or ``{"nodes": [...]}``.
        sampler: the controller's sampler (shipped to its actor by Ray's pickling).
        allow_pickle: allow columns of arbitrary Python objects (trusted deployments only).
        curve: CURVE keys for every service (clients then connect with ``curve=``). Ray ships
            them to the actors, so the secret key is as safe as the Ray cluster is.
        host: the interface to bind instead of the node IP, e.g. ``"127.0.0.1"`` on a single
            node (``"0.0.0.0"`` binds every interface and publishes the node IP).
        detached: let the actors outlive this driver (``lifetime="detached"``); then some job
            must call `RayCluster.shutdown`. Otherwise they die with this driver.
        num_cpus: CPUs each actor reserves in Ray's scheduler (0: they never keep training
            tasks from being scheduled).
        actor_options: extra ``.options(...)`` for every actor (e.g. ``runtime_env``).
        timeout: seconds to wait for all services to serve.
        config: the deployment as a `Config` (the same one
            ``local_cluster(config=...)`` and ``tq-async serve --config`` take): storage
            units, samplers (built in the controller's actor, so their factories must be
            importable there), admission, capacity, pickle, leases, auto-clear and CURVE key
            files (read here, on the driver). ``sampler``, ``allow_pickle``, ``curve`` and
            ``num_storage_units`` must then be left at their defaults; the config's
            ``host``, ``bind`` and ``metrics_on`` do not apply (each actor binds its node).
            Its ``host_id`` (a string, or one per unit) names the units' hosts; without it
            each unit's host is ``"ray:<node id>"`` of its node, the id a client on that node
            resolves by itself.

    Returns:
        A `RayCluster`; connect clients to its ``address``.

    Raises:
        InvalidRequestError: Ray is not initialised, no node matches ``placement``, or
            ``name`` is taken in ``namespace``.
        TQTimeoutError: the services did not start within ``timeout`` (nothing is left
            running).
        BrokenError: a service failed to start (nothing is left running).
    """
    num_storage_units, allow_pickle, curve, controller_options = _fold_config(
        config, num_storage_units, sampler, allow_pickle, curve
    )
    if num_storage_units < 1:
        raise InvalidRequestError(f"num_storage_units must be >= 1, got {num_storage_units}")
    nodes = select_nodes(placement)
    _check_name_free(name, namespace)
    deadline = time.monotonic() + timeout
    options: dict[str, Any] = {
        "namespace": namespace,
        "num_cpus": num_cpus,
        "max_restarts": 0,
        **(actor_options or {}),
    }
    if detached:
        options["lifetime"] = "detached"
    actors: list[Any] = []
    try:
        # Every actor's process starts (and imports tq_async) at once; units are told the
        # controller's address once it serves.
        controller = _spawn(name, nodes[0], options)
        actors.append(controller)
        unit_names = [_unit_actor_name(name, i) for i in range(num_storage_units)]
        units = [_spawn(n, nodes[i % len(nodes)], options) for i, n in enumerate(unit_names)]
        actors.extend(units)
        controller.run.remote("controller", host, controller_options)
        _, address = _resolve(controller.ready.remote(), deadline, f"controller {name!r}")
        unit_options = {
            "controller": address,
            "allow_pickle": allow_pickle,
            "curve": curve,
            "register_timeout": max(1.0, min(30.0, deadline - time.monotonic())),
            **_unit_config(config),
        }
        per_unit = [
            {"host_id": host_id, "device_index": index}
            for host_id, index in zip(
                _unit_host_ids(config, nodes, num_storage_units, options),
                device_indexes(0 if config is None else config.device_index, num_storage_units),
                strict=True,
            )
        ]
        unit_addresses = _start_units(
            dict(zip(unit_names, units, strict=True)), host, unit_options, per_unit, deadline
        )
        cluster = RayCluster(name, namespace, str(address), unit_addresses, (*unit_names, name))
        _resolve(
            controller.set_description.remote(_describe(cluster)), deadline, f"controller {name!r}"
        )
    except BaseException:
        _stop_and_kill(actors, 10.0)
        raise
    log.info("tq_async cluster launched", name=name, namespace=namespace, address=address)
    return cluster


def _spawn(actor_name: str, node_id: str, options: Mapping[str, Any]) -> Any:
    """A service actor (not yet running a service) on ``node_id``."""
    return _RemoteService.options(
        name=actor_name,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        **options,
    ).remote()


def _unit_host_ids(
    config: Config | None,
    nodes: Sequence[str],
    num_storage_units: int,
    actor_options: Mapping[str, Any],
) -> list[str | None]:
    """Each storage unit's host id (locality, see `tq_async._transport._hosts`):
    ``config.host_id`` when set (a list: one per unit), else ``"ray:<node id>"`` of the node
    unit ``i`` is placed on (``nodes[i % len(nodes)]``: the id clients on that node resolve
    by themselves), unless the actors' ``runtime_env`` sets ``TQ_HOST_ID`` (None: the unit
    reads it).

    Raises:
        ConfigError: ``config.host_id`` is a list of another length than the units.
    """
    given = None if config is None else config.host_id
    if isinstance(given, list):
        if len(given) != num_storage_units:
            raise ConfigError(
                f"host_id: {len(given)} host ids for {num_storage_units} storage units; give "
                "one per unit, or one string for all"
            )
        return list(given)
    if given:
        return [given] * num_storage_units
    env = (actor_options.get("runtime_env") or {}).get("env_vars") or {}
    if ENV_HOST_ID in env:
        return [None] * num_storage_units
    return [f"ray:{nodes[i % len(nodes)]}" for i in range(num_storage_units)]


def _start_units(
    units: Mapping[str, Any],
    host: str | None,
    options: Mapping[str, Any],
    per_unit: Sequence[Mapping[str, Any]],
    deadline: float,
) -> dict[int, str]:
    """Start a storage unit in each actor (``{actor name: actor}``, unit ids in order; unit
    ``i`` with ``per_unit[i]``: its host id and GPU index); wait until every one serves.
    Returns ``{unit id: address}``."""
    for i, unit in enumerate(units.values()):
        unit.run.remote("storage", host, {**options, **per_unit[i], "unit_id": i})
    addresses: dict[int, str] = {}
    for unit_name, unit in units.items():
        unit_id, address = _resolve(unit.ready.remote(), deadline, f"storage unit {unit_name!r}")
        addresses[int(unit_id)] = str(address)
    return addresses


def _unit_config(config: Config | None) -> dict[str, Any]:
    """What a storage unit takes from ``config`` (its data paths): shared memory, the data
    path, the device arena."""
    if config is None:
        return {}
    return {
        "shm_cap": config.shm_cap,
        "data_path": config.data_path,
        "device_cap": config.device_cap,
    }


def _fold_config(
    config: Config | None,
    num_storage_units: int,
    sampler: BaseSampler | None,
    allow_pickle: bool,
    curve: CurveServer | None,
) -> tuple[int, bool, CurveServer | None, dict[str, Any]]:
    """``launch``'s arguments with ``config`` folded in, and the controller actor's options."""
    controller_options: dict[str, Any] = {
        "sampler": sampler,
        "allow_pickle": allow_pickle,
        "curve": curve,
    }
    if config is not None:
        given = {"num_storage_units": num_storage_units != 2, "sampler": sampler is not None}
        given.update(allow_pickle=allow_pickle, curve=curve is not None)
        for key, set_too in given.items():
            if set_too:
                raise ConfigError(
                    f"{key}: given both as an argument and by config=; set it in the Config "
                    "or drop config="
                )
        config.controller_options()  # import and call the factories here first: fail early
        num_storage_units, allow_pickle = config.num_storage_units, config.allow_pickle
        curve = config.load_curve()  # the key files are on this host, maybe not the actors'
        shipped = msgspec.structs.replace(config, curve=None)  # keys travel as keys
        controller_options = {"config": shipped, "curve": curve}
    return num_storage_units, allow_pickle, curve, controller_options


def _check_name_free(name: str, namespace: str) -> None:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        pass
    else:
        raise InvalidRequestError(
            f"a tq_async cluster named {name!r} already runs in Ray namespace {namespace!r}; "
            "attach() to it, shut it down, or launch with another name"
        )


def _describe(cluster: RayCluster) -> dict[str, Any]:
    return {
        "address": cluster.address,
        "units": {str(k): v for k, v in cluster.unit_addresses.items()},
        "actors": list(cluster._actor_names),
    }


def attach(
    name: str = "tq_async", namespace: str = "tq_async", *, timeout: float = 30.0
) -> RayCluster:
    """Find a cluster that `launch` started (possibly in another Ray job).

    Args:
        name: the ``name`` given to `launch`.
        namespace: the ``namespace`` given to `launch`.
        timeout: seconds to wait for the controller actor to answer.

    Returns:
        A `RayCluster` whose ``address`` clients connect to.

    Raises:
        InvalidRequestError: no such cluster (or Ray is not initialised).
        TQTimeoutError: the controller actor did not answer within ``timeout``.
    """
    _alive_nodes()  # raises a clear error when Ray is not initialised
    try:
        controller: Any = ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise InvalidRequestError(
            f"no tq_async cluster named {name!r} in Ray namespace {namespace!r}; check the "
            "name and namespace given to tq_async.ray.launch (and that it still runs)"
        ) from None
    deadline = time.monotonic() + timeout
    desc: dict[str, Any] = _resolve(controller.describe.remote(), deadline, f"cluster {name!r}")
    if not desc:
        raise InvalidRequestError(
            f"the cluster {name!r} in namespace {namespace!r} is still starting; attach again "
            "once launch() has returned"
        )
    return RayCluster(
        name,
        namespace,
        str(desc["address"]),
        {int(k): str(v) for k, v in desc["units"].items()},
        tuple(desc["actors"]),
    )
