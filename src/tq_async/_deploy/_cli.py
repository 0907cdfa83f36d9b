"""``tq-async``: run tq_async services as processes.

``tq-async serve`` runs a whole cluster (a controller and its storage units) in one process.
To spread a cluster over hosts, run one controller and any number of storage units, each
in its own process:

    tq-async serve controller --bind tcp://10.0.0.1:5555
    tq-async serve storage --controller tcp://10.0.0.1:5555 --bind tcp://10.0.0.2:0 --unit-id 0

Each process prints the one line a launcher parses (``TQ_ADDRESS=...`` for a controller,
``TQ_UNIT=<id> <address>`` for a unit) on stdout, logs on stderr, and runs until SIGTERM,
SIGINT or SIGHUP (a terminal that closes; unless the launcher had them ignored, as
``nohup`` does SIGHUP): each stops it gracefully.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any, Protocol, TextIO, cast

import anyio

from .._core._settings import Deadlines
from .._errors import AuthenticationError, ConfigError, InvalidRequestError, TQError
from .._logging import configure_logging
from .._paths._nixl import DATA_PATHS
from .._paths._shm import DEFAULT_SHM_CAP
from .._service._config import Config
from .._service._config import load_curve as load_curve
from .._service._serve import DEFAULT_BIND, check_address, first_tq_error, raise_fd_limit
from ._stderr import LogStream

__all__ = ["main"]


def _device_index_arg(text: str) -> int | list[int]:
    """``--device-index``: ``N``, or ``N,M,...`` (one per storage unit)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a GPU index or a comma-separated list of them, got {text!r}"
        ) from None
    return values[0] if len(values) == 1 else values


def _seconds_arg(text: str) -> float:
    """A flag's number of seconds: > 0 (``inf``: no limit)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not seconds > 0:  # also nan
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return seconds


def _address_arg(text: str) -> str:
    """``--controller``: an address a client can dial (``tcp://HOST:PORT``)."""
    try:
        check_address(text)
    except InvalidRequestError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _unit_id_arg(text: str) -> int:
    """``--unit-id``: an id >= 0."""
    try:
        unit_id = int(text)
    except ValueError:
        unit_id = -1
    if unit_id < 0:
        raise argparse.ArgumentTypeError(f"expected a unit id >= 0, got {text!r}")
    return unit_id


def _screens_arg(text: str) -> int:
    """``status --screens``: a count >= 1."""
    try:
        screens = int(text)
    except ValueError:
        screens = 0
    if screens < 1:
        raise argparse.ArgumentTypeError(f"expected a number of screens >= 1, got {text!r}")
    return screens


_FORMATTER = partial(argparse.HelpFormatter, max_help_position=32)

#: ``serve`` options that a Config also sets: flag dest -> Config attribute
_CONFIG_FLAGS = {
    "storage_units": "num_storage_units",
    "host": "host",
    "bind": "bind",
    "metrics_on": "metrics_on",
    "allow_pickle": "allow_pickle",
    "capacity": "capacity",
    "capacity_scope": "capacity_scope",
    "put_lease": "put_lease",
    "unit_suspend_after": "unit_suspend_after",
    "unit_lost_after": "unit_lost_after",
    "waiting_warning_after": "waiting_warning_after",
    "shm_cap": "shm_cap",
    "data_path": "data_path",
    "device_cap": "device_cap",
    "device_index": "device_index",
    "placement": "placement",
    "host_id": "host_id",
    "durability": "durability",
    "data_dir": "data_dir",
    "memory_cap": "memory_cap",
}

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(value: str) -> str:
    level = value.upper()
    if level not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"unknown log level {value!r}; choose from {', '.join(_LOG_LEVELS).lower()}"
        )
    return level


class _Options(Protocol):
    """Where the ``_add_*`` functions add options: ``serve``'s parser, or a `_RoleOptions`."""

    def add_argument(self, *flags: str, **kwargs: Any) -> argparse.Action: ...


class _RoleOptions:
    """A ``serve`` role's parser as the ``_add_*`` functions see it: the options of ``serve``
    they add there default to SUPPRESS, so ``serve --bind X controller`` and ``serve
    controller --bind X`` mean the same (the role's parse keeps what ``serve``'s found)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._parser = parser

    def add_argument(self, *flags: str, **kwargs: Any) -> argparse.Action:
        return self._parser.add_argument(*flags, **{**kwargs, "default": argparse.SUPPRESS})


def _add_shared(parser: _Options) -> None:
    """Options of ``serve`` that its roles take too."""
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="read the deployment from this TOML file (samplers, admission, capacity, ...; "
        "see examples/grpo.toml); options given on the command line override it",
    )
    parser.add_argument(
        "--bind",
        default=None,
        metavar="tcp://HOST:PORT",
        help=f"the address to bind (default: {DEFAULT_BIND}: a free port on loopback)",
    )
    parser.add_argument(
        "--metrics-on",
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics over HTTP here (port 0: any free port; default: off)",
    )
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        default=False,
        help="accept pickled columns (pickle runs code on load: trusted deployments only)",
    )
    parser.add_argument(
        "--curve-cert",
        default=None,
        metavar="FILE",
        help="encrypt every socket with this CURVE secret certificate (NAME.key_secret from "
        "zmq.auth.create_certificates); every service of a cluster uses the same one "
        "(default: no encryption)",
    )
    parser.add_argument(
        "--curve-allow",
        action="append",
        default=None,
        metavar="PATH",
        help="admit only clients whose public certificate is this file or in this directory "
        "(repeatable); without it any client that knows the public key gets in",
    )
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default="INFO",
        metavar="LEVEL",
        help="lowest level logged on stderr: debug, info, warning, error or critical, in "
        "any case (default: info)",
    )
    parser.add_argument(
        "--log-json",
        action="store_true",
        default=False,
        help="log one JSON object per line (default: coloured text on a terminal, plain "
        "text otherwise)",
    )


def _add_deadlines(parser: _Options) -> None:
    defaults = Deadlines()
    for flag, value, text in (
        (
            "--put-lease",
            defaults.put_lease,
            "reclaim the rows of a put neither committed nor renewed for this long (a dead "
            "producer's; live producers renew)",
        ),
        (
            "--unit-suspend-after",
            defaults.unit_suspend_after,
            "suspend a storage unit silent for this long: its rows wait, neither handed out "
            "nor lost",
        ),
        (
            "--unit-lost-after",
            defaults.unit_lost_after,
            "declare a suspended unit's rows lost after this long (a unit whose process is "
            "gone is lost at once)",
        ),
        (
            "--waiting-warning-after",
            defaults.waiting_warning_after,
            "warn once when a get_meta has waited this long on fields no row has, a partition "
            "that does not exist, or an unsealed partition that got no new rows",
        ),
    ):
        parser.add_argument(
            flag,
            type=float,
            default=value,
            metavar="SECONDS",
            help=f"{text} (default: {value:g})",
        )


def _add_shm(parser: _Options) -> None:
    parser.add_argument(
        "--shm-cap",
        type=int,
        default=DEFAULT_SHM_CAP,
        metavar="BYTES",
        help="shared memory per storage unit for clients on this host (0: off; at the cap "
        f"puts go over the socket; default: {DEFAULT_SHM_CAP})",
    )
    parser.add_argument(
        "--data-path",
        choices=DATA_PATHS,
        default="auto",
        help="what storage units offer besides the socket: auto (shared memory on this host, "
        "NIXL to other hosts when installed), shm, nixl or zmq (default: auto)",
    )
    parser.add_argument(
        "--device-cap",
        type=int,
        default=0,
        metavar="BYTES",
        help="GPU memory per storage unit for columns put from GPUs by clients on this host "
        "(moved device to device by CUDA IPC; 0: off, the default)",
    )
    parser.add_argument(
        "--device-index",
        type=_device_index_arg,
        default=0,
        metavar="N[,N...]",
        help="which GPU holds them (CUDA index; default: 0); one per storage unit, "
        "comma-separated, to give each unit of a multi-GPU host its own",
    )
    parser.add_argument(
        "--host-id",
        default=None,
        metavar="ID",
        help="the storage units' host id: units and clients with equal ids are on one host "
        "(default: $TQ_HOST_ID, the Ray node id, or this machine's boot id and host name)",
    )


def _add_durability(parser: _Options) -> None:
    parser.add_argument(
        "--durability",
        choices=["memory", "process", "fsync"],
        default="memory",
        help="memory: nothing survives a crash (the default, fastest); process: a change is "
        "acknowledged once it is in the OS's files (survives SIGKILL/OOM of the service); "
        "fsync: once it is on the disk (survives a machine crash). Storage units keep their "
        "cells on disk too (an all-in-one serve's under DIR/units/unit-N): see "
        "docs/guarantees.md",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="for --durability process/fsync: the controller's journal directory, or a "
        "`serve storage` unit's own directory (an existing directory: empty, or the one this "
        "service used before, which is then recovered)",
    )


def _add_memory_cap(parser: _Options) -> None:
    parser.add_argument(
        "--memory-cap",
        type=int,
        default=None,
        metavar="BYTES",
        help="most bytes of cells a storage unit keeps in memory; the least recently used "
        "ones past it go to disk (--data-dir; at --durability memory a scratch directory "
        "under it, or under the system's temporary directory without one) and are read "
        "back on demand (default: no bound)",
    )


def _add_capacity(parser: _Options) -> None:
    parser.add_argument(
        "--capacity",
        type=int,
        default=None,
        metavar="ROWS",
        help="backpressure: the most live rows per partition (see --capacity-scope); a put "
        "that does not fit waits until rows are cleared (default: unbounded)",
    )
    parser.add_argument(
        "--capacity-scope",
        choices=["partition", "global"],
        default="partition",
        help="--capacity counts rows per partition or in all partitions together "
        "(default: partition)",
    )
    parser.add_argument(
        "--placement",
        choices=["auto", "local", "round_robin"],
        default="auto",
        help="where a put's rows go: local (a unit on the producer's host, least-loaded), "
        "round_robin, or auto (local while units span several hosts; default: auto)",
    )


def _add_roles(serve: argparse.ArgumentParser) -> None:
    """``serve controller`` and ``serve storage``: one service each, for multi-host clusters."""
    # optional: without a role, `serve` runs every service in one process
    roles = serve.add_subparsers(dest="role", metavar="[ROLE]", title="roles (optional)")
    ctl = roles.add_parser(
        "controller",
        help="run a controller alone (storage units register with it)",
        formatter_class=_FORMATTER,
        description="Run a controller alone; prints TQ_ADDRESS=<address>.",
    )
    unit = roles.add_parser(
        "storage",
        help="run one storage unit and register it with a controller",
        formatter_class=_FORMATTER,
        description="Run one storage unit, register it; prints TQ_UNIT=<id> <address>.",
    )
    unit.add_argument(
        "--controller",
        required=True,
        type=_address_arg,
        metavar="ADDR",
        help="the controller's address",
    )
    unit.add_argument(
        "--unit-id",
        type=_unit_id_arg,
        default=None,
        metavar="N",
        help="this unit's id, unique in the cluster (default: the controller assigns one)",
    )
    unit.add_argument(
        "--register-timeout",
        type=_seconds_arg,
        default=30.0,
        metavar="SECONDS",
        help="give up if the controller does not answer the registration in this time "
        "(default: 30)",
    )
    _add_capacity(_RoleOptions(ctl))
    _add_durability(_RoleOptions(ctl))
    _add_durability(_RoleOptions(unit))
    _add_memory_cap(_RoleOptions(unit))
    _add_shm(_RoleOptions(unit))
    _add_deadlines(_RoleOptions(ctl))
    for role in (ctl, unit):
        role.add_argument(
            "--advertise",
            default=None,
            metavar="HOST",
            help="host name or IP that other hosts dial (needed with a 0.0.0.0 bind; a unit "
            "defaults to its IP on the route to the controller)",
        )
        _add_shared(_RoleOptions(role))


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tq-async",
        description="Run tq_async services as processes.",
        formatter_class=_FORMATTER,
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="run tq_async services until SIGTERM/SIGINT/SIGHUP",
        formatter_class=_FORMATTER,
        description=(
            "Without a role: a controller and --storage-units storage units in this process; "
            "prints TQ_ADDRESS=<address>. With a role (controller / storage): one service, "
            "for clusters spread over hosts. Logs go to stderr."
        ),
    )
    serve.add_argument(
        "--storage-units",
        type=int,
        default=2,
        metavar="N",
        help="number of storage units (default: 2)",
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="the interface the services bind (default: 127.0.0.1, loopback only)",
    )
    _add_shared(serve)
    _add_capacity(serve)
    _add_durability(serve)
    _add_memory_cap(serve)
    _add_deadlines(serve)
    _add_shm(serve)
    serve.set_defaults(role=None)

    _add_roles(serve)
    status = sub.add_parser(
        "status",
        help="show a running cluster: partitions, tasks, storage units, admission",
        formatter_class=_FORMATTER,
        description=(
            "Ask the controller at ADDRESS (and its storage units) for one screen: "
            "partitions (rows, fields, sealed; per task consumed / ready / leased), storage "
            "units (rows, bytes, shared memory, state), capacity, admission and the policy "
            "version."
        ),
    )
    status.add_argument("address", metavar="ADDRESS", help="the controller, e.g. tcp://host:5555")
    status.add_argument("--json", action="store_true", help="print JSON (one object per screen)")
    status.add_argument(
        "--watch", action="store_true", help="print again whenever the cluster changes (Ctrl-C)"
    )
    status.add_argument(
        "--curve-cert",
        default=None,
        metavar="FILE",
        help="for a cluster that uses CURVE: the services' secret certificate (the file "
        "`serve --curve-cert` was given); the command connects with the services' keys",
    )
    status.add_argument(
        "--screens",
        type=_screens_arg,
        default=None,
        metavar="N",
        help="with --watch: stop after N screens (default: until interrupted)",
    )
    return parser


def _version() -> str:
    from .. import __version__

    return __version__


class _VersionAction(argparse.Action):
    """``--version``: the version is looked up when asked for (``importlib.metadata`` costs
    ~15-25 ms, which every ``serve`` paid building its parser)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(f"{parser.prog} {_version()}", flush=True)
        parser.exit()


def _given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations of the options present on the command line (not defaults)."""
    saved: list[tuple[argparse.Action, object]] = []

    def suppress(p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    suppress(child)
            elif action.dest != "help":
                saved.append((action, action.default))
                action.default = argparse.SUPPRESS

    suppress(parser)
    try:
        return set(vars(parser.parse_args(argv)))
    finally:
        for action, value in saved:
            action.default = value


def config_from_args(args: argparse.Namespace, given: set[str]) -> Config:
    """The file of ``--config`` (or the defaults) with the options given on top.

    Raises:
        ConfigError: the file is bad, or an option makes the result invalid.
    """
    config = Config.from_toml(args.config) if args.config else Config()
    changes: dict[str, object] = {
        key: getattr(args, dest) for dest, key in _CONFIG_FLAGS.items() if dest in given
    }
    if "curve_cert" in given or "curve_allow" in given:
        cert = args.curve_cert if "curve_cert" in given else None
        allow = args.curve_allow if "curve_allow" in given else None
        if config.curve is not None:
            cert, allow = cert or config.curve.cert, allow or config.curve.allow
        if cert is None:
            raise ConfigError("--curve-allow needs --curve-cert (the services' keys)")
        changes["curve"] = {"cert": cert, "allow": allow or []}
    if not changes:
        return config
    return config.replace(source="command line", **changes)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tq-async`` command.

    Args:
        argv: the arguments (``sys.argv[1:]`` by default).

    Returns:
        The exit status: 0 after a clean stop (or the status shown), 1 when a service could
        not start (or ``status`` could not get the cluster's), 2 for a bad command line or
        configuration (a `ConfigError`, e.g. a ``--data-dir`` that is missing or another
        service's; for ``status`` too: an address without its scheme, a certificate that
        cannot be read).
    """
    parser = _build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.command == "status" and args.screens is not None and not args.watch:
        parser.error("--screens applies to --watch (status prints one screen without it)")
    # This process is ours: move the objects its imports leave behind out of the collector's
    # reach, so full collections do not walk them while serving. (It mattered most while the
    # services imported torch, ~300k objects: worst put 262 ms -> 9 ms; they no longer do.)
    # The library never does this in a user's process.
    gc.freeze()
    if args.command == "status":
        return _status(args)
    if args.command != "serve":  # pragma: no cover - argparse admits only these
        return 2
    if args.role is not None and (args.storage_units != 2 or args.host != "127.0.0.1"):
        parser.error("--storage-units and --host apply to the all-in-one `serve` only")
    # logs never block the service: a launcher may read a piped stderr late, or never
    stderr = LogStream(2, json=args.log_json)  # (sys.stderr is None when it was closed)
    configure_logging(args.log_level, json=args.log_json, stream=cast(TextIO, stderr))
    try:
        return _run_serve(parser, args, argv, stderr)
    finally:
        stderr.close()


def _run_serve(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str], stderr: LogStream
) -> int:
    """``serve``, its logging set up: its exit status."""
    try:
        config = config_from_args(args, _given(parser, argv))
        if args.role != "storage":  # (a unit's process needs no controller options)
            config.controller_options()  # import and call the factories: fail before binding
    except ConfigError as exc:
        print(f"tq-async: error: {exc}", file=stderr)
        return 2
    # a service holds a descriptor per client: the default soft limit (often 1,024) would
    # cap it long before the hard limit does (docs/deployment.md, "File descriptors")
    raise_fd_limit("serve" if args.role is None else args.role, config.num_storage_units)
    from ._process import serve_all, serve_role  # (each command imports what it runs)

    try:
        if args.role is None:
            anyio.run(serve_all, config)
        else:
            anyio.run(serve_role, args, config)
    except BaseException as exc:
        error = first_tq_error(exc)
        if error is None:
            raise
        print(f"tq-async: error: {error}", file=stderr)
        return 2 if isinstance(error, ConfigError) else 1  # (a bad --data-dir)
    return 0


def _status(args: argparse.Namespace) -> int:
    from ._status import run_status  # (each command imports what it runs)

    try:  # a bad command line: status 2, as for serve
        keys = load_curve(args.curve_cert, None)
        check_address(args.address)
    except InvalidRequestError as exc:
        print(f"tq-async: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        anyio.run(
            partial(
                run_status,
                args.address,
                as_json=args.json,
                watch=args.watch,
                screens=args.screens,
                curve=None if keys is None else keys.as_client(),
            )
        )
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # the reader stopped (`| head`): done, as a Ctrl-C is
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # what is still buffered goes there at exit
        os.close(devnull)
        return 0
    except TQError as exc:
        hint = ""
        if isinstance(exc, AuthenticationError) and args.curve_cert is None:
            hint = " (tq-async status: give the services' secret certificate, --curve-cert FILE)"
        print(f"tq-async: error: {exc}{hint}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
