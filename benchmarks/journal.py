"""The durable controller's journal, on the controller side only (issue 36).

``python -m benchmarks.journal [--only ingest,get_meta,recovery] [--seconds S] [--rounds R]``
(``--smoke``: tiny sizes, only proves it runs)

An embedded `ControllerCore` with the journal's `Recorder` and `JournalStore` in front of it
and a fake endpoint behind it: requests are noted, applied to the core, and their replies
held until the group commit that covers them, exactly as in the controller; no network, no
storage units, no cells. So the numbers are about the journal:

* ``ingest``: small-row ingest, 64 concurrent producers, 16 rows a put (one ``PutInline`` of
  6 fields: allocate and commit), for ``S`` seconds per level, levels alternating for ``R``
  rounds (medians); rows/s at ``memory`` (no journal), ``process`` and ``fsync``, and the
  ratio to ``memory``.
* ``get_meta``: one consumer, sequential ``get_meta`` (16 rows, a 60 s lease, acknowledging
  the previous batch in the same request) on a partition of 100k rows at ``process``:
  requests/s (for ``S`` seconds, or until the partition is consumed).
* ``history``: what one journal delta costs a partition whose DP job recorded and settled
  ``N`` batches (``--batches``; each record is built after one more batch): it must not grow
  with them (a run's recorded batches and their leases stay for the whole run).
* ``recovery``: a journal of 1M rows (9 partitions of 100k rows with tags, consumption and
  leases, and one of 100k KV keys), written in commits of 2,000 rows; then a new core on the
  same directory: seconds until it answers its first request (a ``get_meta`` peek).

The journal's directory is a temporary one next to this file's folder (on the disk, not a
tmpfs: ``fsync`` must reach the device).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec

from tq_async._controller._journal import JournalStore, Recorder
from tq_async._core._effects import Effects
from tq_async._core._journal import Tracker
from tq_async._core._state import ControllerState
from tq_async._core._transitions import ControllerCore, SampleCall
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import GetMeta, MetaReply, PutCommit, PutInline, Reply

FIELDS = [
    ColumnHeader("input_ids", "dense", "int64", (2048,)),
    ColumnHeader("attention_mask", "dense", "int64", (2048,)),
    ColumnHeader("responses", "dense", "int64", (1024,)),
    ColumnHeader("old_log_prob", "dense", "float32", (1024,)),
    ColumnHeader("rewards", "dense", "float32", ()),
    ColumnHeader("advantages", "dense", "float32", (1024,)),
]
NAMES = [h.name for h in FIELDS]
UNITS = {0: "inproc://u0", 1: "inproc://u1"}
_encoder = msgspec.msgpack.Encoder()
_NIL = msgspec.Raw(b"\xc0")


class _Endpoint:
    """Where replies go: each one completes the future of its request."""

    def __init__(self) -> None:
        self.waiting: dict[tuple[bytes, int], asyncio.Future[None]] = {}
        self._decoder = msgspec.msgpack.Decoder(Reply)

    def send(self, peer: bytes, frames: Any) -> None:
        rid = self._decoder.decode(frames[0]).rid
        fut = self.waiting.pop((peer, rid))
        if not fut.done():
            fut.set_result(None)


class Controller:
    """A core, and at a durable level the journal in front of it."""

    def __init__(self, level: str, data_dir: str | None) -> None:
        self.core = ControllerCore(ControllerState(dict(UNITS)))
        self.endpoint = _Endpoint()
        self.recorder: Recorder | None = None
        self.sends: Any = self.endpoint
        self.clock: Callable[[], float] = time.monotonic
        self.rids = itertools.count(1)
        self.task: asyncio.Task[None] | None = None
        if level != "memory":
            assert data_dir is not None
            store = JournalStore(data_dir, level)  # type: ignore[arg-type]
            self.recorder = Recorder(store, self.core, {})

    def start(self) -> None:
        if self.recorder is not None:
            self.sends = self.recorder.wrap(self.endpoint)  # type: ignore[arg-type]
            self.task = asyncio.get_running_loop().create_task(self.recorder.run(self.clock))

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def request(self, peer: bytes, body: Any, apply: Callable[[], Any]) -> Any:
        """Note ``body``, run ``apply`` on the core, send the reply; wait until it is sent."""
        rid = next(self.rids)
        if self.recorder is not None:
            self.recorder.note(peer, rid, body)
        out = apply()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.endpoint.waiting[(peer, rid)] = fut
        self.sends.send(peer, [_encoder.encode(Reply(rid, True, _NIL))])
        await fut
        return out

    def put(self, pid: str, n: int, tags: list[Any] | None = None) -> list[int]:
        core = self.core
        placement, _ = core.put_begin(pid, FIELDS, n, None, None, self.clock(), lease=False)
        core.put_commit(pid, placement.rows, NAMES, tags, None)
        return placement.rows

    def get(self, req: GetMeta) -> MetaReply:
        core, now = self.core, self.clock()
        decision, _ = core.get_meta(req, now)
        while isinstance(decision, SampleCall):
            decision, _ = core.sampled(req, decision, decision.run(), now)
        assert isinstance(decision, MetaReply), decision
        return decision


def _new_dir(base: str) -> str:
    return tempfile.mkdtemp(prefix="tq-journal-", dir=base)


async def ingest(level: str, seconds: float, base: str) -> float:
    """Rows/s of 64 producers putting 16-row puts for ``seconds``."""
    data_dir = None if level == "memory" else _new_dir(base)
    ctl = Controller(level, data_dir)
    ctl.start()
    rows = 0
    deadline = time.perf_counter() + seconds

    async def producer(i: int) -> None:
        nonlocal rows
        peer = f"producer-{i}".encode()
        body = PutInline("ingest", FIELDS, n_rows=16)
        while time.perf_counter() < deadline:
            await ctl.request(peer, body, lambda: ctl.put("ingest", 16))
            rows += 16

    t0 = time.perf_counter()
    await asyncio.gather(*(producer(i) for i in range(64)))
    rate = rows / (time.perf_counter() - t0)
    await ctl.stop()
    if data_dir is not None:
        shutil.rmtree(data_dir)
    return rate


async def get_meta_rate(level: str, seconds: float, base: str, n_rows: int = 100_000) -> float:
    """Sequential get_meta requests/s on a partition of ``n_rows`` rows."""
    data_dir = None if level == "memory" else _new_dir(base)
    ctl = Controller(level, data_dir)
    ctl.start()
    for _ in range(0, n_rows, 10_000):  # the partition, in a few big puts
        await ctl.request(b"setup", PutCommit("big", [], []), lambda: ctl.put("big", 10_000))
    peer = b"consumer"
    lease: list[int] = []
    n = 0
    deadline = time.perf_counter() + seconds
    t0 = time.perf_counter()
    while time.perf_counter() < deadline and (n + 2) * 16 < n_rows:  # (rows left to fetch)
        req = GetMeta("big", NAMES, 16, "train", None, lease=60.0, ack=lease or None)
        got = await ctl.request(peer, req, lambda req=req: _get_and_ack(ctl, req))
        lease = [got.lease_id]
        n += 1
    rate = n / (time.perf_counter() - t0)
    await ctl.stop()
    if data_dir is not None:
        shutil.rmtree(data_dir)
    return rate


def _get_and_ack(ctl: Controller, req: GetMeta) -> MetaReply:
    if req.ack:
        ctl.core.ack(req.ack, ctl.clock())
    return ctl.get(req)


async def recovery(base: str, scale: int = 100_000) -> tuple[float, float, float]:
    """``(seconds to write, seconds to the first answer after restart, recovery alone)``
    (``scale``: rows per partition and KV keys)."""
    data_dir = _new_dir(base)
    ctl = Controller("process", data_dir)
    ctl.start()
    t0 = time.perf_counter()
    for k in range(9):
        pid = f"part-{k}"
        for start in range(0, scale, 2_000):
            tags = [{"group": (start + i) // 8} for i in range(2_000)]
            body = PutCommit(pid, [], [])
            await ctl.request(b"setup", body, lambda pid=pid, tags=tags: ctl.put(pid, 2_000, tags))
        for _ in range(50):  # some consumption under leases, some acknowledged
            req = GetMeta(pid, NAMES, 64, "train", None, lease=600.0)
            got = await ctl.request(b"c", req, lambda req=req: ctl.get(req))
            if got.lease_id % 2:
                await ctl.request(b"c", req, lambda got=got: ctl.core.ack([got.lease_id], 0.0))
    keys = [f"prompt-{i:06d}" for i in range(scale)]
    for start in range(0, len(keys), 2_000):
        chunk = keys[start : start + 2_000]

        def kv_put(chunk: list[str] = chunk) -> None:
            placement, _ = ctl.core.put_begin("kv", FIELDS, 0, None, chunk, 0.0, lease=False)
            ctl.core.put_commit("kv", placement.rows, NAMES, None, None)

        await ctl.request(b"setup", PutCommit("kv", [], []), kv_put)
    written = time.perf_counter() - t0
    await ctl.stop()
    rows = sum(p.n_rows for p in ctl.core.state.partitions.values())
    assert rows == 10 * scale, rows
    t0 = time.perf_counter()
    again = Controller("process", data_dir)
    assert again.recorder is not None
    again.recorder.recover(again.clock(), {})
    recovered = time.perf_counter() - t0
    for unit in UNITS:  # the units answer (with their data): rows are handed out again
        again.core.unit_up(unit)
    again.start()
    req = GetMeta("part-0", NAMES, 16, "train", None, mode="peek")
    got = await again.request(b"first", req, lambda: again.get(req))
    first = time.perf_counter() - t0
    assert len(got.rows) == 16
    assert len(again.core.state.partitions["kv"].keys) == scale
    await again.stop()
    shutil.rmtree(data_dir)
    return written, first, recovered


def delta_with_history(batches: int, samples: int = 100) -> float:
    """Median seconds to build one journal delta of a partition with ``batches`` recorded,
    settled DP batches (each delta after one more batch)."""
    core = ControllerCore(ControllerState({0: "tcp://u0"}))
    x = ColumnHeader("x", "dense", "int64", ())
    placement, _ = core.put_begin("p", [x], 4 * (batches + samples), None, None, 0.0)
    core.put_commit("p", placement.rows, ["x"], None, None, placement.put_id)
    p = core.state.partitions["p"]
    tracker = Tracker()
    tracker.record(p, 0.0, 0.0)

    def batch(k: int) -> None:
        req = GetMeta("p", ["x"], 4, "dp", {"batch_index": k}, lease=60.0)
        got = core.decide(req, 0.0, Effects())
        assert isinstance(got, MetaReply)
        core.ack([got.lease_id], 0.0)

    for k in range(batches):
        batch(k)
        if k % 500 == 0:  # (a delta now and then, as commits would: snapshots when it grew)
            tracker.record(p, 0.0, 0.0)
    tracker.record(p, 0.0, 0.0)
    times = []
    for k in range(batches, batches + samples):
        batch(k)
        t0 = time.perf_counter()
        tracker.record(p, 0.0, 0.0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def main_async(args: argparse.Namespace, base: str) -> None:
    only = set(args.only.split(","))
    if "ingest" in only:
        rates: dict[str, list[float]] = {"memory": [], "process": [], "fsync": []}
        for _ in range(args.rounds):
            for level in rates:
                rates[level].append(await ingest(level, args.seconds, base))
        mem = statistics.median(rates["memory"])
        for level, got in rates.items():
            med = statistics.median(got)
            print(
                f"ingest level={level} rows/s={med:,.0f} ratio_to_memory={med / mem:.2f} "
                f"runs={[round(r) for r in got]}"
            )
    if "get_meta" in only:
        got = [
            await get_meta_rate("process", args.seconds, base, args.scale)
            for _ in range(args.rounds)
        ]
        print(
            f"get_meta rows={args.scale:,} level=process requests/s={statistics.median(got):,.0f} "
            f"runs={[round(r) for r in got]}"
        )
    if "history" in only:
        for n in (args.batches // 20, args.batches):
            print(f"history batches={n:,} delta_us={delta_with_history(n) * 1e6:.0f}")
    if "recovery" in only:
        written, first, recovered = await recovery(base, args.scale)
        print(
            f"recovery rows={10 * args.scale:,} partitions=10 kv_keys={args.scale:,} "
            f"write_s={written:.1f} "
            f"recover_s={recovered:.2f} first_answer_s={first:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="ingest,get_meta,history,recovery")
    parser.add_argument("--seconds", type=float, default=3.0, help="per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per level (medians)")
    parser.add_argument("--dir", default=None, help="where the journals go (default: here)")
    parser.add_argument("--scale", type=int, default=100_000, help="rows of a big partition")
    parser.add_argument("--batches", type=int, default=20_000, help="DP batches (history)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes")
    args = parser.parse_args()
    if args.smoke:
        args.seconds, args.rounds, args.scale, args.batches = 0.2, 1, 4_000, 400
    asyncio.run(main_async(args, args.dir or os.path.dirname(os.path.abspath(__file__))))


if __name__ == "__main__":
    main()
