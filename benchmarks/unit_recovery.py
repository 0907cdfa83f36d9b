"""A durable storage unit's restart with many GB of cells: ``python -m benchmarks.unit_recovery``.

Issue 36 asks that a unit with 10 GB of cells re-registers in <= 5 s (it reads its index, not
the data). This fills a unit's directory with ``--gb`` GB of cells (through `StorageState`
in this process, the way a unit writes them: ``--through segments`` appends them to segment
files, as socket puts do; ``--through arena`` puts them into the unit's arena file, as
same-host clients' puts do), drops the files from the page cache, then starts ``tq-async
serve controller`` and ``tq-async serve storage --durability process --data-dir DIR`` and
times the unit from its start to its ``TQ_UNIT=`` line (printed once the controller has
registered it), against the same for an empty directory, and reports the unit's own log line
of what it took back (chunks, bytes, seconds).

Example: ``python -m benchmarks.unit_recovery --gb 10 --dir /var/tmp``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

_CHUNK_ROWS = 1024
_ROW = 8192  # bytes of one row: a chunk is 8 MiB, like a W1 batch


def _fill(directory: Path, gb: float, through: str) -> int:
    """Write ``gb`` GB of cells into a unit's directory; the rows written."""
    from tq_async._paths._shm import Arena
    from tq_async._storage._cells import StorageState, adopt_arena
    from tq_async._storage._segments import ARENA_FILE, SegmentStore, claim_unit_dir
    from tq_async._wire._columns import ColumnHeader

    header = ColumnHeader("x", "dense", "uint8", (_ROW,))
    claim_unit_dir(str(directory), 0)
    disk = SegmentStore(str(directory))
    state = StorageState(disk=disk)
    state.recover()
    chunks = int(gb * 1e9) // (_CHUNK_ROWS * _ROW)
    arena = None
    if through == "arena":
        arena = Arena(
            (chunks + 2) * _CHUNK_ROWS * _ROW + (1 << 20),
            idle_bytes=0,
            path=str(directory / ARENA_FILE),
        )
        disk.use_arena()
        adopt_arena(state, arena)
    base = np.arange(_CHUNK_ROWS * _ROW, dtype=np.uint64).astype(np.uint8)
    for i in range(chunks):
        rows = list(range(i * _CHUNK_ROWS, (i + 1) * _CHUNK_ROWS))
        if arena is not None:
            region = arena.alloc(base.nbytes)
            assert region is not None
            arena.view[region.offset : region.offset + base.nbytes] = base
            arena.view[region.offset : region.offset + 8] = np.frombuffer(
                np.int64(i).tobytes(), np.uint8
            )
            frames: list[Any] = [arena.span(region.offset, base.nbytes)]
            state.put("p", rows, [header], frames, region, incarnation=None)
            arena.release(region)
        else:
            data = base.copy()
            data[:8] = np.frombuffer(np.int64(i).tobytes(), np.uint8)
            state.put("p", rows, [header], [data], incarnation=None)
    disk.close()
    if arena is not None:
        arena.close()
    return chunks * _CHUNK_ROWS


def _drop_cache(directory: Path) -> None:
    from .spill import _drop_cache as drop

    for path in directory.iterdir():
        if path.is_file():
            drop(path)


def _start_unit(controller: str, directory: Path) -> tuple[Any, float]:
    from benchmarks._proc import ServeProcess

    t0 = time.perf_counter()
    unit = ServeProcess(
        role=[
            "storage",
            "--controller",
            controller,
            "--unit-id",
            "0",
            "--durability",
            "process",
            "--data-dir",
            str(directory),
        ],
        line="TQ_UNIT=",
    )
    return unit, time.perf_counter() - t0


def _took_back(unit: Any) -> str:
    """The unit's own log line about its recovery (chunks, bytes, seconds)."""
    for line in unit.tail:
        if "took back its cells" in line:
            return " ".join(
                w for w in line.split() if w.startswith(("chunks=", "bytes=", "seconds="))
            )
    return "(no recovery line)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=10.0)
    parser.add_argument("--dir", default=None, help="on the disk measured (default: $TMPDIR)")
    parser.add_argument("--through", choices=("segments", "arena"), default="segments")
    args = parser.parse_args()
    from benchmarks._proc import ServeProcess

    root = Path(tempfile.mkdtemp(prefix="tq-unit-recovery-", dir=args.dir))
    try:
        full, empty = root / "full", root / "empty"
        full.mkdir()
        empty.mkdir()
        t0 = time.perf_counter()
        rows = _fill(full, args.gb, args.through)
        _drop_cache(full)
        fill_s = time.perf_counter() - t0
        size = sum(f.stat().st_blocks * 512 for f in full.iterdir())
        controller = ServeProcess(role=["controller"])
        try:
            unit, empty_s = _start_unit(controller.address, empty)
            unit.stop()
            unit, full_s = _start_unit(controller.address, full)
            recovered = _took_back(unit)
            unit.stop()
        finally:
            controller.stop()
        print(
            f"unit with {size / 1e9:.2f} GB of cells on disk (through {args.through}; filled "
            f"in {fill_s:.1f} s, page cache dropped): start -> registered {full_s:.2f} s "
            f"(an empty unit: {empty_s:.2f} s); its log: {recovered}; {rows:,} rows"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
