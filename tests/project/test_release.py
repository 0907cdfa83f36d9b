"""The release: ``python -m build`` makes a wheel and an sdist that ``twine check`` accepts,
and the wheel installed into a fresh virtualenv runs the README's 20-line example.

Offline and quick (~30-60 s): the build runs without isolation (the dev environment's
setuptools), the fresh venv has no pip and sees this environment's packages for the
dependencies (a ``.pth`` file), and the wheel is installed with ``--no-deps --no-index``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

import tq_async

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _project_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def _readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## A 20-line example", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found is not None, "README: no python block under 'A 20-line example'"
    return found.group(1)


def test_version_is_the_installed_distributions() -> None:
    assert tq_async.__version__ == importlib.metadata.version("tq_async")


def test_version_of_a_source_tree_never_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert tq_async._version() == "0+unknown"


def _run(*argv: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, f"{argv}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.timeout(420)
def test_the_built_wheel_installs_and_runs_the_readme_example(tmp_path: Path) -> None:
    pytest.importorskip("build", reason="the dev extra's `build` builds the release")
    pytest.importorskip("twine", reason="the dev extra's `twine` checks the release")
    # a copy of what the sdist is made of: the build writes build/ and *.egg-info next to it
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(
        ROOT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, project, cwd=tmp_path)
    version = _project_version()
    wheel = dist / f"tq_async-{version}-py3-none-any.whl"
    sdist = dist / f"tq_async-{version}.tar.gz"
    assert sorted(dist.iterdir()) == sorted([wheel, sdist])
    checked = _run(sys.executable, "-m", "twine", "check", "--strict", wheel, sdist, cwd=tmp_path)
    assert checked.count("PASSED") == 2, checked

    # a fresh venv: the wheel in its own site-packages, the dependencies from this environment
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, symlinks=os.name != "nt")
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    own = Path(
        _run(
            python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path
        ).strip()
    )
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (own / "_tq_release_test_deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    _run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "--no-deps",
        "--no-index",
        "--quiet",
        wheel,
        cwd=tmp_path,
    )

    script = tmp_path / "readme_example.py"
    script.write_text(
        _readme_example()
        + "\nimport tq_async\nprint('FILE', tq_async.__file__)\n"
        + "print('VERSION', tq_async.__version__)\n"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = _run(python, "-I", script, cwd=tmp_path, env=clean).splitlines()
    # the installed wheel ran, not the source tree
    assert Path(out[-2].removeprefix("FILE ")).is_relative_to(own / "tq_async"), out[-2]
    assert out[-1] == f"VERSION {version}"
    assert out[0].startswith("[0, 1, 2, 3] tensor(")
    assert out[1].startswith("[4, 5, 6, 7] tensor(")
