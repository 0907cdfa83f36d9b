"""Leases: unacknowledged batches come back (at-least-once), acknowledged ones never do."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import anyio
import pytest
import torch

import tq_async as tq

DYING_CONSUMER = textwrap.dedent(
    """
    import os, sys, tq_async as tq
    with tq.Client.connect(sys.argv[1]) as client:
        td, meta = client.get(["x"], 4, "p", "learner", lease=0.5)
        print(td["x"].tolist(), flush=True)
        os._exit(3)   # dies holding the lease, before acknowledging
    """
)


async def test_rows_of_a_consumer_that_died_holding_a_lease_are_redelivered() -> None:
    async with (
        tq.local_cluster(num_storage_units=1, transport="tcp") as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(4)}, "p")

        def run_consumer() -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-c", DYING_CONSUMER, cluster.address],
                capture_output=True,
                text=True,
                timeout=60,
            )

        done = await anyio.to_thread.run_sync(run_consumer)
        assert done.returncode == 3
        assert done.stdout.strip() == "[0, 1, 2, 3]"
        # the restarted consumer gets the same rows once the lease expires (no loss)
        td, meta = await client.get(["x"], 4, "p", "learner", lease=30, timeout=10)
        assert td["x"].tolist() == [0, 1, 2, 3]
        await client.ack(meta)
        assert await client.check_consumption_status("p", "learner")


async def test_acknowledged_batches_are_never_redelivered() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(8)}, "p")
        first = await client.get_meta(["x"], 4, "p", "t", lease=0.2)
        assert first.lease_id
        await client.ack(first)
        # acknowledge the next one on the request after it
        second = await client.get_meta(["x"], 4, "p", "t", lease=0.2)
        await client.get_meta(["x"], 1, "p", "other", ack=second)  # carries the ack
        # wait past both leases: nothing comes back (the timeout is the observation window)
        with pytest.raises(tq.TQTimeoutError):
            await client.get_meta(["x"], 1, "p", "t", timeout=0.5)
        assert await client.check_consumption_status("p", "t")


async def test_unacknowledged_lease_expires_and_exactly_once_for_ackers() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(6)}, "p")
        lost = await client.get_meta(["x"], 3, "p", "t", lease=0.1)  # never acknowledged
        acked: list[int] = []
        while len(acked) < 6:
            meta = await client.get_meta(["x"], 3, "p", "t", lease=5, timeout=5)
            acked.extend(meta.global_indexes)
            await client.ack(meta)
        assert sorted(acked) == list(range(6))  # each row acknowledged exactly once
        assert set(lost.global_indexes) <= set(acked)
        with pytest.raises(tq.InvalidRequestError, match="lease"):
            await client.get_meta(["x"], 1, "p", "t", lease=0)


async def test_partition_info_counts_only_leased_rows_that_still_exist() -> None:
    """`partition_info()["leased"]` (and `tq-async status`) counts the rows a task holds
    under lease: rows cleared while leased are no longer there to hold. Before, an open
    lease counted every row it was given, so the status showed leased rows the partition
    did not have (3 leased of 1 row)."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(3)}, "p")
        meta = await client.get_meta(["x"], 3, "p", "t", lease=60)
        assert (await client.partition_info("p"))["leased"] == {"t": 3}
        await client.clear_samples(meta.select_rows([0, 1]))
        info = await client.partition_info("p")
        assert (info["rows"], info["leased"]) == (1, {"t": 1})
        await client.clear_samples(meta.select_rows([2]))
        assert (await client.partition_info("p"))["leased"] == {}
        assert cluster.controller.waiting == 0
