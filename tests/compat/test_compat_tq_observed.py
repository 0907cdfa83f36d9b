"""What TransferQueue 0.1.11 does, observed by running the same calls on it (``pip install
transferqueue==0.1.11``, Ray with 4 CPUs) and on ``tq_async.compat``: each test names the
TransferQueue call that showed the behaviour it asserts. None needs TransferQueue installed."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import tq_async
import tq_async.compat as tq


def test_put_into_a_batch_adds_the_fields_to_that_batch() -> None:
    # TransferQueue: client.put(data, metadata=meta) returns meta itself, with the new field
    # (its put ends with metadata.add_fields(data)): get_data(meta) then reads it too
    tq.init()
    client = tq.get_client()
    client.put(data=TensorDict({"prompt": torch.arange(4).view(2, 2)}, batch_size=2),
               partition_id="p")  # fmt: skip
    meta = client.get_meta(data_fields=["prompt"], batch_size=2, partition_id="p", task_name="g")
    meta.extra_info["step"] = 3
    written = client.put(data=TensorDict({"resp": torch.ones(2, 3)}, batch_size=2), metadata=meta)
    assert written is meta
    assert meta.field_names == ["prompt", "resp"]
    assert meta.is_ready
    assert meta.extra_info == {"step": 3}
    assert sorted(client.get_data(meta).keys()) == ["prompt", "resp"]
    assert meta.field_schema["resp"]["dtype"] == torch.float32
    # a batch whose schema was read before the put learns the new field's schema too
    again = client.get_meta(data_fields=["prompt"], batch_size=2, partition_id="p", task_name="h")
    assert again.field_schema["prompt"]["dtype"] == torch.int64
    client.put(data=TensorDict({"score": torch.zeros(2)}, batch_size=2), metadata=again)
    assert again.field_names == ["prompt", "score"]
    assert again.field_schema["score"]["dtype"] == torch.float32


def test_kv_batch_get_of_keys_that_share_no_field_raises_a_value_error() -> None:
    # TransferQueue: kv_batch_get of a key put with a tag only, or of keys sharing no field,
    # raises ValueError("Some fields are not ready in all the requested keys!") (with or
    # without select_fields); keys that share a field give it
    tq.init()
    tq.kv_put(key="a", partition_id="p", fields={"x": torch.tensor([1])})
    tq.kv_put(key="b", partition_id="p", fields={"y": torch.tensor([2])})
    tq.kv_put(key="c", partition_id="p", tag={"state": "queued"})
    for keys, select in ((["c"], None), (["a", "c"], None), (["a", "b"], None), (["a", "c"], "x")):
        with pytest.raises(ValueError, match="no field") as info:
            tq.kv_batch_get(keys=keys, partition_id="p", select_fields=select)
        assert isinstance(info.value, tq_async.TQError)
        assert "'c'" in str(info.value) or keys == ["a", "b"]
    meta = tq.kv_batch_put(keys=["c"], partition_id="p", tags=[{"state": "queued"}])
    with pytest.raises(ValueError, match="no field"):
        tq.kv_batch_get_by_meta(meta)
    tq.kv_put(key="c", partition_id="p", fields={"x": torch.tensor([3])})
    got = tq.kv_batch_get(keys=["a", "c"], partition_id="p")
    assert got["x"].values().tolist() == [1, 3]


def test_production_status_has_a_column_per_field() -> None:
    # TransferQueue: get_production_status(["prompt", "resp"], pid) gives (row ids, an int8
    # [rows, fields] tensor: 1 where the row has the field), a column per field in the
    # partition's order; (None, None) for a field the partition does not have, or no field
    tq.init()
    client = tq.get_client()
    client.put(data=TensorDict({"prompt": torch.zeros(4, 2)}, batch_size=4), partition_id="p")
    meta = client.get_meta(data_fields=["prompt"], batch_size=2, partition_id="p", task_name="g")
    client.put(data=TensorDict({"resp": torch.ones(2, 3)}, batch_size=2), metadata=meta)
    rows, status = client.get_production_status(data_fields=["resp", "prompt"], partition_id="p")
    assert rows is not None
    assert status is not None
    assert rows.tolist() == [0, 1, 2, 3]
    assert status.dtype == torch.int8
    assert status.tolist() == [[1, 1], [1, 1], [1, 0], [1, 0]]
    assert client.get_production_status(["resp"], "p")[1].tolist() == [[1], [1], [0], [0]]
    assert client.get_production_status(["prompt", "nope"], "p") == (None, None)
    assert client.get_production_status([], "p") == (None, None)
    assert client.check_production_status(["prompt"], "p")
    assert not client.check_production_status(["prompt", "resp"], "p")


def test_rows_ragged_in_one_later_dimension_come_back_jagged() -> None:
    # TransferQueue: kv_batch_get of rows (2, 3) and (2, 4) gives a jagged nested tensor (its
    # ragged dimension the rows' last, as torch.nested.as_nested_tensor(rows,
    # layout=torch.jagged) builds it); rows ragged in two dimensions a strided one
    tq.init()
    for i, length in enumerate((3, 5)):
        position_ids = torch.arange(4 * length).view(4, length)  # Qwen-VL's (4, L)
        tq.kv_put(key=f"q{i}", partition_id="v", fields={"position_ids": position_ids})
    got = tq.kv_batch_get(keys=["q0", "q1"], partition_id="v")["position_ids"]
    assert got.layout == torch.jagged
    assert got.to_padded_tensor(-1).shape == (2, 4, 5)
    assert torch.equal(got.unbind()[1], torch.arange(20).view(4, 5))
    images = [torch.ones(3, 2, 2), torch.zeros(3, 4, 4)]
    tq.kv_batch_put(keys=["a", "b"], partition_id="w",
                    fields={"uid": torch.arange(2), "img": images})  # fmt: skip
    assert tq.kv_batch_get(keys=["a", "b"], partition_id="w")["img"].layout == torch.strided


def test_select_samples_refuses_positions_outside_the_batch() -> None:
    # TransferQueue: BatchMeta.select_samples([-1]) and ([3]) of 3 rows raise ValueError("Sample
    # indices must be in range [0, 3)"); a negative position never picks a row from the end
    batch = tq.BatchMeta(global_indexes=[0, 1, 2], partition_ids=["p"] * 3)
    for positions in ([-1], [3], [0, 5]):
        with pytest.raises(ValueError, match=r"0\.\.2") as info:
            batch.select_samples(positions)
        assert isinstance(info.value, tq_async.TQError)
    assert batch.select_samples([2, 0, 2]).global_indexes == [2, 0, 2]
    assert batch.select_samples([]).size == 0


def test_the_clients_kv_list_is_the_programs_partitions() -> None:
    # TransferQueue: get_client().kv_list() lists the program's partitions, kv_list("nope") of
    # a partition never put to is {} (as the module's kv_list)
    tq.init()
    client = tq.get_client()
    client.put(data=TensorDict({"x": torch.arange(2)}, batch_size=2), partition_id="plain")
    tq.kv_put(key="k", partition_id="kv", fields={"x": torch.tensor([1])}, tag={"n": 1})
    assert client.kv_list() == {"plain": {}, "kv": {"k": {"n": 1}}}
    assert client.kv_list("kv") == {"kv": {"k": {"n": 1}}}
    assert client.kv_list("nope") == {}
    assert tq.kv_list() == client.kv_list()


def test_put_into_a_batch_stores_its_custom_meta() -> None:
    # TransferQueue: meta.update_custom_meta([...]) then client.put(data, metadata=meta)
    # stores the custom_meta with the put (merged into the rows'): another task's get_meta
    # of those rows has it
    tq.init()
    client = tq.get_client()
    client.put(data=TensorDict({"x": torch.arange(3)}, batch_size=3), partition_id="p")
    meta = client.get_meta(data_fields=["x"], batch_size=3, partition_id="p", task_name="a")
    meta.update_custom_meta([{"s": 1}, {}, {"s": 3}])
    client.set_custom_meta(meta)
    meta.update_custom_meta([{"w": 1}, {}, {}])
    client.put(data=TensorDict({"y": torch.arange(3)}, batch_size=3), metadata=meta)
    other = client.get_meta(data_fields=["x", "y"], batch_size=3, partition_id="p", task_name="b")
    assert other.custom_meta == [{"s": 1, "w": 1}, {}, {"s": 3}]


def test_an_empty_batch_reads_and_clears_nothing() -> None:
    # TransferQueue: get_data(BatchMeta.empty()) is an empty TensorDict (batch_size [0]);
    # clear_samples and set_custom_meta of it do nothing (BatchMeta.concat of empty polls gives
    # one)
    tq.init()
    client = tq.get_client()
    for empty in (tq.BatchMeta.empty(), tq.BatchMeta.concat([tq.BatchMeta.empty()])):
        got = client.get_data(empty)
        assert got.batch_size == torch.Size([0])
        assert list(got.keys()) == []
        client.clear_samples(empty)
        client.set_custom_meta(empty)


def test_clearing_what_is_gone_does_nothing() -> None:
    # TransferQueue: clear_partition("nope") and reset_consumption("nope") (which returns True)
    # do nothing, and clear_samples of rows cleared already clears the rest (as kv_clear skips
    # missing keys)
    tq.init()
    client = tq.get_client()
    client.clear_partition("nope")
    assert client.reset_consumption("nope") is True
    assert client.reset_consumption("nope", task_name="t") is True
    client.put(data=TensorDict({"x": torch.arange(3)}, batch_size=3), partition_id="p")
    meta = client.get_meta(data_fields=["x"], batch_size=3, partition_id="p", task_name="t")
    client.clear_samples(meta.select_samples([0]))
    client.clear_samples(meta.select_samples([0]))
    client.clear_samples(meta)  # rows 1 and 2 go too
    assert not client.client.partition_info("p")["rows"]
    client.clear_partition("p")
    client.clear_samples(meta)
    client.clear_partition("p")
    assert client.get_partition_list() == []


def test_kv_put_of_a_nested_tensor_says_to_use_kv_batch_put() -> None:
    # TransferQueue: kv_put(key, pid, fields={"x": <nested tensor>}) raises ValueError("Please
    # use (async)kv_batch_put for batch operation"): a nested tensor is a batch of rows
    tq.init()
    rows = torch.nested.nested_tensor([torch.arange(2), torch.arange(3)], layout=torch.jagged)
    with pytest.raises(ValueError, match="kv_batch_put") as info:
        tq.kv_put(key="k", partition_id="p", fields={"x": rows})
    assert isinstance(info.value, tq_async.TQError)
    assert "'x'" in str(info.value)
    assert tq.kv_list("p") == {}  # nothing was written


def test_kv_retrieve_meta_of_keys_without_a_common_field_is_not_ready() -> None:
    # TransferQueue: get_client().kv_retrieve_meta(["new"], pid, create=True) of a new key is
    # a batch with no field and is_ready False (production_status 0); keys sharing a field: 1
    tq.init()
    client = tq.get_client()
    created = client.kv_retrieve_meta(keys=["new"], partition_id="p", create=True)
    assert created.field_names == []
    assert created.production_status.tolist() == [0]
    assert not created.is_ready
    tq.kv_put(key="new", partition_id="p", fields={"x": torch.tensor([1])})
    written = client.kv_retrieve_meta(keys=["new"], partition_id="p")
    assert written.production_status.tolist() == [1]
    assert written.is_ready


def test_kv_batch_meta_prints_as_transferqueues() -> None:
    # TransferQueue: str(KVBatchMeta(...)) is "KVBatchMeta(size=2, field_names=['x'],
    # extra_info={'e': 1})" (print(meta) in a program's log)
    meta = tq.KVBatchMeta(keys=["a", "b"], tags=[{}, {}], partition_id="p", fields=["x"],
                          extra_info={"e": 1})  # fmt: skip
    assert str(meta) == "KVBatchMeta(size=2, field_names=['x'], extra_info={'e': 1})"
    assert repr(meta).startswith("KVBatchMeta(keys=['a', 'b'], tags=")
