"""W4 start-up: time from start to the first put, teardown time, peak RSS.

Each repetition is a fresh interpreter (``python -m benchmarks._w4_child``), so the numbers
include first-use costs and the peak RSS is that of a process that did nothing else.

* embedded: ``local_cluster(2)`` + ``AsyncClient`` + a one-row put, timed after the imports
  (``import tq_async`` is reported on its own); then the same again in the same process
  ("warm"). Teardown = closing the client and leaving ``local_cluster``.
* process: ``tq-async serve --storage-units 2`` started by the child (which has imported
  tq_async and its client already; the serve process itself never imports torch), time until
  it prints its address, then until a new client's first put
  returns; teardown = SIGTERM until the server exited. Peak RSS of the server (``VmHWM``)
  and of the client process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from time import perf_counter
from typing import Any

from ._common import Config, median, result
from ._proc import REPO_ROOT

__all__ = ["run"]

WORKLOAD = "W4"


def _child(kind: str) -> tuple[dict[str, Any], float]:
    t0 = perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks._w4_child", kind],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    wall = perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith("W4_RESULT="):
            return json.loads(line.split("=", 1)[1]), wall
    raise RuntimeError(
        f"W4 child ({kind}) exited {proc.returncode} without a result:\n"
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


def _mb(metric: str, values: list[float | None], note: str = "") -> dict[str, Any]:
    known = [v / 1e6 for v in values if v is not None]
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
    """Run W4 (the variant of ``cfg.mode``) and return its results."""
    reps = cfg.pick(3, 1)
    runs = [_child(cfg.mode) for _ in range(reps)]
    res = [r for r, _ in runs]
    walls = [w for _, w in runs]
    if cfg.mode == "embedded":
        return [
            _s(
                "local_cluster start->first put",
                [r["start_to_first_put_s"] for r in res],
                "2 units + AsyncClient + 1-row put, fresh process, after imports",
            ),
            _s(
                "local_cluster start->first put, 2nd in process",
                [r["warm_start_to_first_put_s"] for r in res],
            ),
            _s("local_cluster teardown", [r["teardown_s"] for r in res], "client close + exit"),
            _s(
                "import tq_async",
                [r["import_s"] for r in res],
                "import torch, tq_async and its client (tq.AsyncClient)",
            ),
            _s("fresh interpreter: launch->exit", walls),
            _mb("peak RSS, embedded process", [r["peak_rss"] for r in res], "VmHWM"),
        ]
    return [
        _s("serve start->TQ_ADDRESS", [r["serve_ready_s"] for r in res], "new interpreter"),
        _s(
            "serve start->first put",
            [r["start_to_first_put_s"] for r in res],
            "Popen -> address -> client connect -> 1-row put",
        ),
        _s("serve teardown (SIGTERM->exit)", [r["teardown_s"] for r in res]),
        _mb("peak RSS, serve process", [r["server_peak_rss"] for r in res], "VmHWM"),
        _mb("peak RSS, client process", [r["peak_rss"] for r in res], "VmHWM"),
    ]
