"""How many concurrent clients one ``tq-async serve`` holds: ``python -m benchmarks.capacity``.

TransferQueue's README claims 8,192 concurrent clients. This benchmark opens that many real
clients against one ``tq-async serve`` (a controller and ``--storage-units`` units in one
process, as a new user would start it), spread over worker processes, each client with its
own :class:`~tq_async.AsyncClient` (its own sockets: nothing is shared between clients).

Phases, each measured:

1. **connect**: every client opens (Hello, same-host twin) and links to every unit (the
   shared-memory handshake, ``ShmHello``), all at once. Then the services' RSS and open file
   descriptors are read again: the growth divided by the clients is what one idle client
   costs the services.
2. **load** (``--duration`` s): every client loops ``put`` (``--rows`` rows x ``--width``
   int64, its own partition), then ``get_meta`` + ``get_data`` of those rows, then sleeps
   ``--think`` s. The work per client is light, so the services, not the client processes,
   are the bottleneck. Reported: ops/s (one op = put + read), put and read latency p50/p99,
   errors (by kind), the services' CPU (cores) and peak RSS.
3. **drain**: every client seals its partition and reads what is left. Rows lost = rows whose
   put was acknowledged that nobody could read back.

The services' file-descriptor limit is raised to its hard limit by ``serve`` itself (see
``docs/deployment.md``); this benchmark raises its own hard limit first when it may (root),
so that the ``serve`` it starts inherits it.

Example: ``python -m benchmarks.capacity --clients 2048 --duration 60``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from ._common import Config
from ._proc import ServeProcess, machine_info

__all__ = ["main", "run"]


@dataclass
class Load:
    """What each worker process runs."""

    address: str
    clients: int
    first: int  # the first client's index (partition names stay unique across workers)
    duration: float
    think: float
    rows: int
    width: int
    request_timeout: float
    link: bool
    busy_poll: float | None
    at_once: int  # clients of this process opening at the same time (0: all)


@dataclass
class WorkerReport:
    """One worker process's counts (merged by the parent)."""

    connect_s: float = 0.0
    connect_errors: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    ops: int = 0
    put_ms: list[float] = field(default_factory=list)
    get_ms: list[float] = field(default_factory=list)
    rows_acked: int = 0
    rows_read: int = 0
    rows_drained: int = 0
    drain_errors: int = 0
    rows_lost: int = 0  # acknowledged, never read back
    rows_unacked_landed: int = 0  # read back though their put failed (timed out)
    link_fallbacks: int = 0


def _kind(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:100]}"


# ---- worker side -----------------------------------------------------------------------------


class _Rows:
    """One client's row ids: those whose put was acknowledged, and those read back (the
    first int64 of each row is its id, unique in the client's partition)."""

    def __init__(self) -> None:
        self.acked: set[int] = set()
        self.read: set[int] = set()
        self.next = 0

    def note_read(self, td: Any) -> int:
        ids = td["x"][:, 0].tolist()
        self.read.update(ids)
        return len(ids)


async def _client_loop(
    client: Any, load: Load, cid: int, until: float, rep: WorkerReport, rows: _Rows
) -> None:
    import torch
    from tensordict import TensorDict

    part = f"cap-{cid}"
    x = torch.zeros(load.rows, load.width, dtype=torch.int64)
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        ids = list(range(rows.next, rows.next + load.rows))
        rows.next += load.rows
        x[:, 0] = torch.tensor(ids)
        td = TensorDict({"x": x.clone()}, batch_size=[load.rows])
        t0 = time.perf_counter()
        try:
            await client.put(td, partition_id=part)
        except Exception as exc:  # counted: the benchmark reports errors, it does not stop
            rep.errors["put " + _kind(exc)] += 1
            await asyncio.sleep(load.think or 0.05)
            continue
        t1 = time.perf_counter()
        rep.put_ms.append((t1 - t0) * 1e3)
        rows.acked.update(ids)
        try:
            meta = await client.get_meta(["x"], load.rows, part, "read", timeout=load.duration)
            rep.rows_read += rows.note_read(await client.get_data(meta))
        except Exception as exc:
            rep.errors["get " + _kind(exc)] += 1
        else:
            rep.get_ms.append((time.perf_counter() - t1) * 1e3)
            rep.ops += 1
        if load.think:
            await asyncio.sleep(load.think)


async def _drain(client: Any, load: Load, cid: int, rep: WorkerReport, rows: _Rows) -> None:
    part = f"cap-{cid}"
    try:
        await client.seal(part)
        while True:
            meta = await client.get_meta(["x"], 64, part, "read", timeout=load.request_timeout)
            if meta.end_of_stream or not len(meta):
                break
            rep.rows_drained += rows.note_read(await client.get_data(meta))
    except Exception as exc:
        rep.drain_errors += 1
        rep.errors["drain " + _kind(exc)] += 1
    rep.rows_acked += len(rows.acked)
    rep.rows_lost += len(rows.acked - rows.read)
    rep.rows_unacked_landed += len(rows.read - rows.acked)


async def _open(load: Load, cid: int, rep: WorkerReport) -> Any:
    import tq_async as tq

    options: dict[str, Any] = {}
    if load.busy_poll is not None:
        options["busy_poll"] = load.busy_poll
    client = tq.AsyncClient.connect(
        load.address,
        request_timeout=load.request_timeout,
        connect_timeout=load.request_timeout,
        **options,
    )
    try:
        await client.open()
        if load.link:
            # the data path to every unit, as a first get_data would open it (benchmark only:
            # a private call, so that idle clients hold every connection a busy one does)
            for unit in sorted(client._links.unit_addresses):
                await client._links.data_link(unit)
    except Exception as exc:
        rep.connect_errors[_kind(exc)] += 1
        await client.aclose()
        return None
    return client


async def _worker_main(load: Load, conn: Connection) -> None:
    rep = WorkerReport()
    t0 = time.perf_counter()
    gate = asyncio.Semaphore(load.at_once or load.clients)

    async def gated(cid: int) -> Any:
        async with gate:
            return await _open(load, cid, rep)

    opened = await asyncio.gather(*(gated(load.first + i) for i in range(load.clients)))
    rep.connect_s = time.perf_counter() - t0
    clients = [(load.first + i, c) for i, c in enumerate(opened) if c is not None]
    loop = asyncio.get_running_loop()
    conn.send(("connected", rep.connect_s, dict(rep.connect_errors)))
    await loop.run_in_executor(None, conn.recv)  # "go"
    until = loop.time() + load.duration
    rows = {cid: _Rows() for cid, _ in clients}
    await asyncio.gather(*(_client_loop(c, load, cid, until, rep, rows[cid]) for cid, c in clients))
    await asyncio.gather(*(_drain(c, load, cid, rep, rows[cid]) for cid, c in clients))
    rep.link_fallbacks = sum(getattr(c, "link_fallbacks", 0) for _, c in clients)  # 0: older
    conn.send(("done", vars(rep)))  # Counters pickle as they are
    await loop.run_in_executor(None, conn.recv)  # "close"
    for _, c in clients:
        await c.aclose()


def _worker(load: Load, conn: Connection) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        asyncio.run(_worker_main(load, conn))
    except BaseException as exc:
        conn.send(("failed", _kind(exc)))
        raise


# ---- parent side -----------------------------------------------------------------------------


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _py_spy(pid: int, out: str) -> subprocess.Popen[bytes]:
    """``py-spy record`` of ``pid`` (50 Hz, collapsed stacks) until it exits."""
    exe = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or "py-spy"
    cmd = [exe, "record", "-p", str(pid), "-r", "50", "-o", out, "--nonblocking"]
    return subprocess.Popen(
        [*cmd, "--format", "raw"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def _sum(measure: Callable[[int], float], pids: list[int]) -> Any:
    return sum(measure(p) for p in pids)


def _start_services(args: argparse.Namespace) -> list[ServeProcess]:
    """``tq-async serve`` (all in one), or with ``--split`` a controller and one process per
    unit (the controller first)."""
    env = {"OMP_NUM_THREADS": "1"}
    if not args.split:
        return [ServeProcess(args.storage_units, env=env)]
    controller = ServeProcess(role=["controller"], env=env)
    services = [controller]
    try:
        for _ in range(args.storage_units):
            unit = ["storage", "--controller", controller.address]
            services.append(ServeProcess(role=unit, env=env, line="TQ_UNIT="))
    except BaseException:
        for sv in services:
            sv.stop()
        raise
    return services


def _raise_nofile() -> tuple[int, int]:
    """Raise this process's fd limit (inherited by the serve process and the workers)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 20
    try:
        with open("/proc/sys/fs/nr_open") as f:
            want = min(want, int(f.read()))
    except OSError:
        pass
    for limit in ((want, want), (hard, hard)):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, limit)
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, math.ceil(p / 100 * len(values)) - 1)]


def _recv(conn: Connection, what: str, timeout: float) -> tuple[Any, ...]:
    if not conn.poll(timeout):
        raise RuntimeError(f"a worker sent no {what!r} within {timeout:g} s")
    msg: tuple[Any, ...] = conn.recv()
    if msg[0] == "failed":
        raise RuntimeError(f"a worker failed: {msg[1]}")
    if msg[0] != what:
        raise RuntimeError(f"a worker sent {msg[0]!r}, expected {what!r}")
    return msg


def _merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {
        "errors": Counter(),
        "put_ms": [],
        "get_ms": [],
    }
    for rep in reports:
        total["errors"].update(rep["errors"])
        total["put_ms"] += rep["put_ms"]
        total["get_ms"] += rep["get_ms"]
        keys = (
            "ops",
            "rows_acked",
            "rows_read",
            "rows_drained",
            "drain_errors",
            "link_fallbacks",
            "rows_lost",
            "rows_unacked_landed",
        )
        for key in keys:
            total[key] = total.get(key, 0) + rep[key]
    return total


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run one capacity measurement; returns the figures (also printed)."""
    limit = _raise_nofile()
    procs = args.procs or max(1, math.ceil(args.clients / args.per_proc))
    services = _start_services(args)
    pids = [sv.pid for sv in services]  # the controller's first (all services', unsplit)
    address = services[0].address
    spies: list[subprocess.Popen[bytes]] = []
    out: dict[str, Any] = {
        "clients": args.clients,
        "procs": procs,
        "nofile": list(limit),
        "services": f"{len(services)} processes, {args.storage_units} units",
    }
    workers: list[tuple[Any, Connection]] = []
    try:
        time.sleep(0 if args.smoke else 0.5)  # let the services finish starting (imports settle)
        rss0, fds0 = _sum(_rss, pids), _sum(_fds, pids)
        if args.py_spy:  # one profile per service process: FILE, FILE.1, FILE.2, ...
            spies = [_py_spy(p, args.py_spy + (f".{i}" if i else "")) for i, p in enumerate(pids)]
        ctx = Config(smoke=args.smoke).processes()
        sizes = [args.clients // procs + (i < args.clients % procs) for i in range(procs)]
        first = 0
        for n in sizes:
            load = Load(
                address,
                n,
                first,
                args.duration,
                args.think,
                args.rows,
                args.width,
                args.request_timeout,
                not args.no_link,
                args.busy_poll,
                args.at_once,
            )
            first += n
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(load, child), daemon=True)
            proc.start()
            workers.append((proc, parent))
        connected = [_recv(c, "connected", args.request_timeout * 4 + 120) for _, c in workers]
        out["connect_s"] = max(m[1] for m in connected)
        out["connect_errors"] = dict(sum((Counter(m[2]) for m in connected), Counter()))
        # the services trim their heap 2 s after a burst of connections (_unix.trim_heap)
        time.sleep(0 if args.smoke else 3.0)  # (--smoke measures nothing)
        rss1, fds1 = _sum(_rss, pids), _sum(_fds, pids)
        n_ok = args.clients - sum(out["connect_errors"].values())
        out["idle_rss_mb"] = rss1 / 1e6
        out["rss_per_client_kb"] = (rss1 - rss0) / max(1, n_ok) / 1e3
        out["fds_per_client"] = (fds1 - fds0) / max(1, n_ok)
        print(f"connected: {out['connect_s']:.1f} s, {out['connect_errors']}", file=sys.stderr)
        cpu0, t0 = _sum(_cpu_s, pids), time.perf_counter()
        for _, c in workers:
            c.send("go")
        peak = rss1
        deadline = time.perf_counter() + args.duration
        while time.perf_counter() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.perf_counter())))
            peak = max(peak, _sum(_rss, pids))
        out["service_cpu_cores"] = (_sum(_cpu_s, pids) - cpu0) / (time.perf_counter() - t0)
        wait = args.duration + args.request_timeout * 3 + 300
        done = [_recv(c, "done", wait) for _, c in workers]
        out["peak_rss_mb"] = max(peak, _sum(_rss, pids)) / 1e6
        total = _merge([m[1] for m in done])
        out["ops_per_s"] = total["ops"] / args.duration
        out["put_p50_ms"] = _pct(total["put_ms"], 50)
        out["put_p99_ms"] = _pct(total["put_ms"], 99)
        out["get_p50_ms"] = _pct(total["get_ms"], 50)
        out["get_p99_ms"] = _pct(total["get_ms"], 99)
        out["errors"] = sum(total["errors"].values())
        out["error_kinds"] = dict(total["errors"].most_common(6))
        out["link_fallbacks"] = total["link_fallbacks"]
        out["rows_acked"] = total["rows_acked"]
        out["rows_lost"] = total["rows_lost"]
        out["rows_unacked_landed"] = total["rows_unacked_landed"]
        out["stats"] = _service_stats(address)
        for _, c in workers:
            c.send("close")
    finally:
        for proc, _ in workers:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
        for sv in reversed(services):
            sv.stop()
        for spy in spies:  # each stops (and writes its file) once its process is gone
            try:
                spy.wait(timeout=120)
            except subprocess.TimeoutExpired:
                spy.kill()
    return out


def _service_stats(address: str) -> dict[str, Any]:
    """The units' shared-memory counters (handshakes that fell back to the socket)."""
    import tq_async as tq

    async def ask() -> dict[str, Any]:
        async with tq.AsyncClient.connect(address) as client:
            return await client.storage_stats()  # type: ignore[no-any-return]

    try:
        return asyncio.run(ask())
    except Exception as exc:
        return {"error": _kind(exc)}


def _print(out: dict[str, Any]) -> None:
    print(
        f"clients {out['clients']} in {out['procs']} processes (RLIMIT_NOFILE {out['nofile']}, "
        f"services: {out['services']})\n"
        f"  connect all        {out['connect_s']:.1f} s  (errors {out['connect_errors'] or 0})\n"
        f"  services idle      {out['idle_rss_mb']:.0f} MB RSS, "
        f"{out['rss_per_client_kb']:.1f} KB and {out['fds_per_client']:.2f} fds per client\n"
        f"  load               {out['ops_per_s']:.0f} ops/s, put p50/p99 "
        f"{out['put_p50_ms']:.1f}/{out['put_p99_ms']:.1f} ms, read p50/p99 "
        f"{out['get_p50_ms']:.1f}/{out['get_p99_ms']:.1f} ms\n"
        f"  services           {out['service_cpu_cores']:.2f} cores, "
        f"peak {out['peak_rss_mb']:.0f} MB RSS\n"
        f"  errors             {out['errors']} {out['error_kinds'] or ''}\n"
        f"  same-host fallbacks {out['link_fallbacks']} (handshakes that used the socket path)\n"
        f"  rows acked / lost  {out['rows_acked']} / {out['rows_lost']} (and "
        f"{out['rows_unacked_landed']} rows of puts that failed were stored)\n"
        f"  units              {out['stats']}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.capacity", description=__doc__)
    p.add_argument("--clients", type=int, default=512, help="concurrent clients (default 512)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--think", type=float, default=1.0, help="seconds between a client's ops")
    p.add_argument("--rows", type=int, default=4, help="rows per put (default 4)")
    p.add_argument("--width", type=int, default=256, help="int64 per row (default 256)")
    p.add_argument("--storage-units", type=int, default=4)
    p.add_argument(
        "--split",
        action="store_true",
        help="run the controller and each unit in a process of its own (tq-async serve "
        "controller / storage) instead of all in one",
    )
    p.add_argument("--procs", type=int, default=0, help="worker processes (0: --per-proc)")
    p.add_argument("--per-proc", type=int, default=512, help="clients per worker process")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument(
        "--busy-poll",
        type=float,
        default=None,
        help="the clients' busy_poll (default: the library's)",
    )
    p.add_argument(
        "--at-once",
        type=int,
        default=0,
        help="clients each worker process opens at the same time (default 0: all at once)",
    )
    p.add_argument("--no-link", action="store_true", help="do not open data paths up front")
    p.add_argument(
        "--py-spy",
        metavar="FILE",
        help="profile the services (py-spy record, collapsed stacks; with --split FILE is "
        "the controller's, FILE.1 ... the units')",
    )
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.clients, args.duration, args.think, args.procs = 8, 1.0, 0.05, 2
        args.request_timeout = 30.0
    out = run(args)
    _print(out)
    out["machine"] = machine_info()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0 if (not args.smoke or (out["errors"] == 0 and out["rows_lost"] == 0)) else 1


if __name__ == "__main__":
    sys.exit(main())
