"""W4 start-up on TransferQueue: time from start to the first put, teardown, peak RSS.

Each repetition is a fresh interpreter (``python -m benchmarks.transferqueue._w4_child``) that
imports torch + Ray + transfer_queue (timed alone), then ``ray.init(num_cpus=4)`` +
``transfer_queue.init()`` (controller + 2 storage units as Ray actors) + a one-row put from the
default client; teardown is ``transfer_queue.close()`` + ``ray.shutdown()``. Then the same again
in the same process (``2nd in process``: imports done, Ray started afresh).

Peak RSS (``VmHWM``) is taken just after the first put: of the client (driver) process, of the
controller actor, of the storage-unit actors, and of the rest of Ray (GCS, raylet, agents, idle
workers). Sums of ``VmHWM`` count shared pages (libraries) once per process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from time import perf_counter
from typing import Any

from ._common import Config, failure, median, result

__all__ = ["run"]

WORKLOAD = "W4"
REPO_ROOT = Path(__file__).resolve().parents[2]


def _child(timeout: float) -> tuple[dict[str, Any], float]:
    t0 = perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.transferqueue._w4_child"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    wall = perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith("W4_RESULT="):
            return json.loads(line.split("=", 1)[1]), wall
    raise RuntimeError(
        f"W4 child exited {proc.returncode} without a result:\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


def _s(metric: str, values: list[float], note: str = "") -> dict[str, Any]:
    return result(
        WORKLOAD,
        metric,
        median(values),
        "s",
        best=min(values),
        higher_is_better=False,
        n=len(values),
        note=note,
    )


def _mb(metric: str, values: list[float], note: str = "") -> dict[str, Any]:
    known = [v / 1e6 for v in values]
    return result(
        WORKLOAD,
        metric,
        median(known) if known else float("nan"),
        "MB",
        best=min(known) if known else None,
        higher_is_better=False,
        n=len(known),
        note=note,
    )


def run(cfg: Config) -> list[dict[str, Any]]:
    """Run W4 on TransferQueue and return its results."""
    reps = cfg.pick(3, 1)
    runs = []
    errors = []
    for _ in range(reps):
        try:
            runs.append(_child(cfg.pick(240, 180)))
        except Exception as e:  # a hung or failed start: record it, try the next repetition
            errors.append(f"{type(e).__name__}: {str(e)[-500:]}")
    if not runs:
        return [failure(WORKLOAD, "ray.init+tq.init start->first put", "s", "; ".join(errors))]
    res = [r for r, _ in runs]
    walls = [w for _, w in runs]
    failed = f"; {len(errors)} of {reps} runs failed: {errors[0]}" if errors else ""
    units = [sum(r["controller_peak_rss"]) + sum(r["storage_peak_rss"]) for r in res]
    everything = [
        r["peak_rss"] + sum(r["controller_peak_rss"] + r["storage_peak_rss"] + r["ray_peak_rss"])
        for r in res
    ]
    return [
        _s(
            "ray.init+tq.init start->first put",
            [r["total_s"] for r in res],
            "ray.init(num_cpus=4) + tq.init (controller + 2 units) + 1-row put, fresh process, "
            "after imports" + failed,
        ),
        _s("ray.init", [r["ray_init_s"] for r in res], "local instance, no dashboard"),
        _s("tq.init", [r["tq_init_s"] for r in res], "controller + 2 storage units (Ray actors)"),
        _s("first put (1 row) after init", [r["put_s"] for r in res]),
        _s(
            "ray.init+tq.init start->first put, 2nd in process",
            [r["warm_total_s"] for r in res],
            "imports done, Ray started again",
        ),
        _s("teardown (tq.close + ray.shutdown)", [r["teardown_s"] for r in res]),
        _s("import transfer_queue", [r["import_s"] for r in res], "includes torch and Ray"),
        _s("fresh interpreter: launch->exit", walls, "both start/put/stop cycles"),
        _mb("peak RSS, client process", [r["peak_rss"] for r in res], "VmHWM of the driver"),
        _mb(
            "peak RSS, controller actor",
            [max(r["controller_peak_rss"]) for r in res if r["controller_peak_rss"]],
            "VmHWM",
        ),
        _mb(
            "peak RSS, storage unit actor (max)",
            [max(r["storage_peak_rss"]) for r in res if r["storage_peak_rss"]],
            "VmHWM, largest of the 2 units",
        ),
        _mb("peak RSS, TQ actors (controller + 2 units)", units, "sum of VmHWM"),
        _mb(
            "peak RSS, Ray system processes (sum)",
            [sum(r["ray_peak_rss"]) for r in res],
            f"sum of VmHWM of {res[0]['ray_processes']} processes (GCS, raylet, agents, workers)",
        ),
        _mb("peak RSS, all processes (sum)", everything, "client + actors + Ray, sum of VmHWM"),
    ]
