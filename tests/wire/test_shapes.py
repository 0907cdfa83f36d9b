"""Row shapes that change from put to put (issue 16, item 1).

Dense when the rows read share a shape, jagged otherwise, always nested on request; a dtype
or dimension-count change is an error; rows ragged in more than one dimension raise a clear
error when read together.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import tq_async as tq
from tq_async._wire._columns import ColumnHeader, DenseColumn, JaggedColumn, join_columns


def _lengths(t: torch.Tensor) -> list[int]:
    return [int(r.shape[0]) for r in t.unbind()]


@pytest.mark.parametrize("units", [1, 2])
async def test_padded_rollouts_of_different_lengths(units: int) -> None:
    async with (
        tq.local_cluster(num_storage_units=units) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        a = await client.put({"responses": torch.ones(2, 5, dtype=torch.int64)}, partition_id="p")
        b = await client.put({"responses": torch.zeros(2, 7, dtype=torch.int64)}, partition_id="p")
        # rows of one put share a shape: dense
        dense = (await client.get_data(a))["responses"]
        assert not dense.is_nested
        assert dense.shape == (2, 5)
        # rows of both: jagged, in the batch's order
        both = tq.BatchMeta.concat([b, a])
        got = (await client.get_data(both))["responses"]
        assert got.is_nested
        assert _lengths(got) == [7, 7, 5, 5]
        assert got.unbind()[0].tolist() == [0] * 7
        assert got.unbind()[3].tolist() == [1] * 5
        # the streaming path (get, possibly inline) follows the same rule
        td, meta = await client.get(["responses"], 4, "p", "learner")
        assert _lengths(td["responses"]) == [5, 5, 7, 7]
        assert meta.global_indexes == [0, 1, 2, 3]


async def test_nested_option_always_returns_nested() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        meta = await client.put(
            {"responses": torch.arange(6).view(2, 3), "score": torch.rand(2)}, partition_id="p"
        )
        got = await client.get_data(meta, nested=["responses"])
        assert got["responses"].is_nested
        assert [r.tolist() for r in got["responses"].unbind()] == [[0, 1, 2], [3, 4, 5]]
        assert not got["score"].is_nested
        everything = await client.get_data(meta, nested=True)
        assert everything["responses"].is_nested
        assert not everything["score"].is_nested  # scalar rows have no dimension to be ragged
        td, _ = await client.get(["responses"], 2, "p", "t", nested=True)
        assert td["responses"].is_nested
        for bad in ("responses", 3, [1]):
            with pytest.raises(tq.InvalidRequestError, match="nested"):
                await client.get_data(meta, nested=bad)  # type: ignore[arg-type]


async def test_kv_put_per_key_lengths() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        for i, length in enumerate([3, 5, 4]):
            await client.kv_put(f"k{i}", "p", {"response": torch.full((length,), i)})
        got = await client.kv_batch_get(["k0", "k1", "k2"], "p")
        assert _lengths(got["response"]) == [3, 5, 4]
        one = await client.kv_batch_get(["k1"], "p")
        assert one["response"].shape == (1, 5)  # one key: dense
        # a key rewritten with another length reads back with its new length
        await client.kv_put("k0", "p", {"response": torch.full((6,), 9)})
        assert _lengths((await client.kv_batch_get(["k0", "k2"], "p"))["response"]) == [6, 4]


async def test_kv_put_of_a_numpy_value_is_a_row_as_a_tensor_is() -> None:
    # a numpy value became a list of one array: a jagged row (a 0-dim one failed), where
    # the same value as a tensor is a dense row
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.kv_put("k", "p", {"x": np.arange(3), "s": np.array(2.5), "t": np.array("hi")})
        got = await client.kv_batch_get(["k"], "p")
        assert not got["x"].is_nested
        assert got["x"].tolist() == [[0, 1, 2]]
        assert got["s"].tolist() == [2.5]
        assert got.get("t").tolist() == ["hi"]


async def test_dense_and_jagged_puts_mix() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        a = await client.put({"x": torch.ones(1, 2, 3)}, partition_id="p")
        jag = torch.nested.nested_tensor(
            [torch.zeros(1, 3), torch.zeros(4, 3)], layout=torch.jagged
        )
        b = await client.put({"x": jag}, partition_id="p")
        got = (await client.get_data(tq.BatchMeta.concat([a, b])))["x"]
        assert _lengths(got) == [2, 1, 4]
        assert got.unbind()[0].shape == (2, 3)


async def test_dtype_and_dimension_changes_stay_errors() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.zeros(2, 3, dtype=torch.int64)}, partition_id="p")
        with pytest.raises(tq.SchemaError, match=r"int64.*int32.*dtype"):
            await client.put({"x": torch.zeros(2, 4, dtype=torch.int32)}, partition_id="p")
        with pytest.raises(tq.SchemaError, match="dimensions"):
            await client.put({"x": torch.zeros(2, dtype=torch.int64)}, partition_id="p")


async def test_rows_ragged_in_two_dimensions_raise_when_read_together() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        a = await client.put({"img": torch.zeros(1, 2, 3)}, partition_id="p")
        b = await client.put({"img": torch.ones(1, 4, 5)}, partition_id="p")
        assert (await client.get_data(a))["img"].shape == (1, 2, 3)  # apart: fine
        assert (await client.get_data(b))["img"].shape == (1, 4, 5)
        with pytest.raises(tq.SchemaError, match="more than their first dimension"):
            await client.get_data(tq.BatchMeta.concat([a, b]))


async def test_checkpoint_of_a_field_with_changing_shapes(tmp_path: Path) -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"r": torch.ones(2, 2)}, partition_id="p")
        await client.put({"r": torch.ones(1, 3)}, partition_id="p")
        await client.save_checkpoint(tmp_path / "c")
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.load_checkpoint(tmp_path / "c")
        td, _ = await client.get(["r"], 3, "p", "t")  # placement changed: ask again
        assert _lengths(td["r"]) == [2, 2, 3]


def _dense(shape: tuple[int, ...], rows: int, fill: int) -> tuple[ColumnHeader, DenseColumn]:
    header = ColumnHeader("f", "dense", "int64", shape)
    data = np.full((rows, *shape), fill, dtype=np.int64)
    return header, DenseColumn(data.reshape(rows, -1).view(np.uint8))


def test_join_columns_rule() -> None:
    h1, c1 = _dense((2,), 2, 1)
    h2, c2 = _dense((3,), 1, 2)
    header, joined = join_columns([h1, h1], [c1, c1])
    assert header == h1
    assert isinstance(joined, DenseColumn)
    header, joined = join_columns([h1, h2], [c1, c2])
    assert header == ColumnHeader("f", "jagged", "int64", ())
    assert isinstance(joined, JaggedColumn)
    assert joined.offsets.tolist() == [0, 2, 4, 7]
    h3, c3 = _dense((2, 2), 1, 0)
    h4, c4 = _dense((2, 3), 1, 0)
    with pytest.raises(tq.SchemaError, match="first dimension"):
        join_columns([h3, h4], [c3, c4])
    with pytest.raises(tq.SchemaError, match="incompatible"):
        join_columns([h1, h3], [c1, c3])


def test_blocking_client_takes_nested_too() -> None:
    with (
        tq.background_cluster(num_storage_units=1) as cluster,
        tq.Client.connect(cluster.address) as client,
    ):
        meta = client.put({"r": torch.ones(2, 3)}, partition_id="p")
        assert client.get_data(meta, nested=True)["r"].is_nested
        td, _ = client.get(["r"], 2, "p", "t", nested=["r"])
        assert _lengths(td["r"]) == [3, 3]
