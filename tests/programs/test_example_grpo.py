"""The main example, examples/async_grpo.py, at a tiny size: in-process, remote and as a script."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import tq_async as tq
from _example import EXAMPLE, example
from _services import service


def check_summary(s: dict[str, Any], rows: int, dp_size: int = 2) -> None:
    assert s["rows"] == rows
    for task, t in s["tasks"].items():
        assert t["exactly_once"], task
        assert t["rows"] == rows - (s["dropped"] if task == "learner" else 0), task
        assert t["rows_per_s"] > 0
        assert 0 <= t["wait_mean_s"] <= t["wait_max_s"]
    assert s["exactly_once"]
    assert s["consumption_confirmed"]
    assert s["replicas_identical"]
    assert len(s["losses"]) == s["steps"]
    assert all(math.isfinite(loss) for loss in s["losses"])
    assert math.isfinite(s["final_loss"])
    balance = s["balance"]
    assert len(balance["tokens_per_rank"]) == s["steps"]
    assert all(len(per_step) == dp_size for per_step in balance["tokens_per_rank"])
    assert all(tokens > 0 for per_step in balance["tokens_per_rank"] for tokens in per_step)
    assert 1.0 <= balance["ratio_mean"] <= balance["ratio_max"]
    assert balance["in_order_ratio_mean"] >= 1.0


@pytest.mark.parametrize("bound", ["1", "0", "off"])
async def test_tiny_run_in_process(bound: str) -> None:
    args = example.parse_args(["--tiny", "--quiet", "--max-staleness", bound])
    s = await example.run(args)
    check_summary(s, rows=3 * 4 * 2)
    assert s["dropped"] == 0  # admission keeps every row within the bound
    if bound != "off":
        assert s["staleness_seen_max"] <= int(bound)


async def test_larger_groups_and_more_ranks() -> None:
    sizes = "--dp-size 3 --replicas 1 --n-samples 3 --prompts-per-step 6 --rank-batch-size 6"
    args = example.parse_args(["--tiny", "--quiet", *sizes.split(), "--micro-batch-size", "4"])
    s = await example.run(args)
    check_summary(s, rows=3 * 6 * 3, dp_size=3)


async def test_against_a_cluster_it_did_not_start() -> None:
    # --address: the cluster's own (default) samplers and no admission; still exactly once
    async with tq.local_cluster(num_storage_units=1) as cluster:
        args = example.parse_args(["--tiny", "--quiet", "--address", cluster.address])
        s = await example.run(args)
        check_summary(s, rows=24)
        assert s["remote"]
        async with tq.AsyncClient.connect(cluster.address) as client:
            assert await client.list_partitions() == []  # every step partition was cleared


async def test_staleness_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    args = example.parse_args(["--tiny", "--staleness-sweep", "off,0"])
    results = await example.sweep(args, args.staleness_sweep)
    assert [s["max_staleness"] for s in results] == [None, 0]
    for s in results:
        check_summary(s, rows=24)
    out = capsys.readouterr().out
    assert "samples/s" in out
    assert "dropped" in out


def test_summed_rank_gradients_are_the_whole_batch_gradient() -> None:
    """What the learner's all-reduce relies on: sums over ranks / all tokens == one batch."""
    torch.manual_seed(0)
    policy, rng = example.TinyPolicy(16), torch.Generator().manual_seed(0)
    prompts, responses, old = [], [], []
    for _ in range(3):
        prompt = torch.randint(1, 16, (8,), generator=rng)
        got, lps = example.generate(policy, prompt, 2, 12, rng)
        prompts += [prompt, prompt]
        responses += got
        old += lps
    lengths = [len(r) for r in responses]
    batch = {
        "input_ids": torch.stack(prompts),
        "responses": example.jagged(responses),
        "old_log_prob": example.jagged([lp - 0.1 for lp in old]),  # as if from an older policy
        "ref_log_prob": example.jagged([torch.randn(n, generator=rng) for n in lengths]),
        "advantages": torch.randn(6, generator=rng),
    }
    params = list(policy.parameters())

    def grads(rows: slice) -> tuple[list[torch.Tensor], int]:
        part = {
            k: example.jagged(v.unbind()[rows]) if v.is_nested else v[rows]
            for k, v in batch.items()
        }
        loss, tokens = example.grpo_loss(policy, part, clip=0.2, kl_coef=0.02)
        return list(torch.autograd.grad(loss, params)), tokens

    whole, n_tokens = grads(slice(0, 6))
    (rank0, t0), (rank1, t1) = grads(slice(0, 4)), grads(slice(4, 6))
    assert t0 + t1 == n_tokens == sum(lengths)
    for w, a, b in zip(whole, rank0, rank1, strict=True):
        torch.testing.assert_close((a + b) / n_tokens, w / n_tokens)


def test_script_prints_the_summary() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--tiny"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "is_fx_tracing" not in done.stderr  # torch's tracing notice (tq_async drops it)
    out = done.stdout
    for task in ("rollout", "reward", "ref", "learner"):
        line = next(line for line in out.splitlines() if line.startswith(task))
        assert line.endswith("yes"), line  # consumed exactly once
    assert "NO" not in out
    assert "tokens per DP rank per step" in out
    assert "final loss" in out
    assert "step   3/3" in out  # the learner prints its loss per step


def run_script(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_a_failed_task_stops_the_run_with_the_first_error_and_a_diagnosis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Groups of 8 against a cluster set up for groups of 4 (examples/grpo.toml).

    The script runs once as a program (its exit status and stderr are the point); the rerun,
    the printed configuration and the run that succeeds with it run in this process."""
    sizes = ["--tiny", "--n-samples", "8", "--rank-batch-size", "8", "--micro-batch-size", "4"]
    toml = EXAMPLE.parent / "grpo.toml"
    with service(["--config", str(toml)], tmp_path / "serve.err") as svc:
        address = svc.wait_line("TQ_ADDRESS=")
        t0 = time.monotonic()
        done = run_script(*sizes, "--address", address)
        elapsed = time.monotonic() - t0
        assert done.returncode == 1, done.stderr
        assert elapsed < 30  # seconds, not a hang (it used to stay alive indefinitely)
        lines = done.stderr.splitlines()
        [error] = [line for line in lines if line.startswith("error: ")]
        assert "n_samples_per_prompt=4" in error  # the first error: the reward task's
        [diagnosis] = [line for line in lines if line.startswith("diagnosis: ")]
        assert "samplers set up for other arguments" in diagnosis
        assert "--print-config" in diagnosis
        # the failed run cleared its partitions: a rerun is not refused, it fails the same way
        args = example.parse_args([*sizes, "--address", address, "--quiet"])
        try:  # a refusal (SystemExit: "already holds ...") is no Exception: it fails the test
            anyio.run(example.run, args)
        except Exception as exc:  # a task failed, as the script's main sees it
            again = example.first_error(exc)
        else:
            pytest.fail("the rerun succeeded against samplers set up for groups of 4")
        assert "samplers set up for other arguments" in example.diagnose(again, args)
    # with the configuration printed for these arguments, the same run succeeds
    example.main([*sizes, "--print-config"])
    (tmp_path / "run.toml").write_text(capsys.readouterr().out)
    with service(["--config", str(tmp_path / "run.toml")], tmp_path / "run.err") as svc:
        args = example.parse_args([*sizes, "--address", svc.wait_line("TQ_ADDRESS="), "--quiet"])
        s = anyio.run(example.run, args)
        check_summary(s, rows=s["steps"] * args.prompts_per_step * 8)


async def test_a_cluster_holding_another_runs_partitions_is_refused_with_what_to_do() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.zeros(2)}, partition_id="train@0")
        args = example.parse_args(["--tiny", "--quiet", "--address", cluster.address])
        with pytest.raises(SystemExit) as info:
            await example.run(args)
        message = str(info.value)
        assert "['train@0']" in message
        assert "another run of this example" in message
        assert "fresh `tq-async serve`" in message


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        example.main(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "responses per prompt (default: 4)" in text
    assert "GRPO groups per step (default: 16)" in text
    assert "(default: 1)" in text  # --max-staleness


def test_print_config_matches_grpo_toml_for_the_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    example.main(["--print-config"])
    printed = tq.Config.from_toml_string(capsys.readouterr().out)
    assert printed == tq.Config.from_toml(EXAMPLE.parent / "grpo.toml")
