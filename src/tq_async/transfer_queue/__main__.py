"""``python -m tq_async.transfer_queue SCRIPT [ARGS...]``: run a TransferQueue program
unchanged, with ``import transfer_queue`` served by `tq_async.compat`."""

from __future__ import annotations

import runpy
import sys

from . import install


def main(argv: list[str]) -> None:
    """Run ``argv[0]`` as ``__main__`` with ``argv`` as its ``sys.argv``."""
    if not argv or argv[0] in ("-h", "--help"):
        sys.stderr.write(__doc__ or "")
        raise SystemExit(0 if argv else 2)
    install()
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
