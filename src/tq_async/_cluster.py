"""``local_cluster``: a controller and storage units as tasks in the caller's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import structlog

from ._controller import ControllerServer
from ._errors import InvalidRequestError
from ._state import ControllerState
from ._storage import StorageServer
from ._transport import is_loopback
from .samplers import BaseSampler

__all__ = ["LocalCluster", "local_cluster"]

log = structlog.get_logger(__name__)


@dataclass
class LocalCluster:
    """A running cluster: connect clients to :attr:`address`.

    Attributes:
        address: the controller's endpoint.
        controller: the controller service (its ``state`` is inspectable in tests).
        units: the storage unit services.
    """

    address: str
    controller: ControllerServer
    units: list[StorageServer] = field(default_factory=list)

    @property
    def unit_addresses(self) -> list[str]:
        return [u.address for u in self.units]


@asynccontextmanager
async def local_cluster(
    num_storage_units: int = 2,
    sampler: BaseSampler | None = None,
    *,
    host: str = "127.0.0.1",
    bind: str | None = None,
    allow_pickle: bool = False,
) -> AsyncIterator[LocalCluster]:
    """Run a controller and ``num_storage_units`` storage units in this event loop.

    Every service binds its own ZMQ socket (TCP on ``host``, a free port each), so clients in
    other processes can connect to ``cluster.address`` too. Leaving the block stops them.

    Args:
        num_storage_units: how many storage units (rows of one put go to one unit,
            round-robin across puts).
        sampler: the controller's sampler (:class:`~tq_async.SequentialSampler` by default).
        host: the interface to bind; loopback by default.
        bind: the controller's full bind address (overrides ``host``), e.g.
            ``"ipc:///tmp/tq.sock"`` or ``"tcp://127.0.0.1:5555"``.
        allow_pickle: allow columns of arbitrary Python objects (pickle runs code on load:
            trusted deployments only).

    Yields:
        A :class:`LocalCluster`.

    Raises:
        BrokenError: an address could not be bound.
    """
    if num_storage_units < 1:
        raise InvalidRequestError(f"num_storage_units must be >= 1, got {num_storage_units}")
    controller_bind = bind or f"tcp://{host}:0"
    if not is_loopback(controller_bind):
        log.warning(
            "binding a non-loopback interface: anyone who can reach it can read and write data",
            address=controller_bind,
        )
    async with anyio.create_task_group() as tg:
        units = [StorageServer(i, allow_pickle=allow_pickle) for i in range(num_storage_units)]
        addresses = {}
        for unit in units:
            addresses[unit.unit_id] = await tg.start(unit.serve, f"tcp://{host}:0")
        controller = ControllerServer(
            ControllerState(addresses), sampler, allow_pickle=allow_pickle
        )
        address = await tg.start(controller.serve, controller_bind)
        try:
            yield LocalCluster(address, controller, units)
        finally:
            tg.cancel_scope.cancel()
