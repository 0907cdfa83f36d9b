"""Chaos run (issue 36): SIGKILL the controller, one storage unit or everything at random
moments while producers put, a consumer acks under leases and a DP2 job reads recorded
batches; restart on the same directories; then check every guarantee.

``python -m benchmarks.chaos --kills 50 --seconds 300 --seed 1 [--durability process|fsync]
[--memory-cap BYTES] [--pauses N [--max-pause S]] [--worker-kills N] [--json PATH] [--dir DIR]``
runs the harness of ``tests/_chaos.py`` (see its docstring for the checks) and prints a
summary: kills by target, rows, puts acknowledged / in doubt, consumer deliveries and acks,
DP batches and replays, and the violations (there must be none; the exit status is 1 if
there are).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _chaos import run_chaos


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50, help="SIGKILLs (default: 50)")
    parser.add_argument(
        "--seconds", type=float, default=300.0, help="about how long the kills take"
    )
    parser.add_argument("--seed", type=int, default=1, help="the killer's and producers' seed")
    parser.add_argument("--lease", type=float, default=10.0, help="the consumers' lease, s")
    parser.add_argument("--producers", type=int, default=2, help="concurrent producers")
    parser.add_argument(
        "--processes", type=int, default=4, choices=[1, 2, 4], help="worker processes"
    )
    parser.add_argument(
        "--durability", default="process", choices=["process", "fsync"], help="every service's"
    )
    parser.add_argument(
        "--memory-cap", type=int, default=None, help="the units' memory_cap, bytes (spill)"
    )
    parser.add_argument(
        "--pauses", type=int, default=0, help="SIGSTOPs of a service or worker between kills"
    )
    parser.add_argument(
        "--max-pause", type=float, default=2.0, help="the longest pause, seconds (default: 2)"
    )
    parser.add_argument(
        "--worker-kills", type=int, default=0, help="SIGKILLs of a worker, started again"
    )
    parser.add_argument("--dir", default=None, help="where the data_dirs go (default: $TMPDIR)")
    parser.add_argument("--keep", action="store_true", help="keep the data_dirs and logs")
    parser.add_argument("--json", default=None, help="also write the report to this file")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="tq-chaos-", dir=args.dir)
    try:
        t0 = time.monotonic()

        def say(msg: str) -> None:
            print(f"[{time.monotonic() - t0:7.1f}s] {msg}", flush=True)

        report = run_chaos(
            Path(root),
            kills=args.kills,
            seconds=args.seconds,
            seed=args.seed,
            lease=args.lease,
            producers=args.producers,
            processes=args.processes,
            say=say,
            durability=args.durability,
            memory_cap=args.memory_cap,
            pauses=args.pauses,
            max_pause=args.max_pause,
            worker_kills=args.worker_kills,
        )
    finally:
        if args.keep:
            print(f"data_dirs and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    summary = report.as_dict()
    print(json.dumps({k: v for k, v in summary.items() if k != "violations"}, indent=1))
    print(f"violations: {len(report.violations)}")
    for v in report.violations[:50]:
        print("  " + v)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
