"""A cluster spread over "hosts": network namespaces on this machine joined by a private bridge.

Layout (all inside namespaces this test creates and always removes; nothing is configured in
the host's own network namespace, and no traffic leaves the bridge)::

    <p>sw: bridge br0 ── v1 ── <p>h1 eth0 10.77.0.1  controller (binds 0.0.0.0, --advertise)
                     ├── v2 ── <p>h2 eth0 10.77.0.2  storage unit 0 (binds its IP)
                     ├── v3 ── <p>h3 eth0 10.77.0.3  storage unit 1 (binds 0.0.0.0, publishes
                     │                                the IP on its route to the controller)
                     └── v4 ── <p>h4 eth0 10.77.0.4  client (this file run as a script)

Every socket is CURVE-encrypted with an allow-list, as a real multi-host deployment should be.
Skipped when the sandbox cannot build namespaces (not root, no ``ip``, no netns support).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from _netns import Lab, script_env, why_not


@pytest.fixture
def lab() -> Iterator[Lab]:
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    lab = Lab(f"tq{os.getpid() % 100000}")
    try:
        lab.build()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        lab.destroy()
        detail = getattr(exc, "stderr", "") or exc
        pytest.skip(f"this sandbox cannot build network namespaces: {detail}")
    try:
        yield lab
    finally:
        lab.destroy()


def _certificates(tmp_path: Path) -> tuple[str, str, str]:
    """A service certificate, a client certificate and a directory of allowed client keys."""
    import zmq.auth

    keys = tmp_path / "keys"
    allowed = tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    _, service_secret = zmq.auth.create_certificates(keys, "service")
    client_public, client_secret = zmq.auth.create_certificates(keys, "client")
    shutil.copy(client_public, allowed)
    return service_secret, client_secret, str(allowed)


def test_cluster_across_network_namespaces(lab: Lab, tmp_path: Path) -> None:
    from _services import START_TIMEOUT, parse_unit, service

    service_cert, client_cert, allowed = _certificates(tmp_path)
    curve = ["--curve-cert", service_cert, "--curve-allow", allowed]
    with ExitStack() as stack:
        ctl = stack.enter_context(
            service(
                ["controller", "--bind", "tcp://0.0.0.0:5555", "--advertise", lab.ip("h1"), *curve],
                tmp_path / "ctl.err",
                lab.exec_prefix("h1"),
            )
        )
        address = ctl.wait_line("TQ_ADDRESS=")
        assert address == f"tcp://{lab.ip('h1')}:5555"
        # CURVE with an allow-list: no "anyone can read and write" warning
        assert "anyone who can reach it" not in ctl.stderr()

        binds = {"h2": f"tcp://{lab.ip('h2')}:0", "h3": "tcp://0.0.0.0:7000"}
        units = {
            host: stack.enter_context(
                service(
                    [
                        "storage",
                        "--controller",
                        address,
                        "--bind",
                        bind,
                        "--unit-id",
                        str(i),
                        *curve,
                    ],
                    tmp_path / f"{host}.err",
                    lab.exec_prefix(host),
                )
            )
            for i, (host, bind) in enumerate(binds.items())
        }
        registered = {host: parse_unit(u.wait_line("TQ_UNIT=")) for host, u in units.items()}
        assert registered["h2"][0] == 0
        assert registered["h2"][1].startswith(f"tcp://{lab.ip('h2')}:")
        # a wildcard bind publishes the unit's address on its route to the controller
        assert registered["h3"] == (1, f"tcp://{lab.ip('h3')}:7000")

        client = subprocess.run(
            [*lab.exec_prefix("h4"), sys.executable, __file__, address, service_cert, client_cert],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT + 30,
            env=script_env({**os.environ, "OMP_NUM_THREADS": "1"}),
        )
        assert client.returncode == 0, client.stderr
        assert client.stdout.strip().splitlines()[-1] == "OK 32 rows on units [0, 1]"

        for svc in (*units.values(), ctl):
            assert svc.stop() == 0


def _client_main(address: str, service_cert: str, client_cert: str) -> None:
    """Run in namespace h4: put 4 batches, read them back, check both units were used."""
    import anyio
    import torch
    import zmq.auth
    from tensordict import TensorDict

    import tq_async as tq

    server_public, _ = zmq.auth.load_certificate(service_cert)
    public, secret = zmq.auth.load_certificate(client_cert)
    assert secret is not None
    curve = tq.CurveClient(server_public, public, secret)

    async def run() -> None:
        async with tq.AsyncClient.connect(address, curve=curve, request_timeout=30) as client:
            for k in range(4):
                td = TensorDict({"x": torch.arange(k * 8, (k + 1) * 8)}, batch_size=[8])
                await client.put(td, partition_id="p")
            td, meta = await client.get(["x"], 32, "p", "t", timeout=30)
            assert sorted(td["x"].tolist()) == list(range(32)), td["x"].tolist()
            print(f"OK {len(meta)} rows on units {sorted(set(meta.units))}", flush=True)

    anyio.run(run)


if __name__ == "__main__":
    _client_main(*sys.argv[1:4])
