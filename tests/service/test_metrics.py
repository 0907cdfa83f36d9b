"""Prometheus metrics on an injected registry, scraped over HTTP; opt-in logging."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from functools import partial

import anyio
import prometheus_client
import pytest
import structlog
import torch
from prometheus_client import CollectorRegistry

import tq_async as tq
from tq_async.lowlevel import serve_controller, serve_storage


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:  # loopback only
        body: bytes = resp.read()
    return body.decode()


def value(text: str, line_prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_prefix!r} not in the scrape")


async def test_metrics_are_served_and_counted() -> None:
    registry = CollectorRegistry()
    before = set(prometheus_client.REGISTRY._names_to_collectors)
    async with (
        tq.local_cluster(
            num_storage_units=2, metrics_registry=registry, serve_metrics_on="127.0.0.1:0"
        ) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        assert cluster.metrics_url is not None
        meta = await client.put({"x": torch.zeros(4, 256)}, partition_id="train@0")
        await client.get_data(meta)
        await client.get_meta(["x"], 3, "train@0", "learner")
        with pytest.raises(tq.PartitionNotFound):
            await client.partition_info("nope")
        text = await anyio.to_thread.run_sync(scrape, cluster.metrics_url)
    ok = 'tq_requests_total{op="GetMeta",outcome="ok",service="controller"}'
    assert value(text, ok) == 1
    err = 'tq_requests_total{op="PartitionInfo",outcome="error",service="controller"}'
    assert value(text, err) == 1
    assert value(text, 'tq_transfer_bytes_total{direction="in",service="storage"}') == 4 * 256 * 4
    assert value(text, 'tq_transfer_bytes_total{direction="out",service="storage"}') == 4096
    assert value(text, 'tq_rows_ready{task="learner"}') == 1
    assert value(text, 'tq_rows_unconsumed{task="learner"}') == 1
    assert value(text, "tq_partitions ") == 1
    resident = [value(text, f'tq_storage_resident_bytes{{unit="{u}"}}') for u in (0, 1)]
    assert sorted(resident) == [0, 4096]
    assert 'tq_request_duration_seconds_bucket{le="0.001",op="PutInline"' in text
    assert "train@0" not in text  # partition ids are never label values
    assert set(prometheus_client.REGISTRY._names_to_collectors) == before  # global untouched


async def test_waiting_get_meta_records_wait_time() -> None:
    registry = CollectorRegistry()
    async with (
        tq.local_cluster(num_storage_units=1, metrics_registry=registry) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.get_meta, ["x"], 1, "p", "t")
            with anyio.fail_after(5):
                while cluster.controller.waiting < 1:
                    await anyio.lowlevel.checkpoint()
            assert registry.get_sample_value("tq_get_meta_waiting") == 1
            await client.put({"x": torch.zeros(1)}, partition_id="p")
        assert registry.get_sample_value("tq_consumer_wait_seconds_count") == 1
        assert registry.get_sample_value("tq_get_meta_waiting") == 0


def test_serve_metrics_needs_a_registry() -> None:
    async def main() -> None:
        async with tq.local_cluster(serve_metrics_on="127.0.0.1:0"):
            pass

    with pytest.raises(tq.InvalidRequestError, match="metrics_registry"):
        anyio.run(main)


def test_configure_logging_is_opt_in(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        tq.configure_logging("WARNING", json=True)
        log = structlog.get_logger("tq_async.test")
        log.info("hidden")
        log.warning("shown", rid=7)
        err = capsys.readouterr().err
        assert '"event": "shown"' in err
        assert '"rid": 7' in err
        assert "hidden" not in err
        with pytest.raises(ValueError, match="level"):
            tq.configure_logging("LOUD")
    finally:
        structlog.reset_defaults()


@pytest.mark.parametrize("address", ["127.0.0.1:abc", "127.0.0.1:99999", "127.0.0.1:-1"])
async def test_a_bad_metrics_address_is_a_clear_error_before_anything_starts(address: str) -> None:
    """``metrics_on`` / ``serve_metrics_on`` with a port that is no port passed validation
    and ended in a traceback (ValueError, OverflowError) once the services had started."""
    with pytest.raises(tq.ConfigError, match=r"^metrics_on: expected HOST:PORT"):
        tq.Config(metrics_on=address)
    with pytest.raises(tq.InvalidRequestError, match="serve_metrics_on: expected HOST:PORT"):
        async with tq.local_cluster(metrics_registry=CollectorRegistry(), serve_metrics_on=address):
            pass


def test_serve_refuses_a_bad_metrics_address_as_a_bad_flag() -> None:
    """deployment.md: status 2 and one line for a bad command line (it was a traceback and
    status 1, after the services had started)."""
    done = subprocess.run(
        [sys.executable, "-m", "tq_async._deploy._cli", "serve", "--metrics-on", "h:abc"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "tq-async: error: command line: metrics_on: expected HOST:PORT (a port from 0 to "
        "65535; 0: any free port), got 'h:abc'"
    ]


async def test_a_taken_metrics_port_is_a_broken_error() -> None:
    """A metrics port another process holds came out of ``local_cluster`` as an OSError in
    an ExceptionGroup (a bind of the services' own ports is a `BrokenError` saying so)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(tq.BrokenError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            async with tq.local_cluster(
                metrics_registry=CollectorRegistry(), serve_metrics_on=f"127.0.0.1:{port}"
            ):
                pass


def test_serve_controller_with_a_taken_metrics_port_fails_in_one_line() -> None:
    """``tq-async serve controller --metrics-on`` a taken port printed ``TQ_ADDRESS=`` (a
    launcher takes the service for started), then died with a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", "controller", "--metrics-on", f"127.0.0.1:{port}"]
        done = subprocess.run(
            [sys.executable, "-m", "tq_async._deploy._cli", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 1
    assert done.stdout == ""
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tq-async: error: cannot serve metrics on 127.0.0.1:{port}: ")
    assert "Traceback" not in done.stderr


async def test_a_registry_kept_for_the_next_cluster_shows_that_cluster_only() -> None:
    """A cluster's gauges stayed in the registry after it stopped: a second cluster on the
    same registry (a program restarting its cluster) was scraped with both clusters' gauges,
    each family twice (a second TYPE line Prometheus refuses), the first the stopped one's."""
    registry = CollectorRegistry()
    for rows in (3, 5):
        async with (
            tq.local_cluster(num_storage_units=1, metrics_registry=registry) as cluster,
            tq.AsyncClient.connect(cluster.address) as client,
        ):
            await client.put({"x": torch.zeros(rows)}, partition_id="p")
            await client.get_meta(["x"], 1, "p", "t")
            text = prometheus_client.generate_latest(registry).decode()
            types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
            assert len(types) == len(set(types))
            assert registry.get_sample_value("tq_rows_unconsumed", {"task": "t"}) == rows - 1
    assert registry.get_sample_value("tq_partitions") is None  # gone with its cluster
    delivered = {"task": "t", "locality": "same_host"}
    assert registry.get_sample_value("tq_rows_delivered_total", delivered) == 2  # counters stay


async def test_a_registry_kept_after_serve_controller_and_storage_stop() -> None:
    """`serve_controller` / `serve_storage` left their gauges in the registry too."""
    registry = CollectorRegistry()
    async with anyio.create_task_group() as tg:
        address = await tg.start(partial(serve_controller, metrics_registry=registry))
        await tg.start(partial(serve_storage, address, metrics_registry=registry))
        assert registry.get_sample_value("tq_partitions") == 0
        assert registry.get_sample_value("tq_storage_resident_bytes", {"unit": "0"}) == 0
        tg.cancel_scope.cancel()
    assert registry.get_sample_value("tq_partitions") is None
    assert registry.get_sample_value("tq_storage_resident_bytes", {"unit": "0"}) is None


@pytest.mark.parametrize("address", ["[::1]:0", "::1:0"])
async def test_metrics_on_an_ipv6_host(address: str) -> None:
    """``[::1]:9100`` (how an IPv6 host and a port are written) failed: "cannot serve
    metrics on [::1]:0: Name or service not known"; ``::1:9100`` served, but the URL printed
    (``TQ_METRICS_URL=``) was ``http://::1:9100/metrics``, which no client parses."""
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback on this machine")
    registry = CollectorRegistry()
    async with tq.local_cluster(metrics_registry=registry, serve_metrics_on=address) as cluster:
        url = cluster.metrics_url
        assert url is not None
        assert url.startswith("http://[::1]:")
        assert "tq_partitions 0.0" in await anyio.to_thread.run_sync(scrape, url)
