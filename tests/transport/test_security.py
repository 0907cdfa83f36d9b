"""CURVE: encrypted sockets, only allowed client keys get in; loopback by default."""

from __future__ import annotations

import pytest
import torch

import tq_async as tq


async def test_curve_admits_only_allowed_clients() -> None:
    server_public, server_secret = tq.curve_keypair()
    good_public, good_secret = tq.curve_keypair()
    bad_public, bad_secret = tq.curve_keypair()
    server = tq.CurveServer(server_public, server_secret, allowed_clients=[good_public])
    async with tq.local_cluster(num_storage_units=2, curve=server) as cluster:
        good = tq.CurveClient(server_public, good_public, good_secret)
        async with tq.AsyncClient.connect(cluster.address, curve=good) as client:
            meta = await client.put({"x": torch.arange(4)}, "p")
            assert (await client.get_data(meta))["x"].tolist() == [0, 1, 2, 3]
            await client.clear_partition("p")  # the controller reaches the units with CURVE too
        unknown = tq.CurveClient(server_public, bad_public, bad_secret)
        # refused handshakes surface as a broken connection (or, at worst, the timeout)
        with pytest.raises((tq.BrokenError, tq.TQTimeoutError)):
            async with tq.AsyncClient.connect(cluster.address, curve=unknown, request_timeout=0.3):
                pass
        with pytest.raises((tq.BrokenError, tq.TQTimeoutError)):  # no keys: no handshake
            async with tq.AsyncClient.connect(cluster.address, request_timeout=0.3):
                pass


async def test_curve_without_an_allow_list_still_encrypts() -> None:
    server_public, server_secret = tq.curve_keypair()
    client_public, client_secret = tq.curve_keypair()
    server = tq.CurveServer(server_public, server_secret)
    async with (
        tq.local_cluster(num_storage_units=1, curve=server) as cluster,
        tq.AsyncClient.connect(
            cluster.address, curve=tq.CurveClient(server_public, client_public, client_secret)
        ) as client,
    ):
        assert await client.list_partitions() == []
    wrong_server, _ = tq.curve_keypair()
    async with tq.local_cluster(num_storage_units=1, curve=server) as cluster:
        with pytest.raises((tq.BrokenError, tq.TQTimeoutError)):
            async with tq.AsyncClient.connect(
                cluster.address,
                curve=tq.CurveClient(wrong_server, client_public, client_secret),
                request_timeout=0.3,
            ):
                pass


def test_bad_keys_are_rejected_clearly() -> None:
    with pytest.raises(tq.InvalidRequestError, match="40-character"):
        tq.CurveClient(b"short", b"x" * 40, b"y" * 40)


async def test_binds_loopback_by_default_and_warns_on_public(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with tq.local_cluster(transport="tcp") as cluster:
        assert cluster.address.startswith("tcp://127.0.0.1:")
        assert all(a.startswith("tcp://127.0.0.1:") for a in cluster.unit_addresses)
    assert "non-loopback" not in caplog.text
    async with tq.local_cluster(num_storage_units=1, bind="tcp://0.0.0.0:0"):
        pass
    # a warning of the tq_async._deploy._cluster logger (the application's logging shows it)
    assert [r.levelname for r in caplog.records if "non-loopback" in r.getMessage()] == ["WARNING"]


async def test_a_client_without_keys_is_told_to_bring_them_over_ipc_too() -> None:
    """Over ipc (local_cluster's default transport) a CURVE service drops a client without
    keys before it announced its mechanism: the client saw a bare drop and was told that what
    listens there "is not a tq_async service" (a BrokenError), not to bring CURVE keys."""
    server_public, server_secret = tq.curve_keypair()
    server = tq.CurveServer(server_public, server_secret)
    async with tq.local_cluster(num_storage_units=1, curve=server) as cluster:
        assert cluster.address.startswith("ipc://")
        with pytest.raises(tq.AuthenticationError, match=r"curve=tq\.CurveClient"):
            async with tq.AsyncClient.connect(cluster.address, connect_timeout=10):
                pass
