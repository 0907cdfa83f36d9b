"""A durable unit's cells under SIGKILL at random moments (issue 36): a child process puts
and clears at random on tiny segments (index rewrites and compactions every few operations,
`tests/_segment_proc.py`), is SIGKILLed after a random number of acknowledged operations and
started again on the same directory, twelve times; then every row holds what the last
acknowledged operation on it left (the one operation in flight at a kill may have happened
or not), and no other row is there.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tq_async as tq
from _cluster_proc import sigkill, warm_python
from tq_async._storage._cells import StorageState
from tq_async._storage._segments import SegmentStore

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="signals")

CHILD = Path(__file__).resolve().parent.parent / "_segment_proc.py"
ROWS = 64


def _run_until_killed(directory: Path, seed: int, level: str, acks: int) -> list[dict[str, Any]]:
    """Start the child, SIGKILL it once it acknowledged ``acks`` operations; every line it
    printed (read to the end after the kill: it may have gone further)."""
    lines = []
    with warm_python(CHILD.read_text(), str(directory), str(seed), level) as proc:  # (forked)
        for raw in proc.stdout:
            lines.append(json.loads(raw))
            if lines[-1].get("ok") == acks:
                break
        sigkill(proc)
        lines.extend(json.loads(raw) for raw in proc.stdout.read().splitlines() if raw.strip())
    assert any("ok" in line for line in lines), "the child acknowledged nothing"
    return lines


def _value(state: StorageState, row: int) -> int | None:
    try:
        _, (x,) = state.get("p", [row], ["x"])
    except tq.RowsNotFound:
        return None
    values = np.frombuffer(bytes(x.data), np.int64)  # type: ignore[union-attr]
    assert (values == values[0]).all(), f"row {row} is torn"
    return int(values[0])


@pytest.mark.parametrize("level", ["process", "fsync"])
def test_cells_survive_sigkills_at_random_moments(tmp_path: Path, level: str) -> None:
    seed = int(os.environ.get("TQ_SEGMENT_KILLS_SEED", "0")) or int.from_bytes(os.urandom(2), "big")
    rng = random.Random(seed)
    model: dict[int, int] = {}  # row -> value, as the acknowledged operations left it
    doubt: dict[int, set[int | None]] = {}  # rows of an operation in flight at a kill
    for kill in range(12):
        lines = _run_until_killed(tmp_path, rng.randrange(1 << 30), level, rng.randint(3, 40))
        pending = None
        for line in lines:
            if "begin" in line:
                pending = line["begin"]
            elif pending is not None:
                for r in pending.get("put", pending.get("clear", [])):
                    doubt.pop(r, None)
                if "put" in pending:
                    model.update((r, pending["v"] + r) for r in pending["put"])
                else:
                    for r in pending["clear"]:
                        model.pop(r, None)
                pending = None
        if pending is not None:  # killed during it: either outcome
            after = {r: pending["v"] + r for r in pending["put"]} if "put" in pending else {}
            for r in pending.get("put", pending.get("clear", [])):
                doubt[r] = {model.get(r), after.get(r)}
        # the next child starts where this one stopped: settle the doubt on what is there
        state = StorageState(disk=SegmentStore(str(tmp_path)))
        state.recover()
        for r in range(ROWS):
            got = _value(state, r)
            if r in doubt:
                assert got in doubt.pop(r), (
                    f"seed {seed}, kill {kill}: row {r} is {got}, not one of them"
                )
                if got is None:
                    model.pop(r, None)
                else:
                    model[r] = got
            else:
                assert got == model.get(r), (
                    f"seed {seed}, kill {kill}: row {r} is {got}, acked {model.get(r)}"
                )
        assert state.disk is not None
        state.disk.close()
