"""``python -m benchmarks.compare`` on canned results: pairing, ratio table, JSON and PNG.

Needs neither TransferQueue nor its virtual environment: both suites' result files are given
with ``--ours-json`` / ``--tq-json``, so nothing is run but the comparison itself.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

#: the benchmark runs share one xdist worker (--dist loadgroup): each keeps the CPUs busy, and
#: two at once on a 2-vCPU machine pass their subprocess deadlines
pytestmark = pytest.mark.xdist_group("benchmarks")


def _r(workload: str, metric: str, value: float, unit: str, **extra: Any) -> dict[str, Any]:
    return {
        "workload": workload,
        "metric": metric,
        "value": value,
        "unit": unit,
        "best": None,
        "higher_is_better": unit not in ("ms", "s", "us", "MB"),
        "n": 1,
        "note": "",
        **extra,
    }


def _ours() -> dict[str, Any]:
    results = []
    for mode, put in (("embedded", 3.0), ("process", 1.5)):
        results += [
            _r("W1", "put dense", put, "GB/s", mode=mode),
            _r("W1", "get_meta+get_data dense", 2.0, "GB/s", mode=mode),
            _r("W2", "get_meta b8, 1 client sequential", 9000.0, "calls/s", mode=mode),
            _r("W3", "put->get_meta p99 (consumer process)", 1.0, "ms", mode=mode),
            _r("W3", "put->dataset item p99 (consumer process)", 2.5, "ms", mode=mode),
        ]
    results += [
        _r("W4", "local_cluster start->first put", 0.2, "s", mode="embedded"),
        _r("W4", "serve start->first put", 1.5, "s", mode="process"),
    ]
    for r in results:
        r["system"] = "tq_async"
    return {"machine": {"nproc": 2, "cpu": "test cpu", "python": "3.11"}, "results": results}


def _theirs() -> dict[str, Any]:
    results = [
        _r("W1", "put dense", 0.6, "GB/s"),
        _r("W1", "get_meta+get_data dense", 0.25, "GB/s"),
        _r("W1", "dense columns returned jagged dense", 2, "columns", jagged_columns=["a", "b"]),
        # a failed measurement: value NaN (JSON NaN), flagged
        _r("W2", "get_meta b8, 1 client sequential", math.nan, "calls/s", failed=True),
        _r("W3", "put->get_meta p99 (consumer process)", 1000.0, "ms"),
        _r("W3", "put->get_data p99 (consumer process)", 1000.0, "ms"),
        _r("W4", "ray.init+tq.init start->first put", 12.0, "s"),
    ]
    for r in results:
        r["system"], r["mode"] = "transferqueue", "ray"
    results[3]["note"] = "FAILED: TimeoutError"
    return {"machine": {"transferqueue": "0.1.11"}, "results": results, "failures": []}


@pytest.mark.timeout(120)
def test_compare_on_canned_results(tmp_path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib not installed (the bench extra)")
    ours, theirs = tmp_path / "ours.json", tmp_path / "tq.json"
    ours.write_text(json.dumps(_ours()))
    theirs.write_text(json.dumps(_theirs()))
    out_json, out_png = tmp_path / "out" / "cmp.json", tmp_path / "out" / "cmp.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--compare",  # delegates to python -m benchmarks.compare
            "--ours-json",
            str(ours),
            "--tq-json",
            str(theirs),
            "--json",
            str(out_json),
            "--png",
            str(out_png),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "MPLBACKEND": "Agg"},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    header = next(line for line in proc.stdout.splitlines() if line.startswith("workload"))
    for column in ("tq_async", "TransferQueue", "factor", "target", "status"):
        assert column in header
    assert "dense columns returned jagged (dense): a, b" in proc.stdout

    doc = json.loads(out_json.read_text())
    rows = {(r["workload"], r["label"], r["mode"]): r for r in doc["rows"]}
    put_e = rows[("W1", "put dense", "embedded")]
    assert put_e["factor"] == pytest.approx(5.0)  # 3.0 / 0.6 GB/s, higher is better
    assert put_e["status"] == "PASS"  # target >= 4x
    put_p = rows[("W1", "put dense", "process")]
    assert put_p["factor"] == pytest.approx(2.5)
    assert put_p["status"] == "MISS"
    assert rows[("W1", "get dense", "embedded")]["status"] == "PASS"  # 8x >= 8x
    # the targeted W3 row pairs the two streaming datasets: our item in hand vs their get_data
    lat = rows[("W3", "put->dataset item p99 (consumer process)", "process")]
    assert lat["factor"] == pytest.approx(400.0)  # lower is better: theirs / ours
    assert lat["target"] == 500
    assert lat["status"] == "MISS"
    raw = rows[("W3", "raw put->get_meta p99 (consumer process)", "process")]
    assert raw["factor"] == pytest.approx(1000.0)
    assert raw["target"] is None  # informational: raw client vs their dataset
    assert raw["status"] == ""
    w2 = rows[("W2", "get_meta 1 client sequential", "embedded")]
    assert w2["factor"] is None
    assert w2["status"] == "n/a"
    assert "TimeoutError" in w2["note"]
    # W4 start-up pairs with a differently named metric in each of our modes
    assert rows[("W4", "start -> first put", "embedded")]["factor"] == pytest.approx(60.0)
    assert rows[("W4", "start -> first put", "process")]["factor"] == pytest.approx(8.0)
    assert rows[("W4", "start -> first put", "process")]["status"] == "MISS"
    assert doc["observations"] == {"dense columns returned jagged (dense)": ["a", "b"]}
    assert doc["tq_async"]["results"]
    assert doc["transferqueue"]["results"]

    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out_png.stat().st_size > 10_000


@pytest.mark.timeout(120)
def test_smoke_comparison_judges_nothing(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours.json", tmp_path / "tq.json"
    ours.write_text(json.dumps(_ours()))
    theirs.write_text(json.dumps(_theirs()))
    out_json = tmp_path / "cmp.json"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks.compare", "--smoke", "--no-png"),
            *("--ours-json", str(ours), "--tq-json", str(theirs), "--json", str(out_json)),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "MISS" not in proc.stdout
    assert "PASS" not in proc.stdout
    assert "not judged at --smoke sizes" in proc.stdout
    rows = json.loads(out_json.read_text())["rows"]
    targeted = [r for r in rows if r["target"] is not None and r["factor"] is not None]
    assert targeted
    assert {r["status"] for r in targeted} == {"not judged (smoke)"}


def test_outputs_default_to_an_ignored_folder() -> None:
    sys.path.insert(0, str(REPO))
    try:
        from benchmarks.compare import _parse
    finally:
        sys.path.remove(str(REPO))
    args = _parse(["--no-png"])
    for path in (args.json_path, args.png_path):
        assert path.parent == REPO / "benchmarks" / "out"
        ignored = subprocess.run(
            ["git", "check-ignore", "-q", str(path)], cwd=REPO, check=False, timeout=30
        )
        assert ignored.returncode == 0, f"{path} is not ignored by git"
