"""Workers in separate processes that call ``init()`` and attach through ``TQ_ADDRESS``.

* Tutorial 06: a streaming dataloader read by 2 DP groups x 2 ranks, each rank a process
  with a ``StreamingDataLoader`` (RankAwareSampler: ranks of one group get the
  same samples, groups get disjoint ones).
* A verl-v1-trainer-like step: the trainer ``kv_batch_put``s prompts with tags, rollout
  workers ``kv_batch_get`` them with ``select_fields`` and ``kv_batch_put`` responses of their
  own lengths, an asyncio reward step uses the ``async_`` forms, and the trainer reads
  everything with ``kv_batch_get_by_meta`` and ``kv_clear``s the step. KVBatchMeta is the
  handle passed between processes.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
from typing import Any

import anyio
import torch
from tensordict import NonTensorStack, TensorDict

import tq_async.compat as tq

_SPAWN = mp.get_context("spawn")
_TIMEOUT = 90


def _update_worker(rank: int, dp_rank: int, results: Any) -> None:
    config = tq.init()  # attaches to the trainer's cluster (TQ_ADDRESS)
    dataset = tq.StreamingDataset(
        config=config,
        batch_size=2,
        micro_batch_size=2,
        data_fields=["meta_idx"],
        partition_id="train",
        task_name="update_task",
        dp_rank=dp_rank,
        should_check_consumption_status=True,
    )
    # num_workers=0: the rank prefetches on its own event loop (the tutorial's 2 workers per
    # rank are 8 more processes on a 2-core CI box; tq_async's tests cover loader workers)
    dataloader = tq.StreamingDataLoader(dataset=dataset, num_workers=0)
    consumed = []
    for batch, batch_meta in dataloader:
        assert isinstance(batch_meta, tq.BatchMeta)
        consumed.append(batch["meta_idx"].view(-1).tolist())
    del dataloader
    tq.close()
    results.put((rank, dp_rank, consumed))


def test_streaming_dataloader_two_dp_groups_of_two_ranks() -> None:
    tq.init({"controller": {"sampler": tq.RankAwareSampler, "polling_mode": True}})
    tq_client = tq.get_client()
    data = TensorDict({"meta_idx": torch.arange(8).view(8, 1)}, batch_size=8)
    tq_client.put(data, partition_id="train")
    results = _SPAWN.Queue()
    dp_ranks = [0, 0, 1, 1]
    procs = [
        _SPAWN.Process(target=_update_worker, args=(rank, dp, results))
        for rank, dp in enumerate(dp_ranks)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=_TIMEOUT) for _ in procs]
    for p in procs:
        p.join(_TIMEOUT)
        assert p.exitcode == 0
    by_rank = {rank: (dp, batches) for rank, dp, batches in got}
    assert by_rank[0][1] == by_rank[1][1]  # one DP group: identical batches
    assert by_rank[2][1] == by_rank[3][1]
    group0 = [i for b in by_rank[0][1] for i in b]
    group1 = [i for b in by_rank[2][1] for i in b]
    assert not set(group0) & set(group1)  # groups: disjoint samples
    assert sorted(group0 + group1) == list(range(8))  # nothing lost
    assert tq_client.check_consumption_status("update_task", "train")


def _rollout_worker(meta: tq.KVBatchMeta, length: int, results: Any) -> None:
    tq.init()
    prompts = tq.kv_batch_get(
        keys=meta.keys, partition_id=meta.partition_id, select_fields=["input_ids"]
    )
    n = prompts.batch_size[0]
    # jagged, as TransferQueue returns it; padded to this worker's length
    responses = prompts["input_ids"].to_padded_tensor(0)[:, :1].repeat(1, length)
    out = tq.kv_batch_put(
        keys=meta.keys,
        partition_id=meta.partition_id,
        fields=TensorDict(
            {"responses": responses, "response_mask": torch.ones(n, length, dtype=torch.bool)},
            batch_size=n,
        ),
        tags=[{"status": "rollout_done", "response_length": length}] * n,
    )
    tq.close()
    results.put(out)


async def _reward(meta: tq.KVBatchMeta) -> tq.KVBatchMeta:
    td = await tq.async_kv_batch_get_by_meta(meta, select_fields=["responses"])
    scores = torch.tensor([float(r.shape[0]) for r in td["responses"].unbind()])
    return await tq.async_kv_batch_put(
        keys=meta.keys,
        partition_id=meta.partition_id,
        fields=TensorDict({"token_level_scores": scores}, batch_size=len(meta)),
        tags=[{"status": "scored"}] * len(meta),
    )


def test_verl_v1_trainer_step() -> None:
    tq.init()
    step = "train@step_3"
    keys = [f"uid{i}_0" for i in range(6)]
    prompts = TensorDict(
        {
            "input_ids": torch.arange(6 * 4).view(6, 4),
            "multi_modal_inputs": NonTensorStack(
                *[{"pixel_values_shape": [1, i]} for i in range(6)]
            ),
        },
        batch_size=6,
    )
    meta = tq.kv_batch_put(
        keys=keys, partition_id=step, fields=prompts, tags=[{"status": "prompt"}] * 6
    )
    assert sorted(meta.fields or []) == ["input_ids", "multi_modal_inputs"]
    # dispatch: each rollout worker gets a chunk of the KVBatchMeta, in its own process
    results = _SPAWN.Queue()
    chunks = meta.chunk(2)
    procs = [
        _SPAWN.Process(target=_rollout_worker, args=(chunk, 3 + 2 * i, results))
        for i, chunk in enumerate(chunks)
    ]
    for p in procs:
        p.start()
    rolled = [results.get(timeout=_TIMEOUT) for _ in procs]
    for p in procs:
        p.join(_TIMEOUT)
        assert p.exitcode == 0
    rolled_meta = tq.KVBatchMeta.concat(sorted(rolled, key=lambda m: m.keys[0]))
    assert rolled_meta.keys == keys
    assert sorted(rolled_meta.fields or []) == [
        "input_ids", "multi_modal_inputs", "response_mask", "responses"
    ]  # fmt: skip
    scored = anyio.run(_reward, rolled_meta)  # an asyncio worker (the async_ forms)
    # the trainer reads the whole step by its handle
    batch = tq.kv_batch_get_by_meta(scored)
    assert [r.shape[0] for r in batch["responses"].unbind()] == [3, 3, 3, 5, 5, 5]
    assert batch["token_level_scores"].tolist() == [3.0, 3.0, 3.0, 5.0, 5.0, 5.0]
    assert batch.get("multi_modal_inputs").tolist()[4] == {"pixel_values_shape": [1, 4]}
    listing = tq.kv_list(partition_id=step)[step]
    assert listing["uid4_0"] == {"status": "scored", "response_length": 5}
    selected = tq.kv_batch_get(keys=keys[:3], partition_id=step, select_fields=["responses"])
    # one rollout worker's rows, all of one length: still jagged, as in TransferQueue
    assert selected["responses"].offsets().tolist() == [0, 3, 6, 9]
    tq.kv_clear(keys=keys, partition_id=step)
    assert tq.kv_list(partition_id=step)[step] == {}


def test_streaming_dataloader_with_loader_workers() -> None:
    config = tq.init()
    tq.get_client().put(
        TensorDict({"meta_idx": torch.arange(12).view(12, 1)}, batch_size=12),
        partition_id="train",
    )
    dataset = tq.StreamingDataset(
        config=config,
        batch_size=4,
        micro_batch_size=2,
        data_fields=["meta_idx"],
        partition_id="train",
        task_name="update_task",
        dp_rank=0,
        should_check_consumption_status=True,
    )
    loader = tq.StreamingDataLoader(dataset=dataset, num_workers=2, prefetch_factor=2)
    got = []
    for batch, batch_meta in loader:
        assert isinstance(batch_meta, tq.BatchMeta)
        assert len(batch_meta) == 2
        got += batch["meta_idx"].view(-1).tolist()
    assert got == list(range(12))


#: set by the test in this process: a forked worker inherits it, a spawned one imports anew
_PARENT_STATE: list[str] = []


def _expect_start_method(forked: bool, _worker_id: int) -> None:
    if bool(_PARENT_STATE) != forked:
        raise AssertionError(f"the worker was {'not ' if forked else ''}forked")


def test_streaming_dataloader_workers_start_with_the_platforms_default_method() -> None:
    """No ``multiprocessing_context``: workers start as torch's do, with the platform's
    default method (``fork`` on Linux up to Python 3.13), not ``spawn``."""
    config = tq.init()
    tq.get_client().put(TensorDict({"x": torch.arange(8).view(8, 1)}, [8]), partition_id="dflt")
    dataset = tq.StreamingDataset(
        config=config,
        batch_size=4,
        micro_batch_size=4,
        data_fields=["x"],
        partition_id="dflt",
        task_name="t",
        dp_rank=0,
        should_check_consumption_status=True,
    )
    _PARENT_STATE.append("set after import")
    try:
        forked = mp.get_start_method() == "fork"
        loader = tq.StreamingDataLoader(
            dataset=dataset,
            num_workers=2,
            worker_init_fn=functools.partial(_expect_start_method, forked),
        )
        got = [v for batch, _ in loader for v in batch["x"].view(-1).tolist()]
    finally:
        _PARENT_STATE.clear()
    assert got == list(range(8))
