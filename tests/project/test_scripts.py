"""scripts/_install: the install of scripts/check and scripts/run-example is skipped when
nothing changed (a stamp of the Python version, the extras, pyproject.toml and
constraints.txt), and torch always goes first, exactly 2.13.0."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for .venv/bin/python: records what it was asked to do
if [ "$1" = "--version" ]; then echo "Python 3.11.9"; exit 0; fi
echo "$*" >> "$(dirname "$0")/../calls.log"
"""


def install(root: Path, extras: str) -> list[str]:
    """Run install_into_venv in ``root``; the pip commands it ran."""
    log = root / ".venv" / "calls.log"
    log.unlink(missing_ok=True)
    subprocess.run(
        ["bash", "-c", f'set -euo pipefail; source scripts/_install; install_into_venv "{extras}"'],
        cwd=root,
        check=True,
        timeout=30,
    )
    return log.read_text().splitlines() if log.exists() else []


def _project(root: Path) -> None:
    """``root``: the files scripts/_install reads, and a fake .venv/bin/python."""
    (root / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "_install", root / "scripts" / "_install")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copy(REPO / "constraints.txt", root / "constraints.txt")
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)


def test_the_install_is_skipped_when_nothing_changed(tmp_path: Path) -> None:
    _project(tmp_path)
    first = install(tmp_path, "dev,docs")
    assert first == [
        "-m pip install -q --upgrade pip",
        "-m pip install -q torch==2.13.0",
        "-m pip install -q -c constraints.txt -e .[dev,docs]",
    ]
    assert install(tmp_path, "dev,docs") == []  # nothing changed: no pip at all
    assert len(install(tmp_path, "examples")) == 3  # other extras: their own stamp
    with (tmp_path / "constraints.txt").open("a") as f:
        f.write("# changed\n")
    assert install(tmp_path, "dev,docs") == first


def test_the_install_says_what_it_installs_and_how_long_it_takes(tmp_path: Path) -> None:
    _project(tmp_path)

    def printed() -> str:
        return subprocess.run(
            ["bash", "-c", 'set -euo pipefail; source scripts/_install; install_into_venv "dev"'],
            cwd=tmp_path,
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout

    out = printed()
    assert "usually ~70 s" in out
    assert "torch 2.13.0, the CPU build" in out
    assert "[dev]" in out
    assert "==> installed in " in out
    assert printed() == ""  # nothing changed: nothing to say


def test_the_check_runs_the_tests_on_every_core_and_passes_arguments_on() -> None:
    check = (REPO / "scripts" / "check").read_text()
    assert '.venv/bin/pytest -n auto --dist loadgroup "$@"' in check


def test_the_constraints_pin_the_cpu_torch_and_the_project_only_has_lower_bounds() -> None:
    constraints = (REPO / "constraints.txt").read_text().splitlines()
    assert any(line.split(";")[0].strip() == "torch==2.13.0" for line in constraints)
    assert not [line for line in constraints if "nvidia" in line or "+cu" in line]
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        assert "==" not in requirement, requirement
        assert ">=" in requirement, requirement


def test_the_readme_names_the_extras_scripts_check_installs() -> None:
    """README's quick start says what ``./scripts/check`` installs: every extra it passes."""
    script = (REPO / "scripts" / "check").read_text()
    (extras,) = re.findall(r'^install_into_venv "([\w,]+)"$', script, re.MULTILINE)
    (line,) = [
        x for x in (REPO / "README.md").read_text().splitlines() if x.startswith("./scripts/check ")
    ]
    assert [e for e in extras.split(",") if not re.search(rf"\b{e}\b", line)] == []
