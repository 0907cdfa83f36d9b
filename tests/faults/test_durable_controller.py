"""A journaled controller killed with SIGKILL and restarted on its data_dir (issue 36).

Real processes: ``tq-async serve controller --durability process --data-dir D`` and two
``tq-async serve storage`` units that outlive it. A producer puts and a consumer fetches
under leases and acknowledges while the controller is killed at a random moment; it is
restarted on the same address and directory, the units come back to it (it reconnects to
them and checks they are the processes it knew), and a client connects again. Then: every
acknowledged put's rows read back bit-exactly (through the BatchMeta the put returned: the
partition's incarnation is kept), no row the task acknowledged is delivered to it again,
every other row is delivered, a recorded batch replays the same rows, and the seal, tags and
KV keys are there.
"""

from __future__ import annotations

import random
import signal
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import tq_async as tq
from _cluster_proc import free_port, serve_role
from _requests import cancelled_at
from _services import service
from tq_async._wire._protocol import GetMeta

KILLS = 3  # SIGKILLs per test run (the long chaos run is reported in benchmarks/RESULTS.md)


@contextmanager
def _controller(bind: str, data_dir: Path) -> Iterator[Any]:
    args = ("controller", "--bind", bind, "--durability", "process", "--data-dir", str(data_dir))
    with serve_role(*args) as (proc, _):
        yield proc


def _rows(n: int, start: int) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(start, start + n, dtype=torch.int64).reshape(n, 1).repeat(1, 16)}


async def _work(
    address: str,
    kill: threading.Timer,
    puts: list[tq.BatchMeta],
    acked: set[int],
    in_doubt: set[int],
) -> None:
    """Put and consume until the controller dies under the calls (recording what it
    acknowledged, and the rows of an ack that failed: it may have been committed with its
    reply lost, so those rows may or may not come again)."""
    async with tq.AsyncClient.connect(address, request_timeout=3) as c:
        kill.start()
        try:
            while True:
                start = sum(len(m) for m in puts) + 1000 * len(puts)
                meta = await c.put(_rows(4, start), "p")
                puts.append(meta)
                got = await c.get_meta(["x"], 4, "p", "t", lease=2.0, timeout=1)
                await c.get_data(got)
                in_doubt.update(got.global_indexes)
                await c.ack(got)
                in_doubt.difference_update(got.global_indexes)
                acked.update(got.global_indexes)
        except (tq.BrokenError, tq.TQTimeoutError):
            return  # the controller is gone: what it acknowledged is recorded above


async def _drain(c: tq.AsyncClient) -> list[int]:
    """Everything the task is still owed, to the end of the stream (acknowledged)."""
    delivered: list[int] = []
    while True:
        got = await c.get_meta(["x"], 4, "p", "t", lease=2.0, timeout=30)
        if got.end_of_stream:
            return delivered
        await c.get_data(got)
        delivered += got.global_indexes
        await c.ack(got)


async def test_sigkill_the_controller_and_restart_on_its_data_dir(tmp_path: Path) -> None:
    rng = random.Random()
    bind = f"tcp://127.0.0.1:{free_port()}"
    puts: list[tq.BatchMeta] = []
    acked: set[int] = set()
    in_doubt: set[int] = set()  # rows of acks that failed (committed or not)
    with ExitStack() as stack:
        ctl = stack.enter_context(_controller(bind, tmp_path))
        for unit in ("0", "1"):
            args = ("storage", "--controller", bind, "--unit-id", unit)
            stack.enter_context(serve_role(*args, line="TQ_UNIT="))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            await c.kv_put("k", "kv", {"x": torch.ones(1, 16, dtype=torch.int64)})
            tagged = await c.put(_rows(2, 10_000), "tags")
            await c.set_tags(tagged, [{"g": 1}, {"g": 2}])
            await c.seal("tags")
            await c.put(_rows(8, 20_000), "rec")
            recorded = await c.get_meta(["x"], 4, "rec", "r", {"batch_index": 0}, lease=60.0)
        for _ in range(KILLS):
            kill = threading.Timer(rng.uniform(0.05, 0.6), ctl.send_signal, (signal.SIGKILL,))
            await _work(bind, kill, puts, acked, in_doubt)
            kill.join()
            ctl.wait(timeout=10)
            ctl = stack.enter_context(_controller(bind, tmp_path))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            for meta in puts:  # every acknowledged put, bit-exactly, through its own meta
                got = (await c.get_data(meta))["x"]
                assert torch.equal(got, got[:, :1].repeat(1, 16))
            values = {int(v) for m in puts for v in (await c.get_data(m))["x"][:, 0]}
            assert len(values) == sum(len(m) for m in puts)  # no row lost or mixed up
            await c.seal("p")
            again = await _drain(c)
            assert not set(again) & acked  # an acknowledged row is never delivered again
            put_rows = {r for m in puts for r in m.global_indexes}
            # every other row is delivered (a row of an ack in doubt: if that ack was lost)
            assert put_rows <= acked | set(again) | in_doubt
            replay = await c.get_meta(["x"], 4, "rec", "r", {"batch_index": 0}, lease=60.0)
            assert replay.global_indexes == recorded.global_indexes
            assert (await c.partition_info("tags"))["sealed"]
            assert await c.kv_list("kv") == {"kv": {"k": {}}}
            tags = await c.get_meta(["x"], 2, "tags", "t", mode="peek")
            assert sorted(t["g"] for t in tags.tags) == [1, 2]


async def test_a_controller_killed_while_a_small_put_travels_leaves_no_row_behind(
    tmp_path: Path,
) -> None:
    """A small put is one `PutInline`: the controller places its rows, then forwards the
    cells to their unit and waits. A journal record written while it waits holds the placed
    rows; the controller is SIGKILLed before the unit answers. Restarted, it must not keep
    rows that no put will ever produce: a sealed partition would never end (found by the
    50-kill chaos run: the consumer and the DP ranks waited forever after the last restart,
    four rows alive with no field and no put lease)."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        ctl = stack.enter_context(_controller(bind, tmp_path))
        unit, _ = stack.enter_context(
            serve_role("storage", "--controller", bind, "--unit-id", "0", line="TQ_UNIT=")
        )
        async with tq.AsyncClient.connect(bind, request_timeout=5) as c:
            first = await c.put(_rows(2, 0), "p")
            unit.send_signal(signal.SIGSTOP)  # the unit takes the cells but never answers
            failed: list[Exception] = []

            async def stuck() -> None:
                try:
                    await c.put(_rows(2, 100), "p")  # placed, then waits for the unit
                except (tq.BrokenError, tq.TQTimeoutError) as exc:
                    failed.append(exc)

            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(stuck)
                    with anyio.fail_after(30):
                        # each answer waits for the journal record of what it shows: the
                        # reply that counts the placed rows comes after a record of them
                        while (await c.partition_info("p"))["rows"] != 4:
                            pass
                    ctl.send_signal(signal.SIGKILL)
                    ctl.wait(timeout=10)
            finally:
                unit.send_signal(signal.SIGCONT)
            assert failed  # the put was never acknowledged
        ctl = stack.enter_context(_controller(bind, tmp_path))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            assert (await c.partition_info("p"))["rows"] == 2  # the put in flight: aborted
            with anyio.fail_after(30):  # and its unit keeps no cell of it
                while (await c.storage_stats())[0]["rows"] != 2:
                    pass  # the free reaches the unit once it is back: a round trip later
            await c.seal("p")
            got = await c.get_meta(["x"], 2, "p", "t", timeout=10)
            assert got.global_indexes == first.global_indexes
            assert (await c.get_meta(["x"], 2, "p", "t", timeout=10)).end_of_stream


async def test_cells_of_rows_cleared_while_their_unit_was_gone_are_freed_when_it_returns(
    tmp_path: Path,
) -> None:
    """A clear reaches the controller (journaled) while the rows' unit is dead, and the
    controller is killed before it could tell the unit. The unit restarts on its data_dir
    with every cell, the controller on its journal: when the unit comes back, the controller
    lists what it holds and frees the cells of rows it no longer has (before: they stayed on
    the unit's disk until the partition was cleared whole)."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    ctl_dir, unit_dir = tmp_path / "ctl", tmp_path / "u0"
    ctl_dir.mkdir()
    unit_dir.mkdir()
    unit_args = ("storage", "--controller", bind, "--unit-id", "0", "--bind")
    unit_args += (f"tcp://127.0.0.1:{free_port()}", "--durability", "process")
    unit_args += ("--data-dir", str(unit_dir))
    with ExitStack() as stack:
        ctl = stack.enter_context(_controller(bind, ctl_dir))
        unit, _ = stack.enter_context(serve_role(*unit_args, line="TQ_UNIT="))
        async with tq.AsyncClient.connect(bind, request_timeout=5) as c:
            meta = await c.put(_rows(4, 0), "p")
            unit.send_signal(signal.SIGKILL)
            unit.wait(timeout=10)
            half = meta.select_rows([0, 1])
            failed: list[Exception] = []

            async def clear() -> None:
                try:
                    await c.clear_samples(half)  # the controller drops the rows, the unit is gone
                except tq.TQError as exc:
                    failed.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(clear)
                with anyio.fail_after(30):
                    while (await c.partition_info("p"))["rows"] != 2:
                        pass  # this reply comes after the journal record of the clear
                ctl.send_signal(signal.SIGKILL)
                ctl.wait(timeout=10)
            # confirmed or not, the clear is journaled: the controller answers it once its unit
            # is seen away (a suspended or lost unit is not asked; it frees the cells once back),
            # or the kill ends the request first
            assert all(isinstance(exc, (tq.BrokenError, tq.TQTimeoutError)) for exc in failed)
        ctl = stack.enter_context(_controller(bind, ctl_dir))
        stack.enter_context(serve_role(*unit_args, line="TQ_UNIT="))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            assert (await c.partition_info("p"))["rows"] == 2
            with anyio.fail_after(30):
                while (await c.storage_stats())[0]["rows"] != 2:
                    pass  # the unit re-registers, then is told: each stats call a round trip
            got = await c.get_data(meta.select_rows([2, 3]))
            assert torch.equal(got["x"], _rows(2, 2)["x"])


@pytest.mark.parametrize("what", ["missing", "foreign", "storage"])
def test_a_bad_data_dir_is_refused_at_start(tmp_path: Path, what: str) -> None:
    data_dir = tmp_path / "d"
    if what != "missing":
        data_dir.mkdir()
    if what == "foreign":
        (data_dir / "notes.txt").write_text("mine")
    if what == "storage":
        (data_dir / "tq-async-data-dir.json").write_text('{"kind": "storage", "format": 1}')
    with pytest.raises(RuntimeError, match="exited"), _controller("tcp://127.0.0.1:0", data_dir):
        pass


async def test_an_admission_whose_reply_died_with_the_controller_is_not_taken_twice(
    tmp_path: Path,
) -> None:
    """``acquire_rollout`` is admitted and journaled, and the controller is SIGKILLed before
    its reply reaches the client (the reply is held back here, then the kill makes its loss
    real). The client sees `BrokenError` and asks again, as a rollout worker does: the
    restarted controller must count that admission once (before: twice, and with an
    admission ``capacity`` each such loss shrank it for the rest of the run)."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    ctl = None
    with ExitStack() as stack:
        ctl = stack.enter_context(_controller(bind, tmp_path))
        async with tq.AsyncClient.connect(bind, request_timeout=5) as c:
            await c.acquire_rollout(0, 2)  # an admission that got its reply
            conn = c._links.controller
            assert conn is not None
            read, held = conn._on_frames, anyio.Event()

            def hold(frames: list[Any]) -> None:  # the next reply never reaches the call
                conn._on_frames = read  # type: ignore[method-assign]
                held.set()

            conn._on_frames = hold  # type: ignore[method-assign]
            failed: list[Exception] = []

            async def admit() -> None:
                try:
                    await c.acquire_rollout(0, 3)
                except tq.BrokenError as exc:
                    failed.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(admit)
                with anyio.fail_after(30):
                    await held.wait()  # the reply was sent: its admission is journaled
                ctl.send_signal(signal.SIGKILL)
                ctl.wait(timeout=10)
            assert failed  # the caller does not know whether it was admitted
            ctl = stack.enter_context(_controller(bind, tmp_path))
            with anyio.fail_after(30):
                while True:  # the worker asks again until the controller is back
                    try:
                        await c.acquire_rollout(0, 3)
                        break
                    except tq.BrokenError:
                        pass
            assert (await c.staleness_status())["outstanding"] == 5  # 2 + 3, not 2 + 3 + 3
            await c.acquire_rollout(0, 3)  # a new admission is one, as before
            assert (await c.staleness_status())["outstanding"] == 8


async def test_a_batch_waiting_for_its_reader_keeps_its_rows_from_auto_clear_across_a_restart(
    tmp_path: Path,
) -> None:
    """Auto-clear over "train" and "eval". A "train" rank's lease on batch 0 runs out (it
    died), then the durable controller is SIGKILLed and restarted on its journal. "eval"
    then reads and acknowledges the rows: the recovered batch must still hold them for the
    rank's replay (before: the restarted controller freed them)."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    ctl_dir = tmp_path / "ctl"
    ctl_dir.mkdir()
    with ExitStack() as stack:
        ctl = stack.enter_context(_controller(bind, ctl_dir))
        stack.enter_context(
            serve_role("storage", "--controller", bind, "--unit-id", "0", line="TQ_UNIT=")
        )
        cfg = {"dp_rank": 0, "batch_index": 0}
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            await c.register_tasks(["train", "eval"], "p")
            await c.put(_rows(8, 0), "p")
            first = await c.get_meta(["x"], 8, "p", "train", cfg, lease=1.0)  # never acked
            with anyio.fail_after(30):  # the rank is gone: its lease runs out
                while (await c.partition_info("p"))["leased"].get("train"):
                    pass
            # a change after the expiry: the partition's last record has the batch, no lease
            await c.set_tags(first, [{"seen": 1}] * 8)
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=10)
        ctl = stack.enter_context(_controller(bind, ctl_dir))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            evaluated, _ = await c.get(["x"], 8, "p", "eval")  # read and acknowledged
            assert len(evaluated) == 8
            replay = await c.get_meta(["x"], 8, "p", "train", cfg, lease=30.0)
            assert replay.global_indexes == first.global_indexes
            assert torch.equal((await c.get_data(replay))["x"], _rows(8, 0)["x"])
            await c.ack(replay)
            with anyio.fail_after(30):  # settled: auto-clear frees the rows now
                while (await c.partition_info("p"))["rows"]:
                    pass


@contextmanager
def _serve(bind: str, data_dir: Path, *args: str) -> Iterator[Any]:
    """``tq-async serve`` (a controller and one unit in one process) on ``data_dir``."""
    argv = ("--bind", bind, "--storage-units", "1", "--durability", "process")
    with serve_role(*argv, "--data-dir", str(data_dir), *args) as (proc, _):
        yield proc


async def test_recycled_prompts_are_still_handed_out_after_a_restart(tmp_path: Path) -> None:
    """The learner's `StalenessSampler` recycles three stale rows: they are consumed and
    queued for ``take_recycled`` (each exactly once). The controller is SIGKILLed and
    restarted on its journal: the queue must come back with it (before: it was empty, the
    rows consumed, so their prompts were never regenerated)."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "tq.toml"
    config.write_text(
        '[task_samplers.learner]\nfactory = "tq_async:StalenessSampler"\n'
        'max_staleness = 0\non_stale = "recycle"\n'
    )
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with ExitStack() as stack:
        ctl = stack.enter_context(_serve(bind, data_dir, "--config", str(config)))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            await c.put(_rows(4, 0), "p", policy_version=[0, 0, 0, 1])
            await c.set_policy_version(1)  # rows 0-2 are one version too old
            fresh = await c.get_meta(["x"], 1, "p", "learner", timeout=10)
            assert fresh.global_indexes == [3]
            before = await c.staleness_status()
            assert before["recycled_pending"] == 3
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=10)
        stack.enter_context(_serve(bind, data_dir, "--config", str(config)))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            assert await c.staleness_status() == before
            taken = await c.take_recycled()
            assert [m.global_indexes for m in taken] == [[0, 1, 2]]
            assert torch.equal((await c.get_data(taken[0]))["x"], _rows(3, 0)["x"])
            assert await c.take_recycled() == []  # exactly once


async def test_recycled_rows_stay_held_under_auto_clear_across_restarts(tmp_path: Path) -> None:
    """The learner auto-clears and recycles stale rows: queued rows, and rows taken but not
    yet acknowledged, are held -- across a SIGKILL and restart of the controller too (the
    holds are rebuilt from the journal's queue and leases): the prompts are there to read
    after each restart, and the taker's ack frees them."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "tq.toml"
    config.write_text(
        'auto_clear_tasks = ["learner"]\n'
        '[task_samplers.learner]\nfactory = "tq_async:StalenessSampler"\n'
        'max_staleness = 0\non_stale = "recycle"\n'
    )
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with ExitStack() as stack:
        procs = [stack.enter_context(_serve(bind, data_dir, "--config", str(config)))]

        def restart() -> None:
            procs[-1].send_signal(signal.SIGKILL)
            procs[-1].wait(timeout=10)
            procs.append(stack.enter_context(_serve(bind, data_dir, "--config", str(config))))

        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            await c.put(_rows(4, 0), "p", policy_version=[0, 0, 0, 1])
            await c.set_policy_version(1)  # rows 0-2 are one version too old
            await c.ack(await c.get_meta(["x"], 1, "p", "learner", timeout=10))
            assert (await c.partition_info("p"))["rows"] == 3  # row 3 read and freed
        restart()
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            taken = await c.take_recycled(max_rows=2)
            assert [m.global_indexes for m in taken] == [[0, 1]]
        restart()
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            info = await c.partition_info("p")
            assert (info["rows"], info["leased"]) == (3, {"take_recycled": 2})
            assert torch.equal((await c.get_data(taken[0]))["x"], _rows(2, 0)["x"])
            await c.ack(taken)  # the ack of a hold given before the restart frees its rows
            assert (await c.partition_info("p"))["rows"] == 1
            last = await c.take_recycled()
            assert [m.global_indexes for m in last] == [[2]]
            await c.ack(last)
            assert (await c.partition_info("p"))["rows"] == 0


async def test_a_take_recycled_whose_reply_died_with_the_controller_loses_no_prompt(
    tmp_path: Path,
) -> None:
    """`take_recycled` hands out recycled rows and is journaled, and the controller is
    SIGKILLed before its reply reaches the client (the reply is held back here, then the
    kill makes its loss real). The client sees `BrokenError` and asks again, as a rollout
    worker does: the restarted controller must hand out the same rows (before: they had left
    the queue for a reply nobody saw, and their prompts were never regenerated)."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "tq.toml"
    config.write_text(
        '[task_samplers.learner]\nfactory = "tq_async:StalenessSampler"\n'
        'max_staleness = 0\non_stale = "recycle"\n'
    )
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with ExitStack() as stack:
        ctl = stack.enter_context(_serve(bind, data_dir, "--config", str(config)))
        async with tq.AsyncClient.connect(bind, request_timeout=5) as c:
            await c.put(_rows(4, 0), "p", policy_version=[0, 0, 0, 1])
            await c.set_policy_version(1)  # rows 0-2 are one version too old
            assert (await c.get_meta(["x"], 1, "p", "learner", timeout=10)).global_indexes == [3]
            conn = c._links.controller
            assert conn is not None
            read, held = conn._on_frames, anyio.Event()

            def hold(frames: list[Any]) -> None:  # the next reply never reaches the call
                conn._on_frames = read  # type: ignore[method-assign]
                held.set()

            conn._on_frames = hold  # type: ignore[method-assign]
            failed: list[Exception] = []

            async def take() -> None:
                try:
                    await c.take_recycled(max_rows=2)
                except tq.BrokenError as exc:
                    failed.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(take)
                with anyio.fail_after(30):
                    await held.wait()  # the reply was sent: its take is journaled
                ctl.send_signal(signal.SIGKILL)
                ctl.wait(timeout=10)
            assert failed  # the caller does not know what it took
            stack.enter_context(_serve(bind, data_dir, "--config", str(config)))
            with anyio.fail_after(30):
                while True:  # the worker asks again until the controller is back
                    try:
                        taken = await c.take_recycled(max_rows=2)
                        break
                    except tq.BrokenError:
                        pass
            assert [m.global_indexes for m in taken] == [[0, 1]]
            assert torch.equal((await c.get_data(taken[0]))["x"], _rows(2, 0)["x"])
            rest = await c.take_recycled(max_rows=2)  # a new take is one, as before
            assert [m.global_indexes for m in rest] == [[2]]
            assert await c.take_recycled() == []


async def test_rows_of_a_fetch_cancelled_after_its_answer_come_back_after_a_restart(
    tmp_path: Path,
) -> None:
    """A fetch's caller is cancelled right after the request went out, and its `Cancel`
    crosses the answer on the wire: the controller answered (and journaled the rows as
    consumed), then the Cancel gives the rows back to the task. The controller is SIGKILLed
    (nothing else touched the partition) and restarted on its journal: the task must still
    get those rows (before: the give-back was never journaled, so the restarted controller
    had them consumed by the task and delivered to nobody: they never came again)."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        ctl = stack.enter_context(_serve(bind, tmp_path))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            await c.put(_rows(4, 0), "p")
            conn = c._links.controller
            assert conn is not None
            read, send = conn._on_frames, conn.send_best_effort
            answered, cancels = anyio.Event(), []

            def lose(frames: list[Any]) -> None:  # the answer crosses the Cancel: lost
                conn._on_frames = read  # type: ignore[method-assign]
                answered.set()

            conn._on_frames = lose  # type: ignore[method-assign]
            conn.send_best_effort = cancels.append  # type: ignore[assignment,method-assign]
            try:
                with cancelled_at(GetMeta) as (scope, sent), scope:
                    await c.get_meta(["x"], 2, "p", "t")
                assert scope.cancelled_caught
                assert len(sent) == 1
                with anyio.fail_after(30):
                    await answered.wait()  # answered, so journaled as consumed
            finally:
                conn.send_best_effort = send  # type: ignore[method-assign]
            assert len(cancels) == 1
            send(cancels[0])
            # the next call on the connection is answered after the Cancel was handled
            assert (await c.partition_info("p"))["consumed"] == {"t": 0}
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=10)
        stack.enter_context(_serve(bind, tmp_path))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            assert (await c.partition_info("p"))["consumed"] == {"t": 0}
            await c.seal("p")
            got = await c.get_meta(["x"], 4, "p", "t", timeout=10)
            assert got.global_indexes == [0, 1, 2, 3]


@pytest.mark.parametrize("tasks", [["b"], []], ids=["changed", "off"])
async def test_auto_clear_set_by_register_tasks_survives_a_restart_with_the_same_config(
    tmp_path: Path, tasks: list[str]
) -> None:
    """The configuration makes "a" the auto-clear task; the program changes that with an
    acknowledged ``register_tasks`` (to "b", or off). The controller is SIGKILLed and
    restarted on its journal with the same configuration: the program's setting must hold
    (before: the configuration's came back, silently undoing it)."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "tq.toml"
    config.write_text('auto_clear_tasks = ["a"]\n')
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with ExitStack() as stack:
        ctl = stack.enter_context(_serve(bind, data_dir, "--config", str(config)))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            await c.register_tasks(tasks)
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=10)
        stack.enter_context(_serve(bind, data_dir, "--config", str(config)))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            await c.put(_rows(2, 0), "p")
            got, _ = await c.get(["x"], 2, "p", tasks[0] if tasks else "a")  # read and acked
            assert len(got) == 2
            # cleared by "b"'s auto-clear; kept with auto-clear off
            assert (await c.partition_info("p"))["rows"] == (0 if tasks else 2)


async def test_rows_lost_with_a_unit_stay_lost_when_the_controller_restarts(
    tmp_path: Path,
) -> None:
    """A ``--data-dir`` unit is SIGKILLed and stays away past ``unit_lost_after``: the
    controller declares it lost and ``lost_rows()`` names its rows (a program regenerates
    them). Then the controller is SIGKILLed, and both restart on their directories: the rows
    must stay lost (before: the loss, made by a deadline rather than a request, was never
    journaled; the restarted controller resumed the unit and handed the rows out again,
    next to their regenerated copies)."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    ctl_dir, unit_dir = tmp_path / "ctl", tmp_path / "u0"
    ctl_dir.mkdir()
    unit_dir.mkdir()
    ctl_args = ("--unit-suspend-after", "0.5", "--unit-lost-after", "1")
    ctl_args += ("controller", "--bind", bind, "--durability", "process")
    ctl_args += ("--data-dir", str(ctl_dir))
    unit_args = ("storage", "--controller", bind, "--unit-id", "0", "--bind")
    unit_args += (f"tcp://127.0.0.1:{free_port()}", "--durability", "process")
    unit_args += ("--data-dir", str(unit_dir))
    with ExitStack() as stack:
        ctl, _ = stack.enter_context(serve_role(*ctl_args))
        unit, _ = stack.enter_context(serve_role(*unit_args, line="TQ_UNIT="))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            meta = await c.put(_rows(2, 0), "p")
            unit.send_signal(signal.SIGKILL)
            unit.wait(timeout=10)
            with anyio.fail_after(30):
                while not (await c.lost_rows())["rows"].get("p"):
                    pass  # suspended, then lost after unit_lost_after (no event to wait on)
            lost = await c.lost_rows()
            assert lost["rows"] == {"p": [0, 1]}
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=10)
        stack.enter_context(serve_role(*ctl_args))
        stack.enter_context(serve_role(*unit_args, line="TQ_UNIT="))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            with anyio.fail_after(30):
                while (await c.lost_rows())["suspended_units"]:
                    pass  # until the unit came back (and its rows were decided)
            assert (await c.lost_rows())["rows"] == {"p": [0, 1]}
            assert (await c.partition_info("p"))["rows"] == 0
            with pytest.raises(tq.RowsNotFound):
                await c.get_data(meta)


async def test_units_keep_their_hosts_across_a_controller_restart(tmp_path: Path) -> None:
    """Two storage units on two hosts (``--host-id``): a producer on the second host puts
    its rows there. The controller is SIGKILLed and restarted on its journal; the units,
    alive all along, are reconnected to (they do not register again): their hosts must be
    known still (before: they were forgotten, so placement went round robin across hosts
    and every client was told no unit is on its host)."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        ctl = stack.enter_context(_controller(bind, tmp_path))
        for unit, host in (("0", "host-a"), ("1", "host-b")):
            args = ("--host-id", host, "storage", "--controller", bind, "--unit-id", unit)
            stack.enter_context(serve_role(*args, line="TQ_UNIT="))
        async with tq.AsyncClient.connect(bind, request_timeout=10, host_id="host-b") as c:
            placed = [(await c.put(_rows(2, 2 * i), "p")).units for i in range(2)]
            assert placed == [[1, 1], [1, 1]]  # the producer's host
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=10)
        stack.enter_context(_controller(bind, tmp_path))
        async with tq.AsyncClient.connect(bind, request_timeout=10, host_id="host-b") as c:
            assert c._links.unit_hosts == {0: "host-a", 1: "host-b"}
            assert (await c.put(_rows(2, 4), "p")).units == [1, 1]


def test_a_journal_is_not_ignored_by_a_controller_started_at_memory(tmp_path: Path) -> None:
    """A durable controller's directory given to a controller started without
    ``--durability`` (the default, ``memory``): it must refuse to start, saying so (before:
    it started empty, silently ignoring the journal, which a later durable start would
    recover as it was before that run)."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with _controller(bind, data_dir) as ctl:
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=10)
    args = ("controller", "--bind", bind, "--data-dir", str(data_dir))
    with service(args, tmp_path / "stderr.txt") as svc, pytest.raises(RuntimeError) as info:
        svc.wait_line("TQ_ADDRESS=")
    assert "holds a controller's journal" in str(info.value)
    assert "--durability process" in str(info.value)


async def test_a_dp_end_of_stream_owed_to_a_rank_survives_a_restart(tmp_path: Path) -> None:
    """DP rank 0 reaches a stop_when_consumed end of stream at batch 1 (every row consumed,
    the partition not sealed); rows come, the controller is SIGKILLed and restarted on its
    journal before rank 1 asks batch 1: rank 1 must end there too (`ControllerState.dp_ends`
    is journaled), and once told, the index is decided anew for a next round."""
    bind = f"tcp://127.0.0.1:{free_port()}"

    def cfg(rank: int, index: int) -> dict[str, int]:
        return {"dp_size": 2, "dp_rank": rank, "batch_index": index}

    async def fetch(c: tq.AsyncClient, rank: int, index: int) -> tq.BatchMeta:
        return await c.get_meta(
            ["x"], 2, "p", "t", cfg(rank, index), stop_when_consumed=True, timeout=10
        )

    with ExitStack() as stack:
        ctl = stack.enter_context(_serve(bind, tmp_path))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            await c.put(_rows(4, 0), "p")
            assert (await fetch(c, 0, 0)).global_indexes == [0, 1]
            assert (await fetch(c, 1, 0)).global_indexes == [2, 3]
            assert (await fetch(c, 0, 1)).end_of_stream
            await c.put(_rows(4, 4), "p")  # more rows before rank 1 asks batch 1
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=10)
        stack.enter_context(_serve(bind, tmp_path))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            assert (await fetch(c, 1, 1)).end_of_stream  # in step with rank 0
            # a next round at the same index gets the new rows, both ranks alike
            assert (await fetch(c, 0, 1)).global_indexes == [4, 5]
            assert (await fetch(c, 1, 1)).global_indexes == [6, 7]


async def test_an_admitted_rollout_fetched_under_a_lease_that_lapses_across_a_restart(
    tmp_path: Path,
) -> None:
    """The learner fetches an admitted rollout under a lease and dies with the controller
    (SIGKILL); the controller restarts on its journal and the lease lapses: the rows go
    back to the learner and hold their admission slots again, so consuming them again frees
    them once (before: they stayed free, and the capacity admitted rows beyond it)."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "tq.toml"
    config.write_text('[admission]\ncapacity = 4\nlearner_task = "learn"\n')
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    args = ("controller", "--bind", bind, "--durability", "process", "--data-dir", str(data_dir))
    ctl: Any = None
    with ExitStack() as stack:
        ctl, _ = stack.enter_context(serve_role(*args, "--config", str(config)))
        stack.enter_context(serve_role("storage", "--controller", bind, line="TQ_UNIT="))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            await c.acquire_rollout(0, 4)
            await c.put(_rows(4, 0), "p", policy_version=0)
            await c.get_meta(["x"], 4, "p", "learn", lease=0.5)
            assert (await c.staleness_status())["outstanding"] == 0
            ctl.send_signal(signal.SIGKILL)
            ctl.wait(timeout=10)
            ctl, _ = stack.enter_context(serve_role(*args, "--config", str(config)))
            with anyio.fail_after(10):  # the lease runs out (no event tells a client)
                while True:
                    try:
                        if (await c.staleness_status())["outstanding"] == 4:
                            break
                    except tq.BrokenError:
                        pass  # the old controller's connection
            with pytest.raises(tq.TQTimeoutError):
                await c.acquire_rollout(0, 1, timeout=0.05)
            again = await c.get_meta(["x"], 4, "p", "learn", timeout=10)
            assert again.global_indexes == [0, 1, 2, 3]
            assert (await c.staleness_status())["outstanding"] == 0


async def test_what_a_loaded_checkpoint_owes_its_readers_survives_a_restart(
    tmp_path: Path,
) -> None:
    """A checkpoint holding a DP end of stream owed to rank 1 and three rows queued for
    ``take_recycled`` is loaded into a durable controller, which is SIGKILLed and restarted
    on its journal: rank 1 still ends at batch 1, and the queue is handed out once."""
    ckpt = tmp_path / "ckpt"

    def fetch(c: tq.AsyncClient, rank: int, index: int) -> Any:
        cfg = {"dp_size": 2, "dp_rank": rank, "batch_index": index}
        return c.get_meta(["x"], 2, "p", "t", cfg, stop_when_consumed=True, timeout=10)

    recycle = tq.StalenessSampler(max_staleness=0, on_stale="recycle")
    async with (
        tq.local_cluster(num_storage_units=1, task_samplers={"learner": recycle}) as cluster,
        tq.AsyncClient.connect(cluster.address) as c,
    ):
        await c.put(_rows(4, 0), "p")
        assert (await fetch(c, 0, 0)).global_indexes == [0, 1]
        assert (await fetch(c, 1, 0)).global_indexes == [2, 3]
        assert (await fetch(c, 0, 1)).end_of_stream
        await c.put(_rows(4, 4), "p")
        await c.put(_rows(4, 0), "q", policy_version=[0, 0, 0, 1])
        await c.set_policy_version(1)
        assert (await c.get_meta(["x"], 1, "q", "learner")).global_indexes == [3]
        await c.save_checkpoint(ckpt)
    bind = f"tcp://127.0.0.1:{free_port()}"
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with ExitStack() as stack:
        ctl = stack.enter_context(_serve(bind, data_dir))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            assert sorted(await c.load_checkpoint(ckpt)) == ["p", "q"]
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=10)
        stack.enter_context(_serve(bind, data_dir))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            assert (await fetch(c, 1, 1)).end_of_stream  # in step with rank 0
            assert [m.global_indexes for m in await c.take_recycled()] == [[0, 1, 2]]
            assert await c.take_recycled() == []


async def test_a_put_whose_commit_reply_died_with_the_controller_keeps_its_cells(
    tmp_path: Path,
) -> None:
    """A put's `PutCommit` is journaled, then the controller is SIGKILLed before its reply
    reaches the client: the put fails with `BrokenError` and its commit is in doubt (the
    rows may be there: whole, or absent). The client's undo cannot reach the controller, so
    the rows stay committed: their cells must stay on the unit too (before: the client told
    the unit to clear them whatever the controller's answer, and the restarted controller
    had rows whose cells were gone -- `RowsNotFound`, found by the chaos run)."""
    from tq_async._client._async._base import Links
    from tq_async._wire._protocol import PutCommit

    bind = f"tcp://127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        ctl = stack.enter_context(_controller(bind, tmp_path))
        stack.enter_context(
            serve_role("storage", "--controller", bind, "--unit-id", "0", line="TQ_UNIT=")
        )
        call = Links.call

        async def reply_lost(self: Links, body: Any, *args: Any, **kwargs: Any) -> Any:
            got = await call(self, body, *args, **kwargs)
            if isinstance(body, PutCommit):  # committed: the controller dies before replying
                ctl.send_signal(signal.SIGKILL)
                ctl.wait(timeout=10)
                raise tq.BrokenError("the controller went away (its reply with it)")
            return got

        # (no inline put: the rows go to the unit, and the commit is a request of its own)
        async with tq.AsyncClient.connect(bind, request_timeout=5, inline_put_bytes=0) as c:
            await c.put(_rows(2, 0), "p")  # (the unit and its connection are up)
            Links.call = reply_lost  # type: ignore[method-assign]
            try:
                with pytest.raises(tq.BrokenError):
                    await c.put(_rows(2, 100), "p")
            finally:
                Links.call = call  # type: ignore[method-assign]
        stack.enter_context(_controller(bind, tmp_path))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            meta = await c.get_meta(["x"], 4, "p", "audit", timeout=10)
            assert len(meta) == 4  # the put in doubt was committed: whole
            got = (await c.get_data(meta))["x"][:, 0].tolist()
            assert sorted(got) == [0, 1, 100, 101]
