"""Network namespaces on this machine joined by a private bridge: "hosts" for the multihost
and NIXL tests (``tests/programs/test_multihost.py`` draws the layout)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

#: this folder: a test module run as a script in a namespace finds these helpers on it
TESTS = Path(__file__).resolve().parent

SUBNET = "10.77.0"
HOSTS = ("h1", "h2", "h3", "h4")


class Lab:
    """Network namespaces named ``<prefix>sw`` / ``<prefix>h1``... and their cleanup."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.created: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.prefix}{host}"

    def ip(self, host: str) -> str:
        return f"{SUBNET}.{HOSTS.index(host) + 1}"

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def _run(self, *argv: str) -> None:
        subprocess.run(["ip", *argv], check=True, capture_output=True, text=True, timeout=30)

    def build(self) -> None:
        switch = self.ns("sw")
        self._run("netns", "add", switch)
        self.created.append(switch)
        self._run("-n", switch, "link", "add", "br0", "type", "bridge")
        self._run("-n", switch, "link", "set", "br0", "up")
        for i, host in enumerate(HOSTS, start=1):
            ns = self.ns(host)
            self._run("netns", "add", ns)
            self.created.append(ns)
            # both ends are created inside namespaces: the host's own stack is never touched
            self._run(
                "-n", switch, "link", "add", f"v{i}", "type", "veth", "peer", "eth0", "netns", ns
            )
            self._run("-n", switch, "link", "set", f"v{i}", "master", "br0")
            self._run("-n", switch, "link", "set", f"v{i}", "up")
            self._run("-n", ns, "addr", "add", f"{self.ip(host)}/24", "dev", "eth0")
            self._run("-n", ns, "link", "set", "eth0", "up")
            self._run("-n", ns, "link", "set", "lo", "up")

    def destroy(self) -> None:
        for ns in reversed(self.created):
            # Only processes this test started live in these namespaces; end any left over so
            # the namespace really goes away.
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30
            ).stdout.split()
            for pid in pids:
                with suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.created.clear()


def why_not() -> str | None:
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    return None


def script_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this folder first on ``PYTHONPATH``, for a test module run as a script (its
    own folder is on ``sys.path`` then, not this one)."""
    paths = [str(TESTS), *filter(None, [env.get("PYTHONPATH")])]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}
