"""Shared test helpers. Clusters are opened with ``async with`` inside each test body."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

# Tests run with filterwarnings=error; keep torch's thread pools small on the 2-core CI box.
os.environ.setdefault("OMP_NUM_THREADS", "1")

#: `--dist loadgroup` groups that hold under pytest >= 9.2 (see the module)
pytest_plugins = ["_xdist_groups"]


@pytest.fixture(autouse=True)
def _restore_tq_logging() -> Iterator[None]:
    """Undo ``tq.configure_logging`` after each test (it sets up the ``tq_async`` logger)."""
    logger = logging.getLogger("tq_async")
    saved = (logger.level, logger.propagate, list(logger.handlers))
    yield
    logger.setLevel(saved[0])
    logger.propagate = saved[1]
    logger.handlers[:] = saved[2]
