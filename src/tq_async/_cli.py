"""``tq-async``: run tq_async services as processes.

``tq-async serve`` runs a whole cluster (a controller and its storage units) in one process.
To spread a cluster over hosts, run one controller and any number of storage units, each
in its own process::

    tq-async serve controller --bind tcp://10.0.0.1:5555
    tq-async serve storage --controller tcp://10.0.0.1:5555 --bind tcp://10.0.0.2:0 --unit-id 0

Each process prints the one line a launcher parses (``TQ_ADDRESS=...`` for a controller,
``TQ_UNIT=<id> <address>`` for a unit) on stdout, logs on stderr, and runs until SIGTERM or
SIGINT.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
from collections.abc import Callable, Sequence
from functools import partial

import anyio
import structlog
import zmq.auth
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry

from ._cluster import local_cluster
from ._errors import InvalidRequestError
from ._logging import configure_logging
from ._metrics import serve_metrics
from ._security import CurveServer
from ._serve import first_tq_error, serve_controller, serve_storage
from ._storage import DEFAULT_SHM_CAP

__all__ = ["main"]

log = structlog.get_logger(__name__)

_DEFAULT_BIND = "tcp://127.0.0.1:0"


async def _serve(args: argparse.Namespace) -> None:
    registry = CollectorRegistry() if args.metrics_on else None
    async with local_cluster(
        num_storage_units=args.storage_units,
        host=args.host,
        bind=args.bind,
        transport="tcp",
        allow_pickle=args.allow_pickle,
        metrics_registry=registry,
        serve_metrics_on=args.metrics_on,
        curve=load_curve(args.curve_cert, args.curve_allow),
        capacity=args.capacity,
        capacity_scope=args.capacity_scope,
        shm_cap=args.shm_cap,
    ) as cluster:
        # The one line a launcher parses; flushed so a parent reading our stdout sees it.
        print(f"TQ_ADDRESS={cluster.address}", flush=True)
        if cluster.metrics_url:
            print(f"TQ_METRICS_URL={cluster.metrics_url}", flush=True)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break


def load_curve(cert: str | None, allow: Sequence[str] | None) -> CurveServer | None:
    """CURVE keys from ZMQ certificate files (``zmq.auth.create_certificates`` makes them).

    Args:
        cert: the services' secret certificate (``NAME.key_secret``); None: no CURVE.
        allow: public certificates (files, or directories of ``*.key`` files) of the clients
            let in; None: any client that knows the services' public key.

    Raises:
        InvalidRequestError: a file is missing or holds no key of the needed kind.
    """
    if cert is None:
        if allow:
            raise InvalidRequestError("--curve-allow needs --curve-cert (the services' keys)")
        return None
    try:
        public, secret = zmq.auth.load_certificate(cert)
        allowed: list[bytes] | None = None
        if allow:
            allowed = []
            for path in allow:
                if os.path.isdir(path):
                    allowed.extend(zmq.auth.load_certificates(path))
                else:
                    allowed.append(zmq.auth.load_certificate(path)[0])
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"cannot read CURVE certificates: {exc}") from exc
    if secret is None:
        raise InvalidRequestError(
            f"{cert} holds no secret key; pass the NAME.key_secret file that "
            "zmq.auth.create_certificates(dir, NAME) wrote"
        )
    return CurveServer(public, secret, allowed_clients=allowed)


async def _cancel_on_signal(
    scope: anyio.CancelScope, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    # Started (not start_soon) so the handler is installed before any service starts: a
    # SIGTERM during a unit's registration stops it cleanly instead of killing the process.
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            log.info("stopping", signal=signal.Signals(signum).name)
            scope.cancel()
            return


async def _serve_role(args: argparse.Namespace) -> None:
    registry = CollectorRegistry() if args.metrics_on else None
    bind = args.bind or _DEFAULT_BIND
    curve = load_curve(args.curve_cert, args.curve_allow)
    stop_metrics: Callable[[], None] | None = None
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(_cancel_on_signal, tg.cancel_scope)
            if args.role == "controller":
                address = await tg.start(
                    partial(
                        serve_controller,
                        bind,
                        advertise=args.advertise,
                        allow_pickle=args.allow_pickle,
                        metrics_registry=registry,
                        curve=curve,
                        capacity=args.capacity,
                        capacity_scope=args.capacity_scope,
                    )
                )
                print(f"TQ_ADDRESS={address}", flush=True)
            else:
                unit_id, address = await tg.start(
                    partial(
                        serve_storage,
                        args.controller,
                        bind,
                        unit_id=args.unit_id,
                        advertise=args.advertise,
                        allow_pickle=args.allow_pickle,
                        register_timeout=args.register_timeout,
                        metrics_registry=registry,
                        curve=curve,
                        shm_cap=args.shm_cap,
                    )
                )
                print(f"TQ_UNIT={unit_id} {address}", flush=True)
            if registry is not None:
                host, _, port = args.metrics_on.rpartition(":")
                url, stop_metrics = serve_metrics(registry, host or "127.0.0.1", int(port or 0))
                print(f"TQ_METRICS_URL={url}", flush=True)
    finally:
        if stop_metrics is not None:
            await anyio.to_thread.run_sync(stop_metrics)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tq-async", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run tq_async services until SIGTERM/SIGINT",
        description=(
            "Without a role: a controller and --storage-units storage units in this process. "
            "With a role (controller / storage): one service, for clusters spread over hosts."
        ),
    )
    serve.add_argument("--storage-units", type=int, default=2, help="number of storage units")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (loopback)")
    # Options that a role also takes are given SUPPRESS defaults in the role's parser, so
    # `serve --bind X controller` and `serve controller --bind X` mean the same.
    serve.add_argument(
        "--bind", default=None, help="controller bind address, e.g. tcp://127.0.0.1:5555"
    )
    serve.add_argument(
        "--metrics-on",
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics over HTTP here (port 0: any free port)",
    )
    serve.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept pickled columns (pickle runs code on load: trusted deployments only)",
    )
    serve.add_argument(
        "--curve-cert",
        default=None,
        metavar="FILE",
        help="encrypt every socket with this CURVE secret certificate (NAME.key_secret from "
        "zmq.auth.create_certificates); every service of a cluster uses the same one",
    )
    serve.add_argument(
        "--curve-allow",
        action="append",
        default=None,
        metavar="PATH",
        help="admit only clients whose public certificate is this file or in this directory "
        "(repeatable); without it any client that knows the public key gets in",
    )
    serve.add_argument(
        "--capacity",
        type=int,
        default=None,
        metavar="ROWS",
        help="backpressure: the most live rows per partition (see --capacity-scope); a put "
        "that does not fit waits until rows are cleared (default: unbounded)",
    )
    serve.add_argument(
        "--capacity-scope",
        choices=["partition", "global"],
        default="partition",
        help="--capacity counts rows per partition (default) or in all partitions together",
    )
    serve.add_argument(
        "--shm-cap",
        type=int,
        default=DEFAULT_SHM_CAP,
        metavar="BYTES",
        help="shared memory per storage unit for clients on this host (0: off; at the cap "
        "puts go over the socket; default %(default)s)",
    )
    serve.add_argument("--log-level", default="INFO", help="lowest log level shown on stderr")
    serve.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    serve.set_defaults(role=None)

    roles = serve.add_subparsers(dest="role", metavar="{controller,storage}")
    ctl = roles.add_parser(
        "controller",
        help="run a controller alone (storage units register with it)",
        description="Run a controller alone; prints TQ_ADDRESS=<address>.",
    )
    unit = roles.add_parser(
        "storage",
        help="run one storage unit and register it with a controller",
        description="Run one storage unit, register it; prints TQ_UNIT=<id> <address>.",
    )
    unit.add_argument(
        "--controller", required=True, metavar="ADDR", help="the controller's address"
    )
    unit.add_argument(
        "--unit-id",
        type=int,
        default=None,
        metavar="N",
        help="this unit's id, unique in the cluster (default: the controller assigns one)",
    )
    unit.add_argument("--shm-cap", type=int, default=argparse.SUPPRESS, metavar="BYTES")
    unit.add_argument(
        "--register-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="give up if the controller does not answer the registration in this time",
    )
    ctl.add_argument("--capacity", type=int, default=argparse.SUPPRESS, metavar="ROWS")
    ctl.add_argument("--capacity-scope", choices=["partition", "global"], default=argparse.SUPPRESS)
    for role in (ctl, unit):
        role.add_argument(
            "--bind",
            default=argparse.SUPPRESS,
            metavar="tcp://HOST:PORT",
            help=f"address to bind (default {_DEFAULT_BIND}; port 0: any free port)",
        )
        role.add_argument(
            "--advertise",
            default=None,
            metavar="HOST",
            help="host name or IP that other hosts dial (needed with a 0.0.0.0 bind; a unit "
            "defaults to its IP on the route to the controller)",
        )
        role.add_argument("--metrics-on", default=argparse.SUPPRESS, metavar="HOST:PORT")
        role.add_argument("--allow-pickle", action="store_true", default=argparse.SUPPRESS)
        role.add_argument("--curve-cert", default=argparse.SUPPRESS, metavar="FILE")
        role.add_argument(
            "--curve-allow", action="append", default=argparse.SUPPRESS, metavar="PATH"
        )
        role.add_argument("--log-level", default=argparse.SUPPRESS)
        role.add_argument("--log-json", action="store_true", default=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tq-async`` command.

    Args:
        argv: the arguments (``sys.argv[1:]`` by default).

    Returns:
        The exit status: 0 after a clean stop, 1 when a service could not start.
    """
    parser = _build_parser()
    args = parser.parse_args(argv)
    # This process is ours: move the objects its imports leave behind out of the collector's
    # reach, so full collections do not walk them while serving. (It mattered most while the
    # services imported torch, ~300k objects: worst put 262 ms -> 9 ms; they no longer do.)
    # The library never does this in a user's process.
    gc.freeze()
    if args.command != "serve":  # pragma: no cover - argparse admits only "serve"
        return 2
    if args.role is not None and (args.storage_units != 2 or args.host != "127.0.0.1"):
        parser.error("--storage-units and --host apply to the all-in-one `serve` only")
    try:
        configure_logging(args.log_level, json=args.log_json)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        anyio.run(_serve if args.role is None else _serve_role, args)
    except BaseException as exc:
        error = first_tq_error(exc)
        if error is None:
            raise
        print(f"tq-async: error: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
