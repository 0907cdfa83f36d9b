"""Generate the blocking client from the asynchronous one (httpcore's ``unasync`` approach).

The client's logic is written once, as async code; each module of ``_client/_async/`` listed
in ``FILES`` gets a blocking twin of the same name in ``_client/_sync/``, rewritten token by
token: ``async def`` -> ``def``, ``await x`` -> ``x``, ``async with`` -> ``with``, ``AsyncClient``
-> ``Client``, the event-loop connection
(``_dealer.DealerConnection``) -> the calling-thread one (``_sync_dealer.BlockingConnection``),
the async primitives (``_primitives``) -> their blocking twins (``_sync_primitives``), and so
on (``REPLACEMENTS``). Lines between ``# unasync: async-only`` and ``# unasync: end`` are
dropped from the twin. The output is then formatted by ruff, so a twin is plain code that
mypy --strict checks like any other module.

Usage::

    python scripts/unasync.py          # rewrite the twins
    python scripts/unasync.py --check  # fail (exit 1) if a twin is not what the source gives

``tests/client/test_sync_parity.py`` runs the check: a change to the async client that is not
carried to its twin fails CI.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "tq_async"
RUFF = pathlib.Path(sys.executable).parent / "ruff"

#: async source -> its blocking twin (in src/tq_async)
FILES = {
    f"_client/_async/{name}.py": f"_client/_sync/{name}.py"
    for name in (
        "_base",
        "_get",
        "_put",
        "_calls",
        "_nixl_links",
        "_device_links",
        "_device_puts",
        "_client",
        "_checkpoint",
        "_watch",
        "_feeds",
        "_query",
        "_replies",
        "_same_host",
        "_slots",
    )
}

#: whole-word replacements, applied in this order
REPLACEMENTS = [
    (r"\b_client\._async\b", "_client._sync"),
    (r"\._dealer\b", "._sync_dealer"),
    (r"\._primitives\b", "._sync_primitives"),
    (r"\bDealerConnection\b", "BlockingConnection"),
    (r"\bAsyncClient\b", "Client"),
    (r"\bto_device\b", "to_device_now"),
    (r"\bto_host\b", "to_host_now"),
    (r"\bstage_frames\b", "stage_frames_now"),
    (r"\bread_onto_async\b", "read_onto"),
    (r"\bcopy_frames\b", "copy_frames_now"),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\b__aiter__\b", "__iter__"),
    (r"\b__anext__\b", "__next__"),
    (r"\bStopAsyncIteration\b", "StopIteration"),
    (r"\ban async iterator\b", "an iterator"),
    (r"\baclose\b", "close"),
    (r"\ban async context manager\b", "a context manager"),
    (r"\basync with\b", "with"),
    (r"\basync for\b", "for"),
    (r"\basync def\b", "def"),
    (r"\bawait ", ""),
    (r"\bawaited\b", "called"),
]

_ASYNC_ONLY = re.compile(r"^[ \t]*# unasync: async-only\n.*?^[ \t]*# unasync: end\n", re.M | re.S)


def _drop_awaitable(text: str) -> str:
    """``Awaitable[X]`` -> ``X`` (brackets matched, so X may hold brackets itself)."""
    out = []
    pos = 0
    while (i := text.find("Awaitable[", pos)) >= 0:
        if i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_"):
            out.append(text[pos : i + 10])
            pos = i + 10
            continue
        out.append(text[pos:i])
        depth, j = 1, i + len("Awaitable[")
        while depth:
            depth += {"[": 1, "]": -1}.get(text[j], 0)
            j += 1
        out.append(text[i + len("Awaitable[") : j - 1])
        pos = j
    out.append(text[pos:])
    return "".join(out)


def _ruff(args: list[str], text: str, name: str) -> str:
    done = subprocess.run(
        [str(RUFF), *args, "--stdin-filename", str(PACKAGE / name), "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if done.returncode not in (0, 1) or not done.stdout:
        raise SystemExit(f"ruff {' '.join(args)} failed on {name}: {done.stderr}")
    return done.stdout


def generate(source: str, target: str) -> str:
    """The blocking twin of ``source`` (a file name in src/tq_async)."""
    text = (PACKAGE / source).read_text()
    text = _ASYNC_ONLY.sub("", text)
    for pattern, repl in REPLACEMENTS:
        text = re.sub(pattern, repl, text)
    text = _drop_awaitable(text)
    header = (
        f"# Generated from src/tq_async/{source} by scripts/unasync.py:\n"
        f"# do not edit; change the source and run `python scripts/unasync.py`.\n"
    )
    text = header + text
    text = _ruff(["check", "--fix", "--quiet", "--exit-zero"], text, target)
    return _ruff(["format", "--quiet"], text, target)


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for source, target in FILES.items():
        want = generate(source, target)
        path = PACKAGE / target
        if path.exists() and path.read_text() == want:
            continue
        if check:
            stale.append(target)
        else:
            path.write_text(want)
            print(f"wrote src/tq_async/{target}")
    if stale:
        print(
            "out of date (run `python scripts/unasync.py`): " + ", ".join(stale),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
