"""Forked DataLoaders under an open client, many times: does any run hang?

Each run: a parent holding an open blocking ``Client`` (and the services on a background
thread of the same process, as ``tq_async.compat.init()`` does) forks 4 rank processes; each
rank uses the inherited client, then reads a sealed partition through a
``StreamingDataLoader`` with 2 forked workers, and uses the client again. A run that does not
finish within ``--timeout`` seconds counts as hung (its processes are killed).

    python -m benchmarks.fork_stress --runs 100
    python -m benchmarks.fork_stress --first-batch   # 4 ranks x 2 workers: fork vs spawn
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import time
from typing import Any

RANKS, WORKERS, ROWS = 4, 2, 16
_FORK = mp.get_context("fork")


def _rank(address: str, rank: int, client: Any, out: Any) -> None:
    import tq_async as tq

    client.list_partitions()
    dataset = tq.StreamingDataset(address, ["x"], 2, 2, "p", f"task{rank}", prefetch=2)
    loader = tq.StreamingDataLoader(dataset, num_workers=WORKERS, timeout=60)
    got = sorted(int(v) for td, _ in loader for v in td["x"].view(-1).tolist())
    client.list_partitions()
    out.put((rank, got))


def one_run(address: str, timeout: float) -> str:
    """ "ok", "hung" or "wrong" for one run."""
    import torch

    import tq_async as tq

    with tq.Client.connect(address) as client:
        client.put({"x": torch.arange(ROWS)}, partition_id="p")
        client.seal("p")
        out = _FORK.Queue()
        procs = [_FORK.Process(target=_rank, args=(address, r, client, out)) for r in range(RANKS)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        got: dict[int, list[int]] = {}
        status = "ok"
        try:
            for _ in procs:
                got.update([out.get(timeout=max(0.1, deadline - time.monotonic()))])
        except queue.Empty:
            status = "hung"
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join()
                status = "hung"
        if status == "ok" and got != {r: list(range(ROWS)) for r in range(RANKS)}:
            status = "wrong"
        client.clear_partition("p")
        return status


def _first(address: str, rank: int, method: str, t0: float, out: Any) -> None:
    import tq_async as tq

    dataset = tq.StreamingDataset(address, ["x"], 2, 2, "first", f"{method}{rank}")
    loader = tq.StreamingDataLoader(dataset, num_workers=WORKERS, multiprocessing_context=method)
    next(iter(loader))
    out.put(time.perf_counter() - t0)


def first_batch(address: str, method: str) -> float:
    """Seconds until every one of 4 forked ranks has its first batch from 2 ``method``
    workers each."""
    out = _FORK.Queue()
    t0 = time.perf_counter()
    procs = [_FORK.Process(target=_first, args=(address, r, method, t0, out)) for r in range(RANKS)]
    for p in procs:
        p.start()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    return max(got)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--first-batch", action="store_true", help="fork vs spawn, once each")
    args = parser.parse_args()
    import torch

    import tq_async as tq

    if args.first_batch:
        with (
            tq.background_cluster(num_storage_units=2) as cluster,
            tq.Client.connect(cluster.address) as client,
        ):
            client.put({"x": torch.arange(64)}, partition_id="first")
            client.seal("first")
            for method in ("fork", "spawn"):
                s = first_batch(cluster.address, method)
                print(f"4 ranks x {WORKERS} {method} workers: first batch in {s:.2f} s")
        return

    counts: dict[str, int] = {}
    t0 = time.perf_counter()
    with tq.background_cluster(num_storage_units=2) as cluster:
        for i in range(args.runs):
            status = one_run(cluster.address, args.timeout)
            counts[status] = counts.get(status, 0) + 1
            print(f"run {i + 1}/{args.runs}: {status}", flush=True)
    print(
        f"{counts.get('ok', 0)} of {args.runs} runs finished ({counts}); "
        f"{time.perf_counter() - t0:.0f} s in all",
        flush=True,
    )


if __name__ == "__main__":
    main()
