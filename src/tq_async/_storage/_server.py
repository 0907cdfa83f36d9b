"""Storage units: a thin ROUTER server holding a unit's cells, its book and its data paths.

A unit is composed of parts, each tested or readable alone:

- `StorageState`: the cells (chunks of put columns and the
  index that finds a row's cell), a plain class;
- `Book`: who holds which of the unit's memory (same-host and
  NIXL clients, grants, read pins, NIXL claims), a plain class that decides what goes back;
- `UnitDir`: the files of its cells (a durable unit's
  directory, locked while it runs; a spilling unit's scratch directory);
- `GroupCommits`: at durability ``fsync``, the requests
  waiting for the next group commit and the task that makes it;
- `CellCalls`: the requests on the cells (put,
  get, clear, stats) and the count of the bytes they move by locality;
- the data paths beside the socket, each with its handlers:
  `ShmPath` (the shared-memory arena),
  `NixlPath` (the NIXL agent) and
  `DevicePath` (the device arena).

The server opens and closes them, and dispatches each request (through
`tq_async._service._loop`) to the part it concerns.

Its cells' tiers (`tq_async._storage._segments`): at durability ``process`` / ``fsync`` the
unit keeps its cells in segment files under its ``data_dir`` too (a put is answered once its
bytes are in the OS's files; at ``fsync`` once a group commit, shared by every put waiting,
synced them), and a unit started on the directory takes them back. With ``memory_cap``,
cells past it leave memory (at ``memory`` level into a scratch directory, removed on close).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus

from .._errors import ClosedError, InvalidRequestError
from .._paths._nixl import Claims, UnitNixl, check_data_path
from .._paths._shm import DEFAULT_SHM_CAP, DEFAULT_SHM_IDLE, Arena, Region
from .._service._loop import DEFERRED, SENT, Handler, Incoming, Service
from .._service._metrics import Metrics
from .._transport._hosts import resolve_host_id
from .._transport._router import RouterEndpoint
from .._transport._security import CurveServer
from .._wire._checks import check_int
from .._wire._columns import ColumnHeader
from .._wire._protocol import (
    Cancel,
    DeviceHello,
    NixlHello,
    ShmAlloc,
    ShmFree,
    ShmGrant,
    ShmHello,
    StoreClear,
    StoredColumns,
    StoreGet,
    StoreLayout,
    StorePut,
    StoreStats,
    storage_request_decoder,
)
from ._book import Book, Grant, Pin
from ._cell_calls import CellCalls
from ._cells import OverBudget, StorageState
from ._commits import GroupCommits
from ._device_handlers import DevicePath
from ._nixl_handlers import NixlPath
from ._shm_handlers import ShmPath
from ._unit_dir import UnitDir

__all__ = ["DEFAULT_SHM_CAP", "DEFAULT_SHM_IDLE", "StorageServer"]


class StorageServer(Service):
    """Serves one unit's cells on a ROUTER socket, through its parts (every handler is
    synchronous but the first NIXL hellos', which wait for the agent being made on a worker
    thread).

    Its parts: ``state`` (`StorageState`, the cells), ``book`` (`Book`, who
    holds which memory), ``unit_dir`` (`UnitDir`, the cells' files), ``commits``
    (`GroupCommits`, at ``fsync``), ``cells`` (`CellCalls`, the requests on the cells),
    ``shm_path``, ``nixl_path`` and ``device_path`` (the data paths beside the socket, each
    with its handlers).

    Args:
        unit_id: this unit's id.
        allow_pickle: accept pickled columns.
        metrics: where to count requests and bytes.
        curve: CURVE keys (network transports).
        shm_cap: bytes of shared memory for clients on this host (see `tq_async._paths._shm`);
            0 turns the shared-memory path off. At the cap, puts go over the socket.
        shm_idle_bytes: most bytes of freed shared memory kept resident for reuse (None:
            256 MiB, or with ``memory_cap`` 5 % of it, at most 256 MiB: they count against it).
        data_path: what this unit offers besides the socket: ``"auto"`` (shared memory to
            clients on its host, NIXL to the others when installed), ``"shm"``, ``"nixl"``
            (NIXL to every client; its arena is the one shared memory would use) or
            ``"zmq"`` (the socket only).
        device_cap: bytes of GPU memory for cells put from GPUs by clients on this host (see
            `tq_async._paths._device`; 0: none). Needs shared memory (``shm_cap``) too.
        device_index: which GPU (its CUDA index as this process sees it) holds them.
        host_id: this unit's host id (see `tq_async._transport._hosts`; None: found
            out: ``$TQ_HOST_ID``, the Ray node id, or the machine's).
        durability: ``"memory"`` (cells in memory only), ``"process"`` (a put is answered
            once its cells are in the files under ``data_dir``) or ``"fsync"`` (once they
            are on the disk; group commit).
        data_dir: the unit's own directory (durable levels: an existing one, empty or this
            unit's, whose cells are taken back; ``memory``: where spill files go).
        memory_cap: most bytes of cells kept in memory; the least recently used ones past
            it go to disk and are read back on demand (None: no bound).

    Raises:
        ConfigError: a durable level without ``data_dir``, or a ``data_dir`` that is
            missing, another unit's or the controller's, or in use by a running unit.
    """

    name = "storage"

    def __init__(
        self,
        unit_id: int,
        *,
        allow_pickle: bool = False,
        metrics: Metrics | None = None,
        curve: CurveServer | None = None,
        shm_cap: int = DEFAULT_SHM_CAP,
        shm_idle_bytes: int | None = None,
        data_path: str = "auto",
        device_cap: int = 0,
        device_index: int = 0,
        host_id: str | None = None,
        durability: str = "memory",
        data_dir: str | None = None,
        memory_cap: int | None = None,
    ) -> None:
        if memory_cap is not None and memory_cap < 0:
            raise InvalidRequestError(f"memory_cap must be >= 0 bytes, got {memory_cap}")
        if shm_idle_bytes is None:
            # with memory_cap, the freed pages kept for reuse count against it: 5 % of it
            shm_idle_bytes = (
                DEFAULT_SHM_IDLE if memory_cap is None else min(DEFAULT_SHM_IDLE, memory_cap // 20)
            )
        shm_cap = check_int("shm_cap", shm_cap, 0)
        if shm_idle_bytes < 0:
            raise InvalidRequestError(
                f"shm_cap and shm_idle_bytes must be >= 0, got {shm_cap} and {shm_idle_bytes}"
            )
        if device_cap < 0 or device_index < 0:
            raise InvalidRequestError(
                f"device_cap and device_index must be >= 0, got {device_cap} and {device_index}"
            )
        self.curve = curve
        self.data_dir = data_dir
        self.unit_dir = UnitDir(durability, data_dir, memory_cap, unit_id)
        #: ``unit_id``, or (started with < 0) the directory's unit, back under its id
        self.unit_id = self.unit_dir.unit_id
        disk = self.unit_dir.store
        self.state = StorageState(
            allow_pickle=allow_pickle,
            disk=disk,
            memory_cap=memory_cap,
            instance=self.unit_dir.instance,
        )
        self.unit_dir.take_back(self.state)
        #: fsync level: puts and clears answered once the next group commit synced them
        self.commits = (
            GroupCommits(self.state, disk, self) if disk is not None and disk.sync else None
        )
        self.state.host = resolve_host_id(host_id)
        self.book = Book(check_data_path(data_path))
        self.shm_path = ShmPath(
            self.state,
            self.book,
            cap=shm_cap,
            idle_bytes=shm_idle_bytes,
            arena_file=self.unit_dir.arena_file,
        )
        self.nixl_path = NixlPath(self.state, self.book, encrypted=curve is not None)
        self.device_path = DevicePath(self.state, self.book, cap=device_cap, index=device_index)
        super().__init__(metrics or Metrics(None, "storage"), storage_request_decoder)
        self.cells = CellCalls(
            self.state, self.shm_path, self.device_path, self.commits, self.metrics
        )
        self.handlers = self._handler_table()
        self._tg: TaskGroup | None = None

    def registered(self, unit_id: int) -> None:
        """The controller gave this unit ``unit_id``: a durable unit's directory records it."""
        self.unit_id = unit_id
        self.unit_dir.registered(unit_id, self.state.instance)

    def _close_disk(self) -> None:
        """Make the last group commit, then close the cells' files."""
        if self.commits is not None:
            self.commits.close()
        self.unit_dir.close()

    @property
    def host_id(self) -> str:
        """This unit's host id (see `tq_async._transport._hosts`)."""
        return self.state.host

    @property
    def arena(self) -> Arena | None:
        """The shared-memory arena (None when off or not serving)."""
        return self.state.arena

    @property
    def nixl(self) -> UnitNixl | None:
        """The unit's NIXL agent with the arena registered (None: no NIXL client yet)."""
        return self.state.nixl

    @property
    def data_path(self) -> str:
        """What the unit offers besides the socket (``"shm"`` once NIXL failed to start)."""
        return self.book.data_path

    @property
    def address(self) -> str:
        if self._endpoint is None:
            raise ClosedError(
                "the storage unit is not serving: start it with `await tg.start(unit.serve)`"
            )
        return self._endpoint.address

    async def serve(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind, report the address through ``task_status``, serve until cancelled."""
        # its log lines name it (units of one process told apart)
        named = {"unit": self.unit_id} if self.unit_id >= 0 else {}
        with structlog.contextvars.bound_contextvars(**named):
            await self._serve(bind, task_status)

    async def _serve(self, bind: str, task_status: TaskStatus[str]) -> None:
        self._endpoint = RouterEndpoint(bind, self.on_message, curve=self.curve, twin="uds")
        try:
            self.shm_path.open(f"tq-unit-{self.unit_id}", self._endpoint.ipc_address)
            await self.device_path.open()
            async with anyio.create_task_group() as tg:  # ends (NIXL set up) before the arena
                self._tg = tg
                if self.commits is not None:
                    tg.start_soon(self.commits.run)
                if self.data_path == "nixl" and self.arena is not None:
                    await self.nixl_path.start()  # asked for: ready before the first client
                task_status.started(self._endpoint.address)
                await anyio.sleep_forever()
        finally:
            self._tg = None
            self._endpoint.close()
            self.device_path.close()
            self.nixl_path.close()  # deregistered before the arena is unmapped
            self.shm_path.close()
            self.book.reset()
            self._close_disk()

    # ---- a controller in this process ------------------------------------------------------

    def store_local(
        self,
        partition_id: str,
        rows: Sequence[int],
        headers: Sequence[ColumnHeader],
        frames: Any,
        incarnation: str | None = None,
        host: str = "",
    ) -> None:
        """A `StorePut` from a controller in this process, without a message
        (``host``: the producer's host id)."""
        t0 = time.perf_counter()
        ok = False
        try:
            self.state.put(partition_id, rows, headers, frames, incarnation=incarnation)
            if self.commits is not None:  # a caller in this process: synced here
                self.commits.now()
            ok = True
        finally:
            self.cells.moved("in", host, frames)
            if self.metrics.enabled:
                self.metrics.request("StorePut", ok, time.perf_counter() - t0)

    def read_local(
        self,
        partition_id: str,
        rows: Sequence[int],
        fields: Sequence[str],
        max_bytes: int,
        host: str = "",
        task: str = "",
    ) -> tuple[StoredColumns, list[Any]] | None:
        """A `StoreGet` from a controller in this process, without a message; None
        when the cells take more than ``max_bytes`` (nothing is copied then). ``host``: the
        reader's host id; ``task``: the task it reads for."""
        t0 = time.perf_counter()
        ok = False
        try:
            stored, frames = self.state.read(partition_id, rows, fields, max_bytes=max_bytes)
            ok = True
        except OverBudget:
            return None
        finally:
            if ok:
                self.cells.moved("out", host, frames, task)
            if self.metrics.enabled:
                self.metrics.request("StoreGet", ok, time.perf_counter() - t0)
        return stored, frames

    # ---- handlers ----------------------------------------------------------------------------

    def _handler_table(self) -> dict[type, Handler]:
        return {
            StorePut: self.cells.on_store_put,
            StoreGet: self.cells.on_store_get,
            StoreClear: self.cells.on_store_clear,
            StoreLayout: self.cells.on_store_layout,
            StoreStats: self.cells.on_store_stats,
            ShmHello: self.shm_path.on_hello,
            DeviceHello: self.device_path.on_hello,
            ShmAlloc: self._on_shm_alloc,
            ShmFree: self.shm_path.on_free,
            NixlHello: self._on_nixl_hello,
            Cancel: self._on_cancel,
        }

    def _on_shm_alloc(self, msg: Incoming, body: ShmAlloc) -> ShmGrant | None:
        pid = self.shm_path.claimant(msg.peer)
        if body.nbytes <= 0:
            raise InvalidRequestError(f"ShmAlloc nbytes must be > 0, got {body.nbytes}")
        if body.device:
            return self.device_path.alloc(msg.peer, pid, body.nbytes)
        return self.shm_path.alloc(msg.peer, pid, body.nbytes, pinned=body.pinned)

    def _on_nixl_hello(self, msg: Incoming, body: NixlHello) -> Any:
        if self._tg is None or self.nixl_path.answers_now():
            return self.nixl_path.hello(msg.peer, body, self.unit_id)
        self._tg.start_soon(self._nixl_hello_waiting, msg, body)
        return DEFERRED

    async def _nixl_hello_waiting(self, msg: Incoming, body: NixlHello) -> None:
        """Answer a NIXL hello once the agent is made (the first hellos of a unit)."""
        try:
            reply = await self.nixl_path.hello_when_ready(msg.peer, body, self.unit_id)
        except Exception as exc:
            self.send_error(msg.peer, msg.rid, exc, "NixlHello")
            self.record("NixlHello", False, msg.t0)
            return
        self.send_ok(msg.peer, msg.rid, reply)
        self.record("NixlHello", True, msg.t0)

    def _on_cancel(self, msg: Incoming, body: Cancel) -> Any:
        return SENT  # every storage op completes at once; nothing to cancel

    # ---- what tests look at ------------------------------------------------------------------

    @property
    def nixl_claims(self) -> Claims:
        """Grants and pins of NIXL clients, released when abandoned (see Claims)."""
        return self.book.claims

    @property
    def shm_released(self) -> anyio.Event:
        """Set (and replaced) whenever shared memory is given back."""
        return self.shm_path.released

    @property
    def _shm_peers(self) -> dict[bytes, int]:
        return self.book.peers

    @property
    def _grants(self) -> dict[int, Grant]:
        return self.book.grants

    @property
    def _pins(self) -> dict[int, Pin]:
        return self.book.pins

    @property
    def _device_grants(self) -> dict[int, Grant]:
        return self.book.device_grants

    @property
    def _device_pins(self) -> dict[int, list[Region]]:
        return self.book.device_pins
