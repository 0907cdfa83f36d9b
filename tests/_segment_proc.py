"""A child process for `tests/faults/test_segment_kills.py`: a durable `StorageState` on a
directory doing seeded random puts (overwrites) and clears, with tiny segments, index
rewrites and compactions every few operations; it prints ``{"begin": op}`` before each
operation and ``{"ok": n}`` once it is acknowledged (written to the OS at ``process``,
committed at ``fsync``), until it is SIGKILLed.

``python tests/_segment_proc.py DIR SEED LEVEL``
"""

from __future__ import annotations

import json
import random
import sys

import numpy as np

from tq_async._storage import _cells
from tq_async._storage._cells import StorageState
from tq_async._storage._segments import SegmentStore, claim_unit_dir
from tq_async._wire._columns import ColumnHeader

HEADER = ColumnHeader("x", "dense", "int64", (64,))
ROWS = 64


def cells(rows: list[int], v: int) -> bytearray:
    """Row ``r`` holds ``v + r`` 64 times."""
    return bytearray(np.array([[v + r] * 64 for r in rows], dtype=np.int64).tobytes())


def main() -> None:
    directory, seed, level = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    _cells._REWRITE_SLACK = 8
    _cells._COMPACT_SLACK = 0
    _cells._COMPACT_BUDGET = 8 << 10
    claim_unit_dir(directory, 0)
    disk = SegmentStore(directory, sync=level == "fsync", segment_bytes=16 << 10)
    state = StorageState(disk=disk)
    state.recover()
    rng = random.Random(seed)
    n = 0
    while True:
        if rng.random() < 0.7:
            rows = rng.sample(range(ROWS), rng.randint(1, 16))
            op = {"put": rows, "v": rng.randint(0, 1 << 40)}
        else:
            op = {"clear": rng.sample(range(ROWS), rng.randint(1, 32))}
        print(json.dumps({"begin": op}), flush=True)
        if "put" in op:
            state.put("p", op["put"], [HEADER], [cells(op["put"], op["v"])], incarnation="i")
        else:
            state.clear("p", op["clear"], incarnation="i")
        if level == "fsync":
            disk.commit(disk.begin_commit())
        n += 1
        print(json.dumps({"ok": n}), flush=True)


if __name__ == "__main__":
    main()
