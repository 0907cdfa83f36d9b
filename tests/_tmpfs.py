"""A file system of a few MiB that really fills (a tmpfs mounted for a test: needs root)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted at ``path`` (made), unmounted on exit; the test is
    skipped where mounting one is not allowed (not root, no mount)."""
    if sys.platform != "linux":
        pytest.skip("a tmpfs needs Linux")
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:  # lazily: a process of the test that is still going keeps it until it exits
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def fill(directory: Path) -> None:
    """Fill the file system of ``directory`` up (a file of zeros until ENOSPC)."""
    with open(directory / "filler", "wb", buffering=0) as f:
        block = bytes(64 << 10)
        while True:
            try:
                f.write(block)
            except OSError:
                block = block[: len(block) // 2]
                if not block:
                    return
