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

import asyncio
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

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
from ._storage._dir_marker import unit_data_dir
from ._transport._hosts import ENV_HOST_ID
from ._transport._security import CurveServer

if TYPE_CHECKING:  # (a storage unit's actor never imports the samplers)
    from .samplers import BaseSampler

__all__ = ["RayCluster", "attach", "launch", "select_nodes"]

log = get_logger(__name__)

#: actor options `launch` sets itself, and what to pass it instead
_LAUNCH_SETS = {
    "name": "name=",
    "namespace": "namespace=",
    "scheduling_strategy": "placement=",
    "get_if_exists": "nothing: launch refuses a name taken; attach() to that cluster",
}

#: ``placement`` keys understood in the mapping form.
_PLACEMENT_KEYS = frozenset({"nodes", "resources"})

#: the handles of the actors `launch` started in this process, by (namespace, name): Ray ends
#: an actor (not detached) once its owner holds no handle to it, and the cluster must live
#: until `RayCluster.shutdown` or the end of this process, through restarts of its actors
_LAUNCHED: dict[tuple[str, str], list[Any]] = {}


#: the file in a durable controller's ``data_dir`` where its actor keeps what a restart needs:
#: the address it served at (a restarted controller binds that port again, so clients and
#: units find it where they left it) and what `attach` returns
RAY_STATE_FILE = "tq-async-ray.json"


class _ServiceActor:
    """One tq_async service in a Ray actor's event loop (wrapped by ``ray.remote`` below).

    The constructor gets everything the service needs and starts it, as a task of the actor's
    event loop that holds the service's task group for the actor's whole life: Ray re-runs
    only the constructor when it restarts an actor (``max_restarts``), never a method call, so
    a restarted actor serves again by itself (on a Ray that runs an async actor's constructor
    outside its loop, at the first call of any method instead). ``ready`` reports the address
    (or the error that stopped the service) and ``stop`` ends it.

    A storage unit asks the controller's actor for the controller's address (``controller``,
    the actor's name and namespace), so a unit restarted later finds it too: by name, as a
    handle among a restartable actor's arguments is an object Ray may lose before a restart
    (ray-project/ray#53727; Ray logs an error for it). With a durable level a unit keeps
    its cells in ``unit_data_dir(data_dir, unit_id)`` and the controller its state file
    (`RAY_STATE_FILE`) in its journal's ``data_dir``.
    """

    def __init__(
        self,
        role: str,
        host: str | None,
        options: dict[str, Any],
        controller: tuple[str, str] | None = None,
        data_dir: str | None = None,
    ) -> None:
        self._role, self._host, self._options = role, host, options
        self._controller, self._data_dir = controller, data_dir
        # Created by _start: they must belong to the actor's event loop.
        self._started: anyio.Event | None = None
        self._stop: anyio.Event | None = None
        self._unit_id: int | None = None
        self._address: str | None = None
        self._error: TQError | None = None
        self._description: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None
        self._restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # the first method call starts it
        self._start()

    def _start(self) -> None:
        if self._task is None:
            self._started, self._stop = anyio.Event(), anyio.Event()
            self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        """Serve the role until `stop`; record the error that stopped it, if any."""
        assert self._started is not None
        assert self._stop is not None
        role = self._role
        try:
            node_ip = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call,unused-ignore]
            bind = f"tcp://{self._host or node_ip}:{self._port()}"
            # A wildcard host listens everywhere but must publish something routable.
            advertise = node_ip if self._host in ("0.0.0.0", "*") else None
            async with anyio.create_task_group() as tg:
                if role == "controller":
                    self._address = await tg.start(
                        partial(serve_controller, bind, advertise=advertise, **self._options)
                    )
                    self._save_state()
                else:
                    self._unit_id, self._address = await tg.start(
                        partial(serve_storage, bind=bind, advertise=advertise, **await self._unit())
                    )
                    if self._restarted:  # on a new port: what attach returns follows
                        await self._tell_controller(self._unit_id, self._address)
                self._started.set()
                log.info(
                    "tq_async service actor serving",
                    role=role,
                    unit_id=self._unit_id,
                    address=self._address,
                    restarted=self._restarted,
                )
                await self._stop.wait()
                tg.cancel_scope.cancel()
        except Exception as exc:
            self._error = first_tq_error(exc) or BrokenError(f"the {role} service failed: {exc}")
            log.error(
                "tq_async service actor stopped", role=role, error=str(self._error), exc_info=exc
            )
        finally:
            self._started.set()

    def _state_path(self) -> str | None:
        """The controller's `RAY_STATE_FILE` (durable levels only)."""
        if self._role != "controller" or self._data_dir is None:
            return None
        return os.path.join(self._data_dir, RAY_STATE_FILE)

    def _port(self) -> int:
        """The port to bind: any (0), but a restarted durable controller's former one."""
        path = self._state_path()
        if path is None or not self._restarted:
            return 0
        try:
            state = _read_json(path)
            self._description = dict(state.get("description") or {})
            return int(str(state["address"]).rpartition(":")[2])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning(
                "a restarted controller actor does not know its former address; it binds a "
                "new port, which clients and units do not know (launch the cluster again)",
                path=path,
                error=str(exc),
            )
            return 0

    def _save_state(self) -> None:
        path = self._state_path()
        if path is not None:
            _write_json(path, {"address": self._address, "description": self._description})

    def _controller_actor(self) -> Any:
        assert self._controller is not None
        name, namespace = self._controller
        return ray.get_actor(name, namespace=namespace)

    async def _tell_controller(self, unit_id: int, address: str) -> None:
        """Have the controller's actor record a restarted unit's new address."""
        try:
            await self._controller_actor().unit_moved.remote(unit_id, address)
        except (ValueError, ray.exceptions.RayError) as exc:  # gone: nothing to tell
            log.warning("cannot record a unit's new address", unit_id=unit_id, error=str(exc))

    async def _unit(self) -> dict[str, Any]:
        """``serve_storage``'s arguments: the controller's address, asked of its actor (it
        answers once it serves), and the unit's directory (made here, on the unit's node)."""
        _, controller = await self._controller_actor().ready.remote()
        options = {**self._options, "controller": controller}
        if self._data_dir is not None:
            options["data_dir"] = unit_data_dir(self._data_dir, options["unit_id"], create=True)
        return options

    async def ready(self) -> tuple[int | None, str]:
        """Wait until the service serves; returns ``(unit_id, address)``."""
        self._start()
        assert self._started is not None
        await self._started.wait()
        if self._error is not None:
            raise self._error
        assert self._address is not None
        return self._unit_id, self._address

    async def info(self) -> dict[str, Any]:
        """The actor's process id, role, address (None until it serves) and whether Ray
        restarted it."""
        return {
            "pid": os.getpid(),
            "role": self._role,
            "unit_id": self._unit_id,
            "address": self._address,
            "restarted": self._restarted,
        }

    async def stop(self) -> None:
        """End the service (it closes its socket)."""
        if self._task is None or self._started is None or self._stop is None:
            return
        self._stop.set()
        if not self._started.is_set():  # still starting (a unit waiting for the controller)
            self._task.cancel()
        await asyncio.wait([self._task])

    async def set_description(self, description: dict[str, Any]) -> None:
        """Record what `attach` returns (the controller actor holds it; a durable one in its
        state file too, for a restart)."""
        self._description = description
        self._save_state()

    async def unit_moved(self, unit_id: int, address: str) -> None:
        """Record a storage unit's address after Ray restarted it (on a new port)."""
        units = self._description.get("units")
        if units is not None:
            units[str(unit_id)] = address
            self._save_state()

    async def describe(self) -> dict[str, Any]:
        """What `set_description` recorded."""
        return self._description

    async def get_config(self) -> dict[str, Any]:
        """TransferQueue's name for `describe` (its ``"address"`` is what
        ``tq_async.compat.StreamingDataset(config=...)`` reads)."""
        return self._description


def _read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        loaded = json.load(f)
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} holds no JSON object")
    return loaded


def _write_json(path: str, value: dict[str, Any]) -> None:
    """Replace ``path`` with ``value`` whole (a crash leaves the old file or the new one)."""
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


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
        unit_addresses: each storage unit's endpoint, by unit id, when this handle was made
            (a unit Ray restarted serves on a new port: `attach` gives the current ones).
    """

    name: str
    namespace: str
    address: str
    unit_addresses: Mapping[int, str]
    _actor_names: tuple[str, ...] = field(default=(), repr=False)

    def shutdown(self, *, timeout: float = 30.0) -> None:
        """Stop and kill this cluster's actors (and no others); the data in it is lost, but at
        ``process`` / ``fsync``, where a cluster launched again on its ``data_dir`` comes back
        with its rows.

        Any handle can do it, including one from `attach`. Calling it again, or after
        the actors are gone, does nothing; so does calling it once ``ray.shutdown()`` ended
        this process's Ray session (which ended the actors launched from it; a detached
        cluster lives on: ``ray.init(address=...)`` and shut it down then).

        Args:
            timeout: seconds to wait for the actors to stop gracefully and then to be gone.
        """
        if not ray.is_initialized():  # never start a session (Ray's calls would) to stop one
            _LAUNCHED.pop((self.namespace, self.name), None)
            log.info(
                "tq_async cluster not shut down: Ray is not initialised in this process",
                name=self.name,
                namespace=self.namespace,
            )
            return
        actors = []
        for actor_name in self._actor_names:
            try:
                actors.append(ray.get_actor(actor_name, namespace=self.namespace))
            except ValueError:  # already gone
                continue
        _stop_and_kill(actors, timeout)
        _LAUNCHED.pop((self.namespace, self.name), None)
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
        if not isinstance(resources, Mapping) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in resources.values()
        ):
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
        actor_options: extra ``.options(...)`` for every actor (e.g. ``runtime_env``);
            not ``name``, ``namespace`` or ``scheduling_strategy``, which launch sets from
            ``name``, ``namespace`` and ``placement``.
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
            resolves by itself. Its ``durability`` (``"process"`` / ``"fsync"``) and
            ``data_dir`` make the cluster durable: ``data_dir`` is an absolute path on the
            nodes themselves (a local disk of each), the controller's journal directory on
            its node (it must exist there) and unit ``i``'s cells go to
            ``data_dir/units/unit-i`` on unit ``i``'s node (made by the unit). Ray then
            restarts a dead actor (``max_restarts=-1`` unless ``actor_options`` says
            otherwise) on its node, where it finds its directory: a unit comes back with its
            rows (on a new port; clients follow), the controller with its state on its former
            address. Its ``memory_cap`` reaches the units (at ``memory`` they spill under
            ``data_dir`` when it is given, an absolute path on their nodes).

    Returns:
        A `RayCluster`; connect clients to its ``address``.

    Raises:
        InvalidRequestError: Ray is not initialised, no node matches ``placement``,
            ``name`` is taken in ``namespace``, or an argument is malformed (an empty
            ``name``, a ``num_storage_units`` that is not an int >= 1, ...).
        ConfigError: ``config`` is bad, e.g. a relative ``data_dir``, or one that is
            missing on the controller's node (raised when the controller starts).
        TQTimeoutError: the services did not start within ``timeout`` (nothing is left
            running).
        BrokenError: a service failed to start (nothing is left running).
    """
    num_storage_units, allow_pickle, curve, controller_options = _fold_config(
        config, num_storage_units, sampler, allow_pickle, curve
    )
    _check_arguments(name, namespace, num_storage_units, actor_options or {})
    nodes = select_nodes(placement)
    _check_name_free(name, namespace)
    deadline = time.monotonic() + timeout
    data_dir = _actor_data_dir(config)
    options: dict[str, Any] = {
        "namespace": namespace,
        "num_cpus": num_cpus,
        "max_restarts": 0 if data_dir is None else -1,
        **(actor_options or {}),
    }
    if detached:
        options["lifetime"] = "detached"
    actors: list[Any] = []
    try:
        # Every actor's process starts (and imports tq_async) at once; each unit asks the
        # controller's actor for its address once it serves.
        controller = _spawn(
            name, nodes[0], options, ("controller", host, controller_options, None, data_dir)
        )
        actors.append(controller)
        unit_options = {
            "allow_pickle": allow_pickle,
            "curve": curve,
            "register_timeout": max(1.0, min(30.0, timeout)),
            **_unit_config(config),
        }
        per_unit = zip(
            _unit_host_ids(config, nodes, num_storage_units, options),
            device_indexes(0 if config is None else config.device_index, num_storage_units),
            strict=True,
        )
        unit_names = [_unit_actor_name(name, i) for i in range(num_storage_units)]
        for i, (host_id, index) in enumerate(per_unit):
            args = {**unit_options, "host_id": host_id, "device_index": index, "unit_id": i}
            spec = ("storage", host, args, (name, namespace), data_dir)
            actors.append(_spawn(unit_names[i], nodes[i % len(nodes)], options, spec))
        _, address = _resolve(controller.ready.remote(), deadline, f"controller {name!r}")
        unit_addresses: dict[int, str] = {}
        for unit_name, unit in zip(unit_names, actors[1:], strict=True):
            unit_id, unit_address = _resolve(
                unit.ready.remote(), deadline, f"storage unit {unit_name!r}"
            )
            unit_addresses[int(unit_id)] = str(unit_address)
        cluster = RayCluster(name, namespace, str(address), unit_addresses, (*unit_names, name))
        _resolve(
            controller.set_description.remote(_describe(cluster)), deadline, f"controller {name!r}"
        )
    except BaseException:
        _stop_and_kill(actors, 10.0)
        raise
    _LAUNCHED[namespace, name] = actors
    log.info(
        "tq_async cluster launched",
        name=name,
        namespace=namespace,
        address=address,
        durability="memory" if config is None else config.durability,
    )
    return cluster


def _check_arguments(
    name: Any, namespace: Any, num_storage_units: Any, actor_options: Mapping[str, Any]
) -> None:
    """Refuse what Ray would refuse with its own errors, or take for no name at all, and
    actor options that would override what launch sets (actors in another namespace than
    the cluster's would escape `RayCluster.shutdown` and `attach`)."""
    for what, value in (("name", name), ("namespace", namespace)):
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(
                f"{what} must be a non-empty string (the Ray actors' {what}), got {value!r}"
            )
    units = num_storage_units
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise InvalidRequestError(f"num_storage_units must be an int >= 1, got {units!r}")
    for key, instead in _LAUNCH_SETS.items():
        if key in actor_options:
            raise InvalidRequestError(
                f"actor_options[{key!r}] is launch's to set; pass {instead} (or drop it)"
            )


def _actor_data_dir(config: Config | None) -> str | None:
    """The durable directory the actors use (None: memory level).

    With a durable level Ray restarts a dead actor (on its node: the affinity is hard), and
    the restarted service finds its directory; at memory a restart would find nothing.

    Raises:
        ConfigError: a relative ``data_dir`` (the actors do not run in this directory).
    """
    data_dir = None if config is None or config.durability == "memory" else config.data_dir
    return None if data_dir is None else _on_the_nodes(data_dir)


def _on_the_nodes(data_dir: str) -> str:
    """``data_dir``, a path the actors open on their nodes: it must be absolute.

    Raises:
        ConfigError: a relative ``data_dir`` (the actors do not run in this directory).
    """
    if not os.path.isabs(data_dir):
        raise ConfigError(
            f"data_dir: {data_dir!r} is relative, and Ray's actors do not run in this "
            "process's directory; give an absolute path, valid on the nodes the actors run on"
        )
    return data_dir


def _spawn(
    actor_name: str,
    node_id: str,
    options: Mapping[str, Any],
    spec: tuple[str, str | None, dict[str, Any], tuple[str, str] | None, str | None],
) -> Any:
    """A service actor on ``node_id`` that starts serving: ``spec`` is its constructor's
    arguments (role, host, the service's options, the controller actor's name and namespace,
    data_dir).

    Raises:
        InvalidRequestError: ``actor_name`` was taken since `_check_name_free` (another
            driver launched a cluster of that name meanwhile).
    """
    try:
        return _RemoteService.options(
            name=actor_name,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            **options,
        ).remote(*spec)
    except ValueError as exc:  # Ray's ActorAlreadyExistsError is one
        if _taken(actor_name, options["namespace"]):
            raise _name_taken_error(actor_name, options["namespace"]) from exc
        raise


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


def _unit_config(config: Config | None) -> dict[str, Any]:
    """What a storage unit takes from ``config``: its data paths (shared memory, the data
    path, the device arena), its memory cap and its durability level (its directory is
    ``unit_data_dir(config.data_dir, unit_id)``, made by the unit's actor; at ``memory`` with
    a ``memory_cap``, ``data_dir`` is where its spill files go, as in ``local_cluster``)."""
    if config is None:
        return {}
    options: dict[str, Any] = {
        "shm_cap": config.shm_cap,
        "data_path": config.data_path,
        "device_cap": config.device_cap,
        "memory_cap": config.memory_cap,
        "durability": config.durability,
    }
    spills = config.durability == "memory" and config.memory_cap is not None
    if spills and config.data_dir is not None:
        options["data_dir"] = _on_the_nodes(config.data_dir)  # not the node's $TMPDIR
    return options


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
    if _taken(name, namespace):
        raise _name_taken_error(name, namespace)


def _taken(name: str, namespace: str) -> bool:
    """Whether an actor of that name is alive in ``namespace``."""
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


def _name_taken_error(name: str, namespace: str) -> InvalidRequestError:
    return InvalidRequestError(
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
