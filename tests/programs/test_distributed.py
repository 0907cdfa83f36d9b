"""Acceptance: DP 2 x TP 2 torch.distributed ranks read in lockstep through tq_async.

Four real processes (``_dist_rank.py``) join one gloo process group, reused by every phase.
The services run in this process (``local_cluster`` on the portal loop, TCP on loopback), one
sampler per task. Each phase reads a fresh sealed partition whose row count does not divide by
``dp_size * batch_size``, through ``StreamingDataLoader`` (0 and 2 workers) or
``AsyncStreamingDataset``, for every built-in sampler; every step is an ``all_reduce``. Checked
per phase: TP peers got identical rows at every step, every rank ran the same number of steps
(with step ``i`` reading batch ``i``), every row reached exactly one DP rank, and with
``tail="drop"`` every row not reported dropped exactly once.

A step-count mismatch does not hang: the step collective carries "I still have a batch", so
the ranks notice and stop the phase together (see ``_dist_rank.py``); a rank that blocks
otherwise dumps its stacks and exits after ``PHASE_TIMEOUT``; the whole run is bounded by
``RUN_TIMEOUT``. All phases run before the verdict, which lists every problem found.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import tq_async as tq
from _cluster_proc import free_port
from tq_async._portal import get_portal

DP, TP = 2, 2
WORLD = DP * TP
BATCH = 4  # rows per rank per batch: a global batch is DP * BATCH = 8 rows
PHASE_TIMEOUT = 20.0
COLLECTIVE_TIMEOUT = 20.0
RUN_TIMEOUT = 100.0  # below the test's own timeout, so the ranks' output is shown

#: task -> (sampler factory, rows per group, groups): none of the row counts divides by 8, and
#: no tail splits evenly over the DP ranks (so tail "drop" drops something)
SAMPLERS: dict[str, tuple[Callable[[str], tq.BaseSampler], int, int]] = {
    "seq": (lambda tail: tq.SequentialSampler(), 1, 21),  # tail of 5 rows
    "grpo": (lambda tail: tq.GRPOGroupNSampler(2), 2, 9),  # tail of 1 group: an empty share
    "rankaware": (
        lambda tail: tq.RankAwareSampler(tq.GRPOGroupNSampler(2), n_replicas=TP),
        2,
        11,
    ),
    "seqlen": (
        lambda tail: tq.SeqlenBalancedSampler(
            n_samples_per_prompt=2, dp_size=DP, n_replicas=TP, tail=tail
        ),
        2,
        9,
    ),
    "stale": (lambda tail: tq.StalenessSampler(tq.SequentialSampler(), max_staleness=1), 1, 19),
}
#: (mode, DataLoader workers, tail) of each phase, per sampler
MODES = [("loader", 0, "uneven"), ("loader", 2, "uneven"), ("async", 0, "uneven")]
DROP_MODES = [("loader", 2, "drop"), ("async", 0, "drop")]


def _task(sampler: str, tail: str) -> str:
    return sampler if tail == "uneven" else f"{sampler}-{tail}"


@contextmanager
def _services() -> Iterator[tuple[str, tq.Client]]:
    """A local cluster on this process's portal loop (TCP), one sampler per task."""
    samplers = {
        _task(name, tail): factory(tail)
        for name, (factory, _, _) in SAMPLERS.items()
        for tail in ("uneven", "drop")
    }
    cluster_cm = tq.local_cluster(num_storage_units=2, task_samplers=samplers, transport="tcp")
    with (
        get_portal().wrap_async_context_manager(cluster_cm) as cluster,
        tq.Client.connect(cluster.address) as client,
    ):
        yield cluster.address, client


def _fill(client: tq.Client, partition_id: str, group: int, groups: int) -> int:
    """Put ``group * groups`` rows (``x`` = row id, whole groups per put, 3 puts), seal."""
    n = group * groups
    cuts = sorted({0, group * (groups // 3), group * (2 * groups // 3), n})
    for a, b in itertools.pairwise(cuts):
        rows = list(range(a, b))
        client.put(
            {"x": torch.tensor(rows, dtype=torch.int64)},
            partition_id=partition_id,
            tags=[{"uid": r // group, "total_lengths": 10 + (r // group * 7) % 13} for r in rows],
        )
    client.seal(partition_id)
    return n


def _run_ranks(tmp: Path, config: dict[str, Any]) -> list[dict[str, Any]] | str:
    """Start the ranks, wait (bounded) for all; their results, or a failure naming the rank.

    The failure is returned, not raised: raised inside the cluster's ``with`` it would come
    out wrapped in the cluster task group's ExceptionGroup.
    """
    config_path = tmp / "config.json"
    config_path.write_text(json.dumps(config))
    script = Path(__file__).resolve().parents[1] / "_dist_rank.py"
    port = free_port()
    procs, logs = [], []
    for rank in range(WORLD):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
        }
        log = (tmp / f"rank{rank}.log").open("wb")
        logs.append(log)
        cmd = [sys.executable, str(script), str(config_path), str(tmp / f"rank{rank}.json")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + RUN_TIMEOUT
    failed: list[str] = []
    try:
        for rank, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed.append(f"rank {rank} still running after {RUN_TIMEOUT:.0f} s")
                break
            if code != 0:
                failed.append(f"rank {rank} exited with {code}")
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        for log in logs:
            log.close()
    if failed:
        tails = [
            f"--- rank {r} output (last 6000 chars) ---\n"
            + (tmp / f"rank{r}.log").read_text(errors="replace")[-6000:]
            for r in range(WORLD)
        ]
        hint = (
            f"(a rank blocked for {PHASE_TIMEOUT:.0f} s in one phase prints 'Timeout' and every "
            "thread's stack, then exits)"
        )
        return "; ".join(failed) + f" {hint}\n" + "\n".join(tails)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _reported_dropped(client: tq.Client, partition_id: str, task: str) -> int | None:
    """The controller's count of rows dropped by the tail policy for ``task`` (None: absent)."""
    dropped = client.partition_info(partition_id).get("dropped")
    return int(dropped.get(task, 0)) if isinstance(dropped, dict) else None


def _check_phase(
    phase: dict[str, Any], per_rank: list[dict[str, Any]], n_rows: int, dropped: int | None
) -> list[str]:
    """Every broken promise of one phase, as readable lines (empty: all kept)."""
    name = phase["name"]
    problems = [
        f"{name}: rank {r} (dp {r // TP}, tp {r % TP}) raised {got['error']}"
        for r, got in enumerate(per_rank)
        if got["error"]
    ]
    steps = [got["steps"] for got in per_rank]
    counts = [len(s) for s in steps]
    notes = [got["mismatch"] for got in per_rank if got["mismatch"]]
    if len(set(counts)) != 1 or notes:
        rows_per_rank = [sum(len(s["rows"]) for s in ranks) for ranks in steps]
        problems.append(
            f"{name}: ranks ran {counts} steps reading {rows_per_rank} rows (ranks 0,1 = dp 0, "
            "2,3 = dp 1; a rank stops where another ended): an all_reduce per step would hang"
            + ("" if len(set(counts)) != 1 else f" ({notes[0]})")
        )
    for r, ranks in enumerate(steps):
        indexes = [s["b"] for s in ranks]
        if indexes != list(range(len(indexes))):
            problems.append(f"{name}: rank {r} read batch indexes {indexes}, not 0, 1, 2, ...")
    problems += [
        f"{name}: TP peers rank {dp * TP} and rank {peer} (dp {dp}) got different batches: "
        f"{[s['rows'] for s in steps[dp * TP]]} vs {[s['rows'] for s in steps[peer]]}"
        for dp in range(DP)
        for peer in range(dp * TP + 1, (dp + 1) * TP)
        if steps[peer] != steps[dp * TP]
    ]
    delivered = [row for dp in range(DP) for s in steps[dp * TP] for row in s["rows"]]
    twice = sorted({row for row in delivered if delivered.count(row) > 1})
    if twice:
        problems.append(f"{name}: rows {twice} reached more than one DP rank (or one twice)")
    missing = sorted(set(range(n_rows)) - set(delivered))
    if phase["tail"] == "uneven" and missing:
        problems.append(f"{name}: rows {missing} of {n_rows} were never delivered (tail uneven)")
    if phase["tail"] == "drop":
        if not missing:
            problems.append(f"{name}: the tail cannot split evenly, yet nothing was dropped")
        if dropped != len(missing):
            problems.append(
                f"{name}: {len(missing)} rows were not delivered ({missing}) but the controller "
                f"reports {dropped!r} dropped for task {phase['task']!r} "
                "(partition_info()['dropped'])"
            )
        for i, group in enumerate(zip(*(steps[dp * TP] for dp in range(DP)), strict=False)):
            shares = [len(s["rows"]) for s in group]
            if len(set(shares)) != 1:
                problems.append(f"{name}: step {i} split unevenly under tail drop: {shares}")
    return problems


@pytest.mark.timeout(RUN_TIMEOUT + 40)
def test_dp_ranks_read_in_lockstep_for_every_sampler(tmp_path: Path) -> None:
    with _services() as (address, client):
        phases, sizes = [], {}
        for sampler, (_, group, groups) in SAMPLERS.items():
            for mode, workers, tail in MODES + DROP_MODES:
                name = f"{sampler}/{mode}{workers if mode == 'loader' else ''}/{tail}"
                partition_id = f"lockstep-{len(phases)}"
                sizes[name] = _fill(client, partition_id, group, groups)
                phases.append(
                    {
                        "name": name,
                        "mode": mode,
                        "num_workers": workers,
                        "tail": tail,
                        "task": _task(sampler, tail),
                        "partition_id": partition_id,
                        "batch_size": BATCH,
                        "dp_size": DP,
                    }
                )
        config = {
            "address": address,
            "tp_size": TP,
            "phases": phases,
            "phase_timeout": PHASE_TIMEOUT,
            "collective_timeout": COLLECTIVE_TIMEOUT,
        }
        results = _run_ranks(tmp_path, config)
        if isinstance(results, str):
            failure = results
            problems, seconds = [], {}
        else:
            failure = None
            problems, seconds = _check_phases(client, phases, sizes, results)
    assert failure is None, failure
    print("phase seconds:", json.dumps(seconds))
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


def _check_phases(
    client: tq.Client,
    phases: list[dict[str, Any]],
    sizes: dict[str, int],
    results: list[dict[str, Any]],
) -> tuple[list[str], dict[str, float]]:
    """Every phase's problems, and each phase's duration (the slowest rank's)."""
    problems: list[str] = []
    seconds: dict[str, float] = {}
    for phase in phases:
        per_rank = [results[r][phase["name"]] for r in range(WORLD)]
        dropped = None
        if phase["tail"] == "drop":
            dropped = _reported_dropped(client, phase["partition_id"], phase["task"])
        problems += _check_phase(phase, per_rank, sizes[phase["name"]], dropped)
        seconds[phase["name"]] = max(got["seconds"] for got in per_rank)
    return problems, seconds
