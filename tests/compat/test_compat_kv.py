"""Tutorial 02: the KV interface (kv_put, kv_batch_put, tags, kv_list, kv_batch_get with
select_fields, kv_clear) and the async forms."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import tq_async
import tq_async.compat as tq


def test_kv_tutorial_flow() -> None:
    tq.init()
    partition_id = "Train"
    single = TensorDict(
        {"input_ids": torch.tensor([[1, 2, 3, 4]]), "attention_mask": torch.ones(1, 4)},
        batch_size=1,
    )
    meta = tq.kv_put(key="0_0", partition_id=partition_id, fields=single, tag={"global_steps": 0})
    assert isinstance(meta, tq.KVBatchMeta)
    assert meta.keys == ["0_0"]
    assert sorted(meta.fields or []) == ["attention_mask", "input_ids"]
    keys = ["1_0", "1_1", "1_2"]
    batch = TensorDict(
        {"input_ids": torch.arange(12).view(3, 4), "attention_mask": torch.ones(3, 4)},
        batch_size=3,
    )
    tags = [{"global_steps": 1, "status": "running"} for _ in keys]
    tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=batch, tags=tags)
    # append a field to existing keys: the returned meta names every field they have
    responses = TensorDict({"response": torch.arange(6).view(3, 2)}, batch_size=3)
    appended = tq.kv_batch_put(
        keys=keys, partition_id=partition_id, fields=responses,
        tags=[{"status": "finish"}] * 3,
    )  # fmt: skip
    assert sorted(appended.fields or []) == ["attention_mask", "input_ids", "response"]
    # only tags
    tq.kv_put(key="0_0", partition_id=partition_id, fields=None, tag={"score": 0.5})
    listing = tq.kv_list()
    assert listing[partition_id]["0_0"] == {"global_steps": 0, "score": 0.5}
    assert listing[partition_id]["1_1"] == {"global_steps": 1, "status": "finish"}
    only_ids = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields="input_ids")
    assert list(only_ids.keys()) == ["input_ids"]
    assert only_ids["input_ids"][2].tolist() == [8, 9, 10, 11]
    everything = tq.kv_batch_get(keys=keys, partition_id=partition_id)
    assert sorted(everything.keys()) == ["attention_mask", "input_ids", "response"]
    response = tq.kv_batch_get_by_meta(appended, select_fields=["response"])["response"]
    assert response.is_nested  # as in TransferQueue, whatever the rows' lengths
    assert response.to_padded_tensor(0).shape == (3, 2)
    with pytest.raises(tq_async.InvalidRequestError, match="select_fields"):
        tq.kv_batch_get_by_meta(meta, select_fields=["response"])
    with pytest.raises(tq.StorageKeyNotFoundError, match="nope"):
        tq.kv_batch_get(keys=["nope"], partition_id=partition_id)
    tq.kv_clear(keys=["0_0", "1_0", "never_put"], partition_id=partition_id)
    assert sorted(tq.kv_list(partition_id=partition_id)[partition_id]) == ["1_1", "1_2"]
    # keys from rows, and the keys a fetched batch carries
    client = tq.get_client()
    rows = client.kv_retrieve_meta(keys=["1_2", "1_1"], partition_id=partition_id)
    assert rows.keys == ["1_2", "1_1"]
    assert client.kv_retrieve_keys(rows.global_indexes, partition_id) == ["1_2", "1_1"]
    created = client.kv_retrieve_meta(keys=["new"], partition_id=partition_id, create=True)
    assert created.size == 1
    assert created.field_names == []


def test_kv_errors_name_the_argument() -> None:
    tq.init()
    with pytest.raises(tq_async.InvalidRequestError, match="fields, tags"):
        tq.kv_batch_put(keys=["a"], partition_id="p")
    with pytest.raises(tq_async.InvalidRequestError, match="keys"):
        tq.kv_batch_put(keys=[1], partition_id="p", tags=[{}])  # type: ignore[list-item]
    with pytest.raises(tq_async.InvalidRequestError, match="fields, a tag"):
        tq.kv_put(key="a", partition_id="p")
    with pytest.raises(tq_async.InvalidRequestError, match="data_parser must return"):
        tq.kv_put(key="a", partition_id="p", fields={"x": torch.ones(1)}, data_parser=str)
    with pytest.raises(tq_async.InvalidRequestError, match="partition_id"):
        tq.kv_batch_get_by_meta(tq.KVBatchMeta(keys=["a"], tags=[{}]))
    with pytest.raises(tq_async.InvalidRequestError, match="one tag dict per key"):
        tq.KVBatchMeta(keys=["a", "b"], tags=[{}])
    with pytest.raises(tq_async.InvalidRequestError, match="repeat"):
        tq.KVBatchMeta(keys=["a", "a"], tags=[{}, {}])


def test_kv_batch_meta_chunk_concat_select_reorder() -> None:
    meta = tq.KVBatchMeta(
        keys=[f"k{i}" for i in range(10)],
        tags=[{"i": i} for i in range(10)],
        partition_id="p",
        fields=["x"],
        extra_info={"step": 1},
    )
    parts = meta.chunk(3)
    assert [p.size for p in parts] == [4, 3, 3]
    parts[0].tags[0]["i"] = -1
    assert meta.tags[0] == {"i": 0}
    joined = tq.KVBatchMeta.concat(parts)
    assert joined.keys == meta.keys
    assert joined.extra_info == {"step": 1}
    picked = meta.select_keys(["k3", "k1"])
    assert picked.tags == [{"i": 3}, {"i": 1}]
    picked.reorder([1, 0])
    assert picked.keys == ["k1", "k3"]
    with pytest.raises(tq_async.InvalidRequestError, match="permutation"):
        picked.reorder([0, 0])
    with pytest.raises(tq_async.InvalidRequestError, match="not in this KVBatchMeta"):
        meta.select_keys(["zz"])
    with pytest.raises(tq_async.InvalidRequestError, match="partition"):
        tq.KVBatchMeta.concat([meta, tq.KVBatchMeta(keys=["q"], tags=[{}], partition_id="o")])


def test_multi_modal_non_tensor_columns_and_per_key_lengths() -> None:
    tq.init()
    images = NonTensorStack(
        {"image_grid_thw": [[1, 4, 4]], "url": "a.png"},
        {"image_grid_thw": [[1, 2, 2]], "url": "b.png"},
    )
    fields = TensorDict(
        {"multi_modal_inputs": images, "input_ids": torch.arange(6).view(2, 3)}, batch_size=2
    )
    tq.kv_batch_put(keys=["a", "b"], partition_id="mm", fields=fields)
    for key, length in (("a", 5), ("b", 7)):  # per-key responses of their own lengths
        tq.kv_put(key=key, partition_id="mm", fields={"response": torch.arange(length)})
    got = tq.kv_batch_get(keys=["b", "a"], partition_id="mm")
    assert got.get("multi_modal_inputs").tolist()[0]["url"] == "b.png"
    assert [r.shape[0] for r in got["response"].unbind()] == [7, 5]


def test_fields_of_equal_lengths_combine() -> None:
    # a verl step: prompts and responses padded to one length, the mask twice as long. The
    # jagged fields whose rows have the same lengths share one ragged dimension, so they
    # combine as the dense tensors a trainer put (responses * mask, ids + ids)
    tq.init()
    prompts, responses = torch.arange(8).view(2, 4), torch.arange(8, 16).view(2, 4)
    logp = torch.randn(2, 4)
    fields = {
        "prompts": prompts, "responses": responses, "old_log_probs": logp,
        "attention_mask": torch.ones(2, 8, dtype=torch.int64), "rewards": torch.randn(2),
    }  # fmt: skip
    tq.kv_batch_put(keys=["a", "b"], partition_id="step", fields=fields)
    for _ in range(2):  # the second read reuses nothing of the first one's offsets
        got = tq.kv_batch_get(keys=["a", "b"], partition_id="step")
        assert (got["prompts"] + got["responses"]).to_padded_tensor(0).tolist() == (
            prompts + responses
        ).tolist()
        assert torch.equal(
            (got["old_log_probs"] * got["responses"]).to_padded_tensor(0), logp * responses
        )
        assert got["attention_mask"].to_padded_tensor(0).shape == (2, 8)
        assert not got["rewards"].is_nested
        with pytest.raises(RuntimeError):  # rows of other lengths: another ragged dimension
            got["prompts"] + got["attention_mask"]


async def test_async_kv_forms() -> None:
    tq.init()
    fields = TensorDict({"x": torch.arange(4).view(2, 2)}, batch_size=2)
    meta = await tq.async_kv_batch_put(keys=["a", "b"], partition_id="p", fields=fields)
    one = await tq.async_kv_put(key="c", partition_id="p", fields={"x": torch.tensor([7, 8])})
    assert one.keys == ["c"]
    got = await tq.async_kv_batch_get(keys=["a", "c"], partition_id="p", select_fields=["x"])
    assert got["x"].to_padded_tensor(0).tolist() == [[0, 1], [7, 8]]
    by_meta = await tq.async_kv_batch_get_by_meta(meta)
    assert by_meta["x"].to_padded_tensor(0).tolist() == [[0, 1], [2, 3]]
    assert sorted((await tq.async_kv_list("p"))["p"]) == ["a", "b", "c"]
    await tq.async_kv_clear(keys="a", partition_id="p")
    client = tq.get_client()
    assert sorted(await client.async_get_partition_list()) == ["p"]
    async with anyio.create_task_group() as tg:  # concurrent callers on one client
        for k in ("b", "c"):
            tg.start_soon(tq.async_kv_batch_get, [k], "p")


@pytest.mark.parametrize("call", ["kv_batch_get", "kv_batch_get_by_meta"])
def test_keys_removed_while_kv_batch_get_reads_them_say_to_read_again(
    call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys another process cleared after kv_batch_get looked them up, before it read their
    cells: the error said "... since this BatchMeta was made ...; fetch a new BatchMeta" (a
    kv_batch_get has none). It says the keys' rows were removed while this call read them,
    and to call it again."""
    tq.init()
    meta = tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields={"x": torch.ones(2, 3)})
    client = tq.get_client().client
    get_data = type(client).get_data

    def cleared_first(self: Any, *args: Any, **kwargs: Any) -> Any:
        client.clear_partition("p")
        return get_data(self, *args, **kwargs)

    monkeypatch.setattr(type(client), "get_data", cleared_first)
    reads = {
        "kv_batch_get": lambda: tq.kv_batch_get(keys=["a", "b"], partition_id="p"),
        "kv_batch_get_by_meta": lambda: tq.kv_batch_get_by_meta(meta),
    }
    with pytest.raises(tq_async.RowsNotFound) as caught:
        reads[call]()
    message = str(caught.value)
    assert f"while this {call} read" in message
    assert f"call {call} again" in message
    assert "BatchMeta" not in message


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"keys": ["a"], "tags": None}, "tags"),
        ({"keys": None, "tags": []}, "keys"),
        ({"keys": "ab", "tags": [{}, {}]}, "keys"),
        ({"keys": [1], "tags": [{}]}, "keys"),
        ({"keys": ["a"], "tags": ["x"]}, "tags"),
        ({"keys": ["a"], "tags": [None]}, "tags"),
        ({"keys": ["a"], "tags": [{}], "fields": "xy"}, "fields"),
        ({"keys": ["a"], "tags": [{}], "extra_info": [1]}, "extra_info"),
    ],
)
def test_a_kv_batch_meta_of_bad_arguments_names_them(kwargs: dict[str, Any], named: str) -> None:
    """``KVBatchMeta`` built with ``None`` keys or tags, tags that are not dicts or an
    ``extra_info`` that is not one failed with Python's own TypeError / ValueError ("object
    of type 'NoneType' has no len()"), and a string for ``keys`` or ``fields`` was split
    into one-letter names. Each is an InvalidRequestError naming the argument."""
    with pytest.raises(tq_async.InvalidRequestError, match=f"KVBatchMeta {named}"):
        tq.KVBatchMeta(**kwargs)
