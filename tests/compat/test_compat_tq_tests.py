"""TransferQueue 0.1.11's own tests on the alias (issue 41): the facts they pin that a user's
program hits, kept here as our tests (TransferQueue's files are not in this repository and CI
cannot fetch them).

D5 a custom sampler sees ``batch_size`` ready rows (or a final partition); D7 numpy string
columns are split into rows; D1 TransferQueue's submodule paths and ``chunk_batch_fn``; D4 a
``BatchMeta`` through Ray stays writable; D6 rows without ``total_lengths`` count 1; D2 a
missing checkpoint is a ``FileNotFoundError``; D3 ``KVBatchMeta`` tags are deep copies; D8
``BaseSampler`` is abstract.
"""

from __future__ import annotations

import importlib
import pickle
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tq_async
import tq_async.compat as tq
from tq_async._core._state import ControllerState
from tq_async._core._transitions import ControllerCore, SampleCall
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import GetMeta, MetaReply

# ---- D5: a custom sampler is called once batch_size rows are ready (or the partition is final)


class _FirstN(tq.BaseSampler):
    """A TransferQueue-style sampler: trusts that ``batch_size`` rows are ready."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def sample(
        self, ready_indexes: Sequence[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        self.seen.append(len(ready_indexes))
        picked = list(ready_indexes[:batch_size])
        return picked, picked


def test_d5_custom_sampler_not_called_short_in_polling_mode() -> None:
    sampler = _FirstN()
    tq.init({"controller": {"sampler": sampler, "polling_mode": True}})
    client = tq.get_client()
    client.put(data=TensorDict({"x": torch.arange(2)}, batch_size=2), partition_id="p")
    meta = client.get_meta(partition_id="p", data_fields=["x"], batch_size=4, task_name="t")
    assert meta.size == 0
    assert sampler.seen == []
    client.put(data=TensorDict({"x": torch.arange(2)}, batch_size=2), partition_id="p")
    meta = client.get_meta(partition_id="p", data_fields=["x"], batch_size=4, task_name="t")
    assert meta.size == 4
    assert sampler.seen == [4]


def test_d5_custom_sampler_waits_for_a_full_batch_in_blocking_mode() -> None:
    sampler = _FirstN()
    tq.init({"controller": {"sampler": sampler}})
    client = tq.get_client()
    client.put(data=TensorDict({"x": torch.arange(2)}, batch_size=2), partition_id="p")
    got: list[Any] = []
    reader = threading.Thread(
        target=lambda: got.append(
            client.get_meta(partition_id="p", data_fields=["x"], batch_size=4, task_name="t")
        )
    )
    reader.start()
    client.put(data=TensorDict({"x": torch.arange(2, 4)}, batch_size=2), partition_id="p")
    reader.join(timeout=30)
    assert not reader.is_alive()
    assert got[0].size == 4
    assert all(n >= 4 for n in sampler.seen)


_X = ColumnHeader("x", "dense", "int64", ())


def _core_with(sampler: tq_async.BaseSampler, rows: int) -> ControllerCore:
    core = ControllerCore(ControllerState({0: "inproc://u0"}), sampler)
    placement, _ = core.put_begin("p", [_X], rows, None, None, 0.0)
    core.put_commit("p", placement.rows, ["x"], None, None, placement.put_id)
    return core


def _get(core: ControllerCore, request: GetMeta) -> MetaReply | None:
    decision, _ = core.get_meta(request, 0.0)
    while isinstance(decision, SampleCall):
        decision, _ = core.sampled(request, decision, decision.run(), 0.0)
    return decision


def test_d5_a_final_partition_hands_a_custom_sampler_its_short_tail() -> None:
    sampler = _FirstN()
    core = _core_with(sampler, 2)
    request = GetMeta("p", ["x"], 4, "t", None)
    assert _get(core, request) is None  # waits: not enough, not final
    assert sampler.seen == []
    core.state.seal("p")
    reply = _get(core, request)
    assert reply is not None
    assert list(reply.rows) == [0, 1]
    assert sampler.seen == [2]


def test_d5_built_in_samplers_still_see_short_ready_lists() -> None:
    calls: list[int] = []

    class Counting(tq_async.SequentialSampler):
        def sample(self, ready_indexes: Sequence[int], batch_size: int, **kw: Any) -> Any:
            calls.append(len(ready_indexes))
            return super().sample(ready_indexes, batch_size, **kw)

    core = _core_with(Counting(), 2)
    assert _get(core, GetMeta("p", ["x"], 4, "t", None)) is None
    assert calls == [2]  # asked, and it answered "not enough yet" itself
    assert tq_async.SequentialSampler().short_ready_ok
    assert tq_async.StalenessSampler(_FirstN()).short_ready_ok is False


def test_d5_a_sampler_may_declare_it_handles_short_ready_lists() -> None:
    class Greedy(_FirstN):
        short_ready_ok = True

    sampler = Greedy()
    core = _core_with(sampler, 2)
    reply = _get(core, GetMeta("p", ["x"], 4, "t", None))
    assert reply is not None
    assert list(reply.rows) == [0, 1]


# ---- D7: numpy string / object columns are split into rows -----------------------------------


def test_d7_numpy_string_and_object_columns_split_into_rows() -> None:
    tq.init({"allow_pickle": True})
    fields = TensorDict(
        {"s": np.array([b"x", b"y"]), "o": np.array([{"a": 1}, None], dtype=object)},
        batch_size=2,
    )
    tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields=fields, tags=[{}, {}])
    got = tq.kv_batch_get(keys=["a", "b"], partition_id="p")
    assert list(got["s"]) == [b"x", b"y"]
    assert list(got["o"]) == [{"a": 1}, None]
    client = tq.get_client()
    client.put(data={"u": np.array(["p", "q"])}, partition_id="q")
    meta = client.get_meta(partition_id="q", data_fields=["u"], batch_size=2, task_name="t")
    assert list(client.get_data(meta)["u"]) == ["p", "q"]


# ---- D1: TransferQueue's submodule paths ----------------------------------------------------


@pytest.fixture
def alias() -> Iterator[None]:
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "transfer_queue"}
    if "transfer_queue" in saved and saved["transfer_queue"] is not sys.modules.get(
        "tq_async.transfer_queue"
    ):
        pytest.skip("TransferQueue itself is imported in this process")
    import tq_async.transfer_queue as tqa

    tqa.install()
    yield
    for k in [k for k in sys.modules if k.split(".")[0] == "transfer_queue"]:
        del sys.modules[k]
    sys.modules.update(saved)


@pytest.mark.usefixtures("alias")
def test_d1_transfer_queue_submodule_paths_import() -> None:
    names = {
        "transfer_queue.sampler.base": "BaseSampler",
        "transfer_queue.sampler.grpo_group_n_sampler": "GRPOGroupNSampler",
        "transfer_queue.sampler.rank_aware_sampler": "RankAwareSampler",
        "transfer_queue.sampler.seqlen_balanced_sampler": "SeqlenBalancedSampler",
        "transfer_queue.sampler.sequential_sampler": "SequentialSampler",
        "transfer_queue.dataloader.streaming_dataset": "StreamingDataset",
        "transfer_queue.dataloader.streaming_dataloader": "StreamingDataLoader",
    }
    for module, name in names.items():
        assert getattr(importlib.import_module(module), name) is getattr(tq, name), module
    from transfer_queue.dataloader import StreamingDataset  # type: ignore[import-not-found]
    from transfer_queue.sampler import BaseSampler  # type: ignore[import-not-found]

    assert StreamingDataset is tq.StreamingDataset
    assert BaseSampler is tq.BaseSampler


@pytest.mark.usefixtures("alias")
def test_d1_chunk_batch_fn_takes_a_compat_batch_meta() -> None:
    from transfer_queue.dataloader.streaming_dataset import (  # type: ignore[import-not-found]
        chunk_batch_fn,
    )
    from transfer_queue.metadata import BatchMeta  # type: ignore[import-not-found]

    values = [torch.tensor([1, 2]), torch.tensor([3, 4, 5]), torch.tensor([6])]
    td = TensorDict(
        {"a": torch.nested.as_nested_tensor(values, layout=torch.jagged), "b": torch.arange(3)},
        batch_size=(3,),
    )
    meta = BatchMeta(global_indexes=[10, 11, 12], partition_ids=["p"] * 3)
    chunks = chunk_batch_fn(td, meta, micro_batch_size=2)
    assert [c[0].batch_size for c in chunks] == [torch.Size([2]), torch.Size([1])]
    assert [c[1].global_indexes for c in chunks] == [[10, 11], [12]]
    assert all(isinstance(c[1], BatchMeta) for c in chunks)
    assert torch.equal(chunks[1][0]["a"][0], torch.tensor([6]))
    assert torch.equal(chunks[0][0]["b"], torch.tensor([0, 1]))
    with pytest.raises(TypeError):
        chunk_batch_fn({"a": torch.arange(3)}, meta)
    with pytest.raises(ValueError, match="micro_batch_size"):
        chunk_batch_fn(td, meta, micro_batch_size=0)
    with pytest.raises(ValueError, match="exceeds"):
        chunk_batch_fn(td, meta, micro_batch_size=4)


# ---- D4: a BatchMeta that came through Ray stays writable ------------------------------------


def _through_zero_copy(obj: Any) -> Any:
    """What Ray does to an argument or ``ray.get``: pickle 5 with out-of-band buffers that come
    back read-only (Ray's object store)."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=[bytes(b.raw()) for b in buffers])


def test_d4_batch_meta_through_ray_accepts_add_fields() -> None:
    meta = _through_zero_copy(tq.BatchMeta(global_indexes=[0, 1], partition_ids=["p", "p"]))
    meta.add_fields(TensorDict({"x": torch.ones(2, 3)}, batch_size=2))
    assert meta.is_ready
    assert meta.field_names == ["x"]
    again = pickle.loads(pickle.dumps(meta))
    assert again.global_indexes == [0, 1]
    assert again.is_ready


# ---- D6: SeqlenBalancedSampler counts a row without total_lengths as 1 -----------------------


def test_d6_seqlen_balanced_rows_without_lengths_count_one() -> None:
    tq.init({"controller": {"sampler": tq.SeqlenBalancedSampler(dp_size=2), "polling_mode": True}})
    client = tq.get_client()
    client.put(data=TensorDict({"x": torch.arange(4)}, batch_size=4), partition_id="p")
    shares = [
        client.get_meta(
            partition_id="p",
            data_fields=["x"],
            batch_size=2,
            task_name="t",
            sampling_config={"dp_rank": rank, "batch_index": 0},
        )
        for rank in (0, 1)
    ]
    assert [m.size for m in shares] == [2, 2]
    assert len(set(shares[0].global_indexes) | set(shares[1].global_indexes)) == 4


# ---- D2: a missing checkpoint is a FileNotFoundError -----------------------------------------


def test_d2_load_checkpoint_of_a_missing_directory(tmp_path: Path) -> None:
    tq.init()
    with pytest.raises(FileNotFoundError) as caught:
        tq.load_checkpoint(tmp_path / "no-such-dir")
    assert isinstance(caught.value, tq_async.CheckpointError)
    assert isinstance(caught.value, tq_async.CheckpointNotFoundError)
    err = pickle.loads(pickle.dumps(caught.value))
    assert type(err) is tq_async.CheckpointNotFoundError
    assert str(err) == str(caught.value)
    assert "no-such-dir" in str(err)
    with pytest.raises(FileNotFoundError):
        tq_async.checkpoint_metadata(tmp_path / "no-such-dir")


# ---- D3: KVBatchMeta copies tags deeply ------------------------------------------------------


def test_d3_kv_batch_meta_tags_are_deep_copies() -> None:
    tags = [{"d": [1]}]
    meta = tq.KVBatchMeta(keys=["k"], tags=tags)
    meta.tags[0]["d"].append(2)
    assert tags == [{"d": [1]}]
    part = meta.select_keys(["k"])
    part.tags[0]["d"].append(3)
    assert meta.tags == [{"d": [1, 2]}]


# ---- D8: BaseSampler is abstract --------------------------------------------------------------


def test_d8_base_sampler_is_abstract() -> None:
    with pytest.raises(TypeError):
        tq.BaseSampler()  # type: ignore[abstract]

    class NoSample(tq.BaseSampler):
        pass

    with pytest.raises(TypeError):
        NoSample()  # type: ignore[abstract]
    for built_in in (
        tq_async.SequentialSampler(),
        tq_async.GRPOGroupNSampler(2),
        tq_async.RankAwareSampler(),
        tq_async.SeqlenBalancedSampler(dp_size=2),
        tq_async.StalenessSampler(tq_async.SequentialSampler()),
    ):
        assert isinstance(built_in, tq.BaseSampler)
