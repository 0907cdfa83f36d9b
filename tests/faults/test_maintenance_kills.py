"""Processes killed inside the rare maintenance steps of the durable layers (a data_dir's
marker, ...), then started again on the same directory: a state a crash can produce is
never refused, and nothing acknowledged is lost.

Each kill runs in a child process that patches the step to SIGKILL itself (`_killed_in`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tq_async._controller._journal import JournalStore
from tq_async._storage._unit_dir import UnitDir

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="signals")

#: the prologue of every child: ``kill(*args)`` SIGKILLs the process
_KILL = """
import os, signal
def kill(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_in(code: str) -> None:
    """Run ``code`` in a child process (after `_KILL`); it must die of SIGKILL."""
    proc = subprocess.run(
        [sys.executable, "-c", _KILL + textwrap.dedent(code)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()


@pytest.mark.parametrize("step", ["json.dump", "os.replace"])
def test_a_unit_killed_while_it_marks_its_new_directory_starts_on_it_again(
    tmp_path: Path, step: str
) -> None:
    _killed_in(
        f"""
        import json
        from tq_async._storage._unit_dir import UnitDir
        {step} = kill
        UnitDir("process", {str(tmp_path)!r}, None, 0)
        """
    )
    unit = UnitDir("process", str(tmp_path), None, 0)  # not "no storage unit's"
    assert unit.instance is not None
    unit.close()


def test_a_controller_killed_while_it_marks_its_new_directory_starts_on_it_again(
    tmp_path: Path,
) -> None:
    _killed_in(
        f"""
        import json
        from tq_async._controller._journal import JournalStore
        json.dump = kill
        JournalStore({str(tmp_path)!r}, "process")
        """
    )
    store = JournalStore(str(tmp_path), "process")  # not "belongs to a unknown"
    assert store.load()[0] is None
    store.close()
