"""One service on its own: a controller, or a storage unit that registers with a controller.

``local_cluster`` runs every service in one event loop. Past one host, each service runs where
its memory is (``tq-async serve controller`` / ``tq-async serve storage``, or a Ray actor from
`tq_async.ray`), and the pieces find each other through the controller: a unit binds,
then announces ``(unit_id, address)`` with a ``RegisterUnit`` request, and clients learn the
units from the controller (``Hello``), refreshing when they meet a unit id they do not know.
So the server code is the same everywhere; only who starts it differs.

Addresses: a service binds one address and *advertises* another when the bind address is a
wildcard (``tcp://0.0.0.0:PORT``): what clients on other hosts must dial is a routable host
name or IP, never ``0.0.0.0``.
"""

from __future__ import annotations

import resource
import socket
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from anyio.abc import TaskStatus

from .._errors import InvalidRequestError, ProtocolError, TQError, TQTimeoutError
from .._logging import get_logger
from .._paths._shm import DEFAULT_SHM_CAP
from .._transport._dealer import DealerConnection
from .._transport._endpoints import is_loopback
from .._transport._security import CurveClient, CurveServer
from .._wire._protocol import RegisterUnit
from ._config import Config
from ._metrics import Metrics

if sys.version_info < (3, 11):  # pragma: no cover - depends on the Python version
    from exceptiongroup import BaseExceptionGroup
if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..samplers import BaseSampler

__all__ = [
    "DEFAULT_BIND",
    "advertised_address",
    "check_address",
    "first_tq_error",
    "local_ip_towards",
    "register_unit",
    "serve_controller",
    "serve_storage",
    "warn_if_exposed",
]

log = get_logger(__name__)

#: where a service binds without ``--bind``: a free port on loopback
DEFAULT_BIND = "tcp://127.0.0.1:0"

#: ``RegisterUnit.unit_id`` that asks the controller to choose the id.
ASSIGN_UNIT_ID = -1

_WILDCARDS = frozenset({"*", "0.0.0.0", "::", "[::]", "[*]"})


def _split_tcp(address: str) -> tuple[str, str]:
    """``tcp://host:port`` -> ``(host, port)`` (brackets of an IPv6 host kept)."""
    host, sep, port = address[len("tcp://") :].rpartition(":")
    if not address.startswith("tcp://") or not sep or not host:
        raise InvalidRequestError(f"expected an address like tcp://HOST:PORT, got {address!r}")
    return host, port


def _is_wildcard(address: str) -> bool:
    return address.startswith("tcp://") and _split_tcp(address)[0] in _WILDCARDS


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def local_ip_towards(address: str) -> str:
    """The local IP this host would use to reach ``address`` (a ``tcp://`` endpoint).

    Connecting a UDP socket only asks the kernel for a route: no packet is sent.
    """
    if not address.startswith("tcp://"):
        return "127.0.0.1"
    host, port = _split_tcp(address)
    host = host.strip("[]")
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(
            f"cannot find a local address that routes to {address!r} ({exc}); "
            "pass an explicit advertise host"
        ) from exc


def advertised_address(
    bound: str, bind: str, advertise: str | None = None, *, towards: str | None = None
) -> str:
    """The address other hosts should dial for a socket bound at ``bind``.

    Args:
        bound: the address the socket reports after binding (its real port).
        bind: the address that was asked for (tells whether it was a wildcard).
        advertise: a host name or IP to publish instead of the bound host.
        towards: for a wildcard bind without ``advertise``, publish the local IP that routes
            to this address (the controller's); without it a wildcard bind is an error.

    Returns:
        ``bound`` with its host replaced as needed (``ipc://`` addresses are returned as is).

    Raises:
        InvalidRequestError: a wildcard bind with neither ``advertise`` nor ``towards``.
    """
    if not bound.startswith("tcp://"):
        return bound
    _, port = _split_tcp(bound)
    if advertise:
        return f"tcp://{_format_host(advertise)}:{port}"
    if _is_wildcard(bind):
        if towards is None:
            raise InvalidRequestError(
                f"{bind} listens on every interface, so it has no single address to publish; "
                "pass advertise=HOST (`--advertise HOST`): the name or IP that other hosts "
                "use to reach this one"
            )
        return f"tcp://{_format_host(local_ip_towards(towards))}:{port}"
    return bound


def first_tq_error(exc: BaseException) -> TQError | None:
    """The first `TQError` in ``exc`` or in its exception groups (task groups wrap)."""
    if isinstance(exc, TQError):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = first_tq_error(inner)
        if found is not None:
            return found
    return None


def only_error(group: BaseExceptionGroup[BaseException], exc: BaseException) -> bool:
    """Whether ``group`` holds nothing but ``exc`` (and the cancellations it caused)."""
    cancelled = anyio.get_cancelled_exc_class()
    _, rest = group.split(lambda e: e is exc or isinstance(e, cancelled))
    return rest is None


@contextmanager
def raised_as_itself() -> Iterator[None]:
    """Around a service's task group: the `TQError` that stopped it (a bind that failed, a
    registration nobody answered) comes out as itself, not in an ExceptionGroup."""
    try:
        yield
    except BaseExceptionGroup as group:
        failed = first_tq_error(group)
        if failed is not None and only_error(group, failed):
            raise failed from None
        raise


def warn_if_exposed(bind: str, role: str, curve: CurveServer | None = None) -> None:
    """Log a warning when ``bind`` is reachable from other hosts without CURVE protection.

    Args:
        bind: the address about to be bound.
        role: ``"controller"`` or ``"storage"`` (logged).
        curve: the service's CURVE keys, if any. With an allow-list of client keys nothing
            is logged; without one, any client that knows the server's public key gets in.
    """
    if is_loopback(bind):
        return
    if curve is None:
        log.warning(
            "binding a non-loopback interface: anyone who can reach it can read and write "
            "data; bind 127.0.0.1, keep the network private, or use CURVE keys",
            address=bind,
            role=role,
        )
    elif curve.allowed_clients is None:
        log.warning(
            "CURVE without an allow-list on a non-loopback interface: any client that knows "
            "the server's public key can read and write data; list the allowed client keys",
            address=bind,
            role=role,
        )


async def register_unit(
    controller: str,
    unit_id: int | None,
    address: str,
    *,
    timeout: float = 30.0,
    curve: CurveClient | None = None,
    host: str = "",
    instance: str = "",
) -> int:
    """Announce a storage unit to a controller; returns the unit's id.

    Args:
        controller: the controller's address.
        unit_id: the unit's id, or None to have the controller choose one.
        address: the address clients dial to reach the unit.
        timeout: seconds to wait for the controller to answer (ZMQ connects lazily, so a
            controller that starts within this time is found).
        curve: CURVE keys to reach a controller that requires them.
        host: the unit's host id (placement prefers units on a producer's host).
        instance: the unit's instance token (a unit restarted on its data_dir sends the one
            it had: its rows come back instead of being declared lost).

    Returns:
        The registered id (``unit_id``, or the one the controller chose).

    Raises:
        TQTimeoutError: the controller did not answer within ``timeout``.
        InvalidRequestError: the controller refused (e.g. the id belongs to another unit).
        ProtocolError: asked for an id, but the controller does not assign ids.
    """
    requested = ASSIGN_UNIT_ID if unit_id is None else unit_id
    conn = DealerConnection(controller, curve=curve)
    try:
        payload, _ = await conn.request(
            RegisterUnit(requested, address, host=host, instance=instance), timeout=timeout
        )
    except TQTimeoutError:
        raise TQTimeoutError(
            f"the controller at {controller} did not answer within {timeout} s; check that "
            "`tq-async serve controller` runs there, that this host can reach it and uses the "
            "same CURVE keys (if any), or raise the registration timeout"
        ) from None
    finally:
        conn.close()
    try:
        assigned = msgspec.msgpack.decode(payload, type=int | None)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"unexpected RegisterUnit reply from {controller}: {exc}") from exc
    if assigned is not None:
        return assigned
    if unit_id is None:
        raise ProtocolError(
            f"the controller at {controller} does not assign unit ids; give each unit an "
            "explicit id (`--unit-id N`)"
        )
    return unit_id


async def serve_controller(
    bind: str = "tcp://127.0.0.1:0",
    *,
    advertise: str | None = None,
    sampler: BaseSampler | None = None,
    allow_pickle: bool = False,
    metrics_registry: CollectorRegistry | None = None,
    curve: CurveServer | None = None,
    capacity: int | None = None,
    capacity_scope: str = "partition",
    placement: str = "auto",
    config: Config | None = None,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run a controller with no storage units of its own; units register themselves.

    Start it with ``address = await tg.start(serve_controller, bind)``; it serves until
    cancelled.

    Args:
        bind: the address to bind (``tcp://HOST:PORT``; port 0 picks a free one).
        advertise: the host to publish; required when ``bind`` is a wildcard.
        sampler: the controller's sampler (`SequentialSampler` by default).
        allow_pickle: allow columns of arbitrary Python objects (trusted deployments only).
        metrics_registry: record metrics here (off by default).
        curve: CURVE keys: encrypt the socket, admit only allowed client keys; the storage
            units must use the same service keypair.
        capacity: backpressure, as for `local_cluster`: the most live rows
            per partition (``capacity_scope="global"``: in all partitions together); a put
            that does not fit waits. None: unbounded.
        placement: where a put's new rows go: ``"auto"``, ``"local"`` or
            ``"round_robin"`` (see `Config`).
        config: a `Config` that supplies the controller's settings instead
            of the arguments above (samplers, admission, pickle, capacity, leases,
            auto-clear, CURVE files); an explicit ``curve`` still wins over its ``[curve]``.

    Raises:
        BrokenError: ``bind`` could not be bound.
        InvalidRequestError: a wildcard ``bind`` without ``advertise``, or a bad capacity.
        ConfigError: ``config`` is bad (e.g. a sampler factory that does not import).
    """
    if _is_wildcard(bind) and not advertise:
        advertised_address(bind, bind, None)  # raises the explanatory error
    options: dict[str, Any] = {"sampler": sampler, "allow_pickle": allow_pickle, "curve": curve}
    # each role imports its own service: a unit's process never imports the controller's core
    from .._controller._server import ControllerServer
    from .._core._effects import check_capacity
    from .._core._placement import Placer
    from .._core._state import ControllerState

    state = ControllerState()
    if config is not None:
        options = {**config.controller_options(), **({"curve": curve} if curve else {})}
        capacity, capacity_scope = config.capacity, config.capacity_scope
        placement = config.placement
        if config.auto_clear_tasks:
            state.auto_clear[None] = tuple(dict.fromkeys(config.auto_clear_tasks))
    warn_if_exposed(bind, "controller", options["curve"])
    state.capacity, state.capacity_global = check_capacity(capacity, capacity_scope)
    state.placer = Placer(placement)
    controller = ControllerServer(state, **options, metrics=Metrics(metrics_registry, "controller"))
    with raised_as_itself(), ExitStack() as collectors:  # (unregistered once it stops)
        async with anyio.create_task_group() as tg:
            bound: str = await tg.start(controller.serve, bind)
            address = advertised_address(bound, bind, advertise)
            if metrics_registry is not None:
                from ._exposition import controller_collector, register  # (metrics on)

                gauges = controller_collector(controller.state, lambda: controller.waiting)
                collectors.callback(register(metrics_registry, gauges))
            log.info("controller serving", address=address)
            task_status.started(address)


async def serve_storage(
    controller: str,
    bind: str = "tcp://127.0.0.1:0",
    *,
    unit_id: int | None = None,
    advertise: str | None = None,
    allow_pickle: bool = False,
    register_timeout: float = 30.0,
    metrics_registry: CollectorRegistry | None = None,
    curve: CurveServer | None = None,
    shm_cap: int = DEFAULT_SHM_CAP,
    data_path: str = "auto",
    device_cap: int = 0,
    device_index: int = 0,
    host_id: str | None = None,
    durability: str = "memory",
    data_dir: str | None = None,
    memory_cap: int | None = None,
    task_status: TaskStatus[tuple[int, str]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run one storage unit: bind, register with ``controller``, serve until cancelled.

    Start it with ``unit_id, address = await tg.start(serve_storage, controller, bind)``.

    Args:
        controller: the controller's address.
        bind: the address to bind (port 0 picks a free one).
        unit_id: this unit's id (unique in the cluster), or None to have the controller
            choose one.
        advertise: the host to publish; with a wildcard ``bind`` and no ``advertise``, the
            local IP that routes to the controller is published.
        allow_pickle: accept pickled columns (trusted deployments only).
        register_timeout: seconds to wait for the controller to answer the registration.
        metrics_registry: record metrics here (off by default).
        curve: the cluster's service keypair (the controller's): encrypts this unit's socket
            and its registration.
        shm_cap: bytes of shared memory for clients on this host (0: off).
        data_path: what the unit offers besides the socket (``"auto"``, ``"shm"``,
            ``"nixl"``, ``"zmq"``; see `Config`).
        device_cap: bytes of GPU memory for cells put from GPUs on this host (0: none).
        device_index: which GPU holds them.
        host_id: this unit's host id (default: ``$TQ_HOST_ID``, the Ray node id or the
            machine's; see ``docs/deployment.md``, "Locality").
        durability: ``"memory"`` (cells in memory only), ``"process"`` or ``"fsync"``: the
            unit keeps its cells in segment files under ``data_dir`` too, and a unit started
            again on that directory comes back with them (see ``docs/guarantees.md``).
        data_dir: the unit's own directory (at ``memory``: where spilled cells go).
        memory_cap: most bytes of cells in memory; colder ones go to disk (None: no bound).

    Raises:
        BrokenError: ``bind`` could not be bound.
        TQTimeoutError: the controller did not answer within ``register_timeout``.
        InvalidRequestError: the controller refused the registration.
        ConfigError: a bad ``data_dir`` (missing, another unit's, in use).
    """
    if unit_id is not None and unit_id < 0:
        raise InvalidRequestError(f"unit_id must be >= 0, got {unit_id}")
    check_address(controller)
    warn_if_exposed(bind, "storage", curve)
    from .._storage._server import StorageServer  # (see serve_controller)

    unit = StorageServer(
        -1 if unit_id is None else unit_id,
        allow_pickle=allow_pickle,
        metrics=Metrics(metrics_registry, "storage"),
        curve=curve,
        shm_cap=shm_cap,
        data_path=data_path,
        device_cap=device_cap,
        device_index=device_index,
        host_id=host_id,
        durability=durability,
        data_dir=data_dir,
        memory_cap=memory_cap,
    )
    durable = durability != "memory"
    with raised_as_itself(), ExitStack() as collectors:  # (unregistered once it stops)
        async with anyio.create_task_group() as tg:
            bound: str = await tg.start(unit.serve, bind)
            address = advertised_address(bound, bind, advertise, towards=controller)
            unit.registered(
                await register_unit(
                    controller,
                    unit.unit_id if unit.unit_id >= 0 else None,
                    address,
                    timeout=register_timeout,
                    curve=curve.as_client() if curve is not None else None,
                    host=unit.host_id,
                    instance=unit.state.instance if durable else "",
                )
            )
            if metrics_registry is not None:
                from ._exposition import register, storage_collector  # (metrics on)

                gauges = storage_collector({unit.unit_id: unit.state})
                collectors.callback(register(metrics_registry, gauges))
            log.info(
                "storage unit serving",
                unit_id=unit.unit_id,
                address=address,
                controller=controller,
            )
            task_status.started((unit.unit_id, address))


#: descriptors a serving process keeps besides its clients' (listeners, arenas, log files)
FD_RESERVE = 256


def raise_fd_limit(role: str = "serve", units: int = 0) -> tuple[int, int]:
    """Raise this process's ``RLIMIT_NOFILE`` soft limit to its hard limit, and say how many
    clients that holds.

    A service holds one descriptor per connected client and endpoint: a unit one per client
    (its Unix socket or TCP connection), a controller one, the all-in-one ``serve`` with
    ``units`` units ``1 + units`` per client, plus one per client process per unit (a pidfd,
    shared memory). Many hosts start processes at a soft limit of 1,024, which caps a
    controller below 1,000 clients although the hard limit allows far more; raising the soft
    limit up to the hard one needs no privilege. The hard limit is the administrator's
    (``ulimit -Hn``, systemd ``LimitNOFILE=``, ``docker run --ulimit nofile=``).

    Returns:
        The (soft, hard) limits now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # an unlimited hard limit still stops at the kernel's nr_open (1,048,576 by default)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the file-descriptor limit", error=str(exc), soft=soft)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    per_client = 1 + units if role == "serve" else 1
    clients = max(0, (soft - FD_RESERVE) // per_client)
    log.info("file-descriptor limit", soft=soft, hard=hard, clients_held=clients)
    return soft, hard


#: schemes ZMQ can connect to
_SCHEMES = ("tcp://", "ipc://", "inproc://")


def check_address(address: str) -> None:
    """Raise a clear error for an address ZMQ cannot connect to (before anything is sent).

    Raises:
        InvalidRequestError: not a string, no ``tcp://`` / ``ipc://`` / ``inproc://``
            scheme (with a hint at the likely fix), or a ``tcp://`` address without a port
            from 1 to 65535 (ZMQ takes 70000 and waits for ever: "nothing listens").
    """
    if not isinstance(address, str):
        raise InvalidRequestError(
            f"address must be a string like 'tcp://127.0.0.1:5555', got {type(address).__name__}"
        )
    if address.startswith("tcp://"):
        _check_port(address)
        return
    if address.startswith(_SCHEMES):
        return
    if "://" in address:
        raise InvalidRequestError(
            f"address {address!r} has an unsupported scheme; use tcp://HOST:PORT (or the "
            "ipc:// address local_cluster reports)"
        )
    raise InvalidRequestError(
        f"address {address!r} has no scheme; did you mean 'tcp://{address}'? (the "
        "TQ_ADDRESS=... line `tq-async serve` prints is the whole address)"
    )


def _check_port(address: str) -> None:
    """``tcp://HOST:PORT`` with PORT a number from 1 to 65535 (IPv6 hosts in brackets)."""
    _, colon, port = address[len("tcp://") :].rpartition(":")
    if colon and port.isdigit() and 0 < int(port) <= 65535:
        return
    raise InvalidRequestError(
        f"address {address!r} needs a port from 1 to 65535 after the host: write it as "
        "tcp://HOST:PORT (the TQ_ADDRESS=... line `tq-async serve` prints)"
    )
