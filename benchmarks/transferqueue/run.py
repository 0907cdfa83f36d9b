"""``python -m benchmarks.transferqueue.run``: W1-W4 on TransferQueue 0.1.11 (see ``--help``).

Run from the repository root with the interpreter of the TransferQueue environment
(``benchmarks/.venv-tq/bin/python``); ``python -m benchmarks.compare`` does that for you.

Each workload runs in a child interpreter of its own (``--child``) in a new session, under a
hard time limit: TransferQueue's calls have no client-side timeout and a Ray cluster can fail
to come up, so a stuck workload is killed with its whole process group (Ray's services are in
it) and recorded as a failed result with a note instead of hanging the run. The ``--json``
document has the layout of ``python -m benchmarks --json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._proc import CpuMeter

from ._common import MODE, RAY_NUM_CPUS, SYSTEM, Config, failure

__all__ = ["WORKLOADS", "main"]

REPO_ROOT = Path(__file__).resolve().parents[2]

WORKLOADS: dict[str, str] = {
    "W1": "benchmarks.transferqueue.w1_data_plane",
    "W2": "benchmarks.transferqueue.w2_control_plane",
    "W3": "benchmarks.transferqueue.w3_streaming",
    "W4": "benchmarks.transferqueue.w4_startup",
}

#: Hard limit of one workload's child process, seconds (full size, smoke).
TIMEOUTS: dict[str, tuple[float, float]] = {
    "W1": (600, 180),
    "W2": (900, 240),
    "W3": (600, 240),
    "W4": (900, 300),
}


def machine() -> dict[str, Any]:
    """``benchmarks._proc.machine_info()`` plus the Ray and TransferQueue versions."""
    from importlib.metadata import version

    from benchmarks._proc import machine_info  # stdlib only at import; torch/zmq inside

    info = machine_info()
    for dist in ("transferqueue", "ray", "omegaconf"):
        try:
            info[dist] = version(dist)
        except Exception:
            info[dist] = "unknown"
    info["ray_num_cpus"] = RAY_NUM_CPUS
    return info


# ---- child: one workload in this interpreter ---------------------------------------------------


def _child(name: str, smoke: bool, out: str) -> int:
    cfg = Config(smoke=smoke)
    module = importlib.import_module(WORKLOADS[name])
    results = module.run(cfg)
    with open(out, "w") as f:
        json.dump(results, f)
    return 0


# ---- parent: every workload in a child, bounded in time ----------------------------------------


def _session_stats(sid: int) -> list[tuple[int, list[str]]]:
    """``(pid, /proc/pid/stat fields after the command name)`` of every process of session
    ``sid``: the child and everything Ray started under it (Ray puts its actor workers in
    process groups of their own, but they stay in the session)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after the ")": state ppid pgrp session ...
            out.append((int(entry), fields))
    return out


def _session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    return [pid for pid, fields in _session_stats(sid) if fields[0] != "Z"]


class _CpuAccount:
    """CPU used by other processes while a workload ran (the box is shared).

    ``getrusage(RUSAGE_CHILDREN)`` misses Ray's processes (its workers are not reaped by the
    child), so the workload's own CPU is sampled from ``/proc``: the largest
    ``utime + stime`` seen of every process of the child's session (the last fraction of a
    second of a process that exits between two samples is missed, so "foreign" is a slight
    overestimate), plus this runner's own.
    """

    def __init__(self) -> None:
        self._tick = os.sysconf("SC_CLK_TCK")
        self._seen: dict[int, float] = {}
        self._t0, self._busy0, self._self0 = time.perf_counter(), self._busy(), self._own()

    def _busy(self) -> float:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / self._tick

    @staticmethod
    def _own() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    def sample(self, sid: int) -> None:
        for pid, fields in _session_stats(sid):
            cpu = (int(fields[11]) + int(fields[12])) / self._tick
            self._seen[pid] = max(self._seen.get(pid, 0.0), cpu)

    def foreign_cores(self) -> float:
        wall = time.perf_counter() - self._t0
        own = sum(self._seen.values()) + self._own() - self._self0
        return max(0.0, (self._busy() - self._busy0) - own) / wall if wall > 0 else 0.0


def _signal_session(sid: int, sig: int) -> int:
    n = 0
    for pid in _session_pids(sid):
        try:
            os.kill(pid, sig)
            n += 1
        except ProcessLookupError:
            pass
    return n


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the child's session (the child, Ray's services and workers), SIGKILL what is
    left 15 s later."""
    _signal_session(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=15)
    deadline = time.monotonic() + 5
    while _session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    _signal_session(proc.pid, signal.SIGKILL)
    proc.wait()


def run_workload(
    name: str, smoke: bool, timeout: float, cpu: _CpuAccount | None = None
) -> tuple[list[dict[str, Any]], str]:
    """Results of one workload in a child process; ``(results, "")`` or ``([failure], why)``.

    The child is the leader of a new session, so its session id is its pid; ``cpu`` samples
    the session's CPU use every 0.25 s.
    """
    fd, out = tempfile.mkstemp(prefix=f"tq-{name}-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "benchmarks.transferqueue.run", "--child", name, "--out", out]
    if smoke:
        cmd.append("--smoke")
    why = ""
    try:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, start_new_session=True)
        deadline = time.perf_counter() + timeout
        try:
            while True:
                if cpu is not None:
                    cpu.sample(proc.pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    rc = proc.wait(timeout=min(0.25, max(0.0, deadline - time.perf_counter())))
                    break
                if time.perf_counter() >= deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            why = f"killed after the {timeout:g} s limit"
        else:
            # ray.shutdown() stops its services; reap anything of the session left behind
            left = _signal_session(proc.pid, signal.SIGKILL)
            if left:
                print(f"  killed {left} leftover process(es) of the {name} child", flush=True)
            if rc != 0:
                why = f"child exited with status {rc}"
        if not why:
            with open(out) as f:
                return json.load(f), ""
    finally:
        os.unlink(out)
    return [failure(name, "workload", "", why)], why


def aggregate(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Merge ``--repeat`` runs as ``python -m benchmarks`` does: median value, best best."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for run in runs:
        for r in run:
            groups.setdefault((r["workload"], r["metric"]), []).append(r)
    merged = []
    for rs in groups.values():
        first = dict(rs[0])
        ok = [r for r in rs if not math.isnan(r["value"])]
        if ok:
            first = dict(ok[0])
            values = [r["value"] for r in ok]
            bests = [r["best"] if r.get("best") is not None else r["value"] for r in ok]
            first["value"] = float(statistics.median(values))
            first["best"] = max(bests) if first.get("higher_is_better", True) else min(bests)
            first["runs"] = values
            if len(rs) > 1:
                first["note"] = (first.get("note") or "") + f"; median of {len(ok)} runs"
        merged.append(first)
    return merged


def _fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def format_table(results: Sequence[dict[str, Any]]) -> str:
    header = ["workload", "metric", "median", "best", "unit", "note"]
    rows = [
        [
            r["workload"],
            r["metric"],
            _fmt(r["value"]),
            _fmt(r.get("best")),
            r["unit"],
            (r.get("note") or "")[:70],
        ]
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [
        "  ".join(
            c.rjust(w) if i in (2, 3) else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()
        for cells in [header, ["-" * w for w in widths], *rows]
    ]
    return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.transferqueue.run",
        description="W1-W4 on TransferQueue 0.1.11 (run with benchmarks/.venv-tq/bin/python).",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (checks the code paths)")
    parser.add_argument("--only", default="", help="comma-separated workloads, e.g. W1,W3")
    parser.add_argument("--json", dest="json_path", default=None, help="write results here")
    parser.add_argument("--repeat", type=int, default=1, help="run everything N times")
    parser.add_argument(
        "--timeout-scale", type=float, default=1.0, help="multiply every workload's time limit"
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each workload, wait up to SECONDS for other processes to go quiet",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    only = [w.strip().upper() for w in args.only.split(",") if w.strip()]
    unknown = [w for w in only if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {sorted(WORKLOADS)}")
    args.workloads = only or list(WORKLOADS)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.child:
        return _child(args.child, args.smoke, args.out)
    info = machine()
    print(
        f"TransferQueue {info['transferqueue']} on Ray {info['ray']} (num_cpus={RAY_NUM_CPUS}); "
        f"machine: {info['nproc']} cpu ({info['cpu']}), python {info['python']}, "
        f"torch {info['torch']}, loadavg {info['loadavg']}",
        flush=True,
    )
    failures: list[str] = []
    runs: list[list[dict[str, Any]]] = []
    t_start = time.perf_counter()
    for rep in range(args.repeat):
        run: list[dict[str, Any]] = []
        for name in args.workloads:
            label = name + (f" run {rep + 1}/{args.repeat}" if args.repeat > 1 else "")
            if args.wait_idle > 0:
                quiet = CpuMeter.wait_for_quiet(args.wait_idle)
                print(f"  other processes use {quiet:.2f} cores before {label}", flush=True)
            load = os.getloadavg()[0]
            print(f"running {label} on TransferQueue (loadavg {load:.2f}) ...", flush=True)
            cpu = _CpuAccount()
            t0 = time.perf_counter()
            limit = TIMEOUTS[name][1 if args.smoke else 0] * args.timeout_scale
            try:
                results, why = run_workload(name, args.smoke, limit, cpu)
            except Exception:
                traceback.print_exc()
                results, why = [failure(name, "workload", "", "runner error")], "runner error"
            if why:
                failures.append(f"{label}: {why}")
            else:
                failures += [
                    f"{label} {r['metric']}: {r['note']}" for r in results if r.get("failed")
                ]
            foreign = cpu.foreign_cores()
            for r in results:
                r.setdefault("loadavg_at_start", load)
                r.setdefault("foreign_cpu_cores", round(foreign, 2))
                r.setdefault("system", SYSTEM)
                r.setdefault("mode", MODE)
            run.extend(results)
            print(
                f"  {label} done in {time.perf_counter() - t0:.1f} s; other processes used "
                f"{foreign:.2f} of {os.cpu_count()} cores meanwhile",
                flush=True,
            )
        runs.append(run)
    results = aggregate(runs) if args.repeat > 1 else runs[0]
    print()
    print(format_table(results))
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr)
    if args.json_path:
        doc = {
            "machine": info,
            "command": [
                sys.executable,
                "-m",
                "benchmarks.transferqueue.run",
                *(argv or sys.argv[1:]),
            ],
            "system": SYSTEM,
            "smoke": args.smoke,
            "repeat": args.repeat,
            "results": results,
            "failures": failures,
        }
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
