"""Tutorials 01 and 04: core put / get_meta / get_data / clear, partitions, per-task
consumption, adding fields to rows, status queries."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tq_async
import tq_async.compat as tq


def test_core_put_get_clear() -> None:
    tq.init()
    tq_client = tq.get_client()
    input_ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
    attention_mask = torch.ones_like(input_ids)
    data_batch = TensorDict(
        {"input_ids": input_ids, "attention_mask": attention_mask}, batch_size=input_ids.size(0)
    )
    tq_client.put(data=data_batch, partition_id="tutorial_partition_0")
    batch_meta = tq_client.get_meta(
        data_fields=["input_ids", "attention_mask"],
        batch_size=data_batch.batch_size[0],
        partition_id="tutorial_partition_0",
        task_name="tutorial_task",
    )
    assert len(batch_meta) == 4
    assert batch_meta.global_indexes == [0, 1, 2, 3]
    retrieved = tq_client.get_data(batch_meta)
    for key, expected in (("input_ids", input_ids), ("attention_mask", attention_mask)):
        for t1, t2 in zip(retrieved[key], expected, strict=True):
            assert torch.equal(t1, t2)
    assert tq_client.check_consumption_status("tutorial_task", "tutorial_partition_0")
    assert tq_client.check_production_status(["input_ids"], "tutorial_partition_0")
    tq_client.clear_partition(partition_id="tutorial_partition_0")
    assert tq_client.get_partition_list() == []
    assert not tq_client.check_consumption_status("tutorial_task", "tutorial_partition_0")


def test_partitions_tasks_and_dynamic_fields() -> None:
    tq.init()
    tq_client = tq.get_client()
    tq_client.put(data=TensorDict({"x": torch.arange(6)}, batch_size=6), partition_id="train")
    tq_client.put(data=TensorDict({"x": torch.arange(2)}, batch_size=2), partition_id="val")
    assert sorted(tq_client.get_partition_list()) == ["train", "val"]
    a1 = tq_client.get_meta(data_fields=["x"], batch_size=3, partition_id="train", task_name="A")
    a2 = tq_client.get_meta(data_fields=["x"], batch_size=3, partition_id="train", task_name="A")
    b1 = tq_client.get_meta(data_fields=["x"], batch_size=2, partition_id="train", task_name="B")
    assert a1.global_indexes == [0, 1, 2]
    assert a2.global_indexes == [3, 4, 5]
    assert b1.global_indexes == [0, 1]  # each task consumes independently
    _, consumed = tq_client.get_consumption_status(task_name="B", partition_id="train")
    assert consumed is not None
    assert consumed.tolist() == [1, 1, 0, 0, 0, 0]
    # add a field to existing rows with their metadata
    meta1 = tq_client.put(data=TensorDict({"y": torch.arange(3) * 10}, batch_size=3), metadata=a1)
    assert set(meta1.field_names) == {"x", "y"}
    got = tq_client.get_data(meta1)
    assert got["y"].tolist() == [0, 10, 20]
    _, produced = tq_client.get_production_status(data_fields=["x", "y"], partition_id="train")
    assert produced is not None
    assert produced.tolist() == [[1, 1], [1, 1], [1, 1], [1, 0], [1, 0], [1, 0]]  # x, y
    assert tq_client.reset_consumption("train", "A")
    again = tq_client.get_meta(data_fields=["x"], batch_size=3, partition_id="train", task_name="A")
    assert again.global_indexes == [0, 1, 2]
    assert tq_client.get_consumption_status("A", "missing") == (None, None)
    tq_client.clear_samples(again)
    tq_client.clear_partition("train")
    tq_client.clear_partition("val")


def test_batch_meta_of_the_api_follows_transferqueue() -> None:
    tq.init()
    tq_client = tq.get_client()
    tq_client.put(data=TensorDict({"x": torch.arange(10)}, batch_size=10), partition_id="p")
    meta = tq_client.get_meta(data_fields=["x"], batch_size=10, partition_id="p", task_name="t")
    assert [c.size for c in meta.chunk(3)] == [4, 3, 3]  # TransferQueue's chunk(n): n pieces
    assert meta.partition_ids == ["p"] * 10
    assert meta.is_ready
    assert meta[1:3].global_indexes == [1, 2]
    assert meta[-1].global_indexes == [9]
    meta.update_custom_meta([{"score": i} for i in range(10)])
    tq_client.set_custom_meta(meta)
    assert tq_client.get_meta(
        data_fields=["x"], batch_size=10, partition_id="p", task_name="other"
    ).get_all_custom_meta()[3] == {"score": 3}
    meta.set_extra_info("step", 7)
    assert all(c.get_extra_info("step") == 7 for c in meta.chunk(2))
    assert type(meta).concat(meta.chunk(3)).global_indexes == meta.global_indexes
    with pytest.raises(tq_async.InvalidRequestError, match="task_name"):
        tq_client.get_meta(data_fields=["x"], batch_size=1, partition_id="p")
    with pytest.raises(tq_async.InvalidRequestError, match="mode"):
        tq_client.get_meta(
            data_fields=["x"], batch_size=1, partition_id="p", mode="insert", task_name="t"
        )
    with pytest.raises(tq_async.InvalidRequestError, match="data_parser must return"):
        tq_client.put(TensorDict({"x": torch.arange(1)}, batch_size=1), partition_id="p",
                      data_parser=str)  # fmt: skip
    with pytest.raises(tq_async.InvalidRequestError, match="save_checkpoint"):
        tq_client.save_controller_checkpoint("/nowhere")


def test_polling_mode_returns_an_empty_batch_when_short() -> None:
    tq.init({"controller": {"polling_mode": True}})
    tq_client = tq.get_client()
    tq_client.put(data=TensorDict({"x": torch.arange(2)}, batch_size=2), partition_id="p")
    short = tq_client.get_meta(data_fields=["x"], batch_size=4, partition_id="p", task_name="t")
    assert short.size == 0
    assert tq_client.get_meta(
        data_fields=["x"], batch_size=2, partition_id="p", task_name="t"
    ).global_indexes == [0, 1]


def test_init_publishes_its_address_and_close_stops_it() -> None:
    config = tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 3}}})
    address = os.environ["TQ_ADDRESS"]
    assert config.controller.zmq_info == address
    assert config["backend"]["SimpleStorage"]["num_data_storage_units"] == 3
    assert tq.init() is config  # idempotent
    assert tq.get_metrics_endpoint() is None
    tq.close()
    tq.close()
    assert "TQ_ADDRESS" not in os.environ
    with pytest.raises(tq_async.ClosedError, match="init"):
        tq.get_client()


def test_init_config_validation_and_ignored_keys() -> None:
    with pytest.warns(
        UserWarning,
        match=r"ignores the config keys \['backend.SimpleStorage.ssd_offload.enabled'\]",
    ):
        tq.init({"backend": {"SimpleStorage": {"ssd_offload": {"enabled": True}}}})
    tq.close()
    with pytest.raises(tq_async.InvalidRequestError, match=r"controller\.sampler"):
        tq.init({"controller": {"sampler": "NoSuchSampler"}})
    with pytest.raises(tq_async.InvalidRequestError, match="storage_backend"):
        tq.init({"backend": {"storage_backend": "MooncakeStore"}})
    with pytest.raises(tq_async.InvalidRequestError, match="num_data_storage_units"):
        tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 0}}})
    assert "TQ_ADDRESS" not in os.environ


def test_init_takes_numpy_ints_as_a_config_holds_them() -> None:
    """A config built from arrays (or numpy's YAML loaders) holds ``np.int64``:
    ``num_data_storage_units=np.int64(2)`` was refused ("must be an int >= 1, got
    np.int64(2)"), and ``total_storage_size`` too (the capacity check). Both are taken."""
    tq.init(
        {
            "backend": {
                "SimpleStorage": {
                    "num_data_storage_units": np.int64(2),
                    "total_storage_size": np.int64(8),
                }
            }
        }
    )
    try:
        client = tq.get_client()
        client.put(data=TensorDict({"x": torch.ones(2)}, [2]), partition_id="p")
        meta = client.get_meta(data_fields=["x"], batch_size=2, partition_id="p", task_name="t")
        assert meta.size == 2
    finally:
        tq.close()


def test_metrics_endpoint_and_capacity() -> None:
    tq.init(
        {
            "metrics": {"enabled": True, "port": 0},
            "backend": {"SimpleStorage": {"total_storage_size": 4}},
        }
    )
    endpoint = tq.get_metrics_endpoint()
    assert endpoint is not None
    assert endpoint.startswith("127.0.0.1:")
    client = tq.get_client().client
    client.put({"x": torch.arange(4)}, partition_id="p")
    with pytest.raises(tq_async.WouldBlock):
        client.put_nowait({"x": torch.arange(1)}, partition_id="q")


def test_total_storage_size_holds_that_many_rows_of_the_programs_own() -> None:
    """compat numbers the partitions it sees in a partition of its own: its rows are not the
    program's, so they must not take the room of ``total_storage_size`` (a put of the last
    rows that fit waited for ever)."""
    tq.init({"backend": {"SimpleStorage": {"total_storage_size": 4}}})
    tq.get_client().put(TensorDict({"x": torch.arange(2)}, batch_size=2), partition_id="p")
    tq.kv_put(key="k", partition_id="q", fields={"x": torch.tensor([2])})
    client = tq.get_client().client
    client.put_nowait({"x": torch.arange(1)}, partition_id="p")  # the 4th row: it fits
    with pytest.raises(tq_async.WouldBlock):
        client.put_nowait({"x": torch.arange(1)}, partition_id="p")


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    tq.init()
    tq.kv_batch_put(
        keys=["a", "b"], partition_id="p", fields=TensorDict({"x": torch.arange(2)}, batch_size=2)
    )
    tq.save_checkpoint(tmp_path / "ckpt", metadata={"step": 10})
    assert tq_async.checkpoint_metadata(tmp_path / "ckpt") == {"step": 10}
    tq.kv_clear(keys=["a", "b"], partition_id="p")
    tq.get_client().clear_partition("p")
    tq.load_checkpoint(tmp_path / "ckpt")
    assert tq.kv_batch_get(keys=["b", "a"], partition_id="p")["x"].tolist() == [1, 0]


def _forked_child(results: Any) -> None:
    config = tq.init()  # the parent's state is not this process's: attach anew
    tq.kv_put(key="child", partition_id="p", fields={"x": torch.tensor([1])})
    tq.close()
    results.put(config.address)


# Python >= 3.12 warns about fork() with threads running (the cluster's); the child only
# talks to the services over sockets, which is safe.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_attaches_with_its_own_client() -> None:
    config = tq.init()
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=_forked_child, args=(results,))
    child.start()
    assert results.get(timeout=60) == config.address
    child.join(60)
    assert child.exitcode == 0
    # rows of one dimension come back jagged, as in TransferQueue
    assert tq.kv_batch_get(keys="child", partition_id="p")["x"].to_padded_tensor(0).tolist() == [
        [1]
    ]


def _forked_reader(results: Any) -> None:
    # no init() here: the process was forked from one that called it (a DataLoader worker,
    # a worker_init_fn, a helper process): compat's module-level functions work as they did
    try:
        got = tq.kv_batch_get(keys=["a", "b"], partition_id="fork")["x"].tolist()
        tq.kv_put(key=f"child-{os.getpid()}", partition_id="fork", fields={"x": torch.tensor(7)})
        base = tq.get_client().kv_retrieve_meta(["a"], "fork").global_indexes
        results.put((got, base, tq.get_client().client is not None))
    except BaseException as exc:
        results.put(repr(exc))


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("lock_held", [False, True], ids=["plain", "lock-held-at-fork"])
def test_a_forked_child_uses_the_module_level_client_without_init(lock_held: bool) -> None:
    """A child forked from an initialised process gets a client of its own for the parent's
    cluster on first use (the parent's sockets are left alone), even when another thread of
    the parent held compat's lock at the fork; the parent's client keeps working, and the
    child sees the global indexes the parent sees."""
    tq.init()
    tq.get_client().kv_retrieve_meta(["first"], "first", create=True)  # "fork" is not row 0
    tq.kv_batch_put(
        keys=["a", "b"], partition_id="fork", fields=TensorDict({"x": torch.arange(2)}, [2])
    )
    parent_base = tq.get_client().kv_retrieve_meta(["a"], "fork").global_indexes
    assert parent_base[0] >= tq.GLOBAL_INDEX_STRIDE
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    release = threading.Event()
    held = threading.Event()

    def hold() -> None:
        with tq._lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    if lock_held:
        holder.start()
        assert held.wait(10)
    child = ctx.Process(target=_forked_reader, args=(results,))
    try:
        child.start()
        got = results.get(timeout=30)
        child.join(30)
    finally:
        release.set()
        if lock_held:
            holder.join(10)
        if child.is_alive():  # hung: fail without leaving it behind
            child.kill()
            child.join(10)
    assert child.exitcode == 0
    assert got == ([0, 1], parent_base, True)
    assert tq.kv_batch_get(keys=[f"child-{child.pid}"], partition_id="fork")["x"].tolist() == [7]


class _KVRows(torch.utils.data.Dataset[int]):
    """A map-style dataset whose items are read with compat's kv functions (in the worker)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return int(tq.kv_batch_get(keys=[f"k{i}"], partition_id="items")["x"][0])


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_fork_workers_of_a_torch_dataloader_call_compat_kv_functions() -> None:
    tq.init()
    keys = [f"k{i}" for i in range(4)]
    tq.kv_batch_put(
        keys=keys, partition_id="items", fields=TensorDict({"x": torch.arange(4) * 10}, [4])
    )
    loader = torch.utils.data.DataLoader(
        _KVRows(), batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60
    )
    assert [int(x) for x in loader] == [0, 10, 20, 30]
    assert tq.kv_batch_get(keys=keys, partition_id="items")["x"].tolist() == [0, 10, 20, 30]
