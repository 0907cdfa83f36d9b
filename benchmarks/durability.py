"""Durability benchmark (issue 36): every level, and the disk's own bandwidth, in one run.

``python -m benchmarks.durability --data-dir DIR`` measures, on clusters at ``memory``,
``process`` and ``fsync`` (journals in fresh directories under ``DIR``; put it on the disk
you want to measure):

* **W1 put**: the W1 dense batch (256 rows of ``input_ids``/``attention_mask``
  int64[256, 2048] and ``reward``, 8.39 MB), one put at a time, GB/s (median of the puts);
* **disk**: a plain loop that writes the same bytes to a file under ``DIR`` and fsyncs after
  each batch (the disk's own sequential write+fsync bandwidth, same run);
* **small-row ingest**: rows of 6 fields and ~2k tokens (``prompts`` int64[512],
  ``responses`` int64[1536], ``response_mask`` bool[1536], ``old_log_probs`` f32[1536],
  ``reward`` f32, ``uid`` int64; 24 KB a row), 64 concurrent producers on one client, 16 rows
  a put, rows/s.

Targets (issue 36): ``process`` W1 put >= 0.8x ``memory``; ``fsync`` W1 put >= 0.7x the disk
loop; small-row ingest >= 10,000 rows/s at ``process`` and ``fsync`` and >= 0.8x ``memory``.

``--breakdown`` runs the small-row ingest once more at each level and reports where its time
went: CPU a row of the client and of ``tq-async serve`` (the scheduler's counts), the
machine's CPU a row by state within the rounds (``/proc/stat``), and the mean time of each of
a put's requests in the client (``PutBegin``, ``ShmAlloc``, ``StorePut``, ``PutCommit``).

``--profile PATH`` also runs the small-row ingest at ``--profile-level`` in this process
(embedded cluster) under cProfile and writes the stats (``python -m pstats PATH``).

The measurement is only as quiet as the box: the runner prints the cores other processes
used meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import anyio

from ._common import Config, median, open_cluster_handle, result, settle
from ._proc import CPU_STATES, CpuMeter, cpu_seconds, machine_info, machine_ticks
from ._runner import format_table
from .w1_data_plane import _make_batch

__all__ = ["main", "run"]

WORKLOAD = "durability"
LEVELS = ("memory", "process", "fsync")
PRODUCERS = 64
ROWS_PER_PUT = 16


def _small_rows(n: int, seed: int) -> dict[str, Any]:
    """``n`` rows of the small-row workload (6 fields, ~2k tokens)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "prompts": torch.randint(0, 150_000, (n, 512), dtype=torch.int64, generator=g),
        "responses": torch.randint(0, 150_000, (n, 1536), dtype=torch.int64, generator=g),
        "response_mask": torch.rand(n, 1536, generator=g) > 0.1,
        "old_log_probs": torch.randn(n, 1536, generator=g),
        "reward": torch.randn(n, generator=g),
        "uid": torch.arange(seed * n, (seed + 1) * n, dtype=torch.int64),
    }


def _row_bytes(batch: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values()) // len(batch["uid"])


async def _w1_put(cfg: Config) -> list[float]:
    """GB/s of each timed W1 dense put."""
    import tq_async as tq

    rows, seqlen, batches, rounds = cfg.pick((256, 2048, 16, 3), (16, 128, 2, 1))
    sources = [_make_batch("dense", rows, seqlen, (0, 0), seed) for seed in range(4)]
    rates: list[float] = []
    async with (
        open_cluster_handle(cfg) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        for i in range(cfg.storage_units):  # warm-up: sockets, first-use allocations
            await client.put(sources[i % 4][0], partition_id="warm")
        await client.clear_partition("warm")
        for r in range(rounds):
            settle()
            for i in range(batches):
                batch, nbytes = sources[i % 4]
                t0 = time.perf_counter()
                await client.put(batch, partition_id=f"w1-{r}")
                rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
            await client.clear_partition(f"w1-{r}")
    return rates


def _disk_loop(cfg: Config) -> list[float]:
    """GB/s of a plain write+fsync loop of the W1 batches' bytes, under the data_dir."""
    assert cfg.data_dir is not None
    rows, seqlen, batches, rounds = cfg.pick((256, 2048, 16, 3), (16, 128, 2, 1))
    nbytes = _make_batch("dense", rows, seqlen, (0, 0), 0)[1]
    buf = os.urandom(1 << 20) * (nbytes // (1 << 20)) + os.urandom(nbytes % (1 << 20))
    path = os.path.join(cfg.data_dir, f"disk-baseline-{os.getpid()}.bin")
    rates: list[float] = []
    try:
        for _ in range(rounds):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                for _ in range(batches):
                    t0 = time.perf_counter()
                    view = memoryview(buf)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                    rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
            finally:
                os.close(fd)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return rates


class Breakdown:
    """Where the small-row ingest's time goes (``--breakdown``), summed over its rounds: the
    CPU of the client and of the cluster's process (`cpu_seconds`), the machine's clock
    ticks by state (`machine_ticks`), and the time each request type took in the client
    (`DealerConnection.request` timed while `timing`: ~1 us a request)."""

    def __init__(self) -> None:
        self.rows = 0
        self.client = self.serve = 0.0
        self.ticks = [0] * len(CPU_STATES)
        self.requests: dict[str, list[float]] = defaultdict(list)
        self._start: tuple[float, float, list[int]] | None = None

    def begin(self, serve_pid: int) -> None:
        self._start = (cpu_seconds(os.getpid()), self._served(serve_pid), machine_ticks())

    def end(self, serve_pid: int, rows: int) -> None:
        assert self._start is not None
        client, serve, ticks = self._start
        self.client += cpu_seconds(os.getpid()) - client
        self.serve += self._served(serve_pid) - serve
        self.ticks = [t + b - a for t, a, b in zip(self.ticks, ticks, machine_ticks(), strict=True)]
        self.rows += rows

    @staticmethod
    def _served(pid: int) -> float:
        """The cluster's process's CPU (0 when it is this one: ``--mode embedded``)."""
        return 0.0 if pid == os.getpid() else cpu_seconds(pid)

    @contextmanager
    def timing(self) -> Iterator[None]:
        from tq_async._transport._dealer import DealerConnection

        request = DealerConnection.request
        spent = self.requests

        async def timed(conn: DealerConnection, body: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await request(conn, body, *args, **kwargs)
            finally:
                spent[type(body).__name__].append(time.perf_counter() - t0)

        DealerConnection.request = timed  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            DealerConnection.request = request  # type: ignore[method-assign]

    def results(self, level: str) -> list[dict[str, Any]]:
        """Rows of the benchmark's table: CPU a row, and a put's requests."""
        us_row = 1e6 / max(self.rows, 1)
        tick_us = us_row / os.sysconf("SC_CLK_TCK")
        states = {n: t * tick_us for n, t in zip(CPU_STATES, self.ticks, strict=True) if t}
        busy = sum(v for n, v in states.items() if n not in ("idle", "iowait"))
        waits = {n: sum(v) / len(v) * 1e3 for n, v in self.requests.items() if v}
        puts = len(self.requests.get("PutBegin", ())) or 1
        asked = len(self.requests.get("ShmAlloc", ()))
        return [
            result(
                WORKLOAD,
                f"small-row ingest {level}: CPU a row, client + serve",
                (self.client + self.serve) * us_row,
                "us/row",
                note=f"client {self.client * us_row:.1f}, serve {self.serve * us_row:.1f}",
            ),
            result(
                WORKLOAD,
                f"small-row ingest {level}: the machine's CPU a row, in rounds",
                busy,
                "us/row",
                note=", ".join(f"{n} {v:.1f}" for n, v in states.items()),
            ),
            result(
                WORKLOAD,
                f"small-row ingest {level}: a put's requests (mean)",
                sum(waits.get(n, 0.0) for n in ("PutBegin", "ShmAlloc", "StorePut", "PutCommit")),
                "ms",
                note=", ".join(f"{n} {v:.2f}" for n, v in waits.items() if n in _PUT_STEPS)
                + f"; ShmAlloc asked by {asked} of {puts} puts",
            ),
        ]


#: the requests of a put through shared memory, in order
_PUT_STEPS = ("PutBegin", "ShmAlloc", "StorePut", "PutCommit")


async def _ingest(
    cfg: Config, rounds: int | None = None, breakdown: Breakdown | None = None
) -> list[float]:
    """Rows/s of each round of the small-row ingest (64 producers on one client); with
    ``breakdown``, where its time went too (the requests timed: slower)."""
    import tq_async as tq

    puts_each = cfg.pick(16, 2)  # per producer per round: 64 x 16 x 16 = 16,384 rows
    rounds = rounds or cfg.pick(3, 1)
    sources = [_small_rows(ROWS_PER_PUT, seed) for seed in range(8)]
    rates: list[float] = []
    async with (
        open_cluster_handle(cfg) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):

        async def producer(k: int, pid: str) -> None:
            for i in range(puts_each):
                await client.put(sources[(k + i) % len(sources)], partition_id=pid)

        async with anyio.create_task_group() as tg:  # warm-up
            for k in range(PRODUCERS):
                tg.start_soon(producer, k, "warm")
        await client.clear_partition("warm")
        for r in range(rounds):
            settle()
            if breakdown is not None:
                breakdown.begin(cluster.pid)
            t0 = time.perf_counter()
            with breakdown.timing() if breakdown is not None else contextlib.nullcontext():
                async with anyio.create_task_group() as tg:
                    for k in range(PRODUCERS):
                        tg.start_soon(producer, k, f"ingest-{r}")
            dt = time.perf_counter() - t0
            rows = PRODUCERS * puts_each * ROWS_PER_PUT
            if breakdown is not None:
                breakdown.end(cluster.pid, rows)
            rates.append(rows / dt)
            await client.clear_partition(f"ingest-{r}")
    return rates


def _level(cfg: Config, level: str) -> Config:
    return replace(cfg, durability=level)


def run(cfg: Config, breakdown: bool = False) -> list[dict[str, Any]]:
    """Every measurement of the module docstring, with the ratios the targets judge; with
    ``breakdown``, the small-row ingest once more at each level, where its time went."""
    put: dict[str, list[float]] = {}
    ingest: dict[str, list[float]] = {}
    for level in LEVELS:
        print(f"  W1 put at {level} ...", flush=True)
        put[level] = anyio.run(_w1_put, _level(cfg, level))
    print("  disk write+fsync loop ...", flush=True)
    disk = _disk_loop(cfg)
    for level in LEVELS:
        print(f"  small-row ingest at {level} ...", flush=True)
        ingest[level] = anyio.run(_ingest, _level(cfg, level))
    row_kb = _row_bytes(_small_rows(ROWS_PER_PUT, 0)) / 1e3
    out = [
        result(
            WORKLOAD,
            f"W1 put dense, {level}",
            median(put[level]),
            "GB/s",
            best=max(put[level]),
            n=len(put[level]),
            note="8.39 MB a put",
        )
        for level in LEVELS
    ]
    out.append(
        result(
            WORKLOAD,
            "disk write+fsync loop",
            median(disk),
            "GB/s",
            best=max(disk),
            n=len(disk),
            note="same bytes as a W1 put, one fsync each",
        )
    )
    out += [
        result(
            WORKLOAD,
            f"small-row ingest, {level}",
            median(ingest[level]),
            "rows/s",
            best=max(ingest[level]),
            n=len(ingest[level]),
            note=f"{PRODUCERS} producers, {ROWS_PER_PUT} rows a put, {row_kb:.1f} KB a row",
        )
        for level in LEVELS
    ]
    m = {r["metric"]: r["value"] for r in out}
    ratios = [
        ("W1 put process/memory", m["W1 put dense, process"] / m["W1 put dense, memory"], 0.8),
        ("W1 put fsync/disk loop", m["W1 put dense, fsync"] / m["disk write+fsync loop"], 0.7),
        (
            "small-row ingest process/memory",
            m["small-row ingest, process"] / m["small-row ingest, memory"],
            0.8,
        ),
        (
            "small-row ingest fsync/memory",
            m["small-row ingest, fsync"] / m["small-row ingest, memory"],
            0.8,
        ),
        ("small-row ingest process", m["small-row ingest, process"], 10_000),
        ("small-row ingest fsync", m["small-row ingest, fsync"], 10_000),
    ]
    for metric, value, threshold in ratios:
        unit = "rows/s" if threshold > 1 else "x"
        judged = {} if cfg.smoke else {"status": "MET" if value >= threshold else "MISS"}
        out.append(
            result(
                WORKLOAD,
                metric,
                value,
                unit,
                note=f"target >= {threshold:g}",
                target=f">= {threshold:g}",
                **judged,
            )
        )
    if breakdown:
        for level in LEVELS:
            print(f"  small-row ingest at {level}, timed ...", flush=True)
            parts = Breakdown()
            anyio.run(_ingest, _level(cfg, level), None, parts)
            out += parts.results(level)
    return out


def profile(cfg: Config, level: str, path: str) -> None:
    """The small-row ingest at ``level`` in this process (embedded), under cProfile."""
    cfg = replace(cfg, mode="embedded", durability=level)
    prof = cProfile.Profile()
    prof.enable()
    try:
        anyio.run(_ingest, cfg, 1)
    finally:
        prof.disable()
    prof.dump_stats(path)
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(r"_controller|_core|sqlite|_journal", 25)
    stats.sort_stats("tottime").print_stats(20)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.durability",
        description="W1 put and small-row ingest at every durability level, and the disk's "
        "own write+fsync bandwidth, in one run (issue 36's targets).",
    )
    parser.add_argument("--data-dir", required=True, metavar="DIR", help="on the disk measured")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds (CI)")
    parser.add_argument(
        "--mode",
        default="process",
        choices=["embedded", "process"],
        help="process (default): `tq-async serve` in a subprocess; embedded: in this loop",
    )
    parser.add_argument("--storage-units", type=int, default=2, help="storage units (default 2)")
    parser.add_argument("--json", dest="json_path", default=None, help="write results here")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="the small-row ingest once more at each level: CPU a row (client, serve, the "
        "machine by state) and a put's requests (mean ms)",
    )
    parser.add_argument("--profile", default=None, metavar="PATH", help="cProfile stats file")
    parser.add_argument("--profile-level", default="process", choices=LEVELS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    cfg = Config(
        smoke=args.smoke,
        mode=args.mode,
        storage_units=args.storage_units,
        data_dir=os.path.abspath(args.data_dir),
    )
    os.makedirs(cfg.data_dir or ".", exist_ok=True)
    machine = machine_info()
    print(
        f"machine: {machine['nproc']} cpu ({machine['cpu']}), loadavg {machine['loadavg']}",
        flush=True,
    )
    meter = CpuMeter()
    t0 = time.perf_counter()
    results = run(cfg, breakdown=args.breakdown)
    foreign = meter.foreign_cores()
    for r in results:
        r.setdefault("system", "tq_async")
        r.setdefault("mode", cfg.mode)
        r.setdefault("foreign_cpu_cores", round(foreign, 2))
    print()
    print(format_table(results, markdown=args.markdown))
    print(
        f"\ntotal {time.perf_counter() - t0:.1f} s; other processes used {foreign:.2f} of "
        f"{os.cpu_count()} cores meanwhile"
    )
    if args.profile:
        profile(cfg, args.profile_level, args.profile)
    if args.json_path:
        doc = {
            "machine": machine,
            "command": [sys.executable, "-m", "benchmarks.durability", *(argv or sys.argv[1:])],
            "smoke": args.smoke,
            "results": results,
        }
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
