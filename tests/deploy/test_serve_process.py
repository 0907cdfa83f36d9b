"""``tq-async serve`` as a process: the signals that stop it, its pipes, its shutdown."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from _services import service

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
