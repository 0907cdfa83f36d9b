"""Supplementary measurements: sampler cost (issue 3) and the streaming dataset (issue 4).

Run: python -m benchmarks.extra [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio
import torch
from tensordict import TensorDict

import tq_async as tq
from tq_async._core._state import ControllerState, ReadyView
from tq_async._core._views import RowOrigin, RowTags
from tq_async.lowlevel import ColumnHeader

REPLAY = 8


def sampler_cost(n_ready: int, reps: int) -> dict[str, float]:
    """Milliseconds per sample() call over ``n_ready`` ready rows (pure, no sockets)."""
    st = ControllerState({0: "u"})
    header = ColumnHeader("x", "dense", "int64", ())
    rows, _, _ = st.put_begin("p", [header], n_ready, None)
    p = st.partition("p")
    p.commit(rows, ["x"], [{"uid": r // 4, "total_lengths": 100 + r % 977} for r in rows])
    rs = p.ready_set("t", ["x"])
    out: dict[str, float] = {}
    cases = {
        "SequentialSampler": (tq.SequentialSampler(), 32, False),
        "RankAwareSampler": (tq.RankAwareSampler(), 32, True),
        "SeqlenBalancedSampler dp8": (tq.SeqlenBalancedSampler(4, dp_size=8), 32, True),
    }
    for name, (sampler, batch, ranked) in cases.items():
        times = []
        for i in range(reps):
            ctx = {
                "tags": RowTags(p),
                "origin": RowOrigin(p),
                "partition_id": "p",
                "task_name": "t",
            }
            if ranked:
                ctx |= {"dp_rank": 0, "batch_index": i, "replays_served": True}
            t0 = time.perf_counter()
            sampler.sample(ReadyView(rs.rows), batch, **ctx)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    return out


async def dataset_vs_get(batches: int) -> dict[str, float]:
    """W1 batch through AsyncStreamingDataset vs raw client.get, and dataset wake-up latency."""
    td = TensorDict(
        {
            "input_ids": torch.randint(0, 1000, (256, 2048)),
            "attention_mask": torch.ones(256, 2048, dtype=torch.int64),
            "reward": torch.rand(256),
        },
        [256],
    )
    nbytes = 256 * 2048 * 8 * 2 + 256 * 4
    fields = ["input_ids", "attention_mask", "reward"]
    out: dict[str, float] = {}
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        # one untimed pass of each first: connections, first-touch memory, buffer pools
        for name in ("raw", "ds", "raw", "ds"):
            pid = f"w1-{name}"
            for _ in range(batches):
                await client.put(td, pid)
            await client.seal(pid)
            t0 = time.perf_counter()
            if name == "raw":
                for _ in range(batches):
                    await client.get(fields, 256, pid, "t")
            else:
                ds = tq.AsyncStreamingDataset(
                    client, fields, 256, 256, pid, "t", prefetch=2, replay_window=REPLAY
                )
                async with ds:
                    async for _ in ds:
                        pass
            out[f"{name} GB/s"] = batches * nbytes / (time.perf_counter() - t0) / 1e9
            await client.clear_partition(pid)
        out["dataset / raw"] = out["ds GB/s"] / out["raw GB/s"]
        # wake-up latency through the dataset: 1-row puts every 10 ms
        lat: list[float] = []
        ds = tq.AsyncStreamingDataset(client, ["t0"], 1, 1, "w3", "t")
        n = max(20, batches * 10)
        async with ds, anyio.create_task_group() as tg:

            async def produce() -> None:
                for _ in range(n):
                    await anyio.sleep(0.01)  # the workload's pacing, not synchronisation
                    await client.put({"t0": torch.tensor([time.perf_counter()])}, "w3")
                await client.seal("w3")

            tg.start_soon(produce)
            async for batch, _ in ds:
                lat.append(time.perf_counter() - float(batch["t0"][0]))
        lat.sort()
        for q in (0.5, 0.9, 0.99):
            out[f"dataset put->consumer p{int(q * 100)} ms"] = lat[int(q * (len(lat) - 1))] * 1e3
        out["dataset put->consumer max ms"] = lat[-1] * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    for name, ms in sampler_cost(2048 if args.smoke else 65536, 5 if args.smoke else 50).items():
        print(f"sampler {name}: {ms:.3f} ms per get_meta at {'2k' if args.smoke else '64k'} ready")
    for name, value in anyio.run(dataset_vs_get, 2 if args.smoke else 40).items():
        print(f"{name}: {value:.3f}")


if __name__ == "__main__":
    main()
