"""W4 child: a fresh interpreter that starts a cluster, puts one row, tears down, reports.

``python -m benchmarks._w4_child embedded|process`` prints one ``W4_RESULT={json}`` line.
Only the standard library is imported before ``import tq_async`` is timed.
"""

from __future__ import annotations

import json
import sys
from time import perf_counter
from typing import Any

from ._proc import ServeProcess, self_peak_rss_bytes


async def _start_put_stop(tq: Any, torch: Any) -> tuple[float, float]:
    """(start -> first put, teardown) of local_cluster + AsyncClient, in seconds."""
    t0 = perf_counter()
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.zeros(1)}, partition_id="p")
        t1 = perf_counter()
    return t1 - t0, perf_counter() - t1


async def _embedded(tq: Any, torch: Any) -> dict[str, float]:
    first, teardown = await _start_put_stop(tq, torch)
    warm, warm_teardown = await _start_put_stop(tq, torch)
    return {
        "start_to_first_put_s": first,
        "teardown_s": teardown,
        "warm_start_to_first_put_s": warm,
        "warm_teardown_s": warm_teardown,
    }


async def _connect_put(tq: Any, torch: Any, address: str) -> float:
    async with tq.AsyncClient.connect(address) as client:
        await client.put({"x": torch.zeros(1)}, partition_id="p")
        return perf_counter()


def main(argv: list[str]) -> int:
    kind = argv[0] if argv else "embedded"
    t0 = perf_counter()
    import anyio
    import torch

    import tq_async as tq

    # the client's modules load on first use (the services never import torch): a user
    # program has them imported before it starts a cluster, so they count as import time
    _ = tq.AsyncClient
    out: dict[str, Any] = {"import_s": perf_counter() - t0}
    if kind == "embedded":
        out.update(anyio.run(_embedded, tq, torch))
    elif kind == "process":
        t0 = perf_counter()
        server = ServeProcess(2)
        t_put = anyio.run(_connect_put, tq, torch, server.address)
        out["serve_ready_s"] = server.ready_s
        out["start_to_first_put_s"] = t_put - t0
        out["server_peak_rss"] = server.peak_rss()
        out["teardown_s"] = server.stop()
    else:
        print(f"unknown kind {kind!r}", file=sys.stderr)
        return 2
    out["peak_rss"] = self_peak_rss_bytes()
    print("W4_RESULT=" + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
