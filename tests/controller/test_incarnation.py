"""A reused partition id: a BatchMeta of a cleared partition never reads a later incarnation.

Issue 14, defect 5. Every partition gets a random incarnation id when it is created (also by a
checkpoint restore); replies and BatchMetas carry it, and reads and meta-based writes of a
stale one fail with RowsNotFound. A BatchMeta built by hand (no incarnation) is checked as
before.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

import tq_async as tq
from _cluster_proc import serve_cluster
from tq_async._core._state import Partition
from tq_async._storage._cells import StorageState
from tq_async._wire._columns import ColumnHeader, ListColumn, column_to_frames

#: what every error about a stale BatchMeta says
STALE = "was cleared .*since this BatchMeta was made"
_BIG = 64 * 1024  # columns this large go straight to the units (not a one-message put)


def test_incarnations_are_random_not_counters() -> None:
    ids = {Partition("p").incarnation for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 16 for i in ids)


def test_batch_meta_keeps_its_incarnation() -> None:
    meta = tq.BatchMeta(
        partition_id="p", global_indexes=[0, 1, 2], field_names=["x"], units=[0, 0, 0]
    )
    assert meta.incarnation is None  # built by hand
    meta = msgspec.structs.replace(meta, incarnation="abc")
    assert meta.select_rows([0, 2]).incarnation == "abc"
    assert meta.select_fields(["x"]).incarnation == "abc"
    assert all(m.incarnation == "abc" for m in meta.chunk_every(2))
    assert tq.BatchMeta.concat(meta.chunk_every(2)).incarnation == "abc"
    other = msgspec.structs.replace(meta, incarnation="def")
    with pytest.raises(tq.InvalidRequestError, match="incarnation"):
        tq.BatchMeta.concat([meta, other])
    # a hand-built piece takes the incarnation of the others
    hand = msgspec.structs.replace(meta, incarnation=None)
    assert tq.BatchMeta.concat([hand, meta]).incarnation == "abc"


async def _stale_meta_fails(client: tq.AsyncClient, n: int) -> None:
    old = await client.put({"x": torch.arange(n)}, "train@0")
    assert old.incarnation is not None
    got = await client.get_meta(["x"], n, "train@0", "t")
    assert got.incarnation == old.incarnation
    await client.clear_partition("train@0")
    new = await client.put({"x": torch.arange(n) + 100}, "train@0")  # the id is reused
    assert new.incarnation not in (None, old.incarnation)
    for stale in (old, got):
        with pytest.raises(tq.RowsNotFound, match=STALE):
            await client.get_data(stale)
    with pytest.raises(tq.RowsNotFound, match=STALE):
        await client.put({"y": torch.zeros(n)}, meta=old)
    with pytest.raises(tq.RowsNotFound, match=STALE):
        await client.set_tags(old, [{"a": 1}] * n)
    with pytest.raises(tq.RowsNotFound, match=STALE):
        await client.clear_samples(old)
    with pytest.raises(tq.RowsNotFound, match=STALE):
        await client.release(got)
    # nothing of that touched the new incarnation
    assert (await client.get_data(new))["x"].tolist() == (torch.arange(n) + 100).tolist()
    assert (await client.partition_info("train@0"))["rows"] == n
    assert await client.consumption_status("train@0", "t") is not None
    # a BatchMeta built by hand is checked as before: the rows exist, so it reads them
    hand = msgspec.structs.replace(old, incarnation=None, units=new.units)
    assert (await client.get_data(hand))["x"].tolist() == (torch.arange(n) + 100).tolist()
    # puts with the current meta still work
    await client.put({"y": torch.ones(n)}, meta=new)
    assert (await client.get_data(new, ["y"]))["y"].tolist() == [1.0] * n


@pytest.mark.parametrize("n", [4, _BIG // 8])
async def test_stale_meta_of_a_reused_partition_id_gets_rows_not_found(n: int) -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await _stale_meta_fails(client, n)


async def test_stale_meta_with_tq_async_serve() -> None:
    with serve_cluster(storage_units=2) as address:
        async with tq.AsyncClient.connect(address, request_timeout=10) as client:
            await _stale_meta_fails(client, 4)
            await client.clear_partition("train@0")
            await _stale_meta_fails(client, _BIG // 8)


async def test_checkpoint_restore_gives_a_fresh_incarnation(tmp_path: object) -> None:
    path = f"{tmp_path}/ckpt"
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        before = await client.put({"x": torch.arange(4)}, "p")
        await client.save_checkpoint(path)
        await client.clear_partition("p")
        assert await client.load_checkpoint(path) == ["p"]
        after = await client.get_meta(["x"], 4, "p", "t")
        assert after.incarnation not in (None, before.incarnation)
        assert (await client.get_data(after))["x"].tolist() == [0, 1, 2, 3]
        with pytest.raises(tq.RowsNotFound, match=STALE):
            await client.get_data(before)


def _put(st: StorageState, rows: list[int], values: list[int], incarnation: str | None) -> None:
    header = ColumnHeader("x", "object")
    frames = column_to_frames(header, ListColumn(values))
    st.put("p", rows, [header], frames, incarnation=incarnation)


def _read(st: StorageState, rows: list[int], incarnation: str | None) -> list[object]:
    _, columns = st.get("p", rows, ["x"], incarnation=incarnation)
    column = columns[0]
    assert isinstance(column, ListColumn)
    return list(column.values)


def test_storage_unit_keeps_incarnations_apart() -> None:
    st = StorageState()
    _put(st, [0, 1], [1, 2], "A")
    assert _read(st, [0, 1], "A") == [1, 2]
    assert _read(st, [0, 1], None) == [1, 2]
    st.clear("p", None, incarnation="A")
    _put(st, [0, 1], [10, 20], "B")
    with pytest.raises(tq.RowsNotFound, match=STALE):
        _read(st, [0, 1], "A")
    assert _read(st, [0, 1], "B") == [10, 20]
    # a slow producer's put into the cleared incarnation never lands over the new one
    with pytest.raises(tq.RowsNotFound, match="cleared"):
        _put(st, [0, 1], [7, 7], "A")
    assert _read(st, [0, 1], None) == [10, 20]
    # the clear of an old incarnation arriving late does not wipe the new one
    st.clear("p", None, incarnation="A")
    assert _read(st, [0, 1], "B") == [10, 20]
    # a new incarnation whose put arrives before the old one's clear replaces its cells
    _put(st, [0], [99], "C")
    assert _read(st, [0], "C") == [99]
    with pytest.raises(tq.RowsNotFound):
        _read(st, [1], "C")
    assert st.stats().rows == 1


async def test_a_kv_meta_of_a_reused_partition_id_is_stale_too() -> None:
    # kv_retrieve_meta's BatchMeta (what compat's kv_batch_get reads through) carries the
    # incarnation as get_meta's does: after a clear and new puts under the same keys, it
    # reads nothing rather than the new rows
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        keys = ["a", "b", "c"]
        await client.kv_batch_put(keys, "kv", {"x": torch.arange(3)}, [{}] * 3)
        meta = await client.kv_retrieve_meta(keys, "kv")
        assert meta.incarnation is not None
        assert (await client.get_data(meta))["x"].tolist() == [0, 1, 2]
        await client.clear_partition("kv")
        await client.kv_batch_put(keys, "kv", {"x": torch.arange(3) + 100}, [{}] * 3)
        with pytest.raises(tq.RowsNotFound, match=STALE):
            await client.get_data(meta)
        fresh = await client.kv_retrieve_meta(keys, "kv")
        assert (await client.get_data(fresh))["x"].tolist() == [100, 101, 102]
        # a tags-only kv_batch_put's BatchMeta too
        tagged = await client.kv_batch_put(keys, "kv", None, [{"t": 1}] * 3)
        assert tagged.incarnation == fresh.incarnation is not None
        await client.clear_partition("kv")
        await client.kv_batch_put(keys, "kv", {"x": torch.arange(3)}, [{}] * 3)
        with pytest.raises(tq.RowsNotFound, match=STALE):
            await client.get_data(tagged)
