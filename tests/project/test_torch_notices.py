"""torch's tracing notice is not printed by a program that reads jagged data.

torch 2.13 logs "is_fx_tracing will return true for both fx.symbolic_trace and torch.export
..." (once per process, through ``logging``) from ``nested_tensor_from_jagged``: advice for
tracing code, nothing a reader can act on. The library silences that one record where it
builds jagged tensors, and leaves torch's logger as it found it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch
from torch.fx import _symbolic_trace

from tq_async._paths import _device_copy as _devices
from tq_async._wire import _nested

NOTICE = "is_fx_tracing will return true"


@pytest.fixture
def notices() -> Iterator[list[logging.LogRecord]]:
    """The records of torch's notice logged during the test; torch logs it once per process
    (an ``lru_cache``), so it is armed again here."""
    logger = logging.getLogger("torch.fx._symbolic_trace")
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if NOTICE in record.getMessage():
                seen.append(record)

    handler = Keep()
    logger.addHandler(handler)
    _symbolic_trace.is_fx_tracing_warning.cache_clear()
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def _jagged() -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(torch.arange(5.0), torch.tensor([0, 2, 5]))


def test_torch_logs_the_notice_where_the_library_does_not_build(
    notices: list[logging.LogRecord],
) -> None:
    _jagged()  # what the tests below would see
    assert len(notices) == 1


def test_building_jagged_tensors_logs_no_notice(notices: list[logging.LogRecord]) -> None:
    jagged = _jagged()
    _symbolic_trace.is_fx_tracing_warning.cache_clear()
    assert len(notices) == 1  # torch's own call
    dim = _nested.Ragged(torch.tensor([0, 2, 2, 5]), 0, 3)
    _nested._public_njt(torch.arange(5.0), dim)  # the public factory
    _symbolic_trace.is_fx_tracing_warning.cache_clear()
    _nested._probed_njt_maker()  # its probe builds with both factories
    _symbolic_trace.is_fx_tracing_warning.cache_clear()
    _devices._Mover(torch.clone, host_offsets=True)(jagged)  # a copy to a device
    assert len(notices) == 1

    # scoped, never global: torch's logger is left as found
    _symbolic_trace.is_fx_tracing_warning.cache_clear()
    _jagged()
    assert len(notices) == 2


def test_reading_jagged_data_prints_no_notice() -> None:
    """A user's program (and its DataLoader workers, each a process of its own) reading a
    jagged field prints nothing of torch's."""
    script = textwrap.dedent(
        """
        import torch, tq_async as tq

        if __name__ == "__main__":
            with tq.background_cluster(num_storage_units=1) as cluster:
                with tq.Client.connect(cluster.address) as client:
                    rows = [torch.arange(n) for n in (3, 5, 2, 4)]
                    client.put({"responses": rows}, partition_id="p")
                    client.seal("p")
                    # the workers read first: each is a process that has printed nothing yet
                    dataset = tq.StreamingDataset(
                        cluster.address, ["responses"], 2, 2, "p", "learner"
                    )
                    for td, _ in tq.StreamingDataLoader(dataset, num_workers=2):
                        assert td["responses"].is_nested
                    td = client.get_data(client.get_meta(["responses"], 4, "p", "t"))
                    print("read", td["responses"].offsets().tolist())
        """
    )
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "read [0, 3, 8, 10, 14]"
    assert "is_fx_tracing" not in out.stdout + out.stderr
