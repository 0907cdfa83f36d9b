"""Bytes that stay on their host: ``python -m benchmarks.locality`` (issue 39).

Label-only mode (the one implemented): every "host" is a host-id label on this machine
(``local_cluster(host_id=[...])`` for the units, ``host_id=`` for the clients), so what is
measured is the *byte split*, not time: of all bytes the learner ranks read, how many came
from a unit of their own host. Per host: one storage unit, one rollout producer and one
learner rank (DP = hosts). The producers put GRPO groups of ``--group`` responses with jagged
lengths, one group per put; the learner reads global batches through
``SeqlenBalancedSampler(dp_size=hosts)``. The same run is made with ``placement="local"``
(rows on the producer's unit, shares handed to ranks by locality) and with
``placement="round_robin"`` (the behaviour before locality), and the report gives, for each:
the cross-host share of the learner's bytes, and the token imbalance of the steps (largest
rank's tokens over the mean; the assignment only permutes the sampler's shares, so it is the
same in both).

Simulated hosts with a rate-limited network (namespaces + ``tc``), and the data time they would
show, are not part of this mode.

Example: ``python -m benchmarks.locality --hosts 4 --steps 20``.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

import anyio


async def run_mode(
    placement: str, hosts: int, steps: int, groups_per_rank: int, group: int, seed: int
) -> dict[str, Any]:
    """One run: ``steps`` global batches produced on every host and read by every rank."""
    import torch

    import tq_async as tq

    labels = [f"h{i}" for i in range(hosts)]
    sampler = tq.SeqlenBalancedSampler(n_samples_per_prompt=group, dp_size=hosts)
    rng = random.Random(seed)
    batch_size = groups_per_rank * group
    imbalance: list[float] = []
    async with tq.local_cluster(
        num_storage_units=hosts,
        host_id=labels,
        placement=placement,
        task_samplers={"learner": sampler},
    ) as cluster:
        clients = [
            tq.AsyncClient.connect(cluster.address, host_id=h, inline_get_bytes=0) for h in labels
        ]
        for c in clients:
            await c.open()
        try:
            uid = 0
            for step in range(steps):
                for producer in clients:  # every host produces its share of the step
                    for _ in range(groups_per_rank):
                        lengths = [rng.randint(16, 512) for _ in range(group)]
                        data = {"tokens": [torch.ones(n, dtype=torch.int32) for n in lengths]}
                        tags = [{"uid": uid, "total_lengths": n} for n in lengths]
                        await producer.put(data, partition_id="train", tags=tags)
                        uid += 1
                tokens = [0] * hosts

                async def read(rank: int, step: int = step, tokens: list[int] = tokens) -> None:
                    cfg = {"dp_size": hosts, "dp_rank": rank, "batch_index": step}
                    _, meta = await clients[rank].get(
                        ["tokens"], batch_size, "train", "learner", cfg, nested=True
                    )
                    tokens[rank] = sum(int(t["total_lengths"]) for t in meta.tags)

                async with anyio.create_task_group() as tg:
                    for rank in range(hosts):
                        tg.start_soon(read, rank)
                imbalance.append(max(tokens) / (sum(tokens) / hosts))
            stats = await clients[0].storage_stats()
        finally:
            for c in clients:
                await c.aclose()
    same = sum(s["locality"]["out_same_host"] for s in stats.values())
    other = sum(s["locality"]["out_other_host"] for s in stats.values())
    written_here = sum(s["locality"]["in_same_host"] for s in stats.values())
    written = written_here + sum(s["locality"]["in_other_host"] for s in stats.values())
    return {
        "placement": placement,
        "hosts": hosts,
        "steps": steps,
        "read_bytes": same + other,
        "cross_host_read_fraction": round(other / max(same + other, 1), 4),
        "cross_host_write_fraction": round(1 - written_here / max(written, 1), 4),
        "token_imbalance_mean": round(sum(imbalance) / len(imbalance), 4),
        "token_imbalance_max": round(max(imbalance), 4),
    }


async def run(hosts: int, steps: int, groups_per_rank: int, group: int, seed: int) -> list[Any]:
    """Both placements on the same generated data (same seed)."""
    return [
        await run_mode(mode, hosts, steps, groups_per_rank, group, seed)
        for mode in ("local", "round_robin")
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.locality", description=__doc__)
    parser.add_argument("--hosts", type=int, default=4, help="simulated hosts (default: 4)")
    parser.add_argument("--steps", type=int, default=20, help="global batches (default: 20)")
    parser.add_argument(
        "--groups-per-rank", type=int, default=2, help="GRPO groups per rank per step"
    )
    parser.add_argument("--group", type=int, default=4, help="responses per prompt (default 4)")
    parser.add_argument("--seed", type=int, default=39)
    args = parser.parse_args(argv)
    results = anyio.run(run, args.hosts, args.steps, args.groups_per_rank, args.group, args.seed)
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
