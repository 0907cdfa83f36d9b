"""Listings answered from what the controller maintains: ``kv_list`` is cached per partition
and follows every change of keys and tags."""

from __future__ import annotations

from typing import Any

import msgspec
import torch

import tq_async as tq
from tq_async._controller import _queries
from tq_async._core._state import KV_CHUNK_BITS
from tq_async._wire._protocol import KVList


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


def _answers(cluster: tq.LocalCluster, pid: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The packed answer (decoded) and the map answer of ``pid``, from the controller."""
    core = cluster.controller.core
    packed = msgspec.msgpack.decode(_queries.kv_list(core, KVList(pid, packed=True))[pid])
    n, keys, tags = packed
    keys, tags = msgspec.msgpack.decode(keys), msgspec.msgpack.decode(tags)
    assert n == len(keys) == len(tags)
    as_map = msgspec.msgpack.decode(_queries.kv_list(core, KVList(pid))[pid])
    return dict(zip(keys, tags, strict=True)), as_map


async def test_the_packed_listing_re_encodes_only_changed_chunks_and_stays_right() -> None:
    chunk = 1 << KV_CHUNK_BITS
    n = 2 * chunk + 100  # three chunks
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        keys = [f"k{i}" for i in range(n)]
        await client.kv_batch_put(
            keys, "p", {"x": torch.arange(n)}, tags=[{"i": i} for i in range(n)]
        )
        model = {k: {"i": i} for i, k in enumerate(keys)}
        packed, as_map = _answers(cluster, "p")
        assert packed == as_map == model
        assert list(packed) == keys

        p = cluster.controller.state.partitions["p"]
        cache = _queries._KV_LISTINGS[p]
        before = dict(cache._keys), dict(cache._tags)
        await client.kv_put("k5", "p", tag={"x": 1})  # chunk 0
        model["k5"]["x"] = 1
        await client.kv_clear([f"k{chunk + 1}", f"k{chunk + 2}"], "p")  # chunk 1
        del model[f"k{chunk + 1}"], model[f"k{chunk + 2}"]
        await client.kv_batch_put(["new"], "p", {"x": torch.arange(1)})  # chunk 2
        model["new"] = {}
        packed, as_map = _answers(cluster, "p")
        assert packed == as_map == model
        assert list(packed) == list(model)
        assert cache._keys[0] == before[0][0]  # chunk 0's keys were kept, its tags not
        assert cache._tags[0] != before[1][0]

        first = [k for k in model if k != "new" and int(k[1:]) < chunk]
        await client.kv_clear(first, "p")  # chunk 0 emptied
        model = {k: v for k, v in model.items() if k not in first}
        packed, as_map = _answers(cluster, "p")
        assert packed == as_map == model
        assert 0 not in cache._keys  # an empty chunk leaves the answer
        listing = (await client.kv_list("p"))["p"]
        assert isinstance(listing, tq.KVListing)
        assert listing == model
        assert len(listing) == len(model)


async def test_a_listing_is_not_kept_in_the_reply_cache() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.kv_put("a", "p", {"x": torch.zeros(1)}, {"t": 1})
        remembered = len(cluster.controller._shell.replies)
        for _ in range(3):
            assert await client.kv_list("p") == {"p": {"a": {"t": 1}}}
        assert len(cluster.controller._shell.replies) == remembered
