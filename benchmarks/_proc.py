"""Process helpers (standard library only): ``tq-async serve`` subprocesses, RSS, machine info.

Kept free of torch/tq_async imports so the W4 child can time ``import tq_async`` itself.
"""

from __future__ import annotations

import collections
import contextlib
import os
import platform
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = [
    "REPO_ROOT",
    "CpuMeter",
    "ServeProcess",
    "machine_info",
    "peak_rss_bytes",
    "self_peak_rss_bytes",
]

#: The directory holding the ``benchmarks`` package (children run with it as cwd).
REPO_ROOT = Path(__file__).resolve().parent.parent


def peak_rss_bytes(pid: int) -> int | None:
    """Peak resident set size (``VmHWM``) of a live process, from ``/proc``; None if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def self_peak_rss_bytes() -> int:
    """Peak RSS of this process since its ``exec``.

    ``VmHWM`` from ``/proc/self/status``, not ``ru_maxrss``: Linux carries ``ru_maxrss``
    across ``exec``, so a child forked from a big parent would report the parent's size.
    """
    hwm = peak_rss_bytes(os.getpid())
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid``'s threads so far: the scheduler's nanosecond count
    (``/proc/PID/task/*/schedstat``) where the kernel keeps one, else user + system time
    in clock ticks (10 ms: a 2,000-call round's figure would move in 5 us steps)."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    except OSError:
        total = 0
    if total:
        return total / 1e9
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: the columns of ``/proc/stat``'s ``cpu`` line (clock ticks over every core)
CPU_STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_ticks() -> list[int]:
    """The machine's clock ticks so far in each of `CPU_STATES`, over every core."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1 : 1 + len(CPU_STATES)]]


class CpuMeter:
    """How much CPU *other* processes used while we measured (the box is shared).

    ``/proc/stat`` gives the whole machine's busy time; ``getrusage`` gives ours (this
    process plus children already waited for, i.e. every server and client process a workload
    started and stopped). The difference, per second of wall time, is in CPU cores.
    """

    def __init__(self) -> None:
        self._t0, self._busy0, self._own0 = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        tick = os.sysconf("SC_CLK_TCK")
        busy = 0.0
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
            busy = (sum(fields[:8]) - idle) / tick  # without guest time (counted in user)
        own = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            ru = resource.getrusage(who)
            own += ru.ru_utime + ru.ru_stime
        return time.perf_counter(), busy, own

    def foreign_cores(self) -> float:
        """Average CPU cores used by other processes since construction."""
        t1, busy1, own1 = self._sample()
        wall = t1 - self._t0
        if wall <= 0:
            return 0.0
        return max(0.0, (busy1 - self._busy0) - (own1 - self._own0)) / wall

    @staticmethod
    def wait_for_quiet(max_wait: float, threshold: float = 0.3) -> float:
        """Sleep (up to ``max_wait`` s) until other processes use < ``threshold`` cores for
        one second; returns the last measured foreign load."""
        deadline = time.perf_counter() + max_wait
        while True:
            meter = CpuMeter()
            time.sleep(1.0)
            load = meter.foreign_cores()
            if load < threshold or time.perf_counter() >= deadline:
                return load


class ServeProcess:
    """``python -m tq_async._deploy._cli serve`` in a subprocess, until :meth:`stop`.

    The constructor blocks until the server printed ``TQ_ADDRESS=...`` (or fails). A daemon
    thread keeps draining the server's output afterwards so it can never block on a full pipe;
    the last lines are kept for error messages.

    Attributes:
        address: the controller endpoint the server printed.
        started_at: ``time.perf_counter()`` just before the ``Popen``.
        ready_s: seconds from ``Popen`` to the address line.
    """

    def __init__(
        self,
        storage_units: int = 2,
        *,
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
        role: list[str] | None = None,
        line: str = "TQ_ADDRESS=",
    ) -> None:
        # ``role``: the arguments of one role (``["controller"]``, ``["storage",
        # "--controller", ADDR]``) instead of the all-in-one serve; ``line``: what it prints
        args = role if role is not None else ["--storage-units", str(storage_units)]
        cmd = [sys.executable, "-m", "tq_async._deploy._cli", "serve", *args]
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env={**os.environ, **(env or {})},
        )
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._drain, args=(lines,), daemon=True)
        self._reader.start()
        deadline = self.started_at + timeout
        address = None
        while address is None:
            try:
                text = lines.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                self.stop()
                raise RuntimeError(
                    f"tq-async serve printed no address within {timeout} s"
                ) from None
            if text is None:
                self.stop()
                raise RuntimeError(
                    "tq-async serve exited before printing its address:\n" + "".join(self.tail)
                )
            if text.startswith(line):
                address = text.strip().split("=", 1)[1]
        self.ready_s = time.perf_counter() - self.started_at
        self.address: str = address

    def _drain(self, lines: queue.Queue[str | None]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line)
            lines.put(line)
        lines.put(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def peak_rss(self) -> int | None:
        """The server's peak RSS so far (bytes)."""
        return peak_rss_bytes(self.proc.pid)

    def stop(self, timeout: float = 30.0) -> float:
        """SIGTERM, wait for exit; returns the seconds it took (kills it after ``timeout``)."""
        t0 = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        elapsed = time.perf_counter() - t0
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()  # the reader is done with it (EOF at the exit)
        return elapsed


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _read_first(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def machine_info() -> dict[str, Any]:
    """nproc, CPU model, memory, THP and library versions (imports torch/zmq/msgspec)."""
    import msgspec
    import tensordict
    import torch
    import zmq

    mem = "unknown"
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cpu": _cpu_model(),
        "memory": mem,
        "kernel": platform.release(),
        "thp": _read_first("/sys/kernel/mm/transparent_hugepage/enabled"),
        "loadavg": _read_first("/proc/loadavg"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgspec": msgspec.__version__,
        "tensordict": tensordict.__version__,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    }
