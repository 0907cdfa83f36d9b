"""``tq-async --version`` and help texts: plain text, every option described, defaults shown."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import tq_async as tq

COMMANDS = [[], ["serve"], ["serve", "controller"], ["serve", "storage"]]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tq_async._deploy._cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_version() -> None:
    done = run("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"tq-async {tq.__version__}"


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_is_plain_text_and_describes_every_option(command: list[str]) -> None:
    done = run(*command, "--help")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    for markup in ("``", "::", ":class:", ":func:", "<BLANKLINE>"):
        assert markup not in text, markup
    # every option has a description: the option's line, or the next one, has words
    lines = text.splitlines()
    checked = 0
    for i, line in enumerate(lines):
        match = re.match(r"^  (-[-\w]+(?:, --[-\w]+)?)(?: [^ ]+)?(?:  +(.*))?$", line)
        if match is None:
            continue
        description = match.group(2) or (lines[i + 1].strip() if i + 1 < len(lines) else "")
        assert re.search(r"[a-z]{3}", description), f"{match.group(1)} is not described"
        checked += 1
    assert checked >= (2 if not command else 10)


def test_help_shows_the_defaults() -> None:
    text = run("serve", "--help").stdout
    for default in (
        "(default: 2)",
        "(default: 127.0.0.1",
        "(default: tcp://127.0.0.1:0",
        "(default: info)",
        "(default: partition)",
        "(default: unbounded)",
    ):
        assert default in " ".join(text.split()), default
    storage = " ".join(run("serve", "storage", "--help").stdout.split())
    assert "(default: 30)" in storage
    assert "(default: the controller assigns one)" in storage


def test_serve_help_shows_the_role_as_optional() -> None:
    text = run("serve", "--help").stdout
    usage = " ".join(text.split("\n\n")[0].split())
    assert usage.endswith("[ROLE] ...")  # `tq-async serve` alone runs every service
    assert "roles (optional)" in text
    assert "(default: 30)" in " ".join(text.split())  # --waiting-warning-after


def test_the_deployment_guide_names_every_option_of_serve() -> None:
    """`docs/deployment.md`'s "Options:" paragraph of `tq-async serve` names each of its
    options (before, it left out seven of them; `--help` had them)."""
    text = run("serve", "--help").stdout
    usage = text.split("\n\n")[0]
    options = set(re.findall(r"\[(--[a-z-]+)", usage))
    assert len(options) > 20
    guide = (Path(__file__).resolve().parents[2] / "docs" / "deployment.md").read_text()
    paragraph = guide.split("Options: ", 1)[1].split("\n\n", 1)[0]
    missing = sorted(o for o in options if f"`{o}" not in paragraph and o != "--help")
    assert not missing, missing
