"""``python -m benchmarks --smoke`` runs every workload end to end and prints the table.

No performance assertions: the smoke run uses tiny sizes and only proves the suite works.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

#: the benchmark runs share one xdist worker (--dist loadgroup): each keeps the CPUs busy, and
#: two at once on a 2-vCPU machine pass their subprocess deadlines
pytestmark = pytest.mark.xdist_group("benchmarks")


def _python(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python *args`` in the repository, its output captured (bounded in time)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.timeout(240)
def test_durability_benchmarks_smoke(tmp_path: Path) -> None:
    """``python -m benchmarks.durability`` (every level and the disk loop in one run) and the
    suite at a durability level; journals in fresh directories under --data-dir, removed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    data_dir = tmp_path / "d"
    out_json = tmp_path / "durability.json"
    args = ("--smoke", "--data-dir", str(data_dir), "--mode", "embedded", "--breakdown")
    proc = _python("-m", "benchmarks.durability", *args, "--json", str(out_json), env=env)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    results = {r["metric"]: r for r in json.loads(out_json.read_text())["results"]}
    metrics = set(results)
    for level in ("memory", "process", "fsync"):
        assert f"W1 put dense, {level}" in metrics
        assert f"small-row ingest, {level}" in metrics
        requests = results[f"small-row ingest {level}: a put's requests (mean)"]
        assert "PutBegin" in requests["note"]
        assert "PutCommit" in requests["note"]
        assert results[f"small-row ingest {level}: CPU a row, client + serve"]["value"] > 0
    assert {"disk write+fsync loop", "W1 put fsync/disk loop"} <= metrics
    assert "MISS" not in proc.stdout  # tiny sizes are not judged
    assert os.listdir(data_dir) == []
    proc = _python(
        "-m", "benchmarks", "--smoke", "--only", "W1", "--durability", "fsync",
        "--data-dir", str(data_dir), env=env,
    )  # fmt: skip
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert os.listdir(data_dir) == []


@pytest.mark.timeout(180)
def test_benchmarks_smoke(tmp_path: Path) -> None:
    out_json = tmp_path / "smoke.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = _python("-m", "benchmarks", "--smoke", "--json", str(out_json), env=env)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    header = next((line for line in lines if line.startswith("workload")), None)
    assert header is not None, proc.stdout
    for column in ("metric", "median", "best", "unit", "target", "status"):
        assert column in header
    for workload in ("W1", "W2", "W3", "W4", "W5"):
        assert any(line.startswith(workload + " ") for line in lines), workload
    # tiny sizes are not judged against the targets: no MISS (nor PASS) rows
    assert "MISS" not in proc.stdout
    assert "targets not judged at --smoke sizes" in proc.stdout
    doc = json.loads(out_json.read_text())
    assert doc["failures"] == []
    assert {r["workload"] for r in doc["results"]} == {"W1", "W2", "W3", "W4", "W5"}
    for r in doc["results"]:
        assert {"workload", "metric", "value", "unit", "system", "mode"} <= r.keys()


def test_extra_benchmarks_smoke() -> None:
    done = _python("-m", "benchmarks.extra", "--smoke")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SeqlenBalancedSampler" in done.stdout
    assert "dataset / raw" in done.stdout


def test_journal_benchmark_smoke() -> None:
    """The durable controller's journal benchmark (issue 36) runs at tiny sizes."""
    done = _python("-m", "benchmarks.journal", "--smoke")
    assert done.returncode == 0, done.stderr[-2000:]
    for line in (
        "ingest level=fsync",
        "get_meta rows=4,000",
        "history batches=400",
        "recovery rows=40,000",
    ):
        assert line in done.stdout


def test_the_get_meta_walk_stays_short() -> None:
    """`python -m benchmarks.walk` runs, and the controller's get_meta walk keeps what issue 35
    asked for: at most half the calls into the partition state of the flat tree (15 from the
    core, 2 from the sampler) and no more module crossings than it had (35)."""
    done = _python("-m", "benchmarks.walk")
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout[done.stdout.index("\n{") :])
    assert figures["into_state"] <= 17 // 2, figures
    assert figures["crossings"] <= 35, figures


def test_probes_smoke(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine probes quoted in RESULTS.md still run (tiny sizes)."""
    monkeypatch.syspath_prepend(str(REPO))  # also for the probe's spawned receiver
    from benchmarks import probes

    probes.tcp_ceiling(puts=8)
    probes.idle_rtt(calls=4)
    probes.cold_call(calls=2)
    probes.after_spin(calls=2)
    probes.jagged_assembly(calls=2)
    probes.jagged_micro_batches(batches=2, rounds=1)
    probes.loader_cpu(batches=8, rounds=1)
    if sys.platform == "linux":
        probes.same_host(puts=8)
        probes.socket_rtt(calls=20)
        probes.steady_cpu(seconds=0.2)
    out = capsys.readouterr().out
    linux = sys.platform == "linux"
    assert out.count("tcp-ceiling") == 2
    assert out.count("idle-rtt") == 9
    assert out.count("cold-call") == 5
    assert out.count("after-spin") == 4
    assert out.count("jagged-assembly") == 9
    assert out.count("loader-cpu") == 4  # 2 readers x (tq-async serve, embedded)
    assert out.count("same-host") == (3 if linux else 0)
    assert out.count("socket-rtt") == (4 if linux else 0)
    assert out.count("steady-cpu") == (len(os.sched_getaffinity(0)) if linux else 0)


def test_capacity_smoke() -> None:
    """``python -m benchmarks.capacity --smoke``: a few clients in two processes against a
    ``tq-async serve``, every phase (connect, load, drain) with 0 errors and 0 rows lost."""
    done = _python("-m", "benchmarks.capacity", "--smoke", timeout=150)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "rows acked / lost" in done.stdout
    assert "per client" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only host")
def test_gpu_check_says_there_is_no_gpu() -> None:
    done = _python("-m", "benchmarks.gpu_check")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA device here" in done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_check_runs_every_path() -> None:
    done = _python("-m", "benchmarks.gpu_check", "--mib", "16", "--rounds", "2", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "to_device (device= reads)" in done.stdout
    assert "torch CUDA IPC" in done.stdout
    assert "device arena (tq-async serve --device-cap; CUDA IPC)" in done.stdout


def test_gpu_check_device_arena_runs_its_plumbing_emulated() -> None:
    """gpu_check's device-arena rounds, without a GPU: the unit's arena emulated in host
    memory (``TQ_ASYNC_GPU_EMULATE``), host columns standing for CUDA ones."""
    code = (
        "import anyio, torch\n"
        "from benchmarks.gpu_check import device_arena\n"
        "cols = {f'c{i}': torch.arange(64 * 1024).reshape(64, 1024) + i for i in range(2)}\n"
        "got = anyio.run(device_arena, torch, cols, 2, 'cpu')\n"
        "print('COUNTERS', got['counters'], sorted(got['stalls']), got['put'] > 0)\n"
    )
    done = _python("-c", code, env={**os.environ, "TQ_ASYNC_GPU_EMULATE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.split("COUNTERS", 1)[1]
    # 2 timed rounds after a first, then 4 rounds watched by the loop-lag probe, then 3
    # reads by a reader that wants host memory (the unit copies out: 2 columns each)
    assert "'device_puts': 10" in line
    assert "'device_reads': 7" in line
    assert "'device_fallbacks': 6" in line
    assert "'device_out_bytes': 3145728" in line
    # every row cleared: the unit holds only the grants it lent ahead of the client's puts
    held = re.search(r"'device_bytes': (\d+).*'device_spare_bytes': (\d+)", line)
    assert held is not None, line
    assert held[1] == held[2], line
    assert "['first round', 'get', 'put'] True" in line


def test_gpu_check_shares_a_tensor_between_processes_on_the_cpu_too() -> None:
    """The two-process reference of gpu_check (torch's CUDA IPC on a GPU) runs its plumbing
    here with a host tensor (torch shares it through shared memory)."""
    code = (
        "import torch\n"
        "from benchmarks.gpu_check import ipc_between_processes\n"
        "print('GB/s', ipc_between_processes(torch, 'cpu', 1 << 20, 2))\n"
    )
    done = _python("-c", code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split("GB/s")[1]) > 0


@pytest.mark.skipif(
    all(importlib.util.find_spec(m) is None for m in ("nixl_cu12", "nixl_cu13")),
    reason="needs tq_async[nixl]",
)
def test_nixl_vs_zmq_smoke() -> None:
    done = _python("-m", "benchmarks.nixl_vs_zmq", "--rounds", "2", "--repeat", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "nixl puts/reads 7/7" in done.stdout  # 5 warm-up and 2 timed, all through NIXL
    assert "NIXL/ZMQ get" in done.stdout
    assert "best calls" in done.stdout


@pytest.mark.timeout(120)
def test_spill_benchmark_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = _python(
        "-m", "benchmarks.spill", "--cap-mib", "8", "--dir", str(tmp_path), "--json", env=env
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    doc = json.loads(proc.stdout.splitlines()[-1])
    assert doc["spill"]["exact"]
    assert doc["spill"]["spills"] > 0
    assert doc["spill"]["disk_reads"] > 0
    assert doc["spill"]["memory_bytes_after_get"] <= 8 << 20
    assert {"write", "write_fsync", "read"} <= doc["disk"].keys()


@pytest.mark.timeout(180)
def test_chaos_benchmark_smoke(tmp_path: Path) -> None:
    """``python -m benchmarks.chaos`` without kills (``tests/faults/test_chaos.py`` kills):
    the cluster, the workers, the last restart, the drain and the checks, and its JSON."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = tmp_path / "chaos.json"
    args = ("--kills", "0", "--processes", "1", "--dir", str(tmp_path), "--json", str(out))
    proc = _python("-m", "benchmarks.chaos", *args, env=env, timeout=170)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "violations: 0" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["violations"] == []
    assert doc["rows_held"] == doc["rows_ok"] > 0
