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
