"""The policy versions of a partition's rows: which policy produced each cell.

A committed put may carry one ``policy_version`` per row. A partition keeps, per field that
ever carried one, each row's version of that field, and per row the oldest version any of its
fields carries (``-1``: none). The staleness samplers and admission read the per-row one, a
get_meta's reply carries the per-field ones. Plain arrays, no I/O.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Mapping, Sequence

from .._errors import InvalidRequestError

__all__ = ["PolicyVersions"]


class PolicyVersions:
    """The versions of ``n_rows`` rows (see the module docstring)."""

    __slots__ = ("fields", "rows")

    def __init__(self, n_rows: int = 0) -> None:
        #: per row the oldest version of its fields (-1: none)
        self.rows = array("q", itertools.repeat(-1, n_rows))
        #: per field that ever carried a version: each row's (-1: none)
        self.fields: dict[str, array[int]] = {}

    def grow(self, n: int) -> None:
        """``n`` new rows, without versions."""
        self.rows.extend(itertools.repeat(-1, n))
        for fv in self.fields.values():
            fv.extend(itertools.repeat(-1, n))

    def drop(self, n: int) -> None:
        """Forget the first ``n`` rows (cleared: their partition's arrays start after them)."""
        del self.rows[:n]
        for fv in self.fields.values():
            del fv[:n]

    def record(
        self, rows: Sequence[int], fields: Sequence[str], versions: Sequence[int], base: int = 0
    ) -> None:
        """``fields`` of ``rows`` were produced by policy ``versions`` (one per row); the
        arrays start at row ``base`` (the partition's).

        Raises `InvalidRequestError` (changing nothing) unless there is one non-negative
        version per row.
        """
        if len(versions) != len(rows) or any(v < 0 for v in versions):
            raise InvalidRequestError(
                f"policy_version needs one non-negative int per row ({len(rows)} rows)"
            )
        for name in fields:
            fv = self.fields.get(name)
            if fv is None:
                fv = self.fields[name] = array("q", itertools.repeat(-1, len(self.rows)))
            for r, v in zip(rows, versions, strict=True):
                fv[r - base] = v
        rv = self.rows
        for r, v in zip(rows, versions, strict=True):
            i = r - base
            rv[i] = v if rv[i] < 0 else min(rv[i], v)

    @classmethod
    def restore(
        cls, n_rows: int, rows: Sequence[int], fields: Mapping[str, Sequence[int]]
    ) -> PolicyVersions:
        """The versions a checkpoint holds (``rows`` empty: a checkpoint without versions)."""
        out = cls()
        out.rows = array("q", rows or itertools.repeat(-1, n_rows))
        out.fields = {f: array("q", v) for f, v in fields.items()}
        return out
