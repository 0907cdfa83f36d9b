"""``python -m tq_async.transfer_queue PROGRAM [ARGS...]``: run a TransferQueue program
unchanged, with ``import transfer_queue`` served by `tq_async.compat`. ``PROGRAM`` is a
Python file, or a Jupyter notebook (``.ipynb``: its code cells run in order, in one
namespace, as ``tutorial/basic.ipynb`` is meant to be read)."""

from __future__ import annotations

import json
import runpy
import sys
from typing import Any

from . import install


def main(argv: list[str]) -> None:
    """Run ``argv[0]`` as ``__main__`` with ``argv`` as its ``sys.argv``."""
    if not argv or argv[0] in ("-h", "--help"):
        sys.stderr.write(__doc__ or "")
        raise SystemExit(0 if argv else 2)
    path = argv[0]
    try:
        code = notebook_code(path) if path.endswith(".ipynb") else None
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"tq_async.transfer_queue: cannot read notebook {path!r}: {exc}\n")
        raise SystemExit(2) from None
    if code is None:
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            sys.stderr.write(f"tq_async.transfer_queue: cannot open program {path!r}: {exc}\n")
            raise SystemExit(2) from None
    install()
    sys.argv = list(argv)
    if code is None:
        runpy.run_path(path, run_name="__main__")
    else:
        namespace: dict[str, Any] = {"__name__": "__main__", "__file__": path}
        exec(compile(code, path, "exec"), namespace)


def notebook_code(path: str) -> str:
    """The code cells of the notebook at ``path``, in order, as one program (lines of IPython
    magics and shell escapes, ``%...`` and ``!...``, left out: plain Python runs them not).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a notebook (JSON with a list of cells).
    """
    with open(path, encoding="utf-8") as f:
        document = json.load(f)
    cells = document.get("cells") if isinstance(document, dict) else None
    if not isinstance(cells, list):
        raise ValueError("not a Jupyter notebook (no list of cells)")
    sources = []
    for cell in cells:
        if isinstance(cell, dict) and cell.get("cell_type") == "code":
            source = cell.get("source", "")
            text = "".join(source) if isinstance(source, list) else str(source)
            lines = text.splitlines()
            sources.append("\n".join(x for x in lines if not x.lstrip().startswith(("%", "!"))))
    return "\n\n".join(sources) + "\n"


if __name__ == "__main__":
    main(sys.argv[1:])
