"""The partition catalogue: a pure part of the controller's core.

The transitions that change a partition's description but deliver nothing: sealing,
registering auto-clear tasks, tags, the capacity decision of a put (``room_for``), checkpoint
restores and handing out recycled rows. `ControllerCore`
composes it
as ``core.catalog``; the controller's shell calls these and only reads the state itself, so
the property test (``tests/core/test_core_properties.py``) drives every state change without a
loop. No loop, no clock, no sockets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import BrokenError, InvalidRequestError, WouldBlock
from .._wire._events import PartitionCreated, PartitionRestored, PartitionSealed
from .._wire._protocol import PartitionDump, Placement
from ._arrays import live_rows
from ._dumps import restore_partition
from ._effects import Effects
from ._events import partition_snapshot
from ._leases import GetLeases
from ._put_leases import PutLeases
from ._sampling import load_states
from ._state import ControllerState, Partition, Wakeup

__all__ = ["TAKEN_TOKENS", "Catalog"]

#: takes of recycled rows remembered by token (`ControllerState.taken`, journaled with the
#: controller's own state): a client asks again within seconds of losing a reply
TAKEN_TOKENS = 64


class Catalog:
    """Seal, auto-clear tasks, tags, room for puts, restores, recycled rows of ``state``.

    Args:
        state: the controller's state.
        puts: the core's put leases (a KV tag creates its missing keys through them).
        leases: the core's get leases (a restored partition's recorded batches hold their
            rows through them).
    """

    def __init__(self, state: ControllerState, puts: PutLeases, leases: GetLeases) -> None:
        self.state = state
        self._puts = puts
        self._leases = leases

    def seal(self, partition_id: str, *, create: bool = False) -> Effects:
        """No more new rows in ``partition_id``: drained readers get end-of-stream.

        A partition that does not exist raises `PartitionNotFound` (a misspelled id
        would otherwise be created sealed while the real one stays open); ``create=True``
        creates it sealed and empty. (What sealing an unknown partition does is decided
        here, and only here.)
        """
        existed = partition_id in self.state.partitions
        fx = Effects(wakeups=self.state.seal(partition_id, create=create))
        out = self.state.events
        if out.on:
            p = self.state.partitions[partition_id]
            if not existed:
                out.add(PartitionCreated(partition_id=partition_id, incarnation=p.incarnation))
            out.add(PartitionSealed(partition_id=partition_id))
        return fx

    def register_tasks(self, partition_id: str | None, tasks: Sequence[str]) -> Effects:
        """Auto-clear rows of ``partition_id`` (every partition without its own setting:
        None) once ``tasks`` all consumed them; no tasks: auto-clear off (for a partition
        under a default setting: its own setting is "none"). Rows they all consumed already
        are freed now (unless held, as any consumed row)."""
        st = self.state
        fx = Effects()
        if not tasks:
            if partition_id is not None and st.auto_clear.get(None):
                st.auto_clear[partition_id] = ()  # (dropping its own would leave the default's)
            else:
                st.auto_clear.pop(partition_id, None)
            return fx
        st.auto_clear[partition_id] = tuple(dict.fromkeys(tasks))
        for pid, p in st.partitions.items():
            if pid == partition_id or (partition_id is None and pid not in st.auto_clear):
                # (a recorded batch waiting for its reader holds its rows first)
                self._leases.hold_waiting(p)
                self._leases.auto_clear(p, live_rows(p), fx)
        return fx

    def set_tags(
        self,
        partition_id: str,
        rows: Sequence[int],
        tags: Sequence[Mapping[str, Any]],
        incarnation: str | None = None,
    ) -> Effects:
        """Merge ``tags[i]`` into the tags of ``rows[i]`` (of that incarnation)."""
        p = self.state.partition(partition_id)
        p.check_incarnation(incarnation)
        p.set_tags(rows, tags)
        self.state.events.tags(partition_id, rows, tags)
        return Effects()

    def kv_tag(
        self,
        partition_id: str,
        keys: Sequence[str],
        tags: Sequence[Mapping[str, Any]],
        now: float,
    ) -> tuple[Placement, Effects]:
        """Merge tags into the rows of ``keys``, creating missing keys (rows without fields)."""
        if len(tags) != len(keys):
            raise InvalidRequestError(f"got {len(tags)} tag dicts for {len(keys)} keys")
        # refuse an overfull prompt group before missing keys get rows (new ones: ids < 0)
        p = self.state.partitions.get(partition_id) or self.state.new_partition(partition_id)
        fresh: dict[str, int] = {}
        rows = [p.keys[k] if k in p.keys else fresh.setdefault(k, -1 - len(fresh)) for k in keys]
        p.groups.check(p.partition_id, rows, tags)
        placement, fx = self._puts.begin(partition_id, [], 0, None, keys, now, lease=False)
        self.state.partition(partition_id).set_tags(placement.rows, tags)
        self.state.events.tags(partition_id, placement.rows, tags)
        return placement, fx

    def room_for(self, partition_id: str, n_new: int, nowait: bool) -> bool:
        """Whether ``n_new`` new rows fit the capacity now (False: the put waits for room).

        Raises:
            InvalidRequestError: they never will (more than the whole capacity).
            WouldBlock: they do not fit now and the put does not wait (``nowait``).
        """
        st = self.state
        if st.has_room(partition_id, n_new):
            return True
        if st.capacity is not None and n_new > st.capacity:
            raise InvalidRequestError(
                f"a put of {n_new} new rows can never fit the capacity of "
                f"{st.capacity} rows; split it"
            )
        if nowait:
            raise WouldBlock(
                f"{st.at_capacity(partition_id)}; wait with put(), or free rows (clear, or "
                "auto-clear tasks)"
            )
        return False

    # ---- checkpoints -------------------------------------------------------------------------

    def restore_begin(self, dumps: Sequence[PartitionDump]) -> dict[str, list[int]]:
        """Stage partitions of a checkpoint, invisible until `restore_commit`, their alive
        rows spread over the live units (neither lost nor suspended) in contiguous blocks;
        each one's units (where its cells must go), one per row from the dump's ``base`` on."""
        st = self.state
        if not st.units:
            raise InvalidRequestError("the controller has no storage units to restore onto")
        named = [d.partition_id for d in dumps]
        if len(set(named)) != len(named):
            raise InvalidRequestError(f"a restore names a partition twice: {sorted(named)}")
        clash = [d.partition_id for d in dumps if d.partition_id in st.partitions]
        clash += [d.partition_id for d in dumps if d.partition_id in st.restoring]
        if clash:
            raise InvalidRequestError(
                f"partitions {clash} already exist (or are being restored); clear them before "
                "loading a checkpoint that holds them"
            )
        ids = st.live_units()
        if not ids:
            raise BrokenError(
                f"every storage unit ({sorted(st.units)}) is down or suspended; restart them "
                "(they register again) before loading a checkpoint"
            )
        staged = []
        for d in dumps:
            live = [i for i in range(len(d.alive)) if d.alive[i]]  # (from ``d.base`` on)
            units = [ids[0]] * len(d.alive)
            per_unit = -(-len(live) // len(ids)) if live else 1
            for i, r in enumerate(live):  # contiguous blocks, one per unit
                units[r] = ids[min(i // per_unit, len(ids) - 1)]
            staged.append(st.bind(restore_partition(d, units)))
        for p, d in zip(staged, dumps, strict=True):
            st.restoring[p.partition_id] = p
            st.restoring_owed[p.partition_id] = (d.dp_ends, d.recycled)
        return {p.partition_id: list(p.units) for p in staged}

    def restore_commit(
        self,
        partition_ids: Sequence[str],
        sampler_state: Mapping[str, Any] | None,
        samplers: Any,
    ) -> Effects:
        """Make staged partitions live, and load the samplers' state.

        Args:
            partition_ids: partitions staged by `restore_begin`.
            sampler_state: ``{"default": ..., "task:<name>": ...}`` from the checkpoint.
            samplers: ``(default sampler, {task: sampler})``.
        """
        st = self.state
        missing = [pid for pid in partition_ids if pid not in st.restoring]
        if missing:
            raise InvalidRequestError(f"partitions {missing} are not being restored")
        if sampler_state:  # first: a sampler that cannot load its state restores nothing
            default, by_task = samplers
            named = [("default", default)] + [(f"task:{t}", s) for t, s in by_task.items()]
            load_states(
                named,
                sampler_state,
                "the checkpoint",
                "load it with the samplers that saved it (or make load_state_dict read that "
                "state); no partition was restored",
            )
        fx = Effects(wakeups=[Wakeup(pid) for pid in partition_ids])
        for pid in partition_ids:
            p = st.partitions[pid] = st.restoring.pop(pid)
            ends, recycled = st.restoring_owed.pop(pid, ([], []))
            for task, index, ranks in ends:
                st.dp_ends[(pid, p.incarnation, task, index)] = set(ranks)
            queued = [r for r in recycled if p.is_alive(r)]
            st.recycled.extend((pid, p.incarnation, r) for r in queued)
            self._leases.hold_recycled(p, queued)
            # (a checkpoint has no leases: every recorded batch waits for its next reader)
            self._leases.hold_waiting(p)
            if st.events.on:
                snap = partition_snapshot(p)
                st.events.add(PartitionRestored(partition_id=pid, snapshot=snap))
            # nor holds: rows every auto-clear task consumed and no recorded batch waits for
            # are freed (no ack will ever come for them)
            if st.auto_clear:
                self._leases.auto_clear(p, live_rows(p), fx)
        return fx

    def restore_abort(self, partition_ids: Sequence[str]) -> dict[str, str]:
        """Drop the staged partitions among ``partition_ids``; the incarnation of each one
        dropped (the units free that incarnation's cells only: a live partition of the same
        name, or one that is not being restored, is never touched)."""
        dropped = {}
        for pid in partition_ids:
            p = self.state.restoring.pop(pid, None)
            self.state.restoring_owed.pop(pid, None)
            if p is not None:
                self.state.unbind(p)
                dropped[pid] = p.incarnation
        return dropped

    # ---- stale rows --------------------------------------------------------------------------

    def take_recycled(self, max_rows: int, token: int = 0) -> dict[str, tuple[list[int], int]]:
        """Hand out up to ``max_rows`` recycled rows (each once), by partition, each
        partition's with the id of the hold its caller acknowledges once it read their
        prompts (`GetLeases.hold_taken`; 0: none, no task of the partition auto-clears).

        A ``token`` this answered before (one of the last `TAKEN_TOKENS`) gets the same
        rows again, those still there: its client asks again because the first reply was
        lost (with the controller)."""
        st = self.state
        if token and (before := st.taken.get(token)) is not None:
            return self._taken_again(before)
        taken: dict[str, list[int]] = {}
        n = 0
        while st.recycled and n < max_rows:
            pid, incarnation, row = st.recycled.popleft()
            p = st.partitions.get(pid)
            if p is None or p.incarnation != incarnation:
                continue  # its partition was cleared: nothing left to regenerate from
            self._leases.unhold_recycled(p, (row,))
            if not p.is_alive(row):
                continue  # cleared meanwhile
            taken.setdefault(pid, []).append(row)
            n += 1
        out = {
            pid: (rows, self._leases.hold_taken(st.partitions[pid], rows))
            for pid, rows in taken.items()
        }
        if token and out:
            parts = st.partitions
            st.taken[token] = [(pid, parts[pid].incarnation, r, i) for pid, (r, i) in out.items()]
            if len(st.taken) > TAKEN_TOKENS:
                del st.taken[next(iter(st.taken))]
        return out

    def _taken_again(
        self, before: list[tuple[str, str, list[int], int]]
    ) -> dict[str, tuple[list[int], int]]:
        """What a take handed out before, of the rows still there (and their hold, if its
        caller still has it)."""
        out = {}
        for pid, incarnation, rows, lease_id in before:
            p = self.state.partitions.get(pid)
            if p is None or p.incarnation != incarnation:
                continue
            alive = [r for r in rows if p.is_alive(r)]
            if alive:
                out[pid] = (alive, lease_id if lease_id in p.leases else 0)
        return out

    def recycled_pending(self) -> int:
        """How many rows the next `take_recycled` calls can hand out (not those cleared
        meanwhile, which they skip)."""
        return sum(1 for entry in self.state.recycled if self._recyclable(*entry))

    def _recyclable(self, partition_id: str, incarnation: str, row: int) -> bool:
        p = self.state.partitions.get(partition_id)
        return p is not None and p.incarnation == incarnation and p.is_alive(row)

    def return_recycled(
        self,
        partition_id: str,
        incarnation: str | None,
        rows: Sequence[int],
        lease_id: int = 0,
        token: int = 0,
    ) -> None:
        """Recycled rows handed out to a caller that had given up: first in the queue again
        (`take_recycled` skips them if they are gone meanwhile), held there instead of by
        the caller's hold ``lease_id``; the take's ``token`` no longer names them."""
        self.state.taken.pop(token, None)
        p = self.state.partitions.get(partition_id)
        if p is None or p.incarnation != incarnation:
            return  # cleared, or its partition was: nothing left to regenerate from
        back = [r for r in rows if 0 <= r < p.n_rows]
        self.state.recycled.extendleft((partition_id, p.incarnation, r) for r in reversed(back))
        self._leases.hold_recycled(p, back)
        if lease_id:
            self._leases.drop_taken(p, lease_id)

    def hold_recycled(self, p: Partition) -> None:
        """``p`` was rebuilt (a restart, a checkpoint restored): its rows queued for
        `take_recycled` are held again (`GetLeases.hold_recycled`)."""
        rows = [
            r
            for pid, inc, r in self.state.recycled
            if (pid, inc) == (p.partition_id, p.incarnation)
        ]
        self._leases.hold_recycled(p, rows)
