"""The benchmark workloads W1-W4 on TransferQueue 0.1.11, for ``python -m benchmarks.compare``.

This subpackage runs inside its own virtual environment (``benchmarks/.venv-tq``, with
``transferqueue==0.1.11`` and Ray installed); it never imports ``tq_async``. Its entry point is
``python -m benchmarks.transferqueue.run`` (see ``--help``), run from the repository root with
that environment's interpreter. The results are plain dicts in the same schema, and with the same
``workload``/``metric`` names wherever the measurement is the same, as those of
``python -m benchmarks``, so the two suites pair up row by row.

Like ``benchmarks/__init__.py``, importing this package must stay cheap (no torch, no Ray).
"""
