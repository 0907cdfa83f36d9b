"""The chaos test (issue 36), at a size CI affords: SIGKILL the controller, one storage unit
or all three at random moments while producers put, a consumer acknowledges under leases and
a DP2 job reads recorded batches; restart them on the same directories (and, at `process`,
pause a service or the workers, and SIGKILL the workers and start them again); then every guarantee
is checked (`tests/_chaos.py` says which). ``python -m benchmarks.chaos --kills 50`` is the
long run, reported in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from _chaos import run_chaos

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="signals and loopback services"),
    # seven processes that keep the CPUs busy, with deadlines on their progress: one worker
    # with the benchmark runs (--dist loadgroup), not next to them on a 2-vCPU machine
    pytest.mark.xdist_group("benchmarks"),
]

KILLS = 6


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("durability", "memory_cap", "pauses", "worker_kills"),
    [("process", None, 3, 2), ("fsync", 256 << 10, 0, 0)],
    # process: also SIGSTOPs of a service or the workers, and the workers SIGKILLed and
    # started again; spill: most cells are read back from the segments
    ids=["process", "fsync-spill"],
)
def test_chaos_sigkill_controller_units_or_everything(
    tmp_path: Path, durability: str, memory_cap: int | None, pauses: int, worker_kills: int
) -> None:
    seed = int(os.environ.get("TQ_CHAOS_SEED", "0")) or int.from_bytes(os.urandom(2), "big")
    report = run_chaos(
        tmp_path,
        kills=KILLS,
        seconds=12.0,
        seed=seed,
        lease=8.0,
        processes=1,  # the workers' roles share one process: the CI box has 2 cores
        progress_timeout=40.0,
        drain_timeout=60.0,
        durability=durability,
        memory_cap=memory_cap,
        pauses=pauses,
        worker_kills=worker_kills,
    )
    assert sum(report.kills.values()) == KILLS
    assert sum(report.pauses.values()) == pauses
    assert report.worker_kills == worker_kills
    assert report.rows_ok > 0
    assert report.consumer_acks["ok"] > 0
    assert report.dp_batches > 0
    assert not report.violations, f"seed {seed}: {report.violations[:20]}"
