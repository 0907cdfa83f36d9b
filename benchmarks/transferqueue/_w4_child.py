"""W4 child on TransferQueue: a fresh interpreter that starts Ray + TransferQueue, puts one row,
tears down, and reports.

``python -m benchmarks.transferqueue._w4_child`` prints one ``W4_RESULT={json}`` line. Only the
standard library is imported before ``import transfer_queue`` (with torch and Ray) is timed.
"""

from __future__ import annotations

import json
import os
import sys
from time import perf_counter
from typing import Any

RAY_NUM_CPUS = 4  # see benchmarks.transferqueue._common.RAY_NUM_CPUS


def _vm_hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _descendants_rss() -> dict[str, list[int]]:
    """Peak RSS of every process under this one (Ray's services, its workers, the actors),
    grouped: the TransferQueue controller, the storage units, and everything else of Ray."""
    import psutil  # a Ray dependency

    groups: dict[str, list[int]] = {"controller": [], "storage": [], "ray": []}
    for child in psutil.Process().children(recursive=True):
        try:
            name = " ".join(child.cmdline()) or child.name()
        except psutil.Error:
            continue
        hwm = _vm_hwm(child.pid)
        if hwm is None:
            continue
        if "TransferQueueController" in name:
            groups["controller"].append(hwm)
        elif "SimpleStorageUnit" in name:
            groups["storage"].append(hwm)
        else:
            groups["ray"].append(hwm)
    return groups


def _start_put(ray: Any, tq: Any, torch: Any, td_cls: Any, conf: Any) -> dict[str, float]:
    t0 = perf_counter()
    # address="local": always a new instance, never whatever cluster another user started.
    ray.init(address="local", num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False)
    t1 = perf_counter()
    tq.init(conf)
    t2 = perf_counter()
    tq.get_client().put(td_cls({"x": torch.zeros(1, 1)}, batch_size=[1]), partition_id="p")
    t3 = perf_counter()
    return {"ray_init_s": t1 - t0, "tq_init_s": t2 - t1, "put_s": t3 - t2, "total_s": t3 - t0}


def _stop(ray: Any, tq: Any) -> float:
    t0 = perf_counter()
    try:
        tq.close()
    finally:
        ray.shutdown()
    return perf_counter() - t0


def main() -> int:
    os.environ.setdefault("TQ_NUM_THREADS", str(os.cpu_count() or 1))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    t0 = perf_counter()
    import ray
    import torch
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from tensordict import TensorDict

    out: dict[str, Any] = {"import_s": perf_counter() - t0}

    def conf() -> Any:
        return OmegaConf.create(
            {"backend": {"SimpleStorage": {"num_data_storage_units": 2}}},
            flags={"allow_objects": True},
        )

    first = _start_put(ray, tq, torch, TensorDict, conf())
    out.update(first)
    groups = _descendants_rss()
    out["controller_peak_rss"] = groups["controller"]
    out["storage_peak_rss"] = groups["storage"]
    out["ray_peak_rss"] = groups["ray"]
    out["ray_processes"] = len(groups["ray"])
    out["peak_rss"] = _vm_hwm(os.getpid())
    out["teardown_s"] = _stop(ray, tq)
    warm = _start_put(ray, tq, torch, TensorDict, conf())
    out["warm_total_s"] = warm["total_s"]
    out["warm_teardown_s"] = _stop(ray, tq)
    print("W4_RESULT=" + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
