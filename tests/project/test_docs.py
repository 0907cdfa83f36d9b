"""The code in README.md and docs/*.md runs as written, on loopback.

Rules (no list of exceptions):

- ``python`` blocks run in a fresh process (top-level ``await`` allowed), forked from an
  interpreter that imported what they all import; ``bash`` / ``sh``
  blocks run with ``bash -eu``; ``console`` blocks are transcripts: each ``$ command`` runs
  and its output must match the lines below it (any run of digits matches any other). A
  command whose transcript starts with ``TQ_ADDRESS=`` is a service: it runs until it prints
  that line, then is stopped with SIGTERM and must exit with status 0.
- ``toml`` blocks must be valid ``tq.Config`` files.
- The blocks of one file run in order, in one temporary directory (so a block can use the
  files and the services an earlier one started; services started in the background with
  ``&`` are stopped after the file's last block).
- A block whose first line is a comment starting with ``not run`` (``# not run: why``) is not
  run: the marker is visible to readers too.
"""

from __future__ import annotations

import os
import re
import select
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import tq_async as tq

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"python", "bash", "sh", "console", "toml"}
NOT_RUN = re.compile(r"^\s*#\s*not run\b", re.IGNORECASE)
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")

#: runs a python block with top-level await allowed
RUNNER = """
import ast, asyncio, inspect, sys
path = sys.argv[1]
code = compile(open(path).read(), path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
namespace = {"__name__": "__main__"}
if code.co_flags & inspect.CO_COROUTINE:
    asyncio.run(eval(code, namespace))
else:
    exec(code, namespace)
"""

#: forks a process per python block that then runs RUNNER as its program (own namespace and
#: process group, exit status, atexit): a fresh interpreter spends ~4 s of CPU importing torch,
#: tensordict and tq_async before a block's first line, once here for all the blocks
FORKER = (
    """
import os, sys
import anyio, tensordict, torch, tq_async
for request in sys.stdin:
    script, log, cwd = request.rstrip("\\n").split("\\0")
    pid = os.fork()
    if pid == 0:
        break
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
else:
    sys.exit(0)
os.setsid()
os.chdir(cwd)
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(out, 1)
os.dup2(out, 2)
sys.argv = ["-c", script]
"""
    + RUNNER
)


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    text: str

    @property
    def skipped(self) -> bool:
        first = next((line for line in self.text.splitlines() if line.strip()), "")
        return bool(NOT_RUN.match(first))

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> Iterator[Block]:
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        indent = len(fence["indent"])
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not FENCE.match(lines[j]):
            body.append(lines[j][indent:])
            j += 1
        yield Block(path, i + 1, fence["lang"], "\n".join(body) + "\n")
        i = j + 1


def env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }


def same(expected: str, actual: str) -> bool:
    """Lines equal, except that any run of digits matches any other."""
    pattern = re.escape(expected.strip())
    pattern = re.sub(r"\d+", r"\\d+", pattern.replace(r"\ ", " "))
    return re.fullmatch(pattern, actual.strip()) is not None


class Forker:
    """The FORKER interpreter, started on first use: a process of its own per python block."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen[str] | None = None

    def start(self, script: Path, log: Path, cwd: Path) -> int:
        """The pid of a new process running ``script`` in ``cwd``, output to ``log``; 0 when
        the forker is gone."""
        if self.proc is None:
            with self.log.open("w") as err:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", FORKER],
                    cwd=self.log.parent,
                    env=env(),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                )
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(f"{script}\0{log}\0{cwd}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        return int(line) if line else 0

    def exit_code(self) -> int:
        """The exit status of the process last started, once it is gone."""
        assert self.proc is not None
        assert self.proc.stdout is not None
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            assert self.proc.stdout is not None
            self.proc.stdin.close()  # it exits
            self.proc.wait(timeout=30)
            self.proc.stdout.close()


class Session:
    """One file's blocks: a working directory and the process groups they left running."""

    def __init__(self, workdir: Path, forker: Forker) -> None:
        self.workdir = workdir
        self.groups: list[int] = []
        self.forker = forker

    def close(self) -> None:
        """Stop what the blocks left running (each block ran in its own process group)."""
        for pgid in self.groups:
            members = _group_members(pgid)
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for pid in members:
                _wait_gone(pid, timeout=20)

    def run(self, block: Block) -> None:
        if block.lang == "toml":
            tq.Config.from_toml_string(block.text, source=str(block))
        elif block.lang == "python":
            script = self.workdir / f"block_{block.line}.py"
            script.write_text(block.text)
            self.python(block, script)
        elif block.lang in ("bash", "sh"):
            self.check(block, ["bash", "-euc", block.text])
        else:
            self.console(block)

    def check(self, block: Block, argv: list[str]) -> str:
        # output to a file, not a pipe: a service left in the background keeps its end open
        log = self.workdir / f"block_{block.line}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                argv,
                cwd=self.workdir,
                env=env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # what it leaves in the background is stopped later
            )
        self.groups.append(proc.pid)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            pytest.fail(f"{block} did not finish in 120 s:\n{log.read_text()}")
        assert code == 0, f"{block} failed ({code}):\n{log.read_text()}"
        return log.read_text()

    def python(self, block: Block, script: Path) -> None:
        """Run ``script`` as ``python -c RUNNER script`` would, in a process of the forker's."""
        log = self.workdir / f"block_{block.line}.log"
        pid = self.forker.start(script, log, self.workdir)
        if not pid:
            pytest.fail(f"the forker exited before {block}:\n{self.forker.log.read_text()}")
        self.groups.append(pid)
        if not _wait_gone(pid, timeout=120):
            self.forker.exit_code()
            pytest.fail(f"{block} did not finish in 120 s:\n{log.read_text()}")
        code = self.forker.exit_code()
        assert code == 0, f"{block} failed ({code}):\n{log.read_text()}"

    def console(self, block: Block) -> None:
        commands: list[tuple[str, list[str]]] = []
        pending = ""
        for line in block.text.splitlines():
            if pending:  # a command continued with a trailing backslash
                pending += "\n" + line
                if not line.endswith("\\"):
                    commands.append((pending, []))
                    pending = ""
            elif line.startswith("$ "):
                if line.endswith("\\"):
                    pending = line[2:]
                else:
                    commands.append((line[2:], []))
            elif line.strip() and commands:
                commands[-1][1].append(line)
        for command, expected in commands:
            if expected and expected[0].startswith("TQ_ADDRESS="):
                self.service(block, command, expected[0])
                continue
            done = subprocess.run(
                ["bash", "-c", command],
                cwd=self.workdir,
                env=env(),
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            got = (done.stdout + done.stderr).strip().splitlines()
            assert len(got) == len(expected), f"{block}: `{command}` printed {got}"
            for want, line in zip(expected, got, strict=True):
                assert same(want, line), f"{block}: `{command}` printed {line!r}, not {want!r}"

    def service(self, block: Block, command: str, first_line: str) -> None:
        proc = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=self.workdir,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.groups.append(proc.pid)
        assert proc.stdout is not None
        try:
            deadline = time.monotonic() + 60
            with selectors.DefaultSelector() as sel:
                sel.register(proc.stdout, selectors.EVENT_READ)
                while not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    if time.monotonic() > deadline:
                        pytest.fail(f"{block}: `{command}` printed nothing in 60 s")
            line = proc.stdout.readline()
            assert same(first_line, line), f"{block}: `{command}` printed {line!r}"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, f"{block}: `{command}` did not stop cleanly"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            proc.stdout.close()


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    members.append(int(entry))
            except (ProcessLookupError, PermissionError):
                continue
    return members


def _wait_gone(pid: int, timeout: float) -> bool:
    """Wait (on a pidfd: no polling) until ``pid`` exits; SIGKILL it after ``timeout``.

    Returns whether it exited within ``timeout``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        if not select.select([fd], [], [], timeout)[0]:
            os.kill(pid, signal.SIGKILL)
            return False
        return True
    finally:
        os.close(fd)


def all_blocks() -> list[Block]:
    return [b for path in FILES for b in blocks(path) if b.lang in RUNNABLE]


def test_every_shell_and_python_block_is_run_or_marked() -> None:
    found = all_blocks()
    assert {b.path.name for b in found} >= {"README.md", "deployment.md"}
    for block in found:
        if block.lang in ("bash", "console") and re.search(r"\b10\.\d+\.\d+\.\d+", block.text):
            assert block.skipped, f"{block} uses other hosts' addresses: mark it `# not run`"


@pytest.fixture(scope="module")
def forker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Forker]:
    shared = Forker(tmp_path_factory.mktemp("forker") / "forker.log")
    yield shared
    shared.close()


def runnable(path: Path) -> list[Block]:
    return [b for b in blocks(path) if b.lang in RUNNABLE and not b.skipped]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "path", [p for p in FILES if runnable(p)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_the_code_in_the_docs_runs(path: Path, tmp_path: Path, forker: Forker) -> None:
    session = Session(tmp_path, forker)
    try:
        for block in runnable(path):
            session.run(block)
    finally:
        session.close()


def test_python_blocks_also_run_when_pasted_into_a_file() -> None:
    """No top-level ``await`` / ``async with``: a reader's file would not even compile."""
    for block in all_blocks():
        if block.lang == "python" and not block.skipped:
            try:
                compile(block.text, str(block), "exec")
            except SyntaxError as exc:
                pytest.fail(f"{block}: {exc.msg} (wrap it in `async def main()` + anyio.run)")


def test_every_page_has_its_own_title() -> None:
    pages = sorted((ROOT / "docs").glob("*.md"))
    titles = {path.name: path.read_text().splitlines()[0] for path in pages}
    assert all(t.startswith("# ") for t in titles.values()), titles
    assert len(set(titles.values())) == len(titles), titles


#: files the docs name that live in the repository (folders searched, in order)
_NAMED_FILE = re.compile(r"(?<![\w/.:-])([\w./-]*[A-Za-z_]\w*\.(?:md|toml|py))\b")
#: files the pages name that are not ours: the reader's own program, and TransferQueue's
#: tutorials and recipes (docs/migrating.md goes through them program by program)
_OTHERS_FILE = re.compile(r"^(program\.py|tutorial/\w+\.py|recipe/[\w/]+\.py|relax_demo\.py)$")


def _prose(path: Path) -> str:
    """The text of a page outside its code blocks (blocks may name files they create)."""
    out, inside = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            out.append(line)
    return "\n".join(out)


def test_the_files_the_docs_name_exist() -> None:
    places = [ROOT, *(ROOT / d for d in ("docs", "src/tq_async", "src", "benchmarks", "examples"))]
    missing = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in FILES
        for name in sorted(set(_NAMED_FILE.findall(_prose(path))))
        if not _OTHERS_FILE.match(name) and not any((place / name).exists() for place in places)
    ]
    assert not missing, missing


#: reStructuredText that the API reference's renderer (mkdocstrings, Markdown) shows raw
RAW_MARKUP = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj):[`~\w]|\S::\s*$", re.M)


def test_the_rendered_api_reference_shows_no_raw_sphinx_markup(tmp_path: Path) -> None:
    """Docstrings are written in the style the renderer understands: a role such as
    ``:meth:`open``` or a literal-block ``::`` would appear verbatim on the built site."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    done = subprocess.run(
        [str(mkdocs), "build", "--quiet", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    raw = []
    for page in sorted((tmp_path / "site").rglob("*.html")):
        text = re.sub(r"<[^>]+>", "", page.read_text())  # what a reader sees
        raw += [f"{page.name}: {m.group(0)!r}" for m in RAW_MARKUP.finditer(text)]
    assert not raw, f"{len(raw)} raw markups, first: {raw[:10]}"


def test_the_raw_markup_finder_finds_roles_and_literal_markers() -> None:
    assert RAW_MARKUP.search("see :meth:`open` first")
    assert RAW_MARKUP.search("see :class:~tq_async.Client (rendered)")
    assert RAW_MARKUP.search("Usage::\n")
    assert not RAW_MARKUP.search("see `open` first, a[::2], Usage:\n")
