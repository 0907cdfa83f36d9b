"""Behaviour a TransferQueue user relies on (issue 16, items 2 and 4-6): KV metadata, status
checks before the first put, dp_rank validation, strided nested and numpy columns, and
TransferQueue-style samplers (``_states``, ``clear_cache``, checkpoints, exceptions)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tq_async as tq


def _strided(rows: list[torch.Tensor]) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The PyTorch API of nested tensors")
        return torch.nested.as_nested_tensor(rows, layout=torch.strided)


# ---- item 4: KV ------------------------------------------------------------------------------


async def test_kv_put_meta_names_every_field_of_the_key() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.kv_batch_put(["k", "j"], "p", {"input_ids": torch.tensor([[1, 2], [3, 4]])})
        meta = await client.kv_batch_put(["k"], "p", {"response": torch.tensor([[5]])})
        assert meta.field_names == ["input_ids", "response"]
        assert meta.keys == ["k"]
        got = await client.get_data(meta)
        assert sorted(got.keys()) == ["input_ids", "response"]
        # a key lacking a field: the meta names only the fields all its keys have
        both = await client.kv_batch_put(["k", "j"], "p", {"score": torch.tensor([1.0, 2.0])})
        assert both.field_names == ["input_ids", "score"]
        tagged = await client.kv_put("j", "p", tag={"v": 1})
        assert tagged.field_names == ["input_ids", "score"]
        assert tagged.keys == ["j"]
        one = await client.kv_put("k", "p", {"extra": torch.tensor([7])})
        assert one.field_names == ["input_ids", "response", "score", "extra"]


async def test_kv_retrieve_keys_and_keys_on_get_meta() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        put = await client.kv_batch_put(["a", "b", "c"], "p", {"x": torch.arange(3)})
        assert await client.kv_retrieve_keys(list(reversed(put.global_indexes)), "p") == [
            "c",
            "b",
            "a",
        ]
        meta = await client.get_meta(["x"], 3, "p", "t")
        assert meta.keys == ["a", "b", "c"]
        assert meta.select_rows([2]).keys == ["c"]
        plain = await client.put({"x": torch.arange(2)}, partition_id="q")
        assert plain.keys == []
        assert (await client.get_meta(["x"], 2, "q", "t")).keys == []
        with pytest.raises(tq.KeyNotFound, match="no key"):
            await client.kv_retrieve_keys(plain.global_indexes, "q")
        with pytest.raises(tq.RowsNotFound):
            await client.kv_retrieve_keys([99], "p")
        for bad in ("a", [-1], ["x"], 3):
            with pytest.raises(tq.InvalidRequestError, match="global_indexes"):
                await client.kv_retrieve_keys(bad, "p")  # type: ignore[arg-type]


async def test_save_checkpoint_stores_user_metadata(tmp_path: Path) -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(2)}, partition_id="p")
        path = tmp_path / "ckpt"
        await client.save_checkpoint(path, metadata={"step": 10, "time": 1.5})
        assert tq.checkpoint_metadata(path) == {"step": 10, "time": 1.5}
        # numpy's scalars (a step counter kept in an array) were "not JSON serializable"
        numpy_path = tmp_path / "numpy"
        counters = {"step": np.int64(11), "loss": np.float32(0.5), "flags": [np.bool_(True)]}
        await client.save_checkpoint(numpy_path, metadata=counters)
        assert tq.checkpoint_metadata(numpy_path) == {"step": 11, "loss": 0.5, "flags": [True]}
        await client.save_checkpoint(tmp_path / "bare")
        assert tq.checkpoint_metadata(tmp_path / "bare") == {}
        with pytest.raises(tq.InvalidRequestError, match="metadata"):
            await client.save_checkpoint(tmp_path / "bad", metadata={"x": object()})
        with pytest.raises(tq.InvalidRequestError, match="metadata"):
            await client.save_checkpoint(tmp_path / "bad", metadata=[1])  # type: ignore[arg-type]
        assert not await anyio.Path(tmp_path / "bad").exists()
        manifest = json.loads(await anyio.Path(path / "manifest.json").read_text())
        assert manifest["metadata"] == {"step": 10, "time": 1.5}
    with pytest.raises(tq.CheckpointError, match="not a readable checkpoint"):
        tq.checkpoint_metadata(tmp_path / "nothing")


# ---- item 5 ----------------------------------------------------------------------------------


async def test_status_checks_answer_false_before_the_first_put_and_after_a_clear() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        assert await client.check_production_status("p", ["x"]) is False
        assert await client.check_consumption_status("p", "t") is False
        await client.seal("p", create=True)  # exists, no rows
        assert await client.check_production_status("p", ["x"]) is False
        assert await client.check_consumption_status("p", "t") is False
        await client.put({"x": torch.arange(2)}, partition_id="p2")
        assert await client.check_production_status("p2", ["x"]) is True
        assert await client.check_consumption_status("p2", "t") is False
        await client.get_meta(["x"], 2, "p2", "t")
        assert await client.check_consumption_status("p2", "t") is True
        await client.clear_partition("p2")
        assert await client.check_production_status("p2", ["x"]) is False
        assert await client.check_consumption_status("p2", "t") is False


async def test_negative_dp_rank_or_batch_index_is_rejected() -> None:
    async with (
        tq.local_cluster(num_storage_units=1, sampler=tq.RankAwareSampler()) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(4)}, partition_id="p")
        for cfg in ({"dp_rank": -1, "batch_index": 0}, {"dp_rank": 0, "batch_index": -2}):
            # refused before anything is sent, naming the argument
            with pytest.raises(tq.InvalidRequestError, match=r"(dp_rank|batch_index)'\] must be"):
                await client.get_meta(["x"], 2, "p", "t", cfg)
        with pytest.raises(tq.InvalidRequestError, match="dp_rank"):
            tq.AsyncStreamingDataset(client, ["x"], 2, 1, "p", "t", dp_rank=-1)


def test_grpo_sampler_defaults_to_one_sample_per_prompt() -> None:
    assert tq.GRPOGroupNSampler().n_samples_per_prompt == 1
    assert tq.GRPOGroupNSampler().sample([3, 4, 5], 2) == ([3, 4], [3, 4])


async def test_strided_nested_columns_put_as_dict_and_chunk() -> None:
    nt = _strided([torch.ones(2, 2), torch.zeros(3, 2)])
    meta = tq.BatchMeta(partition_id="p", global_indexes=[0, 1], field_names=["a"], units=[0, 0])
    pieces = tq.chunk_batch_fn(TensorDict({"a": nt}, batch_size=2), meta, micro_batch_size=1)
    assert [len(m) for _, m in pieces] == [1, 1]
    assert pieces[1][0]["a"].unbind()[0].shape == (3, 2)
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        put = await client.put({"a": nt}, partition_id="p")
        got = await client.get_data(put)
        assert [t.shape for t in got["a"].unbind()] == [(2, 2), (3, 2)]
        assert torch.equal(got["a"].unbind()[1], torch.zeros(3, 2))


# ---- item 6: numpy ---------------------------------------------------------------------------


async def test_numpy_columns_are_accepted() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        frozen = np.arange(4, dtype=np.float32)
        frozen.flags.writeable = False
        data = {
            "x": np.ones((2, 2)),
            "y": frozen[:2],
            "s": np.array(["a", "bc"]),
            "big_endian": np.array([1, 2], dtype=">i4"),
            "rows": [np.ones(2, dtype=np.int64), np.zeros(3, dtype=np.int64)],
        }
        put = await client.put(data, partition_id="p")
        got = await client.get_data(put)
        assert got["x"].dtype == torch.float64
        assert got["x"].shape == (2, 2)
        assert got["y"].tolist() == [0.0, 1.0]
        assert got.get("s").tolist() == ["a", "bc"]
        assert got["big_endian"].tolist() == [1, 2]
        assert [t.tolist() for t in got["rows"].unbind()] == [[1, 1], [0, 0, 0]]
        with pytest.raises(tq.SchemaError, match="no rows"):
            await client.put({"x": np.float64(1.0)}, partition_id="p")  # a scalar
        with pytest.raises(tq.UnsupportedTypeError, match="cast"):
            await client.put({"x": np.ones(2, dtype=np.float128)}, partition_id="p")


def test_numpy_column_is_not_copied_when_writable() -> None:
    from tq_async._wire._codec import columns_from_batch

    array = np.arange(6, dtype=np.int64).reshape(3, 2)
    _, _, columns = columns_from_batch({"x": array})
    assert np.shares_memory(columns[0].data, array)  # type: ignore[union-attr]


# ---- item 2: TransferQueue-style samplers ----------------------------------------------------


class _TQStyle(tq.BaseSampler):
    """Written as TransferQueue's tutorial samplers are: ``_states`` from the base."""

    def __init__(self) -> None:
        super().__init__()
        self._states["calls"] = 0
        self.cleared: list[str] = []

    def sample(
        self, ready_indexes: Sequence[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        self._states["calls"] += 1
        pid, task = kwargs["partition_id"], kwargs["task_name"]
        dp_rank, batch_index = kwargs.get("dp_rank"), kwargs.get("batch_index")
        if batch_size == 3:
            raise ValueError("batch_size 3 is unlucky")
        rows = list(ready_indexes[:batch_size])
        if len(rows) < batch_size:
            return [], []
        if dp_rank is not None:
            by_task = self._states.setdefault(pid, {}).setdefault(task, {})
            by_task.setdefault(dp_rank, {})[batch_index] = rows
        return rows, rows

    def clear_cache(self, partition_id: str) -> None:
        self.cleared.append(partition_id)
        super().clear_cache(partition_id)


class _NoSuperInit(tq.BaseSampler):
    def __init__(self) -> None:  # skips super().__init__(), as some user samplers do
        self.seen = 0

    def sample(
        self, ready_indexes: Sequence[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        rows = list(ready_indexes[:batch_size])
        return rows, rows


def test_base_sampler_has_transferqueue_surface() -> None:
    s = _TQStyle()
    assert s._states == {"calls": 0}
    assert s([0, 1, 2], 2, partition_id="p", task_name="t") == ([0, 1], [0, 1])  # __call__
    s([5, 6], 2, partition_id="p", task_name="t", dp_rank=0, batch_index=4)
    assert s.has_cached_result("p", "t", {"dp_rank": 0, "batch_index": 4})
    assert not s.has_cached_result("p", "t", {"dp_rank": 0, "batch_index": 5})
    assert not s.has_cached_result("p", "t", {"batch_index": 4})  # no dp_rank: False
    assert not s.has_cached_result("q", "t", None)
    s.clear_cache("p")
    assert "p" not in s._states
    assert _NoSuperInit()._states == {}
    state = s.save_checkpoint()
    fresh = _TQStyle()
    fresh.load_state_dict(s.state_dict())
    assert fresh._states == state["_states"]
    assert tq.SequentialSampler().state_dict() == {}


def test_unstorable_sampler_state_names_the_sampler() -> None:
    s = _NoSuperInit()
    s._states["rng"] = np.random.RandomState(0)
    with pytest.raises(tq.UnsupportedTypeError, match=r"_NoSuperInit.*save_checkpoint"):
        s.state_dict()


async def test_controller_calls_clear_cache_and_checkpoints_sampler_state(
    tmp_path: Path,
) -> None:
    sampler = _TQStyle()
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(4)}, partition_id="p")
        await client.get_meta(["x"], 2, "p", "t", {"dp_rank": 1, "batch_index": 0})
        assert sampler._states["p"]["t"][1][0] == [0, 1]
        await client.save_checkpoint(tmp_path / "ckpt")
        await client.clear_partition("p")
        assert sampler.cleared == ["p"]
        assert "p" not in sampler._states
    restored = _TQStyle()
    async with (
        tq.local_cluster(num_storage_units=1, sampler=restored) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.load_checkpoint(tmp_path / "ckpt")
        assert restored._states["p"]["t"][1][0] == [0, 1]
        assert restored._states["calls"] >= 1


class _AsyncFailing(tq.BaseSampler):
    async def sample(
        self, ready_indexes: Sequence[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        await anyio.lowlevel.checkpoint()
        raise KeyError("no such group")


async def test_sampler_exceptions_reach_the_caller_as_invalid_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with (
        tq.local_cluster(
            num_storage_units=1,
            sampler=_TQStyle(),
            task_samplers={"async": _AsyncFailing(), "grpo": tq.GRPOGroupNSampler(4)},
        ) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(8)}, partition_id="p")
        with pytest.raises(
            tq.InvalidRequestError, match=r"sampler _TQStyle raised ValueError.*unlucky"
        ):
            await client.get_meta(["x"], 3, "p", "t")
        with pytest.raises(tq.InvalidRequestError, match="sampler _AsyncFailing raised KeyError"):
            await client.get_meta(["x"], 2, "p", "async")
        with pytest.raises(tq.InvalidRequestError, match="sampler GRPOGroupNSampler raised"):
            await client.get_meta(["x"], 3, "p", "grpo")
        # nothing was consumed, the service still answers
        assert (await client.get_meta(["x"], 2, "p", "t")).global_indexes == [0, 1]
    assert "Traceback" not in caplog.text
