"""``python -m benchmarks.watch``: what watching costs (issue 37's targets).

* put -> watcher event: one-row puts, one at a time; a watcher (another task of this process)
  takes each ``fields_produced`` event. Latency from the put's call to the event, against the
  put's own latency, embedded (``local_cluster``) and with ``tq-async serve``.
* get_meta with watchers: sequential ``get_meta(batch_size=8)`` calls against ``tq-async
  serve``, with 0 and with 16 watchers attached (in another process, each taking every event;
  ``--watcher-clients K`` spreads them over K clients: watchers of one client with the same
  filter share one request, so K=16 is the unshared case).
* kv_list of a partition with 100k live keys (tagged) through ``AsyncClient``, embedded and
  against ``tq-async serve``, and through ``tq_async.compat`` (what verl calls): the call, the
  call and reading every key's tags, and the call after one tag changed (the controller's
  upkeep).
* 1,000 events/s to each of 16 watchers (another process) for ``--seconds``: events each got,
  drops (events a watcher never saw), Resyncs.

The get_meta rounds alternate 0 and 16 watchers in one ``serve`` (the watchers' process
attaches and detaches between rounds) and also report the CPU the controller and the watchers'
process used per get_meta (``/proc/PID/task/*/schedstat``, in nanoseconds): on a shared box
that figure is steadier than the rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import Any

import anyio
import torch

import tq_async as tq

from ._common import median, percentile
from ._proc import cpu_seconds


@contextmanager
def serve() -> Iterator[tuple[str, int]]:
    """A ``tq-async serve`` process; its address and pid."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tq_async._deploy._cli", "serve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("TQ_ADDRESS="):
                yield line.split("=", 1)[1].strip(), proc.pid
                break
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


async def put_to_event(address: str, n: int) -> dict[str, float]:
    """p50/p99 of put -> event and of the put itself, in ms."""
    started: dict[int, float] = {}
    lat: list[float] = []
    puts: list[float] = []
    async with tq.AsyncClient.connect(address) as client:
        got_all = anyio.Event()
        async with (
            client.watch(kinds=["fields_produced"]) as events,
            anyio.create_task_group() as tg,
        ):

            async def watcher() -> None:
                async for ev in events:
                    now = perf_counter()
                    for r in ev.rows:  # type: ignore[union-attr]
                        lat.append(now - started[r])
                    if len(lat) >= n:
                        got_all.set()
                        return

            tg.start_soon(watcher)
            x = torch.zeros(1, 64)
            for i in range(n):
                started[i] = t0 = perf_counter()
                await client.put({"x": x}, "w")
                puts.append(perf_counter() - t0)
            await got_all.wait()
    warm = n // 10
    lat, puts = lat[warm:], puts[warm:]
    return {
        "event_p50_ms": percentile(lat, 50) * 1e3,
        "event_p99_ms": percentile(lat, 99) * 1e3,
        "put_p50_ms": percentile(puts, 50) * 1e3,
        "put_p99_ms": percentile(puts, 99) * 1e3,
    }


def _watchers(address: str, n: int, ready: Any, commands: Any = None, n_clients: int = 1) -> None:
    """``n`` watchers taking every event, spread over ``n_clients`` clients (watchers of one
    client share their requests; of different clients, not); with ``commands``: "attach" /
    "detach" / "stop" (each acknowledged on ``ready`` with the events and Resyncs seen so
    far)."""

    async def main() -> None:
        seen = [0, 0]  # events, resyncs
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(tq.AsyncClient.connect(address))
                for _ in range(n_clients)
            ]
            count = 0

            async def one(started: Any) -> None:
                nonlocal count
                client = clients[count % n_clients]
                count += 1
                async with client.watch() as events:
                    started()
                    async for ev in events:
                        seen[0] += 1
                        seen[1] += ev.kind == "resync"

            if commands is None:
                async with anyio.create_task_group() as tg:
                    for _ in range(n):
                        tg.start_soon(one, lambda: ready.put(1))
                return
            while True:
                cmd = await anyio.to_thread.run_sync(commands.get)
                if cmd == "stop":
                    return
                async with anyio.create_task_group() as tg:
                    for _ in range(n):
                        await tg.start(_started, one)
                    ready.put(tuple(seen))
                    while (await anyio.to_thread.run_sync(commands.get)) != "detach":
                        ready.put(tuple(seen))
                    tg.cancel_scope.cancel()
                ready.put(tuple(seen))

    anyio.run(main)


async def _started(one: Any, *, task_status: Any) -> None:
    await one(lambda: task_status.started())


def get_meta_with_watchers(
    serve_pid: int,
    address: str,
    calls: int,
    rounds: int,
    n_watchers: int,
    n_clients: int = 1,
) -> dict[str, Any]:
    """Rounds of sequential get_meta alternating 0 and ``n_watchers`` watchers (of
    ``n_clients`` clients)."""
    ctx = multiprocessing.get_context("spawn")
    ready, commands = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_watchers, args=(address, n_watchers, ready, commands, n_clients))
    proc.start()
    rates: dict[int, list[float]] = {0: [], n_watchers: []}
    cpu: dict[int, list[float]] = {0: [], n_watchers: []}
    wcpu: list[float] = []
    try:
        for r in range(2 * rounds):
            n = 0 if r % 2 == 0 else n_watchers
            if n:
                commands.put("attach")
                ready.get(timeout=120)
            c0, w0 = cpu_seconds(serve_pid), cpu_seconds(proc.pid)  # type: ignore[arg-type]
            rate = anyio.run(get_meta_rate, address, calls, 1)
            c1, w1 = cpu_seconds(serve_pid), cpu_seconds(proc.pid)  # type: ignore[arg-type]
            rates[n].append(rate)
            cpu[n].append((c1 - c0) / calls * 1e6)
            if n:
                wcpu.append((w1 - w0) / calls * 1e6)
                commands.put("detach")
                ready.get(timeout=120)
        commands.put("stop")
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
    pairs = [w / z for z, w in zip(rates[0], rates[n_watchers], strict=True)]
    return {
        "watcher_clients": n_clients,
        "get_meta_per_s_0_watchers": median(rates[0]),
        f"get_meta_per_s_{n_watchers}_watchers": median(rates[n_watchers]),
        "ratio": median(rates[n_watchers]) / median(rates[0]),
        # each round with watchers against the round without just before it: the VM's speed
        # drifts over seconds (one run's 0-watcher rounds: 3.4k-9k calls/s), far more than
        # between two rounds in a row
        "ratio_of_pairs": median(pairs),
        "pair_ratios": [round(x, 3) for x in pairs],
        "rates_0": [round(x) for x in rates[0]],
        f"rates_{n_watchers}": [round(x) for x in rates[n_watchers]],
        "controller_cpu_us_per_get_meta_0": median(cpu[0]),
        f"controller_cpu_us_per_get_meta_{n_watchers}": median(cpu[n_watchers]),
        "watchers_process_cpu_us_per_get_meta": median(wcpu),
    }


async def events_to_watchers(
    address: str, n_watchers: int, events_per_s: int, seconds: float
) -> dict[str, Any]:
    """One-row puts making ``events_per_s`` events/s (rows_added + fields_produced each) for
    ``seconds``, watched by ``n_watchers`` watchers of another process."""
    ctx = multiprocessing.get_context("spawn")
    ready, commands = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_watchers, args=(address, n_watchers, ready, commands))
    proc.start()
    try:
        commands.put("attach")
        await anyio.to_thread.run_sync(lambda: ready.get(timeout=120))
        async with tq.AsyncClient.connect(address) as client:
            pid = f"e{perf_counter()}"
            x = torch.zeros(1, 8)
            await client.put({"x": x}, pid)  # partition_created before the clock starts
            puts = int(events_per_s * seconds / 2)
            t0 = perf_counter()
            for i in range(puts):
                await client.put({"x": x}, pid)
                ahead = t0 + (i + 1) * 2 / events_per_s - perf_counter()
                if ahead > 0:
                    await anyio.sleep(ahead)  # pacing the producer, not synchronising
            elapsed = perf_counter() - t0
            expected = 3 + 2 * puts  # created + 2 for the first put, 2 per put
            seen = (0, 0)
            deadline = perf_counter() + 30
            while seen[0] < n_watchers * expected and perf_counter() < deadline:
                commands.put("count")
                seen = await anyio.to_thread.run_sync(lambda: ready.get(timeout=60))
                if seen[0] < n_watchers * expected:
                    await anyio.sleep(0.05)
        commands.put("detach")
        await anyio.to_thread.run_sync(lambda: ready.get(timeout=60))
        commands.put("stop")
    finally:
        await anyio.to_thread.run_sync(lambda: proc.join(timeout=30))
        if proc.is_alive():
            proc.terminate()
    return {
        "events_per_s_each": 2 * puts / elapsed,
        "watchers": n_watchers,
        "events_expected_each": expected,
        "dropped": n_watchers * expected - seen[0],
        "resyncs": seen[1],
    }


async def get_meta_rate(address: str, calls: int, rounds: int) -> float:
    """Median calls/s of sequential get_meta(batch_size=8) over ``rounds`` fresh tasks."""
    rates = []
    async with tq.AsyncClient.connect(address) as client:
        pid = f"g{perf_counter()}"
        await client.put({"x": torch.arange(calls * 8)}, pid)
        for r in range(rounds):
            t0 = perf_counter()
            for _ in range(calls):
                await client.get_meta(["x"], 8, pid, f"t{r}")
            rates.append(calls / (perf_counter() - t0))
    return median(rates)


async def _fill_kv(client: Any, n_keys: int) -> None:
    for i in range(0, n_keys, 4096):
        keys = [f"key-{k}" for k in range(i, min(n_keys, i + 4096))]
        fields = {"x": torch.arange(len(keys))}
        tags = [{"v": 1, "status": "finished"}] * len(keys)
        await client.kv_batch_put(keys, "kv", fields, tags=tags)


def _read_all(listing: Any) -> int:
    """What verl's replay buffer does with a listing: every key's tags."""
    return sum(1 for _, tag in listing.items() if tag.get("status") == "finished")


async def kv_list_ms(address: str | None, n_keys: int, calls: int) -> dict[str, float]:
    """Medians (ms) of kv_list, kv_list + reading every tag, kv_list after a tag changed."""
    async with contextlib.AsyncExitStack() as stack:
        if address is None:
            address = (await stack.enter_async_context(tq.local_cluster())).address
        client = await stack.enter_async_context(tq.AsyncClient.connect(address))
        if "kv" not in await client.list_partitions():
            await _fill_kv(client, n_keys)
        call, read, changed = [], [], []
        for i in range(calls):
            t0 = perf_counter()
            listing = await client.kv_list("kv")
            call.append(perf_counter() - t0)
            assert len(listing["kv"]) == n_keys
            t0 = perf_counter()
            assert _read_all((await client.kv_list("kv"))["kv"]) == n_keys
            read.append(perf_counter() - t0)
            await client.kv_put(f"key-{i}", "kv", None, {"status": "running"})
            t0 = perf_counter()
            await client.kv_list("kv")
            changed.append(perf_counter() - t0)
            await client.kv_put(f"key-{i}", "kv", None, {"status": "finished"})
    return {
        "call_ms": median(call) * 1e3,
        "call_and_read_all_ms": median(read) * 1e3,
        "call_after_a_change_ms": median(changed) * 1e3,
    }


def kv_list_compat_ms(address: str, n_keys: int, calls: int) -> dict[str, float]:
    """The same through ``tq_async.compat.kv_list`` (the blocking face verl calls)."""
    from tq_async import compat

    compat.init({"address": address})
    try:
        call, read = [], []
        for _ in range(calls):
            t0 = perf_counter()
            listing = compat.kv_list("kv")
            call.append(perf_counter() - t0)
            assert len(listing["kv"]) == n_keys
            t0 = perf_counter()
            assert _read_all(compat.kv_list("kv")["kv"]) == n_keys
            read.append(perf_counter() - t0)
    finally:
        compat.close()
    return {"call_ms": median(call) * 1e3, "call_and_read_all_ms": median(read) * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.watch")
    parser.add_argument("--puts", type=int, default=2000)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--watchers", type=int, default=16)
    parser.add_argument(
        "--watcher-clients",
        type=int,
        default=1,
        help="spread the watchers over this many clients (1: all share one client's requests)",
    )
    parser.add_argument("--events-per-s", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--only", default="latency,get_meta,kv,fanout", help="comma-separated parts to run"
    )
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))
    out: dict[str, Any] = {"load_average_before": os.getloadavg()}

    async def embedded() -> dict[str, float]:
        async with tq.local_cluster() as cluster:
            return await put_to_event(cluster.address, args.puts)

    if "latency" in parts:
        out["put_to_event_embedded"] = anyio.run(embedded)
        with serve() as (address, _):
            out["put_to_event_serve"] = anyio.run(put_to_event, address, args.puts)
    if "get_meta" in parts:
        with serve() as (address, pid):
            out["get_meta_watchers"] = get_meta_with_watchers(
                pid, address, args.calls, args.rounds, args.watchers, args.watcher_clients
            )
    if "kv" in parts:
        out["kv_list_100k_embedded"] = anyio.run(kv_list_ms, None, args.keys, 20)
        with serve() as (address, _):
            out["kv_list_100k_serve"] = anyio.run(kv_list_ms, address, args.keys, 20)
            out["kv_list_100k_compat_serve"] = kv_list_compat_ms(address, args.keys, 20)
    if "fanout" in parts:
        with serve() as (address, _):
            out["events_to_watchers"] = anyio.run(
                events_to_watchers, address, args.watchers, args.events_per_s, args.seconds
            )
    out["load_average_after"] = os.getloadavg()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
