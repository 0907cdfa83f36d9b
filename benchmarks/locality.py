"""Bytes that stay on their host: ``python -m benchmarks.locality`` (issue 39).

Per simulated host: one storage unit, one rollout producer and one learner rank (DP = hosts).
Every step each host puts ``--groups-per-rank`` GRPO groups of ``--group`` responses with
jagged lengths (16..512 tokens: an int32 ``tokens`` row and a float32 ``hidden`` row of
``--width`` values per token), one group per put, and every rank then reads its share of the
step's global batch through ``SeqlenBalancedSampler(n_samples_per_prompt=group,
dp_size=hosts)``. The same data (same seed) runs twice: ``placement="local"`` (rows on the
producer's unit; the batch split by locality, `tq_async.samplers._balance`) and
``placement="round_robin"`` (rows spread over units; the sampler's plain split). Step 0 is a
warm-up (the controller learns each rank's host from its first request) and is left out.

Reported per placement: the cross-host share of the bytes the learner read, the per-step
token imbalance (largest rank's tokens over the mean) and the ratio of the largest rank's
tokens to round-robin's on the same step (round-robin's split *is* the unconstrained
sampler's), and in netns mode the learner's data time (``get_data`` of a rank's share; the
step's slowest rank, since ranks step together).

Two modes:

- ``--netns`` (the default where it works: root, ``ip``, ``tc``): every host is a network
  namespace on a private bridge, its link rate-limited with ``tc`` (``tbf``, ``--rate`` each
  way); the controller has its own namespace with an unshaped link. Units serve over TCP only
  (``--data-path zmq``: shared memory would bypass the simulated network), so a same-host
  read is loopback TCP and another host's read crosses two shaped links.
- ``--labels``: every host is a ``host_id`` label in one process (``local_cluster``); the
  byte split and the token balance only, no time.

Example: ``python -m benchmarks.locality --hosts 4 --steps 21 --rate 200mbit``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import anyio

#: the bridge's subnet; the controller is .100, host i is .(i + 1)
SUBNET = "10.78.0"


def step_lengths(seed: int, host: int, step: int, groups: int, group: int) -> list[list[int]]:
    """The jagged response lengths host ``host`` produces at ``step`` (the same in every mode)."""
    rng = random.Random(f"{seed}/{host}/{step}")
    return [[rng.randint(16, 512) for _ in range(group)] for _ in range(groups)]


def group_data(lengths: list[int], width: int, uid: int) -> tuple[dict[str, Any], list[Any]]:
    import torch

    data = {
        "tokens": [torch.ones(n, dtype=torch.int32) for n in lengths],
        "hidden": [torch.ones(n, width, dtype=torch.float32) for n in lengths],
    }
    return data, [{"uid": uid, "total_lengths": n} for n in lengths]


def sampler_config(hosts: int, group: int, placement: str) -> str:
    return (
        f'placement = "{placement}"\n'
        "[task_samplers.learner]\n"
        'factory = "tq_async:SeqlenBalancedSampler"\n'
        f"n_samples_per_prompt = {group}\n"
        f"dp_size = {hosts}\n"
    )


# ---- one rank: producer + learner (netns mode: a process in its host's namespace) ---------


async def rank_loop(
    address: str, rank: int, hosts: int, steps: int, groups: int, group: int, width: int, seed: int
) -> list[dict[str, Any]]:
    """Produce and read ``steps`` steps as rank ``rank`` on host ``h<rank>``; one record a step."""
    import tq_async as tq

    host = f"h{rank}"
    out: list[dict[str, Any]] = []
    async with tq.AsyncClient.connect(
        address, host_id=host, inline_get_bytes=0, request_timeout=120
    ) as client:
        unit_host = {u: s["host"] for u, s in (await client.storage_stats()).items()}
        for step in range(steps):
            t0 = time.perf_counter()
            written = written_remote = 0
            for g, lengths in enumerate(step_lengths(seed, rank, step, groups, group)):
                data, tags = group_data(lengths, width, (step * hosts + rank) * groups + g)
                put = await client.put(data, partition_id="train", tags=tags)
                for n, u in zip(lengths, put.units, strict=True):
                    written += n * (4 + 4 * width)
                    written_remote += n * (4 + 4 * width) * (unit_host[u] != host)
            t1 = time.perf_counter()
            cfg = {"dp_size": hosts, "dp_rank": rank, "batch_index": step}
            meta = await client.get_meta(
                ["tokens", "hidden"], groups * group, "train", "learner", cfg
            )
            t2 = time.perf_counter()
            td = await client.get_data(meta, nested=True)
            t3 = time.perf_counter()
            lengths = [int(t["total_lengths"]) for t in meta.tags]
            row_bytes = [n * (4 + 4 * width) for n in lengths]
            remote = sum(
                b for b, u in zip(row_bytes, meta.units, strict=True) if unit_host[u] != host
            )
            assert td["tokens"].size(0) == len(lengths)
            out.append(
                {
                    "step": step,
                    "rank": rank,
                    "tokens": sum(lengths),
                    "bytes": sum(row_bytes),
                    "remote_bytes": remote,
                    "written_bytes": written,
                    "written_remote_bytes": written_remote,
                    "put_s": t1 - t0,
                    "meta_s": t2 - t1,
                    "data_s": t3 - t2,
                }
            )
    return out


# ---- label mode ------------------------------------------------------------------------------


async def run_labels(
    placement: str, hosts: int, steps: int, groups: int, group: int, width: int, seed: int
) -> list[dict[str, Any]]:
    """All ranks in this process, hosts as labels (``local_cluster(host_id=[...])``)."""
    import tq_async as tq

    sampler = tq.SeqlenBalancedSampler(n_samples_per_prompt=group, dp_size=hosts)
    records: list[list[dict[str, Any]]] = [[] for _ in range(hosts)]
    async with tq.local_cluster(
        num_storage_units=hosts,
        host_id=[f"h{i}" for i in range(hosts)],
        placement=placement,
        task_samplers={"learner": sampler},
    ) as cluster:

        async def one(rank: int) -> None:
            records[rank] = await rank_loop(
                cluster.address, rank, hosts, steps, groups, group, width, seed
            )

        async with anyio.create_task_group() as tg:
            for rank in range(hosts):
                tg.start_soon(one, rank)
    return [r for rs in records for r in rs]


# ---- netns mode ------------------------------------------------------------------------------


def netns_unavailable() -> str | None:
    """Why namespaces with ``tc`` cannot be used here (None: they can)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "network namespaces need root on Linux"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (`ip`, `tc`)"
    probe = f"tqb{os.getpid() % 100000}p"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True, timeout=30)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` failed: {getattr(exc, 'stderr', exc)!r}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


class Lab:
    """``<prefix>sw`` (a bridge), ``<prefix>ctl`` (controller, unshaped) and ``<prefix>h<i>``
    (hosts, each link shaped by ``tc tbf`` both ways); always removed by `destroy`."""

    def __init__(self, prefix: str, hosts: int, rate: str) -> None:
        self.prefix, self.hosts, self.rate = prefix, hosts, rate
        self.created: list[str] = []

    def ns(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def ip(self, name: str) -> str:
        return f"{SUBNET}.100" if name == "ctl" else f"{SUBNET}.{int(name[1:]) + 1}"

    def _ip(self, *argv: str) -> None:
        subprocess.run(["ip", *argv], check=True, capture_output=True, text=True, timeout=30)

    def _shape(self, ns: str, dev: str) -> None:
        subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
             "rate", self.rate, "burst", "256kb", "latency", "100ms"],
            check=True, capture_output=True, text=True, timeout=30,
        )  # fmt: skip

    def build(self) -> None:
        switch = self.ns("sw")
        self._ip("netns", "add", switch)
        self.created.append(switch)
        self._ip("-n", switch, "link", "add", "br0", "type", "bridge")
        self._ip("-n", switch, "link", "set", "br0", "up")
        for i, name in enumerate(["ctl", *(f"h{h}" for h in range(self.hosts))]):
            ns = self.ns(name)
            self._ip("netns", "add", ns)
            self.created.append(ns)
            self._ip(
                "-n", switch, "link", "add", f"v{i}", "type", "veth", "peer", "eth0", "netns", ns
            )
            self._ip("-n", switch, "link", "set", f"v{i}", "master", "br0")
            self._ip("-n", switch, "link", "set", f"v{i}", "up")
            self._ip("-n", ns, "addr", "add", f"{self.ip(name)}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
            if name != "ctl":
                self._shape(ns, "eth0")  # out of the host
                self._shape(switch, f"v{i}")  # into the host

    def exec_prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(name)]

    def destroy(self) -> None:
        for ns in reversed(self.created):
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30
            ).stdout.split()
            for pid in pids:  # only processes this benchmark started live in these namespaces
                with suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.created.clear()


def _serve(prefix: list[str], argv: list[str], err: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", "tq_async._deploy._cli", "serve", *argv],
        stdout=subprocess.PIPE,
        stderr=err.open("w"),
        text=True,
        env=env,
    )


def _line(proc: subprocess.Popen[str], prefix: str, err: Path) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:  # the service prints it once started; ends if it dies
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    raise RuntimeError(f"service exited before printing {prefix}: {err.read_text()[-2000:]}")


def run_netns(
    lab: Lab, placement: str, args: argparse.Namespace, tmp: Path
) -> list[dict[str, Any]]:
    """One placement: controller, units and ranks as processes in the lab's namespaces."""
    procs: list[subprocess.Popen[str]] = []
    try:
        config = tmp / f"{placement}.toml"
        config.write_text(sampler_config(args.hosts, args.group, placement))
        ctl = _serve(
            lab.exec_prefix("ctl"),
            ["controller", "--config", str(config), "--bind", f"tcp://{lab.ip('ctl')}:5555"],
            tmp / f"{placement}-ctl.err",
        )
        procs.append(ctl)
        address = _line(ctl, "TQ_ADDRESS=", tmp / f"{placement}-ctl.err")
        for h in range(args.hosts):
            name = f"h{h}"
            err = tmp / f"{placement}-{name}.err"
            unit = _serve(
                lab.exec_prefix(name),
                ["storage", "--controller", address, "--bind", f"tcp://{lab.ip(name)}:0",
                 "--unit-id", str(h), "--host-id", name, "--data-path", "zmq"],
                err,
            )  # fmt: skip
            procs.append(unit)
            _line(unit, "TQ_UNIT=", err)
        ranks = []
        for h in range(args.hosts):
            argv = [
                "--rank-of", address, str(h), "--hosts", str(args.hosts), "--steps",
                str(args.steps), "--groups-per-rank", str(args.groups_per_rank), "--group",
                str(args.group), "--width", str(args.width), "--seed", str(args.seed),
            ]  # fmt: skip
            ranks.append(
                subprocess.Popen(
                    [*lab.exec_prefix(f"h{h}"), sys.executable, "-m", "benchmarks.locality", *argv],
                    stdout=subprocess.PIPE,
                    stderr=(tmp / f"{placement}-rank{h}.err").open("w"),
                    text=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            )
        procs.extend(ranks)
        records: list[dict[str, Any]] = []
        for h, proc in enumerate(ranks):
            out, _ = proc.communicate(timeout=600)
            if proc.returncode != 0:
                err = (tmp / f"{placement}-rank{h}.err").read_text()
                raise RuntimeError(f"rank {h} failed: {err[-3000:]}")
            records.extend(json.loads(out.strip().splitlines()[-1]))
        return records
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)


# ---- the report ------------------------------------------------------------------------------


def summarise(
    placement: str, records: list[dict[str, Any]], hosts: int, timed: bool
) -> dict[str, Any]:
    """One placement's numbers, step 0 (the warm-up) left out."""
    kept = [r for r in records if r["step"] > 0]
    steps = sorted({r["step"] for r in kept})
    by_step = {s: [r for r in kept if r["step"] == s] for s in steps}
    total = sum(r["bytes"] for r in kept)
    remote = sum(r["remote_bytes"] for r in kept)
    imbalance = [
        max(r["tokens"] for r in rs) / (sum(r["tokens"] for r in rs) / hosts)
        for rs in by_step.values()
    ]
    out: dict[str, Any] = {
        "placement": placement,
        "hosts": hosts,
        "steps_measured": len(steps),
        "read_bytes": total,
        "cross_host_read_fraction": round(remote / max(total, 1), 4),
        "cross_host_write_fraction": round(
            sum(r["written_remote_bytes"] for r in kept)
            / max(sum(r["written_bytes"] for r in kept), 1),
            4,
        ),
        "starved_ranks": sum(1 for r in kept if r["tokens"] == 0),
        "token_imbalance_mean": round(sum(imbalance) / len(imbalance), 4),
        "token_imbalance_max": round(max(imbalance), 4),
        "max_rank_tokens": {s: max(r["tokens"] for r in rs) for s, rs in by_step.items()},
    }
    if timed:
        data = [max(r["data_s"] for r in rs) for rs in by_step.values()]
        out["learner_data_ms_mean"] = round(1000 * sum(data) / len(data), 2)
        out["learner_data_ms_median"] = round(1000 * sorted(data)[len(data) // 2], 2)
        puts = [max(r["put_s"] for r in rs) for rs in by_step.values()]
        out["producer_put_ms_mean"] = round(1000 * sum(puts) / len(puts), 2)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.locality", description=__doc__)
    parser.add_argument("--hosts", type=int, default=4, help="simulated hosts (default: 4)")
    parser.add_argument("--steps", type=int, default=21, help="steps, the first a warm-up (21)")
    parser.add_argument(
        "--groups-per-rank", type=int, default=4, help="GRPO groups per rank per step (4)"
    )
    parser.add_argument("--group", type=int, default=4, help="responses per prompt (default 4)")
    parser.add_argument("--width", type=int, default=64, help="float32 values per token (64)")
    parser.add_argument("--rate", default="200mbit", help="each host link's rate, each way (tc)")
    parser.add_argument("--seed", type=int, default=39)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--netns", action="store_true", help="namespaces + tc (fail if unavailable)")
    mode.add_argument("--labels", action="store_true", help="host-id labels in one process")
    parser.add_argument("--rank-of", nargs=2, metavar=("ADDRESS", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_of is not None:  # a rank process inside a namespace
        address, rank = args.rank_of[0], int(args.rank_of[1])
        records = anyio.run(
            rank_loop, address, rank, args.hosts, args.steps, args.groups_per_rank,
            args.group, args.width, args.seed,
        )  # fmt: skip
        print(json.dumps(records))
        return
    why = None if args.labels else netns_unavailable()
    if args.netns and why is not None:
        raise SystemExit(f"--netns: {why}")
    results: dict[str, dict[str, Any]] = {}
    if why is None and not args.labels:
        print(f"mode: netns, {args.hosts} hosts, links {args.rate} each way (tc tbf)", flush=True)
        lab = Lab(f"tqb{os.getpid() % 100000}", args.hosts, args.rate)
        with tempfile.TemporaryDirectory(prefix="tq-locality-") as tmp:
            try:
                lab.build()
                for placement in ("local", "round_robin"):
                    records = run_netns(lab, placement, args, Path(tmp))
                    results[placement] = summarise(placement, records, args.hosts, True)
            finally:
                lab.destroy()
    else:
        print(f"mode: labels ({why or 'asked for'}): byte split only, no time", flush=True)
        for placement in ("local", "round_robin"):
            records = anyio.run(
                run_labels, placement, args.hosts, args.steps, args.groups_per_rank,
                args.group, args.width, args.seed,
            )  # fmt: skip
            results[placement] = summarise(placement, records, args.hosts, False)
    local, rr = results["local"], results["round_robin"]
    ratios = [local["max_rank_tokens"][s] / rr["max_rank_tokens"][s] for s in rr["max_rank_tokens"]]
    summary: dict[str, Any] = {
        "cross_host_local": local["cross_host_read_fraction"],
        "cross_host_round_robin": rr["cross_host_read_fraction"],
        "max_rank_tokens_vs_unconstrained_max": round(max(ratios), 4),
        "max_rank_tokens_vs_unconstrained_mean": round(sum(ratios) / len(ratios), 4),
    }
    if "learner_data_ms_mean" in local:
        summary["data_time_speedup_mean"] = round(
            rr["learner_data_ms_mean"] / local["learner_data_ms_mean"], 2
        )
    for r in (local, rr):
        r.pop("max_rank_tokens")
        print(json.dumps(r))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
