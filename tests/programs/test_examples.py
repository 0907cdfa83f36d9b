"""The small examples run as their docstrings say (``python examples/NAME.py``), from any
working directory: a change that breaks one fails here, not in a reader's hands. (The main
example, ``async_grpo.py``, has its own tests: ``test_example_grpo.py``.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("quickstart.py", ["put batch 3: rows 24..31", "learner got 16 rows"]),
        ("custom_sampler.py", ["priority, final:", "cluster, highest priority first:"]),
    ],
)
def test_an_example_runs_as_its_docstring_says(tmp_path: Path, name: str, says: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for line in says:
        assert line in done.stdout, done.stdout
    assert "Traceback" not in done.stderr
