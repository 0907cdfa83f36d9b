"""``tq-async``: run tq_async services as a process."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

import anyio
from prometheus_client import CollectorRegistry

from ._cluster import local_cluster

__all__ = ["main"]


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
    ) as cluster:
        # The one line a launcher parses; flushed so a parent reading our stdout sees it.
        print(f"TQ_ADDRESS={cluster.address}", flush=True)
        if cluster.metrics_url:
            print(f"TQ_METRICS_URL={cluster.metrics_url}", flush=True)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tq-async`` command."""
    parser = argparse.ArgumentParser(prog="tq-async", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="run a controller and storage units in this process until SIGTERM/SIGINT"
    )
    serve.add_argument("--storage-units", type=int, default=2, help="number of storage units")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (loopback)")
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
    args = parser.parse_args(argv)
    if args.command == "serve":
        anyio.run(_serve, args)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
