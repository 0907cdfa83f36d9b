"""``--dist loadgroup`` (what `scripts/check` runs) keeps an ``xdist_group`` on one worker.

The chaos test and the benchmark runs share one worker so that they never run side by side
on the 2-vCPU CI box, and the Ray tests share one so that one Ray instance serves them; under
pytest 9.2 the groups held nothing until `tests/_xdist_groups.py` (six tests of one group ran
on both workers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_GROUPED = """
import os, pytest

pytestmark = pytest.mark.xdist_group("one")

@pytest.mark.parametrize("i", range(6))
def test_where(i):
    with open(os.environ["WHERE"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def test_a_group_runs_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(_GROUPED)
    where = tmp_path / "where.txt"
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "WHERE": str(where), "PYTHONPATH": tests}
    args = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q"]
    args += ["-p", "no:cacheprovider", "-p", "_xdist_groups", "--rootdir", str(tmp_path)]
    out = subprocess.run(
        [*args, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stdout + out.stderr
    workers = where.read_text().split()
    assert len(workers) == 6
    assert len(set(workers)) == 1, workers
