"""Directories of durable files: what makes a name made, renamed or deleted in one survive a
machine crash."""

from __future__ import annotations

import os

__all__ = ["sync_dir"]


def sync_dir(directory: str) -> None:
    """Sync ``directory`` (the names of the files made, renamed or deleted in it)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
