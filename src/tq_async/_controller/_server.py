"""The controller service: a thin async shell around
`ControllerCore`.

The core decides (leases, holds, put leases, recorded and global batches, end-of-stream,
admission, auto-clear, unit liveness) and returns `Effects`;
this shell
decodes requests, sends replies, awaits ``async`` samplers, arms the core's one deadline
timer, tells storage units to free rows, and wakes waiters.

Every request is answered from the reader callback when it can be (status calls, puts, a
get_meta whose sampler finds rows at once). Only requests that must wait become tasks: a
get_meta with too few ready rows, an async sampler, a clear that tells the storage units.

The server *holds* its parts, as the client does, and dispatches each request type to one
of them through a table built once (`tq_async._service._loop` decodes, answers and maps
errors): the plumbing they share, `Shell` (effects, timer,
reply cache, waiting requests); the links to the storage units
(`tq_async._controller._units`); the put path (`tq_async._controller._puts`); the get
path (`tq_async._controller._gets`); the other calls (`tq_async._controller._calls`);
and the read-only requests (`tq_async._controller._queries`).

A waiting get_meta parks in the `ParkingLot` under
``(partition, task)``; the core hands back `Wakeup` events when
production, consumption, sealing, clearing, an ack or an expiry changes what a task could
receive, and only the matching keys are unparked.
There is no polling: an idle waiter costs one future until data arrives.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskStatus

from .._core._state import ControllerState
from .._core._transitions import AdmissionConfig, ControllerCore, Deadlines
from .._errors import ClosedError
from .._service._loop import SENT, Handler, Incoming, Service
from .._service._metrics import Metrics
from .._storage._dir_marker import DISK_INSTANCE
from .._transport._router import RouterEndpoint
from .._transport._security import CurveServer
from .._wire._protocol import (
    ClusterStatus,
    Hello,
    HelloReply,
    KVList,
    RegisterUnit,
    UnitInfo,
    WatchNext,
    controller_request_decoder,
    ok_reply,
)
from ..samplers import BaseSampler
from ._calls import ControlCalls
from ._gets import GetPath
from ._journal import Durability, JournalStore, Recorder, check_durability, check_no_journal
from ._puts import PutPath
from ._queries import QUERIES
from ._shell import Shell
from ._units import UnitLinks
from ._watch import WatchHub

if TYPE_CHECKING:  # (a `serve controller` process never imports the units' code)
    from .._storage._server import StorageServer

__all__ = ["AdmissionConfig", "ControllerServer", "Deadlines"]


class ControllerServer(Service):
    """Serves a `ControllerCore` on a ROUTER socket.

    Args:
        state: the partitions (a new empty state by default).
        sampler: decides what each get_meta receives (`SequentialSampler` by default).
        task_samplers: samplers for particular tasks (e.g. ``{"update_actor":
            SeqlenBalancedSampler(...)}``); other tasks use ``sampler``.
        allow_pickle: told to clients; storage units enforce it.
        unit_timeout: seconds to wait for a storage unit when the controller calls it (clears).
        metrics: where to record request metrics (disabled by default).
        admission: bounds for ``acquire_rollout`` (staleness and capacity; none by default).
        curve: CURVE keys for this service's socket and its connections to the units.
        local_units: storage units running in this process (``local_cluster`` passes its
            own): a small put sent whole to the controller (`PutInline`) is stored in
            them directly, without a message.
        deadlines: the put-lease and unit-liveness deadlines (`Deadlines`).
        default_lease: seconds of the lease of a fetch that asks for none (None: no lease
            unless asked for).
        durability: ``"memory"`` (default), or ``"process"`` / ``"fsync"``: the state is
            journaled under ``data_dir`` and a controller started on it recovers (see
            `tq_async._controller._journal` and ``docs/guarantees.md``).
        data_dir: the journal's directory (an existing one: empty, or a controller's).
    """

    name = "controller"

    def __init__(
        self,
        state: ControllerState | None = None,
        sampler: BaseSampler | None = None,
        *,
        task_samplers: Mapping[str, BaseSampler] | None = None,
        allow_pickle: bool = False,
        unit_timeout: float = 30.0,
        metrics: Metrics | None = None,
        admission: AdmissionConfig | None = None,
        curve: CurveServer | None = None,
        local_units: Mapping[int, StorageServer] | None = None,
        deadlines: Deadlines | None = None,
        default_lease: float | None = None,
        durability: Durability = "memory",
        data_dir: str | None = None,
    ) -> None:
        check_durability(durability, data_dir)
        if durability == "memory" and data_dir is not None:
            check_no_journal(data_dir)
        super().__init__(metrics or Metrics(None, "controller"), controller_request_decoder)
        self.core = ControllerCore(
            state, sampler, task_samplers=task_samplers, admission=admission, deadlines=deadlines
        )
        self.allow_pickle = allow_pickle
        #: what a same-host client compares through the ipc twin (see _router)
        self._instance = secrets.token_bytes(16)
        deadlines = self.core.deadlines
        #: who asked lately (``tq-async status``)
        self._clients = ClientsSeen()
        self._shell = Shell(self.core, self.metrics, self.send_error)
        self._links = UnitLinks(
            self._shell, local_units or {}, curve, unit_timeout, deadlines.unit_suspend_after
        )
        self._shell.free_rows = self._links.free
        self._puts = PutPath(self._shell, self._links)
        self._gets = GetPath(
            self._shell,
            self._links,
            default_lease=default_lease,
            waiting_warning_after=deadlines.waiting_warning_after,
        )
        self._calls = ControlCalls(self._shell, self._links)
        #: the journal of a durable controller (None at durability "memory")
        self.recorder: Recorder | None = None
        #: the state lineage told to clients (`HelloReply.state`): the journal's, kept
        #: across restarts; a memory controller's dies with it
        self._lineage = self._instance
        if durability != "memory" and data_dir is not None:
            store = JournalStore(data_dir, durability)
            self.recorder = Recorder(store, self.core, self._links._unit_instance)
            self._shell.unasked = self.recorder.unasked
            self._lineage = store.lineage()
        self.handlers = self._handler_table()

    @property
    def state(self) -> ControllerState:
        """The core's state, for reading: every change goes through a transition of
        `core` (``tests/project/test_layering.py`` checks the controller's modules)."""
        return self.core.state

    @property
    def watch(self) -> WatchHub:
        """The event log and its watchers (``client.watch()``)."""
        return self._shell.watch

    @property
    def sampler(self) -> BaseSampler:
        """The default sampler."""
        return self.core.sampler

    @property
    def task_samplers(self) -> dict[str, BaseSampler]:
        """Samplers of particular tasks."""
        return self.core.task_samplers

    @property
    def admission(self) -> AdmissionConfig:
        """The bounds of ``acquire_rollout``."""
        return self.core.admission

    @property
    def sampler_calls(self) -> int:
        """Number of sampler invocations (tests use it to prove waiting is event-driven)."""
        return self.core.sampler_calls

    @property
    def default_lease(self) -> float | None:
        """Seconds of the lease of a fetch that asks for none (None: no lease unless asked)."""
        return self._gets.default_lease

    @property
    def waiting_warning_after(self) -> float:
        """Seconds after which a get_meta waiting on fields (or a partition) that do not
        exist, or on an unsealed partition that got no new rows, logs a warning saying so."""
        return self._gets.waiting_warning_after

    @waiting_warning_after.setter
    def waiting_warning_after(self, seconds: float) -> None:
        self._gets.waiting_warning_after = seconds

    def _recover(self, recorder: Recorder) -> None:
        """Rebuild the state from the journal. In-process units whose cells live in memory
        lost them with the old process; those with cells on disk (``local_cluster`` at a
        durable level) took them back: their rows are handed out again."""
        units, shell = self.state.units, self._shell
        local = self.local_units
        kept = {u for u, unit in local.items() if unit.state.instance.startswith(DISK_INSTANCE)}
        lost = {u: units[u] for u in self.local_units if u in units and u not in kept}
        addresses = {u: units[u] for u in kept if u in units}
        shell.apply(recorder.recover(shell.now(), lost))
        for u, address in addresses.items():
            shell.apply(self.core.unit_returned(u, address, self.local_units[u].host_id))

    @property
    def local_units(self) -> dict[int, StorageServer]:
        """The storage units running in this process."""
        return self._links.local_units

    @property
    def address(self) -> str:
        if self._endpoint is None:
            raise ClosedError(
                "the controller is not serving: start it with `await tg.start(server.serve)`"
            )
        return self._endpoint.address

    @property
    def waiting(self) -> int:
        """Number of get_meta requests currently parked waiting for data."""
        return len(self._shell.pending)

    async def serve(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind, report the address through ``task_status``, serve until cancelled."""
        shell = self._shell
        async with anyio.create_task_group() as tg:
            shell.tg = tg
            recorder = self.recorder
            try:
                if recorder is not None:
                    self._recover(recorder)
                endpoint = RouterEndpoint(
                    bind,
                    self.on_message,
                    curve=self._links.curve,
                    twin="uds",
                    on_gone=shell.peer_gone,
                )
            except BaseException:
                if recorder is not None:
                    recorder.store.close()  # give the data_dir back (its run never starts)
                raise
            self._endpoint = shell.endpoint = endpoint
            if recorder is not None:
                shell.endpoint = recorder.wrap(endpoint)
                tg.start_soon(recorder.run, shell.now)
            self._links.connect_all()
            try:
                task_status.started(endpoint.address)
                await anyio.sleep_forever()
            finally:
                shell.stop()
                endpoint.close()
                self._links.close()
                tg.cancel_scope.cancel()

    # ---- the request loop's hooks: replies go through the shell's cache ----------------------

    def send(self, peer: bytes, rid: int, header: bytes, frames: Sequence[Any] = ()) -> None:
        """Send a reply and remember it: a retried request gets it again, not re-executed."""
        self._shell.send(peer, rid, header, frames)

    def send_ok(self, peer: bytes, rid: int, payload: Any, frames: Sequence[Any] = ()) -> None:
        """Answer ``rid``; a reply naming rows' units carries the units' epoch."""
        self._shell.send_ok(peer, rid, payload, frames)

    def is_retry(self, peer: bytes, rid: int) -> bool:
        """A retry of a finished request gets the same answer; one still waiting, nothing."""
        return self._shell.is_retry(peer, rid)

    def _handler_table(self) -> dict[type, Handler]:
        """One handler per request type (the read-only ones answer from `QUERIES`)."""
        table: dict[type, Handler] = {
            typ: partial(_query, self.core, answer) for typ, answer in QUERIES.items()
        }
        changes: dict[type, Handler] = {
            **self._gets.handlers(),
            **self._puts.handlers(),
            **self._calls.handlers(),
            Hello: self._on_hello,
            RegisterUnit: self._links.on_register_unit,
            WatchNext: self._shell.watch.on_watch_next,
        }
        if self.recorder is not None:
            changes = {typ: self.recorder.noting(h) for typ, h in changes.items()}
        return table | changes | {KVList: self._on_kv_list, ClusterStatus: self._on_cluster_status}

    def on_message(self, peer: bytes, frames: list[Any]) -> None:
        """Note who asked (``tq-async status`` counts the clients), then handle it."""
        self._clients.seen(peer)
        super().on_message(peer, frames)

    def _on_cluster_status(self, msg: Incoming, body: ClusterStatus) -> dict[str, Any]:
        """The core's view, plus what only the service knows: its clients and its security."""
        status: dict[str, Any] = QUERIES[ClusterStatus](self.core, body)
        status["clients"] = {
            "active": self._clients.active(),
            "window_s": CLIENT_WINDOW,
            "watching": len(self._shell.watch.parked),
        }
        curve = self._links.curve
        status["security"] = {
            "curve": curve is not None,
            "server_key": None if curve is None else curve.public_key.decode(),
            # None: any client with the server key (or CURVE off); else how many keys are let in
            "allowed_clients": None
            if curve is None or curve.allowed_clients is None
            else len(curve.allowed_clients),
        }
        return status

    def _on_kv_list(self, msg: Incoming, body: KVList) -> Any:
        """A listing skips the reply cache: it can weigh megabytes (8192 remembered ones, a
        poll every 2 s, would hold gigabytes), and a retried read is simply answered again."""
        payload = QUERIES[KVList](self.core, body)
        endpoint = self._shell.endpoint
        if endpoint is not None:
            endpoint.send(msg.peer, [ok_reply(msg.rid, payload)])
        return SENT

    def _on_hello(self, msg: Incoming, body: Hello) -> HelloReply:
        self._shell.resends_every(msg.peer, body.refresh)
        st = self.state
        infos = [UnitInfo(i, a, host=st.unit_hosts.get(i, "")) for i, a in sorted(st.units.items())]
        ipc = self._endpoint.ipc_address if self._endpoint is not None else None
        return HelloReply(
            infos,
            self.allow_pickle,
            st.capacity,
            st.units_epoch,
            ipc,
            self._instance,
            self._lineage,
        )


#: ``tq-async status`` counts the clients that asked something in this many seconds
CLIENT_WINDOW = 60.0


class ClientsSeen:
    """The connections the controller heard from lately: identity -> when it last asked.

    ZMQ tells a ROUTER nothing when a peer goes, so "connected" is what can be known: the
    identities that sent a request in the last `CLIENT_WINDOW` seconds (clients, storage
    units registering, the status command itself). One dict store per request; pruned when
    it doubles, so a churn of short-lived clients holds memory for the window only.
    """

    __slots__ = ("_last", "_prune_at")

    def __init__(self) -> None:
        self._last: dict[bytes, float] = {}
        self._prune_at = 1024

    def seen(self, peer: bytes) -> None:
        self._last[peer] = time.monotonic()
        if len(self._last) > self._prune_at:
            self._prune()

    def active(self) -> int:
        """How many identities asked something in the last `CLIENT_WINDOW` seconds."""
        self._prune()
        return len(self._last)

    def _prune(self) -> None:
        cutoff = time.monotonic() - CLIENT_WINDOW
        self._last = {p: t for p, t in self._last.items() if t >= cutoff}
        self._prune_at = max(1024, 2 * len(self._last))


def _query(core: ControllerCore, answer: Any, msg: Incoming, body: Any) -> Any:
    return answer(core, body)
