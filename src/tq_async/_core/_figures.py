"""Per-task figures of a partition that ``tq-async status`` and the metrics show.

The metrics are collected on the HTTP server's thread while the controller's loop changes
the state: these functions read it through copies (``bytes(...)``, ``list(...)``: one call
each under the GIL), never through a numpy view, whose export would stop the loop's
``bytearray`` from growing (a put's ``BufferError``).
"""

from __future__ import annotations

import numpy as np

from ._state import Partition

__all__ = ["ready_counts"]


def ready_counts(p: Partition) -> dict[str, int]:
    """Rows each task of ``p`` can be given now: its largest maintained ready set (no scan);
    for a task whose sets were dropped (a reset, a unit back, a controller restart: rebuilt
    at its next request), the rows alive, not consumed and produced in every field (one
    scan of copies, as the set's rebuild counts them)."""
    counts: dict[str, int] = {}
    for (task, _), rs in list(p.ready.items()):
        counts[task] = max(counts.get(task, 0), len(rs.rows))
    if all(t in counts for t in list(p.consumed)):
        return counts
    while True:  # copies of one layout: again if the loop dropped cleared rows meanwhile
        base = p.base
        unset = [(t, bytes(c)) for t, c in list(p.consumed.items()) if t not in counts]
        have = [bytes(p.alive), *(bytes(f.produced) for f in list(p.fields.values()))]
        unavailable = list(p.unavailable)
        # rows of suspended units are not ready (their units copied only then)
        units = bytes(p.units) if unavailable else None
        if p.base == base:
            break
    n = min(*map(len, have), *(len(c) for _, c in unset))  # (rows added meanwhile)
    mask = np.ones(n, dtype=np.bool_)
    for flags in have:
        mask &= np.frombuffer(flags, dtype=np.bool_, count=n)
    if units is not None:
        mask &= ~np.isin(np.frombuffer(units, dtype=np.int32)[:n], unavailable)
    for task, consumed in unset:
        counts[task] = int(np.count_nonzero(mask & ~np.frombuffer(consumed, np.bool_, count=n)))
    return counts
