"""The calls verl 0.9.1's v1 trainer makes on ``transfer_queue``, in its order, through
``tq_async.compat`` (verl is not a dependency: the sequence is written out here)."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict

import tq_async
import tq_async.compat as tq


async def _step(tmp_path: Path) -> None:
    client = tq.get_client()
    partition = "train"
    assert tq.kv_list(partition) == {}  # a fresh asynchronous run asks before step 1
    assert tq.kv_list() == {}
    uids = [f"uid{i}" for i in range(4)]
    for uid in uids:  # the agent loop: one key per sample, tags as status
        await tq.async_kv_put(key=uid, partition_id=partition, tag={"status": "pending"})
    responses = torch.nested.as_nested_tensor(
        [torch.arange(3), torch.arange(3), torch.arange(5), torch.arange(2)], layout=torch.jagged
    )
    rewards = NonTensorStack(*[{"acc": np.float64(i / 4)} for i in range(4)])
    await tq.async_kv_batch_put(
        keys=uids, partition_id=partition,
        fields=TensorDict({"responses": responses, "reward_extra": rewards}, batch_size=4),
        tags=[{"status": "done"}] * 4,
    )  # fmt: skip
    # the trainer turns keys into a BatchMeta and dispatches chunks to workers
    meta = await client.async_kv_retrieve_meta(keys=uids, partition_id=partition, create=False)
    assert meta.size == 4
    assert meta.partition_ids == [partition] * 4
    assert meta.field_names == ["responses", "reward_extra"]
    keys = await client.async_kv_retrieve_keys(meta.global_indexes, partition_id=partition)
    assert keys == uids
    meta.extra_info = {"micro_batch_size": 2, "global_step": 1}  # every worker dispatch
    chunks = meta.select_fields(["responses"]).chunk(chunks=2)
    datas = [await client.async_get_data(c) for c in chunks]
    assert [d["responses"].offsets().tolist() for d in datas] == [[0, 3, 6], [0, 5, 7]]
    padded = datas[0]["responses"].to_padded_tensor(0)
    assert padded.shape == (2, 3)  # rows of one length are still jagged
    # a worker writes old log-probs back through the chunk's metadata (its own copy, which
    # Ray handed it: the put adds the field to that copy, as in TransferQueue)
    out = TensorDict({"old_log_probs": torch.zeros(2, 1)}, batch_size=2)
    written = await client.async_put(data=out, metadata=chunks[1].copy())
    assert written.extra_info["global_step"] == 1
    joined = tq.BatchMeta.concat(chunks)
    assert joined.global_indexes == meta.global_indexes
    # no critic, no KL: selecting values / ref_log_prob leaves them out
    td = tq.kv_batch_get(uids, partition, select_fields=["responses", "values", "ref_log_prob"])
    assert list(td.keys()) == ["responses"]
    assert td["responses"].to_padded_tensor(-1).shape == (4, 5)
    assert [r["acc"] for r in tq.kv_batch_get(uids, partition)["reward_extra"].tolist()] == [
        0.0,
        0.25,
        0.5,
        0.75,
    ]
    kv_meta = tq.KVBatchMeta(
        keys=uids, tags=[{}] * 4, partition_id=partition, fields=["responses"], extra_info={}
    )
    assert tq.kv_batch_get_by_meta(kv_meta)["responses"].offsets().tolist()[-1] == 13
    tq.save_checkpoint(tmp_path / "ckpt", metadata={"global_step": 1})
    assert tq_async.checkpoint_metadata(tmp_path / "ckpt") == {"global_step": 1}
    tq.kv_clear(keys=uids, partition_id=partition)
    assert tq.kv_list(partition) == {partition: {}}


def test_verl_v1_trainer_call_sequence(tmp_path: Path) -> None:
    tq.init({"metrics": {"enabled": True, "port": 0}})
    assert tq.get_metrics_endpoint() is not None
    anyio.run(_step, tmp_path)
    tq.get_client().clear_partition("train")
    tq.load_checkpoint(tmp_path / "ckpt")
    assert sorted(tq.kv_list("train")["train"]) == ["uid0", "uid1", "uid2", "uid3"]
