"""Shared test helpers. Clusters are opened with ``async with`` inside each test body."""

from __future__ import annotations

import os

# Tests run with filterwarnings=error; keep torch's thread pools small on the 2-core CI box.
os.environ.setdefault("OMP_NUM_THREADS", "1")
