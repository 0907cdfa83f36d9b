"""Quick start: an embedded cluster, a producer putting batches, a consumer streaming them.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import anyio
import torch
from tensordict import TensorDict

import tq_async as tq


async def main() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):

        async def produce() -> None:
            for step in range(4):
                prompts = TensorDict({"input_ids": torch.randint(0, 100, (8, 16))}, [8])
                meta = await client.put(prompts, partition_id="train@0")
                rewards = TensorDict({"reward": torch.rand(8)}, [8])
                await client.put(rewards, meta=meta)  # add a field to the same rows
                print(f"put batch {step}: rows {meta.global_indexes[0]}..{meta.global_indexes[-1]}")
            await client.seal("train@0")  # no more rows: consumers see end-of-stream

        async def consume() -> None:
            while True:
                meta = await client.get_meta(["input_ids", "reward"], 16, "train@0", "learner")
                if meta.end_of_stream:
                    break
                td = await client.get_data(meta)
                print(f"learner got {len(meta)} rows, mean reward {td['reward'].mean():.3f}")

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            tg.start_soon(produce)


if __name__ == "__main__":
    anyio.run(main)
