"""What TransferQueue 0.1.11 does, observed by running the same calls on it (``pip install
transferqueue==0.1.11``, Ray with 4 CPUs) and on ``tq_async.compat``: each test names the
TransferQueue call that showed the behaviour it asserts. None needs TransferQueue installed."""

from __future__ import annotations

import torch
from tensordict import TensorDict

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
