"""The controller's other calls: acks and releases, seal and consumption resets, clears,
tags, KV, checkpoint restores and rollout admission.

Each handler asks the core for the transition and applies its effects; a clear answers once
the storage units freed the rows, an ``acquire_rollout`` that does not fit waits for room.
"""

from __future__ import annotations

from typing import Any

from .._core._state import ControllerState
from .._core._transitions import Effects, meta_reply
from .._errors import InvalidRequestError
from .._service._loop import DEFERRED, SENT, Handler, Incoming
from .._wire._protocol import (
    Ack,
    AcquireRollout,
    ClearPartition,
    ClearSamples,
    KVClear,
    KVTag,
    Placement,
    RecycledRows,
    RegisterTasks,
    Release,
    ReleaseRollout,
    RenewSlots,
    ResetConsumption,
    RestoreAbort,
    RestoreBegin,
    RestoreCommit,
    ReturnRecycled,
    Seal,
    SetPolicyVersion,
    SetTags,
    TakeRecycled,
)
from ._shell import Shell
from ._units import UnitLinks

__all__ = ["ControlCalls"]


class ControlCalls:
    """The controller's other handlers (see the module docstring)."""

    def __init__(self, shell: Shell, links: UnitLinks) -> None:
        self.shell = shell
        self.core = shell.core
        self.links = links

    @property
    def state(self) -> ControllerState:
        """The core's state, for reading."""
        return self.shell.state

    # ---- consumption -------------------------------------------------------------------------

    def on_ack(self, msg: Incoming, body: Ack) -> None:
        self.shell.apply(self.core.ack(body.lease_ids, self.shell.now()))

    def on_release(self, msg: Incoming, body: Release) -> None:
        fx = self.core.release(
            body.partition_id, body.task_name, body.rows, body.incarnation, body.lease_id
        )
        self.shell.apply(fx)

    def on_seal(self, msg: Incoming, body: Seal) -> None:
        self.shell.apply(self.core.catalog.seal(body.partition_id, create=body.create))

    def on_reset_consumption(self, msg: Incoming, body: ResetConsumption) -> None:
        self.shell.apply(self.core.reset_consumption(body.partition_id, body.task_name))

    def on_register_tasks(self, msg: Incoming, body: RegisterTasks) -> None:
        self.shell.apply(self.core.catalog.register_tasks(body.partition_id, body.tasks))

    # ---- clears, tags, KV --------------------------------------------------------------------

    def on_clear_samples(self, msg: Incoming, body: ClearSamples) -> Any:
        fx = self.core.clear_rows(body.partition_id, body.rows, body.incarnation, undo=body.undo)
        return self._clear_then_reply(msg, fx)

    def on_clear_partition(self, msg: Incoming, body: ClearPartition) -> Any:
        return self._clear_then_reply(msg, self.core.clear_partition(body.partition_id))

    def on_kv_clear(self, msg: Incoming, body: KVClear) -> Any:
        key_rows = self.state.partition(body.partition_id).rows_for_keys(body.keys)
        return self._clear_then_reply(msg, self.core.clear_rows(body.partition_id, key_rows))

    def _clear_then_reply(self, msg: Incoming, fx: Effects) -> Any:
        """Apply a clear; answer once the storage units freed the rows."""
        (partition_id, incarnation, by_unit), *rest = fx.free
        fx.free = rest
        self.shell.apply(fx)
        self.shell.spawn(
            self.links.clear_units, msg.peer, msg.rid, partition_id, by_unit, incarnation
        )
        return DEFERRED

    def on_set_tags(self, msg: Incoming, body: SetTags) -> None:
        fx = self.core.catalog.set_tags(body.partition_id, body.rows, body.tags, body.incarnation)
        self.shell.apply(fx)

    def on_kv_tag(self, msg: Incoming, body: KVTag) -> Any:
        if not self._room_for_keys(body):  # its new keys are new rows: they wait for room
            self.shell.spawn_waiting(msg, self._kv_tag_waiting, msg.peer, msg.rid, body, msg.t0)
            return DEFERRED
        return self._kv_tag(body)

    def _kv_tag(self, body: KVTag) -> Placement:
        placement, fx = self.core.catalog.kv_tag(
            body.partition_id, body.keys, body.tags, self.shell.now()
        )
        self.shell.apply(fx)
        return placement

    def _room_for_keys(self, body: KVTag) -> bool:
        n_new = self.state.new_rows_needed(body.partition_id, 0, None, body.keys)
        return self.core.catalog.room_for(body.partition_id, n_new, False)

    async def _kv_tag_waiting(self, peer: bytes, rid: int, body: KVTag, t0: float) -> None:
        async def work() -> None:
            # (its new keys are counted again when woken: keys cleared meanwhile are new now)
            await self.shell.lot.until("room", lambda: self._room_for_keys(body))
            self.shell.send_ok(peer, rid, self._kv_tag(body))

        def why() -> str:  # (no timeout: it waits until room, or its caller cancels)
            return f"{self.state.at_capacity(body.partition_id)}; no key was created"

        await self.shell.waiting_request(peer, rid, "KVTag", t0, None, why, work)

    # ---- checkpoints -------------------------------------------------------------------------

    def on_restore_begin(self, msg: Incoming, body: RestoreBegin) -> dict[str, list[int]]:
        return self.core.catalog.restore_begin(body.state.partitions)

    def on_restore_commit(self, msg: Incoming, body: RestoreCommit) -> None:
        core = self.core
        samplers = (core.sampler, core.task_samplers)
        fx = core.catalog.restore_commit(body.partition_ids, body.sampler_state, samplers)
        self.shell.apply(fx)

    def on_restore_abort(self, msg: Incoming, body: RestoreAbort) -> None:
        everywhere: dict[int, list[int] | None] = dict.fromkeys(self.core.state.units)
        for pid, incarnation in self.core.catalog.restore_abort(body.partition_ids).items():
            self.shell.spawn(self.links.clear_units, None, msg.rid, pid, everywhere, incarnation)

    # ---- admission ---------------------------------------------------------------------------

    def on_set_policy_version(self, msg: Incoming, body: SetPolicyVersion) -> None:
        self.shell.apply(self.core.set_policy_version(body.version))

    def on_acquire_rollout(self, msg: Incoming, body: AcquireRollout) -> Any:
        holder = self._holder(msg.peer, body)
        now = self.shell.now() if body.holder else None
        if self.core.acquire(body.policy_version, body.n, body.token, holder, now):
            self._admit(msg.peer, msg.rid, body, holder)
            return SENT
        self.shell.spawn_waiting(msg, self._acquire_waiting, msg.peer, msg.rid, body, msg.t0)
        return DEFERRED

    def _holder(self, peer: bytes, body: AcquireRollout) -> bytes:
        """Who holds an acquire's slots: the name its client gives (its connection speaks
        for it from now on), else the connection itself."""
        if not body.holder:
            return peer
        self.core.rollouts.named(peer, body.holder)
        return body.holder

    def _admit(self, peer: bytes, rid: int, body: AcquireRollout, holder: bytes) -> None:
        """Answer an admitted rollout: with the slot lease its client renews (None: its
        connection holds the slots)."""
        self.shell.rearm()  # (a named holder's slot lease)
        lease = self.core.rollouts.config.slot_lease if body.holder else None
        self.shell.admit(peer, rid, body.n, holder, lease)

    def on_release_rollout(self, msg: Incoming, body: ReleaseRollout) -> None:
        if body.n < 0:
            raise InvalidRequestError(f"release_rollout needs n >= 0, got {body.n}")
        released = self.core.release_slots(body.n, body.holder or msg.peer)
        self.shell.apply(Effects(admission=released))

    def on_renew_slots(self, msg: Incoming, body: RenewSlots) -> None:
        self.core.renew_slots(body.holder, msg.peer, self.shell.now())
        self.shell.rearm()

    def on_take_recycled(self, msg: Incoming, body: TakeRecycled) -> list[RecycledRows]:
        if body.max_rows < 1:
            raise InvalidRequestError(f"max_rows must be >= 1, got {body.max_rows}")
        taken = self._take_recycled(body.max_rows, body.token)
        if taken:
            back = [
                (r.partition_id, r.meta.incarnation, r.meta.rows, r.meta.lease_id) for r in taken
            ]

            def undo() -> None:  # (what the client's ReturnRecycled would do)
                for pid, incarnation, rows, lease_id in back:
                    self.core.catalog.return_recycled(pid, incarnation, rows, lease_id, body.token)

            self.shell.undo_on_cancel(msg.peer, msg.rid, undo)
        return taken

    def on_return_recycled(self, msg: Incoming, body: ReturnRecycled) -> None:
        self.core.catalog.return_recycled(
            body.partition_id, body.incarnation, body.rows, body.lease_id, body.token
        )

    async def _acquire_waiting(
        self, peer: bytes, rid: int, body: AcquireRollout, t0: float
    ) -> None:
        holder = self._holder(peer, body)

        def admitted() -> bool:
            now = self.shell.now() if body.holder else None
            return self.core.acquire(body.policy_version, body.n, body.token, holder, now)

        async def work() -> None:
            await self.shell.lot.until("admission", admitted)
            self._admit(peer, rid, body, holder)

        st = self.state
        await self.shell.waiting_request(
            peer,
            rid,
            "AcquireRollout",
            t0,
            body.timeout,
            lambda: (
                f"rollout of policy version {body.policy_version} not admitted within "
                f"{body.timeout} s (learner at {st.learner_version}, {st.outstanding} rows "
                "outstanding); nothing was reserved. Slots free as the learner task "
                f"({self.core.rollouts.config.learner_task!r}) consumes rows put with "
                "policy_version= (rows put without one free none), or by release_rollout"
            ),
            work,
        )

    def _take_recycled(self, max_rows: int, token: int = 0) -> list[RecycledRows]:
        out = self.core.catalog.take_recycled(max_rows, token)
        st = self.state
        taken = []
        for pid, (rows, lease_id) in out.items():
            reply = meta_reply(st.partitions[pid], rows, list(st.partitions[pid].fields))
            reply.lease_id = lease_id
            taken.append(RecycledRows(pid, reply))
        return taken

    def handlers(self) -> dict[type, Handler]:
        """The request types this part handles, and their handlers."""
        return {
            Ack: self.on_ack,
            Release: self.on_release,
            Seal: self.on_seal,
            ResetConsumption: self.on_reset_consumption,
            ClearSamples: self.on_clear_samples,
            ClearPartition: self.on_clear_partition,
            SetTags: self.on_set_tags,
            KVTag: self.on_kv_tag,
            KVClear: self.on_kv_clear,
            RestoreBegin: self.on_restore_begin,
            RestoreCommit: self.on_restore_commit,
            RestoreAbort: self.on_restore_abort,
            RegisterTasks: self.on_register_tasks,
            SetPolicyVersion: self.on_set_policy_version,
            AcquireRollout: self.on_acquire_rollout,
            ReleaseRollout: self.on_release_rollout,
            RenewSlots: self.on_renew_slots,
            TakeRecycled: self.on_take_recycled,
            ReturnRecycled: self.on_return_recycled,
        }
