"""``tq-async serve`` as a process: the signals that stop it, its pipes, its shutdown."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import numpy as np
import pytest

import tq_async as tq
from _cluster_proc import _read_address, free_port, serve_cluster
from _services import START_TIMEOUT, service
from tq_async._deploy._stderr import LogStream
from tq_async._service._serve import serve_controller

ROLES = [[], ["controller"]]
ROLE_IDS = ["serve", "controller"]


@pytest.mark.parametrize("role", ROLES, ids=ROLE_IDS)
def test_sighup_stops_the_service_gracefully(role: list[str], tmp_path: Path) -> None:
    """A terminal that closes (or a launcher without ``nohup``) sends SIGHUP: it killed the
    service with the default action (status -1, no clean stop). It stops as on SIGTERM."""
    with service(role or ["--storage-units", "1"], tmp_path / "e") as svc:
        svc.wait_line("TQ_ADDRESS=")
        assert svc.stop(signal.SIGHUP) == 0, svc.stderr()
        assert "signal=SIGHUP" in svc.stderr()


@pytest.mark.parametrize(
    ("sig", "prefix"),
    [
        (signal.SIGHUP, ["nohup"]),
        (signal.SIGINT, ["sh", "-c", 'trap "" INT; exec "$0" "$@"']),  # a script's `&`
    ],
    ids=["nohup", "background"],
)
def test_a_signal_that_came_in_ignored_stays_ignored(
    sig: signal.Signals, prefix: list[str], tmp_path: Path
) -> None:
    """``nohup tq-async serve`` (SIGHUP ignored), ``tq-async serve &`` in a shell script
    (SIGINT ignored): the launcher wants the service to serve on through them, and it
    stopped on them instead."""
    with service(["controller"], tmp_path / "e", prefix=prefix) as svc:
        address = svc.wait_line("TQ_ADDRESS=")
        svc.proc.send_signal(sig)
        with tq.Client.connect(address, request_timeout=START_TIMEOUT) as client:
            assert client.list_partitions() == []
        assert svc.stop() == 0  # SIGTERM: the first signal it took
        assert "signal=SIGTERM" in svc.stderr()
        assert sig.name not in svc.stderr()


@pytest.mark.parametrize("role", ROLES, ids=ROLE_IDS)
def test_a_second_signal_ends_the_service_at_once(role: list[str], tmp_path: Path) -> None:
    """A second SIGTERM/SIGINT (Ctrl-C twice) while the service stops gracefully ends it at
    once, killed by that signal (as without a handler). Both arrive before the service
    reacts to the first (it is stopped meanwhile): the second was swallowed, status 0."""
    with service(role or ["--storage-units", "1"], tmp_path / "e") as svc:
        svc.wait_line("TQ_ADDRESS=")
        proc = svc.proc
        proc.send_signal(signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(timeout=20) in (-signal.SIGTERM, -signal.SIGINT), svc.stderr()
        assert "a second signal: stopping at once" in svc.stderr()


@pytest.mark.parametrize("role", ROLES, ids=ROLE_IDS)
def test_a_launcher_that_never_reads_stderr_does_not_stall_the_service(role: list[str]) -> None:
    """A launcher that pipes the service's stderr and never reads it: once the pipe is full
    (64 KiB of logs), writing the next log line blocked the event loop and the service
    answered nothing more. It serves on (the lines that do not fit are dropped, and counted),
    and SIGTERM still stops it."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    argv = [*role, "--bind", bind, "--waiting-warning-after", "0.05"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tq_async._deploy._cli", "serve", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,  # never read
    )
    try:
        assert _read_address(proc) == bind
        with tq.Client.connect(bind, request_timeout=10) as client:
            # the controller warns that it has waited 0.05 s on a partition that does not
            # exist, naming it and the field: a line over 64 KiB alone
            with pytest.raises(tq.TQTimeoutError):
                client.get_meta(["f" * 40_000], 1, "p" * 40_000, "t", timeout=1)
            assert client.list_partitions() == []  # the service still answers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=START_TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for pipe in (proc.stdout, proc.stderr):
            assert pipe is not None
            pipe.close()


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_log_lines_that_do_not_fit_are_counted(as_json: bool) -> None:
    """`LogStream` drops the lines that do not fit while its reader lags, and says how many
    once there is room: every line written is read, or counted in a note, in order (with
    ``--log-json`` the note is a JSON object too: a log shipper parses every line)."""
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 4096)  # a small pipe: full at once
    stream = LogStream(write, limit=2000, json=as_json)
    os.close(write)
    pad = "x" * 90
    lines = [
        json.dumps({"event": "line", "i": i, "pad": pad}) + "\n" if as_json else f"line {i} {pad}\n"
        for i in range(200)
    ]
    chunks: list[bytes] = []
    reader = threading.Thread(
        target=lambda: chunks.extend(iter(partial(os.read, read, 65536), b""))
    )
    try:
        for line in lines[:100]:  # ~10 KB: over the pipe and the queue, so some are dropped
            stream.write(line)
        chunks.append(os.read(read, 4096))  # some room again
        for line in lines[100:]:
            stream.write(line)
        reader.start()
        stream.close(idle=START_TIMEOUT)  # all written: the reader reads to the end
        reader.join(timeout=START_TIMEOUT)
    finally:
        os.close(read)
    seen, dropped = [], []
    for line in b"".join(chunks).decode().splitlines():
        if as_json:
            record = json.loads(line)
            if record["event"] == "line":
                seen.append(record["i"])
            else:
                assert record["event"] == "log lines dropped: stderr was not read fast enough"
                assert record["level"] == "warning"
                dropped.append(record["count"])
        elif line.startswith("line "):
            seen.append(int(line.split()[1]))
        else:
            match = re.fullmatch(
                r"tq-async: (\d+) log lines dropped: stderr was not read fast enough", line
            )
            assert match, line
            dropped.append(int(match.group(1)))
    assert dropped
    assert len(seen) + sum(dropped) == len(lines)
    assert seen == sorted(seen)


def test_a_closed_stderr_drops_the_lines() -> None:
    """A service started with its stderr closed (``2>&-``): Python has no ``sys.stderr``, and
    the log stream drops every line instead of failing."""
    closed = max(map(int, os.listdir("/proc/self/fd"))) + 100  # no descriptor has it
    stream = LogStream(closed)
    assert not stream.isatty()
    assert stream.write("lost\n") == 5
    stream.close()


@pytest.mark.parametrize("role", ROLES, ids=ROLE_IDS)
def test_a_bind_port_past_65535_is_a_bad_command_line(role: list[str]) -> None:
    """``--bind tcp://127.0.0.1:99999`` (a typo for 9999): ZMQ took the port modulo 65536 and
    the service served at port 34463. It is refused, status 2, naming the range."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tq_async._deploy._cli",
            "serve",
            *role,
            "--bind",
            "tcp://127.0.0.1:99999",
        ],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "from 0 to 65535" in done.stderr
    assert "TQ_ADDRESS" not in done.stdout


async def test_a_service_refuses_a_bind_port_past_65535() -> None:
    with pytest.raises(tq.InvalidRequestError, match="from 0 to 65535"):
        async with tq.local_cluster(transport="tcp", bind="tcp://127.0.0.1:65536"):
            pass
    with pytest.raises(tq.InvalidRequestError, match="from 0 to 65535"):
        await serve_controller("tcp://127.0.0.1:99999")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--controller", "127.0.0.1:5555"], "did you mean 'tcp://127.0.0.1:5555'"),
        (["--controller", "tcp://127.0.0.1:70000"], "needs a port from 1 to 65535"),
        (["--controller", "tcp://127.0.0.1:5555", "--unit-id", "-1"], "--unit-id"),
    ],
    ids=["no-scheme", "port", "unit-id"],
)
def test_a_bad_storage_flag_is_a_bad_command_line(argv: list[str], says: str) -> None:
    """A `serve storage` flag that cannot be right (a controller address without its scheme,
    a negative unit id) ended the unit with status 1, as a controller that does not answer
    does: it is a bad command line, status 2 (as `tq-async status` says of such an
    address), before anything starts."""
    done = subprocess.run(
        [sys.executable, "-m", "tq_async._deploy._cli", "serve", "storage", *argv],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert says in done.stderr


def test_status_watch_into_a_reader_that_stopped_ends_quietly() -> None:
    """``tq-async status --watch | head -n 5``: once ``head`` exits, the next screen met a
    closed pipe and the command died with a BrokenPipeError traceback, status 1. It ends
    quietly, status 0 (as a Ctrl-C ends the watch)."""
    with serve_cluster(1) as address, tq.Client.connect(address) as client:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tq_async._deploy._cli", "status", address, "--watch"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = proc.stdout, proc.stderr
        assert out is not None
        assert err is not None
        try:
            assert out.readline()  # the first screen
            out.close()  # the reader stops
            for i in range(100):  # events: the watch prints again (bounded: it exits first)
                client.put({"x": np.zeros((1, 1))}, partition_id=f"p{i}")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1)
                    break
            said = err.read().decode()
            assert proc.wait(timeout=START_TIMEOUT) == 0, said
            assert "Traceback" not in said, said
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            err.close()


@pytest.mark.parametrize("role", ROLES, ids=ROLE_IDS)
def test_a_data_dir_that_cannot_be_used_is_a_bad_configuration(
    role: list[str], tmp_path: Path
) -> None:
    """``--data-dir`` naming a directory that does not exist is refused with a `ConfigError`
    (a bad configuration: status 2, as documented), not status 1 (a service that could not
    start: a port taken, a controller that does not answer)."""
    missing = tmp_path / "missing"
    argv = [*role, "--durability", "process", "--data-dir", str(missing)]
    done = subprocess.run(
        [sys.executable, "-m", "tq_async._deploy._cli", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert f"mkdir -p {missing}" in done.stderr
