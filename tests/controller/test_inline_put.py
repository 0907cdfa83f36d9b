"""The one-message put (``PutInline``): small puts go to the controller, which stores them.

The three-step put (PutBegin -> StorePut -> PutCommit) is covered everywhere else with
``inline_put_bytes=0`` or with batches above the limit; here: which path a put takes, that
both give the same result, and that a failed one-message put leaves nothing behind.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

import tq_async as tq
from tq_async._controller._server import ControllerServer
from tq_async._wire._codec import columns_from_batch
from tq_async._wire._columns import column_to_frames
from tq_async._wire._protocol import PutInline


def count_requests(controller: ControllerServer) -> dict[str, int]:
    """Count the controller's requests by type (wraps its handlers)."""
    seen: dict[str, int] = {}

    def counting(handler: Any) -> Any:
        def handle(msg: Any, body: object) -> Any:
            seen[type(body).__name__] = seen.get(type(body).__name__, 0) + 1
            return handler(msg, body)

        return handle

    controller.handlers = {typ: counting(h) for typ, h in controller.handlers.items()}
    return seen


async def test_small_put_is_one_request_and_never_touches_a_unit() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        seen = count_requests(cluster.controller)
        meta = await client.put(
            {"x": torch.arange(4), "s": ["a", "b", "c", "d"]},
            "p",
            tags=[{"uid": i} for i in range(4)],
            policy_version=3,
        )
        assert seen == {"PutInline": 1}
        assert not client._links.units  # the client did not connect to any unit
        assert meta.global_indexes == [0, 1, 2, 3]
        assert len(set(meta.units)) == 1
        assert [t["uid"] for t in meta.tags] == [0, 1, 2, 3]
        # a new field for those rows (one unit): one message too
        meta = await client.put({"y": torch.ones(4)}, meta=meta)
        assert seen == {"PutInline": 2}
        td, got = await client.get(["x", "s", "y"], 4, "p", "t")
        assert td["x"].tolist() == [0, 1, 2, 3]
        assert list(td["s"]) == ["a", "b", "c", "d"]
        assert td["y"].tolist() == [1.0] * 4
        assert got.policy_versions["x"] == [3] * 4
        assert [t["uid"] for t in got.tags] == [0, 1, 2, 3]


async def test_big_puts_and_puts_over_several_units_take_three_steps() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address, inline_put_bytes=1024) as client,
    ):
        seen = count_requests(cluster.controller)
        big = await client.put({"x": torch.zeros(256, dtype=torch.float64)}, "p")  # 2 KiB
        assert seen == {"PutBegin": 1, "PutCommit": 1}
        small = await client.put({"x": torch.zeros(2, dtype=torch.float64)}, "p")
        assert seen["PutInline"] == 1
        assert set(big.units) != set(small.units)  # round-robin over the units
        both = tq.BatchMeta.concat([big.select_rows([0]), small.select_rows([0])])
        await client.put({"y": torch.ones(2)}, meta=both)  # rows on two units
        assert seen == {"PutBegin": 2, "PutCommit": 2, "PutInline": 1}
        td, _ = await client.get(["x", "y"], 2, "p", "t", sampling_config=None)
        assert td["y"].tolist() == [1.0, 1.0]


async def test_inline_put_bytes_zero_disables_it() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address, inline_put_bytes=0) as client,
    ):
        seen = count_requests(cluster.controller)
        await client.put({"x": torch.arange(2)}, "p")
        assert seen == {"PutBegin": 1, "PutCommit": 1}
    with pytest.raises(tq.InvalidRequestError, match="inline_put_bytes"):
        tq.AsyncClient("tcp://127.0.0.1:1", inline_put_bytes=-1)


async def test_failed_inline_put_leaves_no_rows() -> None:
    """The unit refuses the columns (pickle not allowed): the rows placed for them go away."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address, allow_pickle=True) as client,
    ):
        await client.put({"x": torch.arange(2)}, "p")
        with pytest.raises(tq.SchemaError, match="pickle"):
            await client.put({"x": torch.arange(1), "obj": [object()]}, "p")
        info = await client.partition_info("p")
        assert info["rows"] == 2
        got = await client.get_meta(["x"], 2, "p", "t", mode="peek")
        assert got.global_indexes == [0, 1]
        assert cluster.units[0].state.stats().rows == 2


async def test_inline_put_failing_at_commit_is_undone() -> None:
    """Tags are checked at commit, after the unit stored the columns: both are undone."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(2)}, "p")
        n, headers, columns = columns_from_batch({"x": torch.arange(2, 4)}, allow_pickle=False)
        frames = [f for h, c in zip(headers, columns, strict=True) for f in column_to_frames(h, c)]
        body = PutInline("p", headers, n_rows=n, tags=[{"uid": 1}])  # 1 tag dict, 2 rows
        with pytest.raises(tq.InvalidRequestError, match="tag dicts"):
            await client._links.ctl().request(body, frames, timeout=10)
        assert (await client.partition_info("p"))["rows"] == 2
        assert cluster.units[0].state.stats().rows == 2
        got = await client.get_meta(["x"], 2, "p", "t", mode="peek")
        assert got.global_indexes == [0, 1]


async def test_blocking_client_takes_the_option() -> None:
    async with tq.local_cluster(num_storage_units=1) as cluster:
        seen = count_requests(cluster.controller)

        def blocking_puts() -> None:
            for limit in (0, 65536):
                with tq.Client.connect(cluster.address, inline_put_bytes=limit) as client:
                    client.put({"x": torch.arange(2)}, "p")

        await anyio.to_thread.run_sync(blocking_puts)
        assert seen == {"Hello": 2, "PutBegin": 1, "PutCommit": 1, "PutInline": 1}
