"""Tutorial 05: custom samplers written against TransferQueue's BaseSampler (``_states``,
sampling_config parameters), passed to ``init`` in the config."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tq_async
import tq_async.compat as tq


class RandomWithReplacement(tq.BaseSampler):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._states["rng"] = np.random.RandomState(seed)

    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        picked = self._states["rng"].choice(list(ready_indexes), batch_size, replace=True)
        return [int(i) for i in picked], []  # nothing consumed: rows may come again


class RandomWithoutReplacement(tq.BaseSampler):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._states["rng"] = np.random.RandomState(seed)

    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        ready = list(ready_indexes)
        if kwargs.get("seed_check") is not None:
            raise ValueError(f"seed_check={kwargs['seed_check']!r} is not supported")
        if len(ready) < batch_size:
            return [], []
        picked = [int(i) for i in self._states["rng"].choice(ready, batch_size, replace=False)]
        return picked, picked


class Priority(tq.BaseSampler):
    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        scores = kwargs.get("priority_scores")  # a sampling_config entry, as in TransferQueue
        ready = list(ready_indexes)
        if scores is None:
            picked = ready[:batch_size]
        else:
            picked = sorted(ready, key=lambda i: -scores[i])[:batch_size]
        return picked, picked


def _setup(sampler: Any) -> Any:
    tq.init(
        {
            "controller": {"sampler": sampler},
            "backend": {"SimpleStorage": {"num_data_storage_units": 2}},
        }
    )
    tq_client = tq.get_client()
    data = TensorDict({"input": torch.tensor([[i] for i in range(5)])}, batch_size=5)
    tq_client.put(data=data, partition_id="test")
    return tq_client


def test_random_sampler_with_replacement() -> None:
    tq_client = _setup(RandomWithReplacement())
    seen = []
    for size in (2, 1, 2):
        meta = tq_client.get_meta(
            data_fields=["input"], batch_size=size, partition_id="test", task_name="demo_task"
        )
        assert meta.size == size
        seen += meta.global_indexes
    assert set(seen) <= set(range(5))
    assert not tq_client.check_consumption_status("demo_task", "test")  # nothing consumed


def test_random_sampler_without_replacement() -> None:
    tq_client = _setup(RandomWithoutReplacement())
    metas = [
        tq_client.get_meta(data_fields=["input"], batch_size=s, partition_id="test", task_name="t")
        for s in (3, 1)
    ]
    rows = [r for m in metas for r in m.global_indexes]
    assert len(set(rows)) == 4
    data = tq_client.get_data(metas[0])
    assert [int(r) for r in data["input"].unbind()] == metas[0].global_indexes


def test_priority_sampler_reads_sampling_config() -> None:
    tq_client = _setup(Priority)  # a class: init instantiates it
    scores = [0.1, 0.9, 0.5, 0.7, 0.3]
    first = tq_client.get_meta(
        data_fields=["input"], batch_size=2, partition_id="test", task_name="t",
        sampling_config={"priority_scores": scores},
    )  # fmt: skip
    assert first.global_indexes == [1, 3]
    second = tq_client.get_meta(
        data_fields=["input"], batch_size=2, partition_id="test", task_name="t",
        sampling_config={"priority_scores": scores},
    )  # fmt: skip
    assert second.global_indexes == [2, 4]


def test_sampler_state_is_cleared_with_the_partition_and_errors_name_it() -> None:
    sampler = RandomWithoutReplacement()
    tq_client = _setup(sampler)
    sampler._states["test"] = {"t": {0: {0: [1]}}}
    assert sampler.has_cached_result("test", "t", {"dp_rank": 0, "batch_index": 0})
    tq_client.clear_partition("test")
    assert "test" not in sampler._states
    assert "rng" in sampler._states
    tq_client.put(data=TensorDict({"input": torch.zeros(1, 1)}, batch_size=1), partition_id="q")
    with pytest.raises(
        tq_async.InvalidRequestError, match="sampler RandomWithoutReplacement raised ValueError"
    ):
        tq_client.get_meta(
            data_fields=["input"], batch_size=1, partition_id="q", task_name="t",
            sampling_config={"seed_check": 1},
        )  # fmt: skip


def test_built_in_samplers_by_name() -> None:
    tq.init({"controller": {"sampler": "GRPOGroupNSampler"}})
    tq_client = tq.get_client()
    tq_client.put(data=TensorDict({"x": torch.arange(3)}, batch_size=3), partition_id="p")
    meta = tq_client.get_meta(data_fields=["x"], batch_size=2, partition_id="p", task_name="t")
    assert meta.global_indexes == [0, 1]  # n_samples_per_prompt=1 by default
