"""``python -m benchmarks.compare``: W1-W4 on tq_async and on TransferQueue 0.1.11, side by side.

Runs, one after the other (never at the same time -- the box has 2 cores):

1. our suite, ``python -m benchmarks --json ...`` with this interpreter;
2. the same workloads on TransferQueue, ``python -m benchmarks.transferqueue.run --json ...``
   with the interpreter of its own virtual environment ``benchmarks/.venv-tq`` (created here
   if missing: ``python -m venv``, then ``pip install torch==2.13.0`` first so that
   transferqueue does not pull a CUDA build, then ``pip install transferqueue==0.1.11``).

Then it pairs the metrics (:data:`PAIRS`), prints a ratio table -- how many times better
tq_async is, the issue's target for that row and PASS/MISS -- and writes a JSON file (both
suites' documents plus the pairs) and a PNG bar chart (matplotlib), by default
``benchmarks/out/comparison.json`` and ``.png`` (ignored by git). ``--ours-json`` and
``--tq-json`` reuse earlier result files instead of running a suite. With ``--smoke`` the
sizes are too small to mean anything, so no row is judged (as ``python -m benchmarks
--smoke`` judges none).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PAIRS",
    "Pair",
    "format_table",
    "main",
    "pair_results",
    "write_json",
    "write_png",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
TQ_VENV = REPO_ROOT / "benchmarks" / ".venv-tq"
TQ_VERSION = "0.1.11"
TORCH_PIN = "torch==2.13.0"
#: where the JSON and the PNG go unless --json / --png say otherwise (ignored by git)
OUT_DIR = REPO_ROOT / "benchmarks" / "out"
#: the status of a row with a target at --smoke sizes
NOT_JUDGED = "not judged (smoke)"


@dataclass(frozen=True)
class Pair:
    """One row of the comparison: our metric against TransferQueue's.

    ``ours`` is one metric name for every mode, or ``{mode: name}`` where the two modes of our
    suite name the measurement differently. ``factor`` (how many times better tq_async is) is
    ours/theirs for ``higher`` metrics, theirs/ours for ``lower`` ones. ``target`` is the
    issue's minimum factor, None for informational rows.
    """

    workload: str
    label: str
    ours: str | dict[str, str]
    theirs: str
    better: str  # "higher" or "lower"
    target: float | None = None

    def ours_metric(self, mode: str) -> str | None:
        if isinstance(self.ours, str):
            return self.ours
        return self.ours.get(mode)


#: The comparison rows. Targets from the issue: W1 put >= 4x, get >= 8x; W2 >= 40x; W3 p99
#: >= 500x lower (streaming dataset on both sides: TransferQueue's ``StreamingDataset``, whose
#: time is taken in its fetch hook, i.e. slightly before its consumer has the item); W4
#: start-up >= 10x faster.
PAIRS: tuple[Pair, ...] = (
    Pair("W1", "put dense", "put dense", "put dense", "higher", 4),
    Pair("W1", "get dense", "get_meta+get_data dense", "get_meta+get_data dense", "higher", 8),
    Pair("W1", "get_data dense", "get_data dense", "get_data dense", "higher"),
    Pair("W1", "put full", "put full", "put full", "higher", 4),
    Pair("W1", "get full", "get_meta+get_data full", "get_meta+get_data full", "higher", 8),
    Pair("W1", "get_data full", "get_data full", "get_data full", "higher"),
    *(
        Pair("W2", m.replace("get_meta b8, ", "get_meta "), m, m, "higher", 40)
        for m in (
            "get_meta b8, 1 client sequential",
            "get_meta b8, 4 AsyncClients in 1 process",
            "get_meta b8, 4 client processes",
        )
    ),
    Pair(
        "W2",
        "get_meta latency p50, sequential",
        "get_meta b8 latency p50, sequential",
        "get_meta b8 latency p50, sequential",
        "lower",
    ),
    Pair(
        "W2",
        "get_meta p50 @1M rows",
        "get_meta b8 p50 @1M rows",
        "get_meta b8 p50 @1M rows",
        "lower",
    ),
    Pair(
        "W2",
        "first get_meta of a task @1M rows",
        "first get_meta of a task @1M rows",
        "first get_meta of a task @1M rows",
        "lower",
    ),
    Pair("W2", "put 1M one-field rows", "put 1M one-field rows", "put 1M one-field rows", "lower"),
    # the W3: a streaming-dataset consumer on both sides, put -> the row in hand
    *(
        Pair(
            "W3",
            f"put->dataset item {p} ({where})",
            f"put->dataset item {p} ({where})",
            f"put->get_data {p} ({where})",
            "lower",
            500 if p == "p99" else None,
        )
        for where in ("same process", "consumer process")
        for p in ("p50", "p90", "p99", "max")
    ),
    # informational: our raw client parked in get_meta vs TransferQueue's dataset get_meta
    *(
        Pair(
            "W3",
            f"raw put->get_meta {p} ({where})",
            f"put->get_meta {p} ({where})",
            f"put->get_meta {p} ({where})",
            "lower",
        )
        for where in ("same process", "consumer process")
        for p in ("p50", "p99")
    ),
    *(
        Pair(
            "W3",
            f"raw put->{what} p99 (consumer process) vs busy-poll get_meta",
            f"put->{what} p99 (consumer process)",
            f"put->{what} p99 (busy-poll get_meta, consumer process)",
            "lower",
        )
        for what in ("get_meta", "get_data")
    ),
    Pair(
        "W4",
        "start -> first put",
        {"embedded": "local_cluster start->first put", "process": "serve start->first put"},
        "ray.init+tq.init start->first put",
        "lower",
        10,
    ),
    Pair(
        "W4",
        "start -> first put, 2nd in process",
        {"embedded": "local_cluster start->first put, 2nd in process"},
        "ray.init+tq.init start->first put, 2nd in process",
        "lower",
    ),
    Pair(
        "W4",
        "teardown",
        {"embedded": "local_cluster teardown", "process": "serve teardown (SIGTERM->exit)"},
        "teardown (tq.close + ray.shutdown)",
        "lower",
    ),
    Pair(
        "W4",
        "import",
        {"embedded": "import tq_async"},
        "import transfer_queue",
        "lower",
    ),
    Pair(
        "W4",
        "fresh interpreter: launch->exit",
        {"embedded": "fresh interpreter: launch->exit"},
        "fresh interpreter: launch->exit",
        "lower",
    ),
    Pair(
        "W4",
        "peak RSS, all processes",
        {"embedded": "peak RSS, embedded process"},
        "peak RSS, all processes (sum)",
        "lower",
    ),
    Pair(
        "W4",
        "peak RSS, services",
        {"process": "peak RSS, serve process"},
        "peak RSS, TQ actors (controller + 2 units)",
        "lower",
    ),
    Pair(
        "W4",
        "peak RSS, client process",
        {"process": "peak RSS, client process"},
        "peak RSS, client process",
        "lower",
    ),
)


# ---- pairing --------------------------------------------------------------------------------


def _ok(r: dict[str, Any] | None) -> bool:
    return r is not None and not r.get("failed") and not math.isnan(float(r["value"]))


def _best(r: dict[str, Any]) -> float:
    """The best repetition (``best``, else the value: one run of a percentile has no best)."""
    b = r.get("best")
    return float(r["value"] if b is None or math.isnan(float(b)) else b)


def _factor(better: str, ours: float, theirs: float) -> float:
    if better == "higher":
        return ours / theirs if theirs > 0 else math.inf
    return theirs / ours if ours > 0 else math.inf


def pair_results(
    ours: Sequence[dict[str, Any]], theirs: Sequence[dict[str, Any]], *, judged: bool = True
) -> list[dict[str, Any]]:
    """The comparison rows for the (workload, metric) pairs present in either result list.

    ``factor`` compares the medians (the headline, judged against the target); ``factor_best``
    the best repetitions of both sides (``status`` says ``MISS (best passes)`` when only that
    meets the target, as ``python -m benchmarks`` does). With ``judged=False`` (smoke sizes)
    a row with a target gets the status :data:`NOT_JUDGED` instead of PASS/MISS.

    One row per pair and per mode of ours (``embedded``/``process``) that has the metric; a pair
    whose metric is missing on one side, or failed there, gets ``status`` ``n/a`` and a note.
    """
    by_ours: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in ours:
        by_ours[(r.get("mode", ""), r["workload"], r["metric"])] = r
    by_theirs = {(r["workload"], r["metric"]): r for r in theirs}
    modes = sorted({r.get("mode", "") for r in ours}, key=lambda m: (m != "embedded", m))
    workloads = {r["workload"] for r in ours} | {r["workload"] for r in theirs}
    rows = []
    for p in PAIRS:
        if p.workload not in workloads:
            continue
        t = by_theirs.get((p.workload, p.theirs))
        for mode in modes:
            name = p.ours_metric(mode)
            o = by_ours.get((mode, p.workload, name)) if name else None
            if o is None and t is None:
                continue
            if name is None:
                continue
            row: dict[str, Any] = {
                "workload": p.workload,
                "label": p.label,
                "mode": mode,
                "ours_metric": name,
                "tq_metric": p.theirs,
                "unit": (o or t or {}).get("unit", ""),
                "better": p.better,
                "ours": o["value"] if o else None,
                "ours_best": o.get("best") if o else None,
                "tq": t["value"] if t else None,
                "tq_best": t.get("best") if t else None,
                "ours_foreign_cpu_cores": o.get("foreign_cpu_cores") if o else None,
                "tq_foreign_cpu_cores": t.get("foreign_cpu_cores") if t else None,
                "target": p.target,
                "factor": None,
                "factor_best": None,
                "status": "" if p.target is None else "n/a",
                "note": "",
            }
            if not _ok(o):
                row["note"] = "tq_async: " + ("missing" if o is None else o.get("note", "failed"))
            elif not _ok(t):
                row["note"] = "TransferQueue: " + (
                    "missing" if t is None else (t.get("note") or "failed")
                )
            else:
                assert o is not None
                assert t is not None
                if o["unit"] != t["unit"]:
                    row["note"] = f"units differ: {o['unit']} vs {t['unit']}"
                else:
                    f = _factor(p.better, o["value"], t["value"])
                    fb = _factor(p.better, _best(o), _best(t))
                    row["factor"], row["factor_best"] = f, fb
                    if p.target is not None and not judged:
                        row["status"] = NOT_JUDGED
                    elif p.target is not None:
                        if f >= p.target:
                            row["status"] = "PASS"
                        elif fb >= p.target:
                            row["status"] = "MISS (best passes)"
                        else:
                            row["status"] = "MISS"
            rows.append(row)
    return rows


def observations(theirs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Facts about TransferQueue's behaviour found by its suite (not ratios)."""
    out: dict[str, Any] = {}
    for r in theirs:
        if r["workload"] == "W1" and r["metric"].startswith("dense columns returned jagged"):
            variant = r["metric"].rsplit(" ", 1)[1]
            out[f"dense columns returned jagged ({variant})"] = r.get("jagged_columns", [])
    return out


# ---- output -----------------------------------------------------------------------------------


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


def _fmt_factor(f: float | None) -> str:
    if f is None:
        return "-"
    if math.isinf(f):
        return "inf"
    return f"{f:,.0f}x" if f >= 100 else f"{f:.1f}x" if f >= 10 else f"{f:.2f}x"


def format_table(rows: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    """The comparison as an aligned text table (or a Markdown table)."""
    header = [
        "workload",
        "comparison",
        "mode",
        "tq_async",
        "TransferQueue",
        "unit",
        "better",
        "factor",
        "best/best",
        "target",
        "status",
    ]
    table = [
        [
            r["workload"],
            r["label"],
            r["mode"],
            _fmt(r["ours"]),
            _fmt(r["tq"]),
            r["unit"],
            r["better"],
            _fmt_factor(r["factor"]),
            _fmt_factor(r.get("factor_best")),
            "" if r["target"] is None else f">= {r['target']:g}x",
            r["status"] + (f" ({r['note']})" if r["note"] and not markdown else ""),
        ]
        for r in rows
    ]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r, cells in zip(rows, table, strict=True):
            if r["note"]:
                cells = [*cells[:-1], f"{cells[-1]} ({r['note'][:120]})".strip()]
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
    numeric = {3, 4, 7, 8}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, table)])


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, allow_nan=True)
        f.write("\n")


def write_png(path: Path, rows: Sequence[dict[str, Any]], title: str) -> None:
    """A horizontal bar chart of the factors (log scale), targets marked, PASS green / MISS red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["factor"] is not None and math.isfinite(r["factor"])]
    missing = [r for r in rows if r["factor"] is None and r["target"] is not None]
    labels = [f"{r['workload']} {r['label']} [{r['mode']}]" for r in shown]
    palette = {"PASS": "tab:green", "MISS": "tab:red", "MISS (best passes)": "tab:orange"}
    colors = [palette.get(r["status"], "tab:gray") for r in shown]
    height = max(3.0, 0.28 * (len(shown) + len(missing)) + 1.5)
    fig, ax = plt.subplots(figsize=(11, height))
    ys = list(range(len(shown)))
    # bars grow from 1x: right where tq_async is better, left where TransferQueue is
    ax.barh(ys, [r["factor"] - 1.0 for r in shown], left=1.0, color=colors)
    for y, r in zip(ys, shown, strict=True):
        if r["target"] is not None:
            ax.plot([r["target"]] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
        ax.text(r["factor"], y, f" {_fmt_factor(r['factor'])}", va="center", fontsize=7)
    for i, r in enumerate(missing):
        y = len(shown) + i
        labels.append(f"{r['workload']} {r['label']} [{r['mode']}]")
        ax.text(1, y, " n/a: " + (r["note"] or "no value")[:90], va="center", fontsize=7)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_ylim(len(labels) - 0.5, -0.5)  # first row on top, no margins
    ax.set_xscale("log")
    ax.axvline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xlabel(
        "factor: times better than TransferQueue (tq_async faster / smaller), log scale\n"
        "black tick = the issue's target; green PASS, orange MISS (best run passes), red MISS, "
        "grey informational",
        fontsize=8,
    )
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- running the two suites -------------------------------------------------------------------


def _tq_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _tq_installed(venv: Path) -> str | None:
    """The transferqueue version installed in ``venv``, None if there is none."""
    py = _tq_python(venv)
    if not py.exists():
        return None
    proc = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('transferqueue'))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def ensure_tq_venv(venv: Path) -> None:
    """Create ``venv`` with torch 2.13.0 (first, so no CUDA build is pulled) and
    transferqueue 0.1.11, unless it already has that version."""
    have = _tq_installed(venv)
    if have == TQ_VERSION:
        return
    pip = str(venv / "bin" / "pip")
    steps = [[pip, "install", TORCH_PIN], [pip, "install", f"transferqueue=={TQ_VERSION}"]]
    if not _tq_python(venv).exists():
        steps.insert(0, [sys.executable, "-m", "venv", str(venv)])
    for cmd in steps:
        print("+ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    have = _tq_installed(venv)
    if have != TQ_VERSION:
        raise RuntimeError(f"{venv}: transferqueue {have} installed, wanted {TQ_VERSION}")


def _run_suite(cmd: list[str], timeout: float, label: str) -> int:
    print(f"\n=== {label}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"=== {label}: killed after {timeout:g} s", flush=True)
        return -1
    print(f"=== {label}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
    return rc


def _load(path: Path) -> dict[str, Any]:
    with open(path) as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare",
        description="W1-W4 on tq_async and on TransferQueue 0.1.11: ratio table, JSON, PNG.",
    )
    parser.add_argument("--only", default="", help="comma-separated workloads, e.g. W1,W3")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on both sides")
    parser.add_argument(
        "--mode",
        default="both",
        choices=["embedded", "process", "both"],
        help="mode(s) of our suite (TransferQueue always runs as Ray actors); default both",
    )
    parser.add_argument("--repeat", type=int, default=1, help="--repeat of our suite")
    parser.add_argument("--tq-repeat", type=int, default=None, help="default: --repeat")
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="both suites: before each workload wait up to SECONDS for the box to go quiet",
    )
    parser.add_argument(
        "--skip-tq-install",
        action="store_true",
        help="do not create/update the TransferQueue venv (it must exist)",
    )
    parser.add_argument("--tq-venv", type=Path, default=TQ_VENV, help=f"default {TQ_VENV}")
    parser.add_argument(
        "--json",
        type=Path,
        default=OUT_DIR / "comparison.json",
        dest="json_path",
        help="where to write the JSON (default: benchmarks/out/comparison.json)",
    )
    parser.add_argument(
        "--png",
        type=Path,
        default=OUT_DIR / "comparison.png",
        dest="png_path",
        help="where to write the chart (default: benchmarks/out/comparison.png)",
    )
    parser.add_argument("--no-png", action="store_true", help="skip the chart")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument(
        "--ours-json", type=Path, default=None, help="reuse this `python -m benchmarks` result"
    )
    parser.add_argument(
        "--tq-json", type=Path, default=None, help="reuse this TransferQueue suite result"
    )
    parser.add_argument(
        "--timeout", type=float, default=7200, help="limit of each suite, seconds (default 2 h)"
    )
    args = parser.parse_args(argv)
    if args.tq_repeat is None:
        args.tq_repeat = args.repeat
    if args.repeat < 1 or args.tq_repeat < 1:
        parser.error("--repeat must be >= 1")
    if not args.no_png and importlib.util.find_spec("matplotlib") is None:
        parser.error("matplotlib is needed for the PNG chart: pip install matplotlib (or --no-png)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    command = [
        sys.executable,
        "-m",
        "benchmarks.compare",
        *(sys.argv[1:] if argv is None else argv),
    ]
    common = (["--only", args.only] if args.only else []) + (["--smoke"] if args.smoke else [])
    if args.wait_idle > 0:
        common += ["--wait-idle", str(args.wait_idle)]
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tq-compare-") as tmp:
        ours_path = args.ours_json or Path(tmp) / "tq_async.json"
        tq_path = args.tq_json or Path(tmp) / "transferqueue.json"
        if args.ours_json is None:
            cmd = [sys.executable, "-m", "benchmarks", "--json", str(ours_path), "--mode"]
            cmd += [args.mode, "--repeat", str(args.repeat), *common]
            rc = _run_suite(cmd, args.timeout, "tq_async")
            if rc != 0:
                problems.append(f"our suite exited {rc}")
        if args.tq_json is None:
            if not args.skip_tq_install:
                ensure_tq_venv(args.tq_venv)
            py = _tq_python(args.tq_venv)
            if not py.exists():
                print(f"no TransferQueue venv at {args.tq_venv}", file=sys.stderr)
                return 2
            cmd = [str(py), "-m", "benchmarks.transferqueue.run", "--json", str(tq_path)]
            cmd += ["--repeat", str(args.tq_repeat), *common]
            rc = _run_suite(cmd, args.timeout, "TransferQueue")
            if rc != 0:
                problems.append(f"the TransferQueue suite exited {rc}")
        if not ours_path.exists() or not tq_path.exists():
            print("a suite wrote no results; nothing to compare", file=sys.stderr)
            return 1
        ours_doc, tq_doc = _load(ours_path), _load(tq_path)

    rows = pair_results(ours_doc["results"], tq_doc["results"], judged=not args.smoke)
    facts = observations(tq_doc["results"])
    print()
    print(format_table(rows, markdown=args.markdown))
    for k, v in facts.items():
        print(f"TransferQueue {k}: {', '.join(v) if v else 'none'}")
    targeted = [r for r in rows if r["target"] is not None]
    passed = sum(r["status"] == "PASS" for r in targeted)
    best = sum(r["status"] == "MISS (best passes)" for r in targeted)
    if args.smoke:
        print("\ntargets: not judged at --smoke sizes (they measure nothing)")
    else:
        print(
            f"\ntargets: {passed} of {len(targeted)} rows PASS on the medians, {best} more on "
            "the best runs (factor = times better than TransferQueue)"
        )
    m = ours_doc.get("machine", {})
    title = (
        f"tq_async vs TransferQueue {tq_doc.get('machine', {}).get('transferqueue', TQ_VERSION)}"
        f" -- {m.get('nproc', '?')} cpu {m.get('cpu', '')}, python {m.get('python', '?')}, "
        f"torch {m.get('torch', '?')}"
    )
    if args.smoke:
        title += " (smoke: sizes too small to mean anything)"
    doc = {
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "smoke": args.smoke,
        "machine": m,
        "machine_transferqueue": tq_doc.get("machine", {}),
        "rows": rows,
        "observations": facts,
        "problems": problems + [f"TransferQueue: {f}" for f in tq_doc.get("failures", [])],
        "tq_async": ours_doc,
        "transferqueue": tq_doc,
    }
    write_json(args.json_path, doc)
    print(f"wrote {args.json_path}")
    if not args.no_png:
        write_png(args.png_path, rows, title)
        print(f"wrote {args.png_path}")
    if problems:
        print("problems: " + "; ".join(problems), file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
