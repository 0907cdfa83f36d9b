"""NIXL against ZMQ TCP between a client and a storage unit process, on loopback.

    python -m benchmarks.nixl_vs_zmq                # W1 dense batch, UCX's own transports
    UCX_TLS=tcp python -m benchmarks.nixl_vs_zmq    # UCX over TCP only
    python -m benchmarks.nixl_vs_zmq --big 1024     # also a 1 GiB batch: client RSS growth
    python -m benchmarks.nixl_vs_zmq --per-call     # the paths alternated call by call
    python -m benchmarks.nixl_vs_zmq --per-call --breakdown  # + where a NIXL read's time goes

A controller and one storage unit run as ``tq-async serve`` processes (the unit with an arena
big enough for the batches); this process is the client. Each data path — ``zmq`` (the socket,
``same_host=False``: as if the unit were on another host) and ``nixl`` (forced) — puts the W1
dense batch (256 x 2048 int64 ``input_ids`` and ``attention_mask``, f32 ``reward``: 8.39 MB)
``--rounds`` times, each put timed alone, then reads each back with ``get_data`` (checked
equal outside the timing). Prints medians in GB/s and the NIXL/ZMQ ratio of the medians and
of the best calls (on a loaded host the best calls say more about a path's ceiling). UCX_TLS
applies to both processes (the unit inherits this environment).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import anyio


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _batch(rows: int, seqlen: int) -> tuple[dict[str, Any], int]:
    import torch

    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 150_000, (rows, seqlen), dtype=torch.int64, generator=g),
        "attention_mask": (torch.rand(rows, seqlen, generator=g) > 0.1).to(torch.int64),
        "reward": torch.randn(rows, generator=g),
    }
    return batch, sum(t.numel() * t.element_size() for t in batch.values())


def _start(argv: list[str], line: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tq_async._deploy._cli", "serve", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    for text in proc.stdout:
        if text.startswith(line):
            return proc, text[len(line) :].strip()
    raise RuntimeError(f"`tq-async serve {' '.join(argv)}` exited with {proc.wait()}")


async def _measure(address: str, path: str, rounds: int, big_mb: int) -> dict[str, Any]:
    import torch

    import tq_async as tq
    from tq_async._paths import _nixl

    batch, nbytes = _batch(256, 2048)
    opts: dict[str, Any] = {"same_host": False} if path == "zmq" else {}
    out: dict[str, Any] = {}
    async with tq.AsyncClient.connect(
        address, data_path=path, request_timeout=120, **opts
    ) as client:
        for _ in range(5):  # connections, agents, registrations, the unit's arena pages
            await client.get_data(await client.put(batch, partition_id="warm"))
        puts, gets, metas = [], [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            metas.append(await client.put(batch, partition_id="w1"))
            puts.append(time.perf_counter() - t0)
        for meta in metas:
            t0 = time.perf_counter()
            td = await client.get_data(meta)
            gets.append(time.perf_counter() - t0)
            assert torch.equal(td["input_ids"], batch["input_ids"])
        out["put_gbps"] = nbytes / statistics.median(puts) / 1e9
        out["get_gbps"] = nbytes / statistics.median(gets) / 1e9
        out["put_best"] = nbytes / min(puts) / 1e9
        out["get_best"] = nbytes / min(gets) / 1e9
        await client.clear_partition("w1")
        await client.clear_partition("warm")
        if big_mb:
            big = {"x": torch.randint(0, 1 << 30, (big_mb, 1 << 17), dtype=torch.int64)}
            size = big_mb << 20
            del td
            before = _rss_mb()
            t0 = time.perf_counter()
            meta = await client.put(big, partition_id="big")
            put_s = time.perf_counter() - t0
            after_put = _rss_mb()
            t0 = time.perf_counter()
            got = await client.get_data(meta)
            get_s = time.perf_counter() - t0
            after_get = _rss_mb()
            assert torch.equal(got["x"], big["x"])
            out["big"] = (
                f"{big_mb} MiB: put {size / put_s / 1e9:.2f} GB/s, RSS +{after_put - before:.0f} "
                f"MiB; get {size / get_s / 1e9:.2f} GB/s, RSS +{after_get - after_put:.0f} MiB "
                f"(the result itself is {big_mb} MiB): growth {(after_get - before) / big_mb:.2f}"
                "x the batch"
            )
            await client.clear_partition("big")
        stats = next(iter((await client.storage_stats()).values()))
        out["nixl_puts"], out["nixl_reads"] = stats["nixl_puts"], stats["nixl_reads"]
        out["fallbacks"] = dict(_nixl.fallbacks)
    return out


def _time_calls(times: dict[str, list[float]]) -> None:
    """Time the client's NIXL read (READ plus the copy out of staging) and its transfers."""
    from tq_async._paths import _nixl

    def timed(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times.setdefault(name, []).append(time.perf_counter() - t0)

        return call

    agent = _nixl.ClientAgent
    agent.read = timed("read", agent.read)  # type: ignore[method-assign]
    agent.write = timed("write", agent.write)  # type: ignore[method-assign]
    agent._xfer = timed("transfer", agent._xfer)  # type: ignore[method-assign]


async def _per_call(address: str, rounds: int, breakdown: bool = False) -> None:
    """Both paths open at once, alternated call by call (get, then put): on a host shared
    with other jobs, drift then hits both paths alike. With ``breakdown``, also the medians
    of the parts of a NIXL read (its READ, the copy out of staging, the rest)."""
    import torch

    import tq_async as tq

    parts: dict[str, list[float]] = {}
    if breakdown:
        _time_calls(parts)

    batch, nbytes = _batch(256, 2048)
    times: dict[tuple[str, str], list[float]] = {}
    async with (
        tq.AsyncClient.connect(
            address, data_path="zmq", same_host=False, request_timeout=120
        ) as zmq_client,
        tq.AsyncClient.connect(address, data_path="nixl", request_timeout=120) as nixl_client,
    ):
        clients = {"zmq": zmq_client, "nixl": nixl_client}
        metas = {}
        for path, client in clients.items():
            metas[path] = await client.put(batch, partition_id=f"r-{path}")
            td = await client.get_data(metas[path])
            assert torch.equal(td["input_ids"], batch["input_ids"])
            for _ in range(4):  # connections, agents, registrations, the arena's pages
                await client.get_data(metas[path])
                await client.clear_samples(await client.put(batch, partition_id=f"w-{path}"))
        parts.clear()
        for _ in range(rounds):
            for path, client in clients.items():
                t0 = time.perf_counter()
                await client.get_data(metas[path])
                times.setdefault((path, "get"), []).append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                meta = await client.put(batch, partition_id=f"w-{path}")
                times.setdefault((path, "put"), []).append(time.perf_counter() - t0)
                await client.clear_samples(meta)
    for op in ("put", "get"):
        z, n = times[("zmq", op)], times[("nixl", op)]
        print(
            f"per call, {op}: zmq {nbytes / statistics.median(z) / 1e9:.2f} GB/s, nixl "
            f"{nbytes / statistics.median(n) / 1e9:.2f} GB/s: NIXL/ZMQ "
            f"{statistics.median(z) / statistics.median(n):.2f}x "
            f"(best calls {min(z) / min(n):.2f}x)"
        )
    if breakdown:
        # every NIXL get is one read; puts add their WRITEs to "transfer": the READs are the
        # first transfer of each (get, put) pair, as the loop above alternates them
        ms = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
        one_each = len(parts["transfer"]) == 2 * rounds
        reads = parts["transfer"][0::2] if one_each else []
        writes = parts["transfer"][1::2] if one_each else []
        xfer = statistics.median(reads) * 1e3 if reads else float("nan")
        wxfer = statistics.median(writes) * 1e3 if writes else float("nan")
        get_ms = statistics.median(times[("nixl", "get")]) * 1e3
        put_ms = statistics.median(times[("nixl", "put")]) * 1e3
        print(
            f"a NIXL get_data: {get_ms:.2f} ms; ClientAgent.read {ms['read']:.2f} ms = its READ "
            f"{xfer:.2f} ms + copy out {ms['read'] - xfer:.2f} ms; the rest (request, pin, "
            f"threads, decoding) {get_ms - ms['read']:.2f} ms; a socket get_data "
            f"{statistics.median(times[('zmq', 'get')]) * 1e3:.2f} ms"
        )
        print(
            f"a NIXL put: {put_ms:.2f} ms; ClientAgent.write {ms['write']:.2f} ms = copy in "
            f"{ms['write'] - wxfer:.2f} ms + its WRITE {wxfer:.2f} ms; the rest (grant, "
            f"StorePut, controller, encoding) {put_ms - ms['write']:.2f} ms; a socket put "
            f"{statistics.median(times[('zmq', 'put')]) * 1e3:.2f} ms"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3, help="alternations of the two paths")
    parser.add_argument("--big", type=int, default=0, metavar="MIB", help="also a batch of MIB")
    parser.add_argument(
        "--per-call", action="store_true", help="alternate the paths call by call instead"
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="with --per-call: the parts of a NIXL read"
    )
    args = parser.parse_args(argv)
    from tq_async._paths import _nixl

    if _nixl.load() is None:
        print("NIXL is not installed: pip install 'tq_async[nixl]'")
        return 2
    cap = max(1 << 30, (args.big << 20) * 3)
    ctl, address = _start(["controller"], "TQ_ADDRESS=")
    unit, _ = _start(
        ["storage", "--controller", address, "--shm-cap", str(cap), "--data-path", "auto"],
        "TQ_UNIT=",
    )
    try:
        print(f"UCX_TLS={os.environ.get('UCX_TLS', '(UCX default)')}, {os.cpu_count()} CPUs")
        if args.per_call:
            anyio.run(_per_call, address, args.rounds * args.repeat, args.breakdown)
            return 0
        results = {}
        for path in ("zmq", "nixl") * args.repeat:  # alternated: a shared machine drifts
            got = anyio.run(_measure, address, path, args.rounds, args.big)
            results.setdefault(path, []).append(got)
            line = f"{path:5s} put {got['put_gbps']:.2f} GB/s (best {got['put_best']:.2f})"
            line += f"  get {got['get_gbps']:.2f} GB/s (best {got['get_best']:.2f})"
            line += f"  nixl puts/reads {got['nixl_puts']}/{got['nixl_reads']}"
            print(line, got.get("big", ""), flush=True)
        for what in ("put_gbps", "get_gbps"):
            z = statistics.median(r[what] for r in results["zmq"])
            n = statistics.median(r[what] for r in results["nixl"])
            zb = max(r[what[:3] + "_best"] for r in results["zmq"])
            nb = max(r[what[:3] + "_best"] for r in results["nixl"])
            print(
                f"NIXL/ZMQ {what[:3]}: {n / z:.2f}x ({n:.2f} vs {z:.2f} GB/s); best calls "
                f"{nb / zb:.2f}x ({nb:.2f} vs {zb:.2f} GB/s)"
            )
        print(f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    finally:
        for proc in (unit, ctl):
            proc.terminate()
            proc.wait(timeout=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
