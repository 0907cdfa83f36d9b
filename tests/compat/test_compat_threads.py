"""compat's client over the blocking ``tq.Client``: concurrent ``async_`` calls (worker
threads) and several trainer threads share one ``TransferQueueClient``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

import anyio
import pytest
import torch
from tensordict import TensorDict

import tq_async
import tq_async.compat as tq


async def test_a_waiting_async_get_meta_and_the_put_it_waits_for_run_at_once() -> None:
    tq.init()
    client = tq.get_client()

    async def put_later() -> None:
        await client.async_put(TensorDict({"x": torch.arange(4)}, batch_size=4), partition_id="p")

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            got: list[tq.BatchMeta] = []

            async def get() -> None:
                got.append(await client.async_get_meta(["x"], 4, "p", task_name="t"))

            tg.start_soon(get)  # the get_meta waits on one worker thread ...
            tg.start_soon(put_later)  # ... while the put runs on another
    assert len(got[0]) == 4


def test_trainer_threads_share_the_process_client() -> None:
    tq.init()
    keys = [f"k{i}" for i in range(8)]
    tq.kv_batch_put(keys, "p", TensorDict({"x": torch.arange(8)}, batch_size=8))
    out: list[list[int]] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            out.extend(tq.kv_batch_get(keys, "p")["x"].tolist() for _ in range(20))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert out == [list(range(8))] * 80


async def test_an_async_get_meta_that_timed_out_takes_no_rows() -> None:
    # verl-style: a waiting async_get_meta given up on (asyncio.wait_for's timeout cancels
    # it while its request waits at the service) consumes nothing: rows put afterwards stay
    # for the task's next read (docs/guarantees.md, "Cancellation")
    tq.init()
    client = tq.get_client()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(client.async_get_meta(["x"], 2, "p", task_name="t"), 0.2)
    await client.async_put(TensorDict({"x": torch.arange(2)}, batch_size=2), partition_id="p")
    got = await asyncio.wait_for(client.async_get_meta(["x"], 2, "p", task_name="t"), 10)
    assert sorted(got.global_indexes) == [0, 1]
    assert (await client.async_get_data(got))["x"].tolist() == [0, 1]


async def test_an_async_put_given_up_on_leaves_no_rows() -> None:
    # the caller times out while its put is on the way (held in data_parser, which runs
    # on the put's worker thread): the rows it went on to write are reclaimed, as a cancelled
    # put's are (docs/guarantees.md, "Cancellation"), so a retry writes them once
    tq.init()
    client = tq.get_client()
    entered, go = threading.Event(), threading.Event()

    def held(columns: dict[str, object]) -> dict[str, object]:
        entered.set()
        go.wait(10)
        return columns

    data = TensorDict({"x": torch.arange(3)}, batch_size=3)
    put = client.async_put(data, partition_id="p", data_parser=held)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(put, 0.2)
    assert entered.is_set()
    go.set()  # the put goes on after its caller gave up
    deadline = time.monotonic() + 10
    info: dict[str, object] = {}
    while time.monotonic() < deadline:  # no event tells when a worker thread's put ends
        with contextlib.suppress(tq_async.PartitionNotFound):
            info = client.client.partition_info("p")
        if info.get("allocated") == 3 and not info.get("uncommitted_puts") and not info["rows"]:
            break
        await asyncio.sleep(0.02)
    assert (info.get("allocated"), info.get("rows")) == (3, 0)
    again = await client.async_put(data, partition_id="p")  # the retry
    assert client.get_production_status(["x"], "p")[1].tolist() == [[0], [0], [0], [1], [1], [1]]
    assert (await client.async_get_data(again))["x"].tolist() == [0, 1, 2]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_threads_that_ended_leave_no_connections_open() -> None:
    # a thread per request (a web handler, a pool made per step) calling the KV API: the
    # connection each thread opened goes with it, so a long run never runs out of files
    tq.init()
    tq.kv_put(key="k", partition_id="p", fields={"x": torch.ones(2)})

    def read() -> None:
        assert tq.kv_batch_get(keys=["k"], partition_id="p")["x"].values().tolist() == [1, 1]

    first = threading.Thread(target=read)  # one ended thread's connection, as a baseline
    first.start()
    first.join()
    before = _open_fds()
    for _ in range(30):
        thread = threading.Thread(target=read)
        thread.start()
        thread.join()
    read()
    assert _open_fds() <= before + 16  # one connection's sockets (8 each) when they leaked
