"""TransferQueue programs that did not run through ``tq_async.compat`` (issue 23): the KV
reads of several keys (D1), numpy values in ``sampling_config`` (D3), ``NonTensorStack`` rows
and pickle (D4), a field's dtype changing between puts, ``data_parser``, and the calls verl's
v1 trainer makes (``kv_list`` before the first put, ``select_fields`` naming absent fields,
jagged fields read back jagged)."""

from __future__ import annotations

import os
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import tq_async
import tq_async.compat as tq


def test_d1_kv_batch_get_returns_the_fields_all_keys_have() -> None:
    tq.init()
    tq.kv_put(key="a", partition_id="p", fields={"x": torch.tensor([1])})
    tq.kv_put(key="b", partition_id="p", fields={"x": torch.tensor([2]), "y": torch.tensor([3])})
    assert list(tq.kv_batch_get(keys="a", partition_id="p").keys()) == ["x"]
    assert list(tq.kv_batch_get(keys=["a", "b"], partition_id="p").keys()) == ["x"]
    assert sorted(tq.kv_batch_get(keys="b", partition_id="p").keys()) == ["x", "y"]
    # select_fields naming a field some key lacks: the present fields (a run without a critic)
    got = tq.kv_batch_get(keys=["a", "b"], partition_id="p", select_fields=["x", "values"])
    assert list(got.keys()) == ["x"]
    none = tq.kv_batch_get(keys=["a", "b"], partition_id="p", select_fields=["values"])
    assert list(none.keys()) == []
    assert none.batch_size == torch.Size([2])
    # fields of cleared rows are not selected either
    tq.kv_put(key="c", partition_id="p", fields={"x": torch.tensor([4]), "z": torch.tensor([5])})
    tq.kv_clear(keys=["b", "c"], partition_id="p")
    assert list(tq.kv_batch_get(keys="a", partition_id="p").keys()) == ["x"]
    with pytest.raises(tq.StorageKeyNotFoundError, match="nope"):
        tq.kv_batch_get(keys=["a", "nope"], partition_id="p")


def test_kv_list_before_any_put_is_empty() -> None:
    tq.init()
    assert tq.kv_list() == {}
    assert tq.kv_list("train") == {}
    tq.kv_put(key="a", partition_id="train", tag={"s": 1})
    assert tq.kv_list("train") == {"train": {"a": {"s": 1}}}
    assert list(tq.kv_list()) == ["train"]


class _PriorityScores(tq.BaseSampler):
    """Tutorial 05's idea: the row with the highest score in ``sampling_config``."""

    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        scores = kwargs["priority_scores"]
        assert isinstance(scores, np.ndarray)  # it arrives as the numpy array it was
        ranked = sorted(ready_indexes, key=lambda i: -float(scores[i]))[:batch_size]
        return ranked, ranked


def test_d3_numpy_array_in_sampling_config() -> None:
    tq.init({"controller": {"sampler": _PriorityScores()}})
    client = tq.get_client()
    client.put(data=TensorDict({"x": torch.arange(8)}, batch_size=8), partition_id="p")
    scores = np.array([0.01, 0.01, 88, 999, 0.01, 0.01, 0.01, 10])
    meta = client.get_meta(
        data_fields=["x"], batch_size=2, partition_id="p", task_name="t",
        sampling_config={"priority_scores": scores, "temperature": np.float64(1.0)},
    )  # fmt: skip
    assert meta.global_indexes == [3, 2]


def test_d4_non_tensor_stack_rows_and_numpy_scalars() -> None:
    tq.init()
    tq.kv_put(
        key="single_nt",
        partition_id="train",
        fields={"label": NonTensorStack("positive"), "score": torch.tensor([0.99])},
    )
    single = tq.kv_batch_get(keys="single_nt", partition_id="train")
    assert list(single["label"]) == [["positive"]]  # the row holds the stack's values
    # a reward function returning numpy scalars inside dicts
    rewards = NonTensorStack({"acc": np.float64(1.0), "n": np.int64(3)}, {"acc": np.float32(0.5)})
    tq.kv_batch_put(
        keys=["a", "b"],
        partition_id="train",
        fields=TensorDict({"reward_extra": rewards}, batch_size=2),
    )
    got = tq.kv_batch_get(keys=["a", "b"], partition_id="train")
    assert got.get("reward_extra").tolist() == [{"acc": 1.0, "n": 3}, {"acc": 0.5}]
    # a dict holding a tensor needs pickle: refused with a TQError that says how to allow it
    with pytest.raises(tq_async.UnsupportedTypeError, match="allow_pickle"):
        tq.kv_put(
            key="c", partition_id="train", fields={"mm": NonTensorStack({"t": torch.ones(2)})}
        )


def test_d4_pickle_enabled_through_init_config() -> None:
    tq.init({"allow_pickle": True})
    multi_modal = NonTensorStack(
        {"pixel_values": torch.ones(2, 3)}, {"pixel_values": torch.ones(1, 3)}
    )
    tq.kv_batch_put(
        keys=["a", "b"], partition_id="p", fields=TensorDict({"mm": multi_modal}, batch_size=2)
    )
    got = tq.kv_batch_get(keys=["b"], partition_id="p").get("mm").tolist()
    assert torch.equal(got[0]["pixel_values"], torch.ones(1, 3))


def test_dtype_change_between_puts_reads_as_the_fields_dtype() -> None:
    # tutorial 02: attention_mask first put as float32 (torch.ones(size)), later as int64
    tq.init()
    first = TensorDict(
        {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3)}, batch_size=1
    )
    tq.kv_put(key="0_0", partition_id="Train", fields=first)
    ids = torch.tensor([[4, 5, 6], [7, 8, 9]])
    later = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, batch_size=2)
    tq.kv_batch_put(keys=["1_0", "1_1"], partition_id="Train", fields=later)
    got = tq.kv_batch_get(keys=["1_0", "0_0", "1_1"], partition_id="Train")
    assert got["attention_mask"].dtype == torch.float32
    assert got["attention_mask"].to_padded_tensor(0).tolist() == [[1.0] * 3] * 3
    # the same through the client's put of new rows
    client = tq.get_client()
    client.put(data=TensorDict({"m": torch.zeros(2, 2)}, batch_size=2), partition_id="q")
    client.put(data=TensorDict({"m": torch.ones(1, 2, dtype=torch.int32)}, batch_size=1),
               partition_id="q")  # fmt: skip
    meta = client.get_meta(data_fields=["m"], batch_size=3, partition_id="q", task_name="t")
    assert client.get_data(meta)["m"].dtype == torch.float32


def test_data_parser_runs_before_the_put() -> None:
    tq.init()
    urls = [f"float32:{n}" for n in (1, 3, 2)]

    def parse(columns: dict[str, Any]) -> dict[str, Any]:
        assert columns["to_parse"] == urls  # a NonTensorStack column arrives as a list
        columns["to_parse"] = [torch.ones(int(u.split(":")[1])) for u in columns["to_parse"]]
        return columns

    fields = TensorDict({"x": torch.randn(3, 2), "to_parse": NonTensorStack(*urls)}, batch_size=3)
    meta = tq.kv_batch_put(keys=["a", "b", "c"], partition_id="p", fields=fields, data_parser=parse)
    assert sorted(meta.fields or []) == ["to_parse", "x"]
    got = tq.kv_batch_get(keys=["a", "b", "c"], partition_id="p")
    assert [r.shape[0] for r in got["to_parse"].unbind()] == [1, 3, 2]


def test_jagged_fields_stay_jagged_whatever_the_lengths() -> None:
    # verl puts responses as jagged rows and calls .offsets() / .to_padded_tensor()
    tq.init()
    same = torch.nested.as_nested_tensor([torch.arange(3), torch.arange(3)], layout=torch.jagged)
    tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields={"responses": same})
    got = tq.kv_batch_get(keys=["a", "b"], partition_id="p", select_fields=["responses"])
    assert got["responses"].offsets().tolist() == [0, 3, 6]
    assert got["responses"].to_padded_tensor(-1).shape == (2, 3)


def test_rows_ragged_in_two_dimensions() -> None:
    # Qwen-VL position ids (4, L) per key, and a list of images of several sizes in one put
    tq.init()
    for i, length in enumerate((3, 5)):
        position_ids = torch.arange(4 * length).view(4, length)
        tq.kv_put(key=f"q{i}", partition_id="v", fields={"position_ids": position_ids})
    got = tq.kv_batch_get(keys=["q0", "q1"], partition_id="v")["position_ids"]
    assert [tuple(t.shape) for t in got.unbind()] == [(4, 3), (4, 5)]
    assert torch.equal(got[1], torch.arange(20).view(4, 5))
    client = tq.get_client()
    images = [torch.ones(3, 2, 2), torch.zeros(3, 4, 4), torch.ones(3, 2, 2)]
    put = client.put(data={"uid": torch.arange(3), "img": images}, partition_id="w")
    assert put.field_names == ["img", "uid"]
    meta = client.get_meta(data_fields=["img"], batch_size=3, partition_id="w", task_name="t")
    rows = client.get_data(meta)["img"].unbind()
    assert [tuple(t.shape) for t in rows] == [(3, 2, 2), (3, 4, 4), (3, 2, 2)]
    assert torch.equal(rows[1], torch.zeros(3, 4, 4))


@pytest.mark.parametrize("name", ["it's", "a\tb"])
def test_rows_ragged_in_two_dimensions_of_any_field_name(name: str) -> None:
    """A field name that Python's repr quotes otherwise (an apostrophe, a tab): compat's
    row-by-row read of such a field did not recognise it in the SchemaError it parsed, and
    raised that error instead of reading the rows."""
    tq.init()
    client = tq.get_client()
    images = [torch.ones(2, 3), torch.zeros(4, 2)]
    meta = client.put(data={"uid": torch.arange(2), name: images}, partition_id="p")
    rows = client.get_data(meta)[name].unbind()
    assert [tuple(t.shape) for t in rows] == [(2, 3), (4, 2)]


def test_kv_keys_from_a_numpy_array() -> None:
    # uids kept in a numpy array (np.str_ elements, which are str): keys like any other
    tq.init()
    uids = np.array(["u0", "u1"])
    fields = TensorDict({"x": torch.tensor([[1], [2]])}, batch_size=2)
    tq.kv_batch_put(keys=list(uids), partition_id="p", fields=fields, tags=[{"s": 1}] * 2)
    tq.kv_put(key=uids[0], partition_id="p", tag={"s": 2})
    got = tq.kv_batch_get(keys=list(uids), partition_id="p")["x"]
    assert got.to_padded_tensor(0).tolist() == [[1], [2]]
    assert tq.kv_list("p") == {"p": {"u0": {"s": 2}, "u1": {"s": 1}}}
    meta = tq.get_client().kv_retrieve_meta(keys=list(uids), partition_id="p")
    assert tq.get_client().kv_retrieve_keys(meta.global_indexes, partition_id="p") == ["u0", "u1"]
    tq.kv_clear(keys=list(uids), partition_id="p")
    assert tq.kv_list("p") == {"p": {}}


def test_kv_retrieve_keys_of_indexes_of_another_partition_says_so() -> None:
    tq.init()
    client = tq.get_client()
    fields = TensorDict({"x": torch.tensor([[1], [2]])}, batch_size=2)
    first = tq.kv_batch_put(keys=["a", "b"], partition_id="first", fields=fields)
    tq.kv_batch_put(keys=["c", "d"], partition_id="second", fields=fields)
    ours = client.kv_retrieve_meta(keys=first.keys, partition_id="first").global_indexes
    theirs = client.kv_retrieve_meta(keys=["c", "d"], partition_id="second").global_indexes
    assert client.kv_retrieve_keys(theirs, partition_id="second") == ["c", "d"]
    # numpy ints (indexes kept in an array) are ints
    assert client.kv_retrieve_keys(np.array(theirs), partition_id="second") == ["c", "d"]
    assert client.kv_retrieve_keys(np.int64(theirs[1]), partition_id="second") == ["d"]
    # the message names the indexes given, never the partition's row numbers they became
    for wrong, pid in ((ours, "second"), (theirs, "first")):
        with pytest.raises(tq_async.RowsNotFound) as info:
            client.kv_retrieve_keys(wrong, partition_id=pid)
        assert str(wrong) in str(info.value)
        assert f"partition {pid!r}" in str(info.value)


def test_an_address_that_is_not_a_string_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # a port number where the address goes never starts a private cluster silently: the
    # program would run apart from the cluster its other processes attach to
    for wrong in (5555, ["tcp://127.0.0.1:5555"]):
        with pytest.raises(tq_async.InvalidRequestError, match="address"):
            tq.init({"address": wrong})
        assert "TQ_ADDRESS" not in os.environ  # nothing was started
    # TransferQueue's own zmq_info (an object, not an address string) is left for the rest
    config = tq.init({"controller": {"zmq_info": object()}})
    assert config.address == os.environ["TQ_ADDRESS"]


def test_kv_list_shows_the_empty_key() -> None:
    # "" is a key like any other: put, read, and listed (a listing drives what is read back)
    tq.init()
    tq.kv_put(key="", partition_id="p", fields={"x": torch.tensor([1])}, tag={"n": 0})
    tq.kv_put(key="b", partition_id="p", fields={"x": torch.tensor([2])}, tag={"n": 1})
    assert tq.kv_list("p") == {"p": {"": {"n": 0}, "b": {"n": 1}}}
    assert tq.kv_batch_get(keys=[""], partition_id="p")["x"].values().tolist() == [1]
    tq.kv_clear(keys=["b"], partition_id="p")
    assert tq.kv_list() == {"p": {"": {"n": 0}}}
    tq.kv_clear(keys=[""], partition_id="p")
    assert tq.kv_list("p") == {"p": {}}


@pytest.mark.parametrize(
    "row",
    [
        np.arange(6, dtype=np.int32)[::-1],  # a reversed view (negative strides)
        np.arange(6, dtype=">i4"),  # big-endian (read from a file, another machine's)
    ],
    ids=["reversed", "big-endian"],
)
def test_a_numpy_row_of_kv_put_travels_as_a_numpy_column_does(row: np.ndarray) -> None:
    """README: numpy arrays go in as tensors. A key's row of ``kv_put`` that torch cannot
    view (a reversed view, a non-native byte order) failed with numpy's ValueError, not a
    TQError; it is put as its values, as the same array in ``kv_batch_put`` is."""
    tq.init()
    tq.kv_put(key="a", partition_id="p", fields={"x": row})
    got = tq.kv_batch_get(keys=["a"], partition_id="p")["x"]
    assert got.dtype == torch.int32
    assert got.values().tolist() == row.tolist()


def test_a_numpy_column_of_another_dtype_is_cast_as_a_tensor_is() -> None:
    """migrating.md: a put with another dtype is cast to the field's dtype in the partition.
    A numpy column (rewards as ``np.float64`` after a first put of ``np.float32``) was
    refused with a SchemaError where the same column as a tensor was cast."""
    tq.init()
    tq.kv_batch_put(keys=["a"], partition_id="p", fields={"r": np.array([0.5], np.float32)})
    tq.kv_batch_put(keys=["b", "c"], partition_id="p", fields={"r": np.array([1.5, 2.5])})
    tq.kv_put(key="d", partition_id="p", fields={"r": np.array(3.5)})
    got = tq.kv_batch_get(keys=["a", "b", "c", "d"], partition_id="p")["r"]
    assert got.dtype == torch.float32
    assert got.tolist() == [0.5, 1.5, 2.5, 3.5]


def test_jagged_rows_of_another_dtype_are_cast_as_dense_ones_are() -> None:
    """migrating.md: a put with another dtype is cast to the field's dtype in the partition.
    Only a dense column was: per-key rows of different lengths (a list of tensors or of
    arrays, and rows ragged in two dimensions, which go in puts of their own) of another
    dtype were refused with a SchemaError."""
    tq.init()
    ones = [torch.ones(2), torch.ones(3)]
    tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields={"x": ones})
    tq.kv_batch_put(keys=["c", "d"], partition_id="p", fields={"x": [r.double() for r in ones]})
    tq.kv_batch_put(keys=["e", "f"], partition_id="p", fields={"x": [np.ones(1), np.ones(4)]})
    got = tq.kv_batch_get(keys=["a", "c", "d", "e", "f"], partition_id="p")["x"]
    assert got.dtype == torch.float32
    assert [len(r) for r in got.unbind()] == [2, 2, 3, 1, 4]
    # rows that differ in a later dimension too (each shape in a put of its own)
    images = {"i": torch.arange(2), "img": [torch.ones(2, 3), torch.ones(4, 2)]}
    tq.kv_batch_put(keys=["a", "b"], partition_id="q", fields=images)
    images = {"i": torch.arange(2), "img": [torch.ones(2, 5).half(), torch.ones(1, 1).half()]}
    tq.kv_batch_put(keys=["c", "d"], partition_id="q", fields=images)
    got = tq.kv_batch_get(keys=["a", "b", "c", "d"], partition_id="q")["img"]
    assert [(r.dtype, tuple(r.shape)) for r in got.unbind()] == [
        (torch.float32, (2, 3)), (torch.float32, (4, 2)),
        (torch.float32, (2, 5)), (torch.float32, (1, 1)),
    ]  # fmt: skip
    # the same through the client's put of new rows
    client = tq.get_client()
    images = {"i": torch.arange(2), "img": [torch.ones(3, 2).double(), torch.ones(1, 4).double()]}
    client.put(data=images, partition_id="q")
    meta = client.get_meta(data_fields=["img"], batch_size=6, partition_id="q", task_name="t")
    assert client.get_data(meta)["img"].dtype == torch.float32


def test_the_streaming_dataset_reads_rows_ragged_in_two_dimensions() -> None:
    """migrating.md: rows ragged in several dimensions (images) become a strided nested
    tensor through compat, as in TransferQueue; its StreamingDataset failed on them."""
    config = tq.init()
    images = [torch.ones(2, 3), torch.ones(4, 2)]
    tq.get_client().put(data={"i": torch.arange(2), "img": images}, partition_id="p")
    tq.get_client().client.seal("p")
    dataset = tq.StreamingDataset(config, 2, 2, ["i", "img"], "p", "t", 0)
    (batch, _), *rest = list(tq.StreamingDataLoader(dataset, num_workers=0))
    assert not rest
    assert [r.shape for r in batch["img"].unbind()] == [r.shape for r in images]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_streaming_dataloader_reads_ragged_rows_once_each_and_frees_them(
    num_workers: int,
) -> None:
    """The same with several batches, through DataLoader workers too (whose request takes
    the next batches along): every row once, in order, each as it was put; an auto-clear
    task's rows are freed once delivered."""
    config = tq.init()
    client = tq.get_client()
    client.client.register_tasks(["t"], "p")
    images = [torch.ones(1 + i % 3, 1 + i % 2) * i for i in range(8)]
    client.put(data={"i": torch.arange(8), "img": images}, partition_id="p")
    client.client.seal("p")
    dataset = tq.StreamingDataset(config, 2, 1, ["i", "img"], "p", "t", 0)
    loader = tq.StreamingDataLoader(
        dataset, num_workers=num_workers, prefetch_factor=2 if num_workers else None
    )
    got = [(int(td["i"]), td["img"].unbind()[0]) for td, _ in loader]
    assert [i for i, _ in got] == list(range(8))
    for i, img in got:
        assert torch.equal(img, images[i])
    assert client.client.partition_info("p")["rows"] == 0


@pytest.mark.timeout(30)  # (it hung for ever)
def test_force_fetch_answers_at_once_with_every_unconsumed_row_and_consumes_none() -> None:
    """TransferQueue's force_fetch returns the partition's rows at once, whatever batch_size;
    compat's waited for batch_size rows (a peek) and hung when fewer existed."""
    tq.init()
    client = tq.get_client()
    meta = client.get_meta(["x"], 4, "p", mode="force_fetch", task_name="t")  # no partition
    assert meta.size == 0
    client.put(data={"x": torch.arange(3)}, partition_id="p")
    client.put(data={"y": torch.arange(2)}, partition_id="p")  # rows without x: not listed
    meta = client.get_meta(["x"], 8, "p", mode="force_fetch", task_name="t")
    assert client.get_data(meta)["x"].tolist() == [0, 1, 2]
    taken = client.get_meta(["x"], 2, "p", task_name="t")  # nothing was consumed
    assert taken.size == 2
    meta = client.get_meta(["x"], 1, "p", mode="force_fetch", task_name="t")
    assert client.get_data(meta)["x"].tolist() == [2]  # (every unconsumed row, not 1)
    client.get_meta(["x"], 1, "p", task_name="t")
    assert client.get_meta(["x"], 1, "p", mode="force_fetch", task_name="t").size == 0
    assert client.get_meta(["z"], 1, "p", mode="force_fetch", task_name="t").size == 0
    with pytest.raises(tq_async.InvalidRequestError, match=r"data_fields=\['x'\]"):
        client.get_meta("x", 1, "p", mode="force_fetch", task_name="t")  # (as fetch refuses)

    async def look() -> Any:
        return await client.async_get_meta(["x"], 5, "p", mode="force_fetch", task_name="u")

    assert anyio.run(look).size == 3
