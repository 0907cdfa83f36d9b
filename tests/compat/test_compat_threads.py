"""compat's client over the blocking ``tq.Client``: concurrent ``async_`` calls (worker
threads) and several trainer threads share one ``TransferQueueClient``."""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest
import torch
from tensordict import TensorDict

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
