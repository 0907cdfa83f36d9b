"""TransferQueue's ``BatchMeta`` through ``tq_async.compat`` (tutorials 03 and 04, verl's
worker dispatch): the constructor and schema API, assignable attributes, and global indexes
unique across partitions."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tq_async
import tq_async.compat as tq
from tq_async.compat import BatchMeta

_INT = {"dtype": torch.int64, "shape": (512,), "is_nested": False, "is_non_tensor": False}


def _batch(rows: list[int], fields: tuple[str, ...] = ("input_ids", "attention_mask")) -> BatchMeta:
    return BatchMeta(
        global_indexes=rows,
        partition_ids=["train_0"] * len(rows),
        field_schema={f: dict(_INT) for f in fields},
    )


def test_batch_meta_built_by_hand_and_its_operations() -> None:
    # tutorial 03, part 1: schema, readiness, per-row views
    ready = BatchMeta(
        global_indexes=[0, 1, 2],
        partition_ids=["train_0"] * 3,
        field_schema={"input_ids": dict(_INT)},
        production_status=np.array([1, 1, 1], dtype="int8"),
    )
    assert ready.is_ready
    assert not _batch([0, 1, 2]).is_ready
    assert ready.samples[0].fields["input_ids"]["shape"] == (512,)
    assert ready.get_dtypes("input_ids") == [torch.int64] * 3
    assert ready.get_shapes("input_ids") == [(512,)] * 3
    with pytest.raises(KeyError):
        ready.get_dtypes("nope")
    # part 2: add_fields, extra_info, custom_meta, selections, reorder, chunk, concat, union
    batch = _batch([0, 1, 2, 3, 4])
    batch.add_fields(
        TensorDict({"responses": torch.zeros(5, 128, dtype=torch.int64)}, batch_size=5)
    )
    assert batch.field_names == ["attention_mask", "input_ids", "responses"]
    assert batch.is_ready
    batch.extra_info["epoch"] = 1
    batch.update_custom_meta([{"uid": f"prompt@{i}"} for i in range(5)])
    assert batch.select_fields(["input_ids", "responses", "absent"]).field_names == [
        "input_ids",
        "responses",
    ]
    picked = batch.select_samples([0, 2, 4])
    assert picked.global_indexes == [0, 2, 4]
    assert picked.custom_meta[1] == {"uid": "prompt@2"}
    batch.reorder([4, 3, 2, 1, 0])
    assert batch.global_indexes == [4, 3, 2, 1, 0]
    assert batch.custom_meta[0] == {"uid": "prompt@4"}
    assert [c.size for c in _batch(list(range(10))).chunk(3)] == [4, 3, 3]
    joined = BatchMeta.concat([_batch([0, 1, 2]), _batch([3, 4, 5])])
    assert joined.global_indexes == [0, 1, 2, 3, 4, 5]
    both = _batch([0, 1, 2], ("input_ids",)).union(_batch([0, 1, 2], ("attention_mask",)))
    assert both.field_names == ["attention_mask", "input_ids"]
    empty = BatchMeta.empty()
    assert empty.size == 0
    assert empty.field_names == []
    copied = batch.copy()
    copied.custom_meta[0]["uid"] = "changed"
    assert batch.custom_meta[0] == {"uid": "prompt@4"}
    batch.clear_custom_meta()
    assert batch.custom_meta == [{}] * 5
    assert str(empty) == (
        "BatchMeta(size=0, field_names=[], is_ready=False, global_indexes=[], extra_info={})"
    )
    with pytest.raises(tq_async.InvalidRequestError, match="partition id per row"):
        BatchMeta(global_indexes=[0, 1], partition_ids=["p"])


def test_real_workflow_schema_and_assignable_extra_info() -> None:
    # tutorial 03, part 3, and verl's dispatch (meta.extra_info = {...} on a fetched batch)
    tq.init()
    client = tq.get_client()
    data = TensorDict(
        {"input_ids": torch.randint(0, 1000, (8, 512)), "attention_mask": torch.ones(8, 512)},
        batch_size=8,
    )
    put = client.put(data=data, partition_id="demo_partition")
    assert put.get_dtypes("attention_mask") == [torch.float32] * 8
    put.update_custom_meta([{"uid": i} for i in range(8)])
    client.set_custom_meta(put)
    meta = client.get_meta(
        data_fields=["input_ids", "attention_mask"], batch_size=8,
        partition_id="demo_partition", task_name="demo_task",
    )  # fmt: skip
    assert meta.custom_meta[3] == {"uid": 3}
    assert meta.get_dtypes("input_ids") == [torch.int64] * 8
    assert meta.get_shapes("input_ids") == [torch.Size([512])] * 8
    meta.extra_info = {"micro_batch_size": 2, "temperature": 1.0}
    chunks = meta.chunk(chunks=2)
    assert all(c.extra_info["micro_batch_size"] == 2 for c in chunks)
    assert client.get_data(chunks[1])["input_ids"].to_padded_tensor(0).shape == (4, 512)
    only_ids = client.get_data(meta.select_fields(["input_ids"]))
    assert list(only_ids.keys()) == ["input_ids"]
    partial = client.get_data(meta.select_samples([0, 2, 4, 6]))
    assert partial.batch_size == torch.Size([4])
    again = pickle.loads(pickle.dumps(meta))  # crosses processes (Ray, DataLoader workers)
    assert client.get_data(again).batch_size == torch.Size([8])
    with pytest.raises(tq_async.InvalidRequestError, match="built by hand"):
        client.get_data(_batch([0]))
    client.clear_partition(partition_id="demo_partition")


def test_global_indexes_are_unique_across_partitions() -> None:
    # tutorial 04: rows of a second partition do not reuse the first one's indexes
    tq.init()
    client = tq.get_client()
    two = TensorDict({"input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]])}, batch_size=2)
    train = client.put(data=two, partition_id="train")
    val = client.put(data=two, partition_id="val")
    assert train.global_indexes == [0, 1]
    assert not set(train.global_indexes) & set(val.global_indexes)
    got = client.get_meta(data_fields=["input_ids"], batch_size=2, partition_id="val",
                          task_name="val_task")  # fmt: skip
    assert got.global_indexes == val.global_indexes
    data = client.get_data(got)
    assert data["input_ids"].to_padded_tensor(0).tolist() == [[1, 2, 3], [4, 5, 6]]
    # columns added through a fetched batch, production status and keys use them too
    client.put(data=TensorDict({"y": torch.ones(2, 1)}, batch_size=2), metadata=got)
    rows, produced = client.get_production_status(["input_ids", "y"], "val")
    assert rows is not None
    assert produced is not None
    assert rows.tolist() == val.global_indexes
    assert produced.tolist() == [[1, 1], [1, 1]]  # a column per field
    tq.kv_put(key="k", partition_id="kv", fields={"x": torch.ones(1)})
    kv_rows = client.kv_retrieve_meta(keys=["k"], partition_id="kv")
    assert client.kv_retrieve_keys(kv_rows.global_indexes, partition_id="kv") == ["k"]
    assert sorted(client.get_partition_list()) == ["kv", "train", "val"]
    assert sorted(tq.kv_list()) == ["kv", "train", "val"]


@pytest.mark.parametrize("chunks", [np.int64(2), np.int32(2), torch.tensor(2)], ids=repr)
def test_chunk_takes_a_numpy_or_torch_int(chunks: Any) -> None:
    """A chunk count computed from a config (``np.int64``, a torch scalar) was refused as
    "chunks must be a positive int", where TransferQueue's ``chunk`` takes it. Both metas
    take any integral number (a bool, a float, 0 are still refused)."""
    meta = tq.BatchMeta(global_indexes=[0, 1, 2], partition_ids=["p"] * 3)
    assert [m.global_indexes for m in meta.chunk(chunks)] == [[0, 1], [2]]
    kv = tq.KVBatchMeta(keys=["a", "b", "c"], tags=[{}, {}, {}])
    assert [m.keys for m in kv.chunk(chunks)] == [["a", "b"], ["c"]]
    for bad in (True, 2.0, 0):
        with pytest.raises(tq_async.InvalidRequestError, match="chunks"):
            meta.chunk(bad)
        with pytest.raises(tq_async.InvalidRequestError, match="chunks"):
            kv.chunk(bad)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"global_indexes": None, "partition_ids": ["p"]}, "global_indexes"),
        ({"global_indexes": "01", "partition_ids": ["p", "p"]}, "global_indexes"),
        ({"global_indexes": [0.5], "partition_ids": ["p"]}, "global_indexes"),
        ({"global_indexes": [0, 1], "partition_ids": "pq"}, "partition_ids"),
        ({"global_indexes": [0], "partition_ids": None}, "partition_ids"),
        ({"global_indexes": [0], "partition_ids": ["p"], "field_schema": ["x"]}, "field_schema"),
        ({"global_indexes": [0], "partition_ids": ["p"], "extra_info": [1]}, "extra_info"),
        ({"global_indexes": [0], "partition_ids": ["p"], "custom_meta": [1]}, "custom_meta"),
    ],
)
def test_a_batch_meta_of_bad_arguments_names_them(kwargs: dict[str, Any], named: str) -> None:
    """``BatchMeta`` built with ``None`` indexes, a schema, ``extra_info`` or ``custom_meta``
    of the wrong type failed with Python's own TypeError / AttributeError, and strings were
    split: ``partition_ids="pq"`` gave partitions 'p' and 'q', ``global_indexes="01"`` rows
    0 and 1. Each is an InvalidRequestError naming the argument."""
    with pytest.raises(tq_async.InvalidRequestError, match=f"BatchMeta {named}"):
        BatchMeta(**kwargs)


def test_a_batch_meta_takes_numpy_indexes_and_partition_ids() -> None:
    meta = BatchMeta(global_indexes=np.arange(2), partition_ids=np.array(["p", "p"]))
    assert meta.global_indexes == [0, 1]
    assert meta.partition_ids == ["p", "p"]
    assert type(meta.partition_ids[0]) is str


def test_add_fields_of_a_dict_says_to_pass_a_tensordict() -> None:
    """``add_fields({"y": tensor})`` failed with AttributeError ("'dict' object has no
    attribute 'batch_size'"); it is an InvalidRequestError saying what to pass."""
    meta = BatchMeta(global_indexes=[0, 1], partition_ids=["p", "p"])
    with pytest.raises(tq_async.InvalidRequestError, match="add_fields takes a TensorDict"):
        meta.add_fields({"y": torch.ones(2, 3)})  # type: ignore[arg-type]
    meta.add_fields(TensorDict({"y": torch.ones(2, 3)}, batch_size=[2]))
    assert meta.field_names == ["y"]
