"""The controller's get_meta walk: which modules one request passes through (issue 35).

One ``get_meta`` with a lease, rows ready, handled by a `ControllerServer` in this process
(no sockets); every call from one module of ``tq_async`` into another is counted
(``sys.setprofile``). Prints the crossings and the ones the issue names: from the core's get
path into the partition state (``_state``, and the ready sets and views split from it), and
from the shell back into the core after deciding.

    python -m benchmarks.walk [--json PATH]

Run against another tree with ``PYTHONPATH=<tree>/src`` (the flat layout before the folders,
``65a7cfa~1``, is understood too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from types import FrameType
from typing import Any

#: the modules of the partition state: the state and what was split from it
STATE = ("_state.py", "_ready.py", "_views.py")


def _module(path: str) -> str | None:
    marker = "/tq_async/"
    return path[path.index(marker) + len(marker) :] if marker in path else None


def _imports() -> tuple[Any, Any, Any, Any, Any]:
    try:
        from tq_async._controller._server import ControllerServer
        from tq_async._core._state import ControllerState
        from tq_async._service._loop import Incoming
        from tq_async._wire._columns import ColumnHeader
        from tq_async._wire._protocol import GetMeta
    except ImportError:  # the flat tree
        from tq_async._columns import ColumnHeader  # type: ignore[no-redef]
        from tq_async._protocol import GetMeta  # type: ignore[no-redef]
        from tq_async._state import ControllerState  # type: ignore[no-redef]

        from tq_async._controller import ControllerServer  # type: ignore[no-redef]
        from tq_async._service import Incoming  # type: ignore[no-redef]
    return ControllerServer, ControllerState, Incoming, ColumnHeader, GetMeta


async def walk() -> list[tuple[str, str, str, str]]:
    """``(caller module, caller function, callee module, callee function)`` of every call
    crossing modules while the controller handles one get_meta with a lease."""
    server_cls, state_cls, incoming, header, get_meta = _imports()
    x = header("x", "dense", "int64", ())
    server = server_cls(state_cls({0: "inproc://u0"}))
    core = server.core
    now = asyncio.get_running_loop().time()
    placement, _ = core.put_begin("p", [x], 64, None, None, now)
    core.put_commit("p", placement.rows, ["x"], None, None, placement.put_id)
    handler = server.handlers[get_meta]
    # warm: the ready sets are built, the sampler's first call made
    handler(incoming(b"c", 1, [], 0.0), get_meta("p", ["x"], 4, "w", None, lease=30.0))
    handler(incoming(b"c", 2, [], 0.0), get_meta("p", ["x"], 4, "t", None, timeout=0))
    request = get_meta("p", ["x"], 4, "t", None, lease=30.0)
    calls: list[tuple[str, str, str, str]] = []

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee, caller = _module(frame.f_code.co_filename), _module(frame.f_back.f_code.co_filename)
        if callee and caller and callee != caller:
            calls.append((caller, frame.f_back.f_code.co_name, callee, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        handler(incoming(b"c", 3, [], 0.0), request)
    finally:
        sys.setprofile(None)
    return calls


def summary(calls: list[tuple[str, str, str, str]]) -> dict[str, Any]:
    def in_state(module: str) -> bool:
        return module.rsplit("/", 1)[-1] in STATE

    def in_core(module: str) -> bool:
        return module in ("_core.py", "_core/_gets.py", "_core/_transitions.py")

    into_state = [c for c in calls if in_state(c[2]) and not in_state(c[0])]
    pairs = sorted(Counter((c[0], c[2]) for c in calls).items())
    return {
        "modules": len({m for c in calls for m in (c[0], c[2])}),
        "crossings": len(calls),
        "core_into_state": sum(1 for c in into_state if in_core(c[0])),
        "sampler_into_state": sum(1 for c in into_state if c[0].startswith("samplers/")),
        "into_state": len(into_state),
        "by_pair": {f"{a} -> {b}": n for (a, b), n in pairs},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.walk", description=__doc__)
    parser.add_argument("--json", dest="json_path", help="also write the figures here")
    args = parser.parse_args(argv)
    calls = asyncio.run(walk())
    out = summary(calls)
    for caller, fn, callee, callee_fn in calls:
        print(f"  {caller}:{fn} -> {callee}:{callee_fn}")
    print(json.dumps(out, indent=2))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out | {"calls": calls}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
