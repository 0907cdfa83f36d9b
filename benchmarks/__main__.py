"""``python -m benchmarks``: run the benchmark suite (see ``--help``)."""

from __future__ import annotations

import sys

# The guard matters: multiprocessing "spawn" children re-import this module as __mp_main__.
if __name__ == "__main__":
    from benchmarks._runner import main

    sys.exit(main())
