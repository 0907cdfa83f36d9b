"""Benchmark suite of tq_async: ``python -m benchmarks --help``.

One module per workload (``w1_data_plane``, ``w2_control_plane``, ``w3_wakeup``,
``w4_startup``); each returns plain result dicts ``{workload, metric, value, unit, ...}`` so a
second system (TransferQueue, for ``--compare``) can fill the same table.

This package must stay cheap to import (no torch, no tq_async at module level): the W4 child
process times ``import tq_async`` itself.
"""
