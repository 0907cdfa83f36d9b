"""Logs go through standard ``logging`` loggers: the application's configuration decides."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tq_async as tq
from _services import service
from tq_async._logging import get_logger
from tq_async._service._serve import warn_if_exposed

QUIET_PROGRAM = """
import anyio, torch
from tensordict import TensorDict
import tq_async as tq
from tq_async._logging import get_logger
from tq_async._service._serve import warn_if_exposed

async def main():
    async with tq.local_cluster(num_storage_units=1) as cluster:
        async with tq.AsyncClient.connect(cluster.address) as client:
            meta = await client.put(TensorDict({"x": torch.arange(4)}, [4]), partition_id="p")
            await client.get_data(meta)
    get_logger("tq_async.test").info("an info record")
    warn_if_exposed("tcp://0.0.0.0:1", "controller")  # a warning
    print("program output")

anyio.run(main)
"""


def test_an_unconfigured_program_gets_nothing_on_stdout_and_warnings_on_stderr() -> None:
    done = subprocess.run(
        [sys.executable, "-c", QUIET_PROGRAM],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "program output\n"
    # warnings and errors only, on stderr, where Python's last-resort handler prints them
    assert "anyone who can reach it can read and write data" in done.stderr
    assert "address='tcp://0.0.0.0:1'" in done.stderr
    assert "an info record" not in done.stderr
    # with the level and the logger: a bare line would not say who warns
    [line] = [ln for ln in done.stderr.splitlines() if "anyone who can reach" in ln]
    assert line.startswith("WARNING tq_async._service._serve: ")


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        (
            "logging.basicConfig()",
            "WARNING:tq_async._service._serve:",
        ),  # the application's own format
        ("logging.lastResort = None", None),  # the application silenced unhandled records
    ],
)
def test_a_configured_program_sees_each_warning_once_in_its_own_format(
    setup: str, expected: str | None
) -> None:
    program = (
        f"import logging\n{setup}\n"
        "from tq_async._service._serve import warn_if_exposed\n"
        "warn_if_exposed('tcp://0.0.0.0:1', 'controller')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if "anyone who can reach" in ln]
    if expected is None:
        assert lines == []
    else:
        [line] = lines
        assert line.startswith(expected)


COMPAT_PROGRAM = """
import tq_async.compat as tq

tq.init({"controller": {"num_storage_units": 1}})  # logs "initialised" at info
try:
    tq.kv_put(key="k", partition_id="p", fields={"x": [1]}, tag={})
    print("program output")
finally:
    tq.close()
"""


def test_compat_init_prints_nothing_on_stdout() -> None:
    done = subprocess.run(
        [sys.executable, "-c", COMPAT_PROGRAM],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "program output\n"
    assert "initialised" not in done.stderr  # an info record: not shown by default


def test_every_module_logs_through_the_project_logger() -> None:
    """A bare ``structlog.get_logger`` prints to stdout (structlog's default PrintLogger)."""
    src = Path(tq.__file__).parent
    offenders = [
        f"{path.relative_to(src)}:{number}"
        for path in sorted(src.rglob("*.py"))
        if path.name != "_logging.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "structlog.get_logger" in line or "structlog.wrap_logger" in line
    ]
    assert not offenders, f"use tq_async._logging.get_logger instead: {offenders}"


FORGOTTEN_SEAL_PROGRAM = """
import anyio, torch
from tensordict import TensorDict
import tq_async as tq

async def main():
    deadlines = tq.Deadlines(waiting_warning_after=0.3)
    async with tq.local_cluster(num_storage_units=1, deadlines=deadlines) as cluster:
        async with tq.AsyncClient.connect(cluster.address) as client:
            await client.put(TensorDict({"x": torch.arange(4)}, [4]), partition_id="train@0")
            # no seal: the third get_meta waits for rows that never come
            for _ in range(3):
                try:
                    meta = await client.get_meta(["x"], 2, "train@0", "learner", timeout=2)
                except tq.TQTimeoutError:
                    print("timed out")
                    break
                print(meta.global_indexes)

anyio.run(main)
"""


def test_a_forgotten_seal_warns_on_stderr_once_and_nothing_on_stdout() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FORGOTTEN_SEAL_PROGRAM],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[0, 1]\n[2, 3]\ntimed out\n"
    assert done.stderr.count("not sealed") == 1, done.stderr
    assert "partition 'train@0'" in done.stderr
    assert "the task consumed 4 of its 4 rows" in done.stderr
    assert "client.seal('train@0')" in done.stderr


async def test_serve_warns_once_about_a_forgotten_seal(tmp_path: Path) -> None:
    with service(["--waiting-warning-after", "0.2"], tmp_path / "serve.err") as svc:
        address = svc.wait_line("TQ_ADDRESS=")
        async with tq.AsyncClient.connect(address) as client:
            await client.put({"x": torch.arange(2)}, partition_id="train@0")
            assert len(await client.get_meta(["x"], 2, "train@0", "learner")) == 2
            with pytest.raises(tq.TQTimeoutError):
                await client.get_meta(["x"], 2, "train@0", "learner", timeout=1.0)
        assert svc.stop() == 0
        err = svc.stderr()
    assert err.count("not sealed") == 1, err
    assert "client.seal('train@0')" in err
    assert "the task consumed 2 of its 2 rows" in err


def test_records_are_stdlib_records_named_after_modules(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="tq_async"):
        warn_if_exposed("tcp://0.0.0.0:5555", "storage")
        get_logger("tq_async.test").debug("hidden")
    [record] = caplog.records
    assert record.name == "tq_async._service._serve"
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("binding a non-loopback interface")
    assert record.tq_event["address"] == "tcp://0.0.0.0:5555"  # type: ignore[attr-defined]


def test_configure_logging_levels_in_any_case_and_plain_text_off_a_tty(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.txt"
    root = logging.getLogger("tq_async")
    saved = (root.level, root.propagate, list(root.handlers))
    try:
        with path.open("w") as stream:
            tq.configure_logging("warning", stream=stream)
            log = get_logger("tq_async.test")
            log.info("hidden")
            log.warning("shown", rid=7)
        text = path.read_text()
        assert "shown" in text
        assert "rid=7" in text
        assert "hidden" not in text
        assert "\x1b[" not in text  # no colour codes in a file
        with pytest.raises(ValueError, match="level"):
            tq.configure_logging("LOUD")
    finally:
        root.setLevel(saved[0])
        root.propagate = saved[1]
        root.handlers[:] = saved[2]
        import structlog

        structlog.reset_defaults()


def test_serve_logs_json_to_stderr_and_stops_on_sigterm_without_errors(tmp_path: Path) -> None:
    with service(["--log-level", "Debug", "--log-json"], tmp_path / "err.txt") as svc:
        assert svc.wait_line("TQ_ADDRESS=").startswith("tcp://127.0.0.1:")
        assert svc.stop() == 0
        lines = svc.stderr().splitlines()
    assert lines
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert {r["event"] for r in records} >= {"serving", "stopping"}
    assert all(r["level"] in ("debug", "info") for r in records), records


def test_serve_plain_text_when_stderr_is_not_a_tty(tmp_path: Path) -> None:
    with service(["controller"], tmp_path / "err.txt") as svc:
        svc.wait_line("TQ_ADDRESS=")
        assert svc.stop() == 0
        text = svc.stderr()
    assert "controller serving" in text
    assert "stopping" in text
    assert "\x1b[" not in text
    assert "error" not in text.lower()
    assert "warning" not in text.lower()


def test_log_level_is_case_insensitive(capsys: pytest.CaptureFixture[str]) -> None:
    from tq_async._deploy._cli import _build_parser

    assert _build_parser().parse_args(["serve", "--log-level", "warning"]).log_level == "WARNING"
    with pytest.raises(SystemExit):
        _build_parser().parse_args(["serve", "--log-level", "loud"])
    assert "unknown log level 'loud'" in capsys.readouterr().err


def test_serve_colours_its_logs_on_a_terminal() -> None:
    import os
    import pty
    import signal

    from _cluster_proc import _read_address

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tq_async._deploy._cli", "serve"],
        stdout=subprocess.PIPE,
        stderr=slave,
    )
    os.close(slave)
    try:
        _read_address(proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other side is closed
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()
        os.close(master)
    text = b"".join(chunks).decode()
    assert "serving" in text
    assert "\x1b[" in text  # coloured


async def test_the_units_of_one_process_name_themselves_in_their_log_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The units of one process (``tq-async serve``, ``local_cluster``) logged the same line
    each, with nothing to tell which unit said it (here: a device arena without shared
    memory). Their lines carry ``unit=N``; the program's own lines do not."""
    config = tq.Config(num_storage_units=2, shm_cap=0, device_cap=1 << 20)
    with caplog.at_level(logging.WARNING, logger="tq_async"):
        async with tq.local_cluster(config=config):
            get_logger("tq_async.test").warning("the program's own line")
    told = [r for r in caplog.records if r.getMessage().startswith("no device arena")]
    assert sorted(r.tq_event["unit"] for r in told) == [0, 1]  # type: ignore[attr-defined]
    assert all(r.getMessage().endswith(f"unit={r.tq_event['unit']}") for r in told)  # type: ignore[attr-defined]
    [own] = [r for r in caplog.records if r.getMessage() == "the program's own line"]
    assert "unit" not in own.tq_event  # type: ignore[attr-defined]
