"""Host identities: which machine a storage unit or a client runs on.

Every unit and client carries a *host id*, a string equal for the processes of one machine
and different across machines. The controller prefers placing a producer's rows on a unit of
its host (see `tq_async._core._placement`), and units count the bytes they move for
clients of their own host and of others. A host id is a preference, never a correctness
input: an unknown or wrong one only makes data travel further.

Where it comes from, first found wins:

1. an explicit ``host_id=`` (``AsyncClient.connect``, ``ClientOptions``, ``tq.Config``,
   ``local_cluster``, ``tq-async serve storage --host-id``), for tests and unusual setups;
2. the environment variable ``TQ_HOST_ID``;
3. on Ray (a worker or driver connected to a cluster), the Ray node id;
4. the machine's: its boot id (``/proc/sys/kernel/random/boot_id``, new at every boot, the
   same in every container of one kernel) and its host name.
"""

from __future__ import annotations

import functools
import os
import socket
import sys

from .._errors import InvalidRequestError

__all__ = [
    "ENV_HOST_ID",
    "LOCALITY_KEYS",
    "locality_key",
    "machine_host_id",
    "resolve_host_id",
    "same_host",
]

#: the environment variable that overrides the host id of every unit and client of a process
ENV_HOST_ID = "TQ_HOST_ID"

_BOOT_ID = "/proc/sys/kernel/random/boot_id"

#: a storage unit's byte counters by direction and locality (``StoreStatsReply.locality``)
LOCALITY_KEYS = ("in_same_host", "in_other_host", "out_same_host", "out_other_host")


def resolve_host_id(explicit: str | None = None) -> str:
    """The host id of this process: ``explicit``, else ``$TQ_HOST_ID``, else the Ray node
    id (when Ray is imported and connected), else `machine_host_id`.

    Raises:
        InvalidRequestError: ``explicit`` is neither a string nor None (a storage unit
            announced it as it came: every client's hello then failed to decode).
    """
    if explicit is not None and not isinstance(explicit, str):
        raise InvalidRequestError(
            f"host_id must be a string (or None: this host's), got {type(explicit).__name__} "
            f"{explicit!r}"
        )
    if explicit:
        return explicit
    env = os.environ.get(ENV_HOST_ID)
    if env:
        return env
    return _ray_node_id() or machine_host_id()


@functools.cache
def machine_host_id() -> str:
    """This machine's id: ``"<hostname>/<boot id>"`` (the host name alone without a boot id)."""
    name = socket.gethostname()
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        return name
    return f"{name}/{boot}" if boot else name


def same_host(a: str, b: str) -> bool:
    """Whether two host ids name the same host (an empty id is unknown: never the same)."""
    return bool(a) and a == b


def locality_key(direction: str, unit_host: str, client_host: str) -> str:
    """The counter of bytes moved ``direction`` (``"in"``: put, ``"out"``: read) between a
    unit on ``unit_host`` and a client on ``client_host`` (unknown: another host)."""
    return f"{direction}_{'same' if same_host(unit_host, client_host) else 'other'}_host"


def _ray_node_id() -> str | None:
    """The Ray node id of this process, if it already imported Ray and is connected."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        if not ray.is_initialized():
            return None
        node = ray.get_runtime_context().get_node_id()
    except Exception:  # an old or partial Ray: fall back to the machine's id
        return None
    return f"ray:{node}" if node else None
