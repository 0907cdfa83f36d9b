"""Command line, target checks, the results table and the ``--json`` file."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._common import SYSTEM, Config
from ._proc import CpuMeter, machine_info

__all__ = ["TARGETS", "Target", "main", "evaluate", "format_table"]

WORKLOADS: dict[str, str] = {
    "W1": "benchmarks.w1_data_plane",
    "W2": "benchmarks.w2_control_plane",
    "W3": "benchmarks.w3_wakeup",
    "W4": "benchmarks.w4_startup",
    "W5": "benchmarks.w5_sync_face",
}


@dataclass(frozen=True)
class Target:
    """A goal from the issue: ``value <op> threshold`` for one (workload, metric)."""

    workload: str
    metric: str
    op: str  # ">=" or "<="
    threshold: float

    def met(self, value: float) -> bool:
        return value >= self.threshold if self.op == ">=" else value <= self.threshold

    def describe(self) -> str:
        return f"{self.op} {self.threshold:g}"


#: Targets of the issue (2-core box). Judged on the median; the best run is shown too.
TARGETS: tuple[Target, ...] = (
    Target("W1", "put dense", ">=", 2.5),
    Target("W1", "get_meta+get_data dense", ">=", 2.5),
    Target("W2", "get_meta b8, 1 client sequential", ">=", 5000),
    Target("W2", "get_meta b8, 4 AsyncClients in 1 process", ">=", 10000),
    Target("W2", "get_meta b8, 4 client processes", ">=", 10000),
    Target("W2", "get_meta p50 ratio 1M/1k rows", "<=", 2.0),
    Target("W3", "put->get_meta p99 (same process)", "<=", 2.0),
    Target("W3", "put->get_meta p99 (consumer process)", "<=", 2.0),
    Target("W3", "put->dataset item p99 (same process)", "<=", 2.0),
    Target("W3", "put->dataset item p99 (consumer process)", "<=", 2.0),
    Target("W4", "local_cluster start->first put", "<=", 0.5),
    Target("W5", "get_meta b8 sequential, blocking/async", ">=", 0.8),
    Target("W5", "W1 put dense, blocking/async", ">=", 0.9),
    Target("W5", "W1 get_meta+get_data dense, blocking/async", ">=", 0.9),
    Target(
        "W5", "StreamingDataLoader 0 workers vs AsyncStreamingDataset, blocking/async", ">=", 0.8
    ),
    Target(
        "W5",
        "StreamingDataLoader 2 workers (fork) vs AsyncStreamingDataset, blocking/async",
        ">=",
        0.8,
    ),
    Target("W5", "compat kv_batch_get 256 keys x 6 fields, blocking/async", ">=", 0.8),
)


def _target_for(r: dict[str, Any]) -> Target | None:
    for t in TARGETS:
        if t.workload == r["workload"] and t.metric == r["metric"]:
            return t
    return None


def evaluate(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Attach ``target`` and ``status`` (PASS / MISS / MISS (best passes)) to each result."""
    out = []
    for r in results:
        r = dict(r)
        t = _target_for(r)
        if t is not None:
            r["target"] = t.describe()
            if t.met(r["value"]):
                r["status"] = "PASS"
            elif r.get("best") is not None and t.met(r["best"]):
                r["status"] = "MISS (best passes)"
            else:
                r["status"] = "MISS"
        out.append(r)
    return out


def aggregate(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Merge ``--repeat`` runs: median of the medians, best of the bests."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for run in runs:
        for r in run:
            key = (r.get("system"), r.get("mode"), r["workload"], r["metric"])
            groups.setdefault(key, []).append(r)
    merged = []
    for rs in groups.values():
        first = dict(rs[0])
        values = [r["value"] for r in rs]
        bests = [r["best"] if r.get("best") is not None else r["value"] for r in rs]
        first["value"] = float(statistics.median(values))
        first["best"] = max(bests) if first.get("higher_is_better", True) else min(bests)
        first["runs"] = [r["value"] for r in rs]
        first["foreign_cpu_cores"] = [r.get("foreign_cpu_cores") for r in rs]
        first["notes"] = [r.get("note", "") for r in rs]
        if len(rs) > 1:
            first["note"] = (first.get("note") or "") + f" (run 1); median of {len(rs)} runs"
        merged.append(first)
    return merged


def _fmt(v: float | None) -> str:
    if v is None:
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


def format_table(results: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    """The results as an aligned text table (or a Markdown table)."""
    header = ["workload", "metric", "system", "mode", "median", "best", "unit", "target", "status"]
    rows = [
        [
            r["workload"],
            r["metric"],
            r.get("system", ""),
            r.get("mode", ""),
            _fmt(r["value"]),
            _fmt(r.get("best")),
            r["unit"],
            r.get("target", ""),
            r.get("status", ""),
        ]
        for r in results
    ]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    numeric = {4, 5}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(row) for row in rows)])


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description="tq_async benchmark suite (W1-W5)."
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds (CI)")
    parser.add_argument(
        "--only", default="", help="comma-separated workloads to run, e.g. W1,W3 (default: all)"
    )
    parser.add_argument(
        "--mode",
        default="embedded",
        choices=["embedded", "process", "both"],
        help="embedded: cluster in this event loop; process: `tq-async serve` subprocess",
    )
    parser.add_argument("--json", dest="json_path", default=None, help="write results here")
    parser.add_argument(
        "--repeat", type=int, default=1, help="run everything N times; report median and best"
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each workload, wait up to SECONDS for other processes to go quiet",
    )
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--storage-units", type=int, default=2, help="storage units (default 2)")
    parser.add_argument(
        "--durability",
        default="memory",
        choices=["memory", "process", "fsync"],
        help="the clusters' durability (default memory); process and fsync need --data-dir",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="where durable clusters journal (a fresh subdirectory per cluster, removed after)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also run the workloads on TransferQueue 0.1.11 in its own venv and print the "
        "ratio table (= python -m benchmarks.compare; see its --help for more options)",
    )
    args = parser.parse_args(argv)
    only = [w.strip().upper() for w in args.only.split(",") if w.strip()]
    unknown = [w for w in only if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {sorted(WORKLOADS)}")
    args.workloads = only or list(WORKLOADS)
    if args.durability != "memory" and args.data_dir is None:
        parser.error(f"--durability {args.durability} needs --data-dir DIR")
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--compare" in argv:
        from benchmarks import compare  # matplotlib and the TransferQueue venv only here

        return compare.main([a for a in argv if a != "--compare"])
    args = _parse(argv)
    modes = ["embedded", "process"] if args.mode == "both" else [args.mode]
    machine = machine_info()
    print(
        f"machine: {machine['nproc']} cpu ({machine['cpu']}), python {machine['python']}, "
        f"torch {machine['torch']}, pyzmq {machine['pyzmq']} (libzmq {machine['libzmq']}), "
        f"loadavg {machine['loadavg']}",
        flush=True,
    )
    failures: list[str] = []
    runs: list[list[dict[str, Any]]] = []
    t_start = time.perf_counter()
    for rep in range(args.repeat):
        run: list[dict[str, Any]] = []
        for mode in modes:
            cfg = Config(
                smoke=args.smoke,
                mode=mode,
                storage_units=args.storage_units,
                durability=args.durability,
                data_dir=args.data_dir,
            )
            for name in args.workloads:
                label = f"{name} [{mode}]" + (
                    f" run {rep + 1}/{args.repeat}" if args.repeat > 1 else ""
                )
                if args.wait_idle > 0:
                    quiet = CpuMeter.wait_for_quiet(args.wait_idle)
                    print(f"  other processes use {quiet:.2f} cores before {label}", flush=True)
                load = os.getloadavg()[0]
                print(f"running {label} (loadavg {load:.2f}) ...", flush=True)
                meter = CpuMeter()
                t0 = time.perf_counter()
                try:
                    module = importlib.import_module(WORKLOADS[name])
                    results = module.run(cfg)
                except Exception:
                    traceback.print_exc()
                    failures.append(label)
                    continue
                foreign = meter.foreign_cores()
                for r in results:
                    r.setdefault("loadavg_at_start", load)
                    r.setdefault("foreign_cpu_cores", round(foreign, 2))
                    r.setdefault("system", SYSTEM)
                    r.setdefault("mode", mode)
                    r.setdefault("durability", args.durability)
                run.extend(results)
                print(
                    f"  done in {time.perf_counter() - t0:.1f} s; other processes used "
                    f"{foreign:.2f} of {os.cpu_count()} cores meanwhile",
                    flush=True,
                )
        runs.append(run)
    results = aggregate(runs) if args.repeat > 1 else runs[0]
    if not args.smoke:  # tiny sizes measure nothing: a MISS there would be noise
        results = evaluate(results)
    print()
    print(format_table(results, markdown=args.markdown))
    judged = "not judged at --smoke sizes" if args.smoke else "judged on the median"
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s; targets {judged}")
    if failures:
        print(f"FAILED workloads: {', '.join(failures)}", file=sys.stderr)
    if args.json_path:
        doc = {
            "machine": machine,
            "command": [sys.executable, "-m", "benchmarks", *argv],
            "smoke": args.smoke,
            "repeat": args.repeat,
            "targets": [vars(t) for t in TARGETS],
            "results": results,
            "failures": failures,
        }
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 1 if failures else 0
