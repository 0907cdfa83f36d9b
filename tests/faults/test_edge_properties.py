"""The real stack under random faults, checked against docs/guarantees.md literally.

Seeded random programs — producers putting (plain and keyed), consumers fetching
(``get_meta`` or ``get``; with or without ``lease=``; pooled, keyed by ``batch_index``, or in
DP lockstep with ``dp_size``) — run against real services: embedded (``local_cluster``) and
a ``tq-async serve`` process (over TCP and over its same-host Unix socket). Every call is
wrapped in a random fault: a timeout of 0 to 3 ms, a cancellation from another task after a
random number of loop turns, or none; against ``tq-async serve`` the whole service is also
paused (SIGSTOP) for a moment, and a consumer child process is SIGKILLed holding leases.

At the end each program seals, drains, and checks:

* without leases every row is delivered at most once, and exactly once after the drain
  (cancellation gives rows back); with leases every row is acknowledged exactly once;
* end-of-stream never comes while a committed row was not delivered (an audit task reads
  every row the partition holds);
* a put is all or nothing;
* an empty DP share carries every requested field;
* every error raised is a ``TQError``.

The default profile stays within the CI budget; ``TQ_EDGE_EXAMPLES=N`` runs N programs per
mode (long local runs). A failing program prints its seed: add it to ``REGRESSIONS``.
"""

from __future__ import annotations

import os
import random
import signal
import textwrap
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
from tensordict import TensorDict

import tq_async as tq
from _cluster_proc import serve_role, warm_python

#: programs per mode (embedded; tq-async serve) in the default profile
DEFAULT_EXAMPLES = (60, 40)
#: seeds that once failed: they always run
REGRESSIONS: list[int] = []
LEASE = 1.0
FIELDS = ["v", "w"]


def _examples(mode: int) -> list[int]:
    n = int(os.environ.get("TQ_EDGE_EXAMPLES", "0")) or DEFAULT_EXAMPLES[mode]
    base = int(os.environ.get("TQ_EDGE_SEED", "0"))
    return REGRESSIONS + [base + i for i in range(n)]


# ---- one program -------------------------------------------------------------------------------


@dataclass
class Program:
    """What one seed runs: a consumer shape, puts and fetches with their faults."""

    seed: int
    shape: str  # "pool", "keyed" or "dp"
    lease: float | None
    puts: list[tuple[int, bool, tuple[str, float]]]  # (rows, keyed, fault)
    fetches: list[list[tuple[int, str, tuple[str, float]]]]  # per consumer: (n, how, fault)
    pauses: list[float] = field(default_factory=list)

    @classmethod
    def random(cls, seed: int, pauses: bool) -> Program:
        rng = random.Random(seed)
        shape = rng.choice(["pool", "pool", "keyed", "dp"])
        lease = rng.choice([None, LEASE])

        def fault() -> tuple[str, float]:
            kind = rng.choice(["none", "timeout", "timeout", "cancel"])
            if kind == "timeout":
                return kind, rng.choice([0.0, 1e-4, 5e-4, 1e-3, 3e-3])
            return kind, rng.randint(0, 6)

        puts = [(rng.randint(1, 6), rng.random() < 0.3, fault()) for _ in range(rng.randint(2, 8))]
        consumers = 2 if shape == "dp" else rng.randint(1, 2)
        batch = 2 if shape == "dp" else rng.randint(1, 4)
        fetches = [
            [(batch, rng.choice(["get_meta", "get"]), fault()) for _ in range(rng.randint(2, 10))]
            for _ in range(consumers)
        ]
        paused = [rng.uniform(0.0, 0.02) for _ in range(rng.randint(0, 2))] if pauses else []
        return cls(seed, shape, lease, puts, fetches, paused)


class Broken(AssertionError):
    pass


async def faulty(
    fn: Callable[[], Awaitable[Any]], fault: tuple[str, float], errors: list[Any]
) -> Any:
    """``fn()`` under ``fault``; None if it was cut short. Records every error."""
    kind, arg = fault
    result: list[Any] = []

    async def run() -> None:
        try:
            result.append(await fn())
        except tq.TQError as exc:
            errors.append(exc)
        except Exception as exc:  # the property: nothing else escapes
            what = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
            raise Broken(f"a call raised {what}") from exc

    if kind == "none":
        await run()
    elif kind == "timeout":
        with anyio.move_on_after(arg):
            await run()
    else:
        async with anyio.create_task_group() as tg:

            async def cancel_later() -> None:
                for _ in range(int(arg)):
                    await anyio.lowlevel.checkpoint()
                tg.cancel_scope.cancel()

            tg.start_soon(run)
            tg.start_soon(cancel_later)
    return result[0] if result else None


@dataclass
class Outcome:
    delivered: Counter[int] = field(default_factory=Counter)  # row -> deliveries
    acked: Counter[int] = field(default_factory=Counter)
    errors: list[Any] = field(default_factory=list)
    puts: list[set[int]] = field(default_factory=list)  # rows of each successful put


async def run_program(
    client: tq.AsyncClient, prog: Program, pause: Callable[[float], Awaitable[None]] | None
) -> None:
    pid = f"edge-{prog.seed}-{random.random()}"
    out = Outcome()
    key_seq = iter(range(10**6))
    cfg_dp = {"dp_size": 2} if prog.shape == "dp" else {}
    # what each consumer still owes: keyed readers re-ask a batch they never saw
    next_index = [0] * len(prog.fetches)
    unacked: list[list[tq.BatchMeta]] = [[] for _ in prog.fetches]

    async def produce() -> None:
        for n, keyed, fault in prog.puts:
            base = next(key_seq) * 100
            td = TensorDict(
                {"v": torch.arange(n) + base, "w": torch.ones(n, 3, dtype=torch.float16)},
                batch_size=[n],
            )
            if keyed:
                keys = [f"k{base + i}" for i in range(n)]
                call = partial(client.kv_batch_put, keys, pid, td)
            else:
                call = partial(client.put, td, partition_id=pid)
            meta = await faulty(call, fault, out.errors)
            if meta is not None:
                out.puts.append(set(meta.global_indexes))

    def cfg(c: int) -> dict[str, Any] | None:
        if prog.shape == "pool":
            return None
        return {"dp_rank": c, "batch_index": next_index[c], **cfg_dp}

    def took(c: int, meta: tq.BatchMeta, td: TensorDict | None) -> None:
        if meta.end_of_stream:
            raise Broken("end of stream before the partition was sealed")
        if prog.shape != "pool":
            next_index[c] += 1
        empty_share = td is not None and len(meta) == 0 and prog.shape == "dp"
        if empty_share and sorted(td.keys()) != sorted(FIELDS):
            raise Broken(f"an empty share carries {sorted(td.keys())}, not {FIELDS}")
        out.delivered.update(meta.global_indexes)
        if meta.lease_id:
            unacked[c].append(meta)

    async def consume(c: int, rounds: list[tuple[int, str, tuple[str, float]]]) -> None:
        for n, how, fault in rounds:
            if how == "get":
                call = partial(
                    client.get, FIELDS, n, pid, "t", cfg(c), lease=prog.lease, timeout=0.05
                )
                got = await faulty(call, fault, out.errors)
                if got is not None:
                    took(c, got[1], got[0])
            else:
                call = partial(
                    client.get_meta, FIELDS, n, pid, "t", cfg(c), lease=prog.lease, timeout=0.05
                )
                meta = await faulty(call, fault, out.errors)
                if meta is not None:
                    try:
                        td = await client.get_data(meta)
                    except tq.RowsNotFound:
                        td = None  # withdrawn: a put undone after its commit (see check)
                    took(c, meta, td)
            await ack_some(c)

    async def ack_some(c: int) -> None:
        if unacked[c]:
            await client.ack(unacked[c])
            out.acked.update(r for m in unacked[c] for r in m.global_indexes)
            unacked[c].clear()

    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        for c, rounds in enumerate(prog.fetches):
            tg.start_soon(consume, c, rounds)
        if pause is not None:
            for at in prog.pauses:
                tg.start_soon(pause, at)
    # a get_meta(timeout=) that found too few rows, and a get whose rows a put undone after
    # its commit withdrew, are answers, not faults
    out.errors = [e for e in out.errors if not isinstance(e, (tq.TQTimeoutError, tq.RowsNotFound))]
    if out.errors:
        raise Broken(f"unexpected errors: {out.errors!r}")
    await drain(client, pid, prog, out, next_index)
    await check(client, pid, prog, out)


async def drain(
    client: tq.AsyncClient, pid: str, prog: Program, out: Outcome, next_index: list[int]
) -> None:
    """Seal, then read to end-of-stream, no faults; every lease acknowledged."""
    await client.seal(pid)
    with anyio.fail_after(30):
        if prog.shape == "pool":
            while True:
                meta = await client.get_meta(FIELDS, 4, pid, "t", lease=prog.lease, timeout=20)
                if meta.end_of_stream:
                    return
                out.delivered.update(meta.global_indexes)
                if meta.lease_id:
                    await client.ack(meta)
                    out.acked.update(meta.global_indexes)
        done = [False] * len(next_index)
        while not all(done):
            for c in range(len(next_index)):
                if done[c]:
                    continue
                cfg = {"dp_rank": c, "batch_index": next_index[c]}
                if prog.shape == "dp":
                    cfg["dp_size"] = 2
                meta = await client.get_meta(FIELDS, 2, pid, "t", cfg, lease=prog.lease, timeout=20)
                if meta.end_of_stream:
                    done[c] = True
                    continue
                next_index[c] += 1
                out.delivered.update(meta.global_indexes)
                if meta.lease_id:
                    await client.ack(meta)
                    out.acked.update(meta.global_indexes)


async def check(client: tq.AsyncClient, pid: str, prog: Program, out: Outcome) -> None:
    # the audit: every row the partition holds, read by a task no fault touched
    held: set[int] = set()
    while True:
        meta = await client.get_meta(FIELDS, 64, pid, "audit", timeout=20)
        if meta.end_of_stream:
            break
        held.update(meta.global_indexes)
    for rows in out.puts:
        if not rows <= held:
            raise Broken(f"a put that returned lost rows {sorted(rows - held)}")
    twice = sorted(r for r, n in out.delivered.items() if n > 1)
    if prog.lease is None and twice:
        raise Broken(f"rows delivered twice without a lease: {twice}")
    # end-of-stream came: every row the partition holds was delivered. (Rows delivered and
    # not held belonged to a put whose caller was cancelled after its commit: the put is
    # undone by clearing them, see guarantees.md.)
    if not held <= set(out.delivered):
        raise Broken(f"end of stream, but rows {sorted(held - set(out.delivered))} never came")
    if prog.lease is not None:
        wrong = {r: n for r, n in out.acked.items() if n != 1 and r in held}
        if wrong or not held <= set(out.acked):
            raise Broken(
                f"acked not exactly once: {wrong}, missing {sorted(held - set(out.acked))}"
            )
    await client.clear_partition(pid)


async def run_all(clients: list[tq.AsyncClient], seeds: list[int], pause: Any = None) -> None:
    for i, seed in enumerate(seeds):
        prog = Program.random(seed, pauses=pause is not None)
        try:
            await run_program(clients[i % len(clients)], prog, pause)
        except Broken as exc:
            raise AssertionError(f"seed {seed} ({prog}): {exc}") from exc
        if os.environ.get("TQ_EDGE_EXAMPLES") and (i + 1) % 100 == 0:
            print(f"edge: {i + 1} programs passed (last seed {seed})", flush=True)  # long runs


# ---- the modes ---------------------------------------------------------------------------------


async def test_embedded_stack_keeps_the_guarantees_under_random_faults() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await run_all([client], _examples(0))


CONSUMER = textwrap.dedent(
    """
    import asyncio, sys
    import tq_async as tq

    async def main():
        async with tq.AsyncClient.connect(sys.argv[1]) as c:
            while True:
                m = await c.get_meta(["v"], 2, sys.argv[2], "t", lease=1.0)
                print("GOT", list(m.global_indexes), flush=True)

    asyncio.run(main())
    """
)


async def test_serve_process_keeps_the_guarantees_under_random_faults() -> None:
    with serve_role("--storage-units", "2") as (proc, address):

        async def pause(at: float) -> None:
            await anyio.sleep(at)
            proc.send_signal(signal.SIGSTOP)
            try:
                await anyio.sleep(0.05)
            finally:
                proc.send_signal(signal.SIGCONT)

        async with (
            tq.AsyncClient.connect(address, same_host=False) as tcp,
            tq.AsyncClient.connect(address) as unix,
        ):
            await run_all([tcp, unix], _examples(1), pause)
            await killed_consumer(unix, address)


async def killed_consumer(client: tq.AsyncClient, address: str) -> None:
    """A consumer process SIGKILLed holding leases: its rows come back, each acked once."""
    await client.put({"v": torch.arange(12)}, partition_id="killed")
    await client.seal("killed")
    with warm_python(CONSUMER, address, "killed") as child:  # (SIGKILLed on leaving)
        line = await anyio.to_thread.run_sync(child.stdout.readline)
        assert line.startswith(b"GOT"), line
    acked: list[int] = []
    with anyio.fail_after(30):
        while True:
            meta = await client.get_meta(["v"], 4, "killed", "t", lease=5.0, timeout=20)
            if meta.end_of_stream:
                break
            await client.ack(meta)
            acked += meta.global_indexes
    assert sorted(acked) == list(range(12))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_programs_are_reproducible(seed: int) -> None:
    assert Program.random(seed, True) == Program.random(seed, True)
