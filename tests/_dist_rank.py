"""One rank of ``tests/programs/test_distributed.py``: read phases through tq_async, all_reduce
each step.

Run as ``python _dist_rank.py CONFIG_JSON OUT_JSON`` with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set. The rank joins one gloo process group, reused by
every phase of the config, reads each phase's partition (``StreamingDataLoader`` with 0 or 2
workers, or ``AsyncStreamingDataset``) and records, per step, the batch index and the rows it
got. It writes ``{phase name: {"steps": [...], "error": str | None, "mismatch": str | None}}``.

Every step is a real ``all_reduce``, and it carries whether this rank still has a batch: a
rank whose stream ended joins the step collective of the ranks that still have one with a 0
(``sum < world``), so a step-count mismatch is *detected* (all ranks stop the phase and have
run the same number of collectives, so the process group stays usable for the next phase)
instead of hanging. Anything else that blocks (a fetch that never returns) is bounded by
``faulthandler.dump_traceback_later(exit=True)``: the rank prints every thread's stack and
exits, and the parent reports it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import anyio
import torch
import torch.distributed as dist

import tq_async as tq

_END = object()


class _Phase:
    """One phase's reading loop: step, all_reduce, record, until every rank's stream ends."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world
        self.steps: list[dict[str, Any]] = []
        self.error: str | None = None
        self.mismatch: str | None = None

    def record(self, item: Any) -> None:
        td, meta = item
        rows = list(meta.global_indexes)
        if meta.end_of_stream:
            raise AssertionError(f"an end-of-stream BatchMeta was yielded as a batch: {meta}")
        if len(rows) == 0:
            if td.batch_size != torch.Size([0]):
                raise AssertionError(f"a batch of 0 rows came with data of {td.batch_size}")
        elif td["x"].tolist() != rows:
            raise AssertionError(f"data {td['x'].tolist()} does not match the meta's rows {rows}")
        self.steps.append({"b": meta.batch_index, "rows": rows})

    def go_on(self, item: Any, total: int) -> bool:
        """After the step's all_reduce of "I have a batch" (``total`` ranks had one).

        Records ``item`` (when there is one) and says whether the phase goes on: not once
        this rank's stream ended, nor once another rank's did.
        """
        have = item is not _END
        if have:
            try:
                self.record(item)
            except AssertionError as exc:
                self.error = str(exc)
        if have and total != self.world:
            self.mismatch = (
                f"rank {self.rank} had a batch for step {len(self.steps) - 1} but "
                f"{self.world - total} rank(s) had ended"
            )
            return False
        if not have and total:
            self.mismatch = (
                f"rank {self.rank} ended after {len(self.steps)} steps while {total} rank(s) "
                "still had a batch"
            )
        return have

    def result(self) -> dict[str, Any]:
        return {"steps": self.steps, "error": self.error, "mismatch": self.mismatch}


def _flag(have: bool) -> torch.Tensor:
    return torch.tensor([1 if have else 0], dtype=torch.int64)


def _run_loader(phase: dict[str, Any], address: str, dp_rank: int, run: _Phase) -> None:
    workers = phase["num_workers"]
    ds = tq.StreamingDataset(
        address,
        ["x"],
        phase["batch_size"],
        phase["batch_size"],  # one micro-batch per batch: one step per batch
        phase["partition_id"],
        phase["task"],
        dp_rank=dp_rank,
        dp_size=phase["dp_size"],
        tail=phase["tail"],
    )
    loader = tq.StreamingDataLoader(
        ds, num_workers=workers, multiprocessing_context="fork" if workers else None
    )
    items: Iterator[Any] = iter(loader)
    try:
        while True:
            item: Any
            try:
                item = next(items, _END)
            except Exception as exc:  # reported by the parent; the rank keeps in step
                run.error = f"{type(exc).__name__}: {exc}"
                item = _END
            flag = _flag(item is not _END)
            dist.all_reduce(flag)  # the step's collective
            if not run.go_on(item, int(flag.item())):
                return
    finally:
        del items  # shuts the workers down


async def _run_async(phase: dict[str, Any], address: str, dp_rank: int, run: _Phase) -> None:
    ds = tq.AsyncStreamingDataset(
        address,
        ["x"],
        phase["batch_size"],
        phase["batch_size"],
        phase["partition_id"],
        phase["task"],
        dp_rank=dp_rank,
        dp_size=phase["dp_size"],
        tail=phase["tail"],
    )
    async with ds:
        while True:
            item: Any
            try:
                item = await anext(ds, _END)
            except Exception as exc:
                run.error = f"{type(exc).__name__}: {exc}"
                item = _END
            flag = _flag(item is not _END)
            # in a thread, so prefetching goes on during the collective (as in a training step)
            await anyio.to_thread.run_sync(dist.all_reduce, flag)
            if not run.go_on(item, int(flag.item())):
                return


def main() -> None:
    config_path, out_path = sys.argv[1], sys.argv[2]
    with open(config_path) as f:
        config = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dp_rank = rank // config["tp_size"]
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=config["collective_timeout"]),
    )
    results: dict[str, Any] = {}
    for phase in config["phases"]:
        # a phase that blocks (not a step mismatch: that is detected) dumps stacks and exits
        faulthandler.dump_traceback_later(config["phase_timeout"], exit=True)
        run = _Phase(rank, world)
        t0 = time.monotonic()
        if phase["mode"] == "async":
            anyio.run(_run_async, phase, config["address"], dp_rank, run)
        else:
            _run_loader(phase, config["address"], dp_rank, run)
        faulthandler.cancel_dump_traceback_later()
        results[phase["name"]] = {**run.result(), "seconds": round(time.monotonic() - t0, 3)}
    dist.barrier()
    dist.destroy_process_group()
    tmp = f"{out_path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, out_path)


if __name__ == "__main__":
    main()
