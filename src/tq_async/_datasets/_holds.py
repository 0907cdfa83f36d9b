"""The auto-clear holds of the streaming datasets, acknowledged once a batch is delivered.

An auto-clear task's fetch holds its rows until it is acknowledged, and `get` acknowledges
once it has read them (`AsyncClient.register_tasks`). The datasets read ahead of the caller
(prefetching, DataLoader workers), so their fetches keep the holds (``keep_hold``) and a
batch is acknowledged when its last micro-batch reaches the caller: a batch read ahead and
never delivered (the caller left, or its process died) keeps its rows for the next reader of
its ``batch_index`` (``docs/guarantees.md``, "What a dead or paused process does").

`Holds` is the dataset's: the holds of delivered batches, sent with its next fetch (``ack=``)
or at the end. `LoaderAcks` is a `StreamingDataLoader`'s, whose workers fetch and whose main
process delivers: it acknowledges what the loader handed out, over a client of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio

from .._client._sync._client import Client
from .._errors import TQError
from .._logging import get_logger
from .._meta import BatchMeta

__all__ = ["Holds", "LoaderAcks", "hold_of"]

log = get_logger(__name__)

#: seconds the acknowledgement of the delivered batches may take when the dataset is left
#: (shielded from cancellation), and a loader's acknowledgement
_ACK_TIMEOUT_S = 5.0


def hold_of(meta: BatchMeta) -> BatchMeta | None:
    """A `BatchMeta` of no rows naming the hold of ``meta``'s batch (what travels with a
    batch to whoever delivers it), or None when it has none."""
    if not meta.lease_id:
        return None
    return BatchMeta(
        partition_id=meta.partition_id,
        global_indexes=[],
        field_names=[],
        units=[],
        lease_id=meta.lease_id,
    )


class Holds:
    """The holds of the batches a dataset delivered, not acknowledged yet."""

    def __init__(self) -> None:
        self._pending: list[BatchMeta] = []

    def delivered(self, meta: BatchMeta) -> None:
        """Every micro-batch of ``meta``'s batch reached the caller."""
        if meta.lease_id:
            self._pending.append(meta)

    def fetch_args(self) -> dict[str, Any]:
        """What the default fetch passes to ``get``: keep the holds of what it reads, and
        acknowledge those delivered since the last fetch."""
        if self._pending:
            return {"keep_hold": True, "ack": list(self._pending)}
        return {"keep_hold": True}

    def sent(self, args: Mapping[str, Any]) -> None:
        """A fetch with ``args`` (`fetch_args`) was answered: its acknowledgements arrived."""
        metas = args.get("ack")
        if metas:
            done = {id(m) for m in metas}
            self._pending = [m for m in self._pending if id(m) not in done]

    async def flush(self, client: Any) -> None:
        """Acknowledge the pending holds now (no fetch follows to carry them)."""
        if self._pending and client is not None:
            metas = list(self._pending)
            await client.ack(metas)
            self.sent({"ack": metas})

    async def flush_on_leaving(self, client: Any, **context: Any) -> None:
        """`flush`, shielded and bounded; a failure is logged (the rows stay held)."""
        try:
            with anyio.move_on_after(_ACK_TIMEOUT_S, shield=True):
                await self.flush(client)
        except TQError as exc:
            log.warning("could not acknowledge the batches delivered", error=repr(exc), **context)


class LoaderAcks:
    """The holds of the batches a `StreamingDataLoader` handed out, acknowledged from its
    main process over a client of its own (opened when there is one to send)."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._client: Client | None = None
        self._pending: list[BatchMeta] = []

    def delivered(self, hold: BatchMeta | None) -> None:
        """Every micro-batch of the batch whose hold (`hold_of`) is ``hold`` was handed out."""
        if hold is not None:
            self._pending.append(hold)

    def send(self) -> None:
        """Acknowledge what was delivered (on failure the rows stay held: logged)."""
        if not self._pending:
            return
        metas, self._pending = self._pending, []
        try:
            if self._client is None:
                self._client = Client(self._address, request_timeout=_ACK_TIMEOUT_S).open()
            self._client.ack(metas)
        except TQError as exc:
            log.warning(
                "could not acknowledge the batches the loader delivered; their rows stay "
                "held until the partition is cleared",
                batches=len(metas),
                error=repr(exc),
            )

    def close(self) -> None:
        """`send`, then close the client."""
        try:
            self.send()
        finally:
            if self._client is not None:
                self._client.close()
                self._client = None
