"""Listings answered from what the controller maintains: ``kv_list`` is cached per partition
and follows every change of keys and tags."""

from __future__ import annotations

import torch

import tq_async as tq
from tq_async._controller import _queries


async def test_kv_list_is_cached_until_keys_or_tags_change() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.kv_batch_put(["a", "b"], "p", {"x": torch.arange(2)}, tags=[{"t": 1}, {}])
        first = await client.kv_list("p")
        assert first == {"p": {"a": {"t": 1}, "b": {}}}
        p = cluster.controller.state.partitions["p"]
        cached = _queries._KV_LISTINGS[p]
        assert await client.kv_list("p") == first
        assert _queries._KV_LISTINGS[p] is cached  # nothing changed: the same answer
        await client.kv_put("b", "p", tag={"u": 2})  # a tag merged
        assert (await client.kv_list("p"))["p"]["b"] == {"u": 2}
        await client.kv_batch_put(["c"], "p", {"x": torch.arange(1)})  # a new key
        assert set((await client.kv_list())["p"]) == {"a", "b", "c"}
        await client.kv_clear(["a"], "p")  # a key gone
        assert set((await client.kv_list("p"))["p"]) == {"b", "c"}
        meta = await client.kv_retrieve_meta(["c"], "p")
        await client.set_tags(meta, [{"v": 3}])  # tags through a BatchMeta
        assert (await client.kv_list("p"))["p"]["c"] == {"v": 3}
        await client.clear_partition("p")
        await client.kv_put("a", "p", tag={"new": True})  # a new incarnation
        assert await client.kv_list("p") == {"p": {"a": {"new": True}}}
