"""Exactly-once under failure, with the services as real ``tq-async serve`` processes.

Consumers and producers are real processes killed with SIGKILL; storage units are paused with
SIGSTOP. The test waits on events (a line a process prints, a request the controller answers
once its state changed), never on sleeps.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import tq_async as tq
from _cluster_proc import WarmProcess, warm_python

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="signals and loopback services")

_DEADLINE = 60.0


class Proc:
    """A child process whose stdout (and optionally stderr) lines are read with deadlines."""

    def __init__(self, proc: subprocess.Popen[bytes] | WarmProcess) -> None:
        self.proc = proc
        self._buf: dict[int, bytes] = {}

    def line(self, prefix: str, *, err: bool = False, timeout: float = _DEADLINE) -> str:
        """The next line (of stdout, or stderr) that contains ``prefix``."""
        stream = self.proc.stderr if err else self.proc.stdout
        assert stream is not None
        fd = stream.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                pending = self._buf.get(fd, b"")
                *lines, rest = pending.split(b"\n")
                for i, raw in enumerate(lines):
                    if prefix.encode() in raw:
                        self._buf[fd] = b"\n".join([*lines[i + 1 :], rest])
                        return raw.decode()
                self._buf[fd] = rest
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no line with {prefix!r} within {timeout} s")
                if sel.select(timeout=left):
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        raise RuntimeError(
                            f"process exited ({self.proc.wait(10)}) before {prefix!r}"
                        )
                    self._buf[fd] = self._buf.get(fd, b"") + chunk

    def json(self, prefix: str) -> Any:
        return json.loads(self.line(prefix).split(prefix, 1)[1])

    def stop(self) -> None:
        for sig in (signal.SIGCONT, signal.SIGTERM):
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@contextmanager
def running(*procs: Proc) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            p.stop()


def serve(*args: str, stderr: bool = False) -> tuple[Proc, str]:
    proc = Proc(
        subprocess.Popen(
            [sys.executable, "-m", "tq_async._deploy._cli", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if stderr else subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    )
    line = proc.line("TQ_")
    return proc, line.split("=", 1)[1] if line.startswith("TQ_ADDRESS=") else line


def child(code: str, *args: str) -> Proc:
    """``python -c CODE ARGS...``, forked warm (`warm_python`: the client imported already)."""
    return Proc(warm_python(textwrap.dedent(code), *args))


CONSUMER = """
    import asyncio, json, sys
    import tq_async as tq

    async def main(address, plan):
        async with tq.AsyncClient.connect(address) as c:
            for step in json.loads(plan):
                m = await c.get_meta(["x"], step["n"], "p", "t", step.get("cfg"),
                                     lease=step["lease"])
                print("GOT " + json.dumps({"rows": m.global_indexes, "lease": m.lease_id}),
                      flush=True)
                if step.get("ack"):
                    await c.ack(m)
                    print("ACKED " + json.dumps(m.global_indexes), flush=True)
            print("PARKED", flush=True)
            await asyncio.Event().wait()  # the test kills us here

    asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def drain(client: Any, n: int, lease: float, cfg: dict[str, Any] | None = None) -> list[int]:
    """Read ``p`` for task ``t`` to the end, acknowledging each batch; the rows read."""
    rows: list[int] = []
    with anyio.fail_after(_DEADLINE):
        while True:
            m = await client.get_meta(["x"], n, "p", "t", cfg, lease=lease)
            if m.end_of_stream:
                return rows
            rows += m.global_indexes
            await client.ack(m)


async def test_consumer_killed_holding_leases_on_a_sealed_partition() -> None:
    server, address = serve()
    with running(server):
        async with tq.AsyncClient.connect(address) as c:
            await c.put({"x": torch.arange(48)}, "p")
            await c.seal("p")
            plan = [{"n": 8, "lease": 30.0, "ack": True}, {"n": 8, "lease": 1.0}]
            a = child(CONSUMER, address, json.dumps(plan))
            with running(a):
                a_acked = a.json("ACKED ")
                a_unacked = a.json("GOT ")["rows"]  # the second batch, never acknowledged
                a.line("PARKED")
                a.kill()
            # the survivor reads to the end: it must wait for A's lease, then get its rows
            b_rows = await drain(c, 8, lease=30.0)
            assert sorted(a_acked + b_rows) == list(range(48))  # every row acked exactly once
            assert set(a_acked).isdisjoint(b_rows)  # no acknowledged row delivered again
            assert set(a_unacked) <= set(b_rows)  # the killed consumer's rows came back
            assert await c.check_consumption_status("p", "t")


async def test_restarted_consumer_replays_its_batch_and_its_ack_settles_it() -> None:
    server, address = serve()
    with running(server):
        async with tq.AsyncClient.connect(address) as c:
            await c.put({"x": torch.arange(16)}, "p")
            await c.seal("p")
            cfg = {"dp_rank": 0, "batch_index": 0}
            first = child(CONSUMER, address, json.dumps([{"n": 8, "lease": 30.0, "cfg": cfg}]))
            with running(first):
                got = first.json("GOT ")
                first.line("PARKED")
                first.kill()
            # restarted before the lease expires: same rows, the same (batch's) lease; it acks
            plan = [{"n": 8, "lease": 30.0, "cfg": cfg, "ack": True}]
            again = child(CONSUMER, address, json.dumps(plan))
            with running(again):
                replay = again.json("GOT ")
                acked = again.json("ACKED ")
                again.line("PARKED")
            assert replay == got
            assert acked == got["rows"]
            # the ack settled the batch for good: the rest, then the end, with no wait
            rest = await drain(c, 8, lease=30.0)
            assert sorted(rest + acked) == list(range(16))


RANK = """
    import asyncio, json, sys
    import tq_async as tq

    async def main(address, task):
        async with tq.AsyncClient.connect(address) as c:
            cfg = {"dp_rank": 0, "batch_index": 0}
            m = await c.get_meta(["x"], 8, "p", task, cfg, lease=1.0)
            print("GOT " + json.dumps(m.global_indexes), flush=True)
            await asyncio.Event().wait()  # the test kills us here

    asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_auto_clear_keeps_a_killed_ranks_batch_for_its_replay() -> None:
    """Auto-clear over tasks "train" and "eval". A "train" rank reads batch 0 under a lease
    and is SIGKILLed; the lease runs out and the batch waits for its next reader. "eval"
    reads and acknowledges the same rows: both tasks consumed them, but the batch still owes
    them to "train" (before: auto-clear freed them, and the restarted rank's replay named
    rows whose cells were gone). The replay reads them; its ack frees them."""
    server, address = serve()
    with running(server):
        async with tq.AsyncClient.connect(address) as c:
            await c.register_tasks(["train", "eval"], "p")
            await c.put({"x": torch.arange(8)}, "p")
            rank = child(RANK, address, "train")
            with running(rank):
                got = json.loads(rank.line("GOT ").split("GOT ", 1)[1])
                rank.kill()
            with anyio.fail_after(_DEADLINE):  # the dead rank's lease runs out
                while (await c.partition_info("p"))["leased"].get("train"):
                    pass  # (each round trip waits for the controller)
            evaluated, _ = await c.get(["x"], 8, "p", "eval")  # read and acknowledged
            assert sorted(evaluated["x"].tolist()) == list(range(8))
            cfg = {"dp_rank": 0, "batch_index": 0}
            replay = await c.get_meta(["x"], 8, "p", "train", cfg, lease=30.0)
            assert replay.global_indexes == got
            assert (await c.get_data(replay))["x"].tolist() == got  # row i holds i
            await c.ack(replay)
            with anyio.fail_after(_DEADLINE):  # settled: auto-clear frees them now
                while (await c.partition_info("p"))["rows"]:
                    pass


async def test_auto_clear_keeps_a_global_batchs_share_for_the_rank_that_reads_it_last() -> None:
    """DP rank 0 of task "train" (dp_size 2) decides global batch 0, recording rank 1's share;
    "eval" reads and acknowledges every row before rank 1 asks. Rank 1 still reads its share
    (before: auto-clear had freed it: `RowsNotFound`)."""
    server, address = serve()
    with running(server):
        async with (
            tq.AsyncClient.connect(address) as c,
            tq.AsyncClient.connect(address) as rank1,
        ):
            await c.register_tasks(["train", "eval"], "p")
            await c.put({"x": torch.arange(8)}, "p")
            cfg = {"dp_rank": 0, "batch_index": 0, "dp_size": 2}
            first = await c.get_meta(["x"], 4, "p", "train", cfg, lease=30.0)
            evaluated, _ = await c.get(["x"], 8, "p", "eval")  # read and acknowledged
            assert sorted(evaluated["x"].tolist()) == list(range(8))
            cfg1 = cfg | {"dp_rank": 1}
            second = await rank1.get_meta(["x"], 4, "p", "train", cfg1, lease=30.0)
            assert sorted(first.global_indexes + second.global_indexes) == list(range(8))
            assert (await rank1.get_data(second))["x"].tolist() == second.global_indexes
            await c.ack(first)
            await rank1.ack(second)
            with anyio.fail_after(_DEADLINE):  # both settled: auto-clear frees every row
                while (await c.partition_info("p"))["rows"]:
                    pass


SERVICES = """
    import anyio, sys
    import tq_async as tq

    async def main():
        sampler = tq.SeqlenBalancedSampler(n_samples_per_prompt=1, dp_size=2)
        async with tq.local_cluster(transport="tcp", task_samplers={"t": sampler}) as cluster:
            print("TQ_ADDRESS=" + cluster.address, flush=True)
            await anyio.sleep_forever()

    anyio.run(main)
"""


async def test_a_checkpoint_taken_mid_batch_restores_its_waiting_shares_after_a_sigkill(
    tmp_path: Any,
) -> None:
    """A DP job (auto-clear over "train" and "eval"; "train" at dp_size 2) checkpoints after
    rank 0 read global batch 0, recording rank 1's share; the service is SIGKILLed and a new
    one restores the checkpoint. "eval" reads and acknowledges every row first: both ranks
    still read their shares (rank 0 the same rows again), bit-exact, and acknowledging them
    frees every row (before: the restored batches held nothing, "eval"'s ack freed the rows
    and the ranks got `RowsNotFound`)."""
    ckpt = tmp_path / "ckpt"
    cfg = {"dp_rank": 0, "batch_index": 0, "dp_size": 2}
    server, address = serve("--storage-units", "1")
    with running(server):
        async with tq.AsyncClient.connect(address) as c:
            await c.register_tasks(["train", "eval"], "p")
            await c.put({"x": torch.arange(8)}, "p")
            first = await c.get_meta(["x"], 4, "p", "train", cfg, lease=30.0)
            await c.save_checkpoint(ckpt)
        server.kill()
    server, address = serve("--storage-units", "1")
    with running(server):
        async with tq.AsyncClient.connect(address) as c:
            await c.register_tasks(["train", "eval"], "p")
            await c.load_checkpoint(ckpt)
            evaluated, _ = await c.get(["x"], 8, "p", "eval")  # read and acknowledged
            assert sorted(evaluated["x"].tolist()) == list(range(8))
            shares = [
                await c.get_meta(["x"], 4, "p", "train", cfg | {"dp_rank": r}, lease=30.0)
                for r in (0, 1)
            ]
            assert shares[0].global_indexes == first.global_indexes
            assert sorted(shares[0].global_indexes + shares[1].global_indexes) == list(range(8))
            for share in shares:
                assert (await c.get_data(share))["x"].tolist() == share.global_indexes
                await c.ack(share)
            assert (await c.partition_info("p"))["rows"] == 0


async def test_seqlen_shares_expire_back_to_their_batch_only() -> None:
    services = child(SERVICES)
    address = services.line("TQ_ADDRESS=").split("=", 1)[1]
    with running(services):
        async with tq.AsyncClient.connect(address) as c:
            await c.put(
                {"x": torch.arange(32)}, "p", tags=[{"total_lengths": r} for r in range(32)]
            )
            await c.seal("p")
            # rank 0's consumer reads batches 0..3 under a short lease and dies
            plan = [
                {"n": 4, "lease": 1.0, "cfg": {"dp_rank": 0, "batch_index": b}} for b in range(4)
            ]
            dead = child(CONSUMER, address, json.dumps(plan))
            with running(dead):
                lost = [dead.json("GOT ")["rows"] for _ in range(4)]
                dead.line("PARKED")
                dead.kill()
            rank1 = [
                (
                    await c.get_meta(["x"], 4, "p", "t", {"dp_rank": 1, "batch_index": b})
                ).global_indexes
                for b in range(4)
            ]
            # after the leases expired, rank 0's restarted consumer gets the same shares
            with anyio.fail_after(_DEADLINE):
                end = await c.get_meta(["x"], 4, "p", "t", {"dp_rank": 1, "batch_index": 4})
            assert end.end_of_stream  # waited for the leases, then nothing went to the pool
            for b in range(4):
                share = await c.get_meta(
                    ["x"], 4, "p", "t", {"dp_rank": 0, "batch_index": b}, lease=30.0
                )
                assert share.global_indexes == lost[b]
                await c.ack(share)
            every = [r for share in lost + rank1 for r in share]
            assert sorted(every) == list(range(32))


PRODUCER = """
    import asyncio, sys, torch
    import tq_async as tq
    from tq_async._client._async._put import PutPath  # the client's put path

    async def main():
        async with tq.AsyncClient.connect(sys.argv[1], inline_put_bytes=0) as c:
            await c.put({"x": torch.arange(8)}, "p")
            real = PutPath._store

            async def store_then_stall(self, *a, **k):
                await real(self, *a, **k)
                print("STORED", flush=True)  # the test kills us here
                await asyncio.Event().wait()

            PutPath._store = store_then_stall
            await c.put({"x": torch.arange(8, 16)}, "p")

    asyncio.run(main())
"""


async def test_producer_killed_mid_put_neither_blocks_the_end_nor_holds_capacity() -> None:
    server, address = serve("--put-lease", "1", "--capacity", "16", "--capacity-scope", "global")
    with running(server):
        producer = child(PRODUCER, address)
        with running(producer):
            producer.line("STORED")
            producer.kill()
        async with tq.AsyncClient.connect(address) as c:
            await c.seal("p")
            rows = await drain(c, 8, lease=30.0)
            assert rows == list(range(8))  # the committed put only; then the end of stream
            info = await c.partition_info("p")
            assert info["rows"] == 8
            assert info["uncommitted_puts"] == 0
            await c.put_nowait({"x": torch.arange(8)}, "q")  # the capacity came back


STORAGE_ARGS = ("--unit-suspend-after", "1")


@contextmanager
def split_cluster(*controller_args: str) -> Iterator[tuple[str, Proc, list[Proc]]]:
    controller, address = serve("controller", *controller_args, stderr=True)
    units = []
    try:
        for unit_id in (0, 1):
            unit, _ = serve("storage", "--controller", address, "--unit-id", str(unit_id))
            units.append(unit)
        yield address, controller, units
    finally:
        for p in [*units, controller]:
            p.stop()


async def test_a_paused_unit_is_suspended_then_resumes_with_its_rows() -> None:
    with split_cluster("--unit-suspend-after", "1", "--unit-lost-after", "120") as (
        address,
        controller,
        units,
    ):
        async with tq.AsyncClient.connect(address) as c:
            for i in range(4):  # units 0, 1, 0, 1
                await c.put({"x": torch.arange(i * 4, i * 4 + 4)}, "p")
            await c.seal("p")
            units[1].proc.send_signal(signal.SIGSTOP)
            controller.line("storage unit suspended", err=True)
            lost = await c.lost_rows("p")
            assert lost == {"dead_units": [], "suspended_units": [1], "rows": {"p": []}}
            first = await c.get_meta(["x"], 8, "p", "t", timeout=30)
            assert first.global_indexes == [0, 1, 2, 3, 8, 9, 10, 11]  # unit 0's rows
            assert (await c.put({"x": torch.arange(2)}, "q")).units == [0, 0]  # avoids it
            units[1].proc.send_signal(signal.SIGCONT)
            controller.line("storage unit resumed", err=True)
            with anyio.fail_after(_DEADLINE):
                second = await c.get(["x"], 8, "p", "t")
            assert second[1].global_indexes == [4, 5, 6, 7, 12, 13, 14, 15]
            assert second[0]["x"].tolist() == [4, 5, 6, 7, 12, 13, 14, 15]  # data intact
            assert (await c.get_meta(["x"], 8, "p", "t")).end_of_stream
            assert (await c.lost_rows("p"))["rows"] == {"p": []}


async def test_a_checkpoint_saved_while_a_unit_is_suspended_is_refused_at_once(
    tmp_path: Path,
) -> None:
    """Unit 1 is paused (SIGSTOP) and suspended when a checkpoint is saved: its rows' cells
    cannot be read, so the save is refused at once with a `CheckpointError` that names the
    unit and says to save again (before: it waited the whole request timeout for the unit,
    then said it "cannot write" the checkpoint). Nothing is left at the path; once the unit
    resumed, the same save goes through."""
    with split_cluster("--unit-suspend-after", "1", "--unit-lost-after", "120") as (
        address,
        controller,
        units,
    ):
        async with tq.AsyncClient.connect(address, request_timeout=20) as c:
            for i in range(2):  # units 0, 1
                await c.put({"x": torch.arange(i * 4, i * 4 + 4)}, "p")
            units[1].proc.send_signal(signal.SIGSTOP)
            controller.line("storage unit suspended", err=True)
            ckpt = tmp_path / "ckpt"
            with (
                anyio.fail_after(10),
                pytest.raises(tq.CheckpointError, match=r"unit 1, suspended"),
            ):
                await c.save_checkpoint(ckpt)
            assert os.listdir(tmp_path) == []  # nothing at the path, no temporary left
            units[1].proc.send_signal(signal.SIGCONT)
            controller.line("storage unit resumed", err=True)
            with anyio.fail_after(_DEADLINE):
                await c.save_checkpoint(ckpt)
        assert sorted(json.loads((ckpt / "manifest.json").read_text())["files"]) == [
            "cells-0-0.bin",
            "state.msgpack",
        ]


async def test_rows_lost_with_a_unit_are_still_reported_after_a_checkpoint(
    tmp_path: Path,
) -> None:
    """Unit 1 is SIGKILLed and declared lost with rows 4-7 before a checkpoint is taken.
    Restored, `lost_rows` and ``partition_info`` still report them, and reading one says it
    was lost (before: the checkpoint forgot them: nothing reported, "does not exist")."""
    ckpt = tmp_path / "ckpt"
    with split_cluster("--unit-suspend-after", "1", "--unit-lost-after", "2") as (
        address,
        controller,
        units,
    ):
        async with tq.AsyncClient.connect(address) as c:
            metas = [await c.put({"x": torch.arange(i * 4, i * 4 + 4)}, "p") for i in range(2)]
            assert metas[1].units == [1] * 4
            units[1].kill()
            controller.line("storage unit lost", err=True)
            assert (await c.lost_rows("p"))["rows"] == {"p": [4, 5, 6, 7]}
            await c.save_checkpoint(ckpt)
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.load_checkpoint(ckpt)
        assert (await client.lost_rows("p"))["rows"] == {"p": [4, 5, 6, 7]}
        info = await client.partition_info("p")
        assert (info["rows"], info["lost"]) == (4, 4)
        peek = await client.get_meta(["x"], 4, "p", "t", mode="peek", timeout=10)
        assert peek.global_indexes == [0, 1, 2, 3]
        row_4 = tq.BatchMeta(partition_id="p", global_indexes=[4], field_names=["x"], units=[0])
        with pytest.raises(tq.RowsNotFound, match="lost with storage unit 1"):
            await client.set_tags(row_4, [{"a": 1}])


@pytest.mark.parametrize("unit_state", ["lost", "suspended"])
async def test_a_checkpoint_loads_onto_the_units_that_are_up(
    tmp_path: Path, unit_state: str
) -> None:
    """Unit 1 of two is lost (SIGKILLed) or suspended (SIGSTOPped) when a checkpoint is
    loaded: its rows go to unit 0, as a put's would, and the load goes through (before: half
    of them were placed on unit 1, and the load failed, or waited the request timeout)."""
    ckpt = tmp_path / "ckpt"
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(8)}, "p")
        await client.save_checkpoint(ckpt)
    with split_cluster("--unit-suspend-after", "1", "--unit-lost-after", "120") as (
        address,
        controller,
        units,
    ):
        async with tq.AsyncClient.connect(address, request_timeout=20) as c:
            if unit_state == "lost":
                units[1].kill()
                controller.line("storage unit lost", err=True)
            else:
                units[1].proc.send_signal(signal.SIGSTOP)
                controller.line("storage unit suspended", err=True)
            with anyio.fail_after(10):
                assert await c.load_checkpoint(ckpt) == ["p"]
                meta = await c.get_meta(["x"], 8, "p", "t", timeout=5)
                assert meta.units == [0] * 8
                assert (await c.get_data(meta))["x"].tolist() == list(range(8))


async def test_a_unit_paused_past_the_second_deadline_is_lost() -> None:
    with split_cluster("--unit-suspend-after", "1", "--unit-lost-after", "2") as (
        address,
        controller,
        units,
    ):
        async with tq.AsyncClient.connect(address) as c:
            for i in range(2):
                await c.put({"x": torch.arange(i * 4, i * 4 + 4)}, "p")
            await c.seal("p")
            units[1].proc.send_signal(signal.SIGSTOP)
            controller.line("storage unit suspended", err=True)
            controller.line("storage unit lost", err=True)
            assert (await c.lost_rows("p"))["rows"] == {"p": [4, 5, 6, 7]}
            assert (await c.get_meta(["x"], 8, "p", "t")).global_indexes == [0, 1, 2, 3]
            assert (await c.get_meta(["x"], 8, "p", "t")).end_of_stream


HOLDER = """
    import asyncio, sys
    import tq_async as tq

    async def main():
        async with tq.AsyncClient.connect(sys.argv[1]) as c:
            m = await c.get_meta(["x"], 4, "p", "t")   # an auto-clear task: a hold
            print("HELD", m.lease_id, flush=True)
            await asyncio.Event().wait()  # killed before it acknowledges

    asyncio.run(main())
"""


async def test_a_hold_never_acknowledged_does_not_outlive_clear_partition() -> None:
    server, address = serve()
    with running(server):
        async with tq.AsyncClient.connect(address) as c:
            await c.register_tasks(["t"], "p")
            await c.put({"x": torch.arange(4)}, "p")
            holder = child(HOLDER, address)
            with running(holder):
                holder.line("HELD")
                holder.kill()
            await c.clear_partition("p")
            await c.put({"x": torch.arange(10, 14)}, "p")  # the id is reused
            td, _ = await c.get(["x"], 4, "p", "t")  # reads, then acknowledges its hold
            assert td["x"].tolist() == [10, 11, 12, 13]
            # the new rows are auto-cleared: the old hold (same row ids) is gone
            assert (await c.partition_info("p"))["rows"] == 0


PREFETCHING_RANK = """
    import anyio, json, sys
    import tq_async as tq

    async def main(address):
        async with tq.AsyncClient.connect(address) as c:
            ds = tq.AsyncStreamingDataset(c, ["x"], 3, 3, "p", "train", dp_rank=0, dp_size=2,
                                          prefetch=2)
            async with ds:
                td, meta = await anext(ds)
                print("GOT " + json.dumps(td["x"].tolist()), flush=True)
                # the prefetcher reads global batches 1 and 2 ahead (each round trip waits
                # for the controller)
                while (await c.partition_info("p"))["ready"]["train"] > 6:
                    pass
                print("STATE " + json.dumps(ds.state_dict()), flush=True)
                await anyio.sleep_forever()  # the test kills us here

    anyio.run(main, sys.argv[1])
"""


async def test_a_dp_rank_killed_with_batches_read_ahead_resumes_them_under_auto_clear() -> None:
    """Auto-clear over "train"; DP rank 0 (dp_size 2) takes one batch while its prefetcher
    reads two more, and is SIGKILLed. Resumed from its state, it reads those two (before: its
    reads had acknowledged them, auto-clear freed them, and the resume got `RowsNotFound`);
    rank 1 reads its shares meanwhile, and both ranks end at the same batch_index with every
    row delivered once."""
    server, address = serve("--storage-units", "1")
    with running(server):
        async with tq.AsyncClient.connect(address) as c:
            await c.register_tasks(["train"], "p")
            await c.put({"x": torch.arange(24)}, "p")  # 4 global batches of 2 x 3 rows
            await c.seal("p")
            rank0 = child(PREFETCHING_RANK, address)
            with running(rank0):
                got = rank0.json("GOT ")
                state = rank0.json("STATE ")
                rank0.kill()
            assert state["batch_index"] == 1
            ends = []
            for rank in (1, 0):
                ds = tq.AsyncStreamingDataset(
                    c, ["x"], 3, 3, "p", "train", dp_rank=rank, dp_size=2, prefetch=2
                )
                if rank == 0:
                    ds.load_state_dict(state)
                async with ds:
                    with anyio.fail_after(_DEADLINE):
                        got += [r async for td, _ in ds for r in td["x"].tolist()]
                    ends.append(ds.batch_index)
            assert ends == [4, 4]
            assert sorted(got) == list(range(24))
