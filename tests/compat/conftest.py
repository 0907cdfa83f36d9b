"""Acceptance tests for ``tq_async.compat``: TransferQueue 0.1.11 flows, written against its
API, run with ``import transfer_queue as tq`` replaced by ``import tq_async.compat as tq``.

Each test starts from a process without a cluster (no ``TQ_ADDRESS``) and closes what it
started.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import tq_async.compat as tq


@pytest.fixture(autouse=True)
def _fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("TQ_ADDRESS", raising=False)
    monkeypatch.delenv("TQ_METRICS_ENDPOINT", raising=False)
    yield
    tq.close()
