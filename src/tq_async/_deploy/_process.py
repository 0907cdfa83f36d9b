"""``tq-async serve`` as a process: the services of a role in this process's event loop, the
lines a launcher parses on stdout, and the signals that stop them."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup, TaskStatus

from .._errors import ConfigError
from .._logging import get_logger
from .._service._config import Config
from .._service._metrics import metrics_address
from .._service._serve import DEFAULT_BIND, serve_controller, serve_storage
from ._stderr import close_all

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["serve_all", "serve_role"]

log = get_logger(__name__)


def _stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop a service gracefully: SIGTERM, SIGINT and SIGHUP (its terminal
    closed, or a launcher went away: its default action killed the process with no clean
    stop), less SIGINT or SIGHUP when they came in ignored (``nohup``, a shell script's
    ``&``: the launcher wants the service to serve on through them, as Python does)."""
    kept = [s for s in (signal.SIGINT, signal.SIGHUP) if signal.getsignal(s) is not signal.SIG_IGN]
    return (signal.SIGTERM, *kept)


async def serve_all(config: Config) -> None:
    """The all-in-one ``tq-async serve``: a controller and its units until a signal."""
    from ._cluster import local_cluster  # (a role's process runs no cluster)

    stop = anyio.Event()
    async with (
        _stopped_by_signals(stop.set),
        local_cluster(transport="tcp", config=config) as cluster,
    ):
        cluster.controller.watch.price_requests = True  # this loop runs only services
        # The line a launcher parses (one write, flushed: a parent reading stdout sees it)
        lines = [f"TQ_ADDRESS={cluster.address}"]
        if cluster.metrics_url:
            lines.append(f"TQ_METRICS_URL={cluster.metrics_url}")
        _announce(lines)
        log.info("serving", address=cluster.address, storage_units=config.num_storage_units)
        await stop.wait()


def _announce(lines: Sequence[str]) -> None:
    """Print the lines a launcher parses on stdout, in one write. A launcher that closed its
    end (it read what it wanted, or went away) does not stop the service: that is logged,
    and stdout goes to /dev/null (nothing else is printed there)."""
    try:
        print("\n".join(lines), flush=True)
    except OSError as exc:  # BrokenPipeError (SIGPIPE is ignored), EIO
        log.warning("stdout is closed: the service serves on", lines=lines, error=str(exc))
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the unflushed lines go there at exit
        os.close(devnull)


@asynccontextmanager
async def _stopped_by_signals(stop: Callable[[], None]) -> AsyncIterator[None]:
    """Around a service's whole life: the first of `_stop_signals` calls ``stop`` (a graceful
    stop); a second one (Ctrl-C twice, a supervisor's second SIGTERM) while it stops ends the
    process at once, killed by that signal as without a handler (what was acknowledged at
    ``process``/``fsync`` is in the files already). Entered before any service starts: a
    signal during a unit's registration stops it cleanly instead of killing the process."""
    async with anyio.create_task_group() as tg:
        await tg.start(_on_signals, stop)
        yield
        tg.cancel_scope.cancel()


async def _on_signals(
    stop: Callable[[], None], *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    with anyio.open_signal_receiver(*_stop_signals()) as signals:
        task_status.started()
        async for signum in signals:
            log.info("stopping", signal=signal.Signals(signum).name)
            stop()
            break
        async for signum in signals:
            log.warning("a second signal: stopping at once", signal=signal.Signals(signum).name)
            close_all(idle=0.2)  # that line out first (unless stderr is not read)
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)


async def serve_role(args: argparse.Namespace, config: Config) -> None:
    """``tq-async serve controller`` / ``serve storage``: the role's service until a signal."""
    registry = None
    if config.metrics_on:
        from prometheus_client import CollectorRegistry  # (metrics on)

        registry = CollectorRegistry()
    stop_metrics: Callable[[], None] | None = None
    serving = anyio.CancelScope()
    async with _stopped_by_signals(serving.cancel):
        try:
            with serving:
                async with anyio.create_task_group() as tg:
                    lines = await _start_role(tg, args, config, registry)
                    if registry is not None and config.metrics_on is not None:
                        from .._service._exposition import serve_metrics

                        address = metrics_address(config.metrics_on)
                        url, stop_metrics = serve_metrics(registry, *address)
                        lines.append(f"TQ_METRICS_URL={url}")
                    # printed once everything serves: a launcher takes the first line for
                    # "started"
                    _announce(lines)
        finally:
            if stop_metrics is not None:
                await anyio.to_thread.run_sync(stop_metrics)


async def _start_role(
    tg: TaskGroup, args: argparse.Namespace, config: Config, registry: CollectorRegistry | None
) -> list[str]:
    """Start the role's service in ``tg``; the lines it prints (``TQ_ADDRESS=``/``TQ_UNIT=``)."""
    bind = config.bind or DEFAULT_BIND
    if args.role == "controller":
        address = await tg.start(
            partial(
                serve_controller,
                bind,
                advertise=args.advertise,
                metrics_registry=registry,
                config=config,
            )
        )
        return [f"TQ_ADDRESS={address}"]
    unit_id, address = await tg.start(
        partial(
            serve_storage,
            args.controller,
            bind,
            unit_id=args.unit_id,
            advertise=args.advertise,
            allow_pickle=config.allow_pickle,
            register_timeout=args.register_timeout,
            metrics_registry=registry,
            curve=config.load_curve(),
            shm_cap=config.shm_cap,
            data_path=config.data_path,
            device_cap=config.device_cap,
            device_index=_one_device_index(config.device_index),
            host_id=_one_host_id(config.host_id),
            durability=config.durability,
            data_dir=config.data_dir,
            memory_cap=config.memory_cap,
        )
    )
    return [f"TQ_UNIT={unit_id} {address}"]


def _one_host_id(host_id: str | list[str] | None) -> str | None:
    """A unit's host id from ``Config.host_id`` (a list names one per unit of a cluster)."""
    if isinstance(host_id, list):
        raise ConfigError("host_id: a storage unit alone takes one host id, not a list")
    return host_id


def _one_device_index(device_index: int | list[int]) -> int:
    """A unit's GPU index from ``Config.device_index`` (a list names one per unit)."""
    if isinstance(device_index, list):
        if len(device_index) != 1:
            raise ConfigError("device_index: a storage unit alone takes one GPU index, not a list")
        return device_index[0]
    return device_index
