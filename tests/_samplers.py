"""Samplers the controller and ``get_batches`` tests share."""

from __future__ import annotations

import anyio

import tq_async as tq


class Later(tq.BaseSampler):
    """A sequential sampler that answers after a suspension (an ``async`` sampler)."""

    async def sample(self, ready_indexes, batch_size, *args, **kwargs):  # type: ignore[no-untyped-def,override]
        await anyio.lowlevel.checkpoint()
        rows = list(ready_indexes)[:batch_size]
        return (rows, rows) if len(rows) == batch_size else ([], [])
