"""Chaos harness (issue 36): SIGKILL the controller, one unit or everything, restart on the
same directories, and check what was acknowledged.

Real processes: ``tq-async serve controller --durability process --data-dir D/ctl`` and two
``tq-async serve storage --durability process --data-dir D/uN`` units, each at a fixed
loopback ``--bind`` so a restart comes back at the same address. Workers, each its own
process running this file (``python tests/_chaos.py worker ROLE ...``), print one JSON record
a line on stdout, written only after the call it reports returned:

* **producers** put rows whose content is a function of a key (``cells``); a put is recorded
  ``begin`` before the call, ``ok`` (with its BatchMeta) once acknowledged, ``maybe`` when the
  call failed (its commit may or may not have happened);
* a **consumer** of task ``c`` fetches under a lease, reads, acknowledges; an ack counts
  (``ok``) only if it returned before the lease could have expired (a late ack is ignored by
  the controller, as documented), else it is ``late``/``maybe``;
* a **DP2 job** (two processes, task ``dp``, ``dp_size=2``) reads recorded batches
  ``batch_index`` 0, 1, ... and acknowledges them; a batch that fails midway is read again
  under the same index (a replay).

A killer sends SIGKILL at random moments (seeded) to the controller, one unit or all three,
waits for them to die, starts them again on the same directories and addresses, and waits
for the workers to make progress before the next kill. Between the kills it can also pause
(SIGSTOP, then SIGCONT) the controller, a unit or a worker, and SIGKILL a worker and start
it again (its producers go on with new keys, its DP ranks at the last batch they recorded;
a put its producer died in is in doubt, like a failed one). Then producers stop, everything is
killed and restarted once more, the partition is sealed, the consumer and the DP ranks drain
it to end-of-stream, and `check` compares the records with what the cluster holds:

1. every acknowledged put's rows read back bit-exactly through the put's own BatchMeta, and
   sit in the partition under their recorded row ids;
2. a ``maybe`` put (failed, or cut short by its producer's death) is in the partition whole
   or not at all; every row belongs to a put that began, and no key is in two rows (a put
   committed twice);
3. no torn cell: every read, by every worker and by the final audit, matches its key;
4. no row is delivered to the consumer after an acknowledgement of it counted;
5. every row of the partition is delivered to the consumer (the rows nobody acknowledged come
   when it drains the sealed partition), and to some DP batch;
6. a recorded batch replays identically: every read of ``(dp_rank, batch_index)`` -- retries
   during the run and a replay after the last restart -- has the rows of the first; no row
   is in two batches;
7. no row is lost (``lost_rows``), and the workers finished (nothing hung);
8. no cell without a row: once the units came back for the last time, they hold cells of the
   partition's live rows only (what the controller dropped while they were away is freed);
9. the DP ranks stay in step: both reach end-of-stream at the same ``batch_index``, each with
   a share of every batch before it.

`run_chaos` returns a `Report` (violations must be empty); ``python -m benchmarks.chaos``
runs it long and prints the numbers.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from _cluster_proc import free_port

PARTITION = "p"
FIELDS = ["key", "x", "f"]
WIDTH = 512  # int64 cells a row: 4 KiB, so a put of 1-32 rows goes inline or to a unit
_START_TIMEOUT = 60.0  # a worker connects within this
_BACKOFF = 0.1  # seconds between a failed call and its retry
_PACE = 0.1  # seconds between a producer's puts
_MUL = np.uint64(6364136223846793005)
_ADD = np.uint64(1442695040888963407)


# -- content ------------------------------------------------------------------------------


def cells(keys: Sequence[int]) -> dict[str, torch.Tensor]:
    """The cells of the rows with these keys (a put's columns): every bit follows from the
    key, so a read can be checked alone."""
    k = np.asarray(keys, dtype=np.uint64)[:, None]
    j = np.arange(WIDTH, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        v = (k + np.uint64(1)) * _MUL + j * _ADD
        v ^= v >> np.uint64(29)
    x = torch.from_numpy(v.view(np.int64).copy())
    return {
        "key": torch.tensor(list(keys), dtype=torch.int64),
        "x": x,
        "f": x[:, :16].contiguous().view(torch.float32),  # random bits: NaN payloads too
    }


def torn(td: Any) -> list[int]:
    """The positions of rows of a read whose cells do not match their key."""
    keys = [int(k) for k in td["key"]]
    if not keys:
        return []
    want = cells(keys)
    x, f = td["x"], td["f"]
    bad = []
    for i in range(len(keys)):
        same_x = torch.equal(x[i], want["x"][i])
        same_f = torch.equal(f[i].view(torch.int32), want["f"][i].view(torch.int32))
        if not (same_x and same_f):
            bad.append(i)
    return bad


# -- services -----------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _wait_line(
    proc: subprocess.Popen[bytes], prefix: bytes, sink: IO[bytes]
) -> tuple[str, threading.Thread]:
    """Wait (bounded) for the line starting with ``prefix``; then copy the rest of the
    process's stdout to ``sink`` in a thread (the pipe never fills), which closes it at its
    end."""
    from _cluster_proc import _read_address

    value = _read_address(proc, prefix)
    assert proc.stdout is not None
    out = proc.stdout

    def drain() -> None:
        with out:
            for line in out:
                sink.write(line)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    return value, thread


class Service:
    """A ``tq-async serve`` role that can be SIGKILLed and started again with the same
    arguments (same ``--bind``, same ``--data-dir``)."""

    def __init__(self, name: str, argv: Sequence[str], line: bytes, logs: Path) -> None:
        self.name, self.argv, self.line = name, list(argv), line
        self.log = open(logs / f"{name}.log", "ab")  # noqa: SIM115 (closed in close())
        self.proc: subprocess.Popen[bytes] | None = None
        self.drain: threading.Thread | None = None
        self.starts = 0

    def spawn(self) -> None:
        self.log.write(f"--- start {self.starts}\n".encode())
        self.log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tq_async._deploy._cli", "serve", *self.argv],
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=_env(),
        )
        self.starts += 1

    def ready(self) -> str:
        assert self.proc is not None
        value, self.drain = _wait_line(self.proc, self.line, self.log)
        return value

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self._reap()

    def _reap(self) -> None:
        """Wait for the dead process and the end of its output."""
        proc = self.proc
        if proc is None:
            return
        proc.wait(timeout=30)
        if self.drain is not None:
            self.drain.join(timeout=30)
            self.drain = None
        elif proc.stdout is not None:
            proc.stdout.close()

    def close(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._reap()
        self.log.close()


class Cluster:
    """A durable controller and ``units`` durable storage units, all restartable."""

    def __init__(
        self,
        root: Path,
        units: int = 2,
        durability: str = "process",
        memory_cap: int | None = None,
    ) -> None:
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.address = f"tcp://127.0.0.1:{free_port()}"
        ctl_dir = root / "ctl"
        ctl_dir.mkdir(exist_ok=True)
        ctl = ("controller", "--bind", self.address, "--durability", durability)
        self.controller = Service(
            "controller", (*ctl, "--data-dir", str(ctl_dir)), b"TQ_ADDRESS=", self.logs
        )
        self.units = []
        for u in range(units):
            unit_dir = root / f"u{u}"
            unit_dir.mkdir(exist_ok=True)
            argv = (
                "storage",
                *("--controller", self.address, "--unit-id", str(u)),
                *("--bind", f"tcp://127.0.0.1:{free_port()}"),
                *("--durability", durability, "--data-dir", str(unit_dir)),
                *(() if memory_cap is None else ("--memory-cap", str(memory_cap))),
            )
            self.units.append(Service(f"unit{u}", argv, b"TQ_UNIT=", self.logs))

    @property
    def services(self) -> list[Service]:
        return [self.controller, *self.units]

    def start(self, services: Iterable[Service] | None = None) -> None:
        """Start these services together (all by default) and wait until each is ready."""
        chosen = list(self.services if services is None else services)
        for s in chosen:
            s.spawn()
        for s in chosen:
            s.ready()

    def kill(self, services: Iterable[Service]) -> None:
        chosen = list(services)
        for s in chosen:
            s.kill()

    def close(self) -> None:
        for s in self.services:
            s.close()


# -- workers (in their own processes) -----------------------------------------------------


class _Out:
    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, **record: Any) -> None:
        self.line(json.dumps(record))

    def line(self, line: str) -> None:
        with self.lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()


def _expected(exc: BaseException) -> bool:
    """The errors a call may fail with while a service is down or restarting (not
    `StateLostError`: the controller keeps its state)."""
    import tq_async as tq

    if isinstance(exc, tq.StateLostError):
        return False
    return isinstance(exc, (tq.BrokenError, tq.TQTimeoutError))


async def _failed(exc: BaseException, out: _Out, role: str) -> None:
    """Record an unexpected error; back off a little before the retry (a call fails at once
    while nothing listens: no hot loop)."""
    import anyio

    if not _expected(exc):
        out(t="error", role=role, err=type(exc).__name__, msg=str(exc)[:500])
    await anyio.sleep(_BACKOFF)


async def _producer(
    c: Any, out: _Out, stop: threading.Event, index: int, seed: int, gen: int
) -> None:
    """Puts until ``stop``; ``gen``: how many times the worker was started before (a
    restarted producer's keys are new ones)."""
    import anyio

    rng = random.Random(seed * 1000 + index + 7919 * gen)
    key = (index + 1 + 64 * gen) << 40
    while not stop.is_set():
        n = rng.randint(1, 24)
        k0, key = key, key + n
        out(t="put", k0=k0, n=n, state="begin")
        try:
            meta = await c.put(cells(range(k0, k0 + n)), PARTITION)
        except Exception as exc:
            out(t="put", k0=k0, n=n, state="maybe", err=type(exc).__name__)
            await _failed(exc, out, "producer")
            continue
        out(t="put", k0=k0, n=n, state="ok", meta=_meta_json(meta))
        await anyio.sleep(_PACE)


def _meta_json(meta: Any) -> str:
    import msgspec

    return msgspec.json.encode(meta).decode()


async def _read(c: Any, meta: Any, out: _Out, role: str) -> bool:
    """Read a fetched batch and check its cells; False when the read failed (a service is
    down)."""
    try:
        td = await c.get_data(meta)
    except Exception as exc:
        await _failed(exc, out, role)
        return False
    bad = torn(td)
    keys = [int(k) for k in td["key"]]
    out(t="read", role=role, rows=list(meta.global_indexes), keys=keys, torn=bad)
    return True


async def _consumer(c: Any, out: _Out, lease: float) -> None:
    while True:
        sent = time.monotonic()
        try:
            meta = await c.get_meta(FIELDS, 8, PARTITION, "c", lease=lease, timeout=2)
        except Exception as exc:
            await _failed(exc, out, "consumer")
            continue
        if meta.end_of_stream:
            out(t="eos", role="consumer")
            return
        rows = list(meta.global_indexes)
        out(t="got", rows=rows)
        deadline = sent + lease  # the controller's deadline is at least this late
        read = await _read(c, meta, out, "consumer")
        while not read and time.monotonic() < deadline:
            read = await _read(c, meta, out, "consumer")
        if not read:
            out(t="ack", rows=rows, state="unread")  # the lease lapses: the rows come again
            continue
        state = "late"
        while time.monotonic() < deadline:
            try:
                await c.ack(meta)
            except Exception as exc:
                state = "maybe"
                await _failed(exc, out, "consumer")
                continue
            state = "ok" if time.monotonic() < deadline else "late"
            break
        out(t="ack", rows=rows, state=state)


async def _dp_rank(c: Any, out: _Out, rank: int, lease: float, k: int) -> None:
    """Reads recorded batches from ``batch_index`` ``k`` on (a restarted rank goes on at the
    last batch it recorded: a replay)."""
    while True:
        cfg = {"dp_size": 2, "dp_rank": rank, "batch_index": k}
        try:
            meta = await c.get_meta(FIELDS, 4, PARTITION, "dp", cfg, lease=lease, timeout=2)
        except Exception as exc:
            await _failed(exc, out, "dp")
            continue
        if meta.end_of_stream:
            out(t="eos", role="dp", rank=rank, k=k)
            return
        out(t="batch", rank=rank, k=k, rows=list(meta.global_indexes))
        if not await _read(c, meta, out, "dp"):
            continue  # read batch k again: a replay
        try:
            await c.ack(meta)  # any ack of the batch's leases settles it, even a late one
        except Exception as exc:
            await _failed(exc, out, "dp")
            continue
        k += 1


async def _role(
    role: str, address: str, out: _Out, stop: threading.Event, args: Any, ready: Any
) -> None:
    """One role, on a client of its own."""
    import anyio

    import tq_async as tq

    async with tq.AsyncClient.connect(address, request_timeout=5) as c:
        await ready()
        if role == "producer":
            async with anyio.create_task_group() as tg:
                for i in range(args.count):
                    tg.start_soon(_producer, c, out, stop, i, args.seed, args.gen)
            out(t="stopped", role=role)
        elif role == "consumer":
            await _consumer(c, out, args.lease)
        else:
            rank = int(role.removeprefix("dp"))
            await _dp_rank(c, out, rank, args.lease, args.dp_start[rank])


async def _worker(args: Any) -> None:
    """A worker process: its roles (``producer``, ``consumer``, ``dp0``, ``dp1``), each on
    its own client; producers stop when stdin closes, the others at end-of-stream."""
    import anyio

    out = _Out()
    stop = threading.Event()

    def wait_stdin() -> None:
        # the harness closes our stdin: stop. (os.read, not sys.stdin: a daemon thread
        # blocked in a buffered read holds its lock, and a worker ending without the harness
        # closing stdin died at interpreter shutdown with "could not acquire lock")
        while os.read(0, 4096):
            pass
        stop.set()

    threading.Thread(target=wait_stdin, daemon=True).start()
    roles = args.roles.split(",")
    pending = set(roles)
    go = anyio.Event()

    async def ready(role: str) -> None:
        """Every role starts once all are connected (after the readiness line)."""
        pending.discard(role)
        if not pending:
            out.line("TQ_CHAOS_READY=1")
            go.set()
        await go.wait()

    async with anyio.create_task_group() as tg:
        for role in roles:
            tg.start_soon(_role, role, args.address, out, stop, args, lambda r=role: ready(r))


class Worker:
    """A worker process; its records are collected by a thread as they are printed. It can
    be SIGKILLed and started again (`restart`): its roles go on where its records say."""

    def __init__(
        self, roles: Sequence[str], argv: Sequence[str], logs: Path, progress: threading.Condition
    ):
        self.roles = list(roles)
        self.role = role = "+".join(roles)
        self.argv = list(argv)
        self.logs = logs
        self.records: list[dict[str, Any]] = []
        self.done = 0  # records of calls that succeeded
        self.progress = progress
        self.starts = 0
        self.log = open(logs / f"{role}.jsonl", "ab")  # noqa: SIM115 (closed in wait())
        self._spawn()

    def _spawn(self) -> None:
        # a restart goes on: new keys for its producers, each DP rank at its last batch
        last = [0, 0]
        for r in self.records:
            if r["t"] == "batch":
                last[r["rank"]] = max(last[r["rank"]], r["k"])
        extra = ["--gen", str(self.starts), "--dp-start", *map(str, last)]
        with open(self.logs / f"{self.role}.stderr", "ab") as stderr:
            stderr.write(f"--- start {self.starts}\n".encode())
            stderr.flush()
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "worker", ",".join(self.roles), *self.argv, *extra],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=_env(),
            )
        self.starts += 1
        self.up = threading.Event()
        self.reader = threading.Thread(target=self._collect, args=(self.proc,), daemon=True)
        self.reader.start()

    def ready(self) -> None:
        """Wait (bounded) until every role of the worker is connected."""
        if not self.up.wait(_START_TIMEOUT) or self.proc.poll() is not None:
            raise RuntimeError(f"worker {self.role} did not start (see its .stderr log)")

    def restart(self) -> None:
        """SIGKILL the worker (its calls in flight die with it) and start it again."""
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.reader.join(timeout=30)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self._spawn()
        self.ready()

    def _collect(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with proc.stdout:
            self._records(proc.stdout)

    def _records(self, lines: Iterable[bytes]) -> None:
        for line in lines:
            self.log.write(line)
            if line.startswith(b"TQ_CHAOS_READY="):
                self.up.set()
                continue
            try:
                record = json.loads(line)
            except ValueError:  # the last line of a killed worker, cut short
                continue
            with self.progress:
                self.records.append(record)
                if record["t"] == "read" or record.get("state") == "ok":
                    self.done += 1
                self.progress.notify_all()
        self.log.flush()

    def stopped(self) -> bool:
        return any(r["t"] == "stopped" for r in self.records)

    def stop(self) -> None:
        """Close the worker's stdin: producers stop after the put in flight."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def wait(self, timeout: float) -> bool:
        """Wait for the process to exit; False if it did not (it is then killed)."""
        try:
            self.proc.wait(timeout=timeout)
            done = True
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            done = False
        self.reader.join(timeout=10)
        self.stop()
        if not self.log.closed:
            self.log.close()
        return done


# -- the run ------------------------------------------------------------------------------


@dataclass
class Report:
    seed: int
    kills: dict[str, int] = field(default_factory=dict)
    #: SIGSTOPs (each followed by a SIGCONT), by target
    pauses: dict[str, int] = field(default_factory=dict)
    #: worker processes SIGKILLed and started again
    worker_kills: int = 0
    seconds: float = 0.0
    puts_ok: int = 0
    puts_maybe: int = 0
    rows_ok: int = 0
    rows_held: int = 0
    consumer_deliveries: int = 0
    consumer_acks: dict[str, int] = field(default_factory=dict)
    dp_batches: int = 0
    dp_replays: int = 0
    reads: int = 0
    worker_errors: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_chaos(
    root: Path,
    *,
    kills: int,
    seconds: float,
    seed: int,
    lease: float = 10.0,
    producers: int = 2,
    processes: int = 4,
    progress_timeout: float = 60.0,
    drain_timeout: float = 120.0,
    say: Any = None,
    durability: str = "process",
    memory_cap: int | None = None,
    pauses: int = 0,
    max_pause: float = 2.0,
    worker_kills: int = 0,
) -> Report:
    """Run the cluster and the workers, kill ``kills`` times (about ``seconds`` in all),
    then drain and check. Every wait is bounded. The workers' roles run in ``processes``
    processes: 4 (producers, consumer, DP rank 0, DP rank 1 each in its own), 2 (producers
    and consumer; the DP ranks) or 1. ``durability`` / ``memory_cap``: every service's level,
    and the units' memory cap (cells past it are read back from their segments).

    Between the kills, in a seeded order: ``pauses`` SIGSTOPs of the controller, a unit or
    a worker process for up to ``max_pause`` seconds each (then SIGCONT; a worker paused
    past its lease acknowledges late, a service past a client's ``request_timeout`` fails
    its calls), and ``worker_kills`` SIGKILLs of a worker process, started again at once
    (its producers with new keys, its DP ranks at the last batch they recorded)."""
    import anyio

    rng = random.Random(seed)
    report = Report(seed=seed, kills={"controller": 0, "unit": 0, "all": 0})
    report.pauses = {"controller": 0, "unit": 0, "worker": 0}
    t0 = time.monotonic()
    cluster = Cluster(root, durability=durability, memory_cap=memory_cap)
    progress = threading.Condition()
    workers: list[Worker] = []
    log = say or (lambda msg: None)
    try:
        cluster.start()
        log("cluster up")
        common = ["--address", cluster.address, "--seed", str(seed), "--lease", str(lease)]
        common += ["--count", str(producers)]
        groups = {
            4: [["producer"], ["consumer"], ["dp0"], ["dp1"]],
            2: [["producer", "consumer"], ["dp0", "dp1"]],
            1: [["producer", "consumer", "dp0", "dp1"]],
        }[processes]
        workers = [Worker(roles, common, cluster.logs, progress) for roles in groups]
        for w in workers:
            w.ready()
        log("workers up")
        events = ["kill"] * kills + ["pause"] * pauses + ["worker"] * worker_kills
        if pauses or worker_kills:
            rng.shuffle(events)  # (kills alone: the order of earlier runs' seeds)
        gap = 2 * seconds / max(len(events), 1)

        def made() -> int:  # calls that succeeded: acknowledged puts, reads
            return sum(w.done for w in workers)

        for i in range(len(events) + 1):
            with progress:  # the workers got going (again, since the last restart)
                before = made()
                if not progress.wait_for(lambda b=before: made() >= b + 3, progress_timeout):
                    report.violations.append(
                        f"no progress within {progress_timeout}s after event {i}"
                    )
            if i == len(events):
                break
            threading.Event().wait(rng.uniform(0, gap))  # a random moment
            if events[i] == "pause":
                what = rng.choice(["controller", "unit", "worker"])
                pid = {
                    "controller": lambda: cluster.controller.pid,
                    "unit": lambda: rng.choice(cluster.units).pid,
                    "worker": lambda: rng.choice(workers).proc.pid,
                }[what]()
                seconds_paused = rng.uniform(0.05, max_pause)
                report.pauses[what] += 1
                log(f"event {i + 1}/{len(events)}: pause {what} for {seconds_paused:.2f}s")
                _pause(pid, seconds_paused)
                continue
            if events[i] == "worker":
                worker = rng.choice(workers)
                report.worker_kills += 1
                log(f"event {i + 1}/{len(events)}: kill worker {worker.role}")
                worker.restart()
                continue
            what = rng.choices(["controller", "unit", "all"], weights=[4, 4, 2])[0]
            victims = {
                "controller": [cluster.controller],
                "unit": [rng.choice(cluster.units)],
                "all": cluster.services,
            }[what]
            report.kills[what] += 1
            log(f"event {i + 1}/{len(events)}: kill {', '.join(s.name for s in victims)}")
            cluster.kill(victims)
            cluster.start(victims)
        producer = workers[0]
        producer.stop()
        with progress:
            if not progress.wait_for(producer.stopped, progress_timeout):
                report.violations.append("the producers did not stop")
        log("producers stopped; the last restart of everything")
        cluster.kill(cluster.services)
        cluster.start()
        anyio.run(_seal, cluster.address)
        for w in workers:
            if not w.wait(drain_timeout):
                why = anyio.run(_owed, cluster.address)
                report.violations.append(f"{w.role} did not reach end-of-stream (hung): {why}")
        log("drained; checking")
        anyio.run(check, cluster.address, [w.records for w in workers], report, lease)
    finally:
        for w in workers:
            w.wait(0)  # (killed if still running)
        cluster.close()
    report.seconds = round(time.monotonic() - t0, 1)
    return report


def _pause(pid: int, seconds: float) -> None:
    """SIGSTOP ``pid`` for ``seconds``, then SIGCONT."""
    os.kill(pid, signal.SIGSTOP)
    try:
        threading.Event().wait(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


async def _owed(address: str) -> str:
    """What the sealed partition still owes each task (why a drain hangs)."""
    import tq_async as tq

    async with tq.AsyncClient.connect(address, request_timeout=10) as c:
        return repr(await c.partition_info(PARTITION))  # rows; per task consumed, ready, leased


async def _seal(address: str) -> None:
    import tq_async as tq

    async with tq.AsyncClient.connect(address, request_timeout=10) as c:
        await c.seal(PARTITION, create=True)


async def _cells_held(c: Any) -> int:
    return sum(s["rows"] for s in (await c.storage_stats()).values())


async def check(
    address: str, logs: list[list[dict[str, Any]]], report: Report, lease: float
) -> None:
    """Compare the workers' records with what the cluster holds; fill ``report``."""
    import anyio
    import msgspec

    import tq_async as tq

    bad = report.violations
    records = [r for log in logs for r in log]
    puts = [r for r in records if r["t"] == "put"]
    begun = {r["k0"]: r["n"] for r in puts if r["state"] == "begin"}
    ok = [r for r in puts if r["state"] == "ok"]
    maybe = [r for r in puts if r["state"] == "maybe"]
    # a put whose producer was killed before its call returned: in doubt, like a failed one
    ended = {r["k0"] for r in ok} | {r["k0"] for r in maybe}
    maybe += [r for r in puts if r["state"] == "begin" and r["k0"] not in ended]
    report.puts_ok, report.puts_maybe = len(ok), len(maybe)
    report.rows_ok = sum(r["n"] for r in ok)
    report.worker_errors = [
        f"{r['role']}: {r['err']}: {r['msg']}" for r in records if r["t"] == "error"
    ]
    for e in report.worker_errors:  # a call failed in a way a restart must not cause
        bad.append(f"unexpected error: {e}")
    reads = [r for r in records if r["t"] == "read"]
    report.reads = len(reads)
    for r in reads:
        if r["torn"]:
            bad.append(f"torn cells read by {r['role']}: rows {[r['rows'][i] for i in r['torn']]}")
    async with tq.AsyncClient.connect(address, request_timeout=30) as c:
        # the audit: every row the partition holds, read by a task nothing else uses
        held: dict[int, int] = {}  # row -> key
        while True:
            meta = await c.get_meta(FIELDS, 256, PARTITION, "audit", timeout=30)
            if meta.end_of_stream:
                break
            td = await c.get_data(meta)
            for i in torn(td):
                bad.append(f"torn cell in the audit: row {meta.global_indexes[i]}")
            held.update(zip(meta.global_indexes, (int(k) for k in td["key"]), strict=True))
        report.rows_held = len(held)
        # 8. no cell without a row: units that came back were told what the controller
        # dropped while they were away (their last return: the final restart)
        live = (await c.partition_info(PARTITION))["rows"]
        with anyio.move_on_after(30):
            while await _cells_held(c) != live:
                pass  # each stats call is a round trip: the units' frees are one-way ahead
        cells = await _cells_held(c)
        if cells != live:
            bad.append(f"the units hold cells of {cells} rows for the partition's {live}")
        # 1. every acknowledged put, through its own meta, bit-exactly
        for r in ok:
            meta = msgspec.json.decode(r["meta"], type=tq.BatchMeta)
            want = list(range(r["k0"], r["k0"] + r["n"]))
            try:
                td = await c.get_data(meta)
            except tq.TQError as exc:
                bad.append(f"acknowledged put k0={r['k0']} unreadable: {type(exc).__name__}: {exc}")
                continue
            if [int(k) for k in td["key"]] != want or torn(td):
                bad.append(f"acknowledged put k0={r['k0']} reads back wrong")
            for row, key in zip(meta.global_indexes, want, strict=True):
                if held.get(row) != key:
                    bad.append(f"acknowledged row {row} (key {key}) not in the partition")
        # 2. maybe puts whole or absent; every row from a put that began; no key twice
        by_key: dict[int, int] = {}
        for row, key in held.items():
            if key in by_key:
                bad.append(f"key {key} in rows {by_key[key]} and {row} (a put committed twice)")
            by_key[key] = row
        starts = sorted(begun)
        for key in by_key:
            j = bisect.bisect_right(starts, key) - 1
            if j < 0 or key >= starts[j] + begun[starts[j]]:
                bad.append(f"row with key {key} from no put")
        for r in maybe:
            there = sum(k in by_key for k in range(r["k0"], r["k0"] + r["n"]))
            if there not in (0, r["n"]):
                bad.append(f"put k0={r['k0']} half there: {there} of {r['n']} rows")
        # 7. nothing lost
        lost = await c.lost_rows()
        if lost["dead_units"] or any(lost["rows"].values()):
            bad.append(f"lost rows: {lost}")
        # 6. recorded batches replay identically (after the last restart too)
        first: dict[tuple[int, int], list[int]] = {}
        replays = 0
        for r in records:
            if r["t"] != "batch":
                continue
            key2 = (r["rank"], r["k"])
            if key2 in first:
                replays += 1
                if r["rows"] != first[key2]:
                    bad.append(f"batch {key2} replayed {r['rows']}, first {first[key2]}")
            else:
                first[key2] = r["rows"]
        report.dp_batches, report.dp_replays = len(first), replays
        owner: dict[int, tuple[int, int]] = {}
        for key2, rows in sorted(first.items()):
            for row in rows:
                if row in owner:
                    bad.append(f"row {row} in batches {owner[row]} and {key2}")
                owner[row] = key2
            cfg = {"dp_size": 2, "dp_rank": key2[0], "batch_index": key2[1]}
            again = await c.get_meta(FIELDS, 4, PARTITION, "dp", cfg, lease=lease, timeout=30)
            if list(again.global_indexes) != rows:
                replayed = list(again.global_indexes)
                bad.append(f"batch {key2} replays {replayed} after the restarts, first {rows}")
            if again.lease_id:
                await c.ack(again)
        missing_dp = sorted(set(held) - set(owner))
        if missing_dp:
            bad.append(f"rows in no DP batch: {missing_dp[:20]} ({len(missing_dp)})")
        # 9. the DP ranks in lockstep: both reach end-of-stream at the same batch_index, each
        # with its share of every batch before it
        ends = {r["rank"]: r["k"] for r in records if r["t"] == "eos" and r["role"] == "dp"}
        if sorted(ends) != [0, 1] or ends[0] != ends[1]:
            bad.append(f"the DP ranks ended at batch_index {ends} (not in step)")
        else:
            for rank in (0, 1):
                have = sorted(k for r, k in first if r == rank)
                if have != list(range(ends[rank])):
                    gaps = sorted(set(range(ends[rank])) - set(have))[:20]
                    bad.append(f"DP rank {rank} has no share of batches {gaps}")
    # 4. and 5. the consumer: no delivery after a counted ack; every row delivered
    acked_at: dict[int, int] = {}
    delivered: set[int] = set()
    acks: dict[str, int] = {"ok": 0, "late": 0, "maybe": 0, "unread": 0}
    deliveries = 0
    consumer = [r for r in records if r["t"] in ("got", "ack")]
    for n, r in enumerate(consumer):
        if r["t"] == "got":
            deliveries += 1
            for row in r["rows"]:
                if row in acked_at:
                    bad.append(f"row {row} acknowledged (record {acked_at[row]}) delivered again")
                delivered.add(row)
        else:
            acks[r["state"]] += 1
            if r["state"] == "ok":
                for row in r["rows"]:
                    acked_at.setdefault(row, n)
    report.consumer_deliveries, report.consumer_acks = deliveries, acks
    never = sorted(set(held) - delivered)
    if never:
        bad.append(f"rows never delivered to the consumer: {never[:20]} ({len(never)})")
    if not any(r["t"] == "eos" and r["role"] == "consumer" for r in records):
        bad.append("the consumer saw no end-of-stream")


def main(argv: Sequence[str]) -> None:
    import argparse

    import anyio

    parser = argparse.ArgumentParser()
    parser.add_argument("roles")
    parser.add_argument("--address", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lease", type=float, default=10.0)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--gen", type=int, default=0, help="earlier starts of this worker")
    parser.add_argument(
        "--dp-start", type=int, nargs=2, default=[0, 0], help="each DP rank's first batch_index"
    )
    args = parser.parse_args(argv)
    anyio.run(_worker, args)


if __name__ == "__main__":
    assert sys.argv[1] == "worker"
    main(sys.argv[2:])
